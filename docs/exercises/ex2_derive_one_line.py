r"""
Exercises: derive one line
==========================

Each exercise below is a backward with one line left to derive. The line
printed is a first attempt that someone plausibly writes, and it is wrong:
derive the right one on paper from the forward, write it into your copy of
the function, and run the checker call shown under it on your version
(:func:`sdpa_ref.check_vjp` differentiates the forward numerically, entry
by entry, and prints ``ok`` for a right answer). The page shows the
checker's verdict on the first attempt. A hint and the solution are folded
under each exercise.

Every function here has the checker's signature, ``vjp(g, *inputs)``: the
cotangent ``g`` of the output, then the inputs, and one gradient returned
per input. The forward passes, written out and checked against
:mod:`sdpa_ref` first, so that any disagreement below is the backward's
fault:
"""

import numpy as np

import sdpa_ref
import sdpa_ref.diagnostics

# sphinx_gallery_start_ignore
import _exercise_solutions as solutions  # noqa: E402  (the folded solutions: docs/_exercise_solutions.py)

EXERCISES = []                  # (name, check, wrong version, solution), run again by the test suite
# sphinx_gallery_end_ignore


def swap(a):
    """Transpose the last two axes (the matrix transpose, batched)."""
    return np.swapaxes(a, -1, -2)


def softmax_forward(x):
    """Softmax along the last axis, shifted by the row maximum."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention_with_scale(q, k, v, scale):
    """O = softmax(scale Q K^T) V, the scale an input (a 0-d array)."""
    return softmax_forward(scale * (q @ swap(k))) @ v


def attention_with_mask(q, k, v, mask):
    """O = softmax(Q K^T / sqrt(d_k) + mask) V, a float mask (L, S) shared by every head, added after the scale."""
    return softmax_forward(q @ swap(k) / np.sqrt(q.shape[-1]) + mask) @ v


def attention_lse(q, k):
    """lse_l = log sum_j exp(T_lj), T = Q K^T / sqrt(d_k): the log-sum-exp FlashAttention saves, (H, L)."""
    T = q @ swap(k) / np.sqrt(q.shape[-1])
    m = T.max(axis=-1, keepdims=True)
    return (m + np.log(np.sum(np.exp(T - m), axis=-1, keepdims=True)))[..., 0]


def attention_with_sinks(q, k, v, sinks):
    """One logit per head (sinks, shape (H,)) joins every row's softmax, with no value (gpt-oss, FlashInfer)."""
    T = q @ swap(k) / np.sqrt(q.shape[-1])
    z = np.broadcast_to(sinks[:, None, None], T.shape[:-1] + (1,))
    P = softmax_forward(np.concatenate([T, z], axis=-1))[..., :-1]     # the sink's column has no value
    return P @ v


rng = np.random.default_rng(1)
H, L, S, d_k, d_v = 2, 3, 4, 4, 3
Q, K, V = rng.standard_normal((H, L, d_k)), rng.standard_normal((H, S, d_k)), rng.standard_normal((H, S, d_v))
scale, mask, sinks = np.array(0.7), rng.standard_normal((L, S)), rng.standard_normal(H)
pkg = sdpa_ref.scaled_dot_product_attention
np.testing.assert_allclose(attention_with_scale(Q, K, V, scale), pkg(Q, K, V, scale=float(scale)), rtol=1e-13)
np.testing.assert_allclose(attention_with_mask(Q, K, V, mask), pkg(Q, K, V, mask), rtol=1e-13)
np.testing.assert_allclose(attention_lse(Q, K), sdpa_ref.sdpa_forward(Q, K, V)[1].lse, rtol=1e-13)
np.testing.assert_allclose(attention_with_sinks(Q, K, V, sinks), sdpa_ref.sdpa_forward(Q, K, V, sinks=sinks)[0],
                           rtol=1e-13)

# %%
# Exercise 7: the scale's gradient
# --------------------------------
#
# Some models learn the scale (a per-head temperature), so the backward
# must also return :math:`\partial \mathcal{L} / \partial s` for
# :math:`T = s\, S`, :math:`S = Q K^{\top}`. Everything but the last line
# is the backward of the tutorials:


