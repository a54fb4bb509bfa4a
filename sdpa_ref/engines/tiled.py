r"""The tiled engine: FlashAttention's algorithm in NumPy, in bounded memory.

``method="tiled"`` (or ``block_size=b``) lands here. The scores are never
materialised: the forward walks key blocks of ``b`` columns for each block of
``b`` query rows, keeping a running max ``m``, sum ``l`` and output
accumulator (the online softmax), and stores only ``O``, ``lse`` and the row
max and sum that make it. The
backward walks the same blocks and recomputes each block's
:math:`P = e^{T - m} / s` from a row max :math:`m` and sum :math:`s` of its
own: its first sweep takes them from the scores it recomputes, block by
block, merged and closed by the sinks as the forward's (a score recomputed
in another block shape, or by another engine's forward, may be an ulp off
the one the forward summed; :math:`e^{T - \mathrm{lse}}` would lose what
``lse = m + log s`` rounded away: everything, once the scores are large),
with the softmax VJP in the pivoted form of
:func:`sdpa_ref.pivot.row_pivot`. The forward's own ``m`` and ``s`` serve
the tiled double backward (:mod:`sdpa_ref.engines.second`), which walks the
forward's block shape.
It is also the ``"lse"`` backward of dense residuals (:func:`lse_blocks`: row
blocks holding every key): FlashAttention's recomputing backward, made stable.

Per block of rows ``I`` and keys ``J`` (all batch entries and heads at once)::

    T_IJ   = transform_scores(scale * Q_I K_J^T)     the same chain as every engine
    m_J    = rowmax T_IJ,   l_J = rowsum e^(T_IJ - m_J)          the block's own normaliser
    m, l, (a, b) = combine_in(m, l; m_J, l_J)        m = max(m, m_J), a = e^(m_old - m), b = e^(m_J - m),
                                                     l = a l + b l_J  (sdpa_ref.lse.combine_in)
    acc    = a acc + b (e^(T_IJ - m_J) * Z / (1-p)) V_J
    ...
    O_I    = acc / l,   lse_I = m + log l          (m and l kept for the backward)

The block merge is the combine of two normalisers that the split-KV merge
(:func:`sdpa_ref.merge_attention`, through :func:`sdpa_ref.lse.combine_lse`)
applies to its parts and the normaliser's close (:func:`sdpa_ref.normalize.close`,
the sinks) to a row: a key block is a split of the keys, merged as it is computed.

Blocks that the allowed set excludes entirely are skipped in both passes.
The blocks of rows run side by side in the package's pool (:func:`each_row_block`), what they add to shared
results summed in the blocks' order, so the bits do not depend on the thread count. Peak memory is
``O((L + S) (E + Ev) + b^2)`` per head and thread on top of the inputs in the forward, and
``O((L + S) (E + Ev) + b S)`` in the backward and the JVP, whose first sweep keeps a block of rows' ``P`` and
``dP`` against every key for the second (one recomputation of the scores, not two).
Fully masked rows follow the same policies as the other engines (the uniform
one in a second pass over the keys for the row blocks that have such rows).
"""

from __future__ import annotations

import numpy as np

from ..broadcast import block_of
from ..policy import (averages_values, constant_rows, counts, excluded, fill_empty_rows, fill_output_without_keys,
                      fills_zero, policy_fill)
from ..arith import NUMPY
from ..lse import combine_in
from ..pivot import block_partial, combine_partials, nan_rows_vjp
from ..normalize import close, extra_grad_in, extras, nan_row_probs, row_stats
from ..transforms import dropout_forward, scores_jvp, scores_vjp, transform_scores_jvp, transform_scores_vjp, \
    unbroadcast
from .blocks import Blocks, check_block_size, exp_inplace as _exp, ranges as _ranges
from .contract import Forward, Grads
from .._threads import blas_is_held, num_threads, ordered

__all__ = ["Rows", "backward", "forward", "jvp", "key_pass"]

# ----------------------------------------------------------------- forward


