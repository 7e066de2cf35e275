"""1-bit Adam and 1-bit LAMB: exact warm-up, 1-bit momentum after it, bytes, safety, NaN."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.optimizers.onebit import OneBitAdamState, OneBitLambState, onebit_adam, onebit_lamb
from commjax.testing import noniid_classification, same_bits, train

N = 8



def exact_adam(lr, **kw):
    return optax.chain(cj.compressed_mean(cj.identity(), "data"), optax.adam(lr, **kw))


@pytest.fixture(scope="module")
def task():
    return noniid_classification(N)



# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("factory", [onebit_adam, onebit_lamb])
@pytest.mark.parametrize("kw,name", [
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(warmup_steps=2.5), "warmup_steps"),
    (dict(warmup_steps=10, b1=1.0), "b1"),
    (dict(warmup_steps=10, b2=-0.1), "b2"),
    (dict(warmup_steps=10, eps=-1.0), "eps"),
    (dict(warmup_steps=10, block_size=0), "block_size"),
    (dict(warmup_steps=10, var_floor=-0.5), "var_floor"),
    (dict(warmup_steps=10, var_floor=float("nan")), "var_floor"),
    (dict(warmup_steps=10, max_update_ratio=0.0), "max_update_ratio"),
    (dict(warmup_steps=10, weight_decay=-1e-4), "weight_decay"),
    (dict(warmup_steps=10, num_replicas=0), "num_replicas"),
])
def test_bad_options_name_the_argument(factory, kw, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        factory(1e-3, **kw)


def test_bad_lamb_options():
    with pytest.raises(ValueError, match="`warmup_steps`.*trust ratio"):
        onebit_lamb(1e-3, warmup_steps=0)
    with pytest.raises(ValueError, match="max_coeff"):
        onebit_lamb(1e-3, warmup_steps=5, min_coeff=1.0, max_coeff=0.5)
    with pytest.raises(ValueError, match="factor_min"):
        onebit_lamb(1e-3, warmup_steps=5, factor_min=2.0)
    with pytest.raises(ValueError, match="factor_threshold"):
        onebit_lamb(1e-3, warmup_steps=5, factor_threshold=1.0)


def test_params_requirements():
    params = {"w": jnp.ones((4, 4))}
    lamb = onebit_lamb(1e-3, warmup_steps=2, axis_name=None)
    with pytest.raises(ValueError, match="params"):
        lamb.update(params, lamb.init(params))
    wd = onebit_adam(1e-3, warmup_steps=2, axis_name=None, weight_decay=0.1)
    with pytest.raises(ValueError, match="params"):
        wd.update(params, wd.init(params))


def test_replicated_params_are_refused_under_vma_check(mesh, task):
    """Gradients of replicated (invariant) parameters were already summed by JAX."""
    tx = onebit_adam(1e-3, warmup_steps=3)
    state = cj.shard_state(tx.init(task.params), mesh, "data")
    specs = cj.state_specs(state, "data")

    def body(p, s, x, y):
        g = jax.grad(task.loss)(p, x[0], y[0])
        u, s = tx.update(g, s)
        return optax.apply_updates(p, u), s

    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                  out_specs=(P(), specs)))
    with pytest.raises(ValueError, match="replicated"):
        f.lower(task.params, state, task.x, task.y)


def test_state_layout():
    params = {"w": jnp.ones((64, 40)), "b": jnp.ones((40,)), "s": jnp.ones(())}
    s = onebit_adam(1e-3, warmup_steps=3, num_replicas=N, min_compress_size=256).init(params)[0]
    assert isinstance(s, OneBitAdamState)
    mask = cj.per_replica_mask(s)
    assert mask.exchange.residual and mask.exchange.server_residual
    assert not any(jax.tree_util.tree_leaves((mask.count, mask.mu, mask.nu, mask.exchange.count)))
    # Worker residual: one per compressed leaf, in its shape; server: one chunk of the
    # bucket padded to N blocks.
    assert [r.shape for r in s.exchange.residual] == [(64, 40)]
    assert s.exchange.server_residual.shape == (4096 // N,)  # 2560 -> 4096 = 2 * (256 * N)
    l = onebit_lamb(1e-3, warmup_steps=3, num_replicas=N, min_compress_size=256).init(params)[0]
    assert isinstance(l, OneBitLambState)
    lm = cj.per_replica_mask(l)
    assert lm.exchange.residual and lm.exchange.server_residual
    assert not any(jax.tree_util.tree_leaves((lm.coeff, lm.factor, lm.nu_fresh, lm.mu)))
    assert all(x.shape == () for x in jax.tree_util.tree_leaves(l.coeff))


# ------------------------------------------------------------------------- convergence

ADAM_STEPS, ADAM_WARMUP, LAMB_STEPS, LAMB_WARMUP, LR, LOG = 210, 70, 150, 50, 3e-3, 10


@pytest.fixture(scope="module")
def adam_runs(task):
    ref = train(exact_adam(LR), task, ADAM_STEPS, log_every=LOG)
    got = train(onebit_adam(LR, warmup_steps=ADAM_WARMUP), task, ADAM_STEPS, log_every=LOG)
    return ref, got


@pytest.fixture(scope="module")
def lamb_runs(task):
    ref = train(optax.chain(cj.compressed_mean(cj.identity(), "data"), optax.lamb(LR)),
                task, LAMB_STEPS, log_every=LOG)
    # Trust ratio unclipped, as optax.lamb, so that the warm-up can be compared step for step.
    got = train(onebit_lamb(LR, warmup_steps=LAMB_WARMUP, min_coeff=0.0, max_coeff=1e6),
                task, LAMB_STEPS, log_every=LOG)
    return ref, got


def test_warmup_is_exact_adam_then_compression_takes_over(adam_runs):
    ref, got = adam_runs
    w = ADAM_WARMUP // LOG
    # Exact Adam on the exact mean until the freeze (losses after every LOG-th step).
    np.testing.assert_allclose(got.losses[:w], ref.losses[:w], rtol=2e-5)
    # Then the 1-bit stage: a different trajectory.
    assert np.max(np.abs(got.losses[w:] - ref.losses[w:])) > 1e-4


def test_onebit_adam_within_10_percent_of_adam_and_replicas_identical(adam_runs):
    ref, got = adam_runs
    assert got.replicas_identical
    assert np.all(np.isfinite(got.losses))
    assert got.final_loss <= 1.10 * ref.final_loss, (got.final_loss, ref.final_loss)
    # The compressed stage did run: its momentum residuals are non-zero.
    assert max(float(np.abs(np.asarray(r)).max()) for r in got.opt_state[0].exchange.residual) > 0
    assert int(np.asarray(got.opt_state[0].count)) == ADAM_STEPS


def test_lamb_warmup_is_exact_lamb(lamb_runs):
    ref, got = lamb_runs
    w = LAMB_WARMUP // LOG
    np.testing.assert_allclose(got.losses[:w], ref.losses[:w], rtol=2e-5)


def test_onebit_lamb_trains_and_its_factor_obeys_the_rule(lamb_runs):
    ref, got = lamb_runs
    steps, wu = LAMB_STEPS, LAMB_WARMUP
    assert got.replicas_identical
    assert np.all(np.isfinite(got.losses))
    assert got.final_loss < got.losses[wu // LOG - 1]  # still improving after the freeze
    assert got.final_loss <= 1.25 * ref.final_loss, (got.final_loss, ref.final_loss)
    # factor stays in [factor_min, factor_max] and moved at most 10% per step from 1.
    fac = np.stack([np.asarray(f) for f in jax.tree_util.tree_leaves(got.opt_state[0].factor)])
    assert np.all((fac >= 0.5) & (fac <= 4.0))
    assert np.all(np.abs(np.log(fac)) <= (steps - wu) * np.log(1.1) + 1e-6)
    coeff = np.stack([np.asarray(c) for c in jax.tree_util.tree_leaves(got.opt_state[0].coeff)])
    assert np.all(np.isfinite(coeff)) and np.all(coeff > 0)


def test_lamb_trust_ratio_is_clipped():
    """One leaf whose trust ratio ||w|| / ||u|| is huge: the running average is clipped."""
    params = {"w": jnp.full((8, 8), 100.0)}
    tx = onebit_lamb(1e-3, warmup_steps=5, axis_name=None, max_coeff=10.0)
    state = tx.init(params)
    for _ in range(3):
        u, state = tx.update({"w": jnp.full((8, 8), 1.0)}, state, params)
    ratio = float(state[0].coeff["w"]) / (1 - 0.9 ** 3)
    assert ratio == pytest.approx(10.0, rel=1e-5)
    # u = m_hat / (sqrt(v_hat) + eps) = 1 / (1 + eps) entrywise, so the step is -lr * 10.
    np.testing.assert_allclose(np.asarray(u["w"]), -1e-3 * 10.0, rtol=1e-5)


def test_schedule_is_evaluated_at_the_step_count():
    """One replica (axis_name=None): the codec still runs after the warm-up. A schedule that
    drops to zero after 6 steps: steps 7 and 8 change nothing; before, it matches the
    constant learning rate bit for bit."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(32, 40)), jnp.float32)}
    grads = [{"w": jnp.asarray(rng.normal(size=(32, 40)), jnp.float32)} for _ in range(8)]

    def run(lr, steps):
        tx = onebit_adam(lr, warmup_steps=4, axis_name=None, min_compress_size=256)
        step = jax.jit(tx.update)
        p, s = params, tx.init(params)
        for t in range(steps):
            u, s = step(grads[t], s, p)
            p = optax.apply_updates(p, u)
        return p

    stop = optax.piecewise_constant_schedule(3e-3, {6: 0.0})
    six = run(3e-3, 6)
    assert same_bits(six, run(stop, 6))
    assert same_bits(six, run(stop, 8))
    assert not same_bits(six, run(3e-3, 8))


