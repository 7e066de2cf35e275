"""The pure-jnp references of the codec kernels, and the per-row constants every
implementation takes from XLA.

Each kernel of [`commjax.kernels`][] computes the same bits as its reference here; the
references are the codecs' own arithmetic and the oracle of the tests. This module is
the one the Pallas kernels (``commjax.kernels.quantize``, ``sign``, ``decode``, ``fp8``)
import.

Rounding rules shared by every implementation (why: XLA's CPU backend, LLVM and kernel
compilers each decide for themselves whether to contract ``a * b + c`` into one fused
multiply-add, and the decision depends on everything else fused into the same loop):

* every product that meets a later addition goes through [`fence`][commjax.kernels.reference.fence]
  first, so it is
  rounded to fp32 in every implementation and whatever the fusion: the quantizer's
  ``q = y * (L / s)`` before ``+ u``, and every decoded value ``l * step`` before it
  is subtracted (the residual), summed (``decode_sum``) or handed to the caller;
* per-row constants (``L / s``, ``s / L``, ``mean |y|``) are computed by XLA with one
  expression (``row_constants``, ``row_scales``, ``row_steps``) and passed
  to the kernels: XLA rewrites a division by a constant as a multiplication by its
  reciprocal, and a row sum's order depends on the whole array's shape, which no
  kernel can reproduce.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat
from commjax import packing
from commjax.kernels._dispatch import fence

__all__ = [
    "safe_recip",
    "feedback_sum",
    "row_constants",
    "row_prescale",
    "TINY",
    "quantize_reference",
    "row_absmax",
    "row_scales",
    "sign_reference",
    "row_steps",
    "decode_reference",
    "decode_sum_reference",
]


def safe_recip(s: jax.Array, numerator: float = 1.0) -> jax.Array:
    """``numerator / s``, and 0 where ``s == 0`` (an all-zero block). One quotient, not
    ``numerator * (1 / s)``: ``1 / s`` is subnormal for ``s > 2**126`` and CPUs flush it to
    zero, which encoded every block of a huge gradient as zeros."""
    return jnp.where(s > 0, numerator / jnp.where(s > 0, s, 1.0), 0.0)


# --------------------------------------------------------------------------- quantize


def feedback_sum(x: jax.Array, residual: Optional[jax.Array]) -> jax.Array:
    """``y = x + e`` of rows ``[nb, B]``, as a flat ``float32[nb * B]``: each consumer
    reshapes it to rows itself (``y.reshape(x.shape)``, one reshape per consumer).

    Why flat: where a consumer takes the flat ``y`` as it is (the conditional of
    ``row_scales``), XLA's CPU fusion writes ``y`` once and the scale reduction, the
    packing and the residual each read it. Added in row shape, the sum is fused, as
    ``add(bitcast x, bitcast e)``, into the packing and the residual as well, which then
    read ``x`` and ``e`` again: two more passes over the block per sign encode
    (``benchmarks/step_traffic.py``). The quantizers' packing and residual still form
    ``y`` themselves inside a training step, either way. The bits are the same.
    """
    flat = x.reshape(-1)
    return flat if residual is None else flat + residual.astype(jnp.float32).reshape(-1)


def row_absmax(y: jax.Array) -> jax.Array:
    """``float32[nb]``: each row's ``max |y|``; NaN where the row holds a NaN.

    Taken on the bit patterns: with the sign bit cleared, float32 patterns order as int32
    the way ``|y|`` does, NaN's above ``+inf``. So the max is exact and a NaN anywhere in
    the row wins, where XLA's CPU float max (a YNNPACK reduction) drops it. In two steps,
    over 8 then over the rest, split by a barrier: XLA fuses the reduction over 8 into
    the loop that forms ``y`` (reading ``x`` and ``e`` once, writing an eighth), while a
    whole-row reduction is rewritten into a reduce-window that takes ``|y|`` written out
    first: one more write and read of the block per step (``benchmarks/step_traffic.py``).
    """
    bits = lax.bitcast_convert_type(y.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
    nb, b = bits.shape
    step = 8 if b % 8 == 0 else b

    def split(v):  # CPU: see above
        part = lax.optimization_barrier(jnp.max(v.reshape(nb, b // step, step), axis=2))
        return jnp.max(part, axis=1)

    # TPU and GPU reduce a row in one fusion; the split's [nb, b / 8, 8] intermediate has
    # a minor dimension of 8, which a TPU pads to 128 lanes (16x its bytes).
    top = _compat.platform_dependent(bits, cpu=split, default=lambda v: jnp.max(v, axis=1))
    return lax.bitcast_convert_type(top, jnp.float32)


#: The smallest normal fp32, ``2**-126``: products below it are flushed to zero by XLA on
#: CPU, by TPUs and by GPU code compiled with flush-to-zero.
TINY = 2.0 ** -126
#: The per-row pre-scale of ``row_prescale`` for huge rows, ``2**-64``.
HUGE_PRESCALE = 2.0 ** -64


def row_prescale(scale: jax.Array, levels: float) -> Optional[jax.Array]:
    """``float32[nb]`` factors ``p`` with ``q = (y p) (L / (s p))``, or ``None`` when no
    row needs one.

    ``L / s`` is subnormal (flushed to zero) for ``s > L * 2**126``, which a finite ``s``
    can reach only when ``L < 4`` (2-bit codes, TernGrad). Such rows are pre-scaled by
    ``2**-64`` (exact for every element that matters: one below ``2**-62`` would round
    to level 0 anyway) so that ``L / (s p)`` is normal; every other row has ``p = 1``.
    """
    if levels * 2.0 ** 126 >= float(jnp.finfo(jnp.float32).max):
        return None
    return jnp.where(scale > levels * 2.0 ** 126, HUGE_PRESCALE, 1.0).astype(jnp.float32)


def row_constants(x: jax.Array, residual: Optional[jax.Array], *, levels: float):
    """Per-row ``(s, c, s / L)`` of ``y = x + e`` with ``c = L / (s p)``
    (``row_prescale``; ``p = 1`` but for huge rows of ``L < 4``), 0 where ``s = 0``.

    ``s`` is the absmax ``max |y|``, exact in any order, with two floors and a flag:

    * NaN when the row holds a NaN or an Inf, so it decodes to NaN on every replica;
    * ``L * 2**-126`` when ``0 < max |y| <`` that: then ``L / s`` (``2**126``) is finite
      and the step ``s / L`` (``2**-126``) is normal. A smaller ``s`` would make ``L / s``
      overflow (``0 * inf`` is NaN: finite blocks decoded as NaN) or the step subnormal
      (flushed: the block decoded as zeros). Such a block is quantized on the grid of
      step ``2**-126``: absolute error at most half a step (nearest), decoded values
      below ``2**-126`` flushed to zero.

    The quotients are XLA's; kernels take them as inputs (one extra read of ``x`` and
    ``e``) rather than dividing themselves.
    """
    return absmax_constants(row_absmax(feedback_sum(x, residual).reshape(x.shape)), levels=levels)


def absmax_constants(scale: jax.Array, *, levels: float):
    """``row_constants`` from each row's ``max |y|`` (NaN for a NaN row)."""
    scale = jnp.where(jnp.isinf(scale), jnp.nan, scale)
    floor = levels * TINY
    scale = jnp.where((scale > 0) & (scale < floor), floor, scale)
    pre = row_prescale(scale, levels)
    return scale, safe_recip(scale if pre is None else scale * pre, float(levels)), scale / levels


