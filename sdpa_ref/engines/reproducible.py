r"""``precision="reproducible"``: faithfully rounded float64, the same bits on every machine.

The formulas are the teaching core's (:mod:`sdpa_ref.attention`), evaluated
in double-double arithmetic (:mod:`sdpa_ref.exact.dd`) with every matrix
product formed exactly on the BLAS by the Ozaki scheme
(:mod:`sdpa_ref.exact.ozaki`), and rounded to float64 once, at the end:

* ``Traw = scale * Q K^T``, the transforms (softcap with the package's own
  ``tanh``, the float mask, bias and ``slope * distance`` of ALiBi, each
  added exactly), ``-inf`` outside the allowed set;
* ``P = exp(T - m) / s`` with its own ``exp`` and a fixed-order sum ``s``,
  ``LSE = m + log s`` with its own ``log``; the fully-masked policy;
* ``P_drop = P * Z / (1 - p)`` (``1 - p`` exact), ``O = P_drop V``;
* the backward and the JVP as in the core, with the pivoted softmax
  derivative, every sum over keys, over a GQA group and over broadcast
  dimensions done in a fixed order in double-double.

Only IEEE-754 operations whose results are fixed to the bit are used, element
by element, and BLAS products whose every partial sum is exact, so the
result does not depend on the thread count, the BLAS (vendor, kernel,
threads), NumPy's SIMD dispatch, or the machine. The intermediates carry
about 100 bits, so every float64 result is within one ulp of the exact value
of the formula on the given inputs unless that value is the result of a
cancellation of more than about 2**45 (normwise: always within 2**-52);
``tests/test_reproducible.py`` holds this against 50-digit mpmath.

NaN results are the one canonical quiet NaN (IEEE 754 does not fix the
sign and payload bits of a NaN, and SIMD paths differ in them).

Limits: float64 compute only (``upcast=False`` with a lower precision is
refused); real inputs; finite values or the masks' ``-inf``; inputs and
results far from the subnormal range (below about ``2**-960`` the low half
of a double-double underflows and the guarantee weakens to absolute
``2**-1074``-level errors).
"""

from __future__ import annotations

import functools

import numpy as np

from ..exact import ozaki
from ..exact.dd import (dd, dd_add, dd_add_d, dd_div, dd_exp, dd_log, dd_mul, dd_mul_d, dd_sub, dd_sum, dd_tanh,
                        dd_where, two_prod, two_sum)
from ..masks import block_of, fill_empty_rows, fill_output_without_keys
from ..transforms import alibi_distance
from ._threads import run_all
from .contract import Forward, Grads

#: Score entries of one block of rows whose element-wise chain runs together (256 KiB per array).
_ROW_ENTRIES = 1 << 15

__all__ = ["forward", "backward", "jvp"]


