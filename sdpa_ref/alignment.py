"""The causal alignment: where the diagonal of a rectangular ``(L, S)`` score matrix lies.

Query ``i`` meets key ``i + off``: ``off = 0`` for ``"top_left"`` (PyTorch, JAX), ``S - L`` for
``"bottom_right"`` (FlashAttention, xformers), per batch ``kv_len - q_len`` with lengths, or a per-sequence
``q_offset[b]`` given outright (a chunk of a prefill whose queries start at position ``q_offset[b]`` of the
keys, as FlashInfer's and vLLM's kernels derive it from their cache lengths). The causal mask,
the windows and chunks of :mod:`sdpa_ref.masks` and ALiBi's distance ``|i + off - j|``
(:mod:`sdpa_ref.transforms`) are all measured from it.
"""

from __future__ import annotations

import numpy as np

from . import _validate as V

__all__ = ["ALIGNMENTS", "alignment_offset", "check_q_offset", "diagonal_offset"]

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


def diagonal_offset(L, S, alignment, q_lengths=None, kv_lengths=None, q_offset=None):
    """``off`` for the problem: 0, ``S - L``, per batch ``kv_len - q_len``, or ``q_offset`` (an int64 array
    broadcastable to the batch, which then replaces the alignment), per batch of shape ``(*batch, 1, 1, 1)``."""
    if q_offset is not None:
        return _per_batch(q_offset)
    if alignment == "top_left":
        return 0
    if q_lengths is None and kv_lengths is None:
        return int(alignment_offset(L, S, alignment))
    return _per_batch(alignment_offset(L if q_lengths is None else q_lengths,
                                       S if kv_lengths is None else kv_lengths, alignment))


def check_q_offset(q_offset, batch):
    """``q_offset`` (a per-sequence query offset, any int, broadcastable to ``batch``) as int64, or a
    `TypeError` / `ValueError` naming it. It replaces the alignment, so it goes with the default ``"top_left"``
    only (:meth:`sdpa_ref.options.AttentionOptions.from_kwargs` checks that)."""
    return V.int_array(q_offset, "q_offset", "per-sequence offsets", batch, where=f"the batch shape {tuple(batch)}",
                       noun="offsets", bounds=(-2**62, 2**62), range_text="[-2**62, 2**62]")


def _per_batch(x):
    """A per-batch array ``(*batch)`` as ``(*batch, 1, 1, 1)``: against (head, row, column)."""
    x = np.asarray(x)
    return x.reshape(x.shape + (1, 1, 1))
