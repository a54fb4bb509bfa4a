r"""
Single-head attention's backward, derived by hand
=================================================

One head of scaled dot-product attention is three lines:

.. math::

   T = s\, Q K^{\top}, \qquad
   P = \operatorname{softmax}_{\text{rows}}(T), \qquad
   O = P V,

with :math:`Q` of shape :math:`(L, E)`, :math:`K` of shape :math:`(S, E)`,
:math:`V` of shape :math:`(S, E_v)` and the scale :math:`s = 1/\sqrt{E}`.
This page derives the backward pass in index notation, one line at a time
and last line first, checks **each step alone** by finite differences, then
the whole chain against :func:`sdpa_ref.sdpa_backward` and
:func:`sdpa_ref.check_vjp`, and shows each step's line in the package's
teaching core, ``sdpa_ref/core.py`` (NumPy alone, one file, the oracle every
engine is tested against). The last section runs the same derivation
forwards (the JVP). It builds on the softmax VJP of the previous tutorial.
"""

import inspect

import numpy as np

import sdpa_ref
import sdpa_ref.core

rng = np.random.default_rng(0)
L, S, E, Ev = 3, 4, 5, 2                     # query rows, keys, query/key width, value width
scale = 1 / np.sqrt(E)
Q = rng.standard_normal((L, E))
K = rng.standard_normal((S, E))
V = rng.standard_normal((S, Ev))
dO = rng.standard_normal((L, Ev))            # the upstream gradient: random, never all ones


def softmax_rows(T):
    return sdpa_ref.softmax(T, axis=-1)


def forward(Q, K, V):
    T = scale * Q @ K.T                      # (L, S)
    P = softmax_rows(T)                      # (L, S), each row sums to 1
    O = P @ V                                # (L, Ev)
    return T, P, O


T, P, O = forward(Q, K, V)
out_core, res_core = sdpa_ref.core.attention_forward(Q, K, V)   # the teaching core: sdpa_ref/core.py
out, res = sdpa_ref.sdpa_forward(Q, K, V, method="plain")       # the package's plain engine
for o in (out_core, out):
    np.testing.assert_allclose(o, O, rtol=1e-13, atol=1e-15)
np.testing.assert_allclose(res.probs.reshape(L, S), P, rtol=1e-13, atol=1e-15)
print("O =\n", np.array2string(O, precision=4))

# %%
# In the teaching core, :func:`sdpa_ref.core.attention_forward` is the same
# three lines, with the allowed set (a boolean mask, the causal rule) written
# as :math:`-\infty` scores, which the softmax turns into exact zeros; a row
# with no allowed key gets :math:`P = 0`, so its output is 0 and it sends no
# gradient (the package's default ``fully_masked="zero"``):
#
# .. literalinclude:: /../sdpa_ref/core.py
#    :language: python
#    :pyobject: attention_forward
#    :lineno-match:
#    :dedent:
#    :start-at: with np.errstate(over="ignore", invalid="ignore"):
#    :end-at: O = P @ v

# %%
# The loss, the check, and how to read it
# ---------------------------------------
#
# A backward pass takes the gradient of some scalar loss with respect to the
# output and returns the gradients with respect to the inputs. Any loss will
# do; the simplest that exercises every entry is linear in :math:`O`,
#
# .. math::
#
#    \mathcal{L} = \sum_{l, c} dO_{lc}\, O_{lc} = \langle dO, O \rangle ,
#
# with a random :math:`dO`: then :math:`\partial \mathcal{L} / \partial O =
# dO` exactly, and the gradient of :math:`\mathcal{L}` with respect to an
# input is that input's VJP of :math:`dO`. (We write :math:`\mathcal{L}` for
# the loss; :math:`L` is the number of query rows.)
#
# Each step is checked with central differences in float64,
# :math:`\partial f / \partial x_i \approx (f(x + h e_i) - f(x - h e_i)) / 2h`
# with :math:`h = 10^{-6}`, for every entry of the step's input (the shapes
# are tiny, so this costs nothing), and compared with the hand-derived
# gradient by a relative error,
#
# .. math::
#
#    \text{rel} = \frac{\max_i |a_i - n_i|}{\max_i |a_i| + \max_i |n_i|} ,
#
# analytic :math:`a` against numeric :math:`n`. How to read it, after the
# `cs231n notes on gradient checking
# <https://cs231n.github.io/neural-networks-3/#gradcheck>`_: in float64 on a
# smooth function, as here, a right gradient gives about :math:`10^{-8}` or
# much less (the truncation error :math:`O(h^2)` and the rounding error
# :math:`O(\epsilon/h)` of the difference quotient); :math:`10^{-4}` would
# already be suspicious, and :math:`10^{-2}` or more means the formula is
# wrong. Kinks (a ReLU, a max, a mask edge) can spoil a right gradient when
# :math:`x \pm h` straddles one; attention without masks has none. Every
# check below fails this page's build above :math:`10^{-6}`.