def _quiet(fn):
    """Run ``fn`` with NumPy's floating-point warnings off: excluded and policy rows make inf and NaN on purpose."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return wrapper


@_quiet
def forward(prob, *, save_probs=True) -> Forward:
    """The forward in double-double; ``probs`` is ``P`` rounded, the dd ``P`` and ``tanh`` ride in ``extra``."""
    o, S, full, nd = prob.options, prob.S, prob.full_scores, len(prob.full_scores)
    Sraw = _full(ozaki.matmul(prob.q, _t(_kv(prob.k))), prob)                          # Q K^T, (..., Hq, L, S)
    P = (np.empty(full), np.empty(full))
    Pd = (np.empty(full), np.empty(full)) if prob.keep is not None else P
    th = (np.empty(full), np.empty(full)) if o.softcap is not None else None
    m, s_hi, lse = (np.empty(full[:-1] + (1,)) for _ in range(3))
    empty = np.empty(full[:-1] + (1,), dtype=bool)
    excluded = _excluded(prob)
    dist = None if prob.alibi is None else alibi_distance(prob.L, S, o.causal_alignment, prob.q_lengths,
                                                          prob.kv_lengths)
    padded = prob.padded_rows()

    def rows(lead, r):
        ix = lead + (slice(*r),)
        T = dd_mul_d((Sraw[0][ix], Sraw[1][ix]), prob.scale)
        if th is not None:                                           # cap * tanh(Traw / cap)
            t = dd_tanh(dd_div(T, dd(np.float64(o.softcap))))
            th[0][ix], th[1][ix] = t
            T = dd_mul_d(t, o.softcap)
        excl = block_of(excluded, nd, lead, r)
        for b in (prob.mask_float, prob.bias):
            if b is not None:
                b = block_of(b, nd, lead, r)
                neg = b == -np.inf                                   # a float -inf excludes the entry
                T = dd_add_d(T, np.where(neg, 0.0, b))
                excl = neg if excl is None else (excl | neg)
        if dist is not None:                                         # - slope * |i + off - j|, exactly
            T = dd_sub(T, two_prod(*np.broadcast_arrays(block_of(prob.alibi, nd, lead), block_of(dist, nd, lead, r))))
        hi = T[0] if excl is None else np.where(excl, -np.inf, T[0])
        mx = np.max(hi, axis=-1, keepdims=True, initial=-np.inf)
        em = mx == -np.inf
        mx = np.where(em | ~np.isfinite(mx), 0.0, mx)
        e = dd_exp(dd_add_d(T, -mx))
        if excl is not None:
            e = dd_where(excl, dd(np.float64(0.0)), e)
        sm = dd_where(em, dd(np.float64(1.0)), dd_sum(e, keepdims=True))
        p = _fill_rows(dd_div(e, sm), em, block_of(padded, nd, lead, r), o.fully_masked, S)
        P[0][ix], P[1][ix] = p
        if Pd is not P:
            Pd[0][ix], Pd[1][ix] = _dropout(p, block_of(prob.keep, nd, lead, r), o.dropout_p)
        m[ix], s_hi[ix], empty[ix] = mx, np.where(em, 0.0, sm[0]), em
        lse[ix] = np.where(em, -np.inf, dd_add_d(dd_log(sm), mx)[0])

    _by_rows(full, rows)
    O = _round(ozaki.matmul(_grouped(Pd, prob), _kv(prob.v), final=True))
    O = _canon(fill_output_without_keys(_full(O, prob), o.fully_masked, S, padded))
    extra = {"P": P, "Pd": Pd, "tanh": th} if save_probs else None
    return Forward(out=O, lse=_canon(lse[..., 0]), probs=P[0] if save_probs else None,
                   tanh=None if th is None else th[0], empty=empty, rowmax=m, rowsum=s_hi, extra=extra)


@_quiet
def backward(prob, fwd: Forward, dO) -> Grads:
    """The core's backward in double-double; every gradient rounded once."""
    o, full, nd = prob.options, prob.full_scores, len(prob.full_scores)
    P, Pd, th = fwd.extra["P"], fwd.extra["Pd"], fwd.extra["tanh"]
    dOg = _grouped(dO, prob)                                          # (..., Hkv, G, L, Ev)
    dv = ozaki.matmul(_t(_fold(_grouped(Pd, prob))), _fold(dOg),      # P_drop^T dO, the group folded in
                      final=_no_sum(prob.batch + prob.v.shape[-3:], prob.shapes["value"]))
    dP = _full(ozaki.matmul(dOg, _t(_kv(prob.v))), prob)             # dO V^T
    keep_dT = prob.mask_float is not None or prob.bias is not None
    dT = (np.empty(full), np.empty(full)) if keep_dT else None
    dTraw = (np.empty(full), np.empty(full))

    def rows(lead, r):
        ix = lead + (slice(*r),)
        g = _dropout((dP[0][ix], dP[1][ix]), block_of(prob.keep, nd, lead, r), o.dropout_p)
        t = _softmax_vjp((P[0][ix], P[1][ix]), g)                    # P * (dP - rowsum(P * dP)), pivoted
        if o.fully_masked == "uniform":
            t = dd_where(fwd.empty[ix], dd(np.float64(0.0)), t)
        if dT is not None:
            dT[0][ix], dT[1][ix] = t
        if th is not None:                                           # * (1 - tanh^2)
            h = (th[0][ix], th[1][ix])
            t = dd_mul(t, dd_add_d(_neg(dd_mul(h, h)), 1.0))
        dTraw[0][ix], dTraw[1][ix] = t

    _by_rows(full, rows)
    dmask = None if prob.mask_float is None else _round(_unbroadcast(dT, prob.shapes["attn_mask"]))
    dbias = None if prob.bias is None else _round(_unbroadcast(dT, prob.shapes["bias"]))
    dTg = _grouped(dTraw, prob)
    dq = dd_mul_d(ozaki.matmul(dTg, _kv(prob.k), final=_no_sum(full[:-1] + (prob.q.shape[-1],),
                                                                prob.shapes["query"])), prob.scale)
    dk = dd_mul_d(ozaki.matmul(_t(_fold(dTg)), _fold_q(prob), final=_no_sum(prob.batch + prob.k.shape[-3:],
                                                                          prob.shapes["key"])), prob.scale)
    return Grads(dq=_round(_unbroadcast(_full(dq, prob), prob.shapes["query"])),
                 dk=_round(_unbroadcast(dk, prob.shapes["key"])), dv=_round(_unbroadcast(dv, prob.shapes["value"])),
                 dmask=dmask, dbias=dbias)


