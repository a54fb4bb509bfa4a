"""Every combination an entry point documents works, and agrees with the same problem written by hand.

The entry points (the forward, :func:`sdpa_backward`, :func:`sdpa_jvp`, :func:`sdpa_backward_jvp`,
:func:`sdpa_hvp`) over the product of the layouts (dense, packed ``thd``, a paged KV cache whose unused slot
holds NaN) and the optional inputs (MLA's ``qv``, sinks, ``grad_lse``, a score function, the precision).
Each result is checked against an independent spelling of the same problem, not only for running:

* a layout against each sequence as its own dense problem, cut out of the storage and its gradients put
  back (summed where storage is shared) by hand here, not by :mod:`sdpa_ref.layouts`;
* ``qv`` against ``[q | qv]`` attending to ``[k | v]`` with values ``v`` and scale ``1 / sqrt(E + Ev)``,
  its gradients split by hand (``dV = dV' + dK'_{E:}``, both uses of ``V``);
* sinks against the same sinks per sequence, their gradient summed over the sequences.

What is refused by design is asserted as its clear error: second order with ``precision=`` or a score function
that captures a tensor.
"""

import itertools

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref import (
    ScoreMod, combine_lse, convert_lse, flash_attn_varlen_func, flash_attn_with_kvcache, merge_attention,
    merge_attention_backward, scaled_dot_product_attention, sdpa_backward, sdpa_backward_jvp, sdpa_forward, sdpa_hvp,
    sdpa_jvp, split_kv_partials,
)
from sdpa_ref.layouts import KVCache, Packed

from helpers import assert_close_normwise
from tolerances import F64_AMPLIFIED, F64_GRAD
import warnings
from hypothesis import given, settings, strategies as st

Hq, Hkv, E, Ev = 2, 1, 3, 2

#: A curved score function that reads the head and the indices (not the batch: a sequence alone is batch 0),
#: with its first and second derivatives.
SCORE = ScoreMod(lambda s, b, h, i, j: 2 * np.tanh(s / 2) + 0.25 * h * (j - i),
                 grad=lambda s, b, h, i, j: 1 - np.tanh(s / 2) ** 2,
                 grad2=lambda s, b, h, i, j: -np.tanh(s / 2) * (1 - np.tanh(s / 2) ** 2), name="tanh and a slope")


