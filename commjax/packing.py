"""Packing small unsigned codes into uint32 words: the one sub-word format of commjax.

Widths that divide 32 (1, 2, 4, 8, 16 bits: every quantizer, sign, fp8-style bytes) are
packed as **lane slices**: a block of ``B`` codes is padded with zero codes to ``k W``
(``k = 32 / bits`` codes per word, ``W = ceil(B / k)`` words) and word ``w`` holds codes
``w, w + W, ..., w + (k - 1) W``, code ``j W + w`` in bits ``[j bits, (j + 1) bits)``::

    words[..., w] = sum_j codes[..., j W + w] << (bits j)

On accelerators each word is built from ``k`` contiguous slices of the block by shifts and
ORs alone: no reduction across lanes and no intermediate with a small minor dimension,
which a TPU pads to 128 lanes (bit planes of 32 lanes took 16x their bytes there). On CPU
the same words come from one reduction over the block viewed as ``[k, W]`` (and codes back
from one broadcast shift), which XLA's CPU backend fuses where it writes every slice out.
Sign bits: ``W = B / 32`` words, bit ``j`` of word ``w`` is element ``j W + w``.

Other widths (3, 5, 6, 7 and 9 to 15 bits: QSGD's levels, lossless deltas) are packed as
*bit planes*: ``bits`` planes of ``ceil(B / 32)`` words, bit ``j`` of word ``w`` of plane
``k`` is bit ``k`` of code ``32 w + j``.

Both cost ``bits * B / 32`` words when ``B`` is a multiple of 32. These functions are the
pure-jnp reference; the Pallas kernels of [`commjax.kernels`][] produce the same words
(``commjax.kernels._bits``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commjax import _compat

__all__ = ["sliced", "words_per_plane", "packed_words", "pack_codes", "unpack_codes", "pack_lane_rows",
           "unpack_lane_rows"]

_SHIFTS = np.arange(32, dtype=np.uint32)


def sliced(bits: int) -> bool:
    """Whether ``bits``-wide codes are packed as lane slices (``bits`` divides 32)."""
    return 32 % int(bits) == 0


def words_per_plane(block_size: int) -> int:
    """``ceil(block_size / 32)``: uint32 words that hold one bit of every code of a block."""
    return -(-int(block_size) // 32)


def packed_words(block_size: int, bits: int) -> int:
    """uint32 words per packed block: ``ceil(B / (32 / bits))`` (lane slices) or
    ``bits * ceil(B / 32)`` (bit planes)."""
    if sliced(bits):
        return -(-int(block_size) // (32 // int(bits)))
    return int(bits) * words_per_plane(block_size)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in [1, 16], got {bits}")


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """Pack ``codes[..., B]`` (unsigned, each ``< 2**bits``) into
    ``uint32[..., packed_words(B, bits)]``, one packed row per block (leading axes kept).
    Codes are masked to ``bits`` bits."""
    _check_bits(bits)
    codes = codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
    if not sliced(bits):
        return _pack_planes(codes, bits)
    k, w = 32 // bits, packed_words(codes.shape[-1], bits)
    if k * w != codes.shape[-1]:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, k * w - codes.shape[-1])])
    # The same words either way. On CPU the k slices of one array keep XLA from fusing the
    # codes' producer into them (the codes are written out as uint32: 67 MB of a sign step
    # of 13.7M parameters); a reduction over the k axis of [.., k, W] fuses it. A TPU pads
    # that array's minor W to 128 lanes, so accelerators OR the slices.
    return _compat.platform_dependent(codes, cpu=functools.partial(_pack_stacked, bits=bits, k=k),
                                  default=functools.partial(_pack_sliced, bits=bits, k=k))


def pack_lane_rows(codes: jax.Array, bits: int, block_size: int) -> jax.Array:
    """``pack_codes`` of blocks of ``block_size`` (a multiple of 128) given as lane rows
    ``uint32[n / 128, 128]`` (each block ``block_size / 128`` consecutive rows):
    ``uint32[n / block_size, packed_words]``, the same words. Slice ``j`` of a block
    (codes ``j W .. j W + W - 1``) is whole rows when ``W >= 128``, else part of one row.

    Slices of at least ``_SUM_MIN_WORDS`` words are shifted and summed over a major axis
    of the block (``_pack_rows_summed``): XLA's TPU compiler fuses that reduction into the
    loop that computes the codes, where it wrote the OR of ``k`` slices' codes out as one
    uint32 per element first and packed them in a loop of their own (v5e, 21M-parameter
    MLP: int8 1,073 -> 937 MB a step, int4 1,024 -> 835, fp8 1,207 -> 900). Sign's slices
    of 8 words keep the ORs: as an axis, 8 is padded to 128 lanes (4,029 MB against 942)."""
    k, m = 32 // bits, block_size // 128
    w = block_size // k
    c3 = codes.astype(jnp.uint32).reshape(-1, m, 128) & jnp.uint32((1 << bits) - 1)
    if w >= _SUM_MIN_WORDS:
        return _pack_rows_summed(c3, bits, k, w)
    out = None
    for j in range(k):
        p = j * w
        piece = (c3[:, p // 128:(p + w) // 128, :].reshape(-1, w) if w >= 128
                 else c3[:, p // 128, p % 128:p % 128 + w])
        piece = piece << jnp.uint32(bits * j) if j else piece
        out = piece if out is None else out | piece
    return out


#: Slices of a block's lane rows at least this many words wide are packed by a sum over
#: a major axis (``pack_lane_rows``).
_SUM_MIN_WORDS = 32


def _pack_rows_summed(c3: jax.Array, bits: int, k: int, w: int) -> jax.Array:
    """``pack_lane_rows`` of ``c3 = uint32[nb, m, 128]`` (masked codes) as one reduction:
    slice ``j`` is ``[nb, W / 128, 128]`` rows (``W >= 128``) or ``[nb, 1, W]`` of row
    ``j div (128 / W)`` at lane ``W (j mod (128 / W))``; shifted by ``bits j`` and summed
    (distinct bit positions: the sum is an OR, no carry). The same sum as ``_pack_stacked``
    but over views that keep the block's rows: summed over ``[nb, k, W]`` as on CPU, the
    v5e MLP's int8 step moved 1,152 MB and int4's 1,405 (937 and 835 through these views)."""
    if w >= 128:
        slices = c3.reshape(c3.shape[0], k, w // 128, 128)
        shifts = (np.arange(k, dtype=np.uint32) * bits).reshape(1, k, 1, 1)
        return jnp.sum(slices << jnp.asarray(shifts), axis=1, dtype=jnp.uint32).reshape(-1, w)
    m = c3.shape[1]
    slices = c3.reshape(c3.shape[0], m, 128 // w, w)
    shifts = (np.arange(k, dtype=np.uint32) * bits).reshape(1, m, 128 // w, 1)
    return jnp.sum(slices << jnp.asarray(shifts), axis=(1, 2), dtype=jnp.uint32)


def unpack_lane_rows(words: jax.Array, bits: int, block_size: int) -> jax.Array:
    """The inverse of [`pack_lane_rows`][commjax.packing.pack_lane_rows]:
    ``uint32[nb, packed_words] -> uint32[nb * block_size / 128, 128]``, each block's codes
    as its ``block_size / 128`` lane rows.

    Code ``p = 128 t + l`` of a block (row ``t``, lane ``l``) is bits ``[b j, b j + b)``
    of word ``p mod W`` with ``j = p div W``: every row is a lane-tiled copy of the
    block's words (or of ``128`` of them) shifted per lane, one broadcast and shift
    (interleaving the ``k`` unpacked slices into rows was a relayout on TPU)."""
    k, m = 32 // bits, block_size // 128
    w, nb = block_size // k, words.shape[0]
    t = np.arange(m)[:, None]
    lane = np.arange(128)[None, :]
    pos = 128 * t + lane  # [m, 128]: each lane row's codes' positions in the block
    shifts = jnp.asarray((bits * (pos // w)).astype(np.uint32))
    if w >= 128:
        src = words.reshape(nb, w // 128, 128)[:, (pos[:, 0] % w) // 128, :]  # [nb, m, 128]
    else:
        src = jnp.tile(words, (1, 128 // w))[:, None, :]  # lane l holds word l mod W
    codes = (src >> shifts[None]) & jnp.uint32((1 << bits) - 1)
    return codes.reshape(-1, 128)


def _pack_sliced(codes: jax.Array, *, bits: int, k: int) -> jax.Array:
    w = codes.shape[-1] // k
    out = codes[..., :w]
    for j in range(1, k):  # distinct bit positions: OR of shifted slices
        out = out | (codes[..., j * w:(j + 1) * w] << jnp.uint32(bits * j))
    return out


def _pack_stacked(codes: jax.Array, *, bits: int, k: int) -> jax.Array:
    codes = codes.reshape(codes.shape[:-1] + (k, codes.shape[-1] // k))
    shifted = codes << (jnp.arange(k, dtype=jnp.uint32) * jnp.uint32(bits))[:, None]
    # Distinct bit positions: the sum is an OR, no carry.
    return jnp.sum(shifted, axis=-2, dtype=jnp.uint32)


def unpack_codes(words: jax.Array, bits: int, block_size: int) -> jax.Array:
    """Inverse of [`pack_codes`][commjax.packing.pack_codes]: ``uint32[..., packed_words]
    -> uint32[..., block_size]``."""
    _check_bits(bits)
    w = packed_words(block_size, bits)
    if words.shape[-1] != w:
        raise ValueError(f"expected {w} words per block for bits={bits}, block_size={block_size}; "
                         f"got {words.shape[-1]}")
    words = words.astype(jnp.uint32)
    if not sliced(bits):
        return _unpack_planes(words, bits, block_size)
    # The same codes either way. XLA's CPU backend writes each of the k slices out and then
    # concatenates them (sign: 32 slices, 1.2 GB more per step of a 13.7M-parameter model);
    # a [.., k, W] array from one broadcast shift is a single fusion there. A TPU pads that
    # array's minor W (8 for sign) to 128 lanes, so accelerators keep the concatenation.
    return _compat.platform_dependent(words, cpu=functools.partial(_unpack_stacked, bits=bits),
                                  default=functools.partial(_unpack_sliced, bits=bits))[..., :block_size]


def _unpack_sliced(words: jax.Array, *, bits: int) -> jax.Array:
    mask = jnp.uint32((1 << bits) - 1)
    return jnp.concatenate([(words >> jnp.uint32(bits * j)) & mask for j in range(32 // bits)], axis=-1)


def _unpack_stacked(words: jax.Array, *, bits: int) -> jax.Array:
    k = 32 // bits
    shifts = (jnp.arange(k, dtype=jnp.uint32) * jnp.uint32(bits))[:, None]
    codes = (words[..., None, :] >> shifts) & jnp.uint32((1 << bits) - 1)  # [..., k, W]
    return codes.reshape(words.shape[:-1] + (k * words.shape[-1],))  # code j W + w


def _pack_planes(codes: jax.Array, bits: int) -> jax.Array:
    block = codes.shape[-1]
    w = words_per_plane(block)
    pad = w * 32 - block
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, pad)])
    codes = codes.reshape(codes.shape[:-1] + (w, 32))
    shifts = jnp.asarray(_SHIFTS)
    # Every plane from ONE variadic reduction: each code is computed once and feeds all
    # the planes. Distinct bit positions: the sum is an OR, no carry.
    spread = [((codes >> jnp.uint32(k)) & jnp.uint32(1)) << shifts for k in range(bits)]
    planes = lax.reduce(spread, [jnp.uint32(0)] * bits,
                        lambda a, b: [x | y for x, y in zip(a, b)], (codes.ndim - 1,))
    return jnp.concatenate(planes, axis=-1) if bits > 1 else planes[0]


def _unpack_planes(words: jax.Array, bits: int, block_size: int) -> jax.Array:
    w = words_per_plane(block_size)
    words = words.reshape(words.shape[:-1] + (bits, w, 1))
    bitvals = (words >> jnp.asarray(_SHIFTS)) & jnp.uint32(1)  # [..., bits, w, 32]
    weights = (jnp.uint32(1) << jnp.arange(bits, dtype=jnp.uint32)).reshape(bits, 1, 1)
    codes = jnp.sum(bitvals * weights, axis=-3, dtype=jnp.uint32)  # [..., w, 32]
    codes = codes.reshape(codes.shape[:-2] + (w * 32,))
    return codes[..., :block_size]
