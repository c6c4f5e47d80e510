"""The kernels and the examples build on umem_numba's public API only (pyproject's import-linter contract)."""

from __future__ import annotations

import pkgutil
import re
import sys
from pathlib import Path

import umem_numba

ROOT = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None


def test_forbidden_contract_names_every_private_module():
    """import-linter's wildcards replace whole names only, so the contract lists umem_numba's private
    modules one by one: a new one must join the list, or kernels could import it unchecked."""
    if tomllib is None:
        import pytest

        pytest.skip("tomllib needs Python 3.11")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}
    forbidden = set(contracts["kernels use the public API only"]["forbidden_modules"])
    private = {f"umem_numba.{m.name}" for m in pkgutil.iter_modules(umem_numba.__path__) if m.name.startswith("_")}
    assert private, "no private modules found"
    assert private <= forbidden, sorted(private - forbidden)


def test_kernels_and_examples_name_no_private_module():
    """Not even lazily or in a string: ``umem_numba._x`` appears nowhere in kernels/ or examples/ code."""
    pattern = re.compile(r"umem_numba\._[a-z]|from umem_numba import _[a-z]")
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for folder in ("kernels", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, "\n".join(found)
