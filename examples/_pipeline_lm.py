"""The char Transformer on a ``data x stage x model`` mesh: GPipe over microbatches with
compressed stage sends, tensor-parallel attention and MLP, compressed data-parallel
gradients (imports JAX: import it after ``--devices`` is applied). Used by
``06_pipeline_lm.py`` and ``benchmarks/model_parallel.py``.

One step, inside ``shard_map`` manual over all three axes, on device ``(d, s, m)``::

    for tick t in 0 .. M + S - 2:                 # GPipe: stage s runs microbatch t - s
        x = embed(microbatch t) if s == 0 else h  # stage 0 reads tokens, the others receive
        y = blocks of stage s (x)                 # heads and MLP columns split over "model":
                                                  #   tp_copy before, tp_reduce after each
        loss += xent(head(y)) if s == S - 1       # the last stage scores microbatch t - S + 1
        h = cc.ppermute(y, "stage", s -> s + 1, fwd_codec, grad_codec=bwd_codec)
    grads = jax.grad(loss)                        # the backward sends go back, compressed
    updates = compressed_mean(dp_codec, "data")   # on each device's (stage, model) shard

Every parameter has a leading stage axis (each stage its own copy of the embedding and
the head; only stage 0's embedding and stage S-1's head are used), so nothing is
replicated over stages and no stage-axis collective but the sends exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat, axes as mesh_axes
from commjax import collectives as cc

AXES = ("data", "stage", "model")

def codec(name: str) -> Optional[cj.Compressor]:
    """A codec from its flag name (``none``: the exact collective of ``jax.lax``; the
    names are ``06_pipeline_lm.CODECS``, listed there because that script parses its
    flags before JAX starts)."""
    q = lambda bits, st=False: cj.quantize(bits, stochastic=st)  # noqa: E731
    table = {"none": None, "identity": cj.identity(), "bf16": cj.cast(jnp.bfloat16),
             "fp8": cj.fp8("e4m3"), "int8": q(8), "int4": q(4), "int2": q(2), "int4s": q(4, True),
             "int2s": q(2, True), "h4": cj.hadamard(q(4)), "h2": cj.hadamard(q(2)),
             "int2m": cj.quantize(2, stochastic=False, clip_rms=1.49, midrise=True),
             "int2ms": cj.quantize(2, stochastic=True, midrise=True),
             "powersgd2": cj.powersgd(rank=2), "powersgd4": cj.powersgd(rank=4),
             "powersgd8": cj.powersgd(rank=8), "sign": cj.sign(), "top_k": cj.top_k(0.01)}
    return table[name]


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and schedule (sizes per device: ``mb`` windows per microbatch and replica)."""

    vocab: int
    d_model: int = 64
    heads: int = 4
    layers_per_stage: int = 1
    seq_len: int = 32
    stages: int = 2
    tensor: int = 2
    data: int = 2
    microbatches: int = 4
    mb: int = 4
    lr: float = 3e-3

    @property
    def ticks(self) -> int:
        return self.microbatches + self.stages - 1


@dataclasses.dataclass(frozen=True)
class Codecs:
    """What travels on each axis: forward and backward stage sends, the tensor-parallel
    all-reduces (forward and backward), the data-parallel gradient mean; the delta mode
    of the forward sends; lazy error propagation of the backward sends; ``epilogue``:
    compress only the backward sends of the first ``stages - 1`` microbatches (the last
    the backward pass finishes: Optimus-CC's epilogue), the others exact; ``delta_rate``
    of the ``"slot"`` mode (``cc.ppermute``)."""

    fwd: Optional[cj.Compressor] = None
    bwd: Optional[cj.Compressor] = None
    tp: Optional[cj.Compressor] = None
    dp: Optional[cj.Compressor] = None
    delta: Optional[str] = None
    lazy: bool = False
    epilogue: bool = False
    delta_rate: float = 1.0


# ----------------------------------------------------------------------- parameters


