r"""Framework-neutral gradient checking by finite differences.

Everything here takes plain callables on NumPy arrays, so it can check
anyone's gradients, not only this package's:

* ``fun(*args) -> array``
* ``vjp(g, *args) -> (grad_0, grad_1, ...)``, one gradient per arg
* ``jvp(tangents, *args) -> output tangent``, ``tangents`` a tuple with one
  entry per arg

All arithmetic is in float64 on private copies of ``args``: the caller's
arrays are never perturbed.

Comparison rule
---------------
An analytic value ``a`` and a numeric value ``n`` agree when

    |a - n| <= atol    or    |a - n| / max(tiny, |a| + |n|) <= rtol.

The relative error is the *symmetric* one, so it is bounded by 1 and
treats ``a`` and ``n`` alike; the absolute floor lets exact zeros pass
against a difference quotient of ``1e-12``. The reported
``max_rel_error`` is taken over the entries past the floor and over those
with ``|a| + |n| >= atol / rtol``, where the relative error is meaningful. Two NaNs agree (a documented NaN
gradient checked against a NaN difference); one NaN does not. Inputs that are
not finite (a ``-inf`` mask entry, say) cannot be perturbed and are left out
of the comparison.

Complex step
------------
With ``method="complex"`` the derivative is taken as
:math:`f'(x)\,t = \operatorname{Im} f(x + i h t) / h` with :math:`h = 10^{-30}`.
There is no subtraction, so no cancellation: the result is exact to
rounding (about ``1e-15`` relative), which proves a gradient to ``1e-12``
where central differences stop near ``1e-9``. It needs ``fun`` to accept
complex input and to be analytic along the path (no ``abs``, no comparisons
on the perturbed values, the max-shift of a softmax taken from the real
part); :func:`sdpa_ref.sdpa_forward_complex` is such a forward.

Step size
---------
Central differences ``(f(x + h) - f(x - h)) / 2h`` have truncation error
:math:`O(h^2)` and rounding error :math:`O(\epsilon / h)`; the two balance at
:math:`h \approx \epsilon^{1/3} \approx 6\times10^{-6}`, which is scaled to
each entry as ``h_i = eps * max(1, |x_i|)``. The realised step
``(x + h) - (x - h)`` is used as the denominator, so representation error in
``x + h`` does not bias the quotient. Expect agreement to about ``1e-9``
relative on well-conditioned functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ._validate import check_choice

__all__ = [
    "DEFAULT_RTOL",
    "DEFAULT_ATOL",
    "GradcheckReport",
    "WorstEntry",
    "numerical_jacobian",
    "check_vjp",
    "assert_vjp",
    "check_jvp",
    "assert_jvp",
]

#: Default relative tolerance (symmetric relative error).
DEFAULT_RTOL = 1e-6
#: Default absolute floor.
DEFAULT_ATOL = 1e-9
_MODES = ("full", "projection")
_METHODS = ("central", "complex")
#: The complex step h of ``method="complex"``.
COMPLEX_STEP = 1e-30
_TINY = np.finfo(np.float64).tiny


@dataclass(frozen=True)
class WorstEntry:
    """The entry that disagrees most: which arg, where, and both values."""

    arg: int
    index: Tuple[int, ...]
    output_index: Optional[Tuple[int, ...]]
    analytic: float
    numeric: float
    abs_error: float
    rel_error: float


@dataclass
class GradcheckReport:
    """The outcome of :func:`check_vjp` or :func:`check_jvp`.

    ``str(report)`` is a readable table.
    """

    ok: bool
    kind: str
    mode: str
    max_abs_error: float
    max_rel_error: float
    rtol: float
    atol: float
    worst: Optional[WorstEntry]
    per_arg: List[dict] = field(default_factory=list)
    n_evals: int = 0
    notes: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        lines = [
            f"{self.kind} ({self.mode}): {status}   rtol={self.rtol:.1e} atol={self.atol:.1e}   "
            f"max_abs={self.max_abs_error:.3e} max_rel={self.max_rel_error:.3e}   evals={self.n_evals}"
        ]
        if self.per_arg:
            lines.append(f"  {'arg':>3}  {'shape':<18} {'max_abs':>10} {'max_rel':>10} {'failed':>12}")
            for row in self.per_arg:
                lines.append(
                    f"  {row['arg']:>3}  {str(row['shape']):<18} {row['max_abs']:>10.3e} "
                    f"{row['max_rel']:>10.3e} {row['failed']:>5}/{row['total']:<6}"
                )
        if self.worst is not None:
            w = self.worst
            where = f"arg {w.arg} index {w.index}"
            if w.output_index is not None:
                where += f" output {w.output_index}"
            lines.append(
                f"  worst: {where}: analytic {w.analytic!r} numeric {w.numeric!r} "
                f"(abs {w.abs_error:.3e}, rel {w.rel_error:.3e})"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def numerical_jacobian(fun: Callable, args: Sequence, eps: Optional[float] = None,
                       method: str = "central") -> List[np.ndarray]:
    r"""Central-difference Jacobians of ``fun`` with respect to each arg.

    Parameters
    ----------
    fun : callable
        ``fun(*args)`` returns one array.
    args : sequence of array_like
        Points of evaluation; copied to float64, never modified.
    eps : float, optional
        Relative step; ``h_i = eps * max(1, |x_i|)``. Default
        :math:`\epsilon_{64}^{1/3}`. With ``method="complex"``: the absolute
        complex step, default ``1e-30``.
    method : {"central", "complex"}
        Central differences, or the complex step (``fun`` must accept
        complex input).

    Returns
    -------
    list of ndarray
        ``J[k]`` has shape ``out.shape + args[k].shape`` with
        ``J[k][o, i] = d out[o] / d args[k][i]``. Columns of non-finite
        inputs are NaN.
    """
    check_choice(method, "method", _METHODS)
    xs = _copy_args(args)
    out = _call(fun, xs)
    blocks = _numeric_blocks(_Numeric(fun, _default_eps(eps, method), method), xs, out)
    return [J.reshape(out.shape + x.shape) for J, x in zip(blocks, xs)]


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
    rep = check_vjp(fun, vjp, args, **kwargs)
    if not rep.ok:
        raise AssertionError("\n" + str(rep))
    return rep


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
) -> GradcheckReport:
    r"""Check a Jacobian-vector product (forward mode) against finite differences.

    Parameters
    ----------
    fun : callable
        ``fun(*args) -> array``.
    jvp : callable
        ``jvp(tangents, *args) -> array`` of the output's shape, where
        ``tangents`` is a tuple with one array per arg.
    args, mode, eps, rtol, atol, seed, n_projections, method
        As in :func:`check_vjp`. ``"full"`` pushes one one-hot tangent per
        input entry; ``"projection"`` compares the whole output tangent
        :math:`J u` for random ``u`` with its central difference, entry by
        entry.

    Returns
    -------
    GradcheckReport
    """
    return _run(_jvp_projection, _jvp_full, fun, jvp, args, mode, eps, rtol, atol, seed, n_projections, method,
                False)


def assert_jvp(fun, jvp, args, **kwargs) -> GradcheckReport:
    """:func:`check_jvp`, raising `AssertionError` with the report's table on failure."""
    rep = check_jvp(fun, jvp, args, **kwargs)
    if not rep.ok:
        raise AssertionError("\n" + str(rep))
    return rep


