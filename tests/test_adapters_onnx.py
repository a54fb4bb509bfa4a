"""The ONNX ``Attention`` operator judged by the harness, on ONNX's reference evaluator and on ONNX Runtime.

Skipped without the onnx extra. The expectations are what was measured (onnx 1.23.2, onnxruntime 1.32.0 CPU).
"""

import numpy as np
import pytest

from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.conformance import check_implementation

onnx = pytest.importorskip("onnx")


def _notes(rep, case):
    return {r.note for r in rep.rows if r.case == case and r.status == "skip"}


@pytest.fixture(scope="module")
def reference_report():
    from sdpa_ref.adapters.onnx import onnx_attention

    fwd, bwd, supports = onnx_attention("reference")
    assert bwd is None and "softcap" in supports
    return check_implementation(fwd, dtypes=("float32", "float64", "float16"))


def test_the_reference_evaluator_conforms_with_skips_carrying_the_reason(reference_report):
    rep = reference_report
    assert rep.ok and rep.counts["pass"] > 100 and rep.counts["error"] == 0, str(rep)
    assert {"Y = 0" in n for n in _notes(rep, "masked-rows-nan-L8-S8")} == {True}
    assert {"cannot be negative (S < L)" in n for n in _notes(rep, "causal-bottom_right-L13-S7")} == {True}
    scale64 = [r for r in rep.rows if r.case == "scale0.3-L6-S8" and r.dtype == "float64"]
    assert [r.status for r in scale64] == ["skip"] and "32-bit" in scale64[0].note   # its scale attribute
    assert {r.status for r in rep.rows if r.case == "scale0.3-L6-S8" and r.dtype == "float32"} == {"pass"}
    judged = {r.case for r in rep.rows if r.status == "pass"}
    assert {"softcap5-L10-S10", "gqa-causal-bottom_right-L7-S13", "mask-bias-L7-S9", "plain-Ev12-L6-S6",
            "masked-rows-L8-S8", "plain-bcast-L4-S7"} <= judged    # past_key's offset, one float mask, Ev != E


def test_a_scale_off_by_one_percent_is_caught():
    from sdpa_ref.adapters.onnx import onnx_attention

    fwd, _, _ = onnx_attention("reference")

    def wrong(query, key, value, scale=None, **opts):
        return fwd(query, key, value, scale=(scale or query.shape[-1] ** -0.5) * 1.01, **opts)

    rep = check_implementation(wrong, supports=fwd.supports, dtypes="float32",
                               cases=[c for c in get_suite("quick") if c.name.startswith(("plain", "softcap"))])
    assert not rep.ok and rep.counts["FAIL"] >= 4, str(rep)


def test_a_bad_runtime_is_a_value_error():
    from sdpa_ref.adapters.onnx import onnx_attention

    with pytest.raises(ValueError, match="`runtime` should be one of"):
        onnx_attention("tensorrt")


# Measured with onnxruntime 1.32.0 on the CPU: its float64 Attention errs as float32 arithmetic does (up to 1.1e-7
# on the quick suite, where the honest float64 kernels err by 2e-14), so under the float64 relative rule every
# row fails. The yardstick is the honest float32 ensemble's error on the same case; past 1 it is worse than that.
def test_onnxruntime_conforms_in_float32_and_float16_and_is_float32_precise_in_float64():
    pytest.importorskip("onnxruntime")
    from sdpa_ref.adapters.onnx import onnx_attention

    fwd, _, _ = onnx_attention("onnxruntime")
    rep = check_implementation(fwd, dtypes=("float32", "float16"))
    assert rep.ok and rep.counts["pass"] > 70 and rep.counts["error"] == 0, str(rep)
    honest32 = {(r.case, r.quantity): r.honest_error for r in rep.rows if r.dtype == "float32" and r.honest_error}
    rep64 = check_implementation(fwd, dtypes="float64")
    judged = [(r.error / honest32[r.case, r.quantity], r) for r in rep64.rows
              if r.status in ("pass", "FAIL") and (r.case, r.quantity) in honest32]
    assert len(judged) > 30 and rep64.counts["error"] == 0, str(rep64)
    ratio, row = max(judged, key=lambda x: x[0])
    assert ratio <= 1.0, f"{row.case}: float64 error {row.error:.3e} is {ratio:.2f}x float32's"
    assert max(r.error for _, r in judged) > 1e-9      # if it drops to 1e-15, ONNX Runtime computes in float64


def test_onnxruntime_reports_a_dtype_it_lacks_as_a_skip_in_its_own_words():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("ml_dtypes")
    from sdpa_ref.adapters.onnx import onnx_attention

    fwd, _, _ = onnx_attention("onnxruntime")
    rep = check_implementation(fwd, dtypes="bfloat16", cases=[c for c in get_suite("quick") if c.name == "plain-L8-S8"])
    notes = [r.note for r in rep.rows]
    assert [r.status for r in rep.rows] == ["skip"], str(rep)
    assert "ONNX Runtime" in notes[0] and "NOT_IMPLEMENTED" in notes[0]


def test_inputs_are_not_mutated():
    from sdpa_ref.adapters.onnx import onnx_attention

    fwd, _, _ = onnx_attention("reference")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2, 3, 4)).astype(np.float32) for _ in range(3))
    copies = [x.copy() for x in (q, k, v)]
    fwd(q, k, v, is_causal=True, causal_alignment="bottom_right")
    for x, y in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, y)
