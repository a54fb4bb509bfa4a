r"""The fully-masked policy of ``SEMANTICS.md``: what a row with no allowed key gets.

A row can be left without a key by a fully masked bool row, causal with
``L > S`` under bottom-right alignment, a window that misses every key, a
row of ``-inf`` float scores, ``S = 0``. ``fully_masked`` decides (:func:`fill_empty_rows`):
zeros (``"zero"``), NaN (``"nan"``) or the uniform average over all ``S``
keys (``"uniform"``). Query rows past ``q_len`` are zero under every policy.
The helpers below say which rows are constant, zero or NaN by the policy, so
that every engine sets them rather than computes them from memory it must
not read.
"""

from __future__ import annotations

import numpy as np

__all__ = ["constant_rows", "fill_empty_rows", "fill_output_without_keys", "nan_rows", "policy_fill",
           "zero_output_rows"]


def policy_fill(policy, S):
    """What ``P`` holds on a row with no allowed key: 0, NaN, or ``1/S`` (the uniform average)."""
    return {"zero": 0.0, "nan": np.nan, "uniform": 1.0 / S if S else np.nan}[policy]


def fill_empty_rows(P, empty, padded, policy, S, X=None):
    """``P`` with the rows that have no allowed key filled by ``policy``; padded query rows are 0.

    ``empty`` is ``(..., L, 1)`` bool; ``padded`` the rows past ``q_len``
    (or None). Returns ``P`` itself when no row is empty. ``X``: an
    arithmetic (:mod:`sdpa_ref.arith`) whose values ``P`` holds; its
    ``policy_const`` is the fill as that arithmetic holds it (double-double:
    ``1/S`` to about 100 bits), and the fills are its constants (structural
    zeros, for :mod:`sdpa_ref.reads`).
    """
    if not np.any(empty):
        return P
    if X is None:
        P = np.where(empty, P.dtype.type(policy_fill(policy, S)), P)
        return P if padded is None or policy == "zero" else np.where(padded, P.dtype.type(0), P)
    P = X.where(empty, X.policy_const(policy, S), P)
    return P if padded is None or policy == "zero" else X.where(padded, X.const(0.0), P)


def constant_rows(empty, padded, policy):
    """``(..., L, 1)`` bool: the rows whose ``P`` is a constant of the policy, or None.

    Fully masked rows under ``"zero"`` or ``"uniform"``, and padded query
    rows. Their ``dT`` and ``dP`` are 0 -- set, not computed, so that nothing
    stored in the keys and values reaches them (``0 * inf`` would be NaN).
    """
    rows = empty if policy in ("zero", "uniform") else None
    if padded is not None:
        rows = padded if rows is None else (rows | padded)
    return rows if rows is not None and np.any(rows) else None


def zero_output_rows(empty, padded, policy):
    """``(..., L, 1)`` bool: the rows whose output is 0 by definition (fully masked under ``"zero"``, padded), or
    None. The engines set their output to 0 rather than compute ``0 V``, which reads every value."""
    rows = empty if policy == "zero" else None
    if padded is not None:
        rows = padded if rows is None else (rows | padded)
    return rows if rows is not None and np.any(rows) else None


def nan_rows(empty, padded, policy):
    """``(..., L, 1)`` bool: the rows that the ``"nan"`` policy makes NaN (fully masked, not padded), or None."""
    if policy != "nan" or not np.any(empty):
        return None
    return empty if padded is None else (empty & ~padded)


def fill_output_without_keys(O, rows):
    """With ``S == 0`` the output is an empty sum (0): the ``"nan"`` policy makes NaN the ``rows`` it applies to
    (:meth:`sdpa_ref.problem.Problem.nan_rows_without_keys`: not padded, and no sink, whose row gives 0), or
    ``O`` itself when ``rows`` is None."""
    return O if rows is None else np.where(rows, O.dtype.type(np.nan), O)
