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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import _validate as V
from .masks import allowed_set, check_lengths, padded_rows
from .options import AttentionOptions
from .poison import Poison, scrub

__all__ = ["Problem"]


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

    @classmethod
    def build(cls, query, key, value, opts: AttentionOptions, *, complex_ok=False) -> "Problem":
        """Check the arrays against each other and the options; every error names its argument."""
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
        alibi = None
        if opts.alibi_slopes is not None:
            s = V.as_float_array(opts.alibi_slopes, "alibi_slopes", min_ndim=1)
            try:
                ok = s.shape[-1] == Hq and np.broadcast_shapes(s.shape[:-1], batch) == batch
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"`alibi_slopes` should have shape (Hq,) = ({Hq},) or (..., Hq) broadcasting to "
                                 f"{batch + (Hq,)}, but got shape {s.shape}")
            alibi = s[..., None, None]
        q_lengths = check_lengths(_lengths(opts.q_lengths, "q_lengths"), "q_lengths", L, batch)
        kv_lengths = check_lengths(_lengths(opts.kv_lengths, "kv_lengths"), "kv_lengths", S, batch)
        keep = None
        if opts.dropout_mask is not None:
            keep = V.as_mask(opts.dropout_mask, "dropout_mask", user_scores, allow_float=False)
        elif opts.dropout_p > 0.0:
            keep = _as_generator(opts.rng).random(user_scores) >= opts.dropout_p
        if opts.fully_masked == "uniform" and S == 0:
            raise ValueError("`fully_masked` should not be 'uniform' when S == 0 (the mean of zero values "
                             "is undefined), but got S=0")

        out_dtype = np.dtype(np.complex128) if complex_ok else np.result_type(q.dtype, k.dtype, v.dtype)
        if not (opts.upcast or complex_ok) and out_dtype.name not in V.UPCAST_FALSE_DTYPES:
            raise TypeError(f"`query` should have dtype {V._listing(V.UPCAST_FALSE_DTYPES)} with upcast=False "
                            f"(it computes in the inputs' dtype, and NumPy has no {out_dtype.name} arithmetic), "
                            f"but got {q.dtype.name}; pass upcast=True (the default) to compute in float64 and "
                            f"round the results to {out_dtype.name}")
        ct = np.result_type(out_dtype, np.float64) if (opts.upcast or complex_ok) else out_dtype
        rt = np.dtype(ct.type(0).real.dtype)
        G = Hq // Hkv if Hkv else 1
        dead_q = _dead(q_lengths, L, batch, qh.shape[:-3])          # rows and keys past the lengths: never read
        dead_kv = _dead(kv_lengths, S, batch, kh.shape[:-3])
        dead_v = None if opts.fully_masked == "uniform" else _dead(kv_lengths, S, batch, vh.shape[:-3])
        own = {"q": _own(qh, ct, dead_q, writable=True), "k": _own(kh, ct, dead_kv, writable=True),
               "v": _own(vh, ct, dead_v, writable=True),
               "mask": _own(mask_float, ct, writable=True), "bias": _own(bias, ct, writable=True),
               "alibi": _own(alibi, rt, writable=True)}
        bad = {"q": scrub(own["q"], rows=True), "k": scrub(own["k"], rows=True), "v": scrub(own["v"]),
               "mask": scrub(own["mask"], additive=True), "bias": scrub(own["bias"], additive=True),
               "alibi": scrub(own["alibi"])}                     # poison is read only where it is read: poison.py
        poison = None
        if any(b is not None for b in bad.values()):
            bq = bad["q"]
            poison = Poison(q=None if bq is None else bq.reshape(qh.shape[:-3] + (Hkv, G, L)), k=bad["k"],
                            v=bad["v"], mask=bad["mask"], bias=bad["bias"], alibi=bad["alibi"])
        for a in own.values():
            if a is not None:
                a.setflags(write=False)
        return cls(
            q=own["q"].reshape(qh.shape[:-3] + (Hkv, G, L, E)), k=own["k"], v=own["v"],
            mask_bool=_own(mask_bool), mask_float=own["mask"], bias=own["bias"], alibi=own["alibi"],
            q_lengths=_own(q_lengths), kv_lengths=_own(kv_lengths), keep=_own(keep), scale=scale, options=opts,
            full_scores=full_scores, user_ndim=user_ndim,
            shapes={"query": q.shape, "key": k.shape, "value": v.shape,
                    "attn_mask": None if mask_float is None else mask_float.shape,
                    "bias": None if bias is None else bias.shape},
            dtypes={"query": q.dtype, "key": k.dtype, "value": v.dtype,
                    "attn_mask": None if mask_float is None else mask_float.dtype,
                    "bias": None if bias is None else bias.dtype},
            out_dtype=out_dtype, poison=poison,
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
        """The structural allowed set of the scores (or of one block), or None: see :func:`masks.allowed_set`."""
        o = self.options
        return allowed_set(self.L, self.S, is_causal=o.is_causal, window=o.window, alignment=o.causal_alignment,
                           q_lengths=self.q_lengths, kv_lengths=self.kv_lengths, mask=self.mask_bool,
                           rows=rows, cols=cols)

    def padded_rows(self, rows=None):
        """``(*batch, 1, L, 1)`` bool: query rows past ``q_len`` (of the block ``rows``), or None."""
        return padded_rows(self.L, self.q_lengths, rows)

    def nan_rows_without_keys(self):
        """``(*batch, 1, L, 1)`` bool, or None: with ``S = 0`` under ``fully_masked="nan"``, the rows that are not
        padded. No row has a key, so, as on a fully masked row with keys, their ``dq`` and their tangent are NaN
        (the engines' empty sums give 0; ``dk``, ``dv`` and the mask and bias gradients have no entries)."""
        if self.S != 0 or self.options.fully_masked != "nan":
            return None
        shape = tuple(self.batch) + (1, self.L, 1)
        pad = self.padded_rows()
        return np.ones(shape, bool) if pad is None else np.broadcast_to(~pad, shape)


def _as_generator(rng):
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, (bool, np.bool_)):
        if rng < 0:
            raise ValueError(f"`rng` should be a non-negative int seed (or a numpy.random.Generator), but got {rng}")
        return np.random.default_rng(int(rng))
    raise TypeError(f"`rng` should be a numpy.random.Generator, an int seed or None, but got {V.describe(rng)}")


