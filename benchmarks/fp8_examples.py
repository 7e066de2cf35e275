"""FP8 against 8-bit integers at equal bytes on the README's examples.

Runs an example script (``examples/01_digits_cnn.py`` or ``examples/02_char_transformer.py``,
8 simulated devices, its default steps, model and data, Adam after the compressed mean)
once per gradient codec: the exact fp32 mean, ``cj.quantize(bits=8)`` with nearest and with
stochastic rounding, ``cj.fp8("e4m3")`` and ``cj.fp8("e5m2")`` with nearest rounding. The
8-bit and FP8 codecs send the same bytes (8.125 bits per element at the default block of
256: a code per element and an fp32 scale per block). Per run: the final training loss
(mean over the last 10% of the steps, as the example reports it), the example's
evaluation (test accuracy; held-out loss), the relative gaps of both to the 8-bit nearest
run, whether every loss and mean stayed finite (``nonfinite`` steps) and the bytes per step
(the plan, equal to the compiled HLO's, which the example also reads).

    python benchmarks/fp8_examples.py --example digits_cnn
    python benchmarks/fp8_examples.py --example char_transformer

Writes ``benchmarks/results/fp8_examples_<example>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from _results import ROOT, write_results

EXAMPLES = {  # name: (script, the JSON it writes, what its evaluation is)
    "digits_cnn": ("examples/01_digits_cnn.py", "digits_cnn.json", "test accuracy"),
    "char_transformer": ("examples/02_char_transformer.py", "char_transformer.json", "held-out loss"),
}
METHODS = {  # name: the example's options
    "exact": ["--compressor", "identity"],
    "int8 nearest": ["--compressor", "quantize", "--bits", "8", "--rounding", "nearest"],
    "int8 stochastic": ["--compressor", "quantize", "--bits", "8", "--rounding", "stochastic"],
    "fp8 e4m3": ["--compressor", "fp8", "--fp8-format", "e4m3", "--rounding", "nearest"],
    "fp8 e5m2": ["--compressor", "fp8", "--fp8-format", "e5m2", "--rounding", "nearest"],
}
REFERENCE = "int8 nearest"


def run_example(script: str, out_name: str, options: list) -> dict:
    """One run of the example in a fresh process: its JSON record of the run."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(ROOT, script), "--devices", "8", "--no-progress", "--out", out, *options]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"error: {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        with open(os.path.join(out, out_name)) as f:
            return json.load(f)["runs"][0]


def _gap(value, ref):
    return None if value is None or not ref else round(value / ref - 1, 5)


def rows_of(records: dict) -> list:
    ref = records[REFERENCE]
    rows = []
    for name, r in records.items():
        finite = all(math.isfinite(x) for x in r["losses"]) and not r["metrics"].get("nonfinite")
        rows.append({"method": name, "final_loss": round(r["final_loss"], 5),
                     "final_eval": None if r["final_eval"] is None else round(r["final_eval"], 5),
                     "loss_gap_vs_int8": _gap(r["final_loss"], ref["final_loss"]),
                     "eval_gap_vs_int8": _gap(r["final_eval"], ref["final_eval"]),
                     "finite": finite, "bytes_per_step": r["bytes_per_step"],
                     "hlo_bytes_per_step": r["hlo_bytes_per_step"], "replicas_in_sync": r["replicas_in_sync"],
                     "label": r["label"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--example", choices=sorted(EXAMPLES), required=True)
    args = ap.parse_args(argv)
    script, out_name, eval_name = EXAMPLES[args.example]
    records = {}
    for name, options in METHODS.items():
        records[name] = run_example(script, out_name, options)
        r = records[name]
        print(f"  {name:16s} loss {r['final_loss']:.4f}  {eval_name} {r['final_eval']:.4f}  "
              f"{r['bytes_per_step']:,.0f} B/step", flush=True)
    rows = rows_of(records)
    fp8 = [r for r in rows if r["method"].startswith("fp8")]
    int8 = [r["final_loss"] for r in rows if r["method"].startswith("int8")]
    target = {"finite": all(r["finite"] for r in fp8),
              "equal_bytes": len({r["bytes_per_step"] for r in rows if r["method"] != "exact"}) == 1,
              "loss_within_1pct_of_int8": all(abs(r["loss_gap_vs_int8"]) <= 0.01 for r in fp8),
              # Where the two 8-bit roundings themselves differ by more than 1% (a loss near 0),
              # whether FP8 lies between them (1% either side).
              "int8_spread": round(max(int8) / min(int8) - 1, 5),
              "loss_within_int8_spread": all(0.99 * min(int8) <= r["final_loss"] <= 1.01 * max(int8) for r in fp8),
              "eval_within_1pct_of_int8": all(abs(r["eval_gap_vs_int8"]) <= 0.01 for r in fp8)}
    print(json.dumps(target))
    write_results(os.path.join(ROOT, "benchmarks", "results", f"fp8_examples_{args.example}.json"),
                  {"example": script, "evaluation": eval_name, "replicas": 8, "reference": REFERENCE,
                   "gap": "value / the int8 nearest run's value - 1", "target": target, "rows": rows},
                  command=f"python benchmarks/fp8_examples.py --example {args.example}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
