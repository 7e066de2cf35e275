"""Which values of a traced step vary over mesh axes: a dataflow pass over its jaxpr.

Inside ``shard_map`` a value is *replicated* over an axis when every replica computes the
same bits, and *varying* when replicas may hold different values. Under
``check_vma=True`` JAX types every value this way; this module computes the same
property for a function traced with ``check_vma=False``, so that it can be asked of any
code (optax wrappers, Flax NNX optimizers, third-party transforms) without that code
having to type-check under ``check_vma=True`` first. The layout helpers use it to find
which optimizer-state leaves are per replica ([`commjax.layout.infer_per_replica`][]).

The rules, for a value ``v`` with the set ``A(v)`` of axes it varies over:

* sources: inputs declared varying (this replica's batch, its gradients) and
  ``axis_index(a)`` (varies over ``a``);
* an ordinary operation: ``A(out) = union of A(in)``;
* ``psum``/``pmax``/``pmin``/``all_gather``/``pbroadcast`` over axes ``X`` (no replica
  groups): ``A(out) = A(in) - X``: every replica receives the same result;
* ``all_to_all``/``reduce_scatter``/``ppermute``: ``A(out) = A(in) | X``: each replica
  receives its own part;
* ``cond``/``while``: the outputs also vary wherever the predicate varies (replicas may
  take different branches); loops and scans iterate their carries to a fixed point.

Operations it does not know are treated as the union of their inputs plus any axis they
name, so that an unknown collective errs towards "varying": a leaf wrongly laid out per
replica costs memory, one wrongly laid out replicated loses the other replicas' values.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import jax
from jax.extend import core as jex_core

from commjax import _compat

__all__ = ["Axes", "propagate", "trace_varying", "varying_of"]

#: The set of mesh axis names a value varies over.
Axes = frozenset

_NONE: frozenset = frozenset()

# Collectives whose result is identical on every replica of the axes they run over.
_REPLICATING = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
    "pbroadcast",
})
# Collectives (and the axis index) that give each replica its own value.
_SPLITTING = frozenset({
    "axis_index", "all_to_all", "reduce_scatter", "ppermute", "ragged_all_to_all",
    "psend", "precv",
})


def _named_axes(params: dict) -> frozenset:
    """Axis names an equation's parameters mention (``axes`` or ``axis_name``)."""
    out: set = set()
    for key in ("axes", "axis_name"):
        value = params.get(key)
        if value is None:
            continue
        for name in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(name, str):
                out.add(name)
    return frozenset(out)


def _as_jaxpr(value: Any) -> Optional[Any]:
    """The open jaxpr of a ``Jaxpr`` or ``ClosedJaxpr`` parameter, else None."""
    if isinstance(value, jex_core.ClosedJaxpr):
        return value.jaxpr
    if isinstance(value, jex_core.Jaxpr):
        return value
    return None


def propagate(jaxpr: Any, in_axes: Sequence[frozenset]) -> list[frozenset]:
    """The axes each output of ``jaxpr`` (open or closed) varies over, given its inputs'."""
    jaxpr = _as_jaxpr(jaxpr) if _as_jaxpr(jaxpr) is not None else jaxpr
    env: dict = {}

    def read(var: Any) -> frozenset:
        if isinstance(var, jex_core.Literal):
            return _NONE
        return env.get(var, _NONE)

    for var, axes in zip(jaxpr.invars, in_axes):
        env[var] = frozenset(axes)
    for eqn in jaxpr.eqns:
        outs = _equation(eqn, [read(v) for v in eqn.invars])
        for var, axes in zip(eqn.outvars, outs):
            env[var] = axes
    return [read(v) for v in jaxpr.outvars]


def _union(sets: Iterable[frozenset]) -> frozenset:
    return frozenset().union(*sets)


def _equation(eqn: Any, ins: list[frozenset]) -> list[frozenset]:
    """Output axes of one equation."""
    name = eqn.primitive.name
    params = eqn.params
    n_out = len(eqn.outvars)
    both = _union(ins)
    if name in _REPLICATING and params.get("axis_index_groups") is None:
        return [both - _named_axes(params)] * n_out
    if name in _SPLITTING:
        return [both | _named_axes(params)] * n_out
    if name in ("optimization_barrier", "commjax_barrier"):  # the identity on each operand
        return list(ins)
    if name == "cond":
        return _cond(params, ins)
    if name == "while":
        return _while(params, ins)
    if name == "scan":
        return _scan(params, ins)
    subs = [j for j in (_as_jaxpr(v) for v in params.values()) if j is not None]
    if (len(subs) == 1 and len(subs[0].invars) == len(ins)
            and len(subs[0].outvars) == n_out):
        return propagate(subs[0], ins)  # jit, remat, custom_jvp/vjp calls, nested maps
    return [both | _named_axes(params)] * n_out