def scale_vjp(g, q, k, v, scale):
    S = q @ swap(k)                                            # T = scale S
    P = softmax_forward(scale * S)
    dP = g @ swap(v)
    dT = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq, dk, dv = scale * (dT @ k), scale * (swap(dT) @ q), swap(P) @ g
    dscale = scale * np.sum(dT)                                # derive this line
    return dq, dk, dv, dscale


def check_7(vjp):
    return sdpa_ref.check_vjp(attention_with_scale, vjp, (Q, K, V, scale))


print(check_7(scale_vjp))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "7: the scale's gradient", check_7, scale_vjp, solutions.scale_vjp, blamed=[3])
# sphinx_gallery_end_ignore

# %%
# .. admonition:: Hint
#    :class: dropdown
#
#    :math:`T_{lj} = s\, S_{lj}` for every entry, and the one :math:`s`
#    moves all of them: :math:`ds = \sum_{l,j} dT_{lj}\, \partial
#    T_{lj} / \partial s`.
#
# .. admonition:: Solution
#    :class: dropdown
#
#    Every score depends on :math:`s`, with :math:`\partial T_{lj} /
#    \partial s = S_{lj}`, so the chain rule sums over all of them:
#
#    .. math::
#
#       ds = \sum_{l, j} dT_{lj}\, S_{lj} = \langle dT, S \rangle
#          = \langle dT, T \rangle / s .
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: scale_vjp
#
#    The first attempt multiplies by :math:`s` where it should multiply by
#    the scores, and its sum is 0 anyway: every row of :math:`dT` sums to
#    0 (adding a constant to a row of scores changes nothing), so
#    ``np.sum(dT)`` is rounding noise. A scale is a weight on every score:
#    its gradient is the sum of the scores' gradients times what they were
#    multiplied by. Compare ``dq = scale * dT @ k``: there :math:`s` is the
#    factor, because :math:`Q` is the variable.
#
# Exercise 8: the mask's gradient
# -------------------------------
#
# A float mask (an additive bias: ALiBi, a relative position bias, a
# learned one) of shape :math:`(L, S)` is shared by the :math:`H` heads and
# added to the scores *after* the scale, as in PyTorch:
# :math:`T = Q K^{\top} / \sqrt{d_k} + M`. Its gradient:


def mask_vjp(g, q, k, v, mask):
    scale = 1.0 / np.sqrt(q.shape[-1])
    P = softmax_forward(scale * (q @ swap(k)) + mask)          # T = scale Q K^T + mask
    dP = g @ swap(v)
    dT = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq, dk, dv = scale * (dT @ k), scale * (swap(dT) @ q), swap(P) @ g
    dmask = scale * np.sum(dT, axis=0)                         # derive this line
    return dq, dk, dv, dmask


def check_8(vjp):
    return sdpa_ref.check_vjp(attention_with_mask, vjp, (Q, K, V, mask))


print(check_8(mask_vjp))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "8: the mask's gradient", check_8, mask_vjp, solutions.mask_vjp, blamed=[3])
# sphinx_gallery_end_ignore

# %%
# .. admonition:: Hint
#    :class: dropdown
#
#    What is :math:`\partial T_{hlj} / \partial M_{lj}`? And how many heads
#    does one entry :math:`M_{lj}` reach?
#
# .. admonition:: Solution
#    :class: dropdown
#
#    The mask is added as it is, so :math:`\partial T_{hlj} / \partial
#    M_{lj} = 1` in every head :math:`h`: the scale multiplies
#    :math:`QK^{\top}`, not :math:`M`. One entry of :math:`M` reaches
#    every head, so its gradient sums theirs (the rule for any broadcast
#    input):
#
#    .. math::
#
#       dM_{lj} = \sum_h dT_{hlj} .
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: mask_vjp
#
#    A masked-out entry (:math:`M = -\infty`) has :math:`P = 0`, so
#    :math:`dT = P (dP - D) = 0` there: a mask that removes a key passes it
#    no gradient, as SEMANTICS.md says.
#
# Exercise 9: the log-sum-exp's gradient
# --------------------------------------
#
# FlashAttention saves each row's log-sum-exp
# :math:`\mathrm{lse}_l = \log \sum_j e^{T_{lj}}` for its backward, and
# some losses read it (a z-loss, or merging partial results). Here the
# output *is* the LSE, :math:`(H, L)`, and ``g`` its cotangent:


