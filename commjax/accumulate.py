"""Gradient accumulation whose exchange runs once per real step.

``optax.MultiSteps`` calls its inner transform on *every* micro-step and keeps the
result only on the last one (a select), so a compressed exchange inside it sends its
bytes ``k`` times per real step. [`accumulate`][commjax.accumulate.accumulate] keeps the same state
(``optax.MultiStepsState``, so checkpoints of either load into the other) and the same
running mean, but runs the inner transform under a ``lax.cond`` on the replicated
micro-step counter: its collectives execute only on the ``k``-th micro-step.

Replica ``i``, micro-step ``j = 0..k-1`` of a real step, gradient ``g_ij``::

    a_i <- a_i + (g_ij - a_i) / (j + 1)          # per-replica running mean (local, no bytes)
    j < k-1:  updates = 0                         # no collective runs
    j = k-1:  updates, s = tx.update(a_i, s)      # one exchange of mean_i a_i
              a_i <- 0

Bytes per real step = one exchange of ``tx`` (its plan's ``bytes_per_step``; for a ``tx``
that [`commjax.communication_plan`][] knows, the accumulated transform's plan spreads
it over the ``k`` micro-steps), against
``k`` exchanges for ``optax.MultiSteps``. The parameters are those of
``optax.MultiSteps`` with the same inner transform (same formula, same order) up to the
last bit: compiled inside a conditional, the inner optimizer's arithmetic may be fused
differently (a multiply-add contracted or not), measured at most 1 ulp after 4 steps.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from commjax import _compat, validation
from commjax.accounting import CommunicationPlan, planner_of, with_plan
from commjax.layout import with_leading_axis
from commjax.plan import float_baseline, repeated

__all__ = ["accumulate", "is_multisteps"]

EveryK = Union[int, Callable[[jax.Array], jax.Array]]


def is_multisteps(tx: Any) -> bool:
    """Whether ``tx`` is an ``optax.MultiSteps`` or its ``gradient_transformation()``."""
    return isinstance(_multisteps_of(tx), optax.MultiSteps)


def _multisteps_of(tx: Any) -> Any:
    if isinstance(tx, optax.MultiSteps):
        return tx
    return getattr(getattr(tx, "update", None), "__self__", None)


def _from_multisteps(ms: Any) -> tuple[Any, EveryK, bool, Any]:
    """``(inner, every_k, use_grad_mean, accumulator_dtype)`` of an ``optax.MultiSteps``.

    optax keeps them in private attributes; a MultiSteps with a custom
    ``should_skip_update_fn`` decides per replica whether to skip, which cannot be
    moved in front of a collective, and is refused.
    """
    try:
        inner, every_k = ms._opt, ms._every_k_schedule
        mean, dtype, skip = ms._use_grad_mean, ms._accumulator_dtype, ms._should_skip_update_fn
    except AttributeError as e:  # pragma: no cover - a future optax
        raise TypeError(
            "accumulate: this optax.MultiSteps keeps its settings elsewhere; build "
            "cj.accumulate(inner_tx, every_k) directly instead.") from e
    if "MultiSteps.__init__" not in getattr(skip, "__qualname__", "MultiSteps.__init__"):
        raise ValueError(
            "accumulate: optax.MultiSteps(should_skip_update_fn=...) decides on each replica "
            "whether to skip a micro-step, which would make replicas disagree on whether to "
            "communicate. Drop should_skip_update_fn (put optax.apply_if_finite after the "
            "commjax transform instead), or keep optax.MultiSteps as it is.")
    return inner, every_k, mean, dtype


def _check_every_k(every_k: Any) -> EveryK:
    if callable(every_k):
        return every_k
    k = validation.check_positive_int("every_k", every_k, factory="accumulate")
    return lambda step: k


def accumulate(tx: Any, every_k: Optional[EveryK] = None, *, use_grad_mean: bool = True,
               accumulator_dtype: Any = jnp.float32) -> optax.GradientTransformation:
    """Accumulate gradients over ``every_k`` micro-steps; run ``tx`` (and its exchange)
    only on the last one.

    ``tx`` is the inner transform (typically ``optax.chain(cj.compressed_mean(...),
    optax.adam(...))``), or an ``optax.MultiSteps`` (or its ``gradient_transformation()``)
    whose settings are taken over (then leave ``every_k`` out). ``every_k``: an integer,
    or a function of the real-step count (``gradient_step``) as in ``optax.MultiSteps``.

    The state is an ``optax.MultiStepsState``: ``acc_grads`` is per replica (each
    replica's own running mean; a scalar parameter's as ``[1]``), everything else replicated;
    [`commjax.init_sharded`][] finds that by tracing.

    Returns:
      An ``optax.GradientTransformation``. Updates are zero on the first ``k - 1``
      micro-steps and ``tx``'s update of the accumulated mean on the ``k``-th.
    """
    if is_multisteps(tx):
        if every_k is not None:
            raise ValueError("accumulate: `every_k` comes from the optax.MultiSteps given as "
                             "`tx`; leave it out.")
        tx, every_k, use_grad_mean, accumulator_dtype = _from_multisteps(_multisteps_of(tx))
    if every_k is None:
        raise ValueError("accumulate: `every_k` (micro-steps per real step) is required, e.g. "
                         "cj.accumulate(tx, every_k=4).")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"accumulate: `tx` must be an optax transform, got {tx!r}.")
    schedule = _check_every_k(every_k)
    inner = optax.with_extra_args_support(tx)
    dtype = jnp.dtype(accumulator_dtype)

    def init_fn(params):
        return optax.MultiStepsState(
            mini_step=jnp.zeros([], jnp.int32), gradient_step=jnp.zeros([], jnp.int32),
            inner_opt_state=inner.init(params),
            acc_grads=jax.tree_util.tree_map(lambda p: with_leading_axis(jnp.zeros(jnp.shape(p), dtype)), params),
            skip_state=())

    def update_fn(updates, state, params=None, **extra):
        return _update(inner, schedule, use_grad_mean, dtype, updates, state, params, extra)

    out = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    planner = planner_of(tx)
    if planner is not None and isinstance(every_k, int):
        # tx's transfers once per real step, every_k micro-steps apart.
        out = with_plan(out, lambda params, num_replicas, **kw: CommunicationPlan(
            f"accumulate({every_k})", num_replicas,
            tuple(repeated(planner(params, num_replicas, **kw).transfers, every_k, offset=every_k - 1)),
            float_baseline(params, num_replicas)))
    return out


def _update(inner, schedule, use_grad_mean, dtype, updates, state, params, extra):
    k = schedule(state.gradient_step)
    n = state.mini_step
    held = jax.tree_util.tree_map(lambda g, a: a.reshape(jnp.shape(g)), updates, state.acc_grads)
    if use_grad_mean:
        acc = jax.tree_util.tree_map(lambda g, a: a + (g - a) / (n + 1), updates, held)
    else:
        acc = jax.tree_util.tree_map(lambda g, a: g + a, updates, held)
    # The counters are replicated, so every replica takes the same branch: the inner
    # transform's collectives run on the k-th micro-step only, everywhere at once.
    emit = n == k - 1

    def fire(ops):
        acc_, inner_state = ops
        return inner.update(optax.tree.cast_like(acc_, updates), inner_state, params, **extra)

    shapes = jax.eval_shape(fire, (acc, state.inner_opt_state))[0]

    def hold(ops):  # zero updates, the inner state as it came in
        return jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes), ops[1]

    out, inner_state = _compat.typed_cond(emit, fire, hold, (acc, state.inner_opt_state))
    new_state = optax.MultiStepsState(
        mini_step=(n + 1) % k,
        gradient_step=state.gradient_step + emit.astype(state.gradient_step.dtype),
        inner_opt_state=inner_state,
        acc_grads=jax.tree_util.tree_map(lambda a: with_leading_axis(((1 - emit) * a).astype(dtype)), acc),
        skip_state=state.skip_state)
    return out, new_state

