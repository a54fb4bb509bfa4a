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
    "sphinx_copybutton",                     # a copy button on every code block, prompts and outputs left out
    "sphinx_codeautolink",                   # names in code examples (guides and gallery) link to their API pages
    "sphinxcontrib.bibtex",                  # one bibliography (references.bib, the References page)
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "**/GALLERY_HEADER.rst", "tutorials/*.py", "exercises/*.py", "README.md"]
templates_path = ["_templates"]             # sidebar-site-nav.html: the whole site in the left sidebar
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
myst_fence_as_directive = ["math"]          # SEMANTICS.md's ```math blocks: math here, as on a code host
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
    "image_scrapers": ("_scraper.matplotlib_plain_alt",),   # alt text without TeX
    "download_all_examples": False,
    "write_computation_times": False,        # those pages load jQuery and DataTables from the network
    "show_memory": False,
    "min_reported_time": 10**9,              # no per-script time on the pages: timings are machine noise
    "remove_config_comments": True,
    "abort_on_example_error": False,         # report every failing script, then fail the build
    "only_warn_on_example_error": False,
    "matplotlib_animations": False,
    "capture_repr": ("_repr_html_", "__repr__"),
    "ignore_repr_types": r"matplotlib[.]",   # a script's last Colorbar or Text is no output for the reader
    "plot_gallery": "True",
}

# --- HTML: the PyData theme, everything local
html_theme = "pydata_sphinx_theme"
html_title = "sdpa_ref " + release
html_theme_options = {
    "navigation_with_keys": False,
    "navbar_center": [],                     # the site's parts are in the left sidebar, not a header that wraps
    "show_toc_level": 2,
    "header_links_before_dropdown": 6,
    "secondary_sidebar_items": [],           # the page's contents go under the site's, so the column is wide
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_context = {"default_mode": "auto"}     # else the theme logs "invalid theme mode" on a first visit
html_sidebars = {"**": ["sidebar-site-nav", "page-toc"]}
html_static_path = ["_static"]               # the layout (sdpa_ref.css) and wide equations on a phone (sdpa_ref.js)
html_css_files = ["sdpa_ref.css"]
html_js_files = ["sdpa_ref.js"]
maximum_signature_line_length = 88           # a longer signature puts one parameter per line: it fits the column
# MathJax's \top is a hairline at 1x; K^\top is typeset as a sans-serif T, which reads at any size
mathjax3_config = {"tex": {"macros": {"top": r"{\mathsf{T}}"}}}
html_show_sourcelink = False
html_copy_source = False
intersphinx_mapping = {}                     # no inventory is fetched: the build needs no network

# --- a reader moves freely: copy buttons, linked code, citations, [source] links
copybutton_prompt_text = r">>> |\.\.\. |\$ "    # the prompts of Python sessions and shells are not copied
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = False    # a block with no prompt (most of them) is copied whole
copybutton_exclude = ".linenos, .gp, .go"
codeautolink_concat_default = True           # a gallery page's blocks are one script: names imported above resolve
bibtex_bibfiles = ["references.bib"]
bibtex_default_style = "plain"
bibtex_reference_style = "author_year"       # (Vaswani et al., 2017, sec. 3.2.1)

import _figures  # noqa: E402
import _linkcode  # noqa: E402

#: ``[source]`` beside every documented name. With a repository URL (setup.cfg's ``project_urls`` entry
#: ``Source``, or the environment variable SDPA_REF_SOURCE_URL) it links to the object's lines in the repository
#: (sphinx.ext.linkcode) at the commit the site was built from (``git rev-parse HEAD``), or at the version's tag
#: ``v<version>`` outside a git checkout. With none, as in this repository today, the lines are shown in the site's
#: own highlighted copy of the module (sphinx.ext.viewcode): the reader still lands on the object's lines.
SOURCE_URL = _linkcode.repository_url()
if SOURCE_URL:
    extensions.append("sphinx.ext.linkcode")
    linkcode_resolve = _linkcode.resolver(SOURCE_URL, _linkcode.source_ref(version))
else:
    extensions.append("sphinx.ext.viewcode")


def _site_links(app, docname, source):
    """The guides link the contract as ``../SEMANTICS.md`` (right on a code host); on the site it is ``semantics``."""
    if docname in ("architecture", "guide", "performance", "why-sqrt-dk") or docname.startswith("guide-"):
        source[0] = source[0].replace("](../SEMANTICS.md", "](semantics.md")


def _gallery_links_itself(app, doctree):
    """A gallery page whose script ran has its names linked by sphinx-gallery (its ``.codeobj.json``, to the same
    API pages); codeautolink, which cannot match code already linked, skips that page and links every other."""
    if os.path.isfile(os.path.join(app.srcdir, app.env.docname + ".codeobj.json")):
        from sphinx_codeautolink.extension.directive import SkipMarker
        doctree.insert(0, SkipMarker("file"))


def _viewcode_backlinks(app, exception):
    """viewcode's ``[docs]`` links name an object by the module that defines it (``sdpa_ref.api.sdpa_forward``)
    where the API page documents it by its public name (``sdpa_ref.sdpa_forward``): each such link is pointed at
    the id on its page that ends in the same name, so it lands on the object, not at the page's top."""
    import re

    root = os.path.join(app.outdir, "_modules")
    if exception is not None or not os.path.isdir(root):
        return
    link = re.compile(r'href="([^"#]+\.html)#([^"]+)"')
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as fh:
                text = fh.read()

            def fix(m, folder=folder):
                target = os.path.normpath(os.path.join(folder, m.group(1)))
                if not os.path.isfile(target):
                    return m.group(0)
                with open(target, encoding="utf-8") as fh:
                    ids = set(re.findall(r'id="([^"]+)"', fh.read()))
                if m.group(2) in ids:
                    return m.group(0)
                parts = m.group(2).split(".")
                for k in range(1, len(parts)):              # the longest dotted tail the page has: Class.method
                    same = sorted(i for i in ids if i.endswith("." + ".".join(parts[k:])))
                    if same:
                        return f'href="{m.group(1)}#{same[0]}"'
                return f'href="{m.group(1)}"'

            new = link.sub(fix, text)
            if new != text:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(new)


def setup(app):
    app.startup_time = time.time()
    app.connect("build-finished", _viewcode_backlinks)
    app.connect("doctree-read", _gallery_links_itself, priority=400)     # before codeautolink reads the blocks
    app.connect("builder-inited", _figures.make_figures)
    app.connect("builder-inited", _figures.check_readme_figure, priority=900)   # after the gallery ran
    app.connect("source-read", _site_links)
