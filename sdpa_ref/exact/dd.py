r"""Double-double arithmetic on NumPy arrays, from IEEE-754 ``+ - * /`` alone.

A double-double (dd) is a pair of float64 arrays ``(hi, lo)`` whose
unevaluated sum carries about 106 bits; ``hi`` is the value rounded to
float64 (the pair is normalised, ``|lo| <= ulp(hi) / 2``), so rounding a dd
to float64 is taking ``hi``.

Every function here uses only the operations whose results IEEE 754 fixes to
the bit (``+ - * /``, comparisons, ``max``, ``frexp`` / ``ldexp``, ``rint``),
element by element, in a fixed order. NumPy applies them with SIMD or
without, on any core count, with the same result; nothing here calls the
platform's ``exp``, ``log`` or ``tanh``, whose last bits differ between
libm versions and NumPy's SIMD dispatch levels. Sums along an axis use a
fixed pairwise tree (:func:`dd_sum`), never ``np.sum``, whose order depends
on the array's layout and the build.

The building blocks are Knuth's TwoSum, Dekker's FastTwoSum and
TwoProduct by Veltkamp splitting (no fused multiply-add, which NumPy does
not expose and which not every machine has):

* ``two_sum(a, b) = (s, e)`` with ``s = fl(a + b)`` and ``s + e = a + b`` exactly;
* ``two_prod(a, b) = (p, e)`` with ``p = fl(a b)`` and ``p + e = a b`` exactly
  (for ``|a|, |b| < 2**996`` and no underflow).

Accuracy (relative, for normalised finite operands): add, multiply and divide
about ``2**-104``; :func:`dd_exp` and :func:`dd_log` about ``2**-100``
(``tests/test_engines_reproducible.py`` holds them to mpmath). Non-finite values are not
handled here; the callers keep them out (masked scores are set aside before
``exp``).
"""

from __future__ import annotations

import math

import numpy as np

from . import _native

__all__ = ["two_sum", "fast_two_sum", "two_prod", "dd", "dd_add", "dd_add_d", "dd_sub", "dd_mul", "dd_mul_d",
           "dd_div", "dd_div_d", "dd_sum", "dd_exp", "dd_log", "dd_tanh", "dd_sech2", "dd_where"]

_SPLITTER = 134217729.0                 # 2**27 + 1: Veltkamp's constant for 53-bit significands


