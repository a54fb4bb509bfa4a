r"""What the public API hands the user between passes: the residuals of :func:`sdpa_forward` and the
gradients of :func:`sdpa_backward` (the engines' own results are :mod:`sdpa_ref.engines.contract`'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from .engines.contract import Forward
from .lse import convert_lse
from .options import check_bool
from .reads import nan_where

__all__ = ["AttentionGrads", "AttentionResiduals"]


class AttentionGrads(NamedTuple):
    """Gradients of a loss with respect to the inputs of attention.

    Each has its input's own shape and dtype. ``attn_mask`` is the gradient
    with respect to a float mask, ``bias`` with respect to ``bias`` (each
    summed to its own shape), ``sinks`` with respect to ``sinks``; ``None`` where there is no such input.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attn_mask: Optional[np.ndarray]
    bias: Optional[np.ndarray] = None
    sinks: Optional[np.ndarray] = None


@dataclass(frozen=True)
class AttentionResiduals:
    """What :func:`sdpa_backward` needs, saved by :func:`sdpa_forward`.

    ``problem`` holds the validated inputs and options, ``forward`` what the
    engine ``method`` returned (:class:`~sdpa_ref.engines.contract.Forward`),
    ``block_size`` the tiled engine's block (None for the dense engines),
    ``taint`` where the forward's results read a non-finite input (the dense
    forward over the arithmetic of reads, :func:`sdpa_ref.poison.forward_taint`,
    whose ``out``, ``lse`` and ``lse_keys`` are bool; None when every input was finite):
    ``forward`` holds the clean computation, which the backward reads, and
    :attr:`out` and :attr:`lse` show the poisoned entries as NaN.
    """

    problem: Any                    # the validated Problem
    forward: Forward
    method: str
    block_size: Optional[int] = None
    taint: Any = None

    @property
    def probs(self):
        """``P`` ``(..., Hq, L, S)``, or None (``save_probs=False``, tiled)."""
        return self.forward.probs

    @property
    def out(self):
        """The output in the compute dtype, in the user's rank."""
        return nan_where(self.forward.out, None if self.taint is None else self.taint.out).reshape(
            self.problem.out_shape)

    @property
    def lse(self):
        """The log-sum-exp of the allowed scores ``(..., Hq, L)``; ``-inf`` on rows with no key."""
        return nan_where(self.forward.lse, None if self.taint is None else self.taint.lse).reshape(
            self.problem.out_shape[:-1])

    def lse_as(self, base="e", empty="-inf", *, sink=True):
        """:attr:`lse` in a kernel's convention: base ``"e"`` or ``2``, and what a row with no allowed key holds
        (``"-inf"``, ``"+inf"`` or a number); see :func:`sdpa_ref.convert_lse`.

        With ``sinks``, ``sink=True`` (FlashAttention 4, cuDNN, splash) gives the LSE whose normaliser includes
        the sink, :attr:`lse`; ``sink=False`` (FlashMLA) the LSE over the keys alone, which the engine kept
        before it folded the sink in (not recovered from :attr:`lse`, where it would cancel when the sink
        dominates): a row with no allowed key is then an empty row, held as ``empty`` says. Without sinks the
        two are the same."""
        sink = check_bool(sink, "sink")
        lse = self.lse
        if not sink and self.forward.lse_keys is not None:
            lse = nan_where(self.forward.lse_keys, None if self.taint is None else self.taint.lse_keys).reshape(
                self.problem.out_shape[:-1])
        return convert_lse(lse, base=base, empty=empty)

    @property
    def row_max(self):
        """cuDNN's ``score_max``: each row's largest allowed score ``m`` ``(..., Hq, L)``, after every score term
        (scale, softcap, mask, bias, ALiBi); ``-inf`` on rows with no allowed key. ``lse = m + log(row_sumexp)``."""
        m = np.where(self.forward.empty, -np.inf, self.forward.rowmax)[..., 0]
        return nan_where(m, None if self.taint is None else self.taint.lse).reshape(self.problem.out_shape[:-1])

    @property
    def row_sumexp(self):
        """cuDNN's ``score_sum_exp``: ``s = sum_j exp(T_j - m)`` over the allowed keys ``(..., Hq, L)``, in
        ``[1, S]``; 0 on rows with no allowed key."""
        s = np.where(self.forward.empty, 0.0, self.forward.rowsum)[..., 0]
        return nan_where(s, None if self.taint is None else self.taint.lse).reshape(self.problem.out_shape[:-1])

    @property
    def tanh(self):
        """Softcap's derivative ``1 - tanh^2(Traw / cap)`` ``(..., Hq, L, S)``, computed as ``sech^2`` without
        cancellation (what the backward multiplies by; the name is the transform's), or None."""
        return self.forward.tanh

    @property
    def empty(self):
        """``(*batch, Hq, L, 1)`` bool: rows with no allowed key."""
        return self.forward.empty

    @property
    def padded(self):
        """``(*batch, 1, L, 1)`` bool: query rows past ``q_lengths``, or None."""
        return self.problem.padded_rows()

    @property
    def dropout_mask(self):
        """The bool keep mask ``Z`` used by the forward, or None."""
        return self.problem.keep

    keep = dropout_mask

    @property
    def scale(self):
        return self.problem.scale

    @property
    def dropout_p(self):
        return self.problem.options.dropout_p

    @property
    def v(self):
        return self.problem.v
