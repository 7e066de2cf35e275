"""Every codec over the whole finite float range: finite in, finite out, within the codec's
error bound, bit-identical on every replica; through every reducer of ``compressed_mean``
and through the compressed collectives.

The gradient is a dict of leaves, one magnitude pattern each (so the bounds of codecs that
act on a whole leaf, top-k and PowerSGD, hold per pattern): all zeros, a single non-zero,
uniform values and mixed magnitudes within a block, from the smallest subnormal (1e-45)
to 3e38, different on every replica. One compile per (codec, path) covers every pattern.

Bound: ``|out - mean| <= rel * max |g| + slack`` per leaf, with ``rel`` the codec's one-step
bound (table below) and ``slack = 2**-118``: values below fp32's smallest normal
(``2**-126``) are flushed to zero by XLA on CPU (and by TPUs, and GPU code compiled with
flush-to-zero), and a mean divides each replica's decoded values before it sums them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax import collectives as cc
from declared_layout import declared_mask

AX = "data"
N = 8
SLACK = 2.0 ** -118
SHAPE = (8, 128)
#: Codecs whose error bound holds per block or element: every pattern is one row of a single
#: leaf (one small program). The others select or factor over a whole leaf: one leaf each.
PER_LEAF = ("top_k", "random_k", "threshold", "powersgd")
ROW = 256

#: name -> (codec, reducers of compressed_mean, one-step bound relative to max |g|).
CODECS = {
    "identity": (cj.identity(), ("auto",), 1e-6),
    "cast_bf16": (cj.cast(jnp.bfloat16), ("auto", "allgather"), 1e-2),
    "lossless": (cj.lossless(), ("auto",), 1e-2),  # fp32 input travels as bf16
    "q8": (cj.quantize(8), ("allgather", "two_phase"), 0.03),
    "q8_nearest": (cj.quantize(8, stochastic=False), ("two_phase",), 0.02),
    "q4": (cj.quantize(4, block_size=64), ("allgather", "two_phase"), 0.6),
    "q4_nearest": (cj.quantize(4, stochastic=False), ("two_phase",), 0.3),
    "q2": (cj.quantize(2, block_size=64), ("allgather", "two_phase"), 4.0),
    "q2_clip": (cj.quantize(2, block_size=64, stochastic=False, clip_rms=1.22), ("two_phase",), 2.0),
    "q2_midrise": (cj.quantize(2, block_size=64, midrise=True), ("allgather", "two_phase"), 4.0),
    "q4_midrise_clip": (cj.quantize(4, block_size=64, stochastic=False, clip_rms=2.5, midrise=True),
                        ("two_phase",), 0.6),
    "qsgd": (cj.qsgd(), ("allgather", "two_phase"), 1.5),
    "terngrad": (cj.terngrad(), ("allgather", "two_phase"), 4.0),
    "terngrad_clip": (cj.terngrad(clip_sigma=2.5), ("allgather",), 2.0),
    "sign": (cj.sign(block_size=64), ("allgather", "two_phase"), 4.0),
    "fp8_e4m3": (cj.fp8(), ("allgather", "two_phase"), 0.25),
    "fp8_e5m2": (cj.fp8("e5m2"), ("allgather", "two_phase"), 0.5),
    "fp8_stochastic": (cj.fp8(stochastic=True), ("two_phase",), 0.5),
    "hadamard_q8": (cj.hadamard(cj.quantize(8, stochastic=False)), ("two_phase",), 0.25),
    "top_k": (cj.top_k(0.1), ("allgather", "two_phase"), 2.5),
    "random_k": (cj.random_k(0.1), ("auto",), 1.0 / 0.1 + 1),
    "threshold": (cj.threshold(0.5, 4096), ("allgather",), 1.0),
    "powersgd": (cj.powersgd(2), ("auto",), 8.0),
}
#: Largest magnitude a codec carries (docs/numerics.md); above it a leaf is flagged: NaN on
#: every replica, its state kept. PowerSGD's products P = M Q and P Q^T overflow first.
LIMITS = {"powersgd": 1e36}
#: Codecs a single collective can carry (no exchange state, no shared randomness).
COLLECTIVE_CODECS = ("cast_bf16", "lossless", "q8", "q4", "q2", "qsgd", "terngrad", "sign",
                     "fp8_e4m3", "fp8_e5m2", "hadamard_q8", "top_k")


def _pattern(name: str, rng: np.random.Generator) -> np.ndarray:
    """``[N, *SHAPE]`` float64 values of one magnitude pattern, different per replica."""
    kind, _, mag = name.partition("@")
    m = float(mag) if mag else 1.0
    per = 1.0 + np.arange(N).reshape(N, 1, 1) / 16.0
    if kind == "zeros":
        return np.zeros((N,) + SHAPE)
    if kind == "single":
        x = np.zeros((N,) + SHAPE)
        x[:, 3, 5] = m * per[:, 0, 0] / per.max() * np.where(np.arange(N) % 2, -1, 1)
        return x
    if kind == "uniform":
        return rng.uniform(-m, m, (N,) + SHAPE) / per.max()
    # mixed: log-uniform magnitudes over the whole range within every block, random signs
    logs = rng.uniform(np.log(1e-45), np.log(3e38), (N,) + SHAPE)
    return np.exp(logs) * rng.choice([-1.0, 1.0], (N,) + SHAPE)


PATTERNS = (["zeros", "mixed"]
            + [f"single@{m}" for m in (1e-45, 1e-40, 1e-38, 1.2e-38, 1e-37, 1e-30, 1e-20, 1.0, 1e30, 3e38)]
            + [f"uniform@{m}" for m in (1e-44, 1e-40, 1e-38, 1e-37, 1e-36, 1e-30, 1e-20, 1.0, 1e20,
                                        1e30, 1e38, 3e38)])
assert len(PATTERNS) % N == 0  # the rows of one leaf are scattered over the replicas


def _grads(dtype, per_leaf: bool) -> dict:
    """The patterns as one leaf each (``per_leaf``), or as the rows (blocks) of one leaf
    ``[N, len(PATTERNS), ROW]``."""
    rng = np.random.default_rng(0)
    xs = [_pattern(name, rng) for name in PATTERNS]
    if dtype == jnp.bfloat16:  # bf16's largest finite is 3.39e38; keep inside it
        xs = [np.clip(x, -3.3e38, 3.3e38) for x in xs]
    cast = lambda x: np.asarray(jnp.asarray(x.astype(np.float32), dtype))  # noqa: E731
    if per_leaf:
        return {f"{i:02d}_{name}": cast(x) for i, (name, x) in enumerate(zip(PATTERNS, xs))}
    return {"rows": cast(np.stack([x.reshape(N, -1)[:, :ROW] for x in xs], axis=1))}


def _views(out: dict, grads: dict):
    """``(name, out, grad)`` per pattern, each ``[N, ...]``."""
    if "rows" not in grads:
        yield from ((k, out[k], g) for k, g in grads.items())
        return
    for i, name in enumerate(PATTERNS):
        yield name, np.asarray(out["rows"])[:, i], np.asarray(grads["rows"])[:, i]


def _check(out: dict, grads: dict, rel: float, what: str, limit: float = np.inf) -> None:
    for k, o, g in _views(out, grads):
        o = np.asarray(o, np.float32).astype(np.float64)
        g64 = np.asarray(g, np.float32).astype(np.float64)
        for r in range(1, o.shape[0]):
            np.testing.assert_array_equal(o[r], o[0], err_msg=f"{what}: {k}: replicas differ")
        if np.max(np.abs(g64)) > limit and np.all(np.isnan(o)):
            continue  # flagged, as documented
        assert np.all(np.isfinite(o)), f"{what}: {k}: finite input gave a non-finite output"
        err = np.max(np.abs(o[0] - g64.mean(0)))
        bound = rel * np.max(np.abs(g64)) + SLACK
        assert err <= bound, f"{what}: {k}: error {err:.3g} > bound {bound:.3g}"


def _check_state(name: str, new) -> None:
    """Residuals finite; ``residual_norm`` the l2 norm of this replica's residuals
    (inf only where that norm itself exceeds fp32's range); ``nonfinite`` 0."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(new):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and "residual_norm" not in jax.tree_util.keystr(path):
            assert np.all(np.isfinite(np.asarray(leaf, np.float32))), (
                f"{name}: state {jax.tree_util.keystr(path)} not finite")
    if not hasattr(new, "metrics"):
        return
    assert int(np.max(np.asarray(new.metrics["nonfinite"]))) == 0, f"{name}: a finite step was flagged"
    res = [np.asarray(e, np.float64).reshape(N, -1) for e in new.residual]
    true = np.sqrt(sum(np.sum(np.square(e), axis=1) for e in res)) if res else np.zeros(N)
    got = np.asarray(new.metrics["residual_norm"], np.float64).reshape(N)
    fmax = float(np.finfo(np.float32).max)
    np.testing.assert_array_equal(np.isinf(got), true > fmax, err_msg=f"{name}: residual_norm")
    ok = true <= fmax
    np.testing.assert_allclose(got[ok], true[ok], rtol=1e-5, err_msg=f"{name}: residual_norm")


def _mesh():
    return _compat.make_mesh((N,), (AX,), devices=jax.devices()[:N])


def _init(tx, params, mesh):
    """``cj.init_sharded`` with the declared per-replica mask: these tests check values."""
    return cj.init_sharded(tx, params, mesh, AX, mask=declared_mask(tx, params, mesh))


def _run_mean(codec, reducer, grads):
    mesh = _mesh()
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a[0]), grads)
    tx = cj.compressed_mean(codec, AX, reducer=reducer)
    state = _init(tx, params, mesh)
    specs = cj.state_specs(state, AX)

    def step(g, s):
        u, s2 = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s)
        return jax.tree_util.tree_map(lambda a: a[None], u), s2

    f = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(AX), specs),
                                  out_specs=(P(AX), specs), check_vma=False))
    out, new = f(jax.device_put(grads, NamedSharding(mesh, P(AX))), state)
    return out, new