def lse_vjp(g, q, k):
    scale = 1.0 / np.sqrt(q.shape[-1])
    T = scale * (q @ swap(k))
    P = softmax_forward(T)
    dT = np.exp(T) * g[..., None]                              # derive this line
    return scale * (dT @ k), scale * (swap(dT) @ q)


def check_9(vjp):
    return sdpa_ref.check_vjp(attention_lse, vjp, (Q, K))


print(check_9(lse_vjp))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "9: the log-sum-exp's gradient", check_9, lse_vjp, solutions.lse_vjp, blamed=[0, 1])
# sphinx_gallery_end_ignore

# %%
# .. admonition:: Hint
#    :class: dropdown
#
#    Differentiate :math:`\log u` with :math:`u = \sum_j e^{T_{lj}}`: the
#    chain rule gives :math:`\frac{1}{u} \frac{\partial u}{\partial
#    T_{lj}}`. What is that ratio?
#
# .. admonition:: Solution
#    :class: dropdown
#
#    .. math::
#
#       \frac{\partial\, \mathrm{lse}_l}{\partial T_{lj}}
#       = \frac{e^{T_{lj}}}{\sum_{j'} e^{T_{lj'}}} = P_{lj},
#       \qquad dT_{lj} = P_{lj}\, g_l .
#
#    The gradient of the log-sum-exp is the softmax: ``np.exp(T)`` forgets
#    the :math:`1/u` of the logarithm.
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: lse_vjp
#
#    When a loss reads both :math:`O` and the LSE, the two cotangents add
#    inside one row pass: :math:`dT = P \odot (dP - D + g)`, the form the
#    package's engines use for ``grad_lse``.
#
# Exercise 10: a sink's gradient
# ------------------------------
#
# A learnable sink (gpt-oss, FlashInfer's ``sinks``, FlashAttention 4's
# ``learnable_sink``) is one logit :math:`\sigma_h` per head that joins
# every row's softmax and has no value: the keys' weights sum to
# :math:`1 - p_{\sigma}` with :math:`p_{\sigma, l} = e^{\sigma} / (e^{\sigma}
# + \sum_j e^{T_{lj}})`. The first attempt reasons that a logit with no
# value cannot change the output:


def sink_vjp(g, q, k, v, sinks):
    scale = 1.0 / np.sqrt(q.shape[-1])
    T = scale * (q @ swap(k))                                  # (H, L, S)
    z = sinks[:, None, None]                                   # one logit per head, with no value
    m = np.maximum(T.max(axis=-1, keepdims=True), z)
    Z = np.exp(T - m).sum(axis=-1, keepdims=True) + np.exp(z - m)
    P, p_sink = np.exp(T - m) / Z, (np.exp(z - m) / Z)[..., 0]
    dP = g @ swap(v)
    D = np.sum(P * dP, axis=-1, keepdims=True)                 # the sink's column has dP = 0 (no value)
    dT = P * (dP - D)
    dq, dk, dv = scale * (dT @ k), scale * (swap(dT) @ q), swap(P) @ g
    dsinks = np.zeros_like(sinks)                              # derive this line
    return dq, dk, dv, dsinks


def check_10(vjp):
    return sdpa_ref.check_vjp(attention_with_sinks, vjp, (Q, K, V, sinks))


print(check_10(sink_vjp))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "10: a sink's gradient", check_10, sink_vjp, solutions.sink_vjp, blamed=[3])
ref = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(Q, K, V, sinks=sinks)[1], V[:, :L] * 0 + 1.0)
np.testing.assert_allclose(solutions.sink_vjp(V[:, :L] * 0 + 1.0, Q, K, V, sinks)[3], ref.sinks, rtol=1e-12)
# sphinx_gallery_end_ignore

