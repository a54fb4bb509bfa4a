"""How the harness calls an implementation: :class:`Implementation`, the functions under test in the layout they
take (``"bhld"``, ``"blhd"``, a top-k ``"gathered"`` kernel, or a storage layout of :mod:`.storage`), each call
under the run's time limit, every result copied as it comes back. With ``guard=`` a call's floating-point inputs
go as guarded copies (:mod:`.guards`), and one whose guard regions were written fails with :class:`GuardBroken`."""

from __future__ import annotations

import numpy as np

from ..lse import check_base
from ._limits import call_in_process
from .guards import GuardBroken, guard_fill, guard_intact, guarded, is_guardable
from .storage import STORAGE_LAYOUTS, Storage

__all__ = ["GuardBroken", "Implementation"]


#: The layouts whose arrays are ``(..., L, H, E)``.
_BLHD = ("blhd", "gathered")


class Implementation:
    """The functions under test and how to call them: the layout, the optional checks asked for, and ``limit``,
    which makes each call under a deadline (:func:`~._limits.call_in_process`, or the child's
    :meth:`.isolate.Isolated.run`). A result is copied when it comes back: what the implementation does to its
    array afterwards cannot change what is judged."""

    def __init__(self, forward, backward=None, jvp=None, layout="bhld", deterministic=False, poison=False,
                 implied=frozenset(), limit=call_in_process, lse=None, lse_empty="-inf", guards=False):
        self.forward, self.backward, self.jvp = forward, backward, jvp
        self.lse = None if lse is None else check_base(lse, "lse")   # the forward returns (out, lse) in this base
        self.lse_empty = lse_empty
        self.layout, self.deterministic, self.poison = layout, deterministic, poison
        self.guards = guards                     # also call on guarded copies of the inputs (.guards)
        self.implied = frozenset(implied)        # required options it applies without a keyword: never passed
        self.limit = limit

    def _opts(self, inp, guard=None):
        opts = _copy_opts({k: v for k, v in inp.items() if k not in self.implied})
        if "gather_kv_indices" in opts:                    # the kernels' (..., L, K), shared by the heads
            opts["gather_kv_indices"] = np.ascontiguousarray(opts["gather_kv_indices"][..., 0, :, :], np.int32)
        if "topk_length" in opts:                          # FlashMLA's counts, (..., L) as the indices
            opts["topk_length"] = np.ascontiguousarray(opts["topk_length"][..., 0, :], np.int32)
        return {k: _guard(v, guard) for k, v in opts.items()}

    def _in(self, a, guard=None):
        """To the implementation's layout: ``(..., H, L, E)`` -> ``(..., L, H, E)`` for ``"blhd"``, ``"gathered"``;
        a guarded copy with ``guard`` (a fill of :mod:`.guards`)."""
        a = np.swapaxes(a, -3, -2).copy() if self.layout in _BLHD and a.ndim >= 3 else a.copy()
        return _guard(a, guard)

    def _out(self, a):
        a = np.array(a)
        return np.swapaxes(a, -3, -2) if self.layout in _BLHD and a.ndim >= 3 else a

    def call_forward(self, q, k, v, inp, fill=0.0, guard=None):
        """The output, or ``(out, lse)`` with :attr:`lse` (the LSE ``(..., H, L)`` in either dense layout, as
        FlashAttention returns its ``softmax_lse``). In a storage layout (:mod:`.storage`) the positions no
        sequence uses hold ``fill``. With ``guard`` (``"nan"`` or ``"huge"``) the floating-point inputs are
        guarded copies, and :class:`GuardBroken` is raised if the call wrote into their guards."""
        if self.layout in STORAGE_LAYOUTS:
            st = Storage(self.layout, q, k, v, inp, fill)
            args = {"query": _guard(st.query(q), guard), "key": _guard(st.kv(k), guard),
                    "value": _guard(st.kv(v), guard)}
            opts = dict(st.kwargs(), **self._opts(st.options, guard))
            res = _checked(self.forward, args, opts)
            if self.lse is not None and isinstance(res, (tuple, list)) and len(res) == 2:
                return st.from_out(res[0]), st.from_lse(res[1])
            return st.from_out(res)
        args = {"query": self._in(q, guard), "key": self._in(k, guard), "value": self._in(v, guard)}
        res = _checked(self.forward, args, self._opts(inp, guard))
        if self.lse is not None and isinstance(res, (tuple, list)) and len(res) == 2:
            return self._out(res[0]), np.array(res[1])
        return self._out(res)

    def call_backward(self, g, q, k, v, inp, guard=None):
        """The gradients ``[dq, dk, dv, (dbias), (dsinks)]`` in the case's shapes; ``guard`` as in
        :meth:`call_forward`."""
        if self.layout in STORAGE_LAYOUTS:
            st = Storage(self.layout, q, k, v, inp)
            args = {"grad_out": _guard(st.out(g), guard), "query": _guard(st.query(q), guard),
                    "key": _guard(st.kv(k), guard), "value": _guard(st.kv(v), guard)}
            res = list(_checked(self.backward, args, dict(st.kwargs(), **self._opts(st.options, guard))))
            return list(st.from_grads(*res[:3])) + [np.array(x) for x in res[3:]]   # dbias, dsinks: as given
        args = {"grad_out": self._in(g, guard), "query": self._in(q, guard), "key": self._in(k, guard),
                "value": self._in(v, guard)}
        res = list(_checked(self.backward, args, self._opts(inp, guard)))
        return [self._out(x) if i < 3 else np.array(x) for i, x in enumerate(res)]  # dbias, dsinks: as given

    def call_jvp(self, ts, q, k, v, inp):
        if self.layout in STORAGE_LAYOUTS:
            st = Storage(self.layout, q, k, v, inp)
            tan = (st.query(ts[0]), st.kv(ts[1]), st.kv(ts[2]))
            return st.from_out(self.jvp((st.query(q), st.kv(k), st.kv(v)), tan, **st.kwargs(),
                                        **self._opts(st.options)))
        return self._out(self.jvp((self._in(q), self._in(k), self._in(v)), tuple(self._in(t) for t in ts),
                                  **self._opts(inp)))




def _copy_opts(inp):
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inp.items()}


def _guard(a, guard):
    """``a`` as a guarded copy when ``guard`` names a fill and ``a`` is a floating-point array, else ``a``."""
    if guard is None or not isinstance(a, np.ndarray) or not is_guardable(a.dtype):
        return a
    return guarded(a, guard)


def _checked(fn, args, opts):
    """``fn(*args.values(), **opts)``; :class:`GuardBroken` naming the guarded arrays whose guards it wrote."""
    res = fn(*args.values(), **opts)
    given = dict(args, **opts)
    broken = [n for n, a in given.items() if guard_fill(a) is not None and not guard_intact(a)]
    if broken:
        raise GuardBroken(broken)
    return res
