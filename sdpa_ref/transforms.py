r"""Score transforms: each one's forward, VJP and JVP side by side.

The scores of attention are built in stages (``SEMANTICS.md``)::

    Traw = scale * Q K^T                 scores_forward      / scores_vjp    / scores_jvp
    T    = cap * tanh(Traw / cap)        softcap_forward     / softcap_vjp   / softcap_jvp    (softcap_sech2,
                                                                       its tangent softcap_sech2_jvp)
    T    = fn(T, b, h, i, j)             score_mod.score_mod_forward (a user's score function; its slope
                                                                       multiplies softcap's)
    T    = T + B                         additive_forward    / additive_vjp  / additive_jvp   (float mask, bias)
    T    = T - slope * |i + off - j|     alibi_forward       (a constant: identity VJP and JVP)
    T    = -inf outside the allowed set  (masks.allowed_set)

and, after the softmax, dropout ``P_drop = P * Z / (1 - p)``
(:func:`dropout_forward`, linear, so it is its own VJP and JVP).

:func:`transform_scores`, :func:`transform_scores_vjp` and
:func:`transform_scores_jvp` run the whole chain for a problem; every engine
(the teaching core, the fast dense one and the tiled one) calls them, on the
whole ``(..., Hq, L, S)`` score array or on one block of it. Adding a
transform means one forward/VJP/JVP triple here, one line in each of the
three chains, and its tests.

Every function takes an optional ``out=`` so that the fast engine can work
in place; the arithmetic is the same either way. Constants are cast to the
scores' dtype, so ``upcast=False`` computes in the inputs' dtype throughout.
"""

from __future__ import annotations

import numpy as np

from .broadcast import unbroadcast
from .masks import block_of, diagonal_offset
from .score_mod import indices, params_vjp, score_mod_curvature, score_mod_forward

__all__ = [
    "additive_forward",
    "additive_jvp",
    "additive_vjp",
    "alibi_distance",
    "alibi_forward",
    "dropout_forward",
    "dropout_jvp",
    "dropout_vjp",
    "scores_forward",
    "scores_jvp",
    "score_mod_params_vjp",
    "scores_vjp",
    "softcap_forward",
    "softcap_jvp",
    "softcap_sech2",
    "softcap_sech2_jvp",
    "softcap_vjp",
    "transform_scores",
    "transform_scores_in",
    "transform_scores_jvp",
    "transform_scores_slope_jvp",
    "transform_scores_vjp",
    "transform_scores_vjp_jvp",
    "unbroadcast",
]


# ------------------------------------------------ scores: Traw = scale * Q K^T


