"""Measure before adopting: exact vs compressed train steps on *your* devices.

    python -m commjax.bench --params 50e6                       # every local device
    python -m commjax.bench --params 5e6 --devices 8            # 8 simulated CPU devices
    python -m commjax.bench --params 200e6 --distributed        # one process per host
    python -m commjax.bench --target v5e:2x4 --params 1e9       # deviceless: no accelerator
    python -m commjax.bench --target v5e:2x4 --params 1e9 --bucket-mb 16 --residual-dtype bfloat16
    python -m commjax.bench --target v5e:2x4 --params 1e9 --bucket-mb 0   # one bucket

With ``--target`` nothing runs: each step is compiled for that TPU topology or GPU target
from this machine ([`commjax.aot`][]; ``pip install 'commjax[aot]'``) and the table gives
the compiled program's HBM traffic, scratch, wire bytes and a projected step time on the
target's fast and slow links, each against the exact step as written without commjax
(``pmean``).

For a model of about ``--params`` parameters (``--layers`` square matrices, their side a
multiple of 128 from 128 up, as models' widths are), each
compressor's step (``cj.data_parallel`` of ``chain(cj.compressed_mean(c), sgd)``) is
compiled and timed, next to the exact fp32 mean (``compressed_mean(cj.identity())``), the
plain ``lax.pmean`` of each leaf (``pmean``: the exact mean without commjax) and a floor
with no exchange at all (each replica applies its own gradient). The table gives, per step and device:

* ``bytes``: what the compiled HLO sends ([`commjax.DataParallel.collectives`][]);
* ``step``: median wall time of ``--steps`` steps;
* ``speedup``: ``t_exact / t``, the exact step being ``pmean`` (what a user has before
  commjax);
* ``bound``: the speedup its bytes alone would allow. With ``t0`` the floor's step and
  ``bw = B_exact / (t_exact - t0)`` the bandwidth the exact step achieved,
  ``bound = t_exact / (t0 + B / bw)``; ``speedup / bound`` is the share of it reached
  (below 1: the codec's encode/decode costs more than its bytes save).

Timing is of whatever runs here (devices, processes, links): on simulated CPU devices
the "link" is memory, where compression rarely pays; the point is to run it where the
training will run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commjax import _compat, aot, launch
from commjax.compressors import cast, identity, powersgd, quantize, sign, top_k
from commjax.step import data_parallel
from commjax.transform import compressed_mean

__all__ = ["Row", "run", "main", "plain_mean", "COMPRESSORS"]

#: The compressors ``--compressors`` can name.
COMPRESSORS = {
    "bf16": lambda: cast(jnp.bfloat16),
    "int8": lambda: quantize(8),
    "int4": lambda: quantize(4),
    "sign": lambda: sign(),
    "powersgd4": lambda: powersgd(4),
    "topk1pct": lambda: top_k(0.01),
}


@dataclasses.dataclass
class Row:
    """One line of the table (per device and step)."""

    method: str
    bytes: float
    step_s: float
    speedup: float = float("nan")
    bound: float = float("nan")


#: Widths of at least this many go to a multiple of it, as models' widths do.
WIDTH_MULTIPLE = 128


def _width(num_params: float, layers: int, width: Optional[int] = None) -> int:
    """The side of ``layers`` square matrices of about ``num_params`` parameters in all
    (``width``, when given, is the side and ``num_params`` is not used).

    From 128 up it is a multiple of 128, as a model's widths are: the codecs read a leaf
    as lane rows of 128 values, a view a TPU lays out for free only when each row holds
    whole lane rows. At another width every view is a relayout: compiled for a v5e-8 in
    4 MB buckets, int8 moves 5.79x the ``pmean`` step's memory at width 5000 and 4.76x at
    5120 (``docs/accelerators.md``)."""
    if isinstance(layers, bool) or not isinstance(layers, (int, np.integer)) or layers < 1:
        raise ValueError(f"bench: `layers` must be a positive integer (square matrices), got {layers!r}.")
    if width is None and not (np.isfinite(num_params) and num_params >= 1):
        raise ValueError(f"bench: `num_params` must be at least 1 (the model's parameters), got {num_params!r}.")
    if width is not None:
        if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
            raise ValueError(f"bench: `width` must be a positive integer (the matrices' side), got {width!r}.")
        return int(width)
    d = (num_params / layers) ** 0.5
    if d < WIDTH_MULTIPLE:
        return max(8, int(round(d)))
    return WIDTH_MULTIPLE * int(round(d / WIDTH_MULTIPLE))


def _model(num_params: float, layers: int, seed: int = 0, width: Optional[int] = None) -> dict:
    """``layers`` square matrices of about ``num_params`` parameters in all (``_width``)."""
    d = _width(num_params, layers, width)
    keys = jax.random.split(jax.random.PRNGKey(seed), layers)
    return {f"w{i}": jax.random.normal(k, (d, d), jnp.float32) / np.sqrt(d)
            for i, k in enumerate(keys)}


def _loss(params: dict, x: jax.Array) -> jax.Array:
    for i in range(len(params)):
        x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean(x * x)


def _time(dp: Any, params: dict, batch: jax.Array, steps: int) -> tuple[float, float]:
    """``(median step seconds, HLO bytes per step and device)`` after two warm-up steps."""
    state = dp.init(params)
    report = dp.collectives(state, batch)
    placed = dp.place_batch(batch)
    times = []
    for t in range(steps + 2):
        t0 = time.perf_counter()
        state, loss = dp.step(state, placed)
        # One multi-device step in flight at a time (CPU collectives can deadlock).
        jax.block_until_ready(loss)
        if t >= 2:
            times.append(time.perf_counter() - t0)
    return float(np.median(times)), report.total_ring_bytes


def _then_sgd(mean: optax.GradientTransformation) -> optax.GradientTransformation:
    """The benchmarked step's transformation: ``mean`` then SGD."""
    return optax.chain(mean, optax.sgd(1e-3))


