"""Fixed-rate lossless code of 16-bit float patterns (bfloat16): exponent deltas + escapes.

For each row (one block of ``B`` bfloat16 bit patterns ``h``, held in uint32), with
``d = delta_bits``, ``E = escapes`` and the block cut into groups of 32 (``g(i)`` is the
group of element ``i``)::

    e_i    = (h_i >> 7) & 0xFF                   (biased exponent)
    b      = max_i e_i                           (the block's base exponent)
    o_k    = min(b - max_{i in group k} e_i, 15)  (each group's offset, 4 bits)
    r_i    = b - o_{g(i)}                        (the reference of i's group, >= e_i)
    code_i = 2**d - 1                  if e_i == 0  (zeros and subnormals)
             r_i - e_i                 if r_i - e_i <= 2**d - 2
             0 (and an escape)         otherwise
    esc_j  = (i_j << 8) | e_{i_j}                (the first E escaped positions i_j;
                                                 unused slots repeat (0, e_0))
    head   = b | overflow << 8                   (overflow: more than E escapes)
    row    = [pack(code), d planes | s_i << 7 | m_i, 4 bytes per word | head, esc_0..
              | o_0 | o_1 << 4 | ...]

Why groups: neighbouring values share a scale far more often than a whole block does (a
fused ``qkv`` weight's gradient row holds the tiny query/key parts beside the value
part, more than 2**14 apart near initialization), so a reference per 32 values keeps
nearly every exponent within ``2**d - 2`` binades of its reference, for 4 bits per 32
values.

The sign and the 7 mantissa bits travel raw, so every pattern (NaN payloads, +-inf,
subnormals, -0) decodes to itself: ``e_i = 0`` for code ``2**d - 1``, ``r_i - code``
otherwise, then each escape slot writes its exponent back at its index. A row whose
``overflow`` bit is set lost exponents: the reducers read the bit
([`commjax.compressors.lossless.Lossless.payload_overflow`][]) and send the raw
fallback instead, on every replica.

Words per row: ``d B / 32 + B / 4 + ceil((E + 1) / 2) + 1`` (``B`` a multiple of 32, at
most 256 so that an index fits a byte): 99 for ``B = 256, d = 4, E = 3``, 12.375 bits
per element, 0.77 of the raw 16.

Lowerings: interpret mode and Mosaic TPU (row-tiled ``pallas_call``) for the encoder;
the decoder is jnp.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from commjax import packing
from commjax.kernels._bits import pack_tile
from commjax.kernels._dispatch import dispatch, resolve_impl
from commjax.kernels._tiling import row_call, tile_rows

__all__ = ["lossless_words", "lossless_encode", "lossless_reference", "lossless_decode",
           "header_column"]


def lossless_words(block_size: int, delta_bits: int, escapes: int) -> int:
    """uint32 words of one encoded row."""
    return delta_bits * block_size // 32 + block_size // 4 + (escapes + 2) // 2 + 1


def header_column(block_size: int, delta_bits: int) -> int:
    """The column of a row whose low half holds ``b | overflow << 8``."""
    return delta_bits * block_size // 32 + block_size // 4


def _escape_halves(escaped, e, *, escapes: int):
    """``[T, E]`` escape entries ``(i << 8) | e_i`` of the first ``E`` escaped positions of
    each row; unused slots are ``(0, e_0)`` (rewriting element 0's own exponent)."""
    rank = jnp.cumsum(escaped.astype(jnp.int32), axis=1)
    pos = jax.lax.broadcasted_iota(jnp.int32, e.shape, 1)
    cols = []
    for j in range(escapes):
        hit = escaped & (rank == j + 1)
        idx = jnp.sum(jnp.where(hit, pos, 0), axis=1, keepdims=True)
        exp = jnp.sum(jnp.where(pos == idx, e, 0), axis=1, keepdims=True)
        cols.append((idx.astype(jnp.uint32) << 8) | exp.astype(jnp.uint32))
    return cols


def _group_refs(e, base):
    """``(offsets word [T, 1], reference exponent per element [T, B])`` of the groups of
    32: ``o_k = min(b - max e over group k, 15)``, ``r = b - o``."""
    refs, word = [], jnp.zeros_like(base, dtype=jnp.uint32)
    for k in range(e.shape[1] // 32):
        o = jnp.minimum(base - jnp.max(e[:, 32 * k:32 * (k + 1)], axis=1, keepdims=True), 15)
        word = word | (o.astype(jnp.uint32) << (4 * k))
        refs.append(jnp.broadcast_to(base - o, (e.shape[0], 32)))
    return word, jnp.concatenate(refs, axis=1)


def lossless_tile(h, *, delta_bits: int, escapes: int):
    """One tile of rows ``uint32[T, B]`` (16-bit patterns) -> ``uint32[T, words]``, as
    every implementation computes it."""
    zero_code = 2 ** delta_bits - 1
    e = ((h >> 7) & 0xFF).astype(jnp.int32)
    base = jnp.max(e, axis=1, keepdims=True)
    offsets, ref = _group_refs(e, base)
    delta = ref - e
    fits = (delta <= zero_code - 1) & (e != 0)
    escaped = (e != 0) & ~fits
    code = jnp.where(e == 0, zero_code, jnp.where(fits, delta, 0)).astype(jnp.uint32)
    overflow = (jnp.sum(escaped.astype(jnp.int32), axis=1, keepdims=True) > escapes).astype(jnp.uint32)
    sm = ((h >> 8) & 0x80) | (h & 0x7F)
    q = h.shape[1] // 4
    sm_words = sm[:, :q] | sm[:, q:2 * q] << 8 | sm[:, 2 * q:3 * q] << 16 | sm[:, 3 * q:] << 24
    halves = [base.astype(jnp.uint32) | overflow << 8] + _escape_halves(escaped, e, escapes=escapes)
    if len(halves) % 2:
        halves.append(jnp.zeros_like(halves[0]))
    tail = [halves[k] | halves[k + 1] << 16 for k in range(0, len(halves), 2)]
    return jnp.concatenate([pack_tile(code, delta_bits), sm_words] + tail + [offsets], axis=1)


def lossless_reference(h, *, delta_bits: int, escapes: int):
    """The encoder on whole arrays (the oracle of the kernel)."""
    return lossless_tile(h, delta_bits=delta_bits, escapes=escapes)


def _pallas(h, *, delta_bits, escapes, tile, interpret: Any = False):
    rows, block = h.shape
    t = tile_rows(rows, block, interpret=bool(interpret), tile=tile)

    def body(h_ref, out_ref):
        out_ref[...] = lossless_tile(h_ref[...], delta_bits=delta_bits, escapes=escapes)

    out_cols = [(lossless_words(block, delta_bits, escapes), jnp.uint32)]
    return row_call(body, rows=rows, tile=t, inputs=[h], out_cols=out_cols,
                    interpret=interpret, name="commjax_lossless")[0]


def lossless_encode(h: jax.Array, *, delta_bits: int, escapes: int, tile: Optional[int] = None,
                    impl: Optional[str] = None) -> jax.Array:
    """Encode the rows of ``h: uint32[nb, B]`` (16-bit float patterns; maths in the
    module docstring): ``uint32[nb, lossless_words(B, d, E)]``. ``impl``: as for
    [`commjax.kernels.quantize_blocks`][]."""
    if h.ndim != 2 or h.shape[1] % 32 or not 32 <= h.shape[1] <= 256:
        raise ValueError(f"lossless_encode: `h` must be [num_blocks, B] with B a multiple of 32 "
                         f"in [32, 256], got shape {h.shape}.")
    impl = resolve_impl(impl, "lossless_encode")
    reference = functools.partial(lossless_reference, delta_bits=delta_bits, escapes=escapes)
    if h.shape[0] == 0:
        return reference(h)
    kernel = functools.partial(_pallas, delta_bits=delta_bits, escapes=escapes, tile=tile)
    return dispatch(reference, impl=impl, tpu=kernel, interpret=kernel, args=(h,))


def lossless_decode(rows: jax.Array, *, block_size: int, delta_bits: int, escapes: int) -> jax.Array:
    """``uint32[nb, words] -> uint32[nb, B]``: the 16-bit patterns (exact unless the
    row's overflow bit is set)."""
    nd = delta_bits * block_size // 32
    q = block_size // 4
    code = packing.unpack_codes(rows[:, :nd], delta_bits, block_size).astype(jnp.int32)
    smw = rows[:, nd:nd + q]
    sm = jnp.concatenate([(smw >> (8 * j)) & 0xFF for j in range(4)], axis=1)
    tail = rows[:, nd + q:-1]
    halves = jnp.stack([tail & 0xFFFF, tail >> 16], axis=2).reshape(rows.shape[0], -1)
    base = (halves[:, :1] & 0xFF).astype(jnp.int32)
    offsets = jnp.concatenate([jnp.broadcast_to(((rows[:, -1:] >> (4 * k)) & 15).astype(jnp.int32),
                                                (rows.shape[0], 32)) for k in range(block_size // 32)], axis=1)
    e = jnp.where(code == 2 ** delta_bits - 1, 0, base - offsets - code)
    pos = jax.lax.broadcasted_iota(jnp.int32, e.shape, 1)
    for j in range(escapes):
        entry = halves[:, 1 + j:2 + j]
        e = jnp.where(pos == (entry >> 8).astype(jnp.int32), (entry & 0xFF).astype(jnp.int32), e)
    e = (e & 0xFF).astype(jnp.uint32)
    return ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
