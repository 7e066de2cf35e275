"""Scaled sign compression (EF-SignSGD, 1-bit SGD/Adam style)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax

from commjax import kernels as _kernels
from commjax.compressors.base import BlockCompressor, check_positive_int
from commjax.packing import words_per_plane

__all__ = ["Sign", "sign"]


@dataclasses.dataclass(frozen=True)
class Sign(BlockCompressor):
    """``x_hat_i = s * (+1 if x_i >= 0 else -1)`` with ``s = mean_i |x_i|`` per block.

    The scale is the mean absolute value over the whole block (padding included), which
    makes ``x_hat`` the best scaled-sign approximation in the l2 sense. Zeros encode as
    ``+s``; an all-zero block decodes to exact zeros. Biased: use it with error feedback.

    ``kernels``: the implementation of [`commjax.kernels`][] that encode and decode run
    (``None``: ``$COMMJAX_KERNELS``, else ``"auto"``); part of the codec's hash.
    """

    block_size: int = 256
    kernels: Optional[str] = dataclasses.field(default=None, kw_only=True)
    name: ClassVar[str] = "sign"
    # v5e, 4 MB buckets, whose scales take no conditional (kernels.reference.row_scales):
    # the MLP's step 676 MB with the norm's sums, 619 MB with l2_norm.
    tpu_norm_sums_in_buckets: ClassVar[bool] = False
    # v5e MLP in 4 MB buckets: 619 MB with encode and decode, 646 MB by encode_feedback
    # (728 against 838 with the scales' conditional); one bucket 942 against 887 MB.
    reencode_by_feedback: ClassVar[bool] = False
    # v5e MLP in 4 MB buckets: 619 MB with the pieces read in place (the whole gradient
    # leaf prefetched to VMEM, the mean joined in HBM), 489 MB taken apart; with
    # check_finite="reset" 464 in place, 481 apart (so reset keeps them in place).
    tpu_pieces_apart_in_buckets: ClassVar[bool] = True

    @property
    def block(self) -> int:
        return self.block_size

    @property
    def row_words(self) -> int:
        return words_per_plane(self.block_size) + 1

    def encode_blocks(self, blocks, key, start=0):
        # scale = mean |x|; bits = x >= 0; row = [pack(bits) | scale], fused in one kernel
        # pass (commjax.kernels.sign_blocks, whose reference is exactly these operations).
        return _kernels.sign_blocks(blocks, output=None, impl=self.kernels)[0]

    def encode_feedback(self, x, residual, key, *, start=0):
        """Error feedback fused with encoding: ``y = x + residual``, returns
        ``(encode(y), y - decode(encode(y)))`` from one kernel pass
        ([`commjax.kernels.sign_blocks`][] with ``output="residual"``)."""
        nb = x.shape[0] // self.block
        rows, res = _kernels.sign_blocks(
            x.reshape(nb, self.block), residual=residual.reshape(nb, self.block), output="residual",
            impl=self.kernels,
        )
        return rows.reshape(-1), res.reshape(-1)

    def _decode_options(self) -> dict:
        # Bit b decodes to (2 b - 1) * scale.
        return dict(bits=1, block_size=self.block_size, offset=1, step=2, divisor=None,
                    impl=self.kernels)

    def payload_finite(self, words):
        """A block decodes to finite values iff its scale (its row's last word) is finite."""
        return self.scales_finite(words)

    def decode_blocks(self, rows):
        """Unpack + dequantize in one kernel pass ([`commjax.kernels.decode_rows`][])."""
        return _kernels.decode_rows(rows, **self._decode_options())

    def decode_sum(self, payloads: jax.Array, n: int, segments=None, *, divide: int = 1) -> jax.Array:
        """``sum_r decode(payloads[r], n)`` over the leading (replica) axis of
        ``uint32[N, payload_words(n)]``: what a reducer computes from the payloads it
        receives, in one fused kernel ([`commjax.kernels.decode_sum`][]), in replica
        order and in fp32 from zeros; ``divide`` is folded into each block's step (see
        [`commjax.compressors.Compressor.decode_sum`][commjax.compressors.base.Compressor.decode_sum])."""
        rows = payloads.reshape(payloads.shape[0], n // self.block, self.row_words)
        opts = self._decode_options()
        if divide != 1:
            opts["divisor"] = int(divide)
        return _kernels.decode_sum(rows, **opts).reshape(n)


def sign(block_size: int = 256, *, kernels: Optional[str] = None) -> Sign:
    """1 bit per element (32 signs per uint32 word) plus one fp32 scale per block.

    Bits per element: ``1 + 32 / block_size`` (1.125 at the default 256).

    Which optimizers suit it: the sign of a single step's gradient discards magnitudes, so
    error feedback (on by default in [`commjax.compressed_mean`][]) is what makes it
    converge. It works well with plain SGD after the transform, and in 1-bit Adam/LAMB
    ([`commjax.onebit_adam`][]), where the *momentum* is compressed. Heavy momentum
    applied *after* a sign-compressed mean amplifies the compression error (the momentum
    buffer accumulates the sign noise that error feedback has not yet corrected): expect
    a slower start with ``optax.sgd(momentum=0.9)`` after ``sign``.

    ``kernels``: the [`commjax.kernels`][] implementation that encodes and decodes, as
    for [`commjax.quantize`][].
    """
    check_positive_int("block_size", block_size, factory="sign")
    _kernels.check_impl(kernels, "sign", "kernels")
    return Sign(block_size=block_size, kernels=kernels)
