"""sdpa_ref.testing: a kernel's own results judged on its own inputs, honest kernels passing and wrong ones caught
with a message that locates the error."""

import re

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref.testing import _host, assert_attention_close, check_attention_close

ml_dtypes = pytest.importorskip("ml_dtypes")


def honest(q, k, v, g=None, *, scale=None, causal=False, work=np.float32):
    """A plain kernel computing in ``work`` and returning the inputs' dtype: ``(out, lse, (dq, dk, dv))``."""
    dt = q.dtype
    q, k, v = (x.astype(work) for x in (q, k, v))
    s = work(q.shape[-1] ** -0.5 if scale is None else scale)
    S = (q @ np.swapaxes(k, -1, -2)) * s
    if causal:
        S = np.where(np.tril(np.ones(S.shape[-2:], bool)), S, -np.inf)
    m = S.max(-1, keepdims=True)
    P = np.exp(S - m)
    l = P.sum(-1, keepdims=True)
    P = P / l
    out, lse = P @ v, (m + np.log(l))[..., 0]
    grads = None
    if g is not None:
        g = g.astype(work)
        dP = g @ np.swapaxes(v, -1, -2)
        dS = P * (dP - (P * dP).sum(-1, keepdims=True)) * s
        grads = tuple(x.astype(dt) for x in (dS @ k, np.swapaxes(dS, -1, -2) @ q, np.swapaxes(P, -1, -2) @ g))
    return out.astype(dt), lse, grads


def draw(dt, shape=(2, 3, 24, 16), seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dt) for _ in range(4))


