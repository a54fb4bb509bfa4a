"""Attention sinks: ``sinks=``, one logit per query head in every row's softmax normaliser, with no value.

Evidence: a Python-loop oracle (tests/oracle.py, which shares no code with the package) for the output, the
LSE with and without the sink and every gradient, the sink's included, over hypothesis draws of the option
grid and every engine; central differences of ``<g, out> + <g_lse, lse>`` in ``(q, k, v, sinks[, mask,
bias])``; the closed-form identities ``lse' = logaddexp(lse, sigma)``, ``O' = O (1 - e^(sigma - lse'))``;
``-inf`` sinks giving the sink-free bits; wrong sink gradients the check must catch; rows with no key; the
poison of non-finite inputs; bad input.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref import sdpa_backward, sdpa_forward, sdpa_jvp

from helpers import assert_faithful
from oracle import oracle_attention
from strategies import dense_case, differentiable, variant_problem
from tolerances import F64_AMPLIFIED, F64_FEW_ULP, F64_GRAD, F64_GRAD_ORACLE, F64_REGROUPED, F64_SUMS

ENGINES = [("fast", {}, True), ("plain", {}, True), ("tiled", {}, True), ("tiled", {"block_size": 2}, True),
           ("fast", {}, False), ("plain", {}, False), ("reproducible", {}, True),
           ("reproducible", {"upcast": False}, True)]
IDS = ["fast", "plain", "tiled", "tiled-block2", "fast-save_probs=False", "plain-save_probs=False", "reproducible",
       "reproducible-upcast=False"]
METHODS = ["fast", "plain", "tiled", "reproducible"]


def _engine(name):
    """The keywords that pick an engine: a ``method``, or ``precision="reproducible"`` (double-double)."""
    if name == "tiled-2":                                               # the tiled engine over blocks of 2
        return {"block_size": 2}
    return {"precision": "reproducible"} if name == "reproducible" else {"method": name}


def _bits(a, b):
    return a is None and b is None or (a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())


def _sinks(rng, B, Hq, none_some=True):
    s = rng.standard_normal((B, Hq)) * 2.0
    if none_some:
        s[rng.random((B, Hq)) < 0.25] = -np.inf                       # some heads without a sink
    return s


@st.composite
def sink_problem(draw, max_len=4):
    q, k, v, opts, oracle = draw(variant_problem(max_len=max_len))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B, Hq = q.shape[0], q.shape[1]
    sinks = _sinks(rng, B, Hq)
    per_head = draw(st.booleans())                                    # (Hq,) or (B, Hq)
    if per_head:
        sinks = np.broadcast_to(sinks[:1], (B, Hq)).copy()
    opts["sinks"] = sinks[0] if per_head else sinks
    oracle["sinks"] = sinks
    return q, k, v, opts, oracle


@pytest.mark.parametrize("method,extra,save_probs", ENGINES, ids=IDS)
@settings(max_examples=15)
@given(problem=sink_problem())
def test_forward_and_backward_match_the_loop_oracle(method, extra, save_probs, problem):
    q, k, v, opts, oracle = problem
    g = np.random.default_rng(1).standard_normal(q.shape[:-1] + (v.shape[-1],))
    o, lse, grads = oracle_attention(q, k, v, grad_out=g, **oracle)
    out, res = sdpa_forward(q, k, v, **_engine(method), save_probs=save_probs, **extra, **opts)
    np.testing.assert_allclose(out, o, rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)
    np.testing.assert_array_equal(np.isneginf(res.lse), np.isneginf(lse))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(res.lse[fin], lse[fin], rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)
    # the sink-free LSE (FlashMLA's) is the LSE of the same problem without the sink
    no_sink = {n: x for n, x in oracle.items() if n != "sinks"}
    _, lse_keys, _ = oracle_attention(q, k, v, **no_sink)
    keys = res.lse_as(sink=False)
    np.testing.assert_array_equal(np.isneginf(keys), np.isneginf(lse_keys))
    np.testing.assert_allclose(keys[np.isfinite(lse_keys)], lse_keys[np.isfinite(lse_keys)],
                               rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)
    if opts["fully_masked"] == "nan" and np.isnan(o).any():
        return                                                        # the policy's NaN rows: checked above
    gr = sdpa_backward(res, g)
    dq, dk, dv, _, dsink = grads
    for got, want in ((gr.query, dq), (gr.key, dk), (gr.value, dv)):
        np.testing.assert_allclose(got, want, rtol=F64_GRAD_ORACLE, atol=F64_AMPLIFIED)
    want_sinks = dsink.sum(axis=0) if opts["sinks"].ndim == 1 else dsink
    np.testing.assert_allclose(gr.sinks, want_sinks, rtol=F64_GRAD_ORACLE, atol=F64_AMPLIFIED)
    assert gr.sinks.shape == np.shape(opts["sinks"])


@settings(max_examples=8)
@given(problem=sink_problem(max_len=3))
def test_the_reproducible_engine_is_faithfully_rounded_with_sinks(problem):
    """Against the loop oracle in 50-digit mpmath: out, both LSEs and every gradient, the sinks' included."""
    pytest.importorskip("mpmath")
    q, k, v, opts, oracle = problem
    if "slopes" in oracle:
        oracle["slopes"] = np.broadcast_to(oracle["slopes"], q.shape[:2])
    g = np.random.default_rng(2).standard_normal(q.shape[:-1] + (v.shape[-1],))
    out, res = sdpa_forward(q, k, v, precision="reproducible", **opts)
    t_out, t_lse, (t_dq, t_dk, t_dv, _, t_ds) = oracle_attention(q, k, v, grad_out=g, num="mp", **oracle)
    _, t_keys, _ = oracle_attention(q, k, v, num="mp", **{n: x for n, x in oracle.items() if n != "sinks"})
    gr = sdpa_backward(res, g)
    for got, want, what in ((out, t_out, "out"), (res.lse, t_lse, "lse"), (res.lse_as(sink=False), t_keys, "keys"),
                            (gr.query, t_dq, "dq"), (gr.key, t_dk, "dk"), (gr.value, t_dv, "dv")):
        assert_faithful(got, want, what)
    if opts["sinks"].ndim == 2:
        assert_faithful(gr.sinks, t_ds, "dsinks")


