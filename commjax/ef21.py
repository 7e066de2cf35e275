"""EF21: error feedback on the gradient estimate (``compressed_mean(error_feedback="ef21")``).

Classic error feedback keeps what compression dropped and adds it to the next gradient.
EF21 (Richtarik, Sokolov, Fatkhullin, NeurIPS 2021) keeps instead an *estimate* ``g_i``
of its own gradient on every worker and the mean of the estimates ``G`` on all of them,
and sends only the compressed change of the estimate::

    c_i = C(grad_i - g_i);   g_i <- g_i + c_i;   G <- G + (1/N) sum_i c_i;   return G

``G`` is the mean of the ``g_i`` at every step (all replicas add the same mean of the
``c_i``), so the optimizer sees the same value everywhere. Same bytes as classic error
feedback (one payload per compressed leaf per step); one more parameter-sized state
(``G``, replicated).

It is built on the classic step of [`commjax.compressed_mean`][], whose worker residual
``r_i`` then holds ``-g_i``: the classic step encodes ``x_i = grad_i + r_i = grad_i -
g_i``, sends ``C(x_i)`` and leaves ``e_i = x_i - C(x_i)``, from which
``r_i' = -(g_i + C(x_i)) = e_i - grad_i``. Only compressed leaves have an estimate;
leaves that go through the exact bucket are exact means as before.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from commjax import guards
from commjax.plan import COMPRESS

__all__ = ["EF21State", "wrap"]


class EF21State(NamedTuple):
    """State of ``compressed_mean(error_feedback="ef21")``.

    Attributes:
      inner: the classic [`commjax.CompressedMeanState`][], whose ``residual`` holds
        ``-g_i``, this worker's negated gradient estimate (per replica).
      estimate: ``G``, the mean of the workers' estimates: one float32 array per
        compressed leaf, in its shape (as ``inner.residual``), replicated.
    """

    inner: Any
    estimate: tuple


def _step(cfg: Any, inner_update: Callable, grads, state: EF21State, params):
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    out, inner = inner_update(grads, state.inner, params)
    if not inner.residual:  # a lossless codec, or nothing compressed: exact means
        return out, EF21State(inner, state.estimate)
    n_rep = guards.check_bound(cfg.axis_name, "compressed_mean")
    routes = cfg.plan(leaves, n_rep).routes
    comp_idx = [i for i, r in enumerate(routes) if r == COMPRESS]
    means = treedef.flatten_up_to(out)
    residual, estimate = list(inner.residual), list(state.estimate)
    for k, i in enumerate(comp_idx):
        m = means[i].astype(jnp.float32)
        bad = jnp.logical_not(guards.all_finite(m))  # NaN on every replica for a flagged leaf
        new_g = estimate[k] + m
        means[i] = new_g.astype(means[i].dtype)
        new_r = inner.residual[k].astype(jnp.float32) - leaves[i].astype(jnp.float32)
        residual[k] = jnp.where(bad, state.inner.residual[k], new_r.astype(inner.residual[k].dtype))
        estimate[k] = jnp.where(bad, estimate[k], new_g)
    inner = inner._replace(residual=tuple(residual))
    return jax.tree_util.tree_unflatten(treedef, means), EF21State(inner, tuple(estimate))


def wrap(cfg: Any, init_fn: Callable, update_fn: Callable) -> tuple[Callable, Callable]:
    """``(init, update)`` of EF21 around the classic ``compressed_mean`` functions made for
    ``cfg`` (its ``ExchangeConfig``, with error feedback on)."""

    def init(params):
        inner = init_fn(params)
        return EF21State(inner, tuple(jnp.zeros(jnp.shape(r), jnp.float32) for r in inner.residual))

    def update(grads, state, params=None):
        if not isinstance(state, EF21State):
            raise TypeError("compressed_mean(error_feedback='ef21'): `state` must be the EF21State "
                            f"made by its init(); got {type(state).__name__}.")
        return _step(cfg, update_fn, grads, state, params)

    return init, update
