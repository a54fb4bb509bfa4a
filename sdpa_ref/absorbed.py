r"""MLA's absorbed attention (DeepSeek, FlashMLA, FlashAttention 3's ``qv``): a second query against the values.

.. math:: T = s\,(Q K^T + Q_v V^T) = s\,[Q \mid Q_v]\,[K \mid V]^T,

so the problem is the attention of the query ``[q | qv]`` (width ``E + Ev``) against the keys ``[k | v]``, with
the same values ``v``; its default scale is ``1 / sqrt(E + Ev)``, FlashAttention's for ``qv``. :class:`Absorbed`
joins the arrays before the problem is built -- every engine, precision, the rules for non-finite inputs and the
JVP then apply unchanged -- and splits the gradients after:

.. math:: dQ = [dQ']_{:E}, \quad dQ_v = [dQ']_{E:}, \quad dK = [dK']_{:E}, \quad
          dV = P_{drop}^T dO + [dK']_{E:},

``V`` being read twice (as values and, through ``qv``, as keys), its gradient collects both uses. Under
``precision="reproducible"`` the engine splits in its own arithmetic (:meth:`Absorbed.split` over the
double-double one), so that sum, and a broadcast key's or value's over the batch, is exact before the one
rounding: ``dV`` is faithfully rounded however its two terms cancel.
"""

from __future__ import annotations

import numpy as np

from . import _validate as V
from .transforms import unbroadcast

__all__ = ["Absorbed"]


class Absorbed:
    """``query``, ``key``, ``value`` and ``qv`` joined: :attr:`q` ``(..., Hq, L, E + Ev)``, :attr:`k`
    ``(..., Hkv, S, E + Ev)``; and the maps back."""

    def __init__(self, query, key, value, qv):
        q, k, v = (V.as_float_array(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
        qv = V.as_float_array(qv, "qv")
        want = q.shape[:-1] + v.shape[-1:]
        if q.ndim < 2 or qv.shape != want:
            raise ValueError(f"`qv` should have the shape of `query` {q.shape} with the last dim Ev={v.shape[-1]} of "
                             f"`value`, {want}, but got shape {qv.shape}")
        if k.shape[-2:-1] != v.shape[-2:-1] or q.shape[-1:] != k.shape[-1:]:
            raise ValueError(f"`key` {k.shape} should have the width E of `query` {q.shape} and the S rows of "
                             f"`value` {v.shape}")
        try:
            lead = np.broadcast_shapes(k.shape[:-1], v.shape[:-1])
        except ValueError:
            raise ValueError(f"`key` {k.shape} and `value` {v.shape} should broadcast together with `qv`") from None
        self.E, self.shapes = q.shape[-1], {"query": q.shape, "key": k.shape, "value": v.shape, "qv": qv.shape}
        self.dtypes = {"query": q.dtype, "key": k.dtype, "value": v.dtype, "qv": qv.dtype}
        self.q = np.concatenate([q, qv], axis=-1)
        self.k = np.concatenate([np.broadcast_to(k, lead + k.shape[-1:]), np.broadcast_to(v, lead + v.shape[-1:])],
                                axis=-1)
        self.v = v

    def split(self, dq2, dk2, dv, arith=None):
        """``(dq, dqv, dk, dv)`` in the inputs' shapes from the joined problem's ``dq2``, ``dk2`` and the values'
        own ``dv``: the one definition of the split, in NumPy (``arith`` None: the compute dtype, the caller
        casts) or over an arithmetic of :mod:`sdpa_ref.exact.arith` whose values these are (double-double for
        ``precision="reproducible"``: a broadcast key's or value's sum and ``dV``'s two uses are then exact to
        about 100 bits, and the caller rounds each result once)."""
        E, X = self.E, arith

        def cols(x, s):                                   # the query's (or key's) own columns, or qv's (v's)
            return x[..., s] if X is None else X.at(x, (Ellipsis, s))

        head, tail = slice(None, E), slice(E, None)
        dq = unbroadcast(cols(dq2, head), self.shapes["query"], X)
        dqv = unbroadcast(cols(dq2, tail), self.shapes["qv"], X)
        dk = unbroadcast(cols(dk2, head), self.shapes["key"], X)
        dv, dv_keys = unbroadcast(dv, self.shapes["value"], X), unbroadcast(cols(dk2, tail), self.shapes["value"], X)
        return dq, dqv, dk, (dv + dv_keys if X is None else X.add(dv, dv_keys))        # v read twice

    def tangents(self, dq, dk, dv, dqv):
        """The joined problem's tangents ``(dq2, dk2, dv)`` from those of ``query``, ``key``, ``value``, ``qv``
        (None is zero)."""
        def full(t, name):
            return np.zeros(self.shapes[name]) if t is None else np.asarray(t, np.float64)
        dq2 = None if dq is None and dqv is None else np.concatenate([full(dq, "query"), full(dqv, "qv")], axis=-1)
        if dk is None and dv is None:
            return dq2, None, None
        tk, tv = full(dk, "key"), full(dv, "value")
        lead = self.k.shape[:-1]
        dk2 = np.concatenate([np.broadcast_to(tk, lead + tk.shape[-1:]), np.broadcast_to(tv, lead + tv.shape[-1:])],
                             axis=-1)
        return dq2, dk2, None if dv is None else tv
