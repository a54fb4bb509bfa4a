"""The double backward and the Hessian-vector product (sdpa_backward_jvp, sdpa_hvp) against finite differences
of the backward, over every option of the finite-difference grid, sinks, the LSE's cotangent, MLA's qv and the
layouts; the Hessian's symmetry; clear errors."""

import numpy as np
import pytest

from sdpa_ref import (
    AttentionGrads,
    Packed,
    assert_hvp,
    assert_jvp,
    check_jvp,
    sdpa_backward,
    sdpa_backward_jvp,
    sdpa_forward,
    sdpa_hvp,
)
from sdpa_ref.harness.grid import gradcheck_grid
from tolerances import F64_GRAD, F64_GRAD_LONG, F64_REGROUPED, F64_SUMS, FD_SECOND_ORDER

FIELDS = ("query", "key", "value", "attn_mask", "bias", "sinks")


class Differentiable:
    """The backward of one problem as a function of its differentiable inputs and both cotangents, with its JVP
    (the double backward) and the loss's HVP, in the forms check_jvp / check_hvp take."""

    def __init__(self, kw, with_lse=False, layout=None):
        self.kw, self.layout, self.with_lse = dict(kw), layout, with_lse
        self.names = ["query", "key", "value"] + [n for n in ("bias", "sinks", "qv") if kw.get(n) is not None]
        self.slot = {"query": 0, "key": 1, "value": 2, "bias": 3, "sinks": 4, "qv": 5}
        self.args = [np.asarray(kw[n], dtype=np.float64) for n in self.names]
        out, res = self.forward(*self.args)
        self.out_shape, self.lse_shape = out.shape, res.lse.shape

    def call_kw(self, xs):
        kw = dict(self.kw, **dict(zip(self.names, xs)))
        q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
        return (q, k, v), kw

    def forward(self, *xs):
        (q, k, v), kw = self.call_kw(xs)
        kw.setdefault("method", "plain")
        return sdpa_forward(q, k, v, layout=self.layout, **kw)

    def fun(self, *xs):                                  # the loss's outputs: O (and the LSE)
        out, res = self.forward(*xs)
        return np.concatenate([out.ravel(), res.lse.ravel()]) if self.with_lse else out

    def split(self, g):
        if not self.with_lse:
            return g.reshape(self.out_shape), None
        n = int(np.prod(self.out_shape))
        return g[:n].reshape(self.out_shape), g[n:].reshape(self.lse_shape)

    def tangents(self, ts):
        t = [None] * 6
        for n, x in zip(self.names, ts):
            t[self.slot[n]] = x
        return tuple(t)

    def vjp(self, g, *xs):
        dO, dl = self.split(g)
        gr = sdpa_backward(self.forward(*xs)[1], dO, grad_lse=dl)
        return [getattr(gr, n) for n in self.names]

    def hvp(self, g, ts, *xs):
        dO, dl = self.split(g)
        (q, k, v), kw = self.call_kw(xs)
        hv = sdpa_hvp((q, k, v), self.tangents(ts), dO, grad_lse=dl, layout=self.layout, **kw)
        return [getattr(hv, n) for n in self.names]

    # the whole backward, cotangents included, as one function, and its JVP: the double backward
    def backward_fun(self, *xs_g):
        xs, g = xs_g[:-1], xs_g[-1]
        dO, dl = self.split(g)
        gr = sdpa_backward(self.forward(*xs)[1], dO, grad_lse=dl)
        return np.concatenate([np.ravel(x) for x in gr if x is not None])

    def backward_jvp(self, ts_all, *xs_g):
        xs, g = xs_g[:-1], xs_g[-1]
        dO, dl = self.split(g)
        ddO, ddl = self.split(ts_all[-1])
        (q, k, v), kw = self.call_kw(xs)
        gr, gt = sdpa_backward_jvp((q, k, v), self.tangents(ts_all[:-1]), dO, ddO, grad_lse=dl,
                                   grad_lse_tangent=ddl, layout=self.layout, **kw)
        for a, b in zip(gr, gt):
            assert (a is None) == (b is None)
            assert b is None or (a.shape == b.shape and a.dtype == b.dtype)
        return np.concatenate([np.ravel(x) for x in gt if x is not None])

    # the same two functions for check_jvp(vectorized=True): every argument, the cotangent and the tangents with
    # one new leading axis, which the API reads as one more batch dimension (bias and sinks, whose own leading
    # dimensions are not the problem's batch, get singleton axes for it): one call per batch of perturbations
    _CORE = {"bias": 3, "sinks": 1}                      # their trailing dimensions: (Hq, L, S) and (Hq,)

    def _lifted(self, xs):
        nb = len(self.out_shape) - 3                     # the problem's batch dimensions
        out = []
        for n, x in zip(self.names, xs):
            x = np.asarray(x)
            if n in self._CORE:
                x = x.reshape(x.shape[:1] + (1,) * (1 + nb + self._CORE[n] - x.ndim) + x.shape[1:])
            out.append(x)
        return out

    def _split_batched(self, g):
        m = g.shape[0]
        if not self.with_lse:
            return g.reshape((m,) + self.out_shape), None
        n = int(np.prod(self.out_shape))
        return g[:, :n].reshape((m,) + self.out_shape), g[:, n:].reshape((m,) + self.lse_shape)

    def backward_fun_batched(self, *xs_g):
        if np.ndim(xs_g[0]) == np.ndim(self.args[0]):    # the check's first call, on the arguments themselves
            return self.backward_fun(*xs_g)
        xs, g = self._lifted(xs_g[:-1]), xs_g[-1]
        dO, dl = self._split_batched(g)
        gr = sdpa_backward(self.forward(*xs)[1], dO, grad_lse=dl)
        return np.concatenate([x.reshape(len(g), -1) for x in gr if x is not None], axis=1)

    def backward_jvp_batched(self, ts_all, *xs_g):
        if np.ndim(xs_g[0]) == np.ndim(self.args[0]):
            return self.backward_jvp(ts_all, *xs_g)
        xs, g = self._lifted(xs_g[:-1]), xs_g[-1]
        dO, dl = self._split_batched(g)
        ddO, ddl = self._split_batched(ts_all[-1])
        (q, k, v), kw = self.call_kw(xs)
        _, gt = sdpa_backward_jvp((q, k, v), self.tangents(self._lifted(ts_all[:-1])), dO, ddO, grad_lse=dl,
                                  grad_lse_tangent=ddl, layout=self.layout, **kw)
        return np.concatenate([x.reshape(len(g), -1) for x in gt if x is not None], axis=1)

    def cotangent(self, seed=1):
        rng = np.random.default_rng(seed)
        n = int(np.prod(self.out_shape)) + (int(np.prod(self.lse_shape)) if self.with_lse else 0)
        g = rng.standard_normal(n)
        return g if self.with_lse else g.reshape(self.out_shape)


