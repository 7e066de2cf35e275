"""commjax inside optax's wrappers and Flax's optimizer, under shard_map on 4 devices.

* ``optax.MultiSteps``: gradient accumulation with a compressed exchange inside equals a
  run that accumulates by hand and exchanges once per real step, **bit for bit** (the
  hand run uses MultiSteps' own running-mean formula ``acc + (g - acc) / (k + 1)``, so
  no round-off differs); the compressed-mean state advances once per real step.
* ``optax.inject_hyperparams``: the learning rate can be changed between steps.
* ``optax.apply_if_finite`` after ``compressed_mean``: a NaN gradient on one replica
  skips the step on every replica and leaves the error-feedback residuals unpoisoned.
* ``optax.partition`` / ``optax.masked``: parts of the model exempt from compression are
  averaged exactly (bit-identical to the exact-mean run's updates for those leaves).
* ``flax.nnx.Optimizer(model, tx, wrt=nnx.Param)`` with its state laid out per replica.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.metrics import compressed_mean_states, local_metrics, replica_metrics, step_metrics
from commjax.testing import flat_residual

N = 4
AX = "data"


DIM, HIDDEN, CLASSES, BATCH = 16, 64, 4, 8


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= N, "needs forced CPU devices (see conftest.py)"
    return _compat.make_mesh((N,), (AX,), devices=jax.devices()[:N])


def cm(compressor, **kw):
    """compressed_mean over AX, its state sized for the N-device mesh (init runs outside
    shard_map, where the default would be jax.device_count())."""
    return cj.compressed_mean(compressor, AX, num_replicas=N, **kw)


def init_params(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "w0": jax.random.normal(k[0], (DIM, HIDDEN)) / np.sqrt(DIM),   # 1024: compressed
        "b0": jnp.zeros((HIDDEN,)),                                     # exact bucket
        "w1": jax.random.normal(k[1], (HIDDEN, HIDDEN)) / np.sqrt(HIDDEN),  # compressed
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k[2], (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),  # 256: exact
    }


def loss_fn(p, x, y):
    h = jax.nn.gelu(x @ p["w0"] + p["b0"])
    h = jax.nn.gelu(h @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()


def batch(step: int, nan_replica: int | None = None):
    """Global batch of a step; replica r's inputs are shifted by r (non-i.i.d.)."""
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(7), step))
    x = jax.random.normal(kx, (N, BATCH, DIM)) + jnp.arange(N, dtype=jnp.float32)[:, None, None] * 0.5
    y = jax.random.randint(ky, (N, BATCH), 0, CLASSES)
    if nan_replica is not None:
        x = x.at[nan_replica, 0, 0].set(jnp.nan)
    return x.reshape(N * BATCH, DIM), y.reshape(N * BATCH)


def make_step(tx, mesh, params):
    """``(step, state)``: one data-parallel step ``(params, state, x, y) -> (params, state,
    updates)`` with replicated params and the state laid out per replica (found by
    tracing tx: MultiSteps' accumulators too, with nothing registered)."""
    state = cj.init_sharded(tx, init_params(), mesh, AX)
    specs = cj.state_specs(state, AX)

    def local(p, s, x, y):
        g = jax.grad(loss_fn)(cj.vary(p, AX), x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, u

    step = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(AX), P(AX)),
                                     out_specs=(P(), specs, P())))
    return step, state


def put(mesh, tree, spec=P()):
    return jax.device_put(tree, NamedSharding(mesh, spec))


def run(tx, mesh, steps, *, nan_at=None, nan_replica=1):
    params = put(mesh, init_params())
    step, state = make_step(tx, mesh, params)
    history = []
    for t in range(steps):
        x, y = batch(t, nan_replica if t == nan_at else None)
        params, state, updates = step(params, state, put(mesh, x, P(AX)), put(mesh, y, P(AX)))
        jax.block_until_ready(params)
        history.append((jax.device_get(params), jax.device_get(updates), state))
    return params, state, history


def assert_trees_equal(a, b):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def cm_state(state):
    found = compressed_mean_states(state)
    assert len(found) == 1, [p for p, _ in found]
    return found[0][1]


# --------------------------------------------------------------------------- MultiSteps


