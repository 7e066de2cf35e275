"""examples/06_pipeline_lm.py (the 3-D data x stage x model char Transformer) end to end at
a small size, and the bit-identity of identity codecs with the exact run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from matplotlib import image
from xla_flags import compile_flags

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--d-model", "32", "--heads", "2", "--seq-len", "16", "--microbatches", "2",
         "--batch-size", "2", "--windows", "64", "--corpus-chars", "100000"]


def test_example_runs_and_compresses_every_axis(tmp_path):
    env = dict(os.environ, XLA_FLAGS=compile_flags(), MPLBACKEND="Agg", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "06_pipeline_lm.py"), "--steps", "3",
                           "--no-progress", "--out", str(tmp_path), *SMALL],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "pipeline_lm.json").read_text())["runs"]
    assert [r["label"] for r in runs][0] == "exact" and len(runs) == 2
    exact, mine = (r["axis_bytes"] for r in runs)
    assert exact["stage"] / mine["stage"] > 5  # h4 forward (7.8x), int8 backward (3.9x)
    assert exact["model"] / mine["model"] > 3.5 and exact["data"] / mine["data"] > 3  # small leaves go exact
    assert all(r["replicas_in_sync"] and np.isfinite(r["held_out"]) for r in runs)
    assert "gap to exact" in proc.stdout
    img = image.imread(tmp_path / "pipeline_lm.png")
    assert img.shape[0] >= 200 and float(np.std(img)) > 0.01


def test_identity_codecs_are_the_exact_run_bit_for_bit():
    sys.path.insert(0, str(ROOT / "examples"))
    import _pipeline_lm as pl

    cfg = pl.Config(vocab=20, d_model=16, heads=2, seq_len=8, microbatches=2, mb=2)
    tokens = np.random.default_rng(0).integers(0, 20, (cfg.data * cfg.microbatches * cfg.mb, 9)).astype(np.int32)
    ids = np.arange(tokens.shape[0], dtype=np.int32)
    out = []
    for name in ("none", "identity"):
        c = pl.codec(name)
        trainer = pl.Trainer(cfg, pl.Codecs(c, c, c, c), pl.make_mesh(cfg))
        state = trainer.init(0)
        losses = []
        for _ in range(2):
            state, loss = trainer.step(state, tokens, ids)
            losses.append(loss)
        out.append((losses, jax.device_get(state["params"])))
    assert out[0][0] == out[1][0]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(out[0][1]),
                                                    jax.tree_util.tree_leaves(out[1][1])))


def test_windows_on_replica_shards_keep_each_sample_on_its_replica():
    """replicas=2: every epoch each replica visits exactly its own fixed shard (so AQ-SGD's
    references on its devices are met again), in a new order; replicas=1 is unchanged."""
    sys.path.insert(0, str(ROOT / "examples"))
    import _pipeline_lm as pl

    class Corpus:
        train = np.arange(10_000) % 50

    w = pl.Windows(Corpus(), 64, 8, 16, seed=3, replicas=2)
    per_epoch = 64 // 16
    seen = {0: [], 1: []}
    for step in range(3 * per_epoch):
        tokens, ids = w.batch(step)
        np.testing.assert_array_equal(tokens, w.tokens[ids])
        for r in (0, 1):
            seen[r].append(ids[8 * r:8 * (r + 1)])
    for r in (0, 1):
        epochs = np.concatenate(seen[r]).reshape(3, -1)
        for e in epochs:
            assert sorted(e.tolist()) == sorted(w.shards[r].tolist())
        assert not np.array_equal(epochs[0], epochs[1])
    assert not set(w.shards[0].tolist()) & set(w.shards[1].tolist())
    one = pl.Windows(Corpus(), 64, 8, 16, seed=3)
    order = np.random.default_rng([3, 1]).permutation(64)[16:32]
    np.testing.assert_array_equal(one.batch(per_epoch + 1)[1], order)