def _grid_kwargs(case):
    kw = case.make_inputs()
    return kw


GRID = gradcheck_grid()


@pytest.mark.parametrize("case", GRID, ids=[c.name for c in GRID])
def test_double_backward_matches_differences_of_the_backward(case):
    d = Differentiable(_grid_kwargs(case), with_lse=GRID.index(case) % 2 == 0)
    if case.opts.get("fully_masked") == "nan" and case.has_fully_masked_rows():
        pytest.skip("NaN gradients: the pattern is tested below")
    assert_jvp(d.backward_fun, d.backward_jvp, d.args + [d.cotangent()], mode="projection", rtol=FD_SECOND_ORDER)


def _grid_double_backward(case, **schedule):
    """``sdpa_backward_jvp`` on a grid case with both cotangents and their tangents and a tangent of every input
    (seeded): ``(grads, grads_tangent)``."""
    kw = case.make_inputs()
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    rng = np.random.default_rng(3)
    out, res = sdpa_forward(q, k, v, **kw)
    g, gt = rng.standard_normal(out.shape), rng.standard_normal(out.shape)
    gl, glt = rng.standard_normal(res.lse.shape), rng.standard_normal(res.lse.shape)
    t = tuple(rng.standard_normal(x.shape) for x in (q, k, v)) + (
        (rng.standard_normal(kw["bias"].shape),) if "bias" in kw else ())
    return sdpa_backward_jvp((q, k, v), t, g, gt, grad_lse=gl, grad_lse_tangent=glt, **kw, **schedule)


@pytest.mark.parametrize("case", GRID, ids=[c.name for c in GRID])
def test_tiled_double_backward_equals_the_cores(case):
    """The bounded-memory schedule (two sweeps over blocks of 2 keys) against the teaching core's, every
    gradient's tangent, with both cotangents and their tangents."""
    a = _grid_double_backward(case)
    b = _grid_double_backward(case, method="tiled", block_size=2)
    for x, xt, y, yt in zip(a[0], a[1], b[0], b[1]):
        if x is None:
            assert y is None and xt is None and yt is None
            continue
        np.testing.assert_allclose(y, x, rtol=F64_GRAD, atol=F64_GRAD)
        np.testing.assert_allclose(yt, xt, rtol=F64_GRAD_LONG, atol=F64_GRAD_LONG)


TILED_SPECIAL = ["sinks+causal+softcap+bias", "qv+causal-br+sinks", "uniform policy+sinks"]


@pytest.mark.parametrize("name", TILED_SPECIAL)
def test_tiled_double_backward_special_options(name):
    """The bounded-memory schedule (blocks of 2 keys) gives the dense schedule's backward and double backward on
    the special options, along random tangents of every input and both cotangents; the dense one is held to finite
    differences, full Jacobian, by test_double_backward_special_options (the tiled one too, among the long
    checks)."""
    dense = Differentiable(SPECIAL[name](np.random.default_rng(7)), with_lse=True)
    tiled = Differentiable(SPECIAL[name](np.random.default_rng(7)), with_lse=True)
    tiled.kw.update(method="tiled", block_size=2)
    xs_g = dense.args + [dense.cotangent()]
    rng = np.random.default_rng(5)
    for _ in range(2):
        ts = [rng.standard_normal(np.shape(x)) for x in xs_g]
        np.testing.assert_allclose(tiled.backward_jvp(ts, *xs_g), dense.backward_jvp(ts, *xs_g),
                                   rtol=F64_GRAD_LONG, atol=F64_GRAD_LONG)
    np.testing.assert_allclose(tiled.backward_fun(*xs_g), dense.backward_fun(*xs_g), rtol=F64_GRAD, atol=F64_GRAD)


