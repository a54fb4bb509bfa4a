"""The tiled path (FlashAttention's algorithm) equals the dense path, in bounded memory."""

import itertools
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdpa_ref import scaled_dot_product_attention, sdpa_backward, sdpa_forward, sdpa_jvp
from sdpa_ref.harness.grid import gradcheck_grid as attention_cases
from sdpa_ref.harness.selfcheck import differentiable_inputs as make_attention_inputs
from sdpa_ref.engines.blocks import auto_block_size

from helpers import assert_close_normwise
from strategies import variant_problem
from tolerances import F64_AMPLIFIED, F64_GRAD, F64_GRAD_LONG, F64_REGROUPED, F64_SUMS


def _close(x, y, rtol=F64_GRAD):
    assert_close_normwise(x, y, rtol)


def _compare(q, k, v, opts, block):
    out, res = sdpa_forward(q, k, v, **opts)
    out_t, res_t = sdpa_forward(q, k, v, block_size=block, **opts)
    assert res_t.probs is None and res_t.block_size == block
    _close(out, out_t)
    np.testing.assert_array_equal(res.lse == -np.inf, res_t.lse == -np.inf)
    _close(np.where(np.isinf(res.lse), 0, res.lse), np.where(np.isinf(res_t.lse), 0, res_t.lse))
    g = np.random.default_rng(0).standard_normal(out.shape)
    for a, b in zip(sdpa_backward(res, g), sdpa_backward(res_t, g)):
        _close(a, b)
    rng = np.random.default_rng(1)                       # forward mode: the core's JVP on P, and block by block
    ts = [rng.standard_normal(np.shape(x)) for x in (q, k, v)]
    for extra in ("bias", "sinks"):
        ts.append(None if opts.get(extra) is None else rng.standard_normal(np.shape(opts[extra])))
    _close(sdpa_jvp((q, k, v), tuple(ts), **opts)[1], sdpa_jvp((q, k, v), tuple(ts), block_size=block, **opts)[1])


@given(variant_problem(max_len=7), st.sampled_from([1, 2, 3, 5, 64]))
def test_tiled_equals_dense_on_random_option_combinations(problem, block):
    q, k, v, opts, _ = problem
    _compare(q, k, v, opts, block)


@pytest.mark.parametrize("case", [c for c in attention_cases(quick=True)], ids=lambda c: c.name)
def test_tiled_equals_dense_over_the_check_grid(case):
    q, k, v, fmask, bias, opts = make_attention_inputs(case)
    opts = dict(opts, bias=bias)
    if fmask is not None:
        opts["attn_mask"] = fmask
    for block in (1, 2, 100):          # block size 1, sizes that do not divide L or S, larger than both
        _compare(q, k, v, opts, block)


def test_block_size_auto_and_validation():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 2, 40, 8)), rng.standard_normal((1, 2, 50, 8)), rng.standard_normal((1, 2, 50, 4))
    a = scaled_dot_product_attention(q, k, v, is_causal=True)
    b = scaled_dot_product_attention(q, k, v, is_causal=True, block_size="auto")
    np.testing.assert_allclose(a, b, rtol=F64_SUMS, atol=F64_REGROUPED)
    for bad in (0, -3, 2.5, "big", True):
        with pytest.raises(ValueError, match="`block_size`"):
            sdpa_forward(q, k, v, block_size=bad)
    _, res = sdpa_forward(q, k, v, block_size=16)
    with pytest.raises(ValueError, match="`method`"):
        sdpa_backward(res, np.ones((1, 2, 40, 4)), method="probs")


def test_auto_block_size_follows_the_budget():
    from sdpa_ref.options import AttentionOptions
    from sdpa_ref.problem import Problem

    def build(shape):
        return Problem.build(np.zeros(shape), np.zeros(shape), np.zeros(shape), AttentionOptions())

    # the block depends on the heads, the lengths and the dtype, not on E: E = 1 keeps the problems small
    small, big, many = build((1, 1, 64, 8)), build((1, 1, 16384, 1)), build((4, 16, 16384, 1))
    assert auto_block_size(small) == 64                    # capped by the sequence
    assert 512 <= auto_block_size(big) <= 2048 and auto_block_size(big) % 16 == 0
    assert auto_block_size(many) < auto_block_size(big)


