"""The char Transformer on a 3-D mesh of 8 devices, ``data x stage x model`` = 2 x 2 x 2:
GPipe over microbatches with compressed stage sends, tensor-parallel attention and MLP
with compressed all-reduces, compressed data-parallel gradients.

    python examples/06_pipeline_lm.py                              # every axis compressed
    python examples/06_pipeline_lm.py --fwd int2m --delta sample   # AQ-SGD activations
    python examples/06_pipeline_lm.py --bwd powersgd4 --lazy       # Optimus-CC backward
    python examples/06_pipeline_lm.py --fwd none --bwd none --tp none --dp none   # exact

On every step each of the 2 data replicas takes its 4 microbatches of 4 windows through
the 2 stages (``cc.ppermute`` over ``"stage"``: ``--fwd`` forward, ``--bwd`` for the
gradients coming back); inside a stage, each of the 2 model devices holds half of the
heads and of the MLP (``cc.tp_copy`` / ``cc.tp_reduce`` over ``"model"`` with ``--tp``);
``cj.compressed_mean(--dp)`` then averages each device's gradient shard over
``"data"``. Codec names: none (exact ``jax.lax``), identity, bf16, fp8, int8, int4,
int2, int4s/int2s (stochastic rounding), int2m (2 bits on the midrise grid clipped at 1.49
RMS: for deltas), int2ms (midrise, stochastic), h4/h2 (Hadamard + int4/int2),
powersgd2/4/8 (``--bwd``: low rank per send), sign, top_k.

The training set is a fixed set of ``--windows`` windows of the standard library's
source (sample ids for ``--delta sample``), visited in epochs; the held-out loss is
measured on the last 5% of the text. Every run also trains the exact run first (all
``none``) and reports the gap to it. Prints a table (held-out loss, bytes per device and
step on each axis from the compiled HLO, ratios to the exact run) and writes
``pipeline_lm.json`` and ``pipeline_lm.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cli  # noqa: E402  (no JAX import: --devices must be applied first)

CODECS = ("none", "identity", "bf16", "fp8", "int8", "int4", "int2", "int4s", "int2s", "int2m", "int2ms",
          "h4", "h2", "powersgd2", "powersgd4", "powersgd8", "sign", "top_k")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_run_args(p, steps=200, batch_size=4, lr=3e-3)
    g = p.add_argument_group("codecs, one per axis")
    g.add_argument("--fwd", choices=CODECS, default="h4", help="stage sends, forward (default h4)")
    g.add_argument("--bwd", choices=CODECS, default="int8", help="stage sends, backward (default int8)")
    g.add_argument("--tp", choices=CODECS, default="int8", help="tensor-parallel all-reduces (default int8)")
    g.add_argument("--dp", choices=CODECS, default="int4", help="data-parallel gradient mean (default int4)")
    g.add_argument("--delta", choices=("none", "sample", "slot"), default="none",
                   help="forward sends as deltas: sample (AQ-SGD, a reference per training "
                        "window) or slot (one per send, no per-sample storage) (default none)")
    g.add_argument("--delta-rate", type=float, default=1.0,
                   help="slot mode: the reference moves this fraction of the way to each "
                        "received value (a running mean over microbatches; default 1)")
    g.add_argument("--lazy", action="store_true",
                   help="lazy error propagation of the backward sends (Optimus-CC)")
    g.add_argument("--epilogue", action="store_true",
                   help="compress only the backward sends of the pipeline's fill (the last "
                        "ones the backward pass makes); the others exact")
    m = p.add_argument_group("model and schedule")
    m.add_argument("--microbatches", type=_cli.positive_int, default=4, help="per step (default 4)")
    m.add_argument("--d-model", type=_cli.positive_int, default=64, help="width (default 64)")
    m.add_argument("--heads", type=_cli.positive_int, default=4, help="attention heads (default 4)")
    m.add_argument("--layers-per-stage", type=_cli.positive_int, default=1, help="(default 1)")
    m.add_argument("--seq-len", type=_cli.positive_int, default=32, help="context length (default 32)")
    m.add_argument("--windows", type=_cli.positive_int, default=1024,
                   help="training windows, visited in epochs (default 1024)")
    m.add_argument("--corpus-chars", type=_cli.positive_int, default=1_000_000,
                   help="characters of standard-library source to use (default 1,000,000)")
    args = _cli.parse(p, ["--devices", "8"] + list(sys.argv[1:] if argv is None else argv))
    if args.devices != 8:
        p.error("--devices: this example runs on 8 devices (2 x 2 x 2)")
    if args.d_model % args.heads or args.heads % 2:
        p.error("--heads must be even (split over 2 model devices) and divide --d-model")
    if args.fwd.startswith("powersgd") or args.tp.startswith("powersgd") or args.dp.startswith("powersgd"):
        p.error("powersgd is for --bwd (a low-rank send of the activation gradients)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    import numpy as np

    import _charlm
    import _pipeline_lm as pl
    import _train

    corpus = _charlm.Corpus(args.corpus_chars)
    cfg = pl.Config(vocab=_charlm.VOCAB, d_model=args.d_model, heads=args.heads,
                    layers_per_stage=args.layers_per_stage, seq_len=args.seq_len,
                    microbatches=args.microbatches, mb=args.batch_size, lr=args.lr)
    mesh = pl.make_mesh(cfg)
    per_step = cfg.data * cfg.microbatches * cfg.mb
    if args.windows < per_step:
        raise SystemExit(f"error: --windows must be at least {per_step} (one step's windows)")
    # AQ-SGD's references stay on the devices a sample passes: each data replica its shard.
    windows = pl.Windows(corpus, args.windows, cfg.seq_len, per_step, args.seed,
                         replicas=cfg.data if args.delta == "sample" else 1)
    held = corpus.eval_batch(64, cfg.seq_len)
    delta = None if args.delta == "none" else args.delta
    runs = [("exact", pl.Codecs())]
    mine = pl.Codecs(pl.codec(args.fwd), pl.codec(args.bwd), pl.codec(args.tp), pl.codec(args.dp),
                     delta, args.lazy, args.epilogue, args.delta_rate)
    label = (f"fwd={args.fwd}{'/' + args.delta if delta else ''} bwd={args.bwd}"
             f"{'/lazy' if args.lazy else ''}{'/epilogue' if args.epilogue else ''} tp={args.tp} dp={args.dp}")
    if mine != runs[0][1]:
        runs.append((label, mine))
    results = [train(pl, cfg, codecs, mesh, windows, held, args, name) for name, codecs in runs]
    print()
    print(summary(_train, results))
    png = plot(_train, results, os.path.join(args.out, "pipeline_lm.png"))
    js = _train.write_json(os.path.join(args.out, "pipeline_lm.json"),
                           {"example": "06_pipeline_lm", "args": vars(args), "runs": results})
    print(f"\nwrote {png} and {js}")
    return 0 if all(r["replicas_in_sync"] and np.isfinite(r["held_out"]) for r in results) else 1


def train(pl, cfg, codecs, mesh, windows, held, args, name: str) -> dict:
    """One run; its record (losses, held-out loss, bytes per axis)."""
    import _train

    trainer = pl.Trainer(cfg, codecs, mesh, num_samples=windows.count)
    state = trainer.init(args.seed)
    bar = _train.Progress(args.steps, desc=name, enabled=not args.no_progress)
    losses = []
    for t in range(args.steps):
        state, loss = trainer.step(state, *windows.batch(t))
        losses.append(loss)
        if t == 0:
            per_step = sum(trainer.axis_bytes().values())
        bar.update(loss, (t + 1) * per_step)
    bar.close()
    return {"label": name, "losses": losses, "held_out": trainer.held_out(state, held),
            "axis_bytes": trainer.axis_bytes(), "replicas_in_sync": trainer.replicas_identical(state),
            "epochs": args.steps * windows.per_step / windows.count}


def summary(_train, results: list) -> str:
    base = results[0]
    rows = []
    for r in results:
        row = {"run": r["label"], "held": f"{r['held_out']:.4f}",
               "gap": f"{100 * (r['held_out'] - base['held_out']) / base['held_out']:+.2f}%"}
        for axis in ("stage", "model", "data"):
            b, b0 = r["axis_bytes"].get(axis, 0.0), base["axis_bytes"].get(axis, 0.0)
            row[axis] = f"{_train.human_bytes(b)} ({b0 / b:.1f}x)" if b else "0"
        rows.append(row)
    cols = [("run", "run"), ("held", "held-out loss"), ("gap", "gap to exact"),
            ("stage", "stage axis*"), ("model", "model axis*"), ("data", "data axis*")]
    return _train.table(rows, cols) + ("\n* bytes per device and step from the compiled HLO "
                                       "(fewer than the exact run: x)")


def plot(_train, results: list, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.3), dpi=110)
    for i, r in enumerate(results):
        ys = np.asarray(r["losses"])
        k = max(1, len(ys) // 25)
        a1.plot(np.arange(k, len(ys) + 1), np.convolve(ys, np.ones(k) / k, "valid"),
                color=f"C{i}", label=f"{r['label']} (held-out {r['held_out']:.3f})")
    a1.set(xlabel="step", ylabel="training loss (last stage)", title="loss against steps")
    axes_ = ("stage", "model", "data")
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        a2.bar(np.arange(3) + i * width, [r["axis_bytes"].get(a, 0.0) / 1e3 for a in axes_],
               width, color=f"C{i}", label=r["label"])
    a2.set(xticks=np.arange(3) + 0.4 - width / 2, xticklabels=axes_, ylabel="KB per device and step (HLO)",
           title="bytes per mesh axis", yscale="log")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    return _train.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
