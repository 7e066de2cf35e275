"""commjax's per-platform code, and the option that traces one platform's branch alone.

The rest of the suite traces only the CPU branches (``COMMJAX_TRACE_PLATFORM=cpu``,
``tests/conftest.py``). Here every branch is traced: each communicating transform, over
every codec, lowers for TPU and for CUDA from one trace (every branch of a
``lax.platform_dependent`` must give the same types, so a branch that drifts from the
others fails here without a TPU or GPU), and the option itself is checked: the CPU program
traced alone is the program traced with every branch, and it refuses to lower elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jax.extend.core import jaxprs_in_params

import commjax as cj
from commjax import _compat
from commjax.testing import same_bits

N = 8
AX = "data"

CODECS = {
    "identity": cj.identity(),
    "cast": cj.cast(jnp.bfloat16),
    "q8": cj.quantize(8),
    "q4": cj.quantize(4, block_size=64),
    "sign": cj.sign(),
    "fp8": cj.fp8("e4m3"),
    "top_k": cj.top_k(0.05),
    "powersgd": cj.powersgd(2),
    "lossless": cj.lossless(block_size=64, escapes=3),
}


def _params():
    # A leaf in whole (8, 128) tiles, a ragged one, a vector and a leaf too small to
    # compress: each takes its own path on some platform.
    return {"w": jnp.zeros((256, 384)), "r": jnp.zeros((130, 77)), "b": jnp.zeros((384,)),
            "s": jnp.zeros((5,))}


def _transforms() -> dict:
    out = {f"mean-{n}": (lambda c=c: cj.compressed_mean(c, AX, min_compress_size=256))
           for n, c in CODECS.items()}
    out["mean-sign-buckets"] = lambda: cj.compressed_mean(cj.sign(), AX, bucket_bytes=64 * 1024,
                                                          min_compress_size=256)
    out["mean-q4-reset"] = lambda: cj.compressed_mean(cj.quantize(4), AX, check_finite="reset",
                                                      min_compress_size=256)
    out["zero-q8"] = lambda: cj.zero(optax.adam(1e-3), AX, grad_codec=cj.quantize(8),
                                     weight_codec=cj.quantize(8), min_compress_size=256)
    return out


def _chooses_platform(jaxpr) -> bool:
    """Whether ``jaxpr`` (or a jaxpr inside it) still holds a choice made at lowering."""
    for eqn in jaxpr.eqns:
        if "branches_platforms" in eqn.params and eqn.params["branches_platforms"] is not None:
            return True
        if any(_chooses_platform(sub) for sub in jaxprs_in_params(eqn.params)):
            return True
    return False


def _traced(tx, mesh, params):
    state = cj.init_sharded(tx, params, mesh, AX)
    specs = cj.state_specs(state, AX)

    def local(p, g, s):
        u, s = tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(), P(AX), specs),
                                     out_specs=(P(), specs), check_vma=False))
    grads = jax.tree_util.tree_map(lambda a: jnp.ones((N,) + a.shape, a.dtype), params)
    return step, (params, grads, state)


@pytest.mark.parametrize("name", sorted(_transforms()))
def test_every_branch_traces_and_lowers_for_tpu_and_cuda(mesh, name):
    tx = _transforms()[name]()
    step, args = _traced(tx, mesh, _params())
    with _compat.TRACE_PLATFORM(None):
        traced = step.trace(*args)
        tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
        cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo" in tpu and "stablehlo" in cuda
    # The trace holds other platforms' code: at least one choice made at lowering.
    assert _chooses_platform(traced.jaxpr.jaxpr) or name == "mean-identity", name


def test_one_platform_traced_alone_is_the_same_cpu_program(mesh):
    """Traced with every branch or with the CPU's alone, a compressed step gives the same
    bits on the CPU; the program traced alone has no per-platform choice left in it, and
    lowering it for another platform fails naming the option."""
    tx = cj.compressed_mean(cj.quantize(4), AX, min_compress_size=256)
    params = _params()
    step, (p, _, state) = _traced(tx, mesh, params)
    keys = jax.random.split(jax.random.PRNGKey(0), len(params))
    grads = {k: 3.0 * jax.random.normal(key, (N,) + a.shape) for (k, a), key in zip(params.items(), keys)}
    with _compat.TRACE_PLATFORM("cpu"):
        alone = step.trace(p, grads, state)
        out_alone = jax.block_until_ready(step(p, grads, state))
        with pytest.raises(ValueError, match="commjax_trace_platform"):
            alone.lower(lowering_platforms=("tpu",))
    with _compat.TRACE_PLATFORM(None):
        every = step.trace(p, grads, state)
        out_every = jax.block_until_ready(step(p, grads, state))
    assert not _chooses_platform(alone.jaxpr.jaxpr)
    assert _chooses_platform(every.jaxpr.jaxpr)
    assert same_bits(out_alone, out_every)


@pytest.mark.parametrize("value", ["gpu", "CPU ", "all"])
def test_a_bad_trace_platform_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("COMMJAX_TRACE_PLATFORM", value)
    with pytest.raises(ValueError, match=r"\$COMMJAX_TRACE_PLATFORM.*one of"):
        _compat._trace_platform_state()


def test_unset_or_empty_traces_every_platform(monkeypatch):
    monkeypatch.setenv("COMMJAX_TRACE_PLATFORM", "")
    assert _compat._trace_platform_state() is _compat.TRACE_PLATFORM
    with _compat.TRACE_PLATFORM(None):
        jaxpr = jax.make_jaxpr(lambda x: _compat.platform_dependent(x, cpu=jnp.sin, default=jnp.cos))(1.0)
    assert _chooses_platform(jaxpr.jaxpr)
    with _compat.TRACE_PLATFORM("tpu"):
        jaxpr = jax.make_jaxpr(lambda x: _compat.platform_dependent(x, cpu=jnp.sin, default=jnp.cos))(1.0)
    # TPU has no branch of its own: the default is traced alone.
    assert "cos" in str(jaxpr) and "sin" not in str(jaxpr)
    grad = jax.grad(lambda x: _compat.platform_dependent(x, cpu=jnp.sin, default=jnp.cos))(0.5)
    np.testing.assert_allclose(np.asarray(grad), np.cos(0.5), rtol=1e-6)


def test_aot_compiles_what_a_users_step_traces(mesh):
    """``commjax.aot`` traces every branch even in a process that traces the CPU's
    alone (this suite): the program it measures for a TPU is the one a user's step
    compiles to there (one branch traced, XLA's TPU compiler placed a v5e top-k step's
    buffers otherwise: 965 MB a step against 621), and it lowers for the TPU."""
    from commjax import aot
    tx = cj.compressed_mean(cj.top_k(0.05), AX, min_compress_size=256)
    step, args = _traced(tx, mesh, _params())
    assert _compat.TRACE_PLATFORM.value == "cpu"
    with aot.traced_for(mesh):
        traced = step.trace(*args)
        assert "stablehlo" in traced.lower(lowering_platforms=("tpu",)).as_text()
    assert _compat.TRACE_PLATFORM.value == "cpu"
    assert _chooses_platform(traced.jaxpr.jaxpr)
