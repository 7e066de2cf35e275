"""cj.zero across processes: 2 processes x 4 CPU devices (gloo) give the parameters of
1 process x 8 devices running the same program, identical on every device of every process.

The worker (``tests/mp_scripts/zero_train.py``) trains a few steps with 4-bit gradients and
4-bit weight differences, on one axis and on two levels (the slow axis across the
processes, 8-bit on the fast one inside each).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from multiprocess import load_script, run_on_task

worker = load_script("zero_train")


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path: Path):
    processes, devices = 2, 4
    g = processes * devices
    results, task = run_on_task("zero_train.py", tmp_path, processes, devices)
    local = jax.devices()[:g]
    p0 = worker.flat(task.params)
    for name, c in worker.configs().items():
        digests = [d for r in results for d in r["configs"][name]["digests"]]
        assert len(digests) == g and len(set(digests)) == 1, f"{name}: copies differ"
        mesh = worker.make_mesh(local, c["axes"], processes)
        rows = lambda a: jax.device_put(a, NamedSharding(mesh, P(c["axes"])))  # noqa: E731
        want = worker.flat(worker.train(mesh, c["axes"], c["kw"], task, worker.STEPS, rows))
        got = np.asarray(results[0]["configs"][name]["params"], np.float32)
        # gloo's exact reduce-scatter (biases, the flag) may sum in another order: fp32 round-off.
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
        assert np.max(np.abs(want - p0)) > 1e3 * 1e-6, name
