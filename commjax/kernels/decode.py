"""Unpack + dequantize (+ accumulate over replicas) of scaled-code rows.

Every scaled block codec (quantize, QSGD, TernGrad, sign) decodes a row
``[pack(c) | bitcast_u32(s)]`` of ``B`` codes the same way, with its own constants::

    l_i     = c_i - offset                 (step 1: quantize, QSGD, TernGrad)
            = 2 c_i - 1                    (step 2, offset 1: sign, l in {-1, +1})
    y_hat_i = l_i * (s / divisor)          (divisor None: l_i * s)

:func:`decode_rows` decodes one payload ``uint32[nb, R] -> float32[nb, B]``.
:func:`decode_sum` decodes the ``N`` payloads a replica receives in the two-phase
reducer (or the all-gather reducer), ``uint32[N, nb, R] -> float32[nb, B]``, and sums them
in replica order in fp32, starting from zeros exactly like the reducers' loop::

    acc = 0;  for r in 0..N-1:  acc = acc + round_fp32(decode(rows[r]))

so that the sum is deterministic and identical on every replica. Each decoded value is
rounded to fp32 before it is added (:func:`commjax.kernels._dispatch.fence`, in the
reference and the kernels): left alone, compilers fuse ``acc + l * q`` into a
multiply-add, and whether they do depends on fusion decisions, which differ between a
kernel and XLA's graph (seen on CPU: XLA fuses all ``N`` decodes and their sum into one
loop and contracts some of the products). The kernel reads each
payload once (``bits / 8 + 4 / B`` bytes per element and replica) and writes the fp32
sum once (4 bytes per element), where the reference materialises ``N`` decoded vectors.

Lowerings: Mosaic TPU and interpret mode (``pallas_call`` over (row tiles, replicas),
the replica axis innermost and accumulated in the output block); Mosaic GPU
(:mod:`commjax.kernels.mosaic_gpu`). Blocks whose size is not a multiple of 32 use the
reference everywhere.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from commjax import packing
from commjax.kernels._bits import unpack_tile
from commjax.kernels._dispatch import dispatch, fence, out_type, vary_like
from commjax.kernels._tiling import row_call, tile_rows

__all__ = ["decode_rows", "decode_sum", "decode_reference", "decode_sum_reference"]


def decode_reference(rows: jax.Array, *, bits: int, block_size: int, offset: int, step: int,
                     divisor: Optional[int], fenced: bool = False) -> jax.Array:
    """The pure-jnp oracle: exactly the codecs' ``decode_blocks`` (``fenced``: each value
    rounded before any later addition, as :func:`decode_sum` needs)."""
    codes = packing.unpack_codes(rows[:, :-1], bits, block_size)
    scale = lax.bitcast_convert_type(rows[:, -1], jnp.float32)
    if step == 1:
        lv = (codes.astype(jnp.int32) - offset).astype(jnp.float32)
    else:
        lv = codes.astype(jnp.float32) * float(step) - float(offset)
    q = scale[:, None] if divisor is None else (scale / divisor)[:, None]
    return fence(lv * q, q) if fenced else lv * q


def decode_sum_reference(rows: jax.Array, **opts: Any) -> jax.Array:
    """Sum of :func:`decode_reference` over the leading (replica) axis, in order, from zeros."""
    total = jnp.zeros((rows.shape[1], opts["block_size"]), jnp.float32)
    for r in range(rows.shape[0]):
        total = total + decode_reference(rows[r], fenced=True, **opts)
    return total


def row_steps(rows: jax.Array, divisor: Optional[int]) -> jax.Array:
    """Per-row ``float32[..., 1]`` step ``q = s / divisor`` (``s`` if None), by XLA with the
    reference's expression: XLA turns a division by a constant into a multiplication by
    its reciprocal, which a kernel compiler need not do the same way."""
    scale = lax.bitcast_convert_type(rows[..., -1], jnp.float32)
    return (scale if divisor is None else scale / divisor)[..., None]


def decode_tile(row, q, *, bits: int, block_size: int, offset: int, step: int, fenced: bool = False):
    """One tile of rows, as every kernel body computes it (values, not refs): ``q`` is
    the tile's ``[T, 1]`` slice of :func:`row_steps`."""
    nw = row.shape[1] - 1
    codes = unpack_tile(row[:, :nw], bits, block_size)
    if step == 1:
        lv = (codes.astype(jnp.int32) - offset).astype(jnp.float32)
    else:
        lv = codes.astype(jnp.float32) * float(step) - float(offset)
    return fence(lv * q, q) if fenced else lv * q


