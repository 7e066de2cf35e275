"""CHOCO-SGD: decentralized training by compressed gossip with neighbours.

Every replica keeps its own parameters ``x_i`` and talks only to its neighbours on a
ring (2 neighbours) or a torus (4), never to all replicas. Each keeps a *public copy*
``x^_i`` of its parameters that its neighbours can reconstruct, and the weighted sum of
its neighbourhood's public copies ``s_i = sum_j w_ij x^_j`` (itself included, uniform
weights ``w = 1 / (k + 1)`` over ``k`` neighbours and itself: a symmetric, doubly
stochastic mixing matrix). One step, with ``C`` the codec and ``gamma`` the consensus
step size::

    x_i'  = x_i + inner_update(g_i)               # the inner optimizer, on its own gradient
    q_i   = C(x_i' - x^_i)                        # encoded once, sent to every neighbour
    x^_i <- x^_i + q_i;   s_i <- s_i + w (q_i + sum_{j ~ i} q_j)
    x_i  <- x_i' + gamma (s_i - x^_i)             # move towards the neighbourhood's mean

Sender and neighbours decode the same words, so ``x^_i`` is exactly what the neighbours
hold of replica ``i``. (Koloskova, Stich, Jaggi, "Decentralized Stochastic Optimization
and Gossip Algorithms with Compressed Communication", ICML 2019.)

Bytes per step and device: ``k * 4 * sum_leaves payload_words`` (one collective-permute
per neighbour direction), plus one fp32 all-reduce of a non-finite flag
(``check_finite``): for ``cj.sign()`` on a ring, ``2 * 36 / 256`` bytes per parameter
against the exact all-reduce's ``2 (N-1)/N * 4`` (N = 8: 24.9x fewer).

Parameters are per replica (``cj.data_parallel(..., per_replica_params=True)``); the
replicas agree only approximately:
[`consensus_distance`][commjax.optimizers.choco.consensus_distance] measures how far apart.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from commjax import _compat, guards, validation
from commjax.accounting import CommunicationPlan, Transfer, ring_bytes, with_plan
from commjax.collectives.permute import _coders, _leaf_key, check_permute_codec
from commjax.compressors.base import Compressor
from commjax.layout import per_replica, with_leading_axis

__all__ = ["ChocoState", "choco", "consensus_distance", "neighbour_perms", "TOPOLOGIES"]

TOPOLOGIES = ("ring", "torus")


@per_replica("public", "neighbours", "inner_state", "metrics")
class ChocoState(NamedTuple):
    """State of [`choco`][commjax.optimizers.choco.choco].

    Attributes:
      count: int32 scalar, replicated: steps taken.
      key: uint32[2] raw PRNG key, replicated (stochastic codecs fold in the step and the
        replica).
      public: per replica, like the parameters (a scalar's as ``[1]``): the public copy
        ``x^_i``.
      neighbours: per replica, like ``public``: ``s_i``, the weighted sum of the
        neighbourhood's public copies.
      inner_state: per replica: the inner optimizer's state, every leaf with a leading
        axis of length 1 (its step counters are scalars).
      metrics: per replica ``float32[1]``: ``public_gap`` (``||x_i - x^_i||``) and
        ``neighbour_gap`` (``||x_i - s_i||``), after the step, no communication.
    """

    count: jax.Array
    key: jax.Array
    public: Any
    neighbours: Any
    inner_state: Any
    metrics: dict


def _torus_shape(n: int) -> tuple[int, int]:
    """``rows x cols`` of the most square grid of ``n`` replicas."""
    rows = max(r for r in range(1, int(math.isqrt(n)) + 1) if n % r == 0)
    return rows, n // rows


def neighbour_perms(n: int, topology: str) -> tuple:
    """The permutations a replica receives its neighbours' payloads through: two on a
    ring (from the left, from the right), four on a ``rows x cols`` torus."""
    if n <= 1:
        return ()
    if topology == "ring":
        shifts = [(1, 0), (-1, 0)]
        rows, cols = 1, n
    else:
        rows, cols = _torus_shape(n)
        shifts = [(0, 1), (0, -1), (1, 0), (-1, 0)]
    perms = []
    for da, db in shifts:
        pairs = []
        for i in range(n):
            a, b = divmod(i, cols) if topology == "torus" else (0, i)
            if topology == "ring":
                j = (i + da) % n
            else:
                j = ((a + da) % rows) * cols + (b + db) % cols
            pairs.append((i, j))
        perms.append(tuple(pairs))
    return tuple(perms)


@dataclasses.dataclass(frozen=True)
class _Config:
    inner: Any
    axis_name: Any
    codec: Optional[Compressor]
    topology: str
    gamma: float
    check_finite: bool
    seed: int


def _floating(leaf: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.floating)


def _gossip(cfg: _Config, diffs: list, key) -> list:
    """``[k + 1, *shape]`` rows per leaf: this replica's decoded ``q_i`` (row 0) and each
    neighbour's (rows 1..k), from one encoding sent once per neighbour direction."""
    perms = neighbour_perms(_compat.axis_size(cfg.axis_name), cfg.topology)
    coders = _coders(diffs, cfg.codec)
    rows = [None] * len(diffs)
    exact = [i for i in range(len(diffs)) if i not in coders]
    if exact:
        own = [diffs[i].astype(jnp.float32) for i in exact]
        got = [lax.ppermute(_compat.vary(own, cfg.axis_name), cfg.axis_name, p) for p in perms]
        for k, i in enumerate(exact):
            rows[i] = jnp.stack([own[k]] + [g[k] for g in got])
    if coders:
        words = jnp.concatenate([coders[i].encode(diffs[i], key) for i in coders])
        got = [lax.ppermute(_compat.vary(words, cfg.axis_name), cfg.axis_name, p) for p in perms]
        stacked, off = jnp.stack([words] + got), 0
        for i, coder in coders.items():
            rows[i] = coder.decode(stacked[:, off:off + coder.words])
            off += coder.words
    return rows


def _any_bad(cfg: _Config, leaves: list) -> jax.Array:
    """Replicated: some leaf is non-finite on some replica (one fp32 all-reduce of one
    flag). The whole step is then skipped everywhere: a public copy that moved on one
    replica and not on its neighbours would part them for good."""
    if not cfg.check_finite or not leaves:
        return jnp.zeros((), bool)
    ok = guards.tree_all_finite(leaves)
    return _compat.psum(jnp.where(ok, 0.0, 1.0).reshape(1), cfg.axis_name)[0] != 0


def _update(cfg: _Config, grads, state: ChocoState, params):
    guards.check_bound(cfg.axis_name, "choco")
    if params is None:
        raise ValueError("choco: update needs `params` (this replica's parameters): call "
                         "tx.update(grads, state, params).")
    inner = jax.tree_util.tree_map(lambda a: a[0], state.inner_state)
    inner_u, new_inner = cfg.inner.update(grads, inner, params)
    p_leaves, treedef = jax.tree_util.tree_flatten(params)
    u_leaves = treedef.flatten_up_to(inner_u)
    pub = [c.reshape(jnp.shape(p)) for c, p in zip(treedef.flatten_up_to(state.public), p_leaves)]
    nb = [c.reshape(jnp.shape(p)) for c, p in zip(treedef.flatten_up_to(state.neighbours), p_leaves)]
    idx = [i for i, p in enumerate(p_leaves) if _floating(p)]
    half = [p_leaves[i].astype(jnp.float32) + u_leaves[i].astype(jnp.float32) for i in idx]
    step_key = jax.random.fold_in(state.key, state.count)
    key = _leaf_key(cfg.codec, step_key, cfg.axis_name, "choco")
    rows = _gossip(cfg, [h - pub[i] for h, i in zip(half, idx)], key)
    bad = _any_bad(cfg, half)
    w = 1.0 / rows[0].shape[0] if rows else 1.0
    out, new_pub, new_nb, gaps = list(u_leaves), list(pub), list(nb), [[], []]
    for k, i in enumerate(idx):
        p_hat = pub[i] + rows[k][0]
        s = nb[i] + w * jnp.sum(rows[k], axis=0)
        u = u_leaves[i].astype(jnp.float32) + cfg.gamma * (s - p_hat)
        out[i] = (u + jnp.where(bad, jnp.nan, 0.0)).astype(p_leaves[i].dtype)
        new_pub[i] = jnp.where(bad, pub[i], p_hat)
        new_nb[i] = jnp.where(bad, nb[i], s)
        x_new = p_leaves[i].astype(jnp.float32) + u
        gaps[0].append(jnp.sum(jnp.square(x_new - p_hat)))
        gaps[1].append(jnp.sum(jnp.square(x_new - s)))
    new_inner = guards.keep_if(bad, inner, new_inner)
    unflat = lambda ls: jax.tree_util.tree_unflatten(treedef, ls)  # noqa: E731
    metrics = {name: jnp.where(bad, state.metrics[name], jnp.sqrt(sum(g, jnp.zeros((), jnp.float32))))
               for name, g in zip(("public_gap", "neighbour_gap"), gaps)}
    return unflat(out), ChocoState(
        state.count + 1, state.key, unflat([with_leading_axis(c) for c in new_pub]),
        unflat([with_leading_axis(c) for c in new_nb]),
        jax.tree_util.tree_map(lambda a: a[None], new_inner), _compat.vary(metrics, cfg.axis_name))


def _init(cfg: _Config, params) -> ChocoState:
    """Public copies and neighbourhood sums start at the (common) initial parameters:
    every replica then knows its neighbours' ``x^_j = x_0`` exactly without a send."""
    validation.check_real_leaves(params, factory="choco")
    copy = jax.tree_util.tree_map(lambda p: with_leading_axis(jnp.asarray(p, jnp.float32) if _floating(p) else p), params)
    inner = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], cfg.inner.init(params))
    return ChocoState(jnp.zeros((), jnp.int32), jax.random.PRNGKey(cfg.seed), copy, copy, inner,
                      {name: jnp.zeros((1,), jnp.float32) for name in ("public_gap", "neighbour_gap")})


