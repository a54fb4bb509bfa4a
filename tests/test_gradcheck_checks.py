"""The checkers cannot be fooled (issue 40, item 5): each loophole has a wrong implementation that must fail.

* NaN: a NaN output made both projections NaN, and two NaNs "agreed", so any VJP passed; a NaN cotangent made
  every product of ``check_hvp`` NaN. Non-finite entries are judged entry by entry (the NaN patterns must be
  the same, the finite parts agree), and a NaN on one side only fails and is named.
* Complex results: ``np.asarray(r, float64)`` dropped the imaginary part with a warning.
* A failed projection was overruled by the full check, which pushed only one-hot vectors: a derivative right
  on every one-hot vector but wrong on the others (not linear: ``|g|``, a branch on two tangents, ``0.5 v`` when
  two args have tangents) passed both modes. The full mode now also pushes dense probes over all args at once.
* Bad ``seed`` and a ``vjp`` returning None are clear errors.
"""

import warnings

import numpy as np
import pytest

import sdpa_ref as sr
from sdpa_ref import check_hvp, check_jvp, check_vjp, sdpa_backward, sdpa_forward, sdpa_jvp
from tolerances import COMPLEX_STEP, COMPLEX_STEP_ATOL, FD

MODES = ["full", "projection"]
_R = np.random.default_rng(40)
Q, K, V = _R.standard_normal((1, 3, 2)), _R.standard_normal((1, 4, 2)), _R.standard_normal((1, 4, 2))
QKV = (Q, K, V)
MASK = np.ones((3, 4), bool)
MASK[1] = False                                                    # row 1 has no key: NaN under "nan"


def _fun(q, k, v, **o):
    return sdpa_forward(q, k, v, **o)[0]


def _vjp(g, q, k, v, **o):
    gr = sdpa_backward(sdpa_forward(q, k, v, **o)[1], g)
    return gr.query, gr.key, gr.value


def _jvp(ts, q, k, v):
    return sdpa_jvp((q, k, v), tuple(ts))[1]


def _nan_fun(q, k, v):
    return _fun(q, k, v, attn_mask=MASK, fully_masked="nan")


def _nan_vjp_sdpa(g, q, k, v):
    """sdpa's own "nan" policy gradient: its dk, dv are NaN whatever g is (0 * NaN, the documented poison)."""
    return _vjp(g, q, k, v, attn_mask=MASK, fully_masked="nan")


def _nan_vjp_honest(g, q, k, v):
    """J^T g of the "nan" function as its differences see it: the NaN row's derivative is NaN, and enters where
    its cotangent is not 0 (everything: every entry of a NaN row is NaN whatever is perturbed); the other rows
    are the "zero" policy's."""
    if np.any(g[:, 1] != 0):
        return tuple(np.full(x.shape, np.nan) for x in (q, k, v))
    return _vjp(g, q, k, v, attn_mask=MASK, fully_masked="zero")


def _issue_wrong(vjp):
    """The issue's wrong VJP: doubles dq, negates dk, returns 100 dv + 7."""
    def wrong(g, q, k, v):
        dq, dk, dv = vjp(g, q, k, v)
        return 2 * dq, -dk, 100 * dv + 7
    return wrong


# ------------------------------------------------------------------ NaN


