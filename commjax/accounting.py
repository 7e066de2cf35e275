"""Wire-byte accounting: what a program really sends, read from its compiled HLO.

Every compressor reports an analytic byte count; this module measures the same
quantity from the *optimized* HLO that XLA compiles, so the two can be checked
against each other.

Conventions
-----------
All byte counts are **per device**. ``S`` is the size in bytes of the per-device
operand of a collective as it appears in the compiled HLO and ``N`` is the size of
the replica group the collective runs over. A bandwidth-optimal ring sends, per
device and per execution of the collective::

    all-reduce          2 * (N - 1) / N * S   (reduce-scatter + all-gather)
    all-gather          (N - 1) * S           (S = the per-device shard; output N*S)
    reduce-scatter      (N - 1) / N * S       (S = the full per-device input)
    all-to-all          (N - 1) / N * S       (S = all operands of the op on one device)
    collective-permute  S                     (each device sends its buffer once)

A group of one device sends nothing.

Public API
----------
- :func:`ring_bytes` and :func:`exact_mean_bytes`: the analytic formulas above.
- :func:`collective_bytes`: compile a function and list its collectives in a
  :class:`CollectiveReport` of :class:`Collective` records.
- :func:`hlo_collective_dtypes`: the element types that actually travel on the wire,
  to check that payloads go as unsigned integer words rather than widened floats.
- :func:`parse_hlo_collectives`: the parser itself, for HLO text from anywhere.

Static counting
---------------
Collectives are counted **statically**: each collective instruction of the module
is counted once, as if its enclosing computation ran once. A collective inside a
``while`` body (``lax.fori_loop``, ``lax.scan``) is flagged ``in_loop=True`` and is
*not* multiplied by the trip count; one inside a ``conditional`` branch is flagged
``in_conditional=True`` and is counted even though only one branch runs.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    "ALL_REDUCE",
    "ALL_GATHER",
    "REDUCE_SCATTER",
    "ALL_TO_ALL",
    "COLLECTIVE_PERMUTE",
    "COLLECTIVE_KINDS",
    "AccountingError",
    "Collective",
    "CollectiveReport",
    "ring_bytes",
    "exact_mean_bytes",
    "collective_bytes",
    "hlo_collective_dtypes",
    "parse_hlo_collectives",
    "dtype_bits",
]

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


# --------------------------------------------------------------------------------------
# Analytic ring costs
# --------------------------------------------------------------------------------------


def ring_bytes(kind: str, operand_bytes: float, group_size: int) -> float:
    """Per-device bytes a bandwidth-optimal ring sends for one collective.

    Args:
      kind: one of :data:`COLLECTIVE_KINDS` (``"all-reduce"``, ``"all-gather"``,
        ``"reduce-scatter"``, ``"all-to-all"``, ``"collective-permute"``).
      operand_bytes: ``S``, the per-device input buffer of the collective as it
        appears in the compiled HLO (for all-gather: the shard each device
        contributes; for reduce-scatter: the full input; for all-to-all: the sum of
        all operands of the op on one device).
      group_size: ``N``, the number of devices in the replica group.

    Returns:
      ``2(N-1)/N*S`` for all-reduce, ``(N-1)*S`` for all-gather, ``(N-1)/N*S`` for
      reduce-scatter and all-to-all, ``S`` for collective-permute; ``0.0`` when
      ``N <= 1``.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(
            f"ring_bytes: unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}"
        )
    if operand_bytes < 0:
        raise ValueError(f"ring_bytes: operand_bytes must be >= 0, got {operand_bytes}")
    if group_size < 0:
        raise ValueError(f"ring_bytes: group_size must be >= 0, got {group_size}")
    n = int(group_size)
    s = float(operand_bytes)
    if n <= 1:
        return 0.0
    if kind == ALL_REDUCE:
        return 2.0 * (n - 1) / n * s
    if kind == ALL_GATHER:
        return float(n - 1) * s
    if kind in (REDUCE_SCATTER, ALL_TO_ALL):
        return (n - 1) / n * s
    return s  # COLLECTIVE_PERMUTE


def exact_mean_bytes(num_elements: int, group_size: int, itemsize: int = 4) -> float:
    """Per-device ring bytes of the exact mean: an all-reduce of ``num_elements``
    values of ``itemsize`` bytes (fp32 by default), i.e.
    ``2 * (N - 1) / N * num_elements * itemsize``.

    This is the baseline that compression ratios are measured against.
    """
    if num_elements < 0:
        raise ValueError(f"exact_mean_bytes: num_elements must be >= 0, got {num_elements}")
    return ring_bytes(ALL_REDUCE, num_elements * itemsize, group_size)


