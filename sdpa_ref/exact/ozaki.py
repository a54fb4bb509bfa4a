r"""Matrix products that the BLAS forms exactly: the Ozaki scheme, with a double-double result.

``matmul(A, B)`` returns ``A @ B`` as a double-double ``(hi, lo)`` within
about ``2**-(bits)`` of the exact product, relative to ``|A| |B|``
(``bits=104`` by default), and **the same bits on every BLAS, thread count
and machine**. The way there (Ozaki, Ogita, Oishi and Rump, 2012):

1. Every row of ``A`` (column of ``B``) is scaled by a power of two to a
   maximum in ``[1/2, 1)``: exact, and it keeps the products below far from
   underflow.
2. ``A`` is cut into slices ``A = A_1 + A_2 + ... + A_n + R``:
   ``A_p = fl(fl(X + sigma) - sigma)`` with ``sigma = 2**(rho + e)`` for the
   row's current maximum ``2**e``, and ``X`` what is left. Each slice of a
   row lies on the grid ``2**(rho + e - 53)`` and has at most ``53 - rho``
   bits; ``B`` is cut the same way by columns. With
   ``2 rho >= 54 + log2(K)``, every entry of ``A_p B_q`` is a sum of ``K``
   products on one grid whose total stays below ``2**53`` grid steps, so
   **every product and every partial sum is exact, in any order**: what the
   BLAS does inside a GEMM (blocking, FMA, threads, SIMD) does not matter.
3. The products ``A_p B_q`` with ``p + q <= n + 1`` (the others lie below
   the target accuracy) are added in a fixed order, smallest first, element
   by element: the small ones in float64, the three leading levels into a
   double-double (:mod:`.dd`); the result is scaled back. A product is
   formed only on the rows and columns of its slices that hold a nonzero
   entry (a float64 line often fits in fewer slices than ``n``), and over
   the contraction's lines of ``B``'s slice that hold one where those are
   few (the last slice of a float64 column holds the last bits of a few
   small entries): what is left out is an exact ``+0``, or a sum of zero
   terms in a sum whose every partial sum is exact, which moves no bit.

The inputs may be dd pairs (the slices are then cut from ``hi`` and ``lo``
in turn, every remainder kept exactly by TwoSum). Inputs must be finite.
"""

from __future__ import annotations

import math

import numpy as np

from .._threads import num_threads, run_all
from ._native import dd_add_d_inplace, dd_finish, dd_mul_d_scalar, kernels, level_redo, slice_rows
from .dd import dd_add_d, dd_mul_d, fast_two_sum, pow2, two_sum

__all__ = ["matmul", "n_slices"]


#: Entries (1 MiB of float64) of the larger of one block of the result, whose sums are formed together, and one
#: slice of that block's rows of ``A``.
_BLOCK_ENTRIES = 1 << 17
#: Products (``M N K``) below which the blocks run one after the other rather than in the pool.
_PARALLEL_WORK = 1 << 21
#: Columns of ``B`` up to which a ``final=True`` product cuts ``B``'s slices side by side, so that each slice of a
#: block of ``A`` is packed by the BLAS once for all its products (:func:`_products`' ``joined``).
_JOIN_COLUMNS = 256


def _ranges(r, name, M):
    """``(start, stop)`` of :func:`matmul`'s ``spans`` or ``contract`` as two int arrays of ``M`` entries, or None."""
    if r is None:
        return None
    try:
        start, stop = (np.asarray(x) for x in r)
    except (TypeError, ValueError):
        raise TypeError(f"`{name}` should be a pair (start, stop) of int arrays, one entry per row of A, but got "
                        f"{type(r).__name__}") from None
    if start.shape != (M,) or stop.shape != (M,) or start.dtype.kind not in "iu" or stop.dtype.kind not in "iu":
        raise ValueError(f"`{name}` should be two int arrays of shape ({M},), one entry per row of A, but got "
                         f"{start.dtype}{list(start.shape)} and {stop.dtype}{list(stop.shape)}")
    return start, stop


def _out(out, shape, A, B):
    """:func:`matmul`'s ``out`` checked: a pair of writeable C-contiguous float64 arrays of ``shape``, apart from
    each other and from the inputs."""
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, np.ndarray) for x in out)):
        raise TypeError(f"`out` should be a pair (hi, lo) of float64 arrays, but got {type(out).__name__}")
    for x in out:
        if x.shape != tuple(shape) or x.dtype != np.float64 or not x.flags.c_contiguous or not x.flags.writeable:
            raise ValueError(f"`out` should be two writeable C-contiguous float64 arrays of shape {tuple(shape)}, "
                             f"but got {x.dtype}{list(x.shape)}")
    if any(np.may_share_memory(out[i], y) for i in range(2) for y in (out[1 - i],) + A + B if y is not None):
        raise ValueError("`out` should share no memory with each other or with `A` and `B`")
    return out


