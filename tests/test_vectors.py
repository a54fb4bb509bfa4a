import hashlib
import json
import os
import zipfile

import numpy as np
import pytest

from sdpa_ref import sdpa_backward, sdpa_forward
from sdpa_ref.harness.cases import get_suite
from sdpa_ref.cli import main
from sdpa_ref.harness.vectors import FORMAT_VERSION, ManifestError, verify_vectors, write_vectors
from tolerances import F64_FEW_ULP, F64_GRAD, F64_REGROUPED, F64_SUMS


@pytest.fixture(scope="module")
def vec_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vectors")
    write_vectors(str(d), suite="quick", dtype="float64")
    return d


def test_round_trip_verifies(vec_dir):
    rep = verify_vectors(str(vec_dir))
    assert rep.ok, str(rep)
    assert len(rep.rows) == len(get_suite("quick"))


def test_manifest_contents(vec_dir):
    m = json.loads((vec_dir / "manifest.json").read_text())
    assert m["format_version"] == FORMAT_VERSION and m["suite"] == "quick" and m["dtype"] == "float64"
    assert m["package_version"] and m["suite_version"] and "float64" in m["tolerance_rule"]
    for entry in m["files"]:
        data = (vec_dir / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]


def test_files_are_plain_npy_arrays_without_pickles(vec_dir):
    path = vec_dir / "all-gqa-mask-bias-alibi-lengths-causal-window_6_inf-bottom_right-softcap8-L24-S24.npz"
    with zipfile.ZipFile(path) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        names = [i.filename for i in zf.infolist()]
    z = np.load(path, allow_pickle=False)
    for key in ("query", "key", "value", "attn_mask", "bias", "alibi_slopes", "q_lengths", "kv_lengths",
                "options_json", "out", "lse", "grad_out", "dq", "dk", "dv", "dbias"):
        assert f"{key}.npy" in names
    opts = json.loads(bytes(z["options_json"]).decode())
    assert opts["is_causal"] is True and opts["causal_alignment"] == "bottom_right" and opts["softcap"] == 8.0
    # the stored answers are the reference's, recomputed here from the stored inputs
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in opts.items() if k != "arrays"}
    for k in ("attn_mask", "bias", "alibi_slopes", "q_lengths", "kv_lengths"):
        kw[k] = z[k]
    out, res = sdpa_forward(z["query"], z["key"], z["value"], **kw)
    np.testing.assert_allclose(z["out"], out, rtol=F64_SUMS, atol=F64_FEW_ULP)
    gr = sdpa_backward(res, z["grad_out"])
    np.testing.assert_allclose(z["dbias"], gr.bias, rtol=F64_GRAD, atol=F64_REGROUPED)


def test_the_vectors_are_deterministic(tmp_path, vec_dir):
    write_vectors(str(tmp_path), suite="quick", dtype="float64")
    assert (tmp_path / "manifest.json").read_bytes() == (vec_dir / "manifest.json").read_bytes()


def test_tampered_file_is_detected(tmp_path):
    write_vectors(str(tmp_path), suite="quick", dtype="float32")
    assert verify_vectors(str(tmp_path)).ok
    target = tmp_path / "plain-L8-S8.npz"
    z = dict(np.load(target))
    z["out"] = z["out"].copy()
    z["out"].flat[3] += 1e-9                                   # a tiny change
    np.savez(target, **z)
    rep = verify_vectors(str(tmp_path))
    assert not rep.ok
    bad = [r for r in rep.rows if not r["ok"]]
    assert [r["file"] for r in bad] == ["plain-L8-S8.npz"] and not bad[0]["hash_ok"]
    (tmp_path / "stray.npz").write_bytes(b"")
    assert any("stray.npz" in p for p in verify_vectors(str(tmp_path)).problems)
    os.remove(tmp_path / "manifest.json")
    with pytest.raises(ManifestError, match="manifest.json"):      # a missing manifest is an error, not a verdict
        verify_vectors(str(tmp_path))


def test_low_precision_vectors_carry_the_honest_errors(tmp_path):
    """Below float64 each file holds the honest ensemble's error per quantity, the harness's own baseline."""
    from sdpa_ref.harness.cases import get_suite
    from sdpa_ref.harness.ensemble import ensemble_errors
    from sdpa_ref.harness.judge import reference_quantities
    write_vectors(str(tmp_path), suite="quick", dtype="float16")
    z = np.load(tmp_path / "plain-L8-S8.npz")
    assert z["query"].dtype == np.float16 and z["out"].dtype == np.float64 and "naive_out" not in z
    case = next(c for c in get_suite("quick") if c.name == "plain-L8-S8")
    want = ensemble_errors(case, "float16", reference_quantities(case, "float16"))
    assert {n: float(z[f"honest_{n}"][0]) for n in want} == want and 0 < want["out"] < 1e-2


def test_bfloat16_and_fp8_vectors_store_bit_patterns_that_decode_to_the_inputs(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from sdpa_ref.harness.cases import get_suite
    from sdpa_ref.harness.vectors import decoded, read_npz
    for name, bits in (("bfloat16", np.uint16), ("float8_e4m3fn", np.uint8)):
        d = tmp_path / name
        write_vectors(str(d), suite="quick", dtype=name)
        assert verify_vectors(str(d)).ok
        stored = read_npz((d / "bias-L7-S9.npz").read_bytes())
        assert stored["query"].dtype == bits and stored["bias"].dtype == bits and stored["out"].dtype == np.float64
        got = decoded(stored, name)
        want = next(c for c in get_suite("quick") if c.name == "bias-L7-S9").make_inputs(getattr(ml_dtypes, name))
        for n in ("query", "key", "value", "bias"):
            assert got[n].dtype == np.dtype(getattr(ml_dtypes, name))
            assert np.array_equal(got[n].view(bits), np.asarray(want[n]).view(bits)), n


def test_cli_vectors_and_verify(tmp_path, capsys):
    assert main(["vectors", str(tmp_path), "--dtype", "float32"]) == 0
    assert f"wrote {len(get_suite('quick'))} cases" in capsys.readouterr().out
    assert main(["verify", str(tmp_path)]) == 0
    assert "VERIFIED" in capsys.readouterr().out
    (tmp_path / "mask-L7-S9.npz").write_bytes(b"not a zip")
    assert main(["verify", str(tmp_path)]) == 1
    assert "NOT VERIFIED" in capsys.readouterr().out


def test_cli_conform(capsys):
    assert main(["conform", "impls:ref_forward", "--backward", "impls:ref_backward", "--dtype", "float32",
                 "float16"]) == 0
    out = capsys.readouterr().out
    assert "verdict: CONFORMS" in out and "0 failed" in out
    assert main(["conform", "impls:wrong_scale", "--format", "json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False and d["counts"]["FAIL"] > 0
    assert main(["conform", "impls:plain_only", "--rule", "fixed", "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "skip" in out and "CONFORMS" in out
    assert main(["conform", "impls:nothing_here"]) == 2
    assert main(["conform", "no_such_module:f"]) == 2