# %%
# .. admonition:: Hint
#    :class: dropdown
#
#    Treat the sink as one more column of the row, with score
#    :math:`\sigma` and :math:`dP = 0` (its value is 0). The softmax's row
#    pass gives that column's :math:`dT`. Then: how many rows does one
#    :math:`\sigma_h` reach?
#
# .. admonition:: Solution
#    :class: dropdown
#
#    The sink's value is 0, so its column's :math:`dP` is 0; but the
#    softmax's row pass mixes the columns: :math:`dT_{\sigma} = p_{\sigma}
#    (0 - D_l)` with :math:`D_l = \sum_j P_{lj}\, dP_{lj}`. The sink moves
#    the output by taking weight from every key. One :math:`\sigma_h`
#    reaches every row of its head:
#
#    .. math::
#
#       d\sigma_h = -\sum_l p_{\sigma, hl}\, D_{hl}
#                 = -\sum_l p_{\sigma, hl}\, (dO_{hl} \cdot O_{hl}) .
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: sink_vjp
#
#    This is the formula of splash attention's reference and of
#    :func:`sdpa_ref.sdpa_backward`'s ``sinks`` gradient (with a ``grad_lse``
#    it gains :math:`+ p_{\sigma}\, g_{\mathrm{lse}}`).
#
# Exercise 11: why :math:`\sqrt{d_k}`
# -----------------------------------
#
# The practice question of the source note (Vaswani et al. 2017, section
# 3.2.1): if :math:`q` and :math:`k` have independent components of mean 0
# and variance 1, what is the variance of :math:`q \cdot k = \sum_{i=1}^{d_k}
# q_i k_i`, and what scale makes it 1? The answer is one line, the two
# numbers as functions of :math:`d_k`. A first attempt:


def variance_and_scale(d_k):
    return d_k, 1 / d_k                                        # derive this line


# %%
# The checker measures instead of differentiating: it draws standard
# normal queries and keys with the package's
# :func:`sdpa_ref.diagnostics.sweep` (64 independent trials of 32 queries
# and 50 keys each) at :math:`d_k = 16, 64, 256`, and accepts an answer
# whose predicted standard deviations (of :math:`q \cdot k`, and of the
# scaled score) are within five standard errors of the measured ones.

MEASURED = sdpa_ref.diagnostics.sweep(d_ks=(16, 64, 256), scales=("none",))


class VarianceReport:
    """The measured against the predicted std of q . k and of the scaled score, per d_k."""

    def __init__(self, answer):
        self.rows = []
        for row in MEASURED:
            variance, scale = answer(row.d_k)
            slack = 5 * row.score_std_stderr
            self.rows.append((row.d_k, row.score_std, np.sqrt(variance), abs(scale) * row.score_std,
                              abs(np.sqrt(variance) - row.score_std) <= slack,
                              abs(abs(scale) * row.score_std - 1) <= abs(scale) * slack))
        self.ok = all(a and b for *_, a, b in self.rows)

    def __str__(self):
        lines = [f"variance check: {'ok' if self.ok else 'FAILED'}",
                 "   d_k   measured std(q.k)   your sqrt(variance)   std(scale q.k)"]
        for d_k, measured, predicted, scaled, ok_var, ok_scale in self.rows:
            lines.append(f"  {d_k:4d}   {measured:17.3f}   {predicted:19.3f}{'' if ok_var else ' x':2}"
                         f"   {scaled:14.3f}{'' if ok_scale else ' x'}")
        return "\n".join(lines)


def check_11(answer):
    return VarianceReport(answer)


print(check_11(variance_and_scale))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "11: why sqrt(d_k)", check_11, variance_and_scale, solutions.variance_and_scale)
if len(EXERCISES) != 5:
    raise AssertionError(f"expected 5 exercises on this page, registered {len(EXERCISES)}")
# sphinx_gallery_end_ignore

# %%
# .. admonition:: Hint
#    :class: dropdown
#
#    The variance of a sum of independent terms is the sum of their
#    variances. What are the mean and the variance of one product
#    :math:`q_i k_i` of two independent unit-variance variables? Then
#    :math:`\operatorname{Var}(c X) = c^2 \operatorname{Var}(X)`.
#
# .. admonition:: Solution
#    :class: dropdown
#
#    :math:`E[q_i k_i] = E[q_i] E[k_i] = 0` and
#    :math:`\operatorname{Var}(q_i k_i) = E[q_i^2] E[k_i^2] = 1`, so the sum
#    of :math:`d_k` independent such terms has variance :math:`d_k`. A
#    scale :math:`c` multiplies the variance by :math:`c^2`, so
#    :math:`c = 1/\sqrt{d_k}` gives 1:
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: variance_and_scale
#
#    The first attempt, :math:`1/d_k`, divides the *standard deviation*
#    :math:`\sqrt{d_k}` by :math:`d_k`: the scores' std falls like
#    :math:`1/\sqrt{d_k}` and the softmax drifts towards uniform, which
#    :ref:`sphx_glr_auto_tutorials_tut5_why_sqrt_dk.py` measures.
