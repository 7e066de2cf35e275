"""Bytes on the wire of each codec and reducer, from the plan (equal to the compiled HLO's:
tests/test_contract.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax import collectives as cc
from commjax.collectives._common import (
    GATHER_WORDS, SHARD_PAD_MIN, SHARD_TILE, _pad_chunks, gathered_width, join_rows, scatter_width, shard_width,
)
from commjax.testing import mlp_4m_params, update_collectives

PARAMS = mlp_4m_params()

# compressor, minimum ratio against the exact fp32 mean (per device, 8 replicas)
TARGETS = {
    "cast": (cj.cast(), 1.9),
    "q8": (cj.quantize(8), 3.5),
    "q4": (cj.quantize(4), 6.5),
    "q2": (cj.quantize(2), 12.0),
    "terngrad": (cj.terngrad(), 12.0),
    "sign": (cj.sign(), 20.0),
    "qsgd": (cj.qsgd(), 4.0),
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_codec_meets_its_ratio(name):
    """Per device on 8 replicas, against the exact fp32 mean of the same tree (the compiled
    step sends the plan, in uint32 words: tests/test_contract.py)."""
    comp, target = TARGETS[name]
    plan = cj.communication_plan(comp, PARAMS, 8)
    assert plan.compression_ratio >= target, f"{name}: {plan.compression_ratio:.2f}x < {target}x"


def _bytes(comp, reducer, n_rep):
    return cj.communication_plan(comp, PARAMS, n_rep, reducer=reducer).bytes_per_step


def test_two_phase_bytes_flat_in_replicas_allgather_grows():
    comp = cj.quantize(4)
    tp2, tp8 = _bytes(comp, "two_phase", 2), _bytes(comp, "two_phase", 8)
    ag2, ag8 = _bytes(comp, "allgather", 2), _bytes(comp, "allgather", 8)
    assert tp8 / tp2 <= 2.0  # only the ring factor 2(N-1)/N grows
    assert ag8 / ag2 >= 6.0  # (N-1) * payload
    assert tp8 < ag8


def test_auto_picks_the_cheapest_valid_reducer():
    for comp, _ in TARGETS.values():
        for n in (2, 4, 8):
            plan = cj.communication_plan(comp, PARAMS, n)
            for r in ("allreduce", "allgather", "two_phase"):
                try:
                    other = cj.communication_plan(comp, PARAMS, n, reducer=r)
                except ValueError:
                    continue
                assert plan.bytes_per_step <= other.bytes_per_step + 1e-6
    assert cj.communication_plan(cj.identity(), PARAMS, 8).routing.reducer == "allreduce"
    assert cj.communication_plan(cj.quantize(4), PARAMS, 8).routing.reducer == "two_phase"


def test_exact_mean_is_one_all_reduce_of_the_leaves_themselves():
    """The identity keeps no residual and sends every leaf, uncopied, as an operand of the
    exact bucket's all-reduce: one collective in all."""
    tx = cj.compressed_mean(cj.identity(), "data")
    assert tx.init(jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape), PARAMS)).residual == ()
    rep = update_collectives(tx, PARAMS, 8)
    assert len(rep.collectives) == 1 and rep.collectives[0].kind == "all-reduce", rep.table()
    # The exact bucket (the biases) and each of the four weight matrices.
    assert rep.collectives[0].dtypes == ("f32",) * 5
    # No NaN flag rides along (each mean tells): exactly what lax.pmean of each leaf sends.
    n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(PARAMS))
    assert rep.total_ring_bytes == cj.ring_bytes("all-reduce", 4 * n, 8)
    assert cj.communication_plan(tx, PARAMS, 8).bytes_per_step == rep.total_ring_bytes


