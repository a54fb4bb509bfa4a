r"""The two arithmetics of ``precision="reproducible"``: one interface, so the engine is written once.

:class:`DoubleDouble` (float64 compute): values are dd pairs ``(hi, lo)``
(:mod:`.dd`), products exact by the Ozaki scheme (:mod:`.ozaki`), results
rounded to float64 once, at the end: faithfully rounded.

:class:`LowPrecision` (``upcast=False``, in float64, float32 or float16): values are
arrays of that dtype and every operation rounds to it, as a kernel working
in that precision would; what makes it reproducible is the order. Matrix
products and row sums accumulate in float32, as half-precision kernels do,
(float64 in float64) by a fixed pairwise tree, and are rounded to the dtype once (float16
products are exact in float32); ``exp``, ``log`` and ``tanh`` are the
double-double ones rounded to the dtype (so faithfully rounded themselves);
every other operation is rounded to the dtype. NumPy's float16 and float32
``+ - * /`` are IEEE-754 operations, with or without SIMD (float16 goes
through float32, whose 24 bits make that one correct rounding).

Both give the same bits on every machine, thread count, BLAS and SIMD level.
"""

from __future__ import annotations

import math

import numpy as np

from . import _native, ozaki
from .dd import (_EXP_CONSTS, _TABLE, dd, dd_add, dd_add_d, dd_div, dd_exp, dd_log, dd_mul, dd_mul_d, dd_sech2,
                 dd_sub, dd_sum, dd_tanh, two_prod, two_sum)

__all__ = ["DoubleDouble", "LowPrecision", "for_problem"]


def for_problem(prob):
    """The arithmetic of a problem: double-double for float64 compute with ``upcast=True`` (the default),
    otherwise the honest one of its compute dtype (``upcast=False``: float64 too)."""
    if prob.dtype == np.float64 and prob.options.upcast:
        return DoubleDouble()
    return LowPrecision(prob.dtype)


