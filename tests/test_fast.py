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

from sdpa_ref import sdpa_backward, sdpa_forward
from sdpa_ref.engines import _threads, fast

from helpers import assert_close_normwise
from strategies import attention_problem, variant_problem

FAST_RTOL = 1e-14


def _close(x, y, rtol=FAST_RTOL):
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
    from sdpa_ref.engines._threads import num_threads

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
    out, res = sdpa_forward(q, k, v, **opts, **kw)
    g = np.random.default_rng(0).standard_normal(out.shape)
    return (out, res.probs, res.lse) + tuple(x for x in sdpa_backward(res, g, method=kw.get("method")) if x is not None)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(1, 50), st.integers(1, 30))
def test_head_chunks_cover_every_head_once(lead, unit, entries):
    lead = tuple(lead)
    seen = np.zeros(lead, dtype=int)
    old = fast._CHUNK_ENTRIES
    fast._CHUNK_ENTRIES = entries
    try:
        for c in fast._head_chunks(lead, unit):
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