@pytest.mark.long
@pytest.mark.parametrize("name", TILED_SPECIAL)
def test_tiled_double_backward_special_options_by_finite_differences(name):
    d = Differentiable(SPECIAL[name](np.random.default_rng(7)), with_lse=True)
    d.kw.update(method="tiled", block_size=2)
    xs_g = d.args + [d.cotangent()]
    assert np.array_equal(d.backward_fun_batched(*[np.stack([x, 2 * x]) for x in xs_g]),
                          [d.backward_fun(*xs_g), d.backward_fun(*[2 * x for x in xs_g])])
    assert_jvp(d.backward_fun_batched, d.backward_jvp_batched, xs_g, mode="full", rtol=FD_SECOND_ORDER,
               vectorized=True)


def test_tiled_double_backward_with_a_block_mask_skips_its_tiles():
    from sdpa_ref import BlockMask

    rng = np.random.default_rng(11)
    kw = _kw(rng, L=8, S=8)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    bm = BlockMask.from_mask_mod(lambda b, h, i, j: j <= i, 1, 1, 8, 8, block_size=2)
    g = rng.standard_normal((2, 4, 8, 2))
    t = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    a = sdpa_hvp((q, k, v), t, g, is_causal=True, **kw)
    b = sdpa_hvp((q, k, v), t, g, block_mask=bm, method="tiled", **kw)
    for x, y in zip(a, b):
        if x is not None:
            np.testing.assert_allclose(y, x, rtol=F64_GRAD, atol=F64_SUMS)


@pytest.mark.parametrize("case", [c for c in GRID if "dropout" in c.arrays and c.Hq != c.Hkv][:6]
                         + [c for c in GRID if c.opts.get("softcap")][:2],
                         ids=lambda c: c.name)
def test_hvp_full_hessian_and_symmetry(case):
    d = Differentiable(_grid_kwargs(case), with_lse=True)
    assert_hvp(d.fun, d.vjp, d.hvp, d.args, cotangent=d.cotangent(), mode="full", rtol=FD_SECOND_ORDER)


def _kw(rng, B=2, Hq=4, Hkv=2, L=3, S=5, E=3, Ev=2, **extra):
    kw = dict(query=rng.standard_normal((B, Hq, L, E)), key=rng.standard_normal((B, Hkv, S, E)),
              value=rng.standard_normal((B, Hkv, S, Ev)), enable_gqa=Hq != Hkv)
    kw.update(extra)
    return kw


SPECIAL = {
    "sinks": lambda r: _kw(r, sinks=r.uniform(-1, 2, 4)),
    "sinks+causal+softcap+bias": lambda r: _kw(r, sinks=r.uniform(-1, 2, 4), is_causal=True, softcap=1.7,
                                               bias=r.standard_normal((4, 3, 5))),
    "sinks+masked rows": lambda r: _kw(r, sinks=np.array([0.5, -np.inf, 1.0, 2.0]),
                                       attn_mask=np.arange(3)[:, None] != 1 + 0 * np.arange(5)),
    "qv": lambda r: _kw(r, Hkv=4, qv=r.standard_normal((2, 4, 3, 2))),
    "qv+causal-br+sinks": lambda r: _kw(r, Hkv=4, qv=r.standard_normal((2, 4, 3, 2)), is_causal=True,
                                        causal_alignment="bottom_right", sinks=r.uniform(-1, 2, 4)),
    "dropout+softcap+alibi+window": lambda r: _kw(r, dropout_p=0.3, dropout_mask=r.random((2, 4, 3, 5)) > 0.3,
                                                  softcap=2.5, alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]),
                                                  window=(1, 2)),
    "uniform policy+sinks": lambda r: _kw(r, fully_masked="uniform", sinks=r.uniform(-1, 2, 4),
                                          attn_mask=np.arange(3)[:, None] != 1 + 0 * np.arange(5)),
}


@pytest.mark.parametrize("name", SPECIAL)
@pytest.mark.parametrize("with_lse", [False, True])
def test_double_backward_special_options(name, with_lse):
    """Every entry of the double backward's Jacobian against central differences of the backward (the
    perturbations of one argument in one batched call), and the loss's HVP along random projections."""
    d = Differentiable(SPECIAL[name](np.random.default_rng(7)), with_lse=with_lse)
    xs_g = d.args + [d.cotangent()]
    ts = [np.random.default_rng(8).standard_normal(np.shape(x)) for x in xs_g]
    two = [np.stack([x, 2 * x]) for x in xs_g]              # the batched forms are the problems one by one
    assert np.array_equal(d.backward_fun_batched(*two), [d.backward_fun(*xs_g),
                                                          d.backward_fun(*[2 * x for x in xs_g])])
    assert np.array_equal(d.backward_jvp_batched([np.stack([t, -t]) for t in ts], *two),
                          [d.backward_jvp(ts, *xs_g), d.backward_jvp([-t for t in ts], *[2 * x for x in xs_g])])
    assert_jvp(d.backward_fun_batched, d.backward_jvp_batched, xs_g, mode="full", rtol=FD_SECOND_ORDER,
               vectorized=True)
    assert_hvp(d.fun, d.vjp, d.hvp, d.args, cotangent=d.cotangent(), mode="projection", rtol=FD_SECOND_ORDER)


