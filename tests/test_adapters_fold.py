"""The adapters' batch folding: the harness's (..., H, L, E) arrays to (B, H, L, E) and back, with NumPy alone."""

import numpy as np

from sdpa_ref.adapters._fold import Folded


def _inputs(rng, qb, kb, hq=4, hkv=2, L=3, S=5, E=4, Ev=6):
    return (rng.standard_normal(qb + (hq, L, E)), rng.standard_normal(kb + (hkv, S, E)),
            rng.standard_normal(kb + (hkv, S, Ev)))


def test_fold_broadcasts_the_batch_and_unfold_restores_it():
    q, k, v = _inputs(np.random.default_rng(0), (3, 2), (1, 2))
    f = Folded(q, k, v)
    assert f.batch == (3, 2) and f.n == 6
    assert f.q.shape == (6, 4, 3, 4) and f.k.shape == (6, 2, 5, 4) and f.v.shape == (6, 2, 5, 6)
    np.testing.assert_array_equal(f.q[4], q[2, 0])                  # batch (2, 0) is row 2 * 2 + 0
    np.testing.assert_array_equal(f.k[4], k[0, 0])                  # the key broadcast over the first axis
    assert f.out_shape == (3, 2, 4, 3, 6)
    np.testing.assert_array_equal(f.unfold(f.q), q)


def test_unfold_sums_a_gradient_over_the_axes_its_input_broadcast():
    q, k, v = _inputs(np.random.default_rng(1), (3, 2), (1, 2))
    f = Folded(q, k, v)
    dk_folded = np.ones((6,) + k.shape[-3:])
    dk = f.unfold(dk_folded, 1)
    assert dk.shape == k.shape
    np.testing.assert_array_equal(dk, np.full(k.shape, 3.0))        # three batch rows shared each key


def test_scores_and_a_bias_gradient_of_the_bias_shape():
    q, k, v = _inputs(np.random.default_rng(2), (2,), (2,))
    f = Folded(q, k, v)
    bias = np.arange(15.0).reshape(3, 5)                            # (L, S), shared by batch and heads
    b = f.scores(bias, np.float32)
    assert b.shape == (2, 4, 3, 5) and b.dtype == np.float32
    np.testing.assert_array_equal(b[1, 3], bias)
    db = f.unfold(np.ones((2, 4, 3, 5)), shape=bias.shape)
    np.testing.assert_array_equal(db, np.full((3, 5), 8.0))          # summed over 2 batch rows x 4 heads


def test_rank_2_inputs_gain_and_lose_one_head():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 6))
    f = Folded(q, k, v)
    assert f.q.shape == (1, 1, 3, 4) and f.out_shape == (1, 3, 6)
    assert f.unfold(np.zeros((1, 1, 3, 6))).shape == (3, 6)
    assert f.unfold(f.k, 1).shape == (5, 4)
    assert f.scores(np.ones((3, 5), bool)).shape == (1, 1, 3, 5)


def test_inputs_are_not_mutated_and_results_do_not_alias_them():
    q, k, v = _inputs(np.random.default_rng(4), (2,), (2,))
    before = [x.copy() for x in (q, k, v)]
    f = Folded(q, k, v)
    f.q[...] = 0
    for x, y in zip((q, k, v), before):
        np.testing.assert_array_equal(x, y)
