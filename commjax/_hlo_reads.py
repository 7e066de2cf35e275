"""Which elements of its operands a fused computation reads: the demand of its outputs,
carried back through the fused instructions.

A fusion reads an operand element only where some output element needs it. XLA fuses a
``concatenate`` followed by a ``slice`` (joining leaves into a bucket, then cutting one
leaf back out) into each consumer, and the emitted loop reads, for each output element,
the one operand element it comes from: the other leaves' parts of the bucket are never
loaded. Counting every operand in full would charge each such consumer the whole bucket.

Demand is kept per instruction as one of

* everything (``None`` in the code below: the instruction's whole result);
* a set of half-open intervals of element positions, row-major (``_Intervals``), where
  each position is known: through element-wise operations, row-major bitcasts and
  reshapes, slices along the leading dimensions, and concatenations that join whole
  row-major pieces;
* a count of elements at unknown positions (``_Count``): after an operation that moves
  elements the analysis does not follow (a bitcast between tiled layouts, a dynamic
  slice; a gather, whose runs shorter than a 32-byte memory sector load the sector).

Every other operation demands its operands whole. The result is an upper bound on the
elements read, never below what the loop loads.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Union

__all__ = ["read_fractions"]

# Operations whose output element i needs only element i of each same-shaped operand.
_ELEMENTWISE = {
    "abs", "add", "and", "atan2", "bitcast-convert", "cbrt", "ceil", "clamp", "compare",
    "complex", "convert", "cosine", "divide", "erf", "exponential", "exponential-minus-one",
    "floor", "imag", "is-finite", "log", "log-plus-one", "logistic", "maximum", "minimum",
    "multiply", "negate", "not", "or", "popcnt", "power", "real", "remainder",
    "round-nearest-afz", "round-nearest-even", "rsqrt", "select", "shift-left",
    "shift-right-arithmetic", "shift-right-logical", "sign", "sine", "sqrt", "subtract",
    "tan", "tanh", "xor", "count-leading-zeros", "stochastic-convert",
}
_RESHAPES = {"bitcast", "reshape"}
_ARRAY = re.compile(r"\b[a-z][a-z0-9]*\[([\d,]*)\](\{[^}]*\})?")
_MAX_INTERVALS = 4096


class _Count:
    """``n`` demanded elements at positions the analysis does not know."""

    def __init__(self, n: int):
        self.n = n


_Intervals = list  # sorted, disjoint [lo, hi) pairs
_Demand = Union[None, _Intervals, _Count]


def _dims(shape: str) -> Optional[list]:
    m = _ARRAY.search(shape)
    return None if m is None else [int(d) for d in m.group(1).split(",") if d]


def _element_bits(shape: str) -> int:
    m = re.match(r"\(?[a-z]+?(\d+)", shape)
    return int(m.group(1)) if m else 8


def _minor_slice(attrs: str) -> int:
    """A gather's slice size along the operand's last dimension (1 if not given)."""
    m = re.search(r"slice_sizes=\{([\d,]*)\}", attrs)
    sizes = [int(v) for v in m.group(1).split(",") if v] if m else []
    return sizes[-1] if sizes else 1


def _row_major(shape: str) -> bool:
    """Whether the array's layout is plain row-major (no tiles, descending order)."""
    m = _ARRAY.search(shape)
    if m is None:
        return False
    dims = [d for d in m.group(1).split(",") if d]
    layout = (m.group(2) or "")[1:-1]
    order, _, rest = layout.partition(":")
    if "T(" in rest:
        return len(dims) <= 1 and _trivial_1d_tile(rest)
    want = ",".join(str(i) for i in reversed(range(len(dims))))
    return order in ("", want)


def _trivial_1d_tile(rest: str) -> bool:
    return re.fullmatch(r"T\(\d+\)(S\(\d+\))?", rest) is not None


def _size(d: _Demand, total: int) -> int:
    if d is None:
        return total
    if isinstance(d, _Count):
        return min(d.n, total)
    return sum(hi - lo for lo, hi in d)


def _union(a: _Demand, b: _Demand, total: int) -> _Demand:
    if a is None or b is None:
        return None
    if isinstance(a, _Count) or isinstance(b, _Count):
        return _Count(min(total, _size(a, total) + _size(b, total)))
    merged: list = []
    for lo, hi in sorted(a + b):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged if len(merged) <= _MAX_INTERVALS else _Count(_size(merged, total))


def _shift(d: _Demand, lo: int, hi: int) -> _Demand:
    """The part of ``d`` inside ``[lo, hi)``, moved to start at 0."""
    if d is None:
        return [(0, hi - lo)]
    if isinstance(d, _Count):
        return _Count(min(d.n, hi - lo))
    return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in d if min(b, hi) > max(a, lo)]


def _slice_bounds(attrs: str) -> Optional[list]:
    m = re.search(r"slice=\{([^}]*)\}", attrs)
    if not m:
        return None
    out = []
    for part in re.findall(r"\[([^\]]*)\]", m.group(1)):
        nums = [int(v) for v in part.split(":")]
        if len(nums) == 3 and nums[2] != 1:
            return None
        out.append((nums[0], nums[1]))
    return out


