"""Codec properties of the block compressors, with no communication."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import commjax as cj
from commjax import packing
from commjax.fingerprint import describe
from commjax.packing import pack_codes, packed_words, unpack_codes

BLOCK_CODECS = {
    "identity": cj.identity(),
    "cast_bf16": cj.cast(jnp.bfloat16),
    "cast_fp16": cj.cast(jnp.float16),
    "q8": cj.quantize(8),
    "q4": cj.quantize(4),
    "q2": cj.quantize(2),
    "q8_nearest": cj.quantize(8, stochastic=False),
    "q4_nearest": cj.quantize(4, stochastic=False),
    "q2_nearest": cj.quantize(2, stochastic=False),
    "q2_clip": cj.quantize(2, block_size=128, stochastic=False, clip_rms=1.22),
    "q2_midrise": cj.quantize(2, midrise=True),
    "q4_midrise_nearest": cj.quantize(4, stochastic=False, midrise=True),
    "q2_midrise_clip": cj.quantize(2, block_size=128, stochastic=False, clip_rms=1.49, midrise=True),
    "q8_midrise_block100": cj.quantize(8, block_size=100, midrise=True),
    "q4_block100": cj.quantize(4, block_size=100),
    "qsgd": cj.qsgd(),
    "qsgd7": cj.qsgd(levels=7, block_size=64),
    "terngrad": cj.terngrad(),
    "sign": cj.sign(),
    "sign_block33": cj.sign(block_size=33),
}


def _x(n, seed=0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.PRNGKey(seed), (n,)) * 3.0).astype(dtype)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8, 16])
@pytest.mark.parametrize("block", [1, 31, 32, 33, 4097])
def test_pack_roundtrip_awkward_block_sizes(bits, block):
    rng = np.random.default_rng(bits * 1000 + block)
    codes = rng.integers(0, 2**bits, size=(3, block), dtype=np.uint64).astype(np.uint32)
    words = pack_codes(jnp.asarray(codes), bits)
    assert words.dtype == jnp.uint32
    assert words.shape == (3, packed_words(block, bits))
    np.testing.assert_array_equal(np.asarray(unpack_codes(words, bits, block)), codes)


def test_pack_large_flat_roundtrip():
    n = 2**20 + 3
    codes = jax.random.randint(jax.random.PRNGKey(3), (1, n), 0, 16).astype(jnp.uint32)
    words = pack_codes(codes, 4)
    np.testing.assert_array_equal(np.asarray(unpack_codes(words, 4, n)), np.asarray(codes))


def test_pack_bit_layout_is_documented_one():
    """Sign bits as lane slices: bit j of word w is element j W + w (W = 2 words here)."""
    codes = np.zeros(64, np.uint32)
    codes[0], codes[31], codes[33] = 1, 1, 1
    words = np.asarray(pack_codes(jnp.asarray(codes), 1))
    assert words.tolist() == [0x1, (1 << 15) | (1 << 16)]


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16])
def test_pack_layout_matches_the_lane_slice_formula(bits):
    """words[..., w] = sum_j codes[..., j W + w] << (bits j), W = ceil(B / (32 / bits)),
    the block zero-padded to k W codes."""
    rng = np.random.default_rng(bits)
    k = 32 // bits
    codes = rng.integers(0, 2**bits, size=(2, 80), dtype=np.uint64).astype(np.uint32)
    w = -(-80 // k)
    padded = np.zeros((2, k * w), np.uint64)
    padded[:, :80] = codes
    want = np.zeros((2, w), np.uint64)
    for j in range(k):
        want |= padded[:, j * w:(j + 1) * w] << (bits * j)
    got = np.asarray(pack_codes(jnp.asarray(codes), bits))
    np.testing.assert_array_equal(got, want.astype(np.uint32))
    np.testing.assert_array_equal(np.asarray(unpack_codes(jnp.asarray(got), bits, 80)), codes)
    # The CPU and accelerator forms of the packing: the same words, the same codes back.
    padded32 = jnp.asarray(padded.astype(np.uint32))
    for pack in (packing._pack_sliced, packing._pack_stacked):
        np.testing.assert_array_equal(np.asarray(pack(padded32, bits=bits, k=k)), got)
    for unpack in (packing._unpack_sliced, packing._unpack_stacked):
        np.testing.assert_array_equal(np.asarray(unpack(jnp.asarray(got), bits=bits))[:, :80], codes)


@pytest.mark.parametrize("bits", [3, 6])
def test_pack_other_widths_match_the_bit_plane_formula(bits):
    """words[..., k * W + w] = sum_j ((codes[..., 32 w + j] >> k) & 1) << j."""
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, size=(2, 80), dtype=np.uint64).astype(np.uint32)
    padded = np.zeros((2, 96), np.uint64)
    padded[:, :80] = codes
    want = np.zeros((2, bits * 3), np.uint64)
    for k in range(bits):
        for w in range(3):
            for j in range(32):
                want[:, k * 3 + w] |= ((padded[:, 32 * w + j] >> k) & 1) << j
    np.testing.assert_array_equal(np.asarray(pack_codes(jnp.asarray(codes), bits)),
                                  want.astype(np.uint32))


@pytest.mark.parametrize("name", sorted(BLOCK_CODECS))
@pytest.mark.parametrize("n", [1, 31, 33, 4097])
def test_roundtrip_shape_dtype_awkward_sizes(name, n):
    comp = BLOCK_CODECS[name]
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16) if n == 33 else (jnp.float32,):
        x = _x(n, seed=n, dtype=dtype)
        y = comp.roundtrip(x, jax.random.PRNGKey(1))
        assert y.shape == x.shape and y.dtype == x.dtype
        assert bool(jnp.all(jnp.isfinite(y)))


@pytest.mark.parametrize("name", sorted(BLOCK_CODECS))
def test_all_zero_blocks_decode_to_exact_zeros(name):
    comp = BLOCK_CODECS[name]
    x = jnp.zeros((777,), jnp.float32)
    y = comp.roundtrip(x, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(y), 0.0)
    # A zero block next to a non-zero block stays exactly zero too.
    b = comp.alignment
    x = jnp.concatenate([jnp.zeros((b * 2,)), _x(b)])
    y = comp.roundtrip(x, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(y[: 2 * b]), 0.0)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("block", [256, 100])
def test_nearest_rounding_within_half_a_step(bits, block):
    comp = cj.quantize(bits, block_size=block, stochastic=False)
    n = block * 13
    x = _x(n, seed=bits)
    y = comp.roundtrip(x)
    scales = np.abs(np.asarray(x).reshape(-1, block)).max(axis=1)
    step = scales / (2 ** (bits - 1) - 1)
    err = np.abs(np.asarray(y) - np.asarray(x)).reshape(-1, block)
    # half a step, plus fp32 round-off of the scale arithmetic
    assert np.all(err <= step[:, None] * (0.5 + 1e-5) + 1e-7)
    # The block maximum is represented exactly (up to round-off).
    idx = np.abs(np.asarray(x).reshape(-1, block)).argmax(axis=1)
    got = np.asarray(y).reshape(-1, block)[np.arange(len(idx)), idx]
    want = np.asarray(x).reshape(-1, block)[np.arange(len(idx)), idx]
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("dtype,rel", [(jnp.bfloat16, 2**-8), (jnp.float16, 2**-11)])
def test_cast_is_round_to_nearest(dtype, rel):
    x = _x(1000, seed=7) * 10.0
    y = cj.cast(dtype).roundtrip(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x.astype(dtype).astype(jnp.float32)))
    assert np.all(np.abs(np.asarray(y - x)) <= rel * np.abs(np.asarray(x)) + 1e-30)


def test_cast_fp16_saturates_instead_of_inf():
    x = jnp.array([1e6, -1e6, 3.0, 70000.0])
    y = cj.cast(jnp.float16).roundtrip(x)
    assert bool(jnp.all(jnp.isfinite(y)))
    np.testing.assert_array_equal(np.asarray(y), [65504.0, -65504.0, 3.0, 65504.0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cast_local_value_is_the_decoded_payload(dtype):
    """``encode_and_decode`` and ``encode_feedback`` take the local value from the rounding
    itself, not from the words: bit for bit ``decode(encode(y))`` over the whole float32
    range (subnormals, saturation, infinities, NaN, signed zeros)."""
    bits = np.random.default_rng(3).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, -70000.0], np.float32)
    y = jnp.asarray(np.concatenate([bits.view(np.float32), special, np.zeros(248, np.float32)]))
    e = jnp.asarray(np.random.default_rng(4).standard_normal(y.shape[0]).astype(np.float32))
    codec = cj.cast(dtype)
    words, local = codec.encode_and_decode(y, None)
    np.testing.assert_array_equal(np.asarray(local).view(np.uint32),
                                  np.asarray(codec.decode(words, y.shape[0])).view(np.uint32))
    words_fb, res = codec.encode_feedback(y - e, e, None)
    want = (y - e) + e
    np.testing.assert_array_equal(np.asarray(words_fb), np.asarray(codec.encode(want, None)))
    np.testing.assert_array_equal(np.asarray(res).view(np.uint32),
                                  np.asarray(want - codec.decode(words_fb, y.shape[0])).view(np.uint32))


@pytest.mark.parametrize(
    "name", ["q8", "q4", "q2", "qsgd", "qsgd7", "terngrad", "q4_block100"]
)
def test_stochastic_codecs_are_unbiased(name):
    comp = BLOCK_CODECS[name]
    b = comp.alignment
    x = _x(2 * b, seed=11)
    # Include exact zeros and the block maximum.
    x = x.at[3].set(0.0)
    k = 4000
    keys = jax.random.split(jax.random.PRNGKey(5), k)
    ys = np.asarray(jax.jit(jax.vmap(lambda key: comp.roundtrip(x, key)))(keys), np.float64)
    mean = ys.mean(axis=0)
    se = ys.std(axis=0, ddof=1) / np.sqrt(k)
    err = np.abs(mean - np.asarray(x, np.float64))
    deterministic = se == 0
    # Where every draw agreed the value must be exact; elsewhere within 4 standard errors
    # (plus fp32 round-off of the decode).
    assert np.all(err[deterministic] <= 1e-6 * (1 + np.abs(np.asarray(x))[deterministic]))
    z = err[~deterministic] / se[~deterministic]
    assert z.max() < 4.5, f"max z-score {z.max():.2f}"
    # Stochastic rounding actually happened (not silently nearest rounding).
    assert (~deterministic).sum() > b // 2


def test_nearest_rounding_is_deterministic_and_stochastic_is_not():
    x = _x(512, seed=2)
    near = cj.quantize(4, stochastic=False)
    sto = cj.quantize(4)
    np.testing.assert_array_equal(
        np.asarray(near.roundtrip(x, jax.random.PRNGKey(0))),
        np.asarray(near.roundtrip(x, jax.random.PRNGKey(1))),
    )
    assert not np.array_equal(
        np.asarray(sto.roundtrip(x, jax.random.PRNGKey(0))),
        np.asarray(sto.roundtrip(x, jax.random.PRNGKey(1))),
    )


def test_stochastic_requires_key():
    with pytest.raises(ValueError, match="key"):
        cj.quantize(8).roundtrip(_x(256), None)


@pytest.mark.parametrize("block", [256, 33, 1])
def test_sign_bits_and_scales_exact(block):
    comp = cj.sign(block_size=block)
    n = block * 7
    x = _x(n, seed=block)
    words = comp.encode(x, None)
    rows = np.asarray(words).reshape(n // block, comp.row_words)
    scales = rows[:, -1].view(np.float32)
    expect_scales = np.abs(np.asarray(x)).reshape(-1, block).mean(axis=1).astype(np.float32)
    np.testing.assert_allclose(scales, expect_scales, rtol=1e-6)
    bits = np.asarray(unpack_codes(jnp.asarray(rows[:, :-1]), 1, block))
    np.testing.assert_array_equal(bits, (np.asarray(x) >= 0).reshape(-1, block))
    y = np.asarray(comp.decode(words, n)).reshape(-1, block)
    np.testing.assert_array_equal(y, np.where(bits == 1, 1.0, -1.0) * scales[:, None])


def test_bits_per_element_reported():
    assert cj.identity().bits_per_element() == 32
    assert cj.cast().bits_per_element() == 16
    assert cj.quantize(8).bits_per_element() == pytest.approx(8 + 32 / 256)
    assert cj.quantize(4).bits_per_element() == pytest.approx(4 + 32 / 256)
    assert cj.quantize(2).bits_per_element() == pytest.approx(2 + 32 / 256)
    assert cj.terngrad().bits_per_element() == pytest.approx(2 + 32 / 256)
    assert cj.sign().bits_per_element() == pytest.approx(1 + 32 / 256)
    assert cj.qsgd(levels=16).bits_per_element() == pytest.approx(6 + 32 / 256)
    assert cj.qsgd(levels=7).bits_per_element() == pytest.approx(4 + 32 / 256)


def test_payload_bytes_match_encoded_size():
    for name, comp in BLOCK_CODECS.items():
        n = comp.alignment * 9
        words = comp.encode(_x(n), jax.random.PRNGKey(0))
        assert words.dtype == jnp.uint32, name
        assert words.size * 4 == comp.payload_bytes(n), name


@pytest.mark.parametrize(
    "factory,kwargs,match",
    [
        (cj.quantize, {"bits": 3}, "bits"),
        (cj.quantize, {"bits": 8, "block_size": 0}, "block_size"),
        (cj.quantize, {"bits": 8, "block_size": -4}, "block_size"),
        (cj.qsgd, {"levels": 0}, "levels"),
        (cj.qsgd, {"block_size": 0}, "block_size"),
        (cj.sign, {"block_size": 0}, "block_size"),
        (cj.terngrad, {"block_size": 2.5}, "block_size"),
        (cj.terngrad, {"clip_sigma": -1.0}, "clip_sigma"),
        (cj.quantize, {"clip_rms": 0.0}, "clip_rms"),
        (cj.quantize, {"clip_rms": -1.0}, "clip_rms"),
        (cj.quantize, {"clip_rms": float("nan")}, "clip_rms"),
        (cj.quantize, {"clip_rms": float("inf")}, "clip_rms"),
        (cj.quantize, {"clip_rms": True}, "clip_rms"),
        (cj.quantize, {"clip_rms": "1.2"}, "clip_rms"),
        (cj.cast, {"dtype": jnp.int8}, "dtype"),
    ],
)
def test_bad_arguments_raise_at_construction(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)


def test_compressors_are_immutable_and_hashable():
    c = cj.quantize(4)
    with pytest.raises(Exception):
        c.num_bits = 8  # type: ignore[misc]
    assert hash(c) == hash(cj.quantize(4)) and c == cj.quantize(4)


def _mse(codec, x):
    return float(jnp.sum(jnp.square(codec.roundtrip(x) - x)) / jnp.sum(jnp.square(x)))


@pytest.mark.parametrize("bits,clip,most,gain", [(2, 1.22, 0.2, 0.35), (4, 2.5, 0.0125, 0.92)])
def test_clip_rms_cuts_the_error_of_nearest_codes(bits, clip, most, gain):
    """Gaussian blocks of 128: clipping at ``c`` RMS lowers the squared error below the
    absmax scale's (2 bits: 0.19 of the energy against 0.59; 4 bits: 0.0122 against
    0.0136), as the docstring of ``quantize`` says."""
    x = jax.random.normal(jax.random.PRNGKey(bits), (128 * 512,))
    plain = _mse(cj.quantize(bits, block_size=128, stochastic=False), x)
    clipped = _mse(cj.quantize(bits, block_size=128, stochastic=False, clip_rms=clip), x)
    assert clipped <= most and clipped < gain * plain, (clipped, plain)


@pytest.mark.parametrize("bits,clip,most,gain", [(2, None, 0.32, 0.55), (2, 1.49, 0.12, 0.65),
                                                 (4, None, 0.0122, 0.9)])
def test_midrise_uses_every_code_and_cuts_the_error(bits, clip, most, gain):
    """Gaussian blocks of 128, nearest rounding: the midrise grid uses all ``2**bits``
    codes and its squared error is below the midtread grid's at the same bytes (2 bits:
    0.31 against 0.59 unclipped, 0.117 at ``clip_rms=1.49`` against 0.19 at 1.22; 4
    bits: 0.0120 against 0.0138), as the docstring of ``quantize`` says."""
    x = jax.random.normal(jax.random.PRNGKey(bits), (128 * 512,))
    mid = cj.quantize(bits, block_size=128, stochastic=False, clip_rms=clip, midrise=True)
    tread = cj.quantize(bits, block_size=128, stochastic=False, clip_rms=1.22 if clip else None)
    assert mid.payload_bytes(x.size) == tread.payload_bytes(x.size)
    assert _mse(mid, x) <= most and _mse(mid, x) < gain * _mse(tread, x), (_mse(mid, x), _mse(tread, x))
    rows = mid.encode(x, None).reshape(512, -1)
    codes = np.asarray(unpack_codes(rows[:, :-1], bits, 128))
    assert set(np.unique(codes)) == set(range(2 ** bits))
    # Every decoded value is an odd multiple of s / K: no zero level.
    s = np.asarray(rows[:, -1]).view(np.float32)[:, None]
    k = 2 ** bits - 1
    lv = np.asarray(mid.roundtrip(x)).reshape(512, 128) / (s / k)
    np.testing.assert_allclose(lv, np.round(lv), atol=1e-3)
    assert np.all(np.round(lv) % 2 == 1)


def test_midrise_nearest_is_within_a_step_and_has_its_own_fingerprint():
    """Nearest midrise codes are within half a level spacing (``s / K``) of the value,
    over magnitudes from 2**-100 to 2**100; the option joins the fingerprint only when set."""
    q = cj.quantize(4, block_size=64, stochastic=False, midrise=True)
    for e in (-100, -20, 0, 20, 100):
        x = jax.random.normal(jax.random.PRNGKey(e + 200), (64 * 32,)) * 2.0 ** e
        s = jnp.max(jnp.abs(x.reshape(32, 64)), axis=1, keepdims=True)
        err = jnp.abs(q.roundtrip(x).reshape(32, 64) - x.reshape(32, 64))
        assert bool(jnp.all(err <= s / 15 * (1 + 1e-5))), e
    assert "midrise" not in describe(cj.quantize(4))
    assert "midrise=True" in describe(q)
    with pytest.raises(ValueError, match="midrise"):
        cj.quantize(4, midrise="yes")


def test_clip_rms_codes_do_not_depend_on_magnitude():
    """Scaling a vector by a power of two from 2**-100 to 2**100 leaves every code as it
    is and scales every block's scale exactly: no overflow or underflow of the RMS."""
    q = cj.quantize(2, block_size=128, stochastic=False, clip_rms=1.22)
    x = _x(128 * 64, seed=5)
    rows = np.asarray(q.encode(x, None)).reshape(64, q.row_words)
    for k in range(-100, 101, 25):
        got = np.asarray(q.encode(x * jnp.float32(2.0 ** k), None)).reshape(64, q.row_words)
        np.testing.assert_array_equal(got[:, :-1], rows[:, :-1], err_msg=str(k))
        np.testing.assert_array_equal(got[:, -1].view(np.float32),
                                      rows[:, -1].view(np.float32) * np.float32(2.0 ** k))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_clip_rms_flags_nonfinite_blocks_and_leaves_the_others(bits):
    """A block holding NaN or Inf still gets a non-finite scale (flagged, as unclipped);
    the other blocks encode as they do alone; the residual of error feedback is what the
    decode misses, clipped excess included, bit for bit."""
    q = cj.quantize(bits, block_size=64, stochastic=False, clip_rms=2.0)
    x = np.asarray(_x(64 * 6, seed=bits)).copy()
    alone = np.asarray(q.encode(jnp.asarray(x), None)).reshape(6, -1)
    x[70], x[200] = np.nan, -np.inf
    rows = np.asarray(q.encode(jnp.asarray(x), None)).reshape(6, -1)
    scales = rows[:, -1].view(np.float32)
    assert not np.isfinite(scales[1]) and not np.isfinite(scales[3])
    np.testing.assert_array_equal(rows[[0, 2, 4, 5]], alone[[0, 2, 4, 5]])
    y, e = _x(64 * 6, seed=7), _x(64 * 6, seed=8) * 0.1
    words, res = q.encode_feedback(y, e, None)
    np.testing.assert_array_equal(np.asarray(words), np.asarray(q.encode(y + e, None)))
    np.testing.assert_array_equal(np.asarray(res), np.asarray((y + e) - q.decode(words, y.size)))


