"""CHOCO-SGD gossip (cj.choco) and EF21 (compressed_mean(error_feedback="ef21")): the
maths on a small quadratic, bytes against the HLO, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.optimizers.choco import consensus_distance, neighbour_perms

N = 8
PARAMS = {"w": jnp.zeros((32, 24)), "b": jnp.zeros((24,))}
TARGETS = jax.random.normal(jax.random.PRNGKey(0), (N, 32, 24))


def _optimum_loss(w_mean):
    return float(np.mean(np.sum((np.asarray(w_mean)[None] - np.asarray(TARGETS)) ** 2, axis=(1, 2)) / 2))


def _stepper(mesh, tx, per_replica: bool):
    state = cj.init_sharded(tx, PARAMS, mesh, "data", per_replica_params=per_replica)
    specs = cj.state_specs(state, "data")
    pspec = P("data") if per_replica else P()

    def step(p, s, t):
        p1 = jax.tree_util.tree_map(lambda a: a[0], p) if per_replica else p
        loss = lambda q: jnp.sum((q["w"] - t[0]) ** 2) / 2 + jnp.sum(q["b"] ** 2)  # noqa: E731
        u, s = tx.update(jax.grad(loss)(cj.vary(p1, "data")), s, p1)
        new = optax.apply_updates(p1, u)
        out = jax.tree_util.tree_map(lambda a: a[None], new) if per_replica else new
        return out, s, consensus_distance(new, "data") if per_replica else jnp.zeros(())

    f = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(pspec, specs, P("data")),
                                  out_specs=(pspec, specs, P())))
    params = jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), PARAMS) if per_replica else PARAMS
    return f, params, state


def test_neighbours_ring_and_torus():
    ring = neighbour_perms(8, "ring")
    assert [sorted(d for s, d in p) for p in ring] == [list(range(8))] * 2
    assert dict(ring[0])[7] == 0 and dict(ring[1])[0] == 7
    torus = neighbour_perms(8, "torus")  # 2 x 4
    assert len(torus) == 4 and {dict(p)[0] for p in torus} == {1, 3, 4}


@pytest.mark.parametrize("codec, gamma", [(None, 1.0), (cj.sign(), 0.3)])
def test_choco_reaches_the_mean_and_bytes_equal_the_plan(mesh, codec, gamma):
    """Replica r pulls towards its own target; gossip makes the replicas' mean the
    minimiser of the mean loss, the consensus distance stays bounded, and the compiled
    step sends what its plan says (the consensus-distance all-reduces aside)."""
    tx = cj.choco(optax.sgd(0.2), "data", codec=codec, gamma=gamma)
    f, params, state = _stepper(mesh, tx, per_replica=True)
    for _ in range(60):
        params, state, cd = f(params, state, TARGETS)
    w_mean = np.asarray(params["w"]).mean(0)
    assert _optimum_loss(w_mean) == pytest.approx(_optimum_loss(np.asarray(TARGETS).mean(0)), rel=1e-3)
    spread = float(np.mean(np.sum((np.asarray(TARGETS) - np.asarray(TARGETS).mean(0)) ** 2, axis=(1, 2))))
    assert 0 < float(cd) < spread
    rep = cj.collective_bytes(f, params, state, TARGETS)
    plan = cj.communication_plan(tx, PARAMS, N)
    # consensus_distance: one all-reduce of the parameters and one of a scalar.
    measure = cj.ring_bytes("all-reduce", 4 * (32 * 24 + 24), N) + cj.ring_bytes("all-reduce", 4, N)
    assert rep.total_ring_bytes == pytest.approx(plan.bytes_per_step + measure)
    if codec is not None:
        assert plan.compression_ratio > 10


def test_ef21_reaches_the_optimum_with_classic_bytes(mesh):
    """EF21 with top-k 5%: the mean of the estimates converges to the exact minimiser,
    replicas identical, and the step sends what classic error feedback sends."""
    losses, sent = {}, {}
    for ef in (True, "ef21"):
        tx = optax.chain(cj.compressed_mean(cj.top_k(0.05), "data", error_feedback=ef,
                                            min_compress_size=64), optax.sgd(0.1))
        f, params, state = _stepper(mesh, tx, per_replica=False)
        for _ in range(60):
            params, state, _ = f(params, state, TARGETS)
        losses[ef] = _optimum_loss(params["w"])
        sent[ef] = cj.collective_bytes(f, params, state, TARGETS).total_ring_bytes
        shards = [np.asarray(s.data) for s in params["w"].addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])
    best = _optimum_loss(np.asarray(TARGETS).mean(0))
    assert losses["ef21"] == pytest.approx(best, rel=2e-3)
    assert sent["ef21"] == sent[True]


def test_errors_name_the_fix():
    # A call outside shard_map (the unbound axis) is checked in tests/test_contract.py.
    with pytest.raises(ValueError, match="gamma"):
        cj.choco(optax.sgd(0.1), "data", codec=cj.sign(), gamma=0.0)
    with pytest.raises(ValueError, match="topology"):
        cj.choco(optax.sgd(0.1), "data", codec=cj.sign(), topology="star")
    with pytest.raises(ValueError, match="cannot travel through a permute"):
        cj.choco(optax.sgd(0.1), "data", codec=cj.random_k(0.01))
    with pytest.raises(TypeError, match="optax"):
        cj.choco(0.1, "data", codec=None)
    with pytest.raises(ValueError, match="error_feedback"):
        cj.compressed_mean(cj.sign(), "data", error_feedback="ef22")


def _choco_run(mesh, params, steps=3):
    """``cj.data_parallel`` with CHOCO (int8, per-replica parameters) on ``params``; the
    loss pulls every float leaf towards the batch mean. Returns the final parameters."""
    tx = cj.choco(optax.sgd(0.1), "data", codec=cj.quantize(bits=8), gamma=0.5)

    def loss(p, batch):
        return sum(jnp.sum(jnp.square(v - jnp.mean(batch))) for v in jax.tree_util.tree_leaves(p))

    dp = cj.data_parallel(loss, tx, mesh, per_replica_params=True)
    state = dp.init(params)
    batch = jnp.arange(N * 4, dtype=jnp.float32).reshape(N, 4) / 10
    for _ in range(steps):
        state, _ = dp.step(state, batch)
    return state.params


def test_scalar_and_empty_parameters_are_gossiped_like_the_others(mesh):
    """A scalar parameter takes the same path as the same value held as shape ``[1]``
    (its public copy is stored as ``[1]``, a per-replica leaf needing a leading axis),
    bit for bit; an empty leaf goes through with its shape. Both were refused (the
    scalar's public copy by the per-replica layout, the empty leaf by ``shard_map``)."""
    w = jnp.linspace(-1.0, 1.0, 16)
    scalar = _choco_run(mesh, {"c": jnp.asarray(0.5), "w": w, "z": jnp.zeros((4, 0))})
    vector = _choco_run(mesh, {"c": jnp.asarray([0.5]), "w": w, "z": jnp.zeros((4, 0))})
    assert scalar["c"].shape == (N,) and scalar["z"].shape[1:] == (4, 0)
    np.testing.assert_array_equal(np.asarray(scalar["c"]), np.asarray(vector["c"])[:, 0])
    np.testing.assert_array_equal(np.asarray(scalar["w"]), np.asarray(vector["w"]))
    # The replicas saw different batches: their scalars moved, and apart.
    c = np.asarray(scalar["c"])
    assert np.all(np.isfinite(c)) and np.all(c != 0.5) and len(set(c.tolist())) > 1
