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

Out-of-bounds reads: hand the kernel guarded copies of its inputs (:func:`guarded`: the same values inside a larger
buffer whose guard regions before, after and between rows hold NaN, or a huge finite value with
``fill="huge"``; for PyTorch, ``torch.from_numpy(guarded(x))`` shares them) and pass the same NumPy arrays here.
A result that fails on guarded inputs is then said to read outside them, and a guard region written to fails a
``guard`` row, "writes outside its inputs". (The harness, :func:`sdpa_ref.check_implementation`, runs every
kernel on guarded and plain inputs by itself and compares the two.)

>>> import numpy as np, sdpa_ref.testing as t
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((2, 8, 16)).astype(np.float32) for _ in range(3))
>>> s = q @ k.swapaxes(-1, -2) / np.float32(4)
>>> p = np.exp(s - s.max(-1, keepdims=True))
>>> t.assert_attention_close((p / p.sum(-1, keepdims=True)) @ v, q, k, v)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from .api import sdpa_forward
from .derivatives import sdpa_backward
from .harness.ensemble import honest_results, worst_errors
from .harness.guards import GuardBroken, guard_fill, guard_intact, guarded
from .harness.judge import REFERENCE_PRECISION, _compare
from .harness.merge_check import judge_merged
from .harness.lowp import output_dtype, work_dtype
from .harness.report import ConformanceReport, ConformanceRow
from .harness.rules import RelativeRule, as_rule, lean, rms_error
from .lse import check_base, convert_lse
from .merge import merge_attention

__all__ = ["GuardBroken", "assert_attention_close", "assert_merge_close", "check_attention_close",
           "check_merge_close", "guard_intact", "guarded"]

_GRAD_NAMES = ("dq", "dk", "dv")


