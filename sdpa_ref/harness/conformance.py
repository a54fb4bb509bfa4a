r"""Judge any attention implementation against the reference, fairly at every dtype.

:func:`check_implementation` runs an implementation over a case suite
(:mod:`sdpa_ref.cases`) at each test dtype and compares its output (and, with
a backward, its gradients) with the reference in float64.

The default rule is FlashAttention's relative rule. Let ``ref64`` be the
reference in float64 and ``naive`` the reference computed in the test dtype
(``upcast=False``: the plain same-dtype implementation). Then a quantity
passes when

.. math::

    \max|impl - ref64| \le k \cdot \max|naive - ref64| + atol_{dtype}

with ``k = 2`` for the output and ``k = 3`` for gradients, and
``atol_dtype = 2 max|fl(fl(ref64 + 0.3) - 0.3) - ref64|``, the rounding of the
output's magnitude in that dtype (FlashAttention's own floor). An
implementation is thus allowed the error of an honest same-precision
computation, no more, and no fixed tolerance has to be guessed per dtype. In
float64 ``naive`` *is* the reference, so the rule reduces to the rounding
floor; judge float64 with :class:`FixedRule` (for example ``rtol = 1e-12``)
or :class:`ULPRule` instead.

NaN must meet NaN: a NaN where the reference has a number (or the reverse)
fails with an infinite error.

An implementation that raises is a failed case (``SystemExit`` included;
only ``KeyboardInterrupt``, the user's own Ctrl-C, stops the run). With
``timeout=SECONDS`` a case (its forward and backward together) that runs
past the limit is a failed case too, and the run goes on.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np

from .._validate import check_tolerance
from ..api import sdpa_backward, sdpa_forward
from ..options import OPTION_NAMES
from ._limits import CaseTimeout, call_with_deadline as _limited
from .cases import Case, get_suite
from .report import ConformanceReport, ConformanceRow

__all__ = ["RelativeRule", "FixedRule", "ULPRule", "ConformanceRow", "ConformanceReport", "CaseTimeout",
           "check_implementation", "resolve_supports"]


# -------------------------------------------------------------------- rules


@dataclass(frozen=True)
class RelativeRule:
    """FlashAttention's rule: ``err <= k * err(naive same-dtype) + atol_dtype``."""

    k_out: float = 2.0
    k_grad: float = 3.0

    name = "relative"

    def __post_init__(self):
        check_tolerance(self.k_out, "k_out")
        check_tolerance(self.k_grad, "k_grad")

    def bound(self, quantity, ref64, naive, dtype):
        k = self.k_out if quantity == "out" else self.k_grad
        return k * _max_abs_diff(naive, ref64) + _rounding_floor(ref64, dtype)

    def describe(self):
        return (f"relative: max|impl-ref64| <= {self.k_out:g} (out) / {self.k_grad:g} (grads) * "
                "max|naive_same_dtype-ref64| + 2*max|fl(fl(ref64+0.3)-0.3)-ref64|")


@dataclass(frozen=True)
class FixedRule:
    """Element-wise ``|impl - ref64| <= atol + rtol * |ref64|``."""

    rtol: float = 1e-12
    atol: float = 1e-12

    name = "fixed"

    def __post_init__(self):
        check_tolerance(self.rtol, "rtol")
        check_tolerance(self.atol, "atol")

    def bound(self, quantity, ref64, naive, dtype):
        return None                      # element-wise; see _judge

    def describe(self):
        return f"fixed: |impl-ref64| <= {self.atol:g} + {self.rtol:g}*|ref64| element-wise"


@dataclass(frozen=True)
class ULPRule:
    """``|impl - ref64| <= max_ulps * spacing(ref64 in the test dtype)``, element-wise."""

    max_ulps: float = 4.0

    name = "ulp"

    def __post_init__(self):
        check_tolerance(self.max_ulps, "max_ulps")

    def bound(self, quantity, ref64, naive, dtype):
        return None

    def describe(self):
        return f"ulp: |impl-ref64| <= {self.max_ulps:g} ulp of ref64 in the test dtype, element-wise"


