"""No warning leaks on overflowing products, and the NumPy row passes are the compiled ones (issue 40, the leftovers
of items 1, 9 and 12).

* Products that overflow are IEEE arithmetic the package means: ``q.k`` whose terms overflow with opposite signs
  (``1e200 * 1e200 - 1e200 * 1e200``: ``+inf``, ``-inf`` or NaN, as the BLAS orders and fuses its sum) and
  ``scale * q`` beyond the largest float (``10 * 1e308``). Every engine (plain, fast, tiled, split), forward,
  ``sdpa_backward``, ``sdpa_jvp``, ``sdpa_backward_jvp`` and ``sdpa_hvp``, native row passes on and off, runs them
  with every warning an error, and gives the one NaN rule's pattern (``tests/test_normalize.py``: the row is NaN
  on the keys it reads), or, where the product came out ``-inf``, the result of that key excluded.
  ``precision="reproducible"`` raises its ValueError on the ``+inf`` score, and on the cancelling product, which it
  forms exactly (0), gives finite results. The warnings are scoped where the products are formed
  (``transforms.scores_forward``, ``scores_vjp``, ``scores_jvp``) and where an overflowed cotangent or tangent meets
  its row's pivot (``inf - inf``, ``pivot.py``, the tiled sweep).
* The fast engine's NumPy row passes (no compiler) sum in the compiled passes' order (``pivot.lane_rowsum``), so
  that, from the same terms, their sums, ``P`` and the pivoted VJP are the compiled bits; only the exp differs
  (``np.exp`` against the package's own, each within an ulp).
"""

import warnings

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref.exact import _native
from sdpa_ref.pivot import lane_rowsum, softmax_vjp_rows

from test_normalize import HOWS, L, S, E, _SECOND, _inputs, _run, native  # noqa: F401 (native: a fixture)
from tolerances import F64_GRAD, F64_REGROUPED

#: The second-order results compared with the first order's pattern.
SECOND_NAMES = ("dq", "dk", "dv", "dbias")


def _cases():
    """name -> (q, k, v, g, options, {NaN row: the keys it reads}, the key its product may make -inf or None)."""
    q, k, v, g = _inputs()
    bias = np.zeros((L, S))
    out = {}
    qq, kk = q.copy(), k.copy()                 # q_0 . k_1 = 1e400 - 1e400: +inf, -inf or NaN as the BLAS sums
    qq[0, 0, 0], kk[0, 0, 1] = [1e200, 1e200], [1e200, -1e200]
    out["q.k: overflowing products cancel"] = (qq, kk, v, g, dict(bias=bias), {0: [0, 1, 2, 3]}, 1)
    qq = q.copy()                               # scale * q_0 = inf: scores -inf on keys 0, 1 (k_j0 < 0), +inf on 2, 3
    qq[0, 0, 0, 0] = 1e308
    out["scale * q overflows"] = (qq, k, v, g, dict(bias=bias, scale=10.0), {0: [2, 3]}, None)
    return out


CASES = _cases()


def _pattern(reads):
    """The rule's NaN pattern (``tests/test_normalize.py``): out, lse, dq and the JVP of a NaN row, dk, dv and
    dbias of the keys it reads; ``reads`` {row: keys}."""
    pat = {n: np.zeros((1, 1, L, E), bool) for n in ("out", "dq", "jvp")}
    pat.update(lse=np.zeros((1, 1, L), bool), dk=np.zeros((1, 1, S, E), bool), dv=np.zeros((1, 1, S, E), bool),
               dbias=np.zeros((L, S), bool))
    for i, keys in reads.items():
        for n in ("out", "dq", "jvp"):
            pat[n][0, 0, i] = True
        pat["lse"][0, 0, i] = True
        for j in keys:
            pat["dk"][0, 0, j] = pat["dv"][0, 0, j] = True
            pat["dbias"][i, j] = True
    return pat


def _excluded(o, row, key):
    """The options with ``key`` excluded from ``row`` (a product that came out -inf excludes its key)."""
    allowed = np.ones((L, S), bool)
    allowed[row, key] = False
    return dict(o, attn_mask=allowed)