H = 1e-6
TOL = 1e-6


def num_grad(f, X, h=H):
    """Central-difference gradient of the scalar function f at X, one entry at a time (X is not modified)."""
    G = np.zeros_like(X)
    for idx in np.ndindex(X.shape):
        Xp, Xm = X.copy(), X.copy()
        Xp[idx] += h
        Xm[idx] -= h
        G[idx] = (f(Xp) - f(Xm)) / (2 * h)
    return G


def rel_error(a, n):
    return float(np.abs(a - n).max() / max(np.abs(a).max() + np.abs(n).max(), np.finfo(float).tiny))


def check(name, analytic, numeric, tol=TOL):
    err = rel_error(analytic, numeric)
    print(f"{name:<34} relative error {err:.1e}")
    if not err <= tol:                       # "not <=" also catches NaN
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:g}:\n{analytic}\nvs\n{numeric}")


# sphinx_gallery_start_ignore
FORWARD_SRC = inspect.getsource(sdpa_ref.core.attention_forward)
BACKWARD_SRC = inspect.getsource(sdpa_ref.core.attention_backward)
JVP_SRC = inspect.getsource(sdpa_ref.core.attention_jvp)


def cited(src, *texts):
    """The lines this page shows from the teaching core must exist (once each): a rename fails the build."""
    for t in texts:
        if src.count(t) != 1:
            raise AssertionError(f"expected {t!r} exactly once in the cited source, found {src.count(t)} times")


cited(FORWARD_SRC, 'with np.errstate(over="ignore", invalid="ignore"):', "T = s * (q @ np.swapaxes(k, -1, -2))",
      "T = np.where(A, T, -np.inf)", "P, _ = softmax_forward(T)", "O = P @ v")
# sphinx_gallery_end_ignore


# %%
# Step 1: :math:`O = P V` gives :math:`dV` and :math:`dP`
# --------------------------------------------------------
#
# In indices (:math:`l` a query row, :math:`j` a key, :math:`e` a column
# of :math:`Q` and :math:`K`, :math:`c` a column of :math:`V`; the letter
# :math:`s` is kept for the scale), :math:`O_{lc} = \sum_j P_{lj} V_{jc}`,
# so :math:`\partial O_{lc} / \partial V_{jc'} = P_{lj}\, \delta_{cc'}` and
# :math:`\partial O_{lc} / \partial P_{l'j} = \delta_{ll'} V_{jc}`. Summing
# over every output entry :math:`(l, c)` with the weights
# :math:`dO_{lc}`:
#
# .. math::
#
#    dV_{jc} = \frac{\partial \mathcal{L}}{\partial V_{jc}}
#            = \sum_{l} dO_{lc}\, P_{lj} = (P^{\top} dO)_{jc},
#    \qquad
#    dP_{lj} = \frac{\partial \mathcal{L}}{\partial P_{lj}}
#            = \sum_{c} dO_{lc}\, V_{jc} = (dO\, V^{\top})_{lj}.
#
# This is the rule for any product :math:`C = A B`: :math:`dA = dC\,
# B^{\top}` and :math:`dB = A^{\top} dC`; the shapes confirm it
# (:math:`P^{\top} dO` is :math:`(S, E_v)` like :math:`V`; :math:`dO\,
# V^{\top}` is :math:`(L, S)` like :math:`P`).
#
# The check of this step alone treats :math:`P` and :math:`V` as free
# inputs of :math:`\langle dO, P V\rangle`: a perturbed :math:`P` is not
# renormalised, because the step does not know that :math:`P` came from a
# softmax. First the directional derivative along a random :math:`\delta V`,
# :math:`(\mathcal{L}(V + h\,\delta V) - \mathcal{L}(V - h\,\delta V)) / 2h`
# against :math:`\langle dV, \delta V\rangle`, then every entry.

