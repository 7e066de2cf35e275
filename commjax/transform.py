"""``compressed_mean``: the optax transform that replaces gradients by a compressed mean.

One step on replica ``i`` of ``N`` (all leaves of the compressed bucket at once)::

    x_i   = g_i + e_i                      # error feedback: add what was not sent before
    p_i   = encode(x_i)                    # compressor payload, uint32 words
    m     = reduce(p_1..p_N) ~ mean_i x_i  # reducer, identical on every replica
    e_i  <- x_i - decode(p_i)              # worker residual (if error_feedback)
    return m

In stages, each one function: validate (axes bound, gradients unreduced, state shapes),
plan ([`commjax.plan`][]: which leaves are exact, compressed or passed through), the
inner-axis mean (hierarchical meshes), the exact stage (one fp32 all-reduce of the small
leaves with one NaN flag per compressed leaf whose mean cannot tell:
``commjax.collectives._exact.exact_mean``), the
compressed stage (encode with error feedback and reduce:
``commjax.collectives._reducers.reduce_parts``, or a stateful exchange such as PowerSGD's:
[`commjax.exchanges`][]), then outputs, residuals and metrics.

The compressed leaves form one *bucket* (one payload, one set of collectives), but its
full-size float vector is never written for block codecs: each leaf is encoded into its
share of the payload words by the fused error-feedback + quantize + pack kernel, and
decoded by the fused unpack + dequantize + sum kernel. Only codecs whose selection spans
leaves (top-k, random-k, threshold) join ``x``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from commjax import _compat, bucket as flat_bucket, ef21, guards, validation
from commjax.bucketing import BucketedState, auto_bucket_bytes, bucketed
from commjax.fingerprint import check_made_for, describe, made_for
from commjax.collectives._exact import exact_mean
from commjax.collectives._reducers import check_reducer, reduce_parts
from commjax.compressors.base import Compressor
from commjax.exchanges import exchange_for
from commjax.guards import AxisNotBoundError
from commjax.layout import per_replica
from commjax.accounting import planner_of, with_plan
from commjax.plan import COMPRESS, EXACT, PASS, MeanPlan, make_plan, mean_plan, sent_directly

__all__ = ["CompressedMeanState", "compressed_mean", "AxisNotBoundError"]


#: Folded into the state's key for the exchange's initial state (PowerSGD's Q), so that
#: the step can redraw it from replica 0's key (see ``Exchange.run``'s ``init_key``).
_INIT_SALT = 0xC0DE


@per_replica("residual", "server_residual", "metrics")
class CompressedMeanState(NamedTuple):
    """State of [`compressed_mean`][commjax.transform.compressed_mean].

    Attributes:
      count: int32 scalar, replicated. Exchanges done so far.
      key: uint32[2] raw PRNG key, replicated. Per-step and per-replica keys are folded
        from it (``fold_in(fold_in(key, count), axis_index)``), so it never needs to differ
        between replicas and is never split in the state.
      residual: per-replica worker error-feedback residuals, a tuple with one array in
        the leaf's shape (``float32`` or ``residual_dtype``) per compressed leaf, in the
        order of ``communication_plan(...).segments``; ``()`` without error feedback and
        for a lossless compressor (the identity), whose residual would always be zero.
        Kept per leaf so that the step reads and writes each in place, never a joined
        copy; in the leaf's shape so that it means the same on every backend (the
        exchange reads leaves in memory order: ``commjax.bucket.ravel_leaf``; compressors
        with their own exchange, PowerSGD, factor the leaves as they are).
      server_residual: per-replica residual of the two-phase reducer's re-encoding, one
        chunk of the bucket; ``()`` for other reducers (a zero-size array would make
        orbax's standard handlers refuse the state). The bucket holds the leaves in the
        backend's memory order, so this chunk is specific to the backend kind (TPU or
        not) it was computed on: a state moved between them keeps working, with this
        one residual's entries misplaced for one step.
      compressor_state: replicated state of a compressor with its own exchange (PowerSGD's
        Q factors); ``()`` otherwise.
      metrics: per-replica ``float32[1]`` values of the last step, computed locally with no
        extra collective: ``residual_norm`` (l2 norm of this replica's worker residual),
        ``nonfinite`` (1 if a compressed leaf was non-finite on some replica), and the
        compressor's own (``compressor.metric_names``).
      made_for: replicated, ``{fingerprint: uint32[1]}``: the compressor and options, the
        parameters' keys and shapes the state was made for ([`commjax.fingerprint`][]);
        ``update`` refuses gradients and transforms it was not made for.
    """

    count: jax.Array
    key: jax.Array
    residual: tuple
    server_residual: Any
    compressor_state: Any
    metrics: dict
    made_for: dict


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
    #: What a flagged leaf's residuals become (``check_finite``): ``"keep"`` (their
    #: previous value) or ``"reset"`` (zero).
    on_nonfinite: str = "keep"
    #: One of several buckets of a step (``compressed_mean(bucket_bytes=...)``).
    in_buckets: bool = False

    def plan(self, leaves, num_replicas: int) -> MeanPlan:
        return make_plan(
            leaves, self.compressor, num_replicas=num_replicas, reducer=self.reducer,
            min_compress_size=self.min_compress_size, compress_vectors=self.compress_vectors,
            check_finite=self.check_finite,
        )

    @property
    def tpu_norm_sums(self) -> bool:
        """On TPU, the residual-norm metric from ``guards._banded_norm``'s three plain sums
        (else ``guards.l2_norm``): for a whole step, for exchanges, and in buckets for the
        codecs that declare it (see ``guards.l2_norm_near`` for which one XLA fuses where)."""
        c = self.compressor
        return not self.in_buckets or c.has_exchange or c.tpu_norm_sums_in_buckets

    @property
    def feedback(self) -> bool:
        """A worker residual is kept (a lossless codec's would always be zero)."""
        return self.error_feedback and not self.compressor.lossless


def _residual_shapes(cfg: ExchangeConfig, plan: MeanPlan) -> tuple[tuple[int, ...], ...]:
    """Shape of each worker residual the state holds: one array per compressed leaf, in
    the leaf's shape (the same meaning on every backend, whatever order the exchange
    reads it in: ``_flat_order``); none without error feedback or for a lossless
    compressor."""
    if not cfg.feedback:
        return ()
    return tuple(tuple(s.shape) for s in plan.segments)


def _num_replicas_now(cfg: ExchangeConfig) -> int:
    """Replicas the state is sized for at ``init`` (see ``num_replicas``)."""
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


# ------------------------------------------------------------------ the step, in stages


def _validate(cfg: ExchangeConfig, updates, leaves, state: CompressedMeanState):
    """Axes bound, gradients unreduced, the state made for these gradients: ``(plan, N)``."""
    n_rep = guards.check_bound(cfg.axis_name, "compressed_mean")
    guards.check_bound(cfg.inner_axis_name, "compressed_mean")
    plan = cfg.plan(leaves, n_rep)
    if cfg.axis_name is not None:
        guards.check_unreduced(leaves, cfg.axis_name, "compressed_mean")
    _check_state(cfg, plan, state, n_rep, updates)
    return plan, n_rep


def _options(cfg: ExchangeConfig) -> tuple:
    """What the state's meaning depends on, for its fingerprint."""
    return (cfg.compressor, cfg.error_feedback, cfg.reducer, cfg.residual_dtype, cfg.min_compress_size,
            cfg.compress_vectors)


_MAKE_STATE = ("Make the state with this transform's init (cj.init_sharded(tx, params, mesh, axis)), "
               "or restore a checkpoint saved by the same chain.")


def _check_state(cfg: ExchangeConfig, plan: MeanPlan, state, n_rep: int, updates) -> None:
    """The state must be what ``init`` makes for these gradients, compressor and replica
    count, in its local (per-replica) view: say which of these differs."""
    if isinstance(state, BucketedState):
        raise ValueError(
            f"compressed_mean: the state holds {len(state.buckets)} buckets, this transform runs "
            "one (bucket_bytes=None, or \"auto\" off a TPU backend): the state was made in buckets "
            "(bucket_bytes=N, or \"auto\" on a TPU). Pass the bucket_bytes the state was made "
            "with, or make the state with this transform's init.")
    if not isinstance(state, CompressedMeanState):
        raise TypeError(f"compressed_mean: `state` must be the CompressedMeanState made by "
                        f"init(); got {type(state).__name__}.")
    check_made_for("compressed_mean", state.made_for, cfg.compressor.name, _options(cfg), updates,
                   num_replicas=n_rep, fix=_MAKE_STATE, label=describe(cfg.compressor))
    want_cs = jax.eval_shape(lambda: _exchange_state(cfg, plan, n_rep))
    got_cs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), a.dtype), state.compressor_state)
    if jax.tree_util.tree_structure(got_cs) != jax.tree_util.tree_structure(want_cs) or any(
            a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(got_cs), jax.tree_util.tree_leaves(want_cs))):
        raise ValueError(
            f"compressed_mean: the state's compressor_state does not fit {cfg.compressor.name}: was "
            "the state made by init() of a transform with another compressor, options or parameters?")
    want = _residual_shapes(cfg, plan)
    have = tuple(tuple(jnp.shape(r)) for r in state.residual)
    if have != want:
        raise ValueError(f"compressed_mean: {_residual_mismatch(have, want, n_rep)}")
    if cfg.axis_name is not None and _replicated_residual(state, cfg.axis_name):
        raise ValueError(f"compressed_mean: {_LAYOUT_HINT}")
    if _size_of(state.server_residual) != plan.server_residual_size:
        if _size_of(state.server_residual) == n_rep * plan.server_residual_size:
            raise ValueError(f"compressed_mean: {_LAYOUT_HINT}")
        raise ValueError(
            "compressed_mean: the state was initialised for a different number of replicas "
            f"(server residual of {_size_of(state.server_residual)} elements, {n_rep} replicas "
            f"need {plan.server_residual_size}). Pass num_replicas={n_rep} to compressed_mean, "
            "or create the state with cj.init_sharded(tx, params, mesh, axis_name).")


