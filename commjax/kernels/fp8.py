"""Fused error feedback + blockwise scaled FP8 rounding + byte packing.

For each row (one block of ``B`` floats) of ``x``, an optional residual ``e`` and, for
stochastic rounding, uniforms ``u`` in ``[0, 1)``; an FP8 format with ``m`` mantissa
bits, smallest normal exponent ``emin`` and largest normal ``F`` (448 for e4m3fn, 57344
for e5m2)::

    y    = x + e                                   (error feedback, fp32)
    s    = max_i |y_i|; c = F / s; step = s / F     (NaN in a block: s = NaN, c = 0)
    a_i  = min(|fence(y_i * c)|, F)
    k_i  = max(floor(log2 a_i), emin)              (the binade; subnormals share emin's)
    t_i  = a_i * 2**(m - k_i)                      (exact: a power of two)
    n_i  = round_half_even(t_i)  or  floor(t_i + u_i)
    code = sign_i << 7 | ((k_i - emin) << m) + n_i  (the FP8 bits of +-n_i 2**(k_i - m))
    row  = [4 codes per word | bitcast_u32(s)]     (byte j of word w: code w + j B / 4)
    y_hat_i = fence(+-n_i 2**(k_i - m) * step)

The grid ``n 2**(k - m)`` is the FP8 format's, so ``code`` is exactly what
``astype(float8)`` gives for round-to-nearest-even (a test checks it) and decodes with a
plain ``bitcast`` + ``astype(float32)``. Stochastic rounding picks the neighbour above
with probability equal to the distance from the one below over the spacing: unbiased.
Computing the grid with integer and power-of-two arithmetic keeps FP8 dtypes out of the
kernel body, which Mosaic may not lower, and makes every implementation agree.

Lowerings: Mosaic TPU and interpret mode: blocks of whole 128-lane rows in one pass over
lane rows (``commjax.kernels._lanes``: absmax, codes, words and output in registers, the
noise drawn in-kernel from ``noise_key``), other multiples of 128 as ``[nb, B]`` rows
with XLA's constants. Blocks whose size is not a multiple of 128 use the reference
everywhere.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat
from commjax.kernels._dispatch import dispatch, fence, pow2, resolve_impl
from commjax.kernels._lanes import check_noise, drawn, lane_encode
from commjax.kernels._tiling import lane_rowable, row_call, tile_rows
from commjax.kernels.reference import by_platform, feedback_sum, lane_absmax_constants, row_constants
from commjax.packing import pack_lane_rows, unpack_lane_rows

__all__ = ["FP8_FORMATS", "Fp8Format", "fp8_blocks", "fp8_reference", "fp8_decode"]

_OUTPUTS = (None, "decoded", "residual")


class Fp8Format(NamedTuple):
    """An FP8 format: mantissa bits, smallest normal exponent, largest normal, dtype."""

    mant_bits: int
    emin: int
    fmax: float
    dtype: Any


FP8_FORMATS = {
    "e4m3": Fp8Format(3, -6, 448.0, jnp.float8_e4m3fn),
    "e5m2": Fp8Format(2, -14, 57344.0, jnp.float8_e5m2),
}


def fp8_tile(x, u, e, c, step, scale_word, *, fmt: Fp8Format, output: Optional[str]):
    """One tile of rows, as every implementation computes it (values, not refs): ``c``,
    ``step``, ``scale_word`` are the tile's ``[T, 1]`` per-row constants."""
    if e is not None:
        x = x + e.astype(jnp.float32)
    code, value = _fp8_codes(x, u, c, fmt)
    quarter = x.shape[1] // 4
    words = (code[:, :quarter] | code[:, quarter:2 * quarter] << 8
             | code[:, 2 * quarter:3 * quarter] << 16 | code[:, 3 * quarter:] << 24)
    row = jnp.concatenate([words, scale_word], axis=1)
    if output is None:
        return row, None
    decoded = fence(value * step, step)
    return row, decoded if output == "decoded" else x - decoded


