"""The allowed sets kernels define: FlashAttention 4's signed window bounds, a count window, StreamingLLM's sink
tokens, Llama 4's chunks, top-k gathered key indices with FlashMLA's ``topk_length`` and a per-sequence
``q_offset``. The peers' spellings of the window reach the core as
``window=`` through :mod:`sdpa_ref.flash`'s translations; the core's deprecated keywords for them give the same
window, with a warning.

The oracle is written here with loops from the peers' own test references (FlashAttention's
``construct_local_mask``, ``construct_chunk_mask`` and ``attention_ref``'s gather, FlashMLA's ``ref_sparse_attn_fwd``
truncation at ``topk_length``), sharing nothing with
``sdpa_ref.masks``. Each engine must give, forward, backward and JVP, what the dense problem with that allowed set
as a bool ``attn_mask`` gives; keys the set excludes are never read.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref import sdpa_backward, sdpa_forward, sdpa_jvp
from sdpa_ref.flash import window_from_count, window_from_fa4

from helpers import assert_close_normwise, loss_derivatives
from tolerances import F64_SUMS, FD_SECOND_ORDER

HOWS = {"fast": {}, "plain": {"method": "plain"}, "tiled-2": {"block_size": 2}, "split-2": {"num_splits": 2},
        "reproducible": {"precision": "reproducible"}}


def oracle(B, Hq, L, S, o):
    """``(B, Hq, L, S)`` bool, entry by entry: lengths, causal, the window with its sink tokens, the chunk, the
    gathered indices (FlashAttention's references: ``p = i + off``, ``off = kv_len - q_len`` bottom-right)."""
    ql, kl = o.get("q_lengths", [L] * B), o.get("kv_lengths", [S] * B)
    left, right = o.get("_window", (None, None))
    if o.get("is_causal"):
        right = 0 if right is None else min(right, 0)
    n_sink, C = o.get("sink_token_length", 0), o.get("attention_chunk")
    idx, n_top = o.get("gather_kv_indices"), o.get("topk_length")
    a = np.zeros((B, Hq, L, S), bool)
    for b, h, i, j in np.ndindex(B, Hq, L, S):
        off = int(kl[b]) - int(ql[b]) if o.get("causal_alignment") == "bottom_right" else 0
        if o.get("q_offset") is not None:                   # the row's position given outright
            off = int(np.broadcast_to(o["q_offset"], (B,))[b])
        p = i + off
        ok = i < ql[b] and j < kl[b]
        ok = ok and not (left is not None and j < p - left and j >= n_sink)
        ok = ok and not (right is not None and j > p + right)
        if C:
            start = p - (p % C)                             # Python's %: the floor, for negative p too
            ok = ok and start <= j < start + C
        if idx is not None:
            row = np.broadcast_to(idx, (B, Hq, L, idx.shape[-1]))[b, h, i]
            if n_top is not None:                            # FlashMLA: positions >= topk_length are -1
                row = row[:int(np.broadcast_to(n_top, (B, Hq, L))[b, h, i])]
            ok = ok and any(int(x) == j for x in row)        # -1 and out-of-range name nothing; duplicates once
        a[b, h, i, j] = ok
    return a


@st.composite
def problems(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Hq, L, S = Hkv * G, draw(st.integers(1, 6)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    o = {"enable_gqa": G > 1, "is_causal": draw(st.booleans()),
         "causal_alignment": draw(st.sampled_from(["top_left", "bottom_right"])),
         "fully_masked": draw(st.sampled_from(["zero", "uniform"]))}
    form = draw(st.sampled_from(["none", "fa4", "count", "window"]))
    if form == "fa4":
        # -1, one key past the diagonal, is unbounded in `window=`: its deprecated spelling is tested apart
        bound = st.one_of(st.none(), st.integers(-3, 4).filter(lambda b: b != -1))
        left, right = draw(bound), draw(bound)
        eff = 0 if o["is_causal"] and (right is None or right > 0) else right
        if left is not None and eff is not None and left + eff < 0:
            left = None                                      # refused: tested apart
        o.update(window=window_from_fa4(left, right, o["is_causal"]), _window=(left, right))
    elif form == "count":
        w = draw(st.integers(1, 5))
        o.update(window=window_from_count(w), _window=(w - 1, None))
    elif form == "window":
        w = (draw(st.sampled_from([None, 0, 1, 3])), draw(st.sampled_from([None, 0, 2])))
        o.update(window=w, _window=w)
    if form != "none" and draw(st.booleans()):
        o["sink_token_length"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        o["attention_chunk"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        K = draw(st.integers(1, 4))
        shape = (B, draw(st.sampled_from([1, Hq])), draw(st.sampled_from([1, L])), K)
        o["gather_kv_indices"] = rng.integers(-2, S + 2, shape)
        if draw(st.booleans()):                              # per query (FlashMLA's prefill) or per row and head
            o["topk_length"] = rng.integers(0, K + 1, draw(st.sampled_from([(L,), (B, 1, 1), (B, Hq, L)])))
    if o["causal_alignment"] == "top_left" and draw(st.booleans()):
        o["q_offset"] = rng.integers(-3, 5, draw(st.sampled_from([(B,), ()])))
    if draw(st.booleans()):
        o["q_lengths"], o["kv_lengths"] = rng.integers(0, L + 1, B), rng.integers(0, S + 1, B)
    arrays = (rng.standard_normal((B, Hq, L, 3)), rng.standard_normal((B, Hkv, S, 3)),
              rng.standard_normal((B, Hkv, S, 2)))
    return (B, Hq, L, S), arrays, o


def _api(o):
    return {k: v for k, v in o.items() if not k.startswith("_")}


def _dense(o, a):
    """The same problem as a plain bool mask: no window, chunk or indices, the lengths kept (they zero padded
    rows, which a mask does not)."""
    d = {k: v for k, v in _api(o).items() if k not in ("sink_token_length", "attention_chunk", "gather_kv_indices",
                                                       "window", "is_causal", "topk_length", "q_offset")}
    return dict(d, attn_mask=a)


@given(problems())
def test_the_allowed_set_is_the_peers_reference_entry_by_entry(problem):
    (B, Hq, L, S), (q, k, v), o = problem
    want = oracle(B, Hq, L, S, o)
    got = sdpa_forward(q, k, v, **_api(o))[1].problem.allowed()
    np.testing.assert_array_equal(np.broadcast_to(True if got is None else got, want.shape), want)


@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(problem=problems())
def test_every_engine_computes_the_allowed_set_as_the_dense_mask(problem, how):
    (B, Hq, L, S), (q, k, v), o = problem
    a = oracle(B, Hq, L, S, o)
    rng = np.random.default_rng(1)
    g = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    ts = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    results = []
    for kw in (_api(o), _dense(o, a)):
        out, res = sdpa_forward(q, k, v, **kw, **HOWS[how])
        grads = sdpa_backward(res, g)
        results.append((out, res.lse, grads.query, grads.key, grads.value, sdpa_jvp((q, k, v), ts, **kw, **HOWS[how])[1]))
    for x, y in zip(*results):
        assert_close_normwise(x, y, 0.0 if how == "reproducible" else 1e-13)


@pytest.mark.parametrize("how", list(HOWS))
def test_keys_the_chunk_and_the_indices_exclude_are_never_read(how):
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 9, 3)), rng.standard_normal((1, 2, 9, 2))
    o = dict(attention_chunk=3, gather_kv_indices=np.array([[[[0, 1, 4, 7, -1]]]]))
    clean = sdpa_forward(q, k, v, **o, **HOWS[how])
    kb, vb = k.copy(), v.copy()
    kb[..., [2, 3, 5, 6, 8], :] = np.nan                       # named by no index
    vb[..., [2, 3, 5, 6, 8], :] = np.inf
    dirty = sdpa_forward(q, kb, vb, **o, **HOWS[how])
    np.testing.assert_array_equal(clean[0], dirty[0])
    g = rng.standard_normal(clean[0].shape)
    for x, y in zip(sdpa_backward(clean[1], g), sdpa_backward(dirty[1], g)):
        if x is not None:
            np.testing.assert_array_equal(x, y)


def test_the_window_forms_are_one_window():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 1, 6, 2)), rng.standard_normal((1, 1, 6, 2)), rng.standard_normal((1, 1, 6, 2))
    want = sdpa_forward(q, k, v, window=(2, 0))[0]
    for kw in (dict(window=window_from_fa4(2, 0)), dict(window=window_from_count(3), is_causal=True),
               dict(window=window_from_fa4(2, None, causal=True), is_causal=True)):
        np.testing.assert_array_equal(sdpa_forward(q, k, v, **kw)[0], want)


def _qkv(seed, L=6, S=7):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, 2, L, 3)), rng.standard_normal((1, 2, S, 3)), rng.standard_normal((1, 2, S, 2))


