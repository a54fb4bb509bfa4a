"""Optional compiled element-wise kernels for the Ozaki products, with the same bits as the NumPy code.

``_kernels.c`` holds two loops of :mod:`.ozaki` -- cutting the slices of a
row, and adding a product into a double-double accumulator -- written with
the same IEEE-754 operations in the same order. It is compiled on first use
with the C compiler (``$CC``, else ``cc``) into a per-user cache
(``$SDPA_REF_CACHE``, else ``$XDG_CACHE_HOME/sdpa_ref`` or
``~/.cache/sdpa_ref``), with ``-ffp-contract=off`` and no fast-math, so the
compiler may neither fuse a multiply-add nor reorder a sum, and loaded with
``ctypes`` (which releases the GIL, so the pool's threads run in parallel).

Nothing depends on it: without a compiler, when the build fails, or with
``SDPA_REF_NATIVE=0``, :mod:`.ozaki` runs the NumPy loops, and the results
are the same bits (``tests/test_reproducible.py`` hashes both). It only makes
``precision="reproducible"`` faster.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np

__all__ = ["dd_add_d_inplace", "dd_exp", "kernels", "slice_rows"]

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kernels.c")
_FLAGS = ["-O2", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
_lib = None
_tried = False


def _cache_dir():
    d = os.environ.get("SDPA_REF_CACHE")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "sdpa_ref")
    return d


def _build():
    with open(_SOURCE, "rb") as fh:
        src = fh.read()
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None
    tag = hashlib.sha256(src + " ".join([cc] + _FLAGS).encode() + sysconfig.get_platform().encode()
                         + sys.implementation.cache_tag.encode()).hexdigest()[:16]
    d = _cache_dir()
    path = os.path.join(d, f"kernels-{tag}.so")
    if not os.path.exists(path):
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
        os.close(fd)
        try:
            subprocess.run([cc, *_FLAGS, "-o", tmp, _SOURCE, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)                          # atomic: a process racing us loads a whole file
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    lib = ctypes.CDLL(path)
    dp, n = ctypes.POINTER(ctypes.c_double), ctypes.c_ssize_t
    lib.sdpa_slice_rows.argtypes = [dp, dp, dp, n, n, ctypes.c_int, ctypes.c_int]
    lib.sdpa_slice_rows.restype = None
    lib.sdpa_dd_add_d.argtypes = [dp, dp, dp, n]
    lib.sdpa_dd_add_d.restype = None
    lib.sdpa_dd_exp.argtypes = [dp, dp, dp, dp, n, dp, dp, dp]
    lib.sdpa_dd_exp.restype = None
    return lib


def kernels():
    """The loaded library, or None (no compiler, a failed build, or ``SDPA_REF_NATIVE=0``)."""
    global _lib, _tried
    if os.environ.get("SDPA_REF_NATIVE", "1") == "0":
        return None
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except Exception:                                  # no compiler, no cache folder, a broken toolchain
            _lib = None
    return _lib


def _ptr(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_double))


def slice_rows(lib, hi, lo, n, rho):
    """``(slices, (hi, lo))`` of :func:`.ozaki._slices` along the last axis, by the compiled loop."""
    hi = np.array(hi, dtype=np.float64, order="C", copy=True)
    lo = None if lo is None else np.array(lo, dtype=np.float64, order="C", copy=True)
    k = hi.shape[-1] if hi.ndim else 1
    rows = hi.size // k if k else 0
    out = np.empty((n,) + hi.shape)
    if hi.size:
        lib.sdpa_slice_rows(_ptr(hi), None if lo is None else _ptr(lo), _ptr(out), rows, k, n, rho)
    return list(out), (hi, np.zeros_like(hi) if lo is None else lo)


def dd_add_d_inplace(lib, acc, c):
    """``acc = dd_add_d(acc, c)`` in place (``acc`` a pair of C-contiguous float64 arrays that we own)."""
    c = np.ascontiguousarray(c, dtype=np.float64)
    lib.sdpa_dd_add_d(_ptr(acc[0]), _ptr(acc[1]), _ptr(c), acc[0].size)
    return acc


def dd_exp(lib, x, table, consts):
    """:func:`.dd.dd_exp` of the dd ``x`` by the compiled loop (``table`` and ``consts`` from :mod:`.dd`)."""
    x0, x1 = np.broadcast_arrays(np.asarray(x[0], dtype=np.float64), np.asarray(x[1], dtype=np.float64))
    x0, x1 = np.ascontiguousarray(x0), np.ascontiguousarray(x1)
    o0, o1 = np.empty_like(x0), np.empty_like(x0)
    if x0.size:
        lib.sdpa_dd_exp(_ptr(x0), _ptr(x1), _ptr(o0), _ptr(o1), x0.size, _ptr(table[0]), _ptr(table[1]),
                        _ptr(consts))
    return o0, o1