def init_params(cfg: Config, seed: int) -> dict:
    """Global parameters (numpy), every leaf with a leading stage axis."""
    rng = np.random.default_rng(seed)
    S, L, D, V, F = cfg.stages, cfg.layers_per_stage, cfg.d_model, cfg.vocab, 4 * cfg.d_model
    H, Dh = cfg.heads, cfg.d_model // cfg.heads
    n = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    ones, zeros = (lambda *s: np.ones(s, np.float32)), (lambda *s: np.zeros(s, np.float32))
    return {"embed": n(S, V, D), "pos": n(S, cfg.seq_len, D),
            "blocks": {"ln1": ones(S, L, D), "ln1_b": zeros(S, L, D), "qkv": n(S, L, D, 3, H, Dh),
                       "out": n(S, L, H, Dh, D), "ln2": ones(S, L, D), "ln2_b": zeros(S, L, D),
                       "fc": n(S, L, D, F), "proj": n(S, L, F, D)},
            "ln_f": ones(S, D), "ln_f_b": zeros(S, D), "head": n(S, D, V)}


def param_specs() -> dict:
    """Stage axis first; heads and MLP columns (rows of the output projections) over
    "model" (Megatron's split)."""
    st = P("stage")
    return {"embed": st, "pos": st,
            "blocks": {"ln1": st, "ln1_b": st, "qkv": P("stage", None, None, None, "model"),
                       "out": P("stage", None, "model"), "ln2": st, "ln2_b": st,
                       "fc": P("stage", None, None, "model"), "proj": P("stage", None, "model")},
            "ln_f": st, "ln_f_b": st, "head": st}


def _norm(x, scale, bias):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * scale + bias


def block(p: dict, x: jax.Array, tp: Optional[str], tp_codec=None) -> jax.Array:
    """One pre-norm block on this device's heads and MLP columns; ``tp``: the model axis
    (``None``: the whole layer, the unsharded reference)."""
    copy = (lambda v: cc.tp_copy(v, tp, grad_codec=tp_codec)) if tp else (lambda v: v)
    reduce = (lambda v: cc.tp_reduce(v, tp, codec=tp_codec)) if tp else (lambda v: v)
    h = copy(_norm(x, p["ln1"], p["ln1_b"]))
    q, k, v = (jnp.einsum("btd,dhe->bthe", h, p["qkv"][:, i]) for i in range(3))
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + reduce(jnp.einsum("bthe,hed->btd", a, p["out"]))
    h = copy(_norm(x, p["ln2"], p["ln2_b"]))
    return x + reduce(jax.nn.gelu(h @ p["fc"]) @ p["proj"])


def _embed(p: dict, tokens: jax.Array) -> jax.Array:
    return p["embed"][tokens] + p["pos"][: tokens.shape[1]]


def _xent(p: dict, h: jax.Array, targets: jax.Array) -> jax.Array:
    logits = _norm(h, p["ln_f"], p["ln_f_b"]) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def stage_blocks(p: dict, x: jax.Array, tp: Optional[str], tp_codec=None) -> jax.Array:
    for i in range(p["blocks"]["qkv"].shape[0]):
        x = block(jax.tree_util.tree_map(lambda a: a[i], p["blocks"]), x, tp, tp_codec)
    return x


def reference_loss(params: dict, tokens: jax.Array) -> jax.Array:
    """The same model on one device: every stage in order, whole layers (held-out loss)."""
    S = params["embed"].shape[0]
    stage = lambda s: jax.tree_util.tree_map(lambda a: a[s], params)  # noqa: E731
    h = _embed(stage(0), tokens[:, :-1])
    for s in range(S):
        h = stage_blocks(stage(s), h, None)
    return _xent(stage(S - 1), h, tokens[:, 1:])


# ------------------------------------------------------------------------- the step


