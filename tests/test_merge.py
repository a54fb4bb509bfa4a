"""merge_attention and its VJP: split-KV merging of partial attention results (sdpa_ref/merge.py).

Four kinds of evidence: attention split over the keys and merged equals the unsplit call; an independent
mpmath loop; central differences for the backward over the option grid (and a wrong VJP that they must
catch); and the conventions -- empty parts are never read, only empty parts give (0, -inf), bad input is a
clear error, no input is written into. precision="reproducible": the merge, its VJP and combine_lse within 1 ulp
of 50-digit mpmath on adversarial parts (SEMANTICS.md's cancellation exemption), and the same bits under every
thread and SIMD setting (tests/repro_merge_digest.py, tests/data/reproducible_merge_hashes.json).
"""

import doctest
import json
import math
import os
import subprocess
import sys
import warnings

import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sdpa_ref
import sdpa_ref.merge
from sdpa_ref import causal_mask, merge_attention, merge_attention_backward, scaled_dot_product_attention
from sdpa_ref.lse import combine_lse

from helpers import assert_faithful
from tolerances import DD_CANCEL_RATIO, DD_CANCELLED, F64_AMPLIFIED, F64_SUMS, FD_LOOSE, FD_LOOSE_ATOL

FD_STEP = 1e-6
LN2 = math.log(2.0)
GARBAGE = [np.nan, np.inf, -np.inf, 1e308, -1e308, 5e-324]


def _inputs(seed, P=3, shape=(2, 3), Ev=2, empty=0.3, all_empty_rows=1):
    """Random parts: lse ~ N(0, 3), some parts empty (lse -inf, out NaN), ``all_empty_rows`` rows empty in
    every part."""
    rng = np.random.default_rng(seed)
    lse = 3 * rng.standard_normal((P,) + shape)
    out = rng.standard_normal((P,) + shape + (Ev,))
    dead = rng.random(lse.shape) < empty
    flat = dead.reshape(P, -1)
    flat[:, :all_empty_rows] = True
    lse[dead] = -np.inf
    out[dead] = np.nan
    return out, lse


@pytest.fixture
def quiet():
    """Every floating-point warning an error, inside NumPy and out."""
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        yield


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ------------------------------------------------------------ split agreement


@st.composite
def split_problems(draw):
    """An attention problem (GQA, causal, a bool mask with fully masked rows, Ev != E) and a split of its
    keys into 1..4 parts, contiguous or not, a part possibly without keys."""
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    L, S = draw(st.integers(1, 4)), draw(st.integers(1, 7))
    E, Ev = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((B, Hkv * G, L, E))
    k = 2 * rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, Ev))
    mask = rng.random((B, Hkv * G, L, S)) < draw(st.sampled_from([0.4, 0.8, 1.0]))
    if draw(st.booleans()):
        mask[0, 0, rng.integers(L)] = False                                    # a fully masked row
    if draw(st.booleans()):
        mask &= causal_mask(L, S, draw(st.sampled_from(["top_left", "bottom_right"])))
    P = draw(st.integers(1, 4))
    if draw(st.booleans()):
        labels = np.searchsorted(np.sort(rng.integers(0, S + 1, P - 1)), np.arange(S), side="right")
    else:
        labels = rng.integers(0, P, S)
    return q, k, v, mask, G > 1, [np.flatnonzero(labels == i) for i in range(P)]


@given(split_problems(), st.sampled_from(["e", 2]))
def test_attention_split_over_the_keys_and_merged_is_the_unsplit_attention(problem, base):
    q, k, v, mask, gqa, parts = problem
    kw = dict(enable_gqa=gqa, return_lse=True, fully_masked="zero")
    out_ref, lse_ref = scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    res = [scaled_dot_product_attention(q, k[..., j, :], v[..., j, :], attn_mask=mask[..., j], **kw)
           for j in parts]
    out_parts, lse_parts = np.stack([o for o, _ in res]), np.stack([s for _, s in res])
    scale = 1.0 if base == "e" else LN2
    out_ans, lse_ans = merge_attention(out_parts, lse_parts / scale, lse_base=base)
    atol = F64_AMPLIFIED * max(1.0, np.max(np.abs(v), initial=0))
    np.testing.assert_allclose(out_ans, out_ref, rtol=F64_AMPLIFIED, atol=atol)
    np.testing.assert_allclose(lse_ans * scale, lse_ref, rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED * 10)
    assert np.array_equal(np.isneginf(lse_ans), np.isneginf(lse_ref))
    assert not np.isnan(out_ans).any() and not np.isnan(lse_ans).any()


def test_the_split_problems_cover_empty_parts_and_fully_masked_rows():
    """The strategy above reaches what it is for: a part with no key for some row, a row with no key at all."""
    seen = set()

    @given(split_problems())
    def look(problem):
        q, k, v, mask, gqa, parts = problem
        for j in parts:
            if (~mask[..., j].any(-1)).any():
                seen.add("empty part")
        if (~mask.any(-1)).any():
            seen.add("fully masked row")

    look()
    assert seen == {"empty part", "fully masked row"}


# ------------------------------------------------------------ an independent loop in mpmath


