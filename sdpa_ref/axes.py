r"""The dense problem in the order a kernel keeps its axes: ``"bhsd"`` or ``"bshd"``.

The package computes in ``(..., H, L, E)`` (``"bhsd"``: PyTorch's SDPA, FlexAttention, cuDNN's default). Many
kernels keep the sequence axis before the heads, ``(..., L, H, E)`` (``"bshd"``: FlashAttention's dense
functions, JAX's ``dot_product_attention``, Keras, xformers' ``BMHK``). ``layout="bshd"`` on any entry point
takes ``query``, ``key``, ``value`` (and MLA's ``qv``) in that order and gives ``out``, the output's tangent and
the gradients of ``query``, ``key``, ``value`` (and ``qv``) back in it; everything else keeps its own shape, as
those kernels keep it: the LSE ``(..., H, L)`` (FlashAttention's ``softmax_lse``), masks and biases
``(..., H, L, S)``, sinks ``(H,)``.

The map is a transpose of the two axes before the last, so it is its own inverse and its VJP: the forward,
the gradients and the tangents go through the same swap, and no value is rounded or reordered -- results in
``"bshd"`` are the ``"bhsd"`` ones, bit for bit, with the axes swapped.
"""

from __future__ import annotations

import numpy as np

from . import _validate as V

__all__ = ["DENSE_LAYOUTS", "Swapped", "is_dense_layout"]

#: The dense layouts' names: the package's own order first.
DENSE_LAYOUTS = ("bhsd", "bshd")


def is_dense_layout(layout) -> bool:
    """Whether ``layout`` names a dense order (:data:`DENSE_LAYOUTS`); another string is a `ValueError`."""
    if not isinstance(layout, str):
        return False
    V.check_choice(layout, "layout", DENSE_LAYOUTS + ("a sdpa_ref.layouts.Packed or KVCache",))
    return True


def _swap(x, name):
    a = np.asarray(x)
    if a.ndim < 3:
        raise ValueError(f"`{name}` should have at least 3 dims (..., L, H, E) with layout='bshd', but got shape "
                         f"{a.shape}")
    return np.swapaxes(a, -3, -2)


class Swapped:
    """``layout="bshd"``: the caller's ``(..., L, H, E)`` arrays as the dense ``(..., H, L, E)`` and back, in the
    interface of :class:`sdpa_ref.layouts.Gathered` (the entry points call both alike). Views, not copies: the
    problem copies what it keeps."""

    lengths = None                                   # no sequence lengths: the dense problem's own

    def __init__(self, query, key, value):
        self.q, self.k, self.v = (_swap(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
        self.shapes = {"query": np.shape(query), "key": np.shape(key), "value": np.shape(value)}
        self.out_shape = tuple(np.shape(query)[:-1]) + (np.shape(value)[-1],)
        self.lse_shape = tuple(self.q.shape[:-1])

    def out(self, o):
        """The output ``(..., H, L, Ev)`` as ``(..., L, H, Ev)``: a new array."""
        return np.ascontiguousarray(np.swapaxes(o, -3, -2))

    def lse(self, lse, fill=-np.inf):
        """A per-row quantity stays ``(..., H, L)``."""
        return lse

    def gather_out(self, g):
        """A cotangent or tangent of the output, ``(..., L, H, Ev)``, as ``(..., H, L, Ev)``."""
        return np.swapaxes(np.asarray(g), -3, -2)

    def gather_lse(self, g):
        return np.asarray(g)

    def gather_qv(self, qv):
        """MLA's ``qv`` ``(..., L, H, Ev)`` as ``(..., H, L, Ev)``; its shape kept for its gradient."""
        self.shapes["qv"] = np.shape(qv)
        return _swap(qv, "qv")

    def gather_input(self, t, name):
        """A tangent of ``query``, ``key``, ``value`` or ``qv`` in the caller's order, as the dense one."""
        return np.swapaxes(np.asarray(t), -3, -2)

    def scatter_input(self, d, name):
        """A gradient (or tangent) of an input, dense, in the caller's order: a new array."""
        return np.ascontiguousarray(np.swapaxes(d, -3, -2))
