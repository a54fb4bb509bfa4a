"""The checker itself: it passes right gradients and catches wrong ones."""

import numpy as np
import pytest

from sdpa_ref import (
    assert_vjp,
    check_jvp,
    check_vjp,
    numerical_jacobian,
    sdpa_backward,
    sdpa_forward,
    softmax,
    softmax_jacobian,
    softmax_vjp,
)
from tolerances import COMPLEX_STEP, COMPLEX_STEP_ATOL, F64_FEW_ULP, FD, FD_ATOL, FD_ATOL_SMOOTH, FD_LOOSE


def _swap(x):
    return np.swapaxes(x, -1, -2)


MODES = ["full", "projection"]
rng = np.random.default_rng(0)
X = rng.standard_normal((3, 5))


# ----------------------------------------------------------- right answers


def test_numerical_jacobian_of_softmax():
    x = rng.standard_normal(4)
    (J,) = numerical_jacobian(softmax, (x,))
    np.testing.assert_allclose(J, softmax_jacobian(softmax(x)), atol=FD_ATOL_SMOOTH)


def test_numerical_jacobian_of_a_product():
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((3, 2))
    Ja, Jb = numerical_jacobian(lambda a, b: a @ b, (a, b))
    assert Ja.shape == (2, 2, 2, 3) and Jb.shape == (2, 2, 3, 2)
    np.testing.assert_allclose(Ja[0, 1, 0], b[:, 1], atol=FD_ATOL)
    np.testing.assert_allclose(Jb[1, 0, :, 0], a[1], atol=FD_ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_right_softmax_vjp_passes(mode):
    rep = check_vjp(softmax, lambda g, x: (softmax_vjp(softmax(x), g),), (X,), mode=mode, rtol=FD)
    assert rep.ok and rep.max_rel_error < FD
    assert "ok" in str(rep)


def test_exact_zeros_pass_by_the_absolute_floor():
    # d/dx of x[0] w.r.t. x[1] is exactly 0; the difference quotient may be 1e-17
    rep = check_vjp(lambda x: x * 1.0, lambda g, x: (g,), (rng.standard_normal(4),))
    assert rep.ok


def test_caller_arrays_not_perturbed_even_by_a_mutating_fun():
    x = rng.standard_normal(5)
    x0 = x.copy()

    def fun(x):
        y = softmax(x)
        x += 1.0          # a badly behaved function
        return y

    check_vjp(fun, lambda g, x: (softmax_vjp(softmax(x), g),), (x,))
    np.testing.assert_array_equal(x, x0)


def test_nan_agrees_with_nan_but_not_with_a_number():
    from sdpa_ref.gradcheck.report import errors as _errors

    a = np.array([np.nan, np.nan, 1.0, np.inf, 2.0])
    n = np.array([np.nan, 1.0, np.nan, np.inf, 2.0 + 1e-12])
    abs_err, rel, _ = _errors(a, n)
    np.testing.assert_array_equal(abs_err[:4], [0.0, np.inf, np.inf, 0.0])
    np.testing.assert_array_equal(rel[:4], [0.0, 1.0, 1.0, 0.0])
    # a function whose output has a NaN entry: J's NaN row matches a NaN gradient row
    c = np.array([0.0, np.nan])
    f = lambda x: x + c  # noqa: E731

    def vjp(g, x):   # J = [[1, 0], [nan, nan]] applied as J^T g, skipping exact-zero cotangents
        return (np.array([g[0], 0.0]) + (np.nan if g[1] != 0 else 0.0),)

    assert check_vjp(f, vjp, (np.array([1.0, 2.0]),)).ok
    assert not check_vjp(f, lambda g, x: (g,), (np.array([1.0, 2.0]),)).ok


def test_non_finite_inputs_are_left_out():
    x = np.array([0.5, -np.inf, 1.0])
    rep = check_vjp(softmax, lambda g, x: (softmax_vjp(softmax(x), g),), (x,))
    assert rep.ok
    assert rep.per_arg[0]["total"] == 3 * 2


def test_wrong_shape_from_vjp_is_a_clear_error():
    with pytest.raises(ValueError, match="`vjp`"):
        check_vjp(softmax, lambda g, x: (g[:2],), (X,))
    with pytest.raises(TypeError, match="`args`"):
        check_vjp(softmax, lambda g, x: (g,), X)
    with pytest.raises(ValueError, match="`mode`"):
        check_vjp(softmax, lambda g, x: (g,), (X,), mode="fast")


# ------------------------------------------------------------ wrong answers


@pytest.mark.parametrize("mode", MODES)
def test_catches_elementwise_y_one_minus_y(mode):
    wrong = lambda g, x: (softmax(x) * (1 - softmax(x)) * g,)  # noqa: E731
    rep = check_vjp(softmax, wrong, (X,), mode=mode)
    assert not rep.ok
    assert rep.worst is not None and rep.worst.abs_error > 1e-3
    assert "FAILED" in str(rep)


@pytest.mark.parametrize("mode", MODES)
def test_catches_missing_sum_term(mode):
    wrong = lambda g, x: (softmax(x) * g,)  # noqa: E731
    assert not check_vjp(softmax, wrong, (X,), mode=mode).ok


def test_assert_vjp_raises_with_the_table():
    with pytest.raises(AssertionError, match="worst: arg 0 index"):
        assert_vjp(softmax, lambda g, x: (softmax(x) * g,), (X,))


def test_projection_failure_falls_back_to_full_and_locates():
    rep = check_vjp(softmax, lambda g, x: (softmax(x) * g,), (X,), mode="projection")
    assert rep.mode == "projection, then full"
    assert rep.worst.output_index is not None and len(rep.worst.index) == 2


def _attention_problem():
    r = np.random.default_rng(1)
    return r.standard_normal((2, 3, 4)), r.standard_normal((2, 5, 4)), r.standard_normal((2, 5, 3))


def _wrong_attention_vjp(variant):
    """The reference backward with one plausible derivation error."""

    def vjp(g, q, k, v):
        out, res = sdpa_forward(q, k, v)
        P = res.probs
        dv = _swap(P) @ g
        dP = g @ _swap(v)
        dT = P * (dP - np.sum(P * dP, -1, keepdims=True))
        E = q.shape[-1]
        scale = {"no_scale": 1.0, "divide_by_dk": 1.0 / E}.get(variant, 1.0 / np.sqrt(E))
        dq = scale * dT @ k
        dk = scale * (_swap(dT) @ q)
        return dq, dk, dv

    return vjp


def _right_attention_vjp(g, q, k, v):
    _, res = sdpa_forward(q, k, v)
    gr = sdpa_backward(res, g)
    return gr.query, gr.key, gr.value


def _fun(q, k, v):
    return sdpa_forward(q, k, v)[0]


@pytest.mark.parametrize("mode", MODES)
def test_right_attention_backward_passes(mode):
    assert check_vjp(_fun, _right_attention_vjp, _attention_problem(), mode=mode, rtol=FD).ok


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["no_scale", "divide_by_dk"])
def test_catches_wrong_attention_scale(mode, variant):
    rep = check_vjp(_fun, _wrong_attention_vjp(variant), _attention_problem(), mode=mode)
    assert not rep.ok
    if mode == "full":
        assert rep.per_arg[2]["failed"] == 0      # dV is right, so it is not blamed
        assert rep.per_arg[0]["failed"] > 0 and rep.per_arg[1]["failed"] > 0


