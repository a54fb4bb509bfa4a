r"""The log-sum-exp as the kernels return it: its base, its value on rows with no key, and the row statistics.

The package's LSE is :math:`\mathrm{lse}_i = \log \sum_{j \in A_i} e^{T_{ij}}`
in base e, ``-inf`` on a row whose allowed set :math:`A_i` is empty (the
empty sum). The kernels differ (``SEMANTICS.md``, "The LSE family"):

* FlashInfer returns base 2, :math:`\log_2 \sum_j 2^{T_{ij} \log_2 e} =
  \mathrm{lse}_i \log_2 e` (``m * log2(e) + log2(sum)`` in its kernels);
* on empty rows FlashAttention 2 returns ``+inf``, most others ``-inf``,
  FlashInfer #4452 asks for a finite value, and with a sink the kernels
  return the sink's logit there;
* cuDNN returns the row statistics instead: the row max :math:`m_i` and the
  sum :math:`s_i = \sum_j e^{T_{ij} - m_i}`, with
  :math:`\mathrm{lse}_i = m_i + \log s_i`; its max is ``-inf`` on an empty
  row, and the sum 0.

:func:`convert_lse` maps the package's LSE to any of these conventions and
back, so a kernel's LSE is compared in its own convention. :func:`combine_lse`
is the log-sum-exp of a union of disjoint sets from theirs, with its VJP
beside it: the merge of split-KV partial results (:mod:`sdpa_ref.merge`).
"""

from __future__ import annotations

import numbers

import numpy as np

from . import _validate as V
from .arith import NUMPY, NUMPY2, combine_in
from .exact import dd as D
from .pivot import pivoted_vjp, softmax_vjp_in

__all__ = ["LSE_BASES", "PRECISIONS", "ExactLSE", "arith_for", "check_base", "check_empty", "check_precision",
           "combine_in", "combine_lse", "combine_lse_vjp", "combine_lse_vjp_in", "combined_in", "convert_lse"]

#: The bases an LSE may be given in: ``"e"`` (natural, the package's) and ``2`` (FlashInfer's).
LSE_BASES = ("e", 2)
#: The precisions of the LSE functions and the merge, as of the attention calls: ``"fast"`` (float64 NumPy, a
#: few ulps) and ``"reproducible"`` (double-double, faithfully rounded, the same bits everywhere).
PRECISIONS = ("fast", "reproducible")

_LOG2E = 1.4426950408889634            # log2(e), correctly rounded
_LN2 = 0.6931471805599453              # ln(2), correctly rounded
_LN2_DD = (np.float64(D._LN2[0]), np.float64(D._LN2[1]))           # ln 2 to 106 bits, a double-double
_LOG2E_DD = D.dd_div(D.dd(np.float64(1.0)), _LN2_DD)              # log2(e) = 1 / ln 2, the same
#: Below this an exponent's difference gives 0 (``e^-760`` and ``2^-1100`` are below the float64 range):
#: clamped there, so that ``-inf - m`` and a difference beyond Dekker's range never reach ``exp``.
_EXP_CLAMP = -2000.0


def check_base(base, name="base"):
    """``"e"`` or ``2`` (the string ``"2"`` and NumPy integers too) -> ``"e"`` or ``2``; anything else (``2.0``,
    ``True``, ``10``) a ValueError naming ``name``."""
    if isinstance(base, str) and base in ("e", "2"):
        return "e" if base == "e" else 2
    if isinstance(base, numbers.Integral) and not isinstance(base, (bool, np.bool_)) and base == 2:
        return 2
    raise ValueError(f"`{name}` should be 'e' or 2, but got {base!r}")


def check_empty(empty, name="empty"):
    """The float a row with no allowed key holds under the convention ``empty`` (``"-inf"``, ``"+inf"`` or a
    finite number), or a ValueError naming ``name``."""
    return _empty_value(empty, name)


