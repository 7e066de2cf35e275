"""Sparsifiers: top-k, random-k and threshold codecs, through compressed_mean on 8 replicas."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from commjax import _compat
from commjax.compressors.base import Compressor, Segment
from commjax.compressors.exact import identity
from commjax.collectives._common import GATHER_WORDS, gathered_width
from commjax.collectives._reducers import _encode_segmentwise
from commjax.compressors.sparse import (TWO_STAGE_MIN_WORK, exact_top_k, group_size, grouped_top_k, random_k,
                                        sorted_top_k, threshold, top_k, two_stage_top_k)
from commjax.layout import shard_state, state_specs
from commjax.plan import communication_plan
from commjax.testing import flat_residual, noniid_classification, train
from commjax.transform import compressed_mean

N = 8


def _segments(sizes):
    out, off = [], 0
    for s in sizes:
        out.append(Segment(off, s, s, (s,)))
        off += s
    return tuple(out), off


# Jitted codec calls: one compilation per case instead of one per primitive.
@functools.partial(jax.jit, static_argnums=(0, 3))
def _encdec(c, x, key, segs):
    return c.encode_and_decode(x, key, segs)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _roundtrip(c, x, key, segs):
    return c.decode(c.encode(x, key, segs), x.shape[0], segs)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _codec_all(c, x, key, segs):
    """(payload, decode(payload), local metrics[, positions, strata]) in one compilation."""
    words = c.encode(x, key, segs)
    out = (words, c.decode(words, x.shape[0], segs), c.local_metrics(x, segs))
    if c.name == "random_k":
        out += (c.encode_and_decode(x, key, segs)[1],) + c.positions(key, x.shape[0], segs)
    return out


def _expected_topk(x, k):
    """Indices of the k largest |x|, ties to the lower index (stable sort)."""
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


# ------------------------------------------------------------------------ construction


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), "0.1", None, True])
def test_bad_ratio_rejected_at_construction(bad):
    for factory in (top_k, random_k):
        with pytest.raises(ValueError, match=r"`ratio` must be .*\(0, 1\]"):
            factory(bad)


def test_bad_options_name_argument_and_allowed_values():
    with pytest.raises(ValueError, match=r"`chunk_size`.*\[1, 65536\].*uint16"):
        top_k(0.01, chunk_size=65537)
    with pytest.raises(ValueError, match=r"`chunk_size`"):
        top_k(0.01, chunk_size=0)
    with pytest.raises(ValueError, match=r"`scope` must be one of 'leaf', 'model'"):
        top_k(0.01, scope="layer")
    with pytest.raises(ValueError, match=r"`values_dtype` must be jnp.float32 or jnp.bfloat16"):
        top_k(0.01, values_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"`values_dtype`"):
        random_k(0.01, values_dtype=jnp.int8)
    with pytest.raises(ValueError, match=r"threshold: `capacity` must be an integer >= 1"):
        threshold(0.1, 0)
    with pytest.raises(ValueError, match=r"`capacity`"):
        threshold(0.1, 2.5)
    with pytest.raises(ValueError, match=r"threshold: `tau` must be a finite number > 0"):
        threshold(0.0, 10)
    with pytest.raises(ValueError, match=r"`tau`"):
        threshold(float("inf"), 10)
    # Edge values that are allowed.
    assert top_k(1.0, chunk_size=65536).chunk_size == 65536
    assert threshold(1e-3, 1).capacity == 1


# ---------------------------------------------------------------------------- top-k


def test_topk_selects_exactly_the_k_largest_magnitudes_ties_to_lower_index():
    # Many ties: magnitudes 3 at positions 1, 4, 6 (signs differ), 2 at 0, 7, 8.
    x = jnp.asarray([2.0, -3.0, 0.5, 1.0, 3.0, -0.5, -3.0, 2.0, -2.0, 1.0], jnp.float32)
    for k, want in [(1, [1]), (2, [1, 4]), (3, [1, 4, 6]), (4, [0, 1, 4, 6]), (5, [0, 1, 4, 6, 7])]:
        c = top_k(k / 10)
        y = np.asarray(c.roundtrip(x))
        got = np.flatnonzero(y)
        assert got.tolist() == want, (k, got)
        np.testing.assert_array_equal(y[got], np.asarray(x)[got])  # values exact, signs kept
    # Magnitude, not value: the most negative entry wins over smaller positives.
    assert np.flatnonzero(np.asarray(top_k(0.1).roundtrip(jnp.asarray([0.1] * 9 + [-5.0])))).tolist() == [9]


def test_approximate_top_k_keeps_k_large_entries():
    segs, n = _segments([3000, 500])
    x = jax.random.normal(jax.random.PRNGKey(3), (n,))
    c = top_k(0.02, approximate=True, recall_target=0.9)
    y = np.asarray(_roundtrip(c, x, None, segs))
    xn = np.asarray(x)
    for s, k in zip(segs, (60, 10)):
        part = y[s.offset:s.offset + s.size]
        sent = np.flatnonzero(part) + s.offset
        assert len(sent) == k  # exactly k per leaf, values exact
        np.testing.assert_array_equal(y[sent], xn[sent])
        true = set(_expected_topk(xn[s.offset:s.offset + s.size], k) + s.offset)
        assert len(true & set(sent)) >= 0.9 * k


def test_leaf_smaller_than_one_over_ratio_still_sends_one_entry():
    segs, n = _segments([3, 5000, 7])
    x = jax.random.normal(jax.random.PRNGKey(1), (n,))
    c = top_k(0.001)
    y = np.asarray(_roundtrip(c, x, None, segs))
    assert np.count_nonzero(y[:3]) == 1 and np.count_nonzero(y[-7:]) == 1
    assert np.count_nonzero(y[3:5003]) == 5  # ceil(0.001 * 5000)
    assert c.num_kept(n, segs) == 7
    rk = random_k(0.001)
    y = np.asarray(_encdec(rk, x, jax.random.PRNGKey(0), segs)[1])
    assert np.count_nonzero(y[:3]) == 1 and np.count_nonzero(y[-7:]) == 1


def test_scope_model_versus_leaf():
    segs, n = _segments([100, 100])
    # All the large entries are in the first leaf.
    x = jnp.concatenate([jnp.arange(1.0, 101.0), jnp.full((100,), 0.01)])
    leaf = np.asarray(_roundtrip(top_k(0.05), x, None, segs))
    model = top_k(0.05, scope="model")
    glob = np.asarray(_roundtrip(model, x, None, segs))
    assert np.count_nonzero(leaf[:100]) == 5 and np.count_nonzero(leaf[100:]) == 5
    assert np.flatnonzero(glob).tolist() == list(range(90, 100))  # top 10 of the whole vector


def test_topk_payload_sizes_and_bf16_uint16_halving():
    segs, n = _segments([4200, 4200])
    base = top_k(0.01)
    k = base.num_kept(n, segs)
    assert k == 2 * 42
    assert base.payload_bytes(n, segs) == 8 * k
    assert top_k(0.01, values_dtype=jnp.bfloat16).payload_bytes(n, segs) == 6 * k
    chunked = top_k(0.01, chunk_size=1400)  # k per chunk = 14, 3 chunks a leaf
    assert chunked.num_kept(n, segs) == 2 * 3 * 14
    assert chunked.payload_bytes(n, segs) == 6 * chunked.num_kept(n, segs)
    both = top_k(0.01, chunk_size=1400, values_dtype=jnp.bfloat16)
    assert both.payload_bytes(n, segs) == 4 * both.num_kept(n, segs)
    # An odd count of 16-bit halves is padded to a whole word.
    assert top_k(0.01, values_dtype=jnp.bfloat16).payload_words(4100) == 41 + 21  # k = 41


@st.composite
def _sparse_case(draw):
    sizes = draw(st.lists(st.integers(1, 200), min_size=1, max_size=3))
    ratio = draw(st.sampled_from([0.003, 0.01, 0.05, 0.2, 0.5, 1.0]))
    tied = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return sizes, ratio, tied, seed


def _data(sizes, tied, seed):
    segs, n = _segments(sizes)
    rng = np.random.default_rng(seed)
    if tied:  # small integers: many equal magnitudes, zeros included
        x = rng.integers(-3, 4, size=n).astype(np.float32)
    else:
        x = rng.standard_normal(n).astype(np.float32)
    return segs, n, x


@settings(max_examples=12, deadline=None)
@given(_sparse_case(), st.sampled_from([None, 1, 7, 64]), st.sampled_from(["float32", "bfloat16"]),
       st.sampled_from(["leaf", "model"]))
def test_topk_encode_decode_property(case, chunk, vdtype, scope):
    sizes, ratio, tied, seed = case
    segs, n, x = _data(sizes, tied, seed)
    c = top_k(ratio, chunk_size=chunk, values_dtype=jnp.dtype(vdtype), scope=scope)
    words, y, metrics = _codec_all(c, jnp.asarray(x), None, segs)
    assert words.dtype == jnp.uint32 and words.shape == (c.payload_words(n, segs),)
    y = np.asarray(y)
    domains = [(s.offset, s.size) for s in segs] if scope == "leaf" else [(0, n)]
    for off, size in domains:
        ch = size if chunk is None else min(chunk, size)
        k = min(ch, max(1, math.ceil(round(ratio * ch, 9))))
        for start in range(0, size, ch):
            xs = x[off + start: off + min(start + ch, size)]
            want = _expected_topk(xs, min(k, xs.shape[0])) + off + start
            expected = np.zeros(n, np.float32)
            expected[want] = x[want]
            if vdtype == "bfloat16":
                expected = expected.astype(jnp.bfloat16).astype(np.float32)
            seg = slice(off + start, off + min(start + ch, size))
            np.testing.assert_array_equal(y[seg], expected[seg])
    # The local density metric counts what was sent as non-zeros; so does the one read
    # from the payload (compressed_mean's), without the input.
    dens = float(metrics["density"])
    assert dens == pytest.approx(np.count_nonzero(y) / n, abs=1e-6)
    assert float(c.payload_metrics([(words, n, segs)], segs)["density"]) == pytest.approx(dens, abs=1e-6)


@settings(max_examples=10, deadline=None)
@given(_sparse_case(), st.booleans(), st.sampled_from(["float32", "bfloat16"]))
def test_random_k_encode_decode_property(case, rescale, vdtype):
    sizes, ratio, _, seed = case
    segs, n, x = _data(sizes, False, seed)
    c = random_k(ratio, rescale=rescale, values_dtype=jnp.dtype(vdtype))
    key = jax.random.PRNGKey(seed)
    words, y, _, local, pos, stratum = _codec_all(c, jnp.asarray(x), key, segs)
    assert words.dtype == jnp.uint32 and words.shape == (c.payload_words(n, segs),)
    y, pos, stratum = np.asarray(y), np.asarray(pos), np.asarray(stratum)
    np.testing.assert_array_equal(y, np.asarray(local))
    assert len(pos) == c.num_kept(n, segs)
    for s in segs:
        inside = pos[(pos >= s.offset) & (pos < s.offset + s.size)]
        k = min(s.size, max(1, math.ceil(round(ratio * s.size, 9))))
        assert len(inside) == k and len(np.unique(inside)) == k
    want = x[pos] * (stratum if rescale else 1.0)
    if vdtype == "bfloat16":
        want = want.astype(np.float32).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(y[pos], want.astype(np.float32))
    mask = np.zeros(n, bool)
    mask[pos] = True
    assert not np.any(y[~mask])


def test_random_k_rescaled_is_unbiased():
    segs, n = _segments([50, 37])
    x = jnp.asarray(np.random.default_rng(0).standard_normal(n), jnp.float32)
    c = random_k(0.1, rescale=True)
    keys = jax.random.split(jax.random.PRNGKey(0), 3000)
    both = jax.jit(jax.vmap(lambda k: (c.encode_and_decode(x, k, segs)[1],
                                       random_k(0.1).encode_and_decode(x, k, segs)[1])))
    est, plain = (np.asarray(a) for a in both(keys))
    mean = est.mean(0)
    se = est.std(0) / np.sqrt(len(keys))
    assert np.all(np.abs(mean - np.asarray(x)) < 5 * se + 1e-6)
    # Without rescaling the same estimator is shrunk by about the density.
    xn = np.asarray(x)
    ratio = float(np.sum(plain.mean(0) * xn) / np.sum(xn * xn))
    assert 0.08 < ratio < 0.13


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 400), st.floats(0.1, 2.5), st.integers(1, 60), st.integers(0, 2**16))
def test_threshold_property(n, tau, capacity, seed):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    c = threshold(tau, capacity)
    xj = jnp.asarray(x)
    words, y, m = _codec_all(c, xj, None, None)
    assert words.shape == (c.payload_words(n),)
    y = np.asarray(y)
    over = np.flatnonzero(np.abs(x) >= np.float32(tau))
    sent = np.flatnonzero(y)
    assert len(sent) == min(len(over), capacity)
    assert set(sent) <= set(over)
    if len(over) > capacity:  # the largest ones win
        assert np.min(np.abs(x[sent])) >= np.max(np.abs(np.delete(x, sent)))
    np.testing.assert_array_equal(y[sent], x[sent])
    assert float(m["dropped"]) == max(0, len(over) - capacity)
    assert float(m["density"]) == pytest.approx(len(sent) / n)


# ------------------------------------------------------------- through compressed_mean


def _step_fn(tx, mesh, state, check_vma=True):
    specs = state_specs(state, "data")

    def step(g, s):
        out, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s)
        return jax.tree_util.tree_map(lambda a: a[None], out), s

    return jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P("data"), specs),
                                     out_specs=(P("data"), specs), check_vma=check_vma))


def _run(tx, mesh, grads, steps, check_vma=True):
    """Apply tx to the same per-replica grads `steps` times; return (outs, states)."""
    params = jax.tree_util.tree_map(lambda a: a[0], grads)
    state = shard_state(tx.init(params), mesh, "data")
    f = _step_fn(tx, mesh, state, check_vma)
    g = jax.device_put(grads, NamedSharding(mesh, P("data")))
    outs, states = [], []
    for _ in range(steps):
        out, state = f(g, state)
        jax.block_until_ready(out)
        outs.append(jax.device_get(out))
        states.append(jax.device_get(state))
    return outs, states

def _leaf_segments(shapes):
    """Unpadded segments of leaves of ``shapes`` laid side by side, and their total size."""
    segs, off = [], 0
    for shp in shapes:
        size = math.prod(shp)
        segs.append(Segment(off, size, size, shp))
        off += size
    return segs, off



@pytest.mark.parametrize("codec", [top_k(0.05), top_k(0.05, values_dtype=jnp.bfloat16, chunk_size=64),
                                   top_k(0.3, scope="model"), threshold(0.5, 40), threshold(0.5, 2000)],
                         ids=["top_k", "top_k_bf16_chunked", "top_k_model", "threshold", "threshold_padded"])
def test_encode_residual_is_y_minus_its_decode(codec):
    """The in-place residual of a sparse codec (sent values subtracted at their positions)
    is ``y - decode(encode(y))`` bit for bit, with the same payload: zeros of either sign,
    huge and tiny magnitudes, bf16 rounding of the sent values, padding slots (a capacity
    above the number of entries over ``tau``), a leaf smaller than a chunk."""
    shapes = [(37, 11), (300,), (3,)]
    segs, off = _leaf_segments(shapes)
    rng = np.random.default_rng(3)
    y = rng.standard_normal(off).astype(np.float32) * np.exp2(rng.integers(-60, 60, off)).astype(np.float32)
    y[rng.integers(0, off, 30)] = -0.0
    y[rng.integers(0, off, 30)] = 0.0
    words, res = jax.jit(lambda v: codec.encode_residual(v, None, segs))(jnp.asarray(y))
    words_ref, local = _encdec(codec, jnp.asarray(y), None, tuple(segs))
    np.testing.assert_array_equal(np.asarray(words), np.asarray(words_ref))
    ref = np.asarray(jnp.asarray(y) - local)
    np.testing.assert_array_equal(np.asarray(res).view(np.uint32), ref.view(np.uint32))
    assert np.count_nonzero(ref != y) > 0  # something was sent and subtracted


@pytest.mark.parametrize("codec", [top_k(0.05), top_k(0.05, values_dtype=jnp.bfloat16, chunk_size=64),
                                   threshold(0.5, 40)], ids=["top_k", "top_k_bf16_chunked", "threshold"])
@pytest.mark.parametrize("divide", [1, 5])
def test_decode_sum_is_the_dense_sum_bit_for_bit(codec, divide):
    """The sparse sum of ``N`` payloads (one buffer, each replica's entries scatter-added in
    replica order) equals the dense sum of their decodings in replica order, bit for bit:
    shared positions, padding slots, zeros of either sign, a leaf smaller than a chunk."""
    n_rep, shapes = 5, [(37, 11), (0,), (300,), (3,)]
    segs, off = _leaf_segments(shapes)
    rng = np.random.default_rng(divide)
    base = rng.standard_normal(off).astype(np.float32)
    xs = []
    for r in range(n_rep):  # overlapping supports: shared large entries, own ones, zeros
        x = base * (rng.random(off) < 0.5) + rng.standard_normal(off).astype(np.float32) * 0.1 * r
        x[rng.integers(0, off, 20)] = -0.0
        xs.append(x)
    payloads = jnp.stack([codec.encode(jnp.asarray(x), None, segs) for x in xs])
    got = jax.jit(lambda p: codec.decode_sum(p, off, segs, divide=divide))(payloads)
    dense = jax.jit(lambda p: Compressor.decode_sum(codec, p, off, segs, divide=divide))(payloads)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(dense).view(np.uint32))
    assert np.count_nonzero(np.asarray(got)) > 0
    if getattr(codec, "scope", None) == "leaf":  # the per-leaf sums the all-gather reducer takes
        leaves = jax.jit(lambda p: codec.decode_sum_leaves(p, segs, divide=divide))(payloads)
        for s, leaf in zip(segs, leaves):
            np.testing.assert_array_equal(np.asarray(leaf).view(np.uint32),
                                          np.asarray(dense)[s.offset:s.offset + s.size].view(np.uint32))


def test_random_k_masks_identical_on_replicas_and_new_each_step(mesh):
    rng = np.random.default_rng(0)
    grads = {"w": jnp.asarray(rng.uniform(1.0, 2.0, (N, 40, 50)), jnp.float32)}  # no zeros
    tx = compressed_mean(random_k(0.05), "data", min_compress_size=16)
    outs, states = _run(tx, mesh, grads, 3)
    k = 100
    masks = []
    for t in range(3):
        res = flat_residual(states[t], N)
        # Sent entries leave the residual exactly 0; everything else is kept.
        sent = res == 0
        assert np.all(sent == sent[:1]), "replicas chose different positions"
        assert sent[0].sum() == k
        mean = outs[t]["w"].reshape(N, -1)
        assert np.all(mean == mean[:1])  # identical on every replica
        np.testing.assert_array_equal(mean[0] != 0, sent[0])
        masks.append(sent[0])
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    # Step 1: the mean at the sent positions is the replicas' exact mean there.
    g = np.asarray(grads["w"]).reshape(N, -1)
    np.testing.assert_allclose(outs[0]["w"].reshape(N, -1)[0][masks[0]], g.mean(0)[masks[0]], rtol=1e-6)
    assert np.all(np.asarray(states[0].metrics["density"]) == np.float32(k / 2000))


@pytest.mark.parametrize("reducer", ["allgather", "two_phase"])
def test_density_counts_the_entries_each_replica_sent(mesh, reducer):
    """compressed_mean's top-k ``density`` (read from the payloads) is the fraction of
    entries this replica sent: those its residual holds as exact zeros (Gaussian data has
    none of its own). The two-phase reducer selects per destination chunk: more than the
    bucket-wide k (its per-chunk counts are rounded up), still counted as sent."""
    rng = np.random.default_rng(3)
    grads = {"a": jnp.asarray(rng.standard_normal((N, 40, 50)), jnp.float32),
             "b": jnp.asarray(rng.standard_normal((N, 10, 30)), jnp.float32)}
    tx = compressed_mean(top_k(0.03), "data", reducer=reducer, min_compress_size=16)
    _, states = _run(tx, mesh, grads, 1)
    res = flat_residual(states[0], N)
    sent = (res == 0).sum(1)
    if reducer == "allgather":  # k per leaf: ceil(0.03 * 2000) + ceil(0.03 * 300)
        assert np.all(sent == 60 + 9)
    else:  # k per chunk of the 2,300 joined values cut into N: 8 * ceil(0.03 * 288)
        assert np.all(sent == 8 * 9)
    np.testing.assert_allclose(np.asarray(states[0].metrics["density"]).reshape(N), sent / res.shape[1], rtol=1e-6)


@pytest.mark.parametrize("reducer,scope", [("allgather", "leaf"), ("allgather", "model"), ("two_phase", "leaf")])
def test_a_non_finite_leaf_leaves_the_others_means_as_a_zero_leaf_would(mesh, reducer, scope):
    """-inf in one replica's ``b``: ``b``'s mean is NaN on every replica, and ``a``'s is what
    it is when that replica's ``b`` is zero. With per-leaf selection through the all-gather
    it is encoded as it is (each leaf selects on its own, ``TopK.leaf_local``); where a
    selection spans leaves (``scope="model"``, the two-phase reducer's destination chunks)
    it is zeroed first, else its infinities would take the others' places."""
    rng = np.random.default_rng(5)
    grads = {"a": jnp.asarray(rng.standard_normal((N, 40, 50)), jnp.float32),
             "b": jnp.asarray(rng.standard_normal((N, 10, 30)) * 100, jnp.float32)}
    tx = compressed_mean(top_k(0.05, scope=scope), "data", reducer=reducer, min_compress_size=16)
    bad = dict(grads, b=grads["b"].at[2, 3, 4].set(-jnp.inf))
    zero = dict(grads, b=grads["b"].at[2].set(0.0))
    (out_bad,), _ = _run(tx, mesh, bad, 1)
    (out_zero,), _ = _run(tx, mesh, zero, 1)
    assert np.all(np.isnan(np.asarray(out_bad["b"])))
    np.testing.assert_array_equal(np.asarray(out_bad["a"]), np.asarray(out_zero["a"]))


@pytest.mark.parametrize("comp", [top_k(0.02, chunk_size=256, values_dtype=jnp.bfloat16), threshold(1.5, 40)],
                         ids=["topk_chunk_bf16", "threshold"])
def test_allgather_mean_is_sum_of_replicas_sparse_payloads(mesh, comp):
    rng = np.random.default_rng(1)
    grads = {"a": jnp.asarray(rng.standard_normal((N, 32, 64)), jnp.float32),
             "b": jnp.asarray(rng.standard_normal((N, 48, 16)), jnp.float32)}
    tx = compressed_mean(comp, "data", min_compress_size=16)
    outs, states = _run(tx, mesh, grads, 1)
    plan = communication_plan(comp, jax.tree_util.tree_map(lambda a: a[0], grads), N, min_compress_size=16)
    assert plan.routing.reducer == "allgather"
    flat = np.concatenate([np.asarray(grads[k]).reshape(N, -1) for k in ("a", "b")], axis=1)
    local = np.stack([np.asarray(_roundtrip(comp, jnp.asarray(flat[r]), None, plan.routing.segments)) for r in range(N)])
    want = local.mean(0)
    got = np.concatenate([outs[0][k].reshape(N, -1) for k in ("a", "b")], axis=1)
    assert np.all(got == got[:1])
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-7)
    # Error feedback kept exactly what was not sent.
    np.testing.assert_allclose(flat_residual(states[0], N), flat - local, atol=1e-7)
    if comp.name == "threshold":
        dropped = np.asarray(states[0].metrics["dropped"]).reshape(N)
        over = (np.abs(flat) >= 1.5).sum(1)
        np.testing.assert_array_equal(dropped, np.maximum(over - 40, 0))
        assert np.any(dropped > 0)
        np.testing.assert_allclose(np.asarray(states[0].metrics["density"]).reshape(N),
                                   np.minimum(over, 40) / flat.shape[1], rtol=1e-6)


