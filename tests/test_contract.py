"""The contract every communicating transform keeps, checked on one matrix.

Every compressor through every reducer that can carry it (``compressed_mean``), and every
optimizer (DGC, 1-bit Adam/LAMB, DiLoCo exact and compressed, DeMo, ZeRO), goes through the
same checks, as optax tests all its optimizers in one file:

* called where its axis is not bound, it raises :class:`commjax.AxisNotBoundError` with
  the ``shard_map`` fix;
* after steps on non-i.i.d. gradients, every replica holds bit-identical parameters;
* a NaN in one replica's gradient makes that leaf's update NaN on *every* replica, and
  leaves the state finite and as it was (the poisoned leaf's residual; an optimizer's
  whole state but its metrics); the next clean step continues, still bit-identical across
  replicas;
* its state lays out for ``shard_map`` (per-replica leaves tiled over the axis) and
  round-trips through [`commjax.checkpoint.Checkpointer`][] bit for bit, training resuming
  from it with the same bits;
* the compiled HLO sends exactly the bytes of its :func:`commjax.communication_plan`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.checkpoint import Checkpointer
from commjax.testing import ready, same_bits

N = 8
AX = "data"
MIN = 256  # compress every leaf of at least this many elements

CODECS = {
    "identity": cj.identity(),
    "cast": cj.cast(jnp.bfloat16),
    "q8": cj.quantize(8),
    "q4": cj.quantize(4, block_size=64),
    "q2": cj.quantize(2),
    "qsgd": cj.qsgd(),
    "terngrad": cj.terngrad(),
    "sign": cj.sign(),
    "hadamard_q4": cj.hadamard(cj.quantize(4)),
    "top_k": cj.top_k(0.1),
    "threshold": cj.threshold(1e-3, 64),
    "random_k": cj.random_k(0.1),
    "powersgd": cj.powersgd(2),
    "fp8": cj.fp8("e5m2", block_size=64, stochastic=True),
    "lossless": cj.lossless(block_size=64, escapes=3),
}
#: Options of a codec that change its payload, through reducer="auto" only.
VARIANTS = {
    "top_k_chunk_bf16": cj.top_k(0.1, chunk_size=512, values_dtype=jnp.bfloat16),
    "top_k_model": cj.top_k(0.1, scope="model"),
    "random_k_bf16": cj.random_k(0.1, values_dtype=jnp.bfloat16),
    "q2_midrise": cj.quantize(2, midrise=True),
}


def _mean_case(codec, reducer):
    return lambda: optax.chain(cj.compressed_mean(codec, AX, reducer=reducer, min_compress_size=MIN),
                               optax.sgd(0.05))


def _cases() -> dict:
    out = {}
    for name, codec in {**CODECS, **VARIANTS}.items():
        reducers = ["auto"] + [r for r in cj.collectives.valid_reducers(codec) if r in cj.REDUCERS]
        if codec.has_exchange or codec.shared_randomness or name in VARIANTS:
            reducers = ["auto"]
        for r in reducers:
            out[f"mean-{name}-{r}"] = _mean_case(codec, r)
    q4, q8 = cj.quantize(4), cj.quantize(8, stochastic=False)
    out.update({
        "dgc": lambda: cj.dgc(0.05, ratio=0.05, min_compress_size=MIN, clip_norm=1.0),
        "onebit_adam": lambda: cj.onebit_adam(1e-3, warmup_steps=2, min_compress_size=MIN),
        "onebit_lamb": lambda: cj.onebit_lamb(1e-3, warmup_steps=5, min_compress_size=MIN),  # NaN in warm-up
        "decoupled_momentum": lambda: cj.decoupled_momentum(0.05, chunk_size=8, top_k=4),
        "diloco": lambda: cj.diloco(optax.sgd(0.05), optax.sgd(0.7), sync_every=2),
        "diloco_q4": lambda: cj.diloco(optax.sgd(0.05), optax.sgd(0.7), sync_every=2, compressor=q4),
        "streaming_diloco_q4": lambda: cj.streaming_diloco(optax.sgd(0.05), optax.sgd(0.7), sync_every=2,
                                                           fragments=2, compressor=q4),
        "choco_sign": lambda: cj.choco(optax.sgd(0.05), AX, codec=cj.sign(), gamma=0.5),
        "zero_q4": lambda: cj.zero(optax.adam(1e-3), AX, grad_codec=q4, weight_codec=q8,
                                   min_compress_size=MIN, grad_error_feedback=True),
    })
    return out


CASES = _cases()
#: Cases whose NaN stays in its leaf (the other leaves' means are exact); the others make
#: the whole update NaN.
LEAF_LOCAL_NAN = ("mean-", "choco")
MEAN_CASES = sorted(k for k in CASES if k.startswith("mean-"))


@functools.lru_cache(maxsize=None)
def _params_cached():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (48, 40)) * 0.1, "v": jax.random.normal(k2, (24, 32)) * 0.1,
            "b": jnp.zeros((40,))}


def _params():
    """The parameters (drawn once: the cases ask for them hundreds of times)."""
    return dict(_params_cached())


@functools.lru_cache(maxsize=None)
def _clean_grads(step: int):
    out = {}
    for i, (k, p) in enumerate(sorted(_params().items())):
        key = jax.random.fold_in(jax.random.PRNGKey(100 + i), step)
        g = np.asarray(jax.random.normal(key, (N,) + p.shape)) + np.arange(N).reshape((N,) + (1,) * p.ndim)
        out[k] = g.astype(np.float32)
    return out


def _grads(step: int, nan_at=None):
    """Per-replica gradients ``[N, ...]``: replica ``r`` sees its own offset (non-i.i.d.).
    Drawn once per step and copied (callers poison their copy)."""
    out = {k: v.copy() for k, v in _clean_grads(step).items()}
    if nan_at is not None:
        out["w"][nan_at, 3, 5] = np.nan
    return out


def _compile(tx, mesh):
    """``(f, state)``: ``tx``'s step on per-replica params and gradients (``check_vma=True``),
    returning per-replica params, updates and the state."""
    state = cj.init_sharded(tx, _params(), mesh, AX)
    specs = cj.state_specs(state, AX)

    def step(p, s, g):
        p1, g1 = (jax.tree_util.tree_map(lambda a: a[0], t) for t in (p, g))
        u, s = tx.update(g1, s, p1)
        new = optax.apply_updates(p1, u)
        return jax.tree_util.tree_map(lambda a: a[None], (new, u)) + (s,)

    f = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(AX), specs, P(AX)),
                                  out_specs=(P(AX), P(AX), specs)))
    return f, state


@pytest.fixture(scope="module")
def steppers(mesh):
    """One compiled step per case: per-replica params and gradients in, per-replica params,
    updates and the state out (``check_vma=True``)."""
    cache = {}

    def get(name):
        if name not in cache:
            tx = CASES[name]()
            cache[name] = (tx,) + _compile(tx, mesh)
        return cache[name]

    return get


def _placed(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P(AX)))


def _identical(tree) -> bool:
    return all(bool(np.all(np.asarray(l) == np.asarray(l)[:1])) for l in jax.tree_util.tree_leaves(tree))


def _finite_floats(tree) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(l)))) for l in jax.tree_util.tree_leaves(tree)
               if jnp.issubdtype(np.asarray(l).dtype, jnp.floating))


@pytest.mark.parametrize("name", sorted(CASES))
def test_unbound_axis_names_the_fix(name):
    tx = CASES[name]()
    params = _params()
    state = tx.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    with pytest.raises(cj.AxisNotBoundError, match="shard_map"):
        tx.update(grads, state, params)


def _agree(name: str, t: int, params, state) -> bool:
    """Whether the replicas agree as ``name`` promises after step ``t``: parameters bit for
    bit, except DiLoCo, whose replicas meet at the syncs (every second step here) on the
    replicated anchor up to half an ulp of each term of ``p + (theta - p)``, and Streaming
    DiLoCo, whose fragments merge at different steps, so that only its replicated anchor
    (every device's copy of it) is the same everywhere at every step."""
    if name.startswith("streaming"):
        return all(len({np.asarray(s.data).tobytes() for s in leaf.addressable_shards}) == 1
                   for leaf in jax.tree_util.tree_leaves(state.anchor))
    if name.startswith("choco"):  # gossip: near, never equal (tests/test_choco.py)
        return True
    if not name.startswith("diloco"):
        return _identical(params)
    if (t + 1) % 2:
        return True
    return all(np.allclose(np.asarray(l), np.asarray(l)[:1], rtol=2 ** -22, atol=2 ** -22)
               for l in jax.tree_util.tree_leaves(params))


def _moved(name: str, before, after) -> list:
    """Paths of the state's float leaves that a NaN step changed but must keep: for a mean
    case, the poisoned leaf's residual (the other leaves' residuals move on); for an
    optimizer, every float leaf but its per-step metrics."""
    if name.startswith("mean-"):
        w = _w_residual(name)
        res = (before[0].residual, after[0].residual)
        return [] if not res[0] else [f"residual[{w}]"] * (not np.array_equal(res[0][w], res[1][w]))
    out = []
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree_util.tree_leaves(after)):
        key = jax.tree_util.keystr(path)
        if "metrics" not in key and jnp.issubdtype(a.dtype, jnp.floating) and not np.array_equal(a, b):
            out.append(key)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_replicas_identical_and_nan_reaches_every_replica(mesh, steppers, name):
    tx, f, state = steppers(name)
    params = _placed(mesh, jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), _params()))
    for t in range(3):
        params, u, state = ready(*f(params, state, _placed(mesh, _grads(t))))
        assert _agree(name, t, params, state), f"step {t}: replicas drifted"
        assert _finite_floats(u), f"step {t}"
    # NaN in one replica's `w` (step 3 is a DiLoCo sync): NaN on every replica, state finite.
    _, u_bad, state_bad = ready(*f(params, state, _placed(mesh, _grads(3, nan_at=5))))
    assert np.all(np.isnan(np.asarray(u_bad["w"]))), "the NaN did not reach every replica"
    if not name.startswith(LEAF_LOCAL_NAN):  # the optimizers reject the whole step
        assert all(np.all(np.isnan(np.asarray(l))) for l in jax.tree_util.tree_leaves(u_bad))
    assert _finite_floats(state_bad), "the state was poisoned"
    assert not _moved(name, state, state_bad), f"the NaN step changed {_moved(name, state, state_bad)}"
    if name.startswith("mean-"):
        assert np.all(np.asarray(state_bad[0].metrics["nonfinite"]) == 1.0), "not every replica saw it"
    # The NaN step is skipped (as optax.apply_if_finite would); training goes on.
    for t in (4, 5):
        params, u, state = ready(*f(params, state_bad if t == 4 else state, _placed(mesh, _grads(t))))
        assert _finite_floats(u) and _agree(name, t, params, state)


