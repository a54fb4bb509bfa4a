"""Every bad argument is a clear error before any allocation (issue 40, item 8).

A table lists each argument of the FlashAttention-style entry points and of the layouts with bad values, the
exception and the words its message must hold (the argument's own name, as the caller spelled it). ``max_seqlen_q``
and ``max_seqlen_k`` are bounds on the sequences' lengths (FlashAttention's meaning), never the padded length: a
bound below a real length is an error, one above it is accepted and allocates nothing (checked under tracemalloc).
"""

import tracemalloc

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref import KVCache, Packed, flash_attn_varlen_func, flash_attn_with_kvcache, sdpa_forward

from tolerances import F64_SUMS

#: Peak traced memory allowed for a call on a handful of tokens, whatever bound it is given (the problem itself
#: needs kilobytes; the old code padded to the bound: 1 GB for 7 tokens and max_seqlen_k=2**27).
SMALL_PEAK = 50 * 2**20

_RNG = np.random.default_rng(0)
Q = _RNG.standard_normal((7, 2, 4))                         # packed: two sequences of 3 and 4 tokens
CU = np.array([0, 3, 7])
QC = _RNG.standard_normal((2, 1, 2, 4))                     # a decode step against a cache of 2 rows of 5
KC = _RNG.standard_normal((2, 5, 2, 4))
PAGES = _RNG.standard_normal((4, 2, 2, 4))                  # 4 pages of 2 slots
BIG = np.array([0, 2**63], np.uint64)                       # a uint64 value no int64 holds


def varlen(**kw):
    return flash_attn_varlen_func(Q, Q, Q, kw.pop("cu_seqlens_q", CU), kw.pop("cu_seqlens_k", CU), **kw)


def kvcache(**kw):
    return flash_attn_with_kvcache(QC, KC, KC, **kw)


def paged(**kw):
    return flash_attn_with_kvcache(QC, PAGES, PAGES, **dict(dict(block_table=np.array([[0, 1], [2, 3]])), **kw))


def paged_varlen(**kw):
    """Packed queries (sequences of 3 and 4 rows) against PAGES, FlashAttention 2's varlen block table."""
    kw = dict(dict(block_table=np.array([[0, 1], [2, 3]])), **kw)
    return flash_attn_varlen_func(Q, kw.pop("k", PAGES), PAGES, CU, kw.pop("cu_seqlens_k", np.array([0, 3, 7])), **kw)


def dense(**kw):
    x = _RNG.standard_normal((2, 2, 3, 4))
    return sdpa_forward(x, x, x, **kw)


