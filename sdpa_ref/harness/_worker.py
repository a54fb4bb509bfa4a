"""The implementation's side of isolated judging (:mod:`.isolate`): load the functions, call them, send arrays.

This file runs in a fresh interpreter (``python -I``) that :mod:`.isolate`
starts and loads it into by its path, so it imports nothing of sdpa_ref,
and nothing but the standard library until it has set the parent's
``sys.path``. What the parent sends is pickled (the child trusts the
parent); what goes back is JSON and raw array bytes, never a pickle, since
the parent trusts nothing from the child.

A frame is an 8-byte little-endian length and that many bytes. The parent
sends the setup (``sys.path`` and the functions, each a ``"module:attr"``
spec or a pickle) and then one request per call, ``(which, args,
kwargs, guard_spec)``; the child answers each with a JSON header and then one frame per
array. Inputs the parent guarded (:mod:`.guards`; a pickle keeps only their
values) are guarded again here, by that module loaded from its path, and a
call that wrote into their guards is answered as such (``"kind": "guard"``). Only the process the parent started answers: a forked copy that
returns from the implementation ends silently, so the parent sees the
process it called and nothing else.
"""

import json
import os
import pickle
import struct
import sys

LENGTH = struct.Struct("<Q")
#: The dtypes without a NumPy code, sent by name (``ml_dtypes``'); every other dtype goes by its ``dtype.str``.
LOW_NAMES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz")


def load_spec(spec):
    """``package.module:attr.sub`` -> the object (imported with the ``sys.path`` in force), which must be callable."""
    import importlib

    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"`{spec}` should be MODULE:FUNCTION")
    mod, _, attr = spec.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"`{spec}` is not callable")
    return obj


def describe(fn):
    """What the parent needs to know of ``fn`` without holding it: its ``supports`` and ``requires`` attributes
    (a list of names, None, or ``{"invalid": type name}``) and its keyword parameters (None: ``**kwargs`` or no
    signature)."""
    import inspect

    info = {}
    for name in ("supports", "requires"):
        val = getattr(fn, name, None)
        if val is None:
            info[name] = None
        elif isinstance(val, str):
            info[name] = [val]
        else:
            try:
                items = list(val)
            except TypeError:
                items = None
            ok = items is not None and all(isinstance(x, str) for x in items)
            info[name] = items if ok else {"invalid": type(val).__name__}
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = None
    if params is None or any(p.kind == p.VAR_KEYWORD for p in params):
        info["params"] = None
    else:
        info["params"] = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return info


def what(exc):
    """An exception as a report's note."""
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) raised by the implementation"
    return f"{type(exc).__name__}: {exc}"


def main(req_fd, rep_fd, parent_pid):
    """Serve the parent until it closes the request pipe."""
    _die_with(parent_pid)
    pid = os.getpid()
    setup = pickle.loads(_read_frame(req_fd))
    sys.path[:] = setup["path"]
    funcs, infos = {}, {}
    for name, (how, spec) in setup["functions"].items():
        try:
            fn = load_spec(spec) if how == "spec" else pickle.loads(spec)
            if not callable(fn):
                raise TypeError(f"`{name}` is not callable")
            funcs[name], infos[name] = fn, describe(fn)
        except BaseException as exc:       # whatever the module does on import is its error
            _reply(rep_fd, {"pid": pid, "ok": False, "which": name, "error": what(exc)})
            while _read_frame(req_fd) is not None:   # stay until the parent closes the pipe: it takes a child
                pass                                 # that has ended as one that died, reply or not
            return
    _reply(rep_fd, {"pid": pid, "ok": True, "functions": infos})
    guards = None
    while True:
        data = _read_frame(req_fd)
        if data is None:
            return
        which, args, kwargs, spec = pickle.loads(data)
        arrays, given = [], []
        try:
            if spec is not None:
                guards = guards or _load_by_path("_sdpa_ref_guards", setup["guards"])
                args, kwargs, given = _guarded(guards, which, args, kwargs, spec)
            res = funcs[which](*args, **kwargs)
            broken = [n for n, a in given if not guards.guard_intact(a)]
            if broken:
                header = {"ok": False, "kind": "guard", "names": broken,
                          "error": "wrote into the guard regions of " + ", ".join(broken)}
            else:
                arrays = _as_arrays(res, which)
                header = {"ok": True}
        except BaseException as exc:       # SystemExit and KeyboardInterrupt too: the implementation's own
            kind = "skip" if isinstance(exc, NotImplementedError) else "error"
            header = {"ok": False, "kind": kind, "message": str(exc), "error": what(exc)}
        if os.getpid() != pid:             # a forked copy returning: it is not the process called
            os._exit(0)
        header.update(pid=pid, arrays=[_describe_array(a) for a in arrays])
        _reply(rep_fd, header, arrays)


def _load_by_path(name, path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _guarded(guards, which, args, kwargs, spec):
    """``(args, kwargs, [(name, guarded array), ...])``: the arguments ``spec`` names as guarded copies."""
    names = ("grad_out", "query", "key", "value") if which == "backward" else ("query", "key", "value")
    given, out = [], []
    for i, (x, fill) in enumerate(zip(args, spec["args"])):
        name = names[i] if i < len(names) else f"argument {i}"
        if isinstance(x, tuple) and isinstance(fill, list):
            parts = [x[j] if f is None else guards.guarded(x[j], f) for j, f in enumerate(fill)]
            given += [(f"{name}[{j}]", p) for j, (p, f) in enumerate(zip(parts, fill)) if f is not None]
            out.append(tuple(parts))
        elif fill is not None:
            out.append(guards.guarded(x, fill))
            given.append((name, out[-1]))
        else:
            out.append(x)
    out += list(args[len(spec["args"]):])
    kwargs = dict(kwargs)
    for n, fill in spec["kwargs"].items():
        kwargs[n] = guards.guarded(kwargs[n], fill)
        given.append((n, kwargs[n]))
    return tuple(out), kwargs, given


def _as_arrays(res, which):
    import numpy as np

    items = list(res) if which == "backward" or (which == "forward" and isinstance(res, tuple)) else [res]
    out = []
    for x in items:
        try:
            a = np.asarray(x)
        except Exception as exc:
            raise TypeError(f"could not read the result: {exc}") from None
        if a.dtype.kind not in "biufc" and a.dtype.name not in LOW_NAMES:
            raise TypeError(f"returned {type(x).__name__} of dtype {a.dtype}, not an array of numbers")
        out.append(np.ascontiguousarray(a))
    return out


def _describe_array(a):
    return {"dtype": a.dtype.name if a.dtype.name in LOW_NAMES else a.dtype.str, "shape": list(a.shape)}


def _reply(fd, header, arrays=()):
    _write_frame(fd, json.dumps(header).encode())
    for a in arrays:
        _write_frame(fd, a.tobytes())


def _write_frame(fd, data):
    view = memoryview(LENGTH.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_frame(fd):
    """The next frame's bytes, or None at the end of the stream."""
    head = _read_exact(fd, LENGTH.size)
    if head is None:
        return None
    body = _read_exact(fd, LENGTH.unpack(head)[0])
    if body is None:
        raise EOFError("the parent closed the pipe in the middle of a frame")
    return body


def _read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _die_with(parent_pid):
    """On Linux, be killed when the parent dies (a hung child must not outlive the run)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)            # PR_SET_PDEATHSIG, SIGKILL
        except Exception:  # pragma: no cover - best effort
            pass
    if os.getppid() != parent_pid:                             # the parent died before that
        os._exit(0)