class DoubleDouble:
    """float64 compute in double-double: about 100 bits in every intermediate."""

    dtype = np.dtype(np.float64)

    # -- storage
    def empty(self, shape):
        return np.empty(shape), np.empty(shape)

    def at(self, a, ix):
        return a[0][ix], a[1][ix]

    def put(self, dst, ix, v):
        dst[0][ix], dst[1][ix] = v

    def const(self, x):
        return dd(np.float64(x))

    def value(self, a):
        """The float64 value (``hi``): for comparisons, maxima, and the result."""
        return a[0]

    # -- element-wise (the compiled loops of ._native where they apply: the same operations, the same bits)
    add, sub, mul = staticmethod(dd_add), staticmethod(dd_sub), staticmethod(dd_mul)

    def add_d(self, a, b):
        """``a + b`` for the float64 ``b``; where it overflows, IEEE's ``+-inf`` (TwoSum's error would be NaN)."""
        r = dd_add_d(a, b)
        over = ~np.isfinite(r[0])
        if over.any():
            r = np.where(over, a[0] + b, r[0]), np.where(over, 0.0, r[1])
        return r
    exp, log, tanh = staticmethod(dd_exp), staticmethod(dd_log), staticmethod(dd_tanh)

    def div(self, a, b):
        lib = _native.kernels()
        if lib is not None and np.ndim(b[0]) >= 1 and np.shape(b[0])[-1] == 1 and np.ndim(a[0]) >= 1 \
                and np.ndim(b[0]) <= np.ndim(a[0]):                 # by one divisor per row
            return _native.dd_div_rows(lib, a, b)
        return dd_div(a, b)

    def mul_d(self, a, b):
        lib = _native.kernels()
        if lib is not None and np.ndim(b) == 0:
            return _native.dd_mul_d_scalar(lib, a, b)
        return dd_mul_d(a, b)

    def exp_minus(self, a, m):
        """``exp(a - m)`` for the row's ``m`` ``(..., 1)``."""
        lib = _native.kernels()
        if lib is not None and np.ndim(a[0]) >= 1:
            return _native.dd_exp(lib, a, _TABLE, _EXP_CONSTS, m=m)
        return dd_exp(dd_sub(a, m))

    def lift(self, x):
        return dd(np.asarray(x, dtype=np.float64))

    def row_max(self, T, excluded):
        """``(m, empty, over)``: each row's largest allowed value as a dd (its ``hi``, then the largest ``lo``
        among the entries with that ``hi``: then ``T - m <= 0`` exactly, however large ``T``), 0 on rows
        with none (``empty``) or whose largest is ``+inf`` or NaN (``over``)."""
        hi = T[0] if excluded is None else np.where(excluded, -np.inf, T[0])
        mh = np.max(hi, axis=-1, keepdims=True, initial=-np.inf)
        ml = np.max(np.where(hi == mh, T[1], -np.inf), axis=-1, keepdims=True, initial=-np.inf)
        empty = mh == -np.inf
        bad = empty | ~np.isfinite(mh)
        return (np.where(bad, 0.0, mh), np.where(bad | ~np.isfinite(ml), 0.0, ml)), empty, bad & ~empty

    def elementwise(self, f, x):
        """A NumPy element-wise map (a score function) on the float64 values: ``f`` of each ``hi`` (the score
        rounded to float64), its float64 result taken as exact (``lo = 0``), so that everything after it is
        the exact arithmetic's; the map's own rounding is its own."""
        with np.errstate(all="ignore"):
            y = np.array(f(x[0]), dtype=np.float64)
        return y, np.zeros_like(y)

    def exact_product(self, a, b):
        """``a * b`` of two float64 arrays, exactly; ``(+-inf, 0)`` where it overflows.

        Dekker's product splits its operands, which overflows from about ``2**996``: an operand that large
        (an ALiBi slope of ``1e308``) is scaled by ``2**-128`` first and the exact pair scaled back.
        """
        a, b = np.broadcast_arrays(np.asarray(a, np.float64), np.asarray(b, np.float64))
        big = np.abs(a) > 2.0 ** 990
        if not big.any():
            return two_prod(a, b)
        p, e = two_prod(np.where(big, a * 2.0 ** -128, a), b)
        f = np.where(big, 2.0 ** 128, 1.0)
        p, e = p * f, e * f
        return p, np.where(np.isfinite(p), e, 0.0)

    def clamp(self, a, limit):
        """``a`` with every entry beyond ``+-limit`` (a float, or inf: none) set to ``+-limit``."""
        out = np.abs(a[0]) > limit
        if not out.any():
            return a
        return np.where(out, np.copysign(limit, a[0]), a[0]), np.where(out, 0.0, a[1])

    def sech2(self, x, t):
        """``sech^2(x) = 1 - tanh^2(x)`` without cancellation (:func:`.dd.dd_sech2`; ``t = tanh(x)`` unused)."""
        return dd_sech2(x)

    def neg(self, a):
        return -a[0], -a[1]

    def where(self, cond, a, b):
        return np.where(cond, a[0], b[0]), np.where(cond, a[1], b[1])

    def take(self, a, idx):
        return np.take_along_axis(a[0], idx, -1), np.take_along_axis(a[1], idx, -1)

    def div_masked(self, x, keep, a, b):
        """``x * Z / (a + b)`` for the bool mask ``Z`` (``keep``) and two floats ``a``, ``b``: their sum exact
        (TwoSum), the quotient a dd, then the mask applied by a multiply (a NaN stays NaN where ``Z`` is 0)."""
        q = dd_div(x, two_sum(np.float64(a), np.float64(b)))
        return q[0] * keep, q[1] * keep

    # -- reductions and products
    def sum(self, a, axis=-1, keepdims=False):
        lib = _native.kernels()
        if lib is not None and axis in (-1, np.ndim(a[0]) - 1) and np.ndim(a[0]) >= 1:
            return _native.dd_rowsum(lib, a, keepdims=keepdims)    # the same tree, compiled
        return dd_sum(a, axis=axis, keepdims=keepdims)

    def softmax_vjp_rows(self, P, g):
        """The pivoted softmax VJP compiled (:mod:`._native`), or None: then the engine's own NumPy form runs."""
        lib = _native.kernels()
        return None if lib is None else _native.softmax_vjp_rows(lib, P, g)

    def matmul(self, A, B, final=False, scale=None, spans=None, contract=None, out=None):
        """``A @ B`` exactly, rounded to a dd (:func:`.ozaki.matmul`; times the float ``scale``; ``spans``: the
        columns wanted in each row, ``+0`` elsewhere; ``contract``: where each row of ``A`` may be nonzero;
        ``out``: a dd workspace of the result's shape to write it to)."""
        return ozaki.matmul(A, B, final=final, scale=scale, spans=spans, contract=contract, out=out)

    def reshape(self, a, shape):
        return a[0].reshape(shape), a[1].reshape(shape)

    def recip(self, n):
        """``1/n`` for positive ``n`` (a count, or an array of counts) to about 100 bits: ``fl(1/n)`` with the low
        half of the double-double quotient."""
        n = np.asarray(n, np.float64)
        return 1.0 / n, dd_div(dd(np.ones_like(n)), dd(n))[1]