# --------------------------------------------------------------------------------------
# Report types
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled HLO module.

    Attributes:
      kind: one of :data:`COLLECTIVE_KINDS` (async ``-start`` forms are reported under
        their synchronous kind).
      dtypes: element types of the operands, in operand order (one per operand of a
        variadic/combined op), e.g. ``("u8",)`` or ``("f32", "f32")``.
      operand_bytes: ``S``, total bytes of the per-device operands.
      group_size: ``N``, devices per replica group (for collective-permute: the
        number of distinct devices in ``source_target_pairs``).
      ring_bytes: :func:`ring_bytes` of (kind, operand_bytes, group_size).
      hlo_name: the instruction's name in the HLO.
      in_loop: the instruction sits (directly or through calls) in a ``while`` body or
        condition. Counted once per execution of the enclosing computation, *not*
        multiplied by the trip count.
      in_conditional: the instruction sits in a branch of a ``conditional``.
      computation: the name of the HLO computation holding the instruction.
      opcode: the opcode as written in the HLO (e.g. ``all-reduce-start``).
    """

    kind: str
    dtypes: tuple[str, ...]
    operand_bytes: int
    group_size: int
    ring_bytes: float
    hlo_name: str
    in_loop: bool = False
    in_conditional: bool = False
    computation: str = ""
    opcode: str = ""


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
    """All collectives of one compiled program (see :func:`collective_bytes`).

    Byte totals are per device and static: each collective is counted once (see the
    module docstring about loops and conditionals).
    """

    collectives: tuple[Collective, ...]
    num_devices: int = 1
    hlo_text: str = dataclasses.field(default="", repr=False, compare=False)

    @property
    def total_ring_bytes(self) -> float:
        """Sum of :attr:`Collective.ring_bytes`: per-device bytes on the wire."""
        return float(sum(c.ring_bytes for c in self.collectives))

    @property
    def total_operand_bytes(self) -> int:
        """Sum of :attr:`Collective.operand_bytes`."""
        return int(sum(c.operand_bytes for c in self.collectives))

    @property
    def dtypes(self) -> frozenset[str]:
        """Every element type that some collective carries."""
        return frozenset(d for c in self.collectives for d in c.dtypes)

    def __len__(self) -> int:
        return len(self.collectives)

    def __iter__(self):
        return iter(self.collectives)

    def of_kind(self, kind: str) -> tuple[Collective, ...]:
        """The collectives of one kind, in HLO order."""
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
        return tuple(c for c in self.collectives if c.kind == kind)

    def by_kind(self) -> dict[str, float]:
        """Total ring bytes per collective kind (only kinds that occur)."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.ring_bytes
        return out

    def table(self) -> str:
        """A plain-text table of the collectives and the totals, for printing."""
        header = ("kind", "dtypes", "operand B", "N", "ring B", "where", "name")
        rows = [
            (
                c.kind,
                _dtype_summary(c.dtypes),
                f"{c.operand_bytes:,}",
                str(c.group_size),
                f"{c.ring_bytes:,.1f}",
                "loop" if c.in_loop else ("cond" if c.in_conditional else ""),
                c.hlo_name,
            )
            for c in self.collectives
        ]
        rows.append(
            (
                "TOTAL",
                "",
                f"{self.total_operand_bytes:,}",
                "",
                f"{self.total_ring_bytes:,.1f}",
                "",
                f"{len(self.collectives)} collective(s)",
            )
        )
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        right = {2, 3, 4}

        def fmt(r: tuple[str, ...]) -> str:
            return "  ".join(
                (v.rjust(w) if i in right else v.ljust(w)) for i, (v, w) in enumerate(zip(r, widths))
            ).rstrip()

        sep = "  ".join("-" * w for w in widths)
        return "\n".join([fmt(header), sep, *(fmt(r) for r in rows[:-1]), sep, fmt(rows[-1])])

    def __str__(self) -> str:
        return self.table()


def _dtype_summary(dtypes: tuple[str, ...]) -> str:
    """``("u32",) * 8 + ("f32",)`` -> ``"u32x8,f32"``."""
    parts: list[str] = []
    i = 0
    while i < len(dtypes):
        j = i
        while j < len(dtypes) and dtypes[j] == dtypes[i]:
            j += 1
        parts.append(dtypes[i] if j - i == 1 else f"{dtypes[i]}x{j - i}")
        i = j
    return ",".join(parts)


# --------------------------------------------------------------------------------------
# HLO text parsing
# --------------------------------------------------------------------------------------

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


def _parse_groups_attr(attrs: str, key: str) -> list[list[int]] | tuple[int, int] | None:
    """Parse ``key={{0,1},{2,3}}`` (explicit) or ``key=[G,S]<=[...]...`` (iota).

    Returns a list of groups, ``(num_groups, group_size)`` for the iota form, or None
    when the attribute is absent.
    """
    m = re.search(r"\b" + re.escape(key) + r"\s*=\s*", attrs)
    if m is None:
        return None
    j = m.end()
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


