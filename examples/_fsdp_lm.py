"""The model, the two training loops and the report of ``05_fsdp_lm.py`` (imports JAX:
import it after ``--devices`` is applied).

FSDP (ZeRO-3) pattern, the part worth reading::

    shards = cj.fsdp_shard(params, 8, align=codec.alignment)        # flat, padded, 1/8 each
    like = cj.fsdp_like(params)                                      # the shapes to rebuild

    def loss(shards, batch):                                         # runs once per replica
        def block(shard, h):                                         # weights alive only here
            w = cj.fsdp_gather(shard, "data", cj.quantize(8, stochastic=False),
                               grad_codec=cj.quantize(4), key=key, like=like_block)
            return nnx.merge(block_def, w)(h)
        for shard in shards["blocks"]:
            h = jax.checkpoint(block)(shard, h)                      # may be re-gathered
        ...
    grads = jax.grad(loss)(shards, batch)     # this replica's shard of the mean gradient
    updates, opt_state = optax.adam(lr).update(grads, opt_state, shards)
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import _charlm
import _train
import commjax as cj
from commjax import _compat

AXIS, FAST = "data", "node"


class Model:
    """The char Transformer as pieces gathered separately: ``top`` (embeddings, final norm)
    and one tree per block, with the graph definitions that rebuild each piece."""

    def __init__(self, args: Any):
        m = _charlm.CharTransformer(d_model=args.d_model, layers=args.layers, heads=args.heads,
                                    seq_len=args.seq_len, rngs=nnx.Rngs(args.seed))
        self.embed_def, embed = nnx.split(m.embed, nnx.Param)
        self.ln_def, ln = nnx.split(m.ln, nnx.Param)
        self.block_defs, blocks = [], []
        for b in m.blocks:
            d, s = nnx.split(b, nnx.Param)
            self.block_defs.append(d)
            blocks.append(s)
        self.params = {"top": {"embed": embed, "pos": jnp.asarray(m.pos[...]), "ln": ln},
                       "blocks": blocks}
        self.num_params = sum(int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(self.params))

    def loss(self, params: Any, batch: jax.Array, get: Callable[[Any, Any], Any]) -> jax.Array:
        """Next-character cross-entropy; ``get(name, piece)`` returns a piece's full weights
        (FSDP: a gather; ZeRO: the piece itself). Blocks run under ``jax.checkpoint``."""
        tokens = batch[:, :-1]
        top = get("top", params["top"])
        embed = nnx.merge(self.embed_def, top["embed"])
        h = embed(tokens) + top["pos"][: tokens.shape[1]]
        for i, (d, piece) in enumerate(zip(self.block_defs, params["blocks"])):
            h = jax.checkpoint(lambda p, x, d=d, i=i: nnx.merge(d, get(i, p))(x))(piece, h)
        logits = embed.attend(nnx.merge(self.ln_def, top["ln"])(h))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def codecs(weights: str, grads: str, block: int) -> tuple[Any, dict]:
    """The weight codec and the gradient codec keywords of a run."""
    q = lambda bits, st: cj.quantize(bits=bits, block_size=block, stochastic=st)  # noqa: E731
    w = {"none": None, "int8": q(8, False), "qwd4": q(4, False)}[weights]
    if grads == "two_level":
        return w, dict(grad_codec=cj.hadamard(q(4, True)), inner_grad_codec=q(8, True))
    return w, dict(grad_codec={"none": None, "int8": q(8, True), "int4": q(4, True)}[grads])


def mesh_of(grads: str):
    """``(mesh, axes of the batch)``: 8 devices, or ``2 x 4`` (slow x fast) for two levels."""
    if grads == "two_level":
        return _compat.make_mesh((2, 4), (AXIS, FAST)), (AXIS, FAST)
    return _compat.make_mesh((8,), (AXIS,)), (AXIS,)


def noniid_batch(corpus: Any, seed: int, step: int, size: int, seq_len: int, n: int = 8) -> np.ndarray:
    """Replica ``r``'s ``size`` windows come from the ``r``-th eighth of the text only."""
    region = (len(corpus.train) - seq_len - 1) // n
    rows = []
    for r in range(n):
        starts = r * region + np.random.default_rng([seed, step, r]).integers(0, region, size)
        rows.append(corpus.train[starts[:, None] + np.arange(seq_len + 1)])
    return np.concatenate(rows)


