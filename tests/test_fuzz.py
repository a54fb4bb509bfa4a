"""A hypothesis fuzz of the public attention API (issue 12): on any input, nothing but ValueError or TypeError
escapes, no input is written into, and on valid input every engine agrees."""

import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref

from helpers import assert_close_normwise
from tolerances import F64_AMPLIFIED, F64_GRAD

_BAD_SCALARS = [None, -1, 0, 1, 2**63, -2**70, 0.5, -0.5, 1e308, float("nan"), float("inf"), "x", "", b"x", [],
                [1], (1, 2), (1, 2, 3), {1, 2}, {"a": 1}, True, False, np.float32(1), np.int64(3), 1j]


@st.composite
def _array(draw, shape):
    kind = draw(st.sampled_from(["f64", "f64", "f64", "f32", "f16", "int", "bool", "complex", "object", "nan"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    a = rng.standard_normal(shape)
    if kind == "f32":
        return a.astype(np.float32)
    if kind == "f16":
        return a.astype(np.float16)
    if kind == "int":
        return a.astype(np.int64)
    if kind == "bool":
        return a > 0
    if kind == "complex":
        return a + 1j
    if kind == "object":
        return a.astype(object)
    if kind == "nan":
        a = a.copy()
        if a.size:
            a.flat[0] = np.nan
        return a
    return a


@st.composite
def _call(draw):
    B, H, L, S, E = (draw(st.integers(0 if i in (2, 3) else 1, 4)) for i in range(5))
    shapes = [(B, H, L, E), (B, H, S, E), (B, H, S, E)]
    if draw(st.booleans()):                                          # sometimes a mismatch
        i = draw(st.integers(0, 2))
        shapes[i] = tuple(max(0, d + draw(st.integers(-1, 1))) for d in shapes[i])
    q, k, v = (draw(_array(s)) for s in shapes)
    opts = {}
    pool = {
        "is_causal": st.sampled_from([True, False] + _BAD_SCALARS),
        "scale": st.sampled_from([None, 0.3, 1.0] + _BAD_SCALARS),
        "dropout_p": st.sampled_from([0.0, 0.25] + _BAD_SCALARS),
        "softcap": st.sampled_from([None, 2.0, 5e-324] + _BAD_SCALARS),
        "window": st.sampled_from([None, (1, 0), (None, 2), (-1, -1)] + _BAD_SCALARS),
        "fully_masked": st.sampled_from(["zero", "nan", "uniform"] + _BAD_SCALARS),
        "causal_alignment": st.sampled_from(["top_left", "bottom_right"] + _BAD_SCALARS),
        "enable_gqa": st.sampled_from([True, False] + _BAD_SCALARS),
        "attn_mask": st.one_of(st.none(), _array((L, S)), st.sampled_from(_BAD_SCALARS)),
        "bias": st.one_of(st.none(), _array((L, S)), st.sampled_from(_BAD_SCALARS)),
        "q_lengths": st.sampled_from([None, [L] * B, [0] * B, [L + 1] * B] + _BAD_SCALARS),
        "kv_lengths": st.sampled_from([None, [S] * B, [max(S - 1, 0)] * B] + _BAD_SCALARS),
        "rng": st.sampled_from([None, 0, 3, -1, "x"]),
    }
    for name in draw(st.lists(st.sampled_from(sorted(pool)), unique=True, max_size=4)):
        opts[name] = draw(pool[name])
    if "dropout_p" in opts and "rng" not in opts:
        opts["rng"] = 0                                               # deterministic across the engines
    return q, k, v, opts


def _snapshot(x):
    return x.copy() if isinstance(x, np.ndarray) else x


@settings(max_examples=60, deadline=None)
@given(_call())
def test_fuzzed_calls_raise_only_clear_errors_mutate_nothing_and_agree(call):
    q, k, v, opts = call
    before = [_snapshot(a) for a in (q, k, v, *opts.values())]
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                              # NaN inputs warn; that is not the point
        for how in ("fast", "plain", "tiled"):
            try:
                out, res = sdpa_ref.sdpa_forward(q, k, v, method=how, **opts)
                g = np.ones(out.shape, dtype=out.dtype)
                grads = sdpa_ref.sdpa_backward(res, g)
            except (ValueError, TypeError) as exc:
                results[how] = type(exc)
                continue
            results[how] = (out, grads)
    after = [a for a in (q, k, v, *opts.values())]
    for x, y in zip(before, after):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"), "an input was mutated"
    kinds = {how: (r if isinstance(r, type) else "ok") for how, r in results.items()}
    assert len(set(kinds.values())) == 1, kinds                       # the engines accept and refuse alike
    if kinds["fast"] != "ok":
        return
    ref_out, ref_grads = results["plain"]
    if not np.all(np.isfinite(ref_out)) or ref_out.dtype != np.float64:
        return                                                       # NaN policies and low precision: elsewhere
    for how in ("fast", "tiled"):
        out, grads = results[how]
        assert_close_normwise(out, ref_out, F64_AMPLIFIED)
        for a, b in zip(grads, ref_grads):
            if a is not None and np.all(np.isfinite(b)):
                assert_close_normwise(a, b, F64_GRAD)