def grid_codes(q: jax.Array, u: Optional[jax.Array], *, levels: int, midrise: bool) -> jax.Array:
    """Non-negative int32 codes of ``q = y * (K / s)`` (in ``[-K, K]``), ``u`` the noise or
    ``None`` for nearest rounding (half to even).

    Midtread (``K = L``, a zero level): ``clip(R(q), -L, L) + L``, codes ``0..2L``.
    Midrise (``K = 2**bits - 1``, odd, no zero level: every code is used):
    ``clip(R((q + K) / 2), 0, K)``, the level ``2 c - K`` of step 2."""
    if midrise:
        h = (q + float(levels)) * 0.5  # exact halving: no fused multiply-add can change it
        r = jnp.floor(h + u) if u is not None else jnp.round(h)
        return jnp.clip(r, 0, levels).astype(jnp.int32)
    r = jnp.floor(q + u) if u is not None else jnp.round(q)
    return (jnp.clip(r, -levels, levels) + levels).astype(jnp.int32)


def grid_levels(codes: jax.Array, *, levels: int, midrise: bool) -> jax.Array:
    """fp32 signed levels of ``grid_codes``' codes (multiply by ``s / K``): ``c - L``
    (midtread) or ``2 c - K`` (midrise); the wire decoders' ``levels_of`` with step 1
    or 2."""
    return levels_of(codes, offset=levels, step=2 if midrise else 1)


