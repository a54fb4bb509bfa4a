r"""
Hand-differentiated layers: enough for a tiny Transformer
=========================================================

The building blocks of the copy-task example (``copy_task.py``) and of the
tutorial that checks a whole Transformer's gradient: a linear layer, ReLU,
LayerNorm, an embedding, softmax cross-entropy, multi-head self-attention
through :func:`sdpa_ref.sdpa_forward` and :func:`sdpa_ref.sdpa_backward`,
and Adam. They are not part of the ``sdpa_ref`` package: the scripts here
import this file as the module ``nn`` (Python puts a script's own folder on
``sys.path``).

Each layer is a pure function pair in the style of :mod:`sdpa_ref.attention`:
``y, cache = layer(x, params...)`` and ``grads = layer_backward(cache, g)``.
No object holds hidden state; the optimizer state is an explicit dict.

Shapes: ``B`` batch, ``T`` positions, ``D`` model width, ``H`` heads,
``V`` vocabulary size; ``(..., D)`` means any leading dims.

An ensemble of ``M`` independent models trains as one: give every parameter
a leading axis ``M`` (a weight ``(M, D_in, D_out)``, a bias or a LayerNorm
gain ``(M, D)``, an embedding table ``(M, V, D)``) and the inputs a leading
axis ``M`` too; model ``m``'s outputs and gradients are those of its own
parameters on its own inputs, and :func:`adam_update` with ``per_model=True``
clips each model's gradient by its own norm. The copy task trains all its
seeds this way, one batched model instead of one run per seed.

The claim, checked when this file runs as a script: every backward here is
its forward's vector-Jacobian product, against central finite differences in
float64 (:func:`sdpa_ref.check_vjp`, the whole Jacobian). ``tests/test_examples_nn.py``
checks the same layers on more inputs.
"""

from __future__ import annotations

import sys
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np

from sdpa_ref import check_vjp, log_softmax, sdpa_backward, sdpa_forward
from sdpa_ref._threads import threads_for

__all__ = [
    "linear", "linear_backward",
    "relu", "relu_backward",
    "layer_norm", "layer_norm_backward",
    "embedding", "embedding_backward",
    "softmax_cross_entropy", "softmax_cross_entropy_backward",
    "multi_head_attention", "multi_head_attention_backward",
    "adam_init", "adam_update",
]


# ------------------------------------------------------------------ linear


def _per_model(p, ndim):
    """A parameter with a leading model axis, ``(M, *core)``, as ``(M, 1, ..., 1, *core)`` of ``ndim`` dims."""
    return p.reshape(p.shape[:1] + (1,) * (ndim - p.ndim) + p.shape[1:])


def _matmul(x, w):
    """``x @ w``; with a model axis (``w`` of shape (M, D_in, D_out), ``x`` of (M, ..., D_in)) one product per model
    over all of its rows, rather than one per leading index."""
    if w.ndim == 2:
        return x @ w
    return (x.reshape(w.shape[0], -1, x.shape[-1]) @ w).reshape(x.shape[:-1] + w.shape[-1:])


def _work(x, w):
    """Multiply-adds of one product ``x @ w`` (of one model's, with a model axis: the BLAS runs them one by one)."""
    return x.size * w.shape[-1] // (w.shape[0] if w.ndim == 3 else 1)


def linear(x, w, b=None):
    r"""``y = x W + b``.  x : (..., D_in), w : (D_in, D_out), b : (D_out,).

    With a model axis: x : (M, ..., D_in), w : (M, D_in, D_out), b : (M, D_out).
    A small product runs on one BLAS thread (``sdpa_ref._threads.SMALL_WORK``), as every layer here does: waking
    the BLAS's threads costs more than they save at these sizes.
    """
    with threads_for(_work(x, w)):
        y = _matmul(x, w)
    if b is not None:
        y = y + (b if w.ndim == 2 else _per_model(b, y.ndim))
    return y, (x, w, b is not None)


