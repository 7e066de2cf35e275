"""Worker: a few cj.decoupled_momentum (DeMo) steps across processes.

    demo_train.py --task TASK.npz [--steps N]

Run by ``tests/test_decoupled_momentum_multiprocess.py`` under the launcher (P processes
x D CPU devices, one replica per device). Trains the non-i.i.d. task of
:mod:`commjax.testing` and prints one ``RESULT {...}`` line with the sha256 of every local
replica's parameters and one replica's parameters.

Importable without side effects: :func:`make_tx` and :func:`train` are also used
in-process by the test for the single-process reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

STEPS = 4
AXIS = "data"


def make_tx():
    import commjax as cj

    return cj.decoupled_momentum(1e-2, beta=0.9, chunk_size=8, top_k=4, axis_name=AXIS,
                                 weight_decay=0.01)


def train(mesh, task: Any, steps: int, place):
    """``steps`` steps; ``place(array)`` builds a global array sharded over ``AXIS`` from
    the rows this process holds. Returns the per-replica parameters (global arrays)."""
    import jax
    from jax.sharding import PartitionSpec as P

    import commjax as cj
    from commjax import _compat
    from train_compressors import step_fn

    tx = make_tx()
    state = cj.shard_state(tx.init(task.params), mesh, AXIS)
    specs = cj.state_specs(state, AXIS)
    step = jax.jit(_compat.shard_map(step_fn(tx, task.loss), mesh=mesh,
                                     in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)),
                                     out_specs=(P(AXIS), specs)))
    n = mesh.shape[AXIS]
    params = jax.tree_util.tree_map(
        lambda a: place(np.broadcast_to(np.asarray(a), (n,) + np.shape(a)).copy()), task.params)
    x, y = place(np.asarray(task.x)), place(np.asarray(task.y))
    for _ in range(steps):
        params, state = step(params, state, x, y)
        jax.block_until_ready(params)  # one multi-device step in flight at a time
    return params


def main() -> None:
    import _worker

    ns = _worker.task_parser(STEPS).parse_args()
    import jax
    from train_compressors import load_task

    ctx = _worker.setup(AXIS)
    task = load_task(ns.task)
    rows = ctx.local_rows
    params = train(ctx.mesh, task, ns.steps, lambda a: _worker.shard_rows(ctx, a[rows]))
    leaves = jax.tree_util.tree_leaves(params)
    local = [np.concatenate([np.asarray(l.addressable_shards[d].data, np.float32).ravel() for l in leaves])
             for d in range(ctx.local_device_count)]
    _worker.emit({"process_id": ctx.process_id, "digests": [_worker.digest(p) for p in local],
                  "params": local[0].tolist()})


if __name__ == "__main__":
    main()