@pytest.mark.parametrize("name", MEAN_CASES)
def test_inf_on_one_replica_flags_only_its_leaf(mesh, steppers, name):
    """-inf in one replica's ``v``: ``v``'s mean is NaN on every replica, the other leaves'
    are finite and identical, and the state stays finite (whether the flag rode in the exact
    all-reduce or was read from the received payloads: ``plan.finite_flags``)."""
    _, f, state = steppers(name)
    params = _placed(mesh, jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), _params()))
    grads = _grads(0)
    grads["v"][2, 7, 1] = -np.inf
    new, u, state_bad = ready(*f(params, state, _placed(mesh, grads)))
    assert np.all(np.isnan(np.asarray(u["v"]))), "the Inf did not reach every replica"
    assert _finite_floats({k: u[k] for k in ("w", "b")}) and _identical({k: u[k] for k in ("w", "b")})
    assert _finite_floats(state_bad), "the state was poisoned"


#: One mean case per way a flagged residual is formed: the two-phase owner's re-encode
#: (cast, int8, sign), the all-gather (int8; top-k, which selects from the kept residual),
#: an exchange (PowerSGD), shared positions (random-k).
RESET_CASES = ["mean-cast-two_phase", "mean-q8-two_phase", "mean-q8-allgather", "mean-sign-auto",
               "mean-top_k-allgather", "mean-powersgd-auto", "mean-random_k-auto"]


