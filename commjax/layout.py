"""Laying out optimizer state for ``shard_map`` and ``pmap``.

Optimizer state has two kinds of leaves:

* **replicated** leaves (step counters, PRNG keys, PowerSGD's Q, the inner optimizer's
  moments): identical on every replica; ``PartitionSpec()`` under ``shard_map``;
* **per-replica** leaves (error-feedback residuals, gradient accumulators): each replica
  owns its own value. Inside the update a per-replica leaf has its local shape
  ``[a, ...]``; outside, the replicas' values are concatenated along axis 0 into a global
  ``[N * a, ...]`` array with ``PartitionSpec(axis_name)``.

Which leaves are per replica is found by **tracing** ``tx.init`` and ``tx.update`` under
``shard_map`` ([`infer_per_replica`][commjax.layout.infer_per_replica]): a leaf that the update
computes from this
replica's gradients without a collective that makes it identical everywhere varies over
the axis, and so is per replica ([`commjax.varying`][]). That holds for any optax
transform, wrapper or chain (``optax.MultiSteps``, ``optax.inject_hyperparams``,
``flax.nnx.Optimizer``'s state, third-party ones) with nothing to register::

    opt_state = cj.init_sharded(tx, params, mesh, "data")   # traced, placed, global
    specs = cj.state_specs(opt_state, "data")                 # read back from the placement
    step = jax.jit(jax.shard_map(train_step, mesh=mesh,
                                 in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs)))

A state that is already placed on a mesh (by [`init_sharded`][commjax.layout.init_sharded],
[`shard_state`][commjax.layout.shard_state]
or a step's outputs) carries its layout in its shardings, and
[`state_specs`][commjax.layout.state_specs] and
[`per_replica_mask`][commjax.layout.per_replica_mask] read it from there. Only a bare local state
with no
transform to trace (``cj.shard_state(tx.init(params), mesh, axis)``) falls back to the
fields that commjax's own state classes declare per replica
([`per_replica`][commjax.layout.per_replica]);
pass ``tx=`` and ``params=`` to [`shard_state`][commjax.layout.shard_state] to trace instead.

Under ``pmap`` every leaf gets a leading device axis instead
([`pmap_state`][commjax.layout.pmap_state]).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from commjax import _compat
from commjax.varying import trace_varying, varying_of

__all__ = [
    "infer_per_replica",
    "trace_update",
    "carry_layout",
    "place",
    "specs_from_mask",
    "init_laid_out",
    "with_leading_axis",
    "per_replica",
    "per_replica_mask",
    "state_specs",
    "shard_state",
    "pmap_state",
    "unshard_state",
    "init_sharded",
]

_PER_REPLICA_FIELDS: dict[type, frozenset[str]] = {}


def per_replica(*fields: str) -> Callable[[type], type]:
    """Class decorator: mark NamedTuple ``fields`` of a state class as per-replica."""

    def register(cls: type) -> type:
        missing = [f for f in fields if f not in getattr(cls, "_fields", ())]
        if missing:
            raise TypeError(f"{cls.__name__} has no fields {missing}")
        _PER_REPLICA_FIELDS[cls] = frozenset(fields)
        return cls

    return register


def _map_marked(fn: Callable[[Any, bool], Any], tree: Any, marked: bool = False) -> Any:
    """Apply ``fn(leaf, is_per_replica)`` over ``tree``, keeping its structure."""
    fields = _PER_REPLICA_FIELDS.get(type(tree))
    if fields is not None:
        return type(tree)(
            *(_map_marked(fn, getattr(tree, f), marked or f in fields) for f in tree._fields)
        )
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map_marked(fn, v, marked) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_marked(fn, v, marked) for v in tree)
    if isinstance(tree, dict):
        return type(tree)((k, _map_marked(fn, v, marked)) for k, v in tree.items())
    if tree is None:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:
        return fn(tree, marked)
    # Another pytree node (a flax struct, say): recurse into its direct children.
    children, node = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)
    return jax.tree_util.tree_unflatten(node, [_map_marked(fn, c, marked) for c in children])


def _placed_spec(leaf: Any) -> Optional[P]:
    """The ``PartitionSpec`` of a leaf placed on a mesh, None for any other leaf."""
    sharding = getattr(leaf, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else None


def _single(leaf: Any, axis_name: Any) -> bool:
    """Whether ``leaf`` is placed on a mesh whose ``axis_name`` has one device: ``jit``
    hands a ``P(axis)`` output back as ``P()`` there, so its placement tells nothing."""
    mesh = leaf.sharding.mesh
    names = _axis_names(axis_name) if axis_name is not None else frozenset(mesh.axis_names)
    return all(mesh.shape.get(a, 1) == 1 for a in names)


def with_leading_axis(x: Any) -> jax.Array:
    """``x`` as a per-replica state leaf holds it: a scalar as ``[1]`` (the replicas' values
    are laid out along the leading axis, which a scalar lacks); any other array as it is.
    A transform reads it back with ``reshape`` to the shape it mirrors."""
    x = jnp.asarray(x)
    return x.reshape(1) if x.ndim == 0 else x


def _first_axis(spec: P) -> Any:
    return spec[0] if len(spec) else None


def _reads_placement(state: Any, axis_name: Any) -> bool:
    """Whether the shardings of ``state`` tell its layout: with ``axis_name`` given, always
    (for its placed leaves); without, only if some placed leaf is replicated (a ``pmap``
    state puts *every* leaf on its device axis, which says nothing about replication)."""
    if axis_name is not None:
        return True
    specs = [_placed_spec(l) for l in jax.tree_util.tree_leaves(state)]
    return any(s is not None and _first_axis(s) is None for s in specs)


def per_replica_mask(state: Any, axis_name: Any = None) -> Any:
    """A pytree of bools shaped like ``state``: True where the leaf is per replica.

    Leaves placed on a mesh answer from their sharding (sharded over the axis along
    dimension 0: per replica; ``P()``: replicated), whatever transform made them. Other
    leaves (a local state fresh from ``tx.init``, tracers) answer from the fields commjax's
    state classes declare ([`per_replica`][commjax.layout.per_replica]); use
    [`infer_per_replica`][commjax.layout.infer_per_replica] to trace
    an arbitrary transform instead.
    """
    read = _reads_placement(state, axis_name)

    def one(leaf: Any, marked: bool) -> bool:
        spec = _placed_spec(leaf) if read else None
        if spec is None or _single(leaf, axis_name):
            return marked
        first = _first_axis(spec)
        if first is None:
            return False
        if axis_name is None or first == axis_name or _axis_names(first) & _axis_names(axis_name):
            return True  # over the axis, or some of its axes (with a model axis: tiled over both)
        return marked  # sharded over another axis (a pmap device axis, say): not ours

    return _map_marked(one, state)


def _check_laid_out(state: Any, axis_name: Any) -> None:
    """Refuse a local state (as ``tx.init`` returns it: concrete arrays on one device,
    none placed on a mesh) whose state classes declare per-replica leaves: ``P(axis)``
    would split one replica's values over the replicas (on more than one device)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    one_device = [isinstance(getattr(l, "sharding", None), SingleDeviceSharding) for _, l in flat]
    if jax.device_count() == 1 or not flat or not all(one_device):
        return  # placed, abstract or traced: nothing to tell
    marked = jax.tree_util.tree_leaves(_map_marked(lambda leaf, m: m, state))
    first = next(((p, l) for (p, l), m in zip(flat, marked) if m), None)
    if first is not None:
        raise ValueError(
            f"state_specs: `state` is a local state, as tx.init(params) returns it: its per-replica "
            f"leaves (such as {jax.tree_util.keystr(first[0])}, shape {tuple(first[1].shape)}) hold "
            f"one replica's values, and P({axis_name!r}) would split them over the replicas. Lay it "
            f"out first: state = cj.init_sharded(tx, params, mesh, {axis_name!r}) (or "
            f"cj.shard_state(state, mesh, {axis_name!r}, tx=tx, params=params)).")


