"""The suite's tolerances, each named once with the error analysis it rests on.

A test reads ``assert_allclose(got, want, rtol=F64_SUMS, atol=F64_REGROUPED)`` and the reason for each number
is here. Units: ``u = 2**-53`` is float64's unit roundoff and ``EPS64 = 2 u = 2**-52 ~ 2.2e-16`` its machine
epsilon (one ulp of 1); ``u32 = 2**-24 ~ 6e-8`` is float32's. A sum of ``n`` terms in any order is within
``(n - 1) u sum|terms|`` of the exact sum; ``exp``, ``log`` and ``log1p`` are good to about an ulp. Shapes in
the suite are small: ``S, E <= 64`` unless a test says otherwise.

The float64 tiers below are relative tolerances. Used as an ``atol``, a tier means the same number of ulps of 1:
the floor for an entry that cancels to about 0 while its terms are O(1) (the suite's inputs are standard normal
or hypothesis floats scaled to O(1)). A pair such as ``rtol=F64_GRAD, atol=F64_SUMS`` reads: relative error at
the gradients' tier, and entries that cancel keep the forward sums' absolute error.

The constants are exactly the values the tests used before they were named; none was loosened or tightened.
"""

import numpy as np

EPS64 = float(np.finfo(np.float64).eps)    # 2**-52, one ulp of 1

# ------------------------------------------------------------------ bits and ulps

EXACT = 0                # bit for bit; as an atol: no absolute floor, so the comparison is relative only
F64_SUB_ULP = 1e-16      # a closed form that is 0 (softmax's VJP of ones): 1 - sum(p) over 3 entries is an
                         # ulp or two of 1; with max p = 0.66 the worst case is ~3e-16, so this is tighter than
                         # the bound and holds for the test's one fixed row
F64_ONE_ULP = 2.3e-16    # one correctly rounded division by a rounded constant (lse / log 2): <= u + u = EPS64,
                         # rounded up
F64_TWO_ULP = 4.5e-16    # a conversion there and back: two F64_ONE_ULP steps
DD_CANCEL_RATIO = 2.0 ** 45  # SEMANTICS.md's exemption from faithful rounding: a precision="reproducible" result
                             # whose terms are more than this many times larger than itself (cancellation)
DD_CANCELLED = 2.0 ** -90    # such a result's error relative to the sum of its terms' magnitudes: the double-double
                             # arithmetic's ~2**-100 (exp, log, a few adds) with a factor of 1000 to spare
F64_FEW_ULP = 1e-15      # ~4.5 EPS64: a closed form a handful of roundings away (a mean of <= 4 values, one exp
                         # or log, entropies of hand-picked rows, exact powers of two), or the same arithmetic on a
                         # batch sliced or broadcast differently (matmul may block a batch differently)

# ------------------------------------------------------------------ float64 forward and backward

F64_REGROUPED = 1e-14    # ~45 EPS64: the same sums regrouped, on rows of S <= 8 (a batch loop against one call,
                         # GQA against repeated keys, ALiBi against its bias, merged log-sum-exps, a plain
                         # softmax(q k^T / sqrt E) @ v, the fast engine against the plain one normwise):
                         # (S + E + 4) u ~ 2e-15, x5
F64_SUMS = 1e-13         # ~450 EPS64: float64 forward results whose S-term row sums and E-term dots run in
                         # another order (another schedule or engine, scipy, mpmath, a plain formula, the
                         # complex-step derivative at h = 1e-30, which has no truncation and no cancellation):
                         # (S + E + 4) u ~ 7e-15 for S, E <= 64, x14
F64_AMPLIFIED = 1e-12    # ~4500 EPS64: float64 forward where the rounding is amplified or the sums are long:
                         # against the loop oracle on hypothesis problems (scores up to |30|, so exp's relative
                         # error 30 u per score), logits shifted by |c| <= 100 (x + c rounds by 100 u absolute),
                         # rows of S ~ 10**3 (S u ~ 1e-13), a division by a small sigma (layer norm), a norm
                         # against an explicit matrix, split partials merged through exp(lse_i - lse)
F64_GRAD = 1e-12         # backward, JVP and HVP of one formula in two schedules or layouts (and float64 peers'
                         # backward; with the forward where one check covers both): dS = P * (dP - delta) cancels,
                         # so the forward's F64_SUMS grows about x10
F64_GRAD_LONG = 1e-11    # gradients summed over KV splits, JVPs on rows of S ~ 10**3, tangents of tangents
                         # (second order): F64_GRAD with one more accumulation or differentiation, x10
F64_GRAD_ORACLE = 1e-10  # gradients against an independent route (the loop oracle with sinks, JAX's and torch's
                         # own second order): F64_GRAD on top of F64_AMPLIFIED's amplification, x100
