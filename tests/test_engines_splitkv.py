"""The split-KV schedule: partials over splits of the keys, merged by their LSEs, as decode kernels do.

Each split's partial is checked against a loop oracle (the softmax of the split's allowed scores, written out
per row), the merged schedule (``method="split"``) against the unsplit result on every option, forward,
backward and JVP; the split-KV backward a kernel would write (the merge's VJP, then each split's attention
backward with its LSE cotangent) against the unsplit gradients; poison and layouts; bad input. Under
precision="reproducible": the split results are the unsplit ones bit for bit, and each partial is faithful
against 50-digit mpmath.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref import KVCache, sdpa_backward, sdpa_backward_jvp, sdpa_forward, sdpa_jvp, split_kv_partials

from helpers import assert_close_normwise
from tolerances import F64_AMPLIFIED, F64_FEW_ULP, F64_GRAD, F64_GRAD_LONG, F64_SUMS
import warnings
import mpmath


def loop_partials(q, k, v, bounds, is_causal=False, kv_lengths=None):
    """``(out, lse)`` per split by a Python loop over splits, rows and keys: ``(n, B, H, L, Ev)``, ``(n, B, H, L)``
    (no GQA; top-left causal)."""
    B, H, L, E = q.shape
    S = k.shape[2]
    n = bounds.shape[-1] - 1
    out, lse = np.zeros((n, B, H, L, v.shape[-1])), np.full((n, B, H, L), -np.inf)
    for i, b, h, r in np.ndindex(n, B, H, L):
        bb = np.broadcast_to(bounds, (B, n + 1))[b]
        keys = [j for j in range(bb[i], bb[i + 1]) if j < S and (kv_lengths is None or j < kv_lengths[b])
                and (not is_causal or j <= r)]
        if not keys:
            continue
        t = np.array([q[b, h, r] @ k[b, h, j] / np.sqrt(E) for j in keys])
        w = np.exp(t - t.max())
        out[i, b, h, r] = sum(wj * v[b, h, j] for wj, j in zip(w / w.sum(), keys))
        lse[i, b, h, r] = t.max() + np.log(w.sum())
    return out, lse


@st.composite
def split_problems(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    L, S, E = draw(st.integers(1, 5)), draw(st.integers(0, 9)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (rng.standard_normal(s) for s in ((B, Hkv * G, L, E), (B, Hkv, S, E), (B, Hkv, S, 2)))
    o = {"enable_gqa": G > 1, "is_causal": draw(st.booleans()),
         "causal_alignment": draw(st.sampled_from(["top_left", "bottom_right"])),
         "fully_masked": draw(st.sampled_from(["zero", "nan"] + (["uniform"] if S else [])))}
    if draw(st.booleans()):
        o["attn_mask"] = rng.random((B, Hkv * G, L, S)) > 0.3
    if draw(st.booleans()):
        o["bias"] = rng.standard_normal((Hkv * G, L, S))
    if draw(st.booleans()):
        o["softcap"] = 2.0
    if draw(st.booleans()):
        o["sinks"] = rng.standard_normal(Hkv * G)
    if draw(st.booleans()):
        o["kv_lengths"] = rng.integers(0, S + 1, B)
    if draw(st.booleans()):
        o["window"] = (draw(st.integers(0, 3)), None)
    if draw(st.booleans()):
        o["dropout_mask"] = rng.random((B, Hkv * G, L, S)) > 0.2
        o["dropout_p"] = 0.2
    if draw(st.booleans()):
        splits = {"num_splits": draw(st.integers(1, S + 2))}
    else:
        cuts = np.sort(rng.integers(0, S + 1, (B, draw(st.integers(0, 3)))), axis=-1)
        splits = {"split_bounds": np.concatenate([np.zeros((B, 1), int), cuts, np.full((B, 1), S)], axis=-1)}
    return (q, k, v), o, splits


@given(split_problems())
def test_the_merged_splits_are_the_unsplit_attention(problem):
    (q, k, v), o, splits = problem
    want, wres = sdpa_forward(q, k, v, **o)
    got, gres = sdpa_forward(q, k, v, **o, **splits)
    assert gres.method == "split"
    assert_close_normwise(want, got, F64_SUMS)
    assert_close_normwise(wres.lse, gres.lse, F64_SUMS)
    rng = np.random.default_rng(0)
    g = rng.standard_normal(want.shape)
    for a, b in zip(sdpa_backward(wres, g), sdpa_backward(gres, g)):
        assert_close_normwise(a, b, F64_GRAD)
    ts = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    assert_close_normwise(sdpa_jvp((q, k, v), ts, **o)[1], sdpa_jvp((q, k, v), ts, method="split", **o, **splits)[1],
                          1e-12)


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(st.integers(0, 2**32 - 1), st.booleans(), st.integers(1, 6))
def test_each_partial_is_the_loop_oracles(seed, causal, n):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 7, 4)), rng.standard_normal((2, 2, 7, 3))
    kv = np.array([7, 4])
    out, lse = split_kv_partials(q, k, v, is_causal=causal, kv_lengths=kv, num_splits=n)
    bounds = sdpa_ref.engines.splitkv.bounds(sdpa_ref.sdpa_forward(q, k, v, kv_lengths=kv)[1].problem, n)
    want_out, want_lse = loop_partials(q, k, v, bounds, causal, kv)
    np.testing.assert_allclose(out, want_out, rtol=F64_AMPLIFIED, atol=F64_SUMS)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=F64_AMPLIFIED)
    # num_splits: ceil(kv_len / n) keys per split, per sequence
    want = np.minimum(-(-kv[:, None] // n) * np.arange(n + 1), kv[:, None])
    want[:, -1] = 7
    np.testing.assert_array_equal(bounds, want)


def test_the_partials_merge_to_the_result_and_a_sink_is_one_more_part():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 4, 2, 3)), rng.standard_normal((1, 2, 9, 3)), rng.standard_normal((1, 2, 9, 2))
    sinks = np.array([0.5, -np.inf, 3.0, -1.0])
    o = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", softcap=3.0)
    out_p, lse_p = split_kv_partials(q, k, v, split_bounds=[0, 2, 2, 8, 9], **o)
    assert np.all(lse_p[1] == -np.inf) and np.all(out_p[1] == 0)            # the empty split
    want, res = sdpa_forward(q, k, v, sinks=sinks, **o)
    keys = sdpa_ref.merge_attention(out_p, lse_p)
    np.testing.assert_allclose(keys[1], res.lse_as(sink=False), rtol=F64_SUMS)
    sink_part = np.broadcast_to(sinks[:, None], lse_p.shape[1:])
    merged = sdpa_ref.merge_attention(np.concatenate([out_p, np.zeros_like(out_p[:1])]),
                                      np.concatenate([lse_p, sink_part[None]]))
    np.testing.assert_allclose(merged[0], want, rtol=F64_SUMS, atol=F64_FEW_ULP)
    np.testing.assert_allclose(merged[1], res.lse, rtol=F64_SUMS)


def test_the_split_kv_backward_through_the_merge_is_the_unsplit_gradient():
    """What a split-KV training kernel computes: the merge's VJP gives each split its output and LSE cotangents,
    each split's attention backward (with ``grad_lse``) its share, and the shares add up."""
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 8, 4)), rng.standard_normal((2, 2, 8, 3))
    bounds = np.array([0, 3, 5, 8])
    o = dict(is_causal=True, causal_alignment="bottom_right", bias=rng.standard_normal((2, 3, 8)))
    g, gl = rng.standard_normal((2, 2, 3, 3)), rng.standard_normal((2, 2, 3))
    want = sdpa_backward(sdpa_forward(q, k, v, **o)[1], g, grad_lse=gl)
    out_p, lse_p = split_kv_partials(q, k, v, split_bounds=bounds, **o)
    d_out, d_lse = sdpa_ref.merge_attention_backward(out_p, lse_p, g, gl)
    total = [np.zeros_like(x) for x in (q, k, v, o["bias"])]
    for i in range(3):
        only = np.zeros(8, bool)
        only[bounds[i]:bounds[i + 1]] = True
        _, r = sdpa_forward(q, k, v, attn_mask=only, **o)
        gr = sdpa_backward(r, d_out[i], grad_lse=d_lse[i])
        for t, x in zip(total, (gr.query, gr.key, gr.value, gr.bias)):
            t += x
    for a, b in zip((want.query, want.key, want.value, want.bias), total):
        np.testing.assert_allclose(b, a, rtol=F64_GRAD_LONG, atol=F64_GRAD)


