"""MLA's ``qv`` under ``precision="reproducible"``: every result faithfully rounded against 50-digit mpmath,
``dV`` (``V`` read twice: as the values and, through ``qv``, as keys) included where its two uses cancel.

The truth is the joined problem (``[q | qv]`` against ``[k | v]``, values ``v``, scale ``1 / sqrt(E + Ev)``)
in the plain-loop oracle at 50 digits, its two contributions to ``dV`` summed there:
``dV = P^T dO + (dK')_{:, E:}``, and a broadcast key or value's gradient summed over the batch there too.
The cancelling cotangents are built from the linear map ``dO -> dV[j, c]`` (its coefficients by the fast
backward on the basis of ``dO``): ``dO = r - (1 - 2**-30) <G, r> / <G, G> G`` leaves ``2**-30`` of the
entry's size, so two parts rounded apart and added in float64 miss it by millions of ulps, while the
double-double sum, rounded once, is within one.
"""

import numpy as np
import pytest

import sdpa_ref

from helpers import assert_faithful
from oracle import mp_shifted, oracle_attention
from tolerances import F64_FEW_ULP, F64_SUMS

mpmath = pytest.importorskip("mpmath")

#: How much of a cancelling entry is left: well inside the reproducible engine's claim (about 2**45).
CANCEL = 2.0 ** -30
#: The dd arithmetic's 100 bits leave far more than one ulp of margin at this cancellation: a float64 sum of
#: the two rounded parts is off by about 2**-53 / CANCEL = 2**-23 of the entry, so its ulp error is huge.
NAIVE_ULPS = 1000


def _problem(rng, qb=2, kb=2, vb=2, Hq=2, Hkv=2, L=3, S=4, E=2, Ev=3):
    q = rng.standard_normal((qb, Hq, L, E))
    k = rng.standard_normal((kb, Hkv, S, E))
    v = rng.standard_normal((vb, Hkv, S, Ev))
    qv = rng.standard_normal((qb, Hq, L, Ev))
    return q, k, v, qv


def _truth(q, k, v, qv, g, **oracle):
    """The mpmath ``(out, lse, dq, dk, dv, dqv)`` of the qv problem, in the inputs' own shapes (broadcast key
    and value gradients summed over the batch in mpmath), by the joined problem in the plain-loop oracle."""
    E, Ev = q.shape[-1], v.shape[-1]
    B = max(q.shape[0], k.shape[0], v.shape[0])
    kf, vf = np.broadcast_to(k, (B,) + k.shape[1:]), np.broadcast_to(v, (B,) + v.shape[1:])
    q2 = np.concatenate([np.broadcast_to(q, (B,) + q.shape[1:]), np.broadcast_to(qv, (B,) + qv.shape[1:])], -1)
    k2 = np.concatenate([kf, vf], -1)
    out, lse, (dq2, dk2, dv, _) = oracle_attention(q2, k2, vf, grad_out=g, scale=1 / np.sqrt(E + Ev), num="mp",
                                                  **oracle)
    dv = dv + dk2[..., E:]                                    # both uses of V, summed exactly (mpf)

    def to(x, shape):
        return x.sum(axis=0, keepdims=True) if shape[0] == 1 and x.shape[0] != 1 else x
    return out, lse, dq2[..., :E], to(dk2[..., :E], k.shape), to(dv, v.shape), dq2[..., E:]


def _coefficients(q, k, v, qv, which, j):
    """``G`` with ``grads.<which>[j] = <G, dO>``: the backward on the basis of ``dO`` (it is linear in ``dO``)."""
    out, res = sdpa_ref.sdpa_forward(q, k, v, qv=qv)
    G = np.empty(out.shape)
    for i in np.ndindex(out.shape):
        e = np.zeros(out.shape)
        e[i] = 1.0
        G[i] = getattr(sdpa_ref.sdpa_backward(res, e), which)[j]
    return G


def _cancelling(rng, q, k, v, qv, which, j):
    """A cotangent ``dO`` under which ``grads.<which>[j]`` is ``CANCEL`` of its terms' size."""
    G = _coefficients(q, k, v, qv, which, j)
    r = rng.standard_normal(G.shape)
    return r - (1 - CANCEL) * np.sum(G * r) / np.sum(G * G) * G


def _ulps(x, truth):
    """The largest distance of float64 ``x`` from the mpmath ``truth``, in ulps of the truth."""
    worst = 0.0
    for i, t in np.ndenumerate(truth):
        with mpmath.workdps(80):
            d = abs(mpmath.mpf(float(x[i])) - t) / mpmath.mpf(float(np.spacing(abs(float(t)))))
        worst = max(worst, float(d))
    return worst


