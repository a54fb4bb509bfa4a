import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdpa_ref import (
    AttentionGrads,
    scaled_dot_product_attention,
    sdpa_backward,
    sdpa_forward,
)
from sdpa_ref.harness.grid import gradcheck_grid as attention_cases
from sdpa_ref.harness.selfcheck import CHECK_RTOL, COMPLEX_RTOL, HVP_RTOL, LSE_RTOL, run_attention_case

from oracle import oracle_attention
from strategies import attention_problem
from tolerances import F64_AMPLIFIED, F64_FEW_ULP, F64_GRAD, F64_REGROUPED, F64_SUMS


def _full(opts, shape):
    m = opts.get("attn_mask")
    return None if m is None else np.broadcast_to(m, shape)


# -------------------------------------------------------------- vs the oracle


@given(attention_problem(), st.sampled_from(["zero", "nan", "uniform"]), st.booleans())
def test_forward_and_grads_match_loop_oracle(problem, policy, dropout):
    q, k, v, opts = problem
    B, Hq, L, _ = q.shape
    S = k.shape[-2]
    rng = np.random.default_rng(1)
    keep = rng.random((B, Hq, L, S)) >= 0.25 if dropout else None
    kw = dict(opts, fully_masked=policy)
    if dropout:
        kw.update(dropout_p=0.25, dropout_mask=keep)
    out, res = sdpa_forward(q, k, v, **kw)
    g = rng.standard_normal(out.shape)
    grads = sdpa_backward(res, g)
    out_ref, lse_ref, (dq, dk, dv, dm) = oracle_attention(
        q, k, v, mask=_full(opts, (B, Hq, L, S)), is_causal=opts["is_causal"], keep=keep,
        p=0.25 if dropout else 0.0, policy=policy, grad_out=g)
    tol = dict(rtol=F64_AMPLIFIED, atol=F64_SUMS)
    np.testing.assert_allclose(out, out_ref, **tol)
    np.testing.assert_allclose(res.lse, lse_ref, **tol)
    np.testing.assert_allclose(grads.value, dv, **tol)
    np.testing.assert_allclose(grads.query, dq, **tol)
    np.testing.assert_allclose(grads.key, dk, **tol)
    m = opts.get("attn_mask")
    if m is not None and m.dtype != bool:
        np.testing.assert_allclose(grads.attn_mask, dm.sum(axis=0, keepdims=True), **tol)
    else:
        assert grads.attn_mask is None


@pytest.mark.parametrize("policy", ["zero", "nan", "uniform"])
def test_fully_masked_row_policies_pinned(policy):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 3, 2)), rng.standard_normal((1, 4, 2)), rng.standard_normal((1, 4, 3))
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False
    out, res = sdpa_forward(q, k, v, mask, fully_masked=policy)
    want = {"zero": np.zeros(3), "nan": np.full(3, np.nan), "uniform": v[0].mean(axis=0)}[policy]
    np.testing.assert_allclose(out[0, 1], want, rtol=F64_FEW_ULP)
    assert res.lse[0, 1] == -np.inf
    assert np.isfinite(out[0, [0, 2]]).all()
    grads = sdpa_backward(res, np.ones_like(out))
    if policy == "nan":
        assert np.isnan(grads.query[0, 1]).all() and np.isnan(grads.key).all()
    else:
        np.testing.assert_array_equal(grads.query[0, 1], 0.0)


def test_float_neg_inf_row_counts_as_fully_masked():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, 2)), rng.standard_normal((4, 2)), rng.standard_normal((4, 2))
    m = np.zeros((3, 4))
    m[2] = -np.inf
    for policy, want in [("zero", 0.0), ("uniform", v.mean(0))]:
        out = scaled_dot_product_attention(q, k, v, m, fully_masked=policy)
        np.testing.assert_allclose(out[2], np.broadcast_to(want, (2,)), rtol=F64_FEW_ULP)
    assert np.isnan(scaled_dot_product_attention(q, k, v, m, fully_masked="nan")[2]).all()


# ------------------------------------------------------- finite differences


