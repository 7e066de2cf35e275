"""FP8 on the wire: ``fp8`` (e4m3 or e5m2 codes with one fp32 scale per block).

Each block of ``B`` elements sends its scale ``s = max_i |x_i|`` (fp32) and one FP8 code
per element for ``x_i * F / s``, where ``F`` is the format's largest normal (448 for
e4m3fn, 57344 for e5m2): the block's largest magnitude lands on ``F`` and the others keep
the format's relative precision down to its subnormals. Four codes per uint32 word (XLA
on CPU widens FP8 collectives), so a block costs ``B / 4 + 1`` words:
``8 + 32 / B`` bits per element (8.125 at the default block of 256).

Rounding (grid and bits in ``commjax.kernels.fp8``):

* nearest (half to even), the bits ``astype(float8)`` gives: ``|x - x_hat| <= 2**-(m+1)
  |x|`` for values in the normal range (``m`` = 3 for e4m3, 2 for e5m2), and at most
  ``2**-4 s`` (e4m3) or ``2**-3 s`` (e5m2) anywhere in the block;
* stochastic: to the FP8 neighbour above with probability equal to the distance from the
  one below over their spacing, noise drawn by position ([`commjax.noise.uniform`][]):
  ``E[x_hat] = x``, ``|x - x_hat| <`` one spacing.

A NaN or Inf in a block makes its scale NaN: the block decodes to NaN (on every replica)
and [`Fp8.payload_finite`][commjax.compressors.fp8.Fp8.payload_finite] reads it from the scale
words.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax

from commjax import kernels as _kernels
from commjax.compressors.base import BlockCompressor, check_choice, check_positive_int
from commjax.kernels.fp8 import FP8_FORMATS, fp8_blocks, fp8_decode
from commjax.validation import check_bool

__all__ = ["Fp8", "fp8"]


@dataclasses.dataclass(frozen=True)
class Fp8(BlockCompressor):
    """Blockwise scaled FP8 codes, four per word, and an fp32 scale per block (see
    [`fp8`][commjax.compressors.fp8.fp8]). ``kernels`` picks the [`commjax.kernels`][]
    implementation of the
    encoder; part of the codec's hash."""

    format: str = "e4m3"
    block_size: int = 256
    stochastic_rounding: bool = False
    kernels: Optional[str] = dataclasses.field(default=None, kw_only=True)
    name: ClassVar[str] = "fp8"

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        return self.stochastic_rounding

    @property
    def block(self) -> int:
        return self.block_size

    @property
    def row_words(self) -> int:
        return self.block_size // 4 + 1

    @property
    def max_normal(self) -> float:
        """``F``: the format's largest normal, onto which each block's absmax maps."""
        return FP8_FORMATS[self.format].fmax

    def _noise(self, key: Optional[jax.Array], start: int) -> dict:
        """``fp8_blocks``' noise arguments: the key of ``commjax.noise.uniform``'s numbers
        (drawn in-kernel by the lane-row kernel, where XLA fuses them by the reference)."""
        if not self.stochastic_rounding:
            return {}
        if key is None:
            raise ValueError("fp8(stochastic=True) needs a PRNG key")
        return dict(noise_key=key, noise_start=start)

    def encode_blocks(self, blocks, key, start=0):
        return fp8_blocks(blocks, fmt=self.format, output=None, impl=self.kernels,
                          **self._noise(key, start))[0]

    def decode_blocks(self, rows):
        return fp8_decode(rows, fmt=self.format)

    def encode_feedback(self, x, residual, key, *, start=0):
        """``(encode(y), y - decode(encode(y)))`` for ``y = x + residual`` from one pass of
        [`commjax.kernels.fp8.fp8_blocks`][] (``output="residual"``)."""
        nb = x.shape[0] // self.block_size
        rows, res = fp8_blocks(x.reshape(nb, self.block_size), fmt=self.format,
                               residual=residual.reshape(nb, self.block_size), output="residual",
                               impl=self.kernels, **self._noise(key, start))
        return rows.reshape(-1), res.reshape(-1)

    def payload_finite(self, words):
        """A block decodes to finite values iff its scale (its row's last word) is finite."""
        return self.scales_finite(words)


def fp8(format: str = "e4m3", block_size: int = 256, stochastic: bool = False, *,
        kernels: Optional[str] = None) -> Fp8:
    """FP8 codes on the wire, with an fp32 scale per block.

    Each block of ``block_size`` elements is scaled so that its absmax ``s`` maps to the
    format's largest normal ``F`` and rounded to FP8: ``x_hat_i = fp8(x_i F / s) * s / F``.
    Per element error (nearest): at most ``2**-4 s`` for e4m3 (``2**-3 s`` for e5m2), and
    ``2**-4 |x_i|`` (``2**-3 |x_i|``) in the format's normal range; stochastic rounding is
    unbiased.

    Bits per element: ``8 + 32 / block_size`` (8.125 at 256): four codes per uint32 word
    plus the scale word.

    Args:
      format: ``"e4m3"`` (float8_e4m3fn: 3 mantissa bits, ``F = 448``) or ``"e5m2"``
        (2 mantissa bits, ``F = 57344``, a wider range within a block).
      block_size: elements per scale, a multiple of 4.
      stochastic: unbiased stochastic rounding instead of round-to-nearest-even.
      kernels: the [`commjax.kernels`][] implementation of the encoder (``"auto"``,
        ``"pallas"``, ``"interpret"``, ``"reference"``, or ``None``:
        ``$COMMJAX_KERNELS`` if set, else ``"auto"``). The bits do not depend on it.

    Example::

        tx = optax.chain(cj.compressed_mean(cj.fp8("e4m3"), "data"), optax.adam(1e-3))
    """
    check_choice("format", format, tuple(FP8_FORMATS), factory="fp8")
    check_positive_int("block_size", block_size, factory="fp8")
    if block_size % 4:
        raise ValueError(f"fp8: `block_size` must be a multiple of 4 (four codes per word), "
                         f"got {block_size}; try {-(-block_size // 4) * 4}.")
    stochastic = check_bool("stochastic", stochastic, factory="fp8")
    _kernels.check_impl(kernels, "fp8", "kernels")
    return Fp8(format=format, block_size=block_size, stochastic_rounding=stochastic, kernels=kernels)