@pytest.mark.parametrize("name", RESET_CASES)
def test_reset_on_nonfinite_zeroes_only_the_flagged_residuals(mesh, steppers, name):
    """``check_finite="reset"``: finite steps give the bits of the default; a NaN step
    gives the same updates (NaN for the flagged leaf on every replica), the other leaves'
    residuals of the default, zero for the flagged leaf's and for the server residual;
    training goes on."""
    _, keep_f, keep_state = steppers(name)
    _, codec, reducer = name.split("-")
    f, state = _compile(optax.chain(cj.compressed_mean({**CODECS, **VARIANTS}[codec], AX, reducer=reducer,
                                                       min_compress_size=MIN, check_finite="reset"),
                                    optax.sgd(0.05)), mesh)
    params = _placed(mesh, jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), _params()))
    w = _w_residual(name)
    for t in range(3):
        grads = _placed(mesh, _grads(t, nan_at=5 if t == 2 else None))
        p_keep, u_keep, keep_state = ready(*keep_f(params, keep_state, grads))
        p_new, u, state = ready(*f(params, state, grads))
        assert same_bits(u, u_keep), f"step {t}: the updates differ from check_finite=True's"
        if t < 2:
            assert same_bits(state, keep_state), f"step {t}: the state differs from check_finite=True's"
            params = p_new
    assert np.all(np.isnan(np.asarray(u["w"]))) and _finite_floats({k: u[k] for k in ("b", "v")})
    assert np.all(np.asarray(state[0].metrics["nonfinite"]) == 1.0) and _finite_floats(state)
    for k, (a, b) in enumerate(zip(state[0].residual, keep_state[0].residual)):
        assert same_bits(a, np.zeros_like(np.asarray(b)) if k == w else b), f"residual[{k}]"
    assert not np.any(np.asarray(state[0].server_residual)), "the server residual was not reset"
    params, u, state = ready(*f(params, state, _placed(mesh, _grads(3))))
    assert _finite_floats(u) and _identical(params)


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_layout_and_checkpoint_round_trip(mesh, steppers, name, tmp_path):
    tx, f, state = steppers(name)
    params = _placed(mesh, jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), _params()))
    _, _, state = ready(*f(params, state, _placed(mesh, _grads(0))))
    local = tx.init(_params())
    for leaf, marked, spec in zip(jax.tree_util.tree_leaves(state),
                                  jax.tree_util.tree_leaves(cj.per_replica_mask(state)),
                                  jax.tree_util.tree_leaves(cj.state_specs(state, AX),
                                                            is_leaf=lambda x: isinstance(x, P))):
        assert spec == (P(AX) if marked else P())
        if marked and leaf.size:
            assert leaf.shape[0] % N == 0
    if True:  # the global per-replica leaves are N local ones side by side
        for g, l, m in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(local),
                           jax.tree_util.tree_leaves(cj.per_replica_mask(state))):
            if m and l.size:
                assert g.shape == (N * l.shape[0],) + tuple(l.shape[1:])
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, {"opt": state})
        back = ckpt.restore({"opt": state})["opt"]
    assert same_bits(back, state)
    # Training resumes from the restored state bit for bit (stochastic codecs included).
    grads = _placed(mesh, _grads(1))
    assert same_bits(ready(*f(params, back, grads)), ready(*f(params, state, grads)))


