"""One :class:`Case` type: the named, deterministic attention problems of the whole harness.

A case is a frozen description -- shapes, a seed and the options -- and
``case.make_inputs(dtype)`` draws its inputs in float64 from the seed and
casts them, so every dtype sees the same problem up to its own rounding.
Conformance (:mod:`.conformance`), golden vectors (:mod:`.vectors`) and the
gradient self-check (:mod:`.selfcheck`) all take their problems from here:

* :func:`get_suite` -- the conformance and vector suites, ``"quick"`` (small
  shapes, every feature at least once, and keys up to S = 136) and ``"full"``
  (plus combinations and sizes up to L = S = 512);
* :func:`gradcheck_grid` -- tiny shapes (L, S <= 5) over every combination
  of options, for finite differences.

What a case declares is computed from what it is, in one place:
``option_names`` from the inputs it makes (in the vocabulary of
:data:`sdpa_ref.options.OPTION_NAMES`), and ``has_fully_masked_rows`` by
asking the reference which rows have no allowed key.

The suite is versioned: :data:`SUITE_VERSION` changes whenever a case is
added, removed or its inputs change, so golden vectors name what they hold.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from ..api import sdpa_forward
from ..options import ARRAY_OPTIONS, FUNCTION_OPTIONS, OPTION_NAMES, AttentionOptions
from ..policy import DEFAULT, is_default
from ..score_mod import ScoreMod
from ..transforms import SCORE_STAGES
from ..rounding import round_to
from .lowp import dequantized, is_fp8, quantize
from .suites import SUITE_VERSION, SUITES

__all__ = ["ARRAY_KINDS", "SUITE_VERSION", "SUITES", "Case", "get_suite", "grad_out_for", "tangents_for"]

#: The array inputs a case can draw (see :class:`Case`), in the order case names list them.
ARRAY_KINDS = ("mask", "masked_rows", "float_mask", "bias", "alibi", "lengths", "zero_kv", "dropout", "sinks",
               "gather", "topk", "q_offset")


@dataclass(frozen=True)
class Case:
    """One attention problem: shapes, seed, options.

    ``options`` holds the scalar options (names from
    :data:`~sdpa_ref.options.OPTION_NAMES`) as sorted ``(name, value)``
    pairs, and may hold a score function and a mask function
    (:data:`~sdpa_ref.options.FUNCTION_OPTIONS`: ``score_mod``, ``mask_mod``;
    then the reference is the float64 NumPy engines', as a score function has
    no double-double form, and the case cannot be written to a case file or
    golden vectors); ``arrays`` names the arrays to draw (the keys of
    :data:`ARRAY_KINDS`): a bool ``mask`` (``masked_rows``: every third row
    from row 1 fully False), a ``float_mask`` ``(batch, 1, L, S)``
    (with ``masked_rows``: -inf on those rows), a ``bias`` ``(Hq, L, S)``, ``alibi`` slopes, per-batch ``lengths``
    (``zero_kv``: the last batch entry has no key), ``dropout`` (an explicit
    keep mask), ``gather`` (top-k ``gather_kv_indices`` ``(batch, 1, L, K)``,
    ``K = ceil(S / 2)``, drawn from ``[-1, S)``: ``-1`` and repeats included;
    :meth:`gathered`), ``topk`` (FlashMLA's ``topk_length`` ``(batch, 1, L)``
    from ``[0, K]``, 0 and K included: only with ``gather``), ``q_offset``
    (one int per sequence, ``(batch)``, from ``[-L // 2, S)``: negative,
    zero and past ``S - L`` included; not with ``causal_alignment``). A case
    that names ``gather`` passes ``gather_kv_indices``, which only a kernel
    judged with ``layout="gathered"`` takes (:attr:`option_names` names it).
    """

    name: str
    L: int
    S: int
    E: int = 8
    Ev: int = 8
    Hq: int = 2
    Hkv: int = 2
    batch_q: Tuple[int, ...] = (2,)
    batch_kv: Tuple[int, ...] = (2,)
    seed: int = 0
    options: Tuple[Tuple[str, object], ...] = ()
    arrays: Tuple[str, ...] = ()
    logit_scale: float = 1.0

    def __post_init__(self):
        for k, f in self.options:
            if k in FUNCTION_OPTIONS and not callable(f) and not isinstance(f, ScoreMod):
                raise TypeError(f"`Case` option {k} should be a function, but got {type(f).__name__}")
        bad = [k for k, _ in self.options if (k not in OPTION_NAMES or k in ARRAY_OPTIONS)
               and k not in FUNCTION_OPTIONS]
        bad += [a for a in self.arrays if a not in ARRAY_KINDS]
        if "topk" in self.arrays and "gather" not in self.arrays:
            raise ValueError("`Case` arrays should name 'gather' beside 'topk' (topk_length counts each row's "
                             f"gather_kv_indices), but got {self.arrays}")
        if "q_offset" in self.arrays and dict(self.options).get("causal_alignment", "top_left") != "top_left":
            raise ValueError("`Case` should not set causal_alignment beside the 'q_offset' array (the offset replaces "
                             f"the alignment), but got {dict(self.options)['causal_alignment']!r}")
        if bad:
            raise ValueError(f"`Case` should name scalar options of {OPTION_NAMES} and arrays of "
                             f"{ARRAY_KINDS}, but got {bad}")

    @property
    def opts(self) -> Dict[str, object]:
        return dict(self.options)

    @property
    def option_names(self) -> frozenset:
        """The keyword names this case passes that an implementation must support (non-default ones)."""
        return _option_names(self)

    def has_fully_masked_rows(self, dtype="float64") -> bool:
        """Whether the reference has a row with no allowed key (query rows past ``q_len`` aside)."""
        return _has_fully_masked_rows(self, np.dtype(dtype).name)

    def grad_out(self, shape, dtype):
        """The case's seeded upstream gradient of ``shape`` in ``dtype`` (:func:`grad_out_for`)."""
        return grad_out_for(self, shape, dtype)

    def make_inputs(self, dtype="float64") -> Dict[str, object]:
        """``query``, ``key``, ``value`` in ``dtype`` plus every option of the case, as keyword arguments.

        At an fp8 dtype ``query``, ``key`` and ``value`` are quantized per (batch, kv-head) and come with
        ``q_descale``, ``k_descale`` and ``v_descale`` (float32, ``batch + (Hkv,)``), as FlashAttention 3 takes
        them; the problem's values are their products (:func:`~sdpa_ref.harness.lowp.dequantized`).
        """
        dt = np.dtype(dtype)
        rng = np.random.default_rng([self.seed, self.L, self.S, self.E])
        batch = np.broadcast_shapes(self.batch_q, self.batch_kv)
        q = rng.standard_normal(self.batch_q + (self.Hq, self.L, self.E)) * self.logit_scale
        k = rng.standard_normal(self.batch_kv + (self.Hkv, self.S, self.E))
        v = rng.standard_normal(self.batch_kv + (self.Hkv, self.S, self.Ev))
        if is_fp8(dt):                           # fp8: quantized per (batch, kv-head), with the descales
            (q8, qd), (k8, kd), (v8, vd) = (quantize(x, dt, self.Hkv) for x in (q, k, v))
            out: Dict[str, object] = {"query": q8, "key": k8, "value": v8, "q_descale": qd, "k_descale": kd,
                                      "v_descale": vd}
        else:
            out = {"query": round_to(q, dt), "key": round_to(k, dt), "value": round_to(v, dt)}
        out.update(self.opts)
        if self.Hq != self.Hkv:
            out["enable_gqa"] = True
        if "mask" in self.arrays or ("masked_rows" in self.arrays and "float_mask" not in self.arrays):
            m = rng.random(batch + (self.Hq, self.L, self.S)) < 0.8
            m[..., 0] = True                     # no row is empty by accident ...
            m[..., -1] = True                    # ... under either alignment
            if "masked_rows" in self.arrays:
                m[..., 1::3, :] = False          # every third row, from row 1, sees no key
            out["attn_mask"] = m
        if "float_mask" in self.arrays:
            fm = rng.standard_normal(batch + (1, self.L, self.S))
            if "masked_rows" in self.arrays:
                fm[..., 1::3, :] = -np.inf       # -inf over a whole row is fully masked too
            out["attn_mask"] = round_to(fm, dt)
        if "bias" in self.arrays:
            out["bias"] = round_to(rng.standard_normal((self.Hq, self.L, self.S)), dt)
        if "alibi" in self.arrays:
            out["alibi_slopes"] = round_to(np.linspace(0.05, 0.5, self.Hq), dt)
        n = batch[0] if batch else 1
        if "lengths" in self.arrays:
            out["q_lengths"] = np.maximum(1, self.L - np.arange(n) * max(1, self.L // 3)).astype(np.int64)
            out["kv_lengths"] = np.maximum(1, self.S - (np.arange(n)[::-1]) * max(1, self.S // 4)).astype(np.int64)
        if "zero_kv" in self.arrays:
            out["kv_lengths"] = np.where(np.arange(n) == n - 1, 0, self.S).astype(np.int64)
        if not batch:
            for name in ("q_lengths", "kv_lengths"):
                if name in out:
                    out[name] = out[name][0]
        if "dropout" in self.arrays:
            p = float(self.opts.get("dropout_p", 0.2))
            out["dropout_p"] = p
            out["dropout_mask"] = rng.random(batch + (self.Hq, self.L, self.S)) >= p
        if "sinks" in self.arrays:               # one logit per head, float32 as the kernels keep them (float64
            s = rng.uniform(-1.0, 3.0, self.Hq)  # in float64); the last head has none when there are several
            if self.Hq > 1:
                s[-1] = -np.inf
            out["sinks"] = s.astype(np.float64 if dt == np.float64 else np.float32)
        if "gather" in self.arrays:              # its own stream: the other arrays stay the case's
            g = np.random.default_rng([self.seed, self.L, self.S, self.E, 1])
            K = max(1, -(-self.S // 2))
            out["gather_kv_indices"] = g.integers(-1, self.S, batch + (1, self.L, K))
            if "topk" in self.arrays:            # drawn after the indices: a case without it keeps its own
                t = g.integers(0, K + 1, batch + (1, self.L))
                t[..., 0] = 0                    # a row that reads no index ...
                t[..., -1] = K                   # ... and one that reads them all
                out["topk_length"] = t
        if "q_offset" in self.arrays:            # its own stream, as the indices
            o = np.random.default_rng([self.seed, self.L, self.S, self.E, 2])
            out["q_offset"] = o.integers(-(self.L // 2), self.S, batch).astype(np.int64)
            if n > 1:
                out["q_offset"].reshape(-1)[:2] = (-(self.L // 2), self.S - self.L)   # above and at bottom-right
        return out

    def gathered(self) -> "Case":
        """This case with top-k gathered key indices (the ``gather`` array), named ``...-gather``: what a
        sparse kernel judged with ``layout="gathered"`` computes."""
        if "gather" in self.arrays:
            return self
        return dataclasses.replace(self, name=self.name + "-gather", arrays=self.arrays + ("gather",))

    def options_json(self) -> dict:
        """The scalar options and the names of the drawn arrays, JSON-ready (a ``ValueError`` for a case with a
        score or mask function, which no file can hold)."""
        fns = [k for k, _ in self.options if k in FUNCTION_OPTIONS]
        if fns:
            raise ValueError(f"case {self.name!r} should have no {' or '.join(fns)} to be written to a file (a "
                             "function has no stored form), but has")
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.options}
        if self.Hq != self.Hkv:
            d["enable_gqa"] = True
        d["arrays"] = list(self.arrays)
        return d


@functools.lru_cache(maxsize=None)
def _option_names(case: Case) -> frozenset:
    defaults = AttentionOptions()
    inp = case.make_inputs()
    return frozenset(k for k, v in inp.items()
                     if (k in OPTION_NAMES and (k in ARRAY_OPTIONS or getattr(defaults, k) != v))
                     or (k in FUNCTION_OPTIONS and v is not None) or k == "gather_kv_indices")


@functools.lru_cache(maxsize=None)
def _has_fully_masked_rows(case: Case, dtype: str) -> bool:
    inp = dequantized(case.make_inputs(dtype))                # (bfloat16 and fp8: the engines take float64)
    _, res = sdpa_forward(inp.pop("query"), inp.pop("key"), inp.pop("value"), save_probs=False, **inp)
    empty = res.empty
    if res.padded is not None:
        empty = empty & ~res.padded
    return bool(np.any(empty))


def get_suite(suite: str = "quick") -> List[Case]:
    """The conformance cases of ``suite`` (``"quick"`` or ``"full"``), in a stable order."""
    if suite not in SUITES:
        raise ValueError(f"`suite` should be one of {SUITES!r}, but got {suite!r}")
    cases = _quick()
    if suite == "full":
        cases = cases + _full_extra()
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return cases


# ------------------------------------------------------------ suite cases


def _case(L, S, *, E=8, Ev=8, Hq=2, Hkv=2, batch_q=(2,), batch_kv=(2,), seed=0, arrays=(), logit_scale=1.0,
          prefix=None, **options):
    parts = [prefix] if prefix else []
    if Hq != Hkv:
        parts.append("mqa" if Hkv == 1 else "gqa")
    if batch_q != batch_kv:
        parts.append("bcast")
    parts += [a.replace("_", "-") for a in ARRAY_KINDS if a in arrays]
    if options.get("is_causal"):
        parts.append("causal")
    if options.get("window") is not None:
        parts.append("window" + "".join("_" + ("inf" if b is None else str(b)) for b in options["window"]))
    if options.get("causal_alignment", "top_left") != "top_left" or options.get("is_causal") \
            or options.get("window") is not None:
        parts.append(options.get("causal_alignment", "top_left"))
    for st in SCORE_STAGES:                                  # the score stages' numeric options (softcap)
        if st.elementwise and st.judged and options.get(st.option) is not None:
            parts.append(f"{st.option}{options[st.option]:g}")
    if options.get("scale") is not None:
        parts.append(f"scale{options['scale']:g}")
    if not is_default(options.get("fully_masked", DEFAULT)):
        parts.append(options["fully_masked"])
    if options.get("alibi_mode", "flash") != "flash":
        parts.append(options["alibi_mode"])
    if logit_scale != 1.0:
        parts.append("large-logits")
    if Ev != E:
        parts.append(f"Ev{Ev}")
    parts.append(f"L{L}-S{S}")
    return Case(name="-".join(parts), L=L, S=S, E=E, Ev=Ev, Hq=Hq, Hkv=Hkv, batch_q=batch_q, batch_kv=batch_kv,
                seed=seed, options=tuple(sorted(options.items())), arrays=tuple(arrays), logit_scale=logit_scale)


def _quick() -> List[Case]:
    br = "bottom_right"
    return [
        _case(8, 8, prefix="plain"),
        _case(5, 11, prefix="plain"),
        _case(11, 5, prefix="plain"),
        _case(6, 6, Ev=12, prefix="plain"),
        _case(4, 7, batch_q=(3, 2), batch_kv=(1, 2), prefix="plain"),
        _case(1, 1, E=1, Ev=1, batch_q=(), batch_kv=(), prefix="tiny"),
        _case(6, 9, Hq=4, Hkv=2),
        _case(6, 9, Hq=4, Hkv=1),
        _case(7, 13, Hq=4, Hkv=2, is_causal=True, causal_alignment=br),
        _case(7, 9, arrays=("mask",)),
        _case(7, 9, arrays=("bias",)),
        _case(7, 9, arrays=("mask", "bias")),
        _case(7, 13, is_causal=True),
        _case(7, 13, is_causal=True, causal_alignment=br),
        _case(13, 7, is_causal=True),
        _case(13, 7, is_causal=True, causal_alignment=br),        # rows 0..5 see no key
        _case(12, 12, window=(3, 0)),
        _case(9, 14, window=(2, 2), causal_alignment=br),
        _case(10, 10, softcap=5.0),
        _case(10, 10, arrays=("alibi",), is_causal=True, causal_alignment=br),
        _case(9, 12, arrays=("lengths",)),
        _case(9, 12, arrays=("lengths",), is_causal=True, causal_alignment=br),
        _case(8, 8, arrays=("masked_rows",)),
        _case(8, 8, arrays=("masked_rows",), fully_masked="nan"),
        _case(8, 8, arrays=("masked_rows",), fully_masked="uniform"),
        _case(16, 16, logit_scale=20.0),
        _case(16, 16, logit_scale=20.0, softcap=30.0),
        _case(8, 10, arrays=("dropout",), dropout_p=0.2),
        _case(6, 8, scale=0.3),
        _case(24, 24, E=16, Ev=16, Hq=4, Hkv=2, arrays=("mask", "bias", "alibi", "lengths"), is_causal=True,
              causal_alignment=br, window=(6, None), softcap=8.0, prefix="all"),
    ] + _self_attention() + _past_a_block()


def _self_attention() -> List[Case]:
    """Plain self-attention as most kernels are first written: L = S, Hq = Hkv, no option but ``is_causal``.

    At the head dims kernels use (64, 128) and at odd sizes (two tokens, L = 37, E = 7, three heads, no batch
    dim, two batch dims), with large logits once; with and without ``is_causal`` (for L = S the two
    alignments agree, so no ``causal_alignment`` is passed), so a causal-only kernel is judged on ten cases
    and a non-causal one on six, with no case of its own written. (Not L = S = 1: there dq and dk are exactly 0,
    so the rule's floor is 0 while a kernel's ``D = rowsum(dO * O)`` leaves a rounding; ``tiny`` has E = 1.)
    """
    shapes = [  # (L, E, Hq = Hkv, batch, logit_scale), each with and without is_causal
        (16, 64, 2, (2,), 1.0), (12, 128, 2, (2,), 1.0), (37, 64, 3, (1,), 1.0), (5, 7, 2, (2,), 1.0),
        (24, 64, 2, (1,), 20.0), (2, 64, 2, (2,), 1.0),
    ]
    causal_only = [(64, 64, 2, (1,), 1.0), (33, 128, 1, (1,), 1.0), (3, 64, 2, (), 1.0), (9, 64, 2, (3, 2), 1.0)]
    grid = [(L, E, H, batch, ls, {}) for L, E, H, batch, ls in shapes]
    grid += [(L, E, H, batch, ls, {"is_causal": True}) for L, E, H, batch, ls in shapes + causal_only]
    grid.append((16, 64, 2, (2,), 1.0, {"is_causal": True, "scale": 0.1}))
    out = []
    for L, E, H, batch, ls, opts in grid:
        c = _case(L, L, E=E, Ev=E, Hq=H, Hkv=H, batch_q=batch, batch_kv=batch, logit_scale=ls, prefix="self", **opts)
        name = c.name.replace("-top_left", "") + f"-E{E}-H{H}-b{'x'.join(map(str, batch)) or '0'}"
        out.append(dataclasses.replace(c, name=name))
    return out


def _past_a_block() -> List[Case]:
    """Keys past a block: S = 128 for every kernel (no option), and a causal L = S = 136 (a tail at 16, 64, 128)."""
    causal = _case(136, 136, E=64, Ev=64, Hq=1, Hkv=1, batch_q=(1,), batch_kv=(1,), is_causal=True, prefix="self")
    return [_case(16, 128, E=64, Ev=64, prefix="long"),
            dataclasses.replace(causal, name=causal.name.replace("-top_left", "") + "-E64-H1-b1")]


def _full_extra() -> List[Case]:
    br = "bottom_right"
    extra = []
    for L, S in ((64, 64), (128, 96), (96, 128), (512, 512)):
        extra.append(_case(L, S, E=64, Ev=64, Hq=4, Hkv=2, batch_q=(1,), batch_kv=(1,), prefix="big"))
        extra.append(_case(L, S, E=64, Ev=64, Hq=4, Hkv=2, batch_q=(1,), batch_kv=(1,), is_causal=True,
                           causal_alignment=br, prefix="big"))
    extra += [
        _case(256, 256, E=64, Ev=32, batch_q=(1,), batch_kv=(1,), window=(32, 32), causal_alignment=br,
              prefix="big"),
        _case(256, 256, E=64, Ev=64, batch_q=(1,), batch_kv=(1,), softcap=20.0, arrays=("alibi",), prefix="big"),
        _case(200, 300, E=32, Ev=32, batch_q=(3,), batch_kv=(3,), arrays=("lengths", "bias"), is_causal=True,
              causal_alignment=br, prefix="big"),
        _case(128, 128, E=64, Ev=64, batch_q=(1,), batch_kv=(1,), logit_scale=20.0, prefix="big"),
        _case(64, 64, E=32, Ev=32, arrays=("dropout",), dropout_p=0.1, prefix="big"),
        _case(12, 20, Hq=6, Hkv=3, arrays=("mask", "bias"), is_causal=True),
        _case(20, 12, Hq=6, Hkv=3, arrays=("mask",), window=(4, 1), causal_alignment=br),
        _case(15, 15, arrays=("masked_rows", "bias"), fully_masked="nan"),
        _case(15, 15, arrays=("masked_rows", "bias"), fully_masked="uniform"),
        _case(15, 15, arrays=("masked_rows", "dropout"), dropout_p=0.3),
        _case(10, 17, arrays=("lengths",), window=(2, 3), causal_alignment=br, softcap=3.0),
        _case(17, 10, arrays=("alibi", "mask"), is_causal=True),
        _case(15, 15, Hq=4, Hkv=2, arrays=("masked_rows", "sinks"), is_causal=True),
        _case(9, 33, arrays=("bias", "lengths", "sinks"), softcap=5.0),
    ] + _issue_42()
    return extra


def _issue_42() -> List[Case]:
    """The peers' options beyond the classic ones: a per-sequence ``q_offset`` (with causal, with a window and
    ALiBi, with lengths), cuDNN's signed ALiBi (``alibi_mode="cudnn"``: with no mask, and a two-sided window
    bottom-right, where it and FlashAttention's differ by more than a row's constant; under causal the outputs
    agree) and FlashMLA's ``topk_length`` with top-k indices (only ``layout="gathered"`` takes them)."""
    br = "bottom_right"
    return [
        _case(9, 14, arrays=("q_offset",), is_causal=True),
        _case(11, 11, Hq=4, Hkv=2, arrays=("alibi", "q_offset"), window=(3, 2)),
        _case(10, 16, arrays=("lengths", "q_offset"), is_causal=True, softcap=4.0),
        _case(10, 12, arrays=("alibi",), alibi_mode="cudnn"),
        _case(12, 9, Hq=4, Hkv=2, arrays=("alibi", "lengths"), window=(4, 3), causal_alignment=br,
              alibi_mode="cudnn"),
        _case(12, 20, arrays=("gather", "topk")),
        _case(14, 14, Hq=4, Hkv=2, arrays=("gather", "topk", "q_offset"), is_causal=True),
    ]


def grad_out_for(case: Case, shape, dtype):
    """The seeded upstream gradient of a case (dtype-free: drawn in float64, then cast)."""
    rng = np.random.default_rng([case.seed, 7, case.L, case.S])
    return round_to(rng.standard_normal(shape), dtype)


def tangents_for(case: Case, q, k, v):
    """The seeded tangents ``(dq, dk, dv)`` of the JVP check, float64 (cast to the test dtype by the caller)."""
    rng = np.random.default_rng([case.seed, 11, case.L, case.S])
    return tuple(rng.standard_normal(a.shape) for a in (q, k, v))
