"""What the examples share: building the optimizer from the command line, the
data-parallel train step, checkpoints, the progress bar, the summary table and the plot.

The data-parallel step is :func:`commjax.data_parallel` (the part worth reading)::

    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    dp = cj.data_parallel(loss_fn, tx, mesh)           # loss_fn(params, batch) -> scalar
    state = dp.init(params)                            # layout of tx's state: traced
    state, loss = dp.step(state, batch)                # loss: each replica's, shape [N]

Each step's result is waited for before the next starts (CPU collectives can deadlock
when several multi-device steps are in flight).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax


import commjax as cj
from commjax.metrics import step_metrics

AXIS = "data"

# Compressors and optimizers that other parts of commjax may or may not provide yet.
_OPTIONAL = {
    "top_k": "cj.top_k (sparsification: values + indices)",
    "random_k": "cj.random_k (sparsification with a shared random mask)",
    "powersgd": "cj.powersgd (low-rank factors)",
    "onebit_adam": "cj.onebit_adam (1-bit Adam)",
    "onebit_lamb": "cj.onebit_lamb (1-bit LAMB)",
    "dgc": "cj.dgc (deep gradient compression)",
    "diloco": "cj.diloco (local steps with a compressed outer step)",
    "streaming_diloco": "cj.streaming_diloco (DiLoCo synced in fragments)",
    "decoupled_momentum": "cj.decoupled_momentum (DeMo)",
}


class MissingFeature(SystemExit):
    """A compressor or optimizer this commjax version does not provide."""


# Where each optional factory lives when the top-level ``commjax`` namespace does not
# re-export it.
_MODULES = {
    "top_k": "commjax.compressors.sparse",
    "random_k": "commjax.compressors.sparse",
    "powersgd": "commjax.compressors.powersgd",
    "onebit_adam": "commjax.optimizers.onebit",
    "onebit_lamb": "commjax.optimizers.onebit",
    "dgc": "commjax.optimizers.dgc",
    "diloco": "commjax.optimizers.diloco",
}


def find(name: str) -> Optional[Callable[..., Any]]:
    """``cj.<name>`` (or the same factory from its commjax submodule), None if absent."""
    fn = getattr(cj, name, None)
    if fn is None and name in _MODULES:
        import importlib

        try:
            fn = getattr(importlib.import_module(_MODULES[name]), name, None)
        except ImportError:
            fn = None
    return fn


def lookup(name: str) -> Callable[..., Any]:
    """:func:`find`, or a clear error if this commjax version has no such factory."""
    fn = find(name)
    if fn is None:
        raise MissingFeature(
            f"error: {_OPTIONAL.get(name, 'cj.' + name)} is not available in this commjax "
            f"version ({cj.__version__}); choose another --compressor/--optimizer."
        )
    return fn


# --------------------------------------------------------------------------- devices


def data_mesh(num_devices: Optional[int] = None) -> jax.sharding.Mesh:
    """A 1-D ``("data",)`` mesh over the first ``num_devices`` local devices (all by default)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if n > len(devices):
        raise SystemExit(
            f"error: --devices {n} asked for more devices than JAX sees ({len(devices)} "
            f"{devices[0].platform} devices)."
        )
    return jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices[:n])


# --------------------------------------------------------------------------- optimizer


def make_compressor(args: Any) -> cj.Compressor:
    """The compressor chosen by ``--compressor`` and its options."""
    name = args.compressor
    if name == "identity":
        return cj.identity()
    if name == "cast":
        return cj.cast(jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float16)
    if name == "quantize":
        return cj.quantize(bits=args.bits, block_size=args.block_size,
                           stochastic=getattr(args, "rounding", "stochastic") == "stochastic")
    if name == "fp8":
        return cj.fp8(args.fp8_format, block_size=args.block_size,
                      stochastic=getattr(args, "rounding", "stochastic") == "stochastic")
    if name == "qsgd":
        return cj.qsgd(levels=args.levels, block_size=args.block_size)
    if name == "terngrad":
        return cj.terngrad(block_size=args.block_size)
    if name == "sign":
        return cj.sign(block_size=args.block_size)
    if name in ("top_k", "random_k"):
        return lookup(name)(ratio=args.ratio)
    if name == "powersgd":
        return lookup(name)(rank=args.rank)
    raise SystemExit(f"error: unknown --compressor {name!r}")


