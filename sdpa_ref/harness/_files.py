"""Reading a file that someone else may control: open first, then check the open descriptor.

Checking a path (``os.lstat``) and then opening it leaves a window in which
another process can swap in a FIFO, which would block ``open`` or ``read``
forever, a symlink, or a device. :func:`read_regular_file` closes that
window: it opens with ``O_NOFOLLOW`` (a symlink is refused by the kernel)
and ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a writer),
then asks ``fstat`` about the descriptor it holds, so what it checks is what
it reads. Reads are bounded by the caller's limit.

Writing into a folder that someone else may have planted entries in:
:class:`WriteFolder` holds the folder open and writes each file to a new
temporary file created there with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (it can
be neither an existing file, nor a symlink, nor a FIFO), then
``os.replace``-s it onto the name: the rename replaces the directory entry,
so a symlink or hard link planted under that name is never written through.
:meth:`WriteFolder.refuse_unsafe` refuses, before anything is written, names
that exist and are not regular files.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Iterable, Optional, Tuple

__all__ = ["UnsafeDestination", "WriteFolder", "read_regular_file"]

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


_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0) \
    | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_HAVE_DIR_FD = all(f in os.supports_dir_fd for f in (os.open, os.rename, os.unlink, os.stat))
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


class UnsafeDestination(OSError):
    """A name :class:`WriteFolder` would replace exists and is not a regular file (``strerror`` says which)."""


class WriteFolder:
    """The folder ``path``, held open, to write whole files into safely (a context manager).

    ``path`` itself is followed if it is a symbolic link: it is the folder the caller named. The entries inside it
    are not: :meth:`write` never follows a symlink, never opens an existing entry, never blocks on a FIFO. Where the
    platform has ``dir_fd`` (POSIX), every operation is relative to the descriptor opened here, so the folder cannot
    be swapped for another between writes.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, _DIR_FLAGS) if _HAVE_DIR_FD else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _at(self, name):
        return (name, {"dir_fd": self.fd}) if self.fd is not None else (os.path.join(self.path, name), {})

    def kind(self, name) -> Optional[str]:
        """None if ``name`` is missing or a regular file, else what it is ("a symbolic link", "a FIFO", ...)."""
        where, kw = self._at(name)
        try:
            mode = os.stat(where, follow_symlinks=False, **kw).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISREG(mode):
            return None
        return next((what for test, what in _KINDS if test(mode)), "not a regular file")

    def refuse_unsafe(self, names: Iterable[str]) -> None:
        """:class:`UnsafeDestination` naming the first of ``names`` that exists and is not a regular file."""
        for name in names:
            what = self.kind(name)
            if what is not None:
                raise UnsafeDestination(errno.EEXIST, f"{name!r} in it is {what}, not a regular file: refused "
                                                      f"(only regular files are replaced; remove it)", name)

    def write(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Put ``data`` under ``name``: a new temporary file (``O_CREAT | O_EXCL | O_NOFOLLOW``), renamed onto it."""
        for _ in range(100):
            tmp = f".{name}.{secrets.token_hex(6)}.tmp"
            where, kw = self._at(tmp)
            try:
                fd = os.open(where, _WRITE_FLAGS, mode, **kw)
                break
            except FileExistsError:                          # someone holds that name: draw another
                continue
        else:
            raise FileExistsError(errno.EEXIST, "no free temporary name", name)
        try:
            try:
                view, n = memoryview(data), 0
                while n < len(view):
                    n += os.write(fd, view[n:])
            finally:
                os.close(fd)
            self.refuse_unsafe([name])                       # planted since it was checked: refused still
            if self.fd is not None:
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            else:
                os.replace(where, os.path.join(self.path, name))
        except BaseException:
            try:
                os.unlink(where, **kw)
            except OSError:
                pass
            raise
