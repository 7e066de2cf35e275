"""Blockwise scaled integer codecs: ``quantize`` (absmax), ``qsgd`` and ``terngrad``.

All three cut the vector into blocks of ``B`` elements, send one fp32 scale ``s`` per
block and one ``b``-bit code per element, packed into words ([`commjax.packing`][]).
A block costs ``b * ceil(B / 32) + 1`` uint32 words, i.e. ``b + 32 / B`` bits per element
when ``B`` is a multiple of 32.

Rounding of ``q = x / s * L`` to an integer level:

* nearest: ``round(q)``, so ``|x - x_hat| <= s / (2 L)`` (half a step);
* stochastic: ``floor(q + u)``, ``u ~ U[0, 1)`` independent per element and replica, so
  ``E[x_hat] = x`` (unbiased) and ``|x - x_hat| < s / L``.

All-zero blocks have ``s = 0`` and decode to exact zeros.

Encoding, error feedback and decoding run through [`commjax.kernels`][]; the codecs'
``kernels`` field picks the implementation (``None``: ``$COMMJAX_KERNELS``, else
``"auto"``) and never changes a bit of the result.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
from jax import lax

from commjax import kernels as _kernels
from commjax import noise
from commjax.compressors.base import BlockCompressor, check_choice, check_positive_int
from commjax.validation import check_bool, check_float
from commjax.kernels.reference import TINY, row_absmax, row_prescale, safe_recip
from commjax.packing import packed_words

__all__ = ["Quantize", "QSGD", "TernGrad", "quantize", "qsgd", "terngrad"]

_FMAX = float(jnp.finfo(jnp.float32).max)


def _uniforms(key: Optional[jax.Array], shape: tuple[int, ...], stochastic: bool, start: int = 0) -> Optional[jax.Array]:
    """The noise ``u ~ U[0, 1)`` of stochastic rounding, ``floor(q + u)`` (``None``: round
    to nearest). Counter-based ([`commjax.noise.uniform`][]): one value per element and
    step is needed, and Threefry cost more than the rest of the step on CPU."""
    if not stochastic:
        return None
    if key is None:
        raise ValueError("a stochastic compressor needs a PRNG key")
    return noise.uniform(key, shape, start=start)


def _noise(key: Optional[jax.Array], stochastic: bool, start: int = 0) -> dict:
    """``quantize_blocks``' noise arguments: the key of ``_uniforms``' numbers, which the
    references draw where XLA fuses them and the lane-row kernel draws in-kernel."""
    if stochastic and key is None:
        raise ValueError("a stochastic compressor needs a PRNG key")
    return dict(noise_key=key, noise_start=start) if stochastic else {}


def _round_levels(x: jax.Array, c: jax.Array, key: Optional[jax.Array], stochastic: bool,
                  start: int = 0) -> jax.Array:
    """``R(x * c)`` for a non-negative ``c``; the product is rounded to fp32 before the
    noise is added ([`commjax.kernels.fence`][]), as in the quantize kernel."""
    q = _kernels.fence(x * c, c)
    u = _uniforms(key, q.shape, stochastic, start)
    return jnp.round(q) if u is None else jnp.floor(q + u)


@dataclasses.dataclass(frozen=True)
class _ScaledCodec(BlockCompressor):
    """Shared layout: ``[packed codes | scale]`` per block, codes offset to be unsigned.

    ``kernels``: the implementation of [`commjax.kernels`][] this codec's encode and
    decode run (``None``: ``$COMMJAX_KERNELS``, else ``"auto"``). A field, so it is part
    of the codec's hash and of every trace that uses it.
    """

    block_size: int = 256
    kernels: Optional[str] = dataclasses.field(default=None, kw_only=True)

    @property
    def block(self) -> int:
        return self.block_size

    @property
    def bits(self) -> int:
        raise NotImplementedError

    @property
    def offset(self) -> int:
        """Signed level ``l`` travels as the unsigned code ``l + offset``."""
        raise NotImplementedError

    @property
    def row_words(self) -> int:
        return packed_words(self.block_size, self.bits) + 1

    def _pack(self, levels: jax.Array, scale: jax.Array) -> jax.Array:
        codes = (levels + self.offset).astype(jnp.uint32)
        words = _kernels.pack_codes(codes, self.bits, impl=self.kernels)
        scale_word = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
        return jnp.concatenate([words, scale_word[:, None]], axis=1)

    @property
    def divisor(self) -> Optional[int]:
        """A block decodes to ``(c - offset) * (scale / divisor)`` (``* scale`` if None)."""
        return None

    def _decode_options(self) -> dict:
        return dict(bits=self.bits, block_size=self.block_size, offset=self.offset,
                    divisor=self.divisor, impl=self.kernels)

    def payload_finite(self, words):
        """A block decodes to finite values iff its scale (its row's last word) is finite."""
        return self.scales_finite(words)

    def decode_blocks(self, rows):
        """Unpack + dequantize in one kernel pass ([`commjax.kernels.decode_rows`][]);
        each value rounded to fp32 (no multiply-add with what the caller does next)."""
        return _kernels.decode_rows(rows, **self._decode_options())

    def decode_sum(self, payloads: jax.Array, n: int, segments=None, *, divide: int = 1) -> jax.Array:
        """``sum_r decode(payloads[r], n)`` over the leading (replica) axis of
        ``uint32[N, payload_words(n)]``: what a reducer computes from the payloads it
        receives, in one fused kernel ([`commjax.kernels.decode_sum`][]).

        Summed in replica order in fp32 from zeros, each decoded value rounded to fp32
        before it is added (no fused multiply-add), so the result is the same with and
        without kernels and on every replica.
        """
        rows = payloads.reshape(payloads.shape[0], n // self.block, self.row_words)
        opts = self._decode_options()
        if divide != 1:  # folded into each block's step: values divided before the sum
            opts["divisor"] = (opts["divisor"] or 1) * int(divide)
        return _kernels.decode_sum(rows, **opts).reshape(n)


def _absmax_feedback(codec: _ScaledCodec, x, residual, key, start: int, *, levels: int,
                     stochastic: bool, midrise: bool = False):
    """``(encode(x + e), x + e - decode(encode(x + e)))`` of an absmax codec (quantize,
    unclipped TernGrad), flat in and out, from one [`commjax.kernels.quantize_blocks`][]
    pass with ``output="residual"``."""
    nb = x.shape[0] // codec.block
    rows, res = _kernels.quantize_blocks(
        x.reshape(nb, codec.block), bits=codec.bits, levels=levels, midrise=midrise, **_noise(key, stochastic, start),
        residual=residual.reshape(nb, codec.block), output="residual", impl=codec.kernels,
    )
    return rows.reshape(-1), res.reshape(-1)


def _clip_to_rms(blocks: jax.Array, clip: float) -> jax.Array:
    """Each row clipped to ``+-clip * rms(row)``, ``rms = sqrt(mean(x**2))``; rows with a
    NaN or an Inf pass unchanged (their absmax flags them, as without clipping).

    The RMS is ``amax * rms(x / amax)`` with the row first scaled by ``2**-64`` (huge) or
    ``2**64`` (tiny), so its squares neither overflow nor underflow and ``x / amax`` is
    a true quotient (XLA turns a division by a row constant into a product with its
    reciprocal, which is not finite past ``2**128``): clipping depends only on the
    row's shape, not its magnitude, over the whole float range."""
    amax = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)
    f = jnp.where(amax > 2.0 ** 64, 2.0 ** -64, jnp.where(amax < 2.0 ** -64, 2.0 ** 64, 1.0))
    unit = (blocks * f) / jnp.where(amax > 0, amax * f, 1.0)
    bound = jnp.float32(clip) * amax * jnp.sqrt(jnp.mean(jnp.square(unit), axis=1, keepdims=True))
    bound = jnp.where(jnp.isfinite(amax), jnp.minimum(bound, amax), jnp.inf)
    return jnp.clip(blocks, -bound, bound)


@dataclasses.dataclass(frozen=True)
class Quantize(_ScaledCodec):
    """Blockwise absmax quantization to ``bits`` in {8, 4, 2} (see
    [`quantize`][commjax.compressors.quantize.quantize])."""

    num_bits: int = 8
    stochastic_rounding: bool = True
    # Left out of the state's fingerprint while None: states made before the option
    # existed keep theirs (commjax.fingerprint.describe).
    clip_rms: Optional[float] = dataclasses.field(default=None, kw_only=True,
                                                  metadata={"fingerprint_if_set": True})
    midrise: bool = dataclasses.field(default=False, kw_only=True, metadata={"fingerprint_if_set": True})
    name: ClassVar[str] = "quantize"

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        return self.stochastic_rounding

    @property
    def bits(self) -> int:
        return self.num_bits

    @property
    def levels(self) -> int:
        """``L = 2**(bits-1) - 1``: codes are the integers ``-L..L``; midrise:
        ``K = 2**bits - 1``, the levels ``2 c - K`` for the codes ``c = 0..K``."""
        return 2 ** self.num_bits - 1 if self.midrise else 2 ** (self.num_bits - 1) - 1

    @property
    def offset(self) -> int:
        return self.levels

    @property
    def divisor(self) -> int:
        return self.levels

    def _decode_options(self) -> dict:
        return super()._decode_options() | {"step": 2 if self.midrise else 1}

    def encode_blocks(self, blocks, key, start=0):
        # scale = max |x|; l = clip(R(x * (L / scale)), -L, L); row = [pack(l + L) | scale]
        # (midrise: the codes of kernels.reference.grid_codes), fused in one kernel pass
        # (commjax.kernels.quantize_blocks, whose reference is exactly these operations).
        # Clipping, if asked, is a pass before it.
        if self.clip_rms is not None:
            blocks = _clip_to_rms(blocks, self.clip_rms)
        return _kernels.quantize_blocks(blocks, bits=self.bits, levels=self.levels, output=None,
                                        midrise=self.midrise, **_noise(key, self.stochastic_rounding, start),
                                        impl=self.kernels)[0]

    def encode_feedback(self, x, residual, key, *, start=0):
        """Error feedback fused with encoding: ``y = x + residual``, returns
        ``(encode(y), y - decode(encode(y)))`` from one kernel pass
        ([`commjax.kernels.quantize_blocks`][] with ``output="residual"``), the same
        bits as encoding, decoding and subtracting. Clipped: encode, decode, subtract
        (the residual keeps what the clipping cut off)."""
        if self.clip_rms is not None:
            return super().encode_feedback(x, residual, key, start=start)
        return _absmax_feedback(self, x, residual, key, start, levels=self.levels,
                                stochastic=self.stochastic_rounding, midrise=self.midrise)


@dataclasses.dataclass(frozen=True)
class QSGD(_ScaledCodec):
    """QSGD: ``x_hat = ||x||_2 * sign(x) * l / s`` with stochastic levels ``l in 0..s``."""

    num_levels: int = 16
    name: ClassVar[str] = "qsgd"
    stochastic: ClassVar[bool] = True

    @property
    def bits(self) -> int:
        return max(1, math.ceil(math.log2(2 * self.num_levels + 1)))

    @property
    def offset(self) -> int:
        return self.num_levels

    def encode_blocks(self, blocks, key, start=0):
        # ||x|| as amax * ||x / amax||: no overflow of the squares for |x| > 1.8e19.
        amax = jnp.max(jnp.abs(blocks), axis=1)
        # XLA divides by a row constant as a product with its reciprocal, which is
        # subnormal (flushed to zero on CPU) past 2**126: scale huge rows by 2**-64 first.
        f = jnp.where(amax > 2.0 ** 64, 2.0 ** -64, 1.0)[:, None]
        unit = (blocks * f) / (jnp.where(amax > 0, amax, 1.0)[:, None] * f)
        norm = amax * jnp.sqrt(jnp.sum(jnp.square(unit), axis=1))
        # A norm past the fp32 range is clamped to its largest value (still finite; the
        # estimate is then biased toward zero), and a tiny one floored at L * 2**-126 so
        # that L / norm stays finite and the step norm / L normal (see row_constants).
        # An Inf in the block (amax not finite) makes the norm NaN: flagged, as for quantize.
        norm = jnp.where(jnp.isinf(norm), jnp.where(jnp.isfinite(amax), _FMAX, jnp.nan), norm)
        floor = self.num_levels * TINY
        norm = jnp.where((norm > 0) & (norm < floor), floor, norm)
        c = safe_recip(norm, float(self.num_levels))[:, None]
        lv = jnp.clip(_round_levels(jnp.abs(blocks), c, key, True, start), 0, self.num_levels) * jnp.sign(blocks)
        return self._pack(lv, norm)

    @property
    def divisor(self) -> int:
        return self.num_levels


@dataclasses.dataclass(frozen=True)
class TernGrad(_ScaledCodec):
    """TernGrad: ``x_hat = s * sign(x) * Bernoulli(|x| / s)`` with ``s = max |x|`` per block."""

    clip_sigma: Optional[float] = None
    name: ClassVar[str] = "terngrad"
    stochastic: ClassVar[bool] = True

    @property
    def bits(self) -> int:
        return 2

    @property
    def offset(self) -> int:
        return 1

    def encode_blocks(self, blocks, key, start=0):
        if self.clip_sigma is None:
            # Unclipped TernGrad is 2-bit absmax quantization with L = 1 and stochastic
            # rounding: the same operations, so the same fused kernel.
            return _kernels.quantize_blocks(blocks, bits=2, levels=1, output=None,
                                            **_noise(key, True, start), impl=self.kernels)[0]
        # The std of huge rows from 2**-64-scaled values: their squares would overflow.
        f = jnp.where(jnp.max(jnp.abs(blocks), axis=1, keepdims=True) > 2.0 ** 64, 2.0 ** -64, 1.0)
        sigma = jnp.std(blocks * f, axis=1, keepdims=True) / f
        bound = self.clip_sigma * sigma
        blocks = jnp.clip(blocks, -bound, bound)
        scale = row_absmax(blocks)  # NaN where the block holds one (a float max may drop it)
        scale = jnp.where((scale > 0) & (scale < TINY), TINY, scale)
        pre = row_prescale(scale, 1)[:, None]  # 1 / s is subnormal past 2**126
        c = safe_recip(scale * pre[:, 0])[:, None]
        lv = jnp.clip(_round_levels(_kernels.fence(blocks * pre, c), c, key, True, start), -1, 1)
        return self._pack(lv, scale)

    def encode_feedback(self, x, residual, key, *, start=0):
        """Unclipped: error feedback fused with encoding in one kernel pass, as for
        [`Quantize.encode_feedback`][commjax.compressors.quantize.Quantize.encode_feedback] (``L =
        1``). Clipped: encode, decode, subtract."""
        if self.clip_sigma is not None:
            return super().encode_feedback(x, residual, key, start=start)
        return _absmax_feedback(self, x, residual, key, start, levels=1, stochastic=True)


def quantize(bits: int = 8, block_size: int = 256, stochastic: bool = True, *,
             clip_rms: Optional[float] = None, midrise: bool = False,
             kernels: Optional[str] = None) -> Quantize:
    """Blockwise absmax quantization.

    Each block of ``block_size`` elements sends its scale ``s = max_i |x_i|`` (fp32) and
    codes ``l_i = R(x_i / s * L)`` with ``L = 2**(bits-1) - 1`` levels on each side,
    ``R`` stochastic (unbiased) or nearest rounding. ``x_hat_i = l_i s / L``.

    Bits per element: ``bits + 32 / block_size`` (8.125, 4.125, 2.125 at the default
    block of 256).

    **Clipping** (``clip_rms=c``): each block is first clipped to ``+-c * rms`` (``rms =
    sqrt(mean_i x_i**2)`` of the block), so ``s = min(max |x|, c * rms)``: outliers lose
    their excess, every other value gets finer steps. With few levels this is most of
    the error: for 2-bit codes ({-1, 0, +1}) rounded to nearest, the squared error of
    Gaussian blocks of 128 is 0.59 of their energy with the absmax scale and 0.19 at
    ``c = 1.22`` (the minimum; 0.26 at 1.22 for Laplace data, 0.39 for Student-t(3)).
    4-bit codes gain about a tenth (0.0122 against 0.0136 at ``c = 2.5``); 8-bit codes
    only lose (their absmax step is already fine), and so do blocks ruled by a few
    outliers (cubes of Gaussian values, 2 bits: 0.43 against 0.35), whose excess the
    clip holds back.
    Biased (the clipped excess is lost), so meant for nearest rounding with error
    feedback or a reference that takes the error back (``cc.ppermute``'s delta modes),
    where the residual keeps what was cut off. Same wire format and decode; the encode
    costs one more pass over the block.

    **Midrise** (``midrise=True``): the grid without a zero level, which uses every one
    of the ``2**bits`` codes: ``x_hat_i = (2 c_i - K) s / K`` with ``K = 2**bits - 1`` and
    ``c_i = R((x_i / s * K + K) / 2)`` in ``0..K``. The midtread grid leaves one code
    unused, which costs most at 2 bits: ``{-1, 0, +1}`` against ``{-1, -1/3, +1/3, +1}``
    times ``s``. Rounded to nearest, the squared error of Gaussian blocks of 128 is 0.31
    of their energy (midtread: 0.59) and 0.117 at ``clip_rms=1.49``, the minimum
    (midtread: 0.19 at 1.22; Laplace data 0.19 at 1.6 against 0.26); 4 bits: 0.0120
    against 0.0138 unclipped. Stochastic rounding's variance is at most ``(s / K)**2``
    per value against ``(s / 2L)**2`` (2 bits: ``s**2 / 9`` against ``s**2 / 4``). A
    zero is not a level (a block of zeros still decodes to zeros: its scale is 0). The same
    bytes, another wire format: both ends must use the same ``midrise``.

    Args:
      bits: code width, one of 8, 4, 2 (2 bits: the levels {-1, 0, +1}, midrise
        {-1, -1/3, +1/3, +1}).
      block_size: elements per scale; multiples of 32 waste no packing space.
      stochastic: unbiased stochastic rounding (default) or round-to-nearest.
      clip_rms: ``c > 0`` clips each block to ``+-c`` times its RMS before the scale is
        taken (``None``: no clipping, the absmax scale).
      midrise: every code used, no zero level (above); ``False``: the levels
        ``-L..L``.
      kernels: the [`commjax.kernels`][] implementation that encodes and decodes:
        ``"auto"``, ``"pallas"``, ``"interpret"``, ``"reference"``, or ``None``
        (``$COMMJAX_KERNELS`` if set, else ``"auto"``). The bits do not depend on it.
    """
    check_choice("bits", bits, (8, 4, 2), factory="quantize")
    check_positive_int("block_size", block_size, factory="quantize")
    _kernels.check_impl(kernels, "quantize", "kernels")
    stochastic = check_bool("stochastic", stochastic, factory="quantize")
    midrise = check_bool("midrise", midrise, factory="quantize")
    if clip_rms is not None:
        # An RMS is at least max|x| / sqrt(block_size): below 1 / sqrt(block_size) every
        # block would be clipped; past sqrt(block_size) none is.
        clip_rms = check_float("clip_rms", clip_rms, 0.0, math.inf, factory="quantize", lo_open=True)
    return Quantize(block_size=block_size, num_bits=bits, stochastic_rounding=stochastic,
                    clip_rms=clip_rms, midrise=midrise, kernels=kernels)


def qsgd(levels: int = 16, block_size: int = 256, *, kernels: Optional[str] = None) -> QSGD:
    """QSGD (Alistarh et al., 2017): norm-scaled stochastic quantization.

    Per block, ``x_hat_i = ||x||_2 sign(x_i) l_i / s`` where ``l_i`` rounds
    ``|x_i| / ||x||_2 * s`` stochastically to ``{0..s}`` (``s = levels``); unbiased.
    Codes are ``ceil(log2(2 s + 1))`` bits (6 for ``levels=16``, 4 for ``levels=7``) plus
    one fp32 norm per block. ``kernels``: as for
    [`quantize`][commjax.compressors.quantize.quantize].
    """
    check_positive_int("levels", levels, factory="qsgd")
    if levels > 32767:
        raise ValueError(f"qsgd: `levels` must be <= 32767, got {levels}.")
    check_positive_int("block_size", block_size, factory="qsgd")
    _kernels.check_impl(kernels, "qsgd", "kernels")
    return QSGD(block_size=block_size, num_levels=levels, kernels=kernels)


def terngrad(block_size: int = 256, clip_sigma: Optional[float] = None, *,
             kernels: Optional[str] = None) -> TernGrad:
    """TernGrad (Wen et al., 2017): ternary levels ``{-s, 0, +s}`` per block.

    ``x_hat_i = s sign(x_i) b_i`` with ``s = max |x|`` over the block and
    ``b_i ~ Bernoulli(|x_i| / s)``: unbiased. 2 bits per element plus a scale per block.
    ``clip_sigma`` (the paper's gradient clipping, e.g. 2.5) first clips to
    ``clip_sigma * std`` of the block: lower variance, but then biased.
    ``kernels``: as for [`quantize`][commjax.compressors.quantize.quantize].
    """
    check_positive_int("block_size", block_size, factory="terngrad")
    if clip_sigma is not None and not clip_sigma > 0:
        raise ValueError(f"terngrad: `clip_sigma` must be positive or None, got {clip_sigma!r}.")
    _kernels.check_impl(kernels, "terngrad", "kernels")
    return TernGrad(block_size=block_size, clip_sigma=clip_sigma, kernels=kernels)
