r"""The score chain: each score transform's forward, VJP and JVP side by side, and the table of stages.

The scores of attention are built in stages (``SEMANTICS.md``)::

    Traw = scale * Q K^T                 scores_forward      / scores_vjp    / scores_jvp
    T    = cap * tanh(Traw / cap)        softcap_forward     / softcap_vjp   / softcap_jvp    (softcap_sech2,
                                                                       its tangent softcap_sech2_jvp)
    T    = fn(T, b, h, i, j)             score_mod.score_mod_forward (a user's score function; its slope
                                                                       multiplies softcap's)
    T    = T + B                         additive_forward    / additive_vjp  / additive_jvp   (float mask, bias)
    T    = T - slope * |i + off - j|     alibi_forward       (a constant: identity VJP and JVP; cuDNN's
                                                                       signed T + slope * (j - i) with
                                                                       alibi_mode="cudnn")
    T    = -inf outside the allowed set  (masks.allowed_set)

and, after the softmax, dropout ``P_drop = P * Z / (1 - p)``
(:func:`dropout_forward`, linear, so it is its own VJP and JVP).

Every transform after the scale is a :class:`ScoreStage`, one object that
declares its option (name, default, check, documentation), its kind and its
math side by side, and :data:`SCORE_STAGES` is their one ordered table.
A stage is of one of two kinds:

* **element-wise** (curved: softcap, a score function): ``T = f(T; c)``.
  Its forward gives the slope ``f'`` at its input; the chain's slope
  ``sech2`` (``dT / dTraw``) is the product of the stages' slopes, so the
  VJP and the JVP of every element-wise stage together are one product, and
  the second order needs each stage's slope tangent (:attr:`ScoreStage.slope_jvp`).
* **additive** (affine: the float mask, the bias, ALiBi): ``T = T + term``.
  Its VJP is the identity on ``dT``, its JVP adds the term's tangent.

The element-wise stages come first: the additive terms are added to the
curved scores (``SEMANTICS.md``), so ``dT`` reaches them unchanged.

The chains run the table for a problem: :func:`transform_scores` (NumPy, in
place: the teaching core, the fast dense engine and the tiled one, on the
whole ``(..., Hq, L, S)`` score array or one block of it),
:func:`transform_scores_in` (over an arithmetic: the reproducible engine and
the honest ensemble), :func:`transform_scores_vjp`,
:func:`transform_scores_jvp`, and the second order's
:func:`transform_scores_slope_jvp` and :func:`transform_scores_vjp_jvp`.
Adding a transform means one stage in this module (or
:func:`register_score_stage`) and its tests: the chains, the options
(:mod:`sdpa_ref.options` reads each stage's option from the table) and every
engine then have it.

Every function takes an optional ``out=`` so that the fast engine can work
in place; the arithmetic is the same either way. Constants are cast to the
scores' dtype, so ``upcast=False`` computes in the inputs' dtype throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Tuple

import numpy as np

from . import _validate as V
from .arith import NUMPY
from .alignment import diagonal_offset
from .broadcast import block_of, unbroadcast
from .score_mod import as_score_mod, indices, params_vjp, score_mod_curvature, score_mod_forward

__all__ = [
    "ALIBI_MODES",
    "SCORE_STAGES",
    "ScoreBlock",
    "ScoreStage",
    "additive_forward",
    "additive_jvp",
    "additive_vjp",
    "alibi_distance",
    "alibi_forward",
    "check_softcap",
    "dropout_forward",
    "dropout_in",
    "dropout_jvp",
    "dropout_vjp",
    "register_score_stage",
    "scores_forward",
    "scores_jvp",
    "score_mod_params_vjp",
    "scores_vjp",
    "softcap_forward",
    "softcap_jvp",
    "softcap_sech2",
    "softcap_sech2_jvp",
    "softcap_sech2_jvp_in",
    "softcap_vjp",
    "transform_scores",
    "transform_scores_in",
    "transform_scores_jvp",
    "transform_scores_slope_jvp",
    "transform_scores_slope_jvp_in",
    "transform_scores_vjp",
    "transform_scores_vjp_jvp",
    "zero_masked_slope_in",
    "unbroadcast",
    "unregister_score_stage",
]


# ------------------------------------------------------------ a stage, and the block it runs on


class ScoreBlock(NamedTuple):
    """Where a chain runs: the block of the ``(*batch, Hq, L, S)`` scores of ``prob`` selected by ``lead``
    (slices of the leading axes: a chunk of heads), ``rows`` and ``cols`` (``(start, stop)``: a tile; None: all).
    A stage takes its parameters' block from it."""

    prob: Any
    lead: Optional[tuple] = None
    rows: Optional[Tuple[int, int]] = None
    cols: Optional[Tuple[int, int]] = None

    def of(self, a):
        """The block of ``a``, an array broadcastable to the scores (a view; None stays None)."""
        return block_of(a, len(self.prob.full_scores), self.lead, self.rows, self.cols)

    def heads(self, a):
        """The block of ``a`` along the leading axes only (a per-head array, or one already of the tile)."""
        return block_of(a, len(self.prob.full_scores), self.lead)

    def indices(self):
        """``(b, h, q_idx, kv_idx)`` of the block (:func:`sdpa_ref.score_mod.indices`)."""
        return indices(self.prob.full_scores, self.lead, self.rows, self.cols)


