"""``precision="reproducible"``'s double backward (:mod:`sdpa_ref.engines.reproducible_second`): faithfully rounded
against mpmath on the edges of the softmax and on random problems with every option, in agreement with the plain
second order, and the same bits under every thread and SIMD setting.

The oracles share no formula with the package's second order: each is a plain loop of the *backward* in mpmath,
differentiated along the tangents (inputs and cotangents together) by a central difference at a precision far
above the step's, as in ``tests/test_engines_second.py`` (whose adversarial cases are reused: a dominant key with
its runner-up at ``P = e^-40``, a dominant sink at ``p_sink = 1 - 5e-18``, scores of 1.7e10) plus softcap
saturated at ``|Traw / cap| = 32`` (``sech^2 ~ 1e-27``) and a score function exact in float64 on the case's
scores (``s^2 / 8``, with its two derivatives), each with and without ``grad_lse`` and its tangent.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpa_ref import Packed, ScoreMod, sdpa_backward_jvp, sdpa_hvp

from helpers import assert_close_normwise, assert_faithful, key_spans_case, with_and_without_key_spans
from oracle import mp_shifted, oracle_attention
from strategies import differentiable, variant_problem
from test_engines_second import _case, _dyadic
from tolerances import F64_GRAD

mpmath = pytest.importorskip("mpmath")

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = ("query", "key", "value", "sinks")
#: The edge cases (``tests/test_engines_second.py``'s, and a saturated softcap and a score function). With its
#: scores of 6.7e299 and ``grad_lse``, ``dq'`` is 2e300, beyond the double-double range (about ``2**995``):
#: precision="reproducible" raises there, as in first order, rather than return a NaN.
CASES = ("dominant_key", "dominant_sink", "huge_1e10_key", "huge_1e10_sink", "huge_1e300", "saturated_softcap",
         "score_mod")
#: A score function exact in float64 on the cases' dyadic scores, with both derivatives: ``s^2 / 8``.
SQUARE = ScoreMod(lambda s, b, h, i, j: s * s / 8, grad=lambda s, b, h, i, j: s / 4,
                  grad2=lambda s, b, h, i, j: np.full_like(s, 0.25), name="square")


def _edge_case(name, rng):
    """``(primals, options, tangents)`` of one head ``(1, L, E)``; ``saturated_softcap``: raw scores of +-32 and
    4, 0 under ``softcap=1`` (``tanh`` is 1 - 1e-28 there)."""
    if name == "score_mod":
        # raw scores (0, -6, 14, -2) and (-4, 12, -5, -3) become s^2 / 8: a dominant key at 24.5 and 18
        q = np.array([[1.0, 0.0], [0.0, 1.0]])
        k = np.array([[0.0, -4.0], [-6.0, 12.0], [14.0, -5.0], [-2.0, -3.0]])
        tangents = (_dyadic(rng, 1, 2, 2), _dyadic(rng, 1, 4, 2), _dyadic(rng, 1, 4, 2), None, None)
        return (q[None], k[None], _dyadic(rng, 1, 4, 2)), {"scale": 1.0, "score_mod": SQUARE}, tangents
    if name != "saturated_softcap":
        return _case(name, rng)
    q = np.array([[4.0, 0.0], [0.0, 4.0]])
    k = np.array([[8.0, 0.0], [-8.0, 1.0], [1.0, 8.0], [0.0, -8.0]])
    tangents = (_dyadic(rng, 1, 2, 2), _dyadic(rng, 1, 4, 2), _dyadic(rng, 1, 4, 2), None, None)
    return (q[None], k[None], _dyadic(rng, 1, 4, 2)), {"scale": 1.0, "softcap": 1.0}, tangents


def _mp_backward(mp, q, k, v, sink, dO, lam, scale, cap, square=False):
    """The backward of one head, plainly, in mpmath (rows of mpf): ``(dq, dk, dv, dsink)``, ``dsink`` summed over
    the rows; softcap ``cap`` (None: none) as ``cap tanh(Traw / cap)``, its slope ``1 - tanh^2``; with ``square``
    the score function ``s^2 / 8`` after it (its slope ``s / 4``)."""
    L, E, S, Ev = len(q), len(q[0]), len(k), len(v[0])
    dq = [[mp.mpf(0)] * E for _ in range(L)]
    dk = [[mp.mpf(0)] * E for _ in range(S)]
    dv = [[mp.mpf(0)] * Ev for _ in range(S)]
    dsink = mp.mpf(0)
    for i in range(L):
        raw = [scale * mp.fsum(q[i][e] * k[j][e] for e in range(E)) for j in range(S)]
        th = [mp.tanh(r / cap) for r in raw] if cap is not None else None
        T = [cap * t for t in th] if cap is not None else raw
        U = T
        if square:
            T = [u * u / 8 for u in U]
        m = max(T + ([] if sink is None else [sink]))
        w = [mp.exp(t - m) for t in T]
        ws = mp.mpf(0) if sink is None else mp.exp(sink - m)
        Z = mp.fsum(w) + ws
        P = [x / Z for x in w]
        dP = [mp.fsum(dO[i][e] * v[j][e] for e in range(Ev)) for j in range(S)]
        D = mp.fsum(P[j] * dP[j] for j in range(S))
        li = 0 if lam is None else lam[i]
        for j in range(S):
            dT = P[j] * (dP[j] - D + li)                       # the softmax's VJP with the LSE's cotangent
            dTraw = dT * U[j] / 4 if square else dT
            dTraw = dTraw if cap is None else dTraw * (1 - th[j] ** 2)
            for e in range(Ev):
                dv[j][e] += P[j] * dO[i][e]
            for e in range(E):
                dq[i][e] += scale * dTraw * k[j][e]
                dk[j][e] += scale * dTraw * q[i][e]
        dsink += ws / Z * (li - D)                             # the sink's column: dP = 0
    return dq, dk, dv, dsink


def _mp_second(primals, opts, tangents, dO, lam=None, ddO=None, dlam=None):
    """The exact tangent of the gradients along the tangents and the cotangents' tangents: ``{field: object
    array of mpf}`` (one head, the inputs' shapes), by a central difference of :func:`_mp_backward` in mpmath at
    a step of 1e-40 of the scores and 200 digits more than the scores' own."""
    mp = mpmath.MPContext()
    xs = [primals[0][0], primals[1][0], primals[2][0]]
    ts = [tangents[0][0], tangents[1][0], tangents[2][0]]
    big = max(float(np.max(np.abs(x))) for x in xs)
    tbig = max(float(np.max(np.abs(t))) for t in ts)
    sc, cap, sink, dsink = opts["scale"], opts.get("softcap"), opts.get("sinks"), tangents[4]
    mp.dps = 200 + 2 * int(math.log10(1 + sc * big * big * 2))
    h = mp.mpf(10) ** -40 / mp.mpf(sc * (2 * big * tbig + 1) + 1)

    def moved(a, t, eps):
        return [[mp.mpf(float(x)) + eps * mp.mpf(float(y)) for x, y in zip(rx, rt)]
                for rx, rt in zip(np.atleast_2d(a), np.atleast_2d(t))]

    def at(eps):
        q, k, v = (moved(a, t, eps) for a, t in zip(xs, ts))
        s = None if sink is None else mp.mpf(float(sink[0])) + eps * mp.mpf(float(0 if dsink is None else dsink[0]))
        g = moved(dO[0], np.zeros_like(dO[0]) if ddO is None else ddO[0], eps)
        la = None if lam is None else moved(lam, np.zeros_like(lam) if dlam is None else dlam, eps)[0]
        return _mp_backward(mp, q, k, v, s, g, la, mp.mpf(sc), None if cap is None else mp.mpf(cap),
                            square="score_mod" in opts)

    hi, lo = at(h), at(-h)
    out = {}
    for name, a, b in zip(FIELDS[:3], hi[:3], lo[:3]):
        out[name] = np.array([[[(x - y) / (2 * h) for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]], dtype=object)
    if sink is not None:
        out["sinks"] = np.array([(hi[3] - lo[3]) / (2 * h)], dtype=object)
    return out


@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("name", CASES)
def test_edge_cases_faithful_against_mpmath(name, with_lse):
    """Every entry of the gradients' tangent (and of the HVP) within one ulp of the exact value, where the plain
    and tiled schedules are held to 1e-12 of it (``tests/test_engines_second.py``)."""
    rng = np.random.default_rng(CASES.index(name) + 10 * with_lse)
    primals, opts, tangents = _edge_case(name, rng)
    dO, ddO = _dyadic(rng, 1, 2, 2), _dyadic(rng, 1, 2, 2)
    lam, dlam = (_dyadic(rng, 1, 2), _dyadic(rng, 1, 2)) if with_lse else (None, None)
    if name == "huge_1e300" and with_lse:                           # dq' of 2e300: beyond the double-double range
        with pytest.raises(ValueError, match="cannot give a finite, faithfully rounded dq tangent"):
            sdpa_backward_jvp(primals, tangents, dO, ddO, grad_lse=lam, grad_lse_tangent=dlam,
                              precision="reproducible", **opts)
        return
    grads, tan = sdpa_backward_jvp(primals, tangents, dO, ddO, grad_lse=lam, grad_lse_tangent=dlam,
                                   precision="reproducible", **opts)
    truth = _mp_second(primals, opts, tangents, dO, lam, ddO, dlam)
    for f, t in truth.items():
        assert_faithful(getattr(tan, f), t, f"{name}: {f}'")
    hvp = sdpa_hvp(primals, tangents, dO, grad_lse=lam, precision="reproducible", **opts)
    for f, t in _mp_second(primals, opts, tangents, dO, lam).items():
        assert_faithful(getattr(hvp, f), t, f"{name}: HVP {f}")


def _shift(ctx, h, a, t, sign):
    return mp_shifted(ctx, a, t, sign, h)


def _random_faithful(problem, with_sinks):
    q, k, v, opts, oracle = problem
    opts = differentiable(opts, float_mask=False)
    oracle["policy"] = opts["fully_masked"]
    if "slopes" in oracle:
        oracle["slopes"] = np.broadcast_to(oracle["slopes"], (q.shape[0], q.shape[1]))
    rng = np.random.default_rng(5)
    g, gt = (rng.standard_normal(q.shape[:-1] + (v.shape[-1],)) for _ in range(2))
    t = {"query": rng.standard_normal(q.shape), "key": rng.standard_normal(k.shape),
         "value": rng.standard_normal(v.shape)}
    sinks = ts = None
    if with_sinks:                                                  # one logit per (batch, head), a tangent too
        sinks, ts = rng.standard_normal(q.shape[:2]) * 2, rng.standard_normal(q.shape[:2])
        opts, t = dict(opts, sinks=sinks), dict(t, sinks=ts)
    _, tan = sdpa_backward_jvp((q, k, v), t, g, gt, precision="reproducible", **opts)
    ctx = mpmath.MPContext()
    ctx.dps = 60
    h = ctx.mpf(10) ** -20

    def at(s):
        sh = [_shift(ctx, h, x, t[n], s) for x, n in ((q, "query"), (k, "key"), (v, "value"))]
        extra = {} if sinks is None else {"sinks": _shift(ctx, h, sinks, ts, s)}
        return oracle_attention(*sh, grad_out=_shift(ctx, h, g, gt, s), num="mp", **oracle, **extra)[2]

    hi, lo = at(1), at(-1)
    for f, a, b in zip(("query", "key", "value", "bias", "sinks"), hi, lo):
        if f == "bias":
            if "bias" not in opts:
                continue
            a, b = a.sum(axis=0), b.sum(axis=0)                       # the bias (Hq, L, S) broadcasts over B
        truth = np.empty(a.shape, dtype=object)
        for i, x in np.ndenumerate(a):
            truth[i] = (x - b[i]) / (2 * h)
        assert_faithful(getattr(tan, f), truth, f)


@settings(max_examples=8, deadline=None)
@given(variant_problem(max_len=3), st.booleans())
def test_random_problems_with_every_option_faithful_against_mpmath(problem, with_sinks):
    """GQA, causal in both alignments, a bool mask, a bias, windows, softcap, ALiBi, lengths, dropout, sinks and
    the ``"zero"`` and ``"uniform"`` policies: the tangent of every gradient (the bias's and the sinks' too)
    within one ulp of the central difference of the loop oracle's 50-digit backward (error O(h^2) = 1e-40)."""
    _random_faithful(problem, with_sinks)


@pytest.mark.long
@settings(max_examples=150, deadline=None)
@given(variant_problem(max_len=5), st.booleans())
def test_random_problems_faithful_against_mpmath_long_sweep(problem, with_sinks):
    """The same on more and larger problems."""
    _random_faithful(problem, with_sinks)


def _rich_problem(rng, **extra):
    """GQA 4/2 heads, two batches, a float mask, a bias, softcap, sinks, a window and dropout."""
    q, k, v = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 4))
    opts = dict(enable_gqa=True, softcap=2.0, attn_mask=rng.standard_normal((5, 6)) * 0.5,
                bias=rng.standard_normal((4, 5, 6)), sinks=rng.standard_normal(4), window=(3, 1),
                dropout_p=0.25, rng=4, **extra)
    tangents = {"query": rng.standard_normal(q.shape), "key": rng.standard_normal(k.shape),
                "value": rng.standard_normal(v.shape), "bias": rng.standard_normal((4, 5, 6)),
                "sinks": rng.standard_normal(4)}
    g = rng.standard_normal((2, 4, 5, 4))
    return (q, k, v), opts, tangents, g


