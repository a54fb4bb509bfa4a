"""The score chain is one table of stages (sdpa_ref.transforms.SCORE_STAGES): a transform declared once, as a
ScoreStage, is computed by every engine, its derivatives and the reproducible precision with no other change.

The toy stage here, ``T -> T + c T^3`` with the option ``toy=c``, exists only in this file: the fixture registers
it and takes it out again. Nothing else in the package names it, and yet the plain, fast and tiled forwards, their
backwards and JVPs, the double backward and ``precision="reproducible"`` all compute it.
"""

import numpy as np
import pytest

from tolerances import F32_ATOL, F32_SCHEDULES, F64_GRAD, F64_SUMS, FD, FD_ATOL, FD_SECOND_ORDER

from sdpa_ref import sdpa_backward, sdpa_forward
from sdpa_ref.derivatives import sdpa_jvp
from sdpa_ref.gradcheck import check_jvp, check_vjp
from sdpa_ref.options import DOC_OPTIONS, OPTION_NAMES, AttentionOptions
from sdpa_ref.second_order import sdpa_backward_jvp
from sdpa_ref.transforms import SCORE_STAGES, ScoreStage, register_score_stage, unregister_score_stage

METHODS = [dict(method="plain"), dict(method="fast"), dict(method="tiled", block_size=2)]


def _mode(how):
    """The whole Jacobian where it is cheap; random projections through the tiled engine's 2 x 2 tiles."""
    return "projection" if how["method"] == "tiled" else "full"


def _toy_check(c, name):
    """The option: a finite number >= 0 (the map stays increasing)."""
    c = float(c)
    if not (np.isfinite(c) and c >= 0):
        raise ValueError(f"`{name}` should be a finite number >= 0, but got {c!r}")
    return c


def _toy(t, c, at, slope=False, slope_out=None):
    """``T + c T^3`` in place, its slope ``1 + 3 c T^2`` at the input first."""
    c = t.dtype.type(c)
    s = None
    if slope:
        s = np.multiply(t, t, out=slope_out)
        s = np.add(np.multiply(s, 3 * c, out=s), t.dtype.type(1), out=s)
    np.add(t, c * t * t * t, out=t)
    return t, s


def _toy_in(X, t, c, at):
    """The same over an arithmetic: ``(t + c t^3, 1 + 3 c t^2)``."""
    t2 = X.mul(t, t)
    return X.add(t, X.mul_d(X.mul(t2, t), c)), X.add_d(X.mul_d(t2, 3.0 * c), 1.0)


TOY = ScoreStage(
    name="toy", elementwise=True, option="toy", check=_toy_check, examples=(0.05,),
    forward=_toy, forward_in=_toy_in,
    slope=lambda t, c, at: 1 + 3 * c * t * t,
    slope_jvp=lambda t, c, s, dt, at, pre: 6 * c * t * dt if pre is None else pre * pre * 6 * c * t * dt,
    doc="\n        toy : float >= 0\n            Scores become ``T + toy T^3``.")


@pytest.fixture
def toy():
    register_score_stage(TOY)
    try:
        yield TOY
    finally:
        unregister_score_stage("toy")


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 2, 5, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 4))
    bias = 0.5 * rng.standard_normal((2, 5, 6))
    return q, k, v, dict(bias=bias, is_causal=True, causal_alignment="bottom_right")


