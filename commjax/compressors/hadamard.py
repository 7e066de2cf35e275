"""``hadamard``: a Walsh-Hadamard rotation in front of any block codec.

Quantizing a block with one absmax scale wastes levels when a few entries are much larger
than the rest (outliers): every other entry rounds to a handful of levels. Rotating each
chunk of ``k`` elements by the normalized Walsh-Hadamard matrix spreads every outlier over
the whole chunk, so the block's absmax shrinks towards its rms and the same bits carry
more of the signal (SDP4Bit rotates 32-wide chunks before its 4-bit gradient exchange).

For ``H_k`` the Sylvester-Hadamard matrix of order ``k`` (a power of two) and
``R = H_k / sqrt(k)`` (orthogonal and symmetric, so ``R^-1 = R^T = R``)::

    encode(x) = C.encode(R x / sqrt(k))             # chunk by chunk: H x / k
    decode(w) = sqrt(k) R C.decode(w)               # the inverse rotation after decoding
    decode_sum(ws) = sqrt(k) R sum_r C.decode(ws[r])   # linearity: one rotation per sum

The codec sees ``R x / sqrt(k) = H x / k``, whose values are at most ``max |x|``: the
rotation of any finite block is finite (``R x`` itself can reach ``sqrt(k) max |x|``,
past fp32's range for ``|x| > 6e37`` at ``k = 32``). Block codecs scale each block by its
absmax (or mean), so the factor changes no code.

Bytes are those of the wrapped codec ``C`` exactly (the rotation changes values, not
layout). ``R`` preserves the l2 norm, so ``||x - decode(encode(x))|| = sqrt(k) ||y - C(y)||``
for ``y = H x / k``: the error of the wrapped codec on the rotated vector. In fp32 the
rotation round-trips to within a few ulps (``H H = k I``; every product is exact).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from commjax.compressors.base import BlockCompressor

__all__ = ["Hadamard", "hadamard", "hadamard_matrix", "rotate"]


@functools.lru_cache(maxsize=None)
def hadamard_matrix(size: int) -> np.ndarray:
    """``R = H_size / sqrt(size)``, float32 (Sylvester construction; ``size`` a power of 2)."""
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < size:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(size)).astype(np.float32)


def rotate(x: jax.Array, size: int) -> jax.Array:
    """``x`` (any shape whose size is a multiple of ``size``) with each consecutive chunk of
    ``size`` elements multiplied by ``R``; ``rotate(rotate(x)) == x`` up to rounding.

    One ``[n / size, size] @ [size, size]`` product at full fp32 precision (TPUs and GPUs
    would otherwise use bf16/tf32 passes and lose the exact inverse)."""
    return _chunk_product(x, hadamard_matrix(size), size)


def _chunk_product(x: jax.Array, m: np.ndarray, size: int) -> jax.Array:
    rows = x.reshape(-1, size).astype(jnp.float32)
    return jnp.dot(rows, jnp.asarray(m), precision=lax.Precision.HIGHEST).reshape(x.shape)


@functools.lru_cache(maxsize=None)
def _signs(size: int) -> np.ndarray:
    """``H_size``, the Sylvester matrix of +-1 (float32, exact)."""
    return np.round(hadamard_matrix(size).astype(np.float64) * math.sqrt(size)).astype(np.float32)


def _spread(x: jax.Array, size: int) -> jax.Array:
    """``H x / size`` per chunk (``= R x / sqrt(size)``): every value at most ``max |x|``, so
    the rotation of a finite block never overflows (``R x`` can reach ``sqrt(size) max |x|``).
    The entries of ``H / size`` are powers of two: each product is exact."""
    return _chunk_product(x, _signs(size) / np.float32(size), size)


def _unspread(y: jax.Array, size: int) -> jax.Array:
    """The inverse of ``_spread``: ``H (y / size) * size`` (``H H = size I``), scaled so
    that no partial sum overflows; both scalings are exact powers of two."""
    return _chunk_product(y * np.float32(1.0 / size), _signs(size), size) * np.float32(size)


@dataclasses.dataclass(frozen=True)
class Hadamard(BlockCompressor):
    """``codec`` applied to Walsh-Hadamard-rotated chunks of ``size`` (see
    [`hadamard`][commjax.compressors.hadamard.hadamard]).

    A block of this codec is ``lcm(codec.block, size)`` elements: a whole number of the
    wrapped codec's blocks and of rotation chunks, so blocks stay independent (chunkable,
    leaf-local) and a payload is the wrapped codec's payload of the rotated vector.
    """

    codec: BlockCompressor = None  # type: ignore[assignment]
    size: int = 32

    # Randomness and summability are the wrapped codec's (properties: the ClassVars of
    # the base class describe a codec's class, these depend on the wrapped instance).
    @property
    def name(self) -> str:  # type: ignore[override]
        return f"hadamard({self.codec.name})"

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        return self.codec.stochastic

    @property
    def linear(self) -> bool:  # type: ignore[override]
        return self.codec.linear

    @property
    def shared_randomness(self) -> bool:  # type: ignore[override]
        return self.codec.shared_randomness

    @property
    def block(self) -> int:
        return self.codec.block * self.size // math.gcd(self.codec.block, self.size)

    @property
    def _inner_per_block(self) -> int:
        return self.block // self.codec.block

    @property
    def row_words(self) -> int:
        return self._inner_per_block * self.codec.row_words

    def encode_blocks(self, blocks: jax.Array, key: Optional[jax.Array], start: int = 0) -> jax.Array:
        nb = blocks.shape[0]
        inner = _spread(blocks, self.size).reshape(-1, self.codec.block)
        return self.codec.encode_blocks(inner, key, start).reshape(nb, self.row_words)

    def decode_blocks(self, rows: jax.Array) -> jax.Array:
        nb = rows.shape[0]
        inner = self.codec.decode_blocks(rows.reshape(-1, self.codec.row_words))
        return _unspread(inner.reshape(nb, self.block), self.size)

    def payload_finite(self, words: jax.Array) -> Optional[jax.Array]:
        """The wrapped codec's check (its rows lie back to back in each row here)."""
        return self.codec.payload_finite(words)

    def decode_sum(self, payloads: jax.Array, n: int, segments=None, *, divide: int = 1) -> jax.Array:
        """``R sum_r C.decode(payloads[r])``: the wrapped codec's (fused) sum in replica
        order, then one inverse rotation. Every replica that holds the same payloads
        computes the same bits."""
        return _unspread(self.codec.decode_sum(payloads, n, divide=divide), self.size)

    def encode_linear(self, x: jax.Array, key: Optional[jax.Array]) -> jax.Array:
        return self.codec.encode_linear(_spread(x, self.size), key)

    def decode_linear(self, summed: jax.Array, n: int) -> jax.Array:
        return _unspread(self.codec.decode_linear(summed, n), self.size)

    def linear_payload_bytes(self, n: int) -> int:
        return self.codec.linear_payload_bytes(n)

    def accepts(self, shape: tuple[int, ...]) -> bool:
        return self.codec.accepts(shape)


