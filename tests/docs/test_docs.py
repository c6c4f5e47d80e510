"""The docs site covers the public API (the build itself runs in .ci/run: sphinx-build -W)."""

from __future__ import annotations

import re
from pathlib import Path

import umem_numba
from umem_numba import kernels

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _documented() -> set[str]:
    text = (DOCS / "api.rst").read_text()
    names = set(re.findall(r"^   ([A-Za-z_][A-Za-z0-9_]*)$", text, flags=re.MULTILINE))  # autosummary entries
    names |= set(re.findall(r"^\.\. data:: ([A-Za-z_][A-Za-z0-9_]*)$", text, flags=re.MULTILINE))
    return names


def test_every_public_name_is_in_the_api_reference():
    documented = _documented()
    missing = sorted(set(umem_numba.__all__) - documented) + sorted(
        f"kernels.{n}" for n in set(kernels.__all__) - documented
    )
    assert not missing, f"add these to docs/api.rst: {', '.join(missing)}"
    unknown = sorted(n for n in documented if not hasattr(umem_numba, n) and not hasattr(kernels, n))
    assert not unknown, f"docs/api.rst lists names that do not exist: {', '.join(unknown)}"


def test_every_page_is_reachable_from_the_index():
    toctrees = "\n".join(re.findall(r"```\{toctree\}(.*?)```", (DOCS / "index.md").read_text(), flags=re.DOTALL))
    pages = {
        p.relative_to(DOCS).with_suffix("").as_posix()
        for p in DOCS.rglob("*")
        if p.suffix in (".md", ".rst")
        and "_build" not in p.parts
        and "_templates" not in p.parts
        and p.parts[len(DOCS.parts)] not in ("report", "api")
    } - {"index"}
    unreachable = sorted(p for p in pages if p not in toctrees)
    assert not unreachable, f"pages in no toctree of docs/index.md: {unreachable}"
    assert "report/report.md" in (DOCS / "benchmarks.md").read_text()
    assert (DOCS / "report" / "report.md").exists()
