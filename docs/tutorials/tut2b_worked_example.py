r"""
A worked example to check on paper
===================================

The previous tutorial derived attention's backward in general. Here is the
same chain on a problem small enough to do by hand: **two queries, three
keys, width** :math:`d_k = 2`, so the scale is :math:`s = 1/\sqrt{2}`.
Every intermediate number of the forward and the backward is printed, in
the order a pencil would produce it. Take the inputs, work each line
yourself (a calculator helps with the exponentials), and compare.

Nothing on this page is typed: every number is formatted from the
computation when the site is built, and the build checks each one against
the package's teaching core, ``sdpa_ref/core.py``
(:func:`sdpa_ref.core.attention_forward`,
:func:`sdpa_ref.core.attention_backward`), and the whole backward with the
gradient checker :func:`sdpa_ref.check_vjp`. The test suite checks the
printed numbers against the core a second time.

The inputs, and the upstream gradient :math:`dO = \partial \mathcal{L} /
\partial O` of a loss :math:`\mathcal{L} = \langle dO, O \rangle`:
"""

import matplotlib.pyplot as plt
import numpy as np

import sdpa_ref
import sdpa_ref.core as core

Q = np.array([[1.0, 0.0],                   # two queries, d_k = 2
              [1.0, 1.0]])
K = np.array([[1.0, 0.0],                   # three keys
              [0.0, 1.0],
              [1.0, 1.0]])
V = np.array([[1.0, 0.0],                   # three values, d_v = 2
              [0.0, 2.0],
              [1.0, 1.0]])
dO = np.array([[1.0, 0.0],                  # the upstream gradient
               [0.0, -1.0]])
s = 1 / np.sqrt(Q.shape[-1])                # the scale, 1/sqrt(d_k)

DIGITS = 4                                  # decimals printed: enough to check a hand computation


def fmt(x):
    """One number as the page prints it (a space for the sign of a positive one; never -0.0000)."""
    return f"{round(float(x), DIGITS) + 0.0: .{DIGITS}f}"


def term(x):
    """A factor inside a written-out sum: a negative one in parentheses."""
    return fmt(x).strip() if x >= 0 else f"({fmt(x).strip()})"


def show(name, a):
    """Print an array under its name, one row per line (a column vector for a per-row quantity)."""
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    print(f"{name} =")
    for row in a:
        print("    [ " + "  ".join(fmt(x) for x in row) + " ]")


show("Q", Q)
show("K", K)
show("V", V)
show("dO", dO)
print(f"s = 1/sqrt({Q.shape[-1]}) = {fmt(s).strip()}")

# %%
# Forward
# -------
#
# **The raw scores** :math:`R = Q K^{\top}`: entry :math:`(l, j)` is the
# dot product of query :math:`l` with key :math:`j`, so every one is a
# small integer here. **Scaled**, :math:`T = s\, R`:

R = Q @ K.T
T = s * R
show("R = Q K^T", R)
show("T = s R", T)

# %%
# **The softmax of each row**, as every careful implementation computes it:
# subtract the row's maximum :math:`m_l` (the result is the same, and no
# exponential overflows), exponentiate, sum, divide:
#
# .. math::
#
#    e_{lj} = \exp(T_{lj} - m_l), \qquad
#    Z_l = \textstyle\sum_j e_{lj}, \qquad
#    P_{lj} = e_{lj} / Z_l .

m = T.max(axis=1, keepdims=True)
e = np.exp(T - m)
Z = e.sum(axis=1, keepdims=True)
P = e / Z
show("m = rowmax(T)", m)
show("e = exp(T - m)", e)
show("Z = rowsum(e)", Z)
show("P = e / Z", P)

# %%
# Each row of :math:`P` sums to 1. **The output** is the
# :math:`P`-weighted average of the value rows, :math:`O = P V`:

O = P @ V
show("O = P V", O)

# %%
# The teaching core computes the same forward; its ``P`` is one of the
# residuals it hands the backward:

out_core, res_core = core.attention_forward(Q, K, V)
np.testing.assert_allclose(out_core, O, rtol=1e-14)
np.testing.assert_allclose(res_core[3], P, rtol=1e-14)
print("sdpa_ref.core.attention_forward agrees: max |difference|", f"{np.abs(out_core - O).max():.1e}")

