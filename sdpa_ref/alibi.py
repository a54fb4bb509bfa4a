"""The public ALiBi builders: the slopes of Press et al. and the bias they add (what ``alibi_slopes=`` adds to
the scores, as an array that can be passed as ``bias=`` to any implementation). The stage itself, its distance and
its place in the chain are :mod:`sdpa_ref.transforms`'s."""

from __future__ import annotations

import numpy as np

from .masks import ALIGNMENTS, _check_size
from .transforms import ALIBI_MODES, alibi_distance

__all__ = ["alibi_bias", "alibi_slopes"]


def alibi_bias(slopes, L, S, alignment="top_left", mode="flash"):
    """Float ALiBi bias of shape ``(..., Hq, L, S)``: ``-slope * |i + off - j|`` (``mode="flash"``,
    FlashAttention's), or cuDNN's signed ``slope * (j - i)`` (``mode="cudnn"``, no diagonal offset:
    ``alignment`` is not read).

    ``slopes`` is ``(Hq,)`` or ``(..., Hq)``. This is what ``alibi_slopes=``
    adds to the scores (with ``alibi_mode=mode``); passing it as ``bias=``
    gives the same attention.

    Examples
    --------
    >>> alibi_bias([0.5], 2, 3)[0].tolist()
    [[-0.0, -0.5, -1.0], [-0.5, -0.0, -0.5]]
    >>> alibi_bias([0.5], 2, 3, mode="cudnn")[0].tolist()
    [[-0.0, 0.5, 1.0], [-0.5, -0.0, 0.5]]
    """
    L, S = _check_size(L, "L"), _check_size(S, "S")
    if alignment not in ALIGNMENTS:
        raise ValueError(f"`alignment` should be one of {ALIGNMENTS!r}, but got {alignment!r}")
    if mode not in ALIBI_MODES:
        raise ValueError(f"`mode` should be one of {ALIBI_MODES!r}, but got {mode!r}")
    try:
        s = np.asarray(slopes)
    except ValueError:                                     # ragged
        s = np.asarray(slopes, dtype=object)
    if s.dtype.kind not in "iuf" or isinstance(slopes, np.ma.MaskedArray):
        raise TypeError(f"`slopes` should be real numbers (an int or float array), but got {slopes!r}")
    s = s.astype(np.float64)
    if not np.all(np.isfinite(s)):
        raise ValueError(f"`slopes` should be finite, but got {slopes!r}")
    if s.ndim < 1:
        raise ValueError(f"`slopes` should have shape (Hq,) or (..., Hq), but got shape {s.shape}")
    return -s[..., None, None] * alibi_distance(L, S, alignment, mode=mode)


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
