"""Second order on the edges of the softmax: a dominant key, a dominant sink and huge scores, against mpmath.

``sdpa_hvp`` and ``sdpa_backward_jvp``, ``method="plain"`` and ``"tiled"`` (blocks of one and of three keys, so
that a row's dominant key and its runner-up sit in different blocks), on a problem small enough (one head,
``L = 2``, ``S = 4``, ``E = Ev = 2``) for an mpmath oracle:

* the oracle is a plain loop of the *backward* (scores, softmax with the sink, ``dV``, ``dP``, ``D``, ``dT``,
  ``dQ``, ``dK``, the sink's gradient), evaluated in mpmath, and its derivative along the tangents (inputs and
  cotangents together) is taken by central differences in mpmath at a precision far above the step's: the
  double backward is never derived by hand here, so the oracle shares no formula with the package's;
* the inputs are dyadic numbers of a few bits, so that the scores, their tangents, ``dP`` and ``dP'`` are exact
  in float64: what is judged is the softmax's second order, not the rounding of ``Q K^T``.

On these rows the plain sums of the double backward cancel: with a dominant key (the runner-up at
``P = e^-40``) or a dominant sink (``p_sink = 1 - 5e-18``), ``D``, ``c = sum P T'`` and ``D'`` agree with the
dominant entry's ``dP``, ``T'``, ``dP'`` to 1e-18, so a plain sum leaves the dominant entry's derivative a
difference of two O(1) numbers. The package takes every such sum relative to the dominant entry
(:func:`sdpa_ref.pivot.second_partial`), on both schedules.

The cases: a dominant key, a dominant sink, scores of 1.7e10 with a dominant key or sink (the runner-up 40
below, exact in float64), and scores of 6.7e299 with an exact tie at the top of one row (``P = 1/2, 1/2``,
where the curvature's two terms, each of the size of the tangent ``T' ~ 1e150``, cancel exactly) and a one-hot
row; with and without ``grad_lse`` and its tangent.

The bounds, each entry of every result: ``|ans - ref| <= MP_RTOL * (|ref| + floor)`` against the oracle,
``floor`` the sum of the magnitudes of the terms of the last product that makes the entry (``sum_j |dT'_ij
K_j| + |dT_ij K'_j|`` for ``dQ'``, ...), the scale of that product's own rounding on exact data, which no
algorithm escapes (an entry along the direction that moves every score of a row alike is such a cancelling
sum); the entries of ``dT'`` themselves enter it at their exact size, so a dominant key's lost derivative is
not hidden by it. ``MP_RTOL = 1e-12``: the inputs are exact and each entry a short chain of exp, products and
pivoted sums of a few terms, a few ulps (measured at most 1.9e-15), with a margin of 500 for other machines'
exp and summation orders. ``TILED_RTOL = 1e-11`` the same way between the two schedules. ``ATOL``, the
smallest normal float64, only keeps 0/0 out: the huge scores' other keys have ``P = e^{-10^299}``.
"""

import math

import mpmath
import numpy as np
import pytest

from sdpa_ref import sdpa_backward_jvp, sdpa_hvp

#: Each entry of the plain and tiled results against the mpmath oracle, relative.
MP_RTOL = 1e-12
#: Each entry of the tiled result against the plain one, relative.
TILED_RTOL = 1e-11
#: What no float64 can hold: the floor of the relative comparison.
ATOL = np.finfo(np.float64).tiny
#: The tiled schedule's key blocks: single keys, and a block of three with one of one.
BLOCKS = (1, 3)
FIELDS = ("query", "key", "value", "sinks")


def _dyadic(rng, *shape, scale=1.0):
    """Random numbers on a grid of 1/8 in [-2, 2], times ``scale`` (a power of two): exact products and sums."""
    return rng.integers(-16, 17, size=shape).astype(np.float64) / 8 * scale


