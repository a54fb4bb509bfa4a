r"""What no result of a problem reads, found at build time in blocks of rows of its allowed set.

The problem's own copies hold 0 wherever no result reads them (:func:`find_unread`, from
:func:`sdpa_ref.masks.reads`: query rows with no allowed key, keys and values that no row of their kv head
allows, mask and bias entries outside the allowed set), so that no arithmetic of any engine ever sees what
memory holds there. :func:`fold` brings a bool array in the problem's full layout to an input's own shape.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from .masks import reads, slice_ls

__all__ = ["BLOCK_ENTRIES", "Unread", "excluded_counts", "find_unread", "fold"]


class Unread(NamedTuple):
    """Where no result reads an input (True), in each array's own shape (a trailing 1 for a row), or None."""

    q: Optional[np.ndarray]         # (..., Hkv, G, L, 1) query rows
    k: Optional[np.ndarray]         # (..., Hkv, S, 1)
    v: Optional[np.ndarray]         # (..., Hkv, S, 1)
    mask: Optional[np.ndarray]      # the float mask's shape
    bias: Optional[np.ndarray]      # the bias's shape


#: Score entries per block of rows when the unread positions are found: no whole L x S allowed set is made.
BLOCK_ENTRIES = 1 << 20


def fold(x, shape, how):
    """Bool ``x`` (broadcastable with the full problem's layout) brought to an array's own ``shape``: ``how``
    (``np.all`` or ``np.any``) over the dims that array broadcasts over (1 or missing in ``shape``)."""
    nd = max(x.ndim, len(shape))
    x = x.reshape((1,) * (nd - x.ndim) + x.shape)
    own = (1,) * (nd - len(shape)) + tuple(shape)
    axes = tuple(i for i in range(nd) if own[i] == 1 and x.shape[i] != 1)
    if axes:
        x = how(x, axis=axes, keepdims=True)
    return np.broadcast_to(x.reshape(x.shape[nd - len(shape):]), tuple(shape))


def find_unread(full, G, allowed, keep, shapes):
    """The :class:`Unread` record: where no allowed score reads each input (:func:`masks.reads`), in the input's own
    ``shapes`` (an input broadcast over a batch or head dim is read if any entry there reads it). ``allowed(rows)``
    is the problem's allowed set of a block of rows, or None."""
    nd, L, S = len(full), full[-2], full[-1]
    step = max(1, BLOCK_ENTRIES // max(1, int(np.prod(full[:-2] + (S,)))))
    rows, keys, values, cells = [], None, None, {}
    for i0 in range(0, L, step):
        i1 = min(L, i0 + step)
        a = allowed((i0, i1))
        r, kr, vr = reads(a, nd, G, None if keep is None else slice_ls(keep, i0, i1, 0, None))
        if vr is None:                                     # nothing is excluded: the same for every block
            return Unread(None, None, None, None, None)
        if r is not None:
            rows.append(np.broadcast_to(r, r.shape[:-1] + (i1 - i0,)))
            keys = kr if keys is None else (keys | kr)
        values = vr if values is None else (values | vr)
        for n in ("mask", "bias"):
            if a is not None and shapes[n] is not None:    # an entry outside the allowed set of every row
                own = (1,) * (nd - len(shapes[n])) + tuple(shapes[n])
                vary = own[-2] != 1
                blk = fold(~a, own[:-2] + (i1 - i0 if vary else 1, own[-1]), np.all)
                cells[n] = blk if n not in cells else (np.concatenate([cells[n], blk], axis=-2) if vary
                                                        else cells[n] & blk)
    rows = np.concatenate(rows, axis=-1) if rows else None
    return Unread(q=_col(_unread_in(rows, shapes["q"])), k=_col(_unread_in(keys, shapes["k"])),
                  v=_col(_unread_in(values, shapes["v"])),
                  **{n: None if n not in cells or not cells[n].any() else cells[n].reshape(shapes[n])
                     for n in ("mask", "bias")})


def _col(x):
    return None if x is None else x[..., None]


def _unread_in(read, shape):
    """Where ``read`` (True = read, in the full layout) is False for every entry of the problem that reads an
    array of ``shape`` at that place; None when nowhere."""
    if read is None:
        return None
    x = fold(~read, shape, np.all)
    return x if x.any() else None


def excluded_counts(full, allowed):
    """``(*batch, Hq, L, 1)`` int64: how many keys the structural rules exclude from each row (``S`` minus its
    allowed keys), what a row with no allowed key averages under ``fully_masked="jax"``. ``allowed(rows)`` as in
    :func:`find_unread`."""
    L, S = full[-2], full[-1]
    out = np.zeros(full[:-1] + (1,), np.int64)
    step = max(1, BLOCK_ENTRIES // max(1, int(np.prod(full[:-2] + (S,)))))
    for i0 in range(0, L, step):
        i1 = min(L, i0 + step)
        a = allowed((i0, i1))
        if a is not None:
            out[..., i0:i1, :] = S - np.sum(np.broadcast_to(a, a.shape[:-1] + (S,)), axis=-1, keepdims=True)
    return out
