r"""Learnable attention sinks: one logit per query head that takes part in the softmax and has no value.

gpt-oss, FlashAttention 4 (``learnable_sink``), FlashInfer, cuDNN, JAX's splash attention and MLX add a logit
:math:`\sigma_h` to every row's normaliser (SEMANTICS.md, "Attention sinks")::

    m = max(max_j T_ij, sigma),   Z = sum_j exp(T_ij - m) + exp(sigma - m),   P_ij = exp(T_ij - m) / Z

so the keys' probabilities sum to :math:`1 - p_\sigma`. It is the softmax over the keys and one more column
whose score is :math:`\sigma` and whose value is 0; the stages below are that column written once, forward
(:func:`fold_sink_in`, :func:`sink_probs`) and backward (:func:`sink_softmax_vjp_in`), over an arithmetic
(:mod:`sdpa_ref.arith`), for every engine.
"""

from __future__ import annotations

import numpy as np

from .arith import combine_in
from .pivot import sink_grad_in, sink_softmax_vjp_in

__all__ = ["fold_sink_in", "sink_grad_in", "sink_probs", "sink_probs_lse_in", "sink_softmax_vjp_in"]


def fold_sink_in(X, m, s, empty, sink):
    r"""Fold a sink logit into a row's softmax, over an arithmetic ``X`` (:mod:`sdpa_ref.arith`): the sink is
    one more score with no value.

    ``m`` ``(..., 1)`` is the row's largest score (0 on a row with no allowed key, ``empty``), ``s`` the sum
    :math:`\sum_j e^{T_j - m}` (not read where ``empty``), ``sink`` the logit :math:`\sigma` (a real array
    broadcastable to ``m``; ``-inf``: no sink, exactly). Returns ``(m2, s2, r, p_sink, empty2)`` with

    .. math:: m_2 = \max(m, \sigma), \qquad s_2 = s\, e^{m - m_2} + e^{\sigma - m_2}, \qquad
              r = e^{m - m_2}\, s / s_2,

    so the keys' probabilities become :math:`P\, r`, the sink's is ``p_sink`` :math:`= e^{\sigma - m_2} / s_2`, and
    :math:`\mathrm{lse} = m_2 + \log s_2` (FlashAttention 4, cuDNN, splash: the LSE includes the sink).
    ``empty2`` are the rows with neither a key nor a sink (``m2 = 0``, ``s2 = 0`` there); ``r`` is 0 on a row
    with no key (the sink takes all the mass: ``O = 0``, ``lse = sigma``) and exactly 1 where ``sink`` is
    ``-inf``, where no bit of ``m`` and ``s`` moves. On a NaN row (``s`` NaN, :func:`sdpa_ref.normalize.row_stats`)
    ``s2``, the LSE and ``p_sink`` are NaN (the sink reads the row) and ``r`` is 1: the keys' ``P`` already holds
    the row's NaN on the keys it reads and 0 on the others, which ``P r`` keeps. The tiled engine applies it after
    a row's last key block.

    A ``+inf`` sink (FlashMLA's tests draw them) takes all the mass, the limit :math:`\sigma \to +\infty`:
    ``r = 0`` (every key's ``P`` is 0, ``O = 0``), ``p_sink = 1``, ``m2 = +inf`` and ``s2 = 1``, so the LSE is
    ``+inf`` and a ``P`` recomputed as :math:`e^{T - m_2} / s_2` is 0. The row's keys are not read (a NaN key
    row still gives NaN through ``P r``). Its gradients are the limits too: :math:`dT = P (\ldots) = 0`, so
    ``dq``, ``dk``, ``dv`` get nothing from the row, and :math:`d\sigma = p_\sigma (\bar\lambda - D) =
    \bar\lambda`, the LSE's cotangent (:math:`\partial\, \mathrm{lse} / \partial \sigma = \mathrm{sigmoid}(\sigma -
    \mathrm{lse}_{keys}) \to 1`, and :math:`D = dO \cdot O = 0`): 0 without a ``grad_lse``.
    """
    none, full = sink == -np.inf, sink == np.inf            # no sink; a sink that takes all the mass
    shape = np.broadcast_shapes(np.shape(sink), np.shape(X.value(m)))
    sv = X.lift(np.broadcast_to(np.where(none | full, 0.0, sink).astype(np.asarray(sink).dtype), shape))
    if np.any(full):                                        # the limit: the keys' part is empty beside the sink
        empty = empty | full
    m2, s2, (a, b), empty2 = combine_in(X, [m, sv], [s, None], [empty, none])   # the sink: a part with s = 1
    if np.any(full):                                        # m2 = +inf, s2 = 1: lse = +inf, exp(T - m2) = 0
        m2 = X.where(np.broadcast_to(full, shape), X.const(np.inf), m2)
    s2_ = X.where(empty2, X.const(1.0), s2)
    r, p_sink = X.div(X.mul(a, s), s2_), X.div(b, s2_)
    sv2 = X.value(s2)
    nan = sv2 != sv2                                        # a NaN row (normalize.row_stats): its keys' P is
    if np.any(nan):                                         # NaN where read and 0 elsewhere already, and r = 1
        r = X.where(nan, X.const(1.0), r)                   # keeps the 0s (a NaN r spread it to every key)
    return m2, s2, X.where(empty2, X.const(0.0), r), p_sink, empty2


def sink_probs(sink, m, s):
    r"""The sink's probability :math:`p_\sigma = e^{\sigma - m} / s` ``(..., 1)`` from the row's closed normaliser
    ``(m, s)`` (:func:`fold_sink_in`'s ``m2``, ``s2``: what a forward keeps as its ``rowmax``, ``rowsum``), on NumPy
    arrays; 0 where there is no sink (``-inf``). The same bits as :func:`fold_sink_in`'s ``p_sink``
    (``tests/test_normalize.py`` holds them to it), NaN on a NaN row (``s`` NaN).

    Not :math:`e^{\sigma - \mathrm{lse}}`: the LSE ``m + log s`` is rounded at the size of ``m``, so with a sink
    near a top score of ``1e15`` its ulp (0.125) moved ``p_sigma`` by 13% (and ``dsinks`` and ``dq`` with it)."""
    none, full = np.asarray(sink) == -np.inf, np.asarray(sink) == np.inf     # full: +inf, p_sigma = 1
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        p = np.exp(np.where(none | full, 0.0, sink) - np.where(none | full, 0.0, m)) / np.where(none, 1.0, s)
    return np.where(none, p.dtype.type(0), p)


def sink_probs_lse_in(X, sink, lse):
    r"""The sink's probability :math:`e^{\sigma - \mathrm{lse}}` ``(..., 1)`` from the LSE that includes it, over
    an arithmetic, as a kernel that keeps only the LSE computes it (the honest ensemble's members); 0 where there
    is no sink (``-inf``) or ``lse`` is ``-inf`` (no key and no sink). The engines use :func:`sink_probs`."""
    none = (np.asarray(sink) == -np.inf) | (X.value(lse) == -np.inf)
    full = ~none & (np.asarray(sink) == np.inf)             # +inf: lse = +inf, p_sigma = 1
    return X.where(none, X.const(0.0), X.exp_minus(X.where(none | full, X.const(0.0), sink),
                                                   X.where(none | full, X.const(0.0), lse)))