def state_specs(state: Any, axis_name: Any) -> Any:
    """``PartitionSpec``s for ``state``: ``P(axis_name)`` per replica, ``P()`` replicated
    (see [`per_replica_mask`][commjax.layout.per_replica_mask] for how that is decided); a leaf
    placed over other mesh
    axes too (a model-parallel state, [`init_sharded`][commjax.layout.init_sharded]) keeps its
    placement's spec.

    Raises:
      ValueError: ``state`` is a local state fresh from ``tx.init`` (concrete arrays none of
        which is placed on a mesh, some declared per replica), on more than one device: lay
        it out with [`init_sharded`][commjax.layout.init_sharded] or
        [`shard_state`][commjax.layout.shard_state] first.
    """
    _check_laid_out(state, axis_name)
    mask = per_replica_mask(state, axis_name)
    names = _axis_names(axis_name)

    def one(leaf: Any, m: bool) -> P:
        spec = _placed_spec(leaf)
        placed = _spec_axes(spec) if spec is not None else frozenset()
        # Over other mesh axes too, or over some of axis_name's axes only (a residual
        # shared by a group averaged exactly first): the placement is the layout.
        if placed - names or (placed and placed < names and not _single(leaf, names - placed)):
            return spec
        return P(axis_name) if m else P()

    return jax.tree_util.tree_map(one, state, mask)


