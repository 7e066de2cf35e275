"""Convergence at equal steps on a non-i.i.d. task: every method against the exact mean.

Each of 8 simulated replicas sees its own shifted input distribution (see
``commjax.testing.noniid_classification``). Every method trains the same MLP from the
same initialisation for the same number of full-batch steps; the table reports the
final global loss, its relative gap to the exact fp32 mean under the same optimizer, the
per-device bytes one step sends (analytic, ring convention) and the compression ratio,
and whether all replicas ended bit-identical.

    python benchmarks/convergence.py [--steps 300] [--out benchmarks/results]

Writes ``convergence.json`` and ``convergence.png`` (loss curves). The rows with a NaN every
20 steps (``--only "NaN every" --name convergence_nonfinite``) compare what
``compressed_mean(check_finite=...)`` does with the residuals on such a step.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from _devices import simulate_cpu_devices  # noqa: E402
from _results import write_results  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import commjax as cj  # noqa: E402
from commjax.testing import noniid_classification, train  # noqa: E402

MIN_SIZE = 256  # the task's matrices are small: compress every matrix


def _cm(comp, **kw):
    return cj.compressed_mean(comp, "data", min_compress_size=MIN_SIZE, **kw)


def _bad_steps(every: int, replica: int = 3) -> optax.GradientTransformation:
    """Makes one gradient element NaN on one replica every ``every`` steps (as a loss-scaled
    fp16 step overflows now and then), ahead of the exchange that flags it."""
    def init(params):
        del params
        return jnp.zeros((), jnp.int32)

    def update(grads, count, params=None):
        del params
        bad = (count % every == every - 1) & (lax.axis_index("data") == replica)
        poison = jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(0.0))
        grads = jax.tree_util.tree_map(lambda g: g.at[(0,) * g.ndim].add(poison.astype(g.dtype)), grads)
        return grads, count + 1

    return optax.GradientTransformation(init, update)


def _nonfinite_methods(mom):
    """The cost of a step skipped every 20 steps (``optax.apply_if_finite`` after the
    exchange), and of what the residuals become on it (``check_finite``)."""
    def run(codec, check_finite=True):
        return lambda: optax.chain(_bad_steps(20), _cm(codec, check_finite=check_finite),
                                   optax.apply_if_finite(mom(), 1000))
    base = "exact, NaN every 20 steps (momentum)"
    return [
        (base, "exact (momentum)", run(cj.identity())),
        ("8-bit, NaN every 20 steps, residuals kept (momentum)", base, run(cj.quantize(8))),
        ("8-bit, NaN every 20 steps, residuals reset (momentum)", base, run(cj.quantize(8), "reset")),
        ("sign+EF, NaN every 20 steps, residuals kept (momentum)", base, run(cj.sign())),
        ("sign+EF, NaN every 20 steps, residuals reset (momentum)", base, run(cj.sign(), "reset")),
    ]


def methods(lr_momentum=0.1, lr_sgd=0.3):
    """(name, baseline name, transformation factory). Baselines are exact-mean runs."""
    mom = lambda: optax.sgd(lr_momentum, momentum=0.9)  # noqa: E731
    sgd = lambda: optax.sgd(lr_sgd)  # noqa: E731
    out = [
        ("exact (momentum)", None, lambda: optax.chain(_cm(cj.identity()), mom())),
        ("bf16 (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.cast()), mom())),
        ("8-bit (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.quantize(8)), mom())),
        ("8-bit nearest (momentum)", "exact (momentum)",
         lambda: optax.chain(_cm(cj.quantize(8, stochastic=False)), mom())),
        ("fp8 e4m3 (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.fp8("e4m3")), mom())),
        ("fp8 e5m2 (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.fp8("e5m2")), mom())),
        ("fp8 e4m3 stochastic (momentum)", "exact (momentum)",
         lambda: optax.chain(_cm(cj.fp8("e4m3", stochastic=True)), mom())),
        ("fp8 e4m3 no EF (momentum)", "exact (momentum)",
         lambda: optax.chain(_cm(cj.fp8("e4m3"), error_feedback=False), mom())),
        ("lossless bf16 (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.lossless()), mom())),
        ("4-bit (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.quantize(4)), mom())),
        ("2-bit (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.quantize(2)), mom())),
        ("2-bit midrise (momentum)", "exact (momentum)",
         lambda: optax.chain(_cm(cj.quantize(2, midrise=True)), mom())),
        ("qsgd (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.qsgd()), mom())),
        ("terngrad (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.terngrad()), mom())),
        ("sign+EF (momentum)", "exact (momentum)", lambda: optax.chain(_cm(cj.sign()), mom())),
        ("exact (sgd)", None, lambda: optax.chain(_cm(cj.identity()), sgd())),
        ("sign+EF (sgd)", "exact (sgd)", lambda: optax.chain(_cm(cj.sign()), sgd())),
        ("sign no EF (sgd)", "exact (sgd)",
         lambda: optax.chain(_cm(cj.sign(), error_feedback=False), sgd())),
    ]
    if hasattr(cj, "top_k"):
        out += [
            ("top-k 1% +EF (momentum)", "exact (momentum)",
             lambda: optax.chain(_cm(cj.top_k(0.01)), mom())),
            ("top-k 1% no EF (momentum)", "exact (momentum)",
             lambda: optax.chain(_cm(cj.top_k(0.01), error_feedback=False), mom())),
        ]
    if hasattr(cj, "random_k"):
        out.append(("random-k 10% +EF (momentum)", "exact (momentum)",
                    lambda: optax.chain(_cm(cj.random_k(0.1)), mom())))
    if hasattr(cj, "dgc"):
        out.append(("DGC 1%", "exact (momentum)",
                    lambda: cj.dgc(lr_momentum, momentum=0.9, ratio=0.01, axis_name="data")))
    if hasattr(cj, "powersgd"):
        out += [
            ("powersgd r4 (momentum)", "exact (momentum)",
             lambda: optax.chain(_cm(cj.powersgd(4, min_compression_rate=1.0)), mom())),
            ("powersgd r1 (momentum)", "exact (momentum)",
             lambda: optax.chain(_cm(cj.powersgd(1, min_compression_rate=1.0)), mom())),
        ]
    if hasattr(cj, "onebit_adam"):
        out += [
            ("exact (adam)", None, lambda: optax.chain(_cm(cj.identity()), optax.adam(1e-2))),
            ("1-bit adam", "exact (adam)",
             lambda: cj.onebit_adam(1e-2, warmup_steps=50, axis_name="data")),
        ]
    out += _nonfinite_methods(mom)
    if hasattr(cj, "diloco"):
        out.append(("diloco H=10", "exact (momentum)",
                    lambda: cj.diloco(optax.sgd(lr_momentum, momentum=0.9),
                                      optax.sgd(0.7, momentum=0.9, nesterov=True),
                                      sync_every=10, axis_name="data")))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--only", default=None, help="comma-separated substrings of method names")
    ap.add_argument("--name", default="convergence",
                    help="results file stem (default convergence; a subset run: another name)")
    args = ap.parse_args(argv)
    task = noniid_classification(8)
    rows, curves = [], {}
    finals = {}
    from commjax.testing import update_collectives

    selected = methods()
    if args.only:
        keys = args.only.split(",")
        wanted = {n for n, _, _ in selected if any(k in n for k in keys)}
        wanted |= {b for n, b, _ in selected if n in wanted and b}
        selected = [m for m in selected if m[0] in wanted]
    for name, base, factory in selected:
        t0 = time.time()
        res = train(factory(), task, args.steps, log_every=max(1, args.steps // 60))
        dt = time.time() - t0
        finals[name] = res.final_loss
        curves[name] = res.losses.tolist()
        try:
            rep = update_collectives(factory(), task.params, 8)
            # Collectives in a conditional branch (cj.lossless's fallback) run only on the
            # steps where a payload overflows: the steady bytes per step leave them out.
            hlo_bytes = sum(c.ring_bytes for c in rep if not c.in_conditional)
            if not hlo_bytes:
                # Optimizers that switch phases under lax.cond (1-bit Adam's warm-up and
                # compressed steps, DiLoCo's sync every H steps) send everything from
                # inside a branch: their row is the sum over the branches, as before.
                hlo_bytes = sum(c.ring_bytes for c in rep)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            hlo_bytes = float("nan")
            print(f"  ({name}: HLO accounting failed: {e})", file=sys.stderr)
        n = sum(np.size(l) for l in jax.tree_util.tree_leaves(task.params))
        exact = cj.ring_bytes("all-reduce", 4 * n, 8)
        gap = None if base is None else (res.final_loss - finals[base]) / finals[base]
        rows.append({
            "method": name, "baseline": base, "final_loss": res.final_loss,
            "gap_to_exact": gap, "bytes_per_step_hlo": hlo_bytes,
            "compression_ratio": exact / hlo_bytes if hlo_bytes else float("inf"),
            "replicas_identical": res.replicas_identical, "seconds": round(dt, 1),
        })
        g = "" if gap is None else f"{100 * gap:+7.2f}%"
        print(f"{name:30s} loss {res.final_loss:.4f} {g:>9s}  {hlo_bytes:>10,.0f} B/step "
              f"({exact / hlo_bytes:6.1f}x)  identical={res.replicas_identical}  {dt:5.1f}s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"steps": args.steps, "task": "noniid_classification(8)", "devices": "8 simulated CPU devices"}
    write_results(os.path.join(args.out, f"{args.name}.json"), {"meta": meta, "rows": rows, "curves": curves},
                  command="python benchmarks/convergence.py " + shlex.join(argv if argv is not None else sys.argv[1:]))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 5.5))
        colors = plt.cm.tab20(np.linspace(0, 1, max(len(curves), 2)))
        for i, (name, c) in enumerate(curves.items()):
            x = np.linspace(0, args.steps, len(c))
            ax.plot(x, c, label=name, color=colors[i], lw=2.2 if name.startswith("exact") else 1.2,
                    ls="--" if name.startswith("exact") else ("-" if i % 2 else "-."))
        ax.set_xlabel("step"); ax.set_ylabel("global training loss"); ax.set_yscale("log")
        ax.set_title("Non-i.i.d. task, 8 replicas, equal steps")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"{args.name}.png"), dpi=110)
    except ImportError:
        print("matplotlib not installed: no PNG written", file=sys.stderr)


if __name__ == "__main__":
    main()