def quantize_reference(
    x: jax.Array,
    uniforms: Optional[jax.Array],
    residual: Optional[jax.Array],
    *,
    bits: int,
    levels: int,
    output: Optional[str],
    midrise: bool = False,
) -> tuple[jax.Array, Optional[jax.Array]]:
    """Blockwise absmax quantization of the rows of ``x`` (maths in
    ``commjax.kernels.quantize``): ``(rows, decoded | residual | None)``.

    On TPU, blocks of whole 128-lane rows are computed on the flat vector seen as
    ``[n / 128, 128]`` (``quantize_lane_rows``, the same bits): that view is the
    vector's own memory layout there, while ``[nb, B]`` is a relayout of every input
    and output (the v5e int8 mean of a 21M-parameter MLP: ``benchmarks/aot.py``)."""
    kw = dict(bits=bits, levels=levels, output=output, midrise=midrise)
    if x.shape[1] % 128 or not packing.sliced(bits) or x.shape[0] == 0:
        return quantize_block_rows(x, uniforms, residual, **kw)
    return by_platform(quantize_lane_rows, quantize_block_rows, x, uniforms, residual, **kw)


def by_platform(lane_fn: Any, block_fn: Any, x: jax.Array, uniforms: Optional[jax.Array],
                residual: Optional[jax.Array], **kw: Any) -> Any:
    """``lane_fn(x, uniforms, residual, **kw)`` when lowered for TPU, ``block_fn(...)``
    elsewhere (``lax.platform_dependent``; absent operands stay ``None``)."""
    present = [a is not None for a in (uniforms, residual)]

    def bind(fn):
        def call(x, *rest):
            it = iter(rest)
            u, e = (next(it) if p else None for p in present)
            return fn(x, u, e, **kw)
        return call

    ops = [a for a in (uniforms, residual) if a is not None]
    return _compat.platform_dependent(x, *ops, tpu=bind(lane_fn), default=bind(block_fn))


def quantize_lane_rows(x, uniforms, residual, *, bits: int, levels: int, output: Optional[str],
                       midrise: bool = False):
    """``quantize_block_rows`` computed on ``[n / 128, 128]`` lane rows (``B % 128 == 0``,
    ``bits`` dividing 32): the same words, scales and output, bit for bit."""
    nb, b = x.shape
    m = b // 128
    y = feedback_sum(x, residual).reshape(-1, 128)
    scale, c, step = lane_absmax_constants(y, nb, levels=levels)
    pre = row_prescale(scale, levels)
    c = jnp.repeat(c, m)[:, None]
    yp = y if pre is None else fence(y * jnp.repeat(pre, m)[:, None], c)
    q = fence(yp * c, c)
    u = None if uniforms is None else uniforms.reshape(-1, 128)
    codes = grid_codes(q, u, levels=levels, midrise=midrise).astype(jnp.uint32)
    if uniforms is not None and output is not None:
        codes = _codes_once(codes, bits)
    words = packing.pack_lane_rows(codes, bits, b)
    rows = jnp.concatenate([words, lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)[:, None]], axis=1)
    if output is None:
        return rows, None
    step = jnp.repeat(step, m)[:, None]
    decoded = fence(grid_levels(codes, levels=levels, midrise=midrise) * step, step)
    out = decoded if output == "decoded" else y - decoded
    return rows, out.reshape(nb, b)


