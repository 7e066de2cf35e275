"""Row-tiled ``pallas_call`` plumbing shared by the kernels (TPU and interpret mode), and
the tiling of the lane-row kernels (``lane_rowable``, ``lane_tile``).

Every codec kernel works on *rows*: one row per codec block (``block_size`` floats in,
``row_words`` uint32 out). Rows are independent, so a kernel is a 1-D grid over tiles of
``tile`` rows; a ragged last tile reads padding rows whose results are discarded.

Tile sizes:

* TPU (Mosaic): ``tile`` is a multiple of 8 (sublanes) or the whole row count, and the
  block's last dimension is the whole row, as Mosaic requires (multiples of (8, 128) or
  the full array dimension). About 128K elements per f32 block keeps the double-buffered
  inputs and outputs of every kernel under 4 MiB of VMEM.
* interpret mode: each grid step of the interpreter costs time proportional to the whole
  array, so a handful of large tiles (at most ``_INTERPRET_STEPS``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from commjax.kernels._dispatch import out_type, vary_like

__all__ = ["tile_rows", "row_call", "TPU_TILE_ELEMENTS", "lane_rowable", "lane_tile"]

TPU_TILE_ELEMENTS = 1 << 17
_INTERPRET_STEPS = 4


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def tile_rows(rows: int, row_elements: int, *, interpret: bool, tile: Optional[int] = None) -> int:
    """Rows per grid step for ``rows`` rows of ``row_elements`` elements each."""
    if tile is not None:
        t = int(tile)
    elif interpret:
        t = _round_up(-(-rows // _INTERPRET_STEPS), 8)
    else:
        t = max(8, (TPU_TILE_ELEMENTS // max(row_elements, 1)) // 8 * 8)
    if t >= rows:
        return rows
    return max(8, t // 8 * 8)


def row_call(
    body: Callable[..., None],
    *,
    rows: int,
    tile: int,
    inputs: Sequence[jax.Array],
    out_cols: Sequence[tuple[int, Any]],
    interpret: Any = False,
    name: str,
) -> tuple[jax.Array, ...]:
    """``pallas_call`` of ``body(*in_refs, *out_refs)`` over tiles of ``tile`` rows.

    ``inputs`` are 2-D ``[rows, cols]``; output ``k`` is ``[rows, out_cols[k][0]]`` of
    dtype ``out_cols[k][1]``.
    """
    grid = (pl.cdiv(rows, tile),)
    in_specs = [pl.BlockSpec((tile, a.shape[1]), lambda i: (i, 0)) for a in inputs]
    out_specs = [pl.BlockSpec((tile, c), lambda i: (i, 0)) for c, _ in out_cols]
    out_shape = [out_type((rows, c), dt) for c, dt in out_cols]
    kwargs: dict[str, Any] = {}
    if not interpret:
        kwargs["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel",))
    outs = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        name=name,
        **kwargs,
    )(*inputs)
    return tuple(vary_like(outs, inputs))


def lane_rowable(block: int, bits: int) -> bool:
    """Whether blocks of ``block`` values can be quantized as ``[n / 128, 128]`` lane rows
    by the lane-row kernels: whole 128-lane rows, and a block's ``W`` packed words either
    whole rows (``W % 128 == 0``) or an equal share of one (``128 % W == 0``)."""
    if block % 128 or 32 % bits:
        return False
    w = block // (32 // bits)
    return w % 128 == 0 or 128 % w == 0


def lane_tile(lanes: int, m: int, interpret: bool) -> int:
    """Lane rows per grid step: a multiple of ``8 m`` (whole blocks, and ``8``-row blocks of
    wire rows), about ``TPU_TILE_ELEMENTS`` values on TPU, four steps in interpret mode."""
    unit = 8 * m
    t = -(-lanes // 4) if interpret else TPU_TILE_ELEMENTS // 128
    t = max(unit, -(-t // unit) * unit)
    return lanes if t >= lanes else t