CASES = [(name, r, dt) for name, (_, reducers, _) in CODECS.items() for r in reducers
         for dt in ("float32",)] + [
    (name, CODECS[name][1][-1], "bfloat16") for name in ("cast_bf16", "q8", "fp8_e4m3", "sign", "lossless")]


@pytest.mark.parametrize("name,reducer,dtype", CASES)
def test_compressed_mean_full_range(name, reducer, dtype):
    codec, _, rel = CODECS[name]
    grads = _grads(jnp.dtype(dtype), name in PER_LEAF)
    out, new = _run_mean(codec, reducer, grads)
    slack = 2.0 ** -7 if dtype == "bfloat16" else 0.0  # the mean is rounded to bf16
    _check(out, grads, rel + slack, f"{name}/{reducer}/{dtype}", LIMITS.get(name, np.inf))
    if name not in LIMITS:
        _check_state(name, new)


def _run_collective(op, codec, grads):
    mesh = _mesh()
    key = jax.random.key(0)

    def body(g):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        if op == "all_gather":
            return jax.tree_util.tree_map(lambda a: a[None], cc.all_gather(g, AX, codec, key=key))
        if op == "reduce_scatter":
            out = cc.reduce_scatter(g, AX, codec, key=key, mean=True)
            return jax.tree_util.tree_map(lambda a: cc.all_gather(a, AX)[None], out)
        return jax.tree_util.tree_map(lambda a: a[None], cc.all_reduce(g, AX, codec, key=key, mean=True))

    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX), check_vma=False))
    return f(jax.device_put(grads, NamedSharding(mesh, P(AX))))


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("name", COLLECTIVE_CODECS)
def test_collectives_full_range(op, name):
    codec, _, rel = CODECS[name]
    grads = _grads(jnp.dtype("float32"), name in PER_LEAF)
    out = _run_collective(op, codec, grads)
    if op != "all_gather":
        _check(out, grads, rel, f"{op}/{name}")
        return
    for k, o, g in _views(out, grads):  # every replica holds every replica's C(x_r)
        o = np.asarray(o, np.float64)
        o = o.reshape((N, N) + SHAPE) if "rows" not in grads else np.asarray(
            out["rows"], np.float64).reshape(N, N, len(PATTERNS), ROW)[:, :, PATTERNS.index(k)]
        assert np.all(np.isfinite(o)), f"all_gather/{name}: {k}: not finite"
        for r in range(1, N):
            np.testing.assert_array_equal(o[r], o[0], err_msg=f"all_gather/{name}: {k}")
        g64 = np.asarray(g, np.float64)
        bound = rel * np.max(np.abs(g64), axis=tuple(range(1, g64.ndim)), keepdims=True) + SLACK
        assert np.all(np.abs(o[0] - g64) <= bound), f"all_gather/{name}: {k}: error above bound"