def lane_absmax_constants(lanes: jax.Array, nb: int, *, levels: float):
    """``row_constants`` of ``nb`` blocks given as their lane rows ``[n / 128, 128]``: the
    max of the rows' maxima (on the bit patterns, as ``row_absmax``: exact, NaN wins)."""
    bits = lax.bitcast_convert_type(lanes, jnp.int32) & 0x7FFFFFFF
    top = jnp.max(jnp.max(bits, axis=1).reshape(nb, -1), axis=1)
    return absmax_constants(lax.bitcast_convert_type(top, jnp.float32), levels=levels)


def _codes_once(codes: jax.Array, bits: int) -> jax.Array:
    """Stochastic codes that feed both the packing and the decode. On CPU written once as
    bytes (hashing the noise again in each consumer's loop cost more than the bytes);
    elsewhere left to the compiler, which recomputes the noise where it is read: the
    barrier's write and two reads of the codes were a v5e int8 step's largest cost (21M
    MLP: 1644 -> 1073 MB without it) and 62 MB of the H100's (1026 -> 964 MB)."""
    narrow = jnp.uint8 if bits <= 8 else jnp.uint16  # codes < 2**bits

    def once(c):
        return lax.optimization_barrier(c.astype(narrow)).astype(jnp.uint32)
    return _compat.platform_dependent(codes, cpu=once, default=lambda c: c)


def quantize_block_rows(x, uniforms, residual, *, bits: int, levels: int, output: Optional[str],
                        midrise: bool = False):
    """``quantize_reference`` on ``[nb, B]`` block rows."""
    y = feedback_sum(x, residual)
    scale, c, step = row_constants(y.reshape(x.shape), None, levels=levels)
    x = y.reshape(x.shape)
    c = c[:, None]
    pre = row_prescale(scale, levels)
    q = fence((x if pre is None else fence(x * pre[:, None], c)) * c, c)
    codes = grid_codes(q, uniforms, levels=levels, midrise=midrise).astype(jnp.uint32)
    if uniforms is not None and output is not None:
        codes = _codes_once(codes, bits)
    words = packing.pack_codes(codes, bits)
    scale_word = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    rows = jnp.concatenate([words, scale_word[:, None]], axis=1)
    if output is None:
        return rows, None
    step = step[:, None]
    decoded = fence(grid_levels(codes, levels=levels, midrise=midrise) * step, step)
    return rows, decoded if output == "decoded" else x - decoded


# --------------------------------------------------------------------------- sign


def row_scales(x: jax.Array, residual: Optional[jax.Array]) -> jax.Array:
    """``float32[nb, 1]``: each row's ``mean |x + e|``, XLA's reduction.

    The sum is divided by ``B``, unless some row's sum overflowed: then every term is
    divided before the sum (a conditional, taken only on such a step), so that a mean of
    finite values never overflows. Dividing each term always would cost a pass: XLA's CPU
    reductions take the constant ``1/B`` as a full-size materialised operand, written and
    read once more per step. For a power-of-two ``B`` both orders give the same bits
    (scaling by a power of two commutes with rounding), down to subnormal terms.
    """
    y, shape = feedback_sum(x, residual), x.shape
    if shape[1] % 128 or shape[0] == 0:
        return _block_mean_abs(y, shape)
    # On TPU summed over 128-lane rows, then over each block's rows: the flat vector's own
    # layout there (kernels and reference take these same scales).
    fused = 4 * math.prod(shape) <= _FUSED_SCALES_BYTES
    return _compat.platform_dependent(y, tpu=lambda v: _block_mean_abs(v, (-1, 128), shape, fused=fused),
                                  default=lambda v: _block_mean_abs(v, shape))


