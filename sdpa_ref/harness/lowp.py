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
    """An honest member's arithmetic (:mod:`.ensemble`) in the interface of :mod:`sdpa_ref.arith`, for the
    stages it shares with the engines (:func:`sdpa_ref.lse.combine_in`, the normaliser's
    :func:`sdpa_ref.normalize.vjp_delta_in` and :func:`sdpa_ref.normalize.extra_probs_in`): values are work-dtype
    arrays, each operation rounded to the work dtype (``kernel.W``), ``exp`` the member's own (``kernel.exp``)."""

    def __init__(self, kernel):
        self.k = kernel

    def value(self, a):
        return a

    def const(self, x):
        return self.k.w.type(x)

    def where(self, cond, a, b):
        return self.k.W(np.where(cond, a, b))

    def exp_minus(self, a, m):
        return self.k.exp(self.k.W(a - m))

    def mul(self, a, b):
        return self.k.W(a * b)

    def add(self, a, b):
        return self.k.W(a + b)

    def sub(self, a, b):
        return self.k.W(a - b)

    def neg(self, a):
        return -a

    def sum(self, a, axis=-1, keepdims=True):
        """Over the last axis, in the member's order (``kernel.rowsum``)."""
        assert axis in (-1, np.ndim(a) - 1)
        r = self.k.rowsum(a)
        return r if keepdims else r[..., 0]


class LibmLowPrecision(LowPrecision):
    """:class:`~sdpa_ref.exact.arith.LowPrecision` whose ``tanh`` is NumPy's in the dtype, not the double-double one
    rounded: the specimens that compute on the platform's libm and BLAS (``Member(arith="blas")``)."""

    def tanh(self, x):
        return np.tanh(np.asarray(x, self.dtype))
