"""cj.zero: ZeRO-1/2 with compressed reduce-scatter and all-gather (SDP4Bit-style).

Checked: exact codecs reproduce plain data-parallel Adam; parameters stay bit-identical on
every replica after every step with every codec; the state is 1/N of the unsharded one
plus the master shard; HLO bytes equal the analytic count and meet the compression
targets; non-finite gradients, bad inputs, two levels, orbax resume.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat, bucket
from commjax.collectives._common import SHARD_TILE
from commjax.testing import Task, noniid_classification, same_bits, train

N = 8
AX = "data"


@pytest.fixture(scope="module")
def task() -> Task:
    # w0 [32, 64], w1 [64, 64] are compressed at block 64 (>= N blocks); w2 [64, 10] and
    # the biases travel exactly (uneven sizes: 640, 64, 10 elements).
    return noniid_classification(N, examples_per_replica=64, dim=32, hidden=64, seed=3)


def q(bits, stochastic=True, block=64):
    return cj.quantize(bits=bits, block_size=block, stochastic=stochastic)


def zero(**kw):
    kw.setdefault("min_compress_size", 512)
    return cj.zero(optax.adam(1e-2), AX, **kw)


def stepper(tx, task, mesh, check_vma=True, axes=AX):
    """A jitted shard_map step on per-replica parameters ``[N, ...]`` (so that replicas
    that disagree keep their own copy) and the state laid out by ``init_sharded``."""
    state = cj.init_sharded(tx, task.params, mesh, axes)
    specs = cj.state_specs(state, axes)

    def local(p, s, x, y):
        p = jax.tree_util.tree_map(lambda a: a[0], p)
        g = jax.grad(task.loss)(p, x[0], y[0])
        u, s = tx.update(g, s, p)
        return jax.tree_util.tree_map(lambda a: a[None], optax.apply_updates(p, u)), s, \
            jax.tree_util.tree_map(lambda a: a[None], u)

    fn = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(axes), specs, P(axes), P(axes)),
                                   out_specs=(P(axes), specs, P(axes)), check_vma=check_vma))
    sh = NamedSharding(mesh, P(axes))
    params = jax.device_put(jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), task.params), sh)
    return fn, params, state, jax.device_put(task.x, sh), jax.device_put(task.y, sh)


_STEPPERS: dict = {}


def cached_stepper(name, task, mesh):
    """:func:`stepper` of ``zero(**CODECS[name])``, compiled once per module (several
    tests drive the same configuration)."""
    if name not in _STEPPERS:
        _STEPPERS[name] = stepper(zero(**CODECS[name]), task, mesh, check_vma=name not in NO_VMA)
    return _STEPPERS[name]


def identical(tree) -> bool:
    return all(bool(np.all(np.asarray(l) == np.asarray(l)[:1])) for l in jax.tree_util.tree_leaves(tree))


# ------------------------------------------------------------------------- exactness


@pytest.fixture(scope="module")
def dp_adam(task):
    """Plain data-parallel Adam (the exact mean, then Adam) on the task."""
    return train(optax.chain(cj.compressed_mean(cj.identity(), AX), optax.adam(1e-2)), task, 6)


@pytest.mark.parametrize("mode", ["vma", "pmap"])
def test_exact_zero_adam_equals_data_parallel_adam(task, dp_adam, mode):
    ref = dp_adam
    got = train(zero(), task, 6, check_vma=mode == "vma", use_pmap=mode == "pmap")
    assert got.replicas_identical
    scale = max(float(np.max(np.abs(l))) for l in jax.tree_util.tree_leaves(ref.params))
    for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(ref.params)):
        # fp32 rounding: the reduce-scatter and the all-reduce sum in different orders.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=4e-7 * scale)
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(task.params)))
    assert moved > 1e4 * 4e-7 * scale


CODECS = {
    # plain (not delta) stochastic int8 weights: the weight_delta=False path
    "int8_plain": dict(grad_codec=q(8), weight_codec=q(8), weight_delta=False),
    "qwd4_hadamard": dict(grad_codec=cj.hadamard(q(4)), weight_codec=q(4, False)),
    "cast_sign_ef": dict(grad_codec=cj.sign(block_size=64), weight_codec=cj.cast(),
                         grad_error_feedback=True),
    # FP8 both ways: e5m2 gradients (stochastic), e4m3 weight differences (nearest)
    "fp8": dict(grad_codec=cj.fp8("e5m2", block_size=64, stochastic=True),
                weight_codec=cj.fp8(block_size=64)),
}
NO_VMA = {"int8_plain", "cast_sign_ef"}  # also run under shard_map(check_vma=False)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_params_bit_identical_after_every_step(task, mesh, name):
    fn, params, state, x, y = cached_stepper(name, task, mesh)
    losses = []
    for _ in range(4):
        params, state, u = fn(params, state, x, y)
        jax.block_until_ready(params)
        assert identical(params), f"{name}: replicas differ"
        assert identical(u), f"{name}: updates differ"
        losses.append(task.global_loss(jax.tree_util.tree_map(lambda a: a[0], params)))
    assert losses[-1] < task.global_loss(task.params)
    assert int(state.count) == 4


def test_state_is_a_shard_plus_the_master(task, mesh):
    tx = zero(grad_codec=q(4), weight_codec=q(4, False))
    state = cj.init_sharded(tx, task.params, mesh, AX)
    full = optax.adam(1e-2).init(task.params)
    n_full = sum(l.size for l in jax.tree_util.tree_leaves(full))
    n_params = sum(l.size for l in jax.tree_util.tree_leaves(task.params))
    local = sum(l.size // N for l in jax.tree_util.tree_leaves((state.master, state.inner_state)))
    master = sum(l.size // N for l in state.master)
    # Padding adds at most one block per compressed leaf and N - 1 elements per exact one.
    slack = 3 * (2 * 64 + 4 * N)
    assert master <= n_params / N + slack
    assert local <= n_full / N + master + slack
    assert state.residual == ()


def _tile_order_run(weight_codec, mesh, monkeypatch, tiled: bool, grad_codec=q(8, False)):
    """Two steps of zero on leaves whose shards are whole (8, 128) tile rows (``w``,
    ``t``) and one whose are not (``v``), the TPU weight order forced on or off."""
    if tiled:  # what a TPU runs: leaves sent in their tiles' order, each a bitcast there
        monkeypatch.setattr(bucket, "_by_layout", lambda x, tiled_fn, flat_fn: tiled_fn(x))
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 256)), jnp.float32),
              "t": jnp.asarray(rng.normal(size=(2, 32, 128)), jnp.float32),
              "v": jnp.asarray(rng.normal(size=(48, 100)), jnp.float32)}
    grads = jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.normal(size=(N,) + a.shape), jnp.float32), params)
    # SGD: weight changes as varied as the gradients (Adam's first steps are all +-lr).
    tx = cj.zero(optax.sgd(0.1), AX, grad_codec=grad_codec, weight_codec=weight_codec, min_compress_size=512)
    state = cj.init_sharded(tx, params, mesh, AX)
    specs = cj.state_specs(state, AX)

    def local(p, s, g):
        u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
        return jax.tree_util.tree_map(lambda a: a[None], optax.apply_updates(p, u)), s

    fn = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(AX)),
                                   out_specs=(P(AX), specs)))
    # Both steps take the parameters placed the same way (replicated), so the second one
    # reuses the first one's executable instead of compiling the same program again.
    replicated = NamedSharding(mesh, P())
    out, state = fn(jax.device_put(params, replicated), state, grads)
    out, _ = fn(jax.device_put(jax.tree_util.tree_map(lambda a: a[0], out), replicated), state, grads)
    return params, out


def test_weights_in_tile_order_are_the_same_leaves(mesh, monkeypatch):
    """On TPU a leaf whose shards are whole tile rows travels in tile order
    (``zero._send_order``/``_gathered_leaf``: the gathered leaf is then a bitcast, not a
    relayout). Forced here. Exact weight codecs, and blocks of 64 (a block is 64
    consecutive elements of one row in either order): every update bit for bit the
    row-major path's. Blocks of 256 cover half rows of two tile rows instead of one leaf
    row: other bits, the replicas still identical, the weights moved as far."""
    for codec in (cj.identity(), cj.lossless(jnp.float32), q(4, False)):
        _, flat = _tile_order_run(codec, mesh, monkeypatch, tiled=False)
        _, tiled = _tile_order_run(codec, mesh, monkeypatch, tiled=True)
        monkeypatch.undo()
        assert same_bits(flat, tiled), codec
    p0, flat = _tile_order_run(q(4, False, block=256), mesh, monkeypatch, tiled=False)
    _, tiled = _tile_order_run(q(4, False, block=256), mesh, monkeypatch, tiled=True)
    assert identical(tiled)
    for k in p0:
        a, b = np.asarray(flat[k][0]) - np.asarray(p0[k]), np.asarray(tiled[k][0]) - np.asarray(p0[k])
        assert np.linalg.norm(b - a) < 0.2 * np.linalg.norm(a), k
    assert not np.array_equal(np.asarray(flat["w"]), np.asarray(tiled["w"]))
    np.testing.assert_array_equal(np.asarray(flat["v"]), np.asarray(tiled["v"]))


def test_exact_zero_in_tile_order_is_the_same_bits(mesh, monkeypatch):
    """Exact ZeRO sends and receives its leaves in the order a TPU stores them (the
    gradient's reduce-scatter on tile rows, ``collectives._common.scatter_flat``; the
    weights' all-gather, ``zero._send_order``): forced here, every parameter bit for bit
    the row-major run's, and the forced run really took the other order (its pieces
    differ when each is read row-major)."""
    _, flat = _tile_order_run(None, mesh, monkeypatch, tiled=False, grad_codec=None)
    _, tiled = _tile_order_run(None, mesh, monkeypatch, tiled=True, grad_codec=None)
    assert same_bits(flat, tiled) and identical(tiled)
    v = jnp.arange(8 * N * 256, dtype=jnp.float32)
    rows = bucket.unravel_leaf(v, (8 * N, 256))
    assert not np.array_equal(np.asarray(rows), np.asarray(v.reshape(8 * N, 256)))
    np.testing.assert_array_equal(np.asarray(bucket.ravel_leaf(rows)), np.asarray(v))


# ------------------------------------------------------------------ bytes on the wire


SHAPES = {"w1": (1024, 1024), "w2": (1024, 1000), "b": (1000,), "scale": ()}


def compiled_bytes(tx, mesh, shapes=SHAPES, axes=AX):
    """Per-device ring bytes of one compiled (never run) update on abstract gradients."""
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    state = jax.eval_shape(lambda p: cj.init_sharded(tx, p, mesh, axes), params)
    specs = cj.state_specs(state, axes)
    n = math.prod(mesh.shape.values())

    def step(g, s, p):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        u, s = tx.update(g, s, p)
        return u, s

    grads = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct((n,) + p.shape, p.dtype), params)
    fn = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(axes), specs, P()),
                                   out_specs=(P(), specs)))
    return cj.collective_bytes(fn, grads, state, params), params


def by_op(rep):
    out = {"reduce_scatter": 0.0, "all_gather": 0.0}
    for c in rep.collectives:
        assert not c.in_conditional  # params typed replicated: no first-step fingerprint test
        out["all_gather" if c.kind == "all-gather" else "reduce_scatter"] += c.ring_bytes
    return out


def zero_bytes(tx, params, n, **kw) -> dict:
    """The plan's bytes per direction, as :func:`by_op` reads the HLO's."""
    plan = cj.communication_plan(tx, params, n, **kw)
    return {"reduce_scatter": plan.bytes_of("gradient"), "all_gather": plan.bytes_of("weight")}


def test_hlo_bytes_equal_analytic_and_meet_targets(mesh):
    exact_rep, params = compiled_bytes(cj.zero(optax.adam(1e-3), AX), mesh)
    exact = by_op(exact_rep)
    assert exact == pytest.approx({k: v for k, v in zero_bytes(cj.zero(optax.adam(1e-3), AX), params, N).items()
                                   if k in exact}, abs=0.5)
    n = sum(math.prod(s) for s in SHAPES.values())
    # Exact ZeRO sends what an fp32 all-reduce sends, plus the flag and each replica's chunk
    # padded to whole TPU tiles (under SHARD_TILE elements a replica).
    assert (cj.ring_bytes("all-reduce", 4 * n, N) < exact_rep.total_ring_bytes
            <= cj.ring_bytes("all-reduce", 4 * (n + N * SHARD_TILE), N))
    ratios = {}
    for name, kw in {"int8": dict(grad_codec=cj.quantize(8), weight_codec=cj.quantize(8, stochastic=False)),
                     "int4": dict(grad_codec=cj.hadamard(cj.quantize(4)),
                                  weight_codec=cj.quantize(4, stochastic=False))}.items():
        rep, _ = compiled_bytes(cj.zero(optax.adam(1e-3), AX, **kw), mesh)
        got = by_op(rep)
        want = zero_bytes(cj.zero(optax.adam(1e-3), AX, **kw), params, N)
        assert got == pytest.approx({k: want[k] for k in got}, abs=0.5), rep.table()
        assert {c.dtypes[0] for c in rep.collectives if c.kind == "all-to-all"} == {"u32"}
        ratios[name] = {k: exact[k] / got[k] for k in got}
    assert min(ratios["int4"].values()) >= 6.0, ratios
    assert min(ratios["int8"].values()) >= 3.5, ratios


def test_two_level_bytes_and_training(task):
    mesh2 = _compat.make_mesh((2, 4), ("data", "node"))
    kw = dict(grad_codec=cj.hadamard(cj.quantize(4)), inner_grad_codec=cj.quantize(8),
              weight_codec=cj.quantize(4, stochastic=False), inner_axis_name="node")
    shapes = {"w": (512, 500), "b": (500,)}
    rep, params = compiled_bytes(cj.zero(optax.adam(1e-3), "data", **kw), mesh2, shapes, ("data", "node"))
    got = by_op(rep)
    want = zero_bytes(cj.zero(optax.adam(1e-3), "data", **kw), params, 2, inner_replicas=4)
    assert got == pytest.approx({k: want[k] for k in got}, abs=0.5), rep.table()
    # 8-bit on the fast axis, 4-bit on the slow one: bit-identical replicas, and the loss
    # goes down (convergence against exact ZeRO: benchmarks/sharded.py).
    tx = cj.zero(optax.adam(1e-2), "data", inner_axis_name="node", min_compress_size=512,
                 grad_codec=cj.hadamard(q(4)), inner_grad_codec=q(8), weight_codec=q(4, False))
    fn, p, s, x, y = stepper(tx, task, mesh2, axes=("data", "node"))
    for _ in range(4):
        p, s, u = fn(p, s, x, y)
        assert identical(p)
    assert task.global_loss(jax.tree_util.tree_map(lambda a: a[0], p)) < 0.9 * task.global_loss(task.params)


# ------------------------------------------------------------- non-finite gradients


# A NaN on one replica, state layout and resume: tests/test_contract.py (zero with
# gradient error feedback).


@pytest.mark.parametrize("codecs", ["q4", "exact"])
def test_apply_if_finite_after_zero_skips_the_step(task, mesh, codecs):
    """``optax.apply_if_finite`` chained after zero tests the shared update: every replica
    skips the NaN step, the parameters do not move, training goes on. Exact ZeRO poisons
    each shard before the weights' all-gather: every update still NaN on every replica."""
    inner = zero(grad_codec=q(4), weight_codec=q(4, False)) if codecs == "q4" else zero()
    tx = optax.chain(inner, optax.apply_if_finite(optax.identity(), 3))
    fn, params, state, x, y = stepper(tx, task, mesh)
    params, state, _ = fn(params, state, x, y)
    skipped, state, u = fn(params, state, x.at[5, 1, 2].set(jnp.inf), y)
    assert same_bits(skipped, params) and identical(skipped)
    assert all(np.all(np.asarray(l) == 0) for l in jax.tree_util.tree_leaves(u))
    after, _, _ = fn(skipped, state, x, y)
    assert identical(after) and not same_bits(after, skipped)
    if codecs == "exact":  # zero's own update of the NaN step: NaN in every element
        fn, params, state, x, y = stepper(inner, task, mesh)
        _, _, u = fn(params, state, x.at[5, 1, 2].set(jnp.inf), y)
        assert all(np.all(np.isnan(np.asarray(l))) for l in jax.tree_util.tree_leaves(u))


