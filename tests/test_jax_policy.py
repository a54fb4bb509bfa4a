"""``fully_masked="jax"``: JAX's finite-sentinel masking, on every engine.

The oracle is JAX's ``_dot_product_attention_core`` written out in NumPy: the scores plus the bias, then every
structurally excluded entry (bool mask, causal, window, key lengths) replaced by the finite sentinel
``-0.7 * finfo.max``, a plain softmax (``exp(x - max)``, NaN on a row of ``-inf``), the dropout, ``P V``, and the
rows past the query lengths zeroed. A row whose allowed keys all have a ``-inf`` bias averages the excluded keys;
one with no excluded key is NaN.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref import sdpa_backward, sdpa_forward, sdpa_jvp

from helpers import assert_close_normwise
from tolerances import F64_AMPLIFIED, F64_FEW_ULP, F64_GRAD

HOWS = {"fast": {}, "plain": {"method": "plain"}, "tiled-2": {"block_size": 2}, "split-2": {"num_splits": 2},
        "reproducible": {"precision": "reproducible"}}
SENTINEL = -0.7 * np.finfo(np.float64).max


def structural(B, H, L, S, o):
    """The structurally allowed entries ``(B, H, L, S)``, by broadcasting index grids (JAX's own way)."""
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    a = np.ones((B, H, L, S), bool)
    if o.get("attn_mask") is not None:
        a &= o["attn_mask"]
    if o.get("is_causal"):
        a &= j <= i
    if o.get("window") is not None:
        left = o["window"][0]
        a &= j >= i - left
    if o.get("kv_lengths") is not None:
        a &= j < np.asarray(o["kv_lengths"])[:, None, None, None]
    return a


def jax_oracle(q, k, v, o):
    B, H, L, E = q.shape
    S = k.shape[2]
    T = q @ np.swapaxes(k, -1, -2) / np.sqrt(E)
    if o.get("bias") is not None:
        T = T + o["bias"]
    T = np.where(structural(B, H, L, S, o), T, SENTINEL)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(T - T.max(-1, keepdims=True))
        P = e / e.sum(-1, keepdims=True)
    if o.get("dropout_mask") is not None:
        P = P * o["dropout_mask"] / (1 - o["dropout_p"])
    out = P @ v
    if o.get("q_lengths") is not None:
        out = np.where(np.arange(L)[:, None] < np.asarray(o["q_lengths"])[:, None, None, None], out, 0.0)
    return out


@st.composite
def problems(draw):
    B, H, L, S, E = (draw(st.integers(1, n)) for n in (2, 2, 5, 6, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (rng.standard_normal(s) for s in ((B, H, L, E), (B, H, S, E), (B, H, S, 2)))
    o = {"fully_masked": "jax", "is_causal": draw(st.booleans())}
    if draw(st.booleans()):
        o["attn_mask"] = rng.random((B, H, L, S)) > 0.4
    bias = rng.standard_normal((B, H, L, S))
    bias[rng.random((B, H, L, S)) < draw(st.sampled_from([0.0, 0.5, 0.9]))] = -np.inf
    for r in range(L):                                             # rows of -inf: all, or the allowed ones
        if rng.random() < 0.3:
            bias[..., r, :] = -np.inf
    o["bias"] = bias
    if draw(st.booleans()):
        o["kv_lengths"] = rng.integers(0, S + 1, B)
    if draw(st.booleans()):
        o["q_lengths"] = rng.integers(0, L + 1, B)
    if draw(st.booleans()):
        o["window"] = (draw(st.integers(0, 2)), None)
    if draw(st.booleans()):
        o["dropout_mask"], o["dropout_p"] = rng.random((B, H, L, S)) > 0.25, 0.25
    return (q, k, v), o


@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(problem=problems())
def test_every_engine_gives_jax_s_result(problem, how):
    (q, k, v), o = problem
    want = jax_oracle(q, k, v, o)
    got = sdpa_forward(q, k, v, **o, **HOWS[how])[0]
    assert_close_normwise(want, got, F64_AMPLIFIED)


@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(problem=problems())
def test_every_engine_gives_the_same_gradients_and_tangents(problem, how):
    (q, k, v), o = problem
    rng = np.random.default_rng(1)
    out, res = sdpa_forward(q, k, v, **o, method="plain")
    g = rng.standard_normal(out.shape)
    ts = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    want = (sdpa_backward(res, g), sdpa_jvp((q, k, v), ts, **o, method="plain")[1])
    out2, res2 = sdpa_forward(q, k, v, **o, **HOWS[how])
    kw = {k2: v2 for k2, v2 in HOWS[how].items() if k2 != "block_size"}
    got = (sdpa_backward(res2, g), sdpa_jvp((q, k, v), ts, **o, **kw)[1])
    for a, b in zip(want[0], got[0]):
        assert_close_normwise(a, b, F64_GRAD)
    assert_close_normwise(want[1], got[1], F64_GRAD)


def test_a_row_emptied_by_minus_inf_floats_averages_the_excluded_keys_and_its_gradients_are_exact():
    """Row 1 allows keys 2..4, all with a -inf bias: JAX averages keys 0 and 1 (the sentinel's), so dV gets
    g / 2 on each, and nothing reaches q, k or the bias from that row. Row 2 is -inf everywhere and allows every
    key: NaN, as the "nan" policy."""
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 1, 3, 2)), rng.standard_normal((1, 1, 5, 2)), rng.standard_normal((1, 1, 5, 3))
    mask = np.ones((3, 5), bool)
    mask[1, :2] = False
    bias = np.zeros((3, 5))
    bias[1, 2:] = -np.inf
    bias[2] = -np.inf
    out, res = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, fully_masked="jax")
    np.testing.assert_allclose(out[0, 0, 1], v[0, 0, :2].mean(0), rtol=F64_FEW_ULP)
    assert np.isnan(out[0, 0, 2]).all() and np.isfinite(out[0, 0, :2]).all()
    uniform = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, fully_masked="uniform")[0]
    np.testing.assert_allclose(uniform[0, 0, 1], v[0, 0].mean(0), rtol=F64_FEW_ULP)     # the difference
    _, res = sdpa_forward(q[:, :, :2], k, v, attn_mask=mask[:2], bias=bias[:2], fully_masked="jax")
    g = np.zeros((1, 1, 2, 3))                                     # (with row 2, every dV would be NaN)
    g[0, 0, 1] = rng.standard_normal(3)
    gr = sdpa_backward(res, g)
    np.testing.assert_allclose(gr.value[0, 0, :2], np.tile(g[0, 0, 1] / 2, (2, 1)), rtol=F64_FEW_ULP)
    assert np.all(gr.value[0, 0, 2:] == 0) and np.all(gr.query == 0) and np.all(gr.key == 0)
    assert np.all(gr.bias[1] == 0)