def check_attention_close(out, query, key, value, *, lse=None, grads=None, grad_out=None, lse_base="e",
                          layout=None, rule="relative", **options) -> ConformanceReport:
    """Judge a kernel's ``out`` (and ``lse``, ``grads``) against the reference on the same inputs; the report.

    Parameters
    ----------
    out : array_like, (..., Hq, L, Ev)
        The kernel's output, in the dtype it returns (the inputs' dtype); in ``layout``'s shape with one.
    query, key, value : array_like, (..., Hq, L, E), (..., Hkv, S, E), (..., Hkv, S, Ev)
        The inputs the kernel was given, in the dtype it computed in (``layout``'s shapes with one).
    lse : array_like, (..., Hq, L), optional
        The kernel's log-sum-exp of the scores, in ``lse_base`` (``"e"`` or ``2``), float32 or wider
        (``layout``'s LSE layout with one).
    grads : sequence or mapping, optional
        ``(dq, dk, dv)`` or ``(dq, dk, dv, dsinks)``, a mapping with those keys (``dsinks`` optional), or a
        gradients record (``.query``, ``.key``, ``.value``, and ``.sinks`` if not None): the kernel's
        gradients for the cotangent ``grad_out``; ``dsinks`` in the shape of ``sinks``, float32 or wider.
    grad_out : array_like, (..., Hq, L, Ev)
        The cotangent the gradients were computed for; required with ``grads``.
    lse_base : {"e", 2}
        The base of ``lse`` (2: FlashInfer, FlashAttention 4's ``exp2``).
    layout : {"bhsd", "bshd"}, sdpa_ref.layouts.Packed or KVCache, optional
        How the kernel's arrays are laid out, as in :func:`sdpa_ref.sdpa_forward`: ``"bshd"`` for
        ``(..., L, H, E)`` (FlashAttention's, JAX's), a packed or paged layout object for varlen and
        KV-cache kernels. Every quantity is judged in that layout (indices in messages are the kernel's own).
    rule : {"relative", "fixed", "ulp"} or a rule object
        As in :func:`sdpa_ref.check_implementation`. ``"relative"`` (the default) is the harness's
        honest-ensemble rule with the spread judged too (``RelativeRule(judge_rms=True)``, see below); pass a
        :class:`~sdpa_ref.harness.rules.RelativeRule` to choose.
    **options
        The attention keywords of :func:`sdpa_ref.sdpa_forward` the kernel computed with (``is_causal``,
        ``scale``, ``attn_mask``, ``enable_gqa``, ``window``, ``softcap``, ``sinks``, ...).

    Returns
    -------
    ConformanceReport
        One row per quantity judged (``out``, ``lse``, ``dq``, ``dk``, ``dv``, ``dsinks``); ``.ok``, ``str()``.

    Notes
    -----
    Under the relative rule each quantity passes three tests, all set by the seven honest kernels of
    :mod:`sdpa_ref.harness.ensemble` run on the caller's inputs in the caller's dtype: the largest error
    (at most 3 times theirs, plus the dtype's rounding), the lean (the systematic error in ulps, as in the
    harness) and the spread: the root mean square of the error, at most 2 times theirs, on quantities of
    256 or more finite entries (:meth:`~sdpa_ref.harness.rules.RelativeRule.rms_bound`). The spread is what
    catches, in bfloat16, an error of either sign spread over every element, such as a 1% error in the
    scale, which moves the worst element no further than bfloat16's own rounding does.
    """
    out, q, k, v = (_host(x, n) for x, n in ((out, "out"), (query, "query"), (key, "key"), (value, "value")))
    options = {n: _host(x, n) if _is_array(x) else x for n, x in options.items()}
    rule = RelativeRule(judge_rms=True) if rule is None or (isinstance(rule, str) and rule == "relative") \
        else as_rule(rule)
    dt = np.dtype(q.dtype)
    got = {"out": out}
    base = check_base(lse_base, "lse_base")
    if lse is not None:
        got["lse"] = _host(lse, "lse")
    if grads is not None:
        if grad_out is None:
            raise ValueError("`grad_out` should be the cotangent the gradients were computed for when `grads` is "
                             "given, but got None")
        got.update(_grads(grads, options.get("sinks") is not None))
    g = None if grad_out is None else _host(grad_out, "grad_out")
    wide = {n: _wide(x) for n, x in options.items()}
    ref_out, res = sdpa_forward(*(np.asarray(x, np.float64) for x in (q, k, v)), precision=REFERENCE_PRECISION,
                                layout=layout, **wide)
    ref = {"out": ref_out}
    if lse is not None:                                  # the exact LSE in the kernel's base, rounded once
        ref["lse"] = convert_lse(res.lse, base=base, precision=REFERENCE_PRECISION)
    if grads is not None:
        gr = sdpa_backward(res, np.asarray(g, np.float64))
        ref.update(dq=gr.query, dk=gr.key, dv=gr.value, dsinks=gr.sinks)
    ref = {n: np.asarray(ref[n], np.float64) for n in got}
    members = None
    if isinstance(rule, RelativeRule):
        members = _honest(q, k, v, g, dt, options, layout, res, ref, base)
    rows = []
    for n in got:
        want = work_dtype(dt) if n in ("lse", "dsinks") else None
        honest = lean_of = None
        if members is not None:
            honest = worst_errors(members, {n: ref[n]})[n]
            if rule.judge_lean and n != "dsinks":             # one number per head: no lean to judge
                lean_of = max(abs(lean(m[n], ref[n], want or output_dtype(dt))[0]) for m in members)
        row = _compare("your inputs", dt.name, n, got[n], ref[n], honest, rule, lean_of, want=want)
        if members is not None and row.status == "pass":
            _judge_spread(row, got[n], ref[n], max(rms_error(m[n], ref[n]) for m in members), rule,
                          want or output_dtype(dt))
        row.exceeding = _exceeding(got[n], ref[n], row)
        rows.append(row)
    rows.extend(_guards(dict(options, query=q, key=k, value=v), rows, dt))
    return ConformanceReport(rows, rule=rule.describe(), suite="your inputs")