# ------------------------------------------------------------------ judging


def resolve_supports(forward, supports=None) -> frozenset:
    """``supports`` if given, else ``forward.supports``, else every option."""
    if supports is None:
        supports = getattr(forward, "supports", None)
    if supports is None:
        return frozenset(OPTION_NAMES)
    supports = frozenset(supports)
    unknown = supports - set(OPTION_NAMES)
    if unknown:
        raise ValueError(f"`supports` should name options among {OPTION_NAMES}, but got unknown {sorted(unknown)}")
    return supports


def check_implementation(
    forward: Callable,
    *,
    backward: Optional[Callable] = None,
    supports: Optional[Iterable[str]] = None,
    suite: str = "quick",
    dtypes: Sequence[str] = ("float32",),
    rule=None,
    cases: Optional[Sequence[Case]] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
    timeout: Optional[float] = None,
) -> ConformanceReport:
    r"""Run ``forward`` (and ``backward``) over a case suite and judge them.

    Parameters
    ----------
    forward : callable
        ``forward(query, key, value, **case_options) -> out`` on NumPy arrays
        of the test dtype, with the keyword names of :func:`sdpa_forward`
        (only those the case uses and the implementation supports).
        ``fully_masked`` is passed only on cases where some row has no
        allowed key, so an implementation with one native policy can refuse
        the others. Raising ``NotImplementedError`` marks the case as
        skipped.
    backward : callable, optional
        ``backward(grad_out, query, key, value, **case_options)`` returning
        ``(dq, dk, dv)`` or, for a case with a bias, ``(dq, dk, dv, dbias)``.
    supports : iterable of str, optional
        Option names the implementation understands (see
        :data:`sdpa_ref.OPTION_NAMES`); default ``forward.supports`` or
        all. A case needing another option is skipped, never called.
    suite : {"quick", "full"}
    dtypes : sequence of str
        Test dtypes, e.g. ``("float32", "float16")``.
    rule : RelativeRule, FixedRule or ULPRule, optional
        Default :class:`RelativeRule`.
    cases : sequence of Case, optional
        Overrides ``suite``.
    timeout : float, optional
        Seconds a case may take (forward and backward together, per dtype);
        one that runs past it is a failed case, and the run goes on. Python
        code is interrupted when the limit passes (by ``SIGALRM`` in the main
        thread on POSIX, else by an exception raised asynchronously in the
        calling thread); native code that never returns to Python cannot be
        interrupted, but a call that comes back late still fails.

    Returns
    -------
    ConformanceReport
    """
    rule = RelativeRule() if rule is None else rule
    if timeout is not None:
        check_tolerance(timeout, "timeout")
        if timeout == 0:
            raise ValueError("`timeout` should be a finite number of seconds > 0, or None, but got 0")
    sup = resolve_supports(forward, supports)
    suite_name = suite if cases is None else "custom"
    cases = list(get_suite(suite) if cases is None else cases)
    rows: List[ConformanceRow] = []
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.name)
        missing = case.option_names - sup
        for dt in dtypes:
            dt = np.dtype(dt).name
            if missing:
                rows.append(ConformanceRow(case.name, dt, "all", "skip", note=f"needs {', '.join(sorted(missing))}"))
                continue
            rows.extend(_judge_case(case, dt, forward, backward, rule, sup, timeout))
    return ConformanceReport(rows=rows, rule=rule.describe(), suite=suite_name,
                             seconds=time.perf_counter() - t0, meta={"dtypes": list(dtypes)})


def reference_quantities(case: Case, dtype="float64", *, naive=False):
    """See :func:`_reference_quantities`; each call gets its own copies of the (cached) arrays."""
    return {n: a.copy() for n, a in _reference_quantities(case, np.dtype(dtype).name, naive).items()}


