"""A time limit on a call into a user's implementation (``conform --timeout``).

:func:`call_with_deadline` runs ``fn`` and raises :class:`CaseTimeout` into it
when the deadline passes: by ``SIGALRM`` when called on the main thread of a
POSIX process (which also wakes a sleep or a blocking call that Python can
interrupt), else by an exception raised asynchronously in the calling thread
(``PyThreadState_SetAsyncExc``: Python code only, once it runs again). Native
code that never returns to Python cannot be interrupted either way; a call
that comes back after the deadline still raises :class:`CaseTimeout`.
:func:`call_in_process` is that plus one check: a call that returns in
another process than it was made in (the implementation forked, and the
harness is running on in the copy) stops the copy at once, so that a
forked copy never reports anything.

Isolated judging (:mod:`.isolate`) needs none of this: the parent waits on
a pipe and kills the child's process group at the deadline.
:class:`ImplementationFailure` is how it says what went wrong with a call.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

__all__ = ["CaseTimeout", "ImplementationFailure", "call_in_process", "call_with_deadline"]

#: The exit status of a forked copy of the harness stopped by :func:`call_in_process` (``EX_SOFTWARE``).
FORKED_COPY_STATUS = 70


class CaseTimeout(BaseException):
    """Raised into an implementation that runs past ``timeout`` (a BaseException, so ``except Exception`` in the
    implementation does not swallow it)."""


class ImplementationFailure(Exception):
    """A call into the implementation that failed in a way only the harness saw (its process ended, forked,
    closed its pipe or answered nonsense); ``str()`` is the report's note."""


def call_in_process(deadline, fn, *args, **kwargs):
    """:func:`call_with_deadline`, and a call that returns in a forked copy of this process ends that copy."""
    pid = os.getpid()
    try:
        return call_with_deadline(deadline, fn, *args, **kwargs)
    finally:
        if os.getpid() != pid:
            os.write(2, b"sdpa_ref: the implementation forked and returned in the copy; the copy stops here "
                        b"(exit status 70) and reports nothing\n")
            os._exit(FORKED_COPY_STATUS)


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
