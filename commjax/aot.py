"""Deviceless measurement of a compiled step for a TPU topology or a GPU target: no
accelerator needed.

JAX compiles for a target it does not run on: a TPU topology description (``jax[tpu]``)
or an NVIDIA target config (``jax[cuda12]``, with ``CUDA_VISIBLE_DEVICES=-1
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``). The compiled program is the one the accelerator would
run: its HLO with the target's layouts, tiles and schedule, its memory plan
(``memory_analysis()``) and, on TPU, XLA's cost model. This module builds a commjax step on
such a target and reads, per step and device:

* ``traffic``: HBM bytes of every top-level operation, layout padding counted
  (``commjax._hlo_traffic``), each conditional's cheapest branch included (one branch
  runs every step); ``branch_bytes``, what the costliest branches cost beyond it, apart
  (some steps only); ``input_copies``, apart and not in ``traffic``: the copies a program
  makes of its gradient inputs to all-reduce them in place (a GPU's all-reduce writes into
  its operand, and an input is not the program's to overwrite). An update step compiled
  alone (``compile_update``) has its gradients as inputs; in training the backward pass
  writes them and nothing is copied (``compile_train``: none). On an H100 the plain
  ``pmean`` step of the 21M-parameter MLP copied 134 of its 621 MB this way;
* ``ideal``: the one-pass ideal, every input read once, every output written once, and
  each collective's send buffer written once and its receive buffer read once (a
  perfectly fused encode, exchange, decode and optimizer);
* ``temp``: scratch (``temp_size_in_bytes``), beside the arguments and outputs;
* ``wire``: each collective's ring bytes ([`commjax.collective_bytes`][]'s count);
* ``kernels``: the custom calls that are kernels (Mosaic TPU, Mosaic GPU, Triton);
* ``overlap``: for each asynchronous collective, the compute the schedule puts between its
  start and its done, as time on the target (bytes / HBM bandwidth, or flops / peak for
  matrix products), against its own transfer time on the target's link;
* ``projected``: an alpha-beta step time, ``traffic / HBM bandwidth`` plus the transfer
  time of what the schedule does not hide, on the fast link (ICI, NVLink) and the slow
  one (DCN, InfiniBand). The link figures are the vendors' published per-chip numbers
  (``TARGETS``); the model ignores contention and latency beyond ``alpha``.

Use::

    python -m commjax.bench --target v5e:2x4 --params 1e9
    benchmarks/aot.py                                 # the method x target matrix
"""

from __future__ import annotations

import dataclasses
import os
import re
from importlib import resources
from typing import Any, Callable, Optional

import jax
import numpy as np
import optax
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from commjax import _compat, _hlo_traffic as hlo, layout
from commjax.accounting import parse_hlo_collectives
from commjax.bucketing import auto_bucket_bytes
from commjax.sync import InBackwardSync

__all__ = ["Target", "TARGETS", "target_mesh", "target_bucket_bytes", "compile_update", "compile_train",
           "analyze", "abstract", "compile_per_device", "traced_for"]


@dataclasses.dataclass(frozen=True)
class Target:
    """An accelerator to compile for, with the published figures the projection uses
    (per chip: bytes, bytes/s, flop/s; ``alpha`` seconds per collective)."""

    name: str
    platform: str  # "tpu" or "cuda"
    topology: str
    hbm_bytes: float
    hbm_bw: float
    peak_flops: float  # dense bf16
    fast_link_bw: float  # ICI / NVLink, one direction, bytes/s per chip
    slow_link_bw: float  # DCN / InfiniBand, bytes/s per chip
    alpha: float = 10e-6
    config: Optional[str] = None  # GPU target config file in commjax/targets


TARGETS = {t.name: t for t in (
    Target("v5e:2x4", "tpu", "v5e:2x4", 16e9, 819e9, 197e12, 200e9, 12.5e9),
    Target("v5p:2x2x2", "tpu", "v5p:2x2x2", 95e9, 2765e9, 459e12, 600e9, 25e9),
    Target("v6e:2x4", "tpu", "v6e:2x4", 32e9, 1640e9, 918e12, 448e9, 25e9),
    Target("v4:2x2x1", "tpu", "v4:2x2x1", 32e9, 1228e9, 275e12, 300e9, 12.5e9),
    Target("h100x8", "cuda", "1x1x8", 80e9, 3.35e12, 989e12, 450e9, 50e9, config="h100_sxm.txtpb"),
    Target("h200x8", "cuda", "1x1x8", 141e9, 4.8e12, 989e12, 450e9, 50e9, config="h200_sxm.txtpb"),
)}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"aot: unknown `target` {name!r}; choose from {sorted(TARGETS)}.")
    return TARGETS[name]


