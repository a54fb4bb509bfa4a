"""Implementations that turn against the harness, for tests/test_harness_isolate.py (importable by ``module:function``).

Each one returns, or pretends to return, a result it did not compute: it exits the process, forks and exits,
outlives the time limit however it is interrupted, rewrites the judge, or reads the reference off the stack.
None of them may ever pass; under isolation (``sdpa-ref conform``'s default) each is a failed case and the
run ends in about the time limit per case.
"""

import os
import signal
import sys
import time

import numpy as np

from sdpa_ref import scaled_dot_product_attention, sdpa_backward, sdpa_forward


def honest(q, k, v, **o):
    return scaled_dot_product_attention(q, k, v, **o)


def honest_blhd(q, k, v, **o):
    """``honest`` for the ``(..., L, H, E)`` layout."""
    t = lambda a: np.swapaxes(a, -3, -2)  # noqa: E731
    return t(scaled_dot_product_attention(t(q), t(k), t(v), **o))


def exits(q, k, v, **o):
    """The process ends with status 0 in the middle of a case."""
    os._exit(0)


def forks(q, k, v, **o):
    """The process called exits with status 0; a forked copy carries on and returns the right answer."""
    if os.fork():
        os._exit(0)
    return scaled_dot_product_attention(q, k, v, **o)


def catches_the_timeout(q, k, v, **o):
    """Swallows whatever interrupts it (BaseException included) and never returns."""
    while True:
        try:
            while True:
                time.sleep(0.01)
        except BaseException:
            pass


def ignores_sigalrm(q, k, v, **o):
    """Ignores the alarm and spins."""
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        pass


def never_answers(q, k, v, **o):
    """Closes nothing, says nothing: blocks forever."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(10 ** 6)


def patches_abs(q, k, v, **o):
    """Makes every difference zero, then returns zeros."""
    np.abs = lambda a, *args, **kw: np.zeros(np.shape(a))
    return np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)


def patches_the_judge(q, k, v, **o):
    """Replaces the judge's comparison by one that always passes, then returns zeros."""
    from sdpa_ref.harness import judge
    from sdpa_ref.harness.report import ConformanceRow

    judge._compare = lambda case, dt, qty, *a: ConformanceRow(case, dt, qty, "pass", error=0.0, allowed=1.0,
                                                               ratio=0.0)
    return np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)


def reads_the_stack(q, k, v, **o):
    """Returns the harness's own reference, found in a caller's frame."""
    f = sys._getframe(1)
    while f is not None:
        ref = f.f_locals.get("ref64")
        if isinstance(ref, dict) and "out" in ref:
            return np.nan_to_num(ref["out"]).astype(q.dtype)
        f = f.f_back
    return np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)


def returns_a_generator(q, k, v, **o):
    yield scaled_dot_product_attention(q, k, v, **o)


def prints(q, k, v, **o):
    """Writes to stdout, where the report goes."""
    print("{not json")
    return scaled_dot_product_attention(q, k, v, **o)


def closes_its_channel(q, k, v, **o):
    """Closes every descriptor it did not open itself, then answers."""
    os.closerange(3, 1024)
    return scaled_dot_product_attention(q, k, v, **o)


def crashes_on_five_queries(q, k, v, **o):
    """Dies by SIGKILL on a case with L = 5 and answers correctly on the others (a fresh process must take them)."""
    if q.shape[-2] == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return scaled_dot_product_attention(q, k, v, **o)


def backward_exits(g, q, k, v, **o):
    os._exit(0)


def refuses(q, k, v, **o):
    raise NotImplementedError("no")


_KEPT = {}


def fills_in_later(q, k, v, **o):
    """Returns zeros, and keeps them to write the right answer into from the backward (after the harness took
    them, before it compares them)."""
    out = np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
    _KEPT["out"] = out
    return out


def fills_in_later_bwd(g, q, k, v, **o):
    out, res = sdpa_forward(q, k, v, **o)
    _KEPT.pop("out")[...] = out
    gr = sdpa_backward(res, g)
    return gr.query, gr.key, gr.value


def forks_and_waits(q, k, v, **o):
    """Forks; the copy returns zeros into the harness (and ends itself after 3 s if the harness lets it run on).
    The caller returns the right answer only if the copy ended with status 70, as the harness stops it."""
    import threading

    pid = os.fork()
    if pid == 0:
        threading.Timer(3.0, os._exit, (99,)).start()
        return np.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
    _, status = os.waitpid(pid, 0)
    out = scaled_dot_product_attention(q, k, v, **o)
    return out if os.waitstatus_to_exitcode(status) == 70 else np.zeros_like(out)
