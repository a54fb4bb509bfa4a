"""Every install the package allows keeps its promises (issue 40, item 12): rounding to bfloat16 and fp8 is the
package's own, once, whatever the ``ml_dtypes`` version; the oldest versions ``setup.cfg`` allows are the ones
.ci/oldest.txt pins; ``SDPA_REF_NO_COMPILE=1`` installs without the compiled kernels.

``ml_dtypes`` before 0.7 rounds float64 to bfloat16 through float32 (``1 + 2**-8 + 2**-30`` became 1.0, not
1.0078125), so the golden vectors' bits depended on its version. :func:`sdpa_ref.rounding.round_to` is checked here
against a plainly written oracle -- every value of the format listed from its bit patterns, the nearest found by
exact rational comparison, a tie to the even bit pattern -- on edge values, and against ``ml_dtypes`` 0.7 (which
rounds once) on random values.
"""

import bisect
import configparser
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from sdpa_ref.rounding import FORMATS, round_to

ml_dtypes = pytest.importorskip("ml_dtypes")
ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = list(FORMATS)


def _version(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _table(name):
    """``(values, patterns)`` of every non-negative finite value of the format, ascending, and one more: the
    pattern after the largest finite value (an infinity or NaN code), at the value the exponent range would give
    it (largest + its spacing): a value rounding to it overflows."""
    dt = np.dtype(getattr(ml_dtypes, name))
    bits = np.arange(1 << (8 * dt.itemsize - 1), dtype=np.uint16 if dt.itemsize == 2 else np.uint8)
    with np.errstate(invalid="ignore"):
        vals = bits.view(dt).astype(np.float64)
    keep = np.isfinite(vals)
    vals, bits = vals[keep], bits[keep]
    order = np.argsort(vals, kind="stable")
    vals, bits = [float(v) for v in vals[order]], [int(b) for b in bits[order]]
    vals.append(vals[-1] + (vals[-1] - vals[-2]))
    bits.append(bits[-1] + 1)
    return vals, bits


_TABLES = {}


def oracle(x, name):
    """``x`` (a Python float) rounded to the format ``name`` once, to nearest, ties to the even pattern; overflow
    gives ``inf`` or, for e4m3fn, NaN; NaN gives NaN; the sign is kept (also on zero)."""
    if name not in _TABLES:
        _TABLES[name] = _table(name)
    vals, bits = _TABLES[name]
    has_inf = FORMATS[name][3]
    if x != x:
        return float("nan")
    sign = -1.0 if (x < 0 or (x == 0 and str(x).startswith("-"))) else 1.0
    a = abs(x)
    if a == float("inf"):
        return sign * float("inf") if has_inf else float("nan")
    i = bisect.bisect_left(vals, a)
    if i < len(vals) and vals[i] == a:
        j = i
    elif i == len(vals):
        j = len(vals) - 1
    else:
        lo, hi = vals[i - 1], vals[i]
        mid = (Fraction(lo) + Fraction(hi)) / 2
        fa = Fraction(a)
        j = i - 1 if fa < mid else i if fa > mid else (i - 1 if bits[i - 1] % 2 == 0 else i)
    if j == len(vals) - 1:                                    # the pattern past the largest finite value
        return sign * float("inf") if has_inf else float("nan")
    return sign * vals[j]


def _same(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(
        np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want)) and np.array_equal(
        np.signbit(got[~np.isnan(got)]), np.signbit(want[~np.isnan(want)]))


def _edges(name):
    m, emin, fmax, _ = FORMATS[name]
    tiny = 2.0 ** (emin - m)                                 # the least subnormal
    one_ulp = 2.0 ** -m
    fmax_ulp = 2.0 ** (np.floor(np.log2(fmax)) - m)
    xs = [0.0, -0.0, 1.0, 1 + one_ulp / 2, 1 + 3 * one_ulp / 2, 1 + one_ulp / 2 + 2.0 ** -40,
          1 + one_ulp / 2 - 2.0 ** -40, 1 + one_ulp / 2 + 2.0 ** -30,          # past float32's precision: the
          2 - one_ulp / 4, 2 - one_ulp / 2,                                      # double-rounding cases
          tiny, tiny / 2, 3 * tiny / 2, 5 * tiny / 2, 3 * tiny / 4, tiny / 4, tiny * 0.5000001,
          2.0 ** emin, 2.0 ** emin - tiny / 2, 2.0 ** emin - tiny, 2.0 ** emin - tiny / 4,
          fmax, fmax + fmax_ulp / 2, fmax + fmax_ulp / 2 - 2.0 ** -30 * fmax, fmax + fmax_ulp / 4,
          fmax + fmax_ulp, 2 * fmax, 1e300, 5e-324, 1e-300, float("inf"), float("nan"),
          np.nextafter(fmax + fmax_ulp / 2, 0), np.nextafter(fmax + fmax_ulp / 2, np.inf)]
    return np.array(xs + [-x for x in xs], np.float64)


@pytest.mark.parametrize("name", NAMES)
def test_round_to_is_the_exact_rounding_on_edge_values(name):
    xs = _edges(name)
    got = round_to(xs, getattr(ml_dtypes, name))
    assert got.dtype == np.dtype(getattr(ml_dtypes, name))
    want = [oracle(float(x), name) for x in xs]
    bad = [(float(x), float(g), w) for x, g, w in zip(xs, got.astype(np.float64), want) if not _same(g, w)]
    assert not bad, bad[:8]


def test_the_double_rounding_case_of_the_issue():
    x = 1 + 2.0 ** -8 + 2.0 ** -30
    assert float(round_to(np.float64(x), ml_dtypes.bfloat16)) == 1.0078125
    assert float(round_to(np.array([x, -x]), ml_dtypes.bfloat16)[1]) == -1.0078125
    # through float32, as ml_dtypes before 0.7 rounds: a tie, to even
    assert float(np.float32(x).astype(ml_dtypes.bfloat16)) == 1.0


def test_the_oracle_catches_a_double_rounding(monkeypatch):
    """The oracle is not round_to's mirror: it tells the float32 route from the right one."""
    x = 1 + 2.0 ** -8 + 2.0 ** -30
    assert oracle(x, "bfloat16") == 1.0078125
    assert oracle(float(np.float32(x)), "bfloat16") == 1.0
    assert oracle(464.0, "float8_e4m3fn") == 448.0 and np.isnan(oracle(465.0, "float8_e4m3fn"))
    assert oracle(61440.0, "float8_e5m2") == float("inf") and oracle(61439.0, "float8_e5m2") == 57344.0


@pytest.mark.parametrize("name", NAMES)
def test_round_to_against_the_oracle_and_ml_dtypes_0_7_on_random_values(name):
    rng = np.random.default_rng(40)
    m, emin, fmax, _ = FORMATS[name]
    e = rng.integers(emin - m - 3, int(np.log2(fmax)) + 3, 3000)
    xs = rng.standard_normal(3000) * np.ldexp(1.0, e)
    # ties and near-ties, where a second rounding bites: the format's midpoints moved by less than float32's ulp
    mids = np.ldexp(rng.integers(1 << m, 1 << (m + 1), 1000) * 2 + 1.0, rng.integers(emin, 4, 1000) - m - 1)
    xs = np.concatenate([xs, mids, mids * (1 + 2.0 ** -30), mids * (1 - 2.0 ** -30)])
    got = round_to(xs, getattr(ml_dtypes, name))
    want = [oracle(float(x), name) for x in xs[:2000]] + [oracle(float(x), name) for x in xs[-1000:]]
    assert _same(np.concatenate([got[:2000], got[-1000:]]).astype(np.float64), want)
    if _version(ml_dtypes.__version__) >= (0, 7):
        with np.errstate(over="ignore"):
            ref = xs.astype(getattr(ml_dtypes, name))
        assert _same(got.astype(np.float64), ref.astype(np.float64))
        fin = np.isfinite(ref.astype(np.float64))
        assert np.array_equal(got[fin].view(np.uint8 if got.itemsize == 1 else np.uint16),
                              ref[fin].view(np.uint8 if got.itemsize == 1 else np.uint16))


def test_round_to_takes_float32_float16_and_ints_and_leaves_other_dtypes_to_numpy():
    x = np.array([1 + 2.0 ** -8 + 2.0 ** -20, 3.0], np.float32)
    assert float(round_to(x, ml_dtypes.bfloat16)[0]) == 1.0078125
    assert round_to(np.array([3, -5]), ml_dtypes.float8_e4m3fn).astype(float).tolist() == [3.0, -5.0]
    assert round_to(np.float16(1.5), ml_dtypes.float8_e5m2).astype(float) == 1.5
    y = np.array([0.1, 1e-40])
    assert np.array_equal(round_to(y, np.float32), y.astype(np.float32))
    b = round_to(x, ml_dtypes.bfloat16)
    assert round_to(b, ml_dtypes.bfloat16, copy=False) is b
    with pytest.raises(TypeError, match="`x` should be a real array"):
        round_to(np.array([1j]), ml_dtypes.bfloat16)


def test_the_package_rounds_with_it_where_it_casts_to_bfloat16():
    """The API's bfloat16 output: its float64 result rounded once (as round_to does), not through float32."""
    import sdpa_ref
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 5, 8)).astype(ml_dtypes.bfloat16) for _ in range(3))
    out = sdpa_ref.scaled_dot_product_attention(q, k, v)
    ref = sdpa_ref.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, k, v)))
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    want = np.array([oracle(float(x), "bfloat16") for x in np.asarray(ref, np.float64).ravel()])
    assert _same(out.astype(np.float64), want.reshape(ref.shape))


