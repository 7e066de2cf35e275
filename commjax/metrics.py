"""Per-step communication metrics, read out of any optimizer state.

Every [`commjax.compressed_mean`][] keeps a small per-replica ``metrics`` dict in its
[`CompressedMeanState`][commjax.CompressedMeanState] (the l2 norm of this replica's error-feedback
residual, a non-finite flag, and the compressor's own scalars), computed locally during
the update with **no extra collective**. This module finds those states wherever they sit
in an optimizer state (``optax.chain``, ``optax.MultiSteps``, ``inject_hyperparams``,
``partition``, ``masked``, ``flax.nnx.Optimizer`` ...) and combines them with the static
bytes of a [`CommunicationPlan`][commjax.CommunicationPlan]::

    plan = cj.communication_plan(cj.quantize(bits=4), params, num_replicas=8)
    ...
    m = step_metrics(opt_state, plan)
    m["bytes_per_step"], m["compression_ratio"], m["residual_norm"]

Reading the values copies a few floats from the devices to the host; it runs no
collective. With several processes, only this process' replicas are visible: the
per-replica values cover those replicas (call it on every process, or aggregate
yourself).

Aggregation over replicas ``i = 1..N`` and over the compressed-mean states ``s`` found
in the state (e.g. one per ``optax.partition`` group)::

    residual_norm = sqrt( sum_s  mean_i ||e_{s,i}||^2 )     # root-mean-square over replicas
    bytes_per_step = sum_s plan_s.bytes_per_step            # per device, ring convention
    compression_ratio = sum_s plan_s.baseline_bytes / bytes_per_step
"""

from __future__ import annotations

import math
from typing import Any, Sequence, Union

import jax
import numpy as np

from commjax.accounting import CommunicationPlan
from commjax.transform import CompressedMeanState

__all__ = [
    "compressed_mean_states",
    "local_metrics",
    "replica_metrics",
    "step_metrics",
]


def _children(tree: Any) -> list[tuple[str, Any]]:
    """Direct children of a pytree node with a readable name each."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return [(f, getattr(tree, f)) for f in tree._fields]
    if isinstance(tree, (tuple, list)):
        return [(str(i), v) for i, v in enumerate(tree)]
    if isinstance(tree, dict):
        return [(str(k), v) for k, v in tree.items()]
    if tree is None:
        return []
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef.num_nodes == 1:
        return []  # a leaf
    with_path, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is not tree
    )
    return [(jax.tree_util.keystr(p).lstrip(".[").rstrip("]'\"").strip("'\""), c)
            for p, c in with_path]


def compressed_mean_states(state: Any) -> list[tuple[str, CompressedMeanState]]:
    """Every [`CompressedMeanState`][commjax.CompressedMeanState] inside ``state``, in pytree order,
    with
    a ``/``-separated path (``"0"`` for the first element of an ``optax.chain``,
    ``"inner_opt_state/0"`` inside ``MultiSteps``...). Works on concrete and traced
    states alike."""
    found: list[tuple[str, CompressedMeanState]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, CompressedMeanState):
            found.append((path, node))
            return
        for name, child in _children(node):
            walk(child, f"{path}/{name}" if path else name)

    walk(state, "")
    return found


def local_metrics(state: Any) -> dict[str, jax.Array]:
    """This replica's metrics, for use *inside* the step (``shard_map``/``pmap``).

    Returns the ``metrics`` dict of the single compressed-mean state in ``state`` (a
    ``float32[1]`` per name), or, with several, the names prefixed with each state's
    path (``"0/residual_norm"``). Nothing is communicated: return them with
    ``out_specs=P(axis)`` to see every replica's value.
    """
    states = compressed_mean_states(state)
    if len(states) == 1:
        return dict(states[0][1].metrics)
    return {f"{path}/{k}": v for path, s in states for k, v in s.metrics.items()}


def _host_values(leaf: Any) -> np.ndarray:
    """A per-replica leaf as a flat host array, one value per (visible) replica.

    Accepts the ``shard_state`` layout (global ``[N * 1]`` array), the ``pmap`` layout
    (``[N, 1]``), a single replica's ``[1]`` and numpy arrays. For an array spread over
    several processes only the addressable shards are read.
    """
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        shards = sorted(leaf.addressable_shards,
                        key=lambda s: tuple((i.start or 0) if isinstance(i, slice) else 0
                                            for i in s.index))
        seen, parts = set(), []
        for s in shards:
            key = tuple((i.start, i.stop) if isinstance(i, slice) else i for i in s.index)
            if key not in seen:
                seen.add(key)
                parts.append(np.asarray(s.data).ravel())
        return np.concatenate(parts) if parts else np.zeros((0,), np.float32)
    return np.asarray(leaf).ravel()


def _host_scalar(leaf: Any) -> float:
    """A replicated leaf (``count``) as one number, whatever its layout."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        leaf = leaf.addressable_shards[0].data
    a = np.asarray(leaf).ravel()
    return float(a[0]) if a.size else float("nan")


