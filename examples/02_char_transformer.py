"""A character-level Transformer language model (Flax NNX), data-parallel, trained on the
Python standard library's own source code with a compressed gradient exchange.

    python examples/02_char_transformer.py --devices 8 --compressor quantize --bits 4
    python examples/02_char_transformer.py --devices 8 --compressor powersgd --rank 4
    python examples/02_char_transformer.py --devices 8 --optimizer onebit_adam
    python examples/02_char_transformer.py --devices 8 --optimizer streaming_diloco \\
        --sync-every 20 --fragments 4 --overlap 1 --mix 0.5 --compressor quantize --bits 4
    python examples/02_char_transformer.py --devices 8 --optimizer decoupled_momentum --lr 1e-3
    python examples/02_char_transformer.py --devices 4 --steps 200 \\
        --checkpoint-dir /tmp/charlm --checkpoint-every 50      # then add --resume

The text is read from ``os.path.dirname(os.__file__)`` (nothing is downloaded); the
last 5% is held out for evaluation. Every replica trains on its own random windows;
``cj.compressed_mean`` exchanges the gradients (``--compressor`` and its options), and
``--optimizer`` follows it. The commjax optimizers (``onebit_adam``, ``dgc``,
``diloco``, ``streaming_diloco``, ``decoupled_momentum``) run their own compressed
exchange instead (``streaming_diloco`` sends its outer gradients through
``--compressor``; ``identity`` is the exact fp32 mean).

Checkpoints (orbax) hold the parameters and the whole optimizer state: error-feedback
residuals, step counters, PRNG keys, compressor state. The batches are a pure function
of the step, so ``--resume`` continues bit-identically.

Prints a progress bar (loss, bytes sent), a summary table and a sample of generated
text; writes ``char_transformer.png`` and ``char_transformer.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cli  # noqa: E402  (no JAX import: --devices must be applied first)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_run_args(p, steps=300, batch_size=4, lr=3e-3)
    _cli.add_compression_args(p, compressor="quantize", optimizer="adam")
    _cli.add_checkpoint_args(p)
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=_cli.positive_int, default=64, help="width (default 64)")
    g.add_argument("--layers", type=_cli.positive_int, default=2, help="Transformer blocks (default 2)")
    g.add_argument("--heads", type=_cli.positive_int, default=4, help="attention heads (default 4)")
    g.add_argument("--seq-len", type=_cli.positive_int, default=64, help="context length (default 64)")
    g.add_argument("--corpus-chars", type=_cli.positive_int, default=2_000_000,
                   help="characters of standard-library source to use (default 2,000,000)")
    g.add_argument("--sample", type=_cli.nonneg_int, default=200,
                   help="characters of text to generate at the end (default 200; 0: none)")
    args = _cli.parse(p, argv)
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    import jax
    import jax.numpy as jnp

    import _charlm
    import _train
    from commjax.checkpoint import Checkpointer

    corpus = _charlm.Corpus(args.corpus_chars)
    mesh = _train.data_mesh(args.devices)
    n = int(mesh.shape[_train.AXIS])
    graphdef, params = _charlm.make_model(d_model=args.d_model, layers=args.layers,
                                          heads=args.heads, seq_len=args.seq_len, seed=args.seed)
    print(f"{_charlm.num_params(params):,} parameters; {len(corpus.train):,} training characters; "
          f"{n} replicas x {args.batch_size} windows of {args.seq_len}")

    setup = _train.make_setup(args, params, n)
    if setup.plan is not None:
        print(setup.plan.summary())

    def loss_fn(p, batch):
        return _charlm.loss_fn(graphdef, p, batch)

    held_out = jnp.asarray(corpus.eval_batch(64, args.seq_len))
    eval_loss = jax.jit(lambda p: _charlm.loss_fn(graphdef, p, held_out))

    def batch_fn(step: int):
        return corpus.batch(args.seed, step, n * args.batch_size, args.seq_len)

    trainer = _train.DataParallel(loss_fn, params, setup.tx, mesh,
                                  per_replica_params=setup.per_replica_params)
    ckpt = Checkpointer(args.checkpoint_dir, max_to_keep=2) if args.checkpoint_dir else None
    try:
        result = _train.run(trainer, setup, batch_fn, args.steps, eval_fn=eval_loss,
                            eval_every=args.eval_every, progress=not args.no_progress, ckpt=ckpt,
                            checkpoint_every=args.checkpoint_every, resume=args.resume,
                            desc=setup.label,
                            metadata={"example": "02_char_transformer", "args": vars(args)})
    finally:
        if ckpt is not None:
            ckpt.close()

    print()
    print(_train.summarize([result], eval_name="held-out loss"))
    if args.sample:
        text = _charlm.sample(graphdef, trainer.eval_params(), "def ", args.sample, args.seq_len,
                              seed=args.seed)
        print("\nsample:\n" + "def " + text)
    png = _train.plot_curves({result.label: (result.steps, result.losses)},
                             os.path.join(args.out, "char_transformer.png"),
                             title=f"Char Transformer, {n} replicas",
                             eval_curves={result.label: (result.eval_steps, result.eval_values)})
    js = _train.write_json(os.path.join(args.out, "char_transformer.json"),
                           {"example": "02_char_transformer", "replicas": n, "args": vars(args),
                            "runs": [result.record()]})
    print(f"\nwrote {png} and {js}")
    return 0 if result.in_sync is not False else 1


if __name__ == "__main__":
    sys.exit(main())
