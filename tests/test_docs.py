"""The documentation and the tools it promises, checked cheaply (``make docs`` builds the site).

* every public name (``commjax.__all__``) has a docstring and a reference entry;
* every page of ``mkdocs.yml`` exists and every relative link between pages resolves;
* the custom compressor of ``docs/custom_compressor.md``, run as written, passes
  ``cj.testing.check_compressor``; a codec whose ``payload_words`` lies fails it;
* ``commjax.bench.run`` reports the HLO bytes of the plan for each method;
* every measured number that README.md and docs/ quote is the number in the current result
  file (``benchmarks/results/``), and each table names the command, commit and date of
  that file.

A table that quotes results is preceded by an HTML comment (invisible once rendered)
naming its source file, how a row is found and what each column holds::

    <!-- table: wire.json
    row: rows[compressor={key},replicas=8,auto=true]
    keys: identity; quantize 4
    cols: -; bytes_per_step_hlo:,.0f; ratio:.1f
    -->

``row`` selects the record of each row from the file (``rows[f=v,...]``: the element of the
list ``rows`` whose fields match, ``{key}`` standing for the row's key; without ``row``,
the column paths start at the file's top level and use ``{key}`` themselves). ``keys``
lists the rows' keys in order (``-`` skips a row); without it a row's key is the first
code span of its first cell. ``cols`` gives per column a dotted path into the record, an
optional ``*k`` or ``/k`` scale and a format; the cell's first number must read exactly
``format(value, spec)``, or hold no number where the file holds ``null`` (``-`` skips a
column). The same page holds a line naming
``results/<file>``, the file's ``command`` (in backticks), ``commit <hash>`` and its date.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import json
import re
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import pytest

import commjax as cj
from commjax import _compat, bench
from commjax.compressors.base import BlockCompressor
from commjax.testing import check_compressor

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
_TABLE = re.compile(r"<!--\s*table:\s*(?P<spec>.*?)-->[ \t]*\n(?P<table>(?:\|[^\n]*\n?)+)", re.S)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def test_every_public_name_has_a_docstring_and_a_reference_entry():
    reference = (DOCS / "reference.md").read_text()
    missing_doc, missing_ref = [], []
    for name in cj.__all__:
        obj = getattr(cj, name)
        if callable(obj) or isinstance(obj, type) or name == "collectives":
            if not (getattr(obj, "__doc__", None) or "").strip():
                missing_doc.append(name)
        if f"::: commjax.{name}\n" not in reference:
            missing_ref.append(name)
    assert not missing_doc, f"no docstring: {missing_doc}"
    assert not missing_ref, f"not in docs/reference.md: {missing_ref}"


def test_pages_exist_and_links_resolve():
    nav = re.findall(r":\s*([\w/]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert "reference.md" in nav and "choosing.md" in nav
    for page in nav:
        assert (DOCS / page).exists(), page
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
    for stale in ("commjax._compat import", "DESIGN.md"):
        assert stale not in (ROOT / "examples" / "README.md").read_text()
    assert "DESIGN.md" not in (ROOT / "commjax" / "distributed.py").read_text()


def _doc_codec():
    """The Int8Nearest class of docs/custom_compressor.md, executed as written."""
    text = (DOCS / "custom_compressor.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(compile(code, "custom_compressor.md", "exec"), namespace)  # noqa: S102
    return namespace["Int8Nearest"]()


def test_custom_compressor_page_passes_check_compressor():
    report = check_compressor(_doc_codec(), num_replicas=2, steps=2, reducers=["allgather"])
    assert report["reducers"] == ["allgather"] and report["hlo_bytes"]["allgather"] > 0


def test_check_compressor_on_fewer_replicas_than_devices():
    """The two-phase server residual is sized for the replicas checked (4), not for every
    device of the machine (8): a state sized for 8 was refused at the first step."""
    report = check_compressor(cj.quantize(8), num_replicas=4, steps=2, reducers=["two_phase"])
    assert report["reducers"] == ["two_phase"] and report["hlo_bytes"]["two_phase"] > 0


@dataclasses.dataclass(frozen=True)
class _Lying(BlockCompressor):
    """Encodes 2 words per block but claims 1: its byte count would be wrong."""

    name: ClassVar[str] = "lying"

    @property
    def block(self):
        return 64

    @property
    def row_words(self):
        return 1

    def encode_blocks(self, blocks, key, start=0):
        return jax.lax.bitcast_convert_type(blocks[:, :2], jnp.uint32)

    def decode_blocks(self, rows):
        return jnp.zeros((rows.shape[0], 64), jnp.float32)


def test_check_compressor_names_the_broken_property():
    with pytest.raises(AssertionError, match="payload size"):
        check_compressor(_Lying(), num_replicas=2)
    with pytest.raises(AssertionError, match="subclass commjax"):
        check_compressor("int8")


def test_bench_reports_the_plan_bytes():
    mesh = _compat.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    rows = bench.run(2e4, compressors=["int8"], layers=2, steps=1, mesh=mesh)
    params = bench._model(2e4, 2)
    assert [r.method for r in rows] == ["no exchange (floor)", "exact fp32 mean", "pmean", "int8"]
    assert rows[0].bytes == 0
    for row, codec in zip(rows[1:], (cj.identity(), None, cj.quantize(8))):
        # lax.pmean sends each fp32 leaf as it is: the plan's exact baseline.
        plan = cj.communication_plan(codec or cj.identity(), params, 2)
        assert row.bytes == pytest.approx(plan.bytes_per_step if codec else plan.baseline_bytes)
        assert row.step_s > 0 and row.bound > 0
    assert "reached" in bench.table(rows)
    # In buckets of one leaf each (bf16 residuals), the int8 row sends each leaf's own plan.
    split = bench.run(2e4, compressors=["int8"], layers=2, steps=1, mesh=mesh, bucket_bytes=40_000,
                      residual_dtype="bfloat16")
    per_leaf = sum(cj.communication_plan(cj.quantize(8), {k: v}, 2).bytes_per_step for k, v in params.items())
    assert split[3].bytes == pytest.approx(per_leaf) and split[3].bytes != rows[3].bytes
    assert split[1].bytes == rows[1].bytes and split[2].bytes == rows[2].bytes


@pytest.mark.parametrize("params,layers,side", [(2e4, 2, 100), (1e8, 4, 4992), (1e9, 4, 15872),
                                                (3e5, 4, 256), (4e4, 1, 256), (1.2e4, 1, 110)])
def test_bench_widths_are_model_widths(params, layers, side):
    """The benchmarked matrices' side is a multiple of 128 from 128 up (whole TPU lane
    rows per row, as a model's widths); below, the square root as it is."""
    assert bench._width(params, layers) == side
    assert {s.shape for s in bench._shapes(params, layers).values()} == {(side, side)}
    assert bench._width(params, layers, width=5000) == 5000  # --width: the user's own side
    with pytest.raises(ValueError, match="width"):
        bench._width(params, layers, width=0)


