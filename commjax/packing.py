"""Bit-plane packing of small unsigned codes into uint32 words.

Every sub-word payload in commjax is packed the same way, so that one format serves
every bit width from 1 to 16 and every block size:

A block of ``B`` codes, each ``bits`` wide, is padded with zero codes to
``W * 32`` elements (``W = ceil(B / 32)``) and stored as ``bits`` *planes* of ``W``
words. Bit ``j`` of word ``w`` of plane ``k`` is bit ``k`` of code ``32 * w + j``::

    words[..., k, w] = sum_j ((codes[..., 32 w + j] >> k) & 1) << j

The 1-bit case is the classic "32 signs per uint32 word". A block costs
``bits * ceil(B / 32)`` words: no waste when ``B`` is a multiple of 32.

These functions are the pure-jnp reference; the Pallas kernels in
[`commjax.kernels`][] produce the same words bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["words_per_plane", "packed_words", "pack_codes", "unpack_codes"]

_SHIFTS = np.arange(32, dtype=np.uint32)


def words_per_plane(block_size: int) -> int:
    """``ceil(block_size / 32)``: uint32 words that hold one bit of every code of a block."""
    return -(-int(block_size) // 32)


def packed_words(block_size: int, bits: int) -> int:
    """uint32 words per packed block: ``bits * ceil(block_size / 32)``."""
    return int(bits) * words_per_plane(block_size)


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """Pack ``codes[..., B]`` (unsigned, each ``< 2**bits``) into ``uint32[..., bits * W]``.

    Leading axes are kept (one packed row per block). Codes are masked to ``bits`` bits.
    """
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in [1, 16], got {bits}")
    codes = codes.astype(jnp.uint32)
    block = codes.shape[-1]
    w = words_per_plane(block)
    pad = w * 32 - block
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    codes = codes.reshape(codes.shape[:-1] + (w, 32))
    shifts = jnp.asarray(_SHIFTS)
    # Every plane from ONE variadic reduction: each code is computed once and feeds all
    # the planes (one reduction per plane recomputed the codes, and the quantization
    # behind them, once per plane). Distinct bit positions: the sum is an OR, no carry.
    spread = [((codes >> jnp.uint32(k)) & jnp.uint32(1)) << shifts for k in range(bits)]
    planes = lax.reduce(spread, [jnp.uint32(0)] * bits,
                        lambda a, b: [x | y for x, y in zip(a, b)], (codes.ndim - 1,))
    return jnp.concatenate(planes, axis=-1) if bits > 1 else planes[0]


def unpack_codes(words: jax.Array, bits: int, block_size: int) -> jax.Array:
    """Inverse of [`pack_codes`][commjax.packing.pack_codes]: ``uint32[..., bits * W] ->
    uint32[..., block_size]``."""
    w = words_per_plane(block_size)
    if words.shape[-1] != bits * w:
        raise ValueError(
            f"expected {bits * w} words per block for bits={bits}, "
            f"block_size={block_size}; got {words.shape[-1]}"
        )
    words = words.astype(jnp.uint32).reshape(words.shape[:-1] + (bits, w, 1))
    bitvals = (words >> jnp.asarray(_SHIFTS)) & jnp.uint32(1)  # [..., bits, w, 32]
    weights = (jnp.uint32(1) << jnp.arange(bits, dtype=jnp.uint32)).reshape(bits, 1, 1)
    codes = jnp.sum(bitvals * weights, axis=-3, dtype=jnp.uint32)  # [..., w, 32]
    codes = codes.reshape(codes.shape[:-2] + (w * 32,))
    return codes[..., :block_size]
