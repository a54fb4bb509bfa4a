"""The block summary of an allowed set (``engines/blocks.py``): the query blocks' key spans and their cover by
rectangles, which the fast engine's products and row passes walk (``tests/test_engines_fast.py`` holds the
engine's results to the plain engine's with them)."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sdpa_ref.engines.blocks import key_spans, rectangles, span_rows
from sdpa_ref.masks import allowed_set


def _masks(L, S, seed):
    rng = np.random.default_rng(seed)
    yield allowed_set(L, S, is_causal=True)
    yield allowed_set(L, S, is_causal=True, alignment="bottom_right")
    yield allowed_set(L, S, window=(int(rng.integers(0, 9)), int(rng.integers(-2, 5))))
    yield allowed_set(L, S, chunk=int(rng.integers(1, 9)))
    yield allowed_set(L, S, is_causal=True, kv_lengths=rng.integers(0, S + 1, size=(2,)), mask=None)
    yield rng.random((2, 1, L, S)) < 0.2
    yield np.zeros((L, S), bool)


@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 9), st.integers(0, 2 ** 31))
def test_spans_hold_every_allowed_entry_and_the_rectangles_cover_them_once(L, S, b, seed):
    for allowed in _masks(L, S, seed):
        if allowed is None:
            continue
        summ = key_spans(allowed, L, S, b)
        some = np.broadcast_to(allowed, np.broadcast_shapes(allowed.shape, (L, S))).reshape(-1, L, S).any(0)
        every = np.broadcast_to(allowed, np.broadcast_shapes(allowed.shape, (L, S))).reshape(-1, L, S).all(0)
        if summ is None:                                    # nothing to skip: every block spans every key
            for i in range(0, L, b):
                cols = np.flatnonzero(some[i:i + b].any(0))
                assert len(cols) == 0 or (cols[0] < 8 and cols[-1] >= (S - 1) // 8 * 8)
            continue
        hull = np.zeros((L, S), bool)
        for n, (i0, i1, j0, j1) in enumerate(summ.spans):
            assert (i0, i1) == (n * b, min(L, n * b + b))
            assert j0 % 8 == 0 and (j1 % 8 == 0 or j1 == S) and j1 > j0
            hull[i0:i1, j0:j1] = True
        assert not (some & ~hull).any()                      # no allowed entry outside the spans
        cover = np.zeros((L, S), int)
        for i0, i1, j0, j1 in summ.rects:
            cover[i0:i1, j0:j1] += 1
            if summ.is_full(i0, i1, j0, j1):
                assert every[i0:i1, j0:j1].all()
        np.testing.assert_array_equal(cover, hull.astype(int))  # each entry of the spans in one rectangle


def test_a_causal_cover_is_squares_of_halving_sizes_and_the_diagonal_blocks():
    L, b = 1024, span_rows(1024)
    summ = key_spans(np.tril(np.ones((L, L), bool)), L, L, b)
    sizes = sorted(((i1 - i0, j1 - j0) for i0, i1, j0, j1 in summ.rects), reverse=True)
    assert sizes[:3] == [(512, 512), (256, 256), (256, 256)]
    assert sizes.count((b, b)) == L // b + L // (2 * b)     # the diagonal blocks, and the last level's squares
    assert rectangles([]) == []
    assert key_spans(None, L, L, b) is None and key_spans(np.ones((1, L), bool), L, L, b) is None
