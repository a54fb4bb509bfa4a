r"""Sequences as kernels store them: packed variable-length batches and KV caches, contiguous or paged.

A layout maps the logical ``(batch b, head h, query row i, key j)`` of the
dense problem to where a kernel keeps it. Its forward is a *gather*: the
positions that sequences use are copied into the dense, padded problem
``(B, H, Lmax, E)`` with per-batch lengths (``q_lengths``, ``kv_lengths``),
so every engine, precision and arithmetic computes a layout as it computes a
dense problem, the non-finite-input rules and the JVP included. Results are
*scattered* back into the kernel's layout; the VJP of the gather is its
scatter-add, so a page that two sequences share (or that a table names twice)
gathers the gradient of both uses.

Memory that no sequence uses -- padding between packed sequences, slots
past ``cache_seqlens``, pages no table names, keys before a left pad -- is
never read: the gather copies only the positions in use, and the dense
problem's padding lies past the lengths, which no result reads. In the
output and the gradients such positions hold 0.

Names are FlashAttention's (``flash_attn_varlen_func``,
``flash_attn_with_kvcache``) and FlashInfer's for its CSR page lists:

* :class:`Packed` -- ``q (total_q, Hq, E)``, ``k, v (total_k, Hkv, E|Ev)``
  (``thd``), sequence ``b`` at rows ``cu_seqlens[b] .. cu_seqlens[b+1]``;
  ``seqused_q`` / ``seqused_k`` use only the first rows of each;
  ``key_leftpad`` skips the first keys (the logical key ``j`` is stored at
  ``j + key_leftpad``); ``out (total_q, Hq, Ev)``, ``lse (Hq, total_q)``.
* :class:`KVCache` -- ``q (B, Lq, Hq, E)`` (``bshd``) against a cache
  ``k_cache (B_cache, S_cache, Hkv, E)``, or a paged one
  ``(num_pages, page_size, Hkv, E)`` (``kv_layout="NHD"``; ``"HND"`` swaps
  the middle axes) addressed by ``block_table (B, max_pages)`` or by
  FlashInfer's ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``; the valid
  keys of row ``b`` are ``cache_leftpad[b] <= t < cache_seqlens[b]``, the
  logical key ``j = t - cache_leftpad[b]``, position ``t`` on page
  ``block_table[b, t // page_size]``, slot ``t % page_size``;
  ``out (B, Lq, Hq, Ev)``, ``lse (B, Hq, Lq)``. With ``cu_seqlens_q`` (and
  ``seqused_q``, ``max_seqlen_q``) the queries are packed as :class:`Packed`'s
  (FlashAttention 3's ``flash_attn_with_kvcache(cu_seqlens_q=, page_table=)``,
  2's ``flash_attn_varlen_func(block_table=)``, FlashInfer's ``qo_indptr``
  with its page lists): ``q (total_q, Hq, E)``, ``out (total_q, Hq, Ev)``,
  ``lse (Hq, total_q)``, ``B = len(cu_seqlens_q) - 1``.

The causal and window diagonal is per sequence: ``off = kv_len - q_len``
under ``causal_alignment="bottom_right"``, FlashAttention's, which
:func:`varlen_attention` and :func:`kvcache_attention` use by default.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from . import _validate as V
from ._threads import num_threads, run_all

__all__ = ["Gathered", "KVCache", "Packed", "paged_key_lengths"]


def _ints(x, name, ndim=1):
    """An integer array of ``ndim`` dims as int64, or a clear error."""
    arr = V.as_array(x, name, "an integer array")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"`{name}` should be an integer array, but got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"`{name}` should have {ndim} dimension(s), but got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:   # would wrap (Python ints:
        # numpy 1.23 compared uint64 with int64 in float64, where 2**63 equals 2**63 - 1)
        raise ValueError(f"`{name}` should hold values below 2**63, but got {int(arr.max())}")
    return arr.astype(np.int64)


def _per_batch(x, name, B, default):
    """``x`` as ``(B,)`` int64 (an int broadcasts), ``default`` when None."""
    if x is None:
        return default
    if isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return np.full(B, int(x), np.int64)
    arr = _ints(x, name)
    if arr.shape != (B,):
        raise ValueError(f"`{name}` should have shape ({B},) (one per sequence), but got shape {arr.shape}")
    return arr


def _storage(x, name, ndim):
    a = V.as_float_array(x, name)
    if a.ndim != ndim:
        raise ValueError(f"`{name}` should have {ndim} dimensions, but got shape {a.shape}")
    return a


class _Map:
    """Where each logical position lives: ``(rows, where)`` with ``rows`` the ``(b, i)`` of the positions in use
    (int64 arrays of one length) and ``where`` their index into the storage's flattened leading axes; the dense
    length ``n`` and the per-batch lengths."""

    def __init__(self, b, i, where, n, lengths):
        self.b, self.i, self.where, self.n, self.lengths = b, i, where, n, lengths

    def gather(self, x):
        """Storage ``x`` (its leading axes flattened to the positions, then ``(H, F)``) into ``(B, H, n, F)``.

        The result is a view of a ``(B, n, H, F)`` array (each position's ``H x F`` block copied whole, the
        storage's own order; a paged cache's pages are runs of such blocks): the products read it with strides
        and give what they give on a contiguous copy, and the gather is one pass over the positions in use
        instead of a transposing scatter (a decode against 32k keys spent most of its time there)."""
        B = len(self.lengths)
        full = len(self.where) == B * self.n                    # every (b, i) in use once, in (b, i) order
        rows = take_rows(x, self.where)                         # (m, H, F): only the positions in use are read
        if full:
            out = rows.reshape((B, self.n) + rows.shape[1:])
        else:
            out = np.zeros((B, self.n) + rows.shape[1:], x.dtype)
            out[self.b, self.i] = rows
        return np.swapaxes(out, 1, 2)

    def scatter(self, d, shape, add=False):
        """The VJP of :meth:`gather`: dense ``d (B, H, n, F)`` into zeros of the storage ``shape`` (flattened
        leading axes), summed where a storage position is used twice."""
        out = np.zeros(shape, d.dtype)
        vals = d[self.b, :, self.i]                             # (m, H, F)
        if add and len(np.unique(self.where)) != len(self.where):
            np.add.at(out, self.where, vals)                    # in index order: the same bits every time
        else:
            out[self.where] = vals
        return out


#: Bytes from which :func:`take_rows` copies runs of consecutive positions (a paged cache's pages) as slices in
#: the pool rather than by one fancy index. A decode, 32/8 heads of 128, pages of 256, 2 threads, 15 rounds, the
#: call with runs against the fancy index: 4 MiB a tensor (1024 keys, float32) 5.68 / 5.05 ms, 8 MiB 7.51 /
#: 7.81, 16 MiB 8.58 / 9.81, 64 MiB 19.9 / 23.4.
RUNS_BYTES = 1 << 23


def take_rows(x, where):
    """``x[where]`` for the flat positions ``where`` (``x``'s leading axis): where they come in runs of consecutive
    positions (a paged cache's pages, long sequences) and the copy is large (:data:`RUNS_BYTES`), each run copied
    as one slice, the runs shared among the pool's threads; otherwise one fancy index. A copy either way: the same
    values. One query token against 32k keys of 8 heads of 128 (pages of 256 in random order, 268 MB a tensor,
    2 threads): 42 ms by the fancy index, 25 ms by runs in the pool."""
    m = len(where)
    if not isinstance(x, np.ndarray) or m < 2 or m * x[:1].nbytes < RUNS_BYTES or num_threads() == 1:
        return x[where]
    cut = np.flatnonzero(np.diff(where) != 1) + 1          # where a run ends
    if len(cut) + 1 > m // 16:                             # short runs: the fancy index
        return x[where]
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [m]])
    out = np.empty((m,) + x.shape[1:], x.dtype)
    parts = np.array_split(np.arange(len(starts)), num_threads())

    def copy(part):
        for r in part:
            a, b = int(starts[r]), int(ends[r])
            src = int(where[a])
            out[a:b] = x[src:src + b - a]
    run_all(copy, [p for p in parts if len(p)])
    return out


def _ranges(starts, lengths):
    """``(b, i, start_b + i)`` for ``i < lengths[b]``, as flat int64 arrays."""
    b = np.repeat(np.arange(len(lengths)), lengths)
    first = np.cumsum(lengths) - lengths
    i = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(first, lengths)
    return b, i, np.repeat(starts, lengths) + i


@dataclass(frozen=True)
class Packed:
    """Packed variable-length sequences (FlashAttention's varlen API); see the module docstring."""

    cu_seqlens_q: Any
    cu_seqlens_k: Any
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    seqused_q: Any = None
    seqused_k: Any = None
    key_leftpad: Any = None

    def maps(self, q, k):
        """``(query map, key map)`` for storage ``q (total_q, Hq, E)`` and ``k (total_k, Hkv, E)``."""
        cq, ck = _ints(self.cu_seqlens_q, "cu_seqlens_q"), _ints(self.cu_seqlens_k, "cu_seqlens_k")
        if len(cq) < 1 or len(cq) != len(ck):
            raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_k` should have the same length B + 1 >= 1, but got "
                             f"{len(cq)} and {len(ck)}")
        B = len(cq) - 1
        qmap = _packed_rows(cq, "cu_seqlens_q", q.shape[0], self.seqused_q, "seqused_q", self.max_seqlen_q,
                            "max_seqlen_q")
        starts, span = _offsets(ck, "cu_seqlens_k", k.shape[0])
        used_k = _within(self.seqused_k, "seqused_k", span)
        pad = _per_batch(self.key_leftpad, "key_leftpad", B, np.zeros(B, np.int64))
        if np.any(pad < 0) or np.any(pad > used_k):
            raise ValueError(f"`key_leftpad` should be within each sequence's used keys [0, {used_k.tolist()}], but "
                             f"got {pad.tolist()}")
        lk = used_k - pad
        return qmap, _Map(*_ranges(starts + pad, lk), _max(self.max_seqlen_k, "max_seqlen_k", lk), lk)

    def queries(self, q, name="query"):
        return _storage(q, name, 3), 1

    def keys(self, x, name):
        return _storage(x, name, 3), 1

    def out_shape(self, q_shape, Ev):
        return tuple(q_shape[:2]) + (Ev,)

    def lse_from(self, qmap, lse, total, fill=-np.inf):
        """The LSE in FlashAttention's varlen layout ``(Hq, total_q)`` (``fill`` on unused rows); trailing dims
        are kept (a split-KV output accumulator, ``(Hq, total_q, Ev)``)."""
        return _packed_lse(qmap, lse, total, fill)

    def lse_to(self, qmap, g, B, Hq):
        """The inverse of :meth:`lse_from` on a cotangent ``(Hq, total_q)``: ``(B, Hq, Lmax)``."""
        return _packed_lse_to(qmap, g, B, Hq)


def _offsets(cu, name, total):
    """``(starts, spans)`` of FlashAttention's ``cu_seqlens`` offsets into the ``total`` rows of an array."""
    d = np.diff(cu)
    if cu.size and (cu[0] < 0 or np.any(d < 0) or cu[-1] > total):
        raise ValueError(f"`{name}` should be non-decreasing offsets from >= 0 to at most the {total} rows "
                         f"of its array, but got {cu.tolist()}")
    return cu[:-1], d


def _within(used, name, span):
    """``seqused`` as ``(B,)`` int64 within each sequence's ``span`` (the whole span when None)."""
    used = _per_batch(used, name, len(span), span)
    if np.any(used < 0) or np.any(used > span):
        raise ValueError(f"`{name}` should be within each sequence's rows [0, {span.tolist()}], but got "
                         f"{used.tolist()}")
    return used


def _packed_rows(cu, name, total, used, used_name, bound, bound_name):
    """The map of packed rows: sequence ``b`` at rows ``cu[b] + i``, ``i < used[b]`` (``cu``'s span by default),
    of an array of ``total`` rows; ``bound`` is FlashAttention's ``max_seqlen``."""
    starts, span = _offsets(cu, name, total)
    lengths = _within(used, used_name, span)
    return _Map(*_ranges(starts, lengths), _max(bound, bound_name, lengths), lengths)


def paged_key_lengths(cu_seqlens_q, cu_seqlens_k, seqused_k=None):
    """The keys per sequence of packed queries against a page table, as FlashAttention's varlen API gives them:
    ``seqused_k`` (FlashAttention 3's, the ``cache_seqlens`` of :class:`KVCache`) when given, else the
    differences of ``cu_seqlens_k`` (FlashAttention 2's ``flash_attn_varlen_func(block_table=)``, whose offsets
    address no rows: the keys are on the pages), capped by ``seqused_k`` when both are given.

    Parameters
    ----------
    cu_seqlens_q : array_like of int, (B + 1,)
        Only its length is read.
    cu_seqlens_k : array_like of int, (B + 1,), or None
        Non-decreasing offsets from >= 0; None with ``seqused_k``.
    seqused_k : array_like of int, (B,), optional

    Returns
    -------
    ndarray of int64, (B,)
    """
    B = len(_ints(cu_seqlens_q, "cu_seqlens_q")) - 1
    if cu_seqlens_k is None:
        if seqused_k is None:
            raise ValueError("`cu_seqlens_k` or `seqused_k` should be given with a page table (the keys per "
                             "sequence), but got neither")
        return _per_batch(seqused_k, "seqused_k", B, None)
    ck = _ints(cu_seqlens_k, "cu_seqlens_k")
    if len(ck) != B + 1:
        raise ValueError(f"`cu_seqlens_q` and `cu_seqlens_k` should have the same length B + 1 >= 1, but got "
                         f"{B + 1} and {len(ck)}")
    if ck.size and (ck[0] < 0 or np.any(np.diff(ck) < 0)):
        raise ValueError(f"`cu_seqlens_k` should be non-decreasing offsets from >= 0, but got {ck.tolist()}")
    return _within(seqused_k, "seqused_k", np.diff(ck))


def _packed_lse(qmap, lse, total, fill):
    """A dense per-row ``(B, Hq, Lmax, ...)`` as FlashAttention's varlen ``(Hq, total_q, ...)``."""
    out = np.full((lse.shape[1], total) + lse.shape[3:], fill, lse.dtype)
    out[:, qmap.where] = np.moveaxis(lse[qmap.b, :, qmap.i], 0, 1)
    return out


def _packed_lse_to(qmap, g, B, Hq):
    out = np.zeros((B, Hq, qmap.n), g.dtype)
    out[qmap.b, :, qmap.i] = g[:, qmap.where].T
    return out


@dataclass(frozen=True)
class KVCache:
    """Queries against a KV cache, contiguous or paged (FlashAttention's ``flash_attn_with_kvcache``, FlashInfer's
    CSR page lists), the queries ``bshd`` or packed (``cu_seqlens_q``); see the module docstring."""

    cache_seqlens: Any = None
    cache_batch_idx: Any = None
    cache_leftpad: Any = None
    block_table: Any = None
    kv_indptr: Any = None
    kv_indices: Any = None
    kv_last_page_len: Any = None
    kv_layout: str = "NHD"
    max_seqlen_k: Optional[int] = None
    cu_seqlens_q: Any = None
    seqused_q: Any = None
    max_seqlen_q: Optional[int] = None

    def maps(self, q, k):
        """``(query map, key map)`` for ``q (B, Lq, Hq, E)`` (with ``cu_seqlens_q``: ``(total_q, Hq, E)``) and the
        cache ``k`` (NHD order: see :meth:`keys`)."""
        V.check_choice(self.kv_layout, "kv_layout", ("NHD", "HND"))
        qmap = self._queries(q)
        B = len(qmap.lengths)
        csr = [x is not None for x in (self.kv_indptr, self.kv_indices, self.kv_last_page_len)]
        paged = self.block_table is not None or any(csr)
        if any(csr) and not all(csr):
            raise ValueError("`kv_indptr`, `kv_indices` and `kv_last_page_len` should be given together (FlashInfer's "
                             "page lists), but got only some of them")
        if self.block_table is not None and any(csr):
            raise ValueError("`block_table` and `kv_indptr`/`kv_indices` should not both be given: they are two "
                             "spellings of the page table")
        P, cap = k.shape[1], k.shape[1]                       # NHD order: (pages or rows, page_size or S, Hkv, E)
        rows = _per_batch(self.cache_batch_idx, "cache_batch_idx", B, np.arange(B, dtype=np.int64))
        if paged:                                             # FlashAttention 3: page_table[cache_batch_idx[b]]
            table, seqlens = self._table(B, P, rows)
            cap = table.shape[1] * P
        else:
            if np.any(rows < 0) or np.any(rows >= k.shape[0]):
                raise ValueError(f"`cache_batch_idx` should name rows of the cache [0, {k.shape[0]}), but got "
                                 f"{rows.tolist()}")
            seqlens = None
        seqlens = _per_batch(self.cache_seqlens, "cache_seqlens", B, seqlens if seqlens is not None
                             else np.full(B, cap, np.int64))
        pad = _per_batch(self.cache_leftpad, "cache_leftpad", B, np.zeros(B, np.int64))
        if np.any(seqlens < 0) or np.any(seqlens > cap):
            raise ValueError(f"`cache_seqlens` should be within the cache's {cap} positions per sequence, but got "
                             f"{seqlens.tolist()}")
        if np.any(pad < 0) or np.any(pad > seqlens):
            raise ValueError(f"`cache_leftpad` should be within [0, cache_seqlens], but got {pad.tolist()}")
        lk = seqlens - pad
        b, j, t = _ranges(pad, lk)                              # t: the position in the sequence's cache
        where = table[b, t // P] * P + t % P if paged else rows[b] * P + t
        if paged and np.any((table[b, t // P] < 0) | (table[b, t // P] >= k.shape[0])):
            bad = table[b, t // P][(table[b, t // P] < 0) | (table[b, t // P] >= k.shape[0])][0]
            raise ValueError(f"`block_table` / `kv_indices` should name pages of the cache [0, {k.shape[0]}) for "
                             f"every position in use, but got page {bad}")
        return qmap, _Map(b, j, where, _max(self.max_seqlen_k, "max_seqlen_k", lk), lk)

    def _queries(self, q):
        """The query map: ``bshd`` rows, or with ``cu_seqlens_q`` packed rows as :class:`Packed`'s."""
        if self.cu_seqlens_q is None:
            for name in ("seqused_q", "max_seqlen_q"):
                if getattr(self, name) is not None:
                    raise ValueError(f"`{name}` should be given only with `cu_seqlens_q` (packed queries), but got "
                                     f"{name} without it")
            B, Lq = q.shape[0], q.shape[1]
            return _Map(*_ranges(np.arange(B, dtype=np.int64) * Lq, np.full(B, Lq, np.int64)), Lq,
                        np.full(B, Lq, np.int64))
        cq = _ints(self.cu_seqlens_q, "cu_seqlens_q")
        if len(cq) < 1:
            raise ValueError("`cu_seqlens_q` should have length B + 1 >= 1, but got length 0")
        return _packed_rows(cq, "cu_seqlens_q", q.shape[0], self.seqused_q, "seqused_q", self.max_seqlen_q,
                            "max_seqlen_q")

    def _table(self, B, P, rows):
        """``(block table (B, pages), cache_seqlens or None)`` from ``block_table`` or FlashInfer's CSR lists.

        With ``cache_batch_idx`` (``rows``), sequence ``b`` reads the table's row ``rows[b]``, as FlashAttention
        3 reads ``page_table[cache_batch_idx[b]]`` (its ``cache_seqlens`` and ``cache_leftpad`` stay indexed by
        ``b``); the table then has any number of rows."""
        if self.block_table is not None:
            t = _ints(self.block_table, "block_table", 2)
            if self.cache_batch_idx is None:
                if t.shape[0] != B:
                    raise ValueError(f"`block_table` should have one row per sequence, ({B}, max_pages), but got "
                                     f"shape {t.shape}")
                return t, None
            if np.any(rows < 0) or np.any(rows >= t.shape[0]):
                raise ValueError(f"`cache_batch_idx` should name rows of `block_table` [0, {t.shape[0]}), but got "
                                 f"{rows.tolist()}")
            return t[rows], None
        if self.cache_batch_idx is not None:
            raise ValueError("`cache_batch_idx` should not be given with FlashInfer's page lists (`kv_indptr` lists "
                             "each sequence's own pages: reorder them instead), but got both")
        if self.cache_seqlens is not None:
            raise ValueError("`cache_seqlens` should not be given with FlashInfer's page lists (kv_last_page_len says "
                             "where each sequence ends)")
        ptr, idx = _ints(self.kv_indptr, "kv_indptr"), _ints(self.kv_indices, "kv_indices")
        last = _per_batch(self.kv_last_page_len, "kv_last_page_len", B, None)
        if len(ptr) != B + 1 or ptr[0] != 0 or np.any(np.diff(ptr) < 0) or ptr[-1] > len(idx):
            raise ValueError(f"`kv_indptr` should be B + 1 = {B + 1} non-decreasing offsets from 0 into `kv_indices`, "
                             f"but got {ptr.tolist()}")
        n = np.diff(ptr)
        if np.any((last < 0) | (last > P) | ((n > 0) & (last < 1)) | ((n == 0) & (last != 0))):
            raise ValueError(f"`kv_last_page_len` should be in [1, {P}] (0 for a sequence without pages), but got "
                             f"{last.tolist()}")
        table = np.zeros((B, max(1, int(n.max(initial=0)))), np.int64)
        for b in range(B):                                      # B rows, not positions: a short loop
            table[b, :n[b]] = idx[ptr[b]:ptr[b + 1]]
        return table, np.where(n > 0, (n - 1) * P + last, 0)

    def queries(self, q, name="query"):
        if self.cu_seqlens_q is not None:
            return _storage(q, name, 3), 1
        q = _storage(q, name, 4)
        return q.reshape((-1,) + q.shape[2:]), 1

    def keys(self, x, name):
        """The cache as ``(positions, Hkv, F)``: its two leading axes flattened (NHD; HND moved first)."""
        x = _storage(x, name, 4)
        if self.kv_layout == "HND":
            x = np.swapaxes(x, 1, 2)
        return x.reshape((-1,) + x.shape[2:]) if x.flags.c_contiguous else _Flat(x), 1

    def out_shape(self, q_shape, Ev):
        return tuple(q_shape[:2 if self.cu_seqlens_q is not None else 3]) + (Ev,)

    def lse_from(self, qmap, lse, total, fill=-np.inf):
        """The LSE as ``(B, Hq, Lq)``, or with ``cu_seqlens_q`` FlashAttention's varlen ``(Hq, total_q)``."""
        return lse if self.cu_seqlens_q is None else _packed_lse(qmap, lse, total, fill)

    def lse_to(self, qmap, g, B, Hq):
        return g if self.cu_seqlens_q is None else _packed_lse_to(qmap, g, B, Hq)


class _Flat:
    """A ``(N, P, H, F)`` array read as ``(N * P, H, F)`` without a copy of the whole cache (an HND cache seen as
    NHD is not contiguous): indexing by flat positions reads only those."""

    def __init__(self, x):
        self.x, self.shape = x, (x.shape[0] * x.shape[1],) + x.shape[2:]
        self.dtype = x.dtype

    def __getitem__(self, where):
        return self.x[where // self.x.shape[1], where % self.x.shape[1]]


def _max(given, name, lengths):
    """The dense length: the longest of ``lengths``. ``given`` (FlashAttention's ``max_seqlen_*``) is only a bound
    on them, checked: below the longest length it is an error, above it costs nothing (the padded length is
    never the bound, so a generous bound allocates nothing)."""
    top = int(lengths.max(initial=0))
    if given is None:
        return top
    if isinstance(given, (bool, np.bool_)) or not isinstance(given, (numbers.Integral, np.integer)):
        raise TypeError(f"`{name}` should be an int >= the longest sequence ({top}) or None, but got "
                        f"{V.describe(given)}")
    if given < top:
        raise ValueError(f"`{name}` should be an int >= the longest sequence ({top}), but got {given!r}")
    return top


class Gathered:
    """One problem gathered from a layout: the dense arrays and lengths for :class:`~sdpa_ref.problem.Problem`, and
    the maps that take each result back (the forward's scatter, the VJP's scatter-add, the JVP's gather).

    ``q, k, v``: ``(B, Hq|Hkv, Lmax|Smax, E|Ev)``; ``lengths``: the ``q_lengths`` / ``kv_lengths`` options.
    """

    def __init__(self, layout, query, key, value):
        if not isinstance(layout, (Packed, KVCache)):
            raise TypeError(f"`layout` should be a sdpa_ref.layouts.Packed or KVCache, but got {V.describe(layout)}")
        self.layout = layout
        qs, _ = layout.queries(query)
        ks, _ = layout.keys(key, "key")
        vs, _ = layout.keys(value, "value")
        if ks.shape[:2] != vs.shape[:2]:
            raise ValueError(f"`value` should have the positions and heads of `key` {np.shape(key)}, but got shape "
                             f"{np.shape(value)}")
        if qs.shape[-1] != ks.shape[-1]:
            raise ValueError(f"`key` should have the last dim E={qs.shape[-1]} of `query`, but got shape "
                             f"{np.shape(key)}")
        self.shapes = {"query": np.shape(query), "key": np.shape(key), "value": np.shape(value)}
        self.qmap, self.kmap = layout.maps(np.asarray(query), _nhd(layout, key))
        self.q, self.k, self.v = self.qmap.gather(qs), self.kmap.gather(ks), self.kmap.gather(vs)
        self.lengths = {"q_lengths": self.qmap.lengths, "kv_lengths": self.kmap.lengths}
        self._flat = {"query": qs.shape, "key": ks.shape, "value": vs.shape}
        self.out_shape = layout.out_shape(self.shapes["query"], vs.shape[-1])
        self.lse_shape = self.lse(np.zeros((len(self.qmap.lengths), qs.shape[1], self.qmap.n))).shape

    # -- the forward's results
    def out(self, o):
        """The dense output ``(B, Hq, Lmax, Ev)`` in the layout's (unused rows 0)."""
        flat = self.qmap.scatter(o, (self._flat["query"][0], o.shape[1], o.shape[-1]))
        return flat.reshape(self.layout.out_shape(self.shapes["query"], o.shape[-1]))

    def lse(self, lse, fill=-np.inf):
        """A dense per-row quantity ``(B, Hq, Lmax)`` in the layout's LSE layout (``fill`` on rows no sequence
        uses: ``-inf`` for the LSE and the row max, 0 for the row sum)."""
        return self.layout.lse_from(self.qmap, lse, self._flat["query"][0], fill)

    # -- the derivatives
    def gather_out(self, g):
        """A cotangent or tangent of the output, in the layout's, as the dense ``(B, Hq, Lmax, Ev)``."""
        g = np.asarray(g)
        return self.qmap.gather(g.reshape((self._flat["query"][0],) + g.shape[-2:]))

    def gather_lse(self, g):
        B, Hq = len(self.qmap.lengths), self._flat["query"][1]
        return self.layout.lse_to(self.qmap, np.asarray(g), B, Hq)

    def gather_qv(self, qv):
        """MLA's ``qv`` (stored as the queries are, its own width) as its dense array; its shape is kept for the
        scatter of its gradient."""
        flat, _ = self.layout.queries(qv, "qv")
        if flat.shape[:2] != self._flat["query"][:2]:
            raise ValueError(f"`qv` should have the rows and heads of `query` {self.shapes['query']}, but got shape "
                             f"{np.shape(qv)}")
        self.shapes["qv"], self._flat["qv"] = np.shape(qv), flat.shape
        return self.qmap.gather(flat)

    def gather_input(self, t, name):
        """A tangent of ``query``, ``key`` or ``value`` (in its input's shape) as its dense array."""
        query_like = name in ("query", "qv")
        flat = (self.layout.queries(t)[0] if query_like else self.layout.keys(t, name)[0])
        return (self.qmap if query_like else self.kmap).gather(flat)

    def scatter_input(self, d, name):
        """The VJP of the gather: a dense gradient of ``query``, ``key`` or ``value`` in its input's shape (a storage
        position that two sequences use, or a table names twice, gets the sum)."""
        query_like = name in ("query", "qv")
        m = self.qmap if query_like else self.kmap
        flat = m.scatter(d, self._flat[name], add=not query_like)
        if not query_like and isinstance(self.layout, KVCache):
            shape = self.shapes[name]
            nhd = (shape[0], shape[2], shape[1], shape[3]) if self.layout.kv_layout == "HND" else shape
            flat = flat.reshape(nhd)
            return np.ascontiguousarray(np.swapaxes(flat, 1, 2)) if self.layout.kv_layout == "HND" else flat
        return flat.reshape(self.shapes[name])


def _nhd(layout, key):
    """The cache in NHD order, as a view (for its sizes only)."""
    x = np.asarray(key)
    return np.swapaxes(x, 1, 2) if getattr(layout, "kv_layout", "NHD") == "HND" else x