def test_double_backward_on_a_packed_layout():
    rng = np.random.default_rng(3)
    cu_q, cu_k = np.array([0, 2, 5]), np.array([0, 3, 7])
    kw = dict(query=rng.standard_normal((5, 2, 3)), key=rng.standard_normal((7, 2, 3)),
              value=rng.standard_normal((7, 2, 2)), is_causal=True, causal_alignment="bottom_right",
              sinks=rng.uniform(-1, 1, 2))
    d = Differentiable(kw, with_lse=True, layout=Packed(cu_q, cu_k))
    assert_jvp(d.backward_fun, d.backward_jvp, d.args + [d.cotangent()], mode="full", rtol=FD_SECOND_ORDER)


def test_first_order_part_is_sdpa_backward_bits():
    rng = np.random.default_rng(5)
    kw = SPECIAL["sinks+causal+softcap+bias"](rng)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    out, res = sdpa_forward(q, k, v, method="plain", **kw)
    g = rng.standard_normal(out.shape)
    want = sdpa_backward(res, g)
    got, _ = sdpa_backward_jvp((q, k, v), (q, None, None), g, **kw)
    assert isinstance(got, AttentionGrads)
    for a, b in zip(want, got):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_hvp_is_linear_in_the_tangent_and_zero_along_nothing():
    rng = np.random.default_rng(6)
    kw = SPECIAL["dropout+softcap+alibi+window"](rng)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    g = rng.standard_normal((2, 4, 3, 2))
    zero = sdpa_hvp((q, k, v), (None, None, None), g, **kw)
    assert all(x is None or not np.any(x) for x in zero)
    u = [rng.standard_normal(x.shape) for x in (q, k, v)]
    w = [rng.standard_normal(x.shape) for x in (q, k, v)]
    a = sdpa_hvp((q, k, v), tuple(u), g, **kw)
    b = sdpa_hvp((q, k, v), tuple(w), g, **kw)
    c = sdpa_hvp((q, k, v), tuple(2 * x - 3 * y for x, y in zip(u, w)), g, **kw)
    for x, y, z in zip(a, b, c):
        if x is not None:
            np.testing.assert_allclose(z, 2 * x - 3 * y, rtol=F64_GRAD, atol=F64_GRAD)


def test_a_wrong_second_order_term_is_caught():
    """The checks above can fail: drop softcap's second derivative and the double backward is rejected."""
    import sdpa_ref.attention as core

    rng = np.random.default_rng(8)
    d = Differentiable(_kw(rng, softcap=1.2), with_lse=False)
    real = core.transform_scores_vjp_jvp
    try:
        core.transform_scores_vjp_jvp = lambda dT, ddT, sech2, dsech2: real(dT, ddT, sech2, 0 * dsech2)
        rep = check_jvp(d.backward_fun, d.backward_jvp, d.args + [d.cotangent()], mode="projection",
                        rtol=FD_SECOND_ORDER)
    finally:
        core.transform_scores_vjp_jvp = real
    assert not rep.ok


def test_nan_policy_rows_give_nan_where_the_gradient_is_nan():
    case = next(c for c in GRID if c.opts.get("fully_masked") == "nan" and c.has_fully_masked_rows())
    kw = case.make_inputs()
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    out, res = sdpa_forward(q, k, v, **kw)
    g = np.random.default_rng(2).standard_normal(out.shape)
    gr, gt = sdpa_backward_jvp((q, k, v), (q, k, v), g, g, **kw)
    for a, b in zip(gr, gt):
        if a is not None:
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))


def test_poisoned_tangent_marks_at_least_what_reads_it():
    rng = np.random.default_rng(9)
    kw = _kw(rng, is_causal=True)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    g = rng.standard_normal((2, 4, 3, 2))
    dq = np.zeros_like(q)
    dq[0, 1, 2, 0] = np.nan
    hv = sdpa_hvp((q, k, v), (dq, None, None), g, **kw)
    assert np.isnan(hv.query[0, 1, 2]).all()                 # the row whose tangent is NaN
    assert np.isfinite(hv.query[1]).all() and np.isfinite(hv.key[1]).all()     # another batch entry reads none
    assert np.isfinite(hv.query[0, 1, :2]).all()             # rows that do not read it


@pytest.mark.parametrize("bad, match", [
    (dict(method="fast"), "`method` should be one of"),
    (dict(method="plain", block_size=4), "`block_size` should be None with method='plain'"),
    (dict(precision="reproducible", method="tiled"), "`method` and `block_size` should be None with precision"),
    (dict(precision="exact"), "`precision` should be one of"),
    (dict(num_splits=2), "`num_splits` should not be given"),
])
def test_schedule_keywords_are_refused(bad, match):
    q = np.ones((2, 3))
    with pytest.raises((TypeError, ValueError), match=match):
        sdpa_hvp((q, q, q), (q, None, None), q, **bad)


def test_bad_tangents_and_cotangents_are_clear_errors():
    q = np.ones((2, 3))
    with pytest.raises(ValueError, match="`grad_out_tangent` should have the output's shape"):
        sdpa_backward_jvp((q, q, q), (q, None, None), q, np.ones((3, 3)))
    with pytest.raises(ValueError, match=r"`tangents\[1\]` should have the shape of `key`"):
        sdpa_hvp((q, q, q), (None, np.ones((4, 3)), None), q)
    with pytest.raises(ValueError, match="`grad_lse_tangent` should have the LSE's shape"):
        sdpa_backward_jvp((q, q, q), (q, None, None), q, grad_lse_tangent=np.ones(3))
    with pytest.raises(TypeError, match="`tangents` should be a tuple"):
        sdpa_hvp((q, q, q), q, q)


