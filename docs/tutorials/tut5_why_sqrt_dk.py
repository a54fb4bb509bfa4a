r"""
Why divide by sqrt(d_k)
=======================

Scaled dot-product attention computes
:math:`\operatorname{softmax}(QK^T/\sqrt{d_k})\,V`. The classic explanation of
the :math:`1/\sqrt{d_k}` comes as a handful of claims: the variance of
:math:`q \cdot k` grows like :math:`d_k`; a worked example in which 45 and 2
become 5.625 and 0.25; an unscaled top weight that "is often > 0.9
(saturated)"; gradients that "vanish". This page turns each claim into a figure computed
while the site is built, checks it (a claim that stops holding fails the
build), and says where the claim is weaker than it sounds.

Nothing here is a number measured once and copied into the text: the page
prints what this build's run computed, and every statistical check is made
with a confidence interval, so that it tests the claim and not the last
digits of one run (which move with the machine and the seed).
"""

import math

import matplotlib.pyplot as plt
import numpy as np

import sdpa_ref
from sdpa_ref.diagnostics import normalized_entropy, softmax_jacobian_norm, sweep


def z_two_sided(level):
    """The normal ``z`` with ``P(|Z| > z) = 1 - level``, by bisection on :func:`math.erfc` (no scipy)."""
    lo, hi = 0.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if math.erfc(mid / math.sqrt(2)) > 1 - level else (lo, mid)
    return 0.5 * (lo + hi)


