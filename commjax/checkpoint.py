"""Saving and restoring training state with orbax, bit for bit: a convenience.

Every commjax state (and [`commjax.TrainState`][]) is a pytree of arrays with no
zero-size array, so orbax's standard handlers save it as it is, into a
``CheckpointManager`` of your own::

    mgr.save(step, args=ocp.args.StandardSave(state))
    state = mgr.restore(step, args=ocp.args.StandardRestore(abstract_state))

Nothing here is needed for that. [`Checkpointer`][commjax.checkpoint.Checkpointer] adds conveniences
on top:

* **Any pytree, any container type.** The tree is stored as a flat, ordered list of
  leaves plus the list of their pytree paths; restoring unflattens into the structure of
  a template (``like``). NamedTuple states (``CompressedMeanState``, optax states),
  ``flax.nnx`` states, ``optax.MaskedNode`` placeholders and empty tuples therefore round
  trip without custom orbax handlers, and a template that does not match the checkpoint
  fails with an error that names the first differing path.
* **The layout of the template.** Each restored array gets the sharding of the
  template's array: global arrays laid out with [`commjax.shard_state`][] come back
  sharded ``P(axis)`` (per-replica leaves) or ``P()`` (replicated leaves) on the same
  mesh, and ``pmap`` states ([`commjax.pmap_state`][], leading device axis) come back
  with their leading axis. Each replica's own residual is restored to that replica.
* **Typed PRNG keys** (``jax.random.key``) are stored as their raw key data and wrapped
  again on restore.

Every process of a multi-process job must call
[`Checkpointer.save`][commjax.checkpoint.Checkpointer.save] and
[`Checkpointer.restore`][commjax.checkpoint.Checkpointer.restore] (orbax coordinates them; each
process writes and reads its
own shards).

Example::

    ckpt = Checkpointer("/tmp/run", max_to_keep=2)
    ckpt.save(step, {"params": params, "opt_state": opt_state})
    ...
    restored = ckpt.restore({"params": params, "opt_state": opt_state})   # latest step
    params, opt_state = restored["params"], restored["opt_state"]

A restored run continues bit-identically to an uninterrupted one, provided the step
function and the data it is fed are the same.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Checkpointer", "save", "restore", "latest_step", "CheckpointMismatchError", "CheckpointDataError"]

_FORMAT = "commjax-flat-v1"
_STATE = "state"
_META = "meta"


class CheckpointMismatchError(ValueError):
    """The template given to ``restore`` does not have the checkpoint's structure."""


class CheckpointDataError(OSError):
    """A checkpoint's files are missing, truncated or corrupted (the template is fine)."""


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ImportError(
            "commjax.checkpoint needs orbax-checkpoint: pip install 'commjax[examples]' "
            "(or pip install orbax-checkpoint)"
        ) from e
    # orbax logs every save and restore at INFO through absl; keep the user's logs clean.
    logging.getLogger("absl").setLevel(max(logging.getLogger("absl").level, logging.WARNING))
    return ocp


def _is_typed_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_name(i: int) -> str:
    return f"leaf_{i:06d}"


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [jax.tree_util.keystr(p) for p, _ in with_path]
    return paths, [leaf for _, leaf in with_path], treedef


