"""Small assertions shared by the test modules."""

import numpy as np


def assert_close_normwise(x, y, rtol):
    """NaN where ``x`` has NaN, and ``|y - x| <= rtol * max(1, max|x|)`` elsewhere (None matches None)."""
    if x is None:
        assert y is None
        return
    np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
    fin = ~np.isnan(x)
    scale = max(1.0, float(np.max(np.abs(x[fin]), initial=0.0)))
    np.testing.assert_allclose(y[fin], x[fin], rtol=rtol, atol=rtol * scale)