def _case(name, rng):
    """``(primals, options, tangents)``: one head ``(1, L, E)``, the scores' scale 1."""
    Ev = 2
    sink, dsink = None, None
    if name == "dominant_key":
        # row 0: key 2 at 40, key 0 next at P = e^-40; row 1: key 1 at 36, key 0 next at P = e^-40
        q = np.array([[1.0, 0.0], [0.0, 1.0]])
        k = np.array([[0.0, -4.0], [-6.0, 36.0], [40.0, -5.0], [-2.0, -12.0]])
        sc = 1.0
    elif name == "dominant_sink":
        # the keys' scores within [-5, 0] and a sink at 40: p_sink = 1 - 5.1e-18 and 1 - 5.8e-18
        q = np.array([[1.0, 0.0], [0.0, 1.0]])
        k = np.array([[0.0, -1.0], [-2.0, 0.0], [-3.0, -5.0], [-4.0, -3.0]])
        sink, sc = 40.0, 1.0
    elif name == "huge_1e10_key":
        # scores 2^34 + (40, 0, -2, -7) and 2^34 + (20, 0, -1, -3.5): a dominant key at 1.7e10
        q = np.array([[2.0 ** 34, 1.0], [2.0 ** 34, 0.5]])
        k = np.array([[1.0, 40.0], [1.0, 0.0], [1.0, -2.0], [1.0, -7.0]])
        sc = 1.0
    elif name == "huge_1e10_sink":
        # scores 2^34 + (0, -2, -3, -4) and 2^34 + (0, -1, -1.5, -2), a sink 40 above: p_sink = 1 - 5.1e-18 on row 0
        q = np.array([[2.0 ** 34, 1.0], [2.0 ** 34, 0.5]])
        k = np.array([[1.0, 0.0], [1.0, -2.0], [1.0, -3.0], [1.0, -4.0]])
        sink, sc = 2.0 ** 34 + 40.0, 1.0
    elif name == "huge_1e300":
        # scores 6.7e299 * (small dyadics): row 0 two keys tied at the top (P = 1/2, 1/2), row 1 one-hot
        big = 2.0 ** 498
        q = np.array([[1.0, 0.5], [0.5, -1.0]]) * big
        k = np.array([[1.0, 0.0], [0.5, 0.5], [0.0, 2.0], [-0.5, 0.25]]) * big
        sc = 1.0
    else:
        raise AssertionError(name)
    tsc = 2.0 ** -34 if name.startswith("huge_1e10") else 1.0
    v = _dyadic(rng, 1, 4, Ev)
    dq = _dyadic(rng, 1, 2, 2, scale=tsc)
    dk = _dyadic(rng, 1, 4, 2, scale=tsc)
    dv = _dyadic(rng, 1, 4, Ev)
    opts = {"scale": sc}
    if sink is not None:
        opts["sinks"] = np.array([sink])
        dsink = _dyadic(rng, 1)
    return (q[None], k[None], v), opts, (dq, dk, dv, None, dsink)


CASES = ("dominant_key", "dominant_sink", "huge_1e10_key", "huge_1e10_sink", "huge_1e300")


