"""1-bit Adam, 1-bit LAMB and DiLoCo against their exact-mean baselines on the non-i.i.d. task.

Every method trains the same 2-hidden-layer MLP on 8 replicas (8 forced CPU devices) for the
same number of steps; ``gap`` is ``(final_loss - ref_loss) / ref_loss`` against the row's
reference (``ref``), and ``gap_vs_adam`` against Adam with the exact mean at the same
learning rate where one applies. Bytes per device and step (ring convention) are read
from the compiled HLO: for the task's MLP and for a 3.1M-parameter model (compile only).
For 1-bit Adam/LAMB the two stages are reported separately and averaged over the run; for
DiLoCo the sync step's bytes are divided by ``sync_every``.

    python benchmarks/optimizers_convergence.py [--steps 300] [--out benchmarks/results/optimizers_convergence.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

from _devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

from _results import write_results  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from commjax import _compat  # noqa: E402
from commjax.accounting import collective_bytes, ring_bytes  # noqa: E402
from commjax.compressors import identity, quantize  # noqa: E402
from commjax.layout import per_replica_mask, state_specs, unshard_state  # noqa: E402
from commjax.optimizers.diloco import diloco  # noqa: E402
from commjax.optimizers.onebit import onebit_adam, onebit_lamb  # noqa: E402
from commjax.testing import noniid_classification, train  # noqa: E402
from commjax.transform import compressed_mean  # noqa: E402

N = 8
H = 10
BIG = {"w1": (1024, 2048), "w2": (2048, 512), "b1": (2048,), "b2": (512,)}


def _num(x: float):
    return round(float(x), 5) if math.isfinite(x) else None


def _nesterov():
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


def _exact(opt):
    return optax.chain(compressed_mean(identity(), "data"), opt)


# ----------------------------------------------------------------------------- bytes


def _global(state):
    mask = per_replica_mask(state)
    return jax.tree_util.tree_map(
        lambda l, m: jax.ShapeDtypeStruct(((N * l.shape[0],) + l.shape[1:]) if m else l.shape, l.dtype),
        state, mask)


def hlo_bytes(tx, shapes: dict) -> dict:
    """Per-device ring bytes of one step, from the compiled HLO, split by cond branch:
    ``{"unconditional": B, "branches": [B1, B2, ...]}``."""
    mesh = _compat.make_mesh((N,), ("data",))
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    state = jax.eval_shape(tx.init, params)
    specs = state_specs(state, "data")
    glob = {k: jax.ShapeDtypeStruct((N,) + s, jnp.float32) for k, s in shapes.items()}

    def body(p, g, s):
        first = lambda t: jax.tree_util.tree_map(lambda a: a[0], t)
        u, s = tx.update(first(g), s, first(p))
        return jax.tree_util.tree_map(lambda a: a[None], u), s

    f = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data"), specs),
                                  out_specs=(P("data"), specs), check_vma=False))
    rep = collective_bytes(f, glob, glob, _global(state))
    out = {"unconditional": sum(c.ring_bytes for c in rep if not c.in_conditional)}
    branches: dict = {}
    for c in rep:
        if c.in_conditional:
            branches[c.computation] = branches.get(c.computation, 0.0) + c.ring_bytes
    out["branches"] = sorted(branches.values())
    return out


def per_step_bytes(kind: str, tx, shapes: dict, steps: int, warmup: int = 0) -> dict:
    b = hlo_bytes(tx, shapes)
    n = sum(int(np.prod(s)) if s else 1 for s in shapes.values())
    exact = ring_bytes("all-reduce", 4 * n, N)
    if kind == "exact":
        step = b["unconditional"]
        return {"per_step": step, "ratio_vs_exact": exact / step}
    if kind == "onebit":  # branches: [compressed stage, warm-up stage]
        comp, warm = b["branches"][0], b["branches"][-1]
        avg = (warmup * warm + (steps - warmup) * comp) / steps
        return {"after_warmup": comp, "during_warmup": warm, "average": avg,
                "ratio_after_warmup": exact / comp, "ratio_average": exact / avg}
    if kind == "diloco":  # one branch: the sync step (none when every step syncs)
        if not b["branches"]:
            sync = b["unconditional"]
            return {"sync_step": sync, "inner_step": None, "average": sync,
                    "ratio_sync_step": exact / sync, "ratio_average": exact / sync}
        sync = b["branches"][0] + b["unconditional"]
        return {"sync_step": sync, "inner_step": b["unconditional"], "average": sync / H,
                "ratio_sync_step": exact / sync, "ratio_average": exact * H / sync}
    raise ValueError(kind)


# ----------------------------------------------------------------------------- runs


@dataclasses.dataclass
class Method:
    name: str
    tx: optax.GradientTransformation
    ref: str  # name of the reference row
    bytes_kind: str
    warmup: int = 0
    adam_ref: str = ""


def methods(steps: int) -> list[Method]:
    wu3, wu6 = steps // 3, steps // 6
    out = []
    for lr in (1e-2, 3e-3):
        ref = f"adam lr={lr:g}, exact mean"
        out += [
            Method(ref, _exact(optax.adam(lr)), ref, "exact"),
            Method(f"onebit_adam lr={lr:g}, warm-up {wu6}", onebit_adam(lr, warmup_steps=wu6), ref,
                   "onebit", wu6),
            Method(f"onebit_adam lr={lr:g}, warm-up {wu3}", onebit_adam(lr, warmup_steps=wu3), ref,
                   "onebit", wu3),
        ]
    ref = "lamb lr=0.01, exact mean"
    out += [
        Method(ref, _exact(optax.lamb(1e-2)), ref, "exact"),
        Method(f"onebit_lamb lr=0.01, warm-up {wu3}", onebit_lamb(1e-2, warmup_steps=wu3), ref,
               "onebit", wu3),
    ]
    ref = "sgd lr=0.3, exact mean"
    out += [
        Method(ref, _exact(optax.sgd(0.3)), ref, "exact"),
        Method(f"diloco H={H}: sgd 0.3 / nesterov 0.7 m0.9", diloco(optax.sgd(0.3), _nesterov(), sync_every=H),
               ref, "diloco", adam_ref="adam lr=0.01, exact mean"),
        Method(f"diloco H={H}: sgd 0.3 / nesterov 0.7 m0.9, 4-bit sync",
               diloco(optax.sgd(0.3), _nesterov(), sync_every=H, compressor=quantize(4)),
               ref, "diloco", adam_ref="adam lr=0.01, exact mean"),
        Method("diloco H=1: sgd 0.3 / sgd 1.0 (= data-parallel sgd)",
               diloco(optax.sgd(0.3), optax.sgd(1.0), sync_every=1), ref, "diloco"),
    ]
    for lr in (1e-2, 3e-3):
        ref = f"adam lr={lr:g}, exact mean"
        out += [
            Method(f"diloco H={H}: adam {lr:g} / nesterov 0.7 m0.9",
                   diloco(optax.adam(lr), _nesterov(), sync_every=H), ref, "diloco"),
            Method(f"diloco H={H}: adam {lr:g} / sgd 1.0 (averaging)",
                   diloco(optax.adam(lr), optax.sgd(1.0), sync_every=H), ref, "diloco"),
        ]
    return out


def _bit_identical(tree) -> bool:
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.asarray(leaf)
        bits = a.view(np.uint32) if a.dtype == np.float32 else a
        if not np.all(bits == bits[:1]):
            return False
    return True


def _diloco_agreement(res) -> dict:
    """At the last (sync) step: fraction of entries bit-identical on all replicas, and the
    largest distance of a replica's parameter from the shared anchor."""
    anchor = unshard_state(res.opt_state).anchor
    same, total, worst = 0, 0, 0.0
    for k, rp in res.replica_params.items():
        rp = np.asarray(rp)
        same += int(np.sum(np.all(rp == rp[:1], axis=0)))
        total += rp[0].size
        worst = max(worst, float(np.max(np.abs(rp - np.asarray(anchor[k])[None]))))
    return {"fraction_bit_identical": round(same / total, 5), "max_abs_from_anchor": worst}


