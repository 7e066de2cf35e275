"""Step time of compressed gradient exchange on real, rate-limited links (run as root).

Builds a private network of Linux network namespaces (one per process, joined by veth
pairs through a bridge, every link shaped with ``tc tbf`` in both directions: see
:mod:`netns`), starts one JAX process per namespace (1 CPU device each, gloo bound to
the namespace's ``eth0`` through ``COMMJAX_INTERFACE``, the coordinator on process 0's
address) and trains the same Flax MLP with each method for a fixed number of steps at
each link rate. Then the same with PyTorch DDP (``vs_torch_ddp.py``: allreduce, fp16
and PowerSGD hooks) in the same namespaces and shaping, when torch is installed.

    sudo python benchmarks/bandwidth.py                       # defaults below
    sudo python benchmarks/bandwidth.py --rates none,1gbit,100mbit --steps 5
    sudo python benchmarks/bandwidth.py --methods exact,sign,powersgd_r4 --no-torch

For every method and rate it reports the median step time, the bytes each device sends
per step (analytic, from ``cj.communication_plan``, and from the compiled HLO, from
``cj.collective_bytes``; ring convention), the loss after the steps, the speedup over the
exact fp32 mean, and the *ideal* speedup implied by the bytes:

    t_compute(method)     = t_unshaped(method) - bytes(method) * 8 / G
    ideal_time(method, R) = t_compute(method) + bytes(method) * 8 / R
    ideal_speedup         = ideal_time(exact, R) / ideal_time(method, R)
    efficiency            = measured speedup / ideal speedup

where ``t_unshaped`` is the method's median step time on the unshaped links and ``G``
the TCP goodput measured on them (one stream, host 0 to host 1): the veths then move a
few Gbit/s, which is not free next to the compute. Results go to
``benchmarks/results/bandwidth.json`` and ``bandwidth.png``.

ZeRO rows (``zero_exact``, ``zero_int8``, ``zero_qwd4``, ``zero_qwd4_had``:
:func:`commjax.zero` around the same SGD, reduce-scatter of gradients + all-gather of
weights, exact / int8 / 4-bit weight differences with 4-bit gradients, without or with the
Hadamard rotation) report their speedup over ``zero_exact``.

A reference row, ``no_exchange``, trains without any exchange (each replica applies its
own gradient): its step time is the compute floor, and
``step(exact, R) / step(no_exchange, R)`` the most any method can gain at rate ``R`` on
this machine, whatever it sends.

Model: an MLP ``d_in -> hidden (depth layers) -> classes`` (GELU; 13.7M parameters by
default) with a small batch per process, so that at 1 Gbit/s the exchange of its fp32
gradients dominates the step; every process gets its own shifted input distribution
(non-i.i.d.). The inputs,
labels and initial parameters come from NumPy with fixed seeds, so the JAX and PyTorch
runs start from the same numbers.

Facts this relies on (kernel and gloo behaviour on the machine this was written on):
``netem`` may be missing (checked and reported; without it the links have no added
delay); gloo advertises the hostname's address unless told which interface to use,
which is wrong across namespaces; at 1 Gbit/s and below gloo's all-reduce runs within a
few percent of the ring bound, its all-gather at ~60-70% of line rate.

Process protocol: process 0 of each job prints ``PHASE <method> <rate>`` before each
measurement phase and waits for ``GO`` on its stdin; this script reshapes the links in
between. Each worker prints one ``RESULT {json}`` line per method.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import netns  # noqa: E402
from _results import write_results  # noqa: E402

RESULTS_DIR = HERE / "results"
AXIS = "data"
RESULT_PREFIX = "RESULT "
PHASE_PREFIX = "PHASE "

#: The model and run configuration (identical for the JAX and the PyTorch workers).
MODEL = dict(d_in=512, hidden=2048, depth=4, classes=10, batch=16, shift=2.0, seed=0)
#: Optimizer after the exchange (JAX: optax.sgd, PyTorch: torch.optim.SGD).
SGD = dict(learning_rate=0.01, momentum=0.9)
#: Untimed steps before the first measurement (1-bit Adam's exact warm-up, the DDP
#: PowerSGD hook's ``start_powerSGD_iter``); every method does them, on unshaped links.
PRELUDE_STEPS = 3

JAX_METHODS = ("no_exchange", "exact", "bf16", "int8", "int4", "sign", "top_k_1pct",
               "powersgd_r4", "onebit_adam", "diloco", "streaming_diloco", "streaming_diloco_q4",
               "zero_exact", "zero_int8", "zero_qwd4", "zero_qwd4_had", "int8_in_backward",
               "sign_in_backward")
#: Sharded data parallel (cj.zero: reduce-scatter + all-gather) rows, timed against
#: exact fp32 ZeRO ("zero_exact") rather than against the exact mean.
ZERO_BASE = "zero_exact"
#: Not a training method: every replica applies its own gradient and nothing is sent. Its
#: step time is the floor under every method's (compute alone), so
#: ``step(exact, R) / step(no_exchange, R)`` bounds the speedup any compressor can reach.
FLOOR = "no_exchange"
TORCH_METHODS = ("ddp_allreduce", "ddp_fp16", "ddp_powersgd_r1", "ddp_powersgd_r4")
#: The methods whose per-step time the targets speak of.
TARGETS = dict(rate="1gbit", min_speedup={"powersgd_r4": 3.0, "sign": 3.0, "zero_qwd4": 3.0},
               min_efficiency=0.7,
               powersgd_pair=("powersgd_r4", "ddp_powersgd_r4"))


# ==================================================================== shared data (numpy)


def init_params(cfg: dict) -> list[tuple[Any, Any]]:
    """``[(kernel [in, out], bias [out]), ...]`` float32, He-normal kernels, zero biases."""
    import numpy as np

    rng = np.random.default_rng(cfg["seed"])
    sizes = [cfg["d_in"]] + [cfg["hidden"]] * cfg["depth"] + [cfg["classes"]]
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        k = (rng.standard_normal((a, b), dtype=np.float32) * np.float32(np.sqrt(2.0 / a)))
        layers.append((k.astype(np.float32), np.zeros((b,), np.float32)))
    return layers


def make_batch(cfg: dict, rank: int, world: int) -> tuple[Any, Any]:
    """Process ``rank``'s fixed batch: inputs centred at its own offset, teacher labels."""
    import numpy as np

    rng = np.random.default_rng(cfg["seed"] + 1)
    teacher = rng.standard_normal((cfg["d_in"], cfg["classes"])).astype(np.float32)
    offsets = rng.standard_normal((world, cfg["d_in"])).astype(np.float32)
    offsets /= np.linalg.norm(offsets, axis=1, keepdims=True)
    local = np.random.default_rng(cfg["seed"] + 100 + rank)
    x = local.standard_normal((cfg["batch"], cfg["d_in"])).astype(np.float32)
    x += np.float32(cfg["shift"]) * offsets[rank]
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)
    return x, y


