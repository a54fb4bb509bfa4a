"""A row's statistics and its one NaN rule on every engine (issue 40, item 1): adversarial scores from finite inputs.

The rule (``sdpa_ref.normalize.row_stats``): a row is empty only when every score is ``-inf`` (no key allowed, or
every allowed score ``-inf``); an allowed score that is NaN or ``+inf`` makes the row NaN on the fast engines --
``out``, ``lse``, ``dq`` of the row, ``dk``, ``dv`` and ``dbias`` of the keys it reads (the reads table of
SEMANTICS.md with the row's scores as the poison), the JVP's tangent of the row -- and a ValueError from
``precision="reproducible"``. Every engine gives the same NaN/finite pattern, native row passes on and off.
"""

import warnings

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref.exact import _native
from sdpa_ref.normalize import row_stats
from tolerances import F64_GRAD, F64_REGROUPED

HOWS = {"plain": {"method": "plain"}, "fast": {"method": "fast"}, "tiled": {"block_size": 2},
        "split": {"num_splits": 2}}
L, S, E = 3, 4, 2


def _inputs():
    rng = np.random.default_rng(40)
    return [rng.standard_normal((1, 1, n, E)) for n in (L, S, S, L)]


def _run(how, q, k, v, g, **kw):
    """``(out, lse, dq, dk, dv, dbias, jvp)`` with every warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, res = sdpa_ref.sdpa_forward(q, k, v, **kw, **how)
        gr = sdpa_ref.sdpa_backward(res, g)
        _, t = sdpa_ref.sdpa_jvp((q, k, v), tuple(np.ones_like(a) for a in (q, k, v)), **kw, **how)
    return {"out": out, "lse": res.lse, "dq": gr.query, "dk": gr.key, "dv": gr.value,
            "dbias": gr.bias, "jvp": t}


def _nan_mask():
    """Row 0 may see key 2 only; the other rows see every key."""
    allowed = np.ones((L, S), bool)
    allowed[0] = False
    allowed[0, 2] = True
    return np.where(allowed, 0.0, -np.inf)


def _cases():
    """name -> (q, k, v, g, options, the rows that are NaN, their allowed keys)."""
    q, k, v, g = _inputs()
    fm = _nan_mask()
    out = {}
    m, b = fm.copy(), np.zeros((L, S))
    m[0, 2], b[0, 2] = 1e308, 1e308                                 # inf, then the ALiBi term -inf: inf - inf
    out["mask+bias+alibi: inf - inf"] = (q, k, v, g, dict(attn_mask=m, bias=b, alibi_slopes=np.array([1e308])),
                                         [0], {0: [2]})
    m, b = fm.copy(), np.zeros((L, S))
    m[0, 2], b[0, 2] = 1e308, 1e308                                 # +inf on the only allowed key
    out["mask+bias: +inf"] = (q, k, v, g, dict(attn_mask=m, bias=b), [0], {0: [2]})
    qq, kk = q.copy(), k.copy()                                     # q.k = +inf on one of two allowed keys
    qq[0, 0, 0, 0], kk[0, 0, 1, 0] = 1e200, 1e200
    out["q.k overflows"] = (qq, kk, v, g, dict(is_causal=True, causal_alignment="bottom_right",
                                               bias=np.zeros((L, S))), [0], {0: [0, 1]})

    def nan_mod(score, b, h, i, j):                                 # NaN on the only key row 0 sees
        return np.where((i == 0) & (j == 2), np.nan, score)
    out["score_mod NaN on the only key"] = (q, k, v, g, dict(attn_mask=fm, bias=np.zeros((L, S)),
                                                             score_mod=nan_mod), [0], {0: [2]})

    def nan_one(score, b, h, i, j):                                 # NaN on one of several allowed keys
        return np.where((i == 1) & (j == 3), np.nan, score)
    out["score_mod NaN on one key"] = (q, k, v, g, dict(bias=np.zeros((L, S)), score_mod=nan_one), [1],
                                       {1: [0, 1, 2, 3]})
    return out


CASES = _cases()


def _expected(name):
    """The NaN pattern the rule gives, written out: each result NaN exactly where it reads a NaN row."""
    q, k, v, g, o, rows, keys = CASES[name]
    pat = {"out": np.zeros((1, 1, L, E), bool), "lse": np.zeros((1, 1, L), bool), "dq": np.zeros((1, 1, L, E), bool),
           "dk": np.zeros((1, 1, S, E), bool), "dv": np.zeros((1, 1, S, E), bool), "dbias": np.zeros((L, S), bool),
           "jvp": np.zeros((1, 1, L, E), bool)}
    for i in rows:
        for n in ("out", "dq", "jvp"):
            pat[n][0, 0, i] = True
        pat["lse"][0, 0, i] = True
        for j in keys[i]:
            pat["dk"][0, 0, j] = pat["dv"][0, 0, j] = True
            pat["dbias"][i, j] = True
    return pat


@pytest.fixture(params=["native", "numpy"])
def native(request, monkeypatch):
    """The compiled row passes, then NumPy's (``SDPA_REF_NATIVE=0``, as tests/test_engines_fast.py switches them)."""
    if request.param == "native" and _native.kernels() is None:
        pytest.skip("the compiled row passes are not in use here")
    if request.param == "numpy":
        monkeypatch.setenv("SDPA_REF_NATIVE", "0")
    return request.param


