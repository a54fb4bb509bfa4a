r"""check_hvp: a Hessian-vector product against finite differences of the gradient.

For a function ``fun`` and a cotangent ``g`` of its output, the scalar loss
:math:`\mathcal{L}(x) = \langle g, f(x)\rangle` has the gradient
:math:`G(x) = J_f(x)^\top g`, which is what ``vjp(g, *args)`` returns, and the
Hessian :math:`H = \partial G / \partial x`. A Hessian-vector product
``hvp(g, tangents, *args)`` returns :math:`H v`: the forward-mode derivative
(JVP) of the VJP along ``v``, one array per arg. So the check is
:func:`sdpa_ref.check_jvp` applied to the function ``x -> vjp(g, *x)`` (every
gradient flattened and joined) with ``hvp`` as its JVP: central differences of
the VJP, whole or along random directions, entry by entry under the usual rule.

A Hessian is symmetric, :math:`\langle u, H v\rangle = \langle H u, v\rangle`,
which needs no finite difference: the check also compares the two for random
``u`` and ``v`` (``symmetry=True``), which catches a transposed block of
:math:`H` even where the differences are too noisy to.

The VJP being differenced should itself be checked first (:func:`sdpa_ref.check_vjp`):
this check proves ``hvp`` against ``vjp``, not against ``fun``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from .checks import DEFAULT_ATOL, DEFAULT_RTOL, _as_grads, _as_real, _asserted, check_jvp, check_seed
from .numeric import call, copy_args
from .report import GradcheckReport, errors

__all__ = ["assert_hvp", "check_hvp"]


def check_hvp(
    fun: Callable,
    vjp: Callable,
    hvp: Callable,
    args: Sequence,
    *,
    cotangent=None,
    mode: str = "full",
    eps: Optional[float] = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    seed: int = 0,
    n_projections: int = 3,
    symmetry: bool = True,
) -> GradcheckReport:
    r"""Check a Hessian-vector product against finite differences of the VJP.

    Parameters
    ----------
    fun : callable
        ``fun(*args) -> array`` (called once, for the output's shape).
    vjp : callable
        ``vjp(g, *args) -> sequence of arrays``, one gradient per arg:
        :math:`G(x) = J^\top g`, the gradient of
        :math:`\mathcal{L} = \langle g, f(x)\rangle`.
    hvp : callable
        ``hvp(g, tangents, *args) -> sequence of arrays``, one per arg, each
        of its arg's shape: :math:`H v`, the derivative of ``vjp(g, *args)``
        along ``tangents`` (a tuple with one array per arg).
    args : sequence of array_like
        Where to check. Copied to float64; never modified.
    cotangent : array_like, optional
        ``g``, of the output's shape, real and finite (a NaN in ``g`` makes
        the gradient and every product NaN, which proves nothing); a
        standard normal one (from ``seed``) by default.
    mode : {"full", "projection"}
        As in :func:`sdpa_ref.check_jvp`: ``"full"`` pushes one one-hot
        tangent per input entry and compares the whole Hessian with the
        central differences of the VJP; ``"projection"`` compares
        :math:`H u` for random ``u``, and runs the full check to locate a
        failure.
    eps, rtol, atol, n_projections
        As in :func:`sdpa_ref.check_jvp`.
    seed : int
        Seed of the default cotangent, the projections, the dense probes and
        the symmetry probes, an int >= 0.
    symmetry : bool
        Also require :math:`\langle u, H v\rangle = \langle H u, v\rangle`
        (under the same rule) for ``n_projections`` random pairs.

    Returns
    -------
    GradcheckReport
        ``kind`` is ``"check_hvp"``; its rows are per arg of the tangent
        (the columns of :math:`H`), and a note names the gradient entry
        (arg and index) of the worst one.

    Notes
    -----
    For :math:`\mathcal{L} = \langle g, f(x)\rangle`,
    :math:`(Hv)_i = \sum_j \partial^2 \mathcal{L} / \partial x_i \partial x_j\, v_j
    = \frac{d}{d\varepsilon} G_i(x + \varepsilon v)\big|_0`, whose central
    difference is :math:`(G(x + h v) - G(x - h v)) / 2h`.
    """
    if not isinstance(symmetry, (bool, np.bool_)):
        raise TypeError(f"`symmetry` should be a bool, but got {type(symmetry).__name__}")
    rng = np.random.default_rng(check_seed(seed))
    xs = copy_args(args)
    out = call(fun, xs)
    if cotangent is None:
        g = rng.standard_normal(out.shape)
    else:
        g = _as_real(cotangent, "cotangent", "", out.shape)
        if g.shape != out.shape:
            raise ValueError(f"`cotangent` should have the output's shape {out.shape}, but got shape {g.shape}")
        if not np.isfinite(g).all():
            raise ValueError(f"`cotangent` should be finite (a NaN or infinite entry makes the gradient and every "
                             f"product NaN, which proves nothing), but got {int(np.count_nonzero(~np.isfinite(g)))} "
                             "non-finite entries")
    sizes = [x.size for x in xs]

    def flat(res, x, who):
        parts = _as_grads(res, list(x), who)
        return np.concatenate([p.ravel() for p in parts]) if parts else np.zeros(0)

    def gradient(*x):
        return flat(vjp(g.copy(), *x), x, "vjp")

    def hessian_times(tangents, *x):
        return flat(hvp(g.copy(), tuple(tangents), *x), x, "hvp")

    rep = check_jvp(gradient, hessian_times, xs, mode=mode, eps=eps, rtol=rtol, atol=atol, seed=seed,
                    n_projections=n_projections)
    rep.kind = "check_hvp"
    if rep.worst is not None and rep.worst.output_index is not None:
        k = int(np.ravel_multi_index(rep.worst.output_index, (sum(sizes),)))
        a = int(np.searchsorted(np.cumsum(sizes), k, side="right"))
        idx = np.unravel_index(k - sum(sizes[:a]), xs[a].shape)
        rep.notes.append(f"the worst entry is of the gradient of arg {a} at index {tuple(int(i) for i in idx)} "
                         f"('output' above counts the gradients' entries joined)")
    if symmetry:
        _check_symmetry(rep, hessian_times, xs, rng, n_projections, rtol, atol)
    return rep


def assert_hvp(fun, vjp, hvp, args, **kwargs) -> GradcheckReport:
    """:func:`check_hvp`, raising `AssertionError` with the report's table on failure."""
    return _asserted(check_hvp(fun, vjp, hvp, args, **kwargs))


