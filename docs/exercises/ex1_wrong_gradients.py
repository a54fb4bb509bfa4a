r"""
Exercises: find the wrong line
==============================

Each backward on this page has exactly one wrong line. They are the
mistakes the package's gradient checker is tested against
(``tests/test_gradcheck.py``), and each is one that people really make
when they derive softmax and attention by hand. For each: read the code,
find the line, and write what it should be. Then copy the function, fix
the line, and run the checker call shown under it on your version:
:func:`sdpa_ref.check_vjp` (or :func:`sdpa_ref.check_jvp`) prints ``ok``
for a right answer, and otherwise which input's gradient is off, and
where. The page shows its verdict on the code as given. A hint and the
solution are folded under each exercise: open them after you tried.

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


def attention_forward(q, k, v):
    """O = softmax(Q K^T / sqrt(d_k)) V, for q (..., L, d_k), k (..., S, d_k), v (..., S, d_v)."""
    P = softmax_forward(q @ swap(k) / np.sqrt(q.shape[-1]))
    return P @ v


rng = np.random.default_rng(0)
X = rng.standard_normal((3, 5))                                  # 3 rows of 5 logits
Q, K, V = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 3))
np.testing.assert_allclose(softmax_forward(X), sdpa_ref.softmax(X), rtol=1e-14)
np.testing.assert_allclose(attention_forward(Q, K, V), sdpa_ref.scaled_dot_product_attention(Q, K, V), rtol=1e-13)


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


def check_1(vjp):
    return sdpa_ref.check_vjp(softmax_forward, vjp, (X,))


print(check_1(softmax_vjp_1))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "1: the softmax's derivative", check_1, softmax_vjp_1, solutions.softmax_vjp_1,
                   blamed=[0])
rep_1 = check_1(softmax_vjp_1)
if rep_1.per_arg[0]["failed"] != 3 * 5 * 4:
    raise AssertionError(f"expected the 60 off-diagonal entries to fail, got {rep_1.per_arg[0]['failed']}")
# sphinx_gallery_end_ignore

# %%
# Find the line, and what it should be.
#
# .. admonition:: Hint
#    :class: dropdown
#
#    How many outputs does one input of the softmax move? Write
#    :math:`\partial y_i / \partial x_j` for :math:`i \ne j`.
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
#    :math:`J^\top g = y \odot (g - \langle y, g \rangle)`:
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: softmax_vjp_1
#
#    The checker's report above counts 60 wrong entries of the
#    :math:`15 \times 15` Jacobian: exactly the off-diagonal entries of the
#    three :math:`5 \times 5` row blocks (:math:`3 \times 20`). The diagonal
#    is right, and entries across rows are 0 both ways. Its worst entry has
#    an ``output`` in the same row as, and another column than, its
#    ``index``: an off-diagonal term.
#
# Exercise 2: the Jacobian, half applied
# --------------------------------------
#
# This one starts from the right Jacobian:


def softmax_vjp_2(g, x):
    y = softmax_forward(x)
    # J = diag(y) - y y^T, so J^T g = ...
    dx = y * g
    return dx


print(check_1(softmax_vjp_2))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "2: the Jacobian, half applied", check_1, softmax_vjp_2, solutions.softmax_vjp_2,
                   blamed=[0])
g_rows = solutions.softmax_vjp_2(rng.standard_normal(X.shape), X).sum(axis=-1)
np.testing.assert_allclose(g_rows, 0.0, atol=1e-15)
# sphinx_gallery_end_ignore

# %%
# Find the line, and what it should be.
#
# .. admonition:: Hint
#    :class: dropdown
#
#    Add the same constant to every logit of a row. What happens to the
#    softmax, and so what must each row of ``dx`` sum to?
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dx = y * g`` applies :math:`\operatorname{diag}(y)` and forgets
#    :math:`-y y^\top`: the term :math:`-y_i \sum_j y_j g_j`. The fix is the
#    same line as in exercise 1:
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: softmax_vjp_2
#
#    One way to see that the missing term cannot be missing: adding a
#    constant :math:`c` to every logit of a row does not change the softmax,
#    so the gradient must be orthogonal to :math:`(1, \dots, 1)`, each row
#    of ``dx`` summing to 0. The right VJP does,
#    :math:`\sum_i y_i (g_i - \langle y, g\rangle) = 0`; ``y * g`` does
#    not. (The same fact is why a gradient check with an all-ones cotangent
#    is weak: the right VJP of ones is exactly 0.)
#
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
    dk = swap(dS) @ q / np.sqrt(d_k)
    return dq, dk, dv


def check_3(vjp):
    return sdpa_ref.check_vjp(attention_forward, vjp, (Q, K, V))


print(check_3(attention_vjp_3))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "3: attention's backward", check_3, attention_vjp_3, solutions.attention_vjp_3,
                   blamed=[0])
rep_3 = check_3(attention_vjp_3)
np.testing.assert_allclose(rep_3.max_rel_error, 1 / 3, rtol=1e-6)
dq_wrong, dq_right = (f(V[..., :3, :], Q, K, V)[0] for f in (attention_vjp_3, solutions.attention_vjp_3))
np.testing.assert_allclose(dq_wrong, np.sqrt(Q.shape[-1]) * dq_right, rtol=1e-12)
# sphinx_gallery_end_ignore

# %%
# Find the line, and what it should be.
#
# .. admonition:: Hint
#    :class: dropdown
#
#    The report blames ``q`` alone (arg 0), and its ``max_rel`` is exactly
#    :math:`1/3`: the checker's relative error is
#    :math:`|a - n| / (|a| + |n|)`. Which factor :math:`c` gives
#    :math:`(c - 1)/(c + 1) = 1/3`, and what is :math:`\sqrt{d_k}` here?
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dq = dS @ k``: the scale is forgotten (``dk``'s line has it).
#    :math:`S = s\, Q K^\top` with :math:`s = 1/\sqrt{d_k}`, so
#    :math:`\partial S_{ij} / \partial Q_{ie} = s K_{je}` and
#
#    .. math::
#
#       dQ = s\, dS\, K, \qquad dK = s\, dS^\top Q .
#
#    The constant of the forward appears in the backward:
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: attention_vjp_3
#
#    Every wrong entry is off by the same factor :math:`\sqrt{d_k} = 2`,
#    which is why ``max_rel`` reads exactly 1/3:
#    :math:`(2 - 1) / (2 + 1) = 1/3`.
#
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
    dk = swap(dS) @ q / np.sqrt(d_k)
    return dq, dk, dv


print(check_3(attention_vjp_4))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "4: the scale, again", check_3, attention_vjp_4, solutions.attention_vjp_4, blamed=[0])
# sphinx_gallery_end_ignore

# %%
# Find the line, and what it should be.
#
# .. admonition:: Hint
#    :class: dropdown
#
#    Compare each constant of the backward with the forward's.
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dq = dS @ k / d_k`` divides by :math:`d_k`, while the forward
#    divides by :math:`\sqrt{d_k}`. The backward's scale must be the
#    forward's:
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: attention_vjp_4
#
#    Dividing the *scores* by :math:`d_k` is itself a known mistake (the
#    scores' variance then falls like :math:`1/d_k` and the softmax goes
#    flat); here the forward is right and the backward disagrees with it,
#    which only a gradient check can notice: training would merely be a
#    little slower. ``dq`` is off by :math:`\sqrt{d_k}`.
#
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


def check_5(vjp):
    return sdpa_ref.check_vjp(attention_forward, vjp, (Q5, K5, V5))


print(check_5(attention_vjp_5))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "5: a transpose", check_5, attention_vjp_5, solutions.attention_vjp_5, blamed=[1])
# sphinx_gallery_end_ignore

# %%
# Find the line, and what it should be.
#
# .. admonition:: Hint
#    :class: dropdown
#
#    Write :math:`dK_{je}` as a sum in index notation: which index of
#    :math:`dS` does it run over?
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
#    :math:`dS`, so it is :math:`dS^\top`, ``swap(dS) @ q``:
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: attention_vjp_5
#
#    With :math:`L \ne S` the wrong line would fail with a shape error; with
#    :math:`L = S` it runs and is silently wrong. Shapes are no proof; the
#    index notation (and the checker, which blames ``k`` alone, arg 1) are.
#
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


def check_6(jvp):
    return sdpa_ref.check_jvp(attention_forward, jvp, (Q, K, V))


print(check_6(attention_jvp_6))

# sphinx_gallery_start_ignore
solutions.exercise(EXERCISES, "6: forward mode", check_6, attention_jvp_6, solutions.attention_jvp_6, blamed=[1])
# sphinx_gallery_end_ignore

# %%
# Find the line, and what it should be.
#
# .. admonition:: Hint
#    :class: dropdown
#
#    Which tangent is unpacked and never used?
#
# .. admonition:: Solution
#    :class: dropdown
#
#    ``dS = scale * (tq @ swap(k))``. The scores depend on *both* ``q``
#    and ``k``; by the product rule
#
#    .. math::
#
#       \dot S = s\, (\dot Q K^\top + Q \dot K^\top):
#
#    .. literalinclude:: /_exercise_solutions.py
#       :language: python
#       :pyobject: attention_jvp_6
#
#    The key's tangent ``tk`` is unpacked and never used (a linter's
#    "unused variable" would have hinted at it).
#    :func:`sdpa_ref.check_jvp` pushes one one-hot tangent per input entry
#    and blames arg 1, the keys, alone.
#
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
# same for a whole Transformer, parameter by parameter, and the next page
# asks you to derive lines of your own.