def _check(q, k, v, opts, method, extra, save_probs, backward=None, with_lse=True):
    """check_vjp of ``(q, k, v, sinks[, attn_mask, bias])`` -> ``(out, lse)``."""
    float_args = ["sinks"] + [n for n in ("attn_mask", "bias") if n in opts and np.asarray(opts[n]).dtype.kind == "f"]
    base = {n: x for n, x in opts.items() if n not in float_args}
    out0, res0 = sdpa_forward(q, k, v, **_engine(method), **extra, **opts)
    n_out = out0.size

    def f(q, k, v, *fl):
        out, res = sdpa_forward(q, k, v, **_engine(method), **extra, **base, **dict(zip(float_args, fl)))
        lse = np.where(np.isneginf(res.lse), 0.0, res.lse)
        return np.concatenate([out.ravel(), lse.ravel() if with_lse else np.zeros(0)])

    def vjp(g, q, k, v, *fl):
        _, res = sdpa_forward(q, k, v, **_engine(method), save_probs=save_probs, **extra, **base,
                              **dict(zip(float_args, fl)))
        go = g[:n_out].reshape(out0.shape)
        gl = g[n_out:].reshape(out0.shape[:-1]) if with_lse else None
        gr = (backward or sdpa_backward)(res, go, grad_lse=gl)
        return [gr.query, gr.key, gr.value] + [getattr(gr, n) for n in float_args]

    return sdpa_ref.check_vjp(f, vjp, [q, k, v] + [opts[n] for n in float_args], mode="projection", n_projections=3)


@pytest.mark.parametrize("method,extra,save_probs", ENGINES, ids=IDS)
@settings(max_examples=10)
@given(problem=sink_problem(), float_mask=st.booleans(), with_lse=st.booleans())
def test_gradients_match_central_differences_over_the_option_grid(method, extra, save_probs, problem, float_mask,
                                                                  with_lse):
    q, k, v, opts, _ = problem
    opts = differentiable(opts, float_mask)
    opts["sinks"] = np.where(np.isneginf(opts["sinks"]), 0.3, opts["sinks"])   # a difference needs a finite sink
    report = _check(q, k, v, opts, method, extra, save_probs, with_lse=with_lse)
    assert report.ok, report


@pytest.mark.parametrize("method,extra,save_probs", ENGINES[:6], ids=IDS[:6])   # reproducible: by projections
def test_full_jacobian_on_a_dense_case(method, extra, save_probs):
    """Entry by entry, with softcap, a float mask with a fully masked row, a bias, GQA, dropout, padding and
    a sink that dominates one head."""
    q, k, v, opts = dense_case(sinks=np.array([[0.5, -1.0, 4.0, 0.0], [1.5, 0.2, -0.3, 2.0]]))
    mask = opts["attn_mask"]
    out, res = sdpa_forward(q, k, v, **_engine(method), **extra, **opts)
    def f(q, k, v, s, m, b):                                            # one forward gives O and the LSE
        o, r = sdpa_forward(q, k, v, **_engine(method), **extra, **dict(opts, sinks=s, attn_mask=m, bias=b))
        return np.concatenate([o.ravel(), np.where(np.isneginf(res.lse), 0.0, r.lse).ravel()])

    def vjp(g, q, k, v, s, m, b):
        _, r = sdpa_forward(q, k, v, **_engine(method), save_probs=save_probs, **extra,
                            **dict(opts, sinks=s, attn_mask=m, bias=b))
        gr = sdpa_backward(r, g[:out.size].reshape(out.shape), grad_lse=g[out.size:].reshape(out.shape[:-1]))
        return [gr.query, gr.key, gr.value, gr.sinks, gr.attn_mask, gr.bias]

    report = sdpa_ref.check_vjp(f, vjp, [q, k, v, opts["sinks"], mask, opts["bias"]], mode="full")
    assert report.ok, report


