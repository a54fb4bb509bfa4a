"""The C client in examples/c (issue 13, part 4): it passes the golden vectors and fails an edited one."""

import os
import shutil
import subprocess

import numpy as np
import pytest

from sdpa_ref.harness import vectors

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "c", "sdpa_check.c")
CC = os.environ.get("CC") or "cc"

pytestmark = pytest.mark.skipif(shutil.which(CC) is None or not os.path.exists(SOURCE),
                                reason="no C compiler here (CI has one)")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    exe = str(tmp_path_factory.mktemp("c") / "sdpa_check")
    subprocess.run([CC, "-std=c99", "-O2", "-Wall", "-Wextra", "-pedantic", "-o", exe, SOURCE, "-lm"],
                   check=True, capture_output=True, text=True)
    return exe


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_c_client_passes_the_quick_vectors_and_fails_an_edited_one(client, tmp_path, dtype):
    d = tmp_path / "v"
    vectors.write_vectors(str(d), "quick", dtype)
    cp = subprocess.run([client, str(d)], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    lines = cp.stdout.splitlines()
    assert sum(line.startswith("pass") for line in lines) == 30 and lines[-1] == "30 cases, 0 failed"
    # one expected value off by 1% (the honest error is stored apart, so the allowance stays): that case, and
    # only it, fails
    name = "causal-bottom_right-L7-S13.npz"
    arrays = vectors.read_npz((d / name).read_bytes())
    a = arrays["out"].copy()
    a.flat[17] = a.flat[17] * 1.01
    arrays["out"] = a
    (d / name).write_bytes(vectors._npz_bytes(arrays))
    cp = subprocess.run([client, str(d)], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 1
    failed = [line for line in cp.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1 and "causal-bottom_right-L7-S13" in failed[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_the_c_client_reads_the_low_precision_vectors(client, tmp_path, dtype):
    """bfloat16 and fp8 arrays are stored as bit patterns; the client decodes them and rounds to the format."""
    pytest.importorskip("ml_dtypes")
    d = tmp_path / "v"
    vectors.write_vectors(str(d), "quick", dtype)
    cp = subprocess.run([client, str(d)], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0 and cp.stdout.splitlines()[-1] == "30 cases, 0 failed", cp.stdout + cp.stderr
    # the decoded inputs are what the reference read: a wrong decoding would not pass, and neither does this
    name = "plain-L8-S8.npz"
    arrays = vectors.read_npz((d / name).read_bytes())
    arrays["value"] = arrays["value"][..., ::-1, :].copy()              # the keys' values permuted
    (d / name).write_bytes(vectors._npz_bytes(arrays))
    cp = subprocess.run([client, str(d)], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 1 and [ln for ln in cp.stdout.splitlines() if ln.startswith("FAIL")][0].startswith(
        "FAIL  plain-L8-S8")


def test_the_c_client_refuses_what_it_cannot_read(client, tmp_path):
    cp = subprocess.run([client, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "cannot read" in cp.stderr
    (tmp_path / "manifest.json").write_text('{"dtype": "float32", "files": [{"file": "gone.npz"}]}')
    cp = subprocess.run([client, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "k_out" in cp.stderr                  # no rule to judge by
    (tmp_path / "manifest.json").write_text('{"dtype": "float32", "relative_rule": {"k_out": 3.0}, '
                                            '"files": [{"file": "gone.npz"}]}')
    cp = subprocess.run([client, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "gone.npz" in cp.stderr
    (tmp_path / "gone.npz").write_bytes(np.arange(10).tobytes())
    cp = subprocess.run([client, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2
