"""Memory traffic of one compiled training step, per method, read from the optimized HLO.

The CPU cost of a codec is mostly memory traffic: on the 2-core machine of
``benchmarks/bandwidth.py`` one pass over the 13.7M-parameter fp32 gradient (read and
write) takes about 25 ms (``benchmarks/codec_cpu.py``). This script compiles the same
step as that benchmark (its model, methods and SGD, one replica per device, on forced CPU
devices in one process) and adds up, over the top-level operations of the compiled
per-device program, the bytes of every operand and result. Unlike a wall-clock time,
the count does not move with the load of the machine, so a change that makes XLA write
or read the gradient once more shows up as about ``8 n`` bytes (``n`` parameters), in
any run.

What is counted, per replica and step:

* ``straight``: every top-level operation (fusions, dots, collectives, copies); a view
  (``bitcast``, ``get-tuple-element``, ``tuple``, ``parameter``, ``constant``) moves
  nothing. An operand that a fusion only slices counts as its slices; any other operand
  counts whole, even where the operation reads part of it (a gather, a dynamic slice):
  an upper bound. A scatter or dynamic-update-slice (alone or as a fusion's root)
  updates its buffer in place: its indices and updates, the updates twice (XLA inserts
  an explicit ``copy`` where the buffer cannot be reused, and that copy is counted).
* ``branches``: the operations inside conditionals, largest branch of each (branches
  that run only on some steps, such as a codec's overflow fallback, are not in
  ``straight``);
* ``passes``: ``straight / (8 n)``, the step in units of one read and one write of the
  fp32 gradient.

Each row also compares with the exact fp32 mean and the no-exchange floor of the same
run. With ``--time`` the steps are also timed, every replica's program on one core
(``taskset``-free: the process pins itself with ``os.sched_setaffinity``), as medians over
``--steps``; those times do move with the load of the machine.

    python benchmarks/step_traffic.py [--methods exact,sign,...] [--devices 4] [--time]

Writes ``benchmarks/results/step_traffic.json``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

MAX_DEVICES = 8
# The device count first: XLA stops reading flags at the bare token that follows.
os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={MAX_DEVICES} "
                           + os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import bandwidth  # noqa: E402  (the model, batches and methods of the link benchmark)
from _results import write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "step_traffic.json"
DEFAULT_METHODS = ("no_exchange", "exact", "int8", "int4", "sign", "top_k_1pct", "powersgd_r4",
                   "onebit_adam")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_INSTR = re.compile(r"\s*(?:ROOT )?%(\S+) = (.*?) ([\w\-]+)\((.*?)\)(, .*)?$")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\{$")
_VIEWS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (a tuple counts each of its arrays)."""
    total = 0
    for dtype, dims in _SHAPE.findall(shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _BYTES[dtype]
    return total


def computations(text: str) -> tuple[dict[str, list[str]], str]:
    """The instruction lines of every computation of an HLO module, and the entry's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
        elif current is not None and line.startswith("  "):
            comps[current].append(line)
    return comps, entry


def _called(attrs: str) -> list[str]:
    names = re.findall(r"(?:true_computation|false_computation|body|condition)=%?([\w.\-]+)", attrs)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", attrs):
        names += [n.strip().lstrip("%") for n in group.split(",")]
    return names


def _operands(args: str) -> list[str]:
    """The instruction names in an HLO operand list (``/*index=5*/`` comments dropped)."""
    return [a.strip().split("*/")[-1].lstrip("%") for a in args.split(",")]


def _parameters(comps: dict[str, list[str]], fused: str) -> dict[str, int]:
    """Parameter name -> operand index, in computation ``fused``."""
    matches = (_INSTR.match(line) for line in comps.get(fused, []))
    return {m.group(1): int(m.group(4)) for m in matches if m and m.group(3) == "parameter"}


def _sliced_reads(comps: dict[str, list[str]], fused: str) -> dict[int, int]:
    """Per parameter of fused computation ``fused`` that is only ever sliced, the bytes of
    its slices (what the fusion reads of that operand)."""
    users: dict[str, list[tuple[str, str]]] = {}
    for line in comps.get(fused, []):
        m = _INSTR.match(line)
        if m and m.group(3) != "parameter":
            for a in _operands(m.group(4)):
                users.setdefault(a, []).append((m.group(3), m.group(2)))
    reads = {}
    for pname, index in _parameters(comps, fused).items():
        use = users.get(pname, [])
        if use and all(op == "slice" for op, _ in use):
            reads[index] = sum(shape_bytes(shape) for _, shape in use)
    return reads


def _in_place(comps: dict[str, list[str]], fused: Optional[str], op: str, operands: list[str],
              sizes: dict[str, str]) -> Optional[int]:
    """Bytes moved by an in-place update (a ``scatter`` or ``dynamic-update-slice``, alone
    or as a fusion's root), which rewrites only its updates in the buffer it is given:
    indices and updates read, updates read and written back. ``None`` for anything else."""
    if fused is not None:
        roots = [_INSTR.match(l) for l in comps.get(fused, []) if l.lstrip().startswith("ROOT ")]
        if not roots or roots[0] is None or roots[0].group(3) not in ("scatter", "dynamic-update-slice"):
            return None
        params = _parameters(comps, fused)
        inner = _operands(roots[0].group(4))
        if inner[0] not in params:
            return None
        rest = [o for i, o in enumerate(operands) if i != params[inner[0]]]
    elif op in ("scatter", "dynamic-update-slice"):
        rest = operands[1:]
    else:
        return None
    # The updates are the last operand of both; counted twice (read, then written).
    return sum(shape_bytes(sizes.get(o, "")) for o in rest) + shape_bytes(sizes.get(rest[-1], ""))


def traffic(comps: dict[str, list[str]], name: str) -> dict[str, Any]:
    """``{"straight", "branches"}`` bytes of computation ``name`` (see the module docstring),
    and ``"ops"``: its top-level operations as ``(bytes, opcode, name)``, largest first."""
    sizes: dict[str, str] = {}
    straight = branches = 0.0
    ops: list[tuple[float, str, str]] = []
    for line in comps.get(name, []):
        m = _INSTR.match(line)
        if not m:
            continue
        out, shape, op, args, attrs = m.group(1), m.group(2), m.group(3), m.group(4), m.group(5) or ""
        sizes[out] = shape
        if op in _VIEWS:
            continue
        if op in ("conditional", "while", "call"):
            inner = [traffic(comps, c) for c in _called(attrs)]
            branches += max((t["straight"] + t["branches"] for t in inner), default=0.0)
            continue
        operands = _operands(args)
        called = re.search(r"calls=%?([\w.\-]+)", attrs) if op == "fusion" else None
        fused = called.group(1) if called else None
        moved = _in_place(comps, fused, op, operands, sizes)
        if moved is None:
            sliced = _sliced_reads(comps, fused) if fused else {}
            moved = shape_bytes(shape) + sum(
                min(sliced.get(i, 1 << 62), shape_bytes(sizes.get(o, ""))) for i, o in enumerate(operands))
        straight += moved
        ops.append((moved, op, out))
    return {"straight": straight, "branches": branches, "ops": sorted(ops, reverse=True)}


def _mlp(cfg: dict):
    import jax
    import jax.numpy as jnp
    import optax

    def loss(p, x, y):
        for i, (k, b) in enumerate(p):
            x = x @ k + b
            if i < len(p) - 1:
                x = jax.nn.gelu(x)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(x, y))

    return [tuple(kb) for kb in bandwidth.init_params(cfg)], loss


def compile_step(name: str, params, loss, mesh, n: int):
    """``(compiled step, its arguments)`` of ``name``, built as ``bandwidth.py``'s workers
    build theirs (parameters replicated unless the method keeps them per replica), on a
    mesh of ``n`` of the forced devices (``cj.init_sharded`` sizes the state for it)."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import commjax as cj
    from commjax import _compat

    ax = bandwidth.AXIS
    m = bandwidth.jax_method(name, params, n)
    state = cj.init_sharded(m.tx, params, mesh, ax)
    specs = cj.state_specs(state, ax)
    pspec = P(ax) if m.per_replica_params else P()

    def local(p, s, xb, yb):
        if m.per_replica_params:
            p = jax.tree_util.tree_map(lambda a: a[0], p)
        g = jax.grad(loss)(cj.vary(p, ax), xb, yb)
        u, s = m.tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        if m.per_replica_params:
            p = jax.tree_util.tree_map(lambda a: a[None], p)
        return p, s

    fn = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(pspec, specs, P(ax), P(ax)),
                                   out_specs=(pspec, specs), check_vma=m.check_vma))
    batches = [bandwidth.make_batch(bandwidth.MODEL, r, n) for r in range(n)]
    data = NamedSharding(mesh, P(ax))
    x = jax.device_put(np.concatenate([b[0] for b in batches]), data)
    y = jax.device_put(np.concatenate([b[1] for b in batches]), data)
    p = params if not m.per_replica_params else jax.tree_util.tree_map(lambda a: np.stack([a] * n), params)
    p = jax.device_put(p, NamedSharding(mesh, pspec))
    return fn.lower(p, state, x, y).compile(), (p, state, x, y)


