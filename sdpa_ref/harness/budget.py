"""How much ``sdpa-ref verify`` will compute: every case of a manifest costed before anything is computed.

A vector set's ``manifest.json`` names its suite, or for a custom set stores its case definitions, and
:func:`~.vectors.verify_vectors` regenerates every case from them. The folder may hold anything, so a manifest of
a kilobyte could ask for hours of work and gigabytes of memory (one case of ``E = 2**22``, or 10,000 cases, as
the case-file format allows). :func:`check_verify_budget` costs each case from its shapes alone -- score entries,
the largest input, the bytes of its file and the work of regenerating it -- and refuses a set past
:data:`VERIFY_LIMITS`, per case or in total, with a :class:`~.vectorio.ManifestError` naming the case, the
quantity and the limit. The limits hold the full suite in every dtype and layout with room (about 4 times its
largest case and 2.5 times its total work; tested), and bound what ``verify`` may take: one case at a time is
regenerated and freed, at most about 110 bytes of memory per score entry (bfloat16, the costliest), so at most
about 0.5 GB; the work limit is about a minute on one core in bfloat16 (whose honest ensemble is the slow part)
and a few seconds in float64 (the figures: docs/performance.md, "Where the numbers in the code went").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable

import numpy as np

from .vectorio import ManifestError

__all__ = ["VERIFY_LIMITS", "VerifyLimits", "case_cost", "check_verify_budget", "describe_limits", "shown_count"]


@dataclass(frozen=True)
class VerifyLimits:
    """The most ``verify`` regenerates: per case, and in total over a set's cases.

    ``scores`` counts a case's score entries (batch x Hq x L x S), ``input`` the entries of its largest input
    (query, key or value), ``bytes`` an upper bound of its ``.npz`` file's size (:func:`case_cost`), ``work`` its
    estimated work, ``scores x (E + Ev + 16) + work_per_case`` (the products of the forward and backward, the
    element-wise passes, and what any case costs however small: the honest ensemble's passes and the file)."""
    case_scores: int = 1 << 22
    case_input: int = 1 << 20
    case_bytes: int = 64 << 20
    case_work: int = 1 << 28
    total_scores: int = 1 << 24
    total_bytes: int = 512 << 20
    total_work: int = 1 << 30
    work_per_case: int = 1 << 18


#: The limits :func:`~.vectors.verify_vectors` (and :func:`~.vectors.write_vectors` with ``cases=``) applies.
VERIFY_LIMITS = VerifyLimits()


def case_cost(case, dtype="float64") -> Dict[str, int]:
    """``{"scores", "input", "bytes", "work"}`` of regenerating ``case``'s vector file, from its shapes alone.

    ``bytes`` bounds the file in any layout: every input, output and gradient at 8 bytes an entry (keys and values
    with 32 more positions, the pages of a paged set), every array of the scores' size (mask, bias and its
    gradient, dropout's keep mask, top-k indices) at 8 bytes too, and 64 KiB for the headers and small arrays."""
    batch = np.broadcast_shapes(case.batch_q, case.batch_kv)
    nb, nq, nkv = math.prod(batch), math.prod(case.batch_q), math.prod(case.batch_kv)
    scores = nb * case.Hq * case.L * case.S
    query, key, value = nq * case.Hq * case.L * case.E, nkv * case.Hkv * case.S * case.E, \
        nkv * case.Hkv * case.S * case.Ev
    out, rows = nb * case.Hq * case.L * case.Ev, nb * case.Hq * case.L
    kv_pad = nkv * case.Hkv * 32 * (case.E + case.Ev)
    n_score_arrays = sum(a in case.arrays for a in ("mask", "masked_rows", "float_mask", "dropout", "gather")) \
        + 2 * ("bias" in case.arrays)
    size = 8 * (2 * (query + key + value + kv_pad) + 2 * out + 2 * rows + n_score_arrays * scores) + (64 << 10)
    work = scores * (case.E + case.Ev + 16) + VERIFY_LIMITS.work_per_case
    return {"scores": scores, "input": max(query, key, value), "bytes": size, "work": work}


def check_verify_budget(cases: Iterable, dtype="float64", where: str = "manifest.json",
                        limits: VerifyLimits = VERIFY_LIMITS) -> Dict[str, int]:
    """The set's total cost (:func:`case_cost` summed), or :class:`~.vectorio.ManifestError` at the first case
    past a per-case limit of ``limits``, or for a set past a total; nothing is computed."""
    total = {"scores": 0, "bytes": 0, "work": 0}
    for case in cases:
        cost = case_cost(case, dtype)
        for what, cap in (("scores", limits.case_scores), ("input", limits.case_input),
                          ("bytes", limits.case_bytes), ("work", limits.case_work)):
            if cost[what] > cap:
                raise ManifestError(f"{where}: case {case.name!r} would need {_WHAT[what]} of "
                                    f"{shown_count(cost[what])}, more than the {shown_count(cap)} a case may have "
                                    "that verify accepts (VERIFY_LIMITS): refused before computing anything")
        for what in total:
            total[what] += cost[what]
    for what, cap in (("scores", limits.total_scores), ("bytes", limits.total_bytes), ("work", limits.total_work)):
        if total[what] > cap:
            raise ManifestError(f"{where}: its cases would need in total {_WHAT[what]} of {shown_count(total[what])}, "
                                f"more than the {shown_count(cap)} that verify accepts (VERIFY_LIMITS): refused "
                                "before computing anything")
    return total


_WHAT = {"scores": "score entries (batch x Hq x L x S)", "input": "entries in its largest input (query, key "
         "or value)", "bytes": "a file (bytes, estimated)", "work": "work (score entries x (E + Ev + 16), "
         "estimated)"}


def shown_count(n: int) -> str:
    """``n`` as the limits are stated: ``2**k`` for a power of two (``64 MiB`` style for bytes is the caller's)."""
    return f"2**{n.bit_length() - 1}" if n > 0 and n & (n - 1) == 0 else str(n)


def describe_limits(limits: VerifyLimits = VERIFY_LIMITS) -> str:
    """The limits in words (``sdpa-ref verify --help``)."""
    c = shown_count
    return (f"per case at most {c(limits.case_scores)} score entries (batch x Hq x L x S), {c(limits.case_input)} "
            f"entries in an input, {c(limits.case_bytes)} bytes of file and {c(limits.case_work)} work (score "
            f"entries x (E + Ev + 16)); in total {c(limits.total_scores)} score entries, {c(limits.total_bytes)} "
            f"bytes and {c(limits.total_work)} work ({c(limits.work_per_case)} more per case)")
