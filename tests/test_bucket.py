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


@pytest.mark.parametrize("shape", [(16, 256), (3, 8, 128), (2, 24, 384), (8, 100), (7, 128), (4096,)])
def test_ravel_tiles_follows_the_tiles_and_unravel_inverts_it(shape):
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    flat = np.asarray(bucket.ravel_tiles(jnp.asarray(a)))
    assert flat.shape == (a.size,)
    if len(shape) >= 2 and shape[-2] % 8 == 0 and shape[-1] % 128 == 0:
        r, c = shape[-2:]
        lead = a.reshape(-1, r, c)
        for t, i, s, j, l in [(0, 0, 1, 0, 5), (len(lead) - 1, r // 8 - 1, 7, c // 128 - 1, 127),
                                (0, min(1, r // 8 - 1), 3, min(1, c // 128 - 1), 64)]:
            pos = ((t * (r // 8) + i) * (c // 128) + j) * 1024 + 128 * s + l
            assert flat[pos] == lead[t, 8 * i + s, 128 * j + l]
    else:
        np.testing.assert_array_equal(flat, a.reshape(-1))
    back = bucket.unravel_tiles(jnp.asarray(flat), shape)
    np.testing.assert_array_equal(np.asarray(back), a)


def test_ravel_leaf_is_row_major_off_tpu():
    a = jnp.arange(16 * 256, dtype=jnp.float32).reshape(16, 256)
    np.testing.assert_array_equal(np.asarray(jax.jit(bucket.ravel_leaf)(a)), np.asarray(a).reshape(-1))
    np.testing.assert_array_equal(np.asarray(bucket.unravel_leaf(a.reshape(-1), (16, 256))), np.asarray(a))