class _Layout:
    """A layout's storage and, by hand, each sequence's rows in it: ``q_rows[b]``, ``k_rows[b]`` index the
    storage with its leading axes flattened (queries, outputs: ``(n, H, F)``; keys and values likewise)."""

    def __init__(self, name, rng):
        self.name = name
        if name == "dense":
            self.kw, self.q_lead, self.k_lead = {}, None, None
            self.q_shape, self.k_shape = (2, Hq, 3), (2, Hkv, 4)
        elif name == "packed":
            self.kw = {"layout": Packed(cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 3, 7]))}
            self.q_rows, self.k_rows = [np.arange(0, 2), np.arange(2, 5)], [np.arange(0, 3), np.arange(3, 7)]
            self.q_shape, self.k_shape = (5, Hq), (7, Hkv)
        else:                                            # pages of 2 slots; page 0's second slot unused
            self.kw = {"layout": KVCache(cache_seqlens=np.array([3, 4]), block_table=np.array([[2, 0], [1, 3]]))}
            self.q_rows, self.k_rows = [np.arange(0, 2), np.arange(2, 4)], [np.array([4, 5, 0]),
                                                                            np.array([2, 3, 6, 7])]
            self.q_shape, self.k_shape = (2, 2, Hq), (4, 2, Hkv)
        self.unused = None if name != "paged" else 1     # a flat key slot no sequence uses: NaN, never read

    def arrays(self, rng):
        q, qv = rng.standard_normal(self.q_shape + (E,)), rng.standard_normal(self.q_shape + (Ev,))
        k, v = rng.standard_normal(self.k_shape + (E,)), rng.standard_normal(self.k_shape + (Ev,))
        if self.unused is not None:
            for x in (k, v):
                x.reshape((-1,) + x.shape[-2:])[self.unused] = np.nan
        return q, k, v, qv

    def seqs(self, x, kind):
        """The dense ``(1, H, n_b, F)`` arrays of each sequence of a query-like (``"q"``) or key-like (``"k"``)
        storage array; the dense layout is one problem of its own."""
        if self.name == "dense":
            return [x]
        flat = x.reshape((-1,) + x.shape[-2:])
        return [np.swapaxes(flat[r], 0, 1)[None] for r in (self.q_rows if kind == "q" else self.k_rows)]

    def put(self, parts, kind, shape):
        """The inverse of :meth:`seqs` for gradients: each sequence's back in the storage, summed where shared,
        0 where no sequence reads."""
        if self.name == "dense":
            return parts[0]
        out = np.zeros((int(np.prod(shape[:-2])),) + shape[-2:])
        for r, p in zip(self.q_rows if kind == "q" else self.k_rows, parts):
            np.add.at(out, r, np.swapaxes(p[0], 0, 1))
        return out.reshape(shape)

    def lse_seqs(self, x):
        """A per-row quantity in the layout's LSE layout, per sequence ``(1, Hq, n_b)``."""
        if self.name == "dense":
            return [x]
        if self.name == "packed":                        # (Hq, total_q)
            return [x[:, r][None] for r in self.q_rows]
        return [x[b][None] for b in range(len(self.q_rows))]     # (B, Hq, Lq)

    def lse_shape(self):
        return {"dense": (2, Hq, 3), "packed": (Hq, 5), "paged": (2, Hq, 2)}[self.name]

    def put_lse(self, parts):
        if self.name == "dense":
            return parts[0]
        if self.name == "packed":
            out = np.full((Hq, 5), -np.inf)
            for r, p in zip(self.q_rows, parts):
                out[:, r] = p[0]
            return out
        return np.concatenate(parts)


def _case(layout, qv, sinks, score, seed=0):
    """The arrays, the options and the tangents and cotangents of one combination."""
    rng = np.random.default_rng(seed)
    lay = _Layout(layout, rng)
    q, k, v, qv_ = lay.arrays(rng)
    opts = dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", **lay.kw)
    if sinks:
        opts["sinks"] = rng.standard_normal(Hq)
    if score:
        opts["score_mod"] = SCORE
    t = [np.where(np.isnan(x), 0.0, rng.standard_normal(x.shape)) for x in (q, k, v, qv_)]
    g = rng.standard_normal(lay.q_shape + (Ev,))
    return dict(lay=lay, q=q, k=k, v=v, qv=qv_ if qv else None, opts=opts, t=t, dsinks=rng.standard_normal(Hq),
                g=g, gt=rng.standard_normal(g.shape), gl=rng.standard_normal(lay.lse_shape()),
                glt=rng.standard_normal(lay.lse_shape()))


def _joined(c, b):
    """Sequence ``b`` as a dense problem with qv joined by hand: ``(q2, k2, v, tangents, dense options)``."""
    lay = c["lay"]
    q, k, v = (lay.seqs(x, kind)[b] for x, kind in ((c["q"], "q"), (c["k"], "k"), (c["v"], "k")))
    tq, tk, tv, tqv = (lay.seqs(x, kind)[b] for x, kind in zip(c["t"], "qkkq"))
    opts = {n: x for n, x in c["opts"].items() if n != "layout"}
    if c["qv"] is not None:
        qv = lay.seqs(c["qv"], "q")[b]
        q, tq = np.concatenate([q, qv], -1), np.concatenate([tq, tqv], -1)
        k, tk = np.concatenate([k, v], -1), np.concatenate([tk, tv], -1)
        opts["scale"] = 1 / np.sqrt(E + Ev)
    return q, k, v, (tq, tk, tv, None, c["dsinks"] if "sinks" in opts else None), opts


