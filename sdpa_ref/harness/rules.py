"""The conformance rules: when an implementation's error is small enough (see :mod:`.conformance`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._validate import check_tolerance
from .lowp import ulp

__all__ = ["FixedRule", "RelativeRule", "ULPRule", "as_rule", "lean", "returned_rounding", "rms_error",
           "rounding_floor"]

#: The fewest finite reference entries on which the spread (RMS) is judged: below it one entry dominates the
#: mean, and the largest error, judged anyway, is the better test.
RMS_MIN_ENTRIES = 256


# -------------------------------------------------------------------- rules


@dataclass(frozen=True)
class RelativeRule:
    """``err <= max(k * err(honest ensemble) + atol_dtype, rounding(dtype))``: FlashAttention's form, with a fair
    baseline and never below the returned dtype's own rounding.

    ``err(honest ensemble)`` is the largest ``max|member - ref64|`` over the
    honest same-precision computations of :mod:`.ensemble` (dense with the
    scale on the scores, on q, on k or its square root on both, the plain
    path, online softmax in blocks of 16 and 64, an exp off by 32 ulp), computed in a fixed order without the
    BLAS: the same bits on every machine. ``atol_dtype`` is FlashAttention's
    floor, twice the rounding of ``|ref| + 0.3`` in the test dtype.

    The factors come from ``benchmarks/calibrate_rule.py``: over 200 random
    problems with scores of about +-50, the largest ``err / err(ensemble)``
    of ten honest NumPy kernels (:data:`.specimens.HONEST`) was 1.93 for the
    output and 2.28 for the gradients in float32 (the exp off by 20 ulp; 1.89
    / 2.03 without it), 1.17 / 1.12 in float16 and 1.00 / 1.00 in bfloat16,
    and every one passed on every problem. ``k = 3`` leaves a margin of 1.3
    over the worst of them, while the mutants of :mod:`.specimens` land at 2
    to 10^6 times the allowance where their bug is visible in the dtype. In
    float16 and bfloat16 the specimens round like the ensemble's members
    (same formulas; after rounding to the dtype the BLAS's sums rarely
    differ), so there the calibration says little by itself: PyTorch's CPU
    kernels judged through the adapter are the independent check
    (docs/guide-frameworks.md).

    **The lean.** The largest error cannot see a kernel that is one ulp off
    everywhere in the same direction: in bfloat16 that moves the worst
    element by 1.3 ulp, inside the honest kernels' own 3 or more (they round
    ``P`` before ``P V``). An average can: with ``judge_lean`` (the default)
    a quantity also fails when its :func:`lean` ``beta`` (the systematic
    error in ulps of the reference, fitted over every element) is past
    ``1/2 + k * max|beta(member)| + 4 * se``. Half an ulp is as far as any
    rounding of a correct result leans, even a directed one (truncation);
    ``k`` times the ensemble's own lean is the same fair baseline as above;
    ``4 * se`` (the fit's standard error, estimated from the spread of the
    implementation's own row sums) keeps a noisy but unbiased kernel from
    failing by chance, so the test says nothing on small cases. Over the
    quick and full suites in all six dtypes the honest specimens reach at
    most 0.41 of this bound, and a correctly rounded bfloat16 output moved
    up one ulp is caught on the S = 128 cases (``beta = 0.99-1.00`` against
    bounds of 0.60-0.79; ``tests/test_harness_cases.py``).

    **The spread (RMS).** Nor can the largest error see a small error of
    either sign spread over every element: a 1% error in the scale moves a
    causal bfloat16 output by about bfloat16's own rounding of it, so its
    worst element stays at 1.6 to 2.9 times the ensemble's worst (under the
    ``k = 3``), the gradients' at 1.6 to 6.7. Its root mean square does not
    hide: over shapes ``(2, 3, 24, 16)`` to ``(2, 8, 256, 64)``, two seeds
    each, a float32 kernel with the 1% error has 2.8 to 3.5 times the
    ensemble's largest RMS error on ``out`` and 2.8 to 5.2 on the
    gradients, while honest kernels, FlashAttention's rounding of ``P`` and
    ``dS`` to bfloat16 included, stay at 0.45 to 1.00. With ``judge_rms``
    (what :mod:`sdpa_ref.testing` judges; off in the harness's suites, whose
    quantities mostly have fewer entries) a quantity of at least
    :data:`RMS_MIN_ENTRIES` finite entries also fails when
    :func:`rms_error` is past :meth:`rms_bound`, ``k_rms = 2`` times the
    ensemble's largest.

    **The floor: the returned dtype's own rounding.** Whatever the
    ensemble errs by, the allowance is at least :func:`returned_rounding`,
    ``ulp_dt(M) / 2 + ulp_64(M)`` with ``M = max|ref64|`` over the finite
    entries and ``dt`` the dtype the quantity is returned in (the output
    dtype for ``out``, the gradients and the JVP, bfloat16 at fp8; the work
    dtype, float32 below float64, for the LSE and ``dsinks``), so that the
    exact value rounded to ``dt`` always passes. The derivation, for one
    entry with exact value ``x``: rounding to nearest gives
    ``|fl_dt(x) - x| <= ulp_dt(x) / 2`` (``ulp_dt`` the spacing of ``dt`` in
    ``x``'s binade, the subnormal spacing below the normal range; a value
    just under a power of two that rounds up to it is within half the lower
    spacing). ``ref64`` is faithful (``precision="reproducible"``): one of
    the two float64 neighbours of ``x``, so ``|x - ref64| <= ulp_64(ref64)``.
    And ``ulp_dt(x) <= ulp_dt(ref64)`` unless a power of two ``p`` lies in
    ``(|ref64|, |x|]``; ``p`` is a float64, so then ``p = |x|`` (else
    ``ref64`` would not be a neighbour), and ``x`` is a ``dt`` value that
    rounds with no error. Hence ``|fl_dt(x) - ref64| <= ulp_dt(ref64) / 2 +
    ulp_64(ref64)``, and as ``ulp`` grows with ``|.|`` every entry is within
    the value at ``M``. (A kernel that rounds ``ref64`` instead of ``x`` is
    within ``ulp_dt(M) / 2``.) Values beyond ``dt``'s largest finite value
    overflow and are outside it. The lean needs no floor: every
    ``|e_i| <= u_i / 2`` gives ``|beta| <= 1/2``. The honest members return
    their results in the same dtypes, so each member's error is at least the
    correctly rounded one entry by entry and ``k >= 1`` covers it on every
    case of the suites; the floor makes it hold by itself, for any ``k``:
    with ``k = 0`` it is the whole allowance, and the correctly rounded
    kernel passes the full suite at float16, bfloat16, float32 and both fp8
    (``tests/test_harness_rules.py``), where the ensemble's term alone
    fails it on 11 to 15 of the quick suite's rows per dtype (the LSE, whose
    ``atol_dtype`` can be 0 -- ``x + 0.3 - 0.3`` exact, as for ``1000.5`` in
    float16 -- and dk, dv, the JVP by up to 1.9 times). With ``k = 3`` the
    floor sets the allowance on 3 to 6 of the quick suite's 248-297 rows per
    dtype: where every member is exact (zero gradients, dV on the one key)
    and the ensemble's term is 0, and at float64 on one output whose
    ensemble term (3.5e-18) is below a float64 ulp of it. An LSE *held* in float16
    (rounded to it, then returned in float32) is not a correctly rounded
    float32 LSE: its floor is float32's, and it fails where the honest
    kernels' own LSE is more accurate than float16's rounding (10 of 49
    quick rows at float16, by up to 79 times); a backward that recomputes
    ``P`` from it fails dV on the large logits (2.4 times).
    """

    k_out: float = 3.0
    k_grad: float = 3.0
    judge_lean: bool = True
    judge_rms: bool = False
    k_rms: float = 2.0

    name = "relative"

    def __post_init__(self):
        check_tolerance(self.k_out, "k_out")
        check_tolerance(self.k_grad, "k_grad")
        check_tolerance(self.k_rms, "k_rms")
        for name in ("judge_lean", "judge_rms"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"`{name}` should be a bool, but got {type(getattr(self, name)).__name__}")

    def lean_bound(self, quantity, honest_lean, se):
        """How far :func:`lean`'s ``beta`` may go, in ulps; inf where the lean is not judged."""
        if not self.judge_lean or honest_lean is None:
            return float("inf")
        k = self.k_out if quantity in ("out", "lse") else self.k_grad
        return 0.5 + k * honest_lean + 4.0 * se

    def rms_bound(self, ref64, honest_rms, dtype):
        """How far :func:`rms_error` may go: ``k_rms`` times the honest ensemble's largest RMS error, never below
        the RMS over the entries of the returned dtype's own rounding, ``ulp_dt(ref64) / 2 + ulp_64(ref64)``
        (the floor of :meth:`bound`, entry by entry, so a correctly rounded result always passes); inf where the
        spread is not judged (``judge_rms`` False, no ensemble, or fewer than :data:`RMS_MIN_ENTRIES` finite
        entries)."""
        ref = np.asarray(ref64, np.float64)
        fin = np.isfinite(ref)
        if not self.judge_rms or honest_rms is None or int(fin.sum()) < RMS_MIN_ENTRIES:
            return float("inf")
        r = np.where(fin, ref, 0.0)[fin]
        floor = float(np.sqrt(np.mean(np.square(ulp(r, dtype) / 2 + ulp(r, np.float64)))))
        return max(self.k_rms * honest_rms, floor)

    def bound(self, quantity, ref64, honest_err, dtype):
        """The allowance of ``max|impl - ref64|`` for ``quantity`` returned in ``dtype``: ``k * honest_err +
        atol_dtype``, and never below :func:`returned_rounding`."""
        k = self.k_out if quantity in ("out", "lse") else self.k_grad
        return max(k * honest_err + rounding_floor(ref64, dtype), returned_rounding(ref64, dtype))

    def describe(self):
        text = (f"relative: max|impl-ref64| <= max({self.k_out:g} (out) / {self.k_grad:g} (grads) * "
                "max|honest_ensemble-ref64| + 2*max|fl(fl(ref64+0.3)-0.3)-ref64|, ulp(M)/2 + ulp64(M)), "
                "M = max|ref64|, ulp in the returned dtype")
        if self.judge_lean:
            text += "; lean: |beta| <= 1/2 + k * max|beta(honest_ensemble)| + 4 se, in ulps"
        if self.judge_rms:
            text += (f"; spread: rms|impl-ref64| <= max({self.k_rms:g} * max rms|honest_ensemble-ref64|, "
                     f"rms(ulp(ref64)/2 + ulp64(ref64))), on {RMS_MIN_ENTRIES} or more entries")
        return text


