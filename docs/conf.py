"""Sphinx configuration: ``sphinx-build -W -b html docs docs/_build`` (no GPU needed)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # so that an uninstalled checkout builds too


def _version() -> str:
    import umem_numba

    return umem_numba.__version__


project = "umem_numba"
author = "umem_numba contributors"
copyright = "umem_numba contributors"
release = _version()
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "report/*.md", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# API reference: one page per public name, generated from the docstrings.
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "none"  # numpydoc's Parameters sections carry the types
autodoc_member_order = "bysource"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"umem_numba {release}"
# Every public name has a docstring, and none documents a parameter that does not exist.
numpydoc_validation_checks = {"GL08", "PR02"}


def class_signature(app, what, name, obj, options, signature, return_annotation):  # type: ignore[no-untyped-def]
    """No call signature for the buffer classes: they cannot be called (``Buffer.__init__`` refuses,
    naming the constructors), so ``ManagedBuffer(*args, **kwargs)`` would show a call that fails;
    their pages start with the constructors (``empty``, ``zeros``, ``from_array``) instead."""
    from umem_numba._arrays._buffer import Buffer

    if what == "class" and isinstance(obj, type) and issubclass(obj, Buffer) and obj.__init__ is Buffer.__init__:
        return "", return_annotation
    return None


def public_bases(app, name, obj, options, bases):  # type: ignore[no-untyped-def]
    """ "Bases:" lists only what a reader can look up: umem_numba's private base classes (``Buffer``,
    the export mix-ins) are implementation, not API; other libraries' bases (``RuntimeError``) stay."""
    import umem_numba

    bases[:] = [
        b
        for b in bases
        if not getattr(b, "__module__", "").startswith("umem_numba") or getattr(umem_numba, b.__name__, None) is b
    ]


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("autodoc-process-signature", class_signature)
    app.connect("autodoc-process-bases", public_bases)
