"""commjax PowerSGD beside PyTorch DDP's ``powerSGD_hook`` on the same problem.

Same model (the 2-hidden-layer GELU MLP of ``commjax.testing``), same initial weights,
same per-replica data (``noniid_classification``, 4 replicas), same rank, warm-up, error
feedback and optimizer (SGD with momentum 0.9), same number of full-batch steps:

* PyTorch: 4 processes on the loopback interface, gloo backend,
  ``DistributedDataParallel`` with ``powerSGD_hook`` (and with the default all-reduce for
  the exact baseline);
* commjax: ``compressed_mean(powersgd(r, start_step=...))`` on 4 simulated CPU devices
  (and ``identity()`` for the exact baseline).

Prints the final global losses and the time per step of the gradient exchange in each
framework (PyTorch: from the hook's call until its future completes; commjax: one jitted
``compressed_mean`` update); the compression overhead is the difference to the exact
exchange of the same framework. Writes ``benchmarks/results/powersgd_vs_torch.json``.

PyTorch is an optional benchmark dependency (never a test dependency)::

    pip install torch==2.13.0
    python benchmarks/vs_torch_powersgd.py --rank 4 --steps 200

Notes: the hook requires ``start_powerSGD_iter >= 2`` with error feedback or warm start,
so both sides use 2 exact warm-up steps by default. ``batched_powerSGD_hook`` (one matrix
for the whole bucket) fails in ``_orthogonalize`` in torch 2.13 and is a different
algorithm anyway; the per-tensor ``powerSGD_hook`` is the one commjax mirrors. Random
initial ``Q`` differ between the frameworks (``randn`` there, a hash of the shared key
here), so the PowerSGD trajectories agree statistically, not bit for bit; the exact
baselines agree to float round-off.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    from _devices import simulate_cpu_devices

    simulate_cpu_devices(8)

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "powersgd_vs_torch.json"
REPLICAS = 4


# ----------------------------------------------------------------------------- PyTorch side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_worker(rank: int, world: int, port: int, data_path: str, out_path: str, cfg: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = np.load(data_path)
    layers = []
    n_layers = sum(1 for k in data.files if k.startswith("w"))
    for i in range(n_layers):
        w = torch.tensor(data[f"w{i}"])  # JAX kernel (in, out)
        lin = torch.nn.Linear(w.shape[0], w.shape[1])
        with torch.no_grad():
            lin.weight.copy_(w.T)  # torch stores (out, in)
            lin.bias.copy_(torch.tensor(data[f"b{i}"]))
        layers.append(lin)
        if i < n_layers - 1:
            layers.append(torch.nn.GELU(approximate="tanh"))  # jax.nn.gelu's default
    model = torch.nn.Sequential(*layers)
    ddp = DDP(model)
    timings: list[float] = []
    if cfg["method"] == "powersgd":
        state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=cfg["rank"],
            start_powerSGD_iter=cfg["start_step"], min_compression_rate=2,
            use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0.0,
            random_seed=0, batch_tensors_with_same_shape=True,
        )
        inner = psgd.powerSGD_hook
    else:
        state, inner = None, default_hooks.allreduce_hook

    def timed(st, bucket):
        t0 = time.perf_counter()
        fut = inner(st, bucket)

        def done(f):
            timings.append(time.perf_counter() - t0)
            return f.value()

        return fut.then(done)

    ddp.register_comm_hook(state, timed)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["learning_rate"], momentum=cfg["momentum"])
    x = torch.tensor(data["x"][rank])
    y = torch.tensor(data["y"][rank]).long()
    all_x = torch.tensor(data["x"].reshape(-1, data["x"].shape[-1]))
    all_y = torch.tensor(data["y"].reshape(-1)).long()
    xent = torch.nn.CrossEntropyLoss()
    losses, step_times = [], []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        xent(ddp(x), y).backward()
        opt.step()
        step_times.append(time.perf_counter() - t0)
        if rank == 0:
            with torch.no_grad():
                losses.append(float(xent(model(all_x), all_y)))
    if rank == 0:
        Path(out_path).write_text(json.dumps({
            "losses": losses,
            "exchange_seconds_per_step": float(np.median(timings[cfg["start_step"]:])),
            "step_seconds": float(np.median(step_times[cfg["start_step"]:])),
        }))
    dist.barrier()
    dist.destroy_process_group()


def run_torch(method: str, task_npz: str, cfg: dict) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_torch_worker, args=(REPLICAS, _free_port(), task_npz, out, dict(cfg, method=method)),
                 nprocs=REPLICAS, join=True)
        res = json.loads(Path(out).read_text())
    res["final_loss"] = res["losses"][-1]
    return res


# ----------------------------------------------------------------------------- commjax side


def run_commjax(compressor, task, cfg: dict) -> dict:
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import commjax as cj
    from commjax import _compat
    from commjax.testing import train

    tx_mean = cj.compressed_mean(compressor, "data", min_compress_size=1)
    tx = optax.chain(tx_mean, optax.sgd(cfg["learning_rate"], momentum=cfg["momentum"]))
    res = train(tx, task, cfg["steps"])
    # Time of the exchange alone: compressed_mean's update on the per-replica gradients.
    devices = jax.devices()[:REPLICAS]
    mesh = _compat.make_mesh((REPLICAS,), ("data",), devices=devices)
    state = cj.shard_state(tx_mean.init(task.params), mesh, "data")
    state = jax.tree_util.tree_map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P())) if a.size == 0 else a, state)
    specs = cj.state_specs(state, "data")

    def upd(g, s):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        u, s = tx_mean.update(g, s)
        return jax.tree_util.tree_map(lambda a: a[None], u), s

    ex = jax.jit(_compat.shard_map(upd, mesh=mesh, in_specs=(P("data"), specs),
                                   out_specs=(P("data"), specs)))
    grads = jax.vmap(jax.grad(task.loss), in_axes=(None, 0, 0))(task.params, task.x, task.y)
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
    times = []
    for t in range(cfg["start_step"] + 30):
        t0 = time.perf_counter()
        u, state = ex(grads, state)
        jax.block_until_ready(u)
        if t >= cfg["start_step"] + 5:  # past the warm-up and the compilations
            times.append(time.perf_counter() - t0)
    return {
        "losses": [float(v) for v in res.losses],
        "final_loss": res.final_loss,
        "replicas_identical": res.replicas_identical,
        "exchange_seconds_per_step": float(np.median(times)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--start-step", type=int, default=2)
    ap.add_argument("--learning-rate", type=float, default=0.1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("this benchmark needs PyTorch (an optional dependency): pip install torch==2.13.0")
        return 2

    import jax

    from commjax.compressors.powersgd import powersgd
    from commjax import identity
    from commjax.testing import noniid_classification

    cfg = dict(rank=args.rank, steps=args.steps, start_step=args.start_step,
               learning_rate=args.learning_rate, momentum=0.9)
    task = noniid_classification(REPLICAS, examples_per_replica=512, dim=32, hidden=32)
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "task.npz")
        np.savez(npz, x=np.asarray(task.x), y=np.asarray(task.y),
                 **{k: np.asarray(v) for k, v in task.params.items()})
        rows["torch_exact"] = run_torch("allreduce", npz, cfg)
        rows["torch_powersgd"] = run_torch("powersgd", npz, cfg)
    rows["commjax_exact"] = run_commjax(identity(), task, cfg)
    rows["commjax_powersgd"] = run_commjax(powersgd(args.rank, start_step=args.start_step), task, cfg)
    for fw in ("torch", "commjax"):
        rows[f"{fw}_compression_overhead_seconds"] = (
            rows[f"{fw}_powersgd"]["exchange_seconds_per_step"] - rows[f"{fw}_exact"]["exchange_seconds_per_step"])
    print(f"rank {args.rank}, {args.steps} steps, {REPLICAS} replicas, warm-up {args.start_step} steps")
    print(f"{'run':<18} {'final loss':>10} {'exchange ms/step':>17}")
    for name in ("torch_exact", "commjax_exact", "torch_powersgd", "commjax_powersgd"):
        r = rows[name]
        print(f"{name:<18} {r['final_loss']:>10.4f} {1e3 * r['exchange_seconds_per_step']:>17.3f}")
    for fw in ("torch", "commjax"):
        print(f"{fw} compression overhead per step: "
              f"{1e3 * rows[f'{fw}_compression_overhead_seconds']:.3f} ms")
    out = {
        "config": dict(cfg, replicas=REPLICAS, model="MLP 32-32-32-10 (GELU tanh)",
                       task="noniid_classification(4, examples_per_replica=512, dim=32, hidden=32)"),
        "versions": {"torch": torch.__version__, "jax": jax.__version__},
        "notes": "torch: DDP + powerSGD_hook over gloo on loopback, 4 processes; commjax: "
                 "compressed_mean(powersgd) on 4 simulated CPU devices. Exchange time = the "
                 "hook (torch) / one jitted compressed_mean update (commjax), median per step.",
        "results": {k: ({kk: vv for kk, vv in v.items() if kk != "losses"} | {"losses_every_10": v["losses"][::10]}
                        if isinstance(v, dict) else v) for k, v in rows.items()},
    }
    from _results import write_results

    write_results(args.out, out, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
