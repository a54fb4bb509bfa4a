"""The installation self-check behind ``sdpa-ref check``.

It proves every backward in the package (the softmax family and attention)
over the grid of :func:`sdpa_ref.harness.grid.gradcheck_grid` and reports
one row per case. Shapes are tiny, so the full grid runs in well under a
minute.

Each attention case is checked four ways:

* ``fd``: the VJP (``sdpa_backward``) and the JVP (``sdpa_jvp``) against
  float64 central differences, whole Jacobian, to ``CHECK_RTOL`` (1e-7);
* ``cs``: the VJP and the JVP against the complex step
  (:func:`sdpa_forward_complex`), whole Jacobian, to ``COMPLEX_RTOL`` (1e-12);
* ``lse``: the tiled engine's recomputing backward (FlashAttention's,
  ``method="tiled"``) and the plain engine's (``method="plain"``) against the
  default one, to ``LSE_RTOL`` (1e-13) in the normwise relative error
  ``max|a - b| / max(1, max|a|)`` of each gradient;
* ``ip``: the inner-product identity ``<g, J t> == <J^T g, t>`` between the
  JVP and the VJP, to 1e-12;
* ``hvp``: second order, the Hessian-vector product of ``<g, O>``
  (:func:`sdpa_ref.sdpa_hvp`) along two random directions against central
  differences of the VJP, to ``HVP_RTOL`` (1e-6), and the tiled schedule's
  against the plain engine's, to ``LSE_RTOL`` (normwise).

The differentiable arguments are ``query``, ``key``, ``value``, then a float
``attn_mask`` and a ``bias`` when the case has them.

Under ``"nan"`` the gradients are NaN by design (the textbook formula in
IEEE arithmetic). Such a case asserts the documented NaN pattern and that
every finite entry equals the gradient of the ``"zero"`` policy on the same
inputs, which is itself proven in full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional

import numpy as np

from .._validate import check_tolerance
from ..api import sdpa_forward, sdpa_forward_complex
from ..derivatives import sdpa_backward, sdpa_jvp
from ..second_order import sdpa_hvp
from ..gradcheck import check_jvp, check_vjp
from ..policy import makes_nan
from ..softmax import log_softmax, log_softmax_vjp, softmax, softmax_jvp, softmax_vjp
from .cases import Case
from .grid import gradcheck_grid

__all__ = [
    "CHECK_RTOL", "CHECK_ATOL", "COMPLEX_RTOL", "COMPLEX_ATOL", "HVP_RTOL", "LSE_RTOL",
    "CheckResult", "differentiable_inputs", "run_attention_case", "run_checks", "softmax_checks",
]

#: Central differences: symmetric relative error every case must meet.
CHECK_RTOL = 1e-7
#: Central differences: absolute floor.
CHECK_ATOL = 1e-9
#: Complex step (VJP and JVP) and the inner-product identity.
COMPLEX_RTOL = 1e-12
#: Complex step: absolute floor (entries below ~1e-2 are judged by it).
COMPLEX_ATOL = 1e-14
#: The recomputing and teaching backwards against the default one.
LSE_RTOL = 1e-13
#: The Hessian-vector product against central differences of the VJP.
HVP_RTOL = 1e-6


@dataclass
class CheckResult:
    name: str
    ok: bool
    max_rel_error: float
    max_abs_error: float
    seconds: float
    detail: str = ""
    cs_rel_error: Optional[float] = None
    lse_rel_error: Optional[float] = None
    ip_rel_error: Optional[float] = None
    hvp_rel_error: Optional[float] = None
    report: Optional[object] = field(default=None, repr=False)

    def as_dict(self):
        return {"name": self.name, "ok": self.ok, "fd_rel_error": self.max_rel_error,
                "fd_abs_error": self.max_abs_error, "cs_rel_error": self.cs_rel_error,
                "lse_rel_error": self.lse_rel_error, "ip_rel_error": self.ip_rel_error,
                "hvp_rel_error": self.hvp_rel_error, "seconds": self.seconds, "detail": self.detail}


# ------------------------------------------------------------------ inputs


def differentiable_inputs(case: Case):
    """``(q, k, v, float_mask, bias, opts)``: the case's inputs, its float mask and bias apart."""
    opts = case.make_inputs("float64")
    q, k, v = opts.pop("query"), opts.pop("key"), opts.pop("value")
    mask = opts.get("attn_mask")
    float_mask = None
    if mask is not None and mask.dtype != bool:
        float_mask = opts.pop("attn_mask")
    return q, k, v, float_mask, opts.pop("bias", None), opts