@_quiet
def jvp(prob, fwd: Forward, dq=None, dk=None, dv=None, dbias=None):
    """The output tangent, the core's JVP in double-double (tangents in the core's layouts; None is zero)."""
    o, full, nd = prob.options, prob.full_scores, len(prob.full_scores)
    P, Pd, th = fwd.extra["P"], fwd.extra["Pd"], fwd.extra["tanh"]
    dO = None
    if dq is not None or dk is not None or dbias is not None:
        dT = None
        if dq is not None:
            dT = ozaki.matmul(dq, _t(_kv(prob.k)))
        if dk is not None:
            u = ozaki.matmul(prob.q, _t(_kv(dk)))
            dT = u if dT is None else dd_add(dT, u)
        dT = dd(np.zeros(full)) if dT is None else _full(dT, prob)
        dPd = (np.empty(full), np.empty(full))

        def rows(lead, r):
            ix = lead + (slice(*r),)
            t = dd_mul_d((dT[0][ix], dT[1][ix]), prob.scale)
            if th is not None:
                h = (th[0][ix], th[1][ix])
                t = dd_mul(t, dd_add_d(_neg(dd_mul(h, h)), 1.0))
            if dbias is not None:
                t = dd_add_d(t, block_of(dbias, nd, lead, r))
            p = _softmax_jvp((P[0][ix], P[1][ix]), t)                # P * (dT - rowsum(P * dT)), pivoted
            if o.fully_masked == "uniform":
                p = dd_where(fwd.empty[ix], dd(np.float64(0.0)), p)
            dPd[0][ix], dPd[1][ix] = _dropout(p, block_of(prob.keep, nd, lead, r), o.dropout_p)

        _by_rows(full, rows)
        dO = ozaki.matmul(_grouped(dPd, prob), _kv(prob.v))
    if dv is not None:
        u = ozaki.matmul(_grouped(Pd, prob), _kv(dv))
        dO = u if dO is None else dd_add(dO, u)
    if dO is None:
        return np.zeros(full[:-1] + (prob.v.shape[-1],))
    return _full(_round(dO), prob)