def _w_residual(name: str) -> int:
    """Which of mean case ``name``'s residuals is leaf ``w``'s (leaves: b, v, w)."""
    routes = cj.communication_plan(_planned(name), _params(), N).routing.routes
    return [i for i, r in enumerate(routes) if r == "compress"].index(2)


def _planned(name: str):
    """The commjax transform of case ``name`` that :func:`commjax.communication_plan` is
    asked about (a mean case's SGD after it sends nothing)."""
    if name.startswith("mean-"):
        _, codec, reducer = name.split("-")
        return cj.compressed_mean({**CODECS, **VARIANTS}[codec], AX, reducer=reducer, min_compress_size=MIN)
    return CASES[name]()


@pytest.mark.parametrize("name", sorted(CASES))
def test_hlo_bytes_equal_the_plan(mesh, steppers, name):
    """The step the other checks ran: its compiled HLO (read from the executable those
    checks already built) sends exactly the bytes of the transform's plan, every transfer
    counted once (conditional branches included: DiLoCo's sync, a warm-up, a fallback)."""
    _, f, state = steppers(name)
    params = _placed(mesh, jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), _params()))
    rep = cj.collective_bytes(f, params, state, _placed(mesh, _grads(0)))
    plan = cj.communication_plan(_planned(name), _params(), N)
    assert rep.total_ring_bytes == pytest.approx(plan.compiled_bytes, abs=0.5), f"{rep.table()}\n{plan}"
    codec = {**CODECS, **VARIANTS}.get(name.split("-")[1]) if name.startswith("mean-") else None
    if codec is not None and not (codec.linear or codec.has_exchange):  # payloads as unsigned words
        assert "u32" in rep.dtypes, rep.table()
    # No integer payload is ever summed (psum on small integers wraps around; ZeRO's
    # first-step fingerprint is a max and a min).
    for c in rep.of_kind("all-reduce"):
        assert c.hlo_name.startswith(("pmax", "pmin")) or all(d.startswith("f") for d in c.dtypes), c


