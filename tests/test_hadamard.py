"""cj.hadamard: a Walsh-Hadamard rotation around any block codec: exact inverse, bytes
unchanged, less error on outliers, and it travels through every collective and reducer
(``compressed_mean`` with it: the contract matrix, tests/test_contract.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax import collectives as cc
from commjax.compressors.hadamard import hadamard_matrix, rotate

N = 8


def test_rotation_is_orthogonal_and_its_own_inverse():
    r = hadamard_matrix(32).astype(np.float64)
    np.testing.assert_allclose(r @ r, np.eye(32), atol=1e-6)
    np.testing.assert_allclose(r, r.T)
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 256))
    np.testing.assert_allclose(rotate(rotate(x, 32), 32), x, rtol=0, atol=2e-6)
    # hadamard(identity) is the identity up to rounding; the payload is the same size.
    h = cj.hadamard(cj.identity())
    flat = jnp.ravel(x)
    np.testing.assert_allclose(h.decode(h.encode(flat, None), flat.size), flat, atol=2e-6)
    for codec in (cj.quantize(4), cj.quantize(8, block_size=64), cj.cast(), cj.sign(), cj.identity()):
        wrapped = cj.hadamard(codec, size=32)
        n = 4096
        assert wrapped.payload_words(n) == codec.payload_words(n), codec.name
        assert wrapped.stochastic == codec.stochastic and wrapped.linear == codec.linear


def test_rotation_lowers_4bit_error_on_outliers():
    x = jax.random.normal(jax.random.PRNGKey(1), (1 << 14,))
    x = x.at[::97].mul(30.0)  # heavy outliers, as in activations' and gradients' tails
    q = cj.quantize(4, block_size=128, stochastic=False)
    err = lambda c: float(jnp.linalg.norm(c.roundtrip(x) - x) / jnp.linalg.norm(x))  # noqa: E731
    assert err(cj.hadamard(q)) < 0.6 * err(q), (err(cj.hadamard(q)), err(q))


def test_in_every_collective_and_reducer(mesh):
    x = jax.random.normal(jax.random.PRNGKey(2), (N, N * 4, 64)).at[:, :, ::13].mul(20.0)
    q4 = cj.hadamard(cj.quantize(4, block_size=64, stochastic=False))
    lin = cj.hadamard(cj.identity())  # linear fp32: psum-able (16-bit payloads are refused)

    def f(v):
        v = v[0]
        out = {
            "ag": cc.all_gather(v, "data", q4, invariant=True),
            "rs": cc.reduce_scatter(v, "data", q4, mean=True),
            "ar_gather": cc.all_reduce(v, "data", q4, reducer="allgather", mean=True),
            "ar_two_phase": cc.all_reduce(v, "data", q4, reducer="two_phase", mean=True),
            "ar_psum": cc.all_reduce(v, "data", lin, reducer="allreduce", mean=True),
        }
        return jax.tree_util.tree_map(lambda a: a[None], out)

    out = jax.jit(_compat.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                    check_vma=False))(x)
    mean = np.asarray(x.mean(0))
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    for k in ("ag", "ar_gather", "ar_two_phase", "ar_psum"):
        for r in range(1, N):
            np.testing.assert_array_equal(out[k][r], out[k][0], err_msg=k)
    assert rel(np.asarray(out["ag"][0]), np.asarray(x).reshape(-1, 64)) < 0.1
    assert rel(np.asarray(out["rs"]).reshape(mean.shape), mean) < 0.1
    assert rel(np.asarray(out["ar_gather"][0]), mean) < 0.1
    assert rel(np.asarray(out["ar_two_phase"][0]), mean) < 0.15
    assert rel(np.asarray(out["ar_psum"][0]), mean) < 1e-5


def test_bad_arguments():
    with pytest.raises(TypeError, match="codec"):
        cj.hadamard(cj.top_k(0.1))
    with pytest.raises(ValueError, match="size"):
        cj.hadamard(cj.quantize(4), size=0)
    with pytest.raises(ValueError, match="already"):
        cj.hadamard(cj.hadamard(cj.quantize(4)))
