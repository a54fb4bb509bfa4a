"""Bad input gets a ValueError or TypeError that names the argument."""

import numpy as np
import pytest

from sdpa_ref import scaled_dot_product_attention, sdpa_backward, sdpa_forward

rng = np.random.default_rng(0)
Q = rng.standard_normal((2, 4, 3, 8))
K = rng.standard_normal((2, 4, 5, 8))
Vv = rng.standard_normal((2, 4, 5, 6))

CASES = [
    # (description, kwargs overriding q/k/v/options, exception, name in message)
    ("rank < 2 query", dict(query=np.ones(8)), ValueError, "query"),
    ("rank < 2 key", dict(key=np.ones(8)), ValueError, "key"),
    ("E differs", dict(key=rng.standard_normal((2, 4, 5, 7))), ValueError, "key"),
    ("S differs", dict(value=rng.standard_normal((2, 4, 6, 6))), ValueError, "value"),
    ("batch does not broadcast", dict(key=rng.standard_normal((3, 4, 5, 8)), value=rng.standard_normal((3, 4, 5, 6))),
     ValueError, "query"),
    ("Hq != Hkv without GQA", dict(key=K[:, :2], value=Vv[:, :2]), ValueError, "key"),
    ("Hq % Hkv with GQA", dict(key=K[:, :3], value=Vv[:, :3], enable_gqa=True), ValueError, "key"),
    ("value heads differ", dict(value=Vv[:, :2]), ValueError, "value"),
    ("int mask", dict(attn_mask=np.ones((3, 5), dtype=int)), TypeError, "attn_mask"),
    ("object mask", dict(attn_mask=np.array([[None] * 5] * 3)), TypeError, "attn_mask"),
    ("mask shape", dict(attn_mask=np.ones((3, 4), dtype=bool)), ValueError, "attn_mask"),
    ("mask would enlarge the output", dict(attn_mask=np.ones((7, 2, 4, 3, 5), dtype=bool)), ValueError, "attn_mask"),
    ("inf scale", dict(scale=np.inf), ValueError, "scale"),
    ("nan scale", dict(scale=np.nan), ValueError, "scale"),
    ("zero scale", dict(scale=0.0), ValueError, "scale"),
    ("string scale", dict(scale="0.5"), TypeError, "scale"),
    ("dropout_p = 1", dict(dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout_p < 0", dict(dropout_p=-0.1), ValueError, "dropout_p"),
    ("dropout_mask shape", dict(dropout_p=0.2, dropout_mask=np.ones((3, 4), dtype=bool)), ValueError, "dropout_mask"),
    ("dropout_mask dtype", dict(dropout_p=0.2, dropout_mask=np.ones((3, 5))), TypeError, "dropout_mask"),
    ("bad rng", dict(dropout_p=0.2, rng="seed"), TypeError, "rng"),
    ("int query", dict(query=np.ones((2, 4, 3, 8), dtype=int)), TypeError, "query"),
    ("bool key", dict(key=np.ones((2, 4, 5, 8), dtype=bool)), TypeError, "key"),
    ("complex value", dict(value=Vv.astype(complex)), TypeError, "value"),
    ("object query", dict(query=np.array([[object()]])), TypeError, "query"),
    ("unknown fully_masked", dict(fully_masked="ignore"), ValueError, "fully_masked"),
    ("non-bool is_causal", dict(is_causal="yes"), TypeError, "is_causal"),
]


@pytest.mark.parametrize("desc,override,exc,name", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("fn", [scaled_dot_product_attention, sdpa_forward])
def test_bad_input(fn, desc, override, exc, name):
    kw = dict(query=Q, key=K, value=Vv)
    kw.update(override)
    with pytest.raises(exc) as info:
        fn(**kw)
    msg = str(info.value)
    assert f"`{name}`" in msg, msg
    assert "should" in msg and "got" in msg, msg


def test_bad_grad_out_and_residuals():
    out, res = sdpa_forward(Q, K, Vv)
    with pytest.raises(ValueError, match="`grad_out`"):
        sdpa_backward(res, np.ones((2, 4, 3, 5)))
    with pytest.raises(TypeError, match="`grad_out`"):
        sdpa_backward(res, np.ones(out.shape, dtype=int))
    with pytest.raises(TypeError, match="`residuals`"):
        sdpa_backward({"probs": 1}, np.ones(out.shape))
