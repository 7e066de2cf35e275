"""Multi-process start-up for commjax: a thin, version-tolerant wrapper over
``jax.distributed.initialize``.

commjax adds no process manager or transport of its own (see docs/multihost.md): every
process runs the same SPMD program, ``jax.distributed`` connects them, and XLA's
collectives (gloo on CPU, NCCL on GPU, ICI/DCN on TPU) move the bytes. This module
only

* reads the environment that [`commjax.launch`][] (or any other launcher) sets,
* sizes the local CPU device count *before* the backend starts,
* makes sure CPU collectives are gloo, optionally pinned to one network interface,
* calls ``jax.distributed.initialize`` with finite time-outs, passing only the
  keyword arguments the installed JAX accepts, and
* builds the 1-D global data-parallel mesh.

Environment variables (all set by ``python -m commjax.launch``)
----------------------------------------------------------------
``COMMJAX_COORDINATOR``      ``host:port`` of the coordination service (process 0).
``COMMJAX_NUM_PROCESSES``    number of processes ``N``.
``COMMJAX_PROCESS_ID``       this process' id in ``0..N-1``.
``COMMJAX_LOCAL_DEVICES``    CPU devices per process (``jax_num_cpu_devices``); optional.
``COMMJAX_INTERFACE``        network interface gloo advertises (e.g. ``eth0``); optional.
``COMMJAX_INIT_TIMEOUT``     seconds to wait for all processes to connect (default 60).
``COMMJAX_HEARTBEAT_TIMEOUT`` seconds without heartbeats before a peer is declared dead
                             (default 10).
``COMMJAX_SHUTDOWN_TIMEOUT`` seconds the exit barrier waits for the others (default 10).

Time-outs and what happens when a peer dies
-------------------------------------------
* ``initialization_timeout``: [`initialize`][commjax.distributed.initialize] (``client.connect()``)
  blocks until
  all ``N`` processes have registered with the coordinator; after this many seconds it
  raises instead of hanging (e.g. a process never started, or a wrong port).
* ``heartbeat_timeout``: every client sends heartbeats to the coordination service
  (hosted inside process 0). A process that stops heart-beating for this long is
  declared dead; the service then reports the error to every other process, whose
  client aborts it (XLA logs ``Terminating process because the JAX distributed
  service detected fatal errors ... another task died`` and the process ends with
  SIGABRT). If process 0 itself dies, the service is gone and the clients notice the
  lost heartbeats the same way.
* A collective in flight (or the next one) when a peer dies: gloo works over plain TCP
  sockets, so the survivors see it at once: the jitted call raises
  ``JaxRuntimeError: Gloo all-reduce failed: ... Connection closed by peer``. The
  Python exception unwinds, and at exit JAX's shutdown barrier waits until the
  heartbeat time-out declares the dead process gone, then aborts as above. Measured
  here (JAX 0.10.2, 3 processes, ``os._exit`` in one after a psum, heartbeat 5 s):
  the survivors end with SIGABRT about 6 s after the death, 10 s later by default.
  When the socket is not closed cleanly (host gone, network partition), only the
  heartbeat time-out stops them.
* ``shutdown_timeout``: at interpreter exit JAX runs a shutdown barrier that waits for
  every process to reach it. If a peer is slow to finish, the others wait at most
  this long (a dead peer is caught sooner by the heartbeat time-out).

[`commjax.launch`][] does not rely on any of this: as soon as one child exits
non-zero it terminates the others (SIGTERM, then SIGKILL), so a run fails fast with
the failing process' exit code. The time-outs matter for other launchers (Slurm,
mpirun, Kubernetes) and for children the launcher cannot see.

Gloo and the network interface
------------------------------
JAX creates its CPU collectives in ``jax._src.xla_bridge.make_cpu_client``: when
``jax.distributed`` is initialised and ``jax_cpu_collectives_implementation`` is
``"gloo"`` (the default in 0.10.2, where the option can also be ``"mpi"`` or
``"megascale"``; older JAX defaulted to no CPU collectives, so
[`initialize`][commjax.distributed.initialize]
selects gloo when the option is unset) it calls
``_jax.make_gloo_tcp_collectives(distributed_client=...)``. That jaxlib function
accepts ``hostname=`` and ``interface=`` keyword arguments, copied into gloo's
``transport::tcp::attr`` (``attr.hostname`` / ``attr.iface``), but JAX never passes
them and offers no config option or environment variable for them. Left unset, gloo
resolves ``gethostname()`` with ``getaddrinfo`` and advertises the first address it
can bind (on this machine ``vm`` -> 127.0.0.1); with ``iface`` set it binds and
advertises that interface's first address in ``getifaddrs`` order (checked here:
``interface="eth0"`` makes every gloo listener bind 192.0.2.2 instead of 127.0.0.1,
and the collectives still run). Each process publishes its gloo address through the
coordinator's key-value store, so the advertised address must be reachable from every
peer: across network namespaces or hosts, a hostname that resolves to loopback breaks
gloo while the coordinator (which binds ``[::]:port``) still works.
[`initialize`][commjax.distributed.initialize] with ``interface=`` therefore re-registers JAX's
``"cpu"`` backend
factory with one that builds the gloo collectives with ``interface=...``. This uses
private JAX API; if it is missing in a future JAX version a ``RuntimeWarning`` is
issued and JAX's default selection is used.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import socket
import warnings
from collections.abc import Mapping
from typing import Any

import jax

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_LOCAL_DEVICES",
    "ENV_INTERFACE",
    "ENV_INIT_TIMEOUT",
    "ENV_HEARTBEAT_TIMEOUT",
    "ENV_SHUTDOWN_TIMEOUT",
    "DEFAULT_INIT_TIMEOUT",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DistributedConfig",
    "config_from_env",
    "initialize",
    "initialize_from_env",
    "is_initialized",
    "shutdown",
    "global_mesh",
]

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "COMMJAX_COORDINATOR"
ENV_NUM_PROCESSES = "COMMJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "COMMJAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "COMMJAX_LOCAL_DEVICES"
ENV_INTERFACE = "COMMJAX_INTERFACE"
ENV_INIT_TIMEOUT = "COMMJAX_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "COMMJAX_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "COMMJAX_SHUTDOWN_TIMEOUT"

#: Seconds ``initialize`` waits for all processes to connect.
DEFAULT_INIT_TIMEOUT = 60
#: Seconds without heartbeats after which a process is declared dead.
DEFAULT_HEARTBEAT_TIMEOUT = 10
#: Seconds the exit barrier waits for the other processes.
DEFAULT_SHUTDOWN_TIMEOUT = 10

# Set once this module has initialised jax.distributed (jax's own state is private).
_INITIALIZED_BY_US = False


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Everything [`initialize`][commjax.distributed.initialize] needs, as read from the
    environment."""

    coordinator_address: str
    num_processes: int
    process_id: int
    local_devices: int | None = None
    interface: str | None = None
    initialization_timeout: int = DEFAULT_INIT_TIMEOUT
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT


def _env_int(env: Mapping[str, str], name: str, default: int | None, *, minimum: int) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def config_from_env(environ: Mapping[str, str] | None = None) -> DistributedConfig | None:
    """Reads the ``COMMJAX_*`` variables; returns ``None`` when none of the three
    required ones (coordinator, process count, process id) is set.

    Raises:
      ValueError: if only some required variables are set, or a value is malformed.
    """
    env = os.environ if environ is None else environ
    required = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    present = [k for k in required if env.get(k, "").strip()]
    if not present:
        return None
    if len(present) != len(required):
        missing = [k for k in required if k not in present]
        raise ValueError(
            f"incomplete commjax distributed environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing (start workers with `python -m commjax.launch`)"
        )
    num_processes = _env_int(env, ENV_NUM_PROCESSES, None, minimum=1)
    process_id = _env_int(env, ENV_PROCESS_ID, None, minimum=0)
    assert num_processes is not None and process_id is not None
    return DistributedConfig(
        coordinator_address=env[ENV_COORDINATOR].strip(),
        num_processes=num_processes,
        process_id=process_id,
        local_devices=_env_int(env, ENV_LOCAL_DEVICES, None, minimum=1),
        interface=env.get(ENV_INTERFACE, "").strip() or None,
        initialization_timeout=_env_int(env, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT, minimum=1),
        heartbeat_timeout=_env_int(env, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT, minimum=1),
        shutdown_timeout=_env_int(env, ENV_SHUTDOWN_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT, minimum=1),
    )


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # private API moved: let jax.distributed.initialize complain
        return False


def _read_config(name: str) -> Any:
    """The current value of a ``jax.config`` option (AttributeError if unknown)."""
    return getattr(jax.config, name)