# --------------------------------------------------------------- collective ops in model code

_Q8 = cj.quantize(8, stochastic=False)
_RING = [(i, (i + 1) % N) for i in range(N)]
OPS = {  # name: (op, plan options, the op inside shard_map on this replica's x)
    "ppermute-q8": (cj.collectives.ppermute, dict(codec=_Q8),
                    lambda x: cj.collectives.ppermute(x, AX, _RING, _Q8)),
    "tp_reduce-q8": (cj.collectives.tp_reduce, dict(codec=_Q8),
                     lambda x: cj.collectives.tp_reduce(x, AX, codec=_Q8)),
    "tp_copy-q8": (cj.collectives.tp_copy, dict(codec=_Q8),  # its all-reduce is in the VJP
                   lambda x: jax.grad(lambda a: jnp.sum(jnp.sin(cj.collectives.tp_copy(a, AX, grad_codec=_Q8))))(x)),
}


@pytest.mark.parametrize("op", [cj.fsdp_gather, cj.collectives.all_gather, cj.collectives.reduce_scatter,
                                cj.collectives.all_reduce, cj.collectives.tp_reduce, cj.collectives.tp_copy,
                                lambda x, axis: cj.collectives.ppermute(x, axis, _RING)],
                         ids=["fsdp_gather", "all_gather", "reduce_scatter", "all_reduce", "tp_reduce",
                              "tp_copy", "ppermute"])
def test_op_unbound_axis_names_the_fix(op):
    with pytest.raises(cj.AxisNotBoundError, match="not bound.*shard_map|shard_map.*not bound"):
        op(jnp.ones((N, 4)), AX)


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_hlo_bytes_equal_the_plan(mesh, name):
    """A collective op of model code sends what ``cj.communication_plan(op, x, N, ...)``
    says (the VJP's collective too, where the op is differentiated)."""
    op, options, run = OPS[name]
    x = np.random.default_rng(0).normal(size=(N * 512, 64)).astype(np.float32)
    fn = jax.jit(_compat.shard_map(lambda a: run(a), mesh=mesh, in_specs=P(AX), out_specs=P(AX),
                                   check_vma=False))
    rep = cj.collective_bytes(fn, x)
    plan = cj.communication_plan(op, jax.ShapeDtypeStruct((512, 64), jnp.float32), N, **options)
    assert rep.total_ring_bytes == pytest.approx(plan.compiled_bytes, abs=0.5), f"{rep.table()}\n{plan}"


def test_fsdp_gather_hlo_bytes_equal_the_plan(mesh):
    """A step that gathers a sharded tree (a compressed leaf and a small exact one, reshaped
    to ``like``) and differentiates through it: the forward all-gather and the VJP's
    reduce-scatter send the plan's bytes."""
    like = {"w": jax.ShapeDtypeStruct((1024, 1000), jnp.float32), "b": jax.ShapeDtypeStruct((1000,), jnp.float32)}
    codec, grad_codec = _Q8, cj.hadamard(cj.quantize(4))
    shards = jax.eval_shape(lambda p: cj.fsdp_shard(p, N, align=256), like)

    def loss(s, x):
        p = cj.fsdp_gather(s, AX, codec, grad_codec=grad_codec, key=jax.random.PRNGKey(0), like=like)
        return jnp.sum(jnp.tanh(x @ p["w"].T)) + jnp.sum(jnp.tanh(p["b"] * x))  # uses every leaf

    fn = jax.jit(_compat.shard_map(lambda s, x: jax.grad(loss)(s, x[0]), mesh=mesh,
                                   in_specs=(P(AX), P(AX)), out_specs=P(AX)))
    rep = cj.collective_bytes(fn, shards, jax.ShapeDtypeStruct((N, 4, 1000), jnp.float32))
    plan = cj.communication_plan(cj.fsdp_gather, like, N, codec=codec, grad_codec=grad_codec, align=256)
    assert rep.total_ring_bytes == pytest.approx(plan.compiled_bytes, abs=0.5), rep.table()