def test_a_partial_reads_only_its_split():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 1, 4, 3)), rng.standard_normal((1, 1, 9, 3)), rng.standard_normal((1, 1, 9, 2))
    clean = split_kv_partials(q, k, v, num_splits=3)
    k2, v2 = k.copy(), v.copy()
    k2[0, 0, 7, 1], v2[0, 0, 4, 0] = np.nan, np.inf                       # split 2 and split 1
    out, lse = split_kv_partials(q, k2, v2, num_splits=3)
    np.testing.assert_array_equal(out[0], clean[0][0])
    np.testing.assert_array_equal(lse[0], clean[1][0])
    assert np.isnan(out[1][..., 0]).all() and np.isfinite(out[1][..., 1]).all()    # a value: its column only,
    assert np.isfinite(lse[1]).all()                                                # not the LSE
    assert np.isnan(out[2]).all() and np.isnan(lse[2]).all()                # a key: both
    merged, res = sdpa_forward(q, k2, v2, num_splits=3)
    assert np.isnan(merged).all()
    # a split past the causal diagonal never reads its keys, poisoned or not
    out_c, _ = split_kv_partials(q, k2, v2, num_splits=3, is_causal=True)
    assert np.all(out_c[1:][:, ..., :3, :] == 0)


def test_paged_decode_splits_per_sequence_and_num_splits_in_flash_attn_with_kvcache():
    rng = np.random.default_rng(4)
    kc, vc = rng.standard_normal((6, 4, 2, 3)), rng.standard_normal((6, 4, 2, 3))
    q = rng.standard_normal((2, 1, 4, 3))
    lay = dict(cache_seqlens=np.array([10, 5]), block_table=np.array([[3, 0, 5], [1, 2, 4]]))
    want, want_lse = sdpa_ref.flash_attn_with_kvcache(q, kc, vc, causal=True, return_softmax_lse=True, **lay)
    for n in (2, 3, 7):
        got, got_lse = sdpa_ref.flash_attn_with_kvcache(q, kc, vc, causal=True, num_splits=n,
                                                        return_softmax_lse=True, **lay)
        np.testing.assert_allclose(got, want, rtol=F64_SUMS, atol=F64_FEW_ULP)
        np.testing.assert_allclose(got_lse, want_lse, rtol=F64_SUMS)
        out_p, lse_p = split_kv_partials(q, kc, vc, layout=KVCache(**lay), enable_gqa=True, is_causal=True,
                                         causal_alignment="bottom_right", num_splits=n)
        assert out_p.shape == (n,) + want_lse.shape + (3,) and lse_p.shape == (n,) + want_lse.shape
        merged = sdpa_ref.merge_attention(out_p, lse_p)                       # FlashAttention's accumulators
        np.testing.assert_allclose(np.swapaxes(merged[0], 1, 2), want, rtol=F64_SUMS, atol=F64_FEW_ULP)
        np.testing.assert_allclose(merged[1], want_lse, rtol=F64_SUMS)
    # sequence 1 (5 keys) in 3 splits of 2, 2, 1; sequence 0 (10 keys) of 4, 4, 2
    _, lse_p = split_kv_partials(q, kc, vc, layout=KVCache(**lay), enable_gqa=True, num_splits=3)
    for b, sizes in ((0, (4, 4, 2)), (1, (2, 2, 1))):
        pos = np.arange(lay["cache_seqlens"][b])
        ks = kc[lay["block_table"][b][pos // 4], pos % 4]                    # (kv_len, Hkv, E)
        edges = np.cumsum((0,) + sizes)
        for i in range(3):
            t = np.einsum("he,khe->hk", q[b, 0, ::2], ks[edges[i]:edges[i + 1]]) / np.sqrt(3)
            np.testing.assert_allclose(lse_p[i, b, ::2, 0], np.log(np.exp(t).sum(-1)), rtol=F64_SUMS)


def test_the_split_gradients_match_central_differences():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 1, 5, 2)), rng.standard_normal((1, 1, 5, 2))
    o = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", sinks=np.array([0.3, -0.2]),
             num_splits=2, block_size=2)
    f = lambda q, k, v: sdpa_forward(q, k, v, **o)[0]                                 # noqa: E731
    vjp = lambda g, q, k, v: sdpa_backward(sdpa_forward(q, k, v, **o)[1], g)[:3]      # noqa: E731
    assert sdpa_ref.check_vjp(f, vjp, (q, k, v)).ok