def _rho(K):
    return math.ceil((54 + math.log2(max(K, 1))) / 2)


def n_slices(K, bits=104):
    """Slices per operand so that the products left out lie below about ``2**-bits`` of ``|A| |B|``.

    A slice carries ``beta = 53 - rho`` bits, so a product of level ``l = p + q`` is below
    ``K 2**(-beta l)`` of the product of the lines' maxima; the ``n + 1`` products of level ``n`` and the
    remainders are what ``n`` slices leave out: ``beta n >= bits + log2(K) + log2(n + 3)``.
    """
    beta = 53 - _rho(K)
    n = 2
    while beta * n < bits + math.log2(max(K, 1)) + math.log2(n + 3):
        n += 1
    return n


def _as_dd(x):
    """A dd pair; a plain float64 array has no low half (None), which spares the slicing its TwoSums."""
    if isinstance(x, tuple):
        return x
    return x, None


def _normalise(x, axis):
    """``(x * 2**-e, e)`` with the max over ``axis`` of ``|x.hi|`` in ``[1/2, 1)`` (e = 0 for a zero line)."""
    mx = np.max(np.abs(x[0]), axis=axis, keepdims=True)
    _, e = np.frexp(mx)
    if e.min() >= -1022 and e.max() <= 1022:
        f = pow2(-e)
        return (x[0] * f, None if x[1] is None else x[1] * f), e
    return (np.ldexp(x[0], -e), None if x[1] is None else np.ldexp(x[1], -e)), e


def _column_cut():
    """How :func:`._native.slice_rows` cuts ``B``'s columns: written as the C-contiguous ``(K, N)`` slices a GEMM
    reads fastest (about 11% faster GEMMs at ``K = 1024, N = 64`` than their transposes), and a large ``B`` in
    ranges of columns side by side in the pool (``B`` is cut before its product's blocks start)."""
    return dict(transposed=True, parts=num_threads(), run=run_all)


def _slices(x, axis, n, rho):
    """``(slices, remainder)``: ``n`` slices of the dd ``x`` (normalised), each on its line's grid (see the
    module docstring), and what is left, a dd: ``x == sum(slices) + remainder`` exactly."""
    hi, lo = x
    lib = kernels()
    if lib is not None and hi.ndim >= 2:                   # the compiled loop: the same operations, in cache
        if axis == -1:
            return slice_rows(lib, hi, lo, n, rho)
        out, (h, l) = slice_rows(lib, np.swapaxes(hi, -1, -2), None if lo is None else np.swapaxes(lo, -1, -2),
                                 n, rho, **_column_cut())     # the columns, read in place, written as columns
        return out, (np.swapaxes(h, -1, -2), np.swapaxes(l, -1, -2))
    return _slices_numpy(x, axis, n, rho)


def _normalised_slices(x, axis, n, rho, remainder=True):
    """``(slices, remainder, e)``: :func:`_slices` of ``x`` normalised by :func:`_normalise` along ``axis``, and
    its exponents; the compiled loop scales each line as it cuts it (no normalised copy is formed), and forms no
    remainder with ``remainder=False`` (None stands in for it)."""
    lib = kernels()
    hi, lo = x
    if lib is not None and hi.ndim >= 2:
        if axis == -1:
            out, rem, e = slice_rows(lib, hi, lo, n, rho, normalise=True, remainder=remainder)
            return out, rem, e
        out, rem, e = slice_rows(lib, np.swapaxes(hi, -1, -2), None if lo is None else np.swapaxes(lo, -1, -2),
                                 n, rho, normalise=True, remainder=remainder, **_column_cut())
        return (out,
                None if rem is None else (np.swapaxes(rem[0], -1, -2), np.swapaxes(rem[1], -1, -2)),
                np.swapaxes(e, -1, -2))
    x, e = _normalise(x, axis)
    out, rem = _slices_numpy(x, axis, n, rho)
    return out, rem, e


def _slices_numpy(x, axis, n, rho):
    """:func:`_slices` in NumPy: the definition, and what runs without the compiled kernels."""
    hi, lo = x
    out = []
    for _ in range(n):
        mx = np.max(np.abs(hi), axis=axis, keepdims=True)
        _, e = np.frexp(mx)
        sigma = pow2(np.maximum(e + rho, -1022))           # e <= 0 after the normalisation: e + rho < 1023
        s = (hi + sigma) - sigma                           # exact: hi rounded to the grid 2**(rho + e - 53)
        out.append(s)
        if lo is None:                                     # a float64 input: the remainder hi - s is exact
            hi = hi - s
        else:
            hi, lo = two_sum(hi - s, lo)                   # hi - s is exact; the remainder stays exact
    return out, (hi, np.zeros_like(hi) if lo is None else lo)


