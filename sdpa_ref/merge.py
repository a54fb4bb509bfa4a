r"""Merging partial attention results over disjoint sets of keys (split-KV), and its VJP.

A split-KV kernel (FlashAttention's split-KV combine, Flash-Decoding, FlashInfer's ``merge_state``,
xformers' ``merge_attentions``) cuts the keys of each query row into parts, attends to each part alone and
merges the partial outputs by their log-sum-exps. Part ``i`` gives ``out_i``, the softmax-weighted average of
its values, and ``lse_i``, the log-sum-exp of its scores (``-inf`` when the part has no allowed key); the merge
gives the attention over the union of the parts, exactly:

.. math:: \mathrm{lse} = \log \sum_i e^{\mathrm{lse}_i}, \qquad
          w_i = e^{\mathrm{lse}_i - \mathrm{lse}}, \qquad
          \mathrm{out} = \sum_i w_i\, \mathrm{out}_i .

The combine of the normalisers is :func:`sdpa_ref.lse.combine_lse` (with its VJP beside it); this module
validates, reads the parts and applies the weights. Shapes, in the package legend: ``out_parts``
``(P, ..., Hq, L, Ev)``, ``lse_parts`` ``(P, ..., Hq, L)``, the parts stacked on a leading axis (or on the
axis ``axis=`` names, as FlashInfer's ``(L, P, Hq, Ev)``); any leading dims work (``(P, Ev)`` and ``(P,)``
is one row). The conventions are SEMANTICS.md's "Merging partial results".
"""

from __future__ import annotations

import numpy as np

from .arith import NUMPY, NUMPY2

from ._validate import as_float_array
from .exact.arith import DoubleDouble
from .lse import ExactLSE, arith_for, check_base, combine_lse_vjp, combine_lse_vjp_in, combined_in
from .rounding import round_to

__all__ = ["merge_attention", "merge_attention_backward"]