def test_one_replica_without_collectives():
    x = {"w": jax.random.normal(jax.random.PRNGKey(0), (30, 40))}
    for comp in (top_k(0.1), random_k(0.1), threshold(1.0, 50)):
        tx = compressed_mean(comp, None, min_compress_size=16)
        s = tx.init(x)
        out, s = jax.jit(tx.update)(x, s)
        y = np.asarray(out["w"]).ravel()
        assert 1 <= np.count_nonzero(y) <= 120
        np.testing.assert_allclose(y + flat_residual(s)[0], np.asarray(x["w"]).ravel(), atol=1e-6)


# ---------------------------------------------------------------------- bytes
# The compiled step sends the plan, in uint32 words, for every codec and variant (and a
# NaN on one replica is flagged, the residual kept): tests/test_contract.py.

FOUR_M = {f"w{i}": jax.ShapeDtypeStruct((1024, 1024), jnp.float32) for i in range(4)}


@pytest.mark.parametrize("comp,min_ratio", [(top_k(0.01), 10.0), (random_k(0.01), 50.0)],
                         ids=["top_k", "random_k"])
def test_bytes_4m_model_against_exact_mean(comp, min_ratio):
    plan = communication_plan(comp, FOUR_M, N)
    assert plan.routing.num_float_elements == 4 * 2**20
    assert plan.compression_ratio >= min_ratio, plan.table()
    k = comp.num_kept(plan.routing.compressed_size, plan.routing.segments)
    assert k == 4 * math.ceil(0.01 * 2**20)
    if comp.name == "random_k":  # only the k fp32 values travel (no indices), in one all-reduce
        assert plan.routing.compressed_bytes == pytest.approx(2 * (N - 1) / N * 4 * k)
        assert plan.routing.reducer == "shared_mask"
    else:
        # k values and k indices, the row padded to whole 128-word TPU lane tiles
        words = gathered_width(2 * k, N)
        assert words == -(-2 * k // GATHER_WORDS) * GATHER_WORDS
        assert plan.routing.compressed_bytes == pytest.approx((N - 1) * 4 * words)


@pytest.mark.parametrize("replicas,reducer,min_ratio", [(8, "allgather", 12.0), (10, "allgather", 9.5),
                                                        (11, "two_phase", 19.0), (64, "two_phase", 19.0)])
def test_auto_reducer_for_top_k_by_bytes_at_the_replica_count(replicas, reducer, min_ratio):
    """``reducer="auto"``: the all-gather, whose bytes grow with the replicas, until
    two-phase sends at most half of them (the margin for the owner's second selection);
    at 64 replicas the all-gather would send only 1.6x fewer bytes than the exact mean."""
    plan = communication_plan(top_k(0.01), FOUR_M, replicas)
    assert plan.routing.reducer == reducer and plan.compression_ratio >= min_ratio, plan.table()
    both = {r: communication_plan(top_k(0.01), FOUR_M, replicas, reducer=r).bytes_per_step
            for r in ("allgather", "two_phase")}
    assert (both["two_phase"] * 2 < both["allgather"]) == (reducer == "two_phase")
    if replicas == 64:
        assert communication_plan(top_k(0.01), FOUR_M, 64, reducer="allgather").compression_ratio < 1.6


def test_bf16_random_k_sends_half_the_bytes():
    comp = random_k(0.01, values_dtype=jnp.bfloat16)
    plan = communication_plan(comp, {"w0": jnp.zeros((256, 512)), "w1": jnp.zeros((300, 70))}, N,
                              min_compress_size=256)
    k = comp.num_kept(plan.routing.compressed_size, plan.routing.segments)
    assert plan.routing.compressed_bytes <= 2 * (N - 1) / N * 2 * (k + 2 * N)


# ---------------------------------------------------------------------- convergence

STEPS, LR, MOMENTUM, MIN_COMPRESS = 100, 0.3, 0.5, 256


def test_topk_error_feedback_converges_near_exact_mean():
    task = noniid_classification(N)

    def run(comp, ef=True):
        tx = optax.chain(compressed_mean(comp, "data", error_feedback=ef, min_compress_size=MIN_COMPRESS),
                         optax.sgd(LR, momentum=MOMENTUM))
        return train(tx, task, STEPS, log_every=STEPS)

    plan = communication_plan(top_k(0.01), task.params, N, min_compress_size=MIN_COMPRESS)
    assert plan.routing.num_compressed == 3  # every weight matrix of the MLP is sparsified
    exact, ef, noef = run(identity()), run(top_k(0.01)), run(top_k(0.01), ef=False)
    for r in (exact, ef, noef):
        assert r.replicas_identical
        assert np.all(np.isfinite(r.losses))
    gap = (ef.final_loss - exact.final_loss) / exact.final_loss
    assert gap < 0.20, (ef.final_loss, exact.final_loss)
    assert ef.final_loss < noef.final_loss - 0.1
    assert ef.final_loss < task.global_loss(task.params) - 0.5  # it did learn


@pytest.mark.parametrize("kind", ["normal", "hot_rows", "ties"])
def test_two_stage_top_k_is_lax_top_k(kind):
    """The two-stage selection of long domains returns exactly lax.top_k's positions, in its
    order, including when one sub-row holds more than its candidates (the fallback) and
    among ties (the lower position first)."""
    rng = np.random.default_rng(3)
    v = np.abs(rng.standard_normal((2, 300_001))).astype(np.float32)
    if kind == "hot_rows":
        v[:, 5000:9000] *= 100.0  # 4000 of the top 3000 in four sub-rows
    if kind == "ties":
        v = np.round(v * 4)
    got = np.asarray(jax.jit(two_stage_top_k, static_argnums=1)(jnp.asarray(v), 3001))
    want = np.asarray(jax.lax.top_k(jnp.asarray(v), 3001)[1])
    np.testing.assert_array_equal(got, want)
    # exact_top_k takes one lax.top_k at this size (3001 * 300001 < TWO_STAGE_MIN_WORK).
    assert 3001 * v.shape[1] < TWO_STAGE_MIN_WORK
    np.testing.assert_array_equal(np.asarray(jax.jit(exact_top_k, static_argnums=1)(jnp.asarray(v), 3001)), want)


def _special(v: np.ndarray, kind: str) -> np.ndarray:
    """``v`` with ties (``"ties"``) or NaN of both signs, zeros of both signs and
    infinities (``"nan"``) put in; other kinds as it is."""
    if kind == "ties":
        v = np.round(v * 2)
    if kind == "nan":
        v[:, ::997] = np.nan
        v[:, 3::1999] = -np.nan
        v[:, 1::5] = 0.0
        v[:, 2::7] = -0.0
        v[:, 4::11] = np.inf
    return v


@pytest.mark.parametrize("kind", ["normal", "ties", "nan"])
def test_sorted_top_k_is_lax_top_k(kind):
    """The selection a TPU compiles (a stable sort) returns lax.top_k's positions in its
    order: among ties the lower position first, NaN above every number, zeros last."""
    rng = np.random.default_rng(4)
    v = np.abs(rng.standard_normal((3, 262_144))).astype(np.float32)
    v = _special(v, kind)
    for k in (1, 2621, 4096):
        want = np.asarray(jax.lax.top_k(jnp.asarray(v), k)[1])
        got = np.asarray(jax.jit(sorted_top_k, static_argnums=1)(jnp.asarray(v), k))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["normal", "ties", "nan", "hot_tail", "mostly_zero"])