@pytest.mark.parametrize("name", list(CASES))
def test_every_engine_gives_the_rules_nan_pattern(name, native):
    """Before this rule, on "mask+bias+alibi" the compiled row pass and reproducible flagged row 0 empty (out 0),
    plain and tiled spread NaN to every key's dk and dv; on "q.k overflows" plain gave dv [nan, nan, fin, fin]
    and fast, tiled and split [nan, nan, nan, nan]."""
    q, k, v, g, o, rows, keys = CASES[name]
    want = _expected(name)
    for how_name, how in HOWS.items():
        got = _run(how, q, k, v, g, **o)
        for n, w in want.items():
            np.testing.assert_array_equal(np.isnan(got[n]), w, err_msg=f"{name}, {how_name}, {native}: {n}")
            assert np.isfinite(got[n][~w]).all(), (name, how_name, n)


@pytest.mark.parametrize("name", [n for n in CASES if "score_mod" not in n])
def test_reproducible_refuses_a_nan_row(name):
    q, k, v, g, o, rows, keys = CASES[name]
    with pytest.raises(ValueError, match=r"\+inf or NaN"):
        sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **o)


def test_cancelling_and_overflowing_masks_are_exclusions_or_nan_rows_alike(native):
    """A float mask and a bias that cancel (1e308 + -1e308 = 0) are an ordinary finite score; that overflow to
    -inf exclude the key. The same finite pattern on every engine and on reproducible; the fast engines agree with
    the core (reproducible's row 0 is another value: in double-double ``T + 1e308 - 1e308`` keeps ``T``, in float64
    the sum rounds it away), and with reproducible on the other rows."""
    q, k, v, g = _inputs()
    m, b = np.zeros((L, S)), np.zeros((L, S))
    m[0, :], b[0, :] = 1e308, -1e308                                # cancels: row 0 finite
    m[1, 1], b[1, 1] = -1e308, -1e308                               # -inf: key 1 excluded from row 1
    m[2, :] = b[2, :] = -1e308                                      # row 2 fully masked: the policy's 0
    exact = _run({"precision": "reproducible"}, q, k, v, g, attn_mask=m, bias=b)
    ref = _run(HOWS["plain"], q, k, v, g, attn_mask=m, bias=b)
    for n in ("out", "lse", "jvp"):
        np.testing.assert_allclose(ref[n][0, 0, 1:], exact[n][0, 0, 1:], rtol=F64_GRAD, atol=F64_REGROUPED, err_msg=n)
    for how_name, how in dict(HOWS, reproducible={"precision": "reproducible"}).items():
        got = _run(how, q, k, v, g, attn_mask=m, bias=b)
        for n in ref:
            assert not np.isnan(got[n]).any(), (how_name, n)              # lse is -inf on row 2
            if how_name != "reproducible":
                np.testing.assert_allclose(got[n], ref[n], rtol=F64_GRAD, atol=F64_REGROUPED,
                                           err_msg=f"{how_name}: {n}")
    assert np.all(ref["out"][0, 0, 2] == 0) and ref["lse"][0, 0, 2] == -np.inf


