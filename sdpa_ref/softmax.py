r"""The softmax family and its derivatives.

Each forward sits next to its VJP and JVP. All functions work along any
``axis`` of an array of any rank, never mutate their input, and are stable
for huge logits: the row maximum is subtracted before exponentiating, and
``log_softmax`` is computed directly as ``x - logsumexp(x)`` rather than as
``log(softmax(x))``.

Non-finite input follows IEEE arithmetic on purpose:

* ``-inf`` entries get probability exactly 0 (and log-probability ``-inf``);
* a row that is *all* ``-inf`` has no probability mass to share, so its
  softmax and log-softmax are NaN and its ``logsumexp`` is ``-inf`` (as in
  scipy, PyTorch and JAX); attention decides what such a row means through
  its ``fully_masked`` policy instead;
* a row holding ``+inf`` or NaN gives NaN.

No floating-point warnings are emitted for these cases.

Complex input is accepted: the max-shift is taken from the real part and
everything else is analytic, so ``softmax(x + 1j*h*t).imag / h`` is the
complex-step directional derivative.
"""

from __future__ import annotations

import numpy as np

from ._validate import along_axis, pair_along_axis
from .pivot import pivoted_vjp, row_pivot

__all__ = [
    "logsumexp",
    "softmax",
    "softmax_lse",
    "softmax_parts",
    "row_pivot",
    "log_softmax",
    "softmax_vjp",
    "log_softmax_vjp",
    "softmax_lse_vjp",
    "softmax_jvp",
    "softmax_jacobian",
]


def logsumexp(x, axis=-1, keepdims=False):
    r"""Log of the sum of exponentials along ``axis``, computed stably.

    Parameters
    ----------
    x : array_like, (..., n, ...)
        Input; integer input is promoted to float64.
    axis : int, optional
        Axis to reduce over. Default -1.
    keepdims : bool, optional
        Keep the reduced axis with length 1.

    Returns
    -------
    ndarray
        :math:`\log \sum_j e^{x_j}` along ``axis``; ``-inf`` for a row
        that is all ``-inf`` (or empty).

    Notes
    -----
    With :math:`m = \max_j x_j` (the real part's maximum, replaced by 0 when
    it is not finite),

    .. math:: \operatorname{lse}(x) = m + \log \sum_j e^{x_j - m},

    so that no exponent exceeds 0 and the sum lies in :math:`[1, n]` for any
    finite row.

    Examples
    --------
    >>> import numpy as np
    >>> float(logsumexp(np.array([1000., 1000.])))  # naive: inf
    1000.6931471805599
    """
    if not isinstance(keepdims, (bool, np.bool_)):
        raise TypeError(f"`keepdims` should be a bool, but got {keepdims!r}")
    x, axis = along_axis(x, axis)
    m = _safe_max(x, axis)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.sum(np.exp(x - m), axis=axis, keepdims=True)
        out = np.log(s) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def softmax(x, axis=-1):
    r"""Softmax along ``axis``: :math:`y_j = e^{x_j} / \sum_k e^{x_k}`.

    Parameters
    ----------
    x : array_like, (..., n, ...)
        Logits; integer input is promoted to float64.
    axis : int, optional
        Axis along which the result sums to 1. Default -1.

    Returns
    -------
    ndarray, same shape as ``x``
        Probabilities. ``-inf`` logits give exactly 0; an all ``-inf`` row
        gives NaN.

    See Also
    --------
    log_softmax, softmax_vjp, softmax_jvp, softmax_jacobian

    Notes
    -----
    Softmax is invariant under adding a constant to a row, so the row maximum
    :math:`m` is subtracted first: every exponent is :math:`\le 0`, nothing
    overflows, and the largest term is exactly 1 so the sum cannot
    underflow.

    Examples
    --------
    >>> import numpy as np
    >>> softmax(np.array([1000., 1.])).tolist()  # naive exp overflows to nan
    [1.0, 0.0]
    """
    x, axis = along_axis(x, axis)
    m = _safe_max(x, axis)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        e = np.exp(x - m)
        return e / np.sum(e, axis=axis, keepdims=True)


