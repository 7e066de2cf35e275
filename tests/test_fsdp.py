"""cj.fsdp_gather (ZeRO-3 / FSDP): compressed weight all-gather, compressed gradient
reduce-scatter as its VJP; with jax.checkpoint and lax.scan over layers; the shard helpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat

N = 8
AX = "data"
BLOCK = 64
Q8 = cj.quantize(bits=8, block_size=BLOCK, stochastic=False)
Q4 = cj.quantize(bits=4, block_size=BLOCK)  # stochastic: the key must make both passes agree


def mlp_params():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return {"w0": jax.random.normal(k[0], (32, 48)) / 6, "b0": jnp.full((48,), 0.1),
            "w1": jax.random.normal(k[1], (48, 10)) / 7, "b1": jnp.zeros((10,))}


def stack_params():
    return {"w": jax.random.normal(jax.random.PRNGKey(1), (3, 32, 32)) / 6,
            "g": jnp.ones((3, 32))}


def mlp(p, x):
    return jnp.tanh(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]


def xent(logits, y):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def data():
    kx, ky = jax.random.split(jax.random.PRNGKey(2))
    x = jax.random.normal(kx, (N, 16, 32)) + jnp.arange(N)[:, None, None] / 4  # non-i.i.d.
    return x, jax.random.randint(ky, (N, 16), 0, 10)


def test_shard_and_unshard_round_trip_uneven_sizes():
    params = {"a": np.arange(7.0, dtype=np.float32), "s": np.float32(3.0),
              "m": np.ones((5, 3), np.float32), "i": np.arange(4, dtype=np.int32)}
    shards = cj.fsdp_shard(params, N, align=4, min_compress_size=10)
    assert {k: v.shape for k, v in shards.items()} == {"a": (8,), "s": (8,), "m": (32,), "i": (8,)}
    assert cj.fsdp_specs(shards, AX)["a"] == P(AX)
    back = cj.fsdp_unshard(shards, cj.fsdp_like(params))
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])
        assert back[k].dtype == np.asarray(params[k]).dtype
    stacked = cj.fsdp_shard(stack_params(), N, align=BLOCK, batch_dims=1)
    assert stacked["w"].shape == (3, N * 128) and stacked["g"].shape == (3, N * 4)
    assert cj.fsdp_specs(stacked, AX, batch_dims=1)["w"] == P(None, AX)
    assert cj.fsdp_like(stack_params(), batch_dims=1)["w"].shape == (32, 32)
    with pytest.raises(ValueError, match="batch_dims"):
        cj.fsdp_shard({"s": np.float32(1)}, N, batch_dims=1)


@pytest.fixture(scope="module")
def grads(mesh):
    """Every variant's gradient with respect to the shards, from one compiled program."""
    params, stacked = mlp_params(), stack_params()
    like, slike = cj.fsdp_like(params), cj.fsdp_like(stacked, batch_dims=1)
    shards = cj.fsdp_shard(params, N, align=BLOCK, min_compress_size=512)
    sshards = cj.fsdp_shard(stacked, N, align=BLOCK, batch_dims=1)
    x, y = data()
    key = jax.random.PRNGKey(7)

    def loss(sh, x, y, codec=None, grad_codec=None):
        p = cj.fsdp_gather(sh, AX, codec, grad_codec=grad_codec, key=key, like=like,
                           min_compress_size=512)
        return xent(mlp(p, x), y)

    def deep(sh, x, y, scan):
        def layer(h, s):
            p = cj.fsdp_gather(s, AX, like=slike)
            return h + jnp.tanh(h @ p["w"]) * p["g"], None
        h, _ = jax.lax.scan(jax.checkpoint(layer), x, sh)  # remat inside scan, as models do
        return jnp.mean(h ** 2)

    def local(sh, ssh, x, y):
        x, y = x[0], y[0]
        q4 = dict(codec=Q8, grad_codec=Q4)
        out = {
            "exact": jax.grad(loss)(sh, x, y),
            "comp": jax.grad(lambda s: loss(s, x, y, codec=Q8, grad_codec=Q8))(sh),
            "q4": jax.grad(lambda s: loss(s, x, y, **q4))(sh),
            "q4_remat": jax.grad(jax.checkpoint(lambda s: loss(s, x, y, **q4)))(sh),
            "scan": jax.grad(lambda s: deep(s, x, y, True))(ssh),
        }
        return jax.tree_util.tree_map(lambda a: a[None], out)

    specs = (cj.fsdp_specs(shards, AX), cj.fsdp_specs(sshards, AX, batch_dims=1), P(AX), P(AX))
    fn = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(AX)))
    out = jax.device_get(fn(shards, sshards, x, y))
    # Reference: the data-parallel mean gradient of the full parameters, sharded.
    ref = jax.tree_util.tree_map(lambda *g: sum(g) / N, *[
        jax.grad(lambda p: xent(mlp(p, x[r]), y[r]))(params) for r in range(N)])
    sref = jax.tree_util.tree_map(lambda *g: sum(g) / N, *[
        jax.grad(lambda p: deep_ref(p, x[r]))(stacked) for r in range(N)])
    return (out, cj.fsdp_shard(ref, N, align=BLOCK, min_compress_size=512),
            cj.fsdp_shard(sref, N, align=BLOCK, batch_dims=1))


def deep_ref(p, x):
    h = x
    for l in range(3):
        h = h + jnp.tanh(h @ p["w"][l]) * p["g"][l]
    return jnp.mean(h ** 2)


def shard_of(tree, r, batch_dims=0):
    """Replica ``r``'s shard of a :func:`fsdp_shard` tree."""
    def one(a):
        s = a.shape[-1] // N
        return np.asarray(a)[..., r * s:(r + 1) * s]
    return jax.tree_util.tree_map(one, tree)


