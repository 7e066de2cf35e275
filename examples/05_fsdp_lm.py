"""Sharded data parallel training of a character-level decoder-only LM (Flax NNX): FSDP
(ZeRO-3) with quantized weight all-gathers and gradient reduce-scatters, or ZeRO-2 with
4-bit weight differences.

    python examples/05_fsdp_lm.py                                # int8 weights, int4 grads vs exact
    python examples/05_fsdp_lm.py --weights qwd4 --grads two_level
    python examples/05_fsdp_lm.py --sweep --steps 300            # every combination

Every replica of 8 (simulated CPU devices) reads its own region of the Python standard
library's source (non-i.i.d. shards). ``--weights``:

* ``none`` / ``int8``: FSDP. Each replica stores ``1/8`` of every parameter (flat,
  zero-padded shards: ``cj.fsdp_shard``); the forward pass gathers each Transformer block's
  weights just before using it (``cj.fsdp_gather``: exact, or blockwise int8 as ZeRO++'s
  qwZ) inside ``jax.checkpoint`` (marked for re-gathering in the backward pass; XLA on
  CPU merges the two identical gathers and sends them once); the gather's VJP
  reduce-scatters the gradient (``--grads``), and ``optax.adam`` runs on the shards.
* ``qwd4``: ZeRO-2 (``cj.zero``): every replica holds the full parameters; the gradient is
  reduce-scattered (``--grads``), Adam updates an fp32 master shard, and the 4-bit
  quantized *difference* between the master shard and the parameters is all-gathered and
  added on every replica (SDP4Bit's qWD), so the parameters stay bit-identical.

``--grads two_level`` runs on a ``2 x 4`` mesh: 8-bit on the fast axis of 4, 4-bit (after
a 32-wide Hadamard rotation) on the slow axis of 2; the table shows the bytes of every
collective and, apart, those on the slow axis.

Prints a table (held-out loss, bytes per step and device from the compiled HLO, ratio to
the exact run) and writes ``fsdp_lm.png`` (loss against bytes sent) and ``fsdp_lm.json``
to ``--out``. Every run also trains the exact baseline (``none``/``none``) first.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cli  # noqa: E402  (no JAX import: --devices must be applied first)

WEIGHTS = ("none", "int8", "qwd4")
GRADS = ("none", "int8", "int4", "two_level")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_run_args(p, steps=150, batch_size=4, lr=3e-3)
    g = p.add_argument_group("sharded data parallel")
    g.add_argument("--weights", choices=WEIGHTS, default="int8",
                   help="weight all-gather: none (exact fp32, FSDP), int8 (FSDP, qwZ) or qwd4 "
                        "(ZeRO-2, 4-bit weight differences) (default int8)")
    g.add_argument("--grads", choices=GRADS, default="int4",
                   help="gradient reduce-scatter: none (exact fp32), int8, int4, or two_level "
                        "(8-bit fast / 4-bit slow axis, 2 x 4 mesh) (default int4)")
    g.add_argument("--sweep", action="store_true", help="train every --weights x --grads combination")
    g.add_argument("--block-size", type=_cli.positive_int, default=256,
                   help="elements per quantization scale (default 256)")
    m = p.add_argument_group("model")
    m.add_argument("--d-model", type=_cli.positive_int, default=64, help="width (default 64)")
    m.add_argument("--layers", type=_cli.positive_int, default=2, help="Transformer blocks (default 2)")
    m.add_argument("--heads", type=_cli.positive_int, default=4, help="attention heads (default 4)")
    m.add_argument("--seq-len", type=_cli.positive_int, default=64, help="context length (default 64)")
    m.add_argument("--corpus-chars", type=_cli.positive_int, default=1_000_000,
                   help="characters of standard-library source to use (default 1,000,000)")
    args = _cli.parse(p, ["--devices", "8"] + list(sys.argv[1:] if argv is None else argv))
    if args.devices != 8:
        p.error("--devices: this example shards over 8 replicas (2 x 4 for two_level)")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    import _charlm
    import _fsdp_lm as lm
    import _train

    corpus = _charlm.Corpus(args.corpus_chars)
    runs = [("none", "none")]
    combos = [(w, g) for w in WEIGHTS for g in GRADS] if args.sweep else [(args.weights, args.grads)]
    runs += [c for c in combos if c != ("none", "none")]
    model = lm.Model(args)
    print(f"{model.num_params:,} parameters; {len(corpus.train):,} training characters; "
          f"8 replicas x {args.batch_size} windows of {args.seq_len}")
    results = []
    for weights, grads in runs:
        results.append(lm.train(model, corpus, weights, grads, args,
                                progress=not args.no_progress))
    print()
    print(lm.summary(results))
    png = lm.plot(results, os.path.join(args.out, "fsdp_lm.png"))
    js = _train.write_json(os.path.join(args.out, "fsdp_lm.json"),
                           {"example": "05_fsdp_lm", "args": vars(args), "runs": results})
    print(f"\nwrote {png} and {js}")
    return 0 if all(r["replicas_in_sync"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