# ------------------------------------------------------------ internals


def _run(projection, full, fun, derivative, args, mode, eps, rtol, atol, seed, n_projections, method, vectorized):
    """The shared body of check_vjp / check_jvp: projection first, full to locate a failure."""
    check_choice(mode, "mode", _MODES)
    check_choice(method, "method", _METHODS)
    xs = _copy_args(args)
    out = _call(fun, xs)
    nd = _Numeric(fun, _default_eps(eps, method), method, vectorized=bool(vectorized))
    if mode == "full":
        return full(nd, derivative, xs, out, rtol, atol)
    rep = projection(nd, derivative, xs, out, rtol, atol, seed, n_projections)
    if rep.ok:
        return rep
    located = full(nd, derivative, xs, out, rtol, atol)
    located.mode = "projection, then full"
    located.notes = rep.notes + [f"projection check failed (max_rel={rep.max_rel_error:.3e}); full check follows"]
    return located


def _copy_args(args):
    if isinstance(args, np.ndarray) or not isinstance(args, (list, tuple)):
        raise TypeError(f"`args` should be a tuple or list of arrays, but got {type(args).__name__}")
    xs = []
    for i, a in enumerate(args):
        arr = np.asarray(a)
        if arr.dtype.kind not in "fiu":
            raise TypeError(f"`args[{i}]` should be a real numeric array, but got dtype {arr.dtype}")
        xs.append(np.array(arr, dtype=np.float64, copy=True))
    return xs


