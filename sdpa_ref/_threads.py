"""The package's threads: one pool, the BLAS held to one thread, and fork safety.

**Why the BLAS is held to one thread.** OpenBLAS's threaded GEMM splits the
inner dimension differently from its single-threaded one (``K = 600`` is
``304 + 296`` on one thread and ``300 + 300`` on two, seen with the SkylakeX
kernels), so a product's last bits depend on how many threads the BLAS uses.
Every public call of the package therefore runs inside
:func:`single_threaded_blas`, and all its parallelism comes from this
module's pool, over pieces cut from the shape alone. The result is the same
bytes for any ``SDPA_REF_NUM_THREADS`` and any ``OPENBLAS_NUM_THREADS``, and
from any calling thread (``tests/test_threads.py``).

**Which threads the limit reaches.** OpenBLAS built on its own pthreads pool
(numpy's wheels) keeps one process-wide count: ``openblas_set_num_threads``
from any thread sets what every thread's next GEMM uses (seen with the
bundled 0.3.31: set to 1 from a worker thread, the main thread reads 1), and
so does ``openblas_set_num_threads_local`` in that build. threadpoolctl 3.8
(not 3.6, which calls the BLAS directly) guards that shared count by letting
only its first caller, the "controlling thread", change it:
``set_num_threads`` from any other thread silently does nothing for as long
as the first one lives. The main thread never dies, so through that setter,
once it has used the package, a call from any other thread would run its
GEMMs on every OpenBLAS thread (``threadpool_info()`` reads 2 inside the
limit, and ``dk``, ``dv`` of ``(2, 4, 300, 32)`` queries against
``(2, 2, 1100, 32)`` keys, GQA and causal, take other last bits), and a last
holder out on another thread could not give the count back. So the count is
set through threadpoolctl's
unguarded setter (``_real_set_num_threads`` where it has one,
``set_num_threads`` otherwise). That is safe because the setting is
reference-counted under this module's lock: the first caller in, on any
thread, sets it; the last one out, on any thread, restores what was there;
concurrent calls never undo each other's limit, and the pool's threads run
under it. Where the count is per thread instead (OpenBLAS built on OpenMP,
whose ``omp_set_num_threads`` is per calling thread), each thread that
enters holds its own: the calling thread for the call, and each pool thread
for each piece it runs (:func:`run_all` enters :func:`single_threaded_blas`
there). Without threadpoolctl, or with a BLAS it cannot control, nothing is
limited and :func:`single_threaded_blas` says so by returning False; results
may then depend on the BLAS's thread count.

**Threads.** The number of CPUs this process may run on by default;
``SDPA_REF_NUM_THREADS`` overrides it (read on every call; 1 disables the
pool; the pool's size is fixed when it is first made).

**Fork.** A forked child has none of the parent's threads: it gets a fresh
pool and fresh locks (``os.register_at_fork``), and its BLAS back (the count
from before the parent's calls in flight); a holder the forking thread was
inside leaves without touching the child's state.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional

import numpy as np

__all__ = ["num_threads", "ordered", "pool", "row_chunks", "run_all", "single_threaded_blas"]

_POOL: Optional[ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()
#: Below this many entries an element-wise pass runs inline (threads cost more than they save).
MIN_PARALLEL = 1 << 22


def num_threads() -> int:
    """``SDPA_REF_NUM_THREADS`` if set, else the CPUs this process may run on."""
    env = os.environ.get("SDPA_REF_NUM_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def pool(n: int) -> ThreadPoolExecutor:
    """The package's thread pool (made with ``n`` workers on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="sdpa_ref")
        return _POOL


class _Worker(threading.local):
    """Whether this thread is running a pool item (a pool item that waited on items of its own could wait on
    itself once every worker does the same: those run inline)."""
    inside = False


_WORKER = _Worker()


def _held(fn):
    """``fn`` as a pool item: inside :func:`single_threaded_blas` (where the BLAS's count is per thread, this is
    what holds that thread's GEMMs to one thread), the thread marked as a worker."""
    def item(it):
        _WORKER.inside = True
        try:
            with single_threaded_blas():
                return fn(it)
        finally:
            _WORKER.inside = False
    return item


def run_all(fn, items):
    """``fn(item)`` for every item in the pool; wait for all, then raise the first error. Called from a pool item,
    the items run inline, one after the other."""
    if _WORKER.inside:
        for it in items:
            fn(it)
        return
    held = _held(fn)
    futs = [pool(num_threads()).submit(held, it) for it in items]
    wait(futs)
    for f in futs:
        f.result()


def ordered(fn, items, ahead=None):
    """``fn(item)`` for every item in the pool, yielding the results in the items' order; at most ``ahead``
    (default: the threads) items run or wait to be taken at once, so that what their results hold stays bounded.
    A caller that sums the results as they come sums them in one order, whatever the threads. On an error, the
    items already started finish, then it is raised."""
    if _WORKER.inside:
        for it in items:
            yield fn(it)
        return
    ahead = max(1, ahead or num_threads())
    held = _held(fn)
    p, futs = pool(num_threads()), deque()
    try:
        for it in items:
            futs.append(p.submit(held, it))
            if len(futs) >= ahead:
                yield futs.popleft().result()
        while futs:
            yield futs.popleft().result()
    finally:
        wait(futs)


