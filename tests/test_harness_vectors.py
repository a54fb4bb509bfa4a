import hashlib
import json
import os
import zipfile

import numpy as np
import pytest

from sdpa_ref import sdpa_backward, sdpa_forward
from sdpa_ref.harness.cases import SUITE_VERSION, get_suite
from sdpa_ref.cli import main
from sdpa_ref.harness.vectors import FORMAT_VERSION, ManifestError, verify_vectors, write_vectors
from tolerances import F64_FEW_ULP, F64_GRAD, F64_REGROUPED, F64_SUMS
import subprocess
import sys
import textwrap
import tracemalloc
from sdpa_ref.harness import budget, vectors
from sdpa_ref.harness.casefile import cases_from_definitions
from sdpa_ref.harness.lowp import TEST_DTYPES
from sdpa_ref.harness.vector_layouts import VECTOR_LAYOUTS, in_layout


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


@pytest.mark.slow
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


#: What a refused hostile manifest may cost ``verify`` (the issue's bounds).
HOSTILE_SECONDS = 5.0


HOSTILE_MIB = 200.0


def _manifest(cases, dtype="float64"):
    """A manifest of a custom set with these case definitions, valid enough to pass the parser (hashes made up)."""
    return {"format": "sdpa_ref golden vectors", "format_version": vectors.FORMAT_VERSION, "suite": "custom",
            "suite_version": SUITE_VERSION, "dtype": dtype, "cases": cases,
            "files": [{"file": f"{c['name']}.npz", "sha256": "0" * 64} for c in cases]}


def _write(folder, manifest):
    folder.mkdir(parents=True, exist_ok=True)
    data = json.dumps(manifest).encode()
    (folder / "manifest.json").write_bytes(data)
    return len(data)


_MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    from sdpa_ref.harness import vectors
    t = time.perf_counter()
    try:
        rep = vectors.verify_vectors(sys.argv[1])
        verdict = "VERIFIED" if rep.ok else "NOT VERIFIED"
    except vectors.ManifestError as exc:
        verdict = "refused: " + str(exc)
    try:                    # this process's own peak: Linux keeps ru_maxrss across fork and exec, so getrusage
        with open("/proc/self/status") as fh:        # would report the (larger) test process that started it
            peak_kib = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": time.perf_counter() - t, "verdict": verdict, "peak_mib": peak_kib / 1024}))
