"""The figures of the Markdown pages, made by every build (never committed).

:func:`make_figures` runs at ``builder-inited`` and writes ``docs/_generated/``:
``diagnose.png`` and ``diagnose.txt`` (``sdpa-ref diagnose --plot``: the
figure and the table). The examples' figures come from running the examples
in the gallery (:func:`gallery_argv` gives each its arguments, ``--plot``
into ``_generated/`` among them), so a page that shows one shows what this
build's run produced.
"""

import os

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATED = os.path.join(HERE, "_generated")

# the arguments each example runs with in the gallery (others: none)
_ARGV = {
    "copy_task.py": ["--seeds", "5", "--plot", os.path.join(GENERATED, "copy_task.png")],
    "saturation_demo.py": ["--plot", os.path.join(GENERATED, "saturation.png")],
}
README_FIGURE = os.path.join(HERE, "images", "saturation.png")     # the README's picture, committed


def _digest(path):
    """The data digest a figure's PNG records (its ``Description``), or None."""
    from PIL import Image

    with Image.open(path) as im:
        return im.text.get("Description")


def check_readme_figure(app):
    """The README's picture must be the one this build's run of the example draws (compared by the digest of the
    numbers it plots, which rounding does not move; the pixels depend on fonts and versions). A build that did not
    run the example (``SDPA_REF_DOCS_ONLY``) cannot check it and says so."""
    made = os.path.join(GENERATED, "saturation.png")
    if not os.path.exists(made) or os.path.getmtime(made) < app.startup_time:
        from sphinx.util import logging
        logging.getLogger(__name__).info("README figure not checked: saturation_demo.py did not run in this build")
        return
    if _digest(made) != _digest(README_FIGURE):
        raise RuntimeError(
            f"docs/images/saturation.png (the README's picture) is not what examples/saturation_demo.py draws now: "
            f"{_digest(README_FIGURE)!r} != {_digest(made)!r}; run: python examples/saturation_demo.py --plot "
            f"docs/images/saturation.png")


def gallery_argv(gallery_conf, script_vars):
    """``sys.argv[1:]`` for one gallery script (sphinx-gallery's ``reset_argv``)."""
    os.makedirs(GENERATED, exist_ok=True)
    return list(_ARGV.get(os.path.basename(str(script_vars["src_file"])), []))


def make_figures(app):
    """Write the figures the Markdown pages show, from this build's runs."""
    import contextlib
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sdpa_ref.cli import main as sdpa_ref_main

    os.makedirs(GENERATED, exist_ok=True)
    path = os.path.join(GENERATED, "diagnose.png")
    table = io.StringIO()
    with contextlib.redirect_stdout(table), contextlib.redirect_stderr(io.StringIO()):
        rc = sdpa_ref_main(["diagnose", "--d-k", "4", "16", "64", "256", "1024", "--plot", path])
    plt.close("all")
    with open(os.path.join(GENERATED, "diagnose.txt"), "w") as fh:
        fh.write(table.getvalue())
    if rc != 0 or not os.path.exists(path):
        raise RuntimeError(f"sdpa-ref diagnose --plot failed (status {rc}): the page's figure is not made")