def row_chunks(fn, *arrays):
    """Run ``fn(*chunks)`` over row chunks of 2-D arrays (same number of rows), in parallel.

    ``fn`` must treat rows independently, so that the cut cannot change a bit.
    """
    rows = arrays[0].shape[0]
    n = num_threads()
    if n == 1 or arrays[0].size < MIN_PARALLEL or rows < 2:
        fn(*arrays)
        return
    bounds = np.linspace(0, rows, min(n, rows) + 1).astype(int)
    run_all(lambda b: fn(*[a[b[0]:b[1]] for a in arrays]),
            [(b0, b1) for b0, b1 in zip(bounds[:-1], bounds[1:]) if b1 > b0])


_BLAS_LOCK = threading.Lock()
#: The controllers (found on first use), the holders inside, and ``(controller, count)`` the first one found.
_BLAS_STATE = {"controllers": None, "users": 0, "saved": None}
#: Forks so far in this process's line (a holder entered before a fork leaves the child's state alone).
_FORKS = [0]


class _ThreadHold(threading.local):
    """This thread's holders inside, and the counts the per-thread controllers had before the first."""
    depth = 0
    saved = None


_LOCAL = _ThreadHold()


def _per_thread(c):
    """Whether controller ``c``'s thread count is per calling thread (OpenBLAS built on OpenMP)."""
    return getattr(c, "internal_api", None) == "openblas" and getattr(c, "threading_layer", None) == "openmp"


def _set(c, n):
    """Set controller ``c``'s thread count from this thread, past threadpoolctl's controlling-thread guard."""
    getattr(c, "_real_set_num_threads", c.set_num_threads)(n)


class single_threaded_blas:
    """Hold the BLAS to one thread while at least one caller is inside (reference-counted, on any thread).

    ``__enter__`` returns True when the BLAS is held, False when there is no
    BLAS that threadpoolctl can control. A process-wide count is set by the
    first caller in and restored by the last one out, whichever threads
    those are; a per-thread count is held by each thread that enters.
    """

    def __enter__(self):
        with _BLAS_LOCK:
            st = _BLAS_STATE
            if st["controllers"] is None:
                st["controllers"] = _controllers()
            if not st["controllers"]:
                self.active = False
                return False
            if st["users"] == 0:
                st["saved"] = [(c, c.get_num_threads()) for c in st["controllers"] if not _per_thread(c)]
                for c, _ in st["saved"]:
                    _set(c, 1)
            st["users"] += 1
            self.active, self.fork = True, _FORKS[0]
        loc = _LOCAL
        if loc.depth == 0:
            own = [c for c in st["controllers"] if _per_thread(c)]
            loc.saved = [(c, c.get_num_threads()) for c in own]
            for c in own:
                _set(c, 1)
        loc.depth += 1
        return True

    def __exit__(self, *exc):
        if not self.active or self.fork != _FORKS[0]:     # not held, or held in the parent of this fork
            return False
        loc = _LOCAL
        loc.depth -= 1
        if loc.depth == 0:
            for c, n in loc.saved:
                _set(c, n)
            loc.saved = None
        with _BLAS_LOCK:
            st = _BLAS_STATE
            st["users"] -= 1
            if st["users"] == 0:
                for c, n in st["saved"]:
                    _set(c, n)
                st["saved"] = None
        return False


#: Multiply-adds below which a matrix product runs on one thread: waking the BLAS's threads costs more than they
#: save, and on a loaded machine their spinning slows everything else (the small layers of ``examples/nn.py``).
SMALL_WORK = 1 << 25


def threads_for(work):
    """:class:`single_threaded_blas` for a product of ``work`` multiply-adds below :data:`SMALL_WORK`, else a
    context that changes nothing."""
    return single_threaded_blas() if work < SMALL_WORK else contextlib.nullcontext()


def blas_is_held() -> bool:
    """Whether the BLAS is held to one thread right now (the engines run chunks in the pool only then)."""
    return _BLAS_STATE["users"] > 0


def _controllers():
    """threadpoolctl's controllers of the loaded BLAS libraries (an empty list when there are none)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return []
    return list(ThreadpoolController().select(user_api="blas").lib_controllers)


def _after_fork_in_child():
    global _POOL, _POOL_LOCK, _BLAS_LOCK
    _POOL = None
    _POOL_LOCK = threading.Lock()
    _BLAS_LOCK = threading.Lock()
    _FORKS[0] += 1
    saved = _BLAS_STATE["saved"]
    _BLAS_STATE.update(users=0, saved=None)
    own, _LOCAL.saved, _LOCAL.depth = _LOCAL.saved, None, 0   # the forking thread's own hold, if it had one
    try:      # forked while a parent thread held the BLAS: give the child its BLAS back
        for c, n in (saved or []) + (own or []):
            _set(c, n)
    except Exception:  # pragma: no cover - best effort in a fork handler
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
