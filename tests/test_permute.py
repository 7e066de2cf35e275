"""commjax.collectives.ppermute: exactness of the identity, codecs, VJP, lazy error
propagation, the delta modes, bytes against the HLO, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax import collectives as cc
from commjax.collectives.permute import permute_bytes

N = 8
RING = [(i, (i + 1) % N) for i in range(N)]
CHAIN = [(i, i + 1) for i in range(N - 1)]  # a pipeline: replica 0 receives nothing


def run(fn, mesh, *args, out=P("data"), check_vma=True):
    return jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=(P("data"),) * len(args), out_specs=out,
                                     check_vma=check_vma))(*args)


def shifted(a, perm):
    """The host reference of a permute of per-replica rows ``a[r]``."""
    out = np.zeros_like(a)
    for s, d in perm:
        out[d] = a[s]
    return out


@pytest.mark.parametrize("check_vma", [True, False])
def test_identity_is_lax_ppermute_bit_for_bit(mesh, check_vma):
    x = jax.random.normal(jax.random.PRNGKey(0), (N * 3, 40))
    ints = jnp.arange(N * 2, dtype=jnp.int32)

    def both(v, i, send):
        y = send({"x": v, "i": i})
        g = jax.grad(lambda u: jnp.sum(jnp.sin(send({"x": u, "i": i})["x"])))(v)
        return y["x"], y["i"], g

    ours = run(lambda v, i: both(v, i, lambda t: cc.ppermute(t, "data", CHAIN, cj.identity(),
                                                               grad_codec=cj.identity())),
               mesh, x, ints, out=(P("data"),) * 3, check_vma=check_vma)
    ref = run(lambda v, i: both(v, i, lambda t: lax.ppermute(t, "data", CHAIN)),
              mesh, x, ints, out=(P("data"),) * 3, check_vma=check_vma)
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(a, b)


def test_codec_forward_backward_and_hlo_bytes(mesh):
    """q8 forward, q4 backward: each value is its sender's decoded payload; the int leaf
    travels exactly; one collective-permute of u32 words each way, bytes == plan."""
    q8, q4 = cj.quantize(8, stochastic=False), cj.quantize(4, stochastic=False, block_size=64)
    x = jax.random.normal(jax.random.PRNGKey(1), (N * 4, 70))
    ids = jnp.arange(N * 2, dtype=jnp.int32)

    def fn(v, i):
        send = lambda u: cc.ppermute({"x": u, "i": i}, "data", CHAIN, q8, grad_codec=q4)  # noqa: E731
        y = send(v)
        g = jax.grad(lambda u: jnp.sum(jnp.cos(u[0, 0]) * send(u)["x"]))(v)
        return y["x"], y["i"], g

    f = jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=(P("data"), P("data")),
                                  out_specs=(P("data"),) * 3))
    y, i, g = f(x, ids)
    xs = np.asarray(x).reshape(N, 4, 70)
    ref = shifted(np.stack([np.asarray(q8.roundtrip(jnp.asarray(r))) for r in xs]), CHAIN)
    np.testing.assert_allclose(np.asarray(y).reshape(N, 4, 70), ref, rtol=2e-7, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(i).reshape(N, 2), shifted(np.asarray(ids).reshape(N, 2), CHAIN))
    assert float(np.max(np.abs(np.asarray(g)))) > 0
    rep = cj.collective_bytes(f, x, ids)
    permutes = rep.of_kind("collective-permute")
    coded = [c for c in permutes if c.dtypes == ("u32",)]
    assert len(coded) == 2, rep.table()
    local = {"x": jax.ShapeDtypeStruct((4, 70), jnp.float32), "i": jax.ShapeDtypeStruct((2,), jnp.int32)}
    assert sum(c.ring_bytes for c in permutes) == pytest.approx(
        permute_bytes(local, N, q8) + permute_bytes(local, N, q4) - 8.0)  # ints go forward only


def test_powersgd_sends_empty_and_small_leaves_exactly(mesh):
    """PowerSGD factors only the matrices it shrinks: an empty leaf (no rank to take)
    and a vector travel exactly beside a factored matrix, which was refused for the
    empty one (a rank-0 factor)."""
    x = {"m": jax.random.normal(jax.random.PRNGKey(1), (N * 32, 32)), "e": jnp.zeros((N, 0)),
         "v": jnp.arange(N * 5, dtype=jnp.float32)}
    y = run(lambda t: cc.ppermute(t, "data", RING, cj.powersgd(rank=2)), mesh, x)
    assert y["e"].shape == (N, 0)
    np.testing.assert_array_equal(np.asarray(y["v"]).reshape(N, 5), shifted(np.asarray(x["v"]).reshape(N, 5), RING))
    assert not cj.powersgd(rank=2).accepts((4, 0)) and not cj.powersgd(rank=2).accepts((0, 0))
    got, sent = np.asarray(y["m"]).reshape(N, 32, 32), shifted(np.asarray(x["m"]).reshape(N, 32, 32), RING)
    assert np.all(np.isfinite(got)) and not np.array_equal(got, sent)  # factored: rank 2, not exact


def test_lazy_error_propagation_keeps_what_was_not_sent(mesh):
    """PowerSGD backward with a carried residual: what the source receives plus the
    residual left at the sender is the cotangent plus the residual it started from."""
    psgd = cj.powersgd(rank=2)
    x = jax.random.normal(jax.random.PRNGKey(2), (N * 32, 24))
    e0 = 0.1 * jax.random.normal(jax.random.PRNGKey(3), (N * 32, 24))

    def fn(v, e):
        def loss(u, tok):
            y, tok = cc.ppermute(u, "data", CHAIN, grad_codec=psgd, grad_residual=tok)
            return jnp.sum(jnp.sin(y)) + cc.inject_residual(tok, e)
        g, r = jax.grad(loss, argnums=(0, 1))(v, jnp.zeros_like(v))
        ct = jnp.cos(lax.ppermute(v, "data", CHAIN))
        return g, r, ct

    g, r, ct = run(fn, mesh, x, e0, out=(P("data"),) * 3)
    g, r, ct, e0 = (np.asarray(a).reshape(N, 32, 24) for a in (g, r, ct, e0))
    for d in range(1, N):  # the forward destinations send the cotangents back
        np.testing.assert_allclose(g[d - 1] + r[d], ct[d] + e0[d], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(r[0], 0)  # replica 0 received nothing: it sends nothing back
    assert np.linalg.norm(r[1:]) > 0.01 * np.linalg.norm(ct[1:])  # PowerSGD dropped something


@pytest.mark.parametrize("mode", ["sample", "slot"])
def test_delta_modes_keep_sender_and_receiver_references_equal(mesh, mode):
    """Three calls on a batch that comes back: the references of both ends stay bit-equal,
    and in 'sample' mode a sample's first visit goes exact and its next visit is close."""
    q4 = cj.quantize(4, stochastic=False, block_size=64)
    x = jax.random.normal(jax.random.PRNGKey(4), (N * 4, 64))

    def fn(v):
        st = cc.delta_state(v, mode, num_samples=8)
        ys = []
        for t in range(3):
            ids = jnp.arange(4, dtype=jnp.int32) + 4 * (t == 1)
            y, st = cc.ppermute(v + 0.01 * t, "data", RING, q4, delta=mode, state=st,
                                sample_ids=ids if mode == "sample" else None)
            ys.append(y)
        return jnp.stack(ys)[None], jax.tree_util.tree_map(lambda a: a[None], st)

    ys, st = run(fn, mesh, x, out=(P("data"), P("data")))
    st = jax.tree_util.tree_map(np.asarray, st)
    np.testing.assert_array_equal(np.roll(st.sent, 1, axis=0), st.received)
    ys = np.asarray(ys).reshape(N, 3, 4, 64)
    ref = np.roll(np.asarray(x).reshape(N, 4, 64), 1, axis=0)
    err = [np.max(np.abs(ys[:, t] - (ref + 0.01 * t))) for t in range(3)]
    if mode == "sample":
        assert err[0] == 0 and err[1] == 0  # first visits: exact
        assert 0 < err[2] < 0.01  # the third call's delta is 0.02: 4 bits of it
        assert st.sent_seen[0].tolist() == [True] * 8
    else:
        assert all(e < 0.5 for e in err)


