r"""Scaled dot-product attention: forward, two hand-derived backwards, and the JVP.

Shapes (the legend of the package docstring)::

    query     (..., Hq, L, E)
    key       (..., Hkv, S, E)
    value     (..., Hkv, S, Ev)
    out       (..., Hq, L, Ev)
    attn_mask, bias, dropout_mask   broadcastable to (..., Hq, L, S)
    alibi_slopes (Hq,) or (..., Hq);  q_lengths, kv_lengths (...)

The symbols follow ``SEMANTICS.md``::

    Traw   = scale * Q K^T                          raw scores
    T      = cap * tanh(Traw / cap)                 only with softcap
    T      = T + B                                  float mask, bias, ALiBi
    A      = bool mask AND causal AND window AND lengths
    P      = softmax of T over the allowed j of each row, 0 outside A
    P_drop = P * Z / (1 - p)
    O      = P_drop V
    LSE    = log sum_{j in A} exp(T_ij)

and the backward::

    dV     = P_drop^T dO
    dP     = (dO V^T) * Z / (1 - p)
    D      = rowsum(P * dP)       (== rowsum(dO * O))
    dT     = P * (dP - D)
    dB     = dT summed to the mask's / bias's shape
    dTraw  = dT * (1 - tanh^2(Traw / cap))          only with softcap
    dQ     = scale * dTraw K
    dK     = scale * dTraw^T Q

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
from ._problem import FULLY_MASKED_POLICIES, Problem, Scores
from .fast import fast_backward, fast_forward
from .tiled import check_block_size, tiled_backward, tiled_forward

__all__ = [
    "FULLY_MASKED_POLICIES",
    "BACKWARD_METHODS",
    "AttentionGrads",
    "AttentionResiduals",
    "scaled_dot_product_attention",
    "sdpa_forward",
    "sdpa_backward",
    "sdpa_jvp",
    "sdpa_forward_complex",
]

#: Accepted values of ``sdpa_backward(..., method=)``.
BACKWARD_METHODS = ("probs", "lse", "plain")
#: Accepted values of ``sdpa_forward(..., method=)``.
FORWARD_METHODS = ("fast", "plain")


class AttentionGrads(NamedTuple):
    """Gradients of a loss with respect to the inputs of attention.

    Each has its input's own shape and dtype. ``attn_mask`` is the gradient
    with respect to a float mask, ``bias`` with respect to ``bias`` (each
    summed to its own shape); ``None`` where there is no such float input.
    """

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    attn_mask: Optional[np.ndarray]
    bias: Optional[np.ndarray] = None


@dataclass(frozen=True)
class AttentionResiduals:
    """What :func:`sdpa_backward` needs, saved by :func:`sdpa_forward`.

    ``problem`` holds the validated inputs and options; ``probs`` is ``P``
    ``(..., Hq, L, S)`` (``None`` with ``save_probs=False``, when only the
    ``"lse"`` backward is possible); ``out`` is the output and ``lse`` the
    log-sum-exp ``(..., Hq, L)``, both in the compute dtype.
    """

    problem: Problem
    probs: Optional[np.ndarray]
    out: np.ndarray
    lse: np.ndarray
    tanh: Optional[np.ndarray]
    empty: np.ndarray
    padded: Optional[np.ndarray]
    block_size: Optional[int] = None

    @property
    def dropout_mask(self):
        """The bool keep mask ``Z`` used by the forward, or ``None``."""
        return self.problem.keep

    @property
    def keep(self):
        return self.problem.keep

    @property
    def scale(self):
        return self.problem.scale

    @property
    def dropout_p(self):
        return self.problem.dropout_p

    @property
    def v(self):
        return self.problem.v


_DOC_OPTIONS = r"""
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
        Keep ``j <= i + off`` (see ``causal_alignment``). Combined with the
        other masks by intersection (PyTorch refuses mask + causal).
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
        all ``S`` keys (JAX). Query rows past ``q_lengths`` are zeros under
        every policy.
    upcast : bool, optional
        Compute in float64 and return the inputs' dtype (default), or compute
        in the inputs' own dtype to stand in for a low-precision kernel.
    bias : array_like, optional, broadcastable to (..., Hq, L, S)
        Float additive bias, separate from ``attn_mask`` (so a bool mask and
        a bias can be given together); has its own gradient.
    causal_alignment : {"top_left", "bottom_right"}, optional
        Offset of the diagonal for ``is_causal``, ``window`` and ALiBi:
        ``off = 0`` (PyTorch, JAX) or ``off = S - L`` (FlashAttention,
        xformers); with per-batch lengths ``kv_len - q_len``.
    window : (int or None, int or None), optional
        Sliding window ``(left, right)``, inclusive: keeps
        ``i + off - left <= j <= i + off + right``; ``None`` or ``-1`` is
        unbounded on that side. ``(None, 0)`` is causal.
    softcap : float > 0, optional
        Scores become ``cap * tanh(scores / cap)`` after scaling, before the
        mask, bias and ALiBi.
    alibi_slopes : array_like, (Hq,) or (..., Hq), optional
        Adds ``-slope * |i + off - j|`` to the scores, as FlashAttention.
    q_lengths, kv_lengths : array_like of int, (...), optional
        Per-batch valid lengths. Keys ``j >= kv_len`` are excluded; query
        rows ``i >= q_len`` are zeroed in the output and every gradient."""


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
    dropout_mask=None, rng=None, fully_masked="zero", upcast=True, bias=None, causal_alignment="top_left",
    window=None, softcap=None, alibi_slopes=None, q_lengths=None, kv_lengths=None, return_lse=False,
    block_size=None,
):
    r"""Scaled dot-product attention, a drop-in for PyTorch's functional op.

    ``softmax(Q K^T * scale + mask) V`` with exact masking: masked entries
    get probability exactly 0, never a ``-1e9`` approximation. The
    positional arguments are PyTorch's; the keyword-only ones reproduce
    FlashAttention, JAX and xformers (see the README's table).

    Parameters
    ----------%s
    return_lse : bool, optional
        Also return the per-row log-sum-exp of the allowed scores.
    block_size : int or "auto", optional
        Run the tiled (FlashAttention) algorithm in bounded memory; see
        :func:`sdpa_forward`.

    Returns
    -------
    out : ndarray, (..., Hq, L, Ev)
    lse : ndarray, (..., Hq, L)
        Only with ``return_lse=True``; ``-inf`` on rows with no allowed key.

    See Also
    --------
    sdpa_forward, sdpa_backward, sdpa_jvp
    """
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"`return_lse` should be a bool, but got {V.describe(return_lse)}")
    out, res = sdpa_forward(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        dropout_mask=dropout_mask, rng=rng, fully_masked=fully_masked, upcast=upcast, bias=bias,
        causal_alignment=causal_alignment, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        q_lengths=q_lengths, kv_lengths=kv_lengths, save_probs=False, block_size=block_size,
    )
    if return_lse:
        return out, res.lse.astype(res.problem.out_dtype, copy=False)
    return out


def sdpa_forward(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
    dropout_mask=None, rng=None, fully_masked="zero", upcast=True, bias=None, causal_alignment="top_left",
    window=None, softcap=None, alibi_slopes=None, q_lengths=None, kv_lengths=None, save_probs=True,
    block_size=None, method="fast",
):
    r"""Attention forward that also returns what the backward needs.

    Parameters
    ----------%s
    save_probs : bool, optional
        Keep ``P`` in the residuals (default) for the teaching backward; with
        False only ``(out, lse)`` are kept and ``sdpa_backward`` uses
        ``method="lse"``.
    block_size : int or "auto", optional
        Tiled path: FlashAttention's algorithm over blocks of ``block_size``
        queries by ``block_size`` keys (an online softmax forward, a
        recomputing backward), so that no ``L x S`` array is ever built; peak
        memory is ``O((L + S)(E + Ev) + block_size^2)`` per head. ``"auto"``
        picks a size from L, S and a 64 MiB budget. Every option is
        supported; the residuals then hold only ``(out, lse)``. Agrees with
        the dense path to rounding (tested at 1e-12).
    method : {"fast", "plain"}, optional
        Dense implementation: ``"fast"`` (default; in place, threaded row
        passes, see :mod:`sdpa_ref.fast`) or ``"plain"``, the readable
        reference that the Notes derive. They agree to 1e-14.

    Returns
    -------
    out : ndarray, (..., Hq, L, Ev)
        In the inputs' floating dtype.
    residuals : AttentionResiduals
        Includes ``P``, the dropout keep mask that was used and the per-row
        log-sum-exp ``lse`` ``(..., Hq, L)`` of the allowed scores.

    Notes
    -----
    With :math:`A_i` the allowed keys of row :math:`i` (the structural masks,
    and float entries that are not ``-inf``),

    .. math::

        m_i = \max_{j \in A_i} T_{ij}, \qquad
        P_{ij} = \frac{[j \in A_i]\, e^{T_{ij} - m_i}}{\sum_{k \in A_i} e^{T_{ik} - m_i}},
        \qquad O = \frac{P \odot Z}{1 - p} V.

    Excluded entries are set to :math:`-\infty` before the shift, so their
    exponential is exactly 0. A row with :math:`A_i = \emptyset` follows the
    ``fully_masked`` policy, and its :math:`\mathrm{lse}_i = -\infty`.
    """
    prob = Problem.build(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout_mask=dropout_mask,
        rng=rng, fully_masked=fully_masked, upcast=upcast, bias=bias, causal_alignment=causal_alignment,
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, q_lengths=q_lengths, kv_lengths=kv_lengths,
    )
    if not isinstance(save_probs, (bool, np.bool_)):
        raise TypeError(f"`save_probs` should be a bool, but got {V.describe(save_probs)}")
    V.check_choice(method, "method", FORWARD_METHODS)
    block = check_block_size(block_size, prob)
    if block is not None:
        O, lse, empty, padded = tiled_forward(prob, block)
        O = O.reshape(prob.out_shape)
        res = AttentionResiduals(problem=prob, probs=None, out=O, lse=lse.reshape(prob.out_shape[:-1]),
                                 tanh=None, empty=empty, padded=padded, block_size=block)
        return O.astype(prob.out_dtype, copy=False), res
    if method == "fast":
        O, P, lse, th, empty = fast_forward(prob)
        O = O.reshape(prob.out_shape)
        res = AttentionResiduals(problem=prob, probs=P if save_probs else None, out=O,
                                 lse=lse.reshape(prob.out_shape[:-1]), tanh=th, empty=empty,
                                 padded=prob.padded_rows())
        return O.astype(prob.out_dtype, copy=False), res
    out, res = _forward(prob, save_probs=bool(save_probs))
    return out.astype(prob.out_dtype, copy=False), res


def sdpa_forward_complex(query, key, value, **options):
    r"""The forward on complex input, for complex-step differentiation only.

    Takes the arguments of :func:`sdpa_forward` but accepts complex
    ``query``, ``key``, ``value``, float ``attn_mask`` and ``bias``, and
    returns the complex output without casting. Every operation on the path
    is analytic -- the max-shift is taken from the real part (softmax is
    invariant to any real shift), masks, ALiBi, lengths and dropout are fixed
    patterns, and softcap's ``tanh`` is analytic -- so

    .. math:: f'(x)\,t = \operatorname{Im} f(x + i h t) / h + O(h^2)

    with :math:`h = 10^{-30}` has no subtractive cancellation and is exact to
    rounding. :func:`sdpa_ref.check_vjp` with ``method="complex"`` uses it.
    """
    options.pop("upcast", None)
    prob = Problem.build(query, key, value, complex_ok=True, **options)
    out, _ = _forward(prob, save_probs=False)
    return out


def sdpa_backward(residuals, grad_out, method=None):
    r"""Gradients of attention by the hand-derived backward.

    Parameters
    ----------
    residuals : AttentionResiduals
        From :func:`sdpa_forward`.
    grad_out : array_like, (..., Hq, L, Ev)
        Cotangent ``dO`` of the output.
    method : {"probs", "lse", "plain"}, optional
        ``"probs"`` (the default when ``P`` was saved) uses the saved ``P``,
        computed in place with :math:`D = \mathrm{rowsum}(dO \odot O)`
        (:mod:`sdpa_ref.fast`); ``"plain"`` is the same algorithm written as
        the Notes derive it, with :math:`D = \mathrm{rowsum}(P \odot dP)`,
        the teaching form. ``"lse"`` is FlashAttention's (the default
        otherwise): it keeps only ``(O, lse)``, recomputes
        :math:`P = e^{T - \mathrm{lse}}` from the scores and uses
        :math:`D = \mathrm{rowsum}(dO \odot O)`. They agree to rounding.
        Residuals of the tiled path (``block_size=``) run the same ``"lse"``
        algorithm block by block.

    Returns
    -------
    AttentionGrads
        ``(query, key, value, attn_mask, bias)``; each summed back to its
        input's shape (broadcast batch dims, a broadcast mask, the GQA group)
        and cast to its input's dtype.

    Notes
    -----
    Reverse through :math:`O = P_{drop} V`: :math:`dV = P_{drop}^T dO` and
    :math:`dP_{drop} = dO\,V^T`. Dropout is element-wise,
    :math:`dP = dP_{drop} \odot Z / (1 - p)`.

    Each row of :math:`P` is a softmax of :math:`T_i`, whose Jacobian is
    :math:`\operatorname{diag}(P_i) - P_i P_i^T`, so

    .. math::

        dT_i = P_i \odot (dP_i - D_i), \qquad D_i = \sum_j P_{ij}\, dP_{ij}.

    **The lse method.** :math:`P_{ij} = e^{T_{ij} - \mathrm{lse}_i}` exactly
    (that is what the log-sum-exp normalises), and
    :math:`D_i = \sum_j P_{ij} dP_{ij} = \sum_j P_{drop,ij} (dO_i \cdot v_j)
    = dO_i \cdot O_i`, so ``D`` needs no ``L x S`` product.

    Masked entries have :math:`P_{ij} = 0` and so :math:`dT_{ij} = 0`. The
    float mask, the bias and ALiBi are added to :math:`T`, so
    :math:`dB = dT`. Softcap :math:`T = c \tanh(T_{raw}/c)` gives
    :math:`dT_{raw} = dT \odot (1 - \tanh^2(T_{raw}/c))`. Finally
    :math:`T_{raw} = s\,Q K^T` gives :math:`dQ = s\, dT_{raw} K` and
    :math:`dK = s\, dT_{raw}^T Q`.

    Fully masked rows: under ``"zero"`` :math:`P_i = 0`, so every
    contribution of the row is 0. Under ``"uniform"`` the row's
    probabilities do not depend on the scores, so :math:`dT_i = 0` while
    :math:`dV` receives :math:`dO_i / S` from it. Under ``"nan"`` the
    formulas are evaluated as written in IEEE arithmetic: :math:`dQ_i` and
    :math:`dB_i` are NaN, and since :math:`P_{drop}^T dO` and
    :math:`dT^T Q` contract over the row, so are :math:`dK` and :math:`dV`
    of the kv head it reads (the textbook / xformers behaviour). Padded query
    rows (``i >= q_len``) have :math:`P_i = 0` under every policy.
    """
    if not isinstance(residuals, AttentionResiduals):
        raise TypeError("`residuals` should be the AttentionResiduals returned by sdpa_forward, "
                        f"but got {V.describe(residuals)}")
    r, prob = residuals, residuals.problem
    if method is None:
        method = "probs" if r.probs is not None else "lse"
    V.check_choice(method, "method", BACKWARD_METHODS)
    g = V.as_float_array(grad_out, "grad_out")
    if g.shape != prob.out_shape:
        raise ValueError(f"`grad_out` should have the output's shape {prob.out_shape}, but got shape {g.shape}")
    if method in ("probs", "plain") and r.probs is None:
        raise ValueError("`method` should be 'lse' for residuals saved with save_probs=False or block_size, "
                         f"but got {method!r}")
    if r.block_size is not None:
        return tiled_backward(prob, r.out, r.lse, r.empty, g, r.block_size)
    if method == "probs" and prob.dtype.kind != "c":
        return fast_backward(prob, r.probs, r.out, r.tanh, r.empty, g)
    ct = prob.dtype
    full, grouped = prob.full_scores, prob.grouped
    dO = g.astype(ct, copy=False).reshape(grouped + (g.shape[-1],))
    S = full[-1]

    if method == "plain":
        P = r.probs
    else:
        P = _probs_from_lse(prob, r)
    P_drop = _apply_dropout(P, prob.keep, prob.dropout_p)
    dv = _swap(P_drop.reshape(grouped + (S,))) @ dO                      # dV = P_drop^T dO
    dP = _apply_dropout((dO @ _swap(prob.v)).reshape(full), prob.keep, prob.dropout_p)
    if method == "plain":
        D = np.sum(P * dP, axis=-1, keepdims=True)                       # D = rowsum(P * dP)
    else:
        D = np.sum(dO * r.out.reshape(dO.shape), axis=-1).reshape(full[:-1] + (1,))   # rowsum(dO * O)
    dT = P * (dP - D)
    if prob.fully_masked == "uniform":
        dT = np.where(r.empty, 0.0, dT)
    return _grads_from_dT(prob, dT, r.tanh, dv)


def sdpa_jvp(primals, tangents, **options):
    r"""Forward-mode derivative of attention: ``(out, out_tangent)``.

    Parameters
    ----------
    primals : tuple
        ``(query, key, value)``; every other input and option is a keyword,
        as in :func:`sdpa_forward` (``bias=`` included).
    tangents : tuple
        ``(dquery, dkey, dvalue)`` or ``(dquery, dkey, dvalue, dbias)``, each
        of its primal's shape, any of them ``None`` for zero.
    **options
        The keyword arguments of :func:`sdpa_forward`.

    Returns
    -------
    out, out_tangent : ndarray, (..., Hq, L, Ev)

    Notes
    -----
    Differentiating the forward in the direction of the tangents,

    .. math::

        dT &= s\,(dQ\,K^T + Q\,dK^T) \odot (1 - \tanh^2(T_{raw}/c)) + dB, \\
        dP &= P \odot (dT - \mathrm{rowsum}(P \odot dT)), \\
        dO &= \frac{dP \odot Z}{1-p} V + P_{drop}\, dV,

    the softcap factor only with softcap. Masked entries have :math:`P = 0`,
    so their :math:`dP` is 0; under ``"uniform"`` a fully masked row's
    :math:`P` is constant and its :math:`dP` is 0.
    """
    if not isinstance(primals, (tuple, list)) or len(primals) != 3:
        raise TypeError(f"`primals` should be a tuple (query, key, value), but got {V.describe(primals)}")
    if not isinstance(tangents, (tuple, list)) or len(tangents) not in (3, 4):
        raise TypeError("`tangents` should be a tuple (dquery, dkey, dvalue[, dbias]), "
                        f"but got {V.describe(tangents)}")
    if options.get("block_size") is not None:
        raise ValueError("`block_size` should be None for sdpa_jvp (forward mode has no tiled path), "
                         f"but got {options['block_size']!r}")
    out, res = sdpa_forward(*primals, **dict(options, save_probs=True))
    prob = res.problem
    names = ("query", "key", "value", "bias")
    ts = list(tangents) + [None] * (4 - len(tangents))
    if ts[3] is not None and prob.bias is None:
        raise ValueError("`tangents` should have no bias tangent when no `bias` is given, but got one")
    ct = prob.dtype
    conv = []
    for name, t in zip(names, ts):
        if t is None:
            conv.append(None)
            continue
        t = V.as_float_array(t, f"tangents[{names.index(name)}]")
        if t.shape != prob.shapes[name]:
            raise ValueError(f"`tangents[{names.index(name)}]` should have the shape of `{name}` "
                             f"{prob.shapes[name]}, but got shape {t.shape}")
        conv.append(t.astype(ct, copy=False))
    dq, dk, dv, db = conv
    full, grouped = prob.full_scores, prob.grouped
    P = res.probs
    dT = np.zeros(full, dtype=ct)
    if dq is not None:
        dqg = _to_grouped(dq, prob)
        dT = dT + ((prob.scale * dqg) @ _swap(prob.k)).reshape(full)
    if dk is not None:
        dkh = dk if dk.ndim > 2 else dk[None]
        dT = dT + ((prob.scale * prob.q) @ _swap(dkh)).reshape(full)
    if res.tanh is not None:
        dT = dT * (1.0 - res.tanh * res.tanh)
    if db is not None:
        dT = dT + db
    dP = P * (dT - np.sum(P * dT, axis=-1, keepdims=True))
    if prob.fully_masked == "uniform":
        dP = np.where(res.empty, 0.0, dP)
    dP_drop = _apply_dropout(dP, prob.keep, prob.dropout_p)
    dO = dP_drop.reshape(grouped + (full[-1],)) @ prob.v
    if dv is not None:
        dvh = dv if dv.ndim > 2 else dv[None]
        P_drop = _apply_dropout(P, prob.keep, prob.dropout_p)
        dO = dO + P_drop.reshape(grouped + (full[-1],)) @ dvh
    dO = dO.reshape(prob.out_shape)
    return out, dO.astype(prob.out_dtype, copy=False)


# ------------------------------------------------------------ internals


def _forward(prob: Problem, *, save_probs: bool):
    full = prob.full_scores
    S = full[-1]
    sc = prob.scores()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        m = np.where(sc.empty, 0.0, np.max(sc.T.real, axis=-1, keepdims=True, initial=-np.inf))
        e = np.exp(sc.T - m)
        s = np.sum(e, axis=-1, keepdims=True)
        P = e / s
        lse = np.log(s) + m
    P = _fill_empty_rows(P, prob, sc)
    P_drop = _apply_dropout(P, prob.keep, prob.dropout_p)
    O = (P_drop.reshape(prob.grouped + (S,)) @ prob.v).reshape(full[:-1] + (prob.v.shape[-1],))
    if prob.fully_masked == "nan" and S == 0:
        O = np.full_like(O, np.nan)       # an empty sum would give 0, not the policy's NaN
        if sc.padded is not None:
            O = np.where(sc.padded, 0.0, O)
    O = O.reshape(prob.out_shape)
    res = AttentionResiduals(
        problem=prob, probs=P if save_probs else None, out=O, lse=lse[..., 0].reshape(prob.out_shape[:-1]),
        tanh=sc.tanh, empty=sc.empty, padded=sc.padded,
    )
    return O, res


def _fill_empty_rows(P, prob: Problem, sc: Scores):
    """Apply the ``fully_masked`` policy; padded query rows are 0 under every policy."""
    if not np.any(sc.empty):
        return P
    S = prob.full_scores[-1]
    fill = {"zero": 0.0, "nan": np.nan, "uniform": 1.0 / S if S else np.nan}[prob.fully_masked]
    P = np.where(sc.empty, fill, P)
    if sc.padded is not None and prob.fully_masked != "zero":
        P = np.where(sc.padded, 0.0, P)
    return P.astype(prob.dtype, copy=False)


def _probs_from_lse(prob: Problem, r: AttentionResiduals):
    """FlashAttention's recomputation: ``P = exp(T - lse)`` on allowed entries."""
    sc = prob.scores()
    lse = r.lse.reshape(prob.full_scores[:-1] + (1,))
    with np.errstate(invalid="ignore", over="ignore"):
        P = np.exp(sc.T - np.where(sc.empty, 0.0, lse))   # exp(-inf) = 0 outside the allowed set
    return _fill_empty_rows(P, prob, sc)