def _merge_ref(out_parts, lse_parts, base):
    """A plain loop over rows and parts, in 40-digit mpmath."""
    mpmath.mp.dps = 40
    P, Ev = out_parts.shape[0], out_parts.shape[-1]
    o, lse = out_parts.reshape(P, -1, Ev), lse_parts.reshape(P, -1)
    out_ref, lse_ref = np.zeros(o.shape[1:]), np.full(lse.shape[1:], -np.inf)
    b = mpmath.mpf(2) if base == 2 else mpmath.e
    for r in range(lse.shape[1]):
        live = [i for i in range(P) if lse[i, r] != -np.inf]
        if not live:
            continue
        total = mpmath.fsum(b ** mpmath.mpf(lse[i, r]) for i in live)
        lse_ref[r] = float(mpmath.log(total, b))
        for e in range(Ev):
            out_ref[r, e] = float(mpmath.fsum(b ** mpmath.mpf(lse[i, r]) / total * mpmath.mpf(o[i, r, e])
                                              for i in live))
    return out_ref.reshape(out_parts.shape[1:]), lse_ref.reshape(lse_parts.shape[1:])


@pytest.mark.parametrize("base", ["e", 2])
@pytest.mark.parametrize("seed", range(4))
def test_merge_matches_an_mpmath_loop(seed, base, quiet):
    out_parts, lse_parts = _inputs(seed, P=1 + seed, shape=(2, 3), Ev=3)
    lse_parts[0, 0, 1] = 700.0                       # exp overflows without the shift by the largest part
    out_ans, lse_ans = merge_attention(out_parts, lse_parts, lse_base=base)
    out_ref, lse_ref = _merge_ref(out_parts, lse_parts, base)
    np.testing.assert_allclose(out_ans, out_ref, rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(lse_ans, lse_ref, rtol=F64_SUMS, atol=F64_SUMS)


def test_translation_permutation_and_grouping(quiet):
    """Adding c to every lse_i adds c to lse and leaves out; the order and grouping of parts do not matter."""
    out_parts, lse_parts = _inputs(7, P=4, shape=(3, 2), Ev=2)
    out, lse = merge_attention(out_parts, lse_parts)
    out_c, lse_c = merge_attention(out_parts, lse_parts + 0.75)
    np.testing.assert_allclose(out_c, out, rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(lse_c, lse + 0.75, rtol=F64_SUMS, atol=F64_SUMS)
    perm = [2, 0, 3, 1]
    out_p, lse_p = merge_attention(out_parts[perm], lse_parts[perm])
    np.testing.assert_allclose(out_p, out, rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(lse_p, lse, rtol=F64_SUMS, atol=F64_SUMS)
    o01, l01 = merge_attention(out_parts[:2], lse_parts[:2])
    o23, l23 = merge_attention(out_parts[2:], lse_parts[2:])
    out_g, lse_g = merge_attention(np.stack([o01, o23]), np.stack([l01, l23]))
    np.testing.assert_allclose(out_g, out, rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(lse_g, lse, rtol=F64_SUMS, atol=F64_SUMS)


def test_one_part_and_empty_parts_are_the_identity_bit_for_bit(quiet):
    rng = np.random.default_rng(3)
    out1, lse1 = rng.standard_normal((1, 2, 4, 3)), 50 * rng.standard_normal((1, 2, 4))
    for base in ("e", 2):
        out, lse = merge_attention(out1, lse1, lse_base=base)
        assert _same_bits(out, out1[0]) and _same_bits(lse, lse1[0])
        junk = np.full((3, 2, 4, 3), np.nan)
        out, lse = merge_attention(np.concatenate([junk[:2], out1, junk[2:]]),
                                   np.concatenate([np.full((2, 2, 4), -np.inf), lse1, np.full((1, 2, 4), -np.inf)]),
                                   lse_base=base)
        assert _same_bits(out, out1[0]) and _same_bits(lse, lse1[0])


def test_base_2_is_the_natural_merge_in_other_units(quiet):
    out_parts, lse_parts = _inputs(11, P=3, shape=(4,), Ev=2)
    out_e, lse_e = merge_attention(out_parts, lse_parts)
    out_2, lse_2 = merge_attention(out_parts, lse_parts / LN2, lse_base="2")
    np.testing.assert_allclose(out_2, out_e, rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(lse_2 * LN2, lse_e, rtol=F64_SUMS, atol=F64_SUMS)


def test_nan_in_an_lse_part_poisons_its_row_only(quiet):
    out_parts, lse_parts = _inputs(5, P=3, shape=(4,), Ev=2, empty=0.0, all_empty_rows=0)
    lse_parts[1, 2] = np.nan
    out, lse = merge_attention(out_parts, lse_parts)
    assert np.isnan(out[2]).all() and np.isnan(lse[2])
    assert np.isfinite(np.delete(out, 2, axis=0)).all() and np.isfinite(np.delete(lse, 2)).all()
    d_out, d_lse = merge_attention_backward(out_parts, lse_parts, np.random.default_rng(0).standard_normal(out.shape))
    assert np.isnan(d_lse[:, 2]).all() and np.isfinite(np.delete(d_lse, 2, axis=1)).all()


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("float16", "float32"), ("bfloat16", "float64"),
                                    ("float64", "float16")])
def test_results_come_back_in_each_inputs_dtype(dtypes, quiet):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dt = [np.dtype(ml_dtypes.bfloat16) if d == "bfloat16" else np.dtype(d) for d in dtypes]
    out_parts, lse_parts = _inputs(2, P=2, shape=(3,), Ev=2)
    o, s = out_parts.astype(dt[0]), lse_parts.astype(dt[1])
    out, lse = merge_attention(o, s)
    assert out.dtype == dt[0] and lse.dtype == dt[1]
    out_ref, lse_ref = merge_attention(o.astype(np.float64), s.astype(np.float64))   # computed in float64
    assert _same_bits(out, out_ref.astype(dt[0])) and _same_bits(lse, lse_ref.astype(dt[1]))
    d_out, d_lse = merge_attention_backward(o, s, np.ones(out.shape, dt[0]))
    assert d_out.dtype == dt[0] and d_lse.dtype == dt[1]


# ------------------------------------------------------------ the backward against central differences


def _vjp_wrong(out_parts, lse_parts, g, g_lse=None, *, lse_base="e", variant):
    """Deliberately wrong VJPs that the check below must catch."""
    d_out, d_lse = merge_attention_backward(out_parts, lse_parts, g, g_lse, lse_base=lse_base)
    lse_e = lse_parts * (LN2 if str(lse_base) == "2" else 1.0)
    _, w = combine_lse(lse_e)
    live = np.isfinite(lse_parts)
    o = np.where(live[..., None], out_parts, 0.0)
    g_o = np.sum(o * g, axis=-1)
    c = LN2 if str(lse_base) == "2" else 1.0
    gl = 0.0 if g_lse is None else g_lse
    if variant == "no <g, out> term":
        d_lse = np.where(live, c * w * g_o + w * gl, 0.0)
    elif variant == "no ln 2 in base 2":
        d_lse = np.where(live, (d_lse - w * gl) / c + w * gl, 0.0)
    elif variant == "d lse / d lse_i = 1":
        d_lse = np.where(live, d_lse - w * gl + gl, 0.0)
    return d_out, d_lse


def _fd_errors(vjp, out_parts, lse_parts, g, g_lse, base):
    """The largest entry-wise error of ``vjp`` against central differences of ``<g, out> + <g_lse, lse>``,
    for ``out_parts`` and ``lse_parts`` (the live lse entries; the analytic gradient must be exactly 0 at
    the others)."""
    row = np.isfinite(lse_parts).any(axis=0)

    def J(o, s):
        out, lse = merge_attention(o, s, lse_base=base)
        val = np.sum(g * out)
        return val + (0.0 if g_lse is None else np.sum(g_lse * np.where(row, lse, 0.0)))

    def num_grad(x, which, where):
        d = np.zeros(x.shape)
        for idx in zip(*np.nonzero(where)):
            h = FD_STEP * max(1.0, abs(x[idx]))
            xp, xm = x.copy(), x.copy()
            xp[idx] += h
            xm[idx] -= h
            args_p = (xp, lse_parts) if which == 0 else (out_parts, xp)
            args_m = (xm, lse_parts) if which == 0 else (out_parts, xm)
            d[idx] = (J(*args_p) - J(*args_m)) / (2 * h)
        return d

    clean = np.where(np.isfinite(out_parts), out_parts, 0.0)       # NaN parts: perturbing NaN is no test
    out_parts = clean
    d_out, d_lse = vjp(out_parts, lse_parts, g, g_lse, lse_base=base)
    num_out = num_grad(out_parts, 0, np.ones(out_parts.shape, bool))
    live = np.isfinite(lse_parts)
    num_lse = num_grad(lse_parts, 1, live)
    assert np.all(d_lse[~live] == 0) and np.all(d_out[~live] == 0)
    err = lambda a, n: float(np.max(np.abs(a - n) - FD_LOOSE * np.abs(n), initial=0.0))
    return err(d_out, num_out), err(d_lse, num_lse)


GRID = [(base, with_g_lse, scene) for base in ("e", 2, "2") for with_g_lse in (False, True)
        for scene in ("all live", "empty parts", "all-empty rows")]


@pytest.mark.parametrize("base,with_g_lse,scene", GRID)
def test_backward_matches_central_differences(base, with_g_lse, scene, quiet):
    empty, dead_rows = {"all live": (0.0, 0), "empty parts": (0.35, 0), "all-empty rows": (0.35, 2)}[scene]
    out_parts, lse_parts = _inputs(13, P=3, shape=(2, 2), Ev=3, empty=empty, all_empty_rows=dead_rows)
    rng = np.random.default_rng(1)
    g = rng.standard_normal(out_parts.shape[1:])
    g_lse = rng.standard_normal(lse_parts.shape[1:]) if with_g_lse else None
    e_out, e_lse = _fd_errors(merge_attention_backward, out_parts, lse_parts, g, g_lse, base)
    assert e_out <= FD_LOOSE_ATOL and e_lse <= FD_LOOSE_ATOL, (e_out, e_lse)


@pytest.mark.parametrize("variant,base", [("no <g, out> term", "e"), ("no <g, out> term", 2),
                                          ("no ln 2 in base 2", 2), ("d lse / d lse_i = 1", "e")])
def test_the_difference_check_catches_a_wrong_vjp(variant, base, quiet):
    out_parts, lse_parts = _inputs(13, P=3, shape=(2, 2), Ev=3, empty=0.2, all_empty_rows=0)
    rng = np.random.default_rng(1)
    g, g_lse = rng.standard_normal(out_parts.shape[1:]), rng.standard_normal(lse_parts.shape[1:])

    def wrong(*args, lse_base):
        return _vjp_wrong(*args, lse_base=lse_base, variant=variant)

    assert max(_fd_errors(merge_attention_backward, out_parts, lse_parts, g, g_lse, base)) <= FD_LOOSE_ATOL
    assert max(_fd_errors(wrong, out_parts, lse_parts, g, g_lse, base)) > 1e-3


# ------------------------------------------------------------ empty parts are never read


@pytest.mark.parametrize("base", ["e", 2])
def test_garbage_in_empty_parts_changes_no_bit(base, quiet):
    """NaN, inf, 1e308, subnormals, random bits in ``out_i`` of an empty part, and in ``grad_out`` /
    ``grad_lse`` on a row whose parts are all empty: the clean run's bits, no warning."""
    out_parts, lse_parts = _inputs(17, P=4, shape=(2, 3), Ev=2, empty=0.4, all_empty_rows=2)
    dead, row_dead = np.isneginf(lse_parts), np.isneginf(lse_parts).all(axis=0)
    rng = np.random.default_rng(0)
    g, g_lse = rng.standard_normal(out_parts.shape[1:]), rng.standard_normal(lse_parts.shape[1:])
    clean_o = np.where(dead[..., None], 0.25, out_parts)
    clean_g, clean_gl = np.where(row_dead[..., None], 0.5, g), np.where(row_dead, 0.5, g_lse)
    fwd_ref = merge_attention(clean_o, lse_parts, lse_base=base)
    bwd_ref = merge_attention_backward(clean_o, lse_parts, clean_g, clean_gl, lse_base=base)
    bits = lambda shape: rng.integers(-2**63, 2**63 - 1, shape, dtype=np.int64, endpoint=True).view(np.float64)
    for junk in GARBAGE + ["random bits"]:
        fill = {n: bits(x.shape) if junk == "random bits" else junk
                for n, x in (("o", out_parts), ("g", g), ("gl", g_lse))}
        o = np.where(dead[..., None], fill["o"], clean_o)
        gg = np.where(row_dead[..., None], fill["g"], clean_g)
        gl = np.where(row_dead, fill["gl"], clean_gl)
        for ans, ref in zip(merge_attention(o, lse_parts, lse_base=base), fwd_ref):
            assert _same_bits(ans, ref), junk
        for ans, ref in zip(merge_attention_backward(o, lse_parts, gg, gl, lse_base=base), bwd_ref):
            assert _same_bits(ans, ref), junk


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_only_empty_parts_give_zero_and_minus_inf(dtype, quiet):
    out_parts = np.full((3, 2, 4, 5), np.nan, dtype)
    lse_parts = np.full((3, 2, 4), -np.inf, dtype)
    out, lse = merge_attention(out_parts, lse_parts, lse_base=2)
    assert _same_bits(out, np.zeros((2, 4, 5), dtype)) and _same_bits(lse, np.full((2, 4), -np.inf, dtype))
    d_out, d_lse = merge_attention_backward(out_parts, lse_parts, np.full(out.shape, np.inf, dtype),
                                            np.full(lse.shape, np.nan, dtype))
    assert _same_bits(d_out, np.zeros(out_parts.shape, dtype)) and _same_bits(d_lse, np.zeros(lse_parts.shape, dtype))


def test_empty_sizes(quiet):
    for o_shape in [(2, 0, 3), (2, 3, 0), (1, 0, 0, 2)]:
        o, s = np.zeros(o_shape), np.zeros(o_shape[:-1])
        out, lse = merge_attention(o, s)
        assert out.shape == o_shape[1:] and lse.shape == o_shape[1:-1]
        d_out, d_lse = merge_attention_backward(o, s, np.zeros(out.shape), np.zeros(lse.shape))
        assert d_out.shape == o_shape and d_lse.shape == o_shape[:-1]


# ------------------------------------------------------------ bad input


def _args():
    out_parts, lse_parts = _inputs(0, P=2, shape=(3,), Ev=4)
    return out_parts, lse_parts


BAD_FORWARD = [
    (dict(lse_parts=np.zeros((2, 4))), ValueError, "`lse_parts`"),
    (dict(lse_parts=np.zeros((2, 3, 1))), ValueError, "`lse_parts`"),
    (dict(lse_parts=np.zeros((3, 3))), ValueError, "`lse_parts`"),
    (dict(out_parts=np.zeros((0, 3, 4)), lse_parts=np.zeros((0, 3))), ValueError, "`out_parts`"),
    (dict(out_parts=np.zeros(4), lse_parts=np.zeros(())), ValueError, "`out_parts`"),
    (dict(lse_parts=np.array([[0.0, np.inf, 1.0], [0.0, 0.0, 0.0]])), ValueError, "`lse_parts`"),
    (dict(out_parts=np.zeros((2, 3, 4), int)), TypeError, "`out_parts`"),
    (dict(lse_parts=np.zeros((2, 3), complex)), TypeError, "`lse_parts`"),
    (dict(out_parts=[[1.0], [1.0, 2.0]]), TypeError, "`out_parts`"),
    (dict(lse_base=10), ValueError, "`lse_base`"),
    (dict(lse_base="ln"), ValueError, "`lse_base`"),
    (dict(lse_base=2.0), ValueError, "`lse_base`"),
    (dict(lse_base=True), ValueError, "`lse_base`"),
    (dict(lse_base=None), ValueError, "`lse_base`"),
]


@pytest.mark.parametrize("bad,exc,name", BAD_FORWARD)
def test_bad_input_is_a_clear_error_naming_the_argument(bad, exc, name):
    out_parts, lse_parts = _args()
    kw = dict(out_parts=out_parts, lse_parts=lse_parts) | bad
    base = kw.pop("lse_base", "e")
    with pytest.raises(exc, match=name):
        merge_attention(kw["out_parts"], kw["lse_parts"], lse_base=base)
    g = np.zeros(np.shape(kw["out_parts"])[1:]) if isinstance(kw["out_parts"], np.ndarray) else np.zeros(1)
    with pytest.raises(exc, match=name):
        merge_attention_backward(kw["out_parts"], kw["lse_parts"], g, lse_base=base)


@pytest.mark.parametrize("bad,exc,name", [
    (dict(grad_out=np.zeros((3, 5))), ValueError, "`grad_out`"),
    (dict(grad_out=np.zeros((2, 3, 4))), ValueError, "`grad_out`"),
    (dict(grad_out=np.zeros((3, 4), int)), TypeError, "`grad_out`"),
    (dict(grad_lse=np.zeros((3, 1))), ValueError, "`grad_lse`"),
    (dict(grad_lse=np.zeros(3, complex)), TypeError, "`grad_lse`"),
])
def test_bad_cotangents_are_clear_errors(bad, exc, name):
    out_parts, lse_parts = _args()
    kw = dict(grad_out=np.zeros((3, 4)), grad_lse=None) | bad
    with pytest.raises(exc, match=name):
        merge_attention_backward(out_parts, lse_parts, kw["grad_out"], kw["grad_lse"])


def test_the_string_2_and_a_numpy_2_are_base_2(quiet):
    out_parts, lse_parts = _args()
    ref = merge_attention(out_parts, lse_parts, lse_base=2)
    for base in ("2", np.int64(2)):
        assert all(_same_bits(a, b) for a, b in zip(merge_attention(out_parts, lse_parts, lse_base=base), ref))


def test_no_input_is_written_into(quiet):
    out_parts, lse_parts = _inputs(9, P=3, shape=(2, 3), Ev=2, empty=0.4, all_empty_rows=1)
    rng = np.random.default_rng(2)
    g, g_lse = rng.standard_normal(out_parts.shape[1:]), rng.standard_normal(lse_parts.shape[1:])
    arrays = [out_parts, lse_parts, g, g_lse]
    copies = [a.copy() for a in arrays]
    for a in arrays:
        a.flags.writeable = False                         # a write would raise
    merge_attention(out_parts, lse_parts)
    merge_attention_backward(out_parts, lse_parts, g, g_lse, lse_base=2)
    assert all(_same_bits(a, c) for a, c in zip(arrays, copies))


def test_docstring_examples():
    res = doctest.testmod(sdpa_ref.merge, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


def test_public_names():
    assert {"merge_attention", "merge_attention_backward"} <= set(dir(sdpa_ref))   # one at the top, one in merge
    assert sdpa_ref.merge_attention is sdpa_ref.merge.merge_attention


@pytest.mark.parametrize("axis", [1, -2, 2, -3])
def test_the_parts_may_sit_on_any_axis(axis):
    """``axis=`` is moving the parts' axis to the front by hand, forward and backward, bit for bit; FlashInfer's
    ``merge_states`` layout ``(L, P, H, Ev)`` / ``(L, P, H)`` is ``axis=1``."""
    rng = np.random.default_rng(3)
    o, lse = rng.standard_normal((3, 4, 5, 6)), rng.standard_normal((3, 4, 5))
    lse[1, 2, 3] = -np.inf                                           # an empty part somewhere
    ax = axis % lse.ndim                                             # negative: counted on lse_parts
    front = (np.ascontiguousarray(np.moveaxis(o, ax, 0)), np.ascontiguousarray(np.moveaxis(lse, ax, 0)))
    out, l = merge_attention(o, lse, axis=axis)
    out0, l0 = merge_attention(*front)
    assert np.array_equal(out, out0) and np.array_equal(l, l0)
    g, gl = rng.standard_normal(out0.shape), rng.standard_normal(l0.shape)
    do, dl = merge_attention_backward(o, lse, g, gl, axis=axis)
    do0, dl0 = merge_attention_backward(*front, g, gl)
    assert np.array_equal(do, np.moveaxis(do0, 0, ax)) and np.array_equal(dl, np.moveaxis(dl0, 0, ax))


@pytest.mark.parametrize("axis", [3, -4, 1.0, True])
def test_a_bad_axis_names_axis(axis):
    with pytest.raises(ValueError, match="`axis` should be an int in \\[-3, 2\\]"):
        merge_attention(np.zeros((2, 3, 4, 5)), np.zeros((2, 3, 4)), axis=axis)


def test_axis_0_is_the_default_bit_for_bit():
    """``axis=0`` and ``axis=-lse.ndim`` are the default call, forward and backward, in float64 and float16."""
    rng = np.random.default_rng(4)
    for dt in (np.float64, np.float16):
        o, lse = rng.standard_normal((3, 2, 5, 4)).astype(dt), rng.standard_normal((3, 2, 5)).astype(dt)
        lse[0, 1, 2] = -np.inf
        g, gl = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5))
        ref = merge_attention(o, lse, lse_base=2) + merge_attention_backward(o, lse, g, gl, lse_base=2)
        for axis in (0, -3, np.int64(0)):
            got = (merge_attention(o, lse, lse_base=2, axis=axis)
                   + merge_attention_backward(o, lse, g, gl, lse_base=2, axis=axis))
            assert all(a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True) for a, b in zip(got, ref))


def test_flashinfer_merge_states_layout_is_the_unsplit_attention():
    """FlashInfer's ``merge_states`` takes ``v`` ``(L, P, Hq, Ev)`` and ``s`` ``(L, P, Hq)`` (base 2): with
    ``axis=1`` the merge of attention over three slices of the keys is the attention over all of them."""
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 7, 4)), rng.standard_normal((2, 7, 5))
    parts = [scaled_dot_product_attention(q, k[:, s], v[:, s], return_lse=True)
             for s in (slice(0, 2), slice(2, 3), slice(3, 7))]
    v_fi = np.stack([np.moveaxis(o, 0, 1) for o, _ in parts], axis=1)            # (L, P, Hq, Ev)
    s_fi = np.stack([np.moveaxis(l, 0, 1) for _, l in parts], axis=1) / LN2   # (L, P, Hq), base 2
    out, lse = merge_attention(v_fi, s_fi, lse_base=2, axis=1)
    ref_out, ref_lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    assert out.shape == (3, 2, 5) and lse.shape == (3, 2)
    np.testing.assert_allclose(out, np.moveaxis(ref_out, 0, 1), rtol=F64_SUMS, atol=F64_SUMS)
    np.testing.assert_allclose(lse * LN2, np.moveaxis(ref_lse, 0, 1), rtol=F64_SUMS,
                               atol=F64_SUMS)
    d_out, d_lse = merge_attention_backward(v_fi, s_fi, np.ones_like(out), lse_base=2, axis=1)
    assert d_out.shape == v_fi.shape and d_lse.shape == s_fi.shape


