r"""
Softmax and its Jacobian
========================

The softmax turns a vector of scores (logits) into a probability
distribution. This page defines it, computes it without overflow, derives its
Jacobian in index notation, and from the Jacobian the vector-Jacobian product
(VJP) that every backward pass through attention uses. It also shows why the
element-wise rule :math:`p(1-p)`, borrowed from the sigmoid, is **not** the
softmax's derivative. Every formula is checked against finite differences and
against :mod:`sdpa_ref` while the page is built, so a wrong formula here fails
the build.
"""

import matplotlib.pyplot as plt
import numpy as np

import sdpa_ref

rng = np.random.default_rng(0)
n = 5
z = rng.standard_normal(n)              # a row of logits
print("z =", np.array2string(z, precision=4))

# %%
# The definition
# --------------
#
# For logits :math:`z \in \mathbb{R}^n`,
#
# .. math::
#
#    p_i = \operatorname{softmax}(z)_i = \frac{e^{z_i}}{\sum_{k=1}^{n} e^{z_k}},
#    \qquad i = 1, \dots, n.
#
# Every :math:`p_i` is positive and :math:`\sum_i p_i = 1`. Written directly:


def softmax_naive(z):
    e = np.exp(z)
    return e / e.sum()


p = softmax_naive(z)
print("p =", np.array2string(p, precision=4), "  sum =", p.sum())
np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-14)
np.testing.assert_allclose(p, sdpa_ref.softmax(z), rtol=1e-14)

# %%
# Computing it stably: subtract the maximum
# -----------------------------------------
#
# The direct form overflows as soon as a logit passes about 709, where
# :math:`e^{z}` exceeds the largest float64. Attention scores that large are
# rare, but in float16 the limit is about 11, and unscaled scores reach that
# easily. With logits near 1000 the naive form computes
# :math:`\infty / \infty`, which is NaN:

z_big = np.array([1000.0, 999.0, 990.0])
with np.errstate(over="ignore", invalid="ignore"):     # the overflow is the point here
    p_naive = softmax_naive(z_big)
print("naive :", p_naive)
if not np.all(np.isnan(p_naive)):
    raise AssertionError(f"expected the naive softmax to overflow to NaN, got {p_naive}")

# %%
# Adding the same constant :math:`c` to every logit changes nothing, because
# :math:`e^{c}` cancels between numerator and denominator:
#
# .. math::
#
#    \frac{e^{z_i - c}}{\sum_k e^{z_k - c}}
#    = \frac{e^{-c}\, e^{z_i}}{e^{-c} \sum_k e^{z_k}} = p_i .
#
# Taking :math:`c = m = \max_k z_k` makes every exponent :math:`\le 0`, so
# nothing overflows. The largest term is exactly :math:`e^0 = 1`, so the sum
# lies in :math:`[1, n]` and cannot underflow to 0. This is what
# :func:`sdpa_ref.softmax` does.


def softmax_stable(z):
    e = np.exp(z - z.max())
    return e / e.sum()


p_stable = softmax_stable(z_big)
print("stable:", p_stable)
print("sdpa_ref.softmax:", sdpa_ref.softmax(z_big))
np.testing.assert_allclose(p_stable, sdpa_ref.softmax(z_big), rtol=1e-14)
np.testing.assert_allclose(p_stable, softmax_naive(z_big - 990.0), rtol=1e-14)   # the same numbers, shifted
np.testing.assert_allclose(p_stable.sum(), 1.0, rtol=1e-14)

# %%
# It must be the maximum: the shift by the mean or by the minimum still
# overflows when the logits are far apart. With the maximum, the only thing
# that can happen to a term is an underflow to 0, and a term that small
# (:math:`e^{-2000}` here) carries no probability anyway:

z_wide = np.array([1000.0, 0.0, -1000.0])
with np.errstate(over="ignore", invalid="ignore"):
    p_by_mean = softmax_naive(z_wide - z_wide.mean())