def choco(inner: optax.GradientTransformation, axis_name: Any = "data", *,
          codec: Optional[Compressor], topology: str = "ring", gamma: float = 0.5,
          check_finite: bool = True, seed: int = 0) -> optax.GradientTransformation:
    """CHOCO-SGD around ``inner`` (see the module docstring for the maths and bytes).

    ::

        tx = cj.choco(optax.sgd(0.1), "data", codec=cj.sign(), gamma=0.2)
        dp = cj.data_parallel(loss_fn, tx, mesh, per_replica_params=True)

    Args:
      inner: the local optimizer (``optax.sgd``, ``optax.adam``, ...), applied to this
        replica's own gradient.
      axis_name: the mesh axis of the replicas (bound by ``shard_map``/``pmap``).
      codec: the gossip codec: ``cj.sign()``, ``cj.top_k(0.01)``, ``cj.quantize(bits=4)``...
        (any codec a [`commjax.collectives.ppermute`][] can send); ``None``: exact fp32.
      topology: ``"ring"`` (2 neighbours) or ``"torus"`` (4, the most square grid).
      gamma: consensus step size in ``(0, 1]``: small for coarse codecs (the public copies
        lag behind), ``1`` with exact gossip (plain neighbourhood averaging).
      check_finite: a non-finite value on any replica makes the whole update NaN on every
        replica (one fp32 all-reduce of one flag) and keeps the state: every replica skips
        the step (``optax.apply_if_finite`` after it).
      seed: seed of the replicated key (stochastic codecs).

    Returns:
      An ``optax.GradientTransformation`` whose state is a
      [`ChocoState`][commjax.optimizers.choco.ChocoState]; its
      ``update`` needs ``params`` (this replica's own).
    """
    factory = "choco"
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(f"{factory}: `inner` must be an optax transform such as optax.sgd(0.1); "
                        f"got {inner!r}.")
    codec = check_permute_codec(codec, factory, "codec")
    validation.check_choice("topology", topology, TOPOLOGIES, factory=factory)
    validation.check_float("gamma", gamma, 0.0, 1.0, factory=factory, lo_open=True)
    validation.check_bool("check_finite", check_finite, factory=factory)
    validation.check_seed("seed", seed, factory=factory)
    axis_name = validation.check_axis_name("axis_name", axis_name, factory=factory, allow_none=False)
    cfg = _Config(inner, axis_name, codec, topology, float(gamma), bool(check_finite), int(seed))
    return with_plan(optax.GradientTransformation(lambda params: _init(cfg, params),
                                                  lambda g, s, params=None: _update(cfg, g, s, params)),
                     functools.partial(_plan, cfg))


