"""Fixed-rate lossless compression of bfloat16 payloads: ``lossless``.

Training traffic in bfloat16 carries far fewer bits than it occupies, mostly in the
8-bit exponent: within a block of neighbouring values the exponents span a few binades.
XLA collectives need static shapes, so this is a *fixed-rate* code (layout and maths in
``commjax.kernels.lossless``): per block of ``B`` values one base exponent (the
block's largest) and a 4-bit offset below it per group of 32 values, a
``delta_bits``-bit distance below its group's reference per value (one code reserved for
zeros and subnormals), the sign and mantissa raw, and ``escapes`` slots of (index,
exponent) for values further below. Per element: ``8 + delta_bits + 32 (ceil((escapes +
1) / 2) + 1) / B`` bits: 12.375 (0.77 of bfloat16) at the defaults.

Exactness: a float32 input is first rounded to bfloat16 (to nearest even, the bits
[`commjax.cast`][] gives every non-NaN value), and every bfloat16 pattern (NaN
payloads, +-inf, subnormals, -0) decodes to itself:
[`bf16_bits`][commjax.compressors.lossless.bf16_bits] and
[`bf16_value`][commjax.compressors.lossless.bf16_value] convert with integer arithmetic, since XLA's
conversions quiet NaN
payloads. So ``decode(encode(x))`` is ``cast(bf16)``'s decode bit for bit (NaN aside),
and training with ``lossless()`` equals training with ``cast(jnp.bfloat16)`` through the
same reducer. It is also ``cast(jnp.bfloat16, wire="lossless")``: the wire format of
[`commjax.cast`][].

What a gather ([`commjax.collectives.all_gather`][], [`commjax.fsdp_gather`][]) hands
back, per leaf dtype (its leaves enter and leave through
[`to_float32`][commjax.compressors.lossless.to_float32] /
[`from_float32`][commjax.compressors.lossless.from_float32], exact both ways):

| leaf | ``lossless()`` | ``lossless(jnp.float32)`` |
|---|---|---|
| bfloat16 | every pattern | every pattern |
| float32 | rounded to bfloat16 (NaN: sign and top 7 payload bits, quieted if those are 0) | every pattern |
| float16 | rounded to bfloat16, back in float16: 3 of 10 mantissa bits lost, magnitudes from 65408 up become inf; NaN: top 7 of 10 payload bits | every pattern |
| float64, float8 | XLA's conversion to float32, then as float32 | XLA's conversion to float32 |

A mean or a sum (``compressed_mean``, ``reduce_scatter``, ``all_reduce``) adds every
replica's exact (bfloat16-rounded) values in fp32 and rounds the result to the leaf's
dtype; a NaN or an infinity on any replica makes it NaN. ``ppermute`` refuses this codec
(its fallback needs every replica of the axis to agree).

Escape overflow: when some block of some replica has more far-below exponents than
slots, its payload cannot be decoded. The reducers read each payload's overflow bits
([`Lossless.payload_overflow`][commjax.compressors.lossless.Lossless.payload_overflow]): an
all-gather reads them from the gathered payloads
(every replica holds the same words), an all-to-all sums them in one fp32 all-reduce
first; then every replica takes the same ``lax.cond`` branch and, on overflow, sends the
raw [`Lossless.fallback`][commjax.compressors.lossless.Lossless.fallback] payload as well (the
bfloat16 patterns, 16 bits each:
the bytes of ``cast(bf16)``). Such a step costs the coded payload plus the raw one; the
group references keep them rare (more ``escapes`` or ``delta_bits`` make them rarer
still, for more bytes).

Only payloads that are gathered or exchanged whole can be lossless (a sum cannot):
reducers ``"allgather"`` and ``"two_phase"`` (all-to-all, a fixed-order fp32 sum,
re-encoding, all-gather), and [`commjax.collectives.all_gather`][] /
``reduce_scatter`` (the traffic of [`commjax.zero`][]).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import jax
import jax.numpy as jnp
from jax import lax

from commjax import kernels as _kernels
from commjax.packing import pack_codes, unpack_codes
from commjax.compressors.base import BlockCompressor, Compressor, check_positive_int
from commjax.compressors.exact import Identity
from commjax.kernels.lossless import header_column, lossless_decode, lossless_encode, lossless_words
from commjax.validation import check_dtype, check_int

__all__ = ["Lossless", "RawBf16", "lossless", "bf16_bits", "bf16_value", "to_float32", "from_float32"]


def bf16_bits(x: jax.Array) -> jax.Array:
    """The bfloat16 pattern (in uint32) of float32 ``x``, rounded to nearest even as
    ``astype(jnp.bfloat16)`` does for every non-NaN value below bfloat16's largest
    (3.3895e38; a finite value above it saturates there, as [`commjax.cast`][] does);
    a NaN keeps its sign and top payload bits (quieted only if they are all zero, where
    truncation would give inf).
    Integer arithmetic, because XLA's conversion quiets or canonicalizes NaN payloads."""
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    top = b >> 16
    rounded = (b + 0x7FFF + (top & 1)) >> 16
    # A finite value above bfloat16's largest (3.3895e38) saturates there, as cast(bf16)
    # does, instead of rounding to infinity.
    rounded = jnp.where(((rounded & 0x7F80) == 0x7F80) & ((b & 0x7FFFFFFF) < 0x7F800000),
                        (top & 0x8000) | 0x7F7F, rounded)
    return jnp.where(nan, top | jnp.where((top & 0x7F) == 0, 0x40, 0).astype(jnp.uint32), rounded)