""")


def _measured(folder):
    """``verify`` of ``folder`` in a fresh process: its seconds, verdict and the process's peak RSS in MiB."""
    try:
        run = subprocess.run([sys.executable, "-c", _MEASURE, str(folder)], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        pytest.fail("verify of a hostile manifest ran past 60 s")
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _wide(name, E=1 << 22):
    return {"name": name, "L": 16, "E": E}


HOSTILE = {
    # the issue's: one case of E = 2**22 (16 x 2**22 query entries, the case-file format's largest input)
    "one-wide-case": [_wide("w")],
    "three-wide-cases": [_wide(f"w{i}") for i in range(3)],
    # each case within the per-case limits, 10,000 of them (the case-file format's most) far past the total
    "ten-thousand-cases": [{"name": f"c{i}", "L": 128, "Hq": 8, "E": 64} for i in range(10_000)],
}


def _over(limit_name):
    """Case definitions just past one of the limits (and within every other)."""
    lim = budget.VERIFY_LIMITS
    if limit_name == "case_scores":                          # 2**22 x 2 score entries, little else
        return [{"name": "s", "L": 2048, "S": 2048, "E": 1, "Hq": 1, "batch": [2]}]
    if limit_name == "case_input":
        return [{"name": "i", "L": 1, "S": 1, "E": lim.case_input + 1}]
    if limit_name == "case_work":                            # 2**21 scores x (E + Ev + 16) past 2**28
        return [{"name": "w", "L": 2048, "S": 1024, "E": 64, "Ev": 64}]
    if limit_name == "case_bytes":                           # score-sized float arrays: mask, bias, dbias
        return [{"name": "b", "L": 2048, "S": 2048, "E": 1, "arrays": ["float_mask", "bias"]}]
    if limit_name == "total_work":
        return [{"name": f"t{i}", "L": 512, "S": 512, "E": 64, "Hq": 4} for i in range(12)]
    raise AssertionError(limit_name)


def _set(tmp_path, n):
    defs = [{"name": f"c{i}", "L": 48, "S": 48, "E": 32, "Hq": 4, "seed": i, "arrays": ["bias"]}
            for i in range(n)]
    (tmp_path / "cases.json").write_text(json.dumps({"cases": defs}))
    out = tmp_path / f"v{n}"
    vectors.write_vectors(str(out), dtype="float64", cases=str(tmp_path / "cases.json"))
    return out


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_manifest_is_refused_within_5_s_and_200_mb(tmp_path, kind):
    size = _write(tmp_path / "v", _manifest(HOSTILE[kind]))
    if kind == "one-wide-case":
        assert size < 2048                                  # the issue's ~1.5 KB manifest
    got = _measured(tmp_path / "v")
    assert got["verdict"].startswith("refused:") and "VERIFY_LIMITS" in got["verdict"], got
    assert got["seconds"] < HOSTILE_SECONDS, got
    assert got["peak_mib"] < HOSTILE_MIB, got


def test_the_refusal_names_the_case_the_quantity_and_the_limit(tmp_path):
    _write(tmp_path / "a", _manifest([{"name": "ok", "L": 4, "E": 4}, _wide("too-wide")]))
    with pytest.raises(vectors.ManifestError, match=r"too-wide.*query.*more than the .* verify accepts"):
        vectors.verify_vectors(str(tmp_path / "a"))
    _write(tmp_path / "b", _manifest(HOSTILE["ten-thousand-cases"]))
    with pytest.raises(vectors.ManifestError, match=r"in total.*more than the .* verify accepts"):
        vectors.verify_vectors(str(tmp_path / "b"))
    assert main(["verify", str(tmp_path / "a")]) == 2


@pytest.mark.parametrize("limit_name", ["case_scores", "case_input", "case_work", "case_bytes", "total_work"])
def test_each_limit_refuses_a_set_just_past_it(limit_name):
    cases = cases_from_definitions(_over(limit_name), "test")
    with pytest.raises(vectors.ManifestError) as exc:
        budget.check_verify_budget(cases, "float64", where="test")
    assert budget.shown_count(getattr(budget.VERIFY_LIMITS, limit_name)) in str(exc.value), (limit_name, str(exc.value))


@pytest.mark.parametrize("dtype", TEST_DTYPES)
def test_the_full_suite_in_every_dtype_and_layout_is_within_the_limits(dtype):
    pytest.importorskip("ml_dtypes")
    for layout in (None,) + VECTOR_LAYOUTS:
        cases = get_suite("full") if layout is None else in_layout(get_suite("full"), layout)
        costs = budget.check_verify_budget(cases, dtype, where="the full suite")
        # and with room: a future case or two does not need the limits raised
        assert costs["work"] < budget.VERIFY_LIMITS.total_work / 2


def test_the_byte_estimate_bounds_every_quick_file_in_every_layout():
    for layout in (None,) + VECTOR_LAYOUTS:
        cases = get_suite("quick") if layout is None else in_layout(get_suite("quick"), layout)
        for case in cases:
            data = vectors._npz_bytes(vectors._case_arrays(case, "float64", layout))
            est = budget.case_cost(case, "float64")["bytes"]
            assert len(data) <= est, (layout, case.name, len(data), est)


def test_verify_reads_in_manifest_order_and_regenerates_one_case_at_a_time(tmp_path, monkeypatch):
    d = _set(tmp_path, 4)
    m = json.loads((d / "manifest.json").read_text())
    m["files"] = m["files"][::-1]                        # the manifest's order, not the suite's
    (d / "manifest.json").write_text(json.dumps(m))
    events, real_read, real_arrays = [], vectors.read_member, vectors._regenerated

    def read(out_dir, name):
        events.append(("read", name))
        return real_read(out_dir, name)

    def regenerated(case, dt, layout=None):
        events.append(("make", f"{case.name}.npz"))
        return real_arrays(case, dt, layout)

    monkeypatch.setattr(vectors, "read_member", read)
    monkeypatch.setattr(vectors, "_regenerated", regenerated)
    vectors.clear_cache()
    rep = vectors.verify_vectors(str(d))
    assert not rep.ok and any("manifest.json" in p for p in rep.problems)   # the order is the manifest's bytes
    assert [r["ok"] for r in rep.rows] == [True] * 4                         # ... every file verifies
    names = [e["file"] for e in m["files"]]
    assert events == [(what, n) for n in names for what in ("read", "make")], events


def test_verify_holds_one_case_at_a_time(tmp_path):
    """The peak of verifying 8 cases is that of one, not eight (the old verify kept every case's arrays and bytes
    until the end)."""
    peaks = {}
    for n in (1, 8):
        d = _set(tmp_path, n)
        vectors.clear_cache()
        tracemalloc.start()
        assert vectors.verify_vectors(str(d)).ok
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[8] < 1.5 * peaks[1], peaks


def test_write_vectors_refuses_cases_that_verify_would_refuse(tmp_path):
    (tmp_path / "cases.json").write_text(json.dumps({"cases": _over("case_input")}))
    with pytest.raises(ValueError, match="verify accepts"):
        vectors.write_vectors(str(tmp_path / "v"), cases=str(tmp_path / "cases.json"))
    assert not (tmp_path / "v" / "manifest.json").exists()


def test_the_limits_are_stated_in_the_help_and_the_docstring(capsys):
    lim = budget.VERIFY_LIMITS
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    doc = " ".join(vectors.verify_vectors.__doc__.split())
    for n in (lim.case_scores, lim.case_input, lim.case_work, lim.case_bytes, lim.total_scores, lim.total_work,
              lim.total_bytes):
        assert budget.shown_count(n) in text, (n, text)
    assert "VERIFY_LIMITS" in doc
    for n in (lim.case_scores, lim.case_input, lim.case_work, lim.case_bytes, lim.total_scores, lim.total_work,
              lim.total_bytes, lim.work_per_case):
        assert budget.shown_count(n) in doc, n
