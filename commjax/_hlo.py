"""Reading the collectives of an HLO module from its text (the parser behind
[`commjax.collective_bytes`][]).

``scan`` returns one ``RawCollective`` per collective instruction reachable from
the entry computation: its kind, operand element types and bytes, replica-group size, and
whether a ``while`` body or a ``conditional`` branch lies on the way to it. Byte totals and
the ring convention are [`commjax.accounting`][]'s.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple

ALL_REDUCE = "all-reduce"
ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
ALL_TO_ALL = "all-to-all"
COLLECTIVE_PERMUTE = "collective-permute"
COLLECTIVE_KINDS: tuple[str, ...] = (
    ALL_REDUCE,
    ALL_GATHER,
    REDUCE_SCATTER,
    ALL_TO_ALL,
    COLLECTIVE_PERMUTE,
)


class AccountingError(RuntimeError):
    """A function could not be compiled, or its HLO could not be read."""


class RawCollective(NamedTuple):
    """One collective instruction as the text states it (see
    [`commjax.accounting.Collective`][])."""

    kind: str
    dtypes: tuple
    operand_bytes: int
    group_size: int
    hlo_name: str
    in_loop: bool
    in_conditional: bool
    computation: str
    opcode: str

_COMMENT_RE = re.compile(r"/\*.*?\*/")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMP_HEADER_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s({]+)")
_INSTR_RE = re.compile(
    r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>(?:\(|[a-z][a-z0-9]*\[).*)$"
)
_LEAF_RE = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_OPCODE_RE = re.compile(r"\s*(?P<opcode>[a-z][\w\-]*)\s*\(")
_DTYPE_RE = re.compile(r"^(?P<base>s|u|f|bf|c)(?P<bits>\d+)")

# Attributes through which one computation calls another.
_CALL_ATTR_RE = re.compile(
    r"\b(?P<key>calls|to_apply|body|condition|branch_computations|true_computation|"
    r"false_computation|called_computations|async_wrapped_computation)\s*=\s*"
    r"(?P<val>\{[^{}]*\}|%?[\w.\-]+)"
)

_SYNC_OPCODES = {k: k for k in COLLECTIVE_KINDS}
_START_OPCODES = {f"{k}-start": k for k in COLLECTIVE_KINDS}


def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO element type (``pred`` = 8, ``s4`` = 4, ``f8e4m3fn`` = 8,
    ``c64`` = 64, ``token`` = 0)."""
    if dtype == "pred":
        return 8
    if dtype in ("token", "opaque"):
        return 0
    m = _DTYPE_RE.match(dtype)
    if m is None:
        raise AccountingError(f"unknown HLO element type {dtype!r}")
    return int(m.group("bits"))


@dataclasses.dataclass(frozen=True)
class _Leaf:
    dtype: str
    elements: int

    @property
    def nbytes(self) -> float:
        return self.elements * dtype_bits(self.dtype) / 8.0


# A parsed shape: a _Leaf (array) or a tuple of shapes.
_Shape = Any


def _parse_shape(text: str) -> tuple[_Shape, int]:
    """Parse one HLO shape at the start of ``text``; return (shape, end index)."""
    i = 0
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    if i < n and text[i] == "(":
        i += 1
        elems: list[_Shape] = []
        while True:
            while i < n and (text[i].isspace() or text[i] == ","):
                i += 1
            if i >= n:
                raise AccountingError(f"unterminated tuple shape in {text[:200]!r}")
            if text[i] == ")":
                return tuple(elems), i + 1
            sub, j = _parse_shape(text[i:])
            elems.append(sub)
            i += j
    m = _LEAF_RE.match(text, i)
    if m is None:
        raise AccountingError(f"cannot parse HLO shape at {text[i:i + 80]!r}")
    dims = []
    for d in m.group("dims").split(","):
        d = d.strip().lstrip("<=").strip()
        if d:
            if not d.isdigit():
                raise AccountingError(f"unsupported dimension {d!r} in HLO shape {m.group(0)!r}")
            dims.append(int(d))
    leaf = _Leaf(m.group("dtype"), math.prod(dims))
    i = m.end()
    # Optional layout: a balanced {...} right after the dims.
    if i < n and text[i] == "{":
        depth = 0
        while i < n:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    i += 1
                    break
            i += 1
    return leaf, i


def _leaves(shape: _Shape) -> list[_Leaf]:
    if isinstance(shape, _Leaf):
        return [shape]
    return [leaf for s in shape for leaf in _leaves(s)]


