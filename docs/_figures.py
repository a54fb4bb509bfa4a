"""The figures of the Markdown pages, made by every build (never committed).

:func:`make_figures` runs at ``builder-inited`` and writes ``docs/_generated/``:
``diagnose.png`` and ``diagnose.txt`` (``sdpa-ref diagnose --plot``: the
figure and the table), and ``bench_table.png`` and ``bench_table.txt`` (the
speed table of ``benchmarks/bench_table.py``, drawn from the results file it
wrote, :data:`BENCH_RESULTS`). The examples' figures come from running the examples
in the gallery (:func:`gallery_argv` gives each its arguments, ``--plot``
into ``_generated/`` among them), so a page that shows one shows what this
build's run produced.

The pages' text quotes this build's results through placeholders that
:func:`fill_numbers` (``source-read``) formats: ``{{copy_task.KEY}}``,
``{{saturation.KEY}}`` (the files the examples write with ``--results``) or
``{{diagnose.SCALE.D_K.FIELD:SPEC}}`` (``diagnose.json``, the sweep's rows by
scale and d_k) or ``{{suites.KEY}}`` (``suites.json``: the harness's suite version
and case counts): a dotted path into the results file of that name and an
optional format spec. No figure a run measures is typed into a page
(``tests/test_docs_sources_numbers.py``). A placeholder naming nothing fails
the build; one whose results this build did not make (``SDPA_REF_DOCS_ONLY``
left its example out) reads "(not computed in this build)".
"""

import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATED = os.path.join(HERE, "_generated")

# the arguments each example runs with in the gallery (others: none)
_ARGV = {
    "copy_task.py": ["--plot", os.path.join(GENERATED, "copy_task.png"),
                     "--results", os.path.join(GENERATED, "copy_task.json")],
    "saturation_demo.py": ["--plot", os.path.join(GENERATED, "saturation.png"),
                           "--results", os.path.join(GENERATED, "saturation.json")],
}
#: the placeholders' results files: ``{{NAME.…}}`` reads ``_generated/NAME.json``
RESULTS = ("copy_task", "saturation", "diagnose", "suites")
PLACEHOLDER = re.compile(r"\{\{([a-z_]+)\.([A-Za-z0-9_.]+?)(?::([^{}]*))?\}\}")
NOT_COMPUTED = "(not computed in this build)"
README_FIGURE = os.path.join(HERE, "images", "saturation.png")     # the README's picture, committed
#: The speed table's results (``python benchmarks/bench_table.py --output docs/data/bench_table.json``, its date
#: and machine inside), committed: the build draws ``_generated/bench_table.png`` from it and never runs the benchmark
BENCH_RESULTS = os.path.join(HERE, "data", "bench_table.json")
BENCH_FIGURE = "bench_table.png"


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
    """Write the figures the Markdown pages show, from this build's runs; and connect :func:`fill_numbers`, which
    formats the pages' numbers from this build's results (``conf.py`` connects this function only)."""
    app.connect("source-read", fill_numbers)
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
        fh.write(fold_table(table.getvalue(), keep=2))
    if rc != 0 or not os.path.exists(path):
        raise RuntimeError(f"sdpa-ref diagnose --plot failed (status {rc}): the page's figure is not made")
    rows = io.StringIO()                 # the same sweep (same seed) as JSON, for the numbers the page quotes
    with contextlib.redirect_stdout(rows), contextlib.redirect_stderr(io.StringIO()):
        rc = sdpa_ref_main(["diagnose", "--d-k", "4", "16", "64", "256", "1024", "--format", "json"])
    if rc != 0:
        raise RuntimeError(f"sdpa-ref diagnose --format json failed (status {rc})")
    by_scale = {}
    for row in json.loads(rows.getvalue()):
        by_scale.setdefault(row["scale"], {})[str(row["d_k"])] = row
    with open(os.path.join(GENERATED, "diagnose.json"), "w") as fh:
        json.dump(by_scale, fh, indent=1)
    write_suites()
    make_bench_figure()


def write_suites(out=GENERATED):
    """``suites.json``: the harness's suite version and how many cases each suite holds, for the guide's text."""
    from sdpa_ref import harness

    quick, full = harness.get_suite("quick"), harness.get_suite("full")
    counts = {"version": harness.SUITE_VERSION, "quick": len(quick), "full": len(full),
              "quick_self": sum(c.name.startswith("self-") for c in quick)}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "suites.json"), "w") as fh:
        json.dump(counts, fh, indent=1)