def _devices(target: Target) -> list:
    if target.platform == "tpu":
        return list(topologies.get_topology_desc(topology_name=target.topology, platform="tpu").devices)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    config = resources.files("commjax").joinpath("targets", target.config).read_text()
    return list(topologies.get_topology_desc(platform="cuda", target_config=config,
                                             topology=target.topology).devices)


def target_mesh(target: str, axis_name: str = "data", shape: Optional[tuple] = None,
                axis_names: Optional[tuple] = None) -> Mesh:
    """A mesh over the target's devices (compile only: they cannot run anything here):
    one axis ``axis_name`` by default, or ``shape`` x ``axis_names``."""
    devs = np.array(_devices(get_target(target)))
    if shape is None:
        return Mesh(devs.reshape(-1), (axis_name,))
    return Mesh(devs.reshape(shape), tuple(axis_names))


def target_bucket_bytes(target: str, params: Any) -> Optional[int]:
    """The bucket size ``compressed_mean(bucket_bytes="auto")`` takes for ``params`` when run
    on ``target`` ([`commjax.bucketing.auto_bucket_bytes`][] for the target's platform, not
    the compiling process's backend); ``None``: one bucket."""
    return auto_bucket_bytes(params, target_mesh(target).devices.flat[0].platform)


def traced_for(mesh: Mesh) -> Any:
    """A context in which commjax traces its per-platform code as a user's step does, to
    be lowered for ``mesh``'s platform: every platform's branch, in
    ``lax.platform_dependent`` (the ``commjax_trace_platform`` option unset, whatever the
    process set it to). The compile functions here enter it themselves.

    Tracing only the target's branch (``commjax_trace_platform="tpu"``) is the same
    computation, but XLA's TPU compiler schedules it and places its buffers differently
    without the platform conditional, and not always for the better (v5e, the 21M MLP,
    ``compressed_mean`` in its default buckets: top-k 1% 620.7 MB against 964.9 MB with
    one branch traced, bf16 445.8 against 486.7): the program measured here must be the
    one a user's step compiles to.
    """
    del mesh  # the platform is the one the program is lowered for
    return _compat.TRACE_PLATFORM(None)


def abstract(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """``jax.ShapeDtypeStruct``\\ s of ``tree`` placed with ``specs`` (one spec or a tree)."""
    if isinstance(specs, P):
        return jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, specs)), tree)
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)), tree, specs)


def compile_per_device(fn: Callable[..., Any], mesh: Mesh, *shapes: tuple):
    """``fn`` compiled as each device of ``mesh`` runs it (``shard_map``, every input
    replicated: Mosaic kernels are not partitioned automatically) on inputs given as
    ``(shape, dtype)``: how a kernel or codec alone compiles for the target."""
    sm = _compat.shard_map(fn, mesh=mesh, in_specs=tuple(P() for _ in shapes), out_specs=P(), check_vma=False)
    args = [abstract(jax.ShapeDtypeStruct(s, d), mesh, P()) for s, d in shapes]
    with traced_for(mesh):
        return jax.jit(sm).lower(*args).compile()


def _state(tx, params, mesh, axis_name, per_replica_params=False):
    """The abstract state of ``tx`` for one replica's ``params``, laid out as
    [`commjax.init_sharded`][] lays it out, and its specs."""
    specs, pspecs = layout.state_layout(tx, params, mesh, axis_name, per_replica_params=per_replica_params)
    init = _compat.shard_map(tx.init, mesh=mesh, in_specs=(pspecs,), out_specs=specs, check_vma=False)
    return abstract(jax.eval_shape(init, params), mesh, specs), specs


def compile_update(tx: optax.GradientTransformation, params: Any, mesh: Mesh, axis_name: str = "data", *,
                   per_replica_params: bool = False):
    """The compiled update step ``(params, state, grads) -> (params, state)`` of ``tx``
    over ``axis_name`` (each replica's gradient in, ``optax.apply_updates`` out), for
    ``params`` given as shapes (one replica's). Buffers donated, as a training loop would."""
    with traced_for(mesh):
        return _compile_update(tx, params, mesh, axis_name, per_replica_params)


