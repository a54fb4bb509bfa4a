r"""The allowed set of ``SEMANTICS.md``: which keys each query row reads.

The public builders (:func:`causal_mask`, :func:`window_mask`,
:func:`padding_mask`) return bool arrays (True = the key takes part) that can
be handed to any attention implementation. They are built by the same
:func:`allowed_set` that every engine of the package calls, so a kernel's own
masks can come from the very definitions the reference uses.

Take query ``i`` and key ``j``. The alignment sets an offset: ``off = 0`` for
``"top_left"`` (PyTorch, JAX) and ``off = S - L`` for ``"bottom_right"``
(FlashAttention, xformers); with per-batch lengths ``off = kv_len - q_len``;
``q_offset[b]`` when given (:mod:`sdpa_ref.alignment`). Then

* causal keeps ``j <= i + off``;
* ``window=(left, right)`` keeps ``i + off - left <= j <= i + off + right``
  (``None`` or ``-1`` for a bound means unbounded on that side);
* lengths keep ``j < kv_len`` and ``i < q_len``;
* a bool ``attn_mask`` keeps its True entries.

A row with no allowed key gets what the ``fully_masked`` policy says
(:mod:`sdpa_ref.policy`).
"""

from __future__ import annotations

import numbers

import numpy as np

from . import _validate as V
from .alignment import ALIGNMENTS, _per_batch, alignment_offset, diagonal_offset
from .broadcast import block_of, slice_ls
from .score_mod import apply_mask_mod

__all__ = [
    "alignment_offset",
    "allowed_set",
    "block_of",
    "causal_mask",
    "padded_rows",
    "padding_mask",
    "reads",
    "topk_indices",
    "window_mask",
]


def allowed_set(L, S, *, is_causal=False, window=None, alignment="top_left", q_lengths=None, kv_lengths=None,
                mask=None, rows=None, cols=None, sink_tokens=0, chunk=None, kv_indices=None, mask_mod=None,
                full=None, q_offset=None):
    """The allowed set: bool mask AND causal AND window AND chunk AND gathered indices AND mask function AND
    lengths, or ``None``
    when nothing is excluded.

    With ``p = i + off`` the query's position on the keys' axis:

    * causal keeps ``j <= p``; the window ``(left, right)`` keeps ``p - left <= j <= p + right`` (a bound may be
      negative), the first ``sink_tokens`` keys exempt from the left bound (StreamingLLM);
    * ``chunk`` ``C`` keeps ``s <= j < s + C``, ``s = p - (p mod C)`` (Llama 4; ``mod`` of a negative ``p`` is
      Python's, non-negative);
    * ``kv_indices`` keeps the keys a row's indices name, each counted once; an index outside ``[0, S)``
      (``-1``) names none.

    Parameters
    ----------
    L, S : int
        Query and key positions.
    is_causal, window, alignment
        As in :func:`sdpa_ref.sdpa_forward` (``window`` already normalised to
        ``(left, right)`` of int or None).
    sink_tokens, chunk
        ``sink_token_length`` and ``attention_chunk`` (None: off).
    kv_indices : ndarray of int, broadcastable to (..., Hq, L, K), optional
        ``gather_kv_indices``.
    q_lengths, kv_lengths : ndarray of int64, (...), optional
        Per-batch lengths (validated by :func:`sdpa_ref._validate.lengths`).
    q_offset : ndarray of int64, (...), optional
        Per-sequence query offset (:func:`sdpa_ref.alignment.check_q_offset`): ``off = q_offset[b]``, in place
        of the alignment's.
    mask : ndarray of bool, broadcastable to (..., Hq, L, S), optional
    mask_mod : callable, optional
        A mask function ``(b, h, q_idx, kv_idx) -> bool`` (:func:`sdpa_ref.score_mod.apply_mask_mod`), with
        ``full`` the scores' shape ``(*batch, Hq, L, S)``.
    rows, cols : (start, stop), optional
        Only this block of query rows and key columns (the tiled engine asks
        for one block at a time); the default is all.

    Returns
    -------
    ndarray of bool, broadcastable to (..., Hq, L, S) (or the block), or None
    """
    i0, i1 = rows if rows is not None else (0, L)
    j0, j1 = cols if cols is not None else (0, S)
    i = np.arange(i0, i1)[:, None]
    j = np.arange(j0, j1)[None, :]
    parts = []
    if mask is not None:
        parts.append(slice_ls(mask, i0, i1, j0, j1))
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    if left is not None or right is not None or chunk:
        p = i + diagonal_offset(L, S, alignment, q_lengths, kv_lengths, q_offset)
        if left is not None:
            parts.append((j >= p - left) | (j < sink_tokens) if sink_tokens else j >= p - left)
        if right is not None:
            parts.append(j <= p + right)
        if chunk:
            start = p - np.mod(p, chunk)
            parts.append((j >= start) & (j < start + chunk))
    if kv_indices is not None:
        parts.append(_named(kv_indices, i0, i1, j0, j1))
    if mask_mod is not None:
        parts.append(apply_mask_mod(mask_mod, full, rows, cols))
    if kv_lengths is not None:
        parts.append(j < _per_batch(kv_lengths))
    if q_lengths is not None:
        parts.append(i < _per_batch(q_lengths))
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


