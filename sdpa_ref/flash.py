r"""FlashAttention's varlen and KV-cache entry points, computed by the reference.

The same arguments as FlashAttention 3's ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache`` (FlashAttention 2's ``block_table`` and 3's
``page_table`` alike), so that a call to a kernel can be repeated against the
reference word for word. They run :func:`sdpa_ref.scaled_dot_product_attention`
on a layout (:mod:`sdpa_ref.layouts`) with FlashAttention's conventions:
the causal and window diagonal per sequence at the bottom right, grouped-query
attention whenever ``Hkv < Hq``, a row with no key giving 0. Any option of
the package can be added by keyword (``sinks=``, ``gather_kv_indices=``,
``precision="reproducible"``, ...). For gradients, call
:func:`sdpa_ref.sdpa_forward` with the same ``layout=`` and
:func:`sdpa_ref.sdpa_backward`.

Shapes: ``q (total_q, Hq, E)``, ``k, v (total_k, Hkv, E|Ev)`` packed; ``q
(B, Lq, Hq, E)`` against ``k_cache, v_cache (B_cache, S_cache, Hkv, E|Ev)``
or, paged, ``(num_pages, page_size, Hkv, E|Ev)``; packed queries against a
paged cache in either (``block_table=`` / ``page_table=`` in
``flash_attn_varlen_func``, ``cu_seqlens_q=`` in ``flash_attn_with_kvcache``).
"""

from __future__ import annotations

import numpy as np

from . import _validate as V
from .api import scaled_dot_product_attention
from .layouts import KVCache, Packed, paged_key_lengths
from .options import check_bool, check_scale, check_softcap, check_window, count_window, fa4_window

