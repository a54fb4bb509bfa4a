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
* rows shorter than 64 are summed by ``np.einsum("ij->i", ...)`` (another
  summation order, 4 to 5 times faster than a reduction there, measured at
  S = 16 to 63). Not by a BLAS product with a ones vector, which is faster
  still but whose result for a row depends on how many rows the call
  holds (measured: in 473 of 600 random cuts), and so would depend on the
  chunks and the thread count;
* the work is split over the heads: a problem with several ``(batch, kv
  head)`` units and at least two chunks' worth of score entries (see
  :func:`_chunk_entries`) is cut into rectangular chunks of whole heads.
  Each chunk runs its whole pipeline (its score GEMM, the row passes, its
  ``P V``; in the backward its four GEMMs and the row passes) in a thread
  pool, with the BLAS limited to ``threads // chunks`` threads (at least 1)
  through threadpoolctl while the chunks run. NumPy releases the GIL in
  BLAS calls and in ufunc loops, so the chunks run side by side and one
  chunk's GEMM overlaps another's ``exp``. This beats a threaded BLAS with
  only the row passes in threads because NumPy's float64 ``exp`` is a
  scalar loop (about a quarter of the time here) and a threaded BLAS leaves
  its worker threads spinning on the cores that ``exp`` needs. A single
  head, a small problem, or a BLAS that threadpoolctl cannot limit keeps the
  BLAS's own threads and runs the row passes on row blocks in the pool.
  Chunks are cut from the shape alone and every row and every matrix
  product is computed the same way in any chunk, so the result does not
  depend on the number of threads (tests compare the bytes).

