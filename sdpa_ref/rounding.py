r"""Rounding to bfloat16 and fp8, once, whatever the ``ml_dtypes`` version.

``ml_dtypes`` before 0.7 converts float64 to bfloat16 and fp8 through float32:
two roundings, so ``1 + 2**-8 + 2**-30`` becomes 1.0 (the float32 step
drops the ``2**-30`` and leaves a tie, which goes to even) where one
rounding gives 1.0078125. The golden vectors' bits would depend on a
dependency's version. :func:`round_to` is the package's one conversion of
floats to these types: round to nearest, ties to even, once, from the value
itself.

How: a float64 ``x`` with ``2**e <= |x| < 2**(e+1)`` is rounded at the
target's quantum ``q = 2**(max(e, emin) - m)`` (``m`` fraction bits, ``emin``
the least normal exponent, so subnormals get the fixed quantum ``2**(emin -
m)``): ``rint(x / q) * q``. Dividing and multiplying by a power of two is
exact in float64 (the quotient has at most ``m + 1`` bits), and ``np.rint``
rounds half to even, so the result is the correctly rounded value, exact in
float64 and in the target; the final cast to the ``ml_dtypes`` type is then
exact in every version. Past the largest finite value: ``inf`` (with the sign)
for bfloat16 and ``float8_e5m2``, NaN for ``float8_e4m3fn``, which has no
infinity (what ``ml_dtypes`` does); ``inf`` is NaN there too. NaN stays NaN,
``-0`` stays ``-0``, and a value that rounds to zero keeps its sign.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FORMATS", "is_rounded_here", "round_to"]

#: ``name: (fraction bits, least normal exponent, largest finite value, overflow gives inf)``.
FORMATS = {
    "bfloat16": (7, -126, float.fromhex("0x1.fep127"), True),
    "float8_e4m3fn": (3, -6, 448.0, False),
    "float8_e5m2": (2, -14, 57344.0, True),
}


def is_rounded_here(dtype) -> bool:
    """Whether :func:`round_to` rounds to ``dtype`` itself (one of :data:`FORMATS`, ml_dtypes' types)."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return False
    return dt.name in FORMATS and getattr(dt.type, "__module__", "").split(".")[0] == "ml_dtypes"


def round_to(x, dtype, copy=True):
    """``x`` (a real array or scalar) rounded to ``dtype`` once, to nearest, ties to even.

    For bfloat16, ``float8_e4m3fn`` and ``float8_e5m2`` (``ml_dtypes``' types) the rounding is the package's own,
    from the value widened to float64 (exact for float32 and float16); any other dtype is NumPy's ``astype``
    (correctly rounded between IEEE types). ``copy=False`` returns ``x`` itself when it is already in ``dtype``.

    Examples
    --------
    >>> import numpy as np, ml_dtypes
    >>> float(round_to(np.float64(1 + 2**-8 + 2**-30), ml_dtypes.bfloat16))   # not 1.0, as through float32
    1.0078125
    >>> round_to(np.array([464.0, 465.0, -1e300]), ml_dtypes.float8_e4m3fn).astype(float)   # no inf in e4m3fn
    array([448.,  nan,  nan])
    """
    dt = np.dtype(dtype)
    a = np.asarray(x)
    if not is_rounded_here(dt) or a.dtype == dt:
        return a.astype(dt, copy=copy)
    if a.dtype.kind not in "fiub":
        raise TypeError(f"`x` should be a real array to round to {dt.name}, but got dtype {a.dtype}")
    m, emin, fmax, has_inf = FORMATS[dt.name]
    v = a.astype(np.float64)
    with np.errstate(all="ignore"):
        finite = np.isfinite(v)
        _, e = np.frexp(np.where(finite, v, 1.0))            # v = f 2**e, 0.5 <= |f| < 1: |v| in [2**(e-1), 2**e)
        q = np.ldexp(1.0, np.maximum(e - 1, emin) - m)
        r = np.rint(np.where(finite, v, 0.0) / q) * q         # exact: a power of two's scaling, one rounding
        over = np.abs(r) > fmax
        big = np.copysign(np.inf if has_inf else np.nan, v)
        r = np.where(finite, np.where(over, big, r), np.where(np.isnan(v) | (not has_inf), np.nan, v))
    return r.astype(dt)
