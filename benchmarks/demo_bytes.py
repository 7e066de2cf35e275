"""DeMo's bytes on the wire: one replica's payload against the fp32 gradient, and the
per-device bytes of its all-gather against the fp32 ring all-reduce as replicas grow.

For the char-LM of ``examples/_charlm.py`` (default size) and a GPT-2-small-shaped
model of the same code (d_model 768, 12 layers, context 1024), with the defaults of
``cj.decoupled_momentum`` (64 x 64 tiles, 32 coefficients kept) and fp32 or bf16 values:

* payload per replica (``cj.communication_plan(cj.decoupled_momentum(...), params, 2)``) vs
  ``4 n`` bytes;
* per-device bytes of one step at N = 2 ... 64, read from the compiled HLO
  (``cj.collective_bytes`` on the update, N simulated CPU devices) and checked against the
  analytic count, vs the exact fp32 mean (``cj.compressed_mean(cj.identity())``) compiled
  the same way in the same run, and vs the ring formula ``2 (N-1)/N * 4 n``;
* the replica count from which the all-gather sends at least as much as the fp32
  all-reduce: ``(N-1) P >= 2 (N-1)/N * 4 n``, i.e. ``N >= 8 n / P``.

    python benchmarks/demo_bytes.py [--replicas 2,4,8,16,32,64] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from _devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(64)

import jax  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import commjax as cj  # noqa: E402
from _results import write_results  # noqa: E402
from commjax.testing import update_collectives  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _charlm  # noqa: E402

# model -> (its configuration, replica counts whose step is compiled and read from the
# HLO; None: all). The larger model compiles in ~20 s per step here, so the run reads
# three replica counts from its HLO and computes the others from the plan.
MODELS = {
    "char-LM (d64, 2 layers)": (dict(d_model=64, layers=2, heads=4, seq_len=64), None),
    "GPT-2-small shape (d768, 12 layers)": (
        dict(d_model=768, layers=12, heads=12, seq_len=1024), (2, 8, 64)),
}
VALUES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def param_shapes(cfg: dict):
    """Abstract parameters (``ShapeDtypeStruct``) of the char-LM at ``cfg``: no memory."""
    model = nnx.eval_shape(lambda: _charlm.CharTransformer(**cfg, rngs=nnx.Rngs(0)))
    _, params = nnx.split(model, nnx.Param)
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)


def row(name: str, params, n: int, reps: int, vname: str, compile_hlo: bool) -> dict:
    """One (model, values dtype, N) row; HLO numbers are None where not compiled."""
    vdtype = VALUES[vname]
    plan = cj.communication_plan(cj.decoupled_momentum(1e-3, chunk_size=64, top_k=32, values_dtype=vdtype), params, reps).bytes_per_step
    payload = cj.communication_plan(cj.decoupled_momentum(1e-3, chunk_size=64, top_k=32, values_dtype=vdtype), params, 2).bytes_per_step
    ring = cj.ring_bytes("all-reduce", 4 * n, reps)
    hlo = exact = None
    if compile_hlo:
        tx = cj.decoupled_momentum(1e-3, chunk_size=64, top_k=32, values_dtype=vdtype)
        hlo = update_collectives(tx, params, reps).total_ring_bytes
        exact = update_collectives(cj.compressed_mean(cj.identity(), "data"), params,
                                   reps).total_ring_bytes
    return {
        "model": name, "params": n, "values": vname, "replicas": reps,
        "payload_bytes": payload, "fp32_gradient_bytes": 4 * n, "payload_ratio": 4 * n / payload,
        "demo_plan_bytes": plan, "demo_hlo_bytes": hlo,
        "hlo_equals_plan": None if hlo is None else hlo == plan,
        "exact_mean_hlo_bytes": exact, "fp32_ring_allreduce_bytes": ring,
        "ratio_vs_exact_hlo": None if hlo is None else exact / hlo,
        "ratio_vs_ring_formula": ring / plan,
        "break_even_replicas": math.ceil(8 * n / payload),
    }


def measure(name: str, params, replicas: list[int], hlo_replicas) -> list[dict]:
    n = sum(math.prod(p.shape) for p in jax.tree_util.tree_leaves(params))
    rows = []
    for reps in replicas:
        for vname in VALUES:
            r = row(name, params, n, reps, vname, hlo_replicas is None or reps in hlo_replicas)
            rows.append(r)
            hlo = "-" if r["demo_hlo_bytes"] is None else f"{r['demo_hlo_bytes']:,.0f}"
            vs_exact = "-" if r["ratio_vs_exact_hlo"] is None else f"{r['ratio_vs_exact_hlo']:.2f}x"
            print(f"{name:36s} {vname:4s} {reps:3d} {r['payload_bytes']:11,.0f} "
                  f"{r['payload_ratio']:7.1f}x {r['demo_plan_bytes']:13,.0f} {hlo:>13s} "
                  f"{str(r['hlo_equals_plan']):>5s} {r['ratio_vs_ring_formula']:8.2f}x "
                  f"{vs_exact:>8s} {r['break_even_replicas']:5d}", flush=True)
    return rows


def plot(rows: list[dict], path: str) -> None:
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        for vname in VALUES:
            sel = [r for r in mine if r["values"] == vname]
            ax.plot([r["replicas"] for r in sel], [r["demo_plan_bytes"] for r in sel], "o-",
                    label=f"DeMo all-gather ({vname} values)")
        sel = [r for r in mine if r["values"] == "fp32"]
        ax.plot([r["replicas"] for r in sel], [r["fp32_ring_allreduce_bytes"] for r in sel], "s--",
                label="fp32 ring all-reduce")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("replicas N")
        ax.set_ylabel("bytes per device and step")
        ax.set_title(f"{model}: {mine[0]['params']:,} params", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="2,4,8,16,32,64")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    replicas = [int(x) for x in args.replicas.split(",")]
    print(f"{'model':36s} {'val':4s} {'N':>3s} {'payload B':>11s} {'vs fp32':>8s} "
          f"{'plan B/dev':>13s} {'HLO B/dev':>13s} {'=plan':>5s} {'vs ring':>9s} "
          f"{'vs exact':>8s} {'N*':>5s}")
    rows = []
    for name, (cfg, hlo_replicas) in MODELS.items():
        rows += measure(name, param_shapes(cfg), replicas, hlo_replicas)
    command = "python benchmarks/demo_bytes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_results(os.path.join(args.out, "demo_bytes.json"), {
        "command": command.strip(),
        "jax": jax.__version__,
        "settings": {"chunk_size": 64, "top_k": 32, "replicas": replicas},
        "note": "Bytes per device and step, ring convention. 'vs ring': the fp32 ring "
                "all-reduce 2(N-1)/N*4n over DeMo's plan; 'vs exact': the compiled exact mean "
                "(cj.compressed_mean(cj.identity()), NaN flags included) over DeMo's compiled "
                "step, both read from the HLO on simulated CPU devices (null where not compiled). "
                "N* = smallest replica count at which the all-gather sends at least the fp32 "
                "all-reduce's bytes (8 n / payload).",
        "rows": rows,
    })
    plot(rows, os.path.join(args.out, "demo_bytes.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