__all__ = ["flash_attn_varlen_func", "flash_attn_with_kvcache", "window_from_window_size", "window_from_fa4",
           "window_from_count"]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                           attention_chunk=0, softcap=0.0, alibi_slopes=None, *, qv=None, key_leftpad=None,
                           block_table=None, page_table=None, return_lse=False, window_size_left=None,
                           window_size_right=None, **options):
    r"""Attention over packed variable-length sequences, as FlashAttention's ``flash_attn_varlen_func``; with
    ``block_table`` (FlashAttention 2's) or ``page_table`` (3's), the packed queries read a paged KV cache.

    Parameters
    ----------
    q, k, v : array_like, (total_q, Hq, E), (total_k, Hkv, E), (total_k, Hkv, Ev)
        With a page table, ``k, v`` are the cache ``(num_pages, page_size, Hkv, E|Ev)``.
    cu_seqlens_q, cu_seqlens_k : array_like of int, (B + 1,)
        Sequence ``b``'s rows are ``cu_seqlens[b] .. cu_seqlens[b + 1]``. With a page table, sequence ``b`` has
        ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` keys (FlashAttention 2), logical key ``t`` on page
        ``block_table[b, t // page_size]``, slot ``t % page_size``; ``cu_seqlens_k`` may then be None with
        ``seqused_k``.
    max_seqlen_q, max_seqlen_k : int, optional
        FlashAttention's bound on the sequences' lengths: checked (below the longest sequence is a
        `ValueError`), never used as a padded length, so a generous bound costs nothing.
    seqused_q, seqused_k : array_like of int, (B,), optional
        Only the first rows of each sequence are used (with a page table, ``seqused_k`` is the keys per sequence,
        FlashAttention 3's ``cache_seqlens``).
    softmax_scale, causal, window_size, attention_chunk, softcap, alibi_slopes
        FlashAttention's: ``window_size`` ``-1`` unbounded, ``softcap`` 0 off.
    qv : array_like, (total_q, Hq, Ev), optional
        MLA's absorbed query: scores ``scale (q k^T + qv v^T)``, default scale ``1/sqrt(E + Ev)``.
    key_leftpad : array_like of int, (B,), optional
        The first keys of each sequence are padding (FlashAttention 2's ``leftpad_k``; with a page table, the
        cache positions ``t < key_leftpad[b]``, as ``cache_leftpad``).
    block_table, page_table : array_like of int, (B, max_pages), optional
        The pages of each sequence (FlashAttention 2's name, and 3's): :class:`~sdpa_ref.layouts.KVCache` with
        ``cu_seqlens_q``. The gradients of ``k`` and ``v`` are in the cache's shape, summed where pages repeat.
    return_lse : bool, optional
        Also return the LSE, ``(Hq, total_q)``.
    window_size_left, window_size_right : int or None, optional
        FlashAttention 4's signed window (its ``window_size=(left, right)``, whose ``-1`` is a real bound where
        FlashAttention 2 and 3's is unbounded, hence its own keywords here): None unbounded, a negative bound past
        the diagonal on the other side; translated by :func:`window_from_fa4` with ``causal``. One spelling of the
        window only: with ``window_size`` (other than ``(-1, -1)``), ``window=`` or ``sliding_window=`` holding a
        window too it is a `ValueError` naming both.
    **options
        Any option of :func:`sdpa_ref.sdpa_forward`.

    Returns
    -------
    out : ndarray, (total_q, Hq, Ev)
    lse : ndarray, (Hq, total_q), with ``return_lse``
    """
    table = _one_table(block_table, page_table)
    if table is None:
        _storage({"q": q, "k": k, "v": v}, 3)
        lay = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, key_leftpad)
    else:
        _storage({"q": q}, 3)
        _storage({"k": k, "v": v}, 4)
        lay = KVCache(paged_key_lengths(cu_seqlens_q, cu_seqlens_k, seqused_k), cache_leftpad=key_leftpad,
                      block_table=table, max_seqlen_k=max_seqlen_k, cu_seqlens_q=cu_seqlens_q, seqused_q=seqused_q,
                      max_seqlen_q=max_seqlen_q)
    window = (window_size, window_size_left, window_size_right)
    return _call(q, k, lay, v, softmax_scale, causal, window, attention_chunk, softcap, alibi_slopes,
                 check_bool(return_lse, "return_lse"), dict(options, qv=qv))


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                            attention_chunk=0, softcap=0.0, alibi_slopes=None, *, qv=None, page_table=None,
                            cu_seqlens_q=None, max_seqlen_q=None, kv_indptr=None, kv_indices=None,
                            kv_last_page_len=None, kv_layout="NHD", num_splits=0, return_softmax_lse=False,
                            window_size_left=None, window_size_right=None, **options):
    r"""Queries against a KV cache, contiguous or paged, as FlashAttention's ``flash_attn_with_kvcache`` (without
    its in-place cache update and rotary embedding); with ``cu_seqlens_q``, packed queries (FlashAttention 3's
    prefill against a cache).

    Parameters
    ----------
    q : array_like, (B, Lq, Hq, E), or (total_q, Hq, E) with ``cu_seqlens_q``
    k_cache, v_cache : array_like
        ``(B_cache, S_cache, Hkv, E|Ev)``, or paged ``(num_pages, page_size, Hkv, E|Ev)`` (``kv_layout="HND"``:
        ``(num_pages, Hkv, page_size, E|Ev)``).
    cache_seqlens : int or array_like of int, (B,), optional
        The cache's used positions per sequence (every one by default).
    cache_batch_idx : array_like of int, (B,), optional
        The cache row of each sequence; paged, the row of ``block_table`` each sequence reads (FlashAttention
        3's ``page_table[cache_batch_idx[b]]``; ``cache_seqlens`` and ``cache_leftpad`` stay indexed by ``b``).
    cache_leftpad : array_like of int, (B,), optional
        The position each sequence's keys start at.
    block_table, page_table : array_like of int, (B, max_pages), optional
        The pages of each sequence (FlashAttention 2's name, and 3's); any page size, a page may repeat.
    cu_seqlens_q : array_like of int, (B + 1,), optional
        Packed queries (FlashAttention 3's): sequence ``b``'s rows of ``q`` are ``cu_seqlens_q[b] ..
        cu_seqlens_q[b + 1]``; ``out`` is then ``(total_q, Hq, Ev)`` and the LSE ``(Hq, total_q)``.
    max_seqlen_q : int, optional
        FlashAttention 3's bound on the queries per sequence, checked as in :func:`flash_attn_varlen_func`.
    kv_indptr, kv_indices, kv_last_page_len : array_like of int, optional
        The same pages as FlashInfer's CSR lists (with ``cu_seqlens_q``, its ``qo_indptr``:
        ``BatchPrefillWithPagedKVCacheWrapper``).
    softmax_scale, causal, window_size, attention_chunk, softcap, alibi_slopes
        FlashAttention's.
    qv : array_like, (B, Lq, Hq, Ev), optional
        MLA's absorbed query, as in :func:`flash_attn_varlen_func`.
    num_splits : int, optional
        FlashAttention's: ``0`` (its heuristic) and ``1`` compute the keys unsplit; ``n > 1`` computes ``n``
        splits of each sequence's keys merged by their LSEs (``method="split"``), which equals the unsplit result
        to rounding. :func:`sdpa_ref.split_kv_partials` gives the splits themselves.
    return_softmax_lse : bool, optional
        Also return the LSE, ``(B, Hq, Lq)``.
    window_size_left, window_size_right : int or None, optional
        FlashAttention 4's signed window, as in :func:`flash_attn_varlen_func`.
    **options
        Any option of :func:`sdpa_ref.sdpa_forward`.

    Returns
    -------
    out : ndarray, (B, Lq, Hq, Ev), or (total_q, Hq, Ev) with ``cu_seqlens_q``
    lse : ndarray, (B, Hq, Lq), or (Hq, total_q) with ``cu_seqlens_q``; with ``return_softmax_lse``
    """
    _storage({"q": q}, 4 if cu_seqlens_q is None else 3)
    _storage({"k_cache": k_cache, "v_cache": v_cache}, 4)
    lay = KVCache(cache_seqlens, cache_batch_idx, cache_leftpad, _one_table(block_table, page_table),
                  kv_indptr, kv_indices, kv_last_page_len, kv_layout, cu_seqlens_q=cu_seqlens_q,
                  max_seqlen_q=max_seqlen_q)
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)) or num_splits < 0:
        raise ValueError(f"`num_splits` should be an int >= 0 (0: FlashAttention's heuristic), but got {num_splits!r}")
    if num_splits > 1:
        options = dict(options, num_splits=int(num_splits))
    window = (window_size, window_size_left, window_size_right)
    return _call(q, k_cache, lay, v_cache, softmax_scale, causal, window, attention_chunk, softcap,
                 alibi_slopes, check_bool(return_softmax_lse, "return_softmax_lse"), dict(options, qv=qv))


