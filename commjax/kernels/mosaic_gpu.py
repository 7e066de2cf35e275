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

Fused multiply-adds: the decoded value ``l * q`` goes through the integer fence of
:func:`commjax.kernels._dispatch.fence` before it is subtracted or accumulated, as in the
references. ``floor(q + u)`` is left
to the compiler as in the reference; whether ``nvcc``'s and XLA's contraction choices
agree for it is what ``benchmarks/gpu_check.sh`` checks on a GPU.

Not verified here: nothing of this file runs on a CPU machine. The tests check that
every kernel *lowers* for CUDA (Mosaic GPU's layout checks run at lowering), and run the
same word-row algorithm with plain jnp (:func:`emulate`) against the references bit
for bit; the GPU run is ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import jax
import jax.numpy as jnp
from jax import lax

from commjax.kernels._dispatch import fence, vary_like

__all__ = ["TILE", "quantize_kernel", "sign_kernel", "decode_kernel", "emulate", "supported"]

TILE = 128  # word rows per CTA: 4096 elements

_EMULATE = False


@contextlib.contextmanager
def emulate() -> Iterator[None]:
    """Run the word-row algorithm of these kernels with plain jnp instead of Mosaic GPU
    (same pre/post-processing, same per-tile arithmetic): the CPU check of the GPU path."""
    global _EMULATE
    previous, _EMULATE = _EMULATE, True
    try:
        yield
    finally:
        _EMULATE = previous


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
    q = y * c
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


def _decode_math(planes, q, lane, *, bits, offset, step, fenced):
    codes = None
    for k in range(bits):
        bit = ((planes[k] >> lane) & jnp.uint32(1)) << jnp.uint32(k)
        codes = bit if codes is None else codes | bit
    if step == 1:
        lv = (codes.astype(jnp.int32) - offset).astype(jnp.float32)
    else:
        lv = codes.astype(jnp.float32) * float(step) - float(offset)
    return fence(lv * q, q) if fenced else lv * q


# --------------------------------------------------------------------------- layout helpers


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _swizzled(block: tuple, index_map: Callable[..., Any]):
    from jax.experimental import pallas as pl

    plgpu = _plgpu()
    if len(block) == 2:
        return plgpu.BlockSpec(block, index_map,
                               transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)))
    return pl.BlockSpec(block, index_map)


def _load_rows(ref):
    plgpu = _plgpu()
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)


def _load_col(ref, width: int = 32):
    """A ``[TILE]`` per-row vector, broadcast along the 32 lanes."""
    plgpu = _plgpu()
    v = plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return lax.broadcast_in_dim(v, (v.shape[0], width), [0])


def _lane():
    plgpu = _plgpu()
    return plgpu.broadcasted_iota(jnp.uint32, (TILE, 32), 1, layout=plgpu.Layout.WGMMA)


def _run(body, *, tiles: int, inputs, in_blocks, out_types, out_blocks, name: str):
    """One CTA per tile; each CTA streams its tile through a one-step TMA pipeline."""
    plgpu = _plgpu()

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
    from jax.experimental import pallas as pl

    return pl.BlockSpec((TILE,), lambda _: (i,))


def _plane_block(bits, i):
    from jax.experimental import pallas as pl

    return pl.BlockSpec((bits, TILE), lambda _: (0, i))


# --------------------------------------------------------------------------- quantize


def _interleave(planes: jax.Array, nb: int, w: int, bits: int, scale: jax.Array) -> jax.Array:
    """``[bits, nb * w]`` planes and ``[nb]`` scales -> ``[nb, bits * w + 1]`` wire rows."""
    words = planes.reshape(bits, nb, w).transpose(1, 0, 2).reshape(nb, bits * w)
    return jnp.concatenate([words, lax.bitcast_convert_type(scale, jnp.uint32)[:, None]], axis=1)


def _quantize(x, uniforms, residual, *, bits, levels, output):
    from commjax.kernels.quantize import quantize_reference, row_constants

    nb, block = x.shape
    w = block // 32
    m = nb * w
    tiles = m // TILE
    main = tiles * TILE // w  # blocks done by the kernel
    scale, c, sl = row_constants(x, residual, levels=levels)
    c, sl = jnp.repeat(c, w), jnp.repeat(sl, w)
    xw = x.reshape(m, 32)
    uw = None if uniforms is None else uniforms.reshape(m, 32)
    ew = None if residual is None else residual.astype(jnp.float32).reshape(m, 32)
    opts = dict(bits=bits, levels=levels, output=output)

    if _EMULATE:
        lane = lax.broadcasted_iota(jnp.uint32, (m, 32), 1)
        words, out = _quantize_math(xw, uw, ew, c[:, None], sl[:, None], lane, **opts)
        planes = jnp.stack(words)
    elif tiles == 0:
        return quantize_reference(x, uniforms, residual, **opts)
    else:
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
        planes, out = outs[0], (outs[1] if output else None)
    rows = _interleave(planes, nb, w, bits, scale)
    if output:
        out = out.reshape(nb, block)
    if main < nb and not _EMULATE:
        tail = quantize_reference(x[main:], None if uniforms is None else uniforms[main:],
                                  None if residual is None else residual[main:], **opts)
        rows = rows.at[main:].set(tail[0])
        if output:
            out = out.at[main:].set(tail[1])
    return rows, out


