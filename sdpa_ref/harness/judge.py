"""Judging one case: the reference's quantities, calling the implementation, and comparing by the rule.

:func:`judge_case` runs the implementation on one case at one dtype and
returns its report rows; :mod:`.conformance` loops it over a suite. The
optional checks a kernel author may ask for live here too: the same bits on
a second run (``deterministic``), the JVP (``jvp``), and NaN written where
no row reads (``poison``); and, unless turned off, the same calls on guarded
copies of the inputs (``guards``, :mod:`.guards`: what reads outside its
inputs). ``layout="blhd"`` hands the implementation
``(B, L, H, E)`` arrays and reads its results back the same way.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from ..api import sdpa_forward
from ..derivatives import sdpa_backward, sdpa_jvp
from ..lse import convert_lse
from ..options import AttentionOptions
from ..policy import averages_values
from ..problem import Problem
from ..rounding import round_to
from ..transforms import unbroadcast
from .calling import GuardBroken, Implementation
from .storage import STORAGE_LAYOUTS
from ._limits import CaseTimeout, ImplementationFailure
from .cases import Case, grad_out_for, tangents_for
from .ensemble import MEMBERS, ensemble_errors, member_quantities
from .guards import guard_value
from .lowp import DESCALES, dequantized, is_fp8, is_low, output_dtype, ulp, widen, work_dtype
from .report import ConformanceRow
from .rules import FixedRule, RelativeRule, lean

__all__ = ["REFERENCE_PRECISION", "Implementation", "dead_positions", "grad_out_for", "judge_case",
           "reference_quantities", "tangents_for"]

#: The precision of every reference the harness judges by: faithfully rounded (within one ulp of the exact value),
#: the same bits everywhere, for every quantity and option, score functions included (exact over the function's
#: float64 values); ``tests/test_harness_judge.py`` holds every reference call to it.
REFERENCE_PRECISION = "reproducible"


def reference_quantities(case: Case, dtype="float64", *, naive=False, lse=False):
    """See :func:`_reference_quantities`; each call gets its own copies of the (cached) arrays. With ``lse=True``
    the dict holds ``lse`` too (base e, ``-inf`` on rows with no allowed key)."""
    return {n: a.copy() for n, a in _reference_quantities(case, np.dtype(dtype).name, naive).items()
            if lse or n != "lse"}


@functools.lru_cache(maxsize=1024)
def _reference_quantities(case: Case, dtype="float64", naive=False):
    """The reference's out and grads for ``case``, on its inputs drawn in ``dtype``.

    By default in float64 arithmetic with float64 results (``ref64``); with
    ``naive=True`` computed in ``dtype`` itself (``upcast=False``), the plain
    same-precision implementation of the relative rule. Both with
    ``precision="reproducible"``: the same bits, so the same verdict, on
    every machine. Returns a dict of
    float64 arrays: ``out, dq, dk, dv``, ``dbias`` with a bias, ``dsinks`` with sinks, and ``lse``.
    """
    dt = np.dtype(dtype)
    inp = case.make_inputs(dt)
    q, k, v = inp.pop("query"), inp.pop("key"), inp.pop("value")
    if naive:
        out, res = sdpa_forward(q, k, v, upcast=False, precision=REFERENCE_PRECISION, **inp)
        g = grad_out_for(case, out.shape, dt)
    else:
        inp = dequantized(dict(inp, query=q, key=k, value=v))
        q, k, v = inp.pop("query"), inp.pop("key"), inp.pop("value")
        out, res = sdpa_forward(q, k, v, precision=REFERENCE_PRECISION, **inp)
        g = grad_out_for(case, out.shape, output_dtype(dt)).astype(np.float64)
    gr = sdpa_backward(res, g)
    quant = {"out": out, "dq": gr.query, "dk": gr.key, "dv": gr.value}
    if gr.bias is not None:
        quant["dbias"] = gr.bias
    if gr.sinks is not None:
        quant["dsinks"] = gr.sinks
    quant["lse"] = res.lse                                     # base e, -inf on rows with no key
    return {n: np.asarray(a, dtype=np.float64) for n, a in quant.items()}


@functools.lru_cache(maxsize=256)
def reference_jvp(case: Case, dtype="float64", naive=False):
    """The reference's JVP on the seeded tangents (:func:`tangents_for`, rounded to ``dtype``), float64 or, with
    ``naive=True``, computed in ``dtype`` (bfloat16: in float32 on its values, rounded to it); a read-only
    float64 array. Not at fp8 (no JVP check there)."""
    dt = np.dtype(dtype)
    inp = case.make_inputs(dt)
    q, k, v = inp.pop("query"), inp.pop("key"), inp.pop("value")
    ts = tuple(round_to(t, dt) for t in tangents_for(case, q, k, v))
    if naive:
        c = np.dtype(np.float32) if is_low(dt) else dt
        inp = widen(inp, c) if is_low(dt) else inp
        tan = round_to(sdpa_jvp(tuple(a.astype(c) for a in (q, k, v)), tuple(t.astype(c) for t in ts),
                                precision=REFERENCE_PRECISION, upcast=False, **inp)[1], dt)
    else:
        inp = widen(inp)
        tan = sdpa_jvp(tuple(a.astype(np.float64) for a in (q, k, v)), tuple(t.astype(np.float64) for t in ts),
                       precision=REFERENCE_PRECISION, **inp)[1]
    tan = np.asarray(tan, dtype=np.float64)
    tan.setflags(write=False)
    return tan


def judge_case(case, dt, impl, rule, sup, timeout=None):
    """The report rows of ``impl`` (an :class:`Implementation`) on ``case`` at dtype ``dt``."""
    ref64 = reference_quantities(case, dt)     # float64 arithmetic on the test-dtype inputs, kept in float64
    honest = _baseline(case, dt) if isinstance(rule, RelativeRule) else None
    leans = _baseline(case, dt, leans=True) if honest is not None and rule.judge_lean else {}
    want_jvp = impl.jvp is not None and not is_fp8(dt)      # fp8 kernels have no JVP (nor FlashAttention 3)
    if want_jvp:
        ref64["jvp"] = reference_jvp(case, dt)
        if honest is not None:                    # the tangent's baseline: the plain same-dtype JVP
            fin = ~np.isnan(ref64["jvp"])
            naive = reference_jvp(case, dt, naive=True)
            honest["jvp"] = float(np.max(np.abs(np.where(fin, naive - ref64["jvp"], 0)), initial=0.0))
            leans["jvp"] = abs(lean(naive, ref64["jvp"], output_dtype(dt))[0])
    inp = case.make_inputs(dt)
    q, k, v = inp.pop("query"), inp.pop("key"), inp.pop("value")
    if case.has_fully_masked_rows(dt):
        # the policy matters only where a row has no key: say it explicitly there
        inp["fully_masked"] = case.opts.get("fully_masked", "zero")
    else:
        inp.pop("fully_masked", None)
    if "fully_masked" in inp and "fully_masked" not in sup:
        inp.pop("fully_masked")
    rows = []
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        first = impl.limit(deadline, impl.call_forward, q, k, v, inp)
    except NotImplementedError as exc:
        return [ConformanceRow(case.name, dt, "all", "skip", note=f"not implemented: {exc}")]
    except KeyboardInterrupt:                              # the user's own Ctrl-C stops the run
        raise
    except BaseException as exc:  # a crash, SystemExit included, is a failure of the case, and the run goes on
        return [ConformanceRow(case.name, dt, "out", "error", note=_what(exc, timeout))]
    if impl.lse is not None:
        if not isinstance(first, tuple) or len(first) != 2:
            return [ConformanceRow(case.name, dt, "out", "error",
                                   note=f"with lse={impl.lse!r} the forward should return (out, lse), but returned "
                                        f"{type(first).__name__}" + (f" of {len(first)}" if isinstance(first, tuple)
                                                                     else ""))]
        ref64["lse"] = convert_lse(reference_quantities(case, dt, lse=True)["lse"], base=impl.lse,
                                   empty=impl.lse_empty, precision=REFERENCE_PRECISION)
        if honest is not None:
            honest["lse"] = _honest_lse(case, dt, ref64["lse"], impl.lse)
    got = {"out": first[0], "lse": first[1]} if impl.lse is not None else {"out": first}
    g = grad_out_for(case, ref64["out"].shape, output_dtype(dt))
    grads = None
    extra = [("grads", impl.backward is not None, lambda: impl.call_backward(g, q, k, v, inp)),
             ("jvp", want_jvp,
              lambda: impl.call_jvp(tuple(round_to(t, q.dtype) for t in tangents_for(case, q, k, v)), q, k, v, inp))]
    for what, wanted, call in extra:
        if not wanted:
            continue
        try:
            res = impl.limit(deadline, call)
            if what == "jvp":
                got["jvp"] = res
                continue
            names = ["dq", "dk", "dv"] + [n for n in ("dbias", "dsinks") if n in ref64]
            res = grads = list(res)
            got.update(zip(names, res))
            if len(res) < len(names):
                rows.append(ConformanceRow(case.name, dt, names[len(res)], "error",
                                           note=f"backward returned {len(res)} gradients, expected {len(names)}"))
        except NotImplementedError as exc:
            rows.append(ConformanceRow(case.name, dt, what, "skip", note=f"not implemented: {exc}"))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            rows.append(ConformanceRow(case.name, dt, what, "error", note=_what(exc, timeout)))
    if impl.jvp is not None and not want_jvp:
        rows.append(ConformanceRow(case.name, dt, "jvp", "skip", note="no JVP check at fp8"))
    for qty, val in got.items():
        rows.append(_compare(case.name, dt, qty, val, ref64[qty], None if honest is None else honest[qty], rule,
                             leans.get(qty), want=work_dtype(dt) if qty in ("lse", "dsinks") else None))
    if impl.deterministic:
        rows.append(_determinism(case.name, dt, "determinism", lambda: impl.call_forward(q, k, v, inp), first,
                                 impl, deadline, timeout))
        if grads is not None:                              # the backward too: atomics in dK, dV change bits
            rows.append(_determinism(case.name, dt, "determinism-backward",
                                     lambda: impl.call_backward(g, q, k, v, inp), grads, impl, deadline, timeout))
    if impl.poison:
        row = _poisoned(case, dt, impl, q, k, v, inp, ref64, honest, rule, deadline, timeout)
        if row is not None:
            rows.append(row)
    if impl.guards:
        rows.extend(_guarded(case, dt, impl, q, k, v, inp, got, g, grads, honest, rule, deadline, timeout))
    return rows


def _determinism(case, dt, qty, call, first, impl, deadline, timeout):
    """A second call (the forward, or the backward) on the same inputs must give the same bits, every result
    of it (``out`` and ``lse``; each gradient)."""
    try:
        again = impl.limit(deadline, call)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return ConformanceRow(case, dt, qty, "error", note=_what(exc, timeout))
    firsts = list(first) if isinstance(first, (tuple, list)) else [first]
    agains = list(again) if isinstance(again, (tuple, list)) else [again]
    same = len(firsts) == len(agains) and all(_same_bits(a, b) for a, b in zip(firsts, agains))
    what = "forward" if qty == "determinism" else "backward"
    return ConformanceRow(case, dt, qty, "pass" if same else "FAIL",
                          note="" if same else f"a second {what} on the same inputs gave other bits")


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _honest_lse(case, dt, ref, base):
    """The largest ``|member - ref|`` of the ensemble's LSEs (work dtype; in ``base`` by one more rounding there)
    over the rows where ``ref`` is finite."""
    w, worst = work_dtype(dt), 0.0
    fin = np.isfinite(ref)
    for m in MEMBERS:
        got = member_quantities(case, np.dtype(dt).name, m)["lse"].astype(np.float64)
        got = convert_lse(got, base=base).astype(w).astype(np.float64)
        with np.errstate(invalid="ignore"):
            d = np.abs(np.where(fin, got - ref, 0.0))
        worst = max(worst, float(np.where(np.isnan(d), np.inf, d).max(initial=0.0)))
    return worst


def dead_positions(q, k, inp):
    """``(dead keys, padded rows)``: bool masks broadcastable to ``k`` and ``q`` of the keys that no row of any head
    reads and of the query rows past ``q_lengths`` (an entry shared by broadcast batch entries counts only when it
    is dead for all of them), each None where there is none. Under ``"uniform"`` and ``"jax"`` a row with no
    allowed key reads the values of keys outside its allowed set: every key of its batch entry is then live."""
    opts = AttentionOptions.from_kwargs("check_implementation", **{n: x for n, x in inp.items()
                                                                    if n != "fully_masked" and n not in DESCALES})
    prob = Problem.build(q, k, np.zeros(k.shape[:-1] + (1,)), opts)
    allowed = prob.allowed()
    keys = None
    if allowed is not None:
        read = np.broadcast_to(allowed, prob.full_scores).any(axis=(-3, -2))       # (*batch, S)
        if averages_values(inp.get("fully_masked")):
            _, res = sdpa_forward(q, k, np.zeros(k.shape[:-1] + (1,)), save_probs=False, **dict(
                {n: x for n, x in inp.items() if n not in DESCALES}))
            empty = res.empty if res.padded is None else (res.empty & ~res.padded)
            read = read | np.broadcast_to(empty, prob.full_scores[:-1] + (1,)).any(axis=(-3, -2))
        keys = _dead_in(read, k.shape, prob.S)
    pad = prob.padded_rows()
    rows = None if pad is None else _dead_in(~np.broadcast_to(pad, prob.batch + (1, prob.L, 1))[..., 0, :, 0],
                                             q.shape, prob.L)
    return keys, rows


def _dead_in(live, shape, n):
    """The positions of an input of ``shape`` (``(..., [H,] n, E)``) that no batch entry sharing them reads, as a
    mask broadcastable to it, or None; ``live`` is ``(*batch, n)``, summed down to the input's batch dims."""
    lead = shape[:-3]
    live = unbroadcast(live.astype(np.int64), lead + (n,)) > 0
    if live.all():
        return None
    return ~live.reshape(lead + ((1,) if len(shape) >= 3 else ()) + (n, 1))


