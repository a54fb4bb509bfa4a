"""The blocks the tiled engine walks: their sizes, and the scores, dropout and ``P V`` of one block.

A block is ``b`` query rows against ``b`` keys, of every batch entry and
head at once (``(*batch, Hq, bi, bj)``). :func:`check_block_size` and
:func:`auto_block_size` choose ``b`` (``block_size="auto"``: the largest
multiple of 16 whose temporaries fit :data:`DEFAULT_BLOCK_BUDGET`);
:class:`Blocks` computes a block's scores through the one transform chain
of :mod:`sdpa_ref.transforms`, its dropout keep mask and its product with
the values, for the tiled forward, backward and JVP (:mod:`.tiled`).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np

from ..exact import _native
from ..broadcast import block_of
from ..transforms import score_mod_params_vjp, scores_forward, transform_scores

__all__ = ["BlockSummary", "Blocks", "DEFAULT_BLOCK_BUDGET", "allowed_anywhere", "auto_block_size", "check_block_size",
           "exp_inplace", "first_last", "key_spans", "lse_blocks", "ranges", "rectangles", "span_rows"]

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


class Blocks:
    """Scores, dropout and ``P V`` of one (row block, key block) of a problem."""

    def __init__(self, prob):
        self.p = prob

    def raw(self, i0, i1, j0, j1):
        """The raw scores ``scale * Q_I K_J^T`` of the block, ``(*batch, Hq, bi, bj)``, a fresh array."""
        p = self.p
        T = scores_forward(p.q[..., i0:i1, :], p.k[..., None, j0:j1, :], p.scale)   # (..., Hkv, G, bi, bj)
        T = T.reshape(T.shape[:-4] + (p.Hq, i1 - i0, j1 - j0))
        want = p.batch + T.shape[-3:]
        if T.shape != want:                                          # batch dims that only `value` has
            T = np.broadcast_to(T, want).copy()
        return T

    def scores(self, i0, i1, j0, j1, allowed, sech2=False):
        """``(T, sech2)`` of the block, ``(*batch, Hq, bi, bj)`` (the chain's slope with ``sech2``, else None)."""
        return transform_scores(self.p, self.raw(i0, i1, j0, j1), (i0, i1), (j0, j1), sech2=sech2, allowed=allowed)

    def mod_grads(self, dT, i0, i1, j0, j1, acc=None):
        """The score function's captured tensors' gradients from the block's ``dT``, added to ``acc`` (a list, or
        None: a new one); None without captured tensors."""
        mod = self.p.options.score_mod
        if mod is None or not mod.params:                # nothing captured: no raw scores to recompute
            return acc
        return score_mod_params_vjp(self.p, dT, self.raw(i0, i1, j0, j1), (i0, i1), (j0, j1), acc)

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


def span_rows(L):
    """Query rows per block of the dense engine's block-skipping schedule (:func:`key_spans`): 128, or ``L / 32``
    from ``L = 4096`` on (per causal row about half a block of masked keys is computed; fewer, larger blocks cost
    less per block). Measured side by side, forward + backward causal over unmasked, 2 threads: at ``L = 2048``
    blocks of 128 rows gave 0.77-0.78 (float64) and 0.76-0.79 (float32), blocks of 64 0.80 and 0.87; at
    ``L = 4096`` 128 and 256 rows were within the noise of each other (0.71-0.75)."""
    return max(128, L // 32)


class BlockSummary(NamedTuple):
    """Which keys each block of query rows attends (:func:`key_spans`)."""
    spans: list           # (i0, i1, j0, j1) per block of rows: its keys' span, every allowed entry inside
    rects: list           # the spans' cover by large rectangles (:func:`rectangles`)
    full: np.ndarray      # (blocks, S) bool: the keys allowed in every row of the block, in every batch and head

    def is_full(self, i0, i1, j0, j1):
        """Whether every entry of the rectangle (made of whole blocks) is allowed: its scores need no mask."""
        b = self.spans[0][1] - self.spans[0][0]
        return bool(self.full[i0 // b:-(-i1 // b), j0:j1].all())


def key_spans(allowed, L, S, b, align=8):
    """The block summary of an allowed set: per block of ``b`` query rows, the keys ``[j0, j1)`` that hold every
    allowed entry of its rows in any batch entry or head, as ``(i0, i1, j0, j1)``, their cover by rectangles and
    the keys each block allows in all its rows (:class:`BlockSummary`); None when no block can skip a key (no
    mask, or every block's span is every key).

    ``allowed`` is the structural allowed set (:meth:`sdpa_ref.problem.Problem.allowed`), broadcastable to
    ``(..., L, S)``, or None. ``j0`` is rounded down and ``j1`` up to a multiple of ``align`` (or ``S``): the
    compiled row passes sum a row in eight lanes from its first entry (:func:`sdpa_ref.pivot.lane_rowsum`), so
    a span that starts on a multiple of eight adds the same terms in the same lanes as the whole row, the
    skipped ones being exact zeros. A block with no allowed entry keeps one aligned group of keys (the row
    passes then see its rows as fully masked, as the whole rows would be). The spans depend on the shape and
    the mask only, never on the thread count.
    """
    if allowed is None or L == 0 or S == 0:
        return None
    some = allowed_anywhere(allowed, L, S)                  # in any batch entry or head
    every = allowed_anywhere(allowed, L, S, np.logical_and)  # in all of them
    starts = np.arange(0, L, b)
    cols = _per_block(some, b, np.any)                      # per block: keys allowed in any of its rows
    full = _per_block(every, b, np.all)                     # and in all of them
    first, last = first_last(cols)
    has = last > 0
    first, last = np.where(has, first, 0), np.where(has, last, 1)
    j0 = (first // align) * align
    j1 = np.minimum(S, -(-last // align) * align)
    if np.all(j0 == 0) and np.all(j1 == S):
        return None
    spans = [(int(i), min(L, int(i) + b), int(x0), int(x1)) for i, x0, x1 in zip(starts, j0, j1)]
    return BlockSummary(spans, rectangles(spans, full), full)


def allowed_anywhere(allowed, L, S, reduce=np.logical_or):
    """The ``(L, S)`` keys allowed in some batch entry or head of the allowed set ``allowed`` (broadcastable to
    ``(..., L, S)``; ``reduce=np.logical_and``: in every one)."""
    a = np.asarray(allowed)
    lead = a.reshape((-1,) + a.shape[-2:]) if a.ndim > 2 else a.reshape((1,) * (3 - a.ndim) + a.shape)
    return np.broadcast_to(reduce.reduce(lead, axis=0), (L, S))


def first_last(mask):
    """``(start, stop)`` per row of the bool ``(n, m)`` ``mask``: its first True and its last plus one (``m`` and
    0 on a row without one)."""
    has = mask.any(axis=1)
    m = mask.shape[1]
    return np.where(has, mask.argmax(axis=1), m), np.where(has, m - mask[:, ::-1].argmax(axis=1), 0)


def _per_block(a, b, reduce):
    """``reduce`` over each block of ``b`` rows of the 2-D ``a``: ``(blocks, S)``."""
    L, whole = a.shape[0], a.shape[0] - a.shape[0] % b
    parts = [reduce(a[:whole].reshape(whole // b, b, a.shape[1]), axis=1)] if whole else []
    if whole < L:
        parts.append(reduce(a[whole:], axis=0, keepdims=True))
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def rectangles(spans, full=None):
    """A cover of the spans (:func:`key_spans`) by few, large rectangles ``(i0, i1, j0, j1)``, each entry of every
    span in exactly one: the matrix products run on them (a causal set of ``L`` rows is about ``log2(L / b)``
    levels of square-ish products instead of ``L / b`` thin ones).

    The later half of a range of blocks takes the keys common to all its spans as one rectangle (with
    ``full``, :class:`BlockSummary`'s, the longest run of those keys that its blocks allow in every row, when
    that is at least half of them: a rectangle that needs no mask); what is left of its spans on either side,
    and the earlier half, are covered the same way.
    """
    out = []

    def cover(lo, hi, sp):
        sp = [(i, a, b) for i, a, b in sp if b > a]
        if not sp:
            return
        if len(sp) == 1 or hi - lo == 1:
            out.extend((spans[i][0], spans[i][1], a, b) for i, a, b in sp)
            return
        mid = (lo + hi) // 2
        late = [x for x in sp if x[0] >= mid]
        cover(lo, mid, [x for x in sp if x[0] < mid])
        if not late:
            return
        c0, c1 = max(a for _, a, _ in late), min(b for _, _, b in late)
        if c1 <= c0 or late[-1][0] - late[0][0] + 1 != len(late):
            for i, a, b in late:                                # nothing in common (or a gap): block by block
                out.append((spans[i][0], spans[i][1], a, b))
            return
        if full is not None:                                    # prefer keys every row allows
            ok = np.concatenate(([False], full[late[0][0]:late[-1][0] + 1, c0:c1].all(axis=0), [False]))
            edges = np.flatnonzero(np.diff(ok.astype(np.int8)))
            if len(edges):                                      # (the run's ends on multiples of 8, as the
                runs = edges.reshape(-1, 2) + c0                # spans': products of whole vectors)
                runs = np.stack([-(-runs[:, 0] // 8) * 8, np.where(runs[:, 1] == c1, c1, runs[:, 1] // 8 * 8)], 1)
                width = runs[:, 1] - runs[:, 0]
                r0, r1 = runs[np.flatnonzero(width == width.max())[0]]    # the longest, the first of equals
                if 2 * (r1 - r0) >= c1 - c0:
                    c0, c1 = int(r0), int(r1)
        out.append((spans[late[0][0]][0], spans[late[-1][0]][1], c0, c1))
        cover(mid, hi, [(i, a, c0) for i, a, _ in late])
        cover(mid, hi, [(i, c1, b) for i, _, b in late])

    cover(0, len(spans), [(i, sp[2], sp[3]) for i, sp in enumerate(spans)])
    return out


def ranges(n, b):
    return [(s, min(s + b, n)) for s in range(0, n, b)] if n else []


def exp_inplace(x):
    """``exp`` of the fresh array ``x``, in place: the fast row passes' compiled SIMD exp (within 1 ulp,
    :mod:`sdpa_ref.exact._native`) for real float64 and float32, NumPy's otherwise (complex, for the complex
    step, or without a compiler)."""
    lib = _native.kernels()
    if lib is not None and x.dtype in (np.float64, np.float32) and x.flags.c_contiguous and x.flags.writeable:
        return _native.fast_exp(lib, x, out=x)
    return np.exp(x)
