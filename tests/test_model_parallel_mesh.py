"""Data parallelism on a model-parallel mesh: cj.data_parallel, cj.init_sharded,
compressed_mean and cj.zero on a ("data", "model") mesh whose weights are split over
"model" (manual over "data" only, or over every axis): the same compressed bytes on the
data axis as on a 1-D mesh, the model shardings kept."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat, axes

Q8 = cj.quantize(8, stochastic=False)


@pytest.fixture(scope="module")
def meshes():
    devices = jax.devices()[:8]
    return (_compat.make_mesh((4, 2), ("data", "model"), devices=devices),
            _compat.make_mesh((4,), ("data",), devices=devices[:4]))


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (64, 32)) * 0.1, "v": jax.random.normal(k2, (32, 16)) * 0.1,
            "b": jnp.zeros((32,))}


def _placed(mesh):
    specs = {"w": P(None, "model"), "v": P("model", None), "b": P()}
    return jax.device_put(_params(), {k: NamedSharding(mesh, s) for k, s in specs.items()}), specs


def _same(arr, spec) -> bool:
    """``arr`` is laid out as ``spec`` says (trailing ``None`` entries aside)."""
    return arr.sharding.is_equivalent_to(NamedSharding(arr.sharding.mesh, spec), arr.ndim)


def _loss(p, batch):
    h = jnp.tanh(batch @ p["w"] + p["b"])
    return jnp.mean((h @ p["v"] - 0.1) ** 2)


def _batch(t):
    return jax.random.normal(jax.random.PRNGKey(10 + t), (8, 64))


MEAN = lambda: cj.compressed_mean(Q8, "data", min_compress_size=64)  # noqa: E731
ZERO = lambda: cj.zero(optax.adam(1e-2), "data", grad_codec=Q8, min_compress_size=64)  # noqa: E731
# Each device's shard of the parameters (w and v split over the 2 model devices).
SHARDS = {"w": jax.ShapeDtypeStruct((64, 16), jnp.float32), "v": jax.ShapeDtypeStruct((16, 16), jnp.float32),
          "b": jax.ShapeDtypeStruct((32,), jnp.float32)}


@pytest.mark.parametrize("name", ["compressed_mean", "zero"])
def test_data_parallel_keeps_the_model_layout_and_the_data_bytes(meshes, name):
    """cj.data_parallel, manual over "data" (the loss sees whole weights, "model" is the
    compiler's): the same losses and weights as on a 1-D mesh, the model layout kept
    (Adam's moments too), replicas identical, and each device's data-axis bytes the plan
    of its shard: the two shards together send what the 1-D mesh sends, up to padding."""
    mesh2, mesh1 = meshes
    params, specs = _placed(mesh2)
    make = (lambda: optax.chain(MEAN(), optax.adam(1e-2))) if name == "compressed_mean" else ZERO
    dp2, dp1 = cj.data_parallel(_loss, make(), mesh2), cj.data_parallel(_loss, make(), mesh1)
    s2, s1 = dp2.init(params), dp1.init(_params())
    for t in range(3):
        s2, l2 = dp2.step(s2, _batch(t))
        s1, l1 = dp1.step(s1, _batch(t))
    for k, spec in specs.items():
        assert _same(s2.params[k], spec), k
    if name == "compressed_mean":
        mu = s2.opt_state[1][0].mu
        assert _same(mu["w"], specs["w"]) and _same(mu["v"], specs["v"])
    assert dp2.replicas_identical(s2)
    # Not the same bits: the int8 blocks of a shard are not those of the whole leaf, and
    # Adam's first steps move each weight by about +-lr whatever the gradient's size.
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=2e-2)
    dw = np.abs(np.asarray(s2.params["w"]) - np.asarray(s1.params["w"]))
    assert np.median(dw) < 1e-3 and dw.max() < 6e-2
    by_axis = axes.bytes_by_axis(dp2.collectives(s2, _batch(0)), mesh2)
    tx = MEAN() if name == "compressed_mean" else ZERO()
    assert by_axis["data"] == pytest.approx(cj.communication_plan(tx, SHARDS, 4).compiled_bytes)
    assert by_axis["data"] < dp1.collectives(s1, _batch(0)).total_ring_bytes  # half the weights


def test_manual_over_every_axis_compresses_each_shard(meshes):
    """init_sharded with weights placed over "model": the state is made shard by shard
    (residuals tiled over data x model, Adam's moments as the weights), the step runs in a
    shard_map manual over both axes, and the data axis carries half of the 1-D bytes."""
    mesh2, _ = meshes
    params, specs = _placed(mesh2)
    tx = optax.chain(MEAN(), optax.adam(1e-2))
    state = cj.init_sharded(tx, params, mesh2, "data")
    sspecs = cj.state_specs(state, "data")
    assert sspecs[0].residual == (P(("data", "model")),) * 2
    mu = state[1][0].mu
    assert _same(mu["w"], specs["w"]) and _same(mu["v"], specs["v"]) and _same(mu["b"], P())

    def local(p, s, batch):
        def loss(q):  # the model-parallel forward: v's rows follow w's columns
            h = jnp.tanh(batch @ q["w"] + q["b"].reshape(2, -1)[jax.lax.axis_index("model")])
            out = jax.lax.psum(h @ q["v"], "model")
            return jnp.mean((out - 0.1) ** 2)
        g = jax.grad(loss)(cj.vary(p, ("data", "model")))
        g["b"] = jax.lax.psum(g["b"], "model")  # replicated over model: one gradient
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(_compat.shard_map(local, mesh=mesh2, in_specs=(specs, sspecs, P("data")),
                                     out_specs=(specs, sspecs), check_vma=False))
    batch = jax.device_put(_batch(0), NamedSharding(mesh2, P("data")))
    new, state = step(params, state, batch)
    for k, spec in specs.items():
        assert _same(new[k], spec)
    assert float(jnp.max(jnp.abs(new["w"] - params["w"]))) > 0
    rep = cj.collective_bytes(step, params, state, batch)
    assert axes.bytes_by_axis(rep, mesh2)["data"] == pytest.approx(
        cj.communication_plan(MEAN(), SHARDS, 4).compiled_bytes)


def test_a_leaf_varying_over_an_unknown_axis_is_refused(meshes):
    mesh2, _ = meshes
    tx = optax.chain(MEAN(), optax.adam(1e-2))
    with pytest.raises(ValueError, match="varies over mesh axes \\['model'\\]"):
        cj.init_sharded(tx, _params(), mesh2, "data")  # unplaced: "model" is not a model axis
    with pytest.raises(ValueError, match="split over \\['data'\\]"):
        cj.init_sharded(tx, jax.device_put(_params(), NamedSharding(mesh2, P("data"))), mesh2, "data")


@pytest.mark.parametrize("make", [lambda: cj.dgc(0.05, min_compress_size=64),
                                  lambda: cj.decoupled_momentum(0.05, chunk_size=8, top_k=4)],
                         ids=["dgc", "decoupled_momentum"])
def test_per_element_optimizers_train_shard_by_shard(meshes, make):
    """DGC and DeMo on weights split over "model": each device selects from its own
    shard; the weights keep their layout and the data replicas stay identical."""
    mesh2, _ = meshes
    params, specs = _placed(mesh2)
    dp = cj.data_parallel(_loss, make(), mesh2)
    state = dp.init(params)
    for t in range(3):
        state, loss = dp.step(state, _batch(t))
    assert all(_same(state.params[k], spec) for k, spec in specs.items())
    assert np.all(np.isfinite(np.asarray(loss))) and dp.replicas_identical(state)
    assert not np.array_equal(np.asarray(state.params["w"]), np.asarray(_params()["w"]))


@pytest.mark.parametrize("make", [lambda: cj.onebit_adam(1e-3, warmup_steps=1),
                                  lambda: cj.onebit_lamb(1e-3, warmup_steps=1)], ids=["onebit_adam", "onebit_lamb"])
def test_a_transform_that_needs_whole_leaves_is_refused_on_split_parameters(meshes, make):
    """1-bit Adam and LAMB keep a step counter advanced only on a finite step (and LAMB a
    norm of each whole leaf): on weights split over "model" each device would decide from
    its own shard. data_parallel refuses them naming the model axis and the fix; it said
    to move optax.apply_if_finite, which the user had not used. Placed whole, they train."""
    mesh2, _ = meshes
    params, _ = _placed(mesh2)
    with pytest.raises(ValueError, match=r"differs between the devices of \['model'\].*place them whole"):
        cj.data_parallel(_loss, make(), mesh2).init(params)
    dp = cj.data_parallel(_loss, make(), mesh2)
    state = dp.init(jax.device_put(_params(), NamedSharding(mesh2, P())))
    for t in range(2):
        state, loss = dp.step(state, _batch(t))
    assert np.all(np.isfinite(np.asarray(loss))) and dp.replicas_identical(state)


@pytest.mark.slow
def test_a_long_run_on_the_data_x_model_mesh_does_not_hang():
    """100 steps of cj.data_parallel on data x model in a fresh process, with the tests'
    environment (PJRT_NPROC: twice the devices in CPU-client threads): with one client
    thread per device this run stalled in a collective, waiting for a device without a
    thread, within 50 steps (2 of 2 runs on a 2-core VM), until XLA aborted it."""
    script = Path(__file__).resolve().parent / "mp_scripts" / "mesh_long_run.py"
    proc = subprocess.run([sys.executable, str(script), "--steps", "100"], env=dict(os.environ),
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0 and "done 100" in proc.stdout, proc.stderr[-3000:]
