"""Pack / unpack kernels for the bit-plane wire format of [`commjax.packing`][].

References: [`commjax.packing.pack_codes`][] and [`commjax.packing.unpack_codes`][]
(pure jnp, the format's definition). The kernels produce the same words bit for bit.

Memory traffic per element of a ``bits``-bit code: pack reads 4 bytes and writes
``bits / 8``; unpack the reverse.

Lowerings: Mosaic TPU and interpret mode through a row-tiled ``pallas_call``. Blocks
whose size is not a multiple of 32 (a word straddles the row's padding) use the
reference on every backend.

With ``impl="auto"`` these standalone passes use the reference: a separate pass materialises
the codes (4 bytes per element), where XLA fuses the reference's shifts with the
producer or consumer of the codes. The hot paths are the fused codec kernels of
``commjax.kernels.quantize``, ``commjax.kernels.sign`` and
``commjax.kernels.decode``, which pack and unpack in registers; these two kernels run
with ``impl="pallas"`` and ``"interpret"`` (and serve as their building blocks' tests). They
have no Mosaic GPU version (the reference runs there whatever ``impl``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from commjax import packing
from commjax.kernels._bits import pack_tile, unpack_tile
from commjax.kernels._dispatch import dispatch, resolve_impl
from commjax.kernels._tiling import row_call, tile_rows

__all__ = ["pack_codes", "unpack_codes"]


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in [1, 16], got {bits}")


def _pack_pallas(codes: jax.Array, *, bits: int, tile: Optional[int], interpret: Any = False) -> jax.Array:
    lead, b = codes.shape[:-1], codes.shape[-1]
    rows = math.prod(lead)
    flat = codes.astype(jnp.uint32).reshape(rows, b)
    t = tile_rows(rows, b, interpret=bool(interpret), tile=tile)

    def body(c_ref, o_ref):
        o_ref[...] = pack_tile(c_ref[...], bits)

    w = packing.packed_words(b, bits)
    (out,) = row_call(body, rows=rows, tile=t, inputs=[flat], out_cols=[(w, jnp.uint32)],
                      interpret=interpret, name=f"commjax_pack{bits}")
    return out.reshape(lead + (w,))


def _unpack_pallas(words: jax.Array, *, bits: int, block: int, tile: Optional[int],
                   interpret: Any = False) -> jax.Array:
    lead, nw = words.shape[:-1], words.shape[-1]
    rows = math.prod(lead)
    flat = words.astype(jnp.uint32).reshape(rows, nw)
    t = tile_rows(rows, block, interpret=bool(interpret), tile=tile)

    def body(w_ref, o_ref):
        o_ref[...] = unpack_tile(w_ref[...], bits, block)

    (out,) = row_call(body, rows=rows, tile=t, inputs=[flat], out_cols=[(block, jnp.uint32)],
                      interpret=interpret, name=f"commjax_unpack{bits}")
    return out.reshape(lead + (block,))


def pack_codes(codes: jax.Array, bits: int, *, tile: Optional[int] = None,
               impl: Optional[str] = None) -> jax.Array:
    """Kernel-dispatched [`commjax.packing.pack_codes`][]: ``codes[..., B] ->
    uint32[..., packing.packed_words(B, bits)]``.
    ``impl``: as for [`commjax.kernels.quantize_blocks`][]."""
    _check_bits(bits)
    impl = resolve_impl(impl, "pack_codes")
    reference = functools.partial(packing.pack_codes, bits=bits)
    b = codes.shape[-1]
    rows = math.prod(codes.shape[:-1])
    if b % 32 or rows == 0 or b == 0:
        return reference(codes)
    kernel = functools.partial(_pack_pallas, bits=bits, tile=tile)
    return dispatch(reference, impl=impl, tpu=kernel, interpret=kernel, args=(codes,), auto=False)


def unpack_codes(words: jax.Array, bits: int, block_size: int, *, tile: Optional[int] = None,
                 impl: Optional[str] = None) -> jax.Array:
    """Kernel-dispatched [`commjax.packing.unpack_codes`][]: ``uint32[..., packed_words] ->
    uint32[..., block_size]``.
    ``impl``: as for [`commjax.kernels.quantize_blocks`][]."""
    _check_bits(bits)
    impl = resolve_impl(impl, "unpack_codes")
    reference = functools.partial(packing.unpack_codes, bits=bits, block_size=block_size)
    if words.shape[-1] != packing.packed_words(block_size, bits):
        return reference(words)  # raises the reference's error
    rows = math.prod(words.shape[:-1])
    if block_size % 32 or rows == 0:
        return reference(words)
    kernel = functools.partial(_unpack_pallas, bits=bits, block=block_size, tile=tile)
    return dispatch(reference, impl=impl, tpu=kernel, interpret=kernel, args=(words,), auto=False)