# ------------------------------------------------------------ a state made for something else

#: Transforms whose state records what it was made for (commjax.fingerprint), each with
#: another transform whose state has the same shapes.
_MADE_FOR = {
    "mean-top_k": (lambda: _mean_case(cj.top_k(0.1), "auto")(), lambda: _mean_case(cj.quantize(4), "allgather")()),
    "mean-sign": (lambda: _mean_case(cj.sign(), "two_phase")(), lambda: _mean_case(cj.quantize(4), "two_phase")()),
    "mean-powersgd": (lambda: _mean_case(cj.powersgd(2), "auto")(), lambda: _mean_case(cj.powersgd(2, seed=1), "auto")()),
    "zero_q4": (CASES["zero_q4"], lambda: cj.zero(optax.adam(1e-3), AX, grad_codec=cj.sign(), min_compress_size=MIN,
                                                 weight_codec=cj.quantize(8, stochastic=False), grad_error_feedback=True)),
}
_MISUSES = {  # name: (what the gradients (and parameters) become on each replica, the error)
    "renamed": (lambda t: {"a": t["b"], "x": t["v"], "z": t["w"]}, "other keys"),
    "reshaped": (lambda t: {**t, "w": t["w"].reshape(40, 48)}, "other shapes"),
    "swapped": (lambda t: {**t, "v": t["w"], "w": t["v"]}, "other shapes"),
    "split": (lambda t: jax.tree_util.tree_map(lambda a: a[:a.shape[0] // N], t), r"split over the replicas' axis.*P\(\)"),
}


@pytest.fixture(scope="module")
def made_states(mesh):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = [cj.init_sharded(make(), _params(), mesh, AX) for make in _MADE_FOR[name]]
        return cache[name]

    return get


def _trace_step(mesh, tx, state, change=lambda t: t):
    """Trace (not compile) one step of ``tx`` from ``state`` on the gradients ``change``
    makes of each replica's own."""
    def step(p, s, g):
        p1, g1 = (change(jax.tree_util.tree_map(lambda a: a[0], t)) for t in (p, g))
        return tx.update(g1, s, p1)[1]

    specs = cj.state_specs(state, AX)
    glob = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((N,) + a.shape, a.dtype), _params())
    return jax.eval_shape(_compat.shard_map(step, mesh=mesh, in_specs=(P(AX), specs, P(AX)), out_specs=specs),
                          glob, state, glob)


@pytest.mark.parametrize("name", sorted(_MADE_FOR))
def test_state_of_another_transform_is_refused(mesh, made_states, name):
    """A state made for another codec (or another codec's options) is refused by name, not
    taken for another replica count; the transform's own state is accepted."""
    (make, _), (state, other) = _MADE_FOR[name], made_states(name)
    _trace_step(mesh, make(), state)
    with pytest.raises(ValueError, match="the state was made for") as err:
        _trace_step(mesh, make(), other)
    assert "replicas" not in str(err.value) and "init_sharded" in str(err.value)


@pytest.mark.parametrize("misuse", sorted(_MISUSES))
@pytest.mark.parametrize("name", sorted(_MADE_FOR))
def test_gradients_of_other_parameters_are_refused(mesh, made_states, name, misuse):
    """Renamed keys, a reshaped leaf, two leaves of different shapes exchanged, parameters
    split over the axis (``in_specs=P(axis)``): each refused with its cause and fix."""
    change, match = _MISUSES[misuse]
    with pytest.raises(ValueError, match=match):
        _trace_step(mesh, _MADE_FOR[name][0](), made_states(name)[0], change)


@pytest.mark.parametrize("name", sorted(_MADE_FOR))
def test_checkpoint_of_another_chain_is_refused(made_states, name, tmp_path):
    """A checkpoint restored into the state of another transform: refused by
    commjax.checkpoint (naming both fingerprints) and by orbax's own restore."""
    ocp = pytest.importorskip("orbax.checkpoint")
    state, other = made_states(name)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, {"opt": state})
        with pytest.raises(ValueError, match="made for"):
            ckpt.restore({"opt": other})
    path = tmp_path / "orbax"
    with ocp.StandardCheckpointer() as c:
        c.save(path, state)
    with ocp.StandardCheckpointer() as c, pytest.raises(Exception, match="made_for"):
        c.restore(path, jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, other))


