r"""The fully-masked policy of ``SEMANTICS.md``: what a row with no allowed key gets.

A row can be left without a key by a fully masked bool row, causal with
``L > S`` under bottom-right alignment, a window that misses every key, a
row of ``-inf`` float scores, ``S = 0``. ``fully_masked`` decides (:func:`fill_empty_rows`):
zeros (``"zero"``), NaN (``"nan"``), the uniform average over all ``S``
keys (``"uniform"``), or JAX's (``"jax"``): JAX masks with a finite
sentinel, so such a row averages the ``n`` keys the structural rules exclude
from it (bool mask, causal, window, lengths, ...: each holds the sentinel),
``P = 1/n`` on them, and is NaN when ``n = 0`` with keys (every key allowed,
every score ``-inf`` from a float mask or bias); with ``S = 0`` JAX's
``P V`` is an empty sum, 0, as under ``"zero"``. Query rows past ``q_len`` are
zero under every policy.
The helpers below say which rows are constant, zero or NaN by the policy, so
that every engine sets them rather than computes them from memory it must
not read.

This module is the one place that tells the policies apart by name. Every
other module asks a question by its meaning: does a fully masked row read
the values (:func:`averages_values`), every key (:func:`averages_every_key`)
or the structurally excluded ones (:func:`averages_excluded`); is its fill 0
(:func:`fills_zero`) or NaN (:func:`makes_nan`); is the policy the default
(:func:`is_default`) or a peer's algorithm reproduced (:func:`emulates_peer`).
The names are validated once, by :class:`sdpa_ref.options.AttentionOptions`;
a predicate given an unknown name answers False.
"""

from __future__ import annotations

import numpy as np

from .arith import NUMPY

__all__ = ["DEFAULT", "FULLY_MASKED_POLICIES", "averages_every_key", "averages_excluded", "averages_values",
           "constant_rows", "counts", "emulates_peer", "excluded", "fill_empty_rows", "fill_output_without_keys",
           "fills_zero", "is_default", "makes_nan", "nan_rows", "policy_fill", "policy_fill_in", "zero_output_rows"]

#: Accepted values of ``fully_masked``, in the order the harness enumerates them; see ``SEMANTICS.md``.
FULLY_MASKED_POLICIES = ("zero", "nan", "uniform", "jax")

#: The default of ``fully_masked``: PyTorch 2.5 and later (math backend) and FlashAttention.
DEFAULT = "zero"


# ------------------------------------------------------------- what each policy does, by meaning


def is_default(policy):
    """Whether ``policy`` is the default of ``fully_masked``, ``"zero"`` (what a case or report need not name)."""
    return policy == DEFAULT


def fills_zero(policy):
    """Whether a fully masked row's ``P`` is 0 on every key (``"zero"``): its output and gradients are 0, set
    without reading a value, and a block of keys that no row allows contributes nothing to it."""
    return policy == "zero"


def fills_past_allowed(policy, empty, padded=None):
    """Whether some row with no allowed key (``empty``, bool broadcastable to ``(..., L, 1)``) that is not padded
    (``padded``, or None) gets a nonzero ``P`` from ``policy`` on keys its allowed set leaves out (``"nan"``,
    ``"uniform"``, ``"jax"``): a schedule that reads ``P`` only on spans of the allowed set must then read those
    rows whole. Padded rows are 0 under every policy."""
    if fills_zero(policy):
        return False
    rows = np.asarray(empty) if padded is None else np.asarray(empty) & ~np.asarray(padded)
    return bool(np.any(rows))


def makes_nan(policy):
    """Whether every fully masked row (not padded) is NaN, output and gradients (``"nan"``: the textbook
    formula, 0/0); with ``S = 0`` too, where the engines' empty sums would give 0. ``"jax"`` is NaN only on a row
    with no excluded key to average (:func:`nan_rows`), which this does not ask."""
    return policy == "nan"


def averages_values(policy):
    """Whether a fully masked row averages values (``"uniform"``: all ``S`` keys; ``"jax"``: the keys the
    structural rules exclude from it), so it reads values outside its allowed set, and ``dV`` receives
    ``dO / n`` there."""
    return policy in ("uniform", "jax")


def averages_every_key(policy):
    """Whether a fully masked row is the mean over all ``S`` keys, ``P = 1/S`` (``"uniform"``): undefined with
    ``S = 0``, and counting a layout's padding as keys."""
    return policy == "uniform"


def averages_excluded(policy):
    """Whether a fully masked row averages only the ``n`` keys the structural rules exclude from it, ``P = 1/n``,
    NaN where ``n = 0`` (``"jax"``: JAX's finite sentinel): the problem keeps those counts (:func:`counts`)."""
    return policy == "jax"


def emulates_peer(policy):
    """Whether ``policy`` reproduces one peer's algorithm bit for bit rather than stating a rule for the row
    (``"jax"``: ``"uniform"`` on rows the structural rules empty, ``"nan"`` on rows ``-inf`` floats empty). It
    is held to that algorithm written out (``tests/test_policy.py``), not to the self-check's grid."""
    return policy == "jax"


# ------------------------------------------------------------- the fill, and the rows it makes


def policy_fill(policy, S):
    """What ``P`` holds on a row with no allowed key: 0, NaN, or ``1/S`` (the uniform average); for ``"jax"``,
    ``S`` is the count ``n`` of the keys the row averages (an array: :func:`counts`), and the fill ``1/n``, NaN
    where ``n = 0``. In NumPy: :func:`policy_fill_in` over :data:`sdpa_ref.arith.NUMPY`."""
    return policy_fill_in(NUMPY, policy, S)