def specs_from_mask(mask: Any, axis_name: Any) -> Any:
    """``P(axis_name)`` where ``mask`` is True, ``P()`` elsewhere (for in/out specs)."""
    return jax.tree_util.tree_map(lambda m: P(axis_name) if m else P(), mask)


def _mesh_axis_size(mesh: jax.sharding.Mesh, axis_name: Any, where: str = "shard_state") -> int:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    missing = [n for n in names if n not in mesh.shape]
    if missing:
        raise ValueError(f"{where}: `axis_name` {axis_name!r} names axes {missing} that the mesh "
                         f"does not have (its axes: {tuple(mesh.axis_names)}).")
    return int(np.prod([mesh.shape[n] for n in names]))


def place(leaf: Any, marked: bool, mesh: jax.sharding.Mesh, axis_name: Any, n: int) -> Any:
    """One leaf as a global array: tiled ``n`` times along axis 0 if per replica."""
    value = np.asarray(leaf)
    if marked and value.size == 0:
        # jit hands empty outputs back replicated; placing them so avoids a recompile.
        marked = False
    if marked:
        if value.ndim == 0:
            raise ValueError(
                "shard_state: a per-replica state leaf is a scalar; per-replica leaves need a "
                "leading dimension to concatenate the replicas' values along (give the leaf "
                "shape [1] in the transform's init).")
        shape = (value.shape[0] * n,) + value.shape[1:]
        # Every shard starts as this process's local value. Building shards from a
        # callback (not device_put of a host array) avoids a cross-process equality
        # check of the whole tiled state when the mesh spans processes.
        return jax.make_array_from_callback(
            shape, NamedSharding(mesh, P(axis_name)), lambda idx: value)
    return jax.make_array_from_callback(
        value.shape, NamedSharding(mesh, P()), lambda idx: value[idx])


