"""Every compressor through ``compressed_mean`` across real processes (jax.distributed).

One launch of 4 processes x 2 CPU devices (gloo over loopback TCP; two-process layouts
are covered by the zero, streaming DiLoCo and DeMo multi-process tests), running
``tests/mp_scripts/train_compressors.py``, which loops over all compressors and trains
the non-i.i.d. task of :mod:`commjax.testing` for a few steps with parameters kept per
replica. Checked for each compressor:

* every replica on every process holds bit-identical parameters (no replica drift
  across process boundaries: shared keys, replica-ordered sums, uint32 payloads);
* the loss went down and nothing is NaN;
* the compiled multi-process step sends exactly the analytic bytes of
  ``cj.communication_plan`` (HLO ring bytes, group size read from the replica
  groups spanning processes) and never uses reduce-scatter;
* for the exact mean (and PowerSGD when it exists) the result equals, to fp32
  summation-order round-off, a single process running the same program on a mesh of
  the same size (computed here, on the 8 forced local devices).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from commjax.testing import train
from multiprocess import leftover_processes, load_script, run_workers

#: Bound on one launch (each compiles ~10 steps in every process, on 2 shared cores).
LAUNCH_TIMEOUT_S = 240.0
#: Compressors whose multi-process result must match the single-process one.
REFERENCE_CHECKED = ("identity", "powersgd")


worker = load_script("train_compressors")


def _flat(params) -> np.ndarray:
    return np.concatenate([np.asarray(l, np.float32).ravel()
                           for l in jax.tree_util.tree_leaves(params)])


def _unflat(flat: np.ndarray, like):
    leaves, treedef = jax.tree_util.tree_flatten(like)
    out, pos = [], 0
    for leaf in leaves:
        size = int(np.prod(np.shape(leaf)))
        out.append(flat[pos:pos + size].reshape(np.shape(leaf)))
        pos += size
    assert pos == flat.size
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes,devices", [(4, 2)], ids=["4x2"])
def test_compressors_across_processes(processes, devices, tmp_path: Path):
    g = processes * devices
    task = worker.make_task(g)
    task_file = tmp_path / "task.npz"
    worker.save_task(task, str(task_file))
    run = run_workers("train_compressors.py", processes, devices,
                      args=["--task", str(task_file)], timeout=LAUNCH_TIMEOUT_S,
                      check=True, stream=False)
    assert not leftover_processes(run.launch.pids)

    names = list(worker.compressors())
    results = run.results
    for pid, res in enumerate(results):
        assert (res["process_id"], res["num_processes"], res["global_devices"]) == (
            pid, processes, g)
        assert sorted(res["compressors"]) == sorted(names), f"process {pid}"

    initial = task.global_loss(task.params)
    p0 = _flat(task.params)
    for name in names:
        per_proc = [res["compressors"][name] for res in results]
        # One parameter digest per local replica, on every process: all the same.
        digests = [d for r in per_proc for d in r["digests"]]
        assert len(digests) == g
        assert len(set(digests)) == 1, f"{name}: replicas differ across devices/processes"
        first = per_proc[0]
        assert first["finite"], name
        params = np.asarray(first["params"], np.float32)
        assert not np.array_equal(params, p0), f"{name}: parameters did not move"
        loss = task.global_loss(_unflat(params, task.params))
        assert np.isfinite(loss) and loss < initial, f"{name}: loss {initial} -> {loss}"
        # Bytes: the compiled cross-process program sends what the plan says.
        for r in per_proc:
            assert r["hlo_bytes"] == pytest.approx(r["plan_bytes"], rel=1e-9, abs=1e-6), (
                f"{name} ({r['reducer']}): HLO {r['hlo_bytes']} B vs plan {r['plan_bytes']} B")
            assert r["plan_bytes"] > 0
            assert not r["reduce_scatter"], f"{name} compiled a reduce-scatter"
        if not first["summed_payload"]:
            # Encoded payloads travel as unsigned words (only the exact bucket is f32).
            assert any(d.startswith("u") for d in first["hlo_dtypes"]), (name, first["hlo_dtypes"])

    # The same program on one process with a mesh of the same size.
    local = jax.devices()[:g]
    assert len(local) == g, "tests run with 8 forced CPU devices"
    checked = [n for n in REFERENCE_CHECKED if n in names]
    assert "identity" in checked
    for name in checked:
        tx = worker.make_tx(worker.compressors()[name]())
        ref = train(tx, task, worker.STEPS, devices=local, log_every=worker.STEPS)
        assert ref.replicas_identical, name
        want = _flat(ref.params)
        got = np.asarray(results[0]["compressors"][name]["params"], np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6,
                                   err_msg=f"{name}: multi-process differs from one process")
        # The tolerance is far below the change the steps made.
        assert np.max(np.abs(want - p0)) > 1e3 * 2e-6, name
