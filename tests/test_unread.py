"""Memory that no result reads may hold anything: any bits, finite or not, change no bit of any result (issue 22).

Positions that no result reads: query rows with no allowed key (padding past ``q_lengths``, rows that causal,
window or bool mask leave without a key), keys and values that no row of any head sharing them allows (padding
past ``kv_lengths``, and what causal, window or bool mask exclude for every row; values also where dropout drops
every allowed entry, unless a fully masked row of ``"uniform"`` averages them), float-mask and bias entries outside
the allowed set, ``grad_out`` on rows whose output is the constant 0, and the tangents at the places of their
primals. The oracle of what is read is written here from SEMANTICS.md with loops, independently of
``sdpa_ref.masks``.

Each example writes garbage there -- NaN, +-inf, ``1e150``, the dtype's largest value, random bit patterns (a
reused buffer, ``np.empty``) -- and checks that ``out``, ``lse``, every gradient and the JVP have the bits of the
run with ordinary values there, with every warning an error: on every engine, precision, dtype and ``upcast``.
"""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sdpa_ref

HOWS = {"plain": {"method": "plain"}, "fast": {"method": "fast"}, "tiled": {"block_size": 2},
        "reproducible": {"precision": "reproducible"}}
ARITHMETICS = [(dt, up) for dt in ("float64", "float32", "float16") for up in (True, False)]
#: Examples per (engine, dtype, upcast): a fraction of the profile's, so that "ci" stays at a few seconds.
EXAMPLES = max(2, settings.default.max_examples // 10)
#: The garbage, by kind ("big": far beyond any score, "max": the dtype's largest finite value).
KINDS = ("nan", "inf", "big", "max", "bits", "mixed")
BIG = {"float64": 1e150, "float32": 1e30, "float16": 1e4}


@st.composite
def problems(draw):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Hq, L, S = Hkv * G, draw(st.integers(1, 5)), draw(st.integers(1, 6))
    E, Ev = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    KB = draw(st.sampled_from([B, 1]))                              # keys and values broadcast over the batch
    o = {"enable_gqa": G > 1, "is_causal": draw(st.booleans()),
         "causal_alignment": draw(st.sampled_from(["top_left", "bottom_right"])),
         "fully_masked": draw(st.sampled_from(["zero", "nan", "uniform"]))}
    bound = st.sampled_from([None, 0, 1, 2])
    if draw(st.booleans()):
        o["window"] = (draw(bound), draw(bound))
    if draw(st.booleans()):
        o["q_lengths"] = np.array(draw(st.lists(st.integers(0, L), min_size=B, max_size=B)))
    if draw(st.booleans()):
        o["kv_lengths"] = np.array(draw(st.lists(st.integers(0, S), min_size=B, max_size=B)))
    extra = {"mask": draw(st.sampled_from([None, "bool", "float"])), "bias": draw(st.booleans()),
             "dropout": draw(st.booleans()), "full": draw(st.booleans())}
    if draw(st.booleans()):
        o["softcap"] = draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):
        o["alibi_slopes"] = np.linspace(0.25, 1.0, Hq)
    seed = draw(st.integers(0, 2**32 - 1))
    return (B, KB, Hkv, G, L, S, E, Ev), o, extra, seed, draw(st.sampled_from(KINDS))


def _allowed(B, Hq, L, S, o, bool_mask):
    """The allowed set ``(B, Hq, L, S)`` by SEMANTICS.md, entry by entry."""
    ql = o.get("q_lengths", [L] * B)
    kl = o.get("kv_lengths", [S] * B)
    left, right = o.get("window", (None, None))
    a = np.zeros((B, Hq, L, S), bool)
    for b, h, i, j in np.ndindex(B, Hq, L, S):
        off = 0 if o["causal_alignment"] == "top_left" else int(kl[b]) - int(ql[b])
        ok = i < ql[b] and j < kl[b]
        ok = ok and (bool_mask is None or bool(np.broadcast_to(bool_mask, a.shape)[b, h, i, j]))
        ok = ok and not (o["is_causal"] and j > i + off)
        ok = ok and not (left is not None and j < i + off - left)
        ok = ok and not (right is not None and j > i + off + right)
        a[b, h, i, j] = ok
    return a