@pytest.mark.parametrize("kw, match", [
    (dict(num_splits=0), "`num_splits`"),
    (dict(num_splits=True), "`num_splits`"),
    (dict(num_splits=2.0), "`num_splits`"),
    (dict(num_splits=2, split_bounds=[0, 4]), "`num_splits` or `split_bounds`"),
    (dict(split_bounds=[1, 4]), "`split_bounds`"),
    (dict(split_bounds=[0, 3, 2, 4]), "`split_bounds`"),
    (dict(split_bounds=[0, 3]), "`split_bounds`"),
    (dict(split_bounds=[0.0, 4.0]), "`split_bounds`"),
    (dict(split_bounds=[4]), "`split_bounds`"),
    (dict(split_bounds=np.zeros((3, 2), int)), "`split_bounds`"),
    (dict(num_splits=2, method="tiled"), "`num_splits` and `split_bounds` should be None"),
    (dict(num_splits=2, block_size=2, precision="reproducible"), "precision='reproducible'"),
    (dict(method="split"), "`num_splits` or `split_bounds`"),
])
def test_bad_splits_name_their_argument(kw, match):
    x = np.zeros((2, 1, 3, 2))
    y = np.zeros((2, 1, 4, 2))
    with pytest.raises(ValueError, match=match):
        sdpa_forward(x, y, y, **kw)


