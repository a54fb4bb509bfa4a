"""Excluded positions are never read (issue 12, part 3): a NaN or inf reaches exactly the results that depend on it.

The oracle is independent of the package's read sets: a result *depends* on an input entry when changing that entry
to another finite value changes the result. With the entry set to NaN (or inf), the results that depend on it must be
NaN, and every other result must have the bits it has with clean memory -- on every engine and precision.
"""

import numpy as np
import pytest

import sdpa_ref
from tolerances import EXACT

B, HQ, HKV, L, S, E = 1, 4, 2, 4, 6, 3
SETTINGS = {
    # causal bottom-right with lengths, GQA, a bias and a dropout mask: rows exclude different keys
    "causal-lengths-gqa-bias-dropout": dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True,
                                            q_lengths=[3], kv_lengths=[5], bias=True, dropout=True),
    # a window and a bool mask with a fully masked row, under "uniform"; softcap
    "window-mask-uniform-softcap": dict(window=(1, 1), mask=True, enable_gqa=True, fully_masked="uniform",
                                        softcap=3.0, bias=True),
    # the same with "zero" on a top-left causal mask
    "causal-mask-zero": dict(is_causal=True, mask=True, enable_gqa=True, bias=True),
}
HOWS = {"fast": dict(method="fast"), "plain": dict(method="plain"), "tiled": dict(block_size=2),
        "reproducible": dict(precision="reproducible")}


def _problem(setting):
    rng = np.random.default_rng(sorted(SETTINGS).index(setting))
    o = dict(SETTINGS[setting])
    arrays = {"query": rng.standard_normal((B, HQ, L, E)), "key": rng.standard_normal((B, HKV, S, E)),
              "value": rng.standard_normal((B, HKV, S, E)), "grad_out": rng.standard_normal((B, HQ, L, E))}
    if o.pop("bias", False):
        arrays["bias"] = rng.standard_normal((HQ, L, S))
    if o.pop("mask", False):
        m = rng.random((L, S)) < 0.7
        m[2] = False                                              # a fully masked row
        o["attn_mask"] = m
    if o.pop("dropout", False):
        o.update(dropout_mask=rng.random((B, HQ, L, S)) < 0.8, dropout_p=0.2)
    for n in ("q_lengths", "kv_lengths"):
        if n in o:
            o[n] = np.array(o[n])
    return arrays, o


def _results(how, arrays, opts):
    a = dict(arrays)
    g = a.pop("grad_out")
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    kw = dict(opts, **a, **HOWS[how])
    out, res = sdpa_ref.sdpa_forward(q, k, v, **kw)
    gr = sdpa_ref.sdpa_backward(res, g)
    got = {"out": out, "lse": res.lse, "dq": gr.query, "dk": gr.key, "dv": gr.value}
    if gr.bias is not None:
        got["dbias"] = gr.bias
    return got


def _jvp(how, arrays, tangents, opts):
    a = dict(arrays)
    a.pop("grad_out")
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    kw = dict(opts, **a, **HOWS[how])
    return {"jvp": sdpa_ref.sdpa_jvp((q, k, v), tangents, **kw)[1]}


def _positions(shape, rng, n):
    """``n`` positions of an array of ``shape``: every row (the second-to-last axis) at a random head and column."""
    rows = rng.choice(shape[-2], size=min(n, shape[-2]), replace=False)
    return [tuple(int(rng.integers(d)) for d in shape[:-2]) + (int(r), int(rng.integers(shape[-1]))) for r in rows]


def _check(clean, perturbed, poisoned, what):
    for name in clean:
        depends = ~np.isclose(perturbed[name], clean[name], rtol=EXACT, atol=EXACT, equal_nan=True)
        assert np.array_equal(np.isnan(poisoned[name]), depends | np.isnan(clean[name])), (
            f"{what}: NaN in {name} at {np.argwhere(np.isnan(poisoned[name]) != (depends | np.isnan(clean[name])))}")
        keep = ~np.isnan(poisoned[name])
        np.testing.assert_array_equal(poisoned[name][keep], clean[name][keep], err_msg=f"{what}: {name}")


@pytest.mark.parametrize("how", list(HOWS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_poison_reaches_exactly_what_depends_on_it(setting, how):
    arrays, opts = _problem(setting)
    rng = np.random.default_rng(11)
    clean = _results(how, arrays, opts)
    for name in arrays:
        for i, pos in enumerate(_positions(arrays[name].shape, rng, 6 if name in ("key", "value") else 3)):
            for bad in ((np.nan, np.inf)[i % 2],):
                changed = {n: a.copy() for n, a in arrays.items()}
                changed[name][pos] += 0.75
                poisoned = {n: a.copy() for n, a in arrays.items()}
                poisoned[name][pos] = bad
                _check(clean, _results(how, changed, opts), _results(how, poisoned, opts),
                       f"{how}, {name}{pos} = {bad}")


@pytest.mark.parametrize("how", ["fast", "plain", "tiled", "reproducible"])
def test_a_poisoned_tangent_or_primal_reaches_exactly_the_jvp_entries_that_depend_on_it(how):
    arrays, opts = _problem("causal-lengths-gqa-bias-dropout")
    rng = np.random.default_rng(12)
    tangents = [rng.standard_normal(arrays[n].shape) for n in ("query", "key", "value", "bias")]
    clean = _jvp(how, arrays, tangents, opts)
    for which in range(8):                                 # four tangents, then four primals
        shape = tangents[which % 4].shape
        for pos in _positions(shape, rng, 2):
            ch_t, po_t = [t.copy() for t in tangents], [t.copy() for t in tangents]
            ch_a, po_a = ({n: a.copy() for n, a in arrays.items()} for _ in range(2))
            if which < 4:
                ch_t[which][pos] += 0.75
                po_t[which][pos] = np.nan
            else:
                n = ("query", "key", "value", "bias")[which - 4]
                ch_a[n][pos] += 0.75
                po_a[n][pos] = np.inf
            _check(clean, _jvp(how, ch_a, ch_t, opts), _jvp(how, po_a, po_t, opts), f"{how}: #{which} at {pos}")


def test_a_clean_problem_carries_no_poison_record():
    arrays, opts = _problem("causal-mask-zero")
    _, res = sdpa_ref.sdpa_forward(arrays["query"], arrays["key"], arrays["value"], bias=arrays["bias"], **opts)
    assert res.problem.poison is None and res.taint is None


@pytest.mark.parametrize("how", list(HOWS))
def test_a_poisoned_row_of_one_batch_entry_leaves_the_shared_gradients_of_the_others_alone(how):
    # keys and values broadcast over the batch: the reproducible engine sums their gradients to their own shape
    # itself, and the NaN pattern has to be summed down the same way (it used to broadcast them back: twice dV)
    rng = np.random.default_rng(13)
    q, g = rng.standard_normal((2, 1, 3, 2)), rng.standard_normal((2, 1, 3, 2))
    k, v = rng.standard_normal((1, 1, 3, 2)), rng.standard_normal((1, 1, 3, 2))
    res = sdpa_ref.sdpa_forward(q, k, v, **HOWS[how])[1]
    clean = sdpa_ref.sdpa_backward(res, g)
    g[1, 0, 2, 0] = np.nan                                  # reaches dV's column 0 only
    got = sdpa_ref.sdpa_backward(res, g)
    assert np.isnan(got.value[..., 0]).all()
    np.testing.assert_array_equal(got.value[..., 1], clean.value[..., 1])
