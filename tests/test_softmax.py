import numpy as np
import pytest
import scipy.special as sp
from hypothesis import given
from hypothesis import strategies as st

from sdpa_ref import (
    assert_jvp,
    assert_vjp,
    log_softmax,
    log_softmax_vjp,
    logsumexp,
    softmax,
    softmax_jacobian,
    softmax_jvp,
    softmax_vjp,
)

from strategies import logits
from tolerances import EXACT, F64_AMPLIFIED, F64_FEW_ULP, F64_SUB_ULP, F64_SUMS, FD, UNDERFLOW_ATOL


# ----------------------------------------------------------- reference values


@given(logits())
def test_softmax_matches_scipy(xa):
    x, axis = xa
    np.testing.assert_allclose(softmax(x, axis), sp.softmax(x, axis=axis), rtol=F64_SUMS, atol=UNDERFLOW_ATOL)


@given(logits())
def test_log_softmax_matches_scipy(xa):
    x, axis = xa
    np.testing.assert_allclose(log_softmax(x, axis), sp.log_softmax(x, axis=axis), rtol=F64_SUMS, atol=F64_SUMS)


@given(logits(), st.booleans())
def test_logsumexp_matches_scipy(xa, keepdims):
    x, axis = xa
    np.testing.assert_allclose(logsumexp(x, axis, keepdims), sp.logsumexp(x, axis=axis, keepdims=keepdims),
                               rtol=F64_SUMS, atol=F64_SUMS)


def test_values_pinned_with_mpmath():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    x = [3.5, -1.25, 20.0, 0.0]
    tot = sum(mpmath.exp(t) for t in x)
    want = np.array([float(mpmath.exp(t) / tot) for t in x])
    np.testing.assert_allclose(softmax(np.array(x)), want, rtol=F64_SUMS)
    np.testing.assert_allclose(logsumexp(np.array(x)), float(mpmath.log(tot)), rtol=F64_SUMS)


# ------------------------------------------------------------------ stability


def test_huge_logits():
    np.testing.assert_array_equal(softmax(np.array([1000.0, 1.0])), [1.0, 0.0])
    np.testing.assert_array_equal(log_softmax(np.array([1000.0, 1.0])), [0.0, -999.0])
    np.testing.assert_allclose(logsumexp(np.array([1000.0, 1000.0])), 1000.0 + np.log(2.0), rtol=F64_FEW_ULP)
    x = np.array([1e300, -1e300, 0.0])
    np.testing.assert_array_equal(softmax(x), [1.0, 0.0, 0.0])
    assert logsumexp(x) == 1e300
    np.testing.assert_array_equal(log_softmax(x), [0.0, -2e300, -1e300])


def test_neg_inf_entries_and_rows():
    x = np.array([[0.0, -np.inf, 0.0], [-np.inf, -np.inf, -np.inf]])
    with np.errstate(all="raise"):   # no warnings leak out
        y = softmax(x)
        ly = log_softmax(x)
        lse = logsumexp(x)
    np.testing.assert_array_equal(y[0], [0.5, 0.0, 0.5])
    assert np.isnan(y[1]).all()                  # no mass to share: NaN, as scipy/torch/jax
    np.testing.assert_array_equal(ly[0], [np.log(0.5), -np.inf, np.log(0.5)])
    assert np.isnan(ly[1]).all()
    np.testing.assert_array_equal(lse, [np.log(2.0), -np.inf])


def test_empty_axis():
    x = np.zeros((3, 0))
    assert softmax(x).shape == (3, 0)
    np.testing.assert_array_equal(logsumexp(x), [-np.inf] * 3)


def test_max_is_taken_along_the_axis_not_the_array():
    # A global max would underflow the second row to 0/0.
    x = np.array([[1000.0, 999.0], [0.0, -1.0]])
    np.testing.assert_allclose(softmax(x, axis=-1)[1], sp.softmax([0.0, -1.0]), rtol=F64_SUMS)


