r"""What the 1/sqrt(d_k) scaling does, measured: entropy, saturation, gradient norms.

With ``q`` and ``k`` of i.i.d. unit-variance components, :math:`q\cdot k` has
variance :math:`d_k`. This module *measures* what follows, by running the
reference; it asserts nothing:

* ``"none"`` (scale 1): scores grow like :math:`\sqrt{d_k}`, the softmax
  saturates towards one-hot, and the gradient through it shrinks;
* ``"sqrt"`` (scale :math:`1/\sqrt{d_k}`): score variance stays 1 for every
  :math:`d_k`;
* ``"linear"`` (scale :math:`1/d_k`): the score std falls like
  :math:`1/\sqrt{d_k}` and the softmax drifts toward uniform.

Data only: printing and plotting live in :mod:`sdpa_ref.cli`.

Every metric is computed per trial (an independent draw of ``q``, ``k``,
``v`` and the upstream gradient), averaged within the trial over its query
rows, and reported as the mean over trials with a standard error
``std(trial values, ddof=1) / sqrt(trials)``. Trials are independent, so that
standard error is honest even though the rows inside one trial share keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable, List, Optional, Sequence

import numpy as np

from . import _validate as V
from .api import sdpa_forward
from .derivatives import sdpa_backward

__all__ = [
    "SCALES",
    "DEFAULT_D_KS",
    "SweepRow",
    "softmax_entropy",
    "normalized_entropy",
    "softmax_jacobian_norm",
    "scale_value",
    "predicted_score_std",
    "sweep",
]

#: The scaling choices: name -> scale as a function of d_k.
SCALES = {
    "none": lambda d_k: 1.0,
    "sqrt": lambda d_k: 1.0 / np.sqrt(d_k),
    "linear": lambda d_k: 1.0 / d_k,
}
DEFAULT_D_KS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: Top weight above which a row counts as saturated.
SATURATION_THRESHOLD = 0.9


@dataclass(frozen=True)
class SweepRow:
    """One (d_k, scale) point of :func:`sweep`; ``*_stderr`` are standard errors over trials."""

    d_k: int
    scale: str
    scale_value: float
    predicted_score_std: float
    score_std: float
    score_std_stderr: float
    entropy: float
    entropy_stderr: float
    normalized_entropy: float
    normalized_entropy_stderr: float
    max_weight_mean: float
    max_weight_mean_stderr: float
    max_weight_median: float
    saturated_fraction: float
    saturated_fraction_stderr: float
    grad_norm_scores: float
    grad_norm_scores_stderr: float
    grad_norm_query: float
    grad_norm_query_stderr: float
    grad_norm_key: float
    grad_norm_key_stderr: float
    jacobian_norm: float
    jacobian_norm_stderr: float
    trials: int
    n_queries: int
    n_keys: int

    def as_dict(self) -> dict:
        return asdict(self)


def softmax_entropy(p, axis=-1):
    r"""Shannon entropy :math:`-\sum_j p_j \log p_j` in nats, with :math:`0 \log 0 = 0`.

    Parameters
    ----------
    p : array_like, (..., n, ...)
        Probabilities along ``axis``.
    axis : int, optional

    Returns
    -------
    ndarray
        The entropy, with ``axis`` removed.

    Examples
    --------
    >>> float(softmax_entropy([0.5, 0.5, 0.0]))   # log 2
    0.6931471805599453
    """
    p = V.as_float_array(np.asarray(p, dtype=float) if np.asarray(p).dtype.kind in "iu" else p, "p", min_ndim=1)
    axis = V.check_axis(axis, p.ndim)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return -np.sum(terms, axis=axis)


def normalized_entropy(p, axis=-1):
    r"""Entropy divided by its maximum :math:`\log n`: 1 for a uniform row, 0 for one-hot.

    Undefined (NaN) when ``n == 1``, where the maximum is 0.

    Examples
    --------
    >>> float(normalized_entropy([0.25, 0.25, 0.25, 0.25]))
    1.0
    """
    p = np.asarray(p, dtype=float)
    ax = V.check_axis(axis, p.ndim) if p.ndim else 0
    n = p.shape[ax] if p.ndim else 1
    with np.errstate(divide="ignore", invalid="ignore"):
        return softmax_entropy(p, axis) / np.log(n)


def softmax_jacobian_norm(p, axis=-1):
    r"""Frobenius norm of the softmax Jacobian :math:`\operatorname{diag}(p) - p p^T` per row.

    Computed in closed form, without building the matrix:

    .. math::

        \lVert \operatorname{diag}(p) - p p^T \rVert_F^2
        = \sum_i p_i^2 - 2 \sum_i p_i^3 + \Bigl(\sum_i p_i^2\Bigr)^2,

    since :math:`\langle \operatorname{diag}(p), p p^T\rangle = \sum_i p_i^3`
    and :math:`\lVert p p^T \rVert_F = \lVert p \rVert^2`. It is 0 for a
    one-hot row, which is why saturated attention passes no gradient.
    """
    p = np.asarray(p, dtype=float)
    s2 = np.sum(p * p, axis=axis)
    s3 = np.sum(p * p * p, axis=axis)
    return np.sqrt(np.maximum(s2 - 2.0 * s3 + s2 * s2, 0.0))


def scale_value(d_k: int, scale: str) -> float:
    """The numerical scale of a named scaling choice at ``d_k``."""
    V.check_choice(scale, "scale", tuple(SCALES))
    return float(SCALES[scale](d_k))


def predicted_score_std(d_k, scale: str) -> float:
    r"""The theory's score std, :math:`\sqrt{d_k}\cdot\text{scale}`, for unit-variance q, k."""
    return float(np.sqrt(d_k) * scale_value(d_k, scale))


