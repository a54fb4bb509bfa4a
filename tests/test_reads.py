"""The arithmetic of reads (sdpa_ref.reads): its rules, and the NaN pattern it derives held to SEMANTICS.md's table.

The package computes which results read a non-finite input by running its dense schedule over this arithmetic; no
second model of the data flow exists in it. The oracle here is that second model, written from the table in
SEMANTICS.md ("Excluded positions are never read") with plain loops, sharing nothing with the package: over
hypothesis draws of every option, the results that are NaN must be exactly those the table names, and every other
result must have the bits of the clean run. Wrong rules of the arithmetic must fail the same check.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref
from sdpa_ref.reads import Reads, ReadsArith

R = ReadsArith()


def _r(v, t=False, z=None):
    v = np.asarray(v, float)
    return Reads(v, np.broadcast_to(t, v.shape).copy(), None if z is None else np.broadcast_to(z, v.shape).copy())


# ------------------------------------------------------------ the rules


def test_a_structural_zero_stops_what_a_product_reads_and_nothing_else_does():
    poisoned, zero = _r([1.0, 2.0], [True, False]), R.const(0.0)
    assert R.result(R.mul(poisoned, zero)).tolist() == [False, False]           # 0 * NaN never happens
    assert R.result(R.mul(poisoned, _r([0.0, 0.0]))).tolist() == [True, False]  # an input that is 0 is no structure
    assert R.result(R.add(poisoned, zero)).tolist() == [True, False]
    assert R.result(R.div(zero, poisoned)).tolist() == [False, False]
    assert R.result(R.div(poisoned, _r([1.0, 1.0], True))).tolist() == [True, True]
    assert R.result(R.exp_minus(_r([0.0, 0.0]), poisoned)).tolist() == [True, False]
    w = R.where(np.array([True, False]), zero, poisoned)
    assert R.result(w).tolist() == [False, False] and w.z.tolist() == [True, False]


def test_a_sum_and_a_product_read_every_term_that_is_not_a_structural_zero():
    P = R.where(np.array([[True, False, True]]), R.lift(np.full((1, 3), 0.5)), R.const(0.0))   # a masked row
    V = _r(np.ones((3, 2)), [[False, False], [True, False], [False, True]])
    assert R.result(R.matmul(P, V)).tolist() == [[False, True]]                  # key 1 is masked: never read
    assert R.result(R.sum(R.mul(P, _r(np.ones((1, 3)), [[False, True, False]])))).tolist() == [False]
    dropped = R.div_masked(_r(np.ones((1, 3)), True), np.array([[True, False, True]]), 1.0, -0.5)
    assert R.result(dropped).tolist() == [[True, False, True]] and dropped.z.tolist() == [[False, True, False]]
    empty = R.matmul(_r(np.ones((2, 0))), _r(np.ones((0, 3)), True))
    assert not R.result(empty).any() and empty.z.all()                           # an empty sum is a structural 0


def test_reads_values_slice_and_reshape_as_arrays_do():
    x = _r(np.arange(6.0).reshape(2, 3), [[True, False, False], [False, False, True]])
    assert R.result(x[1]).tolist() == [False, False, True]
    assert R.result(np.swapaxes(x, 0, 1)).tolist() == [[True, False], [False, False], [False, True]]
    assert R.result(np.broadcast_to(x[:, :1], (2, 2))).tolist() == [[True, True], [False, False]]
    assert R.result(x.reshape(3, 2))[0].tolist() == [True, False]
    with pytest.raises(TypeError):
        np.exp(x)                                                                # only through the arithmetic


# ------------------------------------------------------------ the table, by loops


def _allowed(B, Hq, L, S, o, mask, bias):
    """(B, Hq, L, S) by SEMANTICS.md, entry by entry: bool mask, -inf float entries, causal, window, lengths."""
    ql, kl = o.get("q_lengths", [L] * B), o.get("kv_lengths", [S] * B)
    left, right = o.get("window", (None, None))
    a = np.zeros((B, Hq, L, S), bool)
    for b, h, i, j in np.ndindex(B, Hq, L, S):
        off = 0 if o.get("causal_alignment", "top_left") == "top_left" else int(kl[b]) - int(ql[b])
        ok = i < ql[b] and j < kl[b]
        if mask is not None:
            m = np.broadcast_to(mask, a.shape)[b, h, i, j]
            ok = ok and (bool(m) if mask.dtype == bool else m != -np.inf)
        ok = ok and (bias is None or np.broadcast_to(bias, a.shape)[b, h, i, j] != -np.inf)
        ok = ok and not (o.get("is_causal") and j > i + off)
        ok = ok and not (left is not None and j < i + off - left)
        ok = ok and not (right is not None and j > i + off + right)
        a[b, h, i, j] = ok
    return a


def _to(x, shape):
    """A full-layout bool pattern reduced by any to an input's own (broadcast) shape."""
    x = np.asarray(x)
    while x.ndim > len(shape):
        x = x.any(axis=0)
    for ax, n in enumerate(shape):
        if n == 1 and x.shape[ax] != 1:
            x = x.any(axis=ax, keepdims=True)
    return x


