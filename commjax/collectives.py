"""Compressed collectives: ``all_gather``, ``reduce_scatter`` and ``all_reduce`` with a codec.

Pure functions for code running inside ``jax.shard_map`` (or ``jax.pmap``) over a mesh
axis: optax transforms, optimizers, and model code alike. Each takes a pytree of arrays
and a codec (any commjax compressor that encodes a vector into uint32 words;
``None`` or :func:`commjax.identity` is the exact collective of ``jax.lax``) and returns
the *decoded* result, which is identical on every replica of the axis::

    from commjax import collectives as cc
    full  = cc.all_gather(shard, "data", cj.quantize(bits=8, stochastic=False))
    chunk = cc.reduce_scatter(grad, "data", cj.quantize(bits=4), key=key, mean=True)
    total = cc.all_reduce(grad, "data", cj.sign())

Semantics, for replica ``r`` of ``N``, codec ``C`` (``C(x) = decode(encode(x))``):

==================  ====================================================  ===========================
collective          result on every replica                               bytes sent per device
==================  ====================================================  ===========================
``all_gather``      ``concat_r C(x_r)`` (tiled along axis 0)              ``(N-1) P``
``reduce_scatter``  chunk ``r`` of ``sum_s C(x_s)``, summed in replica    ``(N-1)/N * N P_c``
                    order in fp32 (each chunk encoded on its own)         (one all-to-all)
``all_reduce``      ``sum_s C(x_s)`` by the chosen reducer (below)        see :class:`Reducer`
==================  ====================================================  ===========================

``P`` is one replica's payload (``4 * payload_words``), ``P_c`` that of one chunk. Payloads
travel as unsigned 32-bit words (XLA on CPU widens 16- and 8-bit float collectives) and
quantized codes are never summed by a collective (``psum`` on small integers wraps
around): each replica decodes what it receives and sums in fp32 itself.

Layouts: leaves are flattened; each leaf (or, for ``reduce_scatter``, each leaf's chunk
of ``size / N`` elements) is padded with zeros to the codec's alignment (whole blocks), so
no block spans two leaves or two chunks. All leaves travel in one collective. Integer,
boolean and complex leaves take the exact collective of ``jax.lax``.

Randomness: ``key`` is a PRNG key that is the *same* on every replica; stochastic codecs
fold in the replica index themselves, so their rounding noise differs per replica.

Differentiation: the VJP of a compressed ``all_gather`` is a compressed ``reduce_scatter``
of the cotangent with ``grad_codec`` (``None``: exact), and vice versa; ``all_reduce``'s
VJP is an ``all_reduce``. Under ``shard_map(check_vma=True)`` a cotangent that is typed
replicated needs no communication (as JAX's own rules do): the VJP of ``all_gather`` is
then this replica's slice of it.

Hierarchical pairs (``inner_axis_name``): a fast axis (NVLink, ICI) inside a slow one
(DCN). ``reduce_scatter`` scatters over the inner axis first (``inner_codec``, exact by
default), then over the outer axis (``codec``); ``all_gather`` is its inverse (outer, then
inner). Device ``(o, i)`` holds global chunk ``i * O + o``. ``all_reduce`` takes the
exact mean over the inner axis, then the compressed one over the outer axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat, bucket as flat_bucket
from commjax.guards import check_bound
from commjax.accounting import ring_bytes
from commjax.compressors.base import BlockCompressor, Compressor, Segment
from commjax.compressors.sparse import TopK

__all__ = [
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "wire_bytes",
    "Reducer",
    "AllReduce",
    "AllGather",
    "TwoPhase",
    "REDUCERS",
    "get_reducer",
    "valid_reducers",
    "choose_reducer",
    "reduce_parts",
    "PartsResult",
    "exact_mean",
    "encode_rows",
    "decode_rows",
    "decode_sum",
]


# ----------------------------------------------------------------------------- helpers


def _names(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _round_up(n: int, a: int) -> int:
    return -(-int(n) // a) * a


def _is_exact(codec: Optional[Compressor]) -> bool:
    return codec is None or (codec.lossless and codec.linear)


def _compressible(leaf: Any) -> bool:
    """Real floating leaves go through a codec; others take the exact collective."""
    dtype = jnp.result_type(leaf)
    return jnp.issubdtype(dtype, jnp.floating)


def check_codec(codec: Any, where: str, argument: str = "codec") -> Optional[Compressor]:
    """``codec`` if it can travel through a collective, else a clear error."""
    if codec is None:
        return None
    if not isinstance(codec, Compressor):
        raise TypeError(
            f"{where}: `{argument}` must be a commjax codec such as cj.quantize(bits=8), or "
            f"None for the exact collective; got {codec!r}."
        )
    if codec.has_exchange or codec.shared_randomness:
        raise ValueError(
            f"{where}: {codec.name} runs its own exchange (state or a key shared by every "
            f"replica) and cannot be the codec of a single collective; use it through "
            f"cj.compressed_mean. Codecs for `{argument}`: cj.quantize, cj.sign, cj.cast, "
            "cj.qsgd, cj.terngrad, cj.top_k, cj.threshold, cj.identity."
        )
    return codec


def replica_key(codec: Optional[Compressor], key: Optional[jax.Array], axis_name: Any,
                where: str) -> Optional[jax.Array]:
    """The key a stochastic codec encodes with on this replica: ``key`` (the same on every
    replica) with the replica index folded in; ``None`` for deterministic codecs."""
    if codec is None or not codec.stochastic:
        return None
    if key is None:
        raise ValueError(
            f"{where}: {codec.name} rounds stochastically and needs `key=`: pass a PRNG key "
            "that is the same on every replica (the collective folds in the replica index), "
            "e.g. jax.random.fold_in(jax.random.key(0), step)."
        )
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return jax.random.fold_in(key, lax.axis_index(axis_name))


def _vary_out(x: Any, axis_name: Any) -> Any:
    return _compat.vary(x, axis_name)


# ------------------------------------------------------------- encoding rows of a payload


def encode_rows(codec: Compressor, rows: jax.Array, key: Optional[jax.Array], *,
                residual: Optional[jax.Array] = None, start: int = 0):
    """Encode each row of ``float32[R, c]`` on its own (``c`` a multiple of the codec's
    alignment): ``uint32[R, w]``, with ``w = codec.payload_words(c)``.

    With ``residual`` (``[R, c]``, error feedback) it encodes ``y = rows + residual`` and
    also returns the new residual ``y - C(y)`` (fp32): ``(words, new_residual)``.
    Block codecs encode the rows as one vector (noise drawn by position from ``start``);
    other codecs encode row ``j`` with ``fold_in(key, j)``.
    """
    n_rows, c = rows.shape
    if isinstance(codec, BlockCompressor):
        flat = rows.reshape(-1)
        if residual is None:
            return codec.encode(flat, key, start=start).reshape(n_rows, -1)
        words, new = codec.encode_feedback(flat, residual.reshape(-1), key, start=start)
        return words.reshape(n_rows, -1), new.reshape(n_rows, c)
    if residual is None:
        return jax.vmap(lambda v, k: codec.encode(v, k))(rows, _row_keys(key, n_rows))
    return _encode_rows_feedback(codec, rows + residual.astype(jnp.float32), key)


def _row_keys(key: Optional[jax.Array], n_rows: int) -> Optional[jax.Array]:
    return None if key is None else jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(n_rows))


def _encode_rows_feedback(codec: Compressor, y: jax.Array, key: Optional[jax.Array]):
    """A non-block codec's rows ``y = rows + residual``, already formed: ``(words, y - C(y))``."""
    words, local = jax.vmap(lambda v, k: codec.encode_and_decode(v, k))(y, _row_keys(key, y.shape[0]))
    return words, y - local


