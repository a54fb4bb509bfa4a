"""Second order against PyTorch's double backward, to 1e-10.

PyTorch differentiates its gradients by running autograd on the graph of its backward
(``torch.autograd.grad(..., create_graph=True)``, then ``grad`` of the gradients along a direction: the
Hessian-vector product, reverse over reverse). Two oracles, in float64:

* ``F.scaled_dot_product_attention`` on its math path (``SDPBackend.MATH``) for the options it has: causal, a
  bool mask, an additive float mask (whose tangent is ``sdpa_hvp``'s bias tangent), the scale, GQA;
* the same attention written plainly in ``torch`` for what PyTorch's SDPA lacks: softcap, sinks, dropout with a
  given keep mask, and a loss that reads the LSE.

PyTorch is an optional extra: the module skips without it (``.ci/run`` installs the CPU build for it).
"""

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from sdpa_ref import sdpa_hvp  # noqa: E402

from tolerances import F64_GRAD_ORACLE  # noqa: E402

B, HQ, L, S, E, EV = 2, 4, 5, 6, 3, 2


def _t(x):
    return torch.tensor(x, dtype=torch.float64, requires_grad=True)


def _torch_hvp(loss_of, primals, directions):
    """H u of ``loss_of(*primals)`` by PyTorch's double backward."""
    xs = [_t(p) for p in primals]
    grads = torch.autograd.grad(loss_of(*xs), xs, create_graph=True)
    hv = torch.autograd.grad(grads, xs, grad_outputs=[torch.tensor(u) for u in directions], allow_unused=True)
    return [np.zeros_like(p) if h is None else h.detach().numpy() for h, p in zip(hv, primals)]


def _close(got, want, what):
    scale = max(float(np.abs(want).max()), 1e-300)
    err = float(np.abs(got - want).max()) / scale
    assert err <= F64_GRAD_ORACLE, f"{what}: normwise relative difference {err:.3e} from PyTorch's double backward"


SDPA_GRID = list(itertools.product((False, True), ("none", "bool", "float"), (None, 0.7), (2, 4)))


@pytest.mark.parametrize("causal, mask, scale, hkv", SDPA_GRID)
def test_hvp_matches_torch_sdpa_math_double_backward(causal, mask, scale, hkv):
    rng = np.random.default_rng(abs(hash((causal, mask, scale, hkv))) % 2**32)
    q, k, v = rng.standard_normal((B, HQ, L, E)), rng.standard_normal((B, hkv, S, E)), \
        rng.standard_normal((B, hkv, S, EV))
    g = rng.standard_normal((B, HQ, L, EV))
    bm = rng.random((L, S)) < 0.7 if mask == "bool" else None
    if bm is not None:
        bm[:, 0] = True                                   # no row left without a key (PyTorch's policy differs)
    fm = rng.standard_normal((HQ, L, S)) if mask == "float" else None
    primals = [q, k, v] + ([fm] if fm is not None else [])
    dirs = [rng.standard_normal(p.shape) for p in primals]

    tril = torch.tensor(np.tril(np.ones((L, S), bool)))

    def loss(q_, k_, v_, *m):
        am = m[0] if m else (None if bm is None else torch.tensor(bm))
        if causal and am is not None:                     # PyTorch refuses a mask with is_causal: folded in
            am = am & tril if am.dtype == torch.bool else am + torch.where(tril, 0.0, -torch.inf)
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=am, is_causal=causal and am is None,
                                                 scale=scale, enable_gqa=hkv != HQ)
        return (out * torch.tensor(g)).sum()

    want = _torch_hvp(loss, primals, dirs)
    got = sdpa_hvp((q, k, v), tuple(dirs[:3]) + ((dirs[3],) if fm is not None else ()), g, is_causal=causal,
                   attn_mask=bm, bias=fm, scale=scale, enable_gqa=hkv != HQ)
    for name, w in zip(("query", "key", "value", "bias"), want):
        _close(getattr(got, name), w, name)