def test_the_engines_agree_with_each_other():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 6, 9, 4)), rng.standard_normal((2, 3, 11, 4)), rng.standard_normal((2, 3, 11, 5))
    opts = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", window=(3, 1), softcap=5.0,
                kv_lengths=np.array([11, 6]), sinks=_sinks(rng, 2, 6))
    g, gl = rng.standard_normal((2, 6, 9, 5)), rng.standard_normal((2, 6, 9))
    ref_out, ref = sdpa_forward(q, k, v, method="plain", **opts)
    ref_gr = sdpa_backward(ref, g, grad_lse=gl)
    for method, extra, save_probs in ENGINES:
        out, res = sdpa_forward(q, k, v, **_engine(method), save_probs=save_probs, **extra, **opts)
        gr = sdpa_backward(res, g, grad_lse=gl)
        np.testing.assert_allclose(out, ref_out, rtol=F64_SUMS, atol=F64_REGROUPED)
        np.testing.assert_allclose(res.lse, ref.lse, rtol=F64_SUMS, atol=F64_REGROUPED)
        np.testing.assert_allclose(res.lse_as(sink=False), ref.lse_as(sink=False), rtol=F64_SUMS, atol=F64_REGROUPED)
        for a, b in zip(gr, ref_gr):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(a, b, rtol=F64_GRAD, atol=F64_SUMS)