@pytest.mark.exact_codegen
def test_shard_map_vma_off_and_pmap_give_thesame_bits(task, adam_runs):
    """The vma check changes typing only; pmap lays the state out with a device axis."""
    a = adam_runs[1]
    tx = lambda: onebit_adam(LR, warmup_steps=ADAM_WARMUP)
    b = train(tx(), task, ADAM_STEPS, log_every=ADAM_STEPS, check_vma=False)
    c = train(tx(), task, ADAM_STEPS, log_every=ADAM_STEPS, use_pmap=True)
    assert b.replicas_identical and c.replicas_identical
    assert same_bits(a.params, b.params)
    assert same_bits(a.params, c.params)


# ------------------------------------------------------------------------- dead units


def _dead_unit_task(task, dead=8):
    """Hidden units whose bias is so negative that gelu and its gradient are exactly 0 on
    every input: their incoming weights get zero gradient through warm-up, so their
    frozen second moment is exactly zero."""
    p = dict(task.params)
    p["b0"] = p["b0"].at[:dead].set(-50.0)
    return dataclasses.replace(task, params=p)


def test_dead_units_do_not_blow_up_after_the_freeze(task):
    dtask = _dead_unit_task(task)
    steps, wu = 90, 40
    unguarded = train(onebit_adam(1e-2, warmup_steps=wu, var_floor=0.0, max_update_ratio=None),
                      dtask, steps, log_every=10)
    # Without the guards the zero-variance entries take steps of |m| / eps and the run
    # diverges (this is what the guards are for).
    assert not np.all(np.isfinite(unguarded.losses)) or unguarded.final_loss > 10.0
    guarded = train(onebit_adam(1e-2, warmup_steps=wu), dtask, steps, log_every=10)
    assert np.all(np.isfinite(guarded.losses))
    assert guarded.replicas_identical
    assert guarded.final_loss < guarded.losses[wu // 10 - 1]
    # The dead units' weights stayed of the order of the live ones.
    w0 = np.asarray(guarded.params["w0"])
    assert np.abs(w0[:, :8]).max() <= 2 * np.abs(w0[:, 8:]).max()


# ------------------------------------------------------------------------- bytes


BIG = {"w1": (1024, 2048), "w2": (2048, 512), "b1": (2048,), "b2": (512,)}  # 3.1M params


def _compile_report(tx, mesh):
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in BIG.items()}
    state = jax.eval_shape(tx.init, params)
    mask = cj.per_replica_mask(state)
    gstate = jax.tree_util.tree_map(
        lambda l, m: jax.ShapeDtypeStruct(((N * l.shape[0],) + l.shape[1:]) if m else l.shape, l.dtype),
        state, mask)
    specs = cj.state_specs(state, "data")
    grads = {k: jax.ShapeDtypeStruct((N,) + s, jnp.float32) for k, s in BIG.items()}

    def body(g, s):
        u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s)
        return jax.tree_util.tree_map(lambda a: a[None], u), s

    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P("data"), specs),
                                  out_specs=(P("data"), specs)))
    return cj.collective_bytes(f, grads, gstate)


