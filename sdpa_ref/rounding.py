r"""Rounding to bfloat16 and fp8, once, whatever the ``ml_dtypes`` version.

``ml_dtypes`` before 0.7 converts float64 to bfloat16 and fp8 through float32:
two roundings, so ``1 + 2**-8 + 2**-30`` becomes 1.0 (the float32 step
drops the ``2**-30`` and leaves a tie, which goes to even) where one
rounding gives 1.0078125. The golden vectors' bits would depend on a
dependency's version. :func:`round_to` is the package's one conversion of
floats to these types: round to nearest, ties to even, once, from the value
itself.

How, on float64's bits (``m`` fraction bits in the target, ``emin`` its least
normal exponent): where the result is normal, the 52-bit fraction is rounded
to ``m`` bits, to nearest, ties to even (add half of the dropped part less
one, plus the last kept bit, and clear the dropped bits: a carry moves into
the exponent, as it should); below ``2**emin`` float64's own addition does
it at the target's fixed quantum ``2**(emin - m)``: ``(|x| + C) - C`` with
``C = 2**(emin - m + 52)``, whose spacing is that quantum. The result is the
correctly rounded value, exact in float64 and in the target, so the final
cast to the ``ml_dtypes`` type is exact in every version. float32 and float16
sources are cast by ``ml_dtypes`` directly: one rounding in every version
(tests/test_rounding.py checks it against the same oracle). Past the largest finite value: ``inf`` (with the sign)
for bfloat16 and ``float8_e5m2``, NaN for ``float8_e4m3fn``, which has no
infinity (what ``ml_dtypes`` does); ``inf`` is NaN there too. NaN stays NaN,
``-0`` stays ``-0``, and a value that rounds to zero keeps its sign.
"""

from __future__ import annotations

import functools

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
    return _rounded_here(dt)


@functools.lru_cache(maxsize=None)
def _rounded_here(dt):
    """:func:`is_rounded_here` of a dtype, once per dtype (``dtype.name`` costs a few microseconds a call)."""
    return dt.name in FORMATS and getattr(dt.type, "__module__", "").split(".")[0] == "ml_dtypes"


def round_to(x, dtype, copy=True):
    """``x`` (a real array or scalar) rounded to ``dtype`` once, to nearest, ties to even.

    For bfloat16, ``float8_e4m3fn`` and ``float8_e5m2`` (``ml_dtypes``' types) the rounding is the package's own
    from float64 and integers (from float32 and float16, ``ml_dtypes``' own cast: one rounding); any other dtype
    is NumPy's ``astype`` (correctly rounded between IEEE types). ``copy=False`` returns ``x`` itself when it is already in ``dtype``.

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
    if a.dtype in (np.float32, np.float16):                   # one rounding already (tested on every version)
        return a.astype(dt)
    m, emin, fmax, has_inf = FORMATS[dt.name]
    v = _exact_enough(a) if a.dtype.kind in "iu" and a.dtype.itemsize == 8 else a.astype(np.float64)
    u = v.view(np.uint64)
    sign = u & np.uint64(1 << 63)
    mag = u ^ sign
    shift = np.uint64(52 - m)                                # normal results: round the float64 fraction's bits
    r = ((mag + np.uint64((1 << (52 - m - 1)) - 1) + ((mag >> shift) & np.uint64(1))) >> shift) << shift
    with np.errstate(all="ignore"):
        av = mag.view(np.float64)
        magic = 2.0 ** (emin - m + 52)                       # subnormal results: float64's own rounding at the
        r = np.where(av < 2.0 ** emin, (av + magic) - magic, r.view(np.float64))     # target's fixed quantum
        r = np.where(r > fmax, np.inf if has_inf else np.nan, r)
        r = np.where(np.isnan(v) | (np.isinf(v) & (not has_inf)), np.nan, r)
    return (r.view(np.uint64) | sign).view(np.float64).astype(dt)


def _exact_enough(a):
    """A 64-bit integer array as float64 that rounds to any of :data:`FORMATS` as the integer itself does.

    Beyond 2**53 the cast to float64 rounds, and a second rounding to the target can turn a value just past a
    midpoint into a tie (``2**62 + 2**54 + 1`` to bfloat16 gave ``2**62``). So the magnitude's low 11 bits are
    first folded into one sticky bit (bit 11, kept set if any of them is): what is left has at most 53
    significant bits, exact in float64, and every target keeps at most 8 bits, so its kept bits, half bit and
    whether anything lies below the half bit are all unchanged."""
    neg = a < 0
    mag = np.where(neg, (~a.astype(np.uint64)) + np.uint64(1), a.astype(np.uint64)) if a.dtype.kind == "i" \
        else a.astype(np.uint64)
    low = np.uint64((1 << 11) - 1)
    big = mag >= np.uint64(1 << 53)
    folded = np.where(big & ((mag & low) != 0), (mag & ~low) | np.uint64(1 << 11), np.where(big, mag & ~low, mag))
    v = folded.astype(np.float64)
    return np.where(neg, -v, v)
