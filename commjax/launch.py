"""Start an SPMD JAX program as N local processes (a tiny ``torchrun`` for tests and demos).

Usage::

    python -m commjax.launch --processes N --devices-per-process D \\
        [--timeout S] [--grace S] [--interface IF] script.py [script args...]

Each child runs ``python script.py args...`` with

``COMMJAX_COORDINATOR``    ``127.0.0.1:PORT`` (a free port picked here),
``COMMJAX_NUM_PROCESSES``  ``N``,
``COMMJAX_PROCESS_ID``     ``0..N-1``,
``COMMJAX_LOCAL_DEVICES``  ``D``,
``COMMJAX_INTERFACE``      ``IF`` (only with ``--interface``),
``JAX_PLATFORMS=cpu``      unless already set, ``PYTHONUNBUFFERED=1``,

``--xla_force_host_platform_device_count`` removed from ``XLA_FLAGS`` (``D`` is the
authority), and the directory holding this ``commjax`` package prepended to
``PYTHONPATH``. The script calls [`commjax.distributed.initialize_from_env`][]
before touching JAX.

Each child's stdout and stderr are streamed line by line with a ``[pI] `` prefix.
When a child exits non-zero, or ``--timeout`` seconds pass, every other child is sent
SIGTERM (to its whole process group), then SIGKILL after ``--grace`` seconds. The exit
status is that of the first failing child (``128 + signal`` if it was killed by a
signal), ``124`` on time-out, ``0`` only if every child exits 0. Note that a JAX
child with ``jax.distributed`` initialised usually survives SIGTERM: JAX's preemption
notifier catches it (and logs ``SIGTERM caught``) to let the job reach a preemption
sync point, so stopping such children takes the grace period and then SIGKILL.

This is a convenience for one machine; on clusters use the scheduler (Slurm, mpirun,
Kubernetes) and set the same environment variables, or call
[`commjax.distributed.initialize`][] directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import IO, TextIO

__all__ = ["LaunchResult", "launch", "free_port", "child_env", "main", "TIMEOUT_EXIT_CODE"]

#: CLI exit status when ``--timeout`` expires (the same as coreutils ``timeout``).
TIMEOUT_EXIT_CODE = 124

# Kept in sync with commjax.distributed (not imported: that module imports jax, and the
# launcher itself must stay light and never initialise a backend).
_ENV_COORDINATOR = "COMMJAX_COORDINATOR"
_ENV_NUM_PROCESSES = "COMMJAX_NUM_PROCESSES"
_ENV_PROCESS_ID = "COMMJAX_PROCESS_ID"
_ENV_LOCAL_DEVICES = "COMMJAX_LOCAL_DEVICES"
_ENV_INTERFACE = "COMMJAX_INTERFACE"


@dataclasses.dataclass
class LaunchResult:
    """Outcome of [`launch`][commjax.launch.launch].

    Attributes:
      returncodes: per process, its exit status as ``Popen.returncode`` reports it
        (negative ``-N`` if killed by signal ``N``; ``None`` only if it could not be
        reaped, which should not happen).
      stdout, stderr: per process, everything it wrote (decoded, ``\\n``-joined).
      failed_process: the process whose failure ended the job: the first seen to exit
        non-zero by itself, an error code preferred over a signal (its peers abort when it
        leaves their collectives), or ``None``.
      timed_out: True if the overall time-out expired.
      terminated: ids of the processes the launcher had to stop (SIGTERM/SIGKILL).
      elapsed: wall-clock seconds from the first start to the last exit.
      pids: per process, its pid.
    """

    returncodes: list[int | None]
    stdout: list[str]
    stderr: list[str]
    failed_process: int | None
    timed_out: bool
    terminated: list[int]
    elapsed: float
    pids: list[int]

    @property
    def ok(self) -> bool:
        """True if every process exited 0."""
        return all(rc == 0 for rc in self.returncodes)

    @property
    def returncode(self) -> int:
        """One shell-style exit status for the whole job (what the CLI exits with)."""
        if self.failed_process is not None:
            return _shell_code(self.returncodes[self.failed_process])
        if self.timed_out:
            return TIMEOUT_EXIT_CODE
        for rc in self.returncodes:
            if rc != 0:
                return _shell_code(rc)
        return 0

    def output(self, process_id: int) -> str:
        """stdout then stderr of one process (for error messages)."""
        return self.stdout[process_id] + ("\n" if self.stdout[process_id] else "") + self.stderr[process_id]

    @property
    def error(self) -> str:
        """The failing process's last error line (e.g. ``ValueError: ...``), or ``""``."""
        if self.failed_process is None:
            return ""
        lines = [l for l in self.stderr[self.failed_process].splitlines() if l.strip()]
        return lines[-1].strip() if lines else ""

    def describe(self) -> str:
        """A one-line summary, e.g. ``process 1 exited with 3 (ValueError: ...); stopped
        [0, 2]``."""
        parts = []
        if self.failed_process is not None:
            why = f" ({self.error})" if self.error else ""
            parts.append(
                f"process {self.failed_process} exited with "
                f"{_describe_rc(self.returncodes[self.failed_process])}{why}"
            )
        if self.timed_out:
            parts.append(f"timed out after {self.elapsed:.1f}s")
        if self.terminated:
            parts.append(f"stopped processes {self.terminated}")
        if not parts:
            parts.append("all processes exited 0" if self.ok else f"exit codes {self.returncodes}")
        return "; ".join(parts)


