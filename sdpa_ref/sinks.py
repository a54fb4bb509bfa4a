r"""Learnable attention sinks: one logit per query head that takes part in the softmax and has no value.

gpt-oss, FlashAttention 4 (``learnable_sink``), FlashInfer, cuDNN, JAX's splash attention and MLX add a logit
:math:`\sigma_h` to every row's normaliser (SEMANTICS.md, "Attention sinks")::

    m = max(max_j T_ij, sigma),   Z = sum_j exp(T_ij - m) + exp(sigma - m),   P_ij = exp(T_ij - m) / Z

so the keys' probabilities sum to :math:`1 - p_\sigma`. It is the softmax over the keys and one more column
whose score is :math:`\sigma` and whose value is 0; the stages below are that column written once, forward
(:func:`fold_sink`, :func:`sink_probs`) and backward (:func:`sink_softmax_vjp`), for every engine.
"""

from __future__ import annotations

import numpy as np

from .softmax import row_pivot

__all__ = ["check_sinks", "fold_sink", "sink_probs", "sink_softmax_vjp"]


def check_sinks(s):
    """``sinks`` as given, if every logit is finite or ``-inf`` (no sink on that head); else a ValueError."""
    bad = np.isnan(s) | np.isposinf(s)
    if np.any(bad):
        raise ValueError(f"`sinks` should be finite or -inf (no sink), but got {s[bad].ravel()[0]!r} at index "
                         f"{tuple(int(i) for i in np.argwhere(bad)[0])}")
    return s


def fold_sink(m, s, sink):
    r"""Fold a sink logit into a row's softmax: the sink is one more score with no value.

    ``m`` ``(..., 1)`` is the row's largest score (``-inf`` on a row with no allowed key), ``s`` the sum
    :math:`\sum_j e^{T_j - m}` (0 there), ``sink`` the logit :math:`\sigma`, broadcastable to ``m``
    (``-inf``: no sink, exactly). Returns ``(m2, s2, r)`` with

    .. math:: m_2 = \max(m, \sigma), \qquad s_2 = s\, e^{m - m_2} + e^{\sigma - m_2}, \qquad
              r = e^{m - m_2}\, s / s_2,

    so the keys' probabilities become :math:`P\, r`, the sink's is :math:`e^{\sigma - m_2} / s_2`, and
    :math:`\mathrm{lse} = m_2 + \log s_2` (FlashAttention 4, cuDNN, splash: the LSE includes the sink).
    ``m2`` is ``-inf`` only where there is neither a key nor a sink; ``r`` is 0 on a row with no key (the sink
    takes all the mass: ``O = 0``, ``lse = sigma``) and 1 where ``sink`` is ``-inf``. The same fold is the online
    softmax's step (:mod:`sdpa_ref.engines.tiled` starts each row from it).
    """
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m2 = np.maximum(m, sink)
        safe = np.where(m2 == -np.inf, 0.0, m2)
        a = np.where(m == -np.inf, 0.0, np.exp(m - safe))
        b = np.exp(sink - safe)
        s2 = s * a + b
        r = np.where(s2 > 0, a * s / np.where(s2 > 0, s2, 1.0), 0.0)
    return m2, s2, r.astype(np.result_type(s, np.float16), copy=False)


def sink_probs(sink, lse):
    r"""The sink's probability :math:`e^{\sigma - \mathrm{lse}}` ``(..., 1)`` from the LSE that includes it; 0 where
    ``lse`` is ``-inf`` (no key and no sink)."""
    with np.errstate(invalid="ignore"):
        return np.where(lse == -np.inf, 0.0, np.exp(sink - np.where(lse == -np.inf, 0.0, lse)))


def sink_softmax_vjp(P, dP, p_sink, g_lse=None):
    r"""The softmax VJP of a row with a sink: ``(dT, dsink)``, ``dsink`` ``(..., 1)`` per row.

    The sink is a column with probability ``p_sink`` ``(..., 1)`` and :math:`dP = 0` (it has no value), so
    :func:`softmax_vjp` over the keys and the sink gives, with :math:`D = \sum_j P_j dP_j`,

    .. math:: dT = P \odot (dP - D + \bar\lambda), \qquad d\sigma = p_\sigma (0 - D + \bar\lambda)
              = -p_\sigma (D - \bar\lambda),

    the sink gradient of FlashAttention #2706 and splash attention (:math:`\bar\lambda` = ``g_lse``, or 0).
    Pivoted as :func:`row_pivot`: :math:`c` is :math:`dP` at the row's largest probability, 0 when that is the
    sink's, and :math:`D - c = \sum_j P_j (dP_j - c) - c\, p_\sigma` since the probabilities sum to 1.
    """
    with np.errstate(invalid="ignore"):
        if P.shape[-1]:
            c = np.where(p_sink > np.max(P.real, axis=-1, keepdims=True), 0.0, row_pivot(P, dP))
        else:
            c = np.zeros(p_sink.shape)
        gc = dP - c
        D = np.sum(P * gc, axis=-1, keepdims=True) - c * p_sink
        if g_lse is not None:
            D = D - g_lse
        return P * (gc - D), p_sink * (-c - D)
