"""Kernels judged in the layout they take: packed varlen (``layout="thd"``) and a paged KV cache (``"paged"``).

Honest kernels in each layout conform, forward, backward and JVP, with the poison check; kernels that are wrong in
the ways layout kernels go wrong fail: attending across packed sequences, reading past a sequence's rows or a
cache's length, reading pages in the wrong order, an LSE in the wrong layout.
"""

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref import KVCache, Packed, check_implementation
from sdpa_ref.harness.storage import PAGE_SIZE


def _opts(kw):
    if kw.get("fully_masked") == "uniform":
        raise NotImplementedError("no uniform policy on a layout")
    return kw


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    lay = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return sdpa_ref.sdpa_forward(q, k, v, layout=lay, **_opts(kw))[0].astype(q.dtype)


def varlen_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    lay = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse = sdpa_ref.scaled_dot_product_attention(q, k, v, layout=lay, return_lse=True, **_opts(kw))
    return out.astype(q.dtype), lse.astype(np.float32 if q.dtype != np.float64 else np.float64)


def varlen_bwd(g, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    lay = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, layout=lay, **_opts(kw))[1], g)
    extra = [gr.bias.astype(q.dtype)] if gr.bias is not None else []
    return [x.astype(q.dtype) for x in gr[:3]] + extra + ([gr.sinks] if gr.sinks is not None else [])


def varlen_jvp(primals, tangents, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    lay = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return sdpa_ref.sdpa_jvp(primals, tangents, layout=lay, **_opts(kw))[1].astype(primals[0].dtype)


def paged(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
    lay = KVCache(cache_seqlens=cache_seqlens, block_table=block_table)
    return sdpa_ref.sdpa_forward(q, k_cache, v_cache, layout=lay, **_opts(kw))[0].astype(q.dtype)


def paged_bwd(g, q, k_cache, v_cache, cache_seqlens, block_table, **kw):
    lay = KVCache(cache_seqlens=cache_seqlens, block_table=block_table)
    gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k_cache, v_cache, layout=lay, **_opts(kw))[1], g)
    extra = [gr.bias.astype(q.dtype)] if gr.bias is not None else []
    return [x.astype(q.dtype) for x in gr[:3]] + extra + ([gr.sinks] if gr.sinks is not None else [])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_honest_packed_kernel_conforms_with_gradients_tangents_and_poison(dtype):
    pytest.importorskip("ml_dtypes") if dtype == "bfloat16" else None
    rep = check_implementation(varlen, backward=varlen_bwd, jvp=varlen_jvp, layout="thd", dtypes=dtype, poison=True)
    assert rep.ok and rep.judged >= 40, str(rep)
    assert {r.quantity for r in rep.rows if r.status == "pass"} >= {"out", "dq", "dk", "dv", "jvp", "poison"}


def test_an_honest_paged_kernel_conforms_and_skips_padded_queries():
    rep = check_implementation(paged, backward=paged_bwd, layout="paged", dtypes="float32", poison=True)
    assert rep.ok and rep.judged >= 30, str(rep)
    skipped = [r for r in rep.rows if r.status == "skip"]
    assert any("computes every query row" in r.note for r in skipped)
    assert all(any(w in r.note for w in ("computes every query row", "needs", "uniform")) for r in skipped), skipped


def test_the_lse_comes_back_from_flash_attentions_varlen_layout():
    rep = check_implementation(varlen_lse, layout="thd", dtypes="float32", lse="e")
    assert rep.ok and any(r.quantity == "lse" and r.status == "pass" for r in rep.rows), str(rep)

    def transposed(*a, **kw):                              # (total_q, Hq): the other order
        out, lse = varlen_lse(*a, **kw)
        return out, np.ascontiguousarray(lse.T).reshape(lse.shape)
    assert not check_implementation(transposed, layout="thd", dtypes="float32", lse="e").ok


def _fails(fn, layout, **kw):
    rep = check_implementation(fn, layout=layout, dtypes="float32", **kw)
    assert not rep.ok, str(rep)
    return rep


def test_a_packed_kernel_that_attends_across_sequences_fails():
    def one_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
        n, m = cu_seqlens_q[-1], cu_seqlens_k[-1]
        return varlen(q, k, v, np.array([0, n]), np.array([0, m]), None, None, **kw)
    _fails(one_sequence, "thd")


def test_a_packed_kernel_that_reads_past_its_sequences_fails_the_poison_check():
    def greedy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
        ck = np.append(cu_seqlens_k[:-1], len(k))          # the last sequence's keys run to the end of the array
        return varlen(q, k, v, cu_seqlens_q, ck, max_seqlen_q, None, **kw)
    rep = _fails(greedy, "thd", poison=True)
    assert any(r.quantity == "poison" and r.status == "FAIL" for r in rep.rows)


def test_a_paged_kernel_that_reads_its_pages_in_order_fails():
    def in_order(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
        return paged(q, k_cache, v_cache, cache_seqlens, np.sort(block_table, axis=1), **kw)
    _fails(in_order, "paged")


def test_a_paged_kernel_that_reads_whole_pages_fails_the_poison_check():
    def whole_pages(q, k_cache, v_cache, cache_seqlens, block_table, **kw):
        full = np.where(cache_seqlens > 0, -(-cache_seqlens // PAGE_SIZE) * PAGE_SIZE, 0)
        lay = KVCache(cache_seqlens=full, block_table=block_table)
        kw.pop("kv_lengths", None)
        out = sdpa_ref.sdpa_forward(q, k_cache, v_cache, layout=lay, **_opts(kw))[0]
        return out.astype(q.dtype)
    rep = _fails(whole_pages, "paged", poison=True)
    assert any(r.quantity == "poison" and r.status == "FAIL" for r in rep.rows)


def test_a_layout_is_named_in_the_error_when_unknown():
    with pytest.raises(ValueError, match="`layout`"):
        check_implementation(varlen, layout="bshd")
