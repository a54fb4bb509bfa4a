r"""The tiled engine: FlashAttention's algorithm in NumPy, in bounded memory.

``method="tiled"`` (or ``block_size=b``) lands here. The scores are never
materialised: the forward walks key blocks of ``b`` columns for each block of
``b`` query rows, keeping a running max ``m``, sum ``l`` and output
accumulator (the online softmax), and stores only ``O``, ``lse`` and the row
max and sum that make it. The
backward walks the same blocks and recomputes each block's
:math:`P = e^{T - m} / s` from the row max :math:`m` and sum :math:`s`
that the forward kept apart (:math:`e^{T - \mathrm{lse}}` would lose what
``lse = m + log s`` rounded away: everything, once the scores are large),
with the softmax VJP in the pivoted form of
:func:`sdpa_ref.softmax.row_pivot`.
It is also the ``"lse"`` backward of dense residuals (:func:`lse_blocks`: row
blocks holding every key): FlashAttention's recomputing backward, made stable.

Per block of rows ``I`` and keys ``J`` (all batch entries and heads at once)::

    T_IJ   = transform_scores(scale * Q_I K_J^T)     the same chain as every engine
    m_new  = max(m, rowmax T_IJ)
    l      = l * e^(m - m_new) + rowsum e^(T_IJ - m_new)
    acc    = acc * e^(m - m_new) + (e^(T_IJ - m_new) * Z / (1-p)) V_J
    ...
    O_I    = acc / l,   lse_I = m + log l          (m and l kept for the backward)

Blocks that the allowed set excludes entirely are skipped in both passes.
Peak memory is ``O((L + S) (E + Ev) + b^2)`` per head on top of the inputs.
Fully masked rows follow the same policies as the other engines (the uniform
one in a second pass over the keys for the row blocks that have such rows).
"""

from __future__ import annotations

import numbers

import numpy as np

from ..exact import _native
from ..masks import block_of, constant_rows, fill_empty_rows, fill_output_without_keys, policy_fill
from ..arith import NUMPY
from ..sinks import fold_sink, sink_grad_in, sink_probs
from ..transforms import dropout_forward, scores_forward, scores_vjp, transform_scores, transform_scores_vjp, \
    unbroadcast
from .contract import Forward, Grads

__all__ = ["DEFAULT_BLOCK_BUDGET", "auto_block_size", "backward", "check_block_size", "forward", "lse_blocks"]

#: Memory budget (bytes) for the block temporaries of ``block_size="auto"``.
DEFAULT_BLOCK_BUDGET = 64 * 2**20
#: How many block-sized temporaries a backward step holds at once.
_TEMPS = 6


def check_block_size(block_size, prob):
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


