"""PowerSGD's exchange: two fused all-reduces of low-rank factors per step.

The maths (orthogonalization, shared random starts, the products) and the bytes live with
the configuration in [`commjax.compressors.powersgd`][]; this module runs one step over a
mesh axis (see that module's docstring for the algorithm and every phase's bytes):
exact fp32 mean during the warm-up (``start_step``), then ``P = M_bar Q^`` and
``Q = M_bar^T P^`` (or one of them per step with ``alternating``), all ``P`` of a step
in one variadic ``psum`` and all ``Q`` in a second one.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat, guards
from commjax.compressors.base import Segment
from commjax.compressors.powersgd import (
    PowerSGD,
    PowerSGDState,
    low_rank_product,
    product,
    reseed,
    seeded,
    shared_uniform,
    transposed_product,
)
from commjax.exchanges.base import Exchange

__all__ = ["PowerSGDExchange", "fused_mean", "product_finite"]


def _max_row_norm(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(v, e)`` with ``max_i ||a_i||_2 = v 2^e`` (``v`` in ``[0.5, sqrt(r)]``): the rows
    are first scaled by ``2^-e``, ``2^e`` just above the largest magnitude, in two steps of
    normal powers of two, so that neither the squares overflow nor the scale itself is a
    subnormal number (XLA's CPU code flushes those to zero)."""
    _, e = jnp.frexp(jnp.max(jnp.abs(a)))
    half = e // 2
    scaled = a * jnp.exp2(-half.astype(jnp.float32)) * jnp.exp2((half - e).astype(jnp.float32))
    return jnp.sqrt(jnp.max(jnp.sum(jnp.square(scaled), axis=1))), e


def product_finite(p: jax.Array, q: jax.Array) -> jax.Array:
    """Whether every entry of ``P Q^T`` is finite, read from the thin factors alone: reading
    the ``m x n`` product itself costs a pass over memory each step, and over a whole
    model that was the larger part of PowerSGD's compute on CPU.

    By Cauchy-Schwarz ``|(P Q^T)_ij| <= ||P_i|| ||Q_j|| <= max_i ||P_i|| max_j ||Q_j|| = B``.
    The product is accumulated in fp32 (``Precision.HIGHEST``), a relative rounding error
    far below ``2^-10``, so ``B (1 + 2^-10)`` below the fp32 maximum (about ``2^128``)
    proves every entry finite; ``B`` is formed as a mantissa and a power of two, so the
    test itself never overflows. A NaN or Inf in a factor fails it. It is conservative
    only at the edge of the range: with an orthonormal factor (rows of norm at most 1) it
    asks the other factor's row norms to stay below the fp32 maximum.
    """
    vp, ep = _max_row_norm(p)
    vq, eq = _max_row_norm(q)
    return jnp.log2(vp * vq * (1.0 + 2.0 ** -10)) + (ep + eq).astype(jnp.float32) < 128.0


def fused_mean(parts: Sequence[jax.Array], axis_name: Any, num_replicas: int) -> list[jax.Array]:
    """Mean over replicas of several arrays in ONE all-reduce (a variadic ``psum``)."""
    if axis_name is None:
        return list(parts)
    return [v / num_replicas for v in _compat.psum(list(parts), axis_name)]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _initial_state(c: PowerSGD, segments: tuple[Segment, ...], key: jax.Array) -> PowerSGDState:
    """Compiled once per configuration: eager, the hash and Gram-Schmidt ops would each
    compile on their own."""
    key = seeded(key, c.seed)
    qs, ps = [], []
    for gi, g in enumerate(c.groups(segments)):
        qs.append(shared_uniform(key, 2 * gi, (len(g.members), g.n, g.r)))
        if c.alternating:
            ps.append(jnp.zeros((len(g.members), g.m, g.r), jnp.float32))
    if c.alternating:
        qs = c.orth_all(qs)
    return PowerSGDState(q=tuple(qs), p=tuple(ps))


def _as_matrix(term, m: int, n: int):
    """A leaf (or a pair of leaves) as ``m x n`` matrices: reshapes, no copy."""
    if isinstance(term, tuple):
        return tuple(t.reshape(m, n) for t in term)
    return term.reshape(m, n)


def _right_product(m: jax.Array, q: jax.Array) -> jax.Array:
    return product(m, q, transposed=False)


