"""An independent, deliberately plain attention: Python loops and math.exp.

It shares no code with sdpa_ref. It follows SEMANTICS.md literally: the
allowed set is built entry by entry, the softmax is taken over the allowed
entries only, and the backward goes through the explicit softmax Jacobian
diag(P) - P P^T of each row instead of the package's closed form.

Inputs must already have equal batch dims: q (B, Hq, L, E), k (B, Hkv, S, E),
v (B, Hkv, S, Ev); `mask` and `keep` are full (B, Hq, L, S) arrays or None.
"""

import math

import numpy as np


def oracle_attention(q, k, v, mask=None, is_causal=False, scale=None, keep=None, p=0.0,
                     policy="zero", grad_out=None):
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    G = Hq // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    out = np.zeros((B, Hq, L, Ev))
    lse = np.zeros((B, Hq, L))
    grads = None
    if grad_out is not None:
        dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
        dmask = np.zeros((B, Hq, L, S))
    for b in range(B):
        for h in range(Hq):
            kh = h // G
            for i in range(L):
                t = [0.0] * S
                allowed = [True] * S
                for j in range(S):
                    dot = 0.0
                    for e in range(E):
                        dot += q[b, h, i, e] * k[b, kh, j, e]
                    t[j] = scale * dot
                    if mask is not None:
                        mval = mask[b, h, i, j]
                        if isinstance(mval, (bool, np.bool_)):
                            allowed[j] = bool(mval)
                        else:
                            t[j] += float(mval)
                            if t[j] == -math.inf:
                                allowed[j] = False
                    if is_causal and j > i:
                        allowed[j] = False
                js = [j for j in range(S) if allowed[j]]
                P = [0.0] * S
                score_dependent = True
                if not js:
                    lse[b, h, i] = -math.inf
                    if policy == "nan":
                        P = [math.nan] * S
                    elif policy == "uniform":
                        P = [1.0 / S] * S
                        score_dependent = False
                else:
                    mx = max(t[j] for j in js)
                    tot = sum(math.exp(t[j] - mx) for j in js)
                    for j in js:
                        P[j] = math.exp(t[j] - mx) / tot
                    lse[b, h, i] = mx + math.log(tot)
                drop = [1.0] * S
                if keep is not None:
                    drop = [(1.0 if keep[b, h, i, j] else 0.0) / (1.0 - p) for j in range(S)]
                for e in range(Ev):
                    out[b, h, i, e] = sum(P[j] * drop[j] * v[b, kh, j, e] for j in range(S))
                if grad_out is None:
                    continue
                g = grad_out[b, h, i]
                dP = [drop[j] * sum(g[e] * v[b, kh, j, e] for e in range(Ev)) for j in range(S)]
                for j in range(S):
                    for e in range(Ev):
                        dv[b, kh, j, e] += P[j] * drop[j] * g[e]
                # explicit Jacobian of the row softmax: J[l][j] = dP_l / dT_j
                dT = [0.0] * S
                if score_dependent:
                    for j in range(S):
                        acc = 0.0
                        for l in range(S):
                            J_lj = (P[l] if l == j else 0.0) - P[l] * P[j]
                            acc += J_lj * dP[l]
                        dT[j] = acc
                for j in range(S):
                    dmask[b, h, i, j] = dT[j]
                    for e in range(E):
                        dq[b, h, i, e] += scale * dT[j] * k[b, kh, j, e]
                        dk[b, kh, j, e] += scale * dT[j] * q[b, h, i, e]
    if grad_out is not None:
        grads = (dq, dk, dv, dmask)
    return out, lse, grads
