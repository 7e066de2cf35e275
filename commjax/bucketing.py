"""Exchanging a gradient tree in buckets of leaves, one bucket after the other: the default
of [`commjax.compressed_mean`][] on a TPU backend (``bucket_bytes="auto"``,
[`auto_bucket_bytes`][commjax.bucketing.auto_bucket_bytes]).

[`commjax.compressed_mean`][] with ``bucket_bytes=B`` cuts the leaves, in tree order,
into buckets of at most ``B`` bytes of fp32 values and runs one compressed mean per
bucket, each with its own state, strictly one after the other: bucket ``k + 1`` starts
encoding only once bucket ``k``'s mean and residuals exist (an optimization barrier
between them)::

    for k, pieces_k in enumerate(buckets(grads, B)):
        mean_k, state_k = compressed_mean(codec, seed=seed + k).update(pieces_k, state_k)

A leaf larger than ``B`` is cut along its first axis into pieces of at most ``B`` bytes
(whole multiples of 8 rows, or of 1,024 elements for a vector, where that fits: a TPU
tile), each a leaf of its own in its bucket, and its mean is the pieces' means joined
again. Its residual is kept per piece. A block codec whose pieces hold whole blocks
(``rows * row_size`` a multiple of the block) encodes exactly what it would encode in
one bucket. Compressors with their own exchange (PowerSGD) factor whole matrices: their
leaves are never cut.

The bytes on the wire are each bucket's (its exact all-reduce, its payload's collectives:
one more set per bucket, the same payload bytes up to each bucket's padding). What
changes is memory: the encode, exchange and decode of a bucket finish before the next
one begins, so the scratch of the step is one bucket's, not the tree's, and on a TPU a
bucket of a few MB keeps its intermediates in on-chip memory (VMEM) instead of writing
them to HBM and reading them back (``python benchmarks/aot.py --bucket-mb 4``; numbers in
``docs/accelerators.md``).

Without the barrier the compiler schedules every bucket's encode before any exchange,
which keeps every bucket's intermediates alive at once; and the means must leave
through the barrier, not around it, or the compiler decodes them a second time where the
optimizer reads them. PowerSGD's are the exception: its mean ``P Q^T`` is a product of
two small factors that the optimizer's pass forms again where it reads it, so the means
leave around the barrier (the residuals, which need the whole exchange, order the
buckets); through it, each was written out and read back (v5e, 21M-parameter MLP in
4 MB buckets, PowerSGD r4: 621 MB a step through the barrier, 487 around it). A cut
leaf goes through the barriers whole and is sliced after them: a slice taken before one
would be copied out to be its operand. For some codecs that copy is the cheaper program
(``pieces_apart``, on TPU only): a codec that reads its input in several passes (sign:
the scales, then the bits, then the residual) read each piece as a slice of the whole
leaf, so the compiler prefetched the whole gradient leaf into VMEM, leaving no room to
join the leaf's mean there (v5e, 21M-parameter MLP in 4 MB buckets, the default
``check_finite``: sign 619 MB a step with the pieces sliced in place, 489 MB with each
piece taken apart by a barrier; int8, int4, bf16 and fp8 447, 447, 446, 445 MB in place
against 459, 459, 463, 458 apart; sign with ``check_finite="reset"`` 464 against 481).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from commjax import _compat
from commjax.accounting import CommunicationPlan, planner_of, with_plan
from commjax.plan import float_baseline

__all__ = ["AUTO_MAX_BUCKETS", "AUTO_MIN_BUCKET_BYTES", "BucketedState", "Piece", "auto_bucket_bytes",
           "bucket_groups", "bucketed", "leaf_pieces"]

#: The smallest bucket, and the most buckets, of ``compressed_mean(bucket_bytes="auto")``
#: on a TPU (``auto_bucket_bytes``).
AUTO_MIN_BUCKET_BYTES = 4 << 20
AUTO_MAX_BUCKETS = 512


class BucketedState(NamedTuple):
    """State of a transform run in buckets ([`bucketed`][commjax.bucketing.bucketed]).

    Attributes:
      buckets: one state per bucket, in tree order (each the state of the transform the
        factory makes, e.g. a [`commjax.CompressedMeanState`][]).
    """

    buckets: tuple


class Piece(NamedTuple):
    """Rows ``start:stop`` of leaf ``leaf`` (first axis); ``rows=None``: the whole leaf."""

    leaf: int
    rows: Optional[tuple] = None


def auto_bucket_bytes(params: Any, platform: Optional[str] = None) -> Optional[int]:
    """The bucket size of ``compressed_mean(bucket_bytes="auto")`` (its default) for the
    leaves of ``params`` (arrays or ``ShapeDtypeStruct``s) on ``platform`` (default
    ``jax.default_backend()``, read when called): ``None`` (one bucket) off TPU; on a TPU
    the smallest power of two of at least ``AUTO_MIN_BUCKET_BYTES`` (4 MiB) that holds
    the tree's fp32 bytes in ``AUTO_MAX_BUCKETS`` (512) buckets::

        B = 2^ceil(log2(max(4 MiB, 4 * size(params) / 512)))

    Why, measured on the compiled v5e program (``docs/accelerators.md``): in one bucket
    the codecs' intermediates go through HBM, in buckets of a few MB they stay on chip
    (GPT-2 small, int8: 4.61x the ``lax.pmean`` step's HBM traffic in one bucket, 1.84x
    in 16 MB buckets, 1.44x in 4 MB ones), and the step's scratch is one bucket's (a
    1.3B-parameter tree's int8 step needs 21.9 GB of scratch in one bucket, more than a
    v5e's 16 GB, and fits in 16 MB buckets). The bucket count is bounded because every
    bucket adds its own collectives and compiled code (GPT-2 small: 125 buckets; the
    1.3B tree: 16 MiB, about 320). On an H100 one bucket moves less (GPT-2 small, int8:
    1.40x against 1.64x in 4 MB buckets), and on CPU it is what the benchmarks measured."""
    platform = _default_platform() if platform is None else platform
    if platform != "tpu":
        return None
    total = sum(4 * int(np.prod(np.shape(leaf))) for leaf in jax.tree_util.tree_leaves(params))
    size = AUTO_MIN_BUCKET_BYTES
    while size * AUTO_MAX_BUCKETS < total:
        size *= 2
    return size


def _default_platform() -> str:
    """The platform ``auto_bucket_bytes`` decides for when given none (tests replace it)."""
    return jax.default_backend()


def _row_ranges(shape: tuple, bucket_bytes: int) -> Optional[list]:
    """Row ranges cutting a leaf of ``shape`` into pieces of at most ``bucket_bytes`` fp32
    bytes, or None when it fits whole. A piece is a multiple of 8 rows (of 1024 elements
    for a vector) where that fits, so it starts on a TPU tile; a single row larger than
    the bucket is a piece of its own."""
    if not shape or 4 * int(np.prod(shape)) <= bucket_bytes:
        return None
    row = int(np.prod(shape[1:]))
    fit, align = bucket_bytes // (4 * row), (8 if len(shape) > 1 else 1024)
    r = fit // align * align if fit >= align else max(1, fit)
    return [(a, min(a + r, shape[0])) for a in range(0, shape[0], r)]


def leaf_pieces(leaves: list, bucket_bytes: int, split: bool) -> list:
    """The pieces of ``leaves`` in order: whole leaves, or with ``split`` every floating
    leaf larger than ``bucket_bytes`` cut into row ranges (``_row_ranges``)."""
    out = []
    for i, leaf in enumerate(leaves):
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
        floating = jnp.issubdtype(dtype, jnp.floating)
        ranges = _row_ranges(tuple(np.shape(leaf)), bucket_bytes) if split and floating else None
        out += [Piece(i)] if ranges is None else [Piece(i, r) for r in ranges]
    return out


def _piece_bytes(leaves: list, p: Piece) -> int:
    shape = tuple(np.shape(leaves[p.leaf]))
    if p.rows is None:
        return 4 * int(np.prod(shape))
    return 4 * int(np.prod(shape[1:])) * (p.rows[1] - p.rows[0])


def bucket_groups(leaves: list, bucket_bytes: int, *, split: bool = False) -> tuple:
    """The pieces ([`Piece`][commjax.bucketing.Piece]) of each bucket: pieces in order
    (``leaf_pieces``), a bucket closed when the next piece would take it past
    ``bucket_bytes`` bytes of fp32 values (``4 * size``, whatever the dtype); a piece
    larger than that is a bucket of its own."""
    groups, current, size = [], [], 0
    for p in leaf_pieces(leaves, bucket_bytes, split):
        b = _piece_bytes(leaves, p)
        if current and size + b > bucket_bytes:
            groups.append(tuple(current))
            current, size = [], 0
        current.append(p)
        size += b
    if current:
        groups.append(tuple(current))
    return tuple(groups)


def _cut(leaf: Any, p: Piece) -> Any:
    """The piece ``p`` of ``leaf`` (an array, a tracer or a ShapeDtypeStruct)."""
    if p.rows is None:
        return leaf
    a, b = p.rows
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((b - a,) + tuple(leaf.shape[1:]), leaf.dtype)
    return leaf[a:b]


def _joined(leaves: list, means: dict) -> list:
    """Each leaf's mean from its pieces' means (joined along the first axis)."""
    parts = [[] for _ in leaves]
    for p, m in sorted(means.items(), key=lambda pm: (pm[0].leaf, pm[0].rows or (0, 0))):
        parts[p.leaf].append(m)
    return [ms[0] if len(ms) == 1 else jnp.concatenate(ms, 0) for ms in parts]


def _apart(pieces: list, group: tuple) -> list:
    """The pieces cut from a larger leaf each taken out of it (an optimization barrier
    over them) when lowered for a TPU; elsewhere unchanged (module docstring)."""
    cut = [i for i, p in enumerate(group) if p.rows is not None]
    if not cut:
        return pieces
    taken = _compat.platform_dependent([pieces[i] for i in cut], tpu=_compat.barrier, default=lambda v: v)
    out = list(pieces)
    for i, v in zip(cut, taken):
        out[i] = v
    return out


def _chained(previous: tuple, leaves: list) -> tuple:
    """``leaves`` made to wait for ``previous`` (the last bucket's means and residuals),
    both returned unchanged, each with its own varying/invariant type."""
    return _compat.barrier((previous, leaves))


def _carried(state: Any) -> Any:
    """What of a bucket's new state the next bucket waits for: its residuals, when the
    state has them (their select and write then finish before the next encode)."""
    return getattr(state, "residual", ())


def _with_carried(state: Any, carried: Any) -> Any:
    """``state`` with what ``_carried`` took from it put back (after the barrier)."""
    return state._replace(residual=carried) if hasattr(state, "residual") else state


def bucketed(make: Callable[[int], optax.GradientTransformation], bucket_bytes: int,
             name: str, *, split: bool = False, means_around: bool = False,
             pieces_apart: bool = False) -> optax.GradientTransformation:
    """``make(k)`` (the transform of bucket ``k``) run on buckets of the leaves, one after
    the other (module docstring). ``split``: cut leaves larger than a bucket into row
    ranges (``leaf_pieces``). ``name``: the plan's transform name. ``means_around``: the
    means are cheap to form again where they are read (PowerSGD's ``P Q^T``), so they
    leave around the barrier when residuals are there to order the buckets.
    ``pieces_apart``: on TPU, the pieces of a cut leaf are taken out of it by a barrier
    before the bucket's transform reads them (module docstring)."""

    def init_fn(params):
        leaves = jax.tree_util.tree_leaves(params)
        groups = bucket_groups(leaves, bucket_bytes, split=split)
        return BucketedState(tuple(make(k).init([_cut(leaves[p.leaf], p) for p in g])
                                   for k, g in enumerate(groups)))

    def update_fn(updates, state, params=None):
        del params
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        groups = bucket_groups(leaves, bucket_bytes, split=split)
        if not isinstance(state, BucketedState) or len(groups) != len(state.buckets):
            raise ValueError(
                f"{name}: these gradients make {len(groups)} buckets of at most {bucket_bytes} "
                f"bytes, the state holds {len(getattr(state, 'buckets', ()))}: the state was made "
                "for another tree or another bucket_bytes (one bucket: bucket_bytes=None, or "
                "\"auto\" off a TPU backend). Make it with tx.init(params) for these parameters, "
                "or pass the bucket_bytes it was made with.")
        current, means, states, previous = list(leaves), {}, [], None
        for k, (g, s) in enumerate(zip(groups, state.buckets)):
            # Whole leaves go through the barrier and are cut after it: a slice taken
            # before it would be copied out to be a barrier operand.
            need = sorted({p.leaf for p in g})
            if previous is not None:
                (done, carried), fresh = _chained(previous, [current[i] for i in need])
                states[-1] = _with_carried(states[-1], carried)
                if done:  # the barrier's: not decoded again later
                    means.update(zip(groups[k - 1], done))
                current = [dict(zip(need, fresh)).get(i, v) for i, v in enumerate(current)]
            pieces = [_cut(current[p.leaf], p) for p in g]
            out, new = make(k).update(_apart(pieces, g) if pieces_apart else pieces, s)
            means.update(zip(g, out))
            states.append(new)
            carried = _carried(new)
            around = means_around and bool(jax.tree_util.tree_leaves(carried))
            previous = ([] if around else list(out), carried)
        return jax.tree_util.tree_unflatten(treedef, _joined(leaves, means)), BucketedState(tuple(states))

    def plan(params, num_replicas: int, **options) -> CommunicationPlan:
        leaves = jax.tree_util.tree_leaves(params)
        transfers = []
        for k, g in enumerate(bucket_groups(leaves, bucket_bytes, split=split)):
            sub = planner_of(make(k))([_cut(leaves[p.leaf], p) for p in g], num_replicas, **options)
            transfers += [dataclasses.replace(t, what=f"bucket {k}: {t.what}") for t in sub.transfers]
        return CommunicationPlan(name, num_replicas, tuple(transfers), float_baseline(params, num_replicas))

    return with_plan(optax.GradientTransformation(init_fn, update_fn), plan)
