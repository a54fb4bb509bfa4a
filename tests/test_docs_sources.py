"""The documentation's sources: every picture a page shows is drawn by the build, and the README's one committed
picture is what its example draws today (the site itself is built and checked in a browser by .ci/run)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MADE_BY_THE_BUILD = ("_build", "_generated", "auto_examples", "auto_tutorials", "auto_exercises", "generated")

pytestmark = pytest.mark.skipif(not (DOCS / "conf.py").exists(), reason="docs not shipped beside the tests")


def _figures():
    sys.path.insert(0, str(DOCS))
    try:
        import _figures
    finally:
        sys.path.remove(str(DOCS))
    return _figures


def _pictures_in(text):
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text) + re.findall(r"\.\. (?:image|figure):: (\S+)", text)


def test_the_only_committed_picture_is_the_readmes():
    committed = [p for p in DOCS.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".gif", ".svg")
                 and not any(part in MADE_BY_THE_BUILD for part in p.relative_to(DOCS).parts)]
    assert committed == [DOCS / "images" / "saturation.png"]


def test_every_picture_a_page_shows_is_made_by_the_build_or_checked_by_it():
    figures = _figures()
    made = {"diagnose.png", figures.BENCH_FIGURE} | {pathlib.Path(a[a.index("--plot") + 1]).name
                                                     for a in figures._ARGV.values() if "--plot" in a}
    pages = [p for p in list(DOCS.glob("*.md")) + list(DOCS.glob("*.rst"))] + [ROOT / "README.md"]
    seen = 0
    for page in pages:
        for ref in _pictures_in(page.read_text()):
            seen += 1
            if ref.startswith("_generated/"):
                assert page.parent == DOCS and ref.split("/", 1)[1] in made, (page.name, ref)
            else:
                target = (page.parent / ref).resolve()
                assert target == pathlib.Path(figures.README_FIGURE).resolve(), (page.name, ref)
    assert seen >= 3


def test_the_readme_picture_is_what_the_example_draws_now(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("PIL")
    out = tmp_path / "saturation.png"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "saturation_demo.py"), "--plot", str(out)],
                       capture_output=True, text=True, timeout=120, env={"MPLBACKEND": "Agg", **_env()})
    assert r.returncode == 0, r.stdout + r.stderr
    figures = _figures()
    assert figures._digest(str(out)) == figures._digest(figures.README_FIGURE) is not None


def test_the_digest_tells_a_different_picture(tmp_path):
    # the comparison can fail: fewer seeds draw other counts
    pytest.importorskip("matplotlib")
    pytest.importorskip("PIL")
    out = tmp_path / "s.png"
    subprocess.run([sys.executable, str(ROOT / "examples" / "saturation_demo.py"), "--plot", str(out),
                    "--seeds", "300"], capture_output=True, text=True, timeout=120, env={"MPLBACKEND": "Agg", **_env()})
    figures = _figures()
    assert figures._digest(str(out)) not in (None, figures._digest(figures.README_FIGURE))


def _env():
    import os
    return {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}


def test_the_speed_tables_results_file_states_its_run_and_holds_every_case():
    """The page's speed figure is drawn from the committed results of benchmarks/bench_table.py: the file says when
    and where it was measured, holds every case and dtype, and its table is written as the build writes it (the
    drawing itself is tested in test_benchmarks_bench_table.py)."""
    import json

    figures = _figures()
    with open(figures.BENCH_RESULTS) as fh:
        result = json.load(fh)
    assert result["date"] and result["machine"] and result["versions"]["torch"]
    mod = figures.bench_table()
    assert {(c["case"], c["dtype"]) for c in result["cells"]} == {(c, d) for c in mod.CASES for d in mod.DTYPES}
    assert result["overhead"] and result["second_order"]
    text = mod.format_table(result)
    assert result["date"] in text and result["machine"] in text


def test_a_wide_text_table_is_folded_to_the_pages_width_with_every_value_kept():
    """The diagnose and speed tables are wider than a page's text block: folded into column groups, each line
    fits, the key columns repeat in every group, and every value of the command's output is still there."""
    fold = _figures().fold_table
    header = "a run on some machine, with a long line of prose before the table that must wrap " * 2
    cols = ["scale", "d_k"] + [f"quantity_{i}" for i in range(12)]
    rows = [["none", str(d)] + [f"{d * 1.5 + i:.4f}" for i in range(12)] for d in (4, 16, 1024)]
    widths = [max(len(r[c]) for r in [cols] + rows) for c in range(len(cols))]
    line = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, widths))
    text = "\n".join([header, line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])
    assert max(map(len, text.split("\n"))) > 150
    folded = fold(text, keep=2, width=100)
    lines = folded.split("\n")
    assert max(map(len, lines)) <= 100
    starts = [i for i, ln in enumerate(lines) if ln.startswith("scale")]
    assert len(starts) >= 2
    for i in starts:                                        # every group starts with the key columns
        assert [ln.split()[:2] for ln in lines[i + 2:i + 5]] == [["none", "4"], ["none", "16"], ["none", "1024"]]
    values = {x for r in rows for x in r[2:]}
    assert values == {w for ln in lines for w in ln.split()} & values
    assert fold("a  b\n1  2", keep=1) == "a  b\n1  2"           # a table that fits is left as it is
