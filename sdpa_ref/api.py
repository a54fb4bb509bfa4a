r"""The public forward entry points of attention; ``method=`` picks an engine (the derivatives are in
:mod:`sdpa_ref.derivatives`).

Every call goes the same way down::

    validate    AttentionOptions.from_kwargs, Problem.build   (options.py, problem.py)
    engine      plain (attention.py; heads.py runs its heads in the pool), fast or tiled (engines/),
                the BLAS held to one thread
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

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from . import _validate as V
from . import heads, poison
from .engines import blocks, fast, reproducible, splitkv, tiled
from ._threads import single_threaded_blas
from .residuals import AttentionResiduals
from .rounding import round_to
from .options import DOC_OPTIONS, FULLY_MASKED_POLICIES, AttentionOptions, check_bool
from .policy import averages_values
from .absorbed import Absorbed
from .axes import Swapped, is_dense_layout
from .layouts import Gathered
from .problem import Problem

__all__ = [
    "FULLY_MASKED_POLICIES",
    "METHODS",
    "AttentionResiduals",
    "Engine",
    "scaled_dot_product_attention",
    "sdpa_forward",
    "sdpa_forward_complex",
    "split_kv_partials",
]

#: The engines' modules, by the name ``method=`` takes (``precision="reproducible"``: the dense schedule in
#: double-double or the honest low precision).
ENGINES = {"fast": fast, "plain": heads, "tiled": tiled, "split": splitkv, "reproducible": reproducible}


class Engine(NamedTuple):
    """A schedule and its settings, with the one signature of every engine's forward, backward and JVP.

    ``name`` picks the module of :data:`ENGINES`; ``block_size`` is the tiled and split schedules' block (an
    int, or ``(rows, keys)`` for the tiled backward of dense residuals), None for the dense ones, which have no
    setting; ``split_bounds`` the split schedule's ``(*batch, n + 1)`` (:func:`sdpa_ref.engines.splitkv.bounds`).
    """

    name: str
    block_size: Any = None
    split_bounds: Any = None

    def _kw(self):
        return {"block_size": self.block_size} if self.name in ("tiled", "split") else {}

    def forward(self, prob, *, save_probs=True):
        """The engine's :class:`~sdpa_ref.engines.contract.Forward` (``P`` kept where ``save_probs`` and the
        schedule has one: the tiled and split ones never do)."""
        kw = dict(self._kw(), **({"split_bounds": self.split_bounds} if self.name == "split" else {}))
        return ENGINES[self.name].forward(prob, save_probs=save_probs, **kw)

    def backward(self, prob, fwd, dO, dlse=None, *, absorbed=None):
        """The engine's :class:`~sdpa_ref.engines.contract.Grads`. ``absorbed``: MLA's ``qv`` joined
        (:class:`~sdpa_ref.absorbed.Absorbed`), or None; the reproducible engine splits the gradients itself, in
        its arithmetic (``dV``'s two uses summed before its one rounding), the others leave the split to the API."""
        kw = self._kw()
        if self.name == "reproducible" and absorbed is not None:
            kw["absorbed"] = absorbed
        return ENGINES[self.name].backward(prob, fwd, dO, dlse, **kw)

    def jvp(self, prob, fwd, dq=None, dk=None, dv=None, dbias=None, *, dv_full=None, dextra=None):
        """The output tangent ``(*batch, Hq, L, Ev)``."""
        return ENGINES[self.name].jvp(prob, fwd, dq, dk, dv, dbias, dv_full=dv_full, dextra=dextra, **self._kw())
#: Accepted values of ``method=`` of the forward entry points (``precision="reproducible"`` picks its own engine).
METHODS = ("fast", "plain", "tiled", "split")
#: Accepted values of ``precision=``.
PRECISIONS = ("fast", "reproducible")
#: Why :func:`sdpa_forward_complex` refuses ``precision="reproducible"``, and the bound its fast path reaches.
COMPLEX_REPRODUCIBLE = (
    "`precision` should be 'fast' for sdpa_forward_complex, but got 'reproducible': the reproducible engine's "
    "double-double arithmetic has no complex exp (it would need cos and sin to about 100 bits), so complex "
    "results cannot be faithfully rounded. The fast path is within about 6.5 ulps (the real part) and 120 ulps "
    "(the complex step's derivative Im/h) of the largest entry, measured against 50-digit mpmath")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, return_lse=False, method=None, block_size=None,
                                 num_splits=None, split_bounds=None, precision="fast", layout=None, **options):
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
    layout : {"bhsd", "bshd"}, sdpa_ref.layouts.Packed or KVCache, optional
        As in :func:`sdpa_forward`.

    Returns
    -------
    out : ndarray, (..., Hq, L, Ev)
        In the inputs' dtype (which dtypes: :func:`sdpa_forward`'s Notes); in the layout's with ``layout``.
    lse : ndarray, (..., Hq, L)
        Only with ``return_lse=True``; ``-inf`` on rows with no allowed key; in the layout's with ``layout``.

    See Also
    --------
    sdpa_forward, sdpa_backward, sdpa_jvp
    """
    return_lse = check_bool(return_lse, "return_lse")
    out, res = sdpa_forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            save_probs=False, method=method, block_size=block_size, num_splits=num_splits,
                            split_bounds=split_bounds, precision=precision, layout=layout, **options)
    if return_lse:
        return out, round_to(res.lse, res.problem.out_dtype, copy=False)
    return out


def sdpa_forward(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 *, save_probs=True, method=None, block_size=None, num_splits=None, split_bounds=None,
                 precision="fast", layout=None, **options):
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
        precision, the same bits everywhere. Many times slower; ``method`` must be None or ``"split"`` and
        ``block_size`` None. Split-KV (``num_splits``, ``split_bounds``) is a schedule: it is validated, and
        the results are the unsplit ones, bit for bit (the exact value, rounded once).
    layout : {"bhsd", "bshd"}, sdpa_ref.layouts.Packed or KVCache, optional
        ``"bshd"`` (:mod:`sdpa_ref.axes`): ``query``, ``key``, ``value`` (and
        ``qv``) are ``(..., L, H, E)``, FlashAttention's and JAX's order, and
        ``out`` and their gradients come back in it; the LSE, masks, biases
        and sinks keep their shapes. ``"bhsd"`` or None: the package's own
        order. Else the sequences as a kernel stores them (:mod:`sdpa_ref.layouts`):
        ``query``, ``key`` and ``value`` are then the layout's arrays
        (packed ``thd``; a query ``bshd`` against a KV cache, contiguous or
        paged), gathered into the dense problem with the sequences' lengths
        as ``q_lengths`` and ``kv_lengths`` (not to be given); ``out``, the
        LSE and, in :func:`sdpa_backward`, the gradients of ``query``,
        ``key`` and ``value`` come back in the layout. A float mask, bias or
        dropout mask is in the dense layout ``(B, Hq, Lmax, Smax)``.

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
    prob, gathered, absorbed = _problem(query, key, value, opts, layout)
    engine = _engine(method, block_size, prob, METHODS, precision, (num_splits, split_bounds))
    with single_threaded_blas():
        fwd = engine.forward(prob, save_probs=save_probs)
    fwd = _read_only(fwd)
    taint = poison.forward_taint(prob)                 # where the results read a NaN or inf input: NaN there
    out = poison.nan_where(fwd.out, None if taint is None else taint.out)
    out = round_to(out.reshape(prob.out_shape), prob.out_dtype)   # the caller's own array
    if gathered is not None:
        out = gathered.out(out)                        # a new array, in the layout
    return out, AttentionResiduals(problem=prob, forward=fwd, method=engine.name, block_size=engine.block_size,
                                   taint=taint, layout=gathered, absorbed=absorbed)


def split_kv_partials(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, *, num_splits=None, split_bounds=None, block_size=None, layout=None,
                      precision="fast", **options):
    r"""Each split's own result, as a split-KV kernel writes it before its combine: ``(out_parts, lse_parts)``.

    The arguments are :func:`sdpa_forward`'s; ``num_splits`` or ``split_bounds`` (one of them) cuts each
    sequence's keys into splits, and split ``i`` is the attention of every row to the keys of split ``i``
    alone, under every other option. :func:`sdpa_ref.merge_attention` of the parts gives the attention over
    all keys; ``method="split"`` computes exactly that (:mod:`sdpa_ref.engines.splitkv`).

    ``precision="reproducible"`` (``block_size`` then None): each part is the reproducible engine on its
    split's keys alone, faithfully rounded (within 1 ulp of that part's exact ``out_i`` and ``lse_i``) and the
    same bits everywhere; :func:`sdpa_ref.merge_attention` with ``precision="reproducible"`` merges them
    faithfully too.

    Returns
    -------
    out_parts : ndarray, (n, ..., Hq, L, Ev)
        Split ``i``'s output, normalised over its own keys; 0 on a row with no allowed key in the split.
    lse_parts : ndarray, (n, ..., Hq, L)
        Its log-sum-exp, natural base; ``-inf`` on a row with no allowed key in the split.

    With ``layout``, the bounds count each sequence's own keys, and the parts are in the layout of
    FlashAttention's split-KV accumulators (``out_accum``, ``softmax_lse_accum``): the LSE's layout, and Ev
    last for the outputs -- ``(n, Hq, total_q, Ev)`` and ``(n, Hq, total_q)`` packed, ``(n, B, Hq, Lq, Ev)``
    and ``(n, B, Hq, Lq)`` against a KV cache -- so that :func:`sdpa_ref.merge_attention` takes them as they
    are (its merged ``out`` is then in that layout too: ``np.moveaxis`` it to the output's).

    The parts hold no sink (a kernel adds it at the combine: merging one more part ``(0, sink)`` gives the
    result with sinks) and no ``fully_masked`` policy (a row that no split serves merges to ``(0, -inf)``, the
    ``"zero"`` policy). A part reads only its split's keys: a non-finite key, value or score term makes NaN only
    the parts that read it.
    """
    opts = AttentionOptions.from_kwargs("split_kv_partials", attn_mask=attn_mask, dropout_p=dropout_p,
                                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **options)
    prob, gathered, _ = _problem(query, key, value, opts, layout)
    if prob.dtype.kind == "c":
        raise TypeError("`query` should be real for split_kv_partials, but got a complex dtype")
    V.check_choice(precision, "precision", PRECISIONS)
    if precision == "reproducible" and block_size is not None:
        raise ValueError("`block_size` should be None with precision='reproducible' (it has its own engine, whose "
                         f"bits no schedule changes), but got {block_size!r}")
    b = splitkv.bounds(prob, num_splits, split_bounds)
    with single_threaded_blas():
        outs, lses = splitkv.partials(prob, b, block_size="auto" if block_size is None else block_size,
                                      forward=reproducible.forward if precision == "reproducible" else None)
    res_out, res_lse = [], []
    for i in range(len(outs)):
        taint = poison.forward_taint(splitkv.split_problem(prob, b, i)[0])    # what this split reads
        o = poison.nan_where(outs[i], None if taint is None else taint.out).reshape(prob.out_shape)
        lse = poison.nan_where(lses[i], None if taint is None else taint.lse).reshape(prob.out_shape[:-1])
        o, lse = round_to(o, prob.out_dtype), round_to(lse, prob.out_dtype)
        res_out.append(o if gathered is None else gathered.lse(o, fill=0.0))      # the accumulators' layout
        res_lse.append(lse if gathered is None else gathered.lse(lse))
    return np.stack(res_out), np.stack(res_lse)


def sdpa_forward_complex(query, key, value, *, method=None, block_size=None, precision="fast", **options):
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

    ``precision`` must be ``"fast"``: ``"reproducible"`` is refused
    (``sdpa_ref.api.COMPLEX_REPRODUCIBLE``), as its double-double arithmetic has no
    complex ``exp`` (that needs ``cos`` and ``sin`` to about 100 bits).
    Measured against 50-digit mpmath on 440 problems (dominant keys,
    scores up to about 100, softcap, causal; plain and tiled), the fast
    path's real part is within 6.5 ulps of the largest output entry, and the
    complex step's derivative ``Im / h`` within 120 ulps of the largest
    derivative entry (normwise; an entry that cancels has no relative bound).
    """
    V.check_choice(precision, "precision", PRECISIONS)
    if precision == "reproducible":
        raise ValueError(COMPLEX_REPRODUCIBLE)
    opts = AttentionOptions.from_kwargs("sdpa_forward_complex", **options)
    if opts.qv is not None:
        raise ValueError("`qv` should be None for sdpa_forward_complex, but got an array: join it yourself, "
                         "[query | qv] against [key | value]")
    if not opts.upcast:
        raise ValueError("`upcast` should be True for sdpa_forward_complex (it computes in complex128), "
                         "but got False")
    prob = Problem.build(query, key, value, opts, complex_ok=True)
    if prob.sink is not None:
        raise ValueError("`sinks` should be None for sdpa_forward_complex (a sink is a real logit), but got sinks")
    engine = _engine(method, block_size, prob, ("plain", "tiled"))   # default: plain, or tiled with a block
    with single_threaded_blas():
        fwd = engine.forward(prob, save_probs=False)
    taint = poison.forward_taint(prob)
    return poison.nan_where(fwd.out, None if taint is None else taint.out).reshape(prob.out_shape)


# ---------------------------------------------------------------- helpers


def _problem(query, key, value, opts, layout):
    """``(prob, gathered, absorbed)``: the dense problem, with a layout's sequences gathered into it and MLA's
    ``qv`` joined (each None when not given)."""
    gathered = absorbed = None
    qv = opts.qv
    if is_dense_layout(layout):                        # "bshd": the dense problem with two axes swapped
        gathered = None if layout == "bhsd" else Swapped(query, key, value)
    elif layout is not None:                           # the sequences as stored: gathered into the dense problem
        gathered = Gathered(layout, query, key, value)
        opts = _with_lengths(opts, gathered)
    if gathered is not None:
        query, key, value = gathered.q, gathered.k, gathered.v
        qv = None if qv is None else gathered.gather_qv(qv)
    if qv is not None:                                 # MLA's qv: [q | qv] against [k | v]
        absorbed = Absorbed(query, key, value, qv)
        query, key, opts = absorbed.q, absorbed.k, dataclasses.replace(opts, qv=None)
    # a layout's gathered arrays are fresh and read by nothing else: the problem takes them rather than copying them
    adopt = gathered is not None and not isinstance(gathered, Swapped) and absorbed is None
    return Problem.build(query, key, value, opts, adopt=adopt), gathered, absorbed


def _engine(method, block_size, prob, allowed, precision="fast", splits=(None, None)):
    """The :class:`Engine` that ``method``, ``block_size``, ``precision`` and ``splits`` (``num_splits``,
    ``split_bounds``) pick."""
    V.check_choice(precision, "precision", PRECISIONS)
    split = any(x is not None for x in splits)
    if precision == "reproducible":
        if method not in (None, "split") or block_size is not None:
            raise ValueError("`method` should be None or 'split' and `block_size` None with "
                             "precision='reproducible' (it has its own engine, whose bits no schedule changes), "
                             f"but got method={method!r}, block_size={block_size!r}")
        if split or method == "split":                  # a schedule, validated; the exact value is unsplit
            splitkv.bounds(prob, *splits)
        return Engine("reproducible")
    if method is None:
        method = "split" if split else "tiled" if block_size is not None else allowed[0]
    V.check_choice(method, "method", allowed)
    if method in ("split", "tiled"):
        block_size = _tiles(block_size, prob)
    if method == "split":
        return Engine(method, blocks.check_block_size("auto" if block_size is None else block_size, prob),
                      splitkv.bounds(prob, *splits))
    if split:
        raise ValueError(f"`num_splits` and `split_bounds` should be None with method={method!r} (they are the "
                         "split-KV schedule's, method='split'), but got "
                         f"num_splits={splits[0]!r}, split_bounds={'None' if splits[1] is None else 'an array'}")
    if method != "tiled":
        if block_size is not None:
            raise ValueError(f"`block_size` should be None with method={method!r} (it is the tiled and split "
                             f"engines'), but got {block_size!r}")
        return Engine(method)
    return Engine(method, blocks.check_block_size("auto" if block_size is None else block_size, prob))


def _tiles(block_size, prob):
    """The tiled engine's block with a ``block_mask``: its tile, so that each block is one tile."""
    bm = prob.options.block_mask
    if bm is None:
        return block_size
    bq, bk = bm.block_size
    if bq != bk:
        raise ValueError(f"`block_mask` should have square tiles for the tiled and split engines (their blocks are "
                         f"square), but has {bq} x {bk}")
    if block_size not in (None, "auto", bq):
        raise ValueError(f"`block_size` should be None or the block mask's tile {bq}, but got {block_size!r}")
    return bq


def _with_lengths(opts, gathered):
    """``opts`` with the layout's sequence lengths as ``q_lengths`` and ``kv_lengths``."""
    if averages_values(opts.fully_masked):
        raise ValueError(f"`fully_masked` should be 'zero' or 'nan' with `layout=`, but got {opts.fully_masked!r}: "
                         "it averages keys of the dense problem, whose padding is not the sequence's")
    for name in ("q_lengths", "kv_lengths"):
        if getattr(opts, name) is not None:
            raise ValueError(f"`{name}` should not be given with `layout=` (the sequences' lengths are the layout's), "
                             f"but got {name}")
    return dataclasses.replace(opts, **gathered.lengths)


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


scaled_dot_product_attention.__doc__ = scaled_dot_product_attention.__doc__ % DOC_OPTIONS
sdpa_forward.__doc__ = sdpa_forward.__doc__ % DOC_OPTIONS
