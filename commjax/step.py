"""``cj.data_parallel``: the data-parallel train step, built from a loss and an optax transform.

Compression must see each replica's own gradient, so the step runs inside
``jax.shard_map``; this module writes that wiring once::

    dp = cj.data_parallel(loss_fn, tx, mesh)          # loss_fn(params, batch) -> scalar
    state = dp.init(params)                            # params, opt_state, step, key: placed
    for batch in batches:                              # global batch, split over "data"
        state, loss = dp.step(state, batch)            # loss: each replica's, shape [N]

What the step does on replica ``i`` of ``N`` (``b_i`` its rows of the batch)::

    g_i = grad(loss_fn)(vary(params), b_i)      # vary: keep JAX from summing g_i itself
    u, opt_state = tx.update(g_i, opt_state, params)   # the commjax exchange in tx
    params = params + u                          # u is identical on every replica

and around it: the state's layout found by tracing ``tx`` ([`commjax.layout`][]), the
state's buffers donated, a PRNG key per replica and step (``with_rng=True``),
parameters per replica for DiLoCo-style optimizers (``per_replica_params=True``),
process-local batches with several processes, ``optax.MultiSteps`` replaced by its
once-per-real-step equivalent ([`commjax.accumulate`][]), and Flax NNX modules and
``nnx.Optimizer`` (``dp.init(model)``) through ``nnx.split``/``nnx.merge``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from commjax import _compat, layout, validation
from commjax.accounting import CollectiveReport, collective_bytes
from commjax.accumulate import accumulate, is_multisteps
from commjax.sync import InBackwardSync

try:  # Flax is optional: NNX modules are supported when it is installed.
    from flax import nnx
    from flax.nnx.training.optimizer import to_opt_state
except ImportError:  # pragma: no cover - exercised without the flax extra
    nnx = None

__all__ = ["TrainState", "DataParallel", "data_parallel"]


class TrainState(NamedTuple):
    """What [`DataParallel.step`][commjax.step.DataParallel.step] carries from step to step (a
    pytree of arrays:
    orbax saves it as it is).

    Attributes:
      step: int32 scalar, replicated: steps (micro-steps under accumulation) done.
      params: the parameters, replicated ``P()``; with ``per_replica_params`` a leading
        replica axis ``[N, ...]`` sharded ``P(axis)``. For an NNX model: its
        ``nnx.State`` (parameters and other variables).
      opt_state: the optimizer state laid out by tracing (per-replica leaves as global
        ``[N * a, ...]`` arrays sharded ``P(axis)``). For an NNX model: the
        ``nnx.Optimizer``'s ``nnx.State``.
      key: uint32[2] raw PRNG key, replicated; the step folds in the step and the replica.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    key: jax.Array


def _is_nnx(x: Any) -> bool:
    return nnx is not None and isinstance(x, (nnx.Module, nnx.Optimizer))


@dataclasses.dataclass
class _Nnx:
    """Static halves of an NNX model and optimizer (set by
    [`DataParallel.init`][commjax.step.DataParallel.init])."""

    model_def: Any
    opt_def: Any
    wrt: Any


def _empty_replicated(tree: Any) -> Any:
    """Every empty array of ``tree`` as fresh zeros: an empty leaf holds no value, and it is
    placed replicated (``layout.place``, as ``jit`` returns it), where the one computed from
    a gradient would be typed varying."""
    return jax.tree_util.tree_map(
        lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.Array) and x.size == 0 else x, tree)