@pytest.mark.parametrize("extra", [{}, {"fully_masked": "uniform", "is_causal": True, "window": (0, 0)},
                                   {"attention_chunk": 2, "sink_token_length": 1}, {"score_mod": SQUARE},
                                   {"alibi_slopes": np.array([0.5, 0.25, 0.125, 1.0])}])
def test_agrees_with_the_plain_second_order_on_every_option(extra):
    """The reproducible double backward is the plain one's formulas: the same results to the plain schedule's own
    rounding (``F64_GRAD``), the gradients (the first result) bit for bit the reproducible backward's. With the
    score function, softcap and it make a chain of two curved stages (the slope's tangent a sum of two terms)."""
    rng = np.random.default_rng(7)
    primals, opts, tangents, g = _rich_problem(rng)
    opts.update(extra)
    gl, gt, glt = rng.standard_normal((2, 4, 5)), rng.standard_normal(g.shape), rng.standard_normal((2, 4, 5))
    kw = dict(grad_lse=gl, grad_lse_tangent=glt, **opts)
    ref = sdpa_backward_jvp(primals, tangents, g, gt, **kw)
    grads, tan = sdpa_backward_jvp(primals, tangents, g, gt, precision="reproducible", **kw)
    for f in tan._fields:
        assert_close_normwise(getattr(ref[1], f), getattr(tan, f), F64_GRAD)
    import sdpa_ref
    _, res = sdpa_ref.sdpa_forward(*primals, precision="reproducible", **opts)
    first = sdpa_ref.sdpa_backward(res, g, grad_lse=gl)
    for f in first._fields:
        x, y = getattr(first, f), getattr(grads, f)
        assert (x is None and y is None) or np.array_equal(x, y), f


