"""DiLoCo: local inner steps, then an outer step on the averaged pseudo-gradient.

Every replica trains on its own for ``H = sync_every`` steps of an inner optimizer,
without communicating; then the replicas average how far they moved (the
*pseudo-gradient*), an outer optimizer moves the shared parameters, and every replica
restarts from them. With ``theta`` the shared parameters of the round (the *anchor*) and
``theta_i`` replica ``i``'s parameters after its ``H`` inner steps::

    delta = (1/N) sum_i (theta - theta_i)          # one mean per round (optionally compressed)
    theta <- theta + outer_update(delta)           # e.g. Nesterov SGD, lr 0.7, momentum 0.9
    theta_i <- theta                               # on every replica

Communication: nothing on inner steps; one mean of a parameter-sized vector on every
``H``-th step (an fp32 all-reduce, ``2 (N-1)/N * 4 n`` bytes per device, or the bytes of the
chosen compressor through [`commjax.compressed_mean`][]). The whole round is one
compiled step function: the exchange sits in one branch of a ``lax.cond`` that only the
sync steps take.

Reference: Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models" (arXiv:2311.08105).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from commjax import _compat, guards, validation
from commjax.accounting import CommunicationPlan, Transfer, with_plan
from commjax.collectives._exact import exact_mean
from commjax.compressors.base import Compressor
from commjax.layout import per_replica, per_replica_mask
from commjax.plan import communication_plan, exact_mean_transfers, float_baseline, repeated
from commjax.transform import compressed_mean

__all__ = ["DiLoCoState", "diloco", "landing_update"]


@per_replica("inner_state")
class DiLoCoState(NamedTuple):
    """State of [`diloco`][commjax.optimizers.diloco.diloco].

    Attributes:
      count: int32 scalar, replicated: inner steps taken.
      anchor: pytree like the parameters, replicated: the shared parameters of the
        current round (what every replica restarted from at the last sync).
      outer_state: the outer optimizer's state, replicated.
      inner_state: the inner optimizer's state, **per replica**, every leaf with a
        leading axis of length 1 (local shape ``[1, *shape]``; global ``[N, *shape]``
        under ``shard_map`` with ``P(axis_name)``), whatever the leaf's own shape (the
        inner optimizer's step counters are scalars).
      exchange: the [`commjax.CompressedMeanState`][] of the pseudo-gradient exchange
        when a ``compressor`` is given (its residuals are per replica), else ``()``.
      inner_exchange: with ``inner_compressor``, the [`commjax.CompressedMeanState`][]
        of the gradient mean over ``inner_axis_name``, its residuals **per device** (lay
        them out over both axes, as [`commjax.streaming_diloco`][] shows); else ``()``.

    Parameters are per replica in DiLoCo (they differ between syncs), so the training
    loop keeps them with a leading replica axis and ``P(axis_name)`` specs, as
    [`commjax.testing.train`][] does; lay the state out with
    [`commjax.shard_state`][] and [`commjax.state_specs`][].
    """

    count: jax.Array
    anchor: Any
    outer_state: Any
    inner_state: Any
    exchange: Any
    inner_exchange: Any = ()


def landing_update(params: Any, target: Any) -> Any:
    """Updates ``u = target - params``, so that ``optax.apply_updates(params, u)`` lands on
    ``target``.

    ``params + (target - params)`` equals ``target`` exactly whenever ``target - params``
    is representable, which covers every entry that moved by at most its own magnitude
    (``target / 2 <= params <= 2 target``, Sterbenz's lemma) and many more. Where it is
    not, no float ``u`` at all lands exactly (the low bits of ``params`` cannot be
    cancelled at the exponent of the move), and the miss is at most half an ulp of each
    term: ``|params + u - target| <= 2^-24 (|target - params| + |target|)`` in float32.
    """
    return jax.tree_util.tree_map(lambda p, n: n - p, params, target)


def _check_vary(params: Any, axis_name: Any) -> None:
    """Under ``check_vma=True``, refuse parameters typed replicated: DiLoCo replicas hold
    different parameters between syncs."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    tracked = _compat.varying_axes(lax.axis_index(names[0]))
    if not tracked:
        return  # check_vma=False or pmap: nothing is tracked
    for leaf in jax.tree_util.tree_leaves(params):
        vma = _compat.varying_axes(leaf)
        if vma is not None and not all(n in vma for n in names):
            raise ValueError(
                f"diloco: the parameters (a leaf of shape {jnp.shape(leaf)}) are replicated over "
                f"{axis_name!r}, but DiLoCo replicas hold different parameters between syncs. "
                "Keep the parameters per replica (a leading replica axis with "
                f"P({axis_name!r}) in the shard_map specs, as commjax.testing.train does)."
            )


def _vary_marked(tree: Any, axis_name: Any) -> Any:
    """Mark the per-replica leaves of ``tree`` as varying over the axis (cond outputs of
    both branches must agree on it under ``check_vma=True``)."""
    if axis_name is None:
        return tree
    mask = per_replica_mask(tree)
    return jax.tree_util.tree_map(lambda x, m: _compat.vary(x, axis_name) if m else x, tree, mask)


@dataclasses.dataclass(frozen=True)
class _Config:
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    sync_every: int
    axis_name: Any
    exchange_tx: Optional[optax.GradientTransformation]
    inner_axis_name: Any = None
    inner_tx: Optional[optax.GradientTransformation] = None  # compressed mean over the fast axis


def _group_mean(updates: Any, inner_axis_name: Any, where: str) -> Any:
    """The exact fp32 mean of the gradients over ``inner_axis_name`` (one all-reduce; a
    data-parallel group inside each worker), or ``updates`` as they are without one."""
    if inner_axis_name is None:
        return updates
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    n = guards.check_bound(inner_axis_name, where)
    means, _ = exact_mean(leaves, inner_axis_name, n)  # one replica: typed replicated
    out = [m.reshape(jnp.shape(l)).astype(jnp.result_type(l)) for m, l in zip(means, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _group(cfg: Any, updates: Any, inner_exchange: Any, where: str) -> tuple[Any, Any]:
    """The gradients' mean over ``cfg.inner_axis_name``: exact (``_group_mean``), or
    through ``cfg.inner_tx`` (identical on every device of the group; its residuals stay
    per device). Returns (mean, new inner exchange state)."""
    if cfg.inner_tx is None:
        return _group_mean(updates, cfg.inner_axis_name, where), inner_exchange
    return cfg.inner_tx.update(updates, inner_exchange)


def inner_exchange(inner_compressor: Any, inner_axis_name: Any, *, error_feedback: bool,
                   inner_replicas: Optional[int], seed: int, factory: str) -> Optional[optax.GradientTransformation]:
    """The compressed gradient mean over the fast axis, or ``None`` (exact mean)."""
    if inner_compressor is None:
        if inner_replicas is not None:
            raise ValueError(f"{factory}: `inner_replicas` sizes the state of `inner_compressor`; "
                             "pass inner_compressor=cj.quantize(...) with it, or drop it.")
        return None
    if not isinstance(inner_compressor, Compressor):
        raise TypeError(
            f"{factory}: `inner_compressor` must be None (exact group mean) or a commjax compressor "
            f"such as cj.quantize(bits=8), got {inner_compressor!r}.")
    if inner_axis_name is None:
        raise ValueError(
            f"{factory}: `inner_compressor` compresses the gradient mean over `inner_axis_name`, "
            "which is None; pass inner_axis_name=<the fast mesh axis> or drop inner_compressor.")
    return compressed_mean(inner_compressor, inner_axis_name, error_feedback=error_feedback,
                           num_replicas=inner_replicas, seed=seed, bucket_bytes=None)


def _inner_step(cfg: _Config, updates, state: DiLoCoState, params):
    """The local inner step: ``(u_in, new inner state, p + u_in)``; a non-finite update
    is NaN on every leaf of this replica and keeps its inner state."""
    inner_state = jax.tree_util.tree_map(lambda x: x[0], state.inner_state)
    u_in, new_inner = cfg.inner.update(updates, inner_state, params)
    ok = guards.tree_all_finite(u_in, guards.all_finite_elementwise)
    new_inner = guards.keep_if(jnp.logical_not(ok), inner_state, new_inner)
    u_in = jax.tree_util.tree_map(lambda u: jnp.where(ok, u, jnp.nan).astype(u.dtype), u_in)
    return u_in, new_inner, optax.apply_updates(params, u_in)


def _pseudo_mean(cfg: _Config, deltas, exchange):
    """The replicas' mean pseudo-gradient: exact fp32 (one all-reduce) or compressed."""
    if cfg.exchange_tx is not None:
        return cfg.exchange_tx.update(deltas, exchange)
    leaves, treedef = jax.tree_util.tree_flatten(deltas)
    n_rep = guards.check_bound(cfg.axis_name, "diloco")
    means, _ = exact_mean(leaves, cfg.axis_name, n_rep)  # one replica: typed replicated
    out = [m.reshape(l.shape).astype(l.dtype) for m, l in zip(means, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out), exchange


def _sync(cfg: _Config, params, local, ops):
    """The outer step on the mean pseudo-gradient; every replica lands on the new anchor."""
    anchor, outer_state, exchange = ops
    deltas = jax.tree_util.tree_map(lambda a, q: a.astype(jnp.float32) - q.astype(jnp.float32),
                                    anchor, local)
    mean, new_exchange = _pseudo_mean(cfg, deltas, exchange)
    bad = jnp.logical_not(guards.tree_all_finite(mean))
    mean = jax.tree_util.tree_map(lambda m, a: m.astype(a.dtype), mean, anchor)
    u_out, new_outer = cfg.outer.update(mean, outer_state, anchor)
    # One materialised value of the new anchor for the state and for the landing step:
    # XLA may otherwise recompute it inside several fusions, with and without fused
    # multiply-adds, and the copies can differ in the last bit.
    new_anchor = lax.optimization_barrier(optax.apply_updates(anchor, u_out))
    step = jax.tree_util.tree_map(lambda s: jnp.where(bad, jnp.nan, s).astype(s.dtype),
                                  landing_update(params, new_anchor))
    return (step, guards.keep_if(bad, anchor, new_anchor), guards.keep_if(bad, outer_state, new_outer),
            _vary_marked(guards.keep_if(bad, exchange, new_exchange), cfg.axis_name))


def _update(cfg: _Config, updates, state: DiLoCoState, params):
    if params is None:
        raise ValueError("diloco: update() needs this replica's `params` (update(grads, state, params)).")
    guards.check_bound(cfg.axis_name, "diloco")
    if cfg.axis_name is not None:
        _check_vary(params, cfg.axis_name)
    grads, inner_ex = _group(cfg, updates, state.inner_exchange, "diloco")
    u_in, new_inner, local = _inner_step(cfg, grads, state, params)

    def no_sync(ops):
        anchor, outer_state, exchange = ops
        step = jax.tree_util.tree_map(lambda u, p: u.astype(p.dtype), u_in, params)
        return step, anchor, outer_state, _vary_marked(exchange, cfg.axis_name)

    ops = (state.anchor, state.outer_state, state.exchange)
    if cfg.sync_every == 1:
        out, anchor, outer_state, exchange = _sync(cfg, params, local, ops)
    else:
        is_sync = (state.count + 1) % cfg.sync_every == 0
        out, anchor, outer_state, exchange = lax.cond(
            is_sync, lambda o: _sync(cfg, params, local, o), no_sync, ops)
    new_state = DiLoCoState(
        count=state.count + 1, anchor=anchor, outer_state=outer_state,
        inner_state=jax.tree_util.tree_map(lambda x: x[None], new_inner), exchange=exchange,
        inner_exchange=inner_ex,
    )
    return out, new_state


def _init(cfg: _Config, params) -> DiLoCoState:
    validation.check_real_leaves(params, factory="diloco")
    return DiLoCoState(
        count=jnp.zeros((), jnp.int32),
        anchor=jax.tree_util.tree_map(jnp.asarray, params),
        outer_state=cfg.outer.init(params),
        inner_state=jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], cfg.inner.init(params)),
        exchange=() if cfg.exchange_tx is None else cfg.exchange_tx.init(params),
        inner_exchange=() if cfg.inner_tx is None else cfg.inner_tx.init(params),
    )


def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    *,
    sync_every: int,
    axis_name: Any = "data",
    compressor: Optional[Compressor] = None,
    error_feedback: bool = True,
    num_replicas: Optional[int] = None,
    seed: int = 0,
    inner_axis_name: Any = None,
    inner_compressor: Optional[Compressor] = None,
    inner_replicas: Optional[int] = None,
) -> optax.GradientTransformation:
    """DiLoCo as one optax transformation: ``sync_every - 1`` local steps, then a sync.

    ``update(grads, state, params)`` takes this replica's own gradient and parameters
    (inside ``shard_map``/``pmap`` over ``axis_name``). Step ``t`` (0-based, ``H =
    sync_every``, ``theta`` the anchor in the state, ``p`` the replica's parameters)::

        u_in = inner.update(g_i, p);  p' = p + u_in
        if (t + 1) % H != 0:  return u_in                               # no communication
        delta = mean_i(theta - p'_i)           # fp32 all-reduce, or compressed_mean(...)
        theta <- theta + outer.update(delta, theta)
        return landing_update(p, theta)        # p + u == theta (see below)

    The returned update at a sync step is computed as ``theta - p``
    ([`landing_update`][commjax.optimizers.diloco.landing_update]), not as the outer step plus the
    local drift, so that after
    applying it every replica holds ``theta``: bit-identical wherever ``theta - p`` is
    exactly representable, which covers every entry that moved by at most its own
    magnitude in the round (and most others). An entry that moved by more (across zero,
    say) cannot land exactly from every replica, whatever the update: ``p + u`` keeps the
    low bits of each replica's own ``p``. There a replica may miss ``theta`` by at most
    ``2^-24 (|theta - p| + |theta|)`` (float32, half an ulp of each term). This never
    accumulates: the anchor ``theta`` is kept exactly in the (replicated) state, it is
    bit-identical on every replica, and the next round's pseudo-gradient is measured
    from it, not from the replica's parameters.

    The inner optimizer keeps its own state per replica across rounds (it is not reset
    at a sync); the outer optimizer's state is replicated.

    Non-finite values: a NaN/Inf in a replica's inner update (between syncs nobody else
    can know) makes that replica's whole update NaN and keeps that replica's inner state. At a sync a
    non-finite pseudo-gradient mean (any replica) makes the update NaN on every replica
    and keeps the anchor, the outer state and the exchange residuals; the step counter
    always advances, so all replicas stay on the same sync schedule.

    Bytes per device: 0 on inner steps; on sync steps ``2 (N-1)/N * 4 n`` (exact fp32
    mean of the ``n`` parameters) or, with ``compressor``, the bytes of
    ``cj.compressed_mean(compressor)`` for parameter-shaped inputs
    ([`commjax.communication_plan`][]), i.e. ``H`` times less per step on average.

    Args:
      inner: the local optimizer (e.g. ``optax.adamw(1e-3)``); must not communicate.
      outer: the outer optimizer applied to the averaged pseudo-gradient (e.g.
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``; ``optax.sgd(1.0)`` is plain
        parameter averaging).
      sync_every: inner steps per round, an integer ``>= 1``.
      axis_name: mesh axis (or tuple) of the replicas; ``None`` for one replica.
      compressor: ``None`` for the exact fp32 mean, or a commjax compressor (e.g.
        ``cj.quantize(bits=4)``) for [`commjax.compressed_mean`][] on the pseudo-gradient.
      error_feedback: error feedback of the compressed exchange (default True).
      num_replicas: replicas the compressed exchange's state is sized for when ``init``
        runs outside ``shard_map`` (see [`commjax.compressed_mean`][]).
      seed: seed of the compressed exchange's stochastic rounding.
      inner_axis_name: optional fast mesh axis of data-parallel groups inside each
        worker: the gradients are averaged exactly over it every step (one fp32
        all-reduce, ``2 (M-1)/M * 4 n`` bytes), the sync runs over ``axis_name`` only,
        and parameters and state are identical across it (lay the state out with
        ``cj.state_specs(state, axis_name)``).
      inner_compressor: ``None`` (exact group mean) or a commjax compressor: the gradients
        are averaged over ``inner_axis_name`` by ``cj.compressed_mean(inner_compressor,
        inner_axis_name)`` (rounding seed ``seed + 1``), identical on every device of the
        group, its residuals per device in ``state.inner_exchange`` (lay that field out
        over both axes, as [`commjax.streaming_diloco`][] shows). Needs ``inner_axis_name``.
      inner_replicas: devices per group the inner exchange's state is sized for when
        ``init`` runs outside ``shard_map``.

    Returns:
      An ``optax.GradientTransformation`` with
      [`DiLoCoState`][commjax.optimizers.diloco.DiLoCoState].

    Raises:
      ValueError: bad options (named in the message); ``params`` missing or replicated
        (invariant) at ``update``.
      AxisNotBoundError: ``update`` called where ``axis_name`` is not bound.
    """
    for name, tx in (("inner", inner), ("outer", outer)):
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"diloco: `{name}` must be an optax.GradientTransformation, got {tx!r}.")
    sync_every = validation.check_int("sync_every", sync_every, 1, factory="diloco")
    if compressor is not None and not isinstance(compressor, Compressor):
        raise TypeError(
            f"diloco: `compressor` must be None (exact mean) or a commjax compressor such as "
            f"cj.quantize(bits=4), got {compressor!r}.")
    axis_name = validation.normalize_axis(axis_name)
    inner_axis_name = validation.check_axis_name("inner_axis_name", inner_axis_name, factory="diloco")
    validation.check_axis_pair(axis_name, inner_axis_name, factory="diloco")
    seed = validation.check_seed("seed", seed, factory="diloco")
    exchange_tx = None
    if compressor is not None:
        exchange_tx = compressed_mean(compressor, axis_name, error_feedback=error_feedback,
                                      num_replicas=num_replicas, seed=seed, bucket_bytes=None)
    inner_tx = inner_exchange(inner_compressor, inner_axis_name, error_feedback=error_feedback,
                              inner_replicas=inner_replicas, seed=seed + 1, factory="diloco")
    cfg = _Config(inner, outer, sync_every, axis_name, exchange_tx, inner_axis_name, inner_tx)
    return with_plan(optax.GradientTransformation(lambda params: _init(cfg, params),
                                                  lambda u, s, params=None: _update(cfg, u, s, params)),
                     functools.partial(_plan, cfg))


