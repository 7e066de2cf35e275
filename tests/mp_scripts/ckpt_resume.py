"""Checkpoint round trip of every commjax transform, each half in a fresh process.

Run twice by ``tests/test_checkpoint.py`` (importing it has no side effects)::

    python ckpt_resume.py --phase first  --dir CKPT_ROOT --steps K --out first.json
    python ckpt_resume.py --phase resume --dir CKPT_ROOT --steps K --out resumed.json

``first``: every (transform, layout) case trains ``K`` steps, saves a checkpoint of the
parameters and the complete optimizer state, and keeps training ``K`` more steps (the
uninterrupted run). ``resume``: a new process restores each checkpoint into a freshly
built template and trains the same ``K`` steps. Both write the sha256 of every leaf of
the final parameters and state; the test requires them to be equal, bit for bit.

Both processes compile the same programs: the test points them at one persistent
compilation cache (``JAX_COMPILATION_CACHE_DIR``) so that the second one loads instead
of recompiling, and sets ``JAX_DISABLE_MOST_OPTIMIZATIONS`` to compile faster (the same
setting in both processes, so the programs are the same).

Layouts: ``shard_map`` (``cj.shard_state`` global arrays, ``P("data")`` per-replica
leaves) and ``pmap`` (``cj.pmap_state``, a leading device axis on every leaf). In both,
parameters are kept per replica (a leading replica axis), so that DiLoCo, whose replicas
hold different parameters between syncs, runs in the same harness.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
from typing import Any, Callable

N = 4  # replicas (devices)
AX = "data"
DIM, HIDDEN, CLASSES, BATCH = 16, 64, 4, 8

# Optional factories and where they live when ``commjax`` does not re-export them.
_OPTIONAL = {
    "top_k": "commjax.compressors.sparse",
    "random_k": "commjax.compressors.sparse",
    "powersgd": "commjax.compressors.powersgd",
    "onebit_adam": "commjax.optimizers.onebit",
    "dgc": "commjax.optimizers.dgc",
    "diloco": "commjax.optimizers.diloco",
}


def find(name: str):
    import commjax as cj

    fn = getattr(cj, name, None)
    if fn is None and name in _OPTIONAL:
        try:
            fn = getattr(importlib.import_module(_OPTIONAL[name]), name, None)
        except ImportError:
            fn = None
    return fn


def transforms() -> dict[str, Callable[[], Any]]:
    """Every transform to check, by name: ``compressed_mean`` with each compressor this
    commjax provides (followed by Adam), and the complete commjax optimizers."""
    import jax.numpy as jnp
    import optax

    import commjax as cj

    def cm(comp, **kw):
        return lambda: optax.chain(cj.compressed_mean(comp, AX, num_replicas=N, **kw), optax.adam(1e-2))

    out = {
        "identity": cm(cj.identity()),
        "cast_bf16": cm(cj.cast(jnp.bfloat16)),
        "quantize4_two_phase": cm(cj.quantize(bits=4)),
        "qsgd": cm(cj.qsgd()),
        "terngrad": cm(cj.terngrad()),
        "sign": cm(cj.sign()),
    }
    for name, kw in (("top_k", {"ratio": 0.05}), ("random_k", {"ratio": 0.05}), ("powersgd", {"rank": 2})):
        fn = find(name)
        if fn is not None:
            out[name] = cm(fn(**kw))
    onebit, dgc, diloco = find("onebit_adam"), find("dgc"), find("diloco")
    if onebit is not None:
        # Warm-up ends inside the first half: the checkpoint sits in the 1-bit stage.
        out["onebit_adam"] = lambda: onebit(1e-2, warmup_steps=2, axis_name=AX, num_replicas=N)
    if dgc is not None:
        out["dgc"] = lambda: dgc(0.1, ratio=0.05, axis_name=AX)
    if diloco is not None:
        # Two inner steps per round and an odd number of steps before the checkpoint: it
        # falls between two syncs, with replicas holding different parameters.
        out["diloco_quantize4"] = lambda: diloco(
            optax.adam(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=2,
            axis_name=AX, compressor=cj.quantize(bits=4), num_replicas=N)
    return out


# Cases also run under pmap: one per kind of per-replica/replicated state (the two-phase
# server residual, PowerSGD's replicated factors, DiLoCo's per-replica inner state and
# per-replica parameters). pmap_state lays out every other state the same generic way
# (a leading device axis on every leaf), so the rest run under shard_map only.
PMAP_CASES = ("quantize4_two_phase", "powersgd", "diloco_quantize4")


def cases() -> list[tuple[str, str]]:
    names = list(transforms())
    return [(n, "shard_map") for n in names] + [(n, "pmap") for n in names if n in PMAP_CASES]


def init_params():
    import jax
    import numpy as np

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return {
        "w0": jax.random.normal(k[0], (DIM, HIDDEN)) / np.sqrt(DIM),
        "b0": jax.numpy.zeros((HIDDEN,)),
        "w1": jax.random.normal(k[1], (HIDDEN, 32)) / np.sqrt(HIDDEN),
        "w2": jax.random.normal(k[2], (32, CLASSES)) / np.sqrt(32),
    }


def loss_fn(p, x, y):
    import jax
    import optax

    h = jax.nn.gelu(x @ p["w0"] + p["b0"])
    h = jax.nn.gelu(h @ p["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()


def batch(step: int):
    """``x[N, B, D], y[N, B]``: replica r's inputs shifted by r (non-i.i.d.)."""
    import jax
    import jax.numpy as jnp

    kx, ky = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(11), step))
    x = jax.random.normal(kx, (N, BATCH, DIM)) + jnp.arange(N, dtype=jnp.float32)[:, None, None]
    y = jax.random.randint(ky, (N, BATCH), 0, CLASSES)
    return x, y


