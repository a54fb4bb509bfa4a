"""Results are the caller's own (issue 40, item 9), and three semantics of the peers (item 10): JAX's attention
over no key, FlashAttention 3's ``page_table[cache_batch_idx[b]]``, and the refused 3-D ``gather_kv_indices``.
"""

import numpy as np
import pytest

from sdpa_ref import KVCache, flash_attn_with_kvcache, sdpa_backward, sdpa_forward, sdpa_hvp, sdpa_jvp

from helpers import assert_close_normwise
from tolerances import F64_AMPLIFIED, F64_FEW_ULP

_RNG = np.random.default_rng(7)
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


# ------------------------------------------------------------ results are the caller's own


# ------------------------------------------------------------ JAX over no key


@pytest.mark.parametrize("how", list(HOWS))
def test_jax_policy_with_no_key_gives_zero_as_jax(how):
    """JAX's ``_dot_product_attention_xla`` with a zero-length key axis: the softmax of an empty row is empty,
    and ``einsum('BNTS,BSNH->BTNH', probs, value)`` sums nothing, so the output is 0 (and so are dq and the
    tangent: every term has a key); the LSE is that of an empty sum, -inf. It was NaN here."""
    q, k, v = np.ones((1, 2, 3, 2)), np.ones((1, 2, 0, 2)), np.ones((1, 2, 0, 3))
    g = np.ones((1, 2, 3, 3))
    for policy in ("jax", "zero"):
        out, res = sdpa_forward(q, k, v, fully_masked=policy, **HOWS[how])
        np.testing.assert_array_equal(out, np.zeros((1, 2, 3, 3)))
        np.testing.assert_array_equal(res.lse, np.full((1, 2, 3), -np.inf))
        gr = sdpa_backward(res, g)
        np.testing.assert_array_equal(gr.query, np.zeros(q.shape))
        assert gr.key.shape == k.shape and gr.value.shape == v.shape
        tangent = sdpa_jvp((q, k, v), (q, k, v), fully_masked=policy, **HOWS[how])[1]
        np.testing.assert_array_equal(tangent, np.zeros(out.shape))
    if how in ("plain", "tiled"):
        hv = sdpa_hvp((q, k, v), (q, k, v), g, fully_masked="jax", **({"block_size": 2} if how == "tiled" else {}))
        np.testing.assert_array_equal(hv.query, np.zeros(q.shape))


def test_jax_policy_with_no_key_but_padding_and_sinks():
    """The rows past q_lengths stay 0 and a sink's row gives O = 0, lse = sink, as under "zero"."""
    q, k, v = np.ones((2, 1, 3, 2)), np.ones((2, 1, 0, 2)), np.ones((2, 1, 0, 3))
    for extra in ({"q_lengths": np.array([1, 3])}, {"sinks": np.array([0.5])}):
        want = sdpa_forward(q, k, v, fully_masked="zero", **extra)
        got = sdpa_forward(q, k, v, fully_masked="jax", **extra)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1].lse, want[1].lse)
        for w, x in zip(sdpa_backward(want[1], np.ones((2, 1, 3, 3))), sdpa_backward(got[1], np.ones((2, 1, 3, 3)))):
            np.testing.assert_array_equal(x, w)


# ------------------------------------------------------------ FlashAttention 3's page_table[cache_batch_idx[b]]


