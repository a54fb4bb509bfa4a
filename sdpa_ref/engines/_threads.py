"""The package's threads: one pool, the BLAS held to one thread, and fork safety.

**Why the BLAS is held to one thread.** OpenBLAS's threaded GEMM splits the
inner dimension differently from its single-threaded one (``K = 600`` is
``304 + 296`` on one thread and ``300 + 300`` on two, seen with the SkylakeX
kernels), so a product's last bits depend on how many threads the BLAS uses.
Every public call of the package therefore runs inside
:func:`single_threaded_blas`, and all its parallelism comes from this
module's pool, over pieces cut from the shape alone. The result is the same
bytes for any ``SDPA_REF_NUM_THREADS`` and any ``OPENBLAS_NUM_THREADS``.

The limit is process-wide (it is the BLAS's own setting). It is
reference-counted under a lock: the first caller in sets it, the last one out
restores what was there. Without threadpoolctl, or with a BLAS it cannot
control, nothing is limited and :func:`single_threaded_blas` says so by
returning False; results may then depend on the BLAS's thread count.

**Threads.** The number of CPUs this process may run on by default;
``SDPA_REF_NUM_THREADS`` overrides it (read on every call; 1 disables the
pool; the pool's size is fixed when it is first made).

**Fork.** A forked child has none of the parent's threads: it gets a fresh
pool and fresh locks (``os.register_at_fork``), and its BLAS back.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional

import numpy as np

__all__ = ["num_threads", "pool", "row_chunks", "run_all", "single_threaded_blas"]

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


def run_all(fn, items):
    """``fn(item)`` for every item in the pool; wait for all, then raise the first error."""
    futs = [pool(num_threads()).submit(fn, it) for it in items]
    wait(futs)
    for f in futs:
        f.result()


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
_BLAS_STATE = {"controllers": None, "users": 0, "saved": None}


class single_threaded_blas:
    """Hold the BLAS to one thread while at least one caller is inside (process-wide, reference-counted).

    ``__enter__`` returns True when the BLAS is held, False when there is no
    BLAS that threadpoolctl can control.
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
                st["saved"] = [c.get_num_threads() for c in st["controllers"]]
                for c in st["controllers"]:
                    c.set_num_threads(1)
            st["users"] += 1
            self.active = True
            return True

    def __exit__(self, *exc):
        if not self.active:
            return False
        with _BLAS_LOCK:
            st = _BLAS_STATE
            st["users"] -= 1
            if st["users"] == 0:
                for c, n in zip(st["controllers"], st["saved"]):
                    c.set_num_threads(n)
                st["saved"] = None
        return False


#: Multiply-adds below which a matrix product runs on one thread: waking the BLAS's threads costs more than they
#: save, and on a loaded machine their spinning slows everything else (``sdpa_ref.nn``'s small layers).
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
    saved = _BLAS_STATE["saved"]
    _BLAS_STATE.update(users=0, saved=None)
    if saved is not None:          # forked while a parent thread held the BLAS: give the child its BLAS back
        try:
            for c, n in zip(_BLAS_STATE["controllers"], saved):
                c.set_num_threads(n)
        except Exception:  # pragma: no cover - best effort in a fork handler
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
