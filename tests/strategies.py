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


@st.composite
def variant_problem(draw, max_len=5):
    """Inputs plus any combination of the beyond-PyTorch options, with oracle-ready full arrays."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    use_gqa = draw(st.booleans())
    G = draw(st.integers(2, 3)) if use_gqa else 1
    Hq = Hkv * G
    L, S = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    E, Ev = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((B, Hq, L, E)) * 1.5
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, Ev))
    opts = {"enable_gqa": use_gqa, "is_causal": draw(st.booleans()),
            "causal_alignment": draw(st.sampled_from(["top_left", "bottom_right"])),
            "fully_masked": draw(st.sampled_from(["zero", "nan", "uniform"]))}
    oracle = {"is_causal": opts["is_causal"], "alignment": opts["causal_alignment"], "policy": opts["fully_masked"]}
    if draw(st.booleans()):
        m = rng.random((1, Hq, L, S)) < 0.7
        opts["attn_mask"] = m
        oracle["mask"] = np.broadcast_to(m, (B, Hq, L, S))
    if draw(st.booleans()):
        b = rng.standard_normal((Hq, L, S))
        opts["bias"] = b
        oracle["bias"] = np.broadcast_to(b, (B, Hq, L, S))
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.just(-1), st.integers(0, 3))
        opts["window"] = oracle["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        opts["softcap"] = oracle["softcap"] = draw(st.sampled_from([0.5, 1.0, 3.0]))
    if draw(st.booleans()):
        s = rng.random((B, Hq))
        opts["alibi_slopes"] = s
        oracle["slopes"] = s
    if draw(st.booleans()):
        opts["q_lengths"] = oracle["q_lengths"] = rng.integers(0, L + 1, B)
        opts["kv_lengths"] = oracle["kv_lengths"] = rng.integers(0, S + 1, B)
    if draw(st.booleans()):
        keep = rng.random((B, Hq, L, S)) >= 0.3
        opts["dropout_p"], opts["dropout_mask"] = 0.3, keep
        oracle["p"], oracle["keep"] = 0.3, keep
    return q, k, v, opts, oracle


def differentiable(opts, float_mask):
    """``variant_problem``'s options made fit for finite differences: no NaN policy rows (no difference to
    take), and with ``float_mask`` the bool mask as a float one (0.5 or -inf), so its gradient is checked too."""
    if opts["fully_masked"] == "nan":
        opts["fully_masked"] = "zero"
    if float_mask and "attn_mask" in opts:
        opts["attn_mask"] = np.where(opts["attn_mask"], 0.5, -np.inf)
    return opts


def dense_case(**extra):
    """``(q, k, v, opts)`` of the full-Jacobian checks: softcap, a float mask with a fully masked row, a bias,
    GQA, dropout and padding (``extra`` adds options)."""
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 4, 3, 2)), rng.standard_normal((2, 2, 4, 2)), rng.standard_normal((2, 2, 4, 3))
    mask = np.where(rng.random((2, 4, 3, 4)) < 0.7, 0.25, -np.inf)
    mask[1, 2, 0] = -np.inf
    opts = dict(enable_gqa=True, softcap=2.0, attn_mask=mask, bias=rng.standard_normal((4, 3, 4)),
                dropout_p=0.25, dropout_mask=rng.random((2, 4, 3, 4)) > 0.25, q_lengths=np.array([3, 2]), **extra)
    return q, k, v, opts
