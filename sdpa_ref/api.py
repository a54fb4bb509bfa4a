r"""The public entry points of attention; ``method=`` picks an engine.

Every call goes the same way down::

    validate    AttentionOptions.from_kwargs, Problem.build   (options.py, problem.py)
    engine      plain (attention.py), fast or tiled (engines/) with the BLAS held to one thread
    return      results in the user's shapes and dtypes; residuals for the backward

Shapes (the legend of the package docstring)::

    query     (..., Hq, L, E)
    key       (..., Hkv, S, E)
    value     (..., Hkv, S, Ev)
    out       (..., Hq, L, Ev)
    attn_mask, bias, dropout_mask   broadcastable to (..., Hq, L, S)
    alibi_slopes (Hq,) or (..., Hq);  q_lengths, kv_lengths (...)
"""

from __future__ import annotations

import numpy as np

from . import _validate as V
from . import attention, poison
from .engines import fast, reproducible, tiled
from ._threads import single_threaded_blas
from .residuals import AttentionGrads, AttentionResiduals
from .options import DOC_OPTIONS, FULLY_MASKED_POLICIES, AttentionOptions, check_bool
from .problem import Problem
from .transforms import unbroadcast

__all__ = [
    "BACKWARD_METHODS",
    "FULLY_MASKED_POLICIES",
    "METHODS",
    "AttentionGrads",
    "AttentionResiduals",
    "scaled_dot_product_attention",
    "sdpa_backward",
    "sdpa_forward",
    "sdpa_forward_complex",
    "sdpa_jvp",
]

#: The engines, by the name ``method=`` takes.
ENGINES = {"fast": fast, "plain": attention, "tiled": tiled, "reproducible": reproducible}
#: Accepted values of ``method=`` of the forward entry points (``precision="reproducible"`` picks its own engine).
METHODS = ("fast", "plain", "tiled")
#: Accepted values of ``precision=``.
PRECISIONS = ("fast", "reproducible")
#: Accepted values of ``sdpa_backward(..., method=)``: the engines, and two older names
#: (``"probs"`` is ``"fast"``, ``"lse"`` is ``"tiled"``: FlashAttention's recomputing backward).
BACKWARD_METHODS = METHODS + ("probs", "lse", "reproducible")
_ALIASES = {"probs": "fast", "lse": "tiled"}


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, return_lse=False, method=None, block_size=None,
                                 precision="fast", **options):
    r"""Scaled dot-product attention, a drop-in for PyTorch's functional op.

    ``softmax(Q K^T * scale + mask) V`` with exact masking: masked entries
    get probability exactly 0, never a ``-1e9`` approximation. The
    positional arguments are PyTorch's; the keyword-only ones reproduce
    FlashAttention, JAX and xformers (see ``SEMANTICS.md``).

    Parameters
    ----------%s
    return_lse : bool, optional
        Also return the per-row log-sum-exp of the allowed scores.
    precision : {"fast", "reproducible"}, optional
        As in :func:`sdpa_forward`.

    Returns
    -------
    out : ndarray, (..., Hq, L, Ev)
        In the inputs' dtype (which dtypes: :func:`sdpa_forward`'s Notes).
    lse : ndarray, (..., Hq, L)
        Only with ``return_lse=True``; ``-inf`` on rows with no allowed key.

    See Also
    --------
    sdpa_forward, sdpa_backward, sdpa_jvp
    """
    return_lse = check_bool(return_lse, "return_lse")
    out, res = sdpa_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            save_probs=False, method=method, block_size=block_size, precision=precision, **options)
    if return_lse:
        return out, res.lse.astype(res.problem.out_dtype, copy=False)
    return out