def _replicated_residual(state, axis_name) -> bool:
    """Under ``check_vma=True``: a per-replica leaf typed replicated (laid out ``P()``), so
    every replica would leave with one replica's residual."""
    tracked = _compat.varying_axes(lax.axis_index(axis_name))
    if not tracked:
        return False
    names = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
    leaves = list(state.residual) + jax.tree_util.tree_leaves(state.server_residual)
    return any(not names <= set(_compat.varying_axes(r) or ()) for r in leaves)


def _size_of(server_residual) -> int:
    """Elements of the server residual (``()`` when the reducer keeps none)."""
    return int(server_residual.shape[0]) if hasattr(server_residual, "shape") else 0


_LAYOUT_HINT = (
    "the state's per-replica leaves are not laid out per replica here (the global view, or "
    "replicated P()): lay the state out with cj.shard_state(state, mesh, axis) (or create it "
    "with cj.init_sharded) and pass cj.state_specs(state, axis) as its shard_map "
    "in_specs/out_specs (P(axis) for per-replica leaves).")


def _residual_mismatch(have, want, n_rep: int) -> str:
    """Why the residual shapes differ, in the terms of the likely cause."""
    if len(have) == len(want) and have and all(h[0] == n_rep * w[0] for h, w in zip(have, want)):
        return _LAYOUT_HINT
    if len(have) == len(want) and have and all(h[0] * n_rep == w[0] for h, w in zip(have, want)):
        return ("each gradient leaf holds 1/N of what the state was made for: are the parameters "
                "sharded over the axis (P(axis))? Data-parallel parameters are replicated (P()).")
    return (f"the state's residual holds arrays of shapes {have} but these gradients need "
            f"{want} (one per compressed leaf): was the state made by init() for other "
            "parameters or other options?")