@pytest.mark.parametrize("dt", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_an_honest_kernel_passes_out_lse_and_gradients(dt, causal):
    q, k, v, g = draw(dt)
    out, lse, grads = honest(q, k, v, g, causal=causal)
    report = check_attention_close(out, q, k, v, lse=lse, grads=grads, grad_out=g, is_causal=causal)
    assert report.ok and [r.quantity for r in report.rows] == ["out", "lse", "dq", "dk", "dv"], str(report)
    assert_attention_close(out, q, k, v, lse=lse, grads=grads, grad_out=g, is_causal=causal)


def test_a_one_percent_scale_error_fails_naming_out_and_the_worst_element():
    q, k, v, g = draw(np.float32)
    out, _, _ = honest(q, k, v, scale=1.01 * 16 ** -0.5, causal=True)
    with pytest.raises(AssertionError) as err:
        assert_attention_close(out, q, k, v, is_causal=True)
    msg = str(err.value)
    assert "`out`" in msg and re.search(r"at index \(\d+, \d+, \d+, \d+\) \(kernel .*, reference .*\)", msg), msg
    assert re.search(r"\d+ of 2304 elements exceed it", msg) and "allowed" in msg


def flash_style(q, k, v, g, scale=None):
    """FlashAttention's bfloat16 rounding: float32 work, the unnormalised ``P`` rounded to bfloat16 before
    ``P V``, ``P`` and ``dS`` before the gradients' products; causal."""
    f, bf = np.float32, ml_dtypes.bfloat16
    q, k, v, g = (x.astype(f) for x in (q, k, v, g))
    s = f(q.shape[-1] ** -0.5 if scale is None else scale)
    S = np.where(np.tril(np.ones((q.shape[-2], k.shape[-2]), bool)), (q @ np.swapaxes(k, -1, -2)) * s, -np.inf)
    E = np.exp(S - S.max(-1, keepdims=True))
    l = E.sum(-1, keepdims=True)
    o = (E.astype(bf).astype(f) @ v) / l
    P = E / l
    dS = P * (g @ np.swapaxes(v, -1, -2) - (o.astype(bf).astype(f) * g).sum(-1, keepdims=True)) * s
    dS, Pb = dS.astype(bf).astype(f), P.astype(bf).astype(f)
    return o.astype(bf), tuple(x.astype(bf) for x in (dS @ k, np.swapaxes(dS, -1, -2) @ q, np.swapaxes(Pb, -1, -2) @ g))


@pytest.mark.parametrize("shape", [(2, 3, 24, 16), (1, 4, 128, 64)])
@pytest.mark.parametrize("kernel", [honest, flash_style])
def test_in_bfloat16_the_spread_catches_a_one_percent_scale_error(shape, kernel):
    """The largest error cannot (it stays within 3x the honest kernels'); the RMS error can: 2.8x and more the
    honest kernels' largest RMS, where honest kernels (FlashAttention's roundings included) stay under 1.0x."""
    q, k, v, g = draw(ml_dtypes.bfloat16, shape)
    wrap = (lambda *a, **kw: honest(*a, causal=True, **kw)[::2]) if kernel is honest else flash_style
    out, grads = wrap(q, k, v, g)
    report = check_attention_close(out, q, k, v, grads=grads, grad_out=g, is_causal=True)
    assert report.ok, str(report)
    out, grads = wrap(q, k, v, g, scale=1.01 * shape[-1] ** -0.5)
    report = check_attention_close(out, q, k, v, grads=grads, grad_out=g, is_causal=True)
    assert {r.quantity for r in report.rows if r.status != "pass"} == {"out", "dq", "dk", "dv"}, str(report)
    with pytest.raises(AssertionError) as err:
        assert_attention_close(out, q, k, v, is_causal=True)
    msg = str(err.value)
    assert "`out`" in msg and "spread: rms error" in msg and re.search(r"at index \(\d+, \d+, \d+, \d+\)", msg)
    strict = sdpa_ref.harness.rules.RelativeRule(judge_rms=False)    # the harness's rule: the largest error only
    assert check_attention_close(out, q, k, v, is_causal=True, rule=strict).ok


def test_the_spread_is_not_judged_on_small_quantities():
    q, k, v, g = draw(ml_dtypes.bfloat16, (1, 2, 8, 8))            # 128 entries: one entry dominates the mean
    out, _, _ = honest(q, k, v, scale=1.01 * 8 ** -0.5, causal=True)
    report = check_attention_close(out, q, k, v, is_causal=True)
    assert report.ok and not any("spread" in r.note for r in report.rows), str(report)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_wrong_gradient_is_named(which):
    q, k, v, g = draw(np.float32)
    out, lse, grads = honest(q, k, v, g)
    grads = list(grads)
    grads[which] = (grads[which] * np.float32(1.01)).astype(np.float32)
    with pytest.raises(AssertionError, match=f"`{('dq', 'dk', 'dv')[which]}`"):
        assert_attention_close(out, q, k, v, grads=grads, grad_out=g)


def test_the_lse_in_base_2_and_a_wrong_lse():
    q, k, v, _ = draw(np.float32)
    out, lse, _ = honest(q, k, v)
    lse2 = (lse / np.log(2)).astype(np.float32)
    assert_attention_close(out, q, k, v, lse=lse2, lse_base=2)
    with pytest.raises(AssertionError, match="`lse`"):
        assert_attention_close(out, q, k, v, lse=lse2)                    # base 2 read as base e


def test_the_options_reach_the_reference():
    q, k, v, _ = draw(np.float32)
    out, _, _ = honest(q, k, v, causal=True)
    with pytest.raises(AssertionError, match="`out`"):
        assert_attention_close(out, q, k, v)                               # the kernel was causal
    assert_attention_close(out, q, k, v, attn_mask=np.tril(np.ones((24, 24), bool)))


def test_grads_by_mapping_and_record_and_float64():
    q, k, v, g = draw(np.float64)
    out, res = sdpa_ref.sdpa_forward(q, k, v, is_causal=True)
    gr = sdpa_ref.sdpa_backward(res, g)
    assert_attention_close(out, q, k, v, lse=res.lse, grads=gr, grad_out=g, is_causal=True)
    assert_attention_close(out, q, k, v, grads={"dq": gr.query, "dk": gr.key, "dv": gr.value}, grad_out=g,
                           is_causal=True)


@pytest.mark.parametrize("shape", [(4,), (1, 4, 1, 1), ()])
def test_dsinks_are_judged_in_the_sinks_shape(shape):
    q, k, v, g = draw(np.float32, (2, 4, 24, 16))
    sinks = np.linspace(-1, 1, 4).astype(np.float32).reshape(shape) if shape else np.float32(0.5)
    w = [x.astype(np.float64) for x in (q, k, v, g)]
    out, res = sdpa_ref.sdpa_forward(*w[:3], sinks=sinks, is_causal=True)
    gr = sdpa_ref.sdpa_backward(res, w[3])
    grads = [x.astype(np.float32) for x in (gr.query, gr.key, gr.value)] + [np.asarray(gr.sinks, np.float32)]
    assert np.shape(grads[3]) == np.shape(sinks)
    report = check_attention_close(out.astype(np.float32), q, k, v, grads=grads, grad_out=g, sinks=sinks,
                                   is_causal=True)
    assert report.ok and report.rows[-1].quantity == "dsinks", str(report)
    grads[3] = grads[3] * np.float32(1.05)
    with pytest.raises(AssertionError, match="`dsinks`"):
        assert_attention_close(out.astype(np.float32), q, k, v, grads=dict(zip(("dq", "dk", "dv", "dsinks"),
                               grads)), grad_out=g, sinks=sinks, is_causal=True)
    with pytest.raises(ValueError, match="no dsinks when no `sinks`"):
        check_attention_close(out, q, k, v, grads=grads, grad_out=g, is_causal=True)


def test_bshd_and_packed_layouts_are_judged_in_the_kernels_own_shapes():
    q, k, v, g = draw(np.float32)
    sw = lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2))
    out, lse, grads = honest(q, k, v, g, causal=True)
    assert_attention_close(sw(out), sw(q), sw(k), sw(v), lse=lse, grads=[sw(x) for x in grads], grad_out=sw(g),
                           is_causal=True, layout="bshd")
    bad = sw(out).copy()
    bad[1, 7, 2, 3] += np.float32(0.05)
    with pytest.raises(AssertionError, match=r"`out`.*at index \(1, 7, 2, 3\)"):
        assert_attention_close(bad, sw(q), sw(k), sw(v), is_causal=True, layout="bshd")
    # two sequences of 24 queries and keys, packed (thd), against the dense batch of two
    pk = lambda x: sw(x).reshape(48, 3, x.shape[-1])
    lay = sdpa_ref.layouts.Packed(cu_seqlens_q=np.array([0, 24, 48]), cu_seqlens_k=np.array([0, 24, 48]))
    lse_thd = np.swapaxes(lse, 0, 1).reshape(3, 48)                   # FlashAttention's (Hq, total_q)
    assert_attention_close(pk(out), pk(q), pk(k), pk(v), lse=lse_thd, grads=[pk(x) for x in grads],
                           grad_out=pk(g), is_causal=True, layout=lay)
    wrong = pk(out).copy()
    wrong[30] = pk(out)[29]
    with pytest.raises(AssertionError, match=r"`out`.*at index \(30, "):
        assert_attention_close(wrong, pk(q), pk(k), pk(v), is_causal=True, layout=lay)