def test_inputs_are_not_modified():
    rng = np.random.default_rng(4)
    kw = SPECIAL["sinks"](rng)
    before = {n: np.copy(x) for n, x in kw.items() if isinstance(x, np.ndarray)}
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    g = rng.standard_normal((2, 4, 3, 2))
    t = (np.copy(q), np.copy(k), np.copy(v))
    t0 = [np.copy(x) for x in t]
    sdpa_backward_jvp((q, k, v), t, g, np.copy(g), **kw)
    for n, x in dict(kw, query=q, key=k, value=v).items():
        if n in before:
            np.testing.assert_array_equal(x, before[n])
    for a, b in zip(t, t0):
        np.testing.assert_array_equal(a, b)


def test_tiled_double_backward_makes_no_l_by_s_array(monkeypatch):
    import tracemalloc

    # one thread: each thread holds one block of rows against every key (two threads, two such strips)
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "1")
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((1, 1, 512, 8)) for _ in range(3))
    g = rng.standard_normal(q.shape)
    t = (rng.standard_normal(q.shape), rng.standard_normal(k.shape), None)
    peaks = {}
    for how in ("plain", "tiled"):
        tracemalloc.start()
        sdpa_hvp((q, k, v), t, g, softcap=4.0, method=how, **({"block_size": 64} if how == "tiled" else {}))
        peaks[how] = tracemalloc.get_traced_memory()[1] / (512 * 512 * 8)
        tracemalloc.stop()
    assert peaks["tiled"] < 1 < 4 < peaks["plain"], peaks          # in units of one L x S float64 array


def test_sdpa_hvp_refuses_the_cotangents_tangents():
    q = np.ones((2, 3))
    for name in ("grad_out_tangent", "grad_lse_tangent"):
        with pytest.raises(TypeError, match=f"`{name}` should not be given to sdpa_hvp"):
            sdpa_hvp((q, q, q), (q, None, None), q, **{name: np.ones(2)})


@pytest.mark.parametrize("method", ["plain", "tiled"])
def test_a_tiny_softcap_gives_finite_second_order(method):
    """2 / cap overflows; where tanh * sech^2 is 0 the curvature term is 0, not inf * 0."""
    rng = np.random.default_rng(23)
    q, k, v = rng.standard_normal((1, 2, 4, 3)), rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 5, 2))
    g = rng.standard_normal((1, 2, 4, 2))
    t = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    with np.errstate(all="raise"):
        h = sdpa_hvp((q, k, v), t, g, softcap=1e-310, method=method)
    assert all(np.isfinite(x).all() for x in h if x is not None)


def _gated(s, b, h, i, j):
    return s * np.tanh(s) + 0.5 * s


def _gated_grad(s, b, h, i, j):
    return np.tanh(s) + s / np.cosh(s) ** 2 + 0.5


def _gated_grad2(s, b, h, i, j):
    return 2 / np.cosh(s) ** 2 * (1 - s * np.tanh(s))


def _score_function_problem(given, method):
    from sdpa_ref import ScoreMod

    mod = ScoreMod(_gated, grad=_gated_grad, grad2=_gated_grad2 if given == "grad2" else None)
    kw = _kw(np.random.default_rng(21), score_mod=mod, softcap=2.5, is_causal=True,
             bias=np.random.default_rng(22).standard_normal((4, 3, 5)))
    d = Differentiable(kw, with_lse=True)
    d.kw.update(method=method, **({"block_size": 2} if method == "tiled" else {}))
    return d


@pytest.mark.parametrize("method", ["plain", pytest.param("tiled", marks=pytest.mark.long)])
@pytest.mark.parametrize("given", ["grad", "grad2"])
def test_double_backward_through_a_score_function(method, given):
    d = _score_function_problem(given, method)
    xs_g = d.args + [d.cotangent()]
    assert np.array_equal(d.backward_fun_batched(*[np.stack([x, 2 * x]) for x in xs_g]),
                          [d.backward_fun(*xs_g), d.backward_fun(*[2 * x for x in xs_g])])
    assert_jvp(d.backward_fun_batched, d.backward_jvp_batched, xs_g, mode="full", rtol=FD_SECOND_ORDER,
               vectorized=True)


@pytest.mark.parametrize("given", ["grad", "grad2"])
def test_tiled_double_backward_through_a_score_function_equals_the_plain(given):
    """The tiled schedule's backward and double backward through a score function are the plain schedule's, which
    the test above holds to finite differences (the tiled one too, among the long checks)."""
    plain, tiled = _score_function_problem(given, "plain"), _score_function_problem(given, "tiled")
    xs_g = plain.args + [plain.cotangent()]
    rng = np.random.default_rng(5)
    for _ in range(2):
        ts = [rng.standard_normal(np.shape(x)) for x in xs_g]
        np.testing.assert_allclose(tiled.backward_jvp(ts, *xs_g), plain.backward_jvp(ts, *xs_g),
                                   rtol=F64_GRAD_LONG, atol=F64_GRAD_LONG)
    np.testing.assert_allclose(tiled.backward_fun(*xs_g), plain.backward_fun(*xs_g), rtol=F64_GRAD, atol=F64_GRAD)


