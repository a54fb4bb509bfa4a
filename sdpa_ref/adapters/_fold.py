"""The harness's ``(..., H, L, E)`` arrays folded to the ``(B, H, L, E)`` that ONNX and Keras take, and back."""

from __future__ import annotations

import numpy as np

from ..broadcast import unbroadcast

__all__ = ["Folded"]


class Folded:
    """``query``, ``key``, ``value`` with their leading batch dims broadcast and folded into one axis ``B``.

    A rank-2 ``(L, E)`` input gains a head axis of 1, which :meth:`unfold` drops again.

    Parameters
    ----------
    query : (..., Hq, L, E) or (L, E)
    key : (..., Hkv, S, E) or (S, E)
    value : (..., Hkv, S, Ev) or (S, Ev)
    """

    def __init__(self, query, key, value):
        self.rank2 = np.ndim(query) == 2
        query, key, value = (np.asarray(x)[None] if self.rank2 else np.asarray(x) for x in (query, key, value))
        self.batch = np.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
        self.n = int(np.prod(self.batch, dtype=np.int64))
        self.shapes = (query.shape, key.shape, value.shape)
        self.q, self.k, self.v = (self.fold(x) for x in (query, key, value))
        self.hq, self.L, self.S = query.shape[-3], query.shape[-2], key.shape[-2]
        self.out_shape = self.batch + (self.hq, self.L, value.shape[-1])

    def fold(self, x):
        """``(..., H, T, F)`` broadcast to the batch and folded: ``(B, H, T, F)``, a contiguous copy."""
        return np.array(np.broadcast_to(x, self.batch + x.shape[-3:]).reshape((self.n,) + x.shape[-3:]), order="C")

    def scores(self, m, dtype=None):
        """A mask or bias broadcasting to ``(..., Hq, L, S)`` as ``(B, Hq, L, S)``, in ``dtype`` if given."""
        m = np.broadcast_to(m, self.batch + (self.hq, self.L, self.S)).reshape((self.n, self.hq, self.L, self.S))
        return np.ascontiguousarray(m if dtype is None else m.astype(dtype))

    def unfold(self, y, i=None, shape=None):
        """A ``(B, H, T, F)`` result back to the caller's shape: the output (``i`` None), the gradient of input
        ``i`` (0, 1, 2: summed over the axes that input broadcast), or a bias gradient of ``shape``."""
        y = np.asarray(y)
        if shape is not None:
            return unbroadcast(y.reshape(self.batch + y.shape[1:]), tuple(shape))
        y = y.reshape(self.batch + y.shape[1:])
        if i is not None:
            y = unbroadcast(y, self.shapes[i])
        return y[0] if self.rank2 else y
