"""check_vjp and check_jvp: the analytic derivative against the numeric one, whole or projected."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from .._validate import check_choice, check_tolerance
from .numeric import METHODS, Numeric, batched_call, batched_shape, call, copy_args, default_eps, numeric_blocks, \
    valid_columns
from .report import GradcheckReport, compare

__all__ = ["DEFAULT_ATOL", "DEFAULT_RTOL", "assert_jvp", "assert_vjp", "check_jvp", "check_vjp"]

#: Default relative tolerance (symmetric relative error).
DEFAULT_RTOL = 1e-6
#: Default absolute floor.
DEFAULT_ATOL = 1e-9
_MODES = ("full", "projection")


def check_vjp(
    fun: Callable,
    vjp: Callable,
    args: Sequence,
    *,
    mode: str = "full",
    eps: Optional[float] = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    seed: int = 0,
    n_projections: int = 3,
    method: str = "central",
    vectorized: bool = False,
) -> GradcheckReport:
    r"""Check a vector-Jacobian product against finite differences.

    Parameters
    ----------
    fun : callable
        ``fun(*args) -> array``.
    vjp : callable
        ``vjp(g, *args) -> sequence of arrays``, one gradient per arg, each of
        its arg's shape (a bare array is accepted when there is one arg).
    args : sequence of array_like
        Where to check. Copied to float64; never modified.
    mode : {"full", "projection"}
        ``"full"`` builds the whole analytic Jacobian (one VJP per output
        entry, with one-hot cotangents) and the whole numeric one (two
        evaluations per input entry) and compares them entry by entry.
        ``"projection"`` compares :math:`\langle J^T g, u\rangle` with
        :math:`\langle g, J u\rangle` for random ``g`` and ``u``: one VJP and
        two evaluations per projection. When it fails, the full check is run
        to say where.
    eps : float, optional
        Relative finite-difference step (see the module docstring).
    rtol, atol : float
        Tolerances of the comparison rule.
    seed : int
        Seed of the random projections.
    n_projections : int
        Number of random projections in ``"projection"`` mode.
    method : {"central", "complex"}
        How the numeric derivative is taken: central differences, or the
        complex step (exact to rounding; ``fun`` must accept complex input).
    vectorized : bool
        ``fun`` and ``vjp`` broadcast over one new leading axis, treating it
        as an independent batch (as NumPy code that follows ``np.matmul``
        broadcasting does, sdpa_ref's attention included). Then the full
        check makes one batched call for all ``+h`` perturbations of an
        argument, one for all ``-h`` (one for the complex step), and one
        batched ``vjp`` of all one-hot cotangents, instead of a Python loop
        of calls. The results are the same as the scalar check's.

    Returns
    -------
    GradcheckReport
    """
    return _run(_vjp_projection, _vjp_full, fun, vjp, args, mode, eps, rtol, atol, seed, n_projections, method,
                vectorized)


def assert_vjp(fun, vjp, args, **kwargs) -> GradcheckReport:
    """:func:`check_vjp`, raising `AssertionError` with the report's table on failure."""
    return _asserted(check_vjp(fun, vjp, args, **kwargs))


def check_jvp(
    fun: Callable,
    jvp: Callable,
    args: Sequence,
    *,
    mode: str = "full",
    eps: Optional[float] = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    seed: int = 0,
    n_projections: int = 3,
    method: str = "central",
    vectorized: bool = False,
) -> GradcheckReport:
    r"""Check a Jacobian-vector product (forward mode) against finite differences.

    Parameters
    ----------
    fun : callable
        ``fun(*args) -> array``.
    jvp : callable
        ``jvp(tangents, *args) -> array`` of the output's shape, where
        ``tangents`` is a tuple with one array per arg.
    args, mode, eps, rtol, atol, seed, n_projections, method, vectorized
        As in :func:`check_vjp`. ``"full"`` pushes one one-hot tangent per
        input entry; ``"projection"`` compares the whole output tangent
        :math:`J u` for random ``u`` with its central difference, entry by
        entry. With ``vectorized=True`` (``fun`` and ``jvp`` broadcast over
        one new leading axis, the tangents included) the full check makes
        one batched ``jvp`` call per argument, with all its one-hot tangents.

    Returns
    -------
    GradcheckReport
    """
    return _run(_jvp_projection, _jvp_full, fun, jvp, args, mode, eps, rtol, atol, seed, n_projections, method,
                vectorized)


def assert_jvp(fun, jvp, args, **kwargs) -> GradcheckReport:
    """:func:`check_jvp`, raising `AssertionError` with the report's table on failure."""
    return _asserted(check_jvp(fun, jvp, args, **kwargs))


def _asserted(rep):
    if not rep.ok:
        raise AssertionError("\n" + str(rep))
    return rep


# ------------------------------------------------------------ internals


def _run(projection, full, fun, derivative, args, mode, eps, rtol, atol, seed, n_projections, method, vectorized):
    """The shared body of check_vjp / check_jvp: projection first, full to locate a failure."""
    check_choice(mode, "mode", _MODES)
    check_choice(method, "method", METHODS)
    rtol, atol = check_tolerance(rtol, "rtol"), check_tolerance(atol, "atol")
    if isinstance(n_projections, (bool, np.bool_)) or not isinstance(n_projections, (int, np.integer)) \
            or n_projections < 1:
        raise ValueError(f"`n_projections` should be an int >= 1 (0 checks nothing), but got {n_projections!r}")
    xs = copy_args(args)
    out = call(fun, xs)
    nd = Numeric(fun, default_eps(eps, method), method, vectorized=bool(vectorized))
    if mode == "full":
        return full(nd, derivative, xs, out, rtol, atol)
    rep = projection(nd, derivative, xs, out, rtol, atol, seed, n_projections)
    if rep.ok:
        return rep
    located = full(nd, derivative, xs, out, rtol, atol)
    located.mode = "projection, then full"
    located.notes = rep.notes + [f"projection check failed (max_rel={rep.max_rel_error:.3e}); full check follows"]
    return located


def _as_grads(res, xs, who):
    if len(xs) == 1 and isinstance(res, np.ndarray):
        res = (res,)
    res = list(res)
    if len(res) != len(xs):
        raise ValueError(f"`{who}` should return {len(xs)} gradients (one per arg), but got {len(res)}")
    grads = []
    for k, (r, x) in enumerate(zip(res, xs)):
        r = np.asarray(r, dtype=np.float64)
        if r.shape != x.shape:
            raise ValueError(f"`{who}` gradient {k} should have shape {x.shape}, but got shape {r.shape}")
        grads.append(r)
    return grads


def _vjp_full(nd, vjp, xs, out, rtol, atol):
    m = out.size
    if nd.vectorized:
        # one VJP of all one-hot cotangents; the args are broadcast (views) to the batch
        G = np.eye(m).reshape((m,) + out.shape)
        bx = [np.broadcast_to(x, (m,) + x.shape) for x in xs]
        res = batched_call(vjp, "vjp", G, *bx)
        res = (res,) if len(xs) == 1 and isinstance(res, np.ndarray) else list(res)
        if len(res) != len(xs):
            raise ValueError(f"`vjp` should return {len(xs)} gradients (one per arg), but got {len(res)}")
        ana = []
        for k, (r, x) in enumerate(zip(res, xs)):
            r = np.asarray(r, dtype=np.float64)
            if r.shape != (m,) + x.shape:
                raise ValueError(f"`vjp` gradient {k} should have shape {(m,) + x.shape} for vectorized=True, "
                                 f"but got shape {r.shape}")
            ana.append(r.reshape(m, -1))
        n_calls = 1
    else:
        ana = [np.empty((m, x.size)) for x in xs]
        for o in range(m):
            g = np.zeros(out.shape)
            g.flat[o] = 1.0
            grads = _as_grads(vjp(g, *[x.copy() for x in xs]), xs, "vjp")
            for k, gr in enumerate(grads):
                ana[k][o] = gr.ravel()
        n_calls = m
    num = numeric_blocks(nd, xs, out)
    if nd.vectorized:
        n_evals = 1 + len(xs) + n_calls             # one batched call per arg (plus and minus together)
    else:
        n_evals = 1 + (1 if nd.method == "complex" else 2) * sum(x.size for x in xs) + n_calls
    meta = {"valid": valid_columns(xs, m), "shapes": [x.shape for x in xs]}
    return compare("check_vjp", _mode("full", nd), ana, num, rtol, atol, meta, out.shape, n_evals)


def _directions(xs, rng):
    """Random directions scaled like the steps, zero on non-finite inputs."""
    us = []
    for x in xs:
        u = rng.standard_normal(x.shape)
        with np.errstate(invalid="ignore"):
            u = np.where(np.isfinite(x), u * np.maximum(1.0, np.abs(x)), 0.0)
        us.append(u)
    return us


def _mode(mode, nd):
    m = mode if nd.method == "central" else f"{mode}, complex step"
    return m + ", vectorized" if nd.vectorized else m


def _vjp_projection(nd, vjp, xs, out, rtol, atol, seed, n_projections):
    rng = np.random.default_rng(seed)
    ana, num = [], []
    for _ in range(int(n_projections)):
        g = rng.standard_normal(out.shape)
        us = _directions(xs, rng)
        grads = _as_grads(vjp(g, *[x.copy() for x in xs]), xs, "vjp")
        ana.append(sum(float(np.sum(gr * u)) for gr, u in zip(grads, us)))
        num.append(float(np.sum(g * nd.directional(xs, us))))
    a = np.array(ana).reshape(-1, 1)
    n = np.array(num).reshape(-1, 1)
    meta = {"valid": [np.ones_like(a, dtype=bool)], "shapes": [(1,)]}
    rep = compare("check_vjp", _mode("projection", nd), [a], [n], rtol, atol, meta, (len(ana),), 1 + 3 * len(ana))
    rep.per_arg = []
    rep.notes = [f"<J^T g, u> vs <g, J u> over {len(ana)} random projections (worst 'output' = projection number)"]
    return rep


def _jvp_full(nd, jvp, xs, out, rtol, atol):
    m = out.size
    ana = []
    for a, x in enumerate(xs):
        if nd.vectorized:                           # every one-hot tangent of this arg in one batched call
            n = x.size
            ts = [np.zeros((n,) + y.shape) if b == a else np.broadcast_to(np.zeros(()), (n,) + y.shape)
                  for b, y in enumerate(xs)]
            ts[a].reshape(n, n)[np.arange(n), np.arange(n)] = 1.0
            bx = [np.broadcast_to(y, (n,) + y.shape) for y in xs]
            res = np.asarray(batched_call(jvp, "jvp", tuple(ts), *bx), dtype=np.float64)
            ana.append(batched_shape(res, n, out.shape, "jvp").T if n else np.empty((m, 0)))
            continue
        J = np.empty((m, x.size))
        for i in range(x.size):
            ts = [np.zeros(y.shape) for y in xs]
            ts[a].flat[i] = 1.0
            J[:, i] = _as_tangent(jvp(tuple(ts), *[y.copy() for y in xs]), out).ravel()
        ana.append(J)
    num = numeric_blocks(nd, xs, out)
    if nd.vectorized:
        n_evals = 1 + 2 * len(xs)                   # per arg: one batched difference call and one batched jvp
    else:
        n_evals = 1 + (2 if nd.method == "complex" else 3) * sum(x.size for x in xs)
    meta = {"valid": valid_columns(xs, m), "shapes": [x.shape for x in xs]}
    return compare("check_jvp", _mode("full", nd), ana, num, rtol, atol, meta, out.shape, n_evals)


def _jvp_projection(nd, jvp, xs, out, rtol, atol, seed, n_projections):
    rng = np.random.default_rng(seed)
    ana, num = [], []
    for _ in range(int(n_projections)):
        us = _directions(xs, rng)
        ana.append(_as_tangent(jvp(tuple(us), *[x.copy() for x in xs]), out).ravel())
        num.append(nd.directional(xs, us).ravel())
    a = np.stack(ana, axis=1) if ana else np.zeros((out.size, 0))
    n = np.stack(num, axis=1) if num else np.zeros((out.size, 0))
    meta = {"valid": [np.ones_like(a, dtype=bool)], "shapes": [(a.shape[1],)]}
    rep = compare("check_jvp", _mode("projection", nd), [a], [n], rtol, atol, meta, out.shape, 1 + 3 * a.shape[1])
    rep.per_arg = []
    rep.notes = [f"J u vs its central difference over {a.shape[1]} random tangents (worst 'index' = tangent number)"]
    return rep


def _as_tangent(t, out):
    t = np.asarray(t, dtype=np.float64)
    if t.shape != out.shape:
        raise ValueError(f"`jvp` should return a tangent of the output's shape {out.shape}, but got shape {t.shape}")
    return t
