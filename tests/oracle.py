"""An independent, deliberately plain attention: Python loops and math functions.

It shares no code with sdpa_ref. It follows SEMANTICS.md literally, entry by
entry: the raw score, softcap, the additive terms (float mask, bias, ALiBi),
the allowed set (bool mask, causal, window, lengths, -inf entries), the
softmax over the allowed entries only, the fully-masked policy, query
padding and dropout. The backward goes through the explicit softmax
Jacobian diag(P) - P P^T of each row instead of the package's closed form.

Inputs must already have equal batch dims: q (B, Hq, L, E), k (B, Hkv, S, E),
v (B, Hkv, S, Ev); `mask`, `bias` and `keep` are full (B, Hq, L, S) arrays or
None; `slopes` and `sinks` are (B, Hq) or None; `q_lengths`, `kv_lengths` are (B,) or None.

`num="mp"` evaluates the same loops in 50-digit mpmath (the inputs taken
exactly; q, k, v may then be object arrays of mpf): the exact value of the
formula, for judging faithful rounding. The results are then object arrays.
"""

import math

import numpy as np


class _Float:
    exp, log, tanh, one = math.exp, math.log, math.tanh, 1.0

    @staticmethod
    def array(a):
        return np.asarray(a, dtype=np.float64)

    @staticmethod
    def zeros(shape):
        return np.zeros(shape)


class _Mp:
    def __init__(self, dps=50):
        import mpmath
        self.ctx = mpmath.MPContext()
        self.ctx.dps = dps
        self.exp, self.log, self.tanh, self.one = self.ctx.exp, self.ctx.log, self.ctx.tanh, self.ctx.mpf(1)

    def array(self, a):
        a = np.asarray(a)
        if a.dtype == object:
            return a
        out = np.empty(a.shape, dtype=object)
        for i, x in np.ndenumerate(a):
            out[i] = self.ctx.mpf(float(x))
        return out

    def zeros(self, shape):
        out = np.empty(shape, dtype=object)
        out[...] = self.ctx.mpf(0)
        return out