@pytest.mark.parametrize("method", METHODS)
def test_the_sink_is_a_column_with_no_value(method):
    """lse' = logaddexp(lse, sigma) and O' = O (1 - p_sink), p_sink = exp(sigma - lse'), against the sink-free
    attention of the same problem: the closed form of one more score whose value is 0."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 6, 4)), rng.standard_normal((2, 3, 6, 2))
    s = rng.standard_normal((3,)) * 3
    out0, res0 = sdpa_forward(q, k, v, **_engine(method), is_causal=True)
    out, res = sdpa_forward(q, k, v, **_engine(method), is_causal=True, sinks=s)
    lse = np.logaddexp(res0.lse, s[:, None])
    np.testing.assert_allclose(res.lse, lse, rtol=F64_REGROUPED, atol=F64_REGROUPED)
    np.testing.assert_allclose(out, out0 * -np.expm1(s[:, None, None] - lse[..., None]),
                               rtol=F64_SUMS, atol=F64_FEW_ULP)
    np.testing.assert_allclose(res.lse_as(sink=False), res0.lse, rtol=F64_REGROUPED, atol=F64_REGROUPED)
    np.testing.assert_allclose(res.lse_as(base=2), lse / np.log(2), rtol=F64_REGROUPED)


@pytest.mark.parametrize("method,extra,save_probs", ENGINES, ids=IDS)
def test_minus_inf_sinks_give_the_sink_free_results(method, extra, save_probs):
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 2))
    mask = rng.random((2, 4, 5, 6)) < 0.6
    mask[0, 1, 2] = False
    opts = dict(enable_gqa=True, attn_mask=mask, softcap=3.0, q_lengths=np.array([5, 3]), fully_masked="uniform")
    g, gl = rng.standard_normal((2, 4, 5, 2)), rng.standard_normal((2, 4, 5))
    out0, res0 = sdpa_forward(q, k, v, **_engine(method), save_probs=save_probs, **extra, **opts)
    out, res = sdpa_forward(q, k, v, **_engine(method), save_probs=save_probs, **extra, sinks=np.full(4, -np.inf),
                            **opts)
    assert _bits(out, out0) and _bits(res.lse, res0.lse) and _bits(res.lse_as(sink=False), res0.lse)
    gr0, gr = sdpa_backward(res0, g, grad_lse=gl), sdpa_backward(res, g, grad_lse=gl)
    for a, b in zip(gr0[:5], gr[:5]):                                # the backward's row sums run in NumPy,
        assert (a is None) == (b is None)                              # not the compiled row pass: rounding
        if a is not None:
            np.testing.assert_allclose(b, a, rtol=F64_REGROUPED, atol=F64_FEW_ULP)
    np.testing.assert_array_equal(gr.sinks, np.zeros(4))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("policy", ["zero", "nan", "uniform"])
def test_a_row_with_no_key_gives_zero_and_the_sink(method, policy):
    """The sink takes the whole row: O = 0, lse = sigma, dsink = dlse, whatever the policy; the policy applies
    only on the heads whose sink is -inf. Padded rows have no sink: lse = -inf, no gradient."""
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 4, 2)), rng.standard_normal((1, 2, 4, 2))
    mask = np.ones((1, 2, 3, 4), bool)
    mask[:, :, 0] = False                                               # row 0 has no key on both heads
    s = np.array([0.7, -np.inf])
    out, res = sdpa_forward(q, k, v, **_engine(method), attn_mask=mask, sinks=s, fully_masked=policy,
                            q_lengths=np.array([2]))
    np.testing.assert_array_equal(out[0, 0, 0], 0.0)
    assert res.lse[0, 0, 0] == 0.7 and res.lse_as(sink=False)[0, 0, 0] == -np.inf
    assert res.lse_as(sink=False, empty="+inf")[0, 0, 0] == np.inf
    ref, _ = sdpa_forward(q, k, v, **_engine(method), attn_mask=mask, fully_masked=policy, q_lengths=np.array([2]))
    np.testing.assert_array_equal(out[0, 1], ref[0, 1])                # the head without a sink: the policy
    np.testing.assert_array_equal(out[0, :, 2], 0.0)                   # a padded row
    assert np.all(np.isneginf(res.lse[0, :, 2]))
    g, gl = rng.standard_normal(out.shape), np.zeros(res.lse.shape)
    gl[0, 0, 0], gl[0, 0, 2] = 2.5, 100.0                              # the padded row's cotangent is not read
    gr = sdpa_backward(res, np.where(np.isnan(out), 0.0, g), grad_lse=gl)
    alone = sdpa_backward(res, np.where(np.isnan(out), 0.0, g), grad_lse=np.where(gl == 2.5, 0.0, gl))
    assert gr.sinks[0] - alone.sinks[0] == pytest.approx(2.5, rel=1e-15)   # dsink of that row = dlse
    np.testing.assert_array_equal(gr.query[0, 0, 0], 0.0)


def test_the_sink_free_lse_does_not_cancel_when_the_sink_dominates():
    """Kept by the engine before the fold: lse + log(1 - p_sink) would lose every digit here."""
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 2))
    _, res0 = sdpa_forward(q, k, v)
    for method in METHODS:
        out, res = sdpa_forward(q, k, v, sinks=np.array([60.0, 45.0]), **_engine(method))
        np.testing.assert_allclose(res.lse_as(sink=False), res0.lse, rtol=F64_REGROUPED)
        assert np.all(res.lse[0, 0] == 60.0)                          # exp(lse_keys - 60) < eps
        assert np.all(np.abs(out) < 1e-18)


def _wrong(kind):
    """sdpa_backward with a wrong sink gradient: the check must catch each."""
    def backward(res, g, grad_lse=None):
        gr = sdpa_backward(res, g, grad_lse=grad_lse)
        if kind == "sign":
            return gr._replace(sinks=-gr.sinks)
        if kind == "no_dlse":                                          # -p_sink D, dropping + p_sink dlse
            no = sdpa_backward(res, g)
            return gr._replace(sinks=no.sinks)
        if kind == "unscaled":                                         # -D, without the sink's probability
            p = np.exp(np.asarray(res.problem.sink)[..., 0] - res.forward.lse)
            return gr._replace(sinks=gr.sinks / np.maximum(p.mean(axis=-1), 1e-300).reshape(gr.sinks.shape))
        raise AssertionError(kind)
    return backward


@pytest.mark.parametrize("kind", ["sign", "no_dlse", "unscaled"])
def test_wrong_sink_gradients_are_caught(kind):
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 4, 2)), rng.standard_normal((1, 2, 4, 2))
    opts = dict(sinks=np.array([0.4, -0.8]))
    assert _check(q, k, v, opts, "fast", {}, True).ok
    assert not _check(q, k, v, opts, "fast", {}, True, backward=_wrong(kind)).ok


@pytest.mark.parametrize("method", ["fast", "plain", "tiled-2", "reproducible"])
@pytest.mark.parametrize("sinks_shape", [(2,), (2, 2)])
def test_the_jvp_with_sinks_matches_central_differences(method, sinks_shape):
    """In (q, k, v, bias, sinks): the sinks' tangent enters the row sum as -p_sink dsigma."""
    rng = np.random.default_rng(10)
    q, k, v = rng.standard_normal((2, 2, 3, 2)), rng.standard_normal((2, 2, 4, 2)), rng.standard_normal((2, 2, 4, 3))
    mask = np.ones((2, 2, 3, 4), bool)
    mask[1, 0, 1] = False                                               # a row with no key: O = 0 whatever sigma
    opts = dict(softcap=2.0, attn_mask=mask, q_lengths=np.array([3, 2]), bias=rng.standard_normal((2, 3, 4)))
    s = np.broadcast_to(np.array([1.0, -0.5]), sinks_shape).copy()
    report = sdpa_ref.check_jvp(
        lambda q, k, v, b, s: sdpa_forward(q, k, v, **_engine(method), **dict(opts, bias=b, sinks=s))[0],
        lambda t, q, k, v, b, s: sdpa_jvp((q, k, v), tuple(t), **_engine(method), **dict(opts, bias=b, sinks=s))[1],
        [q, k, v, opts["bias"], s], mode="projection" if method == "reproducible" else "full")
    assert report.ok, report


