r"""Plain builders for the masks of ``SEMANTICS.md``.

Each returns a bool array (True = the key takes part) that can be handed to
any attention implementation, so that a kernel's own masks can be built from
the same definitions the reference uses.

Take query ``i`` and key ``j``. The alignment sets an offset: ``off = 0`` for
``"top_left"`` (PyTorch, JAX) and ``off = S - L`` for ``"bottom_right"``
(FlashAttention, xformers). Then causal keeps ``j <= i + off`` and
``window=(left, right)`` keeps ``i + off - left <= j <= i + off + right``;
``None`` or ``-1`` for a bound means unbounded on that side.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["ALIGNMENTS", "causal_mask", "window_mask", "alignment_offset"]

#: The accepted values of ``alignment`` / ``causal_alignment``.
ALIGNMENTS = ("top_left", "bottom_right")


def alignment_offset(L, S, alignment="top_left"):
    """The diagonal offset ``off``: 0 for top-left, ``S - L`` for bottom-right.

    ``L`` and ``S`` may be integer arrays (per-batch lengths), in which case
    the offset is an array of the broadcast shape.
    """
    if alignment not in ALIGNMENTS:
        raise ValueError(f"`alignment` should be one of {ALIGNMENTS!r}, but got {alignment!r}")
    if alignment == "top_left":
        return np.zeros(np.broadcast_shapes(np.shape(L), np.shape(S)), dtype=np.int64)[()]
    return np.asarray(S, dtype=np.int64) - np.asarray(L, dtype=np.int64)


def causal_mask(L, S, alignment="top_left"):
    """Bool ``(L, S)`` mask keeping ``j <= i + off``.

    Parameters
    ----------
    L, S : int
        Number of queries and keys.
    alignment : {"top_left", "bottom_right"}
        Where the diagonal sits when ``L != S``.

    Returns
    -------
    ndarray of bool, (L, S)

    Examples
    --------
    >>> causal_mask(2, 3).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0]]
    >>> causal_mask(2, 3, "bottom_right").astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    return window_mask(L, S, None, 0, alignment=alignment)


def window_mask(L, S, left, right, alignment="top_left"):
    """Bool ``(L, S)`` sliding-window mask, inclusive on both sides.

    Keeps ``i + off - left <= j <= i + off + right``. ``None`` or ``-1`` for
    ``left`` / ``right`` means unbounded on that side.

    Returns
    -------
    ndarray of bool, (L, S)
    """
    L = _check_size(L, "L")
    S = _check_size(S, "S")
    left = _check_bound(left, "left")
    right = _check_bound(right, "right")
    off = int(alignment_offset(L, S, alignment))
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    keep = np.ones((L, S), dtype=bool)
    if left is not None:
        keep &= j >= i + off - left
    if right is not None:
        keep &= j <= i + off + right
    return keep


def _check_size(n, name):
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (numbers.Integral, np.integer)) or n < 0:
        raise ValueError(f"`{name}` should be a non-negative int, but got {n!r}")
    return int(n)


def _check_bound(b, name):
    """``None`` or -1 -> unbounded (None); otherwise a non-negative int."""
    if b is None:
        return None
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, (numbers.Integral, np.integer)):
        raise TypeError(f"`{name}` should be a non-negative int, -1 or None, but got {b!r}")
    if b == -1:
        return None
    if b < 0:
        raise ValueError(f"`{name}` should be a non-negative int, -1 or None, but got {b!r}")
    return int(b)