@pytest.mark.parametrize("mode", MODES)
def test_the_issues_wrong_vjp_on_a_nan_output_fails(mode):
    """Both projections were NaN and agreed: ok with max_rel 0 (projection mode, before)."""
    rep = check_vjp(_nan_fun, _issue_wrong(_nan_vjp_sdpa), QKV, mode=mode)
    assert not rep.ok, rep
    rep = check_vjp(_nan_fun, _issue_wrong(_nan_vjp_honest), QKV, mode=mode)
    assert not rep.ok, rep
    assert rep.per_arg[0]["failed"] > 0 and rep.per_arg[2]["failed"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_an_honest_vjp_on_a_nan_output_passes(mode):
    """The finite parts are judged and the NaN patterns compared: the honest gradient passes; the projections
    cannot judge a NaN output, so the full check does, and says so."""
    rep = check_vjp(_nan_fun, _nan_vjp_honest, QKV, mode=mode)
    assert rep.ok, rep
    if mode == "projection":
        assert "not finite" in str(rep), rep
    jvp = lambda ts, q, k, v: sdpa_jvp((q, k, v), tuple(ts), attn_mask=MASK, fully_masked="nan")[1]   # noqa: E731
    assert check_jvp(_nan_fun, jvp, QKV, mode=mode).ok


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_gradient_where_the_difference_is_finite_fails_and_is_named(mode):
    def vjp(g, q, k, v):
        dq, dk, dv = _vjp(g, q, k, v)
        dk = dk.copy()
        dk[0, 2, 1] = np.nan
        return dq, dk, dv

    rep = check_vjp(_fun, vjp, QKV, mode=mode)
    assert not rep.ok, rep
    assert "NaN" in str(rep) and "analytic" in str(rep), rep
    if mode == "full":
        assert rep.per_arg[1]["failed"] > 0 and rep.per_arg[0]["failed"] == 0
        assert "arg 1 index (0, 2, 1)" in str(rep), rep


@pytest.mark.parametrize("mode", MODES)
def test_a_finite_gradient_where_the_difference_is_nan_fails_and_is_named(mode):
    c = np.array([0.0, np.nan, 0.0])
    rep = check_vjp(lambda x: np.sin(x) + c, lambda g, x: (g * np.cos(x),), (np.array([0.1, 0.2, 0.3]),), mode=mode)
    assert not rep.ok, rep
    assert "numeric" in str(rep) and "NaN" in str(rep), rep
    rep = check_jvp(lambda x: np.sin(x) + c, lambda t, x: t[0] * np.cos(x), (np.array([0.1, 0.2, 0.3]),), mode=mode)
    assert not rep.ok, rep


def test_nothing_finite_to_compare_is_not_a_pass():
    """Every entry NaN on both sides proves nothing."""
    rep = check_vjp(lambda x: x + np.nan, lambda g, x: (g + np.nan,), (np.array([0.1, 0.2]),))
    assert not rep.ok and "no finite" in str(rep), rep


def _sin_times(x, y):
    return np.sin(x) * y


def _sin_times_vjp(g, x, y):
    return g * np.cos(x) * y, g * np.sin(x)


def _sin_times_hvp(g, ts, x, y, *, wrong=False):
    """L = <g, sin(x) y>: H (tx, ty) = (-g sin(x) y tx + g cos(x) ty, g cos(x) tx); ``wrong`` adds 0.5 v when the
    tangents of both args are non-zero (never on a one-hot tangent)."""
    tx, ty = ts
    hx, hy = -g * np.sin(x) * y * tx + g * np.cos(x) * ty, g * np.cos(x) * tx
    if wrong and np.any(tx != 0) and np.any(ty != 0):
        hx, hy = hx + 0.5 * tx, hy + 0.5 * ty
    return hx, hy


XY = (_R.standard_normal(4), _R.standard_normal(4))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_check_hvp_refuses_a_non_finite_cotangent(bad):
    """A NaN cotangent made the gradient and every product NaN: any HVP passed (before)."""
    g = np.full(4, bad)
    wrong = lambda g, ts, x, y: (3.0 * g * ts[0], -g * ts[1])                      # noqa: E731
    with pytest.raises(ValueError, match="`cotangent`"):
        check_hvp(_sin_times, _sin_times_vjp, wrong, XY, cotangent=g)


# ------------------------------------------------------------------ complex


def test_a_complex_result_is_refused():
    """The imaginary part was dropped with a ComplexWarning and the real part passed (before)."""
    complex_vjp = lambda g, q, k, v: tuple(d + 1j for d in _vjp(g, q, k, v))   # noqa: E731
    complex_jvp = lambda ts, q, k, v: _jvp(ts, q, k, v) + 0.5j                   # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                          # no ComplexWarning on the way
        for mode in MODES:
            with pytest.raises(TypeError, match="`vjp`.*complex"):
                check_vjp(_fun, complex_vjp, QKV, mode=mode)
            with pytest.raises(TypeError, match="`jvp`.*complex"):
                check_jvp(_fun, complex_jvp, QKV, mode=mode)
        with pytest.raises(TypeError, match="`vjp`.*complex"):
            check_vjp(_fun, complex_vjp, QKV, vectorized=True)
        with pytest.raises(TypeError, match="`jvp`.*complex"):
            check_jvp(_fun, complex_jvp, QKV, vectorized=True)
        hvp = lambda g, ts, x, y: tuple(h * (1 + 1e-3j) for h in _sin_times_hvp(g, ts, x, y))   # noqa: E731
        with pytest.raises(TypeError, match="`hvp`.*complex"):
            check_hvp(_sin_times, _sin_times_vjp, hvp, XY)
        with pytest.raises(TypeError, match="`cotangent`"):
            check_hvp(_sin_times, _sin_times_vjp, _sin_times_hvp, XY, cotangent=np.ones(4) + 1j)


# ------------------------------------------------------------------ off the one-hot vectors


@pytest.mark.parametrize("mode", MODES)
def test_an_hvp_adding_half_v_on_two_args_fails(mode):
    """One-hot tangents never have two args non-zero, and 0.5 I is symmetric: the full check passed it, and
    overruled the failed projection (before)."""
    assert check_hvp(_sin_times, _sin_times_vjp, _sin_times_hvp, XY, mode=mode).ok
    wrong = lambda g, ts, x, y: _sin_times_hvp(g, ts, x, y, wrong=True)            # noqa: E731
    rep = check_hvp(_sin_times, _sin_times_vjp, wrong, XY, mode=mode)
    assert not rep.ok, rep
    assert "probe" in str(rep) or "projection" in str(rep), rep


@pytest.mark.parametrize("mode", MODES)
def test_a_vjp_of_abs_g_fails(mode):
    """J^T |g| is J^T g on every one-hot cotangent."""
    rep = check_vjp(_fun, lambda g, q, k, v: _vjp(np.abs(g), q, k, v), QKV, mode=mode)
    assert not rep.ok, rep
    rep = check_vjp(_fun, lambda g, q, k, v: _vjp(np.abs(g), q, k, v), QKV, mode=mode, vectorized=True)
    assert not rep.ok, rep
    rep = check_jvp(_fun, lambda ts, q, k, v: _jvp([np.abs(t) for t in ts], q, k, v), QKV, mode=mode)
    assert not rep.ok, rep


@pytest.mark.parametrize("mode", MODES)
def test_a_jvp_branching_on_two_tangents_fails(mode):
    """Forgets the key's tangent when another arg has one too: right on every one-hot tangent."""
    def wrong(ts, q, k, v):
        ts = list(ts)
        if sum(bool(np.any(t != 0)) for t in ts) > 1:
            ts[1] = np.zeros_like(ts[1])
        return _jvp(ts, q, k, v)

    rep = check_jvp(_fun, wrong, QKV, mode=mode)
    assert not rep.ok, rep
    rep = check_jvp(_fun, wrong, QKV, mode=mode, vectorized=True)
    assert not rep.ok, rep


def test_a_failed_projection_is_never_overruled():
    rep = check_vjp(_fun, lambda g, q, k, v: _vjp(np.abs(g), q, k, v), QKV, mode="projection")
    assert not rep.ok and rep.mode == "projection, then full", rep
    assert any("projection check failed" in n for n in rep.notes), rep


@pytest.mark.parametrize("vectorized", [False, True])
def test_honest_derivatives_pass_with_the_dense_probes(vectorized):
    for method in ("central", "complex"):
        fun = (lambda q, k, v: sr.sdpa_forward_complex(q, k, v)) if method == "complex" else _fun
        tol = dict(rtol=COMPLEX_STEP, atol=COMPLEX_STEP_ATOL) if method == "complex" else dict(rtol=FD)
        rep = check_vjp(fun, _vjp, QKV, method=method, vectorized=vectorized, **tol)
        assert rep.ok and any("probe" in n for n in rep.notes), rep
        assert check_jvp(fun, _jvp, QKV, method=method, vectorized=vectorized, **tol).ok


# ------------------------------------------------------------------ clear errors


@pytest.mark.parametrize("seed,err", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("0", TypeError),
                                      (None, TypeError)])
