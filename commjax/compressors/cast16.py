"""16-bit floats on the wire: ``cast``, raw (two per word) or through the lossless code."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat
from commjax.compressors.base import BlockCompressor
from commjax.compressors.lossless import Lossless, lossless
from commjax.packing import pack_codes, pack_lane_rows, unpack_codes, unpack_lane_rows
from commjax.validation import check_dtype

__all__ = ["Cast", "cast"]

_CAST_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
#: Elements per block: 128 words of two values each.
_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class Cast(BlockCompressor):
    """Round to a 16-bit float (round-to-nearest-even) and send two values per uint32 word
    (blocks of 256 values: word ``w`` holds values ``w`` and ``w + 128``).

    Finite values saturate at the type's largest (``float16`` +-65504, ``bfloat16``
    +-3.3895e38: float32 values above it would round to infinity) instead of overflowing;
    with error feedback the clipped excess is carried to the next step.

    Bytes: ``2 n`` per replica payload. Reduced by the two-phase reducer (all-to-all of
    words, fp32 sums, re-rounding, all-gather), so the sum never accumulates in 16 bits.
    """

    dtype_name: str = "bfloat16"
    #: Values per block (even): word ``w`` holds values ``w`` and ``w + block_size / 2``.
    #: 256 keeps both halves lane-aligned on TPU; sparse payloads of a few values use 2.
    block_size: int = _BLOCK
    name: ClassVar[str] = "cast"
    linear: ClassVar[bool] = True

    @property
    def dtype(self) -> Any:
        return _CAST_DTYPES[self.dtype_name]

    @property
    def block(self) -> int:
        return self.block_size

    @property
    def row_words(self) -> int:
        return self.block_size // 2

    def _round(self, x: jax.Array) -> jax.Array:
        """Round to the 16-bit type, finite values saturating at its largest (65504, or
        bfloat16's 3.3895e38, beyond which float32 values would round to infinity);
        infinities and NaN stay what they are (flagged)."""
        top = float(jnp.finfo(self.dtype).max)
        return jnp.where(jnp.isinf(x), x, jnp.clip(x, -top, top)).astype(self.dtype)

    def encode_blocks(self, blocks, key, start=0):
        """Word ``w`` of a block holds value ``w`` in its low half and ``w + B / 2`` in its
        high half: two lane-aligned slices at the default ``B = 256`` (pairs of adjacent values would need a
        ``[n / 2, 2]`` view, which a TPU pads to 128 lanes: 64x its bytes)."""
        half = lax.bitcast_convert_type(self._round(blocks), jnp.uint16)
        if self.block_size % 128:
            return pack_codes(half, 16)
        return _compat.platform_dependent(half, tpu=pack_halves_lane_rows, default=lambda h: pack_codes(h, 16))

    def decode_blocks(self, rows):
        if self.block_size % 128:
            codes = unpack_codes(rows, 16, self.block_size)
        else:  # see pack_halves_lane_rows
            codes = _compat.platform_dependent(rows, tpu=unpack_halves_lane_rows,
                                           default=lambda r: unpack_codes(r, 16, self.block_size))
        return lax.bitcast_convert_type(codes.astype(jnp.uint16), self.dtype).astype(jnp.float32)

    def encode_and_decode(self, x, key, segments=None, *, start: int = 0):
        """``decode(encode(x))`` is ``x`` rounded (packing is lossless): taken from ``x``
        itself, not unpacked from the words, so the rounding fuses with what reads it."""
        return self.encode(x, key, segments, start=start), self._round(x).astype(jnp.float32)

    def encode_linear(self, x, key):
        return self._round(x)

    def decode_linear(self, summed, n):
        return summed.astype(jnp.float32)

    def linear_payload_bytes(self, n: int) -> int:
        return 2 * n


def pack_halves_lane_rows(half: jax.Array) -> jax.Array:
    """``pack_codes(half, 16)`` of 16-bit codes ``[blocks, B]`` (``B`` a multiple of 128)
    through lane rows ``[n / 128, 128]``, the flat vector's own layout on TPU, where the
    ``[blocks, B]`` view is a relayout of every value (v5e bf16 mean of a 21M-parameter
    MLP: 1044 -> 932 MB of HBM traffic). Value ``w`` and ``w + B / 2`` of a block lie in
    the same lane of rows ``B / 256`` apart. The same words."""
    return pack_lane_rows(half.reshape(-1, 128), 16, half.shape[1])


def unpack_halves_lane_rows(rows: jax.Array) -> jax.Array:
    """The inverse of ``pack_halves_lane_rows``: ``uint32[blocks, B / 2] -> [blocks, B]``."""
    block = 2 * rows.shape[1]
    return unpack_lane_rows(rows, 16, block).reshape(rows.shape[0], block)


def cast(dtype: Any = jnp.bfloat16, *, wire: str = "raw",
         kernels: Optional[str] = None) -> Union[Cast, Lossless]:
    """16-bit floats on the wire: ``dtype`` is ``jnp.bfloat16`` or ``jnp.float16``.

    Values: round-to-nearest-even, so ``|decode(encode(x)) - x| <= 2**-8 |x|`` for
    bfloat16 (``2**-11 |x|`` for float16 within its range).

    Wire format (``wire``):

    * ``"raw"``: two 16-bit patterns per uint32 word, 16 bits per element.
    * ``"lossless"`` (bfloat16 only): the same bfloat16 values through the fixed-rate
      lossless code of [`commjax.lossless`][] (base exponent per block, 4-bit exponent
      deltas, sign and mantissa raw): 12.375 bits per element, 0.77x of raw. Every
      replica receives exactly what ``"raw"`` gives (bit for bit; NaN payloads are kept
      rather than quieted); a step where some replica's block overflows its escapes
      sends the raw words as well, so its bytes are the coded payload plus the raw one.
      The value returned is ``cj.lossless(jnp.bfloat16)``. Reducers ``"allgather"`` and
      ``"two_phase"``, as for raw (a 16-bit payload is never summed by ``psum``).

    ``kernels`` picks the lossless encoder's implementation (as for
    [`commjax.quantize`][]); the raw format has no kernel.

    Example::

        tx = optax.chain(cj.compressed_mean(cj.cast(jnp.bfloat16, wire="lossless"), "data"),
                         optax.sgd(0.1))
    """
    name = check_dtype("dtype", dtype, tuple(_CAST_DTYPES), factory="cast",
                       hint="For fewer bits use cj.quantize(bits=8|4|2).").name
    if wire not in ("raw", "lossless"):
        raise ValueError(f"cast: `wire` must be 'raw' or 'lossless', got {wire!r}.")
    if wire == "lossless":
        if name != "bfloat16":
            raise ValueError(
                f"cast: wire='lossless' codes bfloat16 only, got dtype={name}; use "
                "cast(jnp.bfloat16, wire='lossless'), or wire='raw' for float16.")
        return lossless(jnp.bfloat16, kernels=kernels)
    if kernels is not None:
        raise ValueError("cast: `kernels` applies to wire='lossless' only (the raw format has "
                         "no kernel); drop it or pass wire='lossless'.")
    return Cast(dtype_name=name)