def _named(kv_indices, i0, i1, j0, j1):
    """``(..., Lb, j1 - j0)`` bool: the keys of the block that some index of the row names (each once; an index
    outside the block, ``-1`` and any outside ``[0, S)`` included, names none), without a ``(.., L, K, S)``
    temporary: the indices are scattered into a row of ``j1 - j0 + 1`` flags, the last one a sink for the rest."""
    idx = slice_ls(kv_indices, i0, i1, 0, None).astype(np.int64) - j0
    n = j1 - j0
    idx = np.where((idx >= 0) & (idx < n), idx, n)
    out = np.zeros(idx.shape[:-1] + (n + 1,), bool)
    np.put_along_axis(out, idx, True, axis=-1)
    return out[..., :n]


def topk_indices(kv_indices, topk_length, lead):
    """``gather_kv_indices`` truncated at FlashMLA's ``topk_length``: index ``t`` of row ``i`` is kept where
    ``t < topk_length[..., i]`` and becomes ``-1`` (names no key, so the key it named is never read) elsewhere.

    Parameters
    ----------
    kv_indices : ndarray of int64, broadcastable to (..., Hq, L, K)
        The validated indices.
    topk_length : array_like of int, broadcastable to (..., Hq, L)
        How many of each row's indices count, in ``[0, K]``. FlashMLA's sparse prefill passes ``(s_q,)``, one
        per query (``(L,)`` here); its sparse decode ``(b,)``, one per sequence (``(b, 1, 1)`` here).
    lead : tuple of int
        ``(*batch, Hq, L)``.

    Returns
    -------
    ndarray of int64, broadcastable to (..., Hq, L, K)

    Examples
    --------
    >>> topk_indices(np.array([[3, 1, 2], [0, 2, 1]]), [1, 3], (2,)).tolist()
    [[3, -1, -1], [0, 2, 1]]
    """
    K = kv_indices.shape[-1]
    n = V.int_array(topk_length, "topk_length", "index counts", lead, where=f"(..., Hq, L) = {tuple(lead)}",
                    noun="counts", bounds=(0, K), range_text=f"[0, K] = [0, {K}]",
                    hint="; FlashMLA's per-sequence (b,) is (b, 1, 1) here")
    keep = np.arange(K) < n.astype(np.int64)[..., None]
    return np.where(keep, kv_indices, np.int64(-1))


def padded_rows(L, q_lengths, rows=None):
    """``(*batch, 1, L, 1)`` bool: query rows ``i >= q_len`` (of the block ``rows``), or None."""
    if q_lengths is None:
        return None
    i0, i1 = rows if rows is not None else (0, L)
    return np.arange(i0, i1)[:, None] >= _per_batch(q_lengths)


def reads(allowed, nd, G, keep=None):
    """What the allowed scores of a block of rows read: ``(rows, keys, values)``, bool, True = read; None: all.

    Parameters
    ----------
    allowed : ndarray of bool, broadcastable to (*batch, Hq, Lb, S), or None
        The allowed set (:func:`allowed_set`) of the block, in a problem whose scores have ``nd`` dims.
    G : int
        Query heads per kv head.
    keep : ndarray of bool, broadcastable to (*batch, Hq, Lb, S), optional
        The block's dropout keep mask: a value whose every allowed entry is dropped is not read.

    Returns
    -------
    rows : (*batch, Hq, Lb) -- the query rows with an allowed key
    keys, values : (*batch, Hkv, S) -- the keys that a row of the block, of a head of the kv head's group,
        allows (values: and keeps)

    Each may have 1 where the allowed set does not vary (it broadcasts).
    This is the one model of what is read: :class:`~sdpa_ref.problem.Problem`
    writes 0 where nothing reads, so that no arithmetic sees what memory
    holds there.
    """
    if allowed is None and keep is None:
        return None, None, None
    a = np.ones((1,) * nd, bool) if allowed is None else _rank(allowed, nd)
    rows = None if allowed is None else np.any(a, axis=-1)
    keys = None if allowed is None else _any_of_group(np.any(a, axis=-2), G)
    values = keys if keep is None else _any_of_group(np.any(a & _rank(keep, nd), axis=-2), G)
    return rows, keys, values