def _balanced(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket group that opens at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _mesh_groups(text: str, key: str) -> list[list[int]]:
    """Groups of the mesh form ``mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}``: the
    devices laid out as the named mesh, one group along the named axes for every position
    of the others (the form XLA writes for shard_map manual over some axes only)."""
    m = re.match(r"mesh\[([^\]]*)\],\s*device_ids=\(\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\)\s*"
                 r"\{([^}]*)\}", text)
    if m is None:
        raise AccountingError(f"cannot parse {key} at {text[:80]!r}")
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))]
    dims = [int(v) for v in m.group(2).split(",") if v.strip()]
    ids = list(range(math.prod(dims)))
    if m.group(3):  # iota over dims, transposed
        perm = [int(v) for v in m.group(3).split(",") if v.strip()]
        strides = [math.prod(dims[k + 1:]) for k in range(len(dims))]
        shape = [dims[p] for p in perm]
        ids = []
        for flat in range(math.prod(shape)):
            idx, rem = [], flat
            for size in reversed(shape):
                idx.append(rem % size)
                rem //= size
            idx.reverse()
            ids.append(sum(i * strides[p] for i, p in zip(idx, perm)))
    sizes = [size for _, size in axes]
    inside = {name.strip().strip("'") for name in m.group(4).split(",") if name.strip()}
    grouped = [k for k, (name, _) in enumerate(axes) if name in inside]
    groups: dict = {}
    for flat, device in enumerate(ids):
        coord, rem = [], flat
        for size in reversed(sizes):
            coord.append(rem % size)
            rem //= size
        coord.reverse()
        outer = tuple(c for k, c in enumerate(coord) if k not in grouped)
        groups.setdefault(outer, []).append(device)
    return list(groups.values())


def _parse_groups_attr(attrs: str, key: str) -> list[list[int]] | tuple[int, int] | None:
    """Parse ``key={{0,1},{2,3}}`` (explicit) or ``key=[G,S]<=[...]...`` (iota).

    Returns a list of groups, ``(num_groups, group_size)`` for the iota form, or None
    when the attribute is absent.
    """
    m = re.search(r"\b" + re.escape(key) + r"\s*=\s*", attrs)
    if m is None:
        return None
    j = m.end()
    if attrs.startswith("mesh[", j):
        return _mesh_groups(attrs[j:], key)
    if j < len(attrs) and attrs[j] == "[":
        iota = re.match(r"\[\s*([\d,\s]+)\]\s*<=", attrs[j:])
        if iota is None:
            raise AccountingError(f"cannot parse {key} at {attrs[j:j + 80]!r}")
        dims = [int(x) for x in iota.group(1).split(",") if x.strip()]
        if len(dims) == 1:
            return (1, dims[0])
        return (math.prod(dims[:-1]), dims[-1])
    if j < len(attrs) and attrs[j] == "{":
        end = _balanced(attrs, j, "{", "}")
        body = attrs[j + 1 : end - 1]
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([^{}]*)\}", body)]
    raise AccountingError(f"cannot parse {key} at {attrs[j:j + 80]!r}")


def _group_size(kind: str, attrs: str, num_partitions: int, num_replicas: int) -> int:
    """Devices per group, following XLA's CollectiveOpGroupMode rules."""
    if kind == COLLECTIVE_PERMUTE:
        pairs = _parse_groups_attr(attrs, "source_target_pairs")
        if not pairs or isinstance(pairs, tuple):
            return 0
        return len({d for p in pairs for d in p})
    groups = _parse_groups_attr(attrs, "replica_groups")
    has_channel = re.search(r"\bchannel_id\s*=", attrs) is not None
    global_ids = re.search(r"\buse_global_device_ids\s*=\s*true", attrs) is not None
    if kind == ALL_TO_ALL:
        # all-to-all has no use_global_device_ids: cross-partition with a channel id,
        # cross-replica without one.
        total = num_partitions if has_channel else num_replicas
        factor = 1
    elif not has_channel:  # cross-replica
        total, factor = num_replicas, 1
    elif global_ids:  # flattened ids
        total, factor = num_replicas * num_partitions, 1
    else:  # cross-replica-and-partition: groups of replica ids, times all partitions
        total, factor = num_replicas * num_partitions, num_partitions
    if isinstance(groups, tuple):
        return groups[1] * factor
    if not groups:  # absent or {}: one group of every participant
        return total
    return len(groups[0]) * factor


def _operand_leaves(kind: str, opcode: str, shape: _Shape, n: int) -> tuple[list[_Leaf], float]:
    """Leaves describing the operands, and a divisor/multiplier applied to their bytes."""
    if opcode.endswith("-start") and opcode != "all-reduce-start":
        # all-gather-start: (operand(s), result(s)); collective-permute-start:
        # (operand, result, context...); sugared async ops (X-start for async-start
        # wrapping X): ((operands...), result, context...).
        if isinstance(shape, tuple) and shape:
            return _leaves(shape[0]), 1.0
    # Synchronous form (and all-reduce-start, whose result equals its operands):
    # derive operands from the result shape.
    leaves = _leaves(shape)
    if kind == ALL_GATHER:
        return leaves, 1.0 / max(n, 1)
    if kind == REDUCE_SCATTER:
        return leaves, float(max(n, 1))
    return leaves, 1.0


