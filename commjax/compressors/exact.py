"""Lossless and nearly lossless compressors: ``identity`` (the fp32 baseline) and ``cast``."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from commjax.compressors.base import BlockCompressor

__all__ = ["Identity", "Cast", "identity", "cast"]


@dataclasses.dataclass(frozen=True)
class Identity(BlockCompressor):
    """The exact fp32 mean: 32 bits per element, summed with one all-reduce."""

    name: ClassVar[str] = "identity"
    linear: ClassVar[bool] = True
    lossless: ClassVar[bool] = True

    @property
    def block(self) -> int:
        return 1

    @property
    def row_words(self) -> int:
        return 1

    def encode_blocks(self, blocks, key, start=0):
        return lax.bitcast_convert_type(blocks.astype(jnp.float32), jnp.uint32)

    def decode_blocks(self, rows):
        return lax.bitcast_convert_type(rows, jnp.float32)

    def encode_linear(self, x, key):
        return x.astype(jnp.float32)

    def decode_linear(self, summed, n):
        return summed

    def linear_payload_bytes(self, n: int) -> int:
        return 4 * n


_CAST_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Cast(BlockCompressor):
    """Round to a 16-bit float (round-to-nearest-even) and send two values per uint32 word.

    ``float16`` saturates at +-65504 instead of overflowing to infinity; with error
    feedback the clipped excess is carried to the next step.

    Bytes: ``2 n`` per replica payload. Reduced by the two-phase reducer (all-to-all of
    words, fp32 sums, re-rounding, all-gather), so the sum never accumulates in 16 bits.
    """

    dtype_name: str = "bfloat16"
    name: ClassVar[str] = "cast"
    linear: ClassVar[bool] = True

    @property
    def dtype(self) -> Any:
        return _CAST_DTYPES[self.dtype_name]

    @property
    def block(self) -> int:
        return 2

    @property
    def row_words(self) -> int:
        return 1

    def _round(self, x: jax.Array) -> jax.Array:
        if self.dtype_name == "float16":
            x = jnp.clip(x, -65504.0, 65504.0)
        return x.astype(self.dtype)

    def encode_blocks(self, blocks, key, start=0):
        half = lax.bitcast_convert_type(self._round(blocks), jnp.uint16)  # [nb, 2]
        return lax.bitcast_convert_type(half, jnp.uint32)[:, None]

    def decode_blocks(self, rows):
        half = lax.bitcast_convert_type(rows[:, 0], jnp.uint16)  # [nb, 2]
        return lax.bitcast_convert_type(half, self.dtype).astype(jnp.float32)

    def encode_linear(self, x, key):
        return self._round(x)

    def decode_linear(self, summed, n):
        return summed.astype(jnp.float32)

    def linear_payload_bytes(self, n: int) -> int:
        return 2 * n


def identity() -> Identity:
    """The exact fp32 mean (no compression): the baseline every ratio is measured against."""
    return Identity()


def cast(dtype: Any = jnp.bfloat16) -> Cast:
    """16-bit floats on the wire: ``dtype`` is ``jnp.bfloat16`` or ``jnp.float16``.

    Bits per element: 16. Round-to-nearest, so ``|decode(encode(x)) - x| <= 2**-8 |x|``
    for bfloat16 (``2**-11 |x|`` for float16 within its range).

    Example::

        tx = optax.chain(cj.compressed_mean(cj.cast(jnp.bfloat16), "data"), optax.sgd(0.1))
    """
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in _CAST_DTYPES:
        raise ValueError(
            f"cast: `dtype` must be jnp.bfloat16 or jnp.float16, got {dtype!r}. "
            "For fewer bits use cj.quantize(bits=8|4|2)."
        )
    return Cast(dtype_name=name)
