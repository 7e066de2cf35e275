"""Mosaic GPU versions of the codec kernels (the default Pallas GPU backend of JAX).

Mosaic GPU keeps arrays in registers with explicit layouts, and the layout it reduces
along rows (``WGMMA``: ``[m, n]`` tiles with ``m % 64 == 0``, ``n % 8 == 0``) cannot split
a block row into its 32-element words in registers. So these kernels see the data as
**word rows**: a ``[nb, B]`` array of blocks is the ``[M, 32]`` array of its words
(``M = nb * B / 32``, a free reshape), a bit plane of the payload is one ``uint32`` per
word row (a sum over the 32 lanes of a row: an in-register row reduction), and
per-block quantities (scales) are handed in repeated once per word row (``4 / 32``
bytes per element). XLA does the small steps around the kernel:

* before: the per-block scales (``max |y|`` is exact in any order; ``mean |y|`` is
  XLA's own reduction, as the reference computes it), repeated per word row;
* after: the ``[bits, M]`` planes are interleaved into the wire rows
  ``[plane 0 | ... | plane bits-1 | scale]`` of each block (a transpose of the payload,
  ``bits / 8`` bytes per element, read and written once).

Each CTA handles ``TILE`` word rows (``TILE * 32`` elements) through a TMA pipeline
(GMEM -> SMEM -> registers -> SMEM -> GMEM, 128-byte swizzled tiles). Word rows past the
last whole tile (fewer than ``TILE``, i.e. < 4096 elements) are done by the reference
and written into the kernel's output in place.

Limits, where the reference runs instead: blocks whose word count ``B / 32`` does not
divide ``TILE`` (block sizes 32, 64, ..., 4096 are fine); ``floor`` has no Mosaic GPU
lowering, so stochastic rounding uses ``t - (t > v)`` with ``t`` the truncation (equal
codes for every finite ``v`` of the codec's range, ``|v| <= L + 1``).

Fused multiply-adds: ``q = y * (L / s)`` and the decoded value ``l * step`` go through
the integer fence of [`commjax.kernels._dispatch.fence`][] before they meet an addition,
as in the references, so no contraction choice of the GPU compiler changes a bit.

Not verified here: nothing of this file runs on a CPU machine. The tests check that
every kernel *lowers* for CUDA (Mosaic GPU's layout checks run at lowering), and run the
same word-row algorithm with plain jnp (``emulate=True``) against the references bit
for bit; the GPU run is ``benchmarks/gpu_check.sh``. Until it has passed, ``auto`` does
not run these kernels ([`commjax.kernels._dispatch.auto_impl`][]).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from commjax.kernels._dispatch import fence, vary_like
from commjax.kernels.reference import (decode_reference, decode_sum_reference, levels_of,
                                       quantize_reference, row_constants, row_scales,
                                       row_steps, sign_reference)

__all__ = ["TILE", "quantize_kernel", "sign_kernel", "decode_kernel", "supported"]

TILE = 128  # word rows per CTA: 4096 elements


def supported(block_size: int) -> bool:
    """Whether blocks of ``block_size`` elements fit the word-row tiling."""
    return block_size % 32 == 0 and TILE % (block_size // 32) == 0


# --------------------------------------------------------------------------- maths
# Per-tile arithmetic on word rows, shared by the kernels and the emulation. ``lane``
# is the lane index (0..31) broadcast to the tile; per-row inputs come broadcast.


def _floor(v: jax.Array) -> jax.Array:
    t = v.astype(jnp.int32).astype(jnp.float32)
    return t - jnp.where(t > v, 1.0, 0.0)


def _plane_words(codes: jax.Array, lane: jax.Array, bits: int) -> list:
    return [jnp.sum(((codes >> jnp.uint32(k)) & jnp.uint32(1)) << lane, axis=1) for k in range(bits)]


def _quantize_math(x, u, e, c, sl, lane, *, bits, levels, output):
    y = x if e is None else x + e
    q = fence(y * c, c)
    r = _floor(q + u) if u is not None else jnp.round(q)
    lv = jnp.minimum(jnp.maximum(r, float(-levels)), float(levels))
    codes = (lv + float(levels)).astype(jnp.int32)
    words = _plane_words(codes.astype(jnp.uint32), lane, bits)
    if output is None:
        return words, None
    decoded = fence((codes - levels).astype(jnp.float32) * sl, sl)
    return words, decoded if output == "decoded" else y - decoded


def _sign_math(x, e, s, lane, *, output):
    y = x if e is None else x + e
    b = (y >= 0).astype(jnp.uint32)
    words = _plane_words(b, lane, 1)
    if output is None:
        return words, None
    decoded = (b.astype(jnp.float32) * 2.0 - 1.0) * s
    return words, decoded if output == "decoded" else y - decoded


def _decode_math(planes, q, lane, *, bits, offset, step):
    codes = None
    for k in range(bits):
        bit = ((planes[k] >> lane) & jnp.uint32(1)) << jnp.uint32(k)
        codes = bit if codes is None else codes | bit
    return fence(levels_of(codes, offset=offset, step=step) * q, q)


# --------------------------------------------------------------------------- layout helpers


def _swizzled(block: tuple, index_map: Callable[..., Any]):
    if len(block) == 2:
        return plgpu.BlockSpec(block, index_map,
                               transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))
    return pl.BlockSpec(block, index_map)


def _load_rows(ref):
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)


def _load_col(ref, width: int = 32):
    """A ``[TILE]`` per-row vector, broadcast along the 32 lanes."""
    v = plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return lax.broadcast_in_dim(v, (v.shape[0], width), [0])


def _lane():
    return plgpu.broadcasted_iota(jnp.uint32, (TILE, 32), 1, layout=plgpu.Layout.WGMMA)


def _run(body, *, tiles: int, inputs, in_blocks, out_types, out_blocks, name: str):
    """One CTA per tile; each CTA streams its tile through a one-step TMA pipeline."""

    def kernel(*refs):
        i = lax.axis_index("tile")
        gm_in, gm_out = refs[:len(inputs)], refs[len(inputs):]
        plgpu.emit_pipeline(
            lambda _, *smem: body(*smem),
            grid=(1,),
            in_specs=[spec(i) for spec in in_blocks],
            out_specs=[spec(i) for spec in out_blocks],
        )(*gm_in, *gm_out)

    outs = plgpu.kernel(kernel, out_type=tuple(out_types), grid=(tiles,), grid_names=("tile",),
                        kernel_name=name)(*inputs)
    return vary_like(outs, inputs)


def _word_block(i):
    return _swizzled((TILE, 32), lambda _: (i, 0))


def _col_block(i):
    return pl.BlockSpec((TILE,), lambda _: (i,))


def _plane_block(bits, i):
    return pl.BlockSpec((bits, TILE), lambda _: (0, i))


# --------------------------------------------------------------------------- quantize


def _interleave(planes: jax.Array, nb: int, w: int, bits: int, scale: jax.Array) -> jax.Array:
    """``[bits, nb * w]`` planes and ``[nb]`` scales -> ``[nb, bits * w + 1]`` wire rows."""
    words = planes.reshape(bits, nb, w).transpose(1, 0, 2).reshape(nb, bits * w)
    return jnp.concatenate([words, lax.bitcast_convert_type(scale, jnp.uint32)[:, None]], axis=1)


def _words(a: Optional[jax.Array], m: int) -> Optional[jax.Array]:
    """``[nb, B]`` as its ``[M, 32]`` word rows (fp32), or ``None``."""
    return None if a is None else a.astype(jnp.float32).reshape(m, 32)


def _from(a: Optional[jax.Array], start: int) -> Optional[jax.Array]:
    return None if a is None else a[start:]


def _patch(outs: tuple, tail: tuple, start: int) -> tuple:
    """``outs`` with their rows from ``start`` on replaced by ``tail``'s (``None`` kept)."""
    return tuple(None if o is None else o.at[start:].set(t) for o, t in zip(outs, tail))