def compressor_label(args: Any) -> str:
    name = args.compressor
    opts = {
        "cast": f"({args.dtype})", "qsgd": f"({args.levels} levels)",
        "quantize": f"({args.bits}-bit{', nearest' if getattr(args, 'rounding', '') == 'nearest' else ''})",
        "fp8": f"({getattr(args, 'fp8_format', '')}{', nearest' if getattr(args, 'rounding', '') == 'nearest' else ''})",
        "top_k": f"({args.ratio:g})", "random_k": f"({args.ratio:g})", "powersgd": f"(rank {args.rank})",
    }.get(name, "")
    ef = "" if name == "identity" or not args.no_error_feedback else ", no EF"
    return f"{name}{opts}{ef}"


@dataclasses.dataclass
class Setup:
    """The optimizer of a run and how to account for its bytes."""

    tx: optax.GradientTransformation
    label: str
    plan: Optional[cj.CommunicationPlan]  # compressed_mean's plan (metrics read from the state)
    per_replica_params: bool = False  # params differ between replicas between syncs (diloco)
    bytes_per_step: Optional[float] = None  # analytic average bytes when there is no plan
    bytes_note: str = ""
    sync_every: Optional[int] = None  # per-replica params agree only every sync_every steps
    replicas_agree: bool = True  # False: per-replica params never all agree (streaming_diloco)


