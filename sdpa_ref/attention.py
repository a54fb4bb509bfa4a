r"""The plain engine: attention's forward, backward and JVP with every option, written as the derivation reads.

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
                                                    normalize.row_softmax; rows with no key: the policy
             [m, s = max(m, sink), s e^(m-m') + e^(sink-m')]   normalize.close: the extra logits (sinks), each
                                                    a score with no value
    LSE    = m + log s
    P_drop = P * Z / (1 - p)                        dropout_forward
    O      = P_drop V

Backward, from ``dO`` (and ``dlse``, the LSE's cotangent, when given)::

    dV     = P_drop^T dO, summed over the group     (the group shares one kv head)
    dP     = (dO V^T) * Z / (1 - p)
    dT     = P * (dP - rowsum(P * dP))              normalize.vjp (pivoted: see row_pivot)
             [+ P * dlse]                           d LSE / dT = P (undropped)
    dsink  = -p_sink * (D - dlse)                   an extra logit's column has dP = 0
    dB     = dT summed to the mask's / bias's shape additive_vjp
    dTraw  = dT * (1 - tanh^2)                      softcap_vjp (only with softcap; as sech^2, no cancellation)
    dQ     = scale * dTraw K
    dK     = scale * dTraw^T Q, summed over the group

JVP, along ``(dQ, dK, dV, dB)``::

    dTraw  = scale * (dQ K^T + Q dK^T)
    dT     = dTraw * (1 - tanh^2) + dB
    dP     = P * (dT - rowsum(P * dT))              normalize.vjp: J is symmetric
    dO     = (dP * Z / (1 - p)) V + P_drop dV

Double backward (the tangent of the backward, :func:`backward_jvp`), along the input tangents above and the
cotangents' tangents ``ddO``, ``ddlse``; ``x'`` is the tangent of ``x``, every line the product rule on a line
of the backward::

    T', P'                                          the JVP's lines above (P' = J T', with the sinks' p_sink')
    dV'    = P_drop'^T dO + P_drop^T ddO, summed over the group
    dP'    = (ddO V^T + dO dV^T) * Z / (1 - p)      dV^T here is the value tangent, not the gradient
    dT'    = P * (dP' - rowsum(P * dP') [+ ddlse])  J's map on the tangents (normalize.vjp_jvp_scores) ...
             + P' * (dP - D [+ dlse]) - P * rowsum(P' * dP)      ... and J' dP: the softmax's second order
    dsink' = p_sink' (dlse - D) - p_sink rowsum(P' * dP) + the map's sink entry
    dB'    = dT' summed to the bias's shape
    dTraw' = dT' * sech^2 + dT * (sech^2)',  (sech^2)' = -(2/c) tanh(Traw/c) sech^2 Traw'
    dQ'    = scale (dTraw' K + dTraw dK)        (dK: the key tangent)
    dK'    = scale (dTraw'^T Q + dTraw^T dQ)    (dQ: the query tangent), summed over the group

The Hessian-vector product of a loss ``<g, O> + <glse, LSE>`` is the case ``ddO = 0``, ``ddlse = 0``.
"""

from __future__ import annotations

import numpy as np

from .engines.blocks import Blocks
from .broadcast import block_of
from .engines.contract import Forward, Grads
from .policy import constant_rows, counts, excluded, fill_empty_rows, fill_output_without_keys, zero_output_rows
from .normalize import close, extra_probs, extras, row_softmax, vjp, vjp_jvp_scores
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
    transform_scores_slope_jvp,
    transform_scores_vjp,
    transform_scores_vjp_jvp,
)

__all__ = ["forward", "backward", "backward_jvp", "jvp"]