def _mean(codec: Any, options: dict) -> optax.GradientTransformation:
    """``compressed_mean(codec)`` then SGD."""
    return _then_sgd(compressed_mean(codec, "data", **options))


def plain_mean(axis_name: Any = "data") -> optax.GradientTransformation:
    """The exact mean as it is written without commjax: ``lax.pmean`` of each leaf over
    ``axis_name`` (inside ``shard_map``), sending ``2 (N-1)/N * 4`` bytes per fp32 value.
    No pre-scaled sum (a sum past the fp32 range overflows) and no non-finite flags, so
    it can move less memory than ``compressed_mean(cj.identity())`` (a v5e, GPT-2-small
    update step: 0.70x, ``docs/accelerators.md``): the baseline a user runs today, and
    the one every compiled-step ratio is taken against."""
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda updates, state, params=None: (
            jax.tree_util.tree_map(lambda g: jax.lax.pmean(g, axis_name), updates), state))


#: ``--check-finite`` words and the ``compressed_mean(check_finite=)`` values they name.
CHECK_FINITE = {"true": True, "false": False, "reset": "reset"}


def _options(bucket_bytes: Union[int, str, None], residual_dtype: Any, check_finite: Any = True) -> dict:
    """``compressed_mean`` options of the compressed rows (the exact row keeps the
    defaults: it is commjax's exact mean as a user writes it). ``bucket_bytes``: bytes a
    bucket, ``0`` for one bucket, ``"auto"`` for compressed_mean's default."""
    out: dict = {} if bucket_bytes == "auto" else {"bucket_bytes": int(bucket_bytes) or None}
    if residual_dtype is not None:
        out["residual_dtype"] = jnp.dtype(residual_dtype)
    if check_finite is not True:
        out["check_finite"] = check_finite
    return out


#: The label of the baseline row (``plain_mean`` + SGD) every ratio is taken against.
_BASE = "pmean"


