"""Flat buckets: bucket.concat is jnp.concatenate, bit for bit, whatever the lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from commjax import bucket


@pytest.mark.parametrize("lengths,width", [
    ([1024, 4096], 1024), ([256, 768], 256), ([12, 20], 4), ([7, 1024], 1), ([0, 64], 64),
    ([1 << 20], 1024), ([], 1024),
])
def test_row_width_is_the_largest_power_of_two_dividing_every_length(lengths, width):
    assert bucket.row_width(lengths) == width


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=6), st.sampled_from([1, 8, 256]))
def test_concat_equals_jnp_concatenate(lengths, multiple):
    lengths = [n * multiple for n in lengths]
    rng = np.random.default_rng(sum(lengths))
    parts = [jnp.asarray(rng.standard_normal(n).astype(np.float32)) for n in lengths]
    got = jax.jit(bucket.concat)(parts)
    np.testing.assert_array_equal(np.asarray(got), np.concatenate([np.asarray(p) for p in parts]))


@pytest.mark.parametrize("lengths,operands", [
    ((2048, 1024), "(tensor<2x1024xui32>, tensor<1x1024xui32>) -> tensor<3x1024xui32>"),
    ((2047, 1024), "(tensor<2047xui32>, tensor<1024xui32>) -> tensor<3071xui32>"),
])
def test_concat_joins_whole_rows_when_the_lengths_allow(lengths, operands):
    parts = [jnp.arange(n, dtype=jnp.uint32) for n in lengths]
    out = bucket.concat(parts)
    assert out.dtype == jnp.uint32 and out.shape == (sum(lengths),)
    assert operands in jax.jit(bucket.concat).lower(parts).as_text()
