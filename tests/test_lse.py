"""The LSE in the kernels' conventions (base 2, empty rows) and the row statistics (cuDNN's max and sum-exp)."""

import math

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
