r"""
Exercises: find the wrong line
==============================

Each backward on this page has exactly one mistake (in exercises 3 and 4,
made on two lines). They are the
mistakes the package's gradient checker is tested against
(``tests/test_gradcheck.py``), and each is one that people really make
when they derive softmax and attention by hand. For each: read the code,
find the line, and say what it should be, before you read the solution
below it. The solution explains the fix, and then you see
:func:`sdpa_ref.check_vjp` (or :func:`sdpa_ref.check_jvp`) reject the wrong
version and accept the fixed one; its report says which input's gradient
is off, and where.

Every backward here has the checker's signature: ``vjp(g, *inputs)`` takes
the cotangent ``g`` of the output (the gradient of the loss with respect
to it) and returns one gradient per input; a forward-mode
``jvp(tangents, *inputs)`` takes one tangent per input and returns the
output's tangent. The checker builds the whole Jacobian both ways (by
finite differences of the forward, and row by row from ``vjp`` with
one-hot cotangents) and compares them entry by entry.

The forward passes, written out and checked against :mod:`sdpa_ref`
first, so that any disagreement below is the backward's fault:
"""

import numpy as np

import sdpa_ref


def swap(a):
    """Transpose the last two axes (the matrix transpose, batched)."""
    return np.swapaxes(a, -1, -2)