@pytest.mark.exact_codegen
def test_multisteps_equals_hand_accumulation_and_one_exchange_per_real_step(mesh):
    """MultiSteps(every_k=4) around [compressed_mean(4-bit), sgd] == accumulating the
    per-replica gradients by hand and running the exchange only every 4th micro-step."""
    k, real_steps = 4, 2
    inner = lambda: optax.chain(cm(cj.quantize(bits=4)), optax.sgd(0.3))  # noqa: E731
    ms = optax.MultiSteps(inner(), every_k_schedule=k)
    params_ms, state_ms, _ = run(ms.gradient_transformation(), mesh, k * real_steps)

    # By hand: per-replica running mean of the gradients (MultiSteps' formula), then one
    # exchange + update with the plain inner transform every k micro-steps.
    tx = inner()
    params = put(mesh, init_params())
    state = cj.shard_state(tx.init(init_params()), mesh, AX)
    specs = cj.state_specs(state, AX)

    def accumulate(p, acc, n_acc, x, y):
        g = jax.grad(loss_fn)(cj.vary(p, AX), x, y)
        return jax.tree_util.tree_map(lambda g_, a: (a + (g_ - a) / (n_acc + 1))[None],
                                      g, jax.tree_util.tree_map(lambda a: a[0], acc))

    def exchange(p, s, acc):
        u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], acc), s, p)
        return optax.apply_updates(p, u), s

    acc_step = jax.jit(_compat.shard_map(accumulate, mesh=mesh,
                                         in_specs=(P(), P(AX), P(), P(AX), P(AX)), out_specs=P(AX)))
    ex_step = jax.jit(_compat.shard_map(exchange, mesh=mesh, in_specs=(P(), specs, P(AX)),
                                        out_specs=(P(), specs)))
    zeros = put(mesh, jax.tree_util.tree_map(lambda a: jnp.zeros((N,) + a.shape), init_params()), P(AX))
    acc = zeros
    for t in range(k * real_steps):
        x, y = batch(t)
        acc = acc_step(params, acc, jnp.asarray(t % k, jnp.int32), put(mesh, x, P(AX)), put(mesh, y, P(AX)))
        jax.block_until_ready(acc)
        if t % k == k - 1:
            params, state = ex_step(params, state, acc)
            jax.block_until_ready(params)
            acc = zeros

    assert_trees_equal(params_ms, params)
    inner_state = state_ms.inner_opt_state
    # The compressed mean advanced once per real step, with the same residuals and keys.
    assert int(np.asarray(cm_state(inner_state).count).ravel()[0]) == real_steps
    assert_trees_equal(cm_state(inner_state), cm_state(state))
    assert float(np.max(flat_residual(cm_state(state), N))) > 0  # EF actually in play


def test_multisteps_state_lays_out_and_reports_metrics(mesh):
    ms = optax.MultiSteps(optax.chain(cm(cj.quantize(bits=8)), optax.sgd(0.1)),
                          every_k_schedule=2)
    params = init_params()
    state = cj.init_sharded(ms, params, mesh, AX)
    specs = cj.state_specs(state, AX)
    s = cm_state(specs)
    assert s.residual == (P(AX),) * len(s.residual) and s.residual and s.count == P()
    assert all(sp == P(AX) for sp in jax.tree_util.tree_leaves(
        specs.acc_grads, is_leaf=lambda x: isinstance(x, P)))
    assert specs.mini_step == P()
    assert state.acc_grads["w0"].shape == (N * DIM, HIDDEN)
    plan = cj.communication_plan(cj.quantize(bits=8), params, N)
    m = step_metrics(state, plan)
    assert m["exchanges"] == 0 and m["bytes_per_step"] == plan.bytes_per_step


# ------------------------------------------------------------------ inject_hyperparams