class Case:
    """One (transform, layout): builds the fresh state and the compiled step."""

    def __init__(self, name: str, layout: str):
        import jax
        import jax.numpy as jnp
        import optax
        from jax.sharding import NamedSharding, PartitionSpec as P

        import commjax as cj
        from commjax import _compat

        self.name, self.layout = name, layout
        tx = transforms()[name]()
        params = init_params()
        stacked = jax.tree_util.tree_map(lambda a: jnp.stack([a] * N), params)
        devices = jax.devices()[:N]

        def local(p, s, x, y):
            g = jax.grad(loss_fn)(p, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        mesh = _compat.make_mesh((N,), (AX,), devices=devices)
        if layout == "shard_map":
            state = cj.shard_state(tx.init(params), mesh, AX)
            specs = cj.state_specs(state, AX)

            def sm(p, s, x, y):
                p = jax.tree_util.tree_map(lambda a: a[0], p)
                p, s = local(p, s, x[0], y[0])
                return jax.tree_util.tree_map(lambda a: a[None], p), s

            self.step_fn = jax.jit(_compat.shard_map(
                sm, mesh=mesh, in_specs=(P(AX), specs, P(AX), P(AX)), out_specs=(P(AX), specs)))
            shard = NamedSharding(mesh, P(AX))
            self.place = lambda a: jax.device_put(a, shard)
            self.fresh = {"params": self.place(stacked), "opt_state": state}
        elif layout == "pmap":
            self.step_fn = jax.pmap(local, axis_name=AX, devices=devices)
            # Every leaf has a leading device axis; place it the way pmap returns its
            # outputs (split over the devices), so every step reuses one executable.
            split = NamedSharding(mesh, P(AX))
            self.place = lambda a: jax.device_put(a, split)
            self.fresh = jax.device_put(
                {"params": stacked, "opt_state": cj.pmap_state(tx.init(params), N)}, split)
        else:
            raise ValueError(f"layout must be 'shard_map' or 'pmap', got {layout!r}")

    def train(self, tree: dict, start: int, steps: int) -> dict:
        import jax

        p, s = tree["params"], tree["opt_state"]
        for t in range(start, start + steps):
            x, y = batch(t)
            p, s = self.step_fn(p, s, self.place(x), self.place(y))
            jax.block_until_ready(p)  # one multi-device step in flight at a time
        return {"params": p, "opt_state": s}

    def directory(self, root: str) -> str:
        return os.path.join(root, f"{self.name}-{self.layout}")


def digests(tree: Any) -> dict[str, str]:
    """sha256 of every leaf (dtype, shape and bytes), keyed by its pytree path."""
    import jax
    import numpy as np

    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        a = np.ascontiguousarray(np.asarray(jax.random.key_data(leaf) if jax.numpy.issubdtype(
            leaf.dtype, jax.dtypes.prng_key) else leaf))
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
        out[jax.tree_util.keystr(path)] = h.hexdigest()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=("first", "resume"), required=True)
    ap.add_argument("--dir", required=True, help="root directory of the checkpoints")
    ap.add_argument("--steps", type=int, required=True, help="steps before and after the checkpoint")
    ap.add_argument("--out", required=True, help="JSON file for the digests")
    args = ap.parse_args(argv)

    import jax

    from commjax.checkpoint import Checkpointer

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    results = {}
    for name, layout in cases():
        case = Case(name, layout)
        key = f"{name}-{layout}"
        with Checkpointer(case.directory(args.dir)) as ckpt:
            if args.phase == "first":
                half = case.train(case.fresh, 0, args.steps)
                ckpt.save(args.steps, half)
                start, saved = args.steps, digests(half)
                tree = half
            else:
                start = ckpt.latest_step()
                if start is None:
                    results[key] = {"error": f"no checkpoint in {case.directory(args.dir)}"}
                    continue
                tree, saved = ckpt.restore(case.fresh), None
        final = case.train(tree, start, args.steps)
        results[key] = {"start": start, "saved": saved, "digests": digests(final)}
        print(f"{key}: done", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
