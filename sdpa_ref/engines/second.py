r"""The tiled engine's double backward: :func:`sdpa_ref.attention.backward_jvp` in bounded memory.

The plain engine's double backward holds ``P``, ``P'``, ``dP``, ``dP'`` and their scores as whole
``L x S`` arrays. Here, as in the tiled backward, each block of rows walks the key blocks twice and recomputes
:math:`P = e^{T - m} / s` from the forward's row max and sum; no ``L x S`` array is made. Every quantity
of the derivation is a row sum or a block's own product, so two sweeps suffice:

* the first takes each key block's pivot (``dP``, ``T'``, ``dP'`` at the block's largest ``P``) and its row
  sums relative to it (:func:`sdpa_ref.pivot.second_partial`), and joins them, with the extra logits of the
  normaliser as one more column, into the row's pivot and :math:`D`, :math:`c = \sum_j P\, T'`,
  :math:`D' = \sum_j P\, dP' + \sum_j P'\, dP` taken relative to it (:func:`sdpa_ref.normalize.second_pivots`,
  :func:`sdpa_ref.pivot.combine_second`, which derives the pivoted form);
* the second recomputes each block and forms, as the core does (:func:`sdpa_ref.pivot.tangent_probs`,
  :func:`sdpa_ref.pivot.second_entries`),

  .. math::

      P' = P \odot (T' - c), \qquad dT = P \odot (dP - D + \bar\lambda), \qquad
      dT' = P \odot (dP' - D' + \bar\lambda') + P' \odot (dP - D + \bar\lambda),

  each difference with a row sum taken relative to the pivot, then :math:`dV' \mathrel{+}= P'^T_{drop} dO +
  P^T_{drop} dO'`, :math:`dQ'`, :math:`dK'` from :math:`dT_{raw} = dT\, \mathrm{sech}^2` and
  :math:`dT'_{raw} = dT' \mathrm{sech}^2 + dT\, (\mathrm{sech}^2)'`, and the bias's and the extra logits'
  tangents (:func:`sdpa_ref.normalize.extra_second`).

The row sums are pivoted as the first-order engines' are, by the same functions as the core's
(:func:`sdpa_ref.normalize.vjp_jvp_scores`), so a dominant key or sink costs neither schedule its accuracy
(``tests/test_engines_second.py``).
"""

from __future__ import annotations

import numpy as np

from ..normalize import extra_probs, extra_second, extras, nan_row_probs, second_pivots
from ..pivot import second_entries, second_partial, tangent_probs
from ..policy import constant_rows, counts, excluded, fill_empty_rows, fills_zero
from ..transforms import dropout_forward, scores_jvp, scores_vjp, transform_scores_jvp, transform_scores_slope_jvp, \
    transform_scores_vjp, transform_scores_vjp_jvp, unbroadcast
from ..broadcast import block_of
from .blocks import Blocks, check_block_size, exp_inplace as _exp, ranges as _ranges
from .contract import Grads

__all__ = ["backward_jvp"]


def backward_jvp(prob, fwd, dO, dlse=None, dq=None, dk=None, dv=None, dbias=None, dextra=None, ddO=None,
                 ddlse=None, *, block_size="auto") -> Grads:
    """The tangent of the backward, as :func:`sdpa_ref.attention.backward_jvp` (the same arguments), from the
    tiled forward's row max and sum, ``block_size`` rows by ``block_size`` keys at a time."""
    b = check_block_size(block_size, prob)
    bl, ct = Blocks(prob), prob.dtype
    full, E, Ev = prob.full_scores, prob.q.shape[-1], prob.v.shape[-1]
    out = {"dq": np.zeros(full[:-1] + (E,), ct), "dk": np.zeros(prob.batch + (prob.Hkv, prob.S, E), ct),
           "dv": np.zeros(prob.batch + (prob.Hkv, prob.S, Ev), ct)}
    acc = {"attn_mask": None if prob.mask_float is None else np.zeros(prob.shapes["attn_mask"], ct),
           "bias": None if prob.bias is None else np.zeros(prob.shapes["bias"], ct)}
    dext = None if extras(prob) is None else np.zeros(full[:-1], ct)
    q4 = None if dq is None else dq.reshape(dq.shape[:-4] + (prob.Hq,) + dq.shape[-2:])
    for i0, i1 in _ranges(prob.L, b):
        _rows(prob, bl, fwd, i0, i1, b, dO, dlse, (q4, dk, dv, dbias, dextra), ddO, ddlse, out, acc, dext)
    return Grads(dq=out["dq"], dk=out["dk"], dv=out["dv"], dmask=acc["attn_mask"], dbias=acc["bias"],
                 dextra=None if dext is None else dext.sum(axis=-1))


