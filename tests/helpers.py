"""Small assertions shared by the test modules."""

import numpy as np


def assert_close_normwise(x, y, rtol):
    """NaN and infinities where ``x`` has them, ``|y - x| <= rtol * max(1, max|x|)`` elsewhere (None matches None)."""
    if x is None:
        assert y is None
        return
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
    fin = np.isfinite(x)
    np.testing.assert_array_equal(y[~fin & ~np.isnan(x)], x[~fin & ~np.isnan(x)])   # the same infinities
    scale = max(1.0, float(np.max(np.abs(x[fin]), initial=0.0)))
    np.testing.assert_allclose(y[fin], x[fin], rtol=rtol, atol=rtol * scale)


def assert_faithful(x, truth, what):
    """Every entry of float64 ``x`` is one of the two floats next to the mpmath ``truth`` (the value itself if
    representable); NaN where the truth is NaN."""
    import mpmath
    bad = []
    for idx, t in np.ndenumerate(truth):
        xi = float(x[idx])
        if mpmath.isnan(t):
            if not np.isnan(xi):
                bad.append((idx, xi, t))
            continue
        with mpmath.workdps(80):                                 # the global context's 53 bits would round the
            t = mpmath.mpf(t)                                    # truth first: a truth next to the midpoint of
        a = float(t)                                              # two floats then looked like a float itself
        if mpmath.mpf(a) == t:
            ok = xi == a
        else:
            b = float(np.nextafter(a, np.inf if t > a else -np.inf))
            ok = xi in (a, b)
        if not ok:
            bad.append((idx, xi, mpmath.nstr(t, 20)))
    assert not bad, f"{what}: {len(bad)} entries not faithfully rounded, e.g. {bad[:3]}"


def loss_derivatives(kw):
    """``(fun, vjp, hvp, args, cotangent)`` of the loss ``<g, O> + <g_lse, LSE>`` of one problem in ``(query, key,
    value)``, for ``sdpa_ref.assert_hvp``: ``kw`` holds the three inputs by name and the options (``method=`` too)."""
    import sdpa_ref

    kw = dict(kw)
    q, k, v = (np.asarray(kw.pop(n), dtype=np.float64) for n in ("query", "key", "value"))
    out, res = sdpa_ref.sdpa_forward(q, k, v, **kw)
    n = out.size

    def split(g):
        return g[:n].reshape(out.shape), g[n:].reshape(out.shape[:-1])

    def fun(q, k, v):
        o, r = sdpa_ref.sdpa_forward(q, k, v, **kw)
        return np.concatenate([o.ravel(), r.lse.ravel()])

    def vjp(g, q, k, v):
        dO, dl = split(g)
        gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, **kw)[1], dO, grad_lse=dl)
        return [gr.query, gr.key, gr.value]

    def hvp(g, ts, q, k, v):
        dO, dl = split(g)
        hv = sdpa_ref.sdpa_hvp((q, k, v), tuple(ts), dO, grad_lse=dl, **kw)
        return [hv.query, hv.key, hv.value]

    g = np.random.default_rng(1).standard_normal(n + res.lse.size)
    return fun, vjp, hvp, [q, k, v], g


def key_spans_case(rng, policy, kv_lengths):
    """``(q, k, v, g, tangents, opts)``: a reproducible problem whose products skip masked blocks (per-batch
    lengths with padded rows and a sequence that may start without keys, a window, sinks, dropout, GQA; ``B,
    Hkv, G, L, E = 2, 2, 2, 40, 4``), for the tests that hold those products to the whole ones."""
    B, Hkv, G, L, E = 2, 2, 2, 40, 4
    opts = dict(is_causal=True, causal_alignment="bottom_right", window=(12, 0), fully_masked=policy,
                enable_gqa=True, q_lengths=np.array([40, 25]), kv_lengths=np.array(kv_lengths),
                sinks=np.array([0.5, -np.inf, 1.0, 0.0]), dropout_p=0.2,
                dropout_mask=rng.random((B, Hkv * G, L, L)) > 0.2, precision="reproducible")
    q, g = (rng.standard_normal((B, Hkv * G, L, E)) for _ in range(2))
    k, v = (rng.standard_normal((B, Hkv, L, E)) for _ in range(2))
    return q, k, v, g, tuple(rng.standard_normal(x.shape) for x in (q, k, v)), opts


def with_and_without_key_spans(monkeypatch, module, run):
    """``(with, without, calls)``: the arrays ``run()`` returns with ``module._key_spans`` as it is (each range it
    gives kept in ``calls``), then with it giving None (every product formed whole)."""
    calls, spans = [], module._key_spans

    def counted(*a, **kw):
        calls.append(spans(*a, **kw))
        return calls[-1]
    monkeypatch.setattr(module, "_key_spans", counted)
    with_ = run()
    monkeypatch.setattr(module, "_key_spans", lambda *a, **kw: None)
    return with_, run(), calls