@pytest.mark.parametrize("name", ["mean-sign", "zero_q4"])
def test_state_for_another_replica_count_is_refused(mesh, name):
    """A state sized for 4 replicas (``num_replicas=4``) on 8: the fix names the count."""
    tx = {"mean-sign": lambda **kw: cj.compressed_mean(cj.sign(), AX, reducer="two_phase", min_compress_size=MIN, **kw),
          "zero_q4": lambda **kw: cj.zero(optax.adam(1e-3), AX, grad_codec=cj.quantize(4), min_compress_size=MIN, **kw)}[name]
    state = cj.shard_state(tx(num_replicas=4).init(_params()), mesh, AX)
    with pytest.raises(ValueError, match="num_replicas=8"):
        _trace_step(mesh, tx(), state)


@pytest.mark.parametrize("name", sorted(CASES))
def test_local_state_is_refused_by_state_specs(name):
    """``tx.init(params)`` laid out by nothing: state_specs names init_sharded/shard_state
    instead of shard_map's divisibility error (a state without per-replica leaves, exact
    DiLoCo's, is the same on every replica: its specs are all ``P()``)."""
    state = CASES[name]().init(_params())
    if not any(jax.tree_util.tree_leaves(cj.per_replica_mask(state))):
        specs = jax.tree_util.tree_leaves(cj.state_specs(state, AX), is_leaf=lambda x: isinstance(x, P))
        assert all(sp == P() for sp in specs)
        return
    with pytest.raises(ValueError, match="local state.*init_sharded"):
        cj.state_specs(state, AX)


def test_pmap_state_for_another_device_count_is_refused_by_pmap():
    """``pmap_state(num_devices=4)`` under a pmap over 8 devices: JAX's pmap refuses the
    arguments before any commjax code runs (what pmap_state's docstring says)."""
    tx = cj.compressed_mean(cj.quantize(4), AX, min_compress_size=MIN)
    state = cj.pmap_state(tx.init(_params()), num_devices=4)
    grads = jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), _params())
    with pytest.raises(Exception, match="axis 0 is partitioned 8 times, but the dimension size is 4"):
        jax.pmap(lambda g, s: tx.update(g, s)[1], axis_name=AX)(grads, state)


PER_REPLICA_PARAMS = ("diloco", "streaming_diloco", "choco")


@pytest.fixture(scope="module")
def one_device_mesh():
    return _compat.make_mesh((1,), (AX,))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_transform_trains_on_a_one_device_mesh(one_device_mesh, name):
    """A mesh of one device (a user's first run on one accelerator), ``check_vma=True``:
    the step compiles and trains. ``jit`` hands a one-device ``P(axis)`` output back as
    ``P()``, so the layout answers from the declared fields there; the paths that skip the
    exchange on one replica type their results replicated (they stayed varying, and
    ``shard_map`` or ``data_parallel`` refused the replicated parameters)."""
    tx = CASES[name]()
    dp = cj.data_parallel(lambda p, b: sum(jnp.sum(jnp.square(v - jnp.mean(b))) for v in jax.tree_util.tree_leaves(p)),
                          tx, one_device_mesh, per_replica_params=name.startswith(PER_REPLICA_PARAMS))
    state = dp.init(_params())
    for _ in range(3):
        state, loss = dp.step(state, jnp.ones((1, 4)))
    before = jax.tree_util.tree_leaves(_params())
    after = jax.tree_util.tree_leaves(state.params)
    assert _finite_floats(state.params) and np.all(np.isfinite(np.asarray(loss)))
    assert any(not np.array_equal(np.asarray(a).reshape(np.shape(b)), np.asarray(b)) for a, b in zip(after, before))


REAL_ONLY = {
    "zero": lambda: cj.zero(optax.adam(1e-3), AX), "onebit_adam": lambda: cj.onebit_adam(1e-3, warmup_steps=1),
    "onebit_lamb": lambda: cj.onebit_lamb(1e-3, warmup_steps=1), "dgc": lambda: cj.dgc(0.05),
    "decoupled_momentum": lambda: cj.decoupled_momentum(0.05),
    "diloco": lambda: cj.diloco(optax.sgd(0.05), optax.sgd(0.7), sync_every=2),
    "streaming_diloco": lambda: cj.streaming_diloco(optax.sgd(0.05), optax.sgd(0.7), sync_every=2, fragments=2),
    "choco": lambda: cj.choco(optax.sgd(0.05), AX, codec=cj.sign()),
}