#: On TPU, the scales of at most this many fp32 bytes (a bucket's) are taken without a
#: conditional (``_block_mean_abs``'s ``fused``). v5e, sign with error feedback: in 4 MB
#: buckets the MLP 720 -> 619 MB a step, GPT-2 small 4,288 -> 3,576; in one bucket the MLP
#: went 942 -> 1,142 MB fused (``y``, written once as the conditional's operand, was
#: then formed again by each pass that reads it).
_FUSED_SCALES_BYTES = 8 << 20


def _block_mean_abs(y: jax.Array, view: tuple, shape: Optional[tuple] = None, *,
                    fused: bool = False) -> jax.Array:
    """``row_scales`` of the flat ``y``, each block summed in the ``view`` of it (a block
    row, or its lane rows then those rows' sums). ``fused``: both sums every step, a
    block's divided one where its plain one overflowed, and no conditional, whose operand
    ``y`` XLA writes out (``_FUSED_SCALES_BYTES``)."""
    shape = view if shape is None else shape
    inv = 1.0 / shape[1]

    def total_of(v, divide: bool = False):
        a = jnp.abs(v.reshape(view))
        t = jnp.sum(a * inv if divide else a, axis=1)
        return t if view == shape else jnp.sum(t.reshape(shape[0], -1), axis=1)

    total = total_of(y)
    if fused:
        return jnp.where(jnp.isinf(total), total_of(y, True), total * inv)[:, None]
    # The flat sum is the conditional's operand (see feedback_sum).
    scale = lax.cond(jnp.any(jnp.isinf(total)), lambda v: total_of(v, True), lambda v: total * inv, y)
    return scale[:, None]


def sign_reference(
    x: jax.Array, residual: Optional[jax.Array], *, output: Optional[str]
) -> tuple[jax.Array, Optional[jax.Array]]:
    """Scaled sign of the rows of ``x`` (maths in ``commjax.kernels.sign``).

    ``(2 b - 1) * s`` is ``+-s`` exactly, so the decoded value needs no fence. On TPU,
    blocks of whole lane rows are computed as ``[n / 128, 128]`` (``sign_lane_rows``)."""
    if x.shape[1] % 128 or x.shape[0] == 0:
        return sign_block_rows(x, residual, output=output)
    return by_platform(lambda x, _, e, **kw: sign_lane_rows(x, e, **kw),
                       lambda x, _, e, **kw: sign_block_rows(x, e, **kw), x, None, residual, output=output)


