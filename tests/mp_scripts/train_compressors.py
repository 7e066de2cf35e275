"""Worker: a few data-parallel training steps with every compressor, across processes.

    train_compressors.py [--steps N] [--only NAME[,NAME...]]

Run by ``tests/test_multiprocess_compressors.py`` under the launcher (P processes x D
CPU devices, one global mesh of ``G = P * D`` replicas). For each compressor it trains
the non-i.i.d. task of :mod:`commjax.testing` with parameters kept **per replica** (a
leading replica axis sharded ``P("data")``), so a compressor that lets replicas
disagree shows up as different parameters, on this process or on another one.

It prints one ``RESULT {...}`` line, keyed by compressor name, with per local replica
the sha256 of its parameters, the first local replica's parameters themselves (for the
comparison with a single-process run in the test), its global loss, and the bytes on
the wire of the compiled step from the HLO (``cj.collective_bytes``) beside the
analytic count (``cj.communication_plan``).

Importable without side effects: :func:`compressors`, :func:`make_task`,
:func:`make_tx` and :func:`step_fn` are also used in-process by the test to compute
the single-process reference with exactly the same program.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

AXIS = "data"
STEPS = 3
LEARNING_RATE = 0.1


#: Compressors added by other parts of the project: ``cj.<name>`` once exported, else the
#: submodule that defines them (so they are tested as soon as they exist).
_OPTIONAL = {
    "top_k": ("commjax.compressors.sparse", lambda f: f(ratio=0.05)),
    "random_k": ("commjax.compressors.sparse", lambda f: f(ratio=0.05)),
    "powersgd": ("commjax.compressors.powersgd", lambda f: f(rank=2)),
}


def _optional(name: str):
    import importlib

    import commjax as cj

    if hasattr(cj, name):
        return getattr(cj, name)
    module, _ = _OPTIONAL[name]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def compressors() -> dict[str, Callable[[], Any]]:
    """Name -> factory of every compressor this commjax provides (checked at run time:
    some are added by other parts of the project)."""
    import commjax as cj

    out: dict[str, Callable[[], Any]] = {
        "identity": lambda: cj.identity(),
        "cast": lambda: cj.cast(),
        "quantize8": lambda: cj.quantize(bits=8),
        "quantize4": lambda: cj.quantize(bits=4),
        "quantize2": lambda: cj.quantize(bits=2),
        "qsgd": lambda: cj.qsgd(),
        "terngrad": lambda: cj.terngrad(),
        "sign": lambda: cj.sign(),
    }
    for name, (_, make) in _OPTIONAL.items():
        factory = _optional(name)
        if factory is not None:
            out[name] = (lambda f, m: lambda: m(f))(factory, make)
    return out


def make_task(num_replicas: int):
    """The small non-i.i.d. task (two 2-D leaves of >= 1024 elements get compressed)."""
    from commjax.testing import Task, noniid_classification

    t = noniid_classification(num_replicas, examples_per_replica=64, dim=32, hidden=64, seed=3)
    return Task(params=t.params, x=t.x, y=t.y, loss=loss)


def loss(params: Any, x: Any, y: Any) -> Any:
    """Mean cross-entropy of the MLP of :mod:`commjax.testing` (its task's loss)."""
    import jax.numpy as jnp
    import optax

    from commjax.testing import mlp_apply

    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(mlp_apply(params, x), y))


def save_task(task: Any, path: str) -> None:
    """Write ``task``'s data and parameters to ``path`` (npz) for the workers: building
    the task with eager JAX ops in every worker would cost seconds of op compilation."""
    arrays = {"x": np.asarray(task.x), "y": np.asarray(task.y)}
    arrays.update({f"param_{k}": np.asarray(v) for k, v in task.params.items()})
    np.savez(path, **arrays)


def load_task(path: str):
    from commjax.testing import Task

    with np.load(path) as z:
        params = {k[len("param_"):]: z[k] for k in z.files if k.startswith("param_")}
        return Task(params=params, x=z["x"], y=z["y"], loss=loss)


def make_tx(compressor: Any):
    import optax

    import commjax as cj

    return optax.chain(cj.compressed_mean(compressor, AXIS), optax.sgd(LEARNING_RATE))


