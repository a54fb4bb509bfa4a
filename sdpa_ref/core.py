r"""The teaching core: softmax, log-softmax, logsumexp and attention, forward, backward and JVP, in NumPy alone.

Read this file first. It imports nothing else from the package, so it is the independent oracle every engine
is tested against (``tests/test_core.py``). Each forward returns ``(out, residuals)``; its backward (the VJP)
takes ``(residuals, g)`` and returns one gradient per differentiable input; its JVP takes ``(residuals,
tangent)``. Every backward line names the forward line it inverts and the rule that gives it.

Shapes (the package's legend; heads, if any, are leading dims ``...``, which broadcast as in ``np.matmul``)::

    query   (..., L, E)     L query rows of width E
    key     (..., S, E)     S keys
    value   (..., S, Ev)    Ev may differ from E
    out     (..., L, Ev)
    attn_mask  bool, broadcastable to (..., L, S): True = the key takes part in the row

The softmax family works along any ``axis``: with ``m = max_j x_j`` (0 when not finite),
``y = e^(x - m) / sum_j e^(x - m)``, ``log_softmax = (x - m) - log sum_j e^(x - m)``, ``lse = m + log sum_j
e^(x - m)``. Every exponent is <= 0, so nothing overflows, and a ``-inf`` entry gets exactly 0. Their
Jacobians: ``dy_i/dx_j = y_i (delta_ij - y_j)`` (symmetric), ``d log_softmax_i/dx_j = delta_ij - y_j``,
``d lse/dx_j = y_j``. A row that is all ``-inf`` has no mass to share: its softmax and log-softmax are NaN and
its lse is ``-inf`` (as scipy, PyTorch and JAX), and its VJPs and JVPs are NaN.

Attention, in SEMANTICS.md's symbols (s the scale, A the allowed set)::

    T = s Q K^T                      s = 1/sqrt(E) unless given                  (..., L, S)
    T = -inf outside A               A = attn_mask AND (j <= i if is_causal)     top-left, as PyTorch
    P = softmax_rows(T)              0 outside A; a row with no allowed key: 0
    O = P V                                                                      (..., L, Ev)

Backward, from ``dO``, last line first (for a product ``C = A B``: ``dA = dC B^T``, ``dB = A^T dC``)::

    dV = P^T dO                      O = P V
    dP = dO V^T                      O = P V
    dT = P * (dP - D),  D = rowsum(P * dP)       P = softmax_rows(T): J = diag(P) - P P^T, so dT = J^T dP
    dQ = s dT K                      T = s Q K^T
    dK = s dT^T Q                    T = s Q K^T

``D = rowsum(P * dP)`` is the form used here (SEMANTICS.md's first line for D); it equals FlashAttention's
``rowsum(dO * O)``, as ``rowsum(P * (dO V^T)) = rowsum(dO * (P V))``. Outside ``A``, ``P = 0`` so ``dT = 0``: a
masked entry passes no gradient. The engines evaluate the same ``dT`` in a pivoted form (``dP - c`` for ``c``
the ``dP`` at the row's largest ``P``), equal in exact arithmetic.

JVP, along ``(dQ, dK, dV)``: ``dT = s (dQ K^T + Q dK^T)``, ``dP = P * (dT - rowsum(P * dT))`` (J is
symmetric: the VJP's map), ``dO = dP V + P dV``.

A row with no allowed key (a fully masked bool row, or S = 0) gets ``P = 0``: its output is 0 and every
gradient and tangent it sends is 0, and its LSE (``logsumexp_forward`` of ``T``) is ``-inf``. This is the
package's default ``fully_masked="zero"`` (PyTorch 2.5 and later, FlashAttention). The core has no other policy
and no float mask, bias, softcap, dropout, sinks or grouped heads: those are the engines' (see SEMANTICS.md).

>>> log_softmax_forward(np.array([1000., 1.]))[0].tolist()          # naive log(softmax): [0., -inf]
[0.0, -999.0]
>>> out, res = attention_forward(np.ones((2, 3)), np.ones((4, 3)), np.eye(4), is_causal=True)
>>> out.tolist()                                                       # row i: the mean of values 0..i
[[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]
"""

import numpy as np

__all__ = [
    "softmax_forward", "softmax_backward", "softmax_jvp",
    "log_softmax_forward", "log_softmax_backward", "log_softmax_jvp",
    "logsumexp_forward", "logsumexp_backward", "logsumexp_jvp",
    "attention_forward", "attention_backward", "attention_jvp",
]


# ---------------------------------------------------------------- the softmax family, along any axis

