"""``zero``: ZeRO-1/2 sharded optimizer with compressed reduce-scatter and all-gather.

Every replica holds the full parameters; the optimizer state is sharded. On replica ``r``
of ``N`` (its gradient ``g_r``, parameters ``p`` identical on every replica, fp32 master
shard ``m_r``, grad codec ``C_g``, weight codec ``C_w``), one step is::

    G_r   = (1/N) sum_q C_g(g_q[chunk r])         # compressed reduce-scatter (one all-to-all)
    u_r   = inner.update(G_r, s_r, m_r)           # any elementwise optax optimizer, 1/N of it
    m_r  <- m_r + u_r                             # fp32 master shard
    d_r   = m_r - p[chunk r]      (weight_delta)  # SDP4Bit's qWD: the change still to apply
    D     = concat_r C_w(d_r)                     # compressed all-gather, decoded everywhere
    update = D                                    # so that p <- p + D on every replica

Every replica (the owner included) adds the same decoded ``D`` to the same ``p``, so the
parameters stay bit-identical on every replica; what ``C_w`` dropped stays in
``m_r - p[chunk r]`` and is sent with the next step's difference instead of accumulating.
With ``weight_delta=False`` the master shard itself is sent (``D = concat_r C_w(m_r)``,
``update = D - p``): its quantization error is never corrected (SDP4Bit reports that
plain 4-bit weights drift; ``benchmarks/sharded.py`` measures it).

Layout: each floating leaf of ``n`` elements is flattened and padded with zeros to
``N * s`` ([`commjax.fsdp.shard_size`][]: ``s`` a multiple of the codecs' block ``A``);
replica ``r`` owns elements ``[r s, (r + 1) s)``. Leaves smaller than
``max(min_compress_size, N * A)`` (biases, norms, scalars) are padded to a multiple of
``N`` only and travel exactly (fp32), joined in one collective per direction. On TPU a
leaf, compressed or exact, whose shards are whole groups of 8 rows of its ``(8, 128)``
tiles (``_tile_sharded``) travels in the tiles' order both ways (a compressed gradient
unless gradient residuals are kept): the leaf is then a bitcast of the vector a
collective sends or receives, where the row-major vector is a relayout of the whole leaf.
The master shards stay row-major on every backend.

Bytes per step and device (ring convention, ``P_c(k)`` codec ``c``'s payload bytes for ``k``
elements, ``S_c`` the compressed leaves' shard sizes, ``S_e`` the exact ones')::

    reduce-scatter  (N-1)/N * N * T(sum P_g(s))  +  (N-1)/N * 4 N T(sum S_e + 1)
    all-gather      (N-1) * G(sum P_w(s))        +  (N-1) * 4 T(sum S_e + 1)

(the ``+ 1`` is the shared non-finite flag; without codecs every leaf is in the exact
terms, and an exact shard of at least ``fsdp.JOIN_MAX`` elements travels in its own
collective, its own ``T(S)``; ``T`` pads a replica's chunk to whole TPU tiles,
``shard_width`` and ``scatter_width`` in ``commjax/collectives/_common.py``: from 16,384
elements or words on, at most 1/8 more; ``G`` pads a row of payload words to whole lane
tiles while the gathered rows take at most 8 MB, ``gathered_width``). Exact fp32 ZeRO sends ``2 (N-1)/N * 4 n``, an fp32 all-reduce's bytes;
``cj.quantize(bits=4)`` on both sides about ``4.125 / 32`` of it.
[`commjax.communication_plan`][] gives the count for a parameter tree, equal to the
compiled HLO's.

Two levels (``inner_axis_name``, a fast axis inside the slow ``axis_name``): the
reduce-scatter runs first over the fast axis (``inner_grad_codec``, e.g. 8-bit), then over
the slow one (``grad_codec``, e.g. 4-bit): SDP4Bit's two-level gradient quantization; the
all-gather runs in the reverse order. Device ``(o, i)`` owns chunk ``i * O + o``.

References: Rajbhandari et al., "ZeRO" (2020); Jia et al., "SDP4Bit" (NeurIPS 2024);
Wang et al., "ZeRO++" (2023).
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

from commjax import _compat, bucket, collectives as cc, guards, validation
from commjax.accounting import CommunicationPlan, Transfer, ring_bytes, with_plan
from commjax.collectives._bytes import wire_bytes
from commjax.collectives._common import check_codec
from commjax.compressors.base import BlockCompressor, Compressor
from commjax.fingerprint import check_made_for, made_for
from commjax.fsdp import exact_bytes, gather_exact, scatter_exact, shard_size
from commjax.layout import per_replica
from commjax.transform import AxisNotBoundError

__all__ = ["ZeroState", "zero"]

COMPRESS, EXACT, PASS = "compress", "exact", "pass"


@per_replica("master", "inner_state", "residual", "metrics")
class ZeroState(NamedTuple):
    """State of [`zero`][commjax.optimizers.zero.zero] (arrays only).

    Attributes:
      count: int32 scalar, replicated: steps taken (keys are folded from it).
      key: uint32[2] raw PRNG key, replicated (stochastic codecs fold in the replica).
      master: per replica, one fp32 ``[s]`` shard per parameter leaf (``[0]`` for
        non-floating leaves): this replica's chunk of the exact parameters. Filled from
        the parameters at the first update, so that ``init`` needs no replica index.
      inner_state: per replica, ``inner``'s state for the master shards, every leaf with
        a leading axis of 1 (``[1, *shape]`` locally; ``[N, *shape]`` globally).
      residual: per replica, gradient error feedback (``grad_error_feedback``): one fp32
        ``[N s]`` array per compressed leaf (a full-size buffer); ``()`` otherwise.
      metrics: per replica, ``{"nonfinite": float32[1]}``: 1 if the last step saw a
        non-finite gradient on some replica.
      made_for: replicated, ``{fingerprint: uint32[1]}``: the codecs and options, the
        parameters' keys and shapes the state was made for ([`commjax.fingerprint`][]).

    Memory per replica: ``|master| + |inner_state| ~= (1 + k) n / N`` fp32 values for an
    inner optimizer with ``k`` moment buffers (Adam: ``3 n / N``), plus the residual.
    """

    count: jax.Array
    key: jax.Array
    master: tuple
    inner_state: Any
    residual: tuple
    metrics: dict
    made_for: dict


class _Leaf(NamedTuple):
    route: str  # COMPRESS, EXACT or PASS
    shape: tuple
    dtype: Any
    size: int
    shard: int


@dataclasses.dataclass(frozen=True)
class _Config:
    axis_name: Any
    inner_axis_name: Any
    grad_codec: Optional[Compressor]
    weight_codec: Optional[Compressor]
    inner_grad_codec: Optional[Compressor]
    inner_weight_codec: Optional[Compressor]
    weight_delta: bool
    grad_error_feedback: bool
    min_compress_size: int
    check_finite: bool
    check_replicated: bool
    num_replicas: Optional[int]
    seed: int

    @property
    def align(self) -> int:
        """Shards are whole blocks of every codec that carries them."""
        out = 1
        for c in (self.grad_codec, self.weight_codec, self.inner_grad_codec, self.inner_weight_codec):
            if c is not None:
                out = out * c.alignment // math.gcd(out, c.alignment)
        return out

    @property
    def name(self) -> str:
        """The codecs, for the state's fingerprint: ``zero-<grad codec>-<weight codec>``."""
        return "-".join(["zero"] + [c.name if c is not None else "fp32" for c in (self.grad_codec, self.weight_codec)])

    @property
    def options(self) -> tuple:
        """What the state's meaning depends on, for its fingerprint."""
        return (self.grad_codec, self.weight_codec, self.inner_grad_codec, self.inner_weight_codec,
                self.weight_delta, self.grad_error_feedback, self.min_compress_size)

    @property
    def axes(self) -> tuple:
        names = self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)
        if self.inner_axis_name is None:
            return names
        inner = self.inner_axis_name if isinstance(self.inner_axis_name, tuple) else (self.inner_axis_name,)
        return names + inner