def test_layouts_and_qv():
    """``layout="bshd"`` is the bhsd result with two axes swapped, bit for bit; packed sequences (with sinks) and
    MLA's ``qv`` agree with the plain second order, the tangent of ``dqv`` too."""
    rng = np.random.default_rng(8)
    primals, opts, tangents, g = _rich_problem(rng)
    sw = lambda x: np.swapaxes(x, -2, -3)  # noqa: E731
    want = sdpa_hvp(primals, tangents, g, precision="reproducible", **opts)
    got = sdpa_hvp(tuple(sw(x) for x in primals), dict(tangents, **{n: sw(tangents[n]) for n in
                                                                  ("query", "key", "value")}),
                   sw(g), layout="bshd", precision="reproducible", **opts)
    for f in ("query", "key", "value"):
        assert np.array_equal(sw(getattr(got, f)), getattr(want, f)), f
    for f in ("bias", "sinks"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 3, 7])           # packed sequences, as the plain schedule
    pq, pk, pv = rng.standard_normal((5, 2, 3)), rng.standard_normal((7, 2, 3)), rng.standard_normal((7, 2, 2))
    pt = {"query": rng.standard_normal(pq.shape), "key": rng.standard_normal(pk.shape)}
    pg = rng.standard_normal((5, 2, 2))
    kw = dict(layout=Packed(cu_q, cu_k), is_causal=True, causal_alignment="bottom_right", sinks=rng.uniform(-1, 1, 2))
    ref = sdpa_hvp((pq, pk, pv), pt, pg, **kw)
    ans = sdpa_hvp((pq, pk, pv), pt, pg, precision="reproducible", **kw)
    for f in ("query", "key", "value", "sinks"):
        assert_close_normwise(getattr(ref, f), getattr(ans, f), F64_GRAD)
    qv = rng.standard_normal((2, 4, 5, 4))
    t = {"query": tangents["query"], "value": tangents["value"], "qv": rng.standard_normal(qv.shape)}
    ref = sdpa_hvp(primals, t, g, qv=qv, softcap=2.0, enable_gqa=True)
    ans = sdpa_hvp(primals, t, g, qv=qv, softcap=2.0, enable_gqa=True, precision="reproducible")
    for f in ("query", "key", "value", "qv"):
        assert_close_normwise(getattr(ref, f), getattr(ans, f), F64_GRAD)


