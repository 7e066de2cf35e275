"""Bytes on the wire per step and device, from the compiled HLO, for every compressor.

A 4.2M-parameter MLP (4 x 1024x1024 + biases) on N simulated replicas. For each
compressor and reducer: the analytic count (``cj.communication_plan``), the count read
from the compiled HLO (``cj.collective_bytes``), and the ratio against the exact fp32
mean measured the same way in the same run.

    python benchmarks/wire.py [--replicas 2,4,8] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os

from _devices import simulate_cpu_devices  # noqa: E402
from _results import write_results  # noqa: E402

simulate_cpu_devices(8)


import commjax as cj  # noqa: E402
from commjax.testing import mlp_4m_params, update_collectives  # noqa: E402


def compressors():
    out = [
        ("identity", cj.identity()), ("cast bf16", cj.cast()), ("quantize 8", cj.quantize(8)),
        ("quantize 4", cj.quantize(4)), ("quantize 2", cj.quantize(2)), ("qsgd 16", cj.qsgd()),
        ("terngrad", cj.terngrad()), ("sign", cj.sign()),
    ]
    if hasattr(cj, "top_k"):
        out.append(("top_k 1%", cj.top_k(0.01)))
    if hasattr(cj, "random_k"):
        out.append(("random_k 1%", cj.random_k(0.01)))
    if hasattr(cj, "powersgd"):
        out += [("powersgd r4", cj.powersgd(4)), ("powersgd r1", cj.powersgd(1))]
    return out


def _bits_per_element(comp):
    """Payload bits per element, or None for a codec whose payload is not a word count
    (random-k's summed values, PowerSGD's factors: their bytes are in the plan)."""
    try:
        return comp.bits_per_element()
    except NotImplementedError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", default="2,8")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    params = mlp_4m_params()
    rows = []
    print(f"{'compressor':14s} {'N':>2s} {'reducer':>10s} {'analytic B':>12s} {'HLO B':>12s} "
          f"{'ratio':>7s} {'wire dtypes':>12s}")
    for n in [int(x) for x in args.replicas.split(",")]:
        exact = update_collectives(cj.compressed_mean(cj.identity(), "data"), params, n).total_ring_bytes
        for name, comp in compressors():
            reducers = ["auto"] if comp.has_exchange else ["auto"] + [
                r for r in ("allreduce", "allgather", "two_phase")
                if r in cj.collectives.valid_reducers(comp)]
            for reducer in reducers:
                tx = cj.compressed_mean(comp, "data", reducer=reducer)
                plan = cj.communication_plan(comp, params, n, reducer=reducer)
                rep = update_collectives(tx, params, n)
                row = {"compressor": name, "replicas": n, "reducer": plan.routing.reducer if reducer == "auto" else reducer,
                       "auto": reducer == "auto", "analytic_bytes": plan.bytes_per_step,
                       "hlo_bytes": rep.total_ring_bytes, "exact_hlo_bytes": exact,
                       "ratio": exact / rep.total_ring_bytes, "dtypes": sorted(rep.dtypes),
                       "bits_per_element": _bits_per_element(comp)}
                rows.append(row)
                tag = f"{row['reducer']}{'*' if reducer == 'auto' else ''}"
                print(f"{name:14s} {n:2d} {tag:>10s} {plan.bytes_per_step:12,.0f} "
                      f"{rep.total_ring_bytes:12,.0f} {row['ratio']:6.2f}x {','.join(row['dtypes']):>12s}",
                      flush=True)
    print("* = picked by reducer='auto'")
    os.makedirs(args.out, exist_ok=True)
    write_results(os.path.join(args.out, "wire.json"),
                  {"meta": {"model": "4 x 1024x1024 + biases (4.2M params)"}, "rows": rows})


if __name__ == "__main__":
    main()