dV = P.T @ dO                                # dV_jc = sum_l P_lj dO_lc
dP = dO @ V.T                                # dP_lj = sum_c dO_lc V_jc

dV_dir = rng.standard_normal(V.shape)
directional = (np.sum(dO * (P @ (V + H * dV_dir))) - np.sum(dO * (P @ (V - H * dV_dir)))) / (2 * H)
check("<dV, dV_dir> vs its difference", np.sum(dV * dV_dir), directional)
check("dV = P^T dO", dV, num_grad(lambda V_: np.sum(dO * (P @ V_)), V))
check("dP = dO V^T", dP, num_grad(lambda P_: np.sum(dO * (P_ @ V)), P))

# %%
# In the teaching core (:func:`sdpa_ref.core.attention_backward`) these are
# the first lines after unpacking the residuals; each comment names the
# forward line it inverts and the rule:
#
# .. literalinclude:: /../sdpa_ref/core.py
#    :language: python
#    :pyobject: attention_backward
#    :lineno-match:
#    :dedent:
#    :start-at: dv = P.swapaxes(-1, -2) @ g
#    :end-at: dP = g @ v.swapaxes(-1, -2)
#
# ``g`` is :math:`dO`, and ``swapaxes(-1, -2)`` is the transpose of the last
# two axes, so that leading (batch, head) axes ride along.

# sphinx_gallery_start_ignore
cited(BACKWARD_SRC, "dv = P.swapaxes(-1, -2) @ g", "# dV = P^T dO", "dP = g @ v.swapaxes(-1, -2)",
      "# dP = dO V^T")
# sphinx_gallery_end_ignore

# %%
# Step 2: :math:`P = \operatorname{softmax}_{\text{rows}}(T)` gives :math:`dT`
# ------------------------------------------------------------------------------
#
# Row :math:`l` of :math:`P` depends on row :math:`l` of :math:`T` alone,
# through the softmax whose Jacobian the previous tutorial derived:
#
# .. math::
#
#    \frac{\partial P_{lj}}{\partial T_{l'k}}
#    = \delta_{ll'}\, P_{lj} (\delta_{jk} - P_{lk}) .
#
# Hence
#
# .. math::
#
#    dT_{lk} = \sum_{l', j} dP_{l'j} \frac{\partial P_{l'j}}{\partial T_{lk}}
#            = \sum_{j} dP_{lj}\, P_{lj} (\delta_{jk} - P_{lk})
#            = P_{lk} \big(dP_{lk} - D_l\big),
#    \qquad D_l = \sum_j P_{lj}\, dP_{lj} ,
#
# that is :math:`dT = P \odot (dP - \operatorname{rowsum}(P \odot dP))`:
# the softmax VJP :math:`p \odot (g - \langle g, p\rangle)`, row by row. The
# check of this step alone differentiates :math:`\langle dP,
# \operatorname{softmax}_{\text{rows}}(T)\rangle` with :math:`dP` held
# fixed.

D = np.sum(P * dP, axis=1, keepdims=True)    # D_l = sum_j P_lj dP_lj, (L, 1)
dT = P * (dP - D)
check("dT = P * (dP - rowsum(P * dP))", dT, num_grad(lambda T_: np.sum(dP * softmax_rows(T_)), T))

# %%
# The FlashAttention identity
# ^^^^^^^^^^^^^^^^^^^^^^^^^^^
#
# :math:`D_l` needs the whole row of :math:`P` and of :math:`dP`, an
# :math:`L \times S` product. But substituting :math:`dP = dO\, V^{\top}`,
#
# .. math::
#
#    D_l = \sum_j P_{lj} \sum_c dO_{lc} V_{jc}
#        = \sum_c dO_{lc} \sum_j P_{lj} V_{jc}
#        = \sum_c dO_{lc}\, O_{lc} ,
#
# the row sums of :math:`dO \odot O`, from two :math:`L \times E_v` arrays
# that the backward has anyway. FlashAttention computes :math:`D` this way
# before its loop over key blocks, so it never holds a row of :math:`dP`;
# the package's ``"fast"`` engine does the same. The two forms are equal in
# exact arithmetic; in floating point they agree to rounding:

