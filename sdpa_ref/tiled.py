r"""The tiled path: FlashAttention's algorithm in NumPy, in bounded memory.

``sdpa_forward(..., block_size=b)`` lands here. The scores are never
materialised: the forward walks key blocks of ``b`` columns for each block of
``b`` query rows, keeping a running max ``m``, sum ``l`` and output
accumulator (the online softmax), and stores only ``O`` and ``lse``. The
backward walks the same blocks and recomputes each block's
:math:`P = e^{T - \mathrm{lse}}`, with :math:`D = \mathrm{rowsum}(dO \odot O)`.

Per block of rows ``I`` and keys ``J`` (all batch entries and heads at once)::

    T_IJ   = scores of the block (softcap, mask, bias, ALiBi, -inf outside A)
    m_new  = max(m, rowmax T_IJ)
    l      = l * e^(m - m_new) + rowsum e^(T_IJ - m_new)
    acc    = acc * e^(m - m_new) + (e^(T_IJ - m_new) * Z / (1-p)) V_J
    ...
    O_I    = acc / l,   lse_I = m + log l

Blocks that the structural masks (causal, window, lengths, a bool mask)
exclude entirely are skipped in both passes. Peak memory is
``O((L + S) (E + Ev) + b^2)`` per head on top of the inputs: a mask, bias or
dropout mask that the *user* passes at full ``(L, S)`` size is of course
read block by block but not copied.

Fully masked rows follow the same policies as the dense path: zeros, NaN, or
(``"uniform"``) the mean of V over all keys, computed in a second pass over
the keys for the row blocks that have such rows.
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

from ._problem import Problem, slice_ls

__all__ = ["DEFAULT_BLOCK_BUDGET", "auto_block_size", "check_block_size", "tiled_forward", "tiled_backward"]

#: Memory budget (bytes) for the block temporaries of ``block_size="auto"``.
DEFAULT_BLOCK_BUDGET = 64 * 2**20
#: How many block-sized float64 temporaries a backward step holds at once.
_TEMPS = 6


def check_block_size(block_size, prob: Problem):
    """``None``, a positive int, or ``"auto"`` (resolved here)."""
    if block_size is None:
        return None
    if isinstance(block_size, str):
        if block_size != "auto":
            raise ValueError(f"`block_size` should be None, a positive int or 'auto', but got {block_size!r}")
        return auto_block_size(prob)
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (numbers.Integral, np.integer)) \
            or block_size < 1:
        raise ValueError(f"`block_size` should be None, a positive int or 'auto', but got {block_size!r}")
    return int(block_size)


def auto_block_size(prob: Problem, budget: int = DEFAULT_BLOCK_BUDGET) -> int:
    """The largest multiple of 16 (at least 16) whose block temporaries fit ``budget``.

    A block holds ``n_heads_total * b * b`` entries, ``n_heads_total`` being the
    product of the batch dims and ``Hq``; about six such arrays live at once.
    """
    L, S = prob.full_scores[-2:]
    heads = int(np.prod(prob.full_scores[:-2])) or 1
    itemsize = np.dtype(prob.dtype).itemsize
    b = int(np.sqrt(budget / (_TEMPS * itemsize * heads)))
    b = max(16, (b // 16) * 16)
    return max(1, min(b, max(L, S, 1)))


# ------------------------------------------------------------------ blocks


class _Blocks:
    """Scores, masks and dropout of one (row block, key block) of a problem."""

    def __init__(self, prob: Problem):
        self.p = prob
        full = prob.full_scores
        self.batch, (self.Hq, self.L, self.S) = full[:-3], full[-3:]
        self.Hkv = prob.k.shape[-3]
        self.G = self.Hq // self.Hkv if self.Hkv else 1
        E = prob.q.shape[-1]
        # queries as (..., Hkv, G, L, E): rows of one head stay contiguous in L
        self.q5 = prob.q.reshape(prob.q.shape[:-2] + (self.G, self.L, E))
        self.k4, self.v4 = prob.k, prob.v

    def allowed(self, i0, i1, j0, j1):
        """Structural allowed set of the block, broadcastable to (..., Hq, bi, bj), or None."""
        return self.p.allowed((i0, i1), (j0, j1))

    def scores(self, i0, i1, j0, j1, allowed):
        """``T`` of the block, ``(..., Hq, bi, bj)``, and ``tanh`` with softcap."""
        p = self.p
        q = self.q5[..., i0:i1, :]                                  # (..., Hkv, G, bi, E)
        k = self.k4[..., None, j0:j1, :]                            # (..., Hkv, 1, bj, E)
        T = (p.scale * q) @ np.swapaxes(k, -1, -2)
        T = T.reshape(T.shape[:-4] + (self.Hq, i1 - i0, j1 - j0))
        th = None
        if p.softcap is not None:
            th = np.tanh(T / p.softcap)
            T = p.softcap * th
        if p.mask_float is not None:
            T = T + slice_ls(p.mask_float, i0, i1, j0, j1)
        if p.bias is not None:
            T = T + slice_ls(p.bias, i0, i1, j0, j1)
        if p.alibi is not None:
            T = T + p.alibi_bias((i0, i1), (j0, j1))
        if allowed is not None:
            T = np.where(allowed, T, -np.inf)
        return T, th

    def keep(self, i0, i1, j0, j1):
        if self.p.keep is None:
            return None
        return slice_ls(self.p.keep, i0, i1, j0, j1)

    def times_v(self, P, j0, j1):
        """``P (..., Hq, bi, bj) @ V_J`` per kv head: ``(..., Hq, bi, Ev)``."""
        P5 = P.reshape(P.shape[:-3] + (self.Hkv, self.G) + P.shape[-2:])
        out = P5 @ self.v4[..., None, j0:j1, :]
        return out.reshape(out.shape[:-4] + (self.Hq,) + out.shape[-2:])

    def grouped(self, x):
        """(..., Hq, b, n) -> (..., Hkv, G, b, n)."""
        return x.reshape(x.shape[:-3] + (self.Hkv, self.G) + x.shape[-2:])


def _ranges(n, b):
    return [(s, min(s + b, n)) for s in range(0, n, b)] if n else []


def _drop(x, keep, p):
    if keep is None:
        return x
    return x * (keep.astype(x.real.dtype) * x.real.dtype.type(1.0 / (1.0 - p)))


# ----------------------------------------------------------------- forward


def tiled_forward(prob: Problem, block: int):
    """Online-softmax forward; returns ``O`` (full layout), ``lse`` ``(..., Hq, L)``, empty and padded rows."""
    bl = _Blocks(prob)
    L, S, Hq = bl.L, bl.S, bl.Hq
    lead = prob.batch + (Hq,)
    Ev = prob.v.shape[-1]
    ct = prob.dtype
    O = np.zeros(lead + (L, Ev), dtype=ct)
    lse = np.full(lead + (L,), -np.inf, dtype=np.finfo(ct).dtype)
    empty = np.zeros(lead + (L, 1), dtype=bool)
    for i0, i1 in _ranges(L, block):
        m = np.full(lead + (i1 - i0, 1), -np.inf)
        l = np.zeros(lead + (i1 - i0, 1), dtype=ct)
        acc = np.zeros(lead + (i1 - i0, Ev), dtype=ct)
        for j0, j1 in _ranges(S, block):
            allowed = bl.allowed(i0, i1, j0, j1)
            if allowed is not None and not np.any(allowed):
                continue                                            # a wholly masked block
            T, _ = bl.scores(i0, i1, j0, j1, allowed)
            m_new = np.maximum(m, np.max(T.real, axis=-1, keepdims=True))
            shift = np.where(m_new == -np.inf, 0.0, m_new)
            with np.errstate(invalid="ignore", over="ignore"):
                alpha = np.exp(m - shift)                           # 0 where m was -inf
                e = np.exp(T - shift)
            l = l * alpha + e.sum(axis=-1, keepdims=True)
            acc = acc * alpha + bl.times_v(_drop(e, bl.keep(i0, i1, j0, j1), prob.dropout_p), j0, j1)
            m = m_new
        row_empty = (m == -np.inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            out = acc / l
            lse[..., i0:i1] = (np.log(l) + np.where(row_empty, 0.0, m))[..., 0].real
        out = _policy_rows(prob, bl, out, row_empty, i0, i1)
        O[..., i0:i1, :] = out
        empty[..., i0:i1, :] = row_empty
    padded = prob.padded_rows()
    if prob.fully_masked == "nan" and S == 0:
        O[...] = np.nan
        if padded is not None:
            O = np.where(padded, 0.0, O)
    return O, lse, empty, padded


def _policy_rows(prob, bl, out, row_empty, i0, i1):
    """Apply ``fully_masked`` to the rows of a block that saw no key; padded rows are 0."""
    padded = None
    if prob.q_lengths is not None:
        padded = np.arange(i0, i1)[:, None] >= prob.q_lengths.reshape(prob.q_lengths.shape + (1, 1, 1))
    if not np.any(row_empty):
        return out
    pol = prob.fully_masked
    if pol == "zero":
        out = np.where(row_empty, 0.0, out)
    elif pol == "nan":
        out = np.where(row_empty, np.nan, out)
    else:                                                           # uniform over all S keys
        S = bl.S
        u = np.zeros(out.shape, dtype=out.dtype)
        for j0, j1 in _ranges(S, max(1, i1 - i0)):
            w = np.full(out.shape[:-1] + (j1 - j0,), 1.0 / S, dtype=out.dtype)
            u = u + bl.times_v(_drop(w, bl.keep(i0, i1, j0, j1), prob.dropout_p), j0, j1)
        out = np.where(row_empty, u, out)
    if padded is not None:
        out = np.where(padded, 0.0, out)
    return out


# ---------------------------------------------------------------- backward


def tiled_backward(prob: Problem, O, lse, empty, g, block: int):
    """Blockwise recomputation backward; returns dT-derived grads as in the dense path."""
    from .attention import AttentionGrads, _unbroadcast

    bl = _Blocks(prob)
    L, S, Hq, Hkv, G = bl.L, bl.S, bl.Hq, bl.Hkv, bl.G
    ct = prob.dtype
    full = prob.full_scores
    dO = g.astype(ct, copy=False).reshape(full[:-1] + (g.shape[-1],))
    Ofull = O.reshape(dO.shape)
    D = np.sum(dO * Ofull, axis=-1, keepdims=True)                  # rowsum(dO * O)
    lse_full = lse.reshape(full[:-1] + (1,))
    E = prob.q.shape[-1]
    dq = np.zeros(full[:-1] + (E,), dtype=ct)
    dk = np.zeros(prob.batch + (Hkv, S, E), dtype=ct)
    dv = np.zeros(prob.batch + (Hkv, S, prob.v.shape[-1]), dtype=ct)
    dmask = None if prob.mask_float is None else np.zeros(prob.shapes["attn_mask"], dtype=ct)
    dbias = None if prob.bias is None else np.zeros(prob.shapes["bias"], dtype=ct)
    uniform = prob.fully_masked == "uniform"
    padded = prob.padded_rows()
    for i0, i1 in _ranges(L, block):
        em = empty[..., i0:i1, :]
        pad = None if padded is None else padded[..., i0:i1, :]
        lse_i = np.where(em, 0.0, lse_full[..., i0:i1, :])
        dO_i, D_i = dO[..., i0:i1, :], D[..., i0:i1, :]
        q_i = bl.q5[..., i0:i1, :]
        for j0, j1 in _ranges(S, block):
            allowed = bl.allowed(i0, i1, j0, j1)
            skip = allowed is not None and not np.any(allowed)
            if skip and not (uniform and np.any(em)) and not (prob.fully_masked == "nan" and np.any(em)):
                continue
            if skip:
                T = np.full(prob.batch + (Hq, i1 - i0, j1 - j0), -np.inf, dtype=ct)
                th = None
            else:
                T, th = bl.scores(i0, i1, j0, j1, allowed)
            with np.errstate(invalid="ignore", over="ignore"):
                P = np.exp(T - lse_i)
            if np.any(em):
                fill = {"zero": 0.0, "nan": np.nan, "uniform": 1.0 / S}[prob.fully_masked]
                P = np.where(em, fill, P)
                if pad is not None and prob.fully_masked != "zero":
                    P = np.where(pad, 0.0, P)
            keep = bl.keep(i0, i1, j0, j1)
            P_drop = _drop(P, keep, prob.dropout_p)
            # dV_J += P_drop^T dO_I, summed over the group
            Pg, dOg = bl.grouped(P_drop), bl.grouped(dO_i)
            dv[..., j0:j1, :] += _sum_group(np.swapaxes(Pg, -1, -2) @ dOg)
            # dP = dO V^T * Z / (1-p);  dT = P * (dP - D)
            dP = dOg @ np.swapaxes(prob.v[..., None, j0:j1, :], -1, -2)
            dP = _drop(dP.reshape(P.shape), keep, prob.dropout_p)
            dT = P * (dP - D_i)
            if uniform and np.any(em):
                dT = np.where(em, 0.0, dT)
            if dmask is not None:
                _add_block(dmask, dT, i0, i1, j0, j1, _unbroadcast)
            if dbias is not None:
                _add_block(dbias, dT, i0, i1, j0, j1, _unbroadcast)
            if th is not None:
                dT = dT * (1.0 - th * th)
            dTg = bl.grouped(dT)
            dq_i = prob.scale * (dTg @ prob.k[..., None, j0:j1, :])   # (..., Hkv, G, bi, E)
            dq[..., i0:i1, :] += dq_i.reshape(dq_i.shape[:-4] + (Hq,) + dq_i.shape[-2:])
            dk[..., j0:j1, :] += _sum_group(prob.scale * (np.swapaxes(dTg, -1, -2) @ q_i))
    shapes, dtypes = prob.shapes, prob.dtypes
    return AttentionGrads(
        query=_unbroadcast(dq, shapes["query"]).astype(dtypes["query"], copy=False),
        key=_unbroadcast(dk, shapes["key"]).astype(dtypes["key"], copy=False),
        value=_unbroadcast(dv, shapes["value"]).astype(dtypes["value"], copy=False),
        attn_mask=None if dmask is None else dmask.astype(dtypes["attn_mask"], copy=False),
        bias=None if dbias is None else dbias.astype(dtypes["bias"], copy=False),
    )


def _sum_group(x):
    """(..., Hkv, G, b, n) summed over the group G: (..., Hkv, b, n)."""
    return x.sum(axis=-3)


def _add_block(acc, dT, i0, i1, j0, j1, unbroadcast):
    """Add a block's dT into a gradient of a (possibly broadcast) mask or bias."""
    view = slice_ls(acc, i0, i1, j0, j1)       # a view: += writes through
    view += unbroadcast(dT, view.shape)