def bf16_value(h: jax.Array) -> jax.Array:
    """float32 of bfloat16 patterns ``h`` (uint32): exact for every pattern, NaN payloads
    included."""
    return lax.bitcast_convert_type(h << 16, jnp.float32)


def to_float32(x: jax.Array) -> jax.Array:
    """``x`` as float32, every bfloat16 and float16 pattern kept: bfloat16 by its bits
    (``h << 16``), float16 by XLA's conversion (exact for numbers) with its NaNs rebuilt
    from their bits (``s << 31 | 0x7F800000 | m << 13``: a conversion would quiet a
    signalling NaN). Other dtypes are converted (float64 rounds to float32)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        return bf16_value(lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32))
    if x.dtype == jnp.float16:
        h = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        nan = (h & 0x7FFF) > 0x7C00
        bits = (h & 0x8000) << 16 | 0x7F800000 | (h & 0x3FF) << 13
        return jnp.where(nan, lax.bitcast_convert_type(bits, jnp.float32), x.astype(jnp.float32))
    return x.astype(jnp.float32)


def from_float32(v: jax.Array, dtype: Any) -> jax.Array:
    """float32 ``v`` in ``dtype``, the inverse of
    [`to_float32`][commjax.compressors.lossless.to_float32] on what it returns: bfloat16
    by [`bf16_bits`][commjax.compressors.lossless.bf16_bits] (round to nearest even; a NaN
    keeps its sign and top payload bits), float16 by XLA's conversion with NaNs truncated
    by their bits (quieted only where the kept payload would be zero). XLA's own
    float32 -> bfloat16 conversion replaces every NaN by 0x7FC0."""
    dtype = jnp.dtype(dtype)
    v = jnp.asarray(v, jnp.float32)
    if dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(bf16_bits(v).astype(jnp.uint16), jnp.bfloat16)
    if dtype == jnp.float16:
        b = lax.bitcast_convert_type(v, jnp.uint32)
        m = (b >> 13) & 0x3FF
        bits = (b >> 16) & 0x8000 | 0x7C00 | jnp.where(m == 0, 0x200, m)
        nan = (b & 0x7FFFFFFF) > 0x7F800000
        return jnp.where(nan, lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16), v.astype(jnp.float16))
    return v.astype(dtype)


@dataclasses.dataclass(frozen=True)
class RawBf16(BlockCompressor):
    """bfloat16 patterns, two per word:
    [`Lossless.fallback`][commjax.compressors.lossless.Lossless.fallback]. The values of
    ``cast(bf16)``, converted with [`bf16_bits`][commjax.compressors.lossless.bf16_bits] /
    [`bf16_value`][commjax.compressors.lossless.bf16_value] so that NaN
    payloads survive as they do in the lossless code."""

    block_size: int = 256
    name: ClassVar[str] = "raw_bf16"

    @property
    def block(self) -> int:
        return self.block_size

    @property
    def row_words(self) -> int:
        return self.block_size // 2

    def encode_blocks(self, blocks, key, start=0):
        # Word w of a block holds values w and w + block/2 (packing's lane slices): not
        # adjacent pairs, whose [n, 2] view a TPU pads to 128 lanes (64x its bytes).
        return pack_codes(bf16_bits(blocks), 16)

    def decode_blocks(self, rows):
        return bf16_value(unpack_codes(rows, 16, self.block_size))


@dataclasses.dataclass(frozen=True)
class Lossless(BlockCompressor):
    """bfloat16 values as base exponent + exponent deltas + raw sign/mantissa + escapes
    (see [`lossless`][commjax.compressors.lossless.lossless]); float32 as that code of its top 16
    bits + its low 16 bits
    raw. ``kernels`` picks the encoder's implementation."""

    block_size: int = 256
    delta_bits: int = 4
    escapes: int = 3
    dtype_name: str = "bfloat16"
    kernels: Optional[str] = dataclasses.field(default=None, kw_only=True)
    name: ClassVar[str] = "lossless"

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        """float32 on the wire: decode(encode(x)) == x for every float32 ``x`` (error
        feedback then keeps no residual). bfloat16: exact after the rounding to bf16."""
        return self.dtype_name == "float32"

    @property
    def block(self) -> int:
        return self.block_size

    @property
    def _coded_words(self) -> int:
        return lossless_words(self.block_size, self.delta_bits, self.escapes)

    @property
    def row_words(self) -> int:
        return self._coded_words + (self.block_size // 2 if self.lossless else 0)

    @property
    def fallback(self) -> Compressor:
        """What travels when some payload overflows its escapes: the same values raw,
        [`RawBf16`][commjax.compressors.lossless.RawBf16] (the bytes of ``cast(bf16)``) or fp32
        words (``identity()``)."""
        return Identity() if self.lossless else RawBf16(self.block_size)

    def encode_blocks(self, blocks, key, start=0):
        if not self.lossless:
            return lossless_encode(bf16_bits(blocks), delta_bits=self.delta_bits,
                                   escapes=self.escapes, impl=self.kernels)
        bits = lax.bitcast_convert_type(blocks.astype(jnp.float32), jnp.uint32)
        coded = lossless_encode(bits >> 16, delta_bits=self.delta_bits, escapes=self.escapes,
                                impl=self.kernels)
        # Word w: the low halves of values w and w + block/2 (packing's lane slices).
        return jnp.concatenate([coded, pack_codes(bits & 0xFFFF, 16)], axis=1)

    def decode_blocks(self, rows):
        high = lossless_decode(rows[:, :self._coded_words], block_size=self.block_size,
                               delta_bits=self.delta_bits, escapes=self.escapes)
        if not self.lossless:
            return bf16_value(high)
        low = unpack_codes(rows[:, self._coded_words:], 16, self.block_size)
        return lax.bitcast_convert_type(high << 16 | low, jnp.float32)

    def _values(self, x: jax.Array) -> jax.Array:
        """What ``x`` decodes to: itself (float32) or its bfloat16 rounding."""
        x = x.astype(jnp.float32)
        return x if self.lossless else bf16_value(bf16_bits(x))

    def encode_and_decode(self, x, key, segments=None, *, start: int = 0):
        """``(encode(x), values)``: the decoded values are the bfloat16 rounding itself
        (float32: ``x``), which is what a payload decodes to, and what the fallback carries
        where a block overflowed (its coded words would not decode): error feedback stays
        exact."""
        return self.encode(x, key, segments, start=start), self._values(x)

    def roundtrip(self, x: jax.Array, key: Optional[jax.Array] = None) -> jax.Array:
        """What every replica receives for ``x`` (any shape, float dtype), exact even where
        a block would overflow (the fallback carries it)."""
        x = jnp.asarray(x)
        return from_float32(self._values(to_float32(jnp.ravel(x))), x.dtype).reshape(x.shape)

    def _headers(self, words: jax.Array) -> jax.Array:
        rows = words.reshape(-1, self.row_words)
        return rows[:, header_column(self.block_size, self.delta_bits)] & 0xFFFF

    def payload_overflow(self, words: jax.Array) -> jax.Array:
        """Whether some block of ``words`` (any leading shape) overflowed its escapes: then
        it does not decode, and the reducers send ``fallback`` instead."""
        return jnp.any((self._headers(words) >> 8) != 0)

    def payload_finite(self, words):
        """Finite iff no block's base exponent is 255 (the exponent of inf and NaN); read
        from the header words, right even for a block that overflowed."""
        return jnp.all((self._headers(words) & 0xFF) != 0xFF)


def lossless(dtype: Any = jnp.bfloat16, block_size: int = 256, delta_bits: int = 4,
             escapes: int = 3, *, kernels: Optional[str] = None) -> Lossless:
    """Fixed-rate lossless code of bfloat16 payloads: ``cast(bf16)``'s values in fewer bits.

    Per block of ``block_size`` values: the largest exponent ``b`` and, per group of 32
    values, a reference ``r = b - min(b - group max, 15)``; per value a
    ``delta_bits``-bit code, ``r - e`` for an exponent ``e`` within ``2**delta_bits - 2``
    binades of ``r`` or "zero/subnormal"; the sign and 7 mantissa bits raw; ``escapes``
    16-bit slots (index, exponent) for the values further below. Inputs are rounded to
    bfloat16 first (round-to-nearest-even, as [`commjax.cast`][]); from there the code
    is exact, for every bit pattern.

    Bits per element: ``8 + delta_bits + 32 (ceil((escapes + 1) / 2) + 1) / block_size``
    (12.375 at the defaults, 0.77 of bfloat16's 16). A payload with a block that has
    more than ``escapes`` far-below exponents on any replica travels as raw bfloat16 too,
    for that step (see the module docstring).

    Usable wherever payloads are gathered or exchanged whole: ``compressed_mean`` with
    ``reducer="allgather"`` or ``"two_phase"`` (the mean is summed in fp32 from the exact
    bfloat16 values), [`commjax.collectives.all_gather`][] and ``reduce_scatter``, and
    ``cj.zero(..., weight_codec=cj.lossless())``.

    Every bit pattern of a bfloat16 leaf comes back from a gather as it was; with
    ``dtype=jnp.float32`` every pattern of a bfloat16, float16 or float32 leaf does. What
    is kept of other dtypes: the module docstring's table.

    Args:
      dtype: ``jnp.bfloat16`` (inputs rounded to it; 12.375 bits per element) or
        ``jnp.float32`` (exact for every float32: its top 16 bits through this code, the
        low 16 raw; 28.375 bits per element, 0.89 of 32; ``lossless = True``, so error
        feedback keeps no residual).
      block_size: values per base exponent, a multiple of 32 in ``[32, 256]`` (an escape's
        index is one byte).
      delta_bits: bits of each exponent code, 1 to 7.
      escapes: escape slots per block, at least 1.
      kernels: the [`commjax.kernels`][] implementation of the encoder, as for
        [`commjax.quantize`][]; the bits do not depend on it.
    """
    dtype_name = check_dtype("dtype", dtype, ("bfloat16", "float32"), factory="lossless").name
    check_positive_int("block_size", block_size, factory="lossless")
    if block_size % 32 or block_size > 256:
        raise ValueError(f"lossless: `block_size` must be a multiple of 32 in [32, 256], got "
                         f"{block_size}; 256 compresses best.")
    check_int("delta_bits", delta_bits, 1, factory="lossless")
    if delta_bits > 7:
        raise ValueError(f"lossless: `delta_bits` must be in [1, 7], got {delta_bits}.")
    check_int("escapes", escapes, 1, factory="lossless")
    if escapes > block_size:
        raise ValueError(f"lossless: `escapes` must be at most block_size ({block_size}), got {escapes}.")
    _kernels.check_impl(kernels, "lossless", "kernels")
    return Lossless(block_size=block_size, delta_bits=delta_bits, escapes=escapes,
                    dtype_name=dtype_name, kernels=kernels)
