"""The same bits from every thread and after fork (issue 21, item 4).

Every public call holds the BLAS to one thread (``_threads.py``), so
that its results do not depend on how many threads the BLAS would use. The
review's failure: called from a thread other than the first one that used
the package, the limit silently did nothing (threadpoolctl lets only one
"controlling" thread change OpenBLAS's process-wide setting), and ``dk``,
``dv`` of the problem below came out with other last bits.

Each test compares sha256 digests of ``out``, ``dq``, ``dk``, ``dv`` with
those computed on the main thread: from a new thread, from four threads at
once, from a ``ThreadPoolExecutor``, in forked children (``os.fork`` and
multiprocessing's ``fork``), and in fresh interpreters with
``OPENBLAS_NUM_THREADS`` unset, 1 and 2. Where the BLAS's thread count does
not change a product's bits (another machine, another kernel) those
comparisons cannot fail, so the mechanism is checked directly too: the BLAS
reports one thread, in the calling thread and in the package's pool, inside
every call from any thread, and gets its own count back whichever thread
leaves last.

Run as a script, it prints the digests as JSON (the subprocess tests use it).
"""

import concurrent.futures
import hashlib
import json
import os
import select
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref import _threads
from sdpa_ref.engines import fast

#: ``(name, query shape, key/value shape, options)``; every case is GQA and causal. "review" is the shape the
#: review reproduced the failure with: the ``G * L = 1200`` rows summed into ``dk`` and ``dv`` are a GEMM's inner
#: dimension, which OpenBLAS cuts differently on one thread and on two.
CASES = [
    ("review", (2, 4, 300, 32), (2, 2, 1100, 32), {}),
    ("small", (1, 2, 24, 8), (1, 1, 40, 8), {}),
    ("reproducible", (1, 2, 24, 8), (1, 1, 40, 8), {"precision": "reproducible"}),
]
TIMEOUT = 120          # seconds before a thread or child that has not answered is a failure (a deadlock)


def _inputs(i, qs, ks):
    # Generator.uniform: the same bits on every machine (standard_normal's tail calls the platform's log).
    rng = np.random.default_rng(i)
    return tuple(rng.uniform(-2.0, 2.0, size=s) for s in (qs, ks, ks, qs))


def _sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def digests():
    """``{case: {"out" | "dq" | "dk" | "dv": sha256}}`` computed in the calling thread."""
    res = {}
    for i, (name, qs, ks, opts) in enumerate(CASES):
        q, k, v, g = _inputs(i, qs, ks)
        out, r = sdpa_ref.sdpa_forward(q, k, v, is_causal=True, enable_gqa=True, **opts)
        gr = sdpa_ref.sdpa_backward(r, g)
        res[name] = {"out": _sha(out), "dq": _sha(gr.query), "dk": _sha(gr.key), "dv": _sha(gr.value)}
    return res


@pytest.fixture(scope="module")
def expected():
    """The main thread's digests (pytest runs the tests on the main thread)."""
    assert threading.current_thread() is threading.main_thread()
    return digests()


def _blas_threads():
    """The thread count each BLAS the package calls reports to the calling thread (``[]`` when threadpoolctl sees
    none): NumPy's, loaded with it; not one that another library loads later (scipy brings its own OpenBLAS, which
    a test elsewhere in the same worker may have imported), which no engine calls."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    ours = {c.filepath for c in (_threads._BLAS_STATE["controllers"] or [])}
    return [i["num_threads"] for i in threadpool_info()
            if i["user_api"] == "blas" and (not ours or i["filepath"] in ours)]


def _needs_a_held_blas():
    with _threads.single_threaded_blas() as held:
        if not held:
            pytest.skip("no BLAS that threadpoolctl can control: the limit is not applied")


def _in_thread(fn, *args):
    """``fn(*args)`` on a new thread; its exception re-raised here."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive(), "the thread did not finish"
    if "error" in box:
        raise box["error"]
    return box["value"]


# ------------------------------------------------------------------ the same bits from every thread


def test_a_new_thread_gets_the_main_threads_bits(expected):
    assert _in_thread(digests) == expected


def test_four_threads_at_once_each_get_the_main_threads_bits(expected):
    barrier = threading.Barrier(4, timeout=TIMEOUT)
    results = [None] * 4

    def run(i):
        barrier.wait()                              # start together, so that the calls overlap
        results[i] = digests()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in ts)
    for r in results:
        assert r == expected


