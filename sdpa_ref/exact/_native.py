"""Optional compiled element-wise kernels: the Ozaki products' loops, and the fast path's row passes.

``_kernels.c`` (with the ``_kernels.h`` it includes once per SIMD build)
holds the loops of :mod:`.ozaki` and :mod:`.dd` (cutting the slices of a
row, double-double accumulation, exp, division, row sums), written with the
same IEEE-754 operations in the same order as the NumPy code, so they give
the same bits; ``_fast_rows.c`` (with the ``_fast_rows.h`` it includes once
per SIMD build) the fast path's fused softmax and softmax-VJP rows
(:mod:`sdpa_ref.engines.fast`), which have no NumPy twin of the same bits
but the same bits on every machine. Both are built for the baseline and, on
x86-64, for AVX2 and AVX-512 (F, DQ, VL and BW), the widest the CPU runs
chosen at run time, one level for both (``SDPA_REF_SIMD=baseline``,
``avx2`` or ``avx512`` forces one, read when the library
loads; a level the CPU lacks gives the best one it has; :func:`simd_level`
switches at run time), and every build gives the same bits.

The library is compiled when the package is installed (``setup.py``'s
``build_ext``; for ``pip install -e .`` into the source tree), by the C
compiler (``$CC``, else ``cc``) with exactly ``-O3 -std=c99 -fPIC -shared
-ffp-contract=off -fno-fast-math``, so the compiler may neither fuse a
multiply-add nor reorder a sum, into ``_compiled_kernels.so`` beside this
file, and loaded with ``ctypes`` (which releases the GIL, so the pool's
threads run in parallel). ``_compiled_kernels.json`` beside it records how
it was built, or why it was not. Nothing else is ever loaded: no compiler
runs and no cache is read when the package is imported or called; the one
file is found from this module's own path, and loaded only if it is a
regular file. After editing the C files, reinstall (or run ``python setup.py
build_ext --inplace``); :func:`status` and ``sdpa-ref info`` tell a stale
build.

Nothing depends on it: when it was not built at install (no compiler, a
failed build), when it fails to load, or with ``SDPA_REF_NATIVE=0`` (read on
every call), the NumPy code runs: the same bits for
``precision="reproducible"`` (``tests/test_engines_reproducible.py`` hashes both),
and equal to rounding on the fast path. It only makes things faster.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import stat

import numpy as np

__all__ = ["SIMD_LEVELS", "dd_add_d_inplace", "dd_div_rows", "dd_exp", "dd_mul_d_scalar", "dd_rowsum", "fast_exp",
           "fast_softmax_rows", "fast_softmax_vjp_rows", "simd_level", "kernels", "slice_rows", "softmax_vjp_rows",
           "status"]

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The library's sources (compiled together at install) and the header they include (twice: once per SIMD build).
_SOURCES = [os.path.join(_HERE, "_kernels.c"), os.path.join(_HERE, "_fast_rows.c")]
_HEADERS = [os.path.join(_HERE, "_kernels.h"), os.path.join(_HERE, "_fast_rows.h")]
#: The library built at install (``setup.py``): the one file ever loaded.
_LIBRARY = os.path.join(_HERE, "_compiled_kernels.so")
#: How it was built, or why not (written by ``setup.py`` beside it).
_RECORD = os.path.join(_HERE, "_compiled_kernels.json")
_lib = None
_tried = False
_why = None                                                # why _lib is None once tried


def _load():
    """``(library, None)``, or ``(None, why not)``. Loads :data:`_LIBRARY` and nothing else; builds nothing."""
    try:
        st = os.stat(_LIBRARY)
    except FileNotFoundError:
        rec = build_record()
        tree = os.path.dirname(os.path.dirname(_HERE))
        if rec is None and os.path.exists(os.path.join(tree, "setup.py")):
            why = (f"not built: sdpa_ref was imported from the source tree {tree}, not from an installed copy, "
                   "and nothing was built there (`pip install -e .` or `python setup.py build_ext --inplace` "
                   "builds it in place)")
        elif rec is None:
            why = "not built at install (no build record either: the package was installed without its build step)"
        elif rec.get("built"):
            why = f"missing: the install built {os.path.basename(_LIBRARY)}, but it is not in the package"
        else:
            why = "not built at install" + (f": {rec['reason']}" if rec.get("reason") else "")
        return None, why
    except OSError as e:
        return None, f"failed to load: {e}"
    if not stat.S_ISREG(st.st_mode):
        return None, f"failed to load: {_LIBRARY} is not a regular file"
    try:
        lib = ctypes.CDLL(_LIBRARY)
        _declare(lib)
    except (OSError, AttributeError) as e:                 # a broken or foreign file: the NumPy code runs
        return None, f"failed to load: {e}"
    return lib, None


def _declare(lib):
    dp, n = ctypes.c_void_p, ctypes.c_ssize_t                 # addresses passed as ints: cheaper than data_as
    lib.sdpa_slice_rows.argtypes = [dp, dp, n, n, n, n, n, n, ctypes.c_int, ctypes.c_int, dp, dp, dp, dp, dp, dp, dp,
                                    dp, n, n, n, n, n, dp]
    lib.sdpa_slice_rows.restype = None
    lib.sdpa_dd_add_d.argtypes = [dp, dp, dp, n]
    lib.sdpa_dd_add_d.restype = None
    lib.sdpa_dd_add_d_rows.argtypes = [dp, dp, dp, n, n, n]
    lib.sdpa_dd_add_d_rows.restype = None
    lib.sdpa_dd_exp_rows.argtypes = [dp, dp, dp, dp, n, n, dp, dp, dp, dp, dp]
    lib.sdpa_dd_exp_rows.restype = None
    lib.sdpa_dd_div_rows.argtypes = [dp, dp, dp, dp, n, n, dp, dp]
    lib.sdpa_dd_div_rows.restype = None
    lib.sdpa_dd_mul_d_scalar.argtypes = [dp, dp, ctypes.c_double, n, dp, dp]
    lib.sdpa_dd_mul_d_scalar.restype = None
    lib.sdpa_dd_finish.argtypes = [dp, dp, n, n, n, ctypes.c_int, ctypes.c_int, ctypes.c_double, dp, dp, dp, dp]
    lib.sdpa_dd_finish.restype = None
    lib.sdpa_level_redo.argtypes = [n, n, n, ctypes.c_int, ctypes.c_double, dp, dp, dp, dp, dp, dp, dp, dp, dp]
    lib.sdpa_level_redo.restype = None
    lib.sdpa_dd_rowsum.argtypes = [dp, dp, n, n, dp, dp, dp]
    lib.sdpa_dd_rowsum.restype = None
    lib.sdpa_dd_softmax_vjp_rows.argtypes = [dp, dp, dp, dp, n, n, dp, dp, dp]
    lib.sdpa_dd_softmax_vjp_rows.restype = None
    for name in ("sdpa_fast_softmax_rows", "sdpa_fast_softmax_rows_f32"):
        getattr(lib, name).argtypes = [dp, n, n, n, dp, dp, dp, dp]
        getattr(lib, name).restype = None
    for name in ("sdpa_fast_exp", "sdpa_fast_expf"):
        getattr(lib, name).argtypes = [dp, n, dp]
        getattr(lib, name).restype = None
    lib.sdpa_fast_set_level.argtypes = [ctypes.c_int]
    lib.sdpa_fast_set_level.restype = ctypes.c_int
    lib.sdpa_fast_get_level.argtypes = []
    lib.sdpa_fast_get_level.restype = ctypes.c_int
    for name in ("sdpa_fast_softmax_vjp_rows", "sdpa_fast_softmax_vjp_rows_f32"):
        getattr(lib, name).argtypes = [dp, dp, n, n, n, n]
        getattr(lib, name).restype = None


def kernels():
    """The loaded library, or None (not built at install, failed to load, or ``SDPA_REF_NATIVE=0``).

    The first call loads it (no lock: loading twice at once is harmless, so a fork can never find one held)."""
    global _lib, _tried, _why
    if os.environ.get("SDPA_REF_NATIVE", "1") == "0":
        return None
    level = _simd_level()                                  # a bad SDPA_REF_SIMD is the user's error: raised
    if not _tried:
        lib, why = _load()
        if lib is not None:
            lib.sdpa_fast_set_level(level)
        _lib, _why = lib, why
        _tried = True
    return _lib


def build_record():
    """What ``setup.py`` recorded when it built (or did not build) the library, or None if there is no record."""
    try:
        with open(_RECORD, encoding="utf-8") as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _sources_sha256():
    h = hashlib.sha256()
    try:
        for f in _SOURCES + _HEADERS:
            with open(f, "rb") as fh:
                h.update(fh.read())
    except OSError:
        return None
    return h.hexdigest()


def status():
    """Whether the compiled kernels are in use, and if not why: a dict with ``in_use`` (bool), ``reason`` (None
    when in use; else not built at install, ``SDPA_REF_NATIVE=0``, or failed to load, with the cause),
    ``path`` (the library, when in use), ``simd_level`` and ``simd_levels`` (in use and available on this CPU;
    None and ``[]`` when not in use), ``stale`` (the library was built from other sources than those beside it,
    as after editing the C files of an editable install; None when unknown) and ``build`` (the install's record,
    or None)."""
    rec = build_record()
    out = {"in_use": False, "reason": None, "path": None, "simd_level": None, "simd_levels": [], "stale": None,
           "build": rec}
    if rec and rec.get("built") and rec.get("sources_sha256"):
        now = _sources_sha256()
        out["stale"] = None if now is None else now != rec["sources_sha256"]
    if os.environ.get("SDPA_REF_NATIVE", "1") == "0":
        out["reason"] = "SDPA_REF_NATIVE=0"
        return out
    try:
        lib = kernels()
    except ValueError as e:                                # a bad SDPA_REF_SIMD: said, not raised, here
        out["reason"] = f"not loaded: {e}"
        return out
    if lib is None:
        out["reason"] = _why
        return out
    level = lib.sdpa_fast_get_level()
    best = lib.sdpa_fast_set_level(len(SIMD_LEVELS) - 1)   # asks for the highest: gives the best this CPU runs
    lib.sdpa_fast_set_level(level)                          # and back to the one in use
    out.update(in_use=True, path=_LIBRARY, simd_level=SIMD_LEVELS[level], simd_levels=list(SIMD_LEVELS[:best + 1]))
    return out


def _ptr(a):
    """The address of ``a``'s data; the caller must hold ``a`` until the C call returns."""
    return a.ctypes.data


