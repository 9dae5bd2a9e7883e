"""Sphinx configuration of jaxring's documentation site: ``make docs`` builds it into
docs/_build/html with warnings as errors."""
from __future__ import annotations

import os
import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
# autodoc imports jaxring, which imports jax: keep it on the CPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxring  # noqa: E402

project = "jaxring"
author = "the jaxring authors"
copyright = "the jaxring authors"  # noqa: A001 (Sphinx's name for it)
release = version = jaxring.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
# Pages kept for old links but in no table of contents (a moved page's stub, a page that is
# being retired): built without the "not included in any toctree" warning.
ORPHANS = {"reliability", "benchmarks-history"}
HAS_CHANGELOG = (ROOT / "CHANGELOG.md").exists()
if not HAS_CHANGELOG:   # docs/changelog.md includes ../CHANGELOG.md
    exclude_patterns.append("changelog.md")

# Markdown: headings get anchors (links such as benchmarks.md#allocator), ::: fences, $math$.
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 4

# API reference: Google-style docstrings, members in source order, types in the descriptions of
# the documented parameters only.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autosummary_generate = False
python_use_unqualified_type_names = True

html_theme = "sphinx_book_theme"
html_title = "jaxring"
html_theme_options = {"show_toc_level": 2}


def _source_read(app, docname, source):
  if docname in ORPHANS:
    source[0] = "---\norphan: true\n---\n" + re.sub(r"\A---\n.*?\n---\n", "", source[0], flags=re.S)
  if docname == "index" and not HAS_CHANGELOG:
    source[0] = re.sub(r"^changelog\n", "", source[0], flags=re.M)


def setup(app):
  app.connect("source-read", _source_read)
