"""Wire-byte accounting: what a step sends, planned and compiled.

Two views of the same quantity, checked against each other by the tests:

* the **plan** ([`CommunicationPlan`][commjax.accounting.CommunicationPlan], from
  [`commjax.communication_plan`][]): what a
  transform or a collective sends, computed from shapes without compiling, as a list of
  [`Transfer`][commjax.accounting.Transfer] records;
* the **compiled program** ([`CollectiveReport`][commjax.accounting.CollectiveReport], from
  [`collective_bytes`][commjax.accounting.collective_bytes]):
  every collective of the *optimized* HLO that XLA compiles.

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

Static counting
---------------
Collectives are counted **statically**: each collective instruction of the module
is counted once, as if its enclosing computation ran once. A collective inside a
``while`` body (``lax.fori_loop``, ``lax.scan``) is flagged ``in_loop=True`` and is
*not* multiplied by the trip count; one inside a ``conditional`` branch is flagged
``in_conditional=True`` and is counted even though only one branch runs. A plan's
[`CommunicationPlan.compiled_bytes`][commjax.accounting.CommunicationPlan.compiled_bytes] follows
the same convention (every transfer
once), so that the two are comparable.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

from commjax._hlo import (
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COLLECTIVE_KINDS, COLLECTIVE_PERMUTE, REDUCE_SCATTER,
    AccountingError, dtype_bits, scan,
)

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
    "CommunicationPlan",
    "Transfer",
    "ring_bytes",
    "collective_bytes",
    "hlo_collective_dtypes",
    "parse_hlo_collectives",
    "dtype_bits",
    "with_plan",
    "planner_of",
]


# --------------------------------------------------------------------------------------
# Analytic ring costs
# --------------------------------------------------------------------------------------


def ring_bytes(kind: str, operand_bytes: float, group_size: int) -> float:
    """Per-device bytes a bandwidth-optimal ring sends for one collective.

    Args:
      kind: one of ``COLLECTIVE_KINDS`` (``"all-reduce"``, ``"all-gather"``,
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


# --------------------------------------------------------------------------------------
# Report types
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled HLO module.

    Attributes:
      kind: one of ``COLLECTIVE_KINDS`` (async ``-start`` forms are reported under
        their synchronous kind).
      dtypes: element types of the operands, in operand order (one per operand of a
        variadic/combined op), e.g. ``("u8",)`` or ``("f32", "f32")``.
      operand_bytes: ``S``, total bytes of the per-device operands.
      group_size: ``N``, devices per replica group (for collective-permute: the
        number of distinct devices in ``source_target_pairs``).
      ring_bytes: [`ring_bytes`][commjax.accounting.ring_bytes] of (kind, operand_bytes,
        group_size).
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
    """All collectives of one compiled program (see
    [`collective_bytes`][commjax.accounting.collective_bytes]).

    Byte totals are per device and static: each collective is counted once (see the
    module docstring about loops and conditionals).
    """

    collectives: tuple[Collective, ...]
    num_devices: int = 1
    hlo_text: str = dataclasses.field(default="", repr=False, compare=False)

    @property
    def total_ring_bytes(self) -> float:
        """Sum of ``Collective.ring_bytes``: per-device bytes on the wire."""
        return float(sum(c.ring_bytes for c in self.collectives))

    @property
    def total_operand_bytes(self) -> int:
        """Sum of ``Collective.operand_bytes``."""
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
# Planned bytes
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One exchange of a step: a collective, or collectives that always run together.

    Attributes:
      what: what travels (``"exact bucket"``, ``"gradient shards"``, ``"fragment 2"``...).
      collective: how (``"all-reduce"``, ``"two_phase"``, ``"all-gather"``...).
      bytes: per device, each time it runs (ring convention, as
        [`ring_bytes`][commjax.accounting.ring_bytes]).
      every: in the steady state it runs once every ``every`` steps (``1``: every step;
        DiLoCo's sync: ``sync_every``); ``0``: outside the steady state (the first step
        only, warm-up, or only on a step where a payload overflows its code).
      offset: the steps it runs at, ``t % every == offset`` (0-based steps; DiLoCo's sync:
        ``sync_every - 1``): transfers with the same period and offset run on the same step.
    """

    what: str
    collective: str
    bytes: float
    every: int = 1
    offset: int = 0


@dataclasses.dataclass(frozen=True)
class CommunicationPlan:
    """What one step of a transform (or one collective) sends, per device, without
    compiling: made by [`commjax.communication_plan`][].

    Attributes:
      transform: its name (``"compressed_mean(int4)"``, ``"zero"``, ``"all_gather"``...).
      num_replicas: ``N``, the replicas of the (outer) axis.
      transfers: every exchange the compiled step holds, each a
        [`Transfer`][commjax.accounting.Transfer].
      baseline_bytes: what the exact fp32 mean of the same floating-point values sends
        (one all-reduce over ``N``): the reference of ``compression_ratio``.
      routing: for transforms built on ``compressed_mean`` (and DGC), where each leaf goes
        (a [`commjax.plan.MeanPlan`][]); ``None`` otherwise.
    """

    transform: str
    num_replicas: int
    transfers: tuple[Transfer, ...]
    baseline_bytes: float
    routing: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def bytes_per_step(self) -> float:
        """Average bytes per step in the steady state: each transfer's bytes divided by
        its period (transfers outside the steady state left out)."""
        return float(sum(t.bytes / t.every for t in self.transfers if t.every))

    @property
    def peak_bytes(self) -> float:
        """The most one steady-state step sends: the per-step transfers and the periodic ones
        that fall on the same step (DiLoCo's sync, one Streaming DiLoCo fragment)."""
        steady = [t for t in self.transfers if t.every]
        period = math.lcm(*(t.every for t in steady)) if steady else 1
        return float(max((sum(t.bytes for t in steady if s % t.every == t.offset % t.every)
                          for s in range(period)), default=0.0))

    @property
    def compiled_bytes(self) -> float:
        """Every transfer counted once: what
        [`collective_bytes`][commjax.accounting.collective_bytes] reads from the
        compiled step (``total_ring_bytes``), conditional branches included."""
        return float(sum(t.bytes for t in self.transfers))

    @property
    def compression_ratio(self) -> float:
        """``baseline_bytes`` over ``bytes_per_step``."""
        b = self.bytes_per_step
        return float("inf") if b == 0 else self.baseline_bytes / b

    def bytes_of(self, what: str) -> float:
        """Bytes of the transfers whose ``what`` starts with ``what`` (each counted once)."""
        return float(sum(t.bytes for t in self.transfers if t.what.startswith(what)))

    def summary(self) -> str:
        """One line: bytes per step, the exact baseline and the ratio."""
        peak = "" if self.peak_bytes == self.bytes_per_step else f", peak {self.peak_bytes:,.0f} B"
        return (f"{self.transform} on {self.num_replicas} replicas: "
                f"{self.bytes_per_step:,.0f} B/step/device{peak} vs {self.baseline_bytes:,.0f} B "
                f"exact ({self.compression_ratio:.2f}x)")

    def table(self) -> str:
        """The transfers, one per line, for printing."""
        rows = [f"{t.what:<28} {t.collective:<22} {t.bytes:>14,.1f} B  "
                f"{'every step' if t.every == 1 else f'every {t.every} steps (+{t.offset})' if t.every else 'occasional'}"
                for t in self.transfers]
        return "\n".join(rows + [self.summary()])

    def __str__(self) -> str:
        return self.table()


#: The attribute that holds a planner on a transform's ``update`` or an op function.
_PLANNER = "_commjax_planner"


def with_plan(obj: Any, planner: Callable[..., CommunicationPlan]) -> Any:
    """Attach ``planner(params, num_replicas, **options) -> CommunicationPlan`` to ``obj``
    and return ``obj``: a transform (``optax.GradientTransformation``: held by its
    ``update`` function) or a collective op function. [`commjax.communication_plan`][]
    finds it there."""
    target = obj.update if _is_transform(obj) else obj
    setattr(target, _PLANNER, planner)
    return obj


def planner_of(obj: Any) -> Optional[Callable[..., CommunicationPlan]]:
    """The planner [`with_plan`][commjax.accounting.with_plan] attached to ``obj``, or ``None``."""
    return getattr(obj.update if _is_transform(obj) else obj, _PLANNER, None)


def _is_transform(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "init") and hasattr(obj, "update")


# --------------------------------------------------------------------------------------
# Compiled bytes
# --------------------------------------------------------------------------------------


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
    raw, num_devices = scan(hlo_text)
    out = tuple(Collective(kind=r.kind, dtypes=r.dtypes, operand_bytes=r.operand_bytes,
                           group_size=r.group_size,
                           ring_bytes=ring_bytes(r.kind, r.operand_bytes, r.group_size),
                           hlo_name=r.hlo_name, in_loop=r.in_loop, in_conditional=r.in_conditional,
                           computation=r.computation, opcode=r.opcode) for r in raw)
    return CollectiveReport(collectives=out, num_devices=num_devices, hlo_text=hlo_text)


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
    HLO (``compiled.as_text()``) is parsed by
    [`parse_hlo_collectives`][commjax.accounting.parse_hlo_collectives].

    Returns:
      A [`CollectiveReport`][commjax.accounting.CollectiveReport]; ``report.total_ring_bytes`` is
      the per-device ring
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