def _line_max(x, axis):
    return np.max(np.abs(x), axis=axis, keepdims=True)


def _products(a, b, n, rows=None, cols=None, klines=None, normalise=True, joined=None):
    """The dd sum of the products ``a[p] @ b[q]``, ``p + q < n``, smallest level first (a fixed order).

    A product of level ``l = p + q`` is below ``2**(-beta l)`` of ``|A||B|``: levels 3 and up are summed in
    float64 (their rounding is below ``2**(-53 - 3 beta)``), the rest into a dd.

    A product is formed only on the rows of ``a[p]`` and the columns of ``b[q]`` that hold a nonzero entry
    (:func:`_product`); a float64 operand's line is often cut in fewer slices than ``n`` (its 53 bits, and the
    exponents it spans, fit in three), and what its zero slices would add is an exact ``+0``, which moves no
    bit of the dd sum: a product's entry that is zero is ``+0`` (a GEMM's sum starts from ``+0``, and
    ``x + (-x)`` is ``+0``), so the sum never holds ``-0``, and adding ``+0`` to a normalised dd gives it back.
    ``rows`` and ``cols``: those lines, a :class:`_Lines` per slice (:func:`_lines_of`), found here when not
    given; :data:`_ALL` where a slice holds a NaN or an infinity (whose product with a zero is NaN: every product
    is then formed in full). ``klines``: for each slice of ``b``, its rows (the contraction's lines) that hold
    a nonzero entry, a :class:`_Lines` each, or None; a product is contracted over those alone where they are
    few (the last slice of a float64 operand holds a few lines' last bits): the terms left out are products
    with zero, and every partial sum is exact, so the sum is the same with or without them.

    ``normalise=False`` returns the sum as it stands, for :func:`.dd.fast_two_sum` to be taken by the caller
    (the compiled end of a block, :func:`._native.dd_finish`, takes it in the same pass as the scalings).

    ``joined`` (or None): ``(J, nj)``, ``J`` ``(..., K, >= nj N)`` holding the first ``nj`` slices of ``b``
    side by side (``b[q]`` is ``J[..., q N:(q + 1) N]``, :func:`._native.slice_rows` with ``joined=True``).
    The products of a slice ``a[p]`` with the leading slices ``b[0], b[1], ...`` that it is multiplied by in
    full are then one GEMM ``a[p] @ [b[0] b[1] ...]`` whose blocks of columns are those products (the same
    exact sums): the BLAS packs ``a[p]`` once rather than once per product (at ``N = 64, K = 1024``, 9% less
    time in the GEMMs, measured in place). The sum then takes them in its usual order.
    """
    acc = None
    lib = kernels()
    rows = _lines_of(_nonzero([_line_max(x, -1) for x in a[:n]]), -1) if rows is None else rows
    cols = _lines_of(_nonzero([_line_max(x, -2) for x in b[:n]]), -2) if cols is None else cols
    if rows is _ALL or cols is _ALL:                       # a NaN or an infinity: every product is formed
        rows, cols, klines = [_EVERY] * n, [_EVERY] * n, None          # (NaN times a zero line of b is NaN)
    formed = {}                                            # (p, q): products formed together, by `joined`
    if joined is not None:
        (J, nj), N = joined, b[0].shape[-1]
        for p in range(n):
            qn = 0                                         # the leading slices of b formed in full with a[p]
            while qn < min(n - p, nj) and _in_full(rows[p], cols[qn], None if klines is None else klines[qn]):
                qn += 1
            if qn > 1:
                both = np.matmul(a[p], J[..., :qn * N])
                formed.update(((p, q), both[..., q * N:(q + 1) * N]) for q in range(qn))
    for lev in range(n - 1, -1, -1):
        for p in range(lev + 1):
            c = formed.pop((p, lev - p), None)
            if c is None:
                c = _product(a[p], b[lev - p], rows[p], cols[lev - p],     # exact (see the module docstring)
                             None if klines is None else klines[lev - p])
            if c is None:                                  # exactly zero: it adds nothing
                continue
            if isinstance(c, _Part):
                if acc is not None:                        # added where it is formed: elsewhere it is +0
                    flat = tuple(x.reshape(x.shape[-2:]) for x in acc)
                    part = _accumulate(tuple(np.ascontiguousarray(x[c.ix]) for x in flat), c.prod, lev, lib)
                    flat[0][c.ix], flat[1][c.ix] = part
                    continue
                c = c.full()
            if acc is None:                                # (a block of `joined` columns: copied, then ours)
                acc = (c if c.flags.c_contiguous else np.ascontiguousarray(c), np.zeros(c.shape))
            else:
                acc = _accumulate(acc, c, lev, lib)
    if acc is None:                                        # every product is zero
        z = np.zeros(np.broadcast_shapes(a[0].shape[:-2], b[0].shape[:-2]) + (a[0].shape[-2], b[0].shape[-1]))
        return z, z.copy()
    return fast_two_sum(*acc) if normalise else acc


