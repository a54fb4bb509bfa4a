"""The LSE in the kernels' conventions (base 2, empty rows) and the row statistics (cuDNN's max and sum-exp)."""

import math
import warnings

import numpy as np
import pytest

from sdpa_ref import sdpa_forward
from sdpa_ref.lse import convert_lse
from tolerances import EXACT, F64_ONE_ULP, F64_REGROUPED, F64_SUMS, F64_TWO_ULP

RNG = np.random.default_rng(7)


def _problem(**opts):
    q = RNG.standard_normal((2, 4, 5, 8))
    k = RNG.standard_normal((2, 2, 6, 8))
    v = RNG.standard_normal((2, 2, 6, 3))
    mask = np.ones((5, 6), bool)
    mask[1] = False                                    # a row with no allowed key
    return q, k, v, mask


def _plain_lse(q, k, v, mask, base):
    """A Python loop with math.exp / math.log (math.log2), GQA by h // G."""
    B, Hq, L, E = q.shape
    G = Hq // k.shape[1]
    out = np.empty((B, Hq, L))
    for b in range(B):
        for h in range(Hq):
            for i in range(L):
                t = [float(q[b, h, i] @ k[b, h // G, j]) / math.sqrt(E) for j in range(k.shape[2]) if mask[i, j]]
                if not t:
                    out[b, h, i] = -math.inf
                    continue
                m = max(t)
                s = sum(math.exp(x - m) for x in t)
                out[b, h, i] = (m + math.log(s)) / (math.log(2) if base == 2 else 1.0)
    return out


@pytest.mark.parametrize("method", ["fast", "plain", "tiled", "reproducible"])
def test_lse_in_base_2_and_the_row_statistics_against_a_loop(method):
    q, k, v, mask = _problem()
    kw = {"precision": "reproducible"} if method == "reproducible" else {"method": method}
    _, res = sdpa_forward(q, k, v, attn_mask=mask, enable_gqa=True, **kw)
    for base in ("e", 2):
        np.testing.assert_allclose(res.lse_as(base=base), _plain_lse(q, k, v, mask, base), rtol=F64_SUMS, atol=EXACT)
    m, s = res.row_max, res.row_sumexp
    assert np.all(m[:, :, 1] == -np.inf) and np.all(s[:, :, 1] == 0.0)      # cuDNN's convention on empty rows
    full = np.arange(5) != 1
    assert np.all((s[..., full] >= 1.0) & (s[..., full] <= 6.0))
    np.testing.assert_allclose(m[..., full] + np.log(s[..., full]), res.lse[..., full], rtol=F64_REGROUPED)


@pytest.mark.parametrize("empty, value", [("-inf", -np.inf), ("+inf", np.inf), ("inf", np.inf), (0.0, 0.0),
                                          (-3.5, -3.5)])
def test_the_empty_row_convention_is_selectable_and_round_trips(empty, value):
    lse = np.array([[0.5, -np.inf, 3.0, np.nan]])
    got = convert_lse(lse, base=2, empty=empty)
    assert got[0, 1] == value and np.isnan(got[0, 3])
    assert got[0, 0] == 0.5 * 1.4426950408889634
    back = convert_lse(got, from_base=2, from_empty=empty)
    assert back[0, 1] == -np.inf
    np.testing.assert_allclose(back[0, [0, 2]], lse[0, [0, 2]], rtol=F64_TWO_ULP)   # one rounding each way
    assert np.isnan(back[0, 3])


def test_base_2_round_trip_is_within_an_ulp_and_nothing_is_mutated():
    lse = RNG.standard_normal(1000) * 50
    keep = lse.copy()
    two = convert_lse(lse, base=2)
    np.testing.assert_array_equal(lse, keep)
    np.testing.assert_allclose(two, lse / math.log(2), rtol=F64_ONE_ULP)
    np.testing.assert_allclose(convert_lse(two, from_base=2), lse, rtol=F64_TWO_ULP)
    assert convert_lse(lse) is not lse
    assert convert_lse(lse.astype(np.float32), base=2).dtype == np.float32


@pytest.mark.parametrize("kwargs, name", [({"base": 10}, "base"), ({"base": True}, "base"), ({"base": "ln"}, "base"),
                                          ({"empty": "nan"}, "empty"), ({"empty": float("nan")}, "empty"),
                                          ({"empty": None}, "empty"), ({"from_base": "10"}, "from_base"),
                                          ({"from_empty": "zero"}, "from_empty")])
def test_bad_conventions_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        convert_lse([0.0], **kwargs)


@pytest.mark.parametrize("bad", ["abc", [1, 2], np.array([1 + 1j])])
def test_bad_lse_names_the_argument(bad):
    with pytest.raises(TypeError, match="`lse`"):
        convert_lse(bad)


def test_residual_lse_as_takes_the_poisoned_rows_from_lse():
    q, k, v, mask = _problem()
    q[0, 0, 0, 0] = np.nan
    _, res = sdpa_forward(q, k, v, attn_mask=mask, enable_gqa=True)
    assert np.isnan(res.lse_as(base=2)[0, 0, 0]) and np.isnan(res.row_max[0, 0, 0])
    assert np.isnan(res.row_sumexp[0, 0, 0])
    assert not np.isnan(res.lse_as(base=2)[1]).any()               # the other batch read no NaN


# ---------------------------------------------------------------- precision="reproducible": faithful conversions


def _near_powers_of_two(c):
    """LSEs ``x`` of either sign whose ``x * c`` is within a few ulps of a power of two (where the ulp of the
    result doubles), from 2**-30 to 2**1000, beside random ones of every size (both signs), 0, and a subnormal."""
    k = 2.0 ** np.arange(-30, 1001, 7)
    x = k / c
    near = np.concatenate([x] + [np.nextafter(x, d) for d in (0, np.inf)] + [x * (1 + 2.0 ** -50)])
    rand = RNG.uniform(-1, 1, 300) * 10.0 ** RNG.integers(-20, 300, 300)
    return np.concatenate([near, -near, rand, [0.0, -0.0, 5e-310, -1e308, 1.2e308]])


@pytest.mark.parametrize("to_base", [2, "e"])
def test_reproducible_conversion_is_faithful_against_mpmath(to_base):
    """``convert_lse(precision="reproducible")`` within 1 ulp of 50-digit mpmath in both directions, both signs,
    near powers of two; the same convention mapping of empty rows and NaN as the fast conversion."""
    import mpmath
    from helpers import assert_faithful
    ctx = mpmath.MPContext()
    ctx.dps = 50
    c = 1 / ctx.log(2) if to_base == 2 else ctx.log(2)
    x = _near_powers_of_two(float(c))
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        got = convert_lse(x, base=to_base, from_base="e" if to_base == 2 else 2, precision="reproducible")
    fin = np.abs(x * float(c)) < 1.79e308                         # the product overflows: +-inf, as IEEE says
    truth = np.array([ctx.mpf(float(a)) * c for a in x[fin]], dtype=object)
    assert_faithful(got[fin], truth, f"convert_lse to base {to_base}")
    assert np.array_equal(got[~fin], np.sign(x[~fin]) * np.inf)
    special = np.array([-np.inf, np.nan, 1.0])
    for kw in ({}, {"empty": "+inf"}, {"empty": 3.5}):
        a = convert_lse(special, base=2, precision="reproducible", **kw)
        b = convert_lse(special, base=2, **kw)
        assert np.array_equal(a[:2], b[:2], equal_nan=True)


def test_reproducible_conversion_keeps_the_dtype_and_values_without_a_change_of_base():
    x = RNG.standard_normal(50).astype(np.float32)
    assert convert_lse(x, base=2, precision="reproducible").dtype == np.float32
    assert np.array_equal(convert_lse(x, precision="reproducible"), x)
    with pytest.raises(ValueError, match="`precision`"):
        convert_lse(x, precision="exact")
