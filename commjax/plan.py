"""What a step will send: [`communication_plan`][commjax.plan.communication_plan], and the leaf
routing of a compressed mean.

[`communication_plan`][commjax.plan.communication_plan] is the one way to ask for bytes without
compiling: give it a
codec (the plan of [`commjax.compressed_mean`][] with that codec), a commjax transform
(``cj.zero(...)``, ``cj.diloco(...)``, ...) or a collective op (``cj.fsdp_gather``,
``cj.collectives.all_gather``, ...), and it returns a
[`CommunicationPlan`][commjax.accounting.CommunicationPlan] whose ``compiled_bytes`` the compiled
step carries (``tests/test_contract.py`` checks every transform).

The routing of one compressed mean ([`MeanPlan`][commjax.plan.MeanPlan]) depends only on the leaves'
shapes
and dtypes, the compressor, the options and the number of replicas, so it is computed at
trace time:

* integer and boolean leaves pass through untouched;
* floating scalars, leaves with fewer than ``min_compress_size`` elements, and leaves
  with one dimension (biases, norms) unless ``compress_vectors=True``, are averaged exactly,
  all together, in one fp32 all-reduce (the *exact bucket*);
* the other floating leaves are flattened, each padded to the compressor's alignment (so
  no block mixes two leaves), and laid out back to back as one flat *compressed bucket*
  (``segments``) that is reduced in one go: one payload, one set of collectives (block
  codecs and PowerSGD never write the joined float vector, only its payload);
* one fp32 flag per compressed leaf rides along in the exact bucket's all-reduce, so a
  NaN/Inf on any replica is seen by all of them at no extra collective; unless what every
  replica receives already tells (``finite_flags`` False): a block codec's scale words,
  PowerSGD's factors, a lossless codec's mean (sent directly, ``sent_directly``). A
  non-finite input makes its block's scale, its factors or its pre-scaled sum non-finite,
  and the test of the inputs would cost one more read of every compressed leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from commjax.accounting import CommunicationPlan, Transfer, planner_of, ring_bytes
from commjax.collectives._common import gathered_bytes
from commjax.collectives._reducers import choose_reducer
from commjax.compressors.base import Compressor, Segment
from commjax.exchanges import exchange_for
from commjax.validation import check_positive_int

__all__ = ["MeanPlan", "make_plan", "mean_plan", "communication_plan", "route_leaf", "exact_mean_transfers",
           "repeated", "float_baseline"]

PASS, EXACT, COMPRESS = "pass", "exact", "compress"


@dataclasses.dataclass(frozen=True)
class MeanPlan:
    """Where every leaf of one compressed mean goes, and what it sends (per device, ring
    convention): the ``routing`` of its
    [`CommunicationPlan`][commjax.accounting.CommunicationPlan]."""

    routes: tuple[str, ...]  # per leaf: "pass" | "exact" | "compress"
    shapes: tuple[tuple[int, ...], ...]
    segments: tuple[Segment, ...]  # compressed leaves, in order
    compressed_size: int  # elements of the compressed bucket (leaf-aligned, before N padding)
    exact_size: int  # elements of the exact bucket (flags included)
    num_replicas: int
    reducer: str
    server_residual_size: int
    compressor_name: str
    compressed_bytes: float
    exact_bytes: float
    #: The ``commjax.collectives._reducers.Reducer`` behind ``reducer`` (None: an exchange or
    #: one replica).
    reducer_impl: Any = dataclasses.field(default=None, compare=False, repr=False)
    #: One NaN flag per compressed leaf rides in the exact all-reduce (see the module).
    finite_flags: bool = False

    @property
    def num_compressed(self) -> int:
        return len(self.segments)

    @property
    def bytes_per_step(self) -> float:
        """Per-device bytes one step sends (ring convention), all collectives together."""
        return self.compressed_bytes + self.exact_bytes

    @property
    def num_float_elements(self) -> int:
        return sum(int(np.prod(s)) for s, r in zip(self.shapes, self.routes) if r != PASS)

    @property
    def baseline_bytes(self) -> float:
        """What the exact fp32 mean of the same floats sends: one fp32 all-reduce."""
        return ring_bytes("all-reduce", 4 * self.num_float_elements, self.num_replicas)


def exact_elements(dtype: Any, size: int) -> tuple[int, bool]:
    """``(elements, wide)`` of a leaf in the exact bucket: a complex leaf travels as its real
    and imaginary parts (twice the elements); ``wide`` for float64 precision."""
    d = jnp.dtype(dtype)
    cplx = jnp.issubdtype(d, jnp.complexfloating)
    return (2 * size if cplx else size), d.itemsize // (2 if cplx else 1) == 8


def route_leaf(
    shape: Sequence[int],
    dtype: Any,
    *,
    min_compress_size: int,
    compress_vectors: bool,
    compressor: Optional[Compressor] = None,
) -> str:
    if jnp.issubdtype(dtype, jnp.complexfloating) or jnp.dtype(dtype).itemsize > 4:
        # Complex leaves travel as their real and imaginary parts, float64 ones in float64:
        # exactly, never through a codec built for fp32.
        return EXACT if jnp.issubdtype(dtype, jnp.inexact) else PASS
    if not jnp.issubdtype(dtype, jnp.floating):
        return PASS
    if not len(shape):  # a scalar's per-replica residual would have no axis to lay replicas along
        return EXACT
    size = int(np.prod(shape))
    if size < min_compress_size or (len(shape) < 2 and not compress_vectors):
        return EXACT
    if compressor is not None and not compressor.accepts(tuple(shape)):
        return EXACT
    return COMPRESS


def _compressed_route(compressor: Compressor, reducer: str, n: int, num_replicas: int,
                      segments: list) -> tuple:
    """(reducer object, reducer name, bytes per step, server residual size) of the
    compressed buffer of ``n`` elements."""
    exchange = exchange_for(compressor)
    if exchange is not None:
        red = "custom" if num_replicas > 1 else "none"
        comp_bytes = exchange.bytes(compressor, segments, num_replicas) if n and num_replicas > 1 else 0.0
        return None, red, comp_bytes, 0
    obj = choose_reducer(compressor, reducer, max(n, compressor.alignment), num_replicas, segments)
    red = "none" if obj is None else obj.name
    comp_bytes = obj.bytes(compressor, n, num_replicas, segments) if n and obj else 0.0
    server = obj.server_residual_size(compressor, n, num_replicas) if obj else 0
    return obj, red, comp_bytes, server


def sent_directly(compressor: Compressor, reducer: str) -> bool:
    """Whether a lossless codec's leaves travel as further operands of the exact all-reduce,
    whose pre-scaled sum (``commjax.collectives._exact.prescale``) cannot overflow: a mean
    sent so is non-finite exactly when a replica's leaf is."""
    return compressor.lossless and reducer in ("allreduce", "none")


