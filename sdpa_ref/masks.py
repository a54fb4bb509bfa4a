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

__all__ = [
    "ALIGNMENTS",
    "causal_mask",
    "window_mask",
    "padding_mask",
    "alibi_bias",
    "alibi_slopes",
    "alignment_offset",
]

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


def padding_mask(q_lengths, kv_lengths, L, S):
    """Bool ``(..., 1, L, S)`` mask of the valid (query, key) pairs per batch.

    Keeps ``i < q_len`` and ``j < kv_len``. The head axis of length 1 lets it
    broadcast against ``(..., Hq, L, S)``. Note that passing this as
    ``attn_mask`` makes padded query rows *fully masked* (they follow
    ``fully_masked``), whereas ``q_lengths=`` zeroes them under every policy;
    the two agree under the default ``"zero"``.

    Parameters
    ----------
    q_lengths, kv_lengths : array_like of int, (...)
        Per-batch lengths; ``None`` means ``L`` (resp. ``S``) everywhere.
    L, S : int

    Examples
    --------
    >>> padding_mask([1, 2], [2, 3], 2, 3)[1, 0].astype(int).tolist()
    [[1, 1, 1], [1, 1, 1]]
    >>> padding_mask([1, 2], [2, 3], 2, 3)[0, 0].astype(int).tolist()
    [[1, 1, 0], [0, 0, 0]]
    """
    L = _check_size(L, "L")
    S = _check_size(S, "S")
    from ._problem import _check_lengths     # the one length validator

    ql = np.asarray(L if q_lengths is None else q_lengths)
    kl = np.asarray(S if kv_lengths is None else kv_lengths)
    try:
        batch = np.broadcast_shapes(ql.shape, kl.shape)
    except ValueError:
        raise ValueError(f"`q_lengths` and `kv_lengths` should broadcast together, but got shapes "
                         f"{ql.shape} and {kl.shape}") from None
    ql = np.broadcast_to(_check_lengths(ql, "q_lengths", L, batch), batch)[..., None, None, None]
    kl = np.broadcast_to(_check_lengths(kl, "kv_lengths", S, batch), batch)[..., None, None, None]
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    return (i < ql) & (j < kl)


def alibi_bias(slopes, L, S, alignment="top_left"):
    """Float ALiBi bias ``-slope * |i + off - j|`` of shape ``(..., Hq, L, S)``.

    ``slopes`` is ``(Hq,)`` or ``(..., Hq)``. This is what ``alibi_slopes=``
    adds to the scores; passing it as ``bias=`` gives the same attention.

    Examples
    --------
    >>> alibi_bias([0.5], 2, 3)[0].tolist()
    [[-0.0, -0.5, -1.0], [-0.5, -0.0, -0.5]]
    """
    L = _check_size(L, "L")
    S = _check_size(S, "S")
    s = np.asarray(slopes, dtype=np.float64)
    if s.ndim < 1:
        raise ValueError(f"`slopes` should have shape (Hq,) or (..., Hq), but got shape {s.shape}")
    off = int(alignment_offset(L, S, alignment))
    dist = np.abs(np.arange(L)[:, None] + off - np.arange(S)[None, :])
    return -s[..., None, None] * dist


def alibi_slopes(n_heads):
    """The standard ALiBi slopes of Press et al. (2022) for ``n_heads`` heads.

    For a power of two ``n``, the geometric sequence ``2^(-8/n * (h + 1))``,
    ``h = 0 .. n-1``. Otherwise the slopes of the largest power of two
    ``m < n``, followed by every other slope of ``2m`` heads, as in the
    paper's reference code.

    Examples
    --------
    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    n = _check_size(n_heads, "n_heads")
    if n == 0:
        return np.zeros(0)

    def pow2(m):
        start = 2.0 ** (-8.0 / m)
        return [start ** (h + 1) for h in range(m)]

    m = 1 << (n.bit_length() - 1)
    if m == n:
        return np.array(pow2(n))
    return np.array(pow2(m) + pow2(2 * m)[0::2][: n - m])


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
