"""compressed_mean(bucket_bytes=...): the leaves exchanged in buckets, one after the other."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat, bucket, bucketing, transform
from commjax.bucketing import BucketedState, Piece, bucket_groups
from declared_layout import declared_mask

N = 8
AX = "data"


def _tree():
    """Leaves of 4, 16, 4, 1 (exact), 8 KiB of fp32 values, and an integer leaf."""
    shapes = {"a": (32, 32), "b": (64, 64), "c": (1024,), "d": (16,), "e": (2048,)}
    keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
    tree = {k: jax.random.normal(key, (N,) + shapes[k]) * (i + 1)
            for i, (k, key) in enumerate(zip(shapes, keys))}
    return tree | {"n": jnp.arange(N * 3, dtype=jnp.int32).reshape(N, 3)}


def _step(tx, mesh, grads, steps=2, traced_layout=False):
    """``steps`` updates of per-replica gradients; every replica's updates and the state.

    The state is laid out by ``cj.init_sharded``: with ``traced_layout``, as it traces
    ``tx.update`` to find the per-replica leaves (the test of a chained optimizer's layout);
    else with the mask the state classes declare, which skips three traces of the bucketed
    update (half the cost of a build). A wrong mask cannot pass unnoticed: a leaf that
    varies but is laid out replicated fails the ``check_vma`` step below."""
    local = jax.tree_util.tree_map(lambda a: a[0], grads)
    mask = None if traced_layout else declared_mask(tx, local, mesh)
    state = cj.init_sharded(tx, local, mesh, AX, mask=mask)
    specs = cj.state_specs(state, AX)

    def local(g, s):
        u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s)
        return jax.tree_util.tree_map(lambda a: a[None], u), s

    f = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(AX), specs), out_specs=(P(AX), specs)))
    g = jax.device_put(grads, NamedSharding(mesh, P(AX)))
    outs = []
    for t in range(steps):
        u, state = f(jax.tree_util.tree_map(lambda a: a * (1 + t), g), state)
        outs.append(jax.tree_util.tree_map(np.asarray, u))
    return outs, state, f


def test_bucket_groups_are_whole_leaves_in_order():
    leaves = [np.zeros(s) for s in [(10,), (300,), (100,), (2000,), (5,), (5,)]]

    def idx(groups):
        assert all(p.rows is None for g in groups for p in g)
        return tuple(tuple(p.leaf for p in g) for g in groups)

    assert idx(bucket_groups(leaves, 1600)) == ((0, 1), (2,), (3,), (4, 5))
    assert idx(bucket_groups(leaves, 10 ** 9)) == ((0, 1, 2, 3, 4, 5),)
    assert idx(bucket_groups(leaves, 1)) == tuple((i,) for i in range(6))


def test_split_cuts_large_leaves_into_row_ranges():
    """A leaf over the bucket is cut along its first axis into pieces of at most the
    bucket (multiples of 8 rows, of 1024 elements for a vector, where that fits; one row
    when a row is larger); smaller and integer leaves stay whole."""
    leaves = [np.zeros((64, 64)), np.zeros((20, 100)), np.zeros((3, 1000)), np.zeros(3000),
              np.zeros((64, 64), np.int32), np.zeros((4, 4))]
    groups = bucket_groups(leaves, 4096, split=True)
    pieces = [p for g in groups for p in g]
    by_leaf = {i: [p.rows for p in pieces if p.leaf == i] for i in range(len(leaves))}
    assert by_leaf[0] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert by_leaf[1] == [(0, 8), (8, 16), (16, 20)]
    assert by_leaf[2] == [(0, 1), (1, 2), (2, 3)]
    assert by_leaf[3] == [(0, 1024), (1024, 2048), (2048, 3000)]
    assert by_leaf[4] == [None] and by_leaf[5] == [None]
    assert pieces == sorted(pieces, key=lambda p: (p.leaf, p.rows or (0, 0)))  # tree order
    for g in groups:  # every bucket within its size unless it is one piece
        size = sum(4 * np.prod(leaves[p.leaf].shape[1:]) * (p.rows[1] - p.rows[0]) if p.rows
                   else 4 * leaves[p.leaf].size for p in g)
        assert size <= 4096 or len(g) == 1
    assert Piece(0) == Piece(0, None)


@pytest.mark.parametrize("order", ["rows", "tiles"])
@pytest.mark.parametrize("bucket_bytes", [20_000, 4096], ids=["whole_leaves", "split_leaves"])
def test_buckets_give_the_bits_of_one_bucket(mesh, monkeypatch, bucket_bytes, order):
    """A deterministic codec through the all-gather reducer encodes each leaf on its own
    (leaves padded to whole blocks), so the means and residuals of the buckets are those
    of one bucket, bit for bit, every replica the same; also when the 64x64 leaf and the
    2048-vector are cut into pieces (at 4096 bytes: 16-row pieces, whole 256-blocks).
    Also with the parts in a TPU's tile order (``order="tiles"``), where buckets select
    the new residuals in the leaves' shapes and one bucket in the parts' order."""
    if order == "tiles":
        monkeypatch.setattr(bucket, "_by_layout", lambda x, tiled_fn, flat_fn: tiled_fn(x))
    grads = _tree()
    opts = dict(reducer="allgather", min_compress_size=64)
    one, s1, _ = _step(cj.compressed_mean(cj.quantize(8, stochastic=False), AX, **opts), mesh, grads)
    tx = cj.compressed_mean(cj.quantize(8, stochastic=False), AX, bucket_bytes=bucket_bytes, **opts)
    many, s2, _ = _step(tx, mesh, grads)
    local = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a: a[0], grads))
    groups = bucket_groups(local, bucket_bytes, split=True)
    assert isinstance(s2, BucketedState) and len(s2.buckets) == len(groups) == (3 if bucket_bytes > 4096 else 10)
    for a, b in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(many)):
        np.testing.assert_array_equal(a, b)
        assert all(np.array_equal(r, a[0]) for r in a) or a.dtype == np.int32
    # The residuals of a's and b's pieces (the compressed leaves), joined, are one
    # bucket's (the state holds every replica's, stacked on the first axis).
    flat = [np.asarray(r).reshape((N, -1) + r.shape[1:]) for b in s2.buckets for r in b.residual]
    assert [r.shape for r in flat] == ([(N, 32, 32), (N, 64, 64)] if bucket_bytes > 4096
                                       else [(N, 32, 32)] + [(N, 16, 64)] * 4)
    np.testing.assert_array_equal(np.asarray(s1.residual[0]), flat[0].reshape(-1, 32))
    np.testing.assert_array_equal(np.asarray(s1.residual[1]), np.concatenate(flat[1:], 1).reshape(-1, 64))


@pytest.mark.parametrize("codec,reducer", [(cj.quantize(4), "two_phase"), (cj.sign(), "auto"),
                                           (cj.top_k(0.1), "auto"), (cj.powersgd(2), "auto")],
                         ids=["q4_two_phase", "sign", "top_k", "powersgd"])
def test_bucketed_bytes_are_the_plan_and_replicas_agree(mesh, codec, reducer):
    """HLO bytes == the plan (each bucket's transfers), replicas bit-identical, and a
    chained Adam's moments replicated (the barrier between buckets does not make the
    means look per replica). At 6,000 bytes the 64x64 leaf and the 2048-vector are cut
    into pieces, except for PowerSGD, which factors whole matrices."""
    grads = {k: v for k, v in _tree().items() if k != "n"}
    tx = optax.chain(cj.compressed_mean(codec, AX, reducer=reducer, min_compress_size=64,
                                        bucket_bytes=6_000), optax.adam(1e-3))
    outs, state, f = _step(tx, mesh, grads, traced_layout=True)
    for a in jax.tree_util.tree_leaves(outs[-1]):
        assert all(np.array_equal(r, a[0]) for r in a)
    local = jax.tree_util.tree_map(lambda a: a[0], grads)
    plan = cj.communication_plan(cj.compressed_mean(codec, AX, reducer=reducer, min_compress_size=64,
                                                    bucket_bytes=6_000), local, N)
    groups = bucket_groups(jax.tree_util.tree_leaves(local), 6_000, split=not codec.has_exchange)
    assert len({t.what.split(":")[0] for t in plan.transfers}) == len(groups)
    assert len(groups) == (4 if codec.has_exchange else 8), groups
    rep = cj.collective_bytes(f, jax.device_put(grads, NamedSharding(mesh, P(AX))), state)
    assert rep.total_ring_bytes == pytest.approx(plan.compiled_bytes, abs=0.5), f"{rep.table()}\n{plan}"
    mask = cj.per_replica_mask(state, AX)
    adam = jax.tree_util.tree_leaves(mask[1])
    assert adam and not any(adam), "Adam's moments after a bucketed mean must be replicated"
    assert any(jax.tree_util.tree_leaves(mask[0])), "the residuals are per replica"


@pytest.mark.parametrize("error_feedback", [True, False], ids=["feedback", "no_feedback"])
def test_powersgd_means_around_the_barrier_are_the_means_through_it(mesh, monkeypatch, error_feedback):
    """PowerSGD's means leave the buckets around the barrier (the optimizer forms ``P Q^T``
    again where it reads it) when residuals order the buckets, through it without them:
    two steps give the means and states of the means all through the barrier, replicas
    alike (up to the product's fp32 rounding where it is formed again)."""
    grads = {k: v for k, v in _tree().items() if k != "n"}
    tx = lambda: optax.chain(cj.compressed_mean(cj.powersgd(2), AX, error_feedback=error_feedback,  # noqa: E731
                                                min_compress_size=64, bucket_bytes=6_000), optax.sgd(0.1))
    around = _step(tx(), mesh, grads)
    made = []

    def through_only(*a, **kw):
        made.append(kw["means_around"])
        return bucketing.bucketed(*a, **{**kw, "means_around": False})

    monkeypatch.setattr(transform, "bucketed", through_only)
    through = _step(tx(), mesh, grads)
    assert made and all(made), "compressed_mean did not ask PowerSGD's means around the barrier"
    for a, b in zip(jax.tree_util.tree_leaves(around[0]), jax.tree_util.tree_leaves(through[0])):
        assert all(np.array_equal(r, a[0]) for r in a)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(around[1]), jax.tree_util.tree_leaves(through[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_bucketed_update_refuses_another_tree(mesh):
    tx = cj.compressed_mean(cj.quantize(8), AX, bucket_bytes=20_000, min_compress_size=64)
    state = tx.init({k: v[0] for k, v in _tree().items()})
    with pytest.raises(ValueError, match="buckets"):
        tx.update({"a": jnp.zeros((32, 32))}, state)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "16MB"])
def test_bucket_bytes_is_checked(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        cj.compressed_mean(cj.quantize(8), AX, bucket_bytes=bad)


@pytest.mark.parametrize("order", ["rows", "tiles"])
def test_reset_in_buckets_zeroes_only_the_flagged_piece(mesh, monkeypatch, order):
    """``check_finite="reset"`` with a leaf cut into pieces: a NaN in one replica's ``b``
    (the 64x64 leaf, cut into four 16-row pieces at 4096 bytes), row 5, makes that
    piece's mean NaN, as with the default (each piece is a leaf of its bucket); that
    piece restarts its residual from zero where the default keeps it, every other
    residual is the default's, and the means are the default's bit for bit. Also with
    the parts in a TPU's tile order (``order="tiles"``), where the default selects the
    kept residuals in the leaves' shapes and reset in the parts' order."""
    if order == "tiles":
        monkeypatch.setattr(bucket, "_by_layout", lambda x, tiled_fn, flat_fn: tiled_fn(x))
    grads = _tree()
    bad = dict(grads)
    bad["b"] = bad["b"].at[3, 5, 7].set(jnp.nan)
    opts = dict(min_compress_size=64, bucket_bytes=4096)
    runs = {}
    for mode in (True, "reset"):
        _, state, f = _step(cj.compressed_mean(cj.quantize(8), AX, check_finite=mode, **opts), mesh, grads, steps=1)
        u, new = f(jax.device_put(bad, NamedSharding(mesh, P(AX))), state)
        runs[mode] = (state, jax.tree_util.tree_map(np.asarray, u), new)
    (old, u_keep, keep), (_, u_reset, reset) = runs[True], runs["reset"]
    assert np.all(np.isnan(u_reset["b"][:, :16])) and np.isfinite(u_reset["b"][:, 16:]).all()
    for a, b in zip(jax.tree_util.tree_leaves(u_keep), jax.tree_util.tree_leaves(u_reset)):
        np.testing.assert_array_equal(a, b)
    # Residuals in bucket order: a, b's four pieces, c, e (d goes exact).
    pieces, kept, before = ([np.asarray(r) for b in s.buckets for r in b.residual] for s in (reset, keep, old))
    assert [r.shape[1:] for r in pieces][:5] == [(32,)] + [(64,)] * 4
    for i, (r, k, o) in enumerate(zip(pieces, kept, before)):
        if i == 1:  # b's first piece, flagged: kept by the default, zero with reset
            np.testing.assert_array_equal(k, o)
            assert not np.any(r), "the flagged piece was not reset"
        else:
            assert np.any(r)
            np.testing.assert_array_equal(r, k)


@pytest.mark.parametrize("total", [0, 4, 84 << 20, 497 << 20, 2048 << 20, (2048 << 20) + 4, 5_253_505_024,
                                   28 << 30])
def test_auto_bucket_bytes_is_the_smallest_power_of_two_within_the_bucket_count(total):
    """On a TPU: a power of two, at least 4 MiB, at most 512 buckets' worth of the tree's
    fp32 bytes, and the smallest such; off TPU one bucket, whatever the tree."""
    tree = [jax.ShapeDtypeStruct((total // 4,), jnp.float32)]
    size = bucketing.auto_bucket_bytes(tree, "tpu")
    assert size & (size - 1) == 0 and size >= 4 << 20 and size * 512 >= total
    assert size == 4 << 20 or (size // 2) * 512 < total
    for platform in ("cpu", "gpu", "cuda", "rocm"):
        assert bucketing.auto_bucket_bytes(tree, platform) is None
    # The measured trees: GPT-2 small in 4 MiB buckets, the 1.3B tree in 16 MiB ones.
    assert bucketing.auto_bucket_bytes([jax.ShapeDtypeStruct((5_253_505_024 // 4,), jnp.float32)], "tpu") == 16 << 20


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
def test_auto_buckets_are_the_explicit_ones_of_the_backend(mesh, monkeypatch, platform):
    """The default ``bucket_bytes="auto"`` runs, on a TPU backend, exactly what
    ``bucket_bytes=auto_bucket_bytes(tree)`` runs (state, means, residuals, plan, bit for
    bit), and elsewhere what one bucket runs."""
    monkeypatch.setattr(bucketing, "_default_platform", lambda: platform)
    monkeypatch.setattr(bucketing, "AUTO_MIN_BUCKET_BYTES", 8192)  # buckets of this small tree
    grads = _tree()
    local = {k: v[0] for k, v in grads.items()}
    explicit = 8192 if platform == "tpu" else None
    assert bucketing.auto_bucket_bytes(local) == explicit
    opts = dict(min_compress_size=64)
    auto = cj.compressed_mean(cj.quantize(4), AX, **opts)
    want = cj.compressed_mean(cj.quantize(4), AX, bucket_bytes=explicit, **opts)
    got_out, got_state, _ = _step(auto, mesh, grads)
    want_out, want_state, _ = _step(want, mesh, grads)
    assert isinstance(got_state, BucketedState) == (platform == "tpu")
    assert jax.tree_util.tree_structure(got_state) == jax.tree_util.tree_structure(want_state)
    for a, b in zip(jax.tree_util.tree_leaves((got_out, got_state)), jax.tree_util.tree_leaves((want_out, want_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert cj.communication_plan(auto, local, N) == cj.communication_plan(want, local, N)


def test_a_state_made_in_other_buckets_is_refused_naming_bucket_bytes():
    local = {k: v[0] for k, v in _tree().items()}
    one = cj.compressed_mean(cj.quantize(4), None, bucket_bytes=None, min_compress_size=64)
    many = cj.compressed_mean(cj.quantize(4), None, bucket_bytes=8192, min_compress_size=64)
    for tx, other in ((one, many), (many, one)):
        with pytest.raises(ValueError, match="bucket_bytes"):
            tx.update(local, other.init(local))


class _SignInPlace(type(cj.sign())):
    """sign with its pieces read in place on TPU too (the other codecs' choice)."""

    tpu_pieces_apart_in_buckets = False


def _barriers(codec, mesh, params, platform, bucket_bytes, **options):
    """Optimization barriers in the bucketed step lowered (not compiled) for ``platform``."""
    tx = cj.compressed_mean(codec, AX, bucket_bytes=bucket_bytes, **options)
    state = cj.init_sharded(tx, params, mesh, AX)
    specs = cj.state_specs(state, AX)
    step = _compat.shard_map(lambda g, s: tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s),
                             mesh=mesh, in_specs=(P(AX), specs), out_specs=(P(), specs), check_vma=False)
    grads = jax.tree_util.tree_map(lambda a: jnp.zeros((N,) + a.shape, a.dtype), params)
    with _compat.TRACE_PLATFORM(platform):
        text = jax.jit(step).trace(grads, state).lower(lowering_platforms=(platform,)).as_text()
    return text.count("optimization_barrier")


def test_sign_takes_cut_pieces_apart_on_tpu_only(mesh):
    """On TPU, with the default ``check_finite``, sign's pieces of a leaf cut across
    buckets are each taken out of the leaf by a barrier (one per bucket holding such
    pieces: ``Compressor.tpu_pieces_apart_in_buckets``, v5e numbers in
    ``commjax.bucketing``); lowered for CPU, or with ``check_finite="reset"``, the step is
    the in-place one. Lowered here for both platforms (no TPU needed)."""
    params = {"w": jnp.zeros((64, 256)), "v": jnp.zeros((256,))}
    size = 16384  # w: 64 KB, four pieces of 16 rows, one per bucket
    cut = sum(any(p.rows is not None for p in g)
              for g in bucket_groups(jax.tree_util.tree_leaves(params), size, split=True))
    assert cut == 4
    apart, in_place = cj.sign(), _SignInPlace()
    assert apart.tpu_pieces_apart_in_buckets and not cj.quantize(8).tpu_pieces_apart_in_buckets
    assert (_barriers(apart, mesh, params, "tpu", size)
            == _barriers(in_place, mesh, params, "tpu", size) + cut)
    assert _barriers(apart, mesh, params, "cpu", size) == _barriers(in_place, mesh, params, "cpu", size)
    assert (_barriers(apart, mesh, params, "tpu", size, check_finite="reset")
            == _barriers(in_place, mesh, params, "tpu", size, check_finite="reset"))
