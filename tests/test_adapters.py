"""PyTorch and JAX judged by the harness; skipped cleanly when they are not installed.

The expectations are what was measured (torch 2.13 CPU, JAX 0.10.2 CPU), not
what one might hope: see the README's conformance section.
"""

import importlib.util

import pytest

from sdpa_ref.harness.conformance import FixedRule, check_implementation
from tolerances import F64_GRAD


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
