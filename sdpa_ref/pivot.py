r"""The pivoted softmax VJP: the one home of the formula every engine evaluates.

The softmax Jacobian is :math:`J = \mathrm{diag}(P) - P P^T`, symmetric, so the VJP of a cotangent ``g`` and
the JVP of a tangent are the same map. Since :math:`\sum_k P_k = 1`, for any constant :math:`c`

.. math:: J g = P \odot (g - \textstyle\sum_k P_k g_k) = P \odot ((g - c) - \sum_k P_k (g_k - c)),

and the package takes :math:`c = g_{k^*}` at the row's first largest :math:`P` (:func:`row_pivot`): the
dominant term of the sum is then exactly 0 and the cancellation of the plain form on peaked rows is gone. Every
engine computes this form, from here:

* :func:`pivoted_vjp` -- along any axis, in NumPy (:func:`sdpa_ref.softmax.softmax_vjp` and ``softmax_jvp``,
  the plain engine);
* :func:`softmax_vjp_in` -- over the rows of an arithmetic (:mod:`sdpa_ref.arith`; double-double and the honest
  low precision of ``precision="reproducible"``);
* :func:`softmax_vjp_rows` -- in place on a block of rows (the fast engine, where the compiled row pass does not
  run);
* :func:`sink_softmax_vjp_in`, :func:`sink_grad_in` -- a row with a sink: one more column with no value;
* :func:`block_partial`, :func:`combine_partials` -- a row split into key blocks (the tiled engine): each block's
  own pivot and partial sums, then the row's one pivot and :math:`D`;
* :func:`softmax_vjp_delta_in` -- the unpivoted form with :math:`D` given, as kernels compute it (the honest
  ensemble);
* :func:`second_partial`, :func:`combine_second`, :func:`tangent_probs`, :func:`second_entries` -- the
  softmax's second order (the double backward), pivoted the same way, on a whole row (the plain engine) or
  key block by key block (the tiled engine).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .arith import NUMPY

__all__ = ["block_partial", "combine_partials", "nan_rows_vjp", "pivoted_vjp", "row_pivot", "rowdot",
           "lane_rowsum", "sink_grad_in", "sink_softmax_vjp_in", "softmax_vjp_delta_in", "softmax_vjp_in", "softmax_vjp_rows",
           "SecondPivots", "combine_second", "second_entries", "second_partial", "tangent_probs"]


def row_pivot(y, g, axis=-1):
    r"""``g`` at each row's largest ``y`` (the axis kept, length 1): the pivot of the softmax derivatives.

    :math:`\sum_j y_j = 1`, so for any constant :math:`c`

    .. math:: g - \textstyle\sum_k y_k g_k = (g - c) - \sum_k y_k (g_k - c).

    With :math:`c = g_{j^*}` at the row's largest :math:`y` the dominant term
    of the sum is exactly 0, and the rounding error of the sum shrinks with
    the weight of the other terms: on peaked rows, where the plain form
    cancels, by orders of magnitude (``benchmarks/accuracy_study.py``).
    """
    if y.shape[axis] == 0:
        return np.zeros(y.shape[:axis % y.ndim] + (1,) + y.shape[axis % y.ndim + 1:], dtype=g.dtype)
    idx = np.argmax(y.real, axis=axis, keepdims=True)
    return np.take_along_axis(g, idx, axis=axis)


def pivoted_vjp(y, g, axis=-1):
    """``y * ((g - c) - sum(y * (g - c)))`` along ``axis``, ``c`` = :func:`row_pivot` (validated arrays); a row
    whose sum is NaN as :func:`nan_rows_vjp` says."""
    with np.errstate(invalid="ignore"):                    # an overflowed g (inf - inf) is NaN, as IEEE says
        gc = g - row_pivot(y, g, axis)
    D = np.sum(gc * y, axis=axis, keepdims=True)
    return nan_rows_vjp(y * (gc - D), y, D)


def nan_rows_vjp(dT, P, D):
    r"""The VJP's one NaN rule: on a row whose :math:`D` is NaN (a NaN row of the forward,
    :func:`sdpa_ref.normalize.row_stats`, whose ``P`` is NaN on its allowed keys and 0 elsewhere), an entry with
    :math:`P = 0` is not read and its :math:`dT` is 0, not :math:`0 \cdot \mathrm{NaN}`: the NaN stays on the
    keys the row reads. Other rows are returned as they are (the same bits); the compiled row pass
    (``_fast_rows.h``) and the tiled sweeps apply the same rule."""
    bad = D != D
    if not np.any(bad):
        return dT
    return np.where(bad & (P == 0), dT.dtype.type(0), dT)


def softmax_vjp_rows(g, P, rows):
    """The pivoted VJP in place on the 2-D rows ``g`` (``P`` the same shape), ``rows`` rows at a time (the fast
    engine's cache-sized passes): ``g`` becomes ``P * ((g - c) - rowsum(P * (g - c)))``."""
    for r0 in range(0, g.shape[0], rows):
        gb, pb = g[r0:r0 + rows], P[r0:r0 + rows]
        with np.errstate(invalid="ignore"):                # an overflowed g (inf - inf) is NaN, as IEEE says
            np.subtract(gb, row_pivot(pb, gb), out=gb)
        D = lane_rowsum(gb * pb)
        np.subtract(gb, D, out=gb)
        np.multiply(gb, pb, out=gb)
        gb[...] = nan_rows_vjp(gb, pb, D)


def lane_rowsum(x):
    """Row sums ``(rows, 1)`` of the 2-D ``x`` in the compiled row passes' order (``_fast_rows.h``): lane ``l``
    adds entry ``l`` of each block of eight in turn, from +0 (the last short block padded with 0), and the eight
    lanes meet as ``((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))``. Every step is one IEEE addition, so the NumPy
    passes (:func:`softmax_vjp_rows`, the fast engine's softmax) sum exactly as the compiled ones do: the same
    bits from the same terms, whatever rows a call holds."""
    rows, n = x.shape
    full = n - n % 8
    acc = np.zeros((rows, 8), dtype=x.dtype)
    if full:                                     # (blocks, rows, 8): NumPy reduces an outer axis row after row,
        blocks = np.ascontiguousarray(x[:, :full].reshape(rows, full // 8, 8).transpose(1, 0, 2))
        acc += np.add.reduce(blocks, axis=0)     # in order (its pairwise sum is only along the inner axis)
    if full < n:
        tail = np.zeros((rows, 8), dtype=x.dtype)
        tail[:, :n - full] = x[:, full:]
        acc += tail
    return (((acc[:, 0] + acc[:, 1]) + (acc[:, 2] + acc[:, 3]))
            + ((acc[:, 4] + acc[:, 5]) + (acc[:, 6] + acc[:, 7])))[:, None]


def block_partial(P, g):
    """One key block of a row split into blocks: its own pivot ``c_b`` (``g`` at the block's first largest ``P``)
    and ``(max P, c_b, rowsum(P (g - c_b)), rowsum(P))`` for :func:`combine_partials` (``g`` is not written:
    the row's pivot is subtracted from it later, once)."""
    idx = np.argmax(P.real, axis=-1, keepdims=True)
    c_b = np.take_along_axis(g, idx, axis=-1)
    gc = g - c_b
    return np.take_along_axis(P.real, idx, axis=-1), c_b, rowdot(P, gc), rowdot(P, None)


def softmax_vjp_in(X, P, g, g_lse=None):
    """:func:`softmax_vjp` (and :func:`softmax_lse_vjp` with ``g_lse`` ``(..., 1)``) over the rows of an
    arithmetic ``X`` (:mod:`sdpa_ref.exact.arith`): ``P * ((g - c) - rowsum(P * (g - c))) [+ P * g_lse]``,
    ``c = g`` at the row's first largest ``P``; the arithmetic's compiled row pass where it has one (the same
    operations, the same bits)."""
    fused = getattr(X, "softmax_vjp_rows", None)
    out = None if fused is None else fused(P, g)
    if out is None and X.value(P).shape[-1] == 0:          # S = 0: no entry, and no pivot to take
        return P
    if out is None:
        idx = np.argmax(X.value(P), axis=-1)[..., None]
        gc = X.sub(g, X.take(g, idx))
        out = X.mul(P, X.sub(gc, X.sum(X.mul(P, gc), keepdims=True)))
    return out if g_lse is None else X.add(out, X.mul_d(P, g_lse))


def sink_grad_in(X, p_sink, c, D):
    r"""The sink's gradient on each row, :math:`d\sigma = p_\sigma\, ((0 - c) - D)`: the softmax VJP's entry of
    a column whose :math:`dP` is 0, pivoted by :math:`c` (``D`` with ``dlse`` already folded in); not pivoted
    (``c`` None, :func:`softmax_vjp_delta_in`'s form), :math:`-(p_\sigma D)`."""
    if c is None:
        return X.neg(X.mul(p_sink, D))
    return X.mul(p_sink, X.neg(X.add(c, D)))


def softmax_vjp_delta_in(X, P, g, D):
    r""":math:`P \odot (g - D)` over an arithmetic, with :math:`D` given: the softmax VJP as kernels compute it,
    not pivoted, :math:`D = \mathrm{rowsum}(dO \odot O)` (FlashAttention's identity) or
    :math:`\mathrm{rowsum}(P \odot dP)`. The honest ensemble's members compute this; every engine of the package
    computes the pivoted form above, which does not cancel on peaked rows."""
    return X.mul(P, X.sub(g, D))


def sink_softmax_vjp_in(X, P, dP, p_sink, g_lse=None, d_sink=None):
    r"""The softmax VJP of a row with a sink, over an arithmetic ``X``: ``(dT, dsink)``, ``dsink`` ``(..., 1)``.

    The sink is a column with probability ``p_sink`` ``(..., 1)`` and :math:`dP = 0` (it has no value), so
    :func:`softmax_vjp` over the keys and the sink gives, with :math:`D = \sum_j P_j dP_j`,

    .. math:: dT = P \odot (dP - D + \bar\lambda), \qquad d\sigma = p_\sigma (0 - D + \bar\lambda)
              = -p_\sigma (D - \bar\lambda),

    the sink gradient of FlashAttention #2706 and splash attention (:math:`\bar\lambda` = ``g_lse``, or 0).
    Pivoted as :func:`row_pivot`: :math:`c` is :math:`dP` at the row's largest probability, 0 when that is the
    sink's (the sink is column 0: it wins a tie), and :math:`D - c = \sum_j P_j (dP_j - c) - c\, p_\sigma`
    since the probabilities sum to 1.

    The softmax Jacobian is symmetric, so the same map is the JVP: ``dP`` is then the scores' tangent
    :math:`dT` and ``d_sink`` ``(..., 1)`` the sink's tangent :math:`d\sigma` (the sink column's entry, 0 when
    None), giving :math:`dP = P \odot (dT - \sum_j P_j dT_j - p_\sigma d\sigma)`.
    """
    Pv, ps = X.value(P), X.value(p_sink)
    cs = X.const(0.0) if d_sink is None else X.lift(np.broadcast_to(d_sink, np.shape(ps)))
    if Pv.shape[-1]:
        top = ps >= np.max(Pv, axis=-1, keepdims=True)
        c = X.where(top, cs, X.take(dP, np.argmax(Pv, axis=-1)[..., None]))
    else:                                                           # no key: the sink holds the row
        c = X.add(X.mul(p_sink, X.const(0.0)), cs)
    gc = X.sub(dP, c)
    if d_sink is None:                                              # the sink's column: 0 - c
        D = X.sub(X.sum(X.mul(P, gc), keepdims=True), X.mul(c, p_sink))
    else:
        gs = X.sub(cs, c)
        D = X.add(X.sum(X.mul(P, gc), keepdims=True), X.mul(p_sink, gs))
    if g_lse is not None:
        D = X.add_d(D, -g_lse)
    dT = X.mul(P, X.sub(gc, D))
    Dv = X.value(D)
    bad = (Dv != Dv) & (Pv == 0)                                    # a NaN row: dT 0 where P is 0 (nan_rows_vjp)
    if np.any(bad):
        dT = X.where(bad, X.const(0.0), dT)
    if d_sink is None:
        return dT, sink_grad_in(X, p_sink, c, D)
    return dT, X.mul(p_sink, X.sub(gs, D))


def rowdot(P, X):
    """``rowsum(P * X)`` (``X=None``: ``rowsum(P)``), keeping the axis, without an ``L x S`` temporary."""
    if X is None:
        return np.sum(P, axis=-1, keepdims=True)
    return np.einsum("...j,...j->...", P, X)[..., None]


def combine_partials(parts):
    """One pivot ``c`` and ``D = rowsum(P (dP - c))`` from the key blocks' ``(max P, c_b, rowsum(P (dP - c_b)),
    rowsum(P))``: ``c`` is the ``c_b`` of the block holding the row's largest ``P`` (the first such), and
    ``sum_b [rowsum(P (dP - c_b)) + (c_b - c) rowsum(P)]`` is ``D``, the pivot block's correction exactly 0."""
    pm, cb, s1, sp = (np.stack(x) for x in zip(*parts))
    best = np.argmax(pm, axis=0)[None]
    c = np.take_along_axis(cb, best, axis=0)[0]
    with np.errstate(invalid="ignore"):                    # an overflowed g (inf - inf) is NaN, as IEEE says
        D = s1[0] + (cb[0] - c) * sp[0]
        for b in range(1, len(parts)):
            D = D + (s1[b] + (cb[b] - c) * sp[b])
    return c, D


# ------------------------------------------------------------------ second order


class SecondPivots(NamedTuple):
    r"""A row's pivots and pivoted sums for the softmax's second order (:func:`combine_second`), ``(..., 1)``
    each: ``a``, ``tau``, ``b`` are :math:`g`, :math:`T'`, :math:`dP'` at the row's first largest probability,
    and the sums are taken relative to them."""

    a: Any          # g at the pivot (the first-order pivot, as row_pivot's)
    tau: Any        # T' at the pivot
    b: Any          # dP' at the pivot
    Dg: Any         # D - a = rowsum(P (g - a))
    Ct: Any         # c - tau = rowsum(P (T' - tau)),  c = rowsum(P T')
    Fh: Any         # rowsum(P (dP' - b))
    E: Any          # rowsum(P' (g - a)) = rowsum(P' g);  D' - b = Fh + E,  D' = rowsum(P dP' + P' g)


def second_partial(P, g, t, h, X=NUMPY):
    r"""One key block's share of the softmax's second order, for :func:`combine_second`.

    ``P`` the block's probabilities, ``g`` the probabilities' cotangent :math:`dP`, ``t`` the scores' tangent
    :math:`T'`, ``h`` the cotangent's tangent :math:`dP'`, each ``(..., n)`` with ``n >= 1``, values of the
    arithmetic ``X`` (:mod:`sdpa_ref.arith`; NumPy arrays by default, double-double for
    ``precision="reproducible"``). With the block's own
    pivots :math:`a_b, \tau_b, b_b` (``g``, ``t``, ``h`` at the block's first largest ``P``), returns
    ``(max P, a_b, tau_b, b_b, rowsum(P), rowsum(P (g - a_b)), rowsum(P (t - tau_b)), rowsum(P (h - b_b)),
    rowsum(P (t - tau_b) (g - a_b)))``. An extra column of the normaliser (a sink) is a block of one column whose
    ``g`` and ``h`` are 0 and ``t`` its tangent. Nothing is written into the arguments.
    """
    Pv = X.value(P).real
    idx = np.argmax(Pv, axis=-1, keepdims=True)
    a, tau, b = (X.take(x, idx) for x in (g, t, h))
    gw = X.sub(g, a)
    Pu = X.mul(P, X.sub(t, tau))
    return (np.take_along_axis(Pv, idx, axis=-1), a, tau, b, _rowsum(X, P), _rowsum(X, P, gw), _rowsum(X, Pu),
            _rowsum(X, P, X.sub(h, b)), _rowsum(X, Pu, gw))


def combine_second(parts, X=NUMPY):
    r"""The row's :class:`SecondPivots` from its blocks' :func:`second_partial` (the first part holding the row's
    largest ``P`` gives the pivots; put the extra column first, so that it wins a tie, as in first order).

    Notes
    -----
    The softmax's double backward (:func:`sdpa_ref.normalize.vjp_jvp`) reads three row sums, each an average
    under :math:`P` (:math:`\sum_j P_j = 1`):

    .. math:: D = \sum_j P_j g_j, \qquad c = \sum_j P_j T'_j, \qquad
              D' = \sum_j P_j\, dP'_j + \sum_j P'_j g_j, \quad P' = P \odot (T' - c),

    and it uses them only as differences with a row's entries: :math:`g - D`, :math:`T' - c`,
    :math:`dP' - D'`. When one entry :math:`k` holds nearly all of the row (a dominant key, a sink with
    :math:`p_\sigma = 1 - 5 \cdot 10^{-18}`), each average agrees with that entry's value to
    :math:`1 - P_k`, so the plain sums leave the dominant entry's difference -- the part every result of the
    dominant key and the sink is made of -- as two O(1) numbers that cancel. For any row constant :math:`x_0`,

    .. math:: \sum_j P_j x_j - x_0 = \sum_j P_j (x_j - x_0),

    and taking :math:`x_0` at the largest :math:`P` makes the dominant term exactly 0: every other term is
    small with its weight, so the difference is computed without cancellation. With :math:`a, \tau, b` the
    pivot's :math:`g, T', dP'`:

    .. math::

        D - a = \sum_j P_j (g_j - a), \qquad c - \tau = \sum_j P_j (T'_j - \tau), \\
        D' - b = \sum_j P_j (dP'_j - b) + \sum_j P'_j (g_j - a),

    the last since :math:`\sum_j P'_j = 0` (the tangent of :math:`\sum_j P_j = 1`), where the pivot's term
    :math:`P'_k (g_k - a)` is exactly 0 and the others are small. With
    :math:`P'_j = P_j ((T'_j - \tau) - (c - \tau))`,

    .. math:: \sum_j P'_j (g_j - a) = \sum_j P_j (T'_j - \tau)(g_j - a) - (c - \tau)(D - a).

    A row split into key blocks has each block pivoted at its own largest :math:`P` (:math:`a_b`, ...); the
    row's sums are the blocks' moved to the row's pivot, :math:`x_j - x_0 = (x_j - x_b) + (x_b - x_0)`:

    .. math::

        \sum_{j \in b} P_j (g_j - a) = \sum_{j \in b} P_j (g_j - a_b) + (a_b - a) \sum_{j \in b} P_j,

    and the product term by the product of two such sums, each block's correction a small weight times an O(1)
    difference (the pivot block's exactly 0). The extra column of the normaliser (a sink) is one more block,
    with :math:`g = dP' = 0` and :math:`T'` its tangent :math:`\sigma'`.
    """
    pm, a_b, tau_b, b_b, s1, sg, st, sh, stg = zip(*parts)
    best = np.argmax(np.stack(pm), axis=0)

    def at_best(x):                                             # the pivot block's entry, row by row
        out = x[0]
        for i in range(1, len(x)):
            out = X.where(best == i, x[i], out)
        return out

    a, tau, b = at_best(a_b), at_best(tau_b), at_best(b_b)
    Dg = Ct = Fh = Euw = X.const(0.0)
    add, sub, mul = X.add, X.sub, X.mul
    for i in range(len(parts)):
        da, dt, db = sub(a_b[i], a), sub(tau_b[i], tau), sub(b_b[i], b)
        Dg = add(Dg, add(sg[i], mul(da, s1[i])))
        Ct = add(Ct, add(st[i], mul(dt, s1[i])))
        Fh = add(Fh, add(sh[i], mul(db, s1[i])))
        Euw = add(Euw, add(add(stg[i], mul(da, st[i])), mul(dt, add(sg[i], mul(da, s1[i])))))
    return SecondPivots(a, tau, b, Dg, Ct, Fh, sub(Euw, mul(Ct, Dg)))


def tangent_probs(P, t, piv, X=NUMPY):
    r""":math:`P' = P \odot ((T' - \tau) - (c - \tau))`, the probabilities' tangent (the JVP's
    :math:`J T'`) pivoted by :func:`combine_second`'s ``piv``; ``t`` the scores' tangent :math:`T'` (a value of
    ``X``, or a float array or 0 that it lifts). A NaN row (``piv.Dg`` NaN) as :func:`nan_rows_vjp` says: 0 where
    ``P`` is 0."""
    if X is NUMPY:                                          # the same operations, in one buffer
        return nan_rows_vjp(_scaled(P, _into(np.subtract, np.subtract(t, piv.tau), piv.Ct)), P, piv.Dg)
    return _nan_rows_in(X, X.mul(P, X.sub(X.sub(_lift(X, t), piv.tau), piv.Ct)), P, piv.Dg)


def second_entries(P, Pt, g, h, piv, lam=0, lam_t=0, X=NUMPY):
    r"""``(dT, dT')`` of each entry: the softmax's VJP and its tangent, pivoted by ``piv``
    (:func:`combine_second`),

    .. math::

        dT = P \odot r, \quad r = (g - a) - (D - a) + \bar\lambda, \qquad
        dT' = P \odot ((dP' - b) - F + \bar\lambda') + (P' \odot r - P\, E),

    :math:`F = \sum_j P_j (dP'_j - b)`, :math:`E = \sum_j P'_j (g_j - a)` (so that :math:`F + E = D' - b`),
    with ``Pt`` :math:`P'` (:func:`tangent_probs`), ``g`` :math:`dP`, ``h`` :math:`dP'`, ``lam`` the LSE's
    cotangent :math:`\bar\lambda` and ``lam_t`` its tangent (0: none; float arrays in every arithmetic ``X``).
    The two terms of the curvature
    :math:`J' dP = P' \odot (g - D) - P E` are added together first: on a row whose largest probability is
    shared by keys with the same weight (a tie) they cancel exactly, which leaves :math:`J\, dP'` its bits.
    The extra column of the normaliser (a sink) is an entry with ``g = h = 0``: its gradient and the
    gradient's tangent. A NaN row (``piv.Dg`` NaN) as :func:`nan_rows_vjp` says: both 0 where ``P`` is 0, NaN on
    the keys the row reads (the first-order reads pattern, inside the second order's documented superset)."""
    if X is NUMPY:
        return _second_entries_numpy(P, Pt, g, h, piv, lam, lam_t)
    r = _plus(X, X.sub(X.sub(_lift(X, g), piv.a), piv.Dg), lam)
    dT_t = X.add(X.mul(P, _plus(X, X.sub(X.sub(_lift(X, h), piv.b), piv.Fh), lam_t)),
                 X.sub(X.mul(Pt, r), X.mul(P, piv.E)))
    return _nan_rows_in(X, X.mul(P, r), P, piv.Dg), _nan_rows_in(X, dT_t, P, piv.Dg)


def _second_entries_numpy(P, Pt, g, h, piv, lam, lam_t):
    """:func:`second_entries` on NumPy arrays: each line's operations in the same order, written into a few
    buffers rather than a fresh array each (the same bits; on an ``L x S`` block, eight fewer temporaries)."""
    r = _into(np.add, _into(np.subtract, np.subtract(g, piv.a), piv.Dg), lam)       # r = (g - a) - D + lam
    t = _into(np.add, _into(np.subtract, np.subtract(h, piv.b), piv.Fh), lam_t)     # P ((dP' - b) - F + lam')
    t = _scaled(P, t)
    c = _into(np.subtract, Pt * r, P * piv.E)                                       # ... + (P' r - P E)
    t = _into(np.add, t, c)
    return nan_rows_vjp(_scaled(P, r), P, piv.Dg), nan_rows_vjp(t, P, piv.Dg)


def _fits(x, y):
    """Whether ``op(x, y)`` has the shape and dtype of the array ``x``, so that it can be written into it."""
    return isinstance(x, np.ndarray) and x.shape == np.broadcast_shapes(x.shape, np.shape(y)) \
        and x.dtype == np.result_type(x, y)


def _into(op, x, y):
    """``op(x, y)`` for a fresh array ``x`` (no one else reads it), written into ``x`` where it fits (else a new
    array): the same value, each operand in its place."""
    return op(x, y, out=x) if _fits(x, y) else op(x, y)


def _scaled(P, x):
    """``P * x`` for a fresh array ``x``, written into it where it fits (``P`` stays the first operand, as in
    the arithmetic's ``mul(P, x)``: the same bits, a NaN's payload included)."""
    return np.multiply(P, x, out=x) if _fits(x, P) else P * x


def _rowsum(X, a, b=None):
    """``rowsum(a * b)`` (``b`` None: ``rowsum(a)``) keeping the axis, over ``X``: :func:`rowdot` on NumPy arrays
    (no ``L x S`` temporary), the arithmetic's own fixed-order sum otherwise."""
    if X is NUMPY:
        return rowdot(a, b)
    return X.sum(a if b is None else X.mul(a, b), keepdims=True)


def _lift(X, x):
    """``x`` as a value of ``X``: a value already (a double-double pair, or any value in NumPy) as it is, a float
    array or a number lifted."""
    if X is NUMPY or isinstance(x, tuple):
        return x
    return X.lift(x)


def _plus(X, x, c):
    """``x + c`` for the float array or number ``c`` (0: nothing to add, outside NumPy, which adds it as it
    always has)."""
    if X is NUMPY:
        return x + c
    if isinstance(c, (int, float)) and c == 0:
        return x
    return X.add(x, c) if isinstance(c, tuple) else X.add_d(x, c)


def _nan_rows_in(X, dT, P, D):
    """:func:`nan_rows_vjp` over ``X``."""
    if X is NUMPY:
        return nan_rows_vjp(dT, P, D)
    Dv = X.value(D)
    bad = Dv != Dv
    if not np.any(bad):
        return dT
    return X.where(bad & (X.value(P) == 0), X.const(0.0), dT)
