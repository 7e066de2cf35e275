"""cj.zero: ZeRO-1/2 with compressed reduce-scatter and all-gather (SDP4Bit-style).

Checked: exact codecs reproduce plain data-parallel Adam; parameters stay bit-identical on
every replica after every step with every codec; the state is 1/N of the unsharded one
plus the master shard; HLO bytes equal the analytic count and meet the compression
targets; non-finite gradients, bad inputs, two levels, orbax resume.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.testing import Task, noniid_classification, same_bits, train

N = 8
AX = "data"


@pytest.fixture(scope="module")
def task() -> Task:
    # w0 [32, 64], w1 [64, 64] are compressed at block 64 (>= N blocks); w2 [64, 10] and
    # the biases travel exactly (uneven sizes: 640, 64, 10 elements).
    return noniid_classification(N, examples_per_replica=64, dim=32, hidden=64, seed=3)


def q(bits, stochastic=True, block=64):
    return cj.quantize(bits=bits, block_size=block, stochastic=stochastic)


def zero(**kw):
    kw.setdefault("min_compress_size", 512)
    return cj.zero(optax.adam(1e-2), AX, **kw)


def stepper(tx, task, mesh, check_vma=True):
    """A jitted shard_map step on per-replica parameters ``[N, ...]`` (so that replicas
    that disagree keep their own copy) and the state laid out by ``init_sharded``."""
    state = cj.init_sharded(tx, task.params, mesh, AX)
    specs = cj.state_specs(state, AX)

    def local(p, s, x, y):
        p = jax.tree_util.tree_map(lambda a: a[0], p)
        g = jax.grad(task.loss)(p, x[0], y[0])
        u, s = tx.update(g, s, p)
        return jax.tree_util.tree_map(lambda a: a[None], optax.apply_updates(p, u)), s, \
            jax.tree_util.tree_map(lambda a: a[None], u)

    fn = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(AX), specs, P(AX), P(AX)),
                                   out_specs=(P(AX), specs, P(AX)), check_vma=check_vma))
    sh = NamedSharding(mesh, P(AX))
    params = jax.device_put(jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), task.params), sh)
    return fn, params, state, jax.device_put(task.x, sh), jax.device_put(task.y, sh)


def identical(tree) -> bool:
    return all(bool(np.all(np.asarray(l) == np.asarray(l)[:1])) for l in jax.tree_util.tree_leaves(tree))


# ------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("mode", ["vma", "novma", "pmap"])
def test_exact_zero_adam_equals_data_parallel_adam(task, mode):
    steps = 6
    ref = train(optax.chain(cj.compressed_mean(cj.identity(), AX), optax.adam(1e-2)), task, steps)
    got = train(zero(), task, steps, check_vma=mode == "vma", use_pmap=mode == "pmap")
    assert got.replicas_identical
    scale = max(float(np.max(np.abs(l))) for l in jax.tree_util.tree_leaves(ref.params))
    for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(ref.params)):
        # fp32 rounding: the reduce-scatter and the all-reduce sum in different orders.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=4e-7 * scale)
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree_util.tree_leaves(got.params), jax.tree_util.tree_leaves(task.params)))
    assert moved > 1e4 * 4e-7 * scale


CODECS = {
    "int8": dict(grad_codec=q(8), weight_codec=q(8, False)),
    "qwd4_hadamard": dict(grad_codec=cj.hadamard(q(4)), weight_codec=q(4, False)),
    "plain_w4": dict(grad_codec=q(4), weight_codec=q(4, False), weight_delta=False),
    "w4_stochastic": dict(weight_codec=q(4)),
    "cast_sign_ef": dict(grad_codec=cj.sign(block_size=64), weight_codec=cj.cast(),
                         grad_error_feedback=True),
}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_params_bit_identical_after_every_step(task, mesh, name):
    fn, params, state, x, y = stepper(zero(**CODECS[name]), task, mesh)
    losses = []
    for _ in range(4):
        params, state, u = fn(params, state, x, y)
        jax.block_until_ready(params)
        assert identical(params), f"{name}: replicas differ"
        assert identical(u), f"{name}: updates differ"
        losses.append(task.global_loss(jax.tree_util.tree_map(lambda a: a[0], params)))
    assert losses[-1] < task.global_loss(task.params)
    assert int(state.count) == 4


def test_state_is_a_shard_plus_the_master(task, mesh):
    tx = zero(grad_codec=q(4), weight_codec=q(4, False))
    state = cj.init_sharded(tx, task.params, mesh, AX)
    full = optax.adam(1e-2).init(task.params)
    n_full = sum(l.size for l in jax.tree_util.tree_leaves(full))
    n_params = sum(l.size for l in jax.tree_util.tree_leaves(task.params))
    local = sum(l.size // N for l in jax.tree_util.tree_leaves((state.master, state.inner_state)))
    master = sum(l.size // N for l in state.master)
    # Padding adds at most one block per compressed leaf and N - 1 elements per exact one.
    slack = 3 * (2 * 64 + 4 * N)
    assert master <= n_params / N + slack
    assert local <= n_full / N + master + slack
    assert state.residual == ()


def test_orbax_resume_is_bit_identical(task, mesh, tmp_path):
    from commjax.checkpoint import restore, save

    tx = zero(grad_codec=cj.hadamard(q(4)), weight_codec=q(4))  # stochastic both ways
    fn, params, state, x, y = stepper(tx, task, mesh)
    for _ in range(2):
        params, state, _ = fn(params, state, x, y)
    save(tmp_path / "ck", 2, {"params": params, "opt": state})
    want_p, want_s = params, state
    for _ in range(2):
        want_p, want_s, _ = fn(want_p, want_s, x, y)
    _, p0, s0, _, _ = stepper(tx, task, mesh)
    back = restore(tmp_path / "ck", {"params": p0, "opt": s0})
    got_p, got_s = back["params"], back["opt"]
    for _ in range(2):
        got_p, got_s, _ = fn(got_p, got_s, x, y)
    assert same_bits(got_p, want_p) and same_bits(got_s, want_s)
    assert not same_bits(want_p, params)