def forward(prob, *, save_probs=False, block_size="auto") -> Forward:
    """Online-softmax forward; ``probs`` and softcap's slope are never kept, whatever ``save_probs`` (the engines'
    one signature) asks: there is no ``L x S`` array to keep, and the backward recomputes ``P``."""
    block = check_block_size(block_size, prob)
    rows = Rows(prob)

    def one(i0, i1):
        m, l, acc, row_empty = key_pass(prob, rows.bl, i0, i1, (0, prob.S), block)
        with np.errstate(divide="ignore", invalid="ignore"):
            rows.close(i0, i1, m, l, acc / l, row_empty)

    each_row_block(one, _ranges(prob.L, block))
    return rows.forward()


def each_row_block(fn, blocks, add=None, parallel=True):
    """``fn(i0, i1)`` for each block of rows ``(i0, i1)`` of ``blocks``; ``add(result)`` (if given) takes the
    results in the blocks' order.

    The blocks run side by side in the package's pool where there are several, more than one thread, the BLAS
    held to one (as the fast engine's chunks) and ``parallel``; otherwise one after the other. A block's rows are
    its own: ``fn`` writes only its rows of the results (the forward's ``O`` and ``lse``, ``dq``) and returns
    what it adds to shared ones (``dk``, ``dv``), which ``add`` sums in the blocks' order
    (:func:`sdpa_ref._threads.ordered`), as one thread would: the bits do not depend on the thread count, and at
    most ``num_threads()`` blocks' temporaries and results live at once.
    """
    blocks = list(blocks)
    if parallel and num_threads() > 1 and len(blocks) > 1 and blas_is_held():
        results = ordered(lambda b: fn(*b), blocks)
    else:
        results = (fn(*b) for b in blocks)
    for r in results:
        if add is not None:
            add(r)


def key_pass(prob, bl, i0, i1, keys, block):
    """The online softmax of the rows ``[i0, i1)`` over the keys ``[keys[0], keys[1])``, ``block`` keys at a
    time: ``(m, l, acc, empty)``, the normaliser (``m`` 0 on the rows that saw no key), the unnormalised output
    ``sum_j e^(T_j - m) Z_j / (1 - p) V_j`` and those rows (a split of the keys: :mod:`.splitkv`)."""
    o, lead = prob.options, prob.batch + (prob.Hq,)
    ct = prob.dtype
    rt = ct.type(0).real.dtype
    m = np.zeros(lead + (i1 - i0, 1), dtype=rt)                     # the running normaliser (m, l), empty so far
    l = np.zeros(lead + (i1 - i0, 1), dtype=ct)
    row_empty = np.ones(lead + (i1 - i0, 1), dtype=bool)
    acc = np.zeros(lead + (i1 - i0, prob.v.shape[-1]), dtype=ct)
    for j0, j1 in _ranges(keys[1] - keys[0], block):
        j0, j1 = j0 + keys[0], j1 + keys[0]
        allowed = prob.allowed((i0, i1), (j0, j1))
        if allowed is not None and not np.any(allowed):
            continue                                                # a wholly masked block
        T, _ = bl.scores(i0, i1, j0, j1, allowed)
        m_b, e_b, nan_b = row_stats(T)                             # the block's own normaliser (m_b, l_b) ...
        with np.errstate(invalid="ignore", over="ignore"):
            e = nan_row_probs(_exp(T - m_b), T, nan_b)              # (a NaN row: NaN on its allowed keys)
            m, l, (a, b), row_empty = combine_in(NUMPY, [m, m_b], [l, e.sum(axis=-1, keepdims=True)],
                                                 [row_empty, e_b])          # ... merged into the running one
        pv = bl.times_v(dropout_forward(e, bl.keep(i0, i1, j0, j1), o.dropout_p), j0, j1)
        acc = acc * a + pv * b                                      # a = e^(m_old - m), b = e^(m_b - m)
    return m, l, acc, row_empty


