"""No silent drift, no silent poison, every mistake caught with a clear error.

Each test here is a case that once ran and gave wrong numbers without a word, or failed
with an error a user could not act on.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat, guards
from commjax.checkpoint import CheckpointDataError, CheckpointMismatchError, Checkpointer
from commjax.compressors.powersgd import matrix_shape

N = 8
AX = "data"


def step_fn(tx, params, mesh, check_vma=False):
    """One ``tx.update`` of per-replica gradients ``[N, ...]`` under shard_map."""
    state = cj.init_sharded(tx, params, mesh, AX)
    specs = cj.state_specs(state, AX)
    f = jax.jit(_compat.shard_map(
        lambda g, s: tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s), mesh=mesh,
        in_specs=(P(AX), specs), out_specs=(P(), specs), check_vma=check_vma))
    return f, state


# ------------------------------------------------------------------------- silent numbers


def test_complex_gradients_are_averaged(mesh):
    g = {"c": (jnp.arange(N * 6.0).reshape(N, 6) + 1j * jnp.arange(N * 6.0)[::-1].reshape(N, 6)
               ).astype(jnp.complex64),
         "w": jax.random.normal(jax.random.PRNGKey(0), (N, 64, 64))}
    f, state = step_fn(cj.compressed_mean(cj.quantize(8), AX), jax.tree_util.tree_map(lambda a: a[0], g), mesh)
    u, _ = f(g, state)
    np.testing.assert_allclose(np.asarray(u["c"]), np.asarray(g["c"].mean(0)), rtol=1e-6)
    assert u["c"].dtype == jnp.complex64


@pytest.mark.parametrize("name", ["q8", "sign", "q8_allgather", "identity"])
def test_a_representable_mean_survives_a_sum_that_overflows(mesh, name):
    """Every replica sends +5e37: the fp32 sum (4e38) overflows, the mean does not (and the
    identity's mean, which flags a non-finite leaf by itself, is not flagged)."""
    codec = {"q8": cj.quantize(8), "sign": cj.sign(), "q8_allgather": cj.quantize(8),
             "identity": cj.identity()}[name]
    reducer = "allgather" if name.endswith("allgather") else "two_phase"
    g = {"w": jnp.full((N, 64, 64), 5e37, jnp.float32)}
    f, state = step_fn(cj.compressed_mean(codec, AX, reducer=reducer), {"w": g["w"][0]}, mesh)
    u, state = f(g, state)
    np.testing.assert_allclose(np.asarray(u["w"]), 5e37, rtol=1e-5)
    assert float(state.metrics["nonfinite"][0]) == 0.0


def test_what_a_codec_cannot_carry_is_flagged_not_zeroed(mesh):
    """Past a codec's range (PowerSGD's factors; every other codec carries the whole finite
    range: tests/test_fullrange.py), the leaf's mean is NaN on every replica, flagged, and
    the residuals keep their value."""
    g = {"w": jnp.full((N, 64, 64), 1e38, jnp.float32)}
    f, state = step_fn(cj.compressed_mean(cj.powersgd(2), AX), {"w": g["w"][0]}, mesh)
    u, new = f(g, state)
    assert np.all(np.isnan(np.asarray(u["w"])))
    assert np.all(np.asarray(new.metrics["nonfinite"]) == 1.0)
    for a, b in zip(new.residual, state.residual):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_check_finite_false_nan_stays_nan_in_its_block(mesh):
    g = {"w": jax.random.normal(jax.random.PRNGKey(1), (N, 64, 64)).at[3, 0, 0].set(jnp.nan)}
    f, state = step_fn(cj.compressed_mean(cj.quantize(8), AX, check_finite=False), {"w": g["w"][0]}, mesh)
    u, _ = f(g, state)
    w = np.asarray(u["w"])
    assert np.isnan(w[0, 0]) and np.isfinite(w[-1, -1])


def test_float64_leaves_keep_their_precision(mesh):
    with jax.enable_x64(True):
        g = {"d": jnp.arange(N * 40 * 40, dtype=jnp.float64).reshape(N, 40, 40) * (1 + 1e-12)}
        f, state = step_fn(cj.compressed_mean(cj.identity(), AX), {"d": g["d"][0]}, mesh)
        u, _ = f(g, state)
        assert u["d"].dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(u["d"]), np.asarray(g["d"]).mean(0), rtol=1e-14)
        plan = cj.communication_plan(cj.quantize(8), {"d": g["d"][0]}, N)
        assert plan.routing.routes == ("exact",)
        assert cj.collective_bytes(f, g, state).total_ring_bytes == pytest.approx(plan.bytes_per_step)


