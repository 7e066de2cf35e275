"""A small Flax NNX CNN on scikit-learn's bundled digits, data-parallel over all devices,
with the gradient exchange compressed by commjax.

    python examples/01_digits_cnn.py --devices 8 --compressor quantize --bits 4
    python examples/01_digits_cnn.py --devices 4 --compressor sign --optimizer sgd --lr 0.05

Each replica (device) computes the gradient on its own share of the batch; the gradients
are exchanged through ``cj.compressed_mean`` (the compressor chosen on the command line,
with error feedback) and the optimizer after it sees the same mean on every replica.
The digits (1,797 8x8 images) ship with scikit-learn: nothing is downloaded.

Prints a progress bar with the loss and bytes sent, a summary table, and writes
``digits_cnn.png`` (loss curves) and ``digits_cnn.json`` to ``--out``.
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
    p.add_argument("--compare-exact", action="store_true",
                   help="also train with the exact fp32 mean and report the gap")
    return _cli.parse(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from sklearn.datasets import load_digits

    import _train

    class CNN(nnx.Module):
        """conv3x3(16) -> conv3x3(32) -> 2x2 avg pool -> dense(64) -> dense(10)."""

        def __init__(self, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
            self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
            self.fc1 = nnx.Linear(4 * 4 * 32, 64, rngs=rngs)
            self.fc2 = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):  # x: [b, 8, 8, 1]
            x = nnx.relu(self.conv1(x))
            x = nnx.relu(self.conv2(x))
            x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
            x = nnx.relu(self.fc1(x.reshape(x.shape[0], -1)))
            return self.fc2(x)

    # Data: pixels scaled to [0, 1], a fixed 80/20 split.
    digits = load_digits()
    x_all = (digits.images / 16.0).astype(np.float32)[..., None]
    y_all = digits.target.astype(np.int32)
    perm = np.random.default_rng(1234).permutation(len(y_all))
    n_test = len(y_all) // 5
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    x_train, y_train = x_all[train_idx], y_all[train_idx]
    x_test, y_test = jnp.asarray(x_all[test_idx]), jnp.asarray(y_all[test_idx])

    mesh = _train.data_mesh(args.devices)
    n = int(mesh.shape[_train.AXIS])
    global_batch = n * args.batch_size

    def batch_fn(step: int):
        idx = np.random.default_rng([args.seed, step]).integers(0, len(y_train), global_batch)
        return {"x": x_train[idx], "y": y_train[idx]}

    model = CNN(nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    @jax.jit
    def accuracy(params):
        logits = nnx.merge(graphdef, params)(x_test)
        return jnp.mean(jnp.argmax(logits, -1) == y_test)

    runs = [args]
    if args.compare_exact:
        exact = argparse.Namespace(**vars(args))
        exact.compressor, exact.no_error_feedback = "identity", False
        runs = [exact, args]

    from commjax.checkpoint import Checkpointer

    print(f"{n} replicas x {args.batch_size} examples; {len(y_train)} train / {n_test} test digits")
    results = []
    for run_args in runs:
        setup = _train.make_setup(run_args, params, n)
        if setup.plan is not None:
            print(setup.plan.summary())
        trainer = _train.DataParallel(loss_fn, params, setup.tx, mesh,
                                      per_replica_params=setup.per_replica_params)
        ckpt = None
        if args.checkpoint_dir and run_args is args:
            ckpt = Checkpointer(args.checkpoint_dir, max_to_keep=2)
        res = _train.run(trainer, setup, batch_fn, args.steps, eval_fn=accuracy,
                         eval_every=args.eval_every, progress=not args.no_progress, ckpt=ckpt,
                         checkpoint_every=args.checkpoint_every, resume=args.resume,
                         desc=setup.label, metadata={"example": "01_digits_cnn", "args": vars(args)})
        if ckpt is not None:
            ckpt.close()
        results.append(res)

    print()
    print(_train.summarize(results, eval_name="test accuracy",
                           reference=results[0] if args.compare_exact else None))
    png = _train.plot_curves({r.label: (r.steps, r.losses) for r in results},
                             os.path.join(args.out, "digits_cnn.png"),
                             title=f"Digits CNN, {n} replicas (training loss)")
    js = _train.write_json(os.path.join(args.out, "digits_cnn.json"),
                           {"example": "01_digits_cnn", "replicas": n, "args": vars(args),
                            "runs": [r.record() for r in results]})
    print(f"\nwrote {png} and {js}")
    return 0 if all(r.in_sync is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
