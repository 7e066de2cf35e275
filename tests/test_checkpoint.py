"""Checkpointing with orbax (``commjax.checkpoint``): the complete training state of every
commjax transform round-trips, and a run restored in a *fresh process* continues
bit-identically to an uninterrupted one, under the shard_map and pmap layouts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import commjax as cj
from commjax import _compat
from commjax.checkpoint import Checkpointer, CheckpointMismatchError, latest_step, restore, save

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "mp_scripts" / "ckpt_resume.py"
K = 3  # steps before and after the checkpoint


def _load_worker():
    spec = importlib.util.spec_from_file_location("ckpt_resume", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


worker = _load_worker()


def _run_worker(phase: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{phase}.json"
    env = dict(os.environ)  # 8 forced CPU devices (conftest.py)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax_cache")
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--phase", phase, "--dir", str(tmp_path / "ckpt"),
         "--steps", str(K), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"{phase} phase failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


def test_every_transform_resumes_bit_identically_in_a_fresh_process(tmp_path):
    """For each (transform, layout): K steps, save, K more steps (the uninterrupted run)
    in one process; in a second, new process, restore the checkpoint into a freshly
    built state and train the same K steps. Every leaf of the parameters and of the
    optimizer state (residuals, counters, keys, compressor and inner-optimizer state)
    must match bit for bit."""
    first = _run_worker("first", tmp_path)
    resumed = _run_worker("resume", tmp_path)
    assert set(first) == {f"{n}-{l}" for n, l in worker.cases()}
    assert set(resumed) == set(first)
    for key, want in first.items():
        got = resumed[key]
        assert got.get("start") == K, (key, got)
        bad = [path for path, d in want["digests"].items() if got["digests"].get(path) != d]
        assert not bad, f"{key}: the resumed run differs from the uninterrupted one at {bad[:5]}"
        # Training really changed the state between the checkpoint and the end.
        changed = [p for p, d in want["digests"].items() if want["saved"][p] != d]
        assert any("params" in p for p in changed), key
        assert any("opt_state" in p for p in changed), key


def test_case_list_covers_the_transforms_present():
    names = {n for n, _ in worker.cases()}
    assert {"identity", "cast_bf16", "quantize4_two_phase", "sign", "qsgd", "terngrad"} <= names
    for optional, case in (("top_k", "top_k"), ("random_k", "random_k"), ("powersgd", "powersgd"),
                           ("onebit_adam", "onebit_adam"), ("dgc", "dgc"), ("diloco", "diloco_quantize4")):
        assert (worker.find(optional) is not None) == (case in names), optional
    layouts = {l for _, l in worker.cases()}
    assert layouts == {"shard_map", "pmap"}


# ------------------------------------------------------------------ the helpers themselves


N = 4


@pytest.fixture(scope="module")
def mesh():
    return _compat.make_mesh((N,), ("data",), devices=jax.devices()[:N])


def _state(mesh):
    params = {"w": jnp.ones((64, 64)), "b": jnp.zeros((64,))}
    tx = optax.chain(cj.compressed_mean(cj.quantize(bits=4), "data", num_replicas=N), optax.adam(1e-3))
    return params, tx, cj.shard_state(tx.init(params), mesh, "data")


def test_restore_puts_each_replica_residual_on_its_own_device(tmp_path, mesh):
    params, tx, state = _state(mesh)
    cms = state[0]
    # Give every replica a different residual.
    assert len(cms.residual) >= 1
    residual = tuple(jax.device_put(jnp.arange(r.size, dtype=jnp.float32).reshape(r.shape) + 1000 * k,
                                    NamedSharding(mesh, P("data")))
                     for k, r in enumerate(cms.residual))
    state = (cms._replace(residual=residual, count=cms.count + 5),) + tuple(state[1:])
    save(tmp_path / "c", 7, {"opt": state})
    assert latest_step(tmp_path / "c") == 7
    _, _, template = _state(mesh)
    got = restore(tmp_path / "c", {"opt": template})["opt"]
    for back, saved, like in zip(got[0].residual, residual, template[0].residual):
        assert back.sharding == like.sharding
        want_shards = {s.device: np.asarray(s.data) for s in saved.addressable_shards}
        for s in back.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), want_shards[s.device])
    assert int(got[0].count) == 5
    assert got[0].count.sharding.spec == P()


def test_typed_keys_masked_nodes_numpy_leaves_and_metadata(tmp_path):
    mask = {"a": True, "b": False}
    tx = optax.masked(optax.adam(1e-3), mask)
    params = {"a": jnp.ones((3,)), "b": jnp.ones((2,))}
    tree = {"opt": tx.init(params), "key": jax.random.key(42), "np": np.arange(4), "empty": ()}
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, tree, metadata={"step": step, "note": "x"})
        assert ckpt.all_steps() == [2, 3]  # max_to_keep
        assert ckpt.metadata()["user"] == {"step": 3, "note": "x"}
        like = {"opt": tx.init(params), "key": jax.random.key(0), "np": np.zeros(4, np.int64), "empty": ()}
        got = ckpt.restore(like, step=2)
        assert jnp.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
        np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(tree["key"]))
        assert isinstance(got["np"], np.ndarray)
        np.testing.assert_array_equal(got["np"], np.arange(4))
        with pytest.raises(FileNotFoundError, match="step 1"):
            ckpt.restore(like, step=1)


def test_mismatched_template_names_the_first_differing_leaf(tmp_path, mesh):
    params, tx, state = _state(mesh)
    save(tmp_path, 1, {"params": params, "opt": state})
    other = optax.chain(cj.compressed_mean(cj.quantize(bits=4), "data", num_replicas=N), optax.sgd(1e-3))
    bad = {"params": params, "opt": cj.shard_state(other.init(params), mesh, "data")}
    with pytest.raises(CheckpointMismatchError, match=r"first difference at leaf"):
        restore(tmp_path, bad)
    wrong_shape = {"params": {"w": jnp.ones((32, 64)), "b": jnp.zeros((64,))}, "opt": state}
    with pytest.raises(CheckpointMismatchError, match="shape"):
        restore(tmp_path, wrong_shape)
    # The same state laid out for half the replicas: the first axis of a per-replica leaf.
    half = jax.tree_util.tree_map(lambda a: a[: a.shape[0] // 2] if a.ndim and a.shape[0] % 2 == 0 else a, state)
    with pytest.raises(CheckpointMismatchError, match="first axis differs.*another number of replicas"):
        restore(tmp_path, {"params": params, "opt": half})


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep"):
        Checkpointer(tmp_path, max_to_keep=0)
    with Checkpointer(tmp_path) as c:
        with pytest.raises(ValueError, match="step"):
            c.save(-1, {"a": jnp.ones(2)})
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            c.restore({"a": jnp.ones(2)})
    assert latest_step(tmp_path / "missing") is None
