"""Sharded data parallel (cj.zero): wire bytes and convergence of every codec combination.

Two measurements, each against exact fp32 ZeRO in the same run:

1. **Bytes** (compile only, nothing runs): the per-device bytes of one ZeRO step's
   reduce-scatter of gradients and all-gather of weights, read from the compiled HLO
   (``cj.collective_bytes``) on ``--replicas`` devices for a GPT-shaped parameter tree
   (``--bytes-d-model``, ``--bytes-layers``), beside the analytic ``cj.communication_plan``,
   and the ratio to the exact fp32 collectives of the same step.
2. **Convergence**: the character Transformer of ``examples/_charlm.py`` trained for
   ``--steps`` steps with ``cj.zero(optax.adam(lr))`` on 8 replicas whose data are
   *not* i.i.d. (replica ``r`` reads windows from its own contiguous eighth of the corpus,
   different source files); held-out loss at the end and its gap to exact ZeRO, training
   curves, and whether the parameters stayed bit-identical on every replica.

Two-level configurations (SDP4Bit's TLq) run on a ``2 x 4`` mesh: 8-bit on the fast axis
of 4, 4-bit on the slow axis of 2.

    python benchmarks/sharded.py                          # defaults (~10 min on 2 cores)
    python benchmarks/sharded.py --steps 300 --configs exact,int8,qwd4_two_level

Writes ``benchmarks/results/sharded.json`` (with the command line) and ``sharded.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from _devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import commjax as cj  # noqa: E402
from commjax import _compat  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _charlm  # noqa: E402
from _results import write_results  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FAST = "node"  # the fast (inner) axis of two-level configurations


def q(bits: int, stochastic: bool = True, block: int = 256):
    return cj.quantize(bits=bits, block_size=block, stochastic=stochastic)


def configs(block: int) -> dict:
    """name -> (description, cj.zero keyword arguments; ``inner_axis_name`` means 2 x 4)."""
    two = dict(inner_axis_name=FAST, inner_grad_codec=q(8, block=block),
               inner_weight_codec=q(8, False, block))
    return {
        "exact": ("exact fp32 ZeRO (baseline)", {}),
        "exact_two_level": ("exact fp32 ZeRO on the 2 x 4 mesh (two-level baseline)",
                            dict(inner_axis_name=FAST)),
        "int8": ("int8 weights (qwZ, deltas) + int8 grads",
                 dict(weight_codec=q(8, False, block), grad_codec=q(8, block=block))),
        "int8_plain": ("int8 weights (not deltas) + int8 grads",
                       dict(weight_codec=q(8, False, block), grad_codec=q(8, block=block), weight_delta=False)),
        "qwd4_exact_grads": ("qWD 4-bit weights + exact grads", dict(weight_codec=q(4, False, block))),
        "exact_w_int4": ("exact weights + int4 grads", dict(grad_codec=q(4, block=block))),
        "qwd4_int4": ("qWD 4-bit + int4 grads", dict(weight_codec=q(4, False, block), grad_codec=q(4, block=block))),
        "qwd4_had4": ("qWD 4-bit + Hadamard int4 grads",
                      dict(weight_codec=q(4, False, block), grad_codec=cj.hadamard(q(4, block=block)))),
        "qwd4_two_level": ("two-level: qWD 4-bit / 8-bit weights, 4-bit / 8-bit grads (slow / fast axis)",
                           dict(weight_codec=q(4, False, block), grad_codec=q(4, block=block), **two)),
        "qwd4_two_level_had": ("two-level as above, Hadamard before the 4-bit grads (SDP4Bit)",
                               dict(weight_codec=q(4, False, block), grad_codec=cj.hadamard(q(4, block=block)), **two)),
        "w4_plain_int4": ("plain 4-bit weights (no deltas) + int4 grads",
                          dict(weight_codec=q(4, False, block), grad_codec=q(4, block=block), weight_delta=False)),
        "w4_plain_exact_grads": ("plain 4-bit weights (no deltas) + exact grads",
                                 dict(weight_codec=q(4, False, block), weight_delta=False)),
    }


def mesh_for(kw: dict, n: int):
    """The mesh and axes of a configuration: ``(n,)``, or ``(2, n / 2)`` for two levels
    (the slow axis of 2 first, the fast axis inside it)."""
    if "inner_axis_name" in kw:
        return _compat.make_mesh((2, n // 2), ("data", FAST)), ("data", FAST)
    return _compat.make_mesh((n,), ("data",)), ("data",)


def zero_tx(kw: dict, lr: float, min_compress_size: int):
    return cj.zero(optax.adam(lr), "data", min_compress_size=min_compress_size, **kw)


# ------------------------------------------------------------------------------ bytes


def gpt_shapes(d: int, layers: int, vocab: int) -> dict:
    """Parameter shapes of a GPT-style decoder (no biases in the matrices)."""
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    block = {"ln1": f(d), "ln1_b": f(d), "qkv": f(d, 3 * d), "out": f(d, d),
             "ln2": f(d), "ln2_b": f(d), "fc": f(d, 4 * d), "proj": f(4 * d, d)}
    return {"embed": f(vocab, d), "pos": f(1024, d), "ln_f": f(d),
            "blocks": [dict(block) for _ in range(layers)]}


def hlo_bytes(kw: dict, params: dict, n: int, min_compress_size: int) -> dict:
    """Per-device ring bytes of one compiled ZeRO update (never run), by collective."""
    mesh, axes = mesh_for(kw, n)
    tx = zero_tx(kw, 1e-3, min_compress_size)
    state = jax.eval_shape(lambda p: cj.init_sharded(tx, p, mesh, axes), params)
    specs = cj.state_specs(state, axes)
    grads = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct((n,) + p.shape, p.dtype), params)

    def step(g, s, p):
        return tx.update(jax.tree_util.tree_map(lambda a: a[0], g), s, p)

    fn = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(axes), specs, P()), out_specs=(P(), specs)))
    rep = cj.collective_bytes(fn, grads, state, params)
    out = {"reduce_scatter": 0.0, "all_gather": 0.0, "dtypes": sorted(rep.dtypes)}
    for c in rep.collectives:
        out["all_gather" if c.kind == "all-gather" else "reduce_scatter"] += c.ring_bytes
    out["slow_axis"] = slow_axis_bytes(rep, mesh)
    plan = cj.communication_plan(tx, params, 2 if "inner_axis_name" in kw else n,
                                 inner_replicas=n // 2 if "inner_axis_name" in kw else 1)
    out["analytic"] = {"reduce_scatter": plan.bytes_of("gradient"), "all_gather": plan.bytes_of("weight")}
    return out


def slow_axis_bytes(rep, mesh) -> float:
    """Bytes of the collectives over the slow axis ``"data"`` (every collective on a 1-D
    mesh; on ``2 x 4``, those whose groups have the slow axis' size)."""
    return float(sum(c.ring_bytes for c in rep.collectives if c.group_size == mesh.shape["data"]))


def bytes_table(names: list, cfgs: dict, args) -> dict:
    params = gpt_shapes(args.bytes_d_model, args.bytes_layers, args.bytes_vocab)
    n_params = sum(math.prod(l.shape) for l in jax.tree_util.tree_leaves(params))
    rows = {}
    for name in names:
        t0 = time.time()
        rows[name] = hlo_bytes(cfgs[name][1], params, args.replicas, args.min_compress_size)
        print(f"bytes {name}: RS {rows[name]['reduce_scatter']:,.0f} B, AG {rows[name]['all_gather']:,.0f} B "
              f"({time.time() - t0:.1f} s)", flush=True)
    for name, r in rows.items():
        # Two-level rows against exact two-level ZeRO (same mesh), others against exact.
        base = rows.get("exact_two_level", rows["exact"]) if "inner_axis_name" in cfgs[name][1] else rows["exact"]
        r["total"] = r["reduce_scatter"] + r["all_gather"]
        r["rs_ratio"] = base["reduce_scatter"] / r["reduce_scatter"]
        r["ag_ratio"] = base["all_gather"] / r["all_gather"]
        r["total_ratio"] = (base["reduce_scatter"] + base["all_gather"]) / r["total"]
        r["slow_axis_ratio"] = base["slow_axis"] / r["slow_axis"]
        r["hlo_equals_analytic"] = all(abs(r[k] - r["analytic"][k]) < 0.5 for k in r["analytic"])
    return {"params": n_params, "shapes": f"GPT d={args.bytes_d_model} layers={args.bytes_layers} "
            f"vocab={args.bytes_vocab}", "rows": rows}


# ------------------------------------------------------------------------ convergence


def noniid_batch(corpus, seed: int, step: int, n: int, size: int, seq_len: int) -> np.ndarray:
    """``n * size`` windows; replica ``r``'s ``size`` come from the ``r``-th contiguous
    ``1/n`` of the training text only (different source files: not i.i.d.)."""
    region = (len(corpus.train) - seq_len - 1) // n
    rows = []
    for r in range(n):
        rng = np.random.default_rng([seed, step, r])
        starts = r * region + rng.integers(0, region, size)
        rows.append(corpus.train[starts[:, None] + np.arange(seq_len + 1)])
    return np.concatenate(rows)


def train_one(name: str, kw: dict, model, corpus, args) -> dict:
    graphdef, params = model
    n = args.replicas
    mesh, axes = mesh_for(kw, n)
    tx = zero_tx(kw, args.lr, args.min_compress_size)
    state = cj.init_sharded(tx, params, mesh, axes)
    specs = cj.state_specs(state, axes)

    def local(p, s, batch):
        loss, g = jax.value_and_grad(lambda w: _charlm.loss_fn(graphdef, w, batch))(cj.vary(p, axes))
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss[None]

    step = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(axes)),
                                     out_specs=(P(), specs, P(axes))))
    rep = NamedSharding(mesh, P())
    p = jax.device_put(params, rep)
    place = lambda t: jax.device_put(  # noqa: E731
        noniid_batch(corpus, args.seed, t, n, args.batch, args.seq_len), NamedSharding(mesh, P(axes)))
    t0 = time.time()
    compiled = step.lower(p, state, place(0)).compile()
    compile_s = time.time() - t0
    hlo = cj.collective_bytes(compiled)
    slow = slow_axis_bytes(hlo, mesh)
    held_out = jnp.asarray(corpus.eval_batch(128, args.seq_len))
    eval_fn = jax.jit(lambda w: _charlm.loss_fn(graphdef, w, held_out))
    losses, evals, t1 = [], [], time.time()
    for t in range(args.steps):
        p, state, loss = compiled(p, state, place(t))
        losses.append(float(np.mean(np.asarray(loss))))  # waits: one step in flight at a time
        if (t + 1) % args.eval_every == 0 or t + 1 == args.steps:
            evals.append((t + 1, float(eval_fn(p))))
    copies = [[np.asarray(s.data) for s in l.addressable_shards] for l in jax.tree_util.tree_leaves(p)]
    in_sync = all(np.array_equal(c[0], o) for c in copies for o in c[1:])
    print(f"{name}: held-out {evals[-1][1]:.4f}, {time.time() - t1:.0f} s, in sync {in_sync}", flush=True)
    return {"losses": losses, "eval": evals, "final_eval": evals[-1][1],
            "final_train": float(np.mean(losses[-max(1, len(losses) // 10):])),
            "hlo_bytes_per_step": hlo.total_ring_bytes, "slow_axis_bytes_per_step": slow,
            "replicas_in_sync": in_sync,
            "compile_s": compile_s, "train_s": time.time() - t1}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    runs = result["convergence"]["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), dpi=110)
    for i, (name, r) in enumerate(runs.items()):
        ys = np.asarray(r["losses"])
        k = max(1, len(ys) // 30)
        ax1.plot(np.arange(k, len(ys) + 1), np.convolve(ys, np.ones(k) / k, "valid"), color=f"C{i % 10}",
                 ls="-" if i < 10 else "--", lw=1.2, label=name)
        ax2.scatter(r["slow_axis_bytes_per_step"] / 1e6, r["final_eval"], color=f"C{i % 10}",
                    marker="o" if i < 10 else "s")
        ax2.annotate(name, (r["slow_axis_bytes_per_step"] / 1e6, r["final_eval"]), fontsize=7,
                     xytext=(3, 3), textcoords="offset points")
    ax1.set(xlabel="step", ylabel="training loss (nats/char)", title="cj.zero, 8 replicas, non-i.i.d. shards")
    ax1.set_ylim(top=min(ax1.get_ylim()[1], 3.5))
    ax1.legend(fontsize=7)
    ax2.set_xscale("log")
    ax2.xaxis.set_minor_formatter(NullFormatter())
    ax2.xaxis.set_major_formatter(ScalarFormatter())
    ax2.set(xlabel="bytes per step per device on the slow axis (HLO, MB; two-level: the 2-wide axis)",
            ylabel=f"held-out loss after {result['args']['steps']} steps", title="loss vs bytes")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per configuration")
    ap.add_argument("--configs", default="", help="comma-separated names (default: all)")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--block", type=int, default=256, help="quantization block (elements per scale)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=4, help="windows per replica per step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-compress-size", type=int, default=1024)
    ap.add_argument("--corpus-chars", type=int, default=2_000_000)
    ap.add_argument("--bytes-d-model", type=int, default=1024)
    ap.add_argument("--bytes-layers", type=int, default=2)
    ap.add_argument("--bytes-vocab", type=int, default=32000)
    ap.add_argument("--no-train", action="store_true", help="bytes only")
    ap.add_argument("--no-bytes", action="store_true", help="convergence only")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "sharded.json"))
    ap.add_argument("--replot", action="store_true",
                    help="recompute the ratios, targets and PNG of the JSON at --out (no training)")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.out) as f:
            finish(json.load(f), args.out)
        return 0
    cfgs = configs(args.block)
    names = [c for c in args.configs.split(",") if c] or list(cfgs)
    unknown = [c for c in names if c not in cfgs]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {', '.join(cfgs)}")
    names = ["exact"] + [c for c in names if c != "exact"]  # the baseline runs in every run
    result = {"command": "python benchmarks/sharded.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "args": vars(args), "jax": jax.__version__, "devices": jax.device_count(),
              "descriptions": {k: cfgs[k][0] for k in names}}
    result["bytes"] = {"rows": {}} if args.no_bytes else bytes_table(names, cfgs, args)
    if not args.no_train:
        corpus = _charlm.Corpus(args.corpus_chars)
        model = _charlm.make_model(d_model=args.d_model, layers=args.layers, heads=4,
                                   seq_len=args.seq_len, seed=args.seed)
        runs = {name: train_one(name, cfgs[name][1], model, corpus, args) for name in names}
        result["convergence"] = {"params": _charlm.num_params(model[1]), "runs": runs}
    finish(result, args.out)
    return 0


def derive(result: dict) -> None:
    """Gaps and ratios against the baselines (two-level runs' slow-axis bytes against
    exact two-level ZeRO when it ran), and the targets, in place."""
    runs = result.get("convergence", {}).get("runs", {})
    if runs:
        base = runs["exact"]
        for name, r in runs.items():
            two = "two_level" in name and "exact_two_level" in runs
            slow_base = runs["exact_two_level"] if two else base
            r["gap_vs_exact"] = (r["final_eval"] - base["final_eval"]) / base["final_eval"]
            r["bytes_ratio_vs_exact"] = base["hlo_bytes_per_step"] / r["hlo_bytes_per_step"]
            r["slow_axis_ratio_vs_exact"] = slow_base["slow_axis_bytes_per_step"] / r["slow_axis_bytes_per_step"]
    result["targets"] = targets(result)


def finish(result: dict, out: str) -> None:
    derive(result)
    if result.get("convergence"):
        plot(result, os.path.splitext(out)[0] + ".png")
    print_summary(result)
    write_results(out, result)


def targets(result: dict) -> list:
    """The issue's measured targets, each with its value and whether it is met."""
    rows = result["bytes"]["rows"]
    out = []

    def add(what, value, need, higher=True):
        out.append({"target": what, "value": value, "need": need,
                    "met": None if value is None else (value >= need if higher else value <= need)})

    for name, key, need, what in (("qwd4_int4", "rs_ratio", 6.0, "4-bit gradient reduce-scatter"),
                                  ("qwd4_int4", "ag_ratio", 6.0, "4-bit qWD all-gather"),
                                  ("int8", "rs_ratio", 3.5, "int8 gradient reduce-scatter"),
                                  ("int8", "ag_ratio", 3.5, "int8 weight all-gather")):
        if name in rows:
            add(f"{what}: x fewer HLO bytes than exact fp32", rows[name][key], need)
    runs = result.get("convergence", {}).get("runs", {})
    for name, need in (("int8", 0.01), ("qwd4_two_level", 0.03), ("qwd4_two_level_had", 0.03)):
        if name in runs:
            add(f"{name}: held-out loss gap vs exact ZeRO", runs[name]["gap_vs_exact"], need, higher=False)
    if runs:
        add("parameters bit-identical on every replica (all runs)",
            float(all(r["replicas_in_sync"] for r in runs.values())), 1.0)
    return out


def print_bytes(result: dict) -> None:
    rows = result["bytes"]["rows"]
    print(f"\nHLO bytes per device per step, {result['bytes']['shapes']} "
          f"({result['bytes']['params'] / 1e6:.1f}M params), {result['args']['replicas']} replicas "
          "(x: exact / this; two-level rows against exact two-level)")
    print(f"{'config':22s} {'RS MB':>8s} {'x':>6s} {'AG MB':>8s} {'x':>6s} {'total x':>8s} "
          f"{'slow MB':>8s} {'slow x':>7s} {'==plan':>7s}")
    for name, r in rows.items():
        print(f"{name:22s} {r['reduce_scatter'] / 1e6:8.2f} {r['rs_ratio']:6.2f} {r['all_gather'] / 1e6:8.2f} "
              f"{r['ag_ratio']:6.2f} {r['total_ratio']:8.2f} {r['slow_axis'] / 1e6:8.2f} "
              f"{r['slow_axis_ratio']:7.2f} {str(r['hlo_equals_analytic']):>7s}")


def print_summary(result: dict) -> None:
    if result["bytes"]["rows"]:
        print_bytes(result)
    runs = result.get("convergence", {}).get("runs", {})
    if runs:
        print(f"\nafter {result['args']['steps']} steps (slow x: exact / this on the slow axis; "
              "two-level runs against exact two-level when it ran)")
        print(f"{'config':22s} {'held-out':>9s} {'gap':>8s} {'train':>7s} {'KB/step':>9s} "
              f"{'slow KB':>8s} {'slow x':>7s} in-sync")
        for name, r in runs.items():
            print(f"{name:22s} {r['final_eval']:9.4f} {100 * r['gap_vs_exact']:+7.2f}% {r['final_train']:7.4f} "
                  f"{r['hlo_bytes_per_step'] / 1e3:9.1f} {r['slow_axis_bytes_per_step'] / 1e3:8.1f} "
                  f"{r['slow_axis_ratio_vs_exact']:7.2f} {r['replicas_in_sync']}")
    for t in result["targets"]:
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        print(f"  target: {t['target']}: {t['value']:.4g} (need {t['need']}) -> {verdict}")


if __name__ == "__main__":
    sys.exit(main())
