"""Deep Gradient Compression (Lin et al., 2018) as a complete optax optimizer.

One step on replica ``r`` of ``N`` for the compressed leaves (flattened into one bucket),
momentum ``m``, density ``rho_t`` and learning rate ``eta_t``::

    g   = clip(g_r + wd * w, clip_norm / sqrt(N))      # local gradient clipping
    u  <- m u + g                                       # momentum correction: local
    v  <- v + u                                         #   momentum, then accumulation
    S   = top-k(|v|), k = ceil(rho_t |leaf|) per leaf   # the entries sent
    G   = (1/N) sum_r v_r[S_r]                          # all-gather + scatter-add
    v[S] <- 0;  u[S] <- 0                               # momentum factor masking
    update = -eta_t G

With ``nesterov=True``: ``u <- m (u + g)``, ``v <- v + u + g``. Small, 1-D and otherwise
uncompressed leaves (see [`commjax.plan`][]) are averaged exactly in one fp32 all-reduce
and get ordinary momentum SGD with a replicated buffer (``u <- m u + mean(g)``).

The density warms up exponentially (Section 3.4 of the paper): with the default
``warmup_ratios`` and ``ratio=0.001`` the densities are 25%, 6.25%, 1.5625%, 0.39%, then
0.1% (sparsity 75%, 93.75%, 98.4375%, 99.6%, 99.9%), the first four stages sharing the
first ``warmup_steps`` steps equally.

Reference: Y. Lin, S. Han, H. Mao, Y. Wang, W. J. Dally, "Deep Gradient Compression:
Reducing the Communication Bandwidth for Distributed Training", ICLR 2018.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from commjax import bucket as flat_bucket, guards, validation
from commjax.accounting import CommunicationPlan, Transfer, ring_bytes, with_plan
from commjax.collectives._exact import exact_mean
from commjax.collectives._reducers import reduce_parts
from commjax.compressors.base import Segment
from commjax.compressors.sparse import TopK, top_k
from commjax.layout import per_replica
from commjax.plan import COMPRESS, EXACT, PASS, MeanPlan, make_plan

__all__ = ["DGCState", "dgc", "dgc_ratios"]

METRIC_NAMES = ("density", "ratio", "residual_norm", "nonfinite")


@per_replica("momentum", "accumulation", "metrics")
class DGCState(NamedTuple):
    """State of [`dgc`][commjax.optimizers.dgc.dgc].

    Attributes:
      count: int32 scalar, replicated: steps done (drives the learning-rate schedule and
        the density warm-up).
      momentum: per-replica ``float32[n]``: the local momentum ``u`` of the compressed
        bucket (leaves flattened and concatenated as in [`commjax.plan`][]).
      accumulation: per-replica ``float32[n]``: the local accumulation ``v`` (what has
        not been sent yet).
      dense_momentum: replicated ``float32[m]``: momentum of the exactly averaged leaves.
      metrics: per-replica ``float32[1]`` values of the last step: ``density`` (fraction
        of the compressed bucket sent as non-zeros), ``ratio`` (target density of the
        step), ``residual_norm`` (``||v||`` after sending), ``nonfinite`` (1 if some
        replica's gradient had a NaN/Inf).
    """

    count: jax.Array
    momentum: jax.Array
    accumulation: jax.Array
    dense_momentum: jax.Array
    metrics: dict


def dgc_ratios(ratio: float, warmup_ratios: Optional[Sequence[float]] = None) -> tuple[float, ...]:
    """The densities of the warm-up stages followed by the final ``ratio``.

    Default warm-up: ``0.25, 0.25/4, 0.25/16, ...`` while larger than ``ratio``.
    """
    if warmup_ratios is None:
        stages = []
        d = 0.25
        while d > ratio * (1 + 1e-9):
            stages.append(d)
            d /= 4.0
        warmup_ratios = stages
    return tuple(float(r) for r in warmup_ratios) + (float(ratio),)


@dataclasses.dataclass(frozen=True)
class _Config:
    learning_rate: Any
    momentum: float
    ratios: tuple[float, ...]
    axis_name: Any
    clip_norm: Optional[float]
    warmup_steps: int
    nesterov: bool
    weight_decay: float
    codec: TopK  # options of the top-k codec; ratio replaced per stage
    min_compress_size: int
    compress_vectors: bool

    def codecs(self) -> list[TopK]:
        return [dataclasses.replace(self.codec, ratio=r) for r in self.ratios]

    def plan(self, leaves: Sequence[Any], num_replicas: int) -> MeanPlan:
        return make_plan(
            leaves, self.codecs()[-1], num_replicas=num_replicas,
            reducer="allgather" if num_replicas > 1 else "auto",
            min_compress_size=self.min_compress_size, compress_vectors=self.compress_vectors,
            check_finite=False,
        )


def _size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) if shape else 1


def _stage(cfg: _Config, count: jax.Array) -> jax.Array:
    s = len(cfg.ratios) - 1
    if s == 0 or cfg.warmup_steps <= 0:
        return jnp.full((), s, jnp.int32)
    c = jnp.minimum(count, cfg.warmup_steps).astype(jnp.int32)
    return jnp.minimum((c * s) // cfg.warmup_steps, s).astype(jnp.int32)


def _init(cfg: _Config, params: Any) -> DGCState:
    validation.check_real_leaves(params, factory="dgc")
    leaves = jax.tree_util.tree_leaves(params)
    plan = cfg.plan(leaves, 1)
    m = sum(_size(s) for s, r in zip(plan.shapes, plan.routes) if r == EXACT)
    return DGCState(
        count=jnp.zeros((), jnp.int32),
        momentum=jnp.zeros((plan.compressed_size,), jnp.float32),
        accumulation=jnp.zeros((plan.compressed_size,), jnp.float32),
        dense_momentum=jnp.zeros((m,), jnp.float32),
        metrics={k: jnp.zeros((1,), jnp.float32) for k in METRIC_NAMES},
    )


def _validate(cfg: _Config, leaves, state: DGCState):
    """Axis bound, gradients unreduced, state made for them: ``(plan, N)``."""
    n_rep = guards.check_bound(cfg.axis_name, "dgc")
    plan = cfg.plan(leaves, n_rep)
    if cfg.axis_name is not None:
        guards.check_unreduced(leaves, cfg.axis_name, "dgc")
    if state.momentum.shape[0] != plan.compressed_size:
        raise ValueError(
            f"dgc: the state's momentum has {state.momentum.shape[0]} elements but these "
            f"gradients need {plan.compressed_size}: was the state made by init() for other "
            "parameters?")
    return plan, n_rep


def _local_gradients(cfg: _Config, leaves, treedef, plan, params, n_rep):
    """fp32 local gradients with weight decay and local clipping; ``(g, finite here)``."""
    floats = [i for i, r in enumerate(plan.routes) if r != PASS]
    g = {i: leaves[i].astype(jnp.float32) for i in floats}
    if cfg.weight_decay:
        if params is None:
            raise ValueError("dgc: weight_decay needs the parameters: call update(grads, state, params).")
        p_leaves = treedef.flatten_up_to(params)
        g = {i: g[i] + cfg.weight_decay * p_leaves[i].astype(jnp.float32) for i in floats}
    local_ok = guards.tree_all_finite([g[i] for i in floats])
    if cfg.clip_norm is not None and floats:
        # Threshold scaled by N^{-1/2}: the sum of N independent local gradients then has
        # about the norm of one clipped global gradient.
        thr = cfg.clip_norm / math.sqrt(n_rep)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(jnp.where(local_ok, g[i], 0.0))) for i in floats))
        scale = jnp.where(norm > thr, thr / jnp.where(norm > 0, norm, 1.0), 1.0)
        g = {i: g[i] * scale for i in floats}
    return g, local_ok


def _momentum(cfg: _Config, u, v, g):
    """Momentum correction: ``u <- m u + g, v <- v + u`` (Nesterov: ``u <- m (u + g)``,
    ``v <- v + u + g``); ``v`` is None for the dense leaves (returns the update)."""
    mom = cfg.momentum
    if cfg.nesterov:
        u = mom * (u + g)
        return u, (u + g) if v is None else v + u + g
    u = mom * u + g
    return u, u if v is None else v + u


def _sparse_exchange(cfg: _Config, v, plan, state: DGCState, n_rep: int):
    """Top-k of ``v`` per leaf at this stage's density, all-gathered: ``(mean, local)``,
    ``local`` this replica's own sent entries (zeros elsewhere)."""
    segs = plan.segments
    parts = [v[s.offset:s.offset + s.padded_size] for s in segs]
    red = plan.reducer_impl

    def branch(codec: TopK):
        def reduce(ps):
            res = reduce_parts(codec, red, ps, segs, axis_name=cfg.axis_name,
                               num_replicas=n_rep, key=None)
            return flat_bucket.concat(res.means), flat_bucket.concat(res.residuals)
        return reduce

    branches = [branch(c) for c in cfg.codecs()]
    if len(branches) == 1:
        return branches[0](parts)
    return lax.switch(_stage(cfg, state.count), branches, parts)


def _update(cfg: _Config, updates: Any, state: DGCState, params: Any):
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    plan, n_rep = _validate(cfg, leaves, state)
    g, local_ok = _local_gradients(cfg, leaves, treedef, plan, params, n_rep)
    exact_idx = [i for i, r in enumerate(plan.routes) if r == EXACT]
    comp_idx = [i for i, r in enumerate(plan.routes) if r == COMPRESS]
    flag = jnp.where(local_ok, 0.0, 1.0).reshape(1)
    means, _ = exact_mean([g[i] for i in exact_idx] + [flag], cfg.axis_name, n_rep)
    bad = means[-1][0] != 0  # also True for a NaN flag
    lr = jnp.asarray(cfg.learning_rate(state.count) if callable(cfg.learning_rate)
                     else cfg.learning_rate, jnp.float32)
    out: list[Any] = [jnp.zeros_like(l) for l in leaves]
    # Exact leaves: momentum SGD on the exact mean, replicated buffer.
    g_exact = flat_bucket.concat(means[:-1]) if exact_idx else jnp.zeros((0,), jnp.float32)
    du_new, d_upd = _momentum(cfg, state.dense_momentum, None, g_exact)
    new_dense = jnp.where(bad, state.dense_momentum, du_new)
    for i, s in zip(exact_idx, flat_bucket.cut(d_upd, _offsets(plan, exact_idx))):
        out[i] = jnp.where(bad, jnp.nan, -lr * s).reshape(plan.shapes[i]).astype(leaves[i].dtype)
    new_u, new_v = state.momentum, state.accumulation
    density = jnp.zeros((), jnp.float32)
    if comp_idx:
        gc = jnp.where(local_ok, flat_bucket.concat([jnp.ravel(g[i]) for i in comp_idx]), 0.0)
        u, v = _momentum(cfg, state.momentum, state.accumulation, gc)
        if cfg.axis_name is not None:
            # Exact all-reduce first: the same collective order on every device.
            _, v = lax.optimization_barrier((means[-1], v))
        mean, local = _sparse_exchange(cfg, v, plan, state, n_rep)
        # Sent entries leave the accumulation (the bf16 rounding error stays), and their
        # momentum is masked.
        sent = local != 0
        v_out = v - local
        new_v = jnp.where(bad, state.accumulation, v_out)
        new_u = jnp.where(bad, state.momentum, jnp.where(sent, 0.0, u))
        density = jnp.sum(sent).astype(jnp.float32) / max(plan.compressed_size, 1)
        upd = jnp.where(bad, jnp.nan, -lr * mean)
        for i, seg in zip(comp_idx, plan.segments):
            out[i] = upd[seg.offset:seg.offset + seg.size].reshape(seg.shape).astype(leaves[i].dtype)
    metrics = {
        "density": density.reshape(1),
        "ratio": jnp.asarray(cfg.ratios, jnp.float32)[_stage(cfg, state.count)].reshape(1),
        "residual_norm": guards.l2_norm([new_v]).reshape(1),
        "nonfinite": bad.astype(jnp.float32).reshape(1),
    }
    new_state = DGCState(count=state.count + 1, momentum=new_u, accumulation=new_v,
                         dense_momentum=new_dense, metrics=metrics)
    return jax.tree_util.tree_unflatten(treedef, out), new_state


def _offsets(plan, idx):
    """Segments of the exact leaves ``idx`` laid back to back (for ``bucket.cut``)."""
    out, pos = [], 0
    for i in idx:
        size = _size(plan.shapes[i])
        out.append(Segment(pos, size, size, plan.shapes[i]))
        pos += size
    return out


def dgc(
    learning_rate: optax.ScalarOrSchedule,
    *,
    momentum: float = 0.9,
    ratio: float = 0.001,
    axis_name: Any = "data",
    clip_norm: Optional[float] = None,
    warmup_steps: int = 0,
    warmup_ratios: Optional[Sequence[float]] = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    approximate: bool = False,
    scope: str = "leaf",
    values_dtype: Any = jnp.float32,
    chunk_size: Optional[int] = None,
    min_compress_size: int = 1024,
    compress_vectors: bool = False,
) -> optax.GradientTransformation:
    """Deep Gradient Compression: momentum SGD that sends only the top ``ratio`` of its
    locally accumulated update each step.

    Use it as the whole optimizer, inside ``shard_map``/``pmap`` over ``axis_name``, with
    per-replica gradients::

        tx = cj.dgc(0.1, momentum=0.9, ratio=0.001, warmup_steps=4 * steps_per_epoch)
        updates, opt_state = tx.update(grads, opt_state, params)

    Maths (replica ``r``, see the module docstring for the whole step): local clipping
    of ``g_r`` to norm ``clip_norm / sqrt(N)``; momentum correction ``u <- m u + g``,
    ``v <- v + u``; the top-k entries of ``|v|`` of every compressed leaf are
    all-gathered and averaged, ``G = (1/N) sum_r top_k(v_r)``; the sent entries are
    cleared from ``v`` and ``u`` (momentum factor masking); ``update = -eta_t G``.
    Exactly averaged leaves (small or 1-D) get plain momentum SGD.

    Bytes per device and step (``N`` replicas, ``K`` entries kept per replica, ``E``
    exact elements): ``(N - 1) * 8 K`` (fp32 values, uint32 indices) plus
    ``2 (N - 1)/N * 4 (E + 1)`` for the exact all-reduce (one float is the NaN flag); see
    [`commjax.communication_plan`][]. During warm-up ``K`` follows the stage's density.

    Non-finite gradients: if any replica's gradient has a NaN/Inf, the update is NaN on
    every replica and ``u``, ``v`` and the dense momentum keep their previous values.

    Args:
      learning_rate: a float or an optax schedule ``count -> lr``.
      momentum: ``m`` in [0, 1).
      ratio: final density in (0, 1] (0.001 = 99.9% sparsity).
      axis_name: mesh axis (or tuple) of the data-parallel replicas; ``None`` for one
        replica without collectives.
      clip_norm: global-norm clipping threshold of the *global* gradient; each replica
        clips its local gradient to ``clip_norm / sqrt(N)``. ``None``: no clipping.
      warmup_steps: steps of the density warm-up (0: ``ratio`` from the first step).
      warmup_ratios: densities of the warm-up stages, each in (0, 1]; default
        ``0.25, 0.0625, ...`` (divided by 4 while above ``ratio``). The stages share the
        ``warmup_steps`` equally, then ``ratio`` applies.
      nesterov: Nesterov momentum correction (``u <- m (u + g)``, ``v <- v + u + g``).
      weight_decay: L2 term ``wd * w`` added to the local gradient (needs ``params``).
      approximate, scope, values_dtype, chunk_size: options of the top-k codec, see
        [`commjax.compressors.sparse.top_k`][].
      min_compress_size, compress_vectors: which leaves are sparsified, as in
        [`commjax.compressed_mean`][].

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      [`DGCState`][commjax.optimizers.dgc.DGCState]. Lay it out
      for ``shard_map`` with [`commjax.shard_state`][] / [`commjax.state_specs`][].
    """
    f = "dgc"
    ratio = validation.check_ratio("ratio", ratio, factory=f)
    momentum = validation.check_float("momentum", momentum, 0.0, 1.0, factory=f, hi_open=True)
    if not callable(learning_rate):
        validation.check_float("learning_rate", learning_rate, 0.0, math.inf, factory=f, hi_open=True)
    if clip_norm is not None:
        clip_norm = validation.check_float("clip_norm", clip_norm, 0.0, math.inf, factory=f,
                                           lo_open=True, hi_open=True)
    weight_decay = validation.check_float("weight_decay", weight_decay, 0.0, math.inf, factory=f,
                                          hi_open=True)
    validation.check_int("warmup_steps", warmup_steps, 0, factory=f)
    if warmup_ratios is not None:
        if isinstance(warmup_ratios, (str, bytes)) or not isinstance(warmup_ratios, Sequence):
            raise ValueError(f"dgc: `warmup_ratios` must be None or a sequence of densities in (0, 1], got {warmup_ratios!r}.")
        for r in warmup_ratios:
            validation.check_ratio("warmup_ratios", r, factory=f)
    validation.check_int("min_compress_size", min_compress_size, 1, factory=f)
    codec = top_k(ratio, approximate=approximate, scope=scope, values_dtype=values_dtype, chunk_size=chunk_size)
    cfg = _Config(
        learning_rate=learning_rate, momentum=momentum,
        ratios=dgc_ratios(ratio, warmup_ratios) if warmup_steps > 0 else (ratio,),
        axis_name=tuple(axis_name) if isinstance(axis_name, list) else axis_name,
        clip_norm=clip_norm, warmup_steps=int(warmup_steps), nesterov=bool(nesterov),
        weight_decay=weight_decay, codec=codec, min_compress_size=min_compress_size,
        compress_vectors=bool(compress_vectors),
    )

    def init_fn(params):
        return _init(cfg, params)

    def update_fn(updates, state, params=None):
        return _update(cfg, updates, state, params)

    return with_plan(optax.GradientTransformation(init_fn, update_fn), functools.partial(_plan, cfg))


def _plan(cfg: _Config, params: Any, num_replicas: int) -> CommunicationPlan:
    """What one [`dgc`][commjax.optimizers.dgc.dgc] step sends per device (its
    [`commjax.communication_plan`][]):
    the exact leaves and one NaN/Inf flag in one fp32 all-reduce, the compressed leaves'
    top-k payloads in one all-gather at the final density; each warm-up density's
    all-gather sits in its own branch of the compiled step."""
    leaves = jax.tree_util.tree_leaves(params)
    mp = cfg.plan(leaves, num_replicas)
    exact = ring_bytes("all-reduce", 4 * (mp.exact_size + 1), num_replicas)
    transfers = [Transfer("exact bucket", "all-reduce", exact)] if exact else []
    for k, r in enumerate(cfg.ratios):
        sent = dataclasses.replace(cfg, ratios=(r,)).plan(leaves, num_replicas).compressed_bytes
        last = k == len(cfg.ratios) - 1
        if sent:
            transfers.append(Transfer(f"top-k at density {r:g}" + ("" if last else " (warm-up)"),
                                      mp.reducer, sent, 1 if last else 0))
    return CommunicationPlan("dgc", num_replicas, tuple(transfers), mp.baseline_bytes, routing=mp)