def _call(fun, xs):
    # Hand the function fresh copies so that even a mutating `fun` cannot
    # disturb the evaluation points.
    out = np.asarray(fun(*[x.copy() for x in xs]))
    if out.dtype.kind == "c":     # a complex-capable fun evaluated at a real point
        out = out.real
    return out.astype(np.float64)


def _default_eps(eps, method="central"):
    if eps is None:
        return COMPLEX_STEP if method == "complex" else float(np.finfo(np.float64).eps ** (1.0 / 3.0))
    eps = float(eps)
    if not np.isfinite(eps) or eps <= 0:
        raise ValueError(f"`eps` should be a positive finite float, but got {eps!r}")
    return eps


class _Numeric:
    """Numeric derivatives of ``fun``: central differences or the complex step."""

    def __init__(self, fun, step, method, vectorized=False):
        self.fun, self.step, self.method, self.vectorized = fun, step, method, vectorized

    def jacobian_block(self, xs, a, out_shape):
        """All partials with respect to ``xs[a]`` in one batched call: ``(out.size, x.size)``."""
        x = xs[a]
        n = x.size
        flat = x.reshape(-1)
        finite = np.isfinite(flat)
        others = [y[None] for y in xs]
        if self.method == "complex":
            eye = np.eye(n, dtype=bool).reshape((n,) + x.shape)
            pert = np.where(eye, x[None] + 1j * self.step, x[None] + 0j)
            args = others[:a] + [pert] + others[a + 1:]
            J = self._imag_batched(args, n, out_shape) / self.step
            J[~finite] = np.nan
            return np.ascontiguousarray(J.T)
        h = self.step * np.maximum(1.0, np.abs(np.where(finite, flat, 0.0)))
        xp_flat, xm_flat = flat + h, flat - h
        pm = np.broadcast_to(x, (2 * n,) + x.shape).copy()    # the n "plus" points, then the n "minus" points
        pm2 = pm.reshape(2 * n, n)
        i = np.arange(n)
        pm2[i, i] = xp_flat
        pm2[n + i, i] = xm_flat
        f = self._real_batched(others[:a] + [pm] + others[a + 1:], 2 * n, out_shape)
        J = np.empty((f.shape[1], n))                         # (out, in): contiguous for the comparison
        with np.errstate(invalid="ignore"):                   # inf - inf on non-finite inputs, set to NaN below
            np.divide(np.subtract(f[:n], f[n:]).T, (xp_flat - xm_flat)[None, :], out=J)
        J[:, ~finite] = np.nan
        return J

    def _real_batched(self, args, n, out_shape):
        out = np.asarray(_batched_call(self.fun, "fun", *args))
        if out.dtype.kind == "c":
            out = out.real
        return _batched_shape(out, n, out_shape, "fun").astype(np.float64, copy=False)

    def _imag_batched(self, args, n, out_shape):
        out = np.asarray(_batched_call(self.fun, "fun", *args))
        if out.dtype.kind != "c":
            raise TypeError("`fun` should return a complex array for method='complex', but got dtype "
                            f"{out.dtype}")
        return _batched_shape(out.imag, n, out_shape, "fun").astype(np.float64)

    def partial(self, xs, a, i, out_shape):
        """d fun / d xs[a].flat[i], shaped like the output."""
        x0 = xs[a].reshape(-1)[i]
        if not np.isfinite(x0):
            return np.full(out_shape, np.nan)
        if self.method == "complex":
            pert = [y.astype(np.complex128) for y in xs]
            pert[a].reshape(-1)[i] += 1j * self.step
            return self._imag(pert) / self.step
        h = self.step * max(1.0, abs(x0))
        xp, xm = x0 + h, x0 - h
        pert = [y.copy() for y in xs]
        flat = pert[a].reshape(-1)
        flat[i] = xp
        fp = _call(self.fun, pert)
        flat[i] = xm
        fm = _call(self.fun, pert)
        return (fp - fm) / (xp - xm)

    def directional(self, xs, us):
        """J u for directions ``us`` (zero on non-finite inputs)."""
        if self.method == "complex":
            pert = [np.where(u != 0, x + 1j * self.step * u, x + 0j) for x, u in zip(xs, us)]
            return self._imag(pert) / self.step
        t = self.step
        xp = [np.where(u != 0, x + t * u, x) for x, u in zip(xs, us)]
        xm = [np.where(u != 0, x - t * u, x) for x, u in zip(xs, us)]
        return (_call(self.fun, xp) - _call(self.fun, xm)) / (2.0 * t)

    def _imag(self, pert):
        out = np.asarray(self.fun(*pert))
        if out.dtype.kind != "c":
            raise TypeError("`fun` should return a complex array for method='complex' (it must compute "
                            f"in complex arithmetic), but got dtype {out.dtype}")
        return out.imag.astype(np.float64)


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