print("shift by the mean:", p_by_mean)
print("shift by the max :", softmax_stable(z_wide))
if not np.isnan(p_by_mean).any():
    raise AssertionError(f"expected the shift by the mean to overflow to NaN here, got {p_by_mean}")
np.testing.assert_array_equal(softmax_stable(z_wide), [1.0, 0.0, 0.0])
np.testing.assert_array_equal(sdpa_ref.softmax(z_wide), [1.0, 0.0, 0.0])

# %%
# The Jacobian, in index notation
# -------------------------------
#
# Write :math:`s = \sum_k e^{z_k}`, so :math:`p_i = e^{z_i} / s`, and note
# :math:`\partial e^{z_i} / \partial z_j = \delta_{ij} e^{z_i}` and
# :math:`\partial s / \partial z_j = e^{z_j}`. The quotient rule gives
#
# .. math::
#
#    \frac{\partial p_i}{\partial z_j}
#    = \frac{\delta_{ij} e^{z_i}}{s} - \frac{e^{z_i} e^{z_j}}{s^2}
#    = p_i \delta_{ij} - p_i p_j
#    = p_i (\delta_{ij} - p_j),
#
# or, as a matrix with :math:`J_{ij} = \partial p_i / \partial z_j`,
#
# .. math::
#
#    J = \operatorname{diag}(p) - p\, p^{\top}.
#
# The diagonal is :math:`p_i (1 - p_i)`; the off-diagonal entries are
# :math:`-p_i p_j`, negative: raising one logit takes probability from every
# other entry. We build :math:`J` from the formula and compare it with
# :func:`sdpa_ref.softmax_jacobian`, and with a central finite-difference
# Jacobian, :math:`J_{:, j} \approx (p(z + h e_j) - p(z - h e_j)) / 2h`,
# written out here:

J = np.diag(p) - np.outer(p, p)


def fd_jacobian(f, z, h=1e-6):
    """Central differences, one column per input entry: J[:, j] = (f(z + h e_j) - f(z - h e_j)) / 2h."""
    cols = []
    for j in range(z.size):
        e = np.zeros_like(z)
        e[j] = h
        cols.append((f(z + e) - f(z - e)) / (2 * h))
    return np.stack(cols, axis=1)


J_num = fd_jacobian(sdpa_ref.softmax, z)
J_lib = sdpa_ref.softmax_jacobian(p)
print("J =\n", np.array2string(J, precision=4, suppress_small=True))
print(f"max |J - J_lib| = {np.abs(J - J_lib).max():.1e}   (the same formula: rounding only)")
print(f"max |J - J_num| = {np.abs(J - J_num).max():.1e}   (finite differences: expect about 1e-10)")
np.testing.assert_allclose(J_lib, J, rtol=1e-14, atol=1e-16)
np.testing.assert_allclose(J_num, J, rtol=1e-6, atol=1e-8)

# %%
# The difference quotient agrees to about ten digits, not sixteen: central
# differences carry a truncation error of order :math:`h^2` and a rounding
# error of order :math:`\epsilon / h` (:math:`\epsilon \approx 2\times
# 10^{-16}`); with :math:`h = 10^{-6}` both are far below the tolerance of
# :math:`10^{-8}` used here, and far below the size of any real mistake.
#
# From the Jacobian to the VJP
# ----------------------------
#
# A backward pass never forms :math:`J`. It receives the gradient of the loss
# with respect to the output, :math:`g = \partial \mathcal{L} / \partial p`,
# and returns the gradient with respect to the input, by the chain rule
#
# .. math::
#
#    \frac{\partial \mathcal{L}}{\partial z_j}
#    = \sum_i \frac{\partial \mathcal{L}}{\partial p_i}
#      \frac{\partial p_i}{\partial z_j}
#    = \sum_i g_i\, p_i (\delta_{ij} - p_j)
#    = p_j g_j - p_j \sum_i p_i g_i ,
#
# that is :math:`dz = J^{\top} g`. :math:`J` is symmetric
# (:math:`p_i(\delta_{ij} - p_j) = p_j(\delta_{ji} - p_i)`), so
# :math:`J^{\top} g = J g` and
#
# .. math::
#
#    dz = p \odot \big(g - \langle g, p \rangle\big),
#    \qquad \langle g, p \rangle = \sum_i g_i p_i .
#
# :math:`O(n)` work instead of the :math:`O(n^2)` of forming :math:`J`. We
# compare it with :math:`J^{\top} g` and with :func:`sdpa_ref.softmax_vjp`.
# The cotangent :math:`g` is random, never all ones: the VJP of ones is 0
# (see below), which would hide almost any error.