def _plan(leaves: list, n: int, cfg: _Config) -> tuple[_Leaf, ...]:
    """Route and shard size of every leaf (a pure function of shapes, ``N`` and the codecs)."""
    out = []
    align = cfg.align
    for leaf in leaves:
        shape, dtype = tuple(jnp.shape(leaf)), jnp.result_type(leaf)
        size = math.prod(shape)
        if not jnp.issubdtype(dtype, jnp.floating):
            out.append(_Leaf(PASS, shape, dtype, size, 0))
        elif size >= max(cfg.min_compress_size, n * align):
            out.append(_Leaf(COMPRESS, shape, dtype, size, shard_size(size, n, align)))
        else:
            out.append(_Leaf(EXACT, shape, dtype, size, shard_size(size, n, 1)))
    return tuple(out)


def _num_replicas_now(cfg: _Config) -> int:
    if _compat.axis_is_bound(cfg.axis_name) and (
            cfg.inner_axis_name is None or _compat.axis_is_bound(cfg.inner_axis_name)):
        return math.prod(_compat.axis_size(a) for a in cfg.axes)
    if cfg.num_replicas is not None:
        return cfg.num_replicas
    if cfg.inner_axis_name is not None:
        raise ValueError(
            "zero: with `inner_axis_name`, init() outside shard_map cannot tell how many "
            "replicas share the state. Pass num_replicas=<size of both axes> to cj.zero, or "
            f"initialise with cj.init_sharded(tx, params, mesh, {cfg.axes!r}).")
    return jax.device_count()


def _own_index(cfg: _Config) -> jax.Array:
    """The chunk this device owns: ``i * O + o`` on ``(axis_name, inner_axis_name)``."""
    idx = lax.axis_index(cfg.axis_name)
    if cfg.inner_axis_name is not None:
        idx = lax.axis_index(cfg.inner_axis_name) * _compat.axis_size(cfg.axis_name) + idx
    return idx


def _padded(x: jax.Array, total: int) -> jax.Array:
    flat = jnp.ravel(x).astype(jnp.float32)
    return jnp.pad(flat, (0, total - flat.shape[0]))


# ------------------------------------------------------------------------ checks


