"""Score and mask functions (FlexAttention's score_mod and mask_mod): the built-in options written as functions give
the same bits as the options in every engine, forward, backward and JVP; captured tensors get their gradient;
derivatives are checked; bad functions are clear errors."""

import numpy as np
import pytest

from sdpa_ref import (
    ScoreMod,
    ScoreModGrads,
    assert_vjp,
    check_score_mod,
    sdpa_backward,
    sdpa_forward,
    sdpa_hvp,
    sdpa_jvp,
)
from tolerances import F64_AMPLIFIED, F64_GRAD, F64_REGROUPED, F64_SUMS, FD_LOOSE

METHODS = [dict(method="plain"), dict(method="fast"), dict(method="tiled", block_size=2),
           dict(method="split", num_splits=2)]
B, HQ, HKV, L, S, E, EV = 2, 4, 2, 5, 6, 3, 2
CAP = 1.5


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, HQ, L, E)), rng.standard_normal((B, HKV, S, E)),
            rng.standard_normal((B, HKV, S, EV)))


def softcap_fn(score, b, h, i, j):
    return CAP * np.tanh(score / CAP)


def softcap_grad(score, b, h, i, j):
    r = 1 / np.cosh(score / CAP)                 # as the built-in computes sech^2: no cancellation
    return r * r


SLOPES = np.array([0.25, 0.0625, 0.015625, 0.00390625])


def alibi_fn(score, b, h, i, j):
    return score - SLOPES[h] * np.abs(i - j).astype(float)


def ones(score, *indices_and_params):
    return np.ones_like(score)


TABLE = np.random.default_rng(5).standard_normal((HQ, L + S - 1))


def relpos_fn(score, b, h, i, j, table):
    return score + table[h, i - j + S - 1]


def relpos_vjp(g, score, b, h, i, j, table):
    out = np.zeros_like(table)
    hh, rr = np.broadcast_arrays(h, i - j + S - 1, g)[:2]
    np.add.at(out, (hh, rr), g)
    return (out,)


def _relpos_bias():
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    return TABLE[:, i - j + S - 1]                                   # (Hq, L, S)


BUILT_IN = {
    "softcap": (dict(softcap=CAP), dict(score_mod=ScoreMod(softcap_fn, grad=softcap_grad))),
    "alibi": (dict(alibi_slopes=SLOPES), dict(score_mod=ScoreMod(alibi_fn, grad=ones))),
    "relative-position bias": (dict(bias=_relpos_bias()),
                               dict(score_mod=ScoreMod(relpos_fn, grad=ones, params=(TABLE,), params_vjp=relpos_vjp))),
    "causal": (dict(is_causal=True), dict(mask_mod=lambda b, h, i, j: j <= i)),
    "sliding window": (dict(window=(2, 1)), dict(mask_mod=lambda b, h, i, j: (i - j <= 2) & (j - i <= 1))),
    "softcap+causal": (dict(softcap=CAP, is_causal=True),
                       dict(score_mod=ScoreMod(softcap_fn, grad=softcap_grad), mask_mod=lambda b, h, i, j: j <= i)),
}


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m["method"])
@pytest.mark.parametrize("name", BUILT_IN)
def test_built_in_options_as_functions_give_the_same_bits(name, method):
    q, k, v = _inputs()
    built, mod = BUILT_IN[name]
    common = dict(enable_gqa=True, **method)
    o1, r1 = sdpa_forward(q, k, v, **built, **common)
    o2, r2 = sdpa_forward(q, k, v, **mod, **common)
    assert np.array_equal(o1, o2) and np.array_equal(r1.lse, r2.lse)
    g = np.random.default_rng(1).standard_normal(o1.shape)
    g1, g2 = sdpa_backward(r1, g), sdpa_backward(r2, g)
    for n in ("query", "key", "value"):
        assert np.array_equal(getattr(g1, n), getattr(g2, n)), n
    t = tuple(np.random.default_rng(2).standard_normal(x.shape) for x in (q, k, v))
    assert np.array_equal(sdpa_jvp((q, k, v), t, **built, **common)[1], sdpa_jvp((q, k, v), t, **mod, **common)[1])
    if name == "relative-position bias":                 # the table's gradient is the bias's, gathered
        assert isinstance(g2, ScoreModGrads)
        i, j = np.arange(L)[:, None], np.arange(S)[None, :]
        want = np.zeros_like(TABLE)
        np.add.at(want, (np.arange(HQ)[:, None, None], np.broadcast_to(i - j + S - 1, (HQ, L, S))), g1.bias)
        np.testing.assert_allclose(g2.score_mod[0], want, rtol=F64_SUMS, atol=F64_REGROUPED)