def _poisoned(case, dt, impl, q, k, v, inp, ref64, honest, rule, deadline, timeout):
    """NaN written into the keys and values no row reads and the padded query rows must not reach the output."""
    keys, rows = dead_positions(q, k, inp)
    if keys is None and rows is None and impl.layout not in STORAGE_LAYOUTS:
        return None                                # (a storage layout has positions no sequence uses)
    nan = q.dtype.type(np.nan)
    k2, v2 = (x if keys is None else np.where(keys, nan, x) for x in (k, v))
    q2 = q if rows is None else np.where(rows, nan, q)
    try:
        out = impl.limit(deadline, impl.call_forward, q2, k2, v2, inp, np.nan)
        out = out[0] if impl.lse is not None and isinstance(out, tuple) else out
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return ConformanceRow(case.name, dt, "poison", "error", note=_what(exc, timeout))
    row = _compare(case.name, dt, "out", out, ref64["out"], None if honest is None else honest["out"], rule)
    row.quantity = "poison"
    if row.status != "pass":
        row.note = ("NaN written where no row reads (keys and values no row attends to, padded query rows"
                    + (", storage no sequence uses" if impl.layout in STORAGE_LAYOUTS else "")
                    + ") reached the output; " + row.note).rstrip("; ")
    return row


#: The guarded runs (:mod:`.guards`): the forward with each fill, then the backward with NaN guards.
GUARD_RUNS = (("nan", "forward"), ("huge", "forward"), ("nan", "backward"))


