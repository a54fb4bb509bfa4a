"""Kernels judged in the layout they take: packed varlen (``layout="thd"``), a paged KV cache (``"paged"``) and
packed queries against it (``"thd_paged"``).

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


# -- packed queries against the paged cache (layout="thd_paged")

def _packed_paged(cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table):
    return KVCache(cache_seqlens=cache_seqlens, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                   max_seqlen_q=max_seqlen_q)


def prefill(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table, **kw):
    lay = _packed_paged(cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table)
    out, lse = sdpa_ref.scaled_dot_product_attention(q, k_cache, v_cache, layout=lay, return_lse=True, **_opts(kw))
    return out.astype(q.dtype), lse.astype(np.float32 if q.dtype != np.float64 else np.float64)


def prefill_bwd(g, q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table, **kw):
    lay = _packed_paged(cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table)
    gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k_cache, v_cache, layout=lay, **_opts(kw))[1], g)
    extra = [gr.bias.astype(q.dtype)] if gr.bias is not None else []
    return [x.astype(q.dtype) for x in gr[:3]] + extra + ([gr.sinks] if gr.sinks is not None else [])


def prefill_jvp(primals, tangents, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table, **kw):
    lay = _packed_paged(cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table)
    return sdpa_ref.sdpa_jvp(primals, tangents, layout=lay, **_opts(kw))[1].astype(primals[0].dtype)


def test_an_honest_packed_prefill_on_a_paged_cache_conforms_with_padded_queries_gradients_and_poison():
    rep = check_implementation(prefill, backward=prefill_bwd, jvp=prefill_jvp, layout="thd_paged", dtypes="float32",
                               poison=True, lse="e")
    assert rep.ok and rep.judged >= 40, str(rep)
    assert {r.quantity for r in rep.rows if r.status == "pass"} >= {"out", "lse", "dq", "dk", "dv", "jvp", "poison"}
    assert not any("computes every query row" in r.note for r in rep.rows if r.status == "skip")


def test_a_packed_prefill_that_reads_its_pages_in_order_or_past_its_queries_fails():
    def in_order(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table, **kw):
        return prefill(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, cache_seqlens, np.sort(block_table, axis=1),
                       **kw)[0]
    _fails(in_order, "thd_paged")

    def greedy(q, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table, **kw):
        cq = np.append(cu_seqlens_q[:-1], len(q))          # the last sequence's queries run into the spare row
        return prefill(q, k_cache, v_cache, cq, None, cache_seqlens, block_table, **kw)[0]
    rep = _fails(greedy, "thd_paged", poison=True)
    assert any(r.quantity == "poison" and r.status == "FAIL" for r in rep.rows)


def test_a_layout_is_named_in_the_error_when_unknown():
    with pytest.raises(ValueError, match="`layout`"):
        check_implementation(varlen, layout="hbsd")


# -- a top-k sparse kernel: (..., L, H, E) arrays and gather_kv_indices (..., L, K), shared by the heads

def _t(x):
    return np.swapaxes(x, -3, -2)


def sparse(q, k, v, gather_kv_indices, **kw):
    idx = gather_kv_indices[..., None, :, :]
    return _t(sdpa_ref.scaled_dot_product_attention(_t(q), _t(k), _t(v), gather_kv_indices=idx, **kw)).astype(q.dtype)


def sparse_bwd(g, q, k, v, gather_kv_indices, **kw):
    _, res = sdpa_ref.sdpa_forward(_t(q), _t(k), _t(v), gather_kv_indices=gather_kv_indices[..., None, :, :], **kw)
    gr = sdpa_ref.sdpa_backward(res, _t(g))
    extra = [gr.bias.astype(q.dtype)] if gr.bias is not None else []
    return [_t(x).astype(q.dtype) for x in gr[:3]] + extra + ([gr.sinks] if gr.sinks is not None else [])


def sparse_jvp(primals, tangents, gather_kv_indices, **kw):
    out = sdpa_ref.sdpa_jvp(tuple(_t(x) for x in primals), tuple(_t(x) for x in tangents),
                            gather_kv_indices=gather_kv_indices[..., None, :, :], **kw)[1]
    return _t(out).astype(primals[0].dtype)


@pytest.mark.slow
def test_an_honest_sparse_kernel_conforms_in_the_gathered_layout_with_poison():
    rep = check_implementation(sparse, backward=sparse_bwd, jvp=sparse_jvp, layout="gathered", poison=True)
    assert rep.ok, str(rep)
    assert rep.meta["layout"] == "gathered" and all(r.case.endswith("-gather") for r in rep.rows)
    assert any(r.quantity == "poison" and r.status == "pass" for r in rep.rows)


@pytest.mark.parametrize("wrong", ["dense", "minus_one_is_the_last_key", "repeats_count_twice", "per_head_shift"])
def test_sparse_kernels_wrong_the_usual_ways_are_caught(wrong):
    def kernel(q, k, v, gather_kv_indices, **kw):
        S, idx = k.shape[-3], gather_kv_indices
        if wrong == "dense":                                   # ignores the indices: reads every key
            return _t(sdpa_ref.scaled_dot_product_attention(_t(q), _t(k), _t(v), **kw)).astype(q.dtype)
        if wrong == "minus_one_is_the_last_key":               # Python's negative index
            return sparse(q, k, v, np.where(idx < 0, idx % S, idx), **kw)
        if wrong == "repeats_count_twice":                     # FlashMLA's gather: a repeated key weighs twice
            bias = np.zeros(idx.shape[:-1] + (S,))
            np.add.at(bias, (*np.indices(idx.shape[:-1]), np.where(idx < 0, 0, idx)), (idx >= 0).astype(float))
            with np.errstate(divide="ignore"):
                bias = np.log(bias)[..., None, :, :] + kw.pop("bias", 0.0)   # log(count): e^T counted count times
            return _t(sdpa_ref.scaled_dot_product_attention(_t(q), _t(k), _t(v), bias=bias, **kw)).astype(q.dtype)
        return sparse(q, k, v, np.where(idx >= 0, np.minimum(idx + 1, S - 1), idx), **kw)   # off by one
    rep = check_implementation(kernel, layout="gathered", poison=wrong == "dense")
    assert not rep.ok and any(r.status == "FAIL" for r in rep.failures), str(rep)