def num_params(cfg: dict) -> int:
    sizes = [cfg["d_in"]] + [cfg["hidden"]] * cfg["depth"] + [cfg["classes"]]
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


# ================================================================ worker-side protocol


def emit(payload: dict) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(payload, sort_keys=True) + "\n")
    sys.stdout.flush()


def wait_phase(rank: int, method: str, rate: str) -> None:
    """Process 0 asks the orchestrator to shape the links for ``rate`` and waits for it;
    the other processes go on and block in the next collective until process 0 comes."""
    if rank != 0:
        return
    sys.stdout.write(f"{PHASE_PREFIX}{method} {rate}\n")
    sys.stdout.flush()
    line = sys.stdin.readline()
    if line.strip() != "GO":
        raise SystemExit(f"worker 0: expected GO from the orchestrator, got {line!r}")


def timed_phases(rank: int, method: str, rates: list[str], steps: int,
                 step: Callable[[], None]) -> dict[str, list[float]]:
    """Run the prelude, then for each rate one untimed step and ``steps`` timed ones."""
    wait_phase(rank, method, "none")
    for _ in range(PRELUDE_STEPS):
        step()
    times: dict[str, list[float]] = {}
    for rate in rates:
        wait_phase(rank, method, rate)
        step()  # absorbs process 0's wait and the change of rate
        ts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        times[rate] = ts
    return times


# ====================================================================== the JAX worker


class Unavailable(Exception):
    """This commjax has no such method (yet)."""


def _lookup(name: str, modules: tuple[str, ...]) -> Any:
    """``cj.<name>``, else ``<module>.<name>`` for the given submodules, else Unavailable."""
    import importlib

    import commjax as cj

    if hasattr(cj, name):
        return getattr(cj, name)
    for mod in modules:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, name):
            return getattr(m, name)
    raise Unavailable(f"commjax has no {name} (neither cj.{name} nor in {', '.join(modules)})")


@dataclasses.dataclass
class JaxMethod:
    tx: Any  # the optax transformation that runs
    plan_bytes: float  # analytic per-device bytes of one timed step (average)
    bytes_tx: Any = None  # a variant compiled only to read the timed stage's HLO bytes
    note: str = ""
    per_replica_params: bool = False  # parameters differ between replicas (DiLoCo)
    sync_every: int = 1  # HLO bytes are those of one sync step; divided by this per step
    # False only for the no-exchange floor: replicas' parameters and state then differ,
    # and the step is timed as if they did not (nothing is sent to make them agree).
    check_vma: bool = True
    # (cj.sync_in_backward, the optimizer): the exchange runs in the backward pass; ``tx``
    # is then chain(sync.as_transform(), optimizer), for the state and the byte count.
    sync: Any = None


