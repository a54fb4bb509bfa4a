r"""The contract every engine implements, and what the public API hands the user between passes.

An engine is a module with these functions, one signature for all (the
public API calls them through :class:`sdpa_ref.api.Engine`, which adds
the tiled schedule's ``block_size=``)::

    forward(prob, *, save_probs=True) -> Forward
    backward(prob, fwd, dO, dlse=None) -> Grads
    jvp(prob, fwd, dq, dk, dv, dbias, *, dv_full, dextra) -> dO

``prob`` is a validated :class:`~sdpa_ref.problem.Problem` (compute dtype,
``q`` as ``(..., Hkv, G, L, E)``); ``dO`` is ``(*batch, Hq, L, Ev)`` in the
compute dtype. Every array below is in the compute dtype and in the *full*
batch layout (``*batch`` is the broadcast of the inputs' batch dims); the
public API sums gradients back to the inputs' shapes and casts them.

The engines agree with the teaching core (:mod:`sdpa_ref.core`) and the plain engine (:mod:`sdpa_ref.attention`) to
rounding, on every option; ``tests/test_engines_fast.py`` and ``tests/test_engines_tiled.py``
hold them to it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

__all__ = ["Forward", "Grads"]


class Forward(NamedTuple):
    """What a forward returns (and what its backward reads)."""

    out: np.ndarray                    # O    (*batch, Hq, L, Ev)
    lse: np.ndarray                    # LSE  (*batch, Hq, L); -inf on rows with no allowed key
    probs: Optional[np.ndarray]        # P    (*batch, Hq, L, S), or None when not saved
    slope: Optional[np.ndarray]        # the score chain's slope dT/dTraw: softcap's 1 - tanh^2(Traw / cap), computed
    #                                    as sech^2 (no cancellation), times a score function's derivative;
    #                                    (*batch, Hq, L, S) with either and saved P, else None
    empty: np.ndarray                  # (*batch, Hq, L, 1) bool: rows with no allowed key
    rowmax: np.ndarray                 # m (*batch, Hq, L, 1), real: the row's max score, 0 on rows with no key
    rowsum: np.ndarray                 # s (*batch, Hq, L, 1): sum_j exp(T_j - m); LSE = m + log(s)
    extra: Any = None                  # what only this engine's backward reads (the reproducible one's dd P)
    lse_keys: Optional[np.ndarray] = None  # with extra logits (sinks): the LSE over the keys alone (*batch, Hq, L)
    rowmax_keys: Optional[np.ndarray] = None  # with extra logits: the keys' own max score (FlashMLA's max_logits)
    #                                          (*batch, Hq, L), real, -inf on rows with no key; None without them

    @property
    def tanh(self):
        """:attr:`slope` under the name of the transform it comes from (softcap's ``tanh``): an alias."""
        return self.slope


class Grads(NamedTuple):
    """What a backward returns."""

    dq: np.ndarray                     # (*batch, Hq, L, E)
    dk: np.ndarray                     # (*batch, Hkv, S, E), summed over each GQA group
    dv: np.ndarray                     # (*batch, Hkv, S, Ev), summed over each GQA group
    dmask: Optional[np.ndarray]        # the float attn_mask's gradient, in its own shape
    dbias: Optional[np.ndarray]        # the bias's gradient, in its own shape
    dextra: Optional[np.ndarray] = None  # the extra logits' (the sinks') gradient (*batch, Hq), summed over the
    #                                      rows (sdpa_ref.normalize); None without them
    dmod: Optional[tuple] = None       # the score function's captured tensors' gradients (sdpa_ref.score_mod),
    #                                    each in its tensor's shape; None without them
    absorbed: Optional[tuple] = None   # with MLA's qv, (dq, dqv, dk, dv) in the inputs' shapes, split by the engine
    #                                    in its own arithmetic (sdpa_ref.absorbed.Absorbed.split) and rounded once:
    #                                    the reproducible one's; None: the API splits dq, dk, dv above
