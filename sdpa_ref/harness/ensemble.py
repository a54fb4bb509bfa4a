r"""The honest ensemble: how far from the truth an honest kernel at a dtype lands, the same bits everywhere.

The relative rule (:mod:`.rules`) allows an implementation ``k`` times the
error of honest same-precision computations. One honest computation is not
enough: a kernel that puts the scale on ``q`` instead of the scores, or
walks the keys in blocks with an online softmax, rounds differently and
lands up to several times further from the truth on some problems, and a
rule calibrated on one of them fails honest kernels. So the allowance comes
from the worst of an ensemble (:data:`MEMBERS`), each computed the way
kernels compute:

* inputs in the test dtype; every matrix product accumulated in the work
  dtype (float32 below float64, float64 in float64), by a fixed pairwise
  tree or one fused multiply-add after another, and kept in the work dtype
  (scores, ``dP``) or rounded to the test dtype (the output, the gradients);
* softmax statistics (row max, row sum, ``lse``) in the work dtype;
* ``P`` rounded to the test dtype before ``P V``, unnormalised with the
  division at the end (FlashAttention) or normalised first (the plain path);
  ``dS`` rounded to the test dtype before ``dS K`` and ``dS^T Q``;
* the scale on the scores, on ``q`` or on ``k`` (rounded to the test dtype
  there);
* dense, or an online softmax over blocks of keys (rescaling the running
  sum and output by ``exp(m_old - m_new)``);
* an ``exp`` correctly rounded, or off by up to 32 ulp in a fixed
  pseudo-random pattern (vectorised kernels' ``exp`` are not correctly
  rounded: PyTorch CPU's ``exp_u20`` is documented at 20 ulp).

Every operation is an IEEE-754 operation in NumPy (element-wise, fixed to
the bit on every machine and SIMD level) or a loop in a fixed order;
``exp``, ``log`` and ``tanh`` are the package's double-double ones rounded
to the work dtype (:class:`sdpa_ref.exact.arith.LowPrecision`). No BLAS
call is made, so the allowance is the same bits on every machine, thread
count and BLAS.

The members compute what the reference computes on every option (masks,
causal, windows, lengths, GQA, bias, ALiBi, softcap, dropout, the
fully-masked policy). Where the reference's value is NaN (the ``"nan"``
policy, poisoned inputs) their value is not used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from ..lse import combine_in
from ..normalize import close_in, extra_probs_in, extra_shape, lse_in, row_stats, vjp_delta_in
from ..options import AttentionOptions
from .._validate import check_choice, check_tolerance
from ..problem import Problem
from ..rounding import round_to
from ..policy import averages_excluded, averages_values, constant_rows, counts, nan_rows, zero_output_rows
from ..transforms import dropout_forward, transform_scores_in, unbroadcast
from .lowp import DESCALES, MemberArith, output_dtype, widen

__all__ = ["MEMBERS", "Member", "ensemble_errors", "honest_errors", "honest_results", "member_quantities",
           "run_member", "worst_errors"]


@dataclass(frozen=True)
class Member:
    """One honest way to compute attention at a dtype (see the module docstring)."""

    name: str
    scale_on: str = "scores"           # "scores" (after Q K^T), "q" or "k" (rounded to the dtype there)
    block: Optional[int] = None        # None: dense softmax; else an online softmax over blocks of keys
    normalize: str = "late"            # "late": O = (P~ V) / l; "early": P = e / l rounded, O = P V
    order: str = "tree"                # accumulation: "tree" (fixed pairwise) or "fma" (one after another)
    delta: str = "out"                 # backward D = rowsum(dO * O) ("out") or rowsum(P * dP) ("probs")
    # -- what only the specimens (:mod:`.specimens`) set: the ensemble's members keep these defaults
    arith: str = "exact"               # "exact": fixed-order IEEE emulation; "blas": np.matmul, np.sum, np.exp,
    #                                    np.log, np.tanh
    recip: bool = False                # divide by the row sum (False) or multiply by its reciprocal
    exp_ulps: float = 0.0              # an exp that is off by up to this many ulp (like PyTorch CPU's exp_u20)
    scale_factor: float = 1.0          # a wrong scale (mutants)
    tf32: bool = False                 # matmul inputs rounded to TF32's 10-bit fraction (a mutant in float32)
    softcap_grad: bool = True          # False: the softcap derivative forgotten (a mutant)

    def __post_init__(self):
        for name, choices in (("scale_on", ("scores", "q", "k", "sqrt")), ("normalize", ("late", "early")),
                              ("order", ("tree", "fma")), ("delta", ("out", "probs")), ("arith", ("exact", "blas"))):
            check_choice(getattr(self, name), name, choices)
        if self.block is not None and (isinstance(self.block, bool) or not isinstance(self.block, int)
                                       or self.block < 1):
            raise ValueError(f"`block` should be None or an int >= 1, but got {self.block!r}")
        check_tolerance(self.exp_ulps, "exp_ulps")


#: The ensemble. Calibrated against honest NumPy kernels by ``benchmarks/calibrate_rule.py``.
MEMBERS = (
    Member("dense, scale on the scores"),
    Member("dense, scale on q, fma order", scale_on="q", order="fma"),
    Member("plain, P normalised first", normalize="early", delta="probs"),
    Member("online softmax, blocks of 16, scale on q", scale_on="q", block=16, order="fma"),
    Member("online softmax, blocks of 64, sqrt(scale) on q and k", scale_on="sqrt", block=64),
    Member("dense, scale on k", scale_on="k"),
    Member("dense, an exp off by up to 32 ulp", exp_ulps=32.0),
)


def ensemble_errors(case, dtype, ref64) -> Dict[str, float]:
    """Per quantity (``out, dq, dk, dv``, ``dbias``), the largest ``max|member - ref64|`` over :data:`MEMBERS` on
    ``case``'s inputs in ``dtype``, over the entries where ``ref64`` is a number (members cached per case)."""
    return worst_errors((member_quantities(case, np.dtype(dtype).name, m) for m in MEMBERS), ref64)