def test_softcap_as_a_score_function_has_the_built_ins_second_order():
    from sdpa_ref import ScoreMod

    rng = np.random.default_rng(23)
    kw = _kw(rng)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    g, t = rng.standard_normal((2, 4, 3, 2)), tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    cap = 1.3
    mod = ScoreMod(lambda s, *r: cap * np.tanh(s / cap), grad=lambda s, *r: 1 / np.cosh(s / cap) ** 2)
    a = sdpa_hvp((q, k, v), t, g, softcap=cap, **kw)
    b = sdpa_hvp((q, k, v), t, g, score_mod=mod, **kw)
    for x, y in zip(a, b):
        if x is not None:
            np.testing.assert_allclose(y, x, rtol=F64_SUMS, atol=F64_REGROUPED)


def test_second_order_refuses_captured_tensors_and_needs_a_derivative():
    from sdpa_ref import ScoreMod

    q = np.ones((2, 3))
    with pytest.raises(ValueError, match="should capture no tensor for second order"):
        sdpa_hvp((q, q, q), (q, None, None), q, score_mod=ScoreMod(lambda s, b, h, i, j, w: s * w[0],
                                                                   params=(np.ones(1),)))
    with pytest.raises(ValueError, match="should have its derivative for second order"):
        sdpa_hvp((q, q, q), (q, None, None), q, score_mod=_gated)


@pytest.mark.parametrize("which", ["query", "key", "value", "bias", "sinks", "qv"])
@pytest.mark.parametrize("method", ["plain", "tiled"])
def test_hvp_tangents_by_name_are_the_tuple_form(which, method):
    """``sdpa_hvp(primals, {"qv": t}, ...)`` is the tuple form with ``t`` in ``qv``'s slot, bit for bit, in both
    schedules and for every input (MLA's qv included); the names not given are zero tangents."""
    rng = np.random.default_rng(31)
    kw = _kw(rng, Hkv=4, qv=rng.standard_normal((2, 4, 3, 2)), sinks=rng.uniform(-1, 2, 4),
             bias=rng.standard_normal((4, 3, 5)), is_causal=True)
    kw.update(method=method, **({"block_size": 2} if method == "tiled" else {}))
    d = Differentiable(kw, with_lse=True)
    (q, k, v), rest = d.call_kw(d.args)
    t = rng.standard_normal(np.shape(kw[which]))
    by_position = tuple(t if n == which else None for n in ("query", "key", "value", "bias", "sinks", "qv"))
    g, gl = d.split(d.cotangent())
    a = sdpa_hvp((q, k, v), {which: t}, g, grad_lse=gl, **rest)
    b = sdpa_hvp((q, k, v), by_position, g, grad_lse=gl, **rest)
    assert a._fields == b._fields
    for x, y in zip(a, b):
        assert (x is None and y is None) or np.array_equal(x, y)


@pytest.mark.parametrize("kw", [{"is_causal": True}, {"window": (3, 1)}, {},
                                {"is_causal": True, "fully_masked": "nan", "causal_alignment": "bottom_right"}])
@pytest.mark.parametrize("kv_batch", [2, 1])
@pytest.mark.parametrize("windows", [False, True])
def test_the_plain_double_backward_cut_by_heads_has_the_bits_of_the_whole(monkeypatch, kw, kv_batch, windows):
    """The plain engine runs its heads in chunks in the pool (sdpa_ref.heads), its forward and its double
    backward: the same bits as on all heads at once, with GQA, keys broadcast over the batch and a cotangent
    tangent, on whole rows and on the allowed set's key spans (windows: the same spans on one thread as on two);
    and a wrong put-together (one chunk's result left out) is seen."""
    import sdpa_ref.heads as heads

    if windows:
        _windows_everywhere(monkeypatch)
    rng = np.random.default_rng(3)
    q, g, dg, dq = (rng.standard_normal((2, 4, 5, 3)) for _ in range(4))
    k, v, dk, dv = (rng.standard_normal((kv_batch, 2, 7, 3)) for _ in range(4))
    call = ((q, k, v), (dq, dk, dv), g, dg)
    cut = []
    monkeypatch.setattr(heads, "PARALLEL_ENTRIES", 1)
    monkeypatch.setattr(heads, "head_chunks", lambda prob, f=heads.head_chunks: cut.append(f(prob)) or cut[-1])

    def run():
        fwd = sdpa_forward(q, k, v, method="plain", enable_gqa=True, **kw)
        return fwd[:1] + tuple(fwd[1].forward), sdpa_backward_jvp(*call, enable_gqa=True, **kw)
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "2")
    ans = run()
    assert len(cut) == 3 and all(len(c) == 4 for c in cut)  # two batch entries, two kv heads each: both forwards
    #                                                          (the double backward's own too) and its tangent
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "1")
    ref = run()
    assert len(cut) == 3                                      # one thread: nothing cut
    got, want = ans[0] + ans[1][0] + ans[1][1], ref[0] + ref[1][0] + ref[1][1]
    assert len(got) == len(want)
    for a, r in zip(got, want):
        assert (a is None and r is None) or (a is not None and r is not None and np.array_equal(a, r, equal_nan=True))
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "2")          # the check sees chunks put in each other's place

    def shifted(prob, idx, real=heads._sub_problem, chunks=heads.head_chunks):
        c = chunks(prob)
        return real(prob, c[(c.index(idx) + 1) % len(c)])
    monkeypatch.setattr(heads, "_sub_problem", shifted)
    bad = run()
    assert not np.array_equal(bad[0][0], ref[0][0]) and not np.array_equal(bad[1][1].query, ref[1][1].query)