def test_grouped_top_k_is_lax_top_k(kind):
    """The selection accelerators compile (the k best groups of L, then the k best of their
    elements) returns lax.top_k's positions in its order: ties at the k-th value split
    between groups (the lower positions chosen), NaN and -0.0, a shorter last group, the
    chosen all in the last groups, more zeros than k."""
    rng = np.random.default_rng(5)
    v = rng.standard_normal((2, 100_003)).astype(np.float32)
    v = _special(v, kind)
    if kind == "hot_tail":
        v[:, -5000:] *= 100.0
    if kind == "mostly_zero":
        v[:, 50:] = 0.0
        v[:, 70_000:70_010] = -0.0
    select = jax.jit(grouped_top_k, static_argnums=(1, 2), static_argnames=("of_abs", "lanes"))
    cases = [(1, None, 1), (1000, None, 1), (1000, 8, 1), (1000, 100, 1), (5000, 3, 1), (12_500, 8, 1),
             (20, 5000, 1), (1000, None, 128), (1000, 8, 128), (777, 2, 128), (1, 4, 128), (12_000, 8, 16)]
    for k, group, lanes in cases:
        for of_abs in (False, True):
            want = np.asarray(jax.lax.top_k(jnp.abs(v) if of_abs else jnp.asarray(v), k)[1])
            got = np.asarray(select(jnp.asarray(v), k, group, of_abs=of_abs, lanes=lanes))
            np.testing.assert_array_equal(got, want, err_msg=f"k={k} group={group} lanes={lanes} of_abs={of_abs}")
    assert group_size(100_003, 1000) == 8 and group_size(100_003, 30_000) == 1
    assert group_size(200, 50) == 2 and group_size(200, 50, lanes=128) == 1  # no whole block of 2 x 128