def scores_forward(q, k, scale, out=None):
    """``Traw = scale * q k^T``, ``q (..., M, E)``, ``k (..., S, E)`` -> ``(..., M, S)``.

    The scale multiplies the operand with fewer rows (never the ``M x S``
    product): one rounding of ``scale * x`` either way, and less work. A
    score that overflows is IEEE's ``+-inf``, without a warning: ``-inf``
    excludes its key, softcap takes ``+-inf`` to ``+-cap``, and ``+inf``
    otherwise makes its row NaN (``SEMANTICS.md``). Products that overflow
    with opposite signs give ``+inf``, ``-inf`` or NaN (``inf - inf``), as
    the BLAS orders and fuses its sum, also without a warning; each is a
    score the rule takes as it is.
    """
    s = q.dtype.type(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        if q.shape[-2] <= k.shape[-2]:
            return np.matmul(s * q, np.swapaxes(k, -1, -2), out=out)
        return np.matmul(q, np.swapaxes(s * k, -1, -2), out=out)


def scores_vjp(dT, q, k, scale, dq_out=None, dk_out=None):
    """``dq = scale * dT k`` and ``dk = scale * dT^T q`` (per head; the caller sums a GQA group); a product that
    overflows is IEEE's ``+-inf`` or NaN, without a warning, as in :func:`scores_forward`."""
    s = dT.dtype.type(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        dq = np.multiply(np.matmul(dT, k, out=dq_out), s, out=dq_out)
        dk = np.multiply(transposed_product(dT, q, out=dk_out), s, out=dk_out)
    return dq, dk


def transposed_product(a, b, out=None):
    """``a^T b`` for a tall ``a`` ``(..., M, N)`` and a narrow ``b`` ``(..., M, E)`` -> ``(..., N, E)``: the
    product ``dV = P^T dO`` and ``dK = dT^T Q`` are of this form.

    In float64 it is computed as ``(b^T a)^T``: OpenBLAS runs that product (a short, wide result) faster than the
    one whose first operand is the transposed ``M x N`` matrix (measured on an AMD EPYC, one thread,
    ``1024 x 1024`` by ``1024 x 64``: 2.9 ms against 4.0); the same sums, another order, so the last bits may
    differ between the two forms as they do between BLAS builds. float32 keeps the direct form, which was faster
    there.
    """
    if a.dtype != np.float64:
        return np.matmul(np.swapaxes(a, -1, -2), b, out=out)
    r = np.swapaxes(np.matmul(np.swapaxes(b, -1, -2), a), -1, -2)
    if out is None:
        return np.ascontiguousarray(r)
    np.copyto(out, r)
    return out


def scores_jvp(q, k, dq, dk, scale):
    """``dTraw = scale * (dq k^T + q dk^T)``; ``dq`` or ``dk`` may be None (zero). An overflow (``scale * q``
    beyond the largest float) is IEEE's ``+-inf`` or NaN, without a warning, as in :func:`scores_forward`."""
    s = q.dtype.type(scale)
    t = None
    with np.errstate(over="ignore", invalid="ignore"):
        if dq is not None:
            t = (s * dq) @ np.swapaxes(k, -1, -2)
        if dk is not None:
            u = (s * q) @ np.swapaxes(dk, -1, -2)
            t = u if t is None else t + u
    return t


# ---------------------------------------------- softcap: T = cap * tanh(Traw / cap)


def softcap_forward(t, cap, out=None, tanh_out=None):
    """``(cap * tanh(t / cap), tanh(t / cap))``."""
    c = t.dtype.type(cap)
    with np.errstate(over="ignore"):                       # a tiny cap: t / cap overflows to inf, tanh to 1
        th = np.tanh(np.divide(t, c, out=tanh_out), out=tanh_out)
    return np.multiply(th, c, out=out), th


def softcap_sech2(t, cap, out=None):
    r"""The derivative of softcap at the raw scores ``t``: ``sech^2(t / cap) = 1 - tanh^2(t / cap)``, what its VJP
    and JVP multiply by.

    .. math::

        \frac{d}{dx}\, c \tanh(x / c) = 1 - \tanh^2(y) = \operatorname{sech}^2(y)
        = \frac{1}{\cosh^2 y}, \qquad y = x / c.

    ``1 - tanh^2`` cancels: once ``|y|`` is a few units, ``tanh^2(y)`` is 1
    to within its own rounding, which is then all of the difference (4% off
    at ``|y| = 17.6`` in float64, and 0 from ``|y| = 19.1``, where the
    derivative is still ``1e-16``). ``cosh y = (e^y + e^{-y}) / 2`` is a sum
    of positive terms, within an ulp or so for every ``y``; the reciprocal
    and the square add two roundings: a few ulps everywhere, no
    subtraction. ``cosh`` overflows from ``|y| = 710`` and ``1/cosh`` is
    then 0, as ``sech^2 < 1e-308`` is; the square of ``1/cosh`` underflows
    gradually, not ``cosh``'s square to ``inf``.
    """
    c = t.dtype.type(cap)
    with np.errstate(over="ignore"):                       # cosh overflows to inf: sech^2 is 0 there
        r = np.cosh(np.divide(t, c, out=out), out=out)
        r = np.divide(t.dtype.type(1), r, out=r)
    return np.multiply(r, r, out=r)


def softcap_vjp(sech2, g, out=None):
    """``dTraw = g * sech^2(Traw / cap)`` (:func:`softcap_sech2`: ``1 - tanh^2`` without cancellation)."""
    return np.multiply(g, sech2, out=out)


def softcap_jvp(sech2, dt, out=None):
    """An element-wise map's JVP is the same product as its VJP: ``dT = sech^2(Traw / cap) dTraw``."""
    return softcap_vjp(sech2, dt, out=out)


def softcap_sech2_jvp(t, cap, sech2, dt):
    r"""The tangent of softcap's slope :func:`softcap_sech2` along ``dt`` (the raw scores' tangent), what the
    tangent of softcap's VJP adds (its second derivative):

    .. math::

        \frac{d}{dx}\, \operatorname{sech}^2(x / c) = -\frac{2}{c} \tanh(x / c)\, \operatorname{sech}^2(x / c).

    ``t`` the raw scores, ``sech2`` their slope; both factors are bounded (``|tanh| <= 1``), so no cancellation.
    The division by ``cap`` comes last, so that a tiny cap whose ``2 / cap`` overflows still gives 0 where
    ``tanh * sech^2`` is 0 (not ``inf * 0``).
    """
    c = t.dtype.type(cap)
    with np.errstate(over="ignore", invalid="ignore"):
        th = np.tanh(t / c)
        return (t.dtype.type(-2) * th * sech2 * dt) / c


# ------------------------------------------ additive terms: T = T + B (float mask, bias)


def additive_forward(t, b, out=None):
    """``T + B``; ``-inf`` entries of ``B`` exclude their key exactly (``exp(-inf) = 0``), and so does a sum
    that overflows to ``-inf`` (no warning: it is the definition, ``SEMANTICS.md``)."""
    with np.errstate(over="ignore"):
        return np.add(t, b, out=out)


def additive_vjp(g, shape):
    """``dB = dT`` summed back to ``B``'s own (broadcast) shape."""
    return unbroadcast(g, shape)


def additive_jvp(dt, db):
    """``dT + dB`` (``dB`` may be None: a constant term)."""
    return dt if db is None else dt + db


# -------------------------------------- ALiBi: T = T - slope * |i + off - j|


def alibi_distance(L, S, alignment="top_left", q_lengths=None, kv_lengths=None, rows=None, cols=None,
                   dtype=np.float64):
    """``|i + off - j|`` in ``dtype``, broadcastable to the scores (or to one block of them)."""
    i0, i1 = rows if rows is not None else (0, L)
    j0, j1 = cols if cols is not None else (0, S)
    off = diagonal_offset(L, S, alignment, q_lengths, kv_lengths)
    return np.abs(np.arange(i0, i1)[:, None] + off - np.arange(j0, j1)[None, :]).astype(dtype)


def alibi_forward(t, slopes, dist, out=None):
    """``T - slope * dist``; ``slopes`` is ``(..., Hq, 1, 1)``. A constant term: its VJP and JVP are the identity.

    A term that overflows (a slope of ``1e308``) makes the score ``-inf``, which excludes the key.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return np.subtract(t, slopes * dist, out=out)


# ------------------------------------------- dropout: P_drop = P * Z / (1 - p)


def dropout_forward(x, keep, p, out=None):
    """``x * Z / (1 - p)`` with ``Z`` the bool keep mask; ``x`` itself without one.

    A multiply, not ``np.where``, so that a NaN row stays NaN as the formula says (``NaN * 0`` on a dropped
    entry): a ``"nan"``-policy row whose every key is dropped is NaN, as on every engine and precision.
    """
    if keep is None:
        return x
    return np.multiply(x, keep * x.real.dtype.type(1.0 / (1.0 - p)), out=out)


def dropout_vjp(g, keep, p, out=None):
    """Dropout is a diagonal linear map: its VJP is the same product."""
    return dropout_forward(g, keep, p, out=out)


dropout_jvp = dropout_vjp


# -------------------------------- the same stages over an arithmetic (:mod:`sdpa_ref.exact.arith`)
# The reproducible engine and the honest ensemble compute these terms in double-double or in a low precision
# rounded at every step; the operations, in this order, are the whole of each term's definition there.


def softcap_forward_in(X, t, cap):
    """``(cap * tanh(t / cap), sech^2(t / cap))`` in the arithmetic ``X`` (``X.sech2``: without cancellation in
    double-double, ``1 - tanh^2`` in a low precision, as such a kernel computes it). Beyond ``|t| = 1024 cap``
    ``tanh`` is 1 and ``sech^2`` 0 in every precision, so ``t`` is clamped there first (a finite argument)."""
    x = X.div(X.clamp(t, 1024.0 * cap), X.lift(cap))
    th = X.tanh(x)
    return X.mul_d(th, cap), X.sech2(x, th)


def additive_forward_in(X, t, b, excluded=None):
    """``(t + b, excluded)`` in ``X``: a float ``-inf`` in ``b`` excludes its entry (added as 0, then excluded)."""
    neg = b == -np.inf
    t = X.add_d(t, np.where(neg, 0, b))
    return t, (neg if excluded is None else (excluded | neg))


def alibi_forward_in(X, t, slopes, dist):
    """``t - slope * dist`` in ``X``, the product exact in double-double; a term that overflows makes ``-inf``."""
    ab = X.exact_product(slopes, dist)
    over = np.isinf(X.value(ab))                 # t - inf in float64: -inf, or NaN where t is +inf (as NumPy's chain)
    return X.where(over, X.add_d(X.neg(ab), np.where(over, X.value(t), 0)), X.sub(t, ab))


# ------------------------------------------------------------ the chains


def transform_scores(prob, T, rows=None, cols=None, lead=None, sech2=False, sech2_out=None, allowed=None):
    """Raw scores ``Traw`` -> ``(T, sech2)``: the whole chain, written into ``T``.

    ``T`` is the scores of the block of the ``(*batch, Hq, L, S)`` scores
    selected by ``lead`` (slices of the leading axes: a chunk of heads),
    ``rows`` and ``cols`` (``(start, stop)``: a tile); the default is all of
    it. ``allowed`` is the block's allowed set when the caller has it
    already. With ``sech2=True`` (a backward or a JVP will follow), ``sech2``
    is the slope of the chain's element-wise part, ``dT / dTraw`` before the
    additive terms: softcap's :func:`softcap_sech2` times the score
    function's derivative (:mod:`sdpa_ref.score_mod`), written into
    ``sech2_out`` if given; None when the chain has neither.
    """
    o, nd = prob.options, len(prob.full_scores)
    block = (rows, cols)                                     # as asked: a whole problem is no tile of a block mask
    rows = rows if rows is not None else (0, prob.L)
    cols = cols if cols is not None else (0, prob.S)
    d, slope = None, sech2 or sech2_out is not None
    if o.softcap is not None:
        if slope:
            d = softcap_sech2(T, o.softcap, out=sech2_out)
        T, _ = softcap_forward(T, o.softcap, out=T, tanh_out=T)
    if o.score_mod is not None:                              # fn(T): its slope multiplies softcap's
        out, s = score_mod_forward(o.score_mod, T, indices(prob.full_scores, lead, rows, cols), slope)
        if slope:
            d = np.multiply(d, s, out=d) if d is not None else (s if sech2_out is None else
                                                                 np.copyto(sech2_out, s) or sech2_out)
        np.copyto(T, out)
    for b in (prob.mask_float, prob.bias):
        if b is not None:
            T = additive_forward(T, block_of(b, nd, lead, rows, cols), out=T)
    if prob.alibi is not None:
        dist = alibi_distance(prob.L, prob.S, o.causal_alignment, prob.q_lengths, prob.kv_lengths, rows, cols,
                              dtype=T.real.dtype)
        T = alibi_forward(T, block_of(prob.alibi, nd, lead), block_of(dist, nd, lead), out=T)
    if allowed is None:
        allowed = block_of(prob.allowed(*block), nd, lead)
    if allowed is not None:
        np.copyto(T, -np.inf, where=~allowed)
        if o.score_mod is not None and d is not None:        # a masked entry's slope is never read: 0, not NaN
            np.copyto(d, 0, where=~allowed)
    return T, d


def score_mod_params_vjp(prob, g, Traw, rows=None, cols=None, acc=None):
    """The score function's captured tensors' gradients (:func:`sdpa_ref.score_mod.params_vjp`) from ``g``, the
    gradient of the block's final scores (the additive terms pass it on unchanged), and its raw scores ``Traw``
    (overwritten: softcap is recomputed on them for the function's input); added to the list ``acc`` (None: a new
    one). None when the problem's score function captures nothing."""
    mod = prob.options.score_mod
    if mod is None or not mod.params:
        return acc
    t = Traw if prob.options.softcap is None else softcap_forward(Traw, prob.options.softcap, out=Traw, tanh_out=Traw)[0]
    got = params_vjp(mod, g, t, indices(prob.full_scores, None, rows, cols))
    return list(got) if acc is None else [a + b for a, b in zip(acc, got)]


def transform_scores_in(X, prob, T, lead=None, rows=None, excluded=None):
    """The chain of :func:`transform_scores` over an arithmetic ``X`` (:mod:`sdpa_ref.arith`): the raw scores
    ``T`` of one block (``lead``: slices of the leading ``(*batch, Hq)`` axes, ``rows``: ``(start, stop)``; every
    key; the default is all) -> ``(T, excluded, sech2)``.

    The same stages in the same order as :func:`transform_scores`, each by its definition over an arithmetic
    (:func:`softcap_forward_in`, :func:`additive_forward_in`, :func:`alibi_forward_in`). ``excluded`` is the
    block's complement of the allowed set (None: nothing); every score that is ``-inf`` after the chain (a
    ``-inf`` float-mask or bias entry, a sum or an ALiBi term that overflows) joins it, as on every path.
    ``sech2`` is softcap's slope, None without softcap. The reproducible engine's dense schedule (in
    double-double, the honest low precision, or the arithmetic of reads) and the honest ensemble run it.
    """
    o, nd = prob.options, len(prob.full_scores)
    d = None
    if o.softcap is not None:                                # cap * tanh(T / cap), and its slope
        T, d = softcap_forward_in(X, T, o.softcap)
    if o.score_mod is not None:                              # fn(T), a NumPy function: only where X maps one
        if not hasattr(X, "elementwise"):
            raise ValueError(f"`score_mod` should not be given with this arithmetic ({type(X).__name__}): a NumPy "
                             "function has no double-double or fixed-order low-precision form")
        idx, mod, t_in = indices(prob.full_scores, lead, rows), o.score_mod, T
        T = X.elementwise(lambda t: score_mod_forward(mod, t, idx)[0], t_in)
        s = X.elementwise(lambda t: score_mod_forward(mod, t, idx, slope=True)[1], t_in)
        d = s if d is None else X.mul(d, s)
    for b in (prob.mask_float, prob.bias):                   # + M + B: a -inf entry excludes its key
        if b is not None:
            T, excluded = additive_forward_in(X, T, block_of(b, nd, lead, rows), excluded)
    if prob.alibi is not None:                               # - slope * |i + off - j|
        dist = alibi_distance(prob.L, prob.S, o.causal_alignment, prob.q_lengths, prob.kv_lengths, rows)
        T = alibi_forward_in(X, T, block_of(prob.alibi, nd, lead), block_of(dist, nd, lead))
    neg = X.value(T) == -np.inf
    return T, (neg if excluded is None else (excluded | neg)), d


def transform_scores_vjp(dT, sech2, out=None):
    """``dT`` (the gradient of the final scores) -> ``dTraw``: through softcap when there is one (``sech2``, from
    :func:`transform_scores`).

    The additive terms' gradient is ``dT`` itself (:func:`additive_vjp`);
    ALiBi and the -inf exclusions are constants.
    """
    return dT if sech2 is None else softcap_vjp(sech2, dT, out=out)


def transform_scores_jvp(dTraw, sech2, dB=None):
    """``dTraw`` -> ``dT``: through softcap, plus the bias tangent."""
    dT = dTraw if sech2 is None else softcap_jvp(sech2, dTraw)
    return additive_jvp(dT, dB)


def transform_scores_slope_jvp(prob, Traw, slope, dTraw, rows=None, cols=None, allowed=None):
    """The tangent of the chain's slope (:func:`transform_scores`' ``sech2``, ``s(Traw) fn'(u)``, ``u`` softcap's
    output) along the raw scores' tangent: ``(s' fn'(u) + s^2 fn''(u)) dTraw`` by the product and chain rules
    (softcap's :func:`softcap_sech2_jvp`, the score function's
    :func:`~sdpa_ref.score_mod.score_mod_curvature`), 0 outside ``allowed``; None without a slope."""
    o = prob.options
    if slope is None or o.score_mod is None:
        return None if slope is None else softcap_sech2_jvp(Traw, o.softcap, slope, dTraw)
    idx = indices(prob.full_scores, None, rows, cols)
    s = None if o.softcap is None else softcap_sech2(Traw, o.softcap)
    u = Traw if s is None else softcap_forward(Traw, o.softcap)[0]
    fp = score_mod_forward(o.score_mod, u, idx, slope=True)[1]
    fpp = score_mod_curvature(o.score_mod, u, idx).astype(Traw.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        d = fpp * dTraw if s is None else softcap_sech2_jvp(Traw, o.softcap, s, dTraw) * fp + s * s * fpp * dTraw
    return d if allowed is None else np.where(allowed, d, d.dtype.type(0))


def transform_scores_vjp_jvp(dT, ddT, sech2, dsech2):
    """The tangent of :func:`transform_scores_vjp`: ``ddT`` (the tangent of ``dT``) through softcap, plus ``dT``
    times the tangent of softcap's slope (``dsech2``, :func:`softcap_sech2_jvp`). The other terms are linear in
    the scores, so their second derivative is 0."""
    return ddT if sech2 is None else softcap_vjp(sech2, ddT) + dT * dsech2
