"""Nothing a user does makes a computed result change: no aliasing between what the caller holds and the
residuals (issue 12, part 1)."""

import numpy as np
import pytest

import sdpa_ref

HOWS = ["fast", "plain", "tiled", "reproducible"]


def _forward(how, q, k, v, **kw):
    if how == "reproducible":
        return sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **kw)
    return sdpa_ref.sdpa_forward(q, k, v, method=how, **kw)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((2, 2, 5, 3)) for _ in range(4))
    bias = rng.standard_normal((5, 5))
    mask = rng.random((5, 5)) < 0.8
    mask[:, 0] = True
    return q, k, v, g, bias, mask


@pytest.mark.parametrize("how", HOWS)
def test_writing_into_the_returned_output_changes_no_gradient(how):
    q, k, v, g, bias, _ = _inputs()
    out, res = _forward(how, q, k, v, bias=bias)
    before = sdpa_ref.sdpa_backward(res, g)
    out *= 2                                                        # the caller's own array
    after = sdpa_ref.sdpa_backward(res, g)
    for a, b in zip(before, after):
        if a is not None:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("how", HOWS)
def test_writing_into_the_inputs_after_the_forward_changes_no_gradient(how):
    q, k, v, g, bias, mask = _inputs(1)
    out, res = _forward(how, q, k, v, bias=bias, attn_mask=mask)
    before = sdpa_ref.sdpa_backward(res, g)
    q += 1
    k *= -1
    v[...] = 0
    bias += 5
    mask[...] = False
    after = sdpa_ref.sdpa_backward(res, g)
    for a, b in zip(before, after):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_the_residuals_are_read_only():
    q, k, v, g, bias, _ = _inputs(2)
    out, res = sdpa_ref.sdpa_forward(q, k, v, bias=bias)
    for name in ("out", "lse", "probs"):
        arr = getattr(res, name)
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = 0
    assert not np.shares_memory(out, res.out)
    assert not np.shares_memory(q, res.problem.q)
