"""The gradient through the LSE: ``sdpa_backward(..., grad_lse=)`` (FlashAttention 4's ``dlse``).

``dT = P * (dP - D + dlse)`` with the undropped ``P``. Evidence: central differences of
``<g, out> + <g_lse, lse>`` over every engine and the option grid (hypothesis draws, every input that has a
gradient, the float mask and the bias included); the engines agreeing with each other; wrong
implementations the check must catch; garbage on rows whose LSE is a constant changes no bit; non-finite
``grad_lse`` poisons exactly the gradients that read it; bad input is a clear error.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref import sdpa_backward, sdpa_forward

from strategies import dense_case, differentiable, variant_problem
from tolerances import EXACT, F64_FEW_ULP, F64_GRAD, F64_SUMS

ENGINES = [("fast", "fast", True), ("fast", "plain", True), ("fast", "tiled", True), ("fast", None, False),
           ("reproducible", None, True)]
IDS = ["fast", "plain", "tiled", "tiled-save_probs=False", "reproducible"]


def _bits(a, b):
    return a is None and b is None or (a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())


def _loss_parts(q, k, v, opts, precision, extra=None):
    """``(out, lse with constant rows as 0)``: the function whose VJP ``sdpa_backward`` with ``grad_lse`` is."""
    kw = dict(opts, **(extra or {}))
    out, res = sdpa_forward(q, k, v, precision=precision, **kw)
    lse = res.lse
    return out, np.where(np.isneginf(lse), 0.0, lse)


def _check(q, k, v, opts, precision, method, save_probs, mode="projection", backward=None):
    """check_vjp of ``(q, k, v[, attn_mask, bias])`` -> ``(out, lse)`` with ``sdpa_backward(grad_lse=)``."""
    float_args = [n for n in ("attn_mask", "bias") if n in opts and np.asarray(opts[n]).dtype.kind == "f"]
    base = {n: x for n, x in opts.items() if n not in float_args}
    out_shape, _ = _loss_parts(q, k, v, opts, precision)
    n_out = out_shape.size

    def f(q, k, v, *extra):
        out, lse = _loss_parts(q, k, v, base, precision, dict(zip(float_args, extra)))
        return np.concatenate([out.ravel(), lse.ravel()])

    def vjp(g, q, k, v, *extra):
        _, res = sdpa_forward(q, k, v, precision=precision, save_probs=save_probs,
                              **base, **dict(zip(float_args, extra)))
        go, gl = g[:n_out].reshape(out_shape.shape), g[n_out:].reshape(out_shape.shape[:-1])
        gr = (backward or sdpa_backward)(res, go, method, grad_lse=gl)
        return [gr.query, gr.key, gr.value] + [getattr(gr, n) for n in float_args]

    return sdpa_ref.check_vjp(f, vjp, [q, k, v] + [opts[n] for n in float_args], mode=mode, n_projections=3)


@pytest.mark.parametrize("precision,method,save_probs", ENGINES, ids=IDS)
@settings(max_examples=12)
@given(problem=variant_problem(max_len=4), float_mask=st.booleans())
def test_grad_lse_matches_central_differences_over_the_option_grid(precision, method, save_probs, problem,
                                                                   float_mask):
    q, k, v, opts, _ = problem
    opts = differentiable(opts, float_mask)
    report = _check(q, k, v, opts, precision, method, save_probs)
    assert report.ok, report


@pytest.mark.parametrize("precision,method,save_probs", ENGINES, ids=IDS)
def test_grad_lse_full_jacobian_on_a_dense_case(precision, method, save_probs):
    """Entry by entry, with softcap, a float mask with a fully masked row, a bias, GQA, dropout and padding."""
    q, k, v, opts = dense_case(fully_masked="uniform")
    mode = "projection" if precision == "reproducible" else "full"    # the double-double engine: projections
    report = _check(q, k, v, opts, precision, method, save_probs, mode=mode)
    assert report.ok, report


def _wrong(variant):
    """A backward that gets the LSE's gradient wrong in one way."""
    def backward(res, go, method, grad_lse):
        gl = np.asarray(grad_lse)
        if variant == "ignores grad_lse":
            return sdpa_backward(res, go, method)
        if variant == "the wrong sign":
            return sdpa_backward(res, go, method, grad_lse=-gl)
        if variant == "dropped P":                             # through P_drop instead of P: a factor 1/(1-p)
            return sdpa_backward(res, go, method, grad_lse=gl / 0.75)
        if variant == "only dq":                               # forgets dk
            g = sdpa_backward(res, go, method, grad_lse=gl)
            return g._replace(key=sdpa_backward(res, go, method).key)
        raise AssertionError(variant)
    return backward