def oracle_attention(q, k, v, mask=None, is_causal=False, scale=None, keep=None, p=0.0, policy="zero",
                     grad_out=None, bias=None, alignment="top_left", window=None, softcap=None, slopes=None,
                     q_lengths=None, kv_lengths=None, num="float", sinks=None, q_offset=None, alibi_mode="flash",
                     kv_indices=None, topk_length=None):
    """``q_offset`` (B,): the diagonal at ``i + q_offset[b]``; ``alibi_mode="cudnn"``: cuDNN's ``slope * (j - i)``;
    ``kv_indices`` (B, Hq, L, K) with ``topk_length`` (B, Hq, L): FlashMLA's sparse rows (the first
    ``topk_length`` indices count; one outside ``[0, S)`` names no key)."""
    M = _Mp() if num == "mp" else _Float
    q, k, v = (M.array(a) for a in (q, k, v))
    B, Hq, L, E = q.shape
    _, Hkv, S, Ev = v.shape
    G = Hq // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E else 1.0
    scale = M.one * scale
    if grad_out is not None:
        grad_out = M.array(grad_out)
    left, right = (None, None) if window is None else window
    left = None if left == -1 else left
    right = None if right == -1 else right
    out = M.zeros((B, Hq, L, Ev))
    lse = M.zeros((B, Hq, L))
    want_grads = grad_out is not None
    if want_grads:
        dq, dk, dv = M.zeros(q.shape), M.zeros(k.shape), M.zeros(v.shape)
        dT_all = M.zeros((B, Hq, L, S))
        dsink = M.zeros((B, Hq))
    for b in range(B):
        ql = L if q_lengths is None else int(q_lengths[b])
        kl = S if kv_lengths is None else int(kv_lengths[b])
        off = 0 if alignment == "top_left" else kl - ql
        if q_offset is not None:
            off = int(q_offset[b])
        for h in range(Hq):
            kh = h // G
            for i in range(L):
                t = [0.0] * S
                th = [0.0] * S
                allowed = [True] * S
                for j in range(S):
                    dot = 0.0
                    for e in range(E):
                        dot += q[b, h, i, e] * k[b, kh, j, e]
                    raw = scale * dot
                    if softcap is not None:
                        th[j] = M.tanh(raw / softcap)
                        t[j] = softcap * th[j]
                    else:
                        t[j] = raw
                    if mask is not None:
                        mval = mask[b, h, i, j]
                        if isinstance(mval, (bool, np.bool_)):
                            allowed[j] = allowed[j] and bool(mval)
                        else:
                            t[j] += float(mval)
                    if bias is not None:
                        t[j] += float(bias[b, h, i, j])
                    if slopes is not None:
                        if alibi_mode == "cudnn":
                            t[j] += (M.one * float(slopes[b, h])) * (j - i)
                        else:
                            t[j] += -(M.one * float(slopes[b, h])) * abs(i + off - j)
                    if t[j] == -math.inf:
                        allowed[j] = False
                    if is_causal and j > i + off:
                        allowed[j] = False
                    if left is not None and j < i + off - left:
                        allowed[j] = False
                    if right is not None and j > i + off + right:
                        allowed[j] = False
                    if j >= kl:
                        allowed[j] = False
                    if kv_indices is not None:
                        n = kv_indices.shape[-1] if topk_length is None else int(topk_length[b, h, i])
                        if j not in [int(x) for x in kv_indices[b, h, i, :n]]:
                            allowed[j] = False
                padded = i >= ql
                js = [j for j in range(S) if allowed[j]] if not padded else []
                P = [0.0] * S
                score_dependent = True
                sig = -math.inf if sinks is None or padded else sinks[b, h]
                p_sink = 0.0
                if sig != -math.inf:                   # a sink: one more logit in the normaliser, no value
                    mx = max([t[j] for j in js] + [sig])
                    tot = sum(M.exp(t[j] - mx) for j in js) + M.exp(sig - mx)
                    for j in js:
                        P[j] = M.exp(t[j] - mx) / tot
                    p_sink = M.exp(sig - mx) / tot
                    lse[b, h, i] = mx + M.log(tot)
                elif not js:
                    lse[b, h, i] = -math.inf
                    if not padded and policy == "nan":
                        P = [math.nan] * S
                    elif not padded and policy == "uniform":
                        P = [M.one / S] * S
                        score_dependent = False
                else:
                    mx = max(t[j] for j in js)
                    tot = sum(M.exp(t[j] - mx) for j in js)
                    for j in js:
                        P[j] = M.exp(t[j] - mx) / tot
                    lse[b, h, i] = mx + M.log(tot)
                drop = [1.0] * S
                if keep is not None:
                    drop = [(M.one if keep[b, h, i, j] else 0.0) / (M.one - p) for j in range(S)]
                for e in range(Ev):
                    out[b, h, i, e] = sum(P[j] * drop[j] * v[b, kh, j, e] for j in range(S))
                if not want_grads:
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
                # the sink's column: dP_l / dsigma = -P_l p_sink
                if sinks is not None:          # IEEE: a "nan" row makes its head's dsink NaN, sink or none
                    dsink[b, h] += sum(-P[l] * p_sink * dP[l] for l in range(S))
                for j in range(S):
                    dT_all[b, h, i, j] = dT[j]
                    d_raw = dT[j] * (M.one - th[j] ** 2) if softcap is not None else dT[j]
                    for e in range(E):
                        dq[b, h, i, e] += scale * d_raw * k[b, kh, j, e]
                        dk[b, kh, j, e] += scale * d_raw * q[b, h, i, e]
    grads = ((dq, dk, dv, dT_all) + (() if sinks is None else (dsink,))) if want_grads else None
    return out, lse, grads


def mp_shifted(ctx, a, t, sign, h):
    """``a + sign * h * t`` entry by entry in the mpmath context ``ctx`` (object array): one side of a central
    difference taken in many digits, so its error is O(h^2) in the exact arithmetic."""
    out = np.empty(a.shape, dtype=object)
    for i, x in np.ndenumerate(a):
        out[i] = ctx.mpf(float(x)) + sign * h * ctx.mpf(float(t[i]))
    return out