def decode_rows(codec: Compressor, words: jax.Array, c: int) -> jax.Array:
    """``uint32[R, w] -> float32[R, c]``: each row decoded on its own."""
    n_rows = words.shape[0]
    if isinstance(codec, BlockCompressor):
        return codec.decode(words.reshape(-1), n_rows * c).reshape(n_rows, c)
    return jax.vmap(lambda w: codec.decode(w, c))(words)


def decode_sum(codec: Compressor, words: jax.Array, c: int, divide: int = 1) -> jax.Array:
    """``sum_r decode(words[r], c) / divide`` over the leading axis, in replica order from
    fp32 zeros, each value divided before it is added (a representable mean never
    overflows): every replica that holds the same words computes the same bits (the
    codecs' fused unpack + dequantize + sum kernel where there is one)."""
    return codec.decode_sum(words, c, divide=divide)


# ------------------------------------------------------------------ tree <-> flat items


class _Item(NamedTuple):
    index: int  # position among the tree's leaves
    shape: tuple
    dtype: Any
    size: int  # elements (of the chunk, for reduce_scatter)
    padded: int  # size rounded up to the codec's alignment
    words: int  # payload words of `padded` elements


def _items(leaves: Sequence[Any], codec: Compressor, divisor: int) -> list[_Item]:
    out = []
    for i, leaf in enumerate(leaves):
        if not _compressible(leaf):
            continue
        shape = tuple(jnp.shape(leaf))
        size = math.prod(shape) // divisor
        padded = _round_up(max(size, 1), codec.alignment)
        out.append(_Item(i, shape, jnp.result_type(leaf), size, padded, codec.payload_words(padded)))
    return out


def _check_tiled(leaves: Sequence[Any], n: int, where: str) -> None:
    for leaf in leaves:
        shape = jnp.shape(leaf)
        if not shape or shape[0] % n:
            raise ValueError(
                f"{where}: every leaf's leading dimension must be a multiple of the number of "
                f"replicas ({n}); got a leaf of shape {tuple(shape)}. Pad or reshape it first "
                "(cj.zero and cj.fsdp_gather do this for you)."
            )


# ---------------------------------------------------------------------- all_gather