def test_the_errors_report_the_shapes_given():
    """With the parts on ``axis``, errors name that axis and the shapes as given, not as moved."""
    with pytest.raises(ValueError, match=r"P >= 1 on axis 1\), but got shape \(3, 0, 4, 5\)"):
        merge_attention(np.zeros((3, 0, 4, 5)), np.zeros((3, 0, 4)), axis=1)
    with pytest.raises(ValueError, match=r"should have shape \(3, 2, 4\).*but got shape \(3, 2, 5\)"):
        merge_attention(np.zeros((3, 2, 4, 5)), np.zeros((3, 2, 5)), axis=1)
    lse = np.zeros((3, 2, 4))
    lse[2, 1, 0] = np.inf
    with pytest.raises(ValueError, match=r"\+inf at index \(2, 1, 0\)"):
        merge_attention(np.zeros((3, 2, 4, 5)), lse, axis=1)


# ------------------------------------------------------------ precision="reproducible": faithful against 50 digits


def _exact_merge(out_parts, lse_parts, g, g_lse, base):
    """The exact merge and its VJP of ``(P, R, Ev)`` parts by a loop over rows in 50-digit mpmath: ``(out, lse,
    w, d_out, d_lse)`` as mpf object arrays, and the sums of the magnitudes of each result's terms (what SEMANTICS.md's
    cancellation exemption compares with): ``(out, lse, d_lse)``."""
    ctx = mpmath.MPContext()
    ctx.dps = 50
    P, R, Ev = out_parts.shape
    b = ctx.mpf(2) if base == 2 else ctx.e
    c = ctx.log(2) if base == 2 else ctx.mpf(1)
    res = {n: np.empty(s, dtype=object) for n, s in (("out", (R, Ev)), ("lse", (R,)), ("w", (P, R)),
                                                      ("d_out", (P, R, Ev)), ("d_lse", (P, R)))}
    terms = {n: np.zeros(s) for n, s in (("out", (R, Ev)), ("lse", (R,)), ("d_lse", (P, R)))}
    for r in range(R):
        live = [i for i in range(P) if lse_parts[i, r] != -np.inf]
        res["out"][r], res["lse"][r] = ctx.mpf(0), ctx.mpf("-inf")
        res["w"][:, r], res["d_out"][:, r], res["d_lse"][:, r] = ctx.mpf(0), ctx.mpf(0), ctx.mpf(0)
        if not live:
            continue
        ls = {i: ctx.mpf(float(lse_parts[i, r])) for i in live}
        top = max(live, key=lambda i: ls[i])
        m = ls[top]                                               # log1p: 1 + e^-720 needs more than 50 digits
        lse = m + ctx.log1p(ctx.fsum(b ** (ls[i] - m) for i in live if i != top)) / ctx.log(b)
        res["lse"][r], terms["lse"][r] = lse, float(abs(m) + abs(lse - m))
        w = {i: b ** (ls[i] - lse) for i in live}
        o = {i: [ctx.mpf(float(x)) for x in out_parts[i, r]] for i in live}
        gg = [ctx.mpf(float(x)) for x in g[r]]
        for e in range(Ev):
            res["out"][r, e] = ctx.fsum(w[i] * o[i][e] for i in live)
            terms["out"][r, e] = float(ctx.fsum(abs(w[i] * o[i][e]) for i in live))
        gw = {i: ctx.fsum(gg[e] * o[i][e] for e in range(Ev)) for i in live}
        gw_abs = {i: ctx.fsum(abs(gg[e] * o[i][e]) for e in range(Ev)) for i in live}
        D = ctx.fsum(w[i] * gw[i] for i in live)
        D_abs = ctx.fsum(w[i] * gw_abs[i] for i in live)
        for i in live:
            res["w"][i, r] = w[i]
            res["d_out"][i, r] = [w[i] * x for x in gg]
            res["d_lse"][i, r] = c * w[i] * (gw[i] - D) + w[i] * ctx.mpf(float(g_lse[r]))
            terms["d_lse"][i, r] = float(c * w[i] * (gw_abs[i] + D_abs) + w[i] * abs(float(g_lse[r])))
    return res, terms