def table(shapes, o, arrays, bad, extra_lse=False):
    """The NaN pattern of every result by SEMANTICS.md's table: ``{name: bool array}``; ``bad`` maps each input
    (and ``grad_out``, ``grad_lse``, the tangents ``t_query`` ...) to where it is not finite; ``extra_lse``: a
    ``grad_lse`` is given."""
    B, Hkv, G, L, S, E, Ev = shapes
    Hq = Hkv * G
    mask, bias = o.get("attn_mask"), o.get("bias")
    A = _allowed(B, Hq, L, S, o, mask, bias)
    keep = np.broadcast_to(o.get("dropout_mask", np.ones(1, bool)), A.shape)
    ql = o.get("q_lengths", [L] * B)
    sinks = o.get("sinks")
    full = lambda n, shape: np.broadcast_to(bad.get(n, np.zeros(shape, bool)), shape)     # noqa: E731
    qb = full("query", (B, Hq, L, E)).any(-1)
    kb, vb = full("key", (B, Hkv, S, E)).any(-1), full("value", (B, Hkv, S, Ev))
    add = full("attn_mask", A.shape) | full("bias", A.shape)
    ab = full("alibi_slopes", (B, Hq))
    dob, dlb = full("grad_out", (B, Hq, L, Ev)), full("grad_lse", (B, Hq, L))
    res = {n: np.zeros(s, bool) for n, s in (("out", (B, Hq, L, Ev)), ("lse", (B, Hq, L)), ("dq", (B, Hq, L, E)),
                                              ("dk", (B, Hkv, S, E)), ("dv", (B, Hkv, S, Ev)),
                                              ("dbias", A.shape), ("dsinks", (B, Hq)), ("jvp", (B, Hq, L, Ev)))}
    tq, tk = full("t_query", (B, Hq, L, E)).any(-1), full("t_key", (B, Hkv, S, E)).any(-1)
    tv, tb, ts = full("t_value", (B, Hkv, S, Ev)), full("t_bias", A.shape), full("t_sinks", (B, Hq))
    for b, h, i in np.ndindex(B, Hq, L):
        kh = h // G
        keys = [j for j in range(S) if A[b, h, i, j]]
        has_sink = sinks is not None and np.broadcast_to(sinks, (B, Hq))[b, h] != -np.inf and i < ql[b]
        vals = keys
        if not keys and i < ql[b] and o.get("fully_masked") == "uniform" and not has_sink:
            vals = list(range(S))                              # the mean of every value
        vals = [j for j in vals if keep[b, h, i, j]]
        # the row's scores (its P and LSE) read these; the output and dT read them only through a kept entry
        # (a row whose every entry dropout drops has O = 0 and, without grad_lse, dT = 0: an empty sum)
        r = bool(keys) and (qb[b, h, i] or ab[b, h] or any(kb[b, kh, j] or add[b, h, i, j] for j in keys))
        res["lse"][b, h, i] = r
        for e in range(Ev):
            res["out"][b, h, i, e] = (r and bool(vals)) or any(vb[b, kh, j, e] for j in vals)
        active = bool(keys) and (bool(vals) or extra_lse)         # dT_i = P_i (dP_i - c - D + dlse_i) is no 0
        g = active and (r or dlb[b, h, i] or (bool(vals) and (dob[b, h, i].any()
                                                               or any(vb[b, kh, j].any() for j in vals))))
        res["dq"][b, h, i] = g
        # d sigma_i = p_sink,i ((0 - c) - D_i + dlse_i): what D reads through a kept entry, and dlse; nothing
        # without a sink (-inf: p_sink = 0); with a sink and no key lse = sigma, so it reads dlse there too
        res["dsinks"][b, h] |= has_sink and ((bool(vals) and (r or dob[b, h, i].any()
                                                             or any(vb[b, kh, j].any() for j in vals)))
                                             or (extra_lse and (r or dlb[b, h, i])))
        for j in keys:
            res["dk"][b, kh, j] |= g
            res["dbias"][b, h, i, j] = g
        for j in vals:
            res["dv"][b, kh, j] |= r | dob[b, h, i]
        # dO_i = sum_{j kept} (dP_ij v_j + P_ij dv_j) Z / (1-p): dP_i reads the row's scores and their tangents,
        # and is 0 on a constant row (no key: "uniform" averages dv alone)
        tr = bool(keys) and bool(vals) and (r or tq[b, h, i] or any(tk[b, kh, j] or tb[b, h, i, j] for j in keys)
                                            or (has_sink and ts[b, h]))
        for e in range(Ev):
            res["jvp"][b, h, i, e] = (tr or any(tv[b, kh, j, e] for j in vals)
                                      or (bool(keys) and any(vb[b, kh, j, e] for j in vals)))
    own = {"dq": arrays["query"].shape, "dk": arrays["key"].shape, "dv": arrays["value"].shape,
           "dbias": None if bias is None else bias.shape, "dsinks": None if sinks is None else np.shape(sinks)}
    return {n: (_to(x, own[n]) if own.get(n) is not None else x) for n, x in res.items()
            if not (n in own and own[n] is None)}