def test_clip_rms_kernels_and_fingerprint():
    """The Pallas path (interpret mode) encodes the clipped blocks to the same bits; an
    unclipped codec's fingerprint text is what it was before the option existed."""
    x = _x(256 * 8, seed=9)
    for bits in (8, 4):
        ref = cj.quantize(bits, stochastic=False, clip_rms=2.5, kernels="reference")
        ker = cj.quantize(bits, stochastic=False, clip_rms=2.5, kernels="interpret")
        np.testing.assert_array_equal(np.asarray(ref.encode(x, None)), np.asarray(ker.encode(x, None)))
    assert describe(cj.quantize(4)) == "Quantize(block_size=256, num_bits=4, stochastic_rounding=True)"
    assert "clip_rms=2.5" in describe(cj.quantize(4, clip_rms=2.5))


# Property tests over shapes, sizes and dtypes for every codec.
@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(sorted(BLOCK_CODECS)),
    shape=st.lists(st.integers(1, 40), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
# Half a step plus fp32 rounding: 3.6e-6 of the step over half of it (CI, seed 747).
@example(name="q8_nearest", shape=(8, 8, 19), dtype="float32", scale=670.8125, seed=747)
def test_property_roundtrip(name, shape, dtype, scale, seed):
    comp = BLOCK_CODECS[name]
    x = (jax.random.normal(jax.random.PRNGKey(seed), shape) * scale).astype(dtype)
    y = comp.roundtrip(x, jax.random.PRNGKey(seed + 1))
    assert y.shape == x.shape and y.dtype == x.dtype
    xf = np.asarray(x, np.float32).ravel()
    yf = np.asarray(y, np.float32).ravel()
    assert np.all(np.isfinite(yf))
    if xf.size == 0:
        return
    amax = np.abs(xf).max()
    # No codec produces values beyond the block's absolute maximum (plus the 16-bit
    # rounding of the output dtype).
    slack = 1.01 if (dtype != "float32" or name.startswith("cast")) else 1.0 + 1e-6
    if name.startswith("qsgd"):
        bound = np.linalg.norm(xf) * slack  # QSGD's scale is the block norm
    else:
        bound = amax * slack
    assert np.abs(yf).max() <= bound + 1e-30
    if name == "identity":
        np.testing.assert_array_equal(yf, xf)
    if name.endswith("nearest"):
        bits = BLOCK_CODECS[name].num_bits
        # Half a step, plus the fp32 roundings of q = x (L / s) and of l (s / L), each at
        # most a few ulps of amax: 2**-20 amax bounds them.
        fp32 = amax * 2.0 ** -20
        assert np.abs(yf - xf).max() <= amax / (2 ** (bits - 1) - 1) * 0.5 + fp32 + amax * 1e-2 * (dtype != "float32") + 1e-30


@pytest.mark.parametrize("codec", [cj.quantize(8), cj.quantize(4, block_size=64), cj.quantize(2),
                                   cj.sign(), cj.sign(block_size=33), cj.fp8(), cj.qsgd(),
                                   cj.terngrad()], ids=repr)
def test_scale_words_strided_read_equals_the_row_view(codec):
    """The TPU's strided read of the scale words picks the same words as the row view,
    with leading (replica) axes too, and a non-finite scale anywhere is seen by both."""
    nb = 13
    x = _x(nb * codec.block, seed=3)
    words = jnp.stack([codec.encode(x, jax.random.PRNGKey(r), start=0) for r in range(3)])
    np.testing.assert_array_equal(codec.scale_words(words, strided=True), codec.scale_words(words))
    rows = np.asarray(words).reshape(3, nb, codec.row_words)
    np.testing.assert_array_equal(np.asarray(codec.scale_words(words)), rows[..., -1])
    assert bool(codec.scales_finite(words))
    for b in (0, 7, nb - 1):
        bad = rows.copy()
        bad[1, b, -1] = np.float32(np.inf if b % 2 else np.nan).view(np.uint32)
        w = jnp.asarray(bad.reshape(3, -1))
        for strided in (True, False):
            s = jax.lax.bitcast_convert_type(codec.scale_words(w, strided=strided), jnp.float32)
            assert not bool(jnp.all(jnp.isfinite(s)))
        assert not bool(codec.scales_finite(w))
