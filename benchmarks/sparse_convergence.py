"""Sparsifiers and DGC against the exact mean on the non-i.i.d. task, at equal steps.

Every method trains the same 2-hidden-layer MLP on 8 replicas (8 forced CPU devices) with
the same learning rate and momentum for the same number of steps; the gap is
``(final_loss - exact_final_loss) / exact_final_loss``. Bytes per step are per device
(ring convention) from the communication plan, for the task's MLP and for a ~4M-parameter
model of four 1024x1024 matrices (tests/test_sparse.py and tests/test_dgc.py check that
these analytic counts equal the compiled HLO's).

    python benchmarks/sparse_convergence.py [--steps 100] [--out benchmarks/results/sparse_convergence.json]

Each row also gives the 4M model's compression ratio at 8, 16, 32 and 64 replicas: the
all-gather of top-k payloads grows with the replica count, the two-phase reducer's does
not.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

from _results import write_results  # noqa: E402

import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from commjax.compressors.exact import identity  # noqa: E402
from commjax.compressors.sparse import random_k, top_k  # noqa: E402
from commjax.optimizers.dgc import dgc  # noqa: E402
from commjax.plan import communication_plan  # noqa: E402
from commjax.testing import noniid_classification, train  # noqa: E402
from commjax.transform import compressed_mean  # noqa: E402

N = 8
LR, MOMENTUM, MIN_COMPRESS = 0.3, 0.5, 256  # the settings of the convergence tests
FOUR_M = {f"w{i}": jax.ShapeDtypeStruct((1024, 1024), jnp.float32) for i in range(4)}


def methods(steps: int) -> list[tuple[str, optax.GradientTransformation, callable]]:
    def chain(comp, ef=True, reducer="auto"):
        return optax.chain(
            compressed_mean(comp, "data", error_feedback=ef, min_compress_size=MIN_COMPRESS,
                            reducer=reducer),
            optax.sgd(LR, momentum=MOMENTUM),
        )

    def plan_of(comp, reducer="auto"):
        return lambda params, n=N: communication_plan(comp, params, n, min_compress_size=MIN_COMPRESS,
                                                      reducer=reducer)

    def dgc_plan(params, n=N):
        return communication_plan(dgc(LR, ratio=0.01, min_compress_size=MIN_COMPRESS), params, n)

    tk_small = top_k(0.01, chunk_size=4096, values_dtype=jnp.bfloat16)
    return [
        ("exact mean (fp32 all-reduce)", chain(identity()), plan_of(identity())),
        ("top_k 1% + error feedback", chain(top_k(0.01)), plan_of(top_k(0.01))),
        ("top_k 1% + EF, two-phase (select per destination, owner keeps 4%)",
         chain(top_k(0.01), reducer="two_phase"), plan_of(top_k(0.01), "two_phase")),
        ("top_k 1% without error feedback", chain(top_k(0.01), ef=False), plan_of(top_k(0.01))),
        ("top_k 1% + EF, bf16 values, uint16 offsets (chunk 4096)", chain(tk_small), plan_of(tk_small)),
        ("random_k 1% + error feedback", chain(random_k(0.01)), plan_of(random_k(0.01))),
        ("random_k 1% rescaled, no error feedback", chain(random_k(0.01, rescale=True), ef=False),
         plan_of(random_k(0.01))),
        ("dgc 1%", dgc(LR, momentum=MOMENTUM, ratio=0.01, min_compress_size=MIN_COMPRESS), dgc_plan),
        ("dgc 1% nesterov", dgc(LR, momentum=MOMENTUM, ratio=0.01, nesterov=True,
                                min_compress_size=MIN_COMPRESS), dgc_plan),
        ("dgc 1% with density warm-up (first 20% of steps)",
         dgc(LR, momentum=MOMENTUM, ratio=0.01, warmup_steps=max(1, steps // 5),
             min_compress_size=MIN_COMPRESS), dgc_plan),
    ]


def _bit_identical(tree) -> bool:
    """Replicas hold the same bits (NaNs included, unlike ``==``)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.asarray(leaf)
        bits = a.view(np.uint32) if a.dtype == np.float32 else a
        if not np.all(bits == bits[:1]):
            return False
    return True


def _num(x: float):
    return round(float(x), 5) if math.isfinite(x) else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sparse_convergence.json"))
    args = ap.parse_args(argv)

    task = noniid_classification(N)
    rows = []
    exact_loss = None
    for name, tx, plan_fn in methods(args.steps):
        t0 = time.time()
        res = train(tx, task, args.steps, log_every=max(1, args.steps // 10))
        plan, plan_4m = plan_fn(task.params), plan_fn(FOUR_M)
        if exact_loss is None:
            exact_loss = res.final_loss
        row = {
            "method": name,
            "final_loss": _num(res.final_loss),
            "gap": _num((res.final_loss - exact_loss) / exact_loss),
            "diverged": not math.isfinite(res.final_loss),
            "bytes_per_step": plan.bytes_per_step,
            "compression_ratio": round(plan.compression_ratio, 3),
            "bytes_per_step_4M_model": plan_4m.bytes_per_step,
            "compression_ratio_4M_model": round(plan_4m.compression_ratio, 3),
            "compression_ratio_4M_model_by_replicas": {
                n: round(plan_fn(FOUR_M, n).compression_ratio, 3) for n in (8, 16, 32, 64)},
            "replicas_identical": _bit_identical(res.replica_params),
            "loss_curve": [_num(x) for x in res.losses],
        }
        rows.append(row)
        print(f"{name:70s} loss {res.final_loss:.4f}  gap {(res.final_loss - exact_loss) / exact_loss:+.3f}  "
              f"{row['bytes_per_step']:>9,.0f} B/step ({row['compression_ratio']:.1f}x; "
              f"4M model {row['compression_ratio_4M_model']:.1f}x)  "
              f"identical={row['replicas_identical']}  [{time.time() - t0:.0f}s]", flush=True)

    out = {
        "task": "commjax.testing.noniid_classification(8): MLP 32-32-32-10, 512 examples per replica, "
                "full batch, shifted inputs per replica, 20% label noise",
        "replicas": N,
        "steps": args.steps,
        "optimizer": f"sgd(lr={LR}, momentum={MOMENTUM}) after compressed_mean; dgc(lr={LR}, momentum={MOMENTUM})",
        "min_compress_size": MIN_COMPRESS,
        "initial_loss": round(task.global_loss(task.params), 5),
        "bytes": "per device and step, ring convention (all-reduce 2(N-1)/N*S, all-gather (N-1)*S, "
                 "all-to-all (N-1)/N*S)",
        "jax": jax.__version__,
        "results": rows,
    }
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