def hadamard(codec: BlockCompressor, size: int = 32) -> Hadamard:
    """Rotate each chunk of ``size`` elements by the normalized Walsh-Hadamard matrix before
    ``codec`` encodes it, and rotate back after it decodes (module docstring for the maths).

    Usable wherever ``codec`` is: [`commjax.compressed_mean`][] (every reducer ``codec``
    supports), the collectives of [`commjax.collectives`][], [`commjax.zero`][] and
    [`commjax.fsdp_gather`][]. Bytes on the wire are exactly ``codec``'s; the block is
    ``lcm(codec.block, size)`` elements. Costs one ``size x size`` matrix product per chunk
    on each side (``2 size`` flops per element).

    Example (SDP4Bit's gradient codec)::

        grads = cj.hadamard(cj.quantize(bits=4, block_size=128), size=32)

    Args:
      codec: a block codec (``cj.quantize``, ``cj.cast``, ``cj.sign``, ``cj.qsgd``,
        ``cj.terngrad``, ``cj.identity``).
      size: rotation width, a power of two (32 by default).
    """
    if not isinstance(codec, BlockCompressor):
        raise TypeError(
            f"hadamard: `codec` must be a block codec (cj.quantize, cj.cast, cj.sign, cj.qsgd, "
            f"cj.terngrad, cj.identity) whose blocks the rotation can cover; got {codec!r}. "
            "Sparsifiers and PowerSGD select or factor values, which a rotation would spread.")
    if isinstance(codec, Hadamard):
        raise ValueError("hadamard: `codec` is already a cj.hadamard(...); rotate once, with "
                         "the `size` you want.")
    if isinstance(size, bool) or not isinstance(size, int) or size < 2 or size & (size - 1):
        raise ValueError(f"hadamard: `size` must be a power of two >= 2 (the Walsh-Hadamard "
                         f"order), got {size!r}.")
    return Hadamard(codec=codec, size=size)
