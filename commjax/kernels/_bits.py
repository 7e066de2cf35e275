"""The packing of [`commjax.packing`][] for one tile of rows, as kernel bodies compute it.

A tile's rows are whole blocks of ``B`` codes. Widths that divide 32 are packed as lane
slices (word ``w`` holds codes ``w + j W``, ``W = B bits / 32``): shifts and ORs of ``k``
contiguous slices of the row. Other widths keep the bit planes (each plane word the sum of
``bit << lane`` over a group of 32 lanes; distinct bit positions: the sum is an OR and
cannot carry). Only 32-bit integer arithmetic is used (Mosaic TPU reduces signed integers
only: bit 31 makes a word negative, and two's-complement addition of distinct bits is
still their OR).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from commjax.packing import packed_words, sliced

__all__ = ["pack_tile", "unpack_tile"]


def pack_tile(codes: jax.Array, bits: int) -> jax.Array:
    """``uint32[T, B] -> uint32[T, packed_words(B, bits)]``."""
    t, b = codes.shape
    c = lax.bitcast_convert_type(codes.astype(jnp.uint32), jnp.int32)
    if sliced(bits):
        w = packed_words(b, bits)
        out = c[:, :w]
        for j in range(1, 32 // bits):
            out = out | lax.shift_left(c[:, j * w:(j + 1) * w], jnp.int32(bits * j))
        return lax.bitcast_convert_type(out, jnp.uint32)
    w = b // 32
    c = c.reshape(t, w, 32)
    lane = lax.broadcasted_iota(jnp.int32, (t, w, 32), 2)
    planes = []
    for k in range(bits):
        bit = lax.shift_right_logical(c, jnp.int32(k)) & jnp.int32(1)
        planes.append(jnp.sum(lax.shift_left(bit, lane), axis=2, dtype=jnp.int32))
    words = planes[0] if bits == 1 else jnp.concatenate(planes, axis=1)
    return lax.bitcast_convert_type(words, jnp.uint32)


def unpack_tile(words: jax.Array, bits: int, block: int) -> jax.Array:
    """``uint32[T, packed_words(B, bits)] -> uint32[T, B]``: the codes of each row."""
    t = words.shape[0]
    words = words.astype(jnp.uint32)
    if sliced(bits):
        mask = jnp.uint32((1 << bits) - 1)
        return jnp.concatenate([(words >> jnp.uint32(bits * j)) & mask for j in range(32 // bits)],
                               axis=1)[:, :block]
    w = block // 32
    lane = lax.broadcasted_iota(jnp.uint32, (t, w, 32), 2)
    codes = jnp.zeros((t, w, 32), jnp.uint32)
    for k in range(bits):
        plane = words[:, k * w:(k + 1) * w]
        bit = (jnp.broadcast_to(plane[:, :, None], (t, w, 32)) >> lane) & jnp.uint32(1)
        codes = codes | (bit << jnp.uint32(k))
    return codes.reshape(t, block)