@dataclass(frozen=True)
class FixedRule:
    """Element-wise ``|impl - ref64| <= atol + rtol * |ref64|``."""

    rtol: float = 1e-12
    atol: float = 1e-12

    name = "fixed"

    def __post_init__(self):
        check_tolerance(self.rtol, "rtol")
        check_tolerance(self.atol, "atol")

    def bound(self, quantity, ref64, honest_err, dtype):
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

    def bound(self, quantity, ref64, honest_err, dtype):
        return None

    def describe(self):
        return f"ulp: |impl-ref64| <= {self.max_ulps:g} ulp of ref64 in the test dtype, element-wise"


def rms_error(got, ref64):
    """The root mean square of ``got - ref64`` over the entries where ``ref64`` is finite (0 with none); a NaN
    or infinite ``got`` there makes it inf."""
    ref = np.asarray(ref64, np.float64)
    fin = np.isfinite(ref)
    if not fin.any():
        return 0.0
    with np.errstate(all="ignore"):
        d = np.asarray(got, np.float64)[fin] - ref[fin]
        m = float(np.mean(np.square(d)))
    return float("inf") if not np.isfinite(m) else float(np.sqrt(m))


def as_rule(rule):
    """A rule object from ``None`` (relative), a name (``"relative"``, ``"fixed"``, ``"ulp"``, with their
    defaults) or a rule object."""
    if rule is None:
        return RelativeRule()
    if isinstance(rule, str):
        made = {"relative": RelativeRule, "fixed": FixedRule, "ulp": ULPRule}.get(rule)
        if made is None:
            raise ValueError(f"`rule` should be 'relative', 'fixed', 'ulp' or a rule object, but got {rule!r}")
        return made()
    if not isinstance(rule, (RelativeRule, FixedRule, ULPRule)):
        raise TypeError(f"`rule` should be 'relative', 'fixed', 'ulp' or a RelativeRule, FixedRule or ULPRule, "
                        f"but got {type(rule).__name__}")
    return rule