def _ids(sample_ids, t: int, offset, cfg: Config, trash: int):
    """Sample ids of the microbatch ``t - offset`` (a traced stage index), or the trash row
    of the delta buffer in a pipeline bubble."""
    m = t - offset
    valid = (m >= 0) & (m < cfg.microbatches)
    ids = sample_ids[jnp.clip(m, 0, cfg.microbatches - 1)]
    return jnp.where(valid, ids, trash)


def _tick_send(cfg: Config, codecs: Codecs, t: int, y, pipe: dict, sample_ids, key, s, trash):
    """The forward send of tick ``t`` (stage s -> s + 1); returns ``(h, pipe)``."""
    perm = [(i, i + 1) for i in range(cfg.stages - 1)]
    grad = codecs.bwd
    if codecs.epilogue and t >= cfg.stages - 1:  # not the pipeline's fill: sent exactly
        grad = None
    kw: dict = {"grad_codec": grad, "key": jax.random.fold_in(key, t)}
    if codecs.lazy:
        kw["grad_residual"] = pipe["token"]
    if codecs.delta:
        kw.update(delta=codecs.delta, state=pipe["delta"])
        if codecs.delta_rate != 1.0:
            kw["delta_rate"] = codecs.delta_rate
        if codecs.delta == "sample":
            kw.update(sample_ids=_ids(sample_ids, t, s, cfg, trash),
                      recv_ids=_ids(sample_ids, t, s - 1, cfg, trash))
    out = cc.ppermute(y, "stage", perm, codecs.fwd, **kw)
    if not (codecs.lazy or codecs.delta):
        return out, pipe
    out = list(out)
    h = out.pop(0)
    pipe = dict(pipe)
    if codecs.delta:
        pipe["delta"] = out.pop(0)
    if codecs.lazy:
        pipe["token"] = out.pop(0)
    return h, pipe


def pipeline_loss(cfg: Config, codecs: Codecs, p: dict, tokens, sample_ids, pipe: dict, key):
    """This device's share of the loss (the last stage's mean over microbatches; 0 on the
    other stages) and the new pipeline state, GPipe over the microbatches."""
    s = lax.axis_index("stage")
    micro = tokens.reshape(cfg.microbatches, cfg.mb, -1)
    sample_ids = sample_ids.reshape(cfg.microbatches, cfg.mb)
    trash = cfg_trash(pipe)
    h = jnp.zeros((cfg.mb, cfg.seq_len, cfg.d_model), jnp.float32)
    total = jnp.zeros((), jnp.float32)
    for t in range(cfg.ticks):
        x = jnp.where(s == 0, _embed(p, micro[min(t, cfg.microbatches - 1), :, :-1]), h)
        y = stage_blocks(p, x, "model", codecs.tp)
        m_out = t - (cfg.stages - 1)
        if 0 <= m_out < cfg.microbatches:
            total = total + jnp.where(s == cfg.stages - 1, _xent(p, y, micro[m_out, :, 1:]), 0.0)
        if t < cfg.ticks - 1:
            h, pipe = _tick_send(cfg, codecs, t, y, pipe, sample_ids, key, s, trash)
    return total / cfg.microbatches, pipe


def cfg_trash(pipe: dict) -> int:
    """The delta buffer's last row: where pipeline bubbles write."""
    if "delta" not in pipe or not pipe["delta"].sent_seen.shape[0]:
        return 0
    return pipe["delta"].sent_seen.shape[0] - 1


# ---------------------------------------------------------------------- the trainer


