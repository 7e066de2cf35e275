"""Which implementation of a kernel runs, chosen by an argument; the one function that
runs it; and the helpers every implementation shares.

Every kernel in [`commjax.kernels`][] is a pair: a Pallas kernel and a pure-jnp
reference that computes the same bits. Each kernel function takes ``impl``:

==============  ==========================================================================
``impl``        what runs
==============  ==========================================================================
``None``        ``$COMMJAX_KERNELS`` if set, else ``"auto"`` (read when the caller is
                traced)
``"auto"``      [`auto_impl`][commjax.kernels._dispatch.auto_impl] of the default backend: the
reference on every backend
                today (see below)
``"pallas"``    the compiled kernel for whichever platform the computation is *lowered*
                for (Mosaic TPU; ``lax.platform_dependent``; on CUDA the reference);
                on CPU JAX refuses to lower it with an "only interpret mode" error
``"interpret"`` the kernel in Pallas interpret mode (any platform; the CPU test mode)
``"reference"`` the pure-jnp reference
==============  ==========================================================================

The codecs carry the choice as a field (``cj.quantize(bits=8, kernels="interpret")``),
hashable and so part of every trace that closes over the codec: two codecs that differ
only in ``kernels`` trace separately, and nothing global changes. The environment
variable is read at trace time: a function already traced keeps the implementation it
was traced with, so set it before the first trace (or pass the argument).

Why ``auto`` is the reference on GPU and TPU: there is no GPU kernel (compiled for an
H100, XLA's fusion of the references moves less memory than the Mosaic GPU kernels did:
``benchmarks/aot.py``), and the Mosaic TPU kernels compile for TPU targets but have not
run on one, nor moved less memory than the reference in the compiled TPU step
(``benchmarks/results/aot_*.json``: the lane-row quantize kernel is one pass over the
gradient and residual, less than half the reference's traffic for a 16M-value bucket,
but the v5e int8 step of a 21M MLP moves 1,108 MB with the kernels against 1,073 MB
with the reference, whose decode XLA fuses into the optimizer's update). An unverified kernel does not go
into a user's step by default: ``kernels="pallas"`` (or ``COMMJAX_KERNELS=pallas``) opts
in, and ``benchmarks/gpu_check.sh`` (``benchmarks/kernels.py --check``) is the on-device
check. A backend joins ``VERIFIED_BACKENDS`` once that check has passed on it.

Two things JAX does not do with a ``pallas_call`` and that callers must know:

* it cannot be differentiated (``jax.grad`` through a kernel fails). Gradient codecs
  are never differentiated in commjax (they act on gradients); a user who
  differentiates through ``Compressor.roundtrip`` must use the reference;
* Pallas interpret mode evaluates the kernel body with the plain JAX interpreter,
  which under ``shard_map(check_vma=True)`` rejects the body's constants (they are not
  typed as varying over the manual axes), even for a copy kernel. The TPU interpreter
  (``pltpu.InterpretParams``) accepts them but runs the body in host callbacks, which
  deadlocked the 8-device CPU collectives of a training step. So in ``interpret`` mode
  a kernel whose inputs *vary* over a manual axis runs the reference instead (same
  bits); invariant inputs (all-gathered payloads) and ``check_vma=False`` run the
  kernel. Compiled kernels run under both settings: their outputs are typed as varying
  where their inputs vary (``vary_like``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from commjax import _compat

__all__ = [
    "IMPLS", "ENV_VAR", "VERIFIED_BACKENDS", "check_impl", "resolve_impl", "auto_impl",
    "dispatch", "out_type", "vary_like", "fence", "pow2", "interpret_flag",
]

IMPLS = ("auto", "pallas", "interpret", "reference")
ENV_VAR = "COMMJAX_KERNELS"

#: Backends (``jax.default_backend()`` names) whose compiled kernels have passed the
#: on-device bit-exactness check: ``auto`` runs the kernels there. None yet.
VERIFIED_BACKENDS: frozenset = frozenset()


def check_impl(impl: Any, where: str, argument: str = "impl") -> Optional[str]:
    """``impl`` if it is ``None`` or one of ``IMPLS``, else an error naming the
    argument and the valid values."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(
            f"{where}: `{argument}` must be None (${ENV_VAR} if set, else 'auto') or one of "
            f"{', '.join(map(repr, IMPLS))}; got {impl!r}.")
    return impl


def resolve_impl(impl: Optional[str], where: str, argument: str = "impl") -> str:
    """``impl`` checked, or (``None``) ``$COMMJAX_KERNELS`` checked, or ``"auto"``."""
    if check_impl(impl, where, argument) is not None:
        return impl
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if not env:
        return "auto"
    if env not in IMPLS:
        raise ValueError(
            f"{where}: environment variable {ENV_VAR}={env!r} is not a kernel implementation; "
            f"set it to one of {', '.join(map(repr, IMPLS))} or unset it.")
    return env


def auto_impl(backend: str, verified: frozenset = VERIFIED_BACKENDS) -> str:
    """What ``"auto"`` runs on ``backend``: ``"pallas"`` where the compiled kernels are
    verified (``verified``), else ``"reference"`` (CPU, and GPU/TPU until checked)."""
    return "pallas" if backend in verified else "reference"


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
    outputs as varying where their inputs vary (``vary_like``).
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


def pow2(k: jax.Array) -> jax.Array:
    """``2.0**k`` exactly, for int32 ``k`` in the normal fp32 range ``[-126, 127]``, built
    from its exponent bits (``exp2`` need not be exact)."""
    return lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.uint32), jnp.float32)


def interpret_flag(args: Sequence[Any]) -> Any:
    """What to pass as ``pallas_call(interpret=...)`` in interpret mode for these inputs,
    or ``None`` where interpret mode cannot run them (inputs varying over a manual axis
    under ``check_vma=True``: see the module docstring)."""
    if _manual_axes(args):
        return None
    return True


def dispatch(
    reference: Callable[..., Any],
    *,
    impl: str,
    args: Sequence[Any],
    tpu: Optional[Callable[..., Any]] = None,
    gpu: Optional[Callable[..., Any]] = None,
    interpret: Optional[Callable[..., Any]] = None,
    auto: bool = True,
) -> Any:
    """Run one kernel on ``args`` with the resolved implementation ``impl``.

    ``reference(*args)`` is the pure-jnp oracle. ``tpu(*args)`` / ``gpu(*args)`` run the
    compiled kernel for that platform and ``interpret(*args, interpret=flag)`` the
    interpret-mode one; ``None`` means there is no such kernel (for this configuration)
    and the reference runs instead. ``args`` may hold ``None`` for absent optional
    operands. ``auto=False``: ``"auto"`` runs the reference even on a verified backend
    (for kernels that only pay off inside a larger fused kernel).
    """
    if impl == "auto":
        impl = auto_impl(jax.default_backend()) if auto else "reference"
    if impl == "reference" or (impl == "pallas" and tpu is None and gpu is None):
        return reference(*args)
    if impl == "interpret":
        flag = interpret_flag(args)
        if interpret is None or flag is None:
            return reference(*args)
        return interpret(*args, interpret=flag)
    # "pallas": the kernel for whichever platform this is lowered for; elsewhere a
    # compiled pallas_call, which JAX refuses to lower on CPU with a clear message.
    return _per_platform(
        args,
        tpu=tpu if tpu is not None else reference,
        cuda=gpu if gpu is not None else reference,
        default=tpu if tpu is not None else gpu,
    )


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

    return _compat.platform_dependent(
        *[args[i] for i in present], **{k: wrap(v) for k, v in branches.items()}
    )
