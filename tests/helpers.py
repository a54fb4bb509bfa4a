"""Small assertions shared by the test modules."""

import numpy as np


def assert_close_normwise(x, y, rtol):
    """NaN and infinities where ``x`` has them, ``|y - x| <= rtol * max(1, max|x|)`` elsewhere (None matches None)."""
    if x is None:
        assert y is None
        return
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
    fin = np.isfinite(x)
    np.testing.assert_array_equal(y[~fin & ~np.isnan(x)], x[~fin & ~np.isnan(x)])   # the same infinities
    scale = max(1.0, float(np.max(np.abs(x[fin]), initial=0.0)))
    np.testing.assert_allclose(y[fin], x[fin], rtol=rtol, atol=rtol * scale)
