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

Traffic per element: XLA first reads ``x`` (and ``e``) for the per-block constants
(``commjax.kernels.reference.row_constants``), then the kernel reads ``x`` (and
``e``, ``u``: 4 bytes each) and writes ``bits / 8 + 4 / B`` bytes of payload plus, if
asked, 4 bytes of decoded value or residual; the reference leaves the fusion to XLA.

Randomness comes in as ``u`` ([`commjax.noise.uniform`][] outside the kernel) so that the
kernel and the reference see the same noise on every backend; there is no in-kernel
RNG.

Lowerings: Mosaic TPU and interpret mode (row-tiled ``pallas_call``). No GPU kernel: on CUDA
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
from commjax.kernels._tiling import row_call, tile_rows
from commjax.kernels.reference import quantize_reference, row_constants

__all__ = ["quantize_blocks", "OUTPUTS"]

OUTPUTS = (None, "decoded", "residual")


def quantize_tile(x, u, e, c, sl, scale_word, *, bits: int, levels: int, output: Optional[str]):
    """One tile of rows, as every kernel body computes it (values, not refs): ``c``,
    ``sl``, ``scale_word`` are the tile's ``[T, 1]`` slices of
    ``row_constants``."""
    if e is not None:
        x = x + e.astype(jnp.float32)
    q = fence(x * c, c)
    r = jnp.floor(q + u) if u is not None else jnp.round(q)
    lv = jnp.clip(r, -levels, levels)
    codes = (lv + levels).astype(jnp.int32)
    words = pack_tile(codes.astype(jnp.uint32), bits)
    row = jnp.concatenate([words, scale_word], axis=1)
    if output is None:
        return row, None
    decoded = fence((codes - levels).astype(jnp.float32) * sl, sl)
    return row, decoded if output == "decoded" else x - decoded


def _pallas(x, uniforms, residual, *, bits, levels, output, tile, interpret: Any = False):
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
        row, out = quantize_tile(x_ref[...], u, e, cv, slv, sw, bits=bits, levels=levels, output=output)
        refs[0][...] = row
        if output is not None:
            refs[1][...] = out

    out_cols = [(packing.packed_words(block, bits) + 1, jnp.uint32)]
    if output is not None:
        out_cols.append((block, jnp.float32))
    outs = row_call(body, rows=rows, tile=t, inputs=inputs, out_cols=out_cols,
                    interpret=interpret, name=f"commjax_quantize{bits}")
    return outs[0], (outs[1] if output is not None else None)


def _check(x, uniforms, residual, bits, levels, output) -> int:
    """The arguments of [`quantize_blocks`][commjax.kernels.quantize.quantize_blocks] checked;
    returns ``L``."""
    if not 2 <= bits <= 16:
        raise ValueError(f"quantize_blocks: `bits` must be in [2, 16], got {bits!r}.")
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
    uniforms: Optional[jax.Array] = None,
    residual: Optional[jax.Array] = None,
    output: Optional[str] = "decoded",
    tile: Optional[int] = None,
    impl: Optional[str] = None,
) -> tuple[jax.Array, Optional[jax.Array]]:
    """Quantize the rows of ``x: float32[nb, B]`` (see the module docstring for the maths).

    Args:
      x: one codec block per row.
      bits: code width (2..16; [`commjax.quantize`][] uses 8, 4, 2).
      levels: ``L``, at most ``2**(bits-1) - 1`` (the default).
      uniforms: ``float32[nb, B]`` in ``[0, 1)`` for stochastic rounding; ``None`` rounds
        to nearest (half to even).
      residual: optional error-feedback residual ``e`` (``[nb, B]``, any float dtype),
        added in fp32 before quantization.
      output: ``"decoded"`` (``y_hat``), ``"residual"`` (``y - y_hat``) or ``None``.
      tile: rows per grid step (default: chosen per backend).
      impl: ``"auto"``, ``"pallas"``, ``"interpret"``, ``"reference"``, or ``None``
        (``$COMMJAX_KERNELS``, else ``"auto"``): see ``commjax.kernels._dispatch``.

    Returns:
      ``(rows, out)``: ``uint32[nb, packed_words(B, bits) + 1]`` wire rows and the requested
      ``float32[nb, B]`` output (``None`` if ``output is None``).
    """
    levels = _check(x, uniforms, residual, bits, levels, output)
    impl = resolve_impl(impl, "quantize_blocks")
    opts = dict(bits=bits, levels=levels, output=output)
    reference = functools.partial(quantize_reference, **opts)
    # Levels below 4 can need a per-row pre-scale (row_prescale) the kernels do not take.
    if x.shape[1] % 32 or x.shape[0] == 0 or levels < 4:
        return reference(x, uniforms, residual)
    kernel = functools.partial(_pallas, tile=tile, **opts)
    return dispatch(reference, impl=impl, tpu=kernel, interpret=kernel,
                    args=(x, uniforms, residual))