def _rank(a, nd):
    return np.asarray(a).reshape((1,) * (nd - np.ndim(a)) + np.shape(a))


def _any_of_group(x, G):
    """``(..., Hq, S)`` -> ``(..., Hkv, S)``: True where True for some query head of the kv head's group."""
    if x.shape[-2] == 1 or G == 1:
        return x
    return np.any(x.reshape(x.shape[:-2] + (x.shape[-2] // G, G, x.shape[-1])), axis=-2)


# ------------------------------------------------------- public builders


def causal_mask(L, S, alignment="top_left"):
    """Bool ``(L, S)`` mask keeping ``j <= i + off``.

    Parameters
    ----------
    L, S : int
        Number of queries and keys.
    alignment : {"top_left", "bottom_right"}
        Where the diagonal sits when ``L != S``.

    Returns
    -------
    ndarray of bool, (L, S)

    Examples
    --------
    >>> causal_mask(2, 3).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0]]
    >>> causal_mask(2, 3, "bottom_right").astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    return window_mask(L, S, None, 0, alignment=alignment)


def window_mask(L, S, left, right, alignment="top_left"):
    """Bool ``(L, S)`` sliding-window mask, inclusive on both sides.

    Keeps ``i + off - left <= j <= i + off + right``. ``None`` or ``-1`` for
    ``left`` / ``right`` means unbounded on that side.

    Returns
    -------
    ndarray of bool, (L, S)

    Examples
    --------
    >>> window_mask(3, 3, 1, 0).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    L = _check_size(L, "L")
    S = _check_size(S, "S")
    window = (_check_bound(left, "left"), _check_bound(right, "right"))
    if alignment not in ALIGNMENTS:
        raise ValueError(f"`alignment` should be one of {ALIGNMENTS!r}, but got {alignment!r}")
    keep = allowed_set(L, S, window=window, alignment=alignment)
    return np.ones((L, S), dtype=bool) if keep is None else np.broadcast_to(keep, (L, S)).copy()


def padding_mask(q_lengths, kv_lengths, L, S):
    """Bool ``(..., 1, L, S)`` mask of the valid (query, key) pairs per batch.

    Keeps ``i < q_len`` and ``j < kv_len``. The head axis of length 1 lets it
    broadcast against ``(..., Hq, L, S)``. Note that passing this as
    ``attn_mask`` makes padded query rows *fully masked* (they follow
    ``fully_masked``), whereas ``q_lengths=`` zeroes them under every policy;
    the two agree under the default ``"zero"``.

    Parameters
    ----------
    q_lengths, kv_lengths : array_like of int, (...)
        Per-batch lengths; ``None`` means ``L`` (resp. ``S``) everywhere.
    L, S : int

    Examples
    --------
    >>> padding_mask([1, 2], [2, 3], 2, 3)[1, 0].astype(int).tolist()
    [[1, 1, 1], [1, 1, 1]]
    >>> padding_mask([1, 2], [2, 3], 2, 3)[0, 0].astype(int).tolist()
    [[1, 1, 0], [0, 0, 0]]
    """
    L = _check_size(L, "L")
    S = _check_size(S, "S")
    ql = np.asarray(L if q_lengths is None else q_lengths)
    kl = np.asarray(S if kv_lengths is None else kv_lengths)
    try:
        batch = np.broadcast_shapes(ql.shape, kl.shape)
    except ValueError:
        raise ValueError(f"`q_lengths` and `kv_lengths` should broadcast together, but got shapes "
                         f"{ql.shape} and {kl.shape}") from None
    ql = np.broadcast_to(V.lengths(ql, "q_lengths", L, batch), batch)
    kl = np.broadcast_to(V.lengths(kl, "kv_lengths", S, batch), batch)
    keep = allowed_set(L, S, q_lengths=ql, kv_lengths=kl)
    return np.broadcast_to(keep, batch + (1, L, S)).copy()


# ---------------------------------------------------------------- helpers


def _check_size(n, name):
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (numbers.Integral, np.integer)) or n < 0:
        raise ValueError(f"`{name}` should be a non-negative int, but got {n!r}")
    return int(n)


def _check_bound(b, name):
    """``None`` or -1 -> unbounded (None); otherwise a non-negative int."""
    if b is None:
        return None
    if isinstance(b, (bool, np.bool_)) or not isinstance(b, (numbers.Integral, np.integer)):
        raise TypeError(f"`{name}` should be a non-negative int, -1 or None, but got {b!r}")
    if b == -1:
        return None
    if b < 0:
        raise ValueError(f"`{name}` should be a non-negative int, -1 or None, but got {b!r}")
    return int(b)
