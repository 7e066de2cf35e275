"""The compiled accelerator program of every method, deviceless: HBM traffic, scratch, wire
bytes, kernels and the overlap of the exchange, against the exact step of the same run.

    pip install -e '.[aot]'     # jax[tpu] and jax[cuda12] at the pinned version
    python benchmarks/aot.py --target v5e:2x4 --model mlp21m
    python benchmarks/aot.py --target h100x8 --model gpt2s --methods exact,int8,sign
    python benchmarks/aot.py --target v5e:2x4 --model gpt2s --bucket-mb 16   # bucket_bytes=16 MB
    python benchmarks/aot.py --target v5e:2x4 --model gpt2s --bucket-mb 0    # one bucket

Every row takes the target's default options: on a TPU ``compressed_mean`` exchanges in
buckets (``bucket_bytes="auto"``, `commjax.bucketing.auto_bucket_bytes`), elsewhere in
one; ``--bucket-mb`` sets another size for every compressed mean.

For each method the update step (each replica's gradient in, parameters and state out;
`commjax.aot.compile_update`) is compiled for the target and read by `commjax.aot.analyze`.
Columns, per step and device (one replica):

* ``traffic``: HBM bytes of the compiled program (layout padding counted), and ``x exact``:
  its ratio to the exact step of the same family: for the means the exact mean as written
  without commjax (the ``pmean`` row: ``lax.pmean`` per leaf + SGD), so that a row's ratio
  does not move with commjax's own exact mean (the ``exact`` row,
  ``compressed_mean(cj.identity())`` + SGD, which also flags non-finite leaves and sums
  overflow-safe); for ZeRO rows exact ``cj.zero``, for FSDP rows exact FSDP;
* ``x ideal``: traffic over the one-pass ideal of the same program (inputs read once,
  outputs written once, each collective's buffers once);
* ``temp``: scratch bytes, and ``+grad``: ``(temp - the exact step's) / gradient bytes``;
* ``wire``: ring bytes of every collective; ``kernels``: the custom-call kernels;
* ``projected``: the alpha-beta step time on the target's fast and slow links
  (`commjax.aot`), and its ratio to the exact step's.

Writes ``benchmarks/results/aot_<target>_<model>.json`` (one file per configuration).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import commjax as cj  # noqa: E402
from commjax import _compat, aot, bench  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import commit, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: Bucket size of the in-backward rows: one 2048 x 2048 layer (16 MB) per bucket.
BUCKET_BYTES = 16 * 2 ** 20


def models() -> dict:
    """Parameter shapes (one replica) of the measured models."""
    f32 = jnp.float32
    s = jax.ShapeDtypeStruct

    def gpt(layers: int, d: int, vocab: int = 50304, ctx: int = 1024) -> dict:
        tree = {"wte": s((vocab, d), f32), "wpe": s((ctx, d), f32), "ln_f": s((d,), f32)}
        for i in range(layers):
            tree[f"h{i}"] = {"qkv": s((d, 3 * d), f32), "proj": s((d, d), f32), "fc": s((d, 4 * d), f32),
                             "out": s((4 * d, d), f32), "ln1": s((d,), f32), "ln2": s((d,), f32),
                             "b_fc": s((4 * d,), f32)}
        return tree

    return {
        "mlp21m": {"w1": s((4096, 4096), f32), "w2": s((4096, 1024), f32), "b1": s((4096,), f32)},
        "gpt2s": gpt(12, 768),
        "gpt1b": gpt(24, 2048),
    }


def mlp_train(layers: int = 8, width: int = 2048, batch: int = 64):
    """``(params, batch, loss)`` of an MLP whose backward pass could hide the exchange."""
    s = jax.ShapeDtypeStruct
    params = {f"w{i}": s((width, width), jnp.float32) for i in range(layers)}

    def loss(p, x):
        for i in range(layers):
            x = jnp.tanh(x @ p[f"w{i}"])
        return jnp.mean(x * x)

    return params, s((batch * 8, width), jnp.float32), loss


def gpt_train(layers: int = 12, d: int = 768, heads: int = 12, seq: int = 1024, batch: int = 8,
              vocab: int = 50304):
    """``(params, tokens, loss)`` of a GPT-2-small-shaped model (``batch`` sequences of
    ``seq`` tokens per replica, 8 replicas): the backward pass the exchange can hide in."""
    params = models()["gpt2s"] if (layers, d) == (12, 768) else None
    s = jax.ShapeDtypeStruct

    def norm(x):
        return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

    def block(h, p):
        b, t, _ = h.shape
        qkv = (norm(h) * p["ln1"]) @ p["qkv"]
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in jnp.split(qkv, 3, axis=-1))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        h = h + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, t, d) @ p["proj"]
        return h + jax.nn.gelu((norm(h) * p["ln2"]) @ p["fc"] + p["b_fc"]) @ p["out"]

    def loss(p, tokens):
        h = p["wte"][tokens[:, :-1]] + p["wpe"][: tokens.shape[1] - 1]
        for i in range(layers):
            h = block(h, p[f"h{i}"])
        logits = (norm(h) * p["ln_f"]) @ p["wte"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return params, s((8 * batch, seq + 1), jnp.int32), loss


TRAIN_MODELS = {"mlp8x2048": mlp_train, "gpt2s": gpt_train}


def measure_train(target: str, names: list, model: str = "gpt2s") -> list:
    """The overlap of each method's exchange with the backward pass of a train model."""
    params, batch, loss = TRAIN_MODELS[model]()
    mesh = aot.target_mesh(target)
    table = methods()  # one bucket on every target: the exchange after the backward pass
    in_backward = {"int8_in_backward": cj.quantize(8), "int4_in_backward": cj.quantize(4),
                   "sign_in_backward": cj.sign(), "powersgd_r4_in_backward": cj.powersgd(4)}
    rows = []
    for name in names:
        if name in in_backward:
            sync = cj.sync_in_backward(in_backward[name], "data", bucket_bytes=BUCKET_BYTES)
            compiled = aot.compile_train(loss, optax.sgd(0.1), params, batch, mesh, sync=sync)
        else:
            compiled = aot.compile_train(loss, table[name][0], params, batch, mesh)
        rep = aot.analyze(compiled, target)
        rows.append({"method": name, "overlapped_fraction": rep["overlapped_fraction"],
                     "wire": rep["wire"], "async": rep["async"], "traffic": rep["traffic"],
                     "temp": rep["temp"], "async_collectives": len(rep["async"]),
                     "matmuls_between": sum(a["matmuls"] for a in rep["async"])})
        print(f"  {name}: {100 * rep['overlapped_fraction']:.0f}% of the exchanged bytes overlapped; "
              + ", ".join(f"{r['matmuls']}" for r in rep["async"]) + " matmuls between start and done", flush=True)
    return rows