def _inner_mean(cfg: ExchangeConfig, leaves, plan: MeanPlan) -> list:
    """Hierarchical exchange: the exact mean over the fast inner axis comes first; only
    the slow axis sees compression."""
    if cfg.inner_axis_name is None:
        return list(leaves)
    inner = cfg.inner_axis_name
    size = _compat.axis_size(inner)
    return [l if r == PASS else (_compat.psum(l.astype(jnp.float32), inner) / size).astype(l.dtype)
            for l, r in zip(leaves, plan.routes)]


class _Exact(NamedTuple):
    out: dict  # leaf index -> exact mean (exact leaves, and compressed ones sent directly)
    local_ok: list  # per compressed leaf: finite on this replica
    global_bad: list  # per compressed leaf: non-finite on some replica
    bucket: Any  # the exact all-reduce's result (to sequence the compressed collectives)
    shared_key: Any  # the state's key as every replica holds it (replica 0's)


def _exact_stage(cfg: ExchangeConfig, leaves, plan: MeanPlan, n_rep: int,
                 key: jax.Array) -> _Exact:
    """The exact fp32 mean of the exact leaves in one all-reduce, with one NaN flag per
    compressed leaf riding along (and replica 0's key, for codecs whose randomness must be
    shared); a lossless linear codec (the fp32 identity) sends its leaves as further
    operands of the same collective."""
    exact_idx = [i for i, r in enumerate(plan.routes) if r == EXACT]
    comp_idx = [i for i, r in enumerate(plan.routes) if r == COMPRESS]
    local_ok = [guards.all_finite(leaves[i]) for i in comp_idx] if plan.finite_flags else []
    flags = [jnp.where(ok, 0.0, 1.0).reshape(1) for ok in local_ok]
    direct = comp_idx if _direct(cfg, plan) else []
    parts, owners = [], []
    for i in exact_idx:  # complex leaves as their real and imaginary parts
        pieces = _real_parts(leaves[i])
        parts += pieces
        owners += [i] * len(pieces)
    shared = _key_parts(cfg, key, n_rep) if plan.segments else []  # nothing compressed: no key
    means, extra = exact_mean(parts + flags + shared, cfg.axis_name, n_rep,
                              extra=[leaves[i] for i in direct])
    out = {i: _from_real_parts([m for m, o in zip(means, owners) if o == i], leaves[i])
           for i in exact_idx}
    out.update(zip(direct, extra))
    # `!= 0` is also True for a NaN flag.
    global_bad = [f[0] != 0 for f in means[len(parts):len(parts) + len(flags)]]
    if direct and not plan.finite_flags:
        # A pre-scaled sum cannot overflow: a mean sent directly is non-finite exactly when
        # some replica's leaf is, so it flags itself. One read of each mean after the
        # all-reduce, instead of one of each input before it, which also kept the compiler
        # from scaling the input in the GEMM that produced it (H100, train step of eight
        # 2048-wide layers: 1,346 MB, against 1,681 with the inputs read; lax.pmean 1,212).
        global_bad = [jnp.logical_not(guards.all_finite(m)) for m in extra]
    if shared:
        key = _key_from_parts(means[len(parts) + len(flags):], n_rep)
    bucket = means[0] if means else None
    return _Exact(out, local_ok, global_bad, bucket, key)


def _key_parts(cfg: ExchangeConfig, key: jax.Array, n_rep: int) -> list:
    """Replica 0's raw key as four 16-bit halves (exact in fp32), zeros elsewhere: the
    exact all-reduce then hands every replica the same key, so positions drawn from it
    (random-k) cannot differ even if processes were given different seeds."""
    if not cfg.compressor.shared_randomness or cfg.axis_name is None or n_rep <= 1:
        return []
    words = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    words = jnp.ravel(words).astype(jnp.uint32)[:2]
    halves = jnp.stack([words & 0xFFFF, words >> 16], axis=1).reshape(-1).astype(jnp.float32)
    first = (lax.axis_index(cfg.axis_name) == 0).astype(jnp.float32)
    return [halves * first]


def _key_from_parts(means: list, n_rep: int) -> jax.Array:
    halves = jnp.round(means[0] * n_rep).astype(jnp.uint32).reshape(2, 2)
    return halves[:, 0] | (halves[:, 1] << 16)


def _real_parts(leaf) -> list:
    """A leaf as real arrays: itself, or a complex leaf's real and imaginary parts."""
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
        return [jnp.real(leaf), jnp.imag(leaf)]
    return [leaf]


def _from_real_parts(means: list, leaf):
    """The inverse of ``_real_parts``, in the leaf's shape and dtype."""
    if len(means) == 2:
        return (means[0] + 1j * means[1]).reshape(leaf.shape).astype(leaf.dtype)
    return means[0].reshape(leaf.shape).astype(leaf.dtype)


def _flat_order(cfg: ExchangeConfig) -> tuple:
    """``(ravel, unravel)`` between a compressed leaf and its part: the order its bytes
    lie in memory (``commjax.bucket.ravel_leaf``), except for exchanges (PowerSGD), which
    take each leaf as it is (they factor it as a matrix, a reshape of the leaf itself:
    a flat row-major part is a transpose each way on TPU, four passes over every leaf of
    a v5e step)."""
    if exchange_for(cfg.compressor) is not None:
        return (lambda a: a), (lambda v, shape: v.reshape(shape))
    return flat_bucket.ravel_leaf, flat_bucket.unravel_leaf


def _direct(cfg: ExchangeConfig, plan: MeanPlan) -> bool:
    return sent_directly(cfg.compressor, plan.reducer)