def softmax_lse(x, axis=-1):
    r"""Softmax and log-sum-exp together: one max, one ``exp``, one sum.

    Returns ``(y, lse)`` with ``lse`` keeping the reduced axis (length 1):
    :math:`y = e^{x - m} / s` and :math:`\operatorname{lse} = m + \log s`,
    :math:`s = \sum_j e^{x_j - m}`. Attention needs both (``P`` and ``LSE``);
    an all ``-inf`` row gives NaN probabilities and ``lse = -inf``.

    Examples
    --------
    >>> import numpy as np
    >>> y, lse = softmax_lse(np.array([0., -np.inf]))
    >>> y.tolist(), lse.tolist()
    ([1.0, 0.0], [0.0])
    """
    y, m, s = softmax_parts(x, axis)
    with np.errstate(divide="ignore"):
        return y, np.log(s) + m


def softmax_parts(x, axis=-1):
    r"""Softmax with its two statistics kept apart: ``(y, m, s)``.

    :math:`m` is the row maximum of the real part (0 where it is not
    finite), :math:`s = \sum_j e^{x_j - m}` and :math:`y = e^{x - m} / s`;
    ``m`` and ``s`` keep the reduced axis. Recomputing ``y`` later as
    ``exp(x - m) / s`` gives it to rounding for any finite ``x``, however
    large, whereas ``exp(x - lse)`` loses what ``lse = m + log(s)`` rounded
    away (all of ``log(s)`` once ``|m|`` passes ``2**53 log(s)``).
    """
    x, axis = along_axis(x, axis)
    m = _safe_max(x, axis)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        e = np.exp(x - m)
        s = np.sum(e, axis=axis, keepdims=True)
        return e / s, m, s


def log_softmax(x, axis=-1):
    r"""Log of the softmax along ``axis``, computed directly.

    Parameters
    ----------
    x : array_like, (..., n, ...)
        Logits.
    axis : int, optional
        Default -1.

    Returns
    -------
    ndarray, same shape as ``x``
        :math:`x_j - \operatorname{lse}(x)`. Never ``log(0)`` for a finite
        logit, however small its probability.

    Examples
    --------
    >>> import numpy as np
    >>> log_softmax(np.array([1000., 1.])).tolist()  # naive: [0., -inf]
    [0.0, -999.0]
    """
    x, axis = along_axis(x, axis)
    m = _safe_max(x, axis)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        shifted = x - m
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def softmax_vjp(y, g, axis=-1):
    r"""Vector-Jacobian product of softmax: the gradient with respect to its input.

    Parameters
    ----------
    y : array_like, (..., n, ...)
        The softmax *output*.
    g : array_like, same shape as ``y``
        Cotangent (the gradient of the loss with respect to ``y``).
    axis : int, optional
        The softmax axis. Default -1.

    Returns
    -------
    dx : ndarray, same shape as ``y``

    Notes
    -----
    The Jacobian is :math:`J = \operatorname{diag}(y) - y y^T`
    (:math:`\partial y_i / \partial x_j = y_i(\delta_{ij} - y_j)`). It is
    symmetric, so

    .. math:: dx = J^T g = y \odot g - y (y^T g) = y \odot (g - \textstyle\sum_k g_k y_k).

    The element-wise ``y * (1 - y)`` is only the diagonal of :math:`J` and is
    wrong as a VJP.

    It is evaluated in the pivoted form of :func:`row_pivot`,
    :math:`y \odot ((g - c) - \sum_k y_k (g_k - c))` with :math:`c` the
    entry of ``g`` at the row's largest ``y``: the same value, with the
    cancellation of the dominant term done exactly.
    """
    y, g, axis = pair_along_axis(y, g, axis, "y", "g")
    return pivoted_vjp(y, g, axis)


