"""Test and benchmark harness: a non-i.i.d. data-parallel task and a training loop.

The task is what compression is hardest on: every replica sees a *shifted* input
distribution, so replicas' gradients disagree and a biased or noisy mean shows up in the
loss. The loop keeps one copy of the parameters **per replica** (a leading replica axis,
``P(axis)``), so that any disagreement between replicas' updates makes their parameters
drift apart and is caught by
[`TrainResult.replicas_identical`][commjax.testing.TrainResult.replicas_identical].

Everything here is deterministic: the same arguments give the same bits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from commjax import _compat
from commjax.accounting import collective_bytes
from commjax.collectives import valid_reducers
from commjax.compressors.base import BlockCompressor, Compressor, Segment
from commjax.compressors.cast16 import cast
from commjax.compressors.exact import identity
from commjax.compressors.quantize import qsgd, quantize, terngrad
from commjax.compressors.sign import sign
from commjax.guards import AxisNotBoundError
from commjax.layout import init_sharded, pmap_state, shard_state, state_specs
from commjax.plan import communication_plan
from commjax.transform import compressed_mean

__all__ = ["Task", "noniid_classification", "TrainResult", "train", "mlp_params", "mlp_apply",
           "block_codecs", "ready", "same_bits", "flat_residual", "check_compressor"]


@dataclasses.dataclass(frozen=True)
class Task:
    """Per-replica datasets ``x[r], y[r]`` and a model ``loss(params, x, y)``."""

    params: Any
    x: jax.Array  # [R, n, d]
    y: jax.Array  # [R, n] int labels
    loss: Callable[[Any, jax.Array, jax.Array], jax.Array]

    @property
    def num_replicas(self) -> int:
        return int(self.x.shape[0])

    def global_loss(self, params: Any) -> float:
        """Loss on the union of all replicas' data (the objective the mean optimizes)."""
        d = self.x.shape[-1]
        return float(self.loss(params, self.x.reshape(-1, d), self.y.reshape(-1)))


def mlp_params(key: jax.Array, sizes: tuple[int, ...]) -> dict:
    params = {}
    keys = jax.random.split(key, len(sizes) - 1)
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = jax.random.normal(keys[i], (a, b), jnp.float32) * np.sqrt(2.0 / a)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    return params


def mlp_apply(params: dict, x: jax.Array) -> jax.Array:
    n = len(params) // 2
    for i in range(n):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            x = jax.nn.gelu(x)
    return x


