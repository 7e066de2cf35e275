"""Fused error feedback + scaled sign compression + 1-bit packing.

For each row (one block of ``B`` floats) of ``x`` and an optional residual ``e``::

    y   = x + e                                  (error feedback, fp32)
    s   = mean_i |y_i|                           (sum over the row, then / B)
    b_i = 1 if y_i >= 0 else 0                   (zeros count as positive)
    row = [pack(b) | bitcast_u32(s)]             (one bit plane: 32 signs per word)
    y_hat_i = (2 b_i - 1) * s
    out = y_hat  or  y - y_hat  (the new residual)

Bit-exactness: ``s`` is a floating-point *sum*, whose last bit depends on the order of
the additions, and XLA's own order for a row reduction depends on the shape of the whole
array (seen on CPU: the same row sums differently in an array of 17 rows and in one of 8).
No kernel can promise XLA's order, so the scales are computed by XLA, with the
reference's own expression (``commjax.kernels.reference.row_scales``), and handed to the kernel,
which fuses everything else. Traffic: the scale pass reads ``y``'s inputs (4 bytes per
element, 8 with ``e``), the kernel reads them again and writes ``1/8 + 4/B`` bytes of
payload plus 4 bytes of decoded value or residual if asked; the reference's unfused
graph moves about twice as much.

Lowerings: Mosaic TPU and interpret mode (row-tiled ``pallas_call``). No GPU kernel: on CUDA
``pallas`` runs the reference, which XLA fuses into less memory traffic than the Mosaic
GPU kernels moved (``benchmarks/aot.py``). Blocks whose size is not a multiple of 32 use the
reference everywhere.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from commjax import packing
from commjax.kernels._bits import pack_tile
from commjax.kernels._dispatch import dispatch, resolve_impl
from commjax.kernels._tiling import row_call, tile_rows
from commjax.kernels.reference import row_scales, sign_reference

__all__ = ["sign_blocks"]

_OUTPUTS = (None, "decoded", "residual")


def sign_tile(x, e, scale, *, output: Optional[str]):
    """One tile of rows, as every kernel body computes it (values, not refs);
    ``scale`` is the tile's ``float32[T, 1]`` slice of
    ``row_scales``."""
    if e is not None:
        x = x + e.astype(jnp.float32)
    bits = (x >= 0).astype(jnp.uint32)
    row = jnp.concatenate([pack_tile(bits, 1), lax.bitcast_convert_type(scale, jnp.uint32)], axis=1)
    if output is None:
        return row, None
    decoded = (bits.astype(jnp.float32) * 2.0 - 1.0) * scale
    return row, decoded if output == "decoded" else x - decoded


def _pallas(x, residual, *, output, tile, interpret: Any = False):
    rows, block = x.shape
    has_e = residual is not None
    inputs = [x] + ([residual] if has_e else []) + [row_scales(x, residual)]
    t = tile_rows(rows, block * (1 + has_e), interpret=bool(interpret), tile=tile)

    def body(*refs):
        refs = list(refs)
        x_ref = refs.pop(0)
        e = refs.pop(0)[...] if has_e else None
        scale = refs.pop(0)[...]
        row, out = sign_tile(x_ref[...], e, scale, output=output)
        refs[0][...] = row
        if output is not None:
            refs[1][...] = out

    out_cols = [(packing.words_per_plane(block) + 1, jnp.uint32)]
    if output is not None:
        out_cols.append((block, jnp.float32))
    outs = row_call(body, rows=rows, tile=t, inputs=inputs, out_cols=out_cols,
                    interpret=interpret, name="commjax_sign")
    return outs[0], (outs[1] if output is not None else None)


def sign_blocks(
    x: jax.Array,
    *,
    residual: Optional[jax.Array] = None,
    output: Optional[str] = "decoded",
    tile: Optional[int] = None,
    impl: Optional[str] = None,
) -> tuple[jax.Array, Optional[jax.Array]]:
    """Scaled-sign encode the rows of ``x: float32[nb, B]`` (maths in the module docstring).

    Returns ``(rows, out)``: ``uint32[nb, ceil(B/32) + 1]`` wire rows and the requested
    ``float32[nb, B]`` output (``output``: ``"decoded"``, ``"residual"`` or ``None``).
    ``impl``: as for [`commjax.kernels.quantize_blocks`][].
    """
    if output not in _OUTPUTS:
        raise ValueError(f"sign_blocks: `output` must be one of {_OUTPUTS}, got {output!r}.")
    if x.ndim != 2:
        raise ValueError(f"sign_blocks: `x` must be [num_blocks, block_size], got shape {x.shape}.")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"sign_blocks: `residual` must have x's shape {x.shape}, got {residual.shape}.")
    impl = resolve_impl(impl, "sign_blocks")
    reference = functools.partial(sign_reference, output=output)
    if x.shape[1] % 32 or x.shape[0] == 0:
        return reference(x, residual)
    kernel = functools.partial(_pallas, output=output, tile=tile)
    return dispatch(reference, impl=impl, tpu=kernel, interpret=kernel, args=(x, residual))
