"""Pallas kernels against their pure-jnp references, bit for bit (interpret mode on CPU).

Inputs come from a fresh seed per test session (printed in every failure message), so
each CI run checks new random inputs. Also: the implementation is an argument (codec
field or ``impl=``) and nothing global; ``auto`` never runs an unverified kernel; the
codecs route through the kernels without changing a bit; training runs are bit-identical
with ``interpret`` and ``reference`` for every block codec; the kernels lower for TPU
(Mosaic) and CUDA (Mosaic GPU) from this CPU machine; and the Mosaic GPU word-row
algorithm (run with jnp) matches the references.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat, kernels, packing, testing
from commjax.kernels import reference as kref

SEED = secrets.randbits(31)
IMPLS = ("reference", "interpret")


def _key(*salt: int) -> jax.Array:
    k = jax.random.PRNGKey(SEED)
    for s in salt:
        k = jax.random.fold_in(k, s)
    return k


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype.itemsize == 4 else a


def assert_bits_equal(a, b, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    diff = _bits(a) != _bits(b)
    assert not diff.any(), (
        f"{what}: {int(diff.sum())} of {diff.size} values differ (seed {SEED}); "
        f"first at {np.argwhere(diff)[0].tolist()}"
    )


def run_impls(fn, *args, impls=IMPLS):
    """``jit(fn(impl, ...))(*args)`` for each implementation: ``{impl: outputs}``."""
    return {impl: jax.block_until_ready(jax.jit(functools.partial(fn, impl))(*args)) for impl in impls}


def with_kernels(codec, impl):
    return dataclasses.replace(codec, kernels=impl)


def _rng(salt: int) -> np.random.Generator:
    return np.random.default_rng([SEED, salt])


def _blocks(n: int, block: int, salt: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A flat vector of ``n`` elements padded with zeros to whole blocks, as ``[nb, B]``,
    with per-block magnitudes over six decades, plus uniforms and a residual."""
    rng = _rng(salt)
    nb = -(-n // block)
    x = rng.standard_normal(n, np.float32) * np.repeat(10.0 ** rng.uniform(-3, 3, nb), block)[:n].astype(np.float32)
    x = np.pad(x, (0, nb * block - n)).reshape(nb, block)
    u = rng.random((nb, block), np.float32)
    e = (0.1 * rng.standard_normal((nb, block), np.float32)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(u), jnp.asarray(e)


# --------------------------------------------------------------------------- dispatch


def test_impl_comes_from_the_argument_else_the_environment(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.resolve_impl(None, "f") == "auto"
    monkeypatch.setenv(kernels.ENV_VAR, " Interpret ")
    assert kernels.resolve_impl(None, "f") == "interpret"
    assert kernels.resolve_impl("reference", "f") == "reference"  # the argument wins
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="f: environment variable COMMJAX_KERNELS='fast'.*'auto', "
                                         "'pallas', 'interpret', 'reference'.*or unset it"):
        kernels.resolve_impl(None, "f")
    with pytest.raises(ValueError, match="quantize_blocks: `impl` must be None .*got 'gpu'"):
        kernels.quantize_blocks(jnp.zeros((2, 64)), bits=4, impl="gpu")
    for factory in (cj.quantize, cj.qsgd, cj.terngrad, cj.sign):
        with pytest.raises(ValueError, match=f"{factory.__name__}: `kernels` must be None"):
            factory(kernels="fast")


def test_auto_runs_kernels_only_on_verified_backends():
    """The Mosaic GPU (and TPU) kernels have not run on their hardware: ``auto`` is the
    reference there, and becomes the kernel once a backend is listed as verified."""
    assert kernels.VERIFIED_BACKENDS == frozenset()
    for backend in ("cpu", "gpu", "tpu", "rocm"):
        assert kernels.auto_impl(backend) == "reference", backend
    assert kernels.auto_impl("gpu", verified=frozenset({"gpu"})) == "pallas"
    assert kernels.auto_impl("cpu", verified=frozenset({"gpu"})) == "reference"


def test_cuda_lowering_has_no_kernel():
    """There is no GPU kernel: on CUDA both ``auto`` and ``pallas`` lower the reference
    (XLA's fusion of it moved less memory than the Mosaic GPU kernels: benchmarks/aot.py)."""
    x = jnp.zeros((64, 256))
    for impl in ("auto", "pallas"):
        f = jax.jit(lambda x: kernels.quantize_blocks(x, bits=4, residual=x, output="residual", impl=impl))
        with _compat.TRACE_PLATFORM("cuda"):
            text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" not in text and "tpu_custom_call" not in text, impl


def test_codec_field_is_part_of_the_trace_and_nothing_is_global():
    """Two codecs that differ only in ``kernels`` trace separately in one process, with
    no cache clearing: one program has the kernel, the other does not."""
    x, u, _ = _blocks(512, 256, 1)
    f = jax.jit(lambda codec, x: codec.encode_blocks(x, None), static_argnums=0)
    seen = {}
    for impl in ("interpret", "reference", "interpret"):
        codec = cj.quantize(bits=4, stochastic=False, kernels=impl)
        seen[impl] = "pallas_call" in str(f.trace(codec, x).jaxpr)
        assert codec == cj.quantize(bits=4, stochastic=False, kernels=impl)
    assert seen == {"interpret": True, "reference": False}
    assert hash(cj.quantize(kernels="interpret")) != hash(cj.quantize(kernels="reference"))


def test_interpret_mode_really_runs_a_pallas_kernel():
    x, u, _ = _blocks(512, 256, 1)
    for impl, expect in (("interpret", True), ("reference", False)):
        text = str(jax.make_jaxpr(
            lambda x, u: kernels.quantize_blocks(x, bits=4, uniforms=u, output=None, impl=impl)[0])(x, u))
        assert ("pallas_call" in text) == expect, impl


def test_bad_arguments():
    x = jnp.zeros((2, 64))
    with pytest.raises(ValueError, match="`bits` must be in \\[2, 16\\]"):
        kernels.quantize_blocks(x, bits=1)
    with pytest.raises(ValueError, match="`levels` must be in \\[1, 7\\]"):
        kernels.quantize_blocks(x, bits=4, levels=8)
    with pytest.raises(ValueError, match="midrise=True `levels` is 2\\*\\*bits - 1 = 15"):
        kernels.quantize_blocks(x, bits=4, levels=7, midrise=True)
    with pytest.raises(ValueError, match="`output` must be one of"):
        kernels.quantize_blocks(x, bits=4, output="codes")
    with pytest.raises(ValueError, match="`uniforms` must have x's shape"):
        kernels.quantize_blocks(x, bits=4, uniforms=jnp.zeros((2, 32)))
    with pytest.raises(ValueError, match="`x` must be \\[num_blocks, block_size\\]"):
        kernels.sign_blocks(jnp.zeros(64))
    with pytest.raises(ValueError, match="expected rows of 9 words"):
        kernels.decode_rows(jnp.zeros((2, 8), jnp.uint32), bits=4, block_size=64, offset=7)


# --------------------------------------------------------------------------- kernels


CASES = [  # (n elements, block, tile rows; None = the interpret default)
    (1, 256, None), (127, 32, None), (4097, 32, 8), (2 ** 20 + 3, 256, None),
]


@pytest.mark.exact_codegen
@pytest.mark.parametrize("n,block,tile", CASES)
def test_encode_kernels_bit_identical(n, block, tile):
    """Fused quantize (8/4/2 bits, stochastic or nearest, with or without error feedback,
    every output) and sign kernels against their references, in one program per mode."""
    x, u, e = _blocks(n, block, salt=n)
    qconfigs = [  # (bits, stochastic, error feedback, output, midrise)
        (8, True, True, "residual", False), (8, False, False, None, False), (4, True, False, "decoded", False),
        (4, False, True, "residual", False), (2, True, True, None, False), (2, False, False, "decoded", False),
        (8, False, True, "decoded", True), (4, True, True, "residual", True), (2, True, False, "decoded", True),
    ]
    sconfigs = [(True, "residual"), (False, None), (False, "decoded")]
    if n > 100_000:
        qconfigs, sconfigs = [(4, True, True, "residual", False), (2, False, False, "decoded", False),
                              (4, False, False, "decoded", True)], sconfigs[:1]

    def f(impl, x, u, e):
        q = [kernels.quantize_blocks(x, bits=b, uniforms=u if st else None, residual=e if ef else None,
                                     output=out, tile=tile, impl=impl, midrise=mr) for b, st, ef, out, mr in qconfigs]
        s = [kernels.sign_blocks(x, residual=e if ef else None, output=out, tile=tile, impl=impl)
             for ef, out in sconfigs]
        return q, s

    res = run_impls(f, x, u, e)
    checks = [(f"quantize bits={b} stochastic={st} ef={ef} midrise={mr}", out) for b, st, ef, out, mr in qconfigs]
    checks += [(f"sign ef={ef}", out) for ef, out in sconfigs]
    got = res["interpret"][0] + res["interpret"][1]
    ref = res["reference"][0] + res["reference"][1]
    for (what, out), g, r in zip(checks, got, ref):
        what = f"{what} n={n} B={block} out={out}"
        assert_bits_equal(g[0], r[0], what + " rows")
        if out:
            assert_bits_equal(g[1], r[1], what + " " + out)


@pytest.mark.parametrize("block", [256, 96])
def test_sign_scales_are_the_mean_and_never_overflow(block):
    """``row_scales``: each row's ``mean |x + e|`` (to fp32 round-off), also where the
    row's sum overflows fp32 while its mean does not; Inf and NaN rows stay so. (Every
    kernel mode takes its scales from this function: test_encode_kernels_bit_identical.)"""
    rng = np.random.default_rng(block)
    x = rng.standard_normal((6, block)).astype(np.float32)
    e = rng.standard_normal((6, block)).astype(np.float32)
    x[1] = 3e37  # the sum (block * 3e37) overflows, the mean does not
    e[1] = 0.0
    x[2, 5] = np.inf
    x[3, 7] = np.nan
    x[4] = 0.0
    e[4] = 0.0
    got = np.asarray(jax.jit(kref.row_scales)(jnp.asarray(x), jnp.asarray(e)))[:, 0]
    want = np.abs(x.astype(np.float64) + e).mean(axis=1)
    assert np.isfinite(got[1]) and abs(got[1] / 3e37 - 1) < 1e-5
    assert np.isposinf(got[2]) and np.isnan(got[3]) and got[4] == 0.0
    np.testing.assert_allclose(got[[0, 5]], want[[0, 5]], rtol=1e-6)


def test_quantize_reference_is_the_codec_and_the_format():
    """The kernel's oracle is the codec's own arithmetic, and its rows follow the wire
    format: unpacking them gives l + L with |l| <= L, the scale word is max |x|, and the
    codec decodes them to the reference's decoded values, bit for bit."""
    x, u, _ = _blocks(40 * 64, 64, 7)
    comp = cj.quantize(bits=4, block_size=64, kernels="reference")
    rows, dec = jax.jit(lambda x, u: kref.quantize_reference(x, u, None, bits=4, levels=7, output="decoded"))(x, u)
    assert_bits_equal(jax.jit(comp.decode_blocks)(rows), dec, "codec decode of the reference rows")
    codes = np.asarray(packing.unpack_codes(rows[:, :-1], 4, 64)).astype(np.int64)
    assert codes.max() <= 14 and codes.min() >= 0
    np.testing.assert_array_equal(np.asarray(rows[:, -1]).view(np.float32), np.abs(np.asarray(x)).max(1))
    # Stochastic rounding stays within one step of x.
    step = np.abs(np.asarray(x)).max(1, keepdims=True) / 7
    assert np.all(np.abs(np.asarray(dec) - np.asarray(x)) <= step * (1 + 1e-5))


# The codecs' decode constants: (bits, offset, step, divisor).
DECODERS = {
    "quantize8": (8, 127, 1, 127), "quantize4": (4, 7, 1, 7), "quantize2": (2, 1, 1, 1),
    "quantize4_midrise": (4, 15, 2, 15), "quantize2_midrise": (2, 3, 2, 3),
    "qsgd16": (6, 16, 1, 16), "terngrad": (2, 1, 1, None), "sign": (1, 1, 2, None),
}


def _random_rows(replicas: int, nb: int, block: int, bits: int, salt: int) -> jax.Array:
    """Wire rows with random words and positive scales over eight decades."""
    rng = _rng(salt)
    w = packing.words_per_plane(block)
    words = rng.integers(0, 2 ** 32, (replicas, nb, bits * w), dtype=np.uint32)
    scale = (np.abs(rng.standard_normal((replicas, nb, 1))) * 10.0 ** rng.uniform(-4, 4, (replicas, nb, 1)))
    return jnp.asarray(np.concatenate([words, scale.astype(np.float32).view(np.uint32)], axis=2))


@pytest.mark.exact_codegen
@pytest.mark.parametrize("nb,block,tile", [(1, 256, None), (127, 32, None), (129, 32, 8), (4097, 256, None)])
def test_decode_kernels_bit_identical(nb, block, tile):
    names = sorted(DECODERS) if nb < 1000 else ["quantize4", "sign"]
    rows = {c: _random_rows(3, nb, block, DECODERS[c][0], salt=nb + i) for i, c in enumerate(names)}

    def f(impl, rows):
        out = {}
        for c in names:
            bits, offset, step, divisor = DECODERS[c]
            opts = dict(bits=bits, block_size=block, offset=offset, step=step, divisor=divisor, tile=tile,
                        impl=impl)
            out[c] = (kernels.decode_rows(rows[c][1], **opts), kernels.decode_sum(rows[c], **opts))
        return out

    res = run_impls(f, rows)
    for c in names:
        what = f"decode {c} nb={nb} B={block}"
        assert_bits_equal(res["interpret"][c][0], res["reference"][c][0], what + " rows")
        assert_bits_equal(res["interpret"][c][1], res["reference"][c][1], what + " sum")


def test_decode_sum_semantics_against_numpy():
    """Independent oracle (numpy, no fused multiply-add): the sum over replicas, in order,
    from zeros, of each decoded value rounded to fp32; the step ``s / L`` as XLA computes
    it (to within one ulp of ``s / L``)."""
    bits, offset, step, divisor = DECODERS["quantize4"]
    rows = _random_rows(4, 33, 64, bits, salt=11)
    q = np.asarray(jax.jit(lambda r: kref.row_steps(r, divisor))(rows))
    exact_q = np.asarray(rows[..., -1:]).view(np.float32) / np.float32(divisor)
    assert np.all(np.abs(q - exact_q) <= np.spacing(exact_q))
    lv = np.asarray(packing.unpack_codes(rows[..., :-1], bits, 64)).astype(np.int32) - offset
    expect = np.zeros((33, 64), np.float32)
    for r in range(4):
        expect = expect + (lv[r].astype(np.float32) * q[r]).astype(np.float32)
    res = run_impls(lambda impl, r: kernels.decode_sum(r, bits=bits, block_size=64, offset=offset,
                                                       divisor=divisor, impl=impl), rows)
    for impl, got in res.items():
        assert_bits_equal(got, expect, f"decode_sum {impl} vs numpy")


@pytest.mark.exact_codegen
def test_pack_kernels_bit_identical():
    cases = [(1, (127, 64)), (2, (1, 32)), (3, (3, 5, 256)), (8, (127, 64)), (16, (1, 32))]
    codes = [jnp.asarray(_rng(b + shape[0]).integers(0, 2 ** b, shape, dtype=np.uint32)) for b, shape in cases]

    def f(impl, codes):
        return [(kernels.pack_codes(c, b, impl=impl),
                 kernels.unpack_codes(kernels.pack_codes(c, b, impl=impl), b, shape[-1], impl=impl))
                for (b, shape), c in zip(cases, codes)]

    res = run_impls(f, codes)
    for (b, shape), c, got, ref in zip(cases, codes, res["interpret"], res["reference"]):
        assert_bits_equal(got[0], ref[0], f"pack bits={b} {shape}")
        assert_bits_equal(got[1], c, f"unpack(pack) bits={b} {shape}")


def test_unaligned_blocks_use_the_reference():
    """Blocks that are not whole words (B % 32 != 0) have no kernel: same results, no
    pallas_call in the program."""
    x, u, _ = _blocks(5 * 100, 100, 9)

    def f(impl, x, u):
        return kernels.quantize_blocks(x, bits=8, uniforms=u, output="decoded", impl=impl)

    assert "pallas_call" not in str(jax.make_jaxpr(functools.partial(f, "interpret"))(x, u))
    res = run_impls(f, x, u)
    assert_bits_equal(res["interpret"][0], res["reference"][0], "unaligned rows")


# --------------------------------------------------------------------------- codecs


CODECS = {
    "quantize8": lambda: cj.quantize(bits=8, block_size=64),
    "quantize4_nearest": lambda: cj.quantize(bits=4, block_size=64, stochastic=False),
    "quantize2": lambda: cj.quantize(bits=2, block_size=64),
    "qsgd": lambda: cj.qsgd(levels=16, block_size=64),
    "terngrad": lambda: cj.terngrad(block_size=64),
    "sign": lambda: cj.sign(block_size=64),
}


@pytest.mark.exact_codegen
def test_codecs_identical_in_every_mode():
    """Every codec's payload, encode_and_decode, decode and decode_sum, routed through the
    kernels, are the same bits in interpret and reference modes; decode_sum is the sum of
    the decodes (each rounded, in order)."""
    names = ("quantize4_nearest", "terngrad", "qsgd", "sign")
    n = 37 * 64
    x = jnp.asarray(3 * _rng(21).standard_normal(n, np.float32))
    comps = {name: CODECS[name]() for name in names}
    payloads = jax.jit(lambda x, k: {name: jnp.stack([c.encode(x * (r + 1), jax.random.fold_in(k, r))
                                                      for r in range(3)]) for name, c in comps.items()})(x, _key(22))
    decoded = jax.jit(lambda p: {name: jnp.stack([c.decode(p[name][r], n) for r in range(3)])
                                 for name, c in comps.items()})(payloads)

    def f(impl, x, key, payloads):
        out = {}
        for name in names:
            comp = with_kernels(comps[name], impl)
            words, local = comp.encode_and_decode(x, key)
            out[name] = (words, local, comp.decode(words, n), comp.decode_sum(payloads[name], n))
        return out

    res = run_impls(f, x, _key(23), payloads)
    for name in names:
        for i, part in enumerate(("payload", "local", "decode", "decode_sum")):
            assert_bits_equal(res["interpret"][name][i], res["reference"][name][i], f"{name} {part}")
        loop = np.zeros((n,), np.float32)
        for r in range(3):
            loop = loop + np.asarray(decoded[name][r])
        assert_bits_equal(res["reference"][name][3], loop, f"{name} decode_sum vs decode loop")


def test_encode_feedback_is_encode_decode_subtract():
    """The fused error-feedback path (quantize 8/4/2, unclipped TernGrad, sign) gives the
    same bits in both modes, and the same bits as its definition: the payload of
    ``y = g + e`` and the residual ``y - decode(payload)``, with the decode a separate
    program (nothing fused across it)."""
    names = ("quantize8", "quantize4_nearest", "quantize2", "terngrad", "sign")
    comps = {name: CODECS[name]() for name in names}
    n = 20 * 64
    g = jnp.asarray(_rng(31).standard_normal(n, np.float32))
    e = jnp.asarray((0.3 * _rng(32).standard_normal(n)).astype(np.float32))
    res = run_impls(lambda impl, g, e, k: {name: with_kernels(c, impl).encode_feedback(g, e, k)
                                           for name, c in comps.items()}, g, e, _key(33))
    y = jax.jit(lambda g, e: g + e)(g, e)
    words = jax.jit(lambda y, k: {name: c.encode(y, k) for name, c in comps.items()})(y, _key(33))
    dec = jax.jit(lambda w: {name: c.decode(w[name], n) for name, c in comps.items()})(words)
    for name in names:
        assert_bits_equal(res["interpret"][name][0], res["reference"][name][0], f"{name} fused payload")
        assert_bits_equal(res["interpret"][name][1], res["reference"][name][1], f"{name} fused residual")
        assert_bits_equal(res["reference"][name][0], words[name], f"{name} fused payload vs encode(g + e)")
        assert_bits_equal(res["reference"][name][1], np.asarray(y) - np.asarray(dec[name]),
                          f"{name} fused residual vs y - decode(encode(y))")


# Every block codec, each on its own layer of one MLP (a leaf of 8 or 16 blocks): on a
# leaf of 8 blocks, the 8-bit run once differed between the modes (see the report in
# test_training_bit_identical_across_modes).
TRAIN_CODECS = (("quantize8", cj.quantize(bits=8)), ("quantize4", cj.quantize(bits=4)),
                ("quantize2", cj.quantize(bits=2)), ("terngrad", cj.terngrad()),
                ("qsgd", cj.qsgd()), ("sign", cj.sign()))


def _codec_per_layer(impl):
    """``(transform, label of each leaf)``: layer ``i`` (weights and bias) is averaged
    with the ``i``-th codec (the last layer with the first), all with ``impl``."""
    def label(params):
        return {k: TRAIN_CODECS[int(k[1:]) % len(TRAIN_CODECS)][0] for k in params}

    tx = optax.multi_transform(
        {name: cj.compressed_mean(with_kernels(codec, impl), "data") for name, codec in TRAIN_CODECS}, label)
    return optax.chain(tx, optax.sgd(0.1)), label


@pytest.mark.exact_codegen
@pytest.mark.parametrize("check_vma", [False, True])
def test_training_bit_identical_across_modes(check_vma):
    """A short data-parallel run (8 replicas, the default reducer: fused encode with error
    feedback, decode + sum of what each replica receives) gives the same parameters,
    losses and optimizer state, bit for bit, with kernels and without, for every block
    codec.

    What this guards: XLA's CPU backend (LLVM) contracts ``p + (-lr) * m`` into a fused
    multiply-add or not depending on everything fused into the same loop. When the
    kernel path and the reference path put different code into that loop (an inlined
    interpret-mode unpack of 8 bit planes, against the reference's unpack, a separate
    reduction), a loop-invariant ``where(nan_flag, nan, m)`` between the product and the
    add was hoisted out of one loop and not the other, and the 8-bit run changed bits
    after one step.
    """
    sizes = (32,) + (64,) * len(TRAIN_CODECS) + (10,)
    task = testing.noniid_classification(8, examples_per_replica=16, dim=32, seed=SEED % 1000)
    task = dataclasses.replace(task, params=testing.mlp_params(jax.random.PRNGKey(SEED % 997), sizes))
    runs = {}
    for impl in IMPLS:
        tx, label = _codec_per_layer(impl)
        runs[impl] = testing.train(tx, task, 3, check_vma=check_vma)
    ker, ref = runs["interpret"], runs["reference"]
    assert ker.replicas_identical and ref.replicas_identical
    codec_of = label({k: None for k in task.params})
    for what, a, b in (("params", ker.replica_params, ref.replica_params), ("state", ker.opt_state, ref.opt_state)):
        for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
            where = jax.tree_util.keystr(path)
            codecs = [c for k, c in codec_of.items() if f"'{k}'" in where] or ["(shared state)"]
            assert_bits_equal(x, y, f"check_vma={check_vma}: {what}{where} ({codecs[0]})")
    assert_bits_equal(ker.losses.astype(np.float32), ref.losses.astype(np.float32), "losses")
    assert ker.losses[-1] < task.global_loss(task.params)


def test_kernels_inside_shard_map():
    """Under shard_map(check_vma=False) the interpret-mode kernel runs on each replica's
    shard; under check_vma=True inputs that vary over the axis take the reference (the
    interpreter cannot type the kernel body's constants), invariant ones the kernel."""
    mesh = _compat.make_mesh((8,), ("data",))
    x, u, e = _blocks(8 * 4 * 64, 64, 41)

    def f(impl, x, u, e):
        rows, res = kernels.quantize_blocks(x, bits=8, uniforms=u, residual=e, output="residual", impl=impl)
        gathered = _compat.all_gather_invariant(rows, "data", tiled=True)  # invariant input
        return rows, res, kernels.decode_rows(gathered, bits=8, block_size=64, offset=127, divisor=127,
                                              impl=impl)

    for check_vma, kernels_seen in ((False, 2), (True, 1)):
        def sm(impl, *a):
            return _compat.shard_map(functools.partial(f, impl), mesh=mesh, in_specs=(P("data"),) * 3,
                                     out_specs=(P("data"), P("data"), P()), check_vma=check_vma)(*a)

        assert str(jax.make_jaxpr(functools.partial(sm, "interpret"))(x, u, e)).count("pallas_call[") == kernels_seen
        res = run_impls(sm, x, u, e)
        for i in range(3):
            assert_bits_equal(res["interpret"][i], res["reference"][i], f"output {i} check_vma={check_vma}")


# --------------------------------------------------------------------------- lowering


def _lowering_cases(block: int, nb: int):
    x = jnp.zeros((nb, block))
    r4 = jnp.zeros((3, nb, 4 * (block // 32) + 1), jnp.uint32)
    k = dict(impl="pallas")
    return {
        "quantize": (lambda x, u, e: kernels.quantize_blocks(x, bits=4, uniforms=u, residual=e, output="residual", **k),
                     (x, x, x)),
        "quantize_nearest": (lambda x: kernels.quantize_blocks(x, bits=8, output=None, **k), (x,)),
        "sign": (lambda x, e: kernels.sign_blocks(x, residual=e, output="decoded", **k), (x, x)),
        "decode": (lambda r: kernels.decode_rows(r, bits=4, block_size=block, offset=7, divisor=7, **k), (r4[0],)),
        "decode_sum": (lambda r: kernels.decode_sum(r, bits=4, block_size=block, offset=7, divisor=7, **k), (r4,)),
        "pack": (lambda c: kernels.pack_codes(c, 3, **k), (jnp.zeros((nb, block), jnp.uint32),)),
    }


@pytest.mark.parametrize("platform,marker", [("tpu", "tpu_custom_call")])
def test_kernels_lower_for_accelerators(platform, marker):
    """Cross-platform lowering from CPU: Pallas -> Mosaic TPU (the Mosaic compiler's own
    layout passes run only on a TPU host, so this checks the Pallas-level lowering and
    block shapes; compiled for a TPU target: benchmarks/aot.py)."""
    for nb in (64, 70):  # whole tiles, and a ragged tail
        for name, (f, args) in _lowering_cases(256, nb).items():
            with _compat.TRACE_PLATFORM(platform):
                text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
            assert marker in text, f"{name} (nb={nb}) did not lower to a {platform} kernel"


@pytest.mark.parametrize("platform,marker", [("tpu", "tpu_custom_call")])
def test_kernels_lower_inside_shard_map_with_vma_checks(platform, marker):
    """Compiled kernels take varying inputs under shard_map(check_vma=True): their output
    types carry the manual axis."""
    mesh = jax.sharding.AbstractMesh((8,), ("data",))
    x = jnp.zeros((8 * 64, 256))

    def f(x):
        rows, res = kernels.quantize_blocks(x, bits=4, residual=x, output="residual", impl="pallas")
        return rows, res, kernels.decode_sum(rows[None], bits=4, block_size=256, offset=7, divisor=7,
                                             impl="pallas")

    sm = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=True)
    with _compat.TRACE_PLATFORM(platform):
        text = jax.jit(sm).trace(x).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) >= 2


def test_pallas_mode_on_cpu_fails_clearly():
    with pytest.raises(Exception, match="interpret mode"):
        jax.jit(lambda x: kernels.sign_blocks(x, output=None, impl="pallas")[0])(jnp.ones((4, 64)))
