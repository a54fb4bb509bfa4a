r"""Non-finite inputs: a NaN or inf reaches only the results that read it.

The contract (``SEMANTICS.md``, "Excluded positions are never read"):
whatever is stored at a position that a result does not read -- NaN and
inf included -- cannot change that result. What no result reads at all is
0 in the problem's own copies already (:meth:`Problem.build`, from
:func:`masks.reads`). The rest is read by some results and not by others:
the engines compute with dense products, in which an excluded entry is an
exact 0 times what is stored there, and ``0 * NaN`` is NaN. So the reference
works in two steps, the same for every engine and precision:

1. :func:`scrub` (called by :meth:`Problem.build`): the problem's own copies
   hold 0 wherever an input is not finite (``-inf`` in a float mask or bias
   is an exclusion, not poison, and stays), and :class:`Poison` records
   where. Every engine then computes on clean memory, so every result that
   does not read a poisoned entry has the bits it has with clean memory.
2. :func:`forward_taint`, :func:`backward_taint`, :func:`jvp_taint`: each
   result that does read a non-finite input is set to NaN.

What reads what. ``RK_i`` is the set of keys that row ``i``'s scores read:
the allowed set ``A_i``, empty on a fully masked or padded row. ``RV_i`` is
the set of values its output reads: ``RK_i``, or every key on a fully
masked row under ``"uniform"`` (whose output is the mean of all values),
less the entries that dropout drops.
Row ``i`` is *score-poisoned*, :math:`r_i`, when it has a key and ``q_i``,
an ALiBi slope of its head, or some ``k_j``, bias or float-mask entry with
``j`` in ``RK_i`` is not finite. Then

* ``out[i, e]`` and its JVP: NaN when :math:`r_i` or some ``v[j, e]`` with
  ``j`` in ``RV_i`` is not finite (the JVP also reads the tangents: ``dq_i``,
  ``dk_j`` and the bias tangent row-wide, ``dv[j, e]`` column-wise);
* ``lse_i``: NaN when :math:`r_i`;
* backward, with :math:`g_i = r_i` or (row ``i`` has a key and ``dO_i`` or
  some ``v_j``, ``j`` in ``RV_i``, is not finite): ``dq_i`` NaN when
  :math:`g_i`; ``dk_j`` when :math:`g_i` for some ``i`` with ``j`` in
  ``RK_i``; ``dv[j, e]`` when :math:`r_i` or ``dO[i, e]`` is not finite for
  some ``i`` with ``j`` in ``RV_i``; the bias and float-mask gradient at
  ``(i, j)`` when ``j`` in ``RK_i`` and :math:`g_i`.

A poisoned result is NaN whole: where IEEE arithmetic would give ``inf``
(``P_ij * inf`` with ``P_ij > 0``) the reference says NaN too -- it makes
no promise about which non-finite value a poisoned result holds, only about
which results are poisoned. None of this costs anything on finite input
but one ``isfinite`` pass over each input.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from .masks import slice_ls
from .transforms import unbroadcast

__all__ = ["Poison", "Taint", "backward_taint", "clean", "forward_taint", "jvp_taint", "nan_where", "scrub"]

_BLOCK_CELLS = 1 << 22          # read-set blocks of at most this many (batch x head x row x key) cells


class Poison(NamedTuple):
    """Where the problem's inputs were not finite (each in its own array's shape, or None where all were)."""

    q: Optional[np.ndarray]         # (..., Hkv, G, L): a non-finite entry in the query row
    k: Optional[np.ndarray]         # (..., Hkv, S)
    v: Optional[np.ndarray]         # (..., Hkv, S, Ev), element-wise
    mask: Optional[np.ndarray]      # the float mask's own shape: NaN or +inf
    bias: Optional[np.ndarray]      # the bias's own shape: NaN or +inf
    alibi: Optional[np.ndarray]     # (..., Hq, 1, 1)


def scrub(a, *, additive=False, rows=False):
    """Set the non-finite entries of the writable ``a`` to 0 and say where they were (None if nowhere).

    ``additive``: ``-inf`` (an exclusion) is kept and not reported. ``rows``:
    report per row (any over the last axis).
    """
    if a is None or _all_finite(a):
        return None
    bad = ~np.isfinite(a)
    if additive:
        bad &= ~(np.isreal(a) & (a.real == -np.inf))
    if not bad.any():
        return None
    a[bad] = 0
    return bad.any(axis=-1) if rows else bad


def clean(a):
    """``(a with its non-finite entries set to 0, where they were)``; ``a`` itself and None when all are finite."""
    if a is None or _all_finite(a):
        return a, None
    ok = np.isfinite(a)
    return np.where(ok, a, a.dtype.type(0)), ~ok


def _all_finite(a):
    """Every entry finite: one reduction, no temporary (a sum of finite values that overflows is checked again)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.sum(a)):
            return True
    return bool(np.isfinite(a).all())