# ------------------------------------------------------------------------- refused options


@pytest.mark.parametrize("call,match", [
    (lambda: cj.compressed_mean(cj.sign(), residual_dtype=jnp.float16), "residual_dtype"),
    (lambda: cj.compressed_mean(cj.random_k(0.1, rescale=True)), "error_feedback=False"),
    (lambda: cj.compressed_mean(cj.sign(), axis_name=3), "axis_name"),
    (lambda: cj.compressed_mean(cj.sign(), seed="x"), "seed"),
    (lambda: cj.compressed_mean(cj.sign(), error_feedback="yes"), "error_feedback"),
    (lambda: cj.compressed_mean(cj.sign(), check_finite="keep"), "True, False or 'reset'"),
    (lambda: cj.compressed_mean(cj.sign(), check_finite=1), "True, False or 'reset'"),
    (lambda: cj.compressed_mean(cj.sign(), check_finite="reset", error_feedback="ef21"), "ef21"),
    (lambda: cj.quantize(bits=4.0), "bits"),
    (lambda: cj.quantize(bits=True), "bits"),
    (lambda: cj.quantize(stochastic="no"), "stochastic"),
    (lambda: cj.cast("float8"), "dtype"),
    (lambda: cj.top_k(0.1, approximate=1), "approximate"),
    (lambda: cj.communication_plan(cj.sign(), {"w": jnp.zeros((4, 4))}, 0), "num_replicas"),
    (lambda: matrix_shape((5, 7), 5), "matrix_dims"),
])
def test_bad_options_are_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_random_k_rescaled_without_feedback_is_accepted():
    cj.compressed_mean(cj.random_k(0.1, rescale=True), error_feedback=False)


# ------------------------------------------------------------------------- state errors


def test_state_errors_name_the_cause(mesh):
    params = {"w": jnp.zeros((64, 64))}
    g = {"w": jnp.ones((N, 64, 64))}
    quant = cj.compressed_mean(cj.quantize(8), AX)

    def run(tx, state, specs, grad_spec=P(AX)):
        f = _compat.shard_map(lambda g, s: tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s),
                              mesh=mesh, in_specs=(grad_spec, specs), out_specs=(P(), specs))
        return jax.jit(f)(g, state)

    other = cj.init_sharded(cj.compressed_mean(cj.powersgd(2), AX), params, mesh, AX)
    with pytest.raises(ValueError, match="another compressor"):
        run(quant, other, cj.state_specs(other, AX))
    local = quant.init(params)  # never laid out: per-replica leaves carry the global view
    with pytest.raises(ValueError, match="cj.shard_state"):
        run(quant, local, jax.tree_util.tree_map(lambda _: P(), local))


def test_vary_outside_its_axis_names_the_axis(mesh):
    with pytest.raises(NameError, match="'dta' is not bound"):
        jax.jit(_compat.shard_map(lambda p: cj.vary(p, "dta"), mesh=mesh, in_specs=P(),
                                  out_specs=P()))(jnp.zeros(4))


