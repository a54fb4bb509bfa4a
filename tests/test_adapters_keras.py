"""Keras 3's ``keras.ops.dot_product_attention`` judged by the harness, on the JAX backend unless KERAS_BACKEND says.

Skipped without the keras extra and its backend. The expectations are what was measured (Keras 3.15.1 on JAX
0.10.2, CPU).
"""

import os

import pytest

from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.conformance import check_implementation

os.environ.setdefault("KERAS_BACKEND", "jax")        # read once, when keras is first imported
keras = pytest.importorskip("keras")


def _notes(rep, case):
    return {r.note for r in rep.rows if r.case == case and r.status == "skip"}


@pytest.fixture(scope="module")
def adapter():
    from sdpa_ref.adapters.keras import keras_dpa

    return keras_dpa()


def test_keras_conforms_in_float32_with_skips_in_its_own_words(adapter):
    fwd, bwd, _ = adapter
    rep = check_implementation(fwd, backward=bwd, dtypes="float32")
    assert rep.ok and rep.counts["pass"] > 100 and rep.counts["error"] == 0, str(rep)
    assert rep.counts["skip"] > 0
    if keras.backend.backend() == "jax":
        assert {"only supported for JAX on TPU" in n for n in _notes(rep, "softcap5-L10-S10")} == {True}
        assert {"fully_masked='jax'" in n for n in _notes(rep, "masked-rows-L8-S8")} == {True}
    assert {"Ev == E" in n for n in _notes(rep, "plain-Ev12-L6-S6")} == {True}
    assert {"aligns is_causal top-left" in n for n in _notes(rep, "causal-bottom_right-L13-S7")} == {True}


def test_keras_says_it_computes_float64_in_float32(adapter):
    fwd, bwd, _ = adapter
    rep = check_implementation(fwd, backward=bwd, dtypes="float64",
                               cases=[c for c in get_suite("quick") if c.name == "plain-L8-S8"])
    assert [r.status for r in rep.rows] == ["skip"], str(rep)
    assert "computes float64 inputs in float32 (keras.backend.result_type)" in rep.rows[0].note


def test_a_scale_off_by_one_percent_is_caught(adapter):
    fwd, bwd, _ = adapter

    def wrong(query, key, value, scale=None, **opts):
        return fwd(query, key, value, scale=(scale or query.shape[-1] ** -0.5) * 1.01, **opts)

    rep = check_implementation(wrong, supports=fwd.supports, dtypes="float32",
                               cases=[c for c in get_suite("quick") if c.name.startswith("plain")])
    assert not rep.ok and rep.counts["FAIL"] >= 3, str(rep)
