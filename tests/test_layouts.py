"""Sequences as kernels store them (sdpa_ref.layouts): packed varlen and KV caches, contiguous or paged.

The oracle takes each sequence out of the storage by hand, with loops over FlashAttention's conventions (rows
``cu_seqlens[b] + i``, ``seqused``, a left pad; cache position ``t = leftpad + j`` on page ``table[b, t // P]``,
slot ``t % P``), and runs the dense attention of that sequence alone. The layout's results must be those, row by
row, forward, backward (the storage's gradient summed where a page repeats) and JVP, on every engine; positions no
sequence uses hold 0 and are never read.
"""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref import KVCache, Packed, sdpa_backward, sdpa_forward, sdpa_jvp

from helpers import assert_close_normwise
from tolerances import F64_FEW_ULP, F64_SUMS, FD_SECOND_ORDER

HOWS = {"fast": {}, "plain": {"method": "plain"}, "tiled-2": {"block_size": 2},
        "reproducible": {"precision": "reproducible"}}
RTOL = {"fast": F64_SUMS, "plain": F64_SUMS, "tiled-2": F64_SUMS, "reproducible": F64_FEW_ULP}


def _options(draw, rng, Hq):
    o = {"is_causal": draw(st.booleans()), "causal_alignment": "bottom_right",
         "fully_masked": draw(st.sampled_from(["zero", "nan"]))}
    if draw(st.booleans()):
        o["window"] = (draw(st.sampled_from([None, 0, 2])), draw(st.sampled_from([None, 0, 1])))
    if draw(st.booleans()):
        o["softcap"] = 2.0
    if draw(st.booleans()):
        o["sinks"] = np.where(rng.random(Hq) < 0.3, -np.inf, rng.standard_normal(Hq))
    if draw(st.booleans()):
        o["alibi_slopes"] = rng.uniform(0.1, 1.0, Hq)
    return o


# ------------------------------------------------------------ packed


@st.composite
def packed(draw):
    B, Hkv, G = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Hq = Hkv * G
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lq, lk = rng.integers(0, 4, B), rng.integers(0, 5, B)
    span_q, span_k = lq + rng.integers(0, 2, B), lk + rng.integers(0, 2, B)
    pad = np.minimum(rng.integers(0, 2, B), lk) if draw(st.booleans()) else None
    used_k = lk + (0 if pad is None else pad)
    span_k = np.maximum(span_k, used_k)
    cq, ck = np.r_[0, np.cumsum(span_q)], np.r_[0, np.cumsum(span_k)]
    extra = draw(st.integers(0, 2))
    q = rng.standard_normal((cq[-1] + extra, Hq, 3))
    k, v = rng.standard_normal((ck[-1] + extra, Hkv, 3)), rng.standard_normal((ck[-1] + extra, Hkv, 2))
    lay = Packed(cq, ck, seqused_q=lq if (span_q != lq).any() else None,
                 seqused_k=used_k if (span_k != used_k).any() else None, key_leftpad=pad)
    o = dict(_options(draw, rng, Hq), enable_gqa=G > 1)
    seqs = [(np.arange(cq[b], cq[b] + lq[b]), np.arange(ck[b], ck[b] + used_k[b])[used_k[b] - lk[b]:])
            for b in range(B)]
    return lay, (q, k, v), o, seqs


def _packed_oracle(q, k, v, o, seqs, g, ts, how):
    """Each sequence alone, dense; results placed back in the storage's rows by hand (0 elsewhere)."""
    out, dq, dk, dv = np.zeros(q.shape[:2] + v.shape[-1:]), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    lse, jvp = np.full((q.shape[1], q.shape[0]), -np.inf), np.zeros(out.shape)
    dsinks = None if "sinks" not in o else np.zeros(q.shape[1])
    t = lambda x: np.swapaxes(x, 0, 1)[None]                                                 # noqa: E731
    for rows_q, rows_k in seqs:
        if not len(rows_q):
            continue
        qs, ks, vs = t(q[rows_q]), t(k[rows_k]), t(v[rows_k])
        o_b, res = sdpa_forward(qs, ks, vs, **o, **how)
        gr = sdpa_backward(res, t(g[rows_q]))
        out[rows_q], lse[:, rows_q] = np.swapaxes(o_b[0], 0, 1), res.lse[0]
        dq[rows_q], dk[rows_k], dv[rows_k] = (np.swapaxes(x[0], 0, 1) for x in (gr.query, gr.key, gr.value))
        if dsinks is not None:
            dsinks += gr.sinks
        tan = (t(ts[0][rows_q]), t(ts[1][rows_k]), t(ts[2][rows_k]))
        jvp[rows_q] = np.swapaxes(sdpa_jvp((qs, ks, vs), tan, **o, **how)[1][0], 0, 1)
    return out, lse, dq, dk, dv, dsinks, jvp


