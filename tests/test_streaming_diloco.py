"""Streaming DiLoCo: fragments synced at staggered steps, overlap, mixing, group axis."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.accounting import parse_hlo_collectives
from commjax.optimizers.streaming_diloco import (
    Piece, StreamingDiLoCoState, fragment_leaves, streaming_diloco,
)
from commjax.testing import ready, same_bits

N = 8
LR, OUT_LR, MU = 0.1, 0.7, 0.9
# Uneven leaves: 2 fragments of 228 elements each cut "b" inside a row.
SMALL = {"a": jnp.zeros((24,)), "b": jnp.zeros((40, 8)), "c": jnp.zeros((8, 8)), "d": jnp.zeros((48,))}
# 4-bit: 8 granules of 256 x 8 compressed elements (2 per fragment, "a" cut at rows 64 and
# 128, "b" at row 32) and one exact vector shared out in 4 pieces.
BIG = {"a": jnp.zeros((160, 64)), "b": jnp.zeros((64, 64)), "c": jnp.zeros((32, 64)), "d": jnp.zeros((64,))}
TWO = {"w": jnp.zeros((32, 32)), "b": jnp.zeros((32,))}  # one compressed leaf, one exact


def nesterov():
    return optax.sgd(OUT_LR, momentum=MU, nesterov=True)


def streaming_diloco_bytes(params, n, *, sync_every, fragments=1, compressor=None, inner_replicas=1,
                           inner_compressor=None):
    """The plan's bytes, by fragment: ``per_fragment``, ``full_sync`` (one fragment),
    ``per_inner_step``, ``peak``, ``inner_group``."""
    def plan(p):
        inner = {} if inner_replicas == 1 else dict(inner_axis_name="inner", inner_compressor=inner_compressor)
        tx = streaming_diloco(optax.sgd(LR), nesterov(), sync_every=sync_every, fragments=p,
                              compressor=compressor, **inner)
        return cj.communication_plan(tx, params, n, inner_replicas=inner_replicas)
    got = plan(fragments)
    per = tuple(got.bytes_of(f"fragment {f}") for f in range(fragments))
    return types.SimpleNamespace(per_fragment=per, full_sync=plan(1).bytes_of("fragment 0"),
                                 per_inner_step=got.bytes_per_step, peak=got.peak_bytes,
                                 inner_group=got.bytes_of("inner-axis mean"))


def _targets(params, n, seed=0):
    """Replica ``i`` minimises ``0.5 |p - c_i|^2``: its gradient is ``p - c_i``."""
    rng = np.random.default_rng(seed)
    return [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(n)]


class Driver:
    """One compiled ``(params, grads, state) -> (updates, state)`` step over a mesh, with
    per-replica params (leading axis) on ``axis_name`` (and grads on every device)."""

    def __init__(self, tx, params, mesh, axis_name="data", grad_axes="data", place=None):
        self.tx, self.mesh, self.params = tx, mesh, params
        if place is None:
            self.state0 = cj.shard_state(tx.init(params), mesh, axis_name)
            specs = cj.state_specs(self.state0, axis_name)
        else:  # ``place(state) -> (placed state, specs)``
            self.state0, specs = place(tx.init(params))
        self.n = mesh.shape[axis_name]
        self.p_shard = NamedSharding(mesh, P(axis_name))
        self.g_shard = NamedSharding(mesh, P(grad_axes))

        def body(p, g, s):
            un = lambda t: jax.tree_util.tree_map(lambda a: a[0], t)
            u, s = tx.update(un(g), s, un(p))
            return jax.tree_util.tree_map(lambda a: a[None], u), s

        fn = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(axis_name), P(grad_axes), specs),
                                       out_specs=(P(axis_name), specs)))
        glob = lambda n: {k: jax.ShapeDtypeStruct((n,) + v.shape, v.dtype) for k, v in params.items()}  # noqa: E731
        # One compilation serves the run and the byte count.
        self.fn = fn.lower(glob(self.n), glob(mesh.devices.size), self.state0).compile()
        self.collectives = parse_hlo_collectives(self.fn.as_text())

    def stack(self, trees, shard):
        return jax.device_put({k: np.stack([t[k] for t in trees]) for k in trees[0]}, shard)

    def run(self, steps, grads_of, state=None, params=None):
        """``grads_of(t, params per worker) -> list of per-device grad trees``; returns the
        per-step (params per worker, state) log."""
        state = self.state0 if state is None else state
        p = params or [jax.tree_util.tree_map(np.asarray, self.params)] * self.n
        log = []
        for t in range(steps):
            u, state = self.fn(*ready(self.stack(p, self.p_shard), self.stack(grads_of(t, p), self.g_shard),
                                      state))
            u = jax.device_get(ready(u))
            p = [{k: p[i][k] + u[k][i] for k in u} for i in range(self.n)]
            log.append((p, state))
        return log


def _anchor_copies(state, key):
    """Every device's copy of the (replicated) anchor leaf."""
    return [np.asarray(s.data) for s in state.anchor[key].addressable_shards]


