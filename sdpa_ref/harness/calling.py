"""How the harness calls an implementation: :class:`Implementation`, the functions under test in the layout they
take (``"bhld"``, ``"blhd"``, a top-k ``"gathered"`` kernel, or a storage layout of :mod:`.storage`), each call
under the run's time limit, every result copied as it comes back."""

from __future__ import annotations

import numpy as np

from ..lse import check_base
from ._limits import call_in_process
from .storage import STORAGE_LAYOUTS, Storage

__all__ = ["Implementation"]


#: The layouts whose arrays are ``(..., L, H, E)``.
_BLHD = ("blhd", "gathered")


class Implementation:
    """The functions under test and how to call them: the layout, the optional checks asked for, and ``limit``,
    which makes each call under a deadline (:func:`~._limits.call_in_process`, or the child's
    :meth:`.isolate.Isolated.run`). A result is copied when it comes back: what the implementation does to its
    array afterwards cannot change what is judged."""

    def __init__(self, forward, backward=None, jvp=None, layout="bhld", deterministic=False, poison=False,
                 implied=frozenset(), limit=call_in_process, lse=None, lse_empty="-inf"):
        self.forward, self.backward, self.jvp = forward, backward, jvp
        self.lse = None if lse is None else check_base(lse, "lse")   # the forward returns (out, lse) in this base
        self.lse_empty = lse_empty
        self.layout, self.deterministic, self.poison = layout, deterministic, poison
        self.implied = frozenset(implied)        # required options it applies without a keyword: never passed
        self.limit = limit

    def _opts(self, inp):
        opts = _copy_opts({k: v for k, v in inp.items() if k not in self.implied})
        if "gather_kv_indices" in opts:                    # the kernels' (..., L, K), shared by the heads
            opts["gather_kv_indices"] = np.ascontiguousarray(opts["gather_kv_indices"][..., 0, :, :], np.int32)
        return opts

    def _in(self, a):
        """To the implementation's layout: ``(..., H, L, E)`` -> ``(..., L, H, E)`` for ``"blhd"``, ``"gathered"``."""
        return np.swapaxes(a, -3, -2).copy() if self.layout in _BLHD and a.ndim >= 3 else a.copy()

    def _out(self, a):
        a = np.array(a)
        return np.swapaxes(a, -3, -2) if self.layout in _BLHD and a.ndim >= 3 else a

    def call_forward(self, q, k, v, inp, fill=0.0):
        """The output, or ``(out, lse)`` with :attr:`lse` (the LSE ``(..., H, L)`` in either dense layout, as
        FlashAttention returns its ``softmax_lse``). In a storage layout (:mod:`.storage`) the positions no
        sequence uses hold ``fill``."""
        if self.layout in STORAGE_LAYOUTS:
            st = Storage(self.layout, q, k, v, inp, fill)
            res = self.forward(st.query(q), st.kv(k), st.kv(v), **st.kwargs(), **self._opts(st.options))
            if self.lse is not None and isinstance(res, (tuple, list)) and len(res) == 2:
                return st.from_out(res[0]), st.from_lse(res[1])
            return st.from_out(res)
        res = self.forward(self._in(q), self._in(k), self._in(v), **self._opts(inp))
        if self.lse is not None and isinstance(res, (tuple, list)) and len(res) == 2:
            return self._out(res[0]), np.array(res[1])
        return self._out(res)

    def call_backward(self, g, q, k, v, inp):
        if self.layout in STORAGE_LAYOUTS:
            st = Storage(self.layout, q, k, v, inp)
            res = list(self.backward(st.out(g), st.query(q), st.kv(k), st.kv(v), **st.kwargs(),
                                     **self._opts(st.options)))
            return list(st.from_grads(*res[:3])) + [np.array(x) for x in res[3:]]   # dbias, dsinks: as given
        res = list(self.backward(self._in(g), self._in(q), self._in(k), self._in(v), **self._opts(inp)))
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