# ------------------------------------------------------------ the draw


INPUTS = ("query", "key", "value", "bias", "attn_mask", "alibi_slopes", "grad_out", "grad_lse", "t_query", "t_key",
          "t_value", "t_bias", "t_sinks")


@st.composite
def poisoned_problems(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    L, S, E, Ev = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    Hq = Hkv * G
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    KB = draw(st.sampled_from([B, 1]))
    arrays = {"query": rng.standard_normal((B, Hq, L, E)), "key": rng.standard_normal((KB, Hkv, S, E)),
              "value": rng.standard_normal((KB, Hkv, S, Ev))}
    o = {"enable_gqa": G > 1, "is_causal": draw(st.booleans()),
         "causal_alignment": draw(st.sampled_from(["top_left", "bottom_right"])),
         "fully_masked": draw(st.sampled_from(["zero", "nan", "uniform"]))}
    if draw(st.booleans()):
        o["window"] = (draw(st.sampled_from([None, 0, 1])), draw(st.sampled_from([None, 0, 1])))
    for n, top in (("q_lengths", L), ("kv_lengths", S)):
        if draw(st.booleans()):
            o[n] = rng.integers(0, top + 1, B)
    mask = draw(st.sampled_from([None, "bool", "float"]))
    if mask == "bool":
        o["attn_mask"] = rng.random((L, S)) < 0.7
    elif mask == "float":
        o["attn_mask"] = np.where(rng.random((B, Hq, L, S)) < 0.2, -np.inf, rng.standard_normal((B, Hq, L, S)))
    if draw(st.booleans()):
        o["bias"] = rng.standard_normal(draw(st.sampled_from([(B, Hq, L, S), (Hq, L, S), (1, L, S)])))
    if draw(st.booleans()):
        o["alibi_slopes"] = rng.uniform(0.1, 1.0, Hq)
    if draw(st.booleans()):
        o["softcap"] = 3.0
    if draw(st.booleans()):
        o.update(dropout_mask=rng.random((B, Hq, L, S)) < 0.75, dropout_p=0.25)
    if draw(st.booleans()):
        o["sinks"] = np.where(rng.random(Hq) < 0.3, -np.inf, rng.standard_normal(Hq))
    extra = {"grad_out": rng.standard_normal((B, Hq, L, Ev)),
             "grad_lse": rng.standard_normal((B, Hq, L)) if draw(st.booleans()) else None}
    tangents = {"t_query": rng.standard_normal((B, Hq, L, E)), "t_key": rng.standard_normal((KB, Hkv, S, E)),
                "t_value": rng.standard_normal((KB, Hkv, S, Ev)),
                "t_bias": None if "bias" not in o else rng.standard_normal(o["bias"].shape),
                "t_sinks": None if "sinks" not in o else rng.standard_normal(Hq)}
    pool = dict(arrays, **{n: o[n] for n in ("bias", "alibi_slopes") if n in o}, **extra, **tangents)
    if mask == "float":
        pool["attn_mask"] = o["attn_mask"]
    names = [n for n in INPUTS if pool.get(n) is not None]
    bad = {}
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.sampled_from(names))
        b = bad.setdefault(n, np.zeros(np.shape(pool[n]), bool))
        at = tuple(int(rng.integers(d)) for d in b.shape)
        b[at] = True
        if n == "attn_mask":                                # an exclusion (-inf) made a number first: poisoning it
            pool[n][at] = 0.0                               # must not change the allowed set of the clean run
    return (B, Hkv, G, L, S, E, Ev), arrays, o, extra, tangents, bad, draw(st.sampled_from([np.nan, np.inf, -np.inf]))


