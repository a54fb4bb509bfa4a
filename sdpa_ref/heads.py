r"""The plain engine on the package's pool: its heads cut into chunks that run side by side.

``method="plain"`` is :mod:`sdpa_ref.attention`, written as the derivation reads, on the whole problem at
once. Here a problem whose every input is per head is cut into chunks of its leading ``(*batch, Hkv)`` index
(whole GQA groups), and each chunk runs those same functions on its heads alone, in the pool
(:func:`sdpa_ref._threads.run_all`): the forward and the double backward (:mod:`sdpa_ref.second_order`'s
plain schedule), the two that profiles showed on one core.

Every product and row reduction on a chunk is the one it is on all heads (NumPy's matmul runs one GEMM per
head; the softmax's reductions run along each row), so the bits do not depend on the cut or on the threads:
``tests/test_second_order.py`` holds both to the whole problem's, bit for bit. A problem with an input that is
not per head (a mask, bias, ALiBi, lengths, dropout, sinks, a score or mask function, softcap, top-k indices,
offsets, an input that was not finite) runs whole, as does a small one (:data:`PARALLEL_ENTRIES`), and every
problem when the pool has one thread or when the BLAS is not held to one (its own threads would then share the
cores with the pool's).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import attention
from ._threads import blas_is_held, num_threads, run_all
from .engines.contract import Forward, Grads
from .engines import fast
from .engines.blocks import key_spans, span_rows
from .policy import fills_past_allowed

__all__ = ["backward", "backward_jvp", "forward", "forward_spans", "jvp", "spans"]

#: Score entries (all heads) from which the plain engine runs its heads in the pool: below, the threads cost more
#: than they save.
PARALLEL_ENTRIES = 1 << 16
#: Score entries of one chunk's ``L x S`` arrays at most (8 MiB of float64), where a GQA group is no larger: the
#: double backward makes about fifteen of them a chunk, and smaller ones are served again from the memory the
#: last chunk freed rather than from fresh pages. ``sdpa_hvp`` at causal ``1x8x1024x64``, 2 threads, 6 rounds
#: paired: 417-578 ms (median 488, 100-363 ms of it in the kernel, faulting pages in) with chunks of two heads,
#: 422-466 ms (median 438, 39-88 ms in the kernel) with one.
CHUNK_ENTRIES = 1 << 20
#: Keys from which the double backward runs on the allowed set's key spans (:func:`spans`). Its fifteen or so
#: element-wise passes a score pay for the smaller products sooner than the fast engine's first order does
#: (:data:`sdpa_ref.engines.fast.SPAN_MIN_KEYS`): ``sdpa_hvp`` causal float64, 2 threads, 7 interleaved rounds,
#: whole rows against spans: 38.8 -> 32.4 ms at ``1x8x256x64``, 48.4 -> 43.2 ms at ``1x4x512x64``, 500 -> 313 ms
#: at ``1x8x1024x64``.
SPAN_MIN_KEYS = 256


def forward(prob, *, save_probs=True) -> Forward:
    """:func:`sdpa_ref.attention.forward`, each chunk of heads (:func:`head_chunks`) in the pool when the
    problem may be cut (:func:`per_head`): every array of the result is the chunks' results put in place."""
    chunks = head_chunks(prob) if per_head(prob) else None
    windows = forward_spans(prob)
    if chunks is None:
        return attention.forward(prob, save_probs=save_probs) if windows is None else \
            _forward_on_windows(windows, prob, save_probs)
    parts = [None] * len(chunks)

    def work(i):
        sub = _sub_problem(prob, chunks[i])
        parts[i] = attention.forward(sub, save_probs=save_probs) if windows is None else \
            _forward_on_windows(windows, sub, save_probs)

    run_all(work, range(len(chunks)))
    lead = prob.batch + (prob.Hq,)

    def whole(name):
        first = getattr(parts[0], name)
        if not isinstance(first, np.ndarray):
            return first                                    # None: no chunk has it
        out = np.empty(lead + first.shape[len(lead):], first.dtype)
        for idx, part in zip(chunks, parts):
            out[_full_index(prob, idx)] = getattr(part, name)
        return out
    return Forward(**{n: whole(n) for n in Forward._fields})


def backward(prob, fwd, dO, dlse=None):
    """:func:`sdpa_ref.attention.backward` (on the whole problem)."""
    return attention.backward(prob, fwd, dO, dlse)


def jvp(prob, fwd, dq=None, dk=None, dv=None, dbias=None, *, dv_full=None, dextra=None):
    """:func:`sdpa_ref.attention.jvp` (on the whole problem)."""
    return attention.jvp(prob, fwd, dq, dk, dv, dbias, dv_full=dv_full, dextra=dextra)


