"""Importable implementations for the `sdpa-ref conform` tests."""

from sdpa_ref import sdpa_backward, sdpa_forward


def ref_forward(q, k, v, **o):
    return sdpa_forward(q, k, v, **o)[0]


def ref_backward(g, q, k, v, **o):
    gr = sdpa_backward(sdpa_forward(q, k, v, **o)[1], g)
    return (gr.query, gr.key, gr.value) + ((gr.bias,) if gr.bias is not None else ())


def wrong_scale(q, k, v, scale=None, **o):
    return sdpa_forward(q, k, v, scale=0.5 / q.shape[-1], **o)[0]


def plain_only(q, k, v):
    return sdpa_forward(q, k, v)[0]


plain_only.supports = set()


def ref_forward_lse(q, k, v, **o):
    """``(out, lse)`` in base e, the LSE in float32 below float64 (FlashAttention's convention)."""
    import numpy as np
    out, res = sdpa_forward(q, k, v, **o)
    return out, res.lse.astype(np.float64 if q.dtype == np.float64 else np.float32)


def ref_forward_bshd(q, k, v, **o):
    """The reference in FlashAttention's and JAX's ``(B, L, H, E)`` order."""
    return sdpa_forward(q, k, v, layout="bshd", **o)[0]