@pytest.mark.parametrize("case", attention_cases(quick=False), ids=lambda c: c.name)
def test_gradients_by_finite_differences_and_complex_step(case):
    """Every backward and JVP over the option grid: central differences to 1e-7,
    complex step to 1e-12, the lse backward to 1e-13, <g,Jt> = <J^T g,t> to 1e-12."""
    res = run_attention_case(case)
    assert res.ok, res.detail
    assert res.max_rel_error <= CHECK_RTOL
    assert res.cs_rel_error <= COMPLEX_RTOL
    assert res.lse_rel_error <= LSE_RTOL
    assert res.ip_rel_error <= COMPLEX_RTOL
    assert res.hvp_rel_error <= HVP_RTOL


# ---------------------------------------------------------------- properties


@given(attention_problem())
def test_masked_entries_are_exactly_zero_and_rows_sum_to_one(problem):
    q, k, v, opts = problem
    _, res = sdpa_forward(q, k, v, **opts)
    P = res.probs
    L, S = P.shape[-2:]
    allowed = np.ones(P.shape, dtype=bool)
    m = opts.get("attn_mask")
    if m is not None and m.dtype == bool:
        allowed &= m
    if opts["is_causal"]:
        allowed &= np.tril(np.ones((L, S), dtype=bool))
    assert np.all(P[~allowed] == 0.0)
    nonempty = allowed.any(-1)
    np.testing.assert_allclose(P.sum(-1)[nonempty], 1.0, rtol=F64_SUMS)
    assert np.all(P.sum(-1)[~nonempty] == 0.0)


@given(attention_problem(max_batch=3))
def test_batch_split_does_not_matter(problem):
    q, k, v, opts = problem
    out = scaled_dot_product_attention(q, k, v, **opts)
    m = opts.get("attn_mask")
    parts = []
    for b in range(q.shape[0]):
        o = dict(opts)
        if m is not None:
            o["attn_mask"] = m[b:b + 1] if m.shape[0] > 1 else m
        parts.append(scaled_dot_product_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], **o))
    np.testing.assert_allclose(out, np.concatenate(parts), rtol=F64_REGROUPED, atol=F64_FEW_ULP)


@given(attention_problem(gqa=True))
def test_gqa_equals_explicitly_repeated_heads(problem):
    q, k, v, opts = problem
    G = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    out, res = sdpa_forward(q, k, v, **opts)
    o2 = dict(opts, enable_gqa=False)
    out_r, res_r = sdpa_forward(q, kr, vr, **o2)
    np.testing.assert_allclose(out, out_r, rtol=F64_REGROUPED, atol=F64_FEW_ULP)
    g = np.random.default_rng(0).standard_normal(out.shape)
    a, b = sdpa_backward(res, g), sdpa_backward(res_r, g)
    np.testing.assert_allclose(a.query, b.query, rtol=F64_SUMS, atol=F64_REGROUPED)
    np.testing.assert_allclose(a.key, b.key.reshape(k.shape[:1] + (k.shape[1], G) + k.shape[2:]).sum(2), rtol=F64_SUMS, atol=F64_REGROUPED)
    np.testing.assert_allclose(a.value, b.value.reshape(v.shape[:1] + (v.shape[1], G) + v.shape[2:]).sum(2), rtol=F64_SUMS, atol=F64_REGROUPED)


@given(attention_problem())
def test_bool_mask_equals_float_zero_neg_inf_mask(problem):
    q, k, v, opts = problem
    mb = np.random.default_rng(2).random(q.shape[:-1] + (k.shape[-2],)) < 0.6
    o = {kk: vv for kk, vv in opts.items() if kk != "attn_mask"}
    for policy in ("zero", "nan", "uniform"):
        a = scaled_dot_product_attention(q, k, v, mb, fully_masked=policy, **o)
        b = scaled_dot_product_attention(q, k, v, np.where(mb, 0.0, -np.inf), fully_masked=policy, **o)
        np.testing.assert_array_equal(a, b)


@given(attention_problem(), st.booleans())
def test_flash_identity_D(problem, dropout):
    q, k, v, opts = problem
    if dropout:
        opts = dict(opts, dropout_p=0.4, rng=7)
    out, res = sdpa_forward(q, k, v, **opts)
    g = np.random.default_rng(5).standard_normal(out.shape)
    P = res.probs
    Gr = q.shape[1] // k.shape[1]
    vr = np.repeat(res.v, Gr, axis=-3)
    dP = g @ np.swapaxes(vr, -1, -2)
    if res.keep is not None:
        dP = dP * res.keep / (1 - res.dropout_p)
    np.testing.assert_allclose(np.sum(P * dP, -1), np.sum(g * out, -1), rtol=F64_GRAD, atol=F64_SUMS)