D_flash = np.sum(dO * O, axis=1, keepdims=True)
print("D from rowsum(P * dP):", np.array2string(D.ravel(), precision=12))
print("D from rowsum(dO * O):", np.array2string(D_flash.ravel(), precision=12))
print(f"relative difference  : {rel_error(D, D_flash):.1e}   (rounding only)")
np.testing.assert_allclose(D_flash, D, rtol=1e-12, atol=1e-15)

# %%
# In the teaching core one call does the row pass, the softmax VJP along
# the last axis; the comment carries the derivation, and why a masked entry
# gets no gradient:
#
# .. literalinclude:: /../sdpa_ref/core.py
#    :language: python
#    :pyobject: attention_backward
#    :lineno-match:
#    :dedent:
#    :start-at: dT = softmax_backward((P, -1), dP)
#    :end-at: T = -inf outside A is a constant there
#
# and :func:`sdpa_ref.core.softmax_backward` is the formula above, two lines:
#
# .. literalinclude:: /../sdpa_ref/core.py
#    :language: python
#    :pyobject: softmax_backward
#    :lineno-match:
#
# The package's engines (:func:`sdpa_ref.softmax_vjp` too) evaluate the same
# :math:`dT` in a pivoted form, :math:`P \odot ((dP - c) - \langle dP - c,
# P\rangle)` with :math:`c` the entry of :math:`dP` at the row's largest
# :math:`P`. Since the rows of :math:`P` sum to 1, subtracting :math:`c`
# changes nothing in exact arithmetic; it only makes the dominant term of the
# sum exactly 0, which helps accuracy on peaked rows.

# sphinx_gallery_start_ignore
cited(BACKWARD_SRC, "dT = softmax_backward((P, -1), dP)", "# dT = P * (dP - D), D = rowsum(P * dP)",
      "inverts P = softmax_rows(T)")
cited(inspect.getsource(sdpa_ref.core.softmax_backward), "D = np.sum(y * g, axis=axis, keepdims=True)",
      "return y * (g - D)")
# sphinx_gallery_end_ignore
np.testing.assert_allclose(sdpa_ref.core.softmax_backward((P, -1), dP), dT, rtol=1e-12, atol=1e-15)
c = dP[np.arange(L), np.argmax(P, axis=1)][:, None]
np.testing.assert_allclose(P * ((dP - c) - np.sum(P * (dP - c), axis=1, keepdims=True)), dT, rtol=1e-12, atol=1e-15)
np.testing.assert_allclose(sdpa_ref.softmax_vjp(P, dP), dT, rtol=1e-12, atol=1e-15)

# %%
# Step 3: :math:`T = s\, Q K^{\top}` gives :math:`dQ` and :math:`dK`
# -------------------------------------------------------------------
#
# Step 2 handed us :math:`dT = \partial \mathcal{L} / \partial T`. The line
# :math:`T = s\, Q K^{\top}` is two operations, the product
# :math:`R = Q K^{\top}` (the raw scores) and the scaling :math:`T = s\, R`; walk them back
# in that order. **The scale**: :math:`T_{lj} = s\, R_{lj}`, so
# :math:`\partial T_{lj} / \partial R_{lj} = s` and
#
# .. math::
#
#    dR_{lj} = s\, dT_{lj}, \qquad dR = s\, dT .
#
# **The product**: :math:`R_{lj} = \sum_e Q_{le} K_{je}`, so
# :math:`\partial R_{l'j} / \partial Q_{le} = \delta_{ll'} K_{je}` and
# :math:`\partial R_{lj'} / \partial K_{je} = Q_{le}\, \delta_{jj'}`:
#
# .. math::
#
#    dQ_{le} = \sum_{j} dR_{lj}\, K_{je} = s\, (dT\, K)_{le},
#    \qquad
#    dK_{je} = \sum_{l} dR_{lj}\, Q_{le} = s\, (dT^{\top} Q)_{je}.
#
# This is the product rule of step 1 again, for :math:`C = A B` with
# :math:`C = R`, :math:`A = Q` and :math:`B = K^{\top}`:
# :math:`dA = dR\, B^{\top} = s\, dT\, K` and :math:`dB = A^{\top} dR = s\,
# Q^{\top} dT`, and :math:`dK` is the transpose of :math:`dB`. The scale
# rides along unchanged from :math:`dR` to both gradients. A forgotten
# transpose is caught by the shapes only when :math:`L \ne S`; a forgotten
# scale keeps every shape and makes the gradients :math:`\sqrt{E}` times
# too large: only a numeric check catches either for sure. The checks of
# this step alone differentiate :math:`\langle dT, s\, R\rangle` with
# :math:`dT` held fixed, then :math:`\langle dT, s\, Q K^{\top}\rangle`.