def _n(c):
    return 1 if c["lay"].name == "dense" else 2


def _grads_by_hand(c, per_seq):
    """Per-sequence joined gradients (or their tangents) split and put back: a dict by field."""
    lay, out = c["lay"], {}
    dq = [g.query for g in per_seq]
    dk = [g.key for g in per_seq]
    dv = [g.value for g in per_seq]
    if c["qv"] is not None:
        out["qv"] = lay.put([x[..., E:] for x in dq], "q", c["qv"].shape)
        dv = [a + b[..., E:] for a, b in zip(dv, dk)]             # V read twice
        dq, dk = [x[..., :E] for x in dq], [x[..., :E] for x in dk]
    out["query"] = lay.put(dq, "q", c["q"].shape)
    out["key"] = lay.put(dk, "k", c["k"].shape)
    out["value"] = lay.put(dv, "k", c["v"].shape)
    if "sinks" in c["opts"]:
        out["sinks"] = sum(g.sinks for g in per_seq)
    return out


def _check_grads(got, want):
    assert (getattr(got, "qv", None) is None) == ("qv" not in want)
    assert (got.sinks is None) == ("sinks" not in want)
    for name, w in want.items():
        assert_close_normwise(w, getattr(got, name), F64_GRAD)


def _seq_cotangents(c, b, with_lse):
    lay = c["lay"]
    g = lay.seqs(c["g"], "q")[b]
    gl = lay.lse_seqs(c["gl"])[b] if with_lse else None
    return g, gl


LAYOUTS = ("dense", "packed", "paged")
FIRST = list(itertools.product(LAYOUTS, (False, True), (False, True), (False, True), ("fast", "reproducible")))


@pytest.mark.parametrize("layout, qv, sinks, score, precision", FIRST)
def test_forward(layout, qv, sinks, score, precision):
    c = _case(layout, qv, sinks, score)
    call = lambda: sdpa_ref.scaled_dot_product_attention(c["q"], c["k"], c["v"], qv=c["qv"], return_lse=True,  # noqa
                                                         precision=precision, **c["opts"])
    out, lse = call()
    parts = [sdpa_ref.scaled_dot_product_attention(*_joined(c, b)[:3], return_lse=True, precision=precision,
                                                   **_joined(c, b)[4]) for b in range(_n(c))]
    assert_close_normwise(c["lay"].put([p[0] for p in parts], "q", out.shape), out, F64_GRAD)
    assert_close_normwise(c["lay"].put_lse([p[1] for p in parts]), lse, F64_GRAD)
    assert np.all(np.isfinite(out))                              # the unused NaN slot is never read


@pytest.mark.parametrize("layout, qv, sinks, score, precision",
                         FIRST)
@pytest.mark.parametrize("grad_lse", (False, True))
def test_backward(layout, qv, sinks, score, precision, grad_lse):
    c = _case(layout, qv, sinks, score)
    call = lambda: sdpa_forward(c["q"], c["k"], c["v"], qv=c["qv"], precision=precision, **c["opts"])  # noqa
    got = sdpa_backward(call()[1], c["g"], grad_lse=c["gl"] if grad_lse else None)
    per_seq = []
    for b in range(_n(c)):
        q, k, v, _, o = _joined(c, b)
        g, gl = _seq_cotangents(c, b, grad_lse)
        per_seq.append(sdpa_backward(sdpa_forward(q, k, v, precision=precision, **o)[1], g, grad_lse=gl))
    _check_grads(got, _grads_by_hand(c, per_seq))
    for x in (got.key, got.value):
        assert np.all(np.isfinite(x))


def _tangents(c):
    ts = (c["t"][0], c["t"][1], c["t"][2], None, c["dsinks"] if "sinks" in c["opts"] else None)
    return ts + ((c["t"][3],) if c["qv"] is not None else ())


