"""Where a documented name's ``[source]`` link points (``sphinx.ext.linkcode``): its file and lines in the repository.

The repository's URL is setup.cfg's ``project_urls`` entry ``Source`` (``SDPA_REF_SOURCE_URL`` in the environment
overrides it, for a fork or a mirror); the revision is the commit the site is built from (``git rev-parse HEAD``),
so the lines linked are the lines documented, or the version's tag ``v<version>`` outside a git checkout (an
sdist). :func:`resolver` makes the ``linkcode_resolve`` that docs/conf.py hands Sphinx.
"""

import configparser
import functools
import importlib
import inspect
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The names setup.cfg's ``project_urls`` may give the repository under, first match wins.
SOURCE_KEYS = ("source", "source code", "repository", "code")


def repository_url(setup_cfg=os.path.join(ROOT, "setup.cfg"), environ=os.environ):
    """The repository's web address without a trailing slash, or None when neither the environment nor setup.cfg
    names one."""
    url = environ.get("SDPA_REF_SOURCE_URL", "").strip()
    if not url and os.path.exists(setup_cfg):
        cfg = configparser.ConfigParser()
        cfg.read(setup_cfg)
        urls = {}
        for line in cfg.get("metadata", "project_urls", fallback="").splitlines():
            key, sep, value = line.partition("=")
            if sep:
                urls[key.strip().lower()] = value.strip()
        url = next((urls[k] for k in SOURCE_KEYS if urls.get(k)), "")
    return url.rstrip("/") or None


def source_ref(version, root=ROOT):
    """The revision the links name: the checkout's commit, else the tag ``v<version>``."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        out = None
    sha = out.stdout.strip() if out is not None and out.returncode == 0 else ""
    return sha if len(sha) == 40 else "v" + str(version)


def object_lines(module, fullname, root=ROOT):
    """``(path relative to root, first line, last line)`` of ``module.fullname``'s source, or None (a constant, a
    name defined outside the repository, a C function)."""
    try:
        obj = importlib.import_module(module)
        for part in fullname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    if isinstance(obj, property):
        obj = obj.fget
    obj = inspect.unwrap(obj) if callable(obj) else obj
    obj = getattr(obj, "func", obj) if isinstance(obj, functools.partial) else obj
    try:
        path = inspect.getsourcefile(obj)
        lines, first = inspect.getsourcelines(obj)
    except (TypeError, OSError):
        return None
    if path is None:
        return None
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    if rel.startswith(os.pardir):
        return None
    return rel.replace(os.sep, "/"), max(first, 1), max(first, 1) + len(lines) - 1


def resolver(url, ref, root=ROOT):
    """A ``linkcode_resolve(domain, info)`` giving ``<url>/blob/<ref>/<path>#L<first>-L<last>`` for Python names."""
    def linkcode_resolve(domain, info):
        if domain != "py" or not info.get("module") or not info.get("fullname"):
            return None
        found = object_lines(info["module"], info["fullname"], root)
        if found is None:
            return None
        path, first, last = found
        return f"{url}/blob/{ref}/{path}#L{first}-L{last}"
    return linkcode_resolve