def _check_inputs(cfg: _Config, grads: list, params: Optional[list], plan, state: ZeroState, n: int):
    if params is None:
        raise ValueError("zero: update() needs the current parameters: "
                         "tx.update(grads, opt_state, params) (every replica passes the same, full "
                         "parameters; ZeRO sends their change).")
    if len(params) != len(grads):
        raise ValueError(f"zero: `params` has {len(params)} leaves but the gradients {len(grads)}; "
                         "pass the parameter tree the gradients were taken of.")
    for g, p in zip(grads, params):
        if tuple(jnp.shape(g)) != tuple(jnp.shape(p)):
            raise ValueError(
                f"zero: `params` must be the full parameters, replicated on every replica "
                f"(ZeRO-1/2); got a leaf of shape {tuple(jnp.shape(p))} for a gradient of shape "
                f"{tuple(jnp.shape(g))}. For parameters sharded over the replicas (ZeRO-3) "
                "gather them in the model with cj.fsdp_gather and use a plain optax optimizer "
                "on the shards.")
    want = tuple((l.shard,) for l in plan)
    have = tuple(tuple(jnp.shape(m)) for m in state.master)
    if want != have:
        raise ValueError(
            f"zero: the state holds master shards of shapes {have} but these parameters on "
            f"{n} replicas need {want}: the state was made for other parameters or another "
            f"number of replicas. Pass num_replicas={n} to cj.zero, or create the state with "
            "cj.init_sharded(tx, params, mesh, axis_name).")
    tracked = _compat.varying_axes(lax.axis_index(cfg.axes[0]))
    if tracked:
        for g, l in zip(grads, plan):
            vma = _compat.varying_axes(g)
            if l.route != PASS and vma is not None and not set(cfg.axes) <= set(vma):
                raise ValueError(
                    f"zero: a gradient leaf of shape {l.shape} is replicated (invariant) over "
                    f"{cfg.axes!r}: under shard_map(check_vma=True) JAX has already summed it "
                    "over the replicas. Take the gradient with respect to "
                    f"cj.vary(params, {cfg.axis_name!r}) so that zero receives each replica's own.")


def _fingerprint(params: list) -> jax.Array:
    """A wrapping uint32 sum of the parameters' bits (equal parameters, equal sums)."""
    total = jnp.zeros((), jnp.uint32)
    for p in params:
        if jnp.size(p) and jnp.dtype(jnp.result_type(p)).itemsize in (1, 2, 4):
            total = total + jnp.sum(_compat.as_uint_words(jnp.ravel(p)).astype(jnp.uint32))
    return total


def _raise_if_differ(differ) -> None:
    if bool(differ):
        raise ValueError(
            "zero: the parameters differ between replicas at the first step. ZeRO-1/2 needs "
            "the same full parameters on every replica (it sends their change): initialise "
            "them once (one seed, not one per replica) and pass them replicated, e.g. "
            "in_specs=P() in shard_map, or check_replicated=False to skip this test.")


def _check_replicated(cfg: _Config, params: list, first: jax.Array) -> jax.Array:
    """At the first step only: compare the parameters' fingerprints across replicas (two
    4-byte all-reduces inside a conditional). Returns whether they differ (replicated: the
    step is then skipped on every replica) and, where the process has the backend the step
    is lowered for, raises from a host callback. Compiled for another target (deviceless,
    [`commjax.aot`][]) the callback, which needs that backend here, is left out."""
    tracked = _compat.varying_axes(lax.axis_index(cfg.axes[0]))
    if tracked and all(not (set(cfg.axes) & set(_compat.varying_axes(p) or ())) for p in params):
        return jnp.asarray(False)  # typed replicated under check_vma=True: nothing to test

    def report(differ):
        jax.debug.callback(_raise_if_differ, differ)
        return differ

    def test(ps):
        f = _fingerprint(ps)
        differ = lax.pmax(f, cfg.axes) != lax.pmin(f, cfg.axes)
        present = {d.platform for d in jax.devices()}
        branches = {p: report for p in ("cpu", "cuda", "rocm", "tpu")
                    if p in present or (p in ("cuda", "rocm") and "gpu" in present)}
        return _compat.platform_dependent(differ, default=lambda d: d, **branches)

    return lax.cond(first, test, lambda ps: jnp.asarray(False), params)


# ------------------------------------------------------------------------ the step