# ---------------------------------------------------------------- one case


def attention_functions(q0, k0, v0, opts, float_mask, bias):
    """``fun``, ``fun_complex``, ``vjp``, ``jvp`` over the differentiable args.

    The args are ``(q, k, v)``, then the float mask and the bias when the case
    has them. The JVP has no float-mask tangent, so it closes over the mask.
    """
    has_m, has_b = float_mask is not None, bias is not None
    rest = {k: v for k, v in opts.items() if k != "attn_mask"}

    nd = max(a.ndim for a in (q0, k0, v0))               # the rank of the scores' leading dims + 2

    def split(args):
        q, k, v, *extra = args
        m = extra.pop(0) if has_m else opts.get("attn_mask")
        b = extra.pop(0) if has_b else None
        if q.ndim > q0.ndim:                              # a vectorized check's new leading axis:
            m = _lead(m, nd) if has_m else m                # right-align a broadcast mask / bias under it
            b = _lead(b, nd) if has_b else b
        return q, k, v, m, b

    def fun(*args):
        q, k, v, m, b = split(args)
        return sdpa_forward(q, k, v, attn_mask=m, bias=b, **rest)[0]

    def fun_complex(*args):
        q, k, v, m, b = split(args)
        return sdpa_forward_complex(q, k, v, attn_mask=m, bias=b, **rest)

    def vjp(g, *args, method="probs"):
        q, k, v, m, b = split(args)
        gr = sdpa_backward(sdpa_forward(q, k, v, attn_mask=m, bias=b, **rest)[1], g, method=method)
        extra = ((gr.attn_mask,) if has_m else ()) + ((gr.bias,) if has_b else ())
        return (gr.query, gr.key, gr.value) + tuple(x.reshape(a.shape) for x, a in zip(extra, args[3:]))

    m_fixed = float_mask if has_m else opts.get("attn_mask")

    def jsplit(args):
        q, k, v, *b = args
        b = b[0] if b else None
        if q.ndim > q0.ndim and has_b:                    # a vectorized check's new leading axis
            b = _lead(b, nd)
        return q, k, v, b

    def jfun(*args):
        q, k, v, b = jsplit(args)
        return sdpa_forward(q, k, v, attn_mask=m_fixed, bias=b, **rest)[0]

    def jfun_complex(*args):
        q, k, v, b = jsplit(args)
        return sdpa_forward_complex(q, k, v, attn_mask=m_fixed, bias=b, **rest)

    def jvp(ts, *args):
        q, k, v, b = jsplit(args)
        ts = tuple(ts)
        if len(ts) == 4 and b is not None:
            ts = ts[:3] + (ts[3].reshape(b.shape),)
        return sdpa_jvp((q, k, v), ts, attn_mask=m_fixed, bias=b, **rest)[1]

    return fun, fun_complex, vjp, jfun, jfun_complex, jvp


def _lead(x, nd):
    """``x`` with a new leading batch axis ``(n, *shape)`` as ``(n, 1, ..., *shape)`` of rank ``nd + 1``."""
    if not isinstance(x, np.ndarray) or x.ndim > nd:
        return x
    return x.reshape(x.shape[:1] + (1,) * (nd + 1 - x.ndim) + x.shape[1:])


