"""Fully sharded data parallel (ZeRO-3 / FSDP) with compressed weight and gradient traffic.

Every replica of ``N`` stores ``1/N`` of each parameter: the leaf is flattened, padded with
zeros to ``N * s`` elements (``s`` a multiple of the codec's block ``A``) and cut into
``N`` shards of ``s``. On TPU a compressed leaf whose shards are whole groups of 8 rows of
its ``(8, 128)`` tiles (``commjax.bucket.tile_sharded``) travels in the tiles' order:
the gathered leaf is then a bitcast of the received vector (and the cotangent one of the
leaf), where the row-major vector is a relayout of the whole leaf each way (v5e, int8
weights and gradients of a 21M MLP: 2.7x exact FSDP's memory traffic instead of 7.0x,
``python benchmarks/aot.py --fsdp``); the shards stay row-major.

Model code gathers a layer's weights when it needs them::

    full = cj.fsdp_gather(shard, "data", cj.quantize(bits=8, stochastic=False),
                          grad_codec=cj.quantize(bits=4), key=key, like=shapes)

Forward, a compressed all-gather (ZeRO++'s qwZ): every replica decodes every shard, its
own included, so the gathered weights are bit-identical everywhere. Backward (the VJP), a
compressed reduce-scatter of the weights' cotangent (qgZ) divided by ``N``: ``jax.grad``
of a loss that gathers its weights returns, on replica ``r``, shard ``r`` of
``(1/N) sum_q dL_q/dw``, the mean gradient of the replicas' losses, ready for any optax
optimizer run on the shards.

Bytes per device and gather of ``n`` elements (``s = n_pad / N``, ``P(s)`` a codec's
payload bytes for ``s`` elements)::

    forward all-gather     (N - 1) P_w(s)           exact fp32: (N - 1) 4 s
    backward reduce-scatter (N - 1) P_g(s)           exact fp32: (N - 1) 4 s

(``cj.communication_plan(cj.fsdp_gather, like, N, codec=..., grad_codec=..., align=...)``
gives both for a parameter tree.)

Under ``jax.checkpoint`` JAX emits the gather again for the backward pass (ZeRO-3's way
of not keeping every layer's full weights alive between the passes), with the same key, so
the recomputed weights are the forward ones and the gradient is the same. Whether the
compiled program really gathers twice is XLA's choice: XLA on CPU (JAX 0.10) merges the
two identical gathers, so the step sends the weights once and keeps them alive.
Stochastic codecs need a ``key`` that is the same on every replica. Inside ``lax.scan``
over stacked layers, the stacked shards ``[L, s]`` are scanned like any other array (fold
the layer index into the key).

Helpers lay out a parameter tree: [`fsdp_shard`][commjax.fsdp.fsdp_shard] (full -> padded flat
global shards),
[`fsdp_unshard`][commjax.fsdp.fsdp_unshard] (back), [`fsdp_like`][commjax.fsdp.fsdp_like] (the
shapes to gather into),
[`fsdp_specs`][commjax.fsdp.fsdp_specs] (``PartitionSpec`` s);
[`shard_size`][commjax.fsdp.shard_size] is the padding rule, shared
with [`commjax.zero`][].
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from commjax import _compat, bucket, collectives as cc
from commjax.accounting import CommunicationPlan, Transfer, ring_bytes, with_plan
from commjax.collectives._bytes import wire_bytes
from commjax.collectives._common import check_codec, flat_columns, join_rows, scatter_width, shard_width
from commjax.guards import check_bound
from commjax.compressors.base import Compressor

__all__ = ["fsdp_gather", "fsdp_shard", "fsdp_unshard", "fsdp_like", "fsdp_specs", "shard_size"]


def shard_size(size: int, num_shards: int, align: int = 1) -> int:
    """Elements per shard of a leaf of ``size`` elements cut into ``num_shards``:
    ``ceil(size / (num_shards * align)) * align`` (at least ``align``), so every shard is a
    whole number of codec blocks and no block spans two shards."""
    if num_shards < 1 or align < 1:
        raise ValueError(f"shard_size: `num_shards` ({num_shards}) and `align` ({align}) must be >= 1.")
    return max(1, -(-int(size) // (num_shards * align))) * align


def _batch_shape(leaf: Any, batch_dims: int) -> tuple:
    shape = tuple(np.shape(leaf))
    if len(shape) < batch_dims:
        raise ValueError(f"fsdp: a leaf of shape {shape} has fewer than batch_dims={batch_dims} "
                         "leading axes.")
    return shape[:batch_dims]


def fsdp_shard(params: Any, num_shards: int, *, align: int = 1, batch_dims: int = 0,
               min_compress_size: int = 1024) -> Any:
    """Each leaf ``[*b, *shape]`` as the flat, zero-padded ``[*b, num_shards * s]`` array
    whose ``num_shards`` consecutive pieces of ``s`` ([`shard_size`][commjax.fsdp.shard_size]) are
    the shards.

    Works on host (NumPy) or device arrays, outside ``shard_map``; place the result with
    [`fsdp_specs`][commjax.fsdp.fsdp_specs] (shard ``r`` on replica ``r``). ``batch_dims`` leading
    axes (stacked
    layers for ``lax.scan``) are kept. ``align``: the block of the codec that will carry the
    shards (``codec.alignment``), so that shards are whole blocks; leaves of fewer than
    ``min_compress_size`` elements (which [`fsdp_gather`][commjax.fsdp.fsdp_gather] sends exactly)
    are padded to
    a multiple of ``num_shards`` only.
    """
    def one(leaf):
        b = _batch_shape(leaf, batch_dims)
        flat = jnp.reshape(jnp.asarray(leaf), b + (-1,))
        m = flat.shape[-1]
        s = shard_size(m, num_shards, align if m >= min_compress_size else 1)
        return jnp.pad(flat, [(0, 0)] * batch_dims + [(0, num_shards * s - m)])

    return jax.tree_util.tree_map(one, params)


def fsdp_like(params: Any, *, batch_dims: int = 0) -> Any:
    """``jax.ShapeDtypeStruct`` of each leaf without its ``batch_dims`` leading axes: the
    ``like=`` of [`fsdp_gather`][commjax.fsdp.fsdp_gather] (one layer's shapes when the layers are
    stacked)."""
    return jax.tree_util.tree_map(
        lambda l: jax.ShapeDtypeStruct(tuple(np.shape(l))[batch_dims:], jnp.result_type(l)), params)


def fsdp_unshard(shards: Any, like: Any, *, batch_dims: int = 0) -> Any:
    """The inverse of [`fsdp_shard`][commjax.fsdp.fsdp_shard]: ``[*b, N * s] -> [*b, *like.shape]``
    (padding dropped)."""
    def one(flat, l):
        b = tuple(np.shape(flat))[:batch_dims]
        m = math.prod(l.shape)
        return jnp.reshape(jnp.asarray(flat)[..., :m], b + tuple(l.shape)).astype(l.dtype)

    return jax.tree_util.tree_map(one, shards, like)


def fsdp_specs(shards: Any, axis_name: Any, *, batch_dims: int = 0) -> Any:
    """``PartitionSpec`` of each [`fsdp_shard`][commjax.fsdp.fsdp_shard] leaf: ``P(None,...,
    axis_name)``."""
    return jax.tree_util.tree_map(lambda _: P(*([None] * batch_dims), axis_name), shards)


# --------------------------------------------------------------------- the gather


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_grad(x: jax.Array, c: float) -> jax.Array:
    """Identity forward; the cotangent is multiplied by ``c`` (the ``1/N`` of a mean)."""
    return x


def _scale_fwd(x, c):
    return x, None


def _scale_bwd(c, _, ct):
    return ((ct * jnp.asarray(c, ct.dtype)).astype(ct.dtype),)


_scale_grad.defvjp(_scale_fwd, _scale_bwd)


#: A 1-D vector whose chunk (per replica) has at least this many elements travels in a
#: collective of its own: joining it with others copies it, on a TPU into a zero-filled
#: buffer and again into the tile rows of the collective (v5e, exact ZeRO of a 21M MLP,
#: one-off compiles: 1.53 GB of HBM traffic joined, 1.10 GB apart).
JOIN_MAX = 1 << 16


def _buckets(vecs: list, chunk: Any) -> dict:
    """Positions of the 1-D floating vectors of fewer than ``JOIN_MAX`` elements a replica
    (``chunk(v)``) by dtype (one exact collective per dtype); others alone."""
    groups: dict = {}
    for i, v in enumerate(vecs):
        dt = jnp.result_type(v)
        join = jnp.ndim(v) == 1 and jnp.issubdtype(dt, jnp.inexact) and chunk(v) < JOIN_MAX
        groups.setdefault((dt.name,) if join else ("alone", i), []).append(i)
    return groups


def exact_bytes(op: str, vecs: list, num_replicas: int, inner_replicas: int = 1) -> float:
    """Per-device ring bytes of ``gather_exact`` (``op="all_gather"``, ``vecs`` the shards)
    or ``scatter_exact`` (``"reduce_scatter"``, ``vecs`` the ``[N s]`` vectors) on vectors
    shaped like ``vecs``, ``num_replicas`` on the axis and ``inner_replicas`` on the inner one."""
    num = num_replicas * inner_replicas
    gather = op == "all_gather"
    chunk = (lambda v: v.shape[0]) if gather else (lambda v: v.shape[0] // num)
    total = 0.0
    for k, idx in _buckets(vecs, chunk).items():
        if k[0] == "alone":
            joined = [vecs[i] for i in idx]
        else:
            width = (shard_width if gather else scatter_width)(sum(chunk(vecs[i]) for i in idx))
            joined = [jax.ShapeDtypeStruct(((1 if gather else num) * width,), jnp.result_type(vecs[idx[0]]))]
        total += wire_bytes(op, joined, num_replicas, None, inner_size=inner_replicas)
    return total


def gather_exact(vecs: list, axis_name: Any, *, inner_axis_name: Any = None,
                 invariant: bool = False) -> list:
    """Exact all-gather of shards (exact reduce-scatter VJP) with the 1-D ones of each dtype
    joined into one collective: ``[s_l] -> [N s_l]`` each, ``(N - 1) * itemsize * W``
    bytes per device for the joined bucket, ``W = shard_width(sum s_l)`` (padded to whole
    TPU tiles; the rows are read in place, not cut back)."""
    out = list(vecs)
    for k, idx in _buckets(vecs, lambda v: v.shape[0]).items():
        if k[0] == "alone":
            got = cc.all_gather([vecs[i] for i in idx], axis_name, None,
                                inner_axis_name=inner_axis_name, invariant=invariant)
            for i, g in zip(idx, got):
                out[i] = g
            continue
        sizes = [vecs[i].shape[0] for i in idx]
        joined = join_rows([vecs[i] for i in idx])
        full = cc.all_gather(joined, axis_name, None, inner_axis_name=inner_axis_name, invariant=invariant)
        rows = full.reshape(-1, joined.shape[0])  # [N, W]: replica j's bucket in row j
        off = 0
        for i, s in zip(idx, sizes):
            out[i] = flat_columns(rows, off, off + s)
            off += s
    return out


def scatter_exact(vecs: list, axis_name: Any, *, inner_axis_name: Any = None,
                  mean: bool = False) -> list:
    """Exact reduce-scatter of ``[N s_l]`` vectors (chunk ``j`` to replica ``j``), those of
    each dtype joined into one collective: ``[N s_l] -> [s_l]`` each,
    ``(N - 1) * itemsize * W`` bytes per device for the joined bucket,
    ``W = scatter_width(sum s_l)``."""
    num = _compat.axis_size(axis_name)
    if inner_axis_name is not None:
        num *= _compat.axis_size(inner_axis_name)
    out = list(vecs)
    for k, idx in _buckets(vecs, lambda v: v.shape[0] // num).items():
        if k[0] == "alone":
            got = cc.reduce_scatter([vecs[i] for i in idx], axis_name, None,
                                    inner_axis_name=inner_axis_name, mean=mean)
            for i, g in zip(idx, got):
                out[i] = g
            continue
        sizes = [vecs[i].shape[0] // num for i in idx]
        rows = join_rows([vecs[i].reshape(num, s) for i, s in zip(idx, sizes)], scatter_width)
        mine = cc.reduce_scatter(rows.reshape(-1), axis_name, None,
                                 inner_axis_name=inner_axis_name, mean=mean)
        off = 0
        for i, s in zip(idx, sizes):
            out[i] = mine[off:off + s]
            off += s
    return out


def _route(leaves: list, sizes: list, codec: Optional[Compressor], min_compress_size: int) -> list[bool]:
    """Which leaves go through ``codec``: floating, of at least ``min_compress_size``
    elements (``sizes``: the full leaves'), with shards of whole blocks (else the exact
    gather: a few small leaves)."""
    if codec is None:
        return [False] * len(leaves)
    return [bool(jnp.issubdtype(jnp.result_type(l), jnp.floating)) and m >= min_compress_size
            and math.prod(np.shape(l)) % codec.alignment == 0 for l, m in zip(leaves, sizes)]


def fsdp_gather(
    shard: Any,
    axis_name: Any,
    codec: Optional[Compressor] = None,
    *,
    grad_codec: Optional[Compressor] = None,
    key: Optional[jax.Array] = None,
    like: Any = None,
    grad_mean: bool = True,
    inner_axis_name: Any = None,
    inner_codec: Optional[Compressor] = None,
    inner_grad_codec: Optional[Compressor] = None,
    min_compress_size: int = 1024,
) -> Any:
    """Gather the full parameters from this replica's shards, each shard sent encoded.

    Forward: ``full = concat_r C(shard_r)`` ([`commjax.collectives.all_gather`][]), then,
    with ``like``, padding dropped and each leaf reshaped to ``like``'s shape and dtype.
    VJP: the cotangent of ``full`` goes through ``reduce_scatter`` with ``grad_codec``
    (replica ``r`` receives chunk ``r`` of ``sum_q C_g(ct_q)``), divided by the number of
    replicas when ``grad_mean`` (module docstring for the bytes).

    Args:
      shard: pytree of this replica's shards, each 1-D ``[s]`` (from
        [`fsdp_shard`][commjax.fsdp.fsdp_shard],
        placed with [`fsdp_specs`][commjax.fsdp.fsdp_specs]) or any rank >= 1 (gathered along axis
        0).
      axis_name: the mesh axis the parameters are sharded over (bound by ``shard_map``).
      codec: the weights' codec (qwZ: ``cj.quantize(bits=8, stochastic=False)``); ``None``:
        exact.
      grad_codec: the gradients' codec (qgZ: ``cj.quantize(bits=4)``); ``None``: exact.
      key: PRNG key, the same on every replica, for stochastic codecs (fold in the step and
        the layer).
      like: pytree (matching ``shard``) of arrays or ``jax.ShapeDtypeStruct`` with the full
        shapes ([`fsdp_like`][commjax.fsdp.fsdp_like]); ``None``: return the padded flat gather
        ``[N * s]``.
      grad_mean: divide the reduced gradient by the number of replicas (default: the
        gradient of the mean of the replicas' losses).
      inner_axis_name, inner_codec, inner_grad_codec: a second, fast mesh axis (two-level:
        [`commjax.collectives`][]); the shard then lives on ``(axis, inner axis)``.
      min_compress_size: leaves of fewer elements (``like``'s, else the gathered ones:
        biases, norms), and leaves whose shard is not a whole number of ``codec`` blocks,
        travel exactly (as [`fsdp_shard`][commjax.fsdp.fsdp_shard] lays them out with the same
        threshold).

    Returns:
      The full parameters (``like``'s shapes), identical on every replica.
    """
    where = "fsdp_gather"
    codec = check_codec(codec, where)
    grad_codec = check_codec(grad_codec, where, "grad_codec")
    num = check_bound(axis_name, where)
    if inner_axis_name is not None:
        num *= check_bound(inner_axis_name, where)
    leaves, treedef = jax.tree_util.tree_flatten(shard)
    like_leaves = None
    if like is not None:
        like_leaves = jax.tree_util.tree_leaves(like)
        if len(like_leaves) != len(leaves):
            raise ValueError(f"{where}: `like` has {len(like_leaves)} leaves but `shard` has "
                             f"{len(leaves)}; pass cj.fsdp_like(params) of the same tree.")
    if grad_mean and num > 1:
        leaves = [_scale_grad(l, 1.0 / num) if jnp.issubdtype(jnp.result_type(l), jnp.inexact) else l
                  for l in leaves]
    sizes = ([math.prod(np.shape(l)) * num for l in leaves] if like_leaves is None else
             [math.prod(np.shape(l)) for l in like_leaves])
    routes = _route(leaves, sizes, codec, min_compress_size)
    out = list(leaves)
    exact = [i for i, r in enumerate(routes) if not r]
    got = gather_exact([leaves[i] for i in exact], axis_name, inner_axis_name=inner_axis_name)
    for i, g in zip(exact, got):
        out[i] = g
    comp = [i for i, r in enumerate(routes) if r]
    tiles = _tile_sharded(leaves, like_leaves, num)
    if comp:
        parts = [bucket.ravel_shard(leaves[i], np.shape(like_leaves[i])) if tiles[i] else leaves[i]
                 for i in comp]
        if exact:
            # The exact gather first on every device: independent collectives may start in
            # different orders on different devices and deadlock per-collective runtimes.
            got, parts = lax.optimization_barrier((got, parts))
            for i, g in zip(exact, got):
                out[i] = g
        got = cc.all_gather(parts, axis_name, codec, grad_codec=grad_codec,
                            key=key, inner_axis_name=inner_axis_name, inner_codec=inner_codec,
                            inner_grad_codec=inner_grad_codec)
        for i, g in zip(comp, got):
            out[i] = g
    if like_leaves is not None:
        out = [bucket.unravel_leaf(g, np.shape(l)).astype(jnp.result_type(l)) if i in comp and tiles[i]
               else _unpad(g, l, where) for i, (g, l) in enumerate(zip(out, like_leaves))]
    return jax.tree_util.tree_unflatten(treedef, out)


def _tile_sharded(leaves: list, like_leaves: Optional[list], num: int) -> list[bool]:
    """Per leaf, whether its 1-D shards are whole groups of 8 tile rows of the leaf
    (``commjax.bucket.tile_sharded``): a compressed one is then sent in
    ``bucket.ravel_shard``'s order, so that on TPU the gathered leaf is a bitcast of the
    received vector and the VJP's cotangent one of the leaf, not a relayout of the
    whole leaf each way; the shard itself (the parameter) stays row-major."""
    if like_leaves is None:
        return [False] * len(leaves)
    return [np.ndim(s) == 1 and bucket.tile_sharded(np.shape(l), np.shape(s)[0], num)
            for s, l in zip(leaves, like_leaves)]


def _unpad(full: jax.Array, like: Any, where: str) -> jax.Array:
    m = math.prod(np.shape(like))
    if full.ndim != 1 or full.shape[0] < m:
        raise ValueError(f"{where}: a gathered leaf of shape {full.shape} cannot hold `like`'s "
                         f"{tuple(np.shape(like))}; shard with cj.fsdp_shard and pass 1-D shards.")
    return full[:m].reshape(np.shape(like)).astype(jnp.result_type(like))


def _plan(like: Any, num_replicas: int, *, codec: Optional[Compressor] = None,
          grad_codec: Optional[Compressor] = None, align: int = 1,
          min_compress_size: int = 1024) -> CommunicationPlan:
    """What one [`fsdp_gather`][commjax.fsdp.fsdp_gather] of parameters shaped like ``like`` sends
    per device (its
    [`commjax.communication_plan`][]), laid out by [`fsdp_shard`][commjax.fsdp.fsdp_shard] with
    ``align`` over
    ``num_replicas`` (one axis): the forward all-gather and, in a step that differentiates
    through it, its VJP's reduce-scatter (once per gather: XLA merges a rematerialised
    gather with the forward one on CPU)."""
    leaves = jax.tree_util.tree_leaves(like)
    sizes = [math.prod(np.shape(l)) for l in leaves]
    shards = [jax.ShapeDtypeStruct((shard_size(m, num_replicas, align if m >= min_compress_size else 1),),
                                   jnp.result_type(l)) for l, m in zip(leaves, sizes)]
    routes = _route(shards, sizes, codec, min_compress_size)
    fwd = bwd = 0.0
    for flag in (True, False):
        sel = [s for s, r in zip(shards, routes) if r == flag]
        full = [jax.ShapeDtypeStruct((num_replicas * s.shape[0],), s.dtype) for s in sel]
        if sel and flag:
            fwd += wire_bytes("all_gather", sel, num_replicas, codec)
            bwd += wire_bytes("reduce_scatter", full, num_replicas, grad_codec)
        elif sel:  # joined as gather_exact joins them
            fwd += exact_bytes("all_gather", sel, num_replicas)
            bwd += exact_bytes("reduce_scatter", full, num_replicas)
    n = sum(m for l, m in zip(leaves, sizes) if jnp.issubdtype(jnp.result_type(l), jnp.floating))
    return CommunicationPlan(
        "fsdp_gather", num_replicas,
        (Transfer("weights (forward)", "all-gather", fwd), Transfer("gradients (VJP)", "reduce-scatter", bwd)),
        ring_bytes("all-reduce", 4 * n, num_replicas))


with_plan(fsdp_gather, _plan)