def _scatter_grads(cfg: _Config, plan, grads: list, residual: tuple, key, n: int, ok):
    """Stage 1: the mean gradient's chunk of every leaf on its owner, and the number of
    replicas whose gradient was not finite (shared through the exact bucket).

    Returns ``(shards, flag, new_residual)``: ``shards[i]`` fp32 ``[s_i]`` (``[0]`` for
    PASS leaves), ``flag`` fp32 ``[1]`` (``> 0``: some replica was not finite)."""
    kw = dict(inner_axis_name=cfg.inner_axis_name)
    coded = [i for i, l in enumerate(plan) if l.route == COMPRESS and cfg.grad_codec is not None]
    exact = [i for i, l in enumerate(plan) if l.route != PASS and i not in coded]
    # Exact leaves in the tiles' order where it is a bitcast (TPU): a row-major vector is a
    # relayout of the whole leaf, written out (v5e, the 21M MLP's exact ZeRO step).
    vecs = [_grad_part(grads[i], plan[i], n, True) for i in exact]
    if cfg.check_finite:
        vecs.append(jnp.broadcast_to(jnp.where(ok, 0.0, 1.0).astype(jnp.float32), (n,)))
    shards = [jnp.zeros((0,), jnp.float32) for _ in plan]
    got = scatter_exact(vecs, cfg.axis_name, mean=True, **kw) if vecs else []
    for i, g in zip(exact, got):
        shards[i] = _grad_shard(g, plan[i], n, True)
    flag = got[-1] if cfg.check_finite else jnp.zeros((1,), jnp.float32)
    new_residual = residual
    if coded:
        # Without residuals (a state) a TPU sends tile-sharded leaves in their tiles'
        # order, a bitcast there: the row-major vector was a relayout of every gradient.
        tiles = not residual
        parts = [_grad_part(grads[i], plan[i], n, tiles) for i in coded]
        if got:
            # The exact bucket's collective first, on every device: independent collectives
            # may otherwise start in different orders and deadlock per-collective runtimes.
            got, parts = lax.optimization_barrier((got, parts))
        rs = dict(key=key, mean=True, inner_codec=cfg.inner_grad_codec, **kw)
        if residual:
            out, new_residual = cc.reduce_scatter(parts, cfg.axis_name, cfg.grad_codec,
                                                  residual=list(residual), **rs)
            new_residual = tuple(new_residual)
        else:
            out = cc.reduce_scatter(parts, cfg.axis_name, cfg.grad_codec, **rs)
        for i, g in zip(coded, out):
            shards[i] = _grad_shard(g, plan[i], n, tiles)
    return shards, flag, new_residual


def _grad_part(g: jax.Array, l: _Leaf, n: int, tiles: bool) -> jax.Array:
    """A gradient leaf as the reduce-scatter sends it: the padded row-major vector, or
    for a tile-sharded leaf (``tiles``) ``bucket.ravel_leaf``'s order (on TPU the tiles',
    a bitcast), whose ``n`` chunks are the shards in ``bucket.ravel_shard``'s order."""
    if not (tiles and _tile_sharded(l, n)):
        return _padded(g, n * l.shard)
    return bucket.ravel_leaf(g.astype(jnp.float32))


def _grad_shard(chunk: jax.Array, l: _Leaf, n: int, tiles: bool) -> jax.Array:
    """The inverse of ``_grad_part`` on this replica's chunk: its shard row-major, as the
    master shard is kept (on TPU a relayout of the shard alone, ``1 / n`` of the leaf)."""
    if not (tiles and _tile_sharded(l, n)):
        return chunk
    return bucket.unravel_shard(chunk, l.shape)


def _inner_step(cfg: _Config, inner, treedef, g_shards: list, p_shards: list, state: ZeroState,
                first: jax.Array, bad: jax.Array):
    """Stage 2: ``inner`` on this replica's shards; returns ``(new_master, new_inner)``
    (both kept as they were when ``bad``)."""
    master = [jnp.where(first, p, m) for p, m in zip(p_shards, state.master)]
    master_tree = jax.tree_util.tree_unflatten(treedef, master)
    old_inner = jax.tree_util.tree_map(lambda x: x[0], state.inner_state)

    def vary(t):  # cond branches must agree on types: each leaf varying over the data axes,
        # and over a model axis where the state already does (shards split over it).
        def one(x, old):
            extra = sorted((_compat.varying_axes(old) or frozenset()) - set(cfg.axes))
            return _compat.vary(x, tuple(cfg.axes) + tuple(extra))
        return jax.tree_util.tree_map(one, t, old_inner)

    # At the first step the inner state starts from the real master shard (optimizers
    # whose state copies the parameters), not from init()'s placeholder zeros. On GPU a
    # select, which fuses into the inner update's reads: a conditional's pass-through
    # branch is a copy of the whole state there, every step (31.5 MB of the H100 MLP's
    # Adam step); on CPU and TPU the conditional, which passes it through for free.
    def start():
        return vary(inner.init(master_tree))

    def fresh(s):
        return lax.cond(first, lambda _: start(), vary, s)

    def chosen(s):
        return guards.keep_if(first, start(), vary(s))

    inner_state = _compat.platform_dependent(old_inner, cpu=fresh, tpu=fresh, default=chosen)
    grads = jax.tree_util.tree_unflatten(treedef, g_shards)
    u, new_inner = inner.update(grads, inner_state, master_tree)
    new_master = [m + jnp.asarray(d, jnp.float32) for m, d in zip(master, jax.tree_util.tree_leaves(u))]
    if cfg.check_finite:
        new_master, new_inner = guards.keep_if(bad, (master, inner_state), (new_master, new_inner))
    return new_master, vary(new_inner)