def _guarded(case, dt, impl, q, k, v, inp, got, g, grads, honest, rule, deadline, timeout):
    """The calls again on guarded copies of the inputs (:data:`GUARD_RUNS`), each result compared with the
    implementation's own unguarded one by the rule: a ``"guard"`` row for each run that sees something (a
    result that moved: it reads outside its inputs; guards overwritten: it writes outside them), none for a
    run that sees nothing. A run the implementation refuses (it takes no strided inputs) is a skip."""
    rows = []
    grad_names = ["dq", "dk", "dv", "dbias", "dsinks"]
    for fill, what in GUARD_RUNS:
        if what == "backward" and grads is None:
            continue
        run = f"the {_FILL_NAMES[fill]} run's {what}"
        try:
            if what == "forward":
                res = impl.limit(deadline, impl.call_forward, q, k, v, inp, 0.0, fill)
            else:
                res = impl.limit(deadline, impl.call_backward, g, q, k, v, inp, fill)
        except KeyboardInterrupt:
            raise
        except GuardBroken as exc:
            rows.append(ConformanceRow(case.name, dt, "guard", "FAIL", note=f"{exc} ({run})"))
            continue
        except (CaseTimeout, ImplementationFailure, SystemExit) as exc:
            rows.append(ConformanceRow(case.name, dt, "guard", "error", note=f"{run}: {_what(exc, timeout)}"))
            continue
        except BaseException as exc:
            rows.append(ConformanceRow(case.name, dt, "guard", "skip",
                                       note=f"{run}: raised on strided inputs ({_what(exc, timeout)})"))
            continue
        if what == "forward":
            mine = {"out": got["out"]} | ({"lse": got["lse"]} if "lse" in got else {})
            theirs = dict(zip(mine, res if impl.lse is not None and isinstance(res, tuple) else (res,)))
        else:
            mine = dict(zip(grad_names, grads))
            theirs = dict(zip(grad_names, res))
        for qty, own in mine.items():
            own = np.asarray(own)
            if qty not in theirs or (own.dtype.kind != "f" and not is_low(own.dtype)):
                continue
            base = None if honest is None else honest.get(qty, 0.0)
            row = _compare(case.name, dt, qty, theirs[qty], own.astype(np.float64), base, rule, want=own.dtype)
            if row.status == "pass":
                continue
            row.quantity = "guard"
            row.note = (f"reads outside its inputs: {qty} changed when each input sat in a larger buffer with "
                        f"{_fill_text(fill, own.dtype)} before, after and between its rows ({run}; 'reference' "
                        f"here is its own {qty} on plain inputs); " + row.note).rstrip("; ")
            rows.append(row)
            break
    return rows


