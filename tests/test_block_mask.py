"""Block-sparse masks: the tiled engine skips the tiles the block mask says it skips (counted), never calls the mask
function on full tiles, and gives the results of the mask function alone; a block mask that disagrees with its
mask function is an error; FlexAttention's index layout and cuDNN's bit-packed tiles build the same mask."""

import numpy as np
import pytest

from sdpa_ref import BlockMask, sdpa_backward, sdpa_forward, sdpa_jvp
from tolerances import F64_GRAD, F64_REGROUPED, F64_SUMS

B, HQ, HKV, L, S, E, EV, T = 2, 4, 2, 37, 45, 5, 3, 8


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, HQ, L, E)), rng.standard_normal((B, HKV, S, E)),
            rng.standard_normal((B, HKV, S, EV)))


def causal(b, h, i, j):
    return j <= i


def sliding(b, h, i, j):
    return (j <= i) & (i - j < 12)


DOC = np.repeat(np.arange(5), 10)


def document(b, h, i, j):
    return DOC[i] == DOC[j]


def per_head(b, h, i, j):                      # tiles that differ between heads and batch entries
    return (j <= i + 8 * (h % 2)) & (j >= 8 * b)


MODS = {"causal": causal, "sliding window": sliding, "document": document, "per head and batch": per_head}


def _expected_counts(bm):
    t = bm.tiles.reshape((-1,) + bm.tiles.shape[-2:])
    absent = int(np.all(t == 0, axis=0).sum())
    full = int(np.all(t == 2, axis=0).sum())
    return {"absent": absent, "full": full, "partial": t.shape[-2] * t.shape[-1] - absent - full}


@pytest.mark.parametrize("name", MODS)
def test_tiled_engine_skips_what_it_says_and_equals_the_dense_result(name):
    mm = MODS[name]
    q, k, v = _inputs()
    bh = (B, HQ) if name == "per head and batch" else (1, 1)
    bm = BlockMask.from_mask_mod(mm, *bh, L, S, block_size=T)
    want = _expected_counts(bm)
    assert want["absent"] > 0
    calls = {"n": 0}

    def counted(b, h, i, j):
        calls["n"] += 1
        return mm(b, h, i, j)

    bm_counted = BlockMask.from_tiles(bm.tiles, block_size=T, mask_mod=counted)
    out, res = sdpa_forward(q, k, v, block_mask=bm_counted, method="tiled", enable_gqa=True)
    after_build = calls["n"]
    assert res.tile_counts == want                   # one visit per tile: skipped, full or evaluated
    out_mm, res_mm = sdpa_forward(q, k, v, mask_mod=mm, method="tiled", block_size=T, enable_gqa=True)
    dense, res_d = sdpa_forward(q, k, v, mask_mod=mm, method="fast", enable_gqa=True)
    assert np.array_equal(out, out_mm)               # skipping a block changes no bit
    np.testing.assert_allclose(out, dense, rtol=F64_SUMS, atol=F64_REGROUPED)
    g = np.random.default_rng(1).standard_normal(out.shape)
    calls["n"] = 0
    gb = sdpa_backward(res, g)
    assert calls["n"] == want["partial"]             # the mask function ran on the partial tiles only
    assert res.tile_counts == {kk: 2 * n for kk, n in want.items()}
    for a, b_, c in zip(gb[:3], sdpa_backward(res_mm, g)[:3], sdpa_backward(res_d, g)[:3]):
        assert np.array_equal(a, b_)
        np.testing.assert_allclose(a, c, rtol=F64_GRAD, atol=F64_SUMS)
    tq = tuple(np.random.default_rng(2).standard_normal(x.shape) for x in (q, k, v))
    np.testing.assert_allclose(sdpa_jvp((q, k, v), tq, block_mask=bm, method="tiled", enable_gqa=True)[1],
                               sdpa_jvp((q, k, v), tq, mask_mod=mm, enable_gqa=True)[1], rtol=F64_GRAD, atol=F64_SUMS)
    assert after_build > 0                           # the build checked the claim on the whole of the scores


@pytest.mark.parametrize("method", ["fast", "plain", "split"])
def test_other_engines_compute_the_mask_function(method):
    q, k, v = _inputs(3)
    bm = BlockMask.from_mask_mod(sliding, 1, 1, L, S, block_size=T)
    extra = dict(num_splits=3) if method == "split" else {}
    out, _ = sdpa_forward(q, k, v, block_mask=bm, method=method, enable_gqa=True, **extra)
    want, _ = sdpa_forward(q, k, v, mask_mod=sliding, method="tiled", block_size=T, enable_gqa=True)
    np.testing.assert_allclose(out, want, rtol=F64_SUMS, atol=F64_REGROUPED)


