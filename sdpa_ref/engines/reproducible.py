r"""``precision="reproducible"``: faithfully rounded float64, the same bits on every machine.

The formulas are the plain engine's (:mod:`sdpa_ref.attention`), evaluated
once, here, in one of two arithmetics (:mod:`sdpa_ref.exact.arith`). In
float64: double-double (:mod:`sdpa_ref.exact.dd`), every matrix product
formed exactly on the BLAS by the Ozaki scheme (:mod:`sdpa_ref.exact.ozaki`),
every result rounded to float64 once, at the end. With ``upcast=False`` (in
float64, float32 or float16): every operation rounded to that dtype, as a kernel in
that precision would compute, in a fixed order (products summed by a fixed
pairwise tree; ``exp``, ``log`` and ``tanh`` the double-double ones rounded).
The steps:

* ``Traw = scale * Q K^T``, the transforms (softcap with the package's own
  ``tanh``, the float mask, bias and ``slope * distance`` of ALiBi, each
  added exactly), ``-inf`` outside the allowed set;
* ``P = exp(T - m) / s`` with its own ``exp`` and a fixed-order sum ``s``,
  ``LSE = m + log s`` with its own ``log``; the fully-masked policy; a
  normaliser closed by its extra logits (sinks: :func:`sdpa_ref.normalize.close_in`) over the arithmetic;
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
``tests/test_engines_reproducible.py`` holds this against 50-digit mpmath.

NaN results are the one canonical quiet NaN (IEEE 754 does not fix the
sign and payload bits of a NaN, and SIMD paths differ in them).

Limits: real inputs; finite values or the masks' ``-inf``; inputs and
results far from the subnormal range (below about ``2**-960`` the low half
of a double-double underflows and the guarantee weakens to absolute
``2**-1074``-level errors).
"""

from __future__ import annotations

import functools

import numpy as np

from ..exact.arith import DoubleDouble, for_problem
from ..normalize import EXTRA_NAME, close_in, extra_shape, extras, lse_in, vjp_in
from ..broadcast import block_of
from ..policy import constant_rows, counts, fill_empty_rows, fill_output_without_keys, fills_past_allowed, nan_rows, \
    zero_output_rows
from ..score_mod import indices, params_vjp
from ..transforms import SCORE_MOD, SCORE_STAGES, ScoreBlock, dropout_in, transform_scores_in, unbroadcast
from .._threads import run_all
from .blocks import allowed_anywhere, first_last
from .contract import Forward, Grads

#: Score entries of one block of rows whose element-wise chain runs together (1 MiB per array: fewer, larger
#: blocks hold the GIL less often for their Python steps; docs/performance.md, "Where the numbers in the code went").
_ROW_ENTRIES = 1 << 17
#: Score entries below which the blocks run one after the other rather than in the pool.
_PARALLEL_ENTRIES = 1 << 17

__all__ = ["forward", "backward", "jvp"]