def sweep(
    d_ks: Sequence[int] = DEFAULT_D_KS,
    *,
    n_keys: int = 50,
    n_queries: int = 32,
    trials: int = 64,
    scales: Iterable[str] = ("none", "sqrt", "linear"),
    d_v: int = 32,
    seed: int = 0,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> List[SweepRow]:
    r"""Measure softmax saturation and gradient flow for each (d_k, scale).

    For each ``d_k``, ``trials`` independent problems are drawn: ``q`` of
    shape ``(n_queries, d_k)``, ``k`` of shape ``(n_keys, d_k)``, all
    standard normal, a standard normal ``v`` ``(n_keys, d_v)`` and upstream
    gradient ``dO`` ``(n_queries, d_v)``. The same draws are used for every
    scaling choice (common random numbers), and the draws of one ``d_k`` do
    not depend on which other ``d_k`` are in the sweep.

    Each problem runs through :func:`sdpa_forward` and :func:`sdpa_backward`.
    The gradient with respect to the pre-softmax scores is the backward's
    gradient for an all-zero float ``attn_mask`` (the mask is added to the
    scores, so :math:`dB = dT`).

    Parameters
    ----------
    d_ks : sequence of int
        Key widths.
    n_keys, n_queries, trials, d_v : int
        Problem sizes; defaults keep the default sweep well under 2 s.
    scales : iterable of {"none", "sqrt", "linear"}
    seed : int
        Makes the result deterministic.
    progress : callable, optional
        Called as ``progress(i, n, label)`` before each (d_k, scale).

    Returns
    -------
    list of SweepRow
        One row per (d_k, scale), ``d_k`` outermost. Per-row quantities are
        averaged over the query rows of a trial, then over trials:
        ``score_std`` (std of all scaled scores of a trial), ``entropy``,
        ``normalized_entropy``, ``max_weight_mean`` / ``_median`` (the top
        weight of a row), ``saturated_fraction`` (rows with top weight >
        0.9), ``grad_norm_scores`` / ``grad_norm_query`` (mean L2 norm of a
        row of dT / dQ), ``grad_norm_key`` (mean L2 norm of a row of dK) and
        ``jacobian_norm`` (mean Frobenius norm of the row softmax Jacobian).
    """
    d_ks = [_positive_int(d, "d_ks") for d in d_ks]
    scales = [V.check_choice(s, "scales", tuple(SCALES)) for s in scales]
    n_keys = _positive_int(n_keys, "n_keys", minimum=2)
    n_queries = _positive_int(n_queries, "n_queries")
    trials = _positive_int(trials, "trials", minimum=2)
    d_v = _positive_int(d_v, "d_v")
    rows = []
    total, i = len(d_ks) * len(scales), 0
    for d_k in d_ks:
        rng = np.random.default_rng([seed, d_k])
        q = rng.standard_normal((trials, 1, n_queries, d_k))
        k = rng.standard_normal((trials, 1, n_keys, d_k))
        v = rng.standard_normal((trials, 1, n_keys, d_v))
        g = rng.standard_normal((trials, 1, n_queries, d_v))
        zero_bias = np.zeros((trials, 1, n_queries, n_keys))
        raw = q @ np.swapaxes(k, -1, -2)                       # unscaled scores
        for name in scales:
            if progress is not None:
                progress(i, total, f"d_k={d_k} scale={name}")
            i += 1
            s = scale_value(d_k, name)
            _, res = sdpa_forward(q, k, v, zero_bias, scale=s)
            grads = sdpa_backward(res, g)
            P = res.probs[:, 0]                                # (trials, nq, nk)
            top = P.max(axis=-1)
            per_trial = {
                "score_std": (s * raw[:, 0]).reshape(trials, -1).std(axis=1),
                "entropy": softmax_entropy(P).mean(-1),
                "normalized_entropy": normalized_entropy(P).mean(-1),
                "max_weight_mean": top.mean(-1),
                "saturated_fraction": (top > SATURATION_THRESHOLD).mean(-1),
                "grad_norm_scores": np.linalg.norm(grads.attn_mask[:, 0], axis=-1).mean(-1),
                "grad_norm_query": np.linalg.norm(grads.query[:, 0], axis=-1).mean(-1),
                "grad_norm_key": np.linalg.norm(grads.key[:, 0], axis=-1).mean(-1),
                "jacobian_norm": softmax_jacobian_norm(P).mean(-1),
            }
            stats = {}
            for key, vals in per_trial.items():
                stats[key] = float(vals.mean())
                stats[key + "_stderr"] = float(vals.std(ddof=1) / np.sqrt(trials))
            rows.append(SweepRow(
                d_k=d_k, scale=name, scale_value=s, predicted_score_std=predicted_score_std(d_k, name),
                max_weight_median=float(np.median(top)), trials=trials, n_queries=n_queries, n_keys=n_keys,
                **stats,
            ))
    return rows


def _positive_int(x, name, minimum=1):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < minimum:
        raise ValueError(f"`{name}` should hold ints >= {minimum}, but got {x!r}")
    return int(x)