def honest_errors(inputs, grad_out, dtype, ref64) -> Dict[str, float]:
    """:func:`ensemble_errors` for any problem: ``inputs`` are the keyword arguments of :func:`sdpa_forward`
    (``query``, ``key``, ``value`` and the options, arrays in ``dtype``), ``grad_out`` the cotangent in
    ``dtype``."""
    return worst_errors(honest_results(inputs, grad_out, dtype), ref64)


def honest_results(inputs, grad_out, dtype) -> List[Dict[str, np.ndarray]]:
    """Each member's results (:func:`run_member`) on any problem, ``inputs`` and ``grad_out`` as in
    :func:`honest_errors`: for statistics beyond the largest error (the spread, the lean)."""
    prob, desc = _problem(inputs, "honest_errors")
    dO = np.asarray(grad_out).astype(np.float64)
    return [run_member(prob, dtype, m, dO, desc) for m in MEMBERS]


def _problem(inputs, who):
    """``(Problem, descales)``: the validated problem on the inputs' own values (fp8 ones not yet descaled) and
    the fp8 descales ``(q, k, v)`` (None without)."""
    arrays = widen(dict(inputs))
    desc = tuple(arrays.pop(n) for n in DESCALES) if all(n in arrays for n in DESCALES) else None
    q, k, v = arrays.pop("query"), arrays.pop("key"), arrays.pop("value")
    return Problem.build(q, k, v, AttentionOptions.from_kwargs(who, **arrays)), desc


