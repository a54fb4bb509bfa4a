"""Isolated judging: an implementation run in a child process cannot end, fool or outlast the harness.

The hostile implementations are in tests/hostile_impls.py. ``sdpa-ref conform`` runs each in a child process
(its default): every run exits 1 with a full report in which no hostile case passed, in at most the time limit
plus a few seconds per case. ``check_implementation(isolate=True)`` does the same in Python, and monkeypatching
or reading the stack in the child changes nothing in the parent. In-process (the default in Python) the harness
cannot stop ``os._exit`` or a patched judge, and says so; it still passes nothing the implementation did not
return, and a forked copy that returns is stopped.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import hostile_impls
import impls
import sdpa_ref
from sdpa_ref.harness import conformance, judge
from sdpa_ref.harness.cases import Case, get_suite

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sdpa_ref.__file__)))
TIMEOUT = 1.0
#: "A few seconds" per case: killing the child, starting a fresh one, importing numpy and sdpa_ref there.
PER_CASE = 4.0
#: Starting the command itself (an interpreter, numpy, sdpa_ref) on a loaded machine.
STARTUP = 10.0
SMALL = [Case(name="small-a", L=5, S=11, E=8, Ev=8), Case(name="small-b", L=8, S=8, E=8, Ev=8)]
CASE_FILE = {"cases": [{"name": c.name, "L": c.L, "S": c.S, "E": c.E, "Hq": c.Hq, "batch": list(c.batch_q)}
                       for c in SMALL]}


@pytest.fixture(scope="module")
def case_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("isolation") / "two.json"
    p.write_text(json.dumps(CASE_FILE))
    return str(p)


def _conform(target, case_file, *extra, cwd=HERE):
    """``sdpa-ref conform TARGET`` as a user runs it: its exit status, its report (None if stdout is not one), its
    stderr and the seconds it took; a run past the budget is a failure, not a wait."""
    budget = STARTUP + len(SMALL) * (TIMEOUT + PER_CASE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "sdpa_ref", "conform", target, "--cases", case_file, "--dtype", "float64",
           "--timeout", f"{TIMEOUT:g}", "--format", "json", *extra]
    t0 = time.monotonic()
    try:
        cp = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(cmd[3:])}` still ran after {budget:g} s (timeout {TIMEOUT:g} s, {len(SMALL)} cases)")
    try:
        report = json.loads(cp.stdout)
    except ValueError:
        report = None
    return cp.returncode, report, cp.stderr, time.monotonic() - t0


HOSTILE = {   # name -> what each failed row's note must say
    "exits": "ended without answering (exit status 0",
    "forks": "ended without answering",
    "catches_the_timeout": f"ran past the time limit of {TIMEOUT:g} s",
    "ignores_sigalrm": f"ran past the time limit of {TIMEOUT:g} s",
    "never_answers": f"ran past the time limit of {TIMEOUT:g} s",
    "closes_its_channel": "without answering",
    "returns_a_generator": "not an array of numbers",
    "patches_abs": "",
    "patches_the_judge": "",
    "reads_the_stack": "",
}


#: In the default suite: an early exit, a fork and a timeout ignored; the others are long checks (.ci/run).
DEFAULT_HOSTILE = ("exits", "forks", "ignores_sigalrm")


@pytest.mark.parametrize("name", [n if n in DEFAULT_HOSTILE else pytest.param(n, marks=pytest.mark.long)
                                  for n in HOSTILE])
def test_conform_fails_a_hostile_implementation_with_a_report_in_about_the_time_limit(name, case_file):
    code, report, err, seconds = _conform(f"hostile_impls:{name}", case_file)
    assert code == 1, (code, err[-2000:])
    assert report is not None and report["verdict"] == "does not conform", err[-2000:]
    rows = report["rows"]
    assert {r["case"] for r in rows} == {c.name for c in SMALL}           # every case judged: the run went on
    assert all(r["status"] in ("FAIL", "error") for r in rows), rows
    assert all(HOSTILE[name] in r["note"] for r in rows), rows
    assert report["meta"]["isolated"] is True and report["meta"]["time_limit"] == TIMEOUT
    assert seconds < STARTUP + len(SMALL) * (TIMEOUT + PER_CASE)


def test_conform_goes_on_after_a_crash_and_keeps_stdout_for_the_report(case_file):
    code, report, err, _ = _conform("hostile_impls:crashes_on_five_queries", case_file)
    assert code == 1 and [r["status"] for r in report["rows"]] == ["error", "pass"]    # a fresh process for case 2
    assert "killed by SIGKILL" in report["rows"][0]["note"]
    code, report, err, _ = _conform("hostile_impls:prints", case_file)
    assert code == 0 and report["verdict"] == "conforms"                  # its print went to stderr
    assert "{not json" in err


def test_conform_in_process_is_the_old_way_and_says_what_it_is(case_file):
    code, report, err, _ = _conform("hostile_impls:honest", case_file, "--in-process")
    assert code == 0 and report["meta"]["isolated"] is False
    code, report, err, _ = _conform("hostile_impls:reads_the_stack", case_file, "--in-process")
    assert code == 0, "in-process, reading the stack works (documented): if this fails, update the docs"


def test_conform_never_imports_from_the_current_directory_ahead_of_installed_packages(tmp_path, case_file):
    """A module planted in the current directory under an installed package's name (threadpoolctl, which holds
    the BLAS to one thread) is never imported, by the reference's side or by the implementation's."""
    pytest.importorskip("threadpoolctl")
    (tmp_path / "threadpoolctl.py").write_text(
        "import os\nopen(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'PLANTED'), 'w').close()\n"
        "raise ImportError('planted')\n")
    (tmp_path / "kern.py").write_text("import sdpa_ref\n\n\ndef f(q, k, v, **o):\n"
                                      "    return sdpa_ref.scaled_dot_product_attention(q, k, v, **o)\n")
    for extra in ((), ("--in-process",)):
        code, report, err, _ = _conform("kern:f", case_file, *extra, cwd=str(tmp_path))
        assert code == 0 and report["verdict"] == "conforms", err[-2000:]
        assert not (tmp_path / "PLANTED").exists(), f"the planted threadpoolctl.py was imported ({extra})"


def test_conform_says_when_the_child_cannot_load_the_implementation(tmp_path, case_file):
    (tmp_path / "dies.py").write_text("import os\nos._exit(0)\n")
    (tmp_path / "slow.py").write_text("def f(q, k, v, **o):\n    return q\n")
    for target, words in (("dies:f", "ended without answering"), ("slow:nope", "AttributeError"),
                          ("nosuchmodule:f", "ModuleNotFoundError")):
        code, report, err, _ = _conform(target, case_file, cwd=str(tmp_path))
        assert code == 2 and report is None and words in err and "MODULE:FUNCTION" in err, err
        assert err.strip().count("\n") == 0, err


# ------------------------------------------------------------------ in Python, isolate=True


@pytest.mark.parametrize("fn", [hostile_impls.patches_abs, hostile_impls.patches_the_judge,
                                hostile_impls.reads_the_stack])
def test_what_the_child_does_to_itself_does_not_reach_the_verdict(fn):
    compare, absolute = judge._compare, np.abs
    rep = sdpa_ref.check_implementation(fn, dtypes="float64", cases=SMALL, isolate=True)
    assert not rep.ok and all(r.status == "FAIL" for r in rep.rows), str(rep)
    assert judge._compare is compare and np.abs is absolute


def test_isolated_and_in_process_verdicts_agree_row_for_row():
    """The child's answers come back bit for bit: the same rows as in-process, with a backward, a bias (dbias),
    a skip by NotImplementedError, the blhd layout and bfloat16 (ml_dtypes arrays over the pipe)."""
    pytest.importorskip("ml_dtypes")
    cases = [c for c in get_suite("quick") if c.name in ("plain-L8-S8", "bias-L7-S9", "masked-rows-nan-L8-S8")]
    for kw in (dict(forward=impls.ref_forward, backward=impls.ref_backward, dtypes=("float32", "bfloat16")),
               dict(forward=hostile_impls.honest_blhd, dtypes="float64", layout="blhd", deterministic=True)):
        a = sdpa_ref.check_implementation(cases=cases, **kw)
        b = sdpa_ref.check_implementation(cases=cases, isolate=True, **kw)
        strip = lambda rep: [(r.case, r.dtype, r.quantity, r.status, r.error, r.note) for r in rep.rows]  # noqa
        assert strip(a) == strip(b) and b.ok and b.meta["isolated"]
    rep = sdpa_ref.check_implementation("hostile_impls:refuses", cases=SMALL[:1], dtypes="float64", isolate=True)
    assert [r.status for r in rep.rows] == ["skip"] and "not implemented: no" in rep.rows[0].note


def test_a_crash_in_the_backward_fails_the_gradients_and_the_run_goes_on():
    rep = sdpa_ref.check_implementation(hostile_impls.honest, backward=hostile_impls.backward_exits, cases=SMALL,
                                        dtypes="float64", isolate=True)
    assert [(r.quantity, r.status) for r in rep.rows] == [("grads", "error"), ("out", "pass")] * 2


def test_without_a_timeout_isolation_still_has_a_limit(monkeypatch):
    from sdpa_ref.harness.isolate import DEFAULT_TIME_LIMIT
    assert DEFAULT_TIME_LIMIT == 600
    monkeypatch.setattr(conformance, "DEFAULT_TIME_LIMIT", 0.5)
    t0 = time.monotonic()
    rep = sdpa_ref.check_implementation(hostile_impls.never_answers, dtypes="float64", cases=SMALL[:1],
                                        isolate=True)
    assert [r.status for r in rep.rows] == ["error"] and "time limit of 0.5 s" in rep.rows[0].note
    assert rep.meta["time_limit"] == 0.5 and time.monotonic() - t0 < STARTUP


def test_isolation_refuses_what_the_child_cannot_load():
    from sdpa_ref.harness.isolate import LoadError
    with pytest.raises(TypeError, match="`forward` should be 'module:function' or a picklable callable"):
        sdpa_ref.check_implementation(lambda q, k, v: q, cases=SMALL, isolate=True)
    with pytest.raises(TypeError, match="`forward` should be callable, but got str"):
        sdpa_ref.check_implementation("impls:ref_forward", cases=SMALL)           # a spec needs isolate=True
    with pytest.raises(LoadError, match="ModuleNotFoundError") as e:
        sdpa_ref.check_implementation("no_such_module_here:f", cases=SMALL, isolate=True)
    assert e.value.which == "forward" and isinstance(e.value, ImportError)
    with pytest.raises(LoadError, match="AttributeError") as e:
        sdpa_ref.check_implementation(impls.ref_forward, backward="impls:nope", cases=SMALL, isolate=True)
    assert e.value.which == "backward"


def test_the_child_reports_what_a_spec_supports():
    cases = [c for c in get_suite("quick") if c.name in ("plain-L8-S8", "mask-L7-S9")]
    rep = sdpa_ref.check_implementation("impls:plain_only", dtypes="float64", isolate=True, cases=cases)
    assert [(r.case, r.status) for r in rep.rows] == [("plain-L8-S8", "pass"), ("mask-L7-S9", "skip")]
    assert rep.meta["supports"] == []


# ------------------------------------------------------------------ in-process: what it still holds


@pytest.mark.parametrize("fn", [hostile_impls.returns_a_generator, lambda q, k, v, **o: None,
                                lambda q, k, v, **o: iter([q]), lambda q, k, v, **o: object()])
def test_in_process_a_result_that_is_not_an_array_never_passes(fn):
    rep = sdpa_ref.check_implementation(fn, dtypes="float64", cases=SMALL)
    assert not rep.ok and all(r.status in ("FAIL", "error") for r in rep.rows), str(rep)


def test_in_process_a_result_is_judged_as_it_came_back():
    """A forward that returns zeros and writes the right answer into them later (from its backward) fails."""
    rep = sdpa_ref.check_implementation(hostile_impls.fills_in_later, backward=hostile_impls.fills_in_later_bwd,
                                        dtypes="float64", cases=SMALL)
    assert [r.status for r in rep.rows if r.quantity == "out"] == ["FAIL", "FAIL"], str(rep)


def test_in_process_a_forked_copy_that_returns_is_stopped():
    """The copy returns into the harness; it must end at once with status 70 and report nothing (the forward
    returns the right answer only if it did)."""
    rep = sdpa_ref.check_implementation(hostile_impls.forks_and_waits, dtypes="float64", cases=SMALL[:1])
    assert rep.ok, str(rep)
