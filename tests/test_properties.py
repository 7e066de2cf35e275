"""Property test of ``compressed_mean`` over compressors x reducers x dtypes x shapes x
replica counts: replicas bit-identical, the result within the codec's bound of the true
mean, a NaN on one replica visible on all, residuals finite when the inputs are."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat

AX = "data"
#: codec, its reducers, and the bound of |mean - true mean| / max |g| after one step.
CODECS = {
    "identity": (cj.identity(), ("auto",), 1e-6),
    "cast": (cj.cast(jnp.bfloat16), ("auto", "allgather"), 1e-2),
    "q8": (cj.quantize(8), ("auto", "allgather", "two_phase"), 0.03),
    "q4": (cj.quantize(4, block_size=64), ("auto", "allgather"), 0.4),
    "sign": (cj.sign(block_size=64), ("two_phase", "allgather"), 2.5),
    "top_k": (cj.top_k(0.2), ("allgather", "two_phase"), 2.0),
    "random_k": (cj.random_k(0.2), ("auto",), 2.0),
    "powersgd": (cj.powersgd(2), ("auto",), 4.0),
}
DTYPES = ("float32", "bfloat16", "float16", "complex64", "int32", "bool")
SHAPES = ((), (0,), (1,), (7,), (3, 5), (64, 33), (2, 300))


def _leaf(rng, shape, dtype, n):
    if dtype == "bool":
        return rng.random((n,) + shape) > 0.5
    if dtype == "int32":
        return rng.integers(-5, 5, (n,) + shape).astype(np.int32)
    x = rng.standard_normal((n,) + shape) + np.arange(n).reshape((n,) + (1,) * len(shape))
    if dtype == "complex64":
        x = x + 1j * rng.standard_normal((n,) + shape)
    return x.astype(jnp.dtype(dtype))


def _step(tx, params, mesh):
    state = cj.init_sharded(tx, params, mesh, AX)
    specs = cj.state_specs(state, AX)
    f = jax.jit(_compat.shard_map(
        lambda g, s: (lambda u, s2: (jax.tree_util.tree_map(lambda a: a[None], u), s2))(
            *tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s)),
        mesh=mesh, in_specs=(P(AX), specs), out_specs=(P(AX), specs), check_vma=False))
    return f, state


@settings(max_examples=int(__import__("os").environ.get("COMMJAX_PROPERTY_EXAMPLES", "24")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(codec=st.sampled_from(sorted(CODECS)), data=st.data(),
       n=st.sampled_from([1, 2, 3, 8]),
       leaves=st.lists(st.tuples(st.sampled_from(SHAPES), st.sampled_from(DTYPES)), min_size=1, max_size=4))
def test_compressed_mean_properties(codec, data, n, leaves):
    comp, reducers, bound = CODECS[codec]
    reducer = data.draw(st.sampled_from(reducers))
    nan = data.draw(st.booleans())
    rng = np.random.default_rng(len(leaves) * 31 + n)
    g = {f"l{i}": _leaf(rng, s, d, n) for i, (s, d) in enumerate(leaves)}
    mesh = _compat.make_mesh((n,), (AX,), devices=jax.devices()[:n])
    tx = cj.compressed_mean(comp, AX, reducer=reducer, min_compress_size=16, compress_vectors=True)
    f, state = _step(tx, jax.tree_util.tree_map(lambda a: jnp.asarray(a[0]), g), mesh)
    floats = [k for k, v in g.items() if jnp.issubdtype(v.dtype, jnp.inexact) and v[0].size]
    if nan and floats:
        g[floats[0]] = g[floats[0]].copy()
        g[floats[0]][(n - 1,) + (0,) * (g[floats[0]].ndim - 1)] = np.nan
    u, new = f(jax.device_put(g, NamedSharding(mesh, P(AX))), state)
    for k in floats:
        out = np.asarray(u[k])
        assert out.dtype == g[k].dtype
        for r in range(1, n):  # bit-identical on every replica (NaNs in the same places)
            np.testing.assert_array_equal(out[r], out[0], err_msg=k)
        if nan and k == floats[0]:
            assert np.any(np.isnan(out[0])), "a NaN on one replica is not visible"
            continue
        true = np.asarray(g[k], np.complex128 if np.iscomplexobj(g[k]) else np.float64).mean(0)
        scale = max(float(np.max(np.abs(np.asarray(g[k], np.complex128)))), 1e-30)
        assert np.max(np.abs(out[0] - true)) <= bound * scale + 1e-2 * (g[k].dtype.itemsize == 2) * scale, k
    for leaf in jax.tree_util.tree_leaves(new.residual):
        assert np.all(np.isfinite(np.asarray(leaf))), "a residual is not finite"
