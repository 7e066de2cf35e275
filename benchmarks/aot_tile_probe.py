"""How far a wire format in the TPU's tile order would take int8, measured deviceless.

    python benchmarks/aot_tile_probe.py --target v5e:2x4 --model mlp21m

A hand-written prototype of the two-phase int8 mean (not a commjax transform: no
stochastic rounding, no non-finite guard, no kernels), compiled for the target beside
commjax's exact and int8 steps of the same run (`commjax.aot`), to size the layout change
before it is made. Its format, for every 2-D leaf ``[R, C]`` with ``R % 8 == 0`` and
``C % 128 == 0`` (other leaves travel exact, as ``compressed_mean``'s 1-D leaves do):

* the leaf is read in the order of its ``(8, 128)`` tiles, as ``[R C / 128, 128]`` rows
  (``x.reshape(R/8, 8, C/128, 128).transpose(0, 2, 1, 3)``: a bitcast on a TPU);
* a block is two consecutive rows (256 values) with one fp32 scale ``max |x| / 127``, the
  scales in their own array, not beside each block's words;
* word ``[i, l]`` holds the codes of rows ``4i .. 4i+3`` at lane ``l`` (no small minor
  dimension anywhere);
* each leaf is encoded in place, only the words and scales of all leaves are joined, into
  one all-to-all and one all-gather (the same two collectives, and bytes, as commjax's
  two-phase reducer), with a worker and a server residual in the same row shape.

Writes ``benchmarks/results/aot_tile_probe_<target>_<model>.json``: each step's HBM
traffic, scratch and wire bytes, and their ratios to the exact step's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from commjax import _compat, aot  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import aot as aot_bench  # noqa: E402
from _results import write_results  # noqa: E402

LR = 0.1


def tiled(shape: tuple, n: int) -> bool:
    """Whether a leaf takes the tile-order format: 2-D, whole (8, 128) tiles, and its
    words (a quarter of its rows) cut into ``n`` equal chunks of whole rows."""
    return len(shape) == 2 and shape[0] % 8 == 0 and shape[1] % 128 == 0 and (shape[0] * shape[1] // 512) % n == 0


def to_rows(a: jax.Array) -> jax.Array:
    r, c = a.shape
    return a.reshape(r // 8, 8, c // 128, 128).transpose(0, 2, 1, 3).reshape(-1, 128)


def from_rows(v: jax.Array, shape: tuple) -> jax.Array:
    r, c = shape
    return v.reshape(r // 8, c // 128, 8, 128).transpose(0, 2, 1, 3).reshape(shape)


def encode(x: jax.Array):
    """``x[rows, 128]`` -> (words ``u32[rows/4, 128]``, scales ``f32[rows/2]``, decode)."""
    amax = jnp.max(jnp.abs(x), axis=1).reshape(-1, 2).max(axis=1)
    s = jnp.where(amax > 0, amax, 1.0) / 127.0
    per_row = jnp.repeat(s, 2)[:, None]
    q = jnp.clip(jnp.round(x / per_row), -127, 127)
    u = (q.astype(jnp.int32) + 128).astype(jnp.uint32).reshape(-1, 4, 128)
    words = u[:, 0] | (u[:, 1] << 8) | (u[:, 2] << 16) | (u[:, 3] << 24)
    return words, jnp.where(amax > 0, s, 0.0), q * per_row


def decode(words: jax.Array, s: jax.Array) -> jax.Array:
    q = jnp.stack([((words >> (8 * j)) & 0xFF).astype(jnp.int32) - 128 for j in range(4)], axis=1)
    return q.reshape(-1, 128).astype(jnp.float32) * jnp.repeat(s, 2)[:, None]


def _cuts(parts: list, axis: int) -> list:
    offs = np.cumsum([0] + [p.shape[axis] for p in parts])
    return list(zip(offs[:-1], offs[1:]))


def probe_step(params: dict, res: dict, srv: dict, grads: dict, n: int, axis: str = "data"):
    """One replica's update: ``params - LR * mean`` with the tile-order int8 two-phase mean."""
    g = {k: v[0] for k, v in grads.items()}
    keys = sorted(res)
    xs = {k: to_rows(g[k]) + res[k] for k in keys}
    enc = {k: encode(xs[k]) for k in keys}
    w_parts = [enc[k][0].reshape(n, -1, 128) for k in keys]  # one chunk per destination
    s_parts = [enc[k][1].reshape(n, -1) for k in keys]
    w = jax.lax.all_to_all(jnp.concatenate(w_parts, axis=1), axis, 0, 0)
    s = jax.lax.all_to_all(jnp.concatenate(s_parts, axis=1), axis, 0, 0)
    again, new_srv = {}, {}
    for k, (w0, w1), (s0, s1) in zip(keys, _cuts(w_parts, 1), _cuts(s_parts, 1)):
        mean = sum(decode(w[i, w0:w1], s[i, s0:s1]) for i in range(n)) / n + srv[k]
        w2, s2, dec = encode(mean)
        again[k], new_srv[k] = (w2, s2), mean - dec
    wg = jax.lax.all_gather(jnp.concatenate([again[k][0] for k in keys]), axis)
    sg = jax.lax.all_gather(jnp.concatenate([again[k][1] for k in keys]), axis)
    out = {k: v - LR * jax.lax.pmean(g[k], axis) for k, v in params.items() if k not in res}
    for k, (w0, w1), (s0, s1) in zip(keys, _cuts([again[k][0] for k in keys], 0),
                                      _cuts([again[k][1] for k in keys], 0)):
        mean = decode(wg[:, w0:w1].reshape(-1, 128), sg[:, s0:s1].reshape(-1))
        out[k] = params[k] - LR * from_rows(mean, params[k].shape)
    return out, {k: xs[k] - enc[k][2] for k in keys}, new_srv