def test_a_thread_pool_executor_gets_the_main_threads_bits(expected):
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as ex:
        results = [f.result(TIMEOUT) for f in [ex.submit(digests) for _ in range(2)]]
    for r in results:
        assert r == expected


# ------------------------------------------------------------------ the mechanism: one BLAS thread in every call


def test_the_blas_runs_one_thread_inside_every_call_from_any_thread(monkeypatch):
    """What the engine's GEMMs see, in the calling thread and in the package's pool: one BLAS thread, whether
    the call comes from the main thread, a new thread, or two threads at once."""
    _needs_a_held_blas()
    seen = []
    real = fast.backward

    def spy(*a, **kw):
        seen.append(("caller", threading.current_thread().name, _blas_threads()))
        worker = _threads.pool(_threads.num_threads()).submit(_blas_threads).result(TIMEOUT)
        seen.append(("pool", threading.current_thread().name, worker))
        return real(*a, **kw)

    monkeypatch.setattr(fast, "backward", spy)
    name, qs, ks, opts = CASES[1]

    def call():
        q, k, v, g = _inputs(1, qs, ks)
        out, r = sdpa_ref.sdpa_forward(q, k, v, is_causal=True, enable_gqa=True)
        sdpa_ref.sdpa_backward(r, g)

    call()                                           # the main thread first: the order that used to fail
    _in_thread(call)
    two = [threading.Thread(target=call) for _ in range(2)]
    for t in two:
        t.start()
    for t in two:
        t.join(TIMEOUT)
    assert len(seen) == 8
    assert all(n and set(n) == {1} for _, _, n in seen), seen


def _play(steps):
    """Run ``steps`` (``(thread, action)``, thread "main" or "other", action "enter", "exit" or "look") in that
    order on two threads; "look" records the BLAS's thread counts as that thread sees them."""
    cond, turn, seen = threading.Condition(), [0], []

    def actor(who):
        holder = None
        for i, (w, act) in enumerate(steps):
            if w != who:
                continue
            with cond:
                assert cond.wait_for(lambda: turn[0] == i, TIMEOUT), "a step never came"
            if act == "enter":
                holder = _threads.single_threaded_blas()
                holder.__enter__()
            elif act == "exit":
                holder.__exit__(None, None, None)
            else:
                seen.append((i, who, _blas_threads()))
            with cond:
                turn[0] += 1
                cond.notify_all()

    t = threading.Thread(target=actor, args=("other",))
    t.start()
    try:
        actor("main")
    finally:
        t.join(TIMEOUT)
    assert not t.is_alive()
    return seen


@pytest.mark.parametrize("first_in, first_out", [("main", "main"), ("main", "other"), ("other", "main"),
                                                 ("other", "other")])
def test_overlapping_calls_keep_the_limit_and_the_last_out_gives_the_blas_back(first_in, first_out):
    """Two holders on different threads, in every order of entering and leaving: the BLAS is at one thread
    while either is inside (also for the one that entered second, and the one left after the other went), and
    gets its own count back when the last one leaves, whichever thread that is."""
    _needs_a_held_blas()                                 # (on the main thread, before the other one)
    from threadpoolctl import threadpool_limits

    second_in = "other" if first_in == "main" else "main"
    last_out = "other" if first_out == "main" else "main"
    with threadpool_limits(limits=2, user_api="blas"):   # a count other than 1 to give back, whatever came before
        before = _blas_threads()
        seen = _play([(first_in, "enter"), (first_in, "look"), (second_in, "enter"), (second_in, "look"),
                      (first_in, "look"), (first_out, "exit"), (last_out, "look"), (last_out, "exit")])
        after = _blas_threads()
    assert all(set(n) == {1} for _, _, n in seen), seen
    assert after == before


class _PerThreadBLAS:
    """A BLAS whose thread count is per calling thread (OpenBLAS built on OpenMP, through threadpoolctl)."""

    internal_api, threading_layer = "openblas", "openmp"

    def __init__(self, default=4):
        self.default, self.local = default, threading.local()

    def get_num_threads(self):
        return getattr(self.local, "n", self.default)

    def set_num_threads(self, n):
        self.local.n = n


