"""Sphinx configuration of the sdpa_ref site.

Build (from the repository root, after ``python -m pip install ".[docs]"``)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Everything the pages show is made by the build: the API reference from the
docstrings (numpydoc), the contract and the guides from their Markdown
(MyST), the examples, tutorials and exercises by running them
(sphinx-gallery: a failed check in one fails the build), and the figures of
the Markdown pages by :mod:`docs._figures` (``builder-inited``). Math is
typeset by a MathJax 3 that ships inside the ``sphinx-mathjax-offline``
package: no page fetches anything from the network.
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                     # docs/_figures.py

import sdpa_ref  # noqa: E402  (the installed package: the build documents what pip installed)

project = "sdpa_ref"
author = "the sdpa_ref developers"
copyright = "2026, " + author
release = version = sdpa_ref.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "sphinx.ext.intersphinx",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
    "sphinx-mathjax-offline",                # MathJax 3 copied into _static: math renders offline
    "sphinx_togglebutton",                   # the exercises' solutions fold (admonitions of class dropdown)
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "**/GALLERY_HEADER.rst", "tutorials/*.py", "exercises/*.py", "README.md"]
templates_path = []
nitpicky = False
suppress_warnings = []

# --- API reference: numpydoc renders the docstrings; autosummary writes one page per public name
autosummary_generate = True
autodoc_default_options = {"members": False}
autodoc_typehints = "none"                   # the docstrings' Parameters say the types
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# --- the Markdown pages (SEMANTICS.md, docs/*.md)
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

# --- the examples, tutorials and exercises: each runs at build time; an exception fails the build
sphinx_gallery_conf = {
    "examples_dirs": ["../examples", "tutorials", "exercises"],
    "gallery_dirs": ["auto_examples", "auto_tutorials", "auto_exercises"],
    # run every script, not only plot_*.py (SDPA_REF_DOCS_ONLY, a regular expression, runs only the scripts it
    # matches: for working on one page; the others' pages then have no output)
    "filename_pattern": os.environ.get("SDPA_REF_DOCS_ONLY", r".*\.py$"),
    "ignore_pattern": r"(__init__|conftest)\.py$|[/\\]_[^/\\]*\.py$",
    "within_subsection_order": "FileNameSortKey",
    "reset_argv": "_figures.gallery_argv",
    "image_scrapers": ("matplotlib",),
    "download_all_examples": False,
    "write_computation_times": False,        # those pages load jQuery and DataTables from the network
    "show_memory": False,
    "min_reported_time": 10**9,              # no per-script time on the pages: timings are machine noise
    "remove_config_comments": True,
    "abort_on_example_error": False,         # report every failing script, then fail the build
    "only_warn_on_example_error": False,
    "matplotlib_animations": False,
    "capture_repr": ("_repr_html_", "__repr__"),
    "plot_gallery": "True",
}

# --- HTML: the PyData theme, everything local
html_theme = "pydata_sphinx_theme"
html_title = "sdpa_ref " + release
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 6,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_context = {"default_mode": "auto"}     # else the theme logs "invalid theme mode" on a first visit
html_sidebars = {"**": ["sidebar-nav-bs"]}
html_show_sourcelink = False
html_copy_source = False
intersphinx_mapping = {}                     # no inventory is fetched: the build needs no network

import _figures  # noqa: E402


def _site_links(app, docname, source):
    """The guides link the contract as ``../SEMANTICS.md`` (right on a code host); on the site it is ``semantics``."""
    if docname in ("architecture", "guide", "performance", "why-sqrt-dk"):
        source[0] = source[0].replace("](../SEMANTICS.md", "](semantics.md")


def setup(app):
    app.startup_time = time.time()
    app.connect("builder-inited", _figures.make_figures)
    app.connect("builder-inited", _figures.check_readme_figure, priority=900)   # after the gallery ran
    app.connect("source-read", _site_links)