def _windows_everywhere(monkeypatch, rows=2):
    """The double backward's windows (sdpa_ref.heads.spans) on tiny problems: key spans from any S, blocks of
    ``rows`` query rows, spans not rounded to groups of eight keys."""
    import functools

    import sdpa_ref.heads as heads
    from sdpa_ref.engines import blocks
    from sdpa_ref.engines import fast
    monkeypatch.setattr(heads, "SPAN_MIN_KEYS", 0)
    monkeypatch.setattr(fast, "SPAN_MIN_KEYS", 0)                   # the forward's threshold
    monkeypatch.setattr(fast, "SPAN_MIN_KEYS_NARROW", 0)
    monkeypatch.setattr(heads, "span_rows", lambda L: rows)
    monkeypatch.setattr(heads, "key_spans", functools.partial(blocks.key_spans, align=1))


def _double_backward(case):
    """The grid case's double backward (every gradient's tangent), then the plain forward's output, LSE and P."""
    kw = case.make_inputs()
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    plain = sdpa_forward(q, k, v, method="plain", **kw)
    return tuple(_grid_double_backward(case)[1]) + (plain[0], plain[1].lse, plain[1].forward.probs)


def test_the_plain_engine_on_key_spans_is_the_whole_rows(monkeypatch):
    """Where the allowed set leaves keys out of a block of rows, the plain forward and double backward run each
    block of rows against its key span alone (sdpa_ref.heads.forward_spans, spans): over the whole grid, the
    output, the LSE, P and every gradient's tangent are the whole rows' to rounding (the row sums add the same
    nonzero terms); windows are taken on the masked cases and refused where a row sum needs the whole matrix or a
    policy fills a row; and windows that leave out one allowed key are seen."""
    import sdpa_ref.heads as heads

    _windows_everywhere(monkeypatch)
    used, used_fwd = [], []
    monkeypatch.setattr(heads, "spans", lambda *a, f=heads.spans: used.append(f(*a)) or used[-1])
    monkeypatch.setattr(heads, "forward_spans", lambda *a, f=heads.forward_spans: used_fwd.append(f(*a)) or
                        used_fwd[-1])
    whole = {}
    for case in GRID:
        before = len(used), len(used_fwd)
        got = _double_backward(case)
        if all(u is None for u in used[before[0]:] + used_fwd[before[1]:]):
            continue                                          # whole rows: nothing to compare
        with monkeypatch.context() as m:
            m.setattr(heads, "spans", lambda *a: None)
            m.setattr(heads, "forward_spans", lambda *a: None)
            want = whole[case.name] = _double_backward(case)
        for x, y in zip(got, want):
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_allclose(x, y, rtol=F64_GRAD_LONG, atol=F64_GRAD_LONG, err_msg=case.name)
    windowed = sum(u is not None for u in used)
    assert windowed >= 20 and windowed < len(used), (windowed, len(used))
    windowed = sum(u is not None for u in used_fwd)
    assert windowed >= 20 and windowed < len(used_fwd), (windowed, len(used_fwd))
    causal = next(c for c in GRID if c.opts.get("is_causal") and not c.opts.get("arrays"))

    def short(*a, f=heads.spans):                            # the last block of rows loses its last key
        w = f(*a)
        return None if w is None else w[:-1] + [w[-1][:3] + (w[-1][3] - 1,)]
    monkeypatch.setattr(heads, "spans", short)
    bad = _double_backward(causal)
    assert not np.allclose(bad[0], whole[causal.name][0], rtol=1e-6, atol=1e-6)      # the query's tangent
    monkeypatch.setattr(heads, "spans", lambda *a: None)
    monkeypatch.setattr(heads, "forward_spans", lambda p, f=heads.forward_spans: short(p, f=f))
    bad = _double_backward(causal)
    assert not np.allclose(bad[-3], whole[causal.name][-3], rtol=1e-6, atol=1e-6)    # the output


@pytest.mark.parametrize("case", GRID, ids=[c.name for c in GRID])
def test_the_double_backward_on_key_spans_matches_differences(monkeypatch, case):
    """The windowed double backward (every grid case, blocks of 2 rows against their key spans) against finite
    differences of the backward."""
    _windows_everywhere(monkeypatch)
    d = Differentiable(_grid_kwargs(case), with_lse=GRID.index(case) % 2 == 1)
    if case.opts.get("fully_masked") == "nan" and case.has_fully_masked_rows():
        pytest.skip("NaN gradients: the pattern is tested below")
    assert_jvp(d.backward_fun, d.backward_jvp, d.args + [d.cotangent()], mode="projection", rtol=FD_SECOND_ORDER)


