"""Guards every communicating transform applies: the axis is bound, gradients are
unreduced, non-finite values are seen by every replica, and a bad step keeps the state.

One home for each, so that every transform and optimizer fails the same clear way.
"""

from __future__ import annotations

from typing import Any, Sequence

import sys

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat
from commjax.kernels._dispatch import pow2

__all__ = [
    "AxisNotBoundError",
    "unbound_message",
    "check_bound",
    "check_unreduced",
    "all_finite",
    "all_finite_elementwise",
    "tree_all_finite",
    "keep_if",
    "l2_norm",
    "l2_norm_near",
    "check_not_in_replica_conditional",
]


class AxisNotBoundError(NameError):
    """A commjax transform or collective was called where its mesh axis is not bound."""


def unbound_message(axis_name: Any, where: str = "compressed_mean") -> str:
    """The error text for an unbound axis: why, and the ``shard_map`` call that fixes it."""
    return (
        f"{where}: mesh axis {axis_name!r} is not bound here. Gradient compression "
        "needs each replica's own gradient, so the update must run inside jax.shard_map (or "
        "jax.pmap, or jax.vmap with axis_name=...) over that axis, e.g.\n\n"
        "    step = jax.jit(jax.shard_map(train_step, mesh=mesh,\n"
        f"        in_specs=(P(), cj.state_specs(opt_state, {axis_name!r}), P({axis_name!r})),\n"
        f"        out_specs=(P(), cj.state_specs(opt_state, {axis_name!r}))))\n\n"
        "or pass axis_name=None to study the compressor on one replica without communication."
    )


def check_bound(axis_name: Any, where: str) -> int:
    """The size of ``axis_name`` (1 for ``None``), or
    [`AxisNotBoundError`][commjax.guards.AxisNotBoundError]; refuses a
    per-replica conditional around the caller (``check_not_in_replica_conditional``)."""
    if axis_name is None:
        return 1
    if not _compat.axis_is_bound(axis_name):
        raise AxisNotBoundError(unbound_message(axis_name, where))
    check_not_in_replica_conditional(where)
    return _compat.axis_size(axis_name)


def check_unreduced(leaves: Sequence[Any], axis_name: Any, where: str) -> None:
    """Under ``check_vma=True``, refuse floating gradients that JAX has already summed over
    the axis (the gradient of a replicated parameter): compression would come too late."""
    tracked = _compat.varying_axes(lax.axis_index(axis_name))
    if not tracked:
        return  # check_vma=False or pmap: nothing is tracked
    names = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
    for leaf in leaves:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            continue
        vma = _compat.varying_axes(leaf)
        if vma is not None and not names <= set(vma):
            raise ValueError(
                f"{where}: a gradient leaf of shape {jnp.shape(leaf)} is replicated "
                f"(invariant) over {axis_name!r}: under shard_map(check_vma=True) JAX sums the "
                "gradient of replicated parameters over the axis itself, before any "
                "compression. Take the gradient with respect to "
                f"cj.vary(params, {axis_name!r}) instead, or run shard_map with "
                "check_vma=False."
            )


def all_finite(x: jax.Array) -> jax.Array:
    """``jnp.all(jnp.isfinite(x))`` from one sum that cannot overflow: ``x - x`` is ``+0``
    where ``x`` is finite and NaN where it is NaN or infinite, and a sum is NaN exactly
    when one of its terms is. One reduction, no select and no conditional: XLA reads ``x``
    once where it is, while a conditional (the elementwise test behind an overflowing
    sum, as this function once ran) takes ``x`` as a buffer, and a value that was fused
    away is then written out for it (DiLoCo's outer step wrote each leaf of its mean
    twice). Integer and boolean arrays are finite."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.ones((), bool)
    d = x - x
    if jnp.issubdtype(d.dtype, jnp.complexfloating):
        d = d.real + d.imag
    return jnp.logical_not(jnp.isnan(jnp.sum(d, dtype=jnp.float32)))


def all_finite_elementwise(x: jax.Array) -> jax.Array:
    """``jnp.all(jnp.isfinite(x))`` as written: XLA fuses the test into the computation of
    ``x`` and writes one byte per element for the reduction. For a value the step computes
    but never writes out otherwise (an inner optimizer's update, recomputed inside the
    fusion that applies it), that costs less than ``all_finite``, whose reduction
    needs ``x`` itself in memory; for an array already in memory, ``all_finite``
    reads only ``x``."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.ones((), bool)
    return jnp.all(jnp.isfinite(x))