def _compile_update(tx, params, mesh, axis_name, per_replica_params):
    n = mesh.shape[axis_name]
    state, specs = _state(tx, params, mesh, axis_name, per_replica_params)
    pspec = P(axis_name) if per_replica_params else P()
    stack = (lambda a: jax.ShapeDtypeStruct((n,) + a.shape, a.dtype))
    p = abstract(jax.tree_util.tree_map(stack, params) if per_replica_params else params, mesh, pspec)
    g = abstract(jax.tree_util.tree_map(stack, params), mesh, P(axis_name))

    def local(p, s, g):
        p0 = jax.tree_util.tree_map(lambda a: a[0], p) if per_replica_params else p
        u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p0)
        p0 = optax.apply_updates(p0, u)
        return (jax.tree_util.tree_map(lambda a: a[None], p0) if per_replica_params else p0), s

    fn = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(pspec, specs, P(axis_name)),
                                   out_specs=(pspec, specs), check_vma=False), donate_argnums=(0, 1))
    return fn.lower(p, state, g).compile()


def compile_train(loss: Callable[..., jax.Array], tx: optax.GradientTransformation, params: Any,
                  batch: Any, mesh: Mesh, axis_name: str = "data", *, sync: Optional[InBackwardSync] = None):
    """The compiled train step ``(params, state, batch) -> (params, state, loss)``:
    ``jax.grad`` of ``loss(params, batch_i)`` on each replica's rows of ``batch`` (shapes of
    the global batch), then ``tx`` and ``optax.apply_updates``. With ``sync`` the exchange
    runs in the backward pass ([`commjax.sync_in_backward`][]) and ``tx`` is the optimizer
    alone."""
    with traced_for(mesh):
        return _compile_train(loss, tx, params, batch, mesh, axis_name, sync)


def _compile_train(loss, tx, params, batch, mesh, axis_name, sync):
    full = tx if sync is None else optax.chain(sync.as_transform(), tx)
    state, specs = _state(full, params, mesh, axis_name)
    p, b = abstract(params, mesh, P()), abstract(batch, mesh, P(axis_name))

    def local(p, s, batch):
        if sync is None:
            value, g = jax.value_and_grad(loss)(_compat.vary(p, axis_name), batch)
            u, s = tx.update(g, s, p)
        else:
            (value, g), s0 = sync.value_and_grad(loss)(p, s[0], batch)
            u, s1 = tx.update(g, s[1], p)
            s = (s0, s1)
        return optax.apply_updates(p, u), s, value[None]

    fn = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(axis_name)),
                                   out_specs=(P(), specs, P(axis_name)), check_vma=False),
                 donate_argnums=(0, 1))
    return fn.lower(p, state, b).compile()


_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
                         r"|ragged-all-to-all|collective-broadcast)(-start|-done)?$")
_KERNEL_TARGETS = re.compile(r'custom_call_target="(tpu_custom_call|mosaic_gpu[\w]*|__gpu\$xla\.gpu\.triton'
                             r'|triton_kernel_call|[\w$.]*pallas[\w$.]*)"')


def _is_async_start(ins: hlo.Instr) -> bool:
    return ins.opcode.endswith("-start") and (bool(_COLLECTIVE.match(ins.opcode)) or ins.opcode == "async-start")


def _is_collective(ins: hlo.Instr) -> bool:
    return bool(_COLLECTIVE.match(ins.opcode)) or ins.opcode in ("async-start", "async-done")


def _flops(module: hlo.Module, ins: hlo.Instr, sizes: dict) -> float:
    """``2 M N K`` of a ``dot``/``convolution``, or of every one a fusion holds."""
    if ins.opcode == "fusion":
        called = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
        comp = called.group(1) if called else ""
        inner = module.shapes(comp)
        return sum(_flops(module, i, inner) for i in module.computations.get(comp, []))
    if ins.opcode not in ("dot", "convolution") or not ins.operands:
        return 0.0
    out, lhs = hlo._ARRAY.findall(ins.shape), hlo._ARRAY.findall(sizes.get(ins.operands[0], ""))
    if not out or not lhs:
        return 0.0
    dims = [int(d) for d in lhs[0][1].split(",") if d]
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    k = float(np.prod([dims[int(i)] for i in m.group(1).split(",") if i])) if m else 1.0
    return 2.0 * float(np.prod([int(d) for d in out[0][1].split(",") if d])) * k


def _op_seconds(module: hlo.Module, ins: hlo.Instr, sizes: dict, target: Target) -> float:
    """A roofline time of one compute instruction on ``target``."""
    moved = hlo.instr_bytes(module, ins, sizes)
    return max(moved / target.hbm_bw, _flops(module, ins, sizes) / target.peak_flops)


