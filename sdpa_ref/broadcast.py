"""Arrays broadcastable to the scores ``(*batch, Hq, L, S)``: a block of one as a view (:func:`block_of`,
:func:`slice_ls`), and, in a gradient, undoing the broadcast (a term broadcast in the forward sums its gradient
over the broadcast axes: autograd's ``unbroadcast``), in NumPy or over an arithmetic."""

from __future__ import annotations

__all__ = ["block_of", "slice_ls", "unbroadcast"]


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


def block_of(a, nd, lead=None, rows=None, cols=None):
    """The block of ``a`` (broadcastable to an ``nd``-dim ``(*batch, Hq, L, S)`` array); a view.

    ``lead`` holds slices of the leading ``(*batch, Hq)`` axes (the fast
    engine's chunk of heads), ``rows`` / ``cols`` ``(start, stop)`` ranges of
    the last two (the tiled engine's block). Axes that ``a`` lacks or has as
    1 are left alone, so the result still broadcasts against the block.
    """
    if a is None:
        return None
    if rows is not None or cols is not None:
        a = slice_ls(a, *(rows or (0, None)), *(cols or (0, None)))
    if lead is not None:
        off = nd - a.ndim
        a = a[tuple(slice(None) if i - off < 0 or a.shape[i - off] == 1 else s
                    for i, s in enumerate(lead) if i - off >= 0)]
    return a


def slice_ls(a, i0, i1, j0, j1):
    """Rows ``i0:i1`` and columns ``j0:j1`` of an array broadcastable to (..., L, S); a view."""
    if a.ndim < 2:
        a = a.reshape((1,) * (2 - a.ndim) + a.shape)
    rows = slice(None) if a.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if a.shape[-1] == 1 else slice(j0, j1)
    return a[..., rows, cols]