def fsdp_setup(model: Model, weights: str, grads: str, args: Any):
    """FSDP: the sharded parameters, Adam on the shards, and the compiled-to-be step."""
    mesh, axes = mesh_of(grads)
    two = grads == "two_level"
    w, g = codecs(weights, grads, args.block_size)
    # Device (o, i) of the 2 x 4 mesh holds chunk i * 2 + o (the two-level gather's order).
    shard_axes = (FAST, AXIS) if two else AXIS
    like = {"top": cj.fsdp_like(model.params["top"]),
            "blocks": [cj.fsdp_like(b) for b in model.params["blocks"]]}
    shards = jax.device_put(cj.fsdp_shard(model.params, 8, align=args.block_size),
                            NamedSharding(mesh, P(shard_axes)))
    tx = optax.adam(args.lr)
    opt = jax.jit(tx.init)(shards)
    ospecs = jax.tree_util.tree_map(lambda x: P(shard_axes) if np.ndim(x) else P(), opt)

    def local(sh, o, batch, key):
        def get(name, piece):
            lk = like["top"] if name == "top" else like["blocks"][name]
            k = jax.random.fold_in(key, 0 if name == "top" else name + 1)
            return cj.fsdp_gather(piece, AXIS, w, key=k, like=lk, inner_axis_name=FAST if two else None, **g)

        loss, grad = jax.value_and_grad(model.loss)(sh, batch, get)
        u, o = tx.update(grad, o, sh)
        return optax.apply_updates(sh, u), o, loss[None]

    step = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(shard_axes), ospecs, P(axes), P()),
                                     out_specs=(P(shard_axes), ospecs, P(axes))))
    full = lambda sh: cj.fsdp_unshard(jax.device_get(sh), like)  # noqa: E731
    return mesh, axes, step, shards, opt, full


def zero_setup(model: Model, weights: str, grads: str, args: Any):
    """ZeRO-2 with qWD: replicated parameters, ``cj.zero(optax.adam)``."""
    mesh, axes = mesh_of(grads)
    w, g = codecs(weights, grads, args.block_size)
    inner = FAST if grads == "two_level" else None
    tx = cj.zero(optax.adam(args.lr), AXIS, weight_codec=w, inner_axis_name=inner, **g)
    state = cj.init_sharded(tx, model.params, mesh, axes)
    specs = cj.state_specs(state, axes)

    def local(p, s, batch, key):
        del key  # zero folds its own keys from its state
        loss, grad = jax.value_and_grad(model.loss)(cj.vary(p, axes), batch, lambda name, x: x)
        u, s = tx.update(grad, s, p)
        return optax.apply_updates(p, u), s, loss[None]

    step = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(axes), P()),
                                     out_specs=(P(), specs, P(axes))))
    params = jax.device_put(model.params, NamedSharding(mesh, P()))
    return mesh, axes, step, params, state, jax.device_get


def in_sync(params: Any) -> bool:
    """Every device holds bit-identical (replicated) parameters."""
    for leaf in jax.tree_util.tree_leaves(params):
        copies = [np.asarray(s.data) for s in leaf.addressable_shards]
        if any(not np.array_equal(copies[0], c) for c in copies[1:]):
            return False
    return True


