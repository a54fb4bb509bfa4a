r"""The row normaliser of attention's softmax: closing a row's state, and the VJP through it, once.

A row's normaliser is :math:`(m, s)`: ``m`` its largest allowed score,
:math:`s = \sum_j e^{T_j - m}` over its allowed keys, so that
:math:`P_j = e^{T_j - m} / s` and :math:`\mathrm{lse} = m + \log s`. Every
engine computes the keys' :math:`(m, s)` in its own schedule (the core and
the dense engines over the whole row, the tiled one key block by key block,
merged by :func:`sdpa_ref.lse.combine_in`), then *closes* it here:

* :func:`close_in` folds in the row's *extra logits* -- scores that take
  part in the normaliser and have no value: attention sinks
  (:mod:`sdpa_ref.sinks`) -- and gives the factor ``r`` by which the keys'
  probabilities (or the tiled engine's unnormalised output) are rescaled;
* :func:`vjp_in` is the softmax VJP over the keys and the extra columns (the
  pivoted form of :mod:`sdpa_ref.pivot`), with the LSE's cotangent, and
  each extra logit's gradient; the same map is the JVP (the Jacobian is
  symmetric), with the extra logits' tangent; :func:`vjp_jvp` is its
  tangent, the softmax's second order (the double backward), and
  :func:`vjp_jvp_scores` the same from the scores' tangent on a whole row,
  :func:`second_pivots` and :func:`extra_second` the pieces a schedule over
  key blocks assembles it from: every row sum of it pivoted at the row's
  largest probability, the extra logits included
  (:func:`sdpa_ref.pivot.combine_second`).

An engine never names the extra logits: it asks :func:`extras` for them,
closes its rows, and sums the extra gradient over the rows into
``Grads.dextra``. A new kind of extra logit is a change to this module and
the problem, not to any engine. Without extra logits nothing here moves a
bit: ``close_in`` returns the state as it came (``r`` None), and the VJP is
the plain pivoted one.

Shapes: ``m``, ``s``, ``empty``, ``lse``, an extra logit and its probability
are ``(..., 1)`` per row, in the engine's layout; ``P``, ``g``: ``(..., S)``.
"""

from __future__ import annotations

import dataclasses

from typing import Any, NamedTuple, Optional

import numpy as np

from .arith import NUMPY
from .pivot import (combine_second, second_entries, second_partial, sink_grad_in, sink_softmax_vjp_in,
                    softmax_vjp_delta_in, softmax_vjp_in, tangent_probs)
from .sinks import fold_sink_in, sink_probs, sink_probs_lse_in
from .softmax import softmax_lse_vjp, softmax_vjp

__all__ = ["EXTRA_NAME", "Closed", "close", "nan_row_probs", "row_softmax", "row_stats", "close_in", "extra_grad_in",
           "extra_probs", "extra_probs_in",
           "extra_shape", "extras", "keys_only", "lse_in", "vjp", "vjp_delta_in", "vjp_in", "vjp_jvp",
           "extra_second", "second_pivots", "vjp_jvp_scores"]


def row_stats(T):
    r"""A row's statistics and the one NaN rule: ``(m, empty, nan)``, each ``(..., 1)``, from the scores ``T``
    ``(..., S)`` after the whole chain (``-inf`` outside the allowed set).

    * ``empty``: every score is ``-inf`` -- no key is allowed, or every allowed score is ``-inf`` (a score that is
      ``-inf`` excludes its key). The ``fully_masked`` policy fills such a row.
    * ``nan``: some score is NaN or ``+inf`` (on an allowed key, since the rest are ``-inf``). Such a row has no
      finite answer: its ``P`` is NaN on every key whose score is not ``-inf`` and 0 on the others
      (:func:`nan_row_probs`), its sum and LSE are NaN, and it is never empty. ``precision="reproducible"``
      raises a ValueError instead.
    * ``m``: the shift, the largest score where that is finite, 0 on the other rows.

    The max propagates NaN (``np.max``), so a NaN is never lost in it. Every engine follows this rule: the core
    and the fast engine's NumPy passes through this function, the tiled engine per key block, the reproducible
    arithmetics' ``row_max``, and the compiled row passes (``_fast_rows.h``, which detect the NaN in their max
    pass; their ``m`` on a NaN row is the largest non-NaN score instead of 0, a value no result reads).
    """
    with np.errstate(invalid="ignore"):
        top = np.max(T.real, axis=-1, keepdims=True, initial=-np.inf)
    empty = top == -np.inf
    nan = ~(top < np.inf) & ~empty                          # NaN or +inf
    return np.where(empty | nan, top.dtype.type(0), top), empty, nan


