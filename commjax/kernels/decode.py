"""Unpack + dequantize (+ accumulate over replicas) of scaled-code rows.

Every scaled block codec (quantize, QSGD, TernGrad, sign) decodes a row
``[pack(c) | bitcast_u32(s)]`` of ``B`` codes the same way, with its own constants::

    l_i     = c_i - offset                 (step 1: quantize, QSGD, TernGrad)
            = 2 c_i - 1                    (step 2, offset 1: sign, l in {-1, +1})
    y_hat_i = l_i * (s / divisor)          (divisor None: l_i * s)

[`decode_rows`][commjax.kernels.decode.decode_rows] decodes one payload ``uint32[nb, R] ->
float32[nb, B]``.
[`decode_sum`][commjax.kernels.decode.decode_sum] decodes the ``N`` payloads a replica receives in
the two-phase
reducer (or the all-gather reducer), ``uint32[N, nb, R] -> float32[nb, B]``, and sums them
in replica order in fp32, from the first payload's values::

    acc = round_fp32(decode(rows[0]));  for r in 1..N-1:  acc = acc + round_fp32(decode(rows[r]))

so that the sum is deterministic and identical on every replica. Every decoded value,
summed or not, is rounded to fp32 before any later use
([`commjax.kernels._dispatch.fence`][], in the reference and the kernels): left
alone, a compiler may fuse ``acc + l * q`` (or a caller's ``p + l * q``) into a
multiply-add, and whether it does depends on what else is fused into the same loop,
which differs between a kernel and XLA's graph of the reference. The kernel reads each
payload once (``bits / 8 + 4 / B`` bytes per element and replica) and writes the fp32
sum once (4 bytes per element), where the reference materialises ``N`` decoded vectors.

Lowerings: Mosaic TPU and interpret mode (``pallas_call`` over (row tiles, replicas),
the replica axis innermost and accumulated in the output block). Blocks of whole 128-lane
rows whose packed words fill or evenly share a row (``_tiling.lane_rowable``) are
written as lane rows ``[n / 128, 128]``, each block's scale read from its own row; other
blocks as ``[nb, B]`` rows with the steps computed by XLA. No GPU kernel: on CUDA
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from commjax import packing
from commjax.kernels._bits import unpack_tile
from commjax.kernels._dispatch import dispatch, fence, out_type, resolve_impl, vary_like
from commjax.kernels._tiling import lane_rowable, lane_tile, row_call, tile_rows
from commjax.kernels.reference import decode_reference, decode_sum_reference, levels_of, row_steps

__all__ = ["decode_rows", "decode_sum"]


def decode_tile(row, q, *, bits: int, block_size: int, offset: int, step: int):
    """One tile of rows, as every kernel body computes it (values, not refs): ``q`` is
    the tile's ``[T, 1]`` slice of ``row_steps``."""
    codes = unpack_tile(row[:, :row.shape[1] - 1], bits, block_size)
    return fence(levels_of(codes, offset=offset, step=step) * q, q)


def _decode_pallas(rows, *, tile, divisor, interpret: Any = False, **opts):
    n = rows.shape[0]
    block = opts["block_size"]
    t = tile_rows(n, block, interpret=bool(interpret), tile=tile)

    def body(r_ref, q_ref, o_ref):
        o_ref[...] = decode_tile(r_ref[...], q_ref[...], **opts)

    (out,) = row_call(body, rows=n, tile=t, inputs=[rows, row_steps(rows, divisor)],
                      out_cols=[(block, jnp.float32)], interpret=interpret,
                      name=f"commjax_decode{opts['bits']}")
    return out


