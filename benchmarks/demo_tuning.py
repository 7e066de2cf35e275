"""A small sweep of DeMo (and of the data-parallel AdamW baseline) on crossdc.py's char LM.

Same model, data, workers (8), steps and evaluation as ``benchmarks/crossdc.py``; only the
optimizer's settings change. Each run is one spec::

    demo:lr=2e-3,beta=0.999,chunk=64,top_k=32[,sched=cos][,vals=bf16]
    adam:lr=3e-3[,sched=cos]

``sched=cos`` is a linear warm-up over 5% of the steps then a cosine decay to 0, the same
shape on both sides (crossdc.py uses constant learning rates for every method). ``vals=bf16`` sends DeMo's
coefficient values as bf16 (4 bytes a coefficient with its uint16 index instead of 6), so
``top_k=48,vals=bf16`` costs the bytes of ``top_k=32`` in fp32. Every run
is appended to ``--out`` as soon as it ends (a spec already there is skipped, so a sweep
can be continued in later invocations, one training process at a time); the table gives
each run's final held-out loss and its ratio to the best AdamW run of the file.

    python benchmarks/demo_tuning.py demo:lr=2e-3 adam:lr=1e-3 ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import crossdc  # first: it asks for the 8 CPU devices before JAX is imported

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import _charlm  # noqa: E402
import commjax as cj  # noqa: E402
from _results import write_results  # noqa: E402
from commjax import _compat  # noqa: E402

DEMO_DEFAULTS = {"lr": 1e-3, "beta": 0.999, "chunk": 64, "top_k": 32, "sched": "const", "vals": "fp32"}
ADAM_DEFAULTS = {"lr": 3e-3, "sched": "const"}


def parse(spec: str) -> dict:
    kind, _, rest = spec.partition(":")
    if kind not in ("demo", "adam"):
        raise SystemExit(f"error: {spec!r}: the kind must be demo or adam")
    cfg = dict(DEMO_DEFAULTS if kind == "demo" else ADAM_DEFAULTS, kind=kind)
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in cfg or key == "kind":
            raise SystemExit(f"error: {spec!r}: unknown setting {key!r}")
        cfg[key] = value if key in ("sched", "vals") else type(cfg[key])(float(value))
    return cfg


def key(cfg: dict) -> str:
    """A canonical name: the same settings always give the same key, whatever the spec's order."""
    seed = f" seed={cfg['seed']}" if cfg["seed"] else ""
    if cfg["kind"] == "adam":
        return f"adam lr={cfg['lr']:g} sched={cfg['sched']}" + seed
    return (f"demo lr={cfg['lr']:g} beta={cfg['beta']:g} chunk={cfg['chunk']} top_k={cfg['top_k']} "
            f"sched={cfg['sched']}" + (f" vals={cfg['vals']}" if cfg["vals"] != "fp32" else "") + seed)


