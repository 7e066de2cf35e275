"""PowerSGD against the exact mean on the non-i.i.d. task, at equal steps.

Trains the same MLP on ``commjax.testing.noniid_classification`` (every replica sees a
shifted input distribution) with ``compressed_mean(identity())`` and with
``compressed_mean(powersgd(r))`` for several ranks and variants, and reports the final
global loss, its gap to the exact mean, the bytes per step (plan and compiled HLO) and
whether all replicas ended with bit-identical parameters. Writes
``benchmarks/results/powersgd_convergence.json``.

    python benchmarks/powersgd_convergence.py            # 8 simulated CPU devices
    python benchmarks/powersgd_convergence.py --steps 300 --ranks 1 2 4 8

``CONFIG`` is the configuration ``tests/test_powersgd.py`` checks (rank 4 within 5 % of
the exact mean's final loss, rank 1 within 30 %).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    from _devices import simulate_cpu_devices

    simulate_cpu_devices(8)

import jax
import optax

import commjax as cj
from commjax.compressors.powersgd import powersgd
from commjax.testing import noniid_classification, train

#: The task, optimizer and schedule the test uses (kept small: it runs in CI).
CONFIG = dict(
    num_replicas=8,
    examples_per_replica=512,
    dim=32,
    hidden=32,
    classes=10,
    shift=1.5,
    steps=200,
    learning_rate=0.1,
    momentum=0.9,
    min_compress_size=256,
)

RESULTS = Path(__file__).resolve().parent / "results" / "powersgd_convergence.json"


def make_task(cfg: dict):
    return noniid_classification(
        cfg["num_replicas"], examples_per_replica=cfg["examples_per_replica"], dim=cfg["dim"],
        hidden=cfg["hidden"], classes=cfg["classes"], shift=cfg["shift"],
    )


def make_tx(compressor, cfg: dict) -> optax.GradientTransformation:
    return optax.chain(
        cj.compressed_mean(compressor, "data", min_compress_size=cfg["min_compress_size"]),
        optax.sgd(cfg["learning_rate"], momentum=cfg["momentum"]),
    )


def run(compressor, cfg: dict, task=None) -> dict:
    """Train with ``compressor``; returns final loss, curve, bytes and replica agreement."""
    task = task if task is not None else make_task(cfg)
    plan = cj.communication_plan(compressor, task.params, cfg["num_replicas"],
                                 min_compress_size=cfg["min_compress_size"])
    t0 = time.perf_counter()
    res = train(make_tx(compressor, cfg), task, cfg["steps"], log_every=max(1, cfg["steps"] // 20))
    return {
        "final_loss": res.final_loss,
        "losses": [float(v) for v in res.losses],
        "replicas_identical": res.replicas_identical,
        "bytes_per_step": plan.bytes_per_step,
        "compression_ratio": plan.compression_ratio,
        "leaves_compressed": plan.routing.num_compressed,
        "seconds": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=CONFIG["steps"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    cfg = dict(CONFIG, steps=args.steps)
    task = make_task(cfg)
    rows = {"exact": run(cj.identity(), cfg, task)}
    for r in args.ranks:
        rows[f"rank{r}"] = run(powersgd(r), cfg, task)
    r = max(args.ranks)
    rows[f"rank{r}_alternating"] = run(powersgd(r, alternating=True), cfg, task)
    rows[f"rank{r}_qr"] = run(powersgd(r, orthogonalization="qr"), cfg, task)
    rows[f"rank{r}_no_warm_start"] = run(powersgd(r, warm_start=False), cfg, task)
    rows[f"rank{r}_start_step_10"] = run(powersgd(r, start_step=10), cfg, task)
    base = rows["exact"]["final_loss"]
    print(f"{'method':<24} {'final loss':>10} {'gap':>8} {'B/step/dev':>12} {'ratio':>7} identical")
    for name, row in rows.items():
        row["gap_to_exact"] = row["final_loss"] / base - 1.0
        print(f"{name:<24} {row['final_loss']:>10.4f} {100 * row['gap_to_exact']:>7.2f}% "
              f"{row['bytes_per_step']:>12,.0f} {row['compression_ratio']:>7.2f} {row['replicas_identical']}")
    out = {
        "config": cfg,
        "jax_version": jax.__version__,
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "results": rows,
    }
    from _results import write_results

    write_results(args.out, out, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
