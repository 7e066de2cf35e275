"""The one place where commjax adapts to differences between JAX versions.

commjax supports the JAX 0.10 line (Python 3.11 CPU machines) and 0.11+ (GPU/TPU
machines). Everything version-dependent goes through the small functions below so that
the rest of the library is written against a single API:

* ``shard_map``: ``jax.shard_map(..., check_vma=...)`` (new) or
  ``jax.experimental.shard_map.shard_map(..., check_rep=...)`` (old).
* varying/invariant values under ``check_vma=True``: ``jax.typeof(x).vma`` (0.11+) or
  ``jax.typeof(x).manual_axis_type.varying`` (0.10), ``lax.pcast`` or ``lax.pvary``.
* ``all_gather(..., to="invarying")`` where supported.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as _config  # config options' API: no public home in 0.10
from jax.extend.core import Primitive as _Primitive
from jax.extend.core import Var as _JaxprVar  # the jaxpr types' public home since 0.4.36
from jax.interpreters import ad, batching, mlir

__all__ = [
    "shard_map",
    "make_mesh",
    "axis_is_bound",
    "axis_size",
    "varying_axes",
    "vary",
    "all_gather_invariant",
    "barrier",
    "JAX_VERSION",
]

JAX_VERSION: tuple[int, ...] = tuple(
    int(p) for p in jax.__version__.split(".")[:3] if p.isdigit()
)


def _shard_map_impl() -> tuple[Callable[..., Any], str]:
    if hasattr(jax, "shard_map"):
        return jax.shard_map, "check_vma"
    from jax.experimental.shard_map import shard_map as _sm  # pragma: no cover

    return _sm, "check_rep"  # pragma: no cover


_SHARD_MAP, _CHECK_KW = _shard_map_impl()


def shard_map(
    f: Callable[..., Any],
    *,
    mesh: jax.sharding.Mesh,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
    axis_names: Optional[Any] = None,
) -> Callable[..., Any]:
    """``jax.shard_map`` with the replication-check flag spelled for this JAX.

    ``axis_names``: the mesh axes the function is manual over (the others are left to
    the compiler, as ``jax.jit`` with ``NamedSharding`` places them); ``None``: all."""
    kwargs = {_CHECK_KW: check_vma}
    if axis_names is not None and set(axis_names) != set(mesh.axis_names):
        kwargs["axis_names"] = frozenset(axis_names)
    return _SHARD_MAP(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)


def abstract_mesh(mesh: jax.sharding.Mesh) -> Any:
    """The mesh as code traced inside a ``shard_map`` sees it (some axes manual): what a
    nested ``shard_map`` over the remaining axes must be given."""
    current = _current_mesh()
    return mesh if current is None or not getattr(current, "axis_names", ()) else current


def _current_mesh() -> Any:
    """The abstract mesh of the trace in progress (``None`` where this JAX has none)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    return get() if get is not None else None