@given(attention_problem(), st.booleans())
def test_inputs_not_mutated(problem, dropout):
    q, k, v, opts = problem
    if dropout:
        opts = dict(opts, dropout_p=0.3, dropout_mask=np.random.default_rng(0).random(q.shape[:-1] + k.shape[-2:-1]) > 0.3)
    copies = [a.copy() for a in (q, k, v)] + [np.copy(x) for x in opts.values() if isinstance(x, np.ndarray)]
    out, res = sdpa_forward(q, k, v, **opts)
    g = np.ones_like(out)
    g0 = g.copy()
    sdpa_backward(res, g)
    after = [q, k, v] + [x for x in opts.values() if isinstance(x, np.ndarray)]
    for a, b in zip(after, copies):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(g, g0)


def test_causal_and_mask_intersect():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    m = rng.random((4, 4)) < 0.5
    m[:, 0] = True
    a = scaled_dot_product_attention(q, k, v, m, is_causal=True)
    b = scaled_dot_product_attention(q, k, v, m & np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(a, b)


def test_causal_is_top_left():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3)), rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    _, res = sdpa_forward(q, k, v, is_causal=True)
    assert (res.probs[0, 0, 1:] == 0).all() and (res.probs[0, 1, 2:] == 0).all() and (res.probs[0, 1, :2] > 0).all()


# ---------------------------------------------------- broadcasting and shapes


def test_leading_batch_broadcast_and_grads_summed_back():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 1, 2, 4, 5))
    k = rng.standard_normal((1, 2, 2, 6, 5))
    v = rng.standard_normal((2, 6, 3))
    m = rng.standard_normal((4, 6))
    out, res = sdpa_forward(q, k, v, m)
    assert out.shape == (3, 2, 2, 4, 3)
    g = rng.standard_normal(out.shape)
    gr = sdpa_backward(res, g)
    assert gr.query.shape == q.shape and gr.key.shape == k.shape and gr.value.shape == v.shape
    assert gr.attn_mask.shape == m.shape
    qb, kb, vb = (np.broadcast_to(a, (3, 2) + a.shape[-3:]) for a in (q, k, v))
    out2, res2 = sdpa_forward(qb.copy(), kb.copy(), vb.copy(), np.broadcast_to(m, (3, 2, 2, 4, 6)).copy())
    g2 = sdpa_backward(res2, g)
    np.testing.assert_allclose(out, out2, rtol=F64_REGROUPED)
    np.testing.assert_allclose(gr.query, g2.query.sum(1, keepdims=True), rtol=F64_GRAD, atol=F64_REGROUPED)
    np.testing.assert_allclose(gr.key, g2.key.sum(0, keepdims=True), rtol=F64_GRAD, atol=F64_REGROUPED)
    np.testing.assert_allclose(gr.value, g2.value.sum((0, 1)), rtol=F64_GRAD, atol=F64_REGROUPED)
    np.testing.assert_allclose(gr.attn_mask, g2.attn_mask.sum((0, 1, 2)), rtol=F64_GRAD, atol=F64_REGROUPED)


def test_a_batch_dim_only_value_has():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 5, 3)), rng.standard_normal((6, 2, 5, 2))
    out, res = sdpa_forward(q, k, v, is_causal=True)
    assert out.shape == (6, 2, 4, 2)
    for b in range(6):
        np.testing.assert_allclose(out[b], sdpa_forward(q, k, v[b], is_causal=True)[0], rtol=F64_FEW_ULP)
    gr = sdpa_backward(res, np.ones(out.shape))
    assert gr.query.shape == q.shape and gr.value.shape == v.shape
    _, dense = sdpa_forward(q, k, v, save_probs=False)
    assert sdpa_backward(dense, np.ones(out.shape)).key.shape == k.shape


