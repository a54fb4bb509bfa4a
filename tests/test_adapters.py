"""PyTorch and JAX judged by the harness; skipped cleanly when they are not installed.

The expectations are what was measured (torch 2.13 CPU, JAX 0.10.2 CPU), not
what one might hope: see the README's conformance section.
"""

import importlib.util

import pytest

from sdpa_ref.harness.conformance import FixedRule, check_implementation
from tolerances import F32_SCHEDULES, F64_GRAD


def _fail_set(rep):
    return {(r.case, r.quantity) for r in rep.failures}


def test_importing_sdpa_ref_imports_neither_torch_nor_jax():
    import subprocess
    import sys

    code = "import sys, sdpa_ref, sdpa_ref.adapters; print('torch' in sys.modules, 'jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# The default CPU kernel exceeded FlashAttention's old 2x/3x budget over one plain baseline on 2 to 4 rows
# (which ones moved with the machine's BLAS kernels). Under the ensemble rule it conformed on the one machine
# measured (largest ratio 0.41 in float32, 0.31 in float16, 0.26 in bfloat16), which is not pinned here: only
# that any miss stays within one order of magnitude of the allowance.
TORCH_CPU_MAX_RATIO = 10.0


def test_torch_cpu_float64_at_1e12():
    pytest.importorskip("torch")
    from sdpa_ref.adapters import torch_sdpa

    fwd, bwd, _ = torch_sdpa()
    rep = check_implementation(fwd, backward=bwd, dtypes=("float64",), rule=FixedRule(rtol=F64_GRAD, atol=F64_GRAD))
    assert rep.ok, str(rep)
    assert rep.counts["pass"] > 60


def test_torch_cpu_float32_under_the_relative_rule():
    pytest.importorskip("torch")
    from sdpa_ref.adapters import torch_sdpa

    low = ("bfloat16",) if importlib.util.find_spec("ml_dtypes") else ()     # the adapter passes bfloat16's bits
    fwd, bwd, _ = torch_sdpa(backend="math")
    rep = check_implementation(fwd, backward=bwd, dtypes=("float32", "float16") + low)
    assert rep.ok and rep.counts["pass"] > 100, str(rep)
    fwd, bwd, _ = torch_sdpa()
    rep = check_implementation(fwd, backward=bwd, dtypes=("float32",) + low)
    assert all(r.status == "FAIL" and r.ratio <= TORCH_CPU_MAX_RATIO for r in rep.failures), str(rep)


@pytest.fixture(scope="module")
def jax_float32_report():
    """JAX in float32 under the relative rule (its rows carry the honest float32 ensemble's error per case)."""
    pytest.importorskip("jax")
    from sdpa_ref.adapters import jax_dpa

    fwd, bwd, _ = jax_dpa()
    return check_implementation(fwd, backward=bwd, dtypes=("float32",))


# Measured with JAX 0.10.2: it casts the logits to float32 even for float64 input
# (jax/_src/nn/functions.py), so in float64 it errs as float32 logits do: about 3e-7 on ordinary cases, up to
# 1.7e-5 (dk) on the large-logit ones, where a fixed 1e-5 was too tight. The yardstick is float32 precision on
# the same case: the honest ensemble computing in float32 (the relative rule's baseline). JAX's float64 stayed
# within 0.26 of that error on every row; past 1 it would be worse than float32 arithmetic.
def test_jax_float64_agrees_to_float32_softmax_precision(jax_float32_report):
    from sdpa_ref.adapters import jax_dpa

    fwd, bwd, _ = jax_dpa()
    rep = check_implementation(fwd, backward=bwd, dtypes=("float64",), rule=FixedRule(rtol=F64_GRAD, atol=F64_GRAD))
    honest32 = {(r.case, r.quantity): r.honest_error for r in jax_float32_report.rows if r.honest_error}
    judged = [(r.error / honest32[r.case, r.quantity], r) for r in rep.rows
              if r.status in ("pass", "FAIL") and (r.case, r.quantity) in honest32]
    assert len(judged) > 100 and not [r for r in rep.rows if r.status == "error"], str(rep)
    ratio, row = max(judged, key=lambda x: x[0])
    assert ratio <= 1.0, f"{row.case} {row.quantity}: float64 error {row.error:.3e} is {ratio:.2f}x float32's"
    assert max(r.error for _, r in judged) > 1e-9   # float32 logits; if it drops to 1e-15, JAX stopped casting


