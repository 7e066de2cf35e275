"""DiLoCo: local inner steps without communication, then one (compressed) mean per round."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.optimizers.diloco import DiLoCoState, diloco, landing_update
from commjax.testing import noniid_classification, ready, same_bits, train

N = 8
H = 10
STEPS = 200
INNER_LR = 0.3



def nesterov():
    return optax.sgd(0.7, momentum=0.9, nesterov=True)



@pytest.fixture(scope="module")
def task():
    return noniid_classification(N)


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("h", [0, -3, 2.5, True, None])
def test_sync_every_must_be_a_positive_integer(h):
    with pytest.raises(ValueError, match="`sync_every`"):
        diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=h)


def test_bad_arguments():
    with pytest.raises(TypeError, match="`compressor`"):
        diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=4, compressor="q4")
    with pytest.raises(TypeError, match="`inner`"):
        diloco(lambda g: g, optax.sgd(1.0), sync_every=4)
    params = {"w": jnp.ones((3, 3))}
    one = diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=4, axis_name=None)
    with pytest.raises(ValueError, match="params"):
        one.update(params, one.init(params))


def test_replicated_params_are_refused_under_vma_check(mesh, task):
    tx = diloco(optax.sgd(0.1), nesterov(), sync_every=H)
    state = cj.shard_state(tx.init(task.params), mesh, "data")
    specs = cj.state_specs(state, "data")

    def body(p, s, x, y):
        g = jax.grad(task.loss)(cj.vary(p, "data"), x[0], y[0])
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                  out_specs=(P(), specs)))
    with pytest.raises(ValueError, match="per replica"):
        f.lower(task.params, state, task.x, task.y)


def test_state_layout(task):
    tx = diloco(optax.adam(1e-3), nesterov(), sync_every=H, compressor=cj.quantize(4),
                num_replicas=N)
    s = tx.init(task.params)
    assert isinstance(s, DiLoCoState)
    mask = cj.per_replica_mask(s)
    # Inner state per replica (every leaf, scalars included, with a leading axis of 1),
    # anchor and outer state replicated, the exchange's residuals per replica.
    assert all(jax.tree_util.tree_leaves(mask.inner_state))
    assert all(x.shape[0] == 1 for x in jax.tree_util.tree_leaves(s.inner_state))
    assert not any(jax.tree_util.tree_leaves((mask.anchor, mask.outer_state, mask.count)))
    assert mask.exchange.residual and not mask.exchange.count
    assert same_bits(s.anchor, task.params)


# ------------------------------------------------------------------------- landing


def test_landing_update_exact_when_representable_and_bounded_otherwise():
    rng = np.random.default_rng(0)
    p = (rng.normal(size=200_000) * 0.1).astype(np.float32)
    # Entries that move by less than their own magnitude (Sterbenz: exact difference).
    n_small = (p * (1 + rng.uniform(-0.4, 0.4, p.shape))).astype(np.float32)
    u = np.asarray(jax.jit(landing_update)(p, n_small))
    assert np.array_equal(p + u, n_small)
    # Arbitrary moves, across zero included: within half an ulp of each term.
    n_any = (rng.normal(size=p.shape) * 0.1).astype(np.float32)
    u = np.asarray(jax.jit(landing_update)(p, n_any))
    got = (p + u).astype(np.float64)
    bound = 2.0 ** -24 * (np.abs(n_any.astype(np.float64) - p) + np.abs(n_any))
    assert np.all(np.abs(got - n_any) <= bound)
    # Exact wherever the difference itself is exact.
    exact = (n_any.astype(np.float64) - p) == (n_any - p).astype(np.float64)
    assert np.array_equal(got[exact], n_any[exact])
    assert 0 < np.sum(got != n_any) < np.sum(~exact) + 1


# ------------------------------------------------------------------------- runs


def _step_fn(tx, mesh, state, loss):
    """A shard_map step over per-replica params; also returns each device's anchor."""
    specs = cj.state_specs(state, "data")

    def body(p, s, x, y):
        p = jax.tree_util.tree_map(lambda a: a[0], p)
        g = jax.grad(loss)(p, x[0], y[0])
        u, s = tx.update(g, s, p)
        new = optax.apply_updates(p, u)
        ex = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)
        return ex(new), s, ex(s.anchor)

    return jax.jit(_compat.shard_map(
        body, mesh=mesh, in_specs=(P("data"), specs, P("data"), P("data")),
        out_specs=(P("data"), specs, P("data"))))