g = rng.standard_normal(n)
dz = p * (g - np.dot(g, p))
print("dz            =", np.array2string(dz, precision=6))
print("J^T g         =", np.array2string(J.T @ g, precision=6))
print("softmax_vjp   =", np.array2string(sdpa_ref.softmax_vjp(p, g), precision=6))
np.testing.assert_allclose(J, J.T, rtol=0, atol=0)              # symmetric, exactly
np.testing.assert_allclose(dz, J.T @ g, rtol=1e-12, atol=1e-15)
np.testing.assert_allclose(sdpa_ref.softmax_vjp(p, g), dz, rtol=1e-12, atol=1e-15)
np.testing.assert_allclose(J_num.T @ g, dz, rtol=1e-6, atol=1e-8)

# %%
# The diagonal-only VJP is wrong
# ------------------------------
#
# The sigmoid :math:`\sigma(x)` acts on each entry alone, its Jacobian is
# diagonal, and its VJP is the familiar element-wise
# :math:`g \odot \sigma (1 - \sigma)`. Carried over to the softmax, that rule
# reads
#
# .. math::
#
#    dz^{\text{diag}} = p \odot (1 - p) \odot g ,
#
# which keeps only the diagonal of :math:`J`. The missing part is every
# off-diagonal term :math:`-p_i p_j`:
#
# .. math::
#
#    dz_j - dz^{\text{diag}}_j = -p_j \sum_{i \ne j} p_i g_i ,
#
# which is 0 only when the other entries carry no probability (a one-hot
# :math:`p`) or their :math:`g_i` all vanish. In every other case the softmax
# couples the entries: raising :math:`z_j` lowers every other :math:`p_i`,
# and the diagonal rule forgets that.
#
# :func:`sdpa_ref.check_vjp` compares a VJP with finite differences of the
# function, entry by entry. It passes the right VJP and catches the
# diagonal one:


def vjp_right(g, z):
    return sdpa_ref.softmax_vjp(sdpa_ref.softmax(z), g)


def vjp_diagonal(g, z):                 # WRONG: the element-wise rule of the sigmoid
    p = sdpa_ref.softmax(z)
    return p * (1 - p) * g


rep_right = sdpa_ref.check_vjp(sdpa_ref.softmax, vjp_right, (z,))
rep_diag = sdpa_ref.check_vjp(sdpa_ref.softmax, vjp_diagonal, (z,))
print(rep_right)
print()
print(rep_diag)
if not rep_right.ok:
    raise AssertionError(f"the right softmax VJP should pass check_vjp:\n{rep_right}")
if rep_diag.ok:
    raise AssertionError(f"check_vjp should catch the diagonal-only VJP:\n{rep_diag}")

# %%
# The right VJP agrees to a relative error far below the checker's
# tolerance of :math:`10^{-6}`. The full check builds the whole analytic
# Jacobian from the VJP (one one-hot cotangent per output) and compares it
# with the numeric one: for the diagonal VJP exactly the :math:`n(n-1)`
# off-diagonal entries fail, each with the largest relative error the
# checker's symmetric measure can give, 1 (the analytic entry is 0 where the
# true one is :math:`-p_i p_j`). The :math:`n` diagonal entries pass. The
# difference between the two VJPs is exactly the off-diagonal sum above:

failed = rep_diag.per_arg[0]["failed"]
print(f"entries failed: {failed} of {n * n}  (off-diagonal: {n * (n - 1)})")
if failed != n * (n - 1):
    raise AssertionError(f"expected the {n * (n - 1)} off-diagonal entries to fail, got {failed}")
missing = -p * (np.dot(p, g) - p * g)               # -p_j sum_{i != j} p_i g_i
np.testing.assert_allclose(dz - vjp_diagonal(g, z), missing, rtol=1e-12, atol=1e-15)
print("dz - dz_diag           =", np.array2string(dz - vjp_diagonal(g, z), precision=6))
print("-p_j sum_{i!=j} p_i g_i =", np.array2string(missing, precision=6))

# %%
# The rows of :math:`J` sum to 0
# ------------------------------
#
# .. math::
#
#    \sum_j J_{ij} = p_i \sum_j (\delta_{ij} - p_j) = p_i (1 - 1) = 0 ,
#    \qquad J \mathbf{1} = 0 .
#
# This is the translation invariance seen above: moving every logit by the
# same :math:`t` changes no probability, so the derivative along
# :math:`\mathbf{1}` is 0. Since :math:`J` is symmetric its columns sum to 0
# too, :math:`\mathbf{1}^{\top} J = 0`, and for the VJP this means two
# things:
#
# * the gradient :math:`dz = J g` always sums to 0 over the row, whatever
#   :math:`g` is: no loss can be changed by shifting all logits together;
# * adding a constant to :math:`g` does not change :math:`dz`
#   (:math:`J(g + c\mathbf{1}) = J g`); in particular the VJP of
#   :math:`g = \mathbf{1}` is 0, which is why an all-ones cotangent proves
#   nothing in a gradient check. :mod:`sdpa_ref` uses this freedom on
#   purpose: it evaluates :math:`p \odot ((g - c) - \langle g - c, p\rangle)`
#   with :math:`c` the entry of :math:`g` at the largest :math:`p`, the same
#   value with less cancellation on peaked rows
#   (:func:`sdpa_ref.softmax_vjp`).
#
# The diagonal-only VJP breaks both: its entries do not sum to 0.

print(f"row sums of J        : {np.array2string(J.sum(axis=1), precision=2)}")
print(f"sum of dz            : {dz.sum():.2e}")
print(f"sum of dz_diag       : {vjp_diagonal(g, z).sum():.2e}   (not 0: the diagonal rule is wrong)")
print(f"VJP of ones          : {np.array2string(sdpa_ref.softmax_vjp(p, np.ones(n)), precision=2)}")
np.testing.assert_allclose(J.sum(axis=1), 0.0, atol=1e-15)
np.testing.assert_allclose(dz.sum(), 0.0, atol=1e-15)
np.testing.assert_allclose(sdpa_ref.softmax_vjp(p, g + 3.0), dz, rtol=1e-12, atol=1e-15)
np.testing.assert_allclose(sdpa_ref.softmax_vjp(p, np.ones(n)), 0.0, atol=1e-15)
if abs(vjp_diagonal(g, z).sum()) < 1e-3:
    raise AssertionError("expected the diagonal-only VJP to break the zero sum on this draw")
t = 0.3
np.testing.assert_allclose(sdpa_ref.softmax(z + t), p, rtol=1e-14)     # the invariance itself

# %%
# Peaked and flat: how large is the Jacobian?
# -------------------------------------------
#
# Dividing the logits by a temperature :math:`\tau` makes the softmax
# peaked (small :math:`\tau`) or flat (large :math:`\tau`). At both ends
# the Jacobian has a simple limit:
#
# * **one-hot** (:math:`\tau \to 0`): :math:`p = e_k`, and
#   :math:`\operatorname{diag}(e_k) - e_k e_k^{\top} = 0`; the softmax is
#   saturated and passes (almost) no gradient back to its logits: the
#   saturation that the :math:`1/\sqrt{d_k}` of attention is meant to keep
#   away (:doc:`/why-sqrt-dk` measures when it matters);
# * **uniform** (:math:`\tau \to \infty`): :math:`p = \mathbf{1}/n` and
#   :math:`J = (I - \mathbf{1}\mathbf{1}^{\top}/n)/n`, a projection scaled by
#   :math:`1/n`; its largest singular value is :math:`1/n`.
#
# The heatmaps show :math:`J` for a peaked and a flat row of the same logits:
# the peaked one is nearly 0 everywhere; the flat one has the pattern of its
# uniform limit, a positive diagonal and small negative entries off it.