def _times(m: Any, f: jax.Array, product) -> jax.Array:
    """``product(M, f)`` (``M F`` or ``M^T F``) for ``M = m``, or for ``M = g + e`` given
    as the pair ``m = (g, e)``: on GPU as ``product(g, f) + product(e, f)``, elsewhere of
    the sum. On GPU the sum was written out once for both products and read again by the
    residual's pass; as two products each reads ``g`` and ``e`` and nothing is written
    (H100 update step, PowerSGD r4 with the default ``check_finite``: 21M-parameter MLP
    849 -> 768 MB, GPT-2 small 5,962 -> 5,791 MB). TPUs keep the sum, which the v5e
    holds in on-chip memory where it fits (the MLP's), except for a leaf larger than
    ``_TPU_SUM_BYTES``: GPT-2's 154 MB embedding, written out as ``g + e`` and read by
    both products, cost ten passes over it a step, nine apart (v5e, GPT-2 small in 4 MB
    buckets: 3,279 -> 3,125 MB). The factors differ by fp32 rounding between the two
    forms, the same on every replica."""
    if not isinstance(m, tuple):
        return product(m, f)
    return _by_platform(*m, f, apart=lambda g, e, f: product(g, f) + product(e, f),
                        summed=lambda g, e, f: product(g + e, f))


#: Leaves above this many bytes take ``_times``'s products apart on TPU too.
_TPU_SUM_BYTES = 64 << 20


def _by_platform(g: jax.Array, e: jax.Array, f: jax.Array, *, apart, summed) -> jax.Array:
    """``apart(g, e, f)`` when lowered for an NVIDIA GPU, or for a TPU when the leaf is
    larger than ``_TPU_SUM_BYTES``; ``summed(g, e, f)`` elsewhere: the one switch between
    the two forms of ``_times`` (tests force either on CPU)."""
    big = g.size * 4 > _TPU_SUM_BYTES
    return _compat.platform_dependent(g, e, f, cuda=apart, tpu=apart if big else summed, default=summed)


def _members(p: jax.Array, q: jax.Array) -> tuple[list, list]:
    """A group's factors ``[G, k, r]`` as one array per member. On GPU each through an
    optimization barrier: slices of one array made XLA fuse the passes of all members
    (their residuals, updates and norm sums) into one, which then could not write the
    new residuals in place of the old (H100, GPT-2 small's PowerSGD step: 552 MB of
    copies of the new residuals)."""
    ps, qs = [p[j] for j in range(p.shape[0])], [q[j] for j in range(q.shape[0])]
    return _compat.platform_dependent(ps, qs, cuda=lambda a, b: lax.optimization_barrier((a, b)),
                                  default=lambda a, b: (a, b))


