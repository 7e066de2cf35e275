"""Mode selection and the one function that runs a kernel or its reference.

Every kernel in :mod:`commjax.kernels` is a pair: a Pallas kernel and a pure-jnp
reference that computes the same bits. :func:`dispatch` picks one of them **at trace
time** from the current mode:

==============  ==========================================================================
mode            what runs
==============  ==========================================================================
``auto``        the Pallas kernel on the default backend if it is a TPU (Mosaic TPU) or a
                CUDA GPU (Mosaic GPU), the reference elsewhere (CPU, ROCm); decided from
                ``jax.default_backend()`` when the function is traced
``pallas``      the kernel for whichever platform the computation is *lowered* for
                (``lax.platform_dependent``): use it for cross-platform lowering and
                ``jax.export``; on CPU the lowering fails with JAX's "only interpret mode
                is supported" error
``interpret``   the kernel in Pallas interpret mode (any platform; the CPU test mode)
``reference``   the pure-jnp reference
==============  ==========================================================================

The mode comes from :func:`set_mode` / :func:`use_mode` if set, else from the
environment variable ``COMMJAX_KERNELS`` (read on every trace), else ``auto``. JAX
caches traces per function, and the mode is not part of its cache key: a function
already traced keeps the mode it was traced with. :func:`set_mode` and :func:`use_mode`
therefore clear JAX's caches (``jax.clear_caches()``) when the mode changes; after
changing the environment variable in a running process, call ``jax.clear_caches()``.

Two things JAX does not do with a ``pallas_call`` and that callers must know:

* it cannot be differentiated (``jax.grad`` through a kernel fails). Gradient codecs
  are never differentiated in commjax (they act on gradients); a user who
  differentiates through ``Compressor.roundtrip`` must use ``reference`` mode;
* Pallas interpret mode evaluates the kernel body with the plain JAX interpreter,
  which under ``shard_map(check_vma=True)`` rejects the body's constants (they are not
  typed as varying over the manual axes), even for a copy kernel. The TPU interpreter
  (``pltpu.InterpretParams``) accepts them but runs the body in host callbacks, which
  deadlocked the 8-device CPU collectives of a training step. So in ``interpret`` mode
  a kernel whose inputs *vary* over a manual axis runs the reference instead (same
  bits); invariant inputs (all-gathered payloads) and ``check_vma=False`` run the
  kernel. Compiled kernels (``auto``/``pallas`` on TPU/GPU) run under both settings:
  their outputs are typed as varying where their inputs vary (:func:`vary_like`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat

__all__ = ["MODES", "ENV_VAR", "get_mode", "set_mode", "use_mode", "dispatch", "out_type", "vary_like", "fence"]

MODES = ("auto", "pallas", "interpret", "reference")
ENV_VAR = "COMMJAX_KERNELS"

_override: Optional[str] = None


def _check_mode(mode: Any, where: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{where}: kernel mode must be one of {', '.join(map(repr, MODES))}; got {mode!r}.")
    return mode


def get_mode() -> str:
    """The mode in force now: :func:`set_mode`'s if set, else ``$COMMJAX_KERNELS``, else ``auto``."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if not env:
        return "auto"
    return _check_mode(env, f"environment variable {ENV_VAR}")


def set_mode(mode: Optional[str]) -> None:
    """Force a mode for every later trace (``None``: back to ``$COMMJAX_KERNELS``).

    Clears JAX's trace and compilation caches if the mode in force changes, so that
    functions traced before are traced again in the new mode.
    """
    global _override
    new = None if mode is None else _check_mode(mode, "commjax.kernels.set_mode")
    before = get_mode()
    _override = new
    if get_mode() != before:
        jax.clear_caches()


@contextlib.contextmanager
def use_mode(mode: str) -> Iterator[None]:
    """Context manager: :func:`set_mode` for the duration of a ``with`` block."""
    previous = _override
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)


def _manual_axes(args: Sequence[Any]) -> frozenset:
    out: frozenset = frozenset()
    for a in args:
        if a is None:
            continue
        vma = _compat.varying_axes(a)
        if vma:
            out = out | vma
    return out


