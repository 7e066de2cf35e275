"""``all_reduce`` with a codec, through a ``Reducer``; its VJP is an ``all_reduce``."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from commjax import _compat
from commjax.guards import check_bound
from commjax.compressors.base import Compressor, Segment
from commjax.collectives._common import (
    _is_exact, _items, _names, _replicated_cotangent, _vary_out, check_codec, replica_key,
)
from commjax.collectives._exact import prescale, unscale_mean
from commjax.collectives._reducers import check_reducer, choose_reducer, reduce_parts


def all_reduce(
    x: Any,
    axis_name: Any,
    codec: Optional[Compressor] = None,
    *,
    reducer: Any = "auto",
    grad_codec: Optional[Compressor] = None,
    key: Optional[jax.Array] = None,
    residual: Any = None,
    server_residual: Optional[jax.Array] = None,
    mean: bool = False,
    inner_axis_name: Any = None,
    server_error_feedback: bool = True,
) -> Any:
    """Sum (or mean) ``x`` over ``axis_name``, identical on every replica, sent encoded.

    The floating leaves form one bucket (each padded to whole blocks) reduced by one
    ``Reducer``: ``"allreduce"`` (``psum`` of a linear payload, ``2 (N-1)/N P``),
    ``"allgather"`` (``(N-1) P``, grows with ``N``), ``"two_phase"`` (all-to-all +
    all-gather, ``2 (N-1)/N P``, flat in ``N``, with a server-side re-encoding) or
    ``"auto"`` (the cheapest valid). With ``inner_axis_name`` the exact fp32 mean over that
    (fast) axis comes first and only ``axis_name`` sees the codec.

    Args:
      x: pytree of arrays (any shapes).
      axis_name: the mesh axis (or tuple of axes).
      codec: ``None``: exact ``lax.psum``.
      reducer: see above.
      grad_codec: codec of the VJP's all-reduce of the cotangent; ``None``: exact.
      key: PRNG key, the same on every replica (stochastic codecs only).
      residual: error feedback, a pytree like ``x``: returns ``(out, new_residual,
        new_server_residual)``. Not differentiable.
      server_residual: the two-phase reducer's residual (``float32[chunk]``, see
        ``Reducer.server_residual_size``), with ``residual``.
      mean: divide by the number of replicas (of both axes with ``inner_axis_name``).
      server_error_feedback: keep the two-phase server residual.
    """
    where = "all_reduce"
    codec = check_codec(codec, where)
    grad_codec = check_codec(grad_codec, where, "grad_codec")
    check_bound(axis_name, where)
    if inner_axis_name is not None:
        check_bound(inner_axis_name, where)
    if codec is not None:
        check_reducer(codec, reducer, where)
    cfg = _ReduceConfig(axis_name, codec, reducer, grad_codec, inner_axis_name, bool(mean),
                        bool(server_error_feedback))
    if residual is None and server_residual is None:
        return _reduce_vjp(cfg, x, key)
    return _reduce_impl(cfg, x, key, residual, server_residual)


@dataclasses.dataclass(frozen=True)
class _ReduceConfig:
    axis_name: Any
    codec: Optional[Compressor]
    reducer: Any
    grad_codec: Optional[Compressor]
    inner_axis_name: Any
    mean: bool
    server_error_feedback: bool


def _reduce_impl(cfg: _ReduceConfig, tree, key, residual=None, server_residual=None):
    """``all_reduce``: exact leaves in one ``psum`` over every axis, the floating leaves
    through the codec's reducer over ``axis_name`` after the exact inner mean."""
    n = _compat.axis_size(cfg.axis_name)
    axes = _names(cfg.axis_name)
    inner = 1
    if cfg.inner_axis_name is not None:
        inner = _compat.axis_size(cfg.inner_axis_name)
        axes = axes + _names(cfg.inner_axis_name)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    items = [] if _is_exact(cfg.codec) else _items(leaves, cfg.codec, 1)
    done = {it.index for it in items}
    out = list(leaves)
    exact_idx = [i for i in range(len(leaves)) if i not in done]
    if cfg.mean and any(not jnp.issubdtype(jnp.result_type(leaves[i]), jnp.inexact) for i in exact_idx):
        raise ValueError("all_reduce: mean=True needs floating (or complex) leaves; sum integer "
                         "leaves with mean=False.")
    total_n = n * inner
    sums = _compat.psum([prescale(leaves[i], total_n) if cfg.mean else leaves[i] for i in exact_idx], axes)
    for i, v in zip(exact_idx, sums):
        out[i] = unscale_mean(v, total_n) if cfg.mean else v
    if not items:
        return jax.tree_util.tree_unflatten(treedef, out), residual, server_residual
    if cfg.inner_axis_name is not None:
        leaves = list(leaves)
        for it in items:
            leaves[it.index] = _compat.psum(leaves[it.index].astype(jnp.float32), cfg.inner_axis_name) / inner
    segments, parts, off = [], [], 0
    for it in items:
        segments.append(Segment(off, it.size, it.padded, it.shape))
        parts.append(jnp.pad(jnp.ravel(leaves[it.index]).astype(jnp.float32), (0, it.padded - it.size)))
        off += it.padded
    res_leaves = None if residual is None else jax.tree_util.tree_leaves(residual)
    res = reduce_parts(
        cfg.codec, choose_reducer(cfg.codec, cfg.reducer, off, n, segments), parts, segments,
        axis_name=cfg.axis_name, num_replicas=n,
        key=replica_key(cfg.codec, key, cfg.axis_name, "all_reduce"),
        residuals=None if res_leaves is None else [jnp.ravel(res_leaves[it.index]) for it in items],
        server_residual=server_residual, server_error_feedback=cfg.server_error_feedback)
    scale = 1.0 if cfg.mean else float(n * inner)
    for it, m in zip(items, res.means):
        out[it.index] = (m * scale).reshape(it.shape).astype(it.dtype)
    new_res = residual
    if res_leaves is not None:
        new_res = list(res_leaves)
        for it, e in zip(items, res.residuals):
            new_res[it.index] = e.reshape(res_leaves[it.index].shape).astype(res_leaves[it.index].dtype)
        new_res = jax.tree_util.tree_unflatten(treedef, new_res)
    return jax.tree_util.tree_unflatten(treedef, out), new_res, res.server_residual


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reduce_vjp(cfg: _ReduceConfig, tree, key):
    return _reduce_impl(cfg, tree, key)[0]


def _reduce_fwd(cfg, tree, key):
    return _reduce_vjp(cfg, tree, key), key


def _reduce_bwd(cfg, key, ct):
    if _replicated_cotangent(ct, cfg.axis_name):
        names = _names(cfg.axis_name) + (() if cfg.inner_axis_name is None else _names(cfg.inner_axis_name))
        out = _vary_out(ct, names)
        if cfg.mean:
            n = _compat.axis_size(cfg.axis_name) * (
                1 if cfg.inner_axis_name is None else _compat.axis_size(cfg.inner_axis_name))
            out = jax.tree_util.tree_map(lambda v: (v / n).astype(v.dtype), out)
        return out, None
    grad_key = None if key is None else jax.random.fold_in(key, 1)
    gcfg = dataclasses.replace(cfg, codec=cfg.grad_codec, grad_codec=None, reducer="auto")
    return _reduce_impl(gcfg, ct, grad_key)[0], None


_reduce_vjp.defvjp(_reduce_fwd, _reduce_bwd)