#: The compressed means measured: name -> (codec, compressed_mean options).
MEANS = {
    "exact": (cj.identity(), {}),
    "bf16": (cj.cast(jnp.bfloat16), {}),
    "int8": (cj.quantize(8), {}),
    "int4": (cj.quantize(4), {}),
    "sign": (cj.sign(), {}),
    "fp8": (cj.fp8(), {}),
    "top_k_1pct": (cj.top_k(0.01), {}),
    "powersgd_r4": (cj.powersgd(4), {}),
    # int8 with one default after another switched off: what each costs in the step.
    "int8_nearest": (cj.quantize(8, stochastic=False), {}),
    "int8_nearest_no_guard": (cj.quantize(8, stochastic=False), {"check_finite": False}),
    "int8_nearest_no_guard_no_feedback": (cj.quantize(8, stochastic=False), {
        "check_finite": False, "error_feedback": False, "server_error_feedback": False}),
    "int8_pallas": (cj.quantize(8, kernels="pallas"), {}),
    "int4_pallas": (cj.quantize(4, kernels="pallas"), {}),
    "sign_pallas": (cj.sign(kernels="pallas"), {}),
    "fp8_pallas": (cj.fp8(kernels="pallas"), {}),
}
#: ``<name>_reset``: the same, with a non-finite step's residuals zeroed instead of kept.
MEANS |= {f"{name}_reset": (MEANS[name][0], {**MEANS[name][1], "check_finite": "reset"})
          for name in ("bf16", "int8", "int4", "sign", "fp8", "powersgd_r4")}