class _Compressed(NamedTuple):
    means: list  # per compressed leaf, flat float32
    residuals: list  # per compressed leaf, new worker residual (fp32), or []
    server_residual: jax.Array
    compressor_state: Any
    metrics: dict
    finite: Any = None  # per leaf: its mean finite, from the payloads' scale words or the
    # exchange's factors (None: sparse codecs, whose finite inputs give finite means)
    kept: bool = False  # residuals already the old ones where flagged (all the flags known
    # before the exchange, finite None): not selected again


def _compressed_stage(cfg, leaves, plan, state, keys, n_rep, exact: _Exact) -> _Compressed:
    """Encode and reduce the compressed leaves (each its own padded part; the joined
    float bucket is never written for block codecs), with error feedback. Returns the new
    states as computed: a non-finite step's are discarded by ``_update``."""
    comp_idx = [i for i, r in enumerate(plan.routes) if r == COMPRESS]
    segs = plan.segments
    ravel = _flat_order(cfg)[0]
    res_ravel = _flat_order(cfg)[0]
    exchange = exchange_for(cfg.compressor)
    parts = [_pad(ravel(leaves[i].astype(jnp.float32)), s) for i, s in zip(comp_idx, segs)]
    apart = (cfg.compressor.leaf_local if plan.reducer_impl is None
             else plan.reducer_impl.keeps_leaves_apart(cfg.compressor))
    zero_bad = plan.finite_flags and not apart
    ok = list(exact.local_ok)
    if exact.bucket is not None and cfg.axis_name is not None:
        # Sequence the exact all-reduce before the compressed collectives: XLA may start
        # independent collectives in different orders on different devices, which
        # deadlocks runtimes that rendezvous per collective (CPU). Through the flags
        # when the parts read them: a barrier on the parts themselves writes them out.
        if zero_bad:
            _, ok = lax.optimization_barrier((exact.bucket, ok))
        else:
            _, parts = lax.optimization_barrier((exact.bucket, parts))
    if zero_bad:
        # A non-finite leaf would spoil the others' encoding: it contributes zeros.
        parts = _zero_bad(parts, ok)
    residuals = [res_ravel(r.astype(jnp.float32)) for r in state.residual] if cfg.feedback else None
    comp_metrics = {}
    if cfg.compressor.metric_names and not cfg.compressor.metrics_from_payload:
        comp_metrics = cfg.compressor.local_metrics(_with_residuals(parts, residuals, segs), segs)
    if exchange is not None:
        # Leaf-shaped parts, residuals and results (``_flat_order``): nothing is padded.
        xs = parts if residuals is None else [p + r for p, r in zip(parts, residuals)]
        # Where the residual's pass reads the old residual anyway (to keep it on a flagged
        # step), the exchange gets g and e apart and on GPU forms g + e where it reads it
        # (``commjax.exchanges.powersgd``); elsewhere g + e is written once and read by
        # all (H100, GPT-2 small, PowerSGD r4 with reset: 4,912 MB a step, 5,791 apart).
        apart = residuals is not None and cfg.check_finite and cfg.on_nonfinite == "keep"
        means, locals_, cs, finite = exchange.run(
            cfg.compressor, parts if apart else xs, segs, state.compressor_state,
            axis_name=cfg.axis_name, num_replicas=n_rep,  # one replica: psums of one, typed replicated
            shared_key=keys[0], init_key=keys[2], count=state.count, residuals=residuals if apart else None)
        new_res = [] if residuals is None else [x - l for x, l in zip(xs, locals_)]
        return _Compressed(means, new_res, state.server_residual, cs, comp_metrics, finite)
    server = state.server_residual if plan.server_residual_size else None
    # Leaves flagged before the exchange keep their residuals: a reducer may select them
    # itself, ahead of the exchange (``PartsResult.kept``).
    keep = (list(exact.global_bad) if cfg.check_finite and cfg.on_nonfinite == "keep" and residuals is not None
            and plan.finite_flags else None)
    res = reduce_parts(
        cfg.compressor, plan.reducer_impl, parts, segs,
        axis_name=cfg.axis_name, num_replicas=n_rep, key=keys[1], residuals=residuals,
        server_residual=server, server_error_feedback=cfg.server_error_feedback,
        shared_key=keys[0], keep=keep)
    new_server = state.server_residual if server is None else res.server_residual
    new_res = [] if residuals is None else list(res.residuals)
    if cfg.compressor.metric_names and cfg.compressor.metrics_from_payload:
        if res.sent is None:
            raise AssertionError(f"reducer {plan.reducer!r} does not report what {cfg.compressor.name} sent")
        comp_metrics = cfg.compressor.payload_metrics(res.sent, segs)
    return _Compressed(res.means, new_res, new_server, state.compressor_state, comp_metrics, res.finite,
                       kept=res.kept and res.finite is None)


def _pad(part: jax.Array, seg) -> jax.Array:
    """A flat part padded with zeros to the codec's alignment; a leaf-shaped part (an
    exchange's) as it is, which must need none."""
    if part.ndim == 1:
        return jnp.pad(part, (0, seg.padded_size - seg.size))
    if seg.padded_size != seg.size:
        raise AssertionError(f"a leaf-shaped part of {seg.size} elements needs padding to {seg.padded_size}")
    return part


def _zero_bad(parts: list, ok: list) -> list:
    """Each part, or zeros where its leaf is not finite on this replica. On GPU a select
    that fuses into each reader (a conditional's pass-through branch needs a buffer of its
    own: a copy of every leaf, 168 MB of the H100 MLP's top-k step); on CPU and TPU decided
    once for the bucket under a conditional (a select inside the fusion that joins the
    bucket is slow on CPU; on a v5e the select cost 100 MB more of the MLP's top-k step)."""
    def select(ps, *oks):
        return [jnp.where(o, p, 0.0) for p, o in zip(ps, oks)]

    def decide(ps, *oks):
        return lax.cond(jnp.all(jnp.stack(oks)), lambda qs: list(qs), lambda qs: select(qs, *oks), ps)

    return _compat.platform_dependent(parts, *ok, cpu=decide, tpu=decide, default=select)