def _oracle(primals, opts, tangents, dO, lam=None, ddO=None, dlam=None, extra_digits=0):
    """The derivative of the mpmath backward along the tangents and the cotangents' tangents, by central
    differences: ``(values, floors)``, each a list ``[dq', dk', dv', dsink']`` of float64 arrays (None without a
    sink). ``floors`` are the sums of the magnitudes of the terms each entry is made of (the last matmul's, and
    the rows' for the sink), the scale its rounding is relative to."""
    mp = mpmath.MPContext()
    xs = [primals[0][0], primals[1][0], primals[2][0]]
    ts = [tangents[0][0], tangents[1][0], tangents[2][0]]
    big = max(float(np.max(np.abs(x))) for x in xs)
    tbig = max(float(np.max(np.abs(t))) for t in ts)
    sc = opts["scale"]
    # the step moves every score by at most 1e-40; the precision holds the scores' own digits twice over (their
    # magnitude, and the cancellation of a tangent of that size down to the result) and 200 more
    mp.dps = 200 + extra_digits + 2 * int(math.log10(1 + sc * big * big * 2))
    h = mp.mpf(10) ** -(40 + extra_digits // 4) / mp.mpf(sc * (2 * big * tbig + 1) + 1)
    sink, dsink = opts.get("sinks"), tangents[4]

    def lift(a):
        return [[mp.mpf(float(x)) for x in row] for row in np.atleast_2d(a)]

    def moved(a, t, eps):
        return [[x + eps * y for x, y in zip(rx, rt)] for rx, rt in zip(lift(a), lift(t))]

    def at(eps):
        q, k, v = (moved(a, t, eps) for a, t in zip(xs, ts))
        s = None if sink is None else mp.mpf(float(sink[0])) + eps * mp.mpf(float(0 if dsink is None else dsink[0]))
        g = moved(dO[0], np.zeros_like(dO[0]) if ddO is None else ddO[0], eps)
        la = None if lam is None else moved(lam, np.zeros_like(lam) if dlam is None else dlam, eps)[0]
        return _backward(mp, q, k, v, s, g, la, mp.mpf(sc))

    hi, lo = at(h), at(-h)
    base = at(0)

    def deriv(a, b):
        return [[(x - y) / (2 * h) for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]

    d = {name: deriv(hi[name], lo[name]) for name in base}
    f = {name: np.array([[float(x) for x in row] for row in val]) for name, val in base.items()}
    fd = {name: np.array([[float(x) for x in row] for row in val]) for name, val in d.items()}
    q, k, v = xs
    dq, dk, dv = ts
    g0 = dO[0]
    g1 = np.zeros_like(g0) if ddO is None else ddO[0]
    A = np.abs
    floors = [sc * (A(fd["dT"]) @ A(k) + A(f["dT"]) @ A(dk)),
              sc * (A(fd["dT"]).T @ A(q) + A(f["dT"]).T @ A(dq)),
              A(fd["P"]).T @ A(g0) + A(f["P"]).T @ A(g1),
              None if sink is None else np.array([np.sum(A(fd["dsink"]))])]
    values = [fd["dq"][None], fd["dk"][None], fd["dv"][None],
              None if sink is None else np.array([np.sum(fd["dsink"])])]
    return values, [None if x is None else np.asarray(x)[None] if x.ndim == 2 else x for x in floors]


def _backward(mp, q, k, v, sink, dO, lam, scale):
    """The backward of one head, plainly, in mpmath: ``{name: rows of mpf}``, the gradients ``dq``, ``dk``, ``dv``,
    the sink's gradient per row ``dsink``, and the rows' ``P`` and ``dT``."""
    L, E, S, Ev = len(q), len(q[0]), len(k), len(v[0])
    dq = [[mp.mpf(0)] * E for _ in range(L)]
    dk = [[mp.mpf(0)] * E for _ in range(S)]
    dv = [[mp.mpf(0)] * Ev for _ in range(S)]
    Ps, dTs, dsink = [], [], []
    for i in range(L):
        T = [scale * mp.fsum(q[i][e] * k[j][e] for e in range(E)) for j in range(S)]
        m = max(T + ([] if sink is None else [sink]))
        w = [mp.exp(t - m) for t in T]
        ws = mp.mpf(0) if sink is None else mp.exp(sink - m)
        Z = mp.fsum(w) + ws
        P = [x / Z for x in w]
        ps = ws / Z
        dP = [mp.fsum(dO[i][e] * v[j][e] for e in range(Ev)) for j in range(S)]
        D = mp.fsum(P[j] * dP[j] for j in range(S))
        li = 0 if lam is None else lam[i]
        dT = [P[j] * (dP[j] - D + li) for j in range(S)]     # the softmax's VJP with the LSE's cotangent
        for j in range(S):
            for e in range(Ev):
                dv[j][e] += P[j] * dO[i][e]
            for e in range(E):
                dq[i][e] += scale * dT[j] * k[j][e]
                dk[j][e] += scale * dT[j] * q[i][e]
        Ps.append(P)
        dTs.append(dT)
        dsink.append(ps * (li - D))                            # the sink's column: dP = 0
    return {"dq": dq, "dk": dk, "dv": dv, "dsink": [dsink], "P": Ps, "dT": dTs}


def _rel_err(ans, ref, floor):
    """The largest ``|ans - ref| / (|ref| + floor + ATOL)`` over the entries (inf where ``ans`` is not finite)."""
    ans, ref = np.asarray(ans, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(ans)):
        return np.inf
    return float(np.max(np.abs(ans - ref) / (np.abs(ref) + floor + ATOL), initial=0.0))


def _worst(ans, ref, floors=None):
    """``{field: relative error}`` of the tangent grads ``ans`` against ``ref`` (with the oracle's ``floors``)."""
    floors = floors or [0.0] * len(FIELDS)
    return {f: _rel_err(getattr(ans, f), r, fl) for f, r, fl in zip(FIELDS, ref, floors) if r is not None}


def _problem(name, seed=0):
    rng = np.random.default_rng(seed)
    primals, opts, tangents = _case(name, rng)
    dO = _dyadic(rng, 1, 2, 2)
    lam, ddO, dlam = _dyadic(rng, 1, 2), _dyadic(rng, 1, 2, 2), _dyadic(rng, 1, 2)
    return primals, opts, tangents, dO, lam, ddO, dlam


def _runs(fn):
    """``(method, block_size)`` of every schedule: plain, and tiled with each of :data:`BLOCKS`."""
    return [("plain", None)] + [("tiled", b) for b in BLOCKS]


@pytest.mark.parametrize("with_lse", [False, True], ids=["no_lse", "lse"])
@pytest.mark.parametrize("name", CASES)
def test_hvp_on_dominant_entries_matches_mpmath(name, with_lse):
    """sdpa_hvp, plain and tiled, entry by entry against mpmath's differences of its backward, with and without
    the LSE's cotangent; tiled and plain agree to TILED_RTOL."""
    primals, opts, tangents, dO, lam, _, _ = _problem(name)
    lam = lam if with_lse else None
    ref, floors = _oracle(primals, opts, tangents, dO, lam)
    got = {}
    for method, b in _runs(sdpa_hvp):
        got[method, b] = sdpa_hvp(primals, tangents, dO, grad_lse=lam, method=method, block_size=b, **opts)
        err = _worst(got[method, b], ref, floors)
        assert max(err.values()) <= MP_RTOL, (method, b, err)
    for b in BLOCKS:
        err = _worst(got["tiled", b], [getattr(got["plain", None], f) for f in FIELDS], floors)
        assert max(err.values()) <= TILED_RTOL, (b, err)


@pytest.mark.parametrize("with_lse", [False, True], ids=["no_lse", "lse"])
@pytest.mark.parametrize("name", CASES)
def test_double_backward_on_dominant_entries_matches_mpmath(name, with_lse):
    """sdpa_backward_jvp with the cotangents' tangents (grad_out_tangent; with grad_lse and grad_lse_tangent or
    without), plain and tiled, against mpmath."""
    primals, opts, tangents, dO, lam, ddO, dlam = _problem(name, seed=1)
    lam, dlam = (lam, dlam) if with_lse else (None, None)
    ref, floors = _oracle(primals, opts, tangents, dO, lam, ddO, dlam)
    got = {}
    for method, b in _runs(sdpa_backward_jvp):
        got[method, b] = sdpa_backward_jvp(primals, tangents, dO, ddO, grad_lse=lam, grad_lse_tangent=dlam,
                                           method=method, block_size=b, **opts)[1]
        err = _worst(got[method, b], ref, floors)
        assert max(err.values()) <= MP_RTOL, (method, b, err)
    for b in BLOCKS:
        err = _worst(got["tiled", b], [getattr(got["plain", None], f) for f in FIELDS], floors)
        assert max(err.values()) <= TILED_RTOL, (b, err)


def test_the_oracle_does_not_move_with_its_step_or_precision():
    """The oracle's derivative is the same float64 numbers with a 25 times smaller step and 100 more digits, on
    the cases where it needs the most digits (scores of 6.7e299, a tie among them) and the most cancellation."""
    for name in ("huge_1e300", "dominant_sink"):
        primals, opts, tangents, dO, lam, ddO, dlam = _problem(name, seed=1)
        ref, floors = _oracle(primals, opts, tangents, dO, lam, ddO, dlam)
        finer, _ = _oracle(primals, opts, tangents, dO, lam, ddO, dlam, extra_digits=100)
        for r, f, fl in zip(ref, finer, floors):
            if r is not None:
                assert _rel_err(r, f, fl) <= 1e-15, name


def _unpivoted_partial(P, g, t, h, X=None):
    """second_partial (in NumPy, ``X`` unread) with every pivot 0: the plain sums rowsum(P g), rowsum(P T'), ... (the
    old, wrong form)."""
    z = np.zeros(P.shape[:-1] + (1,))
    rs = lambda x: np.sum(x, axis=-1, keepdims=True)  # noqa: E731
    return np.max(P, axis=-1, keepdims=True), z, z, z, rs(P), rs(P * g), rs(P * t), rs(P * h), rs(P * t * g)


@pytest.mark.parametrize("method, block_size", [("plain", None), ("tiled", 1)])
def test_the_bound_catches_plain_sums(monkeypatch, method, block_size):
    """The same rows with the sums of the double backward taken plainly (every pivot 0, in both schedules' one
    home) miss the oracle by far more than MP_RTOL: the dominant key's derivative is lost."""
    import sdpa_ref.engines.second as second
    import sdpa_ref.normalize as normalize
    monkeypatch.setattr(normalize, "second_partial", _unpivoted_partial)
    monkeypatch.setattr(second, "second_partial", _unpivoted_partial)
    primals, opts, tangents, dO, _, _, _ = _problem("dominant_key")
    ref, floors = _oracle(primals, opts, tangents, dO)
    got = sdpa_hvp(primals, tangents, dO, method=method, block_size=block_size, **opts)
    assert max(_worst(got, ref, floors).values()) > 1e4 * MP_RTOL


def test_vjp_jvp_from_p_tangent_agrees_with_the_scores_form():
    """normalize.vjp_jvp (P' given, the tutorial's form, its E = rowsum(P' (g - a)) taken directly) and
    normalize.vjp_jvp_scores (from T', E from the pivoted partials) agree entry by entry on the rows where plain
    sums cancel: a dominant key, a dominant sink, an exact tie, with the LSE's cotangent and its tangent."""
    from sdpa_ref.normalize import vjp_jvp, vjp_jvp_scores
    rng = np.random.default_rng(3)
    T = np.array([[40.0, 0.0, -2.0, -7.0], [0.0, -2.0, -3.0, -4.0], [3.0, 1.0, 3.0, -1.0]])
    sink = np.array([[-np.inf], [40.0], [-np.inf]])
    m = np.maximum(T.max(axis=-1, keepdims=True), sink)
    Z = np.exp(T - m).sum(axis=-1, keepdims=True) + np.exp(sink - m)
    P, ps = np.exp(T - m) / Z, np.exp(sink - m) / Z
    g, t, h = (_dyadic(rng, 3, 4) for _ in range(3))
    ts, lam, lam_t = _dyadic(rng, 3, 1), _dyadic(rng, 3, 1), _dyadic(rng, 3, 1)
    dT, Pt, ddT, (pst, dsx, ddsx) = vjp_jvp_scores(P, g, t, h, ps, ts, lam, lam_t)
    ddT_p, ddsx_p = vjp_jvp(P, g, Pt, h, ps, pst, lam, lam_t)
    assert _rel_err(ddT_p, ddT, 0.0) <= TILED_RTOL
    assert _rel_err(ddsx_p, ddsx, 0.0) <= TILED_RTOL