def _accumulate(acc, c, lev, lib):
    """The dd ``acc`` plus the product ``c`` of level ``lev``: in float64 from level 3 on, else into the dd (in
    place where the compiled loop runs: ``acc`` is then a pair of C-contiguous arrays that we own)."""
    if lev >= 3:
        np.add(acc[0], c, out=acc[0])
        return acc
    return dd_add_d_inplace(lib, acc, c) if lib is not None else dd_add_d(acc, c)


class _Part:
    """A product formed on some rows or columns alone: ``prod`` at ``ix`` of the ``(M, N)`` result, ``+0``
    elsewhere; ``shape`` the whole result's."""

    def __init__(self, ix, prod, shape):
        self.ix, self.prod, self.shape = ix, prod, shape

    def full(self):
        out = np.zeros(self.shape[-2:])
        out[self.ix] = self.prod
        return out.reshape(self.shape)


#: A slice's product is formed on its nonzero rows (columns) alone when at most this share of them is nonzero.
_SPARSE_SHARE = 0.5


#: What :func:`_nonzero` gives for slices that hold a NaN or an infinity: every line counts.
_ALL = "all"


def _nonzero(maxima):
    """``[m != 0 for m in maxima]``, the lines of each slice that hold a nonzero entry, from their maxima of
    ``|x|`` (keepdims); :data:`_ALL` when one is not finite."""
    if not all(np.isfinite(m).all() for m in maxima):
        return _ALL
    return [m != 0 for m in maxima]


class _Lines:
    """The lines (rows, columns or the contraction's) of one slice that hold a nonzero entry, as a product needs
    them: ``any``, whether one does; ``one``, whether the slice has a single batch entry (with several, a
    product is formed in full); ``idx``, with one batch entry, the indices of those lines where they are at
    most :data:`_SPARSE_SHARE` of them, else None (every line is used). Found once per slice (per block of
    rows, or per batch entry of ``B``), not once per product."""

    __slots__ = ("any", "one", "idx")

    def __init__(self, mask):
        """``mask``: bool, ``(nb, lines)``."""
        self.any = bool(mask.any())
        self.one = mask.shape[0] == 1
        self.idx = None
        if self.one:
            m = mask.reshape(-1)
            if np.count_nonzero(m) <= _SPARSE_SHARE * m.size:
                self.idx = np.flatnonzero(m)


class _Every:
    """Every line of a slice, as :class:`_Lines` has it (a NaN or an infinity: products formed in full)."""
    any, one, idx = True, False, None


_EVERY = _Every()


def _lines_of(masks, axis):
    """:class:`_Lines` for each mask of :func:`_nonzero` (keepdims, the lines along ``axis``), or :data:`_ALL`."""
    if masks is _ALL:
        return _ALL
    out = []
    for m in masks:
        m = m[..., 0] if axis == -1 else m[..., 0, :]
        out.append(_Lines(m.reshape((-1,) + m.shape[-1:]) if m.ndim != 1 else m.reshape(1, -1)))
    return out


def _in_full(ra, cb, kb):
    """Whether :func:`_product` forms ``A @ B`` in full (one ``np.matmul`` of the whole slices) for these lines."""
    if not ra.any or not cb.any:
        return False
    if not (ra.one and cb.one):
        return True
    return ra.idx is None and cb.idx is None and (kb is None or not kb.one or kb.idx is None)


def _product(A, B, ra, cb, kb=None):
    """``A @ B`` for the slices ``A`` ``(nb, M, K)`` and ``B`` ``(nb, K, N)`` whose nonzero rows and columns are
    ``ra`` and ``cb`` (:class:`_Lines`); None where it is zero. With one batch entry, a product whose nonzero
    rows or columns are few is formed on those alone (a :class:`_Part`; the rest is ``+0``): its entries are
    exact sums, the same value in any GEMM, and a zero sum is ``+0`` in every one. ``kb`` (or None): ``B``'s
    rows that hold a nonzero entry; with one batch entry and few of them, the product is contracted over those
    alone (the same exact sums, less their zero terms)."""
    if not ra.any or not cb.any:
        return None
    if not (ra.one and cb.one):                            # several batch entries
        return np.matmul(A, B)
    r, c = ra.idx, cb.idx
    k = kb.idx if kb is not None and kb.one else None
    if k is not None and k.size == 0:
        return None
    if r is None and c is None and k is None:
        return np.matmul(A, B)
    M, N = A.shape[-2], B.shape[-1]
    shape = np.broadcast_shapes(A.shape[:-2], B.shape[:-2]) + (M, N)
    A2, B2 = A.reshape(A.shape[-2:]), B.reshape(B.shape[-2:])
    if r is not None:
        A2 = A2[r] if k is None else A2[np.ix_(r, k)]
    elif k is not None:
        A2 = A2[:, k]
    if k is not None:
        B2 = B2[k]
    prod = np.matmul(A2, B2 if c is None else B2[:, c])
    if r is None and c is None:
        return prod.reshape(shape)
    ix = (slice(None), c) if r is None else r if c is None else np.ix_(r, c)
    return _Part(ix, prod, shape)


