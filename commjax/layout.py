"""Laying out optimizer state for ``shard_map`` and ``pmap``.

Optimizer state has two kinds of leaves:

* **replicated** leaves (step counters, PRNG keys, PowerSGD's Q, the inner optimizer's
  moments): identical on every replica; ``PartitionSpec()`` under ``shard_map``;
* **per-replica** leaves (error-feedback residuals): each replica owns its own value.
  Inside the update a per-replica leaf has its local shape ``[a, ...]``; outside, the
  replicas' values are concatenated along axis 0 into a global ``[N * a, ...]`` array
  with ``PartitionSpec(axis_name)``.

State classes declare their per-replica fields with :func:`per_replica`, so the helpers
here lay out any state, including optax chains that contain commjax transforms::

    opt_state = cj.shard_state(tx.init(params), mesh, "data")     # global arrays
    specs = cj.state_specs(opt_state, "data")                       # for in/out_specs
    step = jax.jit(jax.shard_map(train_step, mesh=mesh,
                                 in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs)))

Under ``pmap`` every leaf gets a leading device axis instead (:func:`pmap_state`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from commjax import _compat

__all__ = [
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


def per_replica_mask(state: Any) -> Any:
    """A pytree of bools shaped like ``state``: True where the leaf is per-replica."""
    return _map_marked(lambda leaf, m: m, state)


def state_specs(state: Any, axis_name: Any) -> Any:
    """``PartitionSpec``s for ``state``: ``P(axis_name)`` per-replica, ``P()`` replicated."""
    return _map_marked(lambda leaf, m: P(axis_name) if m else P(), state)


def _mesh_axis_size(mesh: jax.sharding.Mesh, axis_name: Any) -> int:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return int(np.prod([mesh.shape[n] for n in names]))


def shard_state(state: Any, mesh: jax.sharding.Mesh, axis_name: Any) -> Any:
    """Turn a freshly initialised state into global arrays laid out for ``shard_map``.

    Per-replica leaves (identical at init on every replica) are tiled ``N`` times along
    axis 0 and sharded ``P(axis_name)``; replicated leaves are placed ``P()``.
    """
    n = _mesh_axis_size(mesh, axis_name)

    def place(leaf: Any, marked: bool) -> Any:
        value = np.asarray(leaf)
        if marked and value.size == 0:
            # jit hands empty outputs back replicated; placing them so avoids a recompile.
            marked = False
        if marked:
            if value.ndim == 0:
                raise ValueError("per-replica state leaves need at least one dimension")
            shape = (value.shape[0] * n,) + value.shape[1:]
            # Every shard starts as this process's local value. Building shards from a
            # callback (not device_put of a host array) avoids a cross-process equality
            # check of the whole tiled state when the mesh spans processes.
            return jax.make_array_from_callback(
                shape, NamedSharding(mesh, P(axis_name)), lambda idx: value
            )
        return jax.make_array_from_callback(
            value.shape, NamedSharding(mesh, P()), lambda idx: value[idx]
        )

    return _map_marked(place, state)


def unshard_state(state: Any, replica: int = 0) -> Any:
    """The local view of one replica (``replica``) of a :func:`shard_state`-laid state.

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
        n = _mesh_axis_size(mesh, spec[0])
        a = leaf.shape[0] // n
        return leaf[replica * a:(replica + 1) * a]

    return _map_marked(take, state)


def pmap_state(state: Any, num_devices: Optional[int] = None) -> Any:
    """Give every leaf a leading device axis of size ``num_devices`` (default: all local
    devices), as ``jax.pmap`` expects. Per-replica and replicated leaves alike: at init
    they are identical on every replica."""
    n = jax.local_device_count() if num_devices is None else num_devices
    stacked = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), state)
    # Place the arrays as pmap outputs are placed, so the first step does not compile twice.
    return jax.pmap(lambda t: t, devices=jax.local_devices()[:n])(stacked)


def init_sharded(tx: Any, params: Any, mesh: jax.sharding.Mesh, axis_name: Any) -> Any:
    """``tx.init(params)`` run inside ``shard_map`` over ``axis_name``, laid out as
    :func:`shard_state` lays it out.

    Inside ``shard_map`` the axis is bound, so state whose size depends on the number of
    replicas (the two-phase reducer's server residual) is sized for this mesh without a
    ``num_replicas`` argument. ``params`` are replicated.
    """
    # The structure (not the sizes) decides the specs; trace init where the axes are bound.
    probe = _compat.shard_map(tx.init, mesh=mesh, in_specs=(P(),), out_specs=P(), check_vma=False)
    structure = jax.eval_shape(probe, params)
    specs = state_specs(structure, axis_name)
    fn = _compat.shard_map(
        tx.init, mesh=mesh, in_specs=(P(),), out_specs=specs, check_vma=False
    )
    return jax.jit(fn)(params)
