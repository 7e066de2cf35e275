"""1-bit Adam and 1-bit LAMB: warm up exactly, then exchange a 1-bit momentum.

Both optimizers run in two stages, switched by the replicated step counter ``t``
(``T = warmup_steps``):

**Warm-up** (``t < T``): the exact fp32 mean of the gradients (one all-reduce) feeds an
ordinary Adam (or LAMB) step::

    g = (1/N) sum_i g_i
    m <- b1 m + (1 - b1) g          v <- b2 v + (1 - b2) g^2

**Compression** (``t >= T``): the second moment ``v`` is frozen; every replica advances
the shared momentum with its *own* gradient and the momenta are averaged through the
two-phase reducer with the 1-bit [`commjax.sign`][] codec, with error feedback on both
sides (worker residual ``e_i``, server residual ``s_j`` of the chunk replica ``j`` owns)::

    m_i = b1 m + (1 - b1) g_i                        # local, no communication
    x_i = m_i + e_i;  e_i <- x_i - C(x_i)            # worker error feedback
    m   = two_phase_mean(C(x_1), ..., C(x_N))        # re-encoded with server feedback

``C`` is the scaled sign (one bit per element plus one fp32 scale per block of
``block_size`` elements; blocks never span two leaves). The result ``m`` is identical on
every replica; the update is ``-lr * m_hat / (sqrt(v_frozen_hat) + eps)`` (1-bit Adam)
or the trust-ratio-scaled LAMB update (1-bit LAMB, see
[`onebit_lamb`][commjax.optimizers.onebit.onebit_lamb]).

Numerical safety after the freeze
---------------------------------
An entry whose gradient was (almost) zero during warm-up, a dead unit for instance, has
``v_frozen ~ 0``, while the 1-bit momentum hands every entry of a block the block's
magnitude. Its update ``m / (sqrt(v) + eps)`` would then be about ``|m| / eps``, which
diverges. Two guards, both in the compression stage only (warm-up is exact Adam):

* ``var_floor``: the frozen second moment is floored relative to its leaf's mean,
  ``v_j <- max(v_j, var_floor * mean_leaf(v))``, so an entry's step is at most
  ``1/sqrt(var_floor)`` times what an entry of average variance would take;
* ``max_update_ratio``: the normalised step ``m_hat_j / (sqrt(v_j) + eps)`` is clipped to
  ``[-max_update_ratio, max_update_ratio]`` (exact Adam's ratio stays below about
  ``(1 - b1) / sqrt((1 - b2)(1 - b1^2 / b2))``, 7.3 at the defaults). This also covers a
  leaf whose gradient was zero throughout warm-up (its mean variance, hence its floor,
  is zero).

Bytes per step and device (``n`` floats compressed, ``N`` replicas, ring convention):
warm-up ``2 (N-1)/N * 4 n`` (the exact mean); compression
``2 (N-1)/N * n (1 + 32 / block_size) / 8`` plus a small fp32 all-reduce of the leaves
too small to compress (biases, norms); a non-finite block is told by the gathered scale
words, so no NaN flags travel (``commjax.plan.MeanPlan.finite_flags``). At the
default ``block_size=256`` that is 28.4x less than the exact mean for the compressed
leaves. With ``0 < warmup_steps`` both stages are compiled into one program behind a
``lax.cond``; only the branch of the current stage runs its collectives.

Non-finite values: a NaN/Inf gradient on any replica makes the exchanged mean non-finite
on every replica; that step's update is then NaN on every replica (every leaf) and the
whole state, step counter included, keeps its previous value.

References:
  Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale Training with
  Adam's Convergence Speed" (arXiv:2102.02888).
  Li et al., 2021, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
  with LAMB's Convergence Speed" (arXiv:2104.06069).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from commjax import guards, validation
from commjax.accounting import CommunicationPlan, Transfer, ring_bytes, with_plan
from commjax.collectives._exact import exact_mean
from commjax.compressors.sign import sign
from commjax.plan import communication_plan, exact_mean_transfers, float_baseline
from commjax.transform import CompressedMeanState, compressed_mean

__all__ = [
    "OneBitAdamState",
    "OneBitLambState",
    "onebit_adam",
    "onebit_lamb",
]


class OneBitAdamState(NamedTuple):
    """State of ``scale_by_onebit_adam`` (the first element of
    [`onebit_adam`][commjax.optimizers.onebit.onebit_adam]'s).

    Attributes:
      count: int32 scalar, replicated: steps taken (rejected non-finite steps excluded).
      mu: pytree like the parameters, float32, replicated: the momentum ``m``.
      nu: pytree like the parameters, float32, replicated: the second moment ``v``,
        frozen from step ``warmup_steps`` on.
      exchange: the [`commjax.CompressedMeanState`][] of the 1-bit momentum exchange
        (its worker and server residuals are per replica; [`commjax.state_specs`][]
        lays them out).
    """

    count: jax.Array
    mu: Any
    nu: Any
    exchange: CompressedMeanState


class OneBitLambState(NamedTuple):
    """State of ``scale_by_onebit_lamb`` (the first element of
    [`onebit_lamb`][commjax.optimizers.onebit.onebit_lamb]'s).

    Attributes:
      count, mu, nu, exchange: as in [`OneBitAdamState`][commjax.optimizers.onebit.OneBitAdamState].
      nu_fresh: pytree like the parameters, float32, replicated: the second moment of
        the gradients reconstructed from consecutive compressed momenta (compression
        stage; equal to ``nu`` at the end of warm-up).
      coeff: pytree of float32 scalars (one per leaf), replicated: running average of
        the clipped trust ratios during warm-up (not bias-corrected; frozen after).
      factor: pytree of float32 scalars (one per leaf), replicated: last scaling
        factor of the frozen trust ratio (1 until the compression stage).

    The trust ratio and the factor depend on the parameters, which a training loop may
    keep per replica; their per-leaf scalars are averaged over the replicas in one small
    all-reduce (one float per leaf), so they are replicated whichever way the parameters
    are kept (and unchanged when the parameters are identical on every replica).
    """

    count: jax.Array
    mu: Any
    nu: Any
    nu_fresh: Any
    coeff: Any
    factor: Any
    exchange: CompressedMeanState


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class _Config:
    factory: str
    b1: float
    b2: float
    eps: float
    weight_decay: float
    warmup_steps: int
    axis_name: Any
    block_size: int
    var_floor: float
    max_update_ratio: Optional[float]
    bias_correction: bool
    min_compress_size: int
    compress_vectors: bool
    num_replicas: Optional[int]


def _make_config(factory: str, *, learning_rate, b1, b2, eps, weight_decay, warmup_steps,
                 axis_name, block_size, var_floor, max_update_ratio, bias_correction,
                 min_compress_size, compress_vectors, num_replicas, min_warmup: int) -> _Config:
    v, f, inf = validation, factory, np.inf
    if not callable(learning_rate):
        v.check_float("learning_rate", learning_rate, 0.0, inf, factory=f, hi_open=True)
    why = "" if min_warmup == 0 else " (the frozen trust ratio is estimated during warm-up)"
    if max_update_ratio is not None:
        max_update_ratio = v.check_float("max_update_ratio", max_update_ratio, 0.0, inf, factory=f,
                                         lo_open=True, hi_open=True)
    return _Config(
        factory=factory,
        b1=v.check_float("b1", b1, 0.0, 1.0, factory=f, hi_open=True),
        b2=v.check_float("b2", b2, 0.0, 1.0, factory=f, hi_open=True),
        eps=v.check_float("eps", eps, 0.0, inf, factory=f, hi_open=True),
        weight_decay=v.check_float("weight_decay", weight_decay, 0.0, inf, factory=f, hi_open=True),
        warmup_steps=v.check_int("warmup_steps", warmup_steps, min_warmup, factory=f, why=why),
        axis_name=v.normalize_axis(axis_name),
        block_size=v.check_int("block_size", block_size, 1, factory=f),
        var_floor=v.check_float("var_floor", var_floor, 0.0, 1.0, factory=f),
        max_update_ratio=max_update_ratio, bias_correction=bool(bias_correction),
        min_compress_size=v.check_int("min_compress_size", min_compress_size, 1, factory=f),
        compress_vectors=bool(compress_vectors),
        num_replicas=None if num_replicas is None else v.check_int("num_replicas", num_replicas, 1, factory=f),
    )


def _exchange_tx(cfg: _Config) -> optax.GradientTransformation:
    """The compressed momentum exchange: 1-bit sign, two-phase reducer, both feedbacks."""
    return compressed_mean(
        sign(block_size=cfg.block_size), cfg.axis_name, error_feedback=True,
        reducer="two_phase", min_compress_size=cfg.min_compress_size,
        compress_vectors=cfg.compress_vectors, server_error_feedback=True, check_finite=True,
        num_replicas=cfg.num_replicas, bucket_bytes=None,
    )


def _plan(cfg: _Config, lamb: Optional[_LambConfig], params: Any, num_replicas: int) -> CommunicationPlan:
    """What [`onebit_adam`][commjax.optimizers.onebit.onebit_adam] (``lamb`` None) or
    [`onebit_lamb`][commjax.optimizers.onebit.onebit_lamb] sends per device (its
    [`commjax.communication_plan`][]): after warm-up, the 1-bit momentum exchange every
    step (and LAMB's per-leaf factors with weight decay); during warm-up, the exact mean of
    the gradients (and LAMB's per-leaf trust ratios), in the other branch of the step."""
    leaves = jax.tree_util.tree_leaves(params)
    f32 = [jax.ShapeDtypeStruct(jnp.shape(l), jnp.float32) for l in leaves]
    scalars = ring_bytes("all-reduce", 4 * len(leaves), num_replicas)
    transfers = list(communication_plan(_exchange_tx(cfg), f32, num_replicas).transfers)
    if lamb is not None and cfg.weight_decay and scalars:
        transfers.append(Transfer("LAMB factors", "all-reduce", scalars))
    if cfg.warmup_steps:
        transfers += exact_mean_transfers("warm-up gradients", leaves, num_replicas, every=0)
        if lamb is not None and scalars:
            transfers.append(Transfer("warm-up trust ratios", "all-reduce", scalars, 0))
    name = "onebit_adam" if lamb is None else "onebit_lamb"
    return CommunicationPlan(name, num_replicas, tuple(transfers), float_baseline(leaves, num_replicas))


# ----------------------------------------------------------------------------- pieces


def _f32_zeros(params):
    return jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)


def _exact_leaves(cfg: _Config, leaves: list, n_rep: int) -> list:
    """fp32 mean over the axis of every leaf, in one fused all-reduce."""
    # On one replica the all-reduce of one participant is the value, typed replicated.
    means, _ = exact_mean(leaves, cfg.axis_name, n_rep)
    return [m.reshape(jnp.shape(l)) for m, l in zip(means, leaves)]


def _exchange(cfg: _Config, local: list, treedef, exchange: CompressedMeanState):
    """The 1-bit mean of the per-replica momenta: ``(leaves, new exchange state)``."""
    mean, new = _exchange_tx(cfg).update(jax.tree_util.tree_unflatten(treedef, local), exchange)
    return jax.tree_util.tree_leaves(mean), new


def _bias(b: float, t: jax.Array, enabled: bool) -> jax.Array:
    """``1 - b**t`` (1 when disabled; 1 at t = 0 so that an all-zero moment stays 0)."""
    if not enabled:
        return jnp.ones((), jnp.float32)
    t = t.astype(jnp.float32)
    return jnp.where(t > 0, 1.0 - b ** t, 1.0)


def _floored(cfg: _Config, nu_hat: jax.Array) -> jax.Array:
    if cfg.var_floor == 0.0 or nu_hat.size == 0:
        return nu_hat
    return jnp.maximum(nu_hat, cfg.var_floor * jnp.mean(nu_hat))


def _ratio(cfg: _Config, mu_hat: jax.Array, nu_hat: jax.Array, *, guarded: bool) -> jax.Array:
    """``m_hat / (sqrt(v_hat) + eps)``, with the post-freeze guards when ``guarded``."""
    if guarded:
        nu_hat = _floored(cfg, nu_hat)
    r = mu_hat / (jnp.sqrt(nu_hat) + cfg.eps)
    if guarded and cfg.max_update_ratio is not None:
        r = jnp.clip(r, -cfg.max_update_ratio, cfg.max_update_ratio)
    return r


def _any_nonfinite(leaves: list) -> jax.Array:
    return jnp.logical_not(guards.tree_all_finite(leaves))


def _stage(cfg: _Config, count: jax.Array, warm_fn, comp_fn, operands):
    """Run ``warm_fn`` during warm-up and ``comp_fn`` after, only one of them per step.

    Only the exchange (and small per-leaf collectives) live in the branches: a
    conditional's operands and results are whole buffers, so the elementwise moment
    updates stay outside it, where they fuse."""
    if cfg.warmup_steps == 0:
        return comp_fn(operands)
    return lax.cond(count < cfg.warmup_steps, warm_fn, comp_fn, operands)


def _replica_mean(cfg: _Config, scalars: list, n_rep: int) -> list:
    """Mean over the replicas of a few scalars, in one all-reduce (replicated result)."""
    if not scalars:
        return scalars
    return [m.reshape(()) for m in exact_mean([s.reshape(1) for s in scalars],
                                               cfg.axis_name, n_rep)[0]]


def _output(bad, steps: list, grads: list, treedef):
    """The steps in the gradients' dtypes; NaN on every leaf of a rejected step."""
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.where(bad, jnp.nan, s).astype(g.dtype) for s, g in zip(steps, grads)])


def _schedule_chain(inner: optax.GradientTransformation, learning_rate, weight_decay=0.0):
    """``inner``, then decoupled weight decay (if any) and ``-learning_rate``: optax's pieces."""
    parts = [inner]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


# ----------------------------------------------------------------------------- 1-bit Adam


def _adam_steps(cfg: _Config, state: OneBitAdamState, mean: list, mu: list, nu: list):
    """Moments and the normalised step ``m_hat / (sqrt(v_hat) + eps)`` of either stage."""
    t1 = state.count + 1
    bc1 = _bias(cfg.b1, t1, cfg.bias_correction)
    if not cfg.warmup_steps:
        bc2 = _bias(cfg.b2, jnp.asarray(0), cfg.bias_correction)
        return list(mean), nu, [_ratio(cfg, m / bc1, v / bc2, guarded=True) for m, v in zip(mean, nu)]
    warm = state.count < cfg.warmup_steps
    new_mu = [jnp.where(warm, cfg.b1 * m + (1 - cfg.b1) * x, x) for m, x in zip(mu, mean)]
    new_nu = [jnp.where(warm, cfg.b2 * v + (1 - cfg.b2) * x * x, v) for v, x in zip(nu, mean)]
    bc2 = jnp.where(warm, _bias(cfg.b2, t1, cfg.bias_correction),
                    _bias(cfg.b2, jnp.asarray(cfg.warmup_steps), cfg.bias_correction))
    steps = [jnp.where(warm, _ratio(cfg, m / bc1, v / bc2, guarded=False),
                       _ratio(cfg, m / bc1, v / bc2, guarded=True)) for m, v in zip(new_mu, new_nu)]
    return new_mu, new_nu, steps


def _scale_by_onebit_adam(cfg: _Config) -> optax.GradientTransformation:
    def init_fn(params):
        validation.check_real_leaves(params, factory="onebit_adam")
        return OneBitAdamState(count=jnp.zeros((), jnp.int32), mu=_f32_zeros(params),
                               nu=_f32_zeros(params), exchange=_exchange_tx(cfg).init(params))

    def update_fn(updates, state, params=None):
        del params
        n_rep = guards.check_bound(cfg.axis_name, cfg.factory)
        grads, treedef = jax.tree_util.tree_flatten(updates)
        mu, nu = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)

        def warm(ops):
            grads, mu, ex = ops
            return _exact_leaves(cfg, grads, n_rep), ex  # the exchanged mean gradient

        def comp(ops):
            grads, mu, ex = ops
            local = [cfg.b1 * m + (1 - cfg.b1) * g.astype(jnp.float32) for m, g in zip(mu, grads)]
            return _exchange(cfg, local, treedef, ex)  # the exchanged momentum

        mean, ex = _stage(cfg, state.count, warm, comp, (grads, mu, state.exchange))
        new_mu, new_nu, steps = _adam_steps(cfg, state, mean, mu, nu)
        bad = _any_nonfinite(mean)
        un = lambda leaves: jax.tree_util.tree_unflatten(treedef, leaves)  # noqa: E731
        new_state = OneBitAdamState(count=state.count + 1, mu=un(new_mu), nu=un(new_nu), exchange=ex)
        return _output(bad, steps, grads, treedef), guards.keep_if(bad, state, new_state)

    return optax.GradientTransformation(init_fn, update_fn)


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    warmup_steps: int,
    axis_name: Any = "data",
    block_size: int = 256,
    var_floor: float = 1e-2,
    max_update_ratio: Optional[float] = 10.0,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    min_compress_size: int = 1024,
    compress_vectors: bool = False,
    num_replicas: Optional[int] = None,
) -> optax.GradientTransformation:
    """1-bit Adam: exact Adam for ``warmup_steps`` steps, then a frozen second moment and a
    1-bit compressed momentum exchange with worker and server error feedback.

    A complete optimizer: hand it the *per-replica* gradients inside ``shard_map``/``pmap``
    (no [`commjax.compressed_mean`][] before it); the returned updates are identical on
    every replica. Step ``t`` (0-based, ``T = warmup_steps``, ``lr = learning_rate(t)``)::

        t <  T:  g = mean_i g_i (fp32 all-reduce)
                 m <- b1 m + (1-b1) g;   v <- b2 v + (1-b2) g^2
                 u = -lr (m / (1-b1^(t+1))) / (sqrt(v / (1-b2^(t+1))) + eps)
        t >= T:  m <- two_phase_sign_mean_i(b1 m + (1-b1) g_i)   (error feedback)
                 v_hat = max(v / (1-b2^T), var_floor * mean_leaf(v / (1-b2^T)))
                 u = -lr clip((m / (1-b1^(t+1))) / (sqrt(v_hat) + eps), +-max_update_ratio)

    plus ``-lr * weight_decay * p`` if ``weight_decay > 0`` (decoupled, AdamW style). The
    warm-up stage is ``optax.adam`` on the exact mean, up to floating-point rounding.

    Bytes per step and device after warm-up: ``2 (N-1)/N * n (1 + 32/block_size) / 8`` for
    the ``n`` compressed momentum entries (28.4x below the exact mean at
    ``block_size=256``) plus an fp32 all-reduce of the small leaves; during warm-up the
    exact mean, ``2 (N-1)/N * 4 n``. See the module docstring for the safety guards.

    Args:
      learning_rate: a float or an optax schedule ``count -> lr``.
      b1, b2: decay rates of the first and second moments, in ``[0, 1)``.
      eps: added to ``sqrt(v_hat)``.
      warmup_steps: steps of exact Adam before the freeze, ``>= 0``. ``0`` compiles the
        compression stage only (the second moment is then zero and every step is
        ``max_update_ratio``-bounded: useful to measure bytes, not to train).
      axis_name: mesh axis to average over, bound by ``shard_map``/``pmap`` (or a tuple of
        axes); ``None`` for one replica (the codec still runs).
      block_size: elements per 1-bit block (one fp32 scale each).
      var_floor: floor of the frozen second moment relative to its leaf's mean, in
        ``[0, 1]`` (0 disables it).
      max_update_ratio: bound of ``|m_hat / (sqrt(v_hat) + eps)|`` after the freeze, or
        ``None``.
      weight_decay: decoupled weight decay (needs ``params`` in ``update``).
      bias_correction: Adam's bias corrections (default True, as ``optax.adam``).
      min_compress_size, compress_vectors: which leaves are compressed (see
        [`commjax.compressed_mean`][]); the others are averaged exactly.
      num_replicas: replicas the state is sized for when ``init`` runs outside
        ``shard_map`` (default: the axis size if bound, else ``jax.device_count()``).

    Returns:
      ``optax.chain`` of the 1-bit Adam scaling (state
      [`OneBitAdamState`][commjax.optimizers.onebit.OneBitAdamState]),
      ``optax.add_decayed_weights`` (if ``weight_decay``) and
      ``optax.scale_by_learning_rate``; lay the state out with [`commjax.shard_state`][]
      / [`commjax.state_specs`][] (residuals are per-replica, everything else
      replicated). A schedule's own step counter (optax's) advances on every call, a
      rejected non-finite step included.

    Raises:
      ValueError: a bad option, named in the message.
      AxisNotBoundError: ``update`` called where ``axis_name`` is not bound.
    """
    cfg = _make_config(
        "onebit_adam", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
        weight_decay=weight_decay, warmup_steps=warmup_steps, axis_name=axis_name,
        block_size=block_size, var_floor=var_floor, max_update_ratio=max_update_ratio,
        bias_correction=bias_correction, min_compress_size=min_compress_size,
        compress_vectors=compress_vectors, num_replicas=num_replicas, min_warmup=0,
    )
    return with_plan(_schedule_chain(_scale_by_onebit_adam(cfg), learning_rate, cfg.weight_decay),
                     functools.partial(_plan, cfg, None))