def _guards(inputs, rows, dt):
    """What guarded inputs (:func:`guarded`) tell: a ``guard`` row where a guard region was written, and on each
    failing row the note that its inputs were guarded, so that a result off by that much read outside them."""
    fills = {n: guard_fill(a) for n, a in inputs.items() if isinstance(a, np.ndarray)}
    fills = {n: f for n, f in fills.items() if f is not None}
    if not fills:
        return []
    for row in rows:
        if row.status != "pass":
            row.note = "; ".join(x for x in (row.note, "reads outside its inputs, likely: they were guarded ("
                                             + ", ".join(f"`{n}` by {f}" for n, f in fills.items())
                                             + ") and a kernel that reads only its inputs never sees the guards")
                                 if x)
    broken = [n for n in fills if not guard_intact(inputs[n])]
    if broken:
        return [ConformanceRow("your inputs", dt.name, "guard", "FAIL", note=str(GuardBroken(broken)))]
    return []


def check_merge_close(out, lse, out_parts, lse_parts, *, lse_base="e", axis=0,
                      rule="relative") -> ConformanceReport:
    """Judge a split-KV merge kernel's ``(out, lse)`` against :func:`sdpa_ref.merge_attention` of the same parts.

    Parameters
    ----------
    out : array_like, (..., H, L, Ev)
        The merge's output, in the parts' dtype.
    lse : array_like, (..., H, L)
        The merged LSE, in ``lse_base``, float32 or wider.
    out_parts : array_like, (P, ..., H, L, Ev)
        The parts the kernel merged, in the dtype it merged in (rows of a part with no key may hold anything,
        NaN included: they must not be read); the parts along ``axis``.
    lse_parts : array_like, (P, ..., H, L)
        Their LSEs in ``lse_base``, ``-inf`` for a part with no key on the row.
    lse_base : {"e", 2}
        The base of ``lse`` and ``lse_parts`` (2: FlashInfer's ``merge_state``).
    axis : int
        The parts' axis of ``out_parts`` and ``lse_parts`` (:func:`sdpa_ref.merge_attention`'s).
    rule : {"relative", "fixed", "ulp"} or a rule object
        ``"relative"``: at most 3 times the error of the worse of two honest merges in the parts' work dtype
        (:mod:`sdpa_ref.harness.merge_check`), plus the dtype's rounding; the reference is the exact merge,
        faithfully rounded, so float64 merges are judged too.

    Returns
    -------
    ConformanceReport
        Rows ``out`` and ``lse``.
    """
    out, out_p = _host(out, "out"), _host(out_parts, "out_parts")
    lse, lse_p = _host(lse, "lse"), _host(lse_parts, "lse_parts")
    base = check_base(lse_base, "lse_base")
    rule = as_rule(rule)
    dt = np.dtype(out_p.dtype)
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -lse_p.ndim <= axis < lse_p.ndim:
        raise ValueError(f"`axis` should be an int in [-{lse_p.ndim}, {lse_p.ndim}) (the parts' axis of "
                         f"`lse_parts` {lse_p.shape}), but got {axis!r}")
    axis = axis % lse_p.ndim
    rows = judge_merged(out, lse, out_p, lse_p, dt, base, rule, axis=axis)
    ref = merge_attention(out_p.astype(np.float64), lse_p.astype(np.float64), lse_base=base, axis=axis,
                          precision=REFERENCE_PRECISION)
    for row, got, r in zip(rows, (out, lse), ref):
        row.exceeding = _exceeding(got, r, row)
    return ConformanceReport(rows, rule=rule.describe(), suite="your merge")


def assert_merge_close(out, lse, out_parts, lse_parts, **kwargs) -> None:
    """:func:`check_merge_close`, raising an `AssertionError` that names ``out`` or ``lse`` where it is out of
    its allowance, with the worst element, the error, the allowance and how many elements exceed it."""
    __tracebackhide__ = True
    _raise(check_merge_close(out, lse, out_parts, lse_parts, **kwargs), "the merge is not close to the reference "
           "on your parts")


