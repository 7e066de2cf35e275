"""Counter-based uniform noise: a hash of (key, salt, position), a few integer ops per value.

Stochastic rounding needs one uniform number per gradient element and step, and nothing
of it but a continuous-enough distribution that is independent across positions, steps
and replicas. ``jax.random.uniform`` (Threefry) spends 20 rounds of a block cipher on
each, which on CPU costs more than a model's forward and backward passes; this hash
costs a few integer operations. Here::

    seed = mix(salt, key words)
    h    = fmix32(fmix32(i * 0x9E3779B9 + seed) ^ (seed >> 7))     # i = flat position
    u    = (h >> 8) * 2**-24                                          # in [0, 1)

``fmix32`` is the 32-bit finalizer of MurmurHash3, a bijection in which every input bit
flips every output bit with probability about 1/2; the two rounds decorrelate
neighbouring positions and nearby seeds. ``u`` takes the 2**24 values ``k / 2**24``
equally often over the positions of a block of 2**32, so ``E[floor(q + u)] = q`` up to
``2**-24``. The same key, salt and shape give the same numbers on every platform (integer
arithmetic only).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["fmix32", "uniform"]

_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive positions apart


def fmix32(h: jax.Array) -> jax.Array:
    """The 32-bit finalizer of MurmurHash3 (uint32 in, uint32 out): a mixing bijection."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(key: jax.Array, shape: tuple[int, ...], salt: int = 0, *, start: int = 0) -> jax.Array:
    """``float32`` numbers in ``[0, 1)`` of ``shape``, a pure function of ``key`` (a raw
    ``uint32`` key or a typed PRNG key), ``salt`` and the position. ``start`` is the
    position of the first value: ``uniform(k, (a + b,))[a:] == uniform(k, (b,), start=a)``,
    so a vector's noise can be drawn piece by piece."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = jnp.ravel(key).astype(jnp.uint32)
    seed = fmix32(jnp.uint32(salt & 0xFFFFFFFF) * jnp.uint32(_GOLDEN) + jnp.uint32(0x632BE5AB))
    for i in range(words.shape[0]):
        seed = fmix32(seed ^ words[i])
    size = math.prod(shape)
    i = lax.iota(jnp.uint32, size) + jnp.uint32(start & 0xFFFFFFFF)
    h = fmix32(i * jnp.uint32(_GOLDEN) + seed)
    h = fmix32(h ^ (seed >> 7))
    return ((h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)).reshape(shape)