# ------------------------------------------------------------------------- reference


def reference(p0, grads_of, steps, *, n_w, h, frags, tau, alpha, groups):
    """The schedule in plain numpy (sgd inner, Nesterov outer, exact mean): per step the
    workers' parameters and the anchor."""
    keys = sorted(p0)
    p = [{k: np.asarray(p0[k], np.float32) for k in keys} for _ in range(n_w)]
    anchor = {k: np.array(p0[k], np.float32) for k in keys}
    flat = lambda x, q: x[keys[q.leaf]].reshape(-1)[q.start:q.stop]  # noqa: E731 (a view)
    mom = {q: np.zeros(q.stop - q.start, np.float32) for g in groups for q in g}
    pending, s, log = {}, h // frags, []
    for t in range(steps):
        g = grads_of(t, p)
        local = [{k: p[i][k] - np.float32(LR) * g[i][k] for k in keys} for i in range(n_w)]
        r = (t + 1) % h
        if r % s == 0:
            f = (r // s + frags - 1) % frags
            pending[f] = {q: np.mean([flat(anchor, q) - flat(w, q) for w in local], axis=0) for q in groups[f]}
        r = (t + 1 - tau) % h
        if t >= tau and r % s == 0:
            f = (r // s + frags - 1) % frags
            for q, m in pending.pop(f).items():
                mom[q] = m + MU * mom[q]
                flat(anchor, q)[:] = flat(anchor, q) - OUT_LR * (m + MU * mom[q])
                for w in local:
                    flat(w, q)[:] = alpha * flat(w, q) + (1 - alpha) * flat(anchor, q)
        p = local
        log.append(([dict(w) for w in p], {k: v.copy() for k, v in anchor.items()}))
    return log


def _quadratic(targets, groups_of=1):
    """Gradients ``p - c_j`` on every device ``j``; device ``j`` belongs to worker ``j // groups_of``."""
    return lambda t, p: [{k: p[j // groups_of][k] - c[k] for k in c} for j, c in enumerate(targets)]


def _worker_means(targets, groups_of):
    """The same problem seen by workers whose gradient is their group's exact mean."""
    n_w = len(targets) // groups_of
    cs = [{k: np.mean([targets[w * groups_of + j][k] for j in range(groups_of)], axis=0) for k in targets[0]}
          for w in range(n_w)]
    return lambda t, p: [{k: p[w][k] - c[k] for k in c} for w, c in enumerate(cs)]


H, FRAGS, TAU, ALPHA, STEPS = 4, 2, 1, 0.5, 12


@pytest.fixture(scope="module")
def overlapped(mesh):
    tx = streaming_diloco(optax.sgd(LR), nesterov(), sync_every=H, fragments=FRAGS, overlap=TAU, mix=ALPHA)
    return Driver(tx, SMALL, mesh)


def test_overlap_and_mix_follow_the_reference_schedule(overlapped):
    targets = _targets(SMALL, N)
    log = overlapped.run(STEPS, _quadratic(targets))
    groups = fragment_leaves(SMALL, FRAGS)
    # Largest leaf first: "b" (index 1) is cut after 228 elements, inside row 28.
    assert groups == ((Piece(1, 0, 228, (1, 228)),),
                      (Piece(0, 0, 24, (24,)), Piece(1, 228, 320, (1, 92)), Piece(2, 0, 64, (8, 8)),
                       Piece(3, 0, 48, (48,))))
    ref = reference(SMALL, _quadratic(targets), STEPS, n_w=N, h=H, frags=FRAGS, tau=TAU, alpha=ALPHA, groups=groups)
    moved = set()
    for t, ((p, state), (p_ref, a_ref)) in enumerate(zip(log, ref)):
        for k in SMALL:
            copies = _anchor_copies(state, k)
            # Every device holds the same bits of every fragment's anchor, every step.
            assert all(np.array_equal(c, copies[0]) for c in copies), (t, k)
            np.testing.assert_allclose(copies[0], a_ref[k], rtol=2e-5, atol=1e-6, err_msg=f"{t} {k}")
            for i in range(N):
                np.testing.assert_allclose(p[i][k], p_ref[i][k], rtol=2e-5, atol=1e-6, err_msg=f"{t} {k} {i}")
            before = _anchor_copies(log[t - 1][1], k)[0] if t else np.zeros_like(copies[0])
            for f, group in enumerate(groups):
                for q in group:
                    if "abcd"[q.leaf] == k and not np.array_equal(
                            copies[0].reshape(-1)[q.start:q.stop], before.reshape(-1)[q.start:q.stop]):
                        moved.add((t, f))
    # Fragment 0 (b's first 228 elements) merges at steps 2, 6, 10, fragment 1 (the rest)
    # at 4, 8 (t=0 has no predecessor to compare with); nothing else moves an anchor.
    assert moved == {(2, 0), (6, 0), (10, 0), (4, 1), (8, 1)}
    assert int(np.asarray(log[-1][1].count)) == STEPS


def test_sync_bytes_equal_the_plan_and_peak_is_one_fragment(overlapped):
    rep, n = overlapped.collectives, N
    plan = streaming_diloco_bytes(SMALL, n, sync_every=H, fragments=FRAGS)
    per = {}
    for c in rep:
        assert c.in_conditional and c.group_size == n
        per[c.computation] = per.get(c.computation, 0.0) + c.ring_bytes
    assert sorted(per.values()) == pytest.approx(sorted(plan.per_fragment))
    assert plan.per_fragment == (cj.ring_bytes("all-reduce", 4 * 228, n),) * 2
    # Uneven leaves, and still exactly half of a full sync at the peak.
    assert max(per.values()) == plan.full_sync / FRAGS
    assert plan.per_inner_step == pytest.approx(plan.full_sync / H)


def test_nan_on_one_replica_reaches_every_replica_at_the_merge(overlapped):
    targets = _targets(SMALL, N, seed=1)
    quad = _quadratic(targets)

    def grads(t, p):
        g = quad(t, p)
        if t == 1:  # fragment 0's send step
            g[3] = {k: v.copy() for k, v in g[3].items()}
            g[3]["b"][0, 5] = np.nan  # fragment 0's piece of "b"
        return g

    log = overlapped.run(3, grads)
    (p1, s1), (p2, s2) = log[1:]
    # Step 1: only replica 3's own update is NaN.
    assert all(np.all(np.isnan(p1[3][k])) for k in SMALL)
    assert all(np.all(np.isfinite(p1[i][k])) for i in range(N) if i != 3 for k in SMALL)
    # Step 2 merges fragment 0's (NaN) mean: every replica's update is NaN, the anchor
    # and the outer state are kept, the counter advances.
    assert all(np.all(np.isnan(p2[i][k])) for i in range(N) for k in SMALL)
    assert same_bits(s2.anchor, s1.anchor) and same_bits(s2.outer_state, s1.outer_state)
    assert int(np.asarray(s2.count)) == 3
    # Fragment 1's send (step 3) and merge (step 4) from clean parameters are finite.
    clean = [jax.tree_util.tree_map(np.asarray, SMALL)] * N
    (p3, s3), (p4, s4) = overlapped.run(2, quad, state=s2, params=clean)
    assert all(np.all(np.isfinite(p4[i][k])) for i in range(N) for k in SMALL)
    assert not same_bits(s4.anchor["d"], s2.anchor["d"])


def _window(tx, mesh, state, static: bool):
    """One program of a whole round (H steps unrolled) on the quadratic, the step passed
    statically (``update(..., step=k)``) or read from the state."""
    specs = cj.state_specs(state, "data")

    def body(p, s, c):
        p, c = (jax.tree_util.tree_map(lambda a: a[0], t) for t in (p, c))
        for k in range(H):
            g = jax.tree_util.tree_map(lambda a, b: a - b, p, c)
            u, s = tx.update(g, s, p, step=k) if static else tx.update(g, s, p)
            p = optax.apply_updates(p, u)
        return jax.tree_util.tree_map(lambda a: a[None], p), s

    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P("data"), specs, P("data")),
                                  out_specs=(P("data"), specs)))
    glob = {k: jax.ShapeDtypeStruct((N,) + v.shape, v.dtype) for k, v in SMALL.items()}
    return f.lower(glob, state, glob).compile()


def test_static_steps_take_the_collective_out_of_the_conditional(mesh, overlapped):
    tx = streaming_diloco(optax.sgd(LR), nesterov(), sync_every=H, fragments=FRAGS, overlap=TAU, mix=ALPHA)
    state = overlapped.state0
    static, traced = _window(tx, mesh, state, True), _window(tx, mesh, state, False)
    # Static: the round's two sends are plain all-reduces (no conditional around them), so
    # nothing waits on them until their merge a step later; traced: both inside one.
    rep_s = parse_hlo_collectives(static.as_text())
    assert [c.in_conditional for c in rep_s] == [False, False]
    assert [c.ring_bytes for c in rep_s] == [cj.ring_bytes("all-reduce", 4 * 228, N)] * 2
    assert all(c.in_conditional for c in parse_hlo_collectives(traced.as_text()))
    targets = _targets(SMALL, N, seed=6)
    c = overlapped.stack(targets, overlapped.p_shard)
    start = overlapped.stack([jax.tree_util.tree_map(np.asarray, SMALL)] * N, overlapped.p_shard)
    outs = []
    for fn in (static, traced):
        p, s = start, state
        for _ in range(2):  # two rounds: the second merges what the first sent last
            p, s = ready(*fn(p, s, c))
        outs.append((jax.device_get(p), s))
    (p_s, s_s), (p_t, s_t) = outs
    for k in SMALL:
        np.testing.assert_allclose(p_s[k], p_t[k], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(s_s.anchor[k]), np.asarray(s_t.anchor[k]), rtol=1e-6, atol=1e-7)
    # A static step that is not the state's (mod H): NaN on every replica, not a wrong sync.
    (_, s1), = overlapped.run(1, _quadratic(targets))
    bad, _ = ready(*static(start, s1, c))
    assert all(np.all(np.isnan(np.asarray(v))) for v in jax.tree_util.tree_leaves(bad))


# ------------------------------------------------------------------------- diloco, compressed


@pytest.mark.exact_codegen
@pytest.mark.parametrize("compressor", [None, cj.quantize(4)], ids=["exact", "q4"])
def test_one_fragment_no_overlap_is_diloco_bit_for_bit(mesh, compressor):
    targets = _targets(TWO, N, seed=2)
    make = dict(sync_every=2, compressor=compressor)
    runs = [Driver(tx, TWO, mesh).run(5, _quadratic(targets)) for tx in (
        cj.diloco(optax.adam(1e-2), nesterov(), **make),
        streaming_diloco(optax.adam(1e-2), nesterov(), fragments=1, overlap=0, mix=0.0, **make))]
    for (p_a, s_a), (p_b, s_b) in zip(*runs):
        assert same_bits(p_a, p_b) and same_bits(s_a.anchor, s_b.anchor)
        assert same_bits(s_a.inner_state, s_b.inner_state)
    assert not same_bits(runs[0][0][1].anchor, runs[0][-1][1].anchor)


@pytest.fixture(scope="module")
def quantized(mesh):
    tx = streaming_diloco(optax.sgd(LR), nesterov(), sync_every=8, fragments=4, compressor=cj.quantize(4))
    return Driver(tx, BIG, mesh)


def test_quantized_fragments_send_their_plan_and_a_quarter_of_a_sync(quantized):
    rep = quantized.collectives
    q4 = cj.quantize(4)
    plan = streaming_diloco_bytes(BIG, N, sync_every=8, fragments=4, compressor=q4)
    groups = fragment_leaves(BIG, 4, q4, N)
    # Two granules of 256 x 8 compressed elements each, cut along rows; the exact vector
    # "d" (index 3) in four pieces of 16.
    assert [[(q.leaf, q.shape) for q in g if q.leaf != 3] for g in groups] == [
        [(0, (64, 64))], [(0, (64, 64))], [(0, (32, 64)), (1, (32, 64))], [(1, (32, 64)), (2, (32, 64))]]
    assert [[q.shape for q in g if q.leaf == 3] for g in groups] == [[(16,)]] * 4
    per = {}
    for c in rep:
        assert c.in_conditional
        per[c.computation] = per.get(c.computation, 0.0) + c.ring_bytes
    assert sorted(per.values()) == pytest.approx(sorted(plan.per_fragment))
    # Exactly a quarter of the full sync each: the cut pieces send no NaN flags (the
    # gathered scale words tell a non-finite block).
    assert max(per.values()) == pytest.approx(plan.full_sync / 4)
    assert sum(plan.per_fragment) == plan.full_sync
    assert any(d.startswith("u") for c in rep for d in c.dtypes)
    # 4-bit outer gradients: >= 7.5x fewer bytes per inner step than an fp32 DiLoCo sync.
    exact = streaming_diloco_bytes(BIG, N, sync_every=8)
    assert exact.per_inner_step >= 7.5 * plan.per_inner_step


def test_quantized_anchors_identical_on_every_device_after_every_sync(quantized):
    log = quantized.run(8, _quadratic(_targets(BIG, N, seed=3)))
    for t, (_, state) in enumerate(log):
        for k in BIG:
            copies = _anchor_copies(state, k)
            assert all(np.array_equal(c, copies[0]) for c in copies), (t, k)
    # Fragment f syncs at step 2f + 1: each piece of each anchor moved exactly then in the round.
    anchor = lambda t, q: np.asarray(log[t][1].anchor["abcd"[q.leaf]]).reshape(-1)[q.start:q.stop]  # noqa: E731
    for f, group in enumerate(fragment_leaves(BIG, 4, cj.quantize(4), N)):
        for q in group:
            moved = [t for t in range(1, 8) if not np.array_equal(anchor(t - 1, q), anchor(t, q))]
            assert moved == [2 * f + 1], (f, q)


# ------------------------------------------------------------------------- groups (2-D mesh)


def test_groups_inside_workers_average_exactly_and_sync_over_the_slow_axis():
    mesh = _compat.make_mesh((2, 4), ("dc", "data"))
    tx = streaming_diloco(optax.sgd(LR), nesterov(), sync_every=H, fragments=FRAGS, overlap=TAU,
                          mix=ALPHA, axis_name="dc", inner_axis_name="data")
    drv = Driver(tx, SMALL, mesh, axis_name="dc", grad_axes=("dc", "data"))
    targets = _targets(SMALL, N, seed=4)
    log = drv.run(8, _quadratic(targets, groups_of=4))
    groups = fragment_leaves(SMALL, FRAGS)
    ref = reference(SMALL, _worker_means(targets, 4), 8, n_w=2, h=H, frags=FRAGS, tau=TAU, alpha=ALPHA,
                    groups=groups)
    for t, ((p, state), (p_ref, a_ref)) in enumerate(zip(log, ref)):
        for k in SMALL:
            copies = _anchor_copies(state, k)
            assert all(np.array_equal(c, copies[0]) for c in copies), (t, k)
            np.testing.assert_allclose(copies[0], a_ref[k], rtol=2e-5, atol=1e-6)
            for w in range(2):
                np.testing.assert_allclose(p[w][k], p_ref[w][k], rtol=2e-5, atol=1e-6)
    rep = drv.collectives
    plan = streaming_diloco_bytes(SMALL, 2, sync_every=H, fragments=FRAGS, inner_replicas=4)
    every_step = [c for c in rep if not c.in_conditional]
    assert [c.group_size for c in every_step] == [4]
    assert every_step[0].ring_bytes == pytest.approx(plan.inner_group)
    synced = [c for c in rep if c.in_conditional]
    assert {c.group_size for c in synced} == {2}
    assert sorted(c.ring_bytes for c in synced) == pytest.approx(sorted(plan.per_fragment))


def _both_axes(mesh):
    """The docstring's layout: the state per worker ("dc"), the inner exchange per device."""
    def place(s):
        both = ("dc", "data")
        state = cj.shard_state(s, mesh, "dc")._replace(inner_exchange=cj.shard_state(s.inner_exchange, mesh, both))
        return state, cj.state_specs(state, "dc")._replace(inner_exchange=cj.state_specs(state.inner_exchange, both))
    return place


def test_compressed_group_mean_keeps_the_group_identical_and_sends_its_plan():
    mesh = _compat.make_mesh((2, 4), ("dc", "data"))
    q8 = cj.quantize(8)
    tx = streaming_diloco(optax.sgd(LR), nesterov(), sync_every=H, fragments=FRAGS, overlap=TAU, mix=ALPHA,
                          axis_name="dc", inner_axis_name="data", inner_compressor=q8, inner_replicas=4)
    drv = Driver(tx, TWO, mesh, axis_name="dc", grad_axes=("dc", "data"), place=_both_axes(mesh))
    targets = _targets(TWO, N, seed=7)
    log = drv.run(6, _quadratic(targets, groups_of=4))
    for _, state in log:
        # check_vma=True accepted the parameters, inner state and anchor as one value per
        # worker; each device's copy of them holds the same bits.
        for tree in (state.inner_state, state.anchor):
            for leaf in jax.tree_util.tree_leaves(tree):
                shards = {}
                for sh in leaf.addressable_shards:
                    shards.setdefault(str(sh.index), []).append(np.asarray(sh.data))
                assert all(np.array_equal(c, cs[0]) for cs in shards.values() for c in cs)
        # The error-feedback residuals are the devices' own: all 8 differ.
        res = np.asarray(state.inner_exchange.residual[0]).reshape(N, -1)
        assert len({r.tobytes() for r in res}) == N
    # Close to the exact group mean's schedule (8-bit gradients), not equal to it.
    ref = reference(TWO, _worker_means(targets, 4), 6, n_w=2, h=H, frags=FRAGS, tau=TAU, alpha=ALPHA,
                    groups=fragment_leaves(TWO, FRAGS))
    p, p_ref = log[-1][0], ref[-1][0]
    for w in range(2):
        np.testing.assert_allclose(p[w]["w"], p_ref[w]["w"], rtol=0, atol=2e-2)
        assert not np.array_equal(p[w]["w"], p_ref[w]["w"].astype(np.float32))
    every_step = [c for c in drv.collectives if not c.in_conditional]
    plan = streaming_diloco_bytes(TWO, 2, sync_every=H, fragments=FRAGS, inner_replicas=4, inner_compressor=q8)
    assert {c.group_size for c in every_step} == {4}
    assert sum(c.ring_bytes for c in every_step) == pytest.approx(plan.inner_group)
    assert plan.inner_group < streaming_diloco_bytes(TWO, 2, sync_every=H, inner_replicas=4).inner_group / 2
    assert any(d.startswith("u") for c in every_step for d in c.dtypes)
    with pytest.raises(ValueError, match="`inner_compressor` compresses the gradient mean over `inner_axis_name`"):
        streaming_diloco(optax.sgd(LR), nesterov(), sync_every=H, inner_compressor=q8)
    with pytest.raises(TypeError, match="`inner_compressor` must be None"):
        streaming_diloco(optax.sgd(LR), nesterov(), sync_every=H, axis_name="dc", inner_axis_name="data",
                         inner_compressor="q8")
    with pytest.raises(ValueError, match="`inner_replicas`"):
        streaming_diloco(optax.sgd(LR), nesterov(), sync_every=H, axis_name="dc", inner_axis_name="data",
                         inner_replicas=4)


@pytest.mark.exact_codegen
def test_compressed_group_mean_one_fragment_is_diloco_bit_for_bit():
    """cj.diloco(inner_compressor=...) and its one-fragment streaming form: same bits."""
    mesh = _compat.make_mesh((2, 4), ("dc", "data"))
    make = dict(sync_every=2, axis_name="dc", inner_axis_name="data", inner_compressor=cj.quantize(4),
                inner_replicas=4)
    targets = _targets(TWO, N, seed=8)
    runs = [Driver(tx, TWO, mesh, axis_name="dc", grad_axes=("dc", "data"), place=_both_axes(mesh)).run(
        4, _quadratic(targets, groups_of=4)) for tx in (cj.diloco(optax.adam(1e-2), nesterov(), **make),
                                                        streaming_diloco(optax.adam(1e-2), nesterov(), **make))]
    for (p_a, s_a), (p_b, s_b) in zip(*runs):
        assert same_bits(p_a, p_b) and same_bits(s_a.anchor, s_b.anchor)
        assert same_bits(s_a.inner_exchange, s_b.inner_exchange) and same_bits(s_a.inner_state, s_b.inner_state)
    assert not same_bits(runs[0][0][1].inner_exchange.residual, runs[0][-1][1].inner_exchange.residual)
    with pytest.raises(ValueError, match="diloco: `inner_compressor` compresses"):
        cj.diloco(optax.sgd(LR), nesterov(), sync_every=2, inner_compressor=cj.quantize(4))


def test_diloco_groups_inside_workers_too():
    """cj.diloco(inner_axis_name=...): the same exact group mean, then DiLoCo over "dc"."""
    mesh = _compat.make_mesh((2, 4), ("dc", "data"))
    tx = cj.diloco(optax.sgd(LR), nesterov(), sync_every=3, axis_name="dc", inner_axis_name="data")
    drv = Driver(tx, SMALL, mesh, axis_name="dc", grad_axes=("dc", "data"))
    targets = _targets(SMALL, N, seed=5)
    log = drv.run(6, _quadratic(targets, groups_of=4))
    ref = reference(SMALL, _worker_means(targets, 4), 6, n_w=2, h=3, frags=1, tau=0, alpha=0.0,
                    groups=fragment_leaves(SMALL, 1))
    for (p, state), (p_ref, a_ref) in zip(log, ref):
        for k in SMALL:
            np.testing.assert_allclose(np.asarray(state.anchor[k]), a_ref[k], rtol=2e-5, atol=1e-6)
            for w in range(2):
                np.testing.assert_allclose(p[w][k], p_ref[w][k], rtol=2e-5, atol=1e-6)
    every_step = [c for c in drv.collectives if not c.in_conditional]
    assert [c.group_size for c in every_step] == [4]
    assert {c.group_size for c in drv.collectives if c.in_conditional} == {2}
    with pytest.raises(ValueError, match="`inner_axis_name`"):
        cj.diloco(optax.sgd(LR), nesterov(), sync_every=3, axis_name="dc", inner_axis_name="dc")


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, match", [
    (dict(sync_every=6, fragments=4), "`fragments` \\(4\\) must divide `sync_every` \\(6\\).*\\[1, 2, 3, 6\\]"),
    (dict(sync_every=4, fragments=0), "`fragments`"),
    (dict(sync_every=4, overlap=4), "`overlap` \\(4\\) must be smaller than `sync_every`"),
    (dict(sync_every=4, overlap=-1), "`overlap`"),
    (dict(sync_every=4, mix=1.5), "`mix` must be a number in \\[0.0, 1.0\\]"),
    (dict(sync_every=4, mix=-0.1), "`mix`"),
    (dict(sync_every=4, mix=float("nan")), "`mix`"),
    (dict(sync_every=0), "`sync_every`"),
    (dict(sync_every=4, axis_name="data", inner_axis_name="data"), "`inner_axis_name`"),
    (dict(sync_every=4, axis_name=None, inner_axis_name="data"), "`inner_axis_name` needs"),
])
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        streaming_diloco(optax.sgd(0.1), nesterov(), **kwargs)