@dataclass(frozen=True)
class ScoreStage:
    r"""One stage of the score chain, declared side by side: its option, its kind and its math.

    Parameters
    ----------
    name : str
        The stage's name in the table.
    elementwise : bool
        True: ``T = f(T; c)``, curved, with a slope; False: ``T = T + term``, affine.
    forward : callable
        The NumPy forward, in place. Element-wise: ``forward(t, c, at, slope, slope_out) -> (t, s)``, ``t``
        overwritten by ``f(t; c)`` and ``s`` the slope ``f'(t; c)`` at the input when ``slope`` (written into
        ``slope_out`` when given), else None. Additive: ``forward(t, *terms, out=t) -> t``.
    forward_in : callable, optional
        The same over an arithmetic ``X`` (:mod:`sdpa_ref.arith`). Element-wise:
        ``forward_in(X, t, c, at) -> (t, s)``; additive: ``forward_in(X, t, terms, excluded) -> (t, excluded)``,
        a ``-inf`` term joining ``excluded``. None: not computed over an arithmetic (a ``ValueError`` there).
    option : str, optional
        Element-wise: the keyword of :class:`~sdpa_ref.options.AttentionOptions` holding ``c``; the stage runs
        where it is not None (``opts.<option>``; :func:`register_score_stage` makes it an option).
    default : object
        The option's value when it is not given (None: off).
    check : callable, optional
        ``check(value, name) -> value``: the option validated and normalised (called once, by
        :meth:`~sdpa_ref.options.AttentionOptions.from_kwargs`, on a value that is not None); a
        ``TypeError`` / ``ValueError`` naming ``name``.
    doc : str
        The option's numpydoc entry (indented as the entries of ``DOC_OPTIONS``).
    judged : bool
        Whether the option is in the harness's vocabulary (``OPTION_NAMES``: cases, golden vectors, the C
        client); a NumPy function is not.
    examples : tuple
        Values of the option to test the stage with (the finite-difference grid takes the first).
    slope : callable, optional
        Element-wise: ``slope(t, c, at) -> f'(t; c)``, not in place (the second order recomputes it).
    slope_jvp : callable, optional
        Element-wise, for the second order: ``slope_jvp(t, c, s, dt, at, pre)``, this stage's term of the
        tangent of the chain's slope, ``pre^2 f''(t; c) dt`` with ``s = f'(t; c)``, ``dt`` the raw scores'
        tangent and ``pre`` the product of the slopes of the stages before it (None: it is the first).
        None: no second order through the stage (a ``ValueError`` there).
    slope_jvp_in : callable, optional
        The same over an arithmetic ``X``: ``slope_jvp_in(X, t, c, s, dt, at, pre)`` (values of ``X``); the
        reproducible double backward runs it. None: not over an arithmetic (a ``ValueError`` there).
    terms : callable, optional
        Additive: ``terms(at, dtype) -> tuple of arrays or None``: the problem's term(s) on the block ``at``
        (a :class:`ScoreBlock`), None when the problem has none.
    zero_masked_slope : bool
        Element-wise: the chain's slope is set to 0 outside the allowed set when this stage runs (its slope
        there is never read, and a user's function need not be finite at an excluded score).
    """

    name: str
    elementwise: bool
    forward: Callable
    forward_in: Optional[Callable] = None
    option: Optional[str] = None
    default: Any = None
    check: Optional[Callable] = None
    doc: str = ""
    judged: bool = True
    examples: tuple = ()
    slope: Optional[Callable] = None
    slope_jvp: Optional[Callable] = None
    slope_jvp_in: Optional[Callable] = None
    terms: Optional[Callable] = None
    zero_masked_slope: bool = True

    def __post_init__(self):
        if self.elementwise and (self.option is None or self.slope is None):
            raise ValueError(f"`ScoreStage` {self.name!r}: an element-wise stage should name its `option` and "
                             "give its `slope`")
        if not self.elementwise and self.terms is None:
            raise ValueError(f"`ScoreStage` {self.name!r}: an additive stage should give its `terms`")


# ------------------------------------------------ scores: Traw = scale * Q K^T