Threads: the number of CPUs this process may run on by default; the
environment variable ``SDPA_REF_NUM_THREADS`` overrides it (read on every
call; 1 disables the pool; the pool's size is fixed when it is first made).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Optional

import numpy as np

from ._problem import Problem

__all__ = ["fast_forward", "fast_backward", "num_threads"]

_POOL: Optional[ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()
#: Below this many entries an element-wise pass runs inline (threads cost more than they save).
_MIN_PARALLEL = 1 << 22
#: Score entries of one chunk of heads for the pool when ``E + Ev >= 128`` (see :func:`_chunk_entries`).
_CHUNK_ENTRIES = 1 << 20
#: Rows shorter than this are summed by einsum (a reduction is slow on them).
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
    _wait_all([pool.submit(fn, *[a[b0:b1] for a in arrays]) for b0, b1 in zip(bounds[:-1], bounds[1:]) if b1 > b0])


def _wait_all(futs):
    """Wait for every future, then raise the first error: no piece is left running on a failure."""
    wait(futs)
    for f in futs:
        f.result()


# ------------------------------------------------------------- chunking


def _chunk_entries(width):
    """Score entries per chunk for head width ``E + Ev``: ``_CHUNK_ENTRIES`` scaled by ``width / 128``,
    between a quarter of it and all of it.

    The cut pays when the element-wise work (``exp`` above all, a scalar loop
    in NumPy) is a large part of the time; the GEMM work per score entry
    grows with ``E + Ev``. Measured on 2 cores (fwd + bwd, paired rounds):
    cutting at 2**18 entries took 1.13-1.2x longer than one piece for
    ``(2, 4, 256, 64)`` and ``(4, 8, 128, 64)``, but 0.70x for
    ``(8, 8, 128, 16)`` and 0.73x for the full gradient check on
    ``(2, 2, 16, 8)``; at ``(1, 8, 1024, 64)`` one head per chunk is the
    fastest cut.
    """
    return max(_CHUNK_ENTRIES >> 2, min(_CHUNK_ENTRIES, _CHUNK_ENTRIES * width // 128))


def _head_chunks(lead, unit, width=128):
    """Rectangular chunks of the leading ``(*batch, Hkv)`` index, as tuples of slices.

    Each chunk holds about :func:`_chunk_entries` score entries (``unit`` is
    the number of one ``(batch, kv head)``, ``width`` is ``E + Ev``): whole
    trailing axes, a range of the next one, single indices of the outer
    ones. The cut depends on the shape only, never on the thread count. One
    chunk (everything) when the problem is below two chunks or there is one
    thread.
    """
    whole = [tuple(slice(None) for _ in lead)]
    N = int(np.prod(lead))
    target = _chunk_entries(width)
    if num_threads() == 1 or N < 2 or N * unit < 2 * target:
        return whole
    per = max(1, target // max(unit, 1))                  # units per chunk
    ax, t = len(lead) - 1, 1
    while ax >= 0 and t * lead[ax] <= per:
        t *= lead[ax]
        ax -= 1
    if ax < 0:
        return whole
    r = max(1, per // t)
    chunks = []
    for outer in np.ndindex(*lead[:ax]):
        for a0 in range(0, lead[ax], r):
            chunks.append(tuple(slice(i, i + 1) for i in outer) + (slice(a0, min(a0 + r, lead[ax])),)
                          + tuple(slice(None) for _ in lead[ax + 1:]))
    return chunks


def _take(a, idx, ndim):
    """Chunk ``idx`` (slices of the leading axes of an ``ndim``-dim layout) of ``a``, right-aligned and
    broadcastable: axes that ``a`` lacks or has as 1 are left alone. A view, never a copy."""
    if a is None:
        return None
    off = ndim - a.ndim
    sl = tuple(slice(None) if i - off < 0 or a.shape[i - off] == 1 else s
               for i, s in enumerate(idx) if i - off >= 0)
    return a[sl]


def _full_index(idx, G):
    """A chunk of the grouped ``(*batch, Hkv)`` index as one of the full ``(*batch, Hq)`` index."""
    h = idx[-1]
    hq = h if h.start is None else slice(h.start * G, h.stop * G)
    return idx[:-1] + (hq,)


def _view(a, shape):
    """``a.reshape(shape)`` that must be a view (the chunks are contiguous blocks of their buffers)."""
    r = a.reshape(shape)
    assert r.size == 0 or r.__array_interface__["data"][0] == a.__array_interface__["data"][0]
    return r


def _rows(a):
    """``a`` as a 2-D ``(rows, last)`` array (also when the last dim is 0)."""
    return a.reshape(int(np.prod(a.shape[:-1])), a.shape[-1])


def _run(worker, chunks):
    """One chunk inline (its row passes may use the pool); several side by side in the pool.

    Several chunks run with the BLAS limited to ``threads // chunks`` threads
    each (at least 1), so that the chunks' GEMMs do not oversubscribe the
    cores. Without a BLAS that threadpoolctl can limit they run one by one.
    """
    n = num_threads()
    if len(chunks) > 1:
        with _blas_threads(max(1, n // len(chunks))) as limited:
            if limited:
                _wait_all([_pool(n).submit(worker, c, False) for c in chunks])
                return
    for c in chunks:
        worker(c, True)


_BLAS_LOCK = threading.Lock()
_BLAS_STATE = {"controller": None, "users": 0, "limit": None}


class _blas_threads:
    """Limit the BLAS to ``n`` threads while at least one caller is inside (process-wide).

    threadpoolctl's limits are global, and two threads entering and leaving
    in turn would otherwise restore each other's limits in the wrong order:
    the first caller in sets the limit, the last one out restores the BLAS.
    ``__enter__`` returns False (and limits nothing) when threadpoolctl is
    missing or finds no BLAS it can control.
    """

    def __init__(self, n):
        self.n = n
        self.active = False

    def __enter__(self):
        with _BLAS_LOCK:
            st = _BLAS_STATE
            if st["controller"] is None:
                st["controller"] = _controller()
            if st["controller"] is False:
                return False
            if st["users"] == 0:
                st["limit"] = st["controller"].limit(limits=self.n, user_api="blas")
            st["users"] += 1
            self.active = True
            return True

    def __exit__(self, *exc):
        if not self.active:
            return False
        with _BLAS_LOCK:
            st = _BLAS_STATE
            st["users"] -= 1
            if st["users"] == 0:
                st["limit"].restore_original_limits()
                st["limit"] = None
        return False


def _after_fork_in_child():
    """A forked child has none of the parent's threads: start a fresh pool and fresh locks there."""
    global _POOL, _POOL_LOCK, _BLAS_LOCK
    _POOL = None
    _POOL_LOCK = threading.Lock()
    _BLAS_LOCK = threading.Lock()
    limit = _BLAS_STATE["limit"]
    _BLAS_STATE.update(users=0, limit=None)
    if limit is not None:             # forked while a parent thread held the limit: give the child its BLAS back
        try:
            limit.restore_original_limits()
        except Exception:  # pragma: no cover - best effort in a fork handler
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _controller():
    """threadpoolctl's controller of the loaded BLAS libraries, or False when there is none."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return False
    ctl = ThreadpoolController()
    return ctl if ctl.select(user_api="blas").lib_controllers else False


class _Layout:
    """The shapes of one problem in the grouped ``(*batch, Hkv, G*L)`` and full ``(*batch, Hq, L)`` layouts."""

    def __init__(self, prob: Problem):
        self.full, self.grouped = prob.full_scores, prob.grouped
        self.lead = self.grouped[:-1]
        self.S = self.full[-1]
        Hkv = prob.k.shape[-3]
        self.G = self.full[-3] // Hkv if Hkv else 1
        self.chunks = _head_chunks(self.lead, self.grouped[-1] * self.S, prob.q.shape[-1] + prob.v.shape[-1])
        self.nd_g, self.nd_f = len(self.lead) + 2, len(self.full)

    def full_view(self, a):
        """The full-layout view of a grouped-layout chunk ``a``."""
        return _view(a, a.shape[:-3] + (a.shape[-3] * self.G, self.full[-2], a.shape[-1]))


# ----------------------------------------------------------------- forward


def fast_forward(prob: Problem):
    """``(O, P, lse, tanh, empty)`` in the layouts of the plain path."""
    lay = _Layout(prob)
    full, lead, S = lay.full, lay.lead, lay.S
    GL, Ev = lay.grouped[-1], prob.v.shape[-1]
    ct = prob.dtype
    T = np.empty(lead + (GL, S), dtype=ct)             # becomes P in place
    O = np.empty(lead + (GL, Ev), dtype=ct)
    lse = np.empty(lead + (GL, 1), dtype=ct)
    empty = np.empty(lead + (GL, 1), dtype=bool)
    th = None if prob.softcap is None else np.empty_like(T)
    allowed = prob.allowed()
    blocked = None if allowed is None else ~allowed
    dist = None if prob.alibi is None else prob.alibi_distance()
    drop = None if prob.keep is None else 1.0 / (1.0 - prob.dropout_p)
    sub = max(1, _CACHE_ENTRIES // max(S, 1))          # rows per cache-sized block

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
                s = np.einsum("ij->i", tb)[:, None] if S < _SHORT_ROW else np.sum(tb, axis=-1, keepdims=True)
                np.multiply(tb, 1.0 / s, out=tb)
                np.log(s, out=lb)
                lb += m

    def chunk(idx, inner_parallel):
        fidx = _full_index(idx, lay.G)
        q, k, v = (_take(a, idx, lay.nd_g) for a in (prob.q, prob.k, prob.v))
        Tc = T[idx]
        if q.shape[-2] <= k.shape[-2]:                 # fold the scale into the smaller operand
            np.matmul(prob.scale * q, np.swapaxes(k, -1, -2), out=Tc)
        else:
            np.matmul(q, np.swapaxes(prob.scale * k, -1, -2), out=Tc)
        Tf = lay.full_view(Tc)
        if th is not None:
            thf = lay.full_view(th[idx])
            np.divide(Tf, prob.softcap, out=Tf)
            np.tanh(Tf, out=thf)
            np.multiply(thf, prob.softcap, out=Tf)
        for add in (prob.mask_float, prob.bias):
            if add is not None:
                Tf += _take(add, fidx, lay.nd_f)
        if dist is not None:
            Tf += -_take(prob.alibi, fidx, lay.nd_f) * _take(dist, fidx, lay.nd_f)
        if blocked is not None:
            np.copyto(Tf, -np.inf, where=_take(blocked, fidx, lay.nd_f))
        rows = (_rows(Tc), _rows(lse[idx]), _rows(empty[idx]))
        if inner_parallel:
            _row_chunks(softmax_rows, *rows)
        else:
            softmax_rows(*rows)
        Pd = Tc if drop is None else _view(Tf * (_take(prob.keep, fidx, lay.nd_f) * drop), Tc.shape)
        np.matmul(Pd, v, out=O[idx])

    _run(chunk, lay.chunks)
    P = T.reshape(full)
    if th is not None:
        th = th.reshape(full)
    empty = empty.reshape(full[:-1] + (1,))
    if np.any(empty):                                  # the policy's rows, then O again (a rare path)
        from .attention import _fill_empty_rows
        from ._problem import Scores

        P = _fill_empty_rows(P, prob, Scores(T=P, tanh=th, empty=empty, padded=prob.padded_rows()))
        P_drop = P if prob.keep is None else P * (prob.keep * drop)
        O = P_drop.reshape(lay.grouped + (S,)) @ prob.v
    O = O.reshape(full[:-1] + (Ev,))
    if prob.fully_masked == "nan" and S == 0:
        O = np.full_like(O, np.nan)
        padded = prob.padded_rows()
        if padded is not None:
            O = np.where(padded, 0.0, O)
    return O, P, lse.reshape(full[:-1]), th, empty


# ---------------------------------------------------------------- backward


def fast_backward(prob: Problem, P, O, th, empty, g):
    """The ``"probs"`` backward with D = rowsum(dO * O) and in-place dT."""
    from .attention import _pack_grads

    lay = _Layout(prob)
    full, grouped, lead, S = lay.full, lay.grouped, lay.lead, lay.S
    ct = prob.dtype
    E, Ev = prob.q.shape[-1], prob.v.shape[-1]
    dO = g.astype(ct, copy=False).reshape(grouped + (Ev,))
    Og = O.reshape(grouped + (Ev,))
    Pg = np.broadcast_to(P, full).reshape(grouped + (S,))
    thg = None if th is None else np.broadcast_to(th, full).reshape(grouped + (S,))
    emptyg = empty.reshape(grouped + (1,))
    # the whole dT is kept only when attn_mask or bias needs its gradient (summed down afterwards);
    # otherwise each chunk works in its own buffer, which the allocator reuses
    keep_dT = prob.mask_float is not None or prob.bias is not None
    dT = np.empty(grouped + (S,), dtype=ct) if keep_dT else None
    dq = np.empty(grouped + (E,), dtype=ct)
    dk = np.empty(lead + (S, E), dtype=ct)
    dv = np.empty(lead + (S, Ev), dtype=ct)
    drop = None if prob.keep is None else 1.0 / (1.0 - prob.dropout_p)
    zero_empty = prob.fully_masked == "uniform" and np.any(empty)
    sub = max(1, _CACHE_ENTRIES // max(S, 1))

    def score_grad_rows(d, p, D_c):
        for r0 in range(0, d.shape[0], sub):
            db = d[r0:r0 + sub]
            np.subtract(db, D_c[r0:r0 + sub], out=db)
            np.multiply(db, p[r0:r0 + sub], out=db)

    def chunk(idx, inner_parallel):
        fidx = _full_index(idx, lay.G)
        q, k, v = (_take(a, idx, lay.nd_g) for a in (prob.q, prob.k, prob.v))
        Pc, dOc = Pg[idx], dO[idx]
        keep = None if drop is None else _take(prob.keep, fidx, lay.nd_f)
        if keep is None:
            Pd = Pc
        else:
            Pd = (lay.full_view(np.ascontiguousarray(Pc)) * (keep * drop)).reshape(Pc.shape)
        np.matmul(np.swapaxes(Pd, -1, -2), dOc, out=dv[idx])              # dV = P_drop^T dO
        dTc = dT[idx] if keep_dT else np.empty(Pc.shape, dtype=ct)
        np.matmul(dOc, np.swapaxes(v, -1, -2), out=dTc)                   # dP = dO V^T
        if keep is not None:
            dTf = lay.full_view(dTc)
            dTf *= keep
            dTf *= drop
        D = np.sum(dOc * Og[idx], axis=-1).reshape(-1, 1)                 # D = rowsum(dO * O)
        rows = (_rows(dTc), _rows(Pc), D)
        if inner_parallel:
            _row_chunks(score_grad_rows, *rows)
        else:
            score_grad_rows(*rows)                                         # dT = (dP - D) * P
        if zero_empty:
            np.copyto(dTc, 0.0, where=emptyg[idx])
        dTraw = dTc
        if thg is not None:                                                # softcap: dT (1 - tanh^2)
            dTraw = np.multiply(dTc, 1.0 - thg[idx] * thg[idx], out=None if keep_dT else dTc)
        np.multiply(np.matmul(dTraw, k, out=dq[idx]), prob.scale, out=dq[idx])
        np.multiply(np.matmul(np.swapaxes(dTraw, -1, -2), q, out=dk[idx]), prob.scale, out=dk[idx])

    _run(chunk, lay.chunks)
    return _pack_grads(prob, dq.reshape(full[:-1] + (E,)), dk, dv, None if dT is None else dT.reshape(full))
