r"""``precision="reproducible"``'s double backward: the plain engine's second order, rounded once.

:func:`backward_jvp` is :func:`sdpa_ref.attention.backward_jvp` (each line of the backward differentiated by
the product rule) evaluated in the problem's arithmetic (:func:`sdpa_ref.exact.arith.for_problem`): in float64,
double-double with every matrix product formed exactly by the Ozaki scheme, each result rounded to float64 once,
at the end, as the first-order reproducible engine (:mod:`sdpa_ref.engines.reproducible`) does. The formulas
are the stages' own, run over the arithmetic, not copied:

* the softmax's second order, every row sum pivoted at the row's largest probability (the extra logits, sinks,
  included): :func:`sdpa_ref.normalize.vjp_jvp_scores` over ``X``;
* the score chain's tangent, slope and the slope's tangent (softcap's
  :math:`-\tfrac{2}{c}\tanh\,\operatorname{sech}^2`): :func:`sdpa_ref.transforms.transform_scores_jvp`,
  :func:`~sdpa_ref.transforms.transform_scores_slope_jvp_in`, :func:`~sdpa_ref.transforms.transform_scores_vjp_jvp`;
* dropout's :math:`Z / (1 - p)`: :func:`sdpa_ref.transforms.dropout_in`; the policy's constant rows:
  :func:`sdpa_ref.policy.constant_rows`; every sum to a broadcast input's shape:
  :func:`sdpa_ref.broadcast.unbroadcast` in the arithmetic's fixed order; MLA's ``qv``: the joined gradients'
  tangents split in the arithmetic (:meth:`sdpa_ref.absorbed.Absorbed.split`) before the one rounding.

The forward's full-precision ``P``, ``P_drop``, softcap's :math:`\operatorname{sech}^2` and the extra columns'
probability are its residuals' (``Forward.extra``). Every step is an IEEE operation element by element, a
fixed-order sum or an exact product, so the bits do not depend on the thread count, the BLAS or the SIMD level,
and every float64 result is within one ulp of the exact value of the formula on the given inputs, with the
first order's exemption: a value that is itself the result of a cancellation of more than about ``2**45``
(SEMANTICS.md, "Reproducible precision"). Where an intermediate leaves the double-double range (about
``2**995``) it raises the first order's ``ValueError`` rather than return a NaN that no input or policy asked for.
"""

from __future__ import annotations

import numpy as np

from ..broadcast import block_of, unbroadcast
from ..exact.arith import for_problem
from ..normalize import EXTRA_NAME, extra_shape, vjp_jvp_scores
from ..policy import constant_rows, counts
from ..transforms import dropout_in, transform_scores_jvp, transform_scores_slope_jvp_in, transform_scores_vjp, \
    transform_scores_vjp_jvp, zero_masked_slope_in
from .contract import Forward, Grads
from .reproducible import _any_to, _by_rows, _fold, _fold_q, _full, _grouped, _key_spans, _kv, _nan_rows, \
    _no_silent_nan, _quiet, _round, _t

__all__ = ["backward_jvp"]


