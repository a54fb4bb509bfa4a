r"""Programmable attention: a score function (FlexAttention's ``score_mod``) and a mask function (``mask_mod``).

A **score function** ``fn(score, b, h, q_idx, kv_idx, *params)`` maps the
scores element-wise, written with NumPy and vectorised: ``score`` is a block
of scores ``(*batch, Hq, Lb, Sb)`` (read-only), ``b``, ``h``, ``q_idx`` and
``kv_idx`` are int64 index arrays that broadcast against it (the flat batch
index, the query head, the query row and the key column), and ``params`` the
tensors it captures (a learned bias table, slopes), whose gradients the
backward returns. It runs after the scale and softcap and before the float
mask, the bias, ALiBi and the allowed set (FlexAttention's place: after the
scale, before the mask)::

    T = fn(softcap(scale Q K^T)) + attn_mask + bias - ALiBi,  -inf outside the allowed set

so its derivative is one more element-wise slope, multiplied into softcap's
(:func:`transform_slope`), and the engines' VJP and JVP through the scores
need nothing new; the captured tensors' gradient is
:math:`\sum_{b h i j} dT_{bhij}\, \partial f_{bhij} / \partial \theta` (:func:`params_vjp`).

Its derivative in the score, ``grad``, is the user's, or (None) the complex
step :math:`\operatorname{Im} f(x + i\eta) / \eta`, exact to rounding where
``fn`` is analytic and checked on every call against central differences, so
that a function that is not (``abs``, ``where`` or ``maximum`` on the score)
is an error asking for ``grad=``, not a wrong gradient. The captured tensors'
VJP likewise: the user's ``params_vjp``, or the complex step one entry at a
time (a cost of one evaluation per entry: for small tables).
:func:`sdpa_ref.gradcheck.check_score_mod` checks a user's derivatives by finite differences.

With ``precision="reproducible"`` the function runs in float64 on each score rounded to float64 (the
double-double's high part, :meth:`sdpa_ref.exact.arith.DoubleDouble.elementwise`), and its values and slope
are taken as exact: the results are faithfully rounded with respect to the exact attention over the function's
float64 values, the same bits everywhere when the function's own are (``SEMANTICS.md``). Its own rounding,
and NumPy's ``exp`` or ``tanh`` changing with the SIMD level, are outside that guarantee.

A **mask function** ``mask_mod(b, h, q_idx, kv_idx) -> bool`` joins the
allowed set (an intersection, as every mask does: :func:`sdpa_ref.masks.allowed_set`),
so every engine, the reads of :mod:`sdpa_ref.unread` and the fully masked
policy see it as they see a bool mask.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from . import _validate as V

__all__ = ["ScoreMod", "apply_mask_mod", "as_score_mod", "complex_step_slope", "indices",
           "score_mod_curvature",
           "params_vjp", "score_mod_forward"]

#: The complex step's imaginary increment (relative to max(1, |score|)).
_ETA = 2.0 ** -80
#: Largest number of captured-tensor entries whose VJP the complex step computes one by one.
_MAX_STEPPED = 1 << 14


class ScoreMod:
    """A score function with its derivatives and captured tensors.

    Parameters
    ----------
    fn : callable
        ``fn(score, b, h, q_idx, kv_idx, *params) -> array`` broadcastable
        to ``score``'s shape, element-wise in ``score``.
    grad : callable, optional
        ``grad(score, b, h, q_idx, kv_idx, *params)``: the derivative of
        ``fn`` in ``score``, element by element. None: the complex step,
        checked against central differences on every call.
    params : sequence of array_like, optional
        The tensors ``fn`` captures, passed after the indices; their
        gradients are returned by :func:`sdpa_ref.sdpa_backward` as
        ``grads.score_mod``. Copied here; cast to the compute dtype.
    params_vjp : callable, optional
        ``params_vjp(g, score, b, h, q_idx, kv_idx, *params) -> tuple``:
        :math:`\\sum g\\, \\partial f / \\partial \\theta` for each captured
        tensor, in its shape. None: the complex step, one entry at a time.
    grad2 : callable, optional
        ``grad2(score, b, h, q_idx, kv_idx, *params)``: the second
        derivative in ``score``, for second order
        (:func:`sdpa_ref.sdpa_backward_jvp`). None: the complex step on
        ``grad``, checked against central differences (second order then
        needs ``grad``).
    name : str, optional
        For messages.
    """

    def __init__(self, fn: Callable, grad: Optional[Callable] = None, params=(), params_vjp: Optional[Callable] = None,
                 name: Optional[str] = None, grad2: Optional[Callable] = None):
        for arg, f in (("fn", fn), ("grad", grad), ("params_vjp", params_vjp), ("grad2", grad2)):
            if f is not None and not callable(f):
                raise TypeError(f"`{arg}` should be a callable, but got {V.describe(f)}")
        if fn is None:
            raise TypeError("`fn` should be a callable, but got None")
        if not isinstance(params, (tuple, list)):
            raise TypeError(f"`params` should be a tuple of arrays, but got {V.describe(params)}")
        own = []
        for i, p in enumerate(params):
            a = np.array(V.as_float_array(p, f"params[{i}]"), dtype=np.float64)
            if not np.all(np.isfinite(a)):
                raise ValueError(f"`params[{i}]` should be finite, but got non-finite entries")
            a.flags.writeable = False
            own.append(a)
        self.fn, self.grad, self.params, self.params_vjp, self.grad2 = fn, grad, tuple(own), params_vjp, grad2
        self.name = name or getattr(fn, "__name__", "score_mod")

    def __repr__(self):
        return f"ScoreMod({self.name}, params={[p.shape for p in self.params]})"


def as_score_mod(x) -> Optional[ScoreMod]:
    """``score_mod=``: None, a :class:`ScoreMod`, or a bare callable (no captured tensors, complex-step slope)."""
    if x is None or isinstance(x, ScoreMod):
        return x
    if callable(x):
        return ScoreMod(x)
    raise TypeError(f"`score_mod` should be a callable fn(score, b, h, q_idx, kv_idx) or a ScoreMod, "
                    f"but got {V.describe(x)}")


def indices(full, lead=None, rows=None, cols=None):
    """``(b, h, q_idx, kv_idx)`` int64 index arrays of the block (``lead``: slices of the ``(*batch, Hq)`` axes;
    ``rows``, ``cols``: ``(start, stop)``) of scores of shape ``full`` ``(*batch, Hq, L, S)``, each broadcastable
    to the block: the flat batch index, the query head, the query row and the key column."""
    batch, Hq, L, S = full[:-3], full[-3], full[-2], full[-1]
    i0, i1 = rows if rows is not None else (0, L)
    j0, j1 = cols if cols is not None else (0, S)
    b = np.arange(int(np.prod(batch, dtype=np.int64)), dtype=np.int64).reshape(batch + (1, 1, 1))
    h = np.arange(Hq, dtype=np.int64).reshape(Hq, 1, 1)
    if lead is not None:
        nb = len(batch)
        b = b[tuple(lead[:nb]) + (slice(None),) * 3] if nb else b
        h = h[(lead[nb] if len(lead) > nb else slice(None),)]
    return b, h, np.arange(i0, i1, dtype=np.int64)[:, None], np.arange(j0, j1, dtype=np.int64)[None, :]


def _call(mod, score, idx, params, what="score_mod", f=None):
    """``f`` (the score function by default) on a block, its result checked: real numbers (complex only for
    complex scores), broadcastable to the block; a write into ``score`` is a clear error."""
    try:
        r = (mod.fn if f is None else f)(score, *idx, *params)
    except ValueError as e:
        if "read-only" in str(e):
            raise ValueError(f"`{what}` should not write into its `score` argument (it is read-only), but it "
                             f"did: {e}") from None
        raise
    r = np.asarray(r)
    if r.dtype.kind not in "fiu" + ("c" if np.iscomplexobj(score) else ""):
        raise TypeError(f"`{what}` should return real numbers, but returned {V.describe(r)}")
    try:
        return np.broadcast_to(r, score.shape)
    except ValueError:
        raise ValueError(f"`{what}` should return an array broadcastable to the scores' block {score.shape}, "
                         f"but returned shape {r.shape}") from None


def _readonly(x):
    x = x.view()
    x.flags.writeable = False
    return x


def score_mod_forward(mod, t, idx, slope=False):
    """``(fn(t), its derivative in t or None)`` for the block ``t`` with index arrays ``idx``; the value in
    ``t``'s dtype (one rounding). The derivative (with ``slope``) is the user's ``grad``, or the complex step
    checked against central differences (float64 throughout, then cast)."""
    ps = tuple(p.astype(t.dtype, copy=False) for p in mod.params)
    with np.errstate(over="ignore", invalid="ignore"):
        out = _call(mod, _readonly(t), idx, ps).astype(t.dtype, copy=False)
    if not slope:
        return out, None
    if mod.grad is not None:
        return out, _call(mod, _readonly(t), idx, ps, f"grad of {mod.name}", mod.grad).astype(t.dtype)
    return out, complex_step_slope(mod, t, idx).astype(t.dtype)


def score_mod_curvature(mod, t, idx):
    """``d^2 fn / d score^2`` on the block ``t`` (float64): the user's ``grad2``, or the complex step on ``grad``
    checked against its central differences; a ``ValueError`` when the function has neither (second order needs
    one of them)."""
    ps = tuple(p.astype(t.dtype, copy=False) for p in mod.params)
    if mod.grad2 is not None:
        return _call(mod, _readonly(t), idx, ps, f"grad2 of {mod.name}", mod.grad2).astype(np.float64)
    if mod.grad is None:
        raise ValueError(f"`score_mod` {mod.name} should have its derivative for second order: give "
                         "ScoreMod(fn, grad=...) (its second derivative is then the complex step on grad) or grad2=")
    return complex_step_slope(ScoreMod(mod.grad, params=mod.params, name=f"grad of {mod.name}"), t, idx)


def complex_step_slope(mod, t, idx):
    """``d fn / d score`` by the complex step, in float64, checked against central differences where the score and
    the slope are finite; a ``ValueError`` where they disagree (``fn`` is not analytic there)."""
    x = t.astype(np.float64)
    ps = tuple(mod.params)
    eta = _ETA * np.maximum(1.0, np.abs(np.where(np.isfinite(x), x, 0.0)))
    with np.errstate(over="ignore", invalid="ignore"):
        try:
            d = np.asarray(_call(mod, x + 1j * eta, idx, ps)).imag / eta
        except TypeError as e:
            raise ValueError(f"`score_mod` {mod.name} could not be evaluated at complex scores for its derivative "
                             f"by the complex step ({e}): give ScoreMod(fn, grad=...)") from None
        h = 2.0 ** -20 * np.maximum(1.0, np.abs(np.where(np.isfinite(x), x, 0.0)))
        fp, fm = (np.asarray(_call(mod, x + s * h, idx, ps), np.float64) for s in (1, -1))
        fd = (fp - fm) / (2 * h)
        tol = _tolerance(d, fp, fm, h)
    ok = np.isfinite(x) & np.isfinite(d) & np.isfinite(fd)
    bad = ok & (np.abs(d - fd) > tol)
    if np.any(bad):
        at = tuple(int(a[0]) for a in np.nonzero(bad))
        raise ValueError(f"`score_mod` {mod.name} is not analytic at score {x[at]!r} (index {at}): its complex step "
                         f"gives the slope {d[at]!r}, central differences {fd[at]!r}; give ScoreMod(fn, grad=...)")
    return d


def _tolerance(d, fp, fm, h):
    """How far a central difference ``(fp - fm) / 2h`` may be from a derivative ``d``: ``1e-5`` relative (the
    truncation of a step of ``2^-20``), plus the rounding of ``fp`` and ``fm`` divided by the step (a large
    value, such as a score function's ``-1e9`` penalty, rounds by more than the slope it differences)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return 1e-5 * np.maximum(1.0, np.abs(d)) + 8 * np.finfo(np.float64).eps * (np.abs(fp) + np.abs(fm)) / (2 * h)


def params_vjp(mod, g, t, idx):
    """The captured tensors' gradients ``sum g * d fn / d theta`` (a tuple, each in its tensor's shape, float64)
    for the block ``t`` (``fn``'s input) with cotangent ``g`` (0 where ``g`` is 0, whatever the derivative)."""
    ps = tuple(p.astype(t.dtype, copy=False) for p in mod.params)
    if mod.params_vjp is not None:
        got = mod.params_vjp(_readonly(g), _readonly(t), *idx, *ps)
        if not isinstance(got, (tuple, list)) or len(got) != len(ps):
            raise TypeError(f"`params_vjp` of {mod.name} should return a tuple of {len(ps)} arrays, but got "
                            f"{V.describe(got)}")
        out = []
        for i, (a, p) in enumerate(zip(got, ps)):
            a = np.asarray(a, dtype=np.float64)
            if a.shape != p.shape:
                raise ValueError(f"`params_vjp` of {mod.name} should return params[{i}]'s shape {p.shape}, but "
                                 f"returned shape {a.shape}")
            out.append(a)
        return tuple(out)
    n = sum(p.size for p in mod.params)
    if n > _MAX_STEPPED:
        raise ValueError(f"`score_mod` {mod.name} captures {n} entries, more than the {_MAX_STEPPED} whose gradient "
                         "the complex step computes one by one: give ScoreMod(..., params_vjp=...)")
    x, gg = t.astype(np.float64), g.astype(np.float64)
    live = gg != 0

    def loss(k, q):                                        # sum g * fn over the live entries, with params[k] = q
        with np.errstate(over="ignore", invalid="ignore"):
            r = np.asarray(_call(mod, x.astype(q.dtype), idx, mod.params[:k] + (q,) + mod.params[k + 1:]))
            return np.sum(np.where(live, gg * r, 0.0)), np.sum(np.where(live, np.abs(gg * r), 0.0))

    out = []
    for k, p in enumerate(mod.params):
        grad = np.zeros(p.shape)
        for e in range(p.size):
            eta = _ETA * max(1.0, abs(float(p.flat[e])))
            q = p.astype(np.complex128)
            q.flat[e] += 1j * eta
            grad.flat[e] = loss(k, q)[0].imag / eta
            h = 2.0 ** -20 * max(1.0, abs(float(p.flat[e])))           # checked, as the score's slope is
            (lp, ap), (lm, am) = (loss(k, p + s * h * (np.arange(p.size) == e).reshape(p.shape)) for s in (1, -1))
            fd = (lp - lm) / (2 * h)
            if np.isfinite(grad.flat[e]) and np.isfinite(fd) and abs(grad.flat[e] - fd) > _tolerance(
                    grad.flat[e], ap, am, h):
                raise ValueError(f"`score_mod` {mod.name} is not analytic in params[{k}] at index "
                                 f"{np.unravel_index(e, p.shape)}: its complex step gives {grad.flat[e]!r}, central "
                                 f"differences {fd!r}; give ScoreMod(..., params_vjp=...)")
        out.append(grad)
    return tuple(out)


def apply_mask_mod(mask_mod, full, rows=None, cols=None):
    """The mask function's allowed set of a block of the scores ``full`` ``(*batch, Hq, L, S)``: bool,
    broadcastable to the block, checked."""
    r = mask_mod(*indices(full, None, rows, cols))
    r = np.asarray(r)
    if r.dtype != bool:
        raise TypeError(f"`mask_mod` should return bool (True: the key takes part), but returned dtype {r.dtype}")
    i0, i1 = rows if rows is not None else (0, full[-2])
    j0, j1 = cols if cols is not None else (0, full[-1])
    want = full[:-2] + (i1 - i0, j1 - j0)
    try:
        np.broadcast_to(r, want)
    except ValueError:
        raise ValueError(f"`mask_mod` should return a bool array broadcastable to the scores' block {want}, but "
                         f"returned shape {r.shape}") from None
    return r