def jax_method(name: str, params: Any, n: int, steps: int = 5) -> JaxMethod:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import commjax as cj

    sgd = optax.sgd(SGD["learning_rate"], momentum=SGD["momentum"])

    def via_compressed_mean(comp: Any, note: str = "") -> JaxMethod:
        plan = cj.communication_plan(comp, params, n)
        return JaxMethod(optax.chain(cj.compressed_mean(comp, AXIS), sgd), plan.bytes_per_step,
                         note=note or f"{plan.routing.reducer} reducer")

    if name.endswith("_in_backward"):
        codec = {"int8": cj.quantize(bits=8), "sign": cj.sign()}[name[:-len("_in_backward")]]
        sync = cj.sync_in_backward(codec, AXIS)
        plan = cj.communication_plan(codec, params, n)
        return JaxMethod(optax.chain(sync.as_transform(), sgd), plan.bytes_per_step, sync=(sync, sgd),
                         note="exchanged in the backward pass (cj.sync_in_backward, 25 MB buckets)")
    if name == FLOOR:
        return JaxMethod(sgd, 0.0, check_vma=False,
                         note="floor: no exchange, each replica applies its own gradient")
    if name == "exact":
        return via_compressed_mean(cj.identity())
    if name == "bf16":
        return via_compressed_mean(cj.cast(jnp.bfloat16))
    if name == "int8":
        return via_compressed_mean(cj.quantize(bits=8))
    if name == "int4":
        return via_compressed_mean(cj.quantize(bits=4))
    if name == "sign":
        return via_compressed_mean(cj.sign())
    if name == "top_k_1pct":
        top_k = _lookup("top_k", ("commjax.compressors.sparse",))
        return via_compressed_mean(top_k(ratio=0.01))
    if name == "powersgd_r4":
        powersgd = _lookup("powersgd", ("commjax.compressors.powersgd",))
        return via_compressed_mean(powersgd(rank=4))
    if name == "onebit_adam":
        onebit_adam = _lookup("onebit_adam", ("commjax.optimizers.onebit", "commjax.optimizers"))
        lr = 1e-3
        plan = cj.communication_plan(cj.sign(block_size=256), params, n, reducer="two_phase")
        return JaxMethod(
            onebit_adam(lr, warmup_steps=PRELUDE_STEPS, axis_name=AXIS), plan.bytes_per_step,
            bytes_tx=onebit_adam(lr, warmup_steps=0, axis_name=AXIS),
            note=f"exact Adam for the {PRELUDE_STEPS} untimed prelude steps, then 1-bit",
        )
    if name == "diloco":
        diloco = _lookup("diloco", ("commjax.optimizers.diloco", "commjax.optimizers"))
        # One sync per timed window: any `steps` consecutive steps hold exactly one sync.
        h = steps
        n_params = sum(int(np.prod(np.shape(l))) for l in jax.tree_util.tree_leaves(params))
        return JaxMethod(
            diloco(sgd, optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=h,
                   axis_name=AXIS),
            cj.ring_bytes("all-reduce", 4 * n_params, n) / h, per_replica_params=True, sync_every=h,
            note=(f"sync every {h} steps (inner: the same SGD; outer: Nesterov SGD 0.7/0.9); "
                  "step time = mean over a window holding one sync; bytes averaged per step"),
        )
    if name.startswith("streaming_diloco"):
        return streaming_method(name, params, n, sgd, steps)
    if name.startswith("zero_"):
        return zero_method(name, params, n, sgd)
    raise ValueError(f"unknown JAX method {name!r}; known: {', '.join(JAX_METHODS)}")


def streaming_method(name: str, params: Any, n: int, sgd: Any, steps: int) -> JaxMethod:
    """cj.streaming_diloco with 4 fragments (2 or 1 when they do not divide ``steps``), fp32
    or 4-bit outer gradients, one round per timed window: every fragment is synced once in
    any ``steps`` consecutive steps."""
    import optax

    import commjax as cj

    frags = next(f for f in (4, 2, 1) if steps % f == 0)
    comp = cj.quantize(bits=4, block_size=512) if name.endswith("_q4") else None
    tx = cj.streaming_diloco(sgd, optax.sgd(0.7, momentum=0.9, nesterov=True), sync_every=steps,
                             fragments=frags, compressor=comp, axis_name=AXIS, num_replicas=n)
    b = cj.communication_plan(tx, params, n)
    return JaxMethod(
        tx, b.bytes_per_step, per_replica_params=True, sync_every=steps,
        note=(f"{frags} fragments, one synced every {steps // frags} steps ({'4-bit' if comp else 'fp32'}; "
              f"peak {b.peak_bytes:,.0f} B); step time = mean over a window holding one sync of each"),
    )


def zero_method(name: str, params: Any, n: int, sgd: Any) -> JaxMethod:
    """ZeRO-2 (cj.zero): the same SGD on 1/n shards; exact, int8 (weights and grads), or
    4-bit weight differences (qWD) + 4-bit grads, without or with the 32-wide Hadamard
    rotation of the grads (SDP4Bit's single-level pair; a 32 x 32 product per chunk of the
    full gradient, CPU time that a GPU hides)."""
    import commjax as cj

    kw = {
        "zero_exact": {},
        "zero_int8": dict(grad_codec=cj.quantize(bits=8), weight_codec=cj.quantize(bits=8, stochastic=False)),
        "zero_qwd4": dict(grad_codec=cj.quantize(bits=4), weight_codec=cj.quantize(bits=4, stochastic=False)),
        "zero_qwd4_had": dict(grad_codec=cj.hadamard(cj.quantize(bits=4)),
                              weight_codec=cj.quantize(bits=4, stochastic=False)),
    }[name]
    tx = cj.zero(sgd, AXIS, num_replicas=n, **kw)
    plan = cj.communication_plan(tx, params, n)
    return JaxMethod(tx, plan.bytes_per_step,
                     note=f"ZeRO-2: reduce-scatter {plan.bytes_of('gradient') / 1e6:.1f} MB + "
                          f"all-gather {plan.bytes_of('weight') / 1e6:.1f} MB per device")