def softmax_forward(x, axis=-1):
    """``y = softmax(x)`` along ``axis``, shape of ``x``; residuals ``(y, axis)``. ``-inf`` gives 0."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):                  # an all -inf row: 0 / 0 = NaN, on purpose
        e = np.exp(x - _row_max(x, axis))                # e = exp(x - m) <= 1; exp(-inf) = 0 exactly
        y = e / np.sum(e, axis=axis, keepdims=True)      # y = e / rowsum(e)
    return y, (y, axis)


def softmax_backward(residuals, g):
    """``dx = y * (g - rowsum(y * g))``, the VJP of :func:`softmax_forward` (shape of ``y``)."""
    y, axis = residuals
    D = np.sum(y * g, axis=axis, keepdims=True)          # D = rowsum(y * g) = y^T g      (J = diag(y) - y y^T)
    return y * (g - D)                                   # dx = J^T g = y * g - y (y^T g)   inverts y = e / rowsum(e)


def softmax_jvp(residuals, dx):
    """``dy = y * (dx - rowsum(y * dx))``: J is symmetric, so the JVP is the VJP's map."""
    return softmax_backward(residuals, dx)               # dy = J dx = J^T dx


def log_softmax_forward(x, axis=-1):
    """``y = x - lse(x)`` along ``axis``, computed directly (never ``log(0)`` for a finite ``x``)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = x - _row_max(x, axis)                        # z = x - m <= 0
        y = z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))   # y = z - log rowsum(exp z)
    return y, (y, axis)


def log_softmax_backward(residuals, g):
    """``dx = g - exp(y) * rowsum(g)``, the VJP of :func:`log_softmax_forward`."""
    y, axis = residuals
    # dy_i / dx_j = delta_ij - p_j with p = exp(y)   =>   dx_j = g_j - p_j sum_i g_i      inverts y = x - lse(x)
    return g - np.exp(y) * np.sum(g, axis=axis, keepdims=True)


def log_softmax_jvp(residuals, dx):
    """``dy = dx - rowsum(exp(y) * dx)``."""
    y, axis = residuals
    return dx - np.sum(np.exp(y) * dx, axis=axis, keepdims=True)  # dy_i = sum_j (delta_ij - p_j) dx_j


def logsumexp_forward(x, axis=-1):
    """``lse = log sum_j exp(x_j)`` along ``axis`` (the axis removed); residuals ``(softmax(x), axis)``."""
    x = np.asarray(x, dtype=np.float64)
    m = _row_max(x, axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.exp(x - m)                                        # e = exp(x - m) <= 1
        s = np.sum(e, axis=axis, keepdims=True)                  # s = rowsum(e) in [1, n]; 0 if all -inf
        lse = m + np.log(s)                                      # lse = m + log s; -inf on an all -inf row
        y = e / s                                                # y = softmax(x), the slope of lse
    return np.squeeze(lse, axis=axis), (y, axis)


def logsumexp_backward(residuals, g):
    """``dx = y * g``, ``g`` of the lse's shape broadcast back along ``axis``."""
    y, axis = residuals
    return y * np.expand_dims(g, axis)                   # d lse / dx_j = y_j      inverts lse = m + log s


def logsumexp_jvp(residuals, dx):
    """``d lse = rowsum(y * dx)``."""
    y, axis = residuals
    return np.sum(y * dx, axis=axis)


# ---------------------------------------------------------------- attention