def _f32(params: Any) -> Any:
    return jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.float32), params)


def group_transfers(cfg: Any, params: Any, inner_replicas: int) -> list[Transfer]:
    """Every step's gradient mean over ``cfg.inner_axis_name`` (``inner_replicas`` devices):
    the exact fp32 all-reduce, or ``cfg.inner_tx``'s plan; nothing without an inner axis."""
    if (inner_replicas > 1) != (cfg.inner_axis_name is not None):
        raise ValueError("communication_plan: pass `inner_replicas` (the size of "
                         "`inner_axis_name`) exactly when the transform has an inner axis.")
    if inner_replicas <= 1:
        return []
    if cfg.inner_tx is None:
        return exact_mean_transfers("inner-axis mean", jax.tree_util.tree_leaves(params), inner_replicas)
    return repeated(communication_plan(cfg.inner_tx, params, inner_replicas).transfers, 1, "inner-axis mean: ")


def _plan(cfg: _Config, params: Any, num_replicas: int, inner_replicas: int = 1) -> CommunicationPlan:
    """What [`diloco`][commjax.optimizers.diloco.diloco] sends per device (its
    [`commjax.communication_plan`][]): the
    mean pseudo-gradient (exact fp32, or the compressor's plan) once every ``sync_every``
    steps, and the gradient mean over the inner axis every step."""
    deltas = _f32(params)
    if cfg.exchange_tx is None:
        sync = exact_mean_transfers("pseudo-gradient", jax.tree_util.tree_leaves(deltas), num_replicas)
    else:
        sync = repeated(communication_plan(cfg.exchange_tx, deltas, num_replicas).transfers, 1,
                        "pseudo-gradient: ")
    transfers = group_transfers(cfg, params, inner_replicas) + repeated(sync, cfg.sync_every,
                                                                        offset=cfg.sync_every - 1)
    return CommunicationPlan("diloco", num_replicas, tuple(transfers), float_baseline(params, num_replicas))