def _poisoned(arrays, o, extra, tangents, bad, value):
    """Copies with ``value`` where ``bad`` says (a float mask or bias gets NaN or +inf: -inf there is an exclusion)."""
    def put(n, a):
        if a is None or n not in bad:
            return a
        a = np.array(a, dtype=float)
        a[bad[n]] = np.nan if value == -np.inf and n in ("attn_mask", "bias") else value
        return a
    return ({n: put(n, a) for n, a in arrays.items()}, {n: put(n, a) for n, a in o.items()},
            {n: put(n, a) for n, a in extra.items()}, {n: put(n, a) for n, a in tangents.items()})


def _run(how, arrays, o, extra, tangents):
    q, k, v = arrays["query"], arrays["key"], arrays["value"]
    out, res = sdpa_ref.sdpa_forward(q, k, v, **o, **how)
    g = sdpa_ref.sdpa_backward(res, extra["grad_out"], grad_lse=extra["grad_lse"])
    ts = (tangents["t_query"], tangents["t_key"], tangents["t_value"], tangents["t_bias"], tangents["t_sinks"])
    jvp = sdpa_ref.sdpa_jvp((q, k, v), ts, **o, **how)[1]
    got = {"out": out, "lse": res.lse, "dq": g.query, "dk": g.key, "dv": g.value, "jvp": jvp}
    if g.bias is not None:
        got["dbias"] = g.bias
    if g.sinks is not None:
        got["dsinks"] = g.sinks
    return got


def _check(case, how):
    shapes, arrays, o, extra, tangents, bad, value = case
    clean = _run(how, arrays, o, extra, tangents)
    got = _run(how, *_poisoned(arrays, o, extra, tangents, bad, value))
    want = table(shapes, o, arrays, bad, extra["grad_lse"] is not None)
    for n, x in got.items():
        expect = want[n] | np.isnan(clean[n])
        assert np.array_equal(np.isnan(x), expect), (n, np.argwhere(np.isnan(x) != expect).tolist(), sorted(bad))
        np.testing.assert_array_equal(x[~expect], clean[n][~expect], err_msg=n)


