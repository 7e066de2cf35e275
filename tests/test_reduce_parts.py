"""Leaf-by-leaf reduction of block codecs (``collectives.reduce_parts``) against the joined bucket.

``compressed_mean`` hands a block codec the bucket as one array per leaf and never joins
it: each leaf is encoded on its own (its noise drawn at its position in the bucket) and
each mean decoded from its own words. These tests pin that this is the same exchange as
encoding the joined bucket: the same payload words, the same means, and that the
full-size bucket really is never materialised in the compiled step.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat, bucket
from commjax.compressors.base import Segment
from commjax.collectives._reducers import _server_encode, get_reducer, reduce_parts
from commjax.testing import block_codecs, ready

N = 8
#: Leaf sizes that are not multiples of the block (padding inside each part) and whose
#: padded total is not a multiple of N blocks (the two-phase reducer pads the payload).
SIZES = (700, 256, 1500)
#: Codecs whose block scale is a sum (mean |x|, l2 norm): XLA may add a row in another
#: order when the array around it has another shape, so their scale may differ in the
#: last bit between a part and the joined bucket; every other codec is bit for bit.
SUM_SCALED = ("sign", "qsgd")


def _segments(comp, sizes=SIZES):
    segs, off = [], 0
    for n in sizes:
        padded = -(-n // comp.alignment) * comp.alignment
        segs.append(Segment(off, n, padded, (n,)))
        off += padded
    return segs


def _parts(rng, segs, lead=()):
    return [np.pad(rng.standard_normal(lead + (s.size,)).astype(np.float32),
                   [(0, 0)] * len(lead) + [(0, s.padded_size - s.size)]) for s in segs]


@pytest.mark.exact_codegen
@pytest.mark.parametrize("name", sorted(block_codecs()))
def test_part_payloads_joined_are_the_bucket_payload(name):
    comp = block_codecs()[name]
    segs = _segments(comp)
    parts = _parts(np.random.default_rng(0), segs)
    key = jax.random.PRNGKey(5)
    joined = np.asarray(comp.encode(jnp.asarray(np.concatenate(parts)), key))
    pieces = np.concatenate([np.asarray(comp.encode(jnp.asarray(p), key, start=s.offset))
                             for p, s in zip(parts, segs)])
    assert pieces.shape == joined.shape
    n = sum(s.padded_size for s in segs)
    if name in SUM_SCALED:
        a = np.asarray(comp.decode(jnp.asarray(pieces), n))
        b = np.asarray(comp.decode(jnp.asarray(joined), n))
        close = np.isclose(a, b, rtol=4e-7, atol=0)
        # qsgd's stochastic level may flip where q + u sits within an ulp of an integer.
        assert close.mean() > 1 - 1e-3, (name, close.mean())
    else:
        np.testing.assert_array_equal(pieces, joined)


@pytest.mark.exact_codegen
@pytest.mark.parametrize("reducer", ["allgather", "two_phase"])
@pytest.mark.parametrize("name", ["q4", "terngrad", "sign"])
def test_parts_reduction_equals_the_joined_reduction(mesh, name, reducer):
    comp = block_codecs()[name]
    segs = _segments(comp)
    parts = [jnp.asarray(p) for p in _parts(np.random.default_rng(1), segs, (N,))]
    n = sum(s.padded_size for s in segs)
    m = -(-n // (comp.alignment * N)) * comp.alignment * N
    server = jnp.zeros((N, m // N if reducer == "two_phase" else 0), jnp.float32)
    assert reducer == "allgather" or m > n  # the two-phase payload is padded here

    def both(ps, srv):
        ps = [p[0] for p in ps]
        key = jax.random.fold_in(jax.random.PRNGKey(2), jax.lax.axis_index("data"))
        kw = dict(axis_name="data", num_replicas=N, key=key,
                  server_residual=srv[0] if reducer == "two_phase" else None)
        red = get_reducer(reducer)
        a = reduce_parts(comp, red, ps, segs, **kw)
        whole = (Segment(0, n, n, (n,)),)
        b = reduce_parts(comp, red, [bucket.concat(ps)], whole, **kw)
        cut = lambda v: bucket.cut(v[0], segs)  # noqa: E731
        return (a.means, a.residuals, a.server_residual[None]), (cut(b.means), cut(b.residuals), b.server_residual[None])

    spec = ([P("data")] * len(parts), P("data"))
    f = jax.jit(_compat.shard_map(both, mesh=mesh, in_specs=spec,
                                  out_specs=(([P()] * 3, [P("data")] * 3, P("data")),) * 2,
                                  check_vma=False))
    (ma, la, sa), (mb, lb, sb) = ready(f(parts, server))
    for x, y, s in zip(ma, mb, segs):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == (s.size,)
        if name in SUM_SCALED:
            np.testing.assert_allclose(x, y, rtol=2e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(x, y)
    for x, y in zip(la, lb):
        if name in SUM_SCALED:
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if name not in SUM_SCALED:
        np.testing.assert_array_equal(np.asarray(sa), np.asarray(sb))


def test_the_joined_bucket_is_never_materialised(mesh):
    """The compiled sign step holds no float array as large as the compressed bucket:
    per-leaf encoding, per-leaf residuals and per-leaf decoding of the means."""
    params = {"a": jnp.zeros((96, 64)), "b": jnp.zeros((40, 100)), "c": jnp.zeros((64,))}
    tx = cj.compressed_mean(cj.sign(), "data")
    plan = cj.communication_plan(cj.sign(), params, N)
    total = plan.routing.compressed_size
    assert total == 96 * 64 + 40 * 100 + 96  # 4000 pads to 4096: 16 whole blocks
    state = cj.shard_state(tx.init(params), mesh, "data")
    specs = cj.state_specs(state, "data")
    grads = jax.tree_util.tree_map(lambda p: jnp.ones((N,) + p.shape), params)

    def step(g, s):
        u, s = tx.update(jax.tree_util.tree_map(lambda v: v[0], g), s)
        return u, s

    hlo = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P("data"), specs),
                                    out_specs=(P(), specs), check_vma=False)
                  ).lower(grads, state).compile().as_text()
    sizes = {int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
             for dims in re.findall(r"f32\[([\d,]*)\]", hlo)}
    assert max(sizes) < total, sorted(sizes)[-5:]


def _server_codecs():
    """The codecs whose owner re-encodes by feedback (for the others ``_server_encode``
    is encode, decode, subtract itself, and the comparison below could not fail)."""
    codecs = dict(block_codecs())
    codecs.update({"fp8": cj.fp8(), "q8_interpret": cj.quantize(8, kernels="interpret"),
                   "q4_interpret": cj.quantize(4, kernels="interpret"),
                   "fp8_interpret": cj.fp8(kernels="interpret")})
    return {k: c for k, c in codecs.items() if c.reencode_by_feedback}


@pytest.mark.parametrize("name", sorted(_server_codecs()))
def test_owner_reencode_is_encode_decode_subtract(name):
    """The two-phase owner re-encodes its chunk's mean with the codec's fused feedback
    (``encode_feedback``): the words and the new server residual are the bits of
    encoding ``y = mean + s``, decoding and subtracting, over magnitudes from 1e-30 to
    1e30 and with a bf16 server residual."""
    comp = _server_codecs()[name]
    n = 8 * comp.alignment
    rng = np.random.default_rng(3)
    mags = 10.0 ** rng.uniform(-30, 30, size=n // comp.alignment).repeat(comp.alignment)
    mine = jnp.asarray((rng.standard_normal(n) * mags).astype(np.float32))
    key = jax.random.PRNGKey(4)
    for dtype in (jnp.float32, jnp.bfloat16):
        srv = (mine * 1e-3 * jnp.asarray(rng.standard_normal(n), jnp.float32)).astype(dtype)
        words, new_srv, _ = jax.jit(lambda m, s: _server_encode(comp, m, key, s, True))(mine, srv)
        y = mine + srv.astype(jnp.float32)
        want_words, local = jax.jit(
            lambda v: comp.encode_and_decode(v, jax.random.fold_in(key, 0x5E7)))(y)
        np.testing.assert_array_equal(np.asarray(words), np.asarray(want_words))
        assert new_srv.dtype == dtype
        np.testing.assert_array_equal(np.asarray(new_srv), np.asarray((y - local).astype(dtype)))