def test_document_mask_as_a_mask_function():
    q, k, v = _inputs(3)
    doc_q, doc_k = np.array([0, 0, 1, 1, 2]), np.array([0, 0, 0, 1, 2, 2])
    mask = doc_q[:, None] == doc_k[None, :]
    for m in METHODS:
        o1, r1 = sdpa_forward(q, k, v, attn_mask=mask, enable_gqa=True, **m)
        o2, r2 = sdpa_forward(q, k, v, mask_mod=lambda b, h, i, j: doc_q[i] == doc_k[j], enable_gqa=True, **m)
        assert np.array_equal(o1, o2)
        g = np.ones_like(o1)
        for a, b in zip(sdpa_backward(r1, g)[:3], sdpa_backward(r2, g)[:3]):
            assert np.array_equal(a, b)


def test_a_mask_function_that_varies_with_batch_and_head():
    q, k, v = _inputs(4)
    mm = lambda b, h, i, j: (j <= i + b) & ((h % 2 == 0) | (j >= 1))       # noqa: E731
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    b, h = np.arange(B)[:, None, None, None], np.arange(HQ)[:, None, None]
    mask = np.broadcast_to(mm(b, h, i, j), (B, HQ, L, S))
    o1, _ = sdpa_forward(q, k, v, attn_mask=mask, enable_gqa=True)
    for m in METHODS:
        o2, _ = sdpa_forward(q, k, v, mask_mod=mm, enable_gqa=True, **m)
        np.testing.assert_allclose(o2, o1, rtol=F64_SUMS, atol=F64_REGROUPED)


def test_complex_step_slope_and_param_gradient_agree_with_the_given_ones():
    q, k, v = _inputs(6)
    plain = ScoreMod(relpos_fn, params=(TABLE,))
    given = ScoreMod(relpos_fn, grad=ones, params=(TABLE,), params_vjp=relpos_vjp)
    for m in METHODS[:3]:
        o1, r1 = sdpa_forward(q, k, v, score_mod=plain, enable_gqa=True, **m)
        o2, r2 = sdpa_forward(q, k, v, score_mod=given, enable_gqa=True, **m)
        g = np.random.default_rng(7).standard_normal(o1.shape)
        a, b = sdpa_backward(r1, g), sdpa_backward(r2, g)
        for x, y in zip(a, b):
            if x is not None:
                np.testing.assert_allclose(x if not isinstance(x, tuple) else x[0],
                                           y if not isinstance(y, tuple) else y[0], rtol=F64_GRAD, atol=F64_SUMS)


@pytest.mark.parametrize("method", METHODS[:3], ids=lambda m: m["method"])
def test_gradients_through_a_score_function_match_finite_differences(method):
    """A score function with a curved part and a captured tensor: every gradient, the table's included."""
    q, k, v = (x[:1] for x in _inputs(8))

    def fn(score, b, h, i, j, w):
        return np.sin(score) * w[h] + 0.1 * score ** 2

    def fun(q, k, v, w):
        return sdpa_forward(q, k, v, score_mod=ScoreMod(fn, params=(w,)), is_causal=True, enable_gqa=True,
                            **method)[0]

    def vjp(g, q, k, v, w):
        r = sdpa_backward(sdpa_forward(q, k, v, score_mod=ScoreMod(fn, params=(w,)), is_causal=True,
                                       enable_gqa=True, **method)[1], g)
        return r.query, r.key, r.value, r.score_mod[0]

    w = np.array([0.5, 1.0, -1.5, 2.0])
    assert_vjp(fun, vjp, (q, k, v, w), rtol=FD_LOOSE)