@pytest.mark.parametrize("variant", ["ignores grad_lse", "the wrong sign", "dropped P", "only dq"])
def test_the_check_catches_a_wrong_lse_gradient(variant):
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 4, 2)), rng.standard_normal((1, 2, 4, 2))
    opts = dict(dropout_p=0.25, dropout_mask=rng.random((1, 2, 3, 4)) > 0.25)
    assert _check(q, k, v, opts, "fast", "fast", True).ok
    assert not _check(q, k, v, opts, "fast", "fast", True, backward=_wrong(variant)).ok


def _case(policy="zero", seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 2))
    mask = rng.random((2, 4, 5, 6)) < 0.6
    mask[0, 1, 2] = mask[1, 3, 4] = False                      # rows with no key
    opts = dict(attn_mask=mask, enable_gqa=True, q_lengths=np.array([5, 3]), fully_masked=policy, softcap=4.0)
    return q, k, v, opts, rng.standard_normal((2, 4, 5, 2)), rng.standard_normal((2, 4, 5))


@pytest.mark.parametrize("precision,method,save_probs", ENGINES, ids=IDS)
def test_engines_agree_and_zero_grad_lse_is_no_grad_lse(precision, method, save_probs):
    q, k, v, opts, go, gl = _case()
    _, ref = sdpa_forward(q, k, v, **opts)
    want = sdpa_backward(ref, go, "plain", grad_lse=gl)
    _, res = sdpa_forward(q, k, v, precision=precision, save_probs=save_probs, **opts)
    got = sdpa_backward(res, go, method, grad_lse=gl)
    for a, b in zip(got, want):
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=F64_GRAD, atol=F64_SUMS)
    none = sdpa_backward(res, go, method)
    zero = sdpa_backward(res, go, method, grad_lse=np.zeros(gl.shape))
    for a, b in zip(none, zero):
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=EXACT, atol=F64_FEW_ULP)


@pytest.mark.parametrize("policy", ["zero", "uniform", "nan"])
@pytest.mark.parametrize("precision,method,save_probs", ENGINES, ids=IDS)
def test_grad_lse_on_constant_rows_is_never_read(precision, method, save_probs, policy):
    """Rows with no key and padded rows have a constant LSE: any bits in ``grad_lse`` there, no bit moves."""
    q, k, v, opts, go, gl = _case(policy)
    _, res = sdpa_forward(q, k, v, precision=precision, save_probs=save_probs, **opts)
    const = (np.isneginf(res.lse) | (np.arange(5) >= opts["q_lengths"][:, None, None]))
    assert const.any() and not const.all()
    ref = sdpa_backward(res, go, method, grad_lse=np.where(const, 0.0, gl))
    for junk in (np.nan, np.inf, -np.inf, 1e308):
        got = sdpa_backward(res, go, method, grad_lse=np.where(const, junk, gl))
        assert all(_bits(a, b) for a, b in zip(got, ref)), junk


@pytest.mark.parametrize("precision,method,save_probs", ENGINES, ids=IDS)
def test_non_finite_grad_lse_poisons_what_reads_it(precision, method, save_probs):
    """NaN in ``grad_lse[b, h, i]`` reaches ``dq[b, h, i]`` and the keys row i reads (``dk``), not ``dv``."""
    q, k, v, opts, go, gl = _case()
    opts.pop("attn_mask")
    _, res = sdpa_forward(q, k, v, precision=precision, save_probs=save_probs, **opts)
    bad = gl.copy()
    bad[0, 1, 2] = np.nan
    g = sdpa_backward(res, go, method, grad_lse=bad)
    ref = sdpa_backward(res, go, method, grad_lse=gl)
    assert np.isnan(g.query[0, 1, 2]).all() and not np.isnan(np.delete(g.query[0, 1], 2, axis=0)).any()
    assert np.isnan(g.key[0, 0]).all() and not np.isnan(g.key[1]).any() and not np.isnan(g.key[0, 1]).any()
    assert _bits(g.value, ref.value)


def test_grad_lse_is_read_in_the_lse_s_layout_and_dtype():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 4, 2)).astype(np.float32)
    k, v = rng.standard_normal((3, 5, 2)).astype(np.float32), rng.standard_normal((3, 5, 2)).astype(np.float32)
    _, res = sdpa_forward(q, k, v)
    gl = rng.standard_normal((3, 4)).astype(np.float32)
    g = sdpa_backward(res, np.zeros((3, 4, 2), np.float32), grad_lse=gl)
    assert g.query.dtype == np.float32 and np.abs(g.query).max() > 0


@pytest.mark.parametrize("bad,exc", [(np.zeros((2, 4, 4)), ValueError), (np.zeros((2, 4, 5, 1)), ValueError),
                                     (np.zeros((2, 4, 5), complex), TypeError), ("x", TypeError)])
