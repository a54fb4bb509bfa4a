"""Honest and wrong attention kernels: what the relative rule must pass, and what it must catch.

Each specimen is a pair of functions with the harness's signatures
(``forward(q, k, v, **options)``, ``backward(grad_out, q, k, v, **options)``)
at any test dtype, built on the ensemble's kernel (:mod:`.ensemble`) but
computed the way a NumPy user would write it -- ``np.matmul`` on the BLAS,
``np.exp``, ``np.sum`` (``arith="blas"``) -- with one honest choice or one
bug each. :data:`HONEST` must pass on every case; each of :data:`MUTANTS`
must fail on the case that exposes it (``tests/test_harness_specimens.py``,
``benchmarks/calibrate_rule.py``).

Which bugs can be seen depends on the dtype: a scale off by 1e-4 moves a
float32 output by about 30 ulp, and a bfloat16 one by less than its
rounding. The tests say per dtype what is expected, and why.
"""

from __future__ import annotations

import numpy as np

from ..masks import alignment_offset
from ..options import AttentionOptions
from ..problem import Problem
from ..rounding import round_to
from .ensemble import Member, run_member
from .lowp import DESCALES, output_dtype, widen, work_dtype

__all__ = ["HONEST", "MUTANTS", "Specimen"]


class Specimen:
    """A kernel: ``member`` (its arithmetic) at the test dtype, or at ``inner`` claiming the test dtype, with
    an optional bug in what it is told (``bug``: ``"causal_off_by_one"``, ``"top_left"``, ``"no_descale"``:
    fp8's descales ignored) or returns (``"nan_rows"``, ``"zero_rows"``, ``"constant"``, ``"shuffled_rows"``).
    At fp8 it takes ``q_descale``, ``k_descale``, ``v_descale`` and returns bfloat16."""

    def __init__(self, name, member, inner=None, bug=None):
        self.name, self.member, self.inner, self.bug = name, member, inner, bug

    def __repr__(self):
        return f"Specimen({self.name!r})"

    def _run(self, q, k, v, opts, dO=None):
        dt = np.asarray(q).dtype
        inner = np.dtype(self.inner) if self.inner is not None else dt
        opts = dict(opts)
        if self.bug == "top_left" and opts.get("is_causal"):
            opts["causal_alignment"] = "top_left"
        if self.bug == "causal_off_by_one" and opts.get("is_causal"):
            L, S = q.shape[-2], k.shape[-2]
            off = alignment_offset(L, S, opts.pop("causal_alignment", "top_left"))
            opts.pop("is_causal")
            tri = np.tri(L, S, k=off + 1, dtype=bool)                  # one key too many
            m = opts.get("attn_mask")
            opts["attn_mask"] = tri if m is None else (np.asarray(m) & tri)
        desc = tuple(opts.pop(n) for n in DESCALES) if all(n in opts for n in DESCALES) else None
        if self.bug == "no_descale" and desc is not None:
            desc = tuple(np.ones_like(d) for d in desc)                # the fp8 values taken as they are
        x64 = widen(opts)
        q64, k64, v64 = (round_to(a, inner).astype(np.float64) for a in (q, k, v))
        prob = Problem.build(q64, k64, v64, AttentionOptions.from_kwargs(self.name, **x64))
        g = None if dO is None else round_to(dO, output_dtype(inner)).astype(np.float64)
        res = run_member(prob, inner, self.member, g, desc)
        return {n: round_to(a, work_dtype(dt) if n in ("lse", "dsinks") else output_dtype(dt)) for n, a in res.items()}, \
            prob

    def forward(self, q, k, v, **opts):
        res, prob = self._run(q, k, v, opts)
        out = res["out"]
        if self.bug in ("nan_rows", "zero_rows"):
            empty = _empty_rows(prob)
            out = np.where(empty, out.dtype.type(np.nan if self.bug == "nan_rows" else 0), out)
        elif self.bug == "constant":
            out = np.full_like(out, out.dtype.type(0.25))
        elif self.bug == "shuffled_rows" and out.shape[-2] > 1:
            out = np.roll(out, 1, axis=-2)
        return out

    def forward_lse(self, q, k, v, **opts):
        """``(out, lse)``: the output and its log-sum-exp in base e, in the work dtype (float32 below float64), as
        FlashAttention returns its ``softmax_lse``."""
        res, _ = self._run(q, k, v, opts)
        return self.forward(q, k, v, **opts), res["lse"]

    def backward(self, g, q, k, v, **opts):
        res, _ = self._run(q, k, v, opts, dO=g)
        return tuple(res[n] for n in ("dq", "dk", "dv", "dbias", "dsinks") if n in res)


def _empty_rows(prob):
    """``(*batch, Hq, L, 1)``: rows with no allowed key."""
    a = prob.allowed()
    if a is None:
        return np.zeros(prob.full_scores[:-1] + (1,), bool)
    return ~np.broadcast_to(a, prob.full_scores).any(axis=-1, keepdims=True)


_B = dict(arith="blas")

#: Honest kernels: each must pass everywhere.
HONEST = (
    Specimen("scale on the scores, divide", Member("s1", **_B)),
    Specimen("scale on q, reciprocal", Member("s2", scale_on="q", recip=True, **_B)),
    Specimen("scale on k", Member("s3", scale_on="k", **_B)),
    Specimen("sqrt(scale) on q and k", Member("s4", scale_on="sqrt", **_B)),
    Specimen("fixed-order sums", Member("s5", order="fma", **_B)),
    Specimen("plain: P normalised first", Member("s6", normalize="early", delta="probs", **_B)),
    Specimen("online softmax, blocks of 16", Member("s7", block=16, **_B)),
    Specimen("online softmax, blocks of 64, scale on q", Member("s8", block=64, scale_on="q", **_B)),
    Specimen("online softmax, blocks of 128, reciprocal", Member("s9", block=128, recip=True, **_B)),
    Specimen("exp off by 20 ulp (like exp_u20)", Member("exp_u20", exp_ulps=20.0, **_B)),
)

#: Wrong kernels, with the case that exposes each (a substring of a quick-suite case name).
MUTANTS = (
    (Specimen("scale * (1 + 1e-4)", Member("", scale_factor=1 + 1e-4, **_B)), "large-logits-L16"),
    (Specimen("scale off by 1%", Member("", scale_factor=1.01, **_B)), "plain-L8-S8"),
    (Specimen("float16 arithmetic", Member("", **_B), inner="float16"), "plain-L8-S8"),
    (Specimen("TF32 matmuls", Member("", tf32=True, **_B)), "plain-L8-S8"),
    (Specimen("NaN on fully masked rows", Member("", **_B), bug="nan_rows"), "masked-rows-L8"),
    (Specimen("zeros where NaN is asked", Member("", **_B), bug="zero_rows"), "masked-rows-nan"),
    (Specimen("causal off by one", Member("", **_B), bug="causal_off_by_one"), "causal-top_left-L7-S13"),
    (Specimen("top-left where bottom-right is asked", Member("", **_B), bug="top_left"),
     "causal-bottom_right-L7-S13"),
    (Specimen("softcap derivative missing", Member("", softcap_grad=False, **_B)), "softcap5"),
    (Specimen("constant output", Member("", **_B), bug="constant"), "plain-L8-S8"),
    (Specimen("output rows shuffled", Member("", **_B), bug="shuffled_rows"), "plain-L8-S8"),
    (Specimen("fp8 descales ignored", Member("", **_B), bug="no_descale"), "plain-L8-S8"),
)
