"""Sphinx configuration for the grain_jax_sync documentation site.

Build (warnings are errors, as in CI):

  python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # Document this checkout, not an installed copy.

import grain_jax_sync  # noqa: E402

project = "grain_jax_sync"
author = "the grain_jax_sync authors"
copyright = "the grain_jax_sync authors, Apache-2.0"  # noqa: A001 - Sphinx's name.
release = grain_jax_sync.__version__
version = release

# `contents` holds the site's table of contents; `index.md` stays the page of
# rules that the README links to. A new page is one line in a toctree there.
root_doc = "contents"
extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "requirements.txt"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = f"grain_jax_sync {release}"
html_theme_options = {
  "show_toc_level": 2,
  "use_download_button": False,
  "use_fullscreen_button": False,
}

# Pages link to a few files outside docs/ (links that work on GitHub); each of
# these has a page here that includes it, and the link goes to that page.
OUTSIDE_DOCS = {
  "benchmarks/RESULTS": "benchmark_results",
  "CHANGELOG": "changelog",
}


def _link_outside_docs(app, doctree) -> None:
  from sphinx import addnodes

  for node in doctree.findall(addnodes.pending_xref):
    target = node.get("reftarget", "")
    if node.get("refdomain") != "doc" or not os.path.isabs(target):
      continue
    rel = os.path.relpath(target, ROOT).replace(os.sep, "/")
    if rel in OUTSIDE_DOCS:
      node["reftarget"] = OUTSIDE_DOCS[rel]


def setup(app):
  app.connect("doctree-read", _link_outside_docs)