def scores_forward(q, k, scale, out=None):
    """``Traw = scale * q k^T``, ``q (..., M, E)``, ``k (..., S, E)`` -> ``(..., M, S)``.

    The scale multiplies the operand with fewer rows (never the ``M x S``
    product): one rounding of ``scale * x`` either way, and less work. A
    score that overflows is IEEE's ``+-inf``, without a warning: ``-inf``
    excludes its key, softcap takes ``+-inf`` to ``+-cap``, and ``+inf``
    otherwise makes its row NaN (``SEMANTICS.md``). Products that overflow
    with opposite signs give ``+inf``, ``-inf`` or NaN (``inf - inf``), as
    the BLAS orders and fuses its sum, also without a warning; each is a
    score the rule takes as it is.
    """
    s = q.dtype.type(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        if q.shape[-2] <= k.shape[-2]:
            return np.matmul(s * q, np.swapaxes(k, -1, -2), out=out)
        return np.matmul(q, np.swapaxes(s * k, -1, -2), out=out)


def scores_vjp(dT, q, k, scale, dq_out=None, dk_out=None):
    """``dq = scale * dT k`` and ``dk = scale * dT^T q`` (per head; the caller sums a GQA group); a product that
    overflows is IEEE's ``+-inf`` or NaN, without a warning, as in :func:`scores_forward`. ``dq_out`` or
    ``dk_out`` False: that one is not computed (None)."""
    s = dT.dtype.type(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        dq = None if dq_out is False else np.multiply(np.matmul(dT, k, out=dq_out), s, out=dq_out)
        dk = None if dk_out is False else np.multiply(transposed_product(dT, q, out=dk_out), s, out=dk_out)
    return dq, dk


def transposed_product(a, b, out=None):
    """``a^T b`` for a tall ``a`` ``(..., M, N)`` and a narrow ``b`` ``(..., M, E)`` -> ``(..., N, E)``: the
    product ``dV = P^T dO`` and ``dK = dT^T Q`` are of this form.

    In float64 it is computed as ``(b^T a)^T``: OpenBLAS runs that product (a short, wide result) faster than the
    one whose first operand is the transposed ``M x N`` matrix; the same sums, another order, so the last bits may
    differ between the two forms as they do between BLAS builds. float32 keeps the direct form, the faster one
    there (timings: docs/performance.md, "Where the numbers in the code went").
    """
    if a.dtype != np.float64:
        return np.matmul(np.swapaxes(a, -1, -2), b, out=out)
    r = np.swapaxes(np.matmul(np.swapaxes(b, -1, -2), a), -1, -2)
    if out is None:
        return np.ascontiguousarray(r)
    np.copyto(out, r)
    return out


def scores_jvp(q, k, dq, dk, scale):
    """``dTraw = scale * (dq k^T + q dk^T)``; ``dq`` or ``dk`` may be None (zero). An overflow (``scale * q``
    beyond the largest float) is IEEE's ``+-inf`` or NaN, without a warning, as in :func:`scores_forward`."""
    s = q.dtype.type(scale)
    t = None
    with np.errstate(over="ignore", invalid="ignore"):
        if dq is not None:
            t = (s * dq) @ np.swapaxes(k, -1, -2)
        if dk is not None:
            u = (s * q) @ np.swapaxes(dk, -1, -2)
            t = u if t is None else t + u
    return t


# ---------------------------------------------- softcap: T = cap * tanh(Traw / cap)


def softcap_forward(t, cap, out=None, tanh_out=None):
    """``(cap * tanh(t / cap), tanh(t / cap))``."""
    c = t.dtype.type(cap)
    with np.errstate(over="ignore"):                       # a tiny cap: t / cap overflows to inf, tanh to 1
        th = np.tanh(np.divide(t, c, out=tanh_out), out=tanh_out)
    return np.multiply(th, c, out=out), th


def softcap_sech2(t, cap, out=None):
    r"""The derivative of softcap at the raw scores ``t``: ``sech^2(t / cap) = 1 - tanh^2(t / cap)``, what its VJP
    and JVP multiply by.

    .. math::

        \frac{d}{dx}\, c \tanh(x / c) = 1 - \tanh^2(y) = \operatorname{sech}^2(y)
        = \frac{1}{\cosh^2 y}, \qquad y = x / c.

    ``1 - tanh^2`` cancels: once ``|y|`` is a few units, ``tanh^2(y)`` is 1
    to within its own rounding, which is then all of the difference (4% off
    at ``|y| = 17.6`` in float64, and 0 from ``|y| = 19.1``, where the
    derivative is still ``1e-16``). ``cosh y = (e^y + e^{-y}) / 2`` is a sum
    of positive terms, within an ulp or so for every ``y``; the reciprocal
    and the square add two roundings: a few ulps everywhere, no
    subtraction. ``cosh`` overflows from ``|y| = 710`` and ``1/cosh`` is
    then 0, as ``sech^2 < 1e-308`` is; the square of ``1/cosh`` underflows
    gradually, not ``cosh``'s square to ``inf``.
    """
    c = t.dtype.type(cap)
    with np.errstate(over="ignore"):                       # cosh overflows to inf: sech^2 is 0 there
        r = np.cosh(np.divide(t, c, out=out), out=out)
        r = np.divide(t.dtype.type(1), r, out=r)
    return np.multiply(r, r, out=r)


def softcap_vjp(sech2, g, out=None):
    """``dTraw = g * sech^2(Traw / cap)`` (:func:`softcap_sech2`: ``1 - tanh^2`` without cancellation)."""
    return np.multiply(g, sech2, out=out)


def softcap_jvp(sech2, dt, out=None):
    """An element-wise map's JVP is the same product as its VJP: ``dT = sech^2(Traw / cap) dTraw``."""
    return softcap_vjp(sech2, dt, out=out)


def softcap_sech2_jvp(t, cap, sech2, dt):
    r"""The tangent of softcap's slope :func:`softcap_sech2` along ``dt`` (the raw scores' tangent), what the
    tangent of softcap's VJP adds (its second derivative):

    .. math::

        \frac{d}{dx}\, \operatorname{sech}^2(x / c) = -\frac{2}{c} \tanh(x / c)\, \operatorname{sech}^2(x / c).

    ``t`` the raw scores, ``sech2`` their slope; both factors are bounded (``|tanh| <= 1``), so no cancellation.
    The division by ``cap`` comes last, so that a tiny cap whose ``2 / cap`` overflows still gives 0 where
    ``tanh * sech^2`` is 0 (not ``inf * 0``).
    """
    c = t.dtype.type(cap)
    with np.errstate(over="ignore", invalid="ignore"):
        th = np.tanh(t / c)
        return (t.dtype.type(-2) * th * sech2 * dt) / c


def softcap_sech2_jvp_in(X, t, cap, sech2, dt):
    r""":func:`softcap_sech2_jvp` over an arithmetic ``X``: :math:`-\tfrac{2}{c} \tanh(t / c)\,
    \operatorname{sech}^2(t / c)\, \dot t`, ``tanh`` of ``t`` clamped as :func:`softcap_forward_in` clamps it
    (``sech2`` is its slope there), the division by ``cap`` last."""
    th = X.tanh(X.div(X.clamp(t, 1024.0 * cap), X.lift(cap)))
    return X.div(X.mul_d(X.mul(X.mul(th, sech2), dt), -2.0), X.lift(cap))


def softcap_forward_in(X, t, cap):
    """``(cap * tanh(t / cap), sech^2(t / cap))`` in the arithmetic ``X`` (``X.sech2``: without cancellation in
    double-double, ``1 - tanh^2`` in a low precision, as such a kernel computes it). Beyond ``|t| = 1024 cap``
    ``tanh`` is 1 and ``sech^2`` 0 in every precision, so ``t`` is clamped there first (a finite argument)."""
    x = X.div(X.clamp(t, 1024.0 * cap), X.lift(cap))
    th = X.tanh(x)
    return X.mul_d(th, cap), X.sech2(x, th)


def check_softcap(x, name):
    """Softcap's cap: a finite real number > 0, or a `TypeError` / `ValueError` naming ``name``."""
    c = V.as_real_scalar(x, name)
    if not (np.isfinite(c) and c > 0):
        raise ValueError(f"`{name}` should be a finite number > 0, but got {c!r}")
    return c


def _softcap(t, cap, at, slope=False, slope_out=None):
    """The stage's forward in place: the slope first (it reads the raw scores), then the capped scores."""
    s = softcap_sech2(t, cap, out=slope_out) if slope else None
    return softcap_forward(t, cap, out=t, tanh_out=t)[0], s


SOFTCAP = ScoreStage(
    name="softcap", elementwise=True, option="softcap", check=check_softcap, examples=(1.5,),
    forward=_softcap,
    forward_in=lambda X, t, cap, at: softcap_forward_in(X, t, cap),
    slope=lambda t, cap, at: softcap_sech2(t, cap),
    slope_jvp=lambda t, cap, s, dt, at, pre: (softcap_sech2_jvp(t, cap, s, dt) if pre is None
                                              else pre * pre * softcap_sech2_jvp(t, cap, s, dt)),
    slope_jvp_in=lambda X, t, cap, s, dt, at, pre: (softcap_sech2_jvp_in(X, t, cap, s, dt) if pre is None else
                                                    X.mul(X.mul(pre, pre), softcap_sech2_jvp_in(X, t, cap, s, dt))),
    zero_masked_slope=False,                      # finite wherever the raw score is: kept as computed
    doc=r"""
        softcap : float > 0
            Scores become ``cap * tanh(scores / cap)`` after scaling, before
            the mask, bias and ALiBi.""")


# ----------------------------------------------- a score function: T = fn(T, b, h, i, j)
# sdpa_ref.score_mod holds its forward, slope, curvature and captured tensors' VJP; the stage runs it on a block.


def _score_mod(t, mod, at, slope=False, slope_out=None):
    """The user's function on the block, its slope beside (into ``slope_out`` when given), the result in ``t``."""
    out, s = score_mod_forward(mod, t, at.indices(), slope)
    if slope and slope_out is not None:
        s = np.copyto(slope_out, s) or slope_out
    np.copyto(t, out)
    return t, s


def _score_mod_in(X, t, mod, at):
    """``fn(t)`` and its slope over ``X``: a NumPy function, so only where ``X`` maps one (``X.elementwise``)."""
    if not hasattr(X, "elementwise"):
        raise ValueError(f"`score_mod` should not be given with this arithmetic ({type(X).__name__}): a NumPy "
                         "function has no double-double or fixed-order low-precision form")
    idx = at.indices()
    return (X.elementwise(lambda u: score_mod_forward(mod, u, idx)[0], t),
            X.elementwise(lambda u: score_mod_forward(mod, u, idx, slope=True)[1], t))


def _score_mod_slope_jvp(t, mod, s, dt, at, pre):
    """``pre^2 fn''(t) dt`` (:func:`~sdpa_ref.score_mod.score_mod_curvature`, cast to the scores' dtype)."""
    fpp = score_mod_curvature(mod, t, at.indices()).astype(t.dtype)
    return fpp * dt if pre is None else pre * pre * fpp * dt


def _score_mod_slope_jvp_in(X, t, mod, s, dt, at, pre):
    """``pre^2 fn''(t) dt`` over ``X``: the curvature the function reports on the scores' values
    (``X.elementwise``: in double-double, on each score rounded to float64, its float64 value taken as exact)."""
    idx = at.indices()
    term = X.mul(X.elementwise(lambda u: score_mod_curvature(mod, u, idx), t), dt)
    return term if pre is None else X.mul(X.mul(pre, pre), term)


SCORE_MOD = ScoreStage(
    name="score_mod", elementwise=True, option="score_mod", check=lambda x, name: as_score_mod(x), judged=False,
    forward=_score_mod, forward_in=_score_mod_in,
    slope=lambda t, mod, at: score_mod_forward(mod, t, at.indices(), slope=True)[1],
    slope_jvp=_score_mod_slope_jvp, slope_jvp_in=_score_mod_slope_jvp_in,
    doc=r"""
        score_mod : callable or ScoreMod
            FlexAttention's score function ``fn(score, b, h, q_idx, kv_idx)``,
            NumPy and vectorised (:mod:`sdpa_ref.score_mod`), applied after
            the scale and softcap, before the float mask, bias, ALiBi and the
            allowed set. A :class:`~sdpa_ref.ScoreMod` adds its derivative
            and captured tensors, whose gradients are ``grads.score_mod``.
            With ``precision="reproducible"``: faithful to the exact
            attention over the function's float64 values.""")


# ------------------------------------------ additive terms: T = T + B (float mask, bias)


def additive_forward(t, b, out=None):
    """``T + B``; ``-inf`` entries of ``B`` exclude their key exactly (``exp(-inf) = 0``), and so does a sum
    that overflows to ``-inf`` (no warning: it is the definition, ``SEMANTICS.md``)."""
    with np.errstate(over="ignore"):
        return np.add(t, b, out=out)


def additive_vjp(g, shape):
    """``dB = dT`` summed back to ``B``'s own (broadcast) shape."""
    return unbroadcast(g, shape)


def additive_jvp(dt, db):
    """``dT + dB`` (``dB`` may be None: a constant term)."""
    return dt if db is None else dt + db


def additive_forward_in(X, t, b, excluded=None):
    """``(t + b, excluded)`` in ``X``: a float ``-inf`` in ``b`` excludes its entry (added as 0, then excluded)."""
    neg = b == -np.inf
    t = X.add_d(t, np.where(neg, 0, b))
    return t, (neg if excluded is None else (excluded | neg))


def _problem_term(field):
    """``terms`` of an additive stage whose term is the problem's array ``field``, broadcast to the scores."""
    def terms(at, dtype):
        b = getattr(at.prob, field)
        return None if b is None else (at.of(b),)
    return terms


def _additive_stage(name, field):
    """The stage ``T = T + prob.<field>`` (the float mask, the bias)."""
    return ScoreStage(name=name, elementwise=False, terms=_problem_term(field),
                      forward=lambda t, b, out=None: additive_forward(t, b, out=out),
                      forward_in=lambda X, t, terms, excluded: additive_forward_in(X, t, *terms, excluded))


MASK_FLOAT = _additive_stage("mask_float", "mask_float")   # a float attn_mask
BIAS = _additive_stage("bias", "bias")


# -------------------------------------- ALiBi: T = T - slope * |i + off - j|


#: Accepted values of ``alibi_mode``: ``"flash"`` adds ``-slope * |i + off - j|`` (FlashAttention, xformers,
#: measured from the diagonal of :mod:`sdpa_ref.alignment`), ``"cudnn"`` the signed ``slope * (j - i)`` of cuDNN's
#: ``alibi_mask`` (no diagonal offset: a key after the query is raised, not lowered).
ALIBI_MODES = ("flash", "cudnn")


def alibi_distance(L, S, alignment="top_left", q_lengths=None, kv_lengths=None, rows=None, cols=None,
                   dtype=np.float64, mode="flash", q_offset=None):
    """The distance ALiBi multiplies by ``-slope``, in ``dtype``, broadcastable to the scores (or to one block of
    them): ``|i + off - j|`` (``mode="flash"``, the offset of :func:`sdpa_ref.alignment.diagonal_offset`), or
    cuDNN's signed ``i - j`` (``mode="cudnn"``: the term ``slope * (j - i)``, with no offset)."""
    i0, i1 = rows if rows is not None else (0, L)
    j0, j1 = cols if cols is not None else (0, S)
    if mode == "cudnn":
        return (np.arange(i0, i1)[:, None] - np.arange(j0, j1)[None, :]).astype(dtype)
    off = diagonal_offset(L, S, alignment, q_lengths, kv_lengths, q_offset)
    return np.abs(np.arange(i0, i1)[:, None] + off - np.arange(j0, j1)[None, :]).astype(dtype)


def alibi_forward(t, slopes, dist, out=None):
    """``T - slope * dist``; ``slopes`` is ``(..., Hq, 1, 1)``. A constant term: its VJP and JVP are the identity.

    A term that overflows (a slope of ``1e308``) makes the score ``-inf``, which excludes the key (``+inf``
    where cuDNN's signed distance is negative, which makes the row NaN, as any ``+inf`` score does).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return np.subtract(t, slopes * dist, out=out)


def alibi_forward_in(X, t, slopes, dist):
    """``t - slope * dist`` in ``X``, the product exact in double-double; a term that overflows makes ``-inf``."""
    ab = X.exact_product(slopes, dist)
    over = np.isinf(X.value(ab))                 # t - inf in float64: -inf, or NaN where t is +inf (as NumPy's chain)
    return X.where(over, X.add_d(X.neg(ab), np.where(over, X.value(t), 0)), X.sub(t, ab))


def _alibi_terms(at, dtype):
    """The block's slopes ``(..., Hq, 1, 1)`` and distances (:func:`alibi_distance`, in ``dtype``), or None."""
    p = at.prob
    if p.alibi is None:
        return None
    o = p.options
    dist = alibi_distance(p.L, p.S, o.causal_alignment, p.q_lengths, p.kv_lengths, at.rows, at.cols, dtype=dtype,
                          mode=o.alibi_mode, q_offset=p.q_offset)
    return at.heads(p.alibi), at.heads(dist)


ALIBI = ScoreStage(name="alibi", elementwise=False, terms=_alibi_terms, forward=alibi_forward,
                   forward_in=lambda X, t, terms, excluded: (alibi_forward_in(X, t, *terms), excluded))


# ------------------------------------------- dropout: P_drop = P * Z / (1 - p)


def dropout_forward(x, keep, p, out=None):
    """``x * Z / (1 - p)`` with ``Z`` the bool keep mask; ``x`` itself without one.

    A multiply, not ``np.where``, so that a NaN row stays NaN as the formula says (``NaN * 0`` on a dropped
    entry): a ``"nan"``-policy row whose every key is dropped is NaN, as on every engine and precision. The
    factor ``Z / (1 - p)`` is rounded once to ``x``'s dtype (:meth:`sdpa_ref.arith.NumPyArith.div_masked`).
    """
    return x if keep is None else NUMPY.div_masked(x, keep, 1.0, -p, out=out)


def dropout_in(X, x, keep, p):
    """:func:`dropout_forward` over the arithmetic ``X`` (:mod:`sdpa_ref.arith`): ``x * Z / (1 - p)``, the keep
    probability ``1 - p`` passed as the sum ``1 + (-p)`` (exact in double-double); ``x`` itself without a mask."""
    return x if keep is None else X.div_masked(x, keep, 1.0, -p)


def dropout_vjp(g, keep, p, out=None):
    """Dropout is a diagonal linear map: its VJP is the same product."""
    return dropout_forward(g, keep, p, out=out)


dropout_jvp = dropout_vjp


# ------------------------------------------------------------ the table


#: The score chain's stages in order: the element-wise ones, then the additive ones (``SEMANTICS.md``). Every
#: chain below runs over it, and :mod:`sdpa_ref.options` takes the element-wise stages' options from it;
#: :func:`register_score_stage` adds one.
SCORE_STAGES = [SOFTCAP, SCORE_MOD, MASK_FLOAT, BIAS, ALIBI]


def register_score_stage(stage, before=None):
    """Add ``stage`` to :data:`SCORE_STAGES`; returns it.

    Every engine and chain computes it from then on, and its option is an
    option of :meth:`~sdpa_ref.options.AttentionOptions.from_kwargs` (checked
    by the stage's ``check``) and an attribute of the options. ``before``
    names the stage it goes before; by default it goes after the last stage
    of its kind. The element-wise stages stay before the additive ones, and
    names and options stay unique. The built-in stages are declared in this
    module; this hook is for a stage defined elsewhere (a test, an
    experiment), which :func:`unregister_score_stage` takes out again. The
    harness's vocabulary (``OPTION_NAMES``) is fixed when the package is
    imported: it holds the built-in stages' options only.
    """
    if not isinstance(stage, ScoreStage):
        raise TypeError(f"`stage` should be a ScoreStage, but got {V.describe(stage)}")
    taken = [s.name for s in SCORE_STAGES if s.name == stage.name] + \
        [s.option for s in SCORE_STAGES if stage.option is not None and s.option == stage.option]
    if taken:
        raise ValueError(f"`stage` should have a new name and option, but {taken[0]!r} is taken")
    names = [s.name for s in SCORE_STAGES]
    if before is None:
        i = sum(s.elementwise for s in SCORE_STAGES) if stage.elementwise else len(SCORE_STAGES)
    elif before in names:
        i = names.index(before)
    else:
        raise ValueError(f"`before` should name a stage of {names}, but got {before!r}")
    kinds = [s.elementwise for s in SCORE_STAGES[:i]] + [stage.elementwise] + [s.elementwise for s in SCORE_STAGES[i:]]
    if kinds != sorted(kinds, reverse=True):
        raise ValueError(f"`before` should keep the element-wise stages before the additive ones, but got {before!r}")
    SCORE_STAGES.insert(i, stage)
    return stage


def unregister_score_stage(name):
    """Take the stage named ``name`` out of :data:`SCORE_STAGES`; returns it."""
    for i, s in enumerate(SCORE_STAGES):
        if s.name == name:
            return SCORE_STAGES.pop(i)
    raise ValueError(f"`name` should name a stage of {[s.name for s in SCORE_STAGES]}, but got {name!r}")


def _running(o):
    """The element-wise stages that run under the options ``o``, with their parameters, in order."""
    return [(st, c) for st in SCORE_STAGES if st.elementwise and (c := getattr(o, st.option)) is not None]


# ------------------------------------------------------------ the chains


def transform_scores(prob, T, rows=None, cols=None, lead=None, sech2=False, sech2_out=None, allowed=None):
    """Raw scores ``Traw`` -> ``(T, sech2)``: the whole chain (:data:`SCORE_STAGES`), written into ``T``.

    ``T`` is the scores of the block of the ``(*batch, Hq, L, S)`` scores
    selected by ``lead`` (slices of the leading axes: a chunk of heads),
    ``rows`` and ``cols`` (``(start, stop)``: a tile); the default is all of
    it. ``allowed`` is the block's allowed set when the caller has it
    already. With ``sech2=True`` (a backward or a JVP will follow), ``sech2``
    is the slope of the chain's element-wise part, ``dT / dTraw`` before the
    additive terms: the product of the element-wise stages' slopes (softcap's
    :func:`softcap_sech2` times the score function's derivative,
    :mod:`sdpa_ref.score_mod`), written into ``sech2_out`` if given; None
    when no element-wise stage runs.
    """
    o, block = prob.options, (rows, cols)                   # as asked: a whole problem is no tile of a block mask
    at = ScoreBlock(prob, lead, rows if rows is not None else (0, prob.L), cols if cols is not None else (0, prob.S))
    d, slope, zero, dt = None, sech2 or sech2_out is not None, False, T.real.dtype
    for st in SCORE_STAGES:
        if st.elementwise:                                   # f(T): its slope multiplies the chain's
            c = getattr(o, st.option)
            if c is not None:
                T, s = st.forward(T, c, at, slope, sech2_out if d is None else None)
                if slope:
                    d = s if d is None else np.multiply(d, s, out=d)
                zero = zero or st.zero_masked_slope
        else:                                                # T + term
            terms = st.terms(at, dt)
            if terms is not None:
                T = st.forward(T, *terms, out=T)
    if allowed is None:
        allowed = block_of(prob.allowed(*block), len(prob.full_scores), lead)
    if allowed is not None:
        np.copyto(T, -np.inf, where=~allowed)
        if zero and d is not None:                           # a masked entry's slope is never read: 0, not NaN
            np.copyto(d, 0, where=~allowed)
    return T, d


def score_mod_params_vjp(prob, g, Traw, rows=None, cols=None, acc=None):
    """The score function's captured tensors' gradients (:func:`sdpa_ref.score_mod.params_vjp`) from ``g``, the
    gradient of the block's final scores (the additive terms pass it on unchanged), and its raw scores ``Traw``
    (overwritten: the element-wise stages before it are recomputed on them for the function's input); added to
    the list ``acc`` (None: a new one). None when the problem's score function captures nothing."""
    o = prob.options
    mod = o.score_mod
    if mod is None or not mod.params:
        return acc
    at, t = ScoreBlock(prob, None, rows, cols), Traw
    for st, c in _running(o):
        if st is SCORE_MOD:
            break
        t = st.forward(t, c, at)[0]
    got = params_vjp(mod, g, t, at.indices())
    return list(got) if acc is None else [a + b for a, b in zip(acc, got)]


def transform_scores_in(X, prob, T, lead=None, rows=None, excluded=None):
    """The chain of :func:`transform_scores` over an arithmetic ``X`` (:mod:`sdpa_ref.arith`): the raw scores
    ``T`` of one block (``lead``: slices of the leading ``(*batch, Hq)`` axes, ``rows``: ``(start, stop)``; every
    key; the default is all) -> ``(T, excluded, sech2)``.

    The same stages in the same order as :func:`transform_scores`, each by its definition over an arithmetic
    (its ``forward_in``: :func:`softcap_forward_in`, :func:`additive_forward_in`, :func:`alibi_forward_in`; a
    stage without one is a ``ValueError``). ``excluded`` is the block's complement of the allowed set (None:
    nothing); every score that is ``-inf`` after the chain (a ``-inf`` float-mask or bias entry, a sum or an
    ALiBi term that overflows) joins it, as on every path (None where ``excluded`` is None and no score is). ``sech2`` is the element-wise stages' slope, None
    without one. The reproducible engine's dense schedule (in double-double, the honest low precision, or the
    arithmetic of reads) and the honest ensemble run it.
    """
    o, at, d = prob.options, ScoreBlock(prob, lead, rows), None
    for st in SCORE_STAGES:
        if st.elementwise:
            c = getattr(o, st.option)
            if c is None:
                continue
            _has_form_in(st, X)
            T, s = st.forward_in(X, T, c, at)
            d = s if d is None else X.mul(d, s)
        else:
            terms = st.terms(at, np.float64)
            if terms is not None:
                _has_form_in(st, X)
                T, excluded = st.forward_in(X, T, terms, excluded)
    neg = X.value(T) == -np.inf
    if excluded is None:                               # None where nothing is: no pass over the block masks it
        return T, (neg if neg.any() else None), d
    return T, excluded | neg, d


def _has_form_in(stage, X):
    if stage.forward_in is None:
        raise ValueError(f"`{stage.option or stage.name}` should not be given with this arithmetic "
                         f"({type(X).__name__}): the score stage {stage.name!r} has no form over an arithmetic")


def transform_scores_vjp(dT, sech2, out=None, X=None):
    """``dT`` (the gradient of the final scores) -> ``dTraw``: times the chain's slope when an element-wise stage
    runs (``sech2``, from :func:`transform_scores`); over the arithmetic ``X`` when given (``out`` unused).

    The additive terms' gradient is ``dT`` itself (:func:`additive_vjp`);
    ALiBi and the -inf exclusions are constants.
    """
    if X is not None:
        return dT if sech2 is None else X.mul(dT, sech2)
    return dT if sech2 is None else softcap_vjp(sech2, dT, out=out)


def transform_scores_jvp(dTraw, sech2, dB=None, X=None):
    """``dTraw`` -> ``dT``: times the chain's slope, plus the additive terms' tangent (the bias's, a float array);
    over the arithmetic ``X`` when given."""
    if X is not None:
        dT = dTraw if sech2 is None else X.mul(dTraw, sech2)
        return dT if dB is None else X.add_d(dT, dB)
    dT = dTraw if sech2 is None else softcap_jvp(sech2, dTraw)
    return additive_jvp(dT, dB)


def transform_scores_slope_jvp(prob, Traw, slope, dTraw, rows=None, cols=None, allowed=None):
    """The tangent of the chain's slope (:func:`transform_scores`' ``sech2``, ``prod_k f_k'(u_{k-1})``, ``u_k``
    the scores after stage ``k``, ``u_0 = Traw``) along the raw scores' tangent, by the product and chain rules:
    ``sum_k (prod_{j<k} f_j')^2 f_k''(u_{k-1}) (prod_{j>k} f_j') dTraw``, each stage's middle factor its
    ``slope_jvp`` (softcap's :func:`softcap_sech2_jvp`, the score function's
    :func:`~sdpa_ref.score_mod.score_mod_curvature`); 0 outside ``allowed`` where a stage says so
    (``zero_masked_slope``); None without a slope. With one stage its slope is the chain's, ``slope``."""
    if slope is None:
        return None
    at, run = ScoreBlock(prob, None, rows, cols), _running(prob.options)
    for st, _ in run:
        if st.slope_jvp is None:
            raise ValueError(f"`{st.option}` should not be given to a second-order call: the score stage "
                             f"{st.name!r} has no slope tangent (`slope_jvp`)")
    if len(run) == 1:
        st, c = run[0]
        d = st.slope_jvp(Traw, c, slope, dTraw, at, None)
    else:
        u, ins, slopes = Traw, [], []
        for k, (st, c) in enumerate(run):                    # each stage's input u_{k-1} and slope f_k'
            ins.append(u)
            slopes.append(st.slope(u, c, at))
            if k + 1 < len(run):
                u = st.forward(u.copy(), c, at)[0]
        d = pre = None
        with np.errstate(invalid="ignore", over="ignore"):
            for k, (st, c) in enumerate(run):
                term = st.slope_jvp(ins[k], c, slopes[k], dTraw, at, pre)
                post = None
                for s in slopes[k + 1:]:
                    post = s if post is None else post * s
                term = term if post is None else term * post
                d = term if d is None else d + term
                pre = slopes[k] if pre is None else pre * slopes[k]
    if allowed is None or not any(st.zero_masked_slope for st, _ in run):
        return d
    return np.where(allowed, d, d.dtype.type(0))


def transform_scores_vjp_jvp(dT, ddT, sech2, dsech2, X=None):
    """The tangent of :func:`transform_scores_vjp`: ``ddT`` (the tangent of ``dT``) times the chain's slope, plus
    ``dT`` times the tangent of the slope (``dsech2``, :func:`transform_scores_slope_jvp`). The additive terms
    are linear in the scores, so their second derivative is 0. Over the arithmetic ``X`` when given."""
    if X is not None:
        return ddT if sech2 is None else X.add(X.mul(ddT, sech2), X.mul(dT, dsech2))
    return ddT if sech2 is None else softcap_vjp(sech2, ddT) + dT * dsech2


def transform_scores_slope_jvp_in(X, prob, Traw, slope, dTraw, lead=None, rows=None, allowed=None):
    """:func:`transform_scores_slope_jvp` over an arithmetic ``X`` (values of ``X``; the block of
    :func:`transform_scores_in`: ``lead``, ``rows``, every key): the same sum over the running element-wise stages,
    each stage's input and slope from its ``forward_in`` and its term from its ``slope_jvp_in``; 0 outside
    ``allowed`` (the block's allowed set, or None) where a stage says so (``zero_masked_slope``: never read, and
    a user's function need not be finite there). None without a slope."""
    if slope is None:
        return None
    at, run = ScoreBlock(prob, lead, rows), _running(prob.options)
    for st, _ in run:
        if st.slope_jvp_in is None:
            raise ValueError(f"`{st.option}` should not be given to a second-order call in this arithmetic "
                             f"({type(X).__name__}): the score stage {st.name!r} has no slope tangent over an "
                             "arithmetic (`slope_jvp_in`)")
    if len(run) == 1:
        st, c = run[0]
        d = st.slope_jvp_in(X, Traw, c, slope, dTraw, at, None)
    else:
        u, ins, slopes = Traw, [], []
        for st, c in run:                                   # each stage's input u_{k-1} and slope f_k'
            ins.append(u)
            u, s = st.forward_in(X, u, c, at)
            slopes.append(s)
        d = pre = None
        for k, (st, c) in enumerate(run):
            term = st.slope_jvp_in(X, ins[k], c, slopes[k], dTraw, at, pre)
            for s in slopes[k + 1:]:
                term = X.mul(term, s)
            d = term if d is None else X.add(d, term)
            pre = slopes[k] if pre is None else X.mul(pre, slopes[k])
    if allowed is None or not any(st.zero_masked_slope for st, _ in run):
        return d
    return X.where(allowed, d, X.const(0.0))


def zero_masked_slope_in(X, prob, slope, allowed):
    """The chain's ``slope`` (a value of ``X``, or None) 0 outside ``allowed`` (None: everywhere allowed) when a
    running stage says so (``zero_masked_slope``), as :func:`transform_scores` makes it: never read there, and a
    user's function need not be finite at an excluded score."""
    if slope is None or allowed is None or not any(st.zero_masked_slope for st, _ in _running(prob.options)):
        return slope
    return X.where(allowed, slope, X.const(0.0))
