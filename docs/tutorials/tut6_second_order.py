r"""
Second order: the double backward, derived by hand
==================================================

The backward of one head of attention (the previous tutorials) maps the
output's cotangent :math:`dO` to the gradients:

.. math::

   dV = P^{\top} dO, \quad dP = dO\, V^{\top}, \quad
   dT = P \odot (dP - D), \; D = \operatorname{rowsum}(P \odot dP), \quad
   dQ = s\, dT\, K, \quad dK = s\, dT^{\top} Q.

Its derivative along a direction :math:`(\dot Q, \dot K, \dot V)` of the
inputs (and :math:`\dot{dO}` of the cotangent) is the **double backward**;
with :math:`\dot{dO} = 0` it is the Hessian-vector product :math:`H u` of the
loss :math:`\langle dO, O\rangle`, what Newton-type optimisers, curvature
studies and influence functions use. This page differentiates each line of
the backward by the product rule, checks **each step alone** by central
differences of the line it differentiates, then the whole against
:func:`sdpa_ref.sdpa_backward_jvp` and :func:`sdpa_ref.check_hvp`, and shows
the one term that a careless derivation forgets being caught.
"""

import numpy as np

import sdpa_ref

rng = np.random.default_rng(0)
L, S, E, Ev = 3, 4, 5, 2
s = 1 / np.sqrt(E)
Q, K, V = rng.standard_normal((L, E)), rng.standard_normal((S, E)), rng.standard_normal((S, Ev))
dO = rng.standard_normal((L, Ev))
Qd, Kd, Vd = rng.standard_normal((L, E)), rng.standard_normal((S, E)), rng.standard_normal((S, Ev))   # the direction
dOd = rng.standard_normal((L, Ev))                                                                   # dO's tangent


def backward_lines(Q, K, V, dO):
    """Every line of the first-order backward, as a dict."""
    T = s * Q @ K.T
    P = sdpa_ref.softmax(T, axis=-1)
    dV = P.T @ dO
    dP = dO @ V.T
    D = np.sum(P * dP, axis=-1, keepdims=True)
    dT = P * (dP - D)
    return dict(T=T, P=P, dV=dV, dP=dP, D=D, dT=dT, dQ=s * dT @ K, dK=s * dT.T @ Q)


def along(name, h=1e-6):
    """The central difference of one line of the backward along the direction: what its tangent must equal."""
    plus = backward_lines(Q + h * Qd, K + h * Kd, V + h * Vd, dO + h * dOd)[name]
    minus = backward_lines(Q - h * Qd, K - h * Kd, V - h * Vd, dO - h * dOd)[name]
    return (plus - minus) / (2 * h)


def check(name, tangent):
    want = along(name)
    err = np.abs(tangent - want).max() / np.abs(want).max()
    print(f"{name + chr(39):>4}: max rel error against the central difference {err:.1e}")
    np.testing.assert_allclose(tangent, want, rtol=1e-6, atol=1e-8)


b = backward_lines(Q, K, V, dO)
P, dP, D, dT = b["P"], b["dP"], b["D"], b["dT"]

# %%
# The forward's tangent
# ---------------------
# :math:`\dot T = s(\dot Q K^{\top} + Q \dot K^{\top})` and, since the softmax
# Jacobian is :math:`J = \operatorname{diag}(P) - P P^{\top}` per row,
# :math:`\dot P = J \dot T = P \odot (\dot T - \operatorname{rowsum}(P \odot \dot T))`
# (the JVP of the earlier tutorial).

Td = s * (Qd @ K.T + Q @ Kd.T)
Pd = P * (Td - np.sum(P * Td, axis=-1, keepdims=True))
check("T", Td)
check("P", Pd)

# %%
# The value gradient and dP
# -------------------------
# Both are products, so each has two terms:
# :math:`\dot{dV} = \dot P^{\top} dO + P^{\top} \dot{dO}` and
# :math:`\dot{dP} = \dot{dO}\, V^{\top} + dO\, \dot V^{\top}`.

dVd = Pd.T @ dO + P.T @ dOd
dPd = dOd @ V.T + dO @ Vd.T
check("dV", dVd)
check("dP", dPd)

