"""The encoders and the decode-and-sum alone, compiled deviceless for a TPU: the Pallas
kernels (``impl="pallas"``, lane rows) against the jnp references, and each against the
one-pass ideal.

    python benchmarks/aot_encode.py --target v5e:2x4

One bucket of ``--values`` fp32 values (16M by default) in blocks of 256 and its
error-feedback residual: int8 (stochastic, noise from a key) and fp8 e4m3 encode with
the new residual as output, and the decode-and-sum of 8 int8 payloads. HBM traffic of
each compiled program (``commjax._hlo_traffic``) and its ratio to the ideal: the
encoders read ``x`` and ``e`` and write the residual once, plus the wire rows; the
decode reads the 8 payloads and writes the sum once. Writes
``benchmarks/results/aot_encode_<target>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from commjax import _hlo_traffic as hlo  # noqa: E402
from commjax import aot, kernels  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import aot as aot_bench  # noqa: E402
from _results import write_results  # noqa: E402

BLOCK = 256


def programs(n: int) -> dict:
    """name -> (function of impl, input shapes, one-pass bytes)."""
    nb = n // BLOCK
    f32, u32 = jnp.float32, jnp.uint32
    rows_bytes = nb * 65 * 4  # [nb, 65] wire words

    def encode(codec, kw):
        def make(impl):
            def f(x, e, key):
                rows, res = codec(x.reshape(nb, BLOCK), residual=e.reshape(nb, BLOCK), output="residual",
                                  impl=impl, **kw(key))
                return rows.reshape(-1), res.reshape(-1)
            return f
        return make, [((n,), f32), ((n,), f32), ((2,), u32)], 12 * n + rows_bytes

    def decode_sum(impl):
        def f(rows):
            return kernels.decode_sum(rows, bits=8, block_size=BLOCK, offset=127, divisor=127,
                                      impl=impl).reshape(-1)
        return f

    return {
        "int8_encode": encode(kernels.quantize_blocks, lambda key: dict(bits=8, noise_key=key)),
        "fp8_encode": encode(kernels.fp8_blocks, lambda key: dict(fmt="e4m3")),
        "int8_decode_sum8": (decode_sum, [((8, nb, 65), u32)], 8 * rows_bytes + 4 * n),
    }


def measure(target: str, n: int) -> list:
    mesh = aot.target_mesh(target)
    rows = []
    for name, (make, shapes, ideal) in programs(n).items():
        for impl in ("pallas", "reference"):
            compiled = aot.compile_per_device(make(impl), mesh, *shapes)
            traffic = hlo.traffic(hlo.parse(compiled.as_text())).straight
            rows.append({"program": name, "impl": impl, "values": n, "traffic": traffic, "ideal": ideal,
                         "over_ideal": traffic / ideal})
            print(f"{name:18s} {impl:10s} {traffic / 1e6:9.1f} MB  {traffic / ideal:5.2f}x one pass", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="v5e:2x4", choices=sorted(t for t in aot.TARGETS if not t.startswith("h")))
    ap.add_argument("--values", type=int, default=1 << 24)
    args = ap.parse_args(argv)
    rows = measure(args.target, args.values)
    out = aot_bench.RESULTS / f"aot_encode_{args.target.replace(':', '_')}.json"
    write_results(out, {"command": "python benchmarks/aot_encode.py " + " ".join(sys.argv[1:] if argv is None else argv),
                        "target": args.target, "jax": jax.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