class Trainer:
    """The compiled 3-D step and its state: ``init(seed)``, ``step(state, tokens, ids)``,
    ``axis_bytes`` (per mesh axis, from the compiled HLO), ``held_out(state, tokens)``."""

    def __init__(self, cfg: Config, codecs: Codecs, mesh: Any, *, num_samples: int = 1):
        self.cfg, self.codecs, self.mesh = cfg, codecs, mesh
        self.num_samples = num_samples
        self.tx = optax.chain(cj.compressed_mean(codecs.dp or cj.identity(), "data"),
                              optax.adam(cfg.lr))
        self.specs = param_specs()
        self._fn = None
        self._compiled = None
        self.split = NamedSharding(mesh, P("data"))

    def _pipe(self) -> dict:
        """This device's pipeline state: the delta references, the backward residual."""
        like = jax.ShapeDtypeStruct((self.cfg.mb, self.cfg.seq_len, self.cfg.d_model), jnp.float32)
        pipe = {}
        if self.codecs.delta:
            pipe["delta"] = cc.delta_state(like, self.codecs.delta, num_samples=self.num_samples + 1)
        if self.codecs.lazy:
            pipe["residual"] = jnp.zeros(like.shape, jnp.float32)
        return pipe

    def init(self, seed: int) -> dict:
        place = lambda tree, specs: jax.device_put(tree, jax.tree_util.tree_map(  # noqa: E731
            lambda sp: NamedSharding(self.mesh, sp), specs, is_leaf=lambda x: isinstance(x, P)))
        params = place(init_params(self.cfg, seed), self.specs)
        opt = cj.init_sharded(self.tx, params, self.mesh, "data")
        n = int(np.prod(self.mesh.devices.shape))
        pipe = jax.tree_util.tree_map(
            lambda a: jax.device_put(np.broadcast_to(np.asarray(a)[None], (n,) + a.shape),
                                     NamedSharding(self.mesh, P(AXES))), self._pipe())
        step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))
        state = {"params": params, "opt": opt, "pipe": pipe, "step": step}
        if self._fn is None:  # one compiled step for every seed
            self._build(state)
        return state

    def _local(self, state, tokens, ids):
        cfg, codecs = self.cfg, self.codecs
        key = jax.random.fold_in(jax.random.PRNGKey(17), state["step"])
        key = jax.random.fold_in(key, lax.axis_index("data"))
        pipe_in = jax.tree_util.tree_map(lambda a: a[0], state["pipe"])
        p = jax.tree_util.tree_map(lambda a: a[0], state["params"])  # this stage's

        def loss_fn(p, token):
            pipe = {k: v for k, v in pipe_in.items() if k == "delta"}
            if codecs.lazy:
                pipe["token"] = token
            loss, pipe = pipeline_loss(cfg, codecs, p, tokens, ids, pipe, key)
            if codecs.lazy:
                loss = loss + cc.inject_residual(pipe["token"], pipe_in["residual"])
            return loss, pipe

        token = jnp.zeros((cfg.mb, cfg.seq_len, cfg.d_model), jnp.float32)
        (loss, pipe), (g, g_token) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(p, token)
        g = jax.tree_util.tree_map(lambda a: a[None], g)
        u, opt = self.tx.update(g, state["opt"], state["params"])
        new_pipe = {}
        if codecs.delta:
            new_pipe["delta"] = pipe["delta"]
        if codecs.lazy:
            new_pipe["residual"] = g_token
        new_pipe = jax.tree_util.tree_map(lambda a: a[None], new_pipe)
        return ({"params": optax.apply_updates(state["params"], u), "opt": opt, "pipe": new_pipe,
                 "step": state["step"] + 1}, loss.reshape(1))

    def _build(self, state: dict) -> None:
        specs = {"params": self.specs, "opt": cj.state_specs(state["opt"], "data"),
                 "pipe": jax.tree_util.tree_map(lambda _: P(AXES), state["pipe"]), "step": P()}
        fn = _compat.shard_map(self._local, mesh=self.mesh, in_specs=(specs, P("data"), P("data")),
                               out_specs=(specs, P(AXES)), check_vma=False)
        # The state keeps its layout from step to step (jit would hand an empty leaf, the
        # slot mode's seen flags, back replicated).
        keep = jax.tree_util.tree_map(lambda a: a.sharding, state)
        self._fn = jax.jit(fn, donate_argnums=(0,), out_shardings=(keep, NamedSharding(self.mesh, P(AXES))))

    def place(self, tokens: np.ndarray, ids: np.ndarray):
        return jax.device_put(tokens, self.split), jax.device_put(ids, self.split)

    def step(self, state: dict, tokens: np.ndarray, ids: np.ndarray):
        """One step; returns ``(state, mean training loss of the last stage)``."""
        if self._compiled is None:
            self._compiled = self._fn.lower(state, *self.place(tokens, ids)).compile()
        state, loss = self._compiled(state, *self.place(tokens, ids))
        per_device = np.asarray(loss).reshape(self.mesh.devices.shape)
        return state, float(per_device[:, -1, :].mean())

    def axis_bytes(self) -> dict:
        """Bytes per device and step on each mesh axis (steady state: the delta mode's exact
        first-visit branch left out), from the compiled step's HLO."""
        out: dict = {}
        for c, axes in mesh_axes.collective_axes(cj.collective_bytes(self._compiled), self.mesh):
            if c.in_conditional and any(not d.startswith("u") for d in c.dtypes):
                continue  # a sample's first visit, sent exactly (not the steady state)
            key = "+".join(axes)
            out[key] = out.get(key, 0.0) + float(c.ring_bytes)
        return out

    def held_out(self, state: dict, tokens: np.ndarray) -> float:
        params = jax.device_get(state["params"])
        return float(jax.jit(reference_loss)(params, jnp.asarray(tokens)))

    def replicas_identical(self, state: dict) -> bool:
        """Every data-parallel replica holds the same bits of each parameter shard."""
        for leaf in jax.tree_util.tree_leaves(state["params"]):
            by_index: dict = {}
            for sh in leaf.addressable_shards:
                by_index.setdefault(str(sh.index), []).append(np.asarray(sh.data))
            if any(not np.array_equal(v[0], w) for v in by_index.values() for w in v[1:]):
                return False
        return True