@pytest.mark.parametrize("old, new", [
    (dict(window_size_left=2, window_size_right=0), dict(window=(2, 0))),
    (dict(window_size_left=-2, window_size_right=4), dict(window=(-2, 4))),
    (dict(window_size_left=3, is_causal=True), dict(window=(3, None), is_causal=True)),
    (dict(window_size_left=4, window_size_right=-1), dict(attn_mask=np.tri(6, 7, -1, bool) & ~np.tri(6, 7, -5, bool))),
    (dict(window_size_left=None, window_size_right=None), {}),
])
def test_fa4_window_keywords_are_deprecated_and_give_the_same_result(old, new):
    q, k, v = _qkv(8)
    with pytest.warns(DeprecationWarning, match=r"`window_size_left` and `window_size_right` are deprecated: pass "
                                                r"`window=\(left, right\)`"):
        got = sdpa_forward(q, k, v, **old)
    want = sdpa_forward(q, k, v, **new)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1].lse, want[1].lse)


@pytest.mark.parametrize("n, causal", [(3, True), (2, False), (None, True)])
def test_sliding_window_is_deprecated_and_gives_the_same_result(n, causal):
    q, k, v = _qkv(9)
    with pytest.warns(DeprecationWarning, match=r"`sliding_window` is deprecated: pass `window=\(n - 1, None\)`"):
        got = sdpa_forward(q, k, v, sliding_window=n, is_causal=causal)
    want = sdpa_forward(q, k, v, window=window_from_count(n), is_causal=causal)
    np.testing.assert_array_equal(got[0], want[0])
    if n is not None:
        np.testing.assert_array_equal(got[0], sdpa_forward(q, k, v, window=(n - 1, 0 if causal else None),
                                                           is_causal=causal)[0])