def train(model: Model, corpus: Any, weights: str, grads: str, args: Any, *, progress: bool = True) -> dict:
    """One run; returns its record (losses, held-out loss, HLO bytes per step)."""
    label = f"weights={weights} grads={grads}"
    setup = zero_setup if weights == "qwd4" else fsdp_setup
    mesh, axes, step, params, state, full = setup(model, weights, grads, args)
    place = lambda t: jax.device_put(  # noqa: E731
        noniid_batch(corpus, args.seed, t, args.batch_size, args.seq_len), NamedSharding(mesh, P(axes)))
    key = jax.random.PRNGKey(args.seed)
    t0 = time.time()
    compiled = step.lower(params, state, place(0), key).compile()
    hlo = cj.collective_bytes(compiled)
    slow = sum(c.ring_bytes for c in hlo.collectives if c.group_size == mesh.shape[AXIS])
    held_out = jnp.asarray(corpus.eval_batch(64, args.seq_len))
    eval_fn = jax.jit(lambda p: model.loss(p, held_out, lambda name, x: x))
    bar = _train.Progress(args.steps, desc=label, enabled=progress)
    losses, t1 = [], time.time()
    for t in range(args.steps):
        params, state, loss = compiled(params, state, place(t), jax.random.fold_in(key, t))
        losses.append(float(np.mean(_train.local_values(loss))))  # one step in flight at a time
        bar.update(losses[-1], (t + 1) * hlo.total_ring_bytes)
    bar.close()
    return {"label": label, "weights": weights, "grads": grads,
            "mode": "ZeRO-2 (cj.zero)" if weights == "qwd4" else "FSDP (cj.fsdp_gather)",
            "losses": losses, "final_train": float(np.mean(losses[-max(1, len(losses) // 10):])),
            "held_out": float(eval_fn(full(params))), "hlo_bytes_per_step": hlo.total_ring_bytes,
            "slow_axis_bytes_per_step": float(slow), "compile_s": t1 - t0, "train_s": time.time() - t1,
            # FSDP replicas hold different shards by design (and decode the same gathers).
            "replicas_in_sync": in_sync(params) if weights == "qwd4" else None}


def summary(results: list) -> str:
    base = results[0]
    rows = []
    for r in results:
        rows.append({"run": r["label"], "mode": r["mode"], "held": f"{r['held_out']:.4f}",
                     "gap": f"{100 * (r['held_out'] - base['held_out']) / base['held_out']:+.2f}%",
                     "bytes": _train.human_bytes(r["hlo_bytes_per_step"]),
                     "x": f"{base['hlo_bytes_per_step'] / r['hlo_bytes_per_step']:.2f}x",
                     "slow": _train.human_bytes(r["slow_axis_bytes_per_step"]),
                     "time": f"{r['train_s']:.0f}s"})
    cols = [("run", "run"), ("mode", "mode"), ("held", "held-out loss"), ("gap", "gap to exact"),
            ("bytes", "bytes/step/device*"), ("x", "fewer bytes"), ("slow", "on the slow axis**"),
            ("time", "train time")]
    return (_train.table(rows, cols) + "\n* every collective of the compiled step (HLO; XLA "
            "merged the rematerialised gathers with the forward ones)\n** two_level: the "
            "collectives over the 2-wide (slow, cross-node) axis only; otherwise all of them")


def plot(results: list, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.3), dpi=110)
    for i, r in enumerate(results):
        ys = np.asarray(r["losses"])
        k = max(1, len(ys) // 25)
        sm = np.convolve(ys, np.ones(k) / k, "valid")
        steps = np.arange(k, len(ys) + 1)
        a1.plot(steps * r["hlo_bytes_per_step"] / 1e6, sm, color=f"C{i % 10}", label=r["label"])
        a2.plot(steps, sm, color=f"C{i % 10}", label=r["label"])
    a1.set(xscale="log", xlabel="MB sent per device (HLO, cumulative)", ylabel="training loss",
           title="loss against bytes")
    a2.set(xlabel="step", ylabel="training loss", title="loss against steps (8 replicas, non-i.i.d.)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    return _train.save_figure(fig, path)
