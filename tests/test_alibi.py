"""ALiBi's conventions (``alibi_mode=``): FlashAttention's ``-m |i + off - j|`` and cuDNN's signed ``m (j - i)``
(its ``alibi_mask``, no diagonal offset), in every engine, forward, LSE, backward, JVP and the second order.

Evidence: the Python-loop oracle (tests/oracle.py, written from each peer's formula, sharing no code with the
package); central differences of the forward (VJP, JVP) and of the backward (HVP); the public ``alibi_bias``
passed as ``bias=``; the two conventions agreeing on the keys ``j <= i`` (top-left causal) and nowhere else.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref import sdpa_backward, sdpa_forward, sdpa_jvp
from sdpa_ref.alibi import alibi_bias

from helpers import loss_derivatives
from oracle import oracle_attention
from tolerances import F64_AMPLIFIED, F64_GRAD, F64_GRAD_ORACLE, F64_REGROUPED, FD_SECOND_ORDER

ENGINES = {"fast": {}, "plain": {"method": "plain"}, "tiled-2": {"block_size": 2}, "split-2": {"num_splits": 2},
           "reproducible": {"precision": "reproducible"}}


@st.composite
def alibi_problem(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B, Hq, L, S = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    q, k, v = rng.standard_normal((B, Hq, L, 3)), rng.standard_normal((B, Hq, S, 3)), rng.standard_normal((B, Hq, S, 2))
    slopes = rng.uniform(0.0, 1.5, (B, Hq))
    opts = dict(alibi_slopes=slopes, alibi_mode=draw(st.sampled_from(["flash", "cudnn"])),
                is_causal=draw(st.booleans()), causal_alignment=draw(st.sampled_from(["top_left", "bottom_right"])))
    oracle = dict(slopes=slopes, alibi_mode=opts["alibi_mode"], is_causal=opts["is_causal"],
                  alignment=opts["causal_alignment"])
    if draw(st.booleans()):
        opts["window"] = oracle["window"] = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    if draw(st.booleans()):
        opts["kv_lengths"] = oracle["kv_lengths"] = rng.integers(0, S + 1, B)
    return q, k, v, opts, oracle


@pytest.mark.parametrize("engine", list(ENGINES))
@settings(max_examples=20, deadline=None)
@given(problem=alibi_problem())
def test_each_convention_is_its_peers_formula_in_every_engine(engine, problem):
    q, k, v, opts, oracle = problem
    g = np.random.default_rng(1).standard_normal(q.shape[:-1] + (v.shape[-1],))
    o, lse, (dq, dk, dv, _) = oracle_attention(q, k, v, grad_out=g, **oracle)
    out, res = sdpa_forward(q, k, v, **opts, **ENGINES[engine])
    np.testing.assert_allclose(out, o, rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)
    np.testing.assert_array_equal(np.isneginf(res.lse), np.isneginf(lse))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(res.lse[fin], lse[fin], rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)
    gr = sdpa_backward(res, g)
    for got, want in ((gr.query, dq), (gr.key, dk), (gr.value, dv)):
        np.testing.assert_allclose(got, want, rtol=F64_GRAD_ORACLE, atol=F64_AMPLIFIED)


def _qkv(seed, B=2, Hq=2, L=4, S=6):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, L, 3)), rng.standard_normal((B, Hq, S, 3)),
            rng.standard_normal((B, Hq, S, 2)))


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("extra", [{}, dict(is_causal=True, causal_alignment="bottom_right"), dict(window=(1, 2))])
def test_cudnn_alibi_gradients_and_tangents_match_central_differences(engine, extra):
    q, k, v = _qkv(3)
    kw = dict(alibi_slopes=np.array([0.7, 0.2]), alibi_mode="cudnn", **extra, **ENGINES[engine])
    out0, res0 = sdpa_forward(q, k, v, **kw)

    def f(q, k, v):
        out, res = sdpa_forward(q, k, v, **kw)
        return np.concatenate([out.ravel(), np.where(np.isneginf(res.lse), 0.0, res.lse).ravel()])

    def vjp(g, q, k, v):
        res = sdpa_forward(q, k, v, **kw)[1]
        gr = sdpa_backward(res, g[:out0.size].reshape(out0.shape), grad_lse=g[out0.size:].reshape(out0.shape[:-1]))
        return [gr.query, gr.key, gr.value]

    report = sdpa_ref.check_vjp(f, vjp, [q, k, v], mode="projection", n_projections=3)
    assert report.ok, report
    report = sdpa_ref.check_jvp(lambda q, k, v: sdpa_forward(q, k, v, **kw)[0],
                                lambda ts, q, k, v: sdpa_jvp((q, k, v), tuple(ts), **kw)[1], [q, k, v],
                                mode="projection", n_projections=3)
    assert report.ok, report


@pytest.mark.parametrize("method", ["plain", "tiled"])
@pytest.mark.parametrize("mode", ["flash", "cudnn"])
def test_the_hvp_with_either_convention_matches_differences_of_the_backward(method, mode):
    q, k, v = _qkv(4, B=1)
    fun, vjp, hvp, args, g = loss_derivatives(dict(query=q, key=k, value=v, alibi_slopes=np.array([0.9, 0.3]),
                                                   alibi_mode=mode, window=(2, 1), method=method))
    sdpa_ref.assert_hvp(fun, vjp, hvp, args, cotangent=g, mode="projection", rtol=FD_SECOND_ORDER)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("mode, alignment", [("flash", "top_left"), ("flash", "bottom_right"), ("cudnn", "top_left"),
                                             ("cudnn", "bottom_right")])
def test_alibi_bias_as_bias_is_the_option(engine, mode, alignment):
    q, k, v = _qkv(5)
    slopes = np.array([0.5, 0.25])
    a = sdpa_forward(q, k, v, alibi_slopes=slopes, alibi_mode=mode, causal_alignment=alignment, **ENGINES[engine])
    b = sdpa_forward(q, k, v, bias=alibi_bias(slopes, 4, 6, alignment, mode=mode), causal_alignment=alignment,
                     **ENGINES[engine])
    np.testing.assert_allclose(a[0], b[0], rtol=F64_REGROUPED, atol=F64_REGROUPED)
    np.testing.assert_allclose(a[1].lse, b[1].lse, rtol=F64_REGROUPED, atol=F64_REGROUPED)


def test_the_conventions_agree_exactly_on_keys_before_the_query_top_left():
    """``-m |i - j| = m (j - i)`` for ``j <= i``: top-left causal gives the same bits; a key after the query (no
    causal) or cuDNN's unshifted diagonal under bottom-right causal (``L < S``) does not."""
    q, k, v = _qkv(6, L=4, S=6)
    kw = dict(alibi_slopes=np.array([0.5, 0.25]))
    f = sdpa_forward(q, k, v, is_causal=True, **kw)
    c = sdpa_forward(q, k, v, is_causal=True, alibi_mode="cudnn", **kw)
    np.testing.assert_array_equal(f[0], c[0])
    np.testing.assert_array_equal(f[1].lse, c[1].lse)
    assert not np.allclose(sdpa_forward(q, k, v, **kw)[0], sdpa_forward(q, k, v, alibi_mode="cudnn", **kw)[0])
    br = dict(is_causal=True, causal_alignment="bottom_right", **kw)
    assert not np.allclose(sdpa_forward(q, k, v, **br)[1].lse, sdpa_forward(q, k, v, alibi_mode="cudnn", **br)[1].lse)