def backward_jvp(prob, fwd, dO, dlse, dq, dk, dv, db, ds, ddO, ddlse) -> Grads:
    """:func:`sdpa_ref.attention.backward_jvp`, each chunk of heads in the pool when the problem may be cut
    (:func:`per_head`, which also asks that no bias or extra-logit tangent is given), and on the allowed set's
    key spans (:func:`spans`) where it has them: each block of query rows against only the keys it may read."""
    args = (prob, fwd, dO, dlse, dq, dk, dv, db, ds, ddO, ddlse)
    chunks = head_chunks(prob) if per_head(prob, fwd, db, ds) else None
    windows = spans(prob, fwd, db)
    if chunks is None:
        return attention.backward_jvp(*args) if windows is None else _on_windows(windows, *args)
    batch, Hq, Hkv, G, L, S = prob.batch, prob.Hq, prob.Hkv, prob.G, prob.L, prob.S
    E, Ev = prob.q.shape[-1], prob.v.shape[-1]
    out = Grads(dq=np.empty(batch + (Hq, L, E), prob.dtype), dk=np.empty(batch + (Hkv, S, E), prob.dtype),
                dv=np.empty(batch + (Hkv, S, Ev), prob.dtype), dmask=None, dbias=None)
    grouped, full = batch + (Hkv,), batch + (Hq,)

    def work(idx):
        fidx = _full_index(prob, idx)
        f = fwd._replace(**{n: _cut(x, full, fidx, x.ndim - len(full)) for n, x in fwd._asdict().items()
                            if isinstance(x, np.ndarray)})
        a = (_sub_problem(prob, idx), f, _cut(dO, full, fidx, 2), _cut(dlse, full, fidx, 2),
             _cut(dq, grouped, idx, 3), _cut(dk, grouped, idx, 2), _cut(dv, grouped, idx, 2), None, None,
             _cut(ddO, full, fidx, 2), _cut(ddlse, full, fidx, 2))
        g = attention.backward_jvp(*a) if windows is None else _on_windows(windows, *a)
        out.dq[fidx], out.dk[idx], out.dv[idx] = g.dq, g.dk, g.dv

    run_all(work, chunks)
    return out


def spans(prob, fwd, dbias=None):
    """The windows ``(i0, i1, j0, j1)`` of the double backward, or None (the whole rows): the key spans of the
    allowed set (:func:`sdpa_ref.engines.blocks.key_spans`, blocks of :func:`~sdpa_ref.engines.blocks.span_rows`
    query rows, as the fast engine's), from :data:`SPAN_MIN_KEYS` keys. They depend on the shape and the mask
    only, never on the threads. Whole rows also where a row sum needs the whole matrix or a policy row is not 0
    past the spans: a float mask, a bias or its tangent, or a fully masked row (not padded) whose ``P`` the
    policy fills (:func:`sdpa_ref.policy.fills_past_allowed`)."""
    if prob.S < SPAN_MIN_KEYS or prob.mask_float is not None or prob.bias is not None or dbias is not None:
        return None
    if fills_past_allowed(prob.options.fully_masked, fwd.empty, prob.padded_rows()):
        return None
    summ = key_spans(prob.allowed(), prob.L, prob.S, span_rows(prob.L))
    return None if summ is None else summ.spans


def forward_spans(prob):
    """The windows of the forward (:func:`spans`' rule, known before the forward runs): where no row sum needs
    the whole matrix and no row the policy fills with a nonzero ``P`` can occur (the policy fills 0, or every
    row of the structural allowed set but the padded ones has a key; a float mask, which could empty a row,
    keeps whole rows), from the fast engine's :data:`~sdpa_ref.engines.fast.SPAN_MIN_KEYS`
    (``SPAN_MIN_KEYS_NARROW`` in a narrower compute dtype), below which the forward's smaller products cost more
    than they skip (``sdpa_hvp`` causal float64, one thread, 7 interleaved rounds, whole forward against
    windows: 63.4 -> 66.7 ms at ``1x4x512x64``, 657 -> 554 ms at ``1x8x1024x64``)."""
    if prob.S < (fast.SPAN_MIN_KEYS if np.dtype(prob.dtype).itemsize >= 8 else fast.SPAN_MIN_KEYS_NARROW):
        return None
    if prob.mask_float is not None or prob.bias is not None:
        return None
    allowed = prob.allowed()
    if allowed is None:
        return None
    keyless = ~np.logical_or.reduce(allowed, axis=-1, keepdims=True)        # rows with no allowed key
    if fills_past_allowed(prob.options.fully_masked, keyless, prob.padded_rows()):
        return None
    summ = key_spans(allowed, prob.L, prob.S, span_rows(prob.L))
    return None if summ is None else summ.spans


def _forward_on_windows(windows, prob, save_probs) -> Forward:
    """:func:`sdpa_ref.attention.forward` window by window: each row result put in its rows, ``P`` and the slope
    in their windows of zeros; the whole rows again where a row came out with no key and a policy that fills
    it past its window (a score function's ``-inf`` on every allowed key, a score that overflowed to ``-inf``:
    what the allowed set cannot foresee)."""
    out = {}
    for i0, i1, j0, j1 in windows:
        f = attention.forward(prob, save_probs=save_probs, rows=(i0, i1), cols=(j0, j1))
        for name, x in f._asdict().items():
            if not isinstance(x, np.ndarray):
                continue
            square = name in ("probs", "slope")
            at = -2 if square or x.ndim == len(prob.full_scores) else -1     # the row axis
            if name not in out:
                shape = list(x.shape)
                shape[at] = prob.L
                if square:
                    shape[-1] = prob.S
                out[name] = (np.zeros if square else np.empty)(tuple(shape), x.dtype)
            idx = (Ellipsis, slice(i0, i1), slice(j0, j1)) if square else \
                (Ellipsis, slice(i0, i1)) + (slice(None),) * (-1 - at)
            out[name][idx] = x
    if fills_past_allowed(prob.options.fully_masked, out["empty"], prob.padded_rows()):
        return attention.forward(prob, save_probs=save_probs)
    return Forward(**{n: out.get(n) for n in Forward._fields})