def _unread(shape, KB, G, o, a, keep):
    """``{name: bool array of the input's shape}``: True where no result reads the input."""
    B, Hq, L, S = a.shape
    Hkv = Hq // G
    padded = np.arange(L)[None, None, :] >= np.asarray(o.get("q_lengths", [L] * B))[:, None, None]
    empty = ~a.any(axis=-1)                                         # (B, Hq, L); padded rows included
    reads_v = a & keep
    if o["fully_masked"] == "uniform":                              # such a row averages every value it keeps
        reads_v = reads_v | ((empty & ~padded)[..., None] & keep)

    def per_kv(r):
        r = r.reshape(B, Hkv, G, L, S).any(axis=(2, 3))
        return ~(r.any(axis=0, keepdims=True) if KB == 1 else r)

    return {"q": np.broadcast_to(empty[..., None], (B, Hq, L, shape[6])),
            "k": np.broadcast_to(per_kv(a)[..., None], (KB, Hkv, S, shape[6])),
            "v": np.broadcast_to(per_kv(reads_v)[..., None], (KB, Hkv, S, shape[7])),
            "cells": ~a, "cells_shared": ~a.any(axis=(0, 1)),
            "g": np.broadcast_to((padded | (empty & (o["fully_masked"] == "zero")))[..., None], (B, Hq, L, shape[7]))}


def _garbage(rng, n, dt, kind):
    dt = np.dtype(dt)
    info = np.finfo(dt)
    ut = np.dtype(f"u{dt.itemsize}")
    pools = {"nan": [np.nan], "inf": [np.inf, -np.inf], "big": [BIG[dt.name], -BIG[dt.name]],
             "max": [info.max, -info.max]}
    bits = rng.integers(0, np.iinfo(ut).max, size=n, dtype=ut, endpoint=True).view(dt)
    if kind == "bits":
        return bits
    if kind != "mixed":
        return rng.choice(np.array(pools[kind], dt), size=n)
    every = np.array([x for p in pools.values() for x in p], dt)
    return np.where(rng.random(n) < 0.4, bits, rng.choice(every, size=n))


def _inputs(shape, o, extra, seed, dt):
    B, KB, Hkv, G, L, S, E, Ev = shape
    Hq = Hkv * G
    rng = np.random.default_rng(seed)
    cells = (B, Hq, L, S) if extra["full"] else (L, S)
    arrays = {"q": rng.standard_normal((B, Hq, L, E)), "k": rng.standard_normal((KB, Hkv, S, E)),
              "v": rng.standard_normal((KB, Hkv, S, Ev)), "g": rng.standard_normal((B, Hq, L, Ev))}
    arrays.update({"t" + n: rng.standard_normal(arrays[n].shape) for n in "qkv"})
    bool_mask = None
    opts = dict(o)
    if extra["mask"] == "bool":
        bool_mask = rng.random(cells) < 0.6
        opts["attn_mask"] = bool_mask
    elif extra["mask"] == "float":
        arrays["mask"] = rng.standard_normal(cells)
    if extra["bias"]:
        arrays["bias"], arrays["tbias"] = rng.standard_normal(cells), rng.standard_normal(cells)
    keep = np.ones((B, Hq, L, S), bool)
    if extra["dropout"]:
        keep = rng.random((B, Hq, L, S)) < 0.7
        opts.update(dropout_mask=keep, dropout_p=0.25)
    arrays = {n: a.astype(dt) for n, a in arrays.items()}
    return arrays, opts, _allowed(B, Hq, L, S, o, bool_mask), keep


def _results(how, arrays, opts, upcast):
    kw = dict(opts, upcast=upcast)
    if "mask" in arrays:
        kw["attn_mask"] = arrays["mask"]
    if "bias" in arrays:
        kw["bias"] = arrays["bias"]
    qkv = (arrays["q"], arrays["k"], arrays["v"])
    out, res = sdpa_ref.sdpa_forward(*qkv, **kw, **HOWS[how])
    gr = sdpa_ref.sdpa_backward(res, arrays["g"])
    got = {"out": out, "lse": res.lse, "dq": gr.query, "dk": gr.key, "dv": gr.value, "dmask": gr.attn_mask,
           "dbias": gr.bias}
    tangents = (arrays["tq"], arrays["tk"], arrays["tv"]) + ((arrays["tbias"],) if "bias" in arrays else ())
    got["jvp"] = sdpa_ref.sdpa_jvp(qkv, tangents, **kw, **HOWS[how])[1]
    return {n: x for n, x in got.items() if x is not None}