def _plain_torch(q, k, v, sinks, *, cap, keep, p, hkv, gated=False):
    """O and the LSE, as the textbook writes them (``gated``: the score function ``t tanh(t) + t / 2``)."""
    g = HQ // hkv
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    t = q @ k.transpose(-1, -2) / np.sqrt(E)
    if cap is not None:
        t = cap * torch.tanh(t / cap)
    if gated:
        t = t * torch.tanh(t) + 0.5 * t
    if sinks is not None:
        t = torch.cat([t, sinks[None, :, None, None].expand(t.shape[:-1] + (1,))], dim=-1)
    lse = torch.logsumexp(t, dim=-1)
    prob = torch.exp(t - lse[..., None])
    if sinks is not None:
        prob = prob[..., :-1]
    if keep is not None:
        prob = prob * torch.tensor(keep) / (1 - p)
    return prob @ v, lse


PLAIN_GRID = list(itertools.product((None, 1.5), (False, True), (False, True), (False, True), (2, 4)))


@pytest.mark.parametrize("cap, sinks, dropout, with_lse, hkv", PLAIN_GRID)
def test_hvp_matches_torch_double_backward_beyond_sdpa(cap, sinks, dropout, with_lse, hkv):
    rng = np.random.default_rng(abs(hash((cap, sinks, dropout, with_lse, hkv))) % 2**32)
    q, k, v = rng.standard_normal((B, HQ, L, E)), rng.standard_normal((B, hkv, S, E)), \
        rng.standard_normal((B, hkv, S, EV))
    s = rng.uniform(-1, 2, HQ) if sinks else None
    keep = rng.random((B, HQ, L, S)) > 0.3 if dropout else None
    g, gl = rng.standard_normal((B, HQ, L, EV)), rng.standard_normal((B, HQ, L))
    primals = [q, k, v] + ([s] if sinks else [])
    dirs = [rng.standard_normal(x.shape) for x in primals]

    def loss(q_, k_, v_, *sk):
        out, lse = _plain_torch(q_, k_, v_, sk[0] if sk else None, cap=cap, keep=keep, p=0.3, hkv=hkv)
        return (out * torch.tensor(g)).sum() + ((lse * torch.tensor(gl)).sum() if with_lse else 0)

    want = _torch_hvp(loss, primals, dirs)
    opts = dict(softcap=cap, sinks=s, enable_gqa=hkv != HQ)
    if dropout:
        opts.update(dropout_p=0.3, dropout_mask=keep)
    for method in ("plain", "tiled"):
        got = sdpa_hvp((q, k, v), tuple(dirs[:3]) + ((None, dirs[3]) if sinks else ()), g,
                       grad_lse=gl if with_lse else None, method=method, **opts)
        for name, w in zip(("query", "key", "value", "sinks"), want):
            _close(getattr(got, name), w, f"{name} ({method})")


@pytest.mark.parametrize("cap, sinks", list(itertools.product((None, 1.5), (False, True))))
def test_hvp_through_a_score_function_matches_torch(cap, sinks):
    from sdpa_ref import ScoreMod

    rng = np.random.default_rng(abs(hash((cap, sinks, "gated"))) % 2**32)
    q, k, v = rng.standard_normal((B, HQ, L, E)), rng.standard_normal((B, 2, S, E)), rng.standard_normal((B, 2, S, EV))
    s = rng.uniform(-1, 2, HQ) if sinks else None
    g = rng.standard_normal((B, HQ, L, EV))
    primals = [q, k, v] + ([s] if sinks else [])
    dirs = [rng.standard_normal(x.shape) for x in primals]

    def loss(q_, k_, v_, *sk):
        out, _ = _plain_torch(q_, k_, v_, sk[0] if sk else None, cap=cap, keep=None, p=0.0, hkv=2, gated=True)
        return (out * torch.tensor(g)).sum()

    want = _torch_hvp(loss, primals, dirs)
    mod = ScoreMod(lambda t, *r: t * np.tanh(t) + 0.5 * t, grad=lambda t, *r: np.tanh(t) + t / np.cosh(t) ** 2 + 0.5)
    for method in ("plain", "tiled"):
        got = sdpa_hvp((q, k, v), tuple(dirs[:3]) + ((None, dirs[3]) if sinks else ()), g, softcap=cap, sinks=s,
                       score_mod=mod, enable_gqa=True, method=method)
        for name, w in zip(("query", "key", "value", "sinks"), want):
            _close(getattr(got, name), w, f"{name} ({method})")
