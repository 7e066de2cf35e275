"""Training across datacenters on the char LM: held-out loss against bytes on the wire.

Eight workers (8 forced CPU devices), each with its own random windows of the Python
standard library's source, train the same small character Transformer for the same
number of inner steps with:

* ``dp_adam``: Adam after the exact fp32 gradient mean at every step (the baseline);
* ``diloco_fp32`` / ``diloco_q4``: :func:`commjax.diloco` (Adam inner, Nesterov outer
  lr 0.7 momentum 0.9), one sync every ``H`` steps, fp32 or 4-bit pseudo-gradients;
* ``sd_P{p}_t{tau}_{fp32,q4}``: :func:`commjax.streaming_diloco` with ``p`` fragments,
  overlap ``tau`` (mix 0.5 when ``tau > 0``, else 0), fp32 or 4-bit outer gradients
  (``P = 1, tau = 0`` is not rerun: it equals the ``diloco`` rows bit for bit, as
  tests/test_streaming_diloco.py checks); ``sd_P4_t0_mix_*``: 4 fragments, no overlap, mix
  0.5 (separates the mix from the overlap);
* ``demo``: :func:`commjax.decoupled_momentum` (DeMo), with ``--demo-*`` settings recorded
  in its row (``benchmarks/demo_tuning.py`` chose the defaults).

Bytes per device are read from each method's compiled step (ring convention): the
collectives every step runs, plus each conditional branch once per round of ``H`` steps
(the fragment syncs), giving the average bytes per inner step and the peak of one
step; the analytic plan is printed beside them. Loss: the held-out loss of the
replicas' average parameters (equal to every replica's after a DiLoCo sync). Ratios are
to ``dp_adam`` and to ``diloco_fp32`` from the same run.

    python benchmarks/crossdc.py [--steps 500] [--only dp_adam,diloco_fp32] [--out benchmarks/results/crossdc.json]
    python benchmarks/crossdc.py --bytes-only --only sd_P4_t0_q4   # bytes of existing rows, no training
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

from _results import write_results  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import _charlm  # noqa: E402
import commjax as cj  # noqa: E402
from commjax import _compat  # noqa: E402
from commjax.accounting import parse_hlo_collectives  # noqa: E402

N = 8
AXIS = "data"


def _nesterov():
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


def methods(args) -> dict:
    """name -> (factory of the transformation, kind, fragments, compressor)."""
    lr, h, q4 = args.lr, args.sync_every, cj.quantize(bits=4, block_size=args.block_size)
    out = {
        "dp_adam": (lambda: optax.chain(cj.compressed_mean(cj.identity(), AXIS), optax.adam(lr)), "dp", 1, None),
        "diloco_fp32": (lambda: cj.diloco(optax.adam(lr), _nesterov(), sync_every=h), "diloco", 1, None),
        "diloco_q4": (lambda: cj.diloco(optax.adam(lr), _nesterov(), sync_every=h, compressor=q4),
                      "diloco", 1, q4),
    }
    for comp_name, comp in (("fp32", None), ("q4", q4)):
        for tau in (0, 1):
            for p in (1, 2, 4):
                if p == 1 and tau == 0:
                    continue  # diloco_fp32 / diloco_q4 bit for bit (tests/test_streaming_diloco.py)
                out[f"sd_P{p}_t{tau}_{comp_name}"] = (
                    lambda p=p, tau=tau, comp=comp: cj.streaming_diloco(
                        optax.adam(lr), _nesterov(), sync_every=h, fragments=p, overlap=tau,
                        mix=0.5 if tau else 0.0, compressor=comp), "diloco", p, comp)
        # mix 0.5 without overlap: separates the effect of the mix from that of tau.
        out[f"sd_P4_t0_mix_{comp_name}"] = (
            lambda comp=comp: cj.streaming_diloco(optax.adam(lr), _nesterov(), sync_every=h, fragments=4,
                                                  mix=0.5, compressor=comp), "diloco", 4, comp)
    out["demo"] = (lambda: cj.decoupled_momentum(args.demo_lr, beta=args.demo_beta, chunk_size=args.demo_chunk,
                                                 top_k=args.demo_top_k, axis_name=AXIS,
                                                 values_dtype=_VALUES[args.demo_values]), "dp", 1, None)
    return out


def make_steps(tx, mesh, state, graphdef):
    """``k`` training steps per call (a ``lax.scan`` over the leading axis of the
    batches ``[k, N, B, T + 1]``): one dispatch per ``k`` steps."""
    specs = cj.state_specs(state, AXIS)

    def one(carry, batch):
        p, s = carry
        loss, g = jax.value_and_grad(lambda q: _charlm.loss_fn(graphdef, q, batch[0]))(p)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), loss

    def body(p, s, batches):
        p = jax.tree_util.tree_map(lambda a: a[0], p)
        (p, s), losses = jax.lax.scan(one, (p, s), batches)
        return jax.tree_util.tree_map(lambda a: a[None], p), s, losses[None]

    return jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P(AXIS), specs, P(None, AXIS)),
                                     out_specs=(P(AXIS), specs, P(AXIS))))


def hlo_bytes(report, sync_every: int) -> dict:
    """Per-device ring bytes from the compiled steps: every step's (in the scan body,
    outside any conditional), each branch's, the average per inner step (each branch
    taken once per round of ``sync_every`` steps) and the peak step."""
    every = sum(c.ring_bytes for c in report if not c.in_conditional)
    branches: dict = {}
    for c in report:
        if c.in_conditional:
            branches[c.computation] = branches.get(c.computation, 0.0) + c.ring_bytes
    per = sorted(branches.values())
    return {"every_step": every, "branches": per,
            "per_inner_step": every + sum(per) / sync_every,
            "peak": every + (max(per) if per else 0.0),
            "dtypes": sorted(report.dtypes)}


def plan_bytes(name, kind, frags, comp, params, args) -> float:
    if kind == "diloco":
        tx = cj.streaming_diloco(optax.sgd(0.1), optax.sgd(0.1), sync_every=args.sync_every,
                                 fragments=frags, compressor=comp)
        return cj.communication_plan(tx, params, N).bytes_per_step
    if name == "demo":
        tx = cj.decoupled_momentum(0.1, chunk_size=args.demo_chunk, top_k=args.demo_top_k,
                                   values_dtype=_VALUES[args.demo_values])
        return cj.communication_plan(tx, params, N).bytes_per_step
    return cj.ring_bytes("all-reduce", 4 * _charlm.num_params(params), N)


def compile_method(make, mesh, graphdef, params, corpus, args):
    """The method's compiled ``eval_every`` steps, with its start (state, parameters),
    its batches and its HLO bytes (:func:`hlo_bytes`)."""
    tx = make()
    state = cj.shard_state(tx.init(params), mesh, AXIS)
    steps = make_steps(tx, mesh, state, graphdef)
    p = jax.device_put(jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (N,) + a.shape), params),
                       NamedSharding(mesh, P(AXIS)))
    batch_shard = NamedSharding(mesh, P(None, AXIS))
    batches_of = lambda t0: jax.device_put(np.stack([  # noqa: E731
        corpus.batch(args.seed, t, N * args.batch_size, args.seq_len).reshape(N, args.batch_size, -1)
        for t in range(t0, t0 + args.eval_every)]), batch_shard)
    t0 = time.perf_counter()
    compiled = steps.lower(p, state, batches_of(0)).compile()
    compile_s = time.perf_counter() - t0
    wire = hlo_bytes(parse_hlo_collectives(compiled.as_text()), args.sync_every)
    return compiled, state, p, batches_of, wire, compile_s


def train(name, make, mesh, graphdef, params, corpus, held_out, args) -> dict:
    compiled, state, p, batches_of, wire, compile_s = compile_method(make, mesh, graphdef, params, corpus, args)
    k = args.eval_every
    eval_loss = jax.jit(lambda q: _charlm.loss_fn(graphdef, jax.tree_util.tree_map(
        lambda a: jnp.mean(a, axis=0), q), held_out))
    evals, losses, t0 = [(0, float(eval_loss(p)))], [], time.perf_counter()
    for t in range(0, args.steps, k):
        p, state, loss = compiled(p, state, batches_of(t))
        jax.block_until_ready(p)
        losses.extend(np.mean(np.asarray(loss), axis=0).tolist())
        evals.append((t + k, float(eval_loss(p))))
    seconds = time.perf_counter() - t0
    return {"name": name, "bytes": wire, "eval": evals, "train_loss_last50": float(np.mean(losses[-50:])),
            "final_eval": evals[-1][1], "seconds": seconds, "compile_seconds": compile_s,
            "replicas_identical_at_end": bool(all(
                np.all(np.asarray(l) == np.asarray(l)[:1]) for l in jax.tree_util.tree_leaves(jax.device_get(p))))}


def _ratio(a: float, b: float):
    return round(a / b, 3) if b else None


def targets(rows: dict, h: int) -> list:
    """The issue's measured targets, each with its numbers and hit or miss."""
    out = []
    ref = rows.get("diloco_fp32")
    for name in ("sd_P4_t0_q4", "sd_P4_t1_q4"):
        if ref and name in rows:
            gap = rows[name]["final_eval"] / ref["final_eval"] - 1
            out.append({"target": f"{name} held-out loss within 2% of diloco_fp32", "gap": round(gap, 4),
                        "hit": gap <= 0.02})
            bytes_ratio = ref["bytes"]["per_inner_step"] / rows[name]["bytes"]["per_inner_step"]
            out.append({"target": f"{name} bytes/inner step >= 7.5x below diloco_fp32",
                        "ratio": round(bytes_ratio, 3), "hit": bytes_ratio >= 7.5})
            if "dp_adam" in rows:
                dp_ratio = rows["dp_adam"]["bytes"]["per_inner_step"] / rows[name]["bytes"]["per_inner_step"]
                out.append({"target": f"{name} bytes/inner step >= 7.5*H = {7.5 * h:g}x below dp_adam",
                            "ratio": round(dp_ratio, 1), "hit": dp_ratio >= 7.5 * h})
    if "demo" in rows and "dp_adam" in rows:
        gap = rows["demo"]["final_eval"] / rows["dp_adam"]["final_eval"] - 1
        out.append({"target": "demo held-out loss within 5% of dp_adam", "gap": round(gap, 4), "hit": gap <= 0.05})
    return out