def _with_residuals(parts, residuals, segments):
    """``x = g + e`` as one flat vector (the codecs' metrics read it)."""
    if residuals is None:
        return flat_bucket.concat([p.reshape(-1) for p in parts])
    return flat_bucket.concat([(p + _pad(r.astype(jnp.float32), s)).reshape(-1)
                               for p, r, s in zip(parts, residuals, segments)])


def _means(plan, exact: _Exact, comp: Optional[_Compressed]) -> list:
    """Each compressed leaf's mean (flat, or in its shape when sent directly); on one
    replica typed replicated by the reducer or exchange itself."""
    comp_idx = [i for i, r in enumerate(plan.routes) if r == COMPRESS]
    if comp is None:
        return [exact.out[i] for i in comp_idx]
    return list(comp.means)


def _bad_flags(cfg, plan: MeanPlan, exact: _Exact, comp: Optional[_Compressed]) -> list:
    """Per compressed leaf, replicated: non-finite on some replica before the exchange (the
    flags of the exact stage), or after it (a block that could not be encoded, factors
    that overflowed): read from the payloads' scale words, or from an exchange's factors.
    Both are identical on every replica, so every replica decides the same. Without flags
    (``plan.finite_flags`` False) the latter alone: a non-finite input makes them
    non-finite. (Sparse codecs send the values themselves: finite inputs give finite
    means.)"""
    if not cfg.check_finite or not plan.segments:
        return []
    after = None if comp is None else comp.finite
    if not plan.finite_flags and not _direct(cfg, plan):
        if after is None:
            raise AssertionError("the plan sends no finite flags, but the exchange reports none")
        return [jnp.logical_not(f) for f in after]
    if after is None:
        return list(exact.global_bad)
    return [jnp.logical_or(b, jnp.logical_not(f)) for b, f in zip(exact.global_bad, after)]


def _finish_leaves(cfg, leaves, plan, state, exact: _Exact, comp: Optional[_Compressed], means, bad):
    """Outputs in the leaves' shapes and dtypes, NaN on every replica for a flagged leaf,
    and the new residuals (the old ones kept on such a leaf)."""
    out = list(leaves)
    for i, v in exact.out.items():
        out[i] = v
    comp_idx = [i for i, r in enumerate(plan.routes) if r == COMPRESS]
    # Exact means come in the leaves' shapes, compressed ones in the parts' order.
    unravel = _flat_order(cfg)[1] if comp is not None else (lambda v, shape: v.reshape(shape))
    for k, (i, seg) in enumerate(zip(comp_idx, plan.segments)):
        m = means[k]
        if cfg.check_finite:
            # An addition, not a select: a select between the decode and the optimizer's
            # `p - lr * m` changes whether the compiler contracts them into a multiply-add,
            # differently for differently fused (kernel / reference) decodes.
            m = m + jnp.where(bad[k], jnp.nan, 0.0)
        out[i] = unravel(m, seg.shape).astype(leaves[i].dtype)
    new_residual = state.residual
    if comp is not None and comp.residuals:
        new_residual = tuple(
            _new_residual(cfg, state.residual[k], e, bad[k] if cfg.check_finite and not comp.kept else None,
                          seg.shape)
            for k, (e, seg) in enumerate(zip(comp.residuals, plan.segments)))
    return out, new_residual


#: Leaves (bucket pieces) of at most this many fp32 bytes select a kept residual in their
#: own shape (``_new_residual``).
_SHAPED_SELECT_BYTES = 4 << 20


def _new_residual(cfg: ExchangeConfig, old: jax.Array, e: jax.Array, bad: Optional[jax.Array],
                  shape: tuple) -> jax.Array:
    """A compressed leaf's new residual in its shape and ``residual_dtype``: ``e`` (in the
    part's order), or where ``bad`` what ``_flagged_residual`` makes of ``old``.

    Kept residuals of leaves in buckets of at most ``_SHAPED_SELECT_BYTES`` are selected
    in the leaf's shape, the others in the part's order: each where a v5e moves less.
    21M-parameter MLP, 4 MB buckets: int8 698 MB a step, int4 744, bf16 488 in the part's
    order against 447, 447 and 446 in the leaf's shape (GPT-2 small: int8 4,193 against
    3,025). One bucket in the leaf's shape: int4 910 MB against 814, bf16 1,226 against
    706; 16 MB pieces: int8 577 against 457 (bf16 residuals); reset's zero in 4 MB buckets:
    GPT-2's int8 3,122 against 3,025. On GPU and CPU the two orders are the same
    (``commjax.bucket.ravel_leaf``), and on every backend the same bits."""
    ravel, unravel = _flat_order(cfg)
    shaped = (cfg.in_buckets and cfg.on_nonfinite == "keep"
              and 4 * int(np.prod(shape)) <= _SHAPED_SELECT_BYTES)
    if shaped and bad is not None:
        return jnp.where(bad, old.astype(jnp.float32), unravel(e, shape)).astype(cfg.residual_dtype)
    if bad is not None:
        e = jnp.where(bad, _flagged_residual(cfg, ravel(old)), e)
    # Cast before the unravel (v5e, int8 with bf16 residuals in 16 MB buckets: 457 MB a
    # step, 523 cast after).
    return unravel(e.astype(cfg.residual_dtype), shape)


def _flagged_residual(cfg: ExchangeConfig, old: jax.Array):
    """A flagged leaf's new residual: ``old`` (``"keep"``), or zero (``"reset"``), which
    the step then need not read again after the exchange: the select that keeps ``old``
    reads the old residual a second time, in the pass that writes the new one (v5e,
    21M-parameter MLP: int8 916 -> 821 MB a step, PowerSGD r4 506 -> 420 MB)."""
    if cfg.on_nonfinite == "keep":
        return old
    return jax.tree_util.tree_map(lambda o: jnp.zeros((), o.dtype), old)


