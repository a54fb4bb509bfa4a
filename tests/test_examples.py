"""Every example runs as a script and exits 0 (its own claims hold)."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"

RUNS = [
    ("scaling_arithmetic.py", []),
    ("saturation_demo.py", ["--seeds", "500"]),
    ("variance_growth.py", ["--n", "8000"]),
    ("wrong_scaling.py", []),
    # a smoke run: a few steps, no accuracy claim (the full run takes ~35 s)
    ("copy_task.py", ["--steps", "4", "--eval-every", "2", "--min-accuracy", "0"]),
]


@pytest.mark.skipif(not EXAMPLES.exists(), reason="examples not shipped beside the tests")
@pytest.mark.parametrize("script,args", RUNS, ids=[r[0] for r in RUNS])
def test_example_runs_and_its_claims_hold(script, args, tmp_path):
    extra = ["--csv", str(tmp_path / "h.csv")] if script == "copy_task.py" else []
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args, *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    if script == "copy_task.py":
        lines = (tmp_path / "h.csv").read_text().splitlines()
        assert lines[0] == "run,d_k,step,loss,accuracy" and len(lines) == 1 + 2 * 3


def test_copy_task_fails_when_the_claim_fails():
    # 2 steps cannot reach 95%: the example must say so with exit code 1
    r = subprocess.run([sys.executable, str(EXAMPLES / "copy_task.py"), "--steps", "2", "--eval-every", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "FAIL" in r.stdout


@pytest.mark.skipif(not EXAMPLES.exists(), reason="examples not shipped beside the tests")
def test_the_copy_task_trains_the_same_on_the_teaching_core(tmp_path):
    """``--method plain`` runs the teaching core (sdpa_ref.attention): the same losses as the fast engine, to
    the rounding that the engines' different sum orders make over a few Adam steps."""
    got = {}
    for method in ("fast", "plain"):
        csv = tmp_path / f"{method}.csv"
        r = subprocess.run([sys.executable, str(EXAMPLES / "copy_task.py"), "--steps", "4", "--eval-every", "2",
                            "--min-accuracy", "0", "--method", method, "--csv", str(csv)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        got[method] = [float(line.split(",")[3]) for line in csv.read_text().splitlines()[1:]]
    assert len(got["plain"]) == 6
    assert all(abs(a - b) <= 1e-9 * max(1.0, abs(a)) for a, b in zip(got["fast"], got["plain"])), got


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(r[0] for r in RUNS)