def _run(tx, task, mesh, steps):
    """Train with per-replica params; record (params in, params out, anchors) per step."""
    state = cj.shard_state(tx.init(task.params), mesh, "data")
    step = _step_fn(tx, mesh, state, task.loss)
    shard = NamedSharding(mesh, P("data"))
    params = jax.device_put(
        jax.tree_util.tree_map(lambda p: jnp.broadcast_to(p, (N,) + p.shape), task.params), shard)
    x, y = jax.device_put(task.x, shard), jax.device_put(task.y, shard)
    log = []
    for _ in range(steps):
        new, state, anchors = step(*ready(params, state, x, y))
        ready(new, state, anchors)
        log.append((jax.device_get(params), jax.device_get(new), jax.device_get(anchors)))
        params = new
    return log, state, step, (params, x, y)


@pytest.fixture(scope="module")
def recorded(task, mesh):
    tx = diloco(optax.adam(1e-2), nesterov(), sync_every=H)
    return _run(tx, task, mesh, 3 * H)


@pytest.mark.exact_codegen
def test_replicas_agree_after_every_sync_and_drift_between(recorded):
    log = recorded[0]
    for t, (p_in, p_out, anchors) in enumerate(log):
        for k in p_out:
            a = np.asarray(anchors[k])
            assert np.array_equal(a, np.broadcast_to(a[:1], a.shape)), "anchor differs"
            q = np.asarray(p_out[k]).astype(np.float64)
            if (t + 1) % H == 0:
                n = a[0].astype(np.float64)
                p = np.asarray(p_in[k]).astype(np.float64)
                # Every replica lands on the new shared parameters: exactly where the
                # difference is representable (moved less than the magnitude), else
                # within the stated bound.
                bound = 2.0 ** -24 * (np.abs(n - p) + np.abs(n))
                assert np.all(np.abs(q - n) <= bound), (t, k)
                sterbenz = (p * n > 0) & (np.abs(n - p) <= np.minimum(np.abs(n), np.abs(p)))
                assert np.array_equal(q[sterbenz], np.broadcast_to(n, q.shape)[sterbenz]), (t, k)
                assert np.mean(q == n) > 0.5
            elif k.startswith("w"):
                # Between syncs each replica trains on its own shard: they differ.
                assert not np.array_equal(q[0], q[1]), (t, k)
                if t % H:  # and the anchor only moves at syncs
                    np.testing.assert_array_equal(a, np.asarray(log[t - 1][2][k]))
    # The anchor moved at each sync.
    a0, a1 = log[H - 2][2]["w0"], log[H - 1][2]["w0"]
    assert not np.array_equal(a0, a1)


def test_non_sync_steps_send_nothing_and_sync_steps_one_mean(recorded, task):
    _, state, step, (params, x, y) = recorded
    rep = cj.collective_bytes(step, params, state, x, y)
    n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(task.params))
    assert len(rep) >= 1
    # Every collective sits in the sync branch of the lax.cond: the other branch (the
    # H - 1 inner steps of a round) has none.
    assert all(c.in_conditional for c in rep)
    assert len({c.computation for c in rep}) == 1
    assert rep.total_ring_bytes == pytest.approx(cj.ring_bytes("all-reduce", 4 * n, N))
    assert {d for c in rep for d in c.dtypes} == {"f32"}


def test_compressed_sync_sends_the_compressor_bytes_every_h_steps():
    """A sync sends the compressor's plan for the pseudo-gradient, once every H steps (the
    compiled step sends the plan: tests/test_contract.py)."""
    big = {"w": jnp.zeros((256, 512)), "b": jnp.zeros((512,))}
    tx = diloco(optax.sgd(0.1), nesterov(), sync_every=H, compressor=cj.quantize(4))
    plan = cj.communication_plan(tx, big, N)
    sync = cj.communication_plan(cj.quantize(4), big, N).bytes_per_step
    assert plan.peak_bytes == pytest.approx(sync) and plan.bytes_per_step == pytest.approx(sync / H)
    assert cj.ring_bytes("all-reduce", 4 * (256 * 512 + 512), N) >= 6 * sync