@pytest.mark.parametrize("check_vma", [True, False])
def test_apply_if_finite_around_the_exchange_is_refused(mesh, check_vma):
    """Wrapped around the chain, apply_if_finite decides per replica whether to communicate:
    refused at trace time with the fix (instead of a hang or JAX's cond-branch error)."""
    params = {"w": jnp.zeros((64, 64))}
    for inner in (cj.compressed_mean(cj.sign(), AX), cj.dgc(0.1, ratio=0.1)):
        tx = optax.apply_if_finite(optax.chain(inner, optax.sgd(0.1)), 3)
        with pytest.raises(ValueError, match="apply_if_finite after the commjax transform"):
            state = cj.shard_state(tx.init(params), mesh, AX)
            specs = jax.tree_util.tree_map(lambda _: P(), state)
            f = _compat.shard_map(
                lambda g, s: tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, params),
                mesh=mesh, in_specs=(P(AX), specs), out_specs=(P(AX), specs), check_vma=check_vma)
            jax.jit(f).lower({"w": jnp.ones((N, 64, 64))}, state)


def test_random_k_masks_agree_even_when_the_replicated_key_does_not(mesh):
    """A "replicated" key that differs between devices (processes given different seeds):
    random-k positions come from replica 0's key, shared by the exact all-reduce, so every
    replica still decodes the same mean."""
    tx = cj.compressed_mean(cj.random_k(0.05), AX)
    params = {"w": jnp.zeros((64, 64))}
    state = cj.init_sharded(tx, params, mesh, AX)
    keys = [jax.device_put(jnp.asarray([7, 100 + i], jnp.uint32), d) for i, d in enumerate(mesh.devices.flat)]
    state = state._replace(key=jax.make_array_from_single_device_arrays(
        (2,), NamedSharding(mesh, P()), keys))
    specs = cj.state_specs(state, AX)
    f = jax.jit(_compat.shard_map(
        lambda g, s: jax.tree_util.tree_map(lambda a: a[None], tx.update({"w": g[0]}, s)[0]),
        mesh=mesh, in_specs=(P(AX), specs), out_specs=P(AX), check_vma=False))
    u = np.asarray(f(jax.random.normal(jax.random.PRNGKey(0), (N, 64, 64)), state)["w"])
    for r in range(1, N):
        np.testing.assert_array_equal(u[r], u[0])
    assert 0.03 < np.mean(u[0] != 0) < 0.07


@pytest.mark.parametrize("alternating", [False, True])
def test_powersgd_replicas_agree_even_when_the_replicated_q_does_not(mesh, alternating):
    """PowerSGD's initial Q drawn from a seed that differs between processes: the first
    step's estimate mixes different Q's, but every factor that is decoded has been
    all-reduced, so replicas still agree bit for bit, and from then on Q is the same."""
    tx = cj.compressed_mean(cj.powersgd(rank=2, alternating=alternating), AX)
    params = {"w": jnp.zeros((64, 64))}
    state = cj.init_sharded(tx, params, mesh, AX)
    q = state.compressor_state.q[0]
    qs = [jax.device_put(q * (1.0 + 0.1 * i), d) for i, d in enumerate(mesh.devices.flat)]
    differing = jax.make_array_from_single_device_arrays(q.shape, NamedSharding(mesh, P()), qs)
    state = state._replace(compressor_state=state.compressor_state._replace(q=(differing,)))
    specs = cj.state_specs(state, AX)

    def step(g, s):
        u, s = tx.update({"w": g[0]}, s)
        return u["w"][None], s.compressor_state.q[0][None]

    f = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(AX), specs),
                                  out_specs=(P(AX), P(AX)), check_vma=False))
    u, new_q = map(np.asarray, f(jax.random.normal(jax.random.PRNGKey(0), (N, 64, 64)), state))
    assert np.all(np.isfinite(u[0])) and np.any(u[0] != 0)
    for r in range(1, N):
        np.testing.assert_array_equal(u[r], u[0])
        np.testing.assert_array_equal(new_q[r], new_q[0])


def test_layout_helpers_name_bad_arguments(mesh):
    tx = cj.compressed_mean(cj.sign(), AX)
    state = tx.init({"w": jnp.zeros((64, 64))})
    with pytest.raises(ValueError, match="does not have"):
        cj.shard_state(state, mesh, "dta")
    laid = cj.shard_state(state, mesh, AX)
    with pytest.raises(ValueError, match="`replica` must be in"):
        cj.unshard_state(laid, replica=99)
    with pytest.raises(ValueError, match="num_devices"):
        cj.pmap_state(state, 99)