def nan_row_probs(P, T, nan):
    """``P`` with :func:`row_stats`' NaN rows (``nan`` ``(..., 1)``) as the rule says: NaN where ``T`` is not
    ``-inf``, 0 where it is (those keys are not read). Other rows are returned as they are."""
    if not np.any(nan):
        return P
    return np.where(nan, np.where(T == -np.inf, P.dtype.type(0), P.dtype.type(np.nan)), P)


def row_softmax(T):
    r"""``(P, m, s, empty)`` of each row of ``T`` by :func:`row_stats`: :math:`P = e^{T - m} / s`,
    :math:`s = \sum_j e^{T_j - m}`, NaN rows as the rule says (``s`` NaN), ``P`` 0/0 on empty rows (the policy
    fills them). The plain engine's row pass."""
    m, empty, nan = row_stats(T)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        e = np.exp(T - m)
        s = np.sum(e, axis=-1, keepdims=True)
        P = e / s
    if np.any(nan):
        P, s = nan_row_probs(P, T, nan), np.where(nan, s.dtype.type(np.nan), s)
    return P, m, s, empty


class Closed(NamedTuple):
    """A row's normaliser with its extra logits folded in."""

    m: Any                          # the largest score, the extra logits included (0 on an empty row)
    s: Any                          # sum_j e^(T_j - m) + sum of the extra logits' e^(sigma - m)
    r: Any                          # the keys' rescale (their P times r), or None: no extra logit, nothing moves
    p_extra: Any                    # the extra column's probability (..., 1), or None
    empty: np.ndarray               # rows with neither an allowed key nor an extra logit


def extras(prob, rows=None) -> Optional[np.ndarray]:
    """The extra logits of the normaliser for the rows ``rows`` (all by default), ``(..., Hq, 1 or Lb, 1)`` in the
    full layout, ``-inf`` where a row has none: the sinks (:meth:`sdpa_ref.problem.Problem.sink_rows`; padded rows
    have none). None when the problem has no extra logit."""
    return prob.sink_rows(rows)


def keys_only(prob, **changes):
    """``prob`` (a frozen :class:`~sdpa_ref.problem.Problem`) with a normaliser over its keys alone, no extra
    logit, and ``changes``: a split of the keys, whose partials merge before the extra logits join
    (:mod:`sdpa_ref.engines.splitkv`)."""
    return dataclasses.replace(prob, sink=None, **changes)


#: What the extra logits are called in the API (their argument, and their gradient in ``AttentionGrads``).
EXTRA_NAME = "sinks"


def extra_shape(prob):
    """The shape ``(..., Hq)`` or ``(..., 1)`` to which the extra logits' gradient is summed: a reshape of the
    ``sinks`` input's own shape (:func:`sdpa_ref._validate.sink_fold_shape`: ``()`` folds to ``(1,)``,
    ``(1, Hq, 1, 1)`` to ``(1, Hq)``), read off the problem's ``(..., Hq, 1, 1)`` logits: their head axis is the input's
    own unless the input holds fewer values (one logit for every head)."""
    own, lead = prob.shapes[EXTRA_NAME], prob.sink.shape[:-2]
    return lead if int(np.prod(own)) == int(np.prod(lead)) else lead[:-1] + (1,)


def close_in(X, m, s, empty, extra) -> Closed:
    r"""Close the keys' row state ``(m, s)`` (``empty``: the rows with no allowed key, where ``m`` is 0 and ``s``
    is not read) with the ``extra`` logits (None: none), over an arithmetic ``X`` (:mod:`sdpa_ref.arith`).

    .. math:: m' = \max(m, \sigma), \quad s' = s\, e^{m - m'} + e^{\sigma - m'}, \quad
              r = e^{m - m'} s / s', \quad p_\sigma = e^{\sigma - m'} / s'

    (:func:`sdpa_ref.sinks.fold_sink_in`): the keys' probabilities become :math:`P r`, the LSE
    :math:`m' + \log s'` includes the extra logit, and a row with no key but an extra logit has ``r = 0``.
    """
    if extra is None:
        return Closed(m, s, None, None, empty)
    return Closed(*fold_sink_in(X, m, s, empty, extra))