def make_setup(args: Any, params: Any, num_replicas: int, *, lr: Optional[float] = None) -> Setup:
    """``--optimizer`` (and, for plain optimizers, ``--compressor``) as an optax transform.

    ``adam``/``adamw``/``sgd``/``momentum`` run after ``cj.compressed_mean(compressor)``;
    ``onebit_adam``/``onebit_lamb``/``dgc`` are complete commjax optimizers with their own
    exchange; ``diloco`` takes Adam steps locally and averages the parameters' movement
    every ``--sync-every`` steps through ``compressed_mean(compressor)``.
    """
    lr = args.lr if lr is None else lr
    opt = args.optimizer
    steps = getattr(args, "steps", 100)
    if opt in ("adam", "adamw", "sgd", "momentum"):
        comp = make_compressor(args)
        ef = not args.no_error_feedback
        exchange = cj.compressed_mean(comp, AXIS, error_feedback=ef, reducer=args.reducer,
                                      num_replicas=num_replicas)
        base = {
            "adam": lambda: optax.adam(lr),
            "adamw": lambda: optax.adamw(lr, weight_decay=1e-4),
            "sgd": lambda: optax.sgd(lr),
            "momentum": lambda: optax.sgd(lr, momentum=0.9),
        }[opt]()
        plan = cj.communication_plan(comp, params, num_replicas, reducer=args.reducer)
        return Setup(optax.chain(exchange, base), f"{compressor_label(args)} + {opt}", plan)
    warmup = getattr(args, "warmup_steps", None)
    if opt in ("onebit_adam", "onebit_lamb"):
        warmup = max(1, steps // 5) if warmup is None else warmup
        tx = lookup(opt)(lr, warmup_steps=warmup, axis_name=AXIS, block_size=args.block_size,
                         num_replicas=num_replicas)
        # Exact fp32 mean during the warm-up, then the 1-bit momentum exchange (sign codes,
        # two-phase reducer): the average over the run.
        plan = cj.communication_plan(tx, params, num_replicas)
        exact, onebit = plan.bytes_of("warm-up"), plan.bytes_per_step
        w = min(warmup, steps)
        avg = (w * exact + (steps - w) * onebit) / max(steps, 1)
        return Setup(tx, f"{opt} (warm-up {warmup})", None, bytes_per_step=avg,
                     bytes_note=f"{exact:,.0f} B/step during warm-up, {onebit:,.0f} B/step after")
    if opt == "dgc":
        warmup = 0 if warmup is None else warmup
        tx = lookup(opt)(lr, ratio=args.ratio, momentum=0.9, axis_name=AXIS, warmup_steps=warmup)
        b = cj.communication_plan(tx, params, num_replicas).bytes_per_step
        return Setup(tx, f"dgc({args.ratio:g}) + momentum", None, bytes_per_step=b)
    if opt == "diloco":
        comp = make_compressor(args)
        h = args.sync_every
        tx = lookup(opt)(optax.adam(lr), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=h,
                         axis_name=AXIS, compressor=None if args.compressor == "identity" else comp,
                         error_feedback=not args.no_error_feedback, num_replicas=num_replicas)
        sync = cj.communication_plan(tx, params, num_replicas).peak_bytes
        return Setup(tx, f"diloco(H={h}, {compressor_label(args)})", None, per_replica_params=True,
                     bytes_per_step=sync / h, bytes_note=f"average: {sync:,.0f} B every {h} steps",
                     sync_every=h)
    if opt == "streaming_diloco":
        return _streaming_setup(args, params, num_replicas, lr)
    if opt == "decoupled_momentum":
        tx = lookup(opt)(lr, beta=args.beta, chunk_size=args.chunk_size, top_k=args.top_k, axis_name=AXIS)
        b = cj.communication_plan(tx, params, num_replicas).bytes_per_step
        return Setup(tx, f"decoupled_momentum(c={args.chunk_size}, k={args.top_k})", None, bytes_per_step=b)
    raise SystemExit(f"error: unknown --optimizer {opt!r}")


def _streaming_setup(args: Any, params: Any, num_replicas: int, lr: float) -> Setup:
    """``--optimizer streaming_diloco``: Adam inside, Nesterov outside, ``--fragments``
    synced at staggered steps with ``--compressor`` (``identity``: the exact fp32 mean)."""
    comp = None if args.compressor == "identity" else make_compressor(args)
    h = args.sync_every
    tx = lookup("streaming_diloco")(
        optax.adam(lr), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=h,
        fragments=args.fragments, overlap=args.overlap, mix=args.mix, axis_name=AXIS, compressor=comp,
        error_feedback=not args.no_error_feedback, num_replicas=num_replicas)
    b = cj.communication_plan(tx, params, num_replicas)
    # Fragments are merged at different steps (and mixed with each worker's own values
    # when --mix > 0), so the workers' parameters never all agree at once.
    whole = args.fragments == 1 and args.overlap == 0 and args.mix == 0
    return Setup(tx, f"streaming_diloco(H={h}, P={args.fragments}, tau={args.overlap}, {compressor_label(args)})",
                 None, per_replica_params=True, bytes_per_step=b.bytes_per_step,
                 bytes_note=f"peak {b.peak_bytes:,.0f} B (one fragment), average {b.bytes_per_step:,.0f} B",
                 sync_every=h if whole else None, replicas_agree=whole)


# --------------------------------------------------------------------------- trainer


def local_values(x: jax.Array) -> np.ndarray:
    """The values of a ``P("data")`` array held by this process' devices, in order
    (all of them on one process; no collective)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


class DataParallel:
    """A stateful wrapper of :func:`commjax.data_parallel` for the examples' loop: holds the
    :class:`commjax.TrainState`, compiles the step ahead of time (the demo compiles several
    runs at once), counts steps and checkpoints.

    ``loss_fn(params, batch) -> scalar`` is this replica's loss on its share of the
    batch. Every array of ``batch`` has the global batch on axis 0, split over the
    replicas (``place_batch``, e.g. ``jax.make_array_from_process_local_data``, places
    it instead when given). ``per_replica_params``: for optimizers whose replicas hold
    different parameters between synchronisations (``cj.diloco``).
    """

    def __init__(self, loss_fn: Callable[[Any, Any], jax.Array], params: Any,
                 tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, *,
                 per_replica_params: bool = False,
                 place_batch: Optional[Callable[[Any], Any]] = None):
        self.mesh = mesh
        self.n = int(mesh.shape[AXIS])
        self.tx = tx
        self.per_replica_params = per_replica_params
        self.dp = cj.data_parallel(loss_fn, tx, mesh, axis_name=AXIS,
                                   per_replica_params=per_replica_params)
        self.state = self.dp.init(params)
        self._place_batch = place_batch or self.dp.place_batch
        self._compiled = None

    @property
    def params(self) -> Any:
        return self.state.params

    @property
    def opt_state(self) -> Any:
        return self.state.opt_state

    @property
    def step_count(self) -> int:
        return int(np.asarray(jax.device_get(self.state.step)))

    def shard_batch(self, batch: Any) -> Any:
        """The global batch as arrays split over the replicas."""
        return self._place_batch(batch)

    def compile(self, batch: Any):
        """Compile the step for batches shaped like ``batch`` (ahead of time)."""
        if self._compiled is None:
            self._compiled = self.dp.lower(self.state, self.shard_batch(batch)).compile()
        return self._compiled

    def hlo_bytes(self, batch: Any) -> float:
        """Per-device bytes one step sends, read from the compiled HLO (static count)."""
        return cj.collective_bytes(self.compile(batch)).total_ring_bytes

    def step(self, batch: Any) -> np.ndarray:
        """One step; returns every replica's loss (host array)."""
        fn = self.compile(batch)
        self.state, (losses, _) = fn(self.state, self.shard_batch(batch))
        # One multi-device step in flight at a time (the CPU runtime can deadlock).
        jax.block_until_ready(losses)
        return local_values(losses)

    def eval_params(self) -> Any:
        """Replica 0's parameters (all replicas hold the same ones when in sync)."""
        if self.per_replica_params:
            return jax.tree_util.tree_map(lambda a: a[0], self.params)
        return self.params

    def replicas_in_sync(self, rtol: float = 0.0) -> bool:
        """Whether every device holds the same parameters (reads each device's own copy):
        bit-identical with ``rtol=0``, else within ``rtol`` of the largest magnitude."""
        if rtol == 0.0:
            return self.dp.replicas_identical(self.state)
        for leaf in jax.tree_util.tree_leaves(self.params):
            shards = [np.asarray(s.data) for s in leaf.addressable_shards]
            for other in shards[1:]:
                if np.max(np.abs(shards[0] - other), initial=0.0) > rtol * max(
                        1.0, float(np.max(np.abs(shards[0]), initial=0.0))):
                    return False
        return True

    # -- checkpoints: the whole TrainState (params, optimizer state, step, key) ---------

    def save(self, ckpt: Any, metadata: Optional[dict] = None) -> None:
        ckpt.save(self.step_count, {"train_state": self.state}, metadata=metadata)

    def restore(self, ckpt: Any) -> int:
        self.state = ckpt.restore({"train_state": self.state})["train_state"]
        return self.step_count


# --------------------------------------------------------------------------- reporting


def human_bytes(b: float) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "n/a"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(b) < 1000 or unit == "TB":
            return f"{b:,.0f} {unit}" if unit == "B" else f"{b:,.1f} {unit}"
        b /= 1000.0
    return f"{b:.1f}"


class Progress:
    """A tqdm bar showing the loss and the bytes sent so far (log lines without tqdm)."""

    def __init__(self, total: int, *, initial: int = 0, desc: str = "train", enabled: bool = True,
                 position: Optional[int] = None, silent: bool = False):
        self.total, self.n = total, initial
        self.desc = desc
        self.silent = silent
        enabled = enabled and not silent
        self._bar = None
        self._last_log = time.time()
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # pragma: no cover - tqdm is an examples extra
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                                 leave=True, position=position, file=sys.stderr)

    def update(self, loss: float, bytes_sent: float) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss={loss:.4f} sent={human_bytes(bytes_sent)}", refresh=False)
            self._bar.update(1)
        elif not self.silent and (self.n == self.total or time.time() - self._last_log > 5):
            self._last_log = time.time()
            print(f"{self.desc}: step {self.n}/{self.total} loss={loss:.4f} "
                  f"sent={human_bytes(bytes_sent)}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """Fixed-width text table; ``columns`` are ``(key, header)`` pairs, values preformatted."""
    headers = [h for _, h in columns]
    body = [[str(r.get(k, "")) for k, _ in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(headers, *body)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in body]
    return "\n".join(out)


def plot_curves(curves: dict, path: str, *, title: str, ylabel: str = "loss",
                eval_curves: Optional[dict] = None) -> str:
    """Write loss curves (``label -> (steps, values)``) to a PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for i, (label, (xs, ys)) in enumerate(curves.items()):
        ys = np.asarray(ys, dtype=np.float64)
        k = max(1, len(ys) // 50)
        smooth = np.convolve(ys, np.ones(k) / k, mode="valid") if len(ys) >= k else ys
        xs = np.asarray(xs)[k - 1:] if len(ys) >= k else np.asarray(xs)
        ax.plot(xs, smooth, color=f"C{i}", label=label, lw=1.4)
        if eval_curves and label in eval_curves:
            ex, ey = eval_curves[label]
            ax.plot(ex, ey, color=f"C{i}", ls="--", marker="o", ms=3, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def save_figure(fig: Any, path: str) -> str:
    """Lay out, save (its folder created) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_json(path: str, obj: Any) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def default(o):
        if isinstance(o, (np.floating, np.integer)):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
        raise TypeError(type(o).__name__)

    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=default, allow_nan=True)
    return path


# --------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class RunResult:
    label: str
    steps: list
    losses: list
    eval_steps: list
    eval_values: list
    bytes_per_step: float  # analytic (plan) when known, else measured from HLO
    hlo_bytes_per_step: float
    baseline_bytes: float
    seconds: float
    compile_seconds: float
    in_sync: Optional[bool]  # None: not checkable at this step (between DiLoCo syncs)
    metrics: dict

    @property
    def final_loss(self) -> float:
        """Training loss averaged over the last 10% of the steps (at least one)."""
        if not self.losses:
            return float("nan")
        k = max(1, len(self.losses) // 10)
        return float(np.mean(self.losses[-k:]))

    @property
    def compression_ratio(self) -> float:
        return self.baseline_bytes / self.bytes_per_step if self.bytes_per_step else float("inf")

    def record(self) -> dict:
        return {
            "label": self.label, "final_loss": self.final_loss,
            "final_eval": self.eval_values[-1] if self.eval_values else None,
            "bytes_per_step": self.bytes_per_step, "hlo_bytes_per_step": self.hlo_bytes_per_step,
            "baseline_bytes_per_step": self.baseline_bytes, "compression_ratio": self.compression_ratio,
            "seconds": self.seconds, "compile_seconds": self.compile_seconds,
            "replicas_in_sync": self.in_sync, "metrics": self.metrics,
            "steps": self.steps, "losses": self.losses,
            "eval_steps": self.eval_steps, "eval_values": self.eval_values,
        }


def run(trainer: DataParallel, setup: Setup, batch_fn: Callable[[int], Any], steps: int, *,
        eval_fn: Optional[Callable[[Any], float]] = None, eval_every: Optional[int] = None,
        progress: bool = True, ckpt: Any = None, checkpoint_every: Optional[int] = None,
        resume: bool = False, desc: str = "train", position: Optional[int] = None,
        metadata: Optional[dict] = None, verbose: bool = True) -> RunResult:
    """Train for ``steps`` steps in total; ``batch_fn(step)`` gives the global batch of a
    step (a pure function of the step, so a resumed run sees the same data)."""
    start = 0
    if resume and ckpt is not None and ckpt.latest_step() is not None:
        start = trainer.restore(ckpt)
        if verbose:
            print(f"resumed from step {start} ({ckpt.directory})", flush=True)
    if verbose and setup.bytes_note:
        print(f"{setup.label}: {setup.bytes_note}", flush=True)
    t0 = time.time()
    first = batch_fn(start)
    trainer.compile(first)
    hlo = trainer.hlo_bytes(first)
    compile_s = time.time() - t0
    plan = setup.plan
    if plan is not None:
        bytes_per_step = plan.bytes_per_step
    elif setup.bytes_per_step is not None:
        bytes_per_step = setup.bytes_per_step
    else:
        bytes_per_step = hlo
    n_float = sum(int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(trainer.eval_params())
                  if jnp.issubdtype(jnp.result_type(x), jnp.floating))
    baseline = cj.ring_bytes("all-reduce", 4 * n_float, trainer.n)
    eval_every = eval_every or max(1, steps // 10)
    result = RunResult(setup.label, [], [], [], [], bytes_per_step, hlo, baseline, 0.0, compile_s, True, {})
    bar = Progress(steps, initial=start, desc=desc, enabled=progress, position=position,
                   silent=not verbose)
    t1 = time.time()
    try:
        for t in range(start, steps):
            losses = trainer.step(batch_fn(t) if t != start else first)
            loss = float(np.mean(losses))
            if not math.isfinite(loss):
                raise FloatingPointError(f"{setup.label}: loss became {loss} at step {t + 1}")
            result.steps.append(t + 1)
            result.losses.append(loss)
            bar.update(loss, (t + 1) * bytes_per_step)
            if eval_fn is not None and ((t + 1) % eval_every == 0 or t + 1 == steps):
                result.eval_steps.append(t + 1)
                result.eval_values.append(float(eval_fn(trainer.eval_params())))
            if ckpt is not None and checkpoint_every and (t + 1) % checkpoint_every == 0 and t + 1 < steps:
                trainer.save(ckpt, metadata)
    finally:
        bar.close()
    result.seconds = time.time() - t1
    if ckpt is not None:
        trainer.save(ckpt, metadata)
    if setup.sync_every:
        # DiLoCo-style replicas agree only right after a sync, up to one rounding of the
        # landing update; between syncs there is nothing to check.
        at_sync = trainer.step_count % setup.sync_every == 0
        result.in_sync = trainer.replicas_in_sync(rtol=1e-6) if at_sync else None
    elif setup.replicas_agree:
        result.in_sync = trainer.replicas_in_sync()
    else:
        result.in_sync = None
    try:
        result.metrics = step_metrics(trainer.opt_state, plan)
    except ValueError:
        result.metrics = {}
    return result


def summarize(results: Sequence[RunResult], *, eval_name: Optional[str] = None,
              reference: Optional[RunResult] = None) -> str:
    """The summary table printed at the end of every example."""
    rows = []
    ref = reference.final_loss if reference is not None and reference.losses else None
    for r in results:
        final = r.final_loss
        row = {
            "label": r.label,
            "loss": f"{final:.4f}",
            "bytes": human_bytes(r.bytes_per_step),
            "hlo": human_bytes(r.hlo_bytes_per_step),
            "ratio": f"{r.compression_ratio:.2f}x",
            "time": f"{r.seconds:.1f}s",
            "sync": {True: "yes", False: "NO", None: "between syncs"}[r.in_sync],
        }
        if ref is not None:
            row["gap"] = f"{100.0 * (final - ref) / abs(ref):+.2f}%"
        if eval_name and r.eval_values:
            row["eval"] = f"{r.eval_values[-1]:.4f}"
        if "residual_norm" in r.metrics:
            row["res"] = f"{r.metrics['residual_norm']:.3g}"
        rows.append(row)
    cols = [("label", "run"), ("loss", "final loss*")]
    if ref is not None:
        cols.append(("gap", "gap to exact"))
    if eval_name:
        cols.append(("eval", eval_name))
    cols += [("bytes", "bytes/step/device"), ("hlo", "HLO bytes/step"), ("ratio", "compression"),
             ("res", "residual norm"), ("time", "train time"), ("sync", "replicas in sync")]
    return table(rows, cols) + "\n* training loss averaged over the last 10% of the steps"