def test_a_non_finite_sinks_tangent_poisons_the_rows_that_read_it():
    rng = np.random.default_rng(14)
    q, k, v = rng.standard_normal((1, 3, 3, 2)), rng.standard_normal((1, 3, 4, 2)), rng.standard_normal((1, 3, 4, 2))
    mask = np.ones((1, 3, 3, 4), bool)
    mask[0, 1, 0] = False
    ds = np.array([0.0, np.nan, 1.0])
    for method in METHODS[:2] + ["reproducible"]:
        kw = dict(_engine(method), attn_mask=mask, sinks=np.array([0.5, 0.5, -np.inf]))
        _, t = sdpa_jvp((q, k, v), (None, None, None, None, ds), **kw)
        assert np.all(np.isnan(t[0, 1, 1:])) and np.all(t[0, 1, 0] == 0.0)   # the row with no key does not read it
        assert np.all(np.isfinite(t[0, [0, 2]]))
        np.testing.assert_array_equal(t[0, 2], 0.0)                      # a head without a sink: no effect


def test_a_sinks_tangent_needs_sinks():
    q, k, v = np.ones((1, 2, 3, 2)), np.ones((1, 2, 4, 2)), np.ones((1, 2, 4, 2))
    with pytest.raises(ValueError, match="no sinks tangent when no `sinks`"):
        sdpa_jvp((q, k, v), (None, None, None, None, np.zeros(2)))
    with pytest.raises(ValueError, match=r"`tangents\[4\]` should have the shape of `sinks` \(2,\)"):
        sdpa_jvp((q, k, v), (None, None, None, None, np.zeros(3)), sinks=np.zeros(2))


def test_non_finite_inputs_poison_the_sink_gradient_of_their_head_only():
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((1, 3, 3, 2)), rng.standard_normal((1, 3, 4, 2)), rng.standard_normal((1, 3, 4, 2))
    q[0, 1, 2, 0] = np.nan
    for method in METHODS:
        out, res = sdpa_forward(q, k, v, sinks=np.zeros(3), **_engine(method))
        gr = sdpa_backward(res, np.ones(out.shape))
        assert np.isnan(gr.sinks[1]) and np.all(np.isfinite(gr.sinks[[0, 2]]))
        gl = np.zeros(res.lse.shape)
        gl[0, 2, 1] = np.inf
        q2 = np.where(np.isnan(q), 0.0, q)
        out, res = sdpa_forward(q2, k, v, sinks=np.zeros(3), **_engine(method))
        gr = sdpa_backward(res, np.ones(out.shape), grad_lse=gl)
        assert np.isnan(gr.sinks[2]) and np.all(np.isfinite(gr.sinks[:2]))


def test_inputs_are_not_mutated():
    rng = np.random.default_rng(12)
    q, k, v = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 4, 2)), rng.standard_normal((1, 2, 4, 2))
    s = np.array([0.5, -np.inf])
    s0 = s.copy()
    out, res = sdpa_forward(q, k, v, sinks=s)
    sdpa_backward(res, np.ones(out.shape))
    s[0] = 9.0                                                         # nothing done afterwards changes a result
    np.testing.assert_array_equal(s0, [0.5, -np.inf])
    out2, _ = sdpa_forward(q, k, v, sinks=s0)
    np.testing.assert_array_equal(out, out2)


@pytest.mark.parametrize("sinks,match", [
    (np.zeros(3), r"`sinks` should have shape \(Hq,\) = \(2,\), a scalar, \(1, Hq, 1, 1\), \(Hq, 1, 1\)"),
    (np.zeros((3, 2)), r"`sinks` should have shape"),
    (np.zeros((1, 3, 1, 1)), r"`sinks` should have shape .* but got shape \(1, 3, 1, 1\)"),
    (np.zeros((2, 1, 1, 1, 1)), r"`sinks` should have shape"),
    (np.zeros((3, 1)), r"`sinks` should have shape"),
    (np.array([0.0, np.nan]), r"`sinks` should be finite, -inf \(no sink\) or \+inf"),
    ("a", r"`sinks`"),
    (np.array([True, False]), r"`sinks`"),
])
def test_bad_sinks_are_a_clear_error(sinks, match):
    q, k, v = np.ones((2, 2, 3, 2)), np.ones((2, 2, 4, 2)), np.ones((2, 2, 4, 2))
    with pytest.raises((ValueError, TypeError), match=match):
        sdpa_forward(q, k, v, sinks=sinks)


