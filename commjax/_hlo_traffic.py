"""Memory traffic, kernels and the collective schedule of a compiled HLO module, read from
its text (``compiled.as_text()``), for any backend and with the target's layouts.

What one instruction of the entry computation (or of a ``while``/``conditional``/``call``
it runs) moves in device memory (HBM): the bytes of its operands and results that live in
the default memory space, each array at its *padded* size: the first tile of its layout
rounds its minor dimensions up (TPU: ``T(8,128)`` pads the last two dimensions to
multiples of 8 and 128; a ``u32[n, 8]`` array takes 16x its bytes). Arrays in other
memory spaces (TPU VMEM and SMEM: ``S(1)``, ``S(2)``, ...) are on chip and count nothing.

* views move nothing (``parameter``, ``constant``, ``get-tuple-element``, ``tuple``,
  ``bitcast``, buffer allocations);
* a fusion operand counts only the elements some output of the fused computation needs
  (a leaf cut from a joined bucket reads that leaf, not the bucket; a gather one 32-byte
  sector per element it picks: ``_hlo_reads``);
* an in-place update (``dynamic-update-slice`` or ``scatter``, alone or as a fusion's
  root) reads its other operands (of a fusion's, the part it needs) and writes its
  updates, not the whole buffer; so does one into a buffer its fusion allocates
  (``AllocateBuffer``: the first piece of an array joined from pieces, a cut leaf's mean);
* a slice (``slice``, ``dynamic-slice``, and the TPU's asynchronous ``slice-start`` into
  VMEM) reads its piece, not the array it is cut from, and reads it from HBM only when
  that array is in HBM (a slice of a leaf prefetched into VMEM reads on chip);
* asynchronous pairs count once: a ``*-start`` its operands, a ``*-done`` its result.

Conditional branches are counted apart (``branch_bytes``: the largest branch of each):
they run on some steps only (a codec's overflow fallback). The cheapest branch of each
counts as every step's, so a conditional whose *costly* branch is the common one (work
skipped only when a rare check fires) is undercounted: such a step's traffic is
``straight + branch_bytes``. (PowerSGD's kept residual formed in a conditional's common
branch looked 10-26% cheaper by ``straight`` alone and was 8-27% costlier in all.)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

from commjax._hlo_reads import read_fractions

__all__ = ["Instr", "Module", "parse", "array_bytes", "shape_bytes", "traffic", "Traffic", "input_copies"]

_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8,
         "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3fnuz": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64,
         "c128": 128}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_VIEWS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
          "replica-id", "after-all", "add-dependency", "opt-barrier"}
_FREE_TARGETS = {"AllocateBuffer", "ConcatBitcast", "SliceToDynamic", "Sharding", "SPMDFullToShardShape",
                 "SPMDShardToFullShape", "MoveToHost", "MoveToDevice"}
_SLICES = {"slice", "dynamic-slice", "slice-start"}
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass
class Instr:
    """One instruction: ``shape`` is its result's text, ``operands`` the names it reads."""

    name: str
    shape: str
    opcode: str
    operands: list
    attrs: str
    root: bool = False
    args: str = ""


@dataclasses.dataclass
class Module:
    """A parsed module: computations in text (for a scheduled module: schedule) order."""

    computations: dict
    entry: str

    def shapes(self, comp: str) -> dict:
        return {i.name: i.shape for i in self.computations.get(comp, [])}


def _split_top(text: str) -> tuple[str, str]:
    """``(result shape, rest)`` of ``rest_of_line`` after ``=``: the shape may be a tuple."""
    if text.startswith("("):
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return text[:i + 1], text[i + 1:].lstrip()
    head, _, rest = text.partition(" ")
    return head, rest


def _instr(line: str) -> Optional[Instr]:
    m = _INSTR.match(line)
    if not m:
        return None
    shape, rest = _split_top(m.group(3))
    op_m = re.match(r"([\w\-]+)\((.*)$", rest)
    if not op_m:
        return None
    opcode, tail = op_m.group(1), op_m.group(2)
    depth, end = 1, len(tail)
    for i, ch in enumerate(tail):
        depth += (ch in "({[") - (ch in ")}]")
        if depth == 0:
            end = i
            break
    args = re.sub(r"/\*.*?\*/", "", tail[:end])
    operands = re.findall(r"%([\w.\-]+)", args)
    return Instr(m.group(2), shape, opcode, operands, tail[end + 1:], bool(m.group(1)), args.strip())


def parse(text: str) -> Module:
    """The computations of an HLO module's text, each a list of ``Instr``."""
    comps: dict = {}
    entry, current = "", None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
            continue
        if current is not None and line.startswith(" "):
            ins = _instr(line)
            if ins is not None:
                comps[current].append(ins)
    return Module(comps, entry)