def test_without_minus_inf_floats_jax_is_uniform_bit_for_bit():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 2))
    o = dict(attn_mask=rng.random((2, 2, 4, 6)) > 0.7, is_causal=True, kv_lengths=np.array([6, 2]))
    for how in HOWS.values():
        a, ra = sdpa_forward(q, k, v, fully_masked="uniform", **o, **how)
        b, rb = sdpa_forward(q, k, v, fully_masked="jax", **o, **how)
        np.testing.assert_array_equal(a, b)
        g = rng.standard_normal(a.shape)
        for x, y in zip(sdpa_backward(ra, g), sdpa_backward(rb, g)):
            np.testing.assert_array_equal(x, y)


def test_the_gradients_match_central_differences():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 4, 2)), rng.standard_normal((1, 2, 4, 2))
    mask = np.ones((3, 4), bool)
    mask[0, :2] = False
    bias = rng.standard_normal((2, 3, 4))
    bias[:, 0, 2:] = -np.inf                                       # row 0 averages keys 0 and 1
    o = dict(attn_mask=mask, bias=bias, fully_masked="jax", softcap=2.0)
    for how in ({}, {"block_size": 2}):
        f = lambda q, k, v: sdpa_forward(q, k, v, **o, **how)[0]                       # noqa: E731
        vjp = lambda g, q, k, v: sdpa_backward(sdpa_forward(q, k, v, **o, **how)[1], g)[:3]   # noqa: E731
        assert sdpa_ref.check_vjp(f, vjp, (q, k, v)).ok
        jvp = lambda t, q, k, v: sdpa_jvp((q, k, v), t, **o, **how)[1]                 # noqa: E731
        assert sdpa_ref.check_jvp(f, jvp, (q, k, v)).ok


@pytest.mark.parametrize("how", list(HOWS))
def test_a_jax_row_reads_only_the_keys_it_averages(how):
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 1, 2, 2)), rng.standard_normal((1, 1, 4, 2)), rng.standard_normal((1, 1, 4, 2))
    mask = np.array([[False, True, True, True], [True] * 4])
    bias = np.zeros((2, 4))
    bias[0, 1:] = -np.inf                                          # row 0: averages key 0 only
    clean = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, fully_masked="jax", **HOWS[how])[0]
    v2 = v.copy()
    v2[0, 0, 2] = np.nan                                           # read by row 1, not by row 0
    out = sdpa_forward(q, k, v2, attn_mask=mask, bias=bias, fully_masked="jax", **HOWS[how])[0]
    np.testing.assert_array_equal(out[0, 0, 0], clean[0, 0, 0])
    assert np.isnan(out[0, 0, 1]).any()
    v3 = v.copy()
    v3[0, 0, 0] = np.inf                                           # the key row 0 averages
    assert np.isnan(sdpa_forward(q, k, v3, attn_mask=mask, bias=bias, fully_masked="jax",
                                 **HOWS[how])[0][0, 0, 0]).all()


def test_jax_with_a_layout_is_refused_and_s_zero_gives_zero():
    """S = 0: JAX's P V sums over no key, 0 (tests/test_edges_peers.py checks the gradients and every engine)."""
    x = np.zeros((3, 1, 2))
    with pytest.raises(ValueError, match="`fully_masked`"):
        sdpa_forward(x, x, x, layout=sdpa_ref.Packed([0, 3], [0, 3]), fully_masked="jax")
    out = sdpa_forward(np.zeros((1, 2, 2)), np.zeros((1, 0, 2)), np.zeros((1, 0, 2)), fully_masked="jax")[0]
    np.testing.assert_array_equal(out, np.zeros((1, 2, 2)))


@pytest.mark.parametrize("how", list(HOWS))
def test_a_row_of_minus_inf_with_lengths_but_no_excluded_key_is_nan(how):
    """Regression: with q_lengths the allowed set broadcasts over the keys (shape (..., L, 1)); its count of
    excluded keys must count every key, not one."""
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 2, 1, 2)), rng.standard_normal((2, 2, 2, 2)), rng.standard_normal((2, 2, 2, 2))
    bias = np.zeros((2, 2, 1, 2))
    bias[1, 0] = -np.inf
    o = dict(bias=bias, fully_masked="jax", q_lengths=np.array([1, 1]))
    out = sdpa_forward(q, k, v, **o, **HOWS[how])[0]
    assert np.isnan(out[1, 0]).all() and np.isfinite(out[0]).all() and np.isfinite(out[1, 1]).all()
    assert_close_normwise(jax_oracle(q, k, v, o), out, F64_AMPLIFIED)
