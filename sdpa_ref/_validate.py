"""Turning user input into arrays and checking it, with one error style.

Every message has the form ``"`name` should be X, but got Y"`` so that the
user sees which argument is wrong, what was expected and what arrived.
Validation happens once, at the public entry point; the numerical code
behind it trusts its inputs.
"""

from __future__ import annotations

import functools
import numbers
import sys

import numpy as np

__all__ = [
    "INPUT_DTYPES",
    "UPCAST_FALSE_DTYPES",
    "as_array",
    "as_float_array",
    "result_dtype",
    "as_mask",
    "as_real_scalar",
    "check_dtype",
    "broadcast_batch",
    "check_axis",
    "along_axis",
    "pair_along_axis",
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


#: The floating dtypes that every engine and precision takes, for ``query``, ``key``, ``value``, a float
#: ``attn_mask``, ``bias``, ``alibi_slopes``, ``grad_out`` and the JVP's tangents; anything else is refused with
#: one `TypeError` naming the argument. bfloat16 is ml_dtypes' (the ``lowp`` extra).
INPUT_DTYPES = ("float64", "float32", "float16", "bfloat16")
#: The dtypes ``upcast=False`` computes in: the inputs' own, so bfloat16 (which NumPy has no arithmetic of) is
#: refused there (with upcast=True, the default, it is computed in float64 and the results are rounded to it).
UPCAST_FALSE_DTYPES = ("float64", "float32", "float16")
_COMPLEX_DTYPES = ("complex128", "complex64")       # sdpa_forward_complex only (the complex step)


def _listing(names):
    return ", ".join(names[:-1]) + " or " + names[-1]


def _is_ml_dtype(dt) -> bool:
    return getattr(dt.type, "__module__", "").split(".")[0] == "ml_dtypes"


def result_dtype(*dtypes):
    """``np.result_type`` of input dtypes, and bfloat16 with float16 gives float32 whatever the ``ml_dtypes``
    version (0.7 promotes them so; older versions have no rule, and NumPy raises)."""
    try:
        return np.result_type(*dtypes)
    except TypeError:
        names = {np.dtype(d).name for d in dtypes}
        if "bfloat16" in names and names <= {"bfloat16", "float16", "float32", "float64"}:
            return np.dtype(np.float64 if "float64" in names else np.float32)
        raise


def _known_name(dt):
    """The name of ``dt`` when it is one of :data:`INPUT_DTYPES` or complex64 / complex128, else None (float8 is
    kind ``"f"`` in ml_dtypes, and ``longdouble`` is ``float128`` or ``float96``: both refused)."""
    if _is_ml_dtype(dt):
        return "bfloat16" if dt.name == "bfloat16" else None
    if (dt.kind == "f" and dt.itemsize in (2, 4, 8)) or (dt.kind == "c" and dt.itemsize in (8, 16)):
        return dt.name
    return None


@functools.lru_cache(maxsize=None)
def _accepted(dt, allow_bool, allow_complex):
    """Whether :func:`check_dtype` takes ``dt``, once per dtype and flags (a dtype's name costs a few
    microseconds a call)."""
    want = (("bool",) if allow_bool else ()) + INPUT_DTYPES + (_COMPLEX_DTYPES if allow_complex else ())
    return (allow_bool and dt == np.bool_) or _known_name(dt) in want


def check_dtype(dt, name: str, *, allow_bool: bool = False, allow_complex: bool = False) -> None:
    """Raise the package's one `TypeError` unless ``dt`` is in :data:`INPUT_DTYPES` (or bool, or complex, when
    allowed); the message names the argument and, for the usual mistakes, says what to do."""
    dt = np.dtype(dt)
    if _accepted(dt, allow_bool, allow_complex):
        return
    want = (("bool",) if allow_bool else ()) + INPUT_DTYPES + (_COMPLEX_DTYPES if allow_complex else ())
    msg = f"`{name}` should have dtype {_listing(want)}, but got {dt.name}"
    if dt.name.startswith(("float8", "float6", "float4")):
        msg += ("; fp8 values mean something only with their scales: dequantize them first, "
                "`x.astype(np.float32) * descale` as kernels do (sdpa_ref.harness.lowp.dequantized does this "
                "before the harness calls the reference)")
    elif dt.kind in "biu" and not _is_ml_dtype(dt):
        msg += "; cast it to a floating dtype first (for example `.astype(np.float64)`)"
    elif dt.kind == "f" and not _is_ml_dtype(dt):
        msg += "; cast it to float64 (no engine computes in extended precision)"
    elif dt.kind == "c":
        msg += ("; complex input is for sdpa_forward_complex (the complex step)" if not allow_complex
                else "; cast it to complex128")
    raise TypeError(msg)


def as_array(x, name: str, expected: str) -> np.ndarray:
    """``np.asarray(x)``, refusing ``numpy.ma`` arrays and turning NumPy's errors (ragged lists) into a
    `TypeError` in the house style; ``expected`` says what ``x`` should be."""
    _no_masked(x, name)
    try:
        return np.asarray(x)
    except Exception as exc:  # ragged lists and the like
        raise TypeError(f"`{name}` should be {expected}, but got {describe(x)} ({exc})") from None


def as_float_array(x, name: str, *, min_ndim: int = 0, allow_complex: bool = False) -> np.ndarray:
    """Return ``x`` as a floating NumPy array without copying it.

    Raises `TypeError` unless its dtype is in :data:`INPUT_DTYPES` (complex64 and complex128 too with
    ``allow_complex``): integer, bool, complex, fp8, extended-precision and object input are refused, and
    `ValueError` for fewer than ``min_ndim`` dimensions.
    """
    arr = as_array(x, name, "an array of floats")
    check_dtype(arr.dtype, name, allow_complex=allow_complex)
    if arr.ndim < min_ndim:
        raise ValueError(
            f"`{name}` should have at least {min_ndim} dimensions, but got shape {arr.shape}"
        )
    return arr


def as_mask(x, name: str, target_shape: tuple, *, allow_float: bool = True, allow_complex: bool = False) -> np.ndarray:
    """Return a bool or float mask that broadcasts to ``target_shape``."""
    arr = as_array(x, name, "a bool or float array" if allow_float else "a bool array")
    if not allow_float:
        if arr.dtype != np.bool_:
            raise TypeError(f"`{name}` should have dtype bool, but got {arr.dtype.name}")
    else:
        check_dtype(arr.dtype, name, allow_bool=True, allow_complex=allow_complex)
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
    """``numpy.ma`` arrays are refused: their mask would be dropped silently by ``np.asarray``.

    Looked up in ``sys.modules``, never imported: NumPy imports ``numpy.ma`` lazily, and a first import during
    a call would hold the import lock that a child forked meanwhile could never take (and without it no
    masked array can exist)."""
    ma = sys.modules.get("numpy.ma")
    if ma is not None and isinstance(x, ma.MaskedArray):
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


def along_axis(x, axis, name="x"):
    """``(array, axis)``: ``x`` as a real or complex array of at least one dimension (ints and bools as
    float64) and ``axis`` normalised for it: the arguments of a softmax-like function along an axis."""
    arr = np.asarray(x)
    if arr.dtype.kind in "iub":
        arr = arr.astype(np.float64)
    elif arr.dtype.kind not in "fc":
        raise TypeError(f"`{name}` should be a numeric array, but got dtype {arr.dtype}")
    if arr.ndim == 0:
        raise ValueError(f"`{name}` should have at least 1 dimension, but got a scalar")
    return arr, check_axis(axis, arr.ndim)


def pair_along_axis(y, g, axis, yname, gname):
    """``(y, g, axis)``: :func:`along_axis` of both, ``g`` of ``y``'s shape (a function's output and its
    cotangent or tangent)."""
    y, axis = along_axis(y, axis, name=yname)
    g, _ = along_axis(g, axis, name=gname)
    if g.shape != y.shape:
        raise ValueError(f"`{gname}` should have the shape of `{yname}` {y.shape}, but got shape {g.shape}")
    return y, g, axis


def per_head(x, name: str, Hq: int, batch: tuple) -> np.ndarray:
    """A float array of one value per query head, ``(Hq,)`` or ``(..., Hq)`` broadcasting to ``(*batch, Hq)``
    (``alibi_slopes``, ``sinks``), or a ValueError naming ``name``."""
    s = as_float_array(x, name, min_ndim=1)
    try:
        ok = s.shape[-1] == Hq and np.broadcast_shapes(s.shape[:-1], batch) == batch
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"`{name}` should have shape (Hq,) = ({Hq},) or (..., Hq) broadcasting to "
                         f"{batch + (Hq,)}, but got shape {s.shape}")
    return s