def test_inject_hyperparams_learning_rate_changes_take_effect(mesh):
    make = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(cm(cj.quantize(bits=8, stochastic=False)),
                                          optax.sgd(learning_rate)))
    tx = make(learning_rate=0.1)
    params = put(mesh, init_params())
    step, state = make_step(tx, mesh, params)
    x, y = (put(mesh, a, P(AX)) for a in batch(0))
    p1, s1, u1 = step(params, state, x, y)
    jax.block_until_ready(p1)
    # Same step with the learning rate set to 0.3 in the state: updates scale by 3.
    s_hi = s1._replace(hyperparams={"learning_rate": put(mesh, jnp.asarray(0.3))})
    s_lo = s1
    p2a, _, u_lo = step(p1, s_lo, x, y)
    jax.block_until_ready(p2a)
    p2b, s2b, u_hi = step(p1, s_hi, x, y)
    jax.block_until_ready(p2b)
    for a, b in zip(jax.tree_util.tree_leaves(u_lo), jax.tree_util.tree_leaves(u_hi)):
        np.testing.assert_allclose(np.asarray(b), 3.0 * np.asarray(a), rtol=1e-5, atol=1e-8)
    assert float(np.asarray(s2b.hyperparams["learning_rate"])) == pytest.approx(0.3)
    assert all(r.sharding.spec == P(AX) for r in cm_state(s2b).residual)


# ------------------------------------------------------------------------ apply_if_finite


def test_apply_if_finite_after_compressed_mean_skips_nan_step_everywhere(mesh):
    """A NaN gradient on replica 1 only: every replica skips the step (parameters and
    Adam state unchanged, identical everywhere), the residuals keep their last finite
    value, and training continues finite."""
    tx = optax.chain(cm(cj.quantize(bits=4)),
                     optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3))
    nan_at = 3
    params, state, hist = run(tx, mesh, 6, nan_at=nan_at, nan_replica=1)
    before, after = hist[nan_at - 1], hist[nan_at]
    assert_trees_equal(before[0], after[0])  # parameters unchanged by the NaN step
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree_util.tree_leaves(after[1]))
    cm_before, cm_after = cm_state(before[2]), cm_state(after[2])
    np.testing.assert_array_equal(flat_residual(cm_before, N), flat_residual(cm_after, N))
    assert np.all(np.isfinite(flat_residual(cm_after, N)))
    assert float(np.max(np.asarray(cm_after.metrics["nonfinite"]))) == 1.0
    finite_state = state[1]
    assert int(np.asarray(finite_state.total_notfinite)) == 1
    # Adam's moments were not touched by the NaN and everything stays finite afterwards.
    assert_trees_equal(before[2][1].inner_state, after[2][1].inner_state)
    for leaf in jax.tree_util.tree_leaves(params):
        assert np.all(np.isfinite(np.asarray(leaf)))
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])  # replicas in sync
    assert float(np.max(np.asarray(cm_state(state).metrics["nonfinite"]))) == 0.0


def test_apply_if_finite_around_the_exchange_is_refused_at_trace_time(mesh):
    """Wrapping compressed_mean *inside* apply_if_finite makes the skip decision per
    replica (before the exchange), so replicas would take different branches around a
    collective; the layout traced from it refuses the per-replica skip counter (before
    any step is traced), and under check_vma=True JAX refuses the step too (no hang)."""
    tx = optax.apply_if_finite(optax.chain(cm(cj.quantize(bits=4)), optax.adam(1e-2)), 3)
    with pytest.raises((TypeError, ValueError),
                       match="apply_if_finite after the commjax transform|cond branches|differs between replicas"):
        run(tx, mesh, 1)


# ---------------------------------------------------------------- partition / masked

COMPRESSED = ("w0",)  # only w0 is compressed; w1 (also >= 1024 elements) is exempt


def labels_of(params):
    return {k: ("compress" if k in COMPRESSED else "exact") for k in params}


def partition_tx():
    return optax.partition(
        {"compress": optax.chain(cm(cj.quantize(bits=4)), optax.sgd(0.5)),
         "exact": optax.chain(cm(cj.identity(), error_feedback=False), optax.sgd(0.5))},
        labels_of(init_params()))


@pytest.fixture(scope="module")
def partition_run(mesh):
    return run(partition_tx(), mesh, 2)