def _plan(cfg: _Config, params: Any, num_replicas: int) -> CommunicationPlan:
    """What one [`choco`][commjax.optimizers.choco.choco] step sends per device (its
    [`commjax.communication_plan`][],
    == the compiled HLO's): the encoded difference to every neighbour, and the NaN flags."""
    leaves = [l for l in jax.tree_util.tree_leaves(params) if _floating(l)]
    k = len(neighbour_perms(num_replicas, cfg.topology))
    coders = _coders(leaves, cfg.codec)
    sent = sum(4.0 * math.prod(jnp.shape(l)) for i, l in enumerate(leaves) if i not in coders)
    sent += 4.0 * sum(c.words for c in coders.values())
    transfers = [Transfer(f"gossip to {k} neighbours", "collective-permute", k * sent)]
    if cfg.check_finite and leaves:
        transfers.append(Transfer("NaN flag", "all-reduce", ring_bytes("all-reduce", 4, num_replicas)))
    n = sum(math.prod(jnp.shape(l)) for l in leaves)
    return CommunicationPlan("choco", num_replicas, tuple(transfers), ring_bytes("all-reduce", 4 * n, num_replicas))


def consensus_distance(params: Any, axis_name: Any) -> jax.Array:
    """``(1/N) sum_i ||x_i - x_bar||^2`` over the replicas of ``axis_name`` (inside
    ``shard_map``; one all-reduce of the parameters: call it now and then, not every
    step). Replicated."""
    n = guards.check_bound(axis_name, "consensus_distance")
    leaves = [l.astype(jnp.float32) for l in jax.tree_util.tree_leaves(params) if _floating(l)]
    means = _compat.psum(leaves, axis_name)
    local = sum((jnp.sum(jnp.square(l - m / n)) for l, m in zip(leaves, means)), jnp.zeros((), jnp.float32))
    return _compat.psum(local, axis_name) / n