def _assert_faithful_or_cancelled(x, truth, terms, what):
    """Faithful (:func:`helpers.assert_faithful`) wherever the result is no more than DD_CANCEL_RATIO times smaller
    than its terms; elsewhere (SEMANTICS.md's exemption) within DD_CANCELLED of their magnitude. Returns how many
    entries were exempt."""
    x, t = np.asarray(x, np.float64).ravel(), truth.ravel()
    terms = np.broadcast_to(terms, truth.shape).ravel()
    exempt = np.array([not mpmath.isnan(v) and mpmath.isfinite(v) and terms[i] > DD_CANCEL_RATIO * abs(v)
                       for i, v in enumerate(t)], dtype=bool)
    assert_faithful(x[~exempt], t[~exempt], what)
    for i in np.flatnonzero(exempt):
        assert abs(mpmath.mpf(float(x[i])) - t[i]) <= DD_CANCELLED * terms[i], (what, i, x[i], t[i])
    return int(exempt.sum())


def _adversarial_cases():
    """``{name: (out_parts (P, R, Ev), lse_parts (P, R))}``: the merges that break a float64 merge."""
    rng = np.random.default_rng(43)
    cases = {}
    o, l = _inputs(5, P=4, shape=(7,), Ev=3, empty=0.3, all_empty_rows=1)
    cases["random-with-empty-parts-and-an-empty-row"] = (o, l)
    # outputs of opposite sign cancel, down to 1e-12 of their size (the exemption starts at 2**45 ~ 3.5e13)
    d = np.array([1e-2, 1e-5, 1e-8, 1e-10, 1e-12, 3e-13])
    o = np.stack([np.stack([1 + d, 0.75 - d], -1), np.stack([-np.ones_like(d), -0.75 * np.ones_like(d)], -1)])
    cases["cancelling-equal-weights"] = (o, np.zeros((2, d.size)))
    lse = np.array([[0.3] * d.size, [-0.2] * d.size])
    o = np.stack([np.stack([np.full(d.size, 1.0), 0.5 + d], -1),
                  np.stack([-np.exp(0.5) * (1 + d), np.full(d.size, -0.5 * np.exp(0.5))], -1)])
    cases["cancelling-unequal-weights"] = (o, lse)
    # a part dominating by e^40 (and 2^40), a tie, and huge log-sum-exps of either sign
    o = rng.uniform(-1, 1, (3, 7, 2))
    lse = np.array([[40.0, 0.0, 1e17, 1e300, -1e300, 700.0, 0.0],
                    [0.0, 0.0, 1e17 + 16, 1e300 * (1 - 2e-16), -1e300 * (1 - 2e-16), -700.0, -700.0],
                    [-np.inf, 40.0, 1e17 - 32, -np.inf, -np.inf, -1e308, -1070.0]])    # a merged lse of e^-700
    cases["dominant-huge-and-far-apart"] = (o, lse)
    # base-2 and natural results near powers of two: 3 parts at l, l, l + 1 give l + log2(4) = l + 2 in base 2
    k = np.array([1.0, 2.0, 4.0, 1024.0, 2.0 ** 30, -8.0])
    lse = np.stack([k - 2, k - 2, k - 1])
    lse[:, 4] = np.nextafter(lse[:, 4], np.inf)                # an ulp past them
    cases["near-powers-of-two"] = (rng.uniform(-1, 1, (3, k.size, 3)), lse)
    # the merged lse cancels: m = -log(s) (its exact value is tiny beside m: the exemption's case)
    lse = np.array([[-math.log(2.0), -1.0, -0.5]] * 2)          # 0 up to fl(ln 2)'s error in base e; 0 in base 2
    cases["lse-near-zero"] = (rng.uniform(-1, 1, (2, 3, 2)), lse)
    one = rng.uniform(-1, 1, (1, 3, 2))
    cases["one-part"] = (one, np.array([[0.5, -np.inf, 1e300]]))
    return cases


