"""The teaching core, sdpa_ref/core.py: against loops, scipy and mpmath, against finite differences over every
combination of its options, and as the independent oracle of every engine of the package."""

import ast
import doctest
import pathlib
import warnings

import numpy as np
import pytest
import scipy.special
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import sdpa_ref
from sdpa_ref import core
from sdpa_ref.gradcheck import DEFAULT_ATOL, DEFAULT_RTOL, check_jvp, check_vjp

from oracle import oracle_attention

EPS = np.finfo(np.float64).eps
#: The largest L, S, E, Ev the strategies draw: the longest sum a result holds.
MAX_N = 5
#: The largest |x - m| the softmax strategies draw (logits in [-30, 30]).
MAX_SHIFT = 60
#: Softmax family vs scipy: exp(x - m) carries |x - m| eps relative, then a sum of <= MAX_N terms and one
#: division or log; twice that for the other library's own rounding.
SOFTMAX_TOL = 2 * (MAX_SHIFT + MAX_N + 2) * EPS
#: The largest |T| the attention strategies reach (standard normal inputs, E <= MAX_N: |q.k| <~ 5 sqrt(E) * 5).
MAX_SCORE = 60
#: Attention forward, two float64 implementations: T has E-term dot products (MAX_N eps |T|), exp turns T's
#: absolute error into P's relative error (MAX_SCORE eps), the row sum and P V add MAX_N eps each; on O(1) data.
FWD_TOL = 4 * (MAX_SCORE + 3 * MAX_N) * EPS
#: Backward and JVP: the forward's P, then dO V^T, the row sum D and dT K (or dT^T Q): MAX_N eps more each,
#: on products of size up to MAX_N |x|^2 (standard normal: |x| <~ 5).
GRAD_TOL = 4 * FWD_TOL
#: Finite differences (the package's gradcheck defaults): central differences in float64 are good to about
#: eps^(2/3) ~ 4e-11 relative; a right derivative is far inside, a wrong one (a dropped row sum) far outside.
FD_RTOL, FD_ATOL = DEFAULT_RTOL, DEFAULT_ATOL
#: mpmath's exact value vs the core in float64: the forward's rounding, as FWD_TOL.
MP_TOL = FWD_TOL
#: The size of a wrong derivative's error that a check must report: well above FD_RTOL.
WRONG_AT_LEAST = 1e3 * FD_RTOL
#: Examples per hypothesis test (the whole file runs in a few seconds on two cores).
N_EXAMPLES = 12

CORE = pathlib.Path(core.__file__)


# ------------------------------------------------------------------ the softmax family

finite_rows = st.floats(-30, 30, allow_nan=False, allow_infinity=False, width=64)
masked_rows = st.one_of(finite_rows, st.just(-np.inf))


@st.composite
def arrays_and_axis(draw, elements=finite_rows):
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=MAX_N))
    x = draw(hnp.arrays(np.float64, shape, elements=elements))
    return x, draw(st.integers(-len(shape), len(shape) - 1))


@settings(max_examples=N_EXAMPLES, deadline=None)
@given(arrays_and_axis(masked_rows))
def test_softmax_family_matches_scipy(xa):
    x, axis = xa
    live = np.isfinite(np.max(x, axis=axis, keepdims=True))      # rows with a finite entry
    with np.errstate(all="ignore"):                               # scipy warns on an all -inf row
        y_ref, ly_ref = scipy.special.softmax(x, axis=axis), scipy.special.log_softmax(x, axis=axis)
        lse_ref = scipy.special.logsumexp(x, axis=axis)
    y_ans, ly_ans = core.softmax_forward(x, axis)[0], core.log_softmax_forward(x, axis)[0]
    np.testing.assert_allclose(np.where(live, y_ans, 0), np.where(live, y_ref, 0), rtol=SOFTMAX_TOL, atol=SOFTMAX_TOL)
    fin = live & np.isfinite(x)
    np.testing.assert_allclose(np.where(fin, ly_ans, 0), np.where(fin, ly_ref, 0), rtol=SOFTMAX_TOL,
                               atol=SOFTMAX_TOL * MAX_SHIFT)
    np.testing.assert_allclose(core.logsumexp_forward(x, axis)[0], lse_ref, rtol=SOFTMAX_TOL, atol=SOFTMAX_TOL)
    assert np.all(y_ans[np.isneginf(x) & live] == 0)              # masked entries of a live row: exactly 0
    assert np.isnan(y_ans[~np.broadcast_to(live, x.shape)]).all()    # an all -inf row: NaN, on purpose
    np.testing.assert_allclose(np.sum(y_ans, axis=axis, keepdims=True)[live], 1, rtol=SOFTMAX_TOL)


