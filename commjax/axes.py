"""Which mesh axes each collective of a compiled program runs over, and the bytes per axis.

On a multi-axis mesh (``data x stage x model``) every axis is its own network (DCN, ICI,
NVLink) and the compression on one says nothing about another, so bytes are read per
axis: a collective's replica groups (or, for a ``collective-permute``, its source-target
pairs) are partition ids, which jit assigns in the order of ``mesh.devices.flat``; the
axes along which the mesh coordinates of a group's members differ are the axes it runs
over::

    report = cj.collective_bytes(compiled)
    commjax.axes.bytes_by_axis(report, mesh)   # {"data": ..., "model": ..., "stage": ...}

Keys are the axis names joined by ``"+"`` (``"data+model"`` for a collective over both).
Counting follows [`commjax.collective_bytes`][] (each instruction once, ring bytes).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import numpy as np

from commjax._hlo import _mesh_groups

__all__ = ["collective_axes", "bytes_by_axis"]

_GROUP_KEYS = ("replica_groups", "source_target_pairs")


def _instruction_line(text: str, name: str) -> Optional[str]:
    m = re.search(r"^\s*(?:ROOT\s+)?%?" + re.escape(name) + r"\s*=.*$", text, re.MULTILINE)
    return None if m is None else m.group(0)


def _groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups an instruction names: explicit ``{{0,1},{2,3}}`` lists, iota
    ``[G,S]<=[dims]T(perm)`` tiles, the mesh form (``commjax._hlo._mesh_groups``), or
    source-target pairs (each pair a group)."""
    for key in _GROUP_KEYS:
        m = re.search(r"\b" + key + r"\s*=\s*", line)
        if m is None:
            continue
        rest = line[m.end():]
        if rest.startswith("mesh["):  # shard_map manual over some axes only
            return _mesh_groups(rest, key)
        iota = re.match(r"\[([\d,\s]+)\]\s*<=\s*\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?", rest)
        if iota:
            shape = [int(v) for v in iota.group(1).split(",") if v.strip()]
            dims = [int(v) for v in iota.group(2).split(",") if v.strip()]
            ids = np.arange(int(np.prod(dims))).reshape(dims)
            if iota.group(3):
                ids = ids.transpose([int(v) for v in iota.group(3).split(",") if v.strip()])
            return ids.reshape(-1, shape[-1]).tolist()
        body = re.match(r"\{((?:\{[\d,\s]*\},?\s*)*)\}", rest)
        if body:
            return [[int(v) for v in g.split(",") if v.strip()]
                    for g in re.findall(r"\{([\d,\s]*)\}", body.group(1))]
    return [list(range(num_devices))]  # no groups: every device


def _axes_of(groups: list[list[int]], mesh: Any) -> tuple[str, ...]:
    shape = mesh.devices.shape
    varying = set()
    for g in groups:
        coords = np.array([np.unravel_index(d, shape) for d in g if d < int(np.prod(shape))])
        if len(coords) > 1:
            varying |= {k for k in range(len(shape)) if len(set(coords[:, k])) > 1}
    return tuple(name for k, name in enumerate(mesh.axis_names) if k in varying)


def collective_axes(report: Any, mesh: Any) -> list[tuple[Any, tuple[str, ...]]]:
    """``(collective, axes it runs over)`` for every collective of ``report`` (a
    [`commjax.CollectiveReport`][] of a program compiled for ``mesh``)."""
    n = int(np.prod(mesh.devices.shape))
    out = []
    for c in report.collectives:
        line = _instruction_line(report.hlo_text, c.hlo_name)
        out.append((c, _axes_of(_groups(line or "", n), mesh)))
    return out


def bytes_by_axis(report: Any, mesh: Any, *, steady: bool = False) -> dict[str, float]:
    """Ring bytes per device summed by the axes each collective runs over (keys: axis
    names joined by ``"+"``, ``""`` for a group of one). ``steady``: leave out the
    collectives in conditional branches."""
    out: dict[str, float] = {}
    for c, axes in collective_axes(report, mesh):
        if steady and c.in_conditional:
            continue
        key = "+".join(axes)
        out[key] = out.get(key, 0.0) + float(c.ring_bytes)
    return out
