"""The installation self-check behind ``sdpa-ref check``.

It proves every backward in the package (the softmax family and attention)
over a grid of options and reports one row per case. Shapes are small, so
the full grid runs in well under a minute.

Each attention case is checked five ways:

* ``fd``: the VJP (``sdpa_backward``) and the JVP (``sdpa_jvp``) against
  float64 central differences, whole Jacobian, to ``CHECK_RTOL`` (1e-7);
* ``cs``: the VJP and the JVP (``sdpa_jvp``) against the complex step
  (:func:`sdpa_forward_complex`), whole Jacobian, to ``COMPLEX_RTOL`` (1e-12);
* ``lse``: FlashAttention's backward (``method="lse"``) and the plain,
  documented one (``method="plain"``) against the default one, to
  ``LSE_RTOL`` (1e-13) in the normwise relative error
  ``max|a - b| / max(1, max|a|)`` of each gradient;
* ``ip``: the inner-product identity ``<g, J t> == <J^T g, t>`` between the
  JVP and the VJP, to 1e-12.

The grid: a core product of shapes (``L = S``, ``L < S``, ``L > S``, a
broadcast batch; ``Ev != E`` throughout) x no/bool/float mask x causal x GQA
x dropout (explicit keep mask, ``p = 0.3``); every ``fully_masked`` policy on
inputs with a fully masked row; and the variants of FlashAttention, JAX and
xformers -- bias (alone and with a mask), bottom-right causal, windows in both
alignments, softcap, ALiBi, per-batch lengths, rows emptied by alignment, a
window or a zero length under each policy, and all of them together.

Under ``"nan"`` the gradients are NaN by design (the textbook formula in
IEEE arithmetic). Such a case asserts the documented NaN pattern and that
every finite entry equals the gradient of the ``"zero"`` policy, which is
itself proven in full.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Tuple

import numpy as np

from .attention import sdpa_backward, sdpa_forward, sdpa_forward_complex, sdpa_jvp
from .gradcheck import _errors, check_jvp, check_vjp
from .softmax import log_softmax, log_softmax_vjp, softmax, softmax_jvp, softmax_vjp

__all__ = [
    "CHECK_RTOL", "CHECK_ATOL", "COMPLEX_RTOL", "COMPLEX_ATOL", "LSE_RTOL",
    "AttentionCase", "CheckResult", "attention_cases", "run_attention_case", "run_checks", "softmax_checks",
]

#: Central differences: symmetric relative error every case must meet.
CHECK_RTOL = 1e-7
#: Central differences: absolute floor.
CHECK_ATOL = 1e-9
#: Complex step (VJP and JVP) and the inner-product identity.
COMPLEX_RTOL = 1e-12
#: Complex step: absolute floor (entries below ~1e-2 are judged by it).
COMPLEX_ATOL = 1e-14
#: The lse backward against the probs backward.
LSE_RTOL = 1e-13

# name -> (batch_q, batch_kv, L, S, E, Ev)
_SHAPES = {
    "L=S": ((2,), (2,), 4, 4, 3, 2),
    "L<S": ((2,), (2,), 3, 5, 4, 3),
    "L>S": ((2,), (2,), 5, 3, 2, 3),
    "bcast": ((2,), (1,), 3, 4, 3, 2),
}


@dataclass(frozen=True)
class AttentionCase:
    shape: str
    mask: str = "none"                  # "none" | "bool" | "float"
    causal: bool = False
    gqa: bool = False
    dropout: bool = False
    fully_masked: str = "zero"
    masked_row: bool = False            # a fully masked row made by the mask
    bias: bool = False
    alignment: str = "top_left"
    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    softcap: Optional[float] = None
    alibi: bool = False
    lengths: str = "none"               # "none" | "some" | "zero_kv"

    @property
    def name(self) -> str:
        parts = [self.shape]
        if self.mask != "none":
            parts.append(f"mask={self.mask}")
        if self.bias:
            parts.append("bias")
        if self.causal:
            parts.append("causal" + ("-br" if self.alignment == "bottom_right" else ""))
        if self.window is not None:
            w = ",".join("-" if b is None else str(b) for b in self.window)
            parts.append(f"window=({w})" + ("-br" if self.alignment == "bottom_right" else ""))
        if self.alignment == "bottom_right" and not (self.causal or self.window is not None):
            parts.append("bottom_right")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.lengths != "none":
            parts.append("lengths" if self.lengths == "some" else "kv_len=0")
        if self.gqa:
            parts.append("gqa")
        if self.dropout:
            parts.append("dropout")
        if self.masked_row or self.fully_masked != "zero":
            parts.append(f"fully_masked={self.fully_masked}")
        return " ".join(parts)


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
    report: Optional[object] = field(default=None, repr=False)

    def as_dict(self):
        return {"name": self.name, "ok": self.ok, "fd_rel_error": self.max_rel_error,
                "fd_abs_error": self.max_abs_error, "cs_rel_error": self.cs_rel_error,
                "lse_rel_error": self.lse_rel_error, "ip_rel_error": self.ip_rel_error,
                "seconds": self.seconds, "detail": self.detail}


# ------------------------------------------------------------------ the grid


def attention_cases(quick: bool = False) -> List[AttentionCase]:
    """The grid of attention cases; ``quick`` keeps a covering subset (about a third)."""
    core = [AttentionCase(s, mask=m, causal=c, gqa=g, dropout=d)
            for s, m, c, g, d in itertools.product(_SHAPES, ("none", "bool", "float"), (False, True),
                                                   (False, True), (False, True))]
    masked = [AttentionCase(s, mask=m, gqa=g, dropout=d, fully_masked=p, masked_row=True)
              for s, m, p, g, d in itertools.product(("L=S", "L>S"), ("bool", "float"),
                                                     ("zero", "nan", "uniform"), (False, True), (False, True))]
    br = "bottom_right"
    base_variants = [
        dict(bias=True), dict(bias=True, mask="bool"), dict(bias=True, mask="float"),
        dict(causal=True, alignment=br),
        dict(window=(2, 1)), dict(window=(2, 1), alignment=br), dict(window=(None, 1), alignment=br),
        dict(window=(1, None)), dict(window=(1, 0), causal=True, alignment=br),
        dict(softcap=1.5), dict(softcap=1.5, bias=True, causal=True),
        dict(alibi=True), dict(alibi=True, alignment=br), dict(alibi=True, causal=True, alignment=br),
        dict(lengths="some"), dict(lengths="some", alignment=br, causal=True),
        dict(lengths="some", window=(1, 1), alignment=br),
        dict(mask="bool", bias=True, causal=True, alignment=br, window=(3, None), softcap=2.0, alibi=True,
             lengths="some"),
    ]
    variants = []
    for shape in ("L<S", "L>S", "bcast"):
        for opts in base_variants:
            for gd in (False, True):
                variants.append(AttentionCase(shape, gqa=gd, dropout=gd, **opts))
    # rows emptied by alignment, a window, or a zero length, under each policy
    emptied = [dict(shape="L>S", causal=True, alignment=br),           # rows i < L - S see no key
               dict(shape="L>S", window=(0, 0)),                        # rows i >= S see no key
               dict(shape="L=S", lengths="zero_kv"),                    # a batch with no keys
               dict(shape="L>S", lengths="some", causal=True, alignment=br)]
    for opts, policy, gd in itertools.product(emptied, ("zero", "nan", "uniform"), (False, True)):
        variants.append(AttentionCase(gqa=gd, dropout=gd, fully_masked=policy, **opts))
    cases = core + masked + variants
    if quick:
        keep = []
        for i, c in enumerate(cases):
            if c in core:
                if c.gqa == c.dropout and c.causal == (c.mask != "float"):
                    keep.append(c)
            elif c.gqa == c.dropout and (i % 2 == 0 or c.fully_masked != "zero"):
                keep.append(c)
        cases = keep
    return cases


def make_attention_inputs(case: AttentionCase, seed: int = 0):
    """Small random inputs for ``case``: ``(q, k, v, float_mask, bias, opts)``."""
    bq, bkv, L, S, E, Ev = _SHAPES[case.shape]
    Hq, Hkv = (4, 2) if case.gqa else (2, 2)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(bq + (Hq, L, E))
    k = rng.standard_normal(bkv + (Hkv, S, E))
    v = rng.standard_normal(bkv + (Hkv, S, Ev))
    batch = np.broadcast_shapes(bq, bkv)
    opts = {"is_causal": case.causal, "enable_gqa": case.gqa, "fully_masked": case.fully_masked,
            "causal_alignment": case.alignment}
    mask = None
    if case.mask == "bool":
        mask = rng.random((Hq, L, S)) < 0.75
        mask[..., 0] = True                 # no row is empty by accident ...
        mask[..., -1] = True                # ... under either alignment
    elif case.mask == "float":
        mask = rng.standard_normal(batch + (1, L, S))
    if case.masked_row:
        if case.mask == "bool":
            mask[1, 1, :] = False
        else:
            mask = np.broadcast_to(mask, batch + (Hq, L, S)).copy()
            mask[..., 1, 1, :] = -np.inf
    if case.mask == "bool":
        opts["attn_mask"] = mask
    bias = rng.standard_normal((Hq, 1, S)) if case.bias else None
    if case.window is not None:
        opts["window"] = case.window
    if case.softcap is not None:
        opts["softcap"] = case.softcap
    if case.alibi:
        opts["alibi_slopes"] = np.linspace(0.25, 1.0, Hq)
    if case.lengths == "some":
        opts["q_lengths"] = np.array([L, max(L - 2, 1)])[: batch[0]]
        opts["kv_lengths"] = np.array([max(S - 1, 1), S])[: batch[0]]
    elif case.lengths == "zero_kv":
        opts["kv_lengths"] = np.array([S, 0])[: batch[0]]
    if case.dropout:
        opts["dropout_p"] = 0.3
        opts["dropout_mask"] = rng.random(batch + (Hq, L, S)) >= 0.3
    float_mask = mask if case.mask == "float" else None
    return q, k, v, float_mask, bias, opts


# ---------------------------------------------------------------- one case


def attention_functions(opts, float_mask, bias):
    """``fun``, ``fun_complex``, ``vjp``, ``jvp`` over the differentiable args.

    The args are ``(q, k, v)``, then the float mask and the bias when the case
    has them. The JVP has no float-mask tangent, so it closes over the mask.
    """
    has_m, has_b = float_mask is not None, bias is not None
    rest = {k: v for k, v in opts.items() if k != "attn_mask"}

    def split(args):
        q, k, v, *extra = args
        m = extra.pop(0) if has_m else opts.get("attn_mask")
        b = extra.pop(0) if has_b else None
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
        return (gr.query, gr.key, gr.value) + ((gr.attn_mask,) if has_m else ()) + ((gr.bias,) if has_b else ())

    m_fixed = float_mask if has_m else opts.get("attn_mask")

    def jfun(*args):
        q, k, v, *b = args
        return sdpa_forward(q, k, v, attn_mask=m_fixed, bias=b[0] if b else None, **rest)[0]

    def jfun_complex(*args):
        q, k, v, *b = args
        return sdpa_forward_complex(q, k, v, attn_mask=m_fixed, bias=b[0] if b else None, **rest)

    def jvp(ts, *args):
        q, k, v, *b = args
        return sdpa_jvp((q, k, v), tuple(ts), attn_mask=m_fixed, bias=b[0] if b else None, **rest)[1]

    return fun, fun_complex, vjp, jfun, jfun_complex, jvp


def run_attention_case(case: AttentionCase, *, rtol=CHECK_RTOL, atol=CHECK_ATOL, complex_rtol=COMPLEX_RTOL,
                       complex_atol=COMPLEX_ATOL, lse_rtol=LSE_RTOL, seed=0) -> CheckResult:
    """Run the five checks of one case (see the module docstring)."""
    t0 = time.perf_counter()
    q, k, v, fmask, bias, opts = make_attention_inputs(case, seed)
    if case.fully_masked == "nan":
        return _nan_policy_check(case, t0, rtol=rtol, atol=atol, complex_rtol=complex_rtol,
                                 complex_atol=complex_atol, lse_rtol=lse_rtol, seed=seed)
    args = (q, k, v) + ((fmask,) if fmask is not None else ()) + ((bias,) if bias is not None else ())
    jargs = (q, k, v) + ((bias,) if bias is not None else ())
    fun, fun_c, vjp_raw, jfun, jfun_c, jvp = attention_functions(opts, fmask, bias)
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

    fd = check_vjp(fun, vjp, args, rtol=rtol, atol=atol)
    fd_j = check_jvp(jfun, jvp_m, jargs, rtol=rtol, atol=atol)
    cs = check_vjp(fun_c, vjp, args, method="complex", rtol=complex_rtol, atol=complex_atol)
    cs_j = check_jvp(jfun_c, jvp_m, jargs, method="complex", rtol=complex_rtol, atol=complex_atol)
    # FlashAttention's backward against the teaching one
    g = np.random.default_rng(seed + 1).standard_normal(fun(*args).shape)
    base = vjp(g, *args)
    lse_err = max(_rel_diff(a, b, lse_rtol) for other in ("lse", "plain")
                  for a, b in zip(base, vjp(g, *args, method=other)))
    # <g, J t> == <J^T g, t>
    rng = np.random.default_rng(seed + 2)
    ts = [rng.standard_normal(a.shape) for a in jargs]
    lhs = float(np.sum(g * jvp(ts, *jargs)))
    grads = vjp(g, *args)
    gj = list(grads[:3]) + ([grads[-1]] if bias is not None else [])
    rhs = float(sum(np.sum(a * t) for a, t in zip(gj, ts)))
    ip_err = abs(lhs - rhs) / max(abs(lhs) + abs(rhs), 1e-300)
    ok = fd.ok and fd_j.ok and cs.ok and cs_j.ok and lse_err <= lse_rtol and ip_err <= complex_rtol
    detail = []
    for rep in (fd, fd_j, cs, cs_j):
        if not rep.ok:
            detail.append(str(rep))
    if lse_err > lse_rtol:
        detail.append(f"lse backward differs from the probs backward by {lse_err:.3e} (> {lse_rtol:.0e})")
    if ip_err > complex_rtol:
        detail.append(f"<g, J t> = {lhs!r} but <J^T g, t> = {rhs!r} (rel {ip_err:.3e})")
    return CheckResult(case.name, ok, max(fd.max_rel_error, fd_j.max_rel_error),
                       max(fd.max_abs_error, fd_j.max_abs_error), time.perf_counter() - t0,
                       "\n".join(detail), cs_rel_error=max(cs.max_rel_error, cs_j.max_rel_error),
                       lse_rel_error=lse_err, ip_rel_error=ip_err, report=fd)


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
    """NaN exactly where documented; finite entries equal the proven "zero" policy."""
    q, k, v, fmask, bias, opts = make_attention_inputs(case, tols["seed"])
    mask = opts.get("attn_mask", fmask)
    rest = {kk: vv for kk, vv in opts.items() if kk != "attn_mask"}
    out_nan, r_nan = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, **rest)
    out_zero, r_zero = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, **dict(rest, fully_masked="zero"))
    g = np.random.default_rng(1).standard_normal(out_nan.shape)
    gn, gz = sdpa_backward(r_nan, g), sdpa_backward(r_zero, g)
    gl = sdpa_backward(r_nan, g, method="lse")
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
    zero = run_attention_case(replace(case, fully_masked="zero"),
                              **{kk: vv for kk, vv in tols.items() if kk != "seed"})
    ok = not problems and worst == 0.0 and zero.ok
    detail = "; ".join(problems) or ("" if ok else f"finite part differs by {worst:.3e}, or: {zero.detail}")
    return CheckResult(case.name + " (NaN pattern; finite part == zero policy)", ok, zero.max_rel_error,
                       max(worst, zero.max_abs_error), time.perf_counter() - t0, detail,
                       cs_rel_error=zero.cs_rel_error, lse_rel_error=zero.lse_rel_error,
                       ip_rel_error=zero.ip_rel_error)


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

    ``name_filter`` keeps only the cases whose name contains it.
    """
    results = softmax_checks(**tols)
    cases = attention_cases(quick)
    if name_filter:
        results = [r for r in results if name_filter in r.name]
        cases = [c for c in cases if name_filter in c.name]
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.name)
        results.append(run_attention_case(case, **tols))
    return results
