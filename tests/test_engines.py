"""Dtypes and zero sizes: every engine, precision and ``upcast`` takes the same inputs, refuses the same ones with
the same `TypeError` naming the argument, and gives the same results on empty dims (SEMANTICS.md, "Precision and
dtypes" and "Zero sizes")."""

import numpy as np
import pytest

from sdpa_ref import scaled_dot_product_attention, sdpa_backward, sdpa_forward, sdpa_forward_complex, sdpa_jvp
from tolerances import F32, F32_ATOL, F32_SCHEDULES, F64_GRAD
import warnings
import sdpa_ref

try:
    import ml_dtypes
except ImportError:             # the lowp extra is not installed: bfloat16 and fp8 cannot even be made
    ml_dtypes = None

needs_ml = pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes (the lowp extra)")

#: Every path a forward can take: (keyword arguments, upcast).
ENGINES = [dict(method="plain"), dict(method="fast"), dict(method="tiled"), dict(method="tiled", block_size=2),
           dict(precision="reproducible")]
PATHS = [(e, up) for e in ENGINES for up in (True, False)]
#: The paths of the JVP: every engine.
JVP_PATHS = PATHS


def _ids(p):
    e, up = p
    return "-".join(f"{v}" for v in e.values()) + ("" if up else "-noupcast")


def _problem(rng, lead=(1, 2), L=3, S=5, E=4, Ev=3):
    q = rng.standard_normal(lead + (L, E))
    k = rng.standard_normal(lead + (S, E))
    v = rng.standard_normal(lead + (S, Ev))
    return q, k, v


def _run(q, k, v, path, grad_out=None, **opts):
    e, up = path
    out, res = sdpa_forward(q, k, v, upcast=up, **e, **opts)
    g = sdpa_backward(res, np.ones(out.shape, out.dtype) if grad_out is None else grad_out)
    return out, res, g


def _accepted():
    dts = [np.float64, np.float32, np.float16]
    return dts + ([ml_dtypes.bfloat16] if ml_dtypes is not None else [])


def _eps(dt):
    return 2.0 ** -7 if np.dtype(dt).name == "bfloat16" else float(np.finfo(dt).eps)


# ------------------------------------------------------------------ accepted


