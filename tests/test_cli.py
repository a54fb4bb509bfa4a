import json
import subprocess
import sys

import pytest

from sdpa_ref.cli import main


def test_check_quick_table(capsys):
    assert main(["check", "--quick", "--filter", "fully_masked=uniform"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "fully_masked=uniform" in out and "fully_masked=zero" not in out
    assert "complex step" in out


def test_check_json(capsys):
    assert main(["check", "--quick", "--format", "json", "--filter", "softcap"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["status"] == "ok" and "softcap" in r["case"] for r in rows)
    assert max(r["fd_rel_error"] for r in rows) < 1e-7
    assert max(r["cs_rel_error"] for r in rows) < 1e-12


def test_check_csv(capsys):
    assert main(["check", "--format", "csv", "--filter", "softmax"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "case,status,fd_rel_error,cs_rel_error,lse_rel_error,ip_rel_error,hvp_rel_error,seconds"
    assert len(lines) == 1 + 9


def test_check_fails_with_an_impossible_tolerance(capsys):
    # The exit code reflects failures; a tolerance of 1e-30 cannot be met.
    assert main(["check", "--filter", "L=S mask=bool causal gqa", "--rtol", "1e-30", "--atol", "1e-30"]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert main(["check", "--filter", "no such case"]) == 2


def test_help_and_module_entry_point():
    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    r = subprocess.run([sys.executable, "-m", "sdpa_ref", "--help"], capture_output=True, text=True, check=True)
    assert "check" in r.stdout


# ------------------------------------------------------------------ diagnose


def test_diagnose_table_grouped_by_scale(capsys):
    assert main(["diagnose", "--d-k", "8", "64", "--trials", "8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["scale", "d_k", "score_std"]
    body = [ln.split()[0] for ln in lines[2:] if ln.strip() and not ln.startswith("8 trials")]
    assert body == ["none", "none", "sqrt", "sqrt", "linear", "linear"]
    assert "" in lines[2:8]    # a blank line between groups


def test_diagnose_json_keys(capsys):
    assert main(["diagnose", "--d-k", "16", "--trials", "4", "--scales", "sqrt", "none", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["scale"] for r in rows] == ["sqrt", "none"]
    for key in ("d_k", "scale", "score_std", "entropy", "normalized_entropy", "max_weight_mean",
                "max_weight_median", "saturated_fraction", "grad_norm_scores", "grad_norm_query",
                "grad_norm_key", "jacobian_norm", "trials"):
        assert key in rows[0]
    assert rows[0]["trials"] == 4


def test_diagnose_csv(capsys):
    assert main(["diagnose", "--d-k", "16", "32", "--trials", "4", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("d_k,scale,")
    assert len(lines) == 1 + 2 * 3


def test_diagnose_bad_argument_is_one_line(capsys):
    assert main(["diagnose", "--n-keys", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "n_keys" in err[0]


def test_diagnose_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    assert main(["diagnose", "--d-k", "4", "16", "64", "--trials", "4", "--plot", str(path)]) == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_diagnose_plot_without_matplotlib_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` fail
    assert main(["diagnose", "--d-k", "4", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install matplotlib" in err[0]
    assert not (tmp_path / "x.png").exists()


def test_saturation_demo(capsys):
    assert main(["saturation", "--d-k", "128", "--n-keys", "50", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "raw_weight" in out and "scaled_weight" in out
    assert main(["saturation", "--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["raw_top5"]) == 5 and res["raw_top5"][0]["weight"] >= res["scaled_top5"][0]["weight"]


def test_progress_on_a_terminal_and_every_few_seconds_when_piped(capsys):
    import io

    from sdpa_ref.cli.output import _Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = _Progress("diagnose", stream=tty)
    p(0, 3, "d_k=4")
    p.done()
    assert "1/3" in tty.getvalue()
    # piped (a CI log): the first call, then a line every `every` seconds, then how long the whole took
    piped, clock = io.StringIO(), [0.0]
    p = _Progress("conform", stream=piped, every=5.0)
    p._time, p.start = (lambda: clock[0]), 0.0
    for i, t in enumerate([0.0, 1.0, 6.0]):
        clock[0] = t
        p(i, 3, "case" + str(i))
    clock[0] = 7.0
    p.done()
    assert piped.getvalue().splitlines() == ["conform: 1/3 case0 (0 s)", "conform: 3/3 case2 (6 s)",
                                             "conform: 3/3 done in 7.0 s"]
    assert main(["diagnose", "--d-k", "4", "--trials", "2", "--format", "json"]) == 0
    cap = capsys.readouterr()
    assert "diagnose: 1/" in cap.err and "diagnose:" not in cap.out       # progress never reaches stdout
    json.loads(cap.out)


def test_check_complex_rtol_is_used(capsys, monkeypatch):
    """The tolerance reaches every attention case's complex-step checks (whether an error passes it depends on
    rounding the package does not control: with the fast engine's own JVP, <g, Jt> and <J^T g, t> can agree to
    the bit, and the complex-step errors sit under their absolute floor)."""
    from sdpa_ref.harness import selfcheck

    seen, real = [], selfcheck.run_attention_case

    def spy(case, **kw):
        seen.append(kw.get("complex_rtol"))
        return real(case, **kw)
    monkeypatch.setattr(selfcheck, "run_attention_case", spy)
    main(["check", "--filter", "L<S softcap=1.5 gqa", "--complex-rtol", "1e-30"])
    assert seen and set(seen) == {1e-30}
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("worst relative errors")]
    assert len(summary) == 1 and "complex step" in summary[0] and "(1e-30)" in summary[0]


def test_diagnose_n_queries_is_used(capsys):
    assert main(["diagnose", "--d-k", "8", "--trials", "3", "--n-queries", "5", "--format", "json"]) == 0
    assert {r["n_queries"] for r in json.loads(capsys.readouterr().out)} == {5}


def test_conform_supports_overrides(capsys):
    assert main(["conform", "impls:ref_forward", "--supports", "is_causal", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    skipped = {r["case"] for r in rows if r["status"] == "skip"}
    assert "mask-L7-S9" in skipped and "causal-top_left-L7-S13" not in skipped


def test_conform_takes_the_layout(capsys):
    from sdpa_ref.harness.conformance import LAYOUTS
    assert main(["conform", "impls:ref_forward_bshd", "--layout", "bshd", "--suite", "quick", "--in-process",
                 "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["layout"] == "blhd"
    assert main(["conform", "impls:ref_forward", "--layout", "bshd", "--in-process", "--format", "json"]) == 1
    capsys.readouterr()
    parser_choices = next(a.choices for a in _conform_parser()._actions if a.dest == "layout")
    assert set(parser_choices) <= set(LAYOUTS)


def test_conform_runs_the_guarded_runs_unless_told_not_to(capsys):
    spec = "test_harness_guards:reads_past_each_head"
    assert main(["conform", spec, "--in-process", "--format", "json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    guard = [r for r in rep["rows"] if r["quantity"] == "guard"]
    assert guard and all("reads outside its inputs" in r["note"] for r in guard) and rep["meta"]["guards"]
    assert main(["conform", spec, "--in-process", "--no-guards", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["meta"]["guards"] is False


def _conform_parser():
    import argparse
    from sdpa_ref.cli.parser import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["conform"]
