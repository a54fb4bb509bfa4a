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
from tolerances import F32_ATOL, F32_SCHEDULES, F64_AMPLIFIED, F64_GRAD, F64_REGROUPED, F64_SUMS, FD_LOOSE

mpmath = pytest.importorskip("mpmath")

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


# ---------------------------------------------------------------- precision="reproducible"
# The function's float64 values (and the slope it reports) are taken as exact; the attention over them is
# faithfully rounded. The oracle below is its own: plain loops in 60-digit mpmath, the function called on the
# exact scores rounded to float64 (as the engine hands them over), its outputs and slopes taken as exact.


def poly_fn(score, b, h, i, j):                  # a polynomial: its own bits are the same on every machine
    return score - score * score * score * 0.015625 + 0.25 * h


def poly_grad(score, b, h, i, j):
    return 1.0 - 3.0 * 0.015625 * score * score


def lookup_fn(score, b, h, i, j, table):         # a bias table lookup, with a scale (3 rows, 4 keys)
    return 0.75 * score + table[h, i - j + 3]


def _rows_allowed(fn_vals):
    return fn_vals != -np.inf


def _mp_oracle(q, k, v, mod, g, tangents, softcap=None):
    """``(out, lse, dq, dk, dv, jvp)`` as object arrays of mpf: the exact attention over the function's float64
    values at the float64-rounded exact scores, the chain through its reported slope exact after that."""
    from sdpa_ref.score_mod import score_mod_forward
    ctx = mpmath.MPContext()
    ctx.dps = 60
    mpf = ctx.mpf
    Bq, Hq, Lq, Eq = q.shape
    Hk, Sk, Ev = v.shape[1], v.shape[2], v.shape[3]
    G = Hq // Hk
    scale = mpf(1) / ctx.sqrt(Eq)
    scale = mpf(float(1 / np.sqrt(Eq)))                  # the engine's scale is the float64 1/sqrt(E)
    tq, tk, tv = tangents
    u = np.empty((Bq, Hq, Lq, Sk))                       # the function's float64 input
    sech2 = np.empty((Bq, Hq, Lq, Sk), dtype=object)
    for b, h, i, j in np.ndindex(*u.shape):
        raw = scale * ctx.fsum(mpf(float(q[b, h, i, e])) * mpf(float(k[b, h // G, j, e])) for e in range(Eq))
        if softcap is not None:
            x = raw / softcap
            u[b, h, i, j] = float(softcap * ctx.tanh(x))
            sech2[b, h, i, j] = 1 / ctx.cosh(x) ** 2
        else:
            u[b, h, i, j] = float(raw)
            sech2[b, h, i, j] = mpf(1)
    from sdpa_ref.score_mod import indices
    idx = indices(u.shape)
    T, fp = score_mod_forward(mod, u, idx, slope=True)          # what the function reports, taken as exact
    out = np.empty((Bq, Hq, Lq, Ev), dtype=object)
    lse = np.empty((Bq, Hq, Lq), dtype=object)
    dq, dk, dv = (np.full(x.shape, mpf(0), dtype=object) for x in (q, k, v))
    jvp = np.empty(out.shape, dtype=object)
    for b, h, i in np.ndindex(Bq, Hq, Lq):
        kh = h // G
        js = [j for j in range(Sk) if T[b, h, i, j] != -np.inf]
        if not js:
            out[b, h, i, :] = mpf(0)
            lse[b, h, i] = -ctx.inf
            jvp[b, h, i, :] = mpf(0)
            continue
        t = {j: mpf(float(T[b, h, i, j])) for j in js}
        mx = max(t.values())
        tot = ctx.fsum(ctx.exp(t[j] - mx) for j in js)
        P = {j: ctx.exp(t[j] - mx) / tot for j in js}
        lse[b, h, i] = mx + ctx.log(tot)
        for e in range(Ev):
            out[b, h, i, e] = ctx.fsum(P[j] * mpf(float(v[b, kh, j, e])) for j in js)
        slope = {j: mpf(float(fp[b, h, i, j])) * sech2[b, h, i, j] for j in js}
        # backward: dT = P (dP - D), dTraw = dT * slope
        dP = {j: ctx.fsum(mpf(float(g[b, h, i, e])) * mpf(float(v[b, kh, j, e])) for e in range(Ev)) for j in js}
        D = ctx.fsum(P[j] * dP[j] for j in js)
        for j in js:
            dT = P[j] * (dP[j] - D) * slope[j]
            for e in range(Eq):
                dq[b, h, i, e] += scale * dT * mpf(float(k[b, kh, j, e]))
                dk[b, kh, j, e] += scale * dT * mpf(float(q[b, h, i, e]))
            for e in range(Ev):
                dv[b, kh, j, e] += P[j] * mpf(float(g[b, h, i, e]))
        # JVP: dT' = slope * scale (tq k + q tk), dP = P (dT' - sum P dT'), dO = dP V + P tv
        dTt = {j: slope[j] * scale * ctx.fsum(mpf(float(tq[b, h, i, e])) * mpf(float(k[b, kh, j, e]))
                                              + mpf(float(q[b, h, i, e])) * mpf(float(tk[b, kh, j, e]))
                                              for e in range(Eq)) for j in js}
        mean = ctx.fsum(P[j] * dTt[j] for j in js)
        for e in range(Ev):
            jvp[b, h, i, e] = ctx.fsum(P[j] * (dTt[j] - mean) * mpf(float(v[b, kh, j, e]))
                                       + P[j] * mpf(float(tv[b, kh, j, e])) for j in js)
    return out, lse, dq, dk, dv, jvp


def _adversarial(kind, seed):
    """Small GQA problems: dominant keys (the runner-up at e^-40), huge scores (~1e200), or plain ones."""
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((1, 2, 3, 3)), rng.standard_normal((1, 1, 4, 3)), rng.standard_normal((1, 1, 4, 2))
    if kind == "dominant":
        k[0, 0, 1] = q[0, 0, 0] * (40 * np.sqrt(3) / np.dot(q[0, 0, 0], q[0, 0, 0]))   # one key 40 above the rest
        k[0, 0, 2] = k[0, 0, 1] * (1 + 2.0 ** -30)                                     # and a near tie for it
    elif kind == "huge":
        q, k = q * 1e100, k * 1e100
    return q, k, v


REPRO_CASES = {
    "poly dominant": ("dominant", ScoreMod(poly_fn, grad=poly_grad), {}),
    "poly plain, complex-step slope": ("plain", poly_fn, {}),
    "lookup huge": ("huge", ScoreMod(lookup_fn, grad=lambda s, b, h, i, j, t: np.full_like(s, 0.75),
                                     params=(TABLE[:2, :6],)), {}),
    "lookup dominant": ("dominant", ScoreMod(lookup_fn, grad=lambda s, b, h, i, j, t: np.full_like(s, 0.75),
                                             params=(TABLE[:2, :6],)), {}),
    "poly under softcap, huge": ("huge", ScoreMod(poly_fn, grad=poly_grad), dict(softcap=2.0)),
    "tanh under softcap": ("plain", lambda s, b, h, i, j: 3 * np.tanh(s / 3), dict(softcap=1.5)),
    "a function that excludes keys": ("dominant", ScoreMod(lambda s, b, h, i, j: np.where(j > i + h, -np.inf, s),
                                                            grad=ones), {}),
}


@pytest.mark.parametrize("name", REPRO_CASES)
def test_reproducible_score_function_is_faithful_to_the_exact_attention_of_its_values(name):
    from helpers import assert_faithful
    kind, mod, opts = REPRO_CASES[name]
    q, k, v = _adversarial(kind, 20)
    rng = np.random.default_rng(21)
    g = rng.standard_normal((1, 2, 3, 2))
    tangents = (rng.standard_normal(q.shape), rng.standard_normal(k.shape), rng.standard_normal(v.shape))
    kw = dict(score_mod=mod, enable_gqa=True, precision="reproducible", **opts)
    out, res = sdpa_forward(q, k, v, **kw)
    grads = sdpa_backward(res, g)
    _, tan = sdpa_jvp((q, k, v), tangents, **kw)
    truth = _mp_oracle(q, k, v, mod if isinstance(mod, ScoreMod) else ScoreMod(mod), g, tangents,
                       softcap=opts.get("softcap"))
    for got, want, what in zip((out, res.lse, grads.query, grads.key, grads.value, tan), truth,
                               ("out", "lse", "dq", "dk", "dv", "jvp")):
        assert_faithful(got, want, what)


def test_reproducible_captured_tensors_get_their_vjp_of_the_faithful_score_gradient():
    """The table's gradient is the function's own VJP of the rounded ``dT``: the bias's gradient, gathered."""
    q, k, v = _inputs(22)
    mod = ScoreMod(relpos_fn, grad=ones, params=(TABLE,), params_vjp=relpos_vjp)
    out, res = sdpa_forward(q, k, v, score_mod=mod, enable_gqa=True, precision="reproducible")
    g = np.random.default_rng(23).standard_normal(out.shape)
    got = sdpa_backward(res, g)
    assert isinstance(got, ScoreModGrads)
    ref = sdpa_backward(sdpa_forward(q, k, v, bias=_relpos_bias(), enable_gqa=True, precision="reproducible")[1], g)
    want = relpos_vjp(ref.bias, None, None, np.arange(HQ)[:, None, None], np.arange(L)[:, None],
                      np.arange(S)[None, :], TABLE)[0]
    np.testing.assert_allclose(got.score_mod[0], want, rtol=F64_SUMS, atol=F64_REGROUPED)   # score + table
    for n in ("query", "key", "value"):                                   # rounds once in the function
        np.testing.assert_allclose(getattr(got, n), getattr(ref, n), rtol=F64_SUMS, atol=F64_REGROUPED)
    fast = sdpa_backward(sdpa_forward(q, k, v, score_mod=ScoreMod(relpos_fn, params=(TABLE,)), enable_gqa=True)[1], g)
    np.testing.assert_allclose(sdpa_backward(sdpa_forward(q, k, v, score_mod=ScoreMod(relpos_fn, params=(TABLE,)),
                                                           enable_gqa=True, precision="reproducible")[1], g)
                               .score_mod[0], fast.score_mod[0], rtol=F64_GRAD, atol=F64_SUMS)


def test_reproducible_score_function_in_low_precision_and_its_refusals():
    q, k, v = (x.astype(np.float32) for x in _inputs(24))
    mod = ScoreMod(poly_fn, grad=poly_grad)
    o, res = sdpa_forward(q, k, v, score_mod=mod, enable_gqa=True, precision="reproducible", upcast=False)
    o64, _ = sdpa_forward(*(x.astype(np.float64) for x in (q, k, v)), score_mod=mod, enable_gqa=True)
    assert o.dtype == np.float32
    np.testing.assert_allclose(o, o64, rtol=F32_SCHEDULES, atol=F32_ATOL)
    with pytest.raises(ValueError, match="score of an allowed key is \\+inf or NaN"):
        sdpa_forward(q, k, v, score_mod=lambda s, b, h, i, j: s / 0.0, enable_gqa=True, precision="reproducible")


REPRO_DIGEST = r"""
import hashlib, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import sdpa_ref
from test_score_mod import REPRO_CASES, _adversarial, _inputs, relpos_fn, relpos_vjp, TABLE, ones
from sdpa_ref import ScoreMod
h = hashlib.sha256()
for name, (kind, mod, opts) in sorted(REPRO_CASES.items()):
    if not isinstance(mod, ScoreMod) or mod.fn.__name__ not in ("poly_fn", "lookup_fn"):
        continue                                   # only functions whose own bits are the same everywhere
    q, k, v = _adversarial(kind, 30)
    kw = dict(score_mod=mod, enable_gqa=True, precision="reproducible", **opts)
    out, res = sdpa_ref.sdpa_forward(q, k, v, **kw)
    g = sdpa_ref.sdpa_backward(res, np.ones_like(out))
    t = sdpa_ref.sdpa_jvp((q, k, v), (q, k, v), **kw)[1]
    for a in (out, res.lse, g.query, g.key, g.value, t) + tuple(getattr(g, "score_mod", None) or ()):
        h.update(np.ascontiguousarray(a).tobytes())
q, k, v = (np.tile(x, (1, 1, 40, 8)) for x in _inputs(31))         # big enough for the pool and the blocks
mod = ScoreMod(relpos_fn, grad=ones, params=(np.tile(TABLE, (1, 80)),), params_vjp=relpos_vjp)
out, res = sdpa_ref.sdpa_forward(q, k, v, score_mod=mod, enable_gqa=True, precision="reproducible")
# the cotangent a polynomial of out, never np.cos: NumPy 1.x's cos (and exp) change bits with the SIMD level
g = sdpa_ref.sdpa_backward(res, 1.0 - 0.5 * out * out)
for a in (out, res.lse, g.query, g.key, g.value, g.score_mod[0]):
    h.update(np.ascontiguousarray(a).tobytes())
print(h.hexdigest())
"""


@pytest.mark.slow
def test_reproducible_score_function_bits_under_every_thread_and_simd_setting():
    """A function whose own bits are the same everywhere (a polynomial, a table lookup): one hash of every
    result under thread counts 1 to 3, OpenBLAS at one thread, numpy without AVX-512 (and AVX2), and the NumPy
    loops in place of the compiled kernels."""
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    avx512 = "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR X86_V4"
    plans = [{}, {"SDPA_REF_NUM_THREADS": "1", "SDPA_REF_NATIVE": "0", "NPY_DISABLE_CPU_FEATURES": avx512},
             {"SDPA_REF_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "1",
              "NPY_DISABLE_CPU_FEATURES": avx512 + " AVX2 FMA3 X86_V3"}]
    base = {n: x for n, x in os.environ.items()
            if n not in ("SDPA_REF_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NPY_DISABLE_CPU_FEATURES", "SDPA_REF_NATIVE")}
    seen = set()
    for extra in plans:
        env = dict(base, **extra)
        if subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True).returncode != 0:
            env.pop("NPY_DISABLE_CPU_FEATURES")               # numpy refuses to switch off a baseline feature
        cp = subprocess.run([sys.executable, "-c", REPRO_DIGEST, here], env=env, capture_output=True, text=True,
                            timeout=300)
        assert cp.returncode == 0, cp.stderr[-2000:]
        seen.add(cp.stdout.strip())
    assert len(seen) == 1, seen


@pytest.mark.parametrize("mod", [ScoreMod(poly_fn, grad=poly_grad), poly_fn,
                                 ScoreMod(relpos_fn, grad=ones, params=(TABLE,), params_vjp=relpos_vjp)],
                         ids=["given slope", "complex step", "captured table"])
def test_reproducible_score_function_never_reads_past_the_keys_lengths(mod):
    """NaN and huge values in keys and values past ``kv_lengths`` give the clean run's bits, with no warning."""
    import warnings
    q, k, v = _inputs(25)
    lengths = np.array([4, 6])
    dirty_k, dirty_v = k.copy(), v.copy()
    dirty_k[0, :, 4:] = np.nan
    dirty_v[0, :, 4] = 1e308
    dirty_v[0, :, 5] = np.inf
    g = np.random.default_rng(26).standard_normal((B, HQ, L, EV))
    t = tuple(np.random.default_rng(27).standard_normal(x.shape) for x in (q, k, v))
    kw = dict(score_mod=mod, kv_lengths=lengths, enable_gqa=True, precision="reproducible")
    runs = []
    for kk, vv in ((k, v), (dirty_k, dirty_v)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, res = sdpa_forward(q, kk, vv, **kw)
            grads = sdpa_backward(res, g)
            tan = sdpa_jvp((q, kk, vv), t, **kw)[1]
        runs.append((out, res.lse, grads.query, grads.key[1], grads.value[1], grads.key[0, :, :4], tan)
                    + tuple(getattr(grads, "score_mod", None) or ()))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