def linear_backward(cache, g):
    r"""``dx = g W^T``, ``dW = x^T g`` (summed over the leading dims), ``db = sum g``.

    Returns ``(dx, dw, db)``; ``db`` is ``None`` without a bias.
    """
    x, w, has_b = cache
    if w.ndim == 3:                                   # a model axis: each model's rows alone
        M = w.shape[0]
        x2, g2 = x.reshape(M, -1, x.shape[-1]), g.reshape(M, -1, g.shape[-1])
        with threads_for(_work(x, w)):
            dx = (g2 @ w.transpose(0, 2, 1)).reshape(x.shape)
            dw = x2.transpose(0, 2, 1) @ g2
        return dx, dw, (g2.sum(axis=1) if has_b else None)
    with threads_for(_work(x, w)):
        dx = g @ w.T
        dw = x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])
    db = g.reshape(-1, g.shape[-1]).sum(axis=0) if has_b else None
    return dx, dw, db


# -------------------------------------------------------------------- relu


def relu(x):
    """``max(x, 0)``; the cache is the mask of positive entries."""
    mask = x > 0
    return x * mask, mask


def relu_backward(mask, g):
    """``dx = g`` where ``x > 0``, else 0 (the subgradient 0 at 0)."""
    return g * mask


# -------------------------------------------------------------- layer norm


def layer_norm(x, gamma, beta, eps=1e-5):
    r"""Normalise the last axis: ``y = gamma * (x - mu) / sqrt(var + eps) + beta``.

    x : (..., D); gamma, beta : (D,), or (M, D) with a model axis (x : (M, ..., D)).
    """
    if gamma.ndim == 2:
        gamma, beta = _per_model(gamma, x.ndim), _per_model(beta, x.ndim)
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = xc * rstd
    return gamma * xhat + beta, (xhat, rstd, gamma)


def layer_norm_backward(cache, g):
    r"""Gradients of :func:`layer_norm`: ``(dx, dgamma, dbeta)``.

    Notes
    -----
    With :math:`\hat x = (x - \mu) r`, :math:`r = (\sigma^2 + \epsilon)^{-1/2}`
    and :math:`d\hat x = g \odot \gamma`, differentiating :math:`\mu` and
    :math:`\sigma^2` through the mean over the D entries gives

    .. math::

        dx = r \Bigl(d\hat x - \overline{d\hat x} - \hat x\,\overline{d\hat x \odot \hat x}\Bigr),

    where the bar is the mean over the last axis.
    """
    xhat, rstd, gamma = cache
    dxhat = g * gamma
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * np.mean(dxhat * xhat, -1, keepdims=True))
    lead = tuple(range(1 if gamma.ndim > 1 else 0, g.ndim - 1))      # a model axis stays
    return dx, np.sum(g * xhat, axis=lead), np.sum(g, axis=lead)


# --------------------------------------------------------------- embedding


def embedding(ids, table):
    """Rows of ``table`` (V, D) picked by integer ``ids`` (...) -> (..., D).

    With a model axis: ``table`` (M, V, D) and ``ids`` (M, ...), model ``m``'s ids picking rows of its own table.
    """
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"`ids` should be an integer array, but got dtype {ids.dtype}")
    if table.ndim == 3:                               # row m * V + id of the tables stacked
        ids = _per_model(np.arange(table.shape[0]) * table.shape[1], ids.ndim) + ids
        return table.reshape(-1, table.shape[-1])[ids], (ids, table.shape)
    return table[ids], (ids, table.shape)


def embedding_backward(cache, g):
    """Scatter-add ``g`` (..., D) into a zero table: the gradient of :func:`embedding`."""
    ids, shape = cache
    dtable = np.zeros((int(np.prod(shape[:-1])), shape[-1]), dtype=g.dtype)
    np.add.at(dtable, ids.reshape(-1), g.reshape(-1, shape[-1]))
    return dtable.reshape(shape)


# ------------------------------------------------------- softmax cross-entropy


def softmax_cross_entropy(logits, targets, weights=None):
    r"""Mean cross-entropy of ``softmax(logits)`` against integer ``targets``.

    logits : (..., V); targets : (...) ints; weights : (...) or None. The loss
    is :math:`\sum w_n (-\log p_{n, t_n}) / \sum w_n`.
    """
    logp = log_softmax(logits, axis=-1)
    targets = np.asarray(targets)
    w = np.ones(targets.shape) if weights is None else np.asarray(weights, dtype=float)
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    total = w.sum()
    return float(np.sum(w * nll) / total), (logp, targets, w, total)


