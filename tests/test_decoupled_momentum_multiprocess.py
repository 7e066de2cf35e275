"""cj.decoupled_momentum (DeMo) across processes: 2 processes x 4 CPU devices (gloo) give
bit-identical parameters on all 8 replicas, equal to one process x 8 devices running the
same program (the all-gather moves words, and the decode sums them in replica order, so
no summation order depends on the process layout).

The worker is ``tests/mp_scripts/demo_train.py``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from commjax import _compat
from multiprocess import load_script, run_on_task

worker = load_script("demo_train")


@pytest.mark.multiprocess
def test_two_processes_match_one(tmp_path: Path):
    processes, devices = 2, 4
    g = processes * devices
    results, task = run_on_task("demo_train.py", tmp_path, processes, devices)
    digests = [d for r in results for d in r["digests"]]
    assert len(digests) == g and len(set(digests)) == 1, "replicas differ across processes"

    mesh = _compat.make_mesh((g,), (worker.AXIS,))
    sharding = NamedSharding(mesh, P(worker.AXIS))
    params = worker.train(mesh, task, worker.STEPS, lambda a: jax.device_put(a, sharding))
    ref = np.concatenate([np.asarray(l, np.float32)[0].ravel() for l in jax.tree_util.tree_leaves(params)])
    p0 = np.concatenate([np.asarray(l, np.float32).ravel() for l in jax.tree_util.tree_leaves(task.params)])
    assert np.max(np.abs(ref - p0)) > 1e-3  # it trained
    np.testing.assert_array_equal(np.asarray(results[0]["params"], np.float32), ref)
