"""Kernel dispatch: every hot path of the codecs is called through here.

``COMMJAX_KERNELS`` selects the implementation: ``auto`` (default: Pallas kernels on
GPU/TPU, the pure-jnp reference elsewhere), ``pallas``, ``interpret`` (Pallas interpret
mode, for CPU tests) or ``reference``. Results do not depend on the mode.
"""

from __future__ import annotations

from commjax.packing import pack_codes, unpack_codes

__all__ = ["pack_codes", "unpack_codes"]
