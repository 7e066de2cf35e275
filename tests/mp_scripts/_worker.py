"""Worker-side helpers for scripts started by ``tests/multiprocess.py``.

A worker script in ``tests/mp_scripts/`` (this directory is ``sys.path[0]`` when the
script runs, so ``import _worker`` works) follows one pattern::

    import _worker
    ctx = _worker.setup()              # commjax.distributed.initialize_from_env + mesh
    ...                                # jit(shard_map(..., mesh=ctx.mesh)) as usual
    _worker.emit({"loss": float(loss), "params_sha": _worker.digest(params)})

and the test reads ``run.results[i]`` (the last ``RESULT {...}`` line of process i).
Anything a worker prints to stdout/stderr is kept by the launcher for error messages.

To feed per-process data, build global arrays with :func:`shard_rows` (each process
passes only the rows of its own devices). Read outputs with ``np.asarray`` after
making them replicated (``out_specs=P()``) inside ``shard_map``; an output sharded
across processes is not fully addressable on any one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from typing import Any

import numpy as np

RESULT_PREFIX = "RESULT "


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """What a worker needs to know about the job it is part of."""

    mesh: Any  # jax.sharding.Mesh
    axis_name: str
    process_id: int
    num_processes: int
    local_device_count: int
    global_device_count: int

    @property
    def local_rows(self) -> slice:
        """Rows of a ``(global_device_count, ...)`` array that live on this process
        (devices are ordered by process in :func:`commjax.distributed.global_mesh`)."""
        start = self.process_id * self.local_device_count
        return slice(start, start + self.local_device_count)


def task_parser(steps: int) -> argparse.ArgumentParser:
    """The options every task-training worker takes: ``--task FILE`` (the npz written by
    ``train_compressors.save_task``) and ``--steps`` (default ``steps``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", required=True, help="npz written by train_compressors.save_task")
    parser.add_argument("--steps", type=int, default=steps)
    return parser


def setup(axis_name: str = "data") -> WorkerContext:
    """Joins the job started by the launcher and builds the 1-D global mesh.

    Must be the first thing a worker does with JAX.
    """
    from commjax import distributed

    distributed.initialize_from_env(required=True)
    import jax

    mesh = distributed.global_mesh(axis_name)
    ctx = WorkerContext(
        mesh=mesh,
        axis_name=axis_name,
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        local_device_count=jax.local_device_count(),
        global_device_count=jax.device_count(),
    )
    # Devices must be grouped by process for ``local_rows`` to be right.
    owners = [d.process_index for d in mesh.devices.flat]
    assert owners == sorted(owners), f"global mesh not ordered by process: {owners}"
    return ctx


def shard_rows(ctx: WorkerContext, local_rows: np.ndarray):
    """A global array sharded over ``ctx.axis_name`` along axis 0, from this process'
    rows only (shape ``(local_device_count * k, ...)``)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(ctx.mesh, P(ctx.axis_name))
    return jax.make_array_from_process_local_data(sharding, np.asarray(local_rows))


def digest(x: Any) -> str:
    """sha256 of an array's dtype, shape and bytes (compare results across processes)."""
    a = np.ascontiguousarray(np.asarray(x))
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if hasattr(obj, "__array__"):
        return np.asarray(obj).tolist()
    raise TypeError(f"cannot put {type(obj).__name__} into a RESULT line")


def emit(payload: dict[str, Any]) -> None:
    """Prints ``RESULT {json}`` on one line of stdout (numpy values become lists)."""
    line = RESULT_PREFIX + json.dumps(payload, sort_keys=True, default=_jsonable)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def gloo_listen_addresses() -> list[str]:
    """IPv4 ``host:port`` of the TCP sockets this process listens on (Linux only).

    Gloo opens one listening socket when the CPU backend starts; in process 0 the
    coordination service listens too (on ``[::]``, IPv6, not reported here).
    """
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    addresses = []
    with open("/proc/self/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                hex_ip, hex_port = fields[1].split(":")
                ip = ".".join(str(b) for b in reversed(bytes.fromhex(hex_ip)))
                addresses.append(f"{ip}:{int(hex_port, 16)}")
    return sorted(addresses)
