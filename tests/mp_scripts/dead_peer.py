"""Worker: a psum loop in which one process dies with ``os._exit(3)`` after step 0.

    dead_peer.py [--die PROCESS_ID] [--steps N] [--sleep S]

Survivors keep calling the collective; the test checks that they do not hang.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--die", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--sleep", type=float, default=0.2)
    ns = parser.parse_args()

    import _worker

    ctx = _worker.setup()
    import jax
    from jax.sharding import PartitionSpec as P

    step_fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x[0], ctx.axis_name),
                                    mesh=ctx.mesh, in_specs=P(ctx.axis_name), out_specs=P()))
    g = ctx.global_device_count
    x = _worker.shard_rows(ctx, np.ones((g, 4), np.float32)[ctx.local_rows])
    for step in range(ns.steps):
        total = np.asarray(step_fn(x))
        assert np.all(total == g), total
        print(f"step {step} ok", flush=True)
        if step == 0 and ctx.process_id == ns.die:
            print(f"process {ctx.process_id}: dying with os._exit(3)", flush=True)
            sys.stderr.flush()
            os._exit(3)
        time.sleep(ns.sleep)
    _worker.emit({"process_id": ctx.process_id, "steps": ns.steps})


if __name__ == "__main__":
    main()