def _quantize_tiles(xw, uw, ew, c, sl, *, tiles, bits, levels, output, emulate):
    """``([bits, M] planes, [M, 32] output or None)`` of the word rows: the kernel over
    ``tiles`` whole tiles, or (``emulate``) the same maths with jnp over every row."""
    opts = dict(bits=bits, levels=levels, output=output)
    if emulate:
        lane = lax.broadcasted_iota(jnp.uint32, xw.shape, 1)
        words, out = _quantize_math(xw, uw, ew, c[:, None], sl[:, None], lane, **opts)
        return jnp.stack(words), out
    m = xw.shape[0]
    has_u, has_e = uw is not None, ew is not None
    inputs = [xw] + ([uw] if has_u else []) + ([ew] if has_e else []) + [c] + ([sl] if output else [])

    def body(*refs):
        refs = list(refs)
        xv = _load_rows(refs.pop(0))
        uv = _load_rows(refs.pop(0)) if has_u else None
        ev = _load_rows(refs.pop(0)) if has_e else None
        cv = _load_col(refs.pop(0))
        slv = _load_col(refs.pop(0)) if output else None
        words, out = _quantize_math(xv, uv, ev, cv, slv, _lane(), **opts)
        planes_ref = refs.pop(0)
        for k in range(bits):
            planes_ref[k] = words[k]
        if output:
            refs.pop(0)[...] = out

    in_blocks = [_word_block] * (1 + has_u + has_e) + [_col_block] * (1 + bool(output))
    out_types = [jax.ShapeDtypeStruct((bits, m), jnp.uint32)]
    out_blocks = [functools.partial(_plane_block, bits)]
    if output:
        out_types.append(jax.ShapeDtypeStruct((m, 32), jnp.float32))
        out_blocks.append(_word_block)
    outs = _run(body, tiles=tiles, inputs=inputs, in_blocks=in_blocks, out_types=out_types,
                out_blocks=out_blocks, name=f"commjax_quantize{bits}_mgpu")
    return outs[0], (outs[1] if output else None)