class DataParallel:
    """A compiled data-parallel train step; made by
    [`data_parallel`][commjax.step.data_parallel]."""

    def __init__(self, loss_fn, tx, mesh, axis_name, has_aux, with_rng, per_replica_params,
                 donate, check_vma, wrt, sync=None):
        # With an in-backward exchange the state is that of chain(sync, tx): its layout,
        # init and byte count come from there; the step differentiates through the sync
        # and runs tx alone after it.
        self._sync = None if sync is None else (sync, tx)
        if sync is not None:
            tx = optax.chain(sync.as_transform(), tx)
        self.loss_fn, self.tx, self.mesh, self.axis_name = loss_fn, tx, mesh, axis_name
        self.has_aux, self.with_rng = has_aux, with_rng
        self.per_replica_params, self.donate, self.check_vma = per_replica_params, donate, check_vma
        self.num_replicas = int(np.prod([mesh.shape[a] for a in _names(axis_name)]))
        # Manual over the data axes only: other mesh axes (a model axis the parameters are
        # split over with NamedSharding) are left to the compiler, as under jax.jit.
        self._manual = _names(axis_name)
        self._model_axes = frozenset(mesh.axis_names) - self._manual
        self._shard_specs: Any = None  # (param, state) specs per model shard on a split model
        self._wrt = wrt
        self._nnx: Optional[_Nnx] = None
        self._specs: Any = None
        self._traced_specs: Any = None  # the optimizer state's specs over several data axes
        self._step: Optional[Callable[..., Any]] = None

    # ---------------------------------------------------------------- init

    def init(self, params: Any, *, optimizer: Any = None, seed: int = 0) -> TrainState:
        """The first [`TrainState`][commjax.step.TrainState]: ``params`` (one replica's parameters,
        or a Flax NNX
        module) placed on the mesh, the optimizer state initialised inside ``shard_map``
        and laid out by tracing the update, the step counter and a PRNG key from ``seed``.

        For an NNX module the step trains it through an ``nnx.Optimizer(model, tx,
        wrt=wrt)``, or through ``optimizer`` if given (its transform and ``wrt``; its state
        is initialised afresh for the mesh: resume by restoring a
        [`TrainState`][commjax.step.TrainState]).
        """
        validation.check_int("seed", seed, 0, factory="DataParallel.init")
        # The step donates the state's buffers: none may be one the caller still holds.
        held = _buffers(nnx.state(params) if _is_nnx(params) else params) if self.donate else frozenset()
        if _is_nnx(params) or optimizer is not None:
            params, opt_state, body = self._init_nnx(params, optimizer)
        else:
            params, opt_state, body = self._init_tree(params)
        key = jax.random.key_data(jax.random.key(seed))
        state = TrainState(jnp.zeros((), jnp.int32), params, opt_state, key)
        opt_specs = (self._traced_specs if self._traced_specs is not None
                     else layout.state_specs(opt_state, self.axis_name))
        if self._shard_specs is not None:  # split model: the data part of each spec
            opt_specs = jax.tree_util.tree_map(lambda sp: _only(sp, self._manual), opt_specs,
                                               is_leaf=lambda x: isinstance(x, P))
        self._specs = TrainState(P(), self._param_specs(params), opt_specs, P())
        state = jax.tree_util.tree_map(lambda leaf: self._place_replicated(leaf, held), state,
                                       is_leaf=lambda x: isinstance(x, jax.Array) and _is_placed(x))
        # On a mesh with model axes, every array keeps its layout from step to step.
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, state) if self._model_axes else None
        self._build(body, shardings)
        return state

    def _init_tree(self, params: Any):
        mask, varies = layout.trace_update(self.tx, params, self.mesh, self.axis_name,
                                           per_replica_params=self.per_replica_params,
                                           manual_axes=self._manual)
        if varies and not self.per_replica_params:
            raise ValueError(
                f"data_parallel: `tx`'s updates of {_named(varies)} differ between replicas over "
                f"{self.axis_name!r} (nothing averages them), so replicated parameters would drift "
                f"apart. Put cj.compressed_mean(compressor, axis_name={self.axis_name!r}) first in "
                "the optax.chain, and over every leaf (not inside optax.masked or one partition "
                "of optax.multi_transform), or pass per_replica_params=True for optimizers whose "
                "replicas hold their own parameters (cj.diloco).")
        if self._model_axes and _split(params, self._model_axes):
            if self._sync is not None:
                raise ValueError("data_parallel: `sync` with parameters split over "
                                 f"{sorted(self._model_axes)} is not supported; use compressed_mean in tx.")
            if self.per_replica_params:
                raise ValueError("data_parallel: per_replica_params=True with parameters split over "
                                 f"{sorted(self._model_axes)} is not supported; place them P().")
            return params, self._init_split(params), self._tree_body
        if isinstance(self.axis_name, (tuple, list)) and len(self.axis_name) > 1:
            # A leaf may vary over some of several axes only (a residual shared by a group
            # averaged exactly first): the traced layout, not the mask, tells which, and is
            # kept as the specs (placements over an axis of one device cannot be read back).
            self._traced_specs, pspecs = layout.state_layout(
                self.tx, params, self.mesh, self.axis_name, per_replica_params=self.per_replica_params,
                manual_axes=self._manual)
            opt_state = layout.init_laid_out(self.tx, params, self.mesh, self._traced_specs, pspecs,
                                             self._manual)
        else:
            opt_state = layout.init_sharded(self.tx, params, self.mesh, self.axis_name,
                                            per_replica_params=self.per_replica_params, mask=mask,
                                            manual_axes=self._manual)
        if self.per_replica_params:
            params = jax.tree_util.tree_map(
                lambda p: layout.place(np.asarray(p)[None], True, self.mesh, self.axis_name,
                                       self.num_replicas), params)
        return params, opt_state, self._tree_body

    def _init_split(self, params: Any) -> Any:
        """Parameters split over model axes: the optimizer runs on each device's shard (a
        ``shard_map`` manual over the model axes inside the step), so every device
        compresses only its shard and the exchange adds no model-axis traffic. The state
        is laid out shard by shard ([`commjax.layout.state_layout`][])."""
        specs, pspecs = layout.state_layout(self.tx, params, self.mesh, self.axis_name)
        self._shard_specs = (pspecs, jax.tree_util.tree_map(
            lambda sp: _only(sp, self._model_axes), specs, is_leaf=lambda x: isinstance(x, P)))
        return layout.init_sharded(self.tx, params, self.mesh, self.axis_name)

    def _update(self, grads, opt_state, params):
        """``tx.update``; on a split model, in a ``shard_map`` manual over the model axes
        (nested in the step's, over the mesh as the step sees it). Its replication check is
        off: a transform that joins every leaf in one collective (ZeRO's gather) types a
        whole parameter's update as varying with the split ones, although every device of
        the model axis computes it from the same values."""
        if self._shard_specs is None:
            return self.tx.update(grads, opt_state, params)
        pspecs, specs = self._shard_specs
        fn = _compat.shard_map(self.tx.update, mesh=_compat.abstract_mesh(self.mesh),
                               in_specs=(pspecs, specs, pspecs), out_specs=(pspecs, specs),
                               check_vma=False, axis_names=self._model_axes)
        return fn(grads, opt_state, params)

    def _init_nnx(self, model: Any, optimizer: Any):
        if self._sync is not None:
            raise ValueError("data_parallel: `sync` runs on parameter pytrees; pass "
                             "nnx.state(model, nnx.Param) and a loss of the parameters.")
        if nnx is None:
            raise ImportError("DataParallel.init: `optimizer=` is for Flax NNX; pip install "
                              "'commjax[flax]'.")
        if self.per_replica_params:
            raise ValueError("data_parallel: per_replica_params=True is for parameter pytrees; "
                             "pass nnx.state(model, nnx.Param) instead of the module.")
        if optimizer is None:
            optimizer = nnx.Optimizer(model, self.tx, wrt=self._wrt)
        elif not isinstance(optimizer, nnx.Optimizer):
            raise TypeError(f"DataParallel.init: `optimizer` must be an nnx.Optimizer, got "
                            f"{type(optimizer).__name__}.")
        if is_multisteps(optimizer.tx):
            optimizer.tx = accumulate(optimizer.tx)  # same state, one exchange per real step
        params = nnx.as_pure(nnx.state(model, optimizer.wrt))
        mask, varies = layout.trace_update(optimizer.tx, params, self.mesh, self.axis_name,
                                           manual_axes=self._manual)
        if varies:
            raise ValueError(
                f"data_parallel: the optimizer's updates of {_named(varies)} differ between replicas "
                f"over {self.axis_name!r} (nothing averages them), so the model's replicas would "
                f"drift apart. Put cj.compressed_mean(..., axis_name={self.axis_name!r}) first in "
                "the optax chain, over every leaf.")
        # The optax state initialised again inside shard_map, for this mesh: the one
        # nnx.Optimizer made outside it was sized for every device of the process (the
        # two-phase server residual; which of ZeRO's leaves are compressed, and so which
        # residuals exist), and can differ from it in shape and structure.
        # The caller's optimizer keeps its own arrays (the step donates the state's).
        own = optimizer.opt_state
        optimizer.opt_state = nnx.data(to_opt_state(layout.init_sharded(
            optimizer.tx, params, self.mesh, self.axis_name, mask=mask, manual_axes=self._manual)))
        model_def, model_state = nnx.split(model)
        opt_def, opt_state = nnx.split(optimizer)
        optimizer.opt_state = own
        self._nnx = _Nnx(model_def, opt_def, optimizer.wrt)
        place = lambda leaf: leaf if _is_placed(leaf) else layout.place(  # noqa: E731
            leaf, False, self.mesh, self.axis_name, self.num_replicas)
        return jax.tree_util.tree_map(place, model_state), jax.tree_util.tree_map(place, opt_state), self._nnx_body

    def _nnx_update(self, model_state, opt_state, grads):
        """``nnx.Optimizer.update`` on merged copies; returns the new states."""
        model = nnx.merge(self._nnx.model_def, model_state)
        opt = nnx.merge(self._nnx.opt_def, opt_state)
        opt.update(model, grads)
        return nnx.state(model), nnx.state(opt)

    def _param_specs(self, params: Any) -> Any:
        if self._nnx is not None:
            return layout.state_specs(params, self.axis_name)
        if not self.per_replica_params:
            return jax.tree_util.tree_map(lambda _: P(), params)
        # An empty leaf is placed replicated, as jit returns it (layout.place).
        return jax.tree_util.tree_map(lambda p: P() if np.size(p) == 0 else P(self.axis_name), params)

    def _place_replicated(self, leaf: Any, held: frozenset) -> Any:
        """``leaf`` placed on the mesh (replicated where not yet placed), in new buffers
        where it shares one in ``held`` (the caller's arrays, which a donating step would
        delete)."""
        if isinstance(leaf, jax.Array) and _is_placed(leaf):
            return _copy(leaf) if _buffers(leaf) & held else leaf
        return layout.place(leaf, False, self.mesh, self.axis_name, self.num_replicas)

    # ---------------------------------------------------------------- the step

    def _loss_and_grad(self, params, batch, key):
        args = (batch, key) if self.with_rng else (batch,)
        fn = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)
        out, grads = fn(_compat.vary(params, self.axis_name), *args)
        loss, aux = out if self.has_aux else (out, None)
        return loss, aux, grads

    def _synced(self, params, opt_state, batch, key):
        """The loss, its aux, and the update with the exchange in the backward pass."""
        sync, inner = self._sync
        args = (batch, key) if self.with_rng else (batch,)
        (out, grads), sync_state = sync.value_and_grad(self.loss_fn, has_aux=self.has_aux)(
            params, opt_state[0], *args)
        loss, aux = out if self.has_aux else (out, None)
        updates, inner_state = inner.update(grads, opt_state[1], params)
        return loss, aux, updates, (sync_state, inner_state)

    def _tree_body(self, state: TrainState, batch, key):
        params = state.params
        if self.per_replica_params:
            params = jax.tree_util.tree_map(lambda a: a[0], params)
        if self._sync is not None:
            loss, aux, updates, opt_state = self._synced(params, state.opt_state, batch, key)
            return optax.apply_updates(params, updates), opt_state, loss, aux
        loss, aux, grads = self._loss_and_grad(params, batch, key)
        updates, opt_state = self._update(grads, state.opt_state, params)
        params = optax.apply_updates(params, updates)
        if self.per_replica_params:
            params = jax.tree_util.tree_map(lambda a: a[None], params)
        return params, opt_state, loss, aux

    def _nnx_body(self, state: TrainState, batch, key):
        model = nnx.merge(self._nnx.model_def, state.params)
        wrt = self._nnx.wrt
        graphdef, params, rest = nnx.split(model, wrt, ...)

        def loss_of(p, *args):
            return self.loss_fn(nnx.merge(graphdef, p, rest), *args)

        args = (batch, key) if self.with_rng else (batch,)
        fn = jax.value_and_grad(loss_of, has_aux=self.has_aux)
        out, grads = fn(_compat.vary(params, self.axis_name), *args)
        loss, aux = out if self.has_aux else (out, None)
        model_state, opt_state = self._nnx_update(state.params, state.opt_state, grads)
        return model_state, opt_state, loss, aux

    def _build(self, body: Callable[..., Any], shardings: Any = None) -> None:
        axis = self.axis_name

        def local(state: TrainState, batch):
            key = jax.random.fold_in(jax.random.fold_in(
                jax.random.wrap_key_data(state.key), state.step), lax.axis_index(axis))
            params, opt_state, loss, aux = body(state, batch, key)
            new = _empty_replicated(TrainState(state.step + 1, params, opt_state, state.key))
            per_replica = jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], (loss, aux))
            return new, per_replica

        mapped = _compat.shard_map(local, mesh=self.mesh, in_specs=(self._specs, P(axis)),
                                   out_specs=(self._specs, P(axis)), check_vma=self.check_vma,
                                   axis_names=self._manual)
        #: The step before ``jax.jit``: ``(state, placed batch) -> (state, (loss, aux))``, to
        #: call inside a larger jitted function of the user's.
        self.sharded_step = mapped
        kw = {}
        if shardings is not None:
            split = NamedSharding(self.mesh, P(axis))
            kw = dict(in_shardings=(shardings, split), out_shardings=(shardings, split))
        self._step = jax.jit(mapped, donate_argnums=(0,) if self.donate else (), **kw)

    def place_batch(self, batch: Any) -> Any:
        """The batch as global arrays split over the replicas along axis 0. On one process
        ``batch`` is the global batch; with several processes it is this process's rows
        (``jax.make_array_from_process_local_data``)."""
        sharding = NamedSharding(self.mesh, P(self.axis_name))
        if jax.process_count() > 1:
            return jax.tree_util.tree_map(
                lambda x: x if _is_placed(x) else jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                batch)
        for leaf in jax.tree_util.tree_leaves(batch):
            if not jnp.ndim(leaf) or jnp.shape(leaf)[0] % self.num_replicas:
                raise ValueError(
                    f"DataParallel.step: every batch array needs a leading dimension divisible "
                    f"by the {self.num_replicas} replicas of {self.axis_name!r}; got shape "
                    f"{jnp.shape(leaf)}.")
        return jax.device_put(batch, sharding)

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        """One step: ``(new state, loss)`` (``(new state, (loss, aux))`` with ``has_aux``).

        ``loss`` holds every replica's loss, shape ``[N]`` (sharded over the axis; no
        collective computes it); ``aux`` leaves get the same leading replica axis.
        With ``donate=True`` the buffers of ``state`` are reused: do not read it again.
        """
        if self._step is None:
            raise RuntimeError("DataParallel.step: call dp.init(params) first.")
        new, (loss, aux) = self._step(state, self.place_batch(batch))
        return new, ((loss, aux) if self.has_aux else loss)

    # ---------------------------------------------------------------- inspection

    def lower(self, state: TrainState, batch: Any):
        """``jax.jit(...).lower`` of the step for this state and batch."""
        return self._step.lower(state, self.place_batch(batch))

    def collectives(self, state: TrainState, batch: Any) -> CollectiveReport:
        """Every collective of the compiled step, with the bytes it sends per device."""
        return collective_bytes(self.lower(state, batch).compile())

    def model(self, state: TrainState) -> Any:
        """The NNX model with ``state``'s variables (replica 0's for per-replica ones)."""
        if self._nnx is None:
            raise ValueError("DataParallel.model: this step trains a parameter pytree; read "
                             "state.params.")
        return nnx.merge(self._nnx.model_def, state.params)

    def replicas_identical(self, state: TrainState) -> bool:
        """Whether every device holds bit-identical parameters (each device's own copy; on
        a model-parallel mesh, every copy of the same shard)."""
        for leaf in jax.tree_util.tree_leaves(state.params):
            by_index: dict = {}
            for s in leaf.addressable_shards:
                by_index.setdefault(str(s.index), []).append(np.asarray(s.data))
            for shards in by_index.values():
                if not all(np.array_equal(shards[0], s, equal_nan=True) for s in shards[1:]):
                    return False
        return True