def overlap(module: hlo.Module, target: Target, ring: dict) -> list:
    """Per asynchronous collective of the entry computation (schedule order): its name,
    ring bytes, transfer time on the fast link, the compute time and the number of
    matrix-product operations scheduled between its start and its done."""
    sizes = module.shapes(module.entry)
    open_: dict = {}
    rows = []
    for ins in module.computations[module.entry]:
        if _is_async_start(ins):
            open_[ins.name] = {"name": ins.name, "opcode": ins.opcode, "ring_bytes": ring.get(ins.name, 0.0),
                               "compute_s": 0.0, "matmuls": 0}
            continue
        if ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in open_:
            row = open_.pop(ins.operands[0])
            row["transfer_s"] = row["ring_bytes"] / target.fast_link_bw
            rows.append(row)
            continue
        if _is_collective(ins) or ins.opcode in hlo._VIEWS:
            continue
        t = _op_seconds(module, ins, sizes, target)
        dots = _flops(module, ins, sizes) > 0
        for row in open_.values():
            row["compute_s"] += t
            row["matmuls"] += int(dots)
    return rows


def _io_bytes(module: hlo.Module) -> float:
    """HBM bytes of the entry's parameters and result: read once, written once."""
    entry = module.computations[module.entry]
    params = sum(hlo.shape_bytes(i.shape) for i in entry if i.opcode == "parameter")
    root = next((i for i in entry if i.root), None)
    return params + (hlo.shape_bytes(root.shape) if root is not None else 0.0)


def _collective_io(module: hlo.Module) -> float:
    """Send buffers read and receive buffers written by the entry's collectives."""
    sizes = module.shapes(module.entry)
    return sum(hlo.instr_bytes(module, i, sizes) for i in module.computations[module.entry]
               if _is_collective(i))


def _kernels(text: str) -> dict:
    found: dict = {}
    for name in _KERNEL_TARGETS.findall(text):
        found[name] = found.get(name, 0) + 1
    return found


def _cost_bytes(compiled) -> Optional[float]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends have no cost model
        return None
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    value = cost.get("bytes accessed") if isinstance(cost, dict) else None
    return float(value) if value is not None else None


def analyze(compiled, target: str) -> dict:
    """The report of one compiled program on ``target`` (module docstring), as a dict of
    plain numbers and lists (JSON-ready)."""
    t = get_target(target)
    text = compiled.as_text()
    module = hlo.parse(text)
    traffic = hlo.traffic(module)
    copies = hlo.input_copies(module)
    moved = traffic.straight - sum(copies.values())
    report = parse_hlo_collectives(text)
    ring = {c.hlo_name: c.ring_bytes for c in report.collectives}
    mem = compiled.memory_analysis()
    rows = overlap(module, t, ring)
    wire = report.total_ring_bytes
    hidden = sum(min(r["transfer_s"], r["compute_s"]) for r in rows)
    out = {
        "target": target, "traffic": moved, "branch_bytes": traffic.branch_bytes,
        "input_copies": sum(copies.values()),
        "ideal": _io_bytes(module) + _collective_io(module),
        "temp": float(mem.temp_size_in_bytes), "arguments": float(mem.argument_size_in_bytes),
        "outputs": float(mem.output_size_in_bytes), "cost_bytes": _cost_bytes(compiled),
        "wire": wire, "collectives": [{"kind": c.kind, "dtypes": list(c.dtypes), "ring_bytes": c.ring_bytes,
                                        "name": c.hlo_name} for c in report.collectives],
        "kernels": _kernels(text), "async": rows,
        "largest": [{"bytes": b, "op": op, "name": n} for b, op, n in traffic.ops if n not in copies][:8],
    }
    compute = moved / t.hbm_bw
    for link, bw in (("fast", t.fast_link_bw), ("slow", t.slow_link_bw)):
        comm = len(report.collectives) * t.alpha + wire / bw
        covered = sum(min(r["ring_bytes"] / bw, r["compute_s"]) for r in rows)
        out[f"projected_{link}_s"] = compute + comm - covered
    out["overlapped_fraction"] = _overlapped(rows)
    out["hidden_s"] = hidden
    return out


def _overlapped(rows: list) -> float:
    """Share of the asynchronous collectives' bytes whose collective has at least its own
    transfer time of compute scheduled beside it (0 when there are none)."""
    total = sum(r["ring_bytes"] for r in rows)
    covered = sum(r["ring_bytes"] for r in rows if r["compute_s"] >= r["transfer_s"] > 0)
    return covered / total if total else 0.0