def forward(prob, *, save_probs=True, rows=None, cols=None) -> Forward:
    """The plain forward: ``(O, LSE, P, tanh, empty)`` in the layouts of the legend.

    ``rows`` and ``cols``, ``(start, stop)`` ranges, restrict every line to one window of the scores, whose
    columns hold every allowed key of those rows (:mod:`sdpa_ref.heads` runs the allowed set's key spans so):
    every row result (``O``, the LSE, the normaliser) is then the rows' own, and ``P`` and the slope are the
    window's entries (``P`` is 0 outside it), except on a row with no key that the policy fills past the window
    (``"nan"``, ``"uniform"``, ``"jax"``), which the caller runs again on whole rows.
    """
    o = prob.options
    win = rows is not None or cols is not None
    r0, r1 = rows if rows is not None else (0, prob.L)
    c0, c1 = cols if cols is not None else (0, prob.S)
    q = prob.q[..., r0:r1, :] if win else prob.q
    k, v = (_kv(x[..., c0:c1, :] if win else x) for x in (prob.k, prob.v))
    Traw = scores_forward(q, k, prob.scale)                         # Traw = scale Q K^T   (..., Hkv, G, L, S)
    T = _full(Traw, prob, copy=True)                                # the same scores as (..., Hq, L, S)
    T, sech2 = transform_scores(prob, T, rows, cols, sech2=save_probs)  # T = c tanh(Traw/c) + M + B + ALiBi;
    #                                                                 -inf outside A; sech2 = 1 - tanh^2(Traw/c)
    P, m, s, empty = row_softmax(T)                                 # P = exp(T - m) / s; exp(-inf) = 0; empty:
    #                                                                 no allowed key; a NaN or +inf score: NaN row
    nrm = close(m, s, empty, extras(prob, rows))                    # the normaliser closed by its extra logits
    lse_keys = max_keys = None
    if nrm.r is not None:                                           # (sinks: one more score each, no value)
        with np.errstate(divide="ignore"):
            lse_keys = (m + np.log(s))[..., 0]                      # the LSE over the keys alone (FlashMLA's)
        max_keys = np.where(empty, -np.inf, m)[..., 0]              # and their own max (FlashMLA's max_logits)
        P = np.where(empty, P.dtype.type(0), P) * nrm.r             # P' = P r, r = e^(m - m') s / s'
    m, s, empty = nrm.m, nrm.s, nrm.empty                           # m' = max(m, sink), s' = s e^(m-m') + ...
    with np.errstate(divide="ignore"):
        lse = m + np.log(s)                                         # LSE = m + log s; -inf on a row with no key
    P = fill_empty_rows(P, empty, prob.padded_rows(rows), o.fully_masked, prob.S,   # the policy's P on such rows
                        n=counts(prob, rows), excl=excluded(prob, rows, cols))
    keep = block_of(prob.keep, len(prob.full_scores), None, (r0, r1), (c0, c1)) if win else prob.keep
    P_drop = dropout_forward(P, keep, o.dropout_p)                  # P_drop = P Z / (1 - p)
    O = _full(_grouped(P_drop, prob) @ v, prob)                     # O = P_drop V
    O = _policy_output(prob, O, P_drop, empty, rows)                # rows with no key: as the policy says
    return Forward(out=O, lse=lse[..., 0], probs=P if save_probs else None,
                   slope=sech2 if save_probs else None, empty=empty, rowmax=m, rowsum=s, lse_keys=lse_keys,
                   rowmax_keys=max_keys)


def _policy_output(prob, O, P_drop, empty, rows=None):
    """``O`` on the rows with no allowed key, by the ``fully_masked`` policy: ``"uniform"`` averages every value
    (even those the other rows skip), ``"zero"`` and padded rows are 0 without reading a value, ``S = 0`` as the
    policy says. Layout and policy only: no derivative flows through these lines. ``rows``: ``O`` is those rows'
    (a window of :func:`forward`): a row that averages values past the window is left as computed, and the
    caller runs such a problem's whole rows again (:func:`sdpa_ref.heads.forward`)."""
    o, pad = prob.options, prob.padded_rows(rows)
    vu = prob.averaged_values(empty)
    if vu is not prob.v and rows is None:                           # "uniform": such a row reads every value
        O = np.where(empty, _full(_grouped(P_drop, prob) @ _kv(vu), prob), O)
    nan = prob.nan_rows_without_keys()
    O = fill_output_without_keys(O, nan if nan is None or rows is None else nan[..., rows[0]:rows[1], :])
    zr = zero_output_rows(empty, pad, o.fully_masked)
    return O if zr is None else np.where(zr, O.dtype.type(0), O)    # 0 by definition: no value is read


