r"""The fast dense engine: the plain engine's arithmetic, with fewer passes and copies.

The default of :func:`sdpa_ref.sdpa_forward` (``method="fast"``). It calls
the same transforms, allowed set and policy as the core
(:mod:`sdpa_ref.attention`) and is tested against it to 1e-14. What differs
is how:

* the query heads of a GQA group are folded into the row axis,
  ``(..., Hkv, G*L, E)``, so one GEMM per kv head gives the whole group's
  scores, and the backward's ``P_drop^T dO`` and ``dT^T Q`` contract the
  group's rows: that *is* the sum over the group;
* one ``L x S`` buffer holds the scores, becomes ``exp(T - m)`` in place and
  then ``P`` (divided by the row sum); the backward turns
  ``dO V^T`` into ``dT`` in place; the row passes work on blocks of rows
  small enough to stay in cache;
* the softmax VJP in the pivoted form of :func:`sdpa_ref.pivot.row_pivot`
  (``dP - c`` with ``c`` at the row's largest ``P``, then
  ``D = rowsum(P * (dP - c))``), one pass per cache-sized block of rows: on
  peaked rows it is several times more accurate than FlashAttention's
  ``D = rowsum(dO * O)``, for three more passes over ``L x S``;
* with a C compiler (:mod:`sdpa_ref.exact._native`), the softmax rows (max,
  ``exp(T - m)``, sum, divide, ``log``) and the pivoted VJP rows run as
  fused compiled loops, row by row in cache, on SIMD vectors (AVX2 or AVX-512,
  the widest the CPU has), with a vectorised exp within 1 ulp: IEEE operations in eight
  fixed lanes and a fixed order, so the bits depend neither on the SIMD
  level nor on NumPy's dispatch; without one (or with
  ``SDPA_REF_NATIVE=0``) the NumPy passes below run, equal to rounding;
* rows shorter than 64 are summed by ``np.einsum("ij->i", ...)``, row by row
  by construction (a BLAS product with a ones vector is faster, but its
  result for a row depends on how many rows the call holds);
* a problem with several ``(batch, kv head)`` units and at least two chunks'
  worth of score entries is cut into rectangular chunks of whole heads
  (:func:`_head_chunks`), which run their whole pipeline side by side in the
  package's pool while the BLAS is held to one thread
  (:mod:`sdpa_ref._threads`); so is one with few scores but many keys and
  values to read (a decode, :data:`_KV_BYTES`). A single head or a small
  problem runs its row passes on row blocks in the pool.

* with a structured mask (causal, windows, chunks, lengths, bool and block
  masks, mask functions), only each block of query rows' span of allowed
  keys is computed (:func:`.blocks.key_spans`): the products on a cover of
  the spans by large rectangles, the row passes span by span on views (the
  compiled passes take a row stride), ``P`` and ``dT`` 0 elsewhere; the
  forward's summary travels in ``Forward.extra`` to the backward and JVP.

Chunks are cut from the shape alone, and every row and every matrix product
is computed the same way in any chunk, so the result is the same bytes for
any thread count.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..exact import _native
from ..broadcast import block_of
from ..policy import constant_rows, counts, excluded, fill_empty_rows, fill_output_without_keys, \
    fills_past_allowed, zero_output_rows
from ..normalize import close, extra_probs, extras, nan_row_probs, row_stats, vjp
from ..pivot import lane_rowsum, softmax_vjp_rows
from ..transforms import additive_vjp, dropout_forward, scores_forward, scores_jvp, scores_vjp, transform_scores, \
    transform_scores_jvp, transform_scores_vjp, transposed_product
from .._threads import MIN_PARALLEL, blas_is_held, num_threads, row_chunks, run_all
from .blocks import BlockSummary, Blocks, key_spans, span_rows
from .contract import Forward, Grads

__all__ = ["forward", "backward", "jvp"]

#: Score entries of one chunk of heads when ``E + Ev >= 128`` (see :func:`_chunk_entries`).
_CHUNK_ENTRIES = 1 << 20
#: Entries of a row block that one element-wise pass works on (4 MiB of float64).
_CACHE_ENTRIES = 1 << 19
#: Bytes of keys and values (all heads) from which a problem with few scores is still cut into chunks
#: (:func:`_head_chunks`). One query token, 32/8 heads of 128, forward, 2 threads, 9 interleaved rounds, one
#: piece against chunks: float64 1024 keys (16 MiB) 5.29 / 5.56 ms, 2048 (32 MiB) 9.46 / 9.46, 4096 (64 MiB)
#: 24.2 / 20.3; float32 1024 (8 MiB) 5.50 / 6.52, 4096 (32 MiB) 17.8 / 14.2; float64 32k keys (512 MiB): the
#: engine's part 95-105 / 50-54 ms.
_KV_BYTES = 1 << 25
#: The allowed set of a block that the summary says is wholly allowed (the mask's pass excludes nothing).
_EVERY = np.ones((1, 1), dtype=bool)


def forward(prob, *, save_probs=True) -> Forward:
    """``(O, lse, P, softcap's sech^2, empty)`` as the contract says."""
    lay = _Layout(prob)
    o, full, lead, S = prob.options, lay.full, lay.lead, lay.S
    GL, Ev = lay.grouped[-1], prob.v.shape[-1]
    ct = prob.dtype
    q = prob.q.reshape(prob.q.shape[:-4] + (prob.Hkv, GL, prob.q.shape[-1]))
    allowed = prob.allowed()
    summ = _spans(prob, allowed)                       # the query blocks' allowed key spans, or None
    # becomes P in place; with spans, only they are written: 0 elsewhere, as a masked entry's P is
    T = (np.empty if summ is None else np.zeros)(lead + (GL, S), dtype=ct)
    O = (np.empty if summ is None else np.zeros)(lead + (GL, Ev), dtype=ct)
    lse = np.empty(lead + (GL, 1), dtype=ct)
    rowmax = np.empty(lead + (GL, 1), dtype=ct)
    rowsum = np.empty(lead + (GL, 1), dtype=ct)
    empty = np.empty(lead + (GL, 1), dtype=bool)
    sech2 = None if not o.has_slope or not save_probs else np.zeros_like(T)      # the chain's slope
    sub = max(1, _CACHE_ENTRIES // max(S, 1))          # rows per cache-sized block
    ext = lay.per_row(extras(prob))                    # the normaliser's extra logits (sinks), one per row
    lse_keys = None if ext is None else np.empty_like(lse)     # then the LSE over the keys alone
    max_keys = None if ext is None else np.empty_like(rowmax)  # and their own max

    def softmax_rows(t, lse_c, empty_c, m_c, s_c):
        if _fused(t, lse_c, empty_c, m_c, s_c):        # compiled: the passes fused, row by row
            return _native.fast_softmax_rows(_native.kernels(), t, m_c, s_c, lse_c, empty_c)
        # five passes (max, shift, exp, sum, scale) over blocks that stay in cache: the compiled passes'
        # formula in their order (the sum by pivot.lane_rowsum, the LSE from float64), only the exp is NumPy's
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for r0 in range(0, t.shape[0], sub):
                tb, eb, lb = t[r0:r0 + sub], empty_c[r0:r0 + sub], lse_c[r0:r0 + sub]
                m, s = m_c[r0:r0 + sub], s_c[r0:r0 + sub]
                m[...], eb[...], nan = row_stats(tb)         # the one rule: empty, NaN rows, the shift
                T0 = tb.copy() if nan.any() else None        # (the scores, for nan_row_probs)
                np.subtract(tb, m, out=tb)
                np.exp(tb, out=tb)
                s[...] = lane_rowsum(tb)
                np.divide(tb, s, out=tb)
                lb[...] = np.log(s.astype(np.float64)) + m.astype(np.float64)
                if T0 is not None:                           # NaN rows: NaN on the keys they read, 0 elsewhere
                    tb[...] = nan_row_probs(tb, T0, nan)
                    s[nan], lb[nan] = np.nan, np.nan

    def probs(Tc, r, ext_c, inner_parallel):
        """Scores ``Tc`` -> P in place, with the row results ``r`` (lse, empty, rowmax, rowsum, lse_keys,
        max_keys)."""
        lse_c, empty_c, m_c, s_c, lk_c, mk_c = r
        for rows in _matrices(Tc, lse_c, empty_c, m_c, s_c):
            if inner_parallel and rows[0].size >= MIN_PARALLEL:
                row_chunks(softmax_rows, *rows)
            else:
                softmax_rows(*rows)
        if ext_c is not None:                             # the normaliser closed by its extra logits
            e = empty_c.copy()
            lk_c[...] = lse_c
            m0, s0 = m_c.copy(), s_c.copy()
            mk_c[...] = np.where(e, -np.inf, m0)
            nrm = close(m0, s0, e, ext_c)
            # where the extra logits leave the normaliser as it was (a -inf sink), the LSE is the keys' own bits:
            # m + log(s) is taken once, by the row pass (NumPy's log and the C library's may differ in the last bit)
            same = (nrm.m == m0) & (nrm.s == s0)
            np.copyto(Tc, 0.0, where=e)
            np.multiply(Tc, nrm.r, out=Tc)                 # the keys' P times r
            m_c[...], s_c[...], empty_c[...] = nrm.m, nrm.s, nrm.empty
            with np.errstate(divide="ignore"):
                lse_c[...] = np.where(empty_c, -np.inf, np.where(same, lk_c, nrm.m + np.log(nrm.s)))

    def results(idx):
        return (lse[idx], empty[idx], rowmax[idx], rowsum[idx], None if ext is None else lse_keys[idx],
                None if ext is None else max_keys[idx])

    def chunk(idx, inner_parallel):
        fidx = lay.full_index(idx)
        qc, k, v = (block_of(a, lay.nd_g, idx) for a in (q, prob.k, prob.v))
        Tc, Oc, rows = T[idx], O[idx], lay.row_cuts
        if rows is None:
            scores_forward(qc, k, prob.scale, out=Tc)
        else:                                          # one unit: its products by blocks of rows in the pool
            qs, ks = _prescaled(qc, k, prob.scale)
            _by_blocks(rows, lambda r0, r1: _matmul(qs[..., r0:r1, :], np.swapaxes(ks, -1, -2),
                                                    Tc[..., r0:r1, :]), inner_parallel)
        transform_scores(prob, lay.full_view(Tc), lead=fidx,
                         sech2_out=None if sech2 is None else lay.full_view(sech2[idx]),
                         allowed=block_of(allowed, lay.nd_f, fidx))
        probs(Tc, results(idx), None if ext is None else ext[idx], inner_parallel)
        Pd = dropout_forward(lay.full_view(Tc), block_of(prob.keep, lay.nd_f, fidx), o.dropout_p).reshape(Tc.shape)
        if rows is None:
            np.matmul(Pd, v, out=Oc)
        else:
            _by_blocks(rows, lambda r0, r1: _matmul(Pd[..., r0:r1, :], v, Oc[..., r0:r1, :]), inner_parallel)

    def chunk_spans(idx, inner_parallel):
        # only the query blocks' key spans (:func:`key_spans`) are computed, every step on views of the chunk's
        # arrays (the compiled row passes take a block of columns): the products on the spans' cover by large
        # rectangles (:func:`rectangles`), the row passes span by span. The scale where the whole chunk's product
        # puts it (:func:`transforms.scores_forward`), so that each score is rounded as there
        sm = _summary_of(summ, idx)
        if sm is None:                                              # a batch entry whose keys all count
            return chunk(idx, inner_parallel)
        spans, rects = sm.spans, sm.rects
        qc, k, v = (block_of(a, lay.nd_g, idx) for a in (q, prob.k, prob.v))
        sc = qc.dtype.type(prob.scale)
        with np.errstate(over="ignore", invalid="ignore"):
            qs, ks = (sc * qc, k) if qc.shape[-2] <= S else (qc, sc * k)
        Tc, Oc, sc2, res = T[idx], O[idx], None if sech2 is None else sech2[idx], results(idx)
        rcuts = lay.span_cuts                                       # one unit: by blocks in the pool
        for g, fidx in lay.groups(idx):
            L0 = g * prob.L                                         # the group's rows of the grouped chunk:

            def scores(i0, i1, j0, j1, L0=L0, fidx=fidx):           # (..., Hkv, n, w), the heads fidx
                Tb = Tc[..., L0 + i0:L0 + i1, j0:j1]
                with np.errstate(over="ignore", invalid="ignore"):
                    np.matmul(qs[..., L0 + i0:L0 + i1, :], np.swapaxes(ks[..., j0:j1, :], -1, -2), out=Tb)
                transform_scores(prob, Tb, (i0, i1), (j0, j1), lead=fidx,
                                 sech2_out=None if sc2 is None else sc2[..., L0 + i0:L0 + i1, j0:j1],
                                 allowed=_EVERY if sm.is_full(i0, i1, j0, j1) else
                                 block_of(allowed, lay.nd_f, fidx, (i0, i1), (j0, j1)))
            _by_blocks(rects, scores, inner_parallel and rcuts is not None)   # each writes its own rectangle
            for i0, i1, j0, j1 in spans:
                r = tuple(None if a is None else np.empty(Tc.shape[:-2] + (i1 - i0, 1), a.dtype) for a in res)
                probs(Tc[..., L0 + i0:L0 + i1, j0:j1], r, None if ext is None else ext[idx][..., L0 + i0:L0 + i1, :],
                      inner_parallel)
                for dst, src in zip(res, r):
                    if dst is not None:
                        dst[..., L0 + i0:L0 + i1, :] = src
            def values(r0, r1, L0=L0, fidx=fidx):                   # O = P_drop V, summed over the rectangles
                for i0, i1, j0, j1 in _within(rects, r0, r1):       # (their rows r0:r1, in the rectangles' order)
                    Pd = dropout_forward(Tc[..., L0 + i0:L0 + i1, j0:j1],
                                         block_of(prob.keep, lay.nd_f, fidx, (i0, i1), (j0, j1)), o.dropout_p)
                    Oc[..., L0 + i0:L0 + i1, :] += Pd @ v[..., j0:j1, :]
            if rcuts is None:
                values(0, prob.L)
            else:
                _by_blocks(rcuts, values, inner_parallel)

    _run(chunk if summ is None else chunk_spans, _batch_chunks(lay, summ))
    P = T.reshape(full)
    empty = empty.reshape(full[:-1] + (1,))
    padded = prob.padded_rows()
    if np.any(empty) and _zero_rows(T, empty, padded, o.fully_masked):
        # the policy fills some row past 0: those rows, then O again (a rare path)
        P = fill_empty_rows(P, empty, padded, o.fully_masked, S, n=counts(prob), excl=excluded(prob))
        Pd = dropout_forward(P, prob.keep, o.dropout_p).reshape(lay.grouped + (S,))
        O = Pd @ prob.v
        vu = prob.averaged_values(empty)
        if vu is not prob.v:                           # "uniform": such a row reads every value
            O = np.where(empty.reshape(lay.grouped + (1,)), Pd @ vu, O)
    O = fill_output_without_keys(O.reshape(full[:-1] + (Ev,)), prob.nan_rows_without_keys())
    zr = zero_output_rows(empty, padded, o.fully_masked)
    if zr is not None:                                 # 0 by definition: no value is read
        O = np.where(zr, ct.type(0), O)
    return Forward(out=O, lse=lse.reshape(full[:-1]), probs=P if save_probs else None, extra=summ,
                   slope=None if sech2 is None else sech2.reshape(full), empty=empty,
                   rowmax=rowmax.reshape(full[:-1] + (1,)), rowsum=rowsum.reshape(full[:-1] + (1,)),
                   lse_keys=None if lse_keys is None else lse_keys.reshape(full[:-1]),
                   rowmax_keys=None if max_keys is None else max_keys.real.reshape(full[:-1]))


def backward(prob, fwd: Forward, dO, dlse=None) -> Grads:
    """The backward from the saved ``P``, with the pivoted softmax VJP and ``dT`` in place; ``dlse``
    ``(*batch, Hq, L, 1)`` the LSE's cotangent or None (then no pass is spent on it)."""
    lay = _Layout(prob)
    o, full, grouped, lead, S = prob.options, lay.full, lay.grouped, lay.lead, lay.S
    ct = prob.dtype
    E, Ev = prob.q.shape[-1], prob.v.shape[-1]
    q = prob.q.reshape(prob.q.shape[:-4] + (prob.Hkv, grouped[-1], E))
    dO = dO.reshape(grouped + (Ev,))
    Pg = np.broadcast_to(fwd.probs, full).reshape(grouped + (S,))
    sdg = None if fwd.slope is None else np.broadcast_to(fwd.slope, full).reshape(grouped + (S,))   # sech^2
    # the whole dT is kept only when attn_mask or bias needs its gradient (summed down afterwards);
    # otherwise each chunk works in its own buffer, which the allocator reuses
    keep_dT = prob.mask_float is not None or prob.bias is not None or (o.score_mod is not None and
                                                                        bool(o.score_mod.params))
    summ = _read_spans(prob, fwd)                                 # as the forward's: dT and P are 0 outside
    dT = (np.empty if summ is None else np.zeros)(grouped + (S,), dtype=ct) if keep_dT else None
    dq = np.empty(grouped + (E,), dtype=ct)
    dk = (np.empty if summ is None else np.zeros)(lead + (S, E), dtype=ct)     # the spans add into them
    dv = (np.empty if summ is None else np.zeros)(lead + (S, Ev), dtype=ct)
    cr = constant_rows(fwd.empty, prob.padded_rows(), o.fully_masked, counts(prob))   # their dT is 0, set not computed
    crg = None if cr is None else np.broadcast_to(cr, full[:-1] + (1,)).reshape(grouped + (1,))
    dlg = None if dlse is None else dlse.reshape(grouped + (1,))
    pe = extra_probs(lay.per_row(extras(prob)), *(x.reshape(grouped + (1,)) for x in (fwd.rowmax, fwd.rowsum)))
    dext = None if pe is None else np.empty(grouped + (1,), dtype=ct)
    sub = max(1, _CACHE_ENTRIES // max(S, 1))

    def score_grad_rows(d, p):
        # dT = P * ((dP - c) - rowsum(P * (dP - c))), c = dP at the row's largest P (pivot.row_pivot)
        if _fused(d, p):
            return _native.fast_softmax_vjp_rows(_native.kernels(), d, p)
        softmax_vjp_rows(d, p, sub)

    def score_grad(Pc, dTc, r, inner_parallel):
        """dP -> dT in place on a chunk's or a span's rows (``r`` their ``(sech^2, pe, dlse, constant rows,
        dextra)``): the softmax VJP, the LSE's and extra logits' terms, the constant rows (the chain's slope is the
        caller's)."""
        sd, pe_c, dl_c, cr_c, dext_c = r
        if pe_c is not None:                                               # and the extra columns: dP = 0
            dTc[...], dext_c[...] = vjp(Pc, dTc, pe_c, dl_c)
        else:
            for rows in _matrices(dTc, Pc):
                if inner_parallel and rows[0].size >= MIN_PARALLEL:
                    row_chunks(score_grad_rows, *rows)
                else:
                    score_grad_rows(*rows)                                 # dT = (dP - D) * P
        if dl_c is not None and pe_c is None:                              # ... + P * dlse (softmax_lse_vjp)
            dTc += Pc * dl_c
        if cr_c is not None:
            np.copyto(dTc, 0.0, where=cr_c)
            if dext_c is not None:
                np.copyto(dext_c, 0.0, where=cr_c)

    def grads(qc, k, v, Pc, dOc, dTc, keep, r, inner_parallel, fv=lay.full_view, rows=None):
        """One chunk's (or one span's) rows: ``dT`` into ``dTc``; returns ``(P_drop, dTraw)`` (``dTraw`` may be
        ``dTc``); ``r`` its rows of ``(sech^2, pe, dlse, constant rows, dextra)``, ``fv`` the full-layout view,
        ``rows`` the blocks of rows of one unit's products (:attr:`_Layout.row_cuts`) or None."""
        sd = r[0]
        Pd = Pc if keep is None else dropout_forward(fv(np.ascontiguousarray(Pc)), keep, o.dropout_p).reshape(Pc.shape)
        if rows is None:
            np.matmul(dOc, np.swapaxes(v, -1, -2), out=dTc)               # dP = dO V^T ...
        else:
            _by_blocks(rows, lambda r0, r1: _matmul(dOc[..., r0:r1, :], np.swapaxes(v, -1, -2), dTc[..., r0:r1, :]),
                       inner_parallel)
        if keep is not None:
            dropout_forward(fv(dTc), keep, o.dropout_p, out=fv(dTc))      # ... * Z / (1-p)
        score_grad(Pc, dTc, r, inner_parallel)
        return Pd, transform_scores_vjp(dTc, sd, out=None if keep_dT else dTc)

    def rows_of(idx):
        return tuple(None if a is None else a[idx] for a in (sdg, pe, dlg, crg, dext))

    def chunk(idx, inner_parallel):
        fidx = lay.full_index(idx)
        qc, k, v = (block_of(a, lay.nd_g, idx) for a in (q, prob.k, prob.v))
        Pc, dOc = Pg[idx], dO[idx]
        dTc = dT[idx] if keep_dT else np.empty(Pc.shape, dtype=ct)
        rows, keys = lay.row_cuts, lay.key_cuts
        Pd, dTraw = grads(qc, k, v, Pc, dOc, dTc, block_of(prob.keep, lay.nd_f, fidx), rows_of(idx), inner_parallel,
                          rows=rows)
        if rows is None:
            transposed_product(Pd, dOc, out=dv[idx])                      # dV = P_drop^T dO
            scores_vjp(dTraw, qc, k, prob.scale, dq_out=dq[idx], dk_out=dk[idx])
            return
        # one unit: dq by blocks of rows, dV and dK by blocks of keys (each a whole sum over the rows), in the pool
        dvc, dqc, dkc = dv[idx], dq[idx], dk[idx]
        _by_blocks(keys, lambda j0, j1: transposed_product(Pd[..., j0:j1], dOc, out=dvc[..., j0:j1, :]), inner_parallel)
        _by_blocks(rows, lambda r0, r1: scores_vjp(dTraw[..., r0:r1, :], qc[..., r0:r1, :], k, prob.scale,
                                                   dq_out=dqc[..., r0:r1, :], dk_out=False), inner_parallel)
        _by_blocks(keys, lambda j0, j1: scores_vjp(dTraw[..., j0:j1], qc, k[..., j0:j1, :], prob.scale, dq_out=False,
                                                   dk_out=dkc[..., j0:j1, :]), inner_parallel)

    def chunk_spans(idx, inner_parallel):
        # the forward's spans: the products on their cover by rectangles, dT's row passes span by span, on views
        # of the chunk's P, dO and dT; dq, dK and dV summed over the rectangles, then scaled
        sm = _summary_of(summ, idx)
        if sm is None:                                              # a batch entry whose keys all count
            return chunk(idx, inner_parallel)
        spans, rects = sm.spans, sm.rects
        qc, k, v = (block_of(a, lay.nd_g, idx) for a in (q, prob.k, prob.v))
        Pc, dOc, dqc, dkc, dvc = Pg[idx], dO[idx], dq[idx], dk[idx], dv[idx]
        dTc = dT[idx] if keep_dT else np.empty(Pc.shape, dtype=ct)
        # dTraw = dT times the chain's slope: in place, unless dT itself is kept (dB = dT)
        dTr = np.empty(Pc.shape, dtype=ct) if keep_dT and sdg is not None else dTc
        r_c = rows_of(idx)
        dqc[...] = 0
        rcuts, kcuts = lay.span_cuts, lay.span_key_cuts             # one unit: by blocks in the pool
        for g, fidx in lay.groups(idx):
            L0 = g * prob.L

            def dP_of(i0, i1, j0, j1, L0=L0, fidx=fidx):            # dP = dO V^T Z / (1 - p)
                dTb = dTc[..., L0 + i0:L0 + i1, j0:j1]
                np.matmul(dOc[..., L0 + i0:L0 + i1, :], np.swapaxes(v[..., j0:j1, :], -1, -2), out=dTb)
                keep = block_of(prob.keep, lay.nd_f, fidx, (i0, i1), (j0, j1))
                if keep is not None:
                    dropout_forward(dTb, keep, o.dropout_p, out=dTb)
            _by_blocks(rects, dP_of, inner_parallel and rcuts is not None)    # each writes its own rectangle
            for i0, i1, j0, j1 in spans:                            # dT, row by row
                rows = slice(L0 + i0, L0 + i1)
                r = tuple(None if a is None else a[..., rows, j0:j1] if n == 0 else a[..., rows, :]
                          for n, a in enumerate(r_c))
                score_grad(Pc[..., rows, j0:j1], dTc[..., rows, j0:j1], r, inner_parallel)
                if r[0] is not None:
                    transform_scores_vjp(dTc[..., rows, j0:j1], r[0], out=dTr[..., rows, j0:j1])
            def key_sums(c0, c1, L0=L0, fidx=fidx):
                # dV += P_drop^T dO and dK += dT^T Q as their transposes (short, wide products), over the
                # rectangles' keys c0:c1, in the rectangles' order
                with np.errstate(over="ignore", invalid="ignore"):
                    for i0, i1, j0, j1 in _within(rects, c0, c1, keys=True):
                        rows = slice(L0 + i0, L0 + i1)
                        dTb, qb, dOb = dTr[..., rows, j0:j1], qc[..., rows, :], dOc[..., rows, :]
                        Pd = dropout_forward(Pc[..., rows, j0:j1], block_of(prob.keep, lay.nd_f, fidx, (i0, i1),
                                                                            (j0, j1)), o.dropout_p)
                        dvc[..., j0:j1, :] += np.swapaxes(np.matmul(np.swapaxes(dOb, -1, -2), Pd), -1, -2)
                        dkc[..., j0:j1, :] += np.swapaxes(np.matmul(np.swapaxes(qb, -1, -2), dTb), -1, -2)

            def row_sums(r0, r1, L0=L0):                             # dq += dT K, over the rows r0:r1
                with np.errstate(over="ignore", invalid="ignore"):
                    for i0, i1, j0, j1 in _within(rects, r0, r1):
                        rows = slice(L0 + i0, L0 + i1)
                        dqc[..., rows, :] += np.matmul(dTr[..., rows, j0:j1], k[..., j0:j1, :])
            if rcuts is None:
                key_sums(0, S)
                row_sums(0, prob.L)
            else:
                _by_blocks(kcuts, key_sums, inner_parallel)
                _by_blocks(rcuts, row_sums, inner_parallel)
        sc = ct.type(prob.scale)
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(dqc, sc, out=dqc)
            np.multiply(dkc, sc, out=dkc)

    _run(chunk if summ is None else chunk_spans, _batch_chunks(lay, summ))
    dT = None if dT is None else dT.reshape(full)
    return Grads(dq=dq.reshape(full[:-1] + (E,)), dk=dk, dv=dv,
                 dmask=None if prob.mask_float is None else additive_vjp(dT, prob.shapes["attn_mask"]),
                 dbias=None if prob.bias is None else additive_vjp(dT, prob.shapes["bias"]),
                 dextra=None if dext is None else dext.reshape(full[:-1]).sum(axis=-1),
                 dmod=None if dT is None else _tuple(Blocks(prob).mod_grads(dT, 0, prob.L, 0, S)))


def _tuple(x):
    return None if x is None else tuple(x)


def jvp(prob, fwd: Forward, dq=None, dk=None, dv=None, dbias=None, dv_full=None, dextra=None) -> np.ndarray:
    r"""The output tangent ``(*batch, Hq, L, Ev)`` from the saved ``P``, as the backward is computed: the tangent
    scores by GEMMs, the pivoted softmax map in place on them (the Jacobian is symmetric: the backward's row pass),
    one GEMM with the values.

    .. math:: dT = s\,(dQ K^T + Q\,dK^T) \odot \mathrm{sech}^2 + dB, \quad
              dP = P \odot (dT - \mathrm{rowsum}(P \odot dT)), \quad
              dO = \frac{dP \odot Z}{1 - p} V + P_{drop}\, dV

    (an extra logit's column takes its tangent ``dextra``). The tangents are in the core's layouts
    (:func:`sdpa_ref.attention.jvp`); None is zero.
    """
    lay = _Layout(prob)
    o, full, grouped, S = prob.options, lay.full, lay.grouped, lay.S
    ct, Ev = prob.dtype, prob.v.shape[-1]
    E = prob.q.shape[-1]
    q = prob.q.reshape(prob.q.shape[:-4] + (prob.Hkv, grouped[-1], E))
    dqg = None if dq is None else dq.reshape(dq.shape[:-4] + (prob.Hkv, grouped[-1], E))
    Pg = np.broadcast_to(fwd.probs, full).reshape(grouped + (S,))
    sdg = None if fwd.slope is None else np.broadcast_to(fwd.slope, full).reshape(grouped + (S,))   # sech^2
    out = np.zeros(grouped + (Ev,), dtype=ct)
    scored = dq is not None or dk is not None or dbias is not None or dextra is not None
    cr = constant_rows(fwd.empty, prob.padded_rows(), o.fully_masked, counts(prob))       # P constant there: dP = 0
    crg = None if cr is None else np.broadcast_to(cr, full[:-1] + (1,)).reshape(grouped + (1,))
    pe = extra_probs(lay.per_row(extras(prob)), *(x.reshape(grouped + (1,)) for x in (fwd.rowmax, fwd.rowsum)))
    deg = None if pe is None or dextra is None else lay.per_row(dextra)
    sub = max(1, _CACHE_ENTRIES // max(S, 1))

    def chunk(idx, inner_parallel):
        fidx = lay.full_index(idx)
        qc, k, v = (block_of(a, lay.nd_g, idx) for a in (q, prob.k, prob.v))
        Pc, keep = Pg[idx], block_of(prob.keep, lay.nd_f, fidx)
        if scored:
            t = scores_jvp(qc, k, block_of(dqg, lay.nd_g, idx), block_of(dk, lay.nd_g, idx), prob.scale)
            dP = np.empty(Pc.shape, ct)                                     # dTraw = s (dQ K^T + Q dK^T), then
            dP[...] = 0 if t is None else t                                 # dT: softcap's slope, + dB
            dPf = lay.full_view(dP)
            dPf[...] = transform_scores_jvp(dPf, None if sdg is None else sdg[idx].reshape(dPf.shape),
                                            block_of(dbias, lay.nd_f, fidx))
            if pe is not None:                                              # and the extra columns: d sigma
                dP[...] = vjp(Pc, dP, pe[idx], d_extra=None if deg is None else deg[idx])[0]
            elif _fused(_rows(dP), _rows(Pc)):                              # P * ((dT - c) - D), in place
                _native.fast_softmax_vjp_rows(_native.kernels(), _rows(dP), _rows(Pc))
            else:
                softmax_vjp_rows(_rows(dP), _rows(Pc), sub)
            if crg is not None:
                np.copyto(dP, 0.0, where=crg[idx])
            if keep is not None:
                dropout_forward(lay.full_view(dP), keep, o.dropout_p, out=lay.full_view(dP))
            np.matmul(dP, v, out=out[idx])                                  # dP Z / (1 - p) V
        if dv is not None:
            Pd = Pc if keep is None else dropout_forward(lay.full_view(np.ascontiguousarray(Pc)), keep,
                                                         o.dropout_p).reshape(Pc.shape)
            out[idx] += Pd @ block_of(dv, lay.nd_g, idx)                    # + P_drop dV

    summ = _read_spans(prob, fwd)                                 # P is 0 outside the forward's spans

    def chunk_spans(idx, inner_parallel):
        # the forward's spans: the tangent scores and the products on their cover by rectangles, the row
        # passes span by span, on views of one chunk-sized dP
        sm = _summary_of(summ, idx)
        if sm is None:                                              # a batch entry whose keys all count
            return chunk(idx, inner_parallel)
        spans, rects = sm.spans, sm.rects
        qc, k, v = (block_of(a, lay.nd_g, idx) for a in (q, prob.k, prob.v))
        dqc, dkc, dvc = (block_of(a, lay.nd_g, idx) for a in (dqg, dk, dv))
        Pc, outc = Pg[idx], out[idx]
        dP = np.empty(Pc.shape, ct) if scored else None
        for g, fidx in lay.groups(idx):
            L0 = g * prob.L
            for i0, i1, j0, j1 in (rects if scored else ()):     # dT = s (dQ K^T + Q dK^T) sech^2 + dB
                rows = slice(L0 + i0, L0 + i1)
                t = scores_jvp(qc[..., rows, :], k[..., j0:j1, :], None if dqc is None else dqc[..., rows, :],
                               None if dkc is None else dkc[..., j0:j1, :], prob.scale)
                db = block_of(dbias, lay.nd_f, fidx, (i0, i1), (j0, j1))
                dP[..., rows, j0:j1] = transform_scores_jvp(0 if t is None else t,
                                                            None if sdg is None else sdg[idx][..., rows, j0:j1], db)
            for i0, i1, j0, j1 in (spans if scored else ()):      # P * ((dT - c) - D), in place
                rows = slice(L0 + i0, L0 + i1)
                Pb, dPb = Pc[..., rows, j0:j1], dP[..., rows, j0:j1]
                if pe is not None:
                    dPb[...] = vjp(Pb, dPb, pe[idx][..., rows, :],
                                   d_extra=None if deg is None else deg[idx][..., rows, :])[0]
                else:
                    for mats in _matrices(dPb, Pb):
                        if _fused(*mats):
                            _native.fast_softmax_vjp_rows(_native.kernels(), *mats)
                        else:
                            softmax_vjp_rows(*mats, sub)
                if crg is not None:
                    np.copyto(dPb, 0.0, where=crg[idx][..., rows, :])
            for i0, i1, j0, j1 in rects:                          # dO = dP Z / (1 - p) V + P_drop dV
                rows = slice(L0 + i0, L0 + i1)
                keep = block_of(prob.keep, lay.nd_f, fidx, (i0, i1), (j0, j1))
                if scored:
                    outc[..., rows, :] += dropout_forward(dP[..., rows, j0:j1], keep, o.dropout_p) @ v[..., j0:j1, :]
                if dvc is not None:
                    outc[..., rows, :] += dropout_forward(Pc[..., rows, j0:j1], keep, o.dropout_p) @ dvc[..., j0:j1, :]

    _run(chunk if summ is None else chunk_spans, _batch_chunks(lay, summ))
    if dv is not None:
        dvu = prob.averaged_values(fwd.empty, dv, dv_full)
        if dvu is not dv:                                  # "uniform": such a row averages every value's tangent
            Pd = dropout_forward(np.broadcast_to(fwd.probs, full), prob.keep, o.dropout_p).reshape(grouped + (S,))
            out = np.where(np.broadcast_to(fwd.empty, full[:-1] + (1,)).reshape(grouped + (1,)), Pd @ dvu, out)
    return out.reshape(full[:-1] + (Ev,))


# ------------------------------------------------------------- chunking


def _fused(*arrays):
    """Whether the compiled row passes (:mod:`sdpa_ref.exact._native`) take these arrays: the library is there and
    they are C-contiguous float64 or float32 of one dtype (bool flags aside)."""
    t = arrays[0]
    return (t.dtype in (np.float64, np.float32)
            and all(a.flags.c_contiguous or a.shape[-1] > 1 and _native.row_stride(a) is not None for a in arrays)
            and all(a.dtype in (t.dtype, np.bool_) for a in arrays) and _native.kernels() is not None)


def _chunk_entries(width):
    """Score entries per chunk for head width ``E + Ev``: ``_CHUNK_ENTRIES`` scaled by ``width / 128``,
    between a quarter of it and all of it.

    The cut pays when the element-wise work (``exp`` above all, a scalar loop
    in NumPy) is a large part of the time; the GEMM work per score entry
    grows with ``E + Ev``, so the wider the heads, the more entries a chunk
    needs before the cut pays (the timings behind the sizes are in
    ``docs/performance.md``, "Where the numbers in the code went").
    """
    return max(_CHUNK_ENTRIES >> 2, min(_CHUNK_ENTRIES, _CHUNK_ENTRIES * width // 128))


def _head_chunks(lead, unit, width=128, kv_bytes=0):
    """Rectangular chunks of the leading ``(*batch, Hkv)`` index, as tuples of slices.

    Each chunk holds about :func:`_chunk_entries` score entries (``unit`` is
    the number of one ``(batch, kv head)``, ``width`` is ``E + Ev``): whole
    trailing axes, a range of the next one, single indices of the outer
    ones. The cut depends on the shape only. One chunk (everything) when the
    problem is below two chunks or there is one thread, unless the keys and
    values read are large (``kv_bytes``, those of one unit, times the units, at
    least :data:`_KV_BYTES`): a decode's few scores against many keys, whose
    products stream the keys and values from memory, then runs two chunks
    per thread (one piece runs its products on one thread: the BLAS is held).
    """
    whole = [tuple(slice(None) for _ in lead)]
    N = math.prod(lead)
    target = _chunk_entries(width)
    if num_threads() == 1 or N < 2:
        return whole
    if N * unit < 2 * target:
        if N * kv_bytes < _KV_BYTES:
            return whole
        target = max(1, N * unit // min(N, 2 * num_threads()))     # two chunks per thread
    per = max(1, target // max(unit, 1))                  # units per chunk
    ax, t = len(lead) - 1, 1
    while ax >= 0 and t * lead[ax] <= per:
        t *= lead[ax]
        ax -= 1
    if ax < 0:
        return whole
    r = max(1, per // t)
    chunks = []
    for outer in np.ndindex(*lead[:ax]):
        for a0 in range(0, lead[ax], r):
            chunks.append(tuple(slice(i, i + 1) for i in outer) + (slice(a0, min(a0 + r, lead[ax])),)
                          + tuple(slice(None) for _ in lead[ax + 1:]))
    return chunks


def _zero_rows(T, empty, padded, policy):
    """Set to 0, in place, the rows of ``P`` (``T``, C-contiguous, its rows in the order of ``empty``'s) whose
    output is 0 by definition (:func:`sdpa_ref.policy.zero_output_rows`: padded query rows under every policy,
    every row without a key under ``"zero"``): their ``P`` is 0 too, which the row pass left 0/0, and O needs no
    second product. Returns whether a row without a key is left for the policy to fill otherwise (then
    :func:`fill_empty_rows` and O again, on the whole matrix)."""
    zr = zero_output_rows(empty, padded, policy)
    if zr is None:
        return True
    zr = np.broadcast_to(zr, empty.shape)
    _rows(T)[np.flatnonzero(zr)] = 0
    return bool(np.any(empty & ~zr))


def _run(worker, chunks):
    """One chunk inline (its row passes may use the pool); several side by side in the pool.

    Chunks run in the pool only while the BLAS is held to one thread (every
    public call holds it); otherwise their GEMMs would oversubscribe the
    cores, and they run one by one.
    """
    if len(chunks) > 1 and blas_is_held() and num_threads() > 1:
        run_all(lambda c: worker(c, False), chunks)
        return
    for c in chunks:
        worker(c, True)


class _Layout:
    """The shapes of one problem in the grouped ``(*batch, Hkv, G*L)`` and full ``(*batch, Hq, L)`` layouts."""

    def __init__(self, prob):
        self.full = prob.full_scores
        self.G, self.S = prob.G, prob.S
        self.grouped = prob.batch + (prob.Hkv, self.G * prob.L)
        self.lead = self.grouped[:-1]
        width = prob.q.shape[-1] + prob.v.shape[-1]
        self.chunks = _head_chunks(self.lead, self.grouped[-1] * self.S, width,
                                   self.S * width * np.dtype(prob.dtype).itemsize)
        single = math.prod(self.lead) == 1             # one unit: its products cut by rows and keys (_cuts)
        self.row_cuts = _cuts(self.grouped[-1]) if single else None
        self.key_cuts = _cuts(self.S) if single and self.row_cuts is not None else None
        if self.key_cuts is None:
            self.row_cuts = None
        # with the spans: one unit's rectangles side by side, its sums over them by blocks of rows and keys
        self.span_cuts = _cuts(prob.L) if single and self.S >= 2 * _CUT_MIN else None
        self.span_key_cuts = _cuts(self.S) if self.span_cuts is not None else None
        if self.span_key_cuts is None:
            self.span_cuts = None
        self.nd_g, self.nd_f = len(self.lead) + 2, len(self.full)

    def full_index(self, idx):
        """A chunk of the grouped ``(*batch, Hkv)`` index as one of the full ``(*batch, Hq)`` index."""
        h = idx[-1]
        hq = h if h.start is None else slice(h.start * self.G, h.stop * self.G)
        return idx[:-1] + (hq,)

    def groups(self, idx):
        """``(g, lead)`` for each group ``g`` of a chunk ``idx``: ``lead`` the full-layout index of the group's
        heads in the chunk (every ``G``-th head from ``g``), whose scores are the grouped chunk's rows
        ``g L + [0, L)``."""
        h = idx[-1]
        h0, h1 = (h.start or 0) * self.G, (self.lead[-1] if h.stop is None else h.stop) * self.G
        for g in range(self.G):
            yield g, idx[:-1] + (slice(h0 + g, h1, self.G),)

    def per_row(self, x):
        """A per-head (or per-row) ``(..., Hq, 1 or L, 1)`` array (the extra logits) as one value per row in the
        grouped layout ``(*batch, Hkv, G*L, 1)``; None stays None."""
        return None if x is None else np.broadcast_to(x, self.full[:-1] + (1,)).reshape(self.grouped + (1,))

    def full_view(self, a, rows=None):
        """The full-layout view ``(..., Hq, L, n)`` of a grouped-layout chunk ``(..., Hkv, G*L, n)`` (``rows``
        in place of ``L``: a block of each group's rows)."""
        rows = self.full[-2] if rows is None else rows
        r = a.reshape(a.shape[:-3] + (a.shape[-3] * self.G, rows, a.shape[-1]))
        assert r.size == 0 or np.may_share_memory(r, a), "a chunk must be a view of its buffer"
        return r


#: The fewest keys at which the block-skipping schedule runs, in float64 and in a narrower compute dtype. Measured
#: side by side (2 threads, forward + backward, causal against unmasked, ``1x8x1024x64``): in float64 the spans
#: (blocks of 128 rows) cost 0.88-0.94x the unmasked call against 1.01-1.08x computing every score; in float32
#: with ``upcast=False``, whose products and passes take half the time, their smaller products and per-span
#: passes cost more than the masked half they skip (1.12-1.25x against 1.08x), so there they start at 2048 keys
#: (0.76-0.79x at ``L = 2048``). At S = 4096 float64 they cost 0.71x.
SPAN_MIN_KEYS = 1024
SPAN_MIN_KEYS_NARROW = 2048


#: Where the allowed set differs between batch entries (per-batch lengths: a packed varlen batch padded to its longest
#: sequence), every entry takes its own spans from :data:`SPAN_MIN_KEYS` keys in either dtype, and below that, in
#: float64, where they hold at most this share of its scores (a short sequence's padding). Packed varlen (four
#: causal sequences of L/8, L/4, 3L/8 and L/4 tokens, padded to 3L/8), 8 heads of 64 (4 at ``L = 4096``), forward +
#: backward, 2 threads, medians of 7 to 15 interleaved rounds: ``L = 1024`` (384 keys) float64, every padded score
#: 140-145 ms, the short sequences' spans 122-129 ms; float32, 90-95 ms against 93-97 ms (so none there);
#: ``L = 4096`` (1536 keys) float32, 332 ms, 233 ms with the share, 207 ms with every entry's spans.
_SPAN_SHARE = 0.5
#: ... from this many keys (two blocks of rows' worth: below, a span saves less than its passes cost).
_SPAN_SHARE_MIN_KEYS = 256


class _BatchSpans:
    """The spans of each batch entry (:func:`.blocks.key_spans` over its heads), for a problem whose allowed set
    differs between batch entries: ``per`` maps the batch index to a :class:`.blocks.BlockSummary`, or to None
    where that entry runs over every key. Its chunks hold one batch entry each (:func:`_batch_chunks`); the
    spans depend on the shape and the mask only, as the whole problem's do."""

    def __init__(self, per, nb):
        self.per, self.nb = per, nb

    def of(self, idx):
        return self.per[tuple(s.start for s in idx[:self.nb])]


def _summary_of(summ, idx):
    """The :class:`.blocks.BlockSummary` that the chunk ``idx`` runs on, or None (every key)."""
    return summ.of(idx) if isinstance(summ, _BatchSpans) else summ


def _batch_chunks(lay, summ):
    """The chunks a schedule runs: :attr:`_Layout.chunks`, cut at batch entries where each entry has its own spans
    (:class:`_BatchSpans`): then one batch entry (a range of its kv heads) per chunk, on any thread count."""
    if not isinstance(summ, _BatchSpans):
        return lay.chunks
    out = []
    for idx in lay.chunks:
        ranges = [range(*s.indices(n)) for s, n in zip(idx[:summ.nb], lay.lead)]
        out.extend(tuple(slice(i, i + 1) for i in b) + idx[summ.nb:] for b in itertools.product(*ranges))
    return out


def _spans(prob, allowed):
    """:func:`.blocks.key_spans` of the problem's allowed set, in blocks of :func:`.blocks.span_rows` query rows,
    or None (nothing to skip, or too few keys for skipping to pay, :data:`SPAN_MIN_KEYS` in float64 and
    :data:`SPAN_MIN_KEYS_NARROW` in a narrower compute dtype: every block runs over every key, as one product
    per head).

    Where the allowed set differs between batch entries (per-batch lengths, a bool mask with a batch axis), each
    entry has its own spans (:class:`_BatchSpans`): the union would run a short sequence over its batch's longest.
    From :data:`SPAN_MIN_KEYS` keys in either dtype; below, in float64, an entry takes them only where they hold at
    most :data:`_SPAN_SHARE` of its scores (the padding of a short sequence), from :data:`_SPAN_SHARE_MIN_KEYS` keys."""
    if allowed is None:
        return None
    a = np.asarray(allowed)
    nb = len(prob.batch)
    a = a.reshape((1,) * (len(prob.full_scores) - a.ndim) + a.shape)
    if all(d == 1 for d in a.shape[:nb]):
        enough = prob.S >= (SPAN_MIN_KEYS if np.dtype(prob.dtype).itemsize >= 8 else SPAN_MIN_KEYS_NARROW)
        return key_spans(allowed, prob.L, prob.S, span_rows(prob.L)) if enough else None
    share = 1.0 if prob.S >= SPAN_MIN_KEYS else \
        _SPAN_SHARE if np.dtype(prob.dtype).itemsize >= 8 and prob.S >= _SPAN_SHARE_MIN_KEYS else 0.0
    if share == 0:
        return None
    per = {}
    for b in np.ndindex(*prob.batch):
        sm = key_spans(a[tuple(i if n > 1 else 0 for i, n in zip(b, a.shape))], prob.L, prob.S, span_rows(prob.L))
        if sm is not None and sum((i1 - i0) * (j1 - j0) for i0, i1, j0, j1 in sm.spans) > share * prob.L * prob.S:
            sm = None
        per[b] = sm
    return None if all(sm is None for sm in per.values()) else _BatchSpans(per, nb)


#: Rows (or keys) from which one ``(batch, kv head)`` unit's products are cut into blocks (:func:`_cuts`).
_CUT_MIN = 512


def _cuts(n):
    """Fixed blocks ``(start, stop)`` of ``n`` rows or keys for the products of a problem with one
    ``(batch, kv head)`` unit, or None (fewer than ``2 * _CUT_MIN``): eight blocks of at least :data:`_CUT_MIN`.
    They depend on the shape alone, so the bits do not depend on the threads; each block is a whole product
    (rows of ``Q K^T``, ``P V``, ``dO V^T`` and ``dT K``; keys of ``P^T dO`` and ``dT^T Q``), never a part of a
    sum. Such a problem is one chunk (:func:`_head_chunks`), whose products would run on one thread."""
    if n < 2 * _CUT_MIN:
        return None
    b = max(_CUT_MIN, -(-n // 8))
    return [(i, min(n, i + b)) for i in range(0, n, b)]


def _by_blocks(cuts, fn, inner_parallel):
    """``fn(start, stop)`` for each block of ``cuts``, in the pool when the chunk may use it."""
    if inner_parallel and len(cuts) > 1 and blas_is_held() and num_threads() > 1:
        run_all(lambda c: fn(*c), cuts)
    else:
        for c in cuts:
            fn(*c)


def _within(rects, a, b, keys=False):
    """The rectangles ``(i0, i1, j0, j1)`` cut to the rows ``a:b`` (``keys``: the keys), those left non-empty, in
    their order."""
    out = []
    for i0, i1, j0, j1 in rects:
        if keys:
            j0, j1 = max(j0, a), min(j1, b)
        else:
            i0, i1 = max(i0, a), min(i1, b)
        if i0 < i1 and j0 < j1:
            out.append((i0, i1, j0, j1))
    return out


def _matmul(a, b, out):
    with np.errstate(over="ignore", invalid="ignore"):
        np.matmul(a, b, out=out)


def _prescaled(q, k, scale):
    """``(scale * q, k)`` or ``(q, scale * k)``, the operand with fewer rows scaled, as
    :func:`sdpa_ref.transforms.scores_forward` does."""
    s = q.dtype.type(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        return (s * q, k) if q.shape[-2] <= k.shape[-2] else (q, s * k)


def _read_spans(prob, fwd):
    """The spans a backward or JVP reads ``P`` on: the forward's (or the problem's, :func:`_spans`), or None (the
    whole rows) where a fully masked row's ``P`` is not 0 outside them: ``"nan"``, ``"uniform"`` and ``"jax"``
    fill such a row on every key (or every excluded one), which no span holds. (Found by the split-KV test with
    two-row blocks: a causal, masked, ``"nan"`` problem's ``dK`` was 0, not NaN, on a key past its row block's
    span.)"""
    summ = fwd.extra if isinstance(fwd.extra, (BlockSummary, _BatchSpans)) else _spans(prob, prob.allowed())
    if summ is not None and fills_past_allowed(prob.options.fully_masked, fwd.empty, prob.padded_rows()):
        return None
    return summ


def _matrices(*arrays):
    """The 2-D ``(rows, n)`` matrices the row passes run on: each array as one when it is one in memory (a
    chunk), else one per leading index (a block's view: rows of a wider array, one matrix per head)."""
    flat = [_flat_rows(a) for a in arrays]
    if all(f is not None for f in flat):
        return [tuple(flat)]
    return [tuple(a[ix] for a in arrays) for ix in np.ndindex(*arrays[0].shape[:-2])]


def _flat_rows(a):
    """``a`` as a 2-D ``(rows, n)`` view when its rows are evenly spaced in memory, else None (never a copy)."""
    rows = math.prod(a.shape[:-1])
    if a.flags.c_contiguous:
        return a.reshape(rows, a.shape[-1])
    shape = [(n, st) for n, st in zip(a.shape[:-1], a.strides[:-1]) if n != 1]
    if any(shape[i][1] != shape[i + 1][1] * shape[i + 1][0] for i in range(len(shape) - 1)):
        return None
    return np.lib.stride_tricks.as_strided(a, (rows, a.shape[-1]), (shape[-1][1] if shape else 0, a.strides[-1]))


def _rows(a):
    """``a`` as a 2-D ``(rows, last)`` array (also when the last dim is 0)."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])