def _materialized_on_tpu(tree: Any) -> Any:
    """``tree`` unchanged, held in the layout it was decoded in on a TPU.

    A TPU keeps a flat vector as ``[n / 128, 128]`` lane rows and a weight ``[R, C]`` in
    ``(8, 128)`` tiles of its rows, so cutting a decoded row-major vector into leaves is a
    relayout (a leaf sent in tile order, ``_send_order``, is a bitcast instead).
    Without the barrier XLA moves the decode's multiply past that relayout and
    materializes the per-block steps broadcast to the leaf's shape (two extra arrays of
    the leaf's size); with it the decoded vector is written once and relaid once. v5e,
    21M MLP, int8 ZeRO: 1,199 MB of HBM traffic (``benchmarks/results/aot_v5e_2x4_mlp21m.json``)
    against 1,649 MB without. GPUs fuse the decode into its consumer; a barrier there only
    adds a pass (H100, one-off compiles: 850 MB instead of 682). An empty tree is
    returned as it is (no barrier to place)."""
    if not jax.tree_util.tree_leaves(tree):
        return tree
    return _compat.platform_dependent(tree, tpu=lax.optimization_barrier, default=lambda t: t)


def _tile_sharded(l: _Leaf, n: int) -> bool:
    """Whether leaf ``l``'s ``n`` shards are whole groups of 8 tile rows of it
    (``commjax.bucket.tile_sharded``): such a leaf travels in ``bucket.ravel_leaf``'s
    order, the one a TPU stores it in."""
    return l.route != PASS and bucket.tile_sharded(l.shape, l.shard, n)


def _param_shard(p: jax.Array, l: _Leaf, n: int, idx: jax.Array) -> jax.Array:
    """This replica's fp32 shard of parameter leaf ``p`` (row-major, padded). For a
    tile-sharded leaf cut from its rows: the same values, but a TPU reads its own rows in
    place instead of relaying the whole leaf to a row-major vector first."""
    if l.route == PASS:
        return jnp.zeros((0,), jnp.float32)
    if not _tile_sharded(l, n):
        return lax.dynamic_slice_in_dim(_padded(p, n * l.shard), idx * l.shard, l.shard)
    rows = l.shard // l.shape[-1]
    mine = lax.dynamic_slice_in_dim(p.reshape(-1, l.shape[-1]), idx * rows, rows)
    return mine.reshape(-1).astype(jnp.float32)


def _send_order(v: jax.Array, l: _Leaf, n: int) -> jax.Array:
    """A weight shard as the codec sends it: for a tile-sharded leaf in
    ``bucket.ravel_shard``'s order (on TPU its rows' tiles), so that the gathered vector
    is the leaf in ``ravel_leaf``'s order, a bitcast of the leaf on TPU
    (``_gathered_leaf``). Which elements share a codec block then depends on the backend,
    as in [`commjax.compressed_mean`][]; the master shard stays row-major."""
    return bucket.ravel_shard(v, l.shape) if _tile_sharded(l, n) else v


def _gathered_leaf(f: jax.Array, l: _Leaf, n: int) -> jax.Array:
    """The gathered (padded, flat) vector ``f`` of leaf ``l`` in the leaf's shape; the
    inverse of ``_send_order``."""
    if _tile_sharded(l, n):
        return bucket.unravel_leaf(f, l.shape)
    return f[:l.size].reshape(l.shape)


def _gather_weights(cfg: _Config, plan, new_master: list, p_shards: list, params: list,
                    flag: jax.Array, key, n: int):
    """Stage 3: every replica's new weights (or their change), decoded identically on
    every replica (``n`` of them); returns ``(updates, bad)`` with ``bad`` typed replicated."""
    send = [m - p if cfg.weight_delta else m for m, p in zip(new_master, p_shards)]
    coded = [i for i, l in enumerate(plan) if l.route == COMPRESS and cfg.weight_codec is not None]
    exact = [i for i, l in enumerate(plan) if l.route != PASS and i not in coded]
    # An exact leaf is poisoned in its shard, before the gather (every replica knows the
    # flag already): a select after it wrote the gathered leaf out a second time before
    # the update read it (v5e, exact ZeRO of the 21M MLP: 134 MB a step).
    local_bad = flag[0] != 0
    vecs = [_send_order(jnp.where(local_bad, jnp.nan, send[i]) if cfg.check_finite else send[i], plan[i], n)
            for i in exact] + ([flag] if cfg.check_finite else [])
    kw = dict(inner_axis_name=cfg.inner_axis_name, invariant=True)
    full = [None] * len(plan)
    got = gather_exact(vecs, cfg.axis_name, **kw) if vecs else []
    for i, g in zip(exact, got):
        full[i] = g
    bad = jnp.any(got[-1] != 0) if cfg.check_finite else None
    if coded:
        parts = [_send_order(send[i], plan[i], n) for i in coded]
        if got:
            got, parts = lax.optimization_barrier((got, parts))
        out = cc.all_gather(parts, cfg.axis_name, cfg.weight_codec, key=key,
                            inner_codec=cfg.inner_weight_codec, **kw)
        if bad is not None:  # poisoned in the decode's own pass, before the barrier
            out = [jnp.where(bad, jnp.nan, g) for g in out]
        # Only row-major leaves are held before their relayout; a tile-ordered leaf is a
        # bitcast, decoded where its update is written (held too, with the others, every
        # decoded leaf stayed alive at once: GPT-2 on a v5e, 1.0 gradients of scratch).
        held = [k for k, i in enumerate(coded) if not _tile_sharded(plan[i], n)]
        for k, g in zip(held, _materialized_on_tpu([out[k] for k in held])):
            out[k] = g
        for i, g in zip(coded, out):
            full[i] = g
    updates = []
    for i, (l, f, p) in enumerate(zip(plan, full, params)):
        if l.route == PASS:
            updates.append(jnp.zeros_like(p))
            continue
        w = _gathered_leaf(f, l, n)
        u = w if cfg.weight_delta else w - p.astype(jnp.float32)
        updates.append(u.astype(l.dtype))
    return updates, bad


