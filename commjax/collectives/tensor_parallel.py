"""Megatron's ``f`` and ``g`` for tensor-parallel ``shard_map`` code, compressed.

A tensor-parallel MLP (or attention block) over the model axis of ``T`` replicas splits
its first weight by columns and its second by rows; each replica holds ``x`` whole::

    h = tp_copy(x, "model")               # f: identity forward; backward: sum of the
                                          #    replicas' input gradients (all-reduce)
    z = gelu(h @ W1[:, shard]) @ W2[shard, :]   # a partial sum on every replica
    out = tp_reduce(z, "model")           # g: sum of the partial sums (all-reduce);
                                          #    backward: identity

Two all-reduces of activations per block (one forward in ``g``, one backward in ``f``),
each a reduce-scatter + all-gather of the encoded activations when compressed (the
two-phase reducer: every replica decodes and sums its chunk in fp32, re-encodes it and
all-gathers it), ``2 (T-1)/T * P`` bytes per device, ``P`` the payload of one replica's
activations: for ``cj.quantize(bits=8)`` at block 256, ``4 * 65 / 256`` bytes per
element against fp32's 4 (3.94x fewer); ``cj.hadamard(cj.quantize(bits=4))`` rotates
the outlier-heavy activations first (TACO, TAH-Quant) and sends 7.76x fewer.

The codec's rounding is not differentiated (straight-through): ``tp_reduce``'s backward
is the identity and ``tp_copy``'s forward is. With ``codec=None`` they are
``lax.psum`` and the identity, whatever ``check_vma`` says (under ``check_vma=False``,
``lax.psum``'s own transpose would sum the cotangent again).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
from jax import lax

from commjax import _compat
from commjax.compressors.base import BlockCompressor, Compressor
from commjax.collectives._common import _is_exact, check_codec
from commjax.collectives.reduce import all_reduce
from commjax.guards import check_bound

__all__ = ["tp_copy", "tp_reduce", "tp_reducer"]


def tp_reducer(codec: Optional[Compressor]) -> str:
    """The reducer that carries ``codec`` in the tensor-parallel ops: ``"two_phase"``
    (reduce-scatter + all-gather) for block codecs, else ``"auto"``."""
    return "two_phase" if isinstance(codec, BlockCompressor) else "auto"


@dataclasses.dataclass(frozen=True)
class _TpConfig:
    axis_name: Any
    codec: Optional[Compressor]
    varying: tuple = ()  # tp_copy: per leaf of x, whether it was typed varying over the axis


def _sum(cfg: _TpConfig, tree, key):
    """The sum over the axis: ``lax.psum``, or the compressed all-reduce (no state: the
    two-phase reducer's server residual is not kept for activations)."""
    if cfg.codec is None:
        return _compat.psum(tree, cfg.axis_name)
    return all_reduce(tree, cfg.axis_name, cfg.codec, reducer=tp_reducer(cfg.codec), key=key,
                      server_error_feedback=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _copy(cfg: _TpConfig, x, key):
    return _compat.vary(x, cfg.axis_name)


def _copy_fwd(cfg, x, key):
    return _copy(cfg, x, key), key


def _copy_bwd(cfg, key, ct):
    total = _sum(cfg, ct, None if key is None else jax.random.fold_in(key, 1))
    if not any(cfg.varying):
        return total, None
    # A cotangent has its primal's type: the sum, typed varying where x was (x then is
    # the same on every replica without being typed so, e.g. received through a send).
    leaves, treedef = jax.tree_util.tree_flatten(total)
    leaves = [_compat.vary(l, cfg.axis_name) if v else l for l, v in zip(leaves, cfg.varying)]
    return jax.tree_util.tree_unflatten(treedef, leaves), None


_copy.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reduce(cfg: _TpConfig, x, key):
    return _sum(cfg, x, key)


def _reduce_fwd(cfg, x, key):
    return _reduce(cfg, x, key), key


def _reduce_bwd(cfg, key, ct):
    return _compat.vary(ct, cfg.axis_name), None


_reduce.defvjp(_reduce_fwd, _reduce_bwd)


def _config(axis_name: Any, codec: Any, argument: str, where: str) -> _TpConfig:
    check_bound(axis_name, where)
    codec = check_codec(codec, where, argument)
    return _TpConfig(axis_name, None if _is_exact(codec) else codec)


def tp_copy(x: Any, axis_name: Any, *, grad_codec: Optional[Compressor] = None,
            key: Optional[jax.Array] = None) -> Any:
    """Megatron's ``f``: ``x`` (the same on every replica of ``axis_name``) as it is; the
    backward pass sums the replicas' cotangents, encoded with ``grad_codec``.

    Bytes per device: forward 0; backward the all-reduce of
    ``cj.communication_plan(cc.tp_copy, x, T, codec=grad_codec)`` (``2 (T-1)/T * 4 * size``
    exact).

    Args:
      x: pytree of arrays, the same on every replica of ``axis_name`` (typed replicated
        or varying: the cotangent comes back typed as ``x`` is).
      axis_name: the tensor-parallel mesh axis (bound by ``shard_map``).
      grad_codec: codec of the backward all-reduce; ``None``: exact (``lax.psum``).
      key: PRNG key, the same on every replica (stochastic codecs).
    """
    cfg = _config(axis_name, grad_codec, "grad_codec", "tp_copy")
    names = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
    varying = tuple(bool(names & (_compat.varying_axes(l) or frozenset()))
                    for l in jax.tree_util.tree_leaves(x))
    return _copy(dataclasses.replace(cfg, varying=varying), x, key)


def tp_reduce(x: Any, axis_name: Any, *, codec: Optional[Compressor] = None,
              key: Optional[jax.Array] = None) -> Any:
    """Megatron's ``g``: the sum over ``axis_name`` of the replicas' partial results,
    sent encoded with ``codec`` (reduce-scatter + all-gather); the backward pass is the
    identity (the cotangent of a replicated sum is every replica's).

    Bytes per device: ``cj.communication_plan(cc.tp_reduce, x, T, codec=codec)``; backward 0.

    Args:
      x: pytree of arrays, this replica's partial sums.
      axis_name: the tensor-parallel mesh axis (bound by ``shard_map``).
      codec: codec of the forward all-reduce; ``None``: exact (``lax.psum``). Near-zero,
        outlier-heavy activations: ``cj.hadamard(cj.quantize(bits=4, stochastic=False))``.
      key: PRNG key, the same on every replica (stochastic codecs).

    Returns:
      The sum, identical on every replica (typed replicated under ``check_vma=True``).
    """
    cfg = _config(axis_name, codec, "codec", "tp_reduce")
    return _reduce(cfg, x, key)