def _check_names(compressors: Sequence[str]) -> None:
    unknown = sorted(set(compressors) - set(COMPRESSORS))
    if unknown:
        raise ValueError(f"bench: unknown `compressors` {unknown}; choose from {sorted(COMPRESSORS)}.")


def _runs(compressors: Sequence[str], options: dict, exact_label: str, exact: Optional[dict] = None) -> list:
    """``(label, transform)`` of the exact row, the plain ``lax.pmean`` row
    ([`plain_mean`][commjax.bench.plain_mean]) and each compressor's, built before anything
    is compiled or timed: a bad name or option fails at once, naming itself. ``exact``:
    the exact row's options (default none)."""
    _check_names(compressors)
    return ([(exact_label, _mean(identity(), exact or {})), (_BASE, _then_sgd(plain_mean()))]
            + [(c, _mean(COMPRESSORS[c](), options)) for c in compressors])


def run(num_params: float = 10e6, *, compressors: Sequence[str] = ("int8", "int4", "sign"),
        layers: int = 4, steps: int = 10, batch_per_replica: int = 8,
        mesh: Optional[jax.sharding.Mesh] = None, bucket_bytes: Union[int, str] = "auto",
        residual_dtype: Any = None, check_finite: Any = True, width: Optional[int] = None) -> list[Row]:
    """Time the floor (no exchange), the exact mean and each compressor; see the module
    docstring for the columns. ``mesh``: default, one ``"data"`` axis over every device
    (every process's, under ``jax.distributed``). ``bucket_bytes``, ``residual_dtype``,
    ``check_finite``: [`commjax.compressed_mean`][]'s options for the compressors' rows
    (``bucket_bytes=0``: one bucket).
    ``width``: the matrices' side (default from ``num_params``, see ``_width``)."""
    runs = _runs(compressors, _options(bucket_bytes, residual_dtype, check_finite), "exact fp32 mean")
    if mesh is None:
        mesh = _compat.make_mesh((jax.device_count(),), ("data",))
    params = _model(num_params, layers, width=width)
    d = params["w0"].shape[0]
    n = int(mesh.shape["data"])
    batch = jax.random.normal(jax.random.PRNGKey(1), (n * batch_per_replica, d))
    floor = data_parallel(_loss, optax.sgd(1e-3), mesh, per_replica_params=True)
    t0, _ = _time(floor, params, batch, steps)
    rows = [Row("no exchange (floor)", 0.0, t0)]
    for label, tx in runs:
        t, b = _time(data_parallel(_loss, tx, mesh), params, batch, steps)
        rows.append(Row(label, b, t))
    base = next(r for r in rows if r.method == _BASE)
    bw = base.bytes / (base.step_s - t0) if base.step_s > t0 else float("inf")
    for r in rows:
        r.speedup = base.step_s / r.step_s
        r.bound = base.step_s / (t0 + r.bytes / bw) if bw > 0 else float("nan")
    return rows


def _shapes(num_params: float, layers: int, width: Optional[int] = None) -> dict:
    d = _width(num_params, layers, width)
    return {f"w{i}": jax.ShapeDtypeStruct((d, d), jnp.float32) for i in range(layers)}