def sink_fold_shape(shape, Hq: int, batch: tuple):
    """The shape ``(..., Hq)`` or ``(..., 1)`` of the ``sinks`` input of shape ``shape`` read as one logit per
    query head (a reshape of ``shape``, so its gradient folds back into it), or None when it is not one.

    Accepted: ``(..., Hq)`` broadcasting to ``(*batch, Hq)`` (as :func:`per_head`, kept as it is); a scalar and
    ``(1,)`` (one logit for every head); cuDNN's and FlashMLA's ``(..., H, 1, 1)`` (the score's ``L`` and ``S``
    axes of size 1), e.g. ``(1, Hq, 1, 1)`` and ``(Hq, 1, 1)``, with leading size-1 axes past ``batch`` dropped.
    """
    shape = tuple(shape)

    def fits(s):
        try:
            return len(s) >= 1 and s[-1] in (Hq, 1) and np.broadcast_shapes(s[:-1], batch) == batch
        except ValueError:
            return False

    if len(shape) >= 1 and shape[-1] == Hq and fits(shape):
        return shape
    fold = shape[:-2] if len(shape) >= 3 and shape[-2:] == (1, 1) else shape
    fold = fold or (1,)
    while len(fold) > len(batch) + 1 and fold[0] == 1:
        fold = fold[1:]
    return fold if fits(fold) else None