def merge_attention(out_parts, lse_parts, *, lse_base="e", axis=0, precision="fast"):
    r"""Merge partial attention results over disjoint sets of keys: ``(out, lse)`` of their union.

    Parameters
    ----------
    out_parts : array_like, (P, ..., Hq, L, Ev)
        Each part's output, the softmax-weighted average of the values of its keys; ``P >= 1``. Where a part
        is empty (its ``lse`` is ``-inf``) this is never read: it may hold anything, NaN and inf included.
    lse_parts : array_like, (P, ..., Hq, L)
        Each part's log-sum-exp of its allowed scores, ``-inf`` where the part has no allowed key. Exactly the
        shape of ``out_parts`` without its last axis. ``+inf`` is a `ValueError` (a log-sum-exp of finite
        scores is never ``+inf``; FlashAttention 2's kernels write ``+inf`` on rows with no key: make it
        ``-inf`` first); NaN makes its row's ``out`` and ``lse`` NaN.
    lse_base : {"e", 2}, optional
        ``"e"`` (default): natural log-sum-exps. ``2`` (or ``"2"``): base-2 ones, as FlashInfer returns them
        (``lse / ln 2``); the returned ``lse`` is then base 2 too.
    axis : int, optional
        The axis of ``lse_parts`` that holds the parts, and the same axis of ``out_parts`` (which has one more
        axis at the end, ``Ev``); 0 by default, as above. Negative counts from the end of ``lse_parts``.
        FlashInfer's ``merge_states`` stacks them as ``(L, P, Hq, Ev)`` / ``(L, P, Hq)``: ``axis=1``.
    precision : {"fast", "reproducible"}, optional
        As the attention calls take it. ``"fast"`` (default): float64 NumPy, a few ulps. ``"reproducible"``:
        the same steps in double-double (:mod:`sdpa_ref.exact.dd`), rounded once: ``out`` and ``lse`` within 1
        ulp of the exact merge of the given parts (``SEMANTICS.md``, "Reproducible precision", for the one
        exemption: an ``out`` entry whose terms cancel by more than about ``2**45``), the same bits on every
        machine, thread count and SIMD level.

    Returns
    -------
    out : ndarray, (..., Hq, L, Ev)
        :math:`\sum_i w_i\, \mathrm{out}_i`, in ``out_parts``' dtype; 0 on a row where every part is empty.
    lse : ndarray, (..., Hq, L)
        :math:`\log \sum_i e^{\mathrm{lse}_i}`, in ``lse_parts``' dtype; ``-inf`` where every part is empty.

    See Also
    --------
    merge_attention_backward : its VJP.
    sdpa_ref.lse.combine_lse : the combine of the normalisers.

    Notes
    -----
    Computed in float64 (lower-precision input is upcast), stably: with :math:`m = \max_i \mathrm{lse}_i`,
    :math:`s = \sum_i e^{\mathrm{lse}_i - m}`, the result is :math:`\mathrm{lse} = m + \log s` and
    :math:`w_i = e^{\mathrm{lse}_i - m} / s` (every exponent at most 0). In base 2, ``exp2`` and ``log2``
    take their place, so no conversion rounds. The conventions:

    * an empty part ``(anything, -inf)`` has weight exactly 0 and its ``out_i`` is not read (it is replaced
      by 0 before any arithmetic), so it is the identity: merging a part with empty parts gives back its own
      bits;
    * merging only empty parts gives ``(0, -inf)``, never NaN;
    * NaN in ``lse_parts`` gives NaN in its row's ``out`` and ``lse``; ``+inf`` is refused;
    * no floating-point warnings; no input is written into.

    References
    ----------
    .. [1] T. Dao et al., "Flash-Decoding for long-context inference" (2023), and FlashAttention's split-KV
       combine kernel (``flash_fwd_splitkv_combine``).
    .. [2] FlashInfer, ``flashinfer.merge_state`` (base-2 log-sum-exps).
    .. [3] xformers, ``xformers.ops.fmha.merge_attentions``.

    Examples
    --------
    Attention over all keys equals the merge of attention over two halves of them:

    >>> import numpy as np, sdpa_ref
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((1, 3, 4)), rng.standard_normal((1, 6, 4)), rng.standard_normal((1, 6, 2))
    >>> halves = [sdpa_ref.scaled_dot_product_attention(q, k[:, s], v[:, s], return_lse=True)
    ...           for s in (slice(0, 3), slice(3, 6))]
    >>> out, lse = merge_attention(np.stack([o for o, _ in halves]), np.stack([l for _, l in halves]))
    >>> ref_out, ref_lse = sdpa_ref.scaled_dot_product_attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, ref_out, rtol=1e-12) and np.allclose(lse, ref_lse, rtol=1e-12))
    True

    An empty part is never read, and only empty parts merge to ``(0, -inf)``:

    >>> merge_attention(np.array([[[np.nan]], [[5.0]]]), np.array([[-np.inf], [1.0]]))
    (array([[5.]]), array([1.]))
    >>> merge_attention(np.full((2, 1, 1), np.nan), np.full((2, 1), -np.inf))
    (array([[0.]]), array([-inf]))
    """
    X, log = _arith(check_base(lse_base, "lse_base"), precision)
    o, lse_in, live, dtypes, _ = _parts(out_parts, lse_parts, axis)
    lse, w, _ = combined_in(X, log, list(lse_in[:, None, ..., None]))       # each part (1, ..., 1)
    out = _merged_in(X, w, o)
    return (round_to(X.value(out)[0], dtypes[0], copy=False),
            round_to(X.value(lse)[0, ..., 0], dtypes[1], copy=False))