def typed_cond(pred: Any, true_fn: Callable[[Any], Any], false_fn: Callable[[Any], Any], operands: Any) -> Any:
    """``lax.cond(pred, true_fn, false_fn, operands)`` with each output leaf of both
    branches made varying over the union of the manual axes it varies over in either
    (``check_vma=True`` needs the branches' types equal; a branch that passes a state leaf
    through types it as it came in, one that computes it from this replica's values as
    varying)."""
    avals = [jax.make_jaxpr(fn)(operands).out_avals for fn in (true_fn, false_fn)]
    union = [tuple(sorted((aval_varying_axes(a) or frozenset()) | (aval_varying_axes(b) or frozenset())))
             for a, b in zip(*avals)]

    def typed(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(ops: Any) -> Any:
            leaves, treedef = jax.tree_util.tree_flatten(fn(ops))
            return jax.tree_util.tree_unflatten(treedef, [vary(l, u) if u else l for l, u in zip(leaves, union)])
        return run

    return lax.cond(pred, typed(true_fn), typed(false_fn), operands)


def make_mesh(
    axis_shapes: Sequence[int],
    axis_names: Sequence[str],
    *,
    devices: Optional[Sequence[Any]] = None,
) -> jax.sharding.Mesh:
    """A mesh whose axes are all ``Auto`` (so ``P('data')`` accepts unsharded inputs)."""
    kwargs: dict[str, Any] = {}
    if devices is not None:
        kwargs["devices"] = devices
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is not None and "axis_types" in inspect.signature(jax.make_mesh).parameters:
        kwargs["axis_types"] = (axis_type.Auto,) * len(axis_names)
    return jax.make_mesh(tuple(axis_shapes), tuple(axis_names), **kwargs)


def axis_is_bound(axis_name: Any) -> bool:
    """Whether ``axis_name`` (a name or tuple of names) is bound by shard_map/pmap here."""
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    for name in names:
        try:
            lax.axis_index(name)
        except NameError:
            return False
    return True


def axis_size(axis_name: Any) -> int:
    """Static size of a bound axis (product over a tuple of names)."""
    if hasattr(lax, "axis_size"):
        return int(lax.axis_size(axis_name))
    return int(lax.psum(1, axis_name))  # pragma: no cover


def _manual_axis_names() -> frozenset:
    """The manual axes of the ``shard_map`` being traced (empty outside one)."""
    return frozenset(getattr(_current_mesh(), "manual_axes", ()) or ())


def _vma_of(x: Any) -> Optional[frozenset]:
    try:
        aval = jax.typeof(x)
    except Exception:  # pragma: no cover - not a JAX value
        return None
    return aval_varying_axes(aval)


def aval_varying_axes(aval: Any) -> Optional[frozenset]:
    """``varying_axes`` of an abstract value (e.g. a traced jaxpr's ``out_avals``)."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "manual_axis_type", None)
        vma = getattr(mat, "varying", None) if mat is not None else None
    return frozenset(vma) if vma is not None else None


def varying_axes(x: Any) -> Optional[frozenset]:
    """Mesh axes along which ``x`` varies, as tracked by ``check_vma=True``.

    Returns ``None`` when this JAX does not track it. Under ``check_vma=False`` (and
    ``pmap``) nothing is tracked and the result is the empty set for every value.
    """
    return _vma_of(x)


def vary(tree: Any, axis_name: Any) -> Any:
    """Mark every array of ``tree`` as varying over ``axis_name`` (a no-op if it already is).

    Under ``shard_map(check_vma=True)`` the gradient with respect to an *invariant*
    (replicated) parameter is summed over the axis by JAX itself, during
    differentiation, so compression would come too late. Taking the gradient with
    respect to ``vary(params, axis)`` keeps it per-replica.
    """
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    unbound = [n for n in names if not axis_is_bound(n)]
    if unbound:
        raise NameError(
            f"vary: mesh axis {unbound[0]!r} is not bound here. Call cj.vary(params, axis) inside "
            "the jax.shard_map (or jax.pmap, or jax.vmap) that binds the axis, with the axis name of its mesh.")

    manual = _manual_axis_names()

    def one(x: Any) -> Any:
        vma = _vma_of(x)
        # Only a shard_map's manual axes type values varying; an axis bound by jax.vmap
        # (or pmap) tracks nothing, and JAX refuses the cast there.
        missing = tuple(n for n in names if vma is not None and n not in vma and n in manual)
        if not missing:
            return x
        if hasattr(lax, "pcast"):
            return lax.pcast(x, missing, to="varying")
        if hasattr(lax, "pvary"):  # pragma: no cover
            return lax.pvary(x, missing)
        return x  # pragma: no cover

    return jax.tree_util.tree_map(one, tree)


_ALL_GATHER_HAS_TO = "to" in inspect.signature(lax.all_gather).parameters


def all_gather_invariant(x: jax.Array, axis_name: Any, *, tiled: bool = False) -> jax.Array:
    """All-gather whose result is typed as replicated (identical on every replica)."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if _ALL_GATHER_HAS_TO and set(names) <= _manual_axis_names():
        vma = _vma_of(x)
        if vma is not None:
            if any(n not in vma for n in names):
                x = vary(x, axis_name)
        return lax.all_gather(x, axis_name, tiled=tiled, to="invarying")
    return lax.all_gather(x, axis_name, tiled=tiled)  # jax.vmap, pmap: nothing is typed


def all_to_all(x: jax.Array, axis_name: Any) -> jax.Array:
    """Tiled all-to-all along the leading axis: chunk ``j`` of the input goes to replica ``j``."""
    x = vary(x, axis_name)
    return lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def replicated_over_one(tree: Any, axis_name: Any) -> Any:
    """``tree`` typed replicated over ``axis_name``, an axis of one replica: its ``psum``,
    the value itself (an all-reduce of one participant, which XLA removes). For the paths
    that skip the exchange on one replica, whose results ``shard_map(check_vma=True)``
    would otherwise type as varying."""
    return psum(tree, axis_name)


def psum(x: Any, axis_name: Any) -> Any:
    """``lax.psum`` of values that are first made varying, so every replica adds its own."""
    return lax.psum(vary(x, axis_name), axis_name)


def as_uint_words(x: jax.Array) -> jax.Array:
    """Bit-cast a float/int array to unsigned words of the same width (no value change)."""
    width = jnp.dtype(x.dtype).itemsize
    target = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]
    if jnp.dtype(x.dtype) == jnp.dtype(target):
        return x
    return lax.bitcast_convert_type(x, target)


