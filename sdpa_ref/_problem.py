"""One attention problem: validated inputs, the allowed set, and the scores.

:class:`Problem` is built once, at the public entry point, from the user's
arguments; everything numerical downstream (the forward, both backwards, the
JVP) reads from it, so they all see exactly the same scores and masks.

The scores follow ``SEMANTICS.md``::

    Traw = scale * Q K^T
    T    = cap * tanh(Traw / cap)          (softcap)
    T    = T + attn_mask(float) + bias + ALiBi
    A    = bool mask AND causal AND window AND j < kv_len AND i < q_len

and are set to ``-inf`` outside ``A``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import _validate as V
from .masks import ALIGNMENTS

__all__ = ["FULLY_MASKED_POLICIES", "Problem", "Scores"]

#: Accepted values of ``fully_masked``; see ``SEMANTICS.md``.
FULLY_MASKED_POLICIES = ("zero", "nan", "uniform")


@dataclass(frozen=True)
class Scores:
    """The masked scores of a problem and what the backward needs of them."""

    T: np.ndarray                   # (*batch, Hq, L, S), -inf outside the allowed set
    tanh: Optional[np.ndarray]      # tanh(Traw / cap) with softcap, else None
    empty: np.ndarray               # (*batch, Hq, L, 1): rows with no allowed key
    padded: Optional[np.ndarray]    # (*batch, 1, L, 1): query rows i >= q_len, or None


@dataclass(frozen=True)
class Problem:
    """Validated inputs in the compute dtype, the options, and the shapes."""

    q: np.ndarray                   # (..., Hkv, G*L, E): query heads of a group folded into rows
    k: np.ndarray                   # (..., Hkv, S, E)
    v: np.ndarray                   # (..., Hkv, S, Ev)
    mask_bool: Optional[np.ndarray]
    mask_float: Optional[np.ndarray]
    bias: Optional[np.ndarray]
    is_causal: bool
    alignment: str
    window: Optional[Tuple[Optional[int], Optional[int]]]
    softcap: Optional[float]
    alibi: Optional[np.ndarray]     # (..., Hq, 1, 1) slopes
    q_lengths: Optional[np.ndarray]
    kv_lengths: Optional[np.ndarray]
    scale: float
    dropout_p: float
    keep: Optional[np.ndarray]
    fully_masked: str
    full_scores: tuple              # (*batch, Hq, L, S)
    user_ndim: int
    shapes: dict
    dtypes: dict
    out_dtype: np.dtype

    # ------------------------------------------------------------ build

    @classmethod
    def build(cls, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, dropout_mask=None, rng=None, fully_masked="zero", upcast=True,
              bias=None, causal_alignment="top_left", window=None, softcap=None, alibi_slopes=None,
              q_lengths=None, kv_lengths=None, complex_ok=False):
        """Validate the user's arguments once; every error names its argument."""
        q = V.as_float_array(query, "query", min_ndim=2, allow_complex=complex_ok)
        k = V.as_float_array(key, "key", min_ndim=2, allow_complex=complex_ok)
        v = V.as_float_array(value, "value", min_ndim=2, allow_complex=complex_ok)
        is_causal = _check_bool(is_causal, "is_causal")
        enable_gqa = _check_bool(enable_gqa, "enable_gqa")
        upcast = _check_bool(upcast, "upcast")
        V.check_choice(fully_masked, "fully_masked", FULLY_MASKED_POLICIES)
        V.check_choice(causal_alignment, "causal_alignment", ALIGNMENTS)

        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"`key` should have the last dim E={q.shape[-1]} of `query` {q.shape}, but got shape {k.shape}")
        if k.shape[-2] != v.shape[-2]:
            raise ValueError(
                f"`value` should have the S={k.shape[-2]} rows of `key` {k.shape}, but got shape {v.shape}")
        qh = q if q.ndim > 2 else q[None]
        kh = k if k.ndim > 2 else k[None]
        vh = v if v.ndim > 2 else v[None]
        Hq, L, E = qh.shape[-3:]
        Hkv, S = kh.shape[-3], kh.shape[-2]
        if vh.shape[-3] != Hkv:
            raise ValueError(f"`value` should have the Hkv={Hkv} heads of `key` {k.shape}, but got shape {v.shape}")
        if enable_gqa:
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

        if scale is None:
            scale = float(1.0 / np.sqrt(E)) if E > 0 else 1.0
        else:
            scale = V.as_real_scalar(scale, "scale")
            if not np.isfinite(scale) or scale == 0.0:
                raise ValueError(f"`scale` should be finite and non-zero, but got {scale!r}")

        mask_bool = mask_float = None
        if attn_mask is not None:
            m = V.as_mask(attn_mask, "attn_mask", user_scores, allow_complex=complex_ok)
            if m.dtype == bool:
                mask_bool = m
            else:
                mask_float = m
        if bias is not None:
            bias = V.as_mask(bias, "bias", user_scores, allow_complex=complex_ok)
            if bias.dtype == bool:
                raise TypeError("`bias` should have a floating dtype (it is added to the scores), but got dtype bool; "
                                "pass a bool mask as `attn_mask`")

        window = _check_window(window)
        if softcap is not None:
            softcap = V.as_real_scalar(softcap, "softcap")
            if not (np.isfinite(softcap) and softcap > 0):
                raise ValueError(f"`softcap` should be a finite number > 0, but got {softcap!r}")

        alibi = None
        if alibi_slopes is not None:
            s = V.as_float_array(alibi_slopes, "alibi_slopes", min_ndim=1)
            try:
                ok = s.shape[-1] == Hq and np.broadcast_shapes(s.shape[:-1], batch) == batch
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"`alibi_slopes` should have shape (Hq,) = ({Hq},) or (..., Hq) broadcasting to "
                                 f"{batch + (Hq,)}, but got shape {s.shape}")
            alibi = s[..., None, None]

        q_lengths = _check_lengths(q_lengths, "q_lengths", L, batch)
        kv_lengths = _check_lengths(kv_lengths, "kv_lengths", S, batch)

        dropout_p = V.as_real_scalar(dropout_p, "dropout_p")
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"`dropout_p` should be in [0, 1), but got {dropout_p!r}")
        keep = None
        if dropout_mask is not None:
            keep = V.as_mask(dropout_mask, "dropout_mask", user_scores, allow_float=False)
        elif dropout_p > 0.0:
            keep = _as_generator(rng).random(user_scores) >= dropout_p

        if fully_masked == "uniform" and S == 0:
            raise ValueError("`fully_masked` should not be 'uniform' when S == 0 (the mean of zero values "
                             "is undefined), but got S=0")

        if complex_ok:
            out_dtype = np.dtype(np.complex128)
        else:
            out_dtype = np.result_type(q.dtype, k.dtype, v.dtype)
        ct = np.result_type(out_dtype, np.float64) if (upcast or complex_ok) else out_dtype
        G = Hq // Hkv if Hkv else 1
        cast = lambda a: None if a is None else a.astype(ct, copy=False)  # noqa: E731
        return cls(
            q=qh.astype(ct, copy=False).reshape(qh.shape[:-3] + (Hkv, G * L, E)),
            k=kh.astype(ct, copy=False), v=vh.astype(ct, copy=False),
            mask_bool=mask_bool, mask_float=cast(mask_float), bias=cast(bias),
            is_causal=is_causal, alignment=causal_alignment, window=window, softcap=softcap,
            alibi=None if alibi is None else alibi.astype(ct.type(0).real.dtype, copy=False),
            q_lengths=q_lengths, kv_lengths=kv_lengths, scale=scale, dropout_p=dropout_p, keep=keep,
            fully_masked=fully_masked, full_scores=full_scores, user_ndim=user_ndim,
            shapes={"query": q.shape, "key": k.shape, "value": v.shape,
                    "attn_mask": None if mask_float is None else mask_float.shape,
                    "bias": None if bias is None else bias.shape},
            dtypes={"query": q.dtype, "key": k.dtype, "value": v.dtype,
                    "attn_mask": None if mask_float is None else mask_float.dtype,
                    "bias": None if bias is None else bias.dtype},
            out_dtype=out_dtype,
        )

    # ----------------------------------------------------------- shapes

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def batch(self):
        return self.full_scores[:-3]

    @property
    def grouped(self):
        """``(*batch, Hkv, G*L)``: the leading shape of the grouped layout."""
        Hq, L = self.full_scores[-3], self.full_scores[-2]
        Hkv = self.k.shape[-3]
        return self.batch + (Hkv, (Hq // Hkv if Hkv else 1) * L)

    @property
    def out_shape(self):
        full = self.full_scores[:-1] + (self.v.shape[-1],)
        return full[len(full) - self.user_ndim:]

    # ----------------------------------------------------------- scores

    def offset(self):
        """The diagonal offset ``off``: 0, ``S - L``, or per batch ``kv_len - q_len``; shape ``(*batch, 1, 1, 1)`` or scalar."""
        if self.alignment == "top_left":
            return 0
        L, S = self.full_scores[-2:]
        if self.q_lengths is None and self.kv_lengths is None:
            return S - L
        ql = L if self.q_lengths is None else self.q_lengths
        kl = S if self.kv_lengths is None else self.kv_lengths
        off = np.asarray(kl, dtype=np.int64) - np.asarray(ql, dtype=np.int64)
        return off.reshape(off.shape + (1, 1, 1))

    def allowed(self, rows=None, cols=None):
        """The structural allowed set (bool mask, causal, window, lengths), or None when unrestricted.

        ``rows`` / ``cols`` are ``(start, stop)`` ranges of query and key
        positions (the tiled path asks for one block); the default is all.
        """
        L, S = self.full_scores[-2:]
        i0, i1 = rows if rows is not None else (0, L)
        j0, j1 = cols if cols is not None else (0, S)
        i = np.arange(i0, i1)[:, None]
        j = np.arange(j0, j1)[None, :]
        off = self.offset()
        parts = []
        if self.mask_bool is not None:
            parts.append(slice_ls(self.mask_bool, i0, i1, j0, j1))
        left, right = self.window if self.window is not None else (None, None)
        if self.is_causal:
            right = 0 if right is None else min(right, 0)
        if left is not None:
            parts.append(j >= i + off - left)
        if right is not None:
            parts.append(j <= i + off + right)
        if self.kv_lengths is not None:
            parts.append(j < self.kv_lengths.reshape(self.kv_lengths.shape + (1, 1, 1)))
        if self.q_lengths is not None:
            parts.append(i < self.q_lengths.reshape(self.q_lengths.shape + (1, 1, 1)))
        if not parts:
            return None
        out = parts[0]
        for p in parts[1:]:
            out = out & p
        return out

    def padded_rows(self):
        """``(*batch, 1, L, 1)`` bool: query rows past ``q_len``, or None."""
        if self.q_lengths is None:
            return None
        L = self.full_scores[-2]
        return np.arange(L)[:, None] >= self.q_lengths.reshape(self.q_lengths.shape + (1, 1, 1))

    def alibi_distance(self, rows=None, cols=None):
        """``|i + off - j|``, broadcastable to the scores (or to one block of them)."""
        L, S = self.full_scores[-2:]
        i0, i1 = rows if rows is not None else (0, L)
        j0, j1 = cols if cols is not None else (0, S)
        return np.abs(np.arange(i0, i1)[:, None] + self.offset() - np.arange(j0, j1)[None, :])

    def alibi_bias(self, rows=None, cols=None):
        """``-slope * |i + off - j|``, broadcastable to the scores (or to one block of them)."""
        return -self.alibi * self.alibi_distance(rows, cols)

    def raw_scores(self):
        """``Traw = scale * Q K^T`` in the full layout ``(*batch, Hq, L, S)``."""
        T = (self.scale * self.q) @ np.swapaxes(self.k, -1, -2)
        T = T.reshape(T.shape[:-3] + self.full_scores[-3:])
        if T.shape != self.full_scores:       # a batch dim that only `value` has
            T = np.broadcast_to(T, self.full_scores)
        return T

    def scores(self) -> Scores:
        """The masked scores ``T`` (``-inf`` outside the allowed set) and their by-products."""
        T = self.raw_scores()
        th = None
        if self.softcap is not None:
            th = np.tanh(T / self.softcap)
            T = self.softcap * th
        if self.mask_float is not None:
            T = T + self.mask_float
        if self.bias is not None:
            T = T + self.bias
        if self.alibi is not None:
            T = T + self.alibi_bias()
        allowed = self.allowed()
        if allowed is not None:
            T = np.where(allowed, T, -np.inf)
        m = np.max(T.real, axis=-1, keepdims=True, initial=-np.inf)
        empty = m == -np.inf
        return Scores(T=T, tanh=th, empty=empty, padded=self.padded_rows())


# ---------------------------------------------------------------- helpers


def slice_ls(a, i0, i1, j0, j1):
    """Rows ``i0:i1`` and columns ``j0:j1`` of an array broadcastable to (..., L, S)."""
    if a.ndim < 2:
        a = a.reshape((1,) * (2 - a.ndim) + a.shape)
    rows = slice(None) if a.shape[-2] == 1 else slice(i0, i1)
    cols = slice(None) if a.shape[-1] == 1 else slice(j0, j1)
    return a[..., rows, cols]


def _check_bool(x, name):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"`{name}` should be a bool, but got {V.describe(x)}")
    return bool(x)


def _check_window(window):
    if window is None:
        return None
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(f"`window` should be a pair (left, right) of ints >= 0, -1 or None, but got {window!r}")
    out = []
    for side, b in zip(("left", "right"), window):
        if b is None:
            out.append(None)
            continue
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (numbers.Integral, np.integer)):
            raise TypeError(f"`window` {side} bound should be an int >= 0, -1 or None, but got {b!r}")
        if b == -1:
            out.append(None)
        elif b < 0:
            raise ValueError(f"`window` {side} bound should be >= 0 (or -1 / None for unbounded), but got {b}")
        else:
            out.append(int(b))
    return tuple(out)


def _check_lengths(x, name, limit, batch):
    if x is None:
        return None
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"`{name}` should be an integer array of per-batch lengths, but got dtype {arr.dtype}")
    try:
        ok = np.broadcast_shapes(arr.shape, batch) == batch
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"`{name}` should have a shape that broadcasts to the batch shape {batch}, "
                         f"but got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > limit):
        raise ValueError(f"`{name}` should hold lengths in [0, {limit}], but got values from "
                         f"{arr.min()} to {arr.max()}")
    return arr.astype(np.int64)


def _as_generator(rng):
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, (bool, np.bool_)):
        return np.random.default_rng(int(rng))
    raise TypeError(f"`rng` should be a numpy.random.Generator, an int seed or None, but got {V.describe(rng)}")