@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(case=packed())
def test_packed_sequences_are_the_dense_attention_of_each_sequence(case, how):
    lay, (q, k, v), o, seqs = case
    rng = np.random.default_rng(1)
    g = rng.standard_normal(q.shape[:2] + v.shape[-1:])
    ts = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    out, res = sdpa_forward(q, k, v, layout=lay, **o, **HOWS[how])
    gr = sdpa_backward(res, g)
    jvp = sdpa_jvp((q, k, v), ts, layout=lay, **o, **HOWS[how])[1]
    want = _packed_oracle(q, k, v, o, seqs, g, ts, HOWS[how])
    got = (out, res.lse, gr.query, gr.key, gr.value, gr.sinks, jvp)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "dsinks", "jvp"), got, want):
        assert_close_normwise(y, x, RTOL[how])


# ------------------------------------------------------------ KV caches


@st.composite
def caches(draw):
    B, Hkv, G, Lq = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    Hq = Hkv * G
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    form = draw(st.sampled_from(["contiguous", "table", "csr"]))
    P = draw(st.integers(1, 4)) if form != "contiguous" else draw(st.integers(1, 6))
    hnd = draw(st.booleans())
    if form == "contiguous":
        rows = rng.permutation(B + 1)[:B]
        N, cap = B + 1, P
        where = lambda b, t: (rows[b], t)                                                   # noqa: E731
    else:
        N, npages = draw(st.integers(1, 5)), draw(st.integers(1, 3))
        table = rng.integers(0, N, (B, npages))                                             # pages may repeat
        cap = npages * P
        where = lambda b, t: (table[b, t // P], t % P)                                      # noqa: E731
    seqlens = rng.integers(0, cap + 1, B)
    if form == "csr":
        n = np.where(seqlens > 0, -(-seqlens // P), 0)
        last = np.where(n > 0, seqlens - (n - 1) * P, 0)
        ptr = np.r_[0, np.cumsum(n)]
        idx = np.concatenate([table[b, :n[b]] for b in range(B)] + [np.zeros(0, int)])
    pad = np.minimum(rng.integers(0, 2, B), seqlens) if draw(st.booleans()) else None
    kc, vc = rng.standard_normal((N, P, Hkv, 3)), rng.standard_normal((N, P, Hkv, 2))
    q = rng.standard_normal((B, Lq, Hq, 3))
    kw = {"kv_layout": "HND" if hnd else "NHD", "cache_leftpad": pad}
    if form == "contiguous":
        kw.update(cache_seqlens=seqlens, cache_batch_idx=rows)
    elif form == "table":
        kw.update(cache_seqlens=seqlens, block_table=table)
    else:
        kw.update(kv_indptr=ptr, kv_indices=idx, kv_last_page_len=last)
    seqs = [[where(b, t) for t in range(0 if pad is None else pad[b], seqlens[b])] for b in range(B)]
    o = dict(_options(draw, rng, Hq), enable_gqa=G > 1)
    store = (lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))) if hnd else (lambda x: x)
    return KVCache(**kw), (q, store(kc), store(vc)), (kc, vc), o, seqs, store


def _cache_oracle(q, kc, vc, o, seqs, g, ts, how):
    """Each sequence's keys taken from the cache by hand; the cache's gradient summed by hand where a page repeats."""
    out, dq = np.zeros(q.shape[:3] + vc.shape[-1:]), np.zeros(q.shape)
    dk, dv, lse, jvp = np.zeros(kc.shape), np.zeros(vc.shape), np.zeros((q.shape[0], q.shape[2], q.shape[1])), None
    jvp = np.zeros(out.shape)
    dsinks = None if "sinks" not in o else np.zeros(q.shape[2])
    for b, pos in enumerate(seqs):
        ks = np.stack([kc[n, s] for n, s in pos]) if pos else np.zeros((0,) + kc.shape[2:])
        vs = np.stack([vc[n, s] for n, s in pos]) if pos else np.zeros((0,) + vc.shape[2:])
        tk = np.stack([ts[1][n, s] for n, s in pos]) if pos else np.zeros((0,) + kc.shape[2:])
        tv = np.stack([ts[2][n, s] for n, s in pos]) if pos else np.zeros((0,) + vc.shape[2:])
        qs, ks, vs = np.swapaxes(q[b], 0, 1), np.swapaxes(ks, 0, 1), np.swapaxes(vs, 0, 1)
        o_b, res = sdpa_forward(qs, ks, vs, **o, **how)
        gr = sdpa_backward(res, np.swapaxes(g[b], 0, 1))
        out[b], lse[b], dq[b] = np.swapaxes(o_b, 0, 1), res.lse, np.swapaxes(gr.query, 0, 1)
        for j, (n, s) in enumerate(pos):                      # the VJP of the gather: a scatter-add
            dk[n, s] += gr.key[:, j]
            dv[n, s] += gr.value[:, j]
        if dsinks is not None:
            dsinks += gr.sinks
        tan = (np.swapaxes(ts[0][b], 0, 1), np.swapaxes(tk, 0, 1), np.swapaxes(tv, 0, 1))
        jvp[b] = np.swapaxes(sdpa_jvp((qs, ks, vs), tan, **o, **how)[1], 0, 1)
    return out, lse, dq, dk, dv, dsinks, jvp


@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(case=caches())
def test_a_kv_cache_is_the_dense_attention_of_each_sequences_keys(case, how):
    lay, (q, k, v), (kc, vc), o, seqs, store = case
    rng = np.random.default_rng(2)
    g = rng.standard_normal(q.shape[:3] + vc.shape[-1:])
    ts_nhd = (rng.standard_normal(q.shape), rng.standard_normal(kc.shape), rng.standard_normal(vc.shape))
    out, res = sdpa_forward(q, k, v, layout=lay, **o, **HOWS[how])
    gr = sdpa_backward(res, g)
    jvp = sdpa_jvp((q, k, v), (ts_nhd[0], store(ts_nhd[1]), store(ts_nhd[2])), layout=lay, **o, **HOWS[how])[1]
    want = list(_cache_oracle(q, kc, vc, o, seqs, g, ts_nhd, HOWS[how]))
    want[3], want[4] = store(want[3]), store(want[4])
    got = (out, res.lse, gr.query, gr.key, gr.value, gr.sinks, jvp)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "dsinks", "jvp"), got, want):
        assert_close_normwise(y, x, RTOL[how])


