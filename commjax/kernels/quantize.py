"""Fused error feedback + blockwise absmax quantization + packing.

For each row (one codec block of ``B`` floats) of ``x`` and, optionally, an error-feedback
residual ``e`` and uniform randoms ``u``::

    y   = x + e                                    (error feedback, fp32)
    s   = max_i |y_i|                              (the block's scale)
    q_i = y_i * (L * (1 / s))                      (0 where s = 0), rounded to fp32
    l_i = clip(floor(q_i + u_i), -L, L)            stochastic rounding, E[l_i] = q_i
        = clip(round_half_even(q_i), -L, L)        without u
    c_i = l_i + L                                  (unsigned code, ``bits`` wide)
    row = [pack(c) | bitcast_u32(s)]               (see [`commjax.packing`][])
    y_hat_i = (c_i - L) * (s / L)                  decoded value, rounded to fp32
    out = y_hat  or  y - y_hat  (the new residual)

``q`` and ``y_hat`` are products that meet a later addition; both are rounded to fp32
before it ([`commjax.kernels._dispatch.fence`][]) in the reference and in the kernels
alike, so no compiler's fused multiply-add changes a code or a residual.

``L = 2**(bits-1) - 1`` for [`commjax.quantize`][] (127, 7, 1 for 8, 4, 2 bits);
TernGrad is the case ``bits=2, L=1`` with stochastic rounding.

**Midrise** (``midrise=True``): the grid without a zero level, which uses every code
(``{-1, -1/3, 1/3, 1}`` times ``s`` for 2 bits where the midtread grid has
``{-1, 0, 1}``). With ``K = 2**bits - 1`` (odd) in place of ``L``::

    q_i = y_i * (K * (1 / s))                      in [-K, K]
    c_i = clip(floor((q_i + K) / 2 + u_i), 0, K)   (round_half_even without u)
    y_hat_i = (2 c_i - K) * (s / K)

Two kernels, one pass each:

* **lane rows** (``commjax.kernels._lanes``; blocks of whole 128-lane rows whose packed
  words fill or evenly share a row, ``_tiling.lane_rowable``: 8/4/16-bit codes in blocks
  of 128, 256, 512, ...): the flat
  vector seen as ``[n / 128, 128]``, its own memory layout on TPU. Block ``b`` is lane
  rows ``b m .. b m + m - 1`` (``m = B / 128``); a tile reads them with stride ``m``,
  takes each block's absmax, ``c = L / s`` and the codes in registers, and writes the
  wire rows and the output: per element 4 bytes of ``x`` (and ``e``) read once,
  ``bits / 8 + 4 / B`` bytes of payload and, if asked, 4 bytes of output written.
  The noise ``u`` is drawn in-kernel from ``noise_key`` at each value's position
  ([`commjax.noise.uniform_at`][], 32-bit integer operations), the same numbers as
  the reference draws; or read from ``uniforms``. On a 16M-value bucket compiled for a
  TPU v5e (``x``, ``e``; stochastic; the new residual) it moves 218 MB against the
  reference's 323 MB (``benchmarks/aot_encode.py``).
* **block rows** (other block sizes that are multiples of 32): one row of ``[nb, B]``
  per block; XLA first reads ``x`` (and ``e``) for the per-block constants
  (``commjax.kernels.reference.row_constants``), then the kernel reads ``x``, ``e`` and
  ``u`` (4 bytes each) and writes the payload and the output.

The lane-row kernel divides ``L / s`` and ``s / L`` itself where the block-row kernel
takes XLA's quotients: bit equality of the two divisions on a TPU is part of the
on-device check that must pass before ``auto`` runs the kernels there
(``commjax.kernels._dispatch``); in interpret mode both are XLA's.

Lowerings: Mosaic TPU and interpret mode (tiled ``pallas_call``). No GPU kernel: on CUDA
``pallas`` runs the reference, which XLA fuses into less memory traffic than the Mosaic
GPU kernels moved (``benchmarks/aot.py``). Blocks whose size is not a multiple of 32 use the
reference everywhere. Inputs must be finite (``compressed_mean`` zeroes non-finite
leaves before encoding): the codes of a NaN block are unspecified, its scale word is
NaN on every path, so it decodes to NaN.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from commjax import packing
from commjax.kernels._bits import pack_tile
from commjax.kernels._dispatch import dispatch, fence, resolve_impl
from commjax.kernels._lanes import check_noise, drawn, lane_encode
from commjax.kernels._tiling import lane_rowable, row_call, tile_rows
from commjax.kernels.reference import grid_codes, grid_levels, quantize_reference, row_constants

__all__ = ["quantize_blocks", "OUTPUTS"]

OUTPUTS = (None, "decoded", "residual")


def quantize_tile(x, u, e, c, sl, scale_word, *, bits: int, levels: int, output: Optional[str],
                  midrise: bool = False):
    """One tile of rows, as every kernel body computes it (values, not refs): ``c``,
    ``sl``, ``scale_word`` are the tile's ``[T, 1]`` slices of
    ``row_constants``."""
    if e is not None:
        x = x + e.astype(jnp.float32)
    codes = grid_codes(fence(x * c, c), u, levels=levels, midrise=midrise)
    words = pack_tile(codes.astype(jnp.uint32), bits)
    row = jnp.concatenate([words, scale_word], axis=1)
    if output is None:
        return row, None
    decoded = fence(grid_levels(codes, levels=levels, midrise=midrise) * sl, sl)
    return row, decoded if output == "decoded" else x - decoded


def _pallas(x, uniforms, residual, *, bits, levels, output, tile, midrise: bool = False,
            interpret: Any = False):
    rows, block = x.shape
    has_u, has_e = uniforms is not None, residual is not None
    scale, c, sl = row_constants(x, residual, levels=levels)
    scale_word = lax.bitcast_convert_type(scale, jnp.uint32)[:, None]
    inputs = ([x] + ([uniforms] if has_u else []) + ([residual] if has_e else [])
              + [c[:, None], scale_word] + ([sl[:, None]] if output is not None else []))
    t = tile_rows(rows, block * (1 + has_u + has_e), interpret=bool(interpret), tile=tile)

    def body(*refs):
        refs = list(refs)
        x_ref = refs.pop(0)
        u = refs.pop(0)[...] if has_u else None
        e = refs.pop(0)[...] if has_e else None
        cv, sw = refs.pop(0)[...], refs.pop(0)[...]
        slv = refs.pop(0)[...] if output is not None else None
        row, out = quantize_tile(x_ref[...], u, e, cv, slv, sw, bits=bits, levels=levels, output=output,
                                 midrise=midrise)
        refs[0][...] = row
        if output is not None:
            refs[1][...] = out

    out_cols = [(packing.packed_words(block, bits) + 1, jnp.uint32)]
    if output is not None:
        out_cols.append((block, jnp.float32))
    outs = row_call(body, rows=rows, tile=t, inputs=inputs, out_cols=out_cols,
                    interpret=interpret, name=f"commjax_quantize{bits}")
    return outs[0], (outs[1] if output is not None else None)


def _int_codes(y, c, u, *, levels: int, midrise: bool):
    """The lane-row kernel's codes of ``y`` (``codes``, their signed levels as fp32):
    ``u`` the noise, ``None`` for nearest rounding."""
    codes = grid_codes(fence(y * c, c), u, levels=levels, midrise=midrise)
    return codes.astype(jnp.uint32), grid_levels(codes, levels=levels, midrise=midrise)


def _check(x, uniforms, residual, bits, levels, output, midrise) -> int:
    """The arguments of [`quantize_blocks`][commjax.kernels.quantize.quantize_blocks] checked;
    returns ``K``."""
    if not 2 <= bits <= 16:
        raise ValueError(f"quantize_blocks: `bits` must be in [2, 16], got {bits!r}.")
    if midrise:
        if levels is not None and levels != 2 ** bits - 1:
            raise ValueError(f"quantize_blocks: with midrise=True `levels` is 2**bits - 1 = {2 ** bits - 1} "
                             f"(every code is used), got {levels!r}; pass levels=None.")
        return 2 ** bits - 1
    max_levels = 2 ** (bits - 1) - 1
    levels = max_levels if levels is None else int(levels)
    if not 1 <= levels <= max_levels:
        raise ValueError(f"quantize_blocks: `levels` must be in [1, {max_levels}] for bits={bits}, got {levels!r}.")
    if output not in OUTPUTS:
        raise ValueError(f"quantize_blocks: `output` must be one of {OUTPUTS}, got {output!r}.")
    if x.ndim != 2:
        raise ValueError(f"quantize_blocks: `x` must be [num_blocks, block_size], got shape {x.shape}.")
    for name, a in (("uniforms", uniforms), ("residual", residual)):
        if a is not None and a.shape != x.shape:
            raise ValueError(f"quantize_blocks: `{name}` must have x's shape {x.shape}, got {a.shape}.")
    return levels


def quantize_blocks(
    x: jax.Array,
    *,
    bits: int,
    levels: Optional[int] = None,
    midrise: bool = False,
    uniforms: Optional[jax.Array] = None,
    residual: Optional[jax.Array] = None,
    output: Optional[str] = "decoded",
    noise_key: Optional[jax.Array] = None,
    noise_start: int = 0,
    tile: Optional[int] = None,
    impl: Optional[str] = None,
) -> tuple[jax.Array, Optional[jax.Array]]:
    """Quantize the rows of ``x: float32[nb, B]`` (see the module docstring for the maths).

    Args:
      x: one codec block per row.
      bits: code width (2..16; [`commjax.quantize`][] uses 8, 4, 2).
      levels: ``L``, at most ``2**(bits-1) - 1`` (the default); with ``midrise``
        always ``K = 2**bits - 1``.
      midrise: the grid without a zero level, ``(2 c - K) s / K`` for the codes
        ``c = 0..K``: every code is used (see the module docstring).
      uniforms: ``float32[nb, B]`` in ``[0, 1)`` for stochastic rounding; ``None`` rounds
        to nearest (half to even).
      residual: optional error-feedback residual ``e`` (``[nb, B]``, any float dtype),
        added in fp32 before quantization.
      output: ``"decoded"`` (``y_hat``), ``"residual"`` (``y - y_hat``) or ``None``.
      noise_key: instead of ``uniforms``, the key of
        ``uniforms = commjax.noise.uniform(noise_key, x.shape, start=noise_start)``: the
        references draw them where XLA fuses them, the lane-row kernel in-kernel (no
        array of noise is written or read).
      noise_start: the position of ``x``'s first value in the noise (``noise_key`` only).
      tile: rows per grid step (default: chosen per backend).
      impl: ``"auto"``, ``"pallas"``, ``"interpret"``, ``"reference"``, or ``None``
        (``$COMMJAX_KERNELS``, else ``"auto"``): see ``commjax.kernels._dispatch``.

    Returns:
      ``(rows, out)``: ``uint32[nb, packed_words(B, bits) + 1]`` wire rows and the requested
      ``float32[nb, B]`` output (``None`` if ``output is None``).
    """
    levels = _check(x, uniforms, residual, bits, levels, output, bool(midrise))
    check_noise(uniforms, noise_key, "quantize_blocks")
    impl = resolve_impl(impl, "quantize_blocks")
    opts = dict(bits=bits, levels=levels, output=output, midrise=bool(midrise))
    reference = drawn(functools.partial(quantize_reference, **opts), noise_start)
    args = (x, uniforms, residual, noise_key)
    # Levels below 4 can need a per-row pre-scale (row_prescale) the kernels do not take.
    if x.shape[1] % 32 or x.shape[0] == 0 or levels < 4:
        return reference(*args)
    if lane_rowable(x.shape[1], bits):
        def kernel(x, u, e, key, **kw):
            return lane_encode(x, u, e, key, noise_start, bits=bits, levels=levels, output=output,
                               codes=functools.partial(_int_codes, levels=levels, midrise=bool(midrise)),
                               name=f"commjax_quantize{bits}_lanes", **kw)
    else:
        kernel = drawn(functools.partial(_pallas, tile=tile, **opts), noise_start)
    return dispatch(reference, impl=impl, tpu=kernel, interpret=kernel, args=args)
