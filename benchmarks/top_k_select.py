"""Exact top-k selection on one CPU core: the two-stage selection of
``commjax.compressors.sparse.two_stage_top_k`` against one ``lax.top_k`` over the whole
domain, for domain lengths ``m`` and kept fractions ``k / m``.

Both return the same positions (tests/test_sparse.py); this measures which is faster, and
so where ``exact_top_k`` switches from one to the other (``TWO_STAGE_MIN_WORK``, a bound on
``m * k``). Each time is the median of ``--repeats`` runs of the compiled selection on a
``float32[1, m]`` of |normal| values, the process pinned to one core.

    python benchmarks/top_k_select.py [--repeats 5]

Writes ``benchmarks/results/top_k_select.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from _results import write_results  # noqa: E402
from commjax.compressors.sparse import TWO_STAGE_MIN_WORK, two_stage_top_k, uses_two_stage  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "top_k_select.json"
CASES = [(1 << e, r) for e in (16, 18, 20, 22) for r in (0.001, 0.01, 0.1)] + [
    (1 << 21, 0.1), (1 << 22, 0.05), (1 << 23, 0.01), (1 << 23, 0.05)]


def median_ms(fn, x, repeats: int) -> float:
    fn = jax.jit(fn)
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'m':>9} {'k/m':>6} {'k':>7} {'two-stage ms':>13} {'lax.top_k ms':>13} {'ratio':>6}  chosen")
    for m, ratio in CASES:
        x = jnp.asarray(np.abs(rng.standard_normal((1, m))).astype(np.float32))
        k = max(1, int(round(ratio * m)))
        two = median_ms(lambda v: two_stage_top_k(v, k), x, args.repeats)
        one = median_ms(lambda v: lax.top_k(v, k)[1], x, args.repeats)
        chosen = "two-stage" if uses_two_stage(m, k) else "lax.top_k"
        rows.append({"m": m, "k": k, "ratio": ratio, "two_stage_ms": round(two, 2),
                     "lax_top_k_ms": round(one, 2), "lax_over_two_stage": round(one / two, 3),
                     "chosen": chosen})
        print(f"{m:9d} {ratio:6.3f} {k:7d} {two:13.2f} {one:13.2f} {one / two:6.2f}  {chosen}", flush=True)
    write_results(RESULTS, {"command": "python benchmarks/top_k_select.py " + " ".join(sys.argv[1:]),
                            "jax": jax.__version__, "two_stage_min_work": TWO_STAGE_MIN_WORK,
                            "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
