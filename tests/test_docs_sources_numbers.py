"""No number in the pages about the copy task and the lesson, and no measured figure in the guide, is typed by hand:
the figures a run measures reach the text only through the build's placeholders (``{{NAME.KEY:SPEC}}``, formatted by
``docs/_figures.fill_numbers`` from the results this build's runs write, or from the committed results files of
``docs/data/`` that name the command, date and machine that made them), and a figure typed into a page source is
found here."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.skipif(not (DOCS / "conf.py").exists() or not EXAMPLES.exists(),
                                reason="docs and examples not shipped beside the tests")

#: The sources of the pages that state the copy task's and the lesson's figures (the pages' text: Markdown, and a
#: gallery script's docstring and comment blocks).
PAGES = ("docs/why-sqrt-dk.md", "docs/tutorials/tut5_why_sqrt_dk.py", "docs/tutorials/tut4_transformer_gradcheck.py",
         "examples/copy_task.py", "examples/saturation_demo.py", "examples/scaling_arithmetic.py",
         "examples/variance_growth.py", "examples/wrong_scaling.py", "README.md")

#: Figures the pages once stated, typed, from one run each: the copy task over 10 seeds (95% at step 225, 3.0x;
#: a later run 212.5 and 2.67x, 2.33 to 3.33; a loss of 0.1 nats at 237.5), the lesson's saturation demo (58.6%
#: of rows above 0.9, median 0.111, 5-95% 0.069-0.222, 92% in the band) and the diagnose sweep the guide quotes.
#: None may come back as typed text; this build's own results (when a build has run) and a fresh run of the
#: saturation demo are added to them below.
ONCE_TYPED = ("212.5", "2.67", "2.33", "3.33", "237.5", "3.0 times", "at step 225", "58.6%", "0.111", "0.069",
              "0.222", "92%", "86%", "32.0", "0.031", "0.9999", "0.021", "0.064", "9.4", "0.024")


def _figures_module():
    sys.path.insert(0, str(DOCS))
    try:
        import _figures
    finally:
        sys.path.remove(str(DOCS))
    return _figures


def page_text(path, text=None):
    """What a page source says in prose: Markdown without its fenced blocks, inline code and placeholders; a
    script's docstring and comment lines (its code and output are computed)."""
    text = path.read_text() if text is None else text
    if path.suffix == ".py":
        m = re.match(r'\s*r?"""(.*?)"""', text, re.S)
        doc = m.group(1) if m else ""
        comments = [line.strip()[1:] for line in text.splitlines() if line.strip().startswith("#")
                    and "noqa" not in line]
        text = doc + "\n" + "\n".join(comments)
    else:
        text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
        text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\{\{[^{}]*\}\}", "", text)


def typed(text, figures):
    """The figures found in ``text`` as typed text (not inside a longer number)."""
    return sorted({f for f in figures if re.search(r"(?<![\d.])" + re.escape(f) + r"(?![\d])", text)})