BAD = [
    # FlashAttention's max_seqlen: an int bound on the lengths (the longest here is 4)
    (varlen, dict(max_seqlen_k=3), ValueError, ["`max_seqlen_k`", ">= the longest", "3"]),
    (varlen, dict(max_seqlen_q=-1), ValueError, ["`max_seqlen_q`"]),
    (varlen, dict(max_seqlen_k=4.0), TypeError, ["`max_seqlen_k`", "int"]),
    (varlen, dict(max_seqlen_k=True), TypeError, ["`max_seqlen_k`", "int"]),
    (varlen, dict(max_seqlen_q="8"), TypeError, ["`max_seqlen_q`", "int"]),
    (varlen, dict(max_seqlen_k=np.array([8])), TypeError, ["`max_seqlen_k`", "int"]),
    # integer arrays checked against the sizes they index, and against int64
    (varlen, dict(cu_seqlens_q=np.array([0, 3, 8])), ValueError, ["`cu_seqlens_q`", "7 rows"]),
    (varlen, dict(cu_seqlens_k=np.array([0, 3, 2**63], np.uint64)), ValueError,
     ["`cu_seqlens_k`", "9223372036854775808"]),
    (varlen, dict(cu_seqlens_q=CU.astype(float)), TypeError, ["`cu_seqlens_q`", "integer"]),
    (varlen, dict(seqused_k=BIG), ValueError, ["`seqused_k`", "9223372036854775808"]),
    (kvcache, dict(cache_seqlens=BIG), ValueError, ["`cache_seqlens`", "9223372036854775808"]),
    (kvcache, dict(cache_seqlens=3.0), TypeError, ["`cache_seqlens`"]),
    (kvcache, dict(cache_batch_idx=np.array([0, 2**64 - 1], np.uint64)), ValueError,
     ["`cache_batch_idx`", "18446744073709551615"]),
    (kvcache, dict(cache_batch_idx=np.array([0, 2])), ValueError, ["`cache_batch_idx`", "[0, 2)"]),
    (kvcache, dict(cache_leftpad=BIG), ValueError, ["`cache_leftpad`", "9223372036854775808"]),
    (paged, dict(block_table=np.array([[0, 1], [2, 2**63]], np.uint64)), ValueError, ["`block_table`"]),
    (paged, dict(block_table=np.array([[0, 1], [2, 4]])), ValueError, ["`block_table`", "[0, 4)"]),
    (paged, dict(block_table=np.array([[0.0, 1.0], [2.0, 3.0]])), TypeError, ["`block_table`"]),
    (paged, dict(cache_batch_idx=np.array([0, 2])), ValueError, ["`cache_batch_idx`", "rows of `block_table`"]),
    (paged, dict(block_table=None, kv_indptr=np.array([0, 1, 2]), kv_indices=np.array([0, 1]),
                 kv_last_page_len=np.array([1, 1]), cache_batch_idx=np.array([1, 0])), ValueError,
     ["`cache_batch_idx`", "kv_indptr"]),
    # FlashAttention's window: a pair (left, right), -1 unbounded
    (varlen, dict(window_size=None), TypeError, ["`window_size`", "pair"]),
    (varlen, dict(window_size=np.array([1, 1])), TypeError, ["`window_size`", "pair"]),
    (varlen, dict(window_size=(1,)), TypeError, ["`window_size`", "pair"]),
    (varlen, dict(window_size=(1.5, 0)), TypeError, ["`window_size`"]),
    (varlen, dict(window_size=(-2, 0)), ValueError, ["`window_size`"]),
    (kvcache, dict(window_size="left"), TypeError, ["`window_size`"]),
    # FlashAttention 4's signed bounds: -1 (one key past the diagonal) has no `window=` spelling
    (varlen, dict(window_size_left=-1, window_size_right=3), ValueError, ["`window_size_left`", "-1"]),
    (kvcache, dict(window_size_left=1.5), TypeError, ["`window_size_left`"]),
    (varlen, dict(window_size_left=-3, window_size_right=1), ValueError, ["`window_size_left`", "no key"]),
    # two spellings of one window: the message names both as the caller spelled them
    (varlen, dict(window_size=(2, 0), window=(1, 0)), ValueError, ["`window_size`", "`window`", "(2, 0)", "(1, 0)"]),
    (kvcache, dict(window_size=(2, 0), window_size_left=1), ValueError, ["`window_size`", "`window_size_left`"]),
    (paged, dict(window_size_right=0, window=(1, 0)), ValueError, ["`window_size_right`", "`window`"]),
    (varlen, dict(window_size=(2, 0), sliding_window=3), ValueError, ["`window_size`", "`sliding_window`"]),
    # scalars under the wrappers' own names
    (varlen, dict(softcap=np.array([1.0, 2.0])), TypeError, ["`softcap`", "real number"]),
    (varlen, dict(softcap=-1.0), ValueError, ["`softcap`"]),
    (kvcache, dict(softcap="30"), TypeError, ["`softcap`"]),
    (varlen, dict(softmax_scale=0.0), ValueError, ["`softmax_scale`"]),
    (kvcache, dict(softmax_scale=np.array([1.0, 2.0])), TypeError, ["`softmax_scale`"]),
    (varlen, dict(causal="yes"), TypeError, ["`causal`", "bool"]),
    (kvcache, dict(causal=1), TypeError, ["`causal`", "bool"]),
    (varlen, dict(return_lse=1), TypeError, ["`return_lse`", "bool"]),
    (kvcache, dict(return_softmax_lse="yes"), TypeError, ["`return_softmax_lse`", "bool"]),
    (kvcache, dict(return_softmax_lse=1), TypeError, ["`return_softmax_lse`", "bool"]),
    (kvcache, dict(kv_layout="nhd"), ValueError, ["`kv_layout`"]),
    (kvcache, dict(block_table=np.array([[0]]), page_table=np.array([[0]])), ValueError, ["`page_table`"]),
    # gather_kv_indices: the 3-D (b, t, K) of FlashAttention 4 is ambiguous with (Hq, L, K) beside a batch
    (dense, dict(gather_kv_indices=np.zeros((2, 3, 1), int)), ValueError,
     ["`gather_kv_indices`", "ambiguous", "(b, 1, t, K)", "(b, Hq, t, K)"]),
    (dense, dict(gather_kv_indices=np.zeros((2, 2, 3, 1))), TypeError, ["`gather_kv_indices`", "integer"]),
    (dense, dict(layout="packed"), ValueError, ["`layout`", "'bshd'"]),
    (dense, dict(layout=3), TypeError, ["`layout`"]),
    # the arrays under the wrappers' names
    (kvcache, dict(qv=np.zeros(3)), ValueError, ["`qv`", "4 dimensions"]),
    (varlen, dict(qv=np.zeros((7, 2), int)), TypeError, ["`qv`", "dtype"]),
    (lambda **kw: flash_attn_with_kvcache(QC, KC[0], KC), {}, ValueError, ["`k_cache`", "4 dimensions"]),
    (lambda **kw: flash_attn_with_kvcache(QC, KC, KC.astype(int)), {}, TypeError, ["`v_cache`", "dtype"]),
    (lambda **kw: flash_attn_varlen_func(Q[None], Q, Q, CU, CU), {}, ValueError, ["`q`", "3 dimensions"]),
    # packed queries against a paged cache
    (paged_varlen, dict(page_table=np.array([[0, 1], [2, 3]])), ValueError, ["`block_table`", "`page_table`"]),
    (paged_varlen, dict(cu_seqlens_k=None), ValueError, ["`cu_seqlens_k`", "`seqused_k`"]),
    (paged_varlen, dict(cu_seqlens_k=np.array([0, 3])), ValueError, ["`cu_seqlens_k`", "same length"]),
    (paged_varlen, dict(cu_seqlens_k=np.array([0, 3, 2])), ValueError, ["`cu_seqlens_k`", "non-decreasing"]),
    (paged_varlen, dict(cu_seqlens_k=np.array([0, 3, 8])), ValueError, ["`cache_seqlens`", "4 positions"]),
    (paged_varlen, dict(seqused_k=np.array([3, 5])), ValueError, ["`seqused_k`", "[3, 4]"]),
    (paged_varlen, dict(k=Q), ValueError, ["`k`", "4 dimensions"]),
    (paged_varlen, dict(max_seqlen_q=2), ValueError, ["`max_seqlen_q`"]),
    (lambda **kw: flash_attn_with_kvcache(QC, PAGES, PAGES, page_table=np.array([[0, 1], [2, 3]]), cu_seqlens_q=CU),
     {}, ValueError, ["`q`", "3 dimensions"]),
    (lambda **kw: flash_attn_with_kvcache(Q, PAGES, PAGES, page_table=np.array([[0, 1]]), cu_seqlens_q=CU), {},
     ValueError, ["`block_table`", "one row per sequence"]),
]