def _xent(params, x, y):
    logits = mlp_apply(params, x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def noniid_classification(
    num_replicas: int = 8,
    *,
    examples_per_replica: int = 512,
    dim: int = 32,
    hidden: int = 32,
    classes: int = 10,
    shift: float = 1.5,
    label_noise: float = 0.2,
    seed: int = 0,
) -> Task:
    """Classification with a fixed random teacher; replica ``r``'s inputs are centred at
    its own offset ``shift * u_r`` (``u_r`` a random unit vector), so local gradients
    differ systematically between replicas. A fraction ``label_noise`` of the labels is
    replaced by random classes, so the loss has a floor well above zero and relative
    gaps between methods stay meaningful. The student is a 2-hidden-layer MLP."""
    k_t, k_x, k_u, k_p, k_n, k_c = jax.random.split(jax.random.PRNGKey(seed), 6)
    teacher = mlp_params(k_t, (dim, 64, classes))
    u = jax.random.normal(k_u, (num_replicas, 1, dim))
    u = u / jnp.linalg.norm(u, axis=-1, keepdims=True)
    x = jax.random.normal(k_x, (num_replicas, examples_per_replica, dim)) + shift * u
    y = jnp.argmax(mlp_apply(teacher, x), axis=-1)
    noisy = jax.random.bernoulli(k_n, label_noise, y.shape)
    y = jnp.where(noisy, jax.random.randint(k_c, y.shape, 0, classes), y)
    params = mlp_params(k_p, (dim, hidden, hidden, classes))
    return Task(params=params, x=x, y=y, loss=_xent)


@dataclasses.dataclass
class TrainResult:
    losses: np.ndarray  # global loss of replica 0's parameters after each logged step
    params: Any  # replica 0's final parameters
    replica_params: Any  # all replicas' final parameters, leading replica axis
    opt_state: Any

    @property
    def final_loss(self) -> float:
        return float(self.losses[-1])

    @property
    def replicas_identical(self) -> bool:
        """True when every replica holds bit-identical parameters."""
        leaves = jax.tree_util.tree_leaves(self.replica_params)
        return all(bool(np.all(np.asarray(l) == np.asarray(l)[:1])) for l in leaves)


def _compiled_step(tx, task: Task, devices, axis_name, check_vma: bool, use_pmap: bool):
    """[`train`][commjax.testing.train]'s step under ``pmap`` or ``shard_map``, with its inputs laid
    out:
    ``(step, params, opt_state, x, y)``."""
    n = task.num_replicas
    stacked = jax.tree_util.tree_map(lambda p: jnp.broadcast_to(p, (n,) + p.shape), task.params)
    opt_state = tx.init(task.params)
    loss_fn = task.loss

    def local_step(p, s, x, y):
        g = jax.grad(loss_fn)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    if use_pmap:
        opt_state = pmap_state(opt_state, n)
        step = jax.pmap(local_step, axis_name=axis_name, devices=devices)
        params = stacked
        x, y = task.x, task.y
    else:
        mesh = _compat.make_mesh((n,), (axis_name,), devices=devices)
        opt_state = shard_state(opt_state, mesh, axis_name)
        specs = state_specs(opt_state, axis_name)

        def sm_step(p, s, x, y):
            p = jax.tree_util.tree_map(lambda a: a[0], p)
            p, s = local_step(p, s, x[0], y[0])
            return jax.tree_util.tree_map(lambda a: a[None], p), s

        step = jax.jit(_compat.shard_map(
            sm_step, mesh=mesh, in_specs=(P(axis_name), specs, P(axis_name), P(axis_name)),
            out_specs=(P(axis_name), specs), check_vma=check_vma,
        ))
        shard = NamedSharding(mesh, P(axis_name))
        params = jax.device_put(stacked, shard)
        x, y = jax.device_put(task.x, shard), jax.device_put(task.y, shard)
    return step, params, opt_state, x, y



def train(
    tx: optax.GradientTransformation,
    task: Task,
    steps: int,
    *,
    axis_name: str = "data",
    check_vma: bool = True,
    use_pmap: bool = False,
    log_every: int = 1,
    devices: Optional[list] = None,
) -> TrainResult:
    """Full-batch data-parallel training of ``task`` with ``tx`` for ``steps`` steps.

    Each replica differentiates the loss on its own data and hands the per-replica
    gradient to ``tx`` (which must contain a commjax transform over ``axis_name``).
    Parameters are kept per replica, so replicas drift apart if ``tx`` lets them.
    """
    n = task.num_replicas
    devices = devices if devices is not None else jax.devices()[:n]
    if len(devices) < n:
        raise ValueError(f"train: the task has {n} replicas but only {len(devices)} devices")
    step, params, opt_state, x, y = _compiled_step(tx, task, devices, axis_name, check_vma, use_pmap)
    loss_fn = task.loss
    eval_loss = jax.jit(lambda p: loss_fn(p, task.x.reshape(-1, task.x.shape[-1]), task.y.reshape(-1)))
    losses = []
    for t in range(steps):
        params, opt_state = step(params, opt_state, x, y)
        # One step in flight at a time: the CPU runtime can deadlock when executions of
        # consecutive multi-device steps interleave on its thread pool.
        jax.block_until_ready(params)
        if (t + 1) % log_every == 0 or t == steps - 1:
            losses.append(float(eval_loss(jax.tree_util.tree_map(lambda a: a[0], params))))
    params = jax.device_get(params)
    return TrainResult(
        losses=np.asarray(losses),
        params=jax.tree_util.tree_map(lambda a: a[0], params),
        replica_params=params,
        opt_state=opt_state,
    )


def update_collectives(
    tx: optax.GradientTransformation,
    params: Any,
    num_replicas: int,
    *,
    axis_name: str = "data",
    devices: Optional[list] = None,
):
    """Compile (never run) one ``tx.update`` on per-replica gradients shaped like ``params``
    over ``num_replicas`` devices and return its [`commjax.CollectiveReport`][].

    Gradients and state are abstract (``jax.ShapeDtypeStruct``), so a model of millions of
    parameters costs only its compile time.
    """
    devices = devices if devices is not None else jax.devices()[:num_replicas]
    mesh = _compat.make_mesh((num_replicas,), (axis_name,), devices=devices)
    state = jax.eval_shape(lambda p: init_sharded(tx, p, mesh, axis_name), params)
    specs = state_specs(state, axis_name)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    g_state = jax.tree_util.tree_map(
        lambda spec, leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                sharding=NamedSharding(mesh, spec)),
        specs, state, is_leaf=is_spec,
    )
    grads = jax.tree_util.tree_map(
        lambda p: jax.ShapeDtypeStruct((num_replicas,) + tuple(p.shape), p.dtype,
                                       sharding=NamedSharding(mesh, P(axis_name))), params)

    def step(g, s):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        u, s = tx.update(g, s, g)
        return jax.tree_util.tree_map(lambda a: a[None], u), s

    fn = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(axis_name), specs),
                                   out_specs=(P(axis_name), specs), check_vma=False))
    return collective_bytes(fn, grads, g_state)


