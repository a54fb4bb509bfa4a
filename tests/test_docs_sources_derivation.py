"""The derivation pages: the worked example's printed numbers are the teaching core's, and every exercise's
solution passes the package's checker while the version the page shows fails it, the fix folded away."""

import inspect
import os
import pathlib
import re
import runpy
import subprocess
import sys

import numpy as np
import pytest

import sdpa_ref.core as core
from tolerances import F64_SUMS

ROOT = pathlib.Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorials" / "tut2b_worked_example.py"
DOCS = ROOT / "docs"
EXERCISE_DIR = DOCS / "exercises"
EXERCISE_PAGES = ("ex1_wrong_gradients.py", "ex2_derive_one_line.py")

pytestmark = pytest.mark.skipif(not TUTORIAL.exists(), reason="docs not shipped beside the tests")

ROW = re.compile(r"^\s+\[(.*)\]\s*$")


def _printed(text):
    """The page's printed arrays, ``name -> (values, decimals)``, from blocks ``name =`` then ``    [ a  b ]``."""
    blocks, name, rows = {}, None, []
    for line in text.splitlines() + [""]:
        m = ROW.match(line)
        if m and name is not None:
            rows.append(m.group(1).split())
            continue
        if name is not None and rows:
            decimals = {len(x.split(".")[1]) for r in rows for x in r}
            assert len(decimals) == 1, (name, rows)
            blocks[name] = (np.array(rows, dtype=np.float64), decimals.pop())
        name, rows = (line[:-2], []) if line.endswith(" =") else (None, [])
    return blocks


@pytest.fixture(scope="module")
def worked_example():
    pytest.importorskip("matplotlib")                     # the page draws the graph (the docs extra)
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    r = subprocess.run([sys.executable, str(TUTORIAL)], capture_output=True, text=True, timeout=300,
                       cwd=str(TUTORIAL.parent), env={"MPLBACKEND": "Agg", **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_the_worked_example_prints_the_teaching_cores_numbers(worked_example):
    got = _printed(worked_example)
    Q, K, V, dO = (got[n][0] for n in ("Q", "K", "V", "dO"))
    assert Q.shape == (2, 2) and K.shape == (3, 2), "two queries, three keys, d_k = 2"
    out, res = core.attention_forward(Q, K, V)
    _, _, _, P, s = res
    dq, dk, dv = core.attention_backward(res, dO)
    T = s * (Q @ K.T)
    m = T.max(axis=1, keepdims=True)
    Z = np.sum(np.exp(T - m), axis=1, keepdims=True)
    np.testing.assert_allclose(m + np.log(Z), core.logsumexp_forward(T)[0][:, None], rtol=F64_SUMS)
    np.testing.assert_allclose(np.exp(T - m) / Z, core.softmax_forward(T)[0], rtol=F64_SUMS)
    dP = dO @ V.T
    dT = core.softmax_backward((P, -1), dP)
    want = {
        "R = Q K^T": Q @ K.T, "T = s R": T, "m = rowmax(T)": m, "e = exp(T - m)": np.exp(T - m),
        "Z = rowsum(e)": Z, "P = e / Z": P, "O = P V": out, "dV = P^T dO": dv, "dP = dO V^T": dP,
        "D = rowsum(P * dP)": np.sum(P * dP, axis=1, keepdims=True), "dT = P * (dP - D)": dT,
        "dR = s dT": s * dT, "dQ = dR K": dq, "dK = dR^T Q": dk,
    }
    for name, value in want.items():
        assert name in got, f"the page prints no {name!r}"
        printed, decimals = got[name]
        assert printed.shape == value.shape, name
        assert np.all(np.abs(printed - value) <= 0.5 * 10.0 ** -decimals + F64_SUMS), (name, printed, value)
    assert f"s = 1/sqrt(2) = {s:.4f}" in worked_example
    for l, D_l in enumerate(np.sum(P * dP, axis=1)):            # the row-by-row lines end with D_l
        line = next(x for x in worked_example.splitlines() if x.startswith(f"row {l}: D_{l} = "))
        assert abs(float(line.rsplit("=", 1)[1]) - D_l) <= 0.5e-4 + F64_SUMS, line


def test_the_worked_examples_numbers_are_computed_not_typed(worked_example):
    source = TUTORIAL.read_text()
    numbers = set(re.findall(r"\d+\.\d{4}", worked_example)) - {"0.0000", "1.0000", "2.0000"}
    assert len(numbers) >= 15
    typed = sorted(x for x in numbers if x in source)
    assert not typed, f"numbers the page prints are typed in its source: {typed}"


def test_the_parser_reads_blocks():
    got = _printed("A =\n    [  1.0000  -2.5000 ]\n    [  0.0000   3.0000 ]\nx = 1\nB =\n    [ 0.50 ]\n")
    np.testing.assert_array_equal(got["A"][0], [[1.0, -2.5], [0.0, 3.0]])
    assert got["A"][1] == 4 and got["B"][1] == 2 and set(got) == {"A", "B"}


@pytest.fixture(scope="module")
def exercises():
    sys.path.insert(0, str(DOCS))                      # _exercise_solutions, as conf.py puts it there
    try:
        pages = {page: runpy.run_path(str(EXERCISE_DIR / page)) for page in EXERCISE_PAGES}
    finally:
        sys.path.remove(str(DOCS))
    return pages


def test_each_solution_passes_the_checker_and_each_wrong_version_fails(exercises):
    names = []
    for page, ns in exercises.items():
        for name, check, wrong, solution in ns["EXERCISES"]:
            names.append(name)
            assert not check(wrong).ok, f"{page}, exercise {name}: the wrong version passes the checker"
            assert check(solution).ok, f"{page}, exercise {name}: the solution fails the checker"
    assert len(names) >= 8 and len(set(names)) == len(names), names
    topics = " ".join(names)
    for topic in ("softmax", "scale's gradient", "mask", "log-sum-exp", "sink", "forward mode", "sqrt(d_k)"):
        assert topic in topics, topic


def _code_lines(fn):
    return {ln.split("#")[0].strip() for ln in inspect.getsource(fn).splitlines()} - {""}


def test_each_exercise_is_one_line_and_its_fix_is_folded(exercises):
    for page, ns in exercises.items():
        text = (EXERCISE_DIR / page).read_text()
        for name, _, wrong, solution in ns["EXERCISES"]:
            fixed = _code_lines(solution) - _code_lines(wrong)
            assert len(fixed) == 1, f"{page}, exercise {name}: the fix should be one line, got {fixed}"
            line = fixed.pop()
            assert line not in text, f"{page}, exercise {name}: the fixed line {line!r} is shown unfolded"
            block = text[text.index(f"def {wrong.__name__}("):]
            block = block[block.index(".. admonition:: Solution"):]
            assert block.startswith(".. admonition:: Solution\n#    :class: dropdown"), (page, name)
            assert f":pyobject: {solution.__name__}\n" in block.split(".. admonition::", 2)[1], (page, name)
            assert "admonition:: Hint\n#    :class: dropdown" in text[text.index(f"def {wrong.__name__}("):]