class LowPrecision:
    """Every operation rounded to ``dtype`` (float32 or float16), in a fixed order."""

    #: Products formed at once by :meth:`matmul` (per block of rows).
    BLOCK = 1 << 20

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self._t = self.dtype.type
        self._work = np.dtype(np.float64 if self.dtype == np.float64 else np.float32)   # products and sums

    def empty(self, shape):
        return np.empty(shape, self.dtype)

    def at(self, a, ix):
        return a[ix]

    def put(self, dst, ix, v):
        dst[ix] = v

    def const(self, x):
        return self._t(x)

    def value(self, a):
        return a

    def lift(self, x):
        return np.asarray(x).astype(self.dtype)

    def row_max(self, T, excluded):
        """``(m, empty, over)``: each row's largest allowed value, 0 on rows with none (``empty``) or whose
        largest is ``+inf`` or NaN (``over``)."""
        v = T if excluded is None else np.where(excluded, -np.inf, T)
        m = np.max(v, axis=-1, keepdims=True, initial=-np.inf)
        empty = m == -np.inf
        bad = empty | ~np.isfinite(m)
        return np.where(bad, 0, m).astype(self.dtype), empty, bad & ~empty

    def add(self, a, b):
        return a + b

    def sub(self, a, b):
        return a - b

    def mul(self, a, b):
        return a * b

    def div(self, a, b):
        return a / b

    def add_d(self, a, b):
        return a + np.asarray(b).astype(self.dtype)

    def mul_d(self, a, b):
        return a * np.asarray(b).astype(self.dtype)

    def _rounded(self, f, x):
        with np.errstate(all="ignore"):
            return f(dd(np.asarray(x, dtype=np.float64)))[0].astype(self.dtype)

    def exp(self, x):
        return self._rounded(dd_exp, x)

    def exp_minus(self, a, m):
        """``exp(a - m)`` for the row's ``m``."""
        return self.exp(self.sub(a, m))

    def log(self, x):
        return self._rounded(dd_log, x)

    def tanh(self, x):
        return self._rounded(dd_tanh, x)

    def elementwise(self, f, x):
        """A NumPy element-wise map (a score function) as a kernel computes it in this dtype: on the values
        (float32 for the narrower dtypes, as kernels widen them), rounded to the dtype once."""
        w = np.float32 if self.dtype.itemsize < 4 else self.dtype
        with np.errstate(all="ignore"):
            return np.asarray(f(np.asarray(x).astype(w))).astype(self.dtype)

    def exact_product(self, a, b):
        """``fl(a * b)`` in the dtype (the name is the double-double's; here one rounding)."""
        return np.asarray(a).astype(self.dtype) * np.asarray(b).astype(self.dtype)

    def clamp(self, a, limit):
        """``a`` with every entry beyond ``+-limit`` set to ``+-limit`` (in the dtype: it may round)."""
        return np.clip(a, -limit, limit).astype(self.dtype, copy=False)

    def sech2(self, x, t):
        """``1 - t^2`` in the dtype, as a kernel in that precision computes softcap's derivative from its
        ``tanh`` (it cancels on saturated entries): this arithmetic stands for such a kernel, and is the
        relative rule's plain same-precision baseline, not a reference."""
        return self._t(1) - t * t

    def neg(self, a):
        return -a

    def where(self, cond, a, b):
        return np.where(cond, a, b).astype(self.dtype, copy=False)

    def recip(self, n):
        """``1/n`` for positive ``n`` (a count, or an array of counts): the float64 quotient rounded to the dtype."""
        return self._t(1.0 / np.asarray(n, np.float64))

    def take(self, a, idx):
        return np.take_along_axis(a, idx, -1)

    def div_masked(self, x, keep, a, b):
        """``x * (Z * (1 / (a + b)))`` for the bool mask ``Z`` (``keep``) and two floats ``a``, ``b``: the factor
        rounded once to the dtype, as a kernel scales by a reciprocal, then one multiply (a NaN stays NaN where
        ``Z`` is 0); the NumPy arithmetic's :meth:`sdpa_ref.arith.NumPyArith.div_masked`."""
        return np.multiply(x, keep * x.real.dtype.type(1.0 / (a + b)))

    def sum(self, a, axis=-1, keepdims=False):
        """A fixed pairwise tree along ``axis`` in the accumulation dtype, rounded once to the dtype."""
        x = np.moveaxis(np.asarray(a, self.dtype), axis, -1)
        if x.shape[-1] == 0:
            x = np.zeros(x.shape[:-1] + (1,), self.dtype)
        x = self._tree(x.astype(self._work))
        return np.moveaxis(x, -1, axis) if keepdims else x[..., 0]

    def _tree(self, x):
        """The pairwise tree on the last axis of ``x``, in the accumulation dtype (float32; float64 for
        float64), then rounded once to ``dtype``: half-precision kernels accumulate in float32."""
        while x.shape[-1] > 1:
            n, h = x.shape[-1], x.shape[-1] // 2
            s = x[..., :h] + x[..., h:2 * h]
            x = np.concatenate([s, x[..., -1:]], axis=-1) if n % 2 else s
        return x.astype(self.dtype)

    def matmul(self, A, B, final=False, scale=None, spans=None, contract=None):
        """``sum_k A_ik B_kj`` with products and the fixed tree of :meth:`sum` in the accumulation dtype,
        rounded once to the dtype (float16 products are exact in float32), in blocks of rows; then times
        ``scale`` (rounded to the dtype), rounded again. ``spans``: ``(start, stop)`` per row of ``A``, the
        columns wanted (a block of rows forms the union of its rows'; ``+0`` elsewhere), each the same value.
        ``contract`` (where each row of ``A`` may be nonzero) changes nothing here: the tree pairs the terms by
        their position, so leaving the zero ones out would pair the others otherwise, and round them otherwise."""
        A, B = np.asarray(A, self.dtype), np.asarray(B, self.dtype)
        K = A.shape[-1]
        shape = np.broadcast_shapes(A.shape[:-2], B.shape[:-2]) + (A.shape[-2], B.shape[-1])
        M, N = shape[-2], shape[-1]
        nb = math.prod(shape[:-2])                                 # not -1: ambiguous when M, K or N is 0
        A2 = np.broadcast_to(A, shape[:-2] + (M, K)).reshape(nb, M, K).astype(self._work)
        B2 = np.broadcast_to(B, shape[:-2] + (K, N)).reshape(nb, K, N).astype(self._work)
        out = np.zeros((A2.shape[0], M, N), self.dtype)
        rows = max(1, self.BLOCK // max(K * N, 1))
        if K:
            for b in range(A2.shape[0]):
                for m0 in range(0, M, rows):
                    n0, n1 = (0, N) if spans is None else \
                        (int(np.min(spans[0][m0:m0 + rows])), int(np.max(spans[1][m0:m0 + rows])))
                    if n1 > n0:
                        prod = A2[b, m0:m0 + rows, None, :] * np.swapaxes(B2[b, :, n0:n1], 0, 1)[None]  # (rows, n, K)
                        out[b, m0:m0 + rows, n0:n1] = self._tree(prod)[..., 0]
        out = out.reshape(shape)
        return out if scale is None else out * self._t(scale)

    def reshape(self, a, shape):
        return a.reshape(shape)
