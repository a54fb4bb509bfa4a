r"""Guarded copies: an input whose memory sits inside a larger buffer, fenced by guard regions.

A kernel that reads past the end of a tensor reads whatever the allocator
left there, usually harmless numbers, so the bug goes unseen.
:func:`guarded` copies an array into the middle of a larger buffer: the
copy has the same shape, dtype and values, stride 1 on its last axis, and a
padded stride on every other axis, so that guard elements lie before it,
after it and between its rows (and between its heads, batch entries, ...).
The guard elements hold ``fill``: ``"nan"``, or ``"huge"``, a large finite
value (:data:`HUGE`, or the dtype's largest / 4 where that is less). A kernel that reads one row past the end of
a key tensor then takes a row of NaN into its scores (the NaN run), or a key
of huge scores that takes a softmax row's mass (the huge run), a difference
no rounding explains. The second fill catches what the first cannot: a
kernel that drops NaN on the way (``fmax``, a NaN-ignoring max, ``nan_to_num``).

:func:`guard_intact` says whether the guard regions still hold their fill,
bit for bit: a kernel that wrote outside its inputs broke them.

Only floating-point arrays are guarded (NumPy's real and complex floats and
the ``ml_dtypes`` ones: bfloat16, float8): an integer or boolean array has
no value that marks a stray read as plainly (an index read past its end
would crash or read another key, not show up as a difference), so
:func:`guarded` refuses it with a TypeError and the harness passes such
inputs as they are.

Each region is at least 64 bytes (and at least 8 elements), each row stride
and the start of the array are multiples of 64 bytes, and the region before
the array and after it is at least one row stride long: a read one row
before or after the array reads guard elements only. A kernel that copies its inputs
to contiguous memory first (``np.ascontiguousarray``, ``.contiguous()``)
drops the guards, which is fine: it reads no further than its copy.

This module imports nothing from the package (NumPy only; ``ml_dtypes``
for its dtypes' ``finfo``): the isolated harness's child process loads it by
its path to guard the inputs on its side (:mod:`.isolate`, :mod:`._worker`).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

__all__ = ["FILLS", "HUGE", "GuardBroken", "guard_fill", "guard_intact", "guard_value", "guarded", "is_guardable"]

#: The guard fills: NaN, and a huge finite value.
FILLS = ("nan", "huge")
#: The ``"huge"`` fill (or the dtype's largest / 4 where that is less: float16 16376, float8_e4m3fn 112): a
#: guard key's score then takes its row's mass and a guard value moves the output by about 1e4, while its
#: products with inputs of order 1 stay finite from float16 up, so that it shows as a number where a kernel
#: drops NaN.
HUGE = 2.0 ** 14
#: Bytes each guard region holds at least, and the alignment of the array's start and of its row strides.
_ALIGN_BYTES = 64
#: The ``ml_dtypes`` floating-point dtypes, by name (their NumPy kind is ``"V"``).
_LOW_FLOATS = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                         "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float6_e2m3fn",
                         "float6_e3m2fn", "float4_e2m1fn"})

# id(raw bytes) -> (weak reference to them, fill, the array's (address, shape, strides, dtype), mask of the
# array's elements in the buffer, the buffer's bytes in them); an entry goes when the bytes are freed.
_REGISTRY = {}
_LOCK = threading.Lock()


class GuardBroken(Exception):
    """A kernel wrote outside its inputs: the guard regions of the inputs ``names`` no longer hold their fill."""

    def __init__(self, names):
        self.names = [str(n) for n in names]
        super().__init__("writes outside its inputs: the guard regions around "
                         + ", ".join(f"`{n}`" for n in self.names) + " no longer hold their fill")


def guarded(array, fill="nan"):
    r"""A copy of ``array`` that sits inside a larger buffer, with guard regions before, after and between its rows.

    Parameters
    ----------
    array : array_like
        A floating-point array of any shape (NumPy's float16, float32,
        float64, complex, or an ``ml_dtypes`` float such as bfloat16).
    fill : {"nan", "huge"}
        What the guard regions hold: NaN, or :data:`HUGE` (the dtype's
        largest finite value / 4 where that is less).

    Returns
    -------
    numpy.ndarray
        The same shape, dtype and values as ``array``; a strided view
        (stride 1 on the last axis, a padded stride on every other) into a
        buffer it keeps alive. ``torch.from_numpy`` shares its memory,
        guards included.

    Raises
    ------
    TypeError
        If ``array`` is not floating point.
    ValueError
        If ``fill`` is not one of :data:`FILLS`, or the dtype has no NaN.

    See Also
    --------
    guard_intact : whether the guard regions still hold their fill.

    Examples
    --------
    >>> import numpy as np
    >>> k = guarded(np.ones((2, 3), np.float32))
    >>> k.shape, k.strides, bool((k == 1).all())
    ((2, 3), (128, 4), True)
    >>> np.lib.stride_tricks.as_strided(k, (3, 3), k.strides)[2]   # one row past the end
    array([nan, nan, nan], dtype=float32)
    >>> guard_intact(k)
    True
    """
    a = np.asarray(array)
    if not is_guardable(a.dtype):
        raise TypeError(f"`array` should be a floating-point array, but got an array of dtype {a.dtype}")
    value = guard_value(a.dtype, fill)
    item = a.dtype.itemsize
    unit = max(1, _ALIGN_BYTES // item)                 # elements per 64 bytes
    gap = max(8, unit)                                  # the least guard between two rows, in elements
    strides = [1] * a.ndim                              # in elements; each axis's block padded by `gap`
    for i in range(a.ndim - 2, -1, -1):
        strides[i] = _round_up(a.shape[i + 1] * strides[i + 1] + gap, unit)
    extent = a.shape[0] * strides[0] if a.ndim else 1
    row = strides[-2] if a.ndim >= 2 else (a.shape[-1] if a.ndim else 1)
    edge = _round_up(max(gap, row), unit)               # before and after: at least a row stride
    total = edge + extent + edge
    raw = np.empty(total * item + _ALIGN_BYTES, np.uint8)
    start = (-raw.ctypes.data) % _ALIGN_BYTES
    buf = raw[start:start + total * item].view(a.dtype)
    buf[...] = value
    out = np.ndarray(a.shape, a.dtype, buffer=buf, offset=edge * item, strides=tuple(s * item for s in strides))
    out[...] = a
    inside = np.zeros(total, bool)
    np.ndarray(a.shape, bool, buffer=inside, offset=edge, strides=tuple(strides))[...] = True
    with _LOCK:
        _REGISTRY[id(raw)] = (weakref.ref(raw), fill, _geometry(out), inside, slice(start, start + total * item))
    weakref.finalize(raw, _forget, id(raw))
    return out


def guard_intact(array):
    """Whether the guard regions of ``array``, made by :func:`guarded`, still hold their fill, bit for bit.

    Parameters
    ----------
    array : numpy.ndarray
        The very array :func:`guarded` returned (not a copy or a view of it).

    Returns
    -------
    bool
        False when anything wrote outside the array (into its guard regions).

    Raises
    ------
    ValueError
        If ``array`` was not made by :func:`guarded`.
    """
    entry = _entry(array)
    if entry is None:
        raise ValueError(f"`array` should be an array made by guarded(), but got "
                         f"{_describe(array)} that is not one")
    buf, fill, inside = entry
    want = np.array([guard_value(buf.dtype, fill)], buf.dtype).view(np.uint8)
    got = buf.view(np.uint8).reshape(-1, buf.dtype.itemsize)[~inside]
    return bool((got == want).all())


def guard_fill(array):
    """The fill of ``array``'s guard regions (``"nan"`` or ``"huge"``) if :func:`guarded` made it, else None."""
    entry = _entry(array)
    return None if entry is None else entry[1]


