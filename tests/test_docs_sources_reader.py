"""The site's reader aids from their sources: ``[source]`` links name the right file and lines, and every citation
names an entry of the one bibliography (docs/references.bib)."""

import inspect
import pathlib
import re
import sys

import pytest

import sdpa_ref
import sdpa_ref.harness

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

pytestmark = pytest.mark.skipif(not (DOCS / "_linkcode.py").exists(), reason="docs not shipped beside the tests")


@pytest.fixture(scope="module")
def linkcode():
    sys.path.insert(0, str(DOCS))
    try:
        import _linkcode
    finally:
        sys.path.remove(str(DOCS))
    return _linkcode


def test_the_repository_url_comes_from_project_urls(linkcode, tmp_path):
    cfg = tmp_path / "setup.cfg"
    cfg.write_text("[metadata]\nname = x\nproject_urls =\n    Documentation = https://d.example/\n"
                   "    Source = https://code.example/o/sdpa_ref/\n")
    assert linkcode.repository_url(str(cfg), environ={}) == "https://code.example/o/sdpa_ref"
    assert linkcode.repository_url(str(cfg), environ={"SDPA_REF_SOURCE_URL": "https://m.example/r"}) \
        == "https://m.example/r"
    cfg.write_text("[metadata]\nname = x\n")
    assert linkcode.repository_url(str(cfg), environ={}) is None
    assert linkcode.repository_url(str(tmp_path / "absent.cfg"), environ={}) is None


def test_the_revision_is_the_commit_or_the_version_tag(linkcode, tmp_path):
    ref = linkcode.source_ref("1.2.3")
    assert re.fullmatch(r"[0-9a-f]{40}", ref) or ref == "v1.2.3"
    assert linkcode.source_ref("1.2.3", root=str(tmp_path)) == "v1.2.3"        # not a git checkout: the tag


@pytest.mark.parametrize("module, fullname, obj", [
    ("sdpa_ref", "check_implementation", sdpa_ref.check_implementation),
    ("sdpa_ref", "scaled_dot_product_attention", sdpa_ref.scaled_dot_product_attention),
    ("sdpa_ref.harness", "ConformanceReport.verdict", sdpa_ref.harness.ConformanceReport.verdict.fget),
])
def test_a_source_link_names_the_objects_own_lines(linkcode, module, fullname, obj):
    resolve = linkcode.resolver("https://code.example/o/r", "abc")
    url = resolve("py", {"module": module, "fullname": fullname})
    m = re.fullmatch(r"https://code\.example/o/r/blob/abc/(sdpa_ref/[\w/]+\.py)#L(\d+)-L(\d+)", url)
    assert m, url
    lines = (ROOT / m.group(1)).read_text().splitlines()[int(m.group(2)) - 1:int(m.group(3))]
    assert lines == inspect.getsource(inspect.unwrap(obj)).splitlines()
    name = fullname.split(".")[-1]
    assert any(re.match(rf"\s*def {name}\(", line) for line in lines)


def test_a_name_with_no_source_in_the_repository_gets_no_link(linkcode):
    resolve = linkcode.resolver("https://code.example/o/r", "abc")
    assert resolve("py", {"module": "sdpa_ref", "fullname": "no_such_name"}) is None
    assert resolve("py", {"module": "numpy", "fullname": "matmul"}) is None          # outside the repository
    assert resolve("c", {"names": ["f"]}) is None


def _bib_keys():
    return set(re.findall(r"^@\w+\{([^,\s]+),", (DOCS / "references.bib").read_text(), flags=re.M))


def _cited_keys():
    sources = [p for p in list(DOCS.rglob("*.md")) + list(DOCS.rglob("*.rst")) + list(DOCS.rglob("*.py"))
               if not any(part.startswith(("_build", "auto_", "generated")) for part in p.relative_to(DOCS).parts)]
    keys = {}
    for p in sources + [ROOT / "SEMANTICS.md"]:
        for group in re.findall(r"(?::cite:\w*:|\{cite:\w*\})`([^`]+)`", p.read_text()):
            for target in group.split(","):
                key = re.sub(r"\{[^{}]*\}", "", target).strip()
                keys.setdefault(key, []).append(p.name)
    return keys


def test_every_citation_is_in_the_bibliography():
    cited = _cited_keys()
    assert cited, "the pages cite nothing"
    missing = {k: v for k, v in cited.items() if k not in _bib_keys()}
    assert not missing, missing


def test_the_bibliography_holds_what_the_issue_asked_for():
    keys = _bib_keys()
    for key in ("vaswani2017attention", "dao2022flashattention", "dao2024flashattention2", "shah2024flashattention3",
                "milakov2018online", "rabe2021self", "ozaki2012error"):
        assert key in keys
    text = (DOCS / "references.bib").read_text()
    for entry in re.split(r"\n(?=@)", text)[1:]:
        assert re.search(r"\btitle\s*=", entry) and re.search(r"\byear\s*=", entry), entry[:60]
    assert "vaswani2017attention{sec. 3.2.1}" in (DOCS / "index.rst").read_text()


def _slug(heading):
    """The anchor MyST gives a heading (``myst_heading_anchors``): lower case, punctuation dropped, spaces as -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


GUIDE_PAGES = sorted(DOCS.glob("guide-*.md"))


def test_the_guide_is_split_by_task_and_every_page_is_in_its_toctree():
    hub = (DOCS / "guide.md").read_text()
    toctree = [line.strip() for line in re.search(r"```\{toctree\}\n(.*?)```", hub, flags=re.S).group(1).splitlines()
               if line.strip() and not line.startswith(":")]
    assert len(GUIDE_PAGES) >= 8
    assert sorted(p.stem for p in GUIDE_PAGES) == sorted(toctree)
    for page in GUIDE_PAGES:
        text = page.read_text()
        assert text.count("\n") <= 130, f"{page.name} is not short"
        assert "|\n| ---" in text or "| --- |" in text, f"{page.name} has no table"
        assert f"]({page.name})" in hub, f"the guide's table of tasks does not link {page.name}"


def test_every_link_into_the_guide_resolves():
    sources = [DOCS / "guide.md", *GUIDE_PAGES, *DOCS.glob("*.rst"), ROOT / "README.md", ROOT / "SEMANTICS.md",
               ROOT / "examples" / "cases.toml", *(ROOT / "sdpa_ref").rglob("*.py"), *DOCS.glob("*.md")]
    seen = 0
    for src in sources:
        for target, anchor in re.findall(r"(?:docs/|\]\()(guide(?:-[\w-]+)?\.md)(?:#([\w-]+))?", src.read_text()):
            seen += 1
            page = DOCS / target
            assert page.exists(), (src.name, target)
            if anchor:
                anchors = {_slug(h) for h in re.findall(r"^#{1,3} (.+)$", page.read_text(), flags=re.M)}
                assert anchor in anchors, (src.name, target, anchor)
        for anchor in re.findall(r"\]\(#([\w-]+)\)", src.read_text()) if src.name.startswith("guide") else ():
            anchors = {_slug(h) for h in re.findall(r"^#{1,3} (.+)$", src.read_text(), flags=re.M)}
            assert anchor in anchors, (src.name, anchor)
    assert seen >= 20