def backward(prob, fwd: Forward, dO, dlse=None) -> Grads:
    """The plain backward from the saved ``P``: see the module docstring. ``dlse`` ``(*batch, Hq, L, 1)``, the
    cotangent of the LSE, or None (zero).

    Each step inverts one line of :func:`forward`, last line first; the comment names the line and the rule
    that gives the gradient (for a product ``C = A B``: ``dA = dC B^T``, ``dB = A^T dC``).
    """
    o = prob.options
    P, sech2 = fwd.probs, fwd.slope
    k, v = _kv(prob.k), _kv(prob.v)
    dO = _grouped(dO, prob)                                         # (..., Hkv, G, L, Ev)
    P_drop = dropout_forward(P, prob.keep, o.dropout_p)
    # O = P_drop V  =>  dV = P_drop^T dO (summed over the G query heads that share the kv head), dP_drop = dO V^T
    dv = (np.swapaxes(_grouped(P_drop, prob), -1, -2) @ dO).sum(axis=-3)
    # P_drop = P Z / (1 - p), element-wise  =>  dP = dP_drop Z / (1 - p)
    dP = dropout_vjp(_full(dO @ np.swapaxes(v, -1, -2), prob), prob.keep, o.dropout_p)
    # P = softmax(T), J = diag(P) - P P^T (symmetric)  =>  dT = J dP = P * (dP - D), D = rowsum(P * dP);
    # LSE = log sum exp T, d LSE / dT = P  =>  dT += P * dlse;  an extra logit (a sink) is a column with
    # dP = 0 and P = p_sink, so its gradient is -p_sink (D - dlse)
    p_extra = extra_probs(extras(prob), fwd.rowmax, fwd.rowsum)
    dT, dextra = vjp(P, dP, p_extra, dlse)                          # P * (dP - rowsum(P * dP) [+ dlse]), pivoted
    cr = constant_rows(fwd.empty, prob.padded_rows(), o.fully_masked, counts(prob))
    if cr is not None:                                              # the policy's P there is a constant: dT = 0
        dT = np.where(cr, dT.dtype.type(0), dT)
        dextra = None if dextra is None else np.where(cr, dextra.dtype.type(0), dextra)
    # T = ... + M + B, broadcast  =>  dM = dB = dT summed over the axes M and B were broadcast along
    dmask = None if prob.mask_float is None else additive_vjp(dT, prob.shapes["attn_mask"])
    dbias = None if prob.bias is None else additive_vjp(dT, prob.shapes["bias"])
    # T = fn(c tanh(Traw / c); theta)  =>  dtheta = sum dT dfn/dtheta (the score function's captured tensors)
    dmod = Blocks(prob).mod_grads(dT, 0, prob.L, 0, prob.S)
    # T = fn(c tanh(Traw / c))  =>  dTraw = dT * fn' * (1 - tanh^2(Traw / c))   (sech2: the chain's slope)
    dTraw = transform_scores_vjp(dT, sech2)
    # Traw = scale Q K^T  =>  dQ = scale dTraw K, dK = scale dTraw^T Q (summed over the group)
    dq, dk = scores_vjp(_grouped(dTraw, prob), prob.q, k, prob.scale)
    return Grads(dq=_full(dq, prob), dk=dk.sum(axis=-3), dv=dv, dmask=dmask, dbias=dbias,
                 dextra=None if dextra is None else dextra[..., 0].sum(axis=-1),   # summed over the rows
                 dmod=None if dmod is None else tuple(dmod))


