"""The byte-level half of :mod:`.vectors`: the files' exact bytes, reading them back, and showing names safely.

:func:`npz_bytes` and :func:`manifest_bytes` are the only writers of a vector
set's bytes, so that ``verify`` can ask whether a fresh write gives exactly
the bytes it found. :func:`read_manifest` parses strictly: a key written twice
in one object (readers disagree on which one counts), ``NaN``, ``Infinity``
or a number out of range are refused. :func:`shown` escapes a name for
printing: whatever the name (lone surrogates, bytes that are not UTF-8,
control characters, terminal escape sequences, thousands of characters), the
result is one line of printable ASCII.
"""

from __future__ import annotations

import io
import json
import math
import os
import zipfile
from typing import Dict, List

import numpy as np

from ._files import read_regular_file
from .suites import SUITE_VERSION, SUITES
from .lowp import TEST_DTYPES

__all__ = ["FORMAT_VERSION", "MAX_FILE_BYTES", "MAX_MANIFEST_BYTES", "ManifestError", "manifest_bytes",
           "manifest_differences", "npz_bytes", "read_manifest", "read_member", "read_npz", "shown"]

FORMAT_VERSION = "3"
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)
#: The largest vector file ``verify`` reads (the full suite's largest is about 4 MiB).
MAX_FILE_BYTES = 256 << 20
#: The largest ``manifest.json`` it reads.
MAX_MANIFEST_BYTES = 16 << 20


class ManifestError(ValueError):
    """``manifest.json`` cannot be used: missing, not a regular file, too large, or not of the expected form."""


# ------------------------------------------------------------------ names, printed safely


def shown(name, limit: int = 120) -> str:
    """``name`` as one line of printable ASCII: every other character (and ``\\``) escaped as ``\\xNN``,
    ``\\uNNNN`` or ``\\UNNNNNNNN``, cut to about ``limit`` characters. Distinct names stay distinct (up to the cut).

    A ``bytes`` name is decoded as the file system does (``os.fsdecode``: bytes that are not UTF-8 become lone
    surrogates, escaped like any other)."""
    if isinstance(name, (bytes, bytearray)):
        name = os.fsdecode(bytes(name))
    elif not isinstance(name, str):
        name = repr(name)
    out = []
    for i, c in enumerate(name):
        if limit is not None and sum(map(len, out)) >= limit:
            out.append(f"...({len(name) - i} more characters)")
            break
        o = ord(c)
        out.append(c if 0x20 <= o < 0x7f and c != "\\" else
                   f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return "".join(out)


def one_line(text) -> str:
    """A message made printable on one line: characters outside printable ASCII escaped, backslashes kept."""
    return "".join(c if 0x20 <= ord(c) < 0x7f else shown(c) for c in str(text))


# ------------------------------------------------------------------ the manifest


class _Refused(ValueError):
    pass


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"the key '{shown(k, 60)}' is written twice in one object (readers differ on which "
                           "counts)")
        out[k] = v
    return out


def _no_constant(word):
    raise _Refused(f"{word} is not a JSON number")


def _finite(text):
    v = float(text)
    if not math.isfinite(v):
        raise _Refused(f"the number {shown(text, 40)} is out of range")
    return v


def strict_json(data: bytes):
    """The JSON value of ``data`` (UTF-8), refusing duplicated keys, ``NaN``/``Infinity`` and infinite numbers."""
    return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                      parse_float=_finite)


def manifest_bytes(manifest: dict) -> bytes:
    """The bytes of ``manifest.json``: sorted keys, two-space indent, ASCII, a final newline."""
    return (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("ascii")


def read_manifest(out_dir):
    """``(manifest, raw bytes)``, validated enough to regenerate the set from, or :class:`ManifestError`."""
    path = os.path.join(out_dir, "manifest.json")
    where = shown(path, 300)
    data, why = read_regular_file(path, MAX_MANIFEST_BYTES)       # opened first, then checked: nothing can block it
    if data is None:
        raise ManifestError(f"cannot read {where}: {why} (it should be a regular file of at most "
                            f"{MAX_MANIFEST_BYTES} bytes)")
    try:
        manifest = strict_json(data)
    except _Refused as exc:
        raise ManifestError(f"{where}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{where} is not valid JSON: {type(exc).__name__}") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{where} should hold a JSON object, but holds a {type(manifest).__name__}")
    if manifest.get("suite") not in SUITES + ("custom",):
        raise ManifestError(f"{where}: 'suite' should be one of {SUITES + ('custom',)!r}, but got "
                            f"{shown(repr(manifest.get('suite')), 60)}")
    if manifest.get("dtype") not in TEST_DTYPES:
        raise ManifestError(f"{where}: 'dtype' should be one of {', '.join(TEST_DTYPES)}, but got "
                            f"{shown(repr(manifest.get('dtype')), 60)}")
    want_format = FORMAT_VERSION if "layout" not in manifest else "4"     # a layout set (vector_layouts.py)
    if manifest.get("layout", "thd") not in ("thd", "paged", "thd_paged", "gathered"):
        raise ManifestError(f"{where}: 'layout' should be 'thd', 'paged', 'thd_paged' or 'gathered', but got "
                            f"{shown(repr(manifest.get('layout')), 40)}")
    if manifest.get("suite_version") != SUITE_VERSION or manifest.get("format_version") != want_format:
        raise ManifestError(f"{where}: written for suite version {shown(repr(manifest.get('suite_version')), 40)} "
                            f"and format {shown(repr(manifest.get('format_version')), 40)}; this package has "
                            f"{SUITE_VERSION!r} and {FORMAT_VERSION!r}")
    files = manifest.get("files")
    if not isinstance(files, list) or not all(
            isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("sha256"), str)
            and len(e["sha256"]) == 64 for e in files):
        raise ManifestError(f"{where}: 'files' should be a list of {{'file': name, 'sha256': 64 hex digits}}")
    return manifest, data