@pytest.mark.parametrize("call, kw, err, words", BAD, ids=[f"{c.__name__}-{'-'.join(k)}-{i}"
                                                           for i, (c, k, _, _) in enumerate(BAD)])
def test_a_bad_argument_is_a_clear_error_naming_it(call, kw, err, words):
    tracemalloc.start()
    try:
        with pytest.raises(err) as info:
            call(**kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    assert "should" in msg and "but got" in msg, msg                          # the house style
    assert peak < SMALL_PEAK, f"{peak / 2**20:.0f} MiB traced before the error"


def _peak(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("bound", [2**40, 2**27])
def test_max_seqlen_is_a_bound_that_never_allocates(bound):
    """7 tokens with max_seqlen_k=2**27 allocated 1 GB, and 2**40 was a MemoryError: the bound is only checked."""
    want = varlen(return_lse=True)
    got, peak = _peak(lambda: varlen(max_seqlen_q=bound, max_seqlen_k=bound, return_lse=True))
    assert peak < SMALL_PEAK, f"{peak / 2**20:.0f} MiB"
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    out, peak = _peak(lambda: sdpa_forward(QC, KC, KC, layout=KVCache(max_seqlen_k=bound))[0])
    assert peak < SMALL_PEAK, f"{peak / 2**20:.0f} MiB"
    np.testing.assert_array_equal(out, sdpa_forward(QC, KC, KC, layout=KVCache())[0])


def test_max_seqlen_at_the_longest_length_is_accepted():
    np.testing.assert_array_equal(varlen(max_seqlen_q=4, max_seqlen_k=4), varlen())


def test_max_seqlen_bound_does_not_change_the_residuals_shape():
    """The dense problem is padded to the longest sequence, so a backward on a generous bound costs nothing."""
    lay = Packed(CU, CU, max_seqlen_q=2**30, max_seqlen_k=2**30)
    (out, res), peak = _peak(lambda: sdpa_forward(Q, Q, Q, layout=lay))
    assert peak < SMALL_PEAK and res.problem.L == 4 and res.problem.S == 4
    gr = sdpa_ref.sdpa_backward(res, np.ones_like(out))
    want = sdpa_ref.sdpa_backward(sdpa_forward(Q, Q, Q, layout=Packed(CU, CU))[1], np.ones_like(out))
    for w, g in zip(want, gr):
        np.testing.assert_array_equal(g, w)


def test_window_size_of_two_ints_or_minus_one_is_accepted():
    np.testing.assert_array_equal(varlen(window_size=[-1, -1]), varlen())
    np.testing.assert_array_equal(varlen(window_size=(np.int64(1), 0)), varlen(window_size=(1, 0)))


def test_softcap_zero_is_off():
    np.testing.assert_array_equal(varlen(softcap=0), varlen())
    np.testing.assert_array_equal(varlen(softcap=np.float64(0.0)), varlen())


#: FlashAttention 4's signed bounds (left, right): negative reaches past the diagonal, None is unbounded.
SIGNED = [(-2, 3), (3, -2), (None, -2), (2, None), (0, 0), (1, 0)]


@pytest.mark.parametrize("call, layout", [(varlen, lambda: Packed(CU, CU)), (kvcache, lambda: KVCache()),
                                          (paged, lambda: KVCache(block_table=np.array([[0, 1], [2, 3]])))],
                         ids=["varlen", "kvcache", "paged"])
@pytest.mark.parametrize("left, right", SIGNED)
def test_a_signed_window_equals_the_dense_call_with_its_window(call, layout, left, right):
    """FlashAttention 4's ``window_size_left`` / ``window_size_right`` in each wrapper give the bits of the
    reference called on the same layout with ``window=window_from_fa4(left, right)``, and of the wrapper given
    that ``window=`` through its options."""
    window = sdpa_ref.flash.window_from_fa4(left, right)
    q, k = (Q, Q) if call is varlen else (QC, KC if call is kvcache else PAGES)
    want = sdpa_ref.scaled_dot_product_attention(q, k, k, layout=layout(), window=window,
                                                 causal_alignment="bottom_right", return_lse=True)
    lse = "return_lse" if call is varlen else "return_softmax_lse"
    got = call(window_size_left=left, window_size_right=right, **{lse: True})
    through = call(window=window, **{lse: True})
    for w, g, t in zip(want, got, through):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(t, w)


def test_a_signed_window_masks_and_a_nonnegative_one_is_window_size():
    """The signed window does mask (it differs from no window), and a bound >= 0 means what ``window_size``'s
    does; under ``causal`` it is intersected with the causal mask, as ``window=`` is."""
    assert not np.array_equal(varlen(window_size_left=3, window_size_right=-2), varlen())
    assert not np.array_equal(varlen(window_size_left=-2, window_size_right=3), varlen())
    np.testing.assert_array_equal(varlen(window_size_left=2, window_size_right=0), varlen(window_size=(2, 0)))
    np.testing.assert_array_equal(varlen(window_size_left=2), varlen(window_size=(2, -1)))
    np.testing.assert_array_equal(kvcache(window_size_left=1, window_size_right=3, causal=True),
                                  kvcache(window_size=(1, 0), causal=True))
    np.testing.assert_array_equal(varlen(window_size_left=None, window_size_right=None), varlen())


@pytest.mark.parametrize("kw, names", [
    (dict(window_size=(2, 0), window=(1, 0)), ["`window_size`", "`window`"]),
    (dict(window_size=(2, 0), window_size_left=1), ["`window_size`", "`window_size_left`"]),
    (dict(window_size_left=-2, window_size_right=3, window=(1, 0)), ["`window_size_left`", "`window`"]),
    (dict(window=(1, 0), sliding_window=3), ["`window`", "`sliding_window`"]),
])
def test_two_spellings_of_the_window_name_both(kw, names):
    """Each spelling the caller used is named once, never one name twice ("got window and window")."""
    with pytest.raises(ValueError) as info:
        varlen(**kw)
    msg = str(info.value)
    for n in names:
        assert n in msg, msg
    assert "window and window" not in msg and msg.count("`window`") <= 1, msg


def test_a_spelling_holding_no_window_combines_with_any_other():
    """``window_size=(-1, -1)``, bounds of None and ``window=None`` hold no window: no collision."""
    np.testing.assert_array_equal(varlen(window_size=(-1, -1), window_size_left=2, window_size_right=0),
                                  varlen(window_size=(2, 0)))
    np.testing.assert_array_equal(varlen(window_size=(2, 0), window=None), varlen(window_size=(2, 0)))
    np.testing.assert_array_equal(varlen(window_size_left=None, window=(2, 0)), varlen(window_size=(2, 0)))


# ------------------------------------------------------------ packed queries against a paged cache


def _fa_paged_oracle(q, kc, vc, cu_q, table, seqlens, causal, scale=None):
    """FlashAttention's test semantics written out: sequence ``b``'s queries ``q[cu_q[b]:cu_q[b + 1]]`` against its
    keys ``t < seqlens[b]`` read from page ``table[b, t // P]``, slot ``t % P``; the causal diagonal at the bottom
    right of each sequence (query ``i`` sees ``t <= i + seqlens[b] - len_q``), a row with no key 0, the LSE ``-inf``
    there; ``out (total_q, Hq, Ev)``, ``lse (Hq, total_q)``. Loops, ``math``-free NumPy rows."""
    P, Hq, Hkv = kc.shape[1], q.shape[1], kc.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = np.zeros(q.shape[:2] + vc.shape[-1:]), np.full((Hq, q.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        lq = cu_q[b + 1] - cu_q[b]
        for i in range(lq):
            for h in range(Hq):
                keys = [t for t in range(seqlens[b]) if not causal or t <= i + seqlens[b] - lq]
                if not keys:
                    continue
                hk = h // (Hq // Hkv)
                s = np.array([scale * q[cu_q[b] + i, h] @ kc[table[b][t // P], t % P, hk] for t in keys])
                p = np.exp(s - s.max())
                out[cu_q[b] + i, h] = sum(w * vc[table[b][t // P], t % P, hk] for w, t in zip(p / p.sum(), keys))
                lse[h, cu_q[b] + i] = s.max() + np.log(p.sum())
    return out, lse


def _paged_problem(seed=12):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((6, 4, 3))                        # sequences of 1, 3 and 2 queries
    kc, vc = rng.standard_normal((6, 3, 2, 3)), rng.standard_normal((6, 3, 2, 2))
    table = np.array([[4, 1, 0], [1, 1, 5], [2, 0, 0]])       # page 1 shared and repeated; page 3 named by none
    kc[3], vc[3] = np.nan, np.nan                             # never read
    return q, kc, vc, np.array([0, 1, 4, 6]), table, np.array([7, 5, 2])


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_2s_varlen_block_table_is_each_sequences_paged_keys(causal):
    q, kc, vc, cu_q, table, seqlens = _paged_problem()
    cu_k = np.r_[0, np.cumsum(seqlens)]                       # FlashAttention 2: the keys per sequence
    out, lse = flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 7, causal=causal, block_table=table, return_lse=True)
    want = _fa_paged_oracle(q, kc, vc, cu_q, table, seqlens, causal)
    np.testing.assert_allclose(out, want[0], rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(lse, want[1], rtol=F64_SUMS, atol=F64_SUMS)
    # FlashAttention 3's spelling: page_table, the keys per sequence as seqused_k (cu_seqlens_k then unused)
    out3, lse3 = flash_attn_varlen_func(q, kc, vc, cu_q, None, seqused_k=seqlens, causal=causal, page_table=table,
                                        return_lse=True)
    np.testing.assert_array_equal(out3, out)
    np.testing.assert_array_equal(lse3, lse)
    capped = flash_attn_varlen_func(q, kc, vc, cu_q, cu_k + np.r_[0, 1, 2, 3], seqused_k=seqlens, causal=causal,
                                    block_table=table)             # seqused_k caps cu_seqlens_k's differences
    np.testing.assert_array_equal(capped, out)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_3s_kvcache_with_cu_seqlens_q_and_flashinfers_page_lists(causal):
    q, kc, vc, cu_q, table, seqlens = _paged_problem()
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, cu_seqlens_q=cu_q,
                                       max_seqlen_q=3, causal=causal, return_softmax_lse=True)
    want = _fa_paged_oracle(q, kc, vc, cu_q, table, seqlens, causal)
    np.testing.assert_allclose(out, want[0], rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(lse, want[1], rtol=F64_SUMS, atol=F64_SUMS)
    assert out.shape == (6, 4, 2) and lse.shape == (4, 6)
    # FlashInfer's BatchPrefillWithPagedKVCacheWrapper: qo_indptr, kv_indptr, kv_indices, kv_last_page_len
    n = -(-seqlens // 3)
    csr = dict(kv_indptr=np.r_[0, np.cumsum(n)], kv_indices=np.concatenate([table[b, :n[b]] for b in range(3)]),
               kv_last_page_len=seqlens - (n - 1) * 3)
    got = flash_attn_with_kvcache(q, kc, vc, cu_seqlens_q=cu_q, causal=causal, return_softmax_lse=True, **csr)
    np.testing.assert_array_equal(got[0], out)
    np.testing.assert_array_equal(got[1], lse)
    # the same as the varlen call, and as sdpa_forward on the layout (the gradients' entry point)
    via_varlen = flash_attn_varlen_func(q, kc, vc, cu_q, np.r_[0, np.cumsum(seqlens)], causal=causal,
                                        block_table=table)
    np.testing.assert_array_equal(via_varlen, out)
    lay = KVCache(cache_seqlens=seqlens, block_table=table, cu_seqlens_q=cu_q)
    o, res = sdpa_forward(q, kc, vc, layout=lay, is_causal=causal, causal_alignment="bottom_right", enable_gqa=True)
    np.testing.assert_array_equal(o, out)
    gr = sdpa_ref.sdpa_backward(res, np.ones(o.shape))
    assert gr.key.shape == kc.shape and not gr.key[3].any() and not np.isnan(gr.key).any()
    # split-KV: num_splits, and the parts in FlashAttention's varlen accumulators (n, Hq, total_q, Ev) merged
    split = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, cu_seqlens_q=cu_q,
                                    causal=causal, num_splits=3)
    np.testing.assert_allclose(split, out, rtol=F64_SUMS, atol=F64_SUMS)
    o_parts, lse_parts = sdpa_ref.split_kv_partials(q, kc, vc, num_splits=2, layout=lay, is_causal=causal,
                                                    causal_alignment="bottom_right", enable_gqa=True)
    merged, merged_lse = sdpa_ref.merge_attention(o_parts, lse_parts)
    np.testing.assert_allclose(np.moveaxis(merged, 0, 1), out, rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(merged_lse, lse, rtol=F64_SUMS, atol=F64_SUMS)
