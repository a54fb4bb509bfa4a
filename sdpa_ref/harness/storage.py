r"""A case's dense arrays as a kernel stores them, and its results back: for ``check_implementation(layout=)``.

* ``"thd"``: packed variable-length sequences (FlashAttention's varlen API). The kernel is called as
  ``forward(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, **options)`` with
  ``q (total_q, Hq, E)``, ``k, v (total_k, Hkv, E|Ev)`` and returns ``out (total_q, Hq, Ev)`` (with ``lse=``:
  ``(out, lse)``, the LSE ``(Hq, total_q)``). The case's ``q_lengths`` and ``kv_lengths`` are the sequences'
  lengths; every array is followed by one row no sequence uses.
* ``"paged"``: a decode or prefill kernel on a paged KV cache (FlashAttention's ``flash_attn_with_kvcache``,
  vLLM). It is called as ``forward(q, k_cache, v_cache, cache_seqlens=, block_table=, **options)`` with
  ``q (B, L, Hq, E)`` and ``k_cache, v_cache (pages, PAGE_SIZE, Hkv, E|Ev)``, the pages of each sequence in a
  shuffled order plus one page no table names, and returns ``out (B, L, Hq, Ev)`` (the LSE ``(B, Hq, L)``). Every
  query row is computed: a case with ``q_lengths`` is skipped.
* ``"thd_paged"``: packed queries against the paged cache (FlashAttention 3's ``flash_attn_with_kvcache`` with
  ``cu_seqlens_q`` and ``page_table``, 2's varlen ``block_table``, FlashInfer's paged prefill). It is called as
  ``forward(q, k_cache, v_cache, cu_seqlens_q=, max_seqlen_q=, cache_seqlens=, block_table=, **options)`` with
  ``q`` packed as in ``"thd"`` and the cache as in ``"paged"``, and returns ``out (total_q, Hq, Ev)`` (the LSE
  ``(Hq, total_q)``); the case's ``q_lengths`` are the queries per sequence.

The backward gets ``grad_out`` in the kernel's layout and returns the gradients of its arrays (``dq`` packed or
``bshd``, ``dk``/``dv`` packed or of the cache's shape), which come back to the case's shapes (summed where the
case shares keys and values over its batch). The positions no sequence uses hold 0, and NaN in the poison check.
"""

from __future__ import annotations

import numpy as np

from ..transforms import unbroadcast

__all__ = ["PAGE_SIZE", "STORAGE_LAYOUTS", "Storage"]

#: The layouts a kernel may take its sequences in, beyond the dense ones.
STORAGE_LAYOUTS = ("thd", "paged", "thd_paged")
#: The page size of the ``"paged"`` layout's cache.
PAGE_SIZE = 16