_FILL_NAMES = {"nan": "NaN guards'", "huge": "huge guards'"}


def _fill_text(fill, dtype):
    return f"{float(guard_value(dtype, fill)):g}" if fill == "huge" else "NaN"


def _baseline(case, dt, leans=False):
    """The honest ensemble's largest error per quantity against the reference (:func:`.ensemble.ensemble_errors`),
    or with ``leans=True`` its largest lean (:func:`_honest_leans`): a fresh dict of what
    :func:`_cached_baseline` keeps per case and dtype (both depend on nothing else, and each judge of another
    implementation on the same case reads them again)."""
    return dict(_cached_baseline(case, np.dtype(dt).name, leans))


@functools.lru_cache(maxsize=2048)
def _cached_baseline(case, dtype, leans):
    ref64 = {n: a for n, a in _reference_quantities(case, dtype, False).items() if n != "lse"}
    return _honest_leans(case, dtype, ref64) if leans else ensemble_errors(case, dtype, ref64)


def _honest_leans(case, dt, ref64):
    """Per quantity, the largest ``|beta|`` (:func:`.rules.lean`) of the honest ensemble's members."""
    got = [member_quantities(case, np.dtype(dt).name, m) for m in MEMBERS]
    want = output_dtype(dt)
    return {q: max((abs(lean(g[q], ref, want)[0]) for g in got if q in g), default=0.0) for q, ref in ref64.items()
            if q != "dsinks"}                    # one number per head: no lean to judge


