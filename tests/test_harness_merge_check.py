"""Judging a split-KV merge kernel (``sdpa_ref.check_merge``): honest merges pass in both bases, wrong ones are
caught: one that reads the empty parts (FlashInfer #4051), one that gives NaN on rows with no key at all (vLLM
#39148), an LSE kept in float16, the other base, weights not normalised, the wrong dtype; bad arguments are
clear errors."""

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref import merge_attention
from sdpa_ref.harness.merge_check import MERGE_CASES, check_merge, merge_inputs

DTYPES = ("float32", "float16")


def package(o, l, base="e"):
    out, lse = merge_attention(o, l, lse_base=base)
    return out.astype(o.dtype), lse.astype(l.dtype)


def in_float32(o, l):
    """An honest kernel: float32 statistics, the empty parts replaced by 0 before any product."""
    w = l.astype(np.float32)
    gone = np.isneginf(w)
    m = np.max(w, axis=0)
    ms = np.where(np.isneginf(m), 0, m).astype(np.float32)
    e = np.where(gone, 0, np.exp(w - ms)).astype(np.float32)
    s = e.sum(axis=0)
    oo = np.where(gone[..., None], 0, o.astype(np.float32))
    s1 = np.where(s == 0, 1, s).astype(np.float32)
    return ((e[..., None] * oo).sum(axis=0) / s1[..., None]).astype(o.dtype), \
        np.where(s == 0, -np.inf, ms + np.log(s1)).astype(l.dtype)


def reads_empty_parts(o, l):
    m = np.max(l, axis=0)
    w = np.exp(l - np.where(np.isneginf(m), 0, m))
    s = w.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((w[..., None] * o).sum(axis=0) / s[..., None]).astype(o.dtype), (m + np.log(s)).astype(l.dtype)


def nan_on_rows_without_keys(o, l):
    out, lse = package(o, l)
    empty = np.isneginf(lse)
    return np.where(empty[..., None], np.nan, out).astype(o.dtype), lse


def lse_in_float16(o, l):
    out, lse = package(o, l)
    return out, lse.astype(np.float16).astype(l.dtype)


def unnormalised(o, l):
    out, lse = package(o, l)
    return (out * np.float32(1.001)).astype(o.dtype), lse


def float32_out(o, l):
    out, lse = package(o, l)
    return out.astype(np.float32), lse


def test_the_cases_hold_real_partials_with_empty_parts_and_empty_rows():
    names = {c.name for c in MERGE_CASES}
    assert {"an-empty-part", "rows-with-no-key", "single-part", "one-part-dominates"} <= names
    o, l = merge_inputs(next(c for c in MERGE_CASES if c.name == "an-empty-part"), "float16")
    assert o.dtype == np.float16 and l.dtype == np.float32
    assert np.isneginf(l).any() and np.isnan(o[np.isneginf(l)]).all()   # never to be read
    o, l = merge_inputs(next(c for c in MERGE_CASES if c.name == "rows-with-no-key"))
    assert np.isneginf(l).all(axis=0).any()


@pytest.mark.parametrize("merge,base", [(package, "e"), (lambda o, l: package(o, l, 2), 2), (in_float32, "e")],
                         ids=["package-e", "package-2", "float32"])
def test_honest_merges_conform(merge, base):
    rep = sdpa_ref.check_merge(merge, dtypes=DTYPES, lse_base=base)
    assert rep.ok, rep
    assert len(rep.rows) == 2 * len(DTYPES) * len(MERGE_CASES)
    assert max(r.ratio for r in rep.rows) < 0.7


@pytest.mark.parametrize("merge,where,note", [
    (reads_empty_parts, {"an-empty-part", "rows-with-no-key"}, "NaN where the reference has a number"),
    (nan_on_rows_without_keys, {"rows-with-no-key"}, "NaN where the reference has a number"),
    (lse_in_float16, None, None),
    (unnormalised, None, None),
    (float32_out, None, "expected float16"),
])
def test_wrong_merges_are_caught(merge, where, note):
    rep = sdpa_ref.check_merge(merge, dtypes=DTYPES)
    bad = [r for r in rep.rows if r.status == "FAIL"]
    assert bad and not rep.ok, rep
    if where is not None:
        assert {r.case for r in bad} == where
    if note is not None:
        assert any(note in r.note for r in bad)


def test_the_other_base_is_caught():
    assert not sdpa_ref.check_merge(package, dtypes=("float32",), lse_base=2).ok


@pytest.mark.parametrize("kw,err,match", [
    (dict(dtypes="float8_e4m3fn"), ValueError, "`dtypes`"),
    (dict(lse_base=10), ValueError, "`lse_base`"),
    (dict(cases=[1]), TypeError, "`cases`"),
])
def test_bad_arguments_are_clear_errors(kw, err, match):
    with pytest.raises(err, match=match):
        sdpa_ref.check_merge(package, **kw)
    with pytest.raises(TypeError, match="`merge`"):
        sdpa_ref.check_merge(None)


def test_a_merge_that_raises_fails_its_case_and_the_run_goes_on():
    def boom(o, l):
        raise RuntimeError("no")
    rep = sdpa_ref.check_merge(boom, dtypes=("float32",))
    assert not rep.ok and all(r.status == "error" and "RuntimeError" in r.note for r in rep.rows)


def test_float64_merges_are_judged_against_the_exact_merge():
    """The reference is the exact merge rounded once, so a float64 merge kernel is judged too: the package's own
    fast merge passes, one off by a relative 1e-12 fails."""
    assert check_merge(lambda o, l: merge_attention(o, l), dtypes="float64").ok
    off = lambda o, l: (lambda out, lse: (out * (1 + 1e-12), lse))(*merge_attention(o, l))  # noqa: E731
    assert not check_merge(off, dtypes="float64").ok