# ----------------------------------------------------------------------------- 1-bit LAMB


@dataclasses.dataclass(frozen=True)
class _LambConfig:
    base: _Config
    min_coeff: float
    max_coeff: float
    coeff_beta: float
    factor_min: float
    factor_max: float
    factor_threshold: float


class _LambStep:
    """One 1-bit LAMB step: the pieces both stages share (see
    [`onebit_lamb`][commjax.optimizers.onebit.onebit_lamb])."""

    def __init__(self, lc: _LambConfig, state: OneBitLambState, w: list):
        cfg = self.cfg = lc.base
        self.lc, self.state, self.w = lc, state, w
        t1 = state.count + 1
        self.bc1 = _bias(cfg.b1, t1, cfg.bias_correction)
        self.bc2_frozen = _bias(cfg.b2, jnp.asarray(cfg.warmup_steps), cfg.bias_correction)
        self.bc2_fresh = _bias(cfg.b2, t1, cfg.bias_correction)
        self.bc_c = 1.0 - lc.coeff_beta ** cfg.warmup_steps

    def trust(self, u, x):
        wn, un = jnp.linalg.norm(x), jnp.linalg.norm(u)
        return jnp.where((wn > 0) & (un > 0),
                         jnp.clip(wn / jnp.where(un > 0, un, 1.0), self.lc.min_coeff, self.lc.max_coeff), 1.0)

    def warm_update(self, m, v, g, x):
        """Moments and the LAMB direction of the warm-up stage."""
        cfg = self.cfg
        m = cfg.b1 * m + (1 - cfg.b1) * g
        v = cfg.b2 * v + (1 - cfg.b2) * g * g
        return m, v, _ratio(cfg, m / self.bc1, v / self.bc2_fresh, guarded=False) + cfg.weight_decay * x

    def fresh_update(self, m, mp, vf):
        """The second moment of the gradients rebuilt from consecutive momenta."""
        g_rec = (m - self.cfg.b1 * mp) / (1 - self.cfg.b1)
        return self.cfg.b2 * vf + (1 - self.cfg.b2) * g_rec * g_rec

    def raw_factor(self, m, mp, v, vf, x):
        """``f = max_j (sqrt(v_frozen_hat) + eps) / (sqrt(v_fresh_hat) + eps)``, blended
        toward 1 by the share of weight decay in the step."""
        cfg = self.cfg
        vf = self.fresh_update(m, mp, vf)
        denom = jnp.sqrt(v / self.bc2_frozen) + cfg.eps
        fac = jnp.max(denom / (jnp.sqrt(vf / self.bc2_fresh) + cfg.eps)) if v.size else jnp.ones(())
        if cfg.weight_decay:
            u_pre = _ratio(cfg, m / self.bc1, v / self.bc2_frozen, guarded=True)
            u = u_pre + cfg.weight_decay * x
            un_ = jnp.linalg.norm(u)
            rho = jnp.minimum(1.0, jnp.linalg.norm(u_pre) / jnp.where(un_ > 0, un_, 1.0))
            fac = rho * fac + (1.0 - rho)
        return fac

    def combine(self, leaf):
        """Per leaf: the new moments, coefficient, factor and the step of this stage."""
        m, v, vf, c, f_prev, g, x, r, fac = leaf
        cfg, lc = self.cfg, self.lc
        warm = self.state.count < cfg.warmup_steps
        m_w, v_w, u_w = self.warm_update(m, v, g, x)
        # Compression stage: `g` is the exchanged momentum; the second moment is frozen.
        vf_c = self.fresh_update(g, m, vf)
        u_c = _ratio(cfg, g / self.bc1, v / self.bc2_frozen, guarded=True) + cfg.weight_decay * x
        fac = jnp.clip(fac, lc.factor_min, lc.factor_max)
        fac = jnp.clip(fac, f_prev * (1 - lc.factor_threshold), f_prev * (1 + lc.factor_threshold))
        return (jnp.where(warm, m_w, g), jnp.where(warm, v_w, v), jnp.where(warm, v_w, vf_c),
                jnp.where(warm, lc.coeff_beta * c + (1 - lc.coeff_beta) * r, c),
                jnp.where(warm, f_prev, fac), jnp.where(warm, r * u_w, (c / self.bc_c) * fac * u_c))


