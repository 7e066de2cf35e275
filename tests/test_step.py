"""``cj.data_parallel``, ``cj.accumulate`` and the traced layout, as a user's loop uses them.

* ``optax.MultiSteps(chain(compressed_mean, adam), k)``, ``nnx.Optimizer`` and
  ``optax.inject_hyperparams`` run with no layout code, every replica holds bit-identical
  parameters, and the compiled step sends one exchange per *real* step: no collective
  outside the accumulation's conditional, the plan's bytes inside it (a raw
  ``optax.MultiSteps`` sends them on every micro-step);
* ``cj.accumulate`` gives the parameters of ``optax.MultiSteps`` (to the last bit);
* the whole train state saves with plain orbax (``StandardSave``) and a fresh process
  that restores it continues bit-identically; every contract transform's state saves;
* bad arguments are refused with the argument's name and the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat, layout

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "mp_scripts"))
import orbax_resume  # noqa: E402

N = 4
AX = "data"
DIM, HIDDEN, CLASSES = 16, 64, 4
MIN = 256


@pytest.fixture(scope="module")
def mesh4():
    return _compat.make_mesh((N,), (AX,), devices=jax.devices()[:N])


def init_params():
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    return {"w0": jax.random.normal(k[0], (DIM, HIDDEN)) / 4, "b0": jnp.zeros((HIDDEN,)),
            "w1": jax.random.normal(k[1], (HIDDEN, CLASSES)) / 8}


def loss_fn(p, batch):
    x, y = batch
    logits = jnp.tanh(x @ p["w0"] + p["b0"]) @ p["w1"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batch(t):
    """Replica r's rows are shifted by r (non-i.i.d.: the replicas' gradients differ)."""
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(3), t))
    x = jax.random.normal(kx, (N * 8, DIM)) + jnp.repeat(jnp.arange(N), 8)[:, None] * 0.5
    return x, jax.random.randint(ky, (N * 8,), 0, CLASSES)


def inner_tx(lr=1e-2):
    return optax.chain(cj.compressed_mean(cj.quantize(4), AX, min_compress_size=MIN),
                       optax.adam(lr))


def one_exchange(params) -> float:
    return cj.communication_plan(cj.quantize(4), params, N, min_compress_size=MIN).bytes_per_step


def split_bytes(report) -> tuple[float, float]:
    """(bytes of collectives that run on every micro-step, bytes inside conditionals)."""
    always = sum(c.ring_bytes for c in report if not c.in_conditional)
    return always, sum(c.ring_bytes for c in report if c.in_conditional)


def train(dp, state, steps):
    for t in range(steps):
        state, loss = dp.step(state, batch(t))
        jax.block_until_ready(loss)
    return state


def test_multisteps_runs_as_is_one_exchange_per_real_step(mesh4):
    k = 4
    assert optax.MultiStepsState not in layout._PER_REPLICA_FIELDS  # nothing registered
    dp = cj.data_parallel(loss_fn, optax.MultiSteps(inner_tx(), k), mesh4)
    state = train(dp, dp.init(init_params()), 2 * k)
    assert dp.replicas_identical(state)
    assert state.opt_state.acc_grads["w0"].sharding.spec == P(AX)  # traced: per replica
    assert state.opt_state.mini_step.sharding.spec == P()
    always, in_cond = split_bytes(dp.collectives(state, batch(0)))
    assert always == 0 and in_cond == pytest.approx(one_exchange(init_params()))
    count = state.opt_state.inner_opt_state[0].count
    assert int(np.asarray(count)) == 2  # the exchange ran twice in 8 micro-steps


def _raw_multisteps_step(mesh, tx, params):
    """optax.MultiSteps in a hand-written shard_map step (what data_parallel replaces)."""
    state = cj.init_sharded(tx, params, mesh, AX)
    specs = cj.state_specs(state, AX)

    def local(p, s, b):
        g = jax.grad(loss_fn)(cj.vary(p, AX), b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(AX)),
                                     out_specs=(P(), specs))), state


def test_accumulate_equals_multisteps_and_sends_once(mesh4):
    k, params = 2, init_params()
    ms = optax.MultiSteps(inner_tx(), k).gradient_transformation()
    step, state = _raw_multisteps_step(mesh4, ms, params)
    p = jax.device_put(params, jax.sharding.NamedSharding(mesh4, P()))
    placed = [jax.device_put(batch(t), jax.sharding.NamedSharding(mesh4, P(AX))) for t in range(2 * k)]
    always, _ = split_bytes(cj.collective_bytes(step, p, state, placed[0]))
    assert always == pytest.approx(one_exchange(params))  # MultiSteps: every micro-step
    for b in placed:
        p, state = step(p, state, b)
        jax.block_until_ready(p)
    dp = cj.data_parallel(loss_fn, cj.accumulate(inner_tx(), every_k=k), mesh4)
    acc = train(dp, dp.init(params), 2 * k)
    # The same arithmetic, fused differently inside the conditional: at most an ulp apart.
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(acc.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2 ** -21, atol=2 ** -30)


def test_accumulate_with_scalar_and_empty_parameters(mesh4):
    """A scalar parameter's accumulator is held as ``[1]`` (a per-replica leaf needs a
    leading axis: the layout refused it) and an empty parameter's goes out as fresh zeros
    (placed replicated, it was typed varying): the other leaves train bit for bit as
    without them, and the scalar trains as the same value held as ``[1]``."""
    def lsq(p, b):
        return sum(jnp.sum(jnp.square(v - jnp.mean(b[0]))) for v in jax.tree_util.tree_leaves(p))

    def run(params):
        dp = cj.data_parallel(lsq, cj.accumulate(inner_tx(), every_k=2), mesh4)
        return train(dp, dp.init(params), 4).params

    w = jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)
    both = run({"w": w, "c": jnp.asarray(0.5), "e": jnp.zeros((3, 0))})
    alone = run({"w": w, "c": jnp.asarray([0.5])})
    assert both["c"].shape == () and both["e"].shape == (3, 0)
    np.testing.assert_array_equal(np.asarray(both["w"]), np.asarray(alone["w"]))
    np.testing.assert_array_equal(np.asarray(both["c"]).reshape(1), np.asarray(alone["c"]))
    assert float(both["c"]) != 0.5


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(DIM, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def nnx_loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def test_nnx_optimizer_with_multisteps_and_no_layout_code(mesh4):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.MultiSteps(inner_tx(), 2), wrt=nnx.Param)
    dp = cj.data_parallel(nnx_loss, inner_tx(), mesh4)
    state = train(dp, dp.init(model, optimizer=optimizer), 4)
    assert dp.replicas_identical(state)
    specs = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a: a.sharding.spec, state.opt_state),
                                      is_leaf=lambda x: isinstance(x, P))
    assert P(AX) in specs and P() in specs  # residuals, accumulators per replica; the rest not
    _, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    always, in_cond = split_bytes(dp.collectives(state, batch(0)))
    assert always == 0 and in_cond == pytest.approx(one_exchange(nnx.as_pure(params)))
    assert isinstance(dp.model(state), MLP)


def test_nnx_optimizer_state_is_made_for_the_mesh(mesh4):
    """An ``nnx.Optimizer`` built outside the mesh initialises its optax state for every
    device of the process (8 here): ZeRO on the 4-device mesh compresses leaves it left
    exact there, so the state for the mesh has residuals the optimizer's had not. The
    state is initialised for the mesh (it was carried over leaf by leaf in order, and the
    step failed reshaping a scalar into an accumulator), under optax.MultiSteps too."""
    zero = lambda: cj.zero(optax.adam(1e-3), AX, grad_codec=cj.quantize(4), min_compress_size=256,  # noqa: E731
                           grad_error_feedback=True)
    for tx in (zero(), optax.MultiSteps(zero(), 2)):
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        outside = len(jax.tree_util.tree_leaves(nnx.as_pure(optimizer.opt_state)))
        dp = cj.data_parallel(nnx_loss, tx, mesh4)
        state = train(dp, dp.init(model, optimizer=optimizer), 4)
        assert dp.replicas_identical(state)
        assert len(jax.tree_util.tree_leaves(nnx.as_pure(state.opt_state["opt_state"]))) > outside


def test_inject_hyperparams_and_rng_per_replica(mesh4):
    tx = optax.inject_hyperparams(lambda learning_rate: inner_tx(learning_rate))(learning_rate=0.05)

    def noisy_loss(p, b, key):
        return loss_fn(p, b), jax.random.uniform(key)

    dp = cj.data_parallel(noisy_loss, tx, mesh4, has_aux=True, with_rng=True)
    state = dp.init(init_params(), seed=1)
    state, (loss, noise) = dp.step(state, batch(0))
    state, (loss, noise2) = dp.step(state, batch(1))
    assert dp.replicas_identical(state) and loss.shape == (N,)
    assert len(set(np.asarray(noise).tolist())) == N  # a different key on every replica
    assert not np.array_equal(np.asarray(noise), np.asarray(noise2))  # and every step
    assert split_bytes(dp.collectives(state, batch(0))) == (pytest.approx(one_exchange(init_params())), 0)


def test_plain_orbax_resume_in_a_fresh_process(tmp_path):
    dp, params, batch_fn = orbax_resume.build()
    steps = 3
    state = orbax_resume.train(dp, dp.init(params), batch_fn, 0, steps)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(steps, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
    state = orbax_resume.train(dp, state, batch_fn, steps, steps)
    out = tmp_path / "resumed.npz"
    script = os.path.join(os.path.dirname(__file__), "mp_scripts", "orbax_resume.py")
    run = subprocess.run([sys.executable, script, str(tmp_path / "ckpt"), str(steps), str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = np.load(out)
    mine = jax.tree_util.tree_leaves(jax.device_get(state))
    assert len(resumed.files) == len(mine)
    for i, leaf in enumerate(mine):
        np.testing.assert_array_equal(resumed[f"arr_{i}"], np.asarray(leaf), err_msg=str(i))


def test_every_transform_state_saves_with_standard_orbax(mesh4, tmp_path):
    """The state of every optimizer and of compressed_mean with each reducer kind (no
    zero-size arrays: orbax's StandardSave refuses them) round-trips bit for bit."""
    params = init_params()
    txs = [cj.compressed_mean(c, AX, reducer=r, min_compress_size=MIN)
           for c, r in ((cj.quantize(8), "allgather"), (cj.sign(), "two_phase"),
                        (cj.identity(), "auto"), (cj.top_k(0.1), "auto"),
                        (cj.random_k(0.1), "auto"), (cj.powersgd(2), "auto"))]
    txs += [cj.dgc(0.1, ratio=0.1, min_compress_size=MIN),
            cj.onebit_adam(1e-3, warmup_steps=1, min_compress_size=MIN),
            cj.diloco(optax.sgd(0.1), optax.sgd(0.7), sync_every=2),
            cj.zero(optax.adam(1e-3), AX, grad_codec=cj.quantize(4), min_compress_size=MIN)]
    tree = [cj.init_sharded(tx, params, mesh4, AX, per_replica_params=i == 8)
            for i, tx in enumerate(txs)]
    with ocp.CheckpointManager(tmp_path / "all") as mgr:
        mgr.save(0, args=ocp.args.StandardSave(tree))
        mgr.wait_until_finished()
        back = mgr.restore(0, args=ocp.args.StandardRestore(
            jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(back)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_callers_placed_parameters_survive_the_donated_step(mesh4):
    """Parameters the caller has already placed on the mesh (``jax.device_put`` with a
    ``NamedSharding``, as a ``jit`` user holds them): ``dp.init`` gives the state its own
    buffers, so the donating step leaves the caller's arrays (and the arrays they were
    placed from) alive and unchanged; the state aliased them and the first step deleted
    them."""
    raw = init_params()
    placed = jax.device_put(raw, NamedSharding(mesh4, P()))
    before = {k: np.asarray(v) for k, v in placed.items()}
    dp = cj.data_parallel(loss_fn, inner_tx(), mesh4)
    state = dp.init(placed)
    pointers = lambda a: {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}  # noqa: E731
    for k, v in placed.items():  # the step donates these: none may be the caller's
        assert not pointers(state.params[k]) & pointers(v), k
    for t in range(2):
        state, _ = dp.step(state, batch(t))
    for tree in (placed, raw):
        assert not any(v.is_deleted() for v in tree.values())
    for k, v in placed.items():
        np.testing.assert_array_equal(np.asarray(v), before[k])
        assert v.sharding == state.params[k].sharding
    assert any(not np.array_equal(np.asarray(state.params[k]), before[k]) for k in before)


def test_bad_arguments_name_the_fix(mesh4):
    with pytest.raises(TypeError, match="`loss_fn` must be callable"):
        cj.data_parallel(3, inner_tx(), mesh4)
    with pytest.raises(TypeError, match="`tx` must be an optax transform"):
        cj.data_parallel(loss_fn, "adam", mesh4)
    with pytest.raises(ValueError, match="names axes \\['model'\\]"):
        cj.data_parallel(loss_fn, inner_tx(), mesh4, axis_name="model")
    with pytest.raises(ValueError, match="`has_aux` must be True or False"):
        cj.data_parallel(loss_fn, inner_tx(), mesh4, has_aux="yes")
    with pytest.raises(ValueError, match="nothing averages them.*compressed_mean"):
        cj.data_parallel(loss_fn, optax.adam(1e-3), mesh4).init(init_params())
    # A mean over some leaves only names the others.
    params = init_params()
    first = jax.tree_util.tree_leaves_with_path(params)[0][0]
    mask = jax.tree_util.tree_map_with_path(lambda p, _: p != first, params)
    masked = optax.chain(optax.masked(cj.compressed_mean(cj.quantize(8), "data"), mask), optax.sgd(0.1))
    with pytest.raises(ValueError, match=re.escape(f"updates of {jax.tree_util.keystr(first)} differ")
                       + ".*not inside optax.masked"):
        cj.data_parallel(loss_fn, masked, mesh4).init(params)
    dp = cj.data_parallel(loss_fn, inner_tx(), mesh4)
    with pytest.raises(RuntimeError, match="dp.init"):
        dp.step(None, batch(0))
    state = dp.init(init_params())
    with pytest.raises(ValueError, match="divisible by the 4 replicas"):
        dp.step(state, (jnp.zeros((6, DIM)), jnp.zeros((6,), jnp.int32)))
    with pytest.raises(TypeError, match="`tx` must be an optax transform"):
        cj.infer_per_replica("adam", init_params(), mesh4, AX)
    with pytest.raises(ValueError, match="names axes \\['model'\\]"):
        cj.init_sharded(inner_tx(), init_params(), mesh4, "model")
    with pytest.raises(ValueError, match="`every_k` must be a positive integer"):
        cj.accumulate(inner_tx(), 0)
    with pytest.raises(ValueError, match="`every_k` .* is required"):
        cj.accumulate(inner_tx())
    skip = optax.MultiSteps(inner_tx(), 2, should_skip_update_fn=optax.skip_not_finite)
    with pytest.raises(ValueError, match="should_skip_update_fn"):
        cj.accumulate(skip)
