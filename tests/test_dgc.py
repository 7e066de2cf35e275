"""Deep Gradient Compression: against a NumPy reference on 8 replicas, NaN handling, bytes,
construction errors and convergence on the non-i.i.d. task."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.collectives._common import gathered_width
from commjax.compressors.exact import identity
from commjax.compressors.sparse import top_k
from commjax.layout import shard_state, state_specs
from commjax.optimizers.dgc import DGCState, dgc, dgc_ratios
from commjax.testing import noniid_classification, train
from commjax.transform import compressed_mean

N = 8


# ------------------------------------------------------------------------ construction


@pytest.mark.parametrize("kwargs,match", [
    (dict(ratio=0.0), r"`ratio` must be a number in \(0.0, 1.0\]"),
    (dict(ratio=1.01), r"`ratio`"),
    (dict(momentum=1.0), r"`momentum` must be a number in \[0.0, 1.0\)"),
    (dict(momentum=-0.1), r"`momentum`"),
    (dict(warmup_steps=-1), r"`warmup_steps` must be an integer >= 0"),
    (dict(warmup_steps=2.5), r"`warmup_steps`"),
    (dict(warmup_ratios=(0.5, 0.0)), r"`warmup_ratios` must be a number in \(0.0, 1.0\]"),
    (dict(warmup_ratios=0.5), r"`warmup_ratios` must be None or a sequence"),
    (dict(clip_norm=0.0), r"`clip_norm`"),
    (dict(weight_decay=-1e-4), r"`weight_decay`"),
    (dict(chunk_size=70000), r"`chunk_size`.*65536"),
    (dict(scope="layer"), r"`scope` must be one of 'leaf', 'model'"),
    (dict(min_compress_size=0), r"`min_compress_size`"),
])
def test_bad_arguments_rejected_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dgc(0.1, **kwargs)


def test_default_warmup_is_the_papers_exponential_ramp():
    r = dgc_ratios(0.001)
    assert r == (0.25, 0.0625, 0.015625, 0.00390625, 0.001)  # 75% ... 99.6%, then 99.9%
    assert dgc_ratios(0.01) == (0.25, 0.0625, 0.015625, 0.01)
    assert dgc_ratios(0.3) == (0.3,)
    assert dgc_ratios(0.01, (0.5,)) == (0.5, 0.01)


def test_replicated_gradient_errors(mesh):
    params = {"w": jnp.ones((16, 16))}
    tx = dgc(0.1, ratio=0.1, min_compress_size=16)
    # Under check_vma=True the gradient of replicated parameters is already summed.
    state = shard_state(tx.init(params), mesh, "data")
    specs = state_specs(state, "data")

    def step(p, s):
        g = jax.grad(lambda q: jnp.sum(q["w"] ** 2))(p)
        return tx.update(g, s, p)

    f = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
    with pytest.raises(ValueError, match=r"cj.vary\(params"):
        f.lower(params, state)


# --------------------------------------------------------------- NumPy reference, N = 8


def _topk_mask(v, k):
    mask = np.zeros(v.shape, bool)
    mask[np.argsort(-np.abs(v), kind="stable")[:k]] = True
    return mask


def _reference(grads, params, *, lr, mom, ratios, clip, wd, nesterov, compressed, exact):
    """DGC on N replicas in NumPy (float64), straight from the paper's algorithm."""
    n_rep = grads[0][exact[0]].shape[0]
    u = {k: np.zeros((n_rep, params[k].size)) for k in compressed}
    v = {k: np.zeros((n_rep, params[k].size)) for k in compressed}
    du = {k: np.zeros(params[k].size) for k in exact}
    steps = []
    for t, gt in enumerate(grads):
        g = {k: gt[k].reshape(n_rep, -1).astype(np.float64) + wd * params[k].reshape(-1) for k in gt}
        if clip is not None:
            thr = clip / math.sqrt(n_rep)
            norm = np.sqrt(sum(np.sum(g[k] ** 2, axis=1) for k in g))
            scale = np.where(norm > thr, thr / norm, 1.0)
            g = {k: g[k] * scale[:, None] for k in g}
        upd = {}
        for k in exact:
            gm = g[k].mean(0)
            if nesterov:
                du[k] = mom * (du[k] + gm)
                upd[k] = -lr(t) * (du[k] + gm)
            else:
                du[k] = mom * du[k] + gm
                upd[k] = -lr(t) * du[k]
        for k in compressed:
            if nesterov:
                u[k] = mom * (u[k] + g[k])
                v[k] = v[k] + u[k] + g[k]
            else:
                u[k] = mom * u[k] + g[k]
                v[k] = v[k] + u[k]
            size = v[k].shape[1]
            kk = min(size, max(1, math.ceil(round(ratios[t] * size, 9))))
            sent = np.zeros_like(v[k])
            for r in range(n_rep):
                m = _topk_mask(v[k][r], kk)
                sent[r][m] = v[k][r][m]
                v[k][r][m] = 0.0
                u[k][r][m] = 0.0
            upd[k] = -lr(t) * sent.mean(0)
        steps.append((upd, {k: u[k].copy() for k in compressed}, {k: v[k].copy() for k in compressed}))
    return steps


def _run(tx, mesh, params, grads_seq):
    """Per-replica grads (leading axis N) for each step -> (updates, states) per step."""
    state = shard_state(tx.init(params), mesh, "data")
    specs = state_specs(state, "data")

    def step(p, g, s):
        out, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
        return jax.tree_util.tree_map(lambda a: a[None], out), s

    f = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), specs),
                                  out_specs=(P("data"), specs)))
    outs, states = [], []
    for g in grads_seq:
        out, state = f(params, jax.device_put(g, NamedSharding(mesh, P("data"))), state)
        jax.block_until_ready(out)
        outs.append(jax.device_get(out))
        states.append(jax.device_get(state))
    return outs, states


