"""Hypothesis strategies shared by the test modules."""

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

finite = st.floats(-30, 30, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def logits(draw, min_dims=1, max_dims=4, max_side=5, elements=finite):
    """A float64 array and an axis of it."""
    shape = draw(hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=1, max_side=max_side))
    x = draw(hnp.arrays(np.float64, shape, elements=elements))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return x, axis


@st.composite
def attention_problem(draw, max_batch=2, max_len=5, max_width=4, gqa=None):
    """Shapes and seeded inputs for attention: (q, k, v, options)."""
    B = draw(st.integers(1, max_batch))
    Hkv = draw(st.integers(1, 2))
    use_gqa = draw(st.booleans()) if gqa is None else gqa
    G = draw(st.integers(1, 3)) if use_gqa else 1
    L = draw(st.integers(1, max_len))
    S = draw(st.integers(1, max_len))
    E = draw(st.integers(1, max_width))
    Ev = draw(st.integers(1, max_width))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hkv * G, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, Ev))
    opts = {"enable_gqa": use_gqa, "is_causal": draw(st.booleans())}
    kind = draw(st.sampled_from(["none", "bool", "float"]))
    if kind == "bool":
        opts["attn_mask"] = rng.random((B, Hkv * G, L, S)) < 0.7
    elif kind == "float":
        opts["attn_mask"] = rng.standard_normal((1, Hkv * G, L, S))
    return q, k, v, opts
