"""Beyond PyTorch: bias, alignment, windows, softcap, ALiBi, lengths, LSE backward, JVP."""

import numpy as np
import pytest
import scipy.special as sp
from hypothesis import given
from hypothesis import strategies as st

from sdpa_ref import (
    alibi_bias,
    alibi_slopes,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
    sdpa_backward,
    sdpa_forward,
    sdpa_forward_complex,
    sdpa_jvp,
    window_mask,
)

from oracle import oracle_attention
from strategies import variant_problem
from tolerances import (
    BIG_NEGATIVE_MASK, F32, F64_AMPLIFIED, F64_FEW_ULP, F64_REGROUPED, F64_SUMS, SOFTCAP_LIMIT, SOFTCAP_LIMIT_ATOL,
    SOFTCAP_LIMIT_GRAD,
)

TOL = dict(rtol=F64_AMPLIFIED, atol=F64_SUMS)


def _grads(res, g, method="probs"):
    return sdpa_backward(res, g, method=method)


# -------------------------------------------------------------- vs the oracle


@given(variant_problem())
def test_every_option_matches_the_loop_oracle(problem):
    q, k, v, opts, oracle = problem
    out, res = sdpa_forward(q, k, v, **opts)
    g = np.random.default_rng(0).standard_normal(out.shape)
    gr = _grads(res, g)
    out_ref, lse_ref, (dq, dk, dv, dT) = oracle_attention(q, k, v, grad_out=g, **oracle)
    np.testing.assert_allclose(out, out_ref, **TOL)
    np.testing.assert_allclose(res.lse, lse_ref, **TOL)
    np.testing.assert_allclose(gr.query, dq, **TOL)
    np.testing.assert_allclose(gr.key, dk, **TOL)
    np.testing.assert_allclose(gr.value, dv, **TOL)
    if "bias" in opts:
        np.testing.assert_allclose(gr.bias, dT.sum(axis=0), **TOL)
    else:
        assert gr.bias is None
    # return_lse of the drop-in
    o2, lse2 = scaled_dot_product_attention(q, k, v, return_lse=True, **opts)
    np.testing.assert_array_equal(o2, out)
    np.testing.assert_array_equal(lse2, res.lse)


@given(variant_problem())
def test_lse_backward_equals_probs_backward(problem):
    q, k, v, opts, _ = problem
    out, res = sdpa_forward(q, k, v, **opts)
    g = np.random.default_rng(1).standard_normal(out.shape)
    a, b = _grads(res, g), _grads(res, g, "lse")
    _, res_light = sdpa_forward(q, k, v, **dict(opts, save_probs=False))
    assert res_light.probs is None
    c = _grads(res_light, g, "lse")
    for x, y, z in zip(a, b, c):
        if x is None:
            assert y is None and z is None
            continue
        np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
        scale = max(1.0, float(np.nanmax(np.abs(x), initial=0.0)))
        np.testing.assert_allclose(x, y, rtol=F64_SUMS, atol=F64_SUMS * scale)
        np.testing.assert_array_equal(y, z)


@pytest.mark.parametrize("engine", [{}, {"block_size": 2}], ids=["fast", "tiled-2"])
@given(problem=variant_problem())
def test_jvp_vjp_inner_product_identity(problem, engine):
    q, k, v, opts, _ = problem
    if opts["fully_masked"] == "nan":
        opts = dict(opts, fully_masked="zero")
    rng = np.random.default_rng(2)
    ts = [rng.standard_normal(a.shape) for a in (q, k, v)]
    if "bias" in opts:
        ts.append(rng.standard_normal(opts["bias"].shape))
    out, dout = sdpa_jvp((q, k, v), tuple(ts), **engine, **opts)
    g = rng.standard_normal(out.shape)
    gr = _grads(sdpa_forward(q, k, v, **opts)[1], g)
    lhs = np.sum(g * dout)
    rhs = sum(np.sum(a * t) for a, t in zip([gr.query, gr.key, gr.value] + ([gr.bias] if "bias" in opts else []), ts))
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs) + abs(rhs))