def out_type(shape: Sequence[int], dtype: Any) -> Any:
    """A ``pallas_call`` output type that is accepted inside and outside ``shard_map``.

    Under ``shard_map(check_vma=True)`` a ``ShapeDtypeStruct`` output must name its
    manual-axis type (a keyword whose name differs between JAX versions); a plain
    ``ShapedArray`` is taken as is, as an invariant value. Kernel wrappers then mark their
    outputs as varying where their inputs vary (:func:`vary_like`).
    """
    return jax.core.ShapedArray(tuple(int(s) for s in shape), jnp.dtype(dtype))


def vary_like(outs: Any, inputs: Sequence[Any]) -> Any:
    """``outs`` typed as varying over every manual axis some input varies over."""
    axes = _manual_axes(inputs)
    return _compat.vary(outs, tuple(sorted(axes))) if axes else outs


def fence(product: jax.Array, factor: jax.Array) -> jax.Array:
    """``product`` (``= level * factor``), unchanged, but rounded to fp32 before any later
    use: no later addition can be fused with the multiplication into a multiply-add.

    A fused multiply-add rounds once, so its result depends on the compiler's choice to
    fuse, and compilers choose differently (XLA's CPU backend contracts a product with the
    sum it feeds when both sit in one fusion; a kernel's compiler decides for itself).
    ``lax.optimization_barrier`` does not stop this: XLA removes barriers before fusion.
    So the product goes through an integer OR with ``sign_bit(factor)``, which is 0 for
    every non-negative ``factor`` (scales and steps are never negative) but unknown to
    any compiler; a NaN product stays NaN. The same fence sits in the references and in
    the kernels.
    """
    guard = lax.shift_right_logical(lax.bitcast_convert_type(factor, jnp.uint32), jnp.uint32(31))
    bits = lax.bitcast_convert_type(product, jnp.uint32) | guard
    return lax.bitcast_convert_type(bits, jnp.float32)


def interpret_flag(args: Sequence[Any]) -> Any:
    """What to pass as ``pallas_call(interpret=...)`` in interpret mode for these inputs,
    or ``None`` where interpret mode cannot run them (inputs varying over a manual axis
    under ``check_vma=True``: see the module docstring)."""
    if _manual_axes(args):
        return None
    return True


def dispatch(
    name: str,
    reference: Callable[..., Any],
    *,
    tpu: Optional[Callable[..., Any]] = None,
    gpu: Optional[Callable[..., Any]] = None,
    interpret: Optional[Callable[..., Any]] = None,
    args: Sequence[Any],
    auto: bool = True,
) -> Any:
    """Run kernel ``name`` on ``args`` in the current mode.

    ``reference(*args)`` is the pure-jnp oracle. ``tpu(*args)`` / ``gpu(*args)`` build the
    compiled kernel for that platform and ``interpret(*args, interpret=flag)`` the
    interpret-mode one; ``None`` means this kernel (or this configuration of it) has no
    such kernel and the reference runs instead, in every mode. ``args`` may hold
    ``None`` for absent optional operands. ``auto=False``: the ``auto`` mode runs the
    reference (for kernels that only pay off inside a larger fused kernel).
    """
    mode = get_mode()
    if mode == "reference":
        return reference(*args)
    if mode == "interpret":
        flag = interpret_flag(args)
        if interpret is None or flag is None:
            return reference(*args)
        return interpret(*args, interpret=flag)
    tpu_fn = tpu if tpu is not None else reference
    gpu_fn = gpu if gpu is not None else reference
    if tpu is None and gpu is None:
        return reference(*args)
    if mode == "auto":
        if not auto:
            return reference(*args)
        backend = jax.default_backend()
        if backend == "tpu":
            return tpu_fn(*args)
        if backend != "gpu":
            return reference(*args)
        if gpu is None:
            return reference(*args)
        return _per_platform(args, cuda=gpu_fn, default=reference)
    # "pallas": the kernel for whichever platform this is lowered for; elsewhere a
    # compiled pallas_call, which JAX refuses to lower on CPU with a clear message.
    return _per_platform(args, tpu=tpu_fn, cuda=gpu_fn, default=tpu if tpu is not None else gpu)


def _per_platform(args: Sequence[Any], **branches: Callable[..., Any]) -> Any:
    """``lax.platform_dependent`` over ``args``, some of which may be ``None``."""
    present = [i for i, a in enumerate(args) if a is not None]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*xs: Any) -> Any:
            full = list(args)
            for i, x in zip(present, xs):
                full[i] = x
            return fn(*full)

        return run

    return lax.platform_dependent(
        *[args[i] for i in present], **{k: wrap(v) for k, v in branches.items()}
    )