def softmax_cross_entropy_backward(cache, g=1.0):
    r"""``dlogits = g * w * (softmax(logits) - onehot(t)) / sum(w)``."""
    logp, targets, w, total = cache
    d = np.exp(logp)
    np.put_along_axis(d, targets[..., None], np.take_along_axis(d, targets[..., None], -1) - 1.0, axis=-1)
    return d * (g * w / total)[..., None]


# ------------------------------------------------------ multi-head attention


class _MHACache(NamedTuple):
    x: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    merged: np.ndarray
    residuals: object
    n_heads: int


def multi_head_attention(x, wq, wk, wv, wo, n_heads, *, is_causal=True, scale=None, method=None):
    r"""Self-attention with ``n_heads`` heads through :func:`sdpa_ref.sdpa_forward`.

    x : (B, T, D); wq, wk, wv, wo : (D, D), or with a model axis x : (M, B, T, D) and the weights (M, D, D), the
    attention then taking (M, B) as its leading batch dims. Head ``h`` uses columns
    ``h*D/H : (h+1)*D/H`` of the projections, so ``d_k = D / H``. ``scale``
    is passed to attention (``None``: ``1/sqrt(d_k)``), and ``method`` picks its engine (``"plain"``: the
    teaching core, :mod:`sdpa_ref.attention`; the backward uses the same one).
    """
    *lead, T, D = x.shape
    if D % n_heads:
        raise ValueError(f"`n_heads` should divide the width D={D}, but got {n_heads}")
    dh = D // n_heads

    def heads(y):       # (..., T, D) -> (..., H, T, dh)
        return np.swapaxes(y.reshape(*lead, T, n_heads, dh), -3, -2)

    with threads_for(_work(x, wq)):
        q, k, v = heads(_matmul(x, wq)), heads(_matmul(x, wk)), heads(_matmul(x, wv))
        o, res = sdpa_forward(q, k, v, is_causal=is_causal, scale=scale, method=method)
        merged = np.swapaxes(o, -3, -2).reshape(x.shape)
        y = _matmul(merged, wo)
    return y, _MHACache(x, wq, wk, wv, wo, merged, res, n_heads)


def multi_head_attention_backward(cache, g):
    """Gradients ``(dx, dwq, dwk, dwv, dwo)``; the attention core uses :func:`sdpa_backward`."""
    x, wq, wk, wv, wo, merged, res, H = cache
    *lead, T, D = x.shape
    dh = D // H

    def unheads(y):     # (..., H, T, dh) -> (..., T, D)
        return np.swapaxes(y, -3, -2).reshape(x.shape)

    def wT(w):          # W^T, per model with a model axis
        return np.swapaxes(w, -1, -2)

    # the weight gradients x^T g over all rows (of each model, with a model axis)
    rows = (lambda y: y.reshape(-1, D)) if wq.ndim == 2 else (lambda y: y.reshape(wq.shape[0], -1, D))
    with threads_for(_work(x, wq)):
        dwo = wT(rows(merged)) @ rows(g)
        dmerged = _matmul(g, wT(wo))
        do = np.swapaxes(dmerged.reshape(*lead, T, H, dh), -3, -2)
        grads = sdpa_backward(res, do)
        dq, dk, dv = unheads(grads.query), unheads(grads.key), unheads(grads.value)
        x2 = wT(rows(x))
        dx = _matmul(dq, wT(wq)) + _matmul(dk, wT(wk)) + _matmul(dv, wT(wv))
        return (dx, x2 @ rows(dq), x2 @ rows(dk), x2 @ rows(dv), dwo)


# ------------------------------------------------------------------- adam


def adam_init(params: Dict[str, np.ndarray]) -> dict:
    """Zeroed first and second moments for each parameter, and the step count."""
    return {"t": 0, "m": {k: np.zeros_like(v) for k, v in params.items()},
            "v": {k: np.zeros_like(v) for k, v in params.items()}}