def jvp(prob, fwd: Forward, dq=None, dk=None, dv=None, dbias=None, dv_full=None, dextra=None):
    """The output tangent ``dO`` ``(..., Hq, L, Ev)`` along the input tangents (None means zero).

    ``dq`` is in the layout of ``prob.q``; ``dk``, ``dv`` in that of ``prob.k``, ``prob.v``;
    ``dbias`` broadcastable to the scores; ``dv_full`` the value tangent that the fully masked rows of
    ``"uniform"`` average (``Problem.clean_tangents``); ``dextra`` the extra logits' (the sinks') tangent
    ``(..., Hq, 1, 1)``.
    """
    o = prob.options
    P, sech2 = fwd.probs, fwd.slope
    k, v = _kv(prob.k), _kv(prob.v)
    dO = None
    if dq is not None or dk is not None or dbias is not None or dextra is not None:
        dTraw = scores_jvp(prob.q, k, dq, None if dk is None else _kv(dk), prob.scale)
        dTraw = np.zeros(prob.full_scores, prob.dtype) if dTraw is None else _full(dTraw, prob)
        dT = transform_scores_jvp(dTraw, sech2, dbias)
        dT = np.broadcast_to(dT, P.shape)
        p_extra = extra_probs(extras(prob), fwd.rowmax, fwd.rowsum)     # J is symmetric: the VJP's map, an extra
        dP = vjp(P, dT, p_extra, d_extra=dextra)[0]                 # column's entry its tangent d sigma:
        #                                                             P * (dT - rowsum(P * dT) - p_sink d sigma)
        cr = constant_rows(fwd.empty, prob.padded_rows(), o.fully_masked, counts(prob))
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


