"""The examples run end to end (small sizes, few steps) and their loss goes down.

Each example runs as a subprocess, as a user would start it, with ``--devices`` simulated
CPU devices. All runs of this module share one persistent compilation cache, so a program
compiled by one run (the char Transformer's step, say) is loaded by the next.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image
from xla_flags import compile_flags

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = ("01_digits_cnn.py", "02_char_transformer.py", "03_linen_mlp.py", "04_multiprocess.py",
           "demo.py")
SMALL_LM = ["--d-model", "32", "--layers", "1", "--seq-len", "32"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


def _env(cache_dir: Path) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = compile_flags()  # without the device count: the examples set theirs
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # compile faster; a few tiny steps only
    env["MPLBACKEND"] = "Agg"
    return env


def run_example(args: list, cache_dir: Path, *, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *map(str, args)], env=_env(cache_dir), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{args} exited {proc.returncode}\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def is_figure(path: Path) -> bool:
    """A PNG that decodes to an image of at least 300 x 200 pixels with more than one colour
    (a plot, not an empty canvas)."""
    img = image.imread(path)
    return img.ndim == 3 and img.shape[0] >= 200 and img.shape[1] >= 300 and float(np.std(img)) > 0.01


def decreased(losses) -> bool:
    losses = np.asarray(losses, np.float64)
    k = max(1, len(losses) // 5)
    return bool(np.all(np.isfinite(losses)) and losses[-k:].mean() < 0.9 * losses[:k].mean())


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    """--help works and imports no JAX (the device count is applied before JAX starts)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--help"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout and "--steps" in proc.stdout


def test_bad_option_is_named():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "02_char_transformer.py"), "--compressor", "zip"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--compressor" in proc.stderr and "quantize" in proc.stderr


def test_digits_cnn(tmp_path, cache_dir):
    proc = run_example([EXAMPLES / "01_digits_cnn.py", "--devices", "2", "--steps", "30",
                        "--batch-size", "16", "--bits", "8", "--out", tmp_path], cache_dir)
    out = json.loads((tmp_path / "digits_cnn.json").read_text())
    assert out["replicas"] == 2 and len(out["runs"]) == 1
    r = out["runs"][0]
    assert len(r["losses"]) == 30 and decreased(r["losses"])
    assert r["replicas_in_sync"] is True
    assert r["hlo_bytes_per_step"] == pytest.approx(r["bytes_per_step"], rel=1e-6)
    assert 0.0 <= r["final_eval"] <= 1.0
    # 8-bit codes + one fp32 scale per 256: at most 32 / 8.125 over the exact mean, less the
    # share of small leaves averaged exactly.
    assert 3.0 < r["compression_ratio"] <= 32 / 8.125
    assert r["compression_ratio"] == pytest.approx(r["baseline_bytes_per_step"] / r["bytes_per_step"])
    assert "test accuracy" in proc.stdout and "bytes/step/device" in proc.stdout
    assert "it/s" in proc.stderr or "s/it" in proc.stderr  # the tqdm progress bar
    assert is_figure(tmp_path / "digits_cnn.png")


def test_char_transformer_and_bit_identical_resume(tmp_path, cache_dir):
    common = [EXAMPLES / "02_char_transformer.py", "--devices", "2", *SMALL_LM, "--batch-size", "4",
              "--corpus-chars", "200000", "--no-progress", "--rounding", "nearest"]
    full, ckpt = tmp_path / "full", tmp_path / "ckpt"
    proc = run_example([*common, "--steps", "16", "--sample", "20", "--checkpoint-dir", ckpt,
                        "--checkpoint-every", "8", "--out", full], cache_dir)
    ref = json.loads((full / "char_transformer.json").read_text())["runs"][0]
    assert decreased(ref["losses"]) and ref["replicas_in_sync"] is True
    assert ref["compression_ratio"] > 5 and "sample:" in proc.stdout
    # Interrupted after the checkpoint at step 8 (the one at 16 never written), then
    # resumed to 16 in a new process: the same losses, bit for bit.
    steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())  # orbax: one folder a step
    assert steps == [8, 16], steps
    shutil.rmtree(ckpt / "16")
    part = tmp_path / "part"
    proc = run_example([*common, "--steps", "16", "--checkpoint-dir", ckpt, "--resume", "--out", part,
                        "--sample", "0"], cache_dir)
    assert "resumed from step 8" in proc.stdout
    resumed = json.loads((part / "char_transformer.json").read_text())["runs"][0]
    assert resumed["steps"] == list(range(9, 17))
    assert resumed["losses"] == ref["losses"][8:]  # bit-identical continuation


