"""Fused error feedback + blockwise absmax quantization + bit-plane packing.

For each row (one codec block of ``B`` floats) of ``x`` and, optionally, an error-feedback
residual ``e`` and uniform randoms ``u``::

    y   = x + e                                    (error feedback, fp32)
    s   = max_i |y_i|                              (the block's scale)
    q_i = y_i * (L * (1 / s))                      (0 where s = 0)
    l_i = clip(floor(q_i + u_i), -L, L)            stochastic rounding, E[l_i] = q_i
        = clip(round_half_even(q_i), -L, L)        without u
    c_i = l_i + L                                  (unsigned code, ``bits`` wide)
    row = [pack(c) | bitcast_u32(s)]               (see :mod:`commjax.packing`)
    y_hat_i = (c_i - L) * (s / L)                  decoded value, rounded to fp32
    out = y_hat  or  y - y_hat  (the new residual)

``y - y_hat`` is computed from the *rounded* ``y_hat`` (:func:`commjax.kernels._dispatch.fence`
keeps compilers from fusing the product into a multiply-subtract) in the reference and
in the kernels alike, so the residual does not depend on fusion decisions.

``L = 2**(bits-1) - 1`` for :func:`commjax.quantize` (127, 7, 1 for 8, 4, 2 bits);
TernGrad is the case ``bits=2, L=1`` with stochastic rounding.

Traffic per element: XLA first reads ``x`` (and ``e``) for the per-block constants
(:func:`row_constants`), then the kernel reads ``x`` (and ``e``, ``u``: 4 bytes each) and
writes ``bits / 8 + 4 / B`` bytes of payload plus, if asked, 4 bytes of decoded value or
residual; the reference (``quantize_reference``, the codec's own jnp code) leaves the
fusion to XLA.

Randomness comes in as ``u`` (:func:`commjax.noise.uniform` outside the kernel) so that the
kernel and the reference see the same noise on every backend; there is no in-kernel
RNG.

Lowerings: Mosaic TPU and interpret mode (row-tiled ``pallas_call``); Mosaic GPU
(:mod:`commjax.kernels.mosaic_gpu`). Blocks whose size is not a multiple of 32 use the
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
from commjax.kernels._dispatch import dispatch, fence
from commjax.kernels._tiling import row_call, tile_rows

__all__ = ["quantize_blocks", "quantize_reference", "OUTPUTS"]

OUTPUTS = (None, "decoded", "residual")


def _safe_recip(s: jax.Array) -> jax.Array:
    return jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)


def quantize_reference(
    x: jax.Array,
    uniforms: Optional[jax.Array],
    residual: Optional[jax.Array],
    *,
    bits: int,
    levels: int,
    output: Optional[str],
) -> tuple[jax.Array, Optional[jax.Array]]:
    """The pure-jnp oracle: exactly the operations of :class:`commjax.compressors.Quantize`."""
    if residual is not None:
        x = x + residual.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=1)
    q = x * (levels * _safe_recip(scale))[:, None]
    if uniforms is not None:
        r = jnp.floor(q + uniforms)
    else:
        r = jnp.round(q)
    lv = jnp.clip(r, -levels, levels)
    codes = (lv + levels).astype(jnp.uint32)
    words = packing.pack_codes(codes, bits)
    scale_word = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    rows = jnp.concatenate([words, scale_word[:, None]], axis=1)
    if output is None:
        return rows, None
    step = (scale / levels)[:, None]
    decoded = fence((codes.astype(jnp.int32) - levels).astype(jnp.float32) * step, step)
    return rows, decoded if output == "decoded" else x - decoded


def row_constants(x: jax.Array, residual: Optional[jax.Array], *, levels: int):
    """Per-row ``(s, L / s, s / L)`` (``L / s`` is 0 where ``s = 0``), by XLA with the
    reference's own expressions.

    The kernels take these as inputs instead of dividing themselves: XLA rewrites a
    division by a constant into a multiplication by its reciprocal (seen on CPU: ``s / 127``
    is computed as ``s * (1 / 127)``, which differs in the last bit), and a kernel
    compiler need not do the same, nor round ``1 / s`` the same way. ``max |y|`` itself
    is exact in any order. Costs one extra read of ``x`` (and ``e``).
    """
    y = x if residual is None else x + residual.astype(jnp.float32)
    scale = jnp.max(jnp.abs(y), axis=1)
    return scale, levels * _safe_recip(scale), scale / levels


def quantize_tile(x, u, e, c, sl, scale_word, *, bits: int, levels: int, output: Optional[str]):
    """One tile of rows, as every kernel body computes it (values, not refs): ``c``,
    ``sl``, ``scale_word`` are the tile's ``[T, 1]`` slices of :func:`row_constants`."""
    if e is not None:
        x = x + e.astype(jnp.float32)
    q = x * c
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


def quantize_blocks(
    x: jax.Array,
    *,
    bits: int,
    levels: Optional[int] = None,
    uniforms: Optional[jax.Array] = None,
    residual: Optional[jax.Array] = None,
    output: Optional[str] = "decoded",
    tile: Optional[int] = None,
) -> tuple[jax.Array, Optional[jax.Array]]:
    """Quantize the rows of ``x: float32[nb, B]`` (see the module docstring for the maths).

    Args:
      x: one codec block per row.
      bits: code width (2..16; :func:`commjax.quantize` uses 8, 4, 2).
      levels: ``L``, at most ``2**(bits-1) - 1`` (the default).
      uniforms: ``float32[nb, B]`` in ``[0, 1)`` for stochastic rounding; ``None`` rounds
        to nearest (half to even).
      residual: optional error-feedback residual ``e`` (``[nb, B]``, any float dtype),
        added in fp32 before quantization.
      output: ``"decoded"`` (``y_hat``), ``"residual"`` (``y - y_hat``) or ``None``.
      tile: rows per grid step (default: chosen per backend).

    Returns:
      ``(rows, out)``: ``uint32[nb, bits * ceil(B/32) + 1]`` wire rows and the requested
      ``float32[nb, B]`` output (``None`` if ``output is None``).
    """
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
    opts = dict(bits=bits, levels=levels, output=output)
    reference = functools.partial(quantize_reference, **opts)
    rows, block = x.shape
    if block % 32 or rows == 0:
        return reference(x, uniforms, residual)
    kernel = functools.partial(_pallas, tile=tile, **opts)
    from commjax.kernels import mosaic_gpu

    gpu = mosaic_gpu.quantize_kernel(x, uniforms, residual, **opts)
    return dispatch("quantize", reference, tpu=kernel, gpu=gpu, interpret=kernel,
                    args=(x, uniforms, residual))