@pytest.mark.parametrize("base", ["e", 2])
@pytest.mark.parametrize("name", list(_adversarial_cases()))
def test_reproducible_merge_is_faithful_against_mpmath(name, base):
    """Every result of the reproducible merge, its VJP and combine_lse within 1 ulp of 50-digit mpmath: the
    cancelling merges, a part ahead by e^40, ties, log-sum-exps of 1e17 and 1e300 of either sign, near powers of
    two, one part, empty parts (NaN outputs, never read) and rows with none (exactly (0, -inf), zero gradients)."""
    out_parts, lse_parts = _adversarial_cases()[name]
    rng = np.random.default_rng(7)
    g = rng.uniform(-1, 1, out_parts.shape[1:])
    g_lse = rng.uniform(-1, 1, lse_parts.shape[1:])
    truth, terms = _exact_merge(out_parts, lse_parts, g, g_lse, base)
    with warnings.catch_warnings(), np.errstate(all="raise"):          # no floating-point warning
        warnings.simplefilter("error")
        out, lse = merge_attention(out_parts, lse_parts, lse_base=base, precision="reproducible")
        d_out, d_lse = merge_attention_backward(out_parts, lse_parts, g, g_lse, lse_base=base,
                                                precision="reproducible")
        lse_c, w = combine_lse(lse_parts, base=base, precision="reproducible")
    exempt = _assert_faithful_or_cancelled(out, truth["out"], terms["out"], "out")
    exempt += _assert_faithful_or_cancelled(lse, truth["lse"], terms["lse"], "lse")
    assert _same_bits(lse_c, lse)
    assert_faithful(w, truth["w"], "w")
    assert_faithful(d_out, truth["d_out"], "grad_out_parts")
    exempt += _assert_faithful_or_cancelled(d_lse, truth["d_lse"], terms["d_lse"], "grad_lse_parts")
    assert exempt == (1 if name == "lse-near-zero" else 0)        # the exemption is that case's alone
    none = np.all(np.isneginf(lse_parts), axis=0)
    assert not np.any(out[none]) and np.all(np.isneginf(lse[none]))
    dead = np.isneginf(lse_parts)
    assert not np.any(d_out[dead]) and not np.any(d_lse[dead])