def methods(bucket_bytes: Any = None, residual_dtype: Any = jnp.float32, *, chosen: bool = False) -> dict:
    """name -> (transform, family): the family names the exact row it is compared with.
    Every compressed mean runs in buckets of ``bucket_bytes`` (``None``: one bucket) and
    keeps its residuals in ``residual_dtype``. By default (``chosen=False``) that is the
    target's default (``auto_bucket_bytes``), taken by every mean, commjax's exact one
    too, beside the ZeRO rows. A size the command chose (``chosen``, ``--bucket-mb``)
    leaves the ``exact`` row in one bucket, adds the exact mean in those buckets
    (``exact_bucketed``) and has no ZeRO rows."""
    sgd = optax.sgd(0.1)

    def mean(codec, options, buckets=bucket_bytes):
        options = {"residual_dtype": residual_dtype, **options}
        return optax.chain(cj.compressed_mean(codec, "data", bucket_bytes=buckets, **options), sgd), "mean"

    exact_buckets = None if chosen else bucket_bytes
    rows = {name: mean(*spec, buckets=exact_buckets if name == "exact" else bucket_bytes)
            for name, spec in MEANS.items()}
    # The exact mean as users write it without commjax, beside commjax's own exact mean
    # (which sums pre-scaled values and flags non-finite leaves, at a cost in HBM traffic).
    head = {"exact": rows.pop("exact"), "pmean": (optax.chain(bench.plain_mean(), sgd), "mean")}
    if chosen:
        return head | ({} if bucket_bytes is None else {"exact_bucketed": mean(*MEANS["exact"])}) | rows
    adam = optax.adam(1e-3)
    return head | rows | {
        "zero_exact": (cj.zero(adam, "data"), "zero"),
        "zero_int8": (cj.zero(adam, "data", grad_codec=cj.quantize(8), weight_codec=cj.quantize(8)), "zero"),
        "zero_q4_qwd4": (cj.zero(adam, "data", grad_codec=cj.quantize(4), weight_codec=cj.quantize(4)), "zero"),
        "zero_int8_pallas": (cj.zero(adam, "data", grad_codec=cj.quantize(8, kernels="pallas"),
                                     weight_codec=cj.quantize(8, kernels="pallas")), "zero"),
        "zero_q4_qwd4_pallas": (cj.zero(adam, "data", grad_codec=cj.quantize(4, kernels="pallas"),
                                        weight_codec=cj.quantize(4, kernels="pallas")), "zero"),
    }


def default_buckets(target: str, model: str) -> Any:
    """The bucket size ``compressed_mean(bucket_bytes="auto")`` takes for ``model`` on
    ``target``'s platform (``None``: one bucket)."""
    return aot.target_bucket_bytes(target, models()[model])


