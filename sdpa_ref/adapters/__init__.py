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


class _Lazy:
    """A module-level ``forward`` / ``backward`` for ``sdpa-ref conform``, built on the first call."""

    def __init__(self, factory, which, supports):
        self.factory, self.which, self.supports = factory, which, supports
        self._fn = None

    def __call__(self, *args, **kwargs):
        if self._fn is None:
            fwd, bwd, _ = self.factory()
            self._fn = fwd if self.which == "forward" else bwd
        return self._fn(*args, **kwargs)