def _slice_demand(d: _Demand, out_dims: list, in_dims: list, bounds: list) -> _Demand:
    """Operand demand of a unit-stride slice: each run of the output along its last cut
    dimension (and all dimensions after it) is one contiguous run of the operand; exact
    up to ``_MAX_INTERVALS`` runs, a count beyond."""
    n_out, n_in = math.prod(out_dims), math.prod(in_dims)
    if len(bounds) != len(in_dims):
        return _Count(_size(d, n_out))
    cut = [k for k, (lo, hi) in enumerate(bounds) if (lo, hi) != (0, in_dims[k])]
    if not cut:
        return d
    last = cut[-1]
    inner = math.prod(in_dims[last + 1:])
    run = (bounds[last][1] - bounds[last][0]) * inner
    rows = n_out // max(run, 1)
    if rows > _MAX_INTERVALS or isinstance(d, _Count):
        return _Count(_size(d, n_out))
    strides = [math.prod(in_dims[k + 1:]) for k in range(last + 1)]
    picked = []
    for r in range(rows):
        start, rem = bounds[last][0] * strides[last], r
        for k in reversed(range(last)):
            span = bounds[k][1] - bounds[k][0]
            start += (bounds[k][0] + rem % span) * strides[k]
            rem //= span
        # output positions [r run, (r + 1) run) come from [start, start + run)
        piece = [(0, run)] if d is None else _shift(d, r * run, (r + 1) * run)
        picked += [(start + a, start + b) for a, b in piece]
    return _union(picked, [], n_in)


def _concat_demands(d: _Demand, out_dims: list, parts: list, attrs: str) -> list:
    """Each operand's demand of a ``concatenate``: its own run of positions when the
    operands are whole row-major runs of the result (every dimension before the joined
    one has size 1), else as much as it could hold."""
    m = re.search(r"dimensions=\{(\d+)\}", attrs)
    axis = int(m.group(1)) if m else -1
    n_out = math.prod(out_dims)
    if axis < 0 or any(s != 1 for s in out_dims[:axis]):
        return [None if d is None else _Count(min(_size(d, n_out), math.prod(p))) for p in parts]
    out, off = [], 0
    for p in parts:
        n = math.prod(p)
        out.append(None if d is None else _shift(d, off, off + n))
        off += n
    return out


def _operand_demands(ins, d: _Demand, shapes: dict) -> list:
    """The demand ``ins`` puts on each operand, given the demand ``d`` on its result."""
    out_dims = _dims(ins.shape)
    op_shapes = [shapes.get(o, "") for o in ins.operands]
    op_dims = [_dims(s) for s in op_shapes]
    if out_dims is None or any(x is None for x in op_dims):
        return [None] * len(op_dims)
    n_out = math.prod(out_dims)
    if ins.opcode in _ELEMENTWISE:
        return [d if od == out_dims else None for od in op_dims]
    if ins.opcode in _RESHAPES and math.prod(op_dims[0]) == n_out:
        if _row_major(ins.shape) and _row_major(op_shapes[0]):
            return [d]
        return [_Count(_size(d, n_out))]
    if ins.opcode == "slice":
        bounds = _slice_bounds(ins.attrs)
        if bounds is not None:
            return [_slice_demand(d, out_dims, op_dims[0], bounds)]
    if ins.opcode == "concatenate":
        return _concat_demands(d, out_dims, op_dims, ins.attrs)
    if ins.opcode == "dynamic-slice":
        return [_Count(_size(d, n_out))] + [None] * (len(op_dims) - 1)
    if ins.opcode == "gather":
        # One operand element per output element, at positions the indices decide, in
        # runs of the minor slice size: a run shorter than a 32-byte memory sector loads
        # the whole sector.
        run = _minor_slice(ins.attrs) * _element_bits(op_shapes[0])
        per_sector = max(1, -(-256 // max(run, 1)))
        return [_Count(per_sector * _size(d, n_out))] + [None] * (len(op_dims) - 1)
    return [None] * len(op_dims)


def read_fractions(instrs: list) -> dict:
    """Parameter number -> the fraction (0 to 1) of its elements the fused computation
    ``instrs`` (parsed instructions, definitions before uses, as HLO text lists them)
    reads, for every parameter read less than whole."""
    shapes = {i.name: i.shape for i in instrs}
    demand: dict = {}
    for ins in reversed(instrs):
        if ins.root:
            d: _Demand = None
        elif ins.name in demand:
            d = demand[ins.name]
        else:
            continue  # nothing uses it
        for o, od in zip(ins.operands, _operand_demands(ins, d, shapes)):
            dims = _dims(shapes.get(o, ""))
            total = math.prod(dims) if dims is not None else 0
            demand[o] = od if o not in demand else _union(demand[o], od, total)
    out = {}
    for ins in instrs:
        if ins.opcode != "parameter" or not ins.args.isdigit():
            continue
        dims = _dims(ins.shape)
        total = math.prod(dims) if dims else 1
        got = _size(demand[ins.name], total) if ins.name in demand else 0
        if got < total:
            out[int(ins.args)] = got / total if total else 1.0
    return out