def _quantize(x, uniforms, residual, *, bits, levels, output, emulate):
    nb, block = x.shape
    w = block // 32
    m = nb * w
    tiles = m // TILE
    opts = dict(bits=bits, levels=levels, output=output)
    if tiles == 0 and not emulate:
        return quantize_reference(x, uniforms, residual, **opts)
    scale, c, sl = row_constants(x, residual, levels=levels)
    planes, out = _quantize_tiles(_words(x, m), _words(uniforms, m), _words(residual, m),
                                  jnp.repeat(c, w), jnp.repeat(sl, w), tiles=tiles,
                                  emulate=emulate, **opts)
    outs = (_interleave(planes, nb, w, bits, scale), None if out is None else out.reshape(nb, block))
    main = nb if emulate else tiles * TILE // w  # blocks done by the kernel
    if main < nb:
        tail = quantize_reference(x[main:], _from(uniforms, main), _from(residual, main), **opts)
        outs = _patch(outs, tail, main)
    return outs


def quantize_kernel(x, uniforms, residual, *, bits: int, levels: int, output: Optional[str],
                    emulate: bool = False):
    """The Mosaic GPU kernel for [`commjax.kernels.quantize_blocks`][], or ``None``.
    ``emulate``: the same word-row algorithm with jnp (runs anywhere; for the tests)."""
    if not supported(x.shape[1]):
        return None
    return functools.partial(_quantize, bits=bits, levels=levels, output=output, emulate=emulate)


# --------------------------------------------------------------------------- sign


def _sign_tiles(xw, ew, s, *, tiles, output, emulate):
    """``([1, M] plane, [M, 32] output or None)``, as ``_quantize_tiles``."""
    if emulate:
        lane = lax.broadcasted_iota(jnp.uint32, xw.shape, 1)
        words, out = _sign_math(xw, ew, s[:, None], lane, output=output)
        return jnp.stack(words), out
    m = xw.shape[0]
    has_e = ew is not None
    inputs = [xw] + ([ew] if has_e else []) + [s]

    def body(*refs):
        refs = list(refs)
        xv = _load_rows(refs.pop(0))
        ev = _load_rows(refs.pop(0)) if has_e else None
        sv = _load_col(refs.pop(0))
        words, out = _sign_math(xv, ev, sv, _lane(), output=output)
        refs.pop(0)[0] = words[0]
        if output:
            refs.pop(0)[...] = out

    in_blocks = [_word_block] * (1 + has_e) + [_col_block]
    out_types = [jax.ShapeDtypeStruct((1, m), jnp.uint32)]
    out_blocks = [functools.partial(_plane_block, 1)]
    if output:
        out_types.append(jax.ShapeDtypeStruct((m, 32), jnp.float32))
        out_blocks.append(_word_block)
    outs = _run(body, tiles=tiles, inputs=inputs, in_blocks=in_blocks, out_types=out_types,
                out_blocks=out_blocks, name="commjax_sign_mgpu")
    return outs[0], (outs[1] if output else None)


def _sign(x, residual, *, output, emulate):
    nb, block = x.shape
    w = block // 32
    m = nb * w
    tiles = m // TILE
    if tiles == 0 and not emulate:
        return sign_reference(x, residual, output=output)
    scale = row_scales(x, residual)[:, 0]
    planes, out = _sign_tiles(_words(x, m), _words(residual, m), jnp.repeat(scale, w),
                              tiles=tiles, output=output, emulate=emulate)
    outs = (_interleave(planes, nb, w, 1, scale), None if out is None else out.reshape(nb, block))
    main = nb if emulate else tiles * TILE // w
    if main < nb:
        outs = _patch(outs, sign_reference(x[main:], _from(residual, main), output=output), main)
    return outs