# ------------------------------------------------------------------ the oldest versions, and no compiler


def _lower_bounds():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    reqs = cfg["options"]["install_requires"].split() + cfg["options.extras_require"]["test"].split()
    return {m.group(1).lower().replace("_", "-"): m.group(2)
            for m in (re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)$", r.strip()) for r in reqs) if m}


def test_oldest_txt_pins_exactly_the_lower_bounds_of_setup_cfg():
    pins = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    assert pins == _lower_bounds()


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler: nothing to skip")
def test_sdpa_ref_no_compile_builds_nothing_and_says_why(tmp_path):
    """``SDPA_REF_NO_COMPILE=1`` (setup.py): no library, and a record saying it was asked not to build."""
    for f in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, tmp_path / f)
    (tmp_path / "sdpa_ref" / "exact").mkdir(parents=True)
    for f in ("__init__.py", "_version.py"):                    # setup.cfg reads the version from _version.py
        shutil.copy(ROOT / "sdpa_ref" / f, tmp_path / "sdpa_ref" / f)
    for f in ("_kernels.c", "_kernels.h", "_fast_rows.c", "_fast_rows.h"):
        shutil.copy(ROOT / "sdpa_ref" / "exact" / f, tmp_path / "sdpa_ref" / "exact" / f)
    (tmp_path / "sdpa_ref" / "exact" / "__init__.py").write_text("")
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, SDPA_REF_NO_COMPILE="1"))
    assert run.returncode == 0, run.stderr[-2000:]
    exact = tmp_path / "sdpa_ref" / "exact"
    assert not (exact / "_compiled_kernels.so").exists()
    record = json.loads((exact / "_compiled_kernels.json").read_text())
    assert record["built"] is False and "SDPA_REF_NO_COMPILE" in record["reason"]
    assert "SDPA_REF_NO_COMPILE" in run.stderr


