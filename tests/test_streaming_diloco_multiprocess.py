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

from multiprocess import leftover_processes, load_script, run_workers

worker = load_script("streaming_diloco_train")
tasks = load_script("train_compressors")


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path: Path):
    processes, devices = 2, 4
    g = processes * devices
    task_file = tmp_path / "task.npz"
    tasks.save_task(tasks.make_task(g), str(task_file))
    run = run_workers("streaming_diloco_train.py", processes, devices, args=["--task", str(task_file)],
                      timeout=240.0, env={"XLA_FLAGS": "--xla_backend_optimization_level=0"},
                      check=True, stream=False)
    assert not leftover_processes(run.launch.pids)
    results = run.results
    assert [r["process_id"] for r in results] == list(range(processes))
    task = tasks.load_task(str(task_file))
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
