"""The fast dense path equals the plain (documented) path to 1e-14, whatever the thread count."""

import os
import subprocess
import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdpa_ref import sdpa_backward, sdpa_forward, sdpa_jvp
from sdpa_ref import _threads
from sdpa_ref.engines import fast

from helpers import assert_close_normwise
from strategies import attention_problem, variant_problem
from tolerances import F64_REGROUPED


def _close(x, y, rtol=F64_REGROUPED):
    assert_close_normwise(x, y, rtol)


@given(variant_problem(max_len=6))
def test_fast_equals_plain(problem):
    q, k, v, opts, _ = problem
    out_p, res_p = sdpa_forward(q, k, v, method="plain", **opts)
    out_f, res_f = sdpa_forward(q, k, v, **opts)
    _close(out_p, out_f)
    _close(res_p.probs, res_f.probs)
    np.testing.assert_array_equal(res_p.lse == -np.inf, res_f.lse == -np.inf)
    g = np.random.default_rng(0).standard_normal(out_p.shape)
    plain = sdpa_backward(res_p, g, method="plain")
    for other in (sdpa_backward(res_f, g), sdpa_backward(res_p, g, method="probs"),
                  sdpa_backward(res_f, g, method="plain")):
        for a, b in zip(plain, other):
            _close(a, b)


def test_fast_path_on_a_large_problem_uses_threads_and_agrees():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 4, 300, 16)) for _ in range(3))
    m = rng.standard_normal((300, 300))
    out_p, res_p = sdpa_forward(q, k, v, m, is_causal=True, method="plain")
    out_f, res_f = sdpa_forward(q, k, v, m, is_causal=True)
    _close(out_p, out_f)
    g = rng.standard_normal(out_p.shape)
    for a, b in zip(sdpa_backward(res_p, g, method="plain"), sdpa_backward(res_f, g)):
        _close(a, b)


def test_results_do_not_depend_on_the_thread_count(monkeypatch):
    # with threads: (2, 3, 600, 600) scores in 6 chunks of one head; (2, 3, 3000, 40) short rows in
    # 4 chunks (2 + 1 heads per batch); one head of 110000 x 40 short rows, its row passes in threads.
    # With SDPA_REF_NUM_THREADS=1 all three are one piece without threads.
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "3")      # the cut below is the threaded one, whatever the caller set
    assert len(fast._head_chunks((2, 3), 600 * 600, 16)) == 6
    assert len(fast._head_chunks((2, 3), 3000 * 40, 16)) == 4
    assert 110000 * 40 >= _threads.MIN_PARALLEL
    code = (
        "import numpy as np, sdpa_ref as s, sys, hashlib\n"
        "r = np.random.default_rng(2)\n"
        "h = hashlib.sha256()\n"
        "for qs, ks in (((2, 3, 600, 8), (2, 3, 600, 8)), ((2, 3, 3000, 8), (2, 3, 40, 8)),\n"
        "               ((1, 1, 110000, 8), (1, 1, 40, 8))):\n"
        "    q, k, v = r.standard_normal(qs), r.standard_normal(ks), r.standard_normal(ks)\n"
        "    o, res = s.sdpa_forward(q, k, v, is_causal=True)\n"
        "    g = s.sdpa_backward(res, np.ones_like(o))\n"
        "    for a in (o, res.lse, g.query, g.key, g.value):\n"
        "        h.update(a.tobytes())\n"
        "sys.stdout.write(h.hexdigest())\n"
    )
    outs = set()
    for n in ("1", "2", "3"):
        env = dict(os.environ, SDPA_REF_NUM_THREADS=n)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1


def test_num_threads_reads_the_environment(monkeypatch):
    from sdpa_ref._threads import num_threads

    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "3")
    assert num_threads() == 3
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "1")
    assert num_threads() == 1
    monkeypatch.delenv("SDPA_REF_NUM_THREADS")
    assert num_threads() >= 1


# ------------------------------------------------------- chunks of heads


@contextmanager
def chunked(entries, threads="3"):
    """Force the head-chunked path: chunks of ``entries`` score entries, ``threads`` threads."""
    old, env = fast._CHUNK_ENTRIES, os.environ.get("SDPA_REF_NUM_THREADS")
    fast._CHUNK_ENTRIES = entries
    os.environ["SDPA_REF_NUM_THREADS"] = threads
    try:
        yield
    finally:
        fast._CHUNK_ENTRIES = old
        if env is None:
            del os.environ["SDPA_REF_NUM_THREADS"]
        else:
            os.environ["SDPA_REF_NUM_THREADS"] = env


def _fwd_bwd(q, k, v, opts, **kw):
    """The forward, the backward and the JVP (every tangent, a bias's too)."""
    out, res = sdpa_forward(q, k, v, **opts, **kw)
    g = np.random.default_rng(0).standard_normal(out.shape)
    grads = tuple(x for x in sdpa_backward(res, g, method=kw.get("method")) if x is not None)
    return (out, res.probs, res.lse) + grads + (sdpa_jvp((q, k, v), _tangents(q, k, v, opts), **opts, **kw)[1],)


def _tangents(q, k, v, opts, seed=1):
    rng = np.random.default_rng(seed)
    ts = [rng.standard_normal(np.shape(x)) for x in (q, k, v)]
    return tuple(ts + [None if opts.get(n) is None else rng.standard_normal(np.shape(opts[n])) for n in ("bias", "sinks")])