def _by_rows(full, fn):
    """``fn(lead, (r0, r1))`` for every block of rows of the ``(*batch, Hq, L, S)`` scores, in the pool.

    A block is one ``(batch, head)`` and rows enough for about ``_ROW_ENTRIES``
    entries, so that the element-wise chains work in cache; every row is
    computed the same way in any block.
    """
    L, S = full[-2], full[-1]
    rb = max(1, _ROW_ENTRIES // max(S, 1))
    items = [(tuple(slice(i, i + 1) for i in ix), (r0, min(r0 + rb, L)))
             for ix in np.ndindex(*full[:-2]) for r0 in range(0, L, rb)]
    if len(items) > 1:
        run_all(lambda it: fn(*it), items)
    elif items:
        fn(*items[0])


# ------------------------------------------------------------ the softmax


def _softmax_vjp(P, g):
    """``P * ((g - c) - rowsum(P * (g - c)))``, ``c = g`` at the row's largest ``P`` (the pivoted form)."""
    idx = np.argmax(P[0], axis=-1)[..., None]
    gc = dd_sub(g, (np.take_along_axis(g[0], idx, -1), np.take_along_axis(g[1], idx, -1)))
    D = dd_sum(dd_mul(P, gc), keepdims=True)
    return dd_mul(P, dd_sub(gc, D))


_softmax_jvp = _softmax_vjp                                          # J is symmetric: the same map


# ------------------------------------------------------------- pieces


def _excluded(prob):
    a = prob.allowed()
    return None if a is None else ~a


def _fill_rows(P, empty, padded, policy, S):
    """The fully-masked policy on a dd ``P`` (padded query rows 0), as :func:`masks.fill_empty_rows`."""
    if not np.any(empty):
        return P
    hi = fill_empty_rows(P[0], empty, padded, policy, S)
    fill_lo = dd_div(dd(np.float64(1.0)), dd(np.float64(S)))[1] if policy == "uniform" and S else 0.0
    lo = np.where(empty, fill_lo, P[1])
    if padded is not None:
        lo = np.where(padded, 0.0, lo)
    return hi, lo


def _dropout(x, keep, p):
    """``x * Z / (1 - p)`` exactly (``1 - p`` by TwoSum) in dd; ``x`` without a keep mask."""
    if keep is None:
        return x
    q = dd_div(x, two_sum(np.float64(1.0), np.float64(-p)))
    return q[0] * keep, q[1] * keep


def _unbroadcast(x, shape):
    """A dd summed down to ``shape`` (a fixed-order tree per axis), then rounded later; see ``unbroadcast``."""
    shape = tuple(shape)
    while x[0].ndim > len(shape):
        x = dd_sum(x, axis=0)
    for ax, n in enumerate(shape):
        if n == 1 and x[0].shape[ax] != 1:
            x = dd_sum(x, axis=ax, keepdims=True)
    return x[0].reshape(shape), x[1].reshape(shape)


def _no_sum(shape, target):
    """Whether bringing a result of ``shape`` to the input's ``target`` shape sums nothing (then the product
    is rounded as it comes, and ``ozaki.matmul(final=True)`` may stop at three levels)."""
    return int(np.prod(shape)) == int(np.prod(target))


def _round(x):
    """A dd rounded to float64 (its ``hi``), NaNs made the one quiet NaN (IEEE leaves their bits open)."""
    return _canon(x[0])


def _canon(a):
    return np.where(np.isnan(a), np.nan, a)


def _neg(x):
    return -x[0], -x[1]


# ------------------------------------------------------------ layouts


def _kv(x):
    """``(..., Hkv, S, n)`` -> ``(..., Hkv, 1, S, n)`` (dd pairs too)."""
    if isinstance(x, tuple):
        return _kv(x[0]), _kv(x[1])
    return x[..., None, :, :]


def _t(x):
    if isinstance(x, tuple):
        return _t(x[0]), _t(x[1])
    return np.swapaxes(x, -1, -2)


def _grouped(x, prob):
    """``(*batch, Hq, L, n)`` -> ``(*batch, Hkv, G, L, n)``."""
    if isinstance(x, tuple):
        return _grouped(x[0], prob), _grouped(x[1], prob)
    return x.reshape(x.shape[:-3] + (prob.Hkv, prob.G) + x.shape[-2:])


def _fold(x):
    """``(..., Hkv, G, L, n)`` -> ``(..., Hkv, G*L, n)``: a GQA group's rows in one contraction."""
    if isinstance(x, tuple):
        return _fold(x[0]), _fold(x[1])
    return x.reshape(x.shape[:-3] + (x.shape[-3] * x.shape[-2], x.shape[-1]))


def _fold_q(prob):
    """``q`` ``(..., Hkv, G, L, E)`` broadcast to the full batch and folded, for ``dK = dT^T Q``."""
    q = np.broadcast_to(prob.q, prob.batch + prob.q.shape[-4:])
    return _fold(q)


def _full(x, prob):
    """``(..., Hkv, G, L, n)`` -> ``(*batch, Hq, L, n)``, broadcast over the batch dims (dd pairs too)."""
    if isinstance(x, tuple):
        return _full(x[0], prob), _full(x[1], prob)
    x = x.reshape(x.shape[:-4] + (prob.Hq,) + x.shape[-2:])
    want = prob.batch + x.shape[-3:]
    return np.broadcast_to(x, want) if x.shape != want else x
