r"""The split-KV schedule: partial results over splits of the keys, merged by their normalisers.

``method="split"`` (or ``num_splits=`` / ``split_bounds=``) lands here. A decode kernel (Flash-Decoding,
FlashAttention's ``num_splits``, FlashInfer, FlashMLA) cuts each sequence's keys into splits, attends to each
split alone -- an output ``out_i`` normalised over its own keys and their log-sum-exp ``lse_i`` (``(0, -inf)``
for a split with no allowed key) -- and merges them (:func:`sdpa_ref.merge_attention`; :func:`partials` gives
those parts)::

    for each split i, keys [b_i, b_{i+1}) of the sequence:
        m_i, l_i, acc_i = the tiled engine's online softmax over those keys      (tiled.key_pass)
    (m, l, alpha) = combine_in(m_*, l_*)              m = max m_i, alpha_i = e^(m_i - m), l = sum alpha_i l_i
    out           = sum_i alpha_i acc_i / l           the merge of merge_attention, w_i = alpha_i l_i / l
    then the sinks close the normaliser and the fully-masked policy fills the rows with no key (tiled.Rows).

The merge is ``merge_attention``'s, with its weights ``w_i = e^(lse_i - lse)`` taken from the parts' ``(m_i,
l_i)`` rather than from their rounded log-sum-exps: ``lse_i = m_i + log l_i`` keeps ``log l_i`` only to the ulp
of ``m_i``, which is 16 at scores of ``1e17`` (a weight ``e^16`` off), so a merge by the LSEs is exact only up
to scores of a few hundred. The sink is no split's: the merge is over the keys, and the sink joins the merged
normaliser as it joins a row's in every engine. The result equals the unsplit one to rounding, on every option.
The backward and the JVP are the tiled engine's, which recompute each row's normaliser from the scores they
recompute (a score recomputed in another block shape may be an ulp off the forward's).

Under ``precision="reproducible"`` a split is a schedule and the exact value has none: the API runs the
reproducible engine on the whole problem (the unsplit results, bit for bit, in every output and gradient), and
:func:`partials` runs it on each split's own problem (each part faithfully rounded).

``bounds`` are per sequence: an int array broadcastable to ``(*batch, n + 1)``, ``0`` first, non-decreasing,
the last at least the sequence's key count; split ``i`` holds the keys ``b_i <= j < b_{i+1}`` (its dense key
positions: the logical ones of a layout's sequence). ``num_splits=n`` gives each sequence ``n`` splits of
``ceil(kv_len / n)`` keys (the last ones shorter or empty), as FlashAttention sizes them up to its blocks.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from ..arith import NUMPY
from ..lse import combine_in
from ..normalize import keys_only
from . import tiled
from .blocks import Blocks, check_block_size, ranges as _ranges
from .contract import Forward

__all__ = ["MAX_EMPTY_SPLITS", "backward", "bounds", "forward", "jvp", "max_splits", "partials", "split_problem"]

backward, jvp = tiled.backward, tiled.jvp


#: Splits beyond the key count are empty; up to this many are allowed all the same, and no more, so that a huge
#: ``num_splits`` is a clear error before anything of its size is allocated.
MAX_EMPTY_SPLITS = 256


def max_splits(prob):
    """The most splits ``num_splits`` or ``split_bounds`` may ask for: ``max(S, MAX_EMPTY_SPLITS)``."""
    return max(prob.S, MAX_EMPTY_SPLITS)


def bounds(prob, num_splits=None, split_bounds=None):
    """The splits' bounds ``(*batch, n + 1)`` (int64) of ``num_splits`` or ``split_bounds`` (exactly one);
    every error names its argument."""
    if (num_splits is None) == (split_bounds is None):
        raise ValueError("`num_splits` or `split_bounds` should be given for the split-KV schedule (one of them), "
                         f"but got num_splits={num_splits!r} and split_bounds="
                         f"{'None' if split_bounds is None else 'an array'}")
    kv = np.broadcast_to(prob.S if prob.kv_lengths is None else prob.kv_lengths, prob.batch).astype(np.int64)
    if num_splits is not None:
        if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (numbers.Integral, np.integer)) \
                or not 1 <= int(num_splits) <= max_splits(prob):
            raise ValueError(f"`num_splits` should be a positive int of at most {max_splits(prob)} (the key count "
                             f"S={prob.S}, or {MAX_EMPTY_SPLITS} when that is fewer: more splits are only empty "
                             f"ones), but got {num_splits!r}")
        n = int(num_splits)
        chunk = -(-kv // n)
        b = np.minimum(chunk[..., None] * np.arange(n + 1), kv[..., None])
        b[..., -1] = prob.S
        return b
    b = np.asarray(split_bounds)
    if b.ndim >= 1 and b.shape[-1] - 1 > max_splits(prob):
        raise ValueError(f"`split_bounds` should hold at most {max_splits(prob)} splits (the key count S={prob.S}, "
                         f"or {MAX_EMPTY_SPLITS} when that is fewer), but got {b.shape[-1] - 1}")
    if b.dtype == bool or not np.issubdtype(b.dtype, np.integer) or b.ndim < 1 or b.shape[-1] < 2:
        raise ValueError("`split_bounds` should be integers (..., n + 1) with n >= 1 (split i holds the keys "
                         f"b[i] <= j < b[i + 1]), but got dtype {b.dtype} and shape {b.shape}")
    try:
        b = np.broadcast_to(b, prob.batch + b.shape[-1:]).astype(np.int64)
    except ValueError:
        raise ValueError(f"`split_bounds` should broadcast to the batch dims {prob.batch} + (n + 1,), but got "
                         f"shape {np.shape(split_bounds)}") from None
    if np.any(b[..., 0] != 0) or np.any(np.diff(b, axis=-1) < 0) or np.any(b[..., -1] < kv):
        raise ValueError("`split_bounds` should start at 0, not decrease, and end at or past each sequence's key "
                         f"count (S={prob.S}, or kv_lengths), so that every key is in one split, but got "
                         f"{np.asarray(split_bounds).tolist()}")
    return np.minimum(b, prob.S)


def split_problem(prob, b, i):
    """The problem of split ``i`` alone, and the dense key range to walk: the allowed set intersected with the
    split's keys ``b_i <= j < b_{i+1}`` per sequence (a bool mask over the keys), no extra logit and the ``"zero"``
    policy, so that a split without a key is ``(0, -inf)``. Its :func:`sdpa_ref.poison.forward_taint` is
    where the split's partial reads poison."""
    lo, hi = b[..., i, None], b[..., i + 1, None]
    j = np.arange(prob.S)
    keys = ((j >= lo) & (j < hi)).reshape(prob.batch + (1, 1, prob.S))
    mask = keys if prob.mask_bool is None else prob.mask_bool & keys
    mask.setflags(write=False)
    alone = keys_only(prob, mask_bool=mask, v_full=None,
                      options=dataclasses.replace(prob.options, fully_masked="zero"))
    return alone, (int(lo.min()) if lo.size else 0, int(hi.max(initial=0)))