def _problem(steps, seed=0):
    rng = np.random.default_rng(seed)
    params = {"b": rng.standard_normal(24).astype(np.float32),
              "v": rng.standard_normal((40, 20)).astype(np.float32),
              "w": rng.standard_normal((16, 32)).astype(np.float32)}
    grads = [{k: rng.standard_normal((N,) + p.shape).astype(np.float32) * (1 + 0.5 * np.arange(N)).reshape(
        (N,) + (1,) * p.ndim).astype(np.float32) for k, p in params.items()} for _ in range(steps)]
    return params, grads


@pytest.mark.parametrize("nesterov", [False, True])
def test_matches_numpy_reference_on_8_replicas(mesh, nesterov):
    steps = 7
    params, grads = _problem(steps)
    sched = optax.linear_schedule(0.2, 0.05, steps)
    kw = dict(momentum=0.8, ratio=0.05, warmup_steps=4, warmup_ratios=(0.5, 0.2), clip_norm=6.0,
              weight_decay=1e-2, nesterov=nesterov, min_compress_size=64)
    tx = dgc(sched, **kw)
    outs, states = _run(tx, mesh, params, grads)
    ratios = [0.5, 0.5, 0.2, 0.2, 0.05, 0.05, 0.05]
    ref = _reference(grads, params, lr=lambda t: float(sched(t)), mom=0.8, ratios=ratios, clip=6.0,
                     wd=1e-2, nesterov=nesterov, compressed=["v", "w"], exact=["b"])
    for t in range(steps):
        upd, u, v = ref[t]
        for k in params:
            got = outs[t][k]
            assert np.all(got == got[:1]), f"replicas disagree on {k} at step {t}"
            np.testing.assert_allclose(got[0], upd[k].reshape(params[k].shape), rtol=2e-5, atol=1e-6)
        mom = states[t].momentum.reshape(N, -1)
        acc = states[t].accumulation.reshape(N, -1)
        np.testing.assert_allclose(mom, np.concatenate([u["v"], u["w"]], 1), rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(acc, np.concatenate([v["v"], v["w"]], 1), rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(states[t].metrics["ratio"]), ratios[t])
        kept = sum(max(1, math.ceil(round(ratios[t] * s, 9))) for s in (800, 512))
        np.testing.assert_allclose(np.asarray(states[t].metrics["density"]), kept / 1312, rtol=1e-6)
    assert int(states[-1].count) == steps
    # Momentum factor masking: a sent entry has zero momentum and zero accumulation.
    acc = states[-1].accumulation.reshape(N, -1)
    assert np.all(states[-1].momentum.reshape(N, -1)[acc == 0] == 0)


@pytest.mark.exact_codegen
def test_pmap_and_shard_map_agree():
    task = noniid_classification(N, examples_per_replica=64)
    tx = dgc(0.2, ratio=0.05, min_compress_size=256)
    a = train(tx, task, 3, log_every=3)
    b = train(tx, task, 3, log_every=3, use_pmap=True)
    assert a.replicas_identical and b.replicas_identical
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
    assert isinstance(b.opt_state, DGCState)


def test_plan_counts_k_entries_per_leaf_and_the_flag():
    """K = ceil(ratio * size) per compressed leaf, 8 bytes each through the all-gather (the
    row padded to whole 128-word tiles); the bias and one NaN flag in the exact all-reduce
    (the compiled step sends the plan: tests/test_contract.py)."""
    params = {"w0": jax.ShapeDtypeStruct((512, 256), jnp.float32),
              "w1": jax.ShapeDtypeStruct((256, 300), jnp.float32),
              "b": jax.ShapeDtypeStruct((300,), jnp.float32)}
    plan = cj.communication_plan(dgc(0.1, ratio=0.01), params, N)
    k = math.ceil(0.01 * 512 * 256) + math.ceil(0.01 * 256 * 300)
    assert plan.bytes_of("top-k") == pytest.approx((N - 1) * 4 * gathered_width(2 * k, N))
    assert gathered_width(2 * k, N) == 4224  # 2 * 2079 words, padded to 33 tiles
    assert plan.bytes_of("exact bucket") == pytest.approx(2 * (N - 1) / N * 4 * 301)  # bias + NaN flag
    assert plan.compression_ratio > 10


# ---------------------------------------------------------------------- convergence

STEPS, LR, MOMENTUM, MIN_COMPRESS = 100, 0.3, 0.5, 256


def test_dgc_converges_near_exact_mean_and_beats_topk_without_error_feedback():
    task = noniid_classification(N)

    def sgd_with(comp, ef=True):
        return optax.chain(compressed_mean(comp, "data", error_feedback=ef, min_compress_size=MIN_COMPRESS),
                           optax.sgd(LR, momentum=MOMENTUM))

    exact = train(sgd_with(identity()), task, STEPS, log_every=STEPS)
    noef = train(sgd_with(top_k(0.01), ef=False), task, STEPS, log_every=STEPS)
    res = train(dgc(LR, momentum=MOMENTUM, ratio=0.01, min_compress_size=MIN_COMPRESS), task, STEPS,
                log_every=STEPS)
    for r in (exact, noef, res):
        assert r.replicas_identical
    gap = (res.final_loss - exact.final_loss) / exact.final_loss
    assert gap < 0.20, (res.final_loss, exact.final_loss)
    assert res.final_loss < noef.final_loss - 0.1
    assert res.final_loss < task.global_loss(task.params) - 0.5
    density = np.asarray(res.opt_state.metrics["density"])
    assert np.all(density > 0) and np.all(density <= 0.011)