def test_gradient_is_the_sharded_mean_gradient(grads):
    out, ref, sref = grads
    for r in range(N):
        mine = jax.tree_util.tree_map(lambda a: a[r], out)
        for k, v in shard_of(ref, r).items():
            np.testing.assert_allclose(mine["exact"][k], v, rtol=1e-5, atol=1e-6)
            # 8-bit weights and gradients: close, not equal; 4-bit stochastic gradients
            # (7 levels a side, 8 replicas' noise): coarser.
            for name, bound in (("comp", 0.03), ("q4", 0.3)):
                err = np.linalg.norm(mine[name][k] - v) / max(np.linalg.norm(v), 1e-12)
                assert err < bound, (name, k, err)
            if k == "w0":
                assert np.linalg.norm(mine["comp"][k] - v) > 0  # it was compressed
        for k, v in shard_of(sref, r).items():
            np.testing.assert_allclose(mine["scan"][k], v, rtol=1e-5, atol=1e-6)


def test_checkpoint_gives_the_same_gradient(grads):
    out, _, _ = grads
    # A rematerialised gather (same key, same weights) gives the same gradient, up to the
    # rounding of differently fused arithmetic (4-bit stochastic rounding drawn again with
    # another key would differ by tens of percent). Scanned + rematerialised layers: above.
    for k in out["q4"]:
        np.testing.assert_allclose(out["q4"][k], out["q4_remat"][k], rtol=1e-5, atol=1e-8)


def test_int8_weights_and_hadamard_int4_gradients_cut_the_bytes():
    """Against exact FSDP (the compiled step sends the plan: tests/test_contract.py)."""
    like = {"w": jax.ShapeDtypeStruct((1024, 1000), jnp.float32),
            "b": jax.ShapeDtypeStruct((1000,), jnp.float32)}
    codec, grad_codec = cj.quantize(8, stochastic=False), cj.hadamard(cj.quantize(4))
    want = cj.communication_plan(cj.fsdp_gather, like, N, codec=codec, grad_codec=grad_codec, align=256)
    exact = cj.communication_plan(cj.fsdp_gather, like, N, align=256)
    assert exact.bytes_of("weights") / want.bytes_of("weights") >= 3.5
    assert exact.bytes_of("gradients") / want.bytes_of("gradients") >= 6.0


def test_errors_name_the_argument(mesh):
    sh = jnp.ones((N * 4,))

    def bad_like(s):
        return cj.fsdp_gather(s, AX, like=jax.ShapeDtypeStruct((40,), jnp.float32))

    with pytest.raises(ValueError, match="like"):
        jax.eval_shape(_compat.shard_map(bad_like, mesh=mesh, in_specs=P(AX), out_specs=P()), sh)
    with pytest.raises(ValueError, match="grad_codec"):
        jax.eval_shape(_compat.shard_map(lambda s: cj.fsdp_gather(s, AX, grad_codec=cj.random_k(0.1)),
                                         mesh=mesh, in_specs=P(AX), out_specs=P(AX)), sh)


def _tile_order_grads(mesh, monkeypatch, codec, tiled: bool):
    """The gathered ``[64, 256]`` weight (shards of 8 whole tile rows) and the sharded
    gradient of a loss of it, with the TPU's tile order forced on or off."""
    from commjax import bucket
    if tiled:
        monkeypatch.setattr(bucket, "_by_layout", lambda x, tiled_fn, flat_fn: tiled_fn(x))
    w = {"w": jax.random.normal(jax.random.PRNGKey(3), (64, 256))}
    like, shards = cj.fsdp_like(w), cj.fsdp_shard(w, N, align=BLOCK)
    x = jax.random.normal(jax.random.PRNGKey(4), (N, 4, 64))

    def local(sh, x):
        def loss(s):
            p = cj.fsdp_gather(s, AX, codec, grad_codec=codec, like=like)
            return jnp.sum(jnp.tanh(x[0] @ p["w"]) ** 2), p["w"]
        g, full = jax.grad(loss, has_aux=True)(sh)
        return g, full[None]

    fn = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(cj.fsdp_specs(shards, AX), P(AX)),
                                   out_specs=(cj.fsdp_specs(shards, AX), P(AX))))
    g, full = jax.device_get(fn(shards, x))
    monkeypatch.undo()
    return np.asarray(g["w"]), np.asarray(full)


def test_tile_sharded_leaves_travel_in_tile_order(mesh, monkeypatch):
    """On TPU a leaf whose shards are whole tile rows is gathered (and its cotangent
    reduce-scattered) in tile order, the leaf a bitcast of the vector on the wire. Forced
    here: blocks of 64 (one row's run in either order) give the row-major path's bits;
    blocks of 256 other bits, as far from the exact weights and gradient."""
    flat = _tile_order_grads(mesh, monkeypatch, Q8, False)
    tiled = _tile_order_grads(mesh, monkeypatch, Q8, True)
    for a, b in zip(flat, tiled):
        np.testing.assert_array_equal(a, b)
    q256 = cj.quantize(bits=8, block_size=256, stochastic=False)
    (gf, wf), (gt, wt) = (_tile_order_grads(mesh, monkeypatch, q256, t) for t in (False, True))
    g0, w0 = _tile_order_grads(mesh, monkeypatch, None, False)
    assert (wt == wt[:1]).all() and not np.array_equal(wf, wt)
    for name, (f, t, exact) in {"weights": (wf, wt, w0), "gradient": (gf, gt, g0)}.items():
        ef, et = np.linalg.norm(f - exact), np.linalg.norm(t - exact)
        assert 0 < et < 1.3 * ef and ef < 0.2 * np.linalg.norm(exact), (name, ef, et)