def sdpa_forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 *, save_probs=True, method=None, block_size=None, precision="fast", **options):
    r"""Attention forward that also returns what the backward needs.

    Parameters
    ----------%s
    save_probs : bool, optional
        Keep ``P`` (and softcap's ``tanh``) in the residuals (default), for
        the ``"fast"`` and ``"plain"`` backwards; with False only
        ``(out, lse)`` are kept and :func:`sdpa_backward` recomputes ``P``
        (``method="tiled"``).
    precision : {"fast", "reproducible"}, optional
        ``"fast"`` (default): float64 (or the ``upcast=False`` dtype) with
        the BLAS and NumPy's ``exp``; accurate to a few ulps, but the last
        bits may differ between machines, BLAS kernels and NumPy builds.
        ``"reproducible"``: every float64 result (``out``, ``lse``, and
        later every gradient and the JVP) faithfully rounded -- within one
        ulp of the exact value of the formula on the given inputs -- and the
        same bits on any machine, thread count, BLAS or SIMD level
        (:mod:`sdpa_ref.engines.reproducible`: double-double arithmetic with
        exact BLAS products by the Ozaki scheme). With ``upcast=False``
        (float64, float32 or float16), every operation is rounded to the
        inputs' dtype, in a fixed order (products and sums accumulated in
        float32, float64 for float64): an honest computation in that
        precision, the same bits everywhere. Many times slower; ``method`` and ``block_size`` must be
        None.

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

    Every engine and precision takes the same dtypes (``SEMANTICS.md``):
    float64, float32, float16, bfloat16 (not with ``upcast=False``); any
    other, float8 included (dequantize it first), is one `TypeError` naming
    the argument. Zero sizes agree too; ``S = 0`` makes every row fully masked.
    """
    save_probs = check_bool(save_probs, "save_probs")
    opts = AttentionOptions.from_kwargs("sdpa_forward", attn_mask=attn_mask, dropout_p=dropout_p,
                                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **options)
    prob = Problem.build(query, key, value, opts)
    name, block = _engine(method, block_size, prob, METHODS, precision)
    with single_threaded_blas():
        fwd = _call_forward(name, prob, save_probs, block)
    fwd = _read_only(fwd)
    taint = poison.forward_taint(prob, fwd.empty)      # results that read a NaN or inf input: NaN
    out = poison.nan_where(fwd.out, None if taint is None else taint.out)
    out = out.reshape(prob.out_shape).astype(prob.out_dtype, copy=True)   # the caller's own array
    return out, AttentionResiduals(problem=prob, forward=fwd, method=name, block_size=block, taint=taint)


