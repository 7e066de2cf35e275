"""DeMo's default settings on three seeds and two tasks, against data-parallel Adam.

``cj.decoupled_momentum``'s learning rate is the caller's; its other settings (``beta``,
``chunk_size``, ``top_k``, ``values_dtype``) have defaults. This script trains a small
grid of those settings, each at a few learning rates, on every seed, next to Adam with
the exact mean at its own learning rates, and reports per configuration the gap of its
final loss to the best Adam run of the same seed (mean, smallest and largest over the
seeds):

* ``--task charlm``: ``benchmarks/crossdc.py``'s character Transformer (8 workers, 500
  steps, held-out loss of the workers' mean parameters; seed: model init and batches);
* ``--task mlp``: ``commjax.testing.noniid_classification(8, seed=s)`` (full batch, 300
  steps, final global training loss).

Settings ``k32``: ``beta=0.999, chunk_size=64, top_k=32``, fp32 values (the earlier
defaults); ``k48bf16``: ``top_k=48`` with bf16 values (the same bytes: 4 instead of 6 per
coefficient); ``k48bf16_b99``: the same with ``beta=0.99``. The configuration chosen is
the settings with the smallest mean gap within the bytes of ``k32``, at their best
learning rate.

    python benchmarks/demo_defaults.py --task charlm
    python benchmarks/demo_defaults.py --task mlp

Writes ``benchmarks/results/demo_defaults_<task>.json`` (after every run; runs already in
the file are kept, so an interrupted sweep continues).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import crossdc  # first: it asks for the 8 CPU devices before JAX is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _charlm  # noqa: E402
import commjax as cj  # noqa: E402
from _results import write_results  # noqa: E402
from commjax import _compat  # noqa: E402
from commjax.testing import noniid_classification, train  # noqa: E402
from demo_tuning import crossdc_args  # noqa: E402

SETTINGS = {
    "k32": dict(beta=0.999, chunk_size=64, top_k=32, values_dtype="float32"),
    "k48bf16": dict(beta=0.999, chunk_size=64, top_k=48, values_dtype="bfloat16"),
    "k48bf16_b99": dict(beta=0.99, chunk_size=64, top_k=48, values_dtype="bfloat16"),
}
TASKS = {  # steps, Adam learning rates, DeMo (settings, learning rate) pairs
    "charlm": dict(steps=500, adam=(3e-3, 4e-3),
                   demo=[("k32", 1e-3), ("k32", 2e-3), ("k48bf16", 1e-3), ("k48bf16", 2e-3),
                         ("k48bf16", 3e-3), ("k48bf16_b99", 2e-3)]),
    "mlp": dict(steps=300, adam=(1e-2, 3e-2, 1e-1),
                demo=[(s, lr) for s in SETTINGS for lr in (1e-2, 3e-2, 1e-1)]),
}
SEEDS = (0, 1, 2)


def demo_tx(settings: str, lr: float):
    s = dict(SETTINGS[settings])
    return cj.decoupled_momentum(lr, axis_name=crossdc.AXIS, values_dtype=jnp.dtype(s.pop("values_dtype")), **s)


def adam_tx(lr: float):
    return optax.chain(cj.compressed_mean(cj.identity(), crossdc.AXIS), optax.adam(lr))


def run_key(kind: str, settings: str, lr: float, seed: int) -> str:
    return f"{kind} {settings} lr={lr:g} seed={seed}" if kind == "demo" else f"adam lr={lr:g} seed={seed}"


class CharLM:
    """crossdc.py's setup for one seed: ``(final held-out loss, bytes per step)`` of a run."""

    def __init__(self, steps: int, seed: int):
        self.cx = crossdc_args(steps, seed)
        self.mesh = _compat.make_mesh((crossdc.N,), (crossdc.AXIS,))
        self.corpus = _charlm.Corpus(self.cx.corpus_chars)
        self.graphdef, self.params = _charlm.make_model(d_model=self.cx.d_model, layers=self.cx.layers, heads=2,
                                                        seq_len=self.cx.seq_len, seed=seed)
        self.held_out = jnp.asarray(self.corpus.eval_batch(128, self.cx.seq_len))

    def __call__(self, name, make):
        r = crossdc.train(name, make, self.mesh, self.graphdef, self.params, self.corpus, self.held_out, self.cx)
        return r["final_eval"], r["bytes"]["per_inner_step"]


class MLP:
    """``noniid_classification(8, seed)``: final global loss and the plan's bytes."""

    def __init__(self, steps: int, seed: int):
        self.steps, self.task = steps, noniid_classification(crossdc.N, seed=seed)

    def __call__(self, name, make):
        res = train(make(), self.task, self.steps, log_every=self.steps)
        tx = cj.identity() if name.startswith("adam") else make()  # Adam: the exact mean's bytes
        return float(res.final_loss), cj.communication_plan(tx, self.task.params, crossdc.N).bytes_per_step


