"""Bit-plane packing of one tile of rows, as kernel bodies compute it.

The same wire format as [`commjax.packing`][] (bit ``j`` of word ``w`` of plane ``k`` is
bit ``k`` of code ``32 w + j``), written for a tile whose rows are whole blocks of
``B = 32 W`` codes: a row is viewed as ``W`` groups of 32 lanes, and each plane word is
the sum of ``bit << lane`` over its group (distinct bit positions: the sum is an OR and
cannot carry). Only 32-bit integer arithmetic is used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["pack_tile", "unpack_tile"]


def pack_tile(codes: jax.Array, bits: int) -> jax.Array:
    """``uint32[T, 32 W] -> uint32[T, bits * W]`` (planes side by side).

    The lane sums run in int32 (Mosaic TPU reduces signed integers only): bit 31 makes a
    word negative, and two's-complement addition of distinct bits is still their OR.
    """
    t, b = codes.shape
    w = b // 32
    c = lax.bitcast_convert_type(codes.astype(jnp.uint32), jnp.int32).reshape(t, w, 32)
    lane = lax.broadcasted_iota(jnp.int32, (t, w, 32), 2)
    planes = []
    for k in range(bits):
        bit = lax.shift_right_logical(c, jnp.int32(k)) & jnp.int32(1)
        planes.append(jnp.sum(lax.shift_left(bit, lane), axis=2, dtype=jnp.int32))
    words = planes[0] if bits == 1 else jnp.concatenate(planes, axis=1)
    return lax.bitcast_convert_type(words, jnp.uint32)


def unpack_tile(words: jax.Array, bits: int, block: int) -> jax.Array:
    """``uint32[T, bits * W] -> uint32[T, 32 W]``: the codes of each row."""
    t = words.shape[0]
    w = block // 32
    lane = lax.broadcasted_iota(jnp.uint32, (t, w, 32), 2)
    codes = jnp.zeros((t, w, 32), jnp.uint32)
    for k in range(bits):
        plane = words[:, k * w:(k + 1) * w].astype(jnp.uint32)
        bit = (jnp.broadcast_to(plane[:, :, None], (t, w, 32)) >> lane) & jnp.uint32(1)
        codes = codes | (bit << jnp.uint32(k))
    return codes.reshape(t, block)