def table(rows: dict) -> str:
    dp, dl = rows.get("dp_adam"), rows.get("diloco_fp32")
    head = f"{'method':16s} {'B/step (HLO)':>13s} {'plan':>10s} {'peak B':>10s} {'vs dp':>8s} {'vs diloco':>9s} " \
           f"{'held-out':>9s} {'gap dp':>8s} {'gap diloco':>10s} {'s':>6s}"
    lines = [head, "-" * len(head)]
    for r in rows.values():
        b = r["bytes"]["per_inner_step"]
        gap = lambda ref: f"{100 * (r['final_eval'] / ref['final_eval'] - 1):+.2f}%" if ref else "-"  # noqa: E731
        lines.append(
            f"{r['name']:16s} {b:13,.0f} {r['plan_bytes']:10,.0f} {r['bytes']['peak']:10,.0f} "
            f"{(dp['bytes']['per_inner_step'] / b if dp and b else float('nan')):7.1f}x "
            f"{(dl['bytes']['per_inner_step'] / b if dl and b else float('nan')):8.2f}x "
            f"{r['final_eval']:9.4f} {gap(dp):>8s} {gap(dl):>10s} {r['seconds']:6.0f}")
    return "\n".join(lines)


def plot(rows: dict, path: str, title: str) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for r in rows.values():
        steps = np.array([s for s, _ in r["eval"]])
        loss = np.array([v for _, v in r["eval"]])
        style = "-" if r["name"].startswith(("dp", "diloco", "demo")) else "--"
        ax1.plot(steps[1:] * r["bytes"]["per_inner_step"] / 1e6, loss[1:], style, label=r["name"])  # log x: no 0
        ax2.plot(steps, loss, style, label=r["name"])
    ax1.set_xscale("log")
    ax1.set_xlabel("MB sent per device (cumulative, HLO)")
    ax2.set_xlabel("inner step")
    for ax in (ax1, ax2):
        ax.set_ylabel("held-out loss (nats/char)")
        ax.grid(alpha=0.3)
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