def _update(cfg: _Config, inner, grads, state: ZeroState, params):
    for name in cfg.axes:
        if not _compat.axis_is_bound(name):
            raise AxisNotBoundError(
                f"zero: mesh axis {name!r} is not bound here. ZeRO reduce-scatters each "
                "replica's own gradient, so the update must run inside jax.shard_map (or "
                "jax.pmap) over that axis, e.g. jax.shard_map(step, mesh=mesh, in_specs=(P(), "
                f"cj.state_specs(opt_state, {cfg.axis_name!r}), P({cfg.axis_name!r})), ...).")
    guards.check_not_in_replica_conditional("zero")
    g_leaves, treedef = jax.tree_util.tree_flatten(grads)
    p_leaves = None if params is None else jax.tree_util.tree_leaves(params)
    n = math.prod(_compat.axis_size(a) for a in cfg.axes)
    plan = _plan(g_leaves, n, cfg)
    check_made_for("zero", getattr(state, "made_for", None), cfg.name, cfg.options, grads, num_replicas=n,
                   fix="Make the state with this transform's init (cj.init_sharded(tx, params, mesh, "
                       "axis)), or restore a checkpoint saved by the same transform.")
    _check_inputs(cfg, g_leaves, p_leaves, plan, state, n)
    first = state.count == 0
    differ = _check_replicated(cfg, p_leaves, first) if cfg.check_replicated else jnp.asarray(False)
    step_key = jax.random.fold_in(state.key, state.count)
    idx = _own_index(cfg)
    floats = [g for g, l in zip(g_leaves, plan) if l.route != PASS]
    # One overflow-free sum per leaf, no conditional: a conditional's elementwise test took
    # the leaves as operands and XLA wrote a second copy of a gradient for it (v5e, GPT-2
    # small's embedding in exact ZeRO: 155 MB a step).
    ok = guards.tree_all_finite(floats) if cfg.check_finite else jnp.asarray(True)
    ok = ok & jnp.logical_not(differ)
    g_shards, flag, residual = _scatter_grads(cfg, plan, g_leaves, state.residual,
                                              jax.random.fold_in(step_key, 0), n, ok)
    bad = flag[0] != 0
    p_shards = [_param_shard(p, l, n, idx) for p, l in zip(p_leaves, plan)]
    new_master, new_inner = _inner_step(cfg, inner, treedef, g_shards, p_shards, state, first, bad)
    updates, _ = _gather_weights(cfg, plan, new_master, p_shards, p_leaves, flag,
                                 jax.random.fold_in(step_key, 1), n)
    if cfg.check_finite and residual:
        residual = tuple(jnp.where(bad, o, r) for o, r in zip(state.residual, residual))
    new_state = ZeroState(
        count=state.count + 1, key=state.key, master=tuple(new_master),
        inner_state=jax.tree_util.tree_map(lambda x: x[None], new_inner), residual=residual,
        metrics={"nonfinite": jnp.where(bad, 1.0, 0.0).astype(jnp.float32).reshape(1)},
        made_for=state.made_for)
    return jax.tree_util.tree_unflatten(treedef, updates), new_state


# ------------------------------------------------------------------------ the factory


def _check_codec(codec: Any, argument: str, weights: bool) -> Optional[Compressor]:
    if weights and isinstance(codec, Compressor) and not isinstance(codec, BlockCompressor):
        raise ValueError(
            f"zero: `{argument}`={codec.name} cannot carry weights: every replica must rebuild "
            "every weight from the payload, and a sparsifier sends only some of them (a low-rank "
            "codec an approximation of the whole matrix). Use a "
            "dense block codec: cj.quantize(bits=8 | 4), cj.cast(), cj.hadamard(cj.quantize(...)), "
            "or None for exact fp32.")
    codec = check_codec(codec, "zero", argument)
    if codec is None or codec.lossless and codec.linear:
        return None  # the identity: the exact collective
    return codec


