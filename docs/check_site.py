"""Check a built HTML site in headless Chromium: console, math, images, links.

Usage, after building the site: ``python docs/check_site.py docs/_build/html
[--json] [--max-pages N]``.

The site is served from its directory on 127.0.0.1 (an ephemeral port), so the
pages load as from a web server, and each page is opened, as a first visit
(empty storage), in Debian's Chromium driven by Debian's chromedriver through
Selenium. Nothing is fetched from the network: Chromium's own requests are
switched off and no host name but the local server's resolves, so a page that
needs the network fails with a console error. Each page's problems are: every
console entry of level ``SEVERE`` (script error, uncaught exception, failed
load); every Sphinx math element (class ``math``) that MathJax left without an
``mjx-container`` or typeset with an error; every ``<img>`` that did not load;
every internal link to a missing file, or to a ``#fragment`` that names no
``id`` (or ``<a name>``) in its target page. External links (http(s) to other
hosts, ``mailto:``) are counted, never followed. Exit status: 0 when no page has
a problem, 1 when some page has one, 2 for a usage error or no browser.
"""

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _site_files import _anchors, _check_link, find_pages, serve  # noqa: E402


class SetupError(Exception):
    """No site directory, no browser, or a browser that does not start (exit status 2)."""

#: Chromium switches: headless, and no request of Chromium's own (updates,
#: sync, safe browsing, metrics); only the local server's address resolves.
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
    "--disable-background-networking", "--disable-component-update", "--no-first-run",
    "--no-default-browser-check", "--disable-default-apps", "--disable-sync",
    "--disable-extensions", "--no-pings", "--disable-domain-reliability",
    "--disable-client-side-phishing-detection", "--disable-breakpad", "--metrics-recording-only",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
    "--no-proxy-server", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--window-size=1280,800",
]

#: Waits until MathJax 3 (if the page loads it) has typeset the page.
JS_WAIT_MATHJAX = """
const done = arguments[arguments.length - 1];
const mj = window.MathJax;
if (!mj) { done("absent"); return; }
if (!mj.startup || !mj.startup.promise) { done("not started"); return; }
mj.startup.promise.then(() => done("ok"), (e) => done("failed: " + e));
"""

#: Math elements, images (lazy ones made eager, then awaited) and links.
JS_COLLECT = """
const done = arguments[arguments.length - 1];
const tex = new Map();                       // typeset container -> its TeX source
try { for (const item of MathJax.startup.document.math) tex.set(item.typesetRoot, item.math); } catch (e) {}
const math = Array.from(document.querySelectorAll(".math")).map((el) => {
  const box = el.querySelector("mjx-container"), err = el.querySelector("mjx-merror, [data-mjx-error]");
  return {text: (box && tex.has(box) ? tex.get(box) : el.textContent).slice(0, 60), typeset: box !== null,
          error: err && (err.getAttribute("data-mjx-error") || err.textContent || "error")};
});
const imgs = Array.from(document.images);
imgs.forEach((img) => { if (img.loading === "lazy") img.loading = "eager"; });
const pending = imgs.filter((img) => !img.complete).map((img) => new Promise((ok) => {
  img.addEventListener("load", ok); img.addEventListener("error", ok); setTimeout(ok, 5000);
}));
Promise.all(pending).then(() => done({
  math: math,
  images: imgs.map((img) => ({src: img.getAttribute("src") || "", ok: img.complete && img.naturalWidth > 0})),
  links: Array.from(document.querySelectorAll("a[href]")).map((a) => {
    try { return new URL(a.getAttribute("href"), document.baseURI).href; }
    catch (e) { return "invalid:" + a.getAttribute("href"); }
  }),
  ids: Array.from(document.querySelectorAll("[id], a[name]")).map((el) => el.id || el.getAttribute("name")),
}));
"""