@functools.lru_cache(maxsize=256)
def _reference_quantities(case: Case, dtype="float64", naive=False):
    """The reference's out and grads for ``case``, on its inputs drawn in ``dtype``.

    By default in float64 arithmetic with float64 results (``ref64``); with
    ``naive=True`` computed in ``dtype`` itself (``upcast=False``), the plain
    same-precision implementation of the relative rule. Both with
    ``precision="reproducible"``: the same bits, so the same verdict, on
    every machine. Returns a dict of
    float64 arrays: ``out, dq, dk, dv`` and ``dbias`` with a bias.
    """
    dt = np.dtype(dtype)
    inp = case.make_inputs(dt)
    q, k, v = inp.pop("query"), inp.pop("key"), inp.pop("value")
    if naive:
        out, res = sdpa_forward(q, k, v, upcast=False, precision="reproducible", **inp)
        g = grad_out_for(case, out.shape, dt)
    else:
        q, k, v = (a.astype(np.float64) for a in (q, k, v))
        for n in ("bias", "alibi_slopes"):
            if n in inp:
                inp[n] = np.asarray(inp[n], dtype=np.float64)
        out, res = sdpa_forward(q, k, v, precision="reproducible", **inp)
        g = grad_out_for(case, out.shape, dt).astype(np.float64)
    gr = sdpa_backward(res, g)
    quant = {"out": out, "dq": gr.query, "dk": gr.key, "dv": gr.value}
    if gr.bias is not None:
        quant["dbias"] = gr.bias
    return {n: np.asarray(a, dtype=np.float64) for n, a in quant.items()}


def grad_out_for(case: Case, shape, dtype):
    """The seeded upstream gradient of a case (dtype-free: drawn in float64, then cast)."""
    rng = np.random.default_rng([case.seed, 7, case.L, case.S])
    return rng.standard_normal(shape).astype(dtype)


def _judge_case(case, dt, forward, backward, rule, sup, timeout=None):
    ref64 = reference_quantities(case, dt)     # float64 arithmetic on the test-dtype inputs, kept in float64
    naive = reference_quantities(case, dt, naive=True) if isinstance(rule, RelativeRule) else None
    inp = case.make_inputs(dt)
    q, k, v = inp.pop("query"), inp.pop("key"), inp.pop("value")
    if case.has_fully_masked_rows(dt):
        # the policy matters only where a row has no key: say it explicitly there
        inp["fully_masked"] = case.opts.get("fully_masked", "zero")
    else:
        inp.pop("fully_masked", None)
    if "fully_masked" in inp and "fully_masked" not in sup:
        inp.pop("fully_masked")
    rows = []
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        out = _limited(deadline, forward, q.copy(), k.copy(), v.copy(), **_copy_opts(inp))
    except NotImplementedError as exc:
        return [ConformanceRow(case.name, dt, "all", "skip", note=f"not implemented: {exc}")]
    except KeyboardInterrupt:                              # the user's own Ctrl-C stops the run
        raise
    except BaseException as exc:  # a crash, SystemExit included, is a failure of the case, and the run goes on
        return [ConformanceRow(case.name, dt, "out", "error", note=_what(exc, timeout))]
    got = {"out": out}
    if backward is not None:
        g = grad_out_for(case, ref64["out"].shape, np.dtype(dt))
        try:
            grads = _limited(deadline, backward, g, q.copy(), k.copy(), v.copy(), **_copy_opts(inp))
            names = ["dq", "dk", "dv"] + (["dbias"] if "dbias" in ref64 else [])
            grads = list(grads)
            for n, val in zip(names, grads):
                got[n] = val
            if len(grads) < len(names):
                rows.append(ConformanceRow(case.name, dt, names[len(grads)], "error",
                                           note=f"backward returned {len(grads)} gradients, expected {len(names)}"))
        except NotImplementedError as exc:
            rows.append(ConformanceRow(case.name, dt, "grads", "skip", note=f"not implemented: {exc}"))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            rows.append(ConformanceRow(case.name, dt, "grads", "error", note=_what(exc, timeout)))
    for qty, val in got.items():
        rows.append(_compare(case.name, dt, qty, val, ref64[qty], None if naive is None else naive[qty], rule))
    return rows