def test_integer_input_promotes_and_bad_dtype_rejected():
    np.testing.assert_allclose(softmax([1, 2, 3]), sp.softmax([1.0, 2.0, 3.0]), rtol=F64_SUMS)
    with pytest.raises(TypeError, match="`x`"):
        softmax(np.array(["a", "b"]))
    with pytest.raises(ValueError, match="`axis`"):
        softmax(np.zeros((2, 3)), axis=2)
    with pytest.raises(ValueError, match="`g`"):
        softmax_vjp(np.zeros((2, 3)), np.zeros((3, 2)))


def test_float32_stays_float32():
    x = np.array([1.0, 2.0], dtype=np.float32)
    assert softmax(x).dtype == np.float32
    assert log_softmax(x).dtype == np.float32


# ----------------------------------------------------------------- properties


@given(logits(), st.floats(-100, 100))
def test_translation_invariance(xa, c):
    x, axis = xa
    np.testing.assert_allclose(softmax(x + c, axis), softmax(x, axis), rtol=F64_AMPLIFIED, atol=F64_FEW_ULP)
    np.testing.assert_allclose(logsumexp(x + c, axis), logsumexp(x, axis) + c, rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED)


@given(logits())
def test_rows_sum_to_one_and_not_mutated(xa):
    x, axis = xa
    before = x.copy()
    y = softmax(x, axis)
    np.testing.assert_allclose(y.sum(axis), 1.0, rtol=F64_SUMS)
    np.testing.assert_allclose(np.exp(log_softmax(x, axis)).sum(axis), 1.0, rtol=F64_SUMS)
    np.testing.assert_array_equal(x, before)


@given(logits(max_dims=3, max_side=4))
def test_jacobian_matches_vjp_and_jvp(xa):
    x, axis = xa
    y = softmax(x, axis)
    J = softmax_jacobian(y, axis)                      # (..., n, n), axis moved last
    rng = np.random.default_rng(0)
    g = rng.standard_normal(x.shape)
    gm = np.moveaxis(g, axis, -1)
    want_vjp = np.einsum("...ij,...i->...j", J, gm)
    np.testing.assert_allclose(np.moveaxis(softmax_vjp(y, g, axis), axis, -1), want_vjp, atol=F64_SUMS)
    want_jvp = np.einsum("...ij,...j->...i", J, gm)
    np.testing.assert_allclose(np.moveaxis(softmax_jvp(y, g, axis), axis, -1), want_jvp, atol=F64_SUMS)
    np.testing.assert_allclose(J, np.swapaxes(J, -1, -2), atol=EXACT)  # symmetric


def test_jacobian_explicit_values():
    y = np.array([0.2, 0.3, 0.5])
    J = softmax_jacobian(y)
    want = np.array([[0.16, -0.06, -0.10], [-0.06, 0.21, -0.15], [-0.10, -0.15, 0.25]])
    np.testing.assert_allclose(J, want, atol=F64_FEW_ULP)


# --------------------------------------------------------- finite differences


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("mode", ["full", "projection"])
def test_vjps_and_jvp_by_finite_differences(axis, mode):
    x = np.random.default_rng(axis + 5).standard_normal((3, 4, 2)) * 4
    kw = dict(mode=mode, rtol=FD)
    assert_vjp(lambda x: softmax(x, axis), lambda g, x: softmax_vjp(softmax(x, axis), g, axis), (x,), **kw)
    assert_vjp(lambda x: log_softmax(x, axis), lambda g, x: log_softmax_vjp(log_softmax(x, axis), g, axis), (x,), **kw)
    assert_jvp(lambda x: softmax(x, axis), lambda t, x: softmax_jvp(softmax(x, axis), t[0], axis), (x,), **kw)
    assert_vjp(lambda x: logsumexp(x, axis), lambda g, x: (softmax(x, axis) * np.expand_dims(g, axis),), (x,), **kw)


def test_vjp_of_ones_is_zero():
    # why an all-ones cotangent hides errors: softmax's VJP of ones vanishes
    y = softmax(np.array([0.3, -1.0, 2.0]))
    np.testing.assert_allclose(softmax_vjp(y, np.ones(3)), 0.0, atol=F64_SUB_ULP)