def _metrics(cfg: ExchangeConfig, residual, any_bad, comp_metrics, last_norm) -> dict:
    # Read in memory order: a row-major ravel would transpose each residual on TPU.
    norm = guards.l2_norm_near([flat_bucket.ravel_leaf(r) for r in residual], last_norm,
                               tpu_sums=cfg.tpu_norm_sums)
    metrics = {"residual_norm": norm.reshape(1), "nonfinite": any_bad.astype(jnp.float32).reshape(1)}
    for name in cfg.compressor.metric_names:
        metrics[name] = jnp.asarray(comp_metrics.get(name, 0.0), jnp.float32).reshape(1)
    # Per-replica state, typed as such whatever each value is (the layout's contract).
    return metrics if cfg.axis_name is None else _compat.vary(metrics, cfg.axis_name)


def _update(cfg: ExchangeConfig, updates, state: CompressedMeanState):
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    plan, n_rep = _validate(cfg, updates, leaves, state)
    leaves = _inner_mean(cfg, leaves, plan)
    step_key = jax.random.fold_in(state.key, state.count)
    replica_key = step_key if cfg.axis_name is None else jax.random.fold_in(
        step_key, lax.axis_index(cfg.axis_name))
    exact = _exact_stage(cfg, leaves, plan, n_rep, state.key)
    comp = None
    if plan.segments and not _direct(cfg, plan):
        keys = (jax.random.fold_in(exact.shared_key, state.count), replica_key,
                jax.random.fold_in(exact.shared_key, _INIT_SALT))
        comp = _compressed_stage(cfg, leaves, plan, state, keys, n_rep, exact)
    means = _means(plan, exact, comp)
    bad = _bad_flags(cfg, plan, exact, comp)
    any_bad = jnp.any(jnp.stack(bad)) if bad else jnp.zeros((), bool)
    out, residual = _finish_leaves(cfg, leaves, plan, state, exact, comp, means, bad)
    server, cs = state.server_residual, state.compressor_state
    if comp is not None:
        cs = guards.keep_if(any_bad, cs, comp.compressor_state)
        server = guards.keep_if(any_bad, _flagged_residual(cfg, server), comp.server_residual)
    new_state = CompressedMeanState(
        count=state.count + 1, key=state.key, residual=residual, server_residual=server,
        compressor_state=cs,
        metrics=_metrics(cfg, residual, any_bad, {} if comp is None else comp.metrics,
                         state.metrics["residual_norm"]),
        made_for=state.made_for,
    )
    return jax.tree_util.tree_unflatten(treedef, out), new_state


def _check_options(compressor: Compressor, *, reducer: str, axis_name: Any, inner_axis_name: Any,
                   error_feedback: Any, compress_vectors: Any, server_error_feedback: Any,
                   check_finite: Any, seed: Any, min_compress_size: Any, residual_dtype: Any,
                   num_replicas: Any) -> None:
    """compressed_mean's options, each refused by name with the fix."""
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"compressed_mean: `compressor` must be a commjax compressor such as "
            f"cj.quantize(bits=8), got {compressor!r}.")
    exchange = exchange_for(compressor)
    if exchange is not None and reducer != "auto":
        raise ValueError(
            f"compressed_mean: {compressor.name} runs its own exchange; `reducer` must be "
            f"'auto', got {reducer!r}.")
    if exchange is None:
        check_reducer(compressor, reducer)
    factory = "compressed_mean"
    axis_name = validation.check_axis_name("axis_name", axis_name, factory=factory)
    inner_axis_name = validation.check_axis_name("inner_axis_name", inner_axis_name, factory=factory)
    validation.check_axis_pair(axis_name, inner_axis_name, factory=factory)
    if isinstance(error_feedback, str):  # True, False or "ef21"
        validation.check_choice("error_feedback", error_feedback, ("ef21",), factory=factory)
    else:
        validation.check_bool("error_feedback", error_feedback, factory=factory)
    for name, value in (("compress_vectors", compress_vectors),
                        ("server_error_feedback", server_error_feedback)):
        validation.check_bool(name, value, factory=factory)
    if not (isinstance(check_finite, (bool, np.bool_)) or (isinstance(check_finite, str) and check_finite == "reset")):
        raise ValueError(f"{factory}: `check_finite` must be True, False or 'reset'; got {check_finite!r}.")
    if isinstance(check_finite, str):
        if error_feedback == "ef21":
            raise ValueError(
                "compressed_mean: check_finite='reset' zeroes the classic residual of a flagged "
                "leaf, but with error_feedback='ef21' that residual is the worker's gradient "
                "estimate, which must be kept; pass check_finite=True with EF21.")
    validation.check_seed("seed", seed, factory=factory)
    if error_feedback and getattr(compressor, "rescale", False):
        raise ValueError(
            "compressed_mean: random_k(rescale=True) is unbiased on its own; with error feedback "
            "the rescaled estimate overshoots and the residual grows without bound. Pass "
            "error_feedback=False, or random_k(rescale=False) with error feedback.")
    validation.check_int("min_compress_size", min_compress_size, 1, factory=factory)
    # float16 is refused: its range (65504) overflows with loss-scaled gradients, and an
    # infinite residual would poison every later mean of its leaf.
    validation.check_dtype("residual_dtype", residual_dtype, ("float32", "bfloat16"), factory=factory)
    if num_replicas is not None:
        validation.check_positive_int("num_replicas", num_replicas, factory=factory)