def test_bad_schedule_arguments_are_errors_naming_them():
    rng = np.random.default_rng(9)
    primals, opts, tangents, g = _rich_problem(rng)
    with pytest.raises(ValueError, match="`method` and `block_size` should be None with precision='reproducible'"):
        sdpa_hvp(primals, tangents, g, precision="reproducible", method="tiled")
    with pytest.raises(ValueError, match="`method` and `block_size`"):
        sdpa_hvp(primals, tangents, g, precision="reproducible", block_size=2)
    with pytest.raises(ValueError, match="`precision`"):
        sdpa_hvp(primals, tangents, g, precision="exact")
    with pytest.raises(TypeError, match="`num_splits` should not be given"):
        sdpa_hvp(primals, tangents, g, precision="reproducible", num_splits=2)


_AVX = "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR X86_V4 AVX2 FMA3 X86_V3"
#: Each run varies several settings at once (a run costs an interpreter start); with the in-process default
#: they cover 1 and 3 threads and the default, OpenBLAS on one thread, numpy without AVX-512 and AVX2, the NumPy
#: loops in place of the compiled kernels and three cuts of the blocks (``/work/shared``'s env-matrix runs more).
_SETTINGS = [({"SDPA_REF_NUM_THREADS": "1", "SDPA_REF_NATIVE": "0", "NPY_DISABLE_CPU_FEATURES": _AVX},
              ["--block-entries", "997"]),
             pytest.param({"SDPA_REF_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "1"}, ["--block-entries", "4096"],
                          marks=pytest.mark.long)]


@pytest.fixture(scope="module")
def in_process_digest():
    import importlib.util
    spec = importlib.util.spec_from_file_location("repro_second_digest", os.path.join(HERE, "repro_second_digest.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, HERE)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(HERE)
    return "".join(f"{n} {d}\n" for n, d in mod.digests().items())


@pytest.mark.parametrize("extra_env, args", _SETTINGS)
@pytest.mark.slow
def test_the_same_bits_under_every_thread_and_simd_setting(in_process_digest, extra_env, args):
    """The digest of ``tests/repro_second_digest.py`` (the double backward and the HVP of problems with every
    option, in float64 and the honest float32) in another process under other settings is the in-process one."""
    base = {k: v for k, v in os.environ.items() if k not in ("SDPA_REF_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                             "NPY_DISABLE_CPU_FEATURES", "SDPA_REF_NATIVE")}
    env = dict(base, **extra_env)
    if subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True).returncode:
        env.pop("NPY_DISABLE_CPU_FEATURES")                         # numpy refuses to switch off a baseline feature
    got = subprocess.run([sys.executable, os.path.join(HERE, "repro_second_digest.py")] + args, env=env,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout == in_process_digest, extra_env


@pytest.mark.parametrize("kv_lengths", [[30, 40], [40, 40]])
@pytest.mark.parametrize("policy", ["zero", "nan", "uniform", "jax"])
def test_the_second_order_on_the_allowed_blocks_alone_moves_no_bit(monkeypatch, policy, kv_lengths):
    """The double backward's products on each query row's allowed keys (``dO V^T``, the tangent scores,
    ``ddO V^T + dO dV^T``) and contracted over them (``dQ'``, and ``dK'`` and ``dV'`` over each key's rows, blocks of
    8 rows here): every tangent has the bits of forming every product whole, for per-batch lengths (padded rows,
    and a sequence whose first rows have no key or none), a window, sinks, dropout and GQA, under
    every policy (whole where a policy fills a row past its keys)."""
    from sdpa_ref.engines import reproducible_second as R2
    from sdpa_ref.exact import ozaki
    monkeypatch.setattr(ozaki, "_BLOCK_ENTRIES", 1 << 8)
    rng = np.random.default_rng(41)
    q, k, v, g, ts, opts = key_spans_case(rng, policy, kv_lengths)
    gt = rng.standard_normal(g.shape)

    def run():
        grads, tan = sdpa_backward_jvp((q, k, v), ts, g, gt, **opts)
        return [*grads[:3], *tan[:3]]
    with_, without, calls = with_and_without_key_spans(monkeypatch, R2, run)
    assert (policy != "zero" and kv_lengths[0] < 40) or all(c is not None for c in calls)
    for x, y in zip(with_, without):
        np.testing.assert_array_equal(x, y)
