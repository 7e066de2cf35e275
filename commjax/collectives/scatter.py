"""``reduce_scatter`` with a codec; its VJP is a compressed ``all_gather``."""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax

from commjax import _compat
from commjax.guards import check_bound
from commjax.compressors.base import Compressor
from commjax.collectives._common import _check_tiled, check_codec
from commjax.collectives._sharded import (
    _GatherConfig, _ScatterConfig, _gather_two_level, _scatter_two_level,
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scatter_vjp(cfg: _ScatterConfig, tree, key):
    return _scatter_two_level(tree, cfg, key)[0]


def _scatter_fwd(cfg, tree, key):
    return _scatter_vjp(cfg, tree, key), key


def _scatter_bwd(cfg, key, ct):
    grad_key = None if key is None else jax.random.fold_in(key, 1)
    gcfg = _GatherConfig(cfg.axis_name, cfg.grad_codec, None, cfg.inner_axis_name, None, None, False)
    out = _gather_two_level(ct, gcfg, grad_key)
    if cfg.mean:
        n = _compat.axis_size(cfg.axis_name)
        if cfg.inner_axis_name is not None:
            n *= _compat.axis_size(cfg.inner_axis_name)
        out = jax.tree_util.tree_map(lambda v: (v / n).astype(v.dtype), out)
    return out, None


_scatter_vjp.defvjp(_scatter_fwd, _scatter_bwd)


def reduce_scatter(
    x: Any,
    axis_name: Any,
    codec: Optional[Compressor] = None,
    *,
    grad_codec: Optional[Compressor] = None,
    key: Optional[jax.Array] = None,
    residual: Any = None,
    mean: bool = False,
    inner_axis_name: Any = None,
    inner_codec: Optional[Compressor] = None,
) -> Any:
    """Sum (or mean) ``x`` over ``axis_name`` and keep this replica's chunk, sent encoded.

    Each leaf ``[N * a, ...]`` is cut into ``N`` chunks along axis 0; chunk ``j`` of every
    replica is encoded on its own and sent to replica ``j`` (one all-to-all of uint32
    words for the whole tree), which decodes the ``N`` chunks it receives and sums them in
    replica order in fp32::

        out_j = sum_r C(x_r[chunk j])          (divided by N with mean=True)

    Bytes per device: ``(N - 1) / N * 4 * N * sum_leaves payload_words(chunk)``: for
    ``cj.quantize(bits=4)`` at block 256, ``(N-1)/N * 4.125/32`` of the fp32
    reduce-scatter's ``(N-1)/N * 4 * size``.

    Args:
      x: pytree of arrays whose leading dimension is a multiple of ``N`` (of
        ``N * inner size`` with ``inner_axis_name``).
      axis_name: the mesh axis (or tuple of axes).
      codec: ``None``: exact (``lax.psum_scatter``).
      grad_codec: codec of the VJP's ``all_gather``; ``None``: exact.
      key: PRNG key, the same on every replica (stochastic codecs only).
      residual: error feedback: a pytree like ``x`` (any float dtype); then ``x + residual``
        is encoded and ``(out, new_residual)`` is returned, ``new_residual = y - C(y)``
        per chunk. Not differentiable; not with ``inner_axis_name``.
      mean: divide the sum by the number of replicas.
      inner_axis_name, inner_codec: two-level (see the module docstring): first over the
        inner axis with ``inner_codec`` (exact if ``None``), then over ``axis_name``.

    Returns:
      This replica's chunk of each leaf, ``[a, ...]``, in the leaf's dtype; with
      ``residual``, ``(chunks, new_residual)``.
    """
    where = "reduce_scatter"
    codec = check_codec(codec, where)
    grad_codec = check_codec(grad_codec, where, "grad_codec")
    inner_codec = check_codec(inner_codec, where, "inner_codec")
    n = check_bound(axis_name, where)
    if inner_axis_name is not None:
        n *= check_bound(inner_axis_name, where)
    _check_tiled(jax.tree_util.tree_leaves(x), n, where)
    cfg = _ScatterConfig(axis_name, codec, grad_codec, inner_axis_name, inner_codec, bool(mean))
    if residual is None:
        return _scatter_vjp(cfg, x, key)
    if inner_axis_name is not None:
        raise ValueError(f"{where}: error feedback (`residual`) with `inner_axis_name` is not "
                         "supported; keep a residual per level in your own code.")
    if jax.tree_util.tree_structure(residual) != jax.tree_util.tree_structure(x):
        raise ValueError(f"{where}: `residual` must have the structure and shapes of `x`.")
    return _scatter_two_level(x, cfg, key, residual)