_SETTINGS = ("steps", "sync_every", "lr", "batch_size", "seq_len", "d_model", "layers", "eval_every",
             "corpus_chars", "seed", "block_size")
# Only the demo row depends on these: each demo row records its own, so --append can
# rerun that row with other DeMo settings without retraining every other method.
_DEMO_SETTINGS = ("demo_lr", "demo_beta", "demo_chunk", "demo_top_k", "demo_values")
_VALUES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def rebytes(rows, chosen, all_methods, mesh, graphdef, params, corpus, args) -> dict:
    """``--bytes-only``: the rows of ``--out`` with the chosen methods' bytes read again
    from their compiled steps (and their plan); each such row says which fields are new."""
    for name in chosen:
        if name not in rows:
            raise SystemExit(f"error: --bytes-only: {name} has no row in {args.out} to update; train it first")
        make, kind, frags, comp = all_methods[name]
        wire = compile_method(make, mesh, graphdef, params, corpus, args)[4]
        rows[name]["bytes"], rows[name]["plan_bytes"] = wire, plan_bytes(name, kind, frags, comp, params, args)
        rows[name]["bytes_only"] = ("bytes and plan_bytes re-read from the compiled step by --bytes-only (the last "
                                    "command); eval, losses and seconds are those of this row's earlier training "
                                    "run, not re-measured")
        print(f"  {name}: {wire['per_inner_step']:,.0f} B/inner step, peak {wire['peak']:,.0f} B, branches "
              f"{[round(b) for b in wire['branches']]}, plan {rows[name]['plan_bytes']:,.1f}", flush=True)
    return rows