def test_the_fast_merge_is_not_faithful_where_the_reproducible_one_is(quiet):
    """The reason for the option: on the cancelling merges the fast merge is many ulps off."""
    out_parts, lse_parts = _adversarial_cases()["cancelling-unequal-weights"]
    g, g_lse = np.ones(out_parts.shape[1:]), np.zeros(lse_parts.shape[1:])
    truth = _exact_merge(out_parts, lse_parts, g, g_lse, "e")[0]["out"]
    fast = merge_attention(out_parts, lse_parts)[0]
    ulps = [abs(float((mpmath.mpf(float(a)) - t) / mpmath.mpf(float(np.spacing(float(t)))))) for a, t in
            zip(fast.ravel(), truth.ravel())]
    assert max(ulps) > 100


@pytest.mark.parametrize("base", ["e", 2])
def test_reproducible_backward_matches_central_differences(base, quiet):
    out_parts, lse_parts = _inputs(21, P=3, shape=(2, 3), Ev=2)
    rng = np.random.default_rng(1)
    g, g_lse = rng.standard_normal(out_parts.shape[1:]), rng.standard_normal(lse_parts.shape[1:])
    vjp = lambda *a, **kw: merge_attention_backward(*a, **kw, precision="reproducible")
    errs = _fd_errors(vjp, out_parts, lse_parts, g, g_lse, base)
    assert max(errs) <= FD_LOOSE_ATOL, errs


