"""Hierarchical compressed_mean on a 2x4 mesh: exact over the fast axis, compressed over
the slow one.

``compressed_mean(c, axis_name="dcn", inner_axis_name="ici")`` first averages exactly
over the 4 devices of an ``ici`` group, then compresses only over the 2 ``dcn`` groups.
The compiled HLO tells the two apart by the size of each collective's replica group
(4 for ``ici``, 2 for ``dcn``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.testing import block_codecs, flat_residual, ready

COMPRESSORS = block_codecs()
DEV = ("dcn", "ici")
SHAPES = {"w": (64, 128), "v": (40, 100), "b": (128,), "s": ()}



@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "tests need 8 forced CPU devices (see conftest.py)"
    return _compat.make_mesh((2, 4), DEV)


@pytest.fixture(scope="module")
def grads(mesh):
    """Per-device gradients, global ``[8, *shape]``, device ``(d, i)`` holds row ``4 d + i``.
    Rows differ systematically (a per-device offset) so that means are not trivial."""
    rng = np.random.default_rng(0)
    out = {}
    for k, s in SHAPES.items():
        base = rng.normal(size=s).astype(np.float32)
        out[k] = np.stack([base + (r - 3.5) * 0.5 + rng.normal(size=s).astype(np.float32)
                           for r in range(8)])
    return {k: jax.device_put(v, NamedSharding(mesh, P(DEV))) for k, v in out.items()}


def _params():
    return {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}


def _step_fn(tx, mesh, state, check_vma):
    specs = cj.state_specs(state, "dcn")

    def body(g, s):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        m, s = tx.update(g, s)
        return jax.tree_util.tree_map(lambda a: a[None], m), s

    return jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(DEV), specs),
                                     out_specs=(P(DEV), specs), check_vma=check_vma))


_CACHE = {}


def _setup(comp, mesh, check_vma=True, reducer="auto"):
    """(tx, fresh state laid out P('dcn'), compiled step); one compilation per case."""
    tx = cj.compressed_mean(comp, "dcn", inner_axis_name="ici", num_replicas=2,
                            min_compress_size=512, reducer=reducer)
    state = cj.shard_state(tx.init(_params()), mesh, "dcn")
    key = (comp, check_vma, reducer)
    if key not in _CACHE:
        _CACHE[key] = _step_fn(tx, mesh, state, check_vma)
    return tx, state, _CACHE[key]


def _plan(comp, reducer="auto"):
    return cj.communication_plan(comp, _params(), num_replicas=2, min_compress_size=512,
                                 reducer=reducer)


def _true_mean(grads):
    return {k: np.asarray(v, np.float64).mean(axis=0) for k, v in grads.items()}


def _identical_on_all_devices(out):
    return all(bool(np.all(np.asarray(v) == np.asarray(v)[:1])) for v in out.values())


# ------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("name,reducer", [(n, "auto") for n in sorted(COMPRESSORS)]
                         + [("sign", "two_phase"), ("q4", "two_phase")])
def test_error_feedback_telescopes_and_all_8_devices_agree(mesh, grads, name, reducer):
    """Every step's estimate is bit-identical on the 8 devices, and the error-feedback
    state is carried per dcn replica: with worker residuals ``e_d`` (one per dcn group,
    shared by its 4 ici devices) and the two-phase server residual ``s``, the estimates
    of ``T`` steps telescope to ``sum_t est_t = T * mean - mean_d e_d(T) - s(T)`` for the
    compressed leaves, where ``mean`` is the exact mean over all 8 devices."""
    comp = COMPRESSORS[name]
    tx, state, step = _setup(comp, mesh, reducer=reducer)
    plan = _plan(comp, reducer)
    # "auto" may pick the two-phase reducer too (the cheaper of the two by the plan)
    assert reducer == "auto" or plan.routing.reducer == reducer
    assert (plan.routing.server_residual_size > 0) == (plan.routing.reducer == "two_phase")
    truth = _true_mean(grads)
    keys = sorted(SHAPES)  # leaf order of the dict pytree
    total = {k: np.zeros_like(v) for k, v in truth.items()}
    steps = 12
    errs = []
    for t in range(steps):
        out, state = step(*ready(grads, state))
        ready(out, state)
        assert _identical_on_all_devices(out), f"{name}: devices disagree at step {t}"
        for k in total:
            total[k] += np.asarray(out[k])[0].astype(np.float64)
        errs.append(max(np.max(np.abs(np.asarray(out[k])[0] - truth[k])) for k in keys))
    if comp.lossless:  # nothing to feed back: no residual is kept
        assert state.residual == ()
        res = np.zeros((2, plan.routing.compressed_size))
    else:
        res = flat_residual(state, 2, plan.routing.segments).astype(np.float64)
    srv = np.asarray(state.server_residual, np.float64).reshape(-1)
    comp_keys = [keys[i] for i, r in enumerate(plan.routing.routes) if r == "compress"]
    assert comp_keys == ["v", "w"]
    scale = max(np.max(np.abs(np.asarray(g))) for g in grads.values())
    for k, seg in zip(comp_keys, plan.routing.segments):
        lo, hi = seg.offset, seg.offset + seg.size
        s_part = srv[lo:hi] if srv.size else 0.0
        rebuilt = total[k].reshape(-1) + res[:, lo:hi].mean(axis=0) + s_part
        np.testing.assert_allclose(rebuilt, steps * truth[k].reshape(-1), rtol=0,
                                   atol=2e-5 * steps * scale, err_msg=f"{name}/{k}")
    for k in keys:
        if k not in comp_keys:  # the exact bucket: the mean of all 8 devices, every step
            np.testing.assert_allclose(total[k] / steps, truth[k], rtol=1e-5, atol=1e-5)
    if name == "identity":
        assert max(errs) <= 1e-5 * scale
    else:
        assert max(errs) > 1e-6 * scale  # the codec did something: the test is not vacuous


@pytest.mark.exact_codegen
def test_identity_is_the_exact_mean_and_vma_off_gives_thesame_bits(mesh, grads):
    _, s1, f1 = _setup(COMPRESSORS["q4"], mesh, check_vma=True)
    _, s2, f2 = _setup(COMPRESSORS["q4"], mesh, check_vma=False)
    o1, _ = f1(*ready(grads, s1))
    ready(o1)
    o2, _ = f2(*ready(grads, s2))
    ready(o2)
    for k in o1:
        np.testing.assert_array_equal(np.asarray(o1[k]), np.asarray(o2[k]))
    _, s, f = _setup(COMPRESSORS["identity"], mesh)
    out, _ = f(*ready(grads, s))
    ready(out)
    truth = _true_mean(grads)
    for k in truth:
        np.testing.assert_allclose(np.asarray(out[k])[0], truth[k], rtol=1e-5, atol=1e-6)


def test_inner_devices_share_the_outer_state(mesh, grads):
    """The residual is per dcn replica: its two halves differ (different data), and it
    is what the 4 ici devices of a group agree on (the layout is P('dcn'))."""
    tx, state, step = _setup(COMPRESSORS["q2"], mesh)
    _, state = step(*ready(grads, state))
    ready(state)
    res = flat_residual(state, 2)
    assert [2 * r.shape[0] for r in tx.init(_params()).residual] == [r.shape[0] for r in state.residual]
    assert not np.array_equal(res[0], res[1])
    assert np.all(np.isfinite(res))


# ------------------------------------------------------------------------ wire bytes


def _report(comp, mesh, grads):
    _, state, step = _setup(comp, mesh)
    return cj.collective_bytes(step, grads, state)  # compiled once, shared with the runs


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_fast_axis_exact_f32_slow_axis_compressed(mesh, grads, name):
    comp = COMPRESSORS[name]
    rep = _report(comp, mesh, grads)
    sizes = {c.group_size for c in rep}
    assert sizes <= {2, 4}, sizes
    n_float = sum(int(np.prod(s)) if s else 1 for s in SHAPES.values())
    inner = [c for c in rep if c.group_size == 4]
    outer = [c for c in rep if c.group_size == 2]
    # ici: exact fp32 all-reduces of every float leaf, nothing else.
    assert inner and all(c.kind == "all-reduce" and set(c.dtypes) == {"f32"} for c in inner)
    assert sum(c.ring_bytes for c in inner) == pytest.approx(cj.ring_bytes("all-reduce", 4 * n_float, 4))
    # dcn: exactly what the communication plan for 2 replicas says.
    assert sum(c.ring_bytes for c in outer) == pytest.approx(_plan(comp).bytes_per_step)
    if name != "identity":
        # The compressed payload travels as unsigned words over dcn, never over ici.
        assert any(d.startswith("u") for c in outer for d in c.dtypes)
        assert not any(d.startswith("u") for c in inner for d in c.dtypes)


def test_slow_axis_bytes_4bit_at_least_6x_below_exact(mesh, grads):
    n_float = sum(int(np.prod(s)) if s else 1 for s in SHAPES.values())
    rep = _report(COMPRESSORS["q4"], mesh, grads)
    q4_b = sum(c.ring_bytes for c in rep if c.group_size == 2)
    exact_b = cj.ring_bytes("all-reduce", 4 * n_float, 2)  # one fp32 all-reduce of every float over dcn
    assert exact_b >= 6 * q4_b, (exact_b, q4_b)
    # The exact fp32 mean through the same path costs exactly that: its mean tells whether
    # a replica's leaf was non-finite, so no NaN flag rides along.
    ident = _report(COMPRESSORS["identity"], mesh, grads)
    assert sum(c.ring_bytes for c in ident if c.group_size == 2) == pytest.approx(exact_b)


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("inner", ["dcn", ("dcn",), ["ici", "dcn"]])
def test_inner_axis_equal_to_outer_axis_is_refused(inner):
    with pytest.raises(ValueError, match="inner_axis_name"):
        cj.compressed_mean(cj.quantize(4), "dcn", inner_axis_name=inner)


def test_nonfinite_on_one_device_poisons_every_device_but_not_the_state(mesh, grads):
    _, state, step = _setup(COMPRESSORS["q4"], mesh)
    out, state = step(*ready(grads, state))
    ready(out, state)
    bad = {k: np.asarray(v).copy() for k, v in grads.items()}
    bad["w"][5, 3, 7] = np.nan  # dcn group 1, ici device 1
    bad = {k: jax.device_put(v, NamedSharding(mesh, P(DEV))) for k, v in bad.items()}
    out_bad, state_bad = step(*ready(bad, state))
    ready(out_bad, state_bad)
    assert np.all(np.isnan(np.asarray(out_bad["w"])))
    # Leaves that were finite everywhere are still averaged.
    assert np.all(np.isfinite(np.asarray(out_bad["v"])))
    # The NaN leaf's residual (per dcn replica) keeps its value; the others move on.
    plan = _plan(COMPRESSORS["q4"])
    seg = plan.routing.segments[[i for i, r in enumerate(plan.routing.routes) if r == "compress"].index(3)]
    assert plan.routing.shapes[3] == SHAPES["w"]  # leaves in key order: b, s, v, w
    new = flat_residual(state_bad, 2, plan.routing.segments)
    old = flat_residual(state, 2, plan.routing.segments)
    lo, hi = seg.offset, seg.offset + seg.padded_size
    np.testing.assert_array_equal(new[:, lo:hi], old[:, lo:hi])
    assert not np.array_equal(new, old)
    np.testing.assert_array_equal(np.asarray(state_bad.server_residual),
                                  np.asarray(state.server_residual))


@pytest.mark.parametrize("shape", [(2, 4), (8, 1), (1, 8)])
def test_data_parallel_over_both_axes_lays_the_group_state_out_per_slow_replica(shape):
    """``cj.data_parallel(..., axis_name=("dcn", "ici"))`` with the hierarchical mean: the
    residuals, shared by an ``ici`` group (they follow the group's exact mean), are laid
    out over ``dcn`` alone, and three steps land on the bits of the hand-written
    ``shard_map`` whose state is laid out ``P("dcn")``. Laid out over both axes (the mask
    of any per-replica leaf), the residual was typed varying over ``ici`` and the step
    refused the replicated parameters. With an axis of one device, whose placements
    ``jit`` canonicalises, the layout is the traced one."""
    mesh = _compat.make_mesh(shape, DEV)
    tx = optax.chain(cj.compressed_mean(cj.quantize(8, stochastic=False), "dcn", inner_axis_name="ici",
                                        min_compress_size=512), optax.sgd(0.1))
    params = {"w": jnp.linspace(-1.0, 1.0, 64 * 128).reshape(64, 128), "b": jnp.zeros((128,))}
    batches = [jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4) / (10 + t) for t in range(3)]  # 8 rows

    def loss(p, b):
        return jnp.sum(jnp.square(p["w"] - jnp.mean(b))) + jnp.sum(jnp.square(p["b"] - jnp.max(b)))

    dp = cj.data_parallel(loss, tx, mesh, axis_name=DEV)
    state = dp.init(params)
    residuals = jax.tree_util.tree_leaves(state.opt_state[0].residual)
    assert residuals and (shape[0] == 1 or all(r.sharding.spec == P("dcn") for r in residuals))
    for b in batches:
        state, _ = dp.step(state, b)

    s = cj.init_sharded(tx, params, mesh, "dcn")
    specs = cj.state_specs(s, "dcn")

    def body(p, st, b):
        g = jax.grad(loss)(cj.vary(p, DEV), b)
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st

    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(DEV)), out_specs=(P(), specs)))
    p = params
    for b in batches:
        p, s = f(p, s, b)
    for k in params:
        np.testing.assert_array_equal(np.asarray(state.params[k]), np.asarray(p[k]))
