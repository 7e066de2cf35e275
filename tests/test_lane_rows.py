"""The TPU forms of the block codecs' references (blocks computed as [n/128, 128] lane
rows, chosen by lax.platform_dependent on TPU) against the block-row forms every other
backend runs: the same wire words and outputs, bit for bit, here called directly on CPU.
The one exception is fp8's code words of a block whose scale is NaN (such a block decodes
to NaN whatever its codes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from commjax import packing
from commjax.kernels import fp8 as F
from commjax.kernels import reference as R

#: Row magnitudes across the float range: normal, tiny, zero, near overflow, subnormal,
#: and a row with an infinity (its scale is NaN).
MAGS = jnp.array([1.0, 1e-30, 0.0, 3e37, 1e-40, 5.0])


def _inputs(block: int, seed: int = 0, inf: bool = True):
    x = jax.random.normal(jax.random.PRNGKey(seed), (6, block)) * MAGS[:, None]
    if inf:
        x = x.at[5, 7].set(jnp.inf)
    e = jax.random.normal(jax.random.PRNGKey(seed + 1), (6, block)) * 0.01
    u = jax.random.uniform(jax.random.PRNGKey(seed + 2), (6, block))
    return x, e, u


def _same(a, b, bits: bool = False):
    """Equal values (``bits``: equal bit patterns) output by output."""
    view = (lambda v: np.asarray(v).view(np.uint32)) if bits else np.asarray
    for p, q in zip(a, b):
        assert (p is None) == (q is None)
        if p is not None:
            np.testing.assert_array_equal(view(p), view(q))


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("block", [128, 256, 512, 2048])
def test_lane_row_packing_is_pack_codes(bits, block):
    codes = jax.random.randint(jax.random.PRNGKey(bits), (5, block), 0, 1 << bits).astype(jnp.uint32)
    words = packing.pack_lane_rows(codes.reshape(-1, 128), bits, block)
    np.testing.assert_array_equal(np.asarray(words), np.asarray(packing.pack_codes(codes, bits)))
    back = packing.unpack_lane_rows(words, bits, block)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(codes).reshape(-1, 128))


@pytest.mark.parametrize("bits,levels,midrise", [(8, 127, False), (4, 7, False), (2, 1, False),
                                                 (4, 15, True), (2, 3, True)])
@pytest.mark.parametrize("block", [128, 256, 1024])
@pytest.mark.parametrize("output", [None, "decoded", "residual"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_lane_rows(bits, levels, midrise, block, output, stochastic):
    x, e, u = _inputs(block, bits)
    u = u if stochastic else None
    kw = dict(bits=bits, levels=levels, output=output, midrise=midrise)
    _same(R.quantize_block_rows(x, u, e, **kw), R.quantize_lane_rows(x, u, e, **kw))


@pytest.mark.parametrize("bits,offset,step,divisor", [(8, 127, 1, 127), (4, 7, 1, 7), (2, 1, 1, None),
                                                     (1, 1, 2, None), (4, 15, 2, 15)])
@pytest.mark.parametrize("block", [128, 256, 1024])
def test_decode_lane_rows(bits, offset, step, divisor, block):
    rows = jax.random.bits(jax.random.PRNGKey(block), (6, block * bits // 32 + 1), jnp.uint32)
    scales = jnp.array([1.0, 3e38, 1e-39, jnp.nan, 0.5, 0.0], jnp.float32)
    rows = rows.at[:, -1].set(jax.lax.bitcast_convert_type(scales, jnp.uint32))
    kw = dict(bits=bits, block_size=block, offset=offset, step=step, divisor=divisor)
    _same([R.decode_block_rows(rows, **kw)], [R.decode_lane_rows(rows, **kw)])


@pytest.mark.parametrize("block", [128, 256, 1024])
@pytest.mark.parametrize("output", [None, "decoded", "residual"])
def test_sign_lane_rows(block, output):
    x, e, _ = _inputs(block, 3, inf=False)
    _same(R.sign_block_rows(x, e, output=output), R.sign_lane_rows(x, e, output=output))


@pytest.mark.parametrize("block", [128, 256])
def test_sign_scales_summed_by_lane_rows_match_to_rounding(block):
    x, e, _ = _inputs(block, 4, inf=False)
    x = x.at[3].set(3e38)  # a block whose sum overflows: the conditional divides first
    y = (x + e).reshape(-1)
    by_block = R._block_mean_abs(y, (6, block))
    by_lanes = R._block_mean_abs(y, (-1, 128), (6, block))
    np.testing.assert_allclose(np.asarray(by_lanes), np.asarray(by_block), rtol=2e-6)
    assert np.all(np.isfinite(np.asarray(by_lanes)))


@pytest.mark.parametrize("block", [128, 256])
def test_fused_sign_scales_divide_only_the_blocks_that_overflow(block):
    """The TPU's scales (``fused``: both sums, no conditional) are the conditional's
    bits on every block whose sum is finite, the mean to rounding where it overflowed,
    and inf and NaN where the block holds them."""
    x, e, _ = _inputs(block, 4, inf=False)
    x = x.at[3].set(3e38).at[4, 5].set(jnp.inf).at[5, 7].set(jnp.nan)
    y = (x + e).reshape(-1)
    plain = np.asarray(R._block_mean_abs(y[: 3 * block], (-1, 128), (3, block)))
    fused = np.asarray(R._block_mean_abs(y, (-1, 128), (6, block), fused=True))
    np.testing.assert_array_equal(fused[:3], plain)
    want = np.abs(np.asarray(y, np.float64).reshape(6, block)).mean(axis=1)
    assert np.isfinite(fused[3, 0]) and abs(fused[3, 0] / want[3] - 1) < 2e-6
    assert np.isposinf(fused[4, 0]) and np.isnan(fused[5, 0])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [128, 512])
@pytest.mark.parametrize("output", [None, "decoded", "residual"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_fp8_lane_rows(fmt, block, output, stochastic):
    x, e, u = _inputs(block, 5)
    u = u if stochastic else None
    a = F.fp8_block_rows(x, u, e, fmt=fmt, output=output)
    b = F.fp8_lane_rows(x, u, e, fmt=fmt, output=output)
    finite = np.isfinite(np.asarray(jax.lax.bitcast_convert_type(a[0][:, -1], jnp.float32)))
    np.testing.assert_array_equal(np.asarray(a[0])[finite], np.asarray(b[0])[finite])
    np.testing.assert_array_equal(np.asarray(a[0])[:, -1], np.asarray(b[0])[:, -1])
    _same(a[1:], b[1:])
    f = F.FP8_FORMATS[fmt]
    _same([F._decode(a[0], f)], [F._decode_lanes(a[0], f)])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block", [128, 256, 1024])
def test_cast_lane_rows(dtype, block):
    """cast's TPU packing of 16-bit values (lane rows) against the block rows: the same
    words, and each decodes the other's words to the same values (saturated, infinite
    and NaN values included)."""
    from commjax.compressors import cast16

    codec = cast16.Cast(dtype_name=jnp.dtype(dtype).name, block_size=block)
    x, _, _ = _inputs(block)
    x = x.at[1, 3].set(jnp.nan).at[2, 5].set(-1e38).at[0, 1].set(7e4)
    half = jax.lax.bitcast_convert_type(codec._round(x), jnp.uint16)
    words = cast16.pack_halves_lane_rows(half)
    np.testing.assert_array_equal(np.asarray(words), np.asarray(packing.pack_codes(half, 16)))
    back = cast16.unpack_halves_lane_rows(words)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(packing.unpack_codes(words, 16, block)))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(half).astype(np.uint32))


# --------------------------------------------------------------------------- lane-row kernels
# The Pallas kernels that read and write lane rows (one pass over x and e on TPU), in
# interpret mode against the references, bit for bit.


def _kernel_inputs(nb: int, block: int, seed: int):
    """``nb`` blocks across the float range (MAGS), with a NaN and an Inf block, and a
    residual; ``nb`` not a multiple of the tile, so the last tile is ragged."""
    mags = jnp.resize(MAGS, (nb,))
    x = jax.random.normal(jax.random.PRNGKey(seed), (nb, block)) * mags[:, None]
    x = x.at[1, 3].set(jnp.nan).at[5, 7].set(jnp.inf)
    e = jax.random.normal(jax.random.PRNGKey(seed + 1), (nb, block)) * 0.01
    u = jax.random.uniform(jax.random.PRNGKey(seed + 2), (nb, block))
    return x, e, u


@pytest.mark.parametrize("bits,block", [(8, 128), (8, 256), (4, 256), (16, 256), (4, 2048)])
def test_quantize_lane_kernel_is_the_reference(bits, block):
    """Every noise source (none, an array, a key drawn in-kernel at an offset), every
    output, with and without a residual: the same rows and outputs as the reference."""
    from commjax.kernels import _tiling
    from commjax.kernels import quantize as Q
    assert _tiling.lane_rowable(block, bits)
    x, e, u = _kernel_inputs(37, block, bits)
    key = jax.random.key(block)
    for noise in ({}, {"uniforms": u}, {"noise_key": key, "noise_start": 2 ** 32 - 300}):
        for output, res, mr in ((None, None, False), ("decoded", None, False), ("residual", e, False),
                                ("residual", e, True)):
            kw = dict(bits=bits, output=output, residual=res, midrise=mr, **noise)
            got = jax.jit(lambda x: Q.quantize_blocks(x, impl="interpret", **kw))(x)
            want = jax.jit(lambda x: Q.quantize_blocks(x, impl="reference", **kw))(x)
            _same(got, want, bits=True)


@pytest.mark.parametrize("bits,offset,step,divisor", [(8, 127, 1, 127), (4, 7, 1, 7), (16, 5, 1, 3),
                                                     (2, 1, 1, None), (1, 1, 2, None)])
@pytest.mark.parametrize("block", [128, 256, 4096])
def test_decode_lane_kernels_are_the_reference(bits, offset, step, divisor, block):
    """``decode_rows`` and ``decode_sum`` (three payloads, summed in order from zeros) as
    lane-row kernels: the reference's values, scales across the range, NaN included."""
    from commjax.kernels import decode as D
    nb = 21
    rows = jax.random.bits(jax.random.PRNGKey(block + bits), (3, nb, packing.packed_words(block, bits) + 1),
                           jnp.uint32)
    scales = jnp.resize(jnp.array([1.0, 3e38, 1e-39, jnp.nan, 0.5, 0.0, 2e-30], jnp.float32), (3, nb))
    rows = rows.at[..., -1].set(jax.lax.bitcast_convert_type(scales, jnp.uint32))
    kw = dict(bits=bits, block_size=block, offset=offset, step=step, divisor=divisor)
    both = jax.jit(lambda r, impl: (D.decode_sum(r, impl=impl, **kw), D.decode_rows(r[1], impl=impl, **kw)),
                   static_argnums=1)
    _same(both(rows, "interpret"), both(rows, "reference"), bits=True)


@pytest.mark.parametrize("fmt,block", [("e4m3", 256), ("e5m2", 512), ("e4m3", 128)])
def test_fp8_lane_kernel_is_the_reference(fmt, block):
    """The FP8 encode as a lane-row kernel: every noise source, every output, blocks across
    the float range: the reference's rows and outputs, bit for bit."""
    x, e, u = _kernel_inputs(37, block, 11)
    for noise in ({}, {"uniforms": u}, {"noise_key": jax.random.key(block), "noise_start": 5}):
        for output, res in ((None, None), ("decoded", None), ("residual", e)):
            kw = dict(fmt=fmt, output=output, residual=res, **noise)
            _same(F.fp8_blocks(x, impl="interpret", **kw), F.fp8_blocks(x, impl="reference", **kw), bits=True)