@given(variant_problem(max_len=6), st.booleans())
def test_the_fast_jvp_equals_the_cores(problem, sinks):
    """Forward mode on the fast engine (its own: the backward's row pass on the tangent scores) against the
    teaching core's, over every option, sinks with rows that have none included."""
    q, k, v, opts, _ = problem
    if sinks:
        rng = np.random.default_rng(q.size)
        opts["sinks"] = np.where(rng.random(q.shape[-3]) < 0.3, -np.inf, rng.standard_normal(q.shape[-3]))
    ts = _tangents(q, k, v, opts)
    out_p, dout_p = sdpa_jvp((q, k, v), ts, method="plain", **opts)
    out_f, dout_f = sdpa_jvp((q, k, v), ts, method="fast", **opts)
    _close(out_p, out_f)
    _close(dout_p, dout_f)
    for i in range(len(ts)):                             # one tangent at a time, the others zero
        one = tuple(t if j == i else None for j, t in enumerate(ts))
        _close(sdpa_jvp((q, k, v), one, method="plain", **opts)[1], sdpa_jvp((q, k, v), one, method="fast", **opts)[1])


@given(st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(1, 50), st.integers(1, 30),
       st.sampled_from([0, 1 << 40]))
def test_head_chunks_cover_every_head_once(lead, unit, entries, kv_bytes):
    lead = tuple(lead)
    seen = np.zeros(lead, dtype=int)
    old = fast._CHUNK_ENTRIES
    fast._CHUNK_ENTRIES = entries
    try:
        for c in fast._head_chunks(lead, unit, 128, kv_bytes):
            assert len(c) == len(lead)
            seen[c] += 1
    finally:
        fast._CHUNK_ENTRIES = old
    assert (seen == 1).all()


@given(variant_problem(max_len=6), st.sampled_from([1, 7, 40]))
def test_head_chunked_path_is_bitwise_the_one_piece_path_and_equals_plain(problem, entries):
    q, k, v, opts, _ = problem
    with chunked(entries, threads="1"):
        whole = _fwd_bwd(q, k, v, opts)
    with chunked(entries):
        lead = q.shape[:-3] + (k.shape[-3],)
        unit = (q.shape[-3] // k.shape[-3]) * q.shape[-2] * k.shape[-2]
        if np.prod(lead) >= 2 and np.prod(lead) * unit >= 2 * entries:
            assert len(fast._head_chunks(lead, unit)) >= 2
        parts = _fwd_bwd(q, k, v, opts)
    plain = _fwd_bwd(q, k, v, opts, method="plain")
    assert len(whole) == len(parts) == len(plain)
    for a, b, c in zip(whole, parts, plain):
        np.testing.assert_array_equal(a, b)
        _close(c, b)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_a_decode_against_many_keys_is_cut_by_heads_with_the_bits_of_one_piece(monkeypatch, layout):
    """A problem with few scores but many keys and values to read (a decode) runs two chunks of heads per thread
    (fast._KV_BYTES; one piece would run its products on one thread), with the bits of one piece, forward and
    backward, dense and through a paged cache; below the bytes it stays one piece."""
    import sdpa_ref

    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 1, 8, 16))
    kc, vc = (rng.standard_normal((6, 16, 4, 16)) for _ in range(2))
    table = np.stack([rng.permutation(6)[:3], rng.permutation(6)[:3]])
    lay = sdpa_ref.KVCache(cache_seqlens=np.array([40, 48]), block_table=table)
    dense = [np.swapaxes(c[table].reshape(2, 48, 4, 16), 1, 2) for c in (kc, vc)]
    calls = {"dense": lambda: sdpa_forward(np.swapaxes(q, 1, 2), *dense, enable_gqa=True, is_causal=True,
                                           causal_alignment="bottom_right"),
             "paged": lambda: sdpa_forward(q, kc, vc, layout=lay, enable_gqa=True)}
    cuts = []
    monkeypatch.setattr(fast, "_head_chunks", lambda *a, f=fast._head_chunks: cuts.append(f(*a)) or cuts[-1])

    def run():
        out, res = calls[layout]()
        return [out, res.lse] + [x for x in sdpa_backward(res, rng.standard_normal(out.shape)) if x is not None]
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "2")
    small = run()
    assert all(len(c) == 1 for c in cuts)                     # 4 heads' 48 keys: far below fast._KV_BYTES
    monkeypatch.setattr(fast, "_KV_BYTES", 1)
    rng = np.random.default_rng(5)
    cut = run()
    assert len(cuts[-1]) == 4                                 # two per thread: 2 batch entries x 2 pairs of heads
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "1")
    rng = np.random.default_rng(5)
    one = run()
    assert len(cuts[-1]) == 1
    for a, b, c in zip(cut, one, small):
        assert np.array_equal(a, b) and a.shape == c.shape


@pytest.mark.parametrize("opts", [{}, {"enable_gqa": True}, {"softcap": 3.0, "sinks": np.array([0.5])},
                                  {"dropout_p": 0.2, "bias": "rows"}, {"upcast": False}, {"is_causal": True},
                                  {"is_causal": True, "enable_gqa": True, "dropout_p": 0.2}])
