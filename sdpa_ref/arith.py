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

    @staticmethod
    def recip(n):
        """``1/n`` for positive ``n`` (a count, or an array of counts): one IEEE division (a Python float for a
        Python number, as it mixes with arrays of any dtype without widening them)."""
        return 1.0 / n

    @staticmethod
    def div_masked(x, keep, a, b, out=None):
        """``x * Z / (a + b)`` for the bool mask ``Z`` (``keep``) and the divisor ``a + b`` of two floats: the
        factor ``Z * (1 / (a + b))`` rounded once to ``x``'s dtype, then one multiply (into ``out`` if given).
        A multiply, not ``np.where``, so that a NaN entry stays NaN where ``Z`` is 0 (``NaN * 0``)."""
        return np.multiply(x, keep * x.real.dtype.type(1.0 / (a + b)), out=out)


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
