r"""Judge a split-KV merge kernel: ``merge(out_parts, lse_parts) -> (out, lse)``, against :func:`merge_attention`.

Decode and long-context kernels split the keys, attend to each part, and merge the partial results by their
LSEs (FlashAttention's combine, FlashInfer's ``merge_state``, xformers' ``merge_attentions``). A merge kernel
takes ``out_parts`` ``(P, ..., H, L, Ev)`` in the test dtype and ``lse_parts`` ``(P, ..., H, L)`` in its work
dtype (float32 below float64, as every one of them keeps the LSE), and returns ``out`` in the test dtype and
``lse`` in the work dtype.

The problems (:data:`MERGE_CASES`) are real partial results: attention of seeded inputs over a split of the
keys, computed by the reference and rounded to the test dtype, so each part's ``out`` is an average of values
and its ``lse`` what a kernel returns. They include the cases the peers' bug reports are about: a part with no
allowed key on some rows (``lse = -inf``, its ``out`` filled with NaN, which must never be read: FlashInfer
#4051), rows where every part is empty (the merge must give ``(0, -inf)``, not NaN: vLLM #39148), one part
dominating by ``e^40``, a single part, and many.

The rule is the relative rule of :mod:`.conformance`: ``max|impl - ref64| <= 3 max|honest - ref64| + floor``,
``ref64`` the exact merge of the same (rounded) parts, faithfully rounded to float64 (``precision="reproducible"``),
and ``honest`` the worse of two honest merges in the work dtype (the weights normalised before the sum, or the
parts folded in one after another with the rescale of an online softmax), computed by
:class:`sdpa_ref.exact.arith.LowPrecision`: fixed-order IEEE operations, the same bits on every machine.
Infinities (the LSE of an all-empty row) and NaN must be met exactly.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Optional, Tuple

import numpy as np

from .._validate import check_choice
from ..api import sdpa_forward
from ..exact.arith import LowPrecision
from ..lse import check_base, convert_lse
from ..merge import merge_attention
from ..rounding import round_to
from .cases import SUITE_VERSION
from .judge import REFERENCE_PRECISION, _compare
from .lowp import as_test_dtype, work_dtype
from .report import ConformanceReport, ConformanceRow
from .rules import RelativeRule

__all__ = ["MERGE_CASES", "MergeCase", "check_merge", "judge_merged", "merge_inputs"]


class MergeCase(NamedTuple):
    """A split of the keys ``S`` into parts at ``bounds``; ``empty_rows``: rows with no key in some parts."""

    name: str
    S: int
    bounds: Tuple[int, ...]           # the parts' starts, after 0: keys [0, b1), [b1, b2), ..., [bn, S)
    L: int = 5
    seed: int = 0
    empty: str = "none"               # "none"; "part": a part has no key on some rows; "all": some rows none
    peak: float = 0.0                 # added to one part's scores (its lse dominates by about this much)


#: The merge problems (see the module docstring).
MERGE_CASES = (
    MergeCase("two-parts", 16, (8,), seed=1),
    MergeCase("uneven-parts", 21, (3, 17), seed=2),
    MergeCase("many-parts", 64, tuple(range(8, 64, 8)), seed=3),
    MergeCase("single-part", 9, (), seed=4),
    MergeCase("an-empty-part", 24, (8, 16), seed=5, empty="part"),
    MergeCase("rows-with-no-key", 16, (8,), seed=6, empty="all"),
    MergeCase("one-part-dominates", 16, (4,), seed=7, peak=40.0),
)


def merge_inputs(case: MergeCase, dtype="float32"):
    """``(out_parts, lse_parts)`` of ``case``: the reference's attention over each part of the keys, ``out``
    rounded to ``dtype`` (NaN where a part has no key), ``lse`` to its work dtype."""
    dt, w = as_test_dtype(dtype), work_dtype(dtype)
    rng = np.random.default_rng(case.seed)
    B, H, E, Ev = 2, 2, 8, 8
    q, k, v = (rng.uniform(-2.0, 2.0, s) for s in ((B, H, case.L, E), (B, H, case.S, E), (B, H, case.S, Ev)))
    mask = np.ones((B, H, case.L, case.S), bool)
    starts = (0,) + case.bounds
    ends = case.bounds + (case.S,)
    if case.empty == "part":                                          # rows 0 and 2 see no key of part 1
        mask[..., [0, 2], starts[1]:ends[1]] = False
    elif case.empty == "all":                                         # row 1 of head 0 sees no key at all
        mask[:, 0, 1, :] = False
    bias = np.zeros((case.L, case.S))
    if case.peak:
        bias[:, starts[0]:ends[0]] = case.peak
    outs, lses = [], []
    for j0, j1 in zip(starts, ends):
        o, res = sdpa_forward(q, k[..., j0:j1, :], v[..., j0:j1, :], attn_mask=mask[..., j0:j1], bias=bias[:, j0:j1])
        gone = np.isneginf(res.lse)[..., None]
        outs.append(np.where(gone, np.nan, o))                       # never to be read
        lses.append(res.lse)
    return round_to(np.stack(outs), dt), np.stack(lses).astype(w)


def _honest(out_parts, lse_parts, dt, base):
    """``{"out", "lse"}`` of the worse of two honest merges in the work dtype (fixed-order operations)."""
    w = work_dtype(dt)
    X = LowPrecision(w)
    o = np.asarray(out_parts).astype(w)
    lse = convert_lse(np.asarray(lse_parts, np.float64), from_base=base).astype(w)   # the kernels' natural exp
    gone = np.isneginf(lse)
    o = np.where(gone[..., None], w.type(0), o)
    with np.errstate(all="ignore"):
        m = np.max(lse, axis=0)
        ms = np.where(np.isneginf(m), w.type(0), m)
        e = np.where(gone, w.type(0), X.exp(X.sub(lse, ms)))         # w_i = e^(lse_i - m)
        s = X.sum(np.moveaxis(e, 0, -1), keepdims=False)
        s1 = np.where(s == 0, w.type(1), s)
        dense = X.div(X.sum(np.moveaxis(X.mul(e[..., None], o), 0, -1)), s1[..., None])
        acc, run_m, run_s = np.zeros(o.shape[1:], w), np.full(m.shape, -np.inf, w), np.zeros(m.shape, w)
        for i in range(o.shape[0]):                                   # FlashAttention's combine, part by part
            new = np.maximum(run_m, lse[i])
            safe = np.where(np.isneginf(new), w.type(0), new)
            a = np.where(np.isneginf(run_m), w.type(0), X.exp(X.sub(run_m, safe)))
            b = np.where(gone[i], w.type(0), X.exp(X.sub(lse[i], safe)))
            acc = X.add(X.mul(acc, a[..., None]), X.mul(o[i], b[..., None]))
            run_s, run_m = X.add(X.mul(run_s, a), b), new
        online = X.div(acc, np.where(run_s == 0, w.type(1), run_s)[..., None])
        out_lse = np.where(s == 0, -np.inf, X.add(ms, X.log(s1)))
    lse_b = convert_lse(out_lse.astype(np.float64), base=base).astype(w)
    return {"out": (round_to(dense, dt), round_to(online, dt)), "lse": (lse_b,)}


def check_merge(merge: Callable, *, dtypes="float32", lse_base="e", cases=None,
                progress: Optional[Callable[[int, int, str], None]] = None) -> ConformanceReport:
    """Run ``merge(out_parts, lse_parts)`` over the merge problems and judge its ``(out, lse)``.

    Parameters
    ----------
    merge : callable
        ``merge(out_parts, lse_parts) -> (out, lse)``, ``out_parts`` ``(P, B, H, L, Ev)`` in the test dtype
        (NaN in the parts of rows that have no key there), ``lse_parts`` ``(P, B, H, L)`` in the work dtype
        (float32 below float64), in base ``lse_base``. It returns ``out`` in the test dtype and ``lse`` in
        the work dtype, in the same base; on rows whose parts are all empty ``(0, -inf)``. Raising
        ``NotImplementedError`` skips the case.
    dtypes : str, dtype or sequence of them
        Test dtypes: float64, float32, float16, bfloat16 (the ``lowp`` extra). The reference is the exact
        merge rounded once, so it is more accurate than a float64 kernel too, and the honest float64 merges
        set the allowance there.
    lse_base : {"e", 2}
        The base of the LSEs in and out (2: FlashInfer).
    cases : sequence of MergeCase, optional
        Default :data:`MERGE_CASES`.
    progress : callable, optional
        ``progress(i, n, case_name)`` before each case.

    Returns
    -------
    ConformanceReport
        Rows ``out`` and ``lse`` per (case, dtype), by the relative rule.
    """
    if not callable(merge):
        raise TypeError(f"`merge` should be callable, but got {type(merge).__name__}")
    base = check_base(lse_base, "lse_base")
    from .conformance import _as_dtypes
    dtypes = _as_dtypes(dtypes)
    for dt in dtypes:
        check_choice(dt, "dtypes", ("float64", "float32", "float16", "bfloat16"))
    cases = MERGE_CASES if cases is None else tuple(cases)
    if not cases or not all(isinstance(c, MergeCase) for c in cases):
        raise TypeError("`cases` should be a non-empty sequence of MergeCase")
    rule, rows, t0 = RelativeRule(judge_lean=False), [], time.perf_counter()
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.name)
        for dt in dtypes:
            rows.extend(_judge(merge, case, dt, base, rule))
    return ConformanceReport(rows=rows, rule=rule.describe(), suite="merge", suite_version=SUITE_VERSION,
                             seconds=time.perf_counter() - t0, meta={"dtypes": list(dtypes), "lse_base": base})


def _judge(merge, case, dt, base, rule):
    out_p, lse_p = merge_inputs(case, dt)
    lse_in = convert_lse(lse_p.astype(np.float64), base=base).astype(lse_p.dtype)
    try:
        got = merge(out_p.copy(), lse_in.copy())
    except NotImplementedError as exc:
        return [ConformanceRow(case.name, dt, "all", "skip", note=f"not implemented: {exc}")]
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return [ConformanceRow(case.name, dt, "out", "error", note=f"{type(exc).__name__}: {exc}")]
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return [ConformanceRow(case.name, dt, "out", "error", note="the merge should return (out, lse)")]
    return judge_merged(got[0], got[1], out_p, lse_in, dt, base, rule, case.name)


def judge_merged(out, lse, out_parts, lse_parts, dt, base, rule, case="your inputs", axis=0):
    """The rows ``out`` and ``lse`` of a merge's results against :func:`merge_attention` in float64 of the same
    parts (``out_parts`` in the test dtype ``dt``, ``lse_parts`` in base ``base``, the parts along ``axis``),
    by ``rule``; under the relative rule, with the worse of the two honest merges of :func:`_honest` as the
    baseline."""
    out_p, lse_p = np.moveaxis(np.asarray(out_parts), axis, 0), np.moveaxis(np.asarray(lse_parts), axis, 0)
    ref_out, ref_lse = merge_attention(out_p.astype(np.float64), lse_p.astype(np.float64), lse_base=base,
                                       precision=REFERENCE_PRECISION)
    honest = _honest(out_p, lse_p, dt, base) if isinstance(rule, RelativeRule) else None
    rows = []
    for qty, val, ref, want in (("out", out, ref_out, np.dtype(dt)), ("lse", lse, ref_lse, work_dtype(dt))):
        err = None
        if honest is not None:
            err, fin = 0.0, np.isfinite(ref)
            for h in honest[qty]:
                with np.errstate(invalid="ignore"):
                    d = np.where(fin, np.abs(h.astype(np.float64) - ref), 0.0)
                err = max(err, float(np.where(np.isnan(d), np.inf, d).max(initial=0.0)))
        rows.append(_compare(case, np.dtype(dt).name, qty, np.array(val), ref, err, rule, None, want=want))
    return rows