# %%
# Backward
# --------
#
# Last forward line first. **From** :math:`O = P V`, the product rule
# (:math:`dA = dC\, B^{\top}`, :math:`dB = A^{\top} dC` for :math:`C = AB`):
#
# .. math::
#
#    dV = P^{\top} dO, \qquad dP = dO\, V^{\top} .

dV = P.T @ dO
dP = dO @ V.T
show("dV = P^T dO", dV)
show("dP = dO V^T", dP)

# %%
# **From** :math:`P = \operatorname{softmax}_{\text{rows}}(T)`, row by row:
# first the row's weighted mean of :math:`dP`,
# :math:`D_l = \sum_j P_{lj}\, dP_{lj}`, then
# :math:`dT_{lj} = P_{lj}\,(dP_{lj} - D_l)`. Row by row, as you would on
# paper:

D = np.sum(P * dP, axis=1, keepdims=True)
dT = P * (dP - D)
for l in range(Q.shape[0]):
    terms = " + ".join(f"{term(p)} * {term(g)}" for p, g in zip(P[l], dP[l]))
    print(f"row {l}: D_{l} = {terms} = {fmt(D[l, 0]).strip()}")
    print(f"       dT_{l} = P_{l} * (dP_{l} - D_{l}) = [ " + "  ".join(fmt(x) for x in dT[l]) + " ]")
show("D = rowsum(P * dP)", D)
show("dT = P * (dP - D)", dT)

# %%
# Each row of :math:`dT` sums to 0 (adding a constant to a row of scores
# does not change its softmax), and :math:`D` is also
# :math:`\operatorname{rowsum}(dO \odot O)`, the form FlashAttention uses:

np.testing.assert_allclose(dT.sum(axis=1), 0.0, atol=1e-15)
np.testing.assert_allclose(np.sum(dO * O, axis=1, keepdims=True), D, rtol=1e-14)
print("rowsum(dT)     =", "  ".join(fmt(x) for x in dT.sum(axis=1)))
print("rowsum(dO * O) =", "  ".join(fmt(x) for x in np.sum(dO * O, axis=1)))

# %%
# **From** :math:`T = s\, R`: the scale multiplies the gradient on its way
# back, :math:`dR = s\, dT`. **From** :math:`R = Q K^{\top}`, the product
# rule once more:
#
# .. math::
#
#    dQ = dR\, K = s\, dT\, K, \qquad dK = dR^{\top} Q = s\, dT^{\top} Q .

dR = s * dT
dQ = dR @ K
dK = dR.T @ Q
show("dR = s dT", dR)
show("dQ = dR K", dQ)
show("dK = dR^T Q", dK)

# %%
# The teaching core's backward gives the same three gradients, and the
# gradient checker, which differentiates the forward numerically entry by
# entry, accepts them:

dq_core, dk_core, dv_core = core.attention_backward(res_core, dO)
for name, mine, theirs in (("dQ", dQ, dq_core), ("dK", dK, dk_core), ("dV", dV, dv_core)):
    np.testing.assert_allclose(theirs, mine, rtol=1e-13, atol=1e-15)
    print(f"sdpa_ref.core.attention_backward agrees on {name}: max |difference| {np.abs(theirs - mine).max():.1e}")


def attention(q, k, v):
    return core.attention_forward(q, k, v)[0]


def by_hand(g, q, k, v):
    P_ = core.softmax_forward(q @ k.T / np.sqrt(q.shape[-1]))[0]
    dT_ = P_ * (g @ v.T - np.sum(P_ * (g @ v.T), axis=1, keepdims=True))
    return dT_ @ k / np.sqrt(q.shape[-1]), dT_.T @ q / np.sqrt(q.shape[-1]), P_.T @ g


report = sdpa_ref.check_vjp(attention, by_hand, (Q, K, V))
print(report)
if not report.ok:
    raise AssertionError(f"the page's backward fails the gradient checker:\n{report}")