# %%
# The softmax's second order
# --------------------------
# :math:`dT = P \odot (dP - D)` depends on :math:`P` twice, directly and
# through :math:`D`:
#
# .. math::
#
#    \dot D = \operatorname{rowsum}(\dot P \odot dP + P \odot \dot{dP}), \qquad
#    \dot{dT} = \dot P \odot (dP - D) + P \odot (\dot{dP} - \dot D).
#
# Written as :math:`dT = J\, dP`: :math:`\dot{dT} = J \dot{dP} + \dot J dP`
# with :math:`\dot J dP = \dot P \odot dP - \dot P (P \cdot dP) - P (\dot P \cdot dP)`;
# the last term is the one a derivation that treats :math:`D` as a constant
# forgets. ``sdpa_ref.normalize.vjp_jvp`` is this step.

Dd = np.sum(Pd * dP + P * dPd, axis=-1, keepdims=True)
dTd = Pd * (dP - D) + P * (dPd - Dd)
check("D", Dd)
check("dT", dTd)
from sdpa_ref.normalize import vjp_jvp  # noqa: E402

np.testing.assert_allclose(vjp_jvp(P, dP, Pd, dPd)[0], dTd, rtol=1e-12, atol=1e-14)

# %%
# The query and key gradients
# ---------------------------
# Products again: :math:`\dot{dQ} = s(\dot{dT} K + dT \dot K)` and
# :math:`\dot{dK} = s(\dot{dT}^{\top} Q + dT^{\top} \dot Q)`.

dQd = s * (dTd @ K + dT @ Kd)
dKd = s * (dTd.T @ Q + dT.T @ Qd)
check("dQ", dQd)
check("dK", dKd)

# %%
# The whole, against the package
# ------------------------------
# :func:`sdpa_ref.sdpa_backward_jvp` returns the gradients and their tangent
# (its teaching form is ``sdpa_ref.attention.backward_jvp``, the same lines);
# ``method="tiled"`` computes them in two sweeps over blocks without an
# :math:`L \times S` array.

for method in ("plain", "tiled"):
    grads, tangent = sdpa_ref.sdpa_backward_jvp((Q, K, V), (Qd, Kd, Vd), dO, dOd, method=method)
    for name, mine in (("query", dQd), ("key", dKd), ("value", dVd)):
        np.testing.assert_allclose(getattr(tangent, name), mine, rtol=1e-12, atol=1e-14)
print("sdpa_backward_jvp agrees with the lines above, plain and tiled")

# %%
# The Hessian-vector product, and a wrong one caught
# --------------------------------------------------
# With :math:`\dot{dO} = 0` the tangent is :math:`H u` for the loss
# :math:`\langle dO, O\rangle`; :func:`sdpa_ref.check_hvp` compares it with
# central differences of the gradient and checks that
# :math:`\langle w, H u\rangle = \langle H w, u\rangle`. The version that
# forgets :math:`-P(\dot P \cdot dP)` (``D`` taken as a constant) fails both.


def fun(Q, K, V):
    return sdpa_ref.sdpa_forward(Q, K, V)[0]


def vjp(g, Q, K, V):
    gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(Q, K, V)[1], g)
    return gr.query, gr.key, gr.value


def hvp(g, t, Q, K, V):
    h = sdpa_ref.sdpa_hvp((Q, K, V), tuple(t), g)
    return h.query, h.key, h.value


def hvp_constant_D(g, t, Q, K, V):
    T = s * Q @ K.T
    P = sdpa_ref.softmax(T, axis=-1)
    Td = s * (t[0] @ K.T + Q @ t[1].T)
    Pd = P * (Td - np.sum(P * Td, axis=-1, keepdims=True))
    dP, dPd = g @ V.T, g @ t[2].T
    D = np.sum(P * dP, axis=-1, keepdims=True)
    dT = P * (dP - D)
    dTd = Pd * (dP - D) + P * (dPd - np.sum(P * dPd, axis=-1, keepdims=True))     # D' without P' . dP
    return s * (dTd @ K + dT @ t[1]), s * (dTd.T @ Q + dT.T @ t[0]), Pd.T @ g


good = sdpa_ref.check_hvp(fun, vjp, hvp, (Q, K, V), cotangent=dO)
bad = sdpa_ref.check_hvp(fun, vjp, hvp_constant_D, (Q, K, V), cotangent=dO)
print(good)
print(bad)
if not good.ok or bad.ok:
    raise AssertionError("check_hvp should pass the right HVP and reject the one with D held constant")