@pytest.mark.parametrize("dt", _accepted(), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_accepted_dtypes_agree_across_engines(dt, path):
    rng = np.random.default_rng(7)
    q, k, v = (a.astype(dt) for a in _problem(rng))
    bias = rng.standard_normal((3, 5)).astype(dt)
    mask = np.array([[True] * 5, [True, False, True, True, False], [False, True, True, True, True]])
    if np.dtype(dt).name == "bfloat16" and not path[1]:
        with pytest.raises(TypeError, match="`query` should have dtype float64, float32 or float16 with upcast=False"):
            _run(q, k, v, path)
        return
    ref_out, _, ref_g = _run(*(a.astype(np.float64) for a in (q, k, v)), (dict(method="plain"), True),
                             attn_mask=mask, bias=bias.astype(np.float64))
    out, _, g = _run(q, k, v, path, attn_mask=mask, bias=bias)
    assert out.dtype == np.dtype(dt)
    assert all(x.dtype == np.dtype(dt) for x in (g.query, g.key, g.value, g.bias))
    # rounded once to dt with upcast (1 ulp either way), computed in dt without it
    tol = (1.0 if path[1] else 8.0) * _eps(dt)
    for want, got in zip((ref_out,) + tuple(ref_g[:3]) + (ref_g.bias,), (out,) + tuple(g[:3]) + (g.bias,)):
        got = np.asarray(got, np.float64)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


@needs_ml
@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_mixed_dtypes_promote_as_in_numpy(path):
    rng = np.random.default_rng(1)
    q, k, v = _problem(rng)
    q, k, v = q.astype(np.float16), k.astype(ml_dtypes.bfloat16), v.astype(np.float16)   # bfloat16 + float16
    out, _, g = _run(q, k, v, path, attn_mask=np.ones((3, 5), np.float32), bias=np.zeros((3, 5), ml_dtypes.bfloat16))
    assert out.dtype == np.float32
    assert (g.query.dtype, g.key.dtype, g.value.dtype) == (np.float16, np.dtype(ml_dtypes.bfloat16), np.float16)
    assert g.attn_mask.dtype == np.float32 and g.bias.dtype == np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("path", JVP_PATHS, ids=_ids)
def test_the_jvp_takes_the_same_dtypes(path):
    rng = np.random.default_rng(2)
    e, up = path
    for dt in _accepted():
        q, k, v = (a.astype(dt) for a in _problem(rng))
        if np.dtype(dt).name == "bfloat16" and not up:
            with pytest.raises(TypeError, match="`query`"):
                sdpa_jvp((q, k, v), (q, k, v), upcast=up, **e)
            continue
        out, t = sdpa_jvp((q, k, v), (q, None, v.astype(np.float32)), upcast=up, **e)
        assert out.dtype == t.dtype == np.dtype(dt) and np.isfinite(t.astype(np.float64)).all()


# ------------------------------------------------------------------ refused


def _refused():
    dts = [np.int64, np.int32, np.uint8, np.bool_, np.complex128, np.complex64, np.object_]
    if np.dtype(np.longdouble).itemsize > 8:
        dts.append(np.longdouble)
    if ml_dtypes is not None:
        dts += [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4]
    return dts


def _not_numpys(exc):
    """The error is the package's, in its style, not one NumPy raised from deep inside."""
    msg = str(exc.value)
    assert msg.startswith("`") and " should " in msg and ", but got " in msg, msg
    assert "einsum" not in msg and "ufunc" not in msg and "reshape" not in msg, msg


@pytest.mark.parametrize("dt", _refused(), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_refused_dtypes_raise_one_type_error_naming_the_argument(dt, path):
    rng = np.random.default_rng(3)
    arrays = dict(zip(("query", "key", "value"), _problem(rng)))
    for name in arrays:
        args = dict(arrays, **{name: arrays[name].astype(dt)})
        with pytest.raises(TypeError, match=f"`{name}` should have dtype float64, float32, float16 or bfloat16, "
                                            f"but got {np.dtype(dt).name}") as exc:
            _run(args["query"], args["key"], args["value"], path)
        _not_numpys(exc)
    e, up = path
    with pytest.raises(TypeError, match="`query`") as exc:
        scaled_dot_product_attention(arrays["query"].astype(dt), arrays["key"], arrays["value"], upcast=up, **e)
    _not_numpys(exc)


@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_refused_dtypes_of_the_other_arrays(path):
    rng = np.random.default_rng(4)
    q, k, v = _problem(rng)
    bad = [np.int64, np.complex128] + ([ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn] if ml_dtypes else [])
    for dt in bad:
        for name, val in (("attn_mask", np.zeros((3, 5))), ("bias", np.zeros((3, 5))), ("alibi_slopes", np.ones(2))):
            with pytest.raises(TypeError, match=f"`{name}` should have dtype") as exc:
                _run(q, k, v, path, **{name: val.astype(dt)})
            _not_numpys(exc)
    cases = [("bias", np.zeros((3, 5), bool)), ("dropout_mask", np.ones((3, 5), np.int64)),
             ("dropout_mask", np.ones((3, 5), np.float64)), ("q_lengths", np.array([2.0])),
             ("kv_lengths", np.array([True])), ("q_lengths", np.ma.masked_array([2], mask=[True])),
             ("kv_lengths", [[1, 2], [3]])]                                   # a ragged list
    for name, val in cases:
        opts = dict(dropout_p=0.5) if name == "dropout_mask" else {}
        with pytest.raises(TypeError, match=f"`{name}` should") as exc:
            _run(q, k, v, path, **{name: val}, **opts)
        _not_numpys(exc)
    out, res = sdpa_forward(q, k, v, upcast=path[1], **path[0])
    for dt in bad:
        with pytest.raises(TypeError, match="`grad_out` should have dtype") as exc:
            sdpa_backward(res, np.ones(out.shape).astype(dt))
        _not_numpys(exc)


@pytest.mark.parametrize("path", JVP_PATHS, ids=_ids)
def test_refused_tangents(path):
    q, k, v = _problem(np.random.default_rng(5))
    e, up = path
    bad = [np.int64, np.complex128] + ([ml_dtypes.float8_e5m2] if ml_dtypes else [])
    for dt in bad:
        with pytest.raises(TypeError, match="`tangents\\[1\\]` should have dtype") as exc:
            sdpa_jvp((q, k, v), (None, k.astype(dt), None), upcast=up, **e)
        _not_numpys(exc)
        with pytest.raises(TypeError, match="`query`"):
            sdpa_jvp((q.astype(dt), k, v), (None, None, None), upcast=up, **e)


@needs_ml
@pytest.mark.parametrize("dt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_fp8_is_refused_with_the_hint_to_dequantize(dt, path):
    from sdpa_ref.harness.lowp import dequantized, quantize

    q, k, v = _problem(np.random.default_rng(6))
    (q8, qd), (k8, kd), (v8, vd) = (quantize(a, getattr(ml_dtypes, dt), 2) for a in (q, k, v))
    with pytest.raises(TypeError, match=f"`query` should have dtype .*, but got {dt}; .*dequantize") as exc:
        _run(q8, k8, v8, path)
    assert "descale" in str(exc.value)
    # the harness's way: multiply by the descales, then hand the reference float64
    inp = dequantized(dict(query=q8, key=k8, value=v8, q_descale=qd, k_descale=kd, v_descale=vd))
    out, _, g = _run(inp["query"], inp["key"], inp["value"], path)
    assert out.dtype == np.float64 and np.isfinite(g.query).all()


def test_the_complex_step_path_still_takes_complex_and_refuses_fp8():
    q, k, v = _problem(np.random.default_rng(8))
    h = 1e-30
    t = np.random.default_rng(9).standard_normal(q.shape)
    got = sdpa_forward_complex(q + 1j * h * t, k.astype(np.complex64), v, method="plain").imag / h
    want = sdpa_jvp((q, k, v), (t, None, None), method="plain")[1]
    np.testing.assert_allclose(got, want, rtol=F32, atol=F32_ATOL)                # k in complex64: its rounding
    with pytest.raises(TypeError, match="`value` should have dtype .*complex"):
        sdpa_forward_complex(q, k, v.astype(np.int64))
    if ml_dtypes is not None:
        with pytest.raises(TypeError, match="`query` should .*dequantize"):
            sdpa_forward_complex(q.astype(ml_dtypes.float8_e4m3fn), k, v)


# ---------------------------------------------------------------- zero sizes

ZERO = {  # (lead, L, S, E, Ev)
    "L=0": ((2, 2), 0, 4, 3, 2), "S=0": ((2, 2), 3, 0, 3, 2), "E=0": ((2, 2), 3, 4, 0, 2),
    "Ev=0": ((2, 2), 3, 4, 3, 0), "batch=0": ((0, 2), 3, 4, 3, 2), "heads=0": ((2, 0), 3, 4, 3, 2),
}


def _zero_results(shape, policy, path, dt, jvp_path=None):
    lead, L, S, E, Ev = shape
    rng = np.random.default_rng(10)
    q, k, v = (a.astype(dt) for a in _problem(rng, lead, L, S, E, Ev))
    opts = dict(fully_masked=policy, bias=np.ones((L, S), dt), q_lengths=np.array([L, L // 2])[:lead[0]])
    e, up = path
    out, lse = scaled_dot_product_attention(q, k, v, return_lse=True, upcast=up, **e, **opts)
    out2, res = sdpa_forward(q, k, v, upcast=up, **e, **opts)
    g = sdpa_backward(res, np.ones(out.shape, dt))
    r = dict(out=out, out2=out2, lse=lse, dq=g.query, dk=g.key, dv=g.value, dbias=g.bias)
    if jvp_path is not None:
        je, jup = jvp_path
        r["jvp_out"], r["tangent"] = sdpa_jvp((q, k, v), (q, k, v, opts["bias"]), upcast=jup, **je, **opts)
        r["tangent_none"] = sdpa_jvp((q, k, v), (None, None, None), upcast=jup, **je, **opts)[1]
    return r


@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("policy", ["zero", "nan"])
@pytest.mark.parametrize("case", list(ZERO))
def test_zero_sizes_agree_on_every_path(case, policy, dt):
    shape = ZERO[case]
    want = _zero_results(shape, policy, (dict(method="plain"), True), dt, (dict(method="plain"), True))
    for i, path in enumerate(PATHS):
        jp = JVP_PATHS[i % len(JVP_PATHS)]
        got = _zero_results(shape, policy, path, dt, jp)
        for n, w in want.items():
            x = got[n]
            assert x.shape == w.shape and x.dtype == w.dtype == np.dtype(dt), (path, n, x.shape, w.shape)
            tol = F64_GRAD if dt == np.float64 else F32_SCHEDULES
            np.testing.assert_allclose(x, w, rtol=tol, atol=tol, err_msg=f"{_ids(path)} {n}")
    if case == "S=0":
        nan = policy == "nan"
        lead, L = shape[0], shape[1]
        live = np.arange(L)[None, None, :, None] < np.array([L, L // 2])[:, None, None, None]   # q_lengths
        for n in ("out", "dq", "tangent"):
            np.testing.assert_array_equal(np.isnan(want[n]), np.broadcast_to(live & nan, want[n].shape))
            assert (want[n][~np.isnan(want[n])] == 0).all()
        assert not want["tangent_none"].any() and np.isneginf(want["lse"]).all()


@pytest.mark.parametrize("policy", ["zero", "nan"])
def test_no_keys_is_a_fully_masked_row(policy):
    """S = 0 gives what S = 2 with every key masked out gives, on the entries both have."""
    rng = np.random.default_rng(11)
    q, k, v = _problem(rng, (2, 2), 3, 2, 3, 2)
    ql = np.array([3, 1])
    t = rng.standard_normal(q.shape)
    for path in PATHS:
        e, up = path
        masked = dict(fully_masked=policy, q_lengths=ql, upcast=up, **e)
        out1, res1 = sdpa_forward(q, k, v, attn_mask=np.zeros((3, 2), bool), **masked)
        out0, res0 = sdpa_forward(q, k[..., :0, :], v[..., :0, :], **masked)
        np.testing.assert_array_equal(out0, out1)
        g1 = sdpa_backward(res1, np.ones(out1.shape))
        g0 = sdpa_backward(res0, np.ones(out0.shape))
        np.testing.assert_array_equal(g0.query, g1.query)
    for e, up in JVP_PATHS:
        masked = dict(fully_masked=policy, q_lengths=ql, upcast=up, **e)
        for ts in ((t, None, None), (None, None, None)):
            t1 = sdpa_jvp((q, k, v), ts, attn_mask=np.zeros((3, 2), bool), **masked)[1]
            t0 = sdpa_jvp((q, k[..., :0, :], v[..., :0, :]), ts, **masked)[1]
            np.testing.assert_array_equal(t0, t1)


@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_uniform_without_keys_is_the_same_error_everywhere(path):
    q, k, v = _problem(np.random.default_rng(12), S=0)
    with pytest.raises(ValueError, match="`fully_masked` should not be 'uniform' when S == 0"):
        sdpa_forward(q, k, v, fully_masked="uniform", upcast=path[1], **path[0])


# ---------------------------------------------------------------- no mutation


@pytest.mark.parametrize("path", PATHS, ids=_ids)
def test_no_input_is_mutated(path):
    rng = np.random.default_rng(13)
    q, k, v = _problem(rng)
    q[0, 0, 1, 2] = np.nan                                              # poison is scrubbed in the own copies
    arrays = dict(query=q, key=k, value=v, attn_mask=rng.standard_normal((3, 5)), bias=rng.standard_normal((3, 5)),
                  alibi_slopes=np.array([0.5, 0.25]), q_lengths=np.array([2]), kv_lengths=np.array([4]),
                  dropout_mask=rng.random((3, 5)) > 0.3, grad_out=rng.standard_normal((1, 2, 3, 3)))
    arrays["grad_out"][0, 1, 0, 0] = np.inf
    before = {n: a.copy() for n, a in arrays.items()}
    e, up = path
    a = dict(arrays)
    g_out = a.pop("grad_out")
    out, res = sdpa_forward(a.pop("query"), a.pop("key"), a.pop("value"), dropout_p=0.3, upcast=up, **e, **a)
    sdpa_backward(res, g_out)
    a = dict(arrays)
    a.pop("grad_out")
    sdpa_jvp((a.pop("query"), a.pop("key"), a.pop("value")), (np.ones_like(q), None, None, a["bias"]),
             dropout_p=0.3, upcast=up, **e, **a)
    for n, b in before.items():
        np.testing.assert_array_equal(arrays[n], b, err_msg=n)


mpmath = pytest.importorskip("mpmath")


HOWS = {"plain": {"method": "plain"}, "fast": {"method": "fast"}, "tiled": {"block_size": 2},
        "reproducible": {"precision": "reproducible"}}


#: The bound, in units of 2**-53 of each entry's magnitude ``A``: the formula evaluated with absolute values
#: (``sum_j P_ij |v_je|`` for ``out``, ``|s| sum_j P_ij (|dP_ij| + |D_i|) sech^2_ij (1 + 2 |raw_ij| / cap) |k_je|``
#: for ``dq``, with ``|dP_ij| = sum_e |g_ie v_je|`` and ``|raw_ij| = |s| sum_e |q_ie k_je|``, and so on). Every
#: engine evaluates a short chain -- a dot product of E <= 4 terms, ``exp`` within an ulp, a sum of S <= 6 terms,
#: the softmax VJP's subtraction, softcap's slope to a few ulps -- each step adding a relative 2**-53 of what it
#: works on, so an honest float64 evaluation is within a few units of ``2**-53 A``. (The rounding of a raw score
#: moves ``sech^2`` by ``2 |raw| / cap`` times as much, relatively: hence that factor. The scores are chosen so
#: that their rounding moves ``P`` by no more than that: bounded by softcap, tied exactly or far apart.)
#: ``1 - tanh^2`` instead is off by 2**-53 of 1, ``1 / sech^2`` (1e6 to 1e40) times too much on a saturated entry.
ULPS = 8


EPS = 2.0 ** -53


def _mp(x):
    return mpmath.mpf(float(x))


def _reference(q, k, v, g, scale, softcap=None, slopes=None, tangents=None):
    """``{name: (truth, magnitude A)}`` as float64 arrays: out, lse, dq, dk, dv and the JVP, in 100 digits."""
    with mpmath.workdps(100):
        B, H, L, E = q.shape
        S, Ev = v.shape[-2], v.shape[-1]
        s = _mp(scale)
        res = {n: np.zeros(shape, dtype=object) for n, shape in
               (("out", (B, H, L, Ev)), ("lse", (B, H, L)), ("dq", q.shape), ("dk", k.shape), ("dv", v.shape),
                ("jvp", (B, H, L, Ev)))}
        mag = {n: np.zeros(a.shape, dtype=object) for n, a in res.items()}
        for b, h, i in np.ndindex(B, H, L):
            raw = [s * mpmath.fsum(_mp(q[b, h, i, e]) * _mp(k[b, h, j, e]) for e in range(E)) for j in range(S)]
            araw = [abs(s) * mpmath.fsum(abs(_mp(q[b, h, i, e]) * _mp(k[b, h, j, e])) for e in range(E))
                    for j in range(S)]
            T, d, kd, aT = list(raw), [mpmath.mpf(1)] * S, [mpmath.mpf(1)] * S, list(araw)
            if softcap is not None:
                c = _mp(softcap)
                T = [c * mpmath.tanh(x / c) for x in raw]
                d = [mpmath.sech(x / c) ** 2 for x in raw]
                kd = [1 + 2 * a / c for a in araw]                  # sech^2's condition to its argument's rounding
                aT = [abs(T[j]) + d[j] * araw[j] for j in range(S)]
            if slopes is not None:
                T = [T[j] - _mp(slopes[h]) * abs(i - j) for j in range(S)]
                aT = [aT[j] + abs(_mp(slopes[h])) * abs(i - j) for j in range(S)]
            m = max(T)
            w = [mpmath.exp(t - m) for t in T]
            tot = mpmath.fsum(w)
            P = [x / tot for x in w]
            res["lse"][b, h, i] = m + mpmath.log(tot)
            mag["lse"][b, h, i] = abs(res["lse"][b, h, i]) + mpmath.fsum(P[j] * aT[j] for j in range(S)) + 1
            gi = [_mp(x) for x in g[b, h, i]]
            dP = [mpmath.fsum(gi[e] * _mp(v[b, h, j, e]) for e in range(Ev)) for j in range(S)]
            adP = [mpmath.fsum(abs(gi[e] * _mp(v[b, h, j, e])) for e in range(Ev)) for j in range(S)]
            D = mpmath.fsum(P[j] * dP[j] for j in range(S))
            aD = mpmath.fsum(P[j] * adP[j] for j in range(S))
            dT = [P[j] * (dP[j] - D) * d[j] for j in range(S)]
            adT = [P[j] * (adP[j] + aD) * d[j] * kd[j] for j in range(S)]
            for e in range(Ev):
                res["out"][b, h, i, e] = mpmath.fsum(P[j] * _mp(v[b, h, j, e]) for j in range(S))
                mag["out"][b, h, i, e] = mpmath.fsum(P[j] * abs(_mp(v[b, h, j, e])) for j in range(S))
                for j in range(S):
                    res["dv"][b, h, j, e] += P[j] * gi[e]
                    mag["dv"][b, h, j, e] += P[j] * abs(gi[e])
            for e in range(E):
                res["dq"][b, h, i, e] = s * mpmath.fsum(dT[j] * _mp(k[b, h, j, e]) for j in range(S))
                mag["dq"][b, h, i, e] = abs(s) * mpmath.fsum(adT[j] * abs(_mp(k[b, h, j, e])) for j in range(S))
                for j in range(S):
                    res["dk"][b, h, j, e] += s * dT[j] * _mp(q[b, h, i, e])
                    mag["dk"][b, h, j, e] += abs(s) * adT[j] * abs(_mp(q[b, h, i, e]))
            if tangents is not None:
                tq, tk, tv = tangents
                dr = [s * mpmath.fsum(_mp(tq[b, h, i, e]) * _mp(k[b, h, j, e]) + _mp(q[b, h, i, e])
                                      * _mp(tk[b, h, j, e]) for e in range(E)) for j in range(S)]
                adr = [abs(s) * mpmath.fsum(abs(_mp(tq[b, h, i, e]) * _mp(k[b, h, j, e])) + abs(
                    _mp(q[b, h, i, e]) * _mp(tk[b, h, j, e])) for e in range(E)) for j in range(S)]
                dt = [d[j] * dr[j] for j in range(S)]
                Dt = mpmath.fsum(P[j] * dt[j] for j in range(S))
                aDt = mpmath.fsum(P[j] * d[j] * kd[j] * adr[j] for j in range(S))
                for e in range(Ev):
                    res["jvp"][b, h, i, e] = mpmath.fsum(P[j] * (dt[j] - Dt) * _mp(v[b, h, j, e])
                                                         + P[j] * _mp(tv[b, h, j, e]) for j in range(S))
                    mag["jvp"][b, h, i, e] = mpmath.fsum(P[j] * (d[j] * kd[j] * adr[j] + aDt) * abs(_mp(v[b, h, j, e]))
                                                         + P[j] * abs(_mp(tv[b, h, j, e])) for j in range(S))
        return {n: (np.vectorize(float)(res[n]), np.vectorize(float)(mag[n])) for n in res}


def _results(how, q, k, v, g, tangents, **opts):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, res = sdpa_ref.sdpa_forward(q, k, v, **opts, **HOWS[how])
        gr = sdpa_ref.sdpa_backward(res, g)
        got = {"out": out, "lse": res.lse, "dq": gr.query, "dk": gr.key, "dv": gr.value}
        got["jvp"] = sdpa_ref.sdpa_jvp((q, k, v), tangents, **opts, **HOWS[how])[1]
    return got


def _corner(name):
    """``(q, k, v, opts)`` of a named corner, float64, fixed seeds."""
    rng = np.random.default_rng(sorted(CORNERS).index(name))
    return CORNERS[name](rng)


def _softcap_saturated(rng):
    # raw scores of about 16 against cap 1: tanh is 1 within 1e-14 .. 1e-28; row 0 of head 1 saturated throughout
    q, k, v = rng.standard_normal((1, 2, 3, 4)) * 4, rng.standard_normal((1, 2, 5, 4)) * 4, rng.standard_normal(
        (1, 2, 5, 3))
    q[0, 1, 0] *= 3
    return q, k, v, {"softcap": 1.0}


def _softcap_overflowing(rng):
    # q.k overflows to +-inf for some keys (tanh = +-1 there, slope 0) and is O(1) for others
    q = rng.standard_normal((1, 1, 3, 3))
    q[..., 0] = [1e200, -1e200, 2e200]
    k = rng.standard_normal((1, 1, 4, 3))
    k[..., 0] = [1e200, 0.0, -1e200, 0.0]
    return q, k, rng.standard_normal((1, 1, 4, 2)), {"softcap": 5.0}


def _large_scores(rng):
    # scale q.k near 1e300: far apart (P one-hot) or tied exactly (P = 1/2, nonzero gradients)
    q = rng.standard_normal((1, 2, 3, 4)) * 1e150
    k = rng.standard_normal((1, 2, 5, 4)) * 1e150
    k[:, :, 3] = k[:, :, 1]
    q[:, :, 1] = k[:, :, 1] * 2.0 ** -8
    return q, k, rng.standard_normal((1, 2, 5, 3)), {}


def _large_scale(rng):
    # q.k of order 1, scale 1e300: scale * Q K^T near 1e300 (the JVP's tangents small enough that its scores'
    # tangent stays in the double-double range, 2**995: beyond, the reproducible engine says it cannot)
    q, k = rng.standard_normal((1, 1, 3, 4)), rng.standard_normal((1, 1, 4, 4))
    k[:, :, 2] = k[:, :, 0]
    q[:, :, 0] = k[:, :, 0]
    return q, k, rng.standard_normal((1, 1, 4, 3)), {"scale": 1e300, "tangent_scale": 1e-3}


def _alibi_extreme(rng):
    # slopes 1e308 (a distance of 2 overflows the term: -inf), 1e3, 1e-300 (no effect) and an ordinary one
    q, k, v = rng.standard_normal((1, 4, 4, 3)), rng.standard_normal((1, 4, 6, 3)), rng.standard_normal((1, 4, 6, 2))
    return q, k, v, {"alibi_slopes": np.array([1e308, 1e3, 1e-300, 0.5])}


CORNERS = {"softcap-saturated": _softcap_saturated, "softcap-overflowing": _softcap_overflowing,
           "large-scores": _large_scores, "large-scale": _large_scale, "alibi-extreme": _alibi_extreme}


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(name):
        if name not in cache:
            q, k, v, o = _corner(name)
            ts = o.pop("tangent_scale", 1.0)
            rng = np.random.default_rng(99)
            g = rng.standard_normal(q.shape[:-1] + (v.shape[-1],))
            tangents = tuple(rng.standard_normal(x.shape) * ts for x in (q, k, v))
            scale = o.get("scale", 1.0 / np.sqrt(q.shape[-1]))
            ref = _reference(q, k, v, g, scale, o.get("softcap"), o.get("alibi_slopes"), tangents)
            cache[name] = (q, k, v, o, g, tangents, ref)
        return cache[name]
    return get


@pytest.mark.parametrize("how", list(HOWS))
@pytest.mark.parametrize("corner", list(CORNERS))
def test_corners_agree_with_mpmath_to_a_few_ulps(references, corner, how):
    q, k, v, o, g, tangents, ref = references(corner)
    got = _results(how, q, k, v, g, tangents, **o)
    for n, x in got.items():
        truth, mag = ref[n]
        err = np.abs(x - truth)
        bad = ~(err <= ULPS * EPS * mag)
        assert not bad.any(), (f"{corner}, {how}: {n} off by {np.max(err[bad] / (EPS * mag[bad])):.3g} units of "
                               f"2**-53 times its magnitude at {np.argwhere(bad)[:3].tolist()}: "
                               f"{x[bad][:3]} vs {truth[bad][:3]}")


@pytest.mark.parametrize("how", list(HOWS))
def test_a_float_mask_plus_bias_that_overflows_to_minus_inf_excludes_the_key_on_every_engine(how):
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((1, 2, 3, 4)) for _ in range(4))
    over = np.zeros((3, 3))
    over[0, 1] = over[2, :] = -1e308                                # row 2: every key overflows
    ninf = np.where(over < 0, -np.inf, 0.0)
    runs = []
    for mask in (over, ninf):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, res = sdpa_ref.sdpa_forward(q, k, v, attn_mask=mask, bias=over, **HOWS[how])
            gr = sdpa_ref.sdpa_backward(res, g)
        runs.append((out, res.lse, gr.query, gr.key, gr.value, gr.attn_mask, gr.bias))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    out, lse = runs[0][:2]
    assert np.all(out[:, :, 2] == 0) and np.all(lse[:, :, 2] == -np.inf)     # fully masked, "zero"


def test_the_reproducible_engine_says_when_it_has_no_finite_faithful_answer():
    q, k, v = np.ones((1, 1, 2, 2)), np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2))
    q[0, 0, 0, 0], k[0, 0, 1, 0] = 1e200, 1e200                    # scale q.k = +inf on an allowed key
    with pytest.raises(ValueError, match="cannot give a finite, faithfully rounded"):
        sdpa_ref.sdpa_forward(q, k, v, precision="reproducible")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.isnan(sdpa_ref.sdpa_forward(q, k, v)[0][0, 0, 0]).all()          # IEEE's answer on the fast path
    out = sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", softcap=4.0)[0]   # finite under softcap
    assert np.isfinite(out).all()
    big = np.full((1, 1, 2, 2), 1e300)                              # grad_out V^T beyond the dd range
    _, res = sdpa_ref.sdpa_forward(np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)), big, precision="reproducible")
    with pytest.raises(ValueError, match="cannot give a finite, faithfully rounded dq"):
        sdpa_ref.sdpa_backward(res, big)