@pytest.mark.parametrize("reducer", ["allgather", "two_phase"])
def test_gathered_rows_travel_in_whole_lane_tiles(reducer):
    """A payload row of 2,470 words (int8, 38 blocks of 65 words) is gathered padded to
    20 tiles of 128 words, so that a TPU runs an all-gather, not a zero-padded all-reduce of
    twice the bytes; the compiled all-gather sends exactly what the plan counts. Rows
    under 16 tiles, and rows whose gather would exceed 8 MB, travel as they are."""
    assert [gathered_width(w, 8) for w in (5, 2047, 2048, 2049, 2470)] == [5, 2047, 2048, 2176, 2560]
    assert gathered_width(2470, 1024) == 2470  # 10 MB of gathered rows: not padded
    n = 8
    rows = {"allgather": 38, "two_phase": 38 * n}[reducer]  # blocks: one row per replica's chunk
    params = {"w": jax.ShapeDtypeStruct((rows, 256), jnp.float32)}
    tx = cj.compressed_mean(cj.quantize(8, stochastic=False), "data", reducer=reducer)
    rep = update_collectives(tx, params, n)
    gathers = [c for c in rep.collectives if c.kind == "all-gather"]
    assert len(gathers) == 1, rep.table()
    assert gathers[0].ring_bytes == (n - 1) * 4 * 2560 == 20 * GATHER_WORDS * 4 * (n - 1)
    plan = cj.communication_plan(tx, params, n)
    assert rep.total_ring_bytes == pytest.approx(plan.compiled_bytes, abs=0.5), f"{rep.table()}\n{plan}"


def test_padded_gather_decodes_the_mean_of_the_codes(mesh):
    """Through the padded all-gather every replica gets the mean of the 8 replicas' decoded
    codes (a deterministic codec: computed here replica by replica), identical everywhere."""
    codec = cj.quantize(8, stochastic=False)
    g = jax.random.normal(jax.random.PRNGKey(3), (8, 38, 256)) * jnp.logspace(-3, 3, 38)[:, None]
    tx = cj.compressed_mean(codec, "data", reducer="allgather")
    state = cj.init_sharded(tx, {"w": g[0]}, mesh, "data")
    specs = cj.state_specs(state, "data")
    f = jax.jit(_compat.shard_map(lambda x, s: tx.update({"w": x[0]}, s)[0]["w"][None], mesh=mesh,
                                  in_specs=(P("data"), specs), out_specs=P("data")))
    out = np.asarray(f(jax.device_put(g, NamedSharding(mesh, P("data"))), state))
    codes = [np.asarray(codec.decode(codec.encode(x.reshape(-1), None), x.size)) for x in g]
    np.testing.assert_allclose(out[0].reshape(-1), np.mean(codes, 0), rtol=1e-6, atol=0)
    assert all(np.array_equal(r, out[0]) for r in out)


def test_shard_widths_are_whole_tiles_of_the_reduce_scatter_shape():
    """A replica's chunk of a sharded collective is padded to whole 1,024-element tiles from
    16,384 elements on; an exact 1-D reduce-scatter's to ``2^k q`` tiles (``k >= 1``,
    ``q <= 127``), the shapes a v5e keeps as a reduce-scatter. At most 1/16 (1/8) more;
    padding a padded chunk changes nothing."""
    assert [shard_width(e) for e in (5, 16383, 16384, 16385, 20001)] == [5, 16383, 16384, 17408, 20480]
    assert scatter_width(17 * SHARD_TILE) == 18 * SHARD_TILE
    assert scatter_width(2568 * SHARD_TILE) == 2592 * SHARD_TILE
    for e in list(range(SHARD_PAD_MIN - 3, SHARD_PAD_MIN + 3000, 7)) + [10 ** k + 1 for k in range(5, 10)]:
        for width, most in ((shard_width, 17 / 16), (scatter_width, 9 / 8)):
            w = width(e)
            assert e <= w <= e * most and width(w) == w, (e, w)
        if e < SHARD_PAD_MIN:
            assert scatter_width(e) == e
            continue
        tiles, rest = divmod(scatter_width(e), SHARD_TILE)
        odd = tiles // (tiles & -tiles)
        assert not rest and tiles % 2 == 0 and odd <= 127, (e, tiles)


@pytest.mark.parametrize("chunk", [17 * SHARD_TILE, 17 * SHARD_TILE + 5])
def test_chunks_padded_flat_are_the_padded_rows(chunk):
    """The TPU's padding of a reduce-scatter's chunks (``_common._pad_chunks``, flat, in
    the vector's own layout) is the rows every other backend pads (``join_rows``)."""
    n = 4
    v = jnp.arange(n * chunk, dtype=jnp.float32) + 1
    w = scatter_width(chunk)
    assert w > chunk
    rows = join_rows([v.reshape(n, chunk)], scatter_width)
    np.testing.assert_array_equal(np.asarray(_pad_chunks(v, n, w)), np.asarray(rows.reshape(-1)))


