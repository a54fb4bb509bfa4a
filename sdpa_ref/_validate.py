"""Turning user input into arrays and checking it, with one error style.

Every message has the form ``"`name` should be X, but got Y"`` so that the
user sees which argument is wrong, what was expected and what arrived.
Validation happens once, at the public entry point; the numerical code
behind it trusts its inputs.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = [
    "as_float_array",
    "as_mask",
    "as_real_scalar",
    "broadcast_batch",
    "check_axis",
    "check_choice",
    "check_tolerance",
    "describe",
]

def describe(x) -> str:
    """A short description of ``x`` for error messages."""
    if isinstance(x, np.ndarray):
        return f"an array of shape {x.shape} and dtype {x.dtype}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"{x!r} of type {type(x).__name__}"


def as_float_array(x, name: str, *, min_ndim: int = 0, allow_complex: bool = False) -> np.ndarray:
    """Return ``x`` as a floating NumPy array without copying it.

    Raises `TypeError` for integer, bool, complex (unless allowed) and object
    input, and `ValueError` for fewer than ``min_ndim`` dimensions.
    """
    _no_masked(x, name)
    try:
        arr = np.asarray(x)
    except Exception as exc:  # ragged lists and the like
        raise TypeError(f"`{name}` should be an array of floats, but got {describe(x)} ({exc})") from None
    kind = arr.dtype.kind
    if kind == "c" and allow_complex:
        pass
    elif kind != "f":
        raise TypeError(
            f"`{name}` should have a floating dtype (float16, float32 or float64), "
            f"but got dtype {arr.dtype}"
        )
    if arr.ndim < min_ndim:
        raise ValueError(
            f"`{name}` should have at least {min_ndim} dimensions, but got shape {arr.shape}"
        )
    return arr


def as_mask(x, name: str, target_shape: tuple, *, allow_float: bool = True, allow_complex: bool = False) -> np.ndarray:
    """Return a bool or float mask that broadcasts to ``target_shape``."""
    _no_masked(x, name)
    try:
        arr = np.asarray(x)
    except Exception:
        raise TypeError(f"`{name}` should be a bool or float array, but got {describe(x)}") from None
    kind = arr.dtype.kind
    ok = kind == "b" or (allow_float and kind == "f") or (allow_complex and kind == "c")
    if not ok:
        expected = "bool or floating" if allow_float else "bool"
        raise TypeError(f"`{name}` should have a {expected} dtype, but got dtype {arr.dtype}")
    try:
        shape = np.broadcast_shapes(arr.shape, target_shape)
    except ValueError:
        shape = None
    if shape != tuple(target_shape):
        raise ValueError(
            f"`{name}` should have a shape that broadcasts to {tuple(target_shape)}, "
            f"but got shape {arr.shape}"
        )
    return arr


def _no_masked(x, name):
    """``numpy.ma`` arrays are refused: their mask would be dropped silently by ``np.asarray``."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"`{name}` should be a plain array, but got a numpy.ma.MaskedArray (its mask would be "
                        "ignored); pass `.filled(...)`, or the mask as `attn_mask`")


def check_tolerance(x, name: str) -> float:
    """A finite tolerance >= 0 (NaN would make every comparison pass)."""
    t = as_real_scalar(x, name)
    if not np.isfinite(t) or t < 0:
        raise ValueError(f"`{name}` should be a finite number >= 0, but got {t!r}")
    return t


def as_real_scalar(x, name: str) -> float:
    """Return ``x`` as a Python float; reject bools, arrays with size != 1 and non-numbers."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Real, np.floating, np.integer)):
        if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "fi":
            return float(x)
        raise TypeError(f"`{name}` should be a real number, but got {describe(x)}")
    return float(x)


def check_choice(value, name: str, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` should be one of {options}, but got {value!r}")
    return value


def check_axis(axis, ndim: int, name: str = "axis") -> int:
    """Normalise ``axis`` for an array of ``ndim`` dimensions."""
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"`{name}` should be an int, but got {describe(axis)}")
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"`{name}` should be in [{-ndim}, {ndim}) for an array of {ndim} dimensions, but got {axis}"
        )
    return int(axis) % ndim


def broadcast_batch(shapes: dict) -> tuple:
    """Broadcast the batch shapes of several named arrays, or raise a clear error."""
    try:
        return np.broadcast_shapes(*shapes.values())
    except ValueError:
        listing = ", ".join(f"`{n}` {s}" for n, s in shapes.items())
        raise ValueError(
            f"the leading batch dimensions should broadcast together, but got {listing}"
        ) from None