def test_bytes_after_warmup_at_least_20x_below_exact(mesh):
    """Compile only, a 3.1M-parameter model on 8 replicas. Both stages sit behind one
    lax.cond (every collective is in a branch); the compressed branch is the one with the
    all-to-all."""
    n = sum(int(np.prod(s)) for s in BIG.values())
    exact = cj.ring_bytes("all-reduce", 4 * n, N)
    rep = _compile_report(onebit_adam(1e-3, warmup_steps=10), mesh)
    assert all(c.in_conditional for c in rep)
    branches = {}
    for c in rep:
        branches.setdefault(c.computation, []).append(c)
    assert len(branches) == 2
    comp = next(cs for cs in branches.values() if any(c.kind == "all-to-all" for c in cs))
    warm = next(cs for cs in branches.values() if cs is not comp)
    after = sum(c.ring_bytes for c in comp)
    assert exact >= 20 * after, (exact, after)
    # After warm-up: the payload travels as uint32 words (two-phase: all-to-all, then
    # all-gather); the only f32 is the small exact bucket (the biases; no NaN flags: the
    # gathered scale words tell).
    assert {c.kind for c in comp} == {"all-to-all", "all-gather", "all-reduce"}
    f32 = [c for c in comp if "f32" in c.dtypes]
    assert len(f32) == 1 and f32[0].operand_bytes == 4 * (2048 + 512)
    assert all(set(c.dtypes) == {"u32"} for c in comp if c.kind != "all-reduce")
    plan = cj.communication_plan(cj.sign(256), {k: jnp.zeros(s) for k, s in BIG.items()},
                                 num_replicas=N, reducer="two_phase")
    assert after == pytest.approx(plan.bytes_per_step)
    # Warm-up: one exact fp32 all-reduce of everything.
    assert [c.kind for c in warm] == ["all-reduce"] and warm[0].dtypes == ("f32",)
    assert sum(c.ring_bytes for c in warm) == pytest.approx(exact)


# Non-finite gradients in either stage: tests/test_contract.py (1-bit Adam after warm-up,
# 1-bit LAMB during it).


def test_init_sharded_sizes_the_state_for_the_mesh():
    """On a 4-device mesh the two-phase server residual is sized for 4 replicas."""
    mesh4 = _compat.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    params = {"w": jnp.ones((64, 40)), "b": jnp.ones((40,))}
    tx = onebit_adam(1e-3, warmup_steps=3, min_compress_size=256)
    state = cj.init_sharded(tx, params, mesh4, "data")
    assert [r.shape for r in state[0].exchange.residual] == [(4 * 64, 40)]
    assert state[0].exchange.server_residual.shape == (4 * (3072 // 4),)  # 2560 -> 3 * (256 * 4)
    assert state[0].mu["w"].shape == (64, 40)
