r"""Assertions a kernel's own tests call on results they have already computed.

A kernel's test computes ``out`` (and often the LSE and the gradients) on its own inputs and compares them with
a reference at a hand-picked tolerance. :func:`assert_attention_close` replaces that comparison: it computes the
reference on the same inputs (``precision="reproducible"``, faithfully rounded float64), derives the fair
allowance for the dtype the kernel computed in (the conformance harness's honest-ensemble rule: a few times the
worst error of seven honest kernels in that dtype, plus the dtype's rounding), and raises an `AssertionError`
naming the quantity, the worst element's index, its value, the reference's, the allowance and how many elements
exceed it. :func:`check_attention_close` returns the report instead.

What the allowance can and cannot see: it is set by the worst honest error, so a defect smaller than the
dtype's own rounding of the result passes. A 1% error in the scale is caught in float32 (its error is a thousand
times the allowance), but not in bfloat16 at head width 16 to 128: there it moves the output by about half the
allowance, the same order as bfloat16's rounding of the output itself.

The arrays may be NumPy arrays (``ml_dtypes``' bfloat16 and float8 included) or anything with ``__dlpack__`` or
``__array__`` (PyTorch, JAX, CuPy, MLX on the host); the framework is never imported. A tensor whose dtype NumPy
lacks (PyTorch's bfloat16) is read through its ``float()`` and rounded back to ``ml_dtypes``' type, exactly.

>>> import numpy as np, sdpa_ref.testing as t
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((2, 8, 16)).astype(np.float32) for _ in range(3))
>>> s = q @ k.swapaxes(-1, -2) / np.float32(4)
>>> p = np.exp(s - s.max(-1, keepdims=True))
>>> t.assert_attention_close((p / p.sum(-1, keepdims=True)) @ v, q, k, v)
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .api import sdpa_forward
from .derivatives import sdpa_backward
from .harness.ensemble import honest_errors
from .harness.judge import _compare
from .harness.lowp import output_dtype, work_dtype
from .harness.report import ConformanceReport
from .harness.rules import as_rule
from .lse import check_base, convert_lse

__all__ = ["assert_attention_close", "check_attention_close"]

_GRAD_NAMES = ("dq", "dk", "dv")


def check_attention_close(out, query, key, value, *, lse=None, grads=None, grad_out=None, lse_base="e",
                          rule="relative", **options) -> ConformanceReport:
    """Judge a kernel's ``out`` (and ``lse``, ``grads``) against the reference on the same inputs; the report.

    Parameters
    ----------
    out : array_like, (..., Hq, L, Ev)
        The kernel's output, in the dtype it returns (the inputs' dtype).
    query, key, value : array_like, (..., Hq, L, E), (..., Hkv, S, E), (..., Hkv, S, Ev)
        The inputs the kernel was given, in the dtype it computed in.
    lse : array_like, (..., Hq, L), optional
        The kernel's log-sum-exp of the scores, in ``lse_base`` (``"e"`` or ``2``), float32 or wider.
    grads : sequence or mapping, optional
        ``(dq, dk, dv)``, a mapping with those keys, or a record with ``.query``, ``.key``, ``.value``: the
        kernel's gradients for the cotangent ``grad_out``.
    grad_out : array_like, (..., Hq, L, Ev)
        The cotangent the gradients were computed for; required with ``grads``.
    rule : {"relative", "fixed", "ulp"} or a rule object
        As in :func:`sdpa_ref.check_implementation`.
    **options
        The attention keywords of :func:`sdpa_ref.sdpa_forward` the kernel computed with (``is_causal``,
        ``scale``, ``attn_mask``, ``enable_gqa``, ``window``, ``softcap``, ``sinks``, ...).

    Returns
    -------
    ConformanceReport
        One row per quantity judged (``out``, ``lse``, ``dq``, ``dk``, ``dv``); ``.ok``, ``str()``.
    """
    out, q, k, v = (_host(x, n) for x, n in ((out, "out"), (query, "query"), (key, "key"), (value, "value")))
    options = {n: _host(x, n) if _is_array(x) else x for n, x in options.items()}
    rule = as_rule(rule)
    dt = np.dtype(q.dtype)
    got = {"out": out}
    if lse is not None:
        check_base(lse_base, "lse_base")
        got["lse"] = _natural_lse(_host(lse, "lse"), lse_base)
    if grads is not None:
        if grad_out is None:
            raise ValueError("`grad_out` should be the cotangent the gradients were computed for when `grads` is "
                             "given, but got None")
        got.update(zip(_GRAD_NAMES, _grads(grads)))
    g = None if grad_out is None else _host(grad_out, "grad_out")
    ref_out, res = sdpa_forward(*(np.asarray(x, np.float64) for x in (q, k, v)), precision="reproducible",
                                **{n: _wide(x) for n, x in options.items()})
    ref = {"out": ref_out, "lse": np.asarray(res.lse, np.float64)}
    if grads is not None:
        gr = sdpa_backward(res, np.asarray(g, np.float64))
        ref.update(dq=gr.query, dk=gr.key, dv=gr.value)
    ref = {n: ref[n] for n in got}
    honest = None
    if rule.name == "relative":
        cot = np.zeros(ref_out.shape, output_dtype(dt)) if g is None else g
        honest = honest_errors(dict(options, query=q, key=k, value=v), cot, dt, ref)
    rows = [_compare("your inputs", dt.name, n, got[n], ref[n], None if honest is None else honest[n], rule,
                     want=work_dtype(dt) if n == "lse" else None) for n in got]
    for row in rows:
        row.exceeding = _exceeding(got[row.quantity], ref[row.quantity], row)
    return ConformanceReport(rows, rule=rule.describe(), suite="your inputs")


def assert_attention_close(out, query, key, value, **kwargs) -> None:
    """:func:`check_attention_close`, raising an `AssertionError` that names each quantity out of its allowance:
    the worst element's index, the kernel's value there, the reference's, the error and the allowance, and how
    many elements exceed it. Returns None when every quantity is within it."""
    __tracebackhide__ = True                       # pytest shows the caller's line, not this one
    report = check_attention_close(out, query, key, value, **kwargs)
    bad = [r for r in report.rows if r.status != "pass"]
    if bad:
        raise AssertionError("attention is not close to the reference on your inputs:\n"
                             + "\n".join(_describe(r) for r in bad) + f"\nrule: {report.rule}")


def _describe(row):
    """One line of the failure message for a row of the report."""
    if row.status == "error" or row.error is None:
        return f"  `{row.quantity}`: {row.note}"
    where = "" if row.worst_index is None else (
        f" at index {row.worst_index} (kernel {row.impl_value!r}, reference {row.ref_value!r})")
    count = "" if row.exceeding is None else f"; {row.exceeding[0]} of {row.exceeding[1]} elements exceed it"
    allowed = "" if row.allowed is None else f", allowed {row.allowed:.3g}"
    note = f"; {row.note}" if row.note else ""
    return f"  `{row.quantity}`: max |kernel - reference| = {row.error:.3g}{allowed}{where}{count}{note}"


def _exceeding(got, ref, row):
    """``(how many elements exceed the allowance, how many there are)``, or None where the row has no allowance."""
    if row.allowed is None or row.error is None or not np.isfinite(row.allowed):
        return None
    with np.errstate(invalid="ignore"):
        d = np.abs(np.asarray(got, np.float64) - ref)
    d = np.where(np.isnan(ref) & np.isnan(d), 0.0, np.where(np.isnan(d), np.inf, d))
    return int(np.count_nonzero(d > row.allowed)), int(d.size)


def _grads(grads):
    """``(dq, dk, dv)`` from a sequence, a mapping or a gradients record, each on the host."""
    if isinstance(grads, dict):
        missing = [n for n in _GRAD_NAMES if n not in grads]
        if missing:
            raise ValueError(f"`grads` should map {', '.join(_GRAD_NAMES)} to arrays, but misses {missing}")
        items = [grads[n] for n in _GRAD_NAMES]
    elif all(hasattr(grads, n) for n in ("query", "key", "value")):
        items = [grads.query, grads.key, grads.value]
    else:
        try:
            items = list(grads)[:3]
        except TypeError:
            raise TypeError(f"`grads` should be (dq, dk, dv), a mapping or a gradients record, but got "
                            f"{type(grads).__name__}") from None
        if len(items) != 3:
            raise ValueError(f"`grads` should hold (dq, dk, dv), but got {len(items)} arrays")
    return [_host(x, f"grads[{n!r}]") for x, n in zip(items, _GRAD_NAMES)]


def _natural_lse(lse, base):
    """The LSE in base e, computed in float64 from the kernel's (in base ``base``), the kernel's dtype kept."""
    if base in ("e", None):
        return lse
    return convert_lse(np.asarray(lse, np.float64), base="e", from_base=base).astype(lse.dtype)


def _is_array(x):
    return hasattr(x, "__dlpack__") or hasattr(x, "__array__") or isinstance(x, np.ndarray)


def _wide(x):
    """An option for the float64 reference: a low-precision float array widened (exactly), others as given."""
    if isinstance(x, np.ndarray) and x.dtype.kind == "V" or (isinstance(x, np.ndarray) and x.dtype.kind == "f"
                                                              and x.dtype.itemsize < 8):
        return x.astype(np.float64)
    return x


def _host(x: Any, name: str) -> np.ndarray:
    """``x`` as a NumPy array of numbers on the host (:func:`_read`); anything else is a `TypeError`."""
    a = _read(x, name)
    if a.dtype.kind not in "biufV":
        raise TypeError(f"`{name}` should be an array on the host of real numbers, but got {type(x).__name__} "
                        f"(dtype {a.dtype})")
    return a


def _read(x: Any, name: str) -> np.ndarray:
    """``x`` as a NumPy array on the host, in its own dtype, without importing its framework.

    NumPy arrays as they are; else ``__dlpack__`` (:func:`numpy.from_dlpack`), then ``__array__``. A tensor whose
    dtype NumPy lacks (bfloat16, float8) is read through its ``float()`` and rounded back to ``ml_dtypes``' type
    of the same name (exact: every such value is a float32); a device tensor is refused with how to move it."""
    if isinstance(x, np.ndarray):
        return x
    err: Optional[Exception] = None
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError, ValueError) as exc:
            err = exc
    low = str(getattr(x, "dtype", "")).rpartition(".")[2]
    if low in ("bfloat16", "float8_e4m3fn", "float8_e5m2") and hasattr(x, "float"):
        import ml_dtypes
        wide = x.float()
        wide = wide.detach() if hasattr(wide, "detach") else wide
        wide = wide.cpu() if hasattr(wide, "cpu") else wide
        return _read(wide, name).astype(getattr(ml_dtypes, low))
    if hasattr(x, "__array__"):
        try:
            return np.asarray(x)
        except (TypeError, RuntimeError, ValueError) as exc:
            err = exc
    elif err is None:
        try:
            return np.asarray(x)
        except Exception as exc:                          # a Python list of numbers is an array too
            err = exc
    raise TypeError(f"`{name}` should be an array on the host (NumPy, or anything with __dlpack__ or __array__; "
                    f"move a device tensor first, e.g. tensor.cpu()), but got {type(x).__name__}: {err}")
