"""Adapters that wrap other frameworks' attention for the conformance harness.

Each is an optional import: ``import sdpa_ref`` never imports torch or jax.
``torch_sdpa()`` and ``jax_dpa()`` each return ``(forward, backward,
supports)`` for :func:`sdpa_ref.conformance.check_implementation`; their
modules also expose ready-made ``forward`` / ``backward`` callables for
``sdpa-ref conform``, e.g. ``sdpa-ref conform sdpa_ref.adapters.pytorch:forward``.
"""

__all__ = ["torch_sdpa", "jax_dpa"]


def torch_sdpa(device="cpu", backend=None):
    """See :func:`sdpa_ref.adapters.pytorch.torch_sdpa`."""
    from .pytorch import torch_sdpa as make

    return make(device=device, backend=backend)


def jax_dpa(implementation=None):
    """See :func:`sdpa_ref.adapters.jax_nn.jax_dpa`."""
    from .jax_nn import jax_dpa as make

    return make(implementation=implementation)