def _honest(q, k, v, g, dt, options, layout, res, ref, base):
    """The honest ensemble's results on the caller's inputs, in the caller's layout and shapes (float64), the
    LSE in ``base`` (converted, as a kernel would, in the work dtype)."""
    lay = res.layout
    dense = dict(options, query=q, key=k, value=v)
    if lay is not None:                                  # the members run the dense problem the layout gathers
        dense.update(query=lay.q, key=lay.k, value=lay.v)
        if lay.lengths is not None:
            dense.update(lay.lengths)
    cot = np.zeros(res.problem.out_shape, output_dtype(dt)) if g is None else (g if lay is None
                                                                                else lay.gather_out(g))
    results = []
    for m in honest_results(dense, cot, dt):
        m = {n: np.asarray(x, np.float64) for n, x in m.items()}
        if lay is not None:
            back = {"out": lay.out, "lse": lay.lse}
            back.update({d: (lambda x, name=name: lay.scatter_input(x, name))
                         for d, name in (("dq", "query"), ("dk", "key"), ("dv", "value"))})
            m = {n: back[n](x) if n in back else x for n, x in m.items()}
        if "lse" in m and base != "e":
            m["lse"] = convert_lse(m["lse"], base=base).astype(work_dtype(dt)).astype(np.float64)
        results.append({n: m[n] for n in ref if n in m})
    return results


def _judge_spread(row, got, ref, honest_rms, rule, dtype):
    """Fail ``row`` (a pass by the largest error) where the error's root mean square is past the rule's
    :meth:`~sdpa_ref.harness.rules.RelativeRule.rms_bound`."""
    bound = rule.rms_bound(ref, honest_rms, dtype)
    err = rms_error(got, ref)
    if err > bound:
        row.status = "FAIL"
        row.note = "; ".join(x for x in (
            f"spread: rms error {err:.3g}, allowed {bound:.3g} ({rule.k_rms:g} x the honest kernels' "
            f"{honest_rms:.3g}): an error spread over every element, though the largest is within the rule",
            row.note) if x)


def assert_attention_close(out, query, key, value, **kwargs) -> None:
    """:func:`check_attention_close`, raising an `AssertionError` that names each quantity out of its allowance:
    the worst element's index, the kernel's value there, the reference's, the error and the allowance, and how
    many elements exceed it. Returns None when every quantity is within it."""
    __tracebackhide__ = True                       # pytest shows the caller's line, not this one
    _raise(check_attention_close(out, query, key, value, **kwargs), "attention is not close to the reference on "
           "your inputs")


def _raise(report, what):
    __tracebackhide__ = True
    bad = [r for r in report.rows if r.status != "pass"]
    if bad:
        raise AssertionError(f"{what}:\n" + "\n".join(_describe(r) for r in bad) + f"\nrule: {report.rule}")


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


def _grads(grads, sinks):
    """``{"dq", "dk", "dv"[, "dsinks"]}`` from a sequence, a mapping or a gradients record, each on the host
    (``dsinks`` where given; ``sinks``: whether the problem has sinks, without which it is an error)."""
    names = _GRAD_NAMES + ("dsinks",)
    if isinstance(grads, Mapping):
        unknown = sorted(set(grads) - set(names), key=str)
        missing = [n for n in _GRAD_NAMES if n not in grads]
        if missing or unknown:
            raise ValueError(f"`grads` should map {', '.join(_GRAD_NAMES)} (and dsinks) to arrays, but "
                             + (f"misses {missing}" if missing else f"has {unknown}"))
        items = {n: grads[n] for n in names if grads.get(n) is not None}
    elif all(hasattr(grads, n) for n in ("query", "key", "value")):
        items = dict(zip(names, (grads.query, grads.key, grads.value, getattr(grads, "sinks", None))))
        items = {n: x for n, x in items.items() if x is not None}
    else:
        try:
            seq = list(grads)
        except TypeError:
            raise TypeError(f"`grads` should be (dq, dk, dv), (dq, dk, dv, dsinks), a mapping or a gradients "
                            f"record, but got {type(grads).__name__}") from None
        if len(seq) not in (3, 4):
            raise ValueError(f"`grads` should hold (dq, dk, dv) or (dq, dk, dv, dsinks), but got {len(seq)} arrays")
        items = {n: x for n, x in zip(names, seq) if x is not None}
    if "dsinks" in items and not sinks:
        raise ValueError("`grads` should have no dsinks when no `sinks` are given, but got one")
    return {n: _host(x, f"grads[{n!r}]") for n, x in items.items()}


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