def test_one_units_products_by_blocks_have_the_same_bits_on_any_thread_count(monkeypatch, opts):
    """A problem with one (batch, kv head) unit is one chunk; its products run by fixed blocks of rows and keys
    in the pool (fast._cuts; with a causal mask, its spans' rectangles side by side and the sums over them by
    blocks): the bits of the forward and backward are the same on one thread and two (the blocks come from the
    shape), and agree with the plain engine; the blocks cover every row and key once."""
    rng = np.random.default_rng(15)
    Hq = 2 if opts.get("enable_gqa") else 1
    dt = np.float32 if opts.get("upcast") is False else np.float64
    q = rng.standard_normal((1, Hq, 1100, 8)).astype(dt)
    k, v = (rng.standard_normal((1, 1, 1030, 8)).astype(dt) for _ in range(2))
    g = rng.standard_normal(q.shape).astype(dt)
    opts = dict(opts)
    if opts.get("bias") == "rows":
        opts["bias"] = rng.standard_normal((1100, 1030))
    if "dropout_p" in opts:
        opts["dropout_mask"] = rng.random((1, Hq, 1100, 1030)) > opts["dropout_p"]
    cuts = []
    monkeypatch.setattr(fast, "_cuts", lambda n, f=fast._cuts: cuts.append(f(n)) or cuts[-1])

    def run(threads):
        monkeypatch.setenv("SDPA_REF_NUM_THREADS", threads)
        out, res = sdpa_forward(q, k, v, **opts)
        return [out, res.lse] + [x for x in sdpa_backward(res, g) if x is not None]
    two, one = run("2"), run("1")
    assert any(c is not None and len(c) > 1 for c in cuts)
    for a, b in zip(two, one):
        assert np.array_equal(a, b, equal_nan=True)
    out_p, res_p = sdpa_forward(q, k, v, method="plain", **opts)
    want = [out_p, res_p.lse] + [x for x in sdpa_backward(res_p, g, method="plain") if x is not None]
    for a, b in zip(two, want):
        assert_close_normwise(b, a, 1e-5 if dt == np.float32 else F64_REGROUPED)
    for n in (1024, 1030, 4096, 5000):
        c = fast._cuts(n)
        assert c[0][0] == 0 and c[-1][1] == n and all(a[1] == b[0] for a, b in zip(c, c[1:]))
    assert fast._cuts(1023) is None


@given(attention_problem(max_batch=3, max_len=6))
def test_head_chunks_with_a_float_mask_and_bias_and_broadcast_inputs(problem):
    q, k, v, opts = problem
    rng = np.random.default_rng(3)
    opts = dict(opts, bias=rng.standard_normal(q.shape[-3:-1] + (k.shape[-2],)))
    for kk, vv in ((k, v), (k[:1], v[:1]), (k[0], v[0])):      # key / value shared over the batch
        with chunked(1):
            parts = _fwd_bwd(q, kk, vv, opts)
        plain = _fwd_bwd(q, kk, vv, opts, method="plain")
        for a, b in zip(plain, parts):
            _close(a, b)


def test_head_chunks_without_a_controllable_blas_run_one_by_one():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, 7, 4)) for _ in range(3))
    saved = _threads._BLAS_STATE["controllers"]
    try:
        _threads._BLAS_STATE["controllers"] = []
        with chunked(1):
            parts = _fwd_bwd(q, k, v, {"is_causal": True})
    finally:
        _threads._BLAS_STATE["controllers"] = saved
    with chunked(1, threads="1"):
        whole = _fwd_bwd(q, k, v, {"is_causal": True})
    for a, b in zip(whole, parts):
        np.testing.assert_array_equal(a, b)


class _FakeBLAS:
    """A BLAS controller that records its thread count and every call."""

    def __init__(self):
        self.threads, self.calls = 4, []

    def get_num_threads(self):
        return self.threads

    def set_num_threads(self, n):
        self.calls.append(n)
        self.threads = n


def test_blas_is_held_by_the_first_caller_in_and_restored_by_the_last_out():
    fake = _FakeBLAS()
    saved = _threads._BLAS_STATE["controllers"]
    _threads._BLAS_STATE["controllers"] = [fake]
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with _threads.single_threaded_blas() as ok:
            seen["a_ok"] = ok
            a_in.set()
            b_in.wait()
            seen["a"] = fake.threads
        a_out.set()

    def b():
        a_in.wait()
        with _threads.single_threaded_blas():
            b_in.set()
            a_out.wait()                        # a has left: the limit must still hold for b
            seen["b"] = fake.threads

    try:
        ts = [threading.Thread(target=a), threading.Thread(target=b)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        _threads._BLAS_STATE["controllers"] = saved
    assert seen == {"a_ok": True, "a": 1, "b": 1}
    assert fake.calls == [1, 4] and fake.threads == 4


def test_every_public_call_holds_the_blas_to_one_thread(monkeypatch):
    fake, seen = _FakeBLAS(), []
    monkeypatch.setitem(_threads._BLAS_STATE, "controllers", [fake])
    real = fast.forward

    def spy(prob, **kw):
        seen.append(fake.threads)
        return real(prob, **kw)

    monkeypatch.setattr(fast, "forward", spy)
    monkeypatch.setitem(__import__("sdpa_ref.api", fromlist=["ENGINES"]).ENGINES, "fast", fast)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 5, 3))
    sdpa_forward(q, q, q)
    assert seen == [1] and fake.threads == 4