def guard_value(dtype, fill):
    """The value ``fill`` (``"nan"`` or ``"huge"``) stands for in ``dtype``, as a scalar of that dtype."""
    dt = np.dtype(dtype)
    if fill not in FILLS:
        raise ValueError(f"`fill` should be one of {FILLS}, but got {fill!r}")
    if fill == "huge":
        return dt.type(min(HUGE, float(_finfo(dt).max) / 4))
    value = dt.type(np.nan)
    if dt.kind not in "fc" and not np.isnan(np.array(value, dt).astype(np.float32)):
        raise ValueError(f"`fill` should be 'huge' for {dt.name}, which has no NaN, but got 'nan'")
    return value


def is_guardable(dtype):
    """Whether :func:`guarded` takes arrays of ``dtype``: NumPy's real and complex floats and the ``ml_dtypes``
    floats."""
    dt = np.dtype(dtype)
    return dt.kind in "fc" or dt.name in _LOW_FLOATS


def _entry(array):
    """``(buffer, fill, inside)`` when ``array`` is an array :func:`guarded` returned, else None."""
    if not isinstance(array, np.ndarray):
        return None
    owner = array.base                                  # NumPy keeps the owner of the memory as the base
    while owner is not None:
        with _LOCK:
            entry = _REGISTRY.get(id(owner))
        if entry is not None and entry[0]() is owner:
            if entry[2] != _geometry(array):
                return None
            return owner[entry[4]].view(array.dtype), entry[1], entry[3]
        owner = getattr(owner, "base", None)
    return None


def _geometry(a):
    return (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str, a.dtype.name)


def _forget(key):
    with _LOCK:
        _REGISTRY.pop(key, None)


def _finfo(dt):
    # ml_dtypes' types by the module that defines them, not by ``dt.kind``: float8_e5m2 reports kind "f",
    # and ``np.finfo`` refuses it under NumPy 1.x
    if dt.type.__module__.split(".")[0] == "ml_dtypes":
        import ml_dtypes

        return ml_dtypes.finfo(dt)
    return np.finfo(dt)


def _round_up(n, unit):
    return -(-n // unit) * unit


def _describe(x):
    if isinstance(x, np.ndarray):
        return f"an array of shape {x.shape} and dtype {x.dtype}"
    return f"{type(x).__name__}"
