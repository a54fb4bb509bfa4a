"""The test dtypes of the harness: NumPy's floats, and bfloat16 and fp8 through ``ml_dtypes``.

``ml_dtypes`` (the extension JAX uses for these types) is an optional extra,
``lowp`` (``python -m pip install ml_dtypes``, or ``".[lowp]"`` from a
clone): ``import sdpa_ref`` never imports it, and
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

from ..exact.arith import LowPrecision
from ..rounding import round_to

__all__ = ["DESCALES", "LOW_DTYPES", "LibmLowPrecision", "MemberArith", "TEST_DTYPES", "as_test_dtype", "dequantized",
           "finfo", "is_fp8", "is_low", "output_dtype", "quantize", "tf32", "ulp", "widen", "work_dtype"]

#: The dtypes that need ``ml_dtypes``.
LOW_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
#: Every dtype the harness can judge at.
TEST_DTYPES = ("float64", "float32", "float16") + LOW_DTYPES


def _ml_dtypes(what):
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(f"{what} needs the ml_dtypes package (the lowp extra): python -m pip install ml_dtypes"
                          ) from None
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


# ------------------------------------------------------------------ fp8: descales and the output dtype

#: The per-(batch, kv-head) factors an fp8 kernel takes, as FlashAttention 3's ``q_descale`` and friends.
DESCALES = ("q_descale", "k_descale", "v_descale")


def is_fp8(dt):
    return np.dtype(dt).name.startswith("float8")


def output_dtype(dt):
    """What a kernel at ``dt`` returns: ``dt`` itself, bfloat16 for fp8 (FlashAttention 3's fp8 forward)."""
    dt = np.dtype(dt)
    return np.dtype(_ml_dtypes("fp8").bfloat16) if is_fp8(dt) else dt


def quantize(x, dt, hkv):
    """``(x8, descale)``: ``x`` ``(*batch, H, n, d)`` in float64 quantized to the fp8 ``dt`` with one float32 factor
    per ``(*batch, kv-head)`` (``H`` is a multiple of ``hkv``: a GQA group shares its factor), so that the group's
    largest entry lands on the format's largest value; ``x8 * descale`` is the problem's value."""
    fmax = float(finfo(dt).max)
    g = x.reshape(x.shape[:-3] + (hkv, x.shape[-3] // hkv) + x.shape[-2:])
    d = (np.abs(g).max(axis=(-3, -2, -1), initial=0.0) / fmax).astype(np.float32)
    d = np.where(d > 0, d, np.float32(1.0))
    x8 = round_to((g / d[..., None, None, None].astype(np.float64)).reshape(x.shape), dt)
    return x8, d


def dequantized(inputs):
    """The keyword arguments of the problem itself, in float64: ``widen(inputs)`` with ``query``, ``key`` and
    ``value`` multiplied by their descales (exact: 4 by 24 bits), which are dropped; without descales just
    :func:`widen`."""
    x = widen(inputs)
    if not any(n in x for n in DESCALES):
        return x
    hkv = np.shape(x["key"])[-3]
    for name, d in (("query", "q_descale"), ("key", "k_descale"), ("value", "v_descale")):
        a, s = x[name], np.asarray(x.pop(d), np.float64)
        g = a.reshape(a.shape[:-3] + (hkv, a.shape[-3] // hkv) + a.shape[-2:])
        x[name] = (g * s[..., None, None, None]).reshape(a.shape)
    return x


def tf32(x):
    """float32 values rounded (to nearest, ties away) to TF32's 10-bit fraction."""
    b = np.asarray(x, np.float32).view(np.uint32)
    return ((b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


class MemberArith:
    """An honest member's arithmetic (:mod:`.ensemble`) in the interface of :mod:`sdpa_ref.arith`: the stages it
    shares with the engines (:func:`sdpa_ref.normalize.row_stats`, :func:`sdpa_ref.lse.combine_in`,
    :func:`sdpa_ref.normalize.close_in`, :func:`sdpa_ref.normalize.lse_in`, :func:`sdpa_ref.normalize.vjp_delta_in`,
    :func:`sdpa_ref.normalize.extra_probs_in`) run over it with the member's knobs.

    Values are arrays of the work dtype (:func:`work_dtype` of the test dtype ``dt``), every operation rounded to
    it. The knobs of ``member`` (a :class:`~.ensemble.Member`) live in four operations:

    * :meth:`matmul` -- products accumulated in the work dtype by the fixed pairwise tree (``order="tree"``) or
      one multiply-add after another (``"fma"``), or by ``np.matmul`` (``arith="blas"``); inputs rounded to TF32
      first (``tf32``);
    * :meth:`sum` -- a row sum in the same order (``np.cumsum`` for ``"fma"``, sequential by definition;
      ``np.sum`` for ``"blas"``); a sum along another axis is the fixed tree;
    * :meth:`exp` -- the double-double ``exp`` rounded (NumPy's for ``"blas"``), off by up to ``exp_ulps`` ulp
      in a fixed pattern drawn from the argument's bits and the member's name;
    * :meth:`div` -- a division, or a product with the rounded reciprocal (``recip``).

    ``base`` is the plain low precision (:class:`~sdpa_ref.exact.arith.LowPrecision`; its ``tanh`` NumPy's for
    ``"blas"``, :class:`LibmLowPrecision`): the score transforms and the sums over rows, heads and the batch
    (a gradient's reduction after the kernel's) run in it.
    """

    def __init__(self, member, dt):
        self.m = member
        self.dtype = work_dtype(dt)
        self.base = LibmLowPrecision(self.dtype) if member.arith == "blas" else LowPrecision(self.dtype)
        self._salt = np.uint64(sum(map(ord, member.name)) * 2 + 1)   # each member its own pattern of exp errors

    def value(self, a):
        return a

    def const(self, x):
        return self.dtype.type(x)

    def lift(self, x):
        return np.asarray(x).astype(self.dtype)

    def where(self, cond, a, b):
        return self.lift(np.where(cond, a, b))

    def add(self, a, b):
        return self.lift(a + b)

    def sub(self, a, b):
        return self.lift(a - b)

    def mul(self, a, b):
        return self.lift(a * b)

    def neg(self, a):
        return -a

    def div(self, a, b):
        """``a / b``, or ``a`` times the reciprocal of ``b`` rounded (``recip``)."""
        return self.lift(a * self.lift(self.dtype.type(1) / b)) if self.m.recip else self.lift(a / b)

    def exp(self, x):
        """``exp(x)`` rounded to the work dtype; off by up to ``exp_ulps`` ulp in a fixed pattern."""
        x = self.lift(x)
        e = np.exp(x) if self.m.arith == "blas" else self.base.exp(x)
        if self.m.exp_ulps:                   # a deterministic error of up to exp_ulps ulp, from the bits of x
            bits = np.asarray(x).view(np.uint32 if self.dtype == np.float32 else np.uint64).astype(np.uint64)
            u = ((bits * np.uint64(2654435761) * self._salt) % np.uint64(65536)).astype(np.float64) / 32768.0 - 1.0
            e = self.lift(e * (1.0 + self.m.exp_ulps * np.finfo(self.dtype).eps * u))
        return e

    def exp_minus(self, a, m):
        """``exp(a - m)``, the difference rounded first."""
        return self.exp(self.lift(a - m))

    def log(self, x):
        return self.lift(np.log(self.lift(x))) if self.m.arith == "blas" else self.base.log(self.lift(x))

    def sum(self, a, axis=-1, keepdims=False):
        """Along the last axis in the member's order (above); along another axis by the fixed tree."""
        x = self.lift(a)
        if axis not in (-1, x.ndim - 1):
            return self.base.sum(x, axis=axis, keepdims=keepdims)
        if x.shape[-1] == 0:
            r = np.zeros(x.shape[:-1] + (1,), self.dtype)
        elif self.m.order == "fma":
            r = np.cumsum(x, axis=-1)[..., -1:]
        else:
            r = np.sum(x, axis=-1, keepdims=True) if self.m.arith == "blas" else self.base.sum(x, keepdims=True)
        return r if keepdims else r[..., 0]

    def matmul(self, a, b):
        """``a @ b`` accumulated in the work dtype in the member's order; the result in the work dtype."""
        a, b = self.lift(a), self.lift(b)
        if self.m.tf32:
            a, b = tf32(a), tf32(b)
        if self.m.arith == "blas":
            return np.matmul(a, b)
        if self.m.order == "tree" or a.shape[-1] == 0:
            return self.base.matmul(a, b)
        a2, b2 = a.astype(np.float64), b.astype(np.float64)     # float32 products exact in float64
        acc = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), self.dtype)
        for i in range(a.shape[-1]):                       # one multiply-add after another: a fixed order
            acc = (acc + a2[..., :, i, None] * b2[..., None, i, :]).astype(self.dtype)
        return acc


class LibmLowPrecision(LowPrecision):
    """:class:`~sdpa_ref.exact.arith.LowPrecision` whose ``tanh`` is NumPy's in the dtype, not the double-double one
    rounded: the specimens that compute on the platform's libm and BLAS (``Member(arith="blas")``)."""

    def tanh(self, x):
        return np.tanh(np.asarray(x, self.dtype))