def test_bad_types_and_too_many_fragments():
    with pytest.raises(TypeError, match="`compressor`"):
        streaming_diloco(optax.sgd(0.1), nesterov(), sync_every=4, compressor="q4")
    with pytest.raises(TypeError, match="`outer`"):
        streaming_diloco(optax.sgd(0.1), lambda g: g, sync_every=4)
    tx = streaming_diloco(optax.sgd(0.1), nesterov(), sync_every=4, fragments=4)
    with pytest.raises(ValueError, match="`fragments` \\(4\\) is more than the parameters' 3 elements"):
        tx.init({"w": jnp.zeros((3,))})
    with pytest.raises(ValueError, match="no elements to sync"):  # it said "pass fragments <= 0"
        tx.init({"w": jnp.zeros((0, 5))})
    one = streaming_diloco(optax.sgd(0.1), nesterov(), sync_every=4, axis_name=None)
    with pytest.raises(ValueError, match="params"):
        one.update(SMALL, one.init(SMALL))


def _tiles(groups, params):
    """Each leaf's pieces cover it exactly once, in order."""
    leaves = jax.tree_util.tree_leaves(params)
    for i, leaf in enumerate(leaves):
        spans = sorted((q.start, q.stop) for g in groups for q in g if q.leaf == i)
        assert spans[0][0] == 0 and spans[-1][1] == leaf.size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    return [sum(q.stop - q.start for q in g) for g in groups]