def test_jvp_matches_the_complex_step_directly():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 2))
    b = rng.standard_normal((3, 5))
    opts = dict(softcap=1.3, is_causal=True, causal_alignment="bottom_right", alibi_slopes=np.array([0.3, 0.7]))
    ts = [rng.standard_normal(a.shape) for a in (q, k, v, b)]
    _, dout = sdpa_jvp((q, k, v), tuple(ts), bias=b, **opts)
    _, dout_tiled = sdpa_jvp((q, k, v), tuple(ts), bias=b, block_size=2, **opts)
    h = 1e-30
    cs = sdpa_forward_complex(q + 1j * h * ts[0], k + 1j * h * ts[1], v + 1j * h * ts[2], bias=b + 1j * h * ts[3],
                              **opts).imag / h
    np.testing.assert_allclose(dout, cs, rtol=F64_SUMS, atol=F64_FEW_ULP)
    np.testing.assert_allclose(dout_tiled, cs, rtol=F64_SUMS, atol=F64_FEW_ULP)
    np.testing.assert_allclose(sdpa_forward_complex(q, k, v, bias=b, **opts).real,
                               sdpa_forward(q, k, v, bias=b, **opts)[0], rtol=F64_FEW_ULP, atol=F64_FEW_ULP)


def test_jvp_with_none_tangents_and_shapes():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, 2)), rng.standard_normal((4, 2)), rng.standard_normal((4, 3))
    out, d = sdpa_jvp((q, k, v), (None, None, None))
    assert d.shape == out.shape and not d.any()
    _, d_v = sdpa_jvp((q, k, v), (None, None, v))
    np.testing.assert_allclose(d_v, out, rtol=F64_REGROUPED)          # attention is linear in V
    with pytest.raises(ValueError, match="tangents"):
        sdpa_jvp((q, k, v), (q[:1], None, None))
    with pytest.raises(ValueError, match="bias"):
        sdpa_jvp((q, k, v), (None, None, None, np.ones((3, 4))))
    with pytest.raises(TypeError, match="primals"):
        sdpa_jvp(q, (None, None, None))


# ---------------------------------------------------------------- properties


@given(variant_problem(), st.booleans())
def test_bottom_right_equals_top_left_when_L_equals_S(problem, _):
    q, k, v, opts, _o = problem
    L = q.shape[-2]
    reps = -(-L // k.shape[-2]) if k.shape[-2] else 0      # S made equal to L on every draw (no early return)
    if reps == 0:
        k, v = np.zeros(k.shape[:-2] + (L, k.shape[-1])), np.zeros(v.shape[:-2] + (L, v.shape[-1]))
    k, v = (np.concatenate([a] * max(reps, 1), axis=-2)[..., :L, :] for a in (k, v))
    assert k.shape[-2] == L
    opts = {kk: vv for kk, vv in opts.items() if kk not in ("attn_mask", "bias", "dropout_mask", "dropout_p",
                                                          "q_lengths", "kv_lengths")}
    a = scaled_dot_product_attention(q, k, v, **dict(opts, causal_alignment="top_left"))
    b = scaled_dot_product_attention(q, k, v, **dict(opts, causal_alignment="bottom_right"))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(3, 5), (5, 3), (4, 4)])
def test_window_none_zero_equals_causal(alignment, L, S):
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, L, 3)), rng.standard_normal((2, S, 3)), rng.standard_normal((2, S, 2))
    a = scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment=alignment)
    b = scaled_dot_product_attention(q, k, v, window=(None, 0), causal_alignment=alignment)
    c = scaled_dot_product_attention(q, k, v, window=(-1, 0), causal_alignment=alignment)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(causal_mask(L, S, alignment), window_mask(L, S, None, 0, alignment))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_a_window_covering_everything_equals_no_mask(alignment):
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 2))
    a = scaled_dot_product_attention(q, k, v)
    for w in [(10, 10), (None, None), (-1, -1), (6, 6)]:
        np.testing.assert_array_equal(scaled_dot_product_attention(q, k, v, window=w, causal_alignment=alignment), a)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("slope_shape", ["heads", "batch_heads"])
