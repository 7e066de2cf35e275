"""Wall time of the CI entry point (``bash .ci/run``: install, ``make test``) on a fresh clone,
per commit, so that two states of the suite can be compared on the same machine.

Each commit is cloned from this repository into a new temporary folder, checked out, and
run as CI runs it; the script records the total wall time, the time each pytest run
reports ("N passed ... in S s") and the exit status. Nothing else should run meanwhile: on
2 cores a second job changes the times by tens of percent.

    python benchmarks/suite_time.py [COMMIT ...]        # default: HEAD

Writes one entry per commit given to ``benchmarks/results/suite_time.json`` (overwritten).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from _results import write_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "suite_time.json"
_PYTEST_RUN = re.compile(r"^=*\s*(?P<summary>\d+ passed[^\n]*?) in (?P<seconds>[\d.]+)s", re.M)


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def run_ci(commit: str) -> dict[str, Any]:
    """Clone, check out ``commit`` and time ``bash .ci/run`` there."""
    sha = _git("rev-parse", commit)
    with tempfile.TemporaryDirectory(prefix="suite_time.") as tmp:
        clone = Path(tmp) / "repo"
        _git("clone", "-q", str(ROOT), str(clone))
        _git("checkout", "-q", sha, cwd=clone)
        t0 = time.monotonic()
        proc = subprocess.run(["bash", ".ci/run"], cwd=clone, capture_output=True, text=True)
        wall = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    runs = [{"summary": m["summary"], "seconds": float(m["seconds"])} for m in _PYTEST_RUN.finditer(log)]
    return {"commit": sha[:12], "subject": _git("log", "-1", "--format=%s", sha)[:100],
            "returncode": proc.returncode, "wall_s": round(wall, 1), "pytest_runs": runs,
            "pytest_s": round(sum(s["seconds"] for s in runs), 1),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "log_tail": log[-1500:] if proc.returncode else ""}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commits", nargs="*", default=["HEAD"])
    args = ap.parse_args(argv)
    rows = []
    for commit in args.commits:
        row = run_ci(commit)
        rows.append(row)
        print(f"{row['commit']}  rc={row['returncode']}  wall {row['wall_s']:.0f} s  "
              f"pytest {row['pytest_s']:.0f} s  {[s['summary'] for s in row['pytest_runs']]}", flush=True)
    for row in rows:
        row["command"] = "python benchmarks/suite_time.py " + " ".join(args.commits)
    write_results(RESULTS, {"what": __doc__.split("\n\n")[0], "runs": rows})
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