class Storage:
    """One problem in a kernel's layout: ``layout`` one of :data:`STORAGE_LAYOUTS`, the case's dense ``q, k, v``
    and its options ``inp`` (their ``q_lengths``, ``kv_lengths``), positions no sequence uses filled with
    ``fill``."""

    def __init__(self, layout, q, k, v, inp, fill=0.0):
        self.layout, self.fill = layout, fill
        self.packed_q, self.paged_kv = layout in ("thd", "thd_paged"), layout in ("paged", "thd_paged")
        self.shapes = (q.shape, k.shape, v.shape)
        self.batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        B = int(np.prod(self.batch))
        L, S = q.shape[-2], k.shape[-2]
        self.ql = np.broadcast_to(inp.get("q_lengths", L), self.batch).reshape(B).astype(np.int64)
        self.kl = np.broadcast_to(inp.get("kv_lengths", S), self.batch).reshape(B).astype(np.int64)
        if layout == "paged" and inp.get("q_lengths") is not None:
            raise NotImplementedError("q_lengths: a KV-cache kernel computes every query row")
        self.L, self.S, self.B = L, S, B
        if self.paged_kv:
            pages = -(-self.kl // PAGE_SIZE)
            rng = np.random.default_rng(int(B * 1000003 + S))       # a shuffled page order, fixed by the shape
            order = rng.permutation(int(pages.sum()) + 1)           # one page more, named by no table
            self.spare, self.n_pages = int(order[-1]), len(order)
            self.table = np.full((B, max(1, int(pages.max(initial=0)))), self.spare, np.int64)
            first = np.cumsum(pages) - pages
            for b in range(B):
                self.table[b, :pages[b]] = order[first[b]:first[b] + pages[b]]
        self.options = {n: x for n, x in inp.items() if n not in ("q_lengths", "kv_lengths")}

    def _dense(self, x):
        return np.broadcast_to(x, self.batch + x.shape[-3:]).reshape((self.B,) + x.shape[-3:])

    # -- to the kernel's layout
    def _pack(self, x, lens):
        """``(B, H, n, F)`` -> ``(sum(lens) + 1, H, F)``: the sequences one after the other, then a spare row."""
        parts = [np.swapaxes(x[b, :, :lens[b]], 0, 1) for b in range(self.B)]
        spare = np.full((1,) + x.shape[1:2] + x.shape[-1:], self.fill, x.dtype)
        return np.ascontiguousarray(np.concatenate(parts + [spare], axis=0))

    def _page(self, x):
        """``(B, H, S, F)`` -> the cache ``(pages, PAGE_SIZE, H, F)``: position ``j`` of sequence ``b`` on page
        ``table[b, j // PAGE_SIZE]``, slot ``j % PAGE_SIZE``; every other slot holds ``fill``."""
        cache = np.full((self.n_pages, PAGE_SIZE, x.shape[1], x.shape[-1]), self.fill, x.dtype)
        for b in range(self.B):
            j = np.arange(self.kl[b])
            cache[self.table[b, j // PAGE_SIZE], j % PAGE_SIZE] = np.swapaxes(x[b, :, :self.kl[b]], 0, 1)
        return cache

    def query(self, q):
        q = self._dense(q)
        return self._pack(q, self.ql) if self.packed_q else np.ascontiguousarray(np.swapaxes(q, 1, 2))

    def kv(self, x):
        x = self._dense(x)
        return self._page(x) if self.paged_kv else self._pack(x, self.kl)

    def out(self, g):
        """A cotangent of the output ``(..., Hq, L, Ev)`` in the kernel's layout."""
        return self.query(g)

    def kwargs(self):
        """The layout's own keywords (FlashAttention's names)."""
        cu_q = {"cu_seqlens_q": np.r_[0, np.cumsum(self.ql)].astype(np.int32)}
        if self.layout == "thd":
            return dict(cu_q, cu_seqlens_k=np.r_[0, np.cumsum(self.kl)].astype(np.int32), max_seqlen_q=self.L,
                        max_seqlen_k=self.S)
        paged = {"cache_seqlens": self.kl.astype(np.int32), "block_table": self.table.astype(np.int32)}
        return dict(cu_q, max_seqlen_q=self.L, **paged) if self.packed_q else paged

    # -- back to the case's shapes
    def _unpack(self, y, lens, n):
        y = np.asarray(y)
        out = np.zeros((self.B, y.shape[1], n, y.shape[-1]), y.dtype)
        first = np.cumsum(lens) - lens
        for b in range(self.B):
            out[b, :, :lens[b]] = np.swapaxes(y[first[b]:first[b] + lens[b]], 0, 1)
        return out

    def _unpage(self, c):
        c = np.asarray(c)
        out = np.zeros((self.B, c.shape[2], self.S, c.shape[-1]), c.dtype)
        for b in range(self.B):
            j = np.arange(self.kl[b])
            out[b, :, :self.kl[b]] = np.swapaxes(c[self.table[b, j // PAGE_SIZE], j % PAGE_SIZE], 0, 1)
        return out

    def _shaped(self, d, which):
        """A dense full-batch array back to the case's ``which`` (0 query, 1 key, 2 value) shape (summed where
        the case broadcasts it over its batch)."""
        d = d.reshape(self.batch + d.shape[1:])
        return unbroadcast(d, self.shapes[which]) if d.shape != self.shapes[which] else d

    def from_out(self, y):
        """The kernel's output (or the output's tangent) as the case's ``(..., Hq, L, Ev)``."""
        d = self._unpack(y, self.ql, self.L) if self.packed_q else np.swapaxes(np.asarray(y), 1, 2)
        return d.reshape(self.batch + d.shape[1:])

    def from_lse(self, lse):
        """The kernel's LSE (``(Hq, total_q)`` packed, ``(B, Hq, L)`` paged) as the case's ``(..., Hq, L)``
        (``-inf`` on rows no sequence has)."""
        lse = np.asarray(lse)
        if self.packed_q:
            out = np.full((self.B, lse.shape[0], self.L), -np.inf, lse.dtype)
            first = np.cumsum(self.ql) - self.ql
            for b in range(self.B):
                out[b, :, :self.ql[b]] = lse[:, first[b]:first[b] + self.ql[b]]
            lse = out
        return lse.reshape(self.batch + lse.shape[1:])

    def from_grads(self, dq, dk, dv):
        """The kernel's ``dq``, ``dk``, ``dv`` in the case's shapes."""
        dq = self._unpack(dq, self.ql, self.L) if self.packed_q else np.swapaxes(np.asarray(dq), 1, 2)
        if self.paged_kv:
            dk, dv = self._unpage(dk), self._unpage(dv)
        else:
            dk, dv = self._unpack(dk, self.kl, self.S), self._unpack(dv, self.kl, self.S)
        return self._shaped(dq, 0), self._shaped(dk, 1), self._shaped(dv, 2)
