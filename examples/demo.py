"""commjax demo: the same character-level Transformer trained on 8 simulated CPU devices
with the exact gradient mean and with several compressed exchanges, side by side.

    python examples/demo.py                 # what `make demo` runs (about 2 minutes)
    python examples/demo.py --steps 60      # a quicker look

Every run starts from the same parameters and sees the same batches; only the gradient
exchange differs. The table compares the final loss, the gap to the exact mean, the
bytes each device sends per step (the analytic count, checked against the compiled HLO)
and the compression ratio. Writes ``demo.png`` (loss curves) and ``demo.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cli  # noqa: E402  (no JAX import: the device count must be set first)

T_START = time.time()

# (label, compressor, options) of each run. The 1-bit sign run stands in for PowerSGD
# when this commjax has no cj.powersgd (or when asked for with --only sign).
RUNS = (
    ("exact fp32 mean", "identity", {}),
    ("bf16 cast", "cast", {"dtype": "bfloat16"}),
    ("8-bit quantize", "quantize", {"bits": 8, "rounding": "nearest"}),
    ("4-bit quantize", "quantize", {"bits": 4, "rounding": "nearest", "block_size": 128}),
    ("PowerSGD rank 4", "powersgd", {"rank": 4}),
    ("1-bit sign", "sign", {}),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=_cli.positive_int, default=200, help="steps per run (default 200)")
    p.add_argument("--devices", type=_cli.positive_int, default=8,
                   help="simulated CPU devices, one replica each (default 8)")
    p.add_argument("--batch-size", type=_cli.positive_int, default=4,
                   help="windows per replica per step (default 4)")
    p.add_argument("--seq-len", type=_cli.positive_int, default=48, help="context length (default 48)")
    p.add_argument("--d-model", type=_cli.positive_int, default=64, help="model width (default 64)")
    p.add_argument("--layers", type=_cli.positive_int, default=2, help="Transformer blocks (default 2)")
    p.add_argument("--lr", type=_cli.positive_float, default=3e-3,
                   help="peak Adam learning rate (warm-up, then cosine decay; default 3e-3)")
    p.add_argument("--seed", type=_cli.nonneg_int, default=0, help="seed (default 0)")
    p.add_argument("--only", nargs="+", default=None, metavar="COMPRESSOR",
                   choices=sorted({c for _, c, _ in RUNS}),
                   help="run only these compressors (the exact mean always runs)")
    p.add_argument("--out", default=".", help="directory for demo.png and demo.json (default .)")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of progress bars")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    _cli.use_cpu_devices(args.devices)
    return args


def plot(results, path: str, n: int) -> str:
    """Two panels: training loss per step, and held-out loss against the megabytes each
    device has sent (log scale): the same curve, reached for fewer bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for i, r in enumerate(results):
        k = max(1, len(r.losses) // 40)
        smooth = np.convolve(r.losses, np.ones(k) / k, mode="valid")
        a.plot(r.steps[k - 1:], smooth, color=f"C{i}", lw=1.3, label=r.label)
        mb = np.asarray(r.eval_steps) * r.bytes_per_step / 1e6
        b.plot(mb, r.eval_values, color=f"C{i}", marker="o", ms=4, lw=1.3, label=r.label)
    a.set(xlabel="step", ylabel="training loss", title=f"char Transformer, {n} replicas")
    b.set(xlabel="MB sent per device (log scale)", ylabel="held-out loss",
          title="loss against communication", xscale="log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    import _train  # imported after the device count is set (see main)

    return _train.save_figure(fig, path)


def main(argv=None) -> int:
    args = parse_args(argv)

    import concurrent.futures

    import jax
    import jax.numpy as jnp
    import optax

    import _charlm
    import _train
    import commjax as cj

    corpus = _charlm.Corpus(1_000_000)
    mesh = _train.data_mesh(args.devices)
    n = int(mesh.shape[_train.AXIS])
    graphdef, params = _charlm.make_model(d_model=args.d_model, layers=args.layers, heads=4,
                                          seq_len=args.seq_len, seed=args.seed)
    print(f"commjax {cj.__version__} demo: char Transformer ({_charlm.num_params(params):,} "
          f"parameters) on {n} replicas x {args.batch_size} windows of {args.seq_len} characters "
          f"of Python's standard library; Adam (peak lr {args.lr}, cosine decay), {args.steps} steps "
          "per run.")

    # Linear warm-up, then cosine decay to a tenth: the final parameters settle, so the
    # gap between runs measures the exchange rather than where the last steps happened
    # to land.
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=min(20, args.steps // 5 + 1), decay_steps=args.steps,
        end_value=args.lr / 10)
    runs = []
    have_powersgd = _train.find("powersgd") is not None
    for label, comp, opts in RUNS:
        if args.only and comp != "identity" and comp not in args.only:
            continue
        if comp == "powersgd" and not have_powersgd:
            print(f"  ({label}: cj.powersgd is not in this commjax version; 1-bit sign instead)")
            continue
        if comp == "sign" and have_powersgd and not (args.only and "sign" in args.only):
            continue
        ns = argparse.Namespace(compressor=comp, bits=opts.get("bits", 4),
                                block_size=opts.get("block_size", 256),
                                levels=16, dtype=opts.get("dtype", "bfloat16"),
                                rank=opts.get("rank", 4), ratio=0.01, reducer="auto",
                                no_error_feedback=False, optimizer="adam", lr=args.lr,
                                sync_every=8, rounding=opts.get("rounding", "stochastic"))
        setup = _train.make_setup(ns, params, n, lr=schedule)
        setup.label = label
        runs.append(setup)

    def loss_fn(p, batch):
        return _charlm.loss_fn(graphdef, p, batch)

    held_out = jnp.asarray(corpus.eval_batch(256, args.seq_len))
    eval_loss = jax.jit(lambda p: _charlm.loss_fn(graphdef, p, held_out))

    def batch_fn(step: int):
        return corpus.batch(args.seed, step, n * args.batch_size, args.seq_len)

    trainers = [_train.DataParallel(loss_fn, params, s.tx, mesh) for s in runs]
    # Compile every run's step up front, two at a time (XLA compiles without the GIL).
    t0 = time.time()
    first = batch_fn(0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda tr: tr.compile(first), trainers))
    print(f"compiled {len(trainers)} train steps in {time.time() - t0:.1f}s")

    results = []
    for setup, trainer in zip(runs, trainers):
        results.append(_train.run(trainer, setup, batch_fn, args.steps, eval_fn=eval_loss,
                                  eval_every=max(1, args.steps // 4),
                                  progress=not args.no_progress, desc=f"{setup.label:>16}"))

    exact = results[0]
    ref = exact.eval_values[-1]
    rows = []
    for r in results:
        final = r.eval_values[-1]
        rows.append({
            "run": r.label,
            "loss": f"{final:.4f}",
            "gap": f"{100 * (final - ref) / ref:+.2f}%",
            "bytes": _train.human_bytes(r.bytes_per_step),
            "hlo": _train.human_bytes(r.hlo_bytes_per_step),
            "ratio": f"{r.compression_ratio:.2f}x",
            "sync": "yes" if r.in_sync else "NO",
        })
    print()
    print(_train.table(rows, [("run", "gradient exchange"), ("loss", "held-out loss"),
                              ("gap", "gap to exact"), ("bytes", "bytes/step/device"),
                              ("hlo", "measured (HLO)"), ("ratio", "compression"),
                              ("sync", "replicas in sync")]))
    wins = [r for r in results[1:]
            if (r.eval_values[-1] - ref) / ref <= 0.02 and r.compression_ratio >= 7]
    if wins:
        best = max(wins, key=lambda r: r.compression_ratio)
        print(f"\n{best.label}: within {100 * (best.eval_values[-1] - ref) / ref:+.2f}% of the "
              f"exact mean's loss while sending {best.compression_ratio:.1f}x fewer bytes.")

    png = plot(results, os.path.join(args.out, "demo.png"), n)
    js = _train.write_json(os.path.join(args.out, "demo.json"), {
        "demo": "char Transformer, compressed vs exact gradient mean",
        "replicas": n, "steps": args.steps, "params": _charlm.num_params(params),
        "jax": jax.__version__, "commjax": cj.__version__,
        "seconds_total": time.time() - T_START,
        "runs": [dict(r.record(), gap_to_exact=(r.eval_values[-1] - ref) / ref) for r in results],
    })
    print(f"wrote {png} and {js} ({time.time() - T_START:.0f}s in all)")
    return 0 if all(r.in_sync is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