def measure(target: str, model: str, names: list, dump: Any = None, table: Any = None) -> list:
    """Each of ``names`` from ``table`` (``methods()`` by default) compiled and analyzed."""
    params = models()[model]
    mesh = aot.target_mesh(target)
    grad_bytes = sum(4 * a.size for a in jax.tree_util.tree_leaves(params))
    table = methods() if table is None else table
    rows = []
    for name in names:
        tx, family = table[name]
        t0 = time.perf_counter()
        try:
            compiled = aot.compile_update(tx, params, mesh)
            rep = aot.analyze(compiled, target)
            if dump:
                Path(dump).mkdir(parents=True, exist_ok=True)
                Path(dump, f"{target.replace(':', '_')}_{model}_{name}.hlo").write_text(compiled.as_text())
            del compiled
        except Exception as e:  # noqa: BLE001 - a method that does not compile is a result
            rows.append({"method": name, "family": family, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"  {name}: does not compile: {rows[-1]['error'][:160]}", flush=True)
            continue
        finally:
            # One program at a time: a 1.3B tree's compiled step and the traces behind
            # it hold several GB, and the next method's compile needs them.
            gc.collect()
            jax.clear_caches()
        rep.update(method=name, family=family, compile_s=time.perf_counter() - t0, grad_bytes=grad_bytes)
        rows.append(rep)
        print(f"  {name}: traffic {rep['traffic'] / 1e6:.1f} MB, temp {rep['temp'] / 1e6:.1f} MB, "
              f"wire {rep['wire'] / 1e6:.2f} MB ({rep['compile_s']:.0f} s)", flush=True)
    _ratios(rows)
    return rows


#: Codecs of the FSDP rows (weights, gradients): ZeRO++'s qwZ + qgZ and an int4 variant.
FSDP = {"fsdp_exact": (None, None),
        "fsdp_int8": (cj.quantize(8, stochastic=False), cj.quantize(8)),
        "fsdp_int8_int4": (cj.quantize(8, stochastic=False), cj.quantize(4))}


def measure_fsdp(target: str, model: str, names: list) -> list:
    """``cj.fsdp_gather`` of every leaf of ``model`` and its VJP, compiled per device on
    the 1-D mesh: the gather and the gradient's reduce-scatter with each row's codecs. The
    loss multiplies each matrix by 16 rows of activations (so that the gathered weights
    are materialized, as a layer's matmul needs them) and squares the vectors."""
    mesh = aot.target_mesh(target)
    params = models()[model]
    n = mesh.devices.size
    like = cj.fsdp_like(params)
    shards = jax.eval_shape(lambda p: cj.fsdp_shard(p, n, align=256), params)
    specs = cj.fsdp_specs(shards, "data")
    place = lambda a, sp: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, sp))  # noqa: E731
    acts = jax.tree_util.tree_map(lambda w: jax.ShapeDtypeStruct((16, w.shape[0]) if w.ndim == 2 else (1,), w.dtype),
                                  params)
    args = (jax.tree_util.tree_map(place, shards, specs), jax.tree_util.tree_map(lambda a: place(a, P()), acts))

    def term(w, x):
        return jnp.sum(jnp.tanh(x @ w)) if w.ndim == 2 else jnp.sum(w * w)

    rows = []
    for name in names:
        codec, grad_codec = FSDP[name]

        def local(sh, xs):
            def loss(s):
                full = cj.fsdp_gather(s, "data", codec, grad_codec=grad_codec, like=like,
                                      key=jax.random.PRNGKey(0))
                return sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(term, full, xs)))
            return jax.grad(loss)(sh)

        fn = jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=specs, check_vma=False))
        with aot.traced_for(mesh):
            rep = aot.analyze(fn.lower(*args).compile(), target)
        rep.update(method=name, family="fsdp", grad_bytes=sum(4 * a.size for a in jax.tree_util.tree_leaves(params)))
        rows.append(rep)
        print(f"  {name}: traffic {rep['traffic'] / 1e6:.1f} MB, temp {rep['temp'] / 1e6:.1f} MB, "
              f"wire {rep['wire'] / 1e6:.2f} MB", flush=True)
    _ratios(rows)
    return rows


def _measure_one(target: str, model: str, name: str, dump: Any, bucket: Any, residual_dtype: str,
                 chosen: bool) -> dict:
    """One row of ``measure``, in a process of its own (``--isolate``)."""
    return measure(target, model, [name], dump, methods(bucket, jnp.dtype(residual_dtype), chosen=chosen))[0]


