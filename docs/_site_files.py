"""The file side of ``check_site.py``: the local web server, the list of pages, and whether a link resolves.

Nothing here runs a browser; :mod:`check_site` drives one over what :func:`serve` serves.
"""

import functools
import html.parser
import http.server
import os
import threading
import urllib.parse

#: Directories of a Sphinx build that hold assets, not pages.
SKIP_DIRS = {"_static", "_sources", "_images", "_downloads"}

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Static file handler with no request log and web-server MIME types.

    Chromium asks every server for ``/favicon.ico`` on its own; when the site
    has none, the answer is 204 (no content) rather than a 404 that no page
    asked for. A page's own ``<link rel="icon">`` is checked like any resource.
    """

    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".js": "text/javascript", ".mjs": "text/javascript", ".json": "application/json",
        ".css": "text/css", ".svg": "image/svg+xml", ".woff": "font/woff", ".woff2": "font/woff2",
        ".wasm": "application/wasm", ".txt": "text/plain",
    }

    def send_head(self):
        if self.path.split("?")[0] == "/favicon.ico" and not os.path.exists(self.translate_path("/favicon.ico")):
            self.send_response(204)
            self.end_headers()
            return None
        return super().send_head()

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass                                 # a browser closing a connection early is no problem


def serve(site_dir):
    """Serve a directory over http on 127.0.0.1, from a daemon thread.

    Parameters
    ----------
    site_dir : str
        The directory to serve.

    Returns
    -------
    server : http.server.ThreadingHTTPServer
        The running server; ``server.server_address[1]`` is its port. Stop it
        with ``server.shutdown()``.
    """
    handler = functools.partial(_QuietHandler, directory=site_dir)
    server = _QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def find_pages(site_dir):
    """List the HTML pages of a site, as sorted paths relative to it.

    Parameters
    ----------
    site_dir : str
        The built site.

    Returns
    -------
    list of str
        Relative paths with ``/`` separators, ``index.html`` first when it
        exists; the asset directories in :data:`SKIP_DIRS` are left out.
    """
    pages = []
    for root, dirs, files in os.walk(site_dir):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        rel = os.path.relpath(root, site_dir)
        pages += [f if rel == "." else f"{rel}/{f}".replace(os.sep, "/") for f in files if f.endswith(".html")]
    return sorted(pages, key=lambda p: (p != "index.html", p))


class _Anchors(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.names = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.names.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.names.add(attrs["name"])


@functools.lru_cache(maxsize=None)
def _anchors(path):
    """The ids and ``<a name>`` anchors of an HTML file, a frozenset (cached per file)."""
    parser = _Anchors()
    with open(path, encoding="utf-8", errors="replace") as f:
        parser.feed(f.read())
    return frozenset(parser.names)


def _check_link(url, base, site_dir, page, page_ids):
    """None if an internal link (absolute URL) resolves, else why not.

    A link into ``page`` itself is looked up in ``page_ids``, the ids of the
    rendered page; a link into another page in that page's HTML source.
    """
    target, _, fragment = url.partition("#")
    fragment = urllib.parse.unquote(fragment)
    path = urllib.parse.unquote(urllib.parse.urlsplit(target).path).lstrip("/")
    if path == "" or path.endswith("/"):
        path += "index.html"
    file = os.path.join(site_dir, *path.split("/"))
    if os.path.isdir(file):
        path, file = path + "/index.html", os.path.join(file, "index.html")
    if not os.path.isfile(file):
        return f"link to missing {path}: {url[len(base) - 1:]}"
    if not fragment or fragment.lower() == "top" or not path.endswith((".html", ".htm")):
        return None
    ids = page_ids if path == page else _anchors(os.path.realpath(file))
    if fragment not in ids:
        return f"link to missing anchor #{fragment} in {path}"
    return None
