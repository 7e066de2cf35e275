"""Kernel dispatch: every hot path of the codecs is called through here.

``COMMJAX_KERNELS`` selects the implementation: ``auto`` (default: Pallas kernels on
GPU/TPU, the pure-jnp reference elsewhere), ``pallas``, ``interpret`` (Pallas interpret
mode, for CPU tests) or ``reference``. Results do not depend on the mode (see
:mod:`commjax.kernels._dispatch` for the exceptions JAX imposes: no ``grad`` through a
kernel; interpret mode under ``shard_map(check_vma=True)``).

Kernels, each beside its pure-jnp reference (the oracle of the tests):

* :func:`quantize_blocks` -- error feedback + blockwise absmax quantization + bit-plane
  packing in one pass (``cj.quantize`` 8/4/2 bits, TernGrad), stochastic rounding from
  uniforms passed in; outputs the wire rows and, if asked, the decoded values or the
  new residual;
* :func:`sign_blocks` -- error feedback + scaled sign + 1-bit packing;
* :func:`decode_rows`, :func:`decode_sum` -- unpack + dequantize (+ sum over the ``N``
  payloads a replica receives, in replica order, fp32);
* :func:`pack_codes`, :func:`unpack_codes` -- the bit-plane format of
  :mod:`commjax.packing` alone.

Lowerings: Mosaic TPU (row-tiled ``pallas_call``), Mosaic GPU
(:mod:`commjax.kernels.mosaic_gpu`, ``plgpu.kernel``), interpret mode anywhere.
"""

from __future__ import annotations

from commjax.kernels._dispatch import ENV_VAR, MODES, get_mode, set_mode, use_mode
from commjax.kernels.decode import decode_rows, decode_sum
from commjax.kernels.pack import pack_codes, unpack_codes
from commjax.kernels.quantize import quantize_blocks
from commjax.kernels.sign import sign_blocks

__all__ = [
    "MODES", "ENV_VAR", "get_mode", "set_mode", "use_mode",
    "quantize_blocks", "sign_blocks", "decode_rows", "decode_sum", "pack_codes", "unpack_codes",
]