def window_from_window_size(window_size=(-1, -1)):
    """FlashAttention 2 and 3's ``window_size`` as the core's ``window=``.

    Parameters
    ----------
    window_size : (int, int)
        ``(left, right)``, each an int >= 0 or ``-1`` (unbounded); ``(-1, -1)`` is no window.

    Returns
    -------
    (int or None, int or None)
        ``window=`` for :func:`sdpa_ref.sdpa_forward`: ``-1`` becomes None, so ``(-1, -1)`` is
        ``(None, None)``, no window.

    Examples
    --------
    >>> window_from_window_size((128, 0))
    (128, 0)
    >>> window_from_window_size((-1, -1))
    (None, None)
    """
    if window_size is None:                              # FlashAttention's "no window" is (-1, -1)
        raise TypeError("`window_size` should be a pair (left, right) of ints >= 0, -1 or None, but got None; "
                        "pass (-1, -1) for no window")
    return check_window(window_size, "window_size")


def window_from_fa4(window_size_left=None, window_size_right=None, causal=False):
    """FlashAttention 4's window bounds as the core's ``window=``.

    Parameters
    ----------
    window_size_left, window_size_right : int or None
        FlashAttention 4's bounds: None unbounded, a negative bound past the diagonal on the other side.
    causal : bool, optional
        FlashAttention 4's ``causal`` (pass it on as ``is_causal``), with which the window is checked: the core
        intersects causal with the window, so the right bound is ``min(right, 0)`` (FlashAttention 4 sets it to 0,
        which differs for a negative right bound only).

    Returns
    -------
    (int or None, int or None) or None
        ``window=`` for :func:`sdpa_ref.sdpa_forward` (None when both bounds are None: no window).

    Raises
    ------
    ValueError
        A window that keeps no key (``left + right < 0``, the right bound at most 0 under ``causal``), which
        FlashAttention 4 silently drops (pass no window for its result); and a bound of ``-1``, one key past the
        diagonal, which ``window=`` cannot spell (its ``-1`` is unbounded, as in FlashAttention 2 and 3).

    Examples
    --------
    >>> window_from_fa4(127, 0)
    (127, 0)
    >>> window_from_fa4(-2, 5)
    (-2, 5)
    """
    if window_size_left is None and window_size_right is None:
        return None
    window = fa4_window(window_size_left, window_size_right, check_bool(causal, "causal"))
    if -1 in window:
        side = "window_size_left" if window[0] == -1 else "window_size_right"
        raise ValueError(f"`{side}` should not be -1 (one key past the diagonal): `window=` spells -1 as unbounded, "
                         "as FlashAttention 2 and 3 do, but got -1")
    return window


