r"""What the public API hands the user between passes: the residuals of :func:`sdpa_forward` and the
gradients of :func:`sdpa_backward` (the engines' own results are :mod:`sdpa_ref.engines.contract`'s)."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from .engines.contract import Forward
from .lse import convert_lse
from .options import check_bool
from .reads import nan_where

__all__ = ["AbsorbedGrads", "AttentionGrads", "AttentionResiduals", "ScoreModGrads"]


class AttentionGrads(NamedTuple):
    """Gradients of a loss with respect to the inputs of attention: the one record every backward returns.

    Each has its input's own shape and dtype. ``attn_mask`` is the gradient
    with respect to a float mask, ``bias`` with respect to ``bias`` (each
    summed to its own shape), ``sinks`` with respect to ``sinks``; ``None``
    where there is no such input.

    Two inputs have optional gradients, read as attributes on every record:
    ``qv``, MLA's absorbed queries (``None`` without them), and
    ``score_mod``, a tuple with one gradient per tensor a score function
    captures (``ScoreMod(params=...)``; ``None`` without them). When one is
    present the record is a subclass, :class:`AbsorbedGrads` or
    :class:`ScoreModGrads`, whose tuple carries it after the six fields, so
    code that unpacks six gradients from a forward without them, or reads
    ``grads[:6]`` from any, keeps working.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attn_mask: Optional[np.ndarray]
    bias: Optional[np.ndarray] = None
    sinks: Optional[np.ndarray] = None

    # the optional gradients, absent here; the subclasses below hold them as fields
    qv = None
    score_mod = None


class AbsorbedGrads(namedtuple("_AbsorbedFields", AttentionGrads._fields + ("qv",)), AttentionGrads):
    """:class:`AttentionGrads` of a forward with MLA's ``qv``, and ``qv``'s own gradient last (seven fields)."""

    __slots__ = ()


class ScoreModGrads(namedtuple("_ScoreModFields", AttentionGrads._fields + ("qv", "score_mod")), AttentionGrads):
    """:class:`AttentionGrads` of a forward whose score function captures tensors (``ScoreMod(params=...)``):
    the six fields, ``qv`` (None without it) and ``score_mod``, a tuple with one gradient per captured tensor,
    in its shape (float64)."""

    __slots__ = ()


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
    layout: Any = None              # the sdpa_ref.layouts.Gathered problem of a layout, or None (dense)
    absorbed: Any = None            # MLA's qv joined (sdpa_ref.absorbed.Absorbed), or None

    @property
    def probs(self):
        """``P`` ``(..., Hq, L, S)``, or None (``save_probs=False``, tiled)."""
        return self.forward.probs

    @property
    def out(self):
        """The output in the compute dtype, in the user's rank (in the layout's, with a layout): the caller's own
        writeable copy (writing into it changes no gradient)."""
        out = nan_where(self.forward.out, None if self.taint is None else self.taint.out).reshape(
            self.problem.out_shape)
        return np.array(out) if self.layout is None else self.layout.out(out)

    def _rows(self, x, taint=None, fill=-np.inf):
        """A per-row quantity ``(*batch, Hq, L)`` with the taint's NaN, in the user's rank (the layout's LSE
        layout, with a layout, ``fill`` on its unused rows): the caller's own writeable copy, never a view of the
        residuals (so the LSE of ``return_lse=True`` is one too)."""
        x = nan_where(x, None if self.taint is None else (self.taint.lse if taint is None else taint)).reshape(
            self.problem.out_shape[:-1])
        return np.array(x if self.layout is None else self.layout.lse(x, fill))

    @property
    def tile_counts(self):
        """With a ``block_mask``: how many tiles the tiled engine skipped (``"absent"``), visited without the mask
        function (``"full"``) and with it (``"partial"``), over the forward and every backward and JVP run on these
        residuals so far (a copy); None without one."""
        c = self.problem.tile_counts
        return None if c is None else dict(c)

    @property
    def lse(self):
        """The log-sum-exp of the allowed scores ``(..., Hq, L)``; ``-inf`` on rows with no key (FlashAttention's
        ``(Hq, total_q)`` for a packed layout, ``(B, Hq, Lq)`` for a KV cache)."""
        return self._rows(self.forward.lse)

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
            lse = self._rows(self.forward.lse_keys, None if self.taint is None else self.taint.lse_keys)
        return convert_lse(lse, base=base, empty=empty)

    @property
    def row_max(self):
        """cuDNN's ``score_max``: each row's largest allowed score ``m`` ``(..., Hq, L)``, after every score term
        (scale, softcap, mask, bias, ALiBi); ``-inf`` on rows with no allowed key. ``lse = m + log(row_sumexp)``.
        With ``sinks`` it includes the sink, ``max(m, sink)`` (cuDNN folds it into the max and the sum);
        :meth:`row_max_as` ``(sink=False)`` is the keys' own."""
        return self._rows(np.where(self.forward.empty, -np.inf, self.forward.rowmax)[..., 0])

    def row_max_as(self, *, sink=True):
        """:attr:`row_max` with or without the sink: ``sink=True`` (cuDNN's ``score_max``, which folds the sink
        in) is :attr:`row_max`; ``sink=False`` (FlashMLA's ``max_logits``) the largest allowed score of the keys
        alone, which the engine kept before it folded the sink in: ``-inf`` on a row with no allowed key, and
        the keys' own where the sink is ``+inf`` (where :attr:`row_max` is ``+inf``). Without sinks the two are
        the same."""
        sink = check_bool(sink, "sink")
        if sink or self.forward.rowmax_keys is None:
            return self.row_max
        return self._rows(self.forward.rowmax_keys, None if self.taint is None else self.taint.lse_keys)

    @property
    def row_sumexp(self):
        """cuDNN's ``score_sum_exp``: ``s = sum_j exp(T_j - m)`` over the allowed keys ``(..., Hq, L)``, in
        ``[1, S]``; 0 on rows with no allowed key."""
        return self._rows(np.where(self.forward.empty, 0.0, self.forward.rowsum)[..., 0], fill=0.0)

    @property
    def slope(self):
        """The score chain's slope ``dT/dTraw`` ``(..., Hq, L, S)``, what the backward multiplies ``dT`` by:
        softcap's ``1 - tanh^2(Traw / cap)``, computed as ``sech^2`` without cancellation, times a score
        function's derivative; None without either, or without saved ``P``."""
        return self.forward.slope

    @property
    def tanh(self):
        """:attr:`slope` under the name of the transform it comes from (softcap's ``tanh``): an alias."""
        return self.slope

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
