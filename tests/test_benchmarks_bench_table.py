"""The benchmark table (benchmarks/bench_table.py): each cell's two contenders compute the attention its allowed set
defines, the bound counts the allowed tiles, and the results print and draw."""

import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

from tolerances import F64_GRAD_ORACLE, F64_SUMS

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_table.py"
SIZES = (1, 4, 2, 8)                 # B, Hq, Hkv, E: small, with GQA's sharing where the case takes it


@pytest.fixture(scope="module")
def bench():
    if not PATH.exists():
        pytest.skip("benchmarks/ not shipped beside the tests")
    sys.path.insert(0, str(PATH.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_table", PATH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(PATH.parent))
    return mod


def _oracle_out(q, k, v, keep):
    """Attention written plainly, one (batch, head, row) at a time: q (B, Hq, L, E), k and v (B, Hkv, S, E)."""
    B, Hq, L, E = q.shape
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for b in range(B):
        for h in range(Hq):
            kh = h * k.shape[1] // Hq
            for i in range(L):
                s = np.array([q[b, h, i] @ k[b, kh, j] / np.sqrt(E) if keep[i, j] else -np.inf
                              for j in range(k.shape[2])])
                p = np.exp(s - s.max())
                out[b, h, i] = (p / p.sum()) @ v[b, kh]
    return out


def _close(got, want, tol=F64_SUMS):
    assert np.max(np.abs(got - want)) <= tol * max(1.0, np.max(np.abs(want)))


@pytest.mark.parametrize("case", ["none", "causal", "window", "gqa", "decode", "varlen"])
def test_our_contender_computes_the_allowed_set_the_bound_counts(bench, case):
    L = 24
    sizes = (1, 8, 2, 8) if case == "decode" else (SIZES if case == "gqa" else (1, 2, 2, 8))
    # the same draws problem() makes, rebuilt here in the plain layout
    fns = bench.problem(case, "float64", L, sizes=sizes)
    got = fns["ours"]()[0]
    rng = np.random.default_rng(0)
    B, Hq, Hkv, E = sizes
    keep = bench.allowed(case, L)
    if case == "decode":
        pages = -(-L // bench.PAGE_SIZE)
        q = rng.standard_normal((B, 1, Hq, E))
        kc, vc = (rng.standard_normal((pages, bench.PAGE_SIZE, Hkv, E)) for _ in range(2))
        table = rng.permutation(pages)
        k, v = (c[table].reshape(1, -1, Hkv, E)[:, :L].transpose(0, 2, 1, 3) for c in (kc, vc))
        want = _oracle_out(q.transpose(0, 2, 1, 3), k, v, keep).transpose(0, 2, 1, 3)
    elif case == "varlen":
        q, k, v = (rng.standard_normal((L, Hq, E)) for _ in range(3))
        want = _oracle_out(*(a.transpose(1, 0, 2)[None] for a in (q, k, v)), keep)[0].transpose(1, 0, 2)
    else:
        q = rng.standard_normal((B, Hq, L, E))
        rng.standard_normal((B, Hq, L, E))                   # g
        k, v = (rng.standard_normal((B, Hkv, L, E)) for _ in range(2))
        want = _oracle_out(q, k, v, keep)
    _close(got, want)


@pytest.mark.parametrize("case", ["none", "causal", "window", "gqa", "decode", "varlen"])
def test_both_contenders_compute_the_same_thing(bench, case):
    pytest.importorskip("torch")
    sizes = (1, 8, 2, 8) if case == "decode" else (SIZES if case == "gqa" else (1, 2, 2, 8))
    fns = bench.problem(case, "float64", 40, sizes=sizes)
    for got, want in zip(fns["ours"](), fns["torch"]()):
        _close(got, want, F64_GRAD_ORACLE)


def test_the_fractions_count_allowed_scores_and_tiles(bench):
    assert bench.fractions("none", 128) == (1.0, 1.0)
    exact, tiles = bench.fractions("causal", 128)
    assert exact == pytest.approx(129 / 256) and tiles == 0.75          # 3 of the 4 tiles of 64
    exact, tiles = bench.fractions("causal", 100)                       # a partial last tile: 64 + 36 rows
    assert tiles == pytest.approx((64 * 64 + 36 * 64 + 36 * 36) / 100 ** 2)
    # the window of L // 4 = 256 keys at L = 1024: each row's tiles by a loop
    keep = bench.allowed("window", 1024)
    assert keep[600, 600 - 256] and not keep[600, 600 - 257] and not keep[600, 601]
    want = sum(keep[i * 64:(i + 1) * 64, j * 64:(j + 1) * 64].any() for i in range(16) for j in range(16)) / 256
    assert bench.fractions("window", 1024)[1] == pytest.approx(want)
    assert bench.varlen_lengths(1000) == [125, 250, 375, 250]
    assert bench.fractions("varlen", 128)[0] == pytest.approx(sum(n * (n + 1) / 2 for n in (16, 32, 48, 32)) / 128**2)
    with pytest.raises(ValueError, match="`case` should be one of"):
        bench.allowed("diagonal", 8)


def test_the_ratios_are_taken_within_each_round(bench):
    times = {"ours": [2.0, 4.0, 3.0], "torch": [1.0, 4.0, 1.0]}
    assert bench.ratio(times, "ours", "torch") == (2.0, 1.0, 3.0)
    assert bench.ratio(times, "ours", "bound") is None


def _result(bench):
    cell = {"case": "causal", "dtype": "float64", "L": 128, "dims": [1, 8, 8, 64], "allowed": 0.5,
            "allowed_blocks": 0.75, "ours_s": 0.002, "torch_s": 0.001, "ours_over_torch": (2.0, 1.5, 2.5),
            "ours_over_bound": (1.2, 1.1, 1.3)}
    other = dict(cell, dtype="float32", torch_s=None, ours_over_torch=None)
    return {"date": "2026-01-01 00:00 UTC", "machine": "a test machine", "threads": 2, "rounds": 3, "quick": True,
            "versions": {"sdpa_ref": "0", "numpy": np.__version__, "torch": None, "python": "3"},
            "cells": [cell, other],
            "overhead": [{"shape": "2x2x16x8", "causal": True, "ours_s": 1e-3, "torch_s": 2e-4,
                          "ours_over_torch": (5.0, 4.0, 6.0)}],
            "second_order": [{"shape": "1x4x512x64", "ours_s": 0.5, "torch_s": 0.4, "ours_first_order_s": 0.1,
                              "ours_over_torch": (1.25, 1.2, 1.3), "ours_over_first_order": (5.0, 5.0, 5.0)}]}


def test_the_table_prints_every_measurement(bench):
    text = bench.format_table(json.loads(json.dumps(_result(bench))))      # as read back from a results file
    assert "2026-01-01 00:00 UTC; a test machine" in text
    assert "causal           float64    128  1,8,8,64       0.500      2.00      1.00  2.00 (1.50-2.50)" in text
    assert "1.20 (1.10-1.30)" in text and "float32" in text
    assert "2x2x16x8   causal   ours 1.000 ms, torch 0.200 ms; ours / torch 5.00 (4.00-6.00)" in text
    assert "1x4x512x64   ours 500.0 ms, torch 400.0 ms; ours / torch 1.25" in text


def test_the_figure_is_drawn_from_a_results_file(bench, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "table.png"
    bench.figure(_result(bench), str(path))
    assert path.stat().st_size > 1000