def test_the_complex_forward_refuses_sinks_by_name():
    q, k, v = np.ones((1, 2, 3, 2)), np.ones((1, 2, 4, 2)), np.ones((1, 2, 4, 2))
    with pytest.raises(ValueError, match="`sinks` should be None for sdpa_forward_complex"):
        sdpa_ref.sdpa_forward_complex(q + 0j, k, v, sinks=np.zeros(2))
    _, res = sdpa_forward(q, k, v, sinks=np.zeros(2))
    with pytest.raises(TypeError, match="`sink`"):
        res.lse_as(sink="no")


def test_scaled_dot_product_attention_takes_sinks():
    rng = np.random.default_rng(13)
    q, k, v = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 4, 2)), rng.standard_normal((1, 2, 4, 2))
    out, lse = sdpa_ref.scaled_dot_product_attention(q, k, v, sinks=np.array([0.1, 0.2]), return_lse=True)
    ref, res = sdpa_forward(q, k, v, sinks=np.array([0.1, 0.2]))
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(lse, res.lse)


def test_a_nan_row_of_one_batch_entry_makes_its_heads_sink_gradient_nan_on_every_engine():
    """Found by hypothesis: under ``"nan"`` a row with neither key nor sink in one batch entry makes the summed
    ``dsinks`` of its head NaN; the reproducible engine held that NaN against the unsummed ``(B, Hq)`` rows and
    refused the result as an overflow. Every engine gives the plain core's NaN pattern."""
    rng = np.random.default_rng(21)
    q, k, v = rng.standard_normal((2, 2, 2, 2)), rng.standard_normal((2, 2, 3, 2)), rng.standard_normal((2, 2, 3, 3))
    opts = dict(fully_masked="nan", kv_lengths=np.array([1, 0]), sinks=np.array([0.99, -np.inf]))
    want = sdpa_backward(sdpa_forward(q, k, v, method="plain", **opts)[1], np.ones((2, 2, 2, 3))).sinks
    assert np.isnan(want).tolist() == [False, True]
    for kw in ({"method": "fast"}, {"block_size": 2}, {"precision": "reproducible"},
               {"precision": "reproducible", "upcast": False}):
        got = sdpa_backward(sdpa_forward(q, k, v, **kw, **opts)[1], np.ones((2, 2, 2, 3))).sinks
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=str(kw))
        np.testing.assert_allclose(got[0], want[0], rtol=F64_GRAD, atol=F64_FEW_ULP, err_msg=str(kw))


@pytest.mark.parametrize("kw", [{"method": "plain"}, {"method": "fast"}, {"block_size": 2},
                                {"precision": "reproducible"}], ids=["plain", "fast", "tiled", "reproducible"])
def test_no_key_at_all_under_nan_is_a_fully_masked_row_sink_or_none(kw):
    """Found by the layouts' per-sequence oracle: with S = 0 under "nan" a head with a sink gave NaN where a row
    with no key and a sink gives 0, and a head without one a dsinks of 0 where a fully masked row makes it NaN.
    S = 0 now gives what every key masked gives, on every engine."""
    rng = np.random.default_rng(22)
    q = rng.standard_normal((1, 2, 2, 3))
    sinks = np.array([0.3, -np.inf])
    got = []
    for S, lengths in ((0, None), (2, np.array([0]))):
        k, v = rng.standard_normal((1, 2, S, 3)), rng.standard_normal((1, 2, S, 2))
        out, res = sdpa_forward(q, k, v, fully_masked="nan", sinks=sinks, kv_lengths=lengths, **kw)
        got.append((out, res.lse, sdpa_backward(res, np.ones(out.shape)).sinks))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)
    out, lse, ds = got[0]
    assert (out[:, 0] == 0).all() and np.isnan(out[:, 1]).all()
    assert np.isnan(ds).tolist() == [False, True]



#: Each accepted spelling of the sinks, and the (B, Hq) = (2, 3) shape it broadcasts from.
SHAPES = {(): (1, 1), (1,): (1, 1), (3,): (1, 3), (1, 3, 1, 1): (1, 3), (3, 1, 1): (1, 3), (2, 3): (2, 3),
          (1, 1, 3, 1, 1): (1, 3), (2, 1): (2, 1)}