def test_the_blas_holder_says_when_it_cannot_hold():
    saved = _threads._BLAS_STATE["controllers"]
    _threads._BLAS_STATE["controllers"] = []
    try:
        with _threads.single_threaded_blas() as ok:
            assert ok is False
        assert _threads._BLAS_STATE["users"] == 0
    finally:
        _threads._BLAS_STATE["controllers"] = saved


def _chunked_in_child(conn):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 9, 4)) for _ in range(3))
    with chunked(1):
        out, res = sdpa_forward(q, k, v)
        sdpa_backward(res, np.ones_like(out))
    conn.send(out.sum())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_thread_pool_works_in_a_forked_child():
    import multiprocessing as mp

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 9, 4)) for _ in range(3))
    with chunked(1):
        expected = sdpa_forward(q, k, v)[0].sum()      # the parent's pool exists before the fork
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_chunked_in_child, args=(child,))
    p.start()
    got = parent.recv() if parent.poll(30) else None
    p.join(10)
    if p.is_alive():
        p.kill()
    assert got == expected


@given(variant_problem(max_len=6))
def test_head_chunked_path_never_writes_into_the_inputs(problem):
    q, k, v, opts, _ = problem
    arrays = {"q": q, "k": k, "v": v, **{n: a for n, a in opts.items() if isinstance(a, np.ndarray)}}
    before = {n: a.copy() for n, a in arrays.items()}
    with chunked(1):
        out, res = sdpa_forward(q, k, v, **opts)
        g = np.ones_like(out)
        sdpa_backward(res, g)
    assert (g == 1).all()
    for n, a in arrays.items():
        np.testing.assert_array_equal(a, before[n], err_msg=n)


# ------------------------------------------------------------ the compiled row passes


def _both_paths(monkeypatch, fn):
    """``fn()`` with the compiled row passes and with NumPy's (``SDPA_REF_NATIVE=0``)."""
    from sdpa_ref.exact import _native
    if _native.kernels() is None:
        pytest.skip(f"only the NumPy row passes run here (compiled kernels: {_native.status()['reason']})")
    native = fn()
    monkeypatch.setenv("SDPA_REF_NATIVE", "0")
    numpy_ = fn()
    monkeypatch.delenv("SDPA_REF_NATIVE")
    return native, numpy_


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-13), (np.float32, 3e-5)])
@pytest.mark.parametrize("opts", [dict(), dict(is_causal=True, causal_alignment="bottom_right"),
                                  dict(softcap=5.0, window=(3, 1)), dict(dropout_p=0.3, rng=0),
                                  dict(fully_masked="nan"), dict(fully_masked="uniform")])
def test_compiled_row_passes_agree_with_numpys(monkeypatch, dtype, tol, opts):
    """The fused C softmax and softmax VJP against the NumPy passes they replace: the same values to rounding,
    the same NaN, the same empty rows (a fully masked row, every third)."""
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((2, 3, 37, 16)).astype(dtype) * s for s in (3.0, 1.0, 1.0, 1.0))
    mask = rng.random((2, 3, 37, 37)) < 0.7
    mask[..., ::3, :] = False if "fully_masked" in opts else mask[..., ::3, :]
    kw = dict(opts, attn_mask=mask, upcast=dtype == np.float64)

    def run():
        out, res = sdpa_forward(q, k, v, **kw)
        gr = sdpa_backward(res, g)
        return out, res.lse, gr.query, gr.key, gr.value

    native, numpy_ = _both_paths(monkeypatch, run)
    for a, b in zip(native, numpy_):
        assert np.array_equal(np.isnan(a), np.isnan(b))
        fin = np.isfinite(b)
        assert np.array_equal(np.isinf(a), np.isinf(b))
        scale = np.abs(b[fin]).max(initial=1.0)
        assert np.abs(a[fin] - b[fin]).max(initial=0.0) <= tol * scale


def _lib():
    from sdpa_ref.exact import _native
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use: {_native.status()['reason']}")
    return lib


def test_the_compiled_exp_is_within_one_ulp_down_to_the_subnormals():
    """The row passes' vectorised exp against the package's double-double exp (error about 2**-101) over its
    whole range, and its special values; also through the softmax rows ``[0, x]``, whose second entry is exp(x)
    itself once 1 + exp(x) rounds to 1 (x < -37)."""
    from sdpa_ref.exact import _native
    from sdpa_ref.exact.dd import dd, dd_exp
    lib = _lib()
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-760, 709.7, 200_000), rng.uniform(-1, 1, 100_000),
                        -np.linspace(0, 760, 20_001), np.linspace(0, 709.78, 2001)])
    got = _native.fast_exp(lib, x)
    want = dd_exp(dd(x))[0]
    normal = want >= np.finfo(float).tiny
    assert (np.abs(got[normal] - want[normal]) / np.spacing(want[normal])).max() <= 1.0
    assert np.all(np.abs(got[~normal] - want[~normal]) <= 2.0 ** -1074)            # subnormals: absolute
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 709.79, 710.0, 1e300, -1e300, -760.0001, -745.2])
    with np.errstate(over="ignore"):
        assert np.array_equal(_native.fast_exp(lib, special), np.exp(special), equal_nan=True)

    x = np.concatenate([-np.linspace(37.5, 707, 2001), -np.linspace(708, 760, 301), [-np.inf, -1e300]])
    t = np.stack([np.zeros_like(x), x], 1)
    m, s, lse = (np.empty((len(x), 1)) for _ in range(3))
    empty = np.empty((len(x), 1), bool)
    _native.fast_softmax_rows(lib, t, m, s, lse, empty)
    assert np.array_equal(t[:, 1], _native.fast_exp(lib, x))
    assert not empty.any() and np.all(s == 1.0) and np.all(m == 0.0)