#: Rows the slicing loop gathers at once (``SLICE_GATHER`` in ``_kernels.c``); its scratch is
#: ``2 _GATHER (k + _PAD)`` doubles.
_GATHER = 8
#: Doubles of padding after each of its rows (``SLICE_PAD``).
_PAD = 8


def _row_layout(hi, lo):
    """``(hi, lo, per, bs, rs, cs)``: the arrays and, in elements, the layout the slicing loop reads them in
    place with (row ``r`` at ``(r // per) bs + (r % per) rs``, entries ``cs`` apart); contiguous copies where the
    leading axes do not fold into one stride or ``lo`` is laid out otherwise than ``hi``."""
    hi = np.asarray(hi, dtype=np.float64)
    per = hi.shape[-2] if hi.ndim >= 2 else 1
    lead = [(d, st) for d, st in zip(hi.shape[:-2], hi.strides[:-2]) if d != 1]
    bs = lead[-1][1] if lead else 0
    ok = (lo is None or (np.shape(lo) == hi.shape and np.asarray(lo).strides == hi.strides
                         and np.asarray(lo).dtype == np.float64)) \
        and all(st >= 0 and st % 8 == 0 for st in hi.strides) \
        and all(lead[i][1] == lead[i + 1][0] * lead[i + 1][1] for i in range(len(lead) - 1))
    if not ok:
        hi = np.ascontiguousarray(hi)
        lo = None if lo is None else np.ascontiguousarray(np.broadcast_to(lo, hi.shape), dtype=np.float64)
        return hi, lo, per, per * hi.shape[-1], hi.shape[-1], 1
    st = hi.strides
    return hi, lo, per, bs // 8, (st[-2] // 8 if hi.ndim >= 2 else 0), st[-1] // 8