def close(m, s, empty, extra) -> Closed:
    """:func:`close_in` on NumPy arrays (an empty row's ``m`` may be ``-inf``)."""
    if extra is None:
        return Closed(m, s, None, None, empty)
    with np.errstate(over="ignore", invalid="ignore"):
        return close_in(NUMPY, np.where(empty, m.dtype.type(0), m), s, empty, extra)


def lse_in(X, m, s, empty=None):
    r"""A row's log-sum-exp :math:`\mathrm{lse} = m + \log s` from its (closed) normaliser ``(m, s)`` ``(..., 1)``,
    over an arithmetic ``X``; ``-inf`` on the ``empty`` rows (None: none named, and an empty row's ``s = 0``
    gives ``log 0 = -inf``)."""
    lse = X.add(X.log(s), m)
    full = (X.value(m) == np.inf) & (X.value(s) == 1)  # a +inf sink's row (fold_sink_in): +inf, kept out of a
                                                       # dd sum (a +inf score's row has s NaN and stays NaN)
    lse = X.where(full, X.const(np.inf), lse) if np.any(full) else lse
    return lse if empty is None else X.where(empty, X.const(-np.inf), lse)


def extra_probs_in(X, extra, lse):
    r"""The extra columns' probability :math:`e^{\sigma - \mathrm{lse}}` ``(..., 1)`` from the LSE that includes
    them, over an arithmetic (0 where there is none or ``lse`` is ``-inf``), or None without extra logits: as a
    kernel that keeps only the LSE computes it (the honest ensemble). The engines use :func:`extra_probs`."""
    return None if extra is None else sink_probs_lse_in(X, extra, lse)


def extra_probs(extra, m, s):
    r"""The extra columns' probability :math:`e^{\sigma - m} / s` ``(..., 1)`` from the row's closed normaliser
    ``(m, s)`` (:func:`close`'s; a forward's ``rowmax``, ``rowsum``), 0 where there is none, or None without extra
    logits: the same bits as :func:`close`'s ``p_extra``, never through the rounded LSE
    (:func:`sdpa_ref.sinks.sink_probs`). Every engine's backward, JVP and second order call it."""
    return None if extra is None else sink_probs(extra, m, s)


def vjp_in(X, P, g, p_extra=None, g_lse=None, d_extra=None):
    r"""``(dT, d_extra)``: the softmax VJP through the normaliser over an arithmetic ``X``, and the extra logits'
    gradient per row ``(..., 1)`` (None without them).

    With :math:`D = \sum_j P_j g_j`: :math:`dT = P \odot (g - D + \bar\lambda)` (``g_lse`` :math:`\bar\lambda`,
    the LSE's cotangent, or 0) and :math:`d\sigma = p_\sigma (0 - D + \bar\lambda)`: an extra column has no value,
    so its ``g`` is 0 (:func:`sdpa_ref.pivot.sink_softmax_vjp_in`). Pivoted (:func:`sdpa_ref.pivot.row_pivot`). As
    the JVP (``g`` the scores' tangent), ``d_extra`` is the extra logits' tangent, the extra column's ``g``.
    """
    if p_extra is None:
        return softmax_vjp_in(X, P, g, g_lse), None
    return sink_softmax_vjp_in(X, P, g, p_extra, g_lse, d_extra)


def vjp_delta_in(X, P, g, D, p_extra=None):
    r"""``(dT, d_extra)`` as kernels compute them, with :math:`D` given (FlashAttention's
    :math:`\mathrm{rowsum}(dO \odot O)`, or :math:`\mathrm{rowsum}(P \odot dP)`) and not pivoted:
    :math:`P \odot (g - D)` (:func:`sdpa_ref.pivot.softmax_vjp_delta_in`) and :math:`-p_\sigma D`. The honest
    ensemble's members run it; the engines run :func:`vjp_in`."""
    dT = softmax_vjp_delta_in(X, P, g, D)
    return dT, (None if p_extra is None else sink_grad_in(X, p_extra, None, D))


