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


def test_a_model_axis_gives_each_model_its_own_layers():
    """With a leading model axis on the parameters and the inputs, model m's outputs and gradients are those of its
    own parameters on its own inputs (a loop over the models is the oracle), and every backward is the forward's
    VJP."""
    M = 3
    x = rng.standard_normal((M, 2, 3, 4))
    w, b = rng.standard_normal((M, 4, 4)) * 0.5, rng.standard_normal((M, 4))
    gm, bt = rng.standard_normal((M, 4)), rng.standard_normal((M, 4))
    ws = [rng.standard_normal((M, 4, 4)) * 0.5 for _ in range(4)]
    ids, table = rng.integers(0, 5, (M, 2, 3)), rng.standard_normal((M, 5, 4))
    g = rng.standard_normal((M, 2, 3, 4))
    layers = {
        "linear": (lambda x, w, b: nn.linear(x, w, b), nn.linear_backward, (x, w, b)),
        "layer_norm": (lambda x, gm, bt: nn.layer_norm(x, gm, bt), nn.layer_norm_backward, (x, gm, bt)),
        "multi_head_attention": (lambda x, *ws: nn.multi_head_attention(x, *ws, 2),
                                 nn.multi_head_attention_backward, (x, *ws)),
    }
    for name, (fwd, bwd, args) in layers.items():
        y, cache = fwd(*args)
        grads = bwd(cache, g)
        for m in range(M):
            ym, cm = fwd(*(a[m] for a in args))
            np.testing.assert_allclose(y[m], ym, rtol=F64_SUMS, atol=F64_SUMS, err_msg=name)
            for got, want in zip(grads, bwd(cm, g[m])):
                np.testing.assert_allclose(got[m], want, rtol=F64_AMPLIFIED, atol=F64_AMPLIFIED, err_msg=name)
        assert_vjp(lambda *a: fwd(*a)[0], lambda gg, *a: bwd(fwd(*a)[1], gg), args, rtol=FD)
    y, cache = nn.embedding(ids, table)
    dtable = nn.embedding_backward(cache, g)
    for m in range(M):
        np.testing.assert_array_equal(y[m], table[m][ids[m]])
        np.testing.assert_array_equal(dtable[m], nn.embedding_backward(nn.embedding(ids[m], table[m])[1], g[m]))
    # Adam with per_model: each model clipped by its own norm, as if it were stepped alone
    params = {"w": w, "b": b}
    grads = {"w": rng.standard_normal((M, 4, 4)) * np.array([0.01, 1, 10])[:, None, None], "b": b * 0}
    new, _ = nn.adam_update(params, grads, nn.adam_init(params), max_grad_norm=1.0, per_model=True)
    for m in range(M):
        alone = {k: v[m] for k, v in params.items()}
        want, _ = nn.adam_update(alone, {k: v[m] for k, v in grads.items()}, nn.adam_init(alone), max_grad_norm=1.0)
        for k in params:
            np.testing.assert_allclose(new[k][m], want[k], rtol=ADAM_EPS_TERM, atol=ADAM_EPS_TERM)