def zero(
    inner: optax.GradientTransformation,
    axis_name: Any = "data",
    *,
    grad_codec: Optional[Compressor] = None,
    weight_codec: Optional[Compressor] = None,
    weight_delta: bool = True,
    inner_axis_name: Any = None,
    inner_grad_codec: Optional[Compressor] = None,
    inner_weight_codec: Optional[Compressor] = None,
    grad_error_feedback: bool = False,
    min_compress_size: int = 1024,
    check_finite: bool = True,
    check_replicated: bool = True,
    num_replicas: Optional[int] = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """ZeRO-1/2 (Megatron's distributed optimizer) with compressed collectives, SDP4Bit-style.

    ``update(grads, state, params)`` takes this replica's own (unreduced) gradients and
    the full parameters, identical on every replica, inside ``shard_map``/``pmap``; it
    returns updates identical on every replica, to apply with ``optax.apply_updates``.
    The module docstring has the maths and the bytes of a step; use it alone (not
    followed by other transforms, which would change what every replica adds)::

        tx = cj.zero(optax.adam(1e-3), "data", grad_codec=cj.quantize(bits=4),
                     weight_codec=cj.quantize(bits=4, stochastic=False))
        opt_state = cj.init_sharded(tx, params, mesh, "data")
        # in the shard_map'd step, params replicated (P()), batch split (P("data")):
        grads = jax.grad(loss_fn)(cj.vary(params, "data"), batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

    ``inner`` runs on the flat fp32 master shards (a pytree like the parameters whose leaves
    are ``[s]`` vectors), so it must act elementwise: ``optax.adam``, ``adamw`` (a
    weight-decay mask given as a pytree works; one computed from shapes does not), ``sgd``,
    ``lion``... A global-norm clip would see this replica's shard only.

    Non-finite gradients: if any replica's gradient holds a NaN or an infinity, the whole
    update is NaN on every replica and the master shards, the inner state and the residuals
    keep their previous values (the step counter advances). To skip such steps, put
    ``optax.apply_if_finite`` *after* it, where every replica tests the same update:
    ``optax.chain(cj.zero(...), optax.apply_if_finite(optax.identity(), k))`` (not around
    it: that tests each replica's own gradient, and replicas that disagree would wait in
    different collectives). ``check_finite=False`` saves the flag (two floats per step): a
    NaN then poisons the master shards of its chunks.

    Args:
      inner: the optax optimizer run on this replica's shard (``optax.adam(1e-3)``).
      axis_name: the mesh axis (or tuple) of the replicas; with ``inner_axis_name`` the
        slow one.
      grad_codec: codec of the gradient reduce-scatter (``cj.quantize(bits=4)``,
        ``cj.hadamard(cj.quantize(bits=4))``); ``None``: exact fp32.
      weight_codec: codec of the weight all-gather, a dense block codec
        (``cj.quantize(bits=4, stochastic=False)``); ``None``: exact fp32.
      weight_delta: send the difference between the master shard and the parameters (qWD,
        default) rather than the master shard itself.
      inner_axis_name: a fast mesh axis inside ``axis_name`` (two levels: see the module
        docstring); the state is then per device of both axes: lay it out with
        ``cj.state_specs(state, (axis_name, inner_axis_name))``.
      inner_grad_codec, inner_weight_codec: the codecs on the fast axis (``None``: exact).
      grad_error_feedback: keep each replica's gradient compression error and add it to the
        next step's gradient (a full-size fp32 buffer per replica; one level only).
      min_compress_size: leaves with fewer elements (and fewer than ``N`` codec blocks)
        travel exactly.
      check_finite: share a non-finite flag (above).
      check_replicated: at the first step, compare a fingerprint of the parameters across
        replicas (two 4-byte all-reduces, inside a conditional) and raise if they differ;
        skipped when ``shard_map(check_vma=True)`` types them replicated.
      num_replicas: replicas the state is sized for when ``init`` runs outside
        ``shard_map`` (default: the bound axes' size, else ``jax.device_count()``).
      seed: seed of the replicated PRNG key (stochastic codecs).

    Returns:
      An ``optax.GradientTransformation`` with [`ZeroState`][commjax.optimizers.zero.ZeroState]; lay
      it out with
      [`commjax.init_sharded`][] or [`commjax.shard_state`][] and
      [`commjax.state_specs`][].

    Raises:
      ValueError, TypeError: bad options (named in the message), at construction; at
        ``update``: missing or non-full parameters, a state made for other shapes or
        another replica count, gradients already summed by JAX, or (at the first step)
        parameters that differ between replicas.
      AxisNotBoundError: ``update`` called where an axis is not bound.
    """
    if not (isinstance(inner, optax.GradientTransformation) or (hasattr(inner, "init") and hasattr(inner, "update"))):
        raise TypeError(f"zero: `inner` must be an optax.GradientTransformation such as "
                        f"optax.adam(1e-3); got {inner!r}.")
    if axis_name is None:
        raise ValueError("zero: `axis_name` must name the mesh axis of the replicas; ZeRO has "
                         "nothing to shard on one replica (use `inner` directly).")
    if isinstance(min_compress_size, bool) or not isinstance(min_compress_size, int) or min_compress_size < 1:
        raise ValueError(f"zero: `min_compress_size` must be an integer >= 1, got {min_compress_size!r}.")
    if num_replicas is not None and (isinstance(num_replicas, bool) or not isinstance(num_replicas, int)
                                     or num_replicas < 1):
        raise ValueError(f"zero: `num_replicas` must be a positive integer or None, got {num_replicas!r}.")
    as_tuple = lambda a: tuple(a) if isinstance(a, list) else a  # noqa: E731
    cfg = _Config(
        axis_name=as_tuple(axis_name), inner_axis_name=as_tuple(inner_axis_name),
        grad_codec=_check_codec(grad_codec, "grad_codec", False),
        weight_codec=_check_codec(weight_codec, "weight_codec", True),
        inner_grad_codec=_check_codec(inner_grad_codec, "inner_grad_codec", False),
        inner_weight_codec=_check_codec(inner_weight_codec, "inner_weight_codec", True),
        weight_delta=bool(weight_delta), grad_error_feedback=bool(grad_error_feedback),
        min_compress_size=min_compress_size, check_finite=bool(check_finite),
        check_replicated=bool(check_replicated), num_replicas=num_replicas, seed=int(seed))
    _check_axes(cfg)

    def init_fn(params):
        validation.check_real_leaves(params, factory="zero")
        leaves, treedef = jax.tree_util.tree_flatten(params)
        n = _num_replicas_now(cfg)
        plan = _plan(leaves, n, cfg)
        master = tuple(jnp.zeros((l.shard,), jnp.float32) for l in plan)
        inner_state = inner.init(jax.tree_util.tree_unflatten(treedef, list(master)))
        residual = ()
        if cfg.grad_error_feedback and cfg.grad_codec is not None:
            residual = tuple(jnp.zeros((n * l.shard,), jnp.float32) for l in plan if l.route == COMPRESS)
        return ZeroState(
            count=jnp.zeros((), jnp.int32), key=jax.random.PRNGKey(cfg.seed), master=master,
            inner_state=jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], inner_state),
            residual=residual, metrics={"nonfinite": jnp.zeros((1,), jnp.float32)},
            made_for=made_for(cfg.name, cfg.options, params))

    def update_fn(updates, state, params=None):
        return _update(cfg, inner, updates, state, params)

    return with_plan(optax.GradientTransformation(init_fn, update_fn), functools.partial(_plan_bytes, cfg))


