"""Kernels: every hot path of the codecs, as a Pallas kernel beside its pure-jnp reference.

Each function takes ``impl`` (the codecs pass their ``kernels`` field): ``"auto"``,
``"pallas"``, ``"interpret"`` (Pallas interpret mode, for CPU tests), ``"reference"``, or
``None`` for ``$COMMJAX_KERNELS`` if set, else ``"auto"``. ``auto`` runs the reference on
every backend whose compiled kernels have not passed the on-device check (all of them
today); see
``commjax.kernels._dispatch``. Results do not depend on ``impl``: every
implementation computes the bits of the reference.

Kernels (references in ``commjax.kernels.reference``):

* [`quantize_blocks`][commjax.kernels.quantize_blocks] -- error feedback + blockwise absmax
  quantization + packing in one pass (``cj.quantize`` 8/4/2 bits, TernGrad), stochastic rounding from
  uniforms passed in or drawn in-kernel from a key; outputs the wire rows and, if asked,
  the decoded values or the new residual; blocks of whole 128-lane rows are read and
  written as lane rows, the flat vector's own layout on TPU;
* [`sign_blocks`][commjax.kernels.sign_blocks] -- error feedback + scaled sign + 1-bit packing;
* [`decode_rows`][commjax.kernels.decode_rows], [`decode_sum`][commjax.kernels.decode_sum] --
  unpack + dequantize (+ sum over the ``N``
  payloads a replica receives, in replica order, fp32);
* [`fp8_blocks`][commjax.kernels.fp8_blocks] -- error feedback + blockwise scaled FP8 rounding
  (nearest or
  stochastic) + 4 codes per word (``cj.fp8``);
* [`lossless_encode`][commjax.kernels.lossless_encode] -- the fixed-rate lossless code of bfloat16
  patterns
  (``cj.lossless``);
* [`pack_codes`][commjax.kernels.pack_codes], [`unpack_codes`][commjax.kernels.unpack_codes] -- the
  packing of [`commjax.packing`][] alone.

Lowerings: Mosaic TPU (row-tiled ``pallas_call``) and interpret mode anywhere. There is no
GPU kernel: compiled for an H100, XLA's fusion of the references moved less memory than
the Mosaic GPU kernels did (``benchmarks/aot.py``), so ``pallas`` runs the reference on CUDA.
"""

from __future__ import annotations

from commjax.kernels._dispatch import (ENV_VAR, IMPLS, VERIFIED_BACKENDS, auto_impl, check_impl,
                                       fence, resolve_impl)
from commjax.kernels.decode import decode_rows, decode_sum
from commjax.kernels.pack import pack_codes, unpack_codes
from commjax.kernels.quantize import quantize_blocks
from commjax.kernels.sign import sign_blocks
from commjax.kernels.fp8 import fp8_blocks
from commjax.kernels.lossless import lossless_encode

__all__ = [
    "IMPLS", "ENV_VAR", "VERIFIED_BACKENDS", "check_impl", "resolve_impl", "auto_impl",
    "fence", "quantize_blocks", "sign_blocks", "decode_rows", "decode_sum", "pack_codes", "unpack_codes",
    "fp8_blocks", "lossless_encode",
]