@pytest.mark.parametrize("shape", list(SHAPES), ids=str)
@pytest.mark.parametrize("engine", [{"method": "plain"}, {"method": "fast"}, {"method": "tiled", "block_size": 2},
                                    {"num_splits": 2}, {"precision": "reproducible"}],
                         ids=["plain", "fast", "tiled-2", "num_splits=2", "reproducible"])
def test_sinks_of_any_shape_that_folds_to_one_logit_per_head(shape, engine):
    """A scalar, ``(1,)``, ``(Hq,)``, cuDNN's and FlashMLA's ``(1, Hq, 1, 1)``, ``(Hq, 1, 1)``, ``(B, Hq)`` and
    ``(B, 1)`` give the bits of the same logits spelled ``(B, Hq)``; ``dsinks`` comes back in the caller's own
    shape, the gradient of the ``(B, Hq)`` spelling summed over the axes the caller's shape broadcasts; a sinks
    tangent in the caller's shape gives the JVP of the ``(B, Hq)`` tangent broadcast the same way."""
    rng = np.random.default_rng(7)
    B, H, L, S, E = 2, 3, 4, 5, 4
    q, k, v = rng.standard_normal((B, H, L, E)), rng.standard_normal((B, H, S, E)), rng.standard_normal((B, H, S, E))
    fold = SHAPES[shape]
    sinks, ds = rng.standard_normal(shape), rng.standard_normal(shape)
    full, dfull = (np.broadcast_to(x.reshape(fold), (B, H)).copy() for x in (sinks, ds))
    dO, dlse = rng.standard_normal((B, H, L, E)), rng.standard_normal((B, H, L))
    out, res = sdpa_forward(q, k, v, sinks=sinks, **engine)
    ref_out, ref = sdpa_forward(q, k, v, sinks=full, **engine)
    assert _bits(out, ref_out) and _bits(res.lse, ref.lse)
    g, ref_g = sdpa_backward(res, dO, grad_lse=dlse), sdpa_backward(ref, dO, grad_lse=dlse)
    assert g.sinks.shape == shape and _bits(g.query, ref_g.query) and _bits(g.value, ref_g.value)
    axes = tuple(i for i, n in enumerate(fold) if n == 1)
    want = ref_g.sinks.sum(axis=axes, keepdims=True).reshape(shape)
    np.testing.assert_allclose(g.sinks, want, rtol=F64_SUMS, atol=F64_SUMS)
    t = sdpa_jvp((q, k, v), {"sinks": ds}, sinks=sinks, **engine)[1]
    t_ref = sdpa_jvp((q, k, v), {"sinks": dfull}, sinks=full, **engine)[1]
    assert _bits(t, t_ref)


@pytest.mark.parametrize("engine", [{"method": "plain"}, {"method": "fast"}, {"method": "tiled", "block_size": 2},
                                    {"num_splits": 2}, {"precision": "reproducible"},
                                    {"method": "plain", "save_probs": False}],
                         ids=["plain", "fast", "tiled-2", "num_splits=2", "reproducible", "plain-save_probs=False"])