def _check_axes(cfg: _Config) -> None:
    if cfg.inner_axis_name is None:
        for name in ("inner_grad_codec", "inner_weight_codec"):
            if getattr(cfg, name) is not None:
                raise ValueError(f"zero: `{name}` needs `inner_axis_name` (the fast mesh axis it "
                                 "runs on); without it there is one level: use `grad_codec` / "
                                 "`weight_codec`.")
        return
    names = lambda a: set(a) if isinstance(a, tuple) else {a}  # noqa: E731
    if names(cfg.axis_name) & names(cfg.inner_axis_name):
        raise ValueError(f"zero: `inner_axis_name` ({cfg.inner_axis_name!r}) must differ from "
                         f"`axis_name` ({cfg.axis_name!r}).")
    if cfg.grad_error_feedback:
        raise ValueError("zero: `grad_error_feedback` works on one level only; drop "
                         "`inner_axis_name` or set grad_error_feedback=False.")


def _plan_bytes(cfg: _Config, params: Any, num_replicas: int, inner_replicas: int = 1) -> CommunicationPlan:
    """What one [`zero`][commjax.optimizers.zero.zero] step sends per device (its
    [`commjax.communication_plan`][]),
    ``num_replicas`` on ``axis_name`` and ``inner_replicas`` on ``inner_axis_name``: the
    gradient reduce-scatter and the weight all-gather (exact shards and the flag joined,
    coded ones apart, as the compiled step sends them) and, at the first step only, the
    parameter fingerprint test (``check_replicated``)."""
    if (inner_replicas > 1) != (cfg.inner_axis_name is not None):
        raise ValueError("communication_plan: pass `inner_replicas` (the size of "
                         "`inner_axis_name`) exactly when zero has an inner axis.")
    n = num_replicas * inner_replicas
    plan = _plan(jax.tree_util.tree_leaves(params), n, cfg)
    vec = lambda k: jax.ShapeDtypeStruct((k,), jnp.float32)  # noqa: E731
    transfers = []
    for what, op, codec, inner_codec, scale in (
            ("gradient shards", "reduce_scatter", cfg.grad_codec, cfg.inner_grad_codec, n),
            ("weight shards", "all_gather", cfg.weight_codec, cfg.inner_weight_codec, 1)):
        coded = [vec(scale * l.shard) for l in plan if l.route == COMPRESS and codec is not None]
        exact = [vec(scale * l.shard) for l in plan
                 if l.route == EXACT or (l.route == COMPRESS and codec is None)]
        exact += [vec(scale)] if cfg.check_finite else []
        total = exact_bytes(op, exact, num_replicas, inner_replicas) if exact else 0.0
        if coded:
            total += wire_bytes(op, coded, num_replicas, codec, inner_codec=inner_codec, inner_size=inner_replicas)
        transfers.append(Transfer(what, op.replace("_", "-"), total))
    if cfg.check_replicated:
        check = 2 * ring_bytes("all-reduce", 4, n)
        transfers.append(Transfer("parameter fingerprint (first step)", "all-reduce", check, 0))
    floats = sum(l.size for l in plan if l.route != PASS)
    return CommunicationPlan("zero", num_replicas, tuple(transfers), ring_bytes("all-reduce", 4 * floats, n))