#: The page's layout and rendered text, measured in the main column (``article``, else ``main``, else the
#: body). ``arguments[0]`` says which checks: "wide" (every element of the column stays inside it and nothing
#: in it scrolls sideways) or "narrow" (equations, figures and tables only: code blocks may scroll).
#: ``arguments[1]`` adds the text checks (raw LaTeX, reprs, backticks): they need no second width.
JS_LAYOUT = """
const done = arguments[arguments.length - 1], mode = arguments[0], withText = arguments[1];
const col = document.querySelector("article") || document.querySelector("main, [role=main]") || document.body;
const box = col.getBoundingClientRect(), slack = 1;
const label = (el) => {
  const name = typeof el.className === "string" ? el.className.trim() : "";
  const cls = name ? "." + name.split(/\\s+/)[0] : "";
  const math = el.closest(".math, mjx-container");
  let what = el.tagName.toLowerCase() + cls;
  if (math) {
    let src = "";
    try { for (const m of MathJax.startup.document.math) if (math.contains(m.typesetRoot) || m.typesetRoot.contains(el))
      { src = m.math; break; } } catch (e) {}
    what += " " + JSON.stringify((src || math.textContent).trim().slice(0, 50));
  } else {
    const t = (el.getAttribute("src") || el.textContent || "").trim().replace(/\\s+/g, " ");
    what += " " + JSON.stringify(t.slice(0, 50));
  }
  return what;
};
const isCode = (el) => el.closest("pre, .highlight, div[class*=highlight-]") !== null;
const kinds = "mjx-container, .math, img, svg, figure, table, canvas, video, iframe";
const out = [];
const scrolls = (el) => {
  const ox = getComputedStyle(el).overflowX;
  // scrolls, or is cut off, or (an equation, figure or table) spills its content over its own edge; an inline
  // box (inline math: its hidden assistive MathML counts in its scrollWidth) only when it scrolls
  const inline = getComputedStyle(el).display.startsWith("inline");
  const hit = inline ? (ox === "auto" || ox === "scroll") : (ox !== "visible" || el.matches(kinds));
  // MathJax's container: the typeset math's own width (its hidden assistive MathML can widen scrollWidth)
  const math = el.tagName.toLowerCase() === "mjx-container" && el.querySelector(":scope > mjx-math");
  const wide = math ? math.getBoundingClientRect().width : el.scrollWidth;
  return hit && el.clientWidth > 0 && wide > el.clientWidth + slack;
};
const sticksOut = (el) => {
  const r = el.getBoundingClientRect();
  return r.width > 0 && (r.right > box.right + slack || r.left < box.left - slack);
};
function inside(el) { return el !== col && col.contains(el); }
if (mode === "wide") {
  const seen = new Set();
  for (const el of col.querySelectorAll("*")) {
    if (el.closest("mjx-container") && el.tagName.toLowerCase() !== "mjx-container") continue;
    if (scrolls(el) || sticksOut(el)) {
      // report the outermost culprit only
      let p = el.parentElement, dup = false;
      while (p && p !== col) { if (seen.has(p)) { dup = true; break; } p = p.parentElement; }
      seen.add(el);
      const width = scrolls(el) ? el.scrollWidth : el.getBoundingClientRect().width;
      if (!dup) out.push(`${label(el)} is ${Math.round(width)} px wide in a column of ${Math.round(box.width)} px`);
    }
  }
  if (out.length === 0 && col.scrollWidth > col.clientWidth + slack)   // e.g. a wide element cut off by nothing
    out.push(`the main column is ${col.scrollWidth} px wide inside ${col.clientWidth} px`);
} else {
  const reported = new Set();
  for (const el of col.querySelectorAll(kinds)) {
    if (isCode(el)) continue;
    let within = false;
    for (let p = el.parentElement; p && p !== col && !within; p = p.parentElement) within = reported.has(p);
    if (within) continue;
    let bad = sticksOut(el) || scrolls(el);
    for (let p = el.parentElement; !bad && p && p !== col; p = p.parentElement)
      if (scrolls(p) && !isCode(p)) bad = true;
    if (bad) {
      reported.add(el);
      const width = Math.max(el.getBoundingClientRect().width, el.scrollWidth);
      out.push(`${label(el)} is ${Math.round(width)} px wide at ${window.innerWidth} px`);
    }
  }
}
const text = [];
if (withText) {
  const skip = "script, style, noscript, template, mjx-container, mjx-assistive-mml";
  const prose = [], all = [];
  const walk = document.createTreeWalker(col, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    const el = n.parentElement;
    if (!el || el.closest(skip)) continue;
    all.push(n.nodeValue);
    if (!el.closest("pre, code, kbd, samp, tt, .highlight, .sphx-glr-script-out, .math")) prose.push(n.nodeValue);
  }
  const attrs = Array.from(col.querySelectorAll("img[alt], [title], [aria-label]")).map(
    (el) => [el.tagName.toLowerCase(),
             el.getAttribute("alt") || el.getAttribute("title") || el.getAttribute("aria-label") || ""]);
  done({layout: out, prose: prose.join(""), all: all.join(""), attrs: attrs});
} else {
  done({layout: out});
}
"""


