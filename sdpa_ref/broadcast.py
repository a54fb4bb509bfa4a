"""Undoing NumPy broadcasting in a gradient: a term broadcast in the forward sums its gradient over the
broadcast axes (autograd's ``unbroadcast``), in NumPy or over an arithmetic."""

from __future__ import annotations

__all__ = ["unbroadcast"]


def unbroadcast(g, shape, arith=None):
    """Sum ``g`` down to ``shape``, undoing NumPy broadcasting (autograd's ``unbroadcast``).

    ``arith``: an arithmetic of :mod:`sdpa_ref.exact.arith` (its values, dd pairs included); then each
    summed axis is its own fixed-order tree (``arith.sum``), one axis at a time, leading ones first, so
    the bits do not depend on NumPy's reduction order.
    """
    shape = tuple(shape)
    if arith is not None:
        while arith.value(g).ndim > len(shape):
            g = arith.sum(g, axis=0)
        for ax, n in enumerate(shape):
            if n == 1 and arith.value(g).shape[ax] != 1:
                g = arith.sum(g, axis=ax, keepdims=True)
        return arith.reshape(g, shape)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)