def _import_example_helpers():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import _charlm
        import _cli
        import _train
    finally:
        sys.path.remove(str(EXAMPLES))
    return _cli, _train, _charlm


def test_every_compressor_and_optimizer_choice_builds_a_working_step():
    """Each --compressor and --optimizer choice present in this commjax version gives a
    transform whose data-parallel step traces under shard_map (no compilation); absent
    ones fail with an error that names them."""
    import argparse

    import jax
    import jax.numpy as jnp

    _cli, _train, _charlm = _import_example_helpers()
    p = argparse.ArgumentParser()
    _cli.add_run_args(p, steps=20, batch_size=2, lr=1e-3)
    _cli.add_compression_args(p)
    graphdef, params = _charlm.make_model(d_model=32, layers=1, heads=4, seq_len=16, seed=0)
    mesh = _train.data_mesh(2)
    batch = jnp.zeros((4, 17), jnp.int32)
    choices = [["--compressor", c] for c in _cli.COMPRESSORS] + \
              [["--optimizer", o, "--compressor", "quantize"] for o in _cli.OPTIMIZERS]
    built = 0
    traced = set()
    for argv in choices:
        args = p.parse_args(argv)
        name = argv[1]
        if _train.find(name) is None and name not in ("identity", "cast", "quantize", "qsgd", "terngrad",
                                                        "sign", "adam", "adamw", "sgd", "momentum"):
            with pytest.raises(_train.MissingFeature, match=name):
                _train.make_setup(args, params, 2)
            continue
        setup = _train.make_setup(args, params, 2)
        assert setup.plan is not None or setup.bytes_per_step is not None, argv
        built += 1
        if argv[0] == "--compressor" and name not in ("quantize", "powersgd"):
            continue  # same compressed_mean code path: building it is enough here
        trainer = _train.DataParallel(lambda q, b: _charlm.loss_fn(graphdef, q, b), params, setup.tx, mesh,
                                      per_replica_params=setup.per_replica_params)
        _, (loss, _) = jax.eval_shape(trainer.dp.sharded_step, trainer.state, trainer.shard_batch(batch))
        assert loss.shape == (2,), argv  # one loss per replica
        traced.add(name)
    assert built >= 10 and {"quantize", "adam", "sgd"} <= traced


def test_demo_claim_holds_at_the_demo_size():
    """The demo's 4-bit run (nearest rounding, error feedback) sends at least 7x fewer
    bytes than the exact mean for the demo's model on 8 replicas (a static count)."""
    import commjax as cj

    _, _, _charlm = _import_example_helpers()
    spec = importlib.util.spec_from_file_location("demo", EXAMPLES / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)  # the module body only defines things
    runs = {label: (comp, opts) for label, comp, opts in demo.RUNS}
    comp, opts = runs["4-bit quantize"]
    assert comp == "quantize" and opts["bits"] == 4
    defaults = demo.build_parser().parse_args([])
    _, params = _charlm.make_model(d_model=defaults.d_model, layers=defaults.layers, heads=4,
                                   seq_len=defaults.seq_len, seed=0)
    plan = cj.communication_plan(cj.quantize(bits=4, block_size=opts.get("block_size", 256),
                                             stochastic=opts.get("rounding") != "nearest"), params, 8)
    assert plan.compression_ratio >= 7.0, plan.summary()
    defaults = demo.build_parser().parse_args([])
    assert (defaults.d_model, defaults.layers, defaults.devices) == (64, 2, 8)


def test_linen_mlp(tmp_path, cache_dir):
    run_example([EXAMPLES / "03_linen_mlp.py", "--devices", "2", "--steps", "30", "--hidden", "64",
                 "--compressor", "sign", "--optimizer", "sgd", "--lr", "0.3", "--out", tmp_path], cache_dir)
    r = json.loads((tmp_path / "linen_mlp.json").read_text())["runs"][0]
    assert decreased(r["losses"]) and r["replicas_in_sync"] is True
    assert r["compression_ratio"] > 4
    assert (tmp_path / "linen_mlp.png").exists()


