"""cj.sync_in_backward: the compressed exchange as the VJP of each bucket of parameters.

Against compressed_mean after the backward pass: the same means bit for bit with one
bucket, the same state; several buckets: means within the codec's bound, replicas
identical; under check_vma True and False; inside lax.scan over layers and jax.checkpoint;
the state through steps (error feedback carried)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax import _hlo_traffic as hlo

AX = "data"
N = 8


def _model():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return {"w1": jax.random.normal(k[0], (32, 64)) / 6, "b1": jnp.zeros((64,)),
            "w2": jax.random.normal(k[1], (64, 256)) / 8, "w3": jax.random.normal(k[2], (256, 16)) / 16}


def _loss(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["w2"])
    return jnp.mean((h @ p["w3"]) ** 2)


def _data():
    return jax.random.normal(jax.random.PRNGKey(1), (N * 4, 32))


def _compiled(mesh, body, state, check_vma):
    """``body`` jitted under ``shard_map`` once, for every step it runs (built anew per
    step, it was traced and compiled again each time)."""
    specs = cj.state_specs(state, AX)
    return jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(AX)),
                                     out_specs=(P(AX), specs), check_vma=check_vma))


def _steps(sync, mesh, check_vma, steps=3, after=False):
    """``steps`` exchanges of the gradient, in the backward pass or after it."""
    params, x = _model(), _data()
    tx = sync.as_transform()
    state = cj.init_sharded(tx, params, mesh, AX)

    def body(p, s, xb):
        if after:
            g = jax.grad(_loss)(cj.vary(p, AX), xb)
            g, s = tx.update(g, s)
        else:
            (_, g), s = sync.value_and_grad(_loss)(p, s, xb)
        return jax.tree_util.tree_map(lambda a: a[None], g), s

    f, xs = _compiled(mesh, body, state, check_vma), jax.device_put(x, NamedSharding(mesh, P(AX)))
    outs = []
    for _ in range(steps):
        g, state = f(params, state, xs)
        outs.append(g)
    return outs, state


@pytest.mark.parametrize("codec,check_vma", [(cj.quantize(8), False), (cj.quantize(8), True),
                                             (cj.sign(), True), (cj.powersgd(2), True)],
                         ids=["q8-novma", "q8", "sign", "powersgd"])
def test_one_bucket_is_compressed_mean_after_backward(mesh, codec, check_vma):
    sync = cj.sync_in_backward(codec, AX, bucket_bytes=1 << 30)
    got, s1 = _steps(sync, mesh, check_vma, steps=2)
    want, s2 = _steps(sync, mesh, check_vma, steps=2, after=True)
    for a, b in zip(got, want):
        for k in a:
            out = np.asarray(a[k])
            np.testing.assert_array_equal(out, np.asarray(b[k]), err_msg=k)
            for r in range(1, N):
                np.testing.assert_array_equal(out[r], out[0], err_msg=k)
    for x, y in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(s2)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_several_buckets_stay_within_the_codec_bound(mesh):
    sync = cj.sync_in_backward(cj.quantize(8, stochastic=False), AX, bucket_bytes=20_000)
    assert len(sync.buckets(_model())) >= 3
    got, state = _steps(sync, mesh, True, steps=1)
    params, x = _model(), _data()
    exact = jax.vmap(lambda xb: jax.grad(_loss)(params, xb))(x.reshape(N, -1, 32))
    for k, v in got[0].items():
        mean = np.asarray(exact[k]).mean(0)
        out = np.asarray(v)
        np.testing.assert_allclose(out[0], mean, atol=0.02 * np.abs(np.asarray(exact[k])).max() + 1e-7)
        for r in range(1, N):
            np.testing.assert_array_equal(out[r], out[0])
    assert all(int(s.count) == 1 for s in state)


def _reaches(module, comp, src: str, dst: str) -> bool:
    """Whether instruction ``dst`` of ``comp`` depends on ``src``."""
    ops = {i.name: i.operands for i in module.computations[comp]}
    seen, todo = set(), [dst]
    while todo:
        n = todo.pop()
        if n == src:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(ops.get(n, ()))
    return False


@pytest.mark.parametrize("chained", [True, False])
def test_buckets_exchange_in_backward_order_one_after_another(mesh, chained):
    """The buckets go in the order the backward pass completes them (the latest first use
    first), and each bucket's exchange waits for the mean of the one before it: in the
    compiled program every all-to-all but the first depends on an earlier bucket's
    all-gather, so XLA cannot merge the buckets' collectives into one after the backward
    pass. Without an order, none does (the control)."""
    params, x = _model(), _data()
    sync = cj.sync_in_backward(cj.sign(), AX, bucket_bytes=1)  # one bucket per leaf
    leaves = sorted(params)  # tree order: b1, w1, w2, w3
    assert leaves == ["b1", "w1", "w2", "w3"]
    order = sync.exchange_order(_loss, params, x)
    assert [leaves[k] for k in order] == ["w3", "w2", "b1", "w1"]
    with pytest.raises(ValueError, match="order"):
        sync.attach(params, sync.carrier(sync.init(params)), sync.init(params), order=[0, 1])
    state = cj.init_sharded(sync.as_transform(), params, mesh, AX)

    def body(p, s, xb):
        def inner(p, carrier):
            return _loss(sync.attach(p, carrier, s, order=order if chained else None), xb)
        g, c = jax.grad(inner, argnums=(0, 1))(p, sync.carrier(s))
        return jax.tree_util.tree_map(lambda a: a[None], g), sync.restore(s, c)

    specs = cj.state_specs(state, AX)
    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(AX)),
                                  out_specs=(P(AX), specs), check_vma=True))
    module = hlo.parse(f.lower(params, state, jax.device_put(x, NamedSharding(mesh, P(AX)))).compile().as_text())
    entry = module.computations[module.entry]
    gathers = [i.name for i in entry if i.opcode.startswith("all-gather") and not i.opcode.endswith("-done")]
    scatters = [i.name for i in entry if i.opcode.startswith("all-to-all") and not i.opcode.endswith("-done")]
    assert len(scatters) == len(gathers) == 3  # b1 (64 values) goes exact
    waiting = sum(any(_reaches(module, module.entry, g, a) for g in gathers) for a in scatters)
    assert waiting == (2 if chained else 0)


def test_inside_scan_and_checkpoint(mesh):
    """Layers under lax.scan with jax.checkpoint: each layer slice attached inside the body."""
    layers = jax.random.normal(jax.random.PRNGKey(3), (4, 64, 64)) / 8
    x = jax.random.normal(jax.random.PRNGKey(4), (N * 2, 64))
    sync = cj.sync_in_backward(cj.quantize(8, stochastic=False), AX, bucket_bytes=1 << 30)
    one = cj.init_sharded(sync.as_transform(), layers[0], mesh, AX)
    state = jax.tree_util.tree_map(lambda a: jnp.stack([a] * 4), one)

    def body(w, s, xb):
        def loss(w, carriers):
            @jax.checkpoint
            def layer(h, ws):
                w_l, c_l, s_l = ws
                return jnp.tanh(h @ sync.attach(w_l, c_l, s_l)), None
            h, _ = jax.lax.scan(layer, xb, (w, carriers, s))
            return jnp.mean(h ** 2)

        carriers = jax.vmap(sync.carrier)(s)
        g, cg = jax.grad(loss, argnums=(0, 1))(cj.vary(w, AX), carriers)
        return g[None], jax.vmap(sync.restore)(s, cg)

    specs = jax.tree_util.tree_map(lambda sp: P(None, *sp) if len(sp) else P(), cj.state_specs(one, AX),
                                   is_leaf=lambda v: isinstance(v, P))
    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(AX)),
                                  out_specs=(P(AX), specs), check_vma=False))
    g, new = f(layers, state, jax.device_put(x, NamedSharding(mesh, P(AX))))
    g = np.asarray(g)
    for r in range(1, N):
        np.testing.assert_array_equal(g[r], g[0])
    exact = jax.vmap(lambda xb: jax.grad(lambda w: jnp.mean(jax.lax.scan(
        lambda h, w_l: (jnp.tanh(h @ w_l), None), xb, w)[0] ** 2))(layers))(x.reshape(N, -1, 64))
    mean = np.asarray(exact).mean(0)
    np.testing.assert_allclose(g[0], mean, atol=0.02 * np.abs(np.asarray(exact)).max())


def test_bad_arguments():
    with pytest.raises(TypeError, match="compressor"):
        cj.sync_in_backward("int8")
    with pytest.raises(ValueError, match="bucket_bytes"):
        cj.sync_in_backward(cj.quantize(8), bucket_bytes=0)
    with pytest.raises(ValueError, match="reducer"):
        cj.sync_in_backward(cj.quantize(8), reducer="bogus")


def test_data_parallel_with_sync_trains_like_the_transform(mesh):
    """cj.data_parallel(..., sync=...) against the same exchange after the backward pass:
    the same parameters after three steps (one bucket), replicas identical, bytes from the
    compiled step equal to the plan of the exchange."""
    params, x = _model(), _data()
    sync = cj.sync_in_backward(cj.quantize(8), AX, bucket_bytes=1 << 30)
    dp = cj.data_parallel(_loss, optax.sgd(0.1), mesh, sync=sync)
    ref = cj.data_parallel(_loss, optax.chain(sync.as_transform(), optax.sgd(0.1)), mesh)
    s1, s2 = dp.init(params), ref.init(params)
    for _ in range(3):
        s1, l1 = dp.step(s1, x)
        s2, l2 = ref.step(s2, x)
    for a, b in zip(jax.tree_util.tree_leaves(s1.params), jax.tree_util.tree_leaves(s2.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert dp.replicas_identical(s1)
    want = sum(cj.communication_plan(cj.compressed_mean(cj.quantize(8), AX), [v for v in
               jax.tree_util.tree_leaves(params)], N).compiled_bytes for _ in [0])
    assert dp.collectives(s1, x).total_ring_bytes == pytest.approx(want)


def test_accumulation_exchanges_once_on_the_last_micro_step(mesh):
    """Two micro-steps without an exchange, then one with the accumulated gradient as
    ``pending``: the mean of the sum, bit for bit what the exchange after backward gives
    for the summed gradient; the state advanced once."""
    params = _model()
    x = jax.random.normal(jax.random.PRNGKey(5), (N * 6, 32))
    sync = cj.sync_in_backward(cj.quantize(8), AX, bucket_bytes=1 << 30)
    tx = sync.as_transform()
    state = cj.init_sharded(tx, params, mesh, AX)

    def body(p, s, xb):
        xs = jnp.split(xb, 3, axis=0)
        (_, g0), s0 = sync.value_and_grad(_loss)(p, s, xs[0], exchange=False)
        (_, g1), s1 = sync.value_and_grad(_loss)(p, s0, xs[1], exchange=False)
        acc = jax.tree_util.tree_map(jnp.add, g0, g1)
        (_, g), s2 = sync.value_and_grad(_loss)(p, s1, xs[2], pending=acc)
        gl = jax.grad(_loss)(cj.vary(p, AX), xs[2])
        want, _ = tx.update(jax.tree_util.tree_map(jnp.add, acc, gl), s)
        same = jnp.all(jnp.stack([jnp.all(a == b) for a, b in zip(jax.tree_util.tree_leaves(g),
                                                                    jax.tree_util.tree_leaves(want))]))
        return same[None], s2

    specs = cj.state_specs(state, AX)
    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(AX)),
                                  out_specs=(P(AX), specs), check_vma=False))
    same, new = f(params, state, jax.device_put(x, NamedSharding(mesh, P(AX))))
    assert bool(np.all(np.asarray(same)))
    assert all(int(s.count) == 1 for s in new)