def test_damaged_checkpoints_are_reported_as_data_loss(tmp_path):
    """A truncated array file or a missing item is data loss, not a template mismatch."""
    tree = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "k": np.arange(3)}
    with Checkpointer(tmp_path / "a") as ckpt:
        ckpt.save(1, tree)
        with pytest.raises(CheckpointMismatchError, match="in the template"):
            ckpt.restore({"w": np.zeros((64, 32), np.float32), "k": np.arange(3)})
        for f in pathlib.Path(tmp_path / "a" / "1" / "state").rglob("*"):
            if f.is_file() and f.stat().st_size > 1000:
                f.write_bytes(f.read_bytes()[:100])  # truncate the array data
        with Checkpointer(tmp_path / "a") as fresh, pytest.raises(CheckpointDataError, match="truncated or corrupted"):
            fresh.restore(tree)
        ckpt.save(2, tree)
    for f in sorted(pathlib.Path(tmp_path / "a" / "2" / "meta").rglob("*"), reverse=True):
        f.unlink() if f.is_file() else f.rmdir()
    with Checkpointer(tmp_path / "a") as fresh, pytest.raises(CheckpointDataError, match="metadata"):
        fresh.restore(tree, step=2)


@pytest.mark.parametrize("hint", [0.0, 1.0, "true", 1e-30, 1e30, float("inf"), float("nan")])
@pytest.mark.parametrize("scale", [1e-36, 1e-30, 1e-20, 1e-3, 1.0, 1e10, 1e19, 1e30, 1e36])
def test_residual_norm_from_one_scaled_sum_is_right_whatever_the_hint(scale, hint):
    """``l2_norm_near`` (the residual metric: one plain sum, scaled by last step's norm)
    matches the float64 norm to 2e-6 for any magnitude and any hint, and is inf exactly
    where the norm exceeds float32's range, as ``l2_norm`` is."""
    rng = np.random.default_rng(0)
    parts = [(rng.standard_normal(n) * scale).astype(np.float32) for n in (5000, 777)]
    parts[1][:3] = 0.0
    true = np.sqrt(sum(np.sum(p.astype(np.float64) ** 2) for p in parts))
    h = true if hint == "true" else hint
    got = float(guards.l2_norm_near([jnp.asarray(p) for p in parts], h))
    if true > np.finfo(np.float32).max:
        assert np.isinf(got)
    else:
        assert abs(got - true) <= 2e-6 * true, (got, true)
    assert float(guards.l2_norm_near([jnp.zeros(10)], h)) == 0.0
    assert np.isnan(float(guards.l2_norm_near([jnp.asarray([1.0, np.nan])], h)))


@pytest.mark.parametrize("scale", [1e-36, 1e-30, 1e-18, 1e-3, 1.0, 1e10, 1e15, 1e19, 1e30, 1e36, 3e38])
def test_banded_norm_is_the_norm_over_the_whole_float_range(scale):
    """The residual metric on a TPU (``guards._banded_norm``: three fixed-scale sums of
    squares, no hint, no conditional) matches the float64 norm to 2e-6 at every magnitude,
    across the bands' edges (norms near 2**-30 and 2**50), is inf exactly where the norm
    exceeds float32's range, 0 for zeros, NaN with a NaN and inf with an infinite element."""
    rng = np.random.default_rng(1)
    parts = [(rng.standard_normal(n) * scale).astype(np.float32) for n in (5000, 777, 1)]
    parts[1][:3] = 0.0
    true = np.sqrt(sum(np.sum(p.astype(np.float64) ** 2) for p in parts))
    got = float(jax.jit(guards._banded_norm)([jnp.asarray(p) for p in parts]))
    if true > np.finfo(np.float32).max:
        assert np.isinf(got)
    else:
        assert abs(got - true) <= 2e-6 * true, (got, true)
    assert float(guards._banded_norm([jnp.zeros(10)])) == 0.0
    assert np.isnan(float(guards._banded_norm([jnp.asarray([1.0, np.nan, np.inf])])))
    assert float(guards._banded_norm([jnp.asarray([1.0, -np.inf])])) == np.inf