def test_clipped_deltas_carry_the_clipped_excess_back(mesh):
    """The same value sent again and again (slot mode, the last reconstruction as the
    reference): a 2-bit code clipped at 1.22 RMS misses less of a Gaussian value on its
    first send than the absmax scale (0.43 against 0.71 of its norm), what it cuts off
    comes back with the next deltas (the error shrinks every call), and both ends'
    references stay bit-equal. (Later sends of an unchanged value are no longer
    Gaussian: there the absmax scale converges faster, 0.02 against 0.05 after six.)
    The midrise grid clipped at 1.49 RMS misses less again (0.34), with the same bytes."""
    x = jax.random.normal(jax.random.PRNGKey(6), (N * 4, 64))
    ref = np.roll(np.asarray(x).reshape(N, 4, 64), 1, axis=0)

    def errors(codec):
        def fn(v):
            st = cc.delta_state(v, "slot")
            ys = []
            for _ in range(6):
                y, st = cc.ppermute(v, "data", RING, codec, delta="slot", state=st)
                ys.append(y)
            return jnp.stack(ys)[None], jax.tree_util.tree_map(lambda a: a[None], st)

        ys, st = run(fn, mesh, x, out=(P("data"), P("data")))
        st = jax.tree_util.tree_map(np.asarray, st)
        np.testing.assert_array_equal(np.roll(st.sent, 1, axis=0), st.received)
        ys = np.asarray(ys).reshape(N, 6, 4, 64)
        return np.array([np.linalg.norm(ys[:, t] - ref) for t in range(6)]) / np.linalg.norm(ref)

    clipped = errors(cj.quantize(2, stochastic=False, block_size=64, clip_rms=1.22))
    plain = errors(cj.quantize(2, stochastic=False, block_size=64))
    midrise = errors(cj.quantize(2, stochastic=False, block_size=64, clip_rms=1.49, midrise=True))
    assert clipped[0] < 0.7 * plain[0], (clipped, plain)
    assert np.all(np.diff(clipped) < 0) and clipped[-1] < 0.1, clipped
    assert midrise[0] < 0.85 * clipped[0] and np.all(np.diff(midrise) < 0), (midrise, clipped)