def _decode_pallas(rows, *, tile, divisor, interpret: Any = False, **opts):
    n, r = rows.shape
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
        value = decode_tile(r_ref[...], q_ref[...], fenced=True, **opts)
        k = pl.program_id(1)

        @pl.when(k == 0)
        def _first():
            o_ref[...] = jnp.zeros_like(value) + value

        @pl.when(k > 0)
        def _rest():
            o_ref[...] = o_ref[...] + value

    kwargs: dict[str, Any] = {}
    if not interpret:
        from jax.experimental.pallas import tpu as pltpu

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


def _options(bits: int, block_size: int, offset: int, step: int, divisor: Optional[int]) -> dict:
    if not 1 <= bits <= 16:
        raise ValueError(f"decode: `bits` must be in [1, 16], got {bits!r}.")
    if step not in (1, 2):
        raise ValueError(f"decode: `step` must be 1 or 2, got {step!r}.")
    return dict(bits=int(bits), block_size=int(block_size), offset=int(offset), step=int(step),
                divisor=None if divisor is None else int(divisor))


def decode_rows(rows: jax.Array, *, bits: int, block_size: int, offset: int, step: int = 1,
                divisor: Optional[int] = None, tile: Optional[int] = None) -> jax.Array:
    """Decode one payload ``uint32[nb, bits * ceil(B/32) + 1] -> float32[nb, B]``."""
    opts = _options(bits, block_size, offset, step, divisor)
    if rows.ndim != 2 or rows.shape[1] != packing.packed_words(block_size, bits) + 1:
        raise ValueError(f"decode_rows: expected rows of {packing.packed_words(block_size, bits) + 1} "
                         f"words for bits={bits}, block_size={block_size}; got shape {rows.shape}.")
    reference = functools.partial(decode_reference, **opts)
    if block_size % 32 or rows.shape[0] == 0:
        return reference(rows)
    kernel = functools.partial(_decode_pallas, tile=tile, **opts)
    from commjax.kernels import mosaic_gpu

    gpu = mosaic_gpu.decode_kernel(rows, accumulate=False, **opts)
    return dispatch("decode", reference, tpu=kernel, gpu=gpu, interpret=kernel, args=(rows,))


def decode_sum(rows: jax.Array, *, bits: int, block_size: int, offset: int, step: int = 1,
               divisor: Optional[int] = None, tile: Optional[int] = None) -> jax.Array:
    """Decode ``N`` payloads ``uint32[N, nb, R]`` and sum them in replica order: ``float32[nb, B]``."""
    opts = _options(bits, block_size, offset, step, divisor)
    if rows.ndim != 3 or rows.shape[2] != packing.packed_words(block_size, bits) + 1:
        raise ValueError(f"decode_sum: expected [N, num_blocks, {packing.packed_words(block_size, bits) + 1}] "
                         f"rows for bits={bits}, block_size={block_size}; got shape {rows.shape}.")
    reference = functools.partial(decode_sum_reference, **opts)
    if block_size % 32 or rows.shape[1] == 0 or rows.shape[0] == 0:
        return reference(rows)
    kernel = functools.partial(_decode_sum_pallas, tile=tile, **opts)
    from commjax.kernels import mosaic_gpu

    gpu = mosaic_gpu.decode_kernel(rows, accumulate=True, **opts)
    return dispatch("decode_sum", reference, tpu=kernel, gpu=gpu, interpret=kernel, args=(rows,))