def _empty_value(empty, name="empty"):
    """``"-inf"``, ``"+inf"``/``"inf"`` or a finite float -> the float an empty row holds."""
    if isinstance(empty, str):
        if empty in ("-inf", "+inf", "inf"):
            return float(empty)
    elif isinstance(empty, numbers.Real) and not isinstance(empty, bool):
        x = float(empty)
        if x == x:                                  # NaN would hide the rows it stands for
            return x
    raise ValueError(f"`{name}` should be '-inf', '+inf' or a number (not NaN), but got {empty!r}")


def convert_lse(lse, *, base="e", empty="-inf", from_base="e", from_empty="-inf", precision="fast"):
    r"""An LSE in another convention: its base and the value on rows with no allowed key.

    Parameters
    ----------
    lse : array_like, (..., Hq, L)
        Log-sum-exps in base ``from_base`` whose empty rows hold ``from_empty``
        (by default the package's own: base e, ``-inf``).
    base : {"e", 2}, optional
        The base of the result. ``2`` is FlashInfer's:
        :math:`\mathrm{lse}_2 = \mathrm{lse}_e \log_2 e`.
    empty : {"-inf", "+inf"} or float, optional
        What a row with no allowed key holds in the result: ``"-inf"`` (the
        empty sum; FlashAttention 3/4, cuDNN, FlexAttention), ``"+inf"``
        (FlashAttention 2), or a number (a sink's logit, or a finite
        sentinel).
    from_base, from_empty : optional
        The convention of ``lse``, to map a kernel's LSE to the package's.
        Every entry equal to ``from_empty`` is an empty row (so a finite
        ``from_empty`` must be a value no other row takes).
    precision : {"fast", "reproducible"}, optional
        ``"fast"`` (default): when the base changes, the product by the float64 ``log2(e)`` or ``ln 2``
        (within about 1.5 ulps). ``"reproducible"``: the product by the constant to 106 bits, formed exactly
        and rounded once (within 1 ulp of the exact value, the same bits everywhere), as the attention calls'
        ``precision``. Without a change of base both return the values themselves.

    Returns
    -------
    ndarray, float64 (or the input's floating dtype), the shape of ``lse``
        A new array; the input is not changed. NaN stays NaN.

    Examples
    --------
    >>> convert_lse([0.0, -np.inf], base=2, empty="+inf").tolist()
    [0.0, inf]
    >>> convert_lse([1.0], base=2).tolist() == [1.4426950408889634]
    True
    """
    base, from_base = check_base(base, "base"), check_base(from_base, "from_base")
    to_e, from_e = _empty_value(empty, "empty"), _empty_value(from_empty, "from_empty")
    exact = check_precision(precision) == "reproducible"
    x = V.as_float_array(lse, "lse")
    gone = x == x.dtype.type(from_e)
    y = x
    if base != from_base and exact:                         # x * c exactly to 106 bits, then one rounding
        y = _times_constant(x, _LOG2E_DD if base == 2 else _LN2_DD).astype(x.dtype, copy=False)
    elif base != from_base:                                 # one rounding: lse_e * log2(e) or lse_2 * ln(2)
        y = x * x.dtype.type(_LOG2E if base == 2 else _LN2)
    return np.where(gone, x.dtype.type(to_e), y)


def _times_constant(x, c):
    """``x * c`` for float64-representable ``x`` and the double-double constant ``c``, rounded once to float64:
    ``x c_hi`` exact (Dekker's product, scaled where ``x`` is huge), plus ``x c_lo``; ``+-inf`` where it
    overflows, NaN for NaN, ``+-inf`` for ``+-inf``."""
    x64 = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        f = np.where(np.abs(x64) > 2.0 ** 990, 2.0 ** -128, 1.0)           # Dekker's split overflows past 2**996
        p, e = D.two_prod(x64 * f, c[0])
        hi = D.fast_two_sum(p, e + x64 * f * c[1])[0] / f                   # exact scalings by powers of two
        return np.where(np.isfinite(p), hi, p / f)


def check_precision(precision, name="precision"):
    """``"fast"`` or ``"reproducible"``; anything else a ValueError naming ``name``."""
    return V.check_choice(precision, name, PRECISIONS)