def _decode_sum_pallas(rows, *, tile, divisor, interpret: Any = False, **opts):
    replicas, n, r = rows.shape
    block = opts["block_size"]
    t = tile_rows(n, block, interpret=bool(interpret), tile=tile)

    def body(r_ref, q_ref, o_ref):
        value = decode_tile(r_ref[...], q_ref[...], **opts)
        k = pl.program_id(1)

        @pl.when(k == 0)
        def _first():
            o_ref[...] = value

        @pl.when(k > 0)
        def _rest():
            o_ref[...] = o_ref[...] + value

    kwargs: dict[str, Any] = {}
    if not interpret:
        kwargs["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
    steps = row_steps(rows, divisor)
    out = pl.pallas_call(
        body,
        out_shape=out_type((n, block), jnp.float32),
        grid=(pl.cdiv(n, t), replicas),
        in_specs=[pl.BlockSpec((None, t, r), lambda i, k: (k, i, 0)),
                  pl.BlockSpec((None, t, 1), lambda i, k: (k, i, 0))],
        out_specs=pl.BlockSpec((t, block), lambda i, k: (i, 0)),
        interpret=interpret,
        name=f"commjax_decode_sum{opts['bits']}",
        **kwargs,
    )(rows, steps)
    return vary_like(out, (rows, steps))


# --------------------------------------------------------------------------- lane rows


def _lane_codes(row: jax.Array, j: int, *, bits: int, block_size: int) -> jax.Array:
    """The codes of lane row ``j`` of each block of the wire rows ``row`` (``uint32[T, W
    + 1]``), ``uint32[T, 128]``: code ``p = 128 j + l`` is bits ``[b s, b s + b)`` of word
    ``p mod W``, ``s = p div W`` (``unpack_lane_rows``)."""
    w = packing.packed_words(block_size, bits)
    mask = jnp.uint32((1 << bits) - 1)
    if w >= 128:
        r, s = j % (w // 128), j // (w // 128)
        return (row[:, r * 128:(r + 1) * 128] >> jnp.uint32(bits * s)) & mask
    g = 128 // w
    tiled = jnp.concatenate([row[:, :w]] * g, axis=1) if g > 1 else row[:, :w]
    lane = lax.broadcasted_iota(jnp.int32, tiled.shape, 1)
    shift = (bits * (j * g + lax.div(lane, w))).astype(jnp.uint32)
    return (tiled >> shift) & mask


def _decode_lanes(rows, *, accumulate: bool, divisor, interpret: Any = False, **opts):
    """``decode_sum`` (``accumulate``) or, for one payload, ``decode_rows`` of ``uint32[N,
    nb, W + 1]`` rows, written as lane rows ``[nb m, 128]``: the flat vector's own layout
    on TPU, where ``[nb, B]`` rows are a relayout. Each payload is read once, the
    scale from its own row, and the sum written once."""
    replicas, nb, r = rows.shape
    bits, block = opts["bits"], opts["block_size"]
    m = block // 128
    lanes = nb * m
    tile = lane_tile(lanes, m, bool(interpret))
    tb = tile // m

    def body(r_ref, o_ref):
        row = r_ref[...]
        scale = lax.bitcast_convert_type(row[:, r - 1:r], jnp.float32)
        q = scale if divisor is None else scale / divisor
        k = pl.program_id(1)
        for j in range(m):
            codes = _lane_codes(row, j, bits=bits, block_size=block)
            value = fence(levels_of(codes, offset=opts["offset"], step=opts["step"]) * q, q)
            at = pl.ds(j, tb, stride=m)
            if not accumulate:
                o_ref[at, :] = value
                continue

            @pl.when(k == 0)
            def _first():
                o_ref[at, :] = value

            @pl.when(k > 0)
            def _rest():
                o_ref[at, :] = o_ref[at, :] + value

    kwargs: dict[str, Any] = {}
    if not interpret:
        kwargs["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
    out = pl.pallas_call(
        body, out_shape=out_type((lanes, 128), jnp.float32), grid=(pl.cdiv(lanes, tile), replicas),
        in_specs=[pl.BlockSpec((None, tb, r), lambda i, k: (k, i, 0))],
        out_specs=pl.BlockSpec((tile, 128), lambda i, k: (i, 0)),
        interpret=interpret, name=f"commjax_decode{bits}_lanes", **kwargs,
    )(rows)
    return vary_like(out, (rows,)).reshape(nb, block)


def _options(bits: int, block_size: int, offset: int, step: int, divisor: Optional[int]) -> dict:
    if not 1 <= bits <= 16:
        raise ValueError(f"decode: `bits` must be in [1, 16], got {bits!r}.")
    if step not in (1, 2):
        raise ValueError(f"decode: `step` must be 1 or 2, got {step!r}.")
    return dict(bits=int(bits), block_size=int(block_size), offset=int(offset), step=int(step),
                divisor=None if divisor is None else int(divisor))


def decode_rows(rows: jax.Array, *, bits: int, block_size: int, offset: int, step: int = 1,
                divisor: Optional[int] = None, tile: Optional[int] = None,
                impl: Optional[str] = None) -> jax.Array:
    """Decode one payload ``uint32[nb, packed_words(B, bits) + 1] -> float32[nb, B]``.
    ``impl``: as for [`commjax.kernels.quantize_blocks`][]."""
    opts = _options(bits, block_size, offset, step, divisor)
    words = packing.packed_words(block_size, bits) + 1
    if rows.ndim != 2 or rows.shape[1] != words:
        raise ValueError(f"decode_rows: expected rows of {words} words for bits={bits}, "
                         f"block_size={block_size}; got shape {rows.shape}.")
    impl = resolve_impl(impl, "decode_rows")
    reference = functools.partial(decode_reference, **opts)
    if block_size % 32 or rows.shape[0] == 0:
        return reference(rows)
    if lane_rowable(block_size, bits):
        def kernel(rows, **kw):
            return _decode_lanes(rows[None], accumulate=False, **opts, **kw)
    else:
        kernel = functools.partial(_decode_pallas, tile=tile, **opts)
    return dispatch(reference, impl=impl, tpu=kernel, interpret=kernel, args=(rows,))


def decode_sum(rows: jax.Array, *, bits: int, block_size: int, offset: int, step: int = 1,
               divisor: Optional[int] = None, tile: Optional[int] = None,
               impl: Optional[str] = None) -> jax.Array:
    """Decode ``N`` payloads ``uint32[N, nb, R]`` and sum them in replica order: ``float32[nb, B]``.
    ``impl``: as for [`commjax.kernels.quantize_blocks`][]."""
    opts = _options(bits, block_size, offset, step, divisor)
    words = packing.packed_words(block_size, bits) + 1
    if rows.ndim != 3 or rows.shape[2] != words:
        raise ValueError(f"decode_sum: expected [N, num_blocks, {words}] rows for bits={bits}, "
                         f"block_size={block_size}; got shape {rows.shape}.")
    impl = resolve_impl(impl, "decode_sum")
    reference = functools.partial(decode_sum_reference, **opts)
    if block_size % 32 or rows.shape[1] == 0 or rows.shape[0] == 0:
        return reference(rows)
    if lane_rowable(block_size, bits):
        kernel = functools.partial(_decode_lanes, accumulate=True, **opts)
    else:
        kernel = functools.partial(_decode_sum_pallas, tile=tile, **opts)
    return dispatch(reference, impl=impl, tpu=kernel, interpret=kernel, args=(rows,))