def test_bad_input_gets_a_clear_error():
    q, k, v, g = draw(np.float32)
    out, _, grads = honest(q, k, v, g)
    with pytest.raises(ValueError, match="`grad_out` should be"):
        check_attention_close(out, q, k, v, grads=grads)
    with pytest.raises(ValueError, match="`grads` should hold"):
        check_attention_close(out, q, k, v, grads=grads[:2], grad_out=g)
    with pytest.raises(TypeError, match="`query` should be an array on the host of real numbers"):
        check_attention_close(out, object(), k, v)
    report = check_attention_close(out[..., :8], q, k, v)                 # a wrong shape is a row, not a crash
    assert not report.ok and "shape" in report.rows[0].note
    with pytest.raises(AssertionError, match="returned dtype float64"):
        assert_attention_close(out.astype(np.float64), q, k, v)            # a float32 kernel returns float32


class _Tensor:
    """A framework tensor seen from outside: ``__dlpack__`` only, or a dtype NumPy lacks (PyTorch's bfloat16),
    read through ``float()``, ``detach()`` and ``cpu()``."""

    def __init__(self, a, dtype=None):
        self.a, self.dtype = a, dtype

    def __dlpack__(self, **kw):
        if self.dtype is not None:
            raise BufferError("bfloat16 is not supported by DLPack in NumPy")
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    def float(self):
        return _Tensor(self.a.astype(np.float32))

    def detach(self):
        return self

    def cpu(self):
        return self