def test_catches_dS_instead_of_dS_transposed_for_dK():
    # With L == S, dS @ Q has the right shape but the wrong meaning.
    r = np.random.default_rng(2)
    q, k, v = r.standard_normal((2, 4, 3)), r.standard_normal((2, 4, 3)), r.standard_normal((2, 4, 2))

    def wrong(g, q, k, v):
        dq, dk, dv = _right_attention_vjp(g, q, k, v)
        _, res = sdpa_forward(q, k, v)
        P = res.probs
        dP = g @ _swap(v)
        dT = P * (dP - np.sum(P * dP, -1, keepdims=True))
        return dq, res.scale * (dT @ q), dv           # dS, not dS^T

    for mode in MODES:
        rep = check_vjp(_fun, wrong, (q, k, v), mode=mode)
        assert not rep.ok
    assert rep.per_arg[1]["failed"] > 0 and rep.per_arg[0]["failed"] == 0


def test_check_jvp_catches_a_wrong_jvp():
    f = lambda x: softmax(x)  # noqa: E731
    right = lambda t, x: softmax(x) * (t[0] - np.sum(softmax(x) * t[0], -1, keepdims=True))  # noqa: E731
    wrong = lambda t, x: softmax(x) * t[0]  # noqa: E731
    for mode in MODES:
        assert check_jvp(f, right, (X,), mode=mode, rtol=FD).ok
        assert not check_jvp(f, wrong, (X,), mode=mode).ok


# ------------------------------------------------------------- vectorized


def _attn_problem_small():
    r = np.random.default_rng(5)
    return tuple(r.standard_normal(s) for s in [(2, 2, 5, 3), (2, 2, 6, 3), (2, 2, 6, 2)])


