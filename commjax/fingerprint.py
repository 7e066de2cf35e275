"""What a state was made for: its transform's options, the tree's keys and the shapes.

A commjax state that holds per-leaf parts (``compressed_mean``'s residuals, ``zero``'s
master shards) records what ``init`` made it for in a field ``made_for``: a dict with one
entry whose *key* is the fingerprint::

    "<name>_<options>_<keys>_<shapes>"     e.g. "int4_6f1c0a52_0d1e9b7c_93a0c4e1"

``name`` is the codec's name; ``options``, ``keys`` and ``shapes`` are 32-bit digests
(BLAKE2s) of the transform's options (its codec's fields, the implementation of its
kernels aside, and the options that shape the state), of the parameter tree's key paths
(``jax.tree_util.keystr``, in order, a Flax ``Variable``'s ``.value`` left out) and of
the floating leaves' shapes (integer leaves
pass through, whatever their shape). Its value, ``uint32[1]``,
is the CRC-32 of the key; only the key is compared.

Held as a key, the fingerprint is part of the state's pytree structure: ``update`` reads
it at trace time (no device work, no host callback) and compares it with the fingerprint
of the gradients it receives; a checkpoint stores it as a path, so a checkpoint of one
chain restored into the state of another meets a different path and is refused by
[`commjax.checkpoint.Checkpointer`][] (and by orbax's own structure check).

What it cannot tell: two leaves of the same shape exchanged between steps (their
gradients are arrays of the same shape either way), and options that leave the state's
meaning unchanged (the seed, ``check_finite``, the kernels' implementation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MadeFor", "made_for", "describe", "check_made_for"]


class MadeFor(NamedTuple):
    """The parts of a fingerprint (see the module docstring)."""

    name: str
    options: str
    keys: str
    shapes: str

    @property
    def key(self) -> str:
        return "_".join(self)

    @classmethod
    def parse(cls, key: Any):
        """The parts of ``key``, or None if it is not a fingerprint."""
        parts = key.rsplit("_", 3) if isinstance(key, str) else []
        return cls(*parts) if len(parts) == 4 else None


def _digest(text: str) -> str:
    return hashlib.blake2s(text.encode(), digest_size=4).hexdigest()


def describe(value: Any) -> str:
    """A stable text of an option: dataclasses (codecs) field by field, ``kernels`` left
    out (every implementation computes the same bits), and a field added later
    (``metadata={"fingerprint_if_set": True}``) left out while it holds its default, so
    the fingerprints of states made before it existed do not change; dtypes by name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value)
                  if f.name != "kernels" and not (f.metadata.get("fingerprint_if_set")
                                                  and getattr(value, f.name) == f.default)]
        return f"{type(value).__name__}({', '.join(fields)})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    try:
        return np.dtype(value).name
    except TypeError:
        return repr(value)


#: A Flax ``Variable``'s own key: ``nnx.Optimizer`` initializes its transform with the
#: Variables (paths ``...['kernel'].value``) and updates it with their values.
_VALUE = re.compile(r"\.value(?=$|[.\[])")


def _tree(tree: Any) -> tuple[list[str], list[Any]]:
    """Key paths, and the shapes of the floating leaves (None for the others: integer
    leaves pass through every transform, whatever their shape)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ([_VALUE.sub("", jax.tree_util.keystr(p)) for p, _ in flat],
            [tuple(np.shape(l)) if jnp.issubdtype(jnp.result_type(l), jnp.floating) else None for _, l in flat])


def fingerprint(name: str, options: Any, tree: Any) -> MadeFor:
    """The fingerprint of a state made by a transform called ``name`` with ``options``
    (any value [`describe`][commjax.fingerprint.describe] reads) for ``tree``."""
    keys, shapes = _tree(tree)
    return MadeFor(re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "state", _digest(describe(options)),
                   _digest(repr(keys)), _digest(repr(shapes)))


def _split_shapes(tree: Any, n: int) -> str:
    """The shapes digest of ``tree`` with every leaf's first dimension ``n`` times larger."""
    return _digest(repr([(s[0] * n,) + s[1:] if s else s for s in _tree(tree)[1]]))


def made_for(name: str, options: Any, tree: Any) -> dict:
    """The ``made_for`` field of a state made for ``tree``: ``{fingerprint: uint32[1]}``."""
    key = fingerprint(name, options, tree).key
    return {key: jnp.full((1,), zlib.crc32(key.encode()), jnp.uint32)}


def check_made_for(where: str, field: Any, name: str, options: Any, tree: Any, *, num_replicas: int,
                   fix: str, label: str = "") -> None:
    """Raise a ``ValueError`` naming what differs between the state's ``made_for``
    ``field`` and what ``update`` receives (``tree``), and the fix (``fix``: how to make
    the right state; ``label``: what this transform runs, for the message); nothing if
    they agree.

    Shapes that differ are told apart further: every leaf's first dimension
    ``num_replicas`` times smaller than the state's means parameters split over the
    replicas' axis (``in_specs=P(axis)``) where data parallelism replicates them."""
    want = fingerprint(name, options, tree)
    keys = list(field) if isinstance(field, dict) else []
    got = MadeFor.parse(keys[0]) if len(keys) == 1 else None
    if got == want:
        return
    if got is None:
        raise ValueError(f"{where}: the state's `made_for` field is {field!r}, not the one entry init() "
                         f"writes: was the state built by hand? {fix}")
    if got.options != want.options:
        other = "another compressor" if got.name != want.name else "other options"
        raise ValueError(
            f"{where}: the state was made for {other} ({got.name}; the codec's options and "
            f"{where}'s own count), but this {where} runs {label or want.name}: a state made by "
            f"another transform (a checkpoint of another chain?). {fix}")
    if got.keys != want.keys:
        raise ValueError(
            f"{where}: the gradients' tree has other keys or another structure than the parameters "
            "the state was made for (leaves renamed, added, removed or reordered): pass the "
            "gradients of the parameters given to init(), or make the state with init() of these.")
    if num_replicas > 1 and _split_shapes(tree, num_replicas) == got.shapes:
        raise ValueError(
            f"{where}: every gradient leaf is 1/{num_replicas} of the parameter the state was made "
            "for along its first dimension: the parameters are split over the replicas' axis "
            "(in_specs=P(axis) in shard_map?). Data-parallel parameters are replicated: pass them "
            "with in_specs=P() (only the batch is split).")
    raise ValueError(
        f"{where}: the gradients' leaves have other shapes than the parameters the state was made "
        "for (a floating leaf reshaped, or two of different shapes exchanged?): pass the gradients of "
        "the parameters given to init(), or make the state with init() of these.")