def test_any_framework_by_its_protocols():
    q, k, v, g = draw(ml_dtypes.bfloat16)
    out, lse, grads = honest(q, k, v, g, causal=True)
    wrap = lambda a: _Tensor(a.astype(np.float32), "torch.bfloat16") if a.dtype == ml_dtypes.bfloat16 else _Tensor(a)
    got = _host(wrap(q), "query")
    assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got.astype(np.float32), q.astype(np.float32))
    assert_attention_close(wrap(out), wrap(q), wrap(k), wrap(v), lse=_Tensor(lse),
                           grads=[wrap(x) for x in grads], grad_out=wrap(g), is_causal=True)


def test_a_torch_test_judges_bfloat16_sdpa_and_its_gradients_in_one_line():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=gen, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(2, 4, 32, 16, generator=gen, dtype=torch.bfloat16)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    assert_attention_close(out.detach(), q.detach(), k.detach(), v.detach(), grads=(dq, dk, dv), grad_out=g,
                           is_causal=True)
    # the same with a 1% error in the scale fails, naming `out` and its worst element (the spread catches it)
    wrong = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.01 * 16 ** -0.5)
    dq, dk, dv = torch.autograd.grad(wrong, (q, k, v), g)
    with pytest.raises(AssertionError, match=r"`out`: .* at index \(\d+, \d+, \d+, \d+\)"):
        assert_attention_close(wrong.detach(), q.detach(), k.detach(), v.detach(), grads=(dq, dk, dv),
                               grad_out=g, is_causal=True)


