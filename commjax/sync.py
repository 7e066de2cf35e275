"""``sync_in_backward``: the compressed gradient exchange issued inside the backward pass.

[`compressed_mean`][commjax.compressed_mean] exchanges the gradient after the whole
backward pass, so the collectives cannot hide behind it. Here the exchange of each
*bucket* of parameters (consecutive leaves, up to ``bucket_bytes``) is the VJP of an
identity on those parameters: it is issued as soon as the backward pass has produced
that bucket's gradient, and XLA's scheduler can run it while the backward pass of earlier
layers is still computing (what PyTorch DDP does with its gradient buckets)::

    sync = cj.sync_in_backward(cj.quantize(bits=8), "data")
    state = sync.init(params)                                   # inside shard_map
    (loss, grads), state = sync.value_and_grad(loss_fn)(params, state, batch)
    updates, opt_state = optax.sgd(0.1).update(grads, opt_state)  # grads: the mean

For bucket ``b`` of replica ``i``, with the gradient ``g_{b,i}`` of the loss with respect to
``attach(params)`` (per replica: the parameters are marked varying first, so JAX itself does
not sum the gradient), the VJP returns ``compressed_mean(codec).update(g_{b,i}, s_b)``:
the same codec, reducer, error feedback, NaN flags and replica guarantees, one
``compressed_mean`` state ``s_b`` per bucket. Bytes per step: the sum over buckets of each
bucket's [`commjax.communication_plan`][] (one set of collectives per bucket).

Order: ``value_and_grad`` reads, from the traced loss, the order in which the backward pass
completes the buckets' gradients ([`exchange_order`][commjax.sync.InBackwardSync.exchange_order])
and makes each bucket's exchange wait for the mean of the bucket before it (a data
dependence; the values are unchanged). Without it XLA merges the buckets' all-gathers into
one collective that can only start after the last bucket, with no backward pass left to
hide it behind (on H100 x8, GPT-2 small, sign: 51% of the exchanged bytes overlapped
instead of 99%).

Functional state: each bucket's state enters the loss as a differentiable *carrier* (its
float leaves as they are, its integer leaves as exact float32 16-bit halves) and the new
state comes back as the carrier's cotangent; nothing is hidden, so the state is a pytree of
arrays that jit, orbax and ``jax.checkpoint`` handle as usual.

Results: with one bucket the gradient mean is the one ``compressed_mean`` gives after the
backward pass, bit for bit (the same operations on the same values). With several buckets
each bucket is reduced on its own: the same per-leaf blocks and error feedback for block
codecs and PowerSGD, but a different two-phase chunking and padding of the bucket, so the
means differ in their rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commjax import _compat, validation
from commjax.compressors.base import Compressor
from commjax.transform import compressed_mean

__all__ = ["InBackwardSync", "sync_in_backward"]

#: DDP's default bucket size.
DEFAULT_BUCKET_BYTES = 25 * 2 ** 20


def _buckets(leaves: Sequence[Any], cap: int) -> list[list[int]]:
    """Indices of the floating leaves, grouped in tree order: consecutive leaves until the
    next one would take the bucket past ``cap`` bytes (a larger leaf is a bucket alone)."""
    out, cur, size = [], [], 0
    for i, leaf in enumerate(leaves):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            continue
        nbytes = int(np.prod(jnp.shape(leaf))) * jnp.dtype(jnp.result_type(leaf)).itemsize
        if cur and size + nbytes > cap:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    return out + ([cur] if cur else [])


def _to_carrier(leaf: jax.Array) -> jax.Array:
    """A state leaf as a differentiable array: floats as they are, 32-bit and smaller
    integers as float32 pairs of 16-bit halves (exact, and unchanged by ``+ 0``)."""
    if jnp.issubdtype(leaf.dtype, jnp.floating):
        return leaf
    bits = jax.lax.bitcast_convert_type(leaf.astype(jnp.int32), jnp.uint32) if leaf.dtype != jnp.uint32 else leaf
    return jnp.stack([bits & 0xFFFF, bits >> 16], axis=-1).astype(jnp.float32)


def _from_carrier(value: jax.Array, like: Any) -> jax.Array:
    if jnp.issubdtype(like.dtype, jnp.floating):
        return value
    halves = value.astype(jnp.uint32)
    bits = halves[..., 0] | (halves[..., 1] << 16)
    if like.dtype == jnp.uint32:
        return bits
    return jax.lax.bitcast_convert_type(bits, jnp.int32).astype(like.dtype)


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """What the VJP of one bucket needs, static (hashable): the transform, the layout of
    its state, and the mesh axis."""

    tx: Any
    state_def: Any
    state_like: tuple  # (shape, dtype) of every state leaf
    axis_name: Any

    def carrier(self, state: Any) -> tuple:
        return tuple(_to_carrier(jnp.asarray(x)) for x in jax.tree_util.tree_leaves(state))

    def state(self, carrier: Sequence[jax.Array]) -> Any:
        leaves = [_from_carrier(c, jax.ShapeDtypeStruct(*like)) for c, like in zip(carrier, self.state_like)]
        return jax.tree_util.tree_unflatten(self.state_def, leaves)


def _like_typed(new: jax.Array, old: jax.Array, axis_name: Any) -> jax.Array:
    """``new`` typed as ``old`` is under ``check_vma=True``: a value every replica holds
    (a counter, PowerSGD's ``Q``) comes back invariant through a ``pmax`` of equal values;
    anything else varies, as the per-replica residuals do."""
    old_vma, new_vma = _compat.varying_axes(old), _compat.varying_axes(new)
    if old_vma is None or new_vma is None:
        return new
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    extra = tuple(n for n in names if n in new_vma and n not in old_vma)
    return jax.lax.pmax(new, extra) if extra else new


def _mark(token: jax.Array, values: Sequence[jax.Array]) -> jax.Array:
    """``token`` plus a finite number that depends on (one element of each of) ``values``:
    a data dependence XLA cannot fold away, whatever the values (NaN included)."""
    for v in values:
        word = jax.lax.bitcast_convert_type(jnp.ravel(v)[:1].astype(jnp.float32), jnp.uint32)
        token = token + jnp.sum(word == jnp.uint32(0x7FC00001)).astype(token.dtype)
    return token


def _after(x: jax.Array, token: jax.Array) -> jax.Array:
    """``x``, bit for bit (``v - 0 == v`` for every float, signed zeros and NaN included),
    computed after the finite ``token``."""
    return x - jnp.zeros((), x.dtype) * token.astype(x.dtype)


def _typed_like(values: Sequence[jax.Array], like: jax.Array) -> list:
    """The ``values`` whose varying axes are among ``like``'s (all, without type checks)."""
    axes = _compat.varying_axes(like)
    if axes is None:
        return list(values)
    return [v for v in values if (_compat.varying_axes(v) or frozenset()) <= axes]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attached(spec: _Bucket, leaves: tuple, carrier: tuple, pending: tuple, token: jax.Array) -> tuple:
    # Varying for the loss (each replica its own gradient); the cotangent of replicated
    # parameters is the replicated mean this VJP returns, so JAX adds no psum of its own.
    return tuple(_compat.vary(x, spec.axis_name) for x in leaves), token


def _attached_fwd(spec: _Bucket, leaves: tuple, carrier: tuple, pending: tuple, token: jax.Array):
    return _attached(spec, leaves, carrier, pending, token), (leaves, carrier, pending)


def _attached_bwd(spec: _Bucket, res, cts: tuple):
    leaves, carrier, pending = res
    ct, ct_token = cts
    # The token's cotangent is ready once the bucket exchanged before this one has its
    # mean: this bucket's gradient depends on it, so XLA keeps the buckets' collectives
    # apart (it would otherwise merge them into one, issued after the last bucket's
    # gradient, with nothing left to hide it). A data dependence, because XLA drops
    # optimization barriers before it combines collectives.
    ct = list(ct)
    if ct:
        ct[0] = _after(ct[0], ct_token)
    ct = [c + p.astype(c.dtype) for c, p in zip(ct, pending)] if pending else ct
    mean, new = spec.tx.update(ct, spec.state(carrier))
    mean = tuple(_compat.vary(m, spec.axis_name) if _compat.varying_axes(p) else m
                 for m, p in zip(mean, leaves))
    ct_token = _mark(ct_token, _typed_like(mean, ct_token))
    out = spec.carrier(new)
    return (mean, tuple(_like_typed(n, o, spec.axis_name) for n, o in zip(out, carrier)),
            tuple(jnp.zeros_like(p) for p in pending), ct_token)


_attached.defvjp(_attached_fwd, _attached_bwd)


@dataclasses.dataclass(frozen=True)
class InBackwardSync:
    """A compressed mean of the gradient, exchanged inside the backward pass bucket by
    bucket (see [`sync_in_backward`][commjax.sync.sync_in_backward])."""

    compressor: Compressor
    axis_name: Any
    bucket_bytes: int
    options: tuple  # compressed_mean's keyword options, as sorted (name, value) pairs

    def _tx(self) -> optax.GradientTransformation:
        # One compressed mean per sync bucket: its state is this bucket's, on every backend.
        return compressed_mean(self.compressor, self.axis_name, bucket_bytes=None, **dict(self.options))

    def buckets(self, params: Any) -> list[list[int]]:
        """The leaf indices (in ``tree_leaves`` order) of each bucket of ``params``."""
        return _buckets(jax.tree_util.tree_leaves(params), self.bucket_bytes)

    def init(self, params: Any) -> tuple:
        """One ``compressed_mean`` state per bucket of ``params`` (one replica's; call it
        inside ``shard_map``, or lay it out with [`commjax.init_sharded`][] through
        [`as_transform`][commjax.sync.InBackwardSync.as_transform])."""
        leaves = jax.tree_util.tree_leaves(params)
        tx = self._tx()
        return tuple(tx.init([leaves[i] for i in b]) for b in self.buckets(params))

    def _specs(self, state: tuple) -> list[_Bucket]:
        out = []
        for s in state:
            flat, tdef = jax.tree_util.tree_flatten(s)
            like = tuple((tuple(jnp.shape(x)), jnp.result_type(x)) for x in flat)
            out.append(_Bucket(self._tx(), tdef, like, self.axis_name))
        return out

    def carrier(self, state: tuple) -> tuple:
        """The state as the differentiable inputs of [`attach`][commjax.sync.InBackwardSync.attach]."""
        return tuple(spec.carrier(s) for spec, s in zip(self._specs(state), state))

    def attach(self, params: Any, carrier: tuple, state: tuple, *, pending: Any = None,
               order: Optional[Sequence[int]] = None) -> Any:
        """``params``, unchanged (marked varying over the axis); differentiated, each
        bucket's gradient comes back as its compressed mean (replicated, for replicated
        ``params``: no ``cj.vary`` needed), and the gradient with respect to ``carrier`` as
        the new state (read it with [`restore`][commjax.sync.InBackwardSync.restore]).
        ``pending``: gradients accumulated over earlier micro-steps (a tree like
        ``params``), added to this one's before the exchange.

        ``order``: the bucket indices in the order the backward pass completes their
        gradients ([`exchange_order`][commjax.sync.InBackwardSync.exchange_order]). Each
        bucket's exchange then starts once the one before it has its mean, so XLA keeps
        their collectives apart, each beside the backward pass still to run. ``None``: no
        order between buckets (XLA may merge their collectives)."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        extra = None if pending is None else jax.tree_util.tree_leaves(pending)
        buckets = self.buckets(params)
        if len(buckets) != len(state):
            raise ValueError(f"sync_in_backward: the state has {len(state)} buckets and these "
                             f"parameters make {len(buckets)}: make it with sync.init(params) for "
                             "the same parameters and bucket_bytes.")
        chained = order is not None
        order = list(range(len(buckets))) if order is None else [int(b) for b in order]
        if sorted(order) != list(range(len(buckets))):
            raise ValueError(f"sync_in_backward: `order` must list each of the {len(buckets)} "
                             f"bucket indices once; got {order}.")
        specs, out = self._specs(state), list(leaves)
        token = jnp.zeros((), jnp.float32)
        for k in reversed(order):  # the forward pass attaches in reverse: the VJPs run in order
            b = buckets[k]
            more = () if extra is None else tuple(jax.lax.stop_gradient(extra[i]) for i in b)
            vals, token = _attached(specs[k], tuple(leaves[i] for i in b), tuple(carrier[k]), more,
                                    token if chained else jnp.zeros((), jnp.float32))
            for i, v in zip(b, vals):
                out[i] = v
        return jax.tree_util.tree_unflatten(treedef, out)

    def exchange_order(self, fun: Callable[..., Any], params: Any, *args: Any) -> list[int]:
        """The bucket indices of ``params`` in the order the backward pass of
        ``fun(params, *args)`` completes their gradients: a leaf's gradient is complete
        once the backward pass reaches its *first* use in the forward pass, so buckets go
        by their earliest first use, latest first (what PyTorch DDP learns by watching its
        first step; here read from the traced program). Unused leaves count as ready at
        once; ties keep tree order."""
        n = len(jax.tree_util.tree_leaves(params))
        bound = _compat.axis_is_bound(self.axis_name)  # also callable outside shard_map
        uses = _compat.first_uses(fun, _compat.vary(params, self.axis_name) if bound else params, *args)[:n]
        buckets = self.buckets(params)
        ready = [min(uses[i] for i in b) for b in buckets]
        return sorted(range(len(buckets)), key=lambda k: (-ready[k], k))

    def restore(self, state: tuple, carrier_grad: tuple) -> tuple:
        """The new state from the gradient with respect to the carrier."""
        return tuple(spec.state(c) for spec, c in zip(self._specs(state), carrier_grad))

    def value_and_grad(self, fun: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
        """``jax.value_and_grad(fun)`` with the exchange in its backward pass:
        ``(params, state, *args, pending=None, exchange=True) -> ((value, grads),
        new_state)`` (``value`` is ``(loss, aux)`` with ``has_aux``), ``grads`` the
        compressed mean, identical on every replica. Call it inside ``shard_map`` over
        ``axis_name`` with replicated ``params``.

        Gradient accumulation: ``exchange=False`` (a Python bool) on the micro-steps before
        the last returns this replica's own gradient (for a ``cj.vary``'d sum) and the state
        unchanged; the last micro-step passes their sum as ``pending`` and exchanges
        ``pending + g`` once."""

        def wrapped(params: Any, state: tuple, *args: Any, pending: Any = None, exchange: bool = True):
            if not exchange:
                value, grads = jax.value_and_grad(fun, has_aux=has_aux)(
                    _compat.vary(params, self.axis_name), *args)
                return (value, grads), state

            order = self.exchange_order(fun, params, *args)

            def inner(p, carrier, *a):
                return fun(self.attach(p, carrier, state, pending=pending, order=order), *a)

            value, (grads, carrier_grad) = jax.value_and_grad(inner, argnums=(0, 1), has_aux=has_aux)(
                params, self.carrier(state), *args)
            return (value, grads), self.restore(state, carrier_grad)

        return wrapped

    def as_transform(self) -> optax.GradientTransformation:
        """The same exchange as a transform run *after* the backward pass (bucket by bucket,
        bit for bit what the backward pass computes): for comparison, and for laying the
        state out ([`commjax.init_sharded`][], [`commjax.data_parallel`][])."""

        def update(grads, state, params=None):
            del params
            leaves, treedef = jax.tree_util.tree_flatten(grads)
            out, new = list(leaves), []
            for b, s, spec in zip(self.buckets(grads), state, self._specs(state)):
                mean, s2 = spec.tx.update([leaves[i] for i in b], s)
                new.append(s2)
                for i, m in zip(b, mean):
                    out[i] = m
            return jax.tree_util.tree_unflatten(treedef, out), tuple(new)

        return optax.GradientTransformation(self.init, update)


def sync_in_backward(compressor: Compressor, axis_name: Any = "data", *,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options: Any) -> InBackwardSync:
    """The compressed gradient mean, exchanged in the backward pass (module docstring).

    Args:
      compressor: any codec of [`compressed_mean`][commjax.compressed_mean].
      axis_name: the data-parallel mesh axis (bound by ``shard_map`` where it runs).
      bucket_bytes: consecutive parameters are exchanged together up to this many bytes of
        gradient (DDP's ``bucket_cap_mb``, 25 MB by default): small leaves do not each pay
        a collective's latency, large ones go alone.
      **options: ``compressed_mean``'s keyword options (``reducer``, ``error_feedback``,
        ``residual_dtype``, ...), the same for every bucket.

    Example::

        sync = cj.sync_in_backward(cj.quantize(bits=8), "data")
        (loss, grads), sync_state = sync.value_and_grad(loss_fn)(params, sync_state, batch)
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"sync_in_backward: `compressor` must be a commjax codec such as "
                        f"cj.quantize(bits=8); got {compressor!r}.")
    validation.check_int("bucket_bytes", bucket_bytes, 1, factory="sync_in_backward")
    compressed_mean(compressor, axis_name, bucket_bytes=None, **options)  # the options' own checks
    return InBackwardSync(compressor, axis_name, int(bucket_bytes), tuple(sorted(options.items())))
