"""Where a compressed step's CPU time goes: each codec stage of the two-phase reducer, in
milliseconds and in *memory passes*, beside the floor step it is added to.

The model is the one of ``benchmarks/bandwidth.py`` (13.7M-parameter MLP, batch 16), on
one CPU device with one thread (as each of that benchmark's worker processes runs). One
pass is the time of ``x * 2`` over the model's fp32 gradient (read ``4 n`` bytes, write
``4 n``): this machine's memory speed in the unit every stage is measured in. Stages of
one replica's compressed step (``n`` values, ``N`` replicas), as the two-phase reducer
runs them with error feedback:

* ``encode_feedback``: ``y = g + e``; codes of ``y`` and the new residual (reads ``g``
  and ``e``, writes the residual and the words);
* ``decode_sum``: the ``N`` received chunks of ``n / N`` values decoded and summed;
* ``server_encode``: the chunk's mean re-encoded (``n / N`` values);
* ``decode``: the gathered payload decoded to the ``n``-value mean.

The floor step (``forward + backward + SGD with momentum``, no exchange) is what
``--rates 1gbit`` compares a compressed step with; the exact mean adds one fp32
all-reduce of ``4 n`` bytes instead.

    python benchmarks/codec_cpu.py [--codecs int8,int4,sign] [--replicas 4] [--reps 7]

Writes ``benchmarks/results/codec_cpu.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import commjax as cj  # noqa: E402
from _results import write_results  # noqa: E402
from bandwidth import MODEL, SGD, init_params, make_batch  # noqa: E402
from commjax.collectives._common import decode_sum  # noqa: E402
from kernels import timed  # noqa: E402

CODECS = {"int8": lambda: cj.quantize(bits=8), "int4": lambda: cj.quantize(bits=4),
          "int8_nearest": lambda: cj.quantize(bits=8, stochastic=False), "sign": lambda: cj.sign()}


def median_ms(fn, *args, reps: int) -> float:
    """Median milliseconds of the jitted ``fn(*args)`` after one warm-up call."""
    return 1e3 * timed(jax.jit(fn), args, repeats=reps, warmup=1)


def floor_step_ms(reps: int) -> float:
    """forward + backward + SGD momentum of the bandwidth benchmark's model, one replica."""
    params = [(jnp.asarray(k), jnp.asarray(b)) for k, b in init_params(MODEL)]
    x, y = (jnp.asarray(a) for a in make_batch(MODEL, 0, 1))
    tx = optax.sgd(SGD["learning_rate"], momentum=SGD["momentum"])

    def loss(p):
        h = x
        for i, (k, b) in enumerate(p):
            h = h @ k + b
            h = jax.nn.relu(h) if i < len(p) - 1 else h
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    def step(p, s):
        u, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    return median_ms(step, params, tx.init(params), reps=reps)


def codec_stages(codec, n: int, replicas: int, reps: int) -> dict:
    """Milliseconds of each stage of one replica's two-phase step (see the docstring)."""
    g = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    e = 1e-3 * jax.random.normal(jax.random.key(1), (n,), jnp.float32)
    key = jax.random.key_data(jax.random.key(2))
    words, _ = jax.jit(lambda g, e, k: codec.encode_feedback(g, e, k))(g, e, key)
    rows = words.reshape(replicas, -1)
    mean = jax.jit(lambda r: decode_sum(codec, r, n // replicas, replicas))(rows)
    return {
        "encode_feedback": median_ms(lambda g, e, k: codec.encode_feedback(g, e, k), g, e, key, reps=reps),
        "decode_sum": median_ms(lambda r: decode_sum(codec, r, n // replicas, replicas), rows, reps=reps),
        "server_encode": median_ms(lambda m, k: codec.encode_and_decode(m, k), mean, key, reps=reps),
        "decode": median_ms(lambda w: codec.decode(w, n), words, reps=reps),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codecs", default="int8,int4,sign")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "codec_cpu.json"))
    args = ap.parse_args(argv)
    params = sum(k.size + b.size for k, b in init_params(MODEL))
    align = 256 * args.replicas
    n = -(-params // align) * align  # whole blocks in every chunk, as the reducer pads
    g = jnp.ones((n,), jnp.float32)
    one_pass = median_ms(lambda v: v * 2.0, g, reps=args.reps)
    floor = floor_step_ms(args.reps)
    rows = []
    print(f"n = {n:,} values; one pass (read + write 4n bytes) = {one_pass:.1f} ms; "
          f"floor step = {floor:.1f} ms = {floor / one_pass:.1f} passes")
    print(f"{'codec':14s}" + "".join(f"{s:>18s}" for s in ("encode_feedback", "decode_sum", "server_encode",
                                                           "decode", "total")) + "   total / floor")
    for name in args.codecs.split(","):
        stages = codec_stages(CODECS[name](), n, args.replicas, args.reps)
        total = sum(stages.values())
        rows.append({"codec": name, "ms": stages, "total_ms": total,
                     "passes": {k: v / one_pass for k, v in stages.items()},
                     "total_passes": total / one_pass, "total_over_floor": total / floor})
        print(f"{name:14s}" + "".join(f"{v:9.1f} ms {v / one_pass:4.1f}p" for v in stages.values())
              + f"{total:9.1f} ms {total / one_pass:4.1f}p   {total / floor:.2f}", flush=True)
    write_results(args.out, {
        "command": "python benchmarks/codec_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "values": n, "replicas": args.replicas, "one_pass_ms": one_pass, "floor_step_ms": floor,
        "rows": rows, "loadavg_after": list(os.getloadavg()), "cores": os.cpu_count(),
        "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
    })


if __name__ == "__main__":
    main()