def sign_kernel(x, residual, *, output: Optional[str], emulate: bool = False):
    """The Mosaic GPU kernel for [`commjax.kernels.sign_blocks`][], or ``None``
    (``emulate``: as for ``quantize_kernel``)."""
    if not supported(x.shape[1]):
        return None
    return functools.partial(_sign, output=output, emulate=emulate)


# --------------------------------------------------------------------------- decode


def _decode_tiles(planes, q, *, tiles, bits, offset, step, accumulate, emulate):
    """``[M, 32]``: the decoded word rows of ``[N, bits, M]`` planes with ``[N, M]`` steps
    (summed over ``N`` in order from zeros if ``accumulate``), as ``_quantize_tiles``."""
    n_rep, _, m = planes.shape
    opts = dict(bits=bits, offset=offset, step=step)
    if emulate:
        lane = lax.broadcasted_iota(jnp.uint32, (m, 32), 1)
        acc = jnp.zeros((m, 32), jnp.float32)
        for r in range(n_rep):
            value = _decode_math([planes[r, k][:, None] for k in range(bits)], q[r][:, None], lane, **opts)
            acc = acc + value if accumulate else value
        return acc

    def kernel(p_gmem, q_gmem, o_gmem):
        i = lax.axis_index("tile")

        def step_fn(idx, p_smem, q_smem, carry):
            value = _decode_math([_load_col(p_smem.at[k]) for k in range(bits)], _load_col(q_smem),
                                 _lane(), **opts)
            return carry + value if accumulate else value

        zeros = plgpu.layout_cast(jnp.zeros((TILE, 32), jnp.float32), plgpu.Layout.WGMMA)
        acc = plgpu.emit_pipeline(
            step_fn, grid=(n_rep,),
            in_specs=[pl.BlockSpec((None, bits, TILE), lambda r: (r, 0, i)),
                      pl.BlockSpec((None, TILE), lambda r: (r, i))],
            init_carry=zeros,
        )(p_gmem, q_gmem)

        def store(o_smem):
            o_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(i * TILE, TILE)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((TILE, 32), jnp.float32,
                                        transforms=(plgpu.TilingTransform((8, 32)),
                                                    plgpu.SwizzleTransform(128))))

    out = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((m, 32), jnp.float32),
                       grid=(tiles,), grid_names=("tile",),
                       kernel_name=f"commjax_decode{bits}_mgpu")(planes, q)
    return vary_like(out, (planes, q))


def _decode(rows, *, accumulate, bits, block_size, offset, step, divisor, emulate):
    ref_opts = dict(bits=bits, block_size=block_size, offset=offset, step=step, divisor=divisor)

    def reference(r):
        return decode_sum_reference(r, **ref_opts) if accumulate else decode_reference(r[0], **ref_opts)

    rows = rows if accumulate else rows[None]
    n_rep, nb, _ = rows.shape
    w = block_size // 32
    m = nb * w
    tiles = m // TILE
    if tiles == 0 and not emulate:
        return reference(rows)
    planes = rows[:, :, :bits * w].reshape(n_rep, nb, bits, w).transpose(0, 2, 1, 3).reshape(n_rep, bits, m)
    q = jnp.repeat(row_steps(rows, divisor)[..., 0], w, axis=1)  # [N, M]
    out = _decode_tiles(planes, q, tiles=tiles, bits=bits, offset=offset, step=step,
                        accumulate=accumulate, emulate=emulate).reshape(nb, block_size)
    main = nb if emulate else tiles * TILE // w
    if main < nb:
        out = out.at[main:].set(reference(rows[:, main:]))
    return out


def decode_kernel(rows, *, accumulate: bool, bits: int, block_size: int, offset: int, step: int,
                  divisor: Optional[int], emulate: bool = False):
    """The Mosaic GPU kernel for [`commjax.kernels.decode_rows`][] / ``decode_sum``, or
    ``None`` (``emulate``: as for ``quantize_kernel``)."""
    if not supported(block_size):
        return None
    return functools.partial(_decode, accumulate=accumulate, bits=bits, block_size=block_size,
                             offset=offset, step=step, divisor=divisor, emulate=emulate)