class Rows:
    """The forward's results, filled a block of rows at a time by :meth:`close`, then :meth:`forward`."""

    def __init__(self, prob):
        lead, ct = prob.batch + (prob.Hq,), prob.dtype
        rt = ct.type(0).real.dtype
        L = prob.L
        self.prob, self.bl = prob, Blocks(prob)
        self.O = np.zeros(lead + (L, prob.v.shape[-1]), dtype=ct)
        self.lse = np.full(lead + (L,), -np.inf, dtype=rt)
        self.empty = np.zeros(lead + (L, 1), dtype=bool)
        self.rowmax = np.zeros(lead + (L, 1), dtype=rt)
        self.rowsum = np.zeros(lead + (L, 1), dtype=ct)
        self.lse_keys = None if extras(prob) is None else np.full(lead + (L,), -np.inf, dtype=rt)
        self.rowmax_keys = None if self.lse_keys is None else np.full(lead + (L,), -np.inf, dtype=rt)

    def close(self, i0, i1, m, l, out, row_empty):
        """The rows ``[i0, i1)`` from the keys' normaliser ``(m, l)`` and output ``out`` (not read where
        ``row_empty``): the extra logits' close, the LSE, the ``fully_masked`` policy."""
        prob, ct = self.prob, self.prob.dtype
        rt = ct.type(0).real.dtype
        with np.errstate(divide="ignore", invalid="ignore"):
            if self.lse_keys is not None:                           # the normaliser closed by its extra logits
                self.lse_keys[..., i0:i1] = (np.log(l) + m)[..., 0].real
                self.rowmax_keys[..., i0:i1] = np.where(row_empty, -np.inf, np.real(m))[..., 0]
                nrm = close(m, l, row_empty, extras(prob, (i0, i1)))
                m, l = nrm.m, nrm.s
                out, row_empty = np.where(row_empty, ct.type(0), out) * nrm.r, nrm.empty
            m = np.where(row_empty, rt.type(0), m)
            self.lse[..., i0:i1] = (np.log(l) + m)[..., 0].real
        self.rowmax[..., i0:i1, :], self.rowsum[..., i0:i1, :] = m, l
        self.O[..., i0:i1, :] = _policy_rows(prob, self.bl, out, row_empty, i0, i1)
        self.empty[..., i0:i1, :] = row_empty

    def forward(self) -> Forward:
        O = fill_output_without_keys(self.O, self.prob.nan_rows_without_keys())
        return Forward(out=O, lse=self.lse, probs=None, slope=None, empty=self.empty, rowmax=self.rowmax,
                       rowsum=self.rowsum, lse_keys=self.lse_keys, rowmax_keys=self.rowmax_keys)


def _policy_rows(prob, bl, out, row_empty, i0, i1):
    """Apply ``fully_masked`` to the rows of a block that saw no key; padded rows are 0."""
    if not np.any(row_empty):
        return out
    o, S = prob.options, prob.S
    if averages_values(o.fully_masked):                             # P = 1/S on every key (1/n on the
        u = np.zeros(out.shape, dtype=out.dtype)                    # excluded ones): a pass over V
        vu = prob.averaged_values(row_empty, rows=(i0, i1))       # such a row reads every value it keeps
        n = counts(prob, (i0, i1))
        for j0, j1 in _ranges(S, max(1, i1 - i0)):
            w = fill_empty_rows(np.zeros(out.shape[:-1] + (j1 - j0,), dtype=out.dtype), row_empty, None,
                                o.fully_masked, S, n=n, excl=excluded(prob, (i0, i1), (j0, j1)))
            u = u + bl.times_v(dropout_forward(w, bl.keep(i0, i1, j0, j1), o.dropout_p), j0, j1, vu)
        out = np.where(row_empty, u, out)
    else:
        out = np.where(row_empty, out.dtype.type(policy_fill(o.fully_masked, S)), out)
    padded = prob.padded_rows((i0, i1))
    return out if padded is None else np.where(padded, out.dtype.type(0), out)


# ------------------------------------------------------- backward and JVP