@pytest.mark.parametrize("dt", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("base", ["e", 2])
def test_a_merge_kernel_is_judged_on_its_own_parts(dt, base):
    rng = np.random.default_rng(3)
    out_p = rng.standard_normal((2, 3, 4, 6, 8)).astype(dt)          # the parts on axis 1
    lse_p = rng.uniform(-3, 3, (2, 3, 4, 6)).astype(np.float32)
    lse_p[1, 0, 0, 0] = -np.inf                                     # a part with no key on a row: never read
    out_p[1, 0, 0, 0] = np.nan
    ln = lse_p if base == "e" else (lse_p * np.float32(np.log(2)))   # the natural LSE, for the honest merge
    w = np.exp(ln - ln.max(axis=1, keepdims=True))
    w = np.where(np.isneginf(ln), 0, w)
    o = (np.where(np.isnan(out_p.astype(np.float32)), 0, out_p.astype(np.float32)) * w[..., None]).sum(1)
    o = (o / w.sum(1)[..., None]).astype(dt)
    lse = (ln.max(axis=1) + np.log(w.sum(1))).astype(np.float32)
    lse = lse if base == "e" else (lse / np.float32(np.log(2))).astype(np.float32)
    t = sdpa_ref.testing
    t.assert_merge_close(o, lse, out_p, lse_p, lse_base=base, axis=1)
    bad = o.copy()
    bad[1, 2, 3] = (bad[1, 2, 3].astype(np.float32) * 1.1).astype(dt)
    with pytest.raises(AssertionError, match=r"`out`.*at index \(1, 2, 3, \d\)"):
        t.assert_merge_close(bad, lse, out_p, lse_p, lse_base=base, axis=1)
    with pytest.raises(AssertionError, match="`lse`"):
        t.assert_merge_close(o, lse + np.float32(0.01), out_p, lse_p, lse_base=base, axis=1)
    with pytest.raises(ValueError, match="`axis` should be an int"):
        t.check_merge_close(o, lse, out_p, lse_p, axis=4)
    o64, l64 = sdpa_ref.merge_attention(out_p.astype(np.float64), lse_p.astype(np.float64), lse_base=base, axis=1)
    t.assert_merge_close(o64, l64, out_p.astype(np.float64), lse_p.astype(np.float64), lse_base=base, axis=1)
    with pytest.raises(AssertionError, match="`out`"):                # float64: against the exact merge
        t.assert_merge_close(o64 * (1 + 1e-12), l64, out_p.astype(np.float64), lse_p.astype(np.float64),
                             lse_base=base, axis=1)


def _past_the_end(q, k, v):
    """A float32 kernel that reads one key (and value) row past the end of K and V."""
    k1 = np.lib.stride_tricks.as_strided(k, k.shape[:-2] + (k.shape[-2] + 1, k.shape[-1]), k.strides)
    v1 = np.lib.stride_tricks.as_strided(v, v.shape[:-2] + (v.shape[-2] + 1, v.shape[-1]), v.strides)
    return honest(q, k1, v1)[0]


@pytest.mark.parametrize("fill", ["nan", "huge"])
def test_guarded_inputs_name_a_read_past_the_end(fill):
    t = sdpa_ref.testing
    q, k, v, _ = draw(np.float32)
    qg, kg, vg = (t.guarded(x, fill) for x in (q, k, v))
    assert_attention_close(honest(qg, kg, vg)[0], qg, kg, vg)          # an honest kernel never sees the guards
    with pytest.raises(AssertionError, match=r"`out`.*reads outside its inputs, likely: they were guarded "
                                             rf"\(`query` by {fill}"):
        assert_attention_close(_past_the_end(qg, kg, vg), qg, kg, vg)


def test_a_kernel_writing_into_a_guard_fails_a_guard_row():
    t = sdpa_ref.testing
    q, k, v, _ = draw(np.float32)
    qg, kg, vg = (t.guarded(x) for x in (q, k, v))
    out = honest(qg, kg, vg)[0]
    np.lib.stride_tricks.as_strided(kg, kg.shape[:-2] + (kg.shape[-2] + 1, kg.shape[-1]), kg.strides)[0, 0, -1] = 0
    report = check_attention_close(out, qg, kg, vg)
    assert [r.quantity for r in report.rows] == ["out", "guard"] and report.rows[0].status == "pass"
    assert "writes outside its inputs" in report.rows[1].note and "`key`" in report.rows[1].note
    assert not report.ok


# -- the peers' options of issue 42: each reaches the reference and the honest ensemble, and is judged

def peer_kernel(q, k, v, g, *, allowed=None, bias=None, work=np.float32):
    """A float32 kernel written from a peer's formula: scores ``scale Q K^T + bias``, ``-inf`` where ``allowed``
    is False; ``(out, lse, (dq, dk, dv))`` in the inputs' dtype (every row here has a key)."""
    dt = q.dtype
    q, k, v, g = (x.astype(work) for x in (q, k, v, g))
    s = work(q.shape[-1] ** -0.5)
    S = (q @ np.swapaxes(k, -1, -2)) * s
    if bias is not None:
        S = S + bias.astype(work)
    if allowed is not None:
        S = np.where(allowed, S, -np.inf)
    m = S.max(-1, keepdims=True)
    P = np.exp(S - m)
    l = P.sum(-1, keepdims=True)
    P = P / l
    dP = g @ np.swapaxes(v, -1, -2)
    dS = P * (dP - (P * dP).sum(-1, keepdims=True)) * s
    grads = tuple(x.astype(dt) for x in (dS @ k, np.swapaxes(dS, -1, -2) @ q, np.swapaxes(P, -1, -2) @ g))
    return (P @ v).astype(dt), (m + np.log(l))[..., 0], grads


def _peer_inputs(L=24, S=32):
    rng = np.random.default_rng(42)
    q = rng.standard_normal((2, 3, L, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 3, S, 16)).astype(np.float32) for _ in range(2))
    return q, k, v, rng.standard_normal((2, 3, L, 16)).astype(np.float32)


