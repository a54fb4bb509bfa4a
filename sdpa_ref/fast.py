r"""The fast dense path: the same arithmetic as the plain path, with fewer passes and copies.

This is the default of :func:`sdpa_ref.sdpa_forward` (``method="fast"``). It
computes exactly the formulas of the plain path (``method="plain"``, the
documented, readable reference whose Notes carry the derivation) and is
tested against it to 1e-14. What differs is how:

* the scale is folded into the smaller operand (``Q`` or ``K``), never into
  the ``L x S`` scores;
* one ``L x S`` buffer holds the scores, becomes ``exp(T - m)`` in place and
  then ``P`` in place (normalised by multiplying with ``1/sum``, which may
  differ from the plain path's division in the last bit); the backward turns
  ``dO V^T`` into ``dT`` in place; the row passes work on blocks of rows
  small enough to stay in cache;
* ``D = rowsum(dO * O)`` (``L x Ev`` work) instead of ``rowsum(P * dP)``
  (``L x S``), FlashAttention's identity;
* rows shorter than 64 are summed by a BLAS product with a ones vector
  (another summation order, about 10 times faster than a reduction there);
* the row-wise element-wise passes (shift, exp, normalise; ``(dP - D) * P``)
  run on row chunks in a thread pool -- NumPy releases the GIL inside
  ufunc loops, so on ``n`` cores they take about ``1/n`` of the time. Rows
  are independent, so the result does not depend on the number of threads.

Threads: ``os.cpu_count()`` by default; set the environment variable
``SDPA_REF_NUM_THREADS`` (read when the pool is first used) to override, 1
to disable.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from ._problem import Problem

__all__ = ["fast_forward", "fast_backward", "num_threads"]

_POOL: Optional[ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()
#: Below this many entries an element-wise pass runs inline (threads cost more than they save).
_MIN_PARALLEL = 1 << 22
#: Rows shorter than this are summed by a BLAS product (a reduction is slow on them).
_SHORT_ROW = 64
#: Entries of a row block that one element-wise pass works on (4 MiB of float64).
_CACHE_ENTRIES = 1 << 19


def num_threads() -> int:
    env = os.environ.get("SDPA_REF_NUM_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _pool(n):
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="sdpa_ref")
        return _POOL


def _row_chunks(fn, *arrays):
    """Run ``fn(*chunks)`` over row chunks of 2-D arrays (same number of rows), in parallel."""
    rows = arrays[0].shape[0]
    n = num_threads()
    if n == 1 or arrays[0].size < _MIN_PARALLEL or rows < 2:
        fn(*arrays)
        return
    bounds = np.linspace(0, rows, min(n, rows) + 1).astype(int)
    pool = _pool(n)
    futs = [pool.submit(fn, *[a[b0:b1] for a in arrays]) for b0, b1 in zip(bounds[:-1], bounds[1:]) if b1 > b0]
    for f in futs:
        f.result()


# ----------------------------------------------------------------- forward


def fast_forward(prob: Problem):
    """``(O, P, lse, tanh, empty)`` in the layouts of the plain path."""
    full = prob.full_scores
    S = full[-1]
    T, th = _scores_inplace(prob)
    rows = int(np.prod(full[:-1]))
    T2 = T.reshape(rows, S)
    lse = np.empty((rows, 1), dtype=T.dtype)
    empty = np.empty((rows, 1), dtype=bool)

    sub = max(1, _CACHE_ENTRIES // max(S, 1))        # rows per cache-sized block
    ones = np.ones((S, 1), dtype=T.dtype)              # row sums as a BLAS product: fast on short rows

    def softmax_rows(t, lse_c, empty_c):
        # five passes (max, shift, exp, sum, scale) over blocks that stay in cache
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for r0 in range(0, t.shape[0], sub):
                tb, eb, lb = t[r0:r0 + sub], empty_c[r0:r0 + sub], lse_c[r0:r0 + sub]
                m = np.max(tb, axis=-1, keepdims=True, initial=-np.inf)
                np.equal(m, -np.inf, out=eb)
                m[eb] = 0.0
                np.subtract(tb, m, out=tb)
                np.exp(tb, out=tb)
                s = tb @ ones if S < _SHORT_ROW else np.sum(tb, axis=-1, keepdims=True)
                np.multiply(tb, 1.0 / s, out=tb)
                np.log(s, out=lb)
                lb += m

    _row_chunks(softmax_rows, T2, lse, empty)
    P = T
    empty = empty.reshape(full[:-1] + (1,))
    if np.any(empty):
        from .attention import _fill_empty_rows
        from ._problem import Scores

        P = _fill_empty_rows(P, prob, Scores(T=P, tanh=th, empty=empty, padded=prob.padded_rows()))
    P_drop = P if prob.keep is None else P * (prob.keep * (1.0 / (1.0 - prob.dropout_p)))
    O = (P_drop.reshape(prob.grouped + (S,)) @ prob.v).reshape(full[:-1] + (prob.v.shape[-1],))
    if prob.fully_masked == "nan" and S == 0:
        O = np.full_like(O, np.nan)
        padded = prob.padded_rows()
        if padded is not None:
            O = np.where(padded, 0.0, O)
    return O, P, lse.reshape(full[:-1]), th, empty


def _scores_inplace(prob: Problem):
    """The masked scores in one fresh, writable ``(*batch, Hq, L, S)`` buffer, and tanh with softcap."""
    q, k = prob.q, prob.k
    if q.shape[-2] <= k.shape[-2]:                 # fold the scale into the smaller operand
        T = (prob.scale * q) @ np.swapaxes(k, -1, -2)
    else:
        T = q @ np.swapaxes(prob.scale * k, -1, -2)
    T = T.reshape(T.shape[:-3] + prob.full_scores[-3:])
    if T.shape != prob.full_scores:                # a batch dim that only `value` has
        T = np.broadcast_to(T, prob.full_scores).copy()
    th = None
    if prob.softcap is not None:
        np.divide(T, prob.softcap, out=T)
        th = np.tanh(T)
        np.multiply(th, prob.softcap, out=T)
    if prob.mask_float is not None:
        T += prob.mask_float
    if prob.bias is not None:
        T += prob.bias
    if prob.alibi is not None:
        T += prob.alibi_bias()
    allowed = prob.allowed()
    if allowed is not None:
        np.copyto(T, -np.inf, where=~np.broadcast_to(allowed, T.shape))
    return T, th


# ---------------------------------------------------------------- backward


def fast_backward(prob: Problem, P, O, th, empty, g):
    """The ``"probs"`` backward with D = rowsum(dO * O) and in-place dT."""
    from .attention import _grads_from_dT

    full, grouped = prob.full_scores, prob.grouped
    S = full[-1]
    ct = prob.dtype
    dO = g.astype(ct, copy=False).reshape(grouped + (g.shape[-1],))
    P_drop = P if prob.keep is None else P * (prob.keep * (1.0 / (1.0 - prob.dropout_p)))
    dv = np.swapaxes(P_drop.reshape(grouped + (S,)), -1, -2) @ dO          # dV = P_drop^T dO
    dP = (dO @ np.swapaxes(prob.v, -1, -2)).reshape(full)                   # dO V^T, a fresh buffer
    if dP.shape != full:
        dP = np.broadcast_to(dP, full).copy()
    if prob.keep is not None:
        dP *= prob.keep
        dP *= 1.0 / (1.0 - prob.dropout_p)
    rows = int(np.prod(full[:-1]))
    D = np.sum(dO * O.reshape(dO.shape), axis=-1).reshape(rows, 1)          # rowsum(dO * O)
    dT2 = dP.reshape(rows, S)
    P2 = np.broadcast_to(P, full).reshape(rows, S)

    sub = max(1, _CACHE_ENTRIES // max(S, 1))

    def score_grad_rows(d, p, D_c):
        for r0 in range(0, d.shape[0], sub):
            db = d[r0:r0 + sub]
            np.subtract(db, D_c[r0:r0 + sub], out=db)
            np.multiply(db, p[r0:r0 + sub], out=db)

    _row_chunks(score_grad_rows, dT2, P2, D)
    dT = dP
    if prob.fully_masked == "uniform" and np.any(empty):
        np.copyto(dT, 0.0, where=np.broadcast_to(empty, dT.shape))
    if th is not None:
        # dTraw = dT * (1 - tanh^2), without keeping dT: the mask/bias grads are taken first
        return _grads_from_dT(prob, dT, th, dv)
    return _grads_from_dT(prob, dT, None, dv)