@pytest.mark.parametrize("j", [(0, 0, 1, 2), (1, 0, 3, 0)])
def test_dv_faithful_where_the_two_uses_of_v_cancel(j):
    rng = np.random.default_rng(40)
    q, k, v, qv = _problem(rng)
    g = _cancelling(rng, q, k, v, qv, "value", j)
    _, res = sdpa_ref.sdpa_forward(q, k, v, qv=qv, precision="reproducible")
    dv = sdpa_ref.sdpa_backward(res, g).value
    truth = _truth(q, k, v, qv, g)[4]
    assert abs(float(truth[j])) < 1e-6 * float(np.max(np.abs(dv)))             # it does cancel
    assert_faithful(dv, truth, "dv")


@pytest.mark.parametrize("which, shapes, j", [
    ("key", dict(kb=1), (0, 0, 2, 1)),                       # one key for both batches: dK summed over them
    ("value", dict(vb=1), (0, 0, 1, 2)),                     # one value: dV's two uses, each over both batches
])
def test_broadcast_key_and_value_faithful_where_the_batch_sum_cancels(which, shapes, j):
    rng = np.random.default_rng(41)
    q, k, v, qv = _problem(rng, **shapes)
    g = _cancelling(rng, q, k, v, qv, which, j)
    _, res = sdpa_ref.sdpa_forward(q, k, v, qv=qv, precision="reproducible")
    got = getattr(sdpa_ref.sdpa_backward(res, g), which)
    truth = _truth(q, k, v, qv, g)[3 if which == "key" else 4]
    assert got.shape == truth.shape
    assert_faithful(got, truth, which)


@pytest.mark.parametrize("opts, oracle", [
    ({}, {}),
    (dict(is_causal=True, enable_gqa=True), dict(is_causal=True)),
    (dict(softcap=2.0, enable_gqa=True), dict(softcap=2.0)),
])
def test_every_reproducible_quantity_with_qv_is_faithful(opts, oracle):
    rng = np.random.default_rng(42)
    q, k, v, qv = _problem(rng, Hkv=1 if opts.get("enable_gqa") else 2)
    g = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    out, res = sdpa_ref.sdpa_forward(q, k, v, qv=qv, precision="reproducible", **opts)
    gr = sdpa_ref.sdpa_backward(res, g)
    t_out, t_lse, t_dq, t_dk, t_dv, t_dqv = _truth(q, k, v, qv, g, **oracle)
    for x, t, what in ((out, t_out, "out"), (res.lse, t_lse, "lse"), (gr.query, t_dq, "dq"),
                       (gr.key, t_dk, "dk"), (gr.value, t_dv, "dv"), (gr.qv, t_dqv, "dqv")):
        assert_faithful(x, t, what)


def test_jvp_with_qv_is_faithful():
    """The output tangent along all four inputs against a 60-digit central difference (error O(h^2) = 1e-40)."""
    rng = np.random.default_rng(43)
    q, k, v, qv = _problem(rng, Hq=1, Hkv=1, L=2, S=3)
    ts = [rng.standard_normal(x.shape) for x in (q, k, v, qv)]
    _, tan = sdpa_ref.sdpa_jvp((q, k, v), (ts[0], ts[1], ts[2], None, None, ts[3]), qv=qv,
                               precision="reproducible")
    ctx = mpmath.MPContext()
    ctx.dps = 60
    h = ctx.mpf(10) ** -20

    def shifted(a, t, sign):
        return mp_shifted(ctx, a, t, sign, h)

    def out_at(sign):
        q2 = np.concatenate([shifted(q, ts[0], sign), shifted(qv, ts[3], sign)], -1)
        vv = shifted(v, ts[2], sign)
        k2 = np.concatenate([shifted(k, ts[1], sign), vv], -1)
        return oracle_attention(q2, k2, vv, scale=1 / np.sqrt(q.shape[-1] + v.shape[-1]), num="mp")[0]

    hi, lo = out_at(1), out_at(-1)
    truth = np.empty(hi.shape, dtype=object)
    for i, a in np.ndenumerate(hi):
        truth[i] = (a - lo[i]) / (2 * h)
    assert_faithful(tan, truth, "jvp")


def test_a_nan_in_v_makes_the_same_gradients_nan_as_the_fast_split():
    """The engine's split gives the values, the API's split the NaN pattern of what reads the poison."""
    rng = np.random.default_rng(44)
    q, k, v, qv = _problem(rng)
    v[1, 0, 2, 1] = np.nan
    g = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    got = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, qv=qv, precision="reproducible")[1], g)
    ref = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, qv=qv)[1], g)
    for x, y in zip(got, ref):
        if y is not None:
            np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
            assert np.any(np.isnan(y)) and not np.all(np.isnan(y))
            np.testing.assert_allclose(x[~np.isnan(x)], y[~np.isnan(y)], rtol=F64_SUMS, atol=F64_FEW_ULP)