def run_attention_case(case: Case, *, rtol=CHECK_RTOL, atol=CHECK_ATOL, complex_rtol=COMPLEX_RTOL,
                       complex_atol=COMPLEX_ATOL, lse_rtol=LSE_RTOL, seed=None) -> CheckResult:
    """Run the four checks of one case (see the module docstring); ``seed`` replaces the case's own."""
    t0 = time.perf_counter()
    if seed is not None:
        case = replace(case, seed=seed)
    seed = case.seed
    q, k, v, fmask, bias, opts = differentiable_inputs(case)
    if makes_nan(case.opts.get("fully_masked")):
        return _nan_policy_check(case, t0, rtol=rtol, atol=atol, complex_rtol=complex_rtol,
                                 complex_atol=complex_atol, lse_rtol=lse_rtol)
    args = (q, k, v) + ((fmask,) if fmask is not None else ()) + ((bias,) if bias is not None else ())
    jargs = (q, k, v) + ((bias,) if bias is not None else ())
    fun, fun_c, vjp_raw, jfun, jfun_c, jvp = attention_functions(q, k, v, opts, fmask, bias)
    memo = {}

    def vjp(g, *a, method="probs"):
        # the fd and cs checks ask for the same one-hot VJPs at the same point
        key = (g.tobytes(), method)
        if key not in memo:
            memo[key] = vjp_raw(g, *a, method=method)
        return memo[key]

    jmemo = {}

    def jvp_m(ts, *a):
        key = b"".join(t.tobytes() for t in ts)
        if key not in jmemo:
            jmemo[key] = jvp(ts, *a)
        return jmemo[key]

    fd = check_vjp(fun, vjp, args, rtol=rtol, atol=atol, vectorized=True)
    fd_j = check_jvp(jfun, jvp_m, jargs, rtol=rtol, atol=atol, vectorized=True)
    cs = check_vjp(fun_c, vjp, args, method="complex", rtol=complex_rtol, atol=complex_atol, vectorized=True)
    cs_j = check_jvp(jfun_c, jvp_m, jargs, method="complex", rtol=complex_rtol, atol=complex_atol, vectorized=True)
    # FlashAttention's backward against the teaching one
    g = np.random.default_rng(seed + 1).standard_normal(fun(*args).shape)
    base = vjp(g, *args)
    lse_err = max(_rel_diff(a, b, lse_rtol) for other in ("tiled", "plain")
                  for a, b in zip(base, vjp(g, *args, method=other)))
    # <g, J t> == <J^T g, t>
    rng = np.random.default_rng(seed + 2)
    ts = [rng.standard_normal(a.shape) for a in jargs]
    lhs = float(np.sum(g * jvp(ts, *jargs)))
    grads = vjp(g, *args)
    gj = list(grads[:3]) + ([grads[-1]] if bias is not None else [])
    rhs = float(sum(np.sum(a * t) for a, t in zip(gj, ts)))
    ip_err = abs(lhs - rhs) / max(abs(lhs) + abs(rhs), 1e-300)
    hv, hv_err = _second_order(q, k, v, bias, opts, fmask, g, seed, lse_rtol)
    ok = fd.ok and fd_j.ok and cs.ok and cs_j.ok and lse_err <= lse_rtol and ip_err <= complex_rtol and hv.ok \
        and hv_err <= lse_rtol
    detail = []
    for rep in (fd, fd_j, cs, cs_j, hv):
        if not rep.ok:
            detail.append(str(rep))
    if hv_err > lse_rtol:
        detail.append(f"the tiled second order differs from the plain one by {hv_err:.3e} (> {lse_rtol:.0e})")
    if lse_err > lse_rtol:
        detail.append(f"lse backward differs from the probs backward by {lse_err:.3e} (> {lse_rtol:.0e})")
    if ip_err > complex_rtol:
        detail.append(f"<g, J t> = {lhs!r} but <J^T g, t> = {rhs!r} (rel {ip_err:.3e})")
    return CheckResult(case.name, ok, max(fd.max_rel_error, fd_j.max_rel_error),
                       max(fd.max_abs_error, fd_j.max_abs_error), time.perf_counter() - t0,
                       "\n".join(detail), cs_rel_error=max(cs.max_rel_error, cs_j.max_rel_error),
                       lse_rel_error=lse_err, ip_rel_error=ip_err, hvp_rel_error=hv.max_rel_error, report=fd)