class ExactLSE:
    r"""The double-double arithmetic of the log-sum-exp combines and the merges (:mod:`sdpa_ref.exact.dd`), base e
    or 2: the operations :func:`combine_in` and :func:`combined_in` take, in the interface of
    :class:`sdpa_ref.exact.arith.DoubleDouble` (:func:`sdpa_ref.merge_attention` adds that class's others).

    ``exp_minus(a, m)`` is :math:`e^{a - m}` (base 2: :math:`2^{a - m} = e^{(a - m) \ln 2}`, the product by the
    double-double :math:`\ln 2`): the difference formed exactly (TwoSum), clamped below at ``_EXP_CLAMP``
    (where the result is 0 in float64 either way), then ``dd_exp``; ``log`` is ``dd_log`` (base 2: divided by
    the double-double :math:`\ln 2`). About ``2**-100`` relative in each, so every result rounded once from
    them is within 1 ulp of the exact value, and is the same bits everywhere (IEEE ``+ - * /`` only)."""

    def __init__(self, base):
        self.base = base

    @staticmethod
    def const(x):
        return D.dd(np.float64(x))

    @staticmethod
    def value(a):
        return a[0]

    @staticmethod
    def lift(x):
        return D.dd(np.asarray(x, dtype=np.float64))

    where = staticmethod(D.dd_where)
    add, div = staticmethod(D.dd_add), staticmethod(D.dd_div)

    def exp_minus(self, a, m):
        d = D.dd_sub(a, m)
        low = d[0] < _EXP_CLAMP                              # NaN stays NaN
        d = np.where(low, _EXP_CLAMP, d[0]), np.where(low, 0.0, d[1])
        return D.dd_exp(d if self.base == "e" else D.dd_mul(d, _LN2_DD))

    def log(self, a):
        r = D.dd_log(a)
        return r if self.base == "e" else D.dd_div(r, _LN2_DD)


def arith_for(base, precision):
    """``(X, log)``: the arithmetic of ``base`` (checked) and ``precision`` (checked), and its logarithm."""
    base, precision = check_base(base), check_precision(precision)
    if precision == "reproducible":
        X = ExactLSE(base)
        return X, X.log
    return (NUMPY2, np.log2) if base == 2 else (NUMPY, np.log)


def combine_lse(lse_parts, axis=0, base="e", precision="fast"):
    r"""Combine log-sum-exps: ``lse = log sum_i exp(l_i)`` and the weights ``w_i = exp(l_i - lse)``.

    ``lse_parts`` ``(..., P, ...)`` hold the log-sum-exps of disjoint sets of scores (the split-KV parts of
    :mod:`sdpa_ref.merge`); ``lse`` (``axis`` removed) is that of their union, and ``w`` (the shape of
    ``lse_parts``) each set's share of the mass: the softmax of ``lse_parts`` along ``axis``. Computed as
    :math:`m + \log s` and :math:`w_i = e^{l_i - m} / s` with :math:`s = \sum_i e^{l_i - m}` and :math:`m` the
    largest part (0 when not finite). An empty part (``-inf``) has ``w_i = 0`` exactly, so it is the identity:
    one non-empty part gives back its own ``lse`` and ``w = 1``, bit for bit. All parts empty give
    ``lse = -inf`` and ``w = 0``, never NaN; NaN gives NaN. ``base=2`` takes and returns base-2 log-sum-exps
    (:math:`\log_2 \sum_i 2^{l_i}`, as FlashInfer returns them), with ``exp2``/``log2`` so no conversion
    rounds. No warnings.

    ``precision="reproducible"`` evaluates the same steps (:func:`combine_in`) in double-double (``exp`` and
    ``log`` of :mod:`sdpa_ref.exact.dd`; in base 2 through the double-double :math:`\ln 2`), rounded once:
    ``lse`` and ``w`` within 1 ulp of the exact values, the same bits everywhere (rounded once more to the
    input's dtype below float64).

    >>> lse, w = combine_lse(np.array([0.0, -np.inf, 0.0]))
    >>> float(lse), w.tolist()
    (0.6931471805599453, [0.5, 0.0, 0.5])
    """
    x = V.as_float_array(lse_parts, "lse_parts", min_ndim=1)
    axis = V.check_axis(axis, x.ndim)
    X, log = arith_for(base, precision)
    if x.shape[axis] == 0:                                   # no part: the empty sum
        return np.full(x.shape[:axis] + x.shape[axis + 1:], -np.inf, x.dtype), x.copy()
    dt = x.dtype
    x = x.astype(np.float64) if isinstance(X, ExactLSE) else x
    lse, w, _ = combined_in(X, log, [np.take(x, [i], axis=axis) for i in range(x.shape[axis])])
    lse, w = np.squeeze(X.value(lse), axis=axis), np.concatenate([X.value(a) for a in w], axis=axis)
    return lse.astype(dt, copy=False), w.astype(dt, copy=False)          # rounded once more below float64


