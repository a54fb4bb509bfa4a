"""Numeric derivatives: central differences and the complex step, one entry or one batch at a time.

See :mod:`sdpa_ref.gradcheck` for the step size and the complex step. All
arithmetic is in float64 on private copies of the arguments.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from .._validate import as_real_scalar, check_choice

__all__ = ["COMPLEX_STEP", "METHODS", "Numeric", "numerical_jacobian"]

#: The complex step h of ``method="complex"``.
COMPLEX_STEP = 1e-30
#: Accepted values of ``method``.
METHODS = ("central", "complex")


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
    check_choice(method, "method", METHODS)
    xs = copy_args(args)
    out = call(fun, xs)
    blocks = numeric_blocks(Numeric(fun, default_eps(eps, method), method), xs, out)
    return [J.reshape(out.shape + x.shape) for J, x in zip(blocks, xs)]


def copy_args(args):
    if isinstance(args, np.ndarray) or not isinstance(args, (list, tuple)):
        raise TypeError(f"`args` should be a tuple or list of arrays, but got {type(args).__name__}")
    xs = []
    for i, a in enumerate(args):
        arr = np.asarray(a)
        if arr.dtype.kind not in "fiu":
            raise TypeError(f"`args[{i}]` should be a real numeric array, but got dtype {arr.dtype}")
        xs.append(np.array(arr, dtype=np.float64, copy=True))
    return xs


def call(fun, xs):
    # Hand the function fresh copies so that even a mutating `fun` cannot
    # disturb the evaluation points.
    return real_output(np.asarray(fun(*[x.copy() for x in xs]))).astype(np.float64)


def real_output(out):
    """``fun``'s output at a real point: a complex-capable ``fun`` (for the complex step) may return complex
    values there, whose imaginary part must be 0 (or not finite, as ``inf * (1 + 0j)`` gives); a finite non-zero
    imaginary part is a TypeError, since dropping it would check the real part's derivative alone."""
    if out.dtype.kind != "c":
        return out
    im = out.imag
    bad = np.isfinite(im) & (im != 0)
    if bad.any():
        i = tuple(int(t) for t in np.argwhere(bad)[0])                # the first such entry
        raise TypeError(f"`fun` should return real values at real points, but got an imaginary part "
                        f"{float(im[i])!r} at output {i}: the checkers compare real derivatives, and dropping it "
                        "would check the real part alone")
    return out.real


def default_eps(eps, method="central"):
    if eps is None:
        return COMPLEX_STEP if method == "complex" else float(np.finfo(np.float64).eps ** (1.0 / 3.0))
    eps = as_real_scalar(eps, "eps")                      # a bool or a string is a TypeError naming `eps`
    if not np.isfinite(eps) or eps <= 0:
        raise ValueError(f"`eps` should be a positive finite float, but got {eps!r}")
    return eps


class Numeric:
    """Numeric derivatives of ``fun``: central differences or the complex step."""

    def __init__(self, fun, step, method, vectorized=False):
        self.fun, self.step, self.method, self.vectorized = fun, step, method, vectorized

    def jacobian_block(self, xs, a, out_shape):
        """All partials with respect to ``xs[a]`` in one batched call: ``(out.size, x.size)``."""
        x = xs[a]
        n = x.size
        flat = x.reshape(-1)
        finite = np.isfinite(flat)
        # the other args broadcast (views) to the batch: a rank-2 attention would read a leading axis
        # of length 1 as one head against n query heads
        def others(m):
            return [np.broadcast_to(y, (m,) + y.shape) for y in xs]

        if self.method == "complex":
            eye = np.eye(n, dtype=bool).reshape((n,) + x.shape)
            pert = np.where(eye, x[None] + 1j * self.step, x[None] + 0j)
            args = others(n)[:a] + [pert] + others(n)[a + 1:]
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
        f = self._real_batched(others(2 * n)[:a] + [pm] + others(2 * n)[a + 1:], 2 * n, out_shape)
        J = np.empty((f.shape[1], n))                         # (out, in): contiguous for the comparison
        with np.errstate(invalid="ignore"):                   # inf - inf on non-finite inputs, set to NaN below
            np.divide(np.subtract(f[:n], f[n:]).T, (xp_flat - xm_flat)[None, :], out=J)
        J[:, ~finite] = np.nan
        return J

    def _real_batched(self, args, n, out_shape):
        out = real_output(np.asarray(batched_call(self.fun, "fun", *args)))
        return batched_shape(out, n, out_shape, "fun").astype(np.float64, copy=False)

    def _imag_batched(self, args, n, out_shape):
        out = np.asarray(batched_call(self.fun, "fun", *args))
        if out.dtype.kind != "c":
            raise TypeError("`fun` should return a complex array for method='complex', but got dtype "
                            f"{out.dtype}")
        return batched_shape(out.imag, n, out_shape, "fun").astype(np.float64)

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
        fp = call(self.fun, pert)
        flat[i] = xm
        fm = call(self.fun, pert)
        return (fp - fm) / (xp - xm)

    def directional(self, xs, us):
        """J u for directions ``us`` (zero on non-finite inputs)."""
        if self.method == "complex":
            pert = [np.where(u != 0, x + 1j * self.step * u, x + 0j) for x, u in zip(xs, us)]
            return self._imag(pert) / self.step
        t = self.step
        xp = [np.where(u != 0, x + t * u, x) for x, u in zip(xs, us)]
        xm = [np.where(u != 0, x - t * u, x) for x, u in zip(xs, us)]
        return (call(self.fun, xp) - call(self.fun, xm)) / (2.0 * t)

    def _imag(self, pert):
        out = np.asarray(self.fun(*pert))
        if out.dtype.kind != "c":
            raise TypeError("`fun` should return a complex array for method='complex' (it must compute "
                            f"in complex arithmetic), but got dtype {out.dtype}")
        return out.imag.astype(np.float64)


def valid_columns(xs, m):
    return [np.broadcast_to(np.isfinite(x).reshape(1, -1), (m, x.size)) for x in xs]


def batched_call(f, who, *args):
    try:
        return f(*args)
    except Exception as exc:
        raise ValueError(f"`{who}` failed on batched input with vectorized=True (it should broadcast over a "
                         f"new leading axis): {type(exc).__name__}: {exc}") from exc


def batched_shape(out, n, out_shape, who):
    want = (n,) + tuple(out_shape)
    if out.shape != want:
        raise ValueError(f"`{who}` should broadcast over a new leading axis for vectorized=True and return "
                         f"shape {want}, but got shape {out.shape}")
    return out.reshape(n, -1)


def numeric_blocks(nd, xs, out):
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