#: Codecs whose values travel in a type that cannot hold every finite float32 (bfloat16,
#: largest 3.3895e38) or are rescaled past float32's largest (random-k by ~1 / ratio):
#: (codec, error feedback).
SATURATING = {
    "cast_bf16": (cj.cast(jnp.bfloat16), True),
    "lossless": (cj.lossless(), True),
    "top_k_bf16": (cj.top_k(0.1, values_dtype=jnp.bfloat16), True),
    "random_k_bf16": (cj.random_k(0.1, values_dtype=jnp.bfloat16), True),
    "random_k_rescaled": (cj.random_k(0.1, rescale=True), False),
}


@pytest.mark.parametrize("name", sorted(SATURATING))
def test_values_beyond_the_wire_type_saturate(name):
    """Values up to float32's largest (3.4028e38): each saturates at the largest value its
    wire type holds (rounding or rescaling would give infinity), so the mean is finite and
    identical on every replica, within the codec's bound of it, and nothing is flagged."""
    codec, ef = SATURATING[name]
    mesh = _mesh()
    fmax = float(np.finfo(np.float32).max)
    signs = np.where(np.random.default_rng(1).random((N, 16, 256)) < 0.5, -1.0, 1.0)
    g = {"w": (signs * fmax * np.linspace(0.99, 1.0, 256)).astype(np.float32)}
    tx = cj.compressed_mean(codec, AX, error_feedback=ef)
    state = _init(tx, jax.tree_util.tree_map(lambda a: jnp.asarray(a[0]), g), mesh)
    specs = cj.state_specs(state, AX)

    def step(x, s):
        u, s2 = tx.update(jax.tree_util.tree_map(lambda a: a[0], x), s)
        return u["w"][None], s2

    out, new = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(AX), specs), out_specs=(P(AX), specs),
                                         check_vma=False))(jax.device_put(g, NamedSharding(mesh, P(AX))), state)
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out)) and all(np.array_equal(o, out[0]) for o in out), name
    assert int(np.max(np.asarray(new.metrics["nonfinite"]))) == 0, f"{name}: a finite step was flagged"
    rel = 1.0 / 0.1 + 1 if name.startswith(("random_k", "top_k")) else 1e-2
    assert np.max(np.abs(out[0] - np.asarray(g["w"], np.float64).mean(0))) <= rel * fmax, name