def _grads_from_dT(prob: Problem, dT, tanh, dv):
    """dB, dTraw, dQ, dK from the score gradient, all summed back to their inputs."""
    full, grouped = prob.full_scores, prob.grouped
    dTraw = dT if tanh is None else dT * (1.0 - tanh * tanh)
    dTg = dTraw.reshape(grouped + (full[-1],))
    dq = (prob.scale * (dTg @ prob.k)).reshape(full[:-1] + (prob.q.shape[-1],))
    dk = prob.scale * (_swap(dTg) @ prob.q)
    return _pack_grads(prob, dq, dk, dv, dT)


def _pack_grads(prob: Problem, dq, dk, dv, dT):
    """The gradients summed back to the inputs' shapes and dtypes; ``dT`` (before softcap) gives dmask, dbias."""
    shapes, dtypes = prob.shapes, prob.dtypes
    dmask = dbias = None
    if prob.mask_float is not None:
        dmask = _unbroadcast(dT, shapes["attn_mask"]).astype(dtypes["attn_mask"], copy=False)
    if prob.bias is not None:
        dbias = _unbroadcast(dT, shapes["bias"]).astype(dtypes["bias"], copy=False)
    return AttentionGrads(
        query=_unbroadcast(dq, shapes["query"]).astype(dtypes["query"], copy=False),
        key=_unbroadcast(dk, shapes["key"]).astype(dtypes["key"], copy=False),
        value=_unbroadcast(dv, shapes["value"]).astype(dtypes["value"], copy=False),
        attn_mask=dmask,
        bias=dbias,
    )


def _to_grouped(x, prob: Problem):
    """A query-shaped array in the grouped layout ``(..., Hkv, G*L, E)``."""
    xh = x if x.ndim > 2 else x[None]
    Hkv = prob.k.shape[-3]
    Hq, L = xh.shape[-3], xh.shape[-2]
    G = Hq // Hkv if Hkv else 1
    return xh.reshape(xh.shape[:-3] + (Hkv, G * L, xh.shape[-1]))


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


scaled_dot_product_attention.__doc__ = scaled_dot_product_attention.__doc__ % _DOC_OPTIONS
sdpa_forward.__doc__ = sdpa_forward.__doc__ % _DOC_OPTIONS
