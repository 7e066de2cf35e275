"""commjax.collectives: results against host references, bytes against HLO, VJPs, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax import collectives as cc

N = 8
DET_CODECS = {
    "q8": cj.quantize(bits=8, stochastic=False),
    "q4": cj.quantize(bits=4, stochastic=False, block_size=64),
    "sign": cj.sign(block_size=128),
    "cast": cj.cast(jnp.bfloat16),
    "top_k": cj.top_k(0.05),
}


def run(fn, mesh, in_specs, out_specs, *args, check_vma=True):
    return jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=check_vma))(*args)


def roundtrip(codec, x):
    """``C(x)`` of a whole array, as one vector padded to whole blocks."""
    flat = jnp.ravel(x).astype(jnp.float32)
    a = codec.alignment
    pad = -(-max(flat.shape[0], 1) // a) * a - flat.shape[0]
    v = jnp.pad(flat, (0, pad))
    return codec.decode(codec.encode(v, None), v.shape[0])[:flat.shape[0]].reshape(x.shape)


@pytest.mark.parametrize("name", sorted(DET_CODECS))
@pytest.mark.parametrize("check_vma", [True, False])
def test_all_gather_is_every_shard_decoded(mesh, name, check_vma):
    codec = DET_CODECS[name]
    x = jax.random.normal(jax.random.PRNGKey(0), (N * 3, 50))
    tree = {"w": x, "b": jnp.arange(N * 2, dtype=jnp.int32)}
    out = run(lambda t: cc.all_gather(t, "data", codec, invariant=True), mesh, (P("data"),),
              P(), tree, check_vma=check_vma)
    ref = jnp.concatenate([roundtrip(codec, x[3 * r:3 * r + 3]) for r in range(N)])
    # Up to one rounding of the decode's step (XLA may divide by the level count or
    # multiply by its reciprocal, depending on the fusion).
    np.testing.assert_allclose(out["w"], ref, rtol=2e-7, atol=0)
    np.testing.assert_array_equal(out["b"], tree["b"])  # integers travel exactly
    assert out["w"].dtype == x.dtype


@pytest.mark.parametrize("name", sorted(DET_CODECS))
def test_reduce_scatter_sums_decoded_chunks_in_replica_order(mesh, name):
    codec = DET_CODECS[name]
    xs = jax.random.normal(jax.random.PRNGKey(1), (N, N * 2, 70))
    out = run(lambda x: cc.reduce_scatter(x[0], "data", codec), mesh, (P("data"),), P("data"), xs)
    ref = []
    for j in range(N):
        total = jnp.zeros((2, 70), jnp.float32)
        for r in range(N):
            total = total + roundtrip(codec, xs[r, 2 * j:2 * j + 2])
        ref.append(total)
    np.testing.assert_allclose(out, jnp.concatenate(ref), rtol=1e-6, atol=1e-6)


def test_reduce_scatter_error_feedback_identity(mesh):
    """``C(y) + new_residual == y`` per replica, with ``y = x + residual``."""
    codec = cj.quantize(bits=4, block_size=32)
    xs = jax.random.normal(jax.random.PRNGKey(2), (N, N * 4, 32))
    es = 0.1 * jax.random.normal(jax.random.PRNGKey(3), (N, N * 4, 32))
    key = jax.random.PRNGKey(4)

    def f(x, e):
        out, new = cc.reduce_scatter(x[0], "data", codec, key=key, residual=e[0])
        total = cc.reduce_scatter(x[0] + e[0] - new, "data", None)
        return out[None], total[None], new[None]

    out, total, new = run(f, mesh, (P("data"), P("data")), (P("data"),) * 3, xs, es,
                          check_vma=False)
    # What was sent (y - new residual), summed exactly, equals the compressed sum.
    np.testing.assert_allclose(out, total, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(new))) > 0
    # Residuals are bounded by one quantization step: |e| <= max|y| / 7 per block.
    assert float(jnp.max(jnp.abs(new))) <= float(jnp.max(jnp.abs(xs + es))) / 7 + 1e-6


def test_reduce_scatter_stochastic_is_unbiased(mesh):
    codec = cj.quantize(bits=2, block_size=32)
    x = jnp.tile(jnp.linspace(-1, 1, 32)[None, None, :], (N, N, 1))

    def f(x, k):
        return cc.reduce_scatter(x[0], "data", codec, key=k[0], mean=True)

    trials = 200
    keys = jax.random.split(jax.random.PRNGKey(5), trials)
    outs = jax.vmap(lambda k: run(f, mesh, (P("data"), P()), P("data"), x, k[None]))(keys)
    mean = outs.mean(0)
    # One 2-bit level of a unit block is 1; the mean of 200 x 8 draws has std <= 0.5/40.
    assert float(jnp.max(jnp.abs(mean - x[0]))) < 0.06
    assert float(jnp.max(jnp.abs(outs[0] - x[0]))) > 0.1  # single draws are coarse


@pytest.mark.parametrize("reducer", ["allgather", "two_phase"])
@pytest.mark.parametrize("name", ["q8", "sign", "top_k"])
def test_all_reduce_replicas_identical_and_close(mesh, reducer, name):
    codec = DET_CODECS[name]
    xs = jax.random.normal(jax.random.PRNGKey(6), (N, 96, 40))
    out = run(lambda x: cc.all_reduce(x[0], "data", codec, reducer=reducer, mean=True)[None],
              mesh, (P("data"),), P("data"), xs, check_vma=False)
    for r in range(1, N):
        np.testing.assert_array_equal(out[r], out[0])
    if reducer == "allgather" and name != "top_k":
        ref = sum(roundtrip(codec, xs[r]) for r in range(N)) / N
        np.testing.assert_allclose(out[0], ref, rtol=1e-5, atol=1e-6)
    err = float(jnp.linalg.norm(out[0] - xs.mean(0)) / jnp.linalg.norm(xs.mean(0)))
    bound = {"q8": 0.02, "sign": 3.0, "top_k": 1.0}[name]
    assert err < bound


CASES = [
    ("all_gather", "q4", lambda c: (lambda x: cc.all_gather(x, "data", c)), (N * 8, 256)),
    ("all_gather", "top_k", lambda c: (lambda x: cc.all_gather(x, "data", c)), (N * 8, 256)),
    ("reduce_scatter", "q4", lambda c: (lambda x: cc.reduce_scatter(x, "data", c)), (N * 8, 256)),
    ("reduce_scatter", "sign", lambda c: (lambda x: cc.reduce_scatter(x, "data", c)), (N * 8, 256)),
    ("reduce_scatter", "exact", lambda c: (lambda x: cc.reduce_scatter(x, "data", c)), (N * 8, 256)),
    ("all_reduce", "q8", lambda c: (lambda x: cc.all_reduce(x, "data", c, reducer="two_phase")), (300, 70)),
    ("all_reduce", "top_k", lambda c: (lambda x: cc.all_reduce(x, "data", c, reducer="two_phase")), (300, 70)),
    ("all_reduce", "cast", lambda c: (lambda x: cc.all_reduce(x, "data", c)), (300, 70)),
]


@pytest.mark.parametrize("op,name,make,shape", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_hlo_bytes_equal_the_plan(mesh, op, name, make, shape):
    codec = None if name == "exact" else DET_CODECS[name]
    x = jnp.zeros((N,) + shape, jnp.float32)
    fn = jax.jit(_compat.shard_map(lambda v: make(codec)(v[0]), mesh=mesh, in_specs=P("data"),
                                   out_specs=P("data") if op == "reduce_scatter" else P(),
                                   check_vma=False))
    rep = cj.collective_bytes(fn, x)
    kw = {"reducer": "two_phase" if name != "cast" else "auto"} if op == "all_reduce" else {}
    plan = cj.communication_plan(getattr(cc, op), jax.ShapeDtypeStruct(shape, jnp.float32), N, codec=codec, **kw)
    assert rep.total_ring_bytes == pytest.approx(plan.compiled_bytes, abs=0.5), rep.table()
    if codec is not None:
        assert all(d in ("u32",) for c in rep.collectives for d in c.dtypes), rep.table()


def _bytes(op, x, n, codec=None, **kw) -> float:
    return cj.communication_plan(op, x, n, codec=codec, **kw).bytes_per_step


def test_compressed_reduce_scatter_bytes_target(mesh):
    shape = (N * 64, 512)
    exact = _bytes(cc.reduce_scatter, jax.ShapeDtypeStruct(shape, jnp.float32), N)
    q4 = _bytes(cc.reduce_scatter, jax.ShapeDtypeStruct(shape, jnp.float32), N, cj.quantize(4))
    assert exact / q4 == pytest.approx(32 / 4.125)


def test_sparse_two_phase_bytes_flat_in_replicas():
    x = jax.ShapeDtypeStruct((2048, 512), jnp.float32)
    ratios = {}
    for n in (8, 64):
        exact = _bytes(cc.all_reduce, x, n)
        ag = _bytes(cc.all_reduce, x, n, cj.top_k(0.01), reducer="allgather")
        tp = _bytes(cc.all_reduce, x, n, cj.top_k(0.01), reducer="two_phase")
        ratios[n] = (exact / ag, exact / tp)
    assert ratios[64][0] < 2.0  # the all-gather grows with N
    assert ratios[64][1] >= 10.0 and ratios[8][1] >= 10.0


@pytest.mark.exact_codegen
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("grad_codec", [None, "q8"])
def test_all_gather_vjp_is_reduce_scatter(mesh, check_vma, grad_codec):
    gc = None if grad_codec is None else DET_CODECS[grad_codec]
    w = jax.random.normal(jax.random.PRNGKey(0), (N * 4, 64))
    data = jax.random.normal(jax.random.PRNGKey(1), (N, N * 4, 64))

    def f(ws, d):
        return jax.grad(lambda ws: jnp.sum(cc.all_gather(ws, "data", DET_CODECS["q8"],
                                                         grad_codec=gc) * d[0]))(ws)

    g = run(f, mesh, (P("data"), P("data")), P("data"), w, data, check_vma=check_vma)
    if gc is None:
        np.testing.assert_allclose(g, data.sum(0), rtol=1e-5, atol=1e-5)
    else:
        ref = run(lambda d: cc.reduce_scatter(d[0], "data", gc), mesh, (P("data"),), P("data"), data)
        np.testing.assert_array_equal(g, ref)


@pytest.mark.parametrize("check_vma", [True, False])
def test_reduce_scatter_and_all_reduce_vjps_match_lax(mesh, check_vma):
    xs = jax.random.normal(jax.random.PRNGKey(2), (N, N * 2, 16))
    weight = lambda: 1.0 + lax.axis_index("data")

    def ours(x):
        a = jax.grad(lambda x: jnp.sum(cc.reduce_scatter(x[0], "data", DET_CODECS["q8"], mean=True) * weight()))(x)
        b = jax.grad(lambda x: jnp.sum(cc.all_reduce(x[0], "data", DET_CODECS["q8"], mean=True) * 2.0))(x)
        return a, b

    def theirs(x):
        a = jax.grad(lambda x: jnp.sum(lax.psum_scatter(x[0], "data", tiled=True) / N * weight()))(x)
        b = jax.grad(lambda x: jnp.sum(lax.pmean(x[0], "data") * 2.0))(x)
        return a, b

    got = run(ours, mesh, (P("data"),), (P("data"), P("data")), xs, check_vma=check_vma)
    want = run(theirs, mesh, (P("data"),), (P("data"), P("data")), xs, check_vma=check_vma)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
def test_two_level_scatter_then_gather_is_the_mean(check_vma):
    mesh = _compat.make_mesh((2, 4), ("slow", "fast"))
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 16, 40))

    def f(x, codec, inner):
        ch = cc.reduce_scatter(x[0], "slow", codec, inner_axis_name="fast", inner_codec=inner, mean=True)
        return cc.all_gather(ch, "slow", None, inner_axis_name="fast", invariant=True)

    exact = run(lambda x: f(x, None, None), mesh, (P(("slow", "fast")),), P(), x, check_vma=check_vma)
    np.testing.assert_allclose(exact, x.mean(0), rtol=1e-5, atol=1e-6)
    q = run(lambda x: f(x, cj.quantize(4, stochastic=False), cj.quantize(8, stochastic=False)),
            mesh, (P(("slow", "fast")),), P(), x, check_vma=check_vma)
    assert 0 < float(jnp.max(jnp.abs(q - x.mean(0)))) < 0.15


def test_errors_name_the_fix(mesh):
    x = jnp.zeros((N * 2, 8))
    with pytest.raises(NameError, match="shard_map"):
        cc.all_gather(x, "data", cj.quantize(8))
    with pytest.raises(ValueError, match="own exchange"):
        run(lambda v: cc.all_reduce(v, "data", cj.powersgd(rank=2)), mesh, (P("data"),), P(), x)
    with pytest.raises(ValueError, match="key="):
        run(lambda v: cc.reduce_scatter(v, "data", cj.quantize(8)), mesh, (P("data"),), P("data"),
            jnp.zeros((N * N * 2, 8)))
    with pytest.raises(ValueError, match="multiple of the number of replicas"):
        run(lambda v: cc.reduce_scatter(v, "data", cj.quantize(8, stochastic=False)), mesh,
            (P("data"),), P("data"), jnp.zeros((N * 3, 8)))
    with pytest.raises(ValueError, match="reducer"):
        run(lambda v: cc.all_reduce(v, "data", cj.quantize(8, stochastic=False), reducer="allreduce"),
            mesh, (P("data"),), P(), x)
    with pytest.raises(TypeError, match="codec"):
        run(lambda v: cc.all_gather(v, "data", "int8"), mesh, (P("data"),), P(), x)


# ----------------------------------------------------------- any replica count, shape, dtype

#: codec and the bound of ``|all_reduce mean - true mean| / max|x|`` (None: exact).
PROPERTY_CODECS = {
    "exact": (None, None),
    "identity": (cj.identity(), None),
    "lossless": (cj.lossless(block_size=64), None),  # exact on bfloat16 values
    "cast": (cj.cast(jnp.bfloat16), 1e-2),
    "q8": (cj.quantize(bits=8, block_size=64), 0.03),
    "sign": (cj.sign(block_size=64), 2.5),
    "top_k": (cj.top_k(0.2), 2.0),
    "fp8": (cj.fp8(block_size=64), 0.3),
}


@pytest.mark.parametrize("name,n,shape,dtype", [
    ("exact", 3, (7,), "float32"), ("identity", 5, (3, 5), "bfloat16"),
    ("lossless", 3, (2, 3, 4), "bfloat16"), ("cast", 5, (1,), "float16"),
    ("q8", 3, (130,), "float32"), ("sign", 5, (2, 33), "bfloat16"),
    ("top_k", 3, (5, 5), "float32"), ("fp8", 5, (70,), "float32"),
])
def test_collectives_on_odd_replica_counts(name, n, shape, dtype):
    """On 3 and 5 replicas, odd shapes and low-precision dtypes: all_reduce (every reducer
    the codec allows) is the same on every replica, in the input dtype, within the codec's
    bound of the true mean (equal for exact codecs); all_gather returns every shard and
    reduce_scatter each replica's chunk of the sum, identical where the codec is exact."""
    codec, bound = PROPERTY_CODECS[name]
    mesh = _compat.make_mesh((n,), ("r",), devices=jax.devices()[:n])
    dt = jnp.dtype(dtype)
    x = (jax.random.normal(jax.random.PRNGKey(n), (n,) + shape)
         + jnp.arange(n).reshape((n,) + (1,) * len(shape))).astype(dt)
    xf = np.asarray(x, np.float32)
    true = xf.mean(0)
    reducers = ["auto"] if codec is None else ["auto"] + list(cj.collectives.valid_reducers(codec))
    key = jax.random.PRNGKey(7)
    for reducer in reducers:
        out = run(lambda v: cc.all_reduce(v[0], "r", codec, reducer=reducer, key=key, mean=True)[None],
                  mesh, P("r"), P("r"), x, check_vma=False)
        assert out.dtype == dt and out.shape == x.shape, reducer
        got = np.asarray(out, np.float32)
        assert all(np.array_equal(got[0], got[r]) for r in range(n)), reducer
        err = np.max(np.abs(got[0] - true)) / np.max(np.abs(xf))
        limit = float(jnp.finfo(dt).eps) * n if bound is None else bound
        assert err <= limit, (reducer, err, limit)
    gathered = run(lambda v: cc.all_gather(v[0], "r", codec, key=key)[None], mesh, P("r"), P("r"),
                   x, check_vma=False)
    assert gathered.shape == (n, n * shape[0]) + shape[1:] and gathered.dtype == dt
    g = np.asarray(gathered, np.float32)
    assert all(np.array_equal(g[0], g[r]) for r in range(n))
    if bound is None:
        np.testing.assert_array_equal(g[0].reshape((n,) + shape), xf)
    y = jnp.concatenate([x] * n, axis=1)  # [n, n * a, ...]: chunk j of replica r is x[r]
    chunk = run(lambda v: cc.reduce_scatter(v[0], "r", codec, key=key, mean=True)[None],
                mesh, P("r"), P("r"), y, check_vma=False)
    assert chunk.shape == x.shape and chunk.dtype == dt
    if bound is None:
        c = np.asarray(chunk, np.float32)
        assert np.max(np.abs(c - true[None])) <= float(jnp.finfo(dt).eps) * n * np.max(np.abs(true))