def first_uses(fun: Callable[..., Any], *args: Any) -> list[int]:
    """For each leaf of ``args`` (flattened in order), the index of the first equation of
    ``fun``'s traced program that reads it (the number of equations if none does)."""
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    first: dict = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, _JaxprVar):
                first.setdefault(v, k)
    return [first.get(v, len(jaxpr.eqns)) for v in jaxpr.invars]


# ------------------------------------------------------------------ ordering barrier
# ``lax.optimization_barrier`` requires its operands to vary over the same manual axes and
# casts invariant ones to varying: a replicated mean passed through it beside a
# per-replica value comes out typed per replica. ``barrier`` is the same HLO
# OptimizationBarrier with each operand's type kept.
def _make_barrier():
    prim = _Primitive("commjax_barrier")
    prim.multiple_results = True
    prim.def_impl(lambda *args: list(args))
    prim.def_abstract_eval(lambda *avals: list(avals))

    def lowering(ctx, *args):
        return mlir.lower_fun(lambda *a: lax.optimization_barrier(list(a)), multiple_results=True)(ctx, *args)

    mlir.register_lowering(prim, lowering)
    ad.primitive_jvps[prim] = lambda primals, tangents: (prim.bind(*primals), list(tangents))
    batching.primitive_batchers[prim] = lambda args, dims: (prim.bind(*args), dims)
    return prim


_BARRIER = _make_barrier()


