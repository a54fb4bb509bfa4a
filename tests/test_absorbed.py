"""MLA's absorbed attention, ``qv``: scores ``scale (q k^T + qv v^T)``, the default scale ``1 / sqrt(E + Ev)``.

The oracle writes the two score terms out by hand (no join), with the same options; every engine, and the layouts,
must give its forward, backward and JVP, and central differences prove the gradients, ``dV`` collecting both uses
of ``V``.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref import Packed, sdpa_backward, sdpa_forward, sdpa_jvp

from helpers import assert_close_normwise
from tolerances import F64_AMPLIFIED, F64_REGROUPED, F64_SUMS

HOWS = {"fast": {}, "plain": {"method": "plain"}, "tiled-2": {"block_size": 2},
        "reproducible": {"precision": "reproducible"}}


def oracle(q, k, v, qv, is_causal=False, softcap=None, scale=None):
    """``(out, lse)`` with the two score terms written out: ``(B, Hq, L, E)``, GQA by repeating the kv heads."""
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = 1 / np.sqrt(q.shape[-1] + v.shape[-1]) if scale is None else scale
    T = s * (q @ np.swapaxes(k, -1, -2)) + s * (qv @ np.swapaxes(v, -1, -2))
    if softcap:
        T = softcap * np.tanh(T / softcap)
    if is_causal:
        L, S = T.shape[-2:]
        T = np.where(np.arange(S)[None, :] <= np.arange(L)[:, None] + S - L, T, -np.inf)
    m = T.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(T - m)
    z = e.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(z > 0, e / np.where(z > 0, z, 1), 0) @ v, (np.log(z) + m)[..., 0]


@st.composite
def problems(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    L, S, E, Ev = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = (rng.standard_normal((B, Hkv * G, L, E)), rng.standard_normal((B, Hkv, S, E)),
              rng.standard_normal((B, Hkv, S, Ev)), rng.standard_normal((B, Hkv * G, L, Ev)))
    o = {"is_causal": draw(st.booleans()), "softcap": draw(st.sampled_from([None, 2.0])),
         "scale": draw(st.sampled_from([None, 0.7]))}
    return arrays, o


@given(problems())
def test_the_two_score_terms_are_the_oracles(problem):
    (q, k, v, qv), o = problem
    out, res = sdpa_forward(q, k, v, qv=qv, enable_gqa=True, causal_alignment="bottom_right", **o)
    want_out, want_lse = oracle(q, k, v, qv, **o)
    np.testing.assert_allclose(out, want_out, rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)
    np.testing.assert_allclose(res.lse, want_lse, rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)


@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(problem=problems())
def test_every_engine_gives_the_same_forward_backward_and_jvp(problem, how):
    (q, k, v, qv), o = problem
    o = dict(o, enable_gqa=True, causal_alignment="bottom_right")
    rng = np.random.default_rng(2)
    g = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    ts = tuple(rng.standard_normal(x.shape) for x in (q, k, v)) + (None, None, rng.standard_normal(qv.shape))
    got = []
    for kw in ({"method": "plain"}, HOWS[how]):
        out, res = sdpa_forward(q, k, v, qv=qv, **o, **kw)
        gr = sdpa_backward(res, g)
        got.append((out, gr.query, gr.key, gr.value, gr.qv, sdpa_jvp((q, k, v), ts, qv=qv, **o, **kw)[1]))
    for a, b in zip(*got):
        assert_close_normwise(a, b, F64_SUMS)


def test_the_gradients_and_tangents_match_central_differences_v_read_twice():
    rng = np.random.default_rng(3)
    q, k, v, qv = (rng.standard_normal(s) for s in ((1, 4, 3, 2), (1, 2, 4, 2), (1, 2, 4, 3), (1, 4, 3, 3)))
    o = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", softcap=2.0,
             sinks=np.array([0.2, -1.0, 0.5, 0.1]))
    f = lambda q, k, v, qv: sdpa_forward(q, k, v, qv=qv, **o)[0]                              # noqa: E731

    def vjp(g, q, k, v, qv):
        gr = sdpa_backward(sdpa_forward(q, k, v, qv=qv, **o)[1], g)
        return gr.query, gr.key, gr.value, gr.qv
    assert sdpa_ref.check_vjp(f, vjp, (q, k, v, qv)).ok
    jvp = lambda t, q, k, v, qv: sdpa_jvp((q, k, v), (t[0], t[1], t[2], None, None, t[3]), qv=qv, **o)[1]  # noqa
    assert sdpa_ref.check_jvp(f, jvp, (q, k, v, qv)).ok


def test_qv_in_the_layouts_is_each_sequences_qv():
    rng = np.random.default_rng(4)
    q, k, v, qv = rng.standard_normal((5, 2, 3)), rng.standard_normal((6, 1, 3)), rng.standard_normal((6, 1, 2)), \
        rng.standard_normal((5, 2, 2))
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 4, 6])
    out, res = sdpa_forward(q, k, v, qv=qv, layout=Packed(cu_q, cu_k), enable_gqa=True, is_causal=True,
                            causal_alignment="bottom_right")
    g = rng.standard_normal(out.shape)
    gr = sdpa_backward(res, g)
    for b in range(2):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        t = lambda x: np.swapaxes(x, 0, 1)[None]                                            # noqa: E731
        o_b, r_b = sdpa_forward(t(q[rq]), t(k[rk]), t(v[rk]), qv=t(qv[rq]), enable_gqa=True, is_causal=True,
                                causal_alignment="bottom_right")
        np.testing.assert_allclose(out[rq], np.swapaxes(o_b[0], 0, 1), rtol=F64_SUMS, atol=F64_REGROUPED)
        gb = sdpa_backward(r_b, t(g[rq]))
        for x, y, rows in ((gr.qv, gb.qv, rq), (gr.value, gb.value, rk), (gr.key, gb.key, rk)):
            np.testing.assert_allclose(x[rows], np.swapaxes(y[0], 0, 1), rtol=F64_SUMS, atol=F64_REGROUPED)
    qd, kc, vc = rng.standard_normal((1, 1, 2, 3)), rng.standard_normal((3, 4, 1, 3)), rng.standard_normal((3, 4, 1, 2))
    qvd = rng.standard_normal((1, 1, 2, 2))
    a = sdpa_ref.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=np.array([6]), block_table=np.array([[2, 0]]),
                                         qv=qvd)
    pos = np.arange(6)
    ks, vs = kc[np.array([2, 0])[pos // 4], pos % 4], vc[np.array([2, 0])[pos // 4], pos % 4]
    want = oracle(np.swapaxes(qd, 1, 2), np.swapaxes(ks, 0, 1)[None], np.swapaxes(vs, 0, 1)[None],
                  np.swapaxes(qvd, 1, 2))[0]
    np.testing.assert_allclose(a, np.swapaxes(want, 1, 2), rtol=F64_SUMS, atol=F64_REGROUPED)


def test_a_nan_in_v_reaches_the_scores_through_qv():
    rng = np.random.default_rng(5)
    q, k, v, qv = (rng.standard_normal(s) for s in ((1, 1, 2, 2), (1, 1, 3, 2), (1, 1, 3, 2), (1, 1, 2, 2)))
    v[0, 0, 2, 1] = np.nan
    # bottom-right causal: row 1 sees keys 0..2, row 0 keys 0..1
    out = sdpa_forward(q, k, v, qv=qv, is_causal=True, causal_alignment="bottom_right")[0]
    assert np.isnan(out[0, 0, 1]).all() and not np.isnan(out[0, 0, 0]).any()


@pytest.mark.parametrize("kw, match", [
    (dict(qv=np.zeros((1, 1, 2, 3))), "`qv`"),
    (dict(qv=np.zeros((1, 1, 3, 2))), "`qv`"),
])
def test_a_bad_qv_names_itself(kw, match):
    x = np.zeros((1, 1, 2, 2))
    with pytest.raises(ValueError, match=match):
        sdpa_forward(x, x, x, **kw)
    with pytest.raises(ValueError, match="qv tangent"):
        sdpa_jvp((x, x, x), (x, None, None, None, None, x))
    with pytest.raises(ValueError, match="`qv`"):
        sdpa_ref.sdpa_forward_complex(x, x, x, qv=x)


def test_absorbed_grads_carry_qv_and_the_six_fields_keep_their_places():
    x = np.random.default_rng(6).standard_normal((1, 2, 2))
    gr = sdpa_backward(sdpa_forward(x, x, x, qv=x)[1], x)
    assert isinstance(gr, sdpa_ref.AbsorbedGrads) and gr._fields[:6] == sdpa_ref.AttentionGrads._fields
    assert gr._fields[6] == "qv" and gr.qv.shape == x.shape and gr.sinks is None
    assert type(sdpa_backward(sdpa_forward(x, x, x)[1], x)) is sdpa_ref.AttentionGrads
