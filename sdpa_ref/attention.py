r"""The teaching core: attention's forward, backward and JVP, written as the derivation reads.

This is the ``"plain"`` engine and the oracle that every other engine is
tested against. Each function reads top to bottom against ``SEMANTICS.md``;
every stage calls the one definition the package has of it (the score
transforms in :mod:`sdpa_ref.transforms`, the allowed set and the
fully-masked policy in :mod:`sdpa_ref.masks`, the softmax and its VJP and
JVP in :mod:`sdpa_ref.softmax`).

Shapes, with the group axis of grouped-query attention explicit::

    q      (..., Hkv, G, L, E)     G = Hq // Hkv query heads per kv head
    k      (..., Hkv, 1, S, E)     one kv head, broadcast over its group
    v      (..., Hkv, 1, S, Ev)
    T, P   (..., Hq, L, S)         ==  (..., Hkv, G, L, S), the same memory
    O      (..., Hq, L, Ev)

Forward::

    Traw   = scale * Q K^T                          scores_forward
    T      = transforms(Traw)                       softcap, + mask + bias + ALiBi, -inf outside A
    P      = exp(T - m) / s, m = rowmax T, s = rowsum exp(T - m)
                                                    softmax_parts; rows with no key: the policy
             [m, s = max(m, sink), s e^(m-m') + e^(sink-m')]   fold_sink: a sink is a score with no value
    LSE    = m + log s
    P_drop = P * Z / (1 - p)                        dropout_forward
    O      = P_drop V

Backward, from ``dO`` (and ``dlse``, the LSE's cotangent, when given)::

    dV     = P_drop^T dO, summed over the group     (the group shares one kv head)
    dP     = (dO V^T) * Z / (1 - p)
    dT     = P * (dP - rowsum(P * dP))              softmax_vjp (pivoted: see row_pivot)
             [+ P * dlse]                           softmax_lse_vjp: d LSE / dT = P (undropped)
    dsink  = -p_sink * (D - dlse)                   sink_softmax_vjp: the sink's column has dP = 0
    dB     = dT summed to the mask's / bias's shape additive_vjp
    dTraw  = dT * (1 - tanh^2)                      softcap_vjp (only with softcap; as sech^2, no cancellation)
    dQ     = scale * dTraw K
    dK     = scale * dTraw^T Q, summed over the group

JVP, along ``(dQ, dK, dV, dB)``::

    dTraw  = scale * (dQ K^T + Q dK^T)
    dT     = dTraw * (1 - tanh^2) + dB
    dP     = P * (dT - rowsum(P * dT))              softmax_jvp
    dO     = (dP * Z / (1 - p)) V + P_drop dV
"""

from __future__ import annotations

import numpy as np

from .engines.contract import Forward, Grads
from .masks import constant_rows, fill_empty_rows, fill_output_without_keys, zero_output_rows
from .sinks import fold_sink, sink_probs, sink_softmax_vjp
from .softmax import softmax_jvp, softmax_lse_vjp, softmax_parts, softmax_vjp
from .transforms import (
    additive_vjp,
    dropout_forward,
    dropout_jvp,
    dropout_vjp,
    scores_forward,
    scores_jvp,
    scores_vjp,
    transform_scores,
    transform_scores_jvp,
    transform_scores_vjp,
)

__all__ = ["forward", "backward", "jvp"]


def forward(prob, *, save_probs=True) -> Forward:
    """The plain forward: ``(O, LSE, P, tanh, empty)`` in the layouts of the legend."""
    o, S = prob.options, prob.S
    k, v = _kv(prob.k), _kv(prob.v)
    Traw = scores_forward(prob.q, k, prob.scale)                    # (..., Hkv, G, L, S)
    T = _full(Traw, prob, copy=True)                                # (..., Hq, L, S)
    T, sech2 = transform_scores(prob, T, sech2=save_probs)            # sech2 = 1 - tanh^2: softcap's slope
    P, m, s = softmax_parts(T)                                       # exp(-inf) = 0 outside A
    empty = np.max(T.real, axis=-1, keepdims=True, initial=-np.inf) == -np.inf
    lse_keys = None
    if prob.sink is not None:                                       # a sink: one more score, with no value
        with np.errstate(divide="ignore"):
            lse_keys = (m + np.log(s))[..., 0]                      # the LSE over the keys alone (FlashMLA's)
        m, s, r, _, empty_ = fold_sink(m, s, empty, prob.sink_rows())
        P, empty = np.where(empty, P.dtype.type(0), P) * r, empty_
    with np.errstate(divide="ignore"):
        lse = m + np.log(s)                                         # -inf on a row with no key (and no sink)
    P = fill_empty_rows(P, empty, prob.padded_rows(), o.fully_masked, S)
    P_drop = dropout_forward(P, prob.keep, o.dropout_p)
    O = _full(_grouped(P_drop, prob) @ v, prob)                     # O = P_drop V
    vu = prob.averaged_values(empty)
    if vu is not prob.v:                                            # "uniform": such a row reads every value
        O = np.where(empty, _full(_grouped(P_drop, prob) @ _kv(vu), prob), O)
    O = fill_output_without_keys(O, o.fully_masked, S, prob.padded_rows())
    zr = zero_output_rows(empty, prob.padded_rows(), o.fully_masked)
    if zr is not None:                                              # 0 by definition: no value is read
        O = np.where(zr, O.dtype.type(0), O)
    return Forward(out=O, lse=lse[..., 0], probs=P if save_probs else None,
                   tanh=sech2 if save_probs else None, empty=empty, rowmax=m, rowsum=s, lse_keys=lse_keys)