dR = scale * dT                              # dR_lj = s dT_lj
dQ = dR @ K                                  # dQ_le = sum_j dR_lj K_je = s (dT K)_le
dK = dR.T @ Q                                # dK_je = sum_l dR_lj Q_le = s (dT^T Q)_je
check("dR = s dT", dR, num_grad(lambda R_: np.sum(dT * (scale * R_)), Q @ K.T))
check("dQ = s dT K", dQ, num_grad(lambda Q_: np.sum(dT * (scale * Q_ @ K.T)), Q))
check("dK = s dT^T Q", dK, num_grad(lambda K_: np.sum(dT * (scale * Q @ K_.T)), K))

# %%
# In the teaching core, the last two lines, and the gradients summed back
# over any leading axis that ``np.matmul`` broadcast (none here):
#
# .. literalinclude:: /../sdpa_ref/core.py
#    :language: python
#    :pyobject: attention_backward
#    :lineno-match:
#    :dedent:
#    :start-at: dq = s * (dT @ k)
#    :end-at: return _unbroadcast(dq
#
# (The package's engines compute :math:`dK = dT^{\top} Q` as :math:`(Q^{\top}
# dT)^{\top}`, the same sums in another order, which OpenBLAS runs faster;
# the last bits may differ, as they do between BLAS builds.)

# sphinx_gallery_start_ignore
cited(BACKWARD_SRC, "dq = s * (dT @ k)", "# dQ = s dT K", "dk = s * (dT.swapaxes(-1, -2) @ q)", "# dK = s dT^T Q")
# sphinx_gallery_end_ignore

# %%
# The general form: what the extra factors are
# ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
#
# The teaching core has the scale, the causal rule and boolean masks only.
# The package's engines (:mod:`sdpa_ref.attention` is the ``"plain"`` one)
# add factors that are the identity on this page:
#
# * **dropout**: ``P_drop`` :math:`= P \odot Z/(1-p)`, and :math:`dP` is
#   multiplied by the same :math:`Z/(1-p)`;
# * **grouped-query attention**: the :math:`H_q` query heads are viewed as
#   :math:`H_{kv}` groups of :math:`G`, and the :math:`G` heads'
#   contributions are added to the shared :math:`dK` and :math:`dV`;
# * **float masks, bias, ALiBi**: added to :math:`T`, so their gradient is
#   :math:`dT` summed to their shape; a masked entry has :math:`P = 0` and
#   so :math:`dT = 0`;
# * **softcap**: ``dTraw`` :math:`= dT \odot (1 - \tanh^2)`;
# * **sinks** (extra logits with no value) and ``dlse`` (a loss that reads
#   the log-sum-exp): more terms inside the one softmax row pass.
#
# The whole chain
# ---------------
#
# Put together, the backward is five lines. We check it against central
# differences of the whole loss :math:`\langle dO, O(Q, K, V)\rangle`,
# against the teaching core's :func:`sdpa_ref.core.attention_backward` and
# the package's :func:`sdpa_ref.sdpa_backward` (``method="plain"``), and with
# :func:`sdpa_ref.check_vjp`, which
# builds the whole Jacobian of :math:`O` both ways (one VJP per output
# entry, two forward runs per input entry) and compares them entry by entry.


def backward_by_hand(Q, K, V, dO):
    T, P, O = forward(Q, K, V)
    dV = P.T @ dO
    dP = dO @ V.T
    dT = P * (dP - np.sum(P * dP, axis=1, keepdims=True))
    dQ = scale * dT @ K
    dK = scale * dT.T @ Q
    return dQ, dK, dV


