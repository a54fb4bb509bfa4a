"""The check of a score function's own derivatives (:class:`sdpa_ref.ScoreMod`): its ``grad`` and
``params_vjp`` against central differences, one :func:`~sdpa_ref.gradcheck.check_vjp` of the function alone."""

from __future__ import annotations

from typing import Tuple

import numpy as np

from ..score_mod import ScoreMod, _call, as_score_mod, indices, params_vjp, score_mod_forward
from .checks import check_vjp

__all__ = ["check_score_mod"]


def check_score_mod(score_mod, shape: Tuple[int, ...] = (2, 3, 4, 5), *, seed: int = 0, rtol: float = 1e-6,
                    atol: float = 1e-9):
    """Check a score function's derivatives (its ``grad`` and ``params_vjp``, or the complex step when it has
    none) against central differences at random scores of ``shape`` ``(*batch, Hq, L, S)``; a
    :class:`~sdpa_ref.GradcheckReport` (:func:`sdpa_ref.check_vjp` of ``(score, *params) -> fn``)."""
    mod = as_score_mod(score_mod)
    if mod is None:
        raise TypeError("`score_mod` should be a callable or a ScoreMod, but got None")
    if not isinstance(shape, (tuple, list)) or len(shape) < 4 or not all(
            isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in shape):
        raise ValueError(f"`shape` should be (*batch, Hq, L, S) with at least 4 positive ints, but got {shape!r}")
    rng = np.random.default_rng(seed)
    idx = indices(tuple(int(n) for n in shape))
    x0 = rng.standard_normal(shape) * 2.0

    def fun(x, *ps):
        return np.asarray(_call(ScoreMod(mod.fn, params=ps, name=mod.name), x, idx, ps), dtype=np.float64)

    def vjp(g, x, *ps):
        m = ScoreMod(mod.fn, mod.grad, ps, mod.params_vjp, mod.name)
        return (g * score_mod_forward(m, x, idx, slope=True)[1],) + params_vjp(m, g, x, idx)

    return check_vjp(fun, vjp, (x0,) + mod.params, rtol=rtol, atol=atol, seed=seed)
