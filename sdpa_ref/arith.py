r"""The NumPy arithmetic: the interface of :mod:`sdpa_ref.exact.arith` over plain arrays in the compute dtype.

A stage written once over an arithmetic ``X`` (``X.add``, ``X.mul``, ``X.exp_minus``, ``X.sum``, ...) runs in
double-double or the honest low precision for ``precision="reproducible"`` (:mod:`sdpa_ref.exact.arith`) and,
with :data:`NUMPY`, on the ndarrays of the ``"fast"``, ``"plain"`` and ``"tiled"`` engines: each operation is
NumPy's own, a value is its array, and nothing is rounded twice. :func:`sdpa_ref.sinks.sink_softmax_vjp_in` and
:func:`sdpa_ref.sinks.fold_sink_in` are such stages, and :func:`combine_in` (the combine of normalisers) is
kept here, below all of them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NUMPY", "NUMPY2", "NumPyArith", "NumPyBase2", "combine_in"]


class NumPyArith:
    """NumPy's operations on arrays of the compute dtype (complex included); values are the arrays."""

    @staticmethod
    def const(x):
        return x

    @staticmethod
    def value(a):
        return a

    @staticmethod
    def lift(x):
        return np.asarray(x)

    add, sub, mul, div = staticmethod(np.add), staticmethod(np.subtract), staticmethod(np.multiply), \
        staticmethod(np.divide)
    add_d, mul_d = staticmethod(np.add), staticmethod(np.multiply)

    @staticmethod
    def exp_minus(a, m):
        """``exp(a - m)``."""
        return np.exp(a - m)

    neg = staticmethod(np.negative)

    @staticmethod
    def where(cond, a, b):
        return np.where(cond, a, b)

    @staticmethod
    def take(a, idx):
        return np.take_along_axis(a, idx, -1)

    @staticmethod
    def sum(a, axis=-1, keepdims=False):
        return np.sum(a, axis=axis, keepdims=keepdims)

    @staticmethod
    def recip(n):
        """``1/n`` for positive ``n`` (a count, or an array of counts): one IEEE division (a Python float for a
        Python number, as it mixes with arrays of any dtype without widening them)."""
        return 1.0 / n

    @staticmethod
    def div_masked(x, keep, a, b, out=None):
        """``x * Z / (a + b)`` for the bool mask ``Z`` (``keep``) and the divisor ``a + b`` of two floats: the
        factor ``Z * (1 / (a + b))`` rounded once to ``x``'s dtype, then one multiply (into ``out`` if given).
        A multiply, not ``np.where``, so that a NaN entry stays NaN where ``Z`` is 0 (``NaN * 0``)."""
        return np.multiply(x, keep * x.real.dtype.type(1.0 / (a + b)), out=out)


class NumPyBase2(NumPyArith):
    """:class:`NumPyArith` whose exponential is base 2 (``exp2``): FlashInfer's base-2 log-sum-exps combined
    with no conversion rounding."""

    @staticmethod
    def exp_minus(a, m):
        """``2 ** (a - m)``."""
        return np.exp2(a - m)


#: The one instance (and its base-2 twin).
NUMPY = NumPyArith()
NUMPY2 = NumPyBase2()


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
    split-KV merge combines the parts' LSEs with it (:func:`sdpa_ref.lse.combine_lse`, in double-double too).
    It lives beside the NumPy arithmetic, below every stage that runs it, and :mod:`sdpa_ref.lse` gives it
    under its own name too (``sdpa_ref.lse.combine_in``).
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
