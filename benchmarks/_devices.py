"""Simulated CPU devices for the benchmark scripts (call before JAX is imported)."""

from __future__ import annotations

import os

FLAG = "--xla_force_host_platform_device_count"


def simulate_cpu_devices(n: int = 8) -> None:
    """Ask XLA for ``n`` CPU devices (unless ``XLA_FLAGS`` already sets a count), default
    JAX to the CPU platform and give its CPU client ``2 n`` threads."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FLAG}={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Twice the devices in CPU-client threads, else a collective can wait forever for a
    # device without a thread (commjax.launch.set_cpu_threads; commjax is not imported
    # here, before JAX is configured).
    os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 2 * n)))