def _named(paths: list, most: int = 4) -> str:
    """A few leaf paths for an error message (a single-array parameter's empty path as "the parameters")."""
    shown = [p or "the parameters" for p in paths[:most]]
    return ", ".join(shown) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def _split(params: Any, axes: frozenset) -> bool:
    """Whether some parameter is placed split over one of ``axes``."""
    for leaf in jax.tree_util.tree_leaves(params):
        if _is_placed(leaf) and _only(leaf.sharding.spec, axes) != P():
            return True
    return False


def _only(spec: P, axes: frozenset) -> P:
    """``spec`` with only the mesh axes in ``axes`` (``P(("data", "model"))`` -> ``P("model")``
    for the model axes); ``P()`` when none is left."""
    entries = []
    for e in spec:
        kept = tuple(a for a in (e if isinstance(e, (tuple, list)) else (e,)) if a in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _names(axis_name: Any) -> frozenset:
    return frozenset(axis_name) if isinstance(axis_name, (tuple, list)) else frozenset({axis_name})


def _buffers(tree: Any) -> frozenset:
    """The device buffers of ``tree``'s arrays (this process's shards)."""
    return frozenset(shard.data.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree)
                     if isinstance(x, jax.Array) and not x.is_deleted() for shard in x.addressable_shards)