@pytest.mark.exact_codegen
def test_partition_leaves_exempt_parts_exact(mesh, partition_run):
    exact = optax.chain(cm(cj.identity()), optax.sgd(0.5))
    _, state_p, hist_p = partition_run
    _, _, hist_e = run(exact, mesh, 1)
    up, ue = hist_p[0][1], hist_e[0][1]
    for k in init_params():
        if k in COMPRESSED:
            assert not np.array_equal(np.asarray(up[k]), np.asarray(ue[k])), k
        else:
            np.testing.assert_array_equal(np.asarray(up[k]), np.asarray(ue[k]), err_msg=k)
    # The exact mean really is the mean of the replicas' own gradients.
    x, y = batch(0)
    grads = [jax.grad(loss_fn)(init_params(), x[r * BATCH:(r + 1) * BATCH], y[r * BATCH:(r + 1) * BATCH])
             for r in range(N)]
    mean_w1 = np.mean([np.asarray(g["w1"]) for g in grads], axis=0)
    np.testing.assert_allclose(np.asarray(up["w1"]), -0.5 * mean_w1, rtol=1e-5, atol=1e-7)
    # Two compressed-mean states, one per group; only the compressed one keeps residuals.
    found = compressed_mean_states(state_p)
    assert len(found) == 2
    sizes = sorted(flat_residual(s, N).size for _, s in found)
    assert sizes == [0, N * DIM * HIDDEN]


@pytest.mark.exact_codegen
def test_masked_pair_equals_partition(mesh, partition_run):
    """optax.masked(compressed_mean(q4), m) + optax.masked(compressed_mean(identity), ~m)
    then sgd is the same as optax.partition of the two, bit for bit, over two steps."""
    params = init_params()
    mask = {k: k in COMPRESSED for k in params}
    inv = {k: not v for k, v in mask.items()}
    masked = optax.chain(optax.masked(cm(cj.quantize(bits=4)), mask),
                         optax.masked(cm(cj.identity(), error_feedback=False), inv),
                         optax.sgd(0.5))
    pm, sm, _ = run(masked, mesh, 2)
    pp, sp, _ = partition_run
    assert_trees_equal(pm, pp)
    rm = sorted(flat_residual(s, N).size for _, s in compressed_mean_states(sm))
    assert rm == [0, N * DIM * HIDDEN]
    res_m = [flat_residual(s, N) for _, s in compressed_mean_states(sm) if s.residual]
    res_p = [flat_residual(s, N) for _, s in compressed_mean_states(sp) if s.residual]
    np.testing.assert_array_equal(res_m[0], res_p[0])