def compile_probe(params, mesh, axis: str = "data"):
    """The compiled probe step for a parameter tree (taken as a flat dict of its leaves)."""
    params = {jax.tree_util.keystr(k): a for k, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    n = mesh.shape[axis]
    shard = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))  # noqa: E731
    rows = {k: a.size // 128 for k, a in params.items() if tiled(a.shape, n)}
    p = {k: shard(a.shape, P()) for k, a in params.items()}
    g = {k: shard((n,) + a.shape, P(axis)) for k, a in params.items()}
    res = {k: shard((n * r, 128), P(axis)) for k, r in rows.items()}
    srv = {k: shard((r, 128), P(axis)) for k, r in rows.items()}
    step = lambda p, e, es, g: probe_step(p, e, es, g, n, axis)  # noqa: E731
    fn = jax.jit(_compat.shard_map(step, mesh=mesh, in_specs=(P(), P(axis), P(axis), P(axis)),
                                   out_specs=(P(), P(axis), P(axis)), check_vma=False), donate_argnums=(0, 1, 2))
    with aot.traced_for(mesh):
        return fn.lower(p, res, srv, g).compile()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="v5e:2x4", choices=sorted(aot.TARGETS))
    ap.add_argument("--model", default="mlp21m", choices=sorted(aot_bench.models()))
    args = ap.parse_args(argv)
    params = aot_bench.models()[args.model]
    rows = aot_bench.measure(args.target, args.model, ["exact", "int8"])
    try:
        rep = aot.analyze(compile_probe(params, aot.target_mesh(args.target)), args.target)
        rep.update(grad_bytes=rows[0]["grad_bytes"])
    except Exception as e:  # noqa: BLE001 - a step that does not compile (or fit) is a result
        rep = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    rows.append({"method": "int8_tile_order", "family": "mean", **rep})
    aot_bench._ratios(rows)
    print(aot_bench.table(rows))
    out = aot_bench.RESULTS / f"aot_tile_probe_{args.target.replace(':', '_')}_{args.model}.json"
    write_results(out, {"command": "python benchmarks/aot_tile_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
                        "target": args.target, "model": args.model, "jax": jax.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
