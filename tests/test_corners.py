"""The corners of float64 on every engine, against mpmath: a gold standard at least as accurate as what it judges.

Saturated softcap rows (``1 - tanh^2`` cancels there: it was 4.3% off on plain, fast and tiled), raw scores that
overflow under softcap, scores near ``1e300`` after scaling, extreme ALiBi slopes. The reference here is the
formula of SEMANTICS.md in 100-digit mpmath, with softcap's derivative taken as ``sech^2`` (exact at any
saturation). Where a finite faithful answer does not exist the reproducible engine says so with a ValueError, and
a score that is ``-inf`` in float64 (a float mask plus a bias overflowing) excludes its key on every engine.
"""

import warnings

import numpy as np
import pytest

import sdpa_ref

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