def dead_units(task, steps: int) -> list[dict]:
    """1-bit Adam where hidden units are dead during warm-up (zero frozen variance)."""
    p = dict(task.params)
    p["b0"] = p["b0"].at[:8].set(-50.0)
    dtask = dataclasses.replace(task, params=p)
    wu = max(1, steps // 6)
    rows = []
    for name, kw in [("no guards (var_floor=0, max_update_ratio=None)", dict(var_floor=0.0, max_update_ratio=None)),
                     ("var_floor=0.01 only", dict(max_update_ratio=None)),
                     ("max_update_ratio=10 only", dict(var_floor=0.0)),
                     ("defaults (both)", {})]:
        res = train(onebit_adam(1e-2, warmup_steps=wu, **kw), dtask, steps, log_every=max(1, steps // 10))
        rows.append({"guards": name, "warmup": wu, "final_loss": _num(res.final_loss),
                     "diverged": not all(math.isfinite(x) for x in res.losses),
                     "loss_curve": [_num(x) for x in res.losses]})
        print(f"  dead units, 1-bit Adam {name:50s} final {res.final_loss:.4f}", flush=True)
    ref = train(_exact(optax.adam(1e-2)), dtask, steps, log_every=max(1, steps // 10))
    rows.append({"guards": "reference: adam lr=0.01, exact mean", "final_loss": _num(ref.final_loss),
                 "diverged": False, "loss_curve": [_num(x) for x in ref.losses]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "optimizers_convergence.json"))
    args = ap.parse_args(argv)
    steps = args.steps
    if steps % H:
        ap.error(f"--steps must be a multiple of {H} (the last step is then a DiLoCo sync)")

    task = noniid_classification(N)
    shapes_task = {k: tuple(v.shape) for k, v in task.params.items()}
    finals: dict = {}
    rows = []
    for m in methods(steps):
        t0 = time.time()
        res = train(m.tx, task, steps, log_every=max(1, steps // 10))
        finals[m.name] = res.final_loss
        ref = finals[m.ref]
        row = {
            "method": m.name,
            "reference": m.ref,
            "final_loss": _num(res.final_loss),
            "gap": _num((res.final_loss - ref) / ref),
            "replicas_bit_identical": _bit_identical(res.replica_params),
            "loss_curve": [_num(x) for x in res.losses],
            "bytes_task_model": per_step_bytes(m.bytes_kind, m.tx, shapes_task, steps, m.warmup),
            "bytes_3.1M_model": per_step_bytes(m.bytes_kind, m.tx, BIG, steps, m.warmup),
        }
        if m.adam_ref:
            row["gap_vs_" + m.adam_ref.replace(" ", "_")] = _num((res.final_loss - finals[m.adam_ref]) / finals[m.adam_ref])
        if m.bytes_kind == "diloco":
            row["after_last_sync"] = _diloco_agreement(res)
        rows.append(row)
        b = row["bytes_3.1M_model"]
        ratio = b.get("ratio_average", b.get("ratio_vs_exact"))
        print(f"{m.name:52s} loss {res.final_loss:.4f}  gap {row['gap']:+.3f} vs {m.ref:26s} "
              f"3.1M model: {ratio:6.1f}x fewer B/step than exact  "
              f"identical={row['replicas_bit_identical']}  [{time.time() - t0:.0f}s]", flush=True)

    print("dead units (hidden units with gelu and gradient exactly 0 during warm-up):")
    dead = dead_units(task, steps)

    out = {
        "task": "commjax.testing.noniid_classification(8): MLP 32-32-32-10, 512 examples per replica, "
                "full batch, shifted inputs per replica, 20% label noise",
        "replicas": N,
        "steps": steps,
        "initial_loss": round(task.global_loss(task.params), 5),
        "bytes": "per device and step, ring convention (all-reduce 2(N-1)/N*S, all-gather (N-1)*S, "
                 "all-to-all (N-1)/N*S), from the compiled HLO (static count per cond branch)",
        "models": {"task": shapes_task, "3.1M": BIG},
        "jax": jax.__version__,
        "results": rows,
        "dead_units": dead,
    }
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