def manifest_differences(stored, fresh, limit: int = 6) -> List[str]:
    """Where the parsed ``stored`` manifest differs from ``fresh`` (type-aware: ``3`` is not ``3.0``, ``true`` is
    not ``1``), as at most ``limit`` short, escaped descriptions."""
    out: List[str] = []

    def brief(v):
        return shown(json.dumps(v, sort_keys=True) if not isinstance(v, float) or math.isfinite(v) else repr(v), 50)

    def walk(a, b, path):
        if len(out) > limit:
            return
        if type(a) is not type(b):
            out.append(f"{path or '(the whole)'} (stored {brief(a)}, fresh {brief(b)})")
        elif isinstance(a, dict):
            for k in sorted(set(a) | set(b), key=str):
                p = f"{path}.{shown(k, 60)}" if path else shown(k, 60)
                if k not in b:
                    out.append(f"{p} (not in a fresh write)")
                elif k not in a:
                    out.append(f"{p} (missing)")
                else:
                    walk(a[k], b[k], p)
        elif isinstance(a, list):
            if len(a) != len(b):
                out.append(f"{path} ({len(a)} entries, a fresh write has {len(b)})")
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
        elif a != b:
            out.append(f"{path} (stored {brief(a)}, fresh {brief(b)})")

    walk(stored, fresh, "")
    return out[:limit] + (["and more"] if len(out) > limit else [])


# ------------------------------------------------------------------ the vector files


def read_member(out_dir, name):
    """``(bytes, None)`` of the regular file ``name`` inside ``out_dir``, or ``(None, why)``."""
    if not isinstance(name, str) or name in ("", ".", "..") or name != os.path.basename(name) \
            or any(c in name for c in "/\\\0") or not name.endswith(".npz") or not name.isprintable():
        return None, "not a plain .npz file name (no folders, no '..', printable): not read"
    try:
        os.fsencode(name)
    except UnicodeError:
        return None, "a name the file system cannot encode: not read"
    data, why = read_regular_file(os.path.join(out_dir, name), MAX_FILE_BYTES)
    if data is None and why.startswith("missing"):
        why = why.replace("missing or unreadable", "missing", 1)
    return data, why


def differences(data, fresh):
    """``(note, max_rel_diff)``: which arrays of a stored file differ from the regenerated ones."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            if sum(i.file_size for i in zf.infolist()) > MAX_FILE_BYTES:
                return "its arrays would inflate past the size limit: not parsed", float("nan")
        stored = read_npz(data)
    except Exception as exc:  # a corrupt file is reported, not raised
        return f"not a readable .npz: {type(exc).__name__}", float("nan")
    bad, worst = [], 0.0
    for name in sorted(set(stored) | set(fresh)):
        a, b = stored.get(name), fresh.get(name)
        if a is None or b is None:
            bad.append(f"{shown(name, 60)} {'extra' if b is None else 'missing'}")
            continue
        b = np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{name} shape/dtype")
            continue
        if a.tobytes() != np.ascontiguousarray(b).tobytes():
            n_bad = int(np.sum(a.reshape(-1).view(np.uint8).reshape(a.size, -1)
                               != np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(b.size, -1),
                               axis=-1).astype(bool).sum()) if a.size else 0
            bad.append(f"{name}: {n_bad} entries differ")
            if a.dtype.kind == "f":
                a64, b64 = a.astype(np.float64), b.astype(np.float64)
                fin = np.isfinite(a64) & np.isfinite(b64)
                scale = np.abs(b64[fin]).max(initial=0.0) or 1.0
                worst = max(worst, float(np.abs(a64[fin] - b64[fin]).max(initial=0.0)) / scale)
    shown_bad = bad[:40] + ([f"and {len(bad) - 40} more"] if len(bad) > 40 else [])    # a file has ~30 arrays
    return ("differs from the suite's definition: " + ", ".join(shown_bad) if bad else "bytes differ"), worst


def read_npz(data: bytes) -> Dict[str, np.ndarray]:
    """Arrays of an ``.npz`` given as bytes (no pickles)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def npz_bytes(arrays: Dict[str, np.ndarray]) -> bytes:
    """An uncompressed ``.npz`` with fixed timestamps and entry order: the same bytes every time."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, arr in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_FIXED_TIME)
            info.external_attr = 0o644 << 16
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(info, npy.getvalue())
    return buf.getvalue()
