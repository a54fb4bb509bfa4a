r"""Scaled dot-product attention: forward and hand-derived backward.

Shapes (the legend of the package docstring)::

    query     (..., Hq, L, E)
    key       (..., Hkv, S, E)
    value     (..., Hkv, S, Ev)
    out       (..., Hq, L, Ev)
    attn_mask broadcastable to (..., Hq, L, S)

The symbols follow ``SEMANTICS.md``::

    T      = scale * Q K^T  (+ B for a float mask)     raw scores
    A      = allowed set: bool mask AND causal
    P      = softmax of T over the allowed j of each row, 0 outside A
    P_drop = P * Z / (1 - p)
    O      = P_drop V

and the backward::

    dV = P_drop^T dO
    dP = (dO V^T) * Z / (1 - p)
    D  = rowsum(P * dP)            (== rowsum(dO * O))
    dT = P * (dP - D)
    dB = dT summed to the mask's shape
    dQ = scale * dT K
    dK = scale * dT^T Q

Grouped-query attention is computed without copying K and V: query head
``h = kv * G + g`` reads kv head ``kv``, so the ``G`` query heads of a group
are folded into the row axis, ``(..., Hkv, G*L, E)``. A single matmul against
``(..., Hkv, S, E)`` then gives every head's scores, and the matmuls of the
backward (``P_drop^T dO`` and ``dT^T Q``) sum over the group by contracting
that folded row axis -- which is exactly the "summed over a GQA group" of the
derivation.

Rank-2 input ``(L, E)`` is a single head; the output has the rank of the
highest-rank input, as with ``np.matmul``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np

from . import _validate as V
from .masks import causal_mask

__all__ = [
    "FULLY_MASKED_POLICIES",
    "AttentionGrads",
    "AttentionResiduals",
    "scaled_dot_product_attention",
    "sdpa_forward",
    "sdpa_backward",
]

#: Accepted values of ``fully_masked``; see ``SEMANTICS.md``.
FULLY_MASKED_POLICIES = ("zero", "nan", "uniform")


class AttentionGrads(NamedTuple):
    """Gradients of a loss with respect to the inputs of attention.

    Each has its input's own shape and dtype. ``attn_mask`` is the gradient
    with respect to a float mask (summed to the mask's shape); it is ``None``
    for a bool mask or no mask.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attn_mask: Optional[np.ndarray]


@dataclass(frozen=True)
class AttentionResiduals:
    """What :func:`sdpa_backward` needs, saved by :func:`sdpa_forward`.

    All arrays are in the compute dtype (float64 when ``upcast``). ``q`` is
    in the grouped layout ``(..., Hkv, G*L, E)``; ``probs`` is ``P`` with
    shape ``(..., Hq, L, S)``; ``keep`` is the dropout keep mask ``Z`` that
    was used (``None`` without dropout); ``empty`` marks the rows with no
    allowed key, ``(..., Hq, L, 1)``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    probs: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    keep: Optional[np.ndarray]
    empty: np.ndarray
    scale: float
    dropout_p: float
    fully_masked: str
    mask_shape: Optional[tuple]
    mask_dtype: Optional[np.dtype]
    query_shape: tuple
    key_shape: tuple
    value_shape: tuple
    query_dtype: np.dtype
    key_dtype: np.dtype
    value_dtype: np.dtype
    out_shape: tuple
    out_dtype: np.dtype

    @property
    def dropout_mask(self):
        """The bool keep mask used by the forward, or ``None``."""
        return self.keep


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    dropout_mask=None,
    rng=None,
    fully_masked="zero",
    upcast=True,
):
    r"""Scaled dot-product attention, a drop-in for PyTorch's functional op.

    ``softmax(Q K^T * scale + mask) V`` with exact masking: masked entries
    get probability exactly 0, never a ``-1e9`` approximation.

    Parameters
    ----------
    query : array_like, (..., Hq, L, E)
    key : array_like, (..., Hkv, S, E)
    value : array_like, (..., Hkv, S, Ev)
        Floating arrays (float16, float32 or float64). Leading batch dims
        broadcast as in ``np.matmul``.
    attn_mask : array_like, optional, broadcastable to (..., Hq, L, S)
        Bool: True means the key takes part. Float: added to the scores
        (``-inf`` entries are excluded exactly).
    dropout_p : float, optional
        Dropout probability in ``[0, 1)``, applied to ``P`` after the softmax
        with the scale ``1 / (1 - p)``.
    is_causal : bool, optional
        Keep ``j <= i`` (top-left alignment, as PyTorch). Combined with
        ``attn_mask`` by intersection (PyTorch refuses the combination).
    scale : float, optional
        Score scale; ``1 / sqrt(E)`` by default (1 when ``E == 0``). Must be
        finite and non-zero.
    enable_gqa : bool, optional
        Grouped-query attention: ``Hq % Hkv == 0`` and query head ``h`` reads
        kv head ``h // (Hq // Hkv)`` (``repeat_interleave`` semantics).
    dropout_mask : array_like of bool, optional, broadcastable to (..., Hq, L, S)
        Explicit keep mask ``Z`` (True keeps). Used whenever given, with
        ``P_drop = P * Z / (1 - dropout_p)``.
    rng : numpy.random.Generator or int, optional
        Source of the keep mask when ``dropout_p > 0`` and no
        ``dropout_mask`` is given. ``None`` draws fresh OS entropy.
    fully_masked : {"zero", "nan", "uniform"}, optional
        What a row with no allowed key gets: zeros (PyTorch >= 2.5,
        FlashAttention), NaN (textbook, xformers) or the mean of ``V`` over
        all ``S`` keys (JAX). See ``SEMANTICS.md``.
    upcast : bool, optional
        Compute in float64 and return the inputs' dtype (default), or compute
        in the inputs' own dtype to stand in for a low-precision kernel.

    Returns
    -------
    out : ndarray, (..., Hq, L, Ev)

    See Also
    --------
    sdpa_forward, sdpa_backward
    """
    out, _ = sdpa_forward(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        dropout_mask=dropout_mask, rng=rng, fully_masked=fully_masked, upcast=upcast,
    )
    return out


def sdpa_forward(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    dropout_mask=None,
    rng=None,
    fully_masked="zero",
    upcast=True,
):
    r"""Attention forward that also returns what the backward needs.

    Takes the arguments of :func:`scaled_dot_product_attention`.

    Returns
    -------
    out : ndarray, (..., Hq, L, Ev)
        In the inputs' floating dtype.
    residuals : AttentionResiduals
        Includes ``P``, the dropout keep mask that was used and the
        per-row log-sum-exp ``lse`` ``(..., Hq, L)`` of the allowed scores.

    Notes
    -----
    With :math:`A` the allowed set (bool mask, causal, and float-mask
    entries that are not ``-inf``),

    .. math::

        T &= s\,Q K^T + B, \qquad
        m_i = \max_{j \in A_i} T_{ij}, \\
        P_{ij} &= \frac{[j \in A_i]\, e^{T_{ij} - m_i}}{\sum_{k \in A_i} e^{T_{ik} - m_i}},
        \qquad O = \frac{P \odot Z}{1 - p} V.

    Excluded entries are set to :math:`-\infty` before the shift, so their
    exponential is exactly 0. A row with :math:`A_i = \emptyset` follows the
    ``fully_masked`` policy, and its :math:`\mathrm{lse}_i = -\infty`.
    """
    prob = _Problem.build(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        dropout_mask, rng, fully_masked, upcast,
    )
    return _forward(prob)


def sdpa_backward(residuals, grad_out):
    r"""Gradients of attention by the hand-derived backward.

    Parameters
    ----------
    residuals : AttentionResiduals
        From :func:`sdpa_forward`.
    grad_out : array_like, (..., Hq, L, Ev)
        Cotangent ``dO`` of the output.

    Returns
    -------
    AttentionGrads
        ``(query, key, value, attn_mask)``; each summed back to its input's
        shape (broadcast batch dims, a broadcast mask, and the GQA group)
        and cast to its input's dtype.

    Notes
    -----
    Reverse through :math:`O = P_{drop} V`:
    :math:`dV = P_{drop}^T dO` and :math:`dP_{drop} = dO\,V^T`. Dropout is
    element-wise, :math:`dP = dP_{drop} \odot Z / (1 - p)`.

    Each row of :math:`P` is a softmax of :math:`T_i`, whose Jacobian is
    :math:`\operatorname{diag}(P_i) - P_i P_i^T`, so

    .. math::

        dT_i = P_i \odot (dP_i - D_i), \qquad D_i = \sum_j P_{ij}\, dP_{ij}.

    Masked entries have :math:`P_{ij} = 0` and so :math:`dT_{ij} = 0`. The
    float mask is added to :math:`T`, so :math:`dB = dT`. Finally
    :math:`T = s\,Q K^T` gives :math:`dQ = s\, dT\, K` and
    :math:`dK = s\, dT^T Q`.

    Fully masked rows: under ``"zero"`` :math:`P_i = 0`, so every
    contribution of the row is 0. Under ``"uniform"`` the row's
    probabilities do not depend on the scores, so :math:`dT_i = 0` while
    :math:`dV` receives :math:`dO_i / S` from it. Under ``"nan"`` the
    formulas are evaluated as written in IEEE arithmetic: :math:`dQ_i` and
    :math:`dB_i` are NaN, and since :math:`P_{drop}^T dO` and
    :math:`dT^T Q` contract over the row, so are :math:`dK` and :math:`dV`
    of the kv head it reads (the textbook / xformers behaviour).
    """
    if not isinstance(residuals, AttentionResiduals):
        raise TypeError(
            f"`residuals` should be the AttentionResiduals returned by sdpa_forward, "
            f"but got {V.describe(residuals)}"
        )
    r = residuals
    g = V.as_float_array(grad_out, "grad_out")
    if g.shape != r.out_shape:
        raise ValueError(f"`grad_out` should have the output's shape {r.out_shape}, but got shape {g.shape}")
    ct = r.probs.dtype
    P = r.probs                                   # (..., Hq, L, S)
    full = P.shape
    Hq, L = full[-3], full[-2]
    Hkv = r.k.shape[-3]
    G = Hq // Hkv if Hkv else 1
    grouped = full[:-3] + (Hkv, G * L)            # (..., Hkv, G*L, ·)
    dO = g.astype(ct, copy=False).reshape(grouped + (g.shape[-1],))

    P_drop = _apply_dropout(P, r.keep, r.dropout_p)
    # dV = P_drop^T dO, summed over the group by the folded row axis
    dv = _swap(P_drop.reshape(grouped + (full[-1],))) @ dO
    # dP = (dO V^T) * Z / (1 - p)
    dP = (dO @ _swap(r.v)).reshape(full)
    dP = _apply_dropout(dP, r.keep, r.dropout_p)
    # dT = P * (dP - D), D = rowsum(P * dP)
    D = np.sum(P * dP, axis=-1, keepdims=True)
    dT = P * (dP - D)
    if r.fully_masked == "uniform":
        dT = np.where(r.empty, 0.0, dT)
    dmask = None
    if r.mask_shape is not None:
        dmask = _unbroadcast(dT, r.mask_shape).astype(r.mask_dtype, copy=False)
    dTg = dT.reshape(grouped + (full[-1],))
    dq = r.scale * (dTg @ r.k)                    # (..., Hkv, G*L, E)
    dk = r.scale * (_swap(dTg) @ r.q)             # (..., Hkv, S, E)
    dq = dq.reshape(full[:-1] + (dq.shape[-1],))
    return AttentionGrads(
        query=_unbroadcast(dq, r.query_shape).astype(r.query_dtype, copy=False),
        key=_unbroadcast(dk, r.key_shape).astype(r.key_dtype, copy=False),
        value=_unbroadcast(dv, r.value_shape).astype(r.value_dtype, copy=False),
        attn_mask=dmask,
    )


# ------------------------------------------------------------ internals


@dataclass
class _Problem:
    """Validated inputs, as arrays in the compute dtype, plus shapes."""

    q: np.ndarray          # (..., Hkv, G*L, E), compute dtype
    k: np.ndarray          # (..., Hkv, S, E)
    v: np.ndarray          # (..., Hkv, S, Ev)
    mask: Optional[np.ndarray]
    is_causal: bool
    scale: float
    dropout_p: float
    keep: Optional[np.ndarray]
    fully_masked: str
    full_scores: tuple     # (*batch, Hq, L, S)
    user_ndim: int
    shapes: dict
    dtypes: dict
    out_dtype: np.dtype

    @classmethod
    def build(cls, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
              dropout_mask, rng, fully_masked, upcast, *, allow_complex=False):
        q = V.as_float_array(query, "query", min_ndim=2, allow_complex=allow_complex)
        k = V.as_float_array(key, "key", min_ndim=2, allow_complex=allow_complex)
        v = V.as_float_array(value, "value", min_ndim=2, allow_complex=allow_complex)
        is_causal = _check_bool(is_causal, "is_causal")
        enable_gqa = _check_bool(enable_gqa, "enable_gqa")
        upcast = _check_bool(upcast, "upcast")
        V.check_choice(fully_masked, "fully_masked", FULLY_MASKED_POLICIES)

        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"`key` should have the last dim E={q.shape[-1]} of `query` {q.shape}, but got shape {k.shape}"
            )
        if k.shape[-2] != v.shape[-2]:
            raise ValueError(
                f"`value` should have the S={k.shape[-2]} rows of `key` {k.shape}, but got shape {v.shape}"
            )
        qh = q if q.ndim > 2 else q[None]
        kh = k if k.ndim > 2 else k[None]
        vh = v if v.ndim > 2 else v[None]
        Hq, L, E = qh.shape[-3:]
        Hkv, S, Ev = kh.shape[-3], kh.shape[-2], vh.shape[-1]
        if vh.shape[-3] != Hkv:
            raise ValueError(
                f"`value` should have the Hkv={Hkv} heads of `key` {k.shape}, but got shape {v.shape}"
            )
        if enable_gqa:
            if Hkv == 0 or Hq % Hkv != 0:
                raise ValueError(
                    f"`key` should have a head count Hkv that divides Hq={Hq} of `query` "
                    f"(enable_gqa=True), but got Hkv={Hkv}"
                )
        elif Hq != Hkv:
            raise ValueError(
                f"`key` should have the Hq={Hq} heads of `query` when enable_gqa=False, "
                f"but got Hkv={Hkv}; pass enable_gqa=True for grouped-query attention"
            )
        batch = V.broadcast_batch({"query": qh.shape[:-3], "key": kh.shape[:-3], "value": vh.shape[:-3]})
        full_scores = batch + (Hq, L, S)
        user_ndim = max(q.ndim, k.ndim, v.ndim)
        user_scores = full_scores[len(full_scores) - user_ndim:]

        if scale is None:
            scale = 1.0 / np.sqrt(E) if E > 0 else 1.0
        else:
            scale = V.as_real_scalar(scale, "scale")
            if not np.isfinite(scale) or scale == 0.0:
                raise ValueError(f"`scale` should be finite and non-zero, but got {scale!r}")

        mask = None
        if attn_mask is not None:
            mask = V.as_mask(attn_mask, "attn_mask", user_scores)

        dropout_p = V.as_real_scalar(dropout_p, "dropout_p")
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"`dropout_p` should be in [0, 1), but got {dropout_p!r}")
        keep = None
        if dropout_mask is not None:
            keep = V.as_mask(dropout_mask, "dropout_mask", user_scores, allow_float=False)
        elif dropout_p > 0.0:
            gen = _as_generator(rng)
            keep = gen.random(user_scores) >= dropout_p

        if fully_masked == "uniform" and S == 0:
            raise ValueError(
                "`fully_masked` should not be 'uniform' when S == 0 (the mean of zero values "
                "is undefined), but got S=0"
            )

        out_dtype = np.result_type(q.dtype, k.dtype, v.dtype)
        ct = np.result_type(out_dtype, np.float64) if upcast else out_dtype
        G = Hq // Hkv if Hkv else 1
        qg = qh.astype(ct, copy=False).reshape(qh.shape[:-3] + (Hkv, G * L, E))
        shapes = {"query": q.shape, "key": k.shape, "value": v.shape}
        dtypes = {"query": q.dtype, "key": k.dtype, "value": v.dtype}
        return cls(
            q=qg, k=kh.astype(ct, copy=False), v=vh.astype(ct, copy=False),
            mask=mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p, keep=keep,
            fully_masked=fully_masked, full_scores=full_scores, user_ndim=user_ndim,
            shapes=shapes, dtypes=dtypes, out_dtype=out_dtype,
        )


def _forward(prob: _Problem):
    full = prob.full_scores
    batch, (Hq, L, S) = full[:-3], full[-3:]
    Hkv = prob.k.shape[-3]
    ct = prob.q.dtype
    # T = scale * Q K^T, all heads of a group at once
    T = ((prob.scale * prob.q) @ _swap(prob.k)).reshape(full)
    allowed = None
    if prob.mask is not None:
        if prob.mask.dtype == bool:
            allowed = prob.mask
        else:
            T = T + prob.mask.astype(ct, copy=False)
    if prob.is_causal:
        cm = causal_mask(L, S)
        allowed = cm if allowed is None else (allowed & cm)
    if allowed is not None:
        T = np.where(allowed, T, -np.inf)
    # Stable softmax over the allowed entries; -inf entries give exactly 0.
    m = np.max(T.real, axis=-1, keepdims=True, initial=-np.inf)
    empty = m == -np.inf                              # rows with no allowed key
    m = np.where(empty, 0.0, m)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        e = np.exp(T - m)
        s = np.sum(e, axis=-1, keepdims=True)
        P = e / s
        lse = np.log(s) + m
    if np.any(empty):
        fill = {"zero": 0.0, "nan": np.nan, "uniform": 1.0 / S if S else np.nan}[prob.fully_masked]
        P = np.where(empty, fill, P)
    P = P.astype(ct, copy=False)
    P_drop = _apply_dropout(P, prob.keep, prob.dropout_p)
    G = Hq // Hkv if Hkv else 1
    grouped = batch + (Hkv, G * L, S)
    O = (P_drop.reshape(grouped) @ prob.v).reshape(full[:-1] + (prob.v.shape[-1],))
    if prob.fully_masked == "nan" and S == 0:
        O = np.full_like(O, np.nan)       # an empty sum would give 0, not the policy's NaN
    out_shape = O.shape[O.ndim - prob.user_ndim:]
    O = O.reshape(out_shape)
    mask_shape = mask_dtype = None
    if prob.mask is not None and prob.mask.dtype != bool:
        mask_shape, mask_dtype = prob.mask.shape, prob.mask.dtype
    res = AttentionResiduals(
        q=prob.q, k=prob.k, v=prob.v, probs=P, out=O,
        lse=lse[..., 0].reshape(out_shape[:-1]),
        keep=prob.keep, empty=empty, scale=prob.scale, dropout_p=prob.dropout_p,
        fully_masked=prob.fully_masked, mask_shape=mask_shape, mask_dtype=mask_dtype,
        query_shape=prob.shapes["query"], key_shape=prob.shapes["key"], value_shape=prob.shapes["value"],
        query_dtype=prob.dtypes["query"], key_dtype=prob.dtypes["key"], value_dtype=prob.dtypes["value"],
        out_shape=out_shape, out_dtype=prob.out_dtype,
    )
    return O.astype(prob.out_dtype, copy=False), res


def _apply_dropout(x, keep, p):
    """``x * Z / (1 - p)``; the identity without a keep mask."""
    if keep is None:
        return x
    # A multiply, not np.where, so that NaN rows stay NaN as the formula says.
    return x * (keep.astype(x.real.dtype) * x.real.dtype.type(1.0 / (1.0 - p)))


def _swap(x):
    return np.swapaxes(x, -1, -2)


def _unbroadcast(g, shape):
    """Sum ``g`` down to ``shape``, undoing NumPy broadcasting."""
    shape = tuple(shape)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def _check_bool(x, name):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"`{name}` should be a bool, but got {V.describe(x)}")
    return bool(x)


def _as_generator(rng):
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, (bool, np.bool_)):
        return np.random.default_rng(int(rng))
    raise TypeError(f"`rng` should be a numpy.random.Generator, an int seed or None, but got {V.describe(rng)}")