def window_from_count(sliding_window):
    """A window counted in keys up to the diagonal (gpt-oss's ``sliding_window``, cuDNN's left bound) as the
    core's ``window=``.

    Parameters
    ----------
    sliding_window : int >= 1 or None
        The ``n`` keys up to the diagonal; None: no window.

    Returns
    -------
    (int, None) or None
        ``(n - 1, None)``: FlashAttention counts the left bound inclusively, ``left + 1`` keys. The right side
        stays unbounded; gpt-oss is causal (``is_causal=True``, the same as ``(n - 1, 0)``).

    Examples
    --------
    >>> window_from_count(128)
    (127, None)
    """
    return None if sliding_window is None else count_window(sliding_window)


def _storage(arrays, ndim):
    """The wrapper's arrays checked under FlashAttention's names (their dtype, and ``ndim`` dims)."""
    for name, x in arrays.items():
        a = V.as_float_array(x, name)
        if a.ndim != ndim:
            raise ValueError(f"`{name}` should have {ndim} dimensions, but got shape {a.shape}")


def _one_table(block_table, page_table):
    """The page table under FlashAttention 2's name or 3's, never both."""
    if block_table is not None and page_table is not None:
        raise ValueError("`block_table` and `page_table` should not both be given (FlashAttention 2's and 3's names "
                         "of one table), but got both")
    return block_table if page_table is None else page_table


def _one_window(spellings, causal, options):
    """The core's ``window=`` from the one spelling of the window that holds one, and ``options`` less the
    spellings it took; ``spellings`` is ``(window_size, window_size_left, window_size_right)``.

    The caller may spell the window as FlashAttention 2 and 3's ``window_size``, FlashAttention 4's
    ``window_size_left`` / ``window_size_right``, or through ``**options`` as the core's ``window`` (or its
    deprecated count ``sliding_window``, left to the core, which warns). A spelling holds a window unless it is
    FlashAttention's "none" (``window_size=(-1, -1)``, a bound or option of None); two that hold one are a
    `ValueError` naming both as the caller spelled them, as no precedence between them is obvious."""
    window_size, left, right = spellings
    fa23 = window_from_window_size(window_size)
    held = {}                                                # spelling: what the caller passed, as spelled
    if fa23 != (None, None):
        held["`window_size`"] = f"window_size={window_size!r}"
    if left is not None or right is not None:
        held["`window_size_left`/`window_size_right`"] = f"window_size_left={left!r}, window_size_right={right!r}"
    for name in ("window", "sliding_window"):
        if options.get(name) is not None:
            held[f"`{name}`"] = f"{name}={options[name]!r}"
    if len(held) > 1:
        raise ValueError(f"{' and '.join(held)} should not both be given (each spells the one window: pass one), "
                         f"but got {', '.join(held.values())}")
    options = dict(options)
    window = options.pop("window", None)
    if window is not None:                                   # the core's own spelling: it validates it
        return window, options
    if options.get("sliding_window") is not None:           # the core translates the count, and warns
        return None, options
    if left is not None or right is not None:
        return window_from_fa4(left, right, causal), options
    return fa23, options


def _call(q, k, lay, v, scale, causal, window, chunk, softcap, slopes, return_lse, options):
    """FlashAttention's scalar arguments checked under their own names (before anything is gathered), then the
    reference on the layout."""
    causal = check_bool(causal, "causal")
    window, options = _one_window(window, causal, options)
    scale = None if scale is None else check_scale(scale, "softmax_scale")
    cap = None if softcap is None else V.as_real_scalar(softcap, "softcap")
    cap = None if cap is None or cap == 0.0 else check_softcap(cap, "softcap")     # FlashAttention's 0: off
    hq, hkv = np.shape(q)[-2], np.shape(k)[-2] if getattr(lay, "kv_layout", "NHD") == "NHD" else np.shape(k)[1]
    kw = dict(scale=scale, is_causal=causal, window=window, attention_chunk=chunk, softcap=cap,
              alibi_slopes=slopes, causal_alignment="bottom_right", enable_gqa=hq != hkv)
    kw.update(options)
    return scaled_dot_product_attention(q, k, v, layout=lay, return_lse=return_lse, **kw)