@_quiet
def backward_jvp(prob, fwd: Forward, dO, dlse=None, dq=None, dk=None, dv=None, dbias=None, dextra=None, ddO=None,
                 ddlse=None, *, arith=None, absorbed=None) -> Grads:
    """The tangent of the reproducible backward, with :func:`sdpa_ref.attention.backward_jvp`'s arguments (the
    forward of :func:`sdpa_ref.engines.reproducible.forward`, tangents in the core's layouts, None zero), every
    gradient's tangent rounded once. ``arith``: the arithmetic (default: the problem's); ``absorbed``: MLA's
    ``qv`` joined (:class:`sdpa_ref.absorbed.Absorbed`), whose split then rides in ``Grads.absorbed``."""
    X = arith or for_problem(prob)
    o, full, nd, keep, p = prob.options, prob.full_scores, len(prob.full_scores), prob.keep, prob.options.dropout_p
    P, Pd, sd, pe = (fwd.extra[n] for n in ("P", "Pd", "sech2", "p_extra"))
    allowed = prob.allowed()
    cr = constant_rows(fwd.empty, prob.padded_rows(), o.fully_masked, counts(prob))
    dOg, vT = _grouped(dO, prob), _t(_kv(prob.v))
    # the products the rows read: dO V^T (the backward's dP), Traw' = s (dQ K^T + Q dK^T), ddO V^T + dO dV^T
    # (dP'), and the raw scores Traw where the chain has a slope (the forward's, bit for bit)
    # (on each row's allowed keys, and contracted over them below: P, P' and every dT are 0 outside; the slope's
    # tangent reads Traw' at every entry)
    row_keys, key_rows = _key_spans(prob, fwd.empty), _key_spans(prob, fwd.empty, keys=True)
    dPu = _full(X.matmul(dOg, vT, spans=row_keys), prob)
    traw_t = _joined_product(X, (dq, prob.q), (prob.k, dk),        # [dQ | Q] [K | dK]^T: one exact sum
                             spans=row_keys if sd is None else None)
    traw_t = None if traw_t is None else _full(X.mul_d(traw_t, prob.scale), prob)
    ddPu = _sum(X, None if ddO is None else X.matmul(_grouped(ddO, prob), vT, spans=row_keys),
                None if dv is None else X.matmul(dOg, _t(_kv(dv)), spans=row_keys))
    ddPu = None if ddPu is None else _full(ddPu, prob)
    Traw = None if sd is None else _full(X.matmul(prob.q, _t(_kv(prob.k)), scale=prob.scale), prob)
    keep_ddT = prob.mask_float is not None or prob.bias is not None
    ddT_all = X.empty(full) if keep_ddT else None
    Pt_drop, dTraw, ddTraw = X.empty(full), X.empty(full), X.empty(full)
    ddx = None if pe is None else X.empty(full[:-1] + (1,))

    def rows(lead, r):
        """One block of rows: every step between the products is row by row."""
        ix = lead + (slice(*r),)

        def blk(a):                                                 # a float array's block (None stays None)
            return block_of(a, nd, lead, r)

        def zeros():
            return X.lift(np.zeros(X.value(X.at(P, ix)).shape))

        kb = blk(keep)
        s = None if sd is None else zero_masked_slope_in(X, prob, X.at(sd, ix), blk(allowed))   # 0 where excluded
        # dP = (dO V^T) Z / (1 - p), T' = Traw' sech^2 + dB, dP' = (ddO V^T + dO dV^T) Z / (1 - p)
        g = dropout_in(X, X.at(dPu, ix), kb, p)
        tr = zeros() if traw_t is None else X.at(traw_t, ix)
        t_t = transform_scores_jvp(tr, s, blk(dbias), X=X)
        h = zeros() if ddPu is None else dropout_in(X, X.at(ddPu, ix), kb, p)
        # the softmax's second order, every row sum pivoted (normalize.vjp_jvp_scores, over X)
        dT, Pt, ddT, ext = vjp_jvp_scores(X.at(P, ix), g, t_t, h, None if pe is None else X.at(pe, ix),
                                          blk(dextra), blk(dlse), blk(ddlse), X=X)
        c = blk(cr)
        if c is not None:                                           # the policy's constant rows: no derivative
            dT, Pt, ddT = (X.where(c, X.const(0.0), x) for x in (dT, Pt, ddT))
        if ext is not None:
            X.put(ddx, ix, ext[2] if c is None else X.where(c, X.const(0.0), ext[2]))
        if ddT_all is not None:
            X.put(ddT_all, ix, ddT)
        X.put(Pt_drop, ix, dropout_in(X, Pt, kb, p))
        # dTraw = dT sech^2  =>  dTraw' = dT' sech^2 + dT (sech^2)'
        ds = None if s is None else transform_scores_slope_jvp_in(X, prob, X.at(Traw, ix), s, tr, lead, r,
                                                                  allowed=blk(allowed))
        X.put(dTraw, ix, transform_scores_vjp(dT, s, X=X))
        X.put(ddTraw, ix, transform_scores_vjp_jvp(dT, ddT, s, ds, X=X))

    _by_rows(full, rows)
    # dV = P_drop^T dO  =>  dV' = P_drop'^T dO + P_drop^T ddO, the GQA group folded into the contraction
    dv_t = _sum(X, X.matmul(_t(_fold(_grouped(Pt_drop, prob))), _fold(dOg), contract=key_rows),
                None if ddO is None else X.matmul(_t(_fold(_grouped(Pd, prob))), _fold(_grouped(ddO, prob)),
                                                  contract=key_rows))
    dmask = None if prob.mask_float is None else _round(X, unbroadcast(ddT_all, prob.shapes["attn_mask"], X))
    dbias_t = None if prob.bias is None else _round(X, unbroadcast(ddT_all, prob.shapes["bias"], X))
    # dQ = s dTraw K, dK = s dTraw^T Q  =>  dQ' = s (dTraw' K + dTraw K'), dK' = s (dTraw'^T Q + dTraw^T Q')
    dTg, ddTg = _grouped(dTraw, prob), _grouped(ddTraw, prob)
    dq_t = _sum(X, X.matmul(ddTg, _kv(prob.k), contract=row_keys),
                None if dk is None else X.matmul(dTg, _kv(dk), contract=row_keys))
    dq_t = _full(X.mul_d(dq_t, prob.scale), prob)
    dk_t = _sum(X, X.matmul(_t(_fold(ddTg)), _fold_q(prob), contract=key_rows),
                None if dq is None else X.matmul(_t(_fold(dTg)), _fold(np.broadcast_to(dq, prob.batch + dq.shape[-4:])),
                                                 contract=key_rows))
    dk_t = X.mul_d(dk_t, prob.scale)
    dextra_t = None
    if ddx is not None:                                             # summed over the rows, then to (..., Hq)
        dextra_t = _round(X, unbroadcast(X.sum(X.at(ddx, (Ellipsis, 0)), axis=-1), extra_shape(prob), X))
    nan_rows = _nan_rows(prob, fwd.empty)                           # NaN by the "nan" policy, and nowhere else
    heads = None if nan_rows is None else np.any(_grouped(nan_rows, prob), axis=(-3, -2))[..., None]
    for x, ok, what in ((dq_t, nan_rows, "dq tangent"), (dk_t, heads, "dk tangent"), (dv_t, heads, "dv tangent"),
                        (ddT_all, nan_rows, "attn_mask or bias gradient's tangent")):
        if x is not None:
            _no_silent_nan(X, x, ok, what)
    if dextra_t is not None:
        _no_silent_nan(X, dextra_t, None if nan_rows is None else _any_to(np.any(nan_rows, axis=(-2, -1)),
                                                                            extra_shape(prob)), f"{EXTRA_NAME} tangent")
    dq_t, dk_t, dv_t = (unbroadcast(x, prob.shapes[n], X) for x, n in ((dq_t, "query"), (dk_t, "key"),
                                                                         (dv_t, "value")))
    split = None if absorbed is None else tuple(_round(X, x) for x in absorbed.split(dq_t, dk_t, dv_t, arith=X))
    return Grads(dq=_round(X, dq_t), dk=_round(X, dk_t), dv=_round(X, dv_t), dmask=dmask, dbias=dbias_t,
                 dextra=dextra_t, absorbed=split)


def _joined_product(X, lefts, rights, spans=None):
    """``sum_i lefts[i] @ rights[i]^T`` over the pairs with neither None, as one exact product of the pairs
    joined along the contraction (``(..., Hkv, G, L, n)`` against ``(..., Hkv, S, n)``), rounded once (on the
    columns ``spans`` wants, :func:`sdpa_ref.exact.ozaki.matmul`); None when no pair is whole."""
    pairs = [(a, b) for a, b in zip(lefts, rights) if a is not None and b is not None]
    if not pairs:
        return None
    ls = np.broadcast_arrays(*(a for a, _ in pairs))
    rs = np.broadcast_arrays(*(b for _, b in pairs))
    return X.matmul(np.concatenate(ls, axis=-1), _t(_kv(np.concatenate(rs, axis=-1))), spans=spans)


def _sum(X, a, b):
    """``a + b`` of two values of ``X``, either None (zero); None when both are."""
    if a is None or b is None:
        return b if a is None else a
    return X.add(a, b)