def run_target(target: str, num_params: float = 1e9, *, compressors: Sequence[str] = ("int8", "int4", "sign"),
               layers: int = 4, bucket_bytes: Union[int, str] = "auto", residual_dtype: Any = None,
               check_finite: Any = True, width: Optional[int] = None) -> list[dict]:
    """Compile the exact and each compressor's update step for ``target`` (deviceless)
    and report them ([`commjax.aot.analyze`][]), each with ratios to the exact step as
    written without commjax (the ``pmean`` row; commjax's exact mean is the row before it).
    ``bucket_bytes``, ``residual_dtype``, ``check_finite``, ``width``: as for
    [`run`][commjax.bench.run]; ``"auto"`` takes the target's default
    ([`commjax.bucketing.auto_bucket_bytes`][] for its platform), which the exact row
    always takes: the default of the process compiling it need not be the target's. On a TPU,
    buckets of a few MB keep the codecs' intermediates on chip, ``check_finite="reset"``
    spares the residual pass a second read of the old residuals, and bf16 residuals
    halve their state (``docs/accelerators.md``)."""
    _check_names(compressors)  # before the target's topology, which needs the aot extra
    mesh = aot.target_mesh(target)
    params = _shapes(num_params, layers, width)
    default = aot.target_bucket_bytes(target, params)
    if bucket_bytes == "auto":
        bucket_bytes = default or 0
    runs = _runs(compressors, _options(bucket_bytes, residual_dtype, check_finite), "exact",
                 {"bucket_bytes": default})
    rows = []
    for label, tx in runs:
        rep = aot.analyze(aot.compile_update(tx, params, mesh), target)
        size = {"exact": default, _BASE: None}.get(label, bucket_bytes or None)
        rep.update(method=label, bucket_bytes=size)
        rows.append(rep)
    base = next(r for r in rows if r["method"] == _BASE)
    for r in rows:
        for key in ("traffic", "temp", "wire", "projected_fast_s", "projected_slow_s"):
            r[f"{key}_vs_exact"] = r[key] / base[key] if base[key] else float("nan")
    return rows


def target_table(rows: Sequence[dict]) -> str:
    """The deviceless rows as a fixed-width text table (per device and step)."""
    head = (f"{'method':<10} {'HBM traffic':>12} {'x pmean':>8} {'scratch':>10} {'wire':>10} "
            f"{'fast link':>10} {'x pmean':>8} {'slow link':>10} {'x pmean':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<10} {r['traffic'] / 1e6:>9.1f} MB {r['traffic_vs_exact']:>7.2f}x "
                     f"{r['temp'] / 1e6:>7.1f} MB {r['wire'] / 1e6:>7.2f} MB "
                     f"{r['projected_fast_s'] * 1e3:>7.2f} ms {r['projected_fast_s_vs_exact']:>7.2f}x "
                     f"{r['projected_slow_s'] * 1e3:>7.2f} ms {r['projected_slow_s_vs_exact']:>7.2f}x")
    return "\n".join(lines)


def table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table."""
    head = f"{'method':<22} {'bytes/step':>12} {'step':>9} {'speedup':>8} {'bound':>8} {'reached':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        reached = r.speedup / r.bound if r.bound and np.isfinite(r.bound) else float("nan")
        lines.append(f"{r.method:<22} {r.bytes / 1e6:>9.2f} MB {r.step_s * 1e3:>6.1f} ms "
                     f"{r.speedup:>7.2f}x {r.bound:>7.2f}x {100 * reached:>7.0f}%")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commjax.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=10e6, help="model parameters (default 10e6)")
    p.add_argument("--layers", type=int, default=4, help="square matrices (default 4)")
    p.add_argument("--width", type=int, default=None,
                   help="the matrices' side, instead of one from --params (a multiple of 128 from 128 up)")
    p.add_argument("--compressors", nargs="+", default=["int8", "int4", "sign", "powersgd4"],
                   choices=sorted(COMPRESSORS), help="compressors to time besides the exact mean")
    p.add_argument("--steps", type=int, default=10, help="timed steps per method (default 10)")
    p.add_argument("--batch", type=int, default=8, help="rows per replica (default 8)")
    p.add_argument("--devices", type=int, default=None,
                   help="simulate this many CPU devices (sets XLA_FLAGS and re-runs itself)")
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (one process per host)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--target", default=None, choices=sorted(aot.TARGETS),
                   help="compile for this accelerator instead of running (deviceless; needs "
                        "the aot extra)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="compressed means in buckets of this many MB (compressed_mean(bucket_bytes=)); "
                        "0: one bucket; default compressed_mean's (\"auto\": buckets on a TPU, one "
                        "bucket elsewhere; with --target, the target's)")
    p.add_argument("--residual-dtype", default=None, choices=["float32", "bfloat16"],
                   help="error-feedback residuals' dtype (compressed_mean(residual_dtype=)); default float32")
    p.add_argument("--check-finite", default="true", choices=list(CHECK_FINITE),
                   help="the compressed rows' non-finite guard (compressed_mean(check_finite=)): "
                        "'true' keeps a flagged step's residuals (default), 'reset' restarts them "
                        "from zero and reads them once less per step, 'false' has no guard")
    return p


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values argparse's types accept but no run can use: an error that names the flag."""
    if not (np.isfinite(args.params) and args.params >= 1):
        parser.error(f"argument --params: must be at least 1 (parameters of the model), got {args.params:g}")
    for flag, value in (("layers", args.layers), ("steps", args.steps), ("batch", args.batch),
                        ("devices", args.devices), ("width", args.width)):
        if value is not None and value < 1:
            parser.error(f"argument --{flag}: must be a positive integer, got {value}")
    if args.bucket_mb is not None and not (np.isfinite(args.bucket_mb) and args.bucket_mb >= 0):
        parser.error(f"argument --bucket-mb: must be >= 0 (0: one bucket), got {args.bucket_mb:g}")