def test_stable_and_the_all_minus_inf_row_on_purpose():
    x = np.array([[1000.0, 1.0, -np.inf], [-np.inf, -np.inf, -np.inf]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")                            # no floating-point warning on either row
        y, res = core.softmax_forward(x)
        ly, lres = core.log_softmax_forward(x)
        lse, sres = core.logsumexp_forward(x)
        g = np.ones_like(x)
        grads = core.softmax_backward(res, g), core.log_softmax_backward(lres, g), core.logsumexp_backward(sres, lse)
    assert y[0].tolist() == [1.0, 0.0, 0.0] and ly[0].tolist() == [0.0, -999.0, -np.inf]
    assert lse.tolist() == [1000.0, -np.inf]
    assert np.isnan(y[1]).all() and np.isnan(ly[1]).all()
    assert all(np.isnan(d[1]).all() for d in grads)               # no mass to share: no derivative
    assert grads[0][0, 2] == 0                                    # a -inf entry gets no gradient


def test_logsumexp_matches_mpmath():
    mpmath = pytest.importorskip("mpmath")
    x = np.array([-745.1, 0.3, 709.0, 708.2, 1e-300])
    ref = mpmath.log(mpmath.fsum(mpmath.exp(mpmath.mpf(float(t))) for t in x))
    assert abs(core.logsumexp_forward(x)[0] - float(ref)) <= SOFTMAX_TOL * abs(float(ref))


FAMILY = {
    "softmax": (core.softmax_forward, core.softmax_backward, core.softmax_jvp),
    "log_softmax": (core.log_softmax_forward, core.log_softmax_backward, core.log_softmax_jvp),
    "logsumexp": (core.logsumexp_forward, core.logsumexp_backward, core.logsumexp_jvp),
}


@pytest.mark.parametrize("name", sorted(FAMILY))
@pytest.mark.parametrize("axis", [0, -1])
def test_softmax_family_derivatives_against_finite_differences(name, axis):
    fwd, bwd, jvp = FAMILY[name]
    x = np.random.default_rng(1).standard_normal((3, 4)) * 3
    rep = check_vjp(lambda x: fwd(x, axis)[0], lambda g, x: (bwd(fwd(x, axis)[1], g),), (x,),
                    rtol=FD_RTOL, atol=FD_ATOL)
    assert rep.ok, rep
    rep = check_jvp(lambda x: fwd(x, axis)[0], lambda t, x: jvp(fwd(x, axis)[1], t[0]), (x,),
                    rtol=FD_RTOL, atol=FD_ATOL)
    assert rep.ok, rep


def test_the_check_catches_a_wrong_softmax_vjp():
    x = np.random.default_rng(2).standard_normal((3, 4))
    fwd = core.softmax_forward
    rep = check_vjp(lambda x: fwd(x)[0], lambda g, x: (fwd(x)[0] * (1 - fwd(x)[0]) * g,), (x,),   # diag(J) only
                    rtol=FD_RTOL, atol=FD_ATOL)
    assert not rep.ok and rep.max_rel_error > WRONG_AT_LEAST


# ------------------------------------------------------------------ attention: options and problems

def _masks(B, L, S, rng):
    """The mask kinds: none, a full bool one (its row 0 fully masked), one broadcast over batch and rows."""
    full = rng.random((B, L, S)) < 0.7
    full[..., 0, :] = False
    keys = np.ones((1, S), dtype=bool)
    keys[0, S // 2] = False
    return {"none": None, "bool": full, "broadcast": keys}


def _allowed(L, S, mask, is_causal):
    """The allowed set built here, apart from the core: the mask AND j <= i."""
    A = np.ones((L, S), dtype=bool) if not is_causal else np.arange(S)[None, :] <= np.arange(L)[:, None]
    return A if mask is None else A & mask


def _lse_ref(q, k, mask, is_causal, scale):
    s = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    T = np.where(_allowed(q.shape[-2], k.shape[-2], mask, is_causal), s * q @ np.swapaxes(k, -1, -2), -np.inf)
    return core.logsumexp_forward(T)[0]


@st.composite
def problems(draw):
    """q, k, v of batch dims (B, H) and the core's options: scale given or not, causal or not, a mask kind."""
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    L, S = draw(st.integers(1, MAX_N)), draw(st.integers(0, MAX_N))
    E, Ev = draw(st.integers(1, MAX_N)), draw(st.integers(1, MAX_N))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (rng.standard_normal((B, H, n, w)) for n, w in ((L, E), (S, E), (S, Ev)))
    kind = draw(st.sampled_from(["none", "bool", "rows", "keys"]))
    mask = {"none": None, "bool": rng.random((B, H, L, S)) < 0.6, "rows": rng.random((L, 1)) < 0.7,
            "keys": rng.random((1, S)) < 0.7}[kind]
    opts = {"attn_mask": mask, "is_causal": draw(st.booleans()),
            "scale": draw(st.one_of(st.none(), st.floats(0.05, 2.0), st.floats(-2.0, -0.05)))}
    return q, k, v, opts, rng


# ------------------------------------------------------------------ attention: the core against loops and mpmath

@settings(max_examples=N_EXAMPLES, deadline=None)
@given(problems())
def test_attention_matches_the_loop_oracle(prob):
    q, k, v, opts, rng = prob
    g = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    mask = None if opts["attn_mask"] is None else np.broadcast_to(opts["attn_mask"], q.shape[:-1] + k.shape[-2:-1])
    out_ref, lse_ref, (dq_ref, dk_ref, dv_ref, _) = oracle_attention(
        q, k, v, mask=mask, is_causal=opts["is_causal"], scale=opts["scale"], grad_out=g)
    out_ans, res = core.attention_forward(q, k, v, **opts)
    np.testing.assert_allclose(out_ans, out_ref, rtol=FWD_TOL, atol=FWD_TOL)
    np.testing.assert_allclose(_lse_ref(q, k, opts["attn_mask"], opts["is_causal"], opts["scale"]), lse_ref,
                               rtol=FWD_TOL, atol=FWD_TOL)
    for ans, ref in zip(core.attention_backward(res, g), (dq_ref, dk_ref, dv_ref)):
        np.testing.assert_allclose(ans, ref, rtol=GRAD_TOL, atol=GRAD_TOL)


def test_attention_matches_mpmath():
    pytest.importorskip("mpmath")
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((1, 1, 3, 4)) * 3, rng.standard_normal((1, 1, 5, 4)), rng.standard_normal((1, 1, 5, 2))
    out_mp = oracle_attention(q, k, v, is_causal=True, num="mp")[0]
    out_ans = core.attention_forward(q, k, v, is_causal=True)[0]
    np.testing.assert_allclose(out_ans, out_mp.astype(np.float64), rtol=MP_TOL, atol=MP_TOL)


# ------------------------------------------------------------------ attention: derivatives by finite differences

def _fd_case():
    rng = np.random.default_rng(4)
    B, L, S, E, Ev = 2, 3, 4, 3, 2
    return (rng.standard_normal((B, L, E)), rng.standard_normal((B, S, E)), rng.standard_normal((B, S, Ev))), \
        _masks(B, L, S, rng)


def _core_derivatives(opts):
    fun = lambda q, k, v: core.attention_forward(q, k, v, **opts)[0]                     # noqa: E731
    vjp = lambda g, q, k, v: core.attention_backward(core.attention_forward(q, k, v, **opts)[1], g)   # noqa: E731
    jvp = lambda t, q, k, v: core.attention_jvp(core.attention_forward(q, k, v, **opts)[1], t)        # noqa: E731
    return fun, vjp, jvp


@pytest.mark.parametrize("mask", ["none", "bool", "broadcast"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_attention_derivatives_against_finite_differences(scale, is_causal, mask):
    args, masks = _fd_case()
    fun, vjp, jvp = _core_derivatives({"attn_mask": masks[mask], "is_causal": is_causal, "scale": scale})
    rep = check_vjp(fun, vjp, args, rtol=FD_RTOL, atol=FD_ATOL)
    assert rep.ok, rep
    rep = check_jvp(fun, jvp, args, rtol=FD_RTOL, atol=FD_ATOL)
    assert rep.ok, rep


def test_the_check_catches_a_wrong_attention_vjp():
    args, masks = _fd_case()
    opts = {"attn_mask": masks["broadcast"], "is_causal": True}
    fun = _core_derivatives(opts)[0]

    def without_D(g, q, k, v):                                  # WRONG: dT = P * dP, the row sum D dropped
        q, k, v, P, s = core.attention_forward(q, k, v, **opts)[1]
        dT = P * (g @ np.swapaxes(v, -1, -2))
        return s * dT @ k, s * np.swapaxes(dT, -1, -2) @ q, np.swapaxes(P, -1, -2) @ g

    rep = check_vjp(fun, without_D, args, rtol=FD_RTOL, atol=FD_ATOL)
    assert not rep.ok and rep.max_rel_error > WRONG_AT_LEAST


def test_a_row_with_no_allowed_key_is_zero_with_zero_gradients():
    args, masks = _fd_case()
    out, res = core.attention_forward(*args, attn_mask=masks["bool"])
    g = np.random.default_rng(5).standard_normal(out.shape)
    dq = core.attention_backward(res, g)[0]
    dO = core.attention_jvp(res, [np.ones_like(a) for a in args])
    assert not out[:, 0].any() and not dq[:, 0].any() and not dO[:, 0].any()
    empty = core.attention_forward(args[0], args[1][:, :0], args[2][:, :0])[0]     # S = 0: every row
    assert empty.shape == out.shape and not empty.any()


def test_attention_validates_at_the_entry():
    q, k, v = _fd_case()[0]
    with pytest.raises(ValueError, match="`key`"):
        core.attention_forward(q, k[..., :2], v)
    with pytest.raises(TypeError, match="`attn_mask`"):
        core.attention_forward(q, k, v, attn_mask=np.zeros((3, 4)))
    with pytest.raises(ValueError, match="`attn_mask`"):
        core.attention_forward(q, k, v, attn_mask=np.ones((3, 5), dtype=bool))
    with pytest.raises(ValueError, match="`scale`"):
        core.attention_forward(q, k, v, scale=0.0)


# ------------------------------------------------------------------ every engine against the core

def _engine_options(name, draw):
    """The keywords that pick engine ``name`` (a method of sdpa_ref.METHODS, or the reproducible precision)."""
    if name == "tiled":
        return {"method": "tiled", "block_size": draw(st.integers(1, 3))}
    if name == "split":
        return {"method": "split", "num_splits": draw(st.integers(1, 3))}
    if name == "reproducible":
        return {"precision": "reproducible"}
    return {"method": name}


ENGINES = sdpa_ref.METHODS + ("reproducible",)


def test_every_method_is_tested_against_the_core():
    assert set(sdpa_ref.METHODS) <= set(ENGINES) and {"tiled", "split"} <= set(ENGINES)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=N_EXAMPLES, deadline=None)
@given(prob=problems(), data=st.data())
def test_every_engine_against_the_core(engine, prob, data):
    q, k, v, opts, rng = prob
    pick = _engine_options(engine, data.draw)
    out_ref, res_ref = core.attention_forward(q, k, v, **opts)
    out_ans, res = sdpa_ref.sdpa_forward(q, k, v, **opts, **pick)
    np.testing.assert_allclose(out_ans, out_ref, rtol=FWD_TOL, atol=FWD_TOL)
    np.testing.assert_allclose(res.lse, _lse_ref(q, k, opts["attn_mask"], opts["is_causal"], opts["scale"]),
                               rtol=FWD_TOL, atol=FWD_TOL)
    g = rng.standard_normal(out_ref.shape)
    grads = sdpa_ref.sdpa_backward(res, g)
    for ans, ref in zip((grads.query, grads.key, grads.value), core.attention_backward(res_ref, g)):
        np.testing.assert_allclose(ans, ref, rtol=GRAD_TOL, atol=GRAD_TOL)
    tangents = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    _, dO_ans = sdpa_ref.sdpa_jvp((q, k, v), tangents, **opts, **pick)
    np.testing.assert_allclose(dO_ans, core.attention_jvp(res_ref, tangents), rtol=GRAD_TOL, atol=GRAD_TOL)


@pytest.mark.parametrize("method", sdpa_ref.BACKWARD_METHODS)
@settings(max_examples=N_EXAMPLES // 2, deadline=None)
@given(prob=problems())
def test_every_backward_method_against_the_core(method, prob):
    q, k, v, opts, rng = prob
    pick = {"precision": "reproducible"} if method == "reproducible" else {"method": "fast"}
    out, res = sdpa_ref.sdpa_forward(q, k, v, **opts, **pick)
    res_ref = core.attention_forward(q, k, v, **opts)[1]
    g = rng.standard_normal(out.shape)
    grads = sdpa_ref.sdpa_backward(res, g, method=method)
    for ans, ref in zip((grads.query, grads.key, grads.value), core.attention_backward(res_ref, g)):
        np.testing.assert_allclose(ans, ref, rtol=GRAD_TOL, atol=GRAD_TOL)


# ------------------------------------------------------------------ the core stands alone

def test_the_core_docstring_examples():
    res = doctest.testmod(core, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


def test_the_core_imports_numpy_alone_and_is_short():
    tree = ast.parse(CORE.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import at line {node.lineno}"
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
    assert imported == {"numpy"}
    assert len(CORE.read_text().splitlines()) <= 250