def test_a_bad_seed_is_a_clear_error(seed, err):
    for call in (lambda: check_vjp(_fun, _vjp, QKV, seed=seed),
                 lambda: check_jvp(_fun, _jvp, QKV, seed=seed, mode="projection"),
                 lambda: check_hvp(_sin_times, _sin_times_vjp, _sin_times_hvp, XY, seed=seed)):
        with pytest.raises(err, match="`seed`"):
            call()


@pytest.mark.parametrize("mode", MODES)
def test_a_derivative_returning_none_is_a_clear_error(mode):
    with pytest.raises(TypeError, match="`vjp`.*None"):
        check_vjp(_fun, lambda g, q, k, v: None, QKV, mode=mode)
    with pytest.raises(TypeError, match="`vjp` gradient 1.*None"):
        check_vjp(_fun, lambda g, q, k, v: (g, None, v), QKV, mode=mode)
    with pytest.raises(TypeError, match="`jvp`.*None"):
        check_jvp(_fun, lambda ts, q, k, v: None, QKV, mode=mode)
    with pytest.raises(TypeError, match="`hvp`.*None"):
        check_hvp(_sin_times, _sin_times_vjp, lambda g, ts, x, y: None, XY, mode=mode)
    with pytest.raises(TypeError, match="`vjp`.*None"):
        check_vjp(_fun, lambda g, q, k, v: None, QKV, vectorized=True)