def test_packed_partials_are_in_the_varlen_accumulators_layout():
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((5, 2, 3)), rng.standard_normal((9, 2, 3)), rng.standard_normal((9, 2, 4))
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 6, 9])
    out, lse = sdpa_ref.flash_attn_varlen_func(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    out_p, lse_p = split_kv_partials(q, k, v, layout=sdpa_ref.Packed(cu_q, cu_k), is_causal=True,
                                     causal_alignment="bottom_right", num_splits=2)
    assert out_p.shape == (2, 2, 5, 4) and lse_p.shape == (2, 2, 5)           # (n, Hq, total_q, Ev)
    m_out, m_lse = sdpa_ref.merge_attention(out_p, lse_p)
    np.testing.assert_allclose(np.swapaxes(m_out, 0, 1), out, rtol=F64_SUMS, atol=F64_FEW_ULP)
    np.testing.assert_allclose(m_lse, lse, rtol=F64_SUMS)


def test_bad_splits_in_the_partials_and_flash_attn_with_kvcache():
    x = np.zeros((1, 1, 2, 2))
    with pytest.raises(ValueError, match="`num_splits` or `split_bounds`"):
        split_kv_partials(x, x, x)
    with pytest.raises(ValueError, match="`num_splits`"):
        sdpa_ref.flash_attn_with_kvcache(np.zeros((1, 1, 1, 2)), np.zeros((1, 4, 1, 2)), np.zeros((1, 4, 1, 2)),
                                         num_splits=-1)


def test_flash_attn_with_kvcache_splits_when_asked(monkeypatch):
    """num_splits is not accepted and ignored: n > 1 runs the split schedule with n splits per sequence."""
    seen = []
    real = sdpa_ref.engines.splitkv.forward

    def spy(prob, **kw):
        seen.append(kw["split_bounds"].shape[-1] - 1)
        return real(prob, **kw)
    monkeypatch.setattr(sdpa_ref.engines.splitkv, "forward", spy)
    rng = np.random.default_rng(7)
    kc, vc, q = rng.standard_normal((3, 4, 1, 2)), rng.standard_normal((3, 4, 1, 2)), rng.standard_normal((1, 1, 1, 2))
    for n in (0, 1, 3):
        sdpa_ref.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.array([9]), block_table=np.array([[2, 0, 1]]),
                                         num_splits=n)
    assert seen == [3]


#: Each entry within ULPS * eps of its envelope (see the module docstring for why 16).
ULPS = 16


EPS = np.finfo(np.float64).eps


SCALES = (1e10, 1e15, 1e17, 1e20, 1e100, 1e300)


L, S, E = 2, 5, 3


#: (num_splits, block_size) of the split engine: splits of 3, 2 and 1 keys, blocks that cut them.
SPLITS = ((2, 1), (2, 2), (3, 2), (3, 4), (5, 3), (2, "auto"))