z_show = np.array([2.0, 1.0, 0.5, -0.5, -1.5])
m = z_show.size

fig, axes = plt.subplots(1, 2, figsize=(8, 3.6), constrained_layout=True)
lim = 0.25
for ax, tau in zip(axes, (0.25, 4.0)):
    pt = sdpa_ref.softmax(z_show / tau)
    im = ax.imshow(sdpa_ref.softmax_jacobian(pt), cmap="RdBu_r", vmin=-lim, vmax=lim)
    ax.set_title(f"J at tau = {tau}  (max p = {pt.max():.2f})")
    ax.set_xlabel("j (logit)")
    ax.set_ylabel("i (probability)")
cbar = fig.colorbar(im, ax=axes, shrink=0.8, label="dp_i / dz_j")

# %%
# Below, the largest singular value :math:`\|J\|_2` against :math:`\tau`:
# it vanishes as the softmax saturates (below :math:`10^{-8}` it leaves the
# plot; at :math:`\tau = 0.01` it is far smaller still), rises above
# :math:`1/n` in between, and settles at :math:`1/n` as the row flattens.

taus = np.logspace(-2, 3, 101)
norms = np.array([np.linalg.norm(sdpa_ref.softmax_jacobian(sdpa_ref.softmax(z_show / tau)), 2) for tau in taus])
fig, ax = plt.subplots(figsize=(6.5, 3.6), constrained_layout=True)
ax.loglog(taus, norms, label="||J||_2")
ax.axhline(1 / m, color="gray", ls="--", label="1/n (uniform limit)")
ax.set_ylim(1e-8, 1)
ax.set_xlabel("temperature tau (logits divided by tau)")
ax.set_ylabel("largest singular value of J")
ax.set_title("a saturated softmax passes no gradient back")
ax.legend(loc="lower right")

print(f"||J||_2 at tau = {taus[0]:g}: {norms[0]:.1e};  at tau = {taus[-1]:g}: {norms[-1]:.4f}  (1/n = {1 / m:.4f})")
if not norms[0] < 1e-6:
    raise AssertionError(f"a peaked softmax should have a tiny Jacobian, got {norms[0]:.3e}")
np.testing.assert_allclose(norms[-1], 1 / m, rtol=1e-2)
if not norms.max() > 1 / m:
    raise AssertionError(f"expected ||J||_2 to exceed 1/n at some temperature, max {norms.max():.3e}")
u = np.full(m, 1 / m)
np.testing.assert_allclose(sdpa_ref.softmax_jacobian(u), (np.eye(m) - 1 / m) / m, atol=1e-16)
np.testing.assert_allclose(np.linalg.norm(sdpa_ref.softmax_jacobian(u), 2), 1 / m, rtol=1e-12)

# %%
# Summary
# -------
#
# * :math:`\partial p_i / \partial z_j = p_i(\delta_{ij} - p_j)`, i.e.
#   :math:`J = \operatorname{diag}(p) - p p^{\top}`: symmetric, rows summing
#   to 0.
# * The VJP is :math:`dz = p \odot (g - \langle g, p \rangle)`: one dot
#   product per row, no :math:`n \times n` matrix.
# * :math:`p(1-p) \odot g` keeps only the diagonal and is wrong whenever two
#   entries share the probability; a gradient check with a random cotangent
#   catches it at once.
#
# The next tutorial applies this VJP to every row of the attention matrix.
