"""
The Hessian of a tiny Transformer along one direction
=====================================================

Second order by hand, composed through a model. A one-layer attention
block (causal, softcapped, two heads, a residual and an output projection)
with a squared-error loss; its Hessian-vector product :math:`H u` along a
random direction :math:`u` of all four weight matrices is built from

* the chain rule for the projections (their second derivatives are
  products of first ones), and
* ``sdpa_backward_jvp``: attention's double backward, with the tangent of
  its cotangent (the loss's gradient moves with the weights too).

The claims: :math:`Hu` equals the central difference of the gradient along
:math:`u`; ``check_hvp`` passes it (against the differenced gradient, and
:math:`\\langle w, Hu\\rangle = \\langle Hw, u\\rangle`); and the quadratic
model :math:`L + t\\,g^T u + \\tfrac12 t^2 u^T H u` predicts the loss with an
error that falls like :math:`t^3`. Power iteration on :math:`H` then gives
its largest eigenvalue, checked by its residual.

Run: ``python examples/hessian_transformer.py``   (exits 1 if a claim fails)
"""

import sys

import numpy as np

from sdpa_ref import check_hvp, sdpa_backward, sdpa_backward_jvp, sdpa_forward, sdpa_jvp

failures = []


def claim(ok, text):
    print(("  ok    " if ok else "  FAIL  ") + text)
    if not ok:
        failures.append(text)


rng = np.random.default_rng(0)
B, L, D, H, E = 2, 6, 8, 2, 4
OPTS = dict(is_causal=True, softcap=3.0)
x = rng.standard_normal((B, L, D))
target = rng.standard_normal((B, L, D))
N = target.size
W0 = [rng.standard_normal((D, H, E)) / np.sqrt(D) for _ in range(3)] + [rng.standard_normal((H, E, D)) / np.sqrt(H * E)]


def project(W):
    return [np.einsum("bld,dhe->bhle", x, w) for w in W[:3]]


def loss(*W):
    q, k, v = project(W)
    o = sdpa_forward(q, k, v, **OPTS)[0]
    y = x + np.einsum("bhle,hed->bld", o, W[3])
    return np.array(0.5 * np.sum((y - target) ** 2) / N)


def gradient(g, *W):
    """dL/dW for the loss's cotangent g (a scalar array)."""
    q, k, v = project(W)
    o, res = sdpa_forward(q, k, v, **OPTS)
    dy = float(g) * (x + np.einsum("bhle,hed->bld", o, W[3]) - target) / N
    d = sdpa_backward(res, np.einsum("bld,hed->bhle", dy, W[3]))
    return [np.einsum("bld,bhle->dhe", x, d.query), np.einsum("bld,bhle->dhe", x, d.key),
            np.einsum("bld,bhle->dhe", x, d.value), np.einsum("bhle,bld->hed", o, dy)]


def hvp(g, U, *W):
    """H u: the tangent of every line of `gradient` along u."""
    q, k, v = project(W)
    tq, tk, tv = project(U)                                       # the projections are linear
    o, to = sdpa_jvp((q, k, v), (tq, tk, tv), **OPTS)             # O and its tangent
    y = x + np.einsum("bhle,hed->bld", o, W[3])
    dy = float(g) * (y - target) / N
    ty = np.einsum("bhle,hed->bld", to, W[3]) + np.einsum("bhle,hed->bld", o, U[3])
    tdy = float(g) * ty / N
    dO = np.einsum("bld,hed->bhle", dy, W[3])
    tdO = np.einsum("bld,hed->bhle", tdy, W[3]) + np.einsum("bld,hed->bhle", dy, U[3])
    _, t = sdpa_backward_jvp((q, k, v), (tq, tk, tv), dO, tdO, **OPTS)      # attention's double backward
    return [np.einsum("bld,bhle->dhe", x, t.query), np.einsum("bld,bhle->dhe", x, t.key),
            np.einsum("bld,bhle->dhe", x, t.value),
            np.einsum("bhle,bld->hed", to, dy) + np.einsum("bhle,bld->hed", o, tdy)]


def dot(a, b):
    return sum(float(np.vdot(x_, y_)) for x_, y_ in zip(a, b))


one = np.array(1.0)
u = [rng.standard_normal(w.shape) for w in W0]
Hu = hvp(one, u, *W0)
h = 1e-4
fd = [(a - b) / (2 * h) for a, b in zip(gradient(one, *[w + h * d for w, d in zip(W0, u)]),
                                        gradient(one, *[w - h * d for w, d in zip(W0, u)]))]
err = max(np.abs(a - b).max() for a, b in zip(Hu, fd)) / max(np.abs(b).max() for b in fd)
print(f"H u against the central difference of the gradient along u: max rel {err:.1e}")
claim(err < 1e-6, "H u is the derivative of the gradient along u")

rep = check_hvp(loss, gradient, hvp, W0, cotangent=one, mode="projection", rtol=1e-6)
print("  " + str(rep).replace("\n", "\n  "))
claim(rep.ok, "check_hvp: H u against the differenced gradient on random directions, and H symmetric")

# %%
# The quadratic model
# -------------------
# :math:`L(W + t u) - (L + t g^T u + \tfrac12 t^2 u^T H u)` is :math:`O(t^3)`:
# halving :math:`t` divides it by about 8.

L0, gu, uHu = float(loss(*W0)), dot(gradient(one, *W0), u), dot(u, Hu)
print(f"\nL = {L0:.6f}, g.u = {gu:.6f}, u.Hu = {uHu:.6f}")
print(f"{'t':>8} {'L(W + t u)':>14} {'quadratic model':>16} {'error':>10}")
errs = []
for t in (0.08, 0.04, 0.02, 0.01):
    actual = float(loss(*[w + t * d for w, d in zip(W0, u)]))
    model = L0 + t * gu + 0.5 * t * t * uHu
    errs.append(abs(actual - model))
    print(f"{t:>8.3f} {actual:>14.8f} {model:>16.8f} {errs[-1]:>10.2e}")
ratios = [a / b for a, b in zip(errs, errs[1:])]
claim(all(6.0 < r < 10.0 for r in ratios), "the quadratic model's error falls like t^3 (ratios "
      + ", ".join(f"{r:.2f}" for r in ratios) + " on halving t)")

# %%
# The largest eigenvalue
# ----------------------
# Power iteration needs only :math:`H v`; 60 products give the eigenvalue of
# largest magnitude, checked by the residual :math:`\|H v - \lambda v\|`.

vec = [rng.standard_normal(w.shape) for w in W0]
for _ in range(60):
    n = np.sqrt(dot(vec, vec))
    vec = [a / n for a in vec]
    Hv = hvp(one, vec, *W0)
    lam = dot(vec, Hv)
    vec = Hv
n = np.sqrt(dot(vec, vec))
vec = [a / n for a in vec]
Hv = hvp(one, vec, *W0)
lam = dot(vec, Hv)
resid = np.sqrt(dot([a - lam * b for a, b in zip(Hv, vec)], [a - lam * b for a, b in zip(Hv, vec)]))
print(f"\nthe eigenvalue of largest magnitude: {lam:.6f}, residual |Hv - lambda v| = {resid:.1e}")
claim(resid < 1e-3 * abs(lam), "power iteration converged to an eigenpair of H")

print("\n" + ("all claims hold" if not failures else f"{len(failures)} claim(s) FAILED"))
if failures:
    sys.exit("hessian_transformer.py: " + "; ".join(failures))