def _shell_code(rc: int | None) -> int:
    if rc is None:
        return 1
    if rc < 0:
        return 128 + (-rc)
    return rc


def _describe_rc(rc: int | None) -> str:
    if rc is None:
        return "unknown status"
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: The environment variable XLA's CPU client reads for the size of its two thread pools
#: (the one that runs each device's part of a program, the one for intra-op work).
CPU_THREADS_ENV = "PJRT_NPROC"


def set_cpu_threads(env: MutableMapping[str, str], devices: int) -> None:
    """Give XLA's CPU client at least ``2 * devices`` threads (``PJRT_NPROC``, unless set).

    With CPU devices the client runs each device's part of a program on a pool of
    ``max(cores, devices)`` threads, and a thread that reaches a collective blocks until
    every device of its group has reached it. With exactly one thread per device, one
    thread held by other work (the next program's first device, a transfer) leaves a
    device of the collective without a thread: every other device waits in the
    collective until XLA's termination timeout aborts the process. Seen on a 2-core
    machine with 8 simulated devices (a ``data x model`` mesh: 7 devices in collectives,
    the 8th not started, within 50 steps); with twice the threads, 300 steps in 3 of 3
    runs. Must run before JAX creates its CPU backend.
    """
    env.setdefault(CPU_THREADS_ENV, str(max(os.cpu_count() or 1, 2 * int(devices))))


def _strip_device_count_flag(xla_flags: str) -> str:
    return " ".join(
        f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")
    )


