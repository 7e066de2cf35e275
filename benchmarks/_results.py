"""Writing a benchmark's JSON results (shared by the benchmark scripts).

Every result file carries where it came from, at its top level:

* ``command``: the command line that wrote it (``python benchmarks/<script>.py ...``);
* ``commit``: the commit of the tree that ran it, ``+dirty`` when ``commjax/`` or
  ``benchmarks/`` had uncommitted changes;
* ``date``: when it was written (UTC, ISO 8601);
* ``machine``: CPU, cores, memory, kernel, Python and JAX versions, the JAX backend and
  its device count.

One file per benchmark configuration, overwritten in place by the next run of the same
command; ``benchmarks/results/README.md`` lists them, and ``tests/test_docs.py`` checks
that every number the documentation quotes is the one in the current file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


def commit() -> str:
    """The short hash of HEAD, ``+dirty`` when the code a benchmark runs has local changes
    (result files written by earlier runs are outputs, not code: they do not count)."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    changed = _git("status", "--porcelain", "--", "commjax", "benchmarks", ":!benchmarks/results")
    return head + ("+dirty" if changed else "")


def _proc(path: str, key: str) -> Optional[str]:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """What ran it: CPU, cores, memory, kernel, Python, JAX and its devices."""
    mem = _proc("/proc/meminfo", "MemTotal")
    info: dict[str, Any] = {
        "cpu": _proc("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    jax = sys.modules.get("jax")  # only if the benchmark imported it: no import here
    if jax is not None:
        info["jax"] = jax.__version__
        info["backend"] = jax.default_backend()
        info["devices"] = jax.device_count()
    return info


def provenance(command: Optional[str] = None) -> dict[str, Any]:
    """``{"command", "commit", "date", "machine"}`` of this run."""
    if command is None:
        script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
        command = " ".join(["python", script, *sys.argv[1:]])
    return {"command": command.strip(), "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine()}


def write_results(path: Any, payload: Any, *, allow_nan: bool = False, command: Optional[str] = None,
                  sort_keys: bool = False) -> None:
    """Write ``payload`` (a dict) as indented JSON to ``path`` (its folder created), with the
    run's :func:`provenance` first (a ``machine`` dict in ``payload`` adds to it), and say so."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    record = provenance(command)
    record["machine"].update(payload.get("machine") or {})
    record.update({k: v for k, v in payload.items() if k not in record})
    with open(path, "w") as f:
        json.dump(record, f, indent=2, allow_nan=allow_nan, sort_keys=sort_keys)
        f.write("\n")
    print(f"wrote {path}")