def test_alibi_slopes_equal_alibi_bias_as_bias(alignment, slope_shape):
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 2))
    slopes = alibi_slopes(3) if slope_shape == "heads" else rng.random((2, 3))
    out_a, res_a = sdpa_forward(q, k, v, alibi_slopes=slopes, causal_alignment=alignment, is_causal=True)
    out_b, res_b = sdpa_forward(q, k, v, bias=alibi_bias(slopes, 4, 6, alignment), causal_alignment=alignment,
                                is_causal=True)
    np.testing.assert_allclose(out_a, out_b, rtol=F64_REGROUPED, atol=F64_FEW_ULP)
    g = rng.standard_normal(out_a.shape)
    for x, y in zip(_grads(res_a, g)[:3], _grads(res_b, g)[:3]):
        np.testing.assert_allclose(x, y, rtol=F64_SUMS, atol=F64_REGROUPED)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_lengths_equal_an_explicit_padding_mask(alignment):
    rng = np.random.default_rng(8)
    B, H, L, S = 3, 2, 5, 6
    q, k, v = rng.standard_normal((B, H, L, 4)), rng.standard_normal((B, H, S, 4)), rng.standard_normal((B, H, S, 3))
    ql, kl = np.array([5, 2, 4]), np.array([6, 3, 1])
    out_len, res_len = sdpa_forward(q, k, v, q_lengths=ql, kv_lengths=kl)
    pm = padding_mask(ql, kl, L, S)
    assert pm.shape == (B, 1, L, S)
    out_pm, res_pm = sdpa_forward(q, k, v, attn_mask=pm)
    np.testing.assert_array_equal(out_len, out_pm)
    g = rng.standard_normal(out_len.shape)
    for x, y in zip(_grads(res_len, g)[:3], _grads(res_pm, g)[:3]):
        np.testing.assert_array_equal(x, y)
    # padded query rows are zeroed in the output and every gradient
    assert not out_len[1, :, 2:].any() and not _grads(res_len, g).query[1, :, 2:].any()
    # with causal, bottom-right uses the per-batch lengths: off = kv_len - q_len
    _, res = sdpa_forward(q, k, v, q_lengths=ql, kv_lengths=kl, is_causal=True, causal_alignment="bottom_right")
    P = res.probs
    for b in range(B):
        off = kl[b] - ql[b]
        for i in range(ql[b]):
            allowed = [j for j in range(S) if j <= i + off and j < kl[b]]
            assert set(np.nonzero(P[b, 0, i])[0]) == set(allowed)


def test_padded_rows_are_zero_under_every_policy():
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((2, 1, 3, 2)), rng.standard_normal((2, 1, 4, 2)), rng.standard_normal((2, 1, 4, 2))
    for policy in ("zero", "nan", "uniform"):
        out = scaled_dot_product_attention(q, k, v, q_lengths=np.array([1, 3]), kv_lengths=np.array([0, 4]),
                                           fully_masked=policy)
        assert not out[0, 0, 1:].any()                      # padded rows: zero whatever the policy
        want = {"zero": 0.0, "uniform": v[0, 0].mean(0)}.get(policy)
        if want is None:
            assert np.isnan(out[0, 0, 0]).all()             # row 0 has no key (kv_len 0): the policy
        else:
            np.testing.assert_allclose(out[0, 0, 0], np.broadcast_to(want, (2,)), rtol=F64_FEW_ULP)


def test_softcap_with_a_huge_cap_approaches_no_softcap():
    rng = np.random.default_rng(10)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 5, 2))
    a, ra = sdpa_forward(q, k, v)
    b, rb = sdpa_forward(q, k, v, softcap=1e6)
    np.testing.assert_allclose(a, b, rtol=SOFTCAP_LIMIT, atol=SOFTCAP_LIMIT_ATOL)
    g = rng.standard_normal(a.shape)
    np.testing.assert_allclose(_grads(ra, g).query, _grads(rb, g).query, rtol=SOFTCAP_LIMIT_GRAD, atol=SOFTCAP_LIMIT)
    # and a small cap does bound the scores
    _, rc = sdpa_forward(q * 100, k, v, softcap=2.0)
    assert np.all(np.abs(np.log(rc.probs)) < 2 * 2.0 + np.log(5))


def test_bias_with_a_bool_mask_together():
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    m = rng.random((4, 5)) < 0.6
    m[:, 0] = True
    b = rng.standard_normal((4, 5))
    a = scaled_dot_product_attention(q, k, v, m, bias=b)
    c = scaled_dot_product_attention(q, k, v, np.where(m, b, -np.inf))
    np.testing.assert_allclose(a, c, rtol=F64_FEW_ULP)


