"""A named, versioned, deterministic suite of attention cases.

Each :class:`Case` is a frozen description -- shapes, a dtype-free seed and
the options -- with a stable name such as ``gqa-causal-bottom_right-L7-S13``.
``case.make_inputs(dtype)`` draws the inputs in float64 from the seed and
casts them, so every dtype sees the same problem up to its own rounding.

Two suites:

* ``"quick"`` -- small shapes (L, S <= 24), every feature at least once;
  under a second on the reference.
* ``"full"`` -- the quick cases plus combinations and moderately large
  sizes, up to L = S = 512.

The suite is versioned: :data:`SUITE_VERSION` changes whenever a case is
added, removed or its inputs change, so golden vectors name what they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

__all__ = ["SUITE_VERSION", "SUITES", "OPTION_NAMES", "Case", "get_suite"]

#: Bumped whenever the cases or their inputs change.
SUITE_VERSION = "1"
SUITES = ("quick", "full")

#: The keyword names an implementation under test may be called with.
OPTION_NAMES = (
    "attn_mask", "is_causal", "scale", "enable_gqa", "bias", "causal_alignment", "window", "softcap",
    "alibi_slopes", "q_lengths", "kv_lengths", "dropout_p", "dropout_mask", "fully_masked",
)


@dataclass(frozen=True)
class Case:
    """One attention problem: shapes, seed, options.

    ``options`` holds the scalar options (``is_causal``, ``causal_alignment``,
    ``window``, ``softcap``, ``scale``, ``fully_masked``, ``dropout_p``) as
    sorted ``(name, value)`` pairs; ``arrays`` names the array inputs to draw:
    ``"mask"`` (bool attn_mask), ``"bias"``, ``"alibi"``, ``"lengths"``,
    ``"dropout"`` (an explicit keep mask) and ``"masked_rows"`` (some rows of
    the bool mask fully False).
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
    tags: Tuple[str, ...] = field(default=(), compare=False)

    @property
    def opts(self) -> Dict[str, object]:
        return dict(self.options)

    @property
    def option_names(self) -> set:
        """The keyword names this case passes (what an implementation must support)."""
        names = {k for k, v in self.options if not _is_default(k, v)}
        if self.Hq != self.Hkv:
            names.add("enable_gqa")
        amap = {"mask": "attn_mask", "masked_rows": "attn_mask", "bias": "bias", "alibi": "alibi_slopes",
                "dropout": "dropout_mask"}
        for a in self.arrays:
            if a == "lengths":
                names |= {"q_lengths", "kv_lengths"}
            elif a == "dropout":
                names |= {"dropout_mask", "dropout_p"}
            else:
                names.add(amap[a])
        return names

    @property
    def has_fully_masked_rows(self) -> bool:
        return "masked_rows" in self.arrays or self.opts.get("fully_masked", "zero") != "zero"

    def make_inputs(self, dtype="float64") -> Dict[str, object]:
        """``query``, ``key``, ``value`` in ``dtype`` plus every option of the case, as keyword arguments."""
        dt = np.dtype(dtype)
        rng = np.random.default_rng([self.seed, self.L, self.S, self.E])
        batch = np.broadcast_shapes(self.batch_q, self.batch_kv)
        q = rng.standard_normal(self.batch_q + (self.Hq, self.L, self.E)) * self.logit_scale
        k = rng.standard_normal(self.batch_kv + (self.Hkv, self.S, self.E))
        v = rng.standard_normal(self.batch_kv + (self.Hkv, self.S, self.Ev))
        out: Dict[str, object] = {"query": q.astype(dt), "key": k.astype(dt), "value": v.astype(dt)}
        out.update(self.opts)
        if self.Hq != self.Hkv:
            out["enable_gqa"] = True
        if "mask" in self.arrays or "masked_rows" in self.arrays:
            m = rng.random(batch + (self.Hq, self.L, self.S)) < 0.8
            m[..., 0] = True
            m[..., -1] = True
            if "masked_rows" in self.arrays:
                m[..., 1::3, :] = False          # every third row, from row 1, sees no key
            out["attn_mask"] = m
        if "bias" in self.arrays:
            out["bias"] = rng.standard_normal((self.Hq, self.L, self.S)).astype(dt)
        if "alibi" in self.arrays:
            out["alibi_slopes"] = np.linspace(0.05, 0.5, self.Hq).astype(dt)
        if "lengths" in self.arrays:
            n = batch[0] if batch else 1
            out["q_lengths"] = np.maximum(1, self.L - np.arange(n) * max(1, self.L // 3)).astype(np.int64)
            out["kv_lengths"] = np.maximum(1, self.S - (np.arange(n)[::-1]) * max(1, self.S // 4)).astype(np.int64)
            if not batch:
                out["q_lengths"], out["kv_lengths"] = out["q_lengths"][0], out["kv_lengths"][0]
        if "dropout" in self.arrays:
            p = float(self.opts.get("dropout_p", 0.2))
            out["dropout_p"] = p
            out["dropout_mask"] = rng.random(batch + (self.Hq, self.L, self.S)) >= p
        return out

    def options_json(self) -> dict:
        """The scalar options and the names of the drawn arrays, JSON-ready."""
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.options}
        if self.Hq != self.Hkv:
            d["enable_gqa"] = True
        d["arrays"] = list(self.arrays)
        return d


def get_suite(suite: str = "quick") -> List[Case]:
    """The cases of ``suite`` (``"quick"`` or ``"full"``), in a stable order."""
    if suite not in SUITES:
        raise ValueError(f"`suite` should be one of {SUITES!r}, but got {suite!r}")
    cases = _quick()
    if suite == "full":
        cases = cases + _full_extra()
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return cases


# ------------------------------------------------------------------ building


def _is_default(k, v):
    return {"is_causal": False, "causal_alignment": "top_left", "window": None, "softcap": None, "scale": None,
            "fully_masked": "zero", "dropout_p": 0.0}.get(k, object()) == v


def _case(L, S, *, E=8, Ev=8, Hq=2, Hkv=2, batch_q=(2,), batch_kv=(2,), seed=0, arrays=(), logit_scale=1.0,
          prefix: Optional[str] = None, **options):
    parts = []
    if prefix:
        parts.append(prefix)
    if Hq != Hkv:
        parts.append("mqa" if Hkv == 1 else "gqa")
    if batch_q != batch_kv:
        parts.append("bcast")
    for a in ("mask", "masked_rows", "bias", "alibi", "lengths", "dropout"):
        if a in arrays:
            parts.append({"masked_rows": "masked-rows", "mask": "mask"}.get(a, a))
    if options.get("is_causal"):
        parts.append("causal")
    if options.get("window") is not None:
        w = options["window"]
        parts.append("window" + "".join("_" + ("inf" if b is None else str(b)) for b in w))
    if options.get("causal_alignment", "top_left") != "top_left" or (options.get("is_causal") or
                                                                     options.get("window") is not None):
        parts.append(options.get("causal_alignment", "top_left"))
    if options.get("softcap") is not None:
        parts.append(f"softcap{options['softcap']:g}")
    if options.get("scale") is not None:
        parts.append(f"scale{options['scale']:g}")
    if options.get("fully_masked", "zero") != "zero":
        parts.append(options["fully_masked"])
    if logit_scale != 1.0:
        parts.append("large-logits")
    if Ev != E:
        parts.append(f"Ev{Ev}")
    parts.append(f"L{L}-S{S}")
    name = "-".join(parts)
    opts = tuple(sorted((k, v) for k, v in options.items()))
    return Case(name=name, L=L, S=S, E=E, Ev=Ev, Hq=Hq, Hkv=Hkv, batch_q=batch_q, batch_kv=batch_kv, seed=seed,
                options=opts, arrays=tuple(arrays), logit_scale=logit_scale)


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
    ]


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
    ]
    return extra