def parse_hlo_collectives(hlo_text: str) -> CollectiveReport:
    """Parse every collective of an HLO module given as text (``compiled.as_text()``).

    Understands the synchronous ops (``all-reduce``, ``all-gather``,
    ``reduce-scatter``, ``all-to-all``, ``collective-permute``), their async
    ``-start`` forms (counted once, from the start op; ``-done`` ops are ignored),
    ``async-start`` ops through their wrapped computation, tuple-shaped
    variadic/combined ops (operands summed), and collectives inside called
    computations (while bodies, conditional branches, fusions, async wrappers).
    Replica groups may be explicit (``{{0,1},{2,3}}``), iota (``[2,4]<=[8]``,
    ``[2,4]<=[4,2]T(1,0)``) or empty (every device: ``num_partitions *
    replica_count`` from the ``HloModule`` header, per XLA's group-mode rules).
    """
    if not isinstance(hlo_text, str):
        raise TypeError(f"parse_hlo_collectives expects HLO text (str), got {type(hlo_text).__name__}")
    num_partitions = _header_int(hlo_text, "num_partitions", 1)
    num_replicas = _header_int(hlo_text, "replica_count", _header_int(hlo_text, "num_replicas", 1))
    comps, entry = _split_computations(hlo_text)

    # Reachability from ENTRY, tracking whether a while/conditional lies on the way.
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

    out: list[Collective] = []
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
            operand_bytes = int(math.ceil(nbytes - 1e-9))
            out.append(
                Collective(
                    kind=kind,
                    dtypes=tuple(leaf.dtype for leaf in leaves),
                    operand_bytes=operand_bytes,
                    group_size=n,
                    ring_bytes=ring_bytes(kind, operand_bytes, n),
                    hlo_name=name,
                    in_loop=in_loop,
                    in_conditional=in_cond,
                    computation=comp.name,
                    opcode=opcode,
                )
            )
    return CollectiveReport(
        collectives=tuple(out),
        num_devices=num_partitions * num_replicas,
        hlo_text=hlo_text,
    )


# --------------------------------------------------------------------------------------
# Compiling functions
# --------------------------------------------------------------------------------------


def _fn_name(fn: Any) -> str:
    for attr in ("__qualname__", "__name__"):
        name = getattr(fn, attr, None)
        if isinstance(name, str):
            return name
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is not None and wrapped is not fn:
        return _fn_name(wrapped)
    return repr(fn)


def _compiled_text(fn: Callable[..., Any], args: Iterable[Any], kwargs: Mapping[str, Any]) -> str:
    import jax

    name = _fn_name(fn)
    stages = getattr(jax, "stages", None)
    compiled_t = getattr(stages, "Compiled", ())
    lowered_t = getattr(stages, "Lowered", ())
    try:
        if compiled_t and isinstance(fn, compiled_t):
            compiled = fn
        elif lowered_t and isinstance(fn, lowered_t):
            compiled = fn.compile()
        else:
            target = fn if hasattr(fn, "lower") else jax.jit(fn)
            compiled = target.lower(*args, **kwargs).compile()
    except Exception as e:  # noqa: BLE001 - re-raised with the function named
        raise AccountingError(
            f"collective_bytes: could not lower and compile {name!r} with the given "
            f"arguments: {type(e).__name__}: {e}"
        ) from e
    text = compiled.as_text()
    if isinstance(text, (list, tuple)):  # some backends return one text per module
        text = "\n".join(t for t in text if t)
    if not text:
        raise AccountingError(f"collective_bytes: the compiled {name!r} has no HLO text")
    return text


def collective_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CollectiveReport:
    """Compile ``fn(*args, **kwargs)`` and account for every collective it runs.

    ``fn`` is used as is when it already has ``.lower`` (a ``jax.jit`` / ``jax.pmap``
    result), otherwise it is wrapped in ``jax.jit``; a ``jax.stages.Lowered`` or
    ``Compiled`` object is also accepted (then ``args`` are ignored). The optimized
    HLO (``compiled.as_text()``) is parsed by :func:`parse_hlo_collectives`.

    Returns:
      A :class:`CollectiveReport`; ``report.total_ring_bytes`` is the per-device ring
      cost (static count: collectives in loops are counted once).

    Raises:
      AccountingError: ``fn`` fails to lower or compile (the message names ``fn``).
    """
    return parse_hlo_collectives(_compiled_text(fn, args, kwargs))


def hlo_collective_dtypes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> frozenset[str]:
    """The HLO element types (``"u8"``, ``"u32"``, ``"f32"``, ...) that the collectives of
    the compiled ``fn(*args, **kwargs)`` carry, e.g. to assert that a payload travels
    as unsigned integer words rather than as widened floats."""
    return collective_bytes(fn, *args, **kwargs).dtypes