def make_mesh(cfg: Config):
    return _compat.make_mesh((cfg.data, cfg.stages, cfg.tensor), AXES)


class Windows:
    """A finite training set of ``count`` windows (sample ids ``0..count-1``) visited in
    epochs, each a fresh permutation; ``batch(step)`` is the global batch of a step.

    ``replicas > 1``: every data replica keeps its own fixed shard of ``count / replicas``
    windows and visits it in epochs of its own (the global batch is the replicas' slices
    in order, as ``P("data")`` splits it). A sample then always passes through the same
    devices, so the delta references of ``delta="sample"`` (AQ-SGD) that those devices
    keep are one epoch old on every later visit; with one global permutation per epoch a
    sample changes replicas, and the replica it lands on holds no reference for it (its
    first visit there goes exact) or one several epochs stale."""

    def __init__(self, corpus: Any, count: int, seq_len: int, per_step: int, seed: int,
                 replicas: int = 1):
        if count % replicas or per_step % replicas:
            raise ValueError(f"Windows: {replicas} replicas must divide count={count} and "
                             f"per_step={per_step}.")
        rng = np.random.default_rng([seed, 7])
        starts = rng.integers(0, len(corpus.train) - seq_len - 1, count)
        self.tokens = corpus.train[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
        self.count, self.per_step, self.seed, self.replicas = count, per_step, seed, replicas
        self.shards = np.random.default_rng([seed, 11]).permutation(count).reshape(replicas, -1)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        if self.replicas == 1:
            per_epoch = self.count // self.per_step
            epoch, k = divmod(step, per_epoch)
            order = np.random.default_rng([self.seed, epoch]).permutation(self.count)
            ids = order[k * self.per_step:(k + 1) * self.per_step].astype(np.int32)
            return self.tokens[ids], ids
        per = self.per_step // self.replicas
        epoch, k = divmod(step, self.shards.shape[1] // per)
        ids = np.concatenate([
            shard[np.random.default_rng([self.seed, epoch, r]).permutation(shard.size)][k * per:(k + 1) * per]
            for r, shard in enumerate(self.shards)]).astype(np.int32)
        return self.tokens[ids], ids
