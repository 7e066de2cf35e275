"""``compressed_mean``: the optax transform that replaces gradients by a compressed mean.

One step on replica ``i`` of ``N`` (all leaves of the compressed bucket at once)::

    x_i   = g_i + e_i                      # error feedback: add what was not sent before
    p_i   = encode(x_i)                    # compressor payload, uint32 words
    m     = reduce(p_1..p_N) ~ mean_i x_i  # reducer, identical on every replica
    e_i  <- x_i - decode(p_i)              # worker residual (if error_feedback)
    return m

The compressed leaves form one *bucket* (one payload, one set of collectives), but its
full-size float vector is never written: ``x``, the residual and the mean are kept per
leaf, block codecs encode each leaf into its share of the payload words
(:func:`commjax.reducers.reduce_mean_parts`) and PowerSGD works leaf by leaf. Only
codecs whose selection spans leaves (top-k, random-k, threshold) join ``x``.

Small, 1-D and otherwise uncompressible floating leaves are averaged exactly in one fused
fp32 all-reduce; integer leaves pass through. See :mod:`commjax.plan` for the routing and
:mod:`commjax.reducers` for the bytes each reducer sends.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from commjax import _compat, bucket as flat_bucket
from commjax.compressors.base import Compressor
from commjax.layout import per_replica
from commjax.plan import COMPRESS, EXACT, PASS, CommunicationPlan, make_plan
from commjax.reducers import check_reducer, reduce_mean_parts

__all__ = ["CompressedMeanState", "compressed_mean", "AxisNotBoundError"]


class AxisNotBoundError(NameError):
    """``compressed_mean`` was called where its mesh axis is not bound."""


@per_replica("residual", "server_residual", "metrics")
class CompressedMeanState(NamedTuple):
    """State of :func:`compressed_mean`.

    Attributes:
      count: int32 scalar, replicated. Exchanges done so far.
      key: uint32[2] raw PRNG key, replicated. Per-step and per-replica keys are folded
        from it (``fold_in(fold_in(key, count), axis_index)``), so it never needs to differ
        between replicas and is never split in the state.
      residual: per-replica worker error-feedback residuals, a tuple with one flat array
        (``float32`` or ``residual_dtype``) per compressed leaf, in the order of
        ``communication_plan(...).segments``; ``()`` without error feedback and for a
        lossless compressor (the identity), whose residual would always be zero. Kept per
        leaf so that the step reads and writes each in place, never a joined copy.
      server_residual: per-replica residual of the two-phase reducer's re-encoding, one
        chunk of the bucket; shape ``[0]`` for other reducers.
      compressor_state: replicated state of a compressor with its own exchange (PowerSGD's
        Q factors); ``()`` otherwise.
      metrics: per-replica ``float32[1]`` values of the last step, computed locally with no
        extra collective: ``residual_norm`` (l2 norm of this replica's worker residual),
        ``nonfinite`` (1 if a compressed leaf was non-finite on some replica), and the
        compressor's own (``compressor.metric_names``).
    """

    count: jax.Array
    key: jax.Array
    residual: tuple
    server_residual: jax.Array
    compressor_state: Any
    metrics: dict


@dataclasses.dataclass(frozen=True)
class ExchangeConfig:
    compressor: Compressor
    axis_name: Any
    inner_axis_name: Any
    error_feedback: bool
    reducer: str
    min_compress_size: int
    compress_vectors: bool
    residual_dtype: Any
    server_error_feedback: bool
    check_finite: bool
    num_replicas: Optional[int]
    seed: int

    def plan(self, leaves, num_replicas: int) -> CommunicationPlan:
        return make_plan(
            leaves, self.compressor, num_replicas=num_replicas, reducer=self.reducer,
            min_compress_size=self.min_compress_size, compress_vectors=self.compress_vectors,
            check_finite=self.check_finite,
        )


def _residual_shapes(cfg: ExchangeConfig, plan: CommunicationPlan) -> tuple[tuple[int, ...], ...]:
    """Shape of each worker residual the state holds: one flat array per compressed leaf,
    none without error feedback or for a lossless compressor."""
    if not cfg.error_feedback or cfg.compressor.lossless:
        return ()
    return tuple((s.size,) for s in plan.segments)


def _unbound_message(axis_name: Any) -> str:
    return (
        f"compressed_mean: mesh axis {axis_name!r} is not bound here. Gradient compression "
        "needs each replica's own gradient, so the update must run inside jax.shard_map (or "
        "jax.pmap) over that axis, e.g.\n\n"
        "    step = jax.jit(jax.shard_map(train_step, mesh=mesh,\n"
        f"        in_specs=(P(), cj.state_specs(opt_state, {axis_name!r}), P({axis_name!r})),\n"
        f"        out_specs=(P(), cj.state_specs(opt_state, {axis_name!r}))))\n\n"
        "or pass axis_name=None to study the compressor on one replica without communication."
    )


def _num_replicas_now(cfg: ExchangeConfig) -> int:
    if cfg.axis_name is None:
        return 1
    if _compat.axis_is_bound(cfg.axis_name):
        return _compat.axis_size(cfg.axis_name)
    if cfg.num_replicas is not None:
        return cfg.num_replicas
    if cfg.inner_axis_name is not None:
        raise ValueError(
            "compressed_mean: with `inner_axis_name`, init() outside shard_map cannot tell how "
            f"many replicas the outer axis {cfg.axis_name!r} has. Pass num_replicas=<size of "
            f"{cfg.axis_name!r}> to compressed_mean, or initialise with "
            "cj.init_sharded(tx, params, mesh, axis_name)."
        )
    return jax.device_count()


def _check_unreduced(leaves, routes, axis_name) -> None:
    """Under check_vma=True, refuse gradients that JAX has already summed over the axis."""
    tracked = _compat.varying_axes(lax.axis_index(axis_name))
    if not tracked or axis_name not in tracked:
        return  # check_vma=False or pmap: nothing is tracked
    for leaf, r in zip(leaves, routes):
        if r == PASS:
            continue
        vma = _compat.varying_axes(leaf)
        if vma is not None and axis_name not in vma:
            raise ValueError(
                f"compressed_mean: a gradient leaf of shape {jnp.shape(leaf)} is replicated "
                f"(invariant) over {axis_name!r}: under shard_map(check_vma=True) JAX sums the "
                "gradient of replicated parameters over the axis itself, before any "
                "compression. Take the gradient with respect to "
                f"cj.vary(params, {axis_name!r}) instead, or run shard_map with "
                "check_vma=False."
            )


def _all_finite(x: jax.Array) -> jax.Array:
    """``jnp.all(jnp.isfinite(x))``, mostly from one sum: a finite sum proves every element
    finite (a NaN or an infinity would make it non-finite), and a reduction to one number
    is several times cheaper than the elementwise test on CPU. Only a non-finite sum (a
    NaN or Inf, or a sum that overflowed) runs the elementwise test to decide."""
    total = jnp.sum(x, dtype=jnp.float32)
    return lax.cond(jnp.isfinite(total), lambda v: jnp.isfinite(total),
                    lambda v: jnp.all(jnp.isfinite(v)), x)


def _update(cfg: ExchangeConfig, updates, state: CompressedMeanState):
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    axis = cfg.axis_name
    for name in (axis, cfg.inner_axis_name):
        if name is not None and not _compat.axis_is_bound(name):
            raise AxisNotBoundError(_unbound_message(name))
    n_rep = 1 if axis is None else _compat.axis_size(axis)
    plan = cfg.plan(leaves, n_rep)
    if axis is not None:
        _check_unreduced(leaves, plan.routes, axis)
    if cfg.inner_axis_name is not None:
        # Exact mean over the fast inner axis first; only the slow axis sees compression.
        inner = cfg.inner_axis_name
        leaves = [
            l if r == PASS else (_compat.psum(l.astype(jnp.float32), inner)
                                 / _compat.axis_size(inner)).astype(l.dtype)
            for l, r in zip(leaves, plan.routes)
        ]
    want = _residual_shapes(cfg, plan)
    have = tuple(tuple(jnp.shape(r)) for r in state.residual)
    if have != want:
        raise ValueError(
            f"compressed_mean: the state's residual holds arrays of shapes {have} but these "
            f"gradients need {want} (one per compressed leaf): was the state made by init() "
            "for other parameters or other options?"
        )
    if state.server_residual.shape[0] != plan.server_residual_size:
        raise ValueError(
            "compressed_mean: the state was initialised for a different number of replicas "
            f"(server residual of {state.server_residual.shape[0]} elements, {n_rep} replicas "
            f"need {plan.server_residual_size}). Pass num_replicas={n_rep} to compressed_mean, "
            "or create the state with cj.init_sharded(tx, params, mesh, axis_name)."
        )

    step_key = jax.random.fold_in(state.key, state.count)
    replica_key = step_key if axis is None else jax.random.fold_in(step_key, lax.axis_index(axis))

    out: list[Any] = list(leaves)
    exact_idx = [i for i, r in enumerate(plan.routes) if r == EXACT]
    comp_idx = [i for i, r in enumerate(plan.routes) if r == COMPRESS]
    ef = cfg.error_feedback and not cfg.compressor.lossless
    # A lossless linear payload (the fp32 identity) is the leaf itself: its leaves join the
    # exact bucket's all-reduce as further operands of the same collective, uncopied.
    direct = cfg.compressor.lossless and plan.reducer in ("allreduce", "none")

    # Per-leaf local finiteness of the compressed leaves, shared through the exact bucket.
    # Without check_finite nothing is tested: a NaN flows through the codec into the mean,
    # identically on every replica (they all decode the same payloads).
    check = cfg.check_finite
    local_ok = [_all_finite(leaves[i]) for i in comp_idx] if check else []
    flags = [jnp.where(ok, 0.0, 1.0).reshape(1) for ok in local_ok]
    exact_parts = [jnp.ravel(leaves[i]).astype(jnp.float32) for i in exact_idx] + flags
    direct_parts = [leaves[i].astype(jnp.float32) for i in comp_idx] if direct else []
    global_bad = [jnp.logical_not(ok) for ok in local_ok]
    bucket = None
    if exact_parts or direct_parts:
        bucket = flat_bucket.concat(exact_parts) if exact_parts else jnp.zeros((0,), jnp.float32)
        if axis is not None:
            bucket, *direct_parts = [v / n_rep for v in _compat.psum([bucket] + direct_parts, axis)]
        pos = 0
        for i in exact_idx:
            size = int(np.prod(plan.shapes[i])) if plan.shapes[i] else 1
            out[i] = bucket[pos:pos + size].reshape(plan.shapes[i]).astype(leaves[i].dtype)
            pos += size
        if check:
            # `!= 0` is also True for a NaN flag.
            global_bad = [bucket[pos + k] != 0 for k in range(len(comp_idx))]
    any_bad = jnp.any(jnp.stack(global_bad)) if global_bad else jnp.zeros((), bool)

    new_residual = state.residual
    new_server = state.server_residual
    new_comp_state = state.compressor_state
    comp_metrics: dict = {}
    if comp_idx and direct:
        for k, i in enumerate(comp_idx):
            m = jnp.where(global_bad[k], jnp.nan, direct_parts[k]) if check else direct_parts[k]
            out[i] = m.astype(leaves[i].dtype)
    elif comp_idx:
        # x_i = g_i + e_i, one padded part per leaf.
        xs = []
        for k, i in enumerate(comp_idx):
            g = jnp.ravel(leaves[i]).astype(jnp.float32)
            xs.append(g + state.residual[k].astype(jnp.float32) if ef else g)
        parts = [jnp.pad(x, (0, seg.padded_size - seg.size)) for x, seg in zip(xs, plan.segments)]
        if check and not cfg.compressor.leaf_local:
            # A non-finite leaf would spoil the others' encoding: it contributes zeros.
            # (Leaf-local codecs keep it in its own blocks, and its mean is NaN anyway.)
            # Decided once for the bucket: a select inside the fusion that joins the
            # bucket made it several times slower on CPU.
            parts = lax.cond(
                jnp.all(jnp.stack(local_ok)), lambda ps: list(ps),
                lambda ps: [jnp.where(ok, p, 0.0) for p, ok in zip(ps, local_ok)], parts)
            xs = [p[:seg.size] for p, seg in zip(parts, plan.segments)]
        if bucket is not None and axis is not None:
            # Sequence the exact all-reduce before the compressed collectives: XLA may
            # otherwise start independent collectives in a different order on different
            # devices, which deadlocks runtimes that rendezvous per collective (CPU).
            bucket, parts = lax.optimization_barrier((bucket, parts))
        if cfg.compressor.metric_names:
            comp_metrics = cfg.compressor.local_metrics(flat_bucket.concat(parts), plan.segments)
        if cfg.compressor.has_exchange:
            means, locals_, comp_state = cfg.compressor.exchange_parts(
                parts, plan.segments, state.compressor_state,
                axis_name=axis if n_rep > 1 else None, num_replicas=n_rep, key=replica_key,
                shared_key=step_key, count=state.count,
            )
            new_comp_state = comp_state
            if check:
                # The flags are shared, so this keeps the replicated state replicated.
                new_comp_state = jax.tree_util.tree_map(
                    lambda new, old: jnp.where(any_bad, old, new), comp_state, state.compressor_state
                )
        else:
            # Block codecs encode leaf by leaf: the joined bucket is never written.
            res = reduce_mean_parts(
                cfg.compressor, parts, plan.segments, axis_name=axis, num_replicas=n_rep,
                reducer=plan.reducer, key=replica_key, shared_key=step_key,
                server_residual=state.server_residual if plan.server_residual_size else None,
                server_error_feedback=cfg.server_error_feedback,
            )
            means, locals_ = res.means, res.locals
            if plan.server_residual_size:
                new_server = res.server_residual
                if check:
                    new_server = jnp.where(any_bad, state.server_residual, new_server)
        res_parts = []
        for k, (i, seg) in enumerate(zip(comp_idx, plan.segments)):
            m = means[k]
            if axis is not None and n_rep == 1:
                # An axis of size one: no reducer ran; a (free) psum types the mean replicated.
                m = _compat.psum(m, axis)
            if check:
                m = jnp.where(global_bad[k], jnp.nan, m)
            out[i] = m.reshape(seg.shape).astype(leaves[i].dtype)
            if ef:
                # Compilers may fuse decode's last multiply into this subtraction (FMA):
                # then e' is x - C(x) rounded once instead of twice (<= 1 ulp apart).
                e = (xs[k] - locals_[k]).astype(cfg.residual_dtype)
                if check:
                    e = jnp.where(global_bad[k], state.residual[k], e)
                res_parts.append(e)
        if ef:
            new_residual = tuple(res_parts)

    metrics = {
        "residual_norm": jnp.sqrt(sum((jnp.sum(jnp.square(e.astype(jnp.float32))) for e in new_residual),
                                      jnp.zeros((), jnp.float32))).reshape(1),
        "nonfinite": any_bad.astype(jnp.float32).reshape(1),
    }
    for name in cfg.compressor.metric_names:
        metrics[name] = jnp.asarray(comp_metrics.get(name, 0.0), jnp.float32).reshape(1)
    new_state = CompressedMeanState(
        count=state.count + 1, key=state.key, residual=new_residual, server_residual=new_server,
        compressor_state=new_comp_state, metrics=metrics,
    )
    return jax.tree_util.tree_unflatten(treedef, out), new_state


def compressed_mean(
    compressor: Compressor,
    axis_name: Any = "data",
    *,
    inner_axis_name: Any = None,
    error_feedback: bool = True,
    reducer: str = "auto",
    min_compress_size: int = 1024,
    compress_vectors: bool = False,
    residual_dtype: Any = jnp.float32,
    server_error_feedback: bool = True,
    check_finite: bool = True,
    num_replicas: Optional[int] = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """Replace per-replica gradients by a compressed estimate of their mean over ``axis_name``.

    Put it first in an ``optax.chain``; the optimizer after it sees a mean that is
    identical on every replica::

        tx = optax.chain(cj.compressed_mean(cj.quantize(bits=4), "data"), optax.adam(1e-3))

    Maths (replica ``i`` of ``N``, compressor ``C``, worker residual ``e_i``)::

        x_i = g_i + e_i;   m = R(C(x_1), ..., C(x_N)) ~ (1/N) sum_i C(x_i);   e_i <- x_i - C(x_i)

    With ``error_feedback=False``, ``x_i = g_i`` and ``e`` is not kept. With the two-phase
    reducer the owner of each chunk keeps a second, server-side residual for its
    re-encoding of the chunk's mean (``server_error_feedback``).

    Non-finite gradients: put ``optax.apply_if_finite`` *after* this transform
    (``optax.chain(cj.compressed_mean(...), optax.apply_if_finite(opt, k))``). It then
    tests the shared mean, which is NaN on every replica when any replica had a NaN, so
    all replicas skip the step together. Wrapped *around* this transform it would test
    each replica's own gradient, and replicas would disagree on whether to communicate.

    Bytes per step and device: see :func:`commjax.communication_plan` (and
    :mod:`commjax.reducers` for the formulas).

    Args:
      compressor: a commjax compressor (``cj.quantize(bits=4)``, ``cj.sign()``, ...).
      axis_name: mesh axis (or tuple of axes) to average over, bound by ``shard_map`` or
        ``pmap``. ``None``: no collective; the compressor still encodes and decodes.
      inner_axis_name: hierarchical exchange on a 2-D mesh: first the exact fp32 mean over
        this fast axis (NVLink/ICI), then compression only over ``axis_name`` (DCN).
        Error-feedback state is per ``axis_name`` replica and identical across the inner
        axis; lay it out with ``cj.state_specs(state, axis_name)``.
      error_feedback: keep the worker residual ``e`` (default True).
      reducer: ``"auto"`` (cheapest valid), ``"allreduce"`` (linear payloads only),
        ``"allgather"`` or ``"two_phase"``.
      min_compress_size: floating leaves with fewer elements go to the exact bucket.
      compress_vectors: also compress 1-D leaves of at least ``min_compress_size``.
      residual_dtype: ``jnp.float32`` (default) or ``jnp.bfloat16`` to halve its memory.
      server_error_feedback: the two-phase reducer's second residual (default True).
      check_finite: share one NaN/Inf flag per compressed leaf (rides in the exact
        bucket): a non-finite gradient on any replica makes that leaf's mean NaN on every
        replica, and the residuals keep their previous value on that step. ``False``
        skips the test (one reduction per leaf): a non-finite value then goes through the
        codec as it is, so what the mean becomes depends on the codec (NaN in its block
        for the scaled codecs), still identically on every replica, and it stays in the
        sending replica's residual.
      num_replicas: replicas the state is sized for when ``init`` runs outside
        ``shard_map`` (default: the axis size if bound, else ``jax.device_count()``).
        Only the two-phase server residual depends on it.
      seed: seed of the replicated PRNG key (stochastic rounding, random masks).

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`CompressedMeanState`.
      Per-replica parts: ``residual``, ``server_residual``; replicated: ``count``, ``key``.
      Lay it out for ``shard_map`` with :func:`commjax.shard_state` and
      :func:`commjax.state_specs`.

    Raises:
      ValueError: bad options (named in the message), at construction.
      AxisNotBoundError: at update, if ``axis_name`` is not bound.
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"compressed_mean: `compressor` must be a commjax compressor such as "
            f"cj.quantize(bits=8), got {compressor!r}."
        )
    if compressor.has_exchange:
        if reducer not in ("auto",):
            raise ValueError(
                f"compressed_mean: {compressor.name} runs its own exchange; `reducer` must be "
                f"'auto', got {reducer!r}."
            )
    else:
        check_reducer(compressor, reducer)
    if inner_axis_name is not None:
        if axis_name is None:
            raise ValueError("compressed_mean: `inner_axis_name` needs an outer `axis_name`.")
        outer = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
        inner_set = set(inner_axis_name) if isinstance(inner_axis_name, (tuple, list)) else {inner_axis_name}
        if outer & inner_set:
            raise ValueError(
                f"compressed_mean: `inner_axis_name` ({inner_axis_name!r}) must differ from "
                f"`axis_name` ({axis_name!r}): the inner axis is averaged exactly, the outer "
                "one compressed."
            )
    if isinstance(min_compress_size, bool) or not isinstance(min_compress_size, int) or min_compress_size < 1:
        raise ValueError(f"compressed_mean: `min_compress_size` must be an integer >= 1, got {min_compress_size!r}.")
    rname = jnp.dtype(residual_dtype).name
    if rname not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"compressed_mean: `residual_dtype` must be jnp.float32, jnp.bfloat16 or jnp.float16; got {residual_dtype!r}."
        )
    if num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
        raise ValueError(f"compressed_mean: `num_replicas` must be a positive integer or None, got {num_replicas!r}.")
    cfg = ExchangeConfig(
        compressor=compressor, axis_name=tuple(axis_name) if isinstance(axis_name, list) else axis_name,
        inner_axis_name=tuple(inner_axis_name) if isinstance(inner_axis_name, list) else inner_axis_name,
        error_feedback=bool(error_feedback), reducer=reducer, min_compress_size=min_compress_size,
        compress_vectors=bool(compress_vectors), residual_dtype=jnp.dtype(residual_dtype),
        server_error_feedback=bool(server_error_feedback), check_finite=bool(check_finite),
        num_replicas=num_replicas, seed=int(seed),
    )

    def init_fn(params):
        leaves = jax.tree_util.tree_leaves(params)
        n_rep = _num_replicas_now(cfg)
        plan = cfg.plan(leaves, n_rep)
        key = jax.random.PRNGKey(cfg.seed)
        comp_state = ()
        if compressor.has_exchange and plan.segments:
            comp_state = compressor.init_exchange_state(
                plan.segments, n_rep, jax.random.fold_in(key, 0xC0DE)
            )
        metrics = {name: jnp.zeros((1,), jnp.float32)
                   for name in ("residual_norm", "nonfinite") + tuple(compressor.metric_names)}
        return CompressedMeanState(
            count=jnp.zeros((), jnp.int32),
            key=key,
            residual=tuple(jnp.zeros(shape, cfg.residual_dtype) for shape in _residual_shapes(cfg, plan)),
            server_residual=jnp.zeros((plan.server_residual_size,), jnp.float32),
            compressor_state=comp_state,
            metrics=metrics,
        )

    def update_fn(updates, state, params=None):
        del params
        return _update(cfg, updates, state)

    tx = optax.GradientTransformation(init_fn, update_fn)
    return tx
