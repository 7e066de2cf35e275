"""compressed_mean: error feedback, replica agreement, layouts, bad input, non-finite."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.testing import block_codecs, flat_residual, noniid_classification, ready, train


COMPRESSORS = block_codecs()


@pytest.fixture(scope="module")
def task():
    return noniid_classification(8, examples_per_replica=64, dim=16, hidden=32)


def _tx(comp, **kw):
    kw.setdefault("min_compress_size", 256)
    return optax.chain(cj.compressed_mean(comp, "data", **kw), optax.sgd(0.1, momentum=0.9))


# Replicas identical, NaN on one replica and unbound axes for every codec: tests/test_contract.py.
@pytest.mark.exact_codegen
@pytest.mark.parametrize("name", ["q4", "sign"])
def test_replicas_bit_identical_shard_map_without_vma_check(task, name):
    res = train(_tx(COMPRESSORS[name]), task, 50, log_every=50, check_vma=False)
    ref = train(_tx(COMPRESSORS[name]), task, 50, log_every=50, check_vma=True)
    assert res.replicas_identical
    # The vma check changes typing only, never numbers.
    for a, b in zip(jax.tree_util.tree_leaves(res.params), jax.tree_util.tree_leaves(ref.params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["identity", "q4"])
def test_replicas_bit_identical_after_50_steps_pmap(task, name):
    res = train(_tx(COMPRESSORS[name]), task, 50, log_every=50, use_pmap=True)
    assert res.replicas_identical
    assert res.final_loss < task.global_loss(task.params)


def test_exact_mean_matches_plain_mean():
    """identity via compressed_mean equals the fp32 mean of the replicas' gradients."""
    mesh = _compat.make_mesh((8,), ("data",))
    g = jax.random.normal(jax.random.PRNGKey(0), (8, 64, 48))
    tx = cj.compressed_mean(cj.identity(), "data", min_compress_size=16)
    state = cj.shard_state(tx.init(g[0]), mesh, "data")
    specs = cj.state_specs(state, "data")

    def f(g, s):
        out, _ = tx.update(g[0], s)
        return out

    out = jax.jit(_compat.shard_map(f, mesh=mesh, in_specs=(P("data"), specs), out_specs=P()))(*ready(g, state))
    np.testing.assert_allclose(out, g.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["q4", "q2", "sign", "qsgd", "cast"])
def test_error_feedback_identity_is_exact(name):
    """One replica, three steps: output == C(g + e) and new e == (g + e) - C(g + e), bitwise,
    with C applied by the compressor itself under the same per-step key."""
    comp = COMPRESSORS[name]
    tx = cj.compressed_mean(comp, axis_name=None, min_compress_size=1, seed=3)
    shape = (40, 33)
    state = tx.init(jnp.zeros(shape))
    e = np.zeros(shape, np.float32)
    update = jax.jit(tx.update)
    for t in range(3):
        g = jax.random.normal(jax.random.PRNGKey(10 + t), shape)
        out, state = update(g, state)
        x = g + jnp.asarray(e)
        key = jax.random.fold_in(jax.random.PRNGKey(3), t)
        cx = np.asarray(comp.roundtrip(x, key))
        # The output is C(x) with the step's key (up to the last-bit differences that two
        # separately compiled programs may round differently)...
        np.testing.assert_allclose(np.asarray(out), cx, rtol=2e-7, atol=1e-7)
        (res,) = state.residual  # one compressed leaf, one residual of its size
        res = np.asarray(res).reshape(shape)
        # ...and the residual is what was not sent: e' = (g + e) - C(g + e), exactly up to
        # the single rounding of the subtraction (XLA may fuse C's last multiply into it).
        want = np.asarray(x) - np.asarray(out)
        # The product's own rounding is what an FMA skips: at most one ulp of C(x).
        ulp = np.spacing(np.maximum(np.abs(np.asarray(out)), np.abs(want)).astype(np.float32))
        assert np.all(np.abs(res - want) <= ulp), np.abs(res - want).max()
        e = res