def sink_logits(x, Hq: int, batch: tuple):
    r"""``sinks``: one logit per query head, as ``(logits, fold)``: ``logits`` of shape ``(..., Hq)``
    broadcasting to ``(*batch, Hq)`` and ``fold`` the shape its gradient is summed to before it takes the
    caller's own shape (:func:`sink_fold_shape`: a scalar, ``(Hq,)``, ``(1, Hq, 1, 1)``, ``(Hq, 1, 1)`` or
    ``(..., Hq)``). Each logit is finite, ``-inf`` (no sink on that head) or ``+inf`` (the sink takes all the
    mass: :func:`sdpa_ref.sinks.fold_sink_in`); NaN is refused."""
    s = as_float_array(x, "sinks")
    fold = sink_fold_shape(s.shape, Hq, batch)
    if fold is None:
        raise ValueError(f"`sinks` should have shape (Hq,) = ({Hq},), a scalar, (1, Hq, 1, 1), (Hq, 1, 1) or "
                         f"(..., Hq) broadcasting to {batch + (Hq,)}, but got shape {s.shape}")
    bad = np.isnan(s)
    if np.any(bad):
        raise ValueError(f"`sinks` should be finite, -inf (no sink) or +inf (all the mass), but got "
                         f"{s[bad].ravel()[0]!r} at index {tuple(int(i) for i in np.argwhere(bad)[0])}")
    s = s.reshape(fold)
    return (s if fold[-1] == Hq else np.broadcast_to(s, fold[:-1] + (Hq,))), fold


