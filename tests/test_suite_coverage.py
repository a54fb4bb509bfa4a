"""The suites reach far enough to see what kernels get wrong past a block, and what the rule can and cannot see.

A kernel that drops the keys past a block, or mishandles the last partial one, must fail the default suites: the
quick suite reaches S = 136 (``long-L16-S128`` for any kernel, a causal L = S = 136 for a causal-only one), the
full suite S = 512. A systematic one-ulp bias in bfloat16 stays inside the relative rule's largest-error
allowance, and is caught by its lean (the error fitted over every element) on the S = 128 cases.
"""

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.ensemble import MEMBERS, member_quantities
from sdpa_ref.harness.judge import reference_quantities
from sdpa_ref.harness.lowp import ulp
from sdpa_ref.harness.rules import RelativeRule, lean


def _drops_keys_past(n):
    """The reference, blind to every key at position n and after (it reads them as masked out)."""
    def forward(q, k, v, **o):
        S = k.shape[-2]
        keep = np.arange(S) < n
        m = o.get("attn_mask")
        if m is None:
            m = np.broadcast_to(keep, q.shape[:-1] + (S,))
        elif m.dtype == bool:
            m = m & keep
        else:
            m = np.where(keep, m, -np.inf).astype(m.dtype)
        return sdpa_ref.scaled_dot_product_attention(q, k, v, **dict(o, attn_mask=m))

    return forward


def test_the_quick_suite_reaches_past_a_block_and_the_full_suite_to_512():
    quick, full = get_suite("quick"), get_suite("full")
    assert max(c.S for c in quick) >= 128 and max(c.S for c in full) >= 512
    long = [c for c in quick if c.S >= 128]
    assert any(not c.option_names for c in long)                          # judged for a kernel with no option
    assert any(c.option_names == {"is_causal"} and c.S % 64 and c.S > 128 for c in long)  # causal, a tail


@pytest.mark.parametrize("n", [32, 64, 100, 128])
def test_a_kernel_that_drops_keys_past_a_block_fails_the_quick_suite(n):
    rep = sdpa_ref.check_implementation(_drops_keys_past(n), dtypes="float32")
    assert not rep.ok
    assert all(r.status == "pass" for r in rep.rows if r.status != "skip" and
               next(c for c in get_suite("quick") if c.name == r.case).S <= n)
    causal_only = sdpa_ref.check_implementation(_drops_keys_past(n), dtypes="float32", requires={"is_causal"},
                                                supports={"is_causal"})
    assert not causal_only.ok                                             # a causal-only kernel is caught too


def test_a_kernel_that_drops_keys_past_256_fails_the_full_suite():
    cases = [c for c in get_suite("full") if c.S > 256 and c.L * c.S <= 300 * 300]
    assert cases
    rep = sdpa_ref.check_implementation(_drops_keys_past(256), dtypes="float32", cases=cases)
    assert not rep.ok


def _one_ulp_up(x):
    """``x`` one bfloat16 ulp towards +inf, element-wise."""
    import ml_dtypes

    b = x.view(np.uint16).astype(np.int32)
    b = np.where((b & 0x7FFF) == 0, 1, np.where(b & 0x8000, b - 1, b + 1))
    return b.astype(np.uint16).view(ml_dtypes.bfloat16)


def _biased(q, k, v, **o):
    """A bfloat16 kernel as good as it gets (float32 arithmetic, rounded once), then one ulp up everywhere."""
    import ml_dtypes

    wide = {n: (a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == ml_dtypes.bfloat16 else a)
            for n, a in o.items()}
    out = sdpa_ref.scaled_dot_product_attention(q.astype(np.float32), k.astype(np.float32),
                                                v.astype(np.float32), **wide)
    return _one_ulp_up(out.astype(ml_dtypes.bfloat16))