@pytest.mark.parametrize("base", ["e", 2])
def test_reproducible_merge_ignores_garbage_in_empty_parts_and_poisons_nan_rows(base, quiet):
    out_parts, lse_parts = _inputs(17, P=4, shape=(2, 3), Ev=2, empty=0.4, all_empty_rows=2)
    dead = np.isneginf(lse_parts)
    clean = np.where(dead[..., None], 0.0, out_parts)
    ref = merge_attention(clean, lse_parts, lse_base=base, precision="reproducible")
    for junk in GARBAGE:
        got = merge_attention(np.where(dead[..., None], junk, clean), lse_parts, lse_base=base,
                              precision="reproducible")
        assert all(_same_bits(a, b) for a, b in zip(got, ref)), junk
    lse_nan = lse_parts.copy()
    lse_nan[0, 1] = np.nan                                        # NaN where the fast merge has NaN
    out, lse = merge_attention(clean, lse_nan, lse_base=base, precision="reproducible")
    fast_out, fast_lse = merge_attention(clean, lse_nan, lse_base=base)
    assert np.isnan(lse[1]).all() and np.array_equal(np.isnan(lse), np.isnan(fast_lse))
    assert np.isnan(out).any() and np.array_equal(np.isnan(out), np.isnan(fast_out))