def test_step_metrics_reads_every_compressed_mean_state(partition_run):
    """commjax.metrics on a partition state (two compressed means): residual norms from
    the per-replica residuals, bytes from the plans, no collective."""
    _, state, _ = partition_run
    params = init_params()
    plans = [cj.communication_plan(cj.quantize(bits=4), {k: v for k, v in params.items() if k in COMPRESSED}, N),
             cj.communication_plan(cj.identity(), {k: v for k, v in params.items() if k not in COMPRESSED}, N)]
    found = compressed_mean_states(state)
    assert ["compress" in p for p, _ in found] == [True, False], [p for p, _ in found]
    m = step_metrics(state, plans)
    res = flat_residual(found[0][1], N).astype(np.float64)
    norms = np.linalg.norm(res, axis=1)
    assert len(set(np.round(norms, 6))) > 1  # replicas really hold different residuals
    assert m["residual_norm"] == pytest.approx(np.sqrt(np.mean(norms ** 2)), rel=1e-5)
    assert m["residual_norm_max"] == pytest.approx(norms.max(), rel=1e-5)
    assert m["exchanges"] == 2 and m["nonfinite"] == 0.0
    sent = plans[0].bytes_per_step + plans[1].bytes_per_step
    assert m["bytes_per_step"] == sent and m["bytes_sent"] == 2 * sent
    assert m["compression_ratio"] == pytest.approx((plans[0].baseline_bytes + plans[1].baseline_bytes) / sent)
    per = replica_metrics(state)
    np.testing.assert_allclose(per[0]["residual_norm"], norms, rtol=1e-5)
    assert set(local_metrics(state)) == {f"{p}/{k}" for p, s in found for k in s.metrics}
    with pytest.raises(ValueError, match="2 compressed-mean state"):
        step_metrics(state, plans[:1])
    with pytest.raises(ValueError, match="no CompressedMeanState"):
        step_metrics(optax.adam(1e-3).init(params))
    # The same state in the pmap layout (a leading device axis on every leaf) reads the same.
    def to_pmap(a, per_rep):
        a = np.asarray(a)
        if per_rep:
            return a.reshape((N, a.shape[0] // N) + a.shape[1:])
        return np.broadcast_to(a, (N,) + a.shape)

    pm = step_metrics(jax.tree_util.tree_map(to_pmap, state, cj.per_replica_mask(state)), plans)
    assert pm["residual_norm"] == pytest.approx(m["residual_norm"], rel=1e-6)


# ------------------------------------------------------------------------ nnx.Optimizer


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(DIM, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.gelu(self.l1(x)))


def nnx_optimizer_layout(optimizer: nnx.Optimizer, mesh):
    """Lay out an ``nnx.Optimizer``'s state: ``cj.shard_state`` on its optax state (which
    still has the NamedTuple types that mark per-replica fields), then read the specs
    back from the shardings after ``nnx.split`` (which turns NamedTuples into dicts)."""
    optimizer.opt_state = cj.shard_state(optimizer.opt_state, mesh, AX)
    graphdef, state = nnx.split(optimizer)
    state = jax.tree_util.tree_map(
        lambda a: a if isinstance(getattr(a, "sharding", None), NamedSharding) else put(mesh, a), state)
    specs = jax.tree_util.tree_map(lambda a: a.sharding.spec, state)
    return graphdef, state, specs


@pytest.mark.exact_codegen
def test_nnx_optimizer_matches_functional_chain(mesh):
    tx_fn = lambda: optax.chain(cm(cj.quantize(bits=4)), optax.adam(1e-2))  # noqa: E731
    model = MLP(nnx.Rngs(0))
    mgd, mstate = nnx.split(model)
    optimizer = nnx.Optimizer(model, tx_fn(), wrt=nnx.Param)
    ogd, ostate, ospecs = nnx_optimizer_layout(optimizer, mesh)
    flat_specs = [s for s in jax.tree_util.tree_leaves(ospecs, is_leaf=lambda s: isinstance(s, P))]
    assert P(AX) in flat_specs and P() in flat_specs  # residuals per replica, the rest replicated
    mstate = put(mesh, mstate)

    def nnx_step(mstate, ostate, x, y):
        model = nnx.merge(mgd, mstate)
        opt = nnx.merge(ogd, ostate)
        params = nnx.state(model, nnx.Param)
        g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
            nnx.merge(mgd, p)(x), y).mean())(cj.vary(params, AX))
        opt.update(model, g)
        return nnx.state(model), nnx.state(opt)

    step = jax.jit(_compat.shard_map(nnx_step, mesh=mesh, in_specs=(P(), ospecs, P(AX), P(AX)),
                                     out_specs=(P(), ospecs)))

    # The same model trained functionally with cj.shard_state/cj.state_specs.
    _, params0 = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    tx = tx_fn()
    fstate = cj.shard_state(tx.init(params0), mesh, AX)
    fspecs = cj.state_specs(fstate, AX)

    def fn_step(p, s, x, y):
        g = jax.grad(lambda q: optax.softmax_cross_entropy_with_integer_labels(
            nnx.merge(nnx.split(MLP(nnx.Rngs(0)), nnx.Param)[0], q)(x), y).mean())(cj.vary(p, AX))
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    fstep = jax.jit(_compat.shard_map(fn_step, mesh=mesh, in_specs=(P(), fspecs, P(AX), P(AX)),
                                      out_specs=(P(), fspecs)))
    fparams = put(mesh, params0)
    for t in range(3):
        x, y = (put(mesh, a, P(AX)) for a in batch(t))
        mstate, ostate = step(mstate, ostate, x, y)
        jax.block_until_ready(mstate)
        fparams, fstate = fstep(fparams, fstate, x, y)
        jax.block_until_ready(fparams)
    nnx_params = nnx.state(nnx.merge(mgd, mstate), nnx.Param)
    assert_trees_equal(nnx_params, fparams)
    assert int(np.asarray(ostate["step"][...])) == 3
    residual = ostate["opt_state"][0]["residual"][0][...]
    assert residual.sharding.spec == P(AX)
    np.testing.assert_array_equal(np.asarray(residual), np.asarray(fstate[0].residual[0]))