def wilson_interval(successes, n, z):
    """Wilson score interval for a binomial proportion."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def median_interval(x, z):
    """Distribution-free confidence interval for the median, from order statistics."""
    x = np.sort(np.ravel(x))
    n = x.size
    lo = max(int(math.floor(n / 2 - z * math.sqrt(n) / 2)), 0)
    hi = min(int(math.ceil(n / 2 + z * math.sqrt(n) / 2)), n - 1)
    return float(x[lo]), float(x[hi])


def check(ok, claim):
    """Fail the build when a claim does not hold; print it when it does."""
    if not ok:
        raise AssertionError("claim does not hold: " + claim)
    print("  checked:", claim)


Z = z_two_sided(0.999)          # one interval at 99.9%
print(f"z for a two-sided 99.9% interval: {Z:.3f}")

# %%
# 1. The variance of :math:`q \cdot k` grows like :math:`d_k`
# -----------------------------------------------------------
#
# Take :math:`q, k \in \mathbb{R}^{d_k}` with independent components of mean
# 0 and variance 1. Then :math:`q \cdot k = \sum_{i=1}^{d_k} q_i k_i` is a sum
# of :math:`d_k` independent products, each of mean
# :math:`\mathbb{E}[q_i]\,\mathbb{E}[k_i] = 0` and variance
#
# .. math::
#
#    \operatorname{Var}(q_i k_i) = \mathbb{E}[q_i^2 k_i^2] - 0^2
#    = \mathbb{E}[q_i^2]\,\mathbb{E}[k_i^2] = 1 .
#
# Variances of independent terms add, so
#
# .. math::
#
#    \operatorname{Var}(q \cdot k) = d_k, \qquad
#    \operatorname{Var}\!\left(\frac{q \cdot k}{\sqrt{d_k}}\right)
#    = \frac{d_k}{d_k} = 1 .
#
# The score's standard deviation is :math:`\sqrt{d_k}` unscaled (8 at
# :math:`d_k = 64`, 32 at :math:`d_k = 1024`) and 1 after scaling, whatever
# :math:`d_k` is.
#
# Below, for each :math:`d_k` from 4 to 1024, ``N_PAIRS`` independent pairs of
# standard normal vectors estimate the variance. Its confidence interval comes
# from the sample fourth moment (the standard error of a sample variance is
# :math:`\sqrt{(m_4 - s^4)/N}`), not from a fixed tolerance. There are 18
# intervals, so each is widened (Bonferroni) to keep the chance that *any* of
# them misses a true theory below 0.1%.

D_KS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
N_PAIRS = 20000
Z_FAMILY = z_two_sided(1 - 0.001 / (2 * len(D_KS)))

variance = {"none": [], "sqrt": []}          # (estimate, standard error) per d_k
misses = []                                  # intervals that miss the theory or are too wide
dots_at_64 = None
print(f"{'d_k':>5} {'Var(q.k)':>10} {'CI':>21}   {'Var(q.k / sqrt(d_k))':>20} {'CI':>17}")
for d_k in D_KS:
    rng = np.random.default_rng([5, d_k])
    dots = np.concatenate([                 # in 4 chunks, to keep the memory small at d_k = 1024
        np.einsum("nd,nd->n", rng.standard_normal((m, d_k)), rng.standard_normal((m, d_k)))
        for m in np.diff(np.linspace(0, N_PAIRS, 5).astype(int))
    ])
    if d_k == 64:
        dots_at_64 = dots
    line = f"{d_k:>5}"
    for name, x, theory in (("none", dots, float(d_k)), ("sqrt", dots / math.sqrt(d_k), 1.0)):
        c = x - x.mean()
        var = float(np.mean(c**2))
        se = float(np.sqrt((np.mean(c**4) - var**2) / x.size))
        variance[name].append((var, se))
        lo, hi = var - Z_FAMILY * se, var + Z_FAMILY * se
        if not (lo <= theory <= hi and Z_FAMILY * se < 0.1 * theory):
            misses.append(f"d_k = {d_k}, scale {name}: theory {theory:g}, CI [{lo:.4g}, {hi:.4g}]")
        if name == "none":
            line += f" {var:>10.2f} [{lo:>8.2f}, {hi:>8.2f}]   "
        else:
            line += f" {var:>20.4f} [{lo:.4f}, {hi:.4f}]"
    print(line)
check(not misses,
      f"all {2 * len(D_KS)} intervals (z = {Z_FAMILY:.2f}, family level 99.9%) contain the theory, "
      "Var(q.k) = d_k and 1 after dividing by sqrt(d_k), each with a half-width under 10% of it"
      + "".join("\n    MISSED: " + m for m in misses))

fig, ax = plt.subplots(figsize=(6.4, 4.2))
d = np.array(D_KS, dtype=float)
ax.loglog(d, d, color="C0", lw=1, label=r"theory $d_k$")
ax.loglog(d, np.ones_like(d), color="C1", lw=1, label="theory 1")
for name, color, label in (("none", "C0", r"$q\cdot k$ (unscaled)"),
                           ("sqrt", "C1", r"$q\cdot k/\sqrt{d_k}$")):
    v, se = np.array(variance[name]).T
    ax.errorbar(d, v, yerr=Z_FAMILY * se, fmt="o", ms=4, color=color, capsize=3, label=label)
ax.set_xscale("log", base=2)
ax.set_xlabel(r"$d_k$")
ax.set_ylabel("variance of the score")
ax.set_title(f"Var(q.k) over {N_PAIRS} pairs per $d_k$ (bars: 99.9% family CI)")
ax.legend()
fig.tight_layout()

# %%
# .. admonition:: Caveat
#
#    The derivation needs components that are independent, of mean 0 and of
#    variance 1. That is roughly the situation at initialization, not that of
#    the learned queries and keys of a trained model, whose components are
#    correlated and whose scale the training sets. The :math:`1/\sqrt{d_k}`
#    makes the score scale independent of :math:`d_k` at the start; nothing in
#    it keeps the scores at variance 1 afterwards.

# %%
# 2. The worked example: 45 and 2 at :math:`d_k = 64`
# ---------------------------------------------------
#
# The notes take :math:`d_k = 64`, so :math:`\sqrt{d_k} = 8`, and two raw scores
# 45 and 2, which become :math:`45/8 = 5.625` and :math:`2/8 = 0.25`. Unscaled,
# the softmax of the pair is one-hot in every digit a double holds: the second
# weight is :math:`e^{-43}/(1 + e^{-43})`, about :math:`2 \times 10^{-19}`, and
# the first rounds to exactly 1.

d_k = 64
raw = np.array([45.0, 2.0])
scaled = raw / math.sqrt(d_k)
print(f"sqrt({d_k}) = {math.sqrt(d_k)}; (45, 2) / 8 = ({scaled[0]}, {scaled[1]})")
np.testing.assert_array_equal(scaled, [5.625, 0.25])     # exact in binary floating point

p_raw, p_scaled = sdpa_ref.softmax(raw), sdpa_ref.softmax(scaled)
print(f"softmax(45, 2)        = ({float(p_raw[0])!r}, {p_raw[1]:.2e})")
print(f"softmax(5.625, 0.25)  = ({p_scaled[0]:.4f}, {p_scaled[1]:.4f})")
np.testing.assert_allclose(p_raw[1], math.exp(-43) / (1 + math.exp(-43)), rtol=1e-12)
np.testing.assert_array_equal(p_raw[0], 1.0)
np.testing.assert_allclose(p_scaled[0], 1 / (1 + math.exp(-5.375)), rtol=1e-14)
np.testing.assert_allclose(p_scaled, [0.9954, 0.0046], atol=5e-5)   # the digits the notes quote

# %%
# .. admonition:: Caveat: 45 is not a typical score, and 5.625 still saturates
#
#    With unit-variance :math:`q` and :math:`k` the unscaled score has standard
#    deviation :math:`\sqrt{64} = 8`, so 45 is :math:`45/8 = 5.625` standard
#    deviations out: an outlier, not the typical score the example suggests.
#    Under the normal approximation (the score is a sum of 64 products) the
#    chance of :math:`|q \cdot k| \ge 45` is
#    :math:`\operatorname{erfc}(5.625/\sqrt{2})`, computed below with
#    :func:`math.erfc` (and compared with scipy where it is installed).
#
#    The normal approximation understates this tail. For Gaussian :math:`q` and
#    :math:`k`, :math:`q \cdot k` given :math:`q` is normal with variance
#    :math:`\lVert q \rVert^2 \sim \chi^2_{64}`, so the exact probability is
#    :math:`\mathbb{E}\bigl[\operatorname{erfc}(45/\sqrt{2 R})\bigr]` over
#    :math:`R \sim \chi^2_{64}`: heavier by an order of magnitude, and still
#    below one in a million. (The integral is checked against the pairs of
#    section 1 at a threshold that a sample can reach.)
#
#    And the scaled pair is still nearly saturated: softmax(5.625, 0.25) puts
#    more than 99% on the first key. Scaling does not make the softmax soft for
#    such an outlier; what it does is make *typical* scores :math:`O(1)`, so a
#    typical pair of keys shares the weight.

sigmas = 45 / math.sqrt(d_k)
tail_normal = math.erfc(sigmas / math.sqrt(2))
print(f"45 is {sigmas} standard deviations at d_k = {d_k}")
print(f"P(|q.k| >= 45), normal approximation: {tail_normal:.3e} "
      f"(about 1 in {1 / tail_normal:,.0f})")
try:
    from scipy.stats import norm
except ImportError:
    print("  (scipy is not installed: no cross-check)")
else:
    np.testing.assert_allclose(2 * norm.sf(sigmas), tail_normal, rtol=1e-10)
    print("  scipy.stats.norm agrees")


def tail_gaussian_dot(x, d_k, n=20000):
    r"""P(|q.k| >= x) for q, k ~ N(0, I): E[erfc(x / sqrt(2 R))], R ~ chi^2_{d_k} (midpoint rule)."""
    r_max = d_k + 60 * math.sqrt(2 * d_k)
    r = (np.arange(n) + 0.5) * (r_max / n)
    log_pdf = (d_k / 2 - 1) * np.log(r) - r / 2 - (d_k / 2) * math.log(2) - math.lgamma(d_k / 2)
    erfc = np.array([math.erfc(x / math.sqrt(2 * ri)) for ri in r])
    return float(np.sum(np.exp(log_pdf) * erfc) * (r_max / n))


tail_exact = tail_gaussian_dot(45.0, d_k)
print(f"P(|q.k| >= 45), Gaussian q and k exactly: {tail_exact:.3e}  "
      f"({tail_exact / tail_normal:.1f} times the normal approximation)")

# the integral against the 20000 pairs of section 1, at two standard deviations
threshold = 2 * math.sqrt(d_k)
hits = int(np.sum(np.abs(dots_at_64) >= threshold))
lo, hi = wilson_interval(hits, dots_at_64.size, Z)
predicted = tail_gaussian_dot(threshold, d_k)
print(f"P(|q.k| >= {threshold:g}): integral {predicted:.4f}, sampled {hits / dots_at_64.size:.4f} "
      f"(99.9% CI {lo:.4f}-{hi:.4f})")
check(lo <= predicted <= hi, "the tail integral agrees with the sampled pairs at 2 std")
check(3 < tail_exact / tail_normal < 30 and tail_exact < 1e-6,
      "the exact tail at 45 is an order of magnitude above the normal one, and below 1e-6")
check(p_scaled[0] > 0.99, "softmax(5.625, 0.25) still puts more than 99% on one key")

# %%
# What a *typical* pair looks like at :math:`d_k = 64`: draw one query and two
# keys many times and take the top weight of the softmax of the two scores.

rng = np.random.default_rng(64)
n_draws = 20000
q = rng.standard_normal((n_draws, d_k))
k = rng.standard_normal((n_draws, 2, d_k))
pair_scores = np.einsum("nd,njd->nj", q, k)
top_pair = {name: sdpa_ref.softmax(pair_scores * s).max(axis=-1)
            for name, s in (("none", 1.0), ("sqrt", 1 / math.sqrt(d_k)))}
for name, t in top_pair.items():
    lo, hi = median_interval(t, Z)
    print(f"two keys, scale {name:>4}: median top weight {np.median(t):.4f} "
          f"(99.9% CI {lo:.4f}-{hi:.4f})")
lo, hi = median_interval(top_pair["sqrt"], Z)
check(0.6 < lo and hi < 0.85,
      "scaled, a typical pair of keys shares the weight (median top weight 0.6-0.85)")
lo, hi = median_interval(top_pair["none"], Z)
check(lo > 0.99, "unscaled, even a typical pair is nearly one-hot (median top weight above 0.99)")

# %%
# 3. Saturation at :math:`d_k = 128` with 50 keys
# -----------------------------------------------
#
# The notes' saturation demo (:math:`d_k = 128`, 50 keys) says, word for word:
# "The unscaled top weight is often > 0.9 (saturated); the scaled top weight
# is typically 0.05-0.2 (useful)." Each draw below is one query and 50 fresh
# keys, all standard normal; the histogram shows the top softmax weight,
# unscaled and scaled, and the lines printed under the code are the measured
# share and median that the claim is held to.

D_K_SAT, N_KEYS, N_SAT = 128, 50, 2000
rng = np.random.default_rng(128)
q = rng.standard_normal((N_SAT, D_K_SAT))
k = rng.standard_normal((N_SAT, N_KEYS, D_K_SAT))
scores = np.einsum("nd,njd->nj", q, k)
top_raw = sdpa_ref.softmax(scores).max(axis=-1)
top_scaled = sdpa_ref.softmax(scores / math.sqrt(D_K_SAT)).max(axis=-1)

n_sat = int(np.sum(top_raw > 0.9))
sat_lo, sat_hi = wilson_interval(n_sat, N_SAT, Z)
med_lo, med_hi = median_interval(top_scaled, Z)
in_band = float(np.mean((top_scaled >= 0.05) & (top_scaled <= 0.2)))
print(f"d_k = {D_K_SAT}, {N_KEYS} keys, {N_SAT} draws")
print(f"  unscaled: top weight > 0.9 in {n_sat / N_SAT:.1%} (99.9% CI {sat_lo:.1%}-{sat_hi:.1%}); "
      f"median top weight {np.median(top_raw):.3f}")
print(f"  scaled:   median top weight {np.median(top_scaled):.3f} "
      f"(99.9% CI {med_lo:.3f}-{med_hi:.3f}); "
      f"{in_band:.1%} of draws inside 0.05-0.2")
check(sat_lo > 0.5, "'often > 0.9': a majority of the unscaled rows put more than 0.9 on one key")
check(sat_hi < 0.75, "... and 'often' is the word: not almost all of them (the share is below 75%)")
check(0.05 < med_lo and med_hi < 0.2, "scaled, the median top weight lies inside 0.05-0.2")

fig, ax = plt.subplots(figsize=(6.4, 4.0))
bins = np.linspace(0, 1, 51)
ax.axvspan(0.05, 0.2, color="C1", alpha=0.12, label="the notes' 0.05-0.2")
ax.hist(top_raw, bins=bins, color="C0", alpha=0.7, label="unscaled")
ax.hist(top_scaled, bins=bins, color="C1", alpha=0.7, label=r"scaled by $1/\sqrt{d_k}$")
ax.axvline(0.9, color="k", ls="--", lw=1, label="0.9")
ax.set_xlabel("top softmax weight of a row")
ax.set_ylabel("draws")
ax.set_title(f"$d_k$ = {D_K_SAT}, {N_KEYS} keys, {N_SAT} draws")
ax.legend(loc="upper center")
fig.tight_layout()

# %%
# .. admonition:: Caveat: "often" means a majority, not almost all
#
#    A top weight above 0.9 needs the best key to beat the runner-up by at
#    least :math:`\ln 9 \approx 2.2` (if :math:`p_1 > 0.9` then
#    :math:`p_2 < 0.1`, and :math:`p_1/p_2 = e^{s_1 - s_2}`). Among 50 scores of
#    standard deviation :math:`\sqrt{128} \approx 11.3` the two largest are
#    often closer than that, and then the row splits its weight however large
#    the scores are. So the unscaled softmax is nearly one-hot in a majority of
#    rows, as "often" says, and visibly short of almost all of them; the
#    histogram's unscaled mass below 0.9 is mostly those near ties.

top2 = np.sort(scores, axis=-1)[:, -2:]
gap = top2[:, 1] - top2[:, 0]
close = gap <= math.log(9)
if not np.all(top_raw[close] <= 0.9):
    raise AssertionError("a row whose two best scores are within ln 9 has a top weight above 0.9")
n_close, n_unsat = int(close.sum()), N_SAT - n_sat
lo, hi = wilson_interval(n_close, n_unsat, Z)
print(f"two best raw scores within ln 9 of each other: {close.mean():.1%} of draws, "
      f"{n_close / n_unsat:.0%} of the rows with top weight <= 0.9 (99.9% CI {lo:.0%}-{hi:.0%}); "
      f"median gap {np.median(gap):.2f}")
check(lo > 0.5, "most unsaturated unscaled rows are near ties of the two best keys")

# %%
# 4. Entropy and gradient norms against :math:`d_k`
# -------------------------------------------------
#
# :func:`sdpa_ref.diagnostics.sweep` runs the reference's forward and backward
# for each :math:`d_k` and each of three scalings (none, :math:`1/\sqrt{d_k}`,
# :math:`1/d_k`) on independent problems of 32 queries and 50 keys, and
# reports per-row means with standard errors over the problems: 256 problems
# up to :math:`d_k = 64`, where the gradient's rise and fall have to be told
# apart from noise, and 64 beyond (a problem's draws do not depend on which
# other :math:`d_k` are swept, so the two sweeps join). One measure of the
# softmax and two of the gradient:
#
# * the **normalized entropy** of a row of :math:`P` (1 for uniform, 0 for
#   one-hot);
# * the norm of a row of :math:`dT`, the gradient at the **scores**
#   :math:`T = \text{scale}\cdot QK^T`, which is the upstream
#   :math:`dP` passed through the softmax Jacobian
#   :math:`\operatorname{diag}(p) - p p^T`;
# * the norm of a row of :math:`dQ`, the gradient reaching the **query**.

TRIALS = 64
rows = (sweep([d for d in D_KS if d <= 64], trials=4 * TRIALS, n_keys=50, n_queries=32)
        + sweep([d for d in D_KS if d > 64], trials=TRIALS, n_keys=50, n_queries=32))
SCALINGS = (("none", "no scaling"), ("sqrt", r"$1/\sqrt{d_k}$"), ("linear", r"$1/d_k$"))


def series(metric, scale):
    """(d_k, mean, standard error) of one metric along the sweep, for one scaling."""
    sel = [r for r in rows if r.scale == scale]
    return (np.array([r.d_k for r in sel]),
            np.array([getattr(r, metric) for r in sel]),
            np.array([getattr(r, metric + "_stderr") for r in sel]))


print(f"{'d_k':>5}"
      + "".join(f" {'H/log n ' + s:>16}" for s, _ in SCALINGS)
      + "".join(f" {'|dT| ' + s:>12}" for s, _ in SCALINGS)
      + "".join(f" {'|dQ| ' + s:>12}" for s, _ in SCALINGS))
for i, d_k in enumerate(D_KS):
    line = f"{d_k:>5}"
    for metric, width, fmt in (("normalized_entropy", 16, ".4f"), ("grad_norm_scores", 12, ".3f"),
                               ("grad_norm_query", 12, ".3f")):
        line += "".join(f" {series(metric, s)[1][i]:>{width}{fmt}}" for s, _ in SCALINGS)
    print(line)

fig, ax = plt.subplots(figsize=(6.4, 4.0))
for (scale, label), color in zip(SCALINGS, ("C0", "C1", "C2")):
    x, y, se = series("normalized_entropy", scale)
    ax.errorbar(x, y, yerr=Z * se, fmt="o-", ms=4, capsize=3, color=color, label=label)
ax.set_xscale("log", base=2)
ax.set_ylim(0, 1.05)
ax.set_xlabel(r"$d_k$")
ax.set_ylabel("normalized entropy of a row of P")
ax.set_title("1 = uniform over the 50 keys, 0 = one-hot")
ax.legend()
fig.tight_layout()

# %%
# Without scaling the entropy falls toward 0 (rows go one-hot). With
# :math:`1/\sqrt{d_k}` it is flat, at a level that is neither one-hot nor
# uniform. With :math:`1/d_k` the scores shrink like :math:`1/\sqrt{d_k}` and
# the rows drift toward uniform, the opposite failure: attention that cannot
# pick anything.

x, h_none, se_none = series("normalized_entropy", "none")
_, h_sqrt, _ = series("normalized_entropy", "sqrt")
x_lin, h_lin, se_lin = series("normalized_entropy", "linear")
steps = range(len(x) - 1)
check(all(h_none[i + 1] < h_none[i] + Z * math.hypot(se_none[i], se_none[i + 1]) for i in steps)
      and h_none[-1] < 0.2 * h_none[0],
      "unscaled, the entropy never rises, and falls more than fivefold from d_k = 4 to 1024")
check(np.ptp(h_sqrt) < 0.02 and np.all((h_sqrt > 0.7) & (h_sqrt < 0.95)),
      "with 1/sqrt(d_k) the entropy is flat (spread < 0.02), neither one-hot nor uniform (0.7-0.95)")
check(all(h_lin[i + 1] > h_lin[i] - Z * math.hypot(se_lin[i], se_lin[i + 1]) for i in steps)
      and np.all(h_lin[x >= 64] > 0.99),
      "with 1/d_k the entropy never falls, and is above 0.99 (near uniform) from d_k = 64 on")

fig, axes = plt.subplots(1, 2, figsize=(10, 4.0))
for ax, metric, title in zip(axes, ("grad_norm_scores", "grad_norm_query"),
                             (r"at the scores: $\|dT_{i,:}\|$", r"at the query: $\|dQ_{i,:}\|$")):
    for (scale, label), color in zip(SCALINGS, ("C0", "C1", "C2")):
        xs, y, se = series(metric, scale)
        ax.errorbar(xs, y, yerr=Z * se, fmt="o-", ms=4, capsize=3, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(r"$d_k$")
    ax.set_title("gradient norm " + title)
axes[0].set_ylim(bottom=0)
axes[1].set_yscale("log")
axes[0].set_ylabel("mean norm of a row")
axes[0].legend()
fig.tight_layout()

# %%
# .. admonition:: Caveat: what "vanishes", and from where
#
#    Without scaling, the gradient **at the scores** does fall as :math:`d_k`
#    grows, but only past a certain :math:`d_k`: it first *rises*, from
#    :math:`d_k = 4` to a maximum at 8 or 16, then falls. The softmax Jacobian
#    explains it. Its Frobenius norm is 0 for a one-hot row, small for a
#    near-uniform row over many keys, and largest for two equal weights; as
#    :math:`d_k` grows the unscaled rows pass from spread-out, through a few
#    competing keys, to one-hot.
#
#    And the gradient **reaching the query** does not vanish: it *grows*.
#    :math:`dQ = \text{scale}\cdot dT\,K`, and the rows of :math:`K` have norm
#    about :math:`\sqrt{d_k}`, which outgrows the shrinking :math:`dT`. What
#    saturation kills is the *information* in the gradient (it flows through
#    the one or two keys that hold the weight, so :math:`q` learns only about
#    those), not its size. With :math:`1/d_k`, :math:`dQ` shrinks like
#    :math:`1/\sqrt{d_k}`.

xs, g_none, gse_none = series("grad_norm_scores", "none")
_, g_sqrt, _ = series("grad_norm_scores", "sqrt")
peak = int(np.argmax(g_none))
print(f"unscaled |dT| is largest at d_k = {xs[peak]} ({g_none[peak]:.3f} +- {gse_none[peak]:.3f}); "
      f"at d_k = {xs[0]}: {g_none[0]:.3f}, at d_k = {xs[-1]}: {g_none[-1]:.3f}")
below_peak = g_none[peak] - g_none > Z * np.hypot(gse_none[peak], gse_none)
check(xs[peak] in (8, 16) and np.all(below_peak[~np.isin(xs, (8, 16))]),
      "unscaled |dT| peaks at d_k = 8 or 16; every other d_k is below the peak beyond its 99.9% CI")
check(g_none[1] - g_none[0] > Z * math.hypot(gse_none[0], gse_none[1]),
      "unscaled |dT| rises from d_k = 4 to d_k = 8")
check(g_none[-1] < 0.5 * g_none[peak] and g_none[-1] < 0.5 * g_sqrt[-1],
      "past the peak it falls: at d_k = 1024, under half its peak and half the scaled value")
check(np.ptp(g_sqrt) < 0.15 * g_sqrt.mean(), "with 1/sqrt(d_k), |dT| is flat (spread < 15% of its mean)")

_, q_none, qse_none = series("grad_norm_query", "none")
_, q_sqrt, _ = series("grad_norm_query", "sqrt")
_, q_lin, _ = series("grad_norm_query", "linear")
check(q_none[-1] - 2 * q_none[0] > Z * math.hypot(qse_none[-1], 2 * qse_none[0]),
      "unscaled, |dQ| grows: more than twice as large at d_k = 1024 as at d_k = 4")
check(np.ptp(q_sqrt) < 0.15 * q_sqrt.mean(), "with 1/sqrt(d_k), |dQ| is flat (spread < 15% of its mean)")
q_lin_rescaled = q_lin * np.sqrt(xs)
check(np.ptp(q_lin_rescaled) < 0.15 * q_lin_rescaled.mean(),
      "with 1/d_k, |dQ| * sqrt(d_k) is flat: |dQ| shrinks like 1/sqrt(d_k)")

# the same sweep, the other measurement of section 3
sat = next(r for r in rows if r.scale == "none" and r.d_k == D_K_SAT)
print(f"sweep at d_k = {D_K_SAT}, unscaled: top weight > 0.9 in {sat.saturated_fraction:.1%} "
      f"(+- {sat.saturated_fraction_stderr:.1%}); section 3 measured {n_sat / N_SAT:.1%}")
share = n_sat / N_SAT
check(abs(sat.saturated_fraction - share)
      < Z * math.hypot(sat.saturated_fraction_stderr, math.sqrt(share * (1 - share) / N_SAT)),
      "the sweep's saturated share at d_k = 128 agrees with section 3's")

# %%
# The two facts behind the caveat, checked on the package itself: the
# backward's :math:`dQ` is :math:`\text{scale}\cdot dT\,K` (the gradient at
# the scores is the one for an all-zero additive mask, since the mask is added
# to the scores), and the Jacobian's norm is 0 one-hot, largest at two equal
# weights, small when uniform over 50 keys.

rng = np.random.default_rng(4)
q, k = rng.standard_normal((32, 256)), rng.standard_normal((50, 256))
v, g_out = rng.standard_normal((50, 16)), rng.standard_normal((32, 16))
for scale in (1.0, 1 / 16):
    _, res = sdpa_ref.sdpa_forward(q, k, v, np.zeros((32, 50)), scale=scale)
    grads = sdpa_ref.sdpa_backward(res, g_out)
    np.testing.assert_allclose(grads.query, scale * grads.attn_mask @ k, rtol=1e-10, atol=1e-12)
print("dQ = scale * dT @ K holds for the backward, scaled and unscaled")

examples = {"one-hot": np.eye(50)[0], "two equal weights": np.r_[0.5, 0.5, np.zeros(48)],
            "uniform over 50": np.full(50, 1 / 50)}
jac = {name: float(softmax_jacobian_norm(p)) for name, p in examples.items()}
for name, p in examples.items():
    np.testing.assert_allclose(jac[name], np.linalg.norm(sdpa_ref.softmax_jacobian(p)), atol=1e-15)
    print(f"  |diag(p) - p p^T|_F, {name:>17}: {jac[name]:.4f}")
check(jac["one-hot"] == 0 and jac["two equal weights"] > jac["uniform over 50"] > 0,
      "the Jacobian's norm is 0 one-hot and larger at two equal weights than uniform")

# %%
# "Information, not size" in one number: how many keys a row of :math:`dT`
# reaches. The participation ratio :math:`(\sum_j |dT_{ij}|)^2 / \sum_j
# dT_{ij}^2` is 1 when one key gets all of the gradient and 50 when all keys
# get the same. At :math:`d_k = 256`, over 64 independent problems:

D_K_INFO = 256
pr = {"none": [], "sqrt": []}
for t in range(TRIALS):
    rng = np.random.default_rng([256, t])
    q, k = rng.standard_normal((32, D_K_INFO)), rng.standard_normal((50, D_K_INFO))
    v, g_out = rng.standard_normal((50, 32)), rng.standard_normal((32, 32))
    for name, scale in (("none", 1.0), ("sqrt", 1 / math.sqrt(D_K_INFO))):
        _, res = sdpa_ref.sdpa_forward(q, k, v, np.zeros((32, 50)), scale=scale)
        dT = sdpa_ref.sdpa_backward(res, g_out).attn_mask
        pr[name].append(float(np.mean(np.abs(dT).sum(-1) ** 2 / (dT**2).sum(-1))))
for name in pr:
    a = np.array(pr[name])
    se = a.std(ddof=1) / math.sqrt(a.size)
    print(f"  scale {name:>4}: a row of dT reaches {a.mean():.2f} keys (+- {se:.2f})")
pr_none, pr_sqrt = np.array(pr["none"]), np.array(pr["sqrt"])
check(pr_sqrt.mean() - 2 * pr_none.mean()
      > Z * math.hypot(pr_sqrt.std(ddof=1), 2 * pr_none.std(ddof=1)) / math.sqrt(TRIALS),
      f"at d_k = {D_K_INFO}, the scaled dT reaches more than twice as many keys as the unscaled one")

# %%
# 5. What it looks like: one attention matrix, unscaled and scaled
# ----------------------------------------------------------------
#
# One draw of :math:`L = S = 16` queries and keys at :math:`d_k = 128`, the
# same :math:`Q` and :math:`K` on both sides; each row of :math:`P` sums to 1.
# Unscaled, most rows are a single bright cell; scaled, each row spreads its
# weight over several keys without going uniform. It is one draw, picked for nothing: the histogram
# of section 3 is the distribution it comes from.

L = S = 16
rng = np.random.default_rng(16)
q, k, v = rng.standard_normal((L, 128)), rng.standard_normal((S, 128)), rng.standard_normal((S, 8))
P = {}
for name, scale in (("none", 1.0), ("sqrt", 1 / math.sqrt(128))):
    _, res = sdpa_ref.sdpa_forward(q, k, v, scale=scale)
    P[name] = res.probs.reshape(L, S)
    t = scale * q @ k.T
    e = np.exp(t - t.max(axis=1, keepdims=True))
    np.testing.assert_allclose(P[name], e / e.sum(axis=1, keepdims=True), rtol=1e-12, atol=1e-300)
    print(f"scale {name:>4}: mean top weight {P[name].max(axis=1).mean():.3f}, "
          f"mean normalized entropy {normalized_entropy(P[name]).mean():.3f}")
check(P["none"].max(axis=1).mean() > P["sqrt"].max(axis=1).mean()
      and normalized_entropy(P["none"]).mean() < normalized_entropy(P["sqrt"]).mean(),
      "in this draw the unscaled rows are more peaked than the scaled ones")
check(np.mean(P["none"].max(axis=1) > 0.5) > 0.5,
      "unscaled, most rows of this draw put more than half their weight on one key")
check(0.1 < P["sqrt"].max(axis=1).mean() < 0.5,
      f"the scaled rows are not uniform either (a uniform row's top weight is 1/{S} = {1 / S:.4f})")

fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), layout="constrained")
for ax, (name, title) in zip(axes, (("none", "unscaled: softmax$(QK^T)$"),
                                    ("sqrt", r"scaled: softmax$(QK^T/\sqrt{d_k})$"))):
    im = ax.imshow(P[name], vmin=0, vmax=1, cmap="viridis")
    ax.set_title(title)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
fig.colorbar(im, ax=axes, shrink=0.85, label="attention weight $P_{ij}$")

# %%
# 6. What the copy task says
# --------------------------
#
# The notes' last argument is a training run: a small Transformer learns to
# copy a sequence, with and without the scaling. Single runs of it move with
# rounding (a different machine, or a different summation order, shifts the
# step at which one run crosses an accuracy threshold), so a number from one
# run is not the answer. The answer is stated over seeds, with its spread, on
# :ref:`the copy task over seeds <sphx_glr_auto_examples_copy_task.py>`.