def vjp(P, g, p_extra=None, g_lse=None, d_extra=None):
    """:func:`vjp_in` on NumPy arrays along the last axis (the plain engine's forms of
    :mod:`sdpa_ref.softmax`: ``softmax_vjp``, ``softmax_lse_vjp``)."""
    if p_extra is None:
        return (softmax_vjp(P, g) if g_lse is None else softmax_lse_vjp(P, g, g_lse)), None
    with np.errstate(invalid="ignore"):
        return vjp_in(NUMPY, P, g, p_extra, g_lse, d_extra)


def vjp_jvp(P, g, dP, dg, p_extra=None, dp_extra=None, g_lse=None, dg_lse=None):
    r"""The tangent of :func:`vjp` ``(dT, d_extra)`` when ``P`` moves by ``dP`` (with the extra columns'
    ``dp_extra``), ``g`` by ``dg`` and the LSE's cotangent ``g_lse`` by ``dg_lse`` (None: zero): the softmax's
    second order, on NumPy arrays along the last axis.

    The VJP is :math:`dT = J g + P \bar\lambda` with :math:`J = \operatorname{diag}(P) - P P^T` over the keys
    and the extra columns (whose ``g`` is 0). Its tangent is the same map on the tangents plus what ``J`` and
    ``P`` move by, :math:`\dot J g = \dot P \odot g - \dot P (P \cdot g) - P (\dot P \cdot g)`:

    .. math::

        \dot{dT} = J \dot g + P \dot{\bar\lambda} + \dot P \odot (g - D + \bar\lambda) - P\, (\dot P \cdot g),
        \qquad D = P \cdot g,

    and on an extra column (``g = 0``): :math:`\dot p_\sigma (\bar\lambda - D) - p_\sigma (\dot P \cdot g)`
    plus the first term's entry. ``dP`` and ``dp_extra`` are the forward's tangent (:func:`vjp` with the scores'
    tangent and ``d_extra``: :math:`\dot P = J \dot T`).

    Every row sum is pivoted at the row's largest probability (:func:`sdpa_ref.pivot.combine_second`, whose
    docstring derives it): :math:`g - D = (g - a) - \sum_j P_j (g_j - a)`, the same for ``dg``, and
    :math:`\dot P \cdot g = \sum_j \dot P_j (g_j - a)` (:math:`\sum_j \dot P_j = 0`), taken here from the
    given ``dP``; :func:`vjp_jvp_scores` computes the same from the scores' tangent.
    """
    if P.shape[-1] == 0 and p_extra is None:                   # S = 0: no entry, and no pivot to take
        return np.zeros(P.shape, P.dtype), None
    with np.errstate(invalid="ignore"):
        zero = np.zeros(P.shape, P.dtype)                        # no T': the pivots of g and g' alone
        piv = second_pivots([] if P.shape[-1] == 0 else [second_partial(P, g, zero, dg)], p_extra)
        E = np.sum(dP * (g - piv.a), axis=-1, keepdims=True)     # rowsum(P' (g - a)), the pivot's term 0
        if p_extra is not None:
            E = E + dp_extra * (0 - piv.a)                        # the extra column's g is 0
        piv = piv._replace(E=E)
        lam, lam_t = (0 if x is None else x for x in (g_lse, dg_lse))
        ddT = second_entries(P, dP, g, dg, piv, lam, lam_t)[1]
        ddx = None if p_extra is None else second_entries(p_extra, dp_extra, 0, 0, piv, lam, lam_t)[1]
    return ddT, ddx


