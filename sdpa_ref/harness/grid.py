"""The finite-difference grid: every option, alone and combined, on tiny shapes, for the self-check and the
gradient tests (:func:`gradcheck_grid`)."""

from __future__ import annotations

import itertools
from typing import List

from ..policy import DEFAULT, FULLY_MASKED_POLICIES, emulates_peer, is_default
from ..transforms import SCORE_STAGES
from .cases import ARRAY_KINDS, Case

__all__ = ["gradcheck_grid"]


# name -> (batch_q, batch_kv, L, S, E, Ev)
_GRID_SHAPES = {
    "L=S": ((2,), (2,), 4, 4, 3, 2),
    "L<S": ((2,), (2,), 3, 5, 4, 3),
    "L>S": ((2,), (2,), 5, 3, 2, 3),
    "bcast": ((2,), (1,), 3, 4, 3, 2),
}

# the policies that state a rule for a row with no allowed key; one that reproduces a peer's algorithm is held to
# that algorithm written out instead (tests/test_policy.py)
_RULE_POLICIES = tuple(p for p in FULLY_MASKED_POLICIES if not emulates_peer(p))


def _grid_case(shape, *, gqa=False, dropout=False, arrays=(), **options):
    bq, bkv, L, S, E, Ev = _GRID_SHAPES[shape]
    arrays = tuple(arrays) + (("dropout",) if dropout else ())
    if dropout:
        options["dropout_p"] = 0.3
    label = {"mask": "mask=bool", "float_mask": "mask=float", "masked_rows": None, "zero_kv": "kv_len=0",
             "dropout": None}
    parts = [shape] + [label.get(a, a) for a in ARRAY_KINDS if a in arrays and label.get(a, a)]
    br = options.get("causal_alignment") == "bottom_right"
    if options.get("is_causal"):
        parts.append("causal" + ("-br" if br else ""))
    if options.get("window") is not None:
        parts.append("window=(" + ",".join("-" if b is None else str(b) for b in options["window"]) + ")"
                     + ("-br" if br else ""))
    if br and not (options.get("is_causal") or options.get("window") is not None):
        parts.append("bottom_right")
    if options.get("alibi_mode", "flash") != "flash":
        parts.append(f"alibi_mode={options['alibi_mode']}")
    for k in _stage_options():
        if options.get(k) is not None:
            parts.append(f"{k}={options[k]:g}")
    if gqa:
        parts.append("gqa")
    if dropout:
        parts.append("dropout")
    policy = options.get("fully_masked", DEFAULT)
    if not is_default(policy) or "masked_rows" in arrays:
        parts.append(f"fully_masked={policy}")
    return Case(name=" ".join(parts), L=L, S=S, E=E, Ev=Ev, Hq=4 if gqa else 2, Hkv=2, batch_q=bq, batch_kv=bkv,
                options=tuple(sorted(options.items())), arrays=arrays)


def _stage_options():
    """The options of the score stages the grid draws (:data:`sdpa_ref.transforms.SCORE_STAGES`: the judged
    element-wise ones, whose option is a number)."""
    return [st.option for st in SCORE_STAGES if st.elementwise and st.judged and st.examples]


def _stage_cases():
    """Each such stage with its first example value, alone and with a bias under causal (softcap: 1.5)."""
    return [case for st in SCORE_STAGES if st.option in _stage_options()
            for case in ({st.option: st.examples[0]}, dict({st.option: st.examples[0]}, arrays=("bias",),
                                                             is_causal=True))]