def test_row_stats_and_the_compiled_row_pass_follow_one_rule():
    """The one definition against the compiled row pass on adversarial rows, every SIMD build: the same empty
    rows, the same NaN rows, P NaN exactly where the score is not -inf on a NaN row and 0 where it is."""
    rows = np.array([[0.0, -np.inf, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, np.nan],   # NaN with -inf and finite
                     [np.nan] * 10,                                                 # all NaN (was "empty")
                     [-np.inf] * 9 + [np.nan],                                      # NaN among -inf
                     [-np.inf] * 5 + [np.inf] + [1.0] * 4,                          # +inf
                     [-np.inf] * 10,                                                # empty
                     [np.inf, -np.inf] * 5])
    m, empty, nan = row_stats(rows)
    assert empty[:, 0].tolist() == [False, False, False, False, True, False]
    assert nan[:, 0].tolist() == [True, True, True, True, False, True]
    lib = _native.kernels()
    if lib is None:
        pytest.skip("the compiled row passes are not in use here")
    have = [lv for lv in _native.SIMD_LEVELS if _native.simd_level(lib, lv) == lv]
    try:
        for level in have:
            _native.simd_level(lib, level)
            for dt in (np.float64, np.float32):
                t = rows.astype(dt)
                cm, cs, cl = (np.empty((len(t), 1), dt) for _ in range(3))
                ce = np.empty((len(t), 1), bool)
                _native.fast_softmax_rows(lib, t, cm, cs, cl, ce)
                assert np.array_equal(ce, empty), (level, dt)
                assert np.array_equal(np.isnan(cs[:, 0]), nan[:, 0]), (level, dt)
                bad = nan[:, 0]
                assert np.array_equal(np.isnan(t[bad]), rows[bad] != -np.inf), (level, dt)
                assert np.all(t[bad][rows[bad] == -np.inf] == 0), (level, dt)
                g = np.ones_like(t)
                t[empty[:, 0]] = 0
                _native.fast_softmax_vjp_rows(lib, g, t)                # the VJP: 0 where P is 0, NaN elsewhere
                assert np.array_equal(np.isnan(g[bad]), rows[bad] != -np.inf), (level, dt)
    finally:
        _native.simd_level(lib, "best")


def test_no_warning_leaks_on_the_adversarial_rows(native):
    """Every case above, every engine, forward, backward and JVP, with every warning an error (``_run``)."""
    for name, (q, k, v, g, o, rows, keys) in CASES.items():
        for how in HOWS.values():
            _run(how, q, k, v, g, **o)


def _expected_with(name, drop=None):
    """:func:`_expected` with sinks and dropout (``drop`` ``(L, S)`` bool keep mask, or None): ``dv[j]`` of every
    key ``j`` the NaN row ``i`` allows, dropped or kept (dropout is ``P Z / (1 - p)`` in IEEE arithmetic, so a
    dropped entry of a NaN row is ``NaN * 0``, as a ``"nan"``-policy row's: the engines agree on that, and a
    ``"nan"``-policy row whose keys are all dropped stays NaN), ``dsinks`` of the head NaN (a NaN row reads its
    sink); the rest as the rule says."""
    q, k, v, g, o, rows, keys = CASES[name]
    pat = _expected(name)
    pat["dv"][...] = False
    for i in rows:
        for j in keys[i]:
            pat["dv"][0, 0, j] = True
    pat["dsinks"] = np.ones((1,), bool)
    return pat


_SECOND = {"plain": {"method": "plain"}, "tiled 1": {"block_size": 1}, "tiled 3": {"block_size": 3}}