def worst_errors(results, ref64) -> Dict[str, float]:
    """Per quantity of ``ref64``, the largest ``max|member - ref64|`` over ``results`` (members' result
    dicts), over the entries where the reference is finite; a member's NaN there is an unbounded error."""
    worst: Dict[str, float] = {}
    for got in results:
        for q, ref in ref64.items():
            if q not in got:
                continue
            fin = np.isfinite(ref)                           # NaN, and the LSE's -inf on rows with no key
            with np.errstate(invalid="ignore"):
                d = np.abs(np.where(fin, got[q].astype(np.float64) - ref, 0.0))
            d = np.where(np.isnan(d), np.inf, d)            # a member NaN where the truth is a number: unbounded
            worst[q] = max(worst.get(q, 0.0), float(d.max(initial=0.0)))
    return worst


@functools.lru_cache(maxsize=4096)
def member_quantities(case, dtype, member: Member):
    """``member``'s ``out, dq, dk, dv`` (and ``dbias``) on ``case``'s inputs drawn in ``dtype``, in that dtype,
    and its ``lse`` (base e) in the work dtype; read-only (cached)."""
    dt = np.dtype(dtype)
    prob, desc = _problem(case.make_inputs(dt), "ensemble")
    dO = case.grad_out(prob.out_shape, output_dtype(dt))
    res = run_member(prob, dt, member, np.asarray(dO).astype(np.float64), desc)
    for a in res.values():
        a.setflags(write=False)
    return res


def run_member(prob, dtype, member: Member, dO=None, descales=None):
    """``member`` on a validated float64 :class:`~sdpa_ref.problem.Problem` whose values are ``dtype``'s: ``out``
    and, given ``dO`` (float64 holding values of the output dtype), ``dq, dk, dv`` (and ``dbias``), in the
    output dtype (:func:`~.lowp.output_dtype`: bfloat16 for fp8). ``descales``: fp8's ``(q, k, v)`` factors,
    ``batch + (Hkv,)``; the gradients are then those of the descaled problem."""
    with np.errstate(all="ignore"):
        return _Kernel(prob, dtype, member, descales).run(dO)