def _cond(params: dict, ins: list[frozenset]) -> list[frozenset]:
    pred, ops = ins[0], ins[1:]
    outs = [propagate(branch, ops) for branch in params["branches"]]
    return [_union(parts) | pred for parts in zip(*outs)]


def _while(params: dict, ins: list[frozenset]) -> list[frozenset]:
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, carry = ins[:nc], ins[nc:nc + nb], list(ins[nc + nb:])
    while True:
        pred = propagate(params["cond_jaxpr"], cond_consts + carry)[0]
        body = propagate(params["body_jaxpr"], body_consts + carry)
        new = [c | b | pred for c, b in zip(carry, body)]
        if new == carry:
            return carry
        carry = new


def _scan(params: dict, ins: list[frozenset]) -> list[frozenset]:
    nc, ncarry = params["num_consts"], params["num_carry"]
    consts, carry, xs = ins[:nc], list(ins[nc:nc + ncarry]), ins[nc + ncarry:]
    while True:
        outs = propagate(params["jaxpr"], consts + carry + xs)
        new = [c | o for c, o in zip(carry, outs[:ncarry])]
        if new == carry:
            return carry + outs[ncarry:]
        carry = new


def trace_varying(fn: Callable[..., Any], args: Sequence[Any], in_axes: Sequence[Any],
                  mesh: Any) -> list[frozenset]:
    """Trace ``fn(*args)`` inside ``shard_map`` over ``mesh`` and return, for each leaf of
    its output (flattened), the axes it varies over.

    ``args`` are this replica's local values (arrays or ``jax.ShapeDtypeStruct``);
    ``in_axes`` gives, for each argument, a pytree prefix of it holding the axes (a
    frozenset) each of its leaves varies over. The function is only traced, never run,
    under ``check_vma=False``: code that would not type-check under ``check_vma=True``
    for a wrong guess of its inputs' layout (a ``cond`` whose branches disagree, a guard
    that refuses a replicated gradient) traces all the same. A cast that code makes
    itself (``lax.pcast(x, to="varying")`` of a replicated value) leaves no trace there:
    such *declared* per-replica fields come from [`commjax.layout.per_replica`][].
    """
    return varying_of(fn, args, mesh)(in_axes)


def varying_of(fn: Callable[..., Any], args: Sequence[Any],
               mesh: Any) -> Callable[[Sequence[Any]], list[frozenset]]:
    """``fn(*args)`` traced once, as [`trace_varying`][commjax.varying.trace_varying]
    traces it, and returned as the map ``in_axes -> axes of each output leaf``.

    The trace does not depend on the inputs' axes (nothing is typed under
    ``check_vma=False``), only the dataflow pass over it does: a fixed point over the
    inputs' layout ([`commjax.layout.carry_layout`][]) traces once and propagates as
    often as it needs."""
    flat, treedef = jax.tree_util.tree_flatten(tuple(args))

    def flat_fn(*leaves):
        return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(treedef, leaves)))

    jaxpr = _inner_jaxpr(flat_fn, flat, mesh)
    return lambda in_axes: propagate(jaxpr, _flat_axes(args, in_axes, len(flat)))


def _inner_jaxpr(flat_fn: Callable[..., Any], flat: list, mesh: Any) -> Any:
    """The jaxpr of ``flat_fn`` traced where the mesh axes are bound (inside a
    ``shard_map`` that returns nothing, so no output layout is checked)."""
    captured: list = []

    def body(*leaves):
        captured.append(jax.make_jaxpr(flat_fn)(*leaves))
        return ()

    specs = tuple(jax.sharding.PartitionSpec() for _ in flat)
    jax.make_jaxpr(_compat.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(),
                                     check_vma=False))(*flat)
    return captured[0]


def _flat_axes(args: Sequence[Any], in_axes: Sequence[Any], n: int) -> list[frozenset]:
    """One frozenset per argument leaf, from per-argument sets or pytree prefixes."""
    tree = [jax.tree_util.tree_map(lambda _, a=a: frozenset(a), arg)
            if isinstance(a, (set, frozenset)) else a for arg, a in zip(args, in_axes)]
    flat = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, frozenset))
    if len(flat) != n:
        raise ValueError(f"commjax.varying: `in_axes` gives {len(flat)} leaves for {n} "
                         "argument leaves; give one frozenset per leaf (or per argument).")
    return flat