def test_the_compiled_float32_exp_is_within_one_ulp():
    """The float32 row passes' exp (computed in float32) against exp in float64, over its whole range and its
    special values: within 1 ulp of the float32 grid, and within 2**-149 (one subnormal step) below it."""
    from sdpa_ref.exact import _native
    lib = _lib()
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.uniform(-104, 88.7, 300_000), rng.uniform(-1, 1, 100_000),
                        -np.linspace(0, 104, 20_001), np.linspace(0, 88.72, 2001)]).astype(np.float32)
    got = _native.fast_exp(lib, x)
    assert got.dtype == np.float32
    exact = np.exp(x.astype(np.float64))
    grid = exact.astype(np.float32)
    normal = grid >= np.finfo(np.float32).tiny
    assert (np.abs(got[normal] - exact[normal]) / np.spacing(grid[normal])).max() <= 1.0
    assert np.all(np.abs(got[~normal] - exact[~normal]) <= 2.0 ** -149)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 88.73, 89.0, 1e30, -1e30, -104.01], np.float32)
    with np.errstate(over="ignore"):
        assert np.array_equal(_native.fast_exp(lib, special), np.exp(special), equal_nan=True)


def test_fast_exp_writes_in_place_or_refuses_a_wrong_out():
    from sdpa_ref.exact import _native
    lib = _lib()
    x = np.array([0.0, -1.0, -np.inf])
    assert _native.fast_exp(lib, x, out=x) is x and x[0] == 1.0 and x[2] == 0.0
    for bad in (np.zeros(4), np.zeros(3, np.float32), np.zeros((3, 2))[:, 0]):
        with pytest.raises(ValueError, match="out must be C-contiguous float64 of shape"):
            _native.fast_exp(lib, np.zeros(3), out=bad)


@pytest.fixture
def simd_levels():
    """Every SIMD build of the row passes this CPU runs (the best one restored afterwards)."""
    from sdpa_ref.exact import _native
    lib = _lib()
    have = [lv for lv in _native.SIMD_LEVELS if _native.simd_level(lib, lv) == lv]
    yield lib, have
    _native.simd_level(lib, "best")


def _row_passes(lib, rng, lengths):
    """``(P, row max, row sum, lse, empty, VJP)`` of the compiled row passes on rows of each length (shorter than
    the eight lanes, a multiple of them, with a tail), with NaN, -inf and fully masked rows, float64 then float32."""
    from sdpa_ref.exact import _native
    out = []
    for dtype in (np.float64, np.float32):
        for n in lengths:
            t = rng.standard_normal((9, n)).astype(dtype) * 20
            t[1] = -np.inf
            t[2, ::2] = -np.inf
            t[3, -1] = np.nan
            g = rng.standard_normal((9, n)).astype(dtype)
            m, s, lse = (np.empty((9, 1), dtype) for _ in range(3))
            empty = np.empty((9, 1), bool)
            _native.fast_softmax_rows(lib, t, m, s, lse, empty)
            t[1] = 0.0                                     # the engine fills empty rows; the VJP reads P
            _native.fast_softmax_vjp_rows(lib, g, t)
            out.append((t, m, s, lse, empty, g))
    return out


def test_every_simd_build_of_the_row_passes_gives_the_same_bits(simd_levels):
    """Every build of the compiled row passes this CPU runs (baseline, AVX2, AVX-512), on rows of every length
    class (shorter than the eight lanes, a multiple of them, with a tail), with NaN, -inf and fully masked rows,
    in float64 and float32, and the whole fast path on top of them."""
    from sdpa_ref.exact import _native
    lib, have = simd_levels
    if len(have) < 2:
        pytest.skip(f"this CPU runs only the {have[0]} build")

    def passes(level):
        _native.simd_level(lib, level)
        rng = np.random.default_rng(11)
        out = [a for row in _row_passes(lib, rng, (1, 5, 8, 37, 256)) for a in row]
        out.append(_native.fast_exp(lib, rng.uniform(-800, 720, 1001)))
        q, k, v, do = (rng.standard_normal((2, 3, 45, 16)) for _ in range(4))
        o, res = sdpa_forward(q, k, v, is_causal=True, softcap=20.0)
        gr = sdpa_backward(res, do)
        o32, res32 = sdpa_forward(*(a.astype(np.float32) for a in (q, k, v)), upcast=False)
        gr32 = sdpa_backward(res32, do.astype(np.float32))
        return out + [o, res.lse, gr.query, gr.key, gr.value, o32, gr32.query, gr32.key, gr32.value]

    results = {level: passes(level) for level in have}
    first = results[have[0]]
    for level in have[1:]:
        assert len(results[level]) == len(first)
        for a, b in zip(first, results[level]):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), level


