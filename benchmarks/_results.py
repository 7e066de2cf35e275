"""Writing a benchmark's JSON results (shared by the benchmark scripts)."""

from __future__ import annotations

import json
import os
from typing import Any


def write_results(path: Any, payload: Any, *, allow_nan: bool = False) -> None:
    """Write ``payload`` as indented JSON to ``path`` (its folder created) and say so."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, allow_nan=allow_nan)
        f.write("\n")
    print(f"wrote {path}")