@pytest.mark.parametrize("layout, qv, sinks, score, precision", FIRST)
def test_jvp(layout, qv, sinks, score, precision):
    c = _case(layout, qv, sinks, score)
    call = lambda: sdpa_jvp((c["q"], c["k"], c["v"]), _tangents(c), qv=c["qv"], precision=precision,  # noqa
                            **c["opts"])
    out, tan = call()
    parts = [sdpa_jvp(_joined(c, b)[:3], _joined(c, b)[3], precision=precision, **_joined(c, b)[4])
             for b in range(_n(c))]
    assert_close_normwise(c["lay"].put([p[0] for p in parts], "q", out.shape), out, F64_GRAD)
    assert_close_normwise(c["lay"].put([p[1] for p in parts], "q", tan.shape), tan, F64_GRAD)


SECOND = list(itertools.product(LAYOUTS, (False, True), (False, True), (False, True), (False, True)))


@pytest.mark.parametrize("layout, qv, sinks, score, grad_lse", SECOND)
def test_backward_jvp_and_hvp(layout, qv, sinks, score, grad_lse):
    c = _case(layout, qv, sinks, score)
    gl, glt = (c["gl"], c["glt"]) if grad_lse else (None, None)
    grads, tan = sdpa_backward_jvp((c["q"], c["k"], c["v"]), _tangents(c), c["g"], c["gt"], grad_lse=gl,
                                   grad_lse_tangent=glt, qv=c["qv"], **c["opts"])
    hvp = sdpa_hvp((c["q"], c["k"], c["v"]), _tangents(c), c["g"], grad_lse=gl, qv=c["qv"], **c["opts"])
    per = {"grads": [], "tan": [], "hvp": []}
    for b in range(_n(c)):
        q, k, v, ts, o = _joined(c, b)
        g, gl_b = _seq_cotangents(c, b, grad_lse)
        gt = c["lay"].seqs(c["gt"], "q")[b]
        glt_b = c["lay"].lse_seqs(c["glt"])[b] if grad_lse else None
        gr_b, tan_b = sdpa_backward_jvp((q, k, v), ts, g, gt, grad_lse=gl_b, grad_lse_tangent=glt_b, **o)
        per["grads"].append(gr_b)
        per["tan"].append(tan_b)
        per["hvp"].append(sdpa_hvp((q, k, v), ts, g, grad_lse=gl_b, **o))
    for got, key in ((grads, "grads"), (tan, "tan"), (hvp, "hvp")):
        _check_grads(got, _grads_by_hand(c, per[key]))


def test_second_order_refuses_what_it_does_not_have():
    c = _case("packed", True, True, False)
    args = ((c["q"], c["k"], c["v"]), _tangents(c), c["g"])
    with pytest.raises(TypeError, match="`num_splits` should not be given"):
        sdpa_backward_jvp(*args, qv=c["qv"], num_splits=2, **c["opts"])
    with pytest.raises(ValueError, match="`method` and `block_size` should be None with precision='reproducible'"):
        sdpa_hvp(*args, qv=c["qv"], precision="reproducible", method="plain", **c["opts"])
    captured = ScoreMod(lambda s, b, h, i, j, w: s * w[0], grad=lambda s, b, h, i, j, w: 0 * s + w[0],
                        params=(np.ones(1),))
    with pytest.raises(ValueError, match="`score_mod` should capture no tensor for second order"):
        sdpa_hvp(*args, qv=c["qv"], **dict(c["opts"], score_mod=captured))


_BAD_SCALARS = [None, -1, 0, 1, 2**63, -2**70, 0.5, -0.5, 1e308, float("nan"), float("inf"), "x", "", b"x", [],
                [1], (1, 2), (1, 2, 3), {1, 2}, {"a": 1}, True, False, np.float32(1), np.int64(3), 1j]