def test_round_to_rounds_integers_past_2_53_once():
    """An int64 or uint64 beyond 2**53 is not a float64: through float64 first it was rounded twice, so a value
    just past a midpoint of the target (2**62 + 2**54 + 1 for bfloat16) became a tie and went to even (2**62,
    not 2**62 + 2**55). Against the exact oracle on the integers themselves, near every midpoint. (Only bfloat16
    reaches that far; every fp8 overflows long before 2**53.)"""
    name = "bfloat16"
    m = FORMATS[name][0]
    rng = np.random.default_rng(53)
    ints, uints = [], []
    for top in (53, 54, 60, 62):
        for _ in range(40):
            lead = int(rng.integers(1 << m, 1 << (m + 1)))
            mid = (2 * lead + 1) << (top - m - 1)                # a midpoint of the target at 2**top
            ints += [mid, mid + 1, mid - 1, -(mid + 1), -(mid - 1), mid + int(rng.integers(1, 1 << 10))]
    for top in (63,):
        for _ in range(40):
            lead = int(rng.integers(1 << m, 1 << (m + 1)))
            mid = (2 * lead + 1) << (top - m - 1)
            uints += [mid, mid + 1, mid - 1, min(mid + int(rng.integers(1, 1 << 10)), 2 ** 64 - 1)]
    ints += [2 ** 63 - 1, -2 ** 63, 2 ** 53 + 1, -(2 ** 53 + 1), 0, 1, -1]
    uints += [2 ** 64 - 1, 2 ** 63, 0]
    for xs, dt in ((ints, np.int64), (uints, np.uint64), (ints[:40], np.int32)):
        xs = [x for x in xs if np.iinfo(dt).min <= x <= np.iinfo(dt).max]
        got = round_to(np.array(xs, dt), getattr(ml_dtypes, name))
        assert _same(got, [oracle(x, name) for x in xs]), [
            (x, float(g), oracle(x, name)) for x, g in zip(xs, got.astype(float)) if not _same(g, oracle(x, name))][:5]