class _Sweeps:
    r"""The softmax VJP of one block of rows, key block by key block, in the pivoted form.

    The softmax Jacobian :math:`J = \mathrm{diag}(P) - P P^T` is symmetric, so the backward (``g`` the
    probabilities' cotangent :math:`dP`) and the JVP (``g`` the scores' tangent :math:`dT`) both compute
    :math:`P \odot (g - \mathrm{rowsum}(P \odot g))`. The first sweep finds, from each key block's own pivot,
    one pivot ``c`` (``g`` at the row's largest ``P``) and :math:`D = \mathrm{rowsum}(P (g - c))`
    (:func:`sdpa_ref.pivot.combine_partials`); :meth:`second` recomputes each block and yields
    :math:`P \odot ((g - c) - D)`. The row's normaliser :math:`(m, s)` is the first sweep's own, from the scores
    it recomputes (:func:`sdpa_ref.normalize.row_stats` per block, merged by :func:`sdpa_ref.lse.combine_in`,
    closed by :func:`sdpa_ref.normalize.close`); of the forward only ``fwd.empty`` is read. An extra logit of
    the normaliser (a sink) is one more column with probability ``ps`` and no value, whose ``g`` is ``g_extra``
    (the backward: 0; the JVP: its tangent). The first sweep keeps each block's ``P`` and ``g`` (one block of rows
    against every key: ``O(b S)`` per head, what the sweep's blocks hold together anyway), so the second sweep
    recomputes nothing: the scores, their ``exp`` and ``g`` are formed once per block (a block of rows with a NaN
    row, whose ``P`` is NaN on every key it reads, recomputes its blocks from the row's normaliser).

    ``g_block(j0, j1, P, keep, sech2)`` gives a fresh array ``g`` for one block.
    """

    def __init__(self, prob, bl, fwd, i0, i1, cb, g_block, g_extra=None):
        o, ct = prob.options, prob.dtype
        self.prob, self.bl, self.i0, self.i1, self.g_block = prob, bl, i0, i1, g_block
        self.em = fwd.empty[..., i0:i1, :]
        self.pad = prob.padded_rows((i0, i1))
        self.n = counts(prob, (i0, i1))
        self.const = constant_rows(self.em, self.pad, o.fully_masked, self.n)  # P does not depend on T there
        self.jobs = []
        for j0, j1 in _ranges(prob.S, cb):
            allowed = prob.allowed((i0, i1), (j0, j1))
            skip = allowed is not None and not np.any(allowed)
            if skip and (fills_zero(o.fully_masked) or not np.any(self.em)):
                continue                                            # P = 0 on the whole block
            self.jobs.append((j0, j1, skip, allowed))
        firsts = [self._first(*job) for job in self.jobs]           # (m_b, l_b, empty_b, partial, (Pe, g, ...))
        rt = ct.type(0).real.dtype
        lead = prob.full_scores[:-2] + (i1 - i0, 1)
        if firsts:                                                  # the keys' normaliser, from these scores
            with np.errstate(invalid="ignore", over="ignore"):
                m, l, alpha, kempty = combine_in(NUMPY, *(list(x) for x in zip(*(f[:3] for f in firsts))))
        else:
            m, l, alpha, kempty = np.zeros(lead, rt), np.zeros(lead, ct), [], np.ones(lead, bool)
        nrm = close(m, l, kempty, extras(prob, (i0, i1)))           # the extra logits join it, as in the forward
        self.m = np.where(nrm.empty, rt.type(0), nrm.m)
        self.s = np.where(nrm.empty | self.em, ct.type(1), nrm.s)
        self.ps = nrm.p_extra
        r = 1 if nrm.r is None else nrm.r                          # P = e^(T - m_b) alpha_b r / l
        l = np.where(kempty, ct.type(1), l)
        parts = []
        if self.ps is not None:                                     # the extra column: g_extra, its own pivot
            gs = np.zeros(self.ps.shape) if g_extra is None else np.broadcast_to(g_extra, self.ps.shape)
            parts.append((self.ps, gs, np.zeros(self.ps.shape), self.ps))
        # a NaN row is NaN on every key it reads, in every key block: with several, those are recomputed
        self.cached = None if len(self.jobs) > 1 and np.any(self.s != self.s) else []
        for a, (_, _, _, (pm, c_b, s1, sp), kept) in zip(alpha, firsts):
            with np.errstate(invalid="ignore", over="ignore"):
                w = np.where(self.em | (self.s != self.s), ct.type(1), a * r / l)   # (the policy's rows:
                parts.append((pm * w.real, c_b, s1 * w, sp * w))  # their fill; a NaN row: NaN, as it is)
            if self.cached is not None:
                Pe, g, sech2, keep = kept                           # P = e^(T - m_b) w: the second sweep's
                self.cached.append((np.multiply(Pe, w, out=Pe), g, sech2, keep))
        self.parts = parts
        self.c, self.D = combine_partials(parts) if parts else (None, None)

    def _first(self, j0, j1, skip, allowed):
        """The first sweep's look at one block: its own normaliser ``(m_b, l_b, empty_b)`` from the scores it
        recomputes, and the pivoted partial sums (:func:`sdpa_ref.pivot.block_partial`) of its unnormalised
        ``e^(T - m_b)`` (the fully masked rows filled by the policy), which the row's normaliser rescales."""
        prob, o, ct, i0, i1 = self.prob, self.prob.options, self.prob.dtype, self.i0, self.i1
        if skip:
            T, sech2 = np.full(prob.batch + (prob.Hq, i1 - i0, j1 - j0), -np.inf, dtype=ct), None
        else:
            T, sech2 = self.bl.scores(i0, i1, j0, j1, allowed, sech2=True)
        T = np.broadcast_to(T, prob.full_scores[:-2] + T.shape[-2:])
        m_b, e_b, nan_b = row_stats(T)                             # as the forward's key blocks
        with np.errstate(invalid="ignore", over="ignore"):
            e = nan_row_probs(_exp(T - m_b), T, nan_b)              # (a NaN row: NaN on its allowed keys)
            l_b = e.sum(axis=-1, keepdims=True)
        Pe = fill_empty_rows(e, self.em, self.pad, o.fully_masked, prob.S, n=self.n,
                             excl=excluded(prob, (i0, i1), (j0, j1)))
        keep = self.bl.keep(i0, i1, j0, j1)
        g = self.g_block(j0, j1, Pe, keep, sech2)
        with np.errstate(invalid="ignore"):
            part = block_partial(Pe, g)                             # (g itself is kept for the second sweep)
        return m_b, l_b, e_b, part, (Pe, g, sech2, keep)

    def _recompute(self, j0, j1, skip, allowed):
        """``(P, g, sech2, keep)`` of one block; ``g`` is a fresh array."""
        prob, o, ct, i0, i1 = self.prob, self.prob.options, self.prob.dtype, self.i0, self.i1
        if skip:
            T, sech2 = np.full(prob.batch + (prob.Hq, i1 - i0, j1 - j0), -np.inf, dtype=ct), None
        else:
            T, sech2 = self.bl.scores(i0, i1, j0, j1, allowed, sech2=True)
        with np.errstate(invalid="ignore", over="ignore"):
            P = nan_row_probs(_exp(T - self.m) / self.s, T, self.s != self.s)    # the first sweep's normaliser
        P = fill_empty_rows(P, self.em, self.pad, o.fully_masked, prob.S, n=self.n,
                            excl=excluded(prob, (i0, i1), (j0, j1)))
        keep = self.bl.keep(i0, i1, j0, j1)
        return P, self.g_block(j0, j1, P, keep, sech2), sech2, keep

    def second(self, D):
        """``(j0, j1, P, keep, sech2, t)`` per key block, ``t = P ((g - c) - D)`` (0 on the constant rows), from the
        blocks the first sweep kept (``g`` is overwritten by ``t``), or recomputed where a row is NaN."""
        ct = self.prob.dtype
        for k, job in enumerate(self.jobs):
            P, g, sech2, keep = self._recompute(*job) if self.cached is None else self.cached[k]
            with np.errstate(invalid="ignore"):                     # an overflowed g (inf - inf) is NaN
                np.subtract(g, self.c, out=g)
            np.subtract(g, D, out=g)
            t = nan_rows_vjp(np.multiply(P, g, out=g), P, D)       # a NaN row: 0 where P is 0
            if self.const is not None:
                t = np.where(self.const, ct.type(0), t)
            yield job[0], job[1], P, keep, sech2, t