class _Kernel:
    """One member on one problem: the forward, then the backward, in full ``(*batch, Hq, L, n)`` layout.

    The schedule (where the scale goes, dense or blocks of keys, early or late normalisation, ``D`` from ``O``
    or from ``P``) is the member's and is written here; every formula it evaluates is a stage of the package,
    run over the member's arithmetic ``A`` (:class:`~.lowp.MemberArith`, whose ``matmul``, ``sum``, ``exp`` and
    ``div`` carry the member's order, ``exp`` error, reciprocal and TF32): the score transforms
    (:func:`~sdpa_ref.transforms.transform_scores_in`, in the plain low precision ``A.base``), the row max
    (:func:`~sdpa_ref.normalize.row_stats`), the merge of normalisers (:func:`~sdpa_ref.lse.combine_in`) and the
    sink's fold (:func:`~sdpa_ref.normalize.close_in`), the LSE (:func:`~sdpa_ref.normalize.lse_in`), the
    fully-masked policy's rows (:mod:`sdpa_ref.policy`), the softmax VJP with ``D`` given
    (:func:`~sdpa_ref.normalize.vjp_delta_in`) and the gradients' unbroadcast
    (:func:`~sdpa_ref.broadcast.unbroadcast`, by ``A.base``'s fixed trees).
    """

    def __init__(self, prob, dt, member, descales=None):
        self.p, self.dt, self.m = prob, np.dtype(dt), member
        self.out_dt = output_dtype(dt)
        self.A = MemberArith(member, dt)
        self.w, self.X = self.A.dtype, self.A.base
        self.W = self.A.lift                                       # into the work dtype
        self.s = self.w.type(prob.scale * member.scale_factor)
        # fp8: (*batch, Hq, 1, 1) factors of q, k, v (a GQA group shares its kv-head's)
        self.desc = None if descales is None else tuple(
            self.W(np.repeat(np.asarray(d), prob.G, axis=-1)[..., None, None]) for d in descales)

    def rd(self, x):
        """Rounded to the test dtype, returned in the work dtype (exact there)."""
        return round_to(x, self.dt).astype(self.w)

    def rd_out(self, x):
        """Rounded to the output dtype (bfloat16 for fp8: what an fp8 kernel returns and its backward reads)."""
        return round_to(x, self.out_dt).astype(self.w)

    # -- layouts
    def full(self, a, heads_of_kv):
        """``q`` ``(..., Hkv, G, L, n)`` or ``k``/``v`` ``(..., Hkv, S, n)`` as ``(*batch, Hq, ., n)``."""
        p = self.p
        if heads_of_kv:
            a = np.broadcast_to(a[..., :, None, :, :], a.shape[:-2] + (p.G,) + a.shape[-2:])
        a = a.reshape(a.shape[:-4] + (p.Hq,) + a.shape[-2:])
        return np.broadcast_to(a, p.batch + a.shape[-3:])

    def to_input(self, g, which):
        """A full-layout gradient summed over each GQA group (keys, values) and the broadcast batch dims."""
        p = self.p
        if which != "query":
            g = g.reshape(g.shape[:-3] + (p.Hkv, p.G) + g.shape[-2:])
            g = self.X.sum(np.moveaxis(g, -3, -1), axis=-1)            # (..., Hkv, S, n) by a fixed tree
        shape = tuple(p.shapes[which])
        return self.sum_to(g, shape if len(shape) > 2 else (1,) + shape).reshape(shape)

    def sum_to(self, g, shape):
        """``g`` summed down to the broadcastable ``shape`` by fixed trees, one axis at a time."""
        return unbroadcast(g, tuple(shape), self.X)

    # -- the two passes
    def run(self, dO):
        fw = self.forward()
        out = {"out": round_to(fw["O"], self.out_dt).reshape(self.p.out_shape),
               "lse": fw["lse"][..., 0].reshape(self.p.out_shape[:-1])}     # in the work dtype, as kernels keep it
        if dO is not None:
            out.update(self.backward(fw, np.asarray(dO).reshape(fw["O"].shape)))
        return out

    def scores(self):
        p, m, A = self.p, self.m, self.A
        q, k = self.W(self.full(p.q, False)), self.W(self.full(p.k, True))
        if self.desc is not None:            # fp8: the scale rides with the descales, in float32, after the GEMM
            qd, kd, _ = self.desc
            return self.W(A.matmul(q, np.swapaxes(k, -1, -2)) * self.W(self.W(qd * kd) * self.s))
        if m.scale_on == "scores":
            return self.W(A.matmul(q, np.swapaxes(k, -1, -2)) * self.s)
        q, k = self.scaled(q, k)
        return A.matmul(q, np.swapaxes(k, -1, -2))

    def factors(self):
        """``(r_q, r_k)``: what ``q`` and ``k`` are multiplied by before ``Q K^T`` (None: nothing)."""
        root = self.w.type(np.sqrt(self.s))
        return {"q": (self.s, None), "k": (None, self.s), "sqrt": (root, root), "scores": (None, None)}[
            self.m.scale_on]

    def scaled(self, q, k):
        """``(q, k)`` with the scale on ``q``, on ``k`` or its square root on both, rounded to the dtype."""
        rq, rk = self.factors()
        return (q if rq is None else self.rd(q * rq)), (k if rk is None else self.rd(k * rk))

    def forward(self):
        p, m, o, A = self.p, self.m, self.p.options, self.A
        excl = np.zeros(p.full_scores, bool)
        if p.allowed() is not None:
            excl |= ~np.broadcast_to(p.allowed(), p.full_scores)
        T, excl, sd = transform_scores_in(self.X, p, self.W(self.scores()), excluded=excl)   # softcap, M, B, ALiBi
        empty = excl.all(axis=-1, keepdims=True) if p.S else np.ones(p.full_scores[:-1] + (1,), bool)
        sink = None if p.sink is None else np.broadcast_to(self.W(p.sink_rows()), empty.shape)
        if sink is not None:                            # a row with a sink is not empty: O = 0, no policy
            empty = empty & (sink == -np.inf)
        if averages_values(o.fully_masked):             # every key alike: a row of equal scores (JAX: the keys
            struct = np.zeros(p.full_scores, bool)      # the structural rules exclude, none left: NaN)
            if p.allowed() is not None:
                struct |= ~np.broadcast_to(p.allowed(), p.full_scores)
            excl = np.where(empty, ~struct if averages_excluded(o.fully_masked) else False, excl)
            T = np.where(empty, self.w.type(0), T)
        T = np.where(excl, -np.inf, T).astype(self.w)
        keep, rdrop = self.dropout()
        v = self.W(self.full(p.v, True))
        vd = None if self.desc is None else self.desc[2]
        if m.block is None:                             # the sink: one more score, with no value, in the max
            mx = row_stats(T if sink is None else np.concatenate([T, sink], axis=-1))[0]
            e = A.exp_minus(T, mx)
            lsum = A.sum(e, keepdims=True)
            if sink is not None:                        # the keys' sum at the row's max, joined by the sink's
                lsum = close_in(A, mx, lsum, np.zeros(mx.shape, bool), sink).s
            if m.normalize == "early":
                P = A.div(e, lsum)
                O = self.descale(A.matmul(self.drop(self.rd(P), keep, rdrop), v), vd)
            else:
                O = A.div(self.descale(A.matmul(self.drop(self.rd(e), keep, rdrop), v), vd), lsum)
        else:                                           # the online softmax: one block of keys at a time,
            mx = np.zeros(T.shape[:-1] + (1,), self.w)  # each block's exp at the new max (FlashAttention 2)
            lsum = np.zeros(T.shape[:-1] + (1,), self.w)
            none = np.ones(mx.shape, bool)
            acc = np.zeros(T.shape[:-1] + (v.shape[-1],), self.w)
            for j0 in range(0, p.S, m.block):
                Tj = T[..., j0:j0 + m.block]            # the new max: the running one's and the block's
                new, blank, _ = row_stats(np.concatenate([np.where(none, -np.inf, mx), Tj], axis=-1))
                ej = A.exp_minus(Tj, new)
                mx, lsum, (a, b), none = combine_in(A, [mx, new], [lsum, A.sum(ej, keepdims=True)], [none, blank])
                kj = None if keep is None else keep[..., j0:j0 + m.block]
                pv = A.matmul(self.drop(self.rd(ej), kj, rdrop), v[..., j0:j0 + m.block, :])
                acc = A.add(A.mul(a, acc), A.mul(b, pv))                         # b = 1: exact
            if sink is not None:                        # the sink: one more part, after the last block of keys
                mx, lsum, (a, _), _ = combine_in(A, [mx, np.where(sink == -np.inf, 0, sink).astype(self.w)],
                                                 [lsum, None], [none, sink == -np.inf])
                acc = A.mul(a, acc)
            O = A.div(self.descale(acc, vd), lsum)
        lse = lse_in(A, mx, lsum)
        O = self.fill_rows(O, empty)
        return {"O": self.rd_out(O), "T": T, "sd": sd, "lse": lse, "empty": empty, "sink": sink,
                "P": P if m.normalize == "early" and m.block is None else None}

    def descale(self, x, d):
        return x if d is None else self.W(x * d)

    def dropout(self):
        p = self.p
        return (None, None) if p.keep is None else (np.broadcast_to(p.keep, p.full_scores), p.options.dropout_p)

    def drop(self, x, keep, rate, dt=True):
        """``x * Z / (1 - p)`` in the work dtype, rounded to the test dtype (the kernel's P before P V) unless
        ``dt=False``."""
        y = dropout_forward(self.W(x), keep, rate)
        return self.rd(y) if dt else self.W(y)

    def fill_rows(self, O, empty):
        """The fully-masked policy on a result: NaN on the rows the ``"nan"`` policy makes NaN (a kernel spreads
        them as the formula does), 0 on those whose output is 0 by definition."""
        p, policy = self.p, self.p.options.fully_masked
        pad = p.padded_rows()
        nan, zero = nan_rows(empty, pad, policy, counts(p), p.S), zero_output_rows(empty, pad, policy)
        O = O if zero is None else np.where(zero, self.w.type(0), O)
        return O if nan is None else np.where(nan, self.w.type(np.nan), O)

    def backward(self, fw, dO):
        p, m, A = self.p, self.m, self.A
        dO = self.rd_out(dO)
        keep, rdrop = self.dropout()
        rd = self.rd if self.desc is None else self.rd_out        # fp8: the backward's operands in bfloat16
        q, k, v = (self.W(self.full(x, h)) for x, h in ((p.q, False), (p.k, True), (p.v, True)))
        P = fw["P"] if fw["P"] is not None else A.exp_minus(fw["T"], fw["lse"])     # P from the LSE kept
        P = self.fill_rows(P, fw["empty"])
        Pd = self.drop(P, keep, rdrop, dt=False)
        dv = A.matmul(np.swapaxes(rd(Pd), -1, -2), dO)
        dP = self.descale(A.matmul(dO, np.swapaxes(v, -1, -2)), None if self.desc is None else self.desc[2])
        dPd = self.drop(dP, keep, rdrop, dt=False)
        D = A.sum(A.mul(dO, fw["O"]) if m.delta == "out" else A.mul(P, dPd), keepdims=True)  # FlashAttention's
        pe = extra_probs_in(A, fw["sink"], fw["lse"])               # the sink's e^(sink - lse), or None
        dS, ds = vjp_delta_in(A, P, dPd, D, pe)                     # P (dP - D), and -p_sink D
        const = constant_rows(fw["empty"], p.padded_rows(), p.options.fully_masked, counts(p))
        dS = dS if const is None else np.where(const, self.w.type(0), dS)      # P is a constant there
        res = {}
        if ds is not None:                              # dsink = -sum_i p_sink,i D_i
            ds = ds if const is None else np.where(const, self.w.type(0), ds)
            ds = self.X.sum(ds[..., 0], axis=-1)                       # over the rows, by a fixed tree
            res["dsinks"] = self.sum_to(ds, extra_shape(p)).reshape(p.shapes["sinks"])   # the caller's shape
        if p.bias is not None:
            res["dbias"] = self.sum_to(dS, p.shapes["bias"]).reshape(p.shapes["bias"])
        if fw["sd"] is not None and m.softcap_grad:
            dS = A.mul(dS, fw["sd"])
        dSt = rd(dS)
        if self.desc is not None:            # d(S) = dS through (q8 qd)(k8 kd)^T * scale
            qd, kd, _ = self.desc
            dq = self.W(A.matmul(dSt, k) * self.W(kd * self.s))
            dk = self.W(A.matmul(np.swapaxes(dSt, -1, -2), q) * self.W(qd * self.s))
        elif m.scale_on == "scores":
            dq = self.W(A.matmul(dSt, k) * self.s)
            dk = self.W(A.matmul(np.swapaxes(dSt, -1, -2), q) * self.s)
        else:                                # d(q' k'^T): dq' = dS k', dk' = dS^T q', then through q' = q * r
            (rq, rk), (qs, ks) = self.factors(), self.scaled(q, k)
            dq, dk = A.matmul(dSt, ks), A.matmul(np.swapaxes(dSt, -1, -2), qs)
            dq = dq if rq is None else self.W(dq * rq)
            dk = dk if rk is None else self.W(dk * rk)
        res.update(dq=self.to_input(dq, "query"), dk=self.to_input(dk, "key"), dv=self.to_input(dv, "value"))
        return {n: round_to(a, self.w if n == "dsinks" else self.out_dt) for n, a in res.items()}   # dsinks: as sinks