def _fp8_codes(x, u, c, fmt: Fp8Format):
    """Each element's 8-bit code and its value ``+-n 2**(k - mant)`` (before the step)."""
    q = fence(x * c, c)
    a = jnp.minimum(jnp.abs(q), fmt.fmax)
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    k = jnp.maximum((bits >> 23).astype(jnp.int32) - 127, fmt.emin)
    t = a * pow2(fmt.mant_bits - k)
    n = jnp.round(t) if u is None else jnp.floor(t + u)
    neg = (lax.bitcast_convert_type(q, jnp.uint32) >> 31) << 7
    code = neg | (((k - fmt.emin) << fmt.mant_bits) + n.astype(jnp.int32)).astype(jnp.uint32)
    value = lax.bitcast_convert_type(
        lax.bitcast_convert_type(n * pow2(k - fmt.mant_bits), jnp.uint32) | (neg << 24), jnp.float32)
    return code, value


def fp8_lane_rows(x, uniforms, residual, *, fmt: str, output: Optional[str]):
    """``fp8_reference`` computed on ``[n / 128, 128]`` lane rows (``B % 128 == 0``): the
    same words, scales and output, bit for bit (the TPU's own layout of the flat vector)."""
    f = FP8_FORMATS[fmt]
    nb, b = x.shape
    y = feedback_sum(x, residual).reshape(-1, 128)
    scale, c, step = lane_absmax_constants(y, nb, levels=int(f.fmax))
    m = b // 128
    u = None if uniforms is None else uniforms.reshape(-1, 128)
    c = jnp.repeat(c, m)[:, None]
    code, value = _fp8_codes(y, u, c, f)
    words = pack_lane_rows(code, 8, b)
    row = jnp.concatenate([words, lax.bitcast_convert_type(scale, jnp.uint32)[:, None]], axis=1)
    if output is None:
        return row, None
    step = jnp.repeat(step, m)[:, None]
    decoded = fence(value * step, step)
    return row, (decoded if output == "decoded" else y - decoded).reshape(nb, b)


def _constants(x, residual, fmt: Fp8Format):
    """Per-row ``[nb, 1]`` ``(c, step, scale_word)`` of ``y = x + e``, computed by XLA
    (``commjax.kernels.reference.row_constants``: a NaN or Inf makes ``s`` NaN)."""
    scale, c, step = row_constants(x, residual, levels=int(fmt.fmax))
    return c[:, None], step[:, None], lax.bitcast_convert_type(scale, jnp.uint32)[:, None]


def fp8_reference(x, uniforms, residual, *, fmt: str, output: Optional[str]):
    """Scaled FP8 rows of ``x`` (maths in the module docstring): ``(rows, out | None)``;
    on TPU as lane rows (``fp8_lane_rows``) where blocks are whole 128-lane rows."""
    if x.shape[1] % 128 or x.shape[0] == 0:
        return fp8_block_rows(x, uniforms, residual, fmt=fmt, output=output)
    return by_platform(fp8_lane_rows, fp8_block_rows, x, uniforms, residual, fmt=fmt, output=output)


def fp8_block_rows(x, uniforms, residual, *, fmt: str, output: Optional[str]):
    """``fp8_reference`` on ``[nb, B]`` block rows."""
    f = FP8_FORMATS[fmt]
    y = feedback_sum(x, residual)  # one reshape per consumer: see feedback_sum
    c, step, scale_word = _constants(y.reshape(x.shape), None, f)
    return fp8_tile(y.reshape(x.shape), uniforms, None, c, step, scale_word, fmt=f, output=output)