@pytest.mark.parametrize("call, err, match", [
    (lambda: window_from_fa4(-2, 1), ValueError, "FlashAttention 4 silently drops"),
    (lambda: window_from_fa4(-1, None, causal=True), ValueError, "keep"),
    (lambda: window_from_fa4(4, -1), ValueError, "`window_size_right` should not be -1"),
    (lambda: window_from_fa4(1.5), TypeError, "`window_size_left`"),
    (lambda: window_from_count(0), ValueError, "`sliding_window`"),
    (lambda: window_from_count(2.0), TypeError, "`sliding_window`"),
])
def test_the_window_translations_name_the_peers_arguments(call, err, match):
    with pytest.raises(err, match=match):
        call()


@pytest.mark.parametrize("kw, err, match", [
    (dict(window=(-2, 1)), ValueError, "`window` left \\+ right should be >= 0"),
    (dict(window=(-2, 3), is_causal=True), ValueError, "no key would be kept"),
    (dict(window=(1, 1), sliding_window=2), ValueError, "combined"),
    (dict(window=(1, 1), window_size_left=1), ValueError, "combined"),
    (dict(sliding_window=0), ValueError, "`sliding_window`"),
    (dict(window_size_left=1.5), TypeError, "`window_size_left`"),
    (dict(sink_token_length=-1), ValueError, "`sink_token_length`"),
    (dict(attention_chunk=True), TypeError, "`attention_chunk`"),
    (dict(gather_kv_indices=np.zeros((2, 3, 1))), TypeError, "`gather_kv_indices`"),
    (dict(gather_kv_indices=np.zeros((3, 2), int)), ValueError, "`gather_kv_indices`"),
])
def test_bad_allowed_set_options_name_themselves(kw, err, match):
    x = np.zeros((1, 2, 4, 2))
    with pytest.raises(err, match=match):
        sdpa_forward(x, x, x, **kw)