def test_a_one_ulp_bfloat16_bias_is_caught_by_the_lean_though_the_largest_error_misses_it():
    """A +1 ulp bias on every element of a correctly rounded bfloat16 output errs by 1.3-1.4 ulp at its worst
    element, under 3 times the honest ensemble's error (which rounds P before P V): the largest error cannot
    see it (the rule's ratio stays under 0.5). Its lean (:func:`~sdpa_ref.harness.rules.lean`) is 1 ulp, on
    the S = 128 cases of the quick and the full suite, and past the bound there; the honest ensemble's own
    lean is under 0.05 ulp (a plain mean of ``error / ulp`` would say +1.7 ulp for it, from entries whose
    reference is near 0: the reason the fit weighs each entry by its ulp)."""
    pytest.importorskip("ml_dtypes")
    import ml_dtypes

    bf = np.dtype(ml_dtypes.bfloat16)
    names = ("long-L16-S128", "big-gqa-L96-S128", "big-large-logits-L128-S128")
    cases = [c for c in get_suite("full") if c.name in names]
    assert len(cases) == 3 and any(c.name == "long-L16-S128" for c in get_suite("quick"))
    rep = sdpa_ref.check_implementation(_biased, dtypes="bfloat16", cases=cases)
    assert [r.status for r in rep.rows] == ["FAIL"] * 3, str(rep)
    for r in rep.rows:
        assert r.ratio < 0.5 and r.error < 3 * r.honest_error            # the largest error is within the rule
        assert 0.97 < r.lean < 1.03 and r.lean > r.lean_allowed and "systematic bias" in r.note
    max_only = sdpa_ref.check_implementation(_biased, dtypes="bfloat16", cases=cases,
                                             rule=RelativeRule(judge_lean=False))
    assert max_only.ok                                                   # what the lean adds
    for c in cases:
        ref = reference_quantities(c, bf)["out"]
        for m in MEMBERS:
            got = member_quantities(c, bf.name, m)["out"]
            assert abs(lean(got, ref, bf)[0]) < 0.05                     # honest kernels do not lean
        naive = max(abs(float(np.mean((member_quantities(c, bf.name, m)["out"].astype(np.float64) - ref)
                                      / ulp(ref, bf)))) for m in MEMBERS)
        if c.name == "big-gqa-L96-S128":
            assert naive > 1.5                                            # the plain mean would fail them


@pytest.mark.parametrize("bias_ulps, caught", [(1, True), (-1, True), (0, False)])
def test_the_lean_of_a_shifted_honest_kernel_is_its_shift(bias_ulps, caught):
    """``lean`` is linear in a shift of ``u``: an honest kernel's result moved by ``b`` ulps leans by its own lean
    plus ``b``, whatever its noise; the honest one itself passes."""
    pytest.importorskip("ml_dtypes")
    import ml_dtypes

    bf = np.dtype(ml_dtypes.bfloat16)
    case = next(c for c in get_suite("quick") if c.name == "long-L16-S128")
    ref = reference_quantities(case, bf)["out"]
    honest = member_quantities(case, bf.name, MEMBERS[3])["out"].astype(np.float64)    # online softmax
    shifted = honest + bias_ulps * ulp(ref, bf)
    beta0, _ = lean(honest, ref, bf)
    beta, se = lean(shifted, ref, bf)
    assert beta == pytest.approx(beta0 + bias_ulps, abs=1e-9) and 0 < se < 0.1
    assert (abs(beta) > RelativeRule().lean_bound("out", abs(beta0), se)) == caught


def test_lean_is_silent_without_rows_and_on_overflow():
    assert lean(np.array([1.0]), np.array([0.5]), np.dtype(np.float32))[1] == float("inf")     # one row: no verdict
    beta, se = lean(np.full((4, 3), 1e308), np.full((4, 3), -1e308), np.dtype(np.float64))
    assert (beta, se) == (0.0, float("inf"))                          # an overflowing error: the max rule judges it
    nan_ref = np.array([[np.nan, 1.0], [2.0, np.nan]])
    assert lean(np.array([[5.0, 1.0], [2.0, 7.0]]), nan_ref, np.dtype(np.float64))[0] == 0.0  # NaN entries unread
    with pytest.raises(TypeError, match="judge_lean"):
        RelativeRule(judge_lean=1)


def _qkv(case, dt):
    inp = case.make_inputs(dt)
    inp.pop("fully_masked", None)
    return inp.pop("query"), inp.pop("key"), inp.pop("value"), inp