def test_delta_slot_rate_makes_the_reference_a_running_mean(mesh):
    """delta_rate=r: the receiver reads m + decode (exactly the sent value with an exact
    codec) and both ends move m by r of the decoded delta, bit-equal at the two ends."""
    q2 = cj.quantize(2, stochastic=False, block_size=64)
    x = jax.random.normal(jax.random.PRNGKey(5), (N * 4, 64))
    rate = 0.25

    def fn(v, codec):
        st = cc.delta_state(v, "slot")
        ys = []
        for t in range(3):
            y, st = cc.ppermute(v * (1 + t), "data", RING, codec, delta="slot", state=st,
                                delta_rate=rate)
            ys.append(y)
        return jnp.stack(ys)[None], jax.tree_util.tree_map(lambda a: a[None], st)

    ref = np.roll(np.asarray(x).reshape(N, 4, 64), 1, axis=0)
    ys, st = run(lambda v: fn(v, None), mesh, x, out=(P("data"), P("data")))
    ys = np.asarray(ys).reshape(N, 3, 4, 64)
    m = np.zeros_like(ref)
    for t in range(3):
        np.testing.assert_allclose(ys[:, t], ref * (1 + t), rtol=1e-6, atol=1e-6)
        m = m + rate * (ref * (1 + t) - m)
    np.testing.assert_allclose(np.asarray(st.received), m, rtol=1e-6, atol=1e-6)
    ys, st = run(lambda v: fn(v, q2), mesh, x, out=(P("data"), P("data")))
    st = jax.tree_util.tree_map(np.asarray, st)
    np.testing.assert_array_equal(np.roll(st.sent, 1, axis=0), st.received)
    ys = np.asarray(ys).reshape(N, 3, 4, 64)
    # The running mean removes the part every call shares, so the last send is closer
    # than a 2-bit code of the whole value would be.
    plain = np.stack([np.asarray(q2.roundtrip(jnp.asarray(r * 3))) for r in ref])
    assert np.linalg.norm(ys[:, 2] - 3 * ref) < np.linalg.norm(plain - 3 * ref)