def shard_state(state: Any, mesh: jax.sharding.Mesh, axis_name: Any, *,
                tx: Any = None, params: Any = None, per_replica_params: bool = False) -> Any:
    """Turn a freshly initialised local state into global arrays laid out for ``shard_map``.

    Per-replica leaves (identical at init on every replica) are tiled ``N`` times along
    axis 0 and sharded ``P(axis_name)``; replicated leaves are placed ``P()``. Which is
    which: traced from ``tx`` when ``tx`` and ``params`` are given
    ([`infer_per_replica`][commjax.layout.infer_per_replica]), else the fields commjax's state
    classes declare.
    Prefer [`init_sharded`][commjax.layout.init_sharded], which also sizes the state for the mesh.
    """
    n = _mesh_axis_size(mesh, axis_name)
    if tx is None:
        if params is not None:
            raise ValueError("shard_state: `params` is only used with `tx` (to trace "
                             "tx.update); pass both or neither.")
        return _map_marked(lambda leaf, m: place(leaf, m, mesh, axis_name, n), state)
    if params is None:
        raise ValueError("shard_state: tracing `tx` needs `params` (the parameters the state "
                         "was made for); pass params=..., or call cj.init_sharded(tx, params, "
                         "mesh, axis_name).")
    mask = infer_per_replica(tx, params, mesh, axis_name, per_replica_params=per_replica_params)
    return jax.tree_util.tree_map(lambda leaf, m: place(leaf, m, mesh, axis_name, n), state, mask)


def unshard_state(state: Any, replica: int = 0) -> Any:
    """The local view of one replica (``replica``) of a
    [`shard_state`][commjax.layout.shard_state]-laid state.

    Only the *shape* of the local view is needed to know how to slice: per-replica leaves
    are cut into equal parts along axis 0 using the mesh size they were sharded over.
    """

    def take(leaf: Any, marked: bool) -> Any:
        if not marked:
            return leaf
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", None)
        mesh = getattr(sharding, "mesh", None)
        if spec is None or mesh is None or not spec or spec[0] is None:
            return leaf
        n = _mesh_axis_size(mesh, spec[0], "unshard_state")
        if not 0 <= replica < n:
            raise ValueError(f"unshard_state: `replica` must be in [0, {n}) (the replicas of "
                             f"axis {spec[0]!r}); got {replica!r}.")
        a = leaf.shape[0] // n
        return leaf[replica * a:(replica + 1) * a]

    return jax.tree_util.tree_map(take, state, per_replica_mask(state))


def pmap_state(state: Any, num_devices: Optional[int] = None) -> Any:
    """Give every leaf a leading device axis of size ``num_devices`` (default: all local
    devices), as ``jax.pmap`` expects. Per-replica and replicated leaves alike: at init
    they are identical on every replica.

    ``num_devices`` must be the number of devices the ``pmap`` runs on: fewer than all
    local devices only with ``jax.pmap(step, devices=jax.local_devices()[:num_devices])``.
    A state laid out for another count is refused by ``jax.pmap`` itself, before any
    commjax code runs, with JAX's error (``IndivisibleError: ... implies that array axis 0
    is partitioned 8 times, but the dimension size is 4``): lay the state out again with
    the pmap's device count."""
    n = jax.local_device_count() if num_devices is None else num_devices
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= jax.local_device_count():
        raise ValueError(f"pmap_state: `num_devices` must be an integer in [1, "
                         f"{jax.local_device_count()}] (this process's devices); got {num_devices!r}. "
                         "It must equal the number of devices the pmap'd step runs on.")
    stacked = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), state)
    # Place the arrays as pmap outputs are placed, so the first step does not compile twice.
    return jax.pmap(lambda t: t, devices=jax.local_devices()[:n])(stacked)


# ------------------------------------------------------------------- layout by tracing


def _axis_names(axis_name: Any) -> frozenset:
    many = isinstance(axis_name, (tuple, list, set, frozenset))
    return frozenset(axis_name) if many else frozenset({axis_name})