@settings(max_examples=max(20, settings.default.max_examples))
@given(poisoned_problems())
def test_nan_reaches_exactly_what_the_table_says_fast(case):
    _check(case, {})


@settings(max_examples=max(5, settings.default.max_examples // 4))
@given(poisoned_problems())
def test_nan_reaches_exactly_what_the_table_says_reproducible(case):
    _check(case, {"precision": "reproducible"})


# ------------------------------------------------------------ wrong rules are caught


def _case(opts, bad, value=np.nan, L=3, S=3):
    """One problem in the form the strategy draws: ``(B, Hkv, G, L, S, E, Ev) = (1, 1, 1, L, S, 2, 2)``."""
    rng = np.random.default_rng(5)
    arrays = {"query": rng.standard_normal((1, 1, L, 2)), "key": rng.standard_normal((1, 1, S, 2)),
              "value": rng.standard_normal((1, 1, S, 2))}
    extra = {"grad_out": rng.standard_normal((1, 1, L, 2)), "grad_lse": None}
    tangents = {"t_query": rng.standard_normal((1, 1, L, 2)), "t_key": rng.standard_normal((1, 1, S, 2)),
                "t_value": rng.standard_normal((1, 1, S, 2)), "t_bias": None, "t_sinks": None}
    marks = {}
    for name, at in bad.items():
        m = np.zeros(arrays[name].shape, bool)
        m[at] = True
        marks[name] = m
    return (1, 1, 1, L, S, 2, 2), arrays, dict({"fully_masked": "zero"}, **opts), extra, tangents, marks, value


#: (the rule, a wrong form of it, a problem on which the wrong form puts NaN where nothing reads poison or misses it)
WRONG = {
    # IEEE's 0 * NaN = NaN: a causal row would read the value of a key it masks
    "a product that ignores structural zeros": (
        "mul", lambda self, a, b: ReadsArith.add(self, a, b),
        _case({"is_causal": True}, {"value": (0, 0, 2, 0)})),
    # the scores read q: every result of the row must be NaN
    "a matrix product that reads no poison": (
        "matmul", lambda self, A, B, final=False, scale=None, spans=None, contract=None:
        Reads(_ORIGINAL_MATMUL(self, A, B, final, scale, spans, contract).v),
        _case({}, {"query": (0, 0, 1, 0)})),
    # a dropped entry reads no value (row 0 drops key 2, which the other rows read)
    "a dropout that still reads what it drops": (
        "div_masked", lambda self, x, keep, a, b: self.lift(x),
        _case({"dropout_mask": np.array([[True, True, False], [True, True, True], [True, False, True]]),
               "dropout_p": 0.5}, {"value": (0, 0, 2, 1)})),
    # a constant row ("uniform", no key) has dP = 0: its tangent does not read v
    "a structural zero that a where forgets": (
        "where", lambda self, c, a, b: ReadsArith.lift(self, b) if np.ndim(c) else _ORIGINAL_WHERE(self, c, a, b),
        _case({"attn_mask": np.array([[True, True, False], [False, False, False], [True, True, True]]),
               "fully_masked": "uniform"}, {"value": (0, 0, 0, 0)})),
}
_ORIGINAL_MATMUL, _ORIGINAL_WHERE = ReadsArith.matmul, ReadsArith.where


@pytest.mark.parametrize("name", list(WRONG))
def test_the_check_passes_the_right_rule_and_catches_a_wrong_one(monkeypatch, name):
    attr, wrong, case = WRONG[name]
    _check(case, {})
    monkeypatch.setattr(ReadsArith, attr, wrong)
    with pytest.raises(AssertionError):
        _check(case, {})
