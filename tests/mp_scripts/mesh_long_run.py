"""Worker of tests/test_model_parallel_mesh.py: ``cj.data_parallel`` on a ``data x model``
= 4 x 2 mesh (examples/_pipeline_lm.py's char Transformer, heads and MLP columns split over
"model", manual over "data" only) for ``--steps`` steps, in a fresh process.

On CPU devices this program waited forever in a collective (then XLA aborted it) when
the CPU client had one thread per device (``commjax.launch.set_cpu_threads``): the test
runs it with the environment the tests set and a short collective timeout.
Prints ``done <steps>`` at the end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import argparse

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import _charlm
import _pipeline_lm as pl
import commjax as cj
from commjax import _compat


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    steps = p.parse_args().steps
    cfg = pl.Config(vocab=_charlm.VOCAB, stages=1, tensor=2, data=4, layers_per_stage=2)
    specs = jax.tree_util.tree_map(lambda sp: P(None, *sp[1:]), pl.param_specs(),
                                   is_leaf=lambda x: isinstance(x, P))
    mesh = _compat.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    params = jax.device_put(pl.init_params(cfg, 0), jax.tree_util.tree_map(
        lambda sp: NamedSharding(mesh, sp), specs, is_leaf=lambda x: isinstance(x, P)))
    windows = pl.Windows(_charlm.Corpus(200_000), 512, cfg.seq_len, 16, 0)
    tx = optax.chain(cj.compressed_mean(cj.quantize(4), "data"), optax.adam(3e-3))
    dp = cj.data_parallel(pl.reference_loss, tx, mesh)
    state = dp.init(params)
    for t in range(steps):
        state, _ = dp.step(state, windows.batch(t)[0])
    jax.block_until_ready(state)
    print("done", steps, flush=True)


if __name__ == "__main__":
    main()
