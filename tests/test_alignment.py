"""The diagonal's offset: ``causal_alignment`` and the per-sequence ``q_offset`` (query row ``i`` of sequence ``b``
at position ``i + q_offset[b]`` on the keys' axis, the diagonal of causal, the window, the chunks and ALiBi).

Evidence: ``q_offset = S - L`` (and ``kv_len - q_len`` per sequence) gives the bits of ``"bottom_right"``; the
Python-loop oracle (tests/oracle.py) with ALiBi, causal, windows and lengths in every engine, forward, LSE and
backward; central differences of the forward (VJP, JVP) and of the backward (HVP); bad input (tests/test_masks.py
holds the allowed set entry by entry).
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref import sdpa_backward, sdpa_forward, sdpa_jvp
from sdpa_ref.alignment import check_q_offset, diagonal_offset

from helpers import loss_derivatives
from oracle import oracle_attention
from tolerances import F64_AMPLIFIED, F64_GRAD_ORACLE, FD_SECOND_ORDER

ENGINES = {"fast": {}, "plain": {"method": "plain"}, "tiled-2": {"block_size": 2}, "split-2": {"num_splits": 2},
           "reproducible": {"precision": "reproducible"}}


def _qkv(seed, B=2, Hq=2, L=4, S=6):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, L, 3)), rng.standard_normal((B, Hq, S, 3)),
            rng.standard_normal((B, Hq, S, 2)))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_q_offset_of_s_minus_l_is_bottom_right_bit_for_bit(engine):
    q, k, v = _qkv(1)
    kl, ql = np.array([5, 2]), np.array([4, 1])
    for br, off in ((dict(), np.array([2, 2])), (dict(kv_lengths=kl, q_lengths=ql), kl - ql)):
        kw = dict(is_causal=True, window=(2, None), alibi_slopes=np.array([0.3, 0.6]), attention_chunk=3, **br,
                  **ENGINES[engine])
        a = sdpa_forward(q, k, v, causal_alignment="bottom_right", **kw)
        b = sdpa_forward(q, k, v, q_offset=off, **kw)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1].lse, b[1].lse)
        g = np.random.default_rng(2).standard_normal(a[0].shape)
        for x, y in zip(sdpa_backward(a[1], g)[:3], sdpa_backward(b[1], g)[:3]):
            np.testing.assert_array_equal(x, y)


@st.composite
def offset_problem(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    B, Hq, L, S = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    q, k, v = rng.standard_normal((B, Hq, L, 3)), rng.standard_normal((B, Hq, S, 3)), rng.standard_normal((B, Hq, S, 2))
    off = rng.integers(-L - 1, S + 2, B)
    opts, oracle = dict(q_offset=off, is_causal=draw(st.booleans())), dict(q_offset=off)
    oracle["is_causal"] = opts["is_causal"]
    if draw(st.booleans()):
        opts["alibi_slopes"] = rng.uniform(0.0, 1.0, (B, Hq))
        oracle["slopes"] = opts["alibi_slopes"]
    if draw(st.booleans()):
        opts["window"] = oracle["window"] = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    if draw(st.booleans()):
        opts["kv_lengths"] = oracle["kv_lengths"] = rng.integers(0, S + 1, B)
        opts["q_lengths"] = oracle["q_lengths"] = rng.integers(0, L + 1, B)
    return q, k, v, opts, oracle


@pytest.mark.parametrize("engine", list(ENGINES))
@settings(max_examples=20, deadline=None)
@given(problem=offset_problem())
def test_q_offset_is_the_loop_oracles_diagonal_in_every_engine(engine, problem):
    q, k, v, opts, oracle = problem
    g = np.random.default_rng(3).standard_normal(q.shape[:-1] + (v.shape[-1],))
    o, lse, (dq, dk, dv, _) = oracle_attention(q, k, v, grad_out=g, **oracle)
    out, res = sdpa_forward(q, k, v, **opts, **ENGINES[engine])
    np.testing.assert_allclose(out, o, rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)
    np.testing.assert_array_equal(np.isneginf(res.lse), np.isneginf(lse))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(res.lse[fin], lse[fin], rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)
    gr = sdpa_backward(res, g)
    for got, want in ((gr.query, dq), (gr.key, dk), (gr.value, dv)):
        np.testing.assert_allclose(got, want, rtol=F64_GRAD_ORACLE, atol=F64_AMPLIFIED)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_q_offset_gradients_and_tangents_match_central_differences(engine):
    q, k, v = _qkv(4)
    kw = dict(q_offset=np.array([3, -1]), is_causal=True, window=(2, None), alibi_slopes=np.array([0.4, 0.8]),
              **ENGINES[engine])
    out0 = sdpa_forward(q, k, v, **kw)[0]

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
def test_the_hvp_with_q_offset_matches_differences_of_the_backward(method):
    q, k, v = _qkv(5)
    fun, vjp, hvp, args, g = loss_derivatives(dict(query=q, key=k, value=v, q_offset=np.array([2, -1]),
                                                   is_causal=True, alibi_slopes=np.array([0.5, 0.2]),
                                                   method=method))
    sdpa_ref.assert_hvp(fun, vjp, hvp, args, cotangent=g, mode="projection", rtol=FD_SECOND_ORDER)


def test_diagonal_offset_is_the_one_home_of_the_diagonal():
    assert diagonal_offset(3, 5, "top_left") == 0 and diagonal_offset(3, 5, "bottom_right") == 2
    got = diagonal_offset(3, 5, "top_left", q_offset=np.array([4, -1]))
    assert got.shape == (2, 1, 1, 1) and got.ravel().tolist() == [4, -1]
    x = np.array([1, 2], dtype=np.int32)
    assert check_q_offset(x, (2,)).dtype == np.int64 and x.dtype == np.int32        # a copy; the input untouched
    with pytest.raises(TypeError, match="`q_offset` should be an integer array"):
        check_q_offset(True, ())