def _pages_oracle(q, pages, table, batch_idx, seqlens, leftpad):
    """Plain NumPy: sequence b's keys gathered position by position from the pages of table row
    batch_idx[b] (FlashAttention 3's kernel), its lengths indexed by b, then softmax(q k^T / sqrt(E)) v."""
    B, Lq, Hq, E = q.shape
    P = pages.shape[1]
    out = np.zeros(q.shape[:3] + (pages.shape[-1],))
    for b in range(B):
        row = table[batch_idx[b]]
        ks = np.array([pages[row[t // P], t % P] for t in range(leftpad[b], seqlens[b])])   # (n, Hkv, E)
        for h in range(Hq):
            s = q[b, :, h] @ ks[:, h].T / np.sqrt(E)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            out[b, :, h] = (p / p.sum(axis=-1, keepdims=True)) @ ks[:, h]
    return out


@pytest.mark.parametrize("hnd", [False, True])
def test_cache_batch_idx_picks_the_page_table_row(hnd):
    pages = _RNG.standard_normal((6, 2, 2, 4))                    # 6 pages of 2 slots, Hkv = 2, E = 4
    table = np.array([[0, 1, 2], [3, 4, 5], [5, 1, 0]])          # 3 table rows for 2 sequences
    batch_idx, seqlens, leftpad = np.array([2, 0]), np.array([5, 4]), np.array([1, 0])
    q = _RNG.standard_normal((2, 2, 2, 4))
    want = _pages_oracle(q, pages, table, batch_idx, seqlens, leftpad)
    store = np.ascontiguousarray(np.swapaxes(pages, 1, 2)) if hnd else pages
    got = flash_attn_with_kvcache(q, store, store, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
                                  cache_leftpad=leftpad, page_table=table, kv_layout="HND" if hnd else "NHD")
    assert_close_normwise(want, got, F64_AMPLIFIED)    # the page-table gather against the dense oracle
    # the same as a table already in the sequences' order
    plain = flash_attn_with_kvcache(q, store, store, cache_seqlens=seqlens, cache_leftpad=leftpad,
                                    page_table=table[batch_idx], kv_layout="HND" if hnd else "NHD")
    np.testing.assert_array_equal(got, plain)


def test_cache_batch_idx_with_a_page_table_gathers_the_gradient():
    pages, table = _RNG.standard_normal((4, 2, 1, 3)), np.array([[0, 1], [2, 3]])
    q, g = _RNG.standard_normal((2, 1, 1, 3)), _RNG.standard_normal((2, 1, 1, 3))
    lay = KVCache(cache_seqlens=np.array([3, 4]), cache_batch_idx=np.array([1, 1]), block_table=table)
    gr = sdpa_backward(sdpa_forward(q, pages, pages, layout=lay)[1], g)
    ref = KVCache(cache_seqlens=np.array([3, 4]), block_table=table[[1, 1]])
    want = sdpa_backward(sdpa_forward(q, pages, pages, layout=ref)[1], g)
    for w, x in zip(want, gr):
        np.testing.assert_array_equal(x, w)
    assert not np.any(gr.key[:2]) and np.any(gr.key[2:])         # table row 0's pages are never read


# ------------------------------------------------------------ gather_kv_indices: no ambiguous 3-D shape


def test_three_dim_gather_indices_beside_a_batch_are_refused_when_b_equals_hq():
    """B == Hq == 2: (b, t, K) was read as (Hq, L, K) silently, sequence 1's indices given to head 1."""
    q, k, v, _ = _qkv(np.float64, B=2, H=2, L=3, S=5)
    idx = np.array([[[0], [1], [2]], [[3], [4], [4]]])           # FlashAttention 4's (b, t, K)
    with pytest.raises(ValueError, match=r"`gather_kv_indices`.*ambiguous.*\(b, 1, t, K\)"):
        sdpa_forward(q, k, v, gather_kv_indices=idx)
    shared = sdpa_forward(q, k, v, gather_kv_indices=idx[:, None])[0]       # (b, 1, t, K): what FA4 means
    for b in range(2):
        for i in range(3):
            j = idx[b, i, 0]
            np.testing.assert_allclose(shared[b, :, i], v[b, :, j], rtol=F64_FEW_ULP)
    per_head = sdpa_forward(q, k, v, gather_kv_indices=np.broadcast_to(idx[:, None], (2, 2, 3, 1)))[0]
    np.testing.assert_array_equal(per_head, shared)


def test_gather_indices_of_full_rank_or_shared_by_everything_are_accepted():
    q, k, v, _ = _qkv(np.float64, B=2, H=2, L=3, S=5)
    idx = np.array([[0, 1], [2, 3], [4, 4]])                     # (L, K): the same for every batch and head
    a = sdpa_forward(q, k, v, gather_kv_indices=idx)[0]
    np.testing.assert_array_equal(a, sdpa_forward(q, k, v, gather_kv_indices=idx[None, None])[0])
    q3, k3, v3 = q[0], k[0], v[0]                                # no batch: (Hq, L, K) is not ambiguous
    idx3 = np.stack([idx, idx[::-1]])
    b = sdpa_forward(q3, k3, v3, gather_kv_indices=idx3)[0]
    np.testing.assert_array_equal(b, sdpa_forward(q, k, v, gather_kv_indices=idx3[None])[0][0])
