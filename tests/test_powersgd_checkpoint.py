"""PowerSGD training state through orbax: save mid-run, restore in a NEW process, continue,
and land bit-identically on the uninterrupted run (params, Q/P factors, residuals,
momentum, step counter)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from commjax.testing import flat_residual

WORKER = Path(__file__).resolve().parent / "mp_scripts" / "powersgd_resume.py"
BEFORE, AFTER = 3, 3  # steps before the checkpoint (warm-up included) and after it


def _load_worker():
    spec = importlib.util.spec_from_file_location("powersgd_resume", WORKER)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_resume_in_a_new_process_is_bit_identical(tmp_path):
    assert jax.device_count() >= 4
    w = _load_worker()
    finals, saved = {}, {}
    for variant in ("default", "alternating"):
        run = w.build(variant)
        params, opt_state = w.advance(run, run.params, run.opt_state, BEFORE)
        cm = opt_state[0]  # the CompressedMeanState, first in the chain
        assert int(cm.count) == BEFORE
        # The checkpoint is taken in the PowerSGD phase: the factors and per-replica
        # residuals it carries are non-trivial and differ between replicas.
        res = flat_residual(cm, w.N)
        assert np.any(res != 0) and not np.all(res == res[:1])
        saved[variant] = w.dump(params, opt_state)
        w.save(str(tmp_path / variant / "ckpt"), params, opt_state)
        # The restore helper on this side gives back exactly what was saved.
        back = w.dump(*w.restore(str(tmp_path / variant / "ckpt"), run))
        assert all(np.array_equal(back[k], saved[variant][k]) for k in saved[variant])
        finals[variant] = w.dump(*w.advance(run, params, opt_state, AFTER))

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--root", str(tmp_path), "--variants", "default", "alternating",
         "--steps", str(AFTER)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for variant, want in finals.items():
        got = dict(np.load(tmp_path / variant / "resumed.npz"))
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (variant, k)
            assert np.array_equal(got[k], want[k]), (variant, k)
        # ... and the run really moved on after the checkpoint.
        assert any(not np.array_equal(want[k], saved[variant][k]) for k in want)