def backward_jvp(prob, fwd: Forward, dO, dlse=None, dq=None, dk=None, dv=None, dbias=None, dextra=None,
                 ddO=None, ddlse=None, *, rows=None, cols=None) -> Grads:
    """The tangent of :func:`backward` (the double backward): how each gradient moves along the input tangents
    (those of :func:`jvp`, None is zero) and the cotangents' tangents ``ddO`` ``(*batch, Hq, L, Ev)`` and
    ``ddlse`` ``(*batch, Hq, L, 1)`` (None: zero). See the module docstring; each step differentiates one line
    of :func:`backward` by the product rule, and the softmax's step is :func:`sdpa_ref.normalize.vjp_jvp_scores`
    (every row sum pivoted at the row's largest probability, as the tiled schedule's).

    ``rows`` and ``cols``, ``(start, stop)`` ranges, restrict every line to one window of the scores, whose
    columns hold every key of those rows where ``P`` is not 0 (the caller's promise: :mod:`sdpa_ref.heads` runs
    the allowed set's key spans so). Every row sum then sums the same nonzero terms, and the window's lines are
    the whole problem's on its entries: ``dq`` is the rows' (``(*batch, Hq, i1 - i0, E)``), ``dk``, ``dv`` and
    ``dextra`` the window's parts of sums over rows, which the caller adds. No mask or bias tangent is taken on
    a window (``dmask``, ``dbias`` need the whole matrix).
    """
    o = prob.options
    win = rows is not None or cols is not None
    if win and (prob.mask_float is not None or prob.bias is not None):
        raise ValueError("a window of the double backward takes no float mask or bias (their tangents are sums "
                         "over the whole score matrix)")
    r0, r1 = rows if rows is not None else (0, prob.L)
    c0, c1 = cols if cols is not None else (0, prob.S)
    nd = len(prob.full_scores)
    block = (lambda a: block_of(a, nd, None, (r0, r1), (c0, c1))) if win else (lambda a: a)
    at_rows = (lambda a: None if a is None else a[..., r0:r1, :]) if win else (lambda a: a)
    at_cols = (lambda a: None if a is None else a[..., c0:c1, :]) if win else (lambda a: a)
    P, sech2, keep = block(fwd.probs), block(fwd.slope), block(prob.keep)
    q, k, v = at_rows(prob.q), _kv(at_cols(prob.k)), _kv(at_cols(prob.v))
    dq, dk, dv, dO, dlse, ddO, ddlse = (at_rows(dq), at_cols(dk), at_cols(dv), at_rows(dO), at_rows(dlse),
                                        at_rows(ddO), at_rows(ddlse))
    shape = prob.full_scores[:-2] + (r1 - r0, c1 - c0)
    dO_g = _grouped(dO, prob)
    cr = constant_rows(at_rows(fwd.empty), prob.padded_rows(rows), o.fully_masked, counts(prob, rows))

    def const(x):                                                   # the policy's constant rows: no derivative
        return x if cr is None or x is None else np.where(cr, x.dtype.type(0), x)

    # the backward's own line that the tangent reads: dP
    P_drop = dropout_forward(P, keep, o.dropout_p)
    dP = dropout_vjp(_full(dO_g @ np.swapaxes(v, -1, -2), prob), keep, o.dropout_p)
    p_extra = extra_probs(extras(prob, rows), at_rows(fwd.rowmax), at_rows(fwd.rowsum))
    # the forward's tangent: Traw', T'
    dTraw_t = scores_jvp(q, k, dq, None if dk is None else _kv(dk), prob.scale)
    dTraw_t = np.zeros(shape, prob.dtype) if dTraw_t is None else _full(dTraw_t, prob)
    dT_t = np.broadcast_to(transform_scores_jvp(dTraw_t, sech2, dbias), P.shape)
    # dP = (dO V^T) Z / (1 - p)  =>  dP' = (ddO V^T + dO dV^T) Z / (1 - p)
    ddP = np.zeros_like(dP) if ddO is None else _full(_grouped(ddO, prob) @ np.swapaxes(v, -1, -2), prob)
    if dv is not None:
        ddP = ddP + _full(dO_g @ np.swapaxes(_kv(dv), -1, -2), prob)
    ddP = dropout_vjp(ddP, keep, o.dropout_p)
    # P' = J T' (with the sinks' p_sink'); dT = J dP + P dlse  =>  dT' = J dP' + P ddlse + J' dP + P' dlse (the
    # softmax's second order), every row sum pivoted at the row's largest P (normalize.vjp_jvp_scores)
    dT, dP_t, ddT, ext = vjp_jvp_scores(P, dP, dT_t, ddP, p_extra, dextra, dlse, ddlse)
    dT, dP_t, ddT, ddx = const(dT), const(dP_t), const(ddT), const(None if ext is None else ext[2])
    dTraw = transform_scores_vjp(dT, sech2)
    # dV = P_drop^T dO  =>  dV' = P_drop'^T dO + P_drop^T ddO, summed over the group
    dv_t = np.swapaxes(_grouped(dropout_forward(dP_t, keep, o.dropout_p), prob), -1, -2) @ dO_g
    if ddO is not None:
        dv_t = dv_t + np.swapaxes(_grouped(P_drop, prob), -1, -2) @ _grouped(ddO, prob)
    dv_t = dv_t.sum(axis=-3)
    dmask = None if prob.mask_float is None else additive_vjp(ddT, prob.shapes["attn_mask"])
    dbias_t = None if prob.bias is None else additive_vjp(ddT, prob.shapes["bias"])
    # dTraw = dT sech^2  =>  dTraw' = dT' sech^2 + dT (sech^2)'   (sech^2: the chain's slope, softcap's times fn')
    dsech2 = None
    if sech2 is not None:
        Traw = _full(scores_forward(q, k, prob.scale), prob)
        dsech2 = transform_scores_slope_jvp(prob, Traw, sech2, dTraw_t, rows, cols, allowed=prob.allowed(rows, cols))
    ddTraw = transform_scores_vjp_jvp(dT, ddT, sech2, dsech2)
    # dQ = s dTraw K, dK = s dTraw^T Q  =>  dQ' = s (dTraw' K + dTraw K'), dK' = s (dTraw'^T Q + dTraw^T Q')
    dq_t, dk_t = scores_vjp(_grouped(ddTraw, prob), q, k, prob.scale)
    if dk is not None:
        dq_t = dq_t + scores_vjp(_grouped(dTraw, prob), q, _kv(dk), prob.scale)[0]
    if dq is not None:
        dk_t = dk_t + scores_vjp(_grouped(dTraw, prob), dq, k, prob.scale)[1]
    return Grads(dq=_full(dq_t, prob), dk=dk_t.sum(axis=-3), dv=dv_t, dmask=dmask, dbias=dbias_t,
                 dextra=None if ddx is None else ddx[..., 0].sum(axis=-1))


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