def test_attention_chunk_zero_is_off():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 1, 4, 2))
    np.testing.assert_array_equal(sdpa_forward(x, x, x, attention_chunk=0)[0], sdpa_forward(x, x, x)[0])


def test_the_gradients_through_a_chunk_and_indices_match_central_differences():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((1, 2, 4, 2)), rng.standard_normal((1, 2, 6, 2)), rng.standard_normal((1, 2, 6, 3))
    o = dict(attention_chunk=2, window=(2, None), sink_token_length=1, is_causal=True,
             causal_alignment="bottom_right", gather_kv_indices=np.array([[[[0, 1, 3, 5, 5]]]]))
    rep = sdpa_ref.check_vjp(lambda q, k, v: sdpa_forward(q, k, v, **o)[0],
                             lambda g, q, k, v: tuple(sdpa_backward(sdpa_forward(q, k, v, **o)[1], g))[:3],
                             (q, k, v))
    assert rep.ok, rep


# ------------------------------------------------ FlashMLA's topk_length, the per-sequence q_offset


@pytest.mark.parametrize("how", list(HOWS))
def test_indices_past_topk_length_are_never_read(how):
    """FlashMLA's sparse rows read their first ``topk_length`` indices only: keys named past it (and only there)
    may hold NaN and inf without a bit of any result moving; the result is the problem whose indices are -1 there."""
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 9, 3)), rng.standard_normal((2, 2, 9, 2))
    idx = np.broadcast_to(np.array([0, 2, 4, 6, 8, 1]), (2, 1, 4, 6))
    n = np.array([[[6, 3, 0, 2]], [[1, 4, 5, 6]]])                 # (B, 1, L): per sequence and query
    o = dict(gather_kv_indices=idx, topk_length=n)
    clean = sdpa_forward(q, k, v, **o, **HOWS[how])
    cut = np.where(np.arange(6) < n[..., None], idx, -1)
    np.testing.assert_array_equal(clean[0], sdpa_forward(q, k, v, gather_kv_indices=cut, **HOWS[how])[0])
    kb, vb = k.copy(), v.copy()
    kb[1, ..., [6, 8, 1], :] = np.nan                              # sequence 1 names them past its counts only
    vb[1, ..., [6, 8, 1], :] = np.inf
    kb[0, ..., [3, 5, 7], :] = np.nan                              # named by no index
    n1 = np.array([[[6, 3, 0, 2]], [[1, 3, 3, 3]]])
    clean = sdpa_forward(q, k, v, gather_kv_indices=idx, topk_length=n1, **HOWS[how])
    dirty = sdpa_forward(q, kb, vb, gather_kv_indices=idx, topk_length=n1, **HOWS[how])
    np.testing.assert_array_equal(clean[0], dirty[0])
    np.testing.assert_array_equal(clean[1].lse, dirty[1].lse)
    g = rng.standard_normal(clean[0].shape)
    for x, y in zip(sdpa_backward(clean[1], g), sdpa_backward(dirty[1], g)):
        if x is not None:
            np.testing.assert_array_equal(x, y)


def test_topk_length_per_query_is_flashmla_prefills_reference():
    """FlashMLA's ``ref_sparse_attn_fwd``: ``topk_length`` ``(s_q,)``, indices past it masked to -1, one KV head
    shared by the query heads; a row with no index left has ``O = 0`` and the sink-free LSE ``+inf`` there."""
    rng = np.random.default_rng(12)
    s_q, s_kv, h_q, d, topk = 5, 8, 3, 4, 4
    q, kv = rng.standard_normal((h_q, s_q, d)), rng.standard_normal((1, s_kv, d))
    idx = rng.integers(-1, s_kv, (1, s_q, topk))
    n = np.array([4, 0, 2, 1, 3])
    out, res = sdpa_forward(q, kv, kv, gather_kv_indices=idx, topk_length=n, enable_gqa=True)
    want = np.zeros((h_q, s_q, d))
    for i in range(s_q):                                            # the reference's loop, one query at a time
        keep = sorted({int(j) for j in idx[0, i, :n[i]] if 0 <= j < s_kv})
        for h in range(h_q):
            if keep:
                t = np.array([q[h, i] @ kv[0, j] / np.sqrt(d) for j in keep])
                p = np.exp(t - t.max()) / np.exp(t - t.max()).sum()
                want[h, i] = sum(pj * kv[0, j] for pj, j in zip(p, keep))
    np.testing.assert_allclose(out, want, rtol=F64_SUMS, atol=F64_SUMS)
    assert np.all(res.lse_as(empty="+inf")[:, 1] == np.inf)


