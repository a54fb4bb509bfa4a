r"""Non-finite inputs: which results read them, computed by the same schedule as the results themselves.

The problem's own copies hold 0 where an input was not finite
(:func:`sdpa_ref.reads.scrub`), so every engine computes on clean memory.
Which results read a poisoned entry is then not modelled a second time: the
dense schedule (:mod:`sdpa_ref.engines.reproducible`) runs once more, over
the arithmetic of reads (:class:`sdpa_ref.reads.ReadsArith`), on the problem
whose inputs carry where they were poisoned (:func:`sdpa_ref.reads.lift_problem`).
Its results are, entry by entry, whether the result reads poison, by the very
stage definitions, allowed set, policy and dropout that every engine uses; a
new stage or layout needs nothing here. This costs nothing on finite input.
"""

from __future__ import annotations

import numpy as np

from .engines import reproducible
from .reads import Reads, lift_problem, nan_where

__all__ = ["backward_taint", "forward_taint", "jvp_taint", "nan_where"]


def forward_taint(prob, *, always=False):
    """The dense forward over the arithmetic of reads (a :class:`~sdpa_ref.engines.contract.Forward` whose
    ``out``, ``lse`` and ``lse_keys`` are bool: where each reads poison), or None when no input is poisoned
    (``always``: run it anyway, for a backward or JVP whose cotangents or tangents are)."""
    if prob.poison is None and not always:
        return None
    lifted, R = lift_problem(prob)
    return reproducible.forward(lifted, arith=R)


def backward_taint(prob, taint, dO, do_bad, dlse=None, dl_bad=None):
    """Where each gradient reads poison, in its input's own shape: ``{"query": bool array, ...}`` (``"sinks"``
    too), or None when nothing is poisoned. ``dO`` and ``dlse`` are the cleaned cotangents, ``do_bad`` and
    ``dl_bad`` where they were not finite (or None); ``taint`` the forward's (or None: made here)."""
    if prob.poison is None and do_bad is None and dl_bad is None:
        return None
    lifted, R = lift_problem(prob)
    taint = taint if taint is not None else reproducible.forward(lifted, arith=R)
    g = reproducible.backward(lifted, taint, Reads(dO, do_bad), None if dlse is None else Reads(dlse, dl_bad),
                              arith=R)
    return {"query": g.dq, "key": g.dk, "value": g.dv, "attn_mask": g.dmask, "bias": g.dbias, "sinks": g.dextra}


def jvp_taint(prob, taint, tangents, bads, dv_full=None, dsinks=None, ds_bad=None):
    """Where the output tangent ``(*batch, Hq, L, Ev)`` reads poison (bool), or None when nothing is poisoned.

    ``tangents`` are the cleaned ``(dq, dk, dv, dbias)`` in the engines' layouts (None: zero), ``bads`` where
    each was not finite (or None), ``dv_full`` the value tangent the rows of ``"uniform"`` average, ``dsinks``
    ``(..., Hq, 1, 1)`` and ``ds_bad`` the same for the sinks' tangent."""
    if prob.poison is None and all(b is None for b in bads) and ds_bad is None:
        return None
    lifted, R = lift_problem(prob)
    taint = taint if taint is not None else reproducible.forward(lifted, arith=R)
    dq, dk, dv, db = (None if t is None else Reads(t, b) for t, b in zip(tangents, bads))
    vf = dv if dv_full is tangents[2] else (None if dv_full is None else Reads(dv_full, bads[2]))
    ds = None if dsinks is None else Reads(dsinks, ds_bad)
    return reproducible.jvp(lifted, taint, dq, dk, dv, db, dv_full=vf, dextra=ds, arith=R)


def show(x, bad):
    """``x`` with NaN where ``bad`` (broadcastable), ``x`` itself when ``bad`` is None or nowhere True."""
    return x if bad is None or not np.any(bad) else nan_where(x, bad)