@pytest.mark.parametrize("policy", ["nan", "uniform", "jax", "zero"])
def test_a_row_a_score_function_empties_runs_the_plain_forward_whole(monkeypatch, policy):
    """The allowed set cannot foresee a row that a score function sets to -inf on every key: where its policy
    fills it past its window, the plain forward runs the whole rows again, so the output, the LSE and P are the
    whole rows' (bit for bit there; to rounding under "zero", which keeps the windows), and the double backward
    of sdpa_hvp takes whole rows too."""
    import sdpa_ref.heads as heads

    _windows_everywhere(monkeypatch)
    rng = np.random.default_rng(4)
    q, k, v, g, t = (rng.standard_normal((1, 2, 6, 3)) for _ in range(5))

    from sdpa_ref import ScoreMod

    def mod(s, b, h, i, j):
        return np.where(i == 3, -np.inf, s)

    def grad(s, b, h, i, j):
        return np.where(i == 3, 0.0, 1.0 + 0 * s)
    kw = dict(is_causal=True, score_mod=ScoreMod(mod, grad=grad), fully_masked=policy)
    got = sdpa_forward(q, k, v, method="plain", **kw)
    hv = sdpa_hvp((q, k, v), (t, None, None), g, **kw)
    monkeypatch.setattr(heads, "forward_spans", lambda p: None)
    monkeypatch.setattr(heads, "spans", lambda *a: None)
    want = sdpa_forward(q, k, v, method="plain", **kw)
    hv_want = sdpa_hvp((q, k, v), (t, None, None), g, **kw)
    for a, b in zip((got[0], got[1].lse, got[1].forward.probs, *hv), (want[0], want[1].lse, want[1].forward.probs,
                                                                      *hv_want)):
        assert (a is None) == (b is None)
        if a is None:
            continue
        if policy == "zero":
            np.testing.assert_allclose(a, b, rtol=F64_GRAD_LONG, atol=F64_GRAD_LONG)
        else:
            assert np.array_equal(a, b, equal_nan=True)


WINDOWED_SPECIAL = {
    "sinks+causal+softcap": lambda r: _kw(r, L=6, S=8, sinks=r.uniform(-1, 2, 4), is_causal=True, softcap=1.7),
    "qv+causal-br+sinks": lambda r: _kw(r, L=6, S=8, Hkv=4, qv=r.standard_normal((2, 4, 6, 2)), is_causal=True,
                                        causal_alignment="bottom_right", sinks=r.uniform(-1, 2, 4)),
    "dropout+softcap+alibi+window": lambda r: _kw(r, L=6, S=8, dropout_p=0.3, softcap=2.5, window=(2, 1),
                                                  dropout_mask=r.random((2, 4, 6, 8)) > 0.3,
                                                  alibi_slopes=r.uniform(0.1, 1, 4)),
}


@pytest.mark.parametrize("name", WINDOWED_SPECIAL)
def test_the_double_backward_on_key_spans_special_options(monkeypatch, name):
    """Windows with the options the grid does not combine with a mask (sinks, softcap's curvature, MLA's qv,
    dropout with ALiBi): every entry of the double backward's Jacobian against central differences, and the
    whole rows' values."""
    import sdpa_ref.heads as heads

    _windows_everywhere(monkeypatch)
    used = []
    monkeypatch.setattr(heads, "spans", lambda *a, f=heads.spans: used.append(f(*a)) or used[-1])
    d = Differentiable(WINDOWED_SPECIAL[name](np.random.default_rng(7)), with_lse=True)
    xs_g = d.args + [d.cotangent()]
    assert_jvp(d.backward_fun_batched, d.backward_jvp_batched, xs_g, mode="full", rtol=FD_SECOND_ORDER,
               vectorized=True)
    assert used and all(u is not None and len(u) > 1 for u in used)
    ts = [np.random.default_rng(5).standard_normal(np.shape(x)) for x in xs_g]
    got = d.backward_jvp(ts, *xs_g)
    monkeypatch.setattr(heads, "spans", lambda *a: None)
    np.testing.assert_allclose(got, d.backward_jvp(ts, *xs_g), rtol=F64_GRAD_LONG, atol=F64_GRAD_LONG)


def test_the_plain_engines_chunks_of_heads_stay_small(monkeypatch):
    """About two chunks per thread, each with at most heads.CHUNK_ENTRIES score entries where a GQA group allows
    (whole groups always): every kv head exactly once."""
    import types

    import sdpa_ref.heads as heads
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "2")

    def chunks(B, Hkv, G, L, S):
        c = heads.head_chunks(types.SimpleNamespace(batch=(B,), Hkv=Hkv, G=G, L=L, S=S))
        seen = sorted((b, h) for ix in c for b in range(*ix[0].indices(B)) for h in range(*ix[1].indices(Hkv)))
        assert seen == [(b, h) for b in range(B) for h in range(Hkv)]
        return [len(range(*ix[1].indices(Hkv))) for ix in c]
    assert chunks(1, 8, 1, 256, 256) == [2, 2, 2, 2]          # two per thread
    assert chunks(1, 8, 1, 1024, 1024) == [1] * 8             # one head is CHUNK_ENTRIES
    assert chunks(1, 4, 4, 1024, 1024) == [1] * 4             # a GQA group is never cut
    assert chunks(2, 2, 1, 64, 64) == [1] * 4