def _errors(a, n):
    """Absolute and symmetric relative errors, and ``|a| + |n|``; NaN pairs agree, one NaN disagrees."""
    if np.isfinite(a).all() and np.isfinite(n).all():      # the common case, without the where-chains
        abs_err = np.subtract(a, n)
        np.abs(abs_err, out=abs_err)
        size = np.abs(a)
        size += np.abs(n)
        rel = np.maximum(size, _TINY)
        np.divide(abs_err, rel, out=rel)
        return abs_err, rel, size
    with np.errstate(invalid="ignore"):
        both_nan = np.isnan(a) & np.isnan(n)
        abs_err = np.abs(a - n)
        size = np.abs(a) + np.abs(n)
        rel = abs_err / np.maximum(_TINY, size)
    one_bad = ~np.isfinite(abs_err) & ~both_nan
    inf_equal = np.isinf(a) & (a == n)
    abs_err = np.where(both_nan | inf_equal, 0.0, np.where(one_bad, np.inf, abs_err))
    rel = np.where(both_nan | inf_equal, 0.0, np.where(one_bad, 1.0, rel))
    return abs_err, rel, size


def _compare(kind, mode, ana, num, rtol, atol, arg_index_shapes, out_shape, n_evals, notes=None):
    """Compare lists of (analytic, numeric, valid-mask) blocks and build a report.

    Each block is ``(o, i)`` shaped: o over output entries, i over the arg's
    entries. ``valid`` excludes columns of non-finite inputs.
    """
    per_arg = []
    max_abs = max_rel = 0.0
    worst = None
    worst_key = (-1.0, -1.0)
    ok = True
    for k, (a, n, valid) in enumerate(zip(ana, num, arg_index_shapes["valid"])):
        abs_err, rel, size = _errors(a, n)
        all_valid = bool(np.all(valid))
        if not all_valid:
            abs_err = np.where(valid, abs_err, 0.0)
            rel = np.where(valid, rel, 0.0)
        over = abs_err > atol
        # The relative error is reported where it means something: on entries
        # past the absolute floor, and on entries large enough (|a|+|n| >=
        # atol/rtol) that the floor does not decide them.
        with np.errstate(invalid="ignore"):
            shown = size >= (atol / rtol if rtol > 0 else np.inf)
        if not all_valid:
            shown &= valid
        shown |= over
        rel_over = np.where(shown, rel, 0.0)
        failed = int(np.count_nonzero(over & (rel > rtol)))
        ok &= failed == 0
        arg_abs = float(abs_err.max(initial=0.0))
        arg_rel = float(rel_over.max(initial=0.0))
        per_arg.append({
            "arg": k, "shape": arg_index_shapes["shapes"][k], "max_abs": arg_abs, "max_rel": arg_rel,
            "failed": failed, "total": int(np.count_nonzero(valid) if valid.ndim else a.size),
        })
        max_abs, max_rel = max(max_abs, arg_abs), max(max_rel, arg_rel)
        if a.size:
            flat = int(np.argmax(rel_over if arg_rel > 0 else abs_err))
            key = (float(rel_over.flat[flat]), float(abs_err.flat[flat]))
            if key > worst_key:
                worst_key = key
                o, i = np.unravel_index(flat, a.shape)
                worst = WorstEntry(
                    arg=k,
                    index=tuple(int(t) for t in np.unravel_index(i, arg_index_shapes["shapes"][k])),
                    output_index=(tuple(int(t) for t in np.unravel_index(o, out_shape)) if out_shape is not None else None),
                    analytic=float(a.flat[flat]), numeric=float(n.flat[flat]),
                    abs_error=float(abs_err.flat[flat]), rel_error=float(rel.flat[flat]),
                )
    return GradcheckReport(
        ok=bool(ok), kind=kind, mode=mode, max_abs_error=max_abs, max_rel_error=max_rel,
        rtol=rtol, atol=atol, worst=worst, per_arg=per_arg, n_evals=n_evals, notes=list(notes or []),
    )