class Checkpointer:
    """Numbered checkpoints of one training run in ``directory`` (orbax-managed).

    Args:
      directory: where step sub-directories are written (created if missing). Local
        paths and any path orbax understands (``gs://...``) are accepted.
      max_to_keep: keep only the newest ``max_to_keep`` checkpoints (None: keep all).
      async_save: return from ``save`` while orbax writes in the background (the
        arrays are copied to host memory first). Call ``wait_until_finished`` before
        relying on the files. Default False: ``save`` returns once written.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: Optional[int] = None,
                 async_save: bool = False):
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"Checkpointer: `max_to_keep` must be a positive integer or None, got {max_to_keep!r}.")
        ocp = _ocp()
        self.directory = os.path.abspath(os.fspath(directory)) if "://" not in os.fspath(directory) else os.fspath(directory)
        self._async = bool(async_save)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=self._async,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(_STATE, _META))

    # -- queries ---------------------------------------------------------------------

    def latest_step(self) -> Optional[int]:
        """The newest saved step, or None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every saved step, oldest first."""
        return sorted(self._manager.all_steps())

    def metadata(self, step: Optional[int] = None) -> dict:
        """The ``metadata`` dict given to ``save`` (and the stored leaf paths)."""
        ocp = _ocp()
        step = self._resolve(step)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
            return dict(out[_META])
        except (KeyError, FileNotFoundError, ValueError, OSError) as e:
            raise CheckpointDataError(
                f"checkpoint {self.directory} step {step}: its metadata item cannot be read "
                f"({type(e).__name__}: {e}); the step is incomplete or damaged. Restore an "
                "earlier step (Checkpointer.all_steps()).") from e

    # -- save / restore --------------------------------------------------------------

    def save(self, step: int, tree: Any, *, metadata: Optional[Mapping[str, Any]] = None,
             force: bool = True) -> bool:
        """Write ``tree`` (any pytree of arrays) as checkpoint ``step``.

        ``metadata``: a JSON-serialisable dict stored beside the arrays (run options,
        for instance). Returns True if a checkpoint was written.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"Checkpointer.save: `step` must be a non-negative integer, got {step!r}.")
        ocp = _ocp()
        paths, leaves, _ = _flatten(tree)
        key_impls: dict[str, str] = {}
        empty: dict[str, list] = {}
        shapes: dict[str, list] = {}
        arrays: dict[str, Any] = {}
        for i, leaf in enumerate(leaves):
            if _is_typed_key(leaf):
                key_impls[_leaf_name(i)] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            elif not isinstance(leaf, (jax.Array, np.ndarray)):
                leaf = np.asarray(leaf)
            shapes[_leaf_name(i)] = [list(leaf.shape), np.dtype(leaf.dtype).name]
            if leaf.size == 0:
                # orbax refuses zero-size arrays (no residual without error feedback, no
                # server residual outside the two-phase reducer): keep shape and dtype.
                empty[_leaf_name(i)] = [list(leaf.shape), np.dtype(leaf.dtype).name]
                continue
            arrays[_leaf_name(i)] = leaf
        meta = {
            "format": _FORMAT,
            "paths": paths,
            "typed_keys": key_impls,
            "empty": empty,
            "shapes": shapes,
            "user": dict(metadata or {}),
        }
        saved = self._manager.save(
            int(step),
            args=ocp.args.Composite(**{_STATE: ocp.args.StandardSave(arrays),
                                       _META: ocp.args.JsonSave(meta)}),
            force=force,
        )
        if not self._async:
            self._manager.wait_until_finished()
        return bool(saved)

    def restore(self, like: Any, step: Optional[int] = None) -> Any:
        """Read checkpoint ``step`` (default: the latest) into the structure of ``like``.

        ``like`` is a template with the same pytree structure as the saved tree: typically
        the freshly initialised ``{"params": ..., "opt_state": ...}``, laid out the way the
        run uses it ([`commjax.shard_state`][] or [`commjax.pmap_state`][]). Its
        arrays may also be ``jax.ShapeDtypeStruct`` (with a ``sharding``). Each restored
        array takes the shape, dtype and sharding of the template's leaf; numpy leaves are
        restored as numpy arrays.

        Raises:
          FileNotFoundError: no checkpoint (or not that ``step``) in the directory.
          CheckpointMismatchError: ``like`` has other paths, shapes or dtypes.
        """
        step = self._resolve(step)
        meta = self.metadata(step)
        if meta.get("format") != _FORMAT:
            raise CheckpointMismatchError(
                f"checkpoint {self.directory} step {step} was not written by commjax.checkpoint "
                f"(format {meta.get('format')!r})."
            )
        paths, leaves, treedef = _flatten(like)
        _check_paths(paths, list(meta["paths"]), step)
        typed = meta.get("typed_keys", {})
        targets = _targets(paths, leaves, typed)
        _check_shapes(targets, meta.get("shapes"), paths, step)
        out = _empty_leaves(targets, meta.get("empty", {}), paths)
        out.update(self._read(step, targets))
        restored = []
        for i, leaf in enumerate(leaves):
            name = _leaf_name(i)
            value = out[name]
            want = tuple(np.shape(jax.random.key_data(leaf) if _is_typed_key(leaf) else leaf))
            if tuple(np.shape(value)) != want:
                raise CheckpointMismatchError(
                    f"Checkpointer.restore: leaf {paths[i]} has shape {np.shape(value)} in the "
                    f"checkpoint but {want} in the template.")
            if name in typed:
                value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(leaf))
            restored.append(value)
        return jax.tree_util.tree_unflatten(treedef, restored)

    def _read(self, step: int, targets: dict) -> dict:
        """The non-empty leaves of checkpoint ``step``, placed as ``targets`` say."""
        if not targets:
            return {}
        ocp = _ocp()
        try:
            return self._manager.restore(
                step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(targets)}))[_STATE]
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds
            raise CheckpointDataError(
                f"Checkpointer.restore: the arrays of checkpoint {self.directory} step {step} "
                f"cannot be read although the template matches what was saved: the files are "
                f"missing, truncated or corrupted ({type(e).__name__}: {e}). Restore an earlier "
                "step (Checkpointer.all_steps()).") from e

    def wait_until_finished(self) -> None:
        """Block until every pending (asynchronous) save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _resolve(self, step: Optional[int]) -> int:
        if step is None:
            step = self._manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; saved steps: {self.all_steps()}"
            )
        return int(step)


def save(directory: str | os.PathLike, step: int, tree: Any, *,
         metadata: Optional[Mapping[str, Any]] = None) -> None:
    """One-shot [`Checkpointer.save`][commjax.checkpoint.Checkpointer.save] (synchronous)."""
    with Checkpointer(directory) as c:
        c.save(step, tree, metadata=metadata)


def restore(directory: str | os.PathLike, like: Any, *, step: Optional[int] = None) -> Any:
    """One-shot [`Checkpointer.restore`][commjax.checkpoint.Checkpointer.restore] (default: the
    latest step)."""
    with Checkpointer(directory) as c:
        return c.restore(like, step)


def latest_step(directory: str | os.PathLike) -> Optional[int]:
    """The newest step saved in ``directory`` (None if none, or no such directory)."""
    if "://" not in os.fspath(directory) and not os.path.isdir(directory):
        return None
    with Checkpointer(directory) as c:
        return c.latest_step()


def _check_made_for(paths: list, saved_paths: list, step: int) -> None:
    """States of commjax transforms name what they were made for in a path
    (``.made_for['<fingerprint>']``, [`commjax.fingerprint`][]): say so when those differ."""
    mine = [p for p in paths if ".made_for[" in p]
    theirs = [p for p in saved_paths if ".made_for[" in p]
    for got, want in zip(mine, theirs):
        if got != want:
            where, _, key = got.partition(".made_for[")
            raise CheckpointMismatchError(
                f"Checkpointer.restore: at {where}, the checkpoint (step {step}) holds a state made for "
                f"{want.partition('.made_for[')[2].rstrip(']')} and `like` one made for {key.rstrip(']')}: "
                "another compressor, other options or other parameters (commjax.fingerprint). "
                "Restore into the state of the transform the checkpoint was saved from.")


def _check_paths(paths: list, saved_paths: list, step: int) -> None:
    """The template's leaf paths must be the checkpoint's: name the first difference."""
    if paths == saved_paths:
        return
    _check_made_for(paths, saved_paths, step)
    first = next((i for i, (a, b) in enumerate(zip(paths, saved_paths)) if a != b),
                 min(len(paths), len(saved_paths)))
    got = paths[first] if first < len(paths) else "<end>"
    want = saved_paths[first] if first < len(saved_paths) else "<end>"
    raise CheckpointMismatchError(
        f"Checkpointer.restore: `like` does not match checkpoint step {step}: it has "
        f"{len(paths)} leaves, the checkpoint {len(saved_paths)}; first difference at "
        f"leaf {first}: template {got!r} vs checkpoint {want!r}. Build `like` the way "
        "the saved tree was built (same model, optimizer and transforms)."
    )


def _targets(paths: list, leaves: list, typed: dict) -> dict:
    """What each leaf is restored as: the template's shape, dtype and sharding (typed keys
    as their raw data), numpy leaves as numpy."""
    targets: dict[str, Any] = {}
    for i, leaf in enumerate(leaves):
        name = _leaf_name(i)
        if _is_typed_key(leaf):
            if isinstance(leaf, jax.ShapeDtypeStruct):
                raise CheckpointMismatchError("Checkpointer.restore: give concrete typed keys in `like`.")
            leaf = jax.random.key_data(leaf)
        elif name in typed:
            raise CheckpointMismatchError(
                f"Checkpointer.restore: leaf {paths[i]} was saved as a typed PRNG key but the "
                "template holds a plain array.")
        if isinstance(leaf, jax.ShapeDtypeStruct):
            targets[name] = leaf
        elif isinstance(leaf, jax.Array):
            targets[name] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
        else:
            targets[name] = np.asarray(leaf)
    return targets


def _empty_leaves(targets: dict, empty: dict, paths: list) -> dict:
    """Zero-size leaves (orbax writes none): rebuilt from the checkpoint's record of their
    shapes, placed like the template's (removed from ``targets``)."""
    out: dict[str, Any] = {}
    for name, (shape, dtype) in empty.items():
        target = targets.pop(name)
        if tuple(np.shape(target)) != tuple(shape):
            raise CheckpointMismatchError(
                f"Checkpointer.restore: leaf {paths[int(name.split('_')[1])]} has shape "
                f"{tuple(shape)} in the checkpoint but {tuple(np.shape(target))} in the template.")
        sharding = getattr(target, "sharding", None)
        out[name] = (jax.device_put(jnp.zeros(shape, dtype), sharding) if sharding is not None
                     else np.zeros(shape, dtype))
    return out