def _check(got, reads, may_exclude, ref_excluded, what):
    """``got`` is the rule's NaN pattern, or (where the product may come out -inf and the row has no NaN) all
    finite and equal to the problem with that key excluded."""
    row = next(iter(reads))
    if may_exclude is not None and not np.isnan(got["dq"][0, 0, row]).any():
        for n in got:
            if n in ref_excluded:
                assert np.isfinite(got[n]).all(), (what, n)
                np.testing.assert_allclose(got[n], ref_excluded[n], rtol=F64_GRAD, atol=F64_REGROUPED, err_msg=f"{what}: {n}")
        return "excluded"
    want = _pattern(reads)
    for n in got:
        if n in want:
            np.testing.assert_array_equal(np.isnan(got[n]), want[n], err_msg=f"{what}: {n}")
            assert np.isfinite(got[n][~want[n]]).all(), (what, n)
    return "nan row"


@pytest.mark.parametrize("name", list(CASES))
def test_overflowing_products_warn_nowhere_and_follow_the_rule(name, native):
    """Forward, backward and JVP on every engine with every warning an error (``_run``). Before: the JVP of plain,
    fast, tiled and split warned "overflow encountered in multiply" (``scores_jvp``), then "invalid value in
    subtract" (the pivot: plain, NumPy fast, tiled, split). Here the BLAS gives the cancelling product +inf or NaN
    on every engine, silently (a product it makes -inf is checked against the key excluded); NumPy's own loop
    flags it (:func:`test_a_cancelling_float32_product_of_one_query_row`)."""
    q, k, v, g, o, reads, key = CASES[name]
    ref = None if key is None else _run(HOWS["plain"], q, k, v, g, **_excluded(o, next(iter(reads)), key))
    for how_name, how in HOWS.items():
        _check(_run(how, q, k, v, g, **o), reads, key, ref, f"{name}, {how_name}, {native}")


@pytest.mark.parametrize("name", list(CASES))
def test_overflowing_products_in_second_order(name, native):
    """``sdpa_hvp`` and ``sdpa_backward_jvp`` (with ``grad_lse`` and its tangent), plain and tiled, every warning
    an error: the first order's pattern. Before: "overflow encountered in multiply" from ``scores_jvp``."""
    q, k, v, g, o, reads, key = CASES[name]
    tangents = tuple(np.ones_like(a) for a in (q, k, v))
    ones = np.ones((1, 1, L))
    row = next(iter(reads))

    def both(how, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hv = sdpa_ref.sdpa_hvp((q, k, v), tangents, g, **kw, **how)
            _, bj = sdpa_ref.sdpa_backward_jvp((q, k, v), tangents, g, np.ones_like(g), grad_lse=ones,
                                               grad_lse_tangent=ones, **kw, **how)
        return [{n: getattr(r, m) for n, m in zip(SECOND_NAMES, ("query", "key", "value", "bias"))} for r in (hv, bj)]

    refs = None if key is None else both(_SECOND["plain"], **_excluded(o, row, key))
    for how_name, how in _SECOND.items():
        for i, got in enumerate(both(how, **o)):
            _check(got, reads, key, None if refs is None else refs[i], f"{name}, {how_name}, {native}, {i}")


def test_a_cancelling_float32_product_of_one_query_row(native):
    """``q.k = 1e60 - 1e60`` in float32 (``upcast=False``) with one query row, unbatched: NumPy's own matmul loop
    (not the BLAS) forms it, NaN with an "invalid value" flag. Before: "invalid value encountered in matmul" from
    ``scores_forward`` on every engine (2 to 7 times per forward, backward and JVP). Now silent, and the row is NaN
    on every key it reads (all three: every result is NaN), or, where the product came out ``-inf``, the result of
    that key excluded, to float32's rounding (8 eps, as ``tests/test_engines.py`` allows a computation in float32)."""
    f = np.float32
    q = np.array([[1e30, 1e30]], f)
    k = np.array([[0.5, -0.25], [1e30, -1e30], [-0.75, 0.5]], f)
    v = np.array([[1.0, 2.0], [-1.0, 0.5], [0.25, -2.0]], f)
    g = np.ones((1, 2), f)
    allowed = np.array([[True, False, True]])
    tol = 8 * float(np.finfo(f).eps)
    ref = _run(HOWS["plain"], q, k, v, g, upcast=False, attn_mask=allowed)
    for how_name, how in HOWS.items():
        got = _run(how, q, k, v, g, upcast=False)
        for n, x in got.items():
            if x is None:
                continue
            if np.isnan(got["out"]).any():
                assert np.isnan(x).all(), (how_name, native, n)
            else:
                np.testing.assert_allclose(x, ref[n], rtol=tol, atol=tol * np.abs(ref[n]).max(),
                                           err_msg=f"{how_name}, {native}: {n}")


def test_reproducible_refuses_the_overflow_and_forms_the_cancelling_product_exactly():
    """``precision="reproducible"``: ``scale * q`` beyond the largest float is a ValueError naming the inputs,
    never a warning; ``q.k = 1e400 - 1e400`` is formed exactly (0 in its arithmetic) and every result is finite."""
    q, k, v, g, o, reads, key = CASES["scale * q overflows"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"`query`, `key`: a score of an allowed key is \+inf or NaN"):
            sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **o)
        with pytest.raises(ValueError, match=r"\+inf or NaN"):
            sdpa_ref.sdpa_jvp((q, k, v), tuple(np.ones_like(a) for a in (q, k, v)), precision="reproducible", **o)
        q, k, v, g, o, reads, key = CASES["q.k: overflowing products cancel"]
        got = _run({"precision": "reproducible"}, q, k, v, g, **o)
    for n, x in got.items():
        assert np.isfinite(x).all(), n


