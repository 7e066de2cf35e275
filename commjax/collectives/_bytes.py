"""Analytic per-device ring bytes of each compressed collective, attached to each op as its
[`commjax.communication_plan`][]."""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from commjax.accounting import CommunicationPlan, Transfer, ring_bytes, with_plan
from commjax.compressors.base import Compressor, Segment
from commjax.collectives._common import (
    _flag_bytes, _is_exact, _items, gathered_bytes, scatter_width, shard_width,
)
from commjax.collectives._reducers import choose_reducer
from commjax.collectives.gather import all_gather
from commjax.collectives.permute import permute_bytes, ppermute
from commjax.collectives.reduce import all_reduce
from commjax.collectives.scatter import reduce_scatter
from commjax.collectives.tensor_parallel import tp_copy, tp_reduce, tp_reducer


# ---------------------------------------------------------------------- wire bytes


def wire_bytes(op: str, x: Any, num_replicas: int, codec: Optional[Compressor] = None, *,
               reducer: Any = "auto", inner_size: int = 1,
               inner_codec: Optional[Compressor] = None) -> float:
    """Analytic per-device ring bytes of one collective on ``x`` (arrays or
    ``jax.ShapeDtypeStruct``, as the collective receives them), for ``num_replicas`` on
    ``axis_name`` (and ``inner_size`` on the inner axis): what the compiled HLO sends
    ([`commjax.collective_bytes`][])."""
    leaves = jax.tree_util.tree_leaves(x)
    if op == "all_gather":
        total = _gather_bytes(leaves, codec, num_replicas)
        if inner_size > 1:
            grown = [jax.ShapeDtypeStruct((num_replicas * l.shape[0],) + tuple(l.shape[1:]), l.dtype)
                     for l in leaves]
            total += _gather_bytes(grown, inner_codec, inner_size)
        return total
    if op == "reduce_scatter":
        total = 0.0
        if inner_size > 1:
            total += _scatter_bytes(leaves, inner_codec, inner_size)
            leaves = [jax.ShapeDtypeStruct((l.shape[0] // inner_size,) + tuple(l.shape[1:]), l.dtype)
                      for l in leaves]
        return total + _scatter_bytes(leaves, codec, num_replicas)
    if op == "all_reduce":
        total = 0.0
        if inner_size > 1:
            total += sum(ring_bytes("all-reduce", _nbytes(_summed(l)), inner_size) for l in leaves)
        return total + _reduce_bytes(leaves, codec, num_replicas, reducer)
    raise ValueError(f"wire_bytes: `op` must be 'all_gather', 'reduce_scatter' or 'all_reduce'; got {op!r}.")


def _nbytes(leaf) -> int:
    return math.prod(jnp.shape(leaf)) * jnp.dtype(jnp.result_type(leaf)).itemsize


def _summed(leaf) -> Any:
    """``leaf`` as a sum sends it: booleans are counted in int32 (``lax.psum``)."""
    if jnp.dtype(jnp.result_type(leaf)) != jnp.bool_:
        return leaf
    return jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.int32)


def _sent_bytes(leaf, n: int, width) -> int:
    """Bytes of an exact sharded collective's operand (``n`` chunks): a 1-D one's chunks
    travel padded to ``width`` (``shard_width`` or ``scatter_width``)."""
    if jnp.ndim(leaf) != 1:
        return _nbytes(leaf)
    return n * width(jnp.shape(leaf)[0] // n) * jnp.dtype(jnp.result_type(leaf)).itemsize


def _gather_bytes(leaves, codec, n) -> float:
    items = [] if _is_exact(codec) else _items(leaves, codec, 1)
    done = {it.index for it in items}
    exact = sum(ring_bytes("all-gather", _sent_bytes(l, 1, shard_width), n) for i, l in enumerate(leaves) if i not in done)
    if not items:
        return exact
    return exact + gathered_bytes(4 * sum(it.words for it in items), n)


def _scatter_bytes(leaves, codec, n) -> float:
    items = [] if _is_exact(codec) else _items(leaves, codec, n)
    done = {it.index for it in items}
    exact = sum(ring_bytes("reduce-scatter", _sent_bytes(_summed(l), n, scatter_width), n)
                for i, l in enumerate(leaves) if i not in done)
    if not items:
        return exact
    words = shard_width(sum(it.words for it in items))
    return exact + ring_bytes("all-to-all", 4 * n * words, n) + _flag_bytes(codec, n)



def _reduce_bytes(leaves, codec, n, reducer) -> float:
    if _is_exact(codec):
        return sum(ring_bytes("all-reduce", _nbytes(_summed(l)), n) for l in leaves)
    items = _items(leaves, codec, 1)
    done = {it.index for it in items}
    exact = sum(ring_bytes("all-reduce", _nbytes(_summed(l)), n) for i, l in enumerate(leaves) if i not in done)
    segments, off = [], 0
    for it in items:
        segments.append(Segment(off, it.size, it.padded, it.shape))
        off += it.padded
    red = choose_reducer(codec, reducer, max(off, 1), n, segments)
    return exact + (0.0 if red is None or not off else red.bytes(codec, off, n, segments))


def _op_planner(op: str):
    """The [`commjax.communication_plan`][] of one op: its one transfer (the forward
    collective; a VJP runs only where the op is differentiated), against the exact fp32
    all-reduce of the same floats."""
    def planner(x: Any, num_replicas: int, codec: Optional[Compressor] = None, *,
                reducer: Any = "auto", inner_replicas: int = 1,
                inner_codec: Optional[Compressor] = None) -> CommunicationPlan:
        kw = {"reducer": reducer} if op == "all_reduce" else {}
        sent = wire_bytes(op, x, num_replicas, codec, inner_size=inner_replicas,
                          inner_codec=inner_codec, **kw)
        n = sum(math.prod(jnp.shape(l)) for l in jax.tree_util.tree_leaves(x)
                if jnp.issubdtype(jnp.result_type(l), jnp.inexact))
        name = op if codec is None else f"{op}({codec.name})"
        return CommunicationPlan(name, num_replicas, (Transfer("payload", op.replace("_", "-"), sent),),
                                 ring_bytes("all-reduce", 4 * n, num_replicas))
    return planner


def _floats(x: Any) -> int:
    return sum(math.prod(jnp.shape(l)) for l in jax.tree_util.tree_leaves(x)
               if jnp.issubdtype(jnp.result_type(l), jnp.inexact))


def _ppermute_plan(x: Any, num_replicas: int, codec: Optional[Compressor] = None, *,
                   delta: Optional[str] = None, carry_ids: bool = True) -> CommunicationPlan:
    """[`ppermute`][commjax.collectives.ppermute]: one send per device (its steady state in
    ``"sample"`` delta mode)."""
    sent = permute_bytes(x, num_replicas, codec, delta=delta, carry_ids=carry_ids)
    return CommunicationPlan("ppermute", num_replicas, (Transfer("payload", "collective-permute", sent),),
                             ring_bytes("all-reduce", 4 * _floats(x), num_replicas))


def _tp_plan(name: str, direction: str):
    """Megatron's ``f`` (``tp_copy``: the all-reduce in the backward pass) or ``g``
    (``tp_reduce``: in the forward pass); ``codec`` is that all-reduce's (``tp_copy``'s
    ``grad_codec``)."""
    def planner(x: Any, num_replicas: int, codec: Optional[Compressor] = None) -> CommunicationPlan:
        sent = wire_bytes("all_reduce", x, num_replicas, codec, reducer=tp_reducer(codec))
        return CommunicationPlan(name, num_replicas, (Transfer(direction, "all-reduce", sent),),
                                 ring_bytes("all-reduce", 4 * _floats(x), num_replicas))
    return planner


with_plan(all_gather, _op_planner("all_gather"))
with_plan(reduce_scatter, _op_planner("reduce_scatter"))
with_plan(all_reduce, _op_planner("all_reduce"))
with_plan(ppermute, _ppermute_plan)
with_plan(tp_copy, _tp_plan("tp_copy", "cotangent (backward)"))
with_plan(tp_reduce, _tp_plan("tp_reduce", "partial sums (forward)"))