def _gather_impl(tree, axis_name, codec, key, invariant: bool):
    """``all_gather`` over one axis (tiled along axis 0, leaves of rank >= 1)."""
    n = _compat.axis_size(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    gather = (functools.partial(_compat.all_gather_invariant, axis_name=axis_name, tiled=True)
              if invariant else
              (lambda v: lax.all_gather(_vary_out(v, axis_name), axis_name, tiled=True)))
    if _is_exact(codec):
        return jax.tree_util.tree_unflatten(treedef, [gather(l) for l in leaves])
    items = _items(leaves, codec, 1)
    out = list(leaves)
    for i in {it.index for it in items} ^ set(range(len(leaves))):
        out[i] = gather(leaves[i])
    if items:
        rkey = replica_key(codec, key, axis_name, "all_gather")
        flats = [jnp.pad(jnp.ravel(leaves[it.index]).astype(jnp.float32), (0, it.padded - it.size))
                 for it in items]
        got = _gather_encoded(codec, flats, items, gather, rkey)
        vals = _fallback_cond(
            codec, lambda: codec.payload_overflow(got), lambda: _decode_items(codec, got, items),
            lambda: _decode_items(codec.fallback, _gather_encoded(codec.fallback, flats, items, gather, None),
                                  items))
        for it, v in zip(items, vals):
            out[it.index] = v.reshape((n * it.shape[0],) + it.shape[1:]).astype(it.dtype)
    return jax.tree_util.tree_unflatten(treedef, out)


def _gather_encoded(codec, flats, items, gather, rkey):
    """``[N, W]``: every replica's encoded leaves (replica ``r``'s words in row ``r``)."""
    words, start = [], 0
    for flat, it in zip(flats, items):
        words.append(encode_rows(codec, flat[None], rkey, start=start)[0])
        start += it.padded
    return gather(jnp.concatenate(words)[None])


def _decode_items(codec, got, items):
    """Each item's ``[N, size]`` values from the gathered ``[N, W]`` words of ``codec``."""
    vals, off = [], 0
    for it in items:
        words = codec.payload_words(it.padded)
        vals.append(decode_rows(codec, got[:, off:off + words], it.padded)[:, :it.size])
        off += words
    return vals


def _fallback_cond(codec, overflow, coded, raw):
    """``coded()``, or ``raw()`` (which sends :attr:`Compressor.fallback`'s payload) when
    ``overflow()`` is true: a replicated flag, so every replica takes the same branch and
    joins the same collectives. Codecs without a fallback: ``coded()`` alone."""
    if codec.fallback is None:
        return coded()
    return lax.cond(overflow(), raw, coded)


def _overflow_anywhere(codec, words, axis_name):
    """Replicated: some replica's ``words`` overflowed (one fp32 all-reduce of a flag; an
    all-to-all leaves each replica only its own chunks to read)."""
    return _compat.psum(codec.payload_overflow(words).astype(jnp.float32), axis_name) > 0


def _slice_own(tree, axis_name, inner_axis_name):
    """This replica's chunk of a replicated (full) tree: the VJP of a gather whose
    cotangent is typed replicated."""
    names = _names(axis_name)
    n_out = _compat.axis_size(axis_name)
    idx = lax.axis_index(axis_name)
    n_in = 1
    if inner_axis_name is not None:
        n_in = _compat.axis_size(inner_axis_name)
        idx = lax.axis_index(inner_axis_name) * n_out + idx
        names = names + _names(inner_axis_name)
    total = n_out * n_in

    def one(ct):
        rows = ct.shape[0] // total
        return lax.dynamic_slice_in_dim(_vary_out(ct, names), idx * rows, rows, axis=0)

    return jax.tree_util.tree_map(one, tree)


def _replicated_cotangent(tree, axis_name) -> bool:
    """Under check_vma=True, whether the cotangent is typed replicated over the axis."""
    tracked = _compat.varying_axes(lax.axis_index(axis_name))
    if not tracked:
        return False
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(
        not (set(_names(axis_name)) & set(_compat.varying_axes(l) or ())) for l in leaves)


def _gather_two_level(tree, cfg: "_GatherConfig", key):
    outer = _gather_impl(tree, cfg.axis_name, cfg.codec, key, cfg.invariant)
    if cfg.inner_axis_name is None:
        return outer
    inner_key = None if key is None else jax.random.fold_in(key, 2)
    return _gather_impl(outer, cfg.inner_axis_name, cfg.inner_codec, inner_key, cfg.invariant)


@dataclasses.dataclass(frozen=True)
class _GatherConfig:
    axis_name: Any
    codec: Optional[Compressor]
    grad_codec: Optional[Compressor]
    inner_axis_name: Any
    inner_codec: Optional[Compressor]
    inner_grad_codec: Optional[Compressor]
    invariant: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_vjp(cfg: _GatherConfig, tree, key):
    return _gather_two_level(tree, cfg, key)


def _gather_fwd(cfg, tree, key):
    return _gather_two_level(tree, cfg, key), key


def _gather_bwd(cfg, key, ct):
    if _replicated_cotangent(ct, cfg.axis_name):
        return _slice_own(ct, cfg.axis_name, cfg.inner_axis_name), None
    grad_key = None if key is None else jax.random.fold_in(key, 1)
    out, _ = _scatter_two_level(ct, _ScatterConfig(
        cfg.axis_name, cfg.grad_codec, None, cfg.inner_axis_name, cfg.inner_grad_codec, False,
    ), grad_key)
    return out, None


_gather_vjp.defvjp(_gather_fwd, _gather_bwd)


def all_gather(
    x: Any,
    axis_name: Any,
    codec: Optional[Compressor] = None,
    *,
    grad_codec: Optional[Compressor] = None,
    key: Optional[jax.Array] = None,
    inner_axis_name: Any = None,
    inner_codec: Optional[Compressor] = None,
    inner_grad_codec: Optional[Compressor] = None,
    invariant: bool = False,
) -> Any:
    """All-gather ``x`` (a pytree of shards) over ``axis_name``, each shard sent encoded.

    Every replica gets ``concat_r C(x_r)`` along axis 0 (shape ``[N * a, ...]`` for a shard
    ``[a, ...]``), the owner's own shard included as decoded, so all replicas hold the same
    bits. Bytes per device: ``(N - 1) * 4 * sum_leaves payload_words(leaf)`` in one
    all-gather of uint32 words (exact: ``(N - 1) * itemsize * size``).

    Args:
      x: pytree of arrays of rank >= 1 (this replica's shards).
      axis_name: the mesh axis (or tuple of axes) to gather over.
      codec: the codec of the forward gather; ``None``: exact (``lax.all_gather``).
      grad_codec: codec of the VJP's ``reduce_scatter`` of the cotangent; ``None``: exact.
      key: PRNG key, the same on every replica (stochastic codecs only).
      inner_axis_name, inner_codec, inner_grad_codec: a two-level gather (see the module
        docstring): over ``axis_name`` with ``codec``, then over ``inner_axis_name``.
      invariant: type the result as replicated under ``shard_map(check_vma=True)`` (its
        cotangent is then replicated too and the VJP is a slice, with no communication).

    Returns:
      The gathered pytree, leaves in their input dtypes.
    """
    where = "all_gather"
    codec = check_codec(codec, where)
    grad_codec = check_codec(grad_codec, where, "grad_codec")
    inner_codec = check_codec(inner_codec, where, "inner_codec")
    inner_grad_codec = check_codec(inner_grad_codec, where, "inner_grad_codec")
    check_bound(axis_name, where)
    if inner_axis_name is not None:
        check_bound(inner_axis_name, where)
    for leaf in jax.tree_util.tree_leaves(x):
        if not jnp.shape(leaf):
            raise ValueError(f"{where}: leaves must have rank >= 1 (gathered along axis 0); "
                             "reshape scalars to shape (1,).")
    cfg = _GatherConfig(axis_name, codec, grad_codec, inner_axis_name, inner_codec,
                        inner_grad_codec, bool(invariant))
    return _gather_vjp(cfg, x, key)


# ------------------------------------------------------------------ reduce_scatter


def _scatter_impl(tree, axis_name, codec, key, residual, divide: int = 1):
    """``reduce_scatter`` over one axis, the sum divided by ``divide`` (each value before it
    is added); returns ``(out, new_residual or None)``."""
    n = _compat.axis_size(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    res_leaves = None if residual is None else jax.tree_util.tree_leaves(residual)
    def exact(v):
        out = lax.psum_scatter(_vary_out(v, axis_name), axis_name, tiled=True)
        return out if divide == 1 else (out / divide).astype(out.dtype)

    if _is_exact(codec):
        out = [exact(l) for l in leaves]
        new_res = None if residual is None else [jnp.zeros_like(r) for r in res_leaves]
        return jax.tree_util.tree_unflatten(treedef, out), _unflat(treedef, new_res)
    items = _items(leaves, codec, n)
    out = list(leaves)
    new_res = None if residual is None else list(res_leaves)
    for i in {it.index for it in items} ^ set(range(len(leaves))):
        out[i] = exact(leaves[i])
    if items:
        words = jnp.concatenate(_encode_chunks(codec, leaves, res_leaves, new_res, items, n,
                                               replica_key(codec, key, axis_name, "reduce_scatter")), axis=1)
        got = _compat.all_to_all(words, axis_name)  # [N, W]

        def raw():  # the same values (encoded from the same x + residual) in the fallback
            fb = codec.fallback
            fb_words = _encode_chunks(fb, leaves, res_leaves, None if res_leaves is None else list(res_leaves),
                                      [it._replace(words=fb.payload_words(it.padded)) for it in items], n, None)
            return _sum_items(fb, _compat.all_to_all(jnp.concatenate(fb_words, axis=1), axis_name), items, divide)

        totals = _fallback_cond(codec, lambda: _overflow_anywhere(codec, words, axis_name),
                                lambda: _sum_items(codec, got, items, divide), raw)
        for it, total in zip(items, totals):
            out[it.index] = total.reshape((it.shape[0] // n,) + it.shape[1:]).astype(it.dtype)
    return jax.tree_util.tree_unflatten(treedef, out), _unflat(treedef, new_res)


def _sum_items(codec, got, items, divide):
    """Each item's ``sum_r decode(got[r]) / divide`` from the exchanged ``[N, W]`` words."""
    totals, off = [], 0
    for it in items:
        words = codec.payload_words(it.padded)
        totals.append(decode_sum(codec, got[:, off:off + words], it.padded, divide)[:it.size])
        off += words
    return totals


def _unflat(treedef, leaves):
    return None if leaves is None else jax.tree_util.tree_unflatten(treedef, leaves)


def _encode_chunks(codec, leaves, res_leaves, new_res, items, n, rkey):
    """Each compressed leaf as ``N`` destination chunks, encoded: ``[N, words]`` per leaf
    (updating ``new_res`` in place with error feedback)."""
    words, start = [], 0
    for it in items:
        def rows_of(v, it=it):
            v = jnp.ravel(v).astype(jnp.float32).reshape(n, it.size)
            return jnp.pad(v, ((0, 0), (0, it.padded - it.size)))
        rows = rows_of(leaves[it.index])
        if res_leaves is None:
            words.append(encode_rows(codec, rows, rkey, start=start))
        else:
            r = res_leaves[it.index]
            w, e = encode_rows(codec, rows, rkey, residual=rows_of(r), start=start)
            words.append(w)
            new_res[it.index] = e[:, :it.size].reshape(r.shape).astype(r.dtype)
        start += n * it.padded
    return words


@dataclasses.dataclass(frozen=True)
class _ScatterConfig:
    axis_name: Any
    codec: Optional[Compressor]
    grad_codec: Optional[Compressor]
    inner_axis_name: Any
    inner_codec: Optional[Compressor]
    mean: bool


def _scatter_two_level(tree, cfg: _ScatterConfig, key, residual=None):
    """Inner axis first (its own codec), then the outer axis; with ``mean`` each level
    divides by its own size before summing."""
    if cfg.inner_axis_name is not None:
        inner_key = None if key is None else jax.random.fold_in(key, 2)
        inner = _compat.axis_size(cfg.inner_axis_name) if cfg.mean else 1
        tree, _ = _scatter_impl(tree, cfg.inner_axis_name, cfg.inner_codec, inner_key, None, inner)
    outer = _compat.axis_size(cfg.axis_name) if cfg.mean else 1
    return _scatter_impl(tree, cfg.axis_name, cfg.codec, key, residual, outer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scatter_vjp(cfg: _ScatterConfig, tree, key):
    return _scatter_two_level(tree, cfg, key)[0]


def _scatter_fwd(cfg, tree, key):
    return _scatter_vjp(cfg, tree, key), key


def _scatter_bwd(cfg, key, ct):
    grad_key = None if key is None else jax.random.fold_in(key, 1)
    gcfg = _GatherConfig(cfg.axis_name, cfg.grad_codec, None, cfg.inner_axis_name, None, None, False)
    out = _gather_two_level(ct, gcfg, grad_key)
    if cfg.mean:
        n = _compat.axis_size(cfg.axis_name)
        if cfg.inner_axis_name is not None:
            n *= _compat.axis_size(cfg.inner_axis_name)
        out = jax.tree_util.tree_map(lambda v: (v / n).astype(v.dtype), out)
    return out, None


_scatter_vjp.defvjp(_scatter_fwd, _scatter_bwd)


def reduce_scatter(
    x: Any,
    axis_name: Any,
    codec: Optional[Compressor] = None,
    *,
    grad_codec: Optional[Compressor] = None,
    key: Optional[jax.Array] = None,
    residual: Any = None,
    mean: bool = False,
    inner_axis_name: Any = None,
    inner_codec: Optional[Compressor] = None,
) -> Any:
    """Sum (or mean) ``x`` over ``axis_name`` and keep this replica's chunk, sent encoded.

    Each leaf ``[N * a, ...]`` is cut into ``N`` chunks along axis 0; chunk ``j`` of every
    replica is encoded on its own and sent to replica ``j`` (one all-to-all of uint32
    words for the whole tree), which decodes the ``N`` chunks it receives and sums them in
    replica order in fp32::

        out_j = sum_r C(x_r[chunk j])          (divided by N with mean=True)

    Bytes per device: ``(N - 1) / N * 4 * N * sum_leaves payload_words(chunk)``: for
    ``cj.quantize(bits=4)`` at block 256, ``(N-1)/N * 4.125/32`` of the fp32
    reduce-scatter's ``(N-1)/N * 4 * size``.

    Args:
      x: pytree of arrays whose leading dimension is a multiple of ``N`` (of
        ``N * inner size`` with ``inner_axis_name``).
      axis_name: the mesh axis (or tuple of axes).
      codec: ``None``: exact (``lax.psum_scatter``).
      grad_codec: codec of the VJP's ``all_gather``; ``None``: exact.
      key: PRNG key, the same on every replica (stochastic codecs only).
      residual: error feedback: a pytree like ``x`` (any float dtype); then ``x + residual``
        is encoded and ``(out, new_residual)`` is returned, ``new_residual = y - C(y)``
        per chunk. Not differentiable; not with ``inner_axis_name``.
      mean: divide the sum by the number of replicas.
      inner_axis_name, inner_codec: two-level (see the module docstring): first over the
        inner axis with ``inner_codec`` (exact if ``None``), then over ``axis_name``.

    Returns:
      This replica's chunk of each leaf, ``[a, ...]``, in the leaf's dtype; with
      ``residual``, ``(chunks, new_residual)``.
    """
    where = "reduce_scatter"
    codec = check_codec(codec, where)
    grad_codec = check_codec(grad_codec, where, "grad_codec")
    inner_codec = check_codec(inner_codec, where, "inner_codec")
    n = check_bound(axis_name, where)
    if inner_axis_name is not None:
        n *= check_bound(inner_axis_name, where)
    _check_tiled(jax.tree_util.tree_leaves(x), n, where)
    cfg = _ScatterConfig(axis_name, codec, grad_codec, inner_axis_name, inner_codec, bool(mean))
    if residual is None:
        return _scatter_vjp(cfg, x, key)
    if inner_axis_name is not None:
        raise ValueError(f"{where}: error feedback (`residual`) with `inner_axis_name` is not "
                         "supported; keep a residual per level in your own code.")
    if jax.tree_util.tree_structure(residual) != jax.tree_util.tree_structure(x):
        raise ValueError(f"{where}: `residual` must have the structure and shapes of `x`.")
    return _scatter_two_level(x, cfg, key, residual)


# ----------------------------------------------------------------- all_reduce reducers

#: Density multiplier of a top-k two-phase owner's re-selection (see :class:`TwoPhase`).
SERVER_DENSITY = 4.0


class PartsResult(NamedTuple):
    """What a reducer returns for a bucket held as one flat array per segment."""

    means: list  # float32[size] per segment: the estimate, identical on every replica
    residuals: list  # float32[size] per segment: y - C(y) of this replica (or C(y) w/o EF)
    server_residual: jax.Array  # float32[chunk] (two_phase) or float32[0]
    #: Per segment, replicated: whether every payload that made its mean was finite (read
    #: from the payloads' scale words, for codecs that have them); ``None``: not known.
    finite: Optional[list] = None


@dataclasses.dataclass(frozen=True)
class Reducer:
    """How an ``all_reduce`` moves payloads: a small strategy object.

    ``bytes(codec, n, N)`` is the per-device ring cost for a bucket of ``n`` (aligned)
    elements; ``reduce(...)`` runs it on the bucket held as one padded part per segment.
    """

    name: ClassVar[str] = "reducer"

    def why_not(self, codec: Compressor) -> Optional[str]:
        """``None`` if this reducer can carry ``codec``'s payload, else the reason."""
        return None

    def padded_length(self, codec: Compressor, n: int, num_replicas: int) -> int:
        return _round_up(n, codec.alignment) if n else 0

    def server_residual_size(self, codec: Compressor, n: int, num_replicas: int) -> int:
        return 0

    def bytes(self, codec: Compressor, n: int, num_replicas: int,
              segments: Optional[Sequence[Segment]] = None) -> float:
        raise NotImplementedError

    def reduce(self, codec, parts, segments, **kwargs) -> PartsResult:
        raise NotImplementedError

    def reports_finite(self, codec: Compressor) -> bool:
        """Whether :meth:`reduce` returns :attr:`PartsResult.finite` for ``codec``: then a
        non-finite input on any replica is already flagged on every replica by what they
        all receive, and the transform sends no flags of its own."""
        return False


def _local_parts(codec, parts, segments, residuals, key):
    """Encode every part (with feedback when ``residuals``): ``(words, locals_or_res)``."""
    words, outs = [], []
    for k, (p, s) in enumerate(zip(parts, segments)):
        if residuals is None:
            w, local = codec.encode_and_decode(p, key, start=s.offset)
            outs.append(local[:s.size])
        else:
            res = jnp.pad(residuals[k].astype(jnp.float32), (0, s.padded_size - s.size))
            w, e = codec.encode_feedback(p, res, key, start=s.offset)
            outs.append(e[:s.size])
        words.append(w)
    return words, outs


def _segment_words(codec: Compressor, words: jax.Array, seg: Segment) -> jax.Array:
    """The words of a block codec's payload that encode ``seg`` (whole blocks)."""
    row = codec.payload_words(codec.alignment)
    lo = seg.offset // codec.alignment * row
    return words[..., lo:lo + seg.padded_size // codec.alignment * row]


@dataclasses.dataclass(frozen=True)
class AllReduce(Reducer):
    """``psum`` of a linear payload (the identity, ``cast``): ``2 (N-1)/N * P``."""

    name: ClassVar[str] = "allreduce"

    def why_not(self, codec):
        if codec.shared_randomness:
            return "its positions come from a shared key (reducer 'auto')"
        if not codec.linear:
            return ("its payload is not linear (summing quantized codes is wrong, and psum on "
                    "small integers wraps around)")
        if codec.linear_payload_bytes(2) < 8:
            return ("a 16-bit sum loses precision at every addition (and XLA on CPU sends it "
                    "widened to fp32); 'two_phase' sends the same 16-bit words and sums in fp32")
        return None

    def bytes(self, codec, n, num_replicas, segments=None):
        return ring_bytes("all-reduce", codec.linear_payload_bytes(self.padded_length(codec, n, num_replicas)),
                          num_replicas)

    def reduce(self, codec, parts, segments, *, axis_name, num_replicas, key, residuals=None,
               server_residual=None, server_error_feedback=True):
        y = _joined(parts, segments, residuals)
        n = y.shape[0]
        payload = codec.encode_linear(y, key)
        local = codec.decode_linear(payload, n)
        total = codec.decode_linear(_compat.psum(payload, axis_name), n) / num_replicas
        outs = flat_bucket.cut(local if residuals is None else y - local, segments)
        return PartsResult(flat_bucket.cut(total, segments), outs, _empty(server_residual))


def tells_finite(codec: Compressor) -> bool:
    """Whether ``codec``'s :meth:`~Compressor.payload_finite` can tell (is not ``None``):
    asked of the method itself, on the abstract words of one block, so that the answer
    cannot disagree with what the reducers read."""
    if not isinstance(codec, BlockCompressor):
        return False
    words = jax.ShapeDtypeStruct((codec.payload_words(codec.alignment),), jnp.uint32)
    return jax.eval_shape(codec.payload_finite, words) is not None


def _payload_finite(codec: Compressor, words: list) -> Optional[list]:
    """Per segment: all its payload scales finite (every replica holds the same words);
    ``None`` for a codec that cannot tell from its words."""
    flags = [codec.payload_finite(w) for w in words]
    return None if any(f is None for f in flags) else flags


def _empty(server_residual):
    return jnp.zeros((0,), jnp.float32) if server_residual is None else server_residual


@dataclasses.dataclass(frozen=True)
class AllGather(Reducer):
    """All-gather of every payload, each replica decodes and sums all: ``(N-1) P``."""

    name: ClassVar[str] = "allgather"

    def why_not(self, codec):
        return "its positions come from a shared key (reducer 'auto')" if codec.shared_randomness else None

    def bytes(self, codec, n, num_replicas, segments=None):
        m = self.padded_length(codec, n, num_replicas)
        return ring_bytes("all-gather", codec.payload_bytes(m, segments), num_replicas)

    def reports_finite(self, codec):
        return tells_finite(codec)

    def reduce(self, codec, parts, segments, *, axis_name, num_replicas, key, residuals=None,
               server_residual=None, server_error_feedback=True):
        if not isinstance(codec, BlockCompressor):
            return _gather_whole(codec, parts, segments, axis_name, num_replicas, key, residuals,
                                 server_residual)
        if codec.fallback is not None:
            return _gather_with_fallback(codec, parts, segments, axis_name, num_replicas, key,
                                         residuals, server_residual)
        words, outs = _local_parts(codec, parts, segments, residuals, key)
        got = _compat.all_gather_invariant(jnp.concatenate(words), axis_name, tiled=False)
        means = [decode_sum(codec, _segment_words(codec, got, s), s.padded_size, num_replicas)[:s.size]
                 for s in segments]
        finite = _payload_finite(codec, [_segment_words(codec, got, s) for s in segments])
        return PartsResult(means, outs, _empty(server_residual), finite)


def _with_residuals(parts, segments, residuals):
    """Error feedback's ``y = part + residual`` per segment (fp32), or the parts."""
    if residuals is None:
        return list(parts)
    return [p + jnp.pad(r.astype(jnp.float32), (0, s.padded_size - s.size))
            for p, r, s in zip(parts, residuals, segments)]


def _encode_ys(codec, ys, segments, residuals, key):
    """``(words, outs)`` of :func:`_local_parts` from the ``y`` already formed: the same
    arithmetic (encode ``y``, ``y - C(y)``), with ``y`` kept for a fallback."""
    words, local = _local_parts(codec, ys, segments, None, key)
    if residuals is None:
        return words, local
    return words, [y[:s.size] - c for y, c, s in zip(ys, local, segments)]


def _gather_with_fallback(codec, parts, segments, axis_name, num_replicas, key, residuals,
                          server_residual):
    """All-gather reducer of a codec with a :attr:`~Compressor.fallback`: the coded
    payloads; and, if some gathered payload overflowed (read from the gathered words, the
    same on every replica), the fallback's payloads of the same ``y``, whose mean is used."""
    ys = _with_residuals(parts, segments, residuals)
    words, outs = _encode_ys(codec, ys, segments, residuals, key)
    got = _compat.all_gather_invariant(jnp.concatenate(words), axis_name, tiled=False)

    def means_of(c, g):
        return [decode_sum(c, _segment_words(c, g, s), s.padded_size, num_replicas)[:s.size]
                for s in segments]

    def raw():
        fb = codec.fallback
        fb_words = jnp.concatenate([fb.encode(y, None, start=s.offset) for y, s in zip(ys, segments)])
        return means_of(fb, _compat.all_gather_invariant(fb_words, axis_name, tiled=False))

    means = lax.cond(codec.payload_overflow(got), raw, lambda: means_of(codec, got))
    finite = _payload_finite(codec, [_segment_words(codec, got, s) for s in segments])
    return PartsResult(means, outs, _empty(server_residual), finite)


def _gather_whole(codec, parts, segments, axis_name, num_replicas, key, residuals, server_residual):
    """All-gather reducer of a codec whose selection spans leaves: the joined bucket."""
    x = _joined(parts, segments, residuals)
    words, local = codec.encode_and_decode(x, key, segments)
    got = _compat.all_gather_invariant(words, axis_name, tiled=False)
    mean = codec.decode_sum(got, x.shape[0], segments, divide=num_replicas)
    outs = flat_bucket.cut(local if residuals is None else x - local, segments)
    return PartsResult(flat_bucket.cut(mean, segments), outs, _empty(server_residual))


@dataclasses.dataclass(frozen=True)
class TwoPhase(Reducer):
    """All-to-all of chunks, decode + sum + re-encode one chunk, all-gather: ``2 (N-1)/N P``.

    Replica ``j`` receives chunk ``j`` of every payload, sums the decoded chunks in replica
    order in fp32, re-encodes the chunk's mean with a server-side residual (its own error
    feedback) and all-gathers the re-encoded chunks: per-device bytes independent of
    ``N``. Block codecs send whole blocks per chunk; other codecs (top-k) select within
    each destination chunk, and the owner re-selects from the chunk's mean.
    """

    name: ClassVar[str] = "two_phase"
    #: Codec of the owner's re-encoding of its chunk. ``None``: the same codec, except
    #: top-k, whose owner keeps :data:`SERVER_DENSITY` times its density: the chunk's sum
    #: holds up to ``N`` times more entries than each replica sent, and re-selecting only
    #: ``k`` of them cost the non-i.i.d. benchmark task twice the loss gap of the all-gather
    #: (benchmarks/results/sparse_convergence.json).
    server_codec: Optional[Compressor] = None

    def _server(self, codec: Compressor) -> Compressor:
        if self.server_codec is not None:
            return self.server_codec
        if isinstance(codec, TopK):
            return dataclasses.replace(codec, ratio=min(1.0, SERVER_DENSITY * codec.ratio))
        return codec

    def why_not(self, codec):
        server = self._server(codec)
        if isinstance(codec, BlockCompressor) and (
                not isinstance(server, BlockCompressor) or server.alignment != codec.alignment):
            return "its server codec must be a block codec with the same block size"
        if codec.shared_randomness or (codec.linear and not isinstance(codec, BlockCompressor)):
            return "its payload is summed by an all-reduce (a linear exchange)"
        return None

    def padded_length(self, codec, n, num_replicas):
        return _round_up(n, codec.alignment * num_replicas) if n else 0

    def server_residual_size(self, codec, n, num_replicas):
        return self.padded_length(codec, n, num_replicas) // num_replicas if n else 0

    def bytes(self, codec, n, num_replicas, segments=None):
        m = self.padded_length(codec, n, num_replicas)
        chunk = codec.payload_bytes(m // num_replicas)
        server = self._server(codec).payload_bytes(m // num_replicas)
        return ring_bytes("all-to-all", num_replicas * chunk, num_replicas) + ring_bytes(
            "all-gather", server, num_replicas) + _flag_bytes(codec, num_replicas)

    def reports_finite(self, codec):
        # A non-finite block decodes to non-finite values on its owner, whose sum then
        # encodes to a non-finite scale in the all-gathered words.
        return isinstance(codec, BlockCompressor) and tells_finite(self._server(codec))

    def reduce(self, codec, parts, segments, *, axis_name, num_replicas, key, residuals=None,
               server_residual=None, server_error_feedback=True):
        n = sum(s.padded_size for s in segments)
        m = self.padded_length(codec, n, num_replicas)
        if isinstance(codec, BlockCompressor) and codec.fallback is not None:
            return _two_phase_with_fallback(
                codec, self._server(codec), parts, segments, m, axis_name, num_replicas, key,
                residuals, server_residual, server_error_feedback)
        if isinstance(codec, BlockCompressor):
            words, outs = _local_parts(codec, parts, segments, residuals, key)
            if m > n:  # whole zero blocks up to N chunks: their encoding, once
                words.append(codec.encode(jnp.zeros((m - n,), jnp.float32), key, start=n))
            rows = jnp.concatenate(words).reshape(num_replicas, -1)
        else:
            rows, outs = _sparse_rows(codec, parts, segments, residuals, key, m, num_replicas)
        server = self._server(codec)
        gathered, new_server = _two_phase_exchange(
            codec, server, rows, m // num_replicas, axis_name, num_replicas, key, server_residual,
            server_error_feedback)
        finite = None
        if isinstance(server, BlockCompressor):
            words = [_segment_words(server, gathered, s) for s in segments]
            means = [server.decode(w, s.padded_size)[:s.size] for w, s in zip(words, segments)]
            finite = _payload_finite(server, words)
        else:
            full = decode_rows(server, gathered.reshape(num_replicas, -1), m // num_replicas)
            means = flat_bucket.cut(full.reshape(-1), segments)
        return PartsResult(means, outs, new_server, finite)


def _sparse_rows(codec, parts, segments, residuals, key, m, num_replicas):
    """A non-block codec's two-phase payload: the joined bucket cut into ``N`` destination
    chunks, each encoded (selected) on its own."""
    x = _joined(parts, segments, residuals)
    rows = jnp.pad(x, (0, m - x.shape[0])).reshape(num_replicas, -1)
    if residuals is None:
        words = encode_rows(codec, rows, key)
        local = decode_rows(codec, words, m // num_replicas)
        return words, flat_bucket.cut(local.reshape(-1), segments)
    words, e = _encode_rows_feedback(codec, rows, key)
    return words, flat_bucket.cut(e.reshape(-1), segments)


def _two_phase_exchange(codec, server, rows, chunk, axis_name, num_replicas, key, server_residual,
                        server_error_feedback):
    """All-to-all of the ``[N, w]`` destination rows, decode + sum + re-encode the chunk
    this replica owns, all-gather. Returns the gathered words (``[N * w]``) of the mean of
    the whole bucket and the new server residual."""
    received = _compat.all_to_all(rows, axis_name)
    mine = decode_sum(codec, received, chunk, num_replicas)
    words, new_server, _ = _server_encode(server, mine, key, server_residual, server_error_feedback)
    return _compat.all_gather_invariant(words, axis_name, tiled=True), new_server


def _server_encode(server, mine, key, server_residual, server_error_feedback):
    """The owner's re-encoding of its chunk's mean (with the server residual):
    ``(words, new_server_residual, server_in)``."""
    keep = server_residual is not None and server_error_feedback
    server_in = mine + server_residual.astype(jnp.float32) if keep else mine
    server_key = None if key is None else jax.random.fold_in(key, 0x5E7)
    words, local = server.encode_and_decode(server_in, server_key)
    if keep:
        new_server = (server_in - local).astype(server_residual.dtype)
    else:
        new_server = _empty(None) if server_residual is None else jnp.zeros_like(server_residual)
    return words, new_server, server_in


def _two_phase_with_fallback(codec, server, parts, segments, m, axis_name, num_replicas, key,
                             residuals, server_residual, server_error_feedback):
    """The two-phase reducer of a block codec with a :attr:`~Compressor.fallback`
    (:func:`commjax.lossless`): at each phase the coded payloads travel, and if one
    overflowed on some replica (an fp32 flag summed over the axis after the all-to-all;
    read from the gathered words after the all-gather) the fallback's payloads of the
    same values travel too, on every replica, and are the ones decoded."""
    n, chunk = sum(s.padded_size for s in segments), m // num_replicas
    ys = _with_residuals(parts, segments, residuals)
    words, outs = _encode_ys(codec, ys, segments, residuals, key)
    y = jnp.pad(flat_bucket.concat(ys), (0, m - n))
    if m > n:  # whole zero blocks up to N chunks
        words.append(codec.encode(jnp.zeros((m - n,), jnp.float32), key, start=n))
    rows = jnp.concatenate(words).reshape(num_replicas, -1)
    received = _compat.all_to_all(rows, axis_name)

    def raw_sum():
        fb_rows = codec.fallback.encode(y, None).reshape(num_replicas, -1)
        return decode_sum(codec.fallback, _compat.all_to_all(fb_rows, axis_name), chunk, num_replicas)

    mine = lax.cond(_overflow_anywhere(codec, rows, axis_name), raw_sum,
                    lambda: decode_sum(codec, received, chunk, num_replicas))
    words, new_server, server_in = _server_encode(server, mine, key, server_residual,
                                                  server_error_feedback)
    gathered = _compat.all_gather_invariant(words, axis_name, tiled=True)

    def means_of(c, g):
        return [c.decode(_segment_words(c, g, s), s.padded_size)[:s.size] for s in segments]

    def raw_means():
        fb = server.fallback
        return means_of(fb, _compat.all_gather_invariant(fb.encode(server_in, None), axis_name, tiled=True))

    means = _fallback_cond(server, lambda: server.payload_overflow(gathered),
                           lambda: means_of(server, gathered), raw_means)
    finite = _payload_finite(server, [_segment_words(server, gathered, s) for s in segments])
    return PartsResult(means, outs, new_server, finite)


@dataclasses.dataclass(frozen=True)
class SharedMask(Reducer):
    """Codecs that keep the same ``K`` positions on every replica (random-k: positions
    from a key shared by all replicas). Only the values travel, reduced as a dense vector
    by the codec's ``value_codec``: fp32 in one all-reduce (``2 (N-1)/N * 4 K``), bf16 as
    packed words through the two-phase reducer (``2 (N-1)/N * 2 K``), summed in fp32."""

    name: ClassVar[str] = "shared_mask"

    def why_not(self, codec):
        return None if codec.shared_randomness else "its positions are not drawn from a shared key"

    def _values(self, codec, k: int, num_replicas: int):
        vcodec = codec.value_codec
        kp = _round_up(max(k, 1), vcodec.alignment)
        red = AllReduce() if AllReduce().why_not(vcodec) is None and vcodec.lossless else TwoPhase()
        return vcodec, kp, red

    def bytes(self, codec, n, num_replicas, segments=None):
        vcodec, kp, red = self._values(codec, codec.num_kept(n, segments), num_replicas)
        return red.bytes(vcodec, kp, num_replicas)

    def reduce(self, codec, parts, segments, *, axis_name, num_replicas, key, residuals=None,
               server_residual=None, server_error_feedback=True):
        x = _joined(parts, segments, residuals)
        n = x.shape[0]
        vals = codec.encode_linear(x, key, segments).astype(jnp.float32)
        k = vals.shape[0]
        vcodec, kp, red = self._values(codec, k, num_replicas)
        seg = (Segment(0, k, kp, (k,)),)
        res = red.reduce(vcodec, [jnp.pad(vals, (0, kp - k))], seg, axis_name=axis_name,
                         num_replicas=num_replicas, key=None)
        mean = codec.decode_linear(res.means[0], n, key, segments)
        local = codec.decode_linear(vals, n, key, segments)
        outs = flat_bucket.cut(local if residuals is None else x - local, segments)
        return PartsResult(flat_bucket.cut(mean, segments), outs, _empty(server_residual))


def _joined(parts, segments, residuals):
    """The bucket as one flat vector (``part + residual`` with error feedback), added
    before joining: joining the parts and the residuals apart wrote two bucket-size
    vectors, and every reader of ``x`` then read both."""
    return flat_bucket.concat(_with_residuals(parts, segments, residuals))


REDUCERS = ("auto", "allreduce", "allgather", "two_phase")
_REDUCER_OBJECTS = {r.name: r for r in (AllReduce(), AllGather(), TwoPhase(), SharedMask())}


def get_reducer(reducer: Any) -> Reducer:
    """A :class:`Reducer` from itself or its name (``"allreduce"``, ``"allgather"``,
    ``"two_phase"``)."""
    if isinstance(reducer, Reducer):
        return reducer
    if reducer not in _REDUCER_OBJECTS:
        raise ValueError(
            f"`reducer` must be one of {', '.join(map(repr, REDUCERS))} or a "
            f"commjax.collectives.Reducer; got {reducer!r}.")
    return _REDUCER_OBJECTS[reducer]


def valid_reducers(codec: Compressor) -> tuple[str, ...]:
    """Names of the reducers that can carry ``codec``'s payload."""
    return tuple(name for name, r in _REDUCER_OBJECTS.items() if r.why_not(codec) is None)


def check_reducer(codec: Compressor, reducer: Any, where: str = "compressed_mean") -> Any:
    """``reducer`` (``"auto"``, a name or a :class:`Reducer`) if it can carry ``codec``."""
    if reducer == "auto":
        return reducer
    try:
        obj = get_reducer(reducer)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    why = obj.why_not(codec)
    if why is not None:
        raise ValueError(
            f"{where}: reducer={obj.name!r} cannot carry {codec.name} payloads: {why}. Valid "
            f"reducers for {codec.name}: {', '.join(map(repr, valid_reducers(codec) + ('auto',)))}.")
    return reducer


def choose_reducer(codec: Compressor, reducer: Any, n: int, num_replicas: int,
                   segments: Optional[Sequence[Segment]] = None) -> Optional[Reducer]:
    """Resolve ``"auto"`` to the valid reducer that sends the fewest bytes (``None`` for one
    replica). Ties go to the more exact: an fp32 all-reduce (no re-encoding), then the
    all-gather (one encoding), then two-phase (two). A 16-bit linear payload is never
    summed by ``psum`` (:class:`AllReduce` refuses it; two-phase sums it in fp32)."""
    check_reducer(codec, reducer)
    if num_replicas <= 1:
        return None
    if reducer != "auto":
        return get_reducer(reducer)
    if codec.shared_randomness:
        return _REDUCER_OBJECTS["shared_mask"]
    options = []
    for rank, name in enumerate(("allreduce", "allgather", "two_phase")):
        obj = _REDUCER_OBJECTS[name]
        if obj.why_not(codec) is not None:
            continue
        if name == "two_phase" and not isinstance(codec, BlockCompressor):
            continue  # a second selection on the owner: opt-in (reducer="two_phase")
        options.append((obj.bytes(codec, n, num_replicas, segments), rank, name))
    return _REDUCER_OBJECTS[min(options)[2]]


def reduce_parts(codec: Compressor, reducer: Optional[Reducer], parts: Sequence[jax.Array],
                 segments: Sequence[Segment], *, axis_name: Any, num_replicas: int,
                 key: Optional[jax.Array], residuals: Optional[Sequence[jax.Array]] = None,
                 server_residual: Optional[jax.Array] = None,
                 server_error_feedback: bool = True,
                 shared_key: Optional[jax.Array] = None) -> PartsResult:
    """The mean over ``axis_name`` of a bucket held as one padded flat part per segment
    (``parts[i]`` is ``segments[i].padded_size`` long, segments back to back).

    ``key`` is this replica's encoding key. With ``residuals`` (one per segment, its
    ``size`` long) each part is encoded as ``part + residual`` and
    :attr:`PartsResult.residuals` holds the new residuals; without, the local decodes.
    ``reducer=None``: one replica, encode and decode only. ``shared_key`` (the same on
    every replica) is what codecs with ``shared_randomness`` (random-k) encode with.
    """
    if codec.shared_randomness:
        key = shared_key
    if reducer is None or axis_name is None or num_replicas <= 1:
        return _one_replica(codec, parts, segments, key, residuals, server_residual)
    return reducer.reduce(codec, parts, segments, axis_name=axis_name, num_replicas=num_replicas,
                          key=key, residuals=residuals, server_residual=server_residual,
                          server_error_feedback=server_error_feedback)


def _one_replica(codec, parts, segments, key, residuals, server_residual):
    """One replica: ``C(y)`` is the mean, ``y - C(y)`` the new residual."""
    if residuals is not None:
        parts = [p + jnp.pad(r.astype(jnp.float32), (0, s.padded_size - s.size))
                 for p, r, s in zip(parts, residuals, segments)]
    if isinstance(codec, BlockCompressor):
        local = [codec.encode_and_decode(p, key, start=s.offset)[1][:s.size]
                 for p, s in zip(parts, segments)]
    else:
        local = flat_bucket.cut(codec.encode_and_decode(flat_bucket.concat(parts), key, segments)[1],
                                segments)
    outs = local if residuals is None else [p[:s.size] - c for p, c, s in zip(parts, local, segments)]
    return PartsResult(local, outs, _empty(server_residual))


# ------------------------------------------------------------------------ all_reduce


def exact_mean(parts: Sequence[jax.Array], axis_name: Any, num_replicas: int,
               extra: Sequence[jax.Array] = ()) -> tuple[list[jax.Array], list[jax.Array]]:
    """The exact mean of real ``parts`` (flattened) in one all-reduce (the *exact bucket*:
    joined as whole rows, :mod:`commjax.bucket`): in fp32, or in float64 when a part is
    float64; and of the ``extra`` arrays as further operands of the same collective
    (uncopied). ``axis_name=None``: no collective. Bytes: ``2 (N-1)/N * 4 * elements`` (8
    per element in float64)."""
    # float64 parts keep their precision: then the whole bucket is float64 (XLA would
    # widen an fp32 operand beside it anyway, and the plan counts what travels).
    dtype = jnp.float64 if any(jnp.dtype(jnp.result_type(p)) == jnp.float64 for p in parts) else jnp.float32
    flat = [jnp.ravel(p).astype(dtype) for p in parts]
    extra = [e.astype(jnp.float32) for e in extra]
    if not parts and not extra:
        return [], []
    bucket = flat_bucket.concat(flat) if flat else jnp.zeros((0,), dtype)
    if axis_name is not None:
        bucket, *extra = [v / num_replicas for v in _compat.psum([bucket] + list(extra), axis_name)]
    out, pos = [], 0
    for p in flat:
        out.append(bucket[pos:pos + p.shape[0]])
        pos += p.shape[0]
    return out, list(extra)


def all_reduce(
    x: Any,
    axis_name: Any,
    codec: Optional[Compressor] = None,
    *,
    reducer: Any = "auto",
    grad_codec: Optional[Compressor] = None,
    key: Optional[jax.Array] = None,
    residual: Any = None,
    server_residual: Optional[jax.Array] = None,
    mean: bool = False,
    inner_axis_name: Any = None,
    server_error_feedback: bool = True,
) -> Any:
    """Sum (or mean) ``x`` over ``axis_name``, identical on every replica, sent encoded.

    The floating leaves form one bucket (each padded to whole blocks) reduced by one
    :class:`Reducer`: ``"allreduce"`` (``psum`` of a linear payload, ``2 (N-1)/N P``),
    ``"allgather"`` (``(N-1) P``, grows with ``N``), ``"two_phase"`` (all-to-all +
    all-gather, ``2 (N-1)/N P``, flat in ``N``, with a server-side re-encoding) or
    ``"auto"`` (the cheapest valid). With ``inner_axis_name`` the exact fp32 mean over that
    (fast) axis comes first and only ``axis_name`` sees the codec.

    Args:
      x: pytree of arrays (any shapes).
      axis_name: the mesh axis (or tuple of axes).
      codec: ``None``: exact ``lax.psum``.
      reducer: see above.
      grad_codec: codec of the VJP's all-reduce of the cotangent; ``None``: exact.
      key: PRNG key, the same on every replica (stochastic codecs only).
      residual: error feedback, a pytree like ``x``: returns ``(out, new_residual,
        new_server_residual)``. Not differentiable.
      server_residual: the two-phase reducer's residual (``float32[chunk]``, see
        :meth:`Reducer.server_residual_size`), with ``residual``.
      mean: divide by the number of replicas (of both axes with ``inner_axis_name``).
      server_error_feedback: keep the two-phase server residual.
    """
    where = "all_reduce"
    codec = check_codec(codec, where)
    grad_codec = check_codec(grad_codec, where, "grad_codec")
    check_bound(axis_name, where)
    if inner_axis_name is not None:
        check_bound(inner_axis_name, where)
    if codec is not None:
        check_reducer(codec, reducer, where)
    cfg = _ReduceConfig(axis_name, codec, reducer, grad_codec, inner_axis_name, bool(mean),
                        bool(server_error_feedback))
    if residual is None and server_residual is None:
        return _reduce_vjp(cfg, x, key)
    return _reduce_impl(cfg, x, key, residual, server_residual)


@dataclasses.dataclass(frozen=True)
class _ReduceConfig:
    axis_name: Any
    codec: Optional[Compressor]
    reducer: Any
    grad_codec: Optional[Compressor]
    inner_axis_name: Any
    mean: bool
    server_error_feedback: bool


def _reduce_impl(cfg: _ReduceConfig, tree, key, residual=None, server_residual=None):
    """``all_reduce``: exact leaves in one ``psum`` over every axis, the floating leaves
    through the codec's reducer over ``axis_name`` after the exact inner mean."""
    n = _compat.axis_size(cfg.axis_name)
    axes = _names(cfg.axis_name)
    inner = 1
    if cfg.inner_axis_name is not None:
        inner = _compat.axis_size(cfg.inner_axis_name)
        axes = axes + _names(cfg.inner_axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    items = [] if _is_exact(cfg.codec) else _items(leaves, cfg.codec, 1)
    done = {it.index for it in items}
    out = list(leaves)
    exact_idx = [i for i in range(len(leaves)) if i not in done]
    if cfg.mean and any(not jnp.issubdtype(jnp.result_type(leaves[i]), jnp.inexact) for i in exact_idx):
        raise ValueError("all_reduce: mean=True needs floating (or complex) leaves; sum integer "
                         "leaves with mean=False.")
    for i, v in zip(exact_idx, _compat.psum([leaves[i] for i in exact_idx], axes)):
        out[i] = (v / (n * inner)).astype(v.dtype) if cfg.mean else v
    if not items:
        return jax.tree_util.tree_unflatten(treedef, out), residual, server_residual
    if cfg.inner_axis_name is not None:
        leaves = list(leaves)
        for it in items:
            leaves[it.index] = _compat.psum(leaves[it.index].astype(jnp.float32), cfg.inner_axis_name) / inner
    segments, parts, off = [], [], 0
    for it in items:
        segments.append(Segment(off, it.size, it.padded, it.shape))
        parts.append(jnp.pad(jnp.ravel(leaves[it.index]).astype(jnp.float32), (0, it.padded - it.size)))
        off += it.padded
    res_leaves = None if residual is None else jax.tree_util.tree_leaves(residual)
    res = reduce_parts(
        cfg.codec, choose_reducer(cfg.codec, cfg.reducer, off, n, segments), parts, segments,
        axis_name=cfg.axis_name, num_replicas=n,
        key=replica_key(cfg.codec, key, cfg.axis_name, "all_reduce"),
        residuals=None if res_leaves is None else [jnp.ravel(res_leaves[it.index]) for it in items],
        server_residual=server_residual, server_error_feedback=cfg.server_error_feedback)
    scale = 1.0 if cfg.mean else float(n * inner)
    for it, m in zip(items, res.means):
        out[it.index] = (m * scale).reshape(it.shape).astype(it.dtype)
    new_res = residual
    if res_leaves is not None:
        new_res = list(res_leaves)
        for it, e in zip(items, res.residuals):
            new_res[it.index] = e.reshape(res_leaves[it.index].shape).astype(res_leaves[it.index].dtype)
        new_res = jax.tree_util.tree_unflatten(treedef, new_res)
    return jax.tree_util.tree_unflatten(treedef, out), new_res, res.server_residual


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reduce_vjp(cfg: _ReduceConfig, tree, key):
    return _reduce_impl(cfg, tree, key)[0]


def _reduce_fwd(cfg, tree, key):
    return _reduce_vjp(cfg, tree, key), key


def _reduce_bwd(cfg, key, ct):
    if _replicated_cotangent(ct, cfg.axis_name):
        names = _names(cfg.axis_name) + (() if cfg.inner_axis_name is None else _names(cfg.inner_axis_name))
        out = _vary_out(ct, names)
        if cfg.mean:
            n = _compat.axis_size(cfg.axis_name) * (
                1 if cfg.inner_axis_name is None else _compat.axis_size(cfg.inner_axis_name))
            out = jax.tree_util.tree_map(lambda v: (v / n).astype(v.dtype), out)
        return out, None
    grad_key = None if key is None else jax.random.fold_in(key, 1)
    gcfg = dataclasses.replace(cfg, codec=cfg.grad_codec, grad_codec=None, reducer="auto")
    return _reduce_impl(gcfg, ct, grad_key)[0], None


_reduce_vjp.defvjp(_reduce_fwd, _reduce_bwd)


# ---------------------------------------------------------------------- wire bytes


def wire_bytes(op: str, x: Any, num_replicas: int, codec: Optional[Compressor] = None, *,
               reducer: Any = "auto", inner_size: int = 1,
               inner_codec: Optional[Compressor] = None) -> float:
    """Analytic per-device ring bytes of one collective on ``x`` (arrays or
    ``jax.ShapeDtypeStruct``, as the collective receives them), for ``num_replicas`` on
    ``axis_name`` (and ``inner_size`` on the inner axis): what the compiled HLO sends
    (:func:`commjax.collective_bytes`)."""
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
            total += sum(ring_bytes("all-reduce", _nbytes(l), inner_size) for l in leaves)
        return total + _reduce_bytes(leaves, codec, num_replicas, reducer)
    raise ValueError(f"wire_bytes: `op` must be 'all_gather', 'reduce_scatter' or 'all_reduce'; got {op!r}.")


def _nbytes(leaf) -> int:
    return math.prod(jnp.shape(leaf)) * jnp.dtype(jnp.result_type(leaf)).itemsize


def _gather_bytes(leaves, codec, n) -> float:
    if _is_exact(codec):
        return sum(ring_bytes("all-gather", _nbytes(l), n) for l in leaves)
    items = _items(leaves, codec, 1)
    done = {it.index for it in items}
    exact = sum(ring_bytes("all-gather", _nbytes(l), n) for i, l in enumerate(leaves) if i not in done)
    return exact + ring_bytes("all-gather", 4 * sum(it.words for it in items), n)


def _scatter_bytes(leaves, codec, n) -> float:
    if _is_exact(codec):
        return sum(ring_bytes("reduce-scatter", _nbytes(l), n) for l in leaves)
    items = _items(leaves, codec, n)
    done = {it.index for it in items}
    exact = sum(ring_bytes("reduce-scatter", _nbytes(l), n) for i, l in enumerate(leaves) if i not in done)
    return exact + ring_bytes("all-to-all", 4 * n * sum(it.words for it in items), n) + (
        _flag_bytes(codec, n) if items else 0.0)


def _flag_bytes(codec, n) -> float:
    """The fp32 overflow flag a codec with a fallback sums after an all-to-all (the
    fallback's own collectives run only on overflow: not counted)."""
    return ring_bytes("all-reduce", 4, n) if codec.fallback is not None else 0.0


def _reduce_bytes(leaves, codec, n, reducer) -> float:
    if _is_exact(codec):
        return sum(ring_bytes("all-reduce", _nbytes(l), n) for l in leaves)
    items = _items(leaves, codec, 1)
    done = {it.index for it in items}
    exact = sum(ring_bytes("all-reduce", _nbytes(l), n) for i, l in enumerate(leaves) if i not in done)
    segments, off = [], 0
    for it in items:
        segments.append(Segment(off, it.size, it.padded, it.shape))
        off += it.padded
    red = choose_reducer(codec, reducer, max(off, 1), n, segments)
    return exact + (0.0 if red is None or not off else red.bytes(codec, off, n, segments))