def _quiet(fn):
    """Run ``fn`` with NumPy's floating-point warnings off: excluded and policy rows make inf and NaN on purpose."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)
    return wrapper


@_quiet
def forward(prob, *, save_probs=True, arith=None) -> Forward:
    """The forward; ``probs`` is ``P`` rounded, the full-precision ``P`` and softcap's ``sech^2`` ride in ``extra``.
    ``arith``: the arithmetic (default: the problem's, :func:`sdpa_ref.exact.arith.for_problem`)."""
    X = arith or for_problem(prob)
    o, S, full, nd = prob.options, prob.S, prob.full_scores, len(prob.full_scores)
    Traw = _full(X.matmul(prob.q, _t(_kv(prob.k)), scale=prob.scale, spans=_key_spans(prob, scores=True)),
                 prob)                                                                # scale Q K^T, (..., Hq, L, S)
    P = _reuse(X, Traw, full)                          # a block of P is written after its scores are read
    Pd = X.empty(full) if prob.keep is not None else P
    sd = X.empty(full) if o.has_slope else None                         # sech^2(Traw / cap) (times fn')
    m, s_val = (np.empty(full[:-1] + (1,), X.dtype) for _ in range(2))
    norm = X.empty(full[:-1] + (1,)), X.empty(full[:-1] + (1,))     # each row's (m, s): the LSE after the rows
    ext = extras(prob)                                               # the normaliser's extra logits (sinks)
    keys = None if ext is None else (X.empty(full[:-1] + (1,)), X.empty(full[:-1] + (1,)),    # then the keys'
                                     np.empty(full[:-1] + (1,), dtype=bool))                  # own, for their LSE
    max_keys = None if ext is None else np.empty(full[:-1] + (1,), X.dtype)     # and their own max
    p_extra = None if ext is None else X.empty(full[:-1] + (1,))
    empty = np.empty(full[:-1] + (1,), dtype=bool)
    excluded = _excluded(prob)
    padded = prob.padded_rows()

    def rows(lead, r):
        ix = lead + (slice(*r),)
        T, excl, d = transform_scores_in(X, prob, X.at(Traw, ix), lead, r,     # softcap, + M + B, ALiBi;
                                         block_of(excluded, nd, lead, r))    # a -inf score excludes its key
        if sd is not None:
            X.put(sd, ix, d)                                         # softcap's slope sech^2(Traw / cap)
        mx, em, over = X.row_max(T, excl)                            # T - mx <= 0, however large T
        if np.any(over):
            raise ValueError(_OVERFLOW_SCORE)
        e = X.exp_minus(T, mx)                                       # exp(T - mx)
        if excl is not None:
            e = X.where(excl, X.const(0.0), e)
        sm = X.where(em, X.const(1.0), X.sum(e, keepdims=True))
        p = X.div(e, sm)
        if ext is not None:                                          # the normaliser closed by them
            X.put(keys[0], ix, mx)
            X.put(keys[1], ix, sm)
            keys[2][ix] = em
            max_keys[ix] = np.where(em, -np.inf, X.value(mx))
            mx, sm, fold, pe, em = close_in(X, mx, sm, em, block_of(ext, nd, lead, r))
            p = X.mul(p, fold)
            X.put(p_extra, ix, pe)
            sm = X.where(em, X.const(1.0), sm)
        p = fill_empty_rows(p, em, block_of(padded, nd, lead, r), o.fully_masked, S, X,
                            n=block_of(counts(prob), nd, lead, r), excl=block_of(excluded, nd, lead, r))
        X.put(P, ix, p)
        if Pd is not P:
            X.put(Pd, ix, _dropout(X, p, block_of(prob.keep, nd, lead, r), o.dropout_p))
        m[ix], s_val[ix], empty[ix] = X.value(mx), np.where(em, 0, X.value(sm)), em
        X.put(norm[0], ix, mx)
        X.put(norm[1], ix, sm)

    _by_rows(full, rows)
    lse = lse_in(X, *norm, empty)                                    # element-wise: the same bits as row by row,
    lse_keys = None if keys is None else lse_in(X, *keys)            # in one pass rather than one per block
    O = _full(_times_values(X, prob, Pd, empty, prob.v, prob.v_full, final=True, contract=_key_spans(prob, empty)),
              prob)
    _no_silent_nan(X, O, _nan_rows(prob, empty), "out")
    _no_silent_nan(X, lse, None, "lse")
    O = fill_output_without_keys(_round(X, O), prob.nan_rows_without_keys())
    zr = zero_output_rows(empty, padded, o.fully_masked)
    if zr is not None:                                               # 0 by definition: no value is read
        O = np.where(zr, O.dtype.type(0), O)
    extra = {"P": P, "Pd": Pd, "sech2": sd, "p_extra": p_extra} if save_probs else None
    return Forward(out=O, lse=_round(X, lse)[..., 0], probs=X.value(P) if save_probs else None,
                   slope=None if sd is None or not save_probs else X.value(sd), empty=empty, rowmax=m,
                   rowsum=s_val, extra=extra, lse_keys=None if lse_keys is None else _round(X, lse_keys)[..., 0],
                   rowmax_keys=None if max_keys is None else max_keys[..., 0])


@_quiet
def backward(prob, fwd: Forward, dO, dlse=None, *, arith=None, absorbed=None) -> Grads:
    """The core's backward; every gradient rounded once. ``dlse`` ``(*batch, Hq, L, 1)`` float64 or None;
    ``arith`` as in :func:`forward`. ``absorbed``: MLA's ``qv`` joined into ``prob``
    (:class:`sdpa_ref.absorbed.Absorbed`); the gradients are then also split in the arithmetic, ``dV``'s two
    uses (and a broadcast key's or value's batch) summed before the one rounding (``Grads.absorbed``)."""
    X = arith or for_problem(prob)
    whole = absorbed is None                                          # else dk and dv are summed further
    o, full, nd = prob.options, prob.full_scores, len(prob.full_scores)
    P, Pd, sd = fwd.extra["P"], fwd.extra["Pd"], fwd.extra["sech2"]
    padded = prob.padded_rows()
    dOg = _grouped(dO, prob)                                          # (..., Hkv, G, L, Ev)
    row_keys, key_rows = _key_spans(prob, fwd.empty), _key_spans(prob, fwd.empty, keys=True)  # P, dT 0 outside
    dv = X.matmul(_t(_fold(_grouped(Pd, prob))), _fold(dOg),          # P_drop^T dO, the group folded in
                  final=whole and _no_sum(prob.batch + prob.v.shape[-3:], prob.shapes["value"]), contract=key_rows)
    mod = o.score_mod if o.score_mod is not None and o.score_mod.params else None   # captured tensors
    keep_dT = prob.mask_float is not None or prob.bias is not None or mod is not None
    dT = X.empty(full) if keep_dT else None
    pe = fwd.extra["p_extra"]
    dext = None if pe is None else X.empty(full[:-1] + (1,))

    def rows_of(dP, dTraw, at):
        """The row pass on one piece of the scores: ``dP`` and ``dTraw`` (one storage: a block of ``dT`` is
        written after its ``dP`` is read) hold the piece, ``at(lead)`` is a block's place in the whole."""
        def rows(lead, r):
            ix, glead = lead + (slice(*r),), at(lead)
            gix = glead + (slice(*r),)
            g = _dropout(X, X.at(dP, ix), block_of(prob.keep, nd, glead, r), o.dropout_p)
            gl = None if dlse is None else dlse[gix]
            t, de = vjp_in(X, X.at(P, gix), g, None if pe is None else X.at(pe, gix), gl)   # P(dP - D) [+ P dlse]
            cr = constant_rows(fwd.empty[gix], block_of(padded, nd, glead, r), o.fully_masked,
                               block_of(counts(prob), nd, glead, r))
            if cr is not None:                                       # P does not depend on T there
                t = X.where(cr, X.const(0.0), t)
            if pe is not None:                                       # the extra columns (dP = 0)
                X.put(dext, gix, de if cr is None else X.where(cr, X.const(0.0), de))
            if dT is not None:
                X.put(dT, gix, t)
            if sd is not None:                                       # * (1 - tanh^2), as sech^2
                t = X.mul(t, X.at(sd, gix))
            X.put(dTraw, ix, t)
        return rows

    q_final = _no_sum(full[:-1] + (prob.q.shape[-1],), prob.shapes["query"])
    k_final = whole and _no_sum(prob.batch + prob.k.shape[-3:], prob.shapes["key"])
    pieces = None if keep_dT else _pieces(X, prob)
    if pieces is None:                                               # the whole scores at once
        dP = _full(X.matmul(dOg, _t(_kv(prob.v)), spans=row_keys), prob)     # dO V^T
        dTraw = _reuse(X, dP, full)
        _by_rows(full, rows_of(dP, dTraw, lambda lead: lead))
        dTg = _grouped(dTraw, prob)
        dq = _full(X.matmul(dTg, _kv(prob.k), final=q_final, scale=prob.scale, contract=row_keys), prob)
        dk = X.matmul(_t(_fold(dTg)), _fold_q(prob), final=k_final, scale=prob.scale, contract=key_rows)
    else:                                                            # kv heads a piece at a time, one workspace
        dq, dk = _backward_in_pieces(X, prob, pieces, dOg, rows_of, row_keys, key_rows, q_final, k_final)
    nan_rows = _nan_rows(prob, fwd.empty)                            # NaN by the "nan" policy, and nowhere else
    if dT is not None:
        _no_silent_nan(X, dT, nan_rows, "attn_mask or bias gradient")
    dmask = None if prob.mask_float is None else _round(X, unbroadcast(dT, prob.shapes["attn_mask"], X))
    dbias = None if prob.bias is None else _round(X, unbroadcast(dT, prob.shapes["bias"], X))
    heads = None if nan_rows is None else np.any(_grouped(nan_rows, prob), axis=(-3, -2))[..., None]
    for x, ok, what in ((dq, nan_rows, "dq"), (dk, heads, "dk"), (dv, heads, "dv")):
        _no_silent_nan(X, x, ok, what)
    dextra = None
    if dext is not None:                                             # summed over the rows, then to (..., Hq)
        dextra = unbroadcast(X.sum(X.at(dext, (Ellipsis, 0)), axis=-1), extra_shape(prob), X)
        _no_silent_nan(X, dextra, None if nan_rows is None else _any_to(np.any(nan_rows, axis=(-2, -1)),
                                                                               extra_shape(prob)),
                       f"{EXTRA_NAME} gradient")
        dextra = _round(X, dextra)
    dq, dk, dv = (unbroadcast(x, prob.shapes[n], X) for x, n in ((dq, "query"), (dk, "key"), (dv, "value")))
    split = None if whole else tuple(_round(X, x) for x in absorbed.split(dq, dk, dv, arith=X))
    return Grads(dq=_round(X, dq), dk=_round(X, dk), dv=_round(X, dv), dmask=dmask, dbias=dbias, dextra=dextra,
                 absorbed=split, dmod=None if mod is None else _score_mod_grads(X, prob, mod, dT))


@_quiet
def jvp(prob, fwd: Forward, dq=None, dk=None, dv=None, dbias=None, dv_full=None, dextra=None, *, arith=None):
    """The output tangent, the core's JVP (tangents in the core's layouts; None is zero; ``dv_full`` as in
    :func:`sdpa_ref.attention.jvp`; ``arith`` as in :func:`forward`)."""
    X = arith or for_problem(prob)
    o, full, nd = prob.options, prob.full_scores, len(prob.full_scores)
    P, Pd, sd = fwd.extra["P"], fwd.extra["Pd"], fwd.extra["sech2"]
    padded = prob.padded_rows()
    row_keys = _key_spans(prob, fwd.empty)                          # P is 0 outside them, and so is its map
    dO = None
    if dq is not None or dk is not None or dbias is not None or dextra is not None:
        dT = None
        if dq is not None:
            dT = X.matmul(dq, _t(_kv(prob.k)), spans=row_keys)
        if dk is not None:
            u = X.matmul(prob.q, _t(_kv(dk)), spans=row_keys)
            dT = u if dT is None else X.add(dT, u)
        dT = X.lift(np.zeros(full)) if dT is None else _full(dT, prob)
        dPd = X.empty(full)

        def rows(lead, r):
            ix = lead + (slice(*r),)
            t = X.mul_d(X.at(dT, ix), prob.scale)
            if sd is not None:
                t = X.mul(t, X.at(sd, ix))
            if dbias is not None:
                t = X.add_d(t, block_of(dbias, nd, lead, r))
            pe = fwd.extra["p_extra"]                                # J is symmetric: the VJP's map, an extra
            p = vjp_in(X, X.at(P, ix), t, None if pe is None else X.at(pe, ix),     # column's entry d sigma
                       d_extra=block_of(dextra, nd, lead, r))[0]
            cr = constant_rows(fwd.empty[ix], block_of(padded, nd, lead, r), o.fully_masked,
                               block_of(counts(prob), nd, lead, r))
            if cr is not None:
                p = X.where(cr, X.const(0.0), p)
            X.put(dPd, ix, _dropout(X, p, block_of(prob.keep, nd, lead, r), o.dropout_p))

        _by_rows(full, rows)
        dO = X.matmul(_grouped(dPd, prob), _kv(prob.v), contract=row_keys)
    if dv is not None:
        u = _times_values(X, prob, Pd, fwd.empty, dv, dv_full, contract=row_keys)
        dO = u if dO is None else X.add(dO, u)
    if dO is None:
        return np.zeros(full[:-1] + (prob.v.shape[-1],), X.dtype)
    dO = _full(_round(X, dO), prob)
    _no_silent_nan(X, dO, _nan_rows(prob, fwd.empty), "JVP")
    return dO


#: Score entries (of ``dP``, a dd: 16 bytes each) past which the backward takes the kv heads a piece at a time, and
#: about what a piece holds (docs/performance.md, "Where the numbers in the code went").
_PIECE_ENTRIES = 1 << 21


def _pieces(X, prob):
    """``[(batch index, (h0, h1))]``: the pieces of kv heads the backward takes in turn, each about
    :data:`_PIECE_ENTRIES` score entries (or one head, where that holds more), or None: the whole at once, where
    one batch entry's heads hold fewer (the pieces would be many and small), or in an arithmetic other than
    :class:`sdpa_ref.exact.arith.DoubleDouble`."""
    per_head = prob.G * prob.L * prob.S
    if type(X) is not DoubleDouble or per_head == 0 or prob.Hkv * per_head <= _PIECE_ENTRIES \
            or 0 in tuple(prob.batch):
        return None                                    # (a batch entry's heads are the least a piece holds)
    nh = max(1, min(prob.Hkv, _PIECE_ENTRIES // per_head))
    return [(b, (h0, min(h0 + nh, prob.Hkv))) for b in np.ndindex(*prob.batch) for h0 in range(0, prob.Hkv, nh)]


def _backward_in_pieces(X, prob, pieces, dOg, rows_of, row_keys, key_rows, q_final, k_final):
    """``(dq, dk)`` of :func:`backward`, the kv heads a piece (:func:`_pieces`) at a time: ``dP = dO V^T``, the
    row pass to ``dT`` and the products ``dT K``, ``dT^T Q`` of one piece, in one workspace of a piece's ``dP``
    (formed once, rather than a ``dP`` of the whole scores: a fresh array costs its page faults). Every entry is
    the one the whole gives: the exact products do not depend on the other batch entries and heads
    (:func:`sdpa_ref.exact.ozaki.matmul`), nor a row's pass on the other rows."""
    G, L, S = prob.G, prob.L, prob.S
    nh = max(h1 - h0 for _, (h0, h1) in pieces)
    work = tuple(np.empty((nh, G, L, S)) for _ in range(2))
    at_batch = lambda x, tail: np.broadcast_to(x, prob.batch + x.shape[-tail:])     # noqa: E731
    v, k, qf = at_batch(prob.v, 3), at_batch(prob.k, 3), _fold_q(prob)
    dO = at_batch(dOg, 4)
    dq = X.empty(prob.batch + (prob.Hkv, G, L, prob.q.shape[-1]))
    dk = X.empty(prob.batch + (prob.Hkv, S, prob.k.shape[-1]))
    for b, (h0, h1) in pieces:
        ix = b + (slice(h0, h1),)
        dP = X.matmul(dO[ix], _t(_kv(v[ix])), spans=row_keys, out=tuple(w[:h1 - h0] for w in work))
        flat = tuple(x.reshape((1,) * len(b) + ((h1 - h0) * G, L, S)) for x in dP)    # the scores' layout
        lead0 = tuple(slice(i, i + 1) for i in b)

        def at(lead, lead0=lead0, g0=h0 * G, n=(h1 - h0) * G):
            h = lead[-1].indices(n)[:2]
            return lead0 + (slice(g0 + h[0], g0 + h[1]),)

        _by_rows(flat[0].shape, rows_of(flat, flat, at))
        X.matmul(dP, _kv(k[ix]), final=q_final, scale=prob.scale, contract=row_keys, out=X.at(dq, ix))
        X.matmul(_t(_fold(dP)), qf[ix], final=k_final, scale=prob.scale, contract=key_rows, out=X.at(dk, ix))
    return _full(dq, prob), dk


def _by_rows(full, fn):
    """``fn(lead, (r0, r1))`` for every block of rows of the ``(*batch, Hq, L, S)`` scores, in the pool.

    A block is one ``(batch, head)`` and rows enough for about ``_ROW_ENTRIES``
    entries, so that the element-wise chains work in cache; every row is
    computed the same way in any block.
    """
    L, S = full[-2], full[-1]
    lead = full[:-2]
    if not lead:
        lead_items = [()]
    elif L * S * lead[-1] <= _ROW_ENTRIES:                   # small heads: several in one block
        lead_items = [tuple(slice(i, i + 1) for i in ix) + (slice(None),) for ix in np.ndindex(*lead[:-1])]
    else:
        lead_items = [tuple(slice(i, i + 1) for i in ix) for ix in np.ndindex(*lead)]
    rb = max(1, _ROW_ENTRIES // max(S, 1))
    items = [(li, (r0, min(r0 + rb, L))) for li in lead_items for r0 in range(0, L, rb)]
    if len(items) > 1 and int(np.prod(full)) >= _PARALLEL_ENTRIES:
        run_all(lambda it: fn(*it), items)
    else:                                                    # small: the pool's hand-offs would cost more
        for it in items:
            fn(*it)


# ------------------------------------------------------------ the softmax


# ------------------------------------------------------------- pieces


def _score_mod_grads(X, prob, mod, dT):
    """The score function's captured tensors' gradients: its own VJP (:func:`sdpa_ref.score_mod.params_vjp`, the
    user's ``params_vjp`` or the complex step) of the rounded ``dT`` at the float64 scores the forward gave it.

    Those scores are recomputed as the forward made them: ``scale Q K^T`` exactly, then the stages before the
    score function over ``X``, each ``hi`` (the score rounded to float64). The sum over the scores is the
    function's VJP's own, so these gradients are outside the faithful guarantee (``SEMANTICS.md``)."""
    at = ScoreBlock(prob)
    t = _full(X.matmul(prob.q, _t(_kv(prob.k)), scale=prob.scale), prob)
    for st in SCORE_STAGES:
        if st is SCORE_MOD:
            break
        c = getattr(prob.options, st.option) if st.elementwise else st.terms(at, np.float64)
        if c is not None:
            t = st.forward_in(X, t, c, at)[0] if st.elementwise else st.forward_in(X, t, c, None)[0]
    g = _round(X, dT)
    return tuple(params_vjp(mod, g, np.broadcast_to(X.value(t), g.shape), indices(prob.full_scores)))


def _reuse(X, a, shape):
    """``a``'s storage for a new array of ``shape`` where ``a`` (a value of ``X``, no longer needed once its block
    has been read) is a pair of writeable C-contiguous float64 arrays of that shape that no one else holds,
    else :meth:`DoubleDouble.empty`: a fresh array of this size costs its page faults, about as much as a
    pass over it. Only in :class:`sdpa_ref.exact.arith.DoubleDouble`."""
    if type(X) is DoubleDouble and isinstance(a, tuple) and all(
            isinstance(x, np.ndarray) and x.shape == tuple(shape) and x.dtype == np.float64 and x.flags.writeable
            and x.flags.c_contiguous for x in a) and not np.may_share_memory(a[0], a[1]):
        return a
    return X.empty(shape)


def _excluded(prob):
    a = prob.allowed()
    return None if a is None else ~a


def _key_spans(prob, empty=None, scores=False, keys=False):
    """The ranges :func:`sdpa_ref.exact.ozaki.matmul` forms a product on (its ``spans`` and ``contract``): the
    keys some batch entry or head allows, per query row, or (``keys``) per key the query rows that allow it, over
    a GQA group's ``G L`` folded rows. The others are excluded: their scores are ``-inf`` whatever the product,
    their ``P`` and ``dT`` exactly 0, their ``dP`` read only times that 0. None where every row takes every key, or
    where an entry outside would be read: with ``scores``, a score function or softcap (an excluded entry's value
    or slope is kept); with ``empty`` (the forward's rows without a key), a row that the policy fills past its
    keys (:func:`sdpa_ref.policy.fills_past_allowed`)."""
    o = prob.options
    if scores and (o.score_mod is not None or o.has_slope):
        return None
    if empty is not None and fills_past_allowed(o.fully_masked, empty, prob.padded_rows()):
        return None
    a = prob.allowed()
    if a is None or prob.L == 0 or prob.S == 0:
        return None
    some = allowed_anywhere(a, prob.L, prob.S)
    if not keys:
        start, stop = first_last(some)
        return None if np.all(start == 0) and np.all(stop == prob.S) else (start, stop)
    start, stop = first_last(np.ascontiguousarray(some.T))
    span = prob.G * prob.L                                  # the group's rows g L + [0, L), folded
    start, stop = np.where(stop > 0, start, span), np.where(stop > 0, stop + (prob.G - 1) * prob.L, 0)
    return None if np.all(start == 0) and np.all(stop == span) else (start, stop)


def _times_values(X, prob, P, empty, v, v_full, final=False, contract=None):
    """``P V`` (or ``P dV``) per kv head, ``(..., Hkv, G, L, Ev)``; the fully masked rows of ``"uniform"`` take the
    values they average (:meth:`Problem.averaged_values`), the others the ones no allowed entry skips.
    ``contract``: each row's keys outside which its ``P`` is 0 (:func:`_key_spans`), or None."""
    Pg = _grouped(P, prob)
    out = X.matmul(Pg, _kv(v), final=final, contract=contract)
    vu = prob.averaged_values(empty, v, v_full)
    if vu is not v:
        out = X.where(_grouped(empty, prob), X.matmul(Pg, _kv(vu), final=final), out)
    return out


#: The error for a score that overflows (see SEMANTICS.md, "Reproducible precision").
_OVERFLOW_SCORE = ("`query`, `key`: a score of an allowed key is +inf or NaN after the scale, softcap, mask, bias and "
                   "ALiBi (it overflows float64), so precision='reproducible' cannot give a finite, faithfully "
                   "rounded result (precision='fast' returns IEEE's NaN there); scale the inputs down")
#: The error for an intermediate that leaves the double-double range.
_OVERFLOW = ("precision='reproducible' cannot give a finite, faithfully rounded {}: an intermediate of its "
             "double-double arithmetic leaves the range (beyond about 2**995 = 6.7e299, where Dekker's exact "
             "product overflows) on these inputs; scale them down, or use precision='fast'")


def _nan_rows(prob, empty):
    """``(*batch, Hq, L, 1)``: the rows that the ``"nan"`` policy makes NaN, or None."""
    return nan_rows(empty, prob.padded_rows(), prob.options.fully_masked, counts(prob))


def _no_silent_nan(X, x, ok, what):
    """Raise rather than return a NaN that neither a non-finite input (cleaned before) nor the ``"nan"`` policy
    (``ok``: where it puts NaN, broadcastable, or None) asked for; ``x`` a value of ``X`` or a rounded result.
    Not in an arithmetic that does not check (:class:`sdpa_ref.reads.ReadsArith`: its values are structure)."""
    if not getattr(X, "checks", True):
        return
    bad = np.isnan(x if isinstance(x, np.ndarray) else X.value(x))
    if ok is not None:
        bad = bad & ~ok
    if np.any(bad):
        raise ValueError(_OVERFLOW.format(what))


def _dropout(X, x, keep, p):
    """``x * Z / (1 - p)``; ``x`` itself without a keep mask."""
    return dropout_in(X, x, keep, p)


def _any_to(mask, shape):
    """``mask`` reduced by ``any`` to the broadcastable ``shape`` (the rows a summed gradient entry takes in)."""
    while mask.ndim > len(shape):
        mask = mask.any(axis=0)
    return np.any(mask, axis=tuple(i for i, n in enumerate(shape) if n == 1 and mask.shape[i] != 1), keepdims=True)


def _no_sum(shape, target):
    """Whether bringing a result of ``shape`` to the input's ``target`` shape sums nothing (then the product
    is rounded as it comes, and ``ozaki.matmul(final=True)`` may stop early)."""
    return int(np.prod(shape)) == int(np.prod(target))


def _round(X, x):
    """The result in the compute dtype, NaNs made the one quiet NaN (IEEE leaves their bits open); in an arithmetic
    with a ``result`` of its own (:class:`sdpa_ref.reads.ReadsArith`: where it reads poison), that."""
    result = getattr(X, "result", None)
    return _canon(X.value(x)) if result is None else result(x)


def _canon(a):
    return np.where(np.isnan(a), a.dtype.type(np.nan), a)


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
