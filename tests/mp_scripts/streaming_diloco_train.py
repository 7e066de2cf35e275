"""Worker: a few cj.streaming_diloco steps across processes (per-worker parameters).

    streaming_diloco_train.py --task TASK.npz [--steps N]

Run by ``tests/test_streaming_diloco_multiprocess.py`` under the launcher (P processes x D
CPU devices). For each configuration of :func:`configs` it trains the non-i.i.d. task of
:mod:`commjax.testing` with 2 fragments, overlap 1, mix 0.5 and 4-bit outer gradients,
then prints one ``RESULT {...}`` line with, per configuration, every local device's
parameters (keyed by their row of the global per-worker array) and the sha256 of every
local device's copy of the anchor.

Importable without side effects: :func:`configs`, :func:`make_mesh` and :func:`train`
are also used in-process by the test for the single-process reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

STEPS = 4  # H = 2, 2 fragments, tau = 1: every fragment sent twice and merged


def configs() -> dict[str, dict[str, Any]]:
    """name -> mesh axes: the workers' axis crosses the processes (one worker per
    process, as one datacenter each), the data-parallel group inside a worker spans its
    process's devices. (The 1-D layout, 8 workers, runs the same code with a one-axis
    mesh; ``make_mesh`` and ``train`` take either.)"""
    return {"groups": dict(axes=("dc", "node"))}


def make_mesh(devices: list, axes: tuple, num_processes: int):
    """1-D over every device, or ``(processes, devices per process)``."""
    import jax

    shape = (len(devices),) if len(axes) == 1 else (num_processes, len(devices) // num_processes)
    auto = getattr(jax.sharding, "AxisType", None)
    kw = {} if auto is None else {"axis_types": (auto.Auto,) * len(axes)}
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), axes, **kw)


def flat(tree: Any) -> np.ndarray:
    import jax

    return np.concatenate([np.asarray(l, np.float32).ravel() for l in jax.tree_util.tree_leaves(tree)])


def _global(value: np.ndarray, mesh, spec):
    import jax
    from jax.sharding import NamedSharding

    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda idx: value[idx])


def train(mesh, axes: tuple, task: Any, steps: int):
    """``steps`` steps; returns (per-worker params ``[W, ...]``, state), global arrays."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    import commjax as cj
    from commjax import _compat

    slow, inner = axes[0], (axes[1] if len(axes) > 1 else None)
    tx = cj.streaming_diloco(optax.adam(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=2,
                             fragments=2, overlap=1, mix=0.5,
                             compressor=cj.quantize(bits=4, block_size=64), axis_name=slow,
                             inner_axis_name=inner, num_replicas=mesh.shape[slow])
    state = cj.shard_state(tx.init(task.params), mesh, slow)
    specs = cj.state_specs(state, slow)

    def local(p, s, x, y):
        p = jax.tree_util.tree_map(lambda a: a[0], p)
        g = jax.grad(task.loss)(p, x[0], y[0])
        u, s = tx.update(g, s, p)
        return jax.tree_util.tree_map(lambda a: a[None], optax.apply_updates(p, u)), s

    step = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(slow), specs, P(axes), P(axes)),
                                     out_specs=(P(slow), specs)))
    workers = mesh.shape[slow]
    params = jax.tree_util.tree_map(
        lambda a: _global(np.broadcast_to(np.asarray(a), (workers,) + np.shape(a)).copy(), mesh, P(slow)),
        task.params)
    x, y = _global(np.asarray(task.x), mesh, P(axes)), _global(np.asarray(task.y), mesh, P(axes))
    for _ in range(steps):
        params, state = step(params, state, x, y)
        jax.block_until_ready(params)  # one multi-device step in flight at a time
    return params, state


def local_rows(params) -> dict[int, list]:
    """This process's rows of the per-worker parameters: row -> flat values."""
    import jax

    leaves = jax.tree_util.tree_leaves(params)
    out = {}
    for d in range(len(leaves[0].addressable_shards)):
        row = leaves[0].addressable_shards[d].index[0].start or 0
        out[row] = flat([np.asarray(l.addressable_shards[d].data)[0] for l in leaves]).tolist()
    return out


def main() -> None:
    import _worker

    ns = _worker.task_parser(STEPS).parse_args()
    import jax
    from train_compressors import load_task

    ctx = _worker.setup("data")
    task = load_task(ns.task)
    devices = list(ctx.mesh.devices.flat)
    out = {}
    for name, c in configs().items():
        mesh = make_mesh(devices, c["axes"], ctx.num_processes)
        params, state = train(mesh, c["axes"], task, ns.steps)
        anchors = [flat([np.asarray(l.addressable_shards[d].data) for l in jax.tree_util.tree_leaves(state.anchor)])
                   for d in range(ctx.local_device_count)]
        out[name] = {"rows": local_rows(params), "anchor_digests": [_worker.digest(a) for a in anchors],
                     "anchor": anchors[0].tolist()}
    _worker.emit({"process_id": ctx.process_id, "configs": out})


if __name__ == "__main__":
    main()
