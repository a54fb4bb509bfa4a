"""Regenerated vector files kept per process, within a bound: small files only, a few tens of MiB in all.

A vector file is deterministic to the bit, so a file computed once (by ``write_vectors``) can serve the next
``verify`` of the same case in the same process (the tests write a set, then verify it, many times). An unbounded
cache would hold every case ever regenerated; :class:`KeptFiles` keeps a file only if its arrays take at most
``file_bytes``, and drops the least recently used past ``total_bytes``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

__all__ = ["KeptFiles"]


class KeptFiles:
    """A thread-safe, least-recently-used store of ``{name: array}`` dicts, bounded in bytes."""

    def __init__(self, file_bytes: int, total_bytes: int):
        self.file_bytes, self.total_bytes = file_bytes, total_bytes
        self._store: "OrderedDict[tuple, dict]" = OrderedDict()
        self._sizes = {}
        self._lock = threading.Lock()

    def get(self, key):
        """The arrays kept under ``key``, or None."""
        with self._lock:
            if key not in self._store:
                return None
            self._store.move_to_end(key)
            return self._store[key]

    def put(self, key, arrays) -> None:
        """Keep ``arrays`` under ``key`` if they are small enough, dropping the oldest past the total."""
        size = sum(a.nbytes for a in arrays.values())
        if size > self.file_bytes:
            return
        with self._lock:
            self._store[key], self._sizes[key] = arrays, size
            while sum(self._sizes.values()) > self.total_bytes:
                old, _ = self._store.popitem(last=False)
                del self._sizes[old]

    def clear(self) -> None:
        with self._lock:
            self._store.clear()
            self._sizes.clear()
