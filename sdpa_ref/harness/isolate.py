"""Isolated judging: the implementation runs in a child process; the parent holds the reference and the verdict.

``check_implementation(..., isolate=True)`` (the default of ``sdpa-ref
conform``) starts a fresh interpreter running :mod:`._worker`, in its own
session and process group, with the parent's ``sys.path`` (the current
directory last), stdin from ``/dev/null`` and stdout sent to stderr (the
report owns stdout). The parent sends the functions (``"module:function"``
specs, or pickles of importable callables) and then, per call, the inputs;
the child sends back only the arrays, as JSON and raw bytes, which the
parent reads with a size bound and never unpickles. The reference, the
honest ensemble and the comparison never leave the parent, so nothing the
implementation does to its own process (monkeypatching NumPy or the judge,
reading the stack, ``os._exit``) reaches them.

A call fails -- an ``"error"`` row, never a pass -- when the child ends
before answering (``os._exit``, a signal, a fork whose caller exits), when
the answer comes from another process than the one started, when the child
closes its pipe or answers nonsense, and when the deadline passes: then the
parent kills the whole process group with ``SIGKILL`` (which nothing can
catch or ignore) and reads no further. The next call gets a fresh child, so
the run goes on; one that cannot be restarted fails every later call at
once. Starting a child is not counted against a case's time.

What isolation does not defend against: a child that attacks the parent
through the operating system (signals, ``ptrace``, ``/proc``; it runs as the
same user), and processes it starts in a session of their own, which can
outlive the run (they cannot change the verdict).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import time

import numpy as np

from . import _worker, guards
from ._limits import CaseTimeout, ImplementationFailure

__all__ = ["DEFAULT_TIME_LIMIT", "LOAD_TIME_LIMIT", "Isolated", "LoadError", "Remote"]

#: Seconds a case may take in isolation when no ``timeout`` is given: a child that never answers cannot hang
#: the run, and no honest case of the built-in suites comes near it.
DEFAULT_TIME_LIMIT = 600.0
#: Seconds the child may take to start and import the implementation (at least the case's limit): imports of
#: torch or jax take tens of seconds on a cold, loaded machine.
LOAD_TIME_LIMIT = 120.0
_POLL = 0.05                                  # how often a waiting parent checks that the child still lives
_HEADER_MAX = 1 << 20
_SLACK = 64 << 20                             # an answer may hold 16x the request's bytes plus this
_DTYPE = re.compile(r"^[<>|=]?[biufc][0-9]{1,2}$")
_BOOT = ("import sys, importlib.util as u; s = u.spec_from_file_location('_sdpa_ref_worker', sys.argv[1]); "
         "m = u.module_from_spec(s); s.loader.exec_module(m); m.main(*map(int, sys.argv[2:]))")


class LoadError(ImportError):
    """The child could not load the implementation (``which``: ``"forward"``, ``"backward"``, ``"jvp"``, or None
    when it did not say which)."""

    def __init__(self, which, what):
        super().__init__(f"the implementation's process could not load "
                         f"{'the implementation' if which is None else '`' + which + '`'}: {what}")
        self.which, self.what = which, what


class Remote:
    """One of the implementation's functions, seen from the parent: calling it asks the child.

    ``supports`` and ``requires`` are the function's attributes and ``params`` its keyword parameters (None:
    ``**kwargs`` or no signature), as the child reported them (data, checked by the caller)."""

    def __init__(self, worker, which, info):
        self._worker, self._which = worker, which
        self.supports, self.requires, self.params = info.get("supports"), info.get("requires"), info.get("params")

    def __call__(self, *args, **kwargs):
        return self._worker.call(self._which, args, kwargs)


class Isolated:
    """The child process that runs the implementation; a context manager that kills it on exit.

    ``functions`` maps ``"forward"``, ``"backward"``, ``"jvp"`` to a ``"module:function"`` spec, a picklable
    callable, or None. :meth:`start` loads them in a child and returns their :class:`Remote` stand-ins;
    :meth:`run` is the ``limit`` of :class:`~.judge.Implementation`.
    """

    def __init__(self, functions, time_limit=DEFAULT_TIME_LIMIT):
        self._functions = {n: _transportable(n, f) for n, f in functions.items() if f is not None}
        self.time_limit = float(time_limit)
        self._load_limit = max(LOAD_TIME_LIMIT, self.time_limit)
        self._path = [os.path.abspath(p) if p == "" else p for p in sys.path]
        if os.getcwd() not in self._path:
            self._path.append(os.getcwd())
        self._proc = self._req = self._rep = None
        self._deadline = None
        self._broken = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        """Start the child and load the functions: ``{name: Remote}``; :class:`LoadError` if they do not load."""
        infos = self._spawn()
        return {n: Remote(self, n, infos[n]) for n in self._functions}

    def run(self, deadline, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` whose calls to the child end at ``deadline`` (None: :attr:`time_limit` from
        now); a child restarted first does not use up the time."""
        t0 = time.monotonic()
        if self._proc is None:
            self._restart()
        started = time.monotonic() - t0
        self._deadline = (t0 + self.time_limit if deadline is None else deadline) + started
        try:
            return fn(*args, **kwargs)
        finally:
            self._deadline = None

    def call(self, which, args, kwargs):
        """One call of ``which`` in the child: its result (an array; for ``"backward"`` a list of them; a forward
        that returns a tuple, ``(out, lse)``, a tuple)."""
        if self._proc is None:
            self._restart()
        deadline = self._deadline if self._deadline is not None else time.monotonic() + self.time_limit
        request = pickle.dumps((which, args, kwargs, _guard_spec(args, kwargs)), protocol=4)
        given = [a for x in list(args) + list(kwargs.values()) for a in (x if isinstance(x, tuple) else (x,))]
        budget = _SLACK + 16 * sum(a.nbytes for a in given if isinstance(a, np.ndarray))
        try:
            self._send(request, deadline)
            header, arrays = self._answer(deadline, budget)
        except CaseTimeout:
            self._kill()
            raise CaseTimeout("its process was killed, with its process group") from None
        except ImplementationFailure:
            self._kill()
            raise
        if not header["ok"]:
            if header.get("kind") == "skip":
                raise NotImplementedError(str(header.get("message", "")))
            if header.get("kind") == "guard" and isinstance(header.get("names"), list):
                raise guards.GuardBroken([str(n)[:100] for n in header["names"][:32]])
            raise ImplementationFailure(str(header.get("error", "failed")))
        if which == "forward" and len(arrays) == 2:    # (out, lse)
            return tuple(arrays)
        if which != "backward":
            if len(arrays) != 1:
                self._kill()
                raise ImplementationFailure(f"the implementation's process sent {len(arrays)} arrays for one")
            return arrays[0]
        return arrays

    def close(self):
        """End the child and whatever is left of its process group."""
        if self._req is not None:
            try:
                os.close(self._req)                   # the child reads the end of its requests and returns
            except OSError:
                pass
            self._req = None
            try:
                self._proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    # ------------------------------------------------------------------ the child

    def _spawn(self):
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, _worker.__file__, str(req_r), str(rep_w),
                                     str(os.getpid())], stdin=subprocess.DEVNULL, stdout=2,
                                    pass_fds=(req_r, rep_w), start_new_session=True, close_fds=True)
        except BaseException:
            for fd in (req_r, req_w, rep_r, rep_w):
                os.close(fd)
            raise
        os.close(req_r)
        os.close(rep_w)
        os.set_blocking(req_w, False)
        self._proc, self._req, self._rep = proc, req_w, rep_r
        deadline = time.monotonic() + self._load_limit
        try:
            self._send(pickle.dumps({"path": self._path, "functions": self._functions, "guards": guards.__file__},
                                    protocol=4), deadline)
            hello, _ = self._answer(deadline, 0)
        except CaseTimeout:
            self._kill()
            raise LoadError(None, f"did not finish loading within {self._load_limit:g} s") from None
        except ImplementationFailure as exc:
            self._kill()
            raise LoadError(None, str(exc)) from None
        if not hello["ok"]:
            self._kill()
            which = hello.get("which")
            raise LoadError(which if which in self._functions else None, str(hello.get("error", "")))
        infos = hello.get("functions")
        if not isinstance(infos, dict) or set(infos) != set(self._functions):
            self._kill()
            raise LoadError(None, "its process described other functions than it was given")
        return infos

    def _restart(self):
        if self._broken is not None:
            raise ImplementationFailure(self._broken)
        try:
            self._spawn()
        except LoadError as exc:
            self._broken = f"could not restart the implementation's process after a failure: {exc.what}"
            raise ImplementationFailure(self._broken) from None

    def _kill(self):
        proc, self._proc = self._proc, None
        for fd in (self._req, self._rep):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._req = self._rep = None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)    # the group: what it forked goes too
        except (ProcessLookupError, PermissionError):
            pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    # ------------------------------------------------------------------ the pipe

    def _send(self, data, deadline):
        view = memoryview(_worker.LENGTH.pack(len(data)) + data)
        while view:
            self._wait(deadline, write=True)
            try:
                view = view[os.write(self._req, view):]
            except BlockingIOError:
                continue
            except OSError as exc:                # EPIPE: it closed its end, or ended
                raise ImplementationFailure(self._gone(f"stopped reading its requests ({exc.strerror})")) from None

    def _answer(self, deadline, budget):
        """``(header, arrays)`` of the child's next answer, checked: the pid it was started with, well-formed
        arrays of a numeric dtype within ``budget`` bytes in all."""
        raw = self._frame(deadline, _HEADER_MAX)
        try:
            header = json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ImplementationFailure(f"the implementation's process sent a malformed answer ({exc})") from None
        if not isinstance(header, dict) or not isinstance(header.get("ok"), bool):
            raise ImplementationFailure("the implementation's process sent a malformed answer (no status)")
        if header.get("pid") != self._proc.pid:
            raise ImplementationFailure("the answer came from another process than the one called (the "
                                        "implementation forked): only the process called may answer")
        arrays = []
        for desc in header.get("arrays", []) if header["ok"] else []:
            dt, shape = _dtype_of(desc), desc.get("shape") if isinstance(desc, dict) else None
            if dt is None or not isinstance(shape, list) or len(shape) > 32 \
                    or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise ImplementationFailure(f"the implementation's process sent a malformed array ({desc!r:.200})")
            nbytes = int(np.prod(shape, dtype=object)) * dt.itemsize
            if nbytes > budget:
                raise ImplementationFailure(f"the implementation's process sent an array of {nbytes} bytes, over "
                                            f"the {budget} this call allows")
            budget -= nbytes
            data = self._frame(deadline, nbytes)
            if len(data) != nbytes:
                raise ImplementationFailure("the implementation's process sent an array of the wrong size")
            arrays.append(np.frombuffer(bytearray(data), dtype=dt).reshape(shape))
        return header, arrays

    def _frame(self, deadline, most):
        n = _worker.LENGTH.unpack(self._read(_worker.LENGTH.size, deadline))[0]
        if n > most:
            raise ImplementationFailure(f"the implementation's process sent a frame of {n} bytes, over the {most} "
                                        "expected")
        return self._read(n, deadline)

    def _read(self, n, deadline):
        buf = bytearray()
        while len(buf) < n:
            self._wait(deadline)
            chunk = os.read(self._rep, min(n - len(buf), 1 << 20))
            if not chunk:
                raise ImplementationFailure(self._gone("closed its pipe to the harness"))
            buf += chunk
        return bytes(buf)

    def _wait(self, deadline, write=False):
        """Until the pipe is ready; :class:`CaseTimeout` at the deadline, :class:`ImplementationFailure` as soon
        as the child has ended (whatever a process it forked may still send)."""
        while True:
            if self._proc.poll() is not None:
                raise ImplementationFailure(self._gone("ended"))
            left = deadline - time.monotonic()
            if left <= 0:
                raise CaseTimeout()
            fds = [self._req] if write else [self._rep]
            ready = select.select([] if write else fds, fds if write else [], [], min(left, _POLL))
            if ready[0] or ready[1]:
                return

    def _gone(self, how):
        try:
            code = self._proc.wait(timeout=0.5)   # a pipe closed by a dying child: say how it died
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return f"the implementation's process {how} without answering"
        status = f"killed by {_signal_name(-code)}" if code < 0 else f"exit status {code}"
        return f"the implementation's process ended without answering ({status}: os._exit, a crash, or a fork " \
               "whose caller exited)"