def test_flexattention_layout_and_cudnn_bits_build_the_same_mask():
    bm = BlockMask.from_mask_mod(sliding, 1, 1, L, S, block_size=T)
    t = bm.tiles
    nq, nk = t.shape[-2:]
    num_p, num_f = np.zeros(t.shape[:3], np.int64), np.zeros(t.shape[:3], np.int64)
    ind_p, ind_f = np.zeros(t.shape, np.int64), np.zeros(t.shape, np.int64)
    for r in range(nq):
        p, f = np.nonzero(t[0, 0, r] == 1)[0], np.nonzero(t[0, 0, r] == 2)[0]
        num_p[0, 0, r], num_f[0, 0, r] = len(p), len(f)
        ind_p[0, 0, r, :len(p)], ind_f[0, 0, r, :len(f)] = p[::-1], f     # any order
        ind_p[0, 0, r, len(p):] = 99                                      # past kv_num_blocks: not read
    flex = BlockMask(num_p, ind_p, num_f, ind_f, block_size=T, mask_mod=sliding)
    assert np.array_equal(flex.tiles, t)
    bits = np.packbits(t == 1, axis=-1, bitorder="little")
    full = np.packbits(t == 2, axis=-1, bitorder="little")
    assert np.array_equal(BlockMask.from_bits(bits, nk, full_bits=full, block_size=T, mask_mod=sliding).tiles, t)
    q, k, v = _inputs(4)
    outs = [sdpa_forward(q, k, v, block_mask=m, method="tiled", enable_gqa=True)[0]
            for m in (bm, flex, BlockMask.from_bits(bits, nk, full_bits=full, block_size=T, mask_mod=sliding))]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_a_block_mask_without_a_mask_function_allows_its_tiles():
    q, k, v = _inputs(5)
    tiles = np.zeros((1, 1, 5, 6), np.int8)
    tiles[0, 0, :, 0] = 1
    tiles[0, 0, 2, 3] = 2
    bm = BlockMask.from_tiles(tiles, block_size=T)
    dense = np.kron(tiles[0, 0] != 0, np.ones((T, T), bool))[:L, :S]
    out, res = sdpa_forward(q, k, v, block_mask=bm, method="tiled", enable_gqa=True)
    want, _ = sdpa_forward(q, k, v, attn_mask=dense, enable_gqa=True)
    np.testing.assert_allclose(out, want, rtol=F64_SUMS, atol=F64_REGROUPED)
    assert res.tile_counts == {"absent": 24, "full": 1, "partial": 5}


def test_a_block_mask_that_disagrees_with_its_mask_function_is_an_error():
    q, k, v = _inputs()
    bm = BlockMask.from_mask_mod(causal, 1, 1, L, S, block_size=T)
    dropped = np.array(bm.tiles)
    dropped[0, 0, 3, 1] = 0                                   # a tile with allowed entries marked absent
    with pytest.raises(ValueError, match=r"tile \(b=0, h=0, q tile 3, kv tile 1\) is absent but its mask"):
        sdpa_forward(q, k, v, block_mask=BlockMask.from_tiles(dropped, block_size=T, mask_mod=causal),
                     enable_gqa=True)
    filled = np.array(bm.tiles)
    filled[0, 0, 2, 2] = 2                                    # a diagonal tile marked full
    with pytest.raises(ValueError, match=r"q tile 2, kv tile 2\) is full but its mask function masks"):
        sdpa_forward(q, k, v, block_mask=BlockMask.from_tiles(filled, block_size=T, mask_mod=causal),
                     enable_gqa=True)


