"""Test harness: run a worker script as a multi-process ``jax.distributed`` job.

Usage in a test::

    from multiprocess import run_workers

    run = run_workers("my_worker.py", processes=2, devices_per_process=2)
    run.check()                       # every process exited 0 and printed RESULT
    assert run.results[0] == run.results[1]

Worker scripts live in ``tests/mp_scripts/`` (a bare file name is looked up there)
and follow the pattern of ``tests/mp_scripts/_worker.py``: ``ctx = _worker.setup()``
(``commjax.distributed.initialize_from_env()`` + the global mesh), compute with
``jax.shard_map`` over ``ctx.mesh``, then ``_worker.emit({...})`` prints one
``RESULT {json}`` line which this harness parses.

Processes are started by :func:`commjax.launch.launch`: if one exits non-zero the
others are stopped, and the whole run is bounded by ``timeout`` seconds, so a broken
collective fails a test instead of hanging it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from commjax.launch import LaunchResult, launch

MP_SCRIPTS = Path(__file__).resolve().parent / "mp_scripts"
RESULT_PREFIX = "RESULT "
#: Default bound for one multi-process run (each JAX process needs a few seconds).
DEFAULT_TIMEOUT = 60.0

__all__ = ["MP_SCRIPTS", "MultiProcessRun", "run_workers", "run_on_task", "parse_results",
           "script_path", "leftover_processes", "load_script"]


def load_script(name: str):
    """The worker script ``mp_scripts/<name>.py`` as a module, for the in-process
    reference runs of a test (its functions import their siblings, such as ``_worker``
    and ``train_compressors``, so ``mp_scripts`` joins ``sys.path``)."""
    if str(MP_SCRIPTS) not in sys.path:
        sys.path.insert(0, str(MP_SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"_mp_{name}", MP_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_path(script: str | os.PathLike[str]) -> Path:
    """``script`` itself if it exists, else ``tests/mp_scripts/<script>``."""
    p = Path(script)
    if p.exists():
        return p.resolve()
    candidate = MP_SCRIPTS / p
    if candidate.exists():
        return candidate
    raise FileNotFoundError(f"worker script {script!s} not found (looked in {MP_SCRIPTS})")


def parse_results(text: str) -> list[dict[str, Any]]:
    """Every ``RESULT {json}`` line in ``text``, in order."""
    out = []
    for line in text.splitlines():
        if line.startswith(RESULT_PREFIX):
            out.append(json.loads(line[len(RESULT_PREFIX):]))
    return out


def leftover_processes(pids: Sequence[int]) -> list[int]:
    """The process groups (one per child, led by its pid) that still have a member."""
    alive = []
    for pid in pids:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:  # exists, not ours: still left over
            pass
        alive.append(pid)
    return alive


@dataclasses.dataclass
class MultiProcessRun:
    """A finished run: the launcher's result plus each process' parsed RESULT lines."""

    launch: LaunchResult
    all_results: list[list[dict[str, Any]]]

    @property
    def processes(self) -> int:
        return len(self.launch.returncodes)

    @property
    def results(self) -> list[dict[str, Any] | None]:
        """Per process, its last RESULT payload (``None`` if it printed none)."""
        return [r[-1] if r else None for r in self.all_results]

    @property
    def elapsed(self) -> float:
        return self.launch.elapsed

    def report(self, max_lines: int = 60) -> str:
        """A failure report: the summary, exit codes and each process' last lines."""
        lines = [f"multi-process run: {self.launch.describe()}",
                 f"exit codes: {self.launch.returncodes}, elapsed {self.elapsed:.1f}s"]
        for i in range(self.processes):
            tail = self.launch.output(i).splitlines()[-max_lines:]
            lines.append(f"--- process {i} (last {len(tail)} lines) ---")
            lines.extend(tail)
        return "\n".join(lines)

    def check(self) -> MultiProcessRun:
        """Raises AssertionError (with outputs) unless every process exited 0 and
        printed a RESULT line. Returns self for chaining."""
        if not self.launch.ok or self.launch.timed_out:
            raise AssertionError(self.report())
        missing = [i for i, r in enumerate(self.results) if r is None]
        if missing:
            raise AssertionError(f"processes {missing} printed no RESULT line\n{self.report()}")
        return self


def run_workers(
    script: str | os.PathLike[str],
    processes: int,
    devices_per_process: int = 1,
    *,
    args: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT,
    grace: float = 2.0,
    env: Mapping[str, str] | None = None,
    interface: str | None = None,
    kill_on_failure: bool = True,
    check: bool = False,
    stream: bool = True,
) -> MultiProcessRun:
    """Runs ``script`` on ``processes`` processes with ``devices_per_process`` CPU
    devices each and returns the outcome (see :func:`commjax.launch.launch`).

    Args:
      script: path, or a file name in ``tests/mp_scripts/``.
      timeout: overall bound in seconds; children still running then are stopped.
      grace: seconds between SIGTERM and SIGKILL. JAX's preemption notifier catches
        SIGTERM, so a JAX child usually needs the SIGKILL: keep this short.
      env: extra environment for the children (e.g. ``COMMJAX_HEARTBEAT_TIMEOUT``).
      kill_on_failure: stop the others as soon as one exits non-zero.
      check: call :meth:`MultiProcessRun.check` before returning.
      stream: echo children's output (prefixed ``[pI] ``) into the test's captured output.
    """
    result = launch(
        [str(script_path(script)), *args],
        processes,
        devices_per_process,
        timeout=timeout,
        grace=grace,
        env=env,
        interface=interface,
        kill_on_failure=kill_on_failure,
        stream=stream,
    )
    run = MultiProcessRun(result, [parse_results(out) for out in result.stdout])
    return run.check() if check else run


def run_on_task(script: str, tmp_path: Path, processes: int = 2, devices: int = 4, *,
                timeout: float = 240.0) -> tuple[list, Any]:
    """Run ``script`` (taking ``--task FILE``) on ``processes`` x ``devices`` with the
    non-i.i.d. task of ``mp_scripts/train_compressors.py`` for that many replicas, written
    to ``tmp_path``; the workers compile with pytest's flags (``xla_flags.py``).
    Checks that every process exited 0, none is left behind and the results come in
    process order. Returns ``(results, task)``, the task as the workers read it."""
    tasks = load_script("train_compressors")
    task_file = tmp_path / "task.npz"
    tasks.save_task(tasks.make_task(processes * devices), str(task_file))
    run = run_workers(script, processes, devices, args=["--task", str(task_file)], timeout=timeout,
                      check=True, stream=False)
    assert not leftover_processes(run.launch.pids)
    assert [r["process_id"] for r in run.results] == list(range(processes))
    return run.results, tasks.load_task(str(task_file))