def second_pivots(parts, p_extra=None, t_extra=None, X=NUMPY):
    r"""A row's :class:`sdpa_ref.pivot.SecondPivots` from its key blocks' :func:`sdpa_ref.pivot.second_partial`
    ``parts`` and the extra logits' probability ``p_extra`` ``(..., 1)`` and tangent ``t_extra`` (a float array;
    None: none / zero), the extra column first (it wins a tie, as in first order): one more block with
    ``g = dP' = 0``. Over the arithmetic ``X`` (NumPy by default), whose values ``parts`` and ``p_extra`` are."""
    if p_extra is not None:
        pv = X.value(p_extra)
        z = np.zeros(np.shape(pv), np.result_type(pv))
        te = z if t_extra is None else np.broadcast_to(t_extra, z.shape)
        parts = [second_partial(p_extra, X.lift(z), X.lift(te), X.lift(z), X)] + list(parts)
    if not parts:                                               # no key and no extra logit: nothing moves
        raise ValueError("second_pivots needs a key block or an extra logit")
    return combine_second(parts, X)


def extra_second(piv, p_extra, t_extra=None, g_lse=None, dg_lse=None, X=NUMPY):
    r"""``(p', d_extra, d_extra')`` of the extra logits ``(..., 1)`` from the row's pivots ``piv``
    (:func:`second_pivots`): their probability's tangent :math:`p_\sigma' = p_\sigma ((\sigma' - \tau) - (c -
    \tau))`, gradient :math:`p_\sigma ((0 - a) - (D - a) + \bar\lambda)` and its tangent
    :math:`p_\sigma ((0 - b) - F + \bar\lambda') + p_\sigma' ((0 - a) - (D - a) + \bar\lambda) - p_\sigma E`
    (:func:`sdpa_ref.pivot.second_entries` on a column whose ``g`` and ``dP'`` are 0); None without them. Over
    the arithmetic ``X`` (NumPy by default); ``t_extra``, ``g_lse`` and ``dg_lse`` float arrays."""
    if p_extra is None:
        return None
    te = 0 if t_extra is None else t_extra
    pt = tangent_probs(p_extra, te, piv, X)
    lam, lam_t = (0 if x is None else x for x in (g_lse, dg_lse))
    return (pt,) + second_entries(p_extra, pt, 0, 0, piv, lam, lam_t, X)


def vjp_jvp_scores(P, g, t, h, p_extra=None, t_extra=None, g_lse=None, dg_lse=None, X=NUMPY):
    r"""The softmax's second order on whole rows (the plain engine's and the reproducible one's), from the
    scores' tangent ``t``: ``(dT, P', dT', extra)``, ``extra`` :func:`extra_second`'s ``(p', d_extra, d_extra')``
    or None.

    ``g`` is :math:`dP`, ``h`` its tangent :math:`dP'`, ``t_extra`` the extra logits' tangent; :math:`P'` the
    JVP's :math:`J T'`, :math:`dT` the VJP and :math:`dT'` its tangent, as :func:`vjp_jvp`, each row sum pivoted
    (:func:`sdpa_ref.pivot.combine_second`). The tiled engine assembles the same from key blocks
    (:mod:`sdpa_ref.engines.second`). Over the arithmetic ``X``: ``P``, ``g``, ``t``, ``h`` and ``p_extra`` its
    values (NumPy arrays by default; double-double pairs for ``precision="reproducible"``,
    :mod:`sdpa_ref.engines.reproducible_second`); ``t_extra``, ``g_lse``, ``dg_lse`` float arrays.
    """
    with np.errstate(invalid="ignore"):
        Pv = X.value(P)
        if Pv.shape[-1] == 0 and p_extra is None:               # S = 0: no entry, and no pivot to take
            z = X.lift(np.zeros(Pv.shape, Pv.dtype))
            return z, z, z, None
        parts = [] if Pv.shape[-1] == 0 else [second_partial(P, g, t, h, X)]
        piv = second_pivots(parts, p_extra, t_extra, X)
        Pt = tangent_probs(P, t, piv, X)
        lam, lam_t = (0 if x is None else x for x in (g_lse, dg_lse))
        dT, ddT = second_entries(P, Pt, g, h, piv, lam, lam_t, X)
        return dT, Pt, ddT, extra_second(piv, p_extra, t_extra, g_lse, dg_lse, X)


def extra_grad_in(X, p_extra, c, D):
    r"""The extra logits' gradient on each row, :math:`p_\sigma ((0 - c) - D)`, from a VJP already pivoted by ``c``
    (``D`` with the LSE's cotangent folded in): the tiled engine's, whose ``D`` comes from its key blocks."""
    return sink_grad_in(X, p_extra, c, D)