def measure_isolated(target: str, model: str, names: list, dump: Any, bucket: Any,
                     residual_dtype: str, chosen: bool) -> list:
    """``measure``, each method compiled in a fresh process: what one compile of a 1e9-
    parameter tree leaves behind is freed with the process, so the next fits in memory."""
    table_ = methods(bucket, jnp.dtype(residual_dtype), chosen=chosen)
    rows = []
    for name in names:
        with concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn")) as pool:
            family = table_[name][1]
            try:
                rows.append(pool.submit(_measure_one, target, model, name, dump, bucket, residual_dtype,
                                            chosen).result())
            except concurrent.futures.process.BrokenProcessPool:
                rows.append({"method": name, "family": family,
                             "error": "the compiling process died (out of memory?)"})
                print(f"  {name}: {rows[-1]['error']}", flush=True)
    _ratios(rows)
    return rows


def _ratios(rows: list) -> None:
    base = {"mean": "pmean", "zero": "zero_exact", "fsdp": "fsdp_exact"}
    by = {r["method"]: r for r in rows if "error" not in r}
    for r in rows:
        if "error" in r or "family" not in r:  # train-step rows: no ratios
            continue
        e = by.get(base[r["family"]])
        r["over_ideal"] = r["traffic"] / r["ideal"] if r["ideal"] else float("nan")
        if e is None:
            continue
        r["over_exact"] = r["traffic"] / e["traffic"]
        r["temp_over_exact_in_grads"] = (r["temp"] - e["temp"]) / r["grad_bytes"]
        for link in ("fast", "slow"):
            r[f"projected_{link}_vs_exact"] = r[f"projected_{link}_s"] / e[f"projected_{link}_s"]


def table(rows: list) -> str:
    w = max([14] + [len(r["method"]) for r in rows])
    head = (f"{'method':{w}} {'traffic MB':>10} {'x exact':>7} {'x ideal':>7} {'temp MB':>8} {'+grad':>6} "
            f"{'wire MB':>8} {'fast x':>7} {'slow x':>7}  kernels")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:{w}} does not compile: {r['error'][:90]}")
            continue
        lines.append(
            f"{r['method']:{w}} {r['traffic'] / 1e6:10.1f} {r.get('over_exact', float('nan')):7.2f} "
            f"{r['over_ideal']:7.2f} {r['temp'] / 1e6:8.1f} {r.get('temp_over_exact_in_grads', float('nan')):6.2f} "
            f"{r['wire'] / 1e6:8.2f} {r.get('projected_fast_vs_exact', float('nan')):7.2f} "
            f"{r.get('projected_slow_vs_exact', float('nan')):7.2f}  {','.join(r['kernels']) or '-'}")
    return "\n".join(lines)


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="v5e:2x4", choices=sorted(aot.TARGETS))
    ap.add_argument("--model", default="mlp21m", choices=sorted(set(models()) | set(TRAIN_MODELS)),
                    help="the update step's parameters, or with --train the train model (default gpt2s)")
    ap.add_argument("--methods", default=None, help="comma-separated rows (default: all)")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="every compressed mean in buckets of this many MB (compressed_mean("
                         "bucket_bytes=...)), written to aot_<target>_<model>_b<MB>m.json; 0: one "
                         "bucket (aot_<target>_<model>_onebucket.json); default: the target's default "
                         "(compressed_mean(bucket_bytes='auto'): buckets on a TPU, one on a GPU)")
    ap.add_argument("--residual-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compressed_mean(residual_dtype=...) of every compressed mean; bfloat16 "
                         "is written to aot_<target>_<model>[_b<MB>m]_bf16res.json")
    ap.add_argument("--dump", default=None, help="also write each compiled HLO into this folder")
    ap.add_argument("--isolate", action="store_true",
                    help="compile each method in a process of its own (1e9-parameter trees: one "
                         "compile's leftovers would not leave room for the next in 24 GB)")
    ap.add_argument("--update", action="store_true",
                    help="measure only --methods (and the exact baseline) and replace those rows of "
                         "the existing result file, keeping its other rows (each row says its commit)")
    ap.add_argument("--train", action="store_true",
                    help="the train step of a model (--model gpt2s or mlp8x2048): overlap of the "
                         "exchange with the backward pass")
    ap.add_argument("--fsdp", action="store_true",
                    help="cj.fsdp_gather of the model's leaves and its VJP (rows: " + ", ".join(FSDP) + ")")
    args = ap.parse_args(argv)
    if args.train:
        return _main_train(args, argv)
    if args.update and args.methods is None:
        ap.error("--update replaces the rows of --methods: name them")
    if args.fsdp:
        rows = measure_fsdp(args.target, args.model, list(FSDP) if args.methods is None else args.methods.split(","))
        print(table(rows))
        return _write(f"fsdp_{args.model}", args.target, args.model, rows, argv, args.update)
    chosen = args.bucket_mb is not None
    bucket = (default_buckets(args.target, args.model) if not chosen
              else int(args.bucket_mb * 2 ** 20) if args.bucket_mb > 0 else None)
    table_ = methods(bucket, jnp.dtype(args.residual_dtype), chosen=chosen)
    names = list(table_) if args.methods is None else args.methods.split(",")
    if any(table_[n][1] == "mean" for n in names):  # the base and commjax's exact mean
        names = [n for n in ("exact", "pmean") if n not in names] + names
    if args.isolate:
        rows = measure_isolated(args.target, args.model, names, args.dump, bucket, args.residual_dtype, chosen)
    else:
        rows = measure(args.target, args.model, names, args.dump, table_)
    print(table(rows))
    suffix = ("" if not chosen else "_onebucket" if bucket is None else f"_b{args.bucket_mb:g}m") + (
        "_bf16res" if args.residual_dtype == "bfloat16" else "")
    return _write(f"{args.model}{suffix}", args.target, args.model, rows, argv, args.update)


