"""The exercises' solutions, one function per exercise, shown on the pages only inside a folded solution.

The exercise pages (``exercises/ex1_wrong_gradients.py``, ``exercises/ex2_derive_one_line.py``) show the code
with its one wrong line; each solution here is that code with the line right, and has the same name. The pages
include each function with ``literalinclude :pyobject:`` inside a dropdown and run it through the package's
checker when the site is built (:func:`exercise`: the build fails if a solution fails it or a wrong version
passes it); their ``EXERCISES`` lists, which ``tests/test_docs_sources_derivation.py`` runs through the checkers
again, name every exercise. The file lives beside ``conf.py``, which puts this folder on ``sys.path``, outside
the gallery's folders, so that no page is made of it.
"""

import numpy as np


def exercise(registry, name, check, wrong, solution, blamed=None):
    """Run the wrong version and the solution through ``check`` (an answer -> report with ``.ok``); the wrong one
    must fail (blaming exactly the inputs ``blamed``, where given) and the solution pass. Appends the exercise to
    ``registry``; returns None, so that a page's last line shows no repr."""
    rep, fixed = check(wrong), check(solution)
    if rep.ok:
        raise AssertionError(f"exercise {name}: the checker passed the wrong version:\n{rep}")
    if not fixed.ok:
        raise AssertionError(f"exercise {name}: the solution fails the checker:\n{fixed}")
    if blamed is not None:
        got = [row["arg"] for row in rep.per_arg if row["failed"]]
        if got != blamed:
            raise AssertionError(f"exercise {name}: expected the checker to blame args {blamed}, it blamed {got}")
    registry.append((name, check, wrong, solution))


def swap(a):
    """Transpose the last two axes (the matrix transpose, batched)."""
    return np.swapaxes(a, -1, -2)


def softmax_forward(x):
    """Softmax along the last axis, shifted by the row maximum."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ------------------------------------------------------------------ ex1: find the wrong line

def softmax_vjp_1(g, x):
    y = softmax_forward(x)
    dx = y * (g - np.sum(y * g, axis=-1, keepdims=True))
    return dx


def softmax_vjp_2(g, x):
    y = softmax_forward(x)
    # J = diag(y) - y y^T, so J^T g = y * g - y (y . g)
    dx = y * (g - np.sum(y * g, axis=-1, keepdims=True))
    return dx


def attention_vjp_3(g, q, k, v):
    d_k = q.shape[-1]
    P = softmax_forward(q @ swap(k) / np.sqrt(d_k))
    dv = swap(P) @ g                                          # O = P V
    dP = g @ swap(v)
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))    # P = softmax(S)
    dq = dS @ k / np.sqrt(d_k)                                # S = Q K^T / sqrt(d_k)
    dk = swap(dS) @ q / np.sqrt(d_k)
    return dq, dk, dv


def attention_vjp_4(g, q, k, v):
    d_k = q.shape[-1]
    P = softmax_forward(q @ swap(k) / np.sqrt(d_k))
    dv = swap(P) @ g
    dP = g @ swap(v)
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq = dS @ k / np.sqrt(d_k)
    dk = swap(dS) @ q / np.sqrt(d_k)
    return dq, dk, dv


def attention_vjp_5(g, q, k, v):
    scale = 1.0 / np.sqrt(q.shape[-1])
    P = softmax_forward(scale * (q @ swap(k)))
    dv = swap(P) @ g
    dP = g @ swap(v)
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq = scale * (dS @ k)
    dk = scale * (swap(dS) @ q)
    return dq, dk, dv


def attention_jvp_6(tangents, q, k, v):
    tq, tk, tv = tangents
    scale = 1.0 / np.sqrt(q.shape[-1])
    P = softmax_forward(scale * (q @ swap(k)))
    dS = scale * (tq @ swap(k) + q @ swap(tk))                 # S = scale Q K^T
    dP = P * (dS - np.sum(P * dS, axis=-1, keepdims=True))     # P = softmax(S)
    return dP @ v + P @ tv                                     # O = P V


# ------------------------------------------------------------------ ex2: derive one line

def scale_vjp(g, q, k, v, scale):
    S = q @ swap(k)                                            # T = scale S
    P = softmax_forward(scale * S)
    dP = g @ swap(v)
    dT = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq, dk, dv = scale * (dT @ k), scale * (swap(dT) @ q), swap(P) @ g
    dscale = np.sum(dT * S)                                    # T = scale S: dscale = <dT, S>
    return dq, dk, dv, dscale


def mask_vjp(g, q, k, v, mask):
    scale = 1.0 / np.sqrt(q.shape[-1])
    P = softmax_forward(scale * (q @ swap(k)) + mask)          # T = scale Q K^T + mask
    dP = g @ swap(v)
    dT = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))
    dq, dk, dv = scale * (dT @ k), scale * (swap(dT) @ q), swap(P) @ g
    dmask = np.sum(dT, axis=0)                                 # added as it is: dT, summed over the heads
    return dq, dk, dv, dmask


def lse_vjp(g, q, k):
    scale = 1.0 / np.sqrt(q.shape[-1])
    T = scale * (q @ swap(k))
    P = softmax_forward(T)
    dT = P * g[..., None]                                      # d lse_l / d T_lj = P_lj
    return scale * (dT @ k), scale * (swap(dT) @ q)


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
    dsinks = -np.sum(p_sink * D[..., 0], axis=-1)              # p_sink (0 - D), summed over the head's rows
    return dq, dk, dv, dsinks


def variance_and_scale(d_k):
    return d_k, 1 / np.sqrt(d_k)                               # Var(q . k) = d_k; scale 1/sqrt(d_k) makes it 1
