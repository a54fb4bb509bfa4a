"""Dtypes and zero sizes: every engine, precision and ``upcast`` takes the same inputs, refuses the same ones with
the same `TypeError` naming the argument, and gives the same results on empty dims (SEMANTICS.md, "Precision and
dtypes" and "Zero sizes")."""

import numpy as np
import pytest

from sdpa_ref import scaled_dot_product_attention, sdpa_backward, sdpa_forward, sdpa_forward_complex, sdpa_jvp
from tolerances import F32, F32_ATOL, F32_SCHEDULES, F64_GRAD

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
