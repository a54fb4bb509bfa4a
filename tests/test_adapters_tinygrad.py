"""tinygrad's ``Tensor.scaled_dot_product_attention`` judged by the harness on its CPU device.

Skipped without the tinygrad extra, and where its CPU device has no compiler (clang). The expectations are what
was measured (tinygrad 0.14.0, CPU with clang 14): it conforms in float32, float64 and float16, about 100 s a dtype
(each shape compiles its own kernels), so the suite runs float32 only.
"""

import shutil

import numpy as np
import pytest

from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.conformance import check_implementation

pytest.importorskip("tinygrad")


def _notes(rep, case):
    return {r.note for r in rep.rows if r.case == case and r.status == "skip"}


@pytest.fixture(scope="module")
def adapter():
    if shutil.which("clang") is None:
        pytest.skip("tinygrad's CPU device compiles with clang, which is not installed")
    from sdpa_ref.adapters.tinygrad import tinygrad_sdpa

    return tinygrad_sdpa(device="CPU")


def test_tinygrad_conforms_in_float32_with_skips_naming_what_it_lacks(adapter):
    fwd, bwd, _ = adapter
    rep = check_implementation(fwd, backward=bwd, dtypes="float32")
    assert rep.ok and rep.counts["pass"] > 100 and rep.counts["error"] == 0, str(rep)
    assert {"top-left aligned" in n for n in _notes(rep, "causal-bottom_right-L13-S7")} == {True}
    assert {"fully_masked='nan'" in n for n in _notes(rep, "masked-rows-L8-S8")} == {True}
    assert _notes(rep, "scale0.3-L6-S8") == {"needs scale"}           # no scale argument: 1/sqrt(E) always
    assert {r.status for r in rep.rows if r.case == "masked-rows-nan-L8-S8"} == {"pass"}


def test_a_scale_off_by_one_percent_is_caught(adapter):
    fwd, bwd, _ = adapter

    def wrong(query, key, value, **opts):
        return fwd(query * 1.01, key, value, **opts)

    rep = check_implementation(wrong, supports=fwd.supports, dtypes="float32",
                               cases=[c for c in get_suite("quick") if c.name.startswith("plain")])
    assert not rep.ok and rep.counts["FAIL"] >= 3, str(rep)


def test_tinygrads_own_refusal_is_a_skip_in_its_words(adapter):
    fwd, _, _ = adapter
    q = np.ones((1, 2, 3, 4), np.float32)
    with pytest.raises(NotImplementedError, match="tinygrad: cannot set attn_mask when is_causal=True"):
        fwd(q, q, q, attn_mask=np.ones((3, 3), bool), is_causal=True)