def loss(Q, K, V):
    return np.sum(dO * forward(Q, K, V)[2])


hand = backward_by_hand(Q, K, V, dO)
numeric = (num_grad(lambda Q_: loss(Q_, K, V), Q),
           num_grad(lambda K_: loss(Q, K_, V), K),
           num_grad(lambda V_: loss(Q, K, V_), V))
for name, a, n in zip(("dQ", "dK", "dV"), hand, numeric):
    check(f"whole chain: {name}", a, n)

grads = sdpa_ref.sdpa_backward(res, dO)     # res: the residuals of sdpa_forward(..., method="plain")
for name, a, b, c in zip(("dQ", "dK", "dV"), hand, (grads.query, grads.key, grads.value),
                         sdpa_ref.core.attention_backward(res_core, dO)):
    print(f"{name} by hand vs sdpa_backward: max |difference| {np.abs(a - b).max():.1e}, "
          f"vs the core: {np.abs(a - c).max():.1e}")
    np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(c, a, rtol=1e-12, atol=1e-14)


def attention(q, k, v):
    return sdpa_ref.sdpa_forward(q, k, v, method="plain")[0]


def attention_vjp(g, q, k, v):
    return tuple(sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, method="plain")[1], g))[:3]


def hand_vjp(g, q, k, v):
    return backward_by_hand(q, k, v, g)


for who, vjp in (("sdpa_backward", attention_vjp), ("by hand", hand_vjp)):
    rep = sdpa_ref.check_vjp(attention, vjp, (Q, K, V))
    print(f"\ncheck_vjp of the backward {who}:\n{rep}")
    if not rep.ok:
        raise AssertionError(f"check_vjp failed for the backward {who}:\n{rep}")

# %%
# What a wrong step looks like
# ^^^^^^^^^^^^^^^^^^^^^^^^^^^^
#
# Drop the row sum :math:`D` from step 2, the most common slip (it is the
# diagonal-only softmax VJP of the previous tutorial in another guise), and
# the relative error jumps from rounding size to order :math:`10^{-1}`:


def backward_without_D(Q, K, V, dO):        # WRONG: dT = P * dP
    T, P, O = forward(Q, K, V)
    dT = P * (dO @ V.T)
    return scale * dT @ K, scale * dT.T @ Q, P.T @ dO


wrong = backward_without_D(Q, K, V, dO)
for name, a, n in zip(("dQ", "dK"), wrong[:2], numeric[:2]):
    err = rel_error(a, n)
    print(f"without D: {name} relative error {err:.1e}")
    if not err > 1e-2:
        raise AssertionError(f"expected the backward without D to be visibly wrong in {name}, got {err:.3e}")
rep = sdpa_ref.check_vjp(attention, lambda g, q, k, v: backward_without_D(q, k, v, g), (Q, K, V))
print(f"\n{rep}")
if rep.ok:
    raise AssertionError("check_vjp should catch the backward without D")

# %%
# :math:`dV` does not involve :math:`D` and stays right, which is why the
# checker's table lists the failures under the first two arguments only.
#
# Forward mode: the JVP
# ---------------------
#
# The same chain, read forwards, gives the Jacobian-vector product: how
# :math:`O` moves when the inputs move along tangents :math:`(\delta Q,
# \delta K, \delta V)`. Differentiate each forward line:
#
# .. math::
#
#    \delta T &= s\, (\delta Q\, K^{\top} + Q\, \delta K^{\top}), \\
#    \delta P_{lj} &= \sum_k P_{lj} (\delta_{jk} - P_{lk})\, \delta T_{lk}
#                 = P_{lj} \big(\delta T_{lj} - \textstyle\sum_k P_{lk}\, \delta T_{lk}\big), \\
#    \delta O &= \delta P\, V + P\, \delta V .
#
# The softmax line is the same map as in the backward, because the softmax
# Jacobian is symmetric: :math:`\delta P = P \odot (\delta T -
# \operatorname{rowsum}(P \odot \delta T))`. We check it against a central
# difference of the forward along the tangents, against the teaching core's
# :func:`sdpa_ref.core.attention_jvp` and :func:`sdpa_ref.sdpa_jvp`
# (``method="plain"``), with :func:`sdpa_ref.check_jvp`, and
# against the backward through the identity :math:`\langle dO, J\,\delta
# \rangle = \langle J^{\top} dO, \delta\rangle`, which ties the two modes
# together.