def test_bad_block_masks_are_clear_errors():
    q, k, v = _inputs()
    bm = BlockMask.from_mask_mod(causal, 1, 1, L, S, block_size=T)
    with pytest.raises(ValueError, match="ceil"):
        sdpa_forward(q[..., :20, :], k, v, block_mask=BlockMask.from_mask_mod(causal, 1, 1, L, S, block_size=16),
                     enable_gqa=True)
    with pytest.raises(ValueError, match="`block_size` should be None or the block mask's tile 8"):
        sdpa_forward(q, k, v, block_mask=bm, method="tiled", block_size=16, enable_gqa=True)
    with pytest.raises(ValueError, match="`mask_mod` should not be given beside `block_mask`"):
        sdpa_forward(q, k, v, block_mask=bm, mask_mod=sliding, enable_gqa=True)
    with pytest.raises(TypeError, match="`block_mask` should be a sdpa_ref.BlockMask"):
        sdpa_forward(q, k, v, block_mask=np.ones((L, S), bool), enable_gqa=True)
    n, i = np.ones((1, 1, 2), np.int64), np.zeros((1, 1, 2, 3), np.int64)
    with pytest.raises(ValueError, match="name each tile once"):
        BlockMask(2 * n, i)
    with pytest.raises(ValueError, match=r"`kv_indices` should name key tiles in \[0, 3\)"):
        BlockMask(n, i + 5)
    with pytest.raises(ValueError, match=r"`kv_num_blocks` should be in \[0, 3\]"):
        BlockMask(n * 4, i)
    with pytest.raises(ValueError, match="should be given together"):
        BlockMask(n, i, full_kv_num_blocks=n)
    with pytest.raises(TypeError, match="`bits` should be a uint8 array"):
        BlockMask.from_bits(np.ones((1, 1, 2, 1)), 3)
    with pytest.raises(ValueError, match="should not both mark a tile"):
        BlockMask.from_bits(np.ones((1, 1, 2, 1), np.uint8), 3, full_bits=np.ones((1, 1, 2, 1), np.uint8))
    with pytest.raises(TypeError, match="`block_size` should be an int >= 1"):
        BlockMask(n, i, block_size=0)


def test_the_split_engine_walks_each_split_on_the_tile_grid():
    q, k, v = (x[:, :, :16] for x in _inputs(6))
    bm = BlockMask.from_mask_mod(causal, 1, 1, 16, 16, block_size=4)
    _, res = sdpa_forward(q, k, v, block_mask=bm, method="split", num_splits=2, enable_gqa=True)
    c = res.tile_counts                               # 16 tiles; each split's blocks are tiles of its own keys
    assert c["absent"] + c["full"] + c["partial"] <= 2 * 16 and c["partial"] == 4, c
    out, _ = sdpa_forward(q, k, v, is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(sdpa_forward(q, k, v, block_mask=bm, method="split", num_splits=2,
                                            enable_gqa=True)[0], out, rtol=F64_SUMS, atol=F64_REGROUPED)


def test_only_the_tiled_engines_count_tiles_and_empty_problems_work():
    q, k, v = (x[:, :, :4] for x in _inputs(7))
    bm = BlockMask.from_mask_mod(causal, 1, 1, 4, 4, block_size=8)     # one tile: the whole problem
    _, res = sdpa_forward(q, k, v, block_mask=bm, method="plain", enable_gqa=True)
    assert res.tile_counts == {"absent": 0, "full": 0, "partial": 0}
    z = np.zeros((1, 1, 0, 3))
    for m in ("plain", "fast", "tiled"):
        out, _ = sdpa_forward(z, z, z, block_mask=BlockMask.from_mask_mod(causal, 1, 1, 0, 0), method=m)
        assert out.shape == (1, 1, 0, 3)


def test_more_bad_block_masks_are_clear_errors():
    n, i = np.ones((1, 1, 2), np.int64), np.zeros((1, 1, 2, 3), np.int64)
    with pytest.raises(ValueError, match="should have .B, H. that broadcast"):
        BlockMask(np.ones((2, 1, 2), np.int64), np.zeros((3, 1, 2, 3), np.int64))
    with pytest.raises(TypeError, match="`n_kv_tiles` should be an int"):
        BlockMask.from_bits(np.ones((1, 1, 2, 1), np.uint8), 3.5)
    with pytest.raises(ValueError, match="`full_bits` should have the rows of tiles"):
        BlockMask.from_bits(np.ones((1, 1, 2, 1), np.uint8), 3, full_bits=np.zeros((1, 1, 3, 1), np.uint8))
    with pytest.raises(TypeError, match="`mask_mod` should be a callable"):
        BlockMask.from_mask_mod(None, 1, 1, 4, 4)
    with pytest.raises(TypeError, match="`mask_mod` should be a callable"):
        BlockMask.from_tiles(np.zeros((1, 1, 1, 1), np.int8), mask_mod=3)
    assert BlockMask(n, i).tiles.shape == (1, 1, 2, 3)