# --------------------------------------------------------------------------- errors


def _trace(tx, mesh, params, grads_like=None, state=None, check_vma=True, vary=True):
    """Trace (never compile) one update inside shard_map: raises what update raises."""
    state = cj.init_sharded(tx, params, mesh, AX) if state is None else state
    specs = cj.state_specs(state, AX)

    def step(p, s):
        g = jax.grad(lambda q_: sum(jnp.sum(l ** 2) for l in jax.tree_util.tree_leaves(q_)))(
            cj.vary(p, AX) if vary else p)
        return tx.update(g if grads_like is None else grads_like(g), s, p)

    fn = _compat.shard_map(step, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs),
                           check_vma=check_vma)
    return jax.eval_shape(fn, params, state)


def test_bad_inputs_get_named_errors(task, mesh):
    params = task.params
    with pytest.raises(ValueError, match="weight_codec.*cannot carry weights"):
        cj.zero(optax.adam(1e-3), AX, weight_codec=cj.top_k(0.01))
    with pytest.raises(ValueError, match="weight_codec"):
        cj.zero(optax.adam(1e-3), AX, weight_codec=cj.random_k(0.01))
    with pytest.raises(ValueError, match="inner_grad_codec.*inner_axis_name"):
        cj.zero(optax.adam(1e-3), AX, inner_grad_codec=q(8))
    with pytest.raises(TypeError, match="inner"):
        cj.zero("adam", AX)
    tx = zero(grad_codec=q(4))
    with pytest.raises(ValueError, match="needs the current parameters"):
        _trace(optax.GradientTransformation(tx.init, lambda g, s, p: tx.update(g, s, None)), mesh, params)
    with pytest.raises(ValueError, match="full parameters, replicated"):
        _trace(optax.GradientTransformation(
            tx.init, lambda g, s, p: tx.update(g, s, jax.tree_util.tree_map(lambda a: a[:1], p))),
            mesh, params)
    # A state made for 4 replicas does not fit 8 (the shard sizes do not divide the same).
    small = cj.shard_state(zero(grad_codec=q(4), num_replicas=4).init(params), mesh, AX)
    with pytest.raises(ValueError, match="num_replicas=8"):
        _trace(tx, mesh, params, state=small)
    with pytest.raises(ValueError, match="cj.vary"):
        _trace(tx, mesh, params, vary=False)
    with pytest.raises(ValueError, match="power of two"):
        cj.hadamard(cj.quantize(4), size=24)
    with pytest.raises(ValueError, match="apply_if_finite"):  # around zero: per-replica predicate
        _trace(optax.apply_if_finite(tx, 3), mesh, params)


def test_params_that_differ_between_replicas_are_refused(task, mesh):
    fn, params, state, x, y = cached_stepper("qwd4_hadamard", task, mesh)  # params per replica
    params = jax.tree_util.tree_map(lambda a: a.at[2].add(1e-3), params)
    with pytest.raises(Exception, match="parameters differ between replicas"):
        jax.block_until_ready(fn(params, state, x, y))
    # The runtime keeps each device's token of the failed step until a later step with a
    # callback replaces it (else it is raised again at exit).
    def noop(v):
        jax.debug.callback(lambda: None)
        return v

    jax.block_until_ready(jax.jit(_compat.shard_map(noop, mesh=mesh, in_specs=P(AX), out_specs=P(AX)))(y))
    jax.effects_barrier()