def schedule(cfg: dict, steps: int):
    if cfg["sched"] == "const":
        return cfg["lr"]
    if cfg["sched"] == "cos":
        return optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], max(1, steps // 20), steps, 0.0)
    raise SystemExit(f"error: unknown sched {cfg['sched']!r} (const or cos)")


def factory(cfg: dict, steps: int):
    lr = schedule(cfg, steps)
    if cfg["kind"] == "adam":
        return lambda: optax.chain(cj.compressed_mean(cj.identity(), crossdc.AXIS), optax.adam(lr))
    vals = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[cfg["vals"]]
    return lambda: cj.decoupled_momentum(lr, beta=cfg["beta"], chunk_size=cfg["chunk"], top_k=cfg["top_k"],
                                         axis_name=crossdc.AXIS, values_dtype=vals)


def crossdc_args(steps: int, seed: int) -> argparse.Namespace:
    """crossdc.py's defaults (the settings its results were made with), but for the seed."""
    return argparse.Namespace(steps=steps, sync_every=20, lr=3e-3, block_size=512, demo_lr=1e-3, demo_beta=0.999,
                              demo_chunk=64, demo_top_k=32, batch_size=8, seq_len=32, d_model=64, layers=2,
                              eval_every=25, corpus_chars=400_000, seed=seed)


def best_adams(runs: dict) -> dict:
    """seed -> the name of the best AdamW run with that seed (model init and data both follow it)."""
    best: dict = {}
    for name, r in runs.items():
        s = r["config"].get("seed", 0)
        if r["config"]["kind"] == "adam" and (s not in best or r["final_eval"] < runs[best[s]]["final_eval"]):
            best[s] = name
    return best


def table(runs: dict) -> str:
    best = {s: runs[n]["final_eval"] for s, n in best_adams(runs).items()}
    head = f"{'run':72s} {'held-out':>9s} {'vs best adam':>12s} {'B/step (HLO)':>13s} {'s':>5s}"
    lines = [head, "-" * len(head)]
    for name, r in sorted(runs.items(), key=lambda kv: kv[1]["final_eval"]):
        ref = best.get(r["config"].get("seed", 0))
        gap = f"{100 * (r['final_eval'] / ref - 1):+.2f}%" if ref else "-"
        lines.append(f"{name:72s} {r['final_eval']:9.4f} {gap:>12s} {r['bytes_per_step']:13,.0f} {r['seconds']:5.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="*", help="runs, e.g. demo:lr=2e-3,beta=0.99 adam:lr=1e-3")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0, help="model init and data of every run of this invocation")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "demo_tuning.json"))
    args = ap.parse_args(argv)
    cx = crossdc_args(args.steps, args.seed)
    runs = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        if old["steps"] != args.steps:
            raise SystemExit(f"error: {args.out} holds {old['steps']}-step runs")
        runs = old["runs"]
        for r in runs.values():  # runs recorded before the seed and vals settings existed
            r["config"].setdefault("seed", 0)
            if r["config"]["kind"] == "demo":
                r["config"].setdefault("vals", "fp32")
    mesh = _compat.make_mesh((crossdc.N,), (crossdc.AXIS,))
    corpus = _charlm.Corpus(cx.corpus_chars)
    graphdef, params = _charlm.make_model(d_model=cx.d_model, layers=cx.layers, heads=2, seq_len=cx.seq_len,
                                          seed=cx.seed)
    held_out = jnp.asarray(corpus.eval_batch(128, cx.seq_len))
    for spec in args.specs:
        cfg = dict(parse(spec), seed=args.seed)
        name = key(cfg)
        if name in runs:
            print(f"  {name}: already in {args.out}, skipped")
            continue
        r = crossdc.train(name, factory(cfg, args.steps), mesh, graphdef, params, corpus, held_out, cx)
        runs[name] = {"config": cfg, "final_eval": r["final_eval"], "bytes_per_step": r["bytes"]["per_inner_step"],
                      "eval": r["eval"], "train_loss_last50": r["train_loss_last50"], "seconds": r["seconds"],
                      "replicas_identical_at_end": r["replicas_identical_at_end"]}
        print(f"  {name}: held-out {r['final_eval']:.4f}, {r['bytes']['per_inner_step']:,.0f} B/step, "
              f"{r['seconds']:.0f} s", flush=True)
        write_results(args.out, _payload(runs, args))
    print(table(runs))
    write_results(args.out, _payload(runs, args))
    return 0


def _payload(runs: dict, args) -> dict:
    best = best_adams(runs)
    for r in runs.values():
        ref = best.get(r["config"].get("seed", 0))
        r["ratio_to_best_adam"] = round(r["final_eval"] / runs[ref]["final_eval"], 4) if ref else None
    demos = {n: r["final_eval"] for n, r in runs.items()
             if r["config"]["kind"] == "demo" and not r["config"].get("seed", 0)}
    best_demo = min(demos, key=demos.get) if demos else None
    # The bytes of DeMo's defaults (64 x 64 tiles, 48 bf16 coefficients each: those of 32 fp32 ones).
    budget = cj.communication_plan(cj.decoupled_momentum(1e-3), _charlm.make_model(
        d_model=64, layers=2, heads=2, seq_len=32, seed=0)[1], crossdc.N).bytes_per_step
    cheap = {n: v for n, v in demos.items() if runs[n]["bytes_per_step"] <= budget}
    best_cheap = min(cheap, key=cheap.get) if cheap else None
    return {"steps": args.steps, "workers": crossdc.N,
            "setup": "benchmarks/crossdc.py defaults (char LM, 107k params); seed 0 unless the run's key says",
            "best_adam_per_seed": {str(s): n for s, n in best.items()}, "best_demo_seed0": best_demo,
            "default_bytes_per_step": budget, "best_demo_seed0_within_default_bytes": best_cheap,
            "target_5pct_met_seed0": bool(0 in best and best_demo and runs[best_demo]["ratio_to_best_adam"] <= 1.05),
            "target_5pct_met_seed0_within_default_bytes": bool(
                0 in best and best_cheap and runs[best_cheap]["ratio_to_best_adam"] <= 1.05),
            "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