def test_a_function_that_is_not_analytic_needs_its_grad():
    q, k, v = _inputs(9)
    with pytest.raises(ValueError, match="not analytic"):
        sdpa_forward(q, k, v, enable_gqa=True, score_mod=lambda s, b, h, i, j: np.abs(s))
    out, _ = sdpa_forward(q, k, v, enable_gqa=True,
                          score_mod=ScoreMod(lambda s, b, h, i, j: np.abs(s), grad=lambda s, b, h, i, j: np.sign(s)))
    assert np.isfinite(out).all()


def test_check_score_mod_catches_a_wrong_derivative_and_passes_the_right_one():
    assert check_score_mod(ScoreMod(softcap_fn, grad=softcap_grad)).ok
    assert check_score_mod(softcap_fn).ok                               # the complex step
    assert not check_score_mod(ScoreMod(softcap_fn, grad=lambda s, b, h, i, j: 1 - np.tanh(s) ** 2)).ok
    assert check_score_mod(ScoreMod(relpos_fn, grad=ones, params=(TABLE,), params_vjp=relpos_vjp),
                           shape=(1, HQ, L, S)).ok
    wrong = lambda g, s, b, h, i, j, t: (2 * relpos_vjp(g, s, b, h, i, j, t)[0],)   # noqa: E731
    assert not check_score_mod(ScoreMod(relpos_fn, grad=ones, params=(TABLE,), params_vjp=wrong),
                               shape=(1, HQ, L, S)).ok


def test_bad_functions_are_clear_errors():
    q, k, v = _inputs()
    kw = dict(enable_gqa=True)
    with pytest.raises(TypeError, match="`mask_mod` should return bool"):
        sdpa_forward(q, k, v, mask_mod=lambda b, h, i, j: (j <= i).astype(int), **kw)
    with pytest.raises(ValueError, match="`mask_mod` should return a bool array broadcastable"):
        sdpa_forward(q, k, v, mask_mod=lambda b, h, i, j: np.ones((3, 3), bool), **kw)
    with pytest.raises(TypeError, match="`mask_mod` should be a callable"):
        sdpa_forward(q, k, v, mask_mod=np.ones((L, S), bool), **kw)
    with pytest.raises(TypeError, match="`score_mod` should be a callable"):
        sdpa_forward(q, k, v, score_mod=3.0, **kw)

    def writes(score, b, h, i, j):
        score += 1
        return score
    with pytest.raises(ValueError, match="should not write into its `score`"):
        sdpa_forward(q, k, v, score_mod=writes, **kw)
    with pytest.raises(ValueError, match="broadcastable to the scores' block"):
        sdpa_forward(q, k, v, score_mod=lambda s, b, h, i, j: s[..., :2], **kw)
    with pytest.raises(ValueError, match="precision='reproducible'"):
        sdpa_forward(q, k, v, score_mod=softcap_fn, precision="reproducible", **kw)
    with pytest.raises(ValueError, match="should have its derivative for second order"):
        sdpa_hvp((q, k, v), (q, None, None), np.ones((B, HQ, L, EV)), score_mod=softcap_fn, **kw)
    with pytest.raises(ValueError, match="should be finite"):
        ScoreMod(relpos_fn, params=(np.array([np.nan]),))


def test_mask_function_with_reproducible_precision():
    q, k, v = _inputs(10)
    o1, _ = sdpa_forward(q, k, v, is_causal=True, enable_gqa=True, precision="reproducible")
    o2, _ = sdpa_forward(q, k, v, mask_mod=lambda b, h, i, j: j <= i, enable_gqa=True, precision="reproducible")
    assert np.array_equal(o1, o2)