def _direct(q, k, v, c, cap=None, bias=None, **_):
    """The formula, written out: softcap, then the toy, then the bias, the causal mask (bottom right), softmax."""
    L, S = q.shape[-2], k.shape[-2]
    t = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if cap is not None:
        t = cap * np.tanh(t / cap)
    t = t + c * t ** 3 + bias
    t = np.where(np.arange(S)[None, :] <= np.arange(L)[:, None] + S - L, t, -np.inf)
    p = np.exp(t - t.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def test_the_table_is_the_chain_in_todays_order():
    assert [s.name for s in SCORE_STAGES] == ["softcap", "score_mod", "mask_float", "bias", "alibi"]
    assert "softcap" in OPTION_NAMES and "score_mod" not in OPTION_NAMES     # a NumPy function is not judged
    assert AttentionOptions().softcap is None and AttentionOptions.from_kwargs(softcap=2).softcap == 2.0
    assert "softcap : float > 0" in DOC_OPTIONS


def test_a_registered_stage_is_an_option_validated_once(toy):
    assert [s.name for s in SCORE_STAGES] == ["softcap", "score_mod", "toy", "mask_float", "bias", "alibi"]
    o = AttentionOptions.from_kwargs(toy=0.5)
    assert o.toy == 0.5 and o.has_slope and AttentionOptions.from_kwargs().toy is None
    with pytest.raises(ValueError, match="`toy` should be a finite number >= 0"):
        AttentionOptions.from_kwargs(toy=-1.0)
    with pytest.raises(ValueError, match="`stage` should have a new name"):
        register_score_stage(TOY)
    with pytest.raises(ValueError, match="element-wise stages before the additive ones"):
        register_score_stage(ScoreStage(name="late", elementwise=True, option="late", forward=_toy,
                                        slope=TOY.slope), before="bias")


def test_an_unregistered_stage_is_gone():
    with pytest.raises(TypeError, match="unexpected keyword"):
        AttentionOptions.from_kwargs(toy=0.5)
    with pytest.raises(AttributeError):
        AttentionOptions().toy


@pytest.mark.parametrize("how", METHODS, ids=lambda m: m["method"])
@pytest.mark.parametrize("cap", [None, 2.5])
def test_every_engine_computes_the_registered_stage(toy, how, cap):
    q, k, v, kw = _problem()
    kw.update({} if cap is None else dict(softcap=cap))
    out, _ = sdpa_forward(q, k, v, toy=0.3, **kw, **how)
    np.testing.assert_allclose(out, _direct(q, k, v, 0.3, cap, **kw), rtol=F64_SUMS, atol=F64_SUMS)
    assert not np.allclose(out, sdpa_forward(q, k, v, **kw, **how)[0])          # the stage changes the result


@pytest.mark.parametrize("how", METHODS, ids=lambda m: m["method"])
def test_the_backward_and_jvp_of_the_registered_stage_match_central_differences(toy, how):
    q, k, v, kw = _problem(1)
    kw.update(softcap=2.5, toy=0.3, **how)

    def fun(q, k, v):
        return sdpa_forward(q, k, v, **kw)[0]

    def vjp(g, q, k, v):
        return tuple(sdpa_backward(sdpa_forward(q, k, v, **kw)[1], g))[:3]

    def jvp(t, q, k, v):
        return sdpa_jvp((q, k, v), t, **kw)[1]

    rep = check_vjp(fun, vjp, (q, k, v), mode=_mode(how), rtol=FD, atol=FD_ATOL)
    assert rep.ok, rep
    rep = check_jvp(fun, jvp, (q, k, v), mode=_mode(how), rtol=FD, atol=FD_ATOL)
    assert rep.ok, rep


@pytest.mark.parametrize("how", [METHODS[0], METHODS[2]], ids=lambda m: m["method"])
def test_the_double_backward_of_the_registered_stage_matches_central_differences(toy, how):
    q, k, v, kw = _problem(2)
    kw.update(softcap=2.5, toy=0.3, **how)
    g = np.random.default_rng(3).standard_normal(sdpa_forward(q, k, v, **kw)[0].shape)

    def grads(q, k, v):
        return np.concatenate([x.ravel() for x in tuple(sdpa_backward(sdpa_forward(q, k, v, **kw)[1], g))[:3]])

    def grads_jvp(t, q, k, v):
        gt = sdpa_backward_jvp((q, k, v), t, g, **kw)[1]
        return np.concatenate([x.ravel() for x in tuple(gt)[:3]])

    rep = check_jvp(grads, grads_jvp, (q, k, v), mode=_mode(how), rtol=FD_SECOND_ORDER, atol=FD_ATOL)
    assert rep.ok, rep


def test_the_reproducible_precision_computes_the_registered_stage(toy):
    q, k, v, kw = _problem(4)
    kw.update(softcap=2.5, toy=0.3)
    out, res = sdpa_forward(q, k, v, precision="reproducible", **kw)
    want, wres = sdpa_forward(q, k, v, method="plain", **kw)
    np.testing.assert_allclose(out, want, rtol=F64_SUMS, atol=F64_SUMS)
    g = np.cos(out)
    for a, b in zip(tuple(sdpa_backward(res, g))[:3], tuple(sdpa_backward(wres, g))[:3]):
        np.testing.assert_allclose(a, b, rtol=F64_GRAD, atol=F64_SUMS)
    low, _ = sdpa_forward(*(x.astype(np.float32) for x in (q, k, v)), precision="reproducible", upcast=False,
                          **dict(kw, bias=kw["bias"].astype(np.float32)))
    np.testing.assert_allclose(low, want, rtol=F32_SCHEDULES, atol=F32_ATOL)     # float32, rounded at every step


def test_a_stage_without_a_form_over_an_arithmetic_is_refused_there():
    bare = ScoreStage(name="bare", elementwise=True, option="bare", forward=_toy, slope=TOY.slope)
    register_score_stage(bare)
    try:
        q, k, v, kw = _problem()
        sdpa_forward(q, k, v, bare=0.1, **kw)
        with pytest.raises(ValueError, match="`bare` should not be given with this arithmetic"):
            sdpa_forward(q, k, v, bare=0.1, precision="reproducible", **kw)
    finally:
        unregister_score_stage("bare")


def test_softcap_slope_tangent_over_double_double_is_faithful():
    """softcap_sech2_jvp_in in double-double, rounded once, is within one ulp of -2/c tanh(t/c) sech^2(t/c) dt in
    mpmath, saturated (|t/c| up to 40, sech^2 ~ 1e-34) and beyond the clamp; the NumPy form agrees to rounding."""
    mpmath = pytest.importorskip("mpmath")
    from helpers import assert_faithful
    from sdpa_ref.exact.arith import DoubleDouble
    from sdpa_ref.transforms import softcap_sech2_jvp, softcap_sech2_jvp_in

    X, cap = DoubleDouble(), 1.5
    t = np.array([-60.0, -3.0, -0.25, 0.0, 1e-3, 2.0, 17.5, 4000.0])
    dt = np.linspace(-2.0, 3.0, t.size)
    sech2 = X.sech2(X.div(X.clamp(X.lift(t), 1024.0 * cap), X.lift(cap)), None)
    ans = X.value(softcap_sech2_jvp_in(X, X.lift(t), cap, sech2, X.lift(dt)))
    ctx = mpmath.MPContext()
    ctx.dps = 60
    truth = np.array([-2 / ctx.mpf(cap) * ctx.tanh(ctx.mpf(x) / cap) / ctx.cosh(ctx.mpf(x) / cap) ** 2 * ctx.mpf(d)
                      for x, d in zip(t, dt)], dtype=object)
    assert_faithful(ans, truth, "softcap slope tangent")
    ref = softcap_sech2_jvp(t, cap, X.value(sech2), dt)
    np.testing.assert_allclose(ans, ref, rtol=F64_SUMS, atol=0)