# %%
# The computation graph
# ---------------------
#
# The forward runs down the graph below; the backward walks it back up.
# Each edge carries a value forwards (black) and, in the backward, the
# gradient of the loss with respect to that value, its *adjoint* (red). A
# node's rule turns the adjoint arriving from below into the adjoints of
# its inputs: the product rule at the two products, the softmax's row pass,
# and the scale, which multiplies on the way back as on the way forward.


def matrix(a, digits=2):
    return "\n".join("[" + " ".join(f"{round(x, digits) + 0.0: .{digits}f}" for x in row) + " ]"
                     for row in np.atleast_2d(a))


def draw_graph():
    fig, ax = plt.subplots(figsize=(7.5, 9.5))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 12.6)
    ax.axis("off")
    op = dict(ha="center", va="center", fontsize=12,
              bbox=dict(boxstyle="round,pad=0.4", facecolor="#eef3fb", edgecolor="#3a5a8c"))
    leaf = dict(ha="center", va="center", fontsize=12,
                bbox=dict(boxstyle="round,pad=0.4", facecolor="white", edgecolor="#555555"))
    x = 4.0                                 # the chain runs down one column; V joins from the left
    nodes = {
        "Q": (1.4, 12.0, r"$Q$", leaf), "K": (6.6, 12.0, r"$K$", leaf), "V": (0.5, 2.8, r"$V$", leaf),
        "R": (x, 9.7, r"$R = Q K^{\top}$", op), "T": (x, 7.4, r"$T = s\,R$", op),
        "P": (x, 5.1, r"$P = \mathrm{softmax}_{\mathrm{rows}}(T)$", op), "O": (x, 2.8, r"$O = P V$", op),
        "L": (x, 0.5, r"$\mathcal{L} = \langle dO, O\rangle$", op),
    }
    for nx, ny, text, style in nodes.values():
        ax.text(nx, ny, text, **style)
    edges = [   # (from, to, forward value, adjoint, where the two labels go: x, y, alignment)
        ("Q", "R", ("Q", Q), ("dQ", dQ), (0.0, 10.85, "left")),
        ("K", "R", ("K", K), ("dK", dK), (6.9, 10.85, "left")),
        ("R", "T", ("R", R), ("dR", dR), (x + 0.3, 8.55, "left")),
        ("T", "P", ("T", T), ("dT", dT), (x + 0.3, 6.25, "left")),
        ("P", "O", ("P", P), ("dP", dP), (x + 0.3, 3.95, "left")),
        ("V", "O", ("V", V), ("dV", dV), (0.9, 2.8, "left")),
        ("O", "L", ("O", O), ("dO", dO), (x + 0.3, 1.65, "left")),
    ]
    for a, b, (fname, fval), (bname, bval), (lx, ly, ha) in edges:
        (x0, y0), (x1, y1) = nodes[a][:2], nodes[b][:2]
        ends = ((x1 - 0.75, y1), (x0 + 0.3, y0)) if y0 == y1 else ((x1, y1 + 0.42), (x0, y0 - 0.42))
        ax.annotate("", xy=ends[0], xytext=ends[1],
                    arrowprops=dict(arrowstyle="-|>", color="#333333", lw=1.3, shrinkA=0, shrinkB=0))
        ax.text(lx, ly + 0.06, f"{fname} =\n{matrix(fval)}", ha=ha, va="bottom", fontsize=9.5,
                family="monospace", color="black")
        ax.text(lx, ly - 0.06, f"{bname} =\n{matrix(bval)}", ha=ha, va="top", fontsize=9.5,
                family="monospace", color="#b03020")
    ax.text(0.0, 0.5, f"s = 1/sqrt(2) = {s:.4f}", fontsize=10.5, ha="left", va="center")
    ax.set_title("forward values (black) and their adjoints (red) on the edges", fontsize=11.5)
    fig.tight_layout()
    return fig


draw_graph()
plt.show()

# %%
# Read it from the bottom: :math:`dO` enters at the loss; at
# :math:`O = PV` it splits into :math:`dP` and :math:`dV`; the softmax
# turns :math:`dP` into :math:`dT`; the scale gives :math:`dR = s\,dT`; and
# the product :math:`R = QK^{\top}` hands :math:`dQ` and :math:`dK` to the
# inputs. The two-decimal figures are rounded; the printed lines above
# carry four.
