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

__all__ = ["MAX_ROW_WIDTH", "row_width", "concat", "as_rows", "cut"]

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