def find_browser(chromium=None, chromedriver=None):
    """Locate Chromium and chromedriver, preferring Debian's packages.

    Parameters
    ----------
    chromium, chromedriver : str, optional
        Explicit paths. By default: Debian's browser binary itself
        (``/usr/lib/chromium/chromium``, so that the flags of the
        ``/usr/bin/chromium`` wrapper script and of ``/etc/chromium.d`` do not
        apply), else ``chromium`` on the PATH; ``chromedriver`` on the PATH,
        else ``/usr/bin/chromedriver``.

    Returns
    -------
    (str, str) or None
        The two paths, or None when either is not an executable file.
    """
    def usable(path):
        return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None

    chromium = usable(chromium) if chromium else next(filter(usable, (
        "/usr/lib/chromium/chromium", shutil.which("chromium"), shutil.which("chromium-browser"))), None)
    chromedriver = usable(chromedriver) if chromedriver else next(filter(usable, (
        shutil.which("chromedriver"), "/usr/bin/chromedriver")), None)
    return (chromium, chromedriver) if chromium and chromedriver else None


def start_browser(chromium, chromedriver):
    """Start headless Chromium through chromedriver, with console logging.

    The driver's path is given explicitly, so Selenium never runs Selenium
    Manager (which would try to download a driver).

    Parameters
    ----------
    chromium, chromedriver : str
        Paths of the browser and of its driver.

    Returns
    -------
    selenium.webdriver.Chrome
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in CHROMIUM_ARGS:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    return driver


def check_page(driver, base, site_dir, page):
    """Load one page and check its console, math, images and links.

    Parameters
    ----------
    driver : selenium.webdriver.Chrome
        A browser from :func:`start_browser`.
    base : str
        The local server's root URL.
    site_dir : str
        The served directory.
    page : str
        The page's path relative to ``site_dir``.

    Returns
    -------
    dict
        ``page``, ``seconds``, ``math`` (elements), ``math_typeset``,
        ``images``, ``images_ok``, ``internal_links``, ``external_links``
        and ``problems`` (a list of str).
    """
    from selenium.common.exceptions import WebDriverException

    start = time.perf_counter()
    problems = []
    driver.get_log("browser")                # drop anything left from the page before
    try:
        driver.get(base + urllib.parse.quote(page))
        driver.execute_async_script(
            "const done = arguments[0];"
            "(function wait() { document.readyState === 'complete' ? done() : setTimeout(wait, 20); })();")
        mathjax = driver.execute_async_script(JS_WAIT_MATHJAX)
        data = driver.execute_async_script(JS_COLLECT)
        problems += check_layout(driver)
    except WebDriverException as err:        # a page that never finishes loading or typesetting
        problems.append(f"page did not finish: {(err.msg or type(err).__name__).splitlines()[0]}")
        mathjax, data = "", {"math": [], "images": [], "links": [], "ids": []}

    math = data["math"]
    bad = [m for m in math if not m["typeset"] or m["error"]]
    if mathjax.startswith("failed") or (bad and mathjax != "ok"):
        problems.append(f"{len(bad)} of {len(math)} math elements not typeset: MathJax {mathjax}")
    else:
        problems += [(f"MathJax error ({m['error']}) in " if m["typeset"] else "math not typeset: ")
                     + repr(m["text"]) for m in bad[:5]]
        problems += [f"... and {len(bad) - 5} more math elements"] if len(bad) > 5 else []
    for img in data["images"]:
        if not img["ok"]:
            problems.append(f"image did not load: {img['src']}")

    internal = external = 0
    page_ids, seen = set(data["ids"]), set()
    for url in data["links"]:
        scheme, netloc = urllib.parse.urlsplit(url)[:2]
        if url.startswith(base):
            internal += 1
            if url not in seen:
                seen.add(url)
                why = _check_link(url, base, site_dir, page, page_ids)
                if why:
                    problems.append(why)
        elif scheme == "invalid":
            internal += 1
            problems.append(f"invalid link: {url[8:]}")
        elif scheme == "file" or (scheme in ("http", "https") and netloc.startswith(("127.0.0.1", "localhost"))):
            internal += 1
            problems.append(f"link outside the site: {url}")
        elif scheme in ("http", "https", "mailto", "ftp"):
            external += 1

    try:
        problems += ["console: " + e.get("message", "").replace(base, "/")
                     for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        driver.execute_script("localStorage.clear(); sessionStorage.clear();")  # each page: a first visit
    except WebDriverException as err:
        problems.append(f"browser failed: {(err.msg or type(err).__name__).splitlines()[0]}")
    return {
        "page": page, "seconds": round(time.perf_counter() - start, 3),
        "math": len(math), "math_typeset": sum(m["typeset"] and not m["error"] for m in math),
        "images": len(data["images"]), "images_ok": sum(i["ok"] for i in data["images"]),
        "internal_links": internal, "external_links": external, "problems": problems,
    }


#: Raw TeX in rendered prose or in an image's alt text: a control word MathJax would have typeset, a ``\(``
#: or ``\[`` delimiter, or a ``$...$`` span.
RAW_LATEX = re.compile(r"\\(?:frac|sqrt|top|mathrm|mathbf|mathsf|operatorname|text|sum|prod|cdot|times|left|right|"
                       r"begin|end|partial|alpha|beta|sigma|lambda|delta|exp|log|infty|le|ge|ne)(?![A-Za-z])"
                       r"|\\[(\[]|\$[^$\s][^$\n]*\$")
#: A Python repr shown to the reader: a matplotlib object or any ``<... object at 0x...>``.
RAW_REPR = re.compile(r"<matplotlib[.\w]*[^<>\n]*>|<[^<>\n]* object at 0x[0-9a-fA-F]+")
#: The narrow width: a phone (390 CSS px, as an iPhone 12 to 15).
NARROW = (390, 844)


def _excerpt(text, match, width=30):
    start, end = max(match.start() - width, 0), min(match.end() + width, len(text))
    return " ".join(text[start:end].split())


def check_layout(driver):
    """The current page's layout at the window's width and at a phone's, and what its text shows raw.

    At the window's width (1280x800 in :data:`CHROMIUM_ARGS`) nothing in the
    main column may stick out of it or scroll sideways, code blocks included.
    At :data:`NARROW` width no equation, figure or table may (code blocks may
    scroll there). In the column's prose (text outside code blocks and
    program output) no raw TeX (:data:`RAW_LATEX`) or backtick may show; in
    its whole text no repr (:data:`RAW_REPR`); in an image's alt text or an
    element's title no raw TeX.

    Parameters
    ----------
    driver : selenium.webdriver.Chrome
        A browser with the page loaded and typeset.

    Returns
    -------
    list of str
        The problems found.
    """
    problems = []
    wide = driver.execute_async_script(JS_LAYOUT, "wide", True)
    problems += [f"overflows at {driver.execute_script('return window.innerWidth')} px: {p}" for p in wide["layout"]]
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": NARROW[0], "height": NARROW[1], "deviceScaleFactor": 1, "mobile": False})
    try:
        driver.execute_async_script(
            "const done = arguments[0]; requestAnimationFrame(() => requestAnimationFrame(() => done()));")
        problems += [f"overflows at {NARROW[0]} px: {p}" for p in
                     driver.execute_async_script(JS_LAYOUT, "narrow", False)["layout"]]
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    prose = wide["prose"]
    problems += [f"raw TeX in the text: {_excerpt(prose, m)!r}" for m in RAW_LATEX.finditer(prose)][:5]
    problems += [f"a repr in the text: {m.group()[:60]!r}" for m in RAW_REPR.finditer(wide["all"])][:5]
    ticks = list(re.finditer("`+", prose))
    problems += [f"a backtick in the text ({len(ticks)} runs of them): {_excerpt(prose, ticks[0])!r}"] if ticks else []
    problems += [f"raw TeX in an {tag}'s alt or title: {text[:60]!r}" for tag, text in wide["attrs"]
                 if RAW_LATEX.search(text)][:5]
    return problems


def check_site(site_dir, max_pages=None, progress=None, chromium=None, chromedriver=None):
    """Check every page of a built site in headless Chromium.

    Parameters
    ----------
    site_dir : str
        The built HTML site (e.g. ``docs/_build/html``).
    max_pages : int, optional
        Check only the first ``max_pages`` pages (``index.html`` first).
    progress : file, optional
        Where to write a progress line every 10 pages (e.g. ``sys.stderr``).
    chromium, chromedriver : str, optional
        Paths of the browser and its driver (see :func:`find_browser`).

    Returns
    -------
    dict
        ``site``, ``pages`` (one :func:`check_page` record each), ``problems``
        (their total), ``seconds`` (all, with the browser's start) and
        ``seconds_per_page`` (the mean time of a page).

    Raises
    ------
    SetupError
        If ``site_dir`` is not a directory, if Chromium, chromedriver or
        selenium is missing, or if the browser does not start.
    """
    site_dir = os.path.realpath(site_dir)
    if not os.path.isdir(site_dir):
        raise SetupError(f"no such directory: {site_dir}")
    found = find_browser(chromium, chromedriver)
    if found is None:
        raise SetupError(
            "Chromium or chromedriver not found" + (f" ({chromium}, {chromedriver})" if chromium or chromedriver
                                                    else "") + ": apt-get install chromium chromium-driver")
    if importlib.util.find_spec("selenium") is None:
        raise SetupError("selenium is not installed: python -m pip install selenium")
    pages = find_pages(site_dir)[:max_pages]
    start = time.perf_counter()
    _anchors.cache_clear()
    server = serve(site_dir)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    records, driver = [], None
    try:
        try:
            driver = start_browser(*found)
        except Exception as err:             # e.g. a chromedriver of another version than Chromium
            raise SetupError(f"the browser did not start: {err}".strip()) from err
        for i, page in enumerate(pages, 1):
            records.append(check_page(driver, base, site_dir, page))
            if progress and (i % 10 == 0 or i == len(pages)):
                print(f"check_site: {i}/{len(pages)} pages", file=progress, flush=True)
    finally:
        if driver is not None:
            driver.quit()
        server.shutdown()
        server.server_close()
    return {
        "site": site_dir, "pages": records, "problems": sum(len(r["problems"]) for r in records),
        "seconds": round(time.perf_counter() - start, 2),
        "seconds_per_page": round(sum(r["seconds"] for r in records) / max(len(records), 1), 3),
    }


def format_table(report):
    """Render a report from :func:`check_site` as a text table and a summary line.

    Parameters
    ----------
    report : dict

    Returns
    -------
    str
    """
    rows = [("page", "math", "images", "links int/ext", "problems")]
    for r in report["pages"]:
        rows.append((r["page"], f"{r['math_typeset']}/{r['math']}", f"{r['images_ok']}/{r['images']}",
                     f"{r['internal_links']}/{r['external_links']}", str(len(r["problems"]))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in report["pages"]:
        lines += [f"{r['page']}: {p}" for p in r["problems"]]
    pages = report["pages"]
    lines.append(
        f"{len(pages)} pages, {sum(r['math_typeset'] for r in pages)} math elements typeset on "
        f"{sum(r['math_typeset'] > 0 for r in pages)} pages, {sum(r['images_ok'] for r in pages)} images, "
        f"{sum(r['internal_links'] for r in pages)} internal / {sum(r['external_links'] for r in pages)} "
        f"external links; {report['problems']} problems "
        f"({report['seconds']} s, {report['seconds_per_page']} s/page)")
    return "\n".join(lines)


def main(argv=None):
    """Command-line entry point; returns the exit status (0, 1 or 2)."""
    parser = argparse.ArgumentParser(
        prog="check_site.py",
        description="Render every page of a built HTML site (Sphinx) in headless Chromium, served from "
                    "127.0.0.1, and check that each loads with no console error, that its math is "
                    "typeset by MathJax, and that its images and internal links resolve. No network "
                    "is used. Exit status: 0 no problem, 1 problems, 2 usage error or no browser.",
        epilog="Needs Debian's chromium and chromium-driver packages and Python's selenium.")
    parser.add_argument("site_dir", help="the built site, e.g. docs/_build/html")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--max-pages", type=int, metavar="N", help="check only the first N pages")
    parser.add_argument("--chromium", metavar="PATH", help="the Chromium binary (default: Debian's)")
    parser.add_argument("--chromedriver", metavar="PATH", help="the chromedriver binary (default: on PATH)")
    args = parser.parse_args(argv)
    if args.max_pages is not None and args.max_pages < 1:
        parser.error("--max-pages must be at least 1")
    try:
        report = check_site(args.site_dir, args.max_pages, progress=sys.stderr,
                            chromium=args.chromium, chromedriver=args.chromedriver)
    except SetupError as err:
        print(f"check_site.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