def _ensure_gloo() -> None:
    """Selects gloo for CPU collectives where the installed JAX does not default to it."""
    try:
        current = _read_config("jax_cpu_collectives_implementation")
    except AttributeError:  # option removed or renamed: JAX picks its own default
        return
    if current in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _check_interface(interface: str) -> None:
    names = [name for _, name in socket.if_nameindex()]
    if interface not in names:
        raise ValueError(
            f"network interface {interface!r} does not exist on this host; "
            f"available: {', '.join(names) or '(none)'}"
        )


def _install_gloo_interface(interface: str) -> bool:
    """Re-registers JAX's CPU backend factory so gloo advertises ``interface``'s address.

    Must run before the backend is created. Returns False (with a warning) when the
    private JAX pieces it needs are missing.
    """
    try:
        from jax._src import distributed as jax_distributed
        from jax._src import xla_bridge
        from jax._src.lib import _jax as jaxlib_ext  # jaxlib >= 0.5

        make_gloo = jaxlib_ext.make_gloo_tcp_collectives
        make_cpu_client = xla_bridge.make_cpu_client
        register = xla_bridge.register_backend_factory
        previous = xla_bridge._backend_factories.get("cpu")
    except Exception as e:  # pragma: no cover - depends on the JAX version
        warnings.warn(
            f"cannot pin gloo to interface {interface!r} with this JAX version ({e!r}); "
            "gloo will advertise the address of gethostname()",
            RuntimeWarning,
            stacklevel=3,
        )
        return False

    def cpu_factory():
        collectives = None
        if (
            jax_distributed.global_state.client is not None
            and _read_config("jax_cpu_collectives_implementation") == "gloo"
        ):
            collectives = make_gloo(
                distributed_client=jax_distributed.global_state.client, interface=interface
            )
        return make_cpu_client(collectives=collectives)

    kwargs: dict[str, Any] = {"priority": 0, "fail_quietly": False}
    if previous is not None:
        kwargs["priority"] = getattr(previous, "priority", 0)
    register("cpu", cpu_factory, **kwargs)
    return True


def _supported_kwargs(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drops keyword arguments ``fn`` does not accept (logged, not fatal)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    kept = {k: v for k, v in kwargs.items() if k in params}
    dropped = sorted(set(kwargs) - set(kept))
    if dropped:
        logger.warning(
            "jax.distributed.initialize in JAX %s does not accept %s; ignoring",
            jax.__version__,
            ", ".join(dropped),
        )
    return kept


def _check_initialize_args(coordinator_address: str, num_processes: int, process_id: int,
                           local_devices: int | None) -> None:
    """The arguments of [`initialize`][commjax.distributed.initialize], each checked with its name
    in the message."""
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id must be an int in [0, {num_processes}), got {process_id!r}"
        )
    if local_devices is not None and (not isinstance(local_devices, int) or local_devices < 1):
        raise ValueError(f"local_devices must be an int >= 1, got {local_devices!r}")
    if num_processes > 1:
        host, sep, port = coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(
                f"coordinator_address must look like 'host:port', got {coordinator_address!r}"
            )


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    local_devices: int | None = None,
    *,
    interface: str | None = None,
    initialization_timeout: int = DEFAULT_INIT_TIMEOUT,
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT,
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT,
    coordinator_bind_address: str | None = None,
) -> None:
    """Joins this process to a multi-process JAX job.

    Must be called before anything touches a JAX backend (``jax.devices()``, any
    computation, ``device_put``...). With ``num_processes == 1`` nothing distributed
    is started; only the local device count is applied.

    Args:
      coordinator_address: ``host:port`` of the coordination service, hosted by
        process 0 (which binds ``coordinator_bind_address``, default ``[::]:port``).
      num_processes: total number of processes, >= 1.
      process_id: this process' id, ``0 <= process_id < num_processes``.
      local_devices: number of CPU devices of this process (sets
        ``jax_num_cpu_devices``, overriding ``--xla_force_host_platform_device_count``).
        Has no effect on GPU/TPU backends. ``None`` keeps JAX's choice.
      interface: network interface whose address gloo advertises to its peers (e.g.
        ``"eth0"``); ``None`` keeps gloo's default (the address of ``gethostname()``).
        See the module docstring.
      initialization_timeout: seconds to wait for all processes to connect.
      heartbeat_timeout: seconds without heartbeats after which a process is
        declared dead and the others are aborted.
      shutdown_timeout: seconds the exit barrier waits for the other processes.
      coordinator_bind_address: optional ``host:port`` process 0 binds.

    Raises:
      ValueError: for inconsistent arguments or an unknown interface.
      RuntimeError: if a JAX backend is already initialised, or on a second call.
    """
    global _INITIALIZED_BY_US
    _check_initialize_args(coordinator_address, num_processes, process_id, local_devices)
    if _INITIALIZED_BY_US:
        raise RuntimeError("commjax.distributed.initialize() was already called in this process")
    if _backends_initialized():
        raise RuntimeError(
            "commjax.distributed.initialize() must run before any JAX computation or "
            "jax.devices() call: the XLA backend is already initialised in this process"
        )
    if interface is not None:
        _check_interface(interface)

    if local_devices is not None:
        jax.config.update("jax_num_cpu_devices", local_devices)
    if num_processes == 1:
        _INITIALIZED_BY_US = True
        return

    _ensure_gloo()
    if interface is not None:
        _install_gloo_interface(interface)

    kwargs = _supported_kwargs(
        jax.distributed.initialize,
        dict(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=int(initialization_timeout),
            heartbeat_timeout_seconds=int(heartbeat_timeout),
            shutdown_timeout_seconds=int(shutdown_timeout),
            coordinator_bind_address=coordinator_bind_address,
            # All parameters are explicit: skip Slurm/MPI/TPU auto-detection.
            cluster_detection_method="deactivate",
        ),
    )
    if kwargs.get("coordinator_bind_address") is None:
        kwargs.pop("coordinator_bind_address", None)
    for required in ("coordinator_address", "num_processes", "process_id"):
        if required not in kwargs:  # pragma: no cover - would be a very different JAX
            raise RuntimeError(
                f"jax.distributed.initialize of JAX {jax.__version__} has no {required!r} argument"
            )
    jax.distributed.initialize(**kwargs)
    _INITIALIZED_BY_US = True


