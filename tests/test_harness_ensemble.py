"""The harness judges attention sinks and their gradient: the cases draw them, the honest ensemble computes
them (its members fold the sink into their max and sum, dense or after their last block of keys), the reference
returns ``dsinks``, the golden vectors store ``sinks``, ``dsinks`` and ``honest_dsinks``.

Evidence: the reference and honest kernels pass; a kernel that ignores the sinks, one that puts the softcap on
the sink (HF #41026: sinks applied inside a score function), a sink gradient of the wrong sign or without the
sink's probability, one of the wrong dtype, and a backward that does not return it are caught; a vector set
with sinks is verified from its files alone.
"""

import json

import numpy as np
import pytest

from sdpa_ref import OPTION_NAMES, check_implementation, sdpa_backward, sdpa_forward
from sdpa_ref.harness import vectors
from sdpa_ref.harness.casefile import cases_from_definitions
from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.specimens import HONEST

CASES = [c for c in get_suite("full") if "sinks" in c.arrays]


def fwd(q, k, v, **o):
    return sdpa_forward(q, k, v, **o)[0]


def bwd(g, q, k, v, **o):
    gr = sdpa_backward(sdpa_forward(q, k, v, **o)[1], g)
    return tuple(x for x in (gr.query, gr.key, gr.value, gr.bias) if x is not None) + (
        (gr.sinks.astype(np.asarray(o["sinks"]).dtype),) if gr.sinks is not None else ())


def test_sinks_are_in_the_vocabulary_and_the_full_suite():
    assert "sinks" in OPTION_NAMES and len(CASES) == 2
    assert any(c.has_fully_masked_rows() for c in CASES) and any(c.Hq != c.Hkv for c in CASES)
    inp = CASES[0].make_inputs("float16")
    assert inp["sinks"].dtype == np.float32 and inp["sinks"].shape == (CASES[0].Hq,)
    assert np.isneginf(inp["sinks"][-1]) and np.all(np.isfinite(inp["sinks"][:-1]))   # a head without one
    assert CASES[0].make_inputs("float64")["sinks"].dtype == np.float64


@pytest.mark.parametrize("dt", ["float64", "float32", "float16"])
def test_the_reference_with_its_sink_gradient_conforms(dt):
    rep = check_implementation(fwd, backward=bwd, cases=CASES, dtypes=(dt,))
    assert rep.ok, rep
    assert sum(r.quantity == "dsinks" for r in rep.rows) == len(CASES)


@pytest.mark.parametrize("specimen", HONEST[:2] + HONEST[6:7] + HONEST[-1:], ids=lambda s: s.name)
def test_honest_kernels_with_sinks_conform(specimen):
    rep = check_implementation(specimen.forward, backward=specimen.backward, cases=CASES,
                               dtypes=("float32", "float16"))
    assert rep.ok, rep
    assert max(r.ratio for r in rep.rows if r.ratio is not None) < 0.7


def _failed(rep, qty):
    bad = [r for r in rep.rows if r.status in ("FAIL", "error")]
    assert bad and not rep.ok, rep
    assert {r.quantity for r in bad} == {qty}, [(r.case, r.quantity, r.note) for r in bad]
    return bad


def test_a_kernel_that_ignores_the_sinks_fails():
    def ignores(q, k, v, sinks=None, **o):
        return sdpa_forward(q, k, v, **o)[0]
    _failed(check_implementation(ignores, cases=CASES, dtypes=("float32",)), "out")


def test_a_sink_inside_the_score_function_is_caught():
    """HF #41026: the sink pushed through the softcap like a score."""
    def capped(q, k, v, sinks=None, softcap=None, **o):
        s = sinks if softcap is None else (softcap * np.tanh(sinks.astype(np.float64) / softcap)).astype(sinks.dtype)
        return sdpa_forward(q, k, v, sinks=s, softcap=softcap, **o)[0]
    bad = _failed(check_implementation(capped, cases=CASES, dtypes=("float32",)), "out")
    assert {r.case for r in bad} == {c.name for c in CASES if c.opts.get("softcap")}


@pytest.mark.parametrize("wrong", ["sign", "without p_sink", "float16"])
def test_a_wrong_sink_gradient_is_caught(wrong):
    def backward(g, q, k, v, **o):
        *rest, ds = bwd(g, q, k, v, **o)
        if wrong == "sign":
            ds = -ds
        elif wrong == "without p_sink":                   # -sum_i D_i: the sink's probability forgotten
            ds = ds * 3.0
        else:
            ds = ds.astype(np.float16)
        return (*rest, ds)
    bad = _failed(check_implementation(fwd, backward=backward, cases=CASES, dtypes=("float16",)), "dsinks")
    if wrong == "float16":
        assert all("expected float32" in r.note for r in bad)


def test_a_backward_without_the_sink_gradient_is_an_error():
    def backward(g, q, k, v, **o):
        return bwd(g, q, k, v, **o)[:-1]
    bad = _failed(check_implementation(fwd, backward=backward, cases=CASES, dtypes=("float32",)), "dsinks")
    assert all("expected" in r.note for r in bad)


def test_vector_files_store_the_sinks_and_their_gradient(tmp_path):
    vectors.write_vectors(str(tmp_path), dtype="float16", cases=CASES)
    assert vectors.verify_vectors(str(tmp_path)).ok
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    arrays = vectors.read_npz((tmp_path / manifest["files"][0]["file"]).read_bytes())
    assert {"sinks", "dsinks", "honest_dsinks"} <= set(arrays)
    assert arrays["sinks"].dtype == np.float32 and arrays["dsinks"].dtype == np.float64


def test_a_case_file_can_ask_for_sinks():
    (case,) = cases_from_definitions([{"name": "s", "L": 4, "Hq": 2, "arrays": ["sinks"]}])
    assert "sinks" in case.option_names