def _local_abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def carry_layout(step: Callable[..., Any], carry: Any, args: tuple, args_axes: tuple,
                 mesh: jax.sharding.Mesh, carry_axes: Any = None) -> tuple[list, list]:
    """The mesh axes each leaf of a loop-carried ``carry`` varies over, at the fixed point
    of ``carry, *out = step(carry, *args)`` traced under ``shard_map`` over ``mesh``.

    ``args_axes`` gives the axes each argument varies over (a frozenset per argument, or
    a pytree prefix of it); ``carry_axes`` the starting guess for the carry (default: all
    replicated). A carry leaf that comes out varying must go in varying on the next
    step, which can make more leaves vary: repeat until nothing changes (at most once per
    leaf). Returns ``(carry leaf axes, axes of the other outputs' leaves)``, flattened.
    """
    carry = _local_abstract(carry)
    n = len(jax.tree_util.tree_leaves(carry))
    treedef = jax.tree_util.tree_structure(carry)
    axes = list(carry_axes) if carry_axes is not None else [frozenset()] * n
    # One trace; the fixed point is over the dataflow pass alone.
    varying = varying_of(step, (carry,) + tuple(args), mesh)
    for _ in range(n + 1):
        tree = jax.tree_util.tree_unflatten(treedef, axes)
        outs = varying((tree,) + tuple(args_axes))
        new = [a | o for a, o in zip(axes, outs[:n])]
        if new == axes:
            return axes, outs[n:]
        axes = new
    raise AssertionError("carry_layout: no fixed point")  # pragma: no cover - monotone


class _ParamLayout(NamedTuple):
    """How the parameters lie inside the ``shard_map``: per leaf its path, its spec over
    the manual axes other than the data axes (``P()`` if none), its local (shard) shape
    and the axes it is split over."""

    paths: list
    specs: Any  # a pytree of PartitionSpecs like the parameters
    local: Any  # abstract local values
    axes: list  # frozenset per leaf


def _spec_axes(spec: P) -> frozenset:
    out: set = set()
    for entry in spec:
        out |= set(entry) if isinstance(entry, (tuple, list)) else ({entry} if entry else set())
    return frozenset(out)