def _second_order(q, k, v, bias, opts, fmask, g, seed, lse_rtol):
    """``(report, tiled vs plain)``: the HVP of ``<g, O>`` along random directions of ``(q, k, v[, bias])``
    against central differences of the VJP, and the tiled schedule's HVP against the plain one's."""
    kw = dict(opts, attn_mask=fmask if fmask is not None else opts.get("attn_mask"), bias=bias)
    args = (q, k, v) + ((bias,) if bias is not None else ())

    def grad(*a):
        kw_a = dict(kw, bias=a[3] if len(a) > 3 else None)
        gr = sdpa_backward(sdpa_forward(*a[:3], **kw_a)[1], g)
        return np.concatenate([x.ravel() for x in (gr.query, gr.key, gr.value) + ((gr.bias,) if len(a) > 3 else ())])

    def hvp(ts, *a, **how):
        kw_a = dict(kw, bias=a[3] if len(a) > 3 else None)
        h = sdpa_hvp(tuple(a[:3]), tuple(ts), g, **kw_a, **how)
        return np.concatenate([x.ravel() for x in (h.query, h.key, h.value) + ((h.bias,) if len(a) > 3 else ())])

    rep = check_jvp(grad, hvp, args, mode="projection", n_projections=2, rtol=HVP_RTOL, atol=CHECK_ATOL,
                    seed=seed + 3)
    ts = [np.random.default_rng(seed + 4).standard_normal(a.shape) for a in args]
    return rep, _rel_diff(hvp(ts, *args), hvp(ts, *args, method="tiled", block_size=2), lse_rtol)


