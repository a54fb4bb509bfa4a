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

import numpy as np

from ..exact import _native
from ..broadcast import block_of
from ..transforms import score_mod_params_vjp, scores_forward, transform_scores

__all__ = ["Blocks", "DEFAULT_BLOCK_BUDGET", "auto_block_size", "check_block_size", "exp_inplace", "lse_blocks",
           "ranges"]

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