def _param_layout(params: Any, mesh: jax.sharding.Mesh, names: frozenset,
                  manual: frozenset) -> _ParamLayout:
    """Parameters placed with a ``NamedSharding`` over other manual axes (a model axis)
    are split there: each device traces its shard. Placements over axes left to the
    compiler, and unplaced parameters, are whole."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths, specs, local, axes = [], [], [], []
    for path, leaf in flat:
        spec = _placed_spec(leaf)
        kept = P() if spec is None else P(*[
            e if (set(e) if isinstance(e, (tuple, list)) else {e}) <= manual else None
            for e in spec])
        split = _spec_axes(kept)
        if split & names:
            raise ValueError(
                f"init_sharded: parameter {jax.tree_util.keystr(path)} is split over "
                f"{sorted(split & names)}, the axes its gradient is averaged over; shard "
                "parameters over the data axis with cj.zero or cj.fsdp_gather instead.")
        shape = tuple(jnp.shape(leaf))
        if split:
            shape = NamedSharding(mesh, kept).shard_shape(shape)
        paths.append(jax.tree_util.keystr(path))
        specs.append(kept)
        local.append(jax.ShapeDtypeStruct(shape, jnp.result_type(leaf)))
        axes.append(split)
    return _ParamLayout(paths, jax.tree_util.tree_unflatten(treedef, specs),
                        jax.tree_util.tree_unflatten(treedef, local), axes)


def _tx_layout(tx: Any, params: Any, mesh: jax.sharding.Mesh, per_replica_params: bool,
               pl: _ParamLayout, manual: frozenset) -> tuple[Any, list, list]:
    """``(local abstract state, state leaf axes, update leaf axes)`` of ``tx`` traced on
    gradients that vary over every manual mesh axis, except the model axes (those some
    parameter is split over) for the parameters that are whole there: the gradient of a
    parameter replicated over a model axis is the same on all of its devices."""
    treedef = jax.tree_util.tree_structure(params)
    split = jax.tree_util.tree_unflatten(treedef, pl.axes)
    model = frozenset().union(*pl.axes)
    g_axes = jax.tree_util.tree_unflatten(treedef, [(manual - model) | a for a in pl.axes])
    p_axes = jax.tree_util.tree_unflatten(treedef, [manual if per_replica_params else a for a in pl.axes])
    # init runs once, on the common starting parameters: replicated even when the
    # replicas go on to hold their own.
    init_axes = trace_varying(tx.init, (pl.local,), (split,), mesh)
    state = jax.eval_shape(_compat.shard_map(tx.init, mesh=mesh, in_specs=(pl.specs,), out_specs=P(),
                                             check_vma=False), _local_abstract(params))

    def update(s, g, p):
        u, s = tx.update(g, s, p)
        return s, u

    axes, upd = carry_layout(update, state, (pl.local, pl.local), (g_axes, p_axes), mesh, init_axes)
    return state, axes, upd


def _check_trace_args(where: str, tx: Any, mesh: Any, axis_name: Any) -> None:
    """The transform, mesh and axis a layout trace needs, with the fix in the message."""
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"{where}: `tx` must be an optax transform (with init and update), "
                        f"got {tx!r}.")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"{where}: `mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    missing = sorted(_axis_names(axis_name) - set(mesh.axis_names))
    if missing:
        raise ValueError(f"{where}: `axis_name` {axis_name!r} names axes {missing} that the mesh "
                         f"does not have (its axes: {tuple(mesh.axis_names)}).")


def infer_per_replica(tx: Any, params: Any, mesh: jax.sharding.Mesh, axis_name: Any, *,
                      per_replica_params: bool = False, manual_axes: Any = None) -> Any:
    """Which leaves of ``tx``'s state are per replica, found by tracing (never running)
    ``tx.init`` and ``tx.update`` inside ``shard_map`` over ``mesh``.

    The gradients vary over every manual mesh axis (``manual_axes``, default all: each
    replica differentiates its own batch); the parameters are replicated unless
    ``per_replica_params`` (DiLoCo-style replicas that hold their own parameters), or
    split where they are placed with a ``NamedSharding`` over another manual axis (a
    tensor-parallel model axis: each device then traces its shard). A state leaf is per
    replica when, at the fixed point of ``state -> update(grads, state)``, it varies over
    ``axis_name`` ([`carry_layout`][commjax.layout.carry_layout], [`commjax.varying`][]).

    Returns a pytree of bools shaped like ``tx.init(params)`` (as initialised inside
    ``shard_map``, so sized for this mesh).

    Raises:
      ValueError: a state leaf varies over a mesh axis outside ``axis_name`` and the
        parameters' axes (it cannot be laid out ``P(axis_name)``), naming the leaf.
    """
    return trace_update(tx, params, mesh, axis_name, per_replica_params=per_replica_params,
                        manual_axes=manual_axes)[0]


class _Trace(NamedTuple):
    state: Any  # local abstract state
    axes: list  # per state leaf: the axes it varies over
    paths: list
    declared: list  # per state leaf: declared per replica by its state class
    varies: list  # the paths of the update leaves that vary over axis_name
    params: _ParamLayout


def _manual(mesh: jax.sharding.Mesh, manual_axes: Any) -> frozenset:
    if manual_axes is None:
        return frozenset(mesh.axis_names)
    manual = _axis_names(manual_axes)
    missing = sorted(manual - set(mesh.axis_names))
    if missing:
        raise ValueError(f"trace_update: `manual_axes` names axes {missing} that the mesh does not "
                         f"have (its axes: {tuple(mesh.axis_names)}).")
    return manual


def _trace(tx: Any, params: Any, mesh: jax.sharding.Mesh, axis_name: Any,
           per_replica_params: bool, manual_axes: Any) -> _Trace:
    _check_trace_args("trace_update", tx, mesh, axis_name)
    names, manual = _axis_names(axis_name), _manual(mesh, manual_axes)
    pl = _param_layout(params, mesh, names, manual)
    state, axes, upd = _tx_layout(tx, params, mesh, per_replica_params, pl, manual)
    model = frozenset().union(*pl.axes)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    shapes = [l.shape for l in jax.tree_util.tree_leaves(state)]
    for path, a, shape in zip(paths, axes, shapes):
        if a & names and not shape:
            raise ValueError(
                f"infer_per_replica: state leaf {path} is a scalar that differs between "
                f"replicas over {sorted(a & (names | model))} (it is computed from this "
                "replica's own gradient), so replicas would disagree on it, and a scalar "
                "cannot be laid out per replica. This is usually a decision taken on each "
                "replica before the exchange: put optax.apply_if_finite (or any wrapper that "
                "tests the gradient) *after* cj.compressed_mean in the chain, not around it.")
        if a & model and not shape:
            raise ValueError(
                f"infer_per_replica: state leaf {path} is a scalar that differs between the "
                f"devices of {sorted(a & model)}, over which the parameters are split: each "
                "computes it from its own shard (a step counter advanced only on a finite "
                "step, a norm of the whole leaf), so the shards would disagree on it. This "
                "transform does not run on split parameters: place them whole (P()) on "
                f"{sorted(a & model)}, or use one that works shard by shard "
                "(cj.compressed_mean, cj.zero, cj.dgc).")
        if (a - names - model) and not (a & names):
            raise ValueError(
                f"infer_per_replica: state leaf {path} varies over mesh axes "
                f"{sorted(a - names - model)} but not over `axis_name` {axis_name!r}, so it "
                f"cannot be laid out P({axis_name!r}). Pass every axis the gradients are "
                "averaged over as `axis_name` (a tuple), average over the others inside the "
                "transform, or leave those axes to the compiler (`manual_axes`).")
    # A transform may also *declare* fields per replica (commjax's own metrics, which it
    # types as varying under check_vma=True so that every branch of a cond agrees): a cast
    # that check_vma=False tracing does not record, so the declaration joins the result.
    declared = jax.tree_util.tree_leaves(_map_marked(lambda leaf, m: m, state))
    return _Trace(state, axes, paths, declared, [p for p, a in zip(pl.paths, upd) if a & names], pl)


def trace_update(tx: Any, params: Any, mesh: jax.sharding.Mesh, axis_name: Any, *,
                 per_replica_params: bool = False, manual_axes: Any = None) -> tuple[Any, list]:
    """``(per-replica mask of the state, the paths of the update leaves that vary over
    axis_name)`` from one trace of ``tx`` ([`infer_per_replica`][commjax.layout.infer_per_replica]).
    Updates that vary with replicated parameters are not averaged: the replicas would
    drift apart."""
    t = _trace(tx, params, mesh, axis_name, per_replica_params, manual_axes)
    names = _axis_names(axis_name)
    sizes = [int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(t.state)]
    # Empty leaves hold nothing per replica; jit hands them back replicated.
    mask = [bool(a & names or d) and size > 0 for a, d, size in zip(t.axes, t.declared, sizes)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(t.state), mask), t.varies


def _leaf_spec(t: _Trace, k: int, per: bool, axis_name: Any, mesh: jax.sharding.Mesh) -> P:
    """Where state leaf ``k`` lies: ``P(axis_name)`` / ``P()`` as on a data-only mesh (a
    per-replica leaf that varies over some of several data axes only, over those); a
    leaf that also varies over the parameters' (model) axes takes the spec of the
    parameter it mirrors (same path ending, shape and axes: Adam's moments), else is
    tiled along its first dimension over every axis it varies over."""
    model = t.axes[k] & frozenset().union(*t.params.axes)
    if not model:
        if not per:
            return P()
        # Over the axes of axis_name the leaf varies over (all of them, or, for a state
        # shared by an exactly averaged group, some).
        own = tuple(n for n in mesh.axis_names if n in (t.axes[k] & _axis_names(axis_name)))
        if not own or len(own) == len(_axis_names(axis_name)):
            return P(axis_name)
        return P(own if len(own) > 1 else own[0])
    shape = tuple(jax.tree_util.tree_leaves(t.state)[k].shape)
    if not per:
        specs = jax.tree_util.tree_leaves(t.params.specs, is_leaf=lambda x: isinstance(x, P))
        for path, spec, local, axes in zip(t.params.paths, specs,
                                           jax.tree_util.tree_leaves(t.params.local), t.params.axes):
            if t.paths[k].endswith(path) and shape == tuple(local.shape) and axes == model:
                return spec
    tiled = model | (_axis_names(axis_name) if per else frozenset())
    ordered = tuple(n for n in mesh.axis_names if n in tiled)
    return P(ordered if len(ordered) > 1 else ordered[0])


def state_layout(tx: Any, params: Any, mesh: jax.sharding.Mesh, axis_name: Any, *,
                 per_replica_params: bool = False, manual_axes: Any = None) -> tuple[Any, Any]:
    """``(state specs, parameter specs)`` for a ``shard_map`` manual over ``manual_axes``
    (default: all): per-replica leaves ``P(axis_name)``, replicated ones ``P()``, and on a
    mesh whose parameters are split over a model axis (placed with a ``NamedSharding``),
    the model-split leaves as ``_leaf_spec`` says. The parameter specs are the
    ``in_specs`` of the parameters (``P()`` where they are whole)."""
    t = _trace(tx, params, mesh, axis_name, per_replica_params, manual_axes)
    names = _axis_names(axis_name)
    sizes = [int(np.prod(l.shape)) for l in jax.tree_util.tree_leaves(t.state)]
    specs = [_leaf_spec(t, k, bool(a & names or d) and size > 0, axis_name, mesh)
             for k, (a, d, size) in enumerate(zip(t.axes, t.declared, sizes))]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(t.state), specs), t.params.specs


def init_sharded(tx: Any, params: Any, mesh: jax.sharding.Mesh, axis_name: Any, *,
                 per_replica_params: bool = False, mask: Any = None, manual_axes: Any = None) -> Any:
    """``tx.init(params)`` run inside ``shard_map`` over ``axis_name`` and laid out for it:
    per-replica leaves (found by tracing, [`infer_per_replica`][commjax.layout.infer_per_replica])
    as global
    ``[N * a, ...]`` arrays sharded ``P(axis_name)``, the rest replicated ``P()``.

    Inside ``shard_map`` the axis is bound, so state whose size depends on the number of
    replicas (the two-phase reducer's server residual) is sized for this mesh without a
    ``num_replicas`` argument. ``params`` are one replica's (local) parameters. ``mask``:
    a per-replica mask already traced ([`trace_update`][commjax.layout.trace_update]), to skip
    tracing again.

    Model-parallel meshes: parameters placed with a ``NamedSharding`` over another axis
    (``P(None, "model")``) are initialised shard by shard, and the state follows them
    ([`state_layout`][commjax.layout.state_layout]): for a ``shard_map`` manual over every axis.
    With
    ``manual_axes=axis_name`` the other axes are left to the compiler (``jax.jit`` with
    ``NamedSharding``, as [`commjax.data_parallel`][] runs) and the state is laid out
    as on a data-only mesh.
    """
    manual = _manual(mesh, manual_axes)
    pl = _param_layout(params, mesh, _axis_names(axis_name), manual)
    if any(pl.axes) or mask is None:
        specs, pspecs = state_layout(tx, params, mesh, axis_name, per_replica_params=per_replica_params,
                                     manual_axes=manual_axes)
    else:
        specs, pspecs = specs_from_mask(mask, axis_name), pl.specs
    return init_laid_out(tx, params, mesh, specs, pspecs, manual_axes)


def init_laid_out(tx: Any, params: Any, mesh: jax.sharding.Mesh, specs: Any, param_specs: Any,
                  manual_axes: Any = None) -> Any:
    """``tx.init(params)`` inside ``shard_map``, its state placed with ``specs`` (as
    [`state_layout`][commjax.layout.state_layout] returns them with ``param_specs``)."""
    fn = _compat.shard_map(tx.init, mesh=mesh, in_specs=(param_specs,), out_specs=specs, check_vma=False,
                           axis_names=_manual(mesh, manual_axes))
    return jax.jit(fn)(params)