def _write(config: str, target: str, model: str, rows: list, argv: Any, update: bool = False) -> int:
    """``aot_<target>_<config>.json``: the rows and the command that wrote them; with
    ``update`` the existing file's rows with these replaced (``_updated``)."""
    out = RESULTS / f"aot_{target.replace(':', '_')}_{config}.json"
    command = "python benchmarks/aot.py " + " ".join(sys.argv[1:] if argv is None else argv)
    measured_at = commit()
    for r in rows:
        r["commit"] = measured_at
    record = {"target": target, "model": model, "jax": jax.__version__, "rows": rows}
    if update:
        old = json.loads(out.read_text())
        record, command = _updated(old, rows, command), old["command"]
    write_results(out, record, command=command)
    return 0


def _updated(old: dict, rows: list, command: str) -> dict:
    """``old``'s record with ``rows`` in place of its rows of the same methods (new ones
    appended) and the ratios taken again; ``command`` stays the one that measures every
    row, this one is listed under ``updates``."""
    new = {r["method"]: r for r in rows}
    merged = [new.pop(r["method"], r) for r in old["rows"]] + list(new.values())
    for r in merged:
        r.setdefault("commit", old.get("commit"))
    _ratios(merged)
    keep = {k: v for k, v in old.items() if k not in ("command", "commit", "date", "machine", "rows")}
    # A command run again moves to the end: listed once, where its rows were measured.
    keep["updates"] = [c for c in old.get("updates", []) if c != command] + [command]
    return keep | {"rows": merged}


def _main_train(args: argparse.Namespace, argv: Any) -> int:
    default = "pmean,exact,int8,int8_in_backward,int4,int4_in_backward,sign,sign_in_backward,powersgd_r4,powersgd_r4_in_backward"
    names = (default if args.methods is None else args.methods).split(",")
    model = args.model if args.model in TRAIN_MODELS else "gpt2s"
    rows = measure_train(args.target, names, model)
    return _write(f"train_{model}", args.target, f"{model} train step", rows, argv, args.update)


if __name__ == "__main__":
    sys.exit(main())