def _judged(got, q, k, v, g, **options):
    out, lse, grads = got
    return check_attention_close(out, q, k, v, lse=lse, grads=grads, grad_out=g, **options)


def test_q_offset_is_judged():
    """Per-sequence query positions: row i of sequence b at i + q_offset[b] on the keys' axis (causal keeps
    j <= i + q_offset[b]); a kernel that ignores the offset (top-left causal) fails on out."""
    q, k, v, g = _peer_inputs()
    off = np.array([3, 8])
    i, j = np.arange(24)[:, None], np.arange(32)
    honest_got = peer_kernel(q, k, v, g, allowed=(j <= i + off[:, None, None, None]))
    rep = _judged(honest_got, q, k, v, g, is_causal=True, q_offset=off)
    assert rep.ok and [r.quantity for r in rep.rows] == ["out", "lse", "dq", "dk", "dv"], str(rep)
    ignored = peer_kernel(q, k, v, g, allowed=(j <= i))
    rep = _judged(ignored, q, k, v, g, is_causal=True, q_offset=off)
    assert not rep.ok and "out" in {r.quantity for r in rep.failures}


def test_topk_length_with_gather_kv_indices_is_judged():
    """FlashMLA's sparse attention: row i reads only its first topk_length[i] indices of gather_kv_indices
    (prefill's (s_q,), here (L,)); a kernel reading every index fails."""
    q, k, v, g = _peer_inputs()
    rng = np.random.default_rng(7)
    K = 12
    idx = np.argsort(rng.random((2, 1, 24, 32)), axis=-1)[..., :K]          # distinct keys per row
    n = rng.integers(1, K + 1, 24)
    n[0], n[-1] = 1, K
    def allowed(counts):
        keep = np.arange(K) < counts[:, None]                               # (L, K): the indices read
        a = np.zeros((2, 1, 24, 32), bool)
        np.put_along_axis(a, idx, keep[None, None], axis=-1)
        return a
    rep = _judged(peer_kernel(q, k, v, g, allowed=allowed(n)), q, k, v, g, gather_kv_indices=idx, topk_length=n)
    assert rep.ok and len(rep.rows) == 5, str(rep)
    rep = _judged(peer_kernel(q, k, v, g, allowed=allowed(np.full(24, K))), q, k, v, g, gather_kv_indices=idx,
                  topk_length=n)
    assert not rep.ok and "out" in {r.quantity for r in rep.failures}


def test_cudnn_alibi_is_judged():
    """cuDNN's signed ALiBi, slope * (j - i) with no diagonal offset, without a mask (where FlashAttention's
    -slope |i - j| differs by more than a row's constant); a kernel with FlashAttention's term fails."""
    q, k, v, g = _peer_inputs()
    slopes = np.array([0.5, 0.25, 0.125], np.float32)
    d = (np.arange(32) - np.arange(24)[:, None]).astype(np.float32)         # j - i
    cudnn = peer_kernel(q, k, v, g, bias=slopes[:, None, None] * d)
    rep = _judged(cudnn, q, k, v, g, alibi_slopes=slopes, alibi_mode="cudnn")
    assert rep.ok and len(rep.rows) == 5, str(rep)
    flash = peer_kernel(q, k, v, g, bias=-slopes[:, None, None] * np.abs(d))
    rep = _judged(flash, q, k, v, g, alibi_slopes=slopes, alibi_mode="cudnn")
    assert not rep.ok and "out" in {r.quantity for r in rep.failures}
    assert _judged(flash, q, k, v, g, alibi_slopes=slopes).ok                # the default is FlashAttention's