def _mean_reports_finite(compressor: Compressor, obj: Any, num_replicas: int) -> bool:
    """Whether the compressed stage flags a non-finite input on every replica by itself:
    a lossless codec's leaves sent directly (``sent_directly``), or a codec that encodes
    each leaf on its own (``leaf_local``) through an exchange or through a reducer whose
    received words tell (``Reducer.reports_finite``). Not one replica (nothing
    received)."""
    if num_replicas <= 1:
        return False
    if sent_directly(compressor, "none" if obj is None else obj.name):
        return True
    if not compressor.leaf_local:
        return False
    if exchange_for(compressor) is not None:
        return True
    return obj is not None and obj.reports_finite(compressor)


def make_plan(
    leaves: Sequence[Any],
    compressor: Compressor,
    *,
    num_replicas: int,
    reducer: str = "auto",
    min_compress_size: int = 1024,
    compress_vectors: bool = False,
    check_finite: bool = True,
) -> MeanPlan:
    """Plan the exchange of ``leaves`` (arrays or ``jax.ShapeDtypeStruct``)."""
    check_positive_int("num_replicas", num_replicas, factory="communication_plan")
    routes, shapes, segments = [], [], []
    offset = exact = 0
    wide = False
    align = compressor.alignment
    for leaf in leaves:
        shape = tuple(int(d) for d in jnp.shape(leaf))
        r = route_leaf(shape, jnp.result_type(leaf), min_compress_size=min_compress_size,
                       compress_vectors=compress_vectors, compressor=compressor)
        routes.append(r)
        shapes.append(shape)
        size = int(np.prod(shape)) if shape else 1
        if r == COMPRESS:
            padded = -(-size // align) * align
            segments.append(Segment(offset, size, padded, shape))
            offset += padded
        elif r == EXACT:
            elements, is_wide = exact_elements(jnp.result_type(leaf), size)
            exact += elements
            wide = wide or is_wide
    n = offset
    obj, red, comp_bytes, server = _compressed_route(compressor, reducer, n, num_replicas, segments)
    flags = bool(check_finite and segments) and not _mean_reports_finite(compressor, obj, num_replicas)
    if flags:
        exact += len(segments)
    if compressor.shared_randomness and segments and num_replicas > 1:
        exact += 4  # replica 0's key, shared through the exact all-reduce
    # One bucket: fp32, or float64 throughout when a float64 leaf is in it.
    exact_bytes = ring_bytes("all-reduce", (8 if wide else 4) * exact, num_replicas) if exact else 0.0
    return MeanPlan(
        routes=tuple(routes),
        shapes=tuple(shapes),
        segments=tuple(segments),
        compressed_size=n,
        exact_size=exact,
        num_replicas=num_replicas,
        reducer=red,
        server_residual_size=server,
        compressor_name=compressor.name,
        compressed_bytes=float(comp_bytes),
        exact_bytes=float(exact_bytes),
        reducer_impl=obj,
        finite_flags=flags,
    )


def _fallback_bytes(compressor: Compressor, obj: Any, n: int, num_replicas: int) -> float:
    """What a codec with a fallback ([`commjax.lossless`][]) sends on a step where a
    payload overflowed: the fallback's payloads of the same values, through the same
    reducer (a conditional branch of the compiled step)."""
    fb = compressor.fallback
    if fb is None or obj is None or not n or num_replicas <= 1:
        return 0.0
    m = obj.padded_length(compressor, n, num_replicas)
    if obj.name == "allgather":
        return gathered_bytes(fb.payload_bytes(m), num_replicas)
    if obj.name == "two_phase":
        server = getattr(obj, "server_codec", None) or compressor
        return (ring_bytes("all-to-all", fb.payload_bytes(m), num_replicas)
                + gathered_bytes(server.fallback.payload_bytes(m // num_replicas), num_replicas))
    return 0.0


def mean_transfers(mp: MeanPlan, compressor: Compressor, every: int = 1) -> list[Transfer]:
    """The transfers of one compressed mean: the exact bucket's all-reduce, the compressed
    bucket's collectives, and a fallback's payloads (on overflow only)."""
    out = []
    if mp.exact_bytes:
        out.append(Transfer("exact bucket", "all-reduce", mp.exact_bytes, every))
    if mp.compressed_bytes:
        out.append(Transfer(f"compressed bucket ({mp.compressor_name})", mp.reducer,
                            mp.compressed_bytes, every))
    fallback = _fallback_bytes(compressor, mp.reducer_impl, mp.compressed_size, mp.num_replicas)
    if fallback:
        out.append(Transfer(f"fallback ({compressor.fallback.name})", mp.reducer, fallback, 0))
    return out


def inner_mean_transfer(leaves: Sequence[Any], inner_replicas: int) -> list[Transfer]:
    """The exact fp32 mean over a fast inner axis of every floating leaf (hierarchical
    meshes), or nothing on one inner replica."""
    if inner_replicas <= 1:
        return []
    n = sum(int(np.prod(jnp.shape(l))) for l in leaves if jnp.issubdtype(jnp.result_type(l), jnp.inexact))
    return [Transfer("inner-axis mean", "all-reduce", ring_bytes("all-reduce", 4 * n, inner_replicas))]


def exact_mean_transfers(what: str, leaves: Sequence[Any], num_replicas: int,
                         every: int = 1) -> list[Transfer]:
    """The exact mean of every element of ``leaves`` in one all-reduce (fp32; float64 when
    a leaf is), as ``commjax.collectives._exact.exact_mean`` sends it."""
    n = sum(int(np.prod(jnp.shape(l))) for l in leaves)
    wide = any(jnp.dtype(jnp.result_type(l)) == jnp.float64 for l in leaves)
    sent = ring_bytes("all-reduce", (8 if wide else 4) * n, num_replicas)
    return [Transfer(what, "all-reduce", sent, every)] if sent else []


def repeated(transfers: Sequence[Transfer], every: int, prefix: str = "", offset: int = 0) -> list[Transfer]:
    """``transfers`` run once every ``every`` steps, at the steps ``t % every == offset``,
    instead of every step (those outside the steady state stay outside), their ``what``
    prefixed."""
    return [Transfer(prefix + t.what, t.collective, t.bytes, every, offset) if t.every == 1 else
            Transfer(prefix + t.what, t.collective, t.bytes, t.every, t.offset) for t in transfers]


def float_baseline(params: Any, num_replicas: int) -> float:
    """The exact fp32 mean of every floating element of ``params``: one all-reduce."""
    n = sum(int(np.prod(jnp.shape(l))) for l in jax.tree_util.tree_leaves(params)
            if jnp.issubdtype(jnp.result_type(l), jnp.inexact))
    return ring_bytes("all-reduce", 4 * n, num_replicas)


def mean_plan(
    compressor: Compressor,
    params: Any,
    num_replicas: int,
    *,
    reducer: str = "auto",
    min_compress_size: int = 1024,
    compress_vectors: bool = False,
    check_finite: bool = True,
    inner_replicas: int = 1,
    name: Optional[str] = None,
) -> CommunicationPlan:
    """The [`CommunicationPlan`][commjax.accounting.CommunicationPlan] of
    [`commjax.compressed_mean`][] with ``compressor`` and these options, for gradients
    shaped like ``params`` (``inner_replicas``: the size of ``inner_axis_name``)."""
    leaves = jax.tree_util.tree_leaves(params)
    mp = make_plan(leaves, compressor, num_replicas=num_replicas, reducer=reducer,
                   min_compress_size=min_compress_size, compress_vectors=compress_vectors,
                   check_finite=check_finite)
    check_positive_int("inner_replicas", inner_replicas, factory="communication_plan")
    inner = inner_mean_transfer(leaves, inner_replicas)
    # The baseline on a two-level mesh: the exact mean over both axes, the inner one first.
    baseline = mp.baseline_bytes + sum(t.bytes for t in inner)
    return CommunicationPlan(name or f"compressed_mean({compressor.name})", num_replicas,
                             tuple(inner + mean_transfers(mp, compressor)), baseline, routing=mp)


def communication_plan(what: Any, params: Any, num_replicas: int, **options: Any) -> CommunicationPlan:
    """What one step of ``what`` sends per device, for inputs shaped like ``params``
    (arrays or ``jax.ShapeDtypeStruct``) over ``num_replicas``, without compiling.

    ``what`` is one of

    * a codec (``cj.quantize(bits=4)``): the plan of [`commjax.compressed_mean`][] with
      it; ``options`` are compressed_mean's (``reducer``, ``min_compress_size``,
      ``compress_vectors``, ``check_finite``) and ``inner_replicas``;
    * a commjax transform as its factory returned it (``cj.compressed_mean(...)``,
      ``cj.zero(...)``, ``cj.dgc(...)``, ``cj.onebit_adam(...)``, ``cj.diloco(...)``,
      ``cj.streaming_diloco(...)``, ``cj.decoupled_momentum(...)``,
      ``cj.accumulate(...)``); ``options``: ``inner_replicas`` where the transform has an
      inner axis;
    * a collective op (``cj.fsdp_gather``, ``cj.collectives.all_gather``,
      ``reduce_scatter``, ``all_reduce``); ``options`` are the op's own (``codec``,
      ``grad_codec``, ...).

    The plan lists every [`Transfer`][commjax.accounting.Transfer] the compiled step holds::

        plan = cj.communication_plan(cj.quantize(bits=4), params, num_replicas=8)
        print(plan.summary())      # bytes per step against the exact fp32 mean
        plan.compiled_bytes == cj.collective_bytes(step, ...).total_ring_bytes

    Raises:
      TypeError: ``what`` has no plan (an ``optax.chain`` hides its parts: ask for the
        commjax transform inside it).
    """
    check_positive_int("num_replicas", num_replicas, factory="communication_plan")
    if isinstance(what, Compressor):
        return mean_plan(what, params, num_replicas, **options)
    planner = planner_of(what)
    if planner is None:
        raise TypeError(
            f"communication_plan: {what!r} has no plan. Pass a codec (cj.quantize(bits=4)), a "
            "commjax transform as its factory returned it (cj.zero(...), cj.diloco(...); not "
            "an optax.chain around it) or a collective op (cj.fsdp_gather, "
            "cj.collectives.all_gather, ...).")
    return planner(params, num_replicas, **options)