@dataclasses.dataclass
class _Comp:
    name: str
    is_entry: bool
    instrs: list[tuple[str, str, str, str]]  # (name, shape text + rest, opcode, attrs)
    calls: list[tuple[str, str]]  # (edge kind, callee)


def _split_computations(text: str) -> tuple[dict[str, _Comp], str | None]:
    comps: dict[str, _Comp] = {}
    entry: str | None = None
    cur: _Comp | None = None
    pending: str | None = None  # an instruction whose text continues on later lines

    def flush() -> None:
        nonlocal pending
        if pending is not None and cur is not None:
            _add_instr(cur, pending)
        pending = None

    for raw in text.splitlines():
        line = _COMMENT_RE.sub("", raw).rstrip()
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        if line.startswith("HloModule"):
            continue
        if cur is None and line.endswith("{"):
            header = line.strip()
            m = _COMP_HEADER_RE.match(header)
            if m:
                cur = _Comp(m.group("name"), header.startswith("ENTRY"), [], [])
                comps[cur.name] = cur
                if cur.is_entry:
                    entry = cur.name
            continue
        if line.strip() == "}":
            flush()
            cur = None
            continue
        if cur is None:
            continue
        if _INSTR_RE.match(line):
            flush()
            pending = line.strip()
        elif pending is not None:
            pending += " " + line.strip()
    flush()
    return comps, entry


def _add_instr(comp: _Comp, line: str) -> None:
    m = _INSTR_RE.match(line)
    if m is None:
        return
    rest = m.group("rest")
    try:
        _, end = _parse_shape(rest)
    except AccountingError:
        return
    om = _OPCODE_RE.match(rest, end)
    if om is None:
        return
    opcode = om.group("opcode")
    args_end = _balanced(rest, om.end() - 1, "(", ")")
    attrs = _STRING_RE.sub('""', rest[args_end:])
    comp.instrs.append((m.group("name"), rest[:end], opcode, attrs))
    for cm in _CALL_ATTR_RE.finditer(attrs):
        key, val = cm.group("key"), cm.group("val")
        if key in ("body", "condition") and opcode != "while":
            continue
        names = re.findall(r"%?([\w.\-]+)", val.strip("{}"))
        edge = "loop" if opcode == "while" else ("cond" if opcode == "conditional" else "call")
        comp.calls.extend((edge, nm) for nm in names)


def _header_int(text: str, key: str, default: int) -> int:
    first = next((ln for ln in text.splitlines() if ln.startswith("HloModule")), "")
    m = re.search(r"\b" + key + r"\s*=\s*(\d+)", first)
    return int(m.group(1)) if m else default




def _reachable(comps: dict, entry: str | None) -> dict[str, tuple[bool, bool]]:
    """Computations reachable from ENTRY, with whether a while/conditional lies on the way."""
    flags: dict[str, tuple[bool, bool]] = {}
    roots = [entry] if entry is not None else list(comps)
    stack = [(r, False, False) for r in roots]
    while stack:
        name, loop, cond = stack.pop()
        old = flags.get(name)
        if old is not None and (old[0] or not loop) and (old[1] or not cond):
            continue
        loop = loop or (old[0] if old else False)
        cond = cond or (old[1] if old else False)
        flags[name] = (loop, cond)
        comp = comps.get(name)
        if comp is None:
            continue
        for edge, callee in comp.calls:
            stack.append((callee, loop or edge == "loop", cond or edge == "cond"))
    return flags


def scan(hlo_text: str) -> tuple[list[RawCollective], int]:
    """Every collective of the module reachable from ENTRY, in HLO text order, and the
    number of devices (``num_partitions * replica_count`` from the ``HloModule`` header)."""
    num_partitions = _header_int(hlo_text, "num_partitions", 1)
    num_replicas = _header_int(hlo_text, "replica_count", _header_int(hlo_text, "num_replicas", 1))
    comps, entry = _split_computations(hlo_text)
    flags = _reachable(comps, entry)
    out: list[RawCollective] = []
    for comp in (c for c in comps.values() if c.name in flags):  # HLO text order
        in_loop, in_cond = flags[comp.name]
        for name, shape_text, opcode, attrs in comp.instrs:
            kind = _SYNC_OPCODES.get(opcode) or _START_OPCODES.get(opcode)
            if kind is None:
                continue
            shape, _ = _parse_shape(shape_text)
            n = _group_size(kind, attrs, num_partitions, num_replicas)
            leaves, scale = _operand_leaves(kind, opcode, shape, n)
            nbytes = sum(leaf.nbytes for leaf in leaves) * scale
            out.append(RawCollective(kind, tuple(leaf.dtype for leaf in leaves),
                                     int(math.ceil(nbytes - 1e-9)), n, name, in_loop, in_cond,
                                     comp.name, opcode))
    return out, num_partitions * num_replicas