def barrier(tree: Any) -> Any:
    """``tree`` unchanged, every value computed before any is used (an HLO
    OptimizationBarrier), each keeping its varying/invariant type under ``check_vma``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, _BARRIER.bind(*leaves)) if leaves else tree


# ------------------------------------------------------------------ per-platform code
#: The platforms ``COMMJAX_TRACE_PLATFORM`` may name (``lax.platform_dependent``'s keys).
TRACE_PLATFORMS = ("cpu", "tpu", "cuda", "rocm")
_TRACE_PLATFORM_ENV = "COMMJAX_TRACE_PLATFORM"


def _trace_platform_state() -> Any:
    """The ``commjax_trace_platform`` JAX config option, set from
    ``$COMMJAX_TRACE_PLATFORM``. It is part of the jit cache key, so a program traced
    under one value is never reused under another."""
    value = os.environ.get(_TRACE_PLATFORM_ENV, "")
    if value not in ("", *TRACE_PLATFORMS):
        raise ValueError(f"${_TRACE_PLATFORM_ENV}={value!r} is not a platform: set it to one of "
                         f"{TRACE_PLATFORMS}, or leave it unset to trace every platform's code")
    state = _config.config_states.get("commjax_trace_platform")
    if state is None:
        # JAX reads the variable by the option's name too; it is read here instead, so
        # that an empty value means unset.
        saved = os.environ.pop(_TRACE_PLATFORM_ENV, None)
        try:
            state = _config.optional_enum_state(
                name="commjax_trace_platform", enum_values=list(TRACE_PLATFORMS), default=None,
                help="Trace only this platform's branch of commjax's per-platform code "
                     "(None: every platform's, as lax.platform_dependent does).",
                include_in_jit_key=True, include_in_trace_context=True)
        finally:
            if saved is not None:
                os.environ[_TRACE_PLATFORM_ENV] = saved
        if value:
            jax.config.update("commjax_trace_platform", value)
    return state


TRACE_PLATFORM = _trace_platform_state()


def _make_traced_for():
    # An identity on one output of a branch traced alone. It lowers to nothing, and it
    # refuses to lower for any platform but the one traced: without it a program traced
    # for one chip would lower silently for another with the wrong chip's layout.
    prim = _Primitive("commjax_traced_for")
    prim.def_impl(lambda x, *, platform: x)
    prim.def_abstract_eval(lambda aval, *, platform: aval)

    def lowering(ctx, x, *, platform):
        wanted = tuple(ctx.module_context.platforms)
        if wanted != (platform,):
            raise ValueError(
                f"this program was traced with commjax_trace_platform={platform!r} "
                f"(${_TRACE_PLATFORM_ENV}) and holds only the {platform} branch of commjax's "
                f"per-platform code; to lower it for {wanted}, trace it again with the option "
                f"unset (jax.config.update('commjax_trace_platform', None)) or set to that platform")
        return [x]

    mlir.register_lowering(prim, lowering)
    ad.deflinear2(prim, lambda ct, x, *, platform: [ct])
    batching.defvectorized(prim)
    return prim


_TRACED_FOR = _make_traced_for()


def platform_dependent(*args: Any, default: Optional[Callable[..., Any]] = None,
                       **branches: Callable[..., Any]) -> Any:
    """``lax.platform_dependent(*args, default=default, **branches)``, or, when the
    ``commjax_trace_platform`` option names a platform, only that platform's branch.

    ``lax.platform_dependent`` traces every branch, because the platform is known only at
    lowering. Tracing commjax's TPU, GPU and CPU layouts of one step costs more than the
    one that runs (on the CPU, about 40% of a small step's time to first result). With the
    option set (``COMMJAX_TRACE_PLATFORM=cpu``, or ``jax.config.update(
    "commjax_trace_platform", "cpu")``), only the chosen branch is traced, inline: the
    same computation for that platform, and lowering it for any other fails with a
    ``ValueError`` that says so, instead of running code laid out for another chip.
    Without the conditional XLA may schedule the program differently: on the CPU the bits
    are the same, but XLA's TPU compiler placed a v5e top-k step's buffers worse (965 MB a
    step against 621), so TPU steps, and ``commjax.aot``, trace with the option unset.
    """
    chosen = TRACE_PLATFORM.value
    branch = branches.get(chosen, default) if chosen is not None else None
    if branch is None:
        return lax.platform_dependent(*args, default=default, **branches)
    leaves, treedef = jax.tree_util.tree_flatten(branch(*args))
    if leaves:
        leaves[0] = _TRACED_FOR.bind(leaves[0], platform=chosen)
    return jax.tree_util.tree_unflatten(treedef, leaves)