def backward(prob, fwd: Forward, dO, dlse=None) -> Grads:
    """The plain backward from the saved ``P``: see the module docstring. ``dlse`` ``(*batch, Hq, L, 1)``, the
    cotangent of the LSE, or None (zero)."""
    o = prob.options
    P, sech2 = fwd.probs, fwd.tanh
    k, v = _kv(prob.k), _kv(prob.v)
    dO = _grouped(dO, prob)                                         # (..., Hkv, G, L, Ev)
    P_drop = dropout_forward(P, prob.keep, o.dropout_p)
    dv = (np.swapaxes(_grouped(P_drop, prob), -1, -2) @ dO).sum(axis=-3)   # dV = P_drop^T dO, summed over G
    dP = dropout_vjp(_full(dO @ np.swapaxes(v, -1, -2), prob), prob.keep, o.dropout_p)
    dsink = None
    if prob.sink is not None:                                       # the sink's column: dP = 0 there
        dT, dsink = sink_softmax_vjp(P, dP, sink_probs(prob.sink, fwd.lse[..., None]), dlse)
    elif dlse is None:
        dT = softmax_vjp(P, dP)                                     # P * (dP - rowsum(P * dP))
    else:                                                           # ... + P * dlse: d lse / dT = P
        dT = softmax_lse_vjp(P, dP, dlse)
    cr = constant_rows(fwd.empty, prob.padded_rows(), o.fully_masked)
    if cr is not None:                                               # such a row's P does not depend on T
        dT = np.where(cr, dT.dtype.type(0), dT)
        dsink = None if dsink is None else np.where(cr, dsink.dtype.type(0), dsink)
    dmask = None if prob.mask_float is None else additive_vjp(dT, prob.shapes["attn_mask"])
    dbias = None if prob.bias is None else additive_vjp(dT, prob.shapes["bias"])
    dTraw = transform_scores_vjp(dT, sech2)                         # through softcap
    dq, dk = scores_vjp(_grouped(dTraw, prob), prob.q, k, prob.scale)
    return Grads(dq=_full(dq, prob), dk=dk.sum(axis=-3), dv=dv, dmask=dmask, dbias=dbias,
                 dsinks=None if dsink is None else dsink[..., 0].sum(axis=-1))


def jvp(prob, fwd: Forward, dq=None, dk=None, dv=None, dbias=None, dv_full=None, dsinks=None):
    """The output tangent ``dO`` ``(..., Hq, L, Ev)`` along the input tangents (None means zero).

    ``dq`` is in the layout of ``prob.q``; ``dk``, ``dv`` in that of ``prob.k``, ``prob.v``;
    ``dbias`` broadcastable to the scores; ``dv_full`` the value tangent that the fully masked rows of
    ``"uniform"`` average (``Problem.clean_tangents``); ``dsinks`` the sinks' tangent ``(..., Hq, 1, 1)``.
    """
    o = prob.options
    P, sech2 = fwd.probs, fwd.tanh
    k, v = _kv(prob.k), _kv(prob.v)
    dO = None
    if dq is not None or dk is not None or dbias is not None or dsinks is not None:
        dTraw = scores_jvp(prob.q, k, dq, None if dk is None else _kv(dk), prob.scale)
        dTraw = np.zeros(prob.full_scores, prob.dtype) if dTraw is None else _full(dTraw, prob)
        dT = transform_scores_jvp(dTraw, sech2, dbias)
        dT = np.broadcast_to(dT, P.shape)
        if prob.sink is None:
            dP = softmax_jvp(P, dT)                                 # P * (dT - rowsum(P * dT))
        else:                                                       # J is symmetric: the sink's column, d sigma
            dP = sink_softmax_vjp(P, dT, sink_probs(prob.sink, fwd.lse[..., None]), d_sink=dsinks)[0]
        cr = constant_rows(fwd.empty, prob.padded_rows(), o.fully_masked)
        if cr is not None:
            dP = np.where(cr, dP.dtype.type(0), dP)
        dO = _grouped(dropout_jvp(dP, prob.keep, o.dropout_p), prob) @ v
    if dv is not None:
        Pd = _grouped(dropout_forward(P, prob.keep, o.dropout_p), prob)
        dO_v = Pd @ _kv(dv)
        dvu = prob.averaged_values(fwd.empty, dv, dv_full)
        if dvu is not dv:
            dO_v = np.where(_grouped(fwd.empty, prob), Pd @ _kv(dvu), dO_v)
        dO = dO_v if dO is None else dO + dO_v
    if dO is None:
        return np.zeros(prob.full_scores[:-1] + (prob.v.shape[-1],), prob.dtype)
    return _full(dO, prob)


# ---------------------------------------------------------------- layouts


def _kv(x):
    """``(..., Hkv, S, n)`` -> ``(..., Hkv, 1, S, n)``: one kv head against its group of query heads."""
    return x[..., None, :, :]


def _grouped(x, prob):
    """``(*batch, Hq, L, n)`` -> ``(*batch, Hkv, G, L, n)`` (a view)."""
    return x.reshape(x.shape[:-3] + (prob.Hkv, prob.G) + x.shape[-2:])


def _full(x, prob, copy=False):
    """``(..., Hkv, G, L, n)`` -> ``(*batch, Hq, L, n)``, broadcast over batch dims only ``value`` has.

    With ``copy``, always a fresh array that the caller may write into.
    """
    x = x.reshape(x.shape[:-4] + (prob.Hq,) + x.shape[-2:])
    want = prob.batch + x.shape[-3:]
    if x.shape != want:
        return np.broadcast_to(x, want).copy() if copy else np.broadcast_to(x, want)
    return x