# ------------------------------------------------------------ read sets


def _blocks(prob):
    per_row = max(1, int(np.prod(prob.batch + (prob.Hq, prob.S), dtype=np.int64)))
    step = max(1, _BLOCK_CELLS // per_row)
    for i0 in range(0, prob.L, step):
        yield i0, min(prob.L, i0 + step)


def _grouped(x, prob):
    """``(*batch, Hq, Lb, ...)`` -> ``(*batch, Hkv, G, Lb, ...)``."""
    return x.reshape(x.shape[:-3] + (prob.Hkv, prob.G) + x.shape[-2:])


def _read_sets(prob, empty, rows):
    """``(RK, RV)`` of the row block, bool ``(*batch, Hkv, G, Lb, S)``."""
    full = prob.batch + (prob.Hq, rows[1] - rows[0], prob.S)
    e = np.broadcast_to(empty, prob.batch + (prob.Hq, prob.L, 1))[..., rows[0]:rows[1], :]
    a = prob.allowed(rows=rows)
    rk = np.broadcast_to(~e if a is None else (a & ~e), full)
    rv = rk
    if prob.options.fully_masked == "uniform":
        pad = prob.padded_rows(rows)
        rv = rk | (e if pad is None else (e & ~pad))
    if prob.keep is not None:                                  # a dropped entry reads no value
        rv = rv & slice_ls(prob.keep, rows[0], rows[1], 0, None)
    return _grouped(rk, prob), _grouped(np.broadcast_to(rv, full), prob)


def _additive_bad(p, prob, rows):
    """``(*batch, Hkv, G, Lb, S)`` bool: the bias or float-mask entries of the block that are NaN or +inf."""
    i0, i1 = rows
    out = None
    for bad in (p.mask, p.bias):
        if bad is not None:
            b = np.broadcast_to(slice_ls(bad, i0, i1, 0, None), prob.batch + (prob.Hq, i1 - i0, prob.S))
            out = b if out is None else (out | b)
    return None if out is None else _grouped(out, prob)


def _any_keys(rk, bad_keys):
    """``(*batch, Hkv, G, Lb)``: some key of the row's read set is bad (``bad_keys`` ``(..., Hkv, S)``)."""
    return np.any(rk & bad_keys[..., None, None, :], axis=-1)


def _any_cols(rv, bad):
    """``(*batch, Hkv, G, Lb, Ev)``: some ``bad[j, e]`` (``(..., Hkv, S, Ev)``) with ``j`` in the read set."""
    return (rv.astype(np.float32) @ bad[..., None, :, :].astype(np.float32)) > 0


def _score_rows(p, prob, rk, rows):
    """:math:`r_i` of the block, ``(*batch, Hkv, G, Lb)``."""
    i0, i1 = rows
    has_key = rk.any(axis=-1)
    r = np.zeros(has_key.shape, dtype=bool)
    if p.q is not None:
        r = r | p.q[..., i0:i1]
    if p.alibi is not None:
        r = r | _grouped(np.broadcast_to(p.alibi, prob.batch + (prob.Hq, 1, 1)), prob)[..., 0]
    if p.k is not None:
        r = r | _any_keys(rk, p.k)
    add = _additive_bad(p, prob, rows)
    if add is not None:
        r = r | np.any(rk & add, axis=-1)
    return r & has_key


def _to_full_rows(x, prob):
    """``(*batch, Hkv, G, L, ...)`` -> ``(*batch, Hq, L, ...)``."""
    return x.reshape(prob.batch + (prob.Hq,) + x.shape[len(prob.batch) + 2:])


def nan_where(x, bad):
    """``x`` with NaN where ``bad`` (a new array), or ``x`` itself when ``bad`` is None."""
    return x if bad is None else np.where(bad, x.dtype.type(np.nan), x)


# ------------------------------------------------------------ the taints


class Taint(NamedTuple):
    """The forward's poisoned entries, bool: ``out`` ``(*batch, Hq, L, Ev)``, ``lse`` ``(*batch, Hq, L)``."""

    out: np.ndarray
    lse: np.ndarray


def forward_taint(prob, empty):
    """The :class:`Taint` of the forward, or None when no input is poisoned."""
    p = prob.poison
    if p is None:
        return None
    Ev = prob.v.shape[-1]
    out_bad = np.zeros(prob.batch + (prob.Hkv, prob.G, prob.L, Ev), dtype=bool)
    lse_bad = np.zeros(prob.batch + (prob.Hkv, prob.G, prob.L), dtype=bool)
    for rows in _blocks(prob):
        rk, rv = _read_sets(prob, empty, rows)
        r = _score_rows(p, prob, rk, rows)
        lse_bad[..., rows[0]:rows[1]] = r
        ob = np.broadcast_to(r[..., None], r.shape + (Ev,))
        if p.v is not None:
            ob = ob | _any_cols(rv, p.v)
        out_bad[..., rows[0]:rows[1], :] = ob
    return Taint(_to_full_rows(out_bad, prob), _to_full_rows(lse_bad, prob))


def backward_taint(prob, empty, grads, do_bad, dlse_bad=None):
    """The engine's :class:`~sdpa_ref.engines.contract.Grads` with every gradient that reads poison set to NaN.

    ``do_bad`` ``(*batch, Hq, L, Ev)``: the entries of ``grad_out`` that were not finite (and were cleaned), or None;
    ``dlse_bad`` ``(*batch, Hq, L, 1)`` the same for ``grad_lse`` (it reaches ``dT_i`` only: not ``dV``).
    """
    p = prob.poison
    if p is None and do_bad is None and dlse_bad is None:
        return grads
    p = p if p is not None else Poison(None, None, None, None, None, None)
    Ev = prob.v.shape[-1]
    dq_bad = np.zeros(prob.batch + (prob.Hkv, prob.G, prob.L), dtype=bool)
    dk_bad = np.zeros(prob.batch + (prob.Hkv, prob.S), dtype=bool)
    dv_bad = np.zeros(prob.batch + (prob.Hkv, prob.S, Ev), dtype=bool)
    add_bad = {n: np.zeros(prob.shapes[arg], dtype=bool) for n, arg in (("mask", "attn_mask"), ("bias", "bias"))
               if getattr(grads, "d" + n) is not None}
    dob = None if do_bad is None else _grouped(np.broadcast_to(do_bad, prob.batch + (prob.Hq, prob.L, Ev)), prob)
    dlb = None if dlse_bad is None else _grouped(np.broadcast_to(dlse_bad, prob.batch + (prob.Hq, prob.L, 1)), prob)
    for rows in _blocks(prob):
        i0, i1 = rows
        rk, rv = _read_sets(prob, empty, rows)
        r = _score_rows(p, prob, rk, rows)
        has_key = rk.any(axis=-1)
        g = r
        if dob is not None:                                # dq, dk and dB read all of dO_i ...
            g = g | (dob[..., i0:i1, :].any(axis=-1) & has_key)
        if dlb is not None:                                # ... and dlse_i, through dT_i += P_i dlse_i
            g = g | (dlb[..., i0:i1, 0] & has_key)
        if p.v is not None:                                # ... and v_j through dP_ij = dO_i . v_j
            g = g | (_any_keys(rv, p.v.any(axis=-1)) & has_key)
        dq_bad[..., i0:i1] = g
        dk_bad |= np.any(rk & g[..., None], axis=(-3, -2))
        dv_bad |= np.any(rv & r[..., None], axis=(-3, -2))[..., None]
        if dob is not None:                                # dV = P_drop^T dO, column by column
            dv_bad |= (np.swapaxes(rv, -1, -2).astype(np.float32) @ dob[..., i0:i1, :].astype(np.float32)
                       > 0).any(axis=-3)
        if add_bad:
            cell = _to_full_rows(rk & g[..., None], prob)
            for acc in add_bad.values():
                _or_into(acc, cell, rows)
    E = prob.q.shape[-1]
    out = grads._replace(dq=nan_where(grads.dq, _fit(_to_full_rows(dq_bad, prob)[..., None], grads.dq, E)),
                         dk=nan_where(grads.dk, _fit(dk_bad[..., None], grads.dk, E)),
                         dv=nan_where(grads.dv, _fit(dv_bad, grads.dv, Ev)))
    for n, acc in add_bad.items():
        out = out._replace(**{"d" + n: nan_where(getattr(grads, "d" + n), acc)})
    if grads.dsinks is not None:                           # dsink = -sum_i p_sink (D_i - dlse_i): dq's rows, dlse
        rows_bad = _to_full_rows(dq_bad, prob)
        if dlb is not None:
            rows_bad = rows_bad | _to_full_rows(dlb[..., 0], prob)
        out = out._replace(dsinks=nan_where(grads.dsinks, rows_bad.any(axis=-1)))
    return out


def jvp_taint(prob, empty, tangents_bad):
    """``(*batch, Hq, L, Ev)`` bool: the entries of the output tangent that read poison, or None.

    ``tangents_bad``: ``(dq rows (..., Hkv, G, L), dk rows (..., Hkv, S), dv (..., Hkv, S, Ev), dbias (own shape))``,
    each None where that tangent was finite (or absent).
    """
    p = prob.poison
    tq, tk, tv, tb = tangents_bad
    if p is None and all(t is None for t in tangents_bad):
        return None
    p = p if p is not None else Poison(None, None, None, None, None, None)
    Ev = prob.v.shape[-1]
    vcols = _or(p.v, tv)
    bad = np.zeros(prob.batch + (prob.Hkv, prob.G, prob.L, Ev), dtype=bool)
    for rows in _blocks(prob):
        i0, i1 = rows
        rk, rv = _read_sets(prob, empty, rows)
        t = _score_rows(p._replace(q=_or(p.q, tq), k=_or(p.k, tk), bias=_or(p.bias, tb)), prob, rk, rows)
        b = np.broadcast_to(t[..., None], t.shape + (Ev,))
        if vcols is not None:
            b = b | _any_cols(rv, vcols)
        bad[..., i0:i1, :] = b
    return _to_full_rows(bad, prob)


def _fit(bad, grad, n):
    """``bad`` (full batch, a trailing axis of 1 or ``n``) for a gradient that the engine may have summed to its
    input's own shape already (the reproducible one does): broadcast, then reduced as the gradient was."""
    full = bad.shape[:-1] + (n,)
    bad = np.broadcast_to(bad, full)
    return bad if grad.shape == full else unbroadcast(bad.astype(np.int64), grad.shape) > 0


def _or(a, b):
    if a is None or b is None:
        return b if a is None else a
    return np.broadcast_to(a, np.broadcast_shapes(a.shape, b.shape)) | b


def _or_into(acc, cell, rows):
    """OR the block ``cell`` ``(*batch, Hq, Lb, S)`` into ``acc``, an array broadcastable to ``(*batch, Hq, L, S)``
    (summed down to its shape as its gradient is: :func:`~sdpa_ref.transforms.unbroadcast`)."""
    view = slice_ls(acc, rows[0], rows[1], 0, None)
    view |= unbroadcast(cell.astype(np.int64), view.shape) > 0