def _check_shapes(targets: dict, shapes: Optional[dict], paths: list, step: int) -> None:
    """The template's shapes and dtypes against those recorded at save time (checkpoints
    written before they were recorded are not checked here)."""
    if not shapes:
        return
    for name, target in targets.items():
        want_shape, want_dtype = shapes.get(name, (None, None))
        got = (list(np.shape(target)), np.dtype(target.dtype).name)
        if want_shape is not None and (got[0] != list(want_shape) or got[1] != want_dtype):
            raise CheckpointMismatchError(
                f"Checkpointer.restore: leaf {paths[int(name.split('_')[1])]} has shape "
                f"{tuple(got[0])} ({got[1]}) in the template but {tuple(want_shape)} "
                f"({want_dtype}) in checkpoint step {step}. Build `like` the way the saved tree "
                f"was built.{_replica_hint(got[0], list(want_shape))}")


def _replica_hint(got: list, want: list) -> str:
    """Where only the first axis differs: a per-replica leaf (one row block per replica)
    saved with another replica count."""
    if len(got) != len(want) or not got or got[1:] != want[1:] or got[0] == want[0]:
        return ""
    return (" Only the first axis differs, as it does for a per-replica state leaf saved with "
            "another number of replicas: restore onto the mesh the checkpoint was saved from "
            "(per-replica residuals and copies do not carry over to another replica count).")