def jvp_by_hand(Q, K, V, dQ_t, dK_t, dV_t):
    T, P, O = forward(Q, K, V)
    dT_t = scale * (dQ_t @ K.T + Q @ dK_t.T)
    dP_t = P * (dT_t - np.sum(P * dT_t, axis=1, keepdims=True))
    return dP_t @ V + P @ dV_t


tangents = (rng.standard_normal(Q.shape), rng.standard_normal(K.shape), rng.standard_normal(V.shape))
dO_t = jvp_by_hand(Q, K, V, *tangents)
plus = forward(*(x + H * t for x, t in zip((Q, K, V), tangents)))[2]
minus = forward(*(x - H * t for x, t in zip((Q, K, V), tangents)))[2]
check("JVP vs central difference", dO_t, (plus - minus) / (2 * H))

_, dO_lib = sdpa_ref.sdpa_jvp((Q, K, V), tangents, method="plain")
dO_core = sdpa_ref.core.attention_jvp(res_core, tangents)
print(f"JVP by hand vs sdpa_jvp: max |difference| {np.abs(dO_lib - dO_t).max():.1e}, "
      f"vs the core: {np.abs(dO_core - dO_t).max():.1e}")
np.testing.assert_allclose(dO_lib, dO_t, rtol=1e-12, atol=1e-14)
np.testing.assert_allclose(dO_core, dO_t, rtol=1e-12, atol=1e-14)

rep = sdpa_ref.check_jvp(attention, lambda ts, q, k, v: jvp_by_hand(q, k, v, *ts), (Q, K, V))
print(rep)
if not rep.ok:
    raise AssertionError(f"check_jvp failed for the JVP by hand:\n{rep}")

lhs = np.sum(dO * dO_t)                                        # <dO, J delta>
rhs = sum(np.sum(g * t) for g, t in zip(hand, tangents))      # <J^T dO, delta>
print(f"<dO, J t> = {lhs:.15f}\n<J^T dO, t> = {rhs:.15f}")
np.testing.assert_allclose(lhs, rhs, rtol=1e-12)

# %%
# In the teaching core, :func:`sdpa_ref.core.attention_jvp` (the scores'
# tangent, the softmax row pass on it, then the two products), each line
# naming the forward line it differentiates:
#
# .. literalinclude:: /../sdpa_ref/core.py
#    :language: python
#    :pyobject: attention_jvp
#    :lineno-match:
#    :dedent:
#    :start-at: dT = s * (dq @ k.swapaxes(-1, -2)
#    :end-at: return dP @ v + P @ dv

# sphinx_gallery_start_ignore
cited(JVP_SRC, "dT = s * (dq @ k.swapaxes(-1, -2) + q @ dk.swapaxes(-1, -2))", "dP = softmax_jvp((P, -1), dT)",
      "return dP @ v + P @ dv")
# sphinx_gallery_end_ignore

# %%
# Summary
# -------
#
# .. list-table::
#    :header-rows: 1
#
#    * - forward line
#      - backward
#      - shapes
#    * - :math:`O = P V`
#      - :math:`dV = P^{\top} dO`
#
#        :math:`dP = dO\, V^{\top}`
#      - :math:`(S, E_v)`
#
#        :math:`(L, S)`
#    * - :math:`P = \operatorname{softmax}_{\text{rows}}(T)`
#      - :math:`dT = P \odot (dP - D)`
#
#        :math:`D = \operatorname{rowsum}(dO \odot O)`
#      - :math:`(L, S)`
#
#        :math:`(L, 1)`
#    * - :math:`T = s\, Q K^{\top}`
#      - :math:`dQ = s\, dT\, K`
#
#        :math:`dK = s\, dT^{\top} Q`
#      - :math:`(L, E)`
#
#        :math:`(S, E)`
#
# Every step was checked alone by finite differences, then the whole chain,
# and both modes against each other.
#
# The next page,
# :ref:`sphx_glr_auto_tutorials_tut2b_worked_example.py`, runs the same
# chain on two queries and three keys with every intermediate number
# printed, to check on paper, and draws the computation graph with its
# adjoints.
