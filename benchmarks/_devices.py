"""Simulated CPU devices for the benchmark scripts (call before JAX is imported)."""

from __future__ import annotations

import os

FLAG = "--xla_force_host_platform_device_count"


def simulate_cpu_devices(n: int = 8) -> None:
    """Ask XLA for ``n`` CPU devices (unless ``XLA_FLAGS`` already sets a count) and
    default JAX to the CPU platform."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FLAG}={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
