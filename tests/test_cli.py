import json
import subprocess
import sys

import pytest

from sdpa_ref.cli import main


def test_check_quick_table(capsys):
    assert main(["check", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "softmax_vjp axis=-1" in out and "fully_masked=uniform" in out


def test_check_json(capsys):
    assert main(["check", "--quick", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["status"] == "ok" for r in rows)
    assert max(r["max_rel_error"] for r in rows) < 1e-7


def test_check_csv(capsys):
    assert main(["check", "--quick", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "case,status,max_rel_error,max_abs_error,seconds"
    assert len(lines) > 20


def test_check_fails_with_an_impossible_tolerance(capsys):
    # The exit code reflects failures; a tolerance of 1e-30 cannot be met.
    assert main(["check", "--quick", "--rtol", "1e-30", "--atol", "1e-30"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_help_and_module_entry_point():
    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    r = subprocess.run([sys.executable, "-m", "sdpa_ref", "--help"], capture_output=True, text=True, check=True)
    assert "check" in r.stdout
