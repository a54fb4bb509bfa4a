"""The test dtypes of the harness: NumPy's floats, and bfloat16 and fp8 through ``ml_dtypes``.

``ml_dtypes`` (the extension JAX uses for these types) is an optional extra,
``pip install "sdpa_ref[lowp]"``: ``import sdpa_ref`` never imports it, and
only a harness call that names ``bfloat16``, ``float8_e4m3fn`` or
``float8_e5m2`` needs it. Why an extra and not a dependency: the reference
itself computes in float64 (and float32 / float16 with ``upcast=False``);
the low-precision types matter only to judge a kernel, and a CI job that
checks gradients should not download a compiled extension it never uses.
Without it, naming such a dtype is a one-line error that says what to
install.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LOW_DTYPES", "TEST_DTYPES", "as_test_dtype", "finfo", "is_low", "ulp", "widen", "work_dtype"]

#: The dtypes that need ``ml_dtypes``.
LOW_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
#: Every dtype the harness can judge at.
TEST_DTYPES = ("float64", "float32", "float16") + LOW_DTYPES


def _ml_dtypes(what):
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(f"{what} needs the ml_dtypes package: pip install \"sdpa_ref[lowp]\" "
                          "(or pip install ml_dtypes)") from None
    return ml_dtypes


def as_test_dtype(d, name="dtypes"):
    """``d`` (a name, a NumPy dtype or scalar type, an ml_dtypes type) as a NumPy dtype of :data:`TEST_DTYPES`."""
    if isinstance(d, str) and d in LOW_DTYPES:
        return np.dtype(getattr(_ml_dtypes(f"`{name}` {d!r}"), d))
    try:
        dt = np.dtype(d)
    except TypeError:
        dt = None
    if dt is None or dt.name not in TEST_DTYPES:
        raise TypeError(f"`{name}` should name dtypes of {TEST_DTYPES} (a name, a NumPy or ml_dtypes type), "
                        f"but got {d!r}")
    return dt


def is_low(dt):
    """Whether ``dt`` is one of the ml_dtypes types (bfloat16, fp8)."""
    return np.dtype(dt).name in LOW_DTYPES


def work_dtype(dt):
    """The accumulation dtype of an honest kernel at ``dt``: float64 for float64, float32 below."""
    return np.dtype(np.float64 if np.dtype(dt) == np.float64 else np.float32)


def finfo(dt):
    """``np.finfo`` for NumPy's floats, ``ml_dtypes.finfo`` for the others."""
    dt = np.dtype(dt)
    return _ml_dtypes(dt.name).finfo(dt) if is_low(dt) else np.finfo(dt)


def ulp(x, dt):
    """The spacing of ``dt`` at ``|x|`` (float64 array): ``2**(exponent - fraction bits)``, the subnormal spacing
    below the normal range; like ``np.spacing`` in ``dt``, for every test dtype."""
    fi = finfo(dt)
    a = np.abs(np.asarray(x, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(a))                              # -inf at 0: the subnormal spacing below
    e = np.maximum(np.where(np.isnan(e) | (e == np.inf), 0.0, e), float(fi.minexp))
    return np.ldexp(1.0, (e - fi.nmant).astype(int))


def widen(inputs, dtype=np.float64):
    """``inputs`` (a dict of keyword arguments) with every float array in ``dtype``; bool and integer arrays
    (masks, lengths) and other values as they are. The values of every test dtype are exact in float64 (and
    those of bfloat16 and fp8 in float32), so this changes the type the engines accept, not the problem."""
    return {n: (a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype.kind not in "biu" else a)
            for n, a in inputs.items()}
