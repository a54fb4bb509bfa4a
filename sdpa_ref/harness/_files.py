"""Reading a file that someone else may control: open first, then check the open descriptor.

Checking a path (``os.lstat``) and then opening it leaves a window in which
another process can swap in a FIFO, which would block ``open`` or ``read``
forever, a symlink, or a device. :func:`read_regular_file` closes that
window: it opens with ``O_NOFOLLOW`` (a symlink is refused by the kernel)
and ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a writer),
then asks ``fstat`` about the descriptor it holds, so what it checks is what
it reads. Reads are bounded by the caller's limit.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Optional, Tuple

__all__ = ["read_regular_file"]

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) \
    | getattr(os, "O_NOCTTY", 0)


def read_regular_file(path, limit: int) -> Tuple[Optional[bytes], Optional[str]]:
    """``(data, None)`` with the bytes of the regular file ``path``, or ``(None, why)`` in a few words.

    Never follows a symbolic link at ``path`` itself, never blocks on a FIFO or
    a device, and reads at most ``limit`` bytes (a larger file is refused, one
    that grows past it while read too).
    """
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "a symbolic link: not read"
        if exc.errno == errno.ENXIO:                       # a FIFO or socket with no other end
            return None, "not a regular file: not read"
        return None, f"missing or unreadable: {exc.strerror or exc}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file: not read"
        if st.st_size > limit:
            return None, f"{st.st_size} bytes, more than the {limit} allowed: not read"
        chunks, n = [], 0
        while n <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
        if n > limit:
            return None, "grew past the size limit while read: not read"
        return b"".join(chunks), None
    except OSError as exc:
        return None, f"unreadable: {exc.strerror or exc}"
    finally:
        os.close(fd)