def initialize_from_env(environ: Mapping[str, str] | None = None, *, required: bool = False) -> bool:
    """Calls [`initialize`][commjax.distributed.initialize] with the ``COMMJAX_*`` environment set
    by the launcher.

    Args:
      environ: mapping to read instead of ``os.environ``.
      required: raise if the environment is not set, instead of running as one process.

    Returns:
      True if the variables were found and [`initialize`][commjax.distributed.initialize] ran, False
      if they are
      absent (a plain single-process run: nothing is changed).

    Raises:
      RuntimeError: if ``required`` and the variables are absent.
      ValueError: if they are malformed or incomplete.
    """
    cfg = config_from_env(environ)
    if cfg is None:
        if required:
            raise RuntimeError(
                f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} are not set: "
                "start this script with `python -m commjax.launch --processes N "
                "--devices-per-process D script.py`"
            )
        return False
    initialize(
        cfg.coordinator_address,
        cfg.num_processes,
        cfg.process_id,
        cfg.local_devices,
        interface=cfg.interface,
        initialization_timeout=cfg.initialization_timeout,
        heartbeat_timeout=cfg.heartbeat_timeout,
        shutdown_timeout=cfg.shutdown_timeout,
    )
    return True


def is_initialized() -> bool:
    """True if ``jax.distributed`` is running in this process."""
    try:
        return bool(jax.distributed.is_initialized())
    except AttributeError:  # pragma: no cover - older JAX
        from jax._src import distributed as jax_distributed

        return jax_distributed.global_state.client is not None


def shutdown() -> None:
    """Leaves the job (the exit barrier). Optional: JAX also does this at exit."""
    global _INITIALIZED_BY_US
    jax.distributed.shutdown()
    _INITIALIZED_BY_US = False


def global_mesh(axis_name: str = "data") -> jax.sharding.Mesh:
    """A 1-D mesh over all global devices (every process' devices, in process order),
    with ``AxisType.Auto`` so ``shard_map(in_specs=P(axis_name))`` accepts unsharded
    inputs."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    try:
        axis_types = (jax.sharding.AxisType.Auto,)
        return jax.sharding.Mesh(devices, (axis_name,), axis_types=axis_types)
    except (AttributeError, TypeError):  # pragma: no cover - JAX without AxisType
        return jax.sharding.Mesh(devices, (axis_name,))
