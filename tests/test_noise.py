"""Counter-based uniform noise: range, moments, independence across keys and positions."""

import jax
import jax.numpy as jnp
import numpy as np

from commjax import noise


def test_fmix32_is_a_bijection_on_a_sample():
    x = jnp.arange(1 << 16, dtype=jnp.uint32) * jnp.uint32(65537)
    assert len(np.unique(np.asarray(noise.fmix32(x)))) == 1 << 16


def test_uniform_range_moments_and_determinism():
    key = jax.random.PRNGKey(7)
    u = np.asarray(noise.uniform(key, (1 << 20,)), np.float64)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 2e-3 and abs(u.var() - 1 / 12) < 1e-3
    # Equal-width histogram: every bin within 4 sigma of its expected count.
    counts, _ = np.histogram(u, bins=64, range=(0, 1))
    expected = u.size / 64
    assert np.all(np.abs(counts - expected) < 4 * np.sqrt(expected))
    np.testing.assert_array_equal(u, np.asarray(noise.uniform(key, (1 << 20,)), np.float64))
    typed = jax.random.wrap_key_data(key)
    np.testing.assert_array_equal(np.asarray(noise.uniform(typed, (8, 4))),
                                  np.asarray(noise.uniform(key, (32,))).reshape(8, 4))


def test_neighbours_keys_and_salts_are_uncorrelated():
    n = 1 << 18
    base = np.asarray(noise.uniform(jax.random.PRNGKey(0), (n + 1,)), np.float64)
    others = [
        base[1:],  # the next position
        np.asarray(noise.uniform(jax.random.PRNGKey(1), (n,)), np.float64),  # next key
        np.asarray(noise.uniform(jax.random.fold_in(jax.random.PRNGKey(0), 1), (n,)), np.float64),
        np.asarray(noise.uniform(jax.random.PRNGKey(0), (n,), salt=1), np.float64),
    ]
    for o in others:
        assert abs(np.corrcoef(base[:n], o)[0, 1]) < 0.01
    # Bit 0 of the codes (the finest level) is balanced too.
    codes = (base * (1 << 24)).astype(np.int64)
    assert abs((codes & 1).mean() - 0.5) < 0.01


def test_start_continues_the_same_sequence():
    """``start`` draws the slice of a longer vector's noise: pieces drawn on their own
    and joined are bit for bit the noise of the whole (what per-leaf encoding relies on)."""
    key = jax.random.PRNGKey(11)
    whole = np.asarray(noise.uniform(key, (5000,), 3))
    for lo, n in ((0, 5000), (1, 7), (256, 1024), (4999, 1), (1234, 3000)):
        piece = np.asarray(noise.uniform(key, (n,), 3, start=lo))
        np.testing.assert_array_equal(piece, whole[lo:lo + n])
    shaped = np.asarray(noise.uniform(key, (4, 256), 3, start=512))
    np.testing.assert_array_equal(shaped.ravel(), whole[512:512 + 1024])
    # A different start is different noise, not a shifted copy of the same positions.
    assert not np.array_equal(np.asarray(noise.uniform(key, (64,), 3, start=1)), whole[:64])
