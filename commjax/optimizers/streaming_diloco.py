"""Streaming DiLoCo: DiLoCo whose parameters are synced in fragments at staggered steps.

The parameters are split into ``P`` static *fragments* of about equal bytes on the wire
([`fragment_leaves`][commjax.optimizers.streaming_diloco.fragment_leaves]): slices of the leaves
laid end to end, cut inside the largest
leaves (along rows where the cut allows), each leaf whole where no cut falls in it.
Every replica trains locally with the inner optimizer; fragment ``f`` is synced once
every ``H = sync_every`` steps, at its own step, the ``P`` fragments spread evenly over
the round (one sync every ``H / P`` steps). With
``theta_f`` the fragment's anchor (shared by all replicas) and ``theta_{i,f}`` replica
``i``'s copy after the inner step of step ``t``::

    send (step t):       delta_f = (1/N) sum_i (theta_f - theta_{i,f})   # only f's bytes
    merge (step t+tau):  theta_f <- theta_f + outer_f.update(delta_f)
                         theta_{i,f} <- alpha theta_{i,f} + (1 - alpha) theta_f

``tau = overlap`` inner steps run between the send and the merge (the mean is kept in
the state meanwhile); ``alpha = mix`` keeps part of the replica's own progress. Each
fragment has its own outer-optimizer state and its own (optionally compressed, with
error feedback) exchange.

Communication per device: 0 on most steps; on a fragment's send step the exact fp32
mean of that fragment (``2 (N-1)/N * 4 n_f`` bytes, ``n_f <= ceil(n/P)``: at most ``1/P``
of a DiLoCo sync, plus one element) or the bytes of [`commjax.compressed_mean`][] with
the chosen compressor on the fragment's pieces (``1/P`` of a sync up to the reducer's
granule of ``block * N`` elements, and one fp32 NaN flag per cut piece for a codec whose
payloads cannot tell a non-finite block). The average per inner step is a DiLoCo sync
divided by ``H``, as in DiLoCo ([`commjax.communication_plan`][]).

With ``P = 1``, ``tau = 0``, ``alpha = 0`` it is [`commjax.diloco`][], bit for bit.

References: Douillard et al., 2025, "Streaming DiLoCo with overlapping communication:
Towards a Distributed Free Lunch" (arXiv:2501.18512); Douillard et al., 2023, "DiLoCo:
Distributed Low-Communication Training of Language Models" (arXiv:2311.08105).
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

from commjax import _compat, guards, validation
from commjax.accounting import CommunicationPlan, with_plan
from commjax.compressors.base import Compressor
from commjax.layout import per_replica
from commjax.optimizers.diloco import (
    _Config as _DiLoCoConfig, _check_vary, _group, _inner_step, _pseudo_mean,
    _vary_marked, group_transfers, inner_exchange, landing_update,
)
from commjax.plan import (
    COMPRESS, communication_plan, exact_mean_transfers, float_baseline, repeated, route_leaf,
)
from commjax.transform import compressed_mean

__all__ = ["StreamingDiLoCoState", "streaming_diloco", "Piece", "fragment_leaves"]

_NAME = "streaming_diloco"


@per_replica("inner_state")
class StreamingDiLoCoState(NamedTuple):
    """State of [`streaming_diloco`][commjax.optimizers.streaming_diloco.streaming_diloco].

    Attributes:
      count: int32 scalar, replicated: inner steps taken.
      anchor: pytree like the parameters, replicated: each fragment's shared parameters
        as of that fragment's last merge.
      outer_state: tuple of ``P`` outer-optimizer states (fragment ``f``'s over the list
        of its pieces, each in ``Piece.shape``), replicated.
      inner_state: the inner optimizer's state, **per replica** (leading axis of length 1
        on every leaf, as in [`commjax.optimizers.DiLoCoState`][]).
      exchange: tuple of ``P`` [`commjax.CompressedMeanState`][] (residuals per
        replica) when a ``compressor`` is given, else ``()``.
      pending: with ``overlap > 0``, tuple of ``P`` lists of fp32 arrays (one per piece of
        the fragment, in its shape): the mean pseudo-gradient received at the fragment's last
        send, merged ``overlap`` steps later; replicated. ``()`` when ``overlap == 0``.
      inner_exchange: with ``inner_compressor``, the [`commjax.CompressedMeanState`][]
        of the gradient mean over ``inner_axis_name``; its residuals are **per device**
        (they differ across the fast axis too: lay them out over both axes, see
        [`streaming_diloco`][commjax.optimizers.streaming_diloco.streaming_diloco]). ``()`` without
        one.
    """

    count: jax.Array
    anchor: Any
    outer_state: Any
    inner_state: Any
    exchange: Any
    pending: Any
    inner_exchange: Any = ()


class Piece(NamedTuple):
    """A static slice of one parameter leaf: elements ``[start, stop)`` of the leaf
    flattened in row-major order, exchanged in ``shape``: the leaf's own shape when the
    piece is the whole leaf, ``(rows, *trailing)`` when it is whole rows of a leaf of
    two or more dimensions, else ``(1, stop - start)`` for such a leaf (so that the
    compressed exchange still compresses it) and ``(stop - start,)`` for a vector."""

    leaf: int
    start: int
    stop: int
    shape: tuple


def _piece(shape: tuple, leaf: int, start: int, stop: int) -> Piece:
    size, n = int(np.prod(shape)), stop - start
    if n == size:
        return Piece(leaf, start, stop, shape)
    if len(shape) < 2:
        return Piece(leaf, start, stop, (n,))
    row = size // shape[0]
    if start % row == 0 and stop % row == 0:
        return Piece(leaf, start, stop, (n // row,) + tuple(shape[1:]))
    return Piece(leaf, start, stop, (1, n))


def _split_line(order: Sequence[int], shapes: Sequence[tuple], bounds: Sequence[int], groups: list,
                unit: int = 1) -> None:
    """Lay the leaves ``order`` end to end, each taking its size rounded up to ``unit``
    elements, and give fragment ``f`` the elements in ``[bounds[f], bounds[f + 1])`` of
    that line (appended to ``groups``)."""
    offset = 0
    for i in order:
        size = int(np.prod(shapes[i]))
        for f in range(len(groups)):
            a, b = max(offset, bounds[f]) - offset, min(offset + size, bounds[f + 1]) - offset
            if a < b:
                groups[f].append(_piece(shapes[i], i, a, b))
        offset += -(-size // unit) * unit


def _even(total: int, fragments: int) -> list:
    return [f * total // fragments for f in range(fragments + 1)]


def _water_fill(costs: Sequence[float], total: int) -> list:
    """Bounds that give fragment ``f`` ``e_f >= 0`` of ``total`` elements (``sum e_f = total``)
    so that the largest ``costs[f] + e_f`` is as small as integers allow."""
    lo, hi = 0, int(max(costs)) + total + 1
    fill = lambda level: [max(0, math.floor(level - c)) for c in costs]  # noqa: E731
    while lo < hi:  # the lowest integer level that holds every element
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if sum(fill(mid)) < total else (lo, mid)
    e = fill(lo)
    for f in sorted(range(len(e)), key=lambda g: (-(costs[g] + e[g]), -g)):
        take = min(e[f], sum(e) - total)
        e[f] -= take
    return [sum(e[:f]) for f in range(len(e) + 1)]


def _compressed_bounds(padded_total: int, fragments: int, compressor: Compressor,
                       num_replicas: int) -> tuple[list, list]:
    """Cuts of the compressed line at whole granules of ``alignment * N`` elements (the
    two-phase reducer's chunking, so the fragments' padding adds up to the full sync's),
    and each fragment's payload in exact-element equivalents (bytes / 4)."""
    granule = compressor.alignment * num_replicas
    count = -(-padded_total // granule)
    bounds = [min(padded_total, (f * count // fragments) * granule) for f in range(fragments + 1)]
    costs = [compressor.payload_bytes(-(-(b - a) // granule) * granule) / 4 if b > a else 0.0
             for a, b in zip(bounds, bounds[1:])]
    return bounds, costs


def fragment_leaves(params: Any, fragments: int, compressor: Optional[Compressor] = None,
                    num_replicas: int = 1) -> tuple[tuple[Piece, ...], ...]:
    """Split the parameters into ``fragments`` static groups of
    [`Piece`][commjax.optimizers.streaming_diloco.Piece] s of about
    equal bytes on the wire (``P = fragments``, ``N = num_replicas``).

    The leaves (``jax.tree_util.tree_leaves`` order) are laid end to end from the largest
    down (ties in leaf order) and the line is cut into ``P`` ranges. Exact mean
    (``compressor=None``): fragment ``f`` takes elements ``[f T // P, (f+1) T // P)``, so
    every fragment holds ``floor(T/P)`` or ``ceil(T/P)`` of the ``T`` elements. With a
    ``compressor``, the leaves that [`commjax.compressed_mean`][] compresses form one
    line (each padded to the codec's block), cut at whole granules of ``block * N``
    elements (the two-phase reducer pads each exchange to one), so the fragments' payloads
    add up to the full sync's; the leaves it sends exactly (under 1024 elements, vectors)
    form a second line, shared out so that the fragments with fewer granules carry more of
    it. Cuts fall in the largest leaves first, ``P = 1`` gives every leaf whole, and each
    group lists its pieces by leaf index; the result depends only on the leaves' shapes
    and dtypes (and on ``N`` with a compressor)."""
    leaves = jax.tree_util.tree_leaves(params)
    shapes = [tuple(int(d) for d in np.shape(l)) for l in leaves]
    sizes = [int(np.prod(s)) for s in shapes]
    if not sum(sizes):
        raise ValueError(f"{_NAME}: the parameters have no elements to sync; pass a tree "
                         "with at least one non-empty leaf.")
    if fragments > sum(sizes):
        raise ValueError(
            f"{_NAME}: `fragments` ({fragments}) is more than the parameters' {sum(sizes)} elements; "
            f"every fragment needs at least one, so pass fragments <= {sum(sizes)}.")
    order = sorted(range(len(sizes)), key=lambda j: (-sizes[j], j))
    groups = [[] for _ in range(fragments)]
    if compressor is not None:
        routed = [route_leaf(s, jnp.result_type(l), min_compress_size=1024, compress_vectors=False,
                             compressor=compressor) for s, l in zip(shapes, leaves)]
        squeezed = [i for i in order if routed[i] == COMPRESS]
        unit = compressor.alignment
        bounds, costs = _compressed_bounds(sum(-(-sizes[i] // unit) * unit for i in squeezed), fragments,
                                           compressor, num_replicas)
        _split_line(squeezed, shapes, bounds, groups, unit)
        rest = [i for i in order if routed[i] != COMPRESS]
        _split_line(rest, shapes, _water_fill(costs, sum(sizes[i] for i in rest)), groups)
    if not all(groups):  # exact mean, or a compressed split that left a fragment empty
        groups = [[] for _ in range(fragments)]
        _split_line(order, shapes, _even(sum(sizes), fragments), groups)
    return tuple(tuple(sorted(g)) for g in groups)


def _cut(leaf: Any, piece: Piece) -> Any:
    """The piece's elements of ``leaf``, in the piece's shape (the leaf itself if whole)."""
    if piece.shape == tuple(jnp.shape(leaf)):
        return leaf
    return jnp.reshape(leaf, (-1,))[piece.start:piece.stop].reshape(piece.shape)


def _paste(leaf: Any, piece: Piece, value: Any) -> Any:
    """``leaf`` with the piece's elements replaced by ``value`` (``value`` if whole)."""
    if piece.shape == tuple(jnp.shape(leaf)):
        return value
    flat = lax.dynamic_update_slice(jnp.reshape(leaf, (-1,)), jnp.reshape(value, (-1,)).astype(leaf.dtype),
                                    (piece.start,))
    return flat.reshape(jnp.shape(leaf))


@dataclasses.dataclass(frozen=True)
class _Config:
    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    sync_every: int
    fragments: int
    overlap: int
    mix: float
    axis_name: Any
    inner_axis_name: Any
    exchanges: tuple  # P compressed_mean transforms, or P Nones for the exact mean
    compressor: Optional[Compressor]  # what the fragments are balanced for
    num_replicas: Optional[int]
    inner_tx: Optional[optax.GradientTransformation] = None  # compressed mean over the fast axis

    def fragment(self, f: int) -> _DiLoCoConfig:
        """Fragment ``f`` seen as a DiLoCo (its exchange), for diloco's pieces."""
        return _DiLoCoConfig(self.inner, self.outer, self.sync_every, self.axis_name,
                             self.exchanges[f])


def _due(cfg: _Config, count: Any, delay: int) -> Any:
    """Which fragment's send (``delay = 0``) or merge (``delay = overlap``) falls on step
    ``count``: fragment ``f`` when ``(count + 1 - delay) % H == ((f + 1) H / P) % H``
    (fragment ``P - 1`` on DiLoCo's sync steps), else ``P`` (none); nothing is merged
    before step ``tau``. A Python ``int`` ``count`` (a static step, known only mod ``H``)
    gives a Python ``int`` and leaves the ``count >= tau`` test to the caller."""
    h, p = cfg.sync_every, cfg.fragments
    spacing = h // p
    if isinstance(count, int):
        r = (count + 1 - delay) % h
        return (r // spacing + p - 1) % p if r % spacing == 0 else p
    r = (count + 1 - delay) % h
    due = jnp.logical_and(r % spacing == 0, count >= delay)
    return jnp.where(due, (r // spacing + p - 1) % p, p).astype(jnp.int32)


def _send(cfg: _Config, f: int, idx, local, anchor, exchange):
    """Fragment ``f``'s mean pseudo-gradient over its pieces (fp32, the only collective of the step);
    a non-finite mean keeps the fragment's exchange residuals."""
    deltas = [_cut(anchor[q.leaf], q).astype(jnp.float32) - _cut(local[q.leaf], q).astype(jnp.float32)
              for q in idx]
    mean, new_ex = _pseudo_mean(cfg.fragment(f), deltas, exchange[f] if exchange else ())
    mean = [m.astype(jnp.float32) for m in mean]
    if exchange:
        bad = jnp.logical_not(guards.tree_all_finite(mean))
        new_ex = _vary_marked(guards.keep_if(bad, exchange[f], new_ex), cfg.axis_name)
        exchange = exchange[:f] + (new_ex,) + exchange[f + 1:]
    return mean, exchange


def _merge(cfg: _Config, f: int, idx, mean, params, local, anchor, outer_state):
    """The outer step of fragment ``f`` on its mean; its pieces land on the mix of the
    replica's own and the new shared parameters. Returns (landing updates of ``f``'s
    pieces, new anchor pieces, outer states, bad)."""
    bad = jnp.logical_not(guards.tree_all_finite(mean))
    old = [_cut(anchor[q.leaf], q) for q in idx]
    mean = [m.astype(a.dtype) for m, a in zip(mean, old)]
    u_out, new_outer = cfg.outer.update(mean, outer_state[f], old)
    # One materialised value of the new anchor (see diloco._sync).
    new = lax.optimization_barrier(optax.apply_updates(old, u_out))
    target = new if cfg.mix == 0 else [
        (cfg.mix * _cut(local[q.leaf], q).astype(jnp.float32) + (1 - cfg.mix) * n.astype(jnp.float32)).astype(n.dtype)
        for q, n in zip(idx, new)]
    steps = landing_update([_cut(params[q.leaf], q) for q in idx], target)
    outer_state = outer_state[:f] + (guards.keep_if(bad, outer_state[f], new_outer),) + outer_state[f + 1:]
    return steps, guards.keep_if(bad, old, new), outer_state, bad


def _put(leaves: list, idx: Sequence[Piece], values: Sequence[Any]) -> list:
    out = list(leaves)
    for q, v in zip(idx, values):
        out[q.leaf] = _paste(out[q.leaf], q, v)
    return out


def _sync_branches(cfg: _Config, groups, params, local, send: bool, merge: bool):
    """``P + 1`` branches over ``(step, anchor, outer_state, exchange, pending, bad)``:
    branch ``f`` sends and/or merges fragment ``f``, branch ``P`` passes all through."""

    def branch(f):
        idx = groups[f]

        def run(ops):
            step_, anchor, outer_state, exchange, pending, bad = ops
            if send:
                mean, exchange = _send(cfg, f, idx, local, anchor, exchange)
                pending = pending[:f] + (mean,) + pending[f + 1:] if pending else pending
            else:
                mean = pending[f]
            if merge:
                steps, new_anchor, outer_state, bad = _merge(cfg, f, idx, mean, params, local,
                                                             anchor, outer_state)
                step_, anchor = _put(step_, idx, steps), _put(anchor, idx, new_anchor)
            return step_, anchor, outer_state, exchange, pending, bad
        return run

    def idle(ops):
        step_, anchor, outer_state, exchange, pending, bad = ops
        return step_, anchor, outer_state, _vary_marked(exchange, cfg.axis_name), pending, bad

    return [branch(f) for f in range(cfg.fragments)] + [idle]


def _switch(cfg: _Config, index, branches, ops):
    if isinstance(index, int):  # a static step: the branch itself, no conditional
        out = branches[index](ops)
    elif cfg.sync_every == 1:  # every step syncs the one fragment: no conditional needed
        out = branches[0](ops)
    else:
        out = lax.switch(index, branches, ops)
    step, anchor, outer_state, exchange, pending, bad = out
    return step, anchor, outer_state, _vary_marked(exchange, cfg.axis_name), pending, bad


def _update(cfg: _Config, updates, state: StreamingDiLoCoState, params, step: Optional[int] = None):
    if params is None:
        raise ValueError(f"{_NAME}: update() needs this replica's `params` (update(grads, state, params)).")
    n_rep = guards.check_bound(cfg.axis_name, _NAME)
    if cfg.axis_name is not None:
        _check_vary(params, cfg.axis_name)
    groups = fragment_leaves(params, cfg.fragments, cfg.compressor, n_rep)
    grads, inner_exchange = _group(cfg, updates, state.inner_exchange, _NAME)
    u_in, new_inner, local = _inner_step(cfg, grads, state, params)
    p_leaves, treedef = jax.tree_util.tree_flatten(params)
    local = jax.tree_util.tree_leaves(local)
    at = state.count if step is None else validation.check_int("step", step, 0, factory=_NAME)
    # A static step that is not the state's (mod H) would sync the wrong fragment: every
    # replica's update is NaN instead (the counter is replicated, so all agree).
    wrong = jnp.zeros((), bool) if step is None else state.count % cfg.sync_every != at % cfg.sync_every
    step = [u.astype(p.dtype) for u, p in zip(jax.tree_util.tree_leaves(u_in), p_leaves)]
    ops = (step, jax.tree_util.tree_leaves(state.anchor), state.outer_state, state.exchange,
           state.pending, jnp.zeros((), bool))
    if cfg.overlap == 0:
        ops = _switch(cfg, _due(cfg, at, 0),
                      _sync_branches(cfg, groups, p_leaves, local, True, True), ops)
    else:
        # Both read the state as it came in: the merge (of a mean sent tau >= 1 steps ago,
        # another fragment's) does not wait for this step's send, so nothing computed
        # after it depends on the collective until the merge tau steps later.
        sent = _switch(cfg, _due(cfg, at, 0),
                       _sync_branches(cfg, groups, p_leaves, local, True, False), ops)
        m = _due(cfg, at, cfg.overlap)
        if isinstance(at, int) and m < cfg.fragments:  # static: the merge holds no collective
            m = jnp.where(state.count >= cfg.overlap, m, cfg.fragments).astype(jnp.int32)
        merged = _switch(cfg, m, _sync_branches(cfg, groups, p_leaves, local, False, True), ops)
        ops = merged[:3] + sent[3:5] + merged[5:]
    step, anchor, outer_state, exchange, pending, bad = ops
    # A non-finite merged mean (a NaN on any replica) is NaN on every replica's update.
    step = [jnp.where(bad | wrong, jnp.nan, s).astype(s.dtype) for s in step]
    new_state = StreamingDiLoCoState(
        count=state.count + 1, anchor=jax.tree_util.tree_unflatten(treedef, anchor),
        outer_state=outer_state, inner_state=jax.tree_util.tree_map(lambda x: x[None], new_inner),
        exchange=exchange, pending=pending, inner_exchange=inner_exchange)
    return jax.tree_util.tree_unflatten(treedef, step), new_state


def _layout_replicas(cfg: _Config) -> int:
    """``N`` the compressed fragments are cut for at ``init``: the bound axis's size, else
    ``num_replicas``, else every device (as [`commjax.compressed_mean`][] sizes its state)."""
    if cfg.compressor is None or cfg.axis_name is None:
        return 1
    if _compat.axis_is_bound(cfg.axis_name):
        return _compat.axis_size(cfg.axis_name)
    return cfg.num_replicas if cfg.num_replicas is not None else jax.device_count()


def _init(cfg: _Config, params) -> StreamingDiLoCoState:
    validation.check_real_leaves(params, factory="streaming_diloco")
    leaves = jax.tree_util.tree_leaves(params)
    groups = [[_cut(jnp.asarray(leaves[q.leaf]), q) for q in idx]
              for idx in fragment_leaves(params, cfg.fragments, cfg.compressor, _layout_replicas(cfg))]
    exact = cfg.exchanges[0] is None
    return StreamingDiLoCoState(
        count=jnp.zeros((), jnp.int32),
        anchor=jax.tree_util.tree_map(jnp.asarray, params),
        outer_state=tuple(cfg.outer.init(g) for g in groups),
        inner_state=jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], cfg.inner.init(params)),
        exchange=() if exact else tuple(tx.init(g) for tx, g in zip(cfg.exchanges, groups)),
        pending=() if cfg.overlap == 0 else tuple(
            [jnp.zeros(g.shape, jnp.float32) for g in group] for group in groups),
        inner_exchange=() if cfg.inner_tx is None else cfg.inner_tx.init(params),
    )


def _plan(cfg: _Config, params: Any, num_replicas: int, inner_replicas: int = 1) -> CommunicationPlan:
    """What [`streaming_diloco`][commjax.optimizers.streaming_diloco.streaming_diloco] sends per
    device (its [`commjax.communication_plan`][]):
    each fragment's mean pseudo-gradient (exact fp32 of its pieces, or its exchange's plan)
    once every ``sync_every`` steps, at its own step, and the gradient mean over the inner
    axis every step. ``peak_bytes`` is the largest fragment's sync (with the group mean)."""
    leaves = jax.tree_util.tree_leaves(params)
    transfers = group_transfers(cfg, params, inner_replicas)
    for f, idx in enumerate(fragment_leaves(params, cfg.fragments, cfg.compressor, num_replicas)):
        pieces = [jax.ShapeDtypeStruct(q.shape, jnp.float32) for q in idx]
        if cfg.exchanges[f] is None:
            sync = exact_mean_transfers(f"fragment {f}", pieces, num_replicas)
        else:
            sync = repeated(communication_plan(cfg.exchanges[f], pieces, num_replicas).transfers, 1,
                            f"fragment {f}: ")
        # Fragment f is sent at the steps t with (t + 1) % H == ((f + 1) H / P) % H.
        h = cfg.sync_every
        transfers += repeated(sync, h, offset=((f + 1) * h // cfg.fragments - 1) % h)
    return CommunicationPlan("streaming_diloco", num_replicas, tuple(transfers),
                             float_baseline(leaves, num_replicas))


def _check_options(sync_every, fragments, overlap, mix) -> tuple[int, int, int, float]:
    h = validation.check_int("sync_every", sync_every, 1, factory=_NAME)
    p = validation.check_int("fragments", fragments, 1, factory=_NAME)
    if h % p:
        divisors = [d for d in range(1, h + 1) if h % d == 0]
        raise ValueError(
            f"{_NAME}: `fragments` ({p}) must divide `sync_every` ({h}), so that the fragments' "
            f"syncs are spread evenly over the round (one every sync_every / fragments steps); "
            f"pick fragments from {divisors} or change sync_every.")
    tau = validation.check_int("overlap", overlap, 0, factory=_NAME)
    if tau >= h:
        raise ValueError(
            f"{_NAME}: `overlap` ({tau}) must be smaller than `sync_every` ({h}): a fragment's "
            f"mean must be merged before the fragment's next sync; pass overlap <= {h - 1}.")
    alpha = validation.check_float("mix", mix, 0.0, 1.0, factory=_NAME)
    return h, p, tau, alpha


def _exchanges(compressor, fragments, axis_name, error_feedback, num_replicas, seed) -> tuple:
    if compressor is None:
        return (None,) * fragments
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"{_NAME}: `compressor` must be None (exact mean) or a commjax compressor such as "
            f"cj.quantize(bits=4), got {compressor!r}.")
    seed = validation.check_seed("seed", seed, factory=_NAME)
    # One exchange per fragment (its own residuals and rounding keys); fragment 0 uses
    # ``seed`` itself, so one fragment is diloco's exchange exactly.
    return tuple(compressed_mean(compressor, axis_name, error_feedback=error_feedback,
                                 num_replicas=num_replicas, seed=seed + f, bucket_bytes=None)
                 for f in range(fragments))


def streaming_diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    *,
    sync_every: int,
    fragments: int = 1,
    overlap: int = 0,
    mix: float = 0.0,
    compressor: Optional[Compressor] = None,
    axis_name: Any = "data",
    inner_axis_name: Any = None,
    error_feedback: bool = True,
    num_replicas: Optional[int] = None,
    seed: int = 0,
    inner_compressor: Optional[Compressor] = None,
    inner_replicas: Optional[int] = None,
) -> optax.GradientTransformation:
    """Streaming DiLoCo as one optax transformation: fragments synced at staggered steps.

    ``update(grads, state, params)`` takes this replica's gradient and parameters (inside
    ``shard_map``/``pmap`` over ``axis_name``, parameters kept per replica as for
    [`commjax.diloco`][]). Step ``t`` (0-based; ``H = sync_every``, ``P = fragments``,
    ``tau = overlap``, ``alpha = mix``; fragment ``f``'s pieces from
    [`fragment_leaves`][commjax.optimizers.streaming_diloco.fragment_leaves])::

        g = mean over inner_axis_name of g_i        # exact fp32, every step (if given)
        u_in = inner.update(g, p);  p' = p + u_in
        f sends at t   if (t + 1) % H == ((f + 1) H / P) % H:
            pending_f = mean_i(theta_f - p'_{i,f})  # only fragment f's bytes
        f merges at t  if it sent at t - tau:
            theta_f <- theta_f + outer_f.update(pending_f, theta_f)
            return landing_update(p, alpha p'_f + (1 - alpha) theta_f) on f's pieces, u_in elsewhere

    Fragment ``P - 1`` syncs on DiLoCo's sync steps, the others ``H / P`` steps apart
    before it. The step counter is traced: a ``lax.switch`` over ``P + 1`` branches picks
    the fragment, and only branch ``f`` holds a collective, of fragment ``f``'s pieces.
    At a merge each replica lands on the new shared parameters (with ``alpha = 0``) as in
    [`commjax.diloco`][] (exactly where the move is representable, else within half an
    ulp of each term); anchors are bit-identical on every replica.

    Overlap: ``tau > 0`` reproduces the paper's *schedule* (the mean computed at ``t``
    is applied at ``t + tau``, the replicas training on meanwhile). With one compiled
    program per step, the fragment's collective sits in a conditional and completes
    inside the step: the transfer does not run beside the next ``tau`` steps' compute, on
    CPU, GPU or TPU. For that, compile a whole round as one program (``H`` steps unrolled)
    and pass each step's position statically, ``update(g, state, params, step=k)`` for
    ``k = 0 .. H-1``: the sends are then plain collectives outside any conditional, whose
    result nothing reads before the merge ``tau`` steps later, which XLA's asynchronous
    collectives (GPU, TPU) may overlap with that compute (not measured here; see
    ``docs/crossdc.md``). A static ``step`` that disagrees with the state's counter mod
    ``H`` makes every replica's update NaN.

    Non-finite values: a NaN/Inf in a replica's inner update makes that replica's update
    NaN (and keeps its inner state); a non-finite fragment mean makes the whole update NaN
    on every replica at that fragment's merge, and keeps the fragment's anchor, outer
    state and exchange residuals. The counter always advances.

    Bytes per device ([`commjax.communication_plan`][]): on fragment ``f``'s send step the
    exact mean of its ``n_f <= ceil(n/P)`` elements, ``2 (N-1)/N * 4 n_f``, or the
    compressor's bytes for its pieces; 0 on other steps; a peak of ``1/P`` of a DiLoCo sync
    (exact; compressed up to the granule of ``block * N`` elements, and a NaN flag per
    piece where the codec's payloads cannot tell) and the same average per inner step as
    DiLoCo, ``sync / H``. ``inner_axis_name`` adds an exact all-reduce of the gradients
    over the fast axis every step, ``2 (M-1)/M * 4 n``, or with ``inner_compressor`` that
    compressor's bytes for the gradients (the plan's ``inner-axis mean`` transfers).
    Its residuals differ on every device, so lay
    ``state.inner_exchange`` out over both axes::

        s = tx.init(params)
        both = (axis_name, inner_axis_name)
        state = cj.shard_state(s, mesh, axis_name)._replace(
            inner_exchange=cj.shard_state(s.inner_exchange, mesh, both))
        specs = cj.state_specs(state, axis_name)._replace(
            inner_exchange=cj.state_specs(state.inner_exchange, both))

    Args:
      inner: the local optimizer (e.g. ``optax.adamw(1e-3)``); must not communicate.
      outer: the outer optimizer, one state per fragment (e.g.
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``).
      sync_every: ``H``, inner steps between two syncs of the same fragment (``>= 1``).
      fragments: ``P``, number of fragments; must divide ``sync_every`` and be at most the
        number of parameter elements. With a ``compressor`` the cuts depend on ``N``
        (whole granules of ``block * N`` elements): ``init`` outside ``shard_map`` cuts
        for ``num_replicas`` (default: every device), which must be the size of
        ``axis_name``.
      overlap: ``tau``, steps between a fragment's send and its merge, ``0 <= tau < H``.
      mix: ``alpha`` in ``[0, 1]``, the weight of the replica's own parameters at a merge.
      compressor: ``None`` (exact fp32 mean) or a commjax compressor for
        [`commjax.compressed_mean`][] on each fragment's pseudo-gradient (error
        feedback per fragment; fragment ``f`` uses ``seed + f``).
      axis_name: mesh axis (or tuple) of the workers; ``None`` for one worker.
      inner_axis_name: optional fast mesh axis of data-parallel groups inside each worker:
        gradients are averaged exactly (or through ``inner_compressor``) over it every
        step, and the sync runs over ``axis_name`` only. Parameters and state are then
        identical across this axis (lay the state out with ``cj.state_specs(state,
        axis_name)``; the inner exchange's residuals over both axes).
      error_feedback, num_replicas, seed: as in [`commjax.diloco`][].
      inner_compressor: ``None`` (exact group mean) or a commjax compressor: the gradients
        are averaged over ``inner_axis_name`` every step by
        ``cj.compressed_mean(inner_compressor, inner_axis_name)`` (error feedback as
        ``error_feedback``, rounding seed ``seed + fragments``), whose mean is identical on
        every device of the group; its residuals are per device, in
        ``state.inner_exchange``. Needs ``inner_axis_name``.
      inner_replicas: devices per group the inner exchange's state is sized for when
        ``init`` runs outside ``shard_map`` (default: every device).

    Returns:
      An ``optax.GradientTransformation`` with
      [`StreamingDiLoCoState`][commjax.optimizers.streaming_diloco.StreamingDiLoCoState].

    Raises:
      ValueError: bad options (named in the message, with the fix); at ``init``/``update``
        more fragments than parameter elements, ``params`` missing or replicated.
      AxisNotBoundError: ``update`` called where an axis is not bound.
    """
    for name, tx in (("inner", inner), ("outer", outer)):
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"{_NAME}: `{name}` must be an optax.GradientTransformation, got {tx!r}.")
    h, p, tau, alpha = _check_options(sync_every, fragments, overlap, mix)
    axis_name = validation.check_axis_name("axis_name", axis_name, factory=_NAME)
    inner_axis_name = validation.check_axis_name("inner_axis_name", inner_axis_name, factory=_NAME)
    validation.check_axis_pair(axis_name, inner_axis_name, factory=_NAME)
    validation.check_bool("error_feedback", error_feedback, factory=_NAME)
    seed = validation.check_seed("seed", seed, factory=_NAME)
    exchanges = _exchanges(compressor, p, axis_name, error_feedback, num_replicas, seed)
    inner_tx = inner_exchange(inner_compressor, inner_axis_name, error_feedback=error_feedback,
                              inner_replicas=inner_replicas, seed=seed + p, factory=_NAME)
    cfg = _Config(inner, outer, h, p, tau, alpha, axis_name, inner_axis_name, exchanges, compressor, num_replicas,
                  inner_tx)
    return with_plan(optax.GradientTransformationExtraArgs(
        lambda params: _init(cfg, params),
        lambda u, s, params=None, *, step=None, **extra: _update(cfg, u, s, params, step)),
        functools.partial(_plan, cfg))