def test_rank2_inputs():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 2))
    out, res = sdpa_forward(q, k, v)
    assert out.shape == (3, 2)
    np.testing.assert_allclose(out, sdpa_forward(q[None], k[None], v[None])[0][0], rtol=F64_FEW_ULP)
    gr = sdpa_backward(res, np.ones((3, 2)))
    assert gr.query.shape == (3, 4) and gr.key.shape == (5, 4) and gr.value.shape == (5, 2)


@pytest.mark.parametrize("policy", ["zero", "nan"])
def test_empty_dims(policy):
    z = np.zeros
    # L = 0
    out, res = sdpa_forward(z((2, 0, 3)), z((2, 4, 3)), z((2, 4, 5)), fully_masked=policy)
    assert out.shape == (2, 0, 5)
    gr = sdpa_backward(res, z((2, 0, 5)))
    assert gr.key.shape == (2, 4, 3) and not gr.key.any()
    # S = 0: every row is fully masked and follows the policy
    out, res = sdpa_forward(np.ones((2, 3, 3)), z((2, 0, 3)), z((2, 0, 5)), fully_masked=policy)
    assert out.shape == (2, 3, 5)
    assert (out == 0).all() if policy == "zero" else np.isnan(out).all()
    # zero batch
    out, res = sdpa_forward(z((0, 2, 3, 3)), z((0, 2, 4, 3)), z((0, 2, 4, 5)), fully_masked=policy)
    assert out.shape == (0, 2, 3, 5)
    assert sdpa_backward(res, z(out.shape)).query.shape == (0, 2, 3, 3)
    # E = 0: scores are all 0, so attention is the mean of V
    v = np.arange(8.0).reshape(4, 2)
    np.testing.assert_allclose(scaled_dot_product_attention(z((3, 0)), z((4, 0)), v), np.tile(v.mean(0), (3, 1)))


def test_uniform_with_no_keys_is_an_error():
    with pytest.raises(ValueError, match="fully_masked"):
        sdpa_forward(np.ones((3, 3)), np.zeros((0, 3)), np.zeros((0, 5)), fully_masked="uniform")


# ------------------------------------------------------------ dtypes, dropout


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("upcast", [True, False])
def test_dtypes(dtype, upcast):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in [(2, 3, 4), (2, 5, 4), (2, 5, 2)])
    out, res = sdpa_forward(q, k, v, upcast=upcast)
    assert out.dtype == dtype
    assert res.probs.dtype == (np.float64 if upcast else dtype)
    gr = sdpa_backward(res, np.ones(out.shape, dtype))
    assert gr.query.dtype == gr.key.dtype == gr.value.dtype == dtype
    ref = scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    if upcast:   # float64 arithmetic, rounded once at the end
        np.testing.assert_array_equal(out, ref.astype(dtype))
    else:
        tol = {np.float16: 5e-3, np.float32: 1e-6, np.float64: 1e-15}[dtype]
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


def test_dropout_rng_seed_is_reproducible_and_kept():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 7, 4)), rng.standard_normal((2, 7, 3))
    a, ra = sdpa_forward(q, k, v, dropout_p=0.5, rng=11)
    b, rb = sdpa_forward(q, k, v, dropout_p=0.5, rng=np.random.default_rng(11))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ra.dropout_mask, rb.dropout_mask)
    # replay with the kept mask gives the same output
    c = scaled_dot_product_attention(q, k, v, dropout_p=0.5, dropout_mask=ra.dropout_mask)
    np.testing.assert_array_equal(a, c)
    # the output is scaled by 1/(1-p)
    P = ra.probs
    want = (P * ra.dropout_mask / 0.5) @ v
    np.testing.assert_allclose(a, want, rtol=F64_REGROUPED)
    frac = ra.dropout_mask.mean()
    assert 0.35 < frac < 0.65    # 84 draws, p=0.5: 3.3 sigma each side


def test_attention_grads_is_a_named_tuple():
    rng = np.random.default_rng(0)
    out, res = sdpa_forward(rng.standard_normal((2, 3)), rng.standard_normal((2, 3)), rng.standard_normal((2, 3)))
    gr = sdpa_backward(res, np.ones((2, 3)))
    assert isinstance(gr, AttentionGrads) and gr._fields == ("query", "key", "value", "attn_mask", "bias", "sinks")
    dq, dk, dv, dm, db, ds = gr
    assert dm is None and db is None and ds is None