@pytest.mark.parametrize("kw, err, match", [
    (dict(topk_length=np.array([1, 2, 3])), ValueError, "`topk_length` should be given with `gather_kv_indices`"),
    (dict(gather_kv_indices=np.zeros((1, 1, 3, 2), int), topk_length=np.array([1, 2, 3])), ValueError,
     r"`topk_length` should hold counts in \[0, K\] = \[0, 2\], but got values from 1 to 3"),
    (dict(gather_kv_indices=np.zeros((1, 1, 3, 2), int), topk_length=np.array([-1, 0, 0])), ValueError,
     "`topk_length` should hold counts"),
    (dict(gather_kv_indices=np.zeros((1, 1, 3, 2), int), topk_length=np.array([1.0, 1, 1])), TypeError,
     "`topk_length` should be an integer array"),
    (dict(gather_kv_indices=np.zeros((1, 1, 3, 2), int), topk_length=np.array([1, 1])), ValueError,
     r"`topk_length` should have a shape that broadcasts to \(..., Hq, L\) = \(1, 2, 3\), but got shape \(2,\)"),
    (dict(q_offset=np.array([1]), causal_alignment="bottom_right"), ValueError,
     "`q_offset` should not be given beside `causal_alignment='bottom_right'`"),
    (dict(q_offset=np.array([1.0])), TypeError, "`q_offset` should be an integer array"),
    (dict(q_offset=np.array([1, 2, 3])), ValueError,
     r"`q_offset` should have a shape that broadcasts to the batch shape \(1,\), but got shape \(3,\)"),
    (dict(q_offset=np.ma.array([1])), TypeError, "`q_offset` should be a plain array, but got a numpy.ma"),
])
def test_bad_topk_length_and_q_offset_name_the_argument(kw, err, match):
    q, k, v = _qkv(13, L=3, S=4)
    with pytest.raises(err, match=match):
        sdpa_forward(q, k, v, **kw)


def test_topk_indices_does_not_mutate_its_input():
    idx = np.array([[3, 1, 2], [0, 2, 1]])
    before = idx.copy()
    got = sdpa_ref.masks.topk_indices(idx, np.array([1, 3]), (2,))
    np.testing.assert_array_equal(idx, before)
    assert got.tolist() == [[3, -1, -1], [0, 2, 1]]


@pytest.mark.parametrize("method", ["plain", "tiled"])
def test_topk_length_and_q_offset_gradients_and_hvp_match_central_differences(method):
    q, k, v = _qkv(14, L=4, S=7)
    idx = np.broadcast_to(np.array([6, 0, 3, 5, 1]), (1, 1, 4, 5))
    kw = dict(gather_kv_indices=idx, topk_length=np.array([5, 2, 3, 4]), q_offset=np.array([2]), is_causal=True,
              method=method)
    fun, vjp, hvp, args, g = loss_derivatives(dict(query=q, key=k, value=v, **kw))
    report = sdpa_ref.check_vjp(fun, vjp, args, mode="projection", n_projections=3)
    assert report.ok, report
    sdpa_ref.assert_hvp(fun, vjp, hvp, args, cotangent=g, mode="projection", rtol=FD_SECOND_ORDER)


def test_a_nan_key_named_past_topk_length_poisons_nothing():
    q, k, v = _qkv(15, L=3, S=5)
    k = k.copy()
    k[..., 4, :] = np.nan
    idx = np.array([[[[0, 1, 4], [2, 4, 3], [4, 1, 0]]]])
    out, res = sdpa_forward(q, k, v, gather_kv_indices=idx, topk_length=np.array([2, 1, 0]), q_offset=np.array([1]))
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(res.lse))
    out, res = sdpa_forward(q, k, v, gather_kv_indices=idx, topk_length=np.array([3, 1, 0]))
    assert np.all(np.isnan(out[..., 0, :])) and np.all(np.isfinite(out[..., 1:, :]))
