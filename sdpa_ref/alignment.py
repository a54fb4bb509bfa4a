"""The causal alignment: where the diagonal of a rectangular ``(L, S)`` score matrix lies.

Query ``i`` meets key ``i + off``: ``off = 0`` for ``"top_left"`` (PyTorch, JAX), ``S - L`` for
``"bottom_right"`` (FlashAttention, xformers), and per batch ``kv_len - q_len`` with lengths. The causal mask,
the windows and chunks of :mod:`sdpa_ref.masks` and ALiBi's distance ``|i + off - j|``
(:mod:`sdpa_ref.transforms`) are all measured from it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ALIGNMENTS", "alignment_offset", "diagonal_offset"]

#: Accepted values of ``causal_alignment``: where the diagonal of causal, the window and ALiBi sits.
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


def diagonal_offset(L, S, alignment, q_lengths=None, kv_lengths=None):
    """``off`` for the problem: 0, ``S - L``, or per batch ``kv_len - q_len`` of shape ``(*batch, 1, 1, 1)``."""
    if alignment == "top_left":
        return 0
    if q_lengths is None and kv_lengths is None:
        return int(alignment_offset(L, S, alignment))
    return _per_batch(alignment_offset(L if q_lengths is None else q_lengths,
                                       S if kv_lengths is None else kv_lengths, alignment))


def _per_batch(x):
    """A per-batch array ``(*batch)`` as ``(*batch, 1, 1, 1)``: against (head, row, column)."""
    x = np.asarray(x)
    return x.reshape(x.shape + (1, 1, 1))