def lean(got, ref64, dtype):
    r"""How far ``got`` leans from ``ref64`` on average, in ulps of ``ref64`` in ``dtype``: ``(beta, se)``.

    ``beta`` is the least-squares fit of ``got - ref64 = beta * u`` with
    ``u = ulp(ref64)`` over the entries where ``ref64`` is a number:

    .. math:: \beta = \frac{\sum_i e_i u_i}{\sum_i u_i^2}, \qquad e_i = got_i - ref64_i .

    A kernel one ulp too high everywhere has ``beta = 1`` whatever else it
    gets wrong at random; an honest one has ``beta`` near 0. Entries whose
    reference is tiny next to the rest carry little weight (``u_i`` is
    small), so the absolute errors kernels make there (cancellation) cannot
    dominate, as they do in a plain mean of ``e_i / u_i``. ``se`` is the
    standard error of ``beta``, estimated from the spread of the row sums
    ``sum_j e_ij u_ij`` (a row is the last axis: errors within a row share
    the softmax's normaliser, rows are closer to independent); inf with one
    row or none.
    """
    ref = np.asarray(ref64, np.float64)
    fin = ~np.isnan(ref)
    u = np.where(fin, ulp(np.where(fin, ref, 0.0), dtype), 0.0)
    top = float(u.max(initial=0.0))
    if top == 0.0 or not np.isfinite(top):
        return 0.0, float("inf")
    u = u / top                                   # in units of the largest ulp: no underflow of u * u
    with np.errstate(all="ignore"):
        eu = np.where(fin, np.asarray(got, np.float64) - np.where(fin, ref, 0.0), 0.0) * u
        rows = eu.reshape(-1, eu.shape[-1]).sum(axis=1) if eu.ndim else eu.reshape(1)
        uu = float(np.sum(u * u)) * top
        beta = float(rows.sum()) / uu
        n = rows.size
        se = float(np.sqrt(n / (n - 1) * np.sum((rows - rows.mean()) ** 2))) / uu if n > 1 else float("inf")
    if not (np.isfinite(beta) and np.isfinite(se)):
        return 0.0, float("inf")                  # an overflowing error: the largest error judges it
    return beta, se


def returned_rounding(ref64, dtype):
    """The largest error of the exact values rounded to ``dtype`` against their faithful ``ref64``:
    ``ulp_dtype(M) / 2 + ulp_float64(M)``, ``M`` the largest finite ``|ref64|`` (0 when there is none). The
    relative rule's allowance is never below it; the derivation is :class:`RelativeRule`'s."""
    ref = np.abs(np.asarray(ref64, dtype=np.float64))
    m = float(np.max(np.where(np.isfinite(ref), ref, 0.0), initial=0.0))
    if ref.size == 0 or not np.any(np.isfinite(ref)):
        return 0.0
    return float(ulp(m, dtype)) / 2 + float(np.spacing(m))


def rounding_floor(ref64, dtype):
    """FlashAttention's floor: twice the rounding of ``|ref| + 0.3`` in the test dtype."""
    r = np.asarray(ref64, dtype=np.float64).astype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        back = ((r + dtype.type(0.3)) - dtype.type(0.3)).astype(np.float64)
    return 2.0 * float(np.max(np.abs(back - r.astype(np.float64)), initial=0.0))
