"""Kernel benchmark and on-device bit-exactness check for :mod:`commjax.kernels`.

Benchmark (default): for each size (elements, 1M..256M by default; ``--max-size`` to
limit) times every kernel with ``impl="pallas"`` (``--impl``) and its pure-jnp reference
(``impl="reference"``), plus a device-to-device copy of the same number of bytes, each the median of
``--repeats`` device-synchronised runs after ``--warmup`` runs. Prints the achieved
bandwidth (the bytes the operation must move, divided by the time) and its fraction of
the copy's, and writes everything as JSON.

Bytes an operation must move, per element, for blocks of ``B`` (``--block``):

* ``quantize{8,4,2}_ef``: fused error feedback, stochastic rounding, residual out:
  reads ``x, u, e`` (12), writes the residual (4) and ``bits/8 + 4/B`` of payload;
* ``quantize4``: reads ``x, u`` (8), writes ``1/2 + 4/B``;
* ``sign_ef``: reads ``x, e`` (8), writes the residual (4) and ``1/8 + 4/B``;
* ``decode_sum4``: ``N`` (``--replicas``) payloads of ``n / N`` elements each (the chunks
  one replica receives in the two-phase reducer): reads ``1/2 + 4/B`` per payload
  element, writes 4 per output element.

``--check`` instead runs every kernel with ``impl="pallas"`` against ``impl="reference"``
on random inputs at awkward sizes and reports, per kernel, whether the outputs are the
same bits (and if not, how many values and by how many ulps they differ). Both run on
the same device, so this is the check that the compiled kernels (Mosaic GPU, Mosaic TPU)
agree with XLA's compilation of the reference there: the check a backend must pass
before it joins ``commjax.kernels.VERIFIED_BACKENDS`` (where ``auto`` runs the kernels).

Usage::

    python benchmarks/kernels.py --max-size 16M --out benchmarks/results/kernels_gpu.json
    python benchmarks/kernels.py --check --out benchmarks/results/kernels_check_gpu.json
    python benchmarks/kernels.py --impl interpret --max-size 1M --repeats 3   # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _results import write_results  # noqa: E402

from commjax import kernels, packing  # noqa: E402


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def timed(fn: Callable[..., Any], args: tuple, *, repeats: int, warmup: int) -> float:
    """Median seconds of ``fn(*args)`` (already jitted), each run synchronised."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def make_ops(n: int, block: int, replicas: int, key: jax.Array) -> dict:
    """name -> (function of (impl, *args), args, bytes moved)."""
    nb = n // block
    kx, ku, ke, kr = jax.random.split(key, 4)
    x = jax.random.normal(kx, (nb, block), jnp.float32)
    u = jax.random.uniform(ku, (nb, block), jnp.float32)
    e = 0.1 * jax.random.normal(ke, (nb, block), jnp.float32)
    per_scale = 4 / block
    ops = {}
    for bits in (8, 4, 2):
        ops[f"quantize{bits}_ef"] = (
            lambda impl, x, u, e, b=bits: kernels.quantize_blocks(x, bits=b, uniforms=u, residual=e,
                                                                  output="residual", impl=impl),
            (x, u, e), n * (16 + bits / 8 + per_scale))
    # Noise drawn from a key (in-kernel where the kernel reads lane rows): 12 bytes, not 16.
    ops["quantize8_ef_key"] = (
        lambda impl, x, e, k: kernels.quantize_blocks(x, bits=8, noise_key=k, noise_start=n, residual=e,
                                                      output="residual", impl=impl),
        (x, e, jax.random.key_data(ku)), n * (12 + 1 + per_scale))
    ops["quantize4"] = (lambda impl, x, u: kernels.quantize_blocks(x, bits=4, uniforms=u, output=None, impl=impl)[0],
                        (x, u), n * (8 + 0.5 + per_scale))
    ops["sign_ef"] = (lambda impl, x, e: kernels.sign_blocks(x, residual=e, output="residual", impl=impl),
                      (x, e), n * (12 + 1 / 8 + per_scale))
    chunk_blocks = max(nb // replicas, 1)
    row_words = packing.packed_words(block, 4) + 1
    rows = jax.random.bits(kr, (replicas, chunk_blocks, row_words), jnp.uint32)
    rows = rows.at[:, :, -1].set(jax.lax.bitcast_convert_type(
        jnp.abs(jax.random.normal(kr, (replicas, chunk_blocks))), jnp.uint32))
    m = chunk_blocks * block
    ops["decode_sum4"] = (lambda impl, r: kernels.decode_sum(r, bits=4, block_size=block, offset=7, divisor=7,
                                                              impl=impl),
                          (rows,), replicas * m * (0.5 + per_scale) + 4 * m)
    return ops


def benchmark(args) -> dict:
    sizes = []
    s = parse_size(args.min_size)
    while s <= parse_size(args.max_size):
        sizes.append(s)
        s *= 4
    results = []
    key = jax.random.PRNGKey(0)
    for n in sizes:
        n = n // args.block * args.block
        ops = make_ops(n, args.block, args.replicas, jax.random.fold_in(key, n))
        for name, (fn, fargs, nbytes) in ops.items():
            if args.kernels and name not in args.kernels:
                continue
            row = {"kernel": name, "elements": n, "bytes": nbytes}
            words = max(int(nbytes // 8), 1)  # a copy reads and writes nbytes / 2 each
            src = jnp.zeros((words,), jnp.uint32)
            copy = jax.jit(lambda a: a + jnp.uint32(1))
            row["copy_s"] = timed(copy, (src,), repeats=args.repeats, warmup=args.warmup)
            del src
            for label, impl in (("kernel", args.impl), ("reference", "reference")):
                f = jax.jit(functools.partial(fn, impl))
                try:
                    row[f"{label}_s"] = timed(f, fargs, repeats=args.repeats, warmup=args.warmup)
                except Exception as exc:  # report and go on with the other kernels
                    row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            copy_bw = nbytes / row["copy_s"]
            row["copy_GBps"] = copy_bw / 1e9
            for label in ("kernel", "reference"):
                if f"{label}_s" in row:
                    bw = nbytes / row[f"{label}_s"]
                    row[f"{label}_GBps"] = bw / 1e9
                    row[f"{label}_frac_copy"] = bw / copy_bw
            results.append(row)
            print(f"{name:>14} n={n:>11,d}  copy {row['copy_GBps']:8.1f} GB/s  "
                  + "  ".join(f"{lab} {row.get(lab + '_GBps', float('nan')):8.1f} GB/s "
                              f"({row.get(lab + '_frac_copy', float('nan')):.2f} of copy)"
                              for lab in ("kernel", "reference"))
                  + ("  ERROR " + row.get("kernel_error", "") if "kernel_error" in row else ""), flush=True)
        del ops
    return {"benchmark": results}


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    if a.dtype != np.float32:
        return -1
    ia = a.view(np.int32).astype(np.int64)
    ib = b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.max(np.abs(ia - ib))) if ia.size else 0


def check(args) -> dict:
    rng = np.random.default_rng(args.seed)
    out = []
    cases = [(1, 256), (127, 32), (4097, 256), (2 ** 20 + 3, 256), (3 * 2 ** 20 + 7, 1024)]
    for n, block in cases:
        if n > parse_size(args.max_size):
            continue
        nb = -(-n // block)
        x = rng.standard_normal(nb * block).astype(np.float32)
        x[n:] = 0
        x = jnp.asarray((x * np.repeat(10.0 ** rng.uniform(-3, 3, nb), block)).astype(np.float32).reshape(nb, block))
        u = jnp.asarray(rng.random((nb, block), np.float32))
        e = jnp.asarray((0.1 * rng.standard_normal((nb, block))).astype(np.float32))
        fns: dict[str, tuple] = {}
        for bits in (8, 4, 2):
            for stochastic in (True, False):
                for output in (None, "decoded", "residual"):
                    fns[f"quantize{bits}{'_sr' if stochastic else ''}_{output}"] = (
                        lambda impl, x, u, e, b=bits, s=stochastic, o=output: kernels.quantize_blocks(
                            x, bits=b, uniforms=u if s else None, residual=e if o == "residual" else None,
                            output=o, impl=impl),
                        (x, u, e))
        for bits in (8, 4, 2):  # the midrise grid (every code used)
            for stochastic in (True, False):
                fns[f"quantize{bits}_midrise{'_sr' if stochastic else ''}_residual"] = (
                    lambda impl, x, u, e, b=bits, s=stochastic: kernels.quantize_blocks(
                        x, bits=b, uniforms=u if s else None, residual=e, output="residual", midrise=True,
                        impl=impl),
                    (x, u, e))
        key = jnp.asarray(rng.integers(0, 2 ** 32, 2, dtype=np.uint32))
        for bits in (8, 4):  # noise drawn from a key: in-kernel by the lane-row kernel
            for output in (None, "residual"):
                for midrise in (False, True):
                    fns[f"quantize{bits}{'_midrise' if midrise else ''}_key_{output}"] = (
                        lambda impl, x, e, k, b=bits, o=output, m=midrise: kernels.quantize_blocks(
                            x, bits=b, noise_key=k, noise_start=n, residual=e if o else None, output=o,
                            midrise=m, impl=impl),
                        (x, e, key))
        for fmt in ("e4m3", "e5m2"):
            for noise in ("nearest", "key"):
                fns[f"fp8_{fmt}_{noise}_residual"] = (
                    lambda impl, x, e, k, f=fmt, z=noise: kernels.fp8_blocks(
                        x, fmt=f, residual=e, output="residual", impl=impl,
                        **(dict(noise_key=k, noise_start=n) if z == "key" else {})),
                    (x, e, key))
        for output in (None, "decoded", "residual"):
            fns[f"sign_{output}"] = (lambda impl, x, e, o=output: kernels.sign_blocks(
                x, residual=e if o == "residual" else None, output=o, impl=impl), (x, e))
        for codec, (bits, offset, step, divisor) in {
            "quantize8": (8, 127, 1, 127), "quantize4": (4, 7, 1, 7), "quantize2": (2, 1, 1, 1),
            "quantize4_midrise": (4, 15, 2, 15), "quantize2_midrise": (2, 3, 2, 3),
            "qsgd16": (6, 16, 1, 16), "terngrad": (2, 1, 1, None), "sign": (1, 1, 2, None),
        }.items():
            w = -(-block // 32)
            words = rng.integers(0, 2 ** 32, (8, nb, bits * w), dtype=np.uint32)
            scale = (np.abs(rng.standard_normal((8, nb, 1))) * 10.0 ** rng.uniform(-4, 4, (8, nb, 1))).astype(np.float32)
            rows = jnp.asarray(np.concatenate([words, scale.view(np.uint32)], axis=2))
            opts = dict(bits=bits, block_size=block, offset=offset, step=step, divisor=divisor)
            fns[f"decode_{codec}"] = (lambda impl, r, o=opts: kernels.decode_rows(r[0], impl=impl, **o), (rows,))
            fns[f"decode_sum_{codec}"] = (lambda impl, r, o=opts: kernels.decode_sum(r, impl=impl, **o), (rows,))
        for name, (fn, fargs) in fns.items():
            res = {}
            row = {"kernel": name, "elements": n, "block": block}
            for impl in (args.impl, "reference"):
                try:
                    res[impl] = jax.tree_util.tree_map(np.asarray, jax.jit(functools.partial(fn, impl))(*fargs))
                except Exception as exc:
                    row[f"{impl}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            if len(res) == 2:
                got = jax.tree_util.tree_leaves(res[args.impl])
                ref = jax.tree_util.tree_leaves(res["reference"])
                diffs = [int((g.view(np.uint32) != r.view(np.uint32)).sum()) if g.itemsize == 4 else int((g != r).sum())
                         for g, r in zip(got, ref)]
                row["identical"] = not any(diffs)
                row["values_differing"] = diffs
                row["max_ulps"] = [_ulps(g, r) if d else 0 for g, r, d in zip(got, ref, diffs)]
            out.append(row)
            status = "OK " if row.get("identical") else "DIFF"
            print(f"{status} {name:>28} n={n:>9,d} B={block:>5}  "
                  + (f"differing={row.get('values_differing')} max_ulps={row.get('max_ulps')}" if not row.get("identical") else "")
                  + " ".join(f" {k}={v}" for k, v in row.items() if k.endswith("_error")), flush=True)
    n_bad = sum(not r.get("identical", False) for r in out)
    print(f"{len(out) - n_bad} of {len(out)} kernel checks bit-identical to the reference")
    return {"check": out, "all_identical": n_bad == 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="bit-exactness check instead of the benchmark")
    p.add_argument("--impl", default="pallas", choices=("pallas", "interpret", "auto"),
                   help="kernel implementation to compare with the reference (default pallas)")
    p.add_argument("--min-size", default="1M")
    p.add_argument("--max-size", default="256M")
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", nargs="*", default=None, help="only these benchmark entries")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels[_check]_<platform>[_<impl>].json)")
    args = p.parse_args()
    backend = jax.default_backend()
    if backend == "cpu" and args.impl == "pallas":
        p.error("compiled Pallas kernels need a GPU or TPU; on CPU pass --impl interpret (slow, small sizes)")
    info = {
        "platform": backend,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "impl": args.impl,
        "block": args.block,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(json.dumps(info))
    result = check(args) if args.check else benchmark(args)
    result.update(info=info)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"kernels_{'check_' if args.check else ''}{backend}"
                                   f"{'' if args.impl == 'pallas' else '_' + args.impl}.json")
    write_results(out, result)
    return 0 if result.get("all_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