def _lamb_update(lc: _LambConfig, updates, state: OneBitLambState, params):
    cfg = lc.base
    if params is None:
        raise ValueError("onebit_lamb: the trust ratio needs `params` in update(grads, state, params).")
    n_rep = guards.check_bound(cfg.axis_name, cfg.factory)
    grads, treedef = jax.tree_util.tree_flatten(updates)
    leaves = lambda t: treedef.flatten_up_to(t)  # noqa: E731
    w = [p.astype(jnp.float32) for p in leaves(params)]
    mu, nu, nu_fresh = leaves(state.mu), leaves(state.nu), leaves(state.nu_fresh)
    coeff, factor = leaves(state.coeff), leaves(state.factor)
    step = _LambStep(lc, state, w)

    def warm(ops):
        grads, mu, ex = ops
        g = _exact_leaves(cfg, grads, n_rep)  # the exchanged mean gradient
        us = [step.warm_update(m, v, x_g, x)[2] for m, v, x_g, x in zip(mu, nu, g, w)]
        ratios = _replica_mean(cfg, [step.trust(u, x) for u, x in zip(us, w)], n_rep)
        return g, ex, ratios, list(factor)

    def comp(ops):
        grads, mu_prev, ex = ops
        local = [cfg.b1 * m + (1 - cfg.b1) * g.astype(jnp.float32) for m, g in zip(mu_prev, grads)]
        mu_new, ex = _exchange(cfg, local, treedef, ex)
        raw = [step.raw_factor(m, mp, v, vf, x) for m, mp, v, vf, x in zip(mu_new, mu_prev, nu, nu_fresh, w)]
        if cfg.weight_decay:  # the factor then depends on the (possibly per-replica) parameters
            raw = _replica_mean(cfg, raw, n_rep)
        return mu_new, ex, [jnp.zeros((), jnp.float32) for _ in mu_new], raw

    mean, ex, ratios, raw = _stage(cfg, state.count, warm, comp, (grads, mu, state.exchange))
    cols = list(zip(*[step.combine(leaf) for leaf in
                      zip(mu, nu, nu_fresh, coeff, factor, mean, w, ratios, raw)]))
    un = lambda ls: jax.tree_util.tree_unflatten(treedef, list(ls))  # noqa: E731
    new_state = OneBitLambState(count=state.count + 1, mu=un(cols[0]), nu=un(cols[1]),
                                nu_fresh=un(cols[2]), coeff=un(cols[3]), factor=un(cols[4]),
                                exchange=ex)
    bad = _any_nonfinite(mean)
    return _output(bad, list(cols[5]), grads, treedef), guards.keep_if(bad, state, new_state)


