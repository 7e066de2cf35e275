"""cj.streaming_diloco across processes: 2 processes x 4 CPU devices (gloo) give the
parameters of 1 process x 8 devices running the same program, with every fragment's
anchor bit-identical on every device of every process.

The worker (``tests/mp_scripts/streaming_diloco_train.py``) trains 4 steps with 2
fragments, overlap 1, mix 0.5 and 4-bit outer gradients: 2 workers (one per process, as
one datacenter each) whose 4 devices form an exact data-parallel group.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from multiprocess import load_script, run_on_task

worker = load_script("streaming_diloco_train")


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path: Path):
    processes, devices = 2, 4
    g = processes * devices
    results, task = run_on_task("streaming_diloco_train.py", tmp_path, processes, devices)
    p0 = worker.flat(task.params)
    for name, c in worker.configs().items():
        digests = [d for r in results for d in r["configs"][name]["anchor_digests"]]
        assert len(digests) == g and len(set(digests)) == 1, f"{name}: anchor copies differ"
        mesh = worker.make_mesh(jax.devices()[:g], c["axes"], processes)
        params, state = worker.train(mesh, c["axes"], task, worker.STEPS)
        workers = mesh.shape[c["axes"][0]]
        rows = {int(k): v for r in results for k, v in r["configs"][name]["rows"].items()}
        assert sorted(rows) == list(range(workers)), name
        # gloo's exact all-reduce may sum in another order than one process: fp32 round-off.
        for row, got in rows.items():
            ref = worker.flat([np.asarray(l)[row] for l in jax.tree_util.tree_leaves(jax.device_get(params))])
            np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=1e-5, atol=1e-6, err_msg=name)
            assert np.max(np.abs(ref - p0)) > 1e-3, name
        anchor = worker.flat(jax.device_get(state.anchor))
        np.testing.assert_allclose(np.asarray(results[0]["configs"][name]["anchor"], np.float32), anchor,
                                   rtol=1e-5, atol=1e-6, err_msg=name)
