"""The one-pass lane-row encode shared by the absmax codecs' kernels (``quantize``,
``fp8``): the flat vector seen as ``[n / 128, 128]`` lane rows, its own layout on TPU.

Block ``b`` of ``B = 128 m`` values is lane rows ``b m .. b m + m - 1``; a grid step of
``tile`` lane rows reads each block's row ``j`` with stride ``m``, forms ``y = x + e``,
the block's absmax and constants (``reference.absmax_constants``: the floors, NaN for
a non-finite block), the codes (the codec's ``codes(y, c, u)``), the packed words
(``packing.pack_lane_rows``' format, from lane-aligned ORs and lane rotations) and the
requested output, all in registers: per element ``x`` (and ``e``) is read once and
``bits / 8 + 4 / B`` bytes of payload plus the output written once. Stochastic noise
comes from ``uniforms`` or is drawn in-kernel from a key at each value's position
([`commjax.noise.uniform_at`][]).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from commjax import noise, packing
from commjax.kernels._dispatch import fence, out_type, vary_like
from commjax.kernels._tiling import lane_tile
from commjax.kernels.reference import absmax_constants

__all__ = ["lane_encode", "lane_pack", "drawn", "check_noise"]


def lane_pack(codes: list, bits: int, block: int) -> jax.Array:
    """``pack_lane_rows`` of one tile, from the block's ``m`` lane rows given apart
    (``codes[j]``: row ``j`` of every block, ``uint32[T / m, 128]``), as lane-aligned
    ORs and lane rotations: ``uint32[T / m, max(W, 128)]``, word ``i`` in lane ``i``."""
    k = 32 // bits
    w, m = block // k, len(codes)
    if w >= 128:  # word row r: slots s at rows s W / 128 + r of the block
        return jnp.concatenate([
            functools.reduce(jnp.bitwise_or, [codes[s * (w // 128) + r] << jnp.uint32(bits * s)
                                             for s in range(k)])
            for r in range(w // 128)], axis=1)
    g = 128 // w  # slots per lane row: slot j g + l // W of row j sits in lane l
    comb = functools.reduce(jnp.bitwise_or, [codes[j] << jnp.uint32(bits * j * g) for j in range(m)])
    return functools.reduce(jnp.bitwise_or, [
        (pltpu.roll(comb, 128 - q * w, 1) if q else comb) << jnp.uint32(bits * q) for q in range(g)])


def _tile_noise(seed_ref, tile, m, j):
    """``commjax.noise.uniform`` at lane rows ``j, j + m, ...`` of this tile, drawn
    in-kernel: ``seed_ref`` holds ``(seed, start)`` as int32 (positions wrap mod 2**32)."""
    shape = (tile // m, 128)
    r = lax.broadcasted_iota(jnp.int32, shape, 0) * m + (j + pl.program_id(0) * tile)
    pos = r * 128 + lax.broadcasted_iota(jnp.int32, shape, 1) + seed_ref[1]
    seed = lax.bitcast_convert_type(jnp.full(shape, seed_ref[0], jnp.int32), jnp.uint32)
    return noise.uniform_at(lax.bitcast_convert_type(pos, jnp.uint32), seed)


def _write_rows(row_ref, words: jax.Array, scale: jax.Array, w: int) -> None:
    """Wire rows ``[words | bitcast_u32(s)]`` of ``W`` words into ``row_ref``."""
    scale_word = lax.bitcast_convert_type(scale, jnp.uint32)
    if w < 128:
        lane = lax.broadcasted_iota(jnp.int32, words.shape, 1)
        row = jnp.where(lane < w, words, jnp.where(lane == w, scale_word, jnp.uint32(0)))
        row_ref[...] = row[:, :w + 1]
    else:
        row_ref[:, :w] = words
        row_ref[:, w:w + 1] = scale_word


def _body(*refs, codes: Callable, bits, levels, block, tile, output, has_e, has_u, has_key):
    """One tile of ``tile`` lane rows (``tile / m`` blocks), in one pass over ``x``, ``e``."""
    refs = list(refs)
    seed = refs.pop(0) if has_key else None
    x_ref = refs.pop(0)
    u_ref = refs.pop(0) if has_u else None
    e_ref = refs.pop(0) if has_e else None
    row_ref = refs.pop(0)
    m = block // 128
    tb = tile // m

    def rows(ref, j):
        return ref[pl.ds(j, tb, stride=m), :].astype(jnp.float32)

    ys = [rows(x_ref, j) + rows(e_ref, j) if has_e else rows(x_ref, j) for j in range(m)]
    top = functools.reduce(jnp.maximum, [
        jnp.max(lax.bitcast_convert_type(y, jnp.int32) & 0x7FFFFFFF, axis=1, keepdims=True)
        for y in ys])
    scale, c, step = absmax_constants(lax.bitcast_convert_type(top, jnp.float32), levels=levels)
    noises = [rows(u_ref, j) if has_u else _tile_noise(seed, tile, m, j) if has_key else None
              for j in range(m)]
    coded = [codes(y, c, u) for y, u in zip(ys, noises)]
    _write_rows(row_ref, lane_pack([cd for cd, _ in coded], bits, block), scale,
                packing.packed_words(block, bits))
    if output is not None:
        out_ref = refs.pop(0)
        for j, (y, (_, value)) in enumerate(zip(ys, coded)):
            dec = fence(value * step, step)
            out_ref[pl.ds(j, tb, stride=m), :] = dec if output == "decoded" else y - dec


def lane_encode(x, uniforms, residual, key, start: int, *, codes: Callable, bits: int, levels: int,
                output: Optional[str], name: str, interpret: Any = False):
    """Encode ``x: float32[nb, B]`` (``lane_rowable`` blocks) in one pass over lane rows:
    ``(uint32[nb, W + 1] rows, float32[nb, B] output | None)``. ``codes(y, c, u)``
    returns the ``uint32`` codes of ``y`` scaled by ``c`` (noise ``u`` or ``None``) and
    their values before the step, ``levels`` the constants' ``L``; ``key`` (with
    ``start``) draws the noise in-kernel."""
    nb, block = x.shape
    m, w = block // 128, packing.packed_words(block, bits)
    lanes = nb * m
    tile = lane_tile(lanes, m, bool(interpret))
    arrays = [a.reshape(lanes, 128) for a in (x, uniforms, residual) if a is not None]
    specs = [pl.BlockSpec((tile, 128), lambda i: (i, 0)) for _ in arrays]
    if key is not None:
        seed = lax.bitcast_convert_type(noise.key_seed(key), jnp.int32)
        arrays.insert(0, jnp.stack([seed, lax.bitcast_convert_type(jnp.uint32(start & 0xFFFFFFFF), jnp.int32)]))
        specs.insert(0, pl.BlockSpec(memory_space=pltpu.SMEM))
    out_shape = [out_type((nb, w + 1), jnp.uint32)]
    out_specs = [pl.BlockSpec((tile // m, w + 1), lambda i: (i, 0))]
    if output is not None:
        out_shape.append(out_type((lanes, 128), jnp.float32))
        out_specs.append(pl.BlockSpec((tile, 128), lambda i: (i, 0)))
    body = functools.partial(_body, codes=codes, bits=bits, levels=levels, block=block, tile=tile,
                             output=output, has_e=residual is not None, has_u=uniforms is not None,
                             has_key=key is not None)
    kwargs: dict[str, Any] = {}
    if not interpret:
        kwargs["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel",))
    outs = pl.pallas_call(body, out_shape=out_shape, grid=(pl.cdiv(lanes, tile),), in_specs=specs,
                          out_specs=out_specs, interpret=interpret, name=name, **kwargs)(*arrays)
    outs = vary_like(outs, [a for a in (x, uniforms, residual) if a is not None])
    return outs[0], (outs[1].reshape(nb, block) if output is not None else None)


def check_noise(uniforms: Optional[jax.Array], key: Optional[jax.Array], where: str) -> None:
    """The encoders take their noise as ``uniforms`` or as ``noise_key``, not both."""
    if uniforms is not None and key is not None:
        raise ValueError(f"{where}: pass `uniforms` or `noise_key`, not both.")


def drawn(fn: Callable, start: int) -> Callable:
    """``fn(x, u, e, **kw)`` as ``run(x, u, e, key, **kw)``: with a ``key``,
    ``u = commjax.noise.uniform(key, x.shape, start=start)``, drawn where XLA fuses it.
    The references and block-row kernels take noise this way; ``lane_encode`` draws it
    in-kernel from the same key."""
    def run(x, u, e, key, **kw):
        return fn(x, u if key is None else noise.uniform(key, x.shape, start=start), e, **kw)
    return run