def test_error_feedback_telescopes_over_steps():
    """Sum of outputs + final residual == sum of gradients (within fp32 round-off)."""
    tx = cj.compressed_mean(cj.sign(), axis_name=None, min_compress_size=1)
    shape = (64, 64)
    state = tx.init(jnp.zeros(shape))
    total_g = np.zeros(shape, np.float64)
    total_out = np.zeros(shape, np.float64)
    update = jax.jit(tx.update)
    for t in range(20):
        g = jax.random.normal(jax.random.PRNGKey(t), shape)
        out, state = update(g, state)
        total_g += np.asarray(g, np.float64)
        total_out += np.asarray(out, np.float64)
    res = np.asarray(state.residual[0], np.float64).reshape(shape)
    np.testing.assert_allclose(total_out + res, total_g, atol=1e-4)


def test_without_error_feedback_state_has_no_residual():
    tx = cj.compressed_mean(cj.quantize(4), axis_name=None, error_feedback=False, min_compress_size=1)
    state = tx.init(jnp.zeros((32, 32)))
    assert state.residual == ()
    out, state2 = jax.jit(tx.update)(jnp.ones((32, 32)), state)
    assert state2.residual == ()
    np.testing.assert_allclose(out, 1.0)


def test_bf16_residual_halves_memory_and_trains(task):
    tx = _tx(cj.quantize(4), residual_dtype=jnp.bfloat16)
    s = tx.init(task.params)
    assert s[0].residual and all(r.dtype == jnp.bfloat16 for r in s[0].residual)
    res = train(tx, task, 30, log_every=30)
    assert res.replicas_identical and res.final_loss < task.global_loss(task.params)


def test_axis_none_runs_codec_without_collectives():
    tx = cj.compressed_mean(cj.quantize(2, stochastic=False), axis_name=None, min_compress_size=1)
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 64))
    state = tx.init(x)
    out, _ = jax.jit(tx.update)(x, state)
    assert not np.array_equal(np.asarray(out), np.asarray(x))  # it really compressed
    report = cj.collective_bytes(jax.jit(tx.update), x, state)
    assert len(report.collectives) == 0


def test_unbound_axis_error_names_axis_and_fix():
    tx = cj.compressed_mean(cj.quantize(8), "batch")
    p = {"w": jnp.ones((64, 64))}
    state = tx.init(p)
    with pytest.raises(NameError, match="'batch'.*shard_map") as info:
        tx.update(p, state)
    assert "shard_map" in str(info.value) and "axis_name=None" in str(info.value)
    with pytest.raises(cj.AxisNotBoundError):
        jax.jit(tx.update)(p, state)


def test_replicated_gradients_are_refused_under_vma_check():
    mesh = _compat.make_mesh((8,), ("data",))
    tx = cj.compressed_mean(cj.quantize(8), "data", min_compress_size=16)
    w = jnp.ones((32, 32))
    state = cj.shard_state(tx.init(w), mesh, "data")
    specs = cj.state_specs(state, "data")

    def f(w, s, x):
        g = jax.grad(lambda w: jnp.sum((x[0] @ w) ** 2))(w)  # w replicated: JAX psums g
        out, s = tx.update(g, s)
        return out, s

    x = jnp.ones((8, 4, 32))
    with pytest.raises(ValueError, match="cj.vary"):
        jax.jit(_compat.shard_map(f, mesh=mesh, in_specs=(P(), specs, P("data")),
                                  out_specs=(P(), specs)))(*ready(w, state, x))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"compressor": cj.sign(), "reducer": "allreduce"}, "reducer"),
        ({"compressor": cj.quantize(4), "reducer": "allreduce"}, "allgather"),
        ({"compressor": cj.quantize(4), "reducer": "ring"}, "reducer"),
        ({"compressor": cj.quantize(4), "min_compress_size": 0}, "min_compress_size"),
        ({"compressor": cj.quantize(4), "residual_dtype": jnp.int8}, "residual_dtype"),
        ({"compressor": cj.quantize(4), "num_replicas": 0}, "num_replicas"),
        ({"compressor": cj.quantize(4), "inner_axis_name": "data"}, "inner_axis_name"),
        ({"compressor": "q4"}, "compressor"),
    ],
)
def test_bad_options_raise_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cj.compressed_mean(axis_name="data", **kwargs)