def lengths(x, name: str, limit: int, batch: tuple):
    """Per-batch lengths (``q_lengths``, ``kv_lengths``) as int64, broadcastable to ``batch``, in ``[0, limit]``;
    None stays None. A ``numpy.ma`` array or a ragged list is refused here, in the house style."""
    if x is None:
        return None
    return int_array(x, name, "per-batch lengths", batch, where=f"the batch shape {tuple(batch)}", noun="lengths",
                     bounds=(0, limit), range_text=f"[0, {limit}]")


def int_array(x, name: str, what: str, target: tuple, *, where: str, noun: str, bounds: tuple, range_text: str,
              hint: str = "") -> np.ndarray:
    """An integer array of ``what`` (lengths, offsets, counts) that broadcasts to ``target`` (``where`` names
    it in the message, ``hint`` follows a wrong shape) with values in ``bounds`` (``range_text``), as int64; else
    a `TypeError` (not an integer array: a float, a ``numpy.ma`` array, a ragged list) or `ValueError` naming
    ``name``."""
    arr = as_array(x, name, f"an integer array of {what}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"`{name}` should be an integer array of {what}, but got dtype {arr.dtype}")
    try:
        ok = np.broadcast_shapes(arr.shape, tuple(target)) == tuple(target)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"`{name}` should have a shape that broadcasts to {where}, but got shape {arr.shape}{hint}")
    lo, hi = bounds
    if arr.size and (arr.min() < lo or arr.max() > hi):
        raise ValueError(f"`{name}` should hold {noun} in {range_text}, but got values from {arr.min()} to "
                         f"{arr.max()}")
    return arr.astype(np.int64)


def indices(x, name: str, lead: tuple) -> np.ndarray:
    """Integer indices ``(..., K)`` whose leading dims broadcast to ``lead`` (``gather_kv_indices``: ``lead`` is
    ``(*batch, Hq, L)``), as int64; any value is accepted (one outside the valid range names nothing)."""
    arr = as_array(x, name, "an integer array of indices")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"`{name}` should be an integer array of indices, but got dtype {arr.dtype}")
    try:
        ok = arr.ndim >= 1 and np.broadcast_shapes(arr.shape[:-1], lead) == tuple(lead)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"`{name}` should have a shape (..., K) whose leading dims broadcast to {tuple(lead)}, "
                         f"but got shape {arr.shape}")
    if len(lead) > 2 and 3 <= arr.ndim <= len(lead):
        raise ValueError(f"`{name}` should have all {len(lead) + 1} dims of {tuple(lead) + ('K',)} beside the batch "
                         f"dims {tuple(lead[:-2])}, but got shape {arr.shape}, which is ambiguous: FlashAttention 4's "
                         "(b, t, K) and (Hq, L, K) broadcast differently; write (b, 1, t, K) for indices shared by "
                         "the heads, or (b, Hq, t, K)")
    with np.errstate(over="ignore"):
        return arr.astype(np.int64)


def broadcast_batch(shapes: dict) -> tuple:
    """Broadcast the batch shapes of several named arrays, or raise a clear error."""
    try:
        return np.broadcast_shapes(*shapes.values())
    except ValueError:
        listing = ", ".join(f"`{n}` {s}" for n, s in shapes.items())
        raise ValueError(
            f"the leading batch dimensions should broadcast together, but got {listing}"
        ) from None


def as_generator(rng):
    """``rng`` (a Generator, a non-negative int seed, or None: fresh entropy) as a numpy.random.Generator."""
    if rng is None:
        return np.random.default_rng()
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, (bool, np.bool_)):
        if rng < 0:
            raise ValueError(f"`rng` should be a non-negative int seed (or a numpy.random.Generator), but got {rng}")
        return np.random.default_rng(int(rng))
    raise TypeError(f"`rng` should be a numpy.random.Generator, an int seed or None, but got {describe(rng)}")