def _what(exc, timeout=None):
    if isinstance(exc, CaseTimeout):
        return f"ran past the time limit of {timeout:g} s"
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) raised by the implementation"
    return f"{type(exc).__name__}: {exc}"


def _compare(case, dt, qty, val, ref64, naive, rule):
    try:
        got = np.asarray(val)
    except Exception as exc:
        return ConformanceRow(case, dt, qty, "error", note=f"could not read the result: {exc}")
    if got.shape != ref64.shape:
        return ConformanceRow(case, dt, qty, "error", note=f"shape {got.shape}, expected {ref64.shape}")
    if got.dtype.kind not in "fiu":                        # a complex result would lose its imaginary part
        return ConformanceRow(case, dt, qty, "FAIL", error=float("inf"), allowed=None, ratio=float("inf"),
                              note=f"returned dtype {got.dtype}: attention of real inputs is real")
    note = ""
    if got.dtype != np.dtype(dt):
        note = f"returned dtype {got.dtype}, expected {dt}"
    got = got.astype(np.float64)
    nan_ref, nan_got = np.isnan(ref64), np.isnan(got)
    if not np.array_equal(nan_ref, nan_got):
        idx = tuple(int(i) for i in np.argwhere(nan_ref != nan_got)[0])
        return ConformanceRow(case, dt, qty, "FAIL", error=float("inf"), allowed=None, ratio=float("inf"),
                              worst_index=idx, impl_value=float(got[idx]), ref_value=float(ref64[idx]),
                              note=("NaN where the reference has a number" if nan_got[idx]
                                    else "a number where the reference has NaN") + (f"; {note}" if note else ""))
    fin = ~nan_ref
    diff = np.where(fin, np.abs(got - ref64), 0.0)
    if isinstance(rule, RelativeRule):
        allowed = rule.bound(qty, np.where(fin, ref64, 0.0), np.where(fin, naive, 0.0), np.dtype(dt))
        err = float(diff.max(initial=0.0))
        ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else float("inf"))
        flat = int(np.argmax(diff)) if diff.size else 0
    else:
        if isinstance(rule, FixedRule):
            tol = rule.atol + rule.rtol * np.abs(ref64)
        else:
            tol = rule.max_ulps * np.spacing(np.abs(ref64).astype(np.dtype(dt))).astype(np.float64)
        tol = np.where(fin, tol, 1.0)
        r = diff / tol
        flat = int(np.argmax(r)) if r.size else 0
        ratio = float(r.flat[flat]) if r.size else 0.0
        err = float(diff.flat[flat]) if diff.size else 0.0
        allowed = float(tol.flat[flat]) if diff.size else 0.0
    idx = tuple(int(i) for i in np.unravel_index(flat, diff.shape)) if diff.size else ()
    status = "pass" if ratio <= 1.0 else "FAIL"
    return ConformanceRow(case, dt, qty, status, error=err, allowed=allowed, ratio=ratio, worst_index=idx,
                          impl_value=float(got.flat[flat]) if diff.size else None,
                          ref_value=float(ref64.flat[flat]) if diff.size else None, note=note)


def _max_abs_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


def _rounding_floor(ref64, dtype):
    """FlashAttention's floor: twice the rounding of ``|ref| + 0.3`` in the test dtype."""
    r = np.asarray(ref64, dtype=np.float64).astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        back = ((r + dtype.type(0.3)) - dtype.type(0.3)).astype(np.float64)
    return 2.0 * float(np.max(np.abs(back - r.astype(np.float64)), initial=0.0))


def _copy_opts(inp):
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inp.items()}