def test_reproducible_precision_is_checked_and_keeps_dtypes_and_inputs(quiet):
    out_parts, lse_parts = _inputs(3, P=3, shape=(2, 3), Ev=2)
    o32, l32 = out_parts.astype(np.float32), lse_parts.astype(np.float32)
    keep = o32.copy(), l32.copy()
    out, lse = merge_attention(o32, l32, precision="reproducible")
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert _same_bits(o32, keep[0]) and _same_bits(l32, keep[1])
    for f, args in ((merge_attention, (out_parts, lse_parts)),
                    (merge_attention_backward, (out_parts, lse_parts, np.zeros(out_parts.shape[1:]))),
                    (combine_lse, (lse_parts,))):
        with pytest.raises(ValueError, match="`precision` should be one of 'fast', 'reproducible'"):
            f(*args, precision="exact")


def test_the_reproducible_merge_of_the_reproducible_partials_is_faithful_to_the_unsplit_attention():
    """Both faithful: the merge of the split's faithful parts and the unsplit result agree to an ulp."""
    rng = np.random.default_rng(4)
    q, k, v = rng.uniform(-2, 2, (1, 2, 5, 4)), rng.uniform(-2, 2, (1, 2, 9, 4)), rng.uniform(-2, 2, (1, 2, 9, 3))
    parts = sdpa_ref.split_kv_partials(q, k, v, num_splits=3, is_causal=True, precision="reproducible")
    out, lse = merge_attention(*parts, precision="reproducible")
    ref, ref_lse = scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True, precision="reproducible")
    assert np.max(np.abs(out - ref) / np.spacing(np.abs(ref))) <= 2
    assert np.max(np.abs(lse - ref_lse) / np.spacing(np.abs(ref_lse))) <= 2


MERGE_HASHES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "reproducible_merge_hashes.json")


def test_reproducible_merges_lse_and_splits_are_the_committed_bits_under_every_setting():
    """One hash per quantity (tests/repro_merge_digest.py: the merge and its VJP, combine_lse and convert_lse in
    both bases, the split-KV partials, forward and backward) in process and under threads 1-3, OpenBLAS 1,
    numpy's dispatch without AVX-512 and AVX2, and the NumPy loops in place of the compiled kernels. Regenerate
    the file with ``python tests/repro_merge_digest.py --json`` only where the engine's own committed bits change."""
    import importlib.util
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "repro_merge_digest.py")
    with open(MERGE_HASHES) as f:
        want = json.load(f)
    spec = importlib.util.spec_from_file_location("repro_merge_digest", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.digests() == want
    avx512 = "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR X86_V4"
    settings_ = [{"SDPA_REF_NUM_THREADS": "1", "SDPA_REF_NATIVE": "0", "NPY_DISABLE_CPU_FEATURES": avx512},
                 {"SDPA_REF_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "1",
                  "NPY_DISABLE_CPU_FEATURES": avx512 + " AVX2 FMA3 X86_V3"}]
    base = {k: v for k, v in os.environ.items()
            if k not in ("SDPA_REF_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NPY_DISABLE_CPU_FEATURES", "SDPA_REF_NATIVE")}
    for extra in settings_:
        env = dict(base, **extra)
        if subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True).returncode:
            env.pop("NPY_DISABLE_CPU_FEATURES")                  # numpy refuses to switch off a baseline feature
        cp = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
        assert cp.returncode == 0, cp.stderr[-2000:]
        got = dict(line.split() for line in cp.stdout.strip().splitlines())
        assert got == want, f"{extra}: " + ", ".join(n for n in want if got.get(n) != want[n])