def test_bad_grad_lse_is_a_clear_error(bad, exc):
    q, k, v, opts, go, _ = _case()
    _, res = sdpa_forward(q, k, v, **opts)
    with pytest.raises(exc, match="`grad_lse`"):
        sdpa_backward(res, go, grad_lse=bad)


def test_grad_lse_is_not_written_into():
    q, k, v, opts, go, gl = _case()
    _, res = sdpa_forward(q, k, v, **opts)
    gl[0, 1, 2] = np.nan
    keep = gl.copy()
    gl.flags.writeable = False
    sdpa_backward(res, go, grad_lse=gl)
    assert _bits(gl, keep)


@pytest.mark.parametrize("which", ["query", "key", "value", "bias", "sinks"])
def test_tangents_by_name_are_the_tuple_form(which):
    """``tangents={"value": dv}`` is ``(None, None, dv)``, bit for bit, for every input and engine; a name not
    given is a zero tangent; an unknown name is a ValueError listing the names."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 6, 4)) for _ in range(3))
    kw = dict(is_causal=True, bias=rng.standard_normal((6, 6)), sinks=rng.standard_normal(3))
    shapes = dict(query=q.shape, key=k.shape, value=v.shape, bias=(6, 6), sinks=(3,))
    order = ("query", "key", "value", "bias", "sinks")
    t = rng.standard_normal(shapes[which])
    for method in ("fast", "plain", "tiled"):
        by_name = sdpa_ref.sdpa_jvp((q, k, v), {which: t}, method=method, **kw)[1]
        by_position = sdpa_ref.sdpa_jvp((q, k, v), tuple(t if n == which else None for n in order),
                                        method=method, **kw)[1]
        assert np.array_equal(by_name, by_position)
    g = rng.standard_normal(q.shape)
    h1 = sdpa_ref.sdpa_backward_jvp((q, k, v), {which: t}, g, **kw)
    h2 = sdpa_ref.sdpa_backward_jvp((q, k, v), tuple(t if n == which else None for n in order), g, **kw)
    assert all(a is None and b is None or np.array_equal(a, b) for a, b in zip(h1[-1], h2[-1]))


def test_an_unknown_tangent_name_is_named():
    q = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="`tangents` should map input names .* but got 'dv'"):
        sdpa_ref.sdpa_jvp((q, q, q), {"dv": q})
    with pytest.raises(ValueError, match=r"`tangents\['value'\]` should have the shape"):
        sdpa_ref.sdpa_jvp((q, q, q), {"value": q[0]})


@pytest.mark.parametrize("method", ["fast", "plain", "tiled"])
def test_tangents_by_name_take_qv_and_any_mapping(method):
    """MLA's ``qv`` by name is the sixth slot, bit for bit; a read-only mapping is a mapping too; an empty one is
    every tangent zero (the tuple of Nones)."""
    from types import MappingProxyType

    rng = np.random.default_rng(9)
    q, qv = rng.standard_normal((2, 4, 3, 3)), rng.standard_normal((2, 4, 3, 2))
    k, v = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 4, 5, 2))
    kw = dict(qv=qv, method=method, **({"block_size": 2} if method == "tiled" else {}))
    t = rng.standard_normal(qv.shape)
    by_name = sdpa_ref.sdpa_jvp((q, k, v), MappingProxyType({"qv": t}), **kw)[1]
    by_position = sdpa_ref.sdpa_jvp((q, k, v), (None, None, None, None, None, t), **kw)[1]
    assert np.array_equal(by_name, by_position)
    assert np.array_equal(sdpa_ref.sdpa_jvp((q, k, v), {}, **kw)[1],
                          sdpa_ref.sdpa_jvp((q, k, v), (None, None, None), **kw)[1])


def test_tangents_mixing_positions_and_names_is_refused():
    q = np.zeros((2, 3, 4))
    with pytest.raises(TypeError, match=r"`tangents\[2\]` should be an array .* not both"):
        sdpa_ref.sdpa_jvp((q, q, q), (None, None, {"value": q}))
    with pytest.raises(ValueError, match="but got 2 .*pass a tuple or names, not both"):
        sdpa_ref.sdpa_jvp((q, q, q), {2: q})
    with pytest.raises(ValueError, match="but got 'attn_mask'"):      # AttentionGrads' mask has no tangent
        sdpa_ref.sdpa_jvp((q, q, q), {"attn_mask": q})
    with pytest.raises(TypeError, match="or a mapping by input name"):
        sdpa_ref.sdpa_jvp((q, q, q), q)
    with pytest.raises(TypeError, match=r"`tangents\[0\]` should be an array .* not both"):
        sdpa_ref.sdpa_backward_jvp((q, q, q), ({"query": q}, None, None), q)
