"""The char Transformer of ``02_char_transformer.py`` trained by several processes joined
with ``jax.distributed``: the same script runs in every process (SPMD).

    python -m commjax.launch --processes 2 --devices-per-process 2 \\
        examples/04_multiprocess.py --compressor quantize --bits 4 --steps 100

``commjax.launch`` starts the processes and gives each one the coordinator address, its
id and its device count; :func:`commjax.distributed.initialize_from_env` joins the job
(gloo carries the CPU collectives between processes) and
:func:`commjax.distributed.global_mesh` builds one ``"data"`` axis over every process'
devices. Each process feeds only its own replicas' batches
(``jax.make_array_from_process_local_data``); the compressed gradient exchange is the
same ``cj.compressed_mean`` as on one process. Run without the launcher, the script
trains on the local devices of one process (``--devices`` simulates CPU devices then).

Process 0 shows the progress bar (the loss of its own replicas) and the summary table
and writes ``multiprocess.png``/``multiprocess.json``; every process prints a digest of
its final parameters, identical on all of them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cli  # noqa: E402  (no JAX import: jax.distributed must start first)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _cli.add_run_args(p, steps=100, batch_size=4, lr=3e-3,
                      devices_help=" (single-process runs only: under commjax.launch use "
                                    "--devices-per-process)")
    _cli.add_compression_args(p, compressor="quantize", optimizer="adam")
    _cli.add_checkpoint_args(p)
    p.add_argument("--d-model", type=_cli.positive_int, default=64, help="width (default 64)")
    p.add_argument("--layers", type=_cli.positive_int, default=2, help="Transformer blocks (default 2)")
    p.add_argument("--seq-len", type=_cli.positive_int, default=64, help="context length (default 64)")
    args = p.parse_args(argv)
    _cli.check_checkpoint_args(p, args)
    launched = bool(os.environ.get("COMMJAX_COORDINATOR"))
    if args.devices is not None and launched:
        p.error("--devices is for single-process runs; under commjax.launch use --devices-per-process")
    if not launched:
        _cli.use_cpu_devices(args.devices)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    from commjax import distributed

    distributed.initialize_from_env()  # before anything touches a JAX backend

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import _charlm
    import _train
    from commjax.checkpoint import Checkpointer

    pid, nproc = jax.process_index(), jax.process_count()
    main_process = pid == 0
    mesh = distributed.global_mesh(_train.AXIS)
    n = int(mesh.shape[_train.AXIS])
    # This process' replicas are the devices it owns, in mesh order.
    mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == pid]
    rows = slice(mine[0] * args.batch_size, (mine[-1] + 1) * args.batch_size)

    corpus = _charlm.Corpus(1_000_000)
    graphdef, params = _charlm.make_model(d_model=args.d_model, layers=args.layers, heads=4,
                                          seq_len=args.seq_len, seed=args.seed)
    if main_process:
        print(f"{nproc} process(es) x {jax.local_device_count()} devices = {n} replicas; "
              f"{_charlm.num_params(params):,} parameters")

    def batch_fn(step: int):
        # Every process can compute the global batch of a step; it hands over only its rows.
        return corpus.batch(args.seed, step, n * args.batch_size, args.seq_len)

    batch_sharding = NamedSharding(mesh, P(_train.AXIS))

    def place_batch(global_batch):
        return jax.make_array_from_process_local_data(batch_sharding, global_batch[rows])

    def loss_fn(p, batch):
        return _charlm.loss_fn(graphdef, p, batch)

    held_out = jnp.asarray(corpus.eval_batch(32, args.seq_len))
    eval_loss = jax.jit(lambda p: _charlm.loss_fn(graphdef, p, held_out),
                        out_shardings=NamedSharding(mesh, P()))

    setup = _train.make_setup(args, params, n)
    if main_process and setup.plan is not None:
        print(setup.plan.summary())
    trainer = _train.DataParallel(loss_fn, params, setup.tx, mesh, place_batch=place_batch,
                                  per_replica_params=setup.per_replica_params)
    ckpt = Checkpointer(args.checkpoint_dir, max_to_keep=2) if args.checkpoint_dir else None
    try:
        result = _train.run(trainer, setup, batch_fn, args.steps, eval_fn=eval_loss,
                            eval_every=args.eval_every, progress=not args.no_progress, ckpt=ckpt,
                            checkpoint_every=args.checkpoint_every, resume=args.resume,
                            desc=setup.label, verbose=main_process,
                            metadata={"example": "04_multiprocess", "args": vars(args)})
    finally:
        if ckpt is not None:
            ckpt.close()

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(trainer.eval_params()):
        h.update(np.asarray(leaf.addressable_shards[0].data).tobytes())
    print(f"process {pid}: final parameters sha256 {h.hexdigest()[:16]} "
          f"(replicas on this process in sync: {result.in_sync})", flush=True)
    if main_process:
        print()
        print(_train.summarize([result], eval_name="held-out loss"))
        png = _train.plot_curves({result.label: (result.steps, result.losses)},
                                 os.path.join(args.out, "multiprocess.png"),
                                 title=f"char Transformer, {nproc} processes, {n} replicas",
                                 eval_curves={result.label: (result.eval_steps, result.eval_values)})
        js = _train.write_json(os.path.join(args.out, "multiprocess.json"),
                               {"example": "04_multiprocess", "processes": nproc, "replicas": n,
                                "args": vars(args), "runs": [result.record()]})
        print(f"\nwrote {png} and {js}")
    return 0 if result.in_sync is not False else 1


if __name__ == "__main__":
    sys.exit(main())