@pytest.mark.multiprocess
def test_multiprocess_example_under_the_launcher_with_resume(tmp_path, cache_dir):
    """2 processes x 2 devices: 6 steps and a checkpoint (every process writes its own
    shards), then a new job resumes to 12. Both processes end with the same parameters."""
    launch = ["-m", "commjax.launch", "--processes", "2", "--devices-per-process", "2", "--timeout", "240",
              EXAMPLES / "04_multiprocess.py", *SMALL_LM, "--no-progress", "--checkpoint-dir", tmp_path / "ckpt"]
    run_example([*launch, "--steps", "6", "--out", tmp_path / "a"], cache_dir, timeout=300)
    first = json.loads((tmp_path / "a" / "multiprocess.json").read_text())["runs"][0]
    proc = run_example([*launch, "--steps", "12", "--resume", "--out", tmp_path / "b"], cache_dir, timeout=300)
    assert "resumed from step 6" in proc.stdout
    digests = [line.split("sha256 ")[1].split()[0] for line in proc.stdout.splitlines()
               if "final parameters sha256" in line]
    assert len(digests) == 2 and digests[0] == digests[1], proc.stdout[-2000:]
    r = json.loads((tmp_path / "b" / "multiprocess.json").read_text())
    assert r["processes"] == 2 and r["replicas"] == 4
    run = r["runs"][0]
    assert run["steps"] == list(range(7, 13))
    assert decreased(first["losses"] + run["losses"]) and run["replicas_in_sync"] is True
    assert run["hlo_bytes_per_step"] == pytest.approx(run["bytes_per_step"], rel=1e-6)


def test_demo_small(tmp_path, cache_dir):
    proc = run_example([EXAMPLES / "demo.py", "--devices", "2", "--steps", "10", "--only", "cast",
                        *SMALL_LM, "--no-progress", "--out", tmp_path], cache_dir)
    out = json.loads((tmp_path / "demo.json").read_text())
    labels = [r["label"] for r in out["runs"]]
    assert labels == ["exact fp32 mean", "bf16 cast"]
    for r in out["runs"]:
        assert len(r["losses"]) == 10 and decreased(r["losses"])
        assert r["replicas_in_sync"] is True
        assert r["hlo_bytes_per_step"] == pytest.approx(r["bytes_per_step"], rel=1e-6)
    exact, bf16 = out["runs"]
    assert exact["gap_to_exact"] == 0.0 and abs(bf16["gap_to_exact"]) < 0.02
    assert bf16["compression_ratio"] == pytest.approx(2.0, rel=0.02)
    assert "gap to exact" in proc.stdout and is_figure(tmp_path / "demo.png")


def test_fsdp_lm_small(tmp_path, cache_dir):
    """05_fsdp_lm: the exact FSDP baseline and ZeRO-2 with 4-bit weight differences and
    two-level gradients (2 x 4 mesh), a few steps of a tiny model."""
    help_ = subprocess.run([sys.executable, str(EXAMPLES / "05_fsdp_lm.py"), "--help"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert help_.returncode == 0 and "--weights" in help_.stdout and "--grads" in help_.stdout
    proc = run_example([EXAMPLES / "05_fsdp_lm.py", "--steps", "8", "--d-model", "32", "--layers", "1",
                        "--seq-len", "32", "--corpus-chars", "200000", "--weights", "qwd4",
                        "--grads", "two_level", "--lr", "1e-2", "--no-progress", "--out", tmp_path],
                       cache_dir)
    runs = json.loads((tmp_path / "fsdp_lm.json").read_text())["runs"]
    assert [(r["weights"], r["grads"]) for r in runs] == [("none", "none"), ("qwd4", "two_level")]
    for r in runs:
        assert len(r["losses"]) == 8 and decreased(r["losses"]) and np.isfinite(r["held_out"])
    assert runs[1]["replicas_in_sync"] is True
    assert runs[1]["slow_axis_bytes_per_step"] * 7 < runs[0]["slow_axis_bytes_per_step"]
    assert "gap to exact" in proc.stdout and is_figure(tmp_path / "fsdp_lm.png")