# ------------------------------------------- known discrepancies, pinned


def test_causal_alignment_rows_written_out():
    tl, br = causal_mask(2, 3, "top_left"), causal_mask(2, 3, "bottom_right")
    assert tl.astype(int).tolist() == [[1, 0, 0], [1, 1, 0]]          # PyTorch, JAX
    assert br.astype(int).tolist() == [[1, 1, 0], [1, 1, 1]]          # FlashAttention, xformers
    tl, br = causal_mask(3, 2, "top_left"), causal_mask(3, 2, "bottom_right")
    assert tl.astype(int).tolist() == [[1, 0], [1, 1], [1, 1]]
    assert br.astype(int).tolist() == [[0, 0], [1, 0], [1, 1]]        # row 0 sees no key
    rng = np.random.default_rng(12)
    q, k, v = rng.standard_normal((3, 2)), rng.standard_normal((2, 2)), rng.standard_normal((2, 2))
    out = {p: scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="bottom_right", fully_masked=p)
           for p in ("zero", "nan", "uniform")}
    np.testing.assert_array_equal(out["zero"][0], [0.0, 0.0])
    assert np.isnan(out["nan"][0]).all()
    np.testing.assert_allclose(out["uniform"][0], v.mean(0), rtol=F64_FEW_ULP)
    for p in out:                                 # the rows that see a key agree across policies
        np.testing.assert_array_equal(out[p][1:], out["zero"][1:])
    np.testing.assert_allclose(out["zero"][2], sp.softmax(q[2] @ k.T / np.sqrt(2)) @ v, rtol=F64_REGROUPED)
    # L < S: the same query row reads different keys in the two alignments
    q2 = rng.standard_normal((2, 2))
    k3, v3 = rng.standard_normal((3, 2)), rng.standard_normal((3, 2))
    tl_out = scaled_dot_product_attention(q2, k3, v3, is_causal=True)
    br_out = scaled_dot_product_attention(q2, k3, v3, is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_allclose(tl_out[0], v3[0], rtol=F64_FEW_ULP)          # top-left row 0 sees key 0 only
    np.testing.assert_allclose(br_out[0], sp.softmax(q2[0] @ k3[:2].T / np.sqrt(2)) @ v3[:2], rtol=F64_REGROUPED)


def test_bool_mask_against_minus_1e9_float_mask_on_a_fully_masked_row():
    rng = np.random.default_rng(13)
    q, k, v = rng.standard_normal((3, 2)), rng.standard_normal((4, 2)), rng.standard_normal((4, 3))
    m = np.ones((3, 4), dtype=bool)
    m[1] = False
    trick_mask = np.where(m, 0.0, -1e9)
    exact = scaled_dot_product_attention(q, k, v, m)
    np.testing.assert_array_equal(exact[1], 0.0)                       # exact masking: the "zero" policy
    # float64: softmax is shift-invariant and 1e9 + s keeps s to ~1e-7, so the
    # "masked" row silently attends to every key as if there were no mask
    trick64 = scaled_dot_product_attention(q, k, v, trick_mask)
    unmasked = sp.softmax(q[1] @ k.T / np.sqrt(2)) @ v
    np.testing.assert_allclose(trick64[1], unmasked, rtol=BIG_NEGATIVE_MASK)
    assert np.abs(trick64[1] - v.mean(0)).max() > 0.1
    # float32 arithmetic: the scores are absorbed into -1e9, so the row is the mean of V,
    # which is the JAX-style "uniform" policy
    f32 = [a.astype(np.float32) for a in (q, k, v, trick_mask)]
    trick32 = scaled_dot_product_attention(*f32, upcast=False)
    np.testing.assert_allclose(trick32[1], v.mean(0), rtol=F32)
    np.testing.assert_allclose(scaled_dot_product_attention(q, k, v, m, fully_masked="uniform")[1], v.mean(0),
                               rtol=F64_FEW_ULP)
    # elsewhere all of them agree
    np.testing.assert_allclose(exact[[0, 2]], trick64[[0, 2]], rtol=F64_AMPLIFIED)


# ------------------------------------------------------------ mask builders


def test_alibi_slopes_standard_values():
    np.testing.assert_allclose(alibi_slopes(8), 2.0 ** -np.arange(1, 9), rtol=F64_FEW_ULP)
    np.testing.assert_allclose(alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3], rtol=F64_FEW_ULP)
    np.testing.assert_allclose(alibi_slopes(12)[:8], 2.0 ** -np.arange(1, 9), rtol=F64_FEW_ULP)
    np.testing.assert_allclose(alibi_slopes(12)[8:], 2.0 ** -(np.arange(4) + 0.5), rtol=F64_FEW_ULP)
    assert alibi_slopes(1).tolist() == [2.0 ** -8]