def test_a_bad_simd_level_is_refused(monkeypatch):
    from sdpa_ref.exact import _native
    lib = _lib()
    with pytest.raises(ValueError, match="level must be"):
        _native.simd_level(lib, "avx9")
    monkeypatch.setenv("SDPA_REF_SIMD", "sse9")
    with pytest.raises(ValueError, match="SDPA_REF_SIMD must be one of baseline, avx2.*'sse9'"):
        _native.kernels()


def test_the_compiled_kernels_are_installed_wherever_a_compiler_is():
    """With a C compiler on PATH the installed package must hold the library built at install (next to
    ``_native.py``, from ``_kernels.c``, ``_fast_rows.c`` and the ``_fast_rows.h`` it includes): a file left out
    of the package, or a build step skipped, would otherwise make every compiled-path test above skip as if there
    were no compiler. Without a compiler it skips, saying what the install recorded."""
    import shutil

    from sdpa_ref.exact import _native
    if os.environ.get("SDPA_REF_NATIVE", "1") == "0":
        pytest.skip("SDPA_REF_NATIVE=0")
    for f in _native._SOURCES + _native._HEADERS:
        assert os.path.exists(f), f
    st = _native.status()
    if not st["in_use"] and (os.environ.get("SDPA_REF_EXPECT_NO_KERNELS", "") not in ("", "0")
                             or "SDPA_REF_NO_COMPILE" in str(st["reason"])):     # the install was asked to build none
        pytest.skip(f"installed without the compiled kernels: {st['reason']}")
    if shutil.which(os.environ.get("CC") or "cc") is None and not st["in_use"]:
        pytest.skip(f"no C compiler here, and the compiled kernels are not in use: {st['reason']}")
    assert st["in_use"], (f"a C compiler is here but the compiled kernels are not in use: {st['reason']} "
                          "(a checkout: pip install -e .; an installed copy: reinstall it)")
    assert _native.kernels() is not None


#: sha256 of the compiled row passes' results on fixed inputs (P, the row max and sum, emptiness, the VJP, exp in
#: float64 and float32; not the LSE, whose log is libm's): IEEE operations in eight fixed lanes and a fixed order,
#: so the same on every machine and in every SIMD build; recorded before the AVX-512 build was added (issue 26).
#: Changed once (issue 40): the all-NaN row of length 1 was flagged empty (filled with 0 by the policy); it is a
#: NaN row now (normalize.row_stats), and every other byte is the old library's.
ROW_PASS_BITS = "d399d66ebac3fab19ce6a7df386edc0b39ac321b67fa56678bbcae54532ca85e"


def _row_pass_digest(lib):
    import hashlib

    from sdpa_ref.exact import _native
    rng = np.random.default_rng(2026)
    h = hashlib.sha256()
    for t, m, s, lse, empty, g in _row_passes(lib, rng, (1, 5, 8, 37, 256, 1000)):
        for a in (t, m, s, empty, g):
            h.update(a.tobytes())
    h.update(_native.fast_exp(lib, rng.uniform(-800, 720, 1001)).tobytes())
    h.update(_native.fast_exp(lib, rng.uniform(-110, 95, 1001).astype(np.float32)).tobytes())
    return h.hexdigest()


def test_every_simd_build_gives_the_pinned_bits(simd_levels):
    """Each build this CPU runs (AVX-512 included where it has it) gives the recorded bits: the builds agree with
    one another and with the builds of every other machine, and adding a build changed no bit."""
    from sdpa_ref.exact import _native
    lib, have = simd_levels
    for level in have:
        assert _native.simd_level(lib, level) == level
        assert _row_pass_digest(lib) == ROW_PASS_BITS, level


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def test_a_build_the_cpu_lacks_is_never_picked(simd_levels):
    """The widest build the CPU runs is the default, and asking for a wider one gives it instead (x86-64 Linux,
    where /proc/cpuinfo tells what the CPU has; the OS's support for the registers is checked by the library)."""
    import platform

    from sdpa_ref.exact import _native
    flags = _cpu_flags()
    if flags is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs the CPU flags of x86-64 Linux")
    lib, have = simd_levels
    expect = ["baseline"] + (["avx2"] if "avx2" in flags else [])
    if "avx2" in flags and {"avx512f", "avx512dq", "avx512vl", "avx512bw"} <= flags:
        expect.append("avx512")
    assert have == expect
    for level in _native.SIMD_LEVELS:
        got = _native.simd_level(lib, level)
        assert got == (level if level in expect else expect[-1])
    assert _native.simd_level(lib, "best") == expect[-1]


# ------------------------------------------------- the query blocks' key spans


@contextmanager
def _span_rows(n):
    """The block-skipping schedule with blocks of ``n`` query rows, so that small problems skip keys."""
    old, old_min = fast.span_rows, (fast.SPAN_MIN_KEYS, fast.SPAN_MIN_KEYS_NARROW)
    fast.span_rows = lambda L: n
    fast.SPAN_MIN_KEYS = fast.SPAN_MIN_KEYS_NARROW = 0
    try:
        yield
    finally:
        fast.span_rows, (fast.SPAN_MIN_KEYS, fast.SPAN_MIN_KEYS_NARROW) = old, old_min


