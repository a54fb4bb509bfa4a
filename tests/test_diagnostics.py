import numpy as np
import pytest

from sdpa_ref import softmax, softmax_jacobian
from sdpa_ref.diagnostics import (
    SweepRow,
    normalized_entropy,
    predicted_score_std,
    softmax_entropy,
    softmax_jacobian_norm,
    sweep,
)
from tolerances import F64_AMPLIFIED, F64_FEW_ULP

# Statistical margins: a measured difference must exceed Z standard errors
# (trials are independent draws, so the standard errors are honest). With
# Z = 5 a false failure has probability < 1e-6 per comparison, and the sweep
# is seeded, so the suite is deterministic anyway.
Z = 5.0
D_KS = (4, 16, 64, 256, 1024)


@pytest.fixture(scope="module")
def rows():
    return sweep(D_KS, trials=64, seed=123)


def _get(rows, scale):
    return [r for r in rows if r.scale == scale]


# ------------------------------------------------------------------ entropy


def test_entropy_hand_values():
    assert softmax_entropy([1.0, 0.0, 0.0]) == 0.0
    np.testing.assert_allclose(softmax_entropy([0.5, 0.5]), np.log(2), rtol=F64_FEW_ULP)
    np.testing.assert_allclose(softmax_entropy([0.5, 0.25, 0.25, 0.0]), 1.5 * np.log(2), rtol=F64_FEW_ULP)
    np.testing.assert_allclose(normalized_entropy(np.full(7, 1 / 7)), 1.0, rtol=F64_FEW_ULP)
    np.testing.assert_allclose(normalized_entropy([0.5, 0.5, 0.0, 0.0]), 0.5, rtol=F64_FEW_ULP)
    assert normalized_entropy([0.0, 1.0, 0.0]) == 0.0


def test_entropy_axis_and_no_warnings():
    p = np.array([[1.0, 0.5], [0.0, 0.5]])
    with np.errstate(all="raise"):
        np.testing.assert_allclose(softmax_entropy(p, axis=0), [0.0, np.log(2)], atol=F64_FEW_ULP)


def test_jacobian_norm_closed_form_matches_explicit_matrix():
    p = softmax(np.random.default_rng(0).standard_normal((4, 9)) * 3)
    want = np.linalg.norm(softmax_jacobian(p), axis=(-2, -1))
    np.testing.assert_allclose(softmax_jacobian_norm(p), want, rtol=F64_AMPLIFIED)
    assert softmax_jacobian_norm(np.eye(3)[0]) == 0.0


# -------------------------------------------------------------------- sweep


def test_sweep_fields_and_determinism(rows):
    assert len(rows) == len(D_KS) * 3
    assert isinstance(rows[0], SweepRow)
    fields = {"d_k", "scale", "score_std", "entropy", "normalized_entropy", "max_weight_mean", "max_weight_median",
              "saturated_fraction", "grad_norm_scores", "grad_norm_query", "grad_norm_key", "jacobian_norm", "trials"}
    assert fields <= set(rows[0].as_dict())
    again = sweep(D_KS, trials=64, seed=123)
    assert [r.as_dict() for r in again] == [r.as_dict() for r in rows]
    other = sweep(D_KS, trials=64, seed=124)
    assert other[0].entropy != rows[0].entropy


def test_a_point_does_not_depend_on_the_other_points(rows):
    alone = sweep((64,), trials=64, seed=123, scales=("sqrt",))[0]
    assert alone == [r for r in rows if r.d_k == 64 and r.scale == "sqrt"][0]


def test_score_std_matches_theory_within_sampling_error(rows):
    for r in rows:
        assert r.predicted_score_std == predicted_score_std(r.d_k, r.scale)
        assert abs(r.score_std - r.predicted_score_std) <= Z * r.score_std_stderr + 1e-12, r


def test_sqrt_scaling_keeps_entropy_flat(rows):
    h = [r.normalized_entropy for r in _get(rows, "sqrt")]
    # Measured: about 0.88 at every d_k; the spread is sampling noise.
    assert max(h) - min(h) < 0.02
    assert all(0.8 < x < 0.95 for x in h)


def _strictly_falls(series, key):
    for a, b in zip(series, series[1:]):
        va, vb = getattr(a, key), getattr(b, key)
        se = np.hypot(getattr(a, key + "_stderr"), getattr(b, key + "_stderr"))
        assert va - vb > Z * se, (key, a.d_k, va, b.d_k, vb, se)


def test_no_scaling_saturates_as_d_k_grows(rows):
    none = _get(rows, "none")
    _strictly_falls(none, "normalized_entropy")
    top = [r.max_weight_mean for r in none]
    assert all(b > a for a, b in zip(top, top[1:]))
    assert none[-1].saturated_fraction > 0.8 and _get(rows, "sqrt")[-1].saturated_fraction == 0.0


def test_no_scaling_gradients_vanish_for_large_d_k(rows):
    # Measured, not assumed: both rise from d_k=4 to d_k=8 or 16 (a peaked
    # softmax has a larger Jacobian than a flat one) and then fall; so the
    # claim is checked from d_k=16 on.
    none = [r for r in _get(rows, "none") if r.d_k >= 16]
    _strictly_falls(none, "grad_norm_scores")
    _strictly_falls(none, "jacobian_norm")
    sq = _get(rows, "sqrt")[-1]
    assert none[-1].grad_norm_scores < 0.5 * sq.grad_norm_scores


def test_linear_scaling_drifts_to_uniform(rows):
    lin = _get(rows, "linear")
    assert all(b.normalized_entropy > a.normalized_entropy for a, b in zip(lin, lin[1:]))
    assert lin[-1].normalized_entropy > 0.999


def test_sweep_rejects_bad_input():
    with pytest.raises(ValueError, match="`scales`"):
        sweep((4,), scales=("half",))
    with pytest.raises(ValueError, match="`n_keys`"):
        sweep((4,), n_keys=1)
    with pytest.raises(ValueError, match="`d_ks`"):
        sweep((0,))


def test_default_sweep_is_fast():
    import time

    t0 = time.perf_counter()
    sweep()
    assert time.perf_counter() - t0 < 6.0   # < 1 s measured; generous for a loaded CI machine