@jax.jit
def _copy(x: jax.Array) -> jax.Array:
    """``x`` in new buffers, with its sharding."""
    return jnp.copy(x)


def _is_placed(x: Any) -> bool:
    return isinstance(getattr(x, "sharding", None), NamedSharding)


def data_parallel(loss_fn: Callable[..., Any], tx: Any, mesh: jax.sharding.Mesh, *,
                  axis_name: Any = "data", has_aux: bool = False, with_rng: bool = False,
                  per_replica_params: bool = False, donate: bool = True,
                  check_vma: bool = True, wrt: Any = None,
                  sync: Optional[InBackwardSync] = None) -> DataParallel:
    """Build the data-parallel train step of ``loss_fn`` with the optax transform ``tx``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (``-> (scalar, aux)`` with
        ``has_aux``; a third argument ``key`` with ``with_rng``), this replica's loss on
        its rows of the batch. For an NNX model, ``loss_fn(model, batch)``.
      tx: an optax transform containing a commjax exchange over ``axis_name``
        (``optax.chain(cj.compressed_mean(...), optax.adam(...))``, ``cj.dgc(...)``, ...).
        An ``optax.MultiSteps`` is run as [`commjax.accumulate`][] (same state, the same
        numbers up to the last bit, one exchange per real step instead of one per
        micro-step).
      mesh: a ``jax.sharding.Mesh`` with ``axis_name`` among its axes.
      axis_name: the mesh axis (or tuple of axes) the batch is split over.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      with_rng: ``loss_fn`` takes a PRNG key, ``fold_in(fold_in(key, step), replica)``:
        different on every replica and step, reproducible from ``init``'s ``seed``.
      per_replica_params: each replica keeps its own parameters (``cj.diloco``).
      donate: reuse the state's buffers for the new state (halves peak state memory). The
        parameters given to ``init`` stay readable: where they are already placed on the
        mesh, ``init`` copies them into the state.
      check_vma: ``shard_map``'s replication check (on by default).
      wrt: the NNX variable filter trained (default ``nnx.Param``).
      sync: a [`commjax.sync_in_backward`][] exchange run inside the backward pass, bucket
        by bucket, so that its collectives can hide behind the rest of it; ``tx`` is then
        the optimizer alone (``optax.adam(...)``: no commjax exchange in it). The state's
        ``opt_state`` is ``(sync state, tx state)``. Trees of arrays only (not NNX).

    Returns:
      A [`DataParallel`][commjax.step.DataParallel]: ``init(params)``, ``step(state, batch)``,
      ``collectives``.

    Raises:
      ValueError / TypeError: a bad argument, named in the message with the fix.
    """
    factory = "data_parallel"
    if not callable(loss_fn):
        raise TypeError(f"{factory}: `loss_fn` must be callable, loss_fn(params, batch) -> "
                        f"scalar; got {loss_fn!r}.")
    if is_multisteps(tx):
        tx = accumulate(tx)
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"{factory}: `tx` must be an optax transform such as optax.chain("
                        f"cj.compressed_mean(cj.quantize(bits=8)), optax.adam(1e-3)); got {tx!r}.")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"{factory}: `mesh` must be a jax.sharding.Mesh, e.g. jax.make_mesh(("
                        f"jax.device_count(),), ('data',)); got {type(mesh).__name__}.")
    axis_name = validation.normalize_axis(axis_name)
    missing = sorted(_names(axis_name) - set(mesh.axis_names))
    if missing:
        raise ValueError(f"{factory}: `axis_name` {axis_name!r} names axes {missing} that the "
                         f"mesh does not have (its axes: {tuple(mesh.axis_names)}).")
    for name, value in (("has_aux", has_aux), ("with_rng", with_rng),
                        ("per_replica_params", per_replica_params), ("donate", donate),
                        ("check_vma", check_vma)):
        validation.check_bool(name, value, factory=factory)
    if wrt is None and nnx is not None:
        wrt = nnx.Param
    if sync is not None and not isinstance(sync, InBackwardSync):
        raise TypeError(f"{factory}: `sync` must be cj.sync_in_backward(codec, axis_name), got {sync!r}.")
    if sync is not None and (per_replica_params or _names(sync.axis_name) != _names(axis_name)):
        raise ValueError(f"{factory}: `sync` exchanges over {sync.axis_name!r}; it needs "
                         f"axis_name={sync.axis_name!r} and replicated parameters "
                         "(per_replica_params=False).")
    return DataParallel(loss_fn, tx, mesh, axis_name, bool(has_aux), bool(with_rng),
                        bool(per_replica_params), bool(donate), bool(check_vma), wrt, sync)