def _scale_by_onebit_lamb(lc: _LambConfig) -> optax.GradientTransformation:
    def init_fn(params):
        validation.check_real_leaves(params, factory="onebit_lamb")
        return OneBitLambState(
            count=jnp.zeros((), jnp.int32), mu=_f32_zeros(params), nu=_f32_zeros(params),
            nu_fresh=_f32_zeros(params),
            coeff=jax.tree_util.tree_map(lambda p: jnp.zeros((), jnp.float32), params),
            factor=jax.tree_util.tree_map(lambda p: jnp.ones((), jnp.float32), params),
            exchange=_exchange_tx(lc.base).init(params),
        )

    def update_fn(updates, state, params=None):
        return _lamb_update(lc, updates, state, params)

    return optax.GradientTransformation(init_fn, update_fn)


def _lamb_config(cfg: _Config, *, min_coeff, max_coeff, coeff_beta, factor_min, factor_max,
                 factor_threshold) -> _LambConfig:
    v, f, inf = validation, "onebit_lamb", np.inf
    min_coeff = v.check_float("min_coeff", min_coeff, 0.0, inf, factory=f, hi_open=True)
    max_coeff = v.check_float("max_coeff", max_coeff, 0.0, inf, factory=f, hi_open=True)
    if max_coeff < min_coeff:
        raise ValueError(f"onebit_lamb: `max_coeff` ({max_coeff}) must be >= `min_coeff` ({min_coeff}).")
    factor_min = v.check_float("factor_min", factor_min, 0.0, inf, factory=f, lo_open=True, hi_open=True)
    factor_max = v.check_float("factor_max", factor_max, 0.0, inf, factory=f, lo_open=True, hi_open=True)
    if not factor_min <= 1.0 <= factor_max:
        raise ValueError(
            f"onebit_lamb: need `factor_min` <= 1 <= `factor_max` (the factor starts at 1); "
            f"got factor_min={factor_min}, factor_max={factor_max}.")
    return _LambConfig(
        cfg, min_coeff, max_coeff,
        v.check_float("coeff_beta", coeff_beta, 0.0, 1.0, factory=f, hi_open=True),
        factor_min, factor_max,
        v.check_float("factor_threshold", factor_threshold, 0.0, 1.0, factory=f, hi_open=True))