@pytest.fixture(scope="module")
def sgd_ref(task):
    return train(optax.chain(cj.compressed_mean(cj.identity(), "data"), optax.sgd(INNER_LR)),
                 task, STEPS)


def test_sync_every_step_with_plain_averaging_is_data_parallel_sgd(task, sgd_ref):
    got = train(diloco(optax.sgd(INNER_LR), optax.sgd(1.0), sync_every=1), task, 20)
    np.testing.assert_allclose(got.losses, sgd_ref.losses[:20], rtol=1e-5)


@pytest.mark.parametrize("compressor", [None, cj.quantize(4)], ids=["exact", "q4"])
def test_diloco_within_15_percent_of_data_parallel_inner_optimizer(task, sgd_ref, compressor):
    """DiLoCo with H = 10 (Nesterov outer step, lr 0.7, momentum 0.9) against the inner
    optimizer run data-parallel with the exact mean at every step, at equal steps."""
    got = train(diloco(optax.sgd(INNER_LR), nesterov(), sync_every=H, compressor=compressor),
                task, STEPS, log_every=H)
    assert np.all(np.isfinite(got.losses))
    assert got.final_loss <= 1.15 * sgd_ref.final_loss, (got.final_loss, sgd_ref.final_loss)
    assert got.final_loss < 0.8 * task.global_loss(task.params)
    assert STEPS % H == 0 and int(np.asarray(got.opt_state.count)) == STEPS


@pytest.mark.exact_codegen
def test_vma_off_and_pmap_give_thesame_bits(task):
    make = lambda: diloco(optax.adam(1e-2), nesterov(), sync_every=5)
    a = train(make(), task, 15, log_every=15)
    b = train(make(), task, 15, log_every=15, check_vma=False)
    c = train(make(), task, 15, log_every=15, use_pmap=True)
    assert same_bits(a.replica_params, b.replica_params)
    assert same_bits(a.replica_params, c.replica_params)


# ------------------------------------------------------------------------- non-finite


def test_nan_between_syncs_stays_local(mesh):
    params = {"w": jnp.ones((16, 8)), "b": jnp.zeros((8,))}
    tx = diloco(optax.adam(1e-2), nesterov(), sync_every=3)
    state = cj.shard_state(tx.init(params), mesh, "data")
    specs = cj.state_specs(state, "data")

    def body(p, g, s):
        u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s,
                         jax.tree_util.tree_map(lambda a: a[0], p))
        return jax.tree_util.tree_map(lambda a: a[None], u), s

    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data"), specs),
                                  out_specs=(P("data"), specs)))
    shard = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)
    p = jax.device_put(jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (N,) + a.shape), params), shard)

    def grads(nan_on=None):
        g = {k: rng.normal(size=(N,) + v.shape).astype(np.float32) for k, v in params.items()}
        if nan_on is not None:
            g["w"][nan_on, 0, 0] = np.nan
        return jax.device_put(g, shard)

    # Step 0 (inner): NaN on replica 2 only -> only replica 2's update is NaN, and its
    # inner state is kept.
    u, s1 = f(*ready(p, grads(nan_on=2), state))
    ready(u, s1)
    w = np.asarray(u["w"])
    assert np.all(np.isnan(w[2])) and np.all(np.isfinite(np.delete(w, 2, axis=0)))
    inner_old = jax.tree_util.tree_leaves(state.inner_state)
    inner_new = jax.tree_util.tree_leaves(s1.inner_state)
    for o, n_ in zip(inner_old, inner_new):
        o, n_ = np.asarray(o), np.asarray(n_)
        if o.shape[0] == N and o.ndim > 1 and o.dtype == np.float32:
            np.testing.assert_array_equal(n_[2], o[2])
    # A NaN at a sync reaches every replica and keeps the state: tests/test_contract.py.