def combined_in(X, log, parts):
    r"""``(lse, w, empty)`` of the log-sum-exps ``parts`` (a list of float arrays, each ``(..., 1, ...)``) over
    the arithmetic ``X`` with its ``log``: :func:`combine_in` of the parts, :math:`\mathrm{lse} = \log s + m`
    (``-inf`` on the rows where every part is empty, ``empty``) and :math:`w_i = \alpha_i / s` (exactly 0 where
    :math:`\alpha_i` is: an empty part), as ``X``'s values. The one combine of :func:`combine_lse` and
    :func:`sdpa_ref.merge_attention`, in float64 (``fast``) or double-double (``reproducible``)."""
    zero = X.const(parts[0].dtype.type(0) if X is NUMPY or X is NUMPY2 else 0.0)
    empty = [p == -np.inf for p in parts]
    lifted = [X.where(e, zero, X.lift(p)) for p, e in zip(parts, empty)]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        m, s, alpha, none = combine_in(X, lifted, [None] * len(parts), empty)
        w = [X.where(X.value(a) == 0, zero, X.div(a, s)) for a in alpha]
        lse = X.where(none, X.const(-np.inf), X.add(log(s), m))
    return lse, w, none


def combine_lse_vjp(w, g_w, g_lse, axis=0, base="e"):
    r"""The VJP of :func:`combine_lse`: the gradient of ``lse_parts`` from the cotangents of ``w`` and ``lse``.

    :math:`\partial\, \operatorname{lse} / \partial l_i = w_i` and :math:`\partial w_i / \partial l_j = c\, w_i
    (\delta_{ij} - w_j)` (a softmax; :math:`c = 1`, or :math:`\ln 2` in base 2, where :math:`w_i = 2^{l_i -
    \operatorname{lse}}`), so :math:`\bar l = c\, w \odot (\bar w - \sum_i w_i \bar w_i) + w\, \bar\lambda`
    (:math:`\bar\lambda` = ``g_lse``, ``axis`` removed). The softmax part is the pivoted VJP of
    :func:`sdpa_ref.softmax.softmax_vjp` (:func:`sdpa_ref.pivot.pivoted_vjp`, pivoted at the largest weight).
    """
    c = _LN2 if check_base(base) == 2 else 1.0
    wa, ga, ax = V.pair_along_axis(w, g_w, axis, "w", "g_w")
    return c * pivoted_vjp(wa, ga, ax) + w * np.expand_dims(g_lse, axis)


def combine_lse_vjp_in(X, w, g_w, g_lse, base="e"):
    r""":func:`combine_lse_vjp` over the rows of an arithmetic ``X`` (the parts on the last axis of the
    ``X`` values ``w`` and ``g_w``; ``g_lse`` a float array ``(..., 1)``): :math:`c\, w \odot (\bar w - \sum_i
    w_i \bar w_i) + w\, \bar\lambda` by :func:`sdpa_ref.pivot.softmax_vjp_in` (the same pivot), with
    :math:`c = \ln 2` the double-double one in base 2 under :class:`ExactLSE`."""
    if check_base(base) == "e":
        return softmax_vjp_in(X, w, g_w, g_lse)
    c = X.mul(softmax_vjp_in(X, w, g_w), _LN2_DD) if isinstance(X, ExactLSE) else _LN2 * softmax_vjp_in(X, w, g_w)
    return X.add(c, X.mul_d(w, g_lse))