def quantize_kernel(x, uniforms, residual, *, bits: int, levels: int, output: Optional[str]):
    """The Mosaic GPU kernel for :func:`commjax.kernels.quantize_blocks`, or ``None``."""
    if not supported(x.shape[1]):
        return None
    return functools.partial(_quantize, bits=bits, levels=levels, output=output)


# --------------------------------------------------------------------------- sign


def _sign(x, residual, *, output):
    from commjax.kernels.sign import row_scales, sign_reference

    nb, block = x.shape
    w = block // 32
    m = nb * w
    tiles = m // TILE
    main = tiles * TILE // w
    scale = row_scales(x, residual)[:, 0]
    s = jnp.repeat(scale, w)
    xw = x.reshape(m, 32)
    ew = None if residual is None else residual.astype(jnp.float32).reshape(m, 32)

    if _EMULATE:
        lane = lax.broadcasted_iota(jnp.uint32, (m, 32), 1)
        words, out = _sign_math(xw, ew, s[:, None], lane, output=output)
        planes = jnp.stack(words)
    elif tiles == 0:
        return sign_reference(x, residual, output=output)
    else:
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
        planes, out = outs[0], (outs[1] if output else None)
    rows = _interleave(planes, nb, w, 1, scale)
    if output:
        out = out.reshape(nb, block)
    if main < nb and not _EMULATE:
        tail = sign_reference(x[main:], None if residual is None else residual[main:], output=output)
        rows = rows.at[main:].set(tail[0])
        if output:
            out = out.at[main:].set(tail[1])
    return rows, out


def sign_kernel(x, residual, *, output: Optional[str]):
    """The Mosaic GPU kernel for :func:`commjax.kernels.sign_blocks`, or ``None``."""
    if not supported(x.shape[1]):
        return None
    return functools.partial(_sign, output=output)


# --------------------------------------------------------------------------- decode


def _decode(rows, *, accumulate, bits, block_size, offset, step, divisor):
    from commjax.kernels.decode import decode_reference, decode_sum_reference, row_steps

    if not accumulate:
        rows = rows[None]
    n_rep, nb, _ = rows.shape
    w = block_size // 32
    m = nb * w
    tiles = m // TILE
    main = tiles * TILE // w
    planes = rows[:, :, :bits * w].reshape(n_rep, nb, bits, w).transpose(0, 2, 1, 3).reshape(n_rep, bits, m)
    q = jnp.repeat(row_steps(rows, divisor)[..., 0], w, axis=1)  # [N, M]
    opts = dict(bits=bits, offset=offset, step=step, fenced=accumulate)
    ref_opts = dict(bits=bits, block_size=block_size, offset=offset, step=step, divisor=divisor)

    if _EMULATE:
        lane = lax.broadcasted_iota(jnp.uint32, (m, 32), 1)
        acc = jnp.zeros((m, 32), jnp.float32)
        for r in range(n_rep):
            value = _decode_math([planes[r, k][:, None] for k in range(bits)], q[r][:, None], lane, **opts)
            acc = acc + value if accumulate else value
        out = acc
    elif tiles == 0:
        return decode_sum_reference(rows, **ref_opts) if accumulate else decode_reference(rows[0], **ref_opts)
    else:
        from jax.experimental import pallas as pl

        plgpu = _plgpu()

        def kernel(p_gmem, q_gmem, o_gmem):
            i = lax.axis_index("tile")

            def step_fn(idx, p_smem, q_smem, carry):
                value = _decode_math(
                    [_load_col(p_smem.at[k]) for k in range(bits)], _load_col(q_smem), _lane(), **opts)
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
        out = vary_like(out, (planes, q))
    out = out.reshape(nb, block_size)
    if main < nb and not _EMULATE:
        tail_rows = rows[:, main:]
        tail = decode_sum_reference(tail_rows, **ref_opts) if accumulate else decode_reference(tail_rows[0], **ref_opts)
        out = out.at[main:].set(tail)
    return out


def decode_kernel(rows, *, accumulate: bool, bits: int, block_size: int, offset: int, step: int,
                  divisor: Optional[int]):
    """The Mosaic GPU kernel for :func:`commjax.kernels.decode_rows` / ``decode_sum``, or ``None``."""
    if not supported(block_size):
        return None
    return functools.partial(_decode, accumulate=accumulate, bits=bits, block_size=block_size,
                             offset=offset, step=step, divisor=divisor)