def test_cudnn_alibi_ignores_the_offset_flash_alibi_follows_q_offset():
    q, k, v = _qkv(7)
    kw = dict(alibi_slopes=np.array([0.5, 0.25]))
    np.testing.assert_array_equal(sdpa_forward(q, k, v, alibi_mode="cudnn", q_offset=np.array([3, -2]), **kw)[0],
                                  sdpa_forward(q, k, v, alibi_mode="cudnn", **kw)[0])
    want = oracle_attention(q, k, v, slopes=np.broadcast_to(kw["alibi_slopes"], (2, 2)), q_offset=[3, -2])[0]
    np.testing.assert_allclose(sdpa_forward(q, k, v, q_offset=np.array([3, -2]), **kw)[0], want,
                               rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)


@pytest.mark.parametrize("call, err, match", [
    (lambda q, k, v: sdpa_forward(q, k, v, alibi_slopes=[1.0, 1.0], alibi_mode="signed"), ValueError,
     "`alibi_mode` should be one of 'flash', 'cudnn', but got 'signed'"),
    (lambda q, k, v: sdpa_forward(q, k, v, alibi_slopes=[1.0, 1.0], alibi_mode=None), ValueError, "`alibi_mode`"),
    (lambda q, k, v: alibi_bias([1.0], 2, 3, mode="jax"), ValueError, "`mode` should be one of"),
])
def test_a_bad_convention_names_the_argument(call, err, match):
    with pytest.raises(err, match=match):
        call(*_qkv(8))