def results_figures():
    """The figures of this tree's last build (``docs/_generated/*.json``), as the pages would print them."""
    out = set()
    gen = DOCS / "_generated"
    sat, ct = gen / "saturation.json", gen / "copy_task.json"
    if sat.exists():
        out |= set(json.loads(sat.read_text())["text"].values())
    if ct.exists():
        for m in json.loads(ct.read_text())["measures"].values():
            out |= {v for k, v in m["text"].items() if k in ("median", "finite_range") and "." in v}
    return {f for f in out if re.search(r"\d\.\d|%", f)}       # a bare small step such as "75" is a parameter too


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    """Every figure to look for: the ones once typed, a fresh run of the saturation demo's, the last build's."""
    path = tmp_path_factory.mktemp("sat") / "saturation.json"
    r = subprocess.run([sys.executable, str(EXAMPLES / "saturation_demo.py"), "--results", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    fresh = json.loads(path.read_text())["text"]
    assert fresh["saturated"] == f"{json.loads(path.read_text())['values']['saturated']:.1%}"
    return set(ONCE_TYPED) | set(fresh.values()) | results_figures()


@pytest.mark.parametrize("page", PAGES)
def test_no_figure_is_typed_into_a_page(page, figures):
    path = ROOT / page
    if not path.exists():
        pytest.skip(f"{page} is not in this tree")
    assert typed(page_text(path), figures) == [], f"{page} types a measured figure: format it from the results"


def test_a_planted_figure_is_caught(figures):
    """The check fails on a page source with a typed figure: the copy task's median ratio and the saturated share
    written into why-sqrt-dk.md, and a figure typed into a tutorial's comment."""
    md = DOCS / "why-sqrt-dk.md"
    text = md.read_text() + "\nThe unscaled model needs 212.5 steps; 58.6% of unscaled rows exceed 0.9.\n"
    assert typed(page_text(md, text), figures) == ["212.5", "58.6%"]
    tut = DOCS / "tutorials" / "tut5_why_sqrt_dk.py"
    text = tut.read_text() + "\n# The median top weight is 0.111 after scaling.\n"
    assert typed(page_text(tut, text), figures) == ["0.111"]
    # and not where it is computed: a placeholder, a code block, the code of a script
    text = md.read_text() + "\n{{saturation.text.saturated}}\n```text\n58.6%\n```\n"
    assert typed(page_text(md, text), figures) == []


def test_the_copy_task_and_lesson_figures_come_from_placeholders():
    """why-sqrt-dk.md states the copy task's distribution, the saturation demo's figures and the sweep's through
    placeholders that name existing results, and quotes the lesson word for word."""
    text = (DOCS / "why-sqrt-dk.md").read_text()
    names = re.findall(r"\{\{([a-z_]+)\.", text)
    figures = _figures_module()
    assert set(names) == set(figures.RESULTS) - {"suites", "arithmetic"} - set(figures.COMMITTED), names
    for key in ("measures.unscaled_acc.text.median", "measures.ratio_acc.text.median", "text.saturated",
                "text.scaled_median"):
        assert key in text, key
    flat = " ".join(text.split())
    assert ('"The unscaled top weight is often > 0.9 (saturated); the scaled top weight is typically 0.05-0.2 '
            '(useful)."') in flat
    assert ('"Train a tiny Transformer (2 layers, d_model=64) on a copy task with and without the √d_k scaling. '
            'Plot loss curves on the same axes. The unscaled version should plateau earlier or fail to learn '
            'entirely. How much earlier?"') in flat
    assert "almost always" not in flat


def test_placeholders_are_formatted_from_the_results(tmp_path, monkeypatch):
    figures = _figures_module()
    monkeypatch.setattr(figures, "GENERATED", str(tmp_path))
    (tmp_path / "saturation.json").write_text(json.dumps({"values": {"saturated": 0.5862}, "text": {"x": "58.6%"}}))

    class App:
        startup_time = 0.0

    source = ["{{saturation.values.saturated:.1%}} and {{saturation.text.x}}; {{copy_task.settings.seeds}}"]
    figures.fill_numbers(App(), "why-sqrt-dk", source)
    assert source[0] == "58.6% and 58.6%; " + figures.NOT_COMPUTED      # copy_task.json: not made by this build
    with pytest.raises(ValueError, match="no 'missing'"):
        figures.fill_numbers(App(), "why-sqrt-dk", ["{{saturation.values.missing}}"])
    with pytest.raises(ValueError, match="names no results file"):
        figures.fill_numbers(App(), "why-sqrt-dk", ["{{nothing.x}}"])
    App.startup_time = 2.0 ** 40                    # a file older than this build is not this build's result
    source = ["{{saturation.text.x}}"]
    figures.fill_numbers(App(), "why-sqrt-dk", source)
    assert source == [figures.NOT_COMPUTED]


def test_the_guides_suite_counts_come_from_the_harness(tmp_path):
    """guide-judge.md states the suites' version and sizes through placeholders, and the build's suites.json holds
    the harness's own values (a case added to a suite changes the page, not a typed number)."""
    from sdpa_ref import harness

    text = (DOCS / "guide-judge.md").read_text()
    for key in ("version", "quick", "full", "quick_self"):
        assert "{{suites.%s}}" % key in text, key
    figures = _figures_module()
    figures.write_suites(str(tmp_path))
    got = json.loads((tmp_path / "suites.json").read_text())
    assert got["version"] == harness.SUITE_VERSION
    assert (got["quick"], got["full"]) == (len(harness.get_suite("quick")), len(harness.get_suite("full")))
    assert 0 < got["quick_self"] < got["quick"]


#: The guide's pages (each task's page and the index).
GUIDE = sorted(p.relative_to(ROOT).as_posix() for p in DOCS.glob("guide*.md"))

#: A measured figure as prose types it: a number followed by a unit of error, share, ratio or time (ulp, %, x,
#: times, s, ms); not a shape such as "1 x 1".
UNIT_FIGURE = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e-?\d+)?(?:\s*%|\s*(?:ulps?|times|ms|s|x|×)\b(?!\s*\d))")

#: Figures with a unit that the guide may type because they are constants of the API or of its design, not
#: measurements: (page, figure as matched) -> the reason.
GUIDE_CONSTANTS = {
    ("docs/guide-isolation.md", "600 s"): "isolate.DEFAULT_TIME_LIMIT, the default limit a case",
    ("docs/guide-isolation.md", "120 s"): "isolate.LOAD_TIME_LIMIT, the least time loading the implementation gets",
    ("docs/guide-judge.md", "5 s"): "the interval of the progress lines when stderr is piped (cli/output.py)",
    ("docs/guide-rule.md", "32 ulp"): "how far the ensemble's least accurate exp is off, by design (ensemble.py)",
    ("docs/guide-rule.md", "20 ulp"): "the specimen exp_u20's error, PyTorch CPU's exp_u20, by design (specimens.py)",
    ("docs/guide-rule.md", "1%"): "the size of the scale-error mutant (MUTANTS in specimens.py)",
}


def unit_figures(text):
    """The figures with a unit typed in a page's prose (``page_text``: no code, no placeholders), normalised to one
    space between the number and its unit."""
    return [re.sub(r"\s+", " ", m.group(0)) for m in UNIT_FIGURE.finditer(text)]


def typed_guide_figures(page, text=None):
    return sorted({f for f in unit_figures(page_text(ROOT / page, text)) if (page, f) not in GUIDE_CONSTANTS})


@pytest.mark.parametrize("page", GUIDE)
def test_no_measured_figure_is_typed_into_the_guide(page):
    assert typed_guide_figures(page) == [], f"{page} types a measured figure: format it from a results file"


def test_the_guides_allowed_constants_are_the_apis():
    """Every allowed figure is still on its page (the list holds nothing stale), and the time limits are the
    package's own constants."""
    from sdpa_ref.harness import isolate

    for page, figure in GUIDE_CONSTANTS:
        assert figure in unit_figures(page_text(ROOT / page)), (page, figure)
    assert f"{isolate.DEFAULT_TIME_LIMIT:g} s" == "600 s" and f"{isolate.LOAD_TIME_LIMIT:g} s" == "120 s"


def test_a_planted_guide_figure_is_caught():
    """A timing, an ulp count, a ratio and a share typed into a guide page are found; the same in a placeholder, a
    code span or a code block, an allowed constant on its own page, or a shape, are not."""
    page = "docs/guide-frameworks.md"
    text = (ROOT / page).read_text() + ("\nThe suite took 0.72 s, 1.33 s isolated; P differs by 38 ulp; dv is 4.85x\n"
                                        "the allowance, 1.24 times the honest error; 53.5% fail; 1%.\n")
    assert typed_guide_figures(page, text) == ["0.72 s", "1%", "1.24 times", "1.33 s", "38 ulp", "4.85x", "53.5%"]
    text = (ROOT / page).read_text() + ("\n{{frameworks.torch.exp_ulp:.1f}} ulp, `took 0.72 s`, sizes 1 x 1 to 8 x 8\n"
                                        "```text\n38 ulp\n```\n")
    assert typed_guide_figures(page, text) == []
    rule = "docs/guide-rule.md"
    assert typed_guide_figures(rule, (ROOT / rule).read_text() + "\na 1% scale error, off by 20 ulp\n") == []


@pytest.mark.parametrize("name", ["frameworks", "rule"])
def test_the_guides_committed_results_say_what_made_them(name, tmp_path, monkeypatch):
    """The committed results files name their date, machine and command (and why their values were carried, where
    they were), every placeholder of the guide formats from them, and the pages that quote one state its date and
    machine."""
    figures = _figures_module()
    data = json.loads(pathlib.Path(figures.COMMITTED[name]).read_text())
    for key in ("date", "machine", "command", "note"):
        assert isinstance(data.get(key), str) and data[key], key
    pages = [p for p in GUIDE if "{{%s." % name in (ROOT / p).read_text()]
    assert pages, name
    monkeypatch.setattr(figures, "GENERATED", str(tmp_path))       # the cheap results a build writes, made here
    figures.write_suites(str(tmp_path))
    figures.write_arithmetic(str(tmp_path))

    class App:
        startup_time = 0.0

    for p in pages:
        source = [(ROOT / p).read_text()]
        figures.fill_numbers(App(), p, source)
        assert "{{%s." % name not in source[0] and figures.NOT_COMPUTED not in source[0], p
    assert any("{{%s.date}}" % name in (ROOT / p).read_text() and "{{%s.machine}}" % name in (ROOT / p).read_text()
               for p in pages), name


def test_the_guides_float_facts_are_computed(tmp_path):
    """guide-judge-more.md states half a float16 ulp through placeholders, and arithmetic.json holds NumPy's values
    (0.004 at 10 and 0.016 near 50 as the page prints them)."""
    text = (DOCS / "guide-judge-more.md").read_text()
    assert "{{arithmetic.float16_half_ulp.at_10:.3f}}" in text and "{{arithmetic.float16_half_ulp.at_50:.3f}}" in text
    figures = _figures_module()
    figures.write_arithmetic(str(tmp_path))
    got = json.loads((tmp_path / "arithmetic.json").read_text())["float16_half_ulp"]
    assert (f"{got['at_10']:.3f}", f"{got['at_50']:.3f}") == ("0.004", "0.016")
