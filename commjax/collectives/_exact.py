"""The exact mean of many leaves in one all-reduce (the exact bucket)."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from commjax import _compat, bucket as flat_bucket


# ------------------------------------------------------------------------ all_reduce


def exact_mean(parts: Sequence[jax.Array], axis_name: Any, num_replicas: int,
               extra: Sequence[jax.Array] = ()) -> tuple[list[jax.Array], list[jax.Array]]:
    """The exact mean of real ``parts`` (flattened) in one all-reduce (the *exact bucket*:
    joined as whole rows, :mod:`commjax.bucket`): in fp32, or in float64 when a part is
    float64; and of the ``extra`` arrays as further operands of the same collective
    (uncopied). ``axis_name=None``: no collective. Bytes: ``2 (N-1)/N * 4 * elements`` (8
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
        bucket, *extra = [v / num_replicas for v in _compat.psum([bucket] + list(extra), axis_name)]
    out, pos = [], 0
    for p in flat:
        out.append(bucket[pos:pos + p.shape[0]])
        pos += p.shape[0]
    return out, list(extra)