def _pallas(x, uniforms, residual, *, fmt: str, output, tile, interpret: Any = False):
    rows, block = x.shape
    f = FP8_FORMATS[fmt]
    has_u, has_e = uniforms is not None, residual is not None
    inputs = ([x] + ([uniforms] if has_u else []) + ([residual] if has_e else [])
              + list(_constants(x, residual, f)))
    t = tile_rows(rows, block * (1 + has_u + has_e), interpret=bool(interpret), tile=tile)

    def body(*refs):
        refs = list(refs)
        x_ref = refs.pop(0)
        u = refs.pop(0)[...] if has_u else None
        e = refs.pop(0)[...] if has_e else None
        c, step, sw = (refs.pop(0)[...] for _ in range(3))
        row, out = fp8_tile(x_ref[...], u, e, c, step, sw, fmt=f, output=output)
        refs[0][...] = row
        if output is not None:
            refs[1][...] = out

    out_cols = [(block // 4 + 1, jnp.uint32)] + ([(block, jnp.float32)] if output else [])
    outs = row_call(body, rows=rows, tile=t, inputs=inputs, out_cols=out_cols,
                    interpret=interpret, name=f"commjax_fp8_{fmt}")
    return outs[0], (outs[1] if output is not None else None)


def fp8_blocks(
    x: jax.Array,
    *,
    fmt: str,
    uniforms: Optional[jax.Array] = None,
    residual: Optional[jax.Array] = None,
    output: Optional[str] = "decoded",
    noise_key: Optional[jax.Array] = None,
    noise_start: int = 0,
    tile: Optional[int] = None,
    impl: Optional[str] = None,
) -> tuple[jax.Array, Optional[jax.Array]]:
    """FP8-encode the rows of ``x: float32[nb, B]`` (``B`` a multiple of 4).

    Returns ``(rows, out)``: ``uint32[nb, B/4 + 1]`` wire rows and the requested
    ``float32[nb, B]`` output (``output``: ``"decoded"``, ``"residual"`` or ``None``).
    ``fmt``: ``"e4m3"`` or ``"e5m2"``; ``uniforms``: noise for stochastic rounding
    (``None``: nearest, half to even), or ``noise_key`` and ``noise_start`` to draw it
    (as [`commjax.kernels.quantize_blocks`][]: in-kernel for lane-row blocks); ``impl``:
    as for [`commjax.kernels.quantize_blocks`][].
    """
    if fmt not in FP8_FORMATS or output not in _OUTPUTS:
        raise ValueError(f"fp8_blocks: `fmt` must be one of {tuple(FP8_FORMATS)} and `output` one "
                         f"of {_OUTPUTS}; got {fmt!r}, {output!r}.")
    if x.ndim != 2 or x.shape[1] % 4:
        raise ValueError(f"fp8_blocks: `x` must be [num_blocks, block_size] with block_size a "
                         f"multiple of 4, got shape {x.shape}.")
    check_noise(uniforms, noise_key, "fp8_blocks")
    impl = resolve_impl(impl, "fp8_blocks")
    f = FP8_FORMATS[fmt]
    reference = drawn(functools.partial(fp8_reference, fmt=fmt, output=output), noise_start)
    args = (x, uniforms, residual, noise_key)
    if x.shape[1] % 128 or x.shape[0] == 0:
        return reference(*args)
    if lane_rowable(x.shape[1], 8):
        def kernel(x, u, e, key, **kw):
            return lane_encode(x, u, e, key, noise_start, bits=8, levels=int(f.fmax), output=output,
                               codes=lambda y, c, u: _fp8_codes(y, u, c, f),
                               name=f"commjax_fp8_{fmt}_lanes", **kw)
    else:
        kernel = drawn(functools.partial(_pallas, fmt=fmt, output=output, tile=tile), noise_start)
    return dispatch(reference, impl=impl, tpu=kernel, interpret=kernel, args=args)


def fp8_decode(rows: jax.Array, *, fmt: str) -> jax.Array:
    """``uint32[nb, B/4 + 1] -> float32[nb, B]``: ``fence(fp8(code) * (s / F))``, the
    same step and product as the encoder's decoded output."""
    f = FP8_FORMATS[fmt]
    words = rows[:, :-1]
    b = 4 * words.shape[1]
    if b % 128 == 0 and rows.shape[0]:
        return _compat.platform_dependent(rows, tpu=lambda r: _decode_lanes(r, f), default=lambda r: _decode(r, f))
    return _decode(rows, f)


def _decode_lanes(rows: jax.Array, f: Fp8Format) -> jax.Array:
    """``fp8_decode`` through ``[n / 128, 128]`` lane rows (on TPU): the same values."""
    nb, b = rows.shape[0], 4 * (rows.shape[1] - 1)
    codes = unpack_lane_rows(rows[:, :-1], 8, b)
    value = lax.bitcast_convert_type(codes.astype(jnp.uint8), f.dtype).astype(jnp.float32)
    step = jnp.repeat(lax.bitcast_convert_type(rows[:, -1], jnp.float32) / f.fmax, b // 128)[:, None]
    return fence(value * step, step).reshape(nb, b)


def _decode(rows: jax.Array, f: Fp8Format) -> jax.Array:
    words = rows[:, :-1]
    codes = jnp.concatenate([(words >> (8 * j)) & 0xFF for j in range(4)], axis=1)
    value = lax.bitcast_convert_type(codes.astype(jnp.uint8), f.dtype).astype(jnp.float32)
    step = (lax.bitcast_convert_type(rows[:, -1], jnp.float32) / f.fmax)[:, None]
    return fence(value * step, step)