def _lengths(x, name):
    """``x`` as an array for :func:`masks.check_lengths` (None stays None): a ``numpy.ma`` array or a ragged list
    is refused here, in the house style, not by NumPy."""
    return None if x is None else V.as_array(x, name, "an integer array of per-batch lengths")


def _dead(lengths, n, batch, own_batch):
    """``(*own_batch, 1, n, 1)`` bool: the positions past ``lengths`` for every batch entry that shares an
    array's memory (an input broadcast over a batch dim is live if any entry there reads it); or None."""
    if lengths is None:
        return None
    dead = np.broadcast_to(np.arange(n) >= lengths[..., None], tuple(batch) + (n,))
    off = len(batch) - len(own_batch)
    shared = tuple(i for i in range(len(batch)) if i < off or own_batch[i - off] == 1)
    if shared:
        dead = np.all(dead, axis=shared, keepdims=True)
    dead = dead.reshape(dead.shape[off:])                  # the leading dims the array lacks are 1 now
    dead = dead.reshape(tuple(own_batch) + (1, n, 1))
    return dead if dead.any() else None


def _own(a, dtype=None, dead=None, writable=False):
    """The problem's own read-only copy of ``a`` (None stays None), 0 where ``dead`` is True.

    ``writable=True`` leaves it writable, for :func:`poison.scrub`; the caller then makes it read-only.

    Nothing the caller does to the arrays it passed in can then change the
    residuals, and no engine can write into them. The cost is one copy of
    each input, small next to the ``L x S`` work (a full-size float mask or
    bias is copied too). Query rows past ``q_lengths`` and keys past
    ``kv_lengths`` (values too, except under ``fully_masked="uniform"``,
    whose empty rows average every value by definition) are set to 0: the
    engines' products multiply them by exact zeros, and ``0 * NaN`` would
    leak whatever the padding holds.
    """
    if a is None:
        return None
    a = np.array(a, dtype=dtype, copy=True)
    if dead is not None:                                   # what is stored there is never read: make it 0
        a[np.broadcast_to(dead, a.shape)] = 0
    if not writable:
        a.setflags(write=False)
    return a

