"""A user's case file gives the same golden vectors on every machine: the committed hashes of
``examples/cases.json`` written as vectors (float64 and float32), regenerated here and compared.

The reference arrays are computed with ``precision="reproducible"`` and the inputs are drawn from each case's
seed, so a set written from a case file on one machine verifies on any other (``sdpa-ref verify`` regenerates
it from the definitions its manifest stores). To refresh after a deliberate change, run
``python tests/test_harness_casefile.py``.
"""

import hashlib
import json
import os
import sys

import pytest

from sdpa_ref.harness.casefile import load_cases
from sdpa_ref.harness.vectors import verify_vectors, write_vectors

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "..", "examples", "cases.json")
HASHES = os.path.join(HERE, "data", "custom_vector_hashes.json")
DTYPES = ("float64", "float32")


def _npz_hashes(d):
    return {f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(d)) if f.endswith(".npz")}


@pytest.mark.skipif(not os.path.exists(CASES), reason="examples/ not shipped beside the tests")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_example_case_file_gives_the_committed_vectors(tmp_path, dtype):
    write_vectors(str(tmp_path), dtype=dtype, cases=CASES)
    with open(HASHES) as f:
        want = json.load(f)[dtype]
    assert _npz_hashes(str(tmp_path)) == want
    assert verify_vectors(str(tmp_path)).ok


def test_the_toml_twin_defines_the_same_cases():
    if sys.version_info < (3, 11):
        pytest.importorskip("tomli")
    toml = os.path.join(os.path.dirname(CASES), "cases.toml")
    if not os.path.exists(toml):
        pytest.skip("examples/ not shipped beside the tests")
    assert load_cases(toml) == load_cases(CASES)


if __name__ == "__main__":                                     # refresh the committed hashes
    import tempfile
    out = {}
    for dt in DTYPES:
        with tempfile.TemporaryDirectory() as d:
            write_vectors(d, dtype=dt, cases=CASES)
            out[dt] = _npz_hashes(d)
    with open(HASHES, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {HASHES}", file=sys.stderr)


def test_the_peers_arrays_in_a_case_file_and_what_they_need_beside_each_other():
    """q_offset, FlashMLA's topk (with its gather indices) and cuDNN's ALiBi are a case file's too; topk without
    gather, and q_offset beside causal_alignment, are errors naming the file and the case."""
    from sdpa_ref.harness.casefile import CaseFileError, cases_from_definitions
    (case,) = cases_from_definitions([{"name": "peers", "L": 6, "S": 9, "batch": [2], "arrays": ["gather", "topk",
                                       "q_offset", "alibi"], "options": {"alibi_mode": "cudnn", "is_causal": True}}],
                                     "peers.json")
    assert case.option_names >= {"gather_kv_indices", "topk_length", "q_offset", "alibi_mode"}
    inp = case.make_inputs()
    assert inp["topk_length"].shape == (2, 1, 6) and inp["q_offset"].shape == (2,)
    for d, says in (({"arrays": ["topk"]}, "'gather' beside 'topk'"),
                    ({"arrays": ["q_offset"], "options": {"causal_alignment": "bottom_right"}}, "causal_alignment")):
        with pytest.raises(CaseFileError, match=r"peers\.json, case 0 \('x'\): .*" + says):
            cases_from_definitions([dict(d, name="x", L=4, S=5)], "peers.json")