def gradcheck_grid(quick: bool = False) -> List[Case]:
    """The self-check's grid of tiny cases; ``quick`` keeps a covering subset (see the CLI's ``--quick``).

    A core product of shapes x no / bool / float mask x causal x GQA x dropout;
    every ``fully_masked`` policy on inputs with fully masked rows; the
    variants of FlashAttention, JAX and xformers; and rows emptied by
    alignment, a window or a zero length, under each policy. ``quick`` keeps
    the core cases where GQA and dropout go together and causal goes with the
    mask kind, and every other variant (all those with a non-default policy).
    """
    masks = {"none": (), "bool": ("mask",), "float": ("float_mask",)}
    core = [_grid_case(s, arrays=masks[m], is_causal=c, gqa=g, dropout=d)
            for s, m, c, g, d in itertools.product(_GRID_SHAPES, masks, (False, True), (False, True),
                                                   (False, True))]
    rows = {"bool": ("masked_rows",), "float": ("float_mask", "masked_rows")}
    masked = [_grid_case(s, arrays=rows[m], gqa=g, dropout=d, fully_masked=p)
              for s, m, p, g, d in itertools.product(("L=S", "L>S"), rows, _RULE_POLICIES,
                                                     (False, True), (False, True))]
    br = "bottom_right"
    base = [
        dict(arrays=("bias",)), dict(arrays=("mask", "bias")), dict(arrays=("float_mask", "bias")),
        dict(is_causal=True, causal_alignment=br),
        dict(window=(2, 1)), dict(window=(2, 1), causal_alignment=br), dict(window=(None, 1), causal_alignment=br),
        dict(window=(1, None)), dict(window=(1, 0), is_causal=True, causal_alignment=br),
        *_stage_cases(),
        dict(arrays=("alibi",)), dict(arrays=("alibi",), causal_alignment=br),
        dict(arrays=("alibi",), is_causal=True, causal_alignment=br),
        dict(arrays=("lengths",)), dict(arrays=("lengths",), causal_alignment=br, is_causal=True),
        dict(arrays=("lengths",), window=(1, 1), causal_alignment=br),
        dict(arrays=("mask", "bias", "alibi", "lengths"), is_causal=True, causal_alignment=br, window=(3, None),
             softcap=2.0),
    ]
    variants = [_grid_case(shape, gqa=gd, dropout=gd, **dict(opts))
                for shape in ("L<S", "L>S", "bcast") for opts in base for gd in (False, True)]
    emptied = [dict(shape="L>S", is_causal=True, causal_alignment=br),       # rows i < L - S see no key
               dict(shape="L>S", window=(0, 0)),                             # rows i >= S see no key
               dict(shape="L=S", arrays=("zero_kv",)),                       # a batch entry with no keys
               dict(shape="L>S", arrays=("lengths",), is_causal=True, causal_alignment=br)]
    for opts, policy, gd in itertools.product(emptied, _RULE_POLICIES, (False, True)):
        variants.append(_grid_case(gqa=gd, dropout=gd, fully_masked=policy, **dict(opts)))
    # the peers' options of issue 42: a per-sequence query offset (rows above every key included) and cuDNN's
    # signed ALiBi (without causal, where it differs from FlashAttention's). Not topk_length: the self-check
    # broadcasts its inputs over a new leading axis, which top-k indices refuse (tests/test_masks.py holds
    # topk_length to central differences)
    peers = [dict(shape="L<S", arrays=("q_offset",), is_causal=True),
             dict(shape="L>S", arrays=("q_offset",), is_causal=True),
             dict(shape="bcast", arrays=("alibi", "q_offset"), window=(1, 1)),
             dict(shape="L<S", arrays=("alibi",), alibi_mode="cudnn"),
             dict(shape="L>S", arrays=("alibi", "lengths"), window=(2, 1), alibi_mode="cudnn")]
    for opts, gd in zip(peers, itertools.cycle((False, True))):
        variants.append(_grid_case(gqa=gd, dropout=gd, **opts))
    cases = core + masked + variants
    if quick:
        keep = []
        for i, c in enumerate(cases):
            gqa, drop = c.Hq != c.Hkv, "dropout" in c.arrays
            if i < len(core):
                if gqa == drop and c.opts.get("is_causal", False) == ("float_mask" not in c.arrays):
                    keep.append(c)
            elif gqa == drop and (i % 2 == 0 or not is_default(c.opts.get("fully_masked", DEFAULT))):
                keep.append(c)
        cases = keep
    return cases