#: Doubles after each line of :func:`slice_rows`' ``joined`` slices.
_JOIN_PAD = 8
#: Rows x entries below which :func:`slice_rows` cuts in one call rather than in the pool's threads.
_SLICE_PARALLEL = 1 << 17


def slice_rows(lib, hi, lo, n, rho, stats=False, normalise=False, remainder=True, transposed=False, parts=1,
               run=None, joined=False, nonzero=False):
    """``(slices, (hi, lo))`` of :func:`.ozaki._slices` along the last axis, by the compiled loop, which reads
    the rows in place (a transposed block needs no copy); with ``stats=True`` ``(slices, (slice maxima, slice
    sums), remainder max|hi| + max|lo|)``, each ``(..., 1)``, and no remainder array. ``normalise=True`` scales
    each row first as :func:`.ozaki._normalise` does and appends its exponents ``e`` ``(..., 1)`` to the
    result. ``remainder=False`` (without ``stats``): no remainder is formed, and None stands in for it.

    ``transposed=True`` (``hi`` at least 2-D): each slice is returned as the C-contiguous transpose of its
    last two axes, ``(..., k, rows)`` for ``hi`` ``(..., rows, k)`` -- the columns of a GEMM's ``B``, cut as
    the rows of ``B^T``, laid out as the GEMM reads ``B`` fastest (the statistics, exponents and remainder keep
    their layout). ``joined=True`` (with ``transposed``): the slices side by side, one C-contiguous
    ``(..., k, n rows + _JOIN_PAD)`` array (appended to the result; the padding keeps its lines from being a
    multiple of 4 KiB apart, which costs the BLAS's packing), slice ``p`` the view ``[..., p rows:(p + 1)
    rows]`` of it, so that the products of one ``A`` slice with several ``B`` slices are one GEMM.
    ``nonzero=True`` (with ``transposed``): appended last, a bool ``(n, ..., k)``, whether entry ``j`` of slice
    ``p`` is nonzero in some row of its group (the lines of ``B``'s slices a product must contract over),
    found as the slices are written. ``parts`` > 1 (with ``run``, the pool's ``run_all``): an input of at least
    :data:`_SLICE_PARALLEL` entries is cut in that many ranges of rows, side by side; each row's slices are its
    own, so any ranges give the same bits."""
    shape = np.shape(hi)
    if transposed and len(shape) < 2:
        raise ValueError(f"`transposed` needs at least 2-D rows, but got shape {shape}")
    hi, lo, per, bs, rs, cs = _row_layout(hi, lo)
    k = shape[-1]
    rows = hi.size // k if k else 0
    if (joined or nonzero) and not transposed:
        raise ValueError("`joined` and `nonzero` are for transposed slices: pass transposed=True")
    if joined:
        tjs = n * per + _JOIN_PAD
        whole = np.empty(shape[:-2] + (k, tjs))
        out = [whole[..., p * per:(p + 1) * per] for p in range(n)]
        tps, tgs = per, tjs * k
    else:
        out = np.empty((n,) + (shape[:-2] + (k, shape[-2]) if transposed else shape))
        tps, tgs, tjs = (rows * k, per * k, per) if transposed else (0, 0, 0)
    if stats:
        smax, ssum = np.zeros((n,) + shape[:-1] + (1,)), np.zeros((n,) + shape[:-1] + (1,))
        rmax = np.zeros(shape[:-1] + (1,))
        rh = rl = None
    else:
        smax = ssum = rmax = None
        rh, rl = (np.empty(shape), np.empty(shape)) if remainder else (None, None)
    e = np.zeros(shape[:-1] + (1,), np.intc) if normalise else None
    knz = np.zeros((n,) + shape[:-2] + (k,), bool) if nonzero else None
    if rows and k:
        p = [None if x is None else _ptr(x) for x in (rh, rl, smax, ssum, rmax, e)]
        lo_p = None if lo is None else _ptr(lo)
        size = (2 + (n if transposed else 0)) * _GATHER * (k + _PAD)
        base = _ptr(whole) if joined else _ptr(out)

        parts = parts if run is not None and rows * k >= _SLICE_PARALLEL else 1
        step = -(-rows // (parts * _GATHER)) * _GATHER     # whole groups of gathered rows
        spans = [(r, min(r + step, rows)) for r in range(0, rows, step)]
        flags = [np.zeros((n, rows // per, k), np.uint8) for _ in spans] if nonzero else [None] * len(spans)

        def cut(i):                                        # the scratch is held here: C gets only its address
            scratch = np.empty(size)
            lib.sdpa_slice_rows(_ptr(hi), lo_p, rows, k, per, bs, rs, cs, n, rho, base, *p, _ptr(scratch),
                                spans[i][0], spans[i][1], tps, tgs, tjs,
                                None if flags[i] is None else _ptr(flags[i]))

        if len(spans) > 1:
            run(cut, range(len(spans)))
        else:
            cut(0)
        if nonzero:
            knz = np.logical_or.reduce(flags)              # each range marks the groups of its own rows
    elif not stats and remainder:
        rh, rl = np.array(hi, copy=True).reshape(shape), np.zeros(shape) if lo is None else np.array(lo).reshape(shape)
    res = (list(out), (list(smax), list(ssum)), rmax) if stats else (list(out), (rh, rl) if remainder else None)
    res = res + (e,) if normalise else res
    res = res + (whole,) if joined else res
    return res + (knz.astype(bool).reshape((n,) + shape[:-2] + (k,)),) if nonzero else res


def dd_add_d_inplace(lib, acc, c):
    """``acc = dd_add_d(acc, c)`` in place (``acc`` a pair of C-contiguous float64 arrays that we own)."""
    if isinstance(c, np.ndarray) and c.dtype == np.float64 and c.shape == acc[0].shape and c.ndim >= 2 \
            and c.strides[-1] == 8 and c.strides[-2] >= 0 and c.strides[-2] % 8 == 0 and not c.flags.c_contiguous \
            and all(c.strides[i] == c.shape[i + 1] * c.strides[i + 1] for i in range(c.ndim - 2)):
        n = c.shape[-1]                                    # a block of columns: read in place
        lib.sdpa_dd_add_d_rows(_ptr(acc[0]), _ptr(acc[1]), _ptr(c), c.size // n if n else 0, n, c.strides[-2] // 8)
        return acc
    c = np.ascontiguousarray(c, dtype=np.float64)
    lib.sdpa_dd_add_d(_ptr(acc[0]), _ptr(acc[1]), _ptr(c), acc[0].size)
    return acc


def dd_exp(lib, x, table, consts, m=None):
    """:func:`.dd.dd_exp` of the dd ``x`` (less the row's dd ``m``, ``(..., 1)``, when given) by the compiled loop
    (``table`` and ``consts`` from :mod:`.dd`)."""
    shape = np.broadcast_shapes(np.shape(x[0]), np.shape(x[1]))
    x0, x1 = _rows_of(x[0], shape), _rows_of(x[1], shape)
    o0, o1 = np.empty(shape), np.empty(shape)
    n = shape[-1] if shape else 1
    rows = o0.size // n if n else 0
    if m is not None:
        m0, m1 = (_rows_of(y, shape[:-1] + (1,)) for y in m)
    if rows and n:
        lib.sdpa_dd_exp_rows(_ptr(x0), _ptr(x1), None if m is None else _ptr(m0), None if m is None else _ptr(m1),
                             rows, n, _ptr(o0), _ptr(o1), _ptr(table[0]), _ptr(table[1]), _ptr(consts))
    return o0, o1


def dd_div_rows(lib, a, b):
    """:func:`.dd.dd_div` of the dd ``a`` ``(..., n)`` by the dd ``b`` ``(..., 1)``, by the compiled loop."""
    shape = np.broadcast_shapes(np.shape(a[0]), np.shape(a[1]), np.shape(b[0])[:-1] + (1,))
    a0, a1 = _rows_of(a[0], shape), _rows_of(a[1], shape)
    b0, b1 = (_rows_of(y, shape[:-1] + (1,)) for y in b)
    o0, o1 = np.empty(shape), np.empty(shape)
    n = shape[-1]
    rows = o0.size // n if n else 0
    if rows and n:
        lib.sdpa_dd_div_rows(_ptr(a0), _ptr(a1), _ptr(b0), _ptr(b1), rows, n, _ptr(o0), _ptr(o1))
    return o0, o1


def dd_mul_d_scalar(lib, a, b):
    """:func:`.dd.dd_mul_d` of the dd ``a`` by the float ``b``, by the compiled loop."""
    shape = np.broadcast_shapes(np.shape(a[0]), np.shape(a[1]))
    a0, a1 = _rows_of(a[0], shape), _rows_of(a[1], shape)
    o0, o1 = np.empty(shape), np.empty(shape)
    if o0.size:
        lib.sdpa_dd_mul_d_scalar(_ptr(a0), _ptr(a1), float(b), o0.size, _ptr(o0), _ptr(o1))
    return o0, o1


def dd_finish(lib, acc, ea, eb, out, normalise=True, scale=None):
    """The end of a block of :func:`.ozaki.matmul` in one pass, by the compiled loop: ``acc`` ``(nb, rows, n)``
    (a dd sum of levels) normalised by :func:`.dd.fast_two_sum` (with ``normalise``), times the float ``scale``
    (:func:`.dd.dd_mul_d`, when given), times ``2**(ea + eb)`` (``ea`` ``(nb, rows, 1)``, ``eb`` ``(nb, 1, n)``,
    every exponent and every sum of two in ``[-1022, 1023]``: the caller checks), into ``out``, a pair of
    C-contiguous ``(nb, rows, n)`` float64 arrays. The bits of those NumPy steps."""
    h, l = (np.ascontiguousarray(x, dtype=np.float64) for x in acc)
    nb, rows, n = h.shape
    ea = np.ascontiguousarray(np.broadcast_to(ea, (nb, rows, 1)), dtype=np.intc)
    eb = np.ascontiguousarray(np.broadcast_to(eb, (nb, 1, n)), dtype=np.intc)
    if h.size:
        lib.sdpa_dd_finish(_ptr(h), _ptr(l), nb, rows, n, int(bool(normalise)), int(scale is not None),
                           0.0 if scale is None else float(scale), _ptr(ea), _ptr(eb), _ptr(out[0]), _ptr(out[1]))
    return out


def level_redo(lib, ra, rb, ma, mb, sa, sb, h, K):
    """``~np.all(ozaki._level_bound(ra, rb, ma, mb, sa, sb, K) <= 2**-55 |h|, axis=-1)`` by the compiled loop, the
    same operations entry by entry: ``h`` ``(nb, rows, n)``; ``ra`` and each of the ``t`` of ``ma``, ``sa``
    ``(nb, rows, 1)``; ``rb`` and each of ``mb``, ``sb`` ``(nb, 1, n)``. A bool ``(nb, rows)``."""
    h = np.ascontiguousarray(h, dtype=np.float64)
    nb, rows, n = h.shape
    t = len(ma)
    rs, cs = (nb, rows, 1), (nb, 1, n)
    held = [_laid(ra, rs), _laid(rb, cs)] + [_laid(x, rs) for x in ma] + [_laid(x, cs) for x in mb] \
        + [_laid(x, rs) for x in sa] + [_laid(x, cs) for x in sb]          # held until the call returns
    ptrs = (ctypes.c_void_p * (2 + 4 * t))(*[x.ctypes.data for x in held])
    redo = np.zeros((nb, rows), np.bool_)                  # one byte each, 0 or 1: what the C code writes
    if h.size:
        scratch = np.empty(3 * n)
        sz = ctypes.sizeof(ctypes.c_void_p)
        at = ctypes.addressof(ptrs)
        lib.sdpa_level_redo(nb, rows, n, t, float(K), ptrs[0], ptrs[1], at + 2 * sz, at + (2 + t) * sz,
                            at + (2 + 2 * t) * sz, at + (2 + 3 * t) * sz, _ptr(h), _ptr(redo), _ptr(scratch))
    return redo


def _laid(x, shape):
    """``x`` as a C-contiguous float64 array of ``shape`` (itself where it is one already: the common case, and
    the cheap one)."""
    if type(x) is np.ndarray and x.shape == shape and x.dtype == np.float64 and x.flags.c_contiguous:
        return x
    return np.ascontiguousarray(np.broadcast_to(x, shape), dtype=np.float64)


def _rows_of(a, shape):
    return np.ascontiguousarray(np.broadcast_to(np.asarray(a, dtype=np.float64), shape))


def dd_rowsum(lib, a, keepdims=False):
    """:func:`.dd.dd_sum` of the dd ``a`` along its last axis, the same tree, by the compiled loop."""
    shape = np.broadcast_shapes(np.shape(a[0]), np.shape(a[1]))
    n = shape[-1]
    hi, lo = _rows_of(a[0], shape), _rows_of(a[1], shape)
    o0, o1 = np.empty(shape[:-1]), np.empty(shape[:-1])
    rows = o0.size
    if rows:
        scratch = np.empty(2 * max(n, 1))
        lib.sdpa_dd_rowsum(_ptr(hi), _ptr(lo), rows, n, _ptr(o0), _ptr(o1), _ptr(scratch))
    if keepdims:
        return o0[..., None], o1[..., None]
    return o0, o1


def softmax_vjp_rows(lib, P, g):
    """The pivoted softmax VJP of :mod:`sdpa_ref.engines.reproducible` on dd rows, by the compiled loop."""
    shape = np.broadcast_shapes(*(np.shape(x) for x in (P[0], P[1], g[0], g[1])))
    p0, p1, g0, g1 = (_rows_of(x, shape) for x in (P[0], P[1], g[0], g[1]))
    o0, o1 = np.empty(shape), np.empty(shape)
    n = shape[-1] if shape else 1
    rows = o0.size // n if n else 0
    if rows and n:
        scratch = np.empty(2 * n)
        lib.sdpa_dd_softmax_vjp_rows(_ptr(p0), _ptr(p1), _ptr(g0), _ptr(g1), rows, n, _ptr(o0), _ptr(o1),
                                     _ptr(scratch))
    return o0, o1


# ------------------------------------------------------------------ the fast path's fused row passes

def row_stride(a):
    """The entries between the rows of the 2-D ``a`` when the compiled row passes take it (each row contiguous,
    the rows a non-negative whole number of entries apart: C-contiguous, or a block of columns of such an
    array), else None."""
    if a.ndim != 2:
        return None
    if a.size == 0:
        return max(a.shape[1], 1)
    if a.strides[1] != a.itemsize and a.shape[1] > 1:
        return None
    if a.shape[0] == 1:
        return max(a.shape[1], 1)
    ld, r = divmod(a.strides[0], a.itemsize)
    return ld if r == 0 and ld >= a.shape[1] else None


def fast_softmax_rows(lib, t, m, s, lse, empty):
    """Softmax of each row of ``t`` ``(rows, n)`` (float64 or float32; C-contiguous, or a block of columns of a
    C-contiguous array: :func:`row_stride`) in place, with the rows' max, sum, lse and emptiness written into the
    C-contiguous ``(rows, 1)`` arrays (``empty`` bool)."""
    fn = lib.sdpa_fast_softmax_rows if t.dtype == np.float64 else lib.sdpa_fast_softmax_rows_f32
    fn(_ptr(t), t.shape[0], t.shape[1], row_stride(t), _ptr(m), _ptr(s), _ptr(lse), _ptr(empty))


def fast_softmax_vjp_rows(lib, d, p):
    """``d <- p * ((d - c) - rowsum(p * (d - c)))``, ``c`` at each row's first largest ``p``, in place (``(rows,
    n)``, float64 or float32, each C-contiguous or a block of columns of such an array: :func:`row_stride`)."""
    fn = lib.sdpa_fast_softmax_vjp_rows if d.dtype == np.float64 else lib.sdpa_fast_softmax_vjp_rows_f32
    fn(_ptr(d), _ptr(p), d.shape[0], d.shape[1], row_stride(d), row_stride(p))


def fast_exp(lib, x, out=None):
    """``exp`` of the float64 or float32 array ``x`` (others as float64) by the row passes' compiled exp of that
    dtype (within 1 ulp), into ``out`` when given (C-contiguous, of ``x``'s shape and dtype; ``x`` itself is
    allowed)."""
    x = np.asarray(x)
    x = np.ascontiguousarray(x, dtype=np.float32 if x.dtype == np.float32 else np.float64)
    if out is None:
        out = np.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous {x.dtype} of shape {x.shape}; got {out.dtype} {out.shape}")
    if x.size:
        (lib.sdpa_fast_expf if x.dtype == np.float32 else lib.sdpa_fast_exp)(_ptr(x), x.size, _ptr(out))
    return out


#: The SIMD builds of the compiled kernels, by level (``_fast_rows.c``: ``sdpa_fast_set_level``; one level for both files).
SIMD_LEVELS = ("baseline", "avx2", "avx512")


def _simd_level():
    """The level asked for by ``SDPA_REF_SIMD`` (a name of :data:`SIMD_LEVELS`), or -1: the best the CPU runs.
    An unknown name is an error, not a silent default."""
    name = os.environ.get("SDPA_REF_SIMD", "").strip().lower()
    if not name:
        return -1
    if name not in SIMD_LEVELS:
        raise ValueError(f"SDPA_REF_SIMD must be one of {', '.join(SIMD_LEVELS)} (or unset); got {name!r}")
    return SIMD_LEVELS.index(name)


def simd_level(lib, level=None):
    """The name of the build the compiled kernels run, the row passes and the exact loops alike
    (:data:`SIMD_LEVELS`). With ``level`` set it first: a name (a level the CPU lacks gives the best one it has),
    or ``"best"``. Every level gives the same bits; only the speed changes."""
    if level is not None:
        if level != "best" and level not in SIMD_LEVELS:
            raise ValueError(f"level must be 'best' or one of {', '.join(SIMD_LEVELS)}; got {level!r}")
        lib.sdpa_fast_set_level(-1 if level == "best" else SIMD_LEVELS.index(level))
    return SIMD_LEVELS[lib.sdpa_fast_get_level()]