def jax_worker(args: argparse.Namespace) -> None:
    from commjax import distributed

    distributed.initialize_from_env(required=True)

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import commjax as cj
    from commjax import _compat

    cfg = json.loads(args.model)
    rank, world = jax.process_index(), jax.process_count()
    mesh = distributed.global_mesh(AXIS)
    n = mesh.devices.size

    class MLP(nn.Module):
        sizes: tuple

        @nn.compact
        def __call__(self, x):
            for i, s in enumerate(self.sizes):
                x = nn.Dense(s)(x)
                if i < len(self.sizes) - 1:
                    x = jax.nn.gelu(x)
            return x

    sizes = tuple([cfg["hidden"]] * cfg["depth"] + [cfg["classes"]])
    model = MLP(sizes)
    layers = init_params(cfg)
    host_params = {f"Dense_{i}": {"kernel": k, "bias": b} for i, (k, b) in enumerate(layers)}
    template = model.init(jax.random.PRNGKey(0), jnp.zeros((1, cfg["d_in"])))["params"]
    assert jax.tree_util.tree_structure(template) == jax.tree_util.tree_structure(host_params)

    x_local, y_local = make_batch(cfg, rank, world)
    data_sharding = NamedSharding(mesh, P(AXIS))
    x = jax.make_array_from_process_local_data(data_sharding, x_local)
    y = jax.make_array_from_process_local_data(data_sharding, y_local)
    replicated = NamedSharding(mesh, P())

    def loss_fn(p, xb, yb):
        logits = model.apply({"params": p}, xb)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, yb))

    def mean_loss(p, xb, yb):
        return _compat.psum(loss_fn(p, xb, yb), AXIS) / n

    eval_loss = jax.jit(_compat.shard_map(mean_loss, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                                          out_specs=P()))
    eval_loss_per_replica = jax.jit(_compat.shard_map(
        lambda p, xb, yb: mean_loss(jax.tree_util.tree_map(lambda a: a[0], p), xb, yb),
        mesh=mesh, in_specs=(P(AXIS), P(AXIS), P(AXIS)), out_specs=P()))

    def build(tx, state, per_replica_params, check_vma=True, sync=None):
        specs = cj.state_specs(state, AXIS)
        pspec = P(AXIS) if per_replica_params else P()

        def local(p, s, xb, yb):
            if per_replica_params:  # [1, ...] local rows: this replica's own parameters
                p = jax.tree_util.tree_map(lambda a: a[0], p)
            if sync is not None:  # the exchange inside the backward pass
                (_, g), s0 = sync[0].value_and_grad(loss_fn)(p, s[0], xb, yb)
                u, s1 = sync[1].update(g, s[1], p)
                return optax.apply_updates(p, u), (s0, s1)
            g = jax.grad(loss_fn)(cj.vary(p, AXIS), xb, yb)
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
            if per_replica_params:
                p = jax.tree_util.tree_map(lambda a: a[None], p)
            return p, s

        # Outputs placed as the inputs are (empty per-replica leaves may be replicated),
        # so that the compiled step takes its own output as its next input.
        out_sh = (NamedSharding(mesh, pspec), jax.tree_util.tree_map(lambda a: a.sharding, state))
        return jax.jit(_compat.shard_map(local, mesh=mesh, in_specs=(pspec, specs, P(AXIS), P(AXIS)),
                                         out_specs=(pspec, specs), check_vma=check_vma),
                       out_shardings=out_sh, donate_argnums=(0, 1))

    def place_params(per_replica_params):
        if per_replica_params:
            return jax.tree_util.tree_map(
                lambda a: jax.make_array_from_process_local_data(data_sharding, a[None]),
                host_params)
        return jax.device_put(host_params, replicated)

    for name in args.methods.split(","):
        row: dict[str, Any] = {"framework": "commjax", "method": name, "processes": world,
                               "devices": n, "params": num_params(cfg)}
        try:
            m = jax_method(name, host_params, n, args.steps)
        except Unavailable as e:
            row.update(available=False, reason=str(e))
            if rank == 0:
                emit(row)
            continue
        params = place_params(m.per_replica_params)
        state = cj.shard_state(m.tx.init(host_params), mesh, AXIS)
        t0 = time.perf_counter()
        step_fn = build(m.tx, state, m.per_replica_params, m.check_vma, m.sync).lower(
            params, state, x, y).compile()
        compile_s = time.perf_counter() - t0
        hlo = cj.collective_bytes(step_fn)
        if m.bytes_tx is not None:  # e.g. 1-bit Adam: only the compressed stage's bytes
            s2 = cj.shard_state(m.bytes_tx.init(host_params), mesh, AXIS)
            hlo = cj.collective_bytes(
                build(m.bytes_tx, s2, m.per_replica_params).lower(params, s2, x, y).compile())
            del s2
        box = {"p": params, "s": state}

        def step() -> None:
            box["p"], box["s"] = step_fn(box["p"], box["s"], x, y)
            jax.block_until_ready(box["p"])  # one multi-device step in flight at a time

        times = timed_phases(rank, name, args.rates.split(","), args.steps, step)
        loss = float((eval_loss_per_replica if m.per_replica_params else eval_loss)(box["p"], x, y))
        row.update(
            available=True, note=m.note, compile_s=compile_s, plan_bytes=m.plan_bytes,
            hlo_bytes=hlo.total_ring_bytes / m.sync_every, hlo_collectives=len(hlo),
            hlo_dtypes=sorted(hlo.dtypes), statistic="mean" if m.sync_every > 1 else "median",
            loss=loss, steps=PRELUDE_STEPS + len(times) * (args.steps + 1), times=times,
        )
        if rank == 0:
            emit(row)
        del box, params, state, step_fn