def attention_forward(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """``O = softmax_rows(scale * Q K^T, -inf outside the allowed set) V`` and its residuals.

    Parameters
    ----------
    query : (..., L, E);  key : (..., S, E);  value : (..., S, Ev)
        Leading dims broadcast as in ``np.matmul``. Computed in float64.
    attn_mask : bool array broadcastable to (..., L, S), optional
        True where the key takes part in the row.
    is_causal : bool
        Keep key ``j`` for row ``i`` only when ``j <= i`` (top-left aligned, as PyTorch).
    scale : float, optional
        Default ``1/sqrt(E)`` (1 when ``E = 0``).

    Returns
    -------
    out : (..., L, Ev)
        0 on a row with no allowed key.
    residuals : tuple
        ``(q, k, v, P, scale)`` for :func:`attention_backward` and :func:`attention_jvp`.
    """
    q, k, v = _check(query, key, value, attn_mask, is_causal, scale)
    E = q.shape[-1]
    s = (1 / np.sqrt(E) if E else 1.0) if scale is None else float(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        T = s * (q @ np.swapaxes(k, -1, -2))             # T = s Q K^T                        (..., L, S)
    A = _allowed(q.shape[-2], k.shape[-2], attn_mask, is_causal)
    T = np.where(A, T, -np.inf)                          # T = -inf outside A: exp gives exactly 0
    P, _ = softmax_forward(T)                            # P = softmax_rows(T)
    empty = np.all(T == -np.inf, axis=-1, keepdims=True)     # a row with no allowed key (its P is 0 / 0)
    P = np.where(empty, 0.0, P)                          # P = 0 there: O = 0, and no gradient flows
    O = P @ v                                            # O = P V                            (..., L, Ev)
    return O, (q, k, v, P, s)


def attention_backward(residuals, g):
    """``(dq, dk, dv)`` from ``g = dO`` (..., L, Ev), each in its input's shape (broadcast dims summed)."""
    q, k, v, P, s = residuals
    dv = P.swapaxes(-1, -2) @ g                          # dV = P^T dO       inverts O = P V  (product rule)
    dP = g @ v.swapaxes(-1, -2)                          # dP = dO V^T       inverts O = P V  (product rule)
    dT = softmax_backward((P, -1), dP)                   # dT = P * (dP - D), D = rowsum(P * dP)
    #                                                      inverts P = softmax_rows(T)  (J = diag(P) - P P^T);
    #                                                      T = -inf outside A is a constant there, and P = 0 so dT = 0
    dq = s * (dT @ k)                                    # dQ = s dT K       inverts T = s Q K^T  (product rule)
    dk = s * (dT.swapaxes(-1, -2) @ q)                   # dK = s dT^T Q     inverts T = s Q K^T  (product rule)
    return _unbroadcast(dq, q.shape), _unbroadcast(dk, k.shape), _unbroadcast(dv, v.shape)


def attention_jvp(residuals, tangents):
    """``dO`` (..., L, Ev) along the input tangents ``(dq, dk, dv)``, each of its input's shape."""
    q, k, v, P, s = residuals
    dq, dk, dv = (np.asarray(t, dtype=np.float64) for t in tangents)
    # each line differentiates one forward line (the product rule), first line first
    dT = s * (dq @ k.swapaxes(-1, -2) + q @ dk.swapaxes(-1, -2))   # dT = s (dQ K^T + Q dK^T)   of T = s Q K^T
    dP = softmax_jvp((P, -1), dT)                        # dP = P * (dT - rowsum(P * dT))     of P = softmax_rows(T)
    return dP @ v + P @ dv                               # dO = dP V + P dV                   of O = P V


# ---------------------------------------------------------------- helpers

def _row_max(x, axis):
    """The row maximum ``m``, kept as a dim; 0 where it is not finite (an all -inf row: no ``-inf - -inf``)."""
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    return np.where(np.isfinite(m), m, 0.0)


def _allowed(L, S, attn_mask, is_causal):
    """The allowed set ``A``, broadcastable to (..., L, S): the bool mask AND the causal rule ``j <= i``."""
    A = np.ones((L, S), dtype=bool)
    if is_causal:
        A = np.tril(A)                                   # row i keeps keys j <= i (top-left)
    return A if attn_mask is None else A & attn_mask


def _unbroadcast(x, shape):
    """Sum ``x`` over the leading dims that ``np.matmul`` broadcast, back to ``shape``."""
    x = np.sum(x, axis=tuple(range(x.ndim - len(shape))))
    return np.sum(x, axis=tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1), keepdims=True)


def _check(query, key, value, attn_mask, is_causal, scale):
    """Validate once, at the entry: ``ValueError``/``TypeError`` naming the argument."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (query, key, value))
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(f"`{name}` should have at least 2 dims, but got shape {a.shape}")
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"`key` should be (..., S, E) and `value` (..., S, Ev) with query's E = {q.shape[-1]}, "
                         f"but got key {k.shape} and value {v.shape}")
    if attn_mask is not None and np.asarray(attn_mask).dtype != bool:
        raise TypeError(f"`attn_mask` should be a bool array, but got dtype {np.asarray(attn_mask).dtype}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"`is_causal` should be a bool, but got {is_causal!r}")
    if scale is not None and not (np.isfinite(scale) and scale != 0):
        raise ValueError(f"`scale` should be finite and non-zero, but got {scale!r}")
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(f"the leading dims of `query` {q.shape}, `key` {k.shape} and `value` {v.shape} should "
                         "broadcast") from None
    want = batch + (q.shape[-2], k.shape[-2])
    try:
        ok = attn_mask is None or np.broadcast_shapes(np.shape(attn_mask), want) == want
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"`attn_mask` should broadcast to (..., L, S) = {want}, but got shape {np.shape(attn_mask)}")
    return q, k, v