def _check_symmetry(rep, hessian_times, xs, rng, n, rtol, atol):
    """``<u, H v>`` against ``<H u, v>`` for ``n`` random pairs, under the comparison rule.

    Only over the rows of ``H`` that are finite (found by one probe ``H w``): a NaN row (a gradient that is NaN
    by definition) would make both products NaN, which proves nothing, so ``u`` and ``v`` are drawn on the
    finite rows alone, and the note says how many of them there were.
    """
    sizes = [x.size for x in xs]
    total = sum(sizes)

    def split(flat):
        return [a.reshape(x.shape) for a, x in zip(np.split(flat, np.cumsum(sizes)[:-1]), xs)]

    probe = hessian_times(split(rng.standard_normal(total)), *[x.copy() for x in xs])
    rows = np.isfinite(probe)
    if not rows.any():
        rep.notes.append("symmetry not checked: no row of H is finite")
        return
    worst = 0.0
    for _ in range(int(n)):
        fu, fv = (np.where(rows, rng.standard_normal(total), 0.0) for _ in range(2))
        Hv = hessian_times(split(fv), *[x.copy() for x in xs])
        Hu = hessian_times(split(fu), *[x.copy() for x in xs])
        uHv, Huv = float(fu[rows] @ Hv[rows]), float(Hu[rows] @ fv[rows])
        abs_err, rel, _ = errors(np.array([uHv]), np.array([Huv]))
        if not (np.isfinite(uHv) and np.isfinite(Huv)) or (abs_err[0] > atol and rel[0] > rtol):
            rep.ok = False
            rep.notes.append(f"not symmetric: <u, H v> = {uHv!r} but <H u, v> = {Huv!r} (rel {rel[0]:.3e}): "
                             "a transposed block of the Hessian?")
            return
        worst = max(worst, float(rel[0]) if abs_err[0] > atol else 0.0)
    where = "" if rows.all() else f", on the {int(rows.sum())} of {total} rows of H that are finite"
    rep.notes.append(f"symmetric: <u, H v> = <H u, v> for {int(n)} random pairs{where} (max rel {worst:.1e} "
                     "where above atol)")