def test_bench_check_finite_option(capsys, monkeypatch):
    """``--check-finite reset`` reaches the compressed rows and not the exact one (same
    wire bytes: the guard changes what the residuals keep, not what is sent); a bad value
    fails before any timing, naming the option."""
    mesh = _compat.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    keep = bench.run(2e4, compressors=["int8"], layers=2, steps=1, mesh=mesh)
    calls = []
    made = bench.compressed_mean
    monkeypatch.setattr(bench, "compressed_mean", lambda c, *a, **k: calls.append((c.name, k)) or made(c, *a, **k))
    reset = bench.run(2e4, compressors=["int8"], layers=2, steps=1, mesh=mesh, check_finite="reset")
    monkeypatch.undo()
    assert calls == [("identity", {}), ("quantize", {"check_finite": "reset"})]
    assert [r.bytes for r in reset] == [r.bytes for r in keep]
    with pytest.raises(ValueError, match="check_finite"):
        bench.run(2e4, compressors=["int8"], layers=2, steps=1, mesh=mesh, check_finite="maybe")
    for run in (bench.run, bench.run_target):  # before any compile, with or without the aot extra
        with pytest.raises(ValueError, match="unknown `compressors`"):
            run(*(("v5e:2x4",) if run is bench.run_target else ()), compressors=["int9"])
    assert bench.main(["--params", "1e9", "--width", "100", "--layers", "2", "--steps", "1",
                       "--compressors", "int8", "--bucket-mb", "0.05", "--check-finite", "reset"]) == 0
    out = capsys.readouterr().out
    assert "compressed_mean(codec, bucket_bytes=52428, check_finite='reset')" in out
    assert "2 matrices of 100 x 100 (0.02M parameters)" in out
    with pytest.raises(SystemExit):
        bench.main(["--check-finite", "maybe"])


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="the docs extra is not installed (make docs installs it)")
def test_mkdocs_builds_strict(tmp_path):
    from mkdocs.commands.build import build  # noqa: PLC0415  (optional extra)
    from mkdocs.config import load_config  # noqa: PLC0415

    build(load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site")))
    assert (tmp_path / "site" / "reference" / "index.html").exists()


# ------------------------------------------------------------------ quoted results


def _pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))


def _spec(text: str) -> dict:
    """``file`` and the ``row``/``keys``/``cols`` fields of a table comment."""
    head, *lines = [ln.strip() for ln in text.strip().splitlines()]
    out = {"file": head, "row": None, "keys": None, "cols": []}
    for ln in lines:
        name, _, value = ln.partition(":")
        parts = [v.strip() for v in value.split(";")]
        out[name.strip()] = value.strip() if name.strip() == "row" else parts
    return out


def _select(record, path: str, key: str):
    """Follow a dotted ``path`` (``rows[f=v,...]`` picks a list element by its fields)."""
    for seg in re.split(r"\.(?![^\[]*\])", path):
        seg = seg.replace("{key}", key)
        m = re.fullmatch(r"(\w*)\[(.*)\]", seg)
        if m is None:
            record = record[seg] if isinstance(record, dict) else record[int(seg)]
            continue
        items = record[m[1]] if m[1] else record
        want = dict(c.strip().split("=", 1) for c in re.split(r",(?=\s*\w+=)", m[2]))
        found = [r for r in items if all(str(r.get(f)).lower() == v.lower() for f, v in want.items())]
        assert len(found) == 1, f"{seg!r} matches {len(found)} records"
        record = found[0]
    return record