@pytest.mark.parametrize("policy", ["nan", "uniform", "jax", "zero"])
def test_a_fully_masked_row_read_past_the_spans_under_its_policy(policy):
    """At the schedule's own size (1024 keys, blocks of 128 rows), a causal problem whose bool mask empties row 3:
    "nan", "uniform" and "jax" fill that row on keys past its block's span, so the backward and the JVP read the
    whole rows (fast._read_spans); the output, every gradient and the JVP are the plain engine's, NaN where it has
    NaN. (Before, dK and dV missed the row's NaN or 1/S past the span.)"""
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((1, 2, 1024, 4)) for _ in range(3))
    mask = np.ones((1024, 1024), bool)
    mask[3] = False
    opts = dict(is_causal=True, attn_mask=mask, fully_masked=policy)
    g = rng.standard_normal((1, 2, 1024, 4))
    ts = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    out_f, res_f = sdpa_forward(q, k, v, **opts)
    assert res_f.forward.extra is not None                    # the forward took the spans
    out_p, res_p = sdpa_forward(q, k, v, method="plain", **opts)
    got = [out_f, *sdpa_backward(res_f, g)[:3], sdpa_jvp((q, k, v), ts, **opts)[1]]
    want = [out_p, *sdpa_backward(res_p, g, method="plain")[:3], sdpa_jvp((q, k, v), ts, method="plain", **opts)[1]]
    for a, b in zip(got, want):
        assert_close_normwise(b, a, F64_REGROUPED)


@pytest.mark.parametrize("policy", ["nan", "uniform", "jax", "zero"])
def test_per_batch_lengths_take_the_spans_with_the_plain_engines_answer(policy):
    """Per-batch lengths (a padded varlen batch: padded rows, keys past a sequence's length, one sequence whose
    first query rows have no key under bottom-right alignment) take the span schedule at its own size, and the
    output, LSE, gradients and JVP are the plain engine's under every policy, NaN where it has NaN."""
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((3, 2, 1024, 4)) for _ in range(3))
    opts = dict(is_causal=True, causal_alignment="bottom_right", fully_masked=policy,
                q_lengths=np.array([1024, 300, 700]), kv_lengths=np.array([1024, 500, 400]))
    g = rng.standard_normal(q.shape)
    ts = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    out_f, res_f = sdpa_forward(q, k, v, **opts)
    assert res_f.forward.extra is not None                    # the spans
    out_p, res_p = sdpa_forward(q, k, v, method="plain", **opts)
    got = [out_f, res_f.lse, *sdpa_backward(res_f, g)[:3], sdpa_jvp((q, k, v), ts, **opts)[1]]
    want = [out_p, res_p.lse, *sdpa_backward(res_p, g, method="plain")[:3],
            sdpa_jvp((q, k, v), ts, method="plain", **opts)[1]]
    for a, b in zip(got, want):
        assert_close_normwise(b, a, F64_REGROUPED)


@pytest.mark.parametrize("policy", ["zero", "nan", "uniform", "jax"])
def test_a_padded_varlen_batch_runs_each_sequence_on_its_own_spans(policy, monkeypatch):
    """A packed varlen batch padded to its longest sequence, below the spans' own size (384 keys): each batch entry
    takes its own spans where they hold at most half its scores (the short sequences: their padding is not
    computed) and the longest runs whole rows; with GQA, sinks and dropout, one sequence's first rows without a
    key (bottom-right), the output, LSE, gradients and JVP are the plain engine's under every policy, NaN where it
    has NaN, and the bits are the same on one thread and three."""
    rng = np.random.default_rng(21)
    B, Hkv, G, L, E = 4, 2, 2, 384, 8
    q, g = (rng.standard_normal((B, Hkv * G, L, E)) for _ in range(2))
    k, v = (rng.standard_normal((B, Hkv, L, E)) for _ in range(2))
    opts = dict(is_causal=True, causal_alignment="bottom_right", fully_masked=policy, enable_gqa=True,
                q_lengths=np.array([48, 384, 200, 130]), kv_lengths=np.array([48, 384, 100, 256]),
                sinks=np.array([0.3, -np.inf, 1.0, -0.5]), dropout_p=0.25,
                dropout_mask=rng.random((B, Hkv * G, L, L)) > 0.25)
    ts = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    runs = []
    for n in ("1", "3"):
        monkeypatch.setenv("SDPA_REF_NUM_THREADS", n)
        out, res = sdpa_forward(q, k, v, **opts)
        runs.append([out, res.lse, *sdpa_backward(res, g)[:3], sdpa_jvp((q, k, v), ts, **opts)[1]])
    per = res.forward.extra.per                                   # the short sequences on spans, the longest not
    assert per[(1,)] is None and all(per[(b,)] is not None for b in (0, 2, 3))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    out_p, res_p = sdpa_forward(q, k, v, method="plain", **opts)
    want = [out_p, res_p.lse, *sdpa_backward(res_p, g, method="plain")[:3],
            sdpa_jvp((q, k, v), ts, method="plain", **opts)[1]]
    for a, b in zip(runs[0], want):
        assert_close_normwise(b, a, F64_REGROUPED)


