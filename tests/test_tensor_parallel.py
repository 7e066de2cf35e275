"""commjax.collectives.tp_copy / tp_reduce (Megatron's f and g): a tensor-parallel MLP
against its unsharded reference, compressed bytes per mesh axis, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat, axes
from commjax import collectives as cc

Q8 = cj.quantize(8, stochastic=False)
H4 = cj.hadamard(cj.quantize(4, stochastic=False))


@pytest.fixture(scope="module")
def mesh2d():
    return _compat.make_mesh((4, 2), ("data", "model"))


def _weights():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k1, (4 * 8, 64))
    return x, jax.random.normal(k2, (64, 256)) / 8, jax.random.normal(k3, (256, 64)) / 16


def _mlp(x, w1, w2, codec):
    h = cc.tp_copy(x, "model", grad_codec=codec)
    return cc.tp_reduce(jax.nn.gelu(h @ w1) @ w2, "model", codec=codec)


def _step(mesh, codec, check_vma=True):
    def local(x, w1, w2):
        loss = lambda a, b, c: jnp.sum(jnp.sin(_mlp(a, b, c, codec)))  # noqa: E731
        return _mlp(x, w1, w2, codec), jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)

    specs = (P("data"), P(None, "model"), P("model", None))
    return jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P("data"), specs),
                                     check_vma=check_vma))


@pytest.mark.parametrize("check_vma", [True, False])
def test_exact_pair_is_the_unsharded_mlp(mesh2d, check_vma):
    x, w1, w2 = _weights()
    y, (gx, g1, g2) = _step(mesh2d, None, check_vma)(x, w1, w2)
    ref = lambda a, b, c: jnp.sin(jax.nn.gelu(a @ b) @ c)  # noqa: E731
    np.testing.assert_allclose(y, jax.nn.gelu(x @ w1) @ w2, rtol=1e-5, atol=1e-5)
    rx, r1, r2 = jax.grad(lambda *a: jnp.sum(ref(*a)), argnums=(0, 1, 2))(x, w1, w2)
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-5)
    if check_vma:  # replicated weights: JAX sums their gradients over "data" itself
        np.testing.assert_allclose(g1, r1, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(g2, r2, rtol=1e-4, atol=1e-4)


def test_compressed_bytes_on_the_model_axis(mesh2d):
    """Forward g and backward f of int8 and Hadamard int4: the model axis carries the
    two all-reduces' encoded words (== the plan), 3.9x and 7.7x below fp32; the values
    stay close."""
    x, w1, w2 = _weights()
    y_ref, _ = _step(mesh2d, None)(x, w1, w2)
    exact = None
    for codec, ratio, tol in ((None, 1.0, 1e-5), (Q8, 3.5, 0.05), (H4, 7.0, 0.8)):
        f = _step(mesh2d, codec)
        y, _ = f(x, w1, w2)
        np.testing.assert_allclose(y, y_ref, atol=tol)
        model = axes.bytes_by_axis(cj.collective_bytes(f, x, w1, w2), mesh2d)["model"]
        # Two all-reduces (forward g, backward f) of 8 x 64 floats over 2 replicas.
        plan = 2 * cj.ring_bytes("all-reduce", 4 * (512 if codec is None else codec.payload_words(512)), 2)
        assert model == pytest.approx(plan)
        exact = model if codec is None else exact
        assert exact / model >= ratio


@pytest.mark.parametrize("codec", [None, Q8], ids=["exact", "int8"])
def test_tp_copy_of_an_input_typed_varying_gives_it_the_same_gradient(mesh2d, codec):
    """``x`` the same on every model replica but typed varying over the axis (as an
    activation received through a send is): the backward sum comes back typed as ``x``,
    with the bits of the replicated input's gradient (the custom VJP refused a
    replicated-typed cotangent for a varying input)."""
    x, w1, w2 = _weights()

    def local(v, a, b, vary):
        v = cj.vary(v, "model") if vary else v
        return jax.grad(lambda u: jnp.sum(jnp.sin(_mlp(u, a, b, codec))))(v)

    specs = (P("data"), P(None, "model"), P("model", None))
    grads = [jax.jit(_compat.shard_map(functools.partial(local, vary=vary), mesh=mesh2d, in_specs=specs,
                                       out_specs=P("data", None) if not vary else P("data", "model")))(x, w1, w2)
             for vary in (False, True)]
    np.testing.assert_array_equal(np.asarray(grads[1])[:, :64], np.asarray(grads[0]))
    np.testing.assert_array_equal(np.asarray(grads[1])[:, 64:], np.asarray(grads[0]))


def test_tp_reduce_backward_is_identity_under_check_vma_false(mesh2d):
    """lax.psum's own transpose would sum the cotangent again without check_vma."""
    x = jax.random.normal(jax.random.PRNGKey(5), (4 * 2, 8))

    def local(v):
        return jax.grad(lambda u: jnp.sum(cc.tp_reduce(u, "model") * 3.0))(v)

    g = jax.jit(_compat.shard_map(local, mesh=mesh2d, in_specs=P("data"), out_specs=P("data"),
                                  check_vma=False))(x)
    np.testing.assert_array_equal(g, 3.0 * np.ones_like(x))


def test_errors_name_the_fix(mesh2d):
    # A call outside shard_map (the unbound axis) is checked in tests/test_contract.py.
    bad = lambda v: cc.tp_reduce(v, "model", codec=cj.powersgd(2))  # noqa: E731
    with pytest.raises(ValueError, match="codec"):
        jax.jit(_compat.shard_map(bad, mesh=mesh2d, in_specs=P(), out_specs=P()))(jnp.zeros((4, 4)))
    with pytest.raises(cj.AxisNotBoundError, match="tensor"):
        jax.jit(_compat.shard_map(lambda v: cc.tp_copy(v, "tensor"), mesh=mesh2d, in_specs=P(),
                                  out_specs=P()))(jnp.zeros(4))