def _bucket_bytes(args: argparse.Namespace) -> Union[int, str]:
    """``--bucket-mb`` in bytes: ``0`` one bucket, ``"auto"`` when not given."""
    if args.bucket_mb is None:
        return "auto"
    return 0 if args.bucket_mb <= 0 else max(1, int(args.bucket_mb * 2 ** 20))


def _model_line(args: argparse.Namespace) -> str:
    d = _width(args.params, args.layers, args.width)
    return f"{args.layers} matrices of {d} x {d} ({args.layers * d * d / 1e6:.4g}M parameters)"


def _options_line(args: argparse.Namespace) -> str:
    """The compressed rows' options as the call a user would write (the exact row is the
    default mean)."""
    opts = _options(_bucket_bytes(args), args.residual_dtype, CHECK_FINITE[args.check_finite])
    words = ", ".join(f"{k}={v!r}" if k != "residual_dtype" else f"{k}=jnp.{v}" for k, v in opts.items())
    return f"compressed rows: compressed_mean(codec{', ' + words if words else ''})"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.target:
        return _main_target(args)
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if args.devices and flag not in os.environ.get("XLA_FLAGS", ""):
        # The device count is fixed when JAX starts its CPU backend: start again with it.
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip(),
                   JAX_PLATFORMS="cpu")
        launch.set_cpu_threads(env, args.devices)
        os.execve(sys.executable, [sys.executable, "-m", "commjax.bench", *argv], env)
    if args.distributed:
        jax.distributed.initialize()
    rows = run(args.params, compressors=args.compressors, layers=args.layers,
               steps=args.steps, batch_per_replica=args.batch, bucket_bytes=_bucket_bytes(args),
               residual_dtype=args.residual_dtype, check_finite=CHECK_FINITE[args.check_finite],
               width=args.width)
    if jax.process_index() == 0:
        print(f"{jax.device_count()} {jax.devices()[0].platform} devices, "
              f"{jax.process_count()} process(es), {_model_line(args)}")
        print(_options_line(args))
        print(table(rows))
        if jax.device_count() == 1:
            print("one device: nothing crosses a network, so no step can be faster than the exact "
                  "one; pass --devices N to simulate N CPU devices, or run on several accelerators")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dataclasses.asdict(r) for r in rows], f, indent=2)
    return 0


def _main_target(args: argparse.Namespace) -> int:
    rows = run_target(args.target, args.params, compressors=args.compressors, layers=args.layers,
                      bucket_bytes=_bucket_bytes(args), residual_dtype=args.residual_dtype,
                      check_finite=CHECK_FINITE[args.check_finite], width=args.width)
    print(f"{args.target} (compiled here, deviceless), {_model_line(args)}, per device and step")
    print(_options_line(args))
    size = rows[0]["bucket_bytes"]  # the exact row's: the target's default
    print("the target's default (bucket_bytes=\"auto\", the exact row's): "
          + ("one bucket" if size is None else f"buckets of {size / 2 ** 20:g} MiB"))
    print(target_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
