"""The installation self-check behind ``sdpa-ref check``.

It runs finite-difference gradient checks of every backward in the package
(the softmax family and attention) over a grid of options and reports one
row per case with its worst relative error. Shapes are small, so the full
grid runs in seconds.

Attention cases take the product of:

* shapes: ``L == S``, ``L < S``, ``L > S`` (each with ``Ev != E``), and a
  broadcast batch;
* mask: none, bool, float;
* ``is_causal``: off / on;
* GQA: off / on (Hq=4, Hkv=2);
* dropout: off / an explicit keep mask with ``p = 0.3``;
* ``fully_masked``: every policy, on inputs that have a fully masked row.

Under ``"zero"`` and ``"uniform"`` the gradients are the true Jacobian and are
checked in full against central differences. Under ``"nan"`` they are NaN by
design (the textbook formula in IEEE arithmetic); the check then asserts that
the NaN pattern is the documented one and that every finite entry equals the
gradient of the ``"zero"`` policy, which was itself checked in full.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np

from .attention import sdpa_backward, sdpa_forward
from .gradcheck import check_jvp, check_vjp
from .softmax import (
    log_softmax,
    log_softmax_vjp,
    softmax,
    softmax_jvp,
    softmax_vjp,
)

__all__ = ["CHECK_RTOL", "CHECK_ATOL", "CheckResult", "attention_cases", "run_checks"]

#: Relative tolerance that every self-check must meet (symmetric relative error).
CHECK_RTOL = 1e-7
#: Absolute floor of the self-check.
CHECK_ATOL = 1e-9

# (name, batch_q, batch_kv, L, S, E, Ev)
_SHAPES = [
    ("L=S", (2,), (2,), 4, 4, 3, 2),
    ("L<S", (1,), (1,), 3, 5, 4, 3),
    ("L>S", (1,), (1,), 5, 3, 2, 3),
    ("bcast", (2,), (1,), 3, 4, 3, 2),
]


@dataclass(frozen=True)
class AttentionCase:
    shape: str
    mask: str          # "none" | "bool" | "float"
    causal: bool
    gqa: bool
    dropout: bool
    fully_masked: str  # "zero" | "nan" | "uniform"
    masked_row: bool   # inputs contain a fully masked row

    @property
    def name(self) -> str:
        parts = [self.shape, f"mask={self.mask}"]
        if self.causal:
            parts.append("causal")
        if self.gqa:
            parts.append("gqa")
        if self.dropout:
            parts.append("dropout")
        if self.masked_row:
            parts.append(f"fully_masked={self.fully_masked}")
        return " ".join(parts)


@dataclass
class CheckResult:
    name: str
    ok: bool
    max_rel_error: float
    max_abs_error: float
    seconds: float
    detail: str = ""
    report: Optional[object] = field(default=None, repr=False)

    def as_dict(self):
        return {"name": self.name, "ok": self.ok, "max_rel_error": self.max_rel_error,
                "max_abs_error": self.max_abs_error, "seconds": self.seconds, "detail": self.detail}


def attention_cases(quick: bool = False) -> List[AttentionCase]:
    """The grid of attention cases; ``quick`` keeps a covering subset."""
    cases = []
    for (shape, *_), mask, causal, gqa, dropout in itertools.product(
        _SHAPES, ("none", "bool", "float"), (False, True), (False, True), (False, True)
    ):
        cases.append(AttentionCase(shape, mask, causal, gqa, dropout, "zero", False))
    for shape in ("L=S", "L>S"):
        for mask, policy, gqa, dropout in itertools.product(("bool", "float"), ("zero", "nan", "uniform"), (False, True), (False, True)):
            cases.append(AttentionCase(shape, mask, False, gqa, dropout, policy, True))
    if quick:
        # every option at least once, and each policy with each mask kind
        keep = []
        for c in cases:
            if c.masked_row:
                if not c.gqa and not c.dropout or (c.gqa and c.dropout and c.shape == "L>S"):
                    keep.append(c)
            elif (c.gqa == c.dropout) and (c.causal == (c.mask != "float")):
                keep.append(c)
        cases = keep
    return cases


def make_attention_inputs(case: AttentionCase, seed: int = 0):
    """Small random inputs and fixed options for ``case``."""
    spec = {s[0]: s[1:] for s in _SHAPES}[case.shape]
    bq, bkv, L, S, E, Ev = spec
    Hq, Hkv = (4, 2) if case.gqa else (2, 2)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(bq + (Hq, L, E))
    k = rng.standard_normal(bkv + (Hkv, S, E))
    v = rng.standard_normal(bkv + (Hkv, S, Ev))
    batch = np.broadcast_shapes(bq, bkv)
    opts = {"is_causal": case.causal, "enable_gqa": case.gqa, "fully_masked": case.fully_masked}
    mask = None
    if case.mask == "bool":
        mask = rng.random((Hq, L, S)) < 0.75
        mask[..., 0] = True                 # no row is empty by accident
    elif case.mask == "float":
        mask = rng.standard_normal(batch + (1, L, S))
    if case.masked_row:
        if case.mask == "bool":
            mask[1, 1, :] = False
        else:
            mask = np.broadcast_to(mask, batch + (Hq, L, S)).copy()
            mask[..., 1, 1, :] = -np.inf
    if case.mask == "bool":
        opts["attn_mask"] = mask
    if case.dropout:
        opts["dropout_p"] = 0.3
        opts["dropout_mask"] = rng.random(batch + (Hq, L, S)) >= 0.3
    float_mask = mask if case.mask == "float" else None
    return q, k, v, float_mask, opts


def run_attention_case(case: AttentionCase, *, rtol=CHECK_RTOL, atol=CHECK_ATOL, seed=0) -> CheckResult:
    t0 = time.perf_counter()
    q, k, v, fmask, opts = make_attention_inputs(case, seed)
    if case.fully_masked == "nan":
        return _nan_policy_check(case, q, k, v, fmask, opts, t0, rtol, atol)
    args = (q, k, v) if fmask is None else (q, k, v, fmask)
    fun, vjp = attention_fun_and_vjp(opts)
    rep = check_vjp(fun, vjp, args, mode="full", rtol=rtol, atol=atol)
    return CheckResult(case.name, rep.ok, rep.max_rel_error, rep.max_abs_error,
                       time.perf_counter() - t0, "" if rep.ok else str(rep), rep)


def attention_fun_and_vjp(opts):
    """``fun(q, k, v[, mask])`` and its ``vjp`` through sdpa_forward/backward."""

    def fun(q, k, v, mask=None):
        return sdpa_forward(q, k, v, attn_mask=opts.get("attn_mask", mask), **_rest(opts))[0]

    def vjp(g, q, k, v, mask=None):
        _, res = sdpa_forward(q, k, v, attn_mask=opts.get("attn_mask", mask), **_rest(opts))
        gr = sdpa_backward(res, g)
        return (gr.query, gr.key, gr.value) if mask is None else (gr.query, gr.key, gr.value, gr.attn_mask)

    return fun, vjp


def _rest(opts):
    return {k: v for k, v in opts.items() if k != "attn_mask"}


def _nan_policy_check(case, q, k, v, fmask, opts, t0, rtol, atol):
    """NaN exactly where documented; finite entries equal the checked "zero" policy."""
    mask = opts.get("attn_mask", fmask)
    rest = _rest(opts)
    zero_opts = dict(rest, fully_masked="zero")
    out_nan, r_nan = sdpa_forward(q, k, v, attn_mask=mask, **rest)
    out_zero, r_zero = sdpa_forward(q, k, v, attn_mask=mask, **zero_opts)
    g = np.random.default_rng(1).standard_normal(out_nan.shape)
    gn, gz = sdpa_backward(r_nan, g), sdpa_backward(r_zero, g)
    empty = r_nan.empty[..., 0]                                  # (..., Hq, L)
    problems = []
    if not np.array_equal(np.isnan(out_nan).all(-1), empty) or np.isnan(out_nan[~empty]).any():
        problems.append("output NaN pattern differs from the fully masked rows")
    worst = float(np.max(np.abs(out_nan[~empty] - out_zero[~empty]), initial=0.0))
    dq_nan_rows = np.isnan(gn.query).all(-1)
    if not np.array_equal(dq_nan_rows, np.broadcast_to(empty, dq_nan_rows.shape)):
        problems.append("dq is not NaN exactly on the fully masked rows")
    worst = max(worst, float(np.max(np.abs(gn.query[~dq_nan_rows] - gz.query[~dq_nan_rows]), initial=0.0)))
    if not (np.isnan(gn.key).any() and np.isnan(gn.value).any()):
        problems.append("dk/dv should be poisoned by the NaN row")
    if gn.attn_mask is not None and not np.isnan(gn.attn_mask).any():
        problems.append("d(attn_mask) should be NaN on the fully masked row")
    zero_check = run_attention_case(
        AttentionCase(case.shape, case.mask, case.causal, case.gqa, case.dropout, "zero", True),
        rtol=rtol, atol=atol,
    )
    ok = not problems and worst == 0.0 and zero_check.ok
    detail = "; ".join(problems) or ("" if ok else f"finite part differs by {worst:.3e} or zero-policy check failed")
    return CheckResult(case.name + " (NaN pattern + finite part == zero policy)", ok,
                       zero_check.max_rel_error, max(worst, zero_check.max_abs_error),
                       time.perf_counter() - t0, detail)


def softmax_checks(*, rtol=CHECK_RTOL, atol=CHECK_ATOL) -> List[CheckResult]:
    """VJP and JVP checks of the softmax family along several axes."""
    rng = np.random.default_rng(0)
    results = []
    x = rng.standard_normal((2, 3, 4)) * 3
    for axis in (-1, 0, 1):
        items = [
            ("softmax_vjp", lambda x, a=axis: softmax(x, a),
             lambda g, x, a=axis: (softmax_vjp(softmax(x, a), g, a),), "vjp"),
            ("log_softmax_vjp", lambda x, a=axis: log_softmax(x, a),
             lambda g, x, a=axis: (log_softmax_vjp(log_softmax(x, a), g, a),), "vjp"),
            ("softmax_jvp", lambda x, a=axis: softmax(x, a),
             lambda t, x, a=axis: softmax_jvp(softmax(x, a), t[0], a), "jvp"),
        ]
        for name, fun, d, kind in items:
            t0 = time.perf_counter()
            check = check_vjp if kind == "vjp" else check_jvp
            rep = check(fun, d, (x,), rtol=rtol, atol=atol)
            results.append(CheckResult(f"{name} axis={axis}", rep.ok, rep.max_rel_error, rep.max_abs_error,
                                       time.perf_counter() - t0, "" if rep.ok else str(rep), rep))
    return results


def run_checks(quick: bool = False, progress: Optional[Callable[[int, int, str], None]] = None) -> List[CheckResult]:
    """Run every self-check; ``progress(i, n, name)`` is called before each case."""
    results = softmax_checks()
    cases = attention_cases(quick)
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.name)
        results.append(run_attention_case(case))
    return results
