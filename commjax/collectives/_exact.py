"""The exact mean of many leaves in one all-reduce (the exact bucket)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from commjax import _compat, bucket as flat_bucket

__all__ = ["exact_mean", "prescale", "unscale_mean"]


def _shift(n: int) -> int:
    """``k`` with ``2**k >= n``: ``n`` terms of magnitude at most ``M 2**-k`` sum to at most
    ``M`` (no overflow for any finite ``M``)."""
    return max(int(n) - 1, 0).bit_length()


def prescale(x: jax.Array, n: int) -> jax.Array:
    """``x 2**-k`` before a sum of ``n`` terms (``unscale_mean`` after it): a mean that
    fp32 can hold is returned even when the plain sum would overflow. Scaling by a power
    of two commutes with rounding, so ``unscale_mean(sum(prescale(x)))`` has the bits of
    ``sum(x) / n`` whenever that sum is finite, except for terms below ``2**(k - 126)``,
    which are flushed to zero (as XLA does on CPU, and TPUs) before the sum. Integer
    arrays pass unchanged."""
    k = _shift(n)
    if not k or not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return x * jnp.asarray(2.0 ** -k, x.dtype)


def unscale_mean(total: jax.Array, n: int) -> jax.Array:
    """The mean from the sum of terms scaled by ``prescale``: ``total / (n 2**-k)``."""
    if not jnp.issubdtype(total.dtype, jnp.inexact):
        return total / n
    return (total / jnp.asarray(n * 2.0 ** -_shift(n), total.dtype)).astype(total.dtype)


# ------------------------------------------------------------------------ all_reduce


def exact_mean(parts: Sequence[jax.Array], axis_name: Any, num_replicas: int,
               extra: Sequence[jax.Array] = ()) -> tuple[list[jax.Array], list[jax.Array]]:
    """The exact mean of real ``parts`` (flattened) in one all-reduce (the *exact bucket*:
    joined as whole rows, ``commjax.bucket``): in fp32, or in float64 when a part is
    float64; and of the ``extra`` arrays as further operands of the same collective
    (uncopied). The bucket is summed pre-scaled (``prescale``): a mean that fp32 can
    hold is returned even when the sum over replicas overflows. ``axis_name=None``: no
    collective. Bytes: ``2 (N-1)/N * 4 * elements`` (8
    per element in float64)."""
    # float64 parts keep their precision: then the whole bucket is float64 (XLA would
    # widen an fp32 operand beside it anyway, and the plan counts what travels).
    dtype = jnp.float64 if any(jnp.dtype(jnp.result_type(p)) == jnp.float64 for p in parts) else jnp.float32
    flat = [jnp.ravel(p).astype(dtype) for p in parts]
    extra = [e.astype(jnp.float32) for e in extra]
    if not parts and not extra:
        return [], []
    bucket = flat_bucket.concat(flat) if flat else jnp.zeros((0,), dtype)
    if axis_name is not None:
        sums = _compat.psum([prescale(v, num_replicas) for v in [bucket] + extra], axis_name)
        bucket, *extra = [unscale_mean(v, num_replicas) for v in sums]
    out, pos = [], 0
    for p in flat:
        out.append(bucket[pos:pos + p.shape[0]])
        pos += p.shape[0]
    return out, list(extra)
