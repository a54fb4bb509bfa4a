"""The suite's tolerances stay named: tests/tolerances.py holds each one with its error analysis."""

import pathlib
import re

import tolerances

TESTS = pathlib.Path(__file__).resolve().parent
LITERAL = re.compile(r"\b(rtol|atol|tol)\s*=\s*[-+]?[0-9.]")
MAX_LITERALS = 40    # what may stay literal: a value a test passes to check the package's own handling of it (a
                     # negative rtol must be refused), an eps-multiple spelled out where it is used


def test_literal_tolerances_stay_few():
    hits = [f"{p.name}:{n}" for p in sorted(TESTS.glob("*.py")) if p.name != "tolerances.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) for _ in LITERAL.finditer(line)]
    assert len(hits) <= MAX_LITERALS, f"{len(hits)} literal tolerances; name them in tests/tolerances.py: {hits}"


def test_the_tiers_are_ordered():
    t = tolerances
    assert t.EXACT == 0 < t.F64_SUB_ULP < t.EPS64 < t.F64_ONE_ULP < 2 * t.EPS64 < t.F64_TWO_ULP < t.F64_FEW_ULP
    assert t.F64_FEW_ULP < t.F64_REGROUPED < t.F64_SUMS < t.F64_AMPLIFIED <= t.F64_GRAD < t.F64_GRAD_LONG
    assert t.F64_GRAD_LONG < t.F64_GRAD_ORACLE < t.FD < t.F32 < t.F32_SCHEDULES
    assert t.COMPLEX_STEP == t.F64_GRAD and t.FD_ATOL_SMOOTH < t.FD_ATOL < t.FD_LOOSE_ATOL
