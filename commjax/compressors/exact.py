"""The exact fp32 mean, ``identity``: the baseline every ratio is measured against."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jax import lax

from commjax.compressors.base import BlockCompressor

__all__ = ["Identity", "identity"]


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


def identity() -> Identity:
    """The exact fp32 mean (no compression): the baseline every ratio is measured against."""
    return Identity()