class _Step:
    """One step's matrices and collectives; each phase is one method."""

    def __init__(self, c: PowerSGD, parts, segments, state, axis_name, num_replicas, shared_key,
                 init_key=None, residuals=None):
        self.c, self.state, self.axis, self.n = c, state, axis_name, num_replicas
        self.segments = tuple(segments)
        self.groups = c.groups(self.segments)
        self.shared = seeded(shared_key, c.seed)
        self.init_key = init_key
        self.first = None  # alternating: True at the first P-step (see first_q)
        # Each in its leaf's shape, unpadded: x = g + e (or g without residuals).
        self.leaves = list(parts) if residuals is None else [g + e for g, e in zip(parts, residuals)]
        # mats[g][j]: member j of group g as its m x n matrix (a reshape, no copy), or the
        # pair (g, e) of matrices whose sum it is.
        terms = list(parts) if residuals is None else list(zip(parts, residuals))
        self.mats = [[_as_matrix(terms[i], g.m, g.n) for i in g.members] for g in self.groups]

    def mean(self, parts):
        return fused_mean(parts, self.axis, self.n)

    def right(self, ms, qs):  # [G, m, r] = M_j Q_j
        return jnp.stack([_times(m, qs[j], _right_product) for j, m in enumerate(ms)])

    def left(self, ms, ps):  # [G, n, r] = M_j^T P_j
        return jnp.stack([_times(m, ps[j], transposed_product) for j, m in enumerate(ms)])

    def finish(self, ps, qs, new_state, raw):
        """``M_hat = P Q^T`` per leaf, and per leaf whether it is finite, decided from the
        small factors alone (replicated, so every replica decides the same): the all-reduced
        factors (``raw``: per group, ``[G, k, r]`` arrays) must be finite, since an overflow
        would otherwise be orthogonalized away into a silent zero, and so must the bound
        of ``product_finite`` on the product."""
        mean, finite = [None] * len(self.segments), [None] * len(self.segments)
        for gi, (g, p, q) in enumerate(zip(self.groups, ps, qs)):
            pj, qj = _members(p, q)
            for j, i in enumerate(g.members):
                mean[i] = low_rank_product(pj[j], qj[j]).reshape(self.leaves[i].shape)
                finite[i] = jnp.all(jnp.stack([jnp.all(jnp.isfinite(f[gi][j])) for f in raw]
                                              + [product_finite(p[j], q[j])]))
        local = mean if self.axis is None else [_compat.vary(m, self.axis) for m in mean]
        return mean, local, new_state, finite

    def warmup(self, _):
        means = self.mean(self.leaves)
        return means, list(self.leaves), self.state, [guards.all_finite(m) for m in means]

    def both(self, _):
        c = self.c
        qs = []
        for gi, g in enumerate(self.groups):
            if c.warm_start:
                qs.append(reseed(self.state.q[gi], self.shared, 2 * gi, c.epsilon))
            else:
                qs.append(shared_uniform(self.shared, 2 * gi, (len(g.members), g.n, g.r)))
        qs = c.orth_all(qs)
        raw = self.mean([self.right(ms, q) for ms, q in zip(self.mats, qs)])
        ps = c.orth_all(raw)
        qs = self.mean([self.left(ms, p) for ms, p in zip(self.mats, ps)])
        new = PowerSGDState(q=tuple(qs), p=()) if c.warm_start else self.state
        return self.finish(ps, qs, new, (raw, qs))

    def first_q(self):
        """The ``Q`` of the first P-step redrawn from replica 0's initial key: the stored
        one came from each process's own seed, and the P-step decodes with ``Q`` as it is,
        without reducing it. Equal to the stored ``Q`` when the seeds agree."""
        return _initial_state(self.c, self.segments, self.init_key).q

    def p_step(self, _):
        # P = M_bar Q^ with the stored orthonormal Q^: M_hat = M_bar Q^ Q^^T.
        st, c = self.state, self.c
        q = st.q if self.first is None else lax.cond(self.first, self.first_q, lambda: st.q)
        ps = self.mean([self.right(ms, qi) for ms, qi in zip(self.mats, q)])
        new_p = tuple(c.orth_all([reseed(p, self.shared, 2 * gi + 1, c.epsilon) for gi, p in enumerate(ps)]))
        return self.finish(ps, q, PowerSGDState(q=q, p=new_p), (ps,))

    def q_step(self, _):
        # Q = M_bar^T P^ with the stored orthonormal P^: M_hat = P^ P^^T M_bar.
        st, c = self.state, self.c
        qs = self.mean([self.left(ms, p) for ms, p in zip(self.mats, st.p)])
        new_q = tuple(c.orth_all([reseed(q, self.shared, 2 * gi, c.epsilon) for gi, q in enumerate(qs)]))
        return self.finish(st.p, qs, PowerSGDState(q=new_q, p=st.p), (qs,))


class PowerSGDExchange(Exchange):
    """Runs [`commjax.compressors.PowerSGD`][] (see the module docstring)."""

    def init_state(self, codec, segments, num_replicas, key):
        """Initial ``Q`` per group: i.i.d. unit-variance entries from ``key``, identical on
        every replica (orthonormalized too, and ``P = 0``, with ``alternating``)."""
        if not codec.warm_start:
            return PowerSGDState(q=(), p=())
        return _initial_state(codec, tuple(segments), key)

    def run(self, codec, parts, segments, state, *, axis_name, num_replicas, shared_key,
            init_key, count, residuals=None):
        """Exact mean in the warm-up, then PowerSGD, leaf by leaf: each leaf's matrix is a
        view of its own part (``parts`` in the leaves' shapes, unpadded), and its ``M_hat``
        is returned as its own array in the part's shape. Returns
        ``(M_hat, M_hat, new_state, finite)`` in the PowerSGD phase (error feedback keeps
        ``x - M_hat``; ``finite`` per segment from the factors, see ``_Step.finish``)
        and ``(mean, x, state, finite)`` in the warm-up (no residual builds up; ``finite``
        read from the mean)."""
        step = _Step(codec, parts, segments, state, axis_name, num_replicas, shared_key, init_key, residuals)
        count = jnp.asarray(count, jnp.int32)
        start = codec.start_step
        if not codec.alternating:
            if start == 0:
                return step.both(None)
            return lax.cond(count < start, step.warmup, step.both, None)
        step.first = count == start
        phase = jnp.remainder(jnp.maximum(count - start, 0), 2)  # 0: P-step, 1: Q-step
        if start == 0:
            return lax.cond(phase == 0, step.p_step, step.q_step, None)
        index = jnp.where(count < start, 0, 1 + phase)
        return lax.switch(index, (step.warmup, step.p_step, step.q_step), None)

    def bytes(self, codec, segments, num_replicas):
        return codec.exchange_bytes(segments, num_replicas)
