"""Reports of the gradient checks: the comparison rule and its table.

The rule (see :mod:`sdpa_ref.gradcheck`): an analytic value ``a`` and a
numeric value ``n`` agree when ``|a - n| <= atol`` or
``|a - n| / max(tiny, |a| + |n|) <= rtol``. Two NaNs agree (the same entry is
NaN on both sides: the NaN patterns are compared, and the finite parts
judged); one NaN, or one infinity, does not, and the report names it. A
comparison with entries but none finite on both sides proves nothing and
fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

__all__ = ["GradcheckReport", "WorstEntry", "compare", "errors"]

_TINY = np.finfo(np.float64).tiny


@dataclass(frozen=True)
class WorstEntry:
    """The entry that disagrees most: which arg, where, and both values."""

    arg: int
    index: Tuple[int, ...]
    output_index: Optional[Tuple[int, ...]]
    analytic: float
    numeric: float
    abs_error: float
    rel_error: float


@dataclass
class GradcheckReport:
    """The outcome of :func:`check_vjp` or :func:`check_jvp`.

    ``str(report)`` is a readable table.
    """

    ok: bool
    kind: str
    mode: str
    max_abs_error: float
    max_rel_error: float
    rtol: float
    atol: float
    worst: Optional[WorstEntry]
    per_arg: List[dict] = field(default_factory=list)
    n_evals: int = 0
    notes: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        lines = [
            f"{self.kind} ({self.mode}): {status}   rtol={self.rtol:.1e} atol={self.atol:.1e}   "
            f"max_abs={self.max_abs_error:.3e} max_rel={self.max_rel_error:.3e}   evals={self.n_evals}"
        ]
        if self.per_arg:
            lines.append(f"  {'arg':>3}  {'shape':<18} {'max_abs':>10} {'max_rel':>10} {'failed':>12}")
            for row in self.per_arg:
                lines.append(
                    f"  {row['arg']:>3}  {str(row['shape']):<18} {row['max_abs']:>10.3e} "
                    f"{row['max_rel']:>10.3e} {row['failed']:>5}/{row['total']:<6}"
                )
        if self.worst is not None:
            w = self.worst
            where = f"arg {w.arg} index {w.index}"
            if w.output_index is not None:
                where += f" output {w.output_index}"
            lines.append(
                f"  worst: {where}: analytic {w.analytic!r} numeric {w.numeric!r} "
                f"(abs {w.abs_error:.3e}, rel {w.rel_error:.3e})"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def errors(a, n, scale=None):
    """Absolute and symmetric relative errors, and ``|a| + |n|``; NaN pairs agree, one NaN disagrees.

    ``scale``, when given, stands for ``|n|`` in the size: a bound on it, such as ``|A|^T |g|`` for
    ``n = A^T g``, so that rounding in a sum that cancels is not taken for an error.
    """
    if np.isfinite(a).all() and np.isfinite(n).all():      # the common case, without the where-chains
        abs_err = np.subtract(a, n)
        np.abs(abs_err, out=abs_err)
        size = np.abs(a)
        size += np.abs(n) if scale is None else scale
        rel = np.maximum(size, _TINY)
        np.divide(abs_err, rel, out=rel)
        return abs_err, rel, size
    with np.errstate(invalid="ignore"):
        both_nan = np.isnan(a) & np.isnan(n)
        abs_err = np.abs(a - n)
        size = np.abs(a) + (np.abs(n) if scale is None else scale)
        rel = abs_err / np.maximum(_TINY, size)
    one_bad = ~np.isfinite(abs_err) & ~both_nan
    inf_equal = np.isinf(a) & (a == n)
    abs_err = np.where(both_nan | inf_equal, 0.0, np.where(one_bad, np.inf, abs_err))
    rel = np.where(both_nan | inf_equal, 0.0, np.where(one_bad, 1.0, rel))
    return abs_err, rel, size


def compare(kind, mode, ana, num, rtol, atol, arg_index_shapes, out_shape, n_evals, notes=None, scales=None,
            require_finite=True):
    """Compare lists of (analytic, numeric, valid-mask) blocks and build a report.

    Each block is ``(o, i)`` shaped: o over output entries, i over the arg's
    entries. ``valid`` excludes columns of non-finite inputs. ``scales``
    (one per block) stand for ``|n|`` in the size (see :func:`errors`).
    Entries that are not finite on one side only are counted and named in a
    note; with ``require_finite``, valid entries none of which is finite on
    both sides fail (two NaNs prove nothing).
    """
    per_arg = []
    max_abs = max_rel = 0.0
    worst = None
    worst_key = (-1.0, -1.0)
    ok = True
    notes = list(notes or [])
    n_valid = n_finite = 0
    for k, (a, n, valid) in enumerate(zip(ana, num, arg_index_shapes["valid"])):
        abs_err, rel, size = errors(a, n, None if scales is None else scales[k])
        valid = np.broadcast_to(valid, a.shape)
        fa, fn = np.isfinite(a), np.isfinite(n)
        n_valid += int(np.count_nonzero(valid))
        n_finite += int(np.count_nonzero(fa & fn & valid))
        for side, where in (("analytic", ~fa & fn & valid), ("numeric", fa & ~fn & valid)):
            if where.any():
                notes.append(_one_sided(k, side, a, n, where, arg_index_shapes["shapes"][k], out_shape))
        all_valid = bool(np.all(valid))
        if not all_valid:
            abs_err = np.where(valid, abs_err, 0.0)
            rel = np.where(valid, rel, 0.0)
        over = abs_err > atol
        # The relative error is reported where it means something: on entries
        # past the absolute floor, and on entries large enough (|a|+|n| >=
        # atol/rtol) that the floor does not decide them.
        with np.errstate(invalid="ignore"):
            shown = size >= (atol / rtol if rtol > 0 else np.inf)
        if not all_valid:
            shown &= valid
        shown |= over
        rel_over = np.where(shown, rel, 0.0)
        failed = int(np.count_nonzero(over & (rel > rtol)))
        ok &= failed == 0
        arg_abs = float(abs_err.max(initial=0.0))
        arg_rel = float(rel_over.max(initial=0.0))
        per_arg.append({
            "arg": k, "shape": arg_index_shapes["shapes"][k], "max_abs": arg_abs, "max_rel": arg_rel,
            "failed": failed, "total": int(np.count_nonzero(valid) if valid.ndim else a.size),
        })
        max_abs, max_rel = max(max_abs, arg_abs), max(max_rel, arg_rel)
        if a.size:
            flat = int(np.argmax(rel_over if arg_rel > 0 else abs_err))
            key = (float(rel_over.flat[flat]), float(abs_err.flat[flat]))
            if key > worst_key:
                worst_key = key
                o, i = np.unravel_index(flat, a.shape)
                worst = WorstEntry(
                    arg=k,
                    index=tuple(int(t) for t in np.unravel_index(i, arg_index_shapes["shapes"][k])),
                    output_index=(tuple(int(t) for t in np.unravel_index(o, out_shape))
                                  if out_shape is not None else None),
                    analytic=float(a.flat[flat]), numeric=float(n.flat[flat]),
                    abs_error=float(abs_err.flat[flat]), rel_error=float(rel.flat[flat]),
                )
    if require_finite and n_valid and not n_finite:
        ok = False
        notes.append(f"no finite entry to compare: each of the {n_valid} entries is NaN or infinite on both sides, "
                     "which proves nothing")
    return GradcheckReport(
        ok=bool(ok), kind=kind, mode=mode, max_abs_error=max_abs, max_rel_error=max_rel,
        rtol=rtol, atol=atol, worst=worst, per_arg=per_arg, n_evals=n_evals, notes=notes,
    )


def _one_sided(k, side, a, n, where, shape, out_shape):
    """A note naming the entries of block ``k`` that are not finite on ``side`` alone, and the first of them."""
    o, i = np.unravel_index(int(np.argmax(where.ravel())), a.shape)
    where_txt = f"arg {k} index {tuple(int(t) for t in np.unravel_index(i, shape))}"
    if out_shape is not None:
        where_txt += f" output {tuple(int(t) for t in np.unravel_index(o, out_shape))}"
    other = "numeric" if side == "analytic" else "analytic"
    value = a[o, i] if side == "analytic" else n[o, i]
    return (f"{int(np.count_nonzero(where))} entries are NaN or infinite in the {side} result where the {other} one "
            f"is finite (first: {where_txt}, {side} {float(value)!r}); the NaN patterns must be the same")