def sign_lane_rows(x: jax.Array, residual: Optional[jax.Array], *, output: Optional[str]):
    """``sign_block_rows`` computed on ``[n / 128, 128]`` lane rows: the same words and
    output for the same scales."""
    nb, b = x.shape
    y = feedback_sum(x, residual)
    scale = row_scales(y.reshape(x.shape), None)
    lanes = y.reshape(-1, 128)
    bits = (lanes >= 0).astype(jnp.uint32)
    words = packing.pack_lane_rows(bits, 1, b)
    rows = jnp.concatenate([words, lax.bitcast_convert_type(scale, jnp.uint32)], axis=1)
    if output is None:
        return rows, None
    decoded = (bits.astype(jnp.float32) * 2.0 - 1.0) * jnp.repeat(scale, b // 128, axis=0)
    out = decoded if output == "decoded" else lanes - decoded
    return rows, out.reshape(nb, b)


def sign_block_rows(x: jax.Array, residual: Optional[jax.Array], *, output: Optional[str]):
    """``sign_reference`` on ``[nb, B]`` block rows."""
    y = feedback_sum(x, residual)
    scale = row_scales(y.reshape(x.shape), None)
    x = y.reshape(x.shape)
    bits = (x >= 0).astype(jnp.uint32)
    words = packing.pack_codes(bits, 1)
    rows = jnp.concatenate([words, lax.bitcast_convert_type(scale, jnp.uint32)], axis=1)
    if output is None:
        return rows, None
    decoded = (bits.astype(jnp.float32) * 2.0 - 1.0) * scale
    return rows, decoded if output == "decoded" else x - decoded


# --------------------------------------------------------------------------- decode


def row_steps(rows: jax.Array, divisor: Optional[int]) -> jax.Array:
    """Per-row ``float32[..., 1]`` step ``s / divisor`` (``s`` when ``divisor`` is None)
    of wire rows ``[... | bitcast_u32(s)]``, XLA's quotient."""
    scale = lax.bitcast_convert_type(rows[..., -1], jnp.float32)
    return (scale if divisor is None else scale / divisor)[..., None]


def levels_of(codes: jax.Array, *, offset: int, step: int) -> jax.Array:
    """Signed levels as fp32: ``c - offset`` (step 1) or ``2 c - 1`` (step 2, sign)."""
    if step == 1:
        return (codes.astype(jnp.int32) - offset).astype(jnp.float32)
    return codes.astype(jnp.float32) * float(step) - float(offset)


def decode_reference(rows: jax.Array, *, bits: int, block_size: int, offset: int, step: int,
                     divisor: Optional[int]) -> jax.Array:
    """``uint32[nb, R] -> float32[nb, B]``: ``fence(l * (s / divisor))`` per element.

    On TPU, blocks of whole 128-lane rows are decoded into ``[n / 128, 128]`` lane rows
    (``decode_lane_rows``, the same bits), the flat vector's own layout there."""
    opts = dict(bits=bits, block_size=block_size, offset=offset, step=step, divisor=divisor)
    if block_size % 128 or not packing.sliced(bits) or rows.shape[0] == 0:
        return decode_block_rows(rows, **opts)
    return _compat.platform_dependent(rows, tpu=lambda r: decode_lane_rows(r, **opts),
                                  default=lambda r: decode_block_rows(r, **opts))


def decode_lane_rows(rows: jax.Array, *, bits: int, block_size: int, offset: int, step: int,
                     divisor: Optional[int]) -> jax.Array:
    """``decode_block_rows`` through ``[n / 128, 128]`` lane rows: the same values."""
    codes = packing.unpack_lane_rows(rows[:, :-1], bits, block_size)  # [nb * m, 128]
    q = jnp.repeat(row_steps(rows, divisor), block_size // 128, axis=0)
    return fence(levels_of(codes, offset=offset, step=step) * q, q).reshape(rows.shape[0], block_size)


def decode_block_rows(rows: jax.Array, *, bits: int, block_size: int, offset: int, step: int,
                      divisor: Optional[int]) -> jax.Array:
    """``decode_reference`` on ``[nb, B]`` block rows."""
    codes = packing.unpack_codes(rows[:, :-1], bits, block_size)
    q = row_steps(rows, divisor)
    return fence(levels_of(codes, offset=offset, step=step) * q, q)


def decode_sum_reference(rows: jax.Array, **opts: Any) -> jax.Array:
    """Sum of ``decode_reference`` over the leading (replica) axis, in order, from the
    first term (not from zeros: ``0 + v`` is ``v`` but for ``v = -0``, and compilers fold
    the addition in some programs and not in others, so a sum from zeros ended in ``-0``
    or ``+0`` depending on the program)."""
    if rows.shape[0] == 0:
        return jnp.zeros((rows.shape[1], opts["block_size"]), jnp.float32)
    total = decode_reference(rows[0], **opts)
    for r in range(1, rows.shape[0]):
        total = total + decode_reference(rows[r], **opts)
    return total