def _problem(family, C, sink):
    """``(q, k, v, scale, sinks, dO, dlse, tangents)`` of one head, ``(1, L, E)`` etc., scores of about ``C``."""
    rng = np.random.default_rng(int(np.log10(C)) * 7 + len(sink))
    v, dO = rng.standard_normal((1, S, E)), rng.standard_normal((1, L, E))
    dlse = rng.standard_normal((1, L))
    if family == "exact":                               # T_ij = C2 + u (a_i . b_j), every product and sum exact
        c = int(round(np.log2(C)))
        C2, ue = 2.0 ** c, max(0, c - 52)
        a, b = rng.integers(-2, 3, (L, 2)), rng.integers(-2, 3, (S, 2))
        q = np.concatenate([np.full((L, 1), 2.0 ** (c // 2)), a * 2.0 ** (ue // 2)], axis=1)[None]
        k = np.concatenate([np.full((S, 1), 2.0 ** (c - c // 2)), b * 2.0 ** (ue - ue // 2)], axis=1)[None]
        scale, u = 1.0, 2.0 ** ue
    else:                                               # random directions: rounded scores, one key per row
        q, k = rng.standard_normal((1, L, E)), rng.standard_normal((1, S, E))
        r = np.sqrt(C / np.max(np.abs(q[0] @ k[0].T / np.sqrt(E))))
        q, k, scale, C2, u = q * r, k * r, None, C, 0.0
    sinks = {"": None, "dominant": np.array([2.0 * C2]), "near": np.array([C2 + 3 * u]),
             "low": np.array([-C2])}[sink]
    tq, tk, tv = (rng.standard_normal(x.shape) * np.max(np.abs(x)) for x in (q, k, v))
    tangents = (tq, tk, tv, None, None if sinks is None else np.array([rng.standard_normal() * C2]))
    return q, k, v, scale, sinks, dO, dlse, tangents


def _oracle(q, k, v, scale, sinks, dO, dlse, tangents):
    """The forward, LSE, gradients and output tangent of one head by a loop in mpmath at 50 digits, each with its
    envelope (the sum of the absolute values of its terms): ``{name: (value, envelope)}`` as float arrays."""
    mp = mpmath.mp
    with mpmath.workdps(50):
        F = lambda x: [[mp.mpf(float(t)) for t in row] for row in x[0]]   # noqa: E731
        q_, k_, v_, g_, tq, tk, tv = (F(x) for x in (q, k, v, dO) + tuple(tangents[:3]))
        lam = [mp.mpf(float(t)) for t in dlse[0]]
        s = mp.mpf(1) / mp.sqrt(E) if scale is None else mp.mpf(scale)
        sig = None if sinks is None else mp.mpf(float(sinks[0]))
        dsig = None if sinks is None else mp.mpf(float(tangents[4][0]))
        dot = lambda x, y: mp.fsum(a * b for a, b in zip(x, y))        # noqa: E731
        adot = lambda x, y: mp.fsum(abs(a * b) for a, b in zip(x, y))  # noqa: E731
        res = {n: (np.zeros(shape), np.zeros(shape)) for n, shape in (
            ("out", (L, E)), ("lse", (L,)), ("dq", (L, E)), ("dk", (S, E)), ("dv", (S, E)), ("dsinks", (1,)),
            ("jvp", (L, E)))}

        def put(name, idx, val, env):
            res[name][0][idx] += float(val)
            res[name][1][idx] += float(env)

        for i in range(L):
            T = [s * dot(q_[i], k_[j]) for j in range(S)]
            m = max(T + ([] if sig is None else [sig]))
            w = [mp.exp(t - m) for t in T]
            ws = mp.mpf(0) if sig is None else mp.exp(sig - m)
            Z = mp.fsum(w) + ws
            P, ps = [x / Z for x in w], ws / Z
            put("lse", i, m + mp.log(Z), abs(m + mp.log(Z)) + max(s * adot(q_[i], k_[j]) for j in range(S)))
            dP = [dot(g_[i], v_[j]) for j in range(S)]
            D, gmax = mp.fsum(p * d for p, d in zip(P, dP)), max(abs(d) for d in dP)
            dT = [P[j] * (dP[j] - D + lam[i]) for j in range(S)]
            eT = [P[j] * (abs(dP[j]) + gmax + abs(lam[i])) for j in range(S)]     # dT's envelope (|pivot| <= gmax)
            if sig is not None:
                put("dsinks", 0, ps * (-D + lam[i]), ps * (gmax + abs(lam[i])))
            Tt = [s * (dot(tq[i], k_[j]) + dot(q_[i], tk[j])) for j in range(S)]  # the scores' tangent
            eTt = [s * (adot(tq[i], k_[j]) + adot(q_[i], tk[j])) for j in range(S)]
            Ct = mp.fsum(p * t for p, t in zip(P, Tt)) + (0 if sig is None else ps * dsig)
            dPt = [P[j] * (Tt[j] - Ct) for j in range(S)]
            ePt = [P[j] * (eTt[j] + max(eTt) + (0 if sig is None else abs(dsig))) for j in range(S)]
            for e in range(E):
                put("out", (i, e), mp.fsum(P[j] * v_[j][e] for j in range(S)),
                    mp.fsum(P[j] * abs(v_[j][e]) for j in range(S)))
                put("dq", (i, e), s * mp.fsum(dT[j] * k_[j][e] for j in range(S)),
                    s * mp.fsum(eT[j] * abs(k_[j][e]) for j in range(S)))
                put("jvp", (i, e), mp.fsum(dPt[j] * v_[j][e] + P[j] * tv[j][e] for j in range(S)),
                    mp.fsum(ePt[j] * abs(v_[j][e]) + P[j] * abs(tv[j][e]) for j in range(S)))
                for j in range(S):
                    put("dk", (j, e), s * dT[j] * q_[i][e], s * eT[j] * abs(q_[i][e]))
                    put("dv", (j, e), P[j] * g_[i][e], P[j] * abs(g_[i][e]))
    return res


def _run(q, k, v, scale, sinks, dO, dlse, tangents, **how):
    """``{name: array}`` of one engine (``how``: its method and settings), every warning an error."""
    opts = dict(scale=scale, sinks=sinks, **how)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, res = sdpa_forward(q, k, v, **opts)
        g = sdpa_backward(res, dO, grad_lse=dlse)
        _, jv = sdpa_jvp((q, k, v), tangents if sinks is not None else tangents[:3], **opts)
    got = {"out": out[0], "lse": res.lse[0], "dq": g.query[0], "dk": g.key[0], "dv": g.value[0], "jvp": jv[0]}
    if sinks is not None:
        got["dsinks"] = g.sinks
    return got


def _second(q, k, v, scale, sinks, dO, dlse, tangents):
    """The gradients that the double backward (``sdpa_backward_jvp``) returns with their tangent, plain and tiled
    (``{name: array}``, the tiled ones as ``name@tiled``): the first-order part of the second-order schedules
    (along ``v``'s tangent alone, which the gradients do not read: the scores' tangents at ``1e300`` overflow)."""
    opts = dict(scale=scale, sinks=sinks)
    got = {}
    for tag, how in (("", {"method": "plain"}), ("@tiled", {"block_size": 2})):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            g = sdpa_backward_jvp((q, k, v), (None, None, v), dO, grad_lse=dlse, **opts, **how)[0]
        got.update({"dq" + tag: g.query[0], "dk" + tag: g.key[0], "dv" + tag: g.value[0]})
        if sinks is not None:
            got["dsinks" + tag] = g.sinks
    return got


def _assert_within(got, ref, what):
    for name, x in got.items():
        val, env = ref[name.split("@")[0]]
        err = np.abs(x - val)
        bad = ~(err <= ULPS * EPS * env)                          # NaN fails too
        assert not np.any(bad), (f"{what}: {name} off by {np.max(err / np.maximum(env, 1e-300)):.3g} of its "
                                 f"envelope (bound {ULPS * EPS:.3g}); got {x[bad][:3]}, want {val[bad][:3]}")


CASES = [(f, C, s) for C in SCALES for f, s in (("exact", ""), ("exact", "near"), ("exact", "dominant"),
                                                   ("rounded", ""), ("rounded", "dominant"), ("rounded", "low"))]


@pytest.mark.parametrize("family, C, sink", CASES, ids=[f"{f}-{C:.0e}-{s or 'nosink'}" for f, C, s in CASES])
def test_split_engine_against_mpmath_and_the_unsplit_engines_on_large_scores(family, C, sink, monkeypatch):
    """Forward, LSE, backward (with grad_lse) and JVP of the split engine within 16 ulps of their envelopes,
    against mpmath and so within 32 of the unsplit engines; and its backward and JVP are the tiled engine's bit
    for bit at the same block size (its backward recomputes the row's statistics from its own scores)."""
    args = _problem(family, C, sink)
    ref = _oracle(*args)
    for native in ("1", "0"):  # the dense engines: the sink's probability from the closed (m, s), not the rounded LSE
        monkeypatch.setenv("SDPA_REF_NATIVE", native)
        for method in ("fast", "plain"):
            _assert_within(_run(*args, method=method), ref, f"{method} native={native}")
        _assert_within(_second(*args), ref, f"second order native={native}")
    monkeypatch.delenv("SDPA_REF_NATIVE")
    for n, b in SPLITS:
        split = _run(*args, num_splits=n, block_size=b)
        _assert_within(split, ref, f"split n={n} block={b}")
        tiled = _run(*args, block_size=b)
        _assert_within(tiled, ref, f"tiled block={b}")
        for name in ("dq", "dk", "dv", "jvp") + (() if sink == "" else ("dsinks",)):
            assert np.array_equal(split[name], tiled[name]), (name, n, b)


@pytest.mark.parametrize("C", SCALES)
def test_dense_residuals_lse_backward_recomputes_its_own_row_statistics(C):
    """The recomputing backward of dense residuals (save_probs=False, method='lse') walks blocks of rows whose
    shape is not the dense forward's: on rounded scores of C it matches the saved-P backward to rounding."""
    rng = np.random.default_rng(3)
    Lb, Sb = 600, 300                                   # rows cut in blocks of 150: scale q there, k in the forward
    q, k = rng.standard_normal((1, Lb, 3)), rng.standard_normal((1, Sb, 3))
    r = np.sqrt(C / 3.0)
    q, k, v, g = q * r, k * r, rng.standard_normal((1, Sb, 2)), rng.standard_normal((1, Lb, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = sdpa_backward(sdpa_forward(q, k, v)[1], g)
        got = sdpa_backward(sdpa_forward(q, k, v, save_probs=False)[1], g, method="lse")
    for name in ("query", "key", "value"):
        a, b = getattr(got, name), getattr(want, name)
        assert np.all(np.abs(a - b) <= ULPS * EPS * max(np.max(np.abs(b)), np.max(np.abs(v)))), name


def test_no_warning_leaks_from_the_split_engine():
    """Empty splits, fully masked rows, sinks, infinite scores and every policy, under simplefilter('error')."""
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((2, 1, 3, 2)), rng.standard_normal((2, 1, 7, 2)), rng.standard_normal((2, 1, 7, 2))
    mask = rng.random((2, 1, 3, 7)) > 0.6
    mask[0, 0, 1] = False                               # a row with no key
    big = np.array([1e300, -1e300])[:, None, None, None] * np.ones_like(q)
    for policy in ("zero", "nan", "uniform"):
        for extra in ({}, {"sinks": np.array([0.5])}, {"kv_lengths": np.array([0, 4])}, {"softcap": 3.0}):
            for qq in (q, big):
                opts = dict(attn_mask=mask, fully_masked=policy, num_splits=4, block_size=2, **extra)
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    out, res = sdpa_forward(qq, k, v, **opts)
                    sdpa_backward(res, np.ones_like(out), grad_lse=np.ones(out.shape[:-1]))
                    sdpa_jvp((qq, k, v), (q, k, v), **opts)
                    split_kv_partials(qq, k, v, attn_mask=mask, num_splits=4, block_size=2)


@pytest.mark.parametrize("kw, match", [
    (dict(num_splits=10**12), "`num_splits`"),
    (dict(num_splits=2**70), "`num_splits`"),
    (dict(num_splits=np.int64(2**62)), "`num_splits`"),
    (dict(num_splits=np.uint64(2**63)), "`num_splits`"),
    (dict(num_splits=-3), "`num_splits`"),
    (dict(num_splits=3.0), "`num_splits`"),
    (dict(num_splits="3"), "`num_splits`"),
    (dict(num_splits=np.array([3])), "`num_splits`"),
    (dict(split_bounds=np.arange(10**6)), "`split_bounds`"),
])
@pytest.mark.parametrize("entry", ["forward", "partials"])
def test_num_splits_errors_name_the_argument(kw, match, entry):
    """A huge, negative or non-int ``num_splits`` is a ValueError or TypeError naming it, before any allocation
    (``10**12`` splits asked for 7 TiB; ``2**70`` was an OverflowError from NumPy)."""
    x, y = np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 4, 2))
    with pytest.raises((ValueError, TypeError), match=match):
        (sdpa_forward if entry == "forward" else split_kv_partials)(x, y, y, **kw)


# ---------------------------------------------------------------- precision="reproducible": a schedule, and exact


_REPRO_OPTIONS = [
    {},
    dict(is_causal=True, sinks=np.array([0.5, -np.inf, 3.0, -1.0])),
    dict(enable_gqa=True, attn_mask=np.random.default_rng(5).random((6, 9)) < 0.6, kv_lengths=[9, 4],
         fully_masked="zero", softcap=3.0),
    dict(window=(2, 1), is_causal=True, causal_alignment="bottom_right", bias=np.linspace(-1, 1, 54).reshape(6, 9)),
    dict(layout="bshd", dropout_p=0.25, rng=3, alibi_slopes=np.array([0.5, 0.25, 0.1, 0.05])),
]


@pytest.mark.parametrize("opts", _REPRO_OPTIONS)
@pytest.mark.parametrize("splits", [dict(num_splits=3), dict(method="split", split_bounds=[0, 1, 1, 7, 9])])
def test_reproducible_split_is_the_unsplit_result_bit_for_bit(opts, splits):
    """Under precision="reproducible" a split is a schedule and the exact value has none: the output, the LSE,
    every gradient (with the LSE's cotangent) and the JVP are the unsplit ones, bit for bit."""
    rng = np.random.default_rng(11)
    bshd = opts.get("layout") == "bshd"
    Hkv = 2 if opts.get("enable_gqa") else 4
    shape = lambda L, H, E: (2, L, H, E) if bshd else (2, H, L, E)
    q, k, v = rng.uniform(-2, 2, shape(6, 4, 5)), rng.uniform(-2, 2, shape(9, Hkv, 5)), rng.uniform(-2, 2, shape(9, Hkv, 3))
    base_out, base_res = sdpa_forward(q, k, v, precision="reproducible", **opts)
    out, res = sdpa_forward(q, k, v, precision="reproducible", **opts, **splits)
    assert res.method == "reproducible"
    g, g_lse = rng.uniform(-1, 1, out.shape), rng.uniform(-1, 1, res.lse.shape)
    pairs = [(out, base_out), (res.lse, base_res.lse)]
    pairs += zip(sdpa_backward(res, g, grad_lse=g_lse), sdpa_backward(base_res, g, grad_lse=g_lse))
    t = tuple(np.flip(x, axis=-1).copy() for x in (q, k, v))
    pairs.append((sdpa_jvp((q, k, v), t, precision="reproducible", **opts, **splits)[1],
                  sdpa_jvp((q, k, v), t, precision="reproducible", **opts)[1]))
    for a, b in pairs:
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_reproducible_splits_are_validated_and_block_size_refused():
    q, k, v = (np.ones((1, 1, 3, 2)) for _ in range(3))
    with pytest.raises(ValueError, match="`num_splits` should be a positive int"):
        sdpa_forward(q, k, v, precision="reproducible", num_splits=0)
    with pytest.raises(ValueError, match="`split_bounds` should start at 0"):
        sdpa_forward(q, k, v, precision="reproducible", split_bounds=[1, 3])
    with pytest.raises(ValueError, match="`num_splits` or `split_bounds` should be given"):
        sdpa_forward(q, k, v, precision="reproducible", method="split")
    for kw in (dict(method="tiled"), dict(num_splits=2, block_size=2)):
        with pytest.raises(ValueError, match="precision='reproducible'"):
            sdpa_forward(q, k, v, precision="reproducible", **kw)
    with pytest.raises(ValueError, match="`block_size` should be None with precision='reproducible'"):
        split_kv_partials(q, k, v, num_splits=2, block_size=2, precision="reproducible")
    with pytest.raises(ValueError, match="`precision` should be one of"):
        split_kv_partials(q, k, v, num_splits=2, precision="exact")


@pytest.mark.parametrize("is_causal", [False, True])
def test_reproducible_partials_are_faithful_against_mpmath(is_causal):
    """Each part of split_kv_partials(precision="reproducible") within 1 ulp of the attention of its split's keys
    alone in 50-digit mpmath (the loop oracle with the split as a mask), with huge scores and a dominant key;
    a split without a key is (0, -inf); each part is the reproducible engine on those keys, bit for bit."""
    from helpers import assert_faithful
    from oracle import oracle_attention
    rng = np.random.default_rng(3)
    q, k, v = rng.uniform(-2, 2, (1, 2, 4, 3)), rng.uniform(-2, 2, (1, 2, 7, 3)), rng.uniform(-2, 2, (1, 2, 7, 2))
    q[0, 1] *= 1e6                                            # scores of ~1e12 on the second head
    k[0, 0, 2] *= 30.0                                        # a key that dominates its split
    bounds = np.array([0, 3, 3, 7])
    outs, lses = split_kv_partials(q, k, v, split_bounds=bounds, is_causal=is_causal, precision="reproducible")
    assert not np.any(outs[1]) and np.all(np.isneginf(lses[1]))          # the empty split
    for i in range(3):
        keys = (np.arange(7) >= bounds[i]) & (np.arange(7) < bounds[i + 1])
        allowed = keys & (np.tril(np.ones((4, 7), bool)) if is_causal else True)
        if not allowed.any():
            continue
        mask = np.broadcast_to(np.where(allowed, 0.0, -np.inf), (1, 2, 4, 7))
        t_out, t_lse = oracle_attention(q, k, v, mask=mask, num="mp")[:2]
        assert_faithful(outs[i], t_out, f"out part {i}")
        assert_faithful(lses[i], t_lse, f"lse part {i}")
        ref, ref_res = sdpa_forward(q, k, v, attn_mask=np.broadcast_to(allowed, (4, 7)), fully_masked="zero",
                                    precision="reproducible")
        assert outs[i].tobytes() == ref.tobytes() and lses[i].tobytes() == ref_res.lse.tobytes()


def test_reproducible_partials_are_poisoned_where_the_fast_ones_are():
    """A NaN key poisons only the parts that read it, as in the fast partials; the other parts keep their bits
    (those of the same problem without the NaN)."""
    rng = np.random.default_rng(8)
    q, k, v = rng.uniform(-2, 2, (1, 2, 3, 4)), rng.uniform(-2, 2, (1, 2, 8, 4)), rng.uniform(-2, 2, (1, 2, 8, 3))
    bad = k.copy()
    bad[0, 1, 6, 2] = np.nan
    got = split_kv_partials(q, bad, v, num_splits=2, precision="reproducible")
    fast = split_kv_partials(q, bad, v, num_splits=2)
    clean = split_kv_partials(q, k, v, num_splits=2, precision="reproducible")
    for a, f, c in zip(got, fast, clean):
        assert np.array_equal(np.isnan(a), np.isnan(f)) and np.isnan(a).any()
        assert a[~np.isnan(a)].tobytes() == c[~np.isnan(a)].tobytes()
