"""The docs site covers the public API (the build itself runs in .ci/run: sphinx-build -W)."""

from __future__ import annotations

import ast
import builtins
import inspect
import re
import runpy
from pathlib import Path

import pytest

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


# ---------------------------------------------------------------------------
# The API pages as a user reads them (issue #30 item 6)


def _public_docstrings():
    """``(name, docstring)`` of every public name and of the members its page shows (once each)."""
    seen: set[int] = set()
    for module, names in ((umem_numba, umem_numba.__all__), (kernels, kernels.__all__)):
        for name in names:
            obj = getattr(module, name)
            items = [(name, obj)]
            if isinstance(obj, type):
                items += [(f"{name}.{m}", getattr(obj, m, None)) for m in dir(obj) if not m.startswith("_")]
            for label, item in items:
                doc = getattr(item, "__doc__", None)
                if isinstance(doc, str) and id(doc) not in seen:
                    seen.add(id(doc))
                    yield label, doc


def test_the_api_pages_name_no_private_module():
    """A ``pool`` parameter pointed at ``umem_numba._memory._pool``; the pages name public things only."""
    found = [f"{label}: {m}" for label, doc in _public_docstrings() for m in re.findall(r"umem_numba\._[\w.]*", doc)]
    assert not found, "\n".join(found)


def _example_source(doc: str) -> str:
    lines = []
    for line in inspect.cleandoc(doc).splitlines():
        text = line.strip()
        if text.startswith((">>> ", "... ")) or text in (">>>", "..."):
            lines.append(text[4:])
    return "\n".join(lines)


def test_examples_call_only_what_they_define():
    """ManagedBuffer's example launched ``double``, which it never defined.  Names an example calls
    (or launches) are defined in it, imported, builtins or umem_numba's; data it works on may be assumed."""
    known = set(dir(builtins)) | {"np", "cuda", "um", "cupy", "torch", "jax"}
    known |= set(umem_numba.__all__) | set(kernels.__all__)
    missing = []
    for label, doc in _public_docstrings():
        source = _example_source(doc)
        if not source:
            continue
        tree = ast.parse(source)
        defined = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        defined |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {
            (a.asname or a.name).split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                callee = node.func.value if isinstance(node.func, ast.Subscript) else node.func  # kernel[g, b](...)
                if isinstance(callee, ast.Name) and callee.id not in defined | known:
                    missing.append(f"{label}: {callee.id}")
    assert not missing, "examples call names they never define:\n" + "\n".join(missing)


def test_class_pages_show_a_signature_a_user_can_call():
    """The buffers' pages showed ``ManagedBuffer(*args, **kwargs)``: they cannot be called (their
    constructors are classmethods), so the page shows no call signature; others show their own."""
    conf = runpy.run_path(str(DOCS / "conf.py"))
    shown = {}
    for name in umem_numba.__all__:
        obj = getattr(umem_numba, name)
        if not isinstance(obj, type):
            continue
        result = conf["class_signature"](None, "class", f"umem_numba.{name}", obj, {}, None, None)
        try:
            shown[name] = result[0] if result else str(inspect.signature(obj))
        except ValueError:  # no Python signature (an exception without __init__): Sphinx shows none
            shown[name] = ""
    bad = {name: sig for name, sig in shown.items() if "*args" in sig or "**kwargs" in sig}
    assert not bad, bad
    for name in ("ManagedBuffer", "PinnedBuffer", "VMMBuffer", "DeviceBuffer"):
        assert shown[name] == "", name
        with pytest.raises(TypeError, match="cannot be called directly"):
            getattr(umem_numba, name)()
    assert shown["UmemNumbaMemoryManager"] == "(*, context)"


def test_the_number_of_buffer_kinds_is_the_libraries():
    """memory-kinds.md said "three kinds of buffer"; there are four."""
    from umem_numba._arrays._buffer import Buffer

    kinds = sorted(n for n in umem_numba.__all__ if isinstance(getattr(umem_numba, n), type) and n.endswith("Buffer"))
    assert all(issubclass(getattr(umem_numba, n), Buffer) for n in kinds)
    words = {3: "three", 4: "four", 5: "five", 6: "six"}
    text = (DOCS / "concepts" / "memory-kinds.md").read_text()
    assert f"umem_numba has {words[len(kinds)]} kinds of buffer" in text
    table = re.findall(r"^\| \{class\}`~umem_numba\.(\w+)`", text, flags=re.MULTILINE)
    assert sorted(table) == kinds


def test_code_on_the_index_page_fits_its_column():
    """The index page's code ran past the right edge of furo's content column (78 characters of its code font)."""
    blocks = re.findall(r"```(?:bash|python)\n(.*?)```", (DOCS / "index.md").read_text(), flags=re.DOTALL)
    assert blocks
    long = [line for block in blocks for line in block.splitlines() if len(line) > 76]
    assert not long, "\n".join(long)


def test_the_memory_manager_plugin_has_a_heading_of_its_own():
    api = (DOCS / "api.rst").read_text()
    sections = re.split(r"\n(?=[^\n]+\n-{3,}\n)", api)
    (plugin,) = [s for s in sections if "   UmemNumbaMemoryManager\n" in s]
    assert plugin.splitlines()[0] == "numba's memory-manager plugin", plugin.splitlines()[0]
    assert re.findall(r"^   (\w+)$", plugin, flags=re.MULTILINE) == ["UmemNumbaMemoryManager"]
    assert "\n## numba's memory-manager plugin\n" in (DOCS / "concepts" / "pools.md").read_text()
