"""cj.fp8: blockwise scaled FP8 codes (e4m3, e5m2), nearest or stochastic rounding.

Checked: the codes are astype(float8)'s bits; the per-block error bounds; stochastic
rounding is unbiased over many keys; interpret-mode kernel == reference bit for bit;
NaN/Inf blocks decode to NaN and are read from the scale words; HLO bytes; bad input;
one cj.zero configuration (fp8 gradients, lossless weights). The contract matrix
(tests/test_contract.py) runs it through compressed_mean's reducers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commjax as cj
from commjax.kernels.fp8 import FP8_FORMATS, fp8_blocks
from commjax.testing import noniid_classification, train

N = 8
B = 128
FMTS = ("e4m3", "e5m2")


def _blocks(seed=0, nb=16):
    """Blocks with magnitudes over many binades (log-normal scales), so subnormals,
    every exponent and the absmax are all exercised."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(k1, (nb, B)) * jnp.exp(2.0 * jax.random.normal(k2, (nb, B)))
    return x.at[0, :5].set(jnp.array([0.0, -0.0, 1e-30, -3.0, 1e-12]))


def _codes(rows):
    return jnp.concatenate([(rows[:, :-1] >> (8 * j)) & 0xFF for j in range(4)], axis=1)


@pytest.mark.parametrize("fmt", FMTS)
def test_nearest_codes_are_astype_float8_and_within_bounds(fmt):
    c = cj.fp8(fmt, block_size=B)
    x = _blocks()
    words = c.encode(x.reshape(-1), None)
    assert words.dtype == jnp.uint32 and words.shape == (16 * (B // 4 + 1),)
    f = FP8_FORMATS[fmt]
    s = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    want = jax.lax.bitcast_convert_type((x * (f.fmax / s)).astype(f.dtype), jnp.uint8)
    np.testing.assert_array_equal(_codes(words.reshape(16, -1)), want)
    y = c.decode(words, x.size).reshape(x.shape)
    bound = 2.0 ** -4 if fmt == "e4m3" else 2.0 ** -3
    assert float(jnp.max(jnp.abs(y - x) / s)) <= bound
    normal = jnp.abs(x) * (f.fmax / s) >= 2.0 ** f.emin
    rel = jnp.where(normal, jnp.abs(y - x) / jnp.where(normal, jnp.abs(x), 1.0), 0.0)
    assert float(jnp.max(rel)) <= 2.0 ** -(f.mant_bits + 1) * (1 + 2 ** -20)
    assert bool(jnp.all(y == jnp.abs(y) * jnp.sign(x)) | jnp.all(x == 0))  # signs kept
    assert bool(jnp.signbit(y[0, 1]))  # -0 stays -0


@functools.partial(jax.jit, static_argnums=0)
def _mean_over_keys(codec, x, keys):
    return jnp.mean(jax.vmap(lambda k: codec.decode(codec.encode(x, k), x.shape[0]))(keys), axis=0)


@pytest.mark.parametrize("fmt", FMTS)
def test_stochastic_is_unbiased(fmt):
    c = cj.fp8(fmt, block_size=B, stochastic=True)
    x = _blocks(1, nb=2).reshape(-1)
    keys = jax.random.split(jax.random.PRNGKey(5), 4000)
    mean = _mean_over_keys(c, x, keys)
    # Each value rounds to one of its two FP8 neighbours: the error of the mean of K draws
    # has standard deviation <= spacing / (2 sqrt K); 6 sigma with the spacing bounded by
    # 2**-m |x| (normals) or the block's subnormal spacing.
    f = FP8_FORMATS[fmt]
    s = jnp.repeat(jnp.max(jnp.abs(x.reshape(2, B)), axis=1), B)
    spacing = jnp.maximum(jnp.abs(x) * 2.0 ** -f.mant_bits, s / f.fmax * 2.0 ** (f.emin - f.mant_bits))
    assert bool(jnp.all(jnp.abs(mean - x) <= 6 * spacing / (2 * np.sqrt(4000)) + 1e-30))
    single = c.roundtrip(x, keys[0])
    assert float(jnp.max(jnp.abs(single - x) / spacing)) < 1.0 + 1e-6


@pytest.mark.parametrize("fmt", FMTS)
def test_interpret_kernel_equals_reference(fmt):
    x = _blocks(2)
    e = _blocks(3) * 0.01
    u = jax.random.uniform(jax.random.PRNGKey(4), x.shape)
    for uniforms, residual, output in ((None, None, None), (u, e, "residual"), (None, e, "decoded")):
        ref = fp8_blocks(x, fmt=fmt, uniforms=uniforms, residual=residual, output=output, impl="reference")
        got = fp8_blocks(x, fmt=fmt, uniforms=uniforms, residual=residual, output=output, impl="interpret")
        for a, b in zip(ref, got):
            assert (a is None and b is None) or np.array_equal(a, b)
    c = cj.fp8(fmt, block_size=B)
    words, res = c.encode_feedback(x.reshape(-1), e.reshape(-1), None)
    y = x.reshape(-1) + e.reshape(-1)
    np.testing.assert_array_equal(words, c.encode(y, None))
    np.testing.assert_array_equal(res, y - c.decode(words, y.shape[0]))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_non_finite_block_decodes_to_nan_and_is_flagged(bad):
    c = cj.fp8("e4m3", block_size=B)
    x = _blocks(4, nb=3).at[1, 7].set(bad).reshape(-1)
    words = c.encode(x, None)
    y = c.decode(words, x.shape[0]).reshape(3, B)
    assert bool(jnp.all(jnp.isnan(y[1]))) and bool(jnp.all(jnp.isfinite(y[0]))) and bool(jnp.all(jnp.isfinite(y[2])))
    assert not bool(c.payload_finite(words))
    assert bool(c.payload_finite(c.encode(_blocks(4, nb=3).reshape(-1), None)))


def test_bytes_8_bits_plus_scales():
    """Two-phase (auto) on 8 replicas: 8 bits per element + a scale word per block, at
    least 3.5x below the exact fp32 mean, and no NaN flags (the gathered scale words tell a
    non-finite block). The compiled step sends the plan: tests/test_contract.py."""
    params = {"w": jax.ShapeDtypeStruct((256, 128), jnp.float32)}
    n = 256 * 128
    plan = cj.communication_plan(cj.fp8("e4m3"), params, N)
    want = 2 * (N - 1) / N * n * (8 + 32 / 256) / 8  # all-to-all + all-gather of the payload
    assert plan.bytes_per_step == pytest.approx(want, abs=0.5), plan.table()
    assert plan.compression_ratio >= 3.5


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="`format`"):
        cj.fp8("e3m4")
    with pytest.raises(ValueError, match="multiple of 4"):
        cj.fp8(block_size=6)
    with pytest.raises(ValueError, match="`stochastic`"):
        cj.fp8(stochastic="yes")
    with pytest.raises(ValueError, match="`kernels`"):
        cj.fp8(kernels="cuda")
    with pytest.raises(ValueError, match="PRNG key"):
        cj.fp8(stochastic=True).encode(jnp.zeros((256,)), None)


def test_zero_with_fp8_gradients_and_lossless_weights():
    """cj.zero with fp8 on its gradient reduce-scatter and cj.lossless on its weight
    all-gather (one compiled configuration for both codecs): replicas stay identical and
    the loss falls on the non-i.i.d. task."""
    task = noniid_classification(N, examples_per_replica=32, dim=32, hidden=64, seed=5)
    tx = cj.zero(optax.adam(1e-2), "data", min_compress_size=512,
                 grad_codec=cj.fp8(block_size=64, stochastic=True), weight_codec=cj.lossless(block_size=64))
    got = train(tx, task, 4)
    assert got.replicas_identical
    assert got.final_loss < 0.9 * task.global_loss(task.params)