def _rel_diff(a, b, rtol=None):
    """Normwise relative difference ``max|a - b| / max(1, max|a|)``; NaN must meet NaN (else inf)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not np.array_equal(np.isnan(a), np.isnan(b)):
        return float("inf")
    fin = ~np.isnan(a)
    if not fin.any():
        return 0.0
    scale = max(1.0, float(np.max(np.abs(a[fin]))))     # a floor of 1: exact zeros stay exact-ish
    return float(np.max(np.abs(a[fin] - b[fin]))) / scale


def _nan_policy_check(case, t0, **tols):
    """NaN exactly where documented; finite entries equal the proven "zero" policy on the same inputs."""
    q, k, v, fmask, bias, opts = differentiable_inputs(case)
    mask = opts.get("attn_mask", fmask)
    rest = {kk: vv for kk, vv in opts.items() if kk != "attn_mask"}
    out_nan, r_nan = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, **rest)
    out_zero, r_zero = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, **dict(rest, fully_masked="zero"))
    g = np.random.default_rng(case.seed + 1).standard_normal(out_nan.shape)
    gn, gz = sdpa_backward(r_nan, g), sdpa_backward(r_zero, g)
    gl = sdpa_backward(r_nan, g, method="tiled")
    nan_rows = r_nan.empty[..., 0]
    if r_nan.padded is not None:
        nan_rows = nan_rows & ~np.broadcast_to(r_nan.padded[..., 0], nan_rows.shape)
    problems = []
    if not nan_rows.any():
        problems.append("the case has no fully masked row to check")
    if not np.array_equal(np.isnan(out_nan).all(-1), nan_rows) or np.isnan(out_nan[~nan_rows]).any():
        problems.append("output NaN pattern differs from the fully masked rows")
    worst = float(np.max(np.abs(out_nan[~nan_rows] - out_zero[~nan_rows]), initial=0.0))
    dq_nan = np.isnan(gn.query).all(-1)
    if not np.array_equal(dq_nan, np.broadcast_to(nan_rows, dq_nan.shape)):
        problems.append("dq is not NaN exactly on the fully masked rows")
    worst = max(worst, float(np.max(np.abs(gn.query[~dq_nan] - gz.query[~dq_nan]), initial=0.0)))
    if not (np.isnan(gn.key).any() and np.isnan(gn.value).any()):
        problems.append("dk/dv should be poisoned by the NaN row")
    for a, b in zip(gn, gl):
        if a is not None and not np.array_equal(np.isnan(a), np.isnan(b)):
            problems.append("the lse backward has another NaN pattern")
    ts = tuple(np.random.default_rng(case.seed + 4).standard_normal(x.shape) for x in (q, k, v))
    hn = sdpa_hvp((q, k, v), ts, g, attn_mask=mask, bias=bias, **rest)       # second order: the gradient's NaN
    hz = sdpa_hvp((q, k, v), ts, g, attn_mask=mask, bias=bias, **dict(rest, fully_masked="zero"))    # pattern
    for a, b, c in zip(gn, hn, hz):
        if a is not None and not np.array_equal(np.isnan(a), np.isnan(b)):
            problems.append("the Hessian-vector product has another NaN pattern than the gradient")
        elif a is not None:
            fin = ~np.isnan(b)
            worst = max(worst, float(np.max(np.abs(b[fin] - c[fin]), initial=0.0)))
    zero = run_attention_case(replace(case, options=tuple(sorted(dict(case.options, fully_masked="zero").items()))),
                              **tols)
    ok = not problems and worst == 0.0 and zero.ok
    detail = "; ".join(problems) or ("" if ok else f"finite part differs by {worst:.3e}, or: {zero.detail}")
    return CheckResult(case.name + " (NaN pattern; finite part == zero policy)", ok, zero.max_rel_error,
                       max(worst, zero.max_abs_error), time.perf_counter() - t0, detail,
                       cs_rel_error=zero.cs_rel_error, lse_rel_error=zero.lse_rel_error,
                       ip_rel_error=zero.ip_rel_error, hvp_rel_error=zero.hvp_rel_error)


# ---------------------------------------------------------------- softmax


def softmax_checks(*, rtol=CHECK_RTOL, atol=CHECK_ATOL, complex_rtol=COMPLEX_RTOL,
                   complex_atol=COMPLEX_ATOL, **_) -> List[CheckResult]:
    """VJP and JVP checks of the softmax family along several axes, central and complex step."""
    rng = np.random.default_rng(0)
    results = []
    x = rng.standard_normal((2, 3, 4)) * 3
    for axis in (-1, 0, 1):
        items = [
            ("softmax_vjp", lambda x, a=axis: softmax(x, a),
             lambda g, x, a=axis: (softmax_vjp(softmax(x.real, a), g, a),), check_vjp),
            ("log_softmax_vjp", lambda x, a=axis: log_softmax(x, a),
             lambda g, x, a=axis: (log_softmax_vjp(log_softmax(x.real, a), g, a),), check_vjp),
            ("softmax_jvp", lambda x, a=axis: softmax(x, a),
             lambda t, x, a=axis: softmax_jvp(softmax(x.real, a), t[0], a), check_jvp),
        ]
        for name, fun, d, check in items:
            t0 = time.perf_counter()
            rep = check(fun, d, (x,), rtol=rtol, atol=atol)
            cs = check(fun, d, (x,), rtol=complex_rtol, atol=complex_atol, method="complex")
            detail = "\n".join(str(r) for r in (rep, cs) if not r.ok)
            results.append(CheckResult(f"{name} axis={axis}", rep.ok and cs.ok, rep.max_rel_error,
                                       rep.max_abs_error, time.perf_counter() - t0, detail,
                                       cs_rel_error=cs.max_rel_error, report=rep))
    return results


def run_checks(quick: bool = False, progress: Optional[Callable[[int, int, str], None]] = None,
               name_filter: Optional[str] = None, **tols) -> List[CheckResult]:
    """Run every self-check; ``progress(i, n, name)`` is called before each attention case.

    ``name_filter`` keeps only the cases whose name contains it; every
    tolerance must be a finite number >= 0.
    """
    for name, t in tols.items():
        check_tolerance(t, name)
    results = softmax_checks(**tols)
    cases = gradcheck_grid(quick)
    if name_filter:
        results = [r for r in results if name_filter in r.name]
        cases = [c for c in cases if name_filter in c.name]
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.name)
        results.append(run_attention_case(case, **tols))
    return results
