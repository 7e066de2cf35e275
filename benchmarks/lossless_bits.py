"""Bits per element that ``cj.lossless()`` achieves on the char LM's bfloat16 gradients
and weights, step by step, against ``cj.cast(jnp.bfloat16)`` (16 bits) in the same run.

The char Transformer (examples/_charlm.py) trains with Adam on the exact mean of 8
replicas' gradients (each replica its own batch). At every step each replica's gradient,
the weights, and the weight change of the step (what ``cj.zero`` gathers with
``weight_delta=True``) are encoded with the codec as ``compressed_mean`` lays them out
(each compressed leaf padded to whole blocks). A payload travels coded unless some block
of some replica overflows its escapes; then the raw fallback travels too. Bytes come from
the compiled HLO of ``compressed_mean`` (reducer ``allgather``): the coded all-gather
outside the conditional, the fallback's inside it. So per step::

    bits/element = 16 * (coded + (fallback if any replica overflowed)) / cast(bf16)

The table also shows the empirical entropy of the bfloat16 exponents (what an ideal
variable-rate exponent code would need, plus 8 bits of sign and mantissa).

    python benchmarks/lossless_bits.py [--steps 40] [--configs 4:3,4:7,5:3] [--out benchmarks/results]

Writes ``lossless_bits.json``.
"""

from __future__ import annotations

import argparse
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
from commjax.kernels.lossless import header_column  # noqa: E402
from commjax.testing import update_collectives  # noqa: E402

N = 8


def hlo_gather_bytes(codec, shapes) -> tuple[float, float]:
    """``(coded, fallback)`` per-device all-gather ring bytes of one compressed_mean step."""
    rep = update_collectives(cj.compressed_mean(codec, "data", reducer="allgather"), shapes, N)
    gathers = rep.of_kind("all-gather")
    return (sum(c.ring_bytes for c in gathers if not c.in_conditional),
            sum(c.ring_bytes for c in gathers if c.in_conditional))


def compressed_leaves(codec, params) -> list[int]:
    """Indices of the leaves compressed_mean compresses (the rest go exact)."""
    plan = cj.communication_plan(codec, params, N, reducer="allgather")
    return [i for i, r in enumerate(plan.routing.routes) if r == "compress"]


def make_stats(codec, idx):
    """A jitted ``leaves [R, ...] -> (overflowed per replica, overflowed block fraction,
    exponent entropy in bits)`` over the compressed leaves."""
    def one(leaves):
        flat = [jnp.ravel(leaves[i]).astype(jnp.float32) for i in idx]
        flat = [jnp.pad(f, (0, -f.shape[0] % codec.block)) for f in flat]
        words = [codec.encode(f, None).reshape(-1, codec.row_words) for f in flat]
        col = header_column(codec.block_size, codec.delta_bits)
        heads = jnp.concatenate([w[:, col] & 0xFFFF for w in words])
        x = jnp.concatenate(flat)
        exps = (jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16) >> 7) & 0xFF
        p = jnp.bincount(exps.astype(jnp.int32), length=256) / exps.shape[0]
        ent = -jnp.sum(jnp.where(p > 0, p * jnp.log2(jnp.where(p > 0, p, 1.0)), 0.0))
        over = (heads >> 8) & 1
        return jnp.any(over != 0), jnp.mean(over.astype(jnp.float32)), ent

    return jax.jit(jax.vmap(one))


def run(args):
    graphdef, params = _charlm.make_model(d_model=args.d_model, layers=2, heads=4,
                                          seq_len=args.seq_len, seed=0)
    corpus = _charlm.Corpus(max_chars=400_000)
    shapes = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    raw, _ = hlo_gather_bytes(cj.cast(jnp.bfloat16), shapes)
    codecs = {}
    for cfg in args.configs.split(","):
        d, e = (int(v) for v in cfg.split(":"))
        codec = cj.lossless(delta_bits=d, escapes=e)
        coded, fallback = hlo_gather_bytes(codec, shapes)
        codecs[f"d{d}e{e}"] = (codec, coded, fallback, make_stats(codec, compressed_leaves(codec, params)))
    tx = optax.adam(args.lr)
    opt = tx.init(params)
    grads_of = jax.jit(jax.vmap(jax.grad(lambda p, b: _charlm.loss_fn(graphdef, p, b)), in_axes=(None, 0)))
    rows = []
    for step in range(args.steps):
        batch = corpus.batch(0, step, N * args.batch_size, args.seq_len).reshape(N, args.batch_size, -1)
        g = grads_of(params, jnp.asarray(batch))
        upd, opt = tx.update(jax.tree_util.tree_map(lambda a: a.mean(0), g), opt, params)
        new = optax.apply_updates(params, upd)
        trees = {"grad": g, "weight": jax.tree_util.tree_map(lambda a: a[None], params),
                 "delta": jax.tree_util.tree_map(lambda a, b: (a - b)[None], new, params)}
        row = {"step": step}
        for name, (codec, coded, fallback, stats) in codecs.items():
            row[name] = {}
            for what, tree in trees.items():
                over, frac, ent = stats(jax.tree_util.tree_leaves(tree))
                any_over = bool(np.any(over))
                row[name][what] = {
                    "bits_per_element": 16 * (coded + (fallback if any_over else 0)) / raw,
                    "fallback": any_over, "overflow_replicas": int(np.sum(over)),
                    "overflow_block_fraction": float(np.max(frac)),
                    "exponent_entropy_bits": float(np.mean(ent))}
        params = new
        rows.append(row)
        print(f"{step:4d}  " + "  ".join(
            f"{name} {w} {row[name][w]['bits_per_element']:5.2f}" for name in codecs for w in trees)
            + "  H(exp) " + " ".join(f"{w} {row[next(iter(codecs))][w]['exponent_entropy_bits']:.2f}"
                                     for w in trees), flush=True)
    hlo = {name: {"coded": c, "fallback": f, "cast_bf16": raw, "codec": repr(codec)}
           for name, (codec, c, f, _) in codecs.items()}
    return rows, hlo


def char_lm_parser(description: str, steps: int) -> argparse.ArgumentParser:
    """The options of a char-LM run (also benchmarks/lossless_training.py's)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    return ap


def main(argv=None):
    ap = char_lm_parser(__doc__.split("\n")[0], steps=40)
    ap.add_argument("--configs", default="4:3,4:7,5:3", help="delta_bits:escapes, comma-separated")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows, hlo = run(args)
    summary = {}
    for name in hlo:
        summary[name] = {}
        for w in ("grad", "weight", "delta"):
            bits = [r[name][w]["bits_per_element"] for r in rows]
            fb = sum(r[name][w]["fallback"] for r in rows)
            summary[name][w] = {"mean_bits_per_element": float(np.mean(bits)),
                                "ratio_to_cast_bf16": float(np.mean(bits)) / 16, "fallback_steps": fb}
            print(f"{name:6s} {w:6s}: mean {np.mean(bits):5.2f} bits/element = {np.mean(bits) / 16:.3f}x "
                  f"of cast(bf16); fallback on {fb}/{len(rows)} steps")
    write_results(os.path.join(args.out, "lossless_bits.json"), {
        "command": "python benchmarks/lossless_bits.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "replicas": N, "hlo_allgather_bytes_per_device": hlo, "summary": summary, "rows": rows,
        "seconds": round(time.time() - t0, 1), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
    })


if __name__ == "__main__":
    main()