def test_jax_float32_under_the_relative_rule(jax_float32_report):
    rep = jax_float32_report
    assert _fail_set(rep) <= {("large-logits-L16-S16", "out")}, str(rep)
    assert rep.counts["pass"] > 50


def _quick(*names):
    from sdpa_ref.harness.cases import get_suite

    return [c for c in get_suite("quick") if c.name in names]


def test_torch_no_available_kernel_is_a_skip_with_pytorchs_reasons():
    pytest.importorskip("torch")
    from sdpa_ref.adapters import torch_sdpa

    fwd, bwd, _ = torch_sdpa(backend="flash")       # the CPU flash kernel needs E == Ev and 4-D inputs
    rep = check_implementation(fwd, backward=bwd, dtypes="float32",
                               cases=_quick("plain-L8-S8", "plain-Ev12-L6-S6", "plain-bcast-L4-S7"))
    status = {r.case: r.status for r in rep.rows}
    assert status["plain-L8-S8"] == "pass" and rep.counts["error"] == 0, str(rep)
    notes = {r.case: r.note for r in rep.rows if r.status == "skip"}
    assert "No available kernel" in notes["plain-Ev12-L6-S6"]
    assert "Flash attention requires q,k,v to have the same last dimension" in notes["plain-Ev12-L6-S6"]
    assert "requires query, key and value to be 4 dimensional" in notes["plain-bcast-L4-S7"]


def test_torch_no_kernel_from_a_faked_backend_is_a_skip_and_other_errors_stay_errors(monkeypatch):
    torch = pytest.importorskip("torch")
    import warnings

    from sdpa_ref.adapters import torch_sdpa

    def no_kernel(*args, **kwargs):
        warnings.warn("Memory efficient kernel not used because: (Triggered internally at sdp_utils.cpp:1.)")
        warnings.warn("Mem efficient attention requires a CUDA device (Triggered internally at sdp_utils.cpp:2.)")
        raise RuntimeError("No available kernel.  Aborting execution.")

    fwd, bwd, _ = torch_sdpa()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_kernel)
    rep = check_implementation(fwd, backward=bwd, dtypes="float32", cases=_quick("plain-L8-S8"))
    assert [r.status for r in rep.rows] == ["skip"], str(rep)
    assert rep.rows[0].note.endswith("No available kernel.  Aborting execution. Mem efficient attention requires a "
                                     "CUDA device")

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", broken)
    rep = check_implementation(fwd, backward=bwd, dtypes="float32", cases=_quick("plain-L8-S8"))
    assert [r.status for r in rep.rows] == ["error"], str(rep)


def test_jax_skip_reasons_name_what_the_case_asks_for(jax_float32_report):
    notes = {r.case: r.note for r in jax_float32_report.rows if r.status == "skip"}
    assert "causal_alignment='bottom_right'" in notes["causal-bottom_right-L13-S7"]    # not the policy it implies
    assert "Ev == E, but got Ev=12, E=8" in notes["plain-Ev12-L6-S6"]
    assert "not fully_masked='zero'" in notes["masked-rows-L8-S8"]
    assert {r.status for r in jax_float32_report.rows if r.case == "causal-bottom_right-L7-S13"} == {"skip"}


def test_jax_takes_rank_2_inputs_as_one_head():
    pytest.importorskip("jax")
    import numpy as np

    import sdpa_ref
    from sdpa_ref.adapters import jax_dpa

    fwd, bwd, _ = jax_dpa()
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(s) for s in ((5, 4), (7, 4), (7, 4), (5, 4)))
    out = fwd(q, k, v, is_causal=True)
    np.testing.assert_allclose(out, sdpa_ref.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=F32_SCHEDULES,
                               atol=F32_SCHEDULES)
    ref = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, is_causal=True)[1], g)
    for got, want in zip(bwd(g, q, k, v, is_causal=True), (ref.query, ref.key, ref.value)):
        np.testing.assert_allclose(got, want, rtol=F32_SCHEDULES, atol=F32_SCHEDULES)