# ================================================================= orchestrator


@dataclasses.dataclass
class JobResult:
    rows: list[dict]
    returncodes: list[Optional[int]]
    tails: list[list[str]]
    timed_out: bool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(net: netns.Network, argv_for: Callable[[int], list[str]],
            env_for: Callable[[int], dict], *, timeout: float, log: Callable[[str], None]
            ) -> JobResult:
    """Start one process per namespace, serve PHASE requests of process 0, collect RESULTs."""
    procs: list[subprocess.Popen] = []
    tails: list[list[str]] = [[] for _ in range(net.n)]
    rows: list[dict] = []
    lock = threading.Lock()

    def pump(i: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            with lock:
                tails[i].append(line)
                del tails[i][:-40]
            if line.startswith(RESULT_PREFIX) and i == 0:
                rows.append(json.loads(line[len(RESULT_PREFIX):]))
                r = rows[-1]
                log(f"  {r['framework']}/{r['method']}: "
                    + ("done" if r.get("available") else f"not available ({r.get('reason')})"))
            elif line.startswith(PHASE_PREFIX) and i == 0:
                method, rate = line[len(PHASE_PREFIX):].split()
                net.shape(netns.parse_rate(rate))
                log(f"  phase {method} @ {rate}")
                assert proc.stdin is not None
                proc.stdin.write("GO\n")
                proc.stdin.flush()

    threads = []
    timed_out = False
    try:
        for i in range(net.n):
            proc = subprocess.Popen(
                [*net.exec_prefix(i), *argv_for(i)], env=env_for(i), cwd=str(REPO),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, bufsize=1, start_new_session=True)
            procs.append(proc)
            t = threading.Thread(target=pump, args=(i, proc), daemon=True)
            t.start()
            threads.append(t)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the others fail or finish on their own
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for t in threads:
            t.join(timeout=5)
    return JobResult(rows, [p.returncode for p in procs], tails, timed_out)


#: glibc malloc settings for every worker (JAX and PyTorch alike): keep freed memory in
#: the heap instead of returning it to the kernel, so that the step's large buffers are
#: reused rather than page-faulted in afresh every step (on the VM this was written on a
#: first touch of 55 MB cost ~0.3 s, which would otherwise be charged to "compute").
#: One arena: buffers freed by the runtime's worker threads otherwise land in per-thread
#: arenas whose heaps glibc shrinks with madvise, and are faulted in again on the next
#: step (seen: ~53k page faults per step of the exact mean without it, none with it).
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
              "MALLOC_TOP_PAD_": str(1 << 30), "MALLOC_ARENA_MAX": "1"}


def _jax_env(i: int, n: int, coordinator: str, interface: str) -> dict:
    from commjax.launch import child_env

    env = child_env(i, n, 1, coordinator, interface=interface)
    flags = env.get("XLA_FLAGS", "")
    # One compute thread per process: the processes share this machine's cores.
    env["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false "
                        "intra_op_parallelism_threads=1").strip()
    env["OMP_NUM_THREADS"] = "1"
    env.update(MALLOC_ENV)
    return env