def test_window_mask_and_alibi_bias_values():
    assert window_mask(3, 3, 1, 0).astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    assert window_mask(2, 4, 0, 1, "bottom_right").astype(int).tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    np.testing.assert_array_equal(alibi_bias([1.0], 2, 3, "bottom_right")[0], [[-1, 0, -1], [-2, -1, 0]])


# ------------------------------------------------------------------ bad input

rng = np.random.default_rng(14)
Q, K, Vv = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 2))
BAD = [
    ("negative window", dict(window=(-2, 1)), ValueError, "window"),
    ("window not a pair", dict(window=3), TypeError, "window"),
    ("window float", dict(window=(1.5, 1)), TypeError, "window"),
    ("q_lengths above L", dict(q_lengths=np.array([5, 1])), ValueError, "q_lengths"),
    ("kv_lengths above S", dict(kv_lengths=np.array([7, 1])), ValueError, "kv_lengths"),
    ("negative lengths", dict(kv_lengths=np.array([-1, 1])), ValueError, "kv_lengths"),
    ("lengths shape", dict(q_lengths=np.array([1, 2, 3])), ValueError, "q_lengths"),
    ("float lengths", dict(q_lengths=np.array([1.0, 2.0])), TypeError, "q_lengths"),
    ("slopes shape", dict(alibi_slopes=np.ones(4)), ValueError, "alibi_slopes"),
    ("slopes batch", dict(alibi_slopes=np.ones((3, 3))), ValueError, "alibi_slopes"),
    ("softcap zero", dict(softcap=0.0), ValueError, "softcap"),
    ("softcap negative", dict(softcap=-1.0), ValueError, "softcap"),
    ("bool bias", dict(bias=np.ones((4, 6), dtype=bool)), TypeError, "bias"),
    ("bias shape", dict(bias=np.ones((4, 5))), ValueError, "bias"),
    ("unknown alignment", dict(causal_alignment="bottom_left"), ValueError, "causal_alignment"),
]


@pytest.mark.parametrize("desc,kw,exc,name", BAD, ids=[b[0] for b in BAD])
def test_bad_variant_input(desc, kw, exc, name):
    with pytest.raises(exc) as info:
        sdpa_forward(Q, K, Vv, **kw)
    assert f"`{name}`" in str(info.value) and "got" in str(info.value)


def test_unknown_method_and_probs_not_saved():
    out, res = sdpa_forward(Q, K, Vv)
    with pytest.raises(ValueError, match="`method`"):
        sdpa_backward(res, np.ones(out.shape), method="flash")
    _, light = sdpa_forward(Q, K, Vv, save_probs=False)
    for m in ("probs", "plain"):
        with pytest.raises(ValueError, match="`method`"):
            sdpa_backward(light, np.ones(out.shape), method=m)
    # without P the default is the lse backward
    a = sdpa_backward(light, np.ones(out.shape))
    b = sdpa_backward(res, np.ones(out.shape), method="lse")
    np.testing.assert_array_equal(a.query, b.query)
    with pytest.raises(ValueError, match="`method`"):
        sdpa_forward(Q, K, Vv, method="quick")


def test_padding_mask_bad_lengths_name_the_argument():
    for bad, exc in (([3, 1], ValueError), ([1.0, 2.0], TypeError), ([-1, 1], ValueError)):
        with pytest.raises(exc, match="`q_lengths`"):
            padding_mask(bad, [2, 3], 2, 3)
    with pytest.raises(ValueError, match="`kv_lengths`"):
        padding_mask([1, 2], [4, 1], 2, 3)