def lse_blocks(L, S):
    """The ``(rows, keys)`` blocks of the ``"lse"`` backward of dense residuals: every key in one block (one sweep),
    the rows in four blocks of at least 128, so that it peaks below the default path (``benchmarks/bench_memory.py``:
    about 1.1 to 1.3 ``L x S`` arrays against 1.5 to 3.3)."""
    return max(128, -(-L // 4)), max(S, 1)


def auto_block_size(prob, budget: int = DEFAULT_BLOCK_BUDGET) -> int:
    """The largest multiple of 16 (at least 16) whose block temporaries fit ``budget``.

    A block holds ``n_heads_total * b * b`` entries, ``n_heads_total`` being the
    product of the batch dims and ``Hq``; about six such arrays live at once.
    """
    L, S = prob.L, prob.S
    heads = int(np.prod(prob.full_scores[:-2])) or 1
    itemsize = np.dtype(prob.dtype).itemsize
    b = int(np.sqrt(budget / (_TEMPS * itemsize * heads)))
    b = max(16, (b // 16) * 16)
    return max(1, min(b, max(L, S, 1)))


# ----------------------------------------------------------------- forward


def forward(prob, *, block_size="auto") -> Forward:
    """Online-softmax forward; ``probs`` and softcap's slope are never kept (there is no ``L x S`` array to keep)."""
    block = check_block_size(block_size, prob)
    o, bl = prob.options, _Blocks(prob)
    L, S = prob.L, prob.S
    lead = prob.batch + (prob.Hq,)
    Ev, ct = prob.v.shape[-1], prob.dtype
    rt = ct.type(0).real.dtype
    O = np.zeros(lead + (L, Ev), dtype=ct)
    lse = np.full(lead + (L,), -np.inf, dtype=rt)
    empty = np.zeros(lead + (L, 1), dtype=bool)
    rowmax = np.zeros(lead + (L, 1), dtype=rt)
    rowsum = np.zeros(lead + (L, 1), dtype=ct)
    lse_keys = None if prob.sink is None else np.full(lead + (L,), -np.inf, dtype=rt)
    for i0, i1 in _ranges(L, block):
        m = np.full(lead + (i1 - i0, 1), -np.inf, dtype=rt)
        l = np.zeros(lead + (i1 - i0, 1), dtype=ct)
        acc = np.zeros(lead + (i1 - i0, Ev), dtype=ct)
        for j0, j1 in _ranges(S, block):
            allowed = prob.allowed((i0, i1), (j0, j1))
            if allowed is not None and not np.any(allowed):
                continue                                            # a wholly masked block
            T, _ = bl.scores(i0, i1, j0, j1, allowed)
            m_new = np.maximum(m, np.max(T.real, axis=-1, keepdims=True))
            shift = np.where(m_new == -np.inf, rt.type(0), m_new)
            with np.errstate(invalid="ignore", over="ignore"):
                alpha = _exp(m - shift)                             # 0 where m was -inf
                e = _exp(T - shift)
            l = l * alpha + e.sum(axis=-1, keepdims=True)
            acc = acc * alpha + bl.times_v(dropout_forward(e, bl.keep(i0, i1, j0, j1), o.dropout_p), j0, j1)
            m = m_new
        row_empty = m == -np.inf
        with np.errstate(divide="ignore", invalid="ignore"):
            out = acc / l
            if prob.sink is not None:                               # a sink: one more score, no value (fold_sink)
                lse_keys[..., i0:i1] = (np.log(l) + m)[..., 0].real
                m, l, r, _, empty_ = fold_sink(m, l, row_empty, prob.sink_rows((i0, i1)))
                out, row_empty = np.where(row_empty, ct.type(0), out) * r, empty_
            m = np.where(row_empty, rt.type(0), m)
            lse[..., i0:i1] = (np.log(l) + m)[..., 0].real
        rowmax[..., i0:i1, :], rowsum[..., i0:i1, :] = m, l
        O[..., i0:i1, :] = _policy_rows(prob, bl, out, row_empty, i0, i1)
        empty[..., i0:i1, :] = row_empty
    O = fill_output_without_keys(O, o.fully_masked, S, prob.padded_rows())
    return Forward(out=O, lse=lse, probs=None, tanh=None, empty=empty, rowmax=rowmax, rowsum=rowsum,
                   lse_keys=lse_keys)


def _policy_rows(prob, bl, out, row_empty, i0, i1):
    """Apply ``fully_masked`` to the rows of a block that saw no key; padded rows are 0."""
    if not np.any(row_empty):
        return out
    o, S = prob.options, prob.S
    if o.fully_masked == "uniform":                                 # P = 1/S on every key: a pass over V
        u = np.zeros(out.shape, dtype=out.dtype)
        vu = prob.averaged_values(row_empty, rows=(i0, i1))       # such a row reads every value it keeps
        for j0, j1 in _ranges(S, max(1, i1 - i0)):
            w = np.full(out.shape[:-1] + (j1 - j0,), policy_fill("uniform", S), dtype=out.dtype)
            u = u + bl.times_v(dropout_forward(w, bl.keep(i0, i1, j0, j1), o.dropout_p), j0, j1, vu)
        out = np.where(row_empty, u, out)
    else:
        out = np.where(row_empty, out.dtype.type(policy_fill(o.fully_masked, S)), out)
    padded = prob.padded_rows((i0, i1))
    return out if padded is None else np.where(padded, out.dtype.type(0), out)


# ---------------------------------------------------------------- backward


def backward(prob, fwd: Forward, dO, dlse=None, *, block_size="auto") -> Grads:
    """Blockwise recomputation backward: ``P = exp(T - m) / s`` block by block, the softmax VJP pivoted.

    For each block of rows, a first sweep over the key blocks finds the
    pivot ``c`` (``dP`` at the row's largest ``P``) and
    ``D = rowsum(P * (dP - c))``; the second computes the gradients with
    ``dT = P * ((dP - c) - D)``. With one key block (the dense ``"lse"``
    backward) the two sweeps share one recomputation.

    ``dlse`` ``(*batch, Hq, L, 1)``, the LSE's cotangent (or None), is folded into ``D`` as FlashAttention 4
    does: ``dT = P * ((dP - c) - (D - dlse))`` (:func:`sdpa_ref.softmax.softmax_lse_vjp`, as
    ``rowsum(P) = 1``).

    ``block_size`` may also be a pair ``(rows, keys)``: the dense ``"lse"``
    backward walks blocks of rows with every key in one block, so that its
    temporaries stay below one ``L x S`` array.
    """
    rb, cb = block_size if isinstance(block_size, tuple) else (check_block_size(block_size, prob),) * 2
    o, bl = prob.options, _Blocks(prob)
    L, S, Hq, Hkv = prob.L, prob.S, prob.Hq, prob.Hkv
    ct, full = prob.dtype, prob.full_scores
    nd = len(full)
    rowmax = fwd.rowmax.reshape(full[:-1] + (1,))
    rowsum = fwd.rowsum.reshape(full[:-1] + (1,))
    E = prob.q.shape[-1]
    dq = np.zeros(full[:-1] + (E,), dtype=ct)
    dk = np.zeros(prob.batch + (Hkv, S, E), dtype=ct)
    dv = np.zeros(prob.batch + (Hkv, S, prob.v.shape[-1]), dtype=ct)
    dmask = None if prob.mask_float is None else np.zeros(prob.shapes["attn_mask"], dtype=ct)
    dbias = None if prob.bias is None else np.zeros(prob.shapes["bias"], dtype=ct)
    dsink = None if prob.sink is None else np.zeros(full[:-1], dtype=ct)

    def rows(i0, i1):
        """One block of rows; its temporaries die with the call, before the next block makes its own."""
        em = fwd.empty[..., i0:i1, :]
        pad = prob.padded_rows((i0, i1))
        m_i = rowmax[..., i0:i1, :]
        s_i = np.where(em, ct.type(1), rowsum[..., i0:i1, :])
        dOg = bl.grouped(dO[..., i0:i1, :])
        jobs = []
        for j0, j1 in _ranges(S, cb):
            allowed = prob.allowed((i0, i1), (j0, j1))
            skip = allowed is not None and not np.any(allowed)
            if skip and not (o.fully_masked in ("uniform", "nan") and np.any(em)):
                continue                                            # P = 0 on the whole block
            jobs.append((j0, j1, skip, allowed))

        def recompute(j0, j1, skip, allowed):
            """``(P, dP, sech2, keep)`` of one block; ``dP`` is a fresh array."""
            if skip:
                T, sech2 = np.full(prob.batch + (Hq, i1 - i0, j1 - j0), -np.inf, dtype=ct), None
            else:
                T, sech2 = bl.scores(i0, i1, j0, j1, allowed, sech2=True)
            with np.errstate(invalid="ignore", over="ignore"):
                P = _exp(T - m_i) / s_i                             # as the forward made it
            P = fill_empty_rows(P, em, pad, o.fully_masked, S)
            keep = bl.keep(i0, i1, j0, j1)
            dP = (dOg @ np.swapaxes(prob.v[..., None, j0:j1, :], -1, -2)).reshape(P.shape)
            return P, dropout_forward(dP, keep, o.dropout_p), sech2, keep     # dO V^T Z/(1-p)

        # sweep 1: per key block its own pivot c_b, rowsum(P (dP - c_b)) and rowsum(P); then one c and D
        cached = recompute(*jobs[0]) if len(jobs) == 1 else None
        ps = None if prob.sink is None else sink_probs(prob.sink, fwd.lse[..., i0:i1, None])
        parts = [] if ps is None else [(ps, np.zeros(ps.shape), np.zeros(ps.shape), ps)]   # the sink: dP = 0
        for job in jobs:
            P, dP, _, _ = cached if cached is not None else recompute(*job)
            idx = np.argmax(P.real, axis=-1, keepdims=True)
            c_b = np.take_along_axis(dP, idx, axis=-1)
            np.subtract(dP, c_b, out=dP)
            parts.append((np.take_along_axis(P.real, idx, axis=-1), c_b, _rowdot(P, dP), _rowdot(P, None)))
        if not parts:
            return
        c, D = _pivot_and_D(parts)
        if dlse is not None:
            D = D - dlse[..., i0:i1, :]                             # + P * dlse, folded into D
        if ps is not None:                                          # dsink = p_sink ((0 - c) - D) (sink_softmax_vjp)
            cr = constant_rows(em, pad, o.fully_masked)
            ds = sink_grad_in(NUMPY, ps, c, D)
            dsink[..., i0:i1] = (ds if cr is None else np.where(cr, ct.type(0), ds))[..., 0]
        # sweep 2: the gradients, dT = P * ((dP - c) - D)
        for job in jobs:
            j0, j1 = job[:2]
            if cached is not None:
                P, dP, sech2, keep = cached                         # dP - c already ...
                if ps is not None:                                  # ... unless the sink holds the pivot
                    np.add(dP, parts[1][1] - c, out=dP)
            else:
                P, dP, sech2, keep = recompute(*job)
                np.subtract(dP, c, out=dP)
            P_drop = dropout_forward(P, keep, o.dropout_p)
            dv[..., j0:j1, :] += (np.swapaxes(bl.grouped(P_drop), -1, -2) @ dOg).sum(axis=-3)   # P_drop^T dO
            np.subtract(dP, D, out=dP)
            dT = np.multiply(P, dP, out=dP)
            cr = constant_rows(em, pad, o.fully_masked)
            if cr is not None:                                       # P does not depend on T there
                dT = np.where(cr, ct.type(0), dT)
            for acc in (dmask, dbias):
                if acc is not None:                                  # dB = dT, summed to B's shape
                    view = block_of(acc, nd, None, (i0, i1), (j0, j1))
                    view += unbroadcast(dT, view.shape)
            dTraw = transform_scores_vjp(dT, sech2)
            dq_i, dk_j = scores_vjp(bl.grouped(dTraw), prob.q[..., i0:i1, :], prob.k[..., None, j0:j1, :],
                                    prob.scale)
            dq[..., i0:i1, :] += dq_i.reshape(dq_i.shape[:-4] + (Hq,) + dq_i.shape[-2:])
            dk[..., j0:j1, :] += dk_j.sum(axis=-3)

    for i0, i1 in _ranges(L, rb):
        rows(i0, i1)
    return Grads(dq=dq, dk=dk, dv=dv, dmask=dmask, dbias=dbias,
                 dsinks=None if dsink is None else dsink.sum(axis=-1))


def _rowdot(P, X):
    """``rowsum(P * X)`` (``X=None``: ``rowsum(P)``), keeping the axis, without an ``L x S`` temporary."""
    if X is None:
        return np.sum(P, axis=-1, keepdims=True)
    return np.einsum("...j,...j->...", P, X)[..., None]


def _pivot_and_D(parts):
    """One pivot ``c`` and ``D = rowsum(P (dP - c))`` from the key blocks' ``(max P, c_b, rowsum(P (dP - c_b)),
    rowsum(P))``: ``c`` is the ``c_b`` of the block holding the row's largest ``P`` (the first such), and
    ``sum_b [rowsum(P (dP - c_b)) + (c_b - c) rowsum(P)]`` is ``D``, the pivot block's correction exactly 0."""
    pm, cb, s1, sp = (np.stack(x) for x in zip(*parts))
    best = np.argmax(pm, axis=0)[None]
    c = np.take_along_axis(cb, best, axis=0)[0]
    D = s1[0] + (cb[0] - c) * sp[0]
    for b in range(1, len(parts)):
        D = D + (s1[b] + (cb[b] - c) * sp[b])
    return c, D


# ------------------------------------------------------------------ blocks


class _Blocks:
    """Scores, dropout and ``P V`` of one (row block, key block) of a problem."""

    def __init__(self, prob):
        self.p = prob

    def scores(self, i0, i1, j0, j1, allowed, sech2=False):
        """``(T, sech2)`` of the block, ``(*batch, Hq, bi, bj)`` (softcap's slope with ``sech2``, else None)."""
        p = self.p
        T = scores_forward(p.q[..., i0:i1, :], p.k[..., None, j0:j1, :], p.scale)   # (..., Hkv, G, bi, bj)
        T = T.reshape(T.shape[:-4] + (p.Hq, i1 - i0, j1 - j0))
        want = p.batch + T.shape[-3:]
        if T.shape != want:                                          # batch dims that only `value` has
            T = np.broadcast_to(T, want).copy()
        return transform_scores(p, T, (i0, i1), (j0, j1), sech2=sech2, allowed=allowed)

    def keep(self, i0, i1, j0, j1):
        return block_of(self.p.keep, len(self.p.full_scores), None, (i0, i1), (j0, j1))

    def times_v(self, P, j0, j1, v=None):
        """``P (..., Hq, bi, bj) @ V_J`` per kv head (``v``: other values than the problem's): ``(..., Hq, bi, Ev)``."""
        v = self.p.v if v is None else v
        out = self.grouped(P) @ v[..., None, j0:j1, :]
        return out.reshape(out.shape[:-4] + (self.p.Hq,) + out.shape[-2:])

    def grouped(self, x):
        """``(..., Hq, b, n)`` -> ``(..., Hkv, G, b, n)``."""
        return x.reshape(x.shape[:-3] + (self.p.Hkv, self.p.G) + x.shape[-2:])


def _ranges(n, b):
    return [(s, min(s + b, n)) for s in range(0, n, b)] if n else []


def _exp(x):
    """``exp`` of the fresh array ``x``, in place: the fast row passes' compiled SIMD exp (within 1 ulp,
    :mod:`sdpa_ref.exact._native`) for real float64 and float32, NumPy's otherwise (complex, for the complex
    step, or without a compiler)."""
    lib = _native.kernels()
    if lib is not None and x.dtype in (np.float64, np.float32) and x.flags.c_contiguous and x.flags.writeable:
        return _native.fast_exp(lib, x, out=x)
    return np.exp(x)