def mlp_4m_params() -> dict:
    """A 4.2M-parameter MLP's parameter shapes (4 layers of 1024x1024 + biases)."""
    return {f"layer{i}": {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
                          "b": jax.ShapeDtypeStruct((1024,), jnp.float32)} for i in range(4)}


def block_codecs() -> dict[str, Any]:
    """One instance of every block codec (each chunkable, so every reducer applies),
    by a short name: the set that sweeps and parametrized tests run over."""
    return {
        "identity": identity(), "cast": cast(), "q8": quantize(8), "q4": quantize(4),
        "q2": quantize(2), "qsgd": qsgd(), "terngrad": terngrad(), "sign": sign(),
    }


def ready(*xs: Any) -> Any:
    """Block until ``xs`` are computed and return them (one value unpacked). On CPU with
    forced devices, a step whose inputs are still being produced, or two multi-device
    steps in flight at once, can starve the collectives' rendezvous: materialise inputs
    before each step and block on its outputs."""
    return jax.block_until_ready(xs if len(xs) > 1 else xs[0])


def same_bits(a: Any, b: Any) -> bool:
    """Whether two pytrees hold bit-identical leaves (NaNs in the same places count as equal)."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True) for x, y in zip(la, lb))


def flat_residual(state: Any, num_replicas: int = 1, segments: Optional[Any] = None) -> np.ndarray:
    """A compressed-mean state's worker residuals as one ``[num_replicas, n]`` array, from a
    state laid out with a leading replica axis ([`commjax.shard_state`][]) or, with
    ``num_replicas=1``, a local one. The leaves' residuals lie side by side in plan order;
    given the plan's ``segments``, each sits at its segment's offset in the padded bucket
    layout instead (zeros in the padding)."""
    parts = [np.asarray(jax.device_get(r)).reshape(num_replicas, -1) for r in state.residual]
    if segments is None:
        return np.concatenate(parts, axis=1) if parts else np.zeros((num_replicas, 0), np.float32)
    segments = list(segments)
    if len(segments) != len(parts):
        raise ValueError(f"flat_residual: {len(parts)} residuals but {len(segments)} segments")
    total = sum(s.padded_size for s in segments)
    out = np.zeros((num_replicas, total), parts[0].dtype if parts else np.float32)
    for part, seg in zip(parts, segments):
        out[:, seg.offset:seg.offset + seg.size] = part
    return out


# ------------------------------------------------------------------ a user's compressor


def _check(ok: bool, name: str, compressor: Compressor, why: str) -> None:
    if not ok:
        raise AssertionError(f"check_compressor({compressor!r}): {name}: {why}")


def _codec_checks(c: Compressor, n: int) -> None:
    """The codec alone: payload type and size, determinism, decode shape, bounded error,
    losslessness if claimed, and block independence (pieces encode like the whole)."""
    n = -(-n // c.alignment) * c.alignment
    x = jax.random.normal(jax.random.PRNGKey(1), (n,), jnp.float32)
    key = jax.random.PRNGKey(2)
    seg = (Segment(0, n, n, (n,)),)
    words = c.encode(x, key, seg)
    _check(words.dtype == jnp.uint32, "payload dtype", c,
           f"encode must return uint32 words (the wire format), got {words.dtype}")
    _check(words.shape == (c.payload_words(n, seg),), "payload size", c,
           f"encode gave {words.shape[0]} words, payload_words({n}) says {c.payload_words(n, seg)}")
    _check(bool(jnp.array_equal(words, c.encode(x, key, seg))), "determinism", c,
           "two encodes with the same key differ: replicas could not agree")
    out = c.decode(words, n, seg)
    _check(out.shape == (n,) and out.dtype == jnp.float32, "decode", c,
           f"decode must return float32[{n}], got {out.dtype}{list(out.shape)}")
    err = float(jnp.linalg.norm(out - x) / jnp.linalg.norm(x))
    _check(np.isfinite(err) and err <= 1.0 + 1e-6, "error", c,
           f"||decode(encode(x)) - x|| / ||x|| = {err:.3g}: worse than sending zeros")
    if c.lossless:
        _check(err == 0.0, "lossless", c, "lossless = True but decode(encode(x)) != x")
    if isinstance(c, BlockCompressor) and n >= 2 * c.block:
        half = (n // c.block // 2) * c.block
        parts = jnp.concatenate([c.encode(x[:half], key, start=0), c.encode(x[half:], key, start=half)])
        _check(bool(jnp.array_equal(parts, words)), "blocks", c,
               "encoding a vector in two pieces (start=...) differs from encoding it whole: "
               "the two-phase reducer, which encodes chunks, would disagree")


def check_compressor(compressor: Compressor, *, num_replicas: Optional[int] = None,
                     steps: int = 3, size: int = 4096,
                     reducers: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run commjax's contract checks on a compressor, a user's own codec included.

    The codec alone (``_codec_checks``): uint32 payload of ``payload_words(n)`` words,
    deterministic for a key, float32 decode, error below that of sending zeros, exact if
    it claims ``lossless``, block rows independent. Then, through
    [`commjax.compressed_mean`][] with every reducer that can carry it, on
    ``num_replicas`` devices (default: up to 4 of ``jax.devices()``): an unbound axis
    raises [`commjax.AxisNotBoundError`][]; ``steps`` of non-i.i.d. training leave
    every replica with bit-identical parameters and a finite loss; the compiled HLO sends
    exactly the bytes of [`commjax.communication_plan`][]. ``reducers`` limits the
    reducers tried (each compiles and trains once; default: every valid one and "auto").

    Returns ``{"reducers": [...], "hlo_bytes": {reducer: bytes}, "final_loss": {...}}``.
    Raises ``AssertionError`` naming the property that failed.
    """
    _check(isinstance(compressor, Compressor), "type", compressor,
           "subclass commjax.compressors.base.Compressor (or BlockCompressor)")
    hash(compressor)  # frozen dataclass: used as a static argument of compiled functions
    _codec_checks(compressor, size)
    n_rep = num_replicas or min(4, jax.device_count())
    task = noniid_classification(n_rep, examples_per_replica=32, dim=32, hidden=64, seed=5)
    report: dict[str, Any] = {"reducers": [], "hlo_bytes": {}, "final_loss": {}}
    tx0 = optax.chain(compressed_mean(compressor, "data", min_compress_size=256), optax.sgd(0.1))
    try:
        tx0.update(task.params, tx0.init(task.params), task.params)
        _check(False, "unbound axis", compressor, "no AxisNotBoundError outside shard_map")
    except AxisNotBoundError:
        pass
    if n_rep < 2:
        return report  # one device: the codec checks are all that can run
    valid = ("auto",) if compressor.has_exchange else ("auto",) + tuple(valid_reducers(compressor))
    for r in reducers or valid:
        _check(r in valid, "reducers", compressor, f"{r!r} cannot carry it; valid: {valid}")
        # num_replicas sizes the two-phase server residual when init runs outside shard_map.
        tx = optax.chain(compressed_mean(compressor, "data", reducer=r, min_compress_size=256,
                                         num_replicas=n_rep), optax.sgd(0.1))
        result = train(tx, task, steps)
        _check(result.replicas_identical, f"replicas ({r})", compressor,
               "replicas hold different parameters after the exchange")
        _check(bool(np.isfinite(result.final_loss)), f"loss ({r})", compressor, "non-finite loss")
        shapes = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), task.params)
        rep = update_collectives(compressed_mean(compressor, "data", reducer=r, min_compress_size=256,
                                                 num_replicas=n_rep), shapes, n_rep)
        # A fallback's collectives (a branch taken only on overflow) are in both counts.
        hlo = rep.total_ring_bytes
        plan = communication_plan(compressor, shapes, n_rep, reducer=r, min_compress_size=256)
        _check(abs(hlo - plan.compiled_bytes) <= 0.5, f"bytes ({r})", compressor,
               f"the compiled HLO sends {hlo} bytes per device, the plan says {plan.compiled_bytes}: "
               "payload_words/payload_bytes must count what encode produces")
        report["reducers"].append(r)
        report["hlo_bytes"][r] = hlo
        report["final_loss"][r] = result.final_loss
    return report
