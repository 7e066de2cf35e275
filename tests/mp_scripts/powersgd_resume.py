"""Worker of tests/test_powersgd_checkpoint.py: resume PowerSGD training from an orbax
checkpoint in a fresh process.

The test imports this file for :func:`build`, :func:`advance`, :func:`save` and
:func:`restore` (so both processes run the very same step function), trains, saves
mid-run and keeps going; then it runs this file as a script::

    python powersgd_resume.py --root DIR --variants default alternating --steps 3

which, for each variant, rebuilds the run from scratch, restores ``DIR/<variant>/ckpt``
into it, trains ``--steps`` more steps and writes every leaf of ``(params, opt_state)``
to ``DIR/<variant>/resumed.npz``. The test compares them with its own run bit for bit.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.compressors.powersgd import powersgd
from commjax.testing import mlp_apply

N = 4
AXIS = "data"
VARIANTS = {
    # Two exact warm-up steps, then PowerSGD with warm-started Q.
    "default": lambda: powersgd(2, start_step=2),
    # One warm-up step, then P-steps and Q-steps alternate (both factors in the state).
    "alternating": lambda: powersgd(2, start_step=1, alternating=True),
}


@dataclasses.dataclass
class Run:
    step: Any  # jitted (params, opt_state, x, y) -> (params, opt_state)
    params: Any  # per-replica parameters, [N, ...] sharded P(AXIS)
    opt_state: Any  # laid out with cj.shard_state
    x: Any
    y: Any


def _task(seed: int = 3, examples: int = 64, dim: int = 16, hidden: int = 32, classes: int = 10):
    """A small non-i.i.d. classification task made with numpy (no eager JAX ops to compile):
    replica r's inputs are shifted along its own direction; labels from a random teacher."""
    rng = np.random.default_rng(seed)
    shift = rng.standard_normal((N, 1, dim))
    x = rng.standard_normal((N, examples, dim)) + 1.5 * shift / np.linalg.norm(shift, axis=-1, keepdims=True)
    teacher = rng.standard_normal((dim, classes))
    y = np.argmax(np.tanh(x) @ teacher, axis=-1)
    sizes = (dim, hidden, hidden, classes)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = jnp.asarray(rng.standard_normal((a, b)) * np.sqrt(2.0 / a), jnp.float32)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    return params, x.astype(np.float32), y.astype(np.int32)


def _loss(params, x, y):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(mlp_apply(params, x), y))


def build(variant: str) -> Run:
    """The run at step 0: model, data, optimizer (momentum SGD after compressed_mean)."""
    mesh = _compat.make_mesh((N,), (AXIS,), devices=jax.devices()[:N])
    init_params, data_x, data_y = _task()
    tx = optax.chain(
        cj.compressed_mean(VARIANTS[variant](), AXIS, min_compress_size=64),
        optax.sgd(0.05, momentum=0.9),
    )
    opt_state = cj.shard_state(tx.init(init_params), mesh, AXIS)
    # Zero-size leaves (unused residuals) come back replicated from jit: start that way.
    opt_state = jax.tree_util.tree_map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P())) if a.size == 0 else a, opt_state)
    specs = cj.state_specs(opt_state, AXIS)

    def local(p, s, x, y):
        p = jax.tree_util.tree_map(lambda a: a[0], p)
        g = jax.grad(_loss)(p, x[0], y[0])
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        return jax.tree_util.tree_map(lambda a: a[None], p), s

    step = jax.jit(_compat.shard_map(
        local, mesh=mesh, in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)),
        out_specs=(P(AXIS), specs)))
    shard = NamedSharding(mesh, P(AXIS))
    params = jax.device_put(
        jax.tree_util.tree_map(lambda a: np.broadcast_to(np.asarray(a), (N,) + a.shape), init_params), shard)
    return Run(step, params, opt_state, jax.device_put(data_x, shard), jax.device_put(data_y, shard))


def advance(run: Run, params: Any, opt_state: Any, steps: int) -> tuple[Any, Any]:
    for _ in range(steps):
        params, opt_state = run.step(params, opt_state, run.x, run.y)
        jax.block_until_ready((params, opt_state))  # one multi-device step in flight
    return params, opt_state


def _ocp():
    import orbax.checkpoint as ocp

    logging.getLogger("absl").setLevel(logging.WARNING)
    return ocp


def _stored(tree: Any) -> dict:
    """The leaves orbax stores, by position. Zero-size leaves (unused residuals) hold no
    data and orbax refuses them: restore() takes them from the template instead."""
    return {f"leaf_{i:04d}": leaf for i, leaf in enumerate(jax.tree_util.tree_leaves(tree))
            if leaf.size}


def save(path: str, params: Any, opt_state: Any) -> None:
    """Write the full training state (params + optimizer state) with orbax."""
    ocp = _ocp()
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(path), _stored({"params": params, "opt_state": opt_state}))
    ckpt.wait_until_finished()


def restore(path: str, run: Run) -> tuple[Any, Any]:
    """Read a checkpoint written by :func:`save` into the layout of ``run`` (each leaf
    gets the template's sharding: per-replica residuals back to their replica)."""
    ocp = _ocp()
    like = {"params": run.params, "opt_state": run.opt_state}
    leaves, treedef = jax.tree_util.tree_flatten(like)
    targets = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
               for k, v in _stored(like).items()}
    got = ocp.StandardCheckpointer().restore(os.path.abspath(path), targets)
    out = [got[f"leaf_{i:04d}"] if leaf.size else leaf for i, leaf in enumerate(leaves)]
    tree = jax.tree_util.tree_unflatten(treedef, out)
    return tree["params"], tree["opt_state"]


def dump(params: Any, opt_state: Any) -> dict:
    """Every leaf of the state as a host numpy array, by position."""
    leaves = jax.tree_util.tree_leaves({"params": params, "opt_state": opt_state})
    return {f"leaf_{i:04d}": np.asarray(jax.device_get(leaf)) for i, leaf in enumerate(leaves)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="holds <variant>/ckpt; gets <variant>/resumed.npz")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--steps", type=int, required=True)
    args = ap.parse_args(argv)
    for variant in args.variants:
        run = build(variant)
        params, opt_state = restore(os.path.join(args.root, variant, "ckpt"), run)
        params, opt_state = advance(run, params, opt_state, args.steps)
        np.savez(os.path.join(args.root, variant, "resumed.npz"), **dump(params, opt_state))
        print(f"resumed {variant} for {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