def policy_fill_in(X, policy, S):
    """:func:`policy_fill` as a value of the arithmetic ``X`` (:mod:`sdpa_ref.arith`): an average's ``1/S`` or
    ``1/n`` is ``X.recip`` (in double-double, to about 100 bits), 0 and NaN are ``X.const``."""
    if averages_excluded(policy):
        n = np.asarray(S, np.float64)
        return X.where(n > 0, X.recip(np.where(n > 0, n, 1.0)), X.const(np.nan))
    if averages_every_key(policy) and S:
        return X.recip(S)
    return X.const({"zero": 0.0, "nan": np.nan, "uniform": np.nan}[policy])      # the mean of no key: NaN


def counts(prob, rows=None):
    """``"jax"``: the count ``n`` of keys the structural rules exclude from each row (of the block ``rows``),
    ``(..., L, 1)``, which such a row averages; None under the other policies."""
    n = prob.excluded_counts
    return None if n is None else (n if rows is None else n[..., rows[0]:rows[1], :])


def excluded(prob, rows=None, cols=None):
    """``"jax"``: the keys the structural rules exclude in a block (bool, broadcastable to its scores), or None
    (none is); None under the other policies (no need)."""
    if prob.excluded_counts is None:
        return None
    a = prob.allowed(rows, cols)
    return None if a is None else ~a


def fill_empty_rows(P, empty, padded, policy, S, X=None, n=None, excl=None):
    """``P`` with the rows that have no allowed key filled by ``policy``; padded query rows are 0.

    ``empty`` is ``(..., L, 1)`` bool; ``padded`` the rows past ``q_len``
    (or None). Returns ``P`` itself when no row is empty. ``X``: an
    arithmetic (:mod:`sdpa_ref.arith`) whose values ``P`` holds; the fill is
    :func:`policy_fill_in`, the value as that arithmetic holds it
    (double-double: ``1/S`` to about 100 bits), and the zeros are its
    constants (structural zeros, for :mod:`sdpa_ref.reads`). ``"jax"`` takes the rows' counts ``n``
    (:func:`counts`) for ``S`` and the block's excluded keys ``excl``
    (:func:`excluded`): ``1/n`` on those keys, 0 on the others, NaN on a row
    with ``n = 0``.
    """
    if not np.any(empty):
        return P
    per_key = averages_excluded(policy)                               # a fill per row and key, not a constant
    if per_key:
        nan_row = n == 0
        on = nan_row if excl is None else (excl | nan_row)             # the keys the row averages, or all: NaN
    if X is None:
        fill = P.dtype.type(policy_fill(policy, S)) if not per_key else \
            np.where(on, policy_fill(policy, n), 0.0).astype(P.dtype)
        P = np.where(empty, fill, P)
        return P if padded is None or fills_zero(policy) else np.where(padded, P.dtype.type(0), P)
    fill = policy_fill_in(X, policy, S) if not per_key else \
        X.where(on, policy_fill_in(X, policy, n), X.const(0.0))
    P = X.where(empty, fill, P)
    return P if padded is None or fills_zero(policy) else X.where(padded, X.const(0.0), P)


def constant_rows(empty, padded, policy, n=None):
    """``(..., L, 1)`` bool: the rows whose ``P`` is a constant of the policy, or None.

    Fully masked rows under ``"zero"`` or ``"uniform"`` (and ``"jax"``, those
    with ``n > 0`` keys to average), and padded query rows. Their ``dT`` and
    ``dP`` are 0 -- set, not computed, so that nothing stored in the keys and
    values reaches them (``0 * inf`` would be NaN).
    """
    rows = empty if fills_zero(policy) or averages_every_key(policy) else \
        (empty & (n > 0)) if averages_excluded(policy) else None
    if padded is not None:
        rows = padded if rows is None else (rows | padded)
    return rows if rows is not None and np.any(rows) else None


def zero_output_rows(empty, padded, policy):
    """``(..., L, 1)`` bool: the rows whose output is 0 by definition (fully masked under ``"zero"``, padded), or
    None. The engines set their output to 0 rather than compute ``0 V``, which reads every value."""
    rows = empty if fills_zero(policy) else None
    if padded is not None:
        rows = padded if rows is None else (rows | padded)
    return rows if rows is not None and np.any(rows) else None


def nan_rows(empty, padded, policy, n=None, S=None):
    """``(..., L, 1)`` bool: the rows that the ``"nan"`` policy makes NaN (fully masked, not padded), or those of
    ``"jax"`` with no key to average (``n = 0``) among ``S > 0`` keys (``S = 0``: JAX's empty sum, 0; ``S``
    None: some key), or None."""
    if not (makes_nan(policy) or averages_excluded(policy)) or not np.any(empty) or \
            (averages_excluded(policy) and S == 0):
        return None
    rows = empty if makes_nan(policy) else (empty & (n == 0))
    return rows if padded is None else (rows & ~padded)


def fill_output_without_keys(O, rows):
    """With ``S == 0`` the output is an empty sum (0): the ``"nan"`` policy makes NaN the ``rows`` it applies to
    (:meth:`sdpa_ref.problem.Problem.nan_rows_without_keys`: not padded, and no sink, whose row gives 0), or
    ``O`` itself when ``rows`` is None."""
    return O if rows is None else np.where(rows, O.dtype.type(np.nan), O)