def _what(exc, timeout=None):
    if isinstance(exc, CaseTimeout):
        return f"ran past the time limit of {timeout:g} s" + (f"; {exc.args[0]}" if exc.args else "")
    if isinstance(exc, ImplementationFailure):
        return str(exc)
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) raised by the implementation"
    return f"{type(exc).__name__}: {exc}"


def _compare(case, dt, qty, val, ref64, honest, rule, honest_lean=None, want=None):
    """One row: ``val`` against ``ref64`` by ``rule``; ``honest`` is the honest ensemble's error (relative
    rule), else None; ``honest_lean`` its members' largest ``|beta|`` (None: the lean is not judged); ``want``
    the dtype the result must have (default: :func:`~.lowp.output_dtype`; the LSE's is the work dtype). An
    infinite reference entry (the LSE of a row with no key) must be met exactly."""
    try:
        got = np.asarray(val)
    except Exception as exc:
        return ConformanceRow(case, dt, qty, "error", note=f"could not read the result: {exc}")
    if got.shape != ref64.shape:
        return ConformanceRow(case, dt, qty, "error", note=f"shape {got.shape}, expected {ref64.shape}")
    if got.dtype.kind not in "fiu" and not is_low(got.dtype):   # a complex result would lose its imaginary part
        return ConformanceRow(case, dt, qty, "FAIL", error=float("inf"), allowed=None, ratio=float("inf"),
                              note=f"returned dtype {got.dtype}: attention of real inputs is real")
    want = output_dtype(dt) if want is None else want     # the inputs' dtype; bfloat16 for fp8 inputs
    if got.dtype != want:                                 # a float32 result for float16 inputs is not that kernel
        return ConformanceRow(case, dt, qty, "FAIL", error=float("inf"), allowed=None, ratio=float("inf"),
                              note=f"returned dtype {got.dtype}, expected {want.name}")
    note = ""
    got = got.astype(np.float64)
    nan_ref, nan_got = np.isnan(ref64), np.isnan(got)
    if not np.array_equal(nan_ref, nan_got):
        idx = tuple(int(i) for i in np.argwhere(nan_ref != nan_got)[0])
        return ConformanceRow(case, dt, qty, "FAIL", error=float("inf"), allowed=None, ratio=float("inf"),
                              worst_index=idx, impl_value=float(got[idx]), ref_value=float(ref64[idx]),
                              note=("NaN where the reference has a number" if nan_got[idx]
                                    else "a number where the reference has NaN") + (f"; {note}" if note else ""))
    inf_ref = np.isinf(ref64)
    if np.any(inf_ref & (got != ref64)):
        idx = tuple(int(i) for i in np.argwhere(inf_ref & (got != ref64))[0])
        return ConformanceRow(case, dt, qty, "FAIL", error=float("inf"), allowed=None, ratio=float("inf"),
                              worst_index=idx, impl_value=float(got[idx]), ref_value=float(ref64[idx]),
                              note=f"{float(got[idx])} where the reference has {float(ref64[idx])} (a row with no key)")
    fin = ~nan_ref & ~inf_ref
    with np.errstate(invalid="ignore"):
        diff = np.where(fin, np.abs(got - ref64), 0.0)
    if isinstance(rule, RelativeRule):
        allowed = rule.bound(qty, np.where(fin, ref64, 0.0), honest, want)
        err = float(diff.max(initial=0.0))
        ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else float("inf"))
        flat = int(np.argmax(diff)) if diff.size else 0
    else:
        if isinstance(rule, FixedRule):
            tol = rule.atol + rule.rtol * np.abs(ref64)
        else:
            tol = rule.max_ulps * ulp(ref64, want)
        tol = np.where(fin, tol, 1.0)
        r = diff / tol
        flat = int(np.argmax(r)) if r.size else 0
        ratio = float(r.flat[flat]) if r.size else 0.0
        err = float(diff.flat[flat]) if diff.size else 0.0
        allowed = float(tol.flat[flat]) if diff.size else 0.0
    idx = tuple(int(i) for i in np.unravel_index(flat, diff.shape)) if diff.size else ()
    status = "pass" if ratio <= 1.0 else "FAIL"
    beta = beta_allowed = None
    if isinstance(rule, RelativeRule) and honest_lean is not None and diff.size:
        beta, se = lean(got, ref64, want)
        beta_allowed = rule.lean_bound(qty, honest_lean, se)
        if abs(beta) > beta_allowed:
            note = (f"leans by {beta:+.3g} ulp on average (allowed {beta_allowed:.3g}): a systematic bias"
                    + (", though the largest error is within the rule" if status == "pass" else ""))
            status = "FAIL"
    return ConformanceRow(case, dt, qty, status, error=err, allowed=allowed, ratio=ratio, worst_index=idx,
                          impl_value=float(got.flat[flat]) if diff.size else None,
                          ref_value=float(ref64.flat[flat]) if diff.size else None, note=note, honest_error=honest,
                          lean=beta, lean_allowed=None if beta_allowed is None or not np.isfinite(beta_allowed)
                          else beta_allowed)
