"""PyTorch DDP worker of ``bandwidth.py``: the same MLP, data and schedule with DDP hooks.

Started by ``bandwidth.py`` (one process per network namespace, ``GLOO_SOCKET_IFNAME`` set
to the namespace's interface, ``MASTER_ADDR`` on process 0's address); it follows the same
``PHASE``/``GO`` protocol and prints one ``RESULT {json}`` line per method. Not meant to be
run by hand; PyTorch is an optional dependency that the tests never need.

Methods (communication hooks of ``torch.distributed.algorithms.ddp_comm_hooks``):

* ``ddp_allreduce``: DDP's default, an fp32 all-reduce per gradient bucket;
* ``ddp_fp16``: ``fp16_compress_hook`` (gradients cast to fp16 before the all-reduce);
* ``ddp_powersgd_r1`` / ``ddp_powersgd_r4``: ``powerSGD_hook`` with
  ``matrix_approximation_rank`` 1 / 4, error feedback and warm start, PowerSGD from
  step ``PRELUDE_STEPS - 1`` on (``start_powerSGD_iter``; the earlier steps are plain
  all-reduces, inside the untimed prelude).

Analytic bytes per step and process (ring convention, ``N`` processes): fp32 all-reduce
``2 (N-1)/N * 4 n``; fp16 half of it; PowerSGD ``2 (N-1)/N * 4 * (sum (m + k) r + u)``
over the compressed ``m x k`` weight matrices plus the ``u`` entries it all-reduces
uncompressed (biases, and matrices whose ``m k / ((m + k) r)`` is below
``min_compression_rate``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bandwidth as bw  # noqa: E402

MIN_COMPRESSION_RATE = 2.0
#: DDP's default bucket size (MB); PowerSGD runs use one bucket holding every gradient.
DEFAULT_BUCKET_MB = 25
SINGLE_BUCKET_MB = 4096


def analytic_bytes(method: str, shapes: list[tuple[int, ...]], n: int) -> float:
    ring = 2.0 * (n - 1) / n
    total = sum(int(__import__("math").prod(s)) for s in shapes)
    if method == "ddp_allreduce":
        return ring * 4 * total
    if method == "ddp_fp16":
        return ring * 2 * total
    rank = {"ddp_powersgd_r1": 1, "ddp_powersgd_r4": 4}[method]
    sent = 0
    for s in shapes:
        if len(s) == 2:
            m, k = s
            r = min(rank, m, k)
            if m * k / ((m + k) * r) >= MIN_COMPRESSION_RATE:
                sent += (m + k) * r
                continue
        sent += int(__import__("math").prod(s))
    return ring * 4 * sent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--rates", required=True)
    p.add_argument("--steps", type=int, required=True)
    args = p.parse_args()

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    cfg = json.loads(args.model)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x_np, y_np = bw.make_batch(cfg, rank, world)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np.astype(np.int64))
    layers = bw.init_params(cfg)

    def make_model() -> torch.nn.Module:
        mods: list[torch.nn.Module] = []
        for i, (k, b) in enumerate(layers):
            lin = torch.nn.Linear(k.shape[0], k.shape[1])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(k.T)))
                lin.bias.copy_(torch.from_numpy(b))
            mods.append(lin)
            if i < len(layers) - 1:
                mods.append(torch.nn.GELU(approximate="tanh"))  # jax.nn.gelu's default
        return torch.nn.Sequential(*mods)

    for method in args.methods.split(","):
        model = make_model()
        shapes = [tuple(p.shape) for p in model.parameters()]
        powersgd = method in ("ddp_powersgd_r1", "ddp_powersgd_r4")
        # One bucket for PowerSGD: with several buckets the hook issues the P and Q
        # all-reduces of different buckets from future callbacks, in an order that can
        # differ between processes, which gloo reports as a collective size mismatch
        # ("op.preamble.length <= op.nbytes") and aborts (seen with torch 2.13).
        ddp = DDP(model, gradient_as_bucket_view=True,
                  bucket_cap_mb=SINGLE_BUCKET_MB if powersgd else DEFAULT_BUCKET_MB)
        if method == "ddp_fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif powersgd:
            state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=1 if method.endswith("r1") else 4,
                start_powerSGD_iter=bw.PRELUDE_STEPS - 1, min_compression_rate=MIN_COMPRESSION_RATE,
                use_error_feedback=True, warm_start=True)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        elif method != "ddp_allreduce":
            raise SystemExit(f"unknown DDP method {method!r}; known: {', '.join(bw.TORCH_METHODS)}")
        opt = torch.optim.SGD(ddp.parameters(), lr=bw.SGD["learning_rate"],
                              momentum=bw.SGD["momentum"])
        loss_fn = torch.nn.CrossEntropyLoss()

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            loss = loss_fn(ddp(x), y)
            loss.backward()  # DDP's hooks exchange the buckets and wait for them here
            opt.step()

        times = bw.timed_phases(rank, method, args.rates.split(","), args.steps, step)
        with torch.no_grad():
            loss = loss_fn(model(x), y).detach().reshape(1)
        dist.all_reduce(loss)
        row = {
            "framework": "torch", "method": method, "available": True, "processes": world,
            "devices": world, "params": sum(p.numel() for p in model.parameters()),
            "plan_bytes": analytic_bytes(method, shapes, world), "hlo_bytes": None,
            "loss": float(loss.item() / world), "times": times,
            "steps": bw.PRELUDE_STEPS + len(times) * (args.steps + 1),
            "note": (f"torch {torch.__version__}, gloo, bucket_cap_mb="
                     f"{SINGLE_BUCKET_MB if powersgd else DEFAULT_BUCKET_MB}"),
        }
        if rank == 0:
            bw.emit(row)
        del ddp, model, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