@pytest.mark.parametrize("name", sorted(REAL_ONLY))
def test_complex_parameters_are_refused_by_name_where_the_state_is_real(name):
    """The optimizers whose state holds real fp32 copies of the parameters (moments,
    residuals, anchors, public copies) refuse a complex leaf at init, naming it: DGC left
    one untrained (zero updates, silently), DiLoCo and 1-bit Adam dropped its imaginary
    part. ``compressed_mean`` averages complex leaves exactly (tested elsewhere)."""
    params = {"w": jnp.ones((8, 8)), "z": jnp.ones((4,), jnp.complex64)}
    with pytest.raises(ValueError, match=r"\['z'\] is complex64.*real and imaginary parts"):
        REAL_ONLY[name]().init(params)


ACCUMULATED = ("dgc", "onebit_adam", "decoupled_momentum", "diloco_q4", "streaming_diloco_q4", "choco_sign", "zero_q4",
               "mean-q8-auto")


@pytest.mark.parametrize("name", ACCUMULATED)
def test_every_optimizer_accumulates_under_multisteps(mesh, name):
    """``optax.MultiSteps(tx, 2)`` (run as [`commjax.accumulate`][], ``check_vma=True``):
    the inner transform runs under a ``lax.cond`` on the second micro-step only, so the
    parameters are bit for bit unchanged after the first micro-step and change after
    the second. The held branch returns the inner state as it came in, typed as the
    firing branch returns it: an optimizer whose state or updates come out varying where
    they came in replicated (DGC's per-replica metric, DiLoCo's and CHOCO's updates of
    per-replica parameters) failed with mismatched branch types."""
    tx = optax.MultiSteps(CASES[name](), every_k_schedule=2)
    dp = cj.data_parallel(lambda p, b: sum(jnp.sum(jnp.square(v - jnp.mean(b))) for v in jax.tree_util.tree_leaves(p)),
                          tx, mesh, per_replica_params=name.startswith(PER_REPLICA_PARAMS))
    state = dp.init(_params())
    batch = jnp.arange(N * 4, dtype=jnp.float32).reshape(N, 4)
    seen = [np.asarray(l) for l in jax.tree_util.tree_leaves(state.params)]
    for micro in range(4):
        state, loss = dp.step(state, batch * (micro + 1))
        now = [np.asarray(l) for l in jax.tree_util.tree_leaves(state.params)]
        changed = any(not np.array_equal(a, b) for a, b in zip(now, seen))
        assert changed == (micro % 2 == 1), f"micro-step {micro}"
        assert _finite_floats(state.params) and np.all(np.isfinite(np.asarray(loss)))
        seen = now


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_transform_runs_under_vmap_with_a_named_axis(name):
    """``jax.vmap(..., axis_name="data")`` as the replica axis (replicas simulated on one
    device): every transform trains, the replicated parameters bit-identical on every
    replica. Only a ``shard_map``'s manual axes type values as varying; the cast to
    varying (and the typed all-gather) failed with JAX's "pvary should be called under
    jax.shard_map" here."""
    tx = CASES[name]()
    params = _params()
    state = jax.vmap(lambda _: tx.init(params), axis_name=AX)(jnp.arange(N))
    stacked = jax.tree_util.tree_map(lambda p: jnp.stack([p] * N), params)
    step = jax.jit(jax.vmap(lambda p, s, g: tx.update(g, s, p), axis_name=AX))
    for t in range(2):
        updates, state = step(stacked, state, jax.tree_util.tree_map(jnp.asarray, _clean_grads(t)))
        stacked = optax.apply_updates(stacked, updates)
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(stacked)]
    assert all(np.isfinite(x).all() for x in leaves)
    if not name.startswith(PER_REPLICA_PARAMS):
        assert all(np.array_equal(x[0], x[r]) for x in leaves for r in range(N))
    assert any(not np.array_equal(x[0], np.asarray(p)) for x, p in zip(leaves, jax.tree_util.tree_leaves(params)))