def test_tiled_path_allocates_nothing_of_size_L_times_S():
    # L = S = 2048, one head: a score matrix would be 32 MiB; the tiled path
    # must stay far below it (inputs, outputs and grads are 0.5 MiB each).
    rng = np.random.default_rng(2)
    L = S = 2048
    q, k, v = rng.standard_normal((1, L, 32)), rng.standard_normal((1, S, 32)), rng.standard_normal((1, S, 32))
    g = rng.standard_normal((1, L, 32))
    dense_bytes = L * S * 8
    tracemalloc.start()
    try:
        out, res = sdpa_forward(q, k, v, is_causal=True, window=(300, None), block_size=128)
        grads = sdpa_backward(res, g)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < dense_bytes / 4, f"peak {peak / 2**20:.1f} MiB"
    # and it is right: compare a slice with the dense path on the same rows
    ref = scaled_dot_product_attention(q[:, :256], k, v, is_causal=True, window=(300, None))
    np.testing.assert_allclose(out[:, :256], ref, rtol=F64_AMPLIFIED, atol=F64_SUMS)
    assert np.isfinite(grads.key).all()
    tracemalloc.start()                                  # forward mode too: no L x S array
    try:
        _, dout = sdpa_jvp((q, k, v), (g, g, g), is_causal=True, window=(300, None), block_size=128)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < dense_bytes / 4, f"JVP peak {peak / 2**20:.1f} MiB"
    _, ref_t = sdpa_jvp((q[:, :256], k, v), (g[:, :256], g, g), is_causal=True, window=(300, None))
    np.testing.assert_allclose(dout[:, :256], ref_t, rtol=F64_GRAD_LONG, atol=F64_GRAD)


@given(variant_problem(max_len=6), st.sampled_from([1, 4]))
def test_tiled_and_fast_paths_never_write_into_the_inputs(problem, block):
    q, k, v, opts, _ = problem
    arrays = {"q": q, "k": k, "v": v, **{n: a for n, a in opts.items() if isinstance(a, np.ndarray)}}
    before = {n: a.copy() for n, a in arrays.items()}
    for kw in ({"block_size": block}, {}, {"method": "plain"}):
        out, res = sdpa_forward(q, k, v, **kw, **opts)
        g = np.ones_like(out)
        sdpa_backward(res, g)
        assert (g == 1).all()
    for n, a in arrays.items():
        np.testing.assert_array_equal(a, before[n], err_msg=n)


@pytest.mark.parametrize("opts", [{"is_causal": True}, {}, {"softcap": 3.0, "sinks": np.ones(4)},
                                  {"window": (40, 10), "alibi_slopes": np.linspace(0.1, 0.4, 4)},
                                  {"attn_mask": np.triu(np.ones((300, 300), bool), -50)}],
                         ids=["causal", "none", "softcap-sinks", "window-alibi", "bool-mask"])
def test_tiled_blocks_of_rows_give_the_same_bits_on_any_number_of_threads(monkeypatch, opts):
    # the blocks of rows run side by side; what they add to dk and dv is added in the blocks' order, and a block's
    # rows are its own: one thread and three give the same bits (the dense path checks itself elsewhere)
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((2, 4, 300, 16)) for _ in range(4))
    got = {}
    for n in ("1", "2", "3"):
        monkeypatch.setenv("SDPA_REF_NUM_THREADS", n)
        out, res = sdpa_forward(q, k, v, block_size=64, **opts)
        gr = sdpa_backward(res, g)
        _, t = sdpa_jvp((q, k, v), (g, g, g), block_size=64, **opts)
        got[n] = [out, res.lse, gr.query, gr.key, gr.value, t]
    for n in ("2", "3"):
        for a, b in zip(got["1"], got[n]):
            np.testing.assert_array_equal(a, b)


def test_a_block_of_rows_with_a_nan_row_recomputes_its_blocks_and_agrees_with_the_dense_path():
    # the second sweep reuses the first sweep's P, except in a block of rows with a NaN row (its P is NaN on every
    # key it reads, in every key block): those blocks are recomputed from the row's normaliser; both ways agree
    # with the dense path on the other rows, and the NaN pattern is the dense one
    rng = np.random.default_rng(9)
    q, k, v, g = (rng.standard_normal((1, 2, 96, 8)) for _ in range(4))
    q[0, 1, 5, 3] = np.nan                               # head 1, row 5: NaN scores in every key block it reads

    def nan_one(score, b, h, i, j):                     # row 40: NaN on key 30 alone, in one of its key blocks
        return np.where((i == 40) & (j == 30), np.nan, score)
    for opts, mod in itertools.product(({"is_causal": True}, {"window": (30, 5)}, {"sinks": np.array([0.5, -1.0])}),
                                       (None, nan_one)):
        opts = dict(opts, score_mod=mod, **({"is_causal": True} if mod is not None and "window" not in opts else {}))
        _, rd = sdpa_forward(q, k, v, **opts)
        _, rt = sdpa_forward(q, k, v, block_size=32, **opts)
        gd, gt = sdpa_backward(rd, g), sdpa_backward(rt, g)
        for a, b in ((gd.query, gt.query), (gd.key, gt.key), (gd.value, gt.value)):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            ok = ~np.isnan(a)
            assert ok.any()
            _close(a[ok], b[ok])