def tree_all_finite(tree: Any, test=all_finite) -> jax.Array:
    """Whether every leaf of ``tree`` (a pytree or a list of arrays) passes ``test``: one
    reduction per leaf (``all_finite`` for arrays in memory, ``all_finite_elementwise``
    for values fused into their consumers), their results and-ed; ``True`` for no leaves.
    A scalar ``bool``, local to this replica."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.ones((), bool)
    return jnp.all(jnp.stack([test(l) for l in leaves]))


def l2_norm(arrays: Sequence[jax.Array]) -> jax.Array:
    """``sqrt(sum_k ||a_k||^2)`` over real arrays, in fp32, finite whenever the norm is.

    One scaled reduction (as BLAS ``nrm2`` does), never a sum of raw squares, which
    overflows past ``1.8e19``: each element is a pair ``(|a|, 1)`` and two pairs combine
    into ``(m, q_1 (m_1 / m)**2 + q_2 (m_2 / m)**2)`` with ``m = max(m_1, m_2)``; the
    norm is ``m sqrt(q)``. One read of each array, fused where it is computed: a
    conditional recomputation (on overflow) took the arrays as operands and kept XLA from
    fusing the reduction (on an H100, 185 MB more traffic per step of a 21M-parameter
    model: ``benchmarks/aot.py``).
    """
    arrays = [jnp.ravel(a).astype(jnp.float32) for a in arrays]
    if not arrays:
        return jnp.zeros((), jnp.float32)
    m, q = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    for a in arrays:
        big = jnp.abs(a)
        ones = jnp.where(big > 0, jnp.float32(1.0), jnp.float32(0.0))
        am, aq = lax.reduce((big, ones), (jnp.float32(0.0), jnp.float32(0.0)), _scaled_pair, (0,))
        m, q = _scaled_pair((m, q), (am, aq))
    return m * jnp.sqrt(q)


#: Below ``n * 2**-103`` a scaled sum of squares may have lost more than ``2**-23`` of itself
#: to squares flushed to zero (each below ``2**-126``): ``l2_norm_near`` recomputes then.
_FLUSH_MARGIN = 2.0 ** -103


def l2_norm_near(arrays: Sequence[jax.Array], hint: jax.Array, *, tpu_sums: bool = False) -> jax.Array:
    """``l2_norm(arrays)`` for arrays whose norm is likely near ``hint`` (last step's).

    One plain sum of squares of ``a * 2**-k``, ``k = round(log2 hint)``, which XLA fuses
    into the computation that writes the arrays (a GPU fuses one plain reduction with
    its producer, not ``l2_norm``'s pair of them: one read of every array less per step).
    Where that sum overflowed, is NaN, or is so small that squares flushed to zero may
    matter (below ``n * 2**-103`` for ``n`` elements), ``l2_norm`` recomputes it under a
    conditional: the same result to rounding, finite whenever the norm is. ``hint`` may
    be anything (0, inf, NaN: no scaling).

    On TPU no conditional: its operands cost more scratch there (+111 MB, 1.3 gradients,
    for a 21M-parameter MLP's int8 step on a v5e) than the read it saves (94 MB of
    traffic). ``l2_norm`` itself, or with ``tpu_sums`` ``_banded_norm`` (three plain sums,
    no hint): which one XLA computes with the pass that writes the arrays depends on that
    pass. The sums for a whole step's residuals (v5e, the MLP's step: PowerSGD 639 -> 505
    MB, bf16 932 -> 723 MB) and for PowerSGD's in buckets (755 -> 621 MB); ``l2_norm`` for
    most block codecs' residuals in buckets, whose reduction XLA takes while they are on
    chip (bf16 in 4 MB buckets: 488 MB, 591 MB with the sums, which read them again).
    ``compressed_mean`` chooses (``Compressor.tpu_norm_sums_in_buckets``)."""
    arrays = [jnp.ravel(a).astype(jnp.float32) for a in arrays]
    if sum(a.shape[0] for a in arrays) == 0:
        return jnp.zeros((), jnp.float32)
    hint = jnp.asarray(hint, jnp.float32).reshape(())
    on_tpu = _banded_norm if tpu_sums else l2_norm
    return _compat.platform_dependent(hint, *arrays, tpu=lambda h, *xs: on_tpu(xs), default=_scaled_sum_norm)


#: ``_banded_norm``'s scales (powers of two) and the least sum a band is trusted with.
_BANDS = (-80, 0, 80)
_BAND_FLOOR = 2.0 ** -60


def _banded_norm(arrays: Sequence[jax.Array]) -> jax.Array:
    """``l2_norm`` from three plain sums of squares, ``S_b = sum (a * 2**b)**2`` for
    ``b = -80, 0, 80``: independent reductions of the same elements, which XLA computes in
    the fusion that writes the arrays (one read, no conditional). The first band in that
    order whose sum is at least ``2**-60`` gives ``sqrt(S_b) * 2**-b``:

    * ``S_-80 >= 2**-60`` (norm ``>= 2**50``): its squares are at most ``2**96`` (float32's
      largest is below ``2**128``), so it is finite unless the norm exceeds float32's
      range; those it flushed to zero (``a**2 < 2**34``) are under ``2**-35`` of it;
    * else ``S_0 < 2**100`` is finite and, if at least ``2**-60``, loses under ``2**-35``
      of itself to squares below ``2**-126``;
    * else ``S_80 = 2**160 S_0 < 2**100``, which loses only the squares of subnormal
      elements (``|a| < 2**-143``; a TPU flushes every subnormal to zero).

    So it agrees with ``l2_norm`` to rounding over the whole float32 range; a NaN makes it
    NaN, an infinite element inf. Each scaled magnitude is capped at ``2**60``, which no
    element of a band that is used reaches (its squares are at most ``2**100``): without
    the cap XLA takes the constant factor out of the sum (``sum(a**2) * 2**(2 b)``), whose
    squares then overflow or flush to zero. Three sums cost three multiplies and adds per
    element more than one: nothing in a pass bound by memory."""
    cap = jnp.float32(2.0 ** 60)
    sums = [sum(jnp.sum(jnp.square(jnp.minimum(jnp.abs(a) * jnp.float32(2.0 ** b), cap))) for a in arrays)
            for b in _BANDS]
    # From the last band back to the first: the first trusted one is chosen last.
    out = jnp.sqrt(sums[-1]) * jnp.float32(2.0 ** -_BANDS[-1])
    for b, s in zip(_BANDS[-2::-1], sums[-2::-1]):
        out = jnp.where(s >= _BAND_FLOOR, jnp.sqrt(s) * jnp.float32(2.0 ** -b), out)
    return out


def _scaled_sum_norm(hint: jax.Array, *arrays: jax.Array) -> jax.Array:
    """``l2_norm_near`` off TPU: the scaled sum, ``l2_norm`` where it cannot be trusted."""
    n = sum(a.shape[0] for a in arrays)
    arrays = list(arrays)
    usable = jnp.isfinite(hint) & (hint > 0)
    k = jnp.where(usable, jnp.clip(jnp.round(jnp.log2(jnp.where(usable, hint, 1.0))), -100, 100), 0.0)
    k = k.astype(jnp.int32)
    total = sum(jnp.sum(jnp.square(a * pow2(-k))) for a in arrays)
    # Formed outside the conditional: a branch that reads `total` kept XLA from fusing it.
    fast = jnp.sqrt(total) * pow2(k)
    ok = jnp.isfinite(total) & (total >= n * _FLUSH_MARGIN)
    return lax.cond(ok, lambda xs: fast, l2_norm, arrays)


def _scaled_pair(x, y):
    (m1, q1), (m2, q2) = x, y
    m = jnp.maximum(m1, m2)
    safe = jnp.where(m > 0, m, jnp.float32(1.0))
    return m, q1 * jnp.square(m1 / safe) + q2 * jnp.square(m2 / safe)


def keep_if(bad: jax.Array, old: Any, new: Any) -> Any:
    """``old`` where ``bad`` (a scalar shared by every replica), else ``new``, leaf by leaf:
    a non-finite step leaves the state as it was, identically on every replica."""
    return jax.tree_util.tree_map(lambda o, n: jnp.where(bad, o, n), old, new)


#: Wrappers that run their inner transformation under ``lax.cond`` on a predicate computed
#: from each replica's own gradient: (function name, a part of its file's path).
_REPLICA_CONDITIONALS = (("do_update", "optax/transforms/_conditionality.py"),)


def check_not_in_replica_conditional(where: str) -> None:
    """Refuse to trace a communicating update inside a conditional whose predicate each
    replica decides for itself (``optax.apply_if_finite`` wrapped *around* the transform):
    replicas that disagree would wait for each other in different collectives, which
    deadlocks (``pmap``, ``check_vma=False``) or fails with JAX's obscure "cond branches"
    error (``check_vma=True``). Looked up at trace time on the Python call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        for name, path in _REPLICA_CONDITIONALS:
            if code.co_name == name and code.co_filename.replace("\\", "/").endswith(path):
                raise ValueError(
                    f"{where}: called inside optax.apply_if_finite, which decides per replica "
                    "(from each replica's own gradient) whether to run it: replicas that "
                    "disagree would wait in different collectives and hang. Put apply_if_finite "
                    "after the commjax transform, where every replica sees the same mean: "
                    "optax.chain(cj.compressed_mean(...), optax.apply_if_finite(opt, k)). A NaN "
                    "on any replica then makes that mean NaN on every replica, and all skip "
                    "the step together.")
        frame = frame.f_back