#: Levels a ``final=True`` block tries first (10 of the products).
QUICK_LEVELS = 4


def _level_bound(ra, rb, ma, mb, sa, sb, K):
    """An upper bound of ``|A B - (the levels below len(ma))|`` per entry.

    ``ma``/``mb`` are the maxima and ``sa``/``sb`` the sums of absolute values of the first ``t`` slices of
    each row of ``A`` / column of ``B`` (a slice's sum is exact: its entries share a grid with few bits),
    ``ra``/``rb`` the maxima of their remainders. What the levels ``p + q < t`` leave out is the products
    ``A_p B_q`` with ``p + q >= t`` (``p, q < t``) -- an entry of one is at most
    ``min(sum|A_p| max|B_q|, max|A_p| sum|B_q|)`` -- plus ``(A_0 + ... + A_{t-1}) RB + RA B``. The dd sum
    of the kept levels adds at most ``2**-100 |A||B|``; a factor ``1 + 2**-20`` covers the rounding of the
    bound itself.
    """
    t = len(ma)
    SA, SB, MA, MB = sum(sa), sum(sb), sum(ma), sum(mb)
    left = SA * rb + K * ra * (MB + rb) + 2.0 ** -100 * np.minimum(SA * MB, MA * SB) + 2.0 ** -100 * K * (ra + MA) * (rb + MB)
    for p in range(t):
        for q in range(t):
            if p + q >= t:
                left = left + np.minimum(sa[p] * mb[q], ma[p] * sb[q])
    return left * (1 + 2.0 ** -20)


def _redo(lib, ra, rb, ma, mb, sa, sb, h, K):
    """The rows ``(batch entries, rows)`` of a ``final=True`` block whose leading levels ``h`` are not, by
    :func:`_level_bound`, within ``2**-55`` of every entry: they take every level. Compiled where the kernels run
    (:func:`._native.level_redo`: the same operations, entry by entry, so the same rows)."""
    if lib is not None:
        return level_redo(lib, ra, rb, ma, mb, sa, sb, h, K)
    return ~np.all(_level_bound(ra, rb, ma, mb, sa, sb, K) <= 2.0 ** -55 * np.abs(h), axis=-1)


def _quick_columns(B, t, n, rho, joined=False):
    """``(slices, e, maxima, sums, remainder max, side by side, nonzero)`` of ``B``'s columns for a ``final=True``
    product, by the compiled slicer in one pass (each column normalised, its first ``t`` slices cut with their
    maxima and exact sums and the remainder's ``max|hi| + max|lo|``; the last ``n - t`` slices ``+0`` views):
    what the NumPy passes of :func:`matmul` give, the same values (maxima and exact sums, in any order). None
    (those passes run) without the compiled kernels, where a remainder is left (a column needs more than ``t``
    slices) or where a sum is not finite (a NaN or an infinity, which the compiled maxima skip).
    ``joined=True``: the ``t`` slices are cut side by side (``(..., K, t N + pad)``; else None), each slice a
    view of it. ``nonzero``: per slice, its lines (of ``K``) that hold a nonzero entry, ``(t, ..., K)``."""
    lib = kernels()
    hi, lo = B
    if lib is None or hi.ndim < 2:
        return None
    cut = slice_rows(lib, np.swapaxes(hi, -1, -2), None if lo is None else np.swapaxes(lo, -1, -2), t, rho,
                     stats=True, normalise=True, joined=joined, nonzero=True, **_column_cut())
    (out, (smax, ssum), rmax, e), whole, knz = cut[:4], (cut[4] if joined else None), cut[-1]
    if not (all(np.isfinite(x).all() for x in ssum) and np.isfinite(rmax).all()) or rmax.any():
        return None
    col = lambda x: np.swapaxes(x, -1, -2)                 # noqa: E731  (..., N, 1) -> (..., 1, N)
    sb = list(out)                                         # (..., K, N), C-contiguous
    return (sb + [np.broadcast_to(0.0, sb[0].shape)] * (n - t), col(e), [col(x) for x in smax]
            + [np.zeros_like(col(smax[0]))] * (n - t), [col(x) for x in ssum], col(rmax), whole, knz)