def test_poisoned_input_with_a_score_function():
    q, k, v = _inputs(11)
    q = q.copy()
    q[0, 1, 2, 0] = np.nan
    out, res = sdpa_forward(q, k, v, score_mod=ScoreMod(relpos_fn, params=(TABLE,)), enable_gqa=True)
    assert np.isnan(out[0, 1, 2]).all() and np.isfinite(out[1]).all()
    gr = sdpa_backward(res, np.ones_like(out))
    assert np.isnan(gr.query[0, 1, 2]).all() and np.isfinite(gr.query[1]).all()
    assert np.isnan(gr.score_mod[0]).all()                   # the table reads every score gradient


def test_the_caller_and_the_table_are_not_modified():
    q, k, v = _inputs(12)
    t = TABLE.copy()
    mod = ScoreMod(relpos_fn, params=(t,))
    t[...] = 0                                               # the ScoreMod holds its own copy
    o1, _ = sdpa_forward(q, k, v, score_mod=mod, enable_gqa=True)
    o2, _ = sdpa_forward(q, k, v, bias=_relpos_bias(), enable_gqa=True)
    assert np.array_equal(o1, o2)


def test_a_large_additive_penalty_is_not_taken_for_a_kink():
    """s - 1e9 (j > i): affine, its slope 1 exact; the central difference rounds by |f| eps / h."""
    q, k, v = _inputs(13)
    for pen in (1e9, 1e6, np.finfo(float).max / 4):
        out, _ = sdpa_forward(q, k, v, enable_gqa=True, score_mod=lambda s, b, h, i, j, p=pen: s - p * (j > i))
        want, _ = sdpa_forward(q, k, v, enable_gqa=True, is_causal=True)
        np.testing.assert_allclose(out, want, rtol=F64_AMPLIFIED, atol=F64_SUMS)


def test_a_function_not_analytic_in_its_captured_tensor_needs_its_vjp():
    q, k, v = (x[:1] for x in _inputs(14))
    fn = lambda s, b, h, i, j, w: s * np.abs(w)[h]                             # noqa: E731
    _, res = sdpa_forward(q, k, v, enable_gqa=True, score_mod=ScoreMod(fn, params=(np.array([-0.7, 1.3, 1, 2]),)))
    with pytest.raises(ValueError, match=r"not analytic in params\[0\]"):
        sdpa_backward(res, np.ones((1, HQ, L, EV)))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m["method"])
def test_captured_tensors_get_a_zero_gradient_when_no_key_is_read(method):
    q, k, v = _inputs(15)
    _, res = sdpa_forward(q, k, v, enable_gqa=True, kv_lengths=np.array([0, 0]),
                          score_mod=ScoreMod(relpos_fn, params=(TABLE,)), **method)
    gr = sdpa_backward(res, np.ones((B, HQ, L, EV)))
    assert isinstance(gr, ScoreModGrads) and np.array_equal(gr.score_mod[0], np.zeros_like(TABLE))


def test_a_bad_grad_is_a_clear_error():
    q, k, v = _inputs()
    for bad, match in ((lambda s, b, h, i, j: None, "should return real numbers"),
                       (lambda s, b, h, i, j: s + 0j, "should return real numbers"),
                       (lambda s, b, h, i, j: s[..., :1, :2], "broadcastable"),
                       (lambda s, b, h, i, j: s.__iadd__(1), "should not write into its `score`")):
        with pytest.raises((TypeError, ValueError), match=match):
            sdpa_forward(q, k, v, enable_gqa=True, score_mod=ScoreMod(softcap_fn, grad=bad))
    with pytest.raises(ValueError, match=r"`shape` should be \(\*batch, Hq, L, S\)"):
        check_score_mod(softcap_fn, shape=(3, 4))