def time_steps(compiled, args, steps: int) -> dict[str, float]:
    import jax
    import numpy as np

    p, s, x, y = args
    for _ in range(2):
        p, s = compiled(p, s, x, y)
    jax.block_until_ready(p)
    wall, cpu0 = [], time.process_time()
    for _ in range(steps):
        t = time.perf_counter()
        p, s = compiled(p, s, x, y)
        jax.block_until_ready(p)
        wall.append(time.perf_counter() - t)
    return {"median_s": float(np.median(wall)), "cpu_s": (time.process_time() - cpu0) / steps}


def run(methods: list[str], devices: int, timed: bool, steps: int, top: int = 8) -> list[dict[str, Any]]:
    import jax

    from commjax import _compat

    mesh = _compat.make_mesh((devices,), (bandwidth.AXIS,), devices=jax.devices()[:devices])
    params, loss = _mlp(bandwidth.MODEL)
    n_params = bandwidth.num_params(bandwidth.MODEL)
    rows = []
    for name in methods:
        compiled, args = compile_step(name, params, loss, mesh, devices)
        comps, entry = computations(compiled.as_text())
        t = traffic(comps, entry)
        row = {"method": name, "straight_mb": t["straight"] / 1e6, "branches_mb": t["branches"] / 1e6,
               "passes": t["straight"] / (8 * n_params),
               "largest": [{"mb": b / 1e6, "op": op, "name": o} for b, op, o in t["ops"][:top]]}
        if timed:
            row.update(time_steps(compiled, args, steps))
        rows.append(row)
        print(f"  {name}: {row['straight_mb']:.1f} MB; largest: " + ", ".join(
            f"{r['name']} {r['mb']:.1f}" for r in row["largest"][:4]), flush=True)
    by = {r["method"]: r for r in rows}
    for r in rows:
        for base in ("exact", bandwidth.FLOOR):
            if base in by:
                r[f"over_{base}"] = r["straight_mb"] / by[base]["straight_mb"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'method':14} {'MB/step':>9} {'passes':>7} {'x exact':>8} {'x floor':>8} {'branches MB':>12}"
    timed = "median_s" in rows[0]
    if timed:
        head += f" {'step ms':>8} {'cpu ms':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['method']:14} {r['straight_mb']:9.1f} {r['passes']:7.2f} {r.get('over_exact', float('nan')):8.2f} "
                f"{r.get('over_' + bandwidth.FLOOR, float('nan')):8.2f} {r['branches_mb']:12.1f}")
        if timed:
            line += f" {r['median_s'] * 1e3:8.1f} {r['cpu_s'] * 1e3:7.1f}"
        lines.append(line)
    return "\n".join(lines)


def _commit() -> str:
    """The commit of the tree this script runs in (``+dirty`` with uncommitted changes)."""
    here = str(Path(__file__).resolve().parent)
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "../commjax"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--devices", type=int, default=4, help="replicas (forced CPU devices)")
    ap.add_argument("--time", action="store_true", help="also time the steps on one core")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per method (with --time)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if not 2 <= args.devices <= MAX_DEVICES:
        ap.error(f"--devices must be in [2, {MAX_DEVICES}] (one replica sends nothing), got {args.devices}")
    if args.time:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import jax

    rows = run(args.methods.split(","), args.devices, args.time, args.steps)
    print(table(rows))
    write_results(args.out, {
        "command": "python benchmarks/step_traffic.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": bandwidth.MODEL, "params": bandwidth.num_params(bandwidth.MODEL), "devices": args.devices,
        "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "commit": _commit(), "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
