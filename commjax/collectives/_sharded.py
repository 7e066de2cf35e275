"""The stages of the sharded collectives: ``all_gather`` and ``reduce_scatter`` over one
axis or a two-level pair of axes (the public ops and their VJPs: ``.gather``,
``.scatter``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat
from commjax.compressors.base import Compressor
from commjax.compressors.lossless import from_float32, to_float32
from commjax.collectives._exact import prescale, unscale_mean
from commjax.collectives._common import (
    _fallback_cond, _is_exact, _items, _names, _overflow_anywhere, _vary_out, decode_rows,
    decode_sum, encode_rows, gather_flat, gathered_width, join_rows, replica_key, scatter_flat,
)


def _gather_impl(tree, axis_name, codec, key, invariant: bool):
    """``all_gather`` over one axis (tiled along axis 0, leaves of rank >= 1)."""
    n = _compat.axis_size(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    gather = (functools.partial(_compat.all_gather_invariant, axis_name=axis_name, tiled=True)
              if invariant else
              (lambda v: lax.all_gather(_vary_out(v, axis_name), axis_name, tiled=True)))

    def exact(v):
        return gather_flat(v, gather, n) if jnp.ndim(v) == 1 else gather(v)

    if _is_exact(codec):
        return jax.tree_util.tree_unflatten(treedef, [exact(l) for l in leaves])
    items = _items(leaves, codec, 1)
    out = list(leaves)
    for i in {it.index for it in items} ^ set(range(len(leaves))):
        out[i] = exact(leaves[i])
    if items:
        rkey = replica_key(codec, key, axis_name, "all_gather")
        # Exact conversions both ways: a gathered value arrives as it was sent, 16-bit NaN
        # payloads included (XLA's float32 -> bfloat16 conversion would clear them).
        flats = [jnp.pad(to_float32(jnp.ravel(leaves[it.index])), (0, it.padded - it.size))
                 for it in items]
        got = _gather_encoded(codec, flats, items, gather, rkey, n)
        sent = sum(it.words for it in items)
        vals = _fallback_cond(
            codec, lambda: codec.payload_overflow(got[:, :sent]), lambda: _decode_items(codec, got, items),
            lambda: _decode_items(codec.fallback, _gather_encoded(codec.fallback, flats, items, gather, None, n),
                                  items))
        for it, v in zip(items, vals):
            out[it.index] = from_float32(v, it.dtype).reshape((n * it.shape[0],) + it.shape[1:])
    return jax.tree_util.tree_unflatten(treedef, out)


def _gather_encoded(codec, flats, items, gather, rkey, n):
    """``[N, gathered_width(W, N)]``: every replica's encoded leaves (replica ``r``'s words
    in row ``r``; the words past ``W`` are padding)."""
    words, start = [], 0
    for flat, it in zip(flats, items):
        words.append(encode_rows(codec, flat[None], rkey, start=start)[0])
        start += it.padded
    # Padded as compressed_mean pads its gathered rows (only while they take at most
    # GATHER_PAD_MAX_BYTES: beyond, the padded row costs more HBM traffic on a TPU than the
    # all-reduce it avoids; int8 ZeRO on v5e, one-off compiles: GPT-2 11.1 GB padded, 9.5
    # GB not; the MLP 1,592 and 1,199 MB). Gathered as one vector: a [1, W] row gathers
    # into [N, 1, W] lane rows, which a TPU then copies into (8, 128) tiles before the
    # leaves are sliced out of it.
    row = join_rows(words, lambda w: gathered_width(w, n))
    return gather(row).reshape(n, row.shape[0])


def _decode_items(codec, got, items):
    """Each item's ``[N, size]`` values from the gathered ``[N, W]`` words of ``codec``."""
    vals, off = [], 0
    for it in items:
        words = codec.payload_words(it.padded)
        vals.append(decode_rows(codec, got[:, off:off + words], it.padded)[:, :it.size])
        off += words
    return vals



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



def _scatter_impl(tree, axis_name, codec, key, residual, divide: int = 1):
    """``reduce_scatter`` over one axis, the sum divided by ``divide`` (each value before it
    is added); returns ``(out, new_residual or None)``."""
    n = _compat.axis_size(axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    res_leaves = None if residual is None else jax.tree_util.tree_leaves(residual)

    def scatter(v):
        # Booleans are counted in int32, as lax.psum (and all_reduce) sums them: XLA has no
        # boolean sum, and lax.psum_scatter refuses them.
        v = _vary_out(v.astype(jnp.int32) if v.dtype == jnp.bool_ else v, axis_name)
        return scatter_flat(v, axis_name, n) if v.ndim == 1 else lax.psum_scatter(v, axis_name, tiled=True)

    def exact(v):
        return scatter(v) if divide == 1 else unscale_mean(scatter(prescale(v, divide)), divide)

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
        words = join_rows(_encode_chunks(codec, leaves, res_leaves, new_res, items, n,
                                         replica_key(codec, key, axis_name, "reduce_scatter")))
        got = _compat.all_to_all(words, axis_name)  # [N, shard_width(W)]

        def raw():  # the same values (encoded from the same x + residual) in the fallback
            fb = codec.fallback
            fb_words = _encode_chunks(fb, leaves, res_leaves, None if res_leaves is None else list(res_leaves),
                                      [it._replace(words=fb.payload_words(it.padded)) for it in items], n, None)
            return _sum_items(fb, _compat.all_to_all(join_rows(fb_words), axis_name),
                              items, divide)

        sent = sum(it.words for it in items)
        totals = _fallback_cond(codec, lambda: _overflow_anywhere(codec, words[:, :sent], axis_name),
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