def replica_metrics(state: Any) -> list[dict[str, np.ndarray]]:
    """Per-replica values of every compressed-mean state in ``state``: one dict per state
    (in [`compressed_mean_states`][commjax.metrics.compressed_mean_states] order) mapping each
    metric name to a host array
    with one value per visible replica, plus ``"exchanges"`` (the state's step count)."""
    out = []
    for _, s in compressed_mean_states(state):
        d = {k: _host_values(v).astype(np.float64) for k, v in s.metrics.items()}
        d["exchanges"] = np.asarray(_host_scalar(s.count))
        out.append(d)
    return out


PlanLike = Union[CommunicationPlan, Sequence[CommunicationPlan], None]


def step_metrics(state: Any, plan: PlanLike = None) -> dict[str, float]:
    """Communication metrics of the last step, as plain floats (for logs and progress
    bars).

    Args:
      state: any optimizer state that contains one or more ``compressed_mean``
        states, in any layout (``shard_state`` global arrays, ``pmap`` leading axis, or
        one replica's local view).
      plan: the [`commjax.communication_plan`][] of each compressed-mean state found
        (one plan, or a sequence in
        [`compressed_mean_states`][commjax.metrics.compressed_mean_states] order). The plan is
        static (shapes, compressor, replica count), so it is made once, outside the loop.
        Without it the byte counts are left out.

    Returns:
      A dict with

      * ``residual_norm``: root-mean-square over replicas of the l2 norm of each
        replica's error-feedback residual (combined over states as in the module
        docstring); 0 without error feedback;
      * ``residual_norm_max``: the largest per-replica norm;
      * ``nonfinite``: 1.0 if the last exchange saw a NaN/Inf on some replica (the step
        was skipped by the residuals), else 0.0;
      * ``exchanges``: compressed exchanges done so far (the largest count over states);
      * each compressor metric (``compressor.metric_names``), averaged over replicas;
      * with ``plan``: ``bytes_per_step`` (per device, ring convention),
        ``baseline_bytes`` (the exact fp32 mean of the same gradients),
        ``compression_ratio`` and ``bytes_sent`` (``exchanges * bytes_per_step``).

    Raises:
      ValueError: if ``state`` holds no compressed-mean state, or the number of plans
        differs from the number of states.
    """
    states = compressed_mean_states(state)
    if not states:
        raise ValueError(
            "step_metrics: `state` contains no CompressedMeanState; pass the optimizer state "
            "of a transform built with cj.compressed_mean (e.g. optax.chain(cj.compressed_mean"
            "(...), optax.adam(...)))."
        )
    per = replica_metrics(state)
    sq, mx, bad, exch = 0.0, 0.0, 0.0, 0.0
    extra: dict[str, float] = {}
    for d in per:
        norms = d.get("residual_norm", np.zeros((0,)))
        if norms.size:
            sq += float(np.mean(np.square(norms)))
            mx = max(mx, float(np.max(norms)))
        nf = d.get("nonfinite", np.zeros((0,)))
        if nf.size and float(np.max(np.where(np.isnan(nf), 1.0, nf))) > 0:
            bad = 1.0
        exch = max(exch, float(d["exchanges"]))
        for k, v in d.items():
            if k in ("residual_norm", "nonfinite", "exchanges") or not np.size(v):
                continue
            extra[k] = extra.get(k, 0.0) + float(np.mean(v))
    out: dict[str, float] = {
        "residual_norm": math.sqrt(sq),
        "residual_norm_max": mx,
        "nonfinite": bad,
        "exchanges": exch,
    }
    out.update(extra)
    if plan is not None:
        plans = [plan] if isinstance(plan, CommunicationPlan) else list(plan)
        if len(plans) != len(states):
            raise ValueError(
                f"step_metrics: `plan` has {len(plans)} plan(s) but the state holds "
                f"{len(states)} compressed-mean state(s) at {[p for p, _ in states]}; pass "
                "one cj.communication_plan per state, in that order."
            )
        sent = sum(p.bytes_per_step for p in plans)
        base = sum(p.baseline_bytes for p in plans)
        out["bytes_per_step"] = float(sent)
        out["baseline_bytes"] = float(base)
        out["compression_ratio"] = float("inf") if sent == 0 else float(base / sent)
        out["bytes_sent"] = float(exch * sent)
    return out
