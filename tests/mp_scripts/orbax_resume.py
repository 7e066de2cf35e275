"""Plain-orbax resume of a ``cj.data_parallel`` train state, the second half in a fresh process.

``tests/test_step.py`` imports this file (no side effects) and runs the first half in its
own process: build the step, train ``K`` steps, save the whole :class:`commjax.TrainState`
(parameters, the state of every commjax transform in the chain, step counter, key) with
``orbax.checkpoint.CheckpointManager`` and ``ocp.args.StandardSave`` (no commjax helper),
then train ``K`` more steps. Then it runs::

    python orbax_resume.py DIR K OUT.npz

which, in a new process, builds the same step, restores the checkpoint into the
abstract state of a fresh ``init`` (``ocp.args.StandardRestore``), trains the same ``K``
steps and writes the final parameters; the test requires them bit-identical.
"""

from __future__ import annotations

import os
import sys

N = 4
DIM, HIDDEN = 16, 64


def build():
    """``(dp, params, batch_fn)``: a partition of two compressed means (4-bit two-phase on
    ``w1``, PowerSGD on ``w2``, exact elsewhere) before Adam, accumulated over 2 micro-steps
    with ``optax.MultiSteps``: every kind of state a commjax chain holds."""
    import jax
    import jax.numpy as jnp
    import optax

    import commjax as cj
    from commjax import _compat

    mesh = _compat.make_mesh((N,), ("data",), devices=jax.devices()[:N])
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k[0], (DIM, HIDDEN)) * 0.3,
              "w2": jax.random.normal(k[1], (HIDDEN, HIDDEN)) * 0.1,
              "b": jnp.zeros((HIDDEN,))}
    labels = {"w1": "q4", "w2": "psgd", "b": "q4"}
    inner = optax.chain(
        optax.partition({"q4": cj.compressed_mean(cj.quantize(4), reducer="two_phase",
                                                  min_compress_size=256),
                         "psgd": cj.compressed_mean(cj.powersgd(2), min_compress_size=256)},
                        labels),
        optax.adam(1e-2))

    def loss_fn(p, batch, key):
        x, y = batch
        h = jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"]
        drop = jax.random.bernoulli(key, 0.9, h.shape)  # per-replica randomness in the loss
        return jnp.mean((jnp.where(drop, h, 0.0).sum(-1) - y) ** 2)

    def batch_fn(t):
        kx = jax.random.fold_in(jax.random.PRNGKey(7), t)
        x = jax.random.normal(kx, (N * 8, DIM)) + jnp.repeat(jnp.arange(N), 8)[:, None] * 0.3
        return x, jnp.sin(x.sum(-1))

    dp = cj.data_parallel(loss_fn, optax.MultiSteps(inner, 2), mesh, with_rng=True)
    return dp, params, batch_fn


def train(dp, state, batch_fn, start, steps):
    import jax

    for t in range(start, start + steps):
        state, loss = dp.step(state, batch_fn(t))
        jax.block_until_ready(loss)
    return state


def resume(directory: str, steps: int, out: str) -> None:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    dp, params, batch_fn = build()
    fresh = dp.init(params)
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, fresh)
    with ocp.CheckpointManager(directory) as mgr:
        state = mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(abstract))
    state = train(dp, state, batch_fn, steps, steps)
    leaves = jax.tree_util.tree_leaves(jax.device_get(state))
    np.savez(out, *[np.asarray(l) for l in leaves])


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    resume(sys.argv[1], int(sys.argv[2]), sys.argv[3])