def array_bytes(dtype: str, dims: str, layout: Optional[str]) -> tuple[float, int]:
    """``(padded bytes, memory space)`` of one array ``dtype[dims]{layout}``."""
    shape = [int(d) for d in dims.split(",") if d]
    space = 0
    if layout:
        body = layout[1:-1]
        order_text, _, rest = body.partition(":")
        sm = re.search(r"S\((\d+)\)", rest)
        space = int(sm.group(1)) if sm else 0
        tm = re.match(r"T\(([\d,]+)\)", rest)
        order = [int(o) for o in order_text.split(",") if o]
        if tm and order and len(order) == len(shape):
            tile = [int(t) for t in tm.group(1).split(",")]
            minor_first = [shape[i] for i in order]  # dims from minor to major
            for k, t in enumerate(reversed(tile)):
                if k < len(minor_first):
                    minor_first[k] = -(-minor_first[k] // t) * t
            shape = minor_first
    return math.prod(shape) * _BITS.get(dtype, 32) / 8.0, space


def hlo_arrays(shape: str) -> list:
    """``(dtype, dims, layout)`` of every array in an HLO shape text, in order."""
    return [(d, dims, layout or None) for d, dims, layout in _ARRAY.findall(shape) if d in _BITS]


def shape_bytes(shape: str, *, hbm_only: bool = True) -> float:
    """Padded bytes of every array in an HLO shape text (tuples: each element)."""
    total = 0.0
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in _BITS:
            continue
        b, space = array_bytes(dtype, dims, layout or None)
        if space == 0 or not hbm_only:
            total += b
    return total



def _in_hbm(shape: str) -> float:
    """1 when the (first) array of an HLO shape text lives in HBM or is unknown, else 0."""
    arrays = hlo_arrays(shape)
    return 1.0 if not arrays or array_bytes(*arrays[0])[1] == 0 else 0.0


@dataclasses.dataclass
class Traffic:
    """HBM bytes of one computation: ``straight`` (every step: the straight-line operations
    and, of each conditional, its cheapest branch, since one of its branches runs whatever
    the predicate), ``branch_bytes`` (what each conditional's costliest branch costs beyond
    its cheapest: some steps only) and the top-level operations as ``(bytes, opcode,
    name)``, largest first (a conditional with its cheapest branch's bytes)."""

    straight: float
    branch_bytes: float
    ops: list


def _called(ins: Instr) -> list:
    names = [m.group(2) for m in _CALLS.finditer(ins.attrs)]
    for group in _BRANCHES.findall(ins.attrs):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


def _params(module: Module, comp: str) -> dict:
    """Parameter name -> operand index, in computation ``comp``."""
    return {i.name: int(i.args) for i in module.computations.get(comp, [])
            if i.opcode == "parameter" and i.args.isdigit()}


def _partial_reads(module: Module, comp: str, reads: list) -> list:
    """Bytes of each operand a fused computation reads: its padded bytes times the fraction
    of its elements that some output needs ([`commjax._hlo_reads`][])."""
    fractions = read_fractions(module.computations.get(comp, []))
    return [r * fractions.get(k, 1.0) for k, r in enumerate(reads)]


def _updates(ins: Instr) -> list:
    """The operands an in-place ``scatter`` or ``dynamic-update-slice`` writes: its updates."""
    if ins.opcode == "dynamic-update-slice":
        return ins.operands[1:2]
    n = (len(ins.operands) - 1) // 2  # scatter: n buffers, the indices, n updates
    return ins.operands[n + 1:]


def _allocated(module: Module, comp: str, name: Optional[str]) -> bool:
    """Whether ``name`` is a buffer allocated in the fused computation ``comp`` (a custom
    call to ``AllocateBuffer``): uninitialized, so an update into it writes its piece only
    (the first piece of a joined array; later pieces update that buffer in place)."""
    return any(i.name == name and i.opcode == "custom-call" and '"AllocateBuffer"' in i.attrs
               for i in module.computations.get(comp, []))


def _in_place(module: Module, ins: Instr, comp: Optional[str], sizes: dict) -> Optional[float]:
    """Bytes of an in-place update: the other operands read (the part of each a fused
    computation reads), the updates written; the buffer updated is neither."""
    if comp is not None:
        roots = [i for i in module.computations.get(comp, []) if i.root]
        if not roots or roots[0].opcode not in ("scatter", "dynamic-update-slice"):
            return None
        params = _params(module, comp)
        buffer = roots[0].operands[0] if roots[0].operands else None
        if buffer not in params and not _allocated(module, comp, buffer):
            return None
        reads = _partial_reads(module, comp, [shape_bytes(sizes.get(o, "")) for o in ins.operands])
        inner = module.shapes(comp)
        written = sum(shape_bytes(inner.get(o, "")) for o in _updates(roots[0]))
        return sum(r for k, r in enumerate(reads) if k != params.get(buffer)) + written
    if ins.opcode not in ("scatter", "dynamic-update-slice"):
        return None
    reads = sum(shape_bytes(sizes.get(o, "")) for o in ins.operands[1:])
    return reads + sum(shape_bytes(sizes.get(o, "")) for o in _updates(ins))


def instr_bytes(module: Module, ins: Instr, sizes: dict) -> float:
    """HBM bytes one top-level instruction moves (module docstring)."""
    if ins.opcode in _VIEWS:
        return 0.0
    if ins.opcode == "custom-call" and any(f'"{t}"' in ins.attrs for t in _FREE_TARGETS):
        return 0.0
    if ins.opcode.endswith("-done"):
        return shape_bytes(ins.shape)
    if ins.opcode in _SLICES:  # reads the slice, not the array it is cut from
        arrays = hlo_arrays(ins.shape)
        piece = arrays[1] if ins.opcode == "slice-start" and len(arrays) > 1 else arrays[0]
        written = 0.0 if ins.opcode == "slice-start" else shape_bytes(ins.shape)
        # A slice of an array already on chip (a leaf prefetched to VMEM) reads no HBM.
        return array_bytes(*piece)[0] * _in_hbm(sizes.get(ins.operands[0], "")) + written
    reads = [shape_bytes(sizes.get(o, "")) for o in ins.operands]
    if ins.opcode.endswith("-start"):
        return sum(reads)
    comp = _fused(ins)
    moved = _in_place(module, ins, comp, sizes)
    if moved is not None:
        return moved
    if comp:
        reads = _partial_reads(module, comp, reads)
    return shape_bytes(ins.shape) + sum(reads)


def _fused(ins: Instr) -> Optional[str]:
    if ins.opcode != "fusion":
        return None
    m = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
    return m.group(1) if m else None


def traffic(module: Module, comp: Optional[str] = None) -> Traffic:
    """``Traffic`` of computation ``comp`` (the entry by default), with the
    computations its ``while`` loops and ``call`` instructions run added to ``straight``,
    and its conditionals' cheapest branches (XLA may move work every step does into a
    conditional's branches: counting none of them hid it)."""
    comp = comp or module.entry
    sizes = module.shapes(comp)
    straight = branches = 0.0
    ops = []
    for ins in module.computations.get(comp, []):
        if ins.opcode in ("while", "call"):
            for c in _called(ins):
                t = traffic(module, c)
                straight, branches = straight + t.straight, branches + t.branch_bytes
            continue
        if ins.opcode == "conditional":
            inner = [traffic(module, c) for c in _called(ins)]
            low = min((t.straight for t in inner), default=0.0)
            straight += low
            branches += max((t.straight + t.branch_bytes for t in inner), default=0.0) - low
            if low:
                ops.append((low, ins.opcode, ins.name))
            continue
        b = instr_bytes(module, ins, sizes)
        straight += b
        if b:
            ops.append((b, ins.opcode, ins.name))
    return Traffic(straight, branches, sorted(ops, reverse=True))


#: Collectives that may write their result into their operand's buffer (a GPU's all-reduce).
_IN_PLACE_COLLECTIVES = {"all-reduce", "all-reduce-start"}


def input_copies(module: Module) -> dict:
    """``{name: bytes}`` of the entry computation's copies of its own parameters made only
    to be an in-place collective's buffer: ``copy(parameter)`` whose every user (through
    bitcasts) is an all-reduce. A program may not overwrite an input it was not given, so
    a GPU program whose gradients are its inputs copies each one it all-reduces alone; a
    train step, whose backward pass writes the gradients, copies none."""
    entry = module.computations.get(module.entry, [])
    by = {i.name: i for i in entry}
    users: dict = {}
    for i in entry:
        for o in i.operands:
            users.setdefault(o, []).append(i)

    def source(name: str) -> Optional[Instr]:
        i = by.get(name)
        while i is not None and i.opcode == "bitcast" and i.operands:
            i = by.get(i.operands[0])
        return i

    def ends(name: str) -> list:
        return [e for u in users.get(name, []) for e in (ends(u.name) if u.opcode == "bitcast" else [u])]

    sizes = module.shapes(module.entry)
    out = {}
    for i in entry:
        src = source(i.operands[0]) if i.opcode == "copy" and i.operands else None
        if src is None or src.opcode != "parameter":
            continue
        final = ends(i.name)
        if final and all(u.opcode in _IN_PLACE_COLLECTIVES for u in final):
            out[i.name] = instr_bytes(module, i, sizes)
    return out
