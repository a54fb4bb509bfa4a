"""Golden vectors that really are golden: the files ``sdpa-ref vectors`` writes have the committed hashes.

``tests/data/vector_hashes.json`` holds the sha256 of every file of
``sdpa-ref vectors --suite full`` for float64, float32, float16, bfloat16,
float8_e4m3fn and float8_e5m2, written
on the machine that committed it. Every reference array is computed with
``precision="reproducible"``, so any other machine must write the same
bytes. The default suite regenerates the quick suite's files (a subset of the
full suite's, byte for byte); ``SDPA_REF_FULL_VECTORS=1`` (set by ``.ci/run``)
regenerates the full suite and its manifests too.

To refresh the hashes after a deliberate change of the suite, the format or
the version, run ``python tests/test_harness_vectors_hashes.py``.
"""

import hashlib
import io
import json
import os
import sys
import zipfile

import numpy as np
import pytest

from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.vectors import _npz_bytes, read_npz, verify_vectors, write_vectors

HERE = os.path.dirname(os.path.abspath(__file__))
HASHES = os.path.join(HERE, "data", "vector_hashes.json")
DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _hashes(d):
    return {f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest() for f in sorted(os.listdir(d))}


def _committed():
    with open(HASHES) as f:
        return json.load(f)


@pytest.mark.parametrize("dtype", [d if d in ("float64", "float32", "bfloat16") else pytest.param(d, marks=pytest.mark.long)
                                   for d in DTYPES])
def test_quick_suite_files_have_the_committed_hashes(tmp_path, dtype):
    write_vectors(str(tmp_path), "quick", dtype)
    got = {f: h for f, h in _hashes(str(tmp_path)).items() if f.endswith(".npz")}
    want = _committed()[dtype]
    assert len(got) == len(get_suite("quick"))
    bad = sorted(f for f in got if want.get(f) != got[f])
    assert not bad, f"{dtype}: {len(bad)} files differ from the committed hashes, e.g. {bad[:3]}"


@pytest.mark.skipif(os.environ.get("SDPA_REF_FULL_VECTORS") != "1",
                    reason="the full suite's regeneration runs in .ci/run (SDPA_REF_FULL_VECTORS=1)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_suite_files_have_the_committed_hashes(tmp_path, dtype):
    write_vectors(str(tmp_path), "full", dtype)
    assert _hashes(str(tmp_path)) == _committed()[dtype]


def test_one_ulp_in_a_stored_result_is_not_verified(tmp_path):
    write_vectors(str(tmp_path), "quick", "float32")
    assert verify_vectors(str(tmp_path)).ok
    man_path = tmp_path / "manifest.json"
    manifest = json.loads(man_path.read_text())
    entry = manifest["files"][0]
    path = tmp_path / entry["file"]
    arrays = read_npz(path.read_bytes())
    arrays["dq"] = arrays["dq"].copy()
    arrays["dq"].flat[0] = np.nextafter(arrays["dq"].flat[0], np.inf)     # one ulp, one entry
    data = _npz_bytes(arrays)
    path.write_bytes(data)
    entry["sha256"] = hashlib.sha256(data).hexdigest()                   # a consistent, tampered set
    man_path.write_text(json.dumps(manifest))
    rep = verify_vectors(str(tmp_path))
    assert not rep.ok
    bad = [r for r in rep.rows if not r["ok"]]
    assert len(bad) == 1 and "dq: 1 entries differ" in bad[0]["note"]


def test_the_files_are_plain_npz_with_fixed_timestamps(tmp_path):
    write_vectors(str(tmp_path), "quick", "float64")
    name = sorted(f for f in os.listdir(tmp_path) if f.endswith(".npz"))[0]
    with zipfile.ZipFile(io.BytesIO((tmp_path / name).read_bytes())) as z:
        assert {i.date_time for i in z.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())


if __name__ == "__main__":                                     # refresh the committed hashes
    import tempfile
    out = {}
    for dt in DTYPES:
        with tempfile.TemporaryDirectory() as d:
            write_vectors(d, "full", dt)
            out[dt] = _hashes(d)
    with open(HASHES, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {HASHES}", file=sys.stderr)