def adam_update(params, grads, state, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                max_grad_norm: Optional[float] = None, per_model: bool = False) -> Tuple[dict, dict]:
    r"""One Adam step; returns new ``(params, state)`` and leaves the inputs untouched.

    ``max_grad_norm`` clips the global gradient norm first, when given; with ``per_model`` every parameter has a
    leading model axis and each model's gradient is clipped by its own norm (its update is the one it would get
    alone).
    """
    b1, b2 = betas
    if max_grad_norm is not None and per_model:
        M = next(iter(grads.values())).shape[0]
        norm = np.sqrt(sum(np.sum((g * g).reshape(M, -1), axis=1) for g in grads.values()))
        factor = np.where(norm > max_grad_norm, max_grad_norm / np.maximum(norm, max_grad_norm), 1.0)
        grads = {k: g * _per_model(factor, g.ndim) for k, g in grads.items()}
    elif max_grad_norm is not None:
        norm = np.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
        if norm > max_grad_norm:
            grads = {k: g * (max_grad_norm / norm) for k, g in grads.items()}
    t = state["t"] + 1
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        m = b1 * state["m"][k] + (1 - b1) * g
        v = b2 * state["v"][k] + (1 - b2) * g * g
        mhat = m / (1 - b1**t)
        vhat = v / (1 - b2**t)
        new_p[k] = p - lr * mhat / (np.sqrt(vhat) + eps)
        new_m[k], new_v[k] = m, v
    return new_p, {"t": t, "m": new_m, "v": new_v}


# ------------------------------------------------------- the claim, checked


def _checks(rng):
    """``(name, report)`` of :func:`sdpa_ref.check_vjp` for every layer's backward, on small float64 inputs."""
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    yield "linear", check_vjp(lambda x, w, b: linear(x, w, b)[0],
                              lambda g, x, w, b: linear_backward(linear(x, w, b)[1], g), (x, w, b), rtol=1e-7)
    r = rng.standard_normal((3, 4))
    r[np.abs(r) < 1e-3] = 0.5                      # away from the kink at 0, where the difference straddles it
    yield "relu", check_vjp(lambda r: relu(r)[0], lambda g, r: (relu_backward(relu(r)[1], g),), (r,), rtol=1e-7)
    x, gm, bt = rng.standard_normal((2, 3, 6)) * 2 + 1, rng.standard_normal(6), rng.standard_normal(6)
    yield "layer_norm", check_vjp(lambda x, gm, bt: layer_norm(x, gm, bt)[0],
                                  lambda g, x, gm, bt: layer_norm_backward(layer_norm(x, gm, bt)[1], g),
                                  (x, gm, bt), rtol=1e-7)
    ids, table = np.array([[0, 2, 2], [1, 0, 3]]), rng.standard_normal((4, 5))
    yield "embedding", check_vjp(lambda t: embedding(ids, t)[0],
                                 lambda g, t: (embedding_backward(embedding(ids, t)[1], g),), (table,), rtol=1e-7)
    logits, t = rng.standard_normal((2, 3, 5)), rng.integers(0, 5, (2, 3))
    yield "softmax_cross_entropy", check_vjp(
        lambda z: np.array(softmax_cross_entropy(z, t)[0]),
        lambda g, z: (softmax_cross_entropy_backward(softmax_cross_entropy(z, t)[1], float(g)),), (logits,), rtol=1e-7)
    x, ws = rng.standard_normal((2, 3, 4)), [rng.standard_normal((4, 4)) * 0.5 for _ in range(4)]
    yield "multi_head_attention", check_vjp(
        lambda x, *ws: multi_head_attention(x, *ws, 2)[0],
        lambda g, x, *ws: multi_head_attention_backward(multi_head_attention(x, *ws, 2)[1], g), (x, *ws), rtol=1e-7)


if __name__ == "__main__":      # success falls off the end: the docs gallery runs this file and keeps its stdout
    failures = []
    for name, report in _checks(np.random.default_rng(0)):
        print(f"{'PASS' if report.ok else 'FAIL'}  {name}_backward: max rel error {report.max_rel_error:.1e}")
        if not report.ok:
            failures.append(name)
    print("\n" + ("all claims hold" if not failures else f"{len(failures)} claim(s) FAILED"))
    if failures:
        sys.exit("nn.py: the backward of " + ", ".join(failures) + " is not its forward's derivative")