def test_a_numpy_integer_seed_is_taken():
    assert check_vjp(_fun, _vjp, QKV, seed=np.int64(3)).ok


@pytest.mark.parametrize("vectorized", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_a_complex_output_is_refused_not_cut_to_its_real_part(mode, vectorized):
    """``fun`` returning ``x * (1 + 1j)`` at a real point: its real part alone was checked, so a VJP of 1 (the
    real part's) passed; its derivative is ``1 + 1j``. A complex-capable ``fun`` whose imaginary part is 0 at
    real points (as the complex step needs) still passes."""
    x = [np.array([0.5, -1.0, 2.0])]
    for check, der in ((check_vjp, lambda g, x: [g]), (check_jvp, lambda t, x: t[0])):
        with pytest.raises(TypeError, match="`fun`.*imaginary"):
            check(lambda x: x * (1 + 1j), der, x, mode=mode, vectorized=vectorized)
        assert check(lambda x: x * (1 + 0j), der, x, mode=mode, vectorized=vectorized).ok
    rep = check_vjp(lambda x: np.exp(x + 0j), lambda g, x: [g * np.exp(x)], x, method="complex", mode=mode)
    assert rep.ok, rep


@pytest.mark.parametrize("kwargs, err, name", [
    ({"eps": True}, TypeError, "`eps`"),                          # a step of 1.0 (bool is an int)
    ({"eps": "a"}, TypeError, "`eps`"),                           # NumPy's message named no argument
    ({"vectorized": "no"}, TypeError, "`vectorized`"),            # bool("no") turned the batched mode on
    ({"vectorized": 1}, TypeError, "`vectorized`"),
])
def test_eps_and_vectorized_are_checked_under_their_names(kwargs, err, name):
    for check, der in ((check_vjp, _vjp), (check_jvp, _jvp)):
        with pytest.raises(err, match=name):
            check(_fun, der, QKV, **kwargs)
    if "eps" in kwargs:
        with pytest.raises(err, match=name):
            sr.numerical_jacobian(_fun, QKV, **kwargs)
    assert check_vjp(_fun, _vjp, QKV, eps=np.float32(1e-5), vectorized=np.bool_(True)).ok