def summarize(runs: dict, spec: dict) -> list:
    """Per configuration: its gap to the best Adam run of each seed, over the seeds."""
    best = {s: min(r["final_loss"] for r in runs.values() if r["kind"] == "adam" and r["seed"] == s)
            for s in {r["seed"] for r in runs.values()}}
    configs = [("adam", "-", lr) for lr in spec["adam"]] + [("demo", s, lr) for s, lr in spec["demo"]]
    rows = []
    for kind, settings, lr in configs:
        got = [r for r in runs.values() if (r["kind"], r["settings"], r["lr"]) == (kind, settings, lr)]
        if not got:
            continue
        gaps = [r["final_loss"] / best[r["seed"]] - 1 for r in got]
        finite = all(np.isfinite(gaps))
        rows.append({"config": f"{kind} {settings} lr={lr:g}" if kind == "demo" else f"adam lr={lr:g}",
                     "kind": kind, "settings": settings, "lr": lr, "seeds": sorted(r["seed"] for r in got),
                     "bytes_per_step": got[0]["bytes_per_step"],
                     "final_loss_mean": round(float(np.mean([r["final_loss"] for r in got])), 4),
                     "gap_mean": round(float(np.mean(gaps)), 4) if finite else None,
                     "gap_min": round(float(np.min(gaps)), 4) if finite else None,
                     "gap_max": round(float(np.max(gaps)), 4) if finite else None})
    return rows


def choose(rows: list) -> dict:
    """The settings with the smallest mean gap (at their best learning rate) among those
    that send no more than ``k32``; and each settings' best row."""
    demo = [r for r in rows if r["kind"] == "demo" and r["gap_mean"] is not None and len(r["seeds"]) == len(SEEDS)]
    budget = min((r["bytes_per_step"] for r in demo if r["settings"] == "k32"), default=float("inf"))
    best_of = {}
    for r in demo:
        if r["settings"] not in best_of or r["gap_mean"] < best_of[r["settings"]]["gap_mean"]:
            best_of[r["settings"]] = r
    cheap = [r for r in best_of.values() if r["bytes_per_step"] <= budget]
    chosen = min(cheap, key=lambda r: r["gap_mean"]) if cheap else None
    return {"chosen": None if chosen is None else chosen["config"],
            "best_per_settings": {s: r["config"] for s, r in best_of.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(TASKS), required=True)
    ap.add_argument("--out", default=None, help="default benchmarks/results/demo_defaults_<task>.json")
    args = ap.parse_args(argv)
    spec = TASKS[args.task]
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"demo_defaults_{args.task}.json")
    runs = json.load(open(out))["runs"] if os.path.exists(out) else {}
    for seed in SEEDS:
        setup = (CharLM if args.task == "charlm" else MLP)(spec["steps"], seed)
        todo = [("adam", "-", lr, lambda lr=lr: adam_tx(lr)) for lr in spec["adam"]] + [
            ("demo", s, lr, lambda s=s, lr=lr: demo_tx(s, lr)) for s, lr in spec["demo"]]
        for kind, settings, lr, make in todo:
            name = run_key(kind, settings, lr, seed)
            if name in runs:
                continue
            t0 = time.perf_counter()
            loss, nbytes = setup(name, make)
            runs[name] = {"kind": kind, "settings": settings, "lr": lr, "seed": seed,
                          "final_loss": round(float(loss), 5) if np.isfinite(loss) else None,
                          "bytes_per_step": float(nbytes), "seconds": round(time.perf_counter() - t0, 1)}
            print(f"  {name:40s} loss {loss:.4f}  {nbytes:,.0f} B/step  {runs[name]['seconds']:.0f} s", flush=True)
            write_results(out, {"runs": runs}, command=f"python benchmarks/demo_defaults.py --task {args.task}")
    rows = summarize(runs, spec)
    for r in rows:
        print(f"{r['config']:32s} mean gap {100 * r['gap_mean']:+6.2f}% [{100 * r['gap_min']:+.2f}, "
              f"{100 * r['gap_max']:+.2f}]  {r['bytes_per_step']:,.0f} B/step")
    payload = {"task": args.task, "steps": spec["steps"], "seeds": list(SEEDS), "replicas": crossdc.N,
               "settings": SETTINGS, "rows": rows, **choose(rows), "runs": runs,
               "gap": "final loss / best Adam final loss of the same seed - 1",
               "jax": jax.__version__}
    write_results(out, payload, command=f"python benchmarks/demo_defaults.py --task {args.task}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