def test_plus_inf_sinks_take_all_the_mass(engine):
    """A ``+inf`` sink (FlashMLA's tests draw them) is the limit sigma -> +inf: every key's ``P`` is 0, ``O = 0``,
    the LSE with the sink is ``+inf`` and the keys' own (``lse_as(sink=False)``) stays theirs. Its gradients are
    the limits, not finite differences: 0 for ``q``, ``k``, ``v`` from the head, ``dsinks = sum(grad_lse)`` over
    the head's rows (d lse / d sigma -> 1, ``D = dO . O = 0``), 0 without ``grad_lse``; a tangent gives 0. The
    other heads keep the results of a finite sink there, in every engine alike."""
    rng = np.random.default_rng(11)
    B, H, L, S, E = 2, 3, 4, 5, 4
    q, k, v = rng.standard_normal((B, H, L, E)), rng.standard_normal((B, H, S, E)), rng.standard_normal((B, H, S, E))
    sinks, finite = np.array([np.inf, 0.3, -np.inf]), np.array([0.0, 0.3, -np.inf])
    dO, dlse = rng.standard_normal((B, H, L, E)), rng.standard_normal((B, H, L))
    out, res = sdpa_forward(q, k, v, sinks=sinks, is_causal=True, **engine)
    ref_out, ref = sdpa_forward(q, k, v, sinks=finite, is_causal=True, **engine)
    assert np.all(out[:, 0] == 0) and np.all(res.lse[:, 0] == np.inf)
    np.testing.assert_array_equal(res.lse_as(sink=False), ref.lse_as(sink=False))   # the keys' own LSE
    np.testing.assert_allclose(out[:, 1:], ref_out[:, 1:], rtol=F64_FEW_ULP, atol=F64_FEW_ULP)
    g, g0 = sdpa_backward(res, dO, grad_lse=dlse), sdpa_backward(res, dO)
    ref_g = sdpa_backward(ref, dO, grad_lse=dlse)
    for x, r in ((g.query, ref_g.query), (g.key, ref_g.key), (g.value, ref_g.value)):
        assert np.all(x[:, 0] == 0)
        np.testing.assert_allclose(x[:, 1:], r[:, 1:], rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(g.sinks[0], dlse[:, 0].sum(), rtol=F64_SUMS)
    np.testing.assert_allclose(g.sinks[1:], ref_g.sinks[1:], rtol=F64_SUMS, atol=F64_SUMS)
    assert g0.sinks[0] == 0
    t = sdpa_jvp((q, k, v), {"sinks": np.ones(H), "query": np.ones_like(q)}, sinks=sinks, is_causal=True, **engine)[1]
    assert np.all(t[:, 0] == 0) and np.all(np.isfinite(t))


# ----------------------------------------------- the row maximum with and without the sink


ALL_ENGINES = {"fast": {"method": "fast"}, "plain": {"method": "plain"}, "tiled-2": {"block_size": 2},
               "split-2": {"num_splits": 2}, "reproducible": {"precision": "reproducible"}}


@pytest.mark.parametrize("engine", list(ALL_ENGINES))
def test_the_sink_free_row_max_is_flashmlas_max_logits(engine):
    """``row_max_as(sink=False)`` is FlashMLA's ``max_logits`` (``ref_sparse_attn_fwd``: ``P.max(dim=-1)`` of the
    scaled scores, -inf where a row has no key), computed here by loops; ``row_max`` (cuDNN's ``score_max``) is
    ``max(keys' max, sink)``, and ``+inf`` where the sink is; ``sink=True`` is ``row_max``."""
    rng = np.random.default_rng(21)
    B, Hq, L, S, E = 2, 3, 4, 5, 3
    q, k, v = rng.standard_normal((B, Hq, L, E)), rng.standard_normal((B, Hq, S, E)), rng.standard_normal((B, Hq, S, 2))
    sinks = np.array([[0.5, np.inf, -np.inf], [9.0, -1.0, np.inf]])
    kv_lengths = np.array([5, 0])                                         # sequence 1: no key at all
    out, res = sdpa_forward(q, k, v, sinks=sinks, kv_lengths=kv_lengths, window=(1, 0), **ALL_ENGINES[engine])
    want = np.full((B, Hq, L), -np.inf)
    for b, h, i in np.ndindex(B, Hq, L):
        keys = [j for j in range(S) if j < kv_lengths[b] and i - 1 <= j <= i]
        if keys:
            want[b, h, i] = max(sum(q[b, h, i, e] * k[b, h, j, e] for e in range(E)) / np.sqrt(E) for j in keys)
    got = res.row_max_as(sink=False)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=F64_FEW_ULP, atol=F64_FEW_ULP)
    with_sink = np.maximum(got, sinks[..., None])
    np.testing.assert_allclose(res.row_max, with_sink, rtol=F64_FEW_ULP, atol=F64_FEW_ULP)
    assert np.all(res.row_max[0, 1] == np.inf) and np.all(res.row_max[1, 2] == np.inf)
    np.testing.assert_array_equal(res.row_max_as(sink=True), res.row_max)
    np.testing.assert_array_equal(res.row_max_as(sink=False), res.row_max_as(sink=False))   # a fresh copy each time
    res.row_max_as(sink=False)[...] = 0.0
    np.testing.assert_array_equal(np.isneginf(res.row_max_as(sink=False)), np.isneginf(want))


@pytest.mark.parametrize("engine", list(ALL_ENGINES))
def test_without_sinks_both_row_maxima_are_row_max(engine):
    q, k, v = (np.random.default_rng(22).standard_normal((1, 2, 3, 4)) for _ in range(3))
    res = sdpa_forward(q, k, v, is_causal=True, **ALL_ENGINES[engine])[1]
    np.testing.assert_array_equal(res.row_max_as(sink=False), res.row_max)
    res_sink = sdpa_forward(q, k, v, is_causal=True, sinks=np.array([-np.inf, -np.inf]), **ALL_ENGINES[engine])[1]
    np.testing.assert_array_equal(res_sink.row_max_as(sink=False), res.row_max)


def test_row_max_as_takes_a_bool():
    q, k, v = (np.random.default_rng(23).standard_normal((1, 2, 3, 4)) for _ in range(3))
    res = sdpa_forward(q, k, v, sinks=np.array([0.0, 1.0]))[1]
    with pytest.raises(TypeError, match="`sink` should be a bool"):
        res.row_max_as(sink="no")