# ------------------------------------------------------------ packed queries against a paged cache


@st.composite
def packed_pages(draw):
    """Packed queries (``cu_seqlens_q``, maybe ``seqused_q``) against a paged cache in FlashAttention's block-table
    form or FlashInfer's CSR form; pages shared between sequences and repeated in one, every slot no sequence reads
    (and every query row no sequence uses) NaN. ``seqs[b]``: sequence ``b``'s query rows and its keys' ``(page,
    slot)``, read the way each peer reads them."""
    B, Hkv, G = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Hq = Hkv * G
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    form, hnd = draw(st.sampled_from(["table", "csr"])), draw(st.booleans())
    P, N, npages = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    table = rng.integers(0, N, (B, npages))                                                  # pages may repeat
    seqlens = rng.integers(0, npages * P + 1, B)
    lq = rng.integers(0, 4, B)
    span = lq + (rng.integers(0, 2, B) if draw(st.booleans()) else 0)
    cq = np.r_[0, np.cumsum(span)]
    pad = np.minimum(rng.integers(0, 2, B), seqlens) if draw(st.booleans()) else None
    kw = {"cu_seqlens_q": cq, "kv_layout": "HND" if hnd else "NHD", "cache_leftpad": pad,
          "seqused_q": lq if (span != lq).any() else None}
    if form == "table":
        kw.update(cache_seqlens=seqlens, block_table=table)
        keys = [[(table[b, t // P], t % P) for t in range(seqlens[b])] for b in range(B)]
    else:                                              # FlashInfer: each sequence's pages, its last page's length
        n = np.where(seqlens > 0, -(-seqlens // P), 0)
        last = np.where(n > 0, seqlens - (n - 1) * P, 0)
        ptr, idx = np.r_[0, np.cumsum(n)], np.concatenate([table[b, :n[b]] for b in range(B)] + [np.zeros(0, int)])
        kw.update(kv_indptr=ptr, kv_indices=idx, kv_last_page_len=last)
        keys = []
        for b in range(B):
            pages = idx[ptr[b]:ptr[b + 1]]
            count = (len(pages) - 1) * P + last[b] if len(pages) else 0
            keys.append([(pages[t // P], t % P) for t in range(count)])
    if pad is not None:
        keys = [pos[pad[b]:] for b, pos in enumerate(keys)]
    seqs = [(np.arange(cq[b], cq[b] + lq[b]), keys[b]) for b in range(B)]
    extra = draw(st.integers(0, 2))
    q = rng.standard_normal((cq[-1] + extra, Hq, 3))
    kc, vc = rng.standard_normal((N, P, Hkv, 3)), rng.standard_normal((N, P, Hkv, 2))
    unread = np.ones((N, P), bool)
    for _, pos in seqs:
        for n_, s in pos:
            unread[n_, s] = False
    kc[unread], vc[unread] = np.nan, np.nan
    q[np.setdiff1d(np.arange(len(q)), np.concatenate([r for r, _ in seqs] + [np.zeros(0, int)]))] = np.nan
    o = dict(_options(draw, rng, Hq), enable_gqa=G > 1)
    store = (lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))) if hnd else (lambda x: x)
    return KVCache(**kw), (q, store(kc), store(vc)), (kc, vc), o, seqs, store


def _pages_oracle(q, kc, vc, o, seqs, g, ts, how, hvp=False):
    """Each sequence alone, dense: its query rows and its keys read page by page by hand; the results put back by
    hand, the cache's gradients summed over every use of a slot (0 on rows and slots no sequence uses). With
    ``hvp``, the Hessian-vector product along ``ts`` instead of the JVP (``how`` then a second-order method)."""
    t = lambda x: np.swapaxes(x, 0, 1)[None]                                                 # noqa: E731
    out, dq, dk, dv = np.zeros(q.shape[:2] + vc.shape[-1:]), np.zeros(q.shape), np.zeros(kc.shape), np.zeros(vc.shape)
    lse, jvp = np.full((q.shape[1], q.shape[0]), -np.inf), np.zeros(out.shape)
    hq, hk, hv = np.zeros(q.shape), np.zeros(kc.shape), np.zeros(vc.shape)
    dsinks = None if "sinks" not in o else np.zeros(q.shape[1])
    for rows, pos in seqs:
        if not len(rows):
            continue
        take = lambda c: np.stack([c[n, s] for n, s in pos]) if pos else np.zeros((0,) + c.shape[2:])  # noqa: E731
        qs, ks, vs, gs = t(q[rows]), t(take(kc)), t(take(vc)), t(g[rows])
        tan = (t(ts[0][rows]), t(take(ts[1])), t(take(ts[2])))
        if hvp:
            h = sdpa_ref.sdpa_hvp((qs, ks, vs), tan, gs, **o, **how)
            hq[rows] = np.swapaxes(h.query[0], 0, 1)
            for j, (n, s) in enumerate(pos):
                hk[n, s] += h.key[0, :, j]
                hv[n, s] += h.value[0, :, j]
            continue
        o_b, res = sdpa_forward(qs, ks, vs, **o, **how)
        gr = sdpa_backward(res, gs)
        out[rows], lse[:, rows] = np.swapaxes(o_b[0], 0, 1), res.lse[0]
        dq[rows] = np.swapaxes(gr.query[0], 0, 1)
        for j, (n, s) in enumerate(pos):                      # the VJP of the gather: a scatter-add
            dk[n, s] += gr.key[0, :, j]
            dv[n, s] += gr.value[0, :, j]
        if dsinks is not None:
            dsinks += gr.sinks
        jvp[rows] = np.swapaxes(sdpa_jvp((qs, ks, vs), tan, **o, **how)[1][0], 0, 1)
    return (hq, hk, hv) if hvp else (out, lse, dq, dk, dv, dsinks, jvp)


@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(case=packed_pages())
def test_packed_queries_against_a_paged_cache_are_each_sequence_alone(case, how):
    lay, (q, k, v), (kc, vc), o, seqs, store = case
    rng = np.random.default_rng(9)
    g = rng.standard_normal(q.shape[:2] + vc.shape[-1:])
    ts = (rng.standard_normal(q.shape), rng.standard_normal(kc.shape), rng.standard_normal(vc.shape))
    out, res = sdpa_forward(q, k, v, layout=lay, **o, **HOWS[how])
    gr = sdpa_backward(res, g)
    jvp = sdpa_jvp((q, k, v), (ts[0], store(ts[1]), store(ts[2])), layout=lay, **o, **HOWS[how])[1]
    want = list(_pages_oracle(q, kc, vc, o, seqs, g, ts, HOWS[how]))
    want[3], want[4] = store(want[3]), store(want[4])
    assert out.shape == q.shape[:2] + vc.shape[-1:] and res.lse.shape == q.shape[1::-1]
    assert gr.key.shape == k.shape and gr.value.shape == v.shape
    got = (out, res.lse, gr.query, gr.key, gr.value, gr.sinks, jvp)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "dsinks", "jvp"), got, want):
        assert y is None or not np.isnan(x).any() or "nan" == o["fully_masked"], name      # NaN memory unread
        assert_close_normwise(y, x, RTOL[how])


@pytest.mark.parametrize("method", ["plain", "tiled"])
@settings(max_examples=max(6, settings.default.max_examples // 5))
@given(case=packed_pages())
def test_the_hvp_of_packed_queries_against_a_paged_cache_is_each_sequences_scattered(case, method):
    lay, (q, k, v), (kc, vc), o, seqs, store = case
    o = {n: x for n, x in o.items() if n != "fully_masked"}                # empty rows: 0 in both
    rng = np.random.default_rng(10)
    g = rng.standard_normal(q.shape[:2] + vc.shape[-1:])
    ts = (rng.standard_normal(q.shape), rng.standard_normal(kc.shape), rng.standard_normal(vc.shape))
    how = {"method": method} if method == "plain" else {"block_size": 2}
    hv = sdpa_ref.sdpa_hvp((q, k, v), (ts[0], store(ts[1]), store(ts[2])), g, layout=lay, **o, **how)
    want = _pages_oracle(q, kc, vc, o, seqs, g, ts, how, hvp=True)
    for x, y in zip(hv[:3], (want[0], store(want[1]), store(want[2]))):
        assert x.shape == y.shape
        assert_close_normwise(y, x, F64_SUMS)


def test_the_testing_call_judges_a_packed_prefill_on_a_paged_cache_in_its_own_layout():
    from sdpa_ref.testing import check_attention_close
    rng = np.random.default_rng(13)
    q = rng.standard_normal((6, 4, 8)).astype(np.float32)
    kc, vc = (rng.standard_normal((6, 3, 2, 8)).astype(np.float32) for _ in range(2))
    lay = KVCache(cache_seqlens=np.array([7, 5, 2]), block_table=np.array([[4, 1, 0], [1, 1, 5], [2, 0, 0]]),
                  cu_seqlens_q=np.array([0, 1, 4, 6]))
    kw = dict(layout=lay, is_causal=True, causal_alignment="bottom_right", enable_gqa=True)
    out, res = sdpa_forward(q, kc, vc, **kw)                  # an honest float32 kernel
    g = rng.standard_normal(out.shape).astype(np.float32)
    gr = sdpa_backward(res, g)
    rep = check_attention_close(out, q, kc, vc, lse=res.lse.astype(np.float32), grads=tuple(gr[:3]), grad_out=g,
                                **kw)
    assert rep.ok and {r.quantity for r in rep.rows} == {"out", "lse", "dq", "dk", "dv"}, str(rep)
    bad = out.copy()
    bad[4, 2] *= 1.01                                         # sequence 2's first query, head 2
    rep = check_attention_close(bad, q, kc, vc, **kw)
    assert not rep.ok and "(4, 2," in str(rep), str(rep)      # indexed in the kernel's (total_q, Hq, Ev)


# ------------------------------------------------------------ finite differences through the gather


def test_the_gradient_through_a_paged_gather_with_a_repeated_page_matches_central_differences():
    rng = np.random.default_rng(3)
    q, kc, vc = rng.standard_normal((2, 2, 2, 2)), rng.standard_normal((4, 2, 1, 2)), rng.standard_normal((4, 2, 1, 3))
    lay = KVCache(cache_seqlens=np.array([3, 4]), block_table=np.array([[2, 0], [0, 0]]), cache_leftpad=np.array([1, 0]))
    o = dict(layout=lay, enable_gqa=True, is_causal=True, causal_alignment="bottom_right", softcap=3.0)
    f = lambda q, k, v: sdpa_forward(q, k, v, **o)[0]                                        # noqa: E731
    rep = sdpa_ref.check_vjp(f, lambda g, q, k, v: tuple(sdpa_backward(sdpa_forward(q, k, v, **o)[1], g))[:3],
                             (q, kc, vc))
    assert rep.ok, rep
    rep = sdpa_ref.check_jvp(f, lambda t, q, k, v: sdpa_jvp((q, k, v), t, **o)[1], (q, kc, vc))
    assert rep.ok, rep


def test_the_gradient_through_packed_sequences_matches_central_differences():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((6, 2, 2)), rng.standard_normal((7, 1, 2)), rng.standard_normal((7, 1, 3))
    lay = Packed(np.array([0, 2, 5]), np.array([0, 3, 7]), seqused_k=np.array([3, 3]), key_leftpad=np.array([0, 1]))
    o = dict(layout=lay, enable_gqa=True, is_causal=True, causal_alignment="bottom_right", window=(1, None))
    rep = sdpa_ref.check_vjp(lambda q, k, v: sdpa_forward(q, k, v, **o)[0],
                             lambda g, q, k, v: tuple(sdpa_backward(sdpa_forward(q, k, v, **o)[1], g))[:3], (q, k, v))
    assert rep.ok, rep


@pytest.mark.parametrize("form", ["table", "csr"])
def test_gradients_of_packed_queries_against_shared_pages_match_central_differences(form):
    rng = np.random.default_rng(11)
    q, kc, vc = rng.standard_normal((5, 2, 2)), rng.standard_normal((4, 2, 1, 2)), rng.standard_normal((4, 2, 1, 3))
    if form == "table":                                   # page 0 in both sequences, twice in the second
        lay = KVCache(cache_seqlens=np.array([3, 4]), block_table=np.array([[2, 0], [0, 0]]),
                      cache_leftpad=np.array([1, 0]), cu_seqlens_q=np.array([0, 2, 5]))
    else:
        lay = KVCache(kv_indptr=np.array([0, 2, 4]), kv_indices=np.array([2, 0, 0, 0]),
                      kv_last_page_len=np.array([1, 2]), cu_seqlens_q=np.array([0, 2, 5]))
    o = dict(layout=lay, enable_gqa=True, is_causal=True, causal_alignment="bottom_right", softcap=3.0)
    f = lambda q, k, v: sdpa_forward(q, k, v, **o)[0]                                        # noqa: E731
    rep = sdpa_ref.check_vjp(f, lambda g, q, k, v: tuple(sdpa_backward(sdpa_forward(q, k, v, **o)[1], g))[:3],
                             (q, kc, vc))
    assert rep.ok, rep
    rep = sdpa_ref.check_jvp(f, lambda t, q, k, v: sdpa_jvp((q, k, v), t, **o)[1], (q, kc, vc))
    assert rep.ok, rep
    g0 = rng.standard_normal((5, 2, 3))                   # second order: the backward's JVP, dO's tangent too

    def backward(q, k, v, g):
        return np.concatenate([x.ravel() for x in sdpa_backward(sdpa_forward(q, k, v, **o)[1], g)[:3]])

    def backward_jvp(t, q, k, v, g):
        gt = sdpa_ref.sdpa_backward_jvp((q, k, v), t[:3], g, t[3], **o)[1]
        return np.concatenate([x.ravel() for x in gt[:3]])
    rep = sdpa_ref.check_jvp(backward, backward_jvp, (q, kc, vc, g0), rtol=FD_SECOND_ORDER)
    assert rep.ok, rep


# ------------------------------------------------------------ never read, poison


@pytest.mark.parametrize("how", list(HOWS))
def test_memory_no_sequence_uses_is_never_read(how):
    rng = np.random.default_rng(5)
    q, kc, vc = rng.standard_normal((2, 1, 2, 3)), rng.standard_normal((6, 2, 2, 3)), rng.standard_normal((6, 2, 2, 3))
    lay = KVCache(cache_seqlens=np.array([3, 2]), block_table=np.array([[4, 1], [2, 2]]), cache_leftpad=np.array([1, 0]))
    o = dict(layout=lay, enable_gqa=True, is_causal=True, causal_alignment="bottom_right", **HOWS[how])
    clean = sdpa_forward(q, kc, vc, **o)
    g = rng.standard_normal(clean[0].shape)
    kb, vb = kc.copy(), vc.copy()
    for x, bad in ((kb, np.nan), (vb, np.inf)):
        x[[0, 3, 5]] = bad                                    # pages no table names
        x[4, 0] = bad                                         # the left pad of sequence 0
        x[1, 1] = bad                                         # past cache_seqlens of sequence 0
        x[2, 0] = x[2, 0]                                     # page 2 slot 0: used by sequence 1
    dirty = sdpa_forward(q, kb, vb, **o)
    np.testing.assert_array_equal(clean[0], dirty[0])
    np.testing.assert_array_equal(clean[1].lse, dirty[1].lse)
    for x, y in zip(sdpa_backward(clean[1], g)[:3], sdpa_backward(dirty[1], g)[:3]):
        np.testing.assert_array_equal(x, y)
    # packed: rows between and after the sequences, past seqused and before the left pad
    qp, kp, vp = rng.standard_normal((6, 2, 2)), rng.standard_normal((8, 2, 2)), rng.standard_normal((8, 2, 2))
    lay = Packed(np.array([0, 2, 4]), np.array([0, 3, 7]), seqused_q=np.array([2, 1]), seqused_k=np.array([3, 3]),
                 key_leftpad=np.array([1, 0]))
    o = dict(layout=lay, **HOWS[how])
    clean = sdpa_forward(qp, kp, vp, **o)
    qb, kb, vb = qp.copy(), kp.copy(), vp.copy()
    qb[[3, 4, 5]] = np.nan
    kb[[0, 6, 7]] = np.inf
    vb[[0, 6, 7]] = np.nan
    dirty = sdpa_forward(qb, kb, vb, **o)
    np.testing.assert_array_equal(clean[0], dirty[0])
    assert not clean[0][[3, 4, 5]].any()                     # rows no sequence uses hold 0


def test_a_poisoned_position_reaches_what_its_sequence_reads_and_only_that():
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((5, 2, 2)), rng.standard_normal((6, 2, 2)), rng.standard_normal((6, 2, 3))
    lay = Packed(np.array([0, 2, 5]), np.array([0, 3, 6]))
    o = dict(layout=lay, is_causal=True, causal_alignment="bottom_right")
    kb = k.copy()
    kb[4, 1] = np.nan                                         # sequence 1, key 1, head 1
    out, res = sdpa_forward(q, kb, v, **o)
    bad = np.isnan(out)
    assert not bad[:2].any() and not bad[:, 0].any()          # the other sequence and the other head: untouched
    assert bad[3:, 1].all() and not bad[2, 1].any()           # causal: query 0 of sequence 1 does not see key 1
    gr = sdpa_backward(res, np.ones(out.shape))
    assert not np.isnan(gr.key[:3]).any() and not np.isnan(gr.value[:3]).any()


# ------------------------------------------------------------ speed and memory, FlashAttention's entry points


def test_a_decodes_memory_grows_with_the_keys_it_reads_not_with_the_cache():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 1, 8, 16))

    def peak(pages):
        kc, vc = rng.standard_normal((pages, 64, 2, 16)), rng.standard_normal((pages, 64, 2, 16))
        lay = KVCache(cache_seqlens=np.array([64 * 32]), block_table=np.arange(32)[None])
        tracemalloc.start()
        sdpa_forward(q, kc, vc, layout=lay, enable_gqa=True, save_probs=False)
        p = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return p
    small, big = peak(32), peak(256)                          # the same 2048 keys read from an 8 times larger cache
    assert big < 1.1 * small, (small, big)


def test_a_decode_copies_its_keys_once():
    """The problem takes the gathered keys and values as its own copies rather than copying them again: the
    decode's peak memory is the keys and values read, once, and the gather's one temporary of the values (1.5
    times; 2 times when the problem copied them); the cache given is not written and the result is the dense
    one's, bit for bit."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 1, 8, 16))
    kc, vc = (rng.standard_normal((64, 64, 2, 16)) for _ in range(2))
    table = rng.permutation(64)[None]
    kept = kc.copy(), vc.copy()
    lay = KVCache(cache_seqlens=np.array([64 * 64]), block_table=table)
    tracemalloc.start()
    out, res = sdpa_forward(q, kc, vc, layout=lay, enable_gqa=True, save_probs=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1.7 * (kc.nbytes + vc.nbytes), (peak, kc.nbytes + vc.nbytes)
    assert np.array_equal(kc, kept[0]) and np.array_equal(vc, kept[1])
    assert not res.problem.k.flags.writeable and not res.problem.v.flags.writeable
    dense = [np.swapaxes(c[table[0]].reshape(1, -1, 2, 16), 1, 2) for c in (kc, vc)]
    ref = sdpa_forward(np.swapaxes(q, 1, 2), *dense, enable_gqa=True, save_probs=False)[0]
    assert np.array_equal(out, np.swapaxes(ref, 1, 2))


@pytest.mark.parametrize("threads", ["1", "2"])
def test_runs_of_positions_are_copied_as_the_fancy_index_copies_them(monkeypatch, threads):
    """take_rows copies runs of consecutive positions (pages) as slices in the pool: the values of ``x[where]``
    for pages in any order, a partial last page, runs of one position (the fancy index then), a single run; and a
    decode through it has the bits of the fancy index's."""
    from sdpa_ref import layouts

    monkeypatch.setenv("SDPA_REF_NUM_THREADS", threads)
    monkeypatch.setattr(layouts, "RUNS_BYTES", 0)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((40 * 16, 2, 3))
    pages = rng.permutation(40)
    wheres = [(pages[:, None] * 16 + np.arange(16)).ravel(), (pages[:, None] * 16 + np.arange(16)).ravel()[:-5],
              rng.permutation(len(x)), np.arange(3, 600), np.array([7, 8])]
    for where in wheres:
        got = layouts.take_rows(x, where)
        assert got.flags.c_contiguous and np.array_equal(got, x[where])
    q = rng.standard_normal((1, 1, 4, 3))
    kc, vc = (rng.standard_normal((40, 16, 2, 3)) for _ in range(2))
    lay = KVCache(cache_seqlens=np.array([16 * 40 - 5]), block_table=pages[None])
    runs = sdpa_forward(q, kc, vc, layout=lay, enable_gqa=True)
    monkeypatch.setattr(layouts, "RUNS_BYTES", 1 << 62)
    fancy = sdpa_forward(q, kc, vc, layout=lay, enable_gqa=True)
    assert np.array_equal(runs[0], fancy[0]) and np.array_equal(runs[1].lse, fancy[1].lse)


def test_flash_attentions_entry_points_are_the_layouts():
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((5, 4, 3)), rng.standard_normal((6, 2, 3)), rng.standard_normal((6, 2, 2))
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 3, 6])
    out, lse = sdpa_ref.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, window_size=(1, -1),
                                               return_lse=True)
    want = sdpa_ref.scaled_dot_product_attention(q, k, v, layout=Packed(cu_q, cu_k), is_causal=True, window=(1, None),
                                                 causal_alignment="bottom_right", enable_gqa=True, return_lse=True)
    np.testing.assert_array_equal(out, want[0])
    np.testing.assert_array_equal(lse, want[1])
    assert lse.shape == (4, 5)
    qd, kc, vc = rng.standard_normal((2, 1, 4, 3)), rng.standard_normal((5, 2, 2, 3)), rng.standard_normal((5, 2, 2, 2))
    table = np.array([[3, 1], [0, 4]])
    a = sdpa_ref.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=np.array([3, 4]), block_table=table, causal=True)
    b = sdpa_ref.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=np.array([3, 4]), page_table=table, causal=True)
    c = sdpa_ref.flash_attn_with_kvcache(qd, kc, vc, kv_indptr=np.array([0, 2, 4]), kv_indices=np.array([3, 1, 0, 4]),
                                         kv_last_page_len=np.array([1, 2]), causal=True)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    with pytest.raises(ValueError, match="`block_table` and `page_table`"):
        sdpa_ref.flash_attn_with_kvcache(qd, kc, vc, block_table=table, page_table=table)


@pytest.mark.parametrize("lay, err, match", [
    (Packed(np.array([0, 3, 2]), np.array([0, 1, 2])), ValueError, "`cu_seqlens_q`"),
    (Packed(np.array([0, 2]), np.array([0, 1, 2])), ValueError, "same length"),
    (Packed(np.array([0, 2]), np.array([0, 2]), seqused_k=np.array([3])), ValueError, "`seqused_k`"),
    (Packed(np.array([0, 2]), np.array([0, 2]), key_leftpad=np.array([3])), ValueError, "`key_leftpad`"),
    (Packed(np.array([0, 2]), np.array([0, 2]), max_seqlen_q=1), ValueError, "`max_seqlen_q`"),
    (Packed(np.array([0.0, 2.0]), np.array([0, 2])), TypeError, "`cu_seqlens_q`"),
    ("not a layout", ValueError, "`layout` should be one of"),       # a string: the dense layouts' names
    (3, TypeError, "`layout`"),
])
def test_a_bad_packed_layout_names_its_argument(lay, err, match):
    x = np.zeros((3, 2, 2))
    with pytest.raises(err, match=match):
        sdpa_forward(x, x, x, layout=lay)


@pytest.mark.parametrize("kw, err, match", [
    (dict(block_table=np.array([[0, 9]]), cache_seqlens=np.array([4])), ValueError, "pages of the cache"),
    (dict(block_table=np.array([[0], [1]])), ValueError, "`block_table`"),
    (dict(kv_indptr=np.array([0, 1])), ValueError, "together"),
    (dict(kv_indptr=np.array([0, 1]), kv_indices=np.array([0]), kv_last_page_len=np.array([3])), ValueError,
     "`kv_last_page_len`"),
    (dict(cache_seqlens=np.array([5])), ValueError, "`cache_seqlens`"),
    (dict(cache_leftpad=np.array([3]), cache_seqlens=np.array([2])), ValueError, "`cache_leftpad`"),
    (dict(cache_batch_idx=np.array([4])), ValueError, "`cache_batch_idx`"),
    (dict(kv_layout="BHSD"), ValueError, "`kv_layout`"),
])
def test_a_bad_cache_layout_names_its_argument(kw, err, match):
    q, kc = np.zeros((1, 1, 2, 2)), np.zeros((3, 2, 2, 2))
    with pytest.raises(err, match=match):
        sdpa_forward(q, kc, kc, layout=KVCache(**kw))


@pytest.mark.parametrize("kw, query, err, match", [
    (dict(seqused_q=np.array([1])), (1, 1, 2, 2), ValueError, "`seqused_q`.*`cu_seqlens_q`"),
    (dict(max_seqlen_q=1), (1, 1, 2, 2), ValueError, "`max_seqlen_q`.*`cu_seqlens_q`"),
    (dict(cu_seqlens_q=np.array([0, 4])), (3, 2, 2), ValueError, "`cu_seqlens_q`.*3 rows"),
    (dict(cu_seqlens_q=np.array([0, 2]), seqused_q=np.array([3])), (3, 2, 2), ValueError, "`seqused_q`"),
    (dict(cu_seqlens_q=np.array([0, 2]), max_seqlen_q=1), (3, 2, 2), ValueError, "`max_seqlen_q`"),
    (dict(cu_seqlens_q=np.array([0, 2])), (1, 3, 2, 2), ValueError, "`query` should have 3 dimensions"),
    (dict(cu_seqlens_q=np.array([0.0, 2.0])), (3, 2, 2), TypeError, "`cu_seqlens_q`"),
    (dict(cu_seqlens_q=np.array([], int)), (3, 2, 2), ValueError, "`cu_seqlens_q`"),
    (dict(cu_seqlens_q=np.array([0, 1, 2]), block_table=np.array([[0]])), (3, 2, 2), ValueError,
     "`block_table` should have one row per sequence"),
    (dict(cu_seqlens_q=np.array([0, 1, 2]), cache_seqlens=np.array([1])), (3, 2, 2), ValueError,
     "`cache_seqlens` should have shape \\(2,\\)"),
])
def test_a_bad_packed_query_against_a_cache_names_its_argument(kw, query, err, match):
    kc = np.zeros((3, 2, 2, 2))
    with pytest.raises(err, match=match):
        sdpa_forward(np.zeros(query), kc, kc, layout=KVCache(**kw))


def test_lengths_and_uniform_are_refused_with_a_layout():
    x = np.zeros((2, 1, 2))
    lay = Packed(np.array([0, 2]), np.array([0, 2]))
    with pytest.raises(ValueError, match="`q_lengths`"):
        sdpa_forward(x, x, x, layout=lay, q_lengths=np.array([1]))
    with pytest.raises(ValueError, match="'uniform'"):
        sdpa_forward(x, x, x, layout=lay, fully_masked="uniform")


_RNG = np.random.default_rng(7)


def _residual_arrays(res):
    """Every array the residuals hold (the forward's and the problem's)."""
    out = []

    def walk(x):
        if isinstance(x, np.ndarray):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
    walk(tuple(res.forward))
    walk([getattr(res.problem, f) for f in res.problem.__dataclass_fields__])
    return out


def _own(x, res=None, what=""):
    """``x`` (an array or a tuple of them, None skipped) is writeable and shares no memory with the residuals."""
    for i, a in enumerate(x if isinstance(x, tuple) else (x,)):
        if a is None:
            continue
        if isinstance(a, tuple):
            _own(a, res, f"{what}[{i}]")
            continue
        assert a.flags.writeable, f"{what}[{i}] ({a.dtype}) is read-only"
        if res is not None:
            assert not any(np.shares_memory(a, r) for r in _residual_arrays(res)), f"{what}[{i}] shares residuals"


def _scribble(x):
    for a in (x if isinstance(x, tuple) else (x,)):
        if isinstance(a, tuple):
            _scribble(a)
        elif a is not None:
            a[...] = np.nan


@pytest.mark.parametrize("layout", ["packed", "kvcache"])
def test_layout_results_are_writeable_and_writing_them_changes_no_gradient(layout):
    if layout == "packed":
        q = _RNG.standard_normal((7, 2, 4))
        args, lay, g = (q, q, q), Packed(np.array([0, 3, 7]), np.array([0, 3, 7])), np.ones((7, 2, 4))
    else:
        q, kc = _RNG.standard_normal((2, 1, 2, 4)), _RNG.standard_normal((2, 5, 2, 4))
        args, lay, g = (q, kc, kc), KVCache(cache_seqlens=np.array([3, 5])), np.ones((2, 1, 2, 4))
    want = sdpa_backward(sdpa_forward(*args, layout=lay)[1], g)
    out, res = sdpa_forward(*args, layout=lay)
    views = (out, res.out, res.lse, res.lse_as())
    _own(views, res, layout)
    _scribble(views)
    for w, x in zip(want, sdpa_backward(res, g)):
        np.testing.assert_array_equal(x, w)