def test_a_per_thread_blas_is_held_in_the_calling_thread_and_in_the_pool(monkeypatch):
    fake, seen = _PerThreadBLAS(), []
    monkeypatch.setitem(_threads._BLAS_STATE, "controllers", [fake])
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "2")
    real = fast.backward

    def spy(*a, **kw):
        seen.append(fake.get_num_threads())
        _threads.run_all(lambda _: seen.append(fake.get_num_threads()), range(4))
        return real(*a, **kw)

    monkeypatch.setattr(fast, "backward", spy)

    def call():
        q, k, v, g = _inputs(1, CASES[1][1], CASES[1][2])
        out, r = sdpa_ref.sdpa_forward(q, k, v, is_causal=True, enable_gqa=True)
        sdpa_ref.sdpa_backward(r, g)
        return fake.get_num_threads()               # this thread's own count, given back

    assert _in_thread(call) == 4
    assert call() == 4
    assert seen == [1] * 10


# ------------------------------------------------------------------ fork


def _child_digests_over(fd):
    """In a forked child: the digests, as JSON, written to ``fd``; then exit without running the parent's
    clean-up."""
    code = 1
    try:
        os.write(fd, json.dumps(digests()).encode())
        code = 0
    finally:
        os.close(fd)
        os._exit(code)


def _read_child(pid, fd):
    """The child's JSON answer; the child killed and the test failed if it does not answer in time."""
    chunks, deadline = [], time.monotonic() + TIMEOUT
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            if not ready:
                os.kill(pid, 9)
                pytest.fail("the forked child did not answer: a deadlock")
            b = os.read(fd, 1 << 16)
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return json.loads(b"".join(chunks))


def needs_fork(test):
    """Skip where there is no fork; Python 3.12's warning that forking a threaded process may deadlock is what
    these tests check, so it is silenced."""
    test = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")(test)
    return pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")(test)


@needs_fork
def test_a_forked_child_gets_the_main_threads_bits(expected):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                     # pragma: no cover - the child
        os.close(r)
        _child_digests_over(w)
    os.close(w)
    assert _read_child(pid, r) == expected


@needs_fork
def test_a_child_forked_while_another_thread_is_inside_a_call(expected):
    """The fork comes while a parent thread holds the BLAS (and its lock may be taken): the child must not
    deadlock, must get its BLAS's own count back, and compute the same bits."""
    _needs_a_held_blas()
    before = _blas_threads()
    inside, done = threading.Event(), threading.Event()

    def hold():
        with _threads.single_threaded_blas():
            inside.set()
            done.wait(TIMEOUT)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(TIMEOUT)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                 # pragma: no cover - the child
            os.close(r)
            code = 1
            try:
                ok = _blas_threads() == before
                os.write(w, json.dumps({"blas_back": ok, "digests": digests()}).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        got = _read_child(pid, r)
    finally:
        done.set()
        t.join(TIMEOUT)
    assert got["blas_back"]
    assert got["digests"] == expected


def _mp_child(conn):
    conn.send(digests())
    conn.close()


@needs_fork
def test_a_multiprocessing_fork_child_gets_the_main_threads_bits(expected):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_mp_child, args=(child,))
    p.start()
    try:
        got = parent.recv() if parent.poll(TIMEOUT) else None
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert got == expected


# ------------------------------------------------------------------ the BLAS's thread setting


@pytest.mark.parametrize("openblas_threads", [None, "1", "2"])
def test_a_fresh_process_gets_the_same_bits_under_any_openblas_num_threads(expected, openblas_threads):
    env = dict(os.environ)
    env.pop("OPENBLAS_NUM_THREADS", None)
    if openblas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = openblas_threads
    p = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["main"] == expected
    assert got["thread"] == expected


if __name__ == "__main__":
    main = digests()
    print(json.dumps({"main": main, "thread": _in_thread(digests)}))


def test_ordered_yields_in_order_with_a_bounded_window_and_runs_nested_calls_inline(monkeypatch):
    import threading
    import time

    from sdpa_ref._threads import ordered, run_all
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "2")
    live, most, lock = [0], [0], threading.Lock()

    def fn(i):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        time.sleep(0.002 * (5 - i % 5))            # later items may finish first
        inner = []
        run_all(inner.append, range(3))             # from a pool item: inline, no wait on the pool itself
        with lock:
            live[0] -= 1
        return i, inner

    got = list(ordered(fn, range(12), ahead=3))
    assert [i for i, _ in got] == list(range(12))
    assert all(inner == [0, 1, 2] for _, inner in got)
    assert most[0] <= 3

    def bad(i):
        if i == 4:
            raise ValueError("item 4")
        return i
    with pytest.raises(ValueError, match="item 4"):
        list(ordered(bad, range(8)))