def softmax_lse_vjp(y, g, g_lse, axis=-1):
    r"""VJP of :func:`softmax_lse`: the gradient of ``x`` from the cotangents of ``y`` and of the LSE.

    Parameters
    ----------
    y : array_like, (..., n, ...)
        The softmax *output*.
    g : array_like, same shape as ``y``
        Cotangent of ``y``.
    g_lse : array_like, the shape of ``y`` with ``axis`` of length 1
        Cotangent of ``lse = log sum_k exp(x_k)``, as :func:`softmax_lse` returns it (the axis kept).
    axis : int, optional
        The softmax axis. Default -1.

    Returns
    -------
    dx : ndarray, same shape as ``y``

    Notes
    -----
    :math:`\partial\, \mathrm{lse} / \partial x_j = e^{x_j} / \sum_k e^{x_k} = y_j`, so the LSE adds
    :math:`y\, \bar\lambda` to :func:`softmax_vjp`'s part:

    .. math:: dx = y \odot (g - \textstyle\sum_k g_k y_k + \bar\lambda).

    FlashAttention 4 folds :math:`\bar\lambda` into :math:`D = \sum_k g_k y_k` (``D - dlse``); the
    attention engines use either form (:func:`sdpa_ref.sdpa_backward`'s ``grad_lse``).
    """
    y, g, axis = pair_along_axis(y, g, axis, "y", "g")
    gl = np.asarray(g_lse)
    if gl.dtype.kind not in "iubfc":
        raise TypeError(f"`g_lse` should be a numeric array, but got dtype {gl.dtype}")
    want = y.shape[:axis] + (1,) + y.shape[axis + 1:]
    if gl.shape != want:
        raise ValueError(f"`g_lse` should have the shape {want} of softmax_lse's lse (the axis kept), "
                         f"but got shape {gl.shape}")
    return softmax_vjp(y, g, axis) + y * gl


def log_softmax_vjp(y, g, axis=-1):
    r"""Vector-Jacobian product of log-softmax.

    Parameters
    ----------
    y : array_like, (..., n, ...)
        The log-softmax *output*.
    g : array_like, same shape as ``y``
        Cotangent.
    axis : int, optional
        Default -1.

    Returns
    -------
    dx : ndarray

    Notes
    -----
    :math:`\partial y_i / \partial x_j = \delta_{ij} - p_j` with
    :math:`p = e^{y}`, hence

    .. math:: dx = g - p \textstyle\sum_i g_i.
    """
    y, g, axis = pair_along_axis(y, g, axis, "y", "g")
    return g - np.exp(y) * np.sum(g, axis=axis, keepdims=True)


def softmax_jvp(y, dx, axis=-1):
    r"""Jacobian-vector product of softmax (forward mode).

    Parameters
    ----------
    y : array_like, (..., n, ...)
        The softmax output.
    dx : array_like, same shape as ``y``
        Tangent of the input.
    axis : int, optional
        Default -1.

    Returns
    -------
    dy : ndarray

    Notes
    -----
    .. math:: dy = J\,dx = y \odot (dx - \textstyle\sum_k y_k\,dx_k).
    """
    y, dx, axis = pair_along_axis(y, dx, axis, "y", "dx")
    return pivoted_vjp(y, dx, axis)                        # J is symmetric: the VJP's map


def softmax_jacobian(y, axis=-1):
    r"""The explicit softmax Jacobian :math:`\operatorname{diag}(y) - y y^T`.

    Meant for teaching and for checking the VJP; it costs :math:`O(n^2)` per
    row, so prefer :func:`softmax_vjp` in real work.

    Parameters
    ----------
    y : array_like, (..., n, ...)
        The softmax output.
    axis : int, optional
        The softmax axis. Default -1. The Jacobian's two axes are appended
        last.

    Returns
    -------
    ndarray, (..., n, n)
        ``J[..., i, j] = dy_i / dx_j``, where ``...`` are the other axes of
        ``y`` in order.
    """
    y, axis = along_axis(y, axis, name="y")
    y = np.moveaxis(y, axis, -1)
    n = y.shape[-1]
    eye = np.eye(n, dtype=y.real.dtype)
    return y[..., :, None] * eye - y[..., :, None] * y[..., None, :]


# ---------------------------------------------------------------- helpers


def _safe_max(x, axis):
    """Row maximum of the real part, kept as a dim; non-finite maxima become 0.

    An all ``-inf`` row then gives ``exp(-inf - 0) = 0`` (sum 0), and a row
    with ``+inf`` gives ``inf / inf = nan``, instead of ``-inf - -inf``.
    """
    m = np.max(x.real, axis=axis, keepdims=True, initial=-np.inf)
    return np.where(np.isfinite(m), m, 0.0)
