"""Finite-difference checks of every backward in examples/nn.py, the hand-differentiated layers of the examples
and the tutorials (a script's module, not the package's: loaded here from its file)."""

import importlib.util
import pathlib

import numpy as np
import pytest

from sdpa_ref import assert_vjp

NN_PY = pathlib.Path(__file__).resolve().parents[1] / "examples" / "nn.py"
if not NN_PY.exists():
    pytest.skip("examples not shipped beside the tests", allow_module_level=True)
_spec = importlib.util.spec_from_file_location("nn", NN_PY)
nn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nn)
from tolerances import ADAM_EPS_TERM, F64_AMPLIFIED, F64_SUMS, FD

rng = np.random.default_rng(0)


def test_linear():
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    assert_vjp(lambda x, w, b: nn.linear(x, w, b)[0],
               lambda g, x, w, b: nn.linear_backward(nn.linear(x, w, b)[1], g), (x, w, b), rtol=FD)
    assert nn.linear_backward(nn.linear(x, w)[1], np.ones((2, 3, 5)))[2] is None


def test_relu():
    x = rng.standard_normal((3, 4))
    x[np.abs(x) < 1e-3] = 0.5          # keep away from the kink
    assert_vjp(lambda x: nn.relu(x)[0], lambda g, x: (nn.relu_backward(nn.relu(x)[1], g),), (x,), rtol=FD)


def test_layer_norm():
    x, gm, bt = rng.standard_normal((2, 3, 6)) * 2 + 1, rng.standard_normal(6), rng.standard_normal(6)
    assert_vjp(lambda x, gm, bt: nn.layer_norm(x, gm, bt)[0],
               lambda g, x, gm, bt: nn.layer_norm_backward(nn.layer_norm(x, gm, bt)[1], g), (x, gm, bt), rtol=FD)
    y, _ = nn.layer_norm(x, np.ones(6), np.zeros(6))
    np.testing.assert_allclose(y.mean(-1), 0, atol=F64_AMPLIFIED)


def test_embedding():
    ids = np.array([[0, 2, 2], [1, 0, 3]])
    table = rng.standard_normal((4, 5))
    assert_vjp(lambda t: nn.embedding(ids, t)[0], lambda g, t: (nn.embedding_backward(nn.embedding(ids, t)[1], g),),
               (table,), rtol=FD)
    with pytest.raises(TypeError, match="`ids`"):
        nn.embedding(np.array([0.5]), table)


def test_softmax_cross_entropy():
    logits = rng.standard_normal((2, 3, 5))
    t = rng.integers(0, 5, (2, 3))
    w = (rng.random((2, 3)) > 0.3).astype(float)
    w[0, 0] = 1.0
    f = lambda z: np.array(nn.softmax_cross_entropy(z, t, w)[0])  # noqa: E731
    assert_vjp(f, lambda g, z: (nn.softmax_cross_entropy_backward(nn.softmax_cross_entropy(z, t, w)[1], float(g)),),
               (logits,), rtol=FD)
    # the loss itself against a plain formula
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want = -(w * np.log(np.take_along_axis(p, t[..., None], -1)[..., 0])).sum() / w.sum()
    np.testing.assert_allclose(f(logits), want, rtol=F64_SUMS)


@pytest.mark.parametrize("scale", [None, 1.0])
@pytest.mark.parametrize("causal", [True, False])
def test_multi_head_attention(scale, causal):
    x = rng.standard_normal((2, 3, 4))
    ws = [rng.standard_normal((4, 4)) * 0.5 for _ in range(4)]

    def f(x, wq, wk, wv, wo):
        return nn.multi_head_attention(x, wq, wk, wv, wo, 2, is_causal=causal, scale=scale)[0]

    def vjp(g, x, wq, wk, wv, wo):
        return nn.multi_head_attention_backward(
            nn.multi_head_attention(x, wq, wk, wv, wo, 2, is_causal=causal, scale=scale)[1], g)

    assert_vjp(f, vjp, (x, *ws), rtol=FD)


def test_adam_moves_against_the_gradient_and_does_not_mutate():
    p = {"w": np.array([1.0, -2.0])}
    g = {"w": np.array([0.5, -0.5])}
    st = nn.adam_init(p)
    p2, st2 = nn.adam_update(p, g, st, lr=0.1)
    np.testing.assert_allclose(p2["w"], [0.9, -1.9], rtol=ADAM_EPS_TERM)   # first step: lr * sign(g)
    np.testing.assert_array_equal(p["w"], [1.0, -2.0])
    assert st["t"] == 0 and st2["t"] == 1
    p3, _ = nn.adam_update(p, {"w": np.array([30.0, 40.0])}, st, lr=0.1, max_grad_norm=5.0)
    np.testing.assert_allclose(p3["w"], [0.9, -2.1], rtol=ADAM_EPS_TERM)
