"""The split-KV schedule on large scores, its warnings and its arguments (issue 40).

The split engine's forward walks each split's keys; its backward and JVP recompute the scores block by block.
A score recomputed with another block shape can differ from the forward's by an ulp, and at scores of ``1e17``
an ulp is 16: ``e^(T - m)`` with the forward's row max ``m`` was then ``e^16`` or ``e^-16`` where it should be 1
(``inf`` and NaN from ``1e20`` on). Here the forward, LSE, backward (``grad_lse`` too) and JVP of the split
engine, with several ``num_splits`` and block sizes, dominant keys and a dominant sink, are checked against a
plain mpmath oracle at 50 digits and against the unsplit engines, at scores from ``1e10`` to ``1e300``.

The bound (:data:`ULPS`): every entry within ``ULPS * eps`` of the sum of the absolute values of the terms that
make it (its envelope, computed by the oracle). A computed sum of ``n`` terms is within ``n eps`` of that sum
(Higham, 2002, section 4.2); here a quantity is a few such sums over ``S = 5`` keys and ``E = 3`` features, an
``exp`` within 1 ulp and a division, so 16 ulps hold with room and an error of one ulp in a score at ``1e15``
(``e^0.125``: 13%) is caught by a factor of about ``10^13``. The scores themselves are exact in float64 in the
``exact`` family (integers and powers of two, ``scale=1``), so the probabilities there are not one-hot and the
bound holds on every entry; in the ``rounded`` family (random inputs, the default scale) a score is rounded and
every row is one key's (the gaps are ``1e9`` at least), which is where the ulp between two block shapes did
its damage.
"""

import warnings

import mpmath
import numpy as np
import pytest

from sdpa_ref import sdpa_backward, sdpa_backward_jvp, sdpa_forward, sdpa_jvp, split_kv_partials

#: Each entry within ULPS * eps of its envelope (see the module docstring for why 16).
ULPS = 16
EPS = np.finfo(np.float64).eps
SCALES = (1e10, 1e15, 1e17, 1e20, 1e100, 1e300)
L, S, E = 2, 5, 3
#: (num_splits, block_size) of the split engine: splits of 3, 2 and 1 keys, blocks that cut them.
SPLITS = ((2, 1), (2, 2), (3, 2), (3, 4), (5, 3), (2, "auto"))