def backward(prob, fwd: Forward, dO, dlse=None, *, block_size="auto") -> Grads:
    """Blockwise recomputation backward: ``P = exp(T - m) / s`` block by block, the softmax VJP pivoted
    (:class:`_Sweeps` with ``g = dP = (dO V^T) Z / (1 - p)``).

    ``dlse`` ``(*batch, Hq, L, 1)``, the LSE's cotangent (or None), is folded into ``D`` as FlashAttention 4
    does: ``dT = P * ((dP - c) - (D - dlse))`` (:func:`sdpa_ref.softmax.softmax_lse_vjp`, as
    ``rowsum(P) = 1``).

    ``block_size`` may also be a pair ``(rows, keys)``: the dense ``"lse"``
    backward walks blocks of rows with every key in one block, so that its
    temporaries stay below one ``L x S`` array.
    """
    rb, cb = block_size if isinstance(block_size, tuple) else (check_block_size(block_size, prob),) * 2
    o, bl = prob.options, Blocks(prob)
    L, S, Hq, Hkv = prob.L, prob.S, prob.Hq, prob.Hkv
    ct, full = prob.dtype, prob.full_scores
    nd = len(full)
    E = prob.q.shape[-1]
    dq = np.zeros(full[:-1] + (E,), dtype=ct)
    dk = np.zeros(prob.batch + (Hkv, S, E), dtype=ct)
    dv = np.zeros(prob.batch + (Hkv, S, prob.v.shape[-1]), dtype=ct)
    dmask = None if prob.mask_float is None else np.zeros(prob.shapes["attn_mask"], dtype=ct)
    dbias = None if prob.bias is None else np.zeros(prob.shapes["bias"], dtype=ct)
    dext = None if extras(prob) is None else np.zeros(full[:-1], dtype=ct)
    dmod = None

    def rows(i0, i1):
        """One block of rows; its temporaries die with the call, before the next block makes its own. Its
        ``dq`` rows and its rows of the extra logits' gradient are written here; what it adds to ``dk`` and
        ``dv`` is returned, ``[(j0, j1, dk_J, dv_J)]``, for :func:`add` to add in the blocks' order."""
        nonlocal dmod
        dOg = bl.grouped(dO[..., i0:i1, :])

        def dP_of(j0, j1, P, keep, sech2):                          # dO V^T Z / (1 - p)
            dP = (dOg @ np.swapaxes(prob.v[..., None, j0:j1, :], -1, -2)).reshape(P.shape)
            return dropout_forward(dP, keep, o.dropout_p)

        sw = _Sweeps(prob, bl, fwd, i0, i1, cb, dP_of)
        adds = []
        if sw.c is None:
            return adds
        D = sw.D if dlse is None else sw.D - dlse[..., i0:i1, :]    # + P * dlse, folded into D
        if sw.ps is not None:                                       # the extra logits: p ((0 - c) - D)
            ds = extra_grad_in(NUMPY, sw.ps, sw.c, D)
            dext[..., i0:i1] = (ds if sw.const is None else np.where(sw.const, ct.type(0), ds))[..., 0]
        for j0, j1, P, keep, sech2, dT in sw.second(D):             # dT = P * ((dP - c) - D)
            P_drop = dropout_forward(P, keep, o.dropout_p)
            dv_j = (np.swapaxes(bl.grouped(P_drop), -1, -2) @ dOg).sum(axis=-3)               # P_drop^T dO
            for acc in (dmask, dbias):
                if acc is not None:                                  # dB = dT, summed to B's shape
                    view = block_of(acc, nd, None, (i0, i1), (j0, j1))
                    view += unbroadcast(dT, view.shape)
            dmod = bl.mod_grads(dT, i0, i1, j0, j1, dmod)          # the score function's captured tensors
            dTraw = transform_scores_vjp(dT, sech2)
            dq_i, dk_j = scores_vjp(bl.grouped(dTraw), prob.q[..., i0:i1, :], prob.k[..., None, j0:j1, :],
                                    prob.scale)
            dq[..., i0:i1, :] += dq_i.reshape(dq_i.shape[:-4] + (Hq,) + dq_i.shape[-2:])
            adds.append((j0, j1, dk_j.sum(axis=-3), dv_j))
        return adds

    def add(adds):
        for j0, j1, dk_j, dv_j in adds:
            dv[..., j0:j1, :] += dv_j
            dk[..., j0:j1, :] += dk_j

    # the float mask's, the bias's and the score function's gradients are summed over the row blocks as they come;
    # the dense "lse" backward (a pair of blocks) is there to peak below the dense path: one block at a time
    shared = dmask is not None or dbias is not None or (o.score_mod is not None and bool(o.score_mod.params))
    each_row_block(rows, _ranges(L, rb), add, parallel=not (shared or isinstance(block_size, tuple)))
    mod = o.score_mod
    if dmod is None and mod is not None and mod.params:            # no block visited: a zero gradient
        dmod = [np.zeros(p.shape) for p in mod.params]
    return Grads(dq=dq, dk=dk, dv=dv, dmask=dmask, dbias=dbias,
                 dextra=None if dext is None else dext.sum(axis=-1), dmod=None if dmod is None else tuple(dmod))


