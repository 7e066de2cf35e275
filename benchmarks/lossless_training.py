"""Training through the lossless wire format equals training through raw bfloat16, bit for
bit, over many steps of a real model.

The char Transformer (examples/_charlm.py) trains with Adam on 8 simulated CPU replicas
(``cj.data_parallel``, each replica its own batch) with ``compressed_mean`` and error
feedback. For each reducer that can carry a lossless payload (``allgather``,
``two_phase``) the same run is made with three wire formats of the same bfloat16 values:

* ``raw``: ``cj.cast(jnp.bfloat16)``, two 16-bit patterns per word (the baseline);
* ``lossless``: ``cj.cast(jnp.bfloat16, wire="lossless")`` (= ``cj.lossless()``);
* ``lossless_tight``: ``cj.lossless(block_size=64, delta_bits=2, escapes=1)``, a code
  too small for these gradients, so that steps take the raw fallback.

``gradient_overflow_steps`` counts the steps on which some replica's gradient alone (before
error feedback) overflows the code's escapes, a probe of how often the fallback is taken.
A run equals the baseline when every step's per-replica losses and the final parameters,
optimizer state and error-feedback residuals are the same bits. Bytes per step are the
plan's (checked against the compiled HLO by the test suite) for a step without fallback;
a fallback step sends the raw payload as well (``bytes_per_fallback_step``).

    python benchmarks/lossless_training.py [--steps 200] [--out benchmarks/results]

Writes ``lossless_training.json``.
"""

from __future__ import annotations

import os
import sys
import time

from _devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _charlm  # noqa: E402
import commjax as cj  # noqa: E402
from _results import write_results  # noqa: E402
from commjax import _compat  # noqa: E402
from commjax.compressors import Lossless  # noqa: E402
from lossless_bits import char_lm_parser, compressed_leaves, make_stats  # noqa: E402

N = 8
AXIS = "data"
FORMATS = {
    "raw": cj.cast(jnp.bfloat16),
    "lossless": cj.cast(jnp.bfloat16, wire="lossless"),
    "lossless_tight": cj.lossless(block_size=64, delta_bits=2, escapes=1),
}


def train(codec, reducer: str, args, graphdef, params, corpus):
    """``(losses [steps, N], final state as host arrays, overflow steps)`` of one run. The
    last counts the steps on which some replica's gradient alone (before error feedback
    adds its residual) overflows the codec's escapes: a probe of how often the fallback
    is taken (0 for codecs without one)."""
    tx = optax.chain(cj.compressed_mean(codec, AXIS, reducer=reducer), optax.adam(args.lr))
    mesh = _compat.make_mesh((N,), (AXIS,))
    loss_fn = lambda p, b: _charlm.loss_fn(graphdef, p, b)  # noqa: E731
    dp = cj.data_parallel(loss_fn, tx, mesh)
    probe = None
    if isinstance(codec, Lossless):
        stats = make_stats(codec, compressed_leaves(codec, params))
        grads = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0)))
        probe = lambda p, b: bool(np.any(stats(jax.tree_util.tree_leaves(grads(p, b)))[0]))  # noqa: E731
    state = dp.init(params)
    losses, overflow_steps = [], 0
    for step in range(args.steps):
        batch = jnp.asarray(corpus.batch(0, step, N * args.batch_size, args.seq_len))
        if probe is not None:
            overflow_steps += probe(state.params, batch.reshape(N, args.batch_size, -1))
        state, loss = dp.step(state, batch)
        losses.append(np.asarray(loss))
    return np.stack(losses), jax.tree_util.tree_map(np.asarray, state), overflow_steps


def same_bytes(a, b) -> bool:
    """Byte-for-byte equal pytrees (stricter than commjax.testing.same_bits, which compares
    values: there -0 equals +0 and any NaN any other)."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(la, lb))


def run(args) -> list[dict]:
    graphdef, params = _charlm.make_model(d_model=args.d_model, layers=2, heads=4,
                                          seq_len=args.seq_len, seed=0)
    corpus = _charlm.Corpus(max_chars=400_000)
    rows = []
    for reducer in ("allgather", "two_phase"):
        base_losses, base_state = None, None
        for name, codec in FORMATS.items():
            t0 = time.perf_counter()
            losses, state, overflow_steps = train(codec, reducer, args, graphdef, params, corpus)
            plan = cj.communication_plan(codec, params, N, reducer=reducer)
            if name == "raw":
                base_losses, base_state, base_bytes = losses, state, plan.bytes_per_step
            first_diff = np.flatnonzero(np.any(losses.view(np.uint32) != base_losses.view(np.uint32), axis=1))
            row = {"reducer": reducer, "format": name, "codec": repr(codec), "steps": args.steps,
                   "losses_equal_every_step": bool(first_diff.size == 0),
                   "first_differing_step": int(first_diff[0]) if first_diff.size else None,
                   "state_equal_at_end": same_bytes(state, base_state),
                   "final_mean_loss": float(losses[-1].mean()),
                   "gradient_overflow_steps": overflow_steps,
                   "bytes_per_step": plan.bytes_per_step,
                   "bytes_ratio_to_raw": plan.bytes_per_step / base_bytes,
                   # a fallback step sends the coded payload and the raw one
                   "bytes_per_fallback_step": plan.bytes_per_step + (base_bytes if overflow_steps else 0),
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(f"{reducer:9s} {name:15s} losses equal {row['losses_equal_every_step']!s:5s} "
                  f"state equal {row['state_equal_at_end']!s:5s} overflow steps {overflow_steps:3d} loss {row['final_mean_loss']:.4f} "
                  f"bytes {row['bytes_per_step']:,.0f} ({row['bytes_ratio_to_raw']:.3f}x raw)", flush=True)
    return rows


def main(argv=None):
    args = char_lm_parser(__doc__.split("\n")[0], steps=200).parse_args(argv)
    t0 = time.time()
    rows = run(args)
    failed = [r for r in rows if not (r["losses_equal_every_step"] and r["state_equal_at_end"])]
    write_results(os.path.join(args.out, "lossless_training.json"), {
        "command": "python benchmarks/lossless_training.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "replicas": N, "rows": rows, "all_equal": not failed,
        "seconds": round(time.time() - t0, 1), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
    })
    if failed:
        raise SystemExit(f"{len(failed)} run(s) differ from raw bfloat16: {failed}")


if __name__ == "__main__":
    main()
