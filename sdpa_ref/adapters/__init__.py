"""Adapters that wrap other frameworks' attention for the conformance harness.

Each is an optional import: ``import sdpa_ref`` never imports a framework.
``torch_sdpa()``, ``jax_dpa()``, ``keras_dpa()`` and ``tinygrad_sdpa()`` each
return ``(forward, backward, supports)`` for
:func:`sdpa_ref.conformance.check_implementation`, and ``onnx_attention()``
``(forward, None, supports)`` (the ONNX operator has no gradient); their
modules also expose ready-made ``forward`` / ``backward`` callables for
``sdpa-ref conform``, e.g. ``sdpa-ref conform sdpa_ref.adapters.pytorch:forward``.
What a framework cannot do is a skip whose reason is the framework's own.
"""

__all__ = ["torch_sdpa", "jax_dpa", "onnx_attention", "keras_dpa", "tinygrad_sdpa"]


def torch_sdpa(device="cpu", backend=None):
    """See :func:`sdpa_ref.adapters.pytorch.torch_sdpa`."""
    from .pytorch import torch_sdpa as make

    return make(device=device, backend=backend)


def jax_dpa(implementation=None):
    """See :func:`sdpa_ref.adapters.jax_nn.jax_dpa`."""
    from .jax_nn import jax_dpa as make

    return make(implementation=implementation)


def onnx_attention(runtime="reference"):
    """See :func:`sdpa_ref.adapters.onnx.onnx_attention`."""
    from .onnx import onnx_attention as make

    return make(runtime=runtime)


def keras_dpa():
    """See :func:`sdpa_ref.adapters.keras.keras_dpa`."""
    from .keras import keras_dpa as make

    return make()


def tinygrad_sdpa(device=None):
    """See :func:`sdpa_ref.adapters.tinygrad.tinygrad_sdpa`."""
    from .tinygrad import tinygrad_sdpa as make

    return make(device=device)