def jvp(prob, fwd: Forward, dq=None, dk=None, dv=None, dbias=None, dv_full=None, dextra=None, *,
        block_size="auto"):
    r"""The output tangent ``dO`` ``(*batch, Hq, L, Ev)`` block by block, in the bounded memory of the forward.

    The tangents are those of :func:`sdpa_ref.attention.jvp` (None is zero). Per block of rows,
    :class:`_Sweeps` with ``g`` the scores' tangent
    :math:`dT = s (dQ_I K_J^T + Q_I dK_J^T) \odot \mathrm{sech}^2 + dB_{IJ}`
    gives :math:`dP = P \odot ((dT - c) - D)` per key block (an extra column's tangent ``dextra``), and

    .. math:: dO_I = \sum_J \frac{dP_{IJ} \odot Z_{IJ}}{1 - p} V_J + P_{drop,IJ}\, dV_J,

    the rows of ``"uniform"`` that see no key averaging the value tangent as their forward averages the values.
    """
    rb = cb = check_block_size(block_size, prob)
    o, bl = prob.options, Blocks(prob)
    L, Hq = prob.L, prob.Hq
    nd = len(prob.full_scores)
    dO = np.zeros(prob.full_scores[:-1] + (prob.v.shape[-1],), dtype=prob.dtype)
    scored = dq is not None or dk is not None or dbias is not None or dextra is not None

    def dT_of(i0, i1):
        def g(j0, j1, P, keep, sech2):
            if not scored:
                return np.zeros(P.shape, P.dtype)
            t = scores_jvp(prob.q[..., i0:i1, :], prob.k[..., None, j0:j1, :],
                           None if dq is None else dq[..., i0:i1, :],
                           None if dk is None else dk[..., None, j0:j1, :], prob.scale)
            t = np.zeros(P.shape, P.dtype) if t is None else t.reshape(t.shape[:-4] + (Hq,) + t.shape[-2:])
            db = None if dbias is None else block_of(dbias, nd, None, (i0, i1), (j0, j1))
            return np.array(np.broadcast_to(transform_scores_jvp(t, sech2, db), P.shape))
        return g

    def rows(i0, i1):
        gs = None if dextra is None else np.broadcast_to(dextra, prob.full_scores[:-2] + (1, 1))
        sw = _Sweeps(prob, bl, fwd, i0, i1, cb, dT_of(i0, i1), g_extra=gs)
        if sw.c is None:
            return
        em = sw.em
        dvu = None if dv is None else prob.averaged_values(em, dv, dv_full, rows=(i0, i1))
        acc = np.zeros(dO[..., i0:i1, :].shape, dtype=prob.dtype)
        for j0, j1, P, keep, _, dP in sw.second(sw.D):
            if scored:
                acc += bl.times_v(dropout_forward(dP, keep, o.dropout_p), j0, j1)
            if dv is not None:
                P_drop = dropout_forward(P, keep, o.dropout_p)
                u = bl.times_v(P_drop, j0, j1, dv)
                if dvu is not dv:                                   # the uniform rows: the averaged tangent
                    u = np.where(em, bl.times_v(P_drop, j0, j1, dvu), u)
                acc += u
        dO[..., i0:i1, :] = acc

    each_row_block(rows, _ranges(L, rb))
    return dO
