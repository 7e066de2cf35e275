"""Worker: a few cj.zero steps across processes (replicated parameters, sharded state).

    zero_train.py --task TASK.npz [--steps N]

Run by ``tests/test_zero_multiprocess.py`` under the launcher (P processes x D CPU
devices). For each configuration of :func:`configs` it trains the non-i.i.d. task of
:mod:`commjax.testing` with the parameters replicated (``P()``, the ZeRO-1/2 layout) and
the optimizer state laid out by ``cj.init_sharded``, then prints one ``RESULT {...}``
line with, per configuration, the sha256 of every local device's copy of the parameters
and the first copy's values (the test compares them across processes and with one process
running the same program).

Importable without side effects: :func:`configs`, :func:`make_mesh` and :func:`train` are
also used in-process by the test for the single-process reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np

STEPS = 3


def configs() -> dict[str, dict[str, Any]]:
    """name -> (mesh axes, cj.zero keyword arguments)."""
    import commjax as cj

    q = lambda bits, st=True: cj.quantize(bits=bits, block_size=64, stochastic=st)  # noqa: E731
    return {
        "qwd4": dict(axes=("data",), kw=dict(grad_codec=cj.hadamard(q(4)), weight_codec=q(4, False))),
        # The slow axis spans the processes, the fast one a process's devices.
        "two_level": dict(axes=("data", "node"), kw=dict(
            grad_codec=q(4), inner_grad_codec=q(8), weight_codec=q(4, False), inner_axis_name="node")),
    }


def make_mesh(devices: list, axes: tuple, num_processes: int):
    """1-D over every device, or ``(processes, devices per process)``: row ``p`` holds
    process ``p``'s devices, so the first (slow) axis crosses the processes."""
    import jax

    shape = (len(devices),) if len(axes) == 1 else (num_processes, len(devices) // num_processes)
    auto = getattr(jax.sharding, "AxisType", None)
    kw = {} if auto is None else {"axis_types": (auto.Auto,) * len(axes)}
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), axes, **kw)


def flat(tree: Any) -> np.ndarray:
    import jax

    return np.concatenate([np.asarray(l, np.float32).ravel() for l in jax.tree_util.tree_leaves(tree)])


def train(mesh, axes: tuple, kw: dict, task: Any, steps: int, place_rows) -> Any:
    """``steps`` ZeRO steps; returns the replicated parameters (a global array tree).
    ``place_rows(a)`` turns a ``[G, ...]`` host array into a ``P(axes)`` global array."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import commjax as cj
    from commjax import _compat

    tx = cj.zero(optax.adam(1e-2), axes[0], min_compress_size=512, **kw)
    state = cj.init_sharded(tx, task.params, mesh, axes)
    specs = cj.state_specs(state, axes)

    def local(p, s, x, y):
        g = jax.grad(task.loss)(cj.vary(p, axes), x[0], y[0])
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(axes), P(axes)),
                                     out_specs=(P(), specs)))
    params = jax.device_put(task.params, NamedSharding(mesh, P()))
    x, y = place_rows(np.asarray(task.x)), place_rows(np.asarray(task.y))
    for _ in range(steps):
        params, state = step(params, state, x, y)
        jax.block_until_ready(params)  # one multi-device step in flight at a time
    return params


def main() -> None:
    import _worker

    ns = _worker.task_parser(STEPS).parse_args()
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from train_compressors import load_task

    ctx = _worker.setup("data")
    task = load_task(ns.task)
    devices = list(ctx.mesh.devices.flat)
    out = {}
    for name, c in configs().items():
        mesh = make_mesh(devices, c["axes"], ctx.num_processes)
        sharding = NamedSharding(mesh, P(c["axes"]))
        rows = lambda a: jax.make_array_from_process_local_data(sharding, a[ctx.local_rows])  # noqa: E731
        params = train(mesh, c["axes"], c["kw"], task, ns.steps, rows)
        copies = [jax.tree_util.tree_map(lambda a: np.asarray(a.addressable_shards[d].data), params)
                  for d in range(ctx.local_device_count)]
        out[name] = {"digests": [_worker.digest(flat(t)) for t in copies],
                     "params": flat(copies[0]).tolist()}
    _worker.emit({"process_id": ctx.process_id, "configs": out})


if __name__ == "__main__":
    main()
