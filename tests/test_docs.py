"""The documentation and the tools it promises, checked cheaply (``make docs`` builds the site).

* every public name (``commjax.__all__``) has a docstring and a reference entry;
* every page of ``mkdocs.yml`` exists and every relative link between pages resolves;
* the custom compressor of ``docs/custom_compressor.md``, run as written, passes
  ``cj.testing.check_compressor``; a codec whose ``payload_words`` lies fails it;
* ``commjax.bench.run`` reports the HLO bytes of the plan for each method.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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
    assert [r.method for r in rows] == ["no exchange (floor)", "exact fp32 mean", "int8"]
    assert rows[0].bytes == 0
    for row, codec in zip(rows[1:], (cj.identity(), cj.quantize(8))):
        assert row.bytes == pytest.approx(cj.communication_plan(codec, params, 2).bytes_per_step)
        assert row.step_s > 0 and row.bound > 0
    assert "reached" in bench.table(rows)


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="the docs extra is not installed (make docs installs it)")
def test_mkdocs_builds_strict(tmp_path):
    from mkdocs.commands.build import build  # noqa: PLC0415  (optional extra)
    from mkdocs.config import load_config  # noqa: PLC0415

    build(load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site")))
    assert (tmp_path / "site" / "reference" / "index.html").exists()