def _valid_columns(xs, m):
    return [np.broadcast_to(np.isfinite(x).reshape(1, -1), (m, x.size)) for x in xs]


def _batched_call(f, who, *args):
    try:
        return f(*args)
    except Exception as exc:
        raise ValueError(f"`{who}` failed on batched input with vectorized=True (it should broadcast over a "
                         f"new leading axis): {type(exc).__name__}: {exc}") from exc


def _batched_shape(out, n, out_shape, who):
    want = (n,) + tuple(out_shape)
    if out.shape != want:
        raise ValueError(f"`{who}` should broadcast over a new leading axis for vectorized=True and return "
                         f"shape {want}, but got shape {out.shape}")
    return out.reshape(n, -1)


def _numeric_blocks(nd, xs, out):
    if nd.vectorized:
        return [nd.jacobian_block(xs, a, out.shape) if x.size else np.empty((out.size, 0))
                for a, x in enumerate(xs)]
    blocks = []
    for a, x in enumerate(xs):
        J = np.empty((out.size, x.size))
        for i in range(x.size):
            J[:, i] = nd.partial(xs, a, i, out.shape).ravel()
        blocks.append(J)
    return blocks


def _vjp_full(nd, vjp, xs, out, rtol, atol):
    m = out.size
    if nd.vectorized:
        # one VJP of all one-hot cotangents; the args are broadcast (views) to the batch
        G = np.eye(m).reshape((m,) + out.shape)
        bx = [np.broadcast_to(x, (m,) + x.shape) for x in xs]
        res = _batched_call(vjp, "vjp", G, *bx)
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
    num = _numeric_blocks(nd, xs, out)
    if nd.vectorized:
        n_evals = 1 + len(xs) + n_calls             # one batched call per arg (plus and minus together)
    else:
        n_evals = 1 + (1 if nd.method == "complex" else 2) * sum(x.size for x in xs) + n_calls
    meta = {"valid": _valid_columns(xs, m), "shapes": [x.shape for x in xs]}
    return _compare("check_vjp", _mode("full", nd), ana, num, rtol, atol, meta, out.shape, n_evals)


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
    rep = _compare("check_vjp", _mode("projection", nd), [a], [n], rtol, atol, meta, (len(ana),), 1 + 3 * len(ana))
    rep.per_arg = []
    rep.notes = [f"<J^T g, u> vs <g, J u> over {len(ana)} random projections (worst 'output' = projection number)"]
    return rep


def _jvp_full(nd, jvp, xs, out, rtol, atol):
    m = out.size
    ana = []
    for a, x in enumerate(xs):
        J = np.empty((m, x.size))
        for i in range(x.size):
            ts = [np.zeros(y.shape) for y in xs]
            ts[a].flat[i] = 1.0
            J[:, i] = _as_tangent(jvp(tuple(ts), *[y.copy() for y in xs]), out).ravel()
        ana.append(J)
    num = _numeric_blocks(nd, xs, out)
    n_evals = 1 + (2 if nd.method == "complex" else 3) * sum(x.size for x in xs)
    meta = {"valid": _valid_columns(xs, m), "shapes": [x.shape for x in xs]}
    return _compare("check_jvp", _mode("full", nd), ana, num, rtol, atol, meta, out.shape, n_evals)


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
    rep = _compare("check_jvp", _mode("projection", nd), [a], [n], rtol, atol, meta, out.shape, 1 + 3 * a.shape[1])
    rep.per_arg = []
    rep.notes = [f"J u vs its central difference over {a.shape[1]} random tangents (worst 'index' = tangent number)"]
    return rep


def _as_tangent(t, out):
    t = np.asarray(t, dtype=np.float64)
    if t.shape != out.shape:
        raise ValueError(f"`jvp` should return a tangent of the output's shape {out.shape}, but got shape {t.shape}")
    return t