def two_sum(a, b):
    """``(s, e)``: ``s = fl(a + b)``, ``e`` its exact rounding error (Knuth, no condition on the operands)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def fast_two_sum(a, b):
    """``(s, e)`` as :func:`two_sum` when ``|a| >= |b|`` (or ``a == 0``) (Dekker)."""
    s = a + b
    return s, b - (s - a)


def _split(a):
    c = _SPLITTER * a
    hi = c - (c - a)
    return hi, a - hi


def two_prod(a, b):
    """``(p, e)``: ``p = fl(a b)``, ``e`` its exact rounding error (Dekker's TwoProduct, Veltkamp splitting)."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def dd(x):
    """A float64 array as a dd ``(x, 0)``."""
    x = np.asarray(x, dtype=np.float64)
    return x, np.zeros_like(x)


def dd_add(a, b):
    """``a + b`` for dd ``a``, ``b`` (the accurate, IEEE-style addition)."""
    s, e = two_sum(a[0], b[0])
    t, f = two_sum(a[1], b[1])
    s, e = fast_two_sum(s, e + t)
    return fast_two_sum(s, e + f)


def dd_add_d(a, b):
    """``a + b`` for dd ``a`` and float64 ``b``."""
    s, e = two_sum(a[0], b)
    return fast_two_sum(s, e + a[1])


def dd_sub(a, b):
    return dd_add(a, (-b[0], -b[1]))


def dd_mul(a, b):
    """``a * b`` for dd ``a``, ``b``."""
    p, e = two_prod(a[0], b[0])
    return fast_two_sum(p, e + (a[0] * b[1] + a[1] * b[0]))


def dd_mul_d(a, b):
    """``a * b`` for dd ``a`` and float64 ``b``."""
    p, e = two_prod(a[0], b)
    return fast_two_sum(p, e + a[1] * b)


def dd_div(a, b):
    """``a / b`` for dd ``a``, ``b`` (two correction steps of long division)."""
    q1 = a[0] / b[0]
    r = dd_sub(a, dd_mul_d(b, q1))
    q2 = r[0] / b[0]
    r = dd_sub(r, dd_mul_d(b, q2))
    q3 = r[0] / b[0]
    q1, q2 = fast_two_sum(q1, q2)
    return dd_add_d((q1, q2), q3)


def dd_div_d(a, b):
    """``a / b`` for dd ``a`` and float64 ``b``."""
    return dd_div(a, dd(b))


def dd_where(cond, a, b):
    """Element-wise choice between dd ``a`` and ``b`` (either may be a dd of scalars)."""
    return np.where(cond, a[0], b[0]), np.where(cond, a[1], b[1])


def dd_sum(a, axis=-1, keepdims=False):
    """The sum of a dd along ``axis`` by a fixed pairwise tree: the same bits for any layout or build.

    Level by level, the first half of the remaining entries is added to the
    second half (an odd last entry waits for the next level), so the order
    depends on the length of the axis alone.
    """
    hi, lo = np.moveaxis(a[0], axis, -1), np.moveaxis(a[1], axis, -1)
    if hi.shape[-1] == 0:
        hi, lo = np.zeros(hi.shape[:-1] + (1,)), np.zeros(hi.shape[:-1] + (1,))
    while hi.shape[-1] > 1:
        n = hi.shape[-1]
        h = n // 2
        s = dd_add((hi[..., :h], lo[..., :h]), (hi[..., h:2 * h], lo[..., h:2 * h]))
        if n % 2:
            s = (np.concatenate([s[0], hi[..., -1:]], axis=-1), np.concatenate([s[1], lo[..., -1:]], axis=-1))
        hi, lo = s
    if keepdims:
        return np.moveaxis(hi, -1, axis), np.moveaxis(lo, -1, axis)
    return hi[..., 0], lo[..., 0]


# ----------------------------------------------------------- constants


_LN2 = (float.fromhex("0x1.62e42fefa39efp-1"), float.fromhex("0x1.abc9e3b39803fp-56"),
        float.fromhex("0x1.7b57a079a1934p-111"))          # ln 2 to 159 bits
_TABLE_BITS = 10                                           # exp's table of 2**(j/1024)
_N = 1 << _TABLE_BITS
#: ln2 / 1024 in three parts; the first has 31 significant bits so that ``k * part`` is exact for |k| < 2**22.
_C1 = math.ldexp(math.floor(math.ldexp(_LN2[0], 31)), -31) / _N
_C23 = dd_add_d((np.float64(_LN2[0] / _N - _C1), np.float64(_LN2[1] / _N)), np.float64(_LN2[2] / _N))
#: 1/n! as dd, n = 0..12.
_INV_FACT = []
_f = 1.0
for _n in range(13):
    _f = _f * max(_n, 1)                                   # exact: 12! < 2**53
    _INV_FACT.append(dd_div_d(dd(np.float64(1.0)), np.float64(_f)))
del _f, _n

#: Below this, ``exp`` is 0 in float64 (and a fortiori in dd); the argument is clamped there.
EXP_FLOOR = -760.0


def _exp_small(r):
    """``exp(r)`` for dd ``|r| <= ln2/2048`` by its Taylor polynomial to degree 8 (error about ``2**-103``).

    The terms of degree 4 and up are below ``2**-50`` relative: their sum is
    formed in float64 and joins the double-double Horner steps of degrees 3..0.
    """
    t = _INV_FACT[8][0]
    for n in range(7, 3, -1):
        t = t * r[0] + _INV_FACT[n][0]
    p = dd_mul_d(r, t)                                     # r (1/4! + r/5! + ...)
    for n in range(3, 0, -1):
        p = dd_mul(r, dd_add(_INV_FACT[n], p))             # r (1/n! + p)
    return dd_add_d(p, 1.0)


def _inv_fact_dd(n):
    """``1/n!`` as dd for any n (the table holds n <= 12)."""
    if n < len(_INV_FACT):
        return _INV_FACT[n]
    r = _INV_FACT[12]
    for i in range(13, n + 1):
        r = dd_div_d(r, np.float64(i))
    return r


def _exp_table():
    """``2**(j/1024)`` as dd, j = 0..1023, from the Taylor series of ``exp`` to degree 32 (``j ln2 / 1024 < 0.7``)."""
    j = np.arange(_N, dtype=np.float64)
    r = dd_mul_d((np.float64(_LN2[0]), np.float64(_LN2[1])), j / _N)
    p = dd(np.zeros_like(j))
    for n in range(32, -1, -1):
        p = dd_add(_inv_fact_dd(n), dd_mul(r, p))
    return p


_TABLE = tuple(np.ascontiguousarray(t) for t in _exp_table())
#: dd_exp's constants for the compiled loop: EXP_FLOOR, N / ln2, C1, C23, then 1/m! as dd for m = 0..8.
_EXP_CONSTS = np.array([EXP_FLOOR, _N / _LN2[0], _C1, float(_C23[0]), float(_C23[1])]
                       + [float(v) for m in range(9) for v in _INV_FACT[m]])


def pow2(n):
    """``2.0 ** n`` for integer arrays ``n`` in ``[-1022, 1023]``, built from the exponent bits (exact, and
    cheaper than ``np.ldexp``; multiplying by it is ``ldexp`` with the same rounding)."""
    return ((np.asarray(n, dtype=np.int64) + 1023) << 52).view(np.float64)


def dd_exp(x):
    """``exp(x)`` for a dd ``x`` (clamped below at :data:`EXP_FLOOR`, where it is 0; ``inf`` from 710, NaN for NaN).

    ``x = k ln2 / 1024 + r`` with ``|r| <= ln2/2048``;
    ``exp(x) = 2**(k // 1024) * 2**((k % 1024)/1024) * exp(r)``,
    the table entry and ``exp(r)`` as dd. Relative error about ``2**-101`` while the result is normal.
    """
    lib = _native.kernels()
    if lib is not None:                                    # the same operations, compiled (_kernels.c)
        return _native.dd_exp(lib, x, _TABLE, _EXP_CONSTS)
    return _dd_exp_numpy(x)


def _dd_exp_numpy(x):
    """:func:`dd_exp` in NumPy: the definition, and what runs without the compiled kernels."""
    inside = x[0] >= EXP_FLOOR
    hi = np.minimum(np.maximum(np.where(np.isnan(x[0]), 0.0, x[0]), EXP_FLOOR), 710.0)   # NaN, >= 710: below
    lo = x[1] * inside
    k = np.rint(hi * (_N / _LN2[0]))
    r = dd_add_d((hi, lo), -(k * _C1))                     # k * _C1 is exact
    r = dd_sub(r, dd_mul_d(_C23, k))
    ki = k.astype(np.int64)
    j = ki & (_N - 1)
    e = dd_mul((_TABLE[0][j], _TABLE[1][j]), _exp_small(r))
    sh = (ki - j) >> _TABLE_BITS
    # two exact steps of 2**(sh/2): a deeply negative exponent never leaves the normal range in the first
    h1 = sh // 2
    f1, f2 = pow2(h1), pow2(sh - h1) * inside               # 0 below the floor
    hi, lo = e[0] * f1 * f2, e[1] * f1 * f2
    over, nan = x[0] >= 710.0, np.isnan(x[0])
    if over.any() or nan.any():                            # exp overflows from 709.79; NaN stays NaN
        hi, lo = np.where(over, np.inf, np.where(nan, np.nan, hi)), np.where(over, 0.0, np.where(nan, np.nan, lo))
    return hi, lo


#: 1/d as dd for odd d = 1..45: the coefficients of 2 atanh(z) / z.
_INV_ODD = {d: dd_div_d(dd(np.float64(1.0)), np.float64(d)) for d in range(1, 46, 2)}


def dd_log(x):
    """``log(x)`` for a dd ``x`` of finite positive entries (about ``2**-102`` absolute near 1, relative elsewhere).

    ``x = 2**k f`` with ``f`` in ``[sqrt(1/2), sqrt(2))``;
    ``log f = 2 atanh(z) = 2 (z + z**3/3 + z**5/5 + ...)``, ``z = (f - 1) / (f + 1)``,
    ``|z| < 0.172``: 23 terms reach ``2**-112``.
    """
    m, k = np.frexp(x[0])                                  # x.hi = m 2**k, m in [0.5, 1)
    k = np.where(m < np.sqrt(0.5), k - 1, k)
    f = (np.ldexp(x[0], -k), np.ldexp(x[1], -k))
    z = dd_div(dd_add_d(f, -1.0), dd_add_d(f, 1.0))
    z2 = dd_mul(z, z)
    s = _INV_ODD[45]
    for d in range(43, 0, -2):
        s = dd_add(_INV_ODD[d], dd_mul(z2, s))
    s = dd_mul(z, s)
    kf = k.astype(np.float64)                              # |k| <= 1075: k * ln2's parts are exact products
    kl = dd_add(dd_mul_d((np.float64(_LN2[0]), np.float64(_LN2[1])), kf), dd(kf * _LN2[2]))
    return dd_add(kl, (2.0 * s[0], 2.0 * s[1]))


def dd_tanh(x):
    """``tanh(x)`` for a dd ``x`` of finite entries (about ``2**-100`` relative).

    ``tanh|x| = (1 - e) / (1 + e)``, ``e = exp(-2|x|)``, with ``1 - e`` from
    the series of ``-expm1(-y)`` below ``|x| = 2**-4`` (where ``1 - e`` would
    cancel); the sign is put back at the end (tanh is odd).
    """
    sign = np.where(x[0] < 0, -1.0, 1.0)
    a = (x[0] * sign, x[1] * sign)
    big = a[0] > 40.0                                      # tanh = 1 to far below 2**-106
    y = (np.where(big, 0.0, 2.0 * a[0]), np.where(big, 0.0, 2.0 * a[1]))
    e = dd_exp((-y[0], -y[1]))
    one_minus_e = dd_add_d((-e[0], -e[1]), 1.0)
    small = a[0] < 0.0625
    if np.any(small):                                      # 1 - e^-y = y (1/1! - y (1/2! - y (1/3! - ...)))
        t = dd(np.zeros_like(y[0]))
        for n in range(24, 0, -1):                         # (1/8)**24 / 24! is far below 2**-106
            t = dd_sub(_inv_fact_dd(n), dd_mul(y, t))
        one_minus_e = dd_where(small, dd_mul(y, t), one_minus_e)
    r = dd_div(one_minus_e, dd_add_d(e, 1.0))
    r = dd_where(big, dd(np.ones_like(x[0])), r)
    return r[0] * sign, r[1] * sign


def dd_sech2(x):
    r"""``sech^2(x) = 1 - tanh^2(x)`` for a dd ``x`` (about ``2**-100`` relative, for every ``x``; ``+-inf`` gives 0).

    ``1 - tanh^2`` cancels: once ``|x|`` is a few units, ``tanh^2`` is 1 to
    within its own rounding, which then is all of the difference. Instead,
    with ``e = exp(-2|x|)`` (in ``(0, 1]``, no cancellation),

    .. math:: \operatorname{sech}^2 x = \frac{4}{(e^{x} + e^{-x})^2} = \frac{4 e}{(1 + e)^2},

    a product and quotient of positive terms: each step adds a relative
    ``2**-104`` or so. From ``|x| = 400`` the result is below the float64
    range (``4 e^{-800}``), and 0.
    """
    a = np.abs(x[0])
    big = ~(a <= 400.0)                                    # also NaN: the callers keep NaN out
    sign = np.where(x[0] < 0, -2.0, 2.0)
    y = (np.where(big, 0.0, x[0] * sign), np.where(big, 0.0, x[1] * sign))      # 2|x|
    e = dd_exp((-y[0], -y[1]))
    one_e = dd_add_d(e, 1.0)
    r = dd_div((4.0 * e[0], 4.0 * e[1]), dd_mul(one_e, one_e))
    return np.where(big, 0.0, r[0]), np.where(big, 0.0, r[1])