def test_integer_leaves_pass_through_and_small_leaves_are_exact():
    mesh = _compat.make_mesh((8,), ("data",))
    tx = cj.compressed_mean(cj.sign(), "data", min_compress_size=256)
    params = {"w": jnp.zeros((32, 32)), "b": jnp.zeros((32,)), "step": jnp.zeros((), jnp.int32)}
    state = cj.shard_state(tx.init(params), mesh, "data")
    specs = cj.state_specs(state, "data")
    g = {
        "w": jax.random.normal(jax.random.PRNGKey(0), (8, 32, 32)),
        "b": jax.random.normal(jax.random.PRNGKey(1), (8, 32)),
        "step": jnp.arange(8, dtype=jnp.int32)[:, None],
    }

    def f(g, s):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        out, _ = tx.update(g, s)
        return jax.tree_util.tree_map(lambda a: a[None], out)

    out = jax.jit(_compat.shard_map(f, mesh=mesh, in_specs=(P("data"), specs), out_specs=P("data"),
                                    check_vma=False))(*ready(g, state))
    np.testing.assert_array_equal(out["step"][:, 0], np.arange(8))  # untouched, per replica
    np.testing.assert_allclose(out["b"][0], g["b"].mean(0), rtol=1e-5, atol=1e-6)  # exact
    assert not np.allclose(out["w"][0], g["w"].mean(0), atol=1e-3)  # compressed


@pytest.mark.parametrize("codec", [cj.sign(), cj.top_k(0.5), cj.quantize(8), cj.fp8("e4m3")],
                         ids=lambda c: c.name)
def test_a_scalar_leaf_is_averaged_exactly_whatever_the_size_options(codec):
    # min_compress_size=1 with compress_vectors would otherwise send a scalar through the
    # codec, whose per-replica residual has no axis to lay the replicas along.
    mesh = _compat.make_mesh((8,), ("data",))
    tx = cj.compressed_mean(codec, "data", min_compress_size=1, compress_vectors=True)
    params = {"w": jnp.zeros((8, 128)), "s": jnp.zeros(())}
    plan = cj.communication_plan(tx, params, 8)
    assert plan.routing.routes == ("exact", "compress")  # leaves in key order: s, w
    state = cj.init_sharded(tx, params, mesh, "data")
    specs = cj.state_specs(state, "data")
    g = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 8, 128)),
         "s": jnp.arange(8, dtype=jnp.float32) * 1e30}

    def f(g, s):
        out, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s)
        return jax.tree_util.tree_map(lambda a: a[None], out), s

    out, _ = jax.jit(_compat.shard_map(f, mesh=mesh, in_specs=(P("data"), specs),
                                       out_specs=(P("data"), specs)))(*ready(g, state))
    np.testing.assert_allclose(np.asarray(out["s"]), np.full(8, 3.5e30), rtol=1e-6)


