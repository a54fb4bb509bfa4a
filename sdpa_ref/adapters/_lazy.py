"""The lazily built module-level ``forward`` / ``backward`` of the adapters."""

__all__ = ["_Lazy"]


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