@pytest.mark.parametrize("codec", [None, cj.quantize(8, stochastic=False)], ids=["exact", "int8"])
def test_padded_sharded_collectives_send_the_plan_and_the_same_values(mesh, codec):
    """A 1-D reduce-scatter and all-gather of 66,816-element chunks travel padded (exact:
    ``scatter_width``/``shard_width``; int8: payload rows padded to whole tiles): the
    compiled HLO sends what the plan counts, and the values are those of ``lax``'s own
    collectives (exact) or of the codec's decode (int8), on every replica."""
    n, s = 8, 261 * 256  # chunks of 66 tiles padded; int8 rows of 16,965 words padded
    x = jax.random.randint(jax.random.PRNGKey(0), (n, n * s), -1000, 1000).astype(jnp.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))

    def step(v):
        mine = cc.reduce_scatter(v[0], "data", codec)
        return mine[None], cc.all_gather(mine, "data", codec)[None]

    fn = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data")),
                                   check_vma=False))
    rep = cj.collective_bytes(fn, xs)
    want = (cj.communication_plan(cc.reduce_scatter, jax.ShapeDtypeStruct((n * s,), jnp.float32), n,
                                  codec=codec).compiled_bytes
            + cj.communication_plan(cc.all_gather, jax.ShapeDtypeStruct((s,), jnp.float32), n,
                                    codec=codec).compiled_bytes)
    assert rep.total_ring_bytes == pytest.approx(want, abs=0.5), rep.table()
    if codec is None:
        assert {c.kind for c in rep.collectives} == {"reduce-scatter", "all-gather"}, rep.table()
    mine, full = (np.asarray(a) for a in fn(xs))
    total = np.asarray(x).sum(0).reshape(n, s)
    if codec is None:
        np.testing.assert_array_equal(mine, total)
        np.testing.assert_array_equal(full, np.broadcast_to(total.reshape(-1), (n, n * s)))
    else:
        np.testing.assert_allclose(mine, total, rtol=0.02, atol=0.02 * np.abs(total).max())
        decoded = np.concatenate([np.asarray(codec.decode(codec.encode(jnp.asarray(m), None), s)) for m in mine])
        assert all(np.array_equal(r, decoded) for r in full)


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.int8, jnp.int16, jnp.int32, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_exact_collectives_of_every_dtype_send_the_plan(mesh, dtype):
    """The three collectives on a leaf of each dtype that travels as it is (no codec): the
    compiled HLO sends what the plan counts, and the values are ``lax``'s. Booleans are
    summed as ``lax.psum`` sums them, counted in int32 (4 bytes each on the wire), by
    ``reduce_scatter`` too, which ``lax.psum_scatter`` refuses; the plan counted one byte."""
    n = 8
    x = (jax.random.randint(jax.random.PRNGKey(1), (n, 64, 24), 0, 3) > 0).astype(dtype)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    for op, shape in ((cc.all_reduce, (64, 24)), (cc.all_gather, (64, 24)), (cc.reduce_scatter, (64, 24))):
        fn = jax.jit(_compat.shard_map(lambda v: op(v[0], "data")[None], mesh=mesh, in_specs=P("data"),
                                       out_specs=P("data"), check_vma=False))
        rep = cj.collective_bytes(fn, xs)
        want = cj.communication_plan(op, jax.ShapeDtypeStruct(shape, dtype), n).compiled_bytes
        assert rep.total_ring_bytes == pytest.approx(want, abs=0.5), (op.__name__, rep.table())
        got = np.asarray(fn(xs))
        total = np.asarray(x).astype(np.int64 if dtype == jnp.bool_ else x.dtype).sum(0)
        if op is cc.all_gather:
            np.testing.assert_array_equal(got, np.broadcast_to(np.asarray(x).reshape(1, n * 64, 24), (n, n * 64, 24)))
        elif op is cc.all_reduce:
            np.testing.assert_array_equal(got, np.broadcast_to(total, (n,) + total.shape))
        else:
            np.testing.assert_array_equal(got.reshape(n * 8, 24), total)
