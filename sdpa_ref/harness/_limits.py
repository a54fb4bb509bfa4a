"""A time limit on a call into a user's implementation (``conform --timeout``).

:func:`call_with_deadline` runs ``fn`` and raises :class:`CaseTimeout` into it
when the deadline passes: by ``SIGALRM`` when called on the main thread of a
POSIX process (which also wakes a sleep or a blocking call that Python can
interrupt), else by an exception raised asynchronously in the calling thread
(``PyThreadState_SetAsyncExc``: Python code only, once it runs again). Native
code that never returns to Python cannot be interrupted either way; a call
that comes back after the deadline still raises :class:`CaseTimeout`.
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time

__all__ = ["CaseTimeout", "call_with_deadline"]


class CaseTimeout(BaseException):
    """Raised into an implementation that runs past ``timeout`` (a BaseException, so ``except Exception`` in the
    implementation does not swallow it)."""


def call_with_deadline(deadline, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, interrupted by :class:`CaseTimeout` at ``deadline`` (a ``time.monotonic()`` value;
    None: no limit)."""
    if deadline is None:
        return fn(*args, **kwargs)
    left = deadline - time.monotonic()
    if left <= 0:
        raise CaseTimeout()
    on_main = threading.current_thread() is threading.main_thread()
    if on_main and hasattr(signal, "setitimer"):
        def on_alarm(signum, frame):
            raise CaseTimeout()

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, left)
        try:
            result = fn(*args, **kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    else:                                                  # elsewhere: an exception raised in this thread
        ident, fired = threading.get_ident(), threading.Event()

        def ring():
            fired.set()
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(CaseTimeout))

        timer = threading.Timer(left, ring)
        timer.daemon = True
        timer.start()
        try:
            result = fn(*args, **kwargs)
        finally:
            timer.cancel()
            timer.join()
            if fired.is_set():                             # not delivered yet: take it back, raise it here
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)
                raise CaseTimeout()
    if time.monotonic() > deadline:                        # native code that came back late
        raise CaseTimeout()
    return result