def onebit_lamb(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    warmup_steps: int,
    axis_name: Any = "data",
    block_size: int = 256,
    var_floor: float = 1e-2,
    max_update_ratio: Optional[float] = 10.0,
    min_coeff: float = 0.01,
    max_coeff: float = 10.0,
    coeff_beta: float = 0.9,
    factor_min: float = 0.5,
    factor_max: float = 4.0,
    factor_threshold: float = 0.1,
    bias_correction: bool = True,
    min_compress_size: int = 1024,
    compress_vectors: bool = False,
    num_replicas: Optional[int] = None,
) -> optax.GradientTransformation:
    """1-bit LAMB: exact LAMB during warm-up, then the 1-bit momentum exchange of
    [`onebit_adam`][commjax.optimizers.onebit.onebit_adam] with each layer's (leaf's) trust ratio
    frozen from warm-up.

    Per leaf ``w`` (``T = warmup_steps``, ``lr = learning_rate(t)``, ``m_hat``/``v_hat`` the
    bias-corrected moments, ``clip_c`` clipping to ``[min_coeff, max_coeff]``)::

        warm-up (t < T), exact mean g:
            u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
            r = clip_c(||w|| / ||u||)          (1 if either norm is 0)
            c <- coeff_beta c + (1 - coeff_beta) r
            update = -lr r u;                  v_fresh <- v

        compression (t >= T), m from the 1-bit exchange, m_prev the momentum before it:
            c_frozen = c_T / (1 - coeff_beta^T)          (bias-corrected running average)
            g~ = (m - b1 m_prev) / (1 - b1)               (gradient seen through the codec)
            v_fresh <- b2 v_fresh + (1 - b2) g~^2
            u_pre = guarded(m_hat / (sqrt(v_frozen_hat) + eps));  u = u_pre + wd * w
            f = max_j (sqrt(v_frozen_hat_j) + eps) / (sqrt(v_fresh_hat_j) + eps)
            if wd > 0:  rho = min(1, ||u_pre|| / ||u||);  f = rho f + (1 - rho)
            f = clip(f, factor_min, factor_max)
            f = clip(f, f_prev (1 - factor_threshold), f_prev (1 + factor_threshold))
            update = -lr c_frozen f u

    ``guarded`` is the same floor/clip as in [`onebit_adam`][commjax.optimizers.onebit.onebit_adam].
    The scaling factor ``f``
    lets the frozen ratio follow the change of the gradient variance since the freeze,
    by at most ``factor_threshold`` per step, within ``[factor_min, factor_max]``; ``v``
    itself stays frozen (it is the preconditioner, as in 1-bit Adam). ``v_frozen_hat`` in
    ``f`` is the un-floored one, so that entries with zero variance in both do not count.
    The reference implementation also rescales every layer's momentum to a common
    magnitude before compressing the whole model with one scale; here every block of
    ``block_size`` entries (never spanning two leaves) has its own scale, so no
    rescaling is needed.

    Bytes per step: as [`onebit_adam`][commjax.optimizers.onebit.onebit_adam], plus an all-reduce of
    one float per leaf (the
    trust ratios, averaged over replicas so that they are replicated even when the
    parameters are kept per replica) during warm-up, and after it if ``weight_decay > 0``.
    Differences from [`onebit_adam`][commjax.optimizers.onebit.onebit_adam]:
    ``warmup_steps >= 1`` (the trust ratio is estimated during warm-up), ``params`` are
    required in ``update``, and ``eps`` defaults to ``1e-6`` as in LAMB.

    Args:
      learning_rate: as in [`onebit_adam`][commjax.optimizers.onebit.onebit_adam], and so are
        ``b1``, ``b2``, ``eps``,
        ``warmup_steps``, ``axis_name``, ``block_size``, ``var_floor``,
        ``max_update_ratio``, ``bias_correction``, ``min_compress_size``,
        ``compress_vectors`` and ``num_replicas``.
      weight_decay: added to the adaptive step before the trust ratio (LAMB).
      min_coeff, max_coeff: clipping range of the trust ratio ``||w|| / ||u||``.
      coeff_beta: decay of the running average of the warm-up trust ratios, in
        ``[0, 1)``; ``1 / (1 - coeff_beta)`` should not exceed ``warmup_steps``.
      factor_min, factor_max: range of the scaling factor of the frozen ratio.
      factor_threshold: largest relative change of the factor from one step to the next.

    Returns:
      ``optax.chain`` of the 1-bit LAMB scaling (state
      [`OneBitLambState`][commjax.optimizers.onebit.OneBitLambState]; weight
      decay is inside it, before the trust ratio) and ``optax.scale_by_learning_rate``.
    """
    cfg = _make_config(
        "onebit_lamb", learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
        weight_decay=weight_decay, warmup_steps=warmup_steps, axis_name=axis_name,
        block_size=block_size, var_floor=var_floor, max_update_ratio=max_update_ratio,
        bias_correction=bias_correction, min_compress_size=min_compress_size,
        compress_vectors=compress_vectors, num_replicas=num_replicas, min_warmup=1,
    )
    lc = _lamb_config(cfg, min_coeff=min_coeff, max_coeff=max_coeff, coeff_beta=coeff_beta,
                      factor_min=factor_min, factor_max=factor_max,
                      factor_threshold=factor_threshold)
    return with_plan(_schedule_chain(_scale_by_onebit_lamb(lc), learning_rate), functools.partial(_plan, cfg, lc))
