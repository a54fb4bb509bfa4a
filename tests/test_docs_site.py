"""The browser check of the documentation site (docs/check_site.py).

The built site is checked where ``SDPA_REF_DOCS_HTML`` names it (a step of
.ci/run, after the Sphinx build). The checker itself is tested on small
synthetic sites: each fault it must catch, and a clean page that must pass.
Both need Debian's chromium and chromium-driver packages and selenium; they
skip without them.
"""

import importlib.util
import json
import os
import shutil
import sys

import pytest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
sys.path.insert(0, DOCS)
import check_site  # noqa: E402

#: The built site has at least this many pages (home, API reference, guides, gallery, genindex, search).
MIN_PAGES = 10

needs_browser = pytest.mark.skipif(
    check_site.find_browser() is None or importlib.util.find_spec("selenium") is None,
    reason="needs Chromium, chromedriver (apt-get install chromium chromium-driver) and selenium")

HEAD = '<!DOCTYPE html><html><head><meta charset="utf-8"><title>t</title>{}</head><body>{}</body></html>'

# Sphinx's MathJax 3 configuration and its deferred script (sphinx-mathjax-offline's copy).
MATHJAX = ('<script>window.MathJax = {options: {processHtmlClass: "tex2jax_process|mathjax_process|math"}}'
           '</script><script defer src="mathjax/tex-chtml.js"></script>')
MATH_BODY = ('<p>Inline <span class="math notranslate nohighlight">\\(x^2\\)</span>.</p>'
             '<div class="math notranslate nohighlight">\\[\\frac{a}{b}\\]</div>')
CLEAN_BODY = ('<h1 id="top-title">Clean</h1><img src="pic.svg" alt="pic"><a href="#top-title">here</a> '
              '<a href="other.html#sec">there</a> <a href="sub/">sub</a> '
              '<a href="https://example.org/">out</a> <a href="mailto:a@b.c">mail</a>')
SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'


def mathjax_dir():
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "static", "mathjax")
    return path if os.path.isfile(os.path.join(path, "tex-chtml.js")) else None


def write(site, name, text):
    path = site / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


#: Each faulty page of the synthetic site, and what the checker must say about it (its only problem).
FAULTS = {
    "js_error.html": ("<script>undefined_function()</script>", "undefined_function is not defined"),
    "broken_img.html": ('<img src="missing.png" alt="x">', "image did not load: missing.png"),
    "missing_page.html": ('<a href="nowhere.html">x</a>', "link to missing nowhere.html"),
    "missing_anchor.html": ('<a href="other.html#no-such-id">x</a><a href="sub/index.html#old">ok</a>',
                            "link to missing anchor #no-such-id in other.html"),
    "no_mathjax.html": ('<span class="math notranslate nohighlight">\\(x\\)</span>',
                        "1 of 1 math elements not typeset: MathJax absent"),
    "network.html": ('<script src="https://cdn.example.org/x.js"></script>', "ERR_NAME_NOT_RESOLVED"),
}


