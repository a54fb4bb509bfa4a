"""The double backward against JAX's: ``jax.jvp`` of ``jax.vjp`` of attention written plainly in ``jax.numpy``
(its math path, differentiated by JAX's own rules), to 1e-10, over a grid of the options both express.

JAX is an optional extra: this module skips without it. (PyTorch's double backward on its math path would be the
same kind of oracle; its CPU wheels could not be installed where this was written.)
"""

import itertools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

from sdpa_ref import sdpa_backward_jvp  # noqa: E402
from tolerances import F64_GRAD, F64_GRAD_ORACLE

B, HQ, L, S, E, EV = 2, 4, 3, 5, 3, 2


def jax_attention(q, k, v, bias, sinks, *, hkv, causal, softcap, keep, p):
    """O and LSE, every step as the textbook writes it."""
    g = HQ // hkv
    k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
    t = jnp.einsum("bhle,bhse->bhls", q, k) / np.sqrt(E)
    if softcap is not None:
        t = softcap * jnp.tanh(t / softcap)
    if bias is not None:
        t = t + bias
    if causal:
        t = jnp.where(np.tril(np.ones((L, S), dtype=bool)), t, -jnp.inf)
    if sinks is not None:
        col = jnp.broadcast_to(sinks[None, :, None, None], t.shape[:-1] + (1,))
        t = jnp.concatenate([t, col], axis=-1)
    lse = jax.scipy.special.logsumexp(t, axis=-1)
    prob = jnp.exp(t - lse[..., None])
    if sinks is not None:
        prob = prob[..., :-1]
    if keep is not None:
        prob = prob * keep / (1 - p)
    return jnp.einsum("bhls,bhse->bhle", prob, v), lse


GRID = list(itertools.product((False, True), (None, 1.5), (False, True), (False, True), (False, True),
                              (2, 4), (False, True)))


@pytest.mark.parametrize("causal, softcap, bias, sinks, dropout, hkv, with_lse", GRID[::3] + GRID[1::7])
def test_double_backward_matches_jax(causal, softcap, bias, sinks, dropout, hkv, with_lse):
    rng = np.random.default_rng(hash((causal, softcap, bias, sinks, dropout, hkv, with_lse)) % 2**32)
    q, k, v = rng.standard_normal((B, HQ, L, E)), rng.standard_normal((B, hkv, S, E)), \
        rng.standard_normal((B, hkv, S, EV))
    b = rng.standard_normal((HQ, L, S)) if bias else None
    s = rng.uniform(-1, 2, HQ) if sinks else None
    keep = rng.random((B, HQ, L, S)) > 0.3 if dropout else None
    g, gl = rng.standard_normal((B, HQ, L, EV)), (rng.standard_normal((B, HQ, L)) if with_lse else None)
    tq, tk, tv = (rng.standard_normal(x.shape) for x in (q, k, v))
    tb = rng.standard_normal(b.shape) if bias else None
    ts = rng.standard_normal(s.shape) if sinks else None
    tg, tgl = rng.standard_normal(g.shape), (rng.standard_normal(gl.shape) if with_lse else None)

    kw = dict(hkv=hkv, causal=causal, softcap=softcap, keep=keep, p=0.3)

    def grads(q, k, v, b, s, g, gl):
        _, pull = jax.vjp(lambda *x: jax_attention(*x, **kw), q, k, v, b, s)
        return pull((g, gl if gl is not None else jnp.zeros((B, HQ, L))))

    primals = (q, k, v, b, s, g, gl)
    tangents = (tq, tk, tv, tb, ts, tg, tgl)
    keepx = [i for i, x in enumerate(primals) if x is not None]

    def f(*xs):
        full = list(primals)
        for i, x in zip(keepx, xs):
            full[i] = x
        return grads(*full)

    want, want_t = jax.jvp(f, tuple(primals[i] for i in keepx), tuple(tangents[i] for i in keepx))
    opts = dict(is_causal=causal, softcap=softcap, bias=b, sinks=s, enable_gqa=hkv != HQ)
    if dropout:
        opts.update(dropout_p=0.3, dropout_mask=keep)
    gr, gt = sdpa_backward_jvp((q, k, v), (tq, tk, tv, tb, ts), g, tg, grad_lse=gl, grad_lse_tangent=tgl, **opts)
    for name, w, wt in zip(("query", "key", "value", "bias", "sinks"), want, want_t):
        if w is None:
            continue
        np.testing.assert_allclose(getattr(gr, name), np.asarray(w), rtol=F64_GRAD_ORACLE, atol=F64_GRAD, err_msg=name)
        np.testing.assert_allclose(getattr(gt, name), np.asarray(wt), rtol=F64_GRAD_ORACLE, atol=F64_GRAD,
                                   err_msg=f"the tangent of {name}")
