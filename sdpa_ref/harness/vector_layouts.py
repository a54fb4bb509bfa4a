"""Golden vectors as a varlen or paged kernel stores its sequences: ``sdpa-ref vectors DIR --layout
thd|paged|thd_paged``.

A layout set (format ``"4"``: format ``"3"`` and these; its manifest says ``"layout"``) holds, per case that has
a layout form (:func:`takes`), the arrays of :mod:`.storage` -- what :func:`~sdpa_ref.check_implementation` hands
a kernel with ``layout="thd"`` or ``"paged"`` -- and the reference in that layout:

``"thd"``
    ``query (total_q + 1, Hq, E)``, ``key``, ``value (total_k + 1, Hkv, E|Ev)``: the sequences one after the
    other, then one row no sequence uses (0); ``cu_seqlens_q``, ``cu_seqlens_k`` (int32, ``(B + 1,)``).
    ``out`` and ``grad_out`` as ``query``, ``lse`` ``(Hq, total_q + 1)`` (FlashAttention's; ``-inf`` on the
    unused row), ``dq``, ``dk``, ``dv`` as their inputs (0 on the unused rows).
``"paged"``
    ``query (B, L, Hq, E)``; ``key``, ``value`` a cache ``(pages, 16, Hkv, E|Ev)`` whose pages each sequence's
    ``block_table`` row (int32, ``(B, max_pages)``) names in a shuffled order, one page no table names, and
    ``cache_seqlens`` (int32, ``(B,)``) keys per sequence; ``out``, ``grad_out (B, L, Hq, Ev)``, ``lse
    (B, Hq, L)``, ``dq`` as ``query``, ``dk``, ``dv`` of the cache's shape (0 on slots no sequence uses).
``"thd_paged"``
    Packed queries against that cache (FlashAttention 3's ``flash_attn_with_kvcache`` with ``cu_seqlens_q``, 2's
    varlen ``block_table``, FlashInfer's paged prefill): ``query``, ``out``, ``grad_out``, ``dq`` and ``lse`` as
    in ``"thd"`` (with ``cu_seqlens_q``), ``key``, ``value``, ``dk``, ``dv``, ``cache_seqlens`` and
    ``block_table`` as in ``"paged"``. A case's ``q_lengths`` are its sequences' query counts, so cases with them
    have a form here, as in ``"thd"``.

``"gathered"``
    Every case of the suite with top-k ``gather_kv_indices`` (int64 ``(batch, 1, L, K)``, ``K = ceil(S / 2)``,
    drawn from ``[-1, S)``: ``-1`` names no key, a repeat counts once), named ``...-gather``; the other arrays
    are dense, as in a dense set (a sparse kernel takes the indices as ``(batch, L, K)``).

The reference is computed in the layout itself (``sdpa_forward(layout=...)``, ``precision="reproducible"``);
it equals the dense reference's entries moved, bit for bit (tested). The ``honest_*`` errors are the dense
case's: the layout moves entries, it changes no value. The sequences' lengths are the case's ``q_lengths`` and
``kv_lengths`` (not stored again). The other arrays -- ``alibi_slopes``, ``sinks``, ``q_offset`` -- are as in a
dense set.
"""

from __future__ import annotations

import json
from typing import Dict

import numpy as np

from ..api import sdpa_forward
from ..derivatives import sdpa_backward
from ..layouts import KVCache, Packed
from ..policy import averages_every_key
from .lowp import widen
from .storage import Storage

__all__ = ["LAYOUT_FORMAT_VERSION", "VECTOR_LAYOUTS", "in_layout", "layout_arrays", "takes"]

#: ``write_vectors(layout=)``: the dense layout (None), or one of these (``"gathered"``: every case with top-k
#: ``gather_kv_indices``, :meth:`.cases.Case.gathered`, its arrays dense).
VECTOR_LAYOUTS = ("thd", "paged", "thd_paged", "gathered")
#: The format of a layout set: format "3" plus the layout's arrays and the manifest's ``"layout"``.
LAYOUT_FORMAT_VERSION = "4"
#: The array kinds a case may draw and keep a layout form: per head, or the lengths the layout takes over.
_PER_SEQUENCE = frozenset({"lengths", "zero_kv", "sinks", "alibi", "q_offset"})


def in_layout(cases, layout):
    """The cases of a set in ``layout``: those with a form in it, each :meth:`~.cases.Case.gathered` for
    ``"gathered"``."""
    if layout == "gathered":
        return [c.gathered() for c in cases]
    return [c for c in cases if takes(c, layout)]


def takes(case, layout) -> bool:
    """Whether ``case`` has a form in ``layout``: one batch dim that query and key share, no array laid out as
    the dense scores (a mask, bias or dropout mask), not ``fully_masked="uniform"`` (its mean would count the
    padding), and for ``"paged"`` no ``q_lengths`` (a KV-cache kernel computes every query row)."""
    if case.batch_q != case.batch_kv or len(case.batch_q) != 1 or set(case.arrays) - _PER_SEQUENCE:
        return False
    if averages_every_key(case.opts.get("fully_masked")):
        return False
    return not (layout == "paged" and "lengths" in case.arrays)


def layout_arrays(arrays: Dict[str, np.ndarray], layout: str) -> Dict[str, np.ndarray]:
    """A dense vector file's arrays (inputs in the vectors' dtype, not bit patterns; the references; the honest
    errors) as ``layout`` stores them, its reference recomputed in the layout."""
    q, k, v = arrays["query"], arrays["key"], arrays["value"]
    lengths = {n: arrays[n] for n in ("q_lengths", "kv_lengths") if n in arrays}
    st = Storage(layout, q, k, v, lengths)
    out = {"query": st.query(q), "key": st.kv(k), "value": st.kv(v)}
    kw = st.kwargs()
    if layout == "thd":
        out.update(cu_seqlens_q=kw["cu_seqlens_q"], cu_seqlens_k=kw["cu_seqlens_k"])
        lay = Packed(kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"], kw["max_seqlen_k"])
    else:
        packed = {n: kw[n] for n in ("cu_seqlens_q", "max_seqlen_q") if n in kw}     # thd_paged
        out.update({n: kw[n] for n in ("cu_seqlens_q", "cache_seqlens", "block_table") if n in kw})
        lay = KVCache(cache_seqlens=kw["cache_seqlens"], block_table=kw["block_table"], **packed)
    for name in ("alibi_slopes", "sinks", "q_offset"):
        if name in arrays:
            out[name] = arrays[name]
    out["options_json"] = arrays["options_json"]
    opts = json.loads(arrays["options_json"].tobytes().decode("utf-8"))
    opts = {n: (tuple(x) if isinstance(x, list) else x) for n, x in opts.items() if n != "arrays"}
    x = widen({n: out[n] for n in ("query", "key", "value", "alibi_slopes", "sinks") if n in out})   # float64
    if "q_offset" in out:                                   # one int per sequence, as in the dense set
        x["q_offset"] = out["q_offset"]
    o, res = sdpa_forward(x.pop("query"), x.pop("key"), x.pop("value"), layout=lay, precision="reproducible",
                          **opts, **x)
    g = st.out(arrays["grad_out"])
    gr = sdpa_backward(res, g.astype(np.float64))
    out.update({"out": o, "lse": res.lse, "grad_out": g, "dq": gr.query, "dk": gr.key, "dv": gr.value})
    if gr.sinks is not None:
        out["dsinks"] = gr.sinks
    out.update({n: a for n, a in arrays.items() if n.startswith("honest_")})
    return out