def step_fn(tx: Any, loss: Callable[..., Any]) -> Callable[..., Any]:
    """One step on one replica, as ``commjax.testing.train`` runs it under shard_map:
    per-replica params ``[1, ...]``, state, data ``[1, n, d]`` -> new params, state."""
    import jax
    import optax

    def sm_step(p, s, x, y):
        p = jax.tree_util.tree_map(lambda a: a[0], p)
        g = jax.grad(loss)(p, x[0], y[0])
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        return jax.tree_util.tree_map(lambda a: a[None], p), s

    return sm_step


def _flat(params: Any) -> np.ndarray:
    import jax

    leaves = jax.tree_util.tree_leaves(params)
    return np.concatenate([np.asarray(l, np.float32).ravel() for l in leaves])


def run_one(ctx: Any, task: Any, factory: Callable[[], Any], steps: int) -> dict[str, Any]:
    import _worker
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import commjax as cj
    from commjax import _compat

    g = ctx.global_device_count
    if task.num_replicas != g:
        raise ValueError(f"the task has {task.num_replicas} replicas, the mesh {g} devices")
    comp = factory()
    tx = make_tx(comp)
    opt_state = cj.shard_state(tx.init(task.params), ctx.mesh, AXIS)
    specs = cj.state_specs(opt_state, AXIS)
    # Outputs placed exactly as the inputs were, so the compiled step accepts its own
    # output as the next input (empty per-replica leaves may be placed replicated).
    state_sh = jax.tree_util.tree_map(lambda a: a.sharding, opt_state)
    step = jax.jit(_compat.shard_map(
        step_fn(tx, task.loss), mesh=ctx.mesh,
        in_specs=(P(AXIS), specs, P(AXIS), P(AXIS)), out_specs=(P(AXIS), specs),
    ), out_shardings=(NamedSharding(ctx.mesh, P(AXIS)), state_sh))
    rows = ctx.local_rows
    stacked = jax.tree_util.tree_map(
        lambda p: np.broadcast_to(np.asarray(p), (g,) + p.shape)[rows], task.params)
    params = jax.tree_util.tree_map(lambda a: _worker.shard_rows(ctx, a), stacked)
    x = _worker.shard_rows(ctx, np.asarray(task.x)[rows])
    y = _worker.shard_rows(ctx, np.asarray(task.y)[rows])

    compiled = step.lower(params, opt_state, x, y).compile()
    hlo = cj.collective_bytes(compiled)
    plan = cj.communication_plan(comp, task.params, g)
    for _ in range(steps):
        params, opt_state = compiled(params, opt_state, x, y)
        # One step in flight at a time (the CPU runtime's rendezvous can deadlock).
        jax.block_until_ready(params)

    # Each process reads the replicas it holds: one parameter tree per local device.
    local = []
    for d in range(ctx.local_device_count):
        local.append(jax.tree_util.tree_map(
            lambda a: np.asarray(a.addressable_shards[d].data)[0], params))
    order = [s.index[0].start for s in jax.tree_util.tree_leaves(params)[0].addressable_shards]
    local = [t for _, t in sorted(zip(order, local), key=lambda z: z[0])]
    first = _flat(local[0])
    return {
        "digests": [_worker.digest(_flat(t)) for t in local],
        "params": first.tolist(),
        "finite": bool(np.all(np.isfinite(first))),
        "hlo_bytes": hlo.total_ring_bytes,
        "hlo_kinds": sorted({c.kind for c in hlo}),
        "hlo_dtypes": sorted(hlo.dtypes),
        "reduce_scatter": bool(hlo.of_kind("reduce-scatter")),
        "plan_bytes": plan.bytes_per_step,
        "reducer": plan.routing.reducer,
        # Payloads that are summed (identity, random-k values, PowerSGD factors) travel
        # as f32; all others as unsigned words.
        "summed_payload": bool(comp.linear or comp.has_exchange),
    }


def main() -> None:
    import _worker

    parser = _worker.task_parser(STEPS)
    parser.add_argument("--only", default="", help="comma-separated compressor names")
    ns = parser.parse_args()

    ctx = _worker.setup(AXIS)
    task = load_task(ns.task)
    wanted = [s for s in ns.only.split(",") if s]
    out: dict[str, Any] = {}
    for name, factory in compressors().items():
        if wanted and name not in wanted:
            continue
        t0 = time.perf_counter()
        out[name] = run_one(ctx, task, factory, ns.steps)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    _worker.emit({
        "process_id": ctx.process_id,
        "num_processes": ctx.num_processes,
        "global_devices": ctx.global_device_count,
        "compressors": out,
    })


if __name__ == "__main__":
    main()
