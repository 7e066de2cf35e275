"""The digits task of ``01_digits_cnn.py`` with a Flax **Linen** MLP: commjax works the
same with Linen's plain parameter dicts as with NNX.

    python examples/03_linen_mlp.py --devices 8 --compressor quantize --bits 8
    python examples/03_linen_mlp.py --devices 4 --compressor terngrad --optimizer momentum --lr 0.05

With Linen, ``model.init`` returns ``{"params": ...}``, a dict of arrays that is exactly
what ``optax`` and ``cj.compressed_mean`` work on; the train step differentiates
``model.apply`` with respect to ``cj.vary(params, "data")`` inside ``jax.shard_map``.

Prints a progress bar, a summary table; writes ``linen_mlp.png`` and ``linen_mlp.json``.
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
    _cli.add_run_args(p, steps=300, batch_size=32, lr=3e-3)
    _cli.add_compression_args(p, compressor="quantize", optimizer="adam")
    _cli.add_checkpoint_args(p)
    p.add_argument("--hidden", type=_cli.positive_int, default=128, help="hidden width (default 128)")
    return _cli.parse(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import linen as nn
    from sklearn.datasets import load_digits

    import _train
    from commjax.checkpoint import Checkpointer

    class MLP(nn.Module):
        hidden: int

        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Dense(self.hidden)(x))
            x = nn.gelu(nn.Dense(self.hidden)(x))
            return nn.Dense(10)(x)

    digits = load_digits()
    x_all = (digits.data / 16.0).astype(np.float32)  # [1797, 64]
    y_all = digits.target.astype(np.int32)
    perm = np.random.default_rng(1234).permutation(len(y_all))
    n_test = len(y_all) // 5
    x_train, y_train = x_all[perm[n_test:]], y_all[perm[n_test:]]
    x_test, y_test = jnp.asarray(x_all[perm[:n_test]]), jnp.asarray(y_all[perm[:n_test]])

    mesh = _train.data_mesh(args.devices)
    n = int(mesh.shape[_train.AXIS])
    model = MLP(hidden=args.hidden)
    params = model.init(jax.random.PRNGKey(args.seed), jnp.zeros((1, 64)))["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    @jax.jit
    def accuracy(params):
        return jnp.mean(jnp.argmax(model.apply({"params": params}, x_test), -1) == y_test)

    def batch_fn(step: int):
        idx = np.random.default_rng([args.seed, step]).integers(0, len(y_train), n * args.batch_size)
        return {"x": x_train[idx], "y": y_train[idx]}

    setup = _train.make_setup(args, params, n)
    if setup.plan is not None:
        print(setup.plan.summary())
    trainer = _train.DataParallel(loss_fn, params, setup.tx, mesh,
                                  per_replica_params=setup.per_replica_params)
    ckpt = Checkpointer(args.checkpoint_dir, max_to_keep=2) if args.checkpoint_dir else None
    try:
        result = _train.run(trainer, setup, batch_fn, args.steps, eval_fn=accuracy,
                            eval_every=args.eval_every, progress=not args.no_progress, ckpt=ckpt,
                            checkpoint_every=args.checkpoint_every, resume=args.resume,
                            desc=setup.label, metadata={"example": "03_linen_mlp", "args": vars(args)})
    finally:
        if ckpt is not None:
            ckpt.close()
    print()
    print(_train.summarize([result], eval_name="test accuracy"))
    png = _train.plot_curves({result.label: (result.steps, result.losses)},
                             os.path.join(args.out, "linen_mlp.png"),
                             title=f"Linen MLP on digits, {n} replicas")
    js = _train.write_json(os.path.join(args.out, "linen_mlp.json"),
                           {"example": "03_linen_mlp", "replicas": n, "args": vars(args),
                            "runs": [result.record()]})
    print(f"\nwrote {png} and {js}")
    return 0 if result.in_sync is not False else 1


if __name__ == "__main__":
    sys.exit(main())
