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
from .arith import NUMPY, NUMPY2
from .pivot import pivoted_vjp

__all__ = ["LSE_BASES", "check_base", "check_empty", "combine_in", "combine_lse", "combine_lse_vjp", "convert_lse"]

#: The bases an LSE may be given in: ``"e"`` (natural, the package's) and ``2`` (FlashInfer's).
LSE_BASES = ("e", 2)

_LOG2E = 1.4426950408889634            # log2(e), correctly rounded
_LN2 = 0.6931471805599453              # ln(2), correctly rounded


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


def convert_lse(lse, *, base="e", empty="-inf", from_base="e", from_empty="-inf"):
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
    x = V.as_float_array(lse, "lse")
    gone = x == x.dtype.type(from_e)
    y = x
    if base != from_base:                                   # one rounding: lse_e * log2(e) or lse_2 * ln(2)
        y = x * x.dtype.type(_LOG2E if base == 2 else _LN2)
    return np.where(gone, x.dtype.type(to_e), y)


def combine_in(X, m_parts, s_parts, empty_parts):
    r"""The row normalisers of disjoint sets of scores, combined, over an arithmetic ``X`` (:mod:`sdpa_ref.arith`).

    A normaliser ``(m, s)`` stands for :math:`\sum_j e^{T_j} = s\, e^{m}` over its set: ``m`` the shift (0 on an
    empty set, whose ``s`` is not read), ``s`` the sum of :math:`e^{T_j - m}`; ``s=None`` is 1 (a set of one
    score, ``m`` itself: a sink's logit, or a normalised part's LSE). Given the parts as lists (each entry
    ``(..., 1)`` or broadcastable), returns ``(m, s, alpha, empty)`` with

    .. math:: m = \max_i m_i, \qquad \alpha_i = e^{m_i - m}, \qquad s = \sum_i \alpha_i s_i,

    ``alpha_i`` exactly 1 for the part that holds the max (the first on a tie) and exactly 0 for an empty one
    (so an empty part is the identity and is never read), the sum taken part by part in order, and ``empty``
    the rows where every part is empty (``m`` is then 0 and ``s`` 0). NaN in an ``m_i`` gives NaN in ``s``.

    It is the one combine of the softmax's normaliser: the tiled engine's online softmax merges each key
    block's ``(m, s)`` into the running one with it (and scales its output accumulator by the ``alpha``), the
    sink joins a row's as a part with ``s = 1`` and no value (:func:`sdpa_ref.sinks.fold_sink_in`), and the
    split-KV merge combines the parts' LSEs with it (:func:`combine_lse`).
    """
    n = len(m_parts)
    m, top, best_empty = m_parts[0], 0, empty_parts[0]
    for i in range(1, n):                                   # the largest shift, the first on a tie
        take = ~empty_parts[i] & (best_empty | (X.value(m_parts[i]) > X.value(m)))
        m = X.where(take, m_parts[i], m)
        top = np.where(take, i, top)
        best_empty = best_empty & empty_parts[i]
    alpha, s = [], None
    for i in range(n):
        a = X.where(empty_parts[i], X.const(0.0), X.where(top == i, X.const(1.0), X.exp_minus(m_parts[i], m)))
        t = a if s_parts[i] is None else X.mul(X.where(empty_parts[i], X.const(0.0), s_parts[i]), a)
        alpha.append(a)
        s = t if s is None else X.add(s, t)
    return m, s, alpha, best_empty


def combine_lse(lse_parts, axis=0, base="e"):
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

    >>> lse, w = combine_lse(np.array([0.0, -np.inf, 0.0]))
    >>> float(lse), w.tolist()
    (0.6931471805599453, [0.5, 0.0, 0.5])
    """
    x = V.as_float_array(lse_parts, "lse_parts", min_ndim=1)
    axis = V.check_axis(axis, x.ndim)
    X, log = (NUMPY2, np.log2) if check_base(base) == 2 else (NUMPY, np.log)
    parts = [np.take(x, [i], axis=axis) for i in range(x.shape[axis])]
    if not parts:                                            # no part: the empty sum
        return np.full(x.shape[:axis] + x.shape[axis + 1:], -np.inf, x.dtype), x.copy()
    empty = [p == -np.inf for p in parts]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        m, s, alpha, none = combine_in(X, [np.where(e, x.dtype.type(0), p) for p, e in zip(parts, empty)],
                                       [None] * len(parts), empty)
        w = np.concatenate([np.where(a == 0, x.dtype.type(0), a / s) for a in alpha], axis=axis)
        return np.squeeze(np.where(none, -np.inf, log(s) + m), axis=axis), w


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
