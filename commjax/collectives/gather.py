"""``all_gather`` with a codec; its VJP is a compressed ``reduce_scatter``."""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from commjax.guards import check_bound
from commjax.compressors.base import Compressor
from commjax.collectives._common import _replicated_cotangent, check_codec
from commjax.collectives._sharded import (
    _GatherConfig, _ScatterConfig, _gather_two_level, _scatter_two_level, _slice_own,
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_vjp(cfg: _GatherConfig, tree, key):
    return _gather_two_level(tree, cfg, key)


def _gather_fwd(cfg, tree, key):
    return _gather_two_level(tree, cfg, key), key


def _gather_bwd(cfg, key, ct):
    if _replicated_cotangent(ct, cfg.axis_name):
        return _slice_own(ct, cfg.axis_name, cfg.inner_axis_name), None
    grad_key = None if key is None else jax.random.fold_in(key, 1)
    out, _ = _scatter_two_level(ct, _ScatterConfig(
        cfg.axis_name, cfg.grad_codec, None, cfg.inner_axis_name, cfg.inner_grad_codec, False,
    ), grad_key)
    return out, None


_gather_vjp.defvjp(_gather_fwd, _gather_bwd)


def all_gather(
    x: Any,
    axis_name: Any,
    codec: Optional[Compressor] = None,
    *,
    grad_codec: Optional[Compressor] = None,
    key: Optional[jax.Array] = None,
    inner_axis_name: Any = None,
    inner_codec: Optional[Compressor] = None,
    inner_grad_codec: Optional[Compressor] = None,
    invariant: bool = False,
) -> Any:
    """All-gather ``x`` (a pytree of shards) over ``axis_name``, each shard sent encoded.

    Every replica gets ``concat_r C(x_r)`` along axis 0 (shape ``[N * a, ...]`` for a shard
    ``[a, ...]``), the owner's own shard included as decoded, so all replicas hold the same
    bits. Bytes per device: ``(N - 1) * 4 * sum_leaves payload_words(leaf)`` in one
    all-gather of uint32 words (exact: ``(N - 1) * itemsize * size``).

    Args:
      x: pytree of arrays of rank >= 1 (this replica's shards).
      axis_name: the mesh axis (or tuple of axes) to gather over.
      codec: the codec of the forward gather; ``None``: exact (``lax.all_gather``).
      grad_codec: codec of the VJP's ``reduce_scatter`` of the cotangent; ``None``: exact.
      key: PRNG key, the same on every replica (stochastic codecs only).
      inner_axis_name, inner_codec, inner_grad_codec: a two-level gather (see the module
        docstring): over ``axis_name`` with ``codec``, then over ``inner_axis_name``.
      invariant: type the result as replicated under ``shard_map(check_vma=True)`` (its
        cotangent is then replicated too and the VJP is a slice, with no communication).

    Returns:
      The gathered pytree, leaves in their input dtypes.
    """
    where = "all_gather"
    codec = check_codec(codec, where)
    grad_codec = check_codec(grad_codec, where, "grad_codec")
    inner_codec = check_codec(inner_codec, where, "inner_codec")
    inner_grad_codec = check_codec(inner_grad_codec, where, "inner_grad_codec")
    check_bound(axis_name, where)
    if inner_axis_name is not None:
        check_bound(inner_axis_name, where)
    for leaf in jax.tree_util.tree_leaves(x):
        if not jnp.shape(leaf):
            raise ValueError(f"{where}: leaves must have rank >= 1 (gathered along axis 0); "
                             "reshape scalars to shape (1,).")
    cfg = _GatherConfig(axis_name, codec, grad_codec, inner_axis_name, inner_codec,
                        inner_grad_codec, bool(invariant))
    return _gather_vjp(cfg, x, key)
