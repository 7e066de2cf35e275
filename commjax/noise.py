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

__all__ = ["fmix32", "key_seed", "uniform", "uniform_at"]

_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive positions apart


def fmix32(h: jax.Array) -> jax.Array:
    """The 32-bit finalizer of MurmurHash3 (uint32 in, uint32 out): a mixing bijection."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def key_seed(key: jax.Array, salt: int = 0) -> jax.Array:
    """The ``uint32`` scalar ``seed = mix(salt, key words)`` of ``uniform``."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = jnp.ravel(key).astype(jnp.uint32)
    s = fmix32(jnp.uint32(salt & 0xFFFFFFFF) * jnp.uint32(_GOLDEN) + jnp.uint32(0x632BE5AB))
    for i in range(words.shape[0]):
        s = fmix32(s ^ words[i])
    return s


def uniform_at(i: jax.Array, seed: jax.Array) -> jax.Array:
    """``uniform``'s values at the ``uint32`` positions ``i`` for ``seed = key_seed(key,
    salt)``: only 32-bit integer operations, so a Pallas kernel draws the same numbers."""
    h = fmix32(i * jnp.uint32(_GOLDEN) + seed)
    h = fmix32(h ^ (seed >> 7))
    # h >> 8 < 2**24: as int32 the same value, and int-to-float is what every backend lowers.
    return lax.bitcast_convert_type(h >> 8, jnp.int32).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def uniform(key: jax.Array, shape: tuple[int, ...], salt: int = 0, *, start: int = 0) -> jax.Array:
    """``float32`` numbers in ``[0, 1)`` of ``shape``, a pure function of ``key`` (a raw
    ``uint32`` key or a typed PRNG key), ``salt`` and the position. ``start`` is the
    position of the first value: ``uniform(k, (a + b,))[a:] == uniform(k, (b,), start=a)``,
    so a vector's noise can be drawn piece by piece."""
    i = lax.iota(jnp.uint32, math.prod(shape)) + jnp.uint32(start & 0xFFFFFFFF)
    return uniform_at(i, key_seed(key, salt)).reshape(shape)