def test_delta_sample_first_visit_is_decided_by_the_senders(mesh):
    """A replica that sends nothing (the end of a chain) must not force the senders'
    seen samples to go exact because of ids of its own it has not sent."""
    q4 = cj.quantize(4, stochastic=False, block_size=64)
    x = jax.random.normal(jax.random.PRNGKey(6), (N * 4, 64))

    def fn(v):
        st = cc.delta_state(v, "sample", num_samples=8)
        ids = jnp.arange(4, dtype=jnp.int32)
        _, st = cc.ppermute(v, "data", CHAIN, q4, delta="sample", state=st, sample_ids=ids)
        last = lax.axis_index("data") == N - 1
        y, st = cc.ppermute(v + 0.01, "data", CHAIN, q4, delta="sample", state=st,
                            sample_ids=jnp.where(last, ids + 4, ids))
        return y

    y = np.asarray(run(fn, mesh, x)).reshape(N, 4, 64)
    ref = shifted(np.asarray(x).reshape(N, 4, 64) + 0.01, CHAIN)
    err = np.max(np.abs(y[1:] - ref[1:]))
    assert 0 < err < 0.01  # the coded branch: 4 bits of a 0.01 delta, not the exact send


def test_delta_sample_bytes_equal_the_plan(mesh):
    q4 = cj.quantize(4, stochastic=False, block_size=64)

    def fn(v, st):
        st = jax.tree_util.tree_map(lambda a: a[0], st)
        y, st = cc.ppermute(v, "data", RING, q4, delta="sample", state=st,
                            sample_ids=jnp.arange(4, dtype=jnp.int32))
        return y, jax.tree_util.tree_map(lambda a: a[None], st)

    local = jnp.zeros((4, 64))
    st = jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), cc.delta_state(local, num_samples=8))
    f = jax.jit(_compat.shard_map(fn, mesh=mesh, in_specs=(P("data"), P("data")),
                                  out_specs=(P("data"), P("data"))))
    rep = cj.collective_bytes(f, jnp.zeros((N * 4, 64)), st)
    # The coded branch (u32 words) and everything outside the conditional: the steady state.
    steady = sum(c.ring_bytes for c in rep if not c.in_conditional or c.dtypes == ("u32",))
    assert steady == pytest.approx(permute_bytes(local, N, q4, delta="sample")), rep.table()


def test_errors_name_the_fix(mesh):
    # A call outside shard_map (the unbound axis) is checked in tests/test_contract.py.
    x = jnp.zeros((N * 2, 8))

    def call(**kw):
        return run(lambda v: cc.ppermute(v, "data", **kw), mesh, x)

    with pytest.raises(ValueError, match="not a permutation"):
        call(perm=[(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="outside"):
        call(perm=[(0, 9)])
    with pytest.raises(ValueError, match="cannot travel through a permute"):
        call(perm=RING, codec=cj.random_k(0.1))
    with pytest.raises(ValueError, match="cannot travel through a permute"):
        call(perm=RING, grad_codec=cj.lossless(block_size=64))
    with pytest.raises(ValueError, match="sample_ids"):
        call(perm=RING, codec=cj.quantize(8), delta="sample",
             state=cc.delta_state(jnp.zeros((2, 8)), num_samples=4))
    with pytest.raises(ValueError, match="delta_state"):
        call(perm=RING, delta="slot")
    with pytest.raises(ValueError, match="num_samples"):
        cc.delta_state(x, "sample")
    with pytest.raises(ValueError, match="delta_rate"):
        call(perm=RING, delta="slot", state=cc.delta_state(jnp.zeros((2, 8)), "slot"), delta_rate=0.0)
    with pytest.raises(ValueError, match="delta_rate"):
        call(perm=RING, codec=cj.quantize(8), delta="sample", delta_rate=0.5,
             state=cc.delta_state(jnp.zeros((2, 8)), num_samples=4), sample_ids=jnp.arange(2))