def child_env(
    process_id: int,
    processes: int,
    devices_per_process: int,
    coordinator: str,
    *,
    interface: str | None = None,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of child ``process_id`` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    if extra:
        env.update(extra)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    if "XLA_FLAGS" in env:
        flags = _strip_device_count_flag(env["XLA_FLAGS"])
        if flags:
            env["XLA_FLAGS"] = flags
        else:
            del env["XLA_FLAGS"]
    package_root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_root not in paths:
        paths.insert(0, package_root)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[_ENV_COORDINATOR] = coordinator
    env[_ENV_NUM_PROCESSES] = str(processes)
    env[_ENV_PROCESS_ID] = str(process_id)
    env[_ENV_LOCAL_DEVICES] = str(devices_per_process)
    set_cpu_threads(env, devices_per_process)
    if interface:
        env[_ENV_INTERFACE] = interface
    else:
        env.pop(_ENV_INTERFACE, None)
    return env


def _argv(script_or_argv: str | os.PathLike[str] | Sequence[str], python: str) -> list[str]:
    if isinstance(script_or_argv, (str, os.PathLike)):
        return [python, os.fspath(script_or_argv)]
    argv = [os.fspath(a) for a in script_or_argv]
    if not argv:
        raise ValueError("script_or_argv is empty: give a script path or python arguments")
    return [python, *argv]


class _Pump(threading.Thread):
    """Reads one child stream line by line: stores it and optionally echoes it."""

    def __init__(self, stream: IO[bytes], prefix: str, sink: TextIO | None, lock: threading.Lock):
        super().__init__(daemon=True)
        self.stream = stream
        self.prefix = prefix
        self.sink = sink
        self.lock = lock
        self.lines: list[str] = []

    def run(self) -> None:
        try:
            for raw in iter(self.stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                self.lines.append(line)
                if self.sink is not None:
                    with self.lock:
                        try:
                            self.sink.write(f"{self.prefix}{line}\n")
                            self.sink.flush()
                        except (OSError, ValueError):
                            self.sink = None  # closed sink: keep capturing
        except (OSError, ValueError):
            pass
        finally:
            try:
                self.stream.close()
            except OSError:
                pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # children run in their own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except (ProcessLookupError, OSError):
            pass


def launch(
    script_or_argv: str | os.PathLike[str] | Sequence[str],
    processes: int,
    devices_per_process: int = 1,
    *,
    args: Sequence[str] = (),
    timeout: float | None = None,
    grace: float = 5.0,
    interface: str | None = None,
    env: Mapping[str, str] | None = None,
    stream: bool = True,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    kill_on_failure: bool = True,
    python: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> LaunchResult:
    """Runs ``processes`` copies of a Python program as one ``jax.distributed`` job.

    Args:
      script_or_argv: a script path, or the arguments that follow ``python`` (e.g.
        ``["worker.py", "--steps", "3"]``, ``["-m", "pkg.mod"]``, ``["-c", "code"]``).
      processes: number of processes N >= 1.
      devices_per_process: CPU devices per process D >= 1.
      args: more arguments appended to the command line.
      timeout: overall seconds before every child is stopped (``None``: no limit).
      grace: seconds between SIGTERM and SIGKILL when stopping children.
      interface: network interface gloo should advertise (``COMMJAX_INTERFACE``).
      env: extra environment variables for every child.
      stream: echo child lines, prefixed ``[pI] ``, to ``stdout``/``stderr`` (default
        ``sys.stdout``/``sys.stderr``) while they run. Output is captured either way.
      kill_on_failure: stop the others when one child exits non-zero (default). With
        False the launcher waits for every child (up to ``timeout``): used to observe
        JAX's own failure detection.
      python: interpreter to run (default ``sys.executable``).
      cwd: working directory of the children.

    Returns:
      A [`LaunchResult`][commjax.launch.LaunchResult]; no exception is raised for failing children.

    Raises:
      ValueError: for ``processes < 1``, ``devices_per_process < 1``, a negative
        timeout or grace, or an empty command.
    """
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be an int >= 1, got {processes!r}")
    if not isinstance(devices_per_process, int) or devices_per_process < 1:
        raise ValueError(f"devices_per_process must be an int >= 1, got {devices_per_process!r}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if grace < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace!r}")
    argv = _argv(script_or_argv, python or sys.executable) + [os.fspath(a) for a in args]
    job = _Job(grace, (stdout or sys.stdout) if stream else None,
               (stderr or sys.stderr) if stream else None)
    try:
        job.start(argv, processes, devices_per_process, interface=interface, env=env, cwd=cwd)
        job.watch(None if timeout is None else job.begin + timeout, kill_on_failure)
    except BaseException:  # KeyboardInterrupt, SIGTERM-as-exception, spawn errors
        job.stop(range(len(job.procs)))
        raise
    finally:
        job.join_pumps()
    return job.result()


#: Seconds a job keeps watching after the first failure before stopping the survivors, so
#: that the process whose error caused it (not a peer that aborted) is the one reported.
SETTLE = 1.0


class _Job:
    """The children of one [`launch`][commjax.launch.launch]: started, watched, stopped,
    reported."""

    def __init__(self, grace: float, out_sink: TextIO | None, err_sink: TextIO | None):
        self.grace, self.out_sink, self.err_sink = grace, out_sink, err_sink
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[tuple[_Pump, _Pump]] = []
        self.begin = time.monotonic()
        self.failed: int | None = None
        self.exits: list[int] = []  # children in the order their exit was seen
        self.timed_out = False
        self.terminated: list[int] = []

    def start(self, argv, processes, devices_per_process, *, interface, env, cwd) -> None:
        coordinator = f"127.0.0.1:{free_port()}"
        for i in range(processes):
            proc = subprocess.Popen(
                argv, env=child_env(i, processes, devices_per_process, coordinator,
                                    interface=interface, extra=env),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=cwd, start_new_session=True,
            )
            self.procs.append(proc)
            pair = (_Pump(proc.stdout, f"[p{i}] ", self.out_sink, self.lock),  # type: ignore[arg-type]
                    _Pump(proc.stderr, f"[p{i}] ", self.err_sink, self.lock))  # type: ignore[arg-type]
            for p in pair:
                p.start()
            self.pumps.append(pair)

    def watch(self, deadline: float | None, kill_on_failure: bool) -> None:
        """Poll until every child exited, one failed (then, if asked, stop the others once
        the failure has had ``SETTLE`` seconds to show which process caused it), or the
        deadline passed (then stop every child)."""
        everyone = range(len(self.procs))
        first_failure: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            self.exits += [i for i, rc in enumerate(codes) if rc is not None and i not in self.exits]
            if first_failure is None and any(rc not in (None, 0) for rc in codes):
                first_failure = time.monotonic()
            if first_failure is not None and kill_on_failure and (
                    time.monotonic() >= first_failure + SETTLE or all(rc is not None for rc in codes)):
                self.stop(everyone)
                break
            if all(rc is not None for rc in codes):
                break
            if deadline is not None and time.monotonic() >= deadline:
                self.timed_out = True
                self.stop(everyone)
                break
            time.sleep(0.05)
        self.failed = self._culprit()

    def _culprit(self) -> int | None:
        """The process that failed first *of its own accord*: among the children that exited
        non-zero before being stopped, in the order seen, one that exited with an error
        code (a Python exception, ``sys.exit``) before one killed by a signal (the others
        abort when a peer of their collectives disappears)."""
        own = [i for i in self.exits if self.procs[i].returncode not in (None, 0) and i not in self.terminated]
        errors = [i for i in own if self.procs[i].returncode > 0]
        return (errors or own or [None])[0]

    def stop(self, ids: Sequence[int]) -> None:
        """SIGTERM the live children among ``ids``, SIGKILL them after the grace period."""
        alive = [i for i in ids if self.procs[i].poll() is None]
        self.terminated.extend(i for i in alive if i not in self.terminated)
        for i in alive:
            _signal_group(self.procs[i], signal.SIGTERM)
        end = time.monotonic() + self.grace
        while time.monotonic() < end and any(self.procs[i].poll() is None for i in alive):
            time.sleep(0.05)
        for i in alive:
            if self.procs[i].poll() is None:
                _signal_group(self.procs[i], signal.SIGKILL)
        for i in alive:
            try:
                self.procs[i].wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable
                pass

    def join_pumps(self) -> None:
        # Children of children may still hold the pipes: never wait forever on them.
        for pair in self.pumps:
            for p in pair:
                p.join(timeout=5)

    def result(self) -> LaunchResult:
        return LaunchResult(
            returncodes=[p.returncode for p in self.procs],
            stdout=["\n".join(o.lines) for o, _ in self.pumps],
            stderr=["\n".join(e.lines) for _, e in self.pumps],
            failed_process=self.failed,
            timed_out=self.timed_out,
            terminated=sorted(self.terminated),
            elapsed=time.monotonic() - self.begin,
            pids=[p.pid for p in self.procs],
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m commjax.launch",
        description=(
            "Run a JAX script as N local processes joined by jax.distributed (CPU "
            "collectives: gloo). Each child gets COMMJAX_COORDINATOR, "
            "COMMJAX_NUM_PROCESSES, COMMJAX_PROCESS_ID, COMMJAX_LOCAL_DEVICES (and "
            "COMMJAX_INTERFACE) and should call "
            "commjax.distributed.initialize_from_env() before using JAX. Output lines "
            "are prefixed with [pI]. If a child fails, the others are terminated and its "
            "exit code is returned; 124 on --timeout; 0 only if all children exit 0."
        ),
    )
    p.add_argument("--processes", "-n", type=int, required=True, metavar="N",
                   help="number of processes to start (>= 1)")
    p.add_argument("--devices-per-process", "-d", type=int, default=1, metavar="D",
                   help="CPU devices per process, via jax_num_cpu_devices (default 1)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop every child after S seconds and exit 124 (default: no limit)")
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping children (default 5)")
    p.add_argument("--interface", default=None, metavar="IF",
                   help="network interface whose address gloo advertises, e.g. eth0")
    p.add_argument("script", help="Python script to run in every process")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.processes < 1:
        parser.error(f"--processes must be >= 1, got {ns.processes}")
    if ns.devices_per_process < 1:
        parser.error(f"--devices-per-process must be >= 1, got {ns.devices_per_process}")
    if ns.timeout is not None and ns.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {ns.timeout}")
    if ns.grace < 0:
        parser.error(f"--grace must be >= 0, got {ns.grace}")
    if not os.path.exists(ns.script):
        parser.error(f"script not found: {ns.script}")

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"launcher received signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = launch(
            ns.script,
            ns.processes,
            ns.devices_per_process,
            args=ns.script_args,
            timeout=ns.timeout,
            grace=ns.grace,
            interface=ns.interface,
        )
    except KeyboardInterrupt:
        print("[launch] interrupted: children stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not result.ok or result.timed_out:
        print(f"[launch] {result.describe()}", file=sys.stderr, flush=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