def merge_attention_backward(out_parts, lse_parts, grad_out, grad_lse=None, *, lse_base="e", axis=0,
                             precision="fast"):
    r"""The VJP of :func:`merge_attention`: ``(grad_out_parts, grad_lse_parts)``.

    Parameters
    ----------
    out_parts : array_like, (P, ..., Hq, L, Ev)
    lse_parts : array_like, (P, ..., Hq, L)
        As given to :func:`merge_attention` (the forward is recomputed; it costs one pass).
    grad_out : array_like, (..., Hq, L, Ev)
        Cotangent of the merged ``out``. Not read on a row whose parts are all empty (its ``out`` is the
        constant 0).
    grad_lse : array_like, (..., Hq, L), optional
        Cotangent of the merged ``lse`` (in ``lse_base``); None (default) means 0. Not read on a row whose
        parts are all empty.
    lse_base : {"e", 2}, optional
        As in :func:`merge_attention`.
    axis : int, optional
        As in :func:`merge_attention`; the gradients hold the parts on the same axis.
    precision : {"fast", "reproducible"}, optional
        As in :func:`merge_attention`: ``"reproducible"`` evaluates the steps below in double-double (the
        inner products :math:`\langle g, o_i \rangle` of exact products, the pivoted VJP over the
        double-double weights), each gradient rounded once: within 1 ulp of the exact VJP (a ``grad_lse_parts``
        entry whose terms cancel by more than about ``2**45`` excepted), the same bits everywhere.

    Returns
    -------
    grad_out_parts : ndarray, (P, ..., Hq, L, Ev)
        In ``out_parts``' dtype; exactly 0 for an empty part.
    grad_lse_parts : ndarray, (P, ..., Hq, L)
        In ``lse_parts``' dtype; exactly 0 for an empty part.

    Notes
    -----
    Write :math:`g` for ``grad_out``, :math:`\bar\lambda` for ``grad_lse``, :math:`o_i` for ``out_i``,
    :math:`l_i` for ``lse_i`` and :math:`\langle a, b \rangle` for the inner product over ``Ev``.

    1. :math:`\mathrm{out} = \sum_i w_i o_i`, so :math:`\partial\,\mathrm{out} / \partial o_i = w_i` and
       :math:`\bar o_i = w_i\, g`.
    2. :math:`w_i = e^{l_i - \mathrm{lse}}` is the softmax of the :math:`l` over the parts:
       :math:`\partial w_i / \partial l_j = w_i (\delta_{ij} - w_j)`. Through ``out`` each :math:`w_i`
       receives :math:`\bar w_i = \langle g, o_i \rangle`, and the softmax VJP gives
       :math:`w_j (\bar w_j - \sum_i w_i \bar w_i) = w_j (\langle g, o_j \rangle - \langle g, \mathrm{out}
       \rangle)`, since :math:`\sum_i w_i o_i = \mathrm{out}`.
    3. :math:`\partial\,\mathrm{lse} / \partial l_j = e^{l_j - \mathrm{lse}} = w_j`, which adds
       :math:`w_j \bar\lambda`. Together

       .. math:: \bar l_j = w_j \left(\langle g, o_j \rangle - \langle g, \mathrm{out} \rangle\right)
                 + w_j \bar\lambda .

    4. Base 2: :math:`l_i = \lambda_i / \ln 2` with :math:`\lambda_i` the natural log-sum-exps, so
       :math:`w_i = 2^{l_i - \mathrm{lse}}` and :math:`\partial w_i / \partial l_j = \ln 2\; w_i (\delta_{ij} -
       w_j)`, while :math:`\partial\,\mathrm{lse} / \partial l_j = \frac{1}{\ln 2} \cdot w_j \ln 2 = w_j`:
       only the softmax term gains the factor,
       :math:`\bar l_j = \ln 2\; w_j (\langle g, o_j \rangle - \langle g, \mathrm{out} \rangle) + w_j
       \bar\lambda`. Step 1 is unchanged.

    Step 2 is computed as :func:`sdpa_ref.softmax.softmax_vjp` computes it (pivoted at the largest weight),
    through :func:`sdpa_ref.lse.combine_lse_vjp`. An empty part has :math:`w_i = 0` and gets exactly 0
    gradients, its :math:`o_i` unread; a row whose parts are all empty gets 0 gradients and its :math:`g`,
    :math:`\bar\lambda` are unread. NaN in ``lse_parts`` makes its row's gradients NaN.
    """
    base = check_base(lse_base, "lse_base")
    X, log = _arith(base, precision)
    o, lse_in, live, dtypes, axis = _parts(out_parts, lse_parts, axis)
    row = np.any(live, axis=0)                                    # rows with some key in some part
    g = _cotangent(grad_out, "grad_out", o.shape[1:], "merged `out`", row[..., None])
    g_lse = (np.zeros(row.shape) if grad_lse is None
             else _cotangent(grad_lse, "grad_lse", lse_in.shape[1:], "merged `lse`", row))
    _, w, _ = combined_in(X, log, list(lse_in[:, None, ..., None]))          # each w_i (1, ..., 1)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        if X is NUMPY or X is NUMPY2:
            w = np.concatenate(w)
            d_out = w * g                                         # step 1: w_i g
            g_w = np.sum(o * g, axis=-1)                          # <g, o_i>, the cotangent of w_i
            d_lse = combine_lse_vjp(w[..., 0], g_w, g_lse, axis=0, base=base)         # steps 2-4
        else:                                                     # the same in double-double, rounded once
            d_out = np.concatenate([X.value(X.mul_d(wi, g)) for wi in w])
            g_w = [X.sum(X.exact_product(oi, g), axis=-1) for oi in o]
            W = tuple(np.stack([wi[j][0, ..., 0] for wi in w], axis=-1) for j in (0, 1))
            GW = tuple(np.stack([gi[j] for gi in g_w], axis=-1) for j in (0, 1))
            d_lse = np.moveaxis(X.value(combine_lse_vjp_in(X, W, GW, g_lse[..., None], base)), -1, 0)
        d_out = np.where(live[..., None], d_out, 0.0)
        d_lse = np.where(live, d_lse, 0.0)
    if axis:                                                      # the parts back where they came from
        d_out, d_lse = np.moveaxis(d_out, 0, axis), np.moveaxis(d_lse, 0, axis)
    return round_to(d_out, dtypes[0], copy=False), round_to(d_lse, dtypes[1], copy=False)