def _parts(prob, i0, i1, b, block):
    """Per split, ``(m, l, acc, empty)`` of the rows ``[i0, i1)`` over its keys."""
    for i in range(b.shape[-1] - 1):
        alone, (k0, k1) = split_problem(prob, b, i)
        k0 = min(k0, k1) // block * block                     # on the grid of the blocks (a block mask's tiles)
        yield tiled.key_pass(alone, Blocks(alone), i0, i1, (k0, max(k0, k1)), block)


def _normalised(m, l, acc, empty):
    """A split's ``(out_i, lse_i)``: ``acc / l`` and ``m + log l``, ``(0, -inf)`` with no allowed key."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(empty, acc.dtype.type(0), acc / np.where(empty, 1, l))
        lse = np.where(empty, -np.inf, np.log(np.where(empty, 1, l)).real + m)
    return out, lse[..., 0]


def partials(prob, b, *, block_size="auto", forward=None):
    """``(out_parts, lse_parts)``, ``(n, *batch, Hq, L, Ev)`` and ``(n, *batch, Hq, L)``: each split's own
    normalised output and log-sum-exp over its keys alone, what a split-KV kernel writes before its combine
    (no sink, no policy: ``(0, -inf)`` where a split has no allowed key). ``forward``: another engine's forward
    run on each split's own problem (:func:`split_problem`) instead of the tiled key pass -- the reproducible
    engine's, so that each part is faithfully rounded and the same bits everywhere (``block_size`` unused)."""
    n = b.shape[-1] - 1
    lead = prob.batch + (prob.Hq, prob.L)
    if forward is not None:
        fwds = [forward(split_problem(prob, b, i)[0], save_probs=False) for i in range(n)]
        return (np.stack([f.out for f in fwds]).reshape((n,) + lead + (prob.v.shape[-1],)),
                np.stack([f.lse for f in fwds]).reshape((n,) + lead))
    block = check_block_size(block_size, prob)
    outs = np.zeros((n,) + lead + (prob.v.shape[-1],), dtype=prob.dtype)
    lses = np.full((n,) + lead, -np.inf, dtype=prob.dtype.type(0).real.dtype)
    for i0, i1 in _ranges(prob.L, block):
        for i, part in enumerate(_parts(prob, i0, i1, b, block)):
            outs[i, ..., i0:i1, :], lses[i, ..., i0:i1] = _normalised(*part)
    return outs, lses


def forward(prob, *, save_probs=False, block_size="auto", split_bounds=None) -> Forward:
    """The splits' partials merged (``split_bounds`` from :func:`bounds`); no ``P`` is kept, as in the tiled
    engine, whose backward and JVP read the merged normaliser."""
    block = check_block_size(block_size, prob)
    rows = tiled.Rows(prob)
    for i0, i1 in _ranges(prob.L, block):
        parts = list(_parts(prob, i0, i1, split_bounds, block))
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            m, l, alpha, empty = combine_in(NUMPY, [p[0] for p in parts], [p[1] for p in parts],
                                            [p[3] for p in parts])
            acc = sum(a * np.where(p[3], prob.dtype.type(0), p[2]) for a, p in zip(alpha, parts))
            out = acc / np.where(empty, 1, l)                       # the merge by (m_i, l_i), not by lse_i
        rows.close(i0, i1, m, l, out.astype(prob.dtype, copy=False), empty)
    return rows.forward()