def test_numpy_row_passes_are_the_compiled_ones():
    """pivot.lane_rowsum and softmax_vjp_rows (the fast engine's NumPy passes) against the compiled row passes,
    every SIMD build, float64 and float32, rows of 0 to 4097 entries: the softmax's sum and ``P`` from the compiled
    exp, and the VJP, bit for bit. The old passes (einsum, np.sum) gave another sum on 7 to 35 of 50 rows per
    length and another VJP on 124 of 250 rows."""
    lib = _native.kernels()
    if lib is None:
        pytest.skip("the compiled row passes are not in use here")
    rng = np.random.default_rng(9)
    have = [lv for lv in _native.SIMD_LEVELS if _native.simd_level(lib, lv) == lv]
    try:
        for level in have:
            _native.simd_level(lib, level)
            for dt in (np.float64, np.float32):
                for n in (0, 1, 3, 7, 8, 9, 16, 17, 100, 4097):
                    t = (rng.standard_normal((6, n)) * 5).astype(dt)
                    t[0, n // 2:] = -np.inf                                 # a short row inside a long one
                    pc, m, s, lse = t.copy(), *(np.empty((6, 1), dt) for _ in range(3))
                    _native.fast_softmax_rows(lib, pc, m, s, lse, np.empty((6, 1), bool))
                    e = _native.fast_exp(lib, t - m) if n else t - m
                    s_ans = lane_rowsum(e)
                    assert np.array_equal(s_ans, s), (level, dt, n)
                    with np.errstate(divide="ignore", invalid="ignore"):     # the empty row: 0 / 0, log 0
                        assert np.array_equal(e / s_ans, pc, equal_nan=True), (level, dt, n)
                        # the LSE's log is the C library's in the compiled pass and NumPy's here: the same
                        # formula, but the package controls neither log's last bit (numpy 1.23's differs), so 1 ulp
                        want = (np.log(s.astype(np.float64)) + m).astype(dt)
                        fin = np.isfinite(want)
                        assert np.array_equal(np.isfinite(lse), fin), (level, dt, n)
                        assert np.all(np.abs(lse[fin] - want[fin]) <= np.spacing(np.abs(want[fin]))), (level, dt, n)
                    pc[np.isnan(pc)] = 0                                    # the engine fills the empty row
                    d = rng.standard_normal((6, n)).astype(dt)
                    d_ref, d_ans = d.copy(), d.copy()
                    _native.fast_softmax_vjp_rows(lib, d_ref, pc)
                    softmax_vjp_rows(d_ans, pc, 4)
                    assert np.array_equal(d_ans, d_ref), (level, dt, n)
    finally:
        _native.simd_level(lib, "best")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_buffered_softmax_second_order_is_the_plain_lines_bits(dtype):
    """On NumPy arrays, ``tangent_probs`` and ``second_entries`` write into a few buffers
    (``pivot._second_entries_numpy``); the plain lines they stand for, written here as their docstrings read,
    give the same bits on adversarial rows (a NaN row, an overflowed cotangent, an infinite tangent of the
    cotangent, a dominant key, a column of one entry with g = h = 0 as a sink's), NaN payloads and dtypes
    included; and a buffer that takes a float64 sum into float32 is seen."""
    from sdpa_ref import pivot

    def tangent(P, t, piv):                                              # P' = P ((T' - tau) - (c - tau))
        return pivot.nan_rows_vjp(P * ((t - piv.tau) - piv.Ct), P, piv.Dg)

    def entries(P, Pt, g, h, piv, lam, lam_t):                          # dT = P r; dT' = P (...) + (P' r - P E)
        r = ((g - piv.a) - piv.Dg) + lam
        dT_t = P * (((h - piv.b) - piv.Fh) + lam_t) + (Pt * r - P * piv.E)
        return pivot.nan_rows_vjp(P * r, P, piv.Dg), pivot.nan_rows_vjp(dT_t, P, piv.Dg)

    rng = np.random.default_rng(4)
    P = rng.dirichlet(np.ones(7), size=(2, 3, 5)).astype(dtype)
    P[0, 0, 0] = [1, 0, 0, 0, 0, 0, 0]                                  # a dominant key
    P[0, 1, 1] = [np.nan, 0, np.nan, np.nan, 0, np.nan, np.nan]         # a NaN row: 0 where it reads nothing
    g, t, h = (rng.standard_normal(P.shape).astype(dtype) * 3 for _ in range(3))
    g[1, 2, 3, 4] = np.finfo(dtype).max                                  # an overflowing cotangent
    h[1, 0, 2, 1] = -np.inf
    lam, lam_t = rng.standard_normal((2, 3, 5, 1)).astype(dtype), 0
    z = np.zeros_like(P[..., :1])
    with np.errstate(all="ignore"):
        for args in ((P, g, t, h), (P[..., :1], 0, t[..., :1], 0)):      # the second: one column, g = h = 0
            Pa, ga, ta, ha = args
            piv = pivot.combine_second([pivot.second_partial(*(z if isinstance(a, int) else a for a in args))])
            Pt = pivot.tangent_probs(Pa, ta, piv)
            assert Pt.dtype == dtype and Pt.tobytes() == tangent(Pa, ta, piv).tobytes()
            got = pivot.second_entries(Pa, Pt, ga, ha, piv, lam, lam_t)
            for a, b in zip(got, entries(Pa, Pt, ga, ha, piv, lam, lam_t)):
                assert a.dtype == b.dtype == dtype and a.tobytes() == b.tobytes()
        piv = pivot.combine_second([pivot.second_partial(P, g, t, h)])
        Pt = pivot.tangent_probs(P, t, piv)
        lam64 = lam.astype(np.float64)                                   # a float64 lam: the sums widen
        want = entries(P, Pt, g, h, piv, lam64, lam_t)
        assert all(a.tobytes() == b.tobytes() for a, b in
                   zip(pivot.second_entries(P, Pt, g, h, piv, lam64, lam_t), want))
        real = pivot._fits                                               # a buffer that ignores the dtype
        try:
            pivot._fits = lambda x, y: isinstance(x, np.ndarray) and x.shape == np.broadcast_shapes(x.shape,
                                                                                                      np.shape(y))
            bad = pivot.second_entries(P, Pt, g, h, piv, lam64, lam_t)
        finally:
            pivot._fits = real
    assert (bad[0].tobytes() != want[0].tobytes()) == (dtype == np.float32)
