"""The suites reach far enough to see what kernels get wrong past a block, and what the rule can and cannot see.

A kernel that drops the keys past a block, or mishandles the last partial one, must fail the default suites: the
quick suite reaches S = 136 (``long-L16-S128`` for any kernel, a causal L = S = 136 for a causal-only one), the
full suite S = 512. A systematic one-ulp bias in bfloat16 is measured here, not assumed: it stays inside the
relative rule's allowance, and inside the bias honest bfloat16 kernels already have (see the test's docstring).
"""

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.ensemble import MEMBERS, member_quantities
from sdpa_ref.harness.judge import reference_quantities
from sdpa_ref.harness.lowp import ulp


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


def test_a_one_ulp_bfloat16_bias_is_inside_the_rule_and_inside_honest_kernels_own_bias():
    """Measured, on the quick suite's ``long-L16-S128`` and the full suite's ``big-gqa-L96-S128``: a +1 ulp bias
    on every element of a correctly rounded bfloat16 output errs by 1.3-1.4 ulp at its worst element (5.2e-3 and
    5.6e-3), while the honest ensemble errs by 3.7e-3 and 3.6e-3 (rounding P and the products): under 3 times
    that, and the allowance (1.5e-2, 1.9e-2, FlashAttention's floor of 3.9e-3 and 7.8e-3 included) is used to
    0.35 and 0.30. Nor does the mean signed error single it out: honest kernels lean by more than one ulp on
    average themselves (+1.74 ulp for the ensemble's dense members on ``big-gqa-L96-S128``, +1.72 for the BLAS
    specimens of the calibration; -5.1 on ``big-large-logits-L128-S128``), so a bias test that caught +1 ulp
    would fail honest kernels. The rule is not bent to catch it; this records why it cannot."""
    pytest.importorskip("ml_dtypes")
    import ml_dtypes

    bf = ml_dtypes.bfloat16
    names = ("long-L16-S128", "big-gqa-L96-S128")
    cases = [c for c in get_suite("full") if c.name in names]
    assert len(cases) == 2
    rep = sdpa_ref.check_implementation(_biased, dtypes="bfloat16", cases=cases)
    assert rep.ok, str(rep)
    assert all(0.2 < r.ratio < 0.5 and r.error < 3 * r.honest_error for r in rep.rows), str(rep)
    member_bias = []
    for c in cases:
        ref = reference_quantities(c, bf)["out"]
        u = ulp(ref, np.dtype(bf))
        assert abs(float(np.mean((_biased(*_qkv(c, bf)[:3], **_qkv(c, bf)[3]).astype(np.float64) - ref) / u))
                   - 1) < 0.01                                            # the bias is one ulp, on average too
        for m in MEMBERS:
            got = member_quantities(c, bf, m)["out"].astype(np.float64)
            member_bias.append(float(np.mean((got - ref) / u)))
    assert max(abs(b) for b in member_bias) > 1.5, member_bias          # honest kernels lean by more than that


def _qkv(case, dt):
    inp = case.make_inputs(dt)
    inp.pop("fully_masked", None)
    return inp.pop("query"), inp.pop("key"), inp.pop("value"), inp