def _previous(args) -> tuple:
    """With ``--append`` (or ``--bytes-only``): the rows (and commands) of ``--out``, which must have been
    made with the same settings."""
    if not ((args.append or args.bytes_only) and os.path.exists(args.out)):
        return {}, []
    with open(args.out) as f:
        old = json.load(f)
    differ = [k for k in _SETTINGS if old["args"].get(k) != getattr(args, k)]
    if differ:
        raise SystemExit(f"error: --append to {args.out}, made with other settings: {differ}")
    return old["rows"], old.get("commands", [old["command"]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--block-size", type=int, default=512, help="block of the 4-bit outer gradients (one fp32 scale each)")
    # DeMo's defaults: the best of benchmarks/demo_tuning.py at the bytes of 32 fp32 coefficients
    # per 64 x 64 tile (48 bf16 ones cost the same: 4 bytes each with the index, not 6).
    ap.add_argument("--demo-lr", type=float, default=2e-3)
    ap.add_argument("--demo-beta", type=float, default=0.999)
    ap.add_argument("--demo-chunk", type=int, default=64)
    ap.add_argument("--demo-top-k", type=int, default=48)
    ap.add_argument("--demo-values", choices=sorted(_VALUES), default="bf16", help="DeMo's coefficient values on the wire")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per worker and step")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=25, help="steps per compiled call and between evaluations")
    ap.add_argument("--corpus-chars", type=int, default=400_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated method names (default: all)")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in --out (same settings) and add these: a long grid in several runs")
    ap.add_argument("--bytes-only", action="store_true",
                    help="compile the --only methods and replace their HLO and plan bytes in --out (same "
                         "settings), keeping the losses already there: no training")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "crossdc.json"))
    args = ap.parse_args(argv)
    if args.steps % args.eval_every:
        ap.error("--steps must be a multiple of --eval-every")
    mesh = _compat.make_mesh((N,), (AXIS,))
    corpus = _charlm.Corpus(args.corpus_chars)
    graphdef, params = _charlm.make_model(d_model=args.d_model, layers=args.layers, heads=2,
                                          seq_len=args.seq_len, seed=args.seed)
    held_out = jnp.asarray(corpus.eval_batch(128, args.seq_len))
    all_methods = methods(args)
    chosen = [m for m in args.only.split(",") if m] or list(all_methods)
    print(f"{_charlm.num_params(params):,} parameters, {N} workers x {args.batch_size} windows of "
          f"{args.seq_len}, {args.steps} steps, H = {args.sync_every}")
    rows, commands = _previous(args)
    if args.bytes_only:
        rows = rebytes(rows, chosen, all_methods, mesh, graphdef, params, corpus, args)
        chosen = []
    for name in chosen:
        make, kind, frags, comp = all_methods[name]
        rows[name] = train(name, make, mesh, graphdef, params, corpus, held_out, args)
        rows[name]["plan_bytes"] = plan_bytes(name, kind, frags, comp, params, args)
        if name == "demo":
            rows[name]["settings"] = {k: getattr(args, k) for k in _DEMO_SETTINGS}
        print(f"  {name}: held-out {rows[name]['final_eval']:.4f}, "
              f"{rows[name]['bytes']['per_inner_step']:,.0f} B/inner step, {rows[name]['seconds']:.0f} s", flush=True)
    print()
    print(table(rows))
    hits = targets(rows, args.sync_every)
    print()
    for t in hits:
        print(("HIT  " if t["hit"] else "MISS ") + t["target"] + "  " +
              ", ".join(f"{k}={v}" for k, v in t.items() if k not in ("target", "hit")))
    commands.append("python benchmarks/" + os.path.basename(__file__) + " " + " ".join(argv or sys.argv[1:]))
    payload = {"command": commands[-1], "commands": commands,
               "args": vars(args), "num_params": _charlm.num_params(params), "workers": N,
               "rows": rows, "targets": hits,
               "ratios": {n: {"bytes_vs_dp": _ratio(rows["dp_adam"]["bytes"]["per_inner_step"], r["bytes"]["per_inner_step"])
                              if "dp_adam" in rows else None,
                              "bytes_vs_diloco_fp32": _ratio(rows["diloco_fp32"]["bytes"]["per_inner_step"],
                                                             r["bytes"]["per_inner_step"]) if "diloco_fp32" in rows else None,
                              "loss_vs_dp": _ratio(r["final_eval"], rows["dp_adam"]["final_eval"]) if "dp_adam" in rows else None,
                              "loss_vs_diloco_fp32": _ratio(r["final_eval"], rows["diloco_fp32"]["final_eval"])
                              if "diloco_fp32" in rows else None}
                          for n, r in rows.items()}}
    write_results(args.out, payload)
    plot(rows, os.path.splitext(args.out)[0] + ".png",
         f"char LM, {N} workers, {args.steps} inner steps, H = {args.sync_every}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
