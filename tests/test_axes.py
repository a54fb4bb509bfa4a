"""layout="bshd" (sdpa_ref.axes): every entry point takes (..., L, H, E) and gives its results in it, bit for bit
the package's own (..., H, L, E) results with the two axes swapped; the LSE, masks, biases and sinks keep theirs."""

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref import sdpa_backward, sdpa_backward_jvp, sdpa_forward, sdpa_hvp, sdpa_jvp


def sw(x):
    return None if x is None else np.swapaxes(x, -3, -2)


def draw(seed=0, B=2, L=5, S=7, Hq=4, Hkv=2, E=3, Ev=6):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, L, Hq, E))
    k = rng.standard_normal((B, S, Hkv, E))
    v = rng.standard_normal((B, S, Hkv, Ev))
    return q, k, v, rng


OPTIONS = [
    dict(is_causal=True, enable_gqa=True),
    dict(enable_gqa=True, window=(2, 0), causal_alignment="bottom_right", softcap=2.0),
    dict(enable_gqa=True, sinks=np.linspace(-1, 1, 4)),
]


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("method", [None, "plain", "tiled"])
def test_forward_backward_and_jvp_are_the_swapped_dense_results(opts, method):
    q, k, v, rng = draw()
    bias = rng.standard_normal((2, 4, 5, 7))                      # dense (..., H, L, S) in either layout
    out, res = sdpa_forward(q, k, v, layout="bshd", method=method, bias=bias, **opts)
    ref, rres = sdpa_forward(sw(q), sw(k), sw(v), method=method, bias=bias, **opts)
    assert out.shape == (2, 5, 4, 6) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, sw(ref))
    np.testing.assert_array_equal(res.lse, rres.lse)              # the LSE stays (B, H, L), as FlashAttention's
    g, gl = rng.standard_normal(out.shape), rng.standard_normal(res.lse.shape)
    got, want = sdpa_backward(res, g, grad_lse=gl), sdpa_backward(rres, sw(g), grad_lse=gl)
    for name in ("query", "key", "value"):
        np.testing.assert_array_equal(getattr(got, name), sw(getattr(want, name)))
    np.testing.assert_array_equal(got.bias, want.bias)
    t = {"query": rng.standard_normal(q.shape), "value": rng.standard_normal(v.shape)}
    o1, do1 = sdpa_jvp((q, k, v), t, layout="bshd", method=method, bias=bias, **opts)
    o2, do2 = sdpa_jvp((sw(q), sw(k), sw(v)), {n: sw(x) for n, x in t.items()}, method=method, bias=bias, **opts)
    np.testing.assert_array_equal(o1, sw(o2))
    np.testing.assert_array_equal(do1, sw(do2))


def test_second_order_in_bshd():
    q, k, v, rng = draw(1)
    t = (rng.standard_normal(q.shape), rng.standard_normal(k.shape), rng.standard_normal(v.shape))
    g = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    h1 = sdpa_hvp((q, k, v), t, g, layout="bshd", is_causal=True, enable_gqa=True)
    h2 = sdpa_hvp(tuple(map(sw, (q, k, v))), tuple(map(sw, t)), sw(g), is_causal=True, enable_gqa=True)
    for a, b in zip(h1[:3], h2[:3]):
        np.testing.assert_array_equal(a, sw(b))
    gt = rng.standard_normal(g.shape)
    (g1, t1) = sdpa_backward_jvp((q, k, v), t, g, gt, layout="bshd", is_causal=True, enable_gqa=True)
    (g2, t2) = sdpa_backward_jvp(tuple(map(sw, (q, k, v))), tuple(map(sw, t)), sw(g), sw(gt), is_causal=True,
                                 enable_gqa=True)
    for a, b in zip(g1[:3] + t1[:3], g2[:3] + t2[:3]):
        np.testing.assert_array_equal(a, sw(b))


def test_reproducible_and_mla_qv_in_bshd():
    q, k, v, rng = draw(2, Hq=2, Hkv=2)
    qv = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
    out, res = sdpa_forward(q, k, v, layout="bshd", precision="reproducible", is_causal=True)
    ref, _ = sdpa_forward(sw(q), sw(k), sw(v), precision="reproducible", is_causal=True)
    np.testing.assert_array_equal(out, sw(ref))
    o1, r1 = sdpa_forward(q, k, v, layout="bshd", qv=qv)
    o2, r2 = sdpa_forward(sw(q), sw(k), sw(v), qv=sw(qv))
    np.testing.assert_array_equal(o1, sw(o2))
    g = rng.standard_normal(o1.shape)
    a, b = sdpa_backward(r1, g), sdpa_backward(r2, sw(g))
    for name in ("query", "key", "value", "qv"):
        np.testing.assert_array_equal(getattr(a, name), sw(getattr(b, name)))


def test_bhsd_is_the_default_and_the_results_are_the_callers_own():
    q, k, v, _ = draw(3, Hq=2)
    a, _ = sdpa_forward(sw(q), sw(k), sw(v), layout="bhsd")
    b, _ = sdpa_forward(sw(q), sw(k), sw(v))
    np.testing.assert_array_equal(a, b)
    q0 = q.copy()
    out, res = sdpa_forward(q, k, v, layout="bshd")
    out[...] = 0                                              # the caller's array: nothing kept changes
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(res.out, sdpa_forward(q, k, v, layout="bshd")[0])


def test_bad_layouts_are_named():
    q, k, v, _ = draw(4)
    with pytest.raises(ValueError, match="`layout` should be one of .*'bshd'.* but got 'bhds'"):
        sdpa_forward(q, k, v, layout="bhds")
    with pytest.raises(ValueError, match=r"`query` should have at least 3 dims \(\.\.\., L, H, E\)"):
        sdpa_forward(q[0, :, 0], k[0, :, 0], v[0, :, 0], layout="bshd")
    with pytest.raises(ValueError, match="grad_out"):
        _, res = sdpa_forward(q, k, v, layout="bshd", enable_gqa=True)
        sdpa_backward(res, np.zeros((2, 4, 5, 6)))            # the bhsd shape where bshd is due


def test_the_namespace():
    assert sdpa_ref.axes.DENSE_LAYOUTS == ("bhsd", "bshd")