def test_apply_if_finite_skips_poisoned_step():
    mesh = _compat.make_mesh((8,), ("data",))
    # apply_if_finite goes *after* compressed_mean: it then sees the shared (NaN) mean and
    # every replica skips together. Wrapped around compressed_mean it would test each
    # replica's local gradient and only some replicas would enter the collectives.
    tx = optax.chain(
        cj.compressed_mean(cj.quantize(4), "data", min_compress_size=64),
        optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5),
    )
    params = jnp.ones((16, 16))
    state = cj.shard_state(tx.init(params), mesh, "data")
    specs = cj.state_specs(state, "data")

    def f(p, s, g):
        u, s = tx.update(g[0], s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(_compat.shard_map(f, mesh=mesh, in_specs=(P(), specs, P("data")),
                                     out_specs=(P(), specs), check_vma=False))
    g = jnp.ones((8, 16, 16)).at[5, 0, 0].set(jnp.inf)
    p2, s2 = step(*ready(params, state, g))
    np.testing.assert_array_equal(np.asarray(p2), np.asarray(params))
    assert int(s2[1].notfinite_count) == 1
    assert np.all(np.isfinite(flat_residual(s2[0], 8)))
    p3, s3 = step(*ready(p2, s2, jnp.ones((8, 16, 16))))
    assert int(s3[1].notfinite_count) == 0
    assert not np.array_equal(np.asarray(p3), np.asarray(p2))


def test_state_specs_mark_only_residuals_per_replica():
    tx = optax.chain(cj.compressed_mean(cj.quantize(4), "data", num_replicas=8), optax.adam(1e-3))
    mesh = _compat.make_mesh((8,), ("data",))
    state = cj.shard_state(tx.init({"w": jnp.zeros((64, 64)), "b": jnp.zeros((64,))}), mesh, "data")
    specs = cj.state_specs(state, "data")
    cm = specs[0]
    assert cm.residual == (P("data"),) and cm.server_residual == P("data")
    assert cm.count == P() and cm.key == P()
    assert all(s == P() for s in jax.tree_util.tree_leaves(specs[1], is_leaf=lambda x: isinstance(x, P)))


def test_state_sized_for_other_replica_count_is_refused():
    mesh = _compat.make_mesh((8,), ("data",))
    tx = cj.compressed_mean(cj.quantize(4), "data", num_replicas=4, min_compress_size=64)
    params = jnp.zeros((64, 64))
    state = cj.shard_state(tx.init(params), mesh, "data")
    specs = cj.state_specs(state, "data")
    f = _compat.shard_map(lambda g, s: tx.update(g[0], s), mesh=mesh,
                          in_specs=(P("data"), specs), out_specs=(P(), specs))
    with pytest.raises(ValueError, match="num_replicas=8"):
        jax.jit(f)(*ready(jnp.ones((8, 64, 64)), state))


def test_hierarchical_inner_axis_exact_then_outer_compressed():
    mesh = _compat.make_mesh((2, 4), ("dcn", "ici"))
    tx = cj.compressed_mean(cj.quantize(8, stochastic=False), "dcn", inner_axis_name="ici",
                            min_compress_size=64)
    params = jnp.zeros((32, 32))
    with pytest.raises(ValueError, match="num_replicas"):
        tx.init(params)  # the outer axis size is unknowable outside shard_map
    state = cj.init_sharded(tx, params, mesh, "dcn")
    specs = cj.state_specs(state, "dcn")
    g = jax.random.normal(jax.random.PRNGKey(0), (8, 32, 32))

    def f(g, s):
        out, s = tx.update(g[0], s)
        return out[None], s

    out, _ = jax.jit(_compat.shard_map(f, mesh=mesh, in_specs=(P(("dcn", "ici")), specs),
                                       out_specs=(P(("dcn", "ici")), specs)))(*ready(g, state))
    out = np.asarray(out)
    np.testing.assert_array_equal(out, np.broadcast_to(out[:1], out.shape))
    np.testing.assert_allclose(out[0], np.asarray(g).mean(0), atol=0.05)


@pytest.mark.parametrize("value,finite", [(1e36, True), (np.inf, False), (np.nan, False)])
def test_a_sum_that_overflows_is_not_taken_for_a_non_finite_gradient(value, finite):
    """Finiteness comes from one sum per leaf; a sum that overflows on finite values falls
    back to the elementwise test, so huge but finite gradients are still sent."""
    tx = cj.compressed_mean(cj.quantize(8), axis_name=None, min_compress_size=1)
    g = jnp.full((32, 32), 1e36, jnp.float32).at[3, 4].set(value)  # sum: 1e39 > fp32 max
    state = tx.init(g)
    out, state = jax.jit(tx.update)(g, state)
    assert bool(np.all(np.isfinite(np.asarray(out)))) == finite
    assert float(state.metrics["nonfinite"][0]) == (0.0 if finite else 1.0)
    if finite:
        np.testing.assert_allclose(np.asarray(out), 1e36, rtol=1e-2)


@pytest.mark.parametrize("name", ["sign", "q4", "identity"])
def test_without_check_finite_the_mean_is_still_replicated(name, mesh):
    """check_finite=False under shard_map(check_vma=True): the mean is typed replicated
    (out_specs P() compiles) and equal on all replicas, a NaN included."""
    tx = cj.compressed_mean(COMPRESSORS[name], "data", check_finite=False, min_compress_size=64)
    g = {"a": jax.random.normal(jax.random.PRNGKey(0), (8, 16, 16)),
         "b": jax.random.normal(jax.random.PRNGKey(1), (8, 16, 8))}
    g["a"] = g["a"].at[3, 2, 3].set(jnp.nan)
    state = cj.shard_state(tx.init(jax.tree_util.tree_map(lambda a: a[0], g)), mesh, "data")
    specs = cj.state_specs(state, "data")
    step = jax.jit(_compat.shard_map(
        lambda g, s: tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s),
        mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs)))
    out, state = step(*ready(g, state))
    assert np.isnan(np.asarray(out["a"])).any()  # nothing filtered it out
    assert np.all(np.isfinite(np.asarray(out["b"])))
    assert float(np.max(np.asarray(state.metrics["nonfinite"]))) == 0.0  # nothing was tested