@pytest.mark.parametrize("dt,upcast", ARITHMETICS, ids=[f"{d}-{'up' if u else 'own'}" for d, u in ARITHMETICS])
@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=EXAMPLES, deadline=None)
@given(problem=problems())
def test_garbage_in_never_read_memory_changes_no_bit_and_warns_nothing(problem, how, dt, upcast):
    shape, o, extra, seed, kind = problem
    arrays, opts, allowed, keep = _inputs(shape, o, extra, seed, dt)
    un = _unread(shape, shape[1], shape[3], o, allowed, keep)
    where = {"q": un["q"], "k": un["k"], "v": un["v"], "g": un["g"], "tq": un["q"], "tk": un["k"], "tv": un["v"]}
    for n in ("mask", "bias", "tbias"):
        if n in arrays:
            where[n] = un["cells"] if extra["full"] else un["cells_shared"]
    rng = np.random.default_rng(seed + 1)
    dirty = {}
    for n, a in arrays.items():
        a = a.copy()
        a[where[n]] = _garbage(rng, int(where[n].sum()), dt, kind)
        dirty[n] = a
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clean = _results(how, arrays, opts, upcast)
        got = _results(how, dirty, opts, upcast)
    assert got.keys() == clean.keys()
    for n in clean:
        a, b = np.ascontiguousarray(clean[n]), np.ascontiguousarray(got[n])
        ut = np.dtype(f"u{a.dtype.itemsize}")
        same = a.view(ut) == b.view(ut)
        assert same.all(), (f"{how} {dt} upcast={upcast}, {kind} garbage: {n} changed at "
                            f"{np.argwhere(~same)[:4].tolist()}: {a[~same][:4]} -> {b[~same][:4]}")


def test_gradients_of_never_read_positions_are_exactly_zero():
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((1, 2, 4, 3)) for _ in range(4))
    k = np.concatenate([k, np.full((1, 2, 2, 3), 1e308)], axis=2)         # keys 4, 5: no row of top-left causal
    v = np.concatenate([v, np.full((1, 2, 2, 3), -1e308)], axis=2)
    for how in HOWS.values():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, res = sdpa_ref.sdpa_forward(q, k, v, is_causal=True, q_lengths=[3], **how)
            gr = sdpa_ref.sdpa_backward(res, g)
        assert np.isfinite(out).all() and np.isfinite(gr.query).all()
        assert np.all(gr.key[:, :, 4:] == 0) and np.all(gr.value[:, :, 4:] == 0), how
        assert np.all(gr.query[:, :, 3:] == 0), how                     # the padded row


@pytest.mark.parametrize("opts", [{"is_causal": True}, {"is_causal": True, "causal_alignment": "bottom_right"},
                                  {"window": (1, 0)}, {"attention_chunk": 2}, {"sink_token_length": 1}, {}])
def test_the_cached_record_is_the_search(opts):
    """Problems whose allowed set is the scalar options' alone take their unread record from a cache: the same
    record as a fresh search, read-only, and a problem with another shape or option gets its own."""
    from sdpa_ref.options import AttentionOptions
    from sdpa_ref.problem import Problem, _UNREAD_CACHE
    from sdpa_ref.unread import find_unread
    from sdpa_ref.masks import allowed_set

    rng = np.random.default_rng(0)
    for L, S in ((3, 5), (5, 3), (4, 4)):
        q, k = rng.standard_normal((2, 2, L, 3)), rng.standard_normal((1, 2, S, 3))
        v = rng.standard_normal((1, 2, S, 2))
        o = AttentionOptions.from_kwargs(**opts)
        _UNREAD_CACHE.clear()
        first, again = Problem.build(q, k, v, o).unread, Problem.build(q, k, v, o).unread
        full = (2, 2, L, S)
        want = find_unread(full, 1, lambda rows: allowed_set(
            L, S, is_causal=o.is_causal, window=o.window, alignment=o.causal_alignment, rows=rows,
            sink_tokens=o.sink_token_length, chunk=o.attention_chunk, full=full), None,
            {"q": (2, 2, L), "k": (1, 2, S), "v": (1, 2, S), "mask": None, "bias": None})
        for a, b, c in zip(first._replace(q=None), again._replace(q=None), want._replace(q=None)):
            assert (a is None) == (b is None) == (c is None)
            if a is not None:
                assert np.array_equal(a, c) and np.array_equal(b, c) and not a.flags.writeable
        assert (first.q is None) == (want.q is None)
        if want.q is not None:
            assert np.array_equal(first.q.reshape(want.q.shape), want.q)
