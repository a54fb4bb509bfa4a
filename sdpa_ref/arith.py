r"""The NumPy arithmetic: the interface of :mod:`sdpa_ref.exact.arith` over plain arrays in the compute dtype.

A stage written once over an arithmetic ``X`` (``X.add``, ``X.mul``, ``X.exp_minus``, ``X.sum``, ...) runs in
double-double or the honest low precision for ``precision="reproducible"`` (:mod:`sdpa_ref.exact.arith`) and,
with :data:`NUMPY`, on the ndarrays of the ``"fast"``, ``"plain"`` and ``"tiled"`` engines: each operation is
NumPy's own, a value is its array, and nothing is rounded twice. :func:`sdpa_ref.sinks.sink_softmax_vjp_in` and
:func:`sdpa_ref.sinks.fold_sink_in` are such stages.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NUMPY", "NUMPY2", "NumPyArith", "NumPyBase2"]


class NumPyArith:
    """NumPy's operations on arrays of the compute dtype (complex included); values are the arrays."""

    @staticmethod
    def const(x):
        return x

    @staticmethod
    def value(a):
        return a

    @staticmethod
    def lift(x):
        return np.asarray(x)

    add, sub, mul, div = staticmethod(np.add), staticmethod(np.subtract), staticmethod(np.multiply), \
        staticmethod(np.divide)
    add_d, mul_d = staticmethod(np.add), staticmethod(np.multiply)

    @staticmethod
    def exp_minus(a, m):
        """``exp(a - m)``."""
        return np.exp(a - m)

    neg = staticmethod(np.negative)

    @staticmethod
    def where(cond, a, b):
        return np.where(cond, a, b)

    @staticmethod
    def take(a, idx):
        return np.take_along_axis(a, idx, -1)

    @staticmethod
    def sum(a, axis=-1, keepdims=False):
        return np.sum(a, axis=axis, keepdims=keepdims)


class NumPyBase2(NumPyArith):
    """:class:`NumPyArith` whose exponential is base 2 (``exp2``): FlashInfer's base-2 log-sum-exps combined
    with no conversion rounding."""

    @staticmethod
    def exp_minus(a, m):
        """``2 ** (a - m)``."""
        return np.exp2(a - m)


#: The one instance (and its base-2 twin).
NUMPY = NumPyArith()
NUMPY2 = NumPyBase2()
