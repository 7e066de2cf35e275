"""Error feedback on dead rows, for every codec that keeps a residual: rows that trained for
a few steps and then see a gradient of exactly zero (dead ReLU units, unused embeddings)
while the other rows keep training, for 2000 steps.

The residual of a dead row shrinks by the codec's step every step, through every
magnitude down to fp32's subnormals (where fp8 once turned finite blocks into NaN): it must
stay finite and bounded, ``metrics['nonfinite']`` must stay 0, and the mean must stay
finite and bit-identical on every replica.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat

AX = "data"
N = 2  # two replicas: the property is per replica; 2000 steps of 8-device collectives cost more
STEPS = 2000
ALIVE = 8  # steps during which the dead rows still get a gradient
SHAPE = (16, 256)  # rows 0..7 train throughout, rows 8..15 die after ALIVE steps

CODECS = {
    "q8": cj.quantize(8),
    "q4": cj.quantize(4, stochastic=False),
    "q2": cj.quantize(2, block_size=64),
    "qsgd": cj.qsgd(),
    "terngrad": cj.terngrad(),
    "sign": cj.sign(),
    "fp8_e4m3": cj.fp8(),
    "fp8_e5m2": cj.fp8("e5m2"),
    "fp8_stochastic": cj.fp8(stochastic=True),
    "cast_bf16": cj.cast(jnp.bfloat16),
    "hadamard_q4": cj.hadamard(cj.quantize(4, stochastic=False)),
    "top_k": cj.top_k(0.05),
    "random_k": cj.random_k(0.05),
    "powersgd": cj.powersgd(2),
}


def _gradient(step, replica):
    """Live rows: a smooth, replica-dependent signal of order 1; dead rows: the same until
    ``ALIVE`` steps, then exactly zero."""
    rows = jnp.arange(SHAPE[0])[:, None].astype(jnp.float32)
    cols = jnp.arange(SHAPE[1])[None, :].astype(jnp.float32)
    t = step.astype(jnp.float32)
    g = jnp.sin(0.37 * cols + 1.3 * rows + 0.11 * t + replica.astype(jnp.float32)) * (1.0 + rows)
    dead = (rows >= SHAPE[0] // 2) & (step >= ALIVE)
    return jnp.where(dead, 0.0, g)


def _run(codec):
    mesh = _compat.make_mesh((N,), (AX,), devices=jax.devices()[:N])
    tx = cj.compressed_mean(codec, AX)
    params = {"w": jnp.zeros(SHAPE)}
    state = cj.init_sharded(tx, params, mesh, AX)
    specs = cj.state_specs(state, AX)

    def run(s):
        replica = lax.axis_index(AX)

        def one(carry, step):
            s, worst = carry
            u, s = tx.update({"w": _gradient(step, replica)}, s)
            bad = jnp.logical_not(jnp.all(jnp.isfinite(u["w"])))
            res = jnp.max(jnp.stack([jnp.max(jnp.abs(e)) for e in s.residual] or [jnp.zeros(())]))
            worst = jnp.stack([worst[0] + bad, jnp.maximum(worst[1], res), worst[2] + s.metrics["nonfinite"][0]])
            return (s, worst), u["w"][SHAPE[0] // 2:].sum()

        (s, worst), dead_sums = lax.scan(one, (s, jnp.zeros(3)), jnp.arange(STEPS))
        return s, worst[None], dead_sums[None]

    f = jax.jit(_compat.shard_map(run, mesh=mesh, in_specs=(specs,),
                                  out_specs=(specs, P(AX), P(AX)), check_vma=False))
    return f(state)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_dead_rows_stay_finite_for_2000_steps(name):
    state, worst, dead_sums = _run(CODECS[name])
    worst = np.asarray(worst)
    assert np.all(worst[:, 0] == 0), f"{name}: a step's mean was not finite"
    assert np.all(worst[:, 2] == 0), f"{name}: metrics['nonfinite'] was set on a finite step"
    # Bounded: the gradient is at most 16 in magnitude; a residual holds at most a few
    # steps' worth of what was not sent (top-k and random-k at 5% hold about 20).
    assert np.all(worst[:, 1] <= 16.0 * 64), f"{name}: residual grew to {worst[:, 1].max():.3g}"
    for leaf in jax.tree_util.tree_leaves(state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert np.all(np.isfinite(np.asarray(leaf))), f"{name}: final state not finite"
    sums = np.asarray(dead_sums)
    for r in range(1, N):  # the mean is bit-identical on every replica, step after step
        np.testing.assert_array_equal(sums[r], sums[0], err_msg=name)
    res = [np.asarray(e).reshape(N, -1) for e in state.residual]
    if res and name not in ("top_k", "random_k", "powersgd", "sign"):
        # Block codecs send a dead row's residual until it is gone: it decays to (near) 0.
        dead = np.concatenate([e.reshape(N, SHAPE[0], -1)[:, SHAPE[0] // 2:] for e in res
                               if e.shape[1] == np.prod(SHAPE)], axis=-1)
        assert dead.size == 0 or np.max(np.abs(dead)) < 1e-6, f"{name}: dead residual {np.max(np.abs(dead)):.3g}"