def _problem(family, C, sink):
    """``(q, k, v, scale, sinks, dO, dlse, tangents)`` of one head, ``(1, L, E)`` etc., scores of about ``C``."""
    rng = np.random.default_rng(int(np.log10(C)) * 7 + len(sink))
    v, dO = rng.standard_normal((1, S, E)), rng.standard_normal((1, L, E))
    dlse = rng.standard_normal((1, L))
    if family == "exact":                               # T_ij = C2 + u (a_i . b_j), every product and sum exact
        c = int(round(np.log2(C)))
        C2, ue = 2.0 ** c, max(0, c - 52)
        a, b = rng.integers(-2, 3, (L, 2)), rng.integers(-2, 3, (S, 2))
        q = np.concatenate([np.full((L, 1), 2.0 ** (c // 2)), a * 2.0 ** (ue // 2)], axis=1)[None]
        k = np.concatenate([np.full((S, 1), 2.0 ** (c - c // 2)), b * 2.0 ** (ue - ue // 2)], axis=1)[None]
        scale, u = 1.0, 2.0 ** ue
    else:                                               # random directions: rounded scores, one key per row
        q, k = rng.standard_normal((1, L, E)), rng.standard_normal((1, S, E))
        r = np.sqrt(C / np.max(np.abs(q[0] @ k[0].T / np.sqrt(E))))
        q, k, scale, C2, u = q * r, k * r, None, C, 0.0
    sinks = {"": None, "dominant": np.array([2.0 * C2]), "near": np.array([C2 + 3 * u]),
             "low": np.array([-C2])}[sink]
    tq, tk, tv = (rng.standard_normal(x.shape) * np.max(np.abs(x)) for x in (q, k, v))
    tangents = (tq, tk, tv, None, None if sinks is None else np.array([rng.standard_normal() * C2]))
    return q, k, v, scale, sinks, dO, dlse, tangents


def _oracle(q, k, v, scale, sinks, dO, dlse, tangents):
    """The forward, LSE, gradients and output tangent of one head by a loop in mpmath at 50 digits, each with its
    envelope (the sum of the absolute values of its terms): ``{name: (value, envelope)}`` as float arrays."""
    mp = mpmath.mp
    with mpmath.workdps(50):
        F = lambda x: [[mp.mpf(float(t)) for t in row] for row in x[0]]   # noqa: E731
        q_, k_, v_, g_, tq, tk, tv = (F(x) for x in (q, k, v, dO) + tuple(tangents[:3]))
        lam = [mp.mpf(float(t)) for t in dlse[0]]
        s = mp.mpf(1) / mp.sqrt(E) if scale is None else mp.mpf(scale)
        sig = None if sinks is None else mp.mpf(float(sinks[0]))
        dsig = None if sinks is None else mp.mpf(float(tangents[4][0]))
        dot = lambda x, y: mp.fsum(a * b for a, b in zip(x, y))        # noqa: E731
        adot = lambda x, y: mp.fsum(abs(a * b) for a, b in zip(x, y))  # noqa: E731
        res = {n: (np.zeros(shape), np.zeros(shape)) for n, shape in (
            ("out", (L, E)), ("lse", (L,)), ("dq", (L, E)), ("dk", (S, E)), ("dv", (S, E)), ("dsinks", (1,)),
            ("jvp", (L, E)))}

        def put(name, idx, val, env):
            res[name][0][idx] += float(val)
            res[name][1][idx] += float(env)

        for i in range(L):
            T = [s * dot(q_[i], k_[j]) for j in range(S)]
            m = max(T + ([] if sig is None else [sig]))
            w = [mp.exp(t - m) for t in T]
            ws = mp.mpf(0) if sig is None else mp.exp(sig - m)
            Z = mp.fsum(w) + ws
            P, ps = [x / Z for x in w], ws / Z
            put("lse", i, m + mp.log(Z), abs(m + mp.log(Z)) + max(s * adot(q_[i], k_[j]) for j in range(S)))
            dP = [dot(g_[i], v_[j]) for j in range(S)]
            D, gmax = mp.fsum(p * d for p, d in zip(P, dP)), max(abs(d) for d in dP)
            dT = [P[j] * (dP[j] - D + lam[i]) for j in range(S)]
            eT = [P[j] * (abs(dP[j]) + gmax + abs(lam[i])) for j in range(S)]     # dT's envelope (|pivot| <= gmax)
            if sig is not None:
                put("dsinks", 0, ps * (-D + lam[i]), ps * (gmax + abs(lam[i])))
            Tt = [s * (dot(tq[i], k_[j]) + dot(q_[i], tk[j])) for j in range(S)]  # the scores' tangent
            eTt = [s * (adot(tq[i], k_[j]) + adot(q_[i], tk[j])) for j in range(S)]
            Ct = mp.fsum(p * t for p, t in zip(P, Tt)) + (0 if sig is None else ps * dsig)
            dPt = [P[j] * (Tt[j] - Ct) for j in range(S)]
            ePt = [P[j] * (eTt[j] + max(eTt) + (0 if sig is None else abs(dsig))) for j in range(S)]
            for e in range(E):
                put("out", (i, e), mp.fsum(P[j] * v_[j][e] for j in range(S)),
                    mp.fsum(P[j] * abs(v_[j][e]) for j in range(S)))
                put("dq", (i, e), s * mp.fsum(dT[j] * k_[j][e] for j in range(S)),
                    s * mp.fsum(eT[j] * abs(k_[j][e]) for j in range(S)))
                put("jvp", (i, e), mp.fsum(dPt[j] * v_[j][e] + P[j] * tv[j][e] for j in range(S)),
                    mp.fsum(ePt[j] * abs(v_[j][e]) + P[j] * abs(tv[j][e]) for j in range(S)))
                for j in range(S):
                    put("dk", (j, e), s * dT[j] * q_[i][e], s * eT[j] * abs(q_[i][e]))
                    put("dv", (j, e), P[j] * g_[i][e], P[j] * abs(g_[i][e]))
    return res


def _run(q, k, v, scale, sinks, dO, dlse, tangents, **how):
    """``{name: array}`` of one engine (``how``: its method and settings), every warning an error."""
    opts = dict(scale=scale, sinks=sinks, **how)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, res = sdpa_forward(q, k, v, **opts)
        g = sdpa_backward(res, dO, grad_lse=dlse)
        _, jv = sdpa_jvp((q, k, v), tangents if sinks is not None else tangents[:3], **opts)
    got = {"out": out[0], "lse": res.lse[0], "dq": g.query[0], "dk": g.key[0], "dv": g.value[0], "jvp": jv[0]}
    if sinks is not None:
        got["dsinks"] = g.sinks
    return got


def _second(q, k, v, scale, sinks, dO, dlse, tangents):
    """The gradients that the double backward (``sdpa_backward_jvp``) returns with their tangent, plain and tiled
    (``{name: array}``, the tiled ones as ``name@tiled``): the first-order part of the second-order schedules
    (along ``v``'s tangent alone, which the gradients do not read: the scores' tangents at ``1e300`` overflow)."""
    opts = dict(scale=scale, sinks=sinks)
    got = {}
    for tag, how in (("", {"method": "plain"}), ("@tiled", {"block_size": 2})):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            g = sdpa_backward_jvp((q, k, v), (None, None, v), dO, grad_lse=dlse, **opts, **how)[0]
        got.update({"dq" + tag: g.query[0], "dk" + tag: g.key[0], "dv" + tag: g.value[0]})
        if sinks is not None:
            got["dsinks" + tag] = g.sinks
    return got


def _assert_within(got, ref, what):
    for name, x in got.items():
        val, env = ref[name.split("@")[0]]
        err = np.abs(x - val)
        bad = ~(err <= ULPS * EPS * env)                          # NaN fails too
        assert not np.any(bad), (f"{what}: {name} off by {np.max(err / np.maximum(env, 1e-300)):.3g} of its "
                                 f"envelope (bound {ULPS * EPS:.3g}); got {x[bad][:3]}, want {val[bad][:3]}")


CASES = [(f, C, s) for C in SCALES for f, s in (("exact", ""), ("exact", "near"), ("exact", "dominant"),
                                                   ("rounded", ""), ("rounded", "dominant"), ("rounded", "low"))]


@pytest.mark.parametrize("family, C, sink", CASES, ids=[f"{f}-{C:.0e}-{s or 'nosink'}" for f, C, s in CASES])
def test_split_engine_against_mpmath_and_the_unsplit_engines_on_large_scores(family, C, sink, monkeypatch):
    """Forward, LSE, backward (with grad_lse) and JVP of the split engine within 16 ulps of their envelopes,
    against mpmath and so within 32 of the unsplit engines; and its backward and JVP are the tiled engine's bit
    for bit at the same block size (its backward recomputes the row's statistics from its own scores)."""
    args = _problem(family, C, sink)
    ref = _oracle(*args)
    for native in ("1", "0"):  # the dense engines: the sink's probability from the closed (m, s), not the rounded LSE
        monkeypatch.setenv("SDPA_REF_NATIVE", native)
        for method in ("fast", "plain"):
            _assert_within(_run(*args, method=method), ref, f"{method} native={native}")
        _assert_within(_second(*args), ref, f"second order native={native}")
    monkeypatch.delenv("SDPA_REF_NATIVE")
    for n, b in SPLITS:
        split = _run(*args, num_splits=n, block_size=b)
        _assert_within(split, ref, f"split n={n} block={b}")
        tiled = _run(*args, block_size=b)
        _assert_within(tiled, ref, f"tiled block={b}")
        for name in ("dq", "dk", "dv", "jvp") + (() if sink == "" else ("dsinks",)):
            assert np.array_equal(split[name], tiled[name]), (name, n, b)


@pytest.mark.parametrize("C", SCALES)
def test_dense_residuals_lse_backward_recomputes_its_own_row_statistics(C):
    """The recomputing backward of dense residuals (save_probs=False, method='lse') walks blocks of rows whose
    shape is not the dense forward's: on rounded scores of C it matches the saved-P backward to rounding."""
    rng = np.random.default_rng(3)
    Lb, Sb = 600, 300                                   # rows cut in blocks of 150: scale q there, k in the forward
    q, k = rng.standard_normal((1, Lb, 3)), rng.standard_normal((1, Sb, 3))
    r = np.sqrt(C / 3.0)
    q, k, v, g = q * r, k * r, rng.standard_normal((1, Sb, 2)), rng.standard_normal((1, Lb, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = sdpa_backward(sdpa_forward(q, k, v)[1], g)
        got = sdpa_backward(sdpa_forward(q, k, v, save_probs=False)[1], g, method="lse")
    for name in ("query", "key", "value"):
        a, b = getattr(got, name), getattr(want, name)
        assert np.all(np.abs(a - b) <= ULPS * EPS * max(np.max(np.abs(b)), np.max(np.abs(v)))), name


def test_no_warning_leaks_from_the_split_engine():
    """Empty splits, fully masked rows, sinks, infinite scores and every policy, under simplefilter('error')."""
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((2, 1, 3, 2)), rng.standard_normal((2, 1, 7, 2)), rng.standard_normal((2, 1, 7, 2))
    mask = rng.random((2, 1, 3, 7)) > 0.6
    mask[0, 0, 1] = False                               # a row with no key
    big = np.array([1e300, -1e300])[:, None, None, None] * np.ones_like(q)
    for policy in ("zero", "nan", "uniform"):
        for extra in ({}, {"sinks": np.array([0.5])}, {"kv_lengths": np.array([0, 4])}, {"softcap": 3.0}):
            for qq in (q, big):
                opts = dict(attn_mask=mask, fully_masked=policy, num_splits=4, block_size=2, **extra)
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    out, res = sdpa_forward(qq, k, v, **opts)
                    sdpa_backward(res, np.ones_like(out), grad_lse=np.ones(out.shape[:-1]))
                    sdpa_jvp((qq, k, v), (q, k, v), **opts)
                    split_kv_partials(qq, k, v, attn_mask=mask, num_splits=4, block_size=2)


@pytest.mark.parametrize("kw, match", [
    (dict(num_splits=10**12), "`num_splits`"),
    (dict(num_splits=2**70), "`num_splits`"),
    (dict(num_splits=np.int64(2**62)), "`num_splits`"),
    (dict(num_splits=np.uint64(2**63)), "`num_splits`"),
    (dict(num_splits=-3), "`num_splits`"),
    (dict(num_splits=3.0), "`num_splits`"),
    (dict(num_splits="3"), "`num_splits`"),
    (dict(num_splits=np.array([3])), "`num_splits`"),
    (dict(split_bounds=np.arange(10**6)), "`split_bounds`"),
])
@pytest.mark.parametrize("entry", ["forward", "partials"])
def test_num_splits_errors_name_the_argument(kw, match, entry):
    """A huge, negative or non-int ``num_splits`` is a ValueError or TypeError naming it, before any allocation
    (``10**12`` splits asked for 7 TiB; ``2**70`` was an OverflowError from NumPy)."""
    x, y = np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 4, 2))
    with pytest.raises((ValueError, TypeError), match=match):
        (sdpa_forward if entry == "forward" else split_kv_partials)(x, y, y, **kw)