@pytest.mark.parametrize("policy", ["zero", "nan", "uniform", "jax"])
def test_a_bool_mask_that_differs_over_two_batch_axes_gives_each_entry_its_spans(policy):
    """A bool mask with two batch axes (a band whose width differs per entry, some rows left without a key): the
    entries whose spans hold at most half their scores take them, the others run whole rows, and the output and
    gradients are the plain engine's, NaN where it has NaN."""
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((2, 3, 2, 300, 8)) for _ in range(4))
    i, j = np.arange(300)[:, None], np.arange(300)[None, :]
    mask = np.stack([np.stack([(j <= i) & (j >= i - w - 7 * a) & (i % 97 != 5) for w in (20, 60, 400)])
                     for a in range(2)])[:, :, None]
    out, res = sdpa_forward(q, k, v, attn_mask=mask, fully_masked=policy)
    per = res.forward.extra.per
    assert [per[(a, b)] is not None for a in range(2) for b in range(3)] == [True, False, False] * 2
    out_p, res_p = sdpa_forward(q, k, v, attn_mask=mask, fully_masked=policy, method="plain")
    for a, b in zip([out_p, *sdpa_backward(res_p, g, method="plain")[:3]], [out, *sdpa_backward(res, g)[:3]]):
        assert_close_normwise(a, b, F64_REGROUPED)


@given(variant_problem(max_len=6), st.integers(1, 3))
def test_the_block_skipping_schedule_equals_plain_on_every_option(problem, rows):
    """With blocks of a few query rows, every mask (causal in both alignments, windows, chunks, lengths, block
    masks, mask functions) leaves whole key spans out of the products and row passes; the forward, the LSE, P
    (0 outside the spans), the backward and the JVP still agree with the plain engine's, and the schedule is
    the one taken whenever a span skips a key."""
    q, k, v, opts, _ = problem
    out_p, res_p = sdpa_forward(q, k, v, method="plain", **opts)
    with _span_rows(rows):
        out_f, res_f = sdpa_forward(q, k, v, **opts)
        g = np.random.default_rng(0).standard_normal(out_p.shape)
        grads = sdpa_backward(res_f, g)
        ts = _tangents(q, k, v, opts)
        dout_f = sdpa_jvp((q, k, v), ts, method="fast", **opts)[1]
        prob = res_f.problem
        assert (res_f.forward.extra is None) == (fast._spans(prob, prob.allowed()) is None)
    _close(out_p, out_f)
    _close(res_p.probs, res_f.probs)
    np.testing.assert_array_equal(res_p.lse == -np.inf, res_f.lse == -np.inf)
    for a, b in zip(sdpa_backward(res_p, g, method="plain"), grads):
        _close(a, b)
    _close(sdpa_jvp((q, k, v), ts, method="plain", **opts)[1], dout_f)


def test_a_causal_call_computes_about_half_the_scores():
    """At L = 1024 causal, the products cover 56 % of the scores (the diagonal blocks' upper halves are the
    rest of the 0.5 + b / 2L), in rectangles of which all but the diagonal blocks need no mask, and the
    result equals the unmasked schedule's on a mask given as an array."""
    from sdpa_ref.engines.blocks import key_spans
    L = 1024
    allowed = np.tril(np.ones((L, L), bool))
    summ = key_spans(allowed, L, L, fast.span_rows(L))
    area = sum((i1 - i0) * (j1 - j0) for i0, i1, j0, j1 in summ.rects)
    assert area / L ** 2 <= 0.5 + fast.span_rows(L) / (2 * L)
    assert sum(not summ.is_full(*r) for r in summ.rects) == L // fast.span_rows(L)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 300, 8)) for _ in range(3))
    assert sdpa_forward(q, k, v, is_causal=True)[1].forward.extra is None      # below SPAN_MIN_KEYS: whole rows
    g = rng.standard_normal(q.shape)
    with _span_rows(64):
        out_c, res_c = sdpa_forward(q, k, v, is_causal=True)
        assert res_c.forward.extra is not None
        grads_c = sdpa_backward(res_c, g)
    out_m, res_m = sdpa_forward(q, k, v, attn_mask=np.tril(np.ones((300, 300), bool)), method="plain")
    _close(out_m, out_c)
    for a, b in zip(sdpa_backward(res_m, g), grads_c):
        _close(a, b)


def test_the_block_skipping_backward_keeps_dT_for_the_bias_under_softcap():
    """With a bias (whose gradient is dT) and softcap (dTraw = dT sech^2), the spans' backward keeps dT and
    dTraw apart: the bias's gradient is dT, not dTraw (a first version multiplied the kept dT in place)."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 5, 3)) for _ in range(3))
    k, v = (rng.standard_normal((1, 2, 9, 3)) for _ in range(2))
    opts = dict(is_causal=True, bias=rng.standard_normal((1, 2, 5, 9)), softcap=2.0)
    out_p, res_p = sdpa_forward(q, k, v, method="plain", **opts)
    g = rng.standard_normal(out_p.shape)
    with _span_rows(64):
        out_f, res_f = sdpa_forward(q, k, v, **opts)
        assert res_f.forward.extra is not None              # keys 8 of 9 and beyond are skipped
        grads_f = sdpa_backward(res_f, g)
    for a, b in zip(sdpa_backward(res_p, g), grads_f):
        _close(a, b)