@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("name", sorted(PROPERTY_CODECS))
def test_empty_leaves_and_one_replica_under_check_vma(name, n):
    """An empty leaf beside a real one, on 8 replicas and on a mesh of one device, under
    ``check_vma=True``: ``all_reduce`` returns the empty leaf empty and the real one typed
    replicated (``out_specs=P()``); an empty top-k payload sends nothing (XLA refused
    the empty gather), and a one-replica sum skipped its exchange and stayed varying."""
    codec, bound = PROPERTY_CODECS[name]
    mesh = _compat.make_mesh((n,), ("r",), devices=jax.devices()[:n])
    x = {"e": jnp.zeros((n, 0)), "w": jax.random.normal(jax.random.PRNGKey(n), (n * 4, 96))}
    out = run(lambda t: cc.all_reduce(t, "r", codec, key=jax.random.PRNGKey(1), mean=True), mesh,
              P("r"), P(), x)
    assert out["e"].shape == (1, 0)
    true = np.asarray(x["w"]).reshape(n, 4, 96).mean(0)
    err = np.max(np.abs(np.asarray(out["w"], np.float32) - true)) / np.max(np.abs(true))
    limit = 1e-2 if name == "lossless" else 1e-6 if bound is None else bound  # lossless: of bf16 values
    assert err <= limit, err