def _results(app, name):
    """This build's results file ``_generated/NAME.json``, or None where this build did not write it."""
    path = os.path.join(GENERATED, name + ".json")
    if not os.path.exists(path) or os.path.getmtime(path) < getattr(app, "startup_time", 0):
        return None
    with open(path) as fh:
        return json.load(fh)


def format_placeholder(results, name, key, spec):
    """The text of ``{{name.key:spec}}`` from ``results`` (the file's data): the value at the dotted ``key``,
    formatted with ``spec``; a ValueError names a key that is not there."""
    value = results
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"the placeholder {{{{{name}.{key}}}}} names nothing in _generated/{name}.json "
                             f"(no {part!r})")
        value = value[part]
    return format(value, spec or "")


def fill_numbers(app, docname, source):
    """``source-read``: replace every placeholder of a page by its value from this build's results."""
    if "{{" not in source[0]:
        return
    cache = {}

    def one(m):
        name, key, spec = m.groups()
        if name not in RESULTS:
            raise ValueError(f"{docname}: the placeholder {m.group(0)} names no results file ({', '.join(RESULTS)})")
        if name not in cache:
            cache[name] = _results(app, name)
        if cache[name] is None:
            return NOT_COMPUTED
        return format_placeholder(cache[name], name, key, spec)

    source[0] = PLACEHOLDER.sub(one, source[0])


def bench_table():
    """``benchmarks/bench_table.py`` as a module (the figure and the table are drawn by its own functions)."""
    import importlib.util

    path = os.path.join(os.path.dirname(HERE), "benchmarks", "bench_table.py")
    spec = importlib.util.spec_from_file_location("bench_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: The widest line a page's text block holds: the column fits 120 characters of code at 1280 px (the site check).
TEXT_WIDTH = 100


def fold_table(text, keep, width=TEXT_WIDTH):
    """A command's aligned text table folded to ``width`` characters: its columns in groups, one block per
    group, each block repeating the first ``keep`` (key) columns; the lines before the table (a line of
    prose has no run of two spaces) wrapped. The values are the command's own strings, only moved."""
    import re
    import textwrap

    lines = text.rstrip("\n").split("\n")
    start = next((i for i, ln in enumerate(lines) if re.search(r"\S  +\S", ln) and not ln.startswith(" ")), len(lines))
    head = [w for ln in lines[:start] for w in (textwrap.wrap(ln, width) or [""])]
    rows = [re.split(r"\s{2,}", ln.strip()) if ln.strip() else None for ln in lines[start:]]
    ncol = max((len(r) for r in rows if r), default=0)
    if ncol == 0 or all(len(ln) <= width for ln in lines[start:]):
        return "\n".join(head + lines[start:])
    rows = [r if r is None or len(r) == ncol else None for r in rows]    # a rule line or a blank: a gap
    cols = [[r[c] for r in rows if r] for c in range(ncol)]
    widths = [max(len(x) for x in col) for col in cols]
    groups, cur = [], []
    for c in range(keep, ncol):
        if cur and sum(widths[k] + 2 for k in list(range(keep)) + cur + [c]) > width:
            groups.append(cur)
            cur = []
        cur.append(c)
    groups.append(cur)
    out = list(head)
    for g in groups:
        idx = list(range(keep)) + g
        for r in rows:
            if r is None:
                if out and out[-1] != "":
                    out.append("")
                continue
            out.append("  ".join(r[k].ljust(widths[k]) if k < keep else r[k].rjust(widths[k]) for k in idx).rstrip())
        out.append("")
    return "\n".join(out).rstrip("\n")


def make_bench_figure(results=BENCH_RESULTS, out=GENERATED):
    """Draw the speed table's figure and write its text table into ``out`` from the committed results file."""
    import json

    with open(results) as fh:
        result = json.load(fh)
    mod = bench_table()
    os.makedirs(out, exist_ok=True)
    mod.figure(result, os.path.join(out, BENCH_FIGURE))
    with open(os.path.join(out, "bench_table.txt"), "w") as fh:
        fh.write(fold_table(mod.format_table(result), keep=3) + "\n")
