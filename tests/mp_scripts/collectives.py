"""Worker: psum, uint8 all_gather and uint8 all_to_all over the global mesh.

Run by ``tests/test_launch.py`` under the launcher. Importable without side effects:
``build`` and ``expected`` are also used in-process to check the compiled HLO.

Every process prints ``RESULT {...}`` with the values it read back; the test checks
them against ``expected`` and across processes.
"""

from __future__ import annotations

import numpy as np

WORD_BYTES = 16  # uint8 words per row
FEATURES = 4


def psum_input(num_devices: int) -> np.ndarray:
    """Row ``i`` is what device ``i`` contributes to the psum."""
    i = np.arange(num_devices, dtype=np.float32)[:, None]
    return (i + 1.0) * np.arange(1, FEATURES + 1, dtype=np.float32) + 0.25 * i


def gather_input(num_devices: int) -> np.ndarray:
    """Row ``i``: device ``i``'s uint8 word (distinct per device, all 256 values reachable)."""
    i = np.arange(num_devices)[:, None]
    k = np.arange(WORD_BYTES)[None, :]
    return ((i * 37 + k * 11 + 5) % 256).astype(np.uint8)


def all_to_all_input(num_devices: int) -> np.ndarray:
    """Rows ``[i*G:(i+1)*G]`` belong to device ``i``; its row ``j`` goes to device ``j``."""
    g = num_devices
    src = np.repeat(np.arange(g), g)[:, None]
    dst = np.tile(np.arange(g), g)[:, None]
    k = np.arange(WORD_BYTES)[None, :]
    return ((src * 16 + dst + k * 3 + 200) % 256).astype(np.uint8)


def expected(num_devices: int) -> dict[str, np.ndarray]:
    """What every process must read back."""
    g = num_devices
    a2a = all_to_all_input(g).reshape(g, g, WORD_BYTES)  # [src, dst, byte]
    return {
        "psum": psum_input(g).sum(axis=0),
        "all_gather": gather_input(g),
        # Device d receives row d from every source i, in source order; then all are
        # gathered in device order: [d, i, byte].
        "all_to_all": np.transpose(a2a, (1, 0, 2)).reshape(g * g, WORD_BYTES),
    }


def build(mesh, axis_name: str = "data") -> dict:
    """The three jitted collectives over ``mesh`` (outputs replicated: ``P()``)."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def sm(f):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(axis_name), out_specs=P()))

    def psum(x):  # x: (1, FEATURES) per device
        return lax.psum(x[0], axis_name)

    def all_gather(w):  # w: (1, WORD_BYTES) uint8 per device
        return lax.all_gather(w, axis_name, tiled=True, to="invarying")

    def all_to_all(w):  # w: (G, WORD_BYTES) uint8 per device
        received = lax.all_to_all(w, axis_name, split_axis=0, concat_axis=0, tiled=True)
        return lax.all_gather(received, axis_name, tiled=True, to="invarying")

    return {"psum": sm(psum), "all_gather": sm(all_gather), "all_to_all": sm(all_to_all)}


def main() -> None:
    import _worker

    ctx = _worker.setup()
    g = ctx.global_device_count
    rows = ctx.local_rows
    fns = build(ctx.mesh, ctx.axis_name)
    a2a_local = all_to_all_input(g).reshape(g, g, WORD_BYTES)[rows].reshape(-1, WORD_BYTES)
    inputs = {
        "psum": _worker.shard_rows(ctx, psum_input(g)[rows]),
        "all_gather": _worker.shard_rows(ctx, gather_input(g)[rows]),
        "all_to_all": _worker.shard_rows(ctx, a2a_local),
    }
    out = {name: np.asarray(fns[name](inputs[name])) for name in fns}
    hlo = {name: fns[name].lower(inputs[name]).compile().as_text() for name in fns}
    _worker.emit({
        "process_id": ctx.process_id,
        "num_processes": ctx.num_processes,
        "local_devices": ctx.local_device_count,
        "global_devices": g,
        "values": dict(out),
        "dtypes": {k: str(v.dtype) for k, v in out.items()},
        "digests": {k: _worker.digest(v) for k, v in out.items()},
        "reduce_scatter_in_hlo": any("reduce-scatter" in t for t in hlo.values()),
        "gloo_listen": _worker.gloo_listen_addresses(),
    })


if __name__ == "__main__":
    main()
