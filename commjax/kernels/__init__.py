"""Kernel dispatch: every hot path of the codecs is called through here.

``COMMJAX_KERNELS`` selects the implementation: ``auto`` (default: Pallas kernels on
GPU/TPU, the pure-jnp reference elsewhere), ``pallas``, ``interpret`` (Pallas interpret
mode, for CPU tests) or ``reference``. Results do not depend on the mode.
"""

from __future__ import annotations

from commjax.kernels._dispatch import ENV_VAR, MODES, get_mode, set_mode, use_mode
from commjax.kernels.decode import decode_rows, decode_sum
from commjax.kernels.pack import pack_codes, unpack_codes
from commjax.kernels.quantize import quantize_blocks
from commjax.kernels.sign import sign_blocks

__all__ = [
    "MODES", "ENV_VAR", "get_mode", "set_mode", "use_mode",
    "pack_codes", "unpack_codes", "quantize_blocks", "sign_blocks", "decode_rows", "decode_sum",
]