UNDERFLOW_ATOL = 1e-300  # an explicit "no floor" for probabilities: with logits in [-30, 30] every probability
                         # is >= exp(-60) ~ 9e-27, so 1e-300 never decides and the comparison stays relative

# ------------------------------------------------------------------ finite differences and the complex step

FD = 1e-7                # central differences at h = eps**(1/3) ~ 6e-6: truncation h**2/6 |f'''| ~ 6e-12 plus
                         # rounding u |f| / h ~ 2e-11 per entry, i.e. ~3e-11 absolute on O(1) data; 1e-7 relative
                         # holds for entries down to ~1e-3 of the largest (the package's checkers default to
                         # rtol 1e-6, atol 1e-9: these tests ask for a digit more)
FD_ATOL = 1e-9           # the absolute floor of a central difference at that step on O(1) data: ~3e-11 x30
FD_ATOL_SMOOTH = 1e-10   # the same for softmax of O(1) logits (|f'''| <= 1, |f| <= 1): ~3e-11 x3
FD_LOOSE = 1e-6          # a hand-rolled central difference at h = 1e-6 (rounding u |f| / h ~ 1e-10 per entry,
                         # relative ~1e-6 on entries ~1e-4), checks of score_mod's table VJP by central
                         # differences, and two checks' reported error estimates (themselves central-difference
                         # residuals, ~1e-10 computed in another order: they agree to ~6 digits)
FD_LOOSE_ATOL = 1e-8     # the absolute floor of a central difference at h = 1e-6: u |f| / h ~ 1e-10, x100
FD_SECOND_ORDER = 1e-5   # central differences of a backward (the JVP of a VJP, the HVP): the differentiated
                         # function is itself a cancelling sum, so FD's ~1e-7 loses another ~2 digits
COMPLEX_STEP = 1e-12     # the complex step (h = 1e-30 or 1e-20): no truncation (h**2 ~ 1e-60) and no
                         # cancellation, so the derivative carries the complex forward's rounding at the
                         # gradients' tier, F64_GRAD
COMPLEX_STEP_ATOL = 1e-14   # its absolute floor on O(1) data: F64_REGROUPED's count of ulps
COMPLEX_STEP_IMAG_ATOL = 1e-36  # imaginary parts of size ~h = 1e-20: 1e-16 of that, an ulp of their scale
COMPLEX_FORWARD_NORMWISE = 16 * EPS64  # sdpa_forward_complex's real part against 50-digit mpmath, relative to the
                                       # largest output entry: measured up to 6.5 ulps over 440 problems (dominant
                                       # keys, scores ~100, softcap, causal), x2.5
COMPLEX_STEP_NORMWISE = 256 * EPS64    # its complex-step derivative Im / h, relative to the largest: measured up
                                       # to 120 ulps there (the forward's error amplified by the softmax's
                                       # derivative), x2

# ------------------------------------------------------------------ low precision

F32 = 1e-6               # float32 results a few roundings from their float64 value: inputs rounded to float32
                         # (complex64 keys) through an E-term dot, or a uniform row's mean: ~8 u32 ~ 5e-7
F32_ATOL = 1e-7          # its absolute floor on O(1) data: ~2 u32
F32_SCHEDULES = 1e-5     # float32 results of one formula in two schedules: (S + E + 4) u32 ~ 1e-6 for small
                         # shapes, x10 (the float32 twin of F64_GRAD)

# ------------------------------------------------------------------ models of an approximation

BIG_NEGATIVE_MASK = 1e-6     # an additive -1e9 "mask" in float64: s - 1e9 rounds s to a multiple of
                             # ulp(1e9) = 1.2e-7, so each score moves by <= 6e-8 and the output by ~1e-7, x10
SOFTCAP_LIMIT = 1e-10        # softcap c = 1e6 against no softcap: c tanh(s / c) = s - s**3 / (3 c**2) + ...;
                             # |s| <= ~4 moves scores by <= 2e-11, the output by ~2e-11 relative, x5; as an atol
                             # it is the gradients' floor
SOFTCAP_LIMIT_ATOL = 1e-11   # the forward's absolute floor: the scores' shift itself, 2e-11, rounded down
                             # (the test's seed keeps it below)
SOFTCAP_LIMIT_GRAD = 1e-9    # the gradients of the same: the backward's cancellation, x10
ADAM_EPS_TERM = 1e-6         # Adam's first step is lr g / (|g| + eps) = lr sign(g) (1 - eps / |g|) with
                             # eps = 1e-8 and |g| >= 0.5: <= 2e-8 of the step, so ~2e-9 of the parameter, x500
