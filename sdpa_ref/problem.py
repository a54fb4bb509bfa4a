r"""One attention problem: the validated arrays, in the compute dtype, and their shapes.

:class:`Problem` is built once, at the public entry point, from ``query``,
``key``, ``value`` and an :class:`~sdpa_ref.options.AttentionOptions`; every
engine reads from it, so they all see exactly the same inputs and options.

Layouts (the shape legend of the package, plus the group axis ``G``)::

    q     (..., Hkv, G, L, E)     G = Hq // Hkv query heads share one kv head
    k     (..., Hkv, S, E)
    v     (..., Hkv, S, Ev)

Query head ``h = kv * G + g`` reads kv head ``kv``, which is what
``repeat_interleave`` on the head axis gives, so ``(..., Hkv, G, L, ...)``
and ``(..., Hq, L, ...)`` are the same memory: a reshape, never a copy.

The problem's own copies hold 0 wherever no result reads them
(:func:`masks.reads`: query rows with no allowed key, keys and values that
no row of their kv head allows, mask and bias entries outside the allowed
set), so that no arithmetic of any engine -- a dense product, an exact
product's scaling -- ever sees what memory holds there, and 0 where an input
is not finite (:mod:`.reads` records where; :mod:`.poison` finds which results read it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import _validate as V
from .alignment import check_q_offset
from .block_mask import TileCounts, tile_status, validate
from .masks import allowed_set, padded_rows, slice_ls, topk_indices
from .policy import averages_every_key, averages_excluded, averages_values, makes_nan, zero_output_rows
from .options import AttentionOptions
from .reads import Poison, clean, scrub
from .score_mod import apply_mask_mod
from .unread import Unread, excluded_counts, find_unread, fold

__all__ = ["Problem", "Unread"]


@dataclass(frozen=True)
class Problem:
    """Validated inputs in the compute dtype, the options, and the shapes."""

    q: np.ndarray                   # (..., Hkv, G, L, E)
    k: np.ndarray                   # (..., Hkv, S, E)
    v: np.ndarray                   # (..., Hkv, S, Ev)
    mask_bool: Optional[np.ndarray]  # broadcastable to (..., Hq, L, S)
    mask_float: Optional[np.ndarray]
    bias: Optional[np.ndarray]
    alibi: Optional[np.ndarray]     # (..., Hq, 1, 1) slopes
    q_lengths: Optional[np.ndarray]
    kv_lengths: Optional[np.ndarray]
    keep: Optional[np.ndarray]      # the dropout keep mask Z, broadcastable to (..., Hq, L, S)
    scale: float
    options: AttentionOptions
    full_scores: Tuple[int, ...]    # (*batch, Hq, L, S)
    user_ndim: int
    shapes: dict                    # the user's shapes of query, key, value, attn_mask, bias
    dtypes: dict
    out_dtype: np.dtype
    poison: Optional[Poison] = None  # where the inputs were not finite (the own copies hold 0 there), or None
    v_full: Optional[np.ndarray] = None  # "uniform": the values, non-finite ones only made 0 (averaged_values)
    unread: Optional[Unread] = None     # where the own copies hold 0 because no result reads them
    excluded_counts: Optional[np.ndarray] = None  # "jax": (*batch, Hq, L, 1) keys the structural rules exclude
    sink: Optional[np.ndarray] = None   # (..., Hq, 1, 1) the sink logits (real compute dtype; -inf: none), or None
    kv_indices: Optional[np.ndarray] = None  # gather_kv_indices, int64 broadcastable to (..., Hq, L, K), or None
    #                                          (-1 past topk_length)
    q_offset: Optional[np.ndarray] = None   # the per-sequence query offset, int64 broadcastable to the batch, or None
    tile_counts: Optional[TileCounts] = None  # with a block mask: the tiles the tiled engine skipped and visited

    @classmethod
    def build(cls, query, key, value, opts: AttentionOptions, *, complex_ok=False, adopt=False) -> "Problem":
        """Check the arrays against each other and the options; every error names its argument.

        ``adopt``: ``query``, ``key`` and ``value`` are fresh arrays of the caller's own that nothing else reads
        (a layout's gathered copies), which the problem takes as its own copies where they are already in the
        compute dtype, rather than copying them once more.
        """
        q = V.as_float_array(query, "query", min_ndim=2, allow_complex=complex_ok)
        k = V.as_float_array(key, "key", min_ndim=2, allow_complex=complex_ok)
        v = V.as_float_array(value, "value", min_ndim=2, allow_complex=complex_ok)
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"`key` should have the last dim E={q.shape[-1]} of `query` {q.shape}, but got shape {k.shape}")
        if k.shape[-2] != v.shape[-2]:
            raise ValueError(
                f"`value` should have the S={k.shape[-2]} rows of `key` {k.shape}, but got shape {v.shape}")
        qh, kh, vh = (a if a.ndim > 2 else a[None] for a in (q, k, v))
        Hq, L, E = qh.shape[-3:]
        Hkv, S = kh.shape[-3], kh.shape[-2]
        if vh.shape[-3] != Hkv:
            raise ValueError(f"`value` should have the Hkv={Hkv} heads of `key` {k.shape}, but got shape {v.shape}")
        if opts.enable_gqa:
            if Hkv == 0 or Hq % Hkv != 0:
                raise ValueError(f"`key` should have a head count Hkv that divides Hq={Hq} of `query` "
                                 f"(enable_gqa=True), but got Hkv={Hkv}")
        elif Hq != Hkv:
            raise ValueError(f"`key` should have the Hq={Hq} heads of `query` when enable_gqa=False, "
                             f"but got Hkv={Hkv}; pass enable_gqa=True for grouped-query attention")
        batch = V.broadcast_batch({"query": qh.shape[:-3], "key": kh.shape[:-3], "value": vh.shape[:-3]})
        full_scores = batch + (Hq, L, S)
        user_ndim = max(q.ndim, k.ndim, v.ndim)
        user_scores = full_scores[len(full_scores) - user_ndim:]
        scale = opts.scale if opts.scale is not None else (float(1.0 / np.sqrt(E)) if E > 0 else 1.0)

        mask_bool = mask_float = None
        if opts.attn_mask is not None:
            m = V.as_mask(opts.attn_mask, "attn_mask", user_scores, allow_complex=complex_ok)
            mask_bool, mask_float = (m, None) if m.dtype == bool else (None, m)
        bias = None
        if opts.bias is not None:
            bias = V.as_mask(opts.bias, "bias", user_scores, allow_complex=complex_ok)
            if bias.dtype == bool:
                raise TypeError(f"`bias` should have dtype {V._listing(V.INPUT_DTYPES)} (it is added to the "
                                "scores), but got bool; pass a bool mask as `attn_mask`")
        alibi = None if opts.alibi_slopes is None else V.per_head(opts.alibi_slopes, "alibi_slopes", Hq, batch)
        alibi = None if alibi is None else alibi[..., None, None]
        sinks = None if opts.sinks is None else V.sink_logits(opts.sinks, Hq, batch)[0]   # (..., Hq)
        q_lengths = V.lengths(opts.q_lengths, "q_lengths", L, batch)
        kv_lengths = V.lengths(opts.kv_lengths, "kv_lengths", S, batch)
        kv_indices = None if opts.gather_kv_indices is None else \
            V.indices(opts.gather_kv_indices, "gather_kv_indices", batch + (Hq, L))
        if opts.topk_length is not None:
            kv_indices = topk_indices(kv_indices, opts.topk_length, batch + (Hq, L))
        q_offset = None if opts.q_offset is None else check_q_offset(opts.q_offset, batch)
        keep = None
        if opts.dropout_mask is not None:
            keep = V.as_mask(opts.dropout_mask, "dropout_mask", user_scores, allow_float=False)
        elif opts.dropout_p > 0.0:
            keep = V.as_generator(opts.rng).random(user_scores) >= opts.dropout_p
        if averages_every_key(opts.fully_masked) and S == 0:
            raise ValueError("`fully_masked` should not be 'uniform' when S == 0 (the mean of zero values "
                             "is undefined), but got S=0")

        out_dtype = np.dtype(np.complex128) if complex_ok else V.result_dtype(q.dtype, k.dtype, v.dtype)
        if not (opts.upcast or complex_ok) and out_dtype.name not in V.UPCAST_FALSE_DTYPES:
            raise TypeError(f"`query` should have dtype {V._listing(V.UPCAST_FALSE_DTYPES)} with upcast=False "
                            f"(it computes in the inputs' dtype, and NumPy has no {out_dtype.name} arithmetic), "
                            f"but got {q.dtype.name}; pass upcast=True (the default) to compute in float64 and "
                            f"round the results to {out_dtype.name}")
        ct = np.result_type(out_dtype, np.float64) if (opts.upcast or complex_ok) else out_dtype
        rt = np.dtype(ct.type(0).real.dtype)
        G = Hq // Hkv if Hkv else 1
        arrays = (q_lengths, kv_lengths, mask_bool, kv_indices, q_offset)
        at = _unread(opts, full_scores, G, arrays, keep,
                     {"q": qh.shape[:-1], "k": kh.shape[:-1], "v": vh.shape[:-1],
                      "mask": None if mask_float is None else mask_float.shape,
                      "bias": None if bias is None else bias.shape})
        own = {"q": _own(qh, ct, at.q, True, adopt), "k": _own(kh, ct, at.k, True, adopt),
               "mask": _own(mask_float, ct, at.mask, True), "bias": _own(bias, ct, at.bias, True),
               "alibi": _own(alibi, rt, writable=True)}
        bad = {"q": scrub(own["q"], rows=True), "k": scrub(own["k"], rows=True),
               "mask": scrub(own["mask"], additive=True), "bias": scrub(own["bias"], additive=True),
               "alibi": scrub(own["alibi"])}                     # what reads it: poison.py
        v_full = None
        if averages_values(opts.fully_masked):              # a fully masked row averages values it keeps
            v_full = _own(vh, ct, writable=True)
            bad["v"] = scrub(v_full)
            own["v"] = v_full if at.v is None else _own(v_full, ct, at.v)
        else:
            own["v"] = _own(vh, ct, at.v, True, adopt)
            bad["v"] = scrub(own["v"])
        poison = None
        if any(b is not None for b in bad.values()):
            bq = bad["q"]
            poison = Poison(q=None if bq is None else bq.reshape(qh.shape[:-3] + (Hkv, G, L, 1)), k=bad["k"],
                            v=bad["v"], mask=bad["mask"], bias=bad["bias"], alibi=bad["alibi"])
        at = at._replace(q=None if at.q is None else at.q.reshape(qh.shape[:-3] + (Hkv, G, L, 1)))
        for a in (*own.values(), v_full):
            if a is not None:
                a.setflags(write=False)
        return cls(
            q=own["q"].reshape(qh.shape[:-3] + (Hkv, G, L, E)), k=own["k"], v=own["v"],
            mask_bool=_own(mask_bool), mask_float=own["mask"], bias=own["bias"], alibi=own["alibi"],
            q_lengths=_own(q_lengths), kv_lengths=_own(kv_lengths), keep=_own(keep), scale=scale, options=opts,
            full_scores=full_scores, user_ndim=user_ndim,
            shapes={"query": q.shape, "key": k.shape, "value": v.shape,
                    "attn_mask": None if mask_float is None else mask_float.shape,
                    "bias": None if bias is None else bias.shape,
                    "sinks": None if sinks is None else np.shape(opts.sinks)},     # the caller's own shape
            dtypes={"query": q.dtype, "key": k.dtype, "value": v.dtype,
                    "attn_mask": None if mask_float is None else mask_float.dtype,
                    "bias": None if bias is None else bias.dtype, "sinks": None if sinks is None else sinks.dtype},
            out_dtype=out_dtype, poison=poison, v_full=v_full, unread=at,
            excluded_counts=None if not averages_excluded(opts.fully_masked) else
            _own(excluded_counts(full_scores, lambda rows: _allowed(opts, full_scores, arrays, rows))),
            sink=None if sinks is None else _own(sinks[..., None, None], rt), kv_indices=_own(kv_indices),
            q_offset=_own(q_offset),
            tile_counts=_tiles(opts, full_scores),
        )

    # ----------------------------------------------------------- shapes

    @property
    def dtype(self):
        """The compute dtype."""
        return self.q.dtype

    @property
    def batch(self):
        return self.full_scores[:-3]

    @property
    def L(self):
        return self.full_scores[-2]

    @property
    def S(self):
        return self.full_scores[-1]

    @property
    def Hq(self):
        return self.full_scores[-3]

    @property
    def Hkv(self):
        return self.k.shape[-3]

    @property
    def G(self):
        return self.q.shape[-3]

    @property
    def out_shape(self):
        """The output's shape, in the user's rank."""
        full = self.full_scores[:-1] + (self.v.shape[-1],)
        return full[len(full) - self.user_ndim:]

    # ------------------------------------------------------ allowed set

    def allowed(self, rows=None, cols=None):
        """The structural allowed set of the scores (or of one block), or None: see :func:`masks.allowed_set`.

        With a block mask, a block that is one tile absent for every batch entry and head is all False, and one
        that is full is the other masks' set without the mask function (counted in :attr:`tile_counts`).
        """
        arrays = (self.q_lengths, self.kv_lengths, self.mask_bool, self.kv_indices, self.q_offset)
        opts = self.options
        st = None if opts.block_mask is None or rows is None or cols is None else \
            tile_status(opts.block_mask, self.full_scores, rows, cols)
        if st is not None:
            self.tile_counts[st] += 1
            if st == "absent":
                return np.zeros((rows[1] - rows[0], cols[1] - cols[0]), bool)
            if st == "full":                                     # every entry, as the other masks say
                a = _allowed(dataclasses.replace(opts, mask_mod=None), self.full_scores, arrays, rows, cols)
                return np.ones((rows[1] - rows[0], cols[1] - cols[0]), bool) if a is None else a
        return _allowed(opts, self.full_scores, arrays, rows, cols)

    def padded_rows(self, rows=None):
        """``(*batch, 1, L, 1)`` bool: query rows past ``q_len`` (of the block ``rows``), or None."""
        return padded_rows(self.L, self.q_lengths, rows)

    def sink_rows(self, rows=None):
        """The sink logits for the rows ``rows`` (all by default): ``(..., Hq, 1, 1)``, or ``(..., Hq, Lb, 1)``
        with ``-inf`` on the padded rows (past ``q_lengths``, which have no sink: ``lse = -inf`` there, as
        without one); None without sinks."""
        if self.sink is None:
            return None
        pad = self.padded_rows(rows)
        return self.sink if pad is None else np.where(pad, self.sink.dtype.type(-np.inf), self.sink)

    def nan_rows_without_keys(self):
        """``(*batch, 1, L, 1)`` (``(..., Hq, L, 1)`` with sinks) bool, or None: with ``S = 0`` under
        ``fully_masked="nan"``, the rows that are not padded and have no sink. No row has a key,
        so, as on a fully masked row with keys, their ``dq`` and their tangent are NaN
        (the engines' empty sums give 0; ``dk``, ``dv`` and the mask and bias gradients have no entries).
        ``"jax"`` is JAX's formula, whose softmax over no key is empty and whose ``P V`` an empty sum: 0, as the
        engines give (:func:`sdpa_ref.policy.nan_rows`)."""
        if self.S != 0 or not makes_nan(self.options.fully_masked):
            return None
        shape = tuple(self.batch) + (1, self.L, 1)
        pad = self.padded_rows()
        rows = np.ones(shape, bool) if pad is None else np.broadcast_to(~pad, shape)
        return rows if self.sink is None else rows & (self.sink == -np.inf)   # with a sink: O = 0, no policy

    # ---------------------------------------------------- unread memory

    def averaged_values(self, empty, zeroed=None, full=None, rows=None):
        """What the rows ``empty`` ``(*batch, Hq, Lb, 1)`` (of the row block ``rows``) average under
        ``fully_masked="uniform"`` (``"jax"``: of the keys each row's structural rules exclude),
        ``(..., Hkv, S, n)``: the values (or their tangent, ``zeroed`` and ``full``) as given where one of those
        rows keeps the key, and as the other rows read them elsewhere.

        ``zeroed`` is what every other row reads (:attr:`v`, 0 where no allowed entry reads it); ``full`` the
        same cleaned of non-finite entries only (:attr:`v_full`). Such a row averages every value that its
        dropout keeps, whatever the allowed set says; what no row reads stays 0, so that no arithmetic -- the
        exact products' scaling included -- sees it.
        """
        zeroed, full = (self.v, self.v_full) if zeroed is None else (zeroed, full)
        if full is None or full is zeroed or not np.any(empty):
            return zeroed
        i0, i1 = rows if rows is not None else (0, self.L)
        pad = self.padded_rows(rows)
        e = empty if pad is None else (empty & ~pad)
        if self.keep is not None:
            e = e & slice_ls(self.keep, i0, i1, 0, None)
        if self.excluded_counts is not None:               # "jax": only the keys the structural rules exclude
            a = self.allowed((i0, i1))
            if a is None:
                return zeroed
            e = e & ~a
        e = np.broadcast_to(e, self.batch + (self.Hq, i1 - i0, e.shape[-1]))
        kept = np.any(e.reshape(self.batch + (self.Hkv, self.G * (i1 - i0), e.shape[-1])), axis=-2)
        return np.where(fold(kept, zeroed.shape[:-1], np.any)[..., None], full, zeroed)

    def clean_grad_out(self, g, empty):
        """``(dO, where it was not finite or None)``: ``grad_out`` in the compute dtype and the layout
        ``(*batch, Hq, L, Ev)``, 0 on the rows whose output is the constant 0 (``empty``: the forward's rows
        without a key), which no gradient reads, and where it is not finite (:func:`reads.clean`)."""
        dO = _cast(g, self.dtype).reshape(self.full_scores[:-1] + (g.shape[-1],))
        zr = zero_output_rows(empty, self.padded_rows(), self.options.fully_masked)
        if zr is not None:
            dO = np.where(zr, self.dtype.type(0), dO)
        return clean(dO)

    def clean_grad_lse(self, g, empty):
        """``(dlse, where it was not finite or None)``: ``grad_lse`` in the compute dtype, ``(*batch, Hq, L, 1)``,
        0 on the rows whose LSE is a constant (no allowed key, or padded), which no gradient reads, and where it is
        not finite (:func:`reads.clean`)."""
        dl = _cast(g, self.dtype).reshape(self.full_scores[:-1] + (1,))
        pad = self.padded_rows()
        return clean(np.where(empty if pad is None else (empty | pad), self.dtype.type(0), dl))

    def clean_tangents(self, dq, dk, dv, dbias):
        """The JVP's tangents (in the layouts of :attr:`q`, :attr:`k`, :attr:`v` and the bias; None is zero) as
        the problem's inputs are cleaned: in the compute dtype, 0 where no result reads them, and where they
        are not finite.

        Returns ``((dq, dk, dv, dbias), (where each was not finite, or None), dv_full)``, ``dv_full`` the value
        tangent as the rows of ``"uniform"`` average it (:meth:`averaged_values`), or None.
        """
        at = self.unread if self.unread is not None else Unread(None, None, None, None, None)
        ts, bads, dv_full = [], [], None
        dq, dk, dv, dbias = (None if t is None else _cast(t, self.dtype) for t in (dq, dk, dv, dbias))
        for t, dead in ((dq, at.q), (dk, at.k), (dv, at.v), (dbias, at.bias)):
            if t is not None and t is dv and self.v_full is not None:      # "uniform" rows read it all
                dv_full, b = clean(t)
                t = dv_full if dead is None else np.where(dead, t.dtype.type(0), dv_full)
            elif t is not None:
                t, b = clean(t if dead is None else np.where(dead, t.dtype.type(0), t))
            else:
                b = None
            ts.append(t)
            bads.append(b)
        return tuple(ts), tuple(bads), dv_full


def _own(a, dtype=None, dead=None, writable=False, adopt=False):
    """The problem's own read-only copy of ``a`` (None stays None), 0 where ``dead`` is True.

    ``writable=True`` leaves it writable, for :func:`reads.scrub`; the caller then makes it read-only.
    ``adopt=True``: ``a`` is a fresh array that nothing else reads (:meth:`Problem.build`'s ``adopt``), taken
    itself when it is writable and in ``dtype``, whatever its strides (a layout's gathered keys are a view of
    ``(B, S, H, E)``: the engines read any strides, and a transposing copy of a long cache would cost more than
    the attention over it).

    Nothing the caller does to the arrays it passed in can then change the
    residuals, and no engine can write into them. The cost is one copy of
    each input, small next to the ``L x S`` work (a full-size float mask or
    bias is copied too). Where no result reads it (``dead``, from
    :func:`masks.reads`: padding past the lengths, keys and values that
    causal, window or bool mask exclude for every row, query rows with no
    key) it holds 0: whatever memory holds there -- NaN, ``1e308``, random
    bits -- never meets an arithmetic operation (``0 * NaN``, an overflowing
    ``dO V^T``, an exact product's scaling by its column's maximum).
    """
    if a is None:
        return None
    if not (adopt and a.dtype == dtype and a.flags.writeable):
        with np.errstate(invalid="ignore"):                # a signalling NaN (random bits) casts quietly
            a = np.array(a, dtype=dtype, copy=True)
    if dead is not None:                                   # what is stored there is never read: make it 0
        np.copyto(a, 0, where=dead)
    if not writable:
        a.setflags(write=False)
    return a


def _cast(a, dtype):
    """``a`` in ``dtype`` (itself when it is already); a signalling NaN (random bits in memory) casts quietly."""
    with np.errstate(invalid="ignore"):
        return a.astype(dtype, copy=False)


def _tiles(opts, full):
    """A block mask checked against its mask function on the whole of the scores (:func:`block_mask.validate`),
    and its tile counts; None without one."""
    bm = opts.block_mask
    if bm is None:
        return None
    validate(bm, full, None if bm.mask_mod is None else apply_mask_mod(bm.mask_mod, tuple(full)))
    return TileCounts()


#: :func:`find_unread`'s records of problems whose allowed set is the scalar options' alone (no array, no mask
#: function, no dropout), by those options and the shapes: a small call pays for its search once.
_UNREAD_CACHE = {}
_UNREAD_CACHE_SIZE = 256


def _unread(opts, full, G, arrays, keep, shapes):
    """:func:`find_unread` of a problem: from :data:`_UNREAD_CACHE` when only the scalar options (causal, window,
    alignment, sink tokens, chunk) shape the allowed set, its arrays then read-only and shared."""
    def search():
        return find_unread(full, G, lambda rows: _allowed(opts, full, arrays, rows), keep, shapes)

    if keep is not None or opts.mask_mod is not None or any(a is not None for a in arrays):
        return search()
    key = (tuple(full), G, opts.is_causal, opts.window, opts.causal_alignment, opts.sink_token_length,
           opts.attention_chunk, tuple(sorted(shapes.items())))
    try:
        hit = _UNREAD_CACHE.get(key)
    except TypeError:                                      # an unhashable option: no cache
        return search()
    if hit is None:
        hit = search()
        for a in hit:
            if a is not None:
                a.setflags(write=False)
        if len(_UNREAD_CACHE) >= _UNREAD_CACHE_SIZE:
            _UNREAD_CACHE.clear()
        _UNREAD_CACHE[key] = hit
    return hit


def _allowed(opts, full, arrays, rows=None, cols=None):
    """:func:`masks.allowed_set` of a problem's options and its ``(q_lengths, kv_lengths, bool mask, kv_indices,
    q_offset)``: the one place that hands every allowed-set parameter on."""
    q_lengths, kv_lengths, mask, kv_indices, q_offset = arrays
    return allowed_set(full[-2], full[-1], is_causal=opts.is_causal, window=opts.window,
                       alignment=opts.causal_alignment, q_lengths=q_lengths, kv_lengths=kv_lengths, mask=mask,
                       rows=rows, cols=cols, sink_tokens=opts.sink_token_length, chunk=opts.attention_chunk,
                       kv_indices=kv_indices, mask_mod=opts.mask_mod, full=tuple(full), q_offset=q_offset)