def _causal_fun_and_tols(method):
    """Causal attention (complex for the complex step) and the tolerances of ``method``."""
    from sdpa_ref import sdpa_forward_complex

    fun = (lambda q, k, v: sdpa_forward_complex(q, k, v, is_causal=True)) if method == "complex" else \
        (lambda q, k, v: sdpa_forward(q, k, v, is_causal=True)[0])
    return fun, dict(method=method, rtol=COMPLEX_STEP if method == "complex" else FD,
                     atol=COMPLEX_STEP_ATOL if method == "complex" else FD_ATOL)


@pytest.mark.parametrize("method", ["central", "complex"])
def test_vectorized_full_check_agrees_with_the_scalar_one(method):
    fun, kw = _causal_fun_and_tols(method)

    def vjp(g, q, k, v):
        gr = sdpa_backward(sdpa_forward(q, k, v, is_causal=True)[1], g)
        return gr.query, gr.key, gr.value

    a = check_vjp(fun, vjp, _attn_problem_small(), **kw)
    b = check_vjp(fun, vjp, _attn_problem_small(), vectorized=True, **kw)
    assert a.ok and b.ok and b.mode.endswith("vectorized")
    assert b.n_evals < a.n_evals / 20
    np.testing.assert_allclose(b.max_abs_error, a.max_abs_error, rtol=FD_LOOSE, atol=F64_FEW_ULP)
    for ra, rb in zip(a.per_arg, b.per_arg):
        assert ra["total"] == rb["total"] and ra["failed"] == rb["failed"] == 0


@pytest.mark.parametrize("method", ["central", "complex"])
def test_vectorized_check_leaves_out_non_finite_inputs_like_the_scalar_one(method):
    x = np.array([[0.5, -np.inf, 1.0], [2.0, -1.0, -np.inf]])
    vjp = lambda g, x: (softmax_vjp(softmax(x), g),)      # noqa: E731
    a = check_vjp(softmax, vjp, (x,), method=method)
    b = check_vjp(softmax, vjp, (x,), method=method, vectorized=True)
    assert a.ok and b.ok
    assert a.per_arg[0]["total"] == b.per_arg[0]["total"] == 6 * 4
    np.testing.assert_allclose(b.max_abs_error, a.max_abs_error, rtol=FD_LOOSE, atol=F64_FEW_ULP)
    # and a wrong gradient on a finite entry next to the -inf ones is still caught
    bad = check_vjp(softmax, lambda g, x: (softmax_vjp(softmax(x), g) * 1.01,), (x,), method=method, vectorized=True)
    assert not bad.ok


def test_vectorized_check_catches_a_wrong_vjp_and_bad_broadcasting():
    def wrong(g, q, k, v):
        gr = sdpa_backward(sdpa_forward(q, k, v)[1], g)
        return gr.query * 2, gr.key, gr.value

    rep = check_vjp(lambda q, k, v: sdpa_forward(q, k, v)[0], wrong, _attn_problem_small(), vectorized=True)
    assert not rep.ok and rep.per_arg[0]["failed"] > 0 and rep.per_arg[1]["failed"] == 0
    # a fun that does not broadcast over the new axis gets a clear error
    with pytest.raises(ValueError, match="vectorized"):
        check_vjp(lambda x: x.sum(axis=0), lambda g, x: (np.ones_like(x) * g,), (np.ones((3, 2)),), vectorized=True)


@pytest.mark.parametrize("method", ["central", "complex"])
def test_vectorized_jvp_check_agrees_with_the_scalar_one_and_catches_a_wrong_jvp(method):
    from sdpa_ref import sdpa_jvp

    fun, kw = _causal_fun_and_tols(method)

    def jvp(ts, q, k, v):
        return sdpa_jvp((q, k, v), ts, is_causal=True)[1]

    def wrong(ts, q, k, v):                                         # forgets the key's tangent
        return sdpa_jvp((q, k, v), (ts[0], None, ts[2]), is_causal=True)[1]

    a = check_jvp(fun, jvp, _attn_problem_small(), **kw)
    b = check_jvp(fun, jvp, _attn_problem_small(), vectorized=True, **kw)
    assert a.ok and b.ok and b.mode.endswith("vectorized")
    assert b.n_evals < a.n_evals / 20
    np.testing.assert_allclose(b.max_abs_error, a.max_abs_error, rtol=FD_LOOSE, atol=F64_FEW_ULP)
    rep = check_jvp(fun, wrong, _attn_problem_small(), vectorized=True, **kw)
    assert not rep.ok and rep.per_arg[1]["failed"] > 0 and rep.per_arg[0]["failed"] == 0
    with pytest.raises(ValueError, match="vectorized"):
        check_jvp(lambda x: x.sum(axis=0), lambda t, x: t[0].sum(axis=0), (np.ones((3, 2)),), vectorized=True)