def test_segmentwise_top_k_is_the_joined_encoding():
    """The all-gather reducer encodes top-k (per leaf) a leaf at a time: the same words as
    the joined bucket's payload and the same residuals, bit for bit; with a leaf flagged
    to keep its residual, that leaf's old residual exactly (its part non-finite, as on a
    flagged step), finite words, and the others unchanged."""
    shapes = [(37, 11), (300,), (3,), (0,), (2000,)]
    segs, off = _leaf_segments(shapes)
    rng = np.random.default_rng(6)
    parts = [jnp.asarray(rng.standard_normal(s.size).astype(np.float32)) for s in segs]
    olds = [jnp.asarray(rng.standard_normal(s.size).astype(np.float32)) for s in segs]
    olds[1] = olds[1].at[:7].set(-0.0)
    for codec in (top_k(0.05), top_k(0.05, values_dtype=jnp.bfloat16, chunk_size=64)):
        # Jitted: op by op, every eager operation would be a compile of its own.
        encode = jax.jit(lambda y, codec=codec: codec.encode_residual(y, None, segs))
        segmentwise = jax.jit(lambda p, o, k, codec=codec: _encode_segmentwise(codec, p, segs, o, None, k))
        y = jnp.concatenate([p + r for p, r in zip(parts, olds)])
        words_ref, res_ref = encode(y)
        keep = [jnp.asarray(False)] * len(segs)
        words, outs = segmentwise(parts, olds, keep)
        np.testing.assert_array_equal(np.asarray(words), np.asarray(words_ref))
        for o, s in zip(outs, segs):
            np.testing.assert_array_equal(np.asarray(o).view(np.uint32),
                                          np.asarray(res_ref[s.offset:s.offset + s.size]).view(np.uint32))
        keep[1] = jnp.asarray(True)
        bad = list(parts)
        bad[1] = parts[1].at[3].set(jnp.nan).at[5].set(jnp.inf)
        sent, kept = segmentwise(bad, olds, keep)
        np.testing.assert_array_equal(np.asarray(kept[1]).view(np.uint32), np.asarray(olds[1]).view(np.uint32))
        assert np.all(np.isfinite(np.asarray(codec.decode(sent, sum(s.padded_size for s in segs), segs))))
        for i in (0, 2, 4):
            np.testing.assert_array_equal(np.asarray(kept[i]), np.asarray(outs[i]))