def _machine() -> dict:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(), "kernel": platform.release(),
        "python": platform.python_version(), "cores": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["memory_gib"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import jax

        info["jax"] = jax.__version__
    except ImportError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def _loadavg() -> list[float]:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def summarize(rows: list[dict], rates: list[str], unshaped_goodput: Optional[float]) -> None:
    """Add medians, compute-time estimates, speedups over the exact mean and ideal
    speedups to the rows in place (see the module docstring for the formulas)."""
    exact = {"commjax": "exact", "torch": "ddp_allreduce"}
    by_name = {(r["framework"], r["method"]): r for r in rows if r.get("available")}
    for r in rows:
        if not r.get("available"):
            continue
        # Median step time; the mean over the window for methods whose steps differ by
        # design (DiLoCo: inner steps and one sync step per window).
        stat = statistics.mean if r.get("statistic") == "mean" else statistics.median
        r["step_s"] = {k: stat(v) for k, v in r["times"].items()}
        t_none = r["step_s"].get("none")
        if t_none is not None:
            local = r["plan_bytes"] * 8 / unshaped_goodput if unshaped_goodput else 0.0
            r["compute_s"] = max(t_none - local, 0.0)
    for r in rows:
        if not r.get("available"):
            continue
        base = by_name.get((r["framework"], exact[r["framework"]]))
        if r["method"].startswith("zero_") and ("commjax", ZERO_BASE) in by_name:
            base = by_name[("commjax", ZERO_BASE)]
        # Both frameworks are compared with commjax's exact mean as well.
        cj_base = by_name.get(("commjax", "exact"))
        t_comp = r.get("compute_s")
        r["per_rate"] = {}
        for rate in rates:
            t = r["step_s"].get(rate)
            if t is None:
                continue
            entry: dict[str, Any] = {"step_s": t}
            bps = netns.parse_rate(rate)
            if base is not None and rate in base["step_s"]:
                entry["speedup"] = base["step_s"][rate] / t
            if cj_base is not None and rate in cj_base["step_s"]:
                entry["speedup_vs_commjax_exact"] = cj_base["step_s"][rate] / t
            if bps is not None and t_comp is not None and base is not None \
                    and base.get("compute_s") is not None:
                ideal_m = t_comp + r["plan_bytes"] * 8 / bps
                ideal_b = base["compute_s"] + base["plan_bytes"] * 8 / bps
                entry["ideal_s"] = ideal_m
                entry["ideal_speedup"] = ideal_b / ideal_m
                if "speedup" in entry:
                    entry["efficiency"] = entry["speedup"] / entry["ideal_speedup"]
                entry["comm_fraction_of_ideal"] = (r["plan_bytes"] * 8 / bps) / ideal_m
            r["per_rate"][rate] = entry


def check_targets(rows: list[dict]) -> list[dict]:
    rate = TARGETS["rate"]
    by = {r["method"]: r for r in rows if r.get("available")}
    out = []
    t_exact = by.get("exact", {}).get("step_s", {}).get(rate)
    t_floor = by.get(FLOOR, {}).get("step_s", {}).get(rate)
    for m, need in TARGETS["min_speedup"].items():
        e = by.get(m, {}).get("per_rate", {}).get(rate, {})
        got = e.get("speedup")
        versus = ZERO_BASE if m.startswith("zero_") else "exact"
        entry = dict(target=f"{m} >= {need}x faster per step than {versus} @ {rate}",
                     value=got, met=None if got is None else got >= need)
        if t_exact and t_floor:
            # No method's step is shorter than computing alone (the no-exchange floor).
            entry["bound"] = t_exact / t_floor
        out.append(entry)
    for r in rows:
        e = r.get("per_rate", {}).get(rate, {})
        if r.get("available") and "efficiency" in e \
                and r["method"] not in ("exact", "ddp_allreduce", FLOOR, ZERO_BASE):
            out.append(dict(target=f"{r['framework']}/{r['method']} >= "
                                   f"{TARGETS['min_efficiency']:.0%} of its ideal speedup @ {rate}",
                            value=e["efficiency"], met=e["efficiency"] >= TARGETS["min_efficiency"]))
    a, b = TARGETS["powersgd_pair"]
    ta = by.get(a, {}).get("step_s", {}).get(rate)
    tb = by.get(b, {}).get("step_s", {}).get(rate)
    out.append(dict(target=f"commjax {a} step <= torch DDP {b} step @ {rate}",
                    value=None if ta is None or tb is None else ta / tb,
                    met=None if ta is None or tb is None else ta <= tb))
    return out


def table(rows: list[dict], rates: list[str]) -> str:
    head = ["framework", "method", "plan MB", "HLO MB", "loss"]
    for rate in rates:
        head += [f"{rate} s", "x", "ideal x", "eff"]
    lines = [head]
    for r in rows:
        if not r.get("available"):
            lines.append([r["framework"], r["method"], "not available: " + r.get("reason", "")])
            continue
        line = [r["framework"], r["method"], f"{r['plan_bytes'] / 1e6:.2f}",
                "-" if r.get("hlo_bytes") is None else f"{r['hlo_bytes'] / 1e6:.2f}",
                f"{r['loss']:.4f}"]
        for rate in rates:
            e = r.get("per_rate", {}).get(rate, {})
            fmt = lambda k, f: "-" if k not in e else f.format(e[k])  # noqa: E731
            line += [fmt("step_s", "{:.3f}"), fmt("speedup", "{:.2f}"),
                     fmt("ideal_speedup", "{:.2f}"), fmt("efficiency", "{:.0%}")]
        lines.append(line)
    full = [l for l in lines if len(l) == len(head)]
    widths = [max(len(l[i]) for l in full) for i in range(len(head))]
    out = []
    for l in lines:
        if len(l) != len(head):
            out.append("  ".join([l[0].ljust(widths[0]), l[1].ljust(widths[1]), l[2]]))
        else:
            out.append("  ".join(v.rjust(w) if i >= 2 else v.ljust(w)
                                 for i, (v, w) in enumerate(zip(l, widths))))
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def plot(rows: list[dict], rates: list[str], path: Path, title: str,
         goodput: Optional[dict] = None) -> None:
    """Step time against link rate, one line per method; the unshaped links are drawn at
    their measured TCP goodput (open markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    xs = {}
    for rate in rates:
        bps = netns.parse_rate(rate)
        if bps is None:
            if goodput and goodput.get("none"):
                xs[rate] = goodput["none"] / 1e9
        else:
            xs[rate] = bps / 1e9
    order = sorted(xs, key=lambda r: xs[r])
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = plt.get_cmap("tab20").colors
    for k, r in enumerate([r for r in rows if r.get("available")]):
        pts = [(xs[rate], r["step_s"][rate], rate) for rate in order if rate in r["step_s"]]
        if not pts:
            continue
        torch_row = r["framework"] != "commjax"
        color = colors[(2 * k) % 20 if k < 10 else (2 * k + 1) % 20]
        label = f"torch {r['method']}" if torch_row else r["method"]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if torch_row else "-",
                color=color, label=label, marker="s" if torch_row else "o", markersize=4)
        for x, y, rate in pts:
            if netns.parse_rate(rate) is None:
                ax.plot([x], [y], marker="o", markersize=8, mfc="none", color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("link rate per host and direction, Gbit/s (tc tbf; open circles: unshaped "
                  "veth, at its measured TCP goodput)", fontsize=8)
    ax.set_ylabel("step time, s (median; DiLoCo: mean over a window with one sync)", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _title(result: dict) -> str:
    m, c = result["machine"], result["config"]
    return (f"{result['conditions']['processes']} processes x 1 CPU device, "
            f"{c['params'] / 1e6:.1f}M-param MLP, batch {c['model']['batch']}/process, "
            f"{result['date'][:10]}, {m.get('cpu', '?')} ({m.get('cores')} cores, load "
            f"{result['conditions']['loadavg_before'][0]:.0f}-"
            f"{result['conditions']['loadavg_after'][0]:.0f})")


def orchestrate(args: argparse.Namespace) -> int:
    netns.check_environment()
    netns.install_signal_handlers()
    rates = [netns.format_rate(netns.parse_rate(r)) for r in args.rates.split(",")]
    if "none" not in rates:
        rates = ["none"] + rates  # the ideal speedups need the unshaped step time
    jax_methods = [m for m in args.methods.split(",") if m]
    for m in jax_methods:
        if m not in JAX_METHODS:
            raise SystemExit(f"--methods: unknown method {m!r}; known: {', '.join(JAX_METHODS)}")
    torch_methods = [m for m in args.torch_methods.split(",") if m]
    for m in torch_methods:
        if m not in TORCH_METHODS:
            raise SystemExit(f"--torch-methods: unknown {m!r}; known: {', '.join(TORCH_METHODS)}")
    torch_ok = not args.no_torch
    if torch_ok:
        try:
            import torch  # noqa: F401
        except ImportError:
            torch_ok = False
            print("PyTorch is not installed: DDP rows skipped (pip install torch).")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    stale = netns.remove_stale()
    if stale:
        log(f"removed stale namespaces of earlier runs: {', '.join(stale)}")
    netem_ok, netem_msg = netns.netem_available()
    log(netem_msg)
    cfg = dict(MODEL, hidden=args.hidden, depth=args.depth, batch=args.batch)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = _loadavg()
    rows: list[dict] = []
    goodput: dict[str, float] = {}
    failures: list[str] = []
    t_start = time.monotonic()
    with netns.Network(args.processes, subnet=args.subnet) as net:
        log(f"network: {net.n} namespaces on a bridge, {net.subnet}.0/24, "
            f"coordinator {net.addresses[0]}")
        for rate in rates:
            net.shape(netns.parse_rate(rate))
            goodput[rate] = netns.tcp_goodput(net, 0, 1, seconds=1.5)
            log(f"TCP goodput host0->host1 @ {rate}: {goodput[rate] / 1e6:.0f} Mbit/s")
        net.shape(None)
        py = sys.executable
        model_json = json.dumps(cfg)
        common = ["--model", model_json, "--rates", ",".join(rates), "--steps", str(args.steps)]
        if jax_methods:
            coordinator = f"{net.addresses[0]}:{_free_port()}"
            log(f"JAX job: {len(jax_methods)} methods x {len(rates)} rates")
            res = run_job(
                net, lambda i: [py, str(Path(__file__).resolve()), "--worker", "jax",
                                "--methods", ",".join(jax_methods), *common],
                lambda i: _jax_env(i, net.n, coordinator, net.interface),
                timeout=args.job_timeout, log=log)
            rows += res.rows
            if res.timed_out or any(rc != 0 for rc in res.returncodes):
                failures.append(f"JAX job: exit codes {res.returncodes}, timed out {res.timed_out}")
                for i, t in enumerate(res.tails):
                    print(f"--- JAX process {i} (last lines) ---\n" + "\n".join(t[-15:]))
        if torch_ok and torch_methods:
            port = _free_port()
            log(f"PyTorch DDP job: {len(torch_methods)} methods x {len(rates)} rates")

            def torch_env(i: int) -> dict:
                env = dict(os.environ)
                env.update(MASTER_ADDR=net.addresses[0], MASTER_PORT=str(port), RANK=str(i),
                           WORLD_SIZE=str(net.n), GLOO_SOCKET_IFNAME=net.interface,
                           OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **MALLOC_ENV)
                env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO),
                                                     env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
                return env

            res = run_job(
                net, lambda i: [py, str(HERE / "vs_torch_ddp.py"),
                                "--methods", ",".join(torch_methods), *common],
                torch_env, timeout=args.job_timeout, log=log)
            rows += res.rows
            if res.timed_out or any(rc != 0 for rc in res.returncodes):
                failures.append(f"torch job: exit codes {res.returncodes}, timed out {res.timed_out}")
                for i, t in enumerate(res.tails):
                    print(f"--- torch process {i} (last lines) ---\n" + "\n".join(t[-15:]))
    wall = time.monotonic() - t_start
    summarize(rows, rates, goodput.get("none"))
    targets = check_targets(rows)
    print()
    print(table(rows, rates))
    print()
    print("x = speedup over the same framework's exact mean; ideal x from bytes: "
          "t_compute + bytes*8/rate, t_compute = t_unshaped - bytes*8/goodput_unshaped "
          f"({goodput.get('none', 0) / 1e9:.2f} Gbit/s). {netem_msg}.")
    for t in targets:
        verdict = "n/a" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        val = "-" if t["value"] is None else f"{t['value']:.2f}"
        bound = (f" (at most {t['bound']:.2f}x here: exact / {FLOOR} step)"
                 if t.get("bound") else "")
        print(f"  target: {t['target']}: {val} -> {verdict}{bound}")
    for f in failures:
        print(f"  FAILED: {f}")
    result = {
        "date": started.isoformat(timespec="seconds"),
        "wall_s": wall,
        "machine": _machine(),
        "conditions": {
            "loadavg_before": load_before, "loadavg_after": _loadavg(),
            "note": args.note or "",
            "processes": args.processes, "devices_per_process": 1,
            "shaping": "tc tbf on every veth, both directions (host eth0 and bridge port egress)",
            "worker_env": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false "
                           "intra_op_parallelism_threads=1", "OMP_NUM_THREADS": "1",
                           "torch.set_num_threads": 1, **MALLOC_ENV},
            "netem": netem_msg, "tcp_goodput_bps": goodput,
        },
        "config": {"model": cfg, "sgd": SGD, "prelude_steps": PRELUDE_STEPS,
                   "timed_steps_per_rate": args.steps, "rates": rates,
                   "params": num_params(cfg)},
        "rows": rows,
        "targets": targets,
        "failures": failures,
    }
    out_json = Path(args.out)
    write_results(out_json, result, sort_keys=True)
    result = json.loads(out_json.read_text())  # with its provenance (the plot's title reads it)
    try:
        plot(rows, rates, out_json.with_suffix(".png"), _title(result), goodput)
    except ImportError:
        print("matplotlib missing: no PNG written")
    log(f"wrote {out_json} and {out_json.with_suffix('.png').name} ({wall / 60:.1f} min)")
    return 1 if failures else 0


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["jax"], help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--processes", type=int, default=4, help="JAX/torch processes (namespaces)")
    p.add_argument("--rates", default="none,1gbit,100mbit",
                   help="comma-separated link rates (tbf), 'none' = unshaped")
    p.add_argument("--steps", type=int, default=5, help="timed steps per method and rate")
    p.add_argument("--methods", default=",".join(JAX_METHODS), help="commjax methods")
    p.add_argument("--torch-methods", default=",".join(TORCH_METHODS), help="DDP methods")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch DDP runs")
    p.add_argument("--hidden", type=int, default=MODEL["hidden"], help="MLP width")
    p.add_argument("--depth", type=int, default=MODEL["depth"], help="hidden layers")
    p.add_argument("--batch", type=int, default=MODEL["batch"], help="examples per process")
    p.add_argument("--subnet", default="10.213.7", help="private /24 inside the namespaces")
    p.add_argument("--job-timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--note", default="", help="free text stored with the results")
    p.add_argument("--out", default=str(RESULTS_DIR / "bandwidth.json"))
    p.add_argument("--replot", action="store_true",
                   help="only redraw the PNG from the JSON at --out (no root needed)")
    args = p.parse_args(argv)
    if args.replot:
        result = json.loads(Path(args.out).read_text())
        plot(result["rows"], result["config"]["rates"], Path(args.out).with_suffix(".png"),
             _title(result), result["conditions"].get("tcp_goodput_bps"))
        return 0
    if args.worker == "jax":
        jax_worker(args)
        return 0
    if args.processes < 2:
        p.error("--processes must be >= 2")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return orchestrate(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the namespaces and workers are gone already (finally blocks)
        print("\ninterrupted: workers stopped, network namespaces removed", file=sys.stderr)
        sys.exit(130)
