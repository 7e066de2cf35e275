"""Flat buckets: joining many leaves into one vector without a slow copy.

Every exchange in commjax works on one flat float32 *bucket* built from many gradient
leaves, and turns the bucket back into leaves afterwards. The obvious
``jnp.concatenate([jnp.ravel(g) for g in leaves])`` is correct but, on XLA:CPU, is compiled
to a loop that works out, for every element, which part and which index it comes from,
several times slower than joining ``[rows, W]`` blocks along axis 0, where each row comes
whole from one part and the same bytes land in the same places.

``row_width`` picks ``W``: the largest power of two up to ``MAX_ROW_WIDTH`` that
divides every part's length (then every offset is a whole number of rows too). When the
lengths share no such factor the bucket falls back to the one-dimensional concatenation.
The result is bit-for-bit the same either way.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from commjax import _compat

__all__ = ["MAX_ROW_WIDTH", "row_width", "concat", "as_rows", "cut", "tiled", "tile_sharded", "ravel_tiles",
           "unravel_tiles", "ravel_leaf", "unravel_leaf", "ravel_shard", "unravel_shard"]

#: Widest row used to join parts; wider rows gain nothing measurable on CPU.
MAX_ROW_WIDTH = 1024


def row_width(lengths: Sequence[int], max_width: int = MAX_ROW_WIDTH) -> int:
    """Largest power of two ``<= max_width`` that divides every length (1 if none)."""
    g = 0
    for n in lengths:
        g = math.gcd(g, int(n))
    if g == 0:
        return max_width
    w = g & -g  # the largest power of two dividing all of them
    return min(w, max_width)


def as_rows(v: jax.Array, width: int) -> jax.Array:
    """A flat vector whose length is a multiple of ``width`` seen as ``[len // width, width]``."""
    return v.reshape(-1, width)


def concat(parts: Sequence[jax.Array]) -> jax.Array:
    """``jnp.concatenate`` of 1-D arrays, joined as whole rows where the lengths allow."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    w = row_width([p.shape[0] for p in parts])
    if w == 1:
        return jnp.concatenate(parts)
    return jnp.concatenate([as_rows(p, w) for p in parts], axis=0).reshape(-1)


def cut(v: jax.Array, segments: Sequence[Any]) -> list[jax.Array]:
    """The inverse of joining: each segment's own ``v[offset:offset + size]`` (its padding
    dropped), for segments such as [`commjax.compressors.base.Segment`][]."""
    return [v[s.offset:s.offset + s.size] for s in segments]


# ------------------------------------------------------------------ a leaf as a flat part


def tiled(shape: Sequence[int]) -> bool:
    """Whether a TPU lays the leaf out in whole ``(8, 128)`` tiles of its two minor axes."""
    return len(shape) >= 2 and shape[-2] % 8 == 0 and shape[-1] % 128 == 0


def tile_sharded(shape: Sequence[int], shard: int, num_shards: int) -> bool:
    """Whether cutting a leaf of ``shape`` row-major into ``num_shards`` shards of ``shard``
    elements cuts it into whole groups of 8 rows of its ``(8, 128)`` tiles, without
    padding. Then the leaf's tile order (``ravel_tiles``) is its shards' tile orders one
    after the other (``ravel_shard``): a sharded collective can carry the leaf in the order
    a TPU stores it."""
    shape = tuple(shape)
    return (tiled(shape) and num_shards * shard == math.prod(shape)
            and shard % (8 * shape[-1]) == 0)


def ravel_tiles(a: jax.Array) -> jax.Array:
    """``a`` flat in the order of its ``(8, 128)`` tiles (row-major over the tiles, then
    row-major inside each): ``a[..., 8 i + s, 128 j + l]`` at position
    ``((t * R/8 + i) * C/128 + j) * 1024 + 128 s + l``; row-major where the two minor axes
    are not whole tiles."""
    if not tiled(a.shape):
        return a.reshape(-1)
    r, c = a.shape[-2:]
    return a.reshape(-1, r // 8, 8, c // 128, 128).transpose(0, 1, 3, 2, 4).reshape(-1)


def unravel_tiles(v: jax.Array, shape: Sequence[int]) -> jax.Array:
    """The inverse of ``ravel_tiles``."""
    shape = tuple(shape)
    if not tiled(shape):
        return v.reshape(shape)
    r, c = shape[-2:]
    return v.reshape(-1, r // 8, c // 128, 8, 128).transpose(0, 1, 3, 2, 4).reshape(shape)


def ravel_leaf(a: jax.Array) -> jax.Array:
    """A gradient leaf as the flat part the codecs encode, in the order its bytes lie in
    memory: on TPU the tile order of ``ravel_tiles``, a
    bitcast there; row-major elsewhere.

    Why: a TPU stores a 2-D ``f32[R, C]`` in ``(8, 128)`` tiles and a flat vector in runs
    of 1024, so a row-major ``ravel`` is a transpose of every leaf, written out, and its
    inverse another (with the residual added in either order, several per step: the v5e
    bf16 mean of a 21M-parameter MLP moved 1515 MB against 1044 MB in tile order,
    ``benchmarks/aot.py``). On GPU and CPU the tile order would be the transpose
    (+168 MB on the H100 MLP). Which elements share a codec block therefore depends on
    the backend; each replica of a run encodes and decodes in the same order, and the
    worker residuals are kept in the leaves' shapes, which mean the same on every backend.
    """
    return _by_layout(a, ravel_tiles, lambda v: v.reshape(-1))


def unravel_leaf(v: jax.Array, shape: Sequence[int]) -> jax.Array:
    """The inverse of ``ravel_leaf``: ``v`` in ``shape``."""
    shape = tuple(shape)
    return _by_layout(v, lambda u: unravel_tiles(u, shape), lambda u: u.reshape(shape))


def ravel_shard(v: jax.Array, shape: Sequence[int]) -> jax.Array:
    """A row-major shard ``v`` of a leaf of ``shape`` (``tile_sharded``) in the order
    ``ravel_leaf`` gives the leaf: on TPU the tile order of its rows (a relayout of the
    shard alone), row-major elsewhere."""
    return ravel_leaf(v.reshape(-1, tuple(shape)[-1]))


def unravel_shard(v: jax.Array, shape: Sequence[int]) -> jax.Array:
    """The inverse of ``ravel_shard``: the shard row-major."""
    c = tuple(shape)[-1]
    return unravel_leaf(v, (v.shape[0] // c, c)).reshape(-1)


def _by_layout(x: Any, tiled_fn: Any, flat_fn: Any) -> Any:
    """``tiled_fn(x)`` when lowered for TPU, ``flat_fn(x)`` elsewhere: the one switch
    between the two memory orders (tests force the TPU's on CPU)."""
    return _compat.platform_dependent(x, tpu=tiled_fn, default=flat_fn)