def test_fragments_balance_elements_and_state_layout():
    params = {"a": jnp.zeros((10,)), "b": jnp.zeros((30,)), "c": jnp.zeros((5, 4)), "d": jnp.zeros((50,))}
    assert fragment_leaves(params, 1) == (tuple(Piece(i, 0, v.size, v.shape) for i, v in
                                                enumerate(params.values())),)
    # 110 elements: no fragment above ceil(110 / P), whatever the leaves.
    assert _tiles(fragment_leaves(params, 2), params) == [55, 55]
    assert _tiles(fragment_leaves(params, 3), params) == [36, 37, 37]
    assert _tiles(fragment_leaves(params, 4), params) == [27, 28, 27, 28]
    # Whole rows keep the leaf's trailing shape; a cut inside a row is one (1, n) row.
    assert fragment_leaves({"c": jnp.zeros((6, 4))}, 3)[1] == (Piece(0, 8, 16, (2, 4)),)
    assert fragment_leaves({"c": jnp.zeros((5, 4))}, 3)[1] == (Piece(0, 6, 13, (1, 7)),)
    # The exact-mean plan: each fragment exactly 1/P of the full sync when P divides T.
    b = streaming_diloco_bytes(SMALL, N, sync_every=6, fragments=3)
    assert b.per_fragment == (cj.ring_bytes("all-reduce", 4 * 152, N),) * 3 and max(b.per_fragment) * 3 == b.full_sync
    tx = streaming_diloco(optax.adam(1e-3), nesterov(), sync_every=4, fragments=2, overlap=1,
                          compressor=cj.quantize(4), num_replicas=N)
    s = tx.init(BIG)
    assert isinstance(s, StreamingDiLoCoState)
    mask = cj.per_replica_mask(s)
    assert all(jax.tree_util.tree_leaves(mask.inner_state))
    assert not any(jax.tree_util.tree_leaves((mask.anchor, mask.outer_state, mask.count, mask.pending)))
    assert all(m.residual for m in mask.exchange) and len(s.exchange) == len(s.pending) == 2
    assert [p.shape for p in s.pending[0]] == [(128, 64), (32,)]  # 4 of 8 granules, half of "d"