def softmax_forward(x):
    """Softmax along the last axis, shifted by the row maximum."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention_forward(q, k, v):
    """O = softmax(Q K^T / sqrt(d_k)) V, for q (..., L, d_k), k (..., S, d_k), v (..., S, d_v)."""
    P = softmax_forward(q @ swap(k) / np.sqrt(q.shape[-1]))
    return P @ v


rng = np.random.default_rng(0)
X = rng.standard_normal((3, 5))                                  # 3 rows of 5 logits
Q, K, V = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 3))
np.testing.assert_allclose(softmax_forward(X), sdpa_ref.softmax(X), rtol=1e-14)
np.testing.assert_allclose(attention_forward(Q, K, V), sdpa_ref.scaled_dot_product_attention(Q, K, V), rtol=1e-13)


def expect_caught(rep, blamed=None):
    """The checker must reject the wrong backward (and, where given, blame exactly these inputs)."""
    print("the wrong one:\n" + str(rep))
    if rep.ok:
        raise AssertionError("the gradient checker passed a wrong backward:\n" + str(rep))
    if blamed is not None:
        got = [row["arg"] for row in rep.per_arg if row["failed"]]
        if got != blamed:
            raise AssertionError(f"expected the checker to blame args {blamed}, it blamed {got}:\n{rep}")


def expect_passed(rep):
    """The checker must accept the fixed backward."""
    print("the fixed one:\n" + str(rep))
    if not rep.ok:
        raise AssertionError("the fixed backward does not pass the gradient checker:\n" + str(rep))


# %%
# Exercise 1: the softmax's derivative
# ------------------------------------
#
# The derivative of the logistic sigmoid :math:`\sigma(x)` is
# :math:`\sigma(x)(1 - \sigma(x))`. By analogy:


def softmax_vjp_1(g, x):
    y = softmax_forward(x)
    dx = y * (1.0 - y) * g          # dy_i / dx_i = y_i (1 - y_i)
    return dx


# %%
# Find the line, and what it should be.
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dx = y * (1.0 - y) * g``. :math:`y_i(1 - y_i)` is only the *diagonal*
#    of the softmax's Jacobian,
#
#    .. math::
#
#       J_{ij} = \frac{\partial y_i}{\partial x_j} = y_i (\delta_{ij} - y_j),
#       \qquad J = \operatorname{diag}(y) - y y^\top .
#
#    Each output depends on *every* input, through the normaliser: raising
#    :math:`x_j` takes probability from every :math:`y_i`, the off-diagonal
#    :math:`-y_i y_j`. The sigmoid has one output per input, so there its
#    Jacobian *is* its diagonal; the softmax's is not. The VJP is
#    :math:`J^\top g = y \odot (g - \langle y, g \rangle)`, one line:
#
#    .. code-block:: python
#
#       dx = y * (g - np.sum(y * g, axis=-1, keepdims=True))
#
#    The report counts 60 wrong entries of the :math:`15 \times 15`
#    Jacobian: exactly the off-diagonal entries of the three
#    :math:`5 \times 5` row blocks (:math:`3 \times 20`). The diagonal is
#    right, and entries across rows are 0 both ways. Its worst entry has
#    an ``output`` in the same row as, and another column than, its
#    ``index``: an off-diagonal term.


def softmax_vjp_1_fixed(g, x):
    y = softmax_forward(x)
    dx = y * (g - np.sum(y * g, axis=-1, keepdims=True))
    return dx


rep_1 = sdpa_ref.check_vjp(softmax_forward, softmax_vjp_1, (X,))
expect_caught(rep_1, blamed=[0])
if rep_1.per_arg[0]["failed"] != 3 * 5 * 4:
    raise AssertionError(f"expected the 60 off-diagonal entries to fail, got {rep_1.per_arg[0]['failed']}")
expect_passed(sdpa_ref.check_vjp(softmax_forward, softmax_vjp_1_fixed, (X,)))

# %%
# Exercise 2: the Jacobian, half applied
# --------------------------------------
#
# This one starts from the right Jacobian:


def softmax_vjp_2(g, x):
    y = softmax_forward(x)
    # J = diag(y) - y y^T, so J^T g = ...
    dx = y * g
    return dx


# %%
# Find the line, and what it should be.
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dx = y * g`` applies :math:`\operatorname{diag}(y)` and forgets
#    :math:`-y y^\top`: the term :math:`-y_i \sum_j y_j g_j`. The fix is the
#    same line as in exercise 1,
#    ``dx = y * (g - np.sum(y * g, axis=-1, keepdims=True))``.
#
#    One way to see that the missing term cannot be missing: adding a
#    constant :math:`c` to every logit of a row does not change the softmax,
#    so the gradient must be orthogonal to :math:`(1, \dots, 1)`, each row
#    of ``dx`` summing to 0. The right VJP does,
#    :math:`\sum_i y_i (g_i - \langle y, g\rangle) = 0`; ``y * g`` does
#    not. (The same fact is why a gradient check with an all-ones cotangent
#    is weak: the right VJP of ones is exactly 0.)


def softmax_vjp_2_fixed(g, x):
    y = softmax_forward(x)
    dx = y * (g - np.sum(y * g, axis=-1, keepdims=True))
    return dx


expect_caught(sdpa_ref.check_vjp(softmax_forward, softmax_vjp_2, (X,)), blamed=[0])
expect_passed(sdpa_ref.check_vjp(softmax_forward, softmax_vjp_2_fixed, (X,)))
g_rows = softmax_vjp_2_fixed(rng.standard_normal(X.shape), X).sum(axis=-1)
print("row sums of the right gradient:", g_rows)
np.testing.assert_allclose(g_rows, 0.0, atol=1e-15)

# %%
# Exercise 3: attention's backward
# --------------------------------
#
# Attention is :math:`S = QK^\top/\sqrt{d_k}`, :math:`P = \operatorname{softmax}(S)`
# row by row, :math:`O = PV`. Its backward, in the order of the chain rule:


def attention_vjp_3(g, q, k, v):
    d_k = q.shape[-1]
    P = softmax_forward(q @ swap(k) / np.sqrt(d_k))
    dv = swap(P) @ g                                          # O = P V
    dP = g @ swap(v)
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))    # P = softmax(S)
    dq = dS @ k                                               # S = Q K^T / sqrt(d_k)
    dk = swap(dS) @ q
    return dq, dk, dv


# %%
# Find the line (or lines), and what they should be.
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dq = dS @ k`` and ``dk = swap(dS) @ q``: the scale is forgotten.
#    :math:`S = s\, Q K^\top` with :math:`s = 1/\sqrt{d_k}`, so
#    :math:`\partial S_{ij} / \partial Q_{ie} = s K_{je}` and
#
#    .. math::
#
#       dQ = s\, dS\, K, \qquad dK = s\, dS^\top Q .
#
#    The constant of the forward appears in the backward. The report blames
#    ``q`` and ``k`` (args 0 and 1) and finds ``dv`` right: the mistake is
#    in the step from :math:`dS` to the inputs of the scores. Every wrong
#    entry is off by the same factor :math:`\sqrt{d_k} = 2`, which is why
#    ``max_rel`` reads exactly 1/3: the checker's relative error is the
#    symmetric :math:`|a - n| / (|a| + |n|)`, and
#    :math:`(2 - 1) / (2 + 1) = 1/3`.


def attention_vjp_3_fixed(g, q, k, v):
    scale = 1.0 / np.sqrt(q.shape[-1])
    P = softmax_forward(scale * (q @ swap(k)))
    dv = swap(P) @ g
    dP = g @ swap(v)
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq = scale * (dS @ k)
    dk = scale * (swap(dS) @ q)
    return dq, dk, dv


rep_3 = sdpa_ref.check_vjp(attention_forward, attention_vjp_3, (Q, K, V))
expect_caught(rep_3, blamed=[0, 1])
np.testing.assert_allclose(rep_3.max_rel_error, 1 / 3, rtol=1e-6)
expect_passed(sdpa_ref.check_vjp(attention_forward, attention_vjp_3_fixed, (Q, K, V)))
dq_wrong, dq_right = attention_vjp_3(V[..., :3, :], Q, K, V)[0], attention_vjp_3_fixed(V[..., :3, :], Q, K, V)[0]
np.testing.assert_allclose(dq_wrong, np.sqrt(Q.shape[-1]) * dq_right, rtol=1e-12)

# %%
# Exercise 4: the scale, again
# ----------------------------
#
# Someone remembered the scale this time:


def attention_vjp_4(g, q, k, v):
    d_k = q.shape[-1]
    P = softmax_forward(q @ swap(k) / np.sqrt(d_k))
    dv = swap(P) @ g
    dP = g @ swap(v)
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq = dS @ k / d_k
    dk = swap(dS) @ q / d_k
    return dq, dk, dv


# %%
# Find the line (or lines), and what they should be.
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dq = dS @ k / d_k`` and ``dk = swap(dS) @ q / d_k`` divide by
#    :math:`d_k`, while the forward divides by :math:`\sqrt{d_k}`. The
#    backward's scale must be the forward's: ``/ np.sqrt(d_k)`` in both.
#    Dividing the *scores* by :math:`d_k` is itself a known mistake (the
#    scores' variance then falls like :math:`1/d_k` and the softmax goes
#    flat); here the forward is right and the backward disagrees with it,
#    which only a gradient check can notice: training would merely be a
#    little slower. ``dq`` and ``dk`` are off by :math:`\sqrt{d_k}`.


def attention_vjp_4_fixed(g, q, k, v):
    d_k = q.shape[-1]
    P = softmax_forward(q @ swap(k) / np.sqrt(d_k))
    dv = swap(P) @ g
    dP = g @ swap(v)
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq = dS @ k / np.sqrt(d_k)
    dk = swap(dS) @ q / np.sqrt(d_k)
    return dq, dk, dv


expect_caught(sdpa_ref.check_vjp(attention_forward, attention_vjp_4, (Q, K, V)), blamed=[0, 1])
expect_passed(sdpa_ref.check_vjp(attention_forward, attention_vjp_4_fixed, (Q, K, V)))

# %%
# Exercise 5: a transpose
# -----------------------
#
# Here the queries and the keys have the same length (:math:`L = S = 4`, as
# in self-attention), so every product below has the right shape:

Q5, K5, V5 = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4, 2))


def attention_vjp_5(g, q, k, v):
    scale = 1.0 / np.sqrt(q.shape[-1])
    P = softmax_forward(scale * (q @ swap(k)))
    dv = swap(P) @ g
    dP = g @ swap(v)
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq = scale * (dS @ k)
    dk = scale * (dS @ q)
    return dq, dk, dv


# %%
# Find the line, and what it should be.
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dk = scale * (dS @ q)``. In index notation,
#    :math:`S_{ij} = s \sum_e Q_{ie} K_{je}`, so
#    :math:`\partial S_{ij} / \partial K_{je} = s\, Q_{ie}` and
#
#    .. math::
#
#       dK_{je} = s \sum_i dS_{ij}\, Q_{ie} = s\, (dS^\top Q)_{je}:
#
#    the sum runs over the *queries* :math:`i`, the first index of
#    :math:`dS`, so it is :math:`dS^\top`, ``swap(dS) @ q``. With
#    :math:`L \ne S` the wrong line would fail with a shape error; with
#    :math:`L = S` it runs and is silently wrong. Shapes are no proof; the
#    index notation (and the checker, which blames ``k`` alone, arg 1) are.


def attention_vjp_5_fixed(g, q, k, v):
    scale = 1.0 / np.sqrt(q.shape[-1])
    P = softmax_forward(scale * (q @ swap(k)))
    dv = swap(P) @ g
    dP = g @ swap(v)
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq = scale * (dS @ k)
    dk = scale * (swap(dS) @ q)
    return dq, dk, dv


expect_caught(sdpa_ref.check_vjp(attention_forward, attention_vjp_5, (Q5, K5, V5)), blamed=[1])
expect_passed(sdpa_ref.check_vjp(attention_forward, attention_vjp_5_fixed, (Q5, K5, V5)))

# %%
# Exercise 6: forward mode
# ------------------------
#
# A Jacobian-vector product pushes tangents :math:`(\dot Q, \dot K, \dot V)`
# of the inputs forward to the tangent :math:`\dot O` of the output: what
# forward-mode automatic differentiation computes (``jax.jvp``,
# ``torch.func.jvp``), and what :func:`sdpa_ref.sdpa_jvp` computes by hand:


def attention_jvp_6(tangents, q, k, v):
    tq, tk, tv = tangents
    scale = 1.0 / np.sqrt(q.shape[-1])
    P = softmax_forward(scale * (q @ swap(k)))
    dS = scale * (tq @ swap(k))                                # S = scale Q K^T
    dP = P * (dS - np.sum(P * dS, axis=-1, keepdims=True))     # P = softmax(S)
    return dP @ v + P @ tv                                     # O = P V


# %%
# Find the line, and what it should be.
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dS = scale * (tq @ swap(k))``. The scores depend on *both* ``q``
#    and ``k``; by the product rule
#
#    .. math::
#
#       \dot S = s\, (\dot Q K^\top + Q \dot K^\top),
#
#    so the line is ``dS = scale * (tq @ swap(k) + q @ swap(tk))``. The
#    key's tangent ``tk`` is unpacked and never used (a linter's "unused
#    variable" would have hinted at it). :func:`sdpa_ref.check_jvp` pushes
#    one one-hot tangent per input entry and blames arg 1, the keys, alone.


def attention_jvp_6_fixed(tangents, q, k, v):
    tq, tk, tv = tangents
    scale = 1.0 / np.sqrt(q.shape[-1])
    P = softmax_forward(scale * (q @ swap(k)))
    dS = scale * (tq @ swap(k) + q @ swap(tk))
    dP = P * (dS - np.sum(P * dS, axis=-1, keepdims=True))
    return dP @ v + P @ tv


expect_caught(sdpa_ref.check_jvp(attention_forward, attention_jvp_6, (Q, K, V)), blamed=[1])
expect_passed(sdpa_ref.check_jvp(attention_forward, attention_jvp_6_fixed, (Q, K, V)))

# %%
# What the checker did, and did not, need
# ---------------------------------------
#
# None of these mistakes raises an error, and only one (exercise 5, with
# :math:`L \ne S`) would ever change a shape. A model trained with any of
# them still trains, worse or differently. What caught every one was a
# comparison of the whole Jacobian with finite differences of the forward,
# in float64, on small random inputs: the forward is the specification,
# and the backward is held to it. The tutorial
# :ref:`sphx_glr_auto_tutorials_tut4_transformer_gradcheck.py` does the
# same for a whole Transformer, parameter by parameter.