@pytest.mark.parametrize("name", list(CASES))
def test_nan_rows_with_sinks_dropout_and_second_order(name, native):
    """The rule on a NaN row with a sink and with dropout, and in second order, on every engine.

    With a sink, the close's factor ``r`` was NaN on a NaN row, so ``P r`` spread NaN to the keys the row does not
    read (``dk``, ``dv``, ``dbias`` of excluded keys); with dropout the dropped entries of the keys the row allows
    are ``NaN * 0`` (the formula's, on every engine). In second order (``sdpa_hvp``,
    ``sdpa_backward_jvp``, plain and tiled) the entries with ``P = 0`` of a NaN row were NaN (and every entry of
    the tiled sweep's row). Now each result is NaN exactly where the first-order reads table says (second order:
    the same pattern, inside SEMANTICS.md's superset), plain and tiled alike, the rest finite."""
    q, k, v, g, o, rows, keys = CASES[name]
    keep = np.ones((L, S), bool)
    keep[0, 1] = keep[1, 2] = keep[1, 0] = keep[2, 3] = False       # drops a key row 1 reads (NaN on one key)
    sinks = np.array([0.25])
    for extra, drop in (({"sinks": sinks}, None), ({"dropout_p": 0.5, "dropout_mask": keep}, keep),
                        ({"sinks": sinks, "dropout_p": 0.5, "dropout_mask": keep}, keep)):
        kw = dict(o, **extra)
        want = _expected_with(name, drop)
        if "sinks" not in extra:
            del want["dsinks"]
        for how_name, how in HOWS.items():
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out, res = sdpa_ref.sdpa_forward(q, k, v, **kw, **how)
                gr = sdpa_ref.sdpa_backward(res, g)
                _, t = sdpa_ref.sdpa_jvp((q, k, v), tuple(np.ones_like(a) for a in (q, k, v)), **kw, **how)
            got = {"out": out, "lse": res.lse, "dq": gr.query, "dk": gr.key, "dv": gr.value, "dbias": gr.bias,
                   "jvp": t, "dsinks": gr.sinks}
            for n, w in want.items():
                np.testing.assert_array_equal(np.isnan(got[n]), w, err_msg=f"{name}, {extra}, {how_name}: {n}")
                assert np.isfinite(got[n][~w]).all(), (name, how_name, n)
        tangents = tuple(np.ones_like(a) for a in (q, k, v)) + (None, np.array([0.5]) if "sinks" in extra else None)
        for how_name, how in ({} if "score_mod" in kw else _SECOND).items():     # (second order: no derivative)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                hv = sdpa_ref.sdpa_hvp((q, k, v), tangents, g, **kw, **how)
                _, bj = sdpa_ref.sdpa_backward_jvp((q, k, v), tangents, g, np.ones_like(g), grad_lse=np.ones((1, 1, L)),
                                                   grad_lse_tangent=np.ones((1, 1, L)), **kw, **how)
            for what, got in (("hvp", hv), ("backward_jvp", bj)):
                got = {"dq": got.query, "dk": got.key, "dv": got.value, "dbias": got.bias, "dsinks": got.sinks}
                for n in got:
                    if n in want:
                        np.testing.assert_array_equal(np.isnan(got[n]), want[n],
                                                      err_msg=f"{name}, {extra}, {how_name}, {what}: {n}")


def test_the_sinks_probability_is_the_closed_normalisers_bit_for_bit():
    """``normalize.extra_probs`` (every engine's backward, JVP and second order) from a forward's closed ``(m, s)``
    gives ``close``'s own ``p_extra`` bit for bit: a sink near the top score (its probability from the rounded LSE
    was 13% off at 1e15), a dominant one, a low one, none, a row with no key, a NaN row (NaN)."""
    from sdpa_ref.normalize import close, extra_probs
    T = np.array([[2.0 ** 50, 2.0 ** 50 - 1], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [-np.inf, -np.inf],
                  [-np.inf, -np.inf], [np.nan, 1.0]])
    sink = np.array([[2.0 ** 50 + 3], [40.0], [-700.0], [-np.inf], [0.5], [-np.inf], [0.5]])
    m, empty, nan = row_stats(T)
    with np.errstate(invalid="ignore"):
        s = np.where(nan, np.nan, np.sum(np.exp(T - m), axis=-1, keepdims=True))
    nrm = close(m, s, empty, sink)
    got = extra_probs(sink, nrm.m, nrm.s)
    np.testing.assert_array_equal(got, nrm.p_extra)
    assert got[3, 0] == 0 and got[4, 0] == 1 and got[5, 0] == 0 and np.isnan(got[6, 0])