def sdpa_forward_complex(query, key, value, *, method=None, block_size=None, **options):
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
    It always computes in complex128 (``upcast`` must be True), with the
    ``"plain"`` or ``"tiled"`` engine (the fast engine is real-only).
    """
    opts = AttentionOptions.from_kwargs("sdpa_forward_complex", **options)
    if not opts.upcast:
        raise ValueError("`upcast` should be True for sdpa_forward_complex (it computes in complex128), "
                         "but got False")
    prob = Problem.build(query, key, value, opts, complex_ok=True)
    name, block = _engine(method, block_size, prob, ("plain", "tiled"))   # default: plain, or tiled with a block
    with single_threaded_blas():
        fwd = _call_forward(name, prob, False, block)
    taint = poison.forward_taint(prob, fwd.empty)
    return poison.nan_where(fwd.out, None if taint is None else taint.out).reshape(prob.out_shape)


def sdpa_backward(residuals, grad_out, method=None):
    r"""Gradients of attention by the hand-derived backward.

    Parameters
    ----------
    residuals : AttentionResiduals
        From :func:`sdpa_forward`.
    grad_out : array_like, (..., Hq, L, Ev)
        Cotangent ``dO`` of the output (any input dtype of the forward).
    method : {"fast", "plain", "tiled", "probs", "lse"}, optional
        The engine; by default the one that made the residuals. ``"fast"``
        and ``"plain"`` read the saved ``P`` (``"fast"`` in place, with
        :math:`D = \mathrm{rowsum}(dO \odot O)`; ``"plain"``, the teaching
        form, with :math:`D = \mathrm{rowsum}(P \odot dP)`). ``"tiled"`` is
        FlashAttention's: it keeps only ``(O, lse)`` (with the row max and sum
        apart) and recomputes :math:`P = e^{T - m} / s` block by block (for
        dense residuals, four blocks of rows with every key, so that it peaks
        below the default). ``"probs"`` and ``"lse"`` are the older names of
        ``"fast"`` and ``"tiled"``. They agree to rounding.

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

    :math:`D_i = \sum_j P_{drop,ij} (dO_i \cdot v_j) = dO_i \cdot O_i` too, so
    ``D`` needs no ``L x S`` product (FlashAttention's identity).

    Masked entries have :math:`P_{ij} = 0` and so :math:`dT_{ij} = 0`. The
    float mask, the bias and ALiBi are added to :math:`T`, so
    :math:`dB = dT`. Softcap :math:`T = c \tanh(T_{raw}/c)` gives
    :math:`dT_{raw} = dT \odot (1 - \tanh^2(T_{raw}/c))`. Finally
    :math:`T_{raw} = s\,Q K^T` gives :math:`dQ = s\, dT_{raw} K` and
    :math:`dK = s\, dT_{raw}^T Q`, summed over the query heads of a GQA group.

    Fully masked rows: under ``"zero"`` :math:`P_i = 0`, so every
    contribution of the row is 0. Under ``"uniform"`` the row's
    probabilities do not depend on the scores, so :math:`dT_i = 0` while
    :math:`dV` receives :math:`dO_i / S` from it. Under ``"nan"`` the
    formulas are evaluated as written in IEEE arithmetic: :math:`dQ_i` and
    :math:`dB_i` are NaN, and so are :math:`dK` and :math:`dV` of the kv
    head it reads (the textbook / xformers behaviour). Padded query rows
    (``i >= q_len``) have :math:`P_i = 0` under every policy.
    """
    if not isinstance(residuals, AttentionResiduals):
        raise TypeError("`residuals` should be the AttentionResiduals returned by sdpa_forward, "
                        f"but got {V.describe(residuals)}")
    prob = residuals.problem
    V.check_choice(method if method is not None else residuals.method, "method", BACKWARD_METHODS)
    name = _ALIASES.get(method, method) if method is not None else residuals.method
    if (name == "reproducible") != (residuals.method == "reproducible"):
        raise ValueError("`method` should be None or 'reproducible' for residuals of precision='reproducible', "
                         "and 'reproducible' only for those, but got "
                         f"method={method!r} for residuals of method {residuals.method!r}")
    if name == "reproducible" and residuals.forward.extra is None:
        raise ValueError("`residuals` of precision='reproducible' need save_probs=True for the backward "
                         "(it has no recomputing form)")
    if name != "tiled" and residuals.probs is None:
        if method is not None:
            raise ValueError("`method` should be 'tiled' (or 'lse') for residuals saved with save_probs=False "
                             f"or by the tiled engine, but got {method!r}")
        name = "tiled"
    g = V.as_float_array(grad_out, "grad_out")
    if g.shape != prob.out_shape:
        raise ValueError(f"`grad_out` should have the output's shape {prob.out_shape}, but got shape {g.shape}")
    dO, do_bad = prob.clean_grad_out(g, residuals.empty)    # 0 where never read, and where not finite
    with single_threaded_blas():
        if name == "tiled":
            block = residuals.block_size or tiled.lse_blocks(prob.L, prob.S)
            gr = tiled.backward(prob, residuals.forward, dO, block_size=block)
        else:
            gr = ENGINES[name].backward(prob, residuals.forward, dO)
    gr = poison.backward_taint(prob, residuals.empty, gr, do_bad)
    gr = gr._replace(dq=poison.nan_where(gr.dq, prob.nan_rows_without_keys()))     # S = 0 under "nan"
    shapes, dtypes = prob.shapes, prob.dtypes

    def back(x, name):
        return None if x is None else unbroadcast(x, shapes[name]).astype(dtypes[name], copy=False)

    return AttentionGrads(query=back(gr.dq, "query"), key=back(gr.dk, "key"), value=back(gr.dv, "value"),
                          attn_mask=back(gr.dmask, "attn_mask"), bias=back(gr.dbias, "bias"))


def sdpa_jvp(primals, tangents, *, method=None, precision="fast", **options):
    r"""Forward-mode derivative of attention: ``(out, out_tangent)``.

    Parameters
    ----------
    primals : tuple
        ``(query, key, value)``; every other input and option is a keyword,
        as in :func:`sdpa_forward` (``bias=`` included).
    tangents : tuple
        ``(dquery, dkey, dvalue)`` or ``(dquery, dkey, dvalue, dbias)``, each
        of its primal's shape and an input dtype, any of them ``None`` for zero.
    method : {"fast", "plain"}, optional
        The engine of the primal forward (default ``"fast"``); the tangent is
        the teaching core's :func:`sdpa_ref.attention.jvp` on its ``P``.
        Forward mode has no tiled engine.
    precision : {"fast", "reproducible"}, optional
        As in :func:`sdpa_forward`; ``"reproducible"`` computes the tangent
        in double-double too, faithfully rounded and the same bits everywhere.
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
        raise ValueError("`block_size` should be None for sdpa_jvp (forward mode has no tiled engine), "
                         f"but got {options['block_size']!r}")
    options.pop("block_size", None)
    V.check_choice("fast" if method is None else method, "method", ("fast", "plain"))
    out, res = sdpa_forward(*primals, method=method, precision=precision, **dict(options, save_probs=True))
    prob = res.problem
    names = ("query", "key", "value", "bias")
    ts = list(tangents) + [None] * (4 - len(tangents))
    if ts[3] is not None and prob.bias is None:
        raise ValueError("`tangents` should have no bias tangent when no `bias` is given, but got one")
    conv = []
    for i, (name, t) in enumerate(zip(names, ts)):
        if t is not None:
            t = V.as_float_array(t, f"tangents[{i}]")
            if t.shape != prob.shapes[name]:
                raise ValueError(f"`tangents[{i}]` should have the shape of `{name}` {prob.shapes[name]}, "
                                 f"but got shape {t.shape}")
            if name != "bias" and t.ndim == 2:
                t = t[None]
        conv.append(t)
    dq, dk, dv, db = conv
    if dq is not None:
        dq = dq.reshape(dq.shape[:-3] + prob.q.shape[-4:])
    (dq, dk, dv, db), (bq, bk, bv, bb), dv_full = prob.clean_tangents(dq, dk, dv, db)   # as the primals are
    with single_threaded_blas():
        core = reproducible if res.method == "reproducible" else attention
        dO = core.jvp(prob, res.forward, dq, dk, dv, db, dv_full=dv_full)
    rows = (None if b is None else b.any(axis=-1) for b in (bq, bk))
    dO = poison.nan_where(dO, poison.jvp_taint(prob, res.empty, (*rows, bv, bb)))
    dO = poison.nan_where(dO, prob.nan_rows_without_keys() if any(t is not None for t in (dq, dk, dv, db)) else None)
    return out, dO.reshape(prob.out_shape).astype(prob.out_dtype, copy=False)


# ---------------------------------------------------------------- helpers


def _engine(method, block_size, prob, allowed, precision="fast"):
    """``(engine name, tiled block or None)`` from ``method``, ``block_size`` and ``precision``."""
    V.check_choice(precision, "precision", PRECISIONS)
    if precision == "reproducible":
        if method is not None or block_size is not None:
            raise ValueError("`method` and `block_size` should be None with precision='reproducible' (it has its "
                             f"own engine), but got method={method!r}, block_size={block_size!r}")
        return "reproducible", None
    if method is None:
        method = "tiled" if block_size is not None else allowed[0]
    V.check_choice(method, "method", allowed)
    if method != "tiled":
        if block_size is not None:
            raise ValueError(f"`block_size` should be None with method={method!r} (it is the tiled engine's), "
                             f"but got {block_size!r}")
        return method, None
    return method, tiled.check_block_size("auto" if block_size is None else block_size, prob)


def _read_only(fwd):
    """The forward's arrays (and the engine's extras) made read-only: the residuals are never written again,
    and ``out`` is handed out as a copy, so nothing the caller does afterwards changes a gradient."""
    def freeze(x):
        if isinstance(x, np.ndarray):
            x.setflags(write=False)
        elif isinstance(x, (tuple, list)):
            for y in x:
                freeze(y)
        elif isinstance(x, dict):
            for y in x.values():
                freeze(y)
    freeze(tuple(fwd))
    return fwd


def _call_forward(name, prob, save_probs, block):
    if name == "tiled":
        return tiled.forward(prob, block_size=block)
    return ENGINES[name].forward(prob, save_probs=save_probs)


scaled_dot_product_attention.__doc__ = scaled_dot_product_attention.__doc__ % DOC_OPTIONS
sdpa_forward.__doc__ = sdpa_forward.__doc__ % DOC_OPTIONS