def _guard_spec(args, kwargs):
    """Which arguments are guarded copies (:mod:`.guards`), which a pickle does not keep: ``{"args": [fill or
    None, or a list of them for a tuple], "kwargs": {name: fill}}`` for the child to guard its own copies, or
    None when none is."""
    spec = {"args": [[guards.guard_fill(a) for a in x] if isinstance(x, tuple) else guards.guard_fill(x)
                     for x in args],
            "kwargs": {n: f for n, f in ((n, guards.guard_fill(x)) for n, x in kwargs.items()) if f is not None}}
    flat = [f for x in spec["args"] for f in (x if isinstance(x, list) else [x])]
    return spec if spec["kwargs"] or any(f is not None for f in flat) else None


def _transportable(name, fn):
    """``("spec", "module:function")`` or ``("pickle", bytes)``; a TypeError for what the child cannot load."""
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"`{name}` should be 'module:function' or a callable, but got {fn!r}")
        return ("spec", fn)
    if not callable(fn):
        raise TypeError(f"`{name}` should be callable, but got {type(fn).__name__}")
    hint = ("with isolate=True, `{}` should be 'module:function' or a picklable callable (one defined at the top "
            "level of an importable module), but got {!r}: {}; or pass isolate=False")
    if getattr(fn, "__module__", None) == "__main__":
        raise TypeError(hint.format(name, fn, "a function of __main__ cannot be imported by another process"))
    try:
        return ("pickle", pickle.dumps(fn, protocol=4))
    except Exception as exc:
        raise TypeError(hint.format(name, fn, exc)) from None


def _dtype_of(desc):
    name = desc.get("dtype") if isinstance(desc, dict) else None
    if not isinstance(name, str):
        return None
    if name in _worker.LOW_NAMES:
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.dtype(getattr(ml_dtypes, name, None)) if hasattr(ml_dtypes, name) else None
    if not _DTYPE.match(name):
        return None
    try:
        dt = np.dtype(name)
    except TypeError:
        return None
    return dt if dt.kind in "biufc" else None


def _signal_name(n):
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"