@needs_browser
def test_checker_on_synthetic_site(tmp_path, capsys):
    """One run of the CLI over clean pages and one page per fault (one browser: xdist runs it once)."""
    write(tmp_path, "pic.svg", SVG)
    write(tmp_path, "other.html", HEAD.format("", '<h2 id="sec">Section</h2><a href="index.html">home</a>'))
    write(tmp_path, "sub/index.html", HEAD.format("", '<a name="old"></a><a href="../other.html">o</a>'))
    write(tmp_path, "_static/skipped.html", HEAD.format("", "<script>undefined_function()</script>"))
    for page, (body, _) in FAULTS.items():
        write(tmp_path, page, HEAD.format("", body))
    faults = dict(FAULTS)
    mj = mathjax_dir()                       # without it, the clean page has no math
    if mj is not None:
        try:
            os.symlink(mj, tmp_path / "mathjax")
        except OSError:
            shutil.copytree(mj, tmp_path / "mathjax")
        # A TeX error: MathJax typesets it as an error box.
        write(tmp_path, "math_error.html", HEAD.format(MATHJAX, '<span class="math">\\(x_1_2\\)</span>'))
        faults["math_error.html"] = (None, "MathJax error (Double subscripts: use braces to clarify) in 'x_1_2'")
    write(tmp_path, "index.html", HEAD.format(MATHJAX, MATH_BODY + CLEAN_BODY) if mj else HEAD.format("", CLEAN_BODY))

    assert check_site.main([str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    pages = {r["page"]: r for r in report["pages"]}
    assert sorted(pages) == sorted(["index.html", "other.html", "sub/index.html", *faults])
    for page, (_, expected) in faults.items():
        problems = pages[page]["problems"]
        assert any(expected in p for p in problems), (page, problems)
        # A broken image is also a failed load in the console.
        assert len(problems) == 1 + (page == "broken_img.html"), (page, problems)
    for page in ("index.html", "other.html", "sub/index.html"):
        assert pages[page]["problems"] == [], page
    index = pages["index.html"]
    assert (index["images"], index["images_ok"], index["internal_links"], index["external_links"]) == (1, 1, 3, 2)
    if mj is not None:
        assert (index["math"], index["math_typeset"]) == (2, 2)
    assert report["problems"] == sum(len(r["problems"]) for r in report["pages"])


@needs_browser
def test_cli_clean_site(tmp_path, capsys):
    write(tmp_path, "index.html", HEAD.format("", '<p id="p">ok</p><a href="#p">p</a>'))
    assert check_site.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 pages" in out and "0 problems" in out


def test_cli_usage_errors(tmp_path, capsys):
    assert check_site.main([str(tmp_path / "no-such-dir")]) == 2
    assert "no such directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        check_site.main([str(tmp_path), "--max-pages", "0"])
    assert exc.value.code == 2


def test_find_pages_skips_assets(tmp_path):
    for name in ("index.html", "api/f.html", "_static/x.html", "_sources/y.html", "_images/z.html",
                 "_downloads/d/w.html", "genindex.html", "search.html", "style.css"):
        write(tmp_path, name, "")
    assert check_site.find_pages(str(tmp_path)) == ["index.html", "api/f.html", "genindex.html", "search.html"]


@needs_browser
@pytest.mark.skipif(not os.path.isdir(os.environ.get("SDPA_REF_DOCS_HTML", "")),
                    reason="SDPA_REF_DOCS_HTML does not name a built site (set by .ci/run after the build)")
def test_built_site():
    report = check_site.check_site(os.environ["SDPA_REF_DOCS_HTML"])
    problems = [f"{r['page']}: {p}" for r in report["pages"] for p in r["problems"]]
    assert problems == [], "\n".join(problems[:50])
    assert len(report["pages"]) >= MIN_PAGES
    assert any(r["math_typeset"] > 0 for r in report["pages"]), "no page has typeset math"


#: A main column of at most 600 px, as a theme's article; the planted faults sit in it.
ARTICLE = '<article style="max-width: 600px; margin: 0 auto">{}</article>'
WIDE_TEX = " + ".join(f"x_{{{i}}}" for i in range(60))        # about 1500 px of display math
#: Each page with a layout or text fault, and what the checker must say (its only problems).
LAYOUT_FAULTS = {
    "wide_code.html": ("<pre style='overflow-x: auto'>" + "x = 1; " * 40 + "</pre>",
                       ["overflows at 1280 px: pre"]),
    "wide_img.html": ('<img src="pic.svg" alt="a figure" style="width: 900px">',
                      ["overflows at 1280 px: img", "overflows at 390 px: img"]),
    "narrow_table.html": ("<table><tr><td>" + "&nbsp;".join(["cell"] * 16) + "</td></tr></table>",
                          ["overflows at 390 px: table"]),
    "repr.html": ('<div class="sphx-glr-script-out"><pre>&lt;matplotlib.colorbar.Colorbar object at 0x7f1854d0ed10&gt;'
                  "</pre></div>", ["a repr in the text: '<matplotlib.colorbar.Colorbar object at 0x7f1854d0ed10>'"]),
    "object_repr.html": ("<p>&lt;sdpa_ref.BlockMask object at 0x7f00aa&gt;</p>", ["a repr in the text"]),
    "raw_tex.html": (r"<p>the scale $1/\sqrt{d_k}$ of the scores</p>", ["raw TeX in the text"]),
    "raw_tex_paren.html": (r"<p>the scores \(QK^T\)</p>", ["raw TeX in the text"]),
    "raw_frac.html": (r"<p>take \frac{1}{2} of it</p>", ["raw TeX in the text"]),
    "raw_alt.html": (r'<img src="pic.svg" alt="softmax$(QK^T/\sqrt{d_k})$">', ["raw TeX in an img's alt"]),
    "backtick.html": ("<p>``B`` and ``H`` may be 1</p>", ["a backtick in the text"]),
}
#: What must pass: code that scrolls at 390 px (not at 1280), backticks, TeX and dollars in code and output.
LAYOUT_CLEAN = ("<h1>Clean</h1><p>Text that wraps. " * 20 + "</p><pre style='overflow-x: auto'>" + "y = 2; " * 6
                + "# `x` $a$ \\frac</pre><p>Inline <code>``B``</code> and <code>$HOME</code>.</p>"
                '<div class="sphx-glr-script-out"><pre>cost: $5, \\(x\\)</pre></div>'
                '<table><tr><td>a</td><td>b</td></tr></table><img src="pic.svg" alt="a plain figure">')


@needs_browser
def test_checker_layout_and_text(tmp_path, capsys):
    """Over-wide equations, code, figures and tables, and raw TeX, reprs and backticks, are caught; clean passes."""
    write(tmp_path, "pic.svg", SVG)
    faults = dict(LAYOUT_FAULTS)
    mj = mathjax_dir()
    if mj is not None:
        try:
            os.symlink(mj, tmp_path / "mathjax")
        except OSError:
            shutil.copytree(mj, tmp_path / "mathjax")
        faults["wide_math.html"] = ('<div class="math">\\[' + WIDE_TEX + "\\]</div>",
                                    ["overflows at 1280 px: div.math", "overflows at 390 px: div.math"])
        narrow_tex = " + ".join(f"x_{{{i}}}" for i in range(12))          # about 480 px: fits 600, not 390
        faults["narrow_math.html"] = ('<div class="math">\\[' + narrow_tex + "\\]</div>",
                                      ["overflows at 390 px: div.math"])
    for page, (body, _) in faults.items():
        write(tmp_path, page, HEAD.format(MATHJAX if "math" in page else "", ARTICLE.format(body)))
    write(tmp_path, "index.html", HEAD.format(MATHJAX if mj else "", ARTICLE.format(
        LAYOUT_CLEAN + (r'<div class="math">\[\frac{a}{b} + x^\top\]</div>' if mj else ""))))

    assert check_site.main([str(tmp_path), "--json"]) == 1
    pages = {r["page"]: r for r in json.loads(capsys.readouterr().out)["pages"]}
    assert pages["index.html"]["problems"] == []
    for page, (_, expected) in faults.items():
        problems = pages[page]["problems"]
        assert len(problems) == len(expected), (page, problems)
        for want, got in zip(expected, problems):
            assert got.startswith(want), (page, problems)


def test_plain_alt_text():
    """The gallery's alt text: matplotlib's TeX made plain, so that the site check finds none raw."""
    import _scraper

    assert _scraper.plain_text(r"scaled: softmax$(QK^T/\sqrt{d_k})$") == "scaled: softmax(QK^T/sqrt(d_k))"
    assert _scraper.plain_text(r"norm $\|dT_{i,:}\|$, $d_k$ = 128") == "norm |dT_i,:|, d_k = 128"
    assert _scraper.plain_text("no math: 92% of rows") == "no math: 92% of rows"
    assert not check_site.RAW_LATEX.search(_scraper.plain_text(r"$\mathrm{softmax}(x)\cdot y$"))