def _columns(B, n, rho):
    """``(slices, e, maxima, nonzero)`` of ``B``'s columns for a product summed on (``final=False``), by the
    compiled slicer in one pass: the ``n`` slices (``(..., K, N)`` each, C-contiguous), the exponents, each slice's
    column maxima and the lines (of ``K``) of each slice that hold a nonzero entry, the values the NumPy passes of
    :func:`matmul` give (maxima are exact in any order). None (those passes run) without the compiled kernels or
    where a slice's sum is not finite (a NaN or an infinity, which the compiled maxima skip)."""
    lib = kernels()
    hi, lo = B
    if lib is None or hi.ndim < 2:
        return None
    out, (smax, ssum), _, e, knz = slice_rows(lib, np.swapaxes(hi, -1, -2), None if lo is None else
                                              np.swapaxes(lo, -1, -2), n, rho, stats=True, normalise=True,
                                              nonzero=True, **_column_cut())
    if not all(np.isfinite(x).all() for x in ssum):
        return None
    return list(out), np.swapaxes(e, -1, -2), [np.swapaxes(x, -1, -2) for x in smax], knz


def matmul(A, B, bits=104, final=False, scale=None, spans=None, contract=None, out=None):
    """``A @ B`` as a dd ``(hi, lo)``; ``A`` ``(..., M, K)``, ``B`` ``(..., K, N)``, float64 or dd pairs.

    ``scale`` (a float): ``scale * (A @ B)``, the dd product by the float
    (:func:`.dd.dd_mul_d`) taken while the result is still scaled to the
    lines' maxima, before the powers of two are put back: the same bits as
    multiplying afterwards wherever that neither overflows nor underflows,
    and no overflow when ``A @ B`` itself is out of range but the scaled
    product is not (``scale * Q K^T`` with ``Q K^T`` near ``1e300``; the
    split of Dekker's product overflows from about ``2**996``).

    Batch dimensions broadcast as in ``np.matmul``. See the module docstring
    for the algorithm and the guarantee. ``B`` is sliced once (its columns
    in ranges side by side, written as the C-contiguous slices a GEMM reads
    fastest); ``A`` block of rows by block of rows, each block's slices,
    products and sums formed together (in cache) and the blocks run side by
    side in the package's thread pool, at least two a thread where the
    shape allows: any cut gives the same bits.

    ``final=True`` is for a result that is rounded to float64 next: a row
    whose :data:`QUICK_LEVELS` leading levels (10 products of the
    ``n (n + 1) / 2``) are, by a rigorous bound, within ``2**-55`` of every entry's own magnitude
    keeps them (its ``hi`` is then faithfully rounded); the other rows take
    every level. The choice depends on exact quantities of the row alone, so
    it is the same on every machine and in any block.

    ``spans`` (``final=False`` only): ``(start, stop)``, two int arrays with
    one entry per row of ``A``, the columns of the result wanted in that
    row (an attention mask's keys); a block of rows is formed on the union
    of its rows' columns alone, and the rest of the result is ``+0``. Each
    entry formed has the bits it has without ``spans``: its products are
    the same exact sums, on the same slices (a column's slices do not
    depend on the other columns), added in the same order. Which entries
    outside a row's own columns are formed depends on the block cuts (the
    shape and the number of threads): a caller reads only the columns
    each row wants.

    ``contract``: ``(start, stop)``, one entry per row of ``A``, the
    contraction's indices outside which that row of ``A`` is exactly zero
    (the keys a row of ``P`` allows); a block of rows is contracted over
    the union of its rows' alone. The terms left out are products with
    zero slices (a zero entry's slices are zero), so every sum, the bound
    of ``final=True`` (from the rows' and columns' statistics, which zeros
    do not change) and so every bit are those of the whole contraction.

    ``out``: a pair of C-contiguous float64 arrays of the result's shape that
    the result is written to (and returned as), so that a caller forming
    products of one shape in turn reuses one workspace; it must share no
    memory with ``A`` or ``B``.
    """
    if spans is not None and final:
        raise ValueError("`spans` is for a product that is not rounded next (final=False)")
    A, B = _as_dd(A), _as_dd(B)
    spans, contract = (_ranges(r, name, A[0].shape[-2]) for r, name in ((spans, "spans"), (contract, "contract")))
    K = A[0].shape[-1]
    shape = np.broadcast_shapes(A[0].shape[:-2], B[0].shape[:-2]) + (A[0].shape[-2], B[0].shape[-1])
    if out is not None:
        out = _out(out, shape, A, B)
    if K == 0 or 0 in shape:
        if out is not None:
            out[0].fill(0.0)
            out[1].fill(0.0)
            return out
        z = np.zeros(shape)
        return z, z.copy()
    rho, n = _rho(K), n_slices(K, bits)
    M, N = shape[-2], shape[-1]
    t = QUICK_LEVELS
    quick = final and n > t
    zero = set()                                           # B's slices that are +0 views (nothing stored)
    bj = knz = None                                        # B's first t slices side by side, where they are;
                                                           # each slice's nonzero lines, where the slicer found them
    if quick:                                              # the first t slices, their remainder, then the rest
        cut = _quick_columns(B, t, n, rho, joined=N <= _JOIN_COLUMNS and B[0].shape[:-2] == shape[:-2])
        if cut is not None:                                # compiled, with the columns' statistics
            sb, eb, mbs, sbq, rbq, bj, knz = cut
            bj = None if bj is None else bj.reshape((-1,) + bj.shape[-2:])
            zero = set(range(t, n))
        else:
            sb, rbq, eb = _normalised_slices(B, -2, t, rho)    # (cutting on from a remainder: the same slices)
            if rbq[0].any() or rbq[1].any():
                sb = sb + _slices(rbq, -2, n - t, rho)[0]
            else:                                          # (a float64 B often fits in t slices: the rest is +0,
                sb = sb + [np.broadcast_to(0.0, sb[0].shape)] * (n - t)    # as its slices would be, not stored)
                zero = set(range(t, n))
            sbq = [np.sum(np.abs(x), axis=-2, keepdims=True) for x in sb[:t]]  # exact: K entries on one grid
            rbq = _line_max(rbq[0], -2) + _line_max(rbq[1], -2)
            mbs = [_line_max(x, -2) for x in sb]
        sbq = [np.broadcast_to(x, shape[:-2] + (1, N)).reshape(-1, 1, N) for x in sbq]
        rbq = np.broadcast_to(rbq, shape[:-2] + (1, N)).reshape(-1, 1, N)
    else:
        cut = _columns(B, n, rho)
        if cut is not None:
            sb, eb, mbs, knz = cut
        else:
            sb, _, eb = _normalised_slices(B, -2, n, rho, remainder=False)
            mbs = [_line_max(x, -2) for x in sb]
    mbs = [np.broadcast_to(x, shape[:-2] + (1, N)).reshape(-1, 1, N) for x in mbs]
    cols = _nonzero(mbs)                                   # the columns each slice of B holds
    kls = [np.broadcast_to(False if q in zero else np.any(x != 0, axis=-1) if knz is None else knz[q],
                           shape[:-2] + (K,)).reshape(-1, K) for q, x in enumerate(sb)]      # and its rows
    sb = [np.broadcast_to(x, shape[:-2] + (K, N)).reshape(-1, K, N) for x in sb]
    eb = np.broadcast_to(eb, shape[:-2] + (1, N)).reshape(-1, 1, N)
    Ah, Al = (None if x is None else np.broadcast_to(x, shape[:-2] + (M, K)).reshape(-1, M, K) for x in A)
    some = spans is not None or contract is not None       # some blocks, or parts, are left +0
    if out is None:
        hi = (np.zeros if some else np.empty)((sb[0].shape[0], M, N))
        lo = (np.zeros if some else np.empty)(hi.shape)
    else:
        hi, lo = (x.reshape((sb[0].shape[0], M, N)) for x in out)   # views: C-contiguous
        if some:
            hi.fill(0.0)
            lo.fill(0.0)
    mb = max(8, _BLOCK_ENTRIES // max(N, K, 1))            # rows per block: its slices and sums stay in cache
    nb = max(1, _BLOCK_ENTRIES // max(M * N, 1)) if mb >= M else 1      # small products: several per block
    parallel = hi.size * K >= _PARALLEL_WORK
    if parallel and num_threads() > 1:                     # at least two blocks a thread where the work allows:
        want = 2 * num_threads()                           # batch entries spread first, then rows cut finer
        nb = max(1, min(nb, hi.shape[0] // want))
        if hi.shape[0] // nb * -(-M // mb) < want:
            mb = max(8, min(mb, -(-M * hi.shape[0] // want)))
    items = [(slice(b, b + nb), m0) for b in range(0, hi.shape[0], nb) for m0 in range(0, M, mb)]
    lines = {}                                             # B's lines per batch range: found once, not per product
    for b, _ in items:
        if b.start not in lines:
            lines[b.start] = (_ALL if cols is _ALL else [_Lines(x[b][:, 0, :]) for x in cols],
                              [_Lines(x[b]) for x in kls])
    lib = kernels()

    def rows_of(amax, asum):
        """A block's rows per slice (:class:`_Lines`), from its slices' maxima (which skip a NaN) and sums (which
        do not)."""
        return _ALL if not all(np.isfinite(x).all() for x in asum) else _lines_of(_nonzero(amax), -1)

    def block(item):
        b, m0 = item                                       # b: a range of batch entries
        a = (Ah[b, m0:m0 + mb], None if Al is None else Al[b, m0:m0 + mb])           # not yet normalised
        bcols, bk = lines[b.start]
        n0, n1 = 0, N
        if spans is not None:                              # the columns the block's rows want: the rest is +0
            n0, n1 = int(np.min(spans[0][m0:m0 + mb])), int(np.max(spans[1][m0:m0 + mb]))
            if n1 <= n0:
                return
            if (n0, n1) != (0, N) and bcols is not _ALL:
                bcols = [_Lines(x[b][:, 0, n0:n1]) for x in cols]
        k0, k1 = 0, K
        if contract is not None:                           # the contraction the block's rows need
            k0, k1 = int(np.min(contract[0][m0:m0 + mb])), int(np.max(contract[1][m0:m0 + mb]))
            if k1 <= k0:                                   # every term is zero: +0
                return
            if (k0, k1) != (0, K):
                bk = [_Lines(x[b][:, k0:k1]) for x in kls]
        kk = slice(k0, k1)
        if quick:
            if lib is not None:                            # normalised, sliced, with maxima and sums, compiled
                aq, (amax, asum), ra, ea = slice_rows(lib, a[0], a[1], t, rho, stats=True, normalise=True)
            else:
                aq, raq, ea = _normalised_slices(a, -1, t, rho)
                ra = _line_max(raq[0], -1) + _line_max(raq[1], -1)
                amax = [_line_max(x, -1) for x in aq]
                asum = [np.sum(np.abs(x), axis=-1, keepdims=True) for x in aq]   # exact, in any order
            h, l = _products([x[..., kk] for x in aq], [x[b][..., kk, n0:n1] for x in sb[:t]], t,
                             rows_of(amax, asum), bcols if bcols is _ALL else bcols[:t], bk[:t],
                             joined=None if bj is None or (n0, n1) != (0, N) else (bj[b][..., kk, :], t))
            redo = _redo(lib, ra, rbq[b], amax, [x[b] for x in mbs[:t]], asum, [x[b] for x in sbq], h, K)
            for i in np.flatnonzero(redo.any(axis=-1)):     # those rows take every level (rows are independent)
                r = np.flatnonzero(redo[i])
                bi = slice(b.start + i, b.start + i + 1)
                h[i, r], l[i, r] = _products([x[..., kk] for x in _normalised_slices(
                                                  (a[0][i, r], None if a[1] is None else a[1][i, r]), -1, n, rho)[0]],
                                             [x[bi][0][kk, n0:n1] for x in sb], n, None,
                                             None if cols is _ALL else [_Lines(x[bi][:, 0, n0:n1]) for x in cols],
                                             [_Lines(x[bi][:, kk]) for x in kls])
            acc = (h, l)
        else:
            if lib is not None:
                aq, (amax, asum), _, ea = slice_rows(lib, a[0], a[1], n, rho, stats=True, normalise=True)
            else:
                aq, _, ea = _normalised_slices(a, -1, n, rho)
                amax = [_line_max(x, -1) for x in aq]
                asum = amax                                # NumPy's maxima carry a NaN
            acc = _products([x[..., kk] for x in aq], [x[b][..., kk, n0:n1] for x in sb], n, rows_of(amax, asum),
                            bcols, bk, normalise=False)
        ec = eb[b][..., n0:n1]                             # (rows, 1) + (1, N): undo the scalings, exactly
        lo_e, hi_e = (int(ea.min()), int(ec.min())), (int(ea.max()), int(ec.max()))
        in_range = min(lo_e) >= -1022 and max(hi_e) <= 1023 and sum(lo_e) >= -1022 and sum(hi_e) <= 1023
        out = (hi[b, m0:m0 + mb, n0:n1], lo[b, m0:m0 + mb, n0:n1])
        if lib is not None and in_range:
            if out[0].flags.c_contiguous:
                dd_finish(lib, acc, ea, ec, out, normalise=not quick, scale=scale)   # one pass: the steps below
                return
            part = (np.empty(out[0].shape), np.empty(out[0].shape))     # some columns: finished, then copied
            dd_finish(lib, acc, ea, ec, part, normalise=not quick, scale=scale)
            out[0][...], out[1][...] = part
            return
        h, l = acc if quick else fast_two_sum(*acc)
        if scale is not None:                              # scale * (A B), before the result leaves [1/2, K)
            h, l = dd_mul_d_scalar(lib, (h, l), scale) if lib is not None else dd_mul_d((h, l), np.float64(scale))
        if in_range:
            f = pow2(ea) * pow2(ec)                        # 2**(ea + eb), exact: every exponent in range
            np.multiply(h, f, out=out[0])
            np.multiply(l, f, out=out[1])
        else:                                              # results near the ends of the range
            e = ea + ec
            out[0][...], out[1][...] = np.ldexp(h, e), np.ldexp(l, e)

    if len(items) > 1 and parallel:
        run_all(block, items)
    else:                                                  # small: the pool's hand-offs would cost more
        for it in items:
            block(it)
    return out if out is not None else (hi.reshape(shape), lo.reshape(shape))
