"""Argument checks shared by every factory: one message style, naming the argument.

Each check returns the normalised value or raises ``ValueError`` (``TypeError`` where the
kind of object is wrong) with ``"<factory>: `<name>` must be ...; got <value>."``, so the
user sees which call and which argument to fix.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "check_positive_int",
    "check_int",
    "check_choice",
    "check_float",
    "check_bool",
    "check_ratio",
    "check_dtype",
    "check_axis_pair",
    "check_real_leaves",
    "normalize_axis",
]


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: Any, lo: int, *, factory: str, why: str = "") -> int:
    """An integer ``>= lo``."""
    if not _is_int(value) or value < lo:
        raise ValueError(f"{factory}: `{name}` must be an integer >= {lo}{why}; got {value!r}.")
    return int(value)


def check_positive_int(name: str, value: Any, *, factory: str) -> int:
    """An integer ``>= 1``."""
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{factory}: `{name}` must be a positive integer, got {value!r}.")
    return int(value)


def check_choice(name: str, value: Any, allowed: Sequence[Any], *, factory: str) -> Any:
    """One of ``allowed``; among integer choices an integer (``4.0`` or ``True`` is not ``4``
    or ``1``, as ``==`` would say)."""
    ints = all(_is_int(a) for a in allowed)
    if (ints and not _is_int(value)) or value not in allowed:
        raise ValueError(
            f"{factory}: `{name}` must be one of {', '.join(map(repr, allowed))}; got {value!r}.")
    return value


def check_float(name: str, value: Any, lo: float, hi: float, *, factory: str,
                lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite real number in the interval ``[lo, hi]`` (each end open if asked)."""
    ok = not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.floating, np.integer))
    v = float(value) if ok else math.nan
    ok = ok and math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{factory}: `{name}` must be a number in {interval}; got {value!r}.")
    return v


def check_bool(name: str, value: Any, *, factory: str) -> bool:
    """``True`` or ``False`` (NumPy booleans too), not a truthy object."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{factory}: `{name}` must be True or False, got {value!r}.")
    return bool(value)


def check_ratio(name: str, value: Any, *, factory: str) -> float:
    """A fraction in ``(0, 1]``."""
    return check_float(name, value, 0.0, 1.0, factory=factory, lo_open=True)


def check_dtype(name: str, value: Any, allowed: Sequence[str], *, factory: str, hint: str = "") -> Any:
    """A dtype whose name is in ``allowed`` (e.g. ``("float32", "bfloat16")``); ``hint``
    is appended to the error (where to go instead)."""
    try:
        dname = jnp.dtype(value).name
    except TypeError:
        dname = None
    if dname not in allowed:
        names = ["jnp." + a for a in allowed]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        raise ValueError(f"{factory}: `{name}` must be {listed}, got {value!r}.{' ' + hint if hint else ''}")
    return jnp.dtype(value)


def check_seed(name: str, value: Any, *, factory: str) -> int:
    """Any integer (NumPy integers too), as ``jax.random.PRNGKey`` takes."""
    if not _is_int(value):
        raise ValueError(f"{factory}: `{name}` must be an integer, got {value!r}.")
    return int(value)


def check_axis_name(name: str, value: Any, *, factory: str, allow_none: bool = True) -> Any:
    """A mesh axis name (a string), a tuple/list of them, or ``None`` where allowed."""
    if value is None and allow_none:
        return None
    names = value if isinstance(value, (tuple, list)) else (value,)
    if not names or not all(isinstance(n, str) and n for n in names):
        none = " or None (one replica, no collective)" if allow_none else ""
        raise ValueError(
            f"{factory}: `{name}` must be a mesh axis name such as \"data\", a tuple of names{none}; "
            f"got {value!r}.")
    return normalize_axis(value)


def normalize_axis(axis_name: Any) -> Any:
    """A mesh axis name, or a tuple of names (lists become tuples: hashable)."""
    return tuple(axis_name) if isinstance(axis_name, list) else axis_name


def check_axis_pair(axis_name: Any, inner_axis_name: Optional[Any], *, factory: str) -> None:
    """``inner_axis_name`` needs an outer ``axis_name`` and shares no name with it."""
    if inner_axis_name is None:
        return
    if axis_name is None:
        raise ValueError(f"{factory}: `inner_axis_name` needs an outer `axis_name`.")
    outer = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
    inner = set(inner_axis_name) if isinstance(inner_axis_name, (tuple, list)) else {inner_axis_name}
    if outer & inner:
        raise ValueError(
            f"{factory}: `inner_axis_name` ({inner_axis_name!r}) must differ from `axis_name` "
            f"({axis_name!r}): the inner axis is averaged exactly, the outer one compressed.")


def check_real_leaves(tree: Any, *, factory: str) -> None:
    """Refuse complex leaves in ``tree`` (the parameters given to ``init``), naming the
    first: the optimizers that keep fp32 moments, residuals or public copies of the
    parameters would drop their imaginary parts (or, treating them as non-floating, leave
    them untrained or unaveraged)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise ValueError(
                f"{factory}: parameter {jax.tree_util.keystr(path)} is {jnp.dtype(dtype).name}; "
                f"{factory} handles real leaves only (its state would drop the imaginary part). "
                "Hold it as two real leaves (its real and imaginary parts), or average it "
                "with cj.compressed_mean, which sends complex leaves exactly.")