def _on_windows(windows, prob, fwd, dO, dlse, dq, dk, dv, db, ds, ddO, ddlse) -> Grads:
    """:func:`sdpa_ref.attention.backward_jvp` window by window: the rows' ``dq`` put in place, the windows' parts
    of ``dk``, ``dv`` and the extra logits' tangent added, one window after another in the order given."""
    batch, E, Ev = prob.batch, prob.q.shape[-1], prob.v.shape[-1]
    dq_t = np.empty(batch + (prob.Hq, prob.L, E), prob.dtype)
    dk_t = np.zeros(batch + (prob.Hkv, prob.S, E), prob.dtype)
    dv_t = np.zeros(batch + (prob.Hkv, prob.S, Ev), prob.dtype)
    dx = None
    for i0, i1, j0, j1 in windows:
        g = attention.backward_jvp(prob, fwd, dO, dlse, dq, dk, dv, db, ds, ddO, ddlse, rows=(i0, i1),
                                   cols=(j0, j1))
        dq_t[..., i0:i1, :] = g.dq
        dk_t[..., j0:j1, :] += g.dk
        dv_t[..., j0:j1, :] += g.dv
        if g.dextra is not None:
            dx = g.dextra if dx is None else dx + g.dextra
    return Grads(dq=dq_t, dk=dk_t, dv=dv_t, dmask=None, dbias=None, dextra=dx)


def per_head(prob, fwd=None, dbias=None, dextra=None):
    """Whether the plain engine may cut ``prob`` by heads and run them in the pool: large enough, more than one
    thread with the BLAS held, every input per head (and, for the double backward, the forward ``fwd`` without
    a slope or extra logits, and no bias or extra-logit tangent)."""
    if num_threads() == 1 or not blas_is_held() or int(np.prod(prob.full_scores)) < PARALLEL_ENTRIES:
        return False
    o = prob.options
    arrays = (prob.mask_bool, prob.mask_float, prob.bias, prob.alibi, prob.q_lengths, prob.kv_lengths, prob.keep,
              prob.poison, prob.v_full, prob.excluded_counts, prob.sink, prob.kv_indices, prob.q_offset,
              prob.tile_counts, o.mask_mod, dbias, dextra)
    if fwd is not None:
        arrays += (fwd.extra, fwd.slope, fwd.lse_keys, fwd.rowmax_keys)
    return all(x is None for x in arrays) and all(x is None for x in o.stages.values())


def head_chunks(prob):
    """Rectangular chunks of the leading ``(*batch, Hkv)`` index (tuples of slices), about two per thread and
    each with at most :data:`CHUNK_ENTRIES` score entries where a GQA group allows: single batch entries, and kv
    heads in ranges (whole GQA groups). None when there would be one chunk."""
    batch, Hkv = prob.batch, prob.Hkv
    nb = int(np.prod(batch))
    per = -(-Hkv // max(1, -(-2 * num_threads() // max(nb, 1))))      # kv heads per chunk
    per = max(1, min(per, CHUNK_ENTRIES // max(1, prob.G * prob.L * prob.S)))
    chunks = [tuple(slice(i, i + 1) for i in b) + (slice(h, min(h + per, Hkv)),)
              for b in np.ndindex(*batch) for h in range(0, Hkv, per)]
    return chunks if len(chunks) > 1 else None


def _full_index(prob, idx):
    """A chunk ``idx`` of the grouped ``(*batch, Hkv)`` index as one of the full ``(*batch, Hq)`` index."""
    h = idx[-1]
    return idx[:-1] + (slice(h.start * prob.G, h.stop * prob.G),)


def _sub_problem(prob, idx):
    """The problem on the heads of chunk ``idx`` alone (its inputs are views; nothing in it is unread)."""
    grouped, full = prob.batch + (prob.Hkv,), prob.batch + (prob.Hq,)
    fidx = _full_index(prob, idx)
    return dataclasses.replace(prob, q=_cut(prob.q, grouped, idx, 3), k=_cut(prob.k, grouped, idx, 2),
                               v=_cut(prob.v, grouped, idx, 2), unread=None,
                               full_scores=tuple(len(range(*i.indices(n))) for i, n in zip(fidx, full))
                               + (prob.L, prob.S))


def _cut(x, lead, idx, tail):
    """``x``'s chunk: its leading dims broadcast to ``lead``, then ``idx`` (None stays None)."""
    return None if x is None else np.broadcast_to(x, lead + x.shape[x.ndim - tail:])[idx]