def compressed_mean(
    compressor: Compressor,
    axis_name: Any = "data",
    *,
    inner_axis_name: Any = None,
    error_feedback: Union[bool, str] = True,
    reducer: str = "auto",
    min_compress_size: int = 1024,
    compress_vectors: bool = False,
    residual_dtype: Any = jnp.float32,
    server_error_feedback: bool = True,
    check_finite: Union[bool, str] = True,
    num_replicas: Optional[int] = None,
    seed: int = 0,
    bucket_bytes: Union[int, str, None] = "auto",
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

    Bytes per step and device: see [`commjax.communication_plan`][] (and
    ``commjax.collectives._reducers.Reducer`` for the formulas).

    Args:
      compressor: a commjax compressor (``cj.quantize(bits=4)``, ``cj.sign()``, ...).
      axis_name: mesh axis (or tuple of axes) to average over, bound by ``shard_map`` or
        ``pmap``. ``None``: no collective; the compressor still encodes and decodes.
      inner_axis_name: hierarchical exchange on a 2-D mesh: first the exact fp32 mean over
        this fast axis (NVLink/ICI), then compression only over ``axis_name`` (DCN).
        Error-feedback state is per ``axis_name`` replica and identical across the inner
        axis; lay it out with ``cj.state_specs(state, axis_name)``.
      error_feedback: keep the worker residual ``e`` (default True); ``"ef21"``: EF21,
        each worker keeps a gradient estimate ``g_i`` and sends ``C(grad - g_i)``, the
        transform returns the mean estimate ([`commjax.ef21`][]; state
        [`commjax.ef21.EF21State`][], same bytes).
      reducer: ``"auto"`` (cheapest valid), ``"allreduce"`` (linear payloads only),
        ``"allgather"`` or ``"two_phase"``.
      min_compress_size: floating leaves with fewer elements go to the exact bucket (so
        do floating scalars, whatever this is).
      compress_vectors: also compress 1-D leaves of at least ``min_compress_size``.
      residual_dtype: ``jnp.float32`` (default) or ``jnp.bfloat16`` to halve its memory.
      server_error_feedback: the two-phase reducer's second residual (default True).
      check_finite: a non-finite gradient on any replica makes that leaf's mean NaN on
        every replica, and the residuals keep their previous value on that step. Read
        from what every replica receives where it tells (block codecs' scale words,
        PowerSGD's factors: no extra cost); otherwise one NaN/Inf flag per compressed leaf
        rides in the exact bucket (one reduction per leaf). ``"reset"``: the same flags
        and NaN means, but a flagged leaf's worker residuals, and on such a step the
        whole server residual, restart from zero instead, so that the pass writing the
        new residuals need not read the old ones again (one read of the residuals less
        per step: v5e, 21M-parameter MLP, int8 916 -> 821 MB of HBM traffic, PowerSGD r4
        506 -> 420 MB; ``docs/accelerators.md``). The error those residuals carried is
        lost on that step; the bytes sent are the same. With a NaN every 20 steps
        that cost nothing measurable for 8-bit codes but +21.9% of final loss for sign,
        whose residual carries much of what it sends (+2.0% kept:
        ``benchmarks/results/convergence_nonfinite.json``). Not with
        ``error_feedback="ef21"``, whose residual is a gradient estimate. ``False`` skips both: a
        non-finite value then goes through the
        codec as it is, so what the mean becomes depends on the codec (NaN in its block
        for the scaled codecs), still identically on every replica, and it stays in the
        sending replica's residual.
      num_replicas: replicas the state is sized for when ``init`` runs outside
        ``shard_map`` (default: the axis size if bound, else ``jax.device_count()``).
        Only the two-phase server residual depends on it.
      seed: seed of the replicated PRNG key (stochastic rounding, random masks).
      bucket_bytes: exchange the leaves in buckets of at most this many bytes of fp32
        values, in tree order, one bucket after the other ([`commjax.bucketing`][]); a
        leaf larger than that is cut along its first axis into pieces that fit (except
        for PowerSGD, which factors whole matrices). The step's scratch memory is then
        one bucket's instead of the whole tree's, and on a TPU buckets of a few MB keep
        the codec's intermediates on chip: v5e, GPT-2-small in 4 MB buckets, int8 moves
        1.44x the HBM traffic of the exact step (``lax.pmean``) instead of 4.61x in one
        bucket, with 0.21 gradients of extra scratch instead of 2.58
        (``docs/accelerators.md``). Each bucket sends its own exact all-reduce and
        payload (one more set of collectives per bucket) and draws its randomness from
        ``seed + k``. ``None``: one bucket. ``"auto"`` (default): on a TPU backend
        buckets of [`commjax.bucketing.auto_bucket_bytes`][] (4 MiB, more for trees
        over 2 GB), elsewhere one bucket; the backend is ``jax.default_backend()`` when
        ``init``, ``update`` or the plan runs, so the state's structure differs between
        a TPU and other backends: pass an explicit value to move a state (a checkpoint)
        from one to the other.

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      [`CompressedMeanState`][commjax.transform.CompressedMeanState] (in buckets:
      a [`commjax.bucketing.BucketedState`][] of one per bucket).
      Per-replica parts: ``residual``, ``server_residual``; replicated: ``count``, ``key``.
      Lay it out for ``shard_map`` with [`commjax.shard_state`][] and
      [`commjax.state_specs`][].

    Raises:
      ValueError: bad options (named in the message), at construction.
      AxisNotBoundError: at update, if ``axis_name`` is not bound.
    """
    _check_options(compressor, reducer=reducer, axis_name=axis_name,
                   inner_axis_name=inner_axis_name, error_feedback=error_feedback,
                   compress_vectors=compress_vectors, server_error_feedback=server_error_feedback,
                   check_finite=check_finite, seed=seed, min_compress_size=min_compress_size,
                   residual_dtype=residual_dtype, num_replicas=num_replicas)
    options = dict(inner_axis_name=inner_axis_name, error_feedback=error_feedback, reducer=reducer,
                   min_compress_size=min_compress_size, compress_vectors=compress_vectors,
                   residual_dtype=residual_dtype, server_error_feedback=server_error_feedback,
                   check_finite=check_finite, num_replicas=num_replicas)
    if bucket_bytes == "auto":
        return _auto_buckets(compressor, axis_name, seed, options)
    if bucket_bytes is not None:
        validation.check_int("bucket_bytes", bucket_bytes, 1, factory="compressed_mean",
                             why=' (bytes a bucket), None (one bucket) or "auto"')
        return _in_buckets(compressor, axis_name, seed, options, int(bucket_bytes))
    return _one_bucket(compressor, axis_name, seed=seed, in_buckets=False, **options)


def _in_buckets(compressor: Compressor, axis_name: Any, seed: int, options: dict,
                bucket_bytes: int) -> optax.GradientTransformation:
    """``compressed_mean`` in buckets of ``bucket_bytes`` (``commjax.bucketing``)."""
    return bucketed(lambda k: _one_bucket(compressor, axis_name, seed=int(seed) + k, in_buckets=True, **options),
                    bucket_bytes, f"compressed_mean({compressor.name}) in buckets of {bucket_bytes} bytes",
                    split=not compressor.has_exchange, means_around=compressor.has_exchange,
                    pieces_apart=compressor.tpu_pieces_apart_in_buckets and options["check_finite"] is True)


def _auto_buckets(compressor: Compressor, axis_name: Any, seed: int,
                  options: dict) -> optax.GradientTransformation:
    """``compressed_mean(bucket_bytes="auto")``: in buckets of ``auto_bucket_bytes(tree)``
    or in one, chosen from the tree and the backend where ``init``, ``update`` and the
    plan run (not at construction: reading the backend initializes it, which must wait
    for ``jax.distributed.initialize``)."""

    def chosen(tree: Any) -> optax.GradientTransformation:
        size = auto_bucket_bytes(tree)
        if size is None:
            return _one_bucket(compressor, axis_name, seed=seed, in_buckets=False, **options)
        return _in_buckets(compressor, axis_name, seed, options, size)

    def init_fn(params):
        return chosen(params).init(params)

    def update_fn(updates, state, params=None):
        return chosen(updates).update(updates, state, params)

    def plan(params, num_replicas: int, **kw):
        return planner_of(chosen(params))(params, num_replicas, **kw)

    return with_plan(optax.GradientTransformation(init_fn, update_fn), plan)


def _one_bucket(compressor: Compressor, axis_name: Any, *, inner_axis_name, error_feedback, reducer,
                min_compress_size, compress_vectors, residual_dtype, server_error_feedback, check_finite,
                num_replicas, seed, in_buckets: bool) -> optax.GradientTransformation:
    """``compressed_mean`` of one bucket (the options checked by its caller). ``in_buckets``:
    one of several buckets of a step (``bucket_bytes``), which decides how a TPU computes the
    residual-norm metric (``ExchangeConfig.tpu_norm_sums``)."""
    cfg = ExchangeConfig(
        compressor=compressor, axis_name=validation.normalize_axis(axis_name),
        inner_axis_name=validation.normalize_axis(inner_axis_name),
        error_feedback=bool(error_feedback), reducer=reducer, min_compress_size=min_compress_size,
        compress_vectors=bool(compress_vectors), residual_dtype=jnp.dtype(residual_dtype),
        server_error_feedback=bool(server_error_feedback), check_finite=bool(check_finite),
        num_replicas=num_replicas, seed=int(seed), in_buckets=bool(in_buckets),
        on_nonfinite="reset" if isinstance(check_finite, str) else "keep",
    )

    def init_fn(params):
        return _init(cfg, params)

    def update_fn(updates, state, params=None):
        del params
        return _update(cfg, updates, state)

    if isinstance(error_feedback, str):  # "ef21", around the classic step
        init_fn, update_fn = ef21.wrap(cfg, init_fn, update_fn)
    return with_plan(optax.GradientTransformation(init_fn, update_fn), functools.partial(_plan, cfg))


def _plan(cfg: ExchangeConfig, params, num_replicas: int, inner_replicas: int = 1):
    """This transform's [`commjax.communication_plan`][] (``inner_replicas``: the size of
    ``inner_axis_name``)."""
    if cfg.inner_axis_name is None and inner_replicas != 1:
        raise ValueError("communication_plan: `inner_replicas` needs a compressed_mean with "
                         "`inner_axis_name`.")
    return mean_plan(cfg.compressor, params, num_replicas, reducer=cfg.reducer,
                     min_compress_size=cfg.min_compress_size, compress_vectors=cfg.compress_vectors,
                     check_finite=cfg.check_finite, inner_replicas=inner_replicas)


def _exchange_state(cfg: ExchangeConfig, plan: MeanPlan, n_rep: int):
    """The compressor's exchange state at init (``()`` when a reducer carries it)."""
    exchange = exchange_for(cfg.compressor)
    if exchange is None or not plan.segments:
        return ()
    return exchange.init_state(cfg.compressor, plan.segments, n_rep,
                               jax.random.fold_in(jax.random.PRNGKey(cfg.seed), _INIT_SALT))


def _init(cfg: ExchangeConfig, params) -> CompressedMeanState:
    leaves = jax.tree_util.tree_leaves(params)
    n_rep = _num_replicas_now(cfg)
    plan = cfg.plan(leaves, n_rep)
    key = jax.random.PRNGKey(cfg.seed)
    comp_state = _exchange_state(cfg, plan, n_rep)
    names = ("residual_norm", "nonfinite") + tuple(cfg.compressor.metric_names)
    return CompressedMeanState(
        count=jnp.zeros((), jnp.int32),
        key=key,
        residual=tuple(jnp.zeros(shape, cfg.residual_dtype) for shape in _residual_shapes(cfg, plan)),
        server_residual=(jnp.zeros((plan.server_residual_size,), jnp.float32)
                         if plan.server_residual_size else ()),
        compressor_state=comp_state,
        metrics={name: jnp.zeros((1,), jnp.float32) for name in names},
        made_for=made_for(cfg.compressor.name, _options(cfg), params),
    )
