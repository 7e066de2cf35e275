"""compressed_mean in the TPU's flat order (commjax.bucket.ravel_leaf), forced here on CPU:
a 2-D leaf then travels as its tiles, so each mean and residual must be the row-major
exchange of the tile-ordered vector, put back in the leaf's shape; identity and the
elementwise cast give the same bits as the row-major order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat, bucket
from commjax.testing import ready

SHAPE = (16, 256)


def _step(tx, g, mesh):
    state = cj.shard_state(tx.init(g[0]), mesh, "data")
    specs = cj.state_specs(state, "data")

    def f(g, s):
        out, s = tx.update(g[0], s)
        return out, s

    fn = _compat.shard_map(f, mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs))
    return jax.jit(fn)(*ready(g, state))


@pytest.fixture
def tiles(monkeypatch):
    monkeypatch.setattr(bucket, "ravel_leaf", bucket.ravel_tiles)
    monkeypatch.setattr(bucket, "unravel_leaf", bucket.unravel_tiles)


@pytest.mark.parametrize("codec", [cj.quantize(8), cj.quantize(4), cj.sign(), cj.top_k(0.05)],
                         ids=["int8", "int4", "sign", "topk"])
def test_tile_order_is_the_row_major_exchange_of_the_tiles(mesh, tiles, codec):
    g = jax.random.normal(jax.random.PRNGKey(1), (8,) + SHAPE) * jnp.linspace(0.1, 3.0, SHAPE[1])
    tx = cj.compressed_mean(codec, "data", min_compress_size=16, compress_vectors=True)
    out, state = _step(tx, g, mesh)
    flat = jax.vmap(bucket.ravel_tiles)(g)
    with pytest.MonkeyPatch.context() as m:  # the row-major order, on the tiles as a vector
        m.setattr(bucket, "ravel_leaf", lambda a: a.reshape(-1))
        m.setattr(bucket, "unravel_leaf", lambda v, shape: v.reshape(shape))
        ref_out, ref_state = _step(tx, flat, mesh)
    np.testing.assert_array_equal(np.asarray(bucket.ravel_tiles(out)), np.asarray(ref_out))
    assert state.residual[0].shape == (8 * SHAPE[0], SHAPE[1])  # per replica: the leaf's shape
    res = np.asarray(state.residual[0]).reshape((8,) + SHAPE)
    ref_res = np.asarray(ref_state.residual[0]).reshape(8, -1)
    np.testing.assert_array_equal(np.asarray(jax.vmap(bucket.ravel_tiles)(jnp.asarray(res))), ref_res)


@pytest.mark.parametrize("codec", [cj.identity(), cj.cast(jnp.bfloat16)], ids=["identity", "bf16"])
def test_elementwise_codecs_give_the_same_bits_in_either_order(mesh, codec):
    g = jax.random.normal(jax.random.PRNGKey(2), (8,) + SHAPE)
    tx = cj.compressed_mean(codec, "data", min_compress_size=16)
    row_out, row_state = _step(tx, g, mesh)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(bucket, "ravel_leaf", bucket.ravel_tiles)
        m.setattr(bucket, "unravel_leaf", bucket.unravel_tiles)
        tile_out, tile_state = _step(tx, g, mesh)
    np.testing.assert_array_equal(np.asarray(tile_out), np.asarray(row_out))
    for a, b in zip(row_state.residual, tile_state.residual):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