def _rows(prob, bl, fwd, i0, i1, b, dO, dlse, tangents, ddO, ddlse, out, acc, dext):
    """One block of rows: the two sweeps over the key blocks."""
    o, ct, nd = prob.options, prob.dtype, len(prob.full_scores)
    q4, dk, dv, dbias, dextra = tangents
    em = fwd.empty[..., i0:i1, :]
    pad = prob.padded_rows((i0, i1))
    m = fwd.rowmax.reshape(prob.full_scores[:-1] + (1,))[..., i0:i1, :]
    s = np.where(em, ct.type(1), fwd.rowsum.reshape(prob.full_scores[:-1] + (1,))[..., i0:i1, :])
    n = counts(prob, (i0, i1))
    const = constant_rows(em, pad, o.fully_masked, n)              # P does not depend on T there
    px = extra_probs(extras(prob, (i0, i1)), m, s)                     # the extra column's probability
    dOg = bl.grouped(dO[..., i0:i1, :])
    ddOg = None if ddO is None else bl.grouped(ddO[..., i0:i1, :])
    qI = prob.q[..., i0:i1, :]
    dqI = None if q4 is None else bl.grouped(q4[..., i0:i1, :])

    def block(j0, j1, allowed, skip):
        """``(P, dP, T', dP', keep, slope, Traw, Traw')`` of one block, as the forward made ``P``."""
        if skip:
            T, slope = np.full(prob.batch + (prob.Hq, i1 - i0, j1 - j0), -np.inf, dtype=ct), None
        else:
            T, slope = bl.scores(i0, i1, j0, j1, allowed, sech2=True)
        with np.errstate(invalid="ignore", over="ignore"):
            P = nan_row_probs(_exp(T - m) / s, T, s != s)           # a NaN row: NaN on its allowed keys only
        P = fill_empty_rows(P, em, pad, o.fully_masked, prob.S, n=n, excl=excluded(prob, (i0, i1), (j0, j1)))
        keep = bl.keep(i0, i1, j0, j1)
        vJ = prob.v[..., None, j0:j1, :]
        dP = dropout_forward(_full(dOg @ np.swapaxes(vJ, -1, -2), prob), keep, o.dropout_p)
        ddP = np.zeros_like(dP) if ddOg is None else _full(ddOg @ np.swapaxes(vJ, -1, -2), prob)
        if dv is not None:
            ddP = ddP + _full(dOg @ np.swapaxes(dv[..., None, j0:j1, :], -1, -2), prob)
        ddP = dropout_forward(ddP, keep, o.dropout_p)
        traw_t = scores_jvp(qI, prob.k[..., None, j0:j1, :], dqI, None if dk is None else dk[..., None, j0:j1, :],
                            prob.scale)
        traw_t = np.zeros(P.shape, ct) if traw_t is None else np.broadcast_to(_full(traw_t, prob), P.shape)
        db = None if dbias is None else block_of(dbias, nd, None, (i0, i1), (j0, j1))
        t_t = np.broadcast_to(transform_scores_jvp(traw_t, slope, db), P.shape)
        return P, dP, t_t, ddP, keep, slope, traw_t

    jobs = []
    for j0, j1 in _ranges(prob.S, b):
        allowed = prob.allowed((i0, i1), (j0, j1))
        skip = allowed is not None and not np.any(allowed)
        if skip and (fills_zero(o.fully_masked) or not np.any(em)):
            continue                                                # P = 0 on the whole block
        jobs.append((j0, j1, allowed, skip))
    if not jobs and px is None:
        return                                                      # P = 0 on every block, and no extra logit
    # the first sweep: each key block's pivot and pivoted row sums, joined into the row's (the extra logits first)
    with np.errstate(invalid="ignore"):
        parts = [second_partial(*block(*job)[:4]) for job in jobs]  # (P, dP, T', dP') of each block
        piv = second_pivots(parts, px, dextra)
    lam = 0 if dlse is None else dlse[..., i0:i1, :]
    lam_t = 0 if ddlse is None else ddlse[..., i0:i1, :]

    def zero_const(x):
        return x if const is None else np.where(const, ct.type(0), x)

    if dext is not None:                                            # the extra logits' gradient's tangent
        with np.errstate(invalid="ignore"):
            dext[..., i0:i1] = zero_const(extra_second(piv, px, dextra, lam, lam_t)[2])[..., 0]
    # the second sweep: each block's part of every gradient's tangent
    for job in jobs:
        j0, j1 = job[0], job[1]
        P, dP, t_t, ddP, keep, slope, traw_t = block(*job)
        with np.errstate(invalid="ignore"):
            Pt = zero_const(tangent_probs(P, t_t, piv))                 # P' = P ((T' - tau) - (c - tau))
            dT, ddT = (zero_const(x) for x in second_entries(P, Pt, dP, ddP, piv, lam, lam_t))
        dv_t = np.swapaxes(bl.grouped(dropout_forward(Pt, keep, o.dropout_p)), -1, -2) @ dOg
        if ddOg is not None:
            dv_t = dv_t + np.swapaxes(bl.grouped(dropout_forward(P, keep, o.dropout_p)), -1, -2) @ ddOg
        out["dv"][..., j0:j1, :] += dv_t.sum(axis=-3)
        for name, a in acc.items():
            if a is not None:                                       # dB' = dT', summed to B's shape
                view = block_of(a, nd, None, (i0, i1), (j0, j1))
                view += unbroadcast(ddT, view.shape)
        dslope = None
        if slope is not None:                                       # the chain's slope moves with the raw scores
            dslope = transform_scores_slope_jvp(prob, bl.raw(i0, i1, j0, j1), slope, traw_t, (i0, i1), (j0, j1),
                                                job[2])
        dTraw = transform_scores_vjp(dT, slope)
        ddTraw = transform_scores_vjp_jvp(dT, ddT, slope, dslope)
        kJ = prob.k[..., None, j0:j1, :]
        dq_i, dk_j = scores_vjp(bl.grouped(ddTraw), qI, kJ, prob.scale)
        if dk is not None:
            dq_i = dq_i + scores_vjp(bl.grouped(dTraw), qI, dk[..., None, j0:j1, :], prob.scale)[0]
        if dqI is not None:
            dk_j = dk_j + scores_vjp(bl.grouped(dTraw), dqI, kJ, prob.scale)[1]
        out["dq"][..., i0:i1, :] += dq_i.reshape(dq_i.shape[:-4] + (prob.Hq,) + dq_i.shape[-2:])
        out["dk"][..., j0:j1, :] += dk_j.sum(axis=-3)


def _full(x, prob):
    """``(..., Hkv, G, b, n)`` -> ``(*batch, Hq, b, n)``, broadcast over batch dims only ``value`` has."""
    x = x.reshape(x.shape[:-4] + (prob.Hq,) + x.shape[-2:])
    want = prob.batch + x.shape[-3:]
    return x if x.shape == want else np.broadcast_to(x, want)