def _expected(record, col: str, key: str):
    """The cell's number as ``format`` writes it; ``None`` where the file holds none (the
    cell then shows no number)."""
    path, _, fmt = col.partition(":")
    scale = re.fullmatch(r"(.*?)([*/])([\d.e+-]+)", path)
    value = _select(record, scale[1] if scale else path, key)
    if value is None:
        return None
    if scale:
        value = value * float(scale[3]) if scale[2] == "*" else value / float(scale[3])
    return format(value, fmt)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables():
    for page in _pages():
        for m in _TABLE.finditer(page.read_text()):
            yield page, _spec(m["spec"]), [_cells(ln) for ln in m["table"].splitlines()[2:] if ln.strip()]


def test_every_quoted_result_is_the_current_one():
    checked = 0
    for page, spec, rows in _tables():
        data = json.loads((RESULTS / spec["file"]).read_text())
        keys = spec["keys"] or [(re.findall(r"`([^`]+)`", r[0]) or ["-"])[0] for r in rows]
        assert len(keys) == len(rows), f"{page.name} {spec['file']}: {len(keys)} keys, {len(rows)} rows"
        for key, cells in zip(keys, rows):
            if key == "-":
                continue
            record = data if spec["row"] is None else _select(data, spec["row"], key)
            for col, cell in zip(spec["cols"], cells):
                if col == "-":
                    continue
                got = _NUMBER.findall(cell.replace("\u2212", "-"))
                want = _expected(record, col, key)
                assert (got[:1] or [None])[0] == want, f"{page.name} {spec['file']} row {key!r}: {cell!r} != {want}"
                checked += 1
    assert checked > 100


def test_every_quoted_result_file_names_its_provenance():
    for page, spec, _ in _tables():
        data = json.loads((RESULTS / spec["file"]).read_text())
        text = page.read_text()
        lines = [ln for ln in text.splitlines() if f"results/{spec['file']}" in ln and f"`{data['command']}`" in ln
                 and f"commit {data['commit']}" in ln and data["date"][:10] in ln]
        assert lines, f"{page.name}: no line with results/{spec['file']}, its command, commit and date"


def test_results_index_lists_every_file():
    """Every result file is in the index (by name, or by a family pattern such as
    ``aot_*.json``) and carries its provenance."""
    index = (RESULTS / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([^`]+\.json)`(.*)$", index, re.M))
    for f in sorted(RESULTS.glob("*.json")):
        assert any(fnmatch.fnmatch(f.name, n) for n in rows), f"benchmarks/results/README.md does not list {f.name}"
        data = json.loads(f.read_text())
        assert {"command", "commit", "date", "machine"} <= set(data), f"{f.name} lacks its provenance"
        if f.name in rows:  # a row naming the file gives the command that regenerates it
            assert f"`{data['command']}`" in rows[f.name], f"the index's command for {f.name}"


def test_no_words_of_the_development_process():
    pattern = re.compile(r"\b(session|rerun|redesign)", re.I)
    for path in _pages() + sorted(RESULTS.glob("*")):
        if path.suffix in (".md", ".json"):
            assert not pattern.search(path.read_text()), f"{path.name}: {pattern.search(path.read_text())[0]!r}"



def test_docstrings_use_markdown_cross_references():
    """The site renders Markdown cross-references as links; a Sphinx role would show as text."""
    role = re.compile(r":(func|class|meth|attr|mod|data|exc|obj):`")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "commjax").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if role.search(line)]
    assert not found, f"Sphinx roles (write [`name`][] or [`name`][full.path]): {found[:10]}"


@pytest.mark.parametrize("argv,flag", [(["--params", "0"], "--params"), (["--params", "-5"], "--params"),
                                       (["--params", "inf"], "--params"), (["--layers", "0"], "--layers"),
                                       (["--steps", "0"], "--steps"), (["--batch", "0"], "--batch"),
                                       (["--devices", "0"], "--devices"), (["--width", "0"], "--width"),
                                       (["--bucket-mb", "-1"], "--bucket-mb")])
def test_bench_refuses_values_no_run_can_use(argv, flag, capsys):
    """``python -m commjax.bench`` with a count that is not positive (or a negative bucket
    size) stops before any compile, naming the flag: it printed NaN rows, or failed with
    a ZeroDivisionError (``--layers 0``) or a TypeError (``--params -5``)."""
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err


def test_bench_run_refuses_a_model_it_cannot_build():
    """``bench.run`` from Python: no parameters or no layers is an error naming the argument."""
    with pytest.raises(ValueError, match="num_params"):
        bench._width(0, 2)
    with pytest.raises(ValueError, match="layers"):
        bench._width(1e4, 0)