@st.composite
def _array(draw, shape):
    kind = draw(st.sampled_from(["f64", "f64", "f64", "f32", "f16", "int", "bool", "complex", "object", "nan"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    a = rng.standard_normal(shape)
    if kind == "f32":
        return a.astype(np.float32)
    if kind == "f16":
        return a.astype(np.float16)
    if kind == "int":
        return a.astype(np.int64)
    if kind == "bool":
        return a > 0
    if kind == "complex":
        return a + 1j
    if kind == "object":
        return a.astype(object)
    if kind == "nan":
        a = a.copy()
        if a.size:
            a.flat[0] = np.nan
        return a
    return a


@st.composite
def _call(draw):
    B, H, L, S, E = (draw(st.integers(0 if i in (2, 3) else 1, 4)) for i in range(5))
    shapes = [(B, H, L, E), (B, H, S, E), (B, H, S, E)]
    if draw(st.booleans()):                                          # sometimes a mismatch
        i = draw(st.integers(0, 2))
        shapes[i] = tuple(max(0, d + draw(st.integers(-1, 1))) for d in shapes[i])
    q, k, v = (draw(_array(s)) for s in shapes)
    opts = {}
    pool = {
        "is_causal": st.sampled_from([True, False] + _BAD_SCALARS),
        "scale": st.sampled_from([None, 0.3, 1.0] + _BAD_SCALARS),
        "dropout_p": st.sampled_from([0.0, 0.25] + _BAD_SCALARS),
        "softcap": st.sampled_from([None, 2.0, 5e-324] + _BAD_SCALARS),
        "window": st.sampled_from([None, (1, 0), (None, 2), (-1, -1)] + _BAD_SCALARS),
        "fully_masked": st.sampled_from(["zero", "nan", "uniform"] + _BAD_SCALARS),
        "causal_alignment": st.sampled_from(["top_left", "bottom_right"] + _BAD_SCALARS),
        "enable_gqa": st.sampled_from([True, False] + _BAD_SCALARS),
        "attn_mask": st.one_of(st.none(), _array((L, S)), st.sampled_from(_BAD_SCALARS)),
        "bias": st.one_of(st.none(), _array((L, S)), st.sampled_from(_BAD_SCALARS)),
        "q_lengths": st.sampled_from([None, [L] * B, [0] * B, [L + 1] * B] + _BAD_SCALARS),
        "kv_lengths": st.sampled_from([None, [S] * B, [max(S - 1, 0)] * B] + _BAD_SCALARS),
        "rng": st.sampled_from([None, 0, 3, -1, "x"]),
    }
    for name in draw(st.lists(st.sampled_from(sorted(pool)), unique=True, max_size=4)):
        opts[name] = draw(pool[name])
    if "dropout_p" in opts and "rng" not in opts:
        opts["rng"] = 0                                               # deterministic across the engines
    return q, k, v, opts


def _snapshot(x):
    return x.copy() if isinstance(x, np.ndarray) else x


@settings(max_examples=60, deadline=None)
@given(_call())
def test_fuzzed_calls_raise_only_clear_errors_mutate_nothing_and_agree(call):
    q, k, v, opts = call
    before = [_snapshot(a) for a in (q, k, v, *opts.values())]
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                              # NaN inputs warn; that is not the point
        for how in ("fast", "plain", "tiled"):
            try:
                out, res = sdpa_ref.sdpa_forward(q, k, v, method=how, **opts)
                g = np.ones(out.shape, dtype=out.dtype)
                grads = sdpa_ref.sdpa_backward(res, g)
            except (ValueError, TypeError) as exc:
                results[how] = type(exc)
                continue
            results[how] = (out, grads)
    after = [a for a in (q, k, v, *opts.values())]
    for x, y in zip(before, after):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"), "an input was mutated"
    kinds = {how: (r if isinstance(r, type) else "ok") for how, r in results.items()}
    assert len(set(kinds.values())) == 1, kinds                       # the engines accept and refuse alike
    if kinds["fast"] != "ok":
        return
    ref_out, ref_grads = results["plain"]
    if not np.all(np.isfinite(ref_out)) or ref_out.dtype != np.float64:
        return                                                       # NaN policies and low precision: elsewhere
    for how in ("fast", "tiled"):
        out, grads = results[how]
        assert_close_normwise(out, ref_out, F64_AMPLIFIED)
        for a, b in zip(grads, ref_grads):
            if a is not None and np.all(np.isfinite(b)):
                assert_close_normwise(a, b, F64_GRAD)


_RNG = np.random.default_rng(7)


DTYPES = (np.float64, np.float32)


HOWS = {"fast": {}, "plain": {"method": "plain"}, "tiled": {"block_size": 2}, "split": {"num_splits": 2},
        "reproducible": {"precision": "reproducible"}}


def _qkv(dt, B=2, H=2, L=3, S=5):
    q, k, v = (_RNG.standard_normal(s).astype(dt) for s in ((B, H, L, 4), (B, H, S, 4), (B, H, S, 3)))
    return q, k, v, _RNG.standard_normal((B, H, L, 3)).astype(dt)


def _residual_arrays(res):
    """Every array the residuals hold (the forward's and the problem's)."""
    out = []

    def walk(x):
        if isinstance(x, np.ndarray):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
    walk(tuple(res.forward))
    walk([getattr(res.problem, f) for f in res.problem.__dataclass_fields__])
    return out


def _own(x, res=None, what=""):
    """``x`` (an array or a tuple of them, None skipped) is writeable and shares no memory with the residuals."""
    for i, a in enumerate(x if isinstance(x, tuple) else (x,)):
        if a is None:
            continue
        if isinstance(a, tuple):
            _own(a, res, f"{what}[{i}]")
            continue
        assert a.flags.writeable, f"{what}[{i}] ({a.dtype}) is read-only"
        if res is not None:
            assert not any(np.shares_memory(a, r) for r in _residual_arrays(res)), f"{what}[{i}] shares residuals"


def _scribble(x):
    for a in (x if isinstance(x, tuple) else (x,)):
        if isinstance(a, tuple):
            _scribble(a)
        elif a is not None:
            a[...] = np.nan


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("how", list(HOWS))
def test_forward_results_are_writeable_and_writing_them_changes_no_gradient(dt, how):
    q, k, v, g = _qkv(dt)
    want = sdpa_backward(sdpa_forward(q, k, v, **HOWS[how])[1], g)
    out, res = sdpa_forward(q, k, v, **HOWS[how])
    views = (out, res.out, res.lse, res.lse_as(), res.lse_as(base=2), res.row_max, res.row_sumexp)
    _own(views, res, f"sdpa_forward {how}")
    _scribble(views)
    got = sdpa_backward(res, g)
    _own(tuple(got), res, "sdpa_backward")
    for w, x in zip(want, got):
        np.testing.assert_array_equal(x, w)
    _scribble(tuple(got))                                       # a second backward on the same residuals
    for w, x in zip(want, sdpa_backward(res, g)):
        np.testing.assert_array_equal(x, w)


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.__name__)
def test_every_entry_point_returns_writeable_arrays(dt):
    """The LSE of return_lse=True was the residuals' own frozen array for float64 (dense, and a KV cache's)."""
    q, k, v, g = _qkv(dt)
    for how in HOWS.values():
        _own(scaled_dot_product_attention(q, k, v, return_lse=True, **how), what="return_lse")
        _own(sdpa_jvp((q, k, v), (q, k, v), **how), what="sdpa_jvp")
    _own(sdpa_hvp((q, k, v), (q, k, v), g), what="sdpa_hvp")
    _own(sdpa_backward_jvp((q, k, v), (q, k, v), g, block_size=2), what="sdpa_backward_jvp")
    parts = split_kv_partials(q, k, v, num_splits=2)
    _own(parts, what="split_kv_partials")
    _own(merge_attention(*parts), what="merge_attention")
    _own(merge_attention_backward(*parts, g), what="merge_attention_backward")
    _own(combine_lse(parts[1]), what="combine_lse")
    _own(convert_lse(parts[1][0]), what="convert_lse")
    cu, qq = np.array([0, 3, 7]), _RNG.standard_normal((7, 2, 4)).astype(dt)
    _own(flash_attn_varlen_func(qq, qq, qq, cu, cu, return_lse=True), what="varlen")
    qc, kc = _RNG.standard_normal((2, 1, 2, 4)).astype(dt), _RNG.standard_normal((2, 5, 2, 4)).astype(dt)
    _own(flash_attn_with_kvcache(qc, kc, kc, return_softmax_lse=True), what="kvcache")
    _own(flash_attn_with_kvcache(qc, kc, kc, return_softmax_lse=True, num_splits=2), what="kvcache split")


# ---------------------------------------------------------------- sdpa_forward_complex and precision


def _mp_complex_attention(q, k, v, softcap=None, causal=False):
    """Complex attention in 50-digit mpmath, plain loops: the exact value of the complex inputs' formula."""
    import mpmath
    ctx = mpmath.MPContext()
    ctx.dps = 50
    B, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[3]
    sc = ctx.mpf(float(1 / np.sqrt(E)))
    out = np.empty((B, H, L, Ev), dtype=object)
    for b, h, i in np.ndindex(B, H, L):
        js = [j for j in range(S) if not causal or j <= i]
        t = []
        for j in js:
            raw = sc * ctx.fsum(ctx.mpc(q[b, h, i, e].real, q[b, h, i, e].imag)
                                * ctx.mpc(k[b, h, j, e].real, k[b, h, j, e].imag) for e in range(E))
            t.append(softcap * ctx.tanh(raw / softcap) if softcap else raw)
        m = max(x.real for x in t)
        ex = [ctx.exp(x - m) for x in t]
        tot = ctx.fsum(ex)
        for e in range(Ev):
            out[b, h, i, e] = ctx.fsum(ex[n] / tot * ctx.mpc(v[b, h, j, e].real, v[b, h, j, e].imag)
                                       for n, j in enumerate(js))
    return out


@pytest.mark.parametrize("kind", ("plain", "dominant", "large", "softcap"))
def test_complex_forward_refuses_reproducible_and_meets_its_measured_bound(kind):
    """``precision="reproducible"`` is refused with its reason; the fast path's complex step stays within the
    bound the refusal states (normwise, against mpmath), on both engines."""
    pytest.importorskip("mpmath")
    from tolerances import COMPLEX_FORWARD_NORMWISE, COMPLEX_STEP_NORMWISE
    rng = np.random.default_rng(40)
    q, k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 3))
    if kind == "dominant":
        k[..., 1, :] = q[..., 0, :] * 10
    elif kind == "large":
        q = q * 30
    h = 1e-30
    qc, kc, vc = (x + 1j * h * rng.standard_normal(x.shape) for x in (q, k, v))
    opts = dict(softcap=5.0) if kind == "softcap" else {}
    with pytest.raises(ValueError, match="`precision` should be 'fast' for sdpa_forward_complex.*no complex exp"):
        sdpa_ref.sdpa_forward_complex(qc, kc, vc, precision="reproducible", **opts)
    exact = _mp_complex_attention(qc, kc, vc, softcap=opts.get("softcap"), causal=True)
    re_ex = np.vectorize(lambda z: float(z.real))(exact)
    im_ex = np.vectorize(lambda z: float(z.imag / h))(exact)
    for kw in (dict(method="plain"), dict(method="tiled", block_size=2)):
        got = sdpa_ref.sdpa_forward_complex(qc, kc, vc, is_causal=True, precision="fast", **kw, **opts)
        assert np.max(np.abs(got.real - re_ex)) <= COMPLEX_FORWARD_NORMWISE * np.max(np.abs(re_ex))
        assert np.max(np.abs(got.imag / h - im_ex)) <= COMPLEX_STEP_NORMWISE * np.max(np.abs(im_ex))