# ---------------------------------------------------------------- helpers


class _ExactMerge(ExactLSE, DoubleDouble):
    """:class:`sdpa_ref.lse.ExactLSE` (the combine's operations, its ``exp`` and ``log`` in either base) with the
    rest of the double-double arithmetic (:class:`sdpa_ref.exact.arith.DoubleDouble`: products, exact dot
    products, row sums, the pivoted VJP's row pass) for the merged outputs and the VJP."""


def _arith(base, precision):
    """``(X, log)`` of :func:`sdpa_ref.lse.arith_for`, the double-double one widened to :class:`_ExactMerge`."""
    X, log = arith_for(base, precision)
    if isinstance(X, ExactLSE):
        X = _ExactMerge(X.base)
        log = X.log
    return X, log


def _merged_in(X, w, o):
    r""":math:`\sum_i w_i\, o_i` over the arithmetic ``X``, part by part in order (``w`` the list of ``X``
    values ``(1, ..., 1)`` from :func:`sdpa_ref.lse.combined_in`, ``o`` the float64 parts on axis 0)."""
    out = None
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        for wi, oi in zip(w, o):
            t = X.mul_d(wi, oi[None])
            out = t if out is None else X.add(out, t)
    return out


def _parts(out_parts, lse_parts, axis=0):
    """Validate the parts; return them in float64 with the parts on axis 0 (``out`` 0 wherever its part is
    empty: never read), the mask of non-empty parts, the two dtypes of the results, and ``axis`` normalised."""
    out_a = as_float_array(out_parts, "out_parts", min_ndim=2)
    lse_a = as_float_array(lse_parts, "lse_parts", min_ndim=1)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -lse_a.ndim <= axis < lse_a.ndim:
        raise ValueError(f"`axis` should be an int in [{-lse_a.ndim}, {lse_a.ndim - 1}] (an axis of `lse_parts`, "
                         f"shape {lse_a.shape}), but got {axis!r}")
    axis = int(axis) % lse_a.ndim
    if out_a.shape[axis] == 0:
        raise ValueError(f"`out_parts` should have at least one part (P >= 1 on axis {axis}), "
                         f"but got shape {out_a.shape}")
    if lse_a.shape != out_a.shape[:-1]:
        raise ValueError(f"`lse_parts` should have shape {out_a.shape[:-1]}, the shape of `out_parts` "
                         f"{out_a.shape} without its last axis Ev, but got shape {lse_a.shape}")
    lse = lse_a.astype(np.float64)
    if np.any(np.isposinf(lse)):
        at = tuple(int(i) for i in np.argwhere(np.isposinf(lse))[0])
        raise ValueError(f"`lse_parts` should be finite, -inf (an empty part) or NaN, but got +inf at index "
                         f"{at} (a log-sum-exp of finite scores is never +inf; where a kernel writes +inf "
                         "for a row with no key, make it -inf)")
    if axis:                                                      # the parts to the front (views)
        out_a, lse = np.moveaxis(out_a, axis, 0), np.moveaxis(lse, axis, 0)
    live = lse != -np.inf
    o = np.where(live[..., None], out_a.astype(np.float64, copy=False), 0.0)
    return o, lse, live, (out_a.dtype, lse_a.dtype), axis


def _cotangent(x, name, shape, of, read):
    """A cotangent of ``shape`` in float64, 0 where ``read`` is False (never read there)."""
    arr = as_float_array(x, name)
    if arr.shape != shape:
        raise ValueError(f"`{name}` should have the shape {shape} of the {of}, but got shape {arr.shape}")
    return np.where(read, arr.astype(np.float64, copy=False), 0.0)
