"""The suites reach far enough to see what kernels get wrong past a block, and what the rule can and cannot see.

A kernel that drops the keys past a block, or mishandles the last partial one, must fail the default suites: the
quick suite reaches S = 136 (``long-L16-S128`` for any kernel, a causal L = S = 136 for a causal-only one), the
full suite S = 512. A systematic one-ulp bias in bfloat16 stays inside the relative rule's largest-error
allowance, and is caught by its lean (the error fitted over every element) on the S = 128 cases.
"""

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.ensemble import MEMBERS, member_quantities
from sdpa_ref.harness.judge import reference_quantities
from sdpa_ref.harness.lowp import ulp
from sdpa_ref.harness.rules import RelativeRule, lean
from sdpa_ref import ScoreMod, check_implementation, sdpa_backward, sdpa_forward
from sdpa_ref.harness import Case
from sdpa_ref.harness.vectors import write_vectors


def _drops_keys_past(n):
    """The reference, blind to every key at position n and after (it reads them as masked out)."""
    def forward(q, k, v, **o):
        S = k.shape[-2]
        keep = np.arange(S) < n
        m = o.get("attn_mask")
        if m is None:
            m = np.broadcast_to(keep, q.shape[:-1] + (S,))
        elif m.dtype == bool:
            m = m & keep
        else:
            m = np.where(keep, m, -np.inf).astype(m.dtype)
        return sdpa_ref.scaled_dot_product_attention(q, k, v, **dict(o, attn_mask=m))

    return forward


def test_the_quick_suite_reaches_past_a_block_and_the_full_suite_to_512():
    quick, full = get_suite("quick"), get_suite("full")
    assert max(c.S for c in quick) >= 128 and max(c.S for c in full) >= 512
    long = [c for c in quick if c.S >= 128]
    assert any(not c.option_names for c in long)                          # judged for a kernel with no option
    assert any(c.option_names == {"is_causal"} and c.S % 64 and c.S > 128 for c in long)  # causal, a tail


@pytest.mark.parametrize("n", [32, 64, 100, 128])
def test_a_kernel_that_drops_keys_past_a_block_fails_the_quick_suite(n):
    rep = sdpa_ref.check_implementation(_drops_keys_past(n), dtypes="float32")
    assert not rep.ok
    assert all(r.status == "pass" for r in rep.rows if r.status != "skip" and
               next(c for c in get_suite("quick") if c.name == r.case).S <= n)
    causal_only = sdpa_ref.check_implementation(_drops_keys_past(n), dtypes="float32", requires={"is_causal"},
                                                supports={"is_causal"})
    assert not causal_only.ok                                             # a causal-only kernel is caught too


def test_a_kernel_that_drops_keys_past_256_fails_the_full_suite():
    cases = [c for c in get_suite("full") if c.S > 256 and c.L * c.S <= 300 * 300]
    assert cases
    rep = sdpa_ref.check_implementation(_drops_keys_past(256), dtypes="float32", cases=cases)
    assert not rep.ok


def _one_ulp_up(x):
    """``x`` one bfloat16 ulp towards +inf, element-wise."""
    import ml_dtypes

    b = x.view(np.uint16).astype(np.int32)
    b = np.where((b & 0x7FFF) == 0, 1, np.where(b & 0x8000, b - 1, b + 1))
    return b.astype(np.uint16).view(ml_dtypes.bfloat16)


def _biased(q, k, v, **o):
    """A bfloat16 kernel as good as it gets (float32 arithmetic, rounded once), then one ulp up everywhere."""
    import ml_dtypes

    wide = {n: (a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == ml_dtypes.bfloat16 else a)
            for n, a in o.items()}
    out = sdpa_ref.scaled_dot_product_attention(q.astype(np.float32), k.astype(np.float32),
                                                v.astype(np.float32), **wide)
    return _one_ulp_up(out.astype(ml_dtypes.bfloat16))


def test_a_one_ulp_bfloat16_bias_is_caught_by_the_lean_though_the_largest_error_misses_it():
    """A +1 ulp bias on every element of a correctly rounded bfloat16 output errs by 1.3-1.4 ulp at its worst
    element, under 3 times the honest ensemble's error (which rounds P before P V): the largest error cannot
    see it (the rule's ratio stays under 0.5). Its lean (:func:`~sdpa_ref.harness.rules.lean`) is 1 ulp, on
    the S = 128 cases of the quick and the full suite, and past the bound there; the honest ensemble's own
    lean is under 0.05 ulp (a plain mean of ``error / ulp`` would say +1.7 ulp for it, from entries whose
    reference is near 0: the reason the fit weighs each entry by its ulp)."""
    pytest.importorskip("ml_dtypes")
    import ml_dtypes

    bf = np.dtype(ml_dtypes.bfloat16)
    names = ("long-L16-S128", "big-gqa-L96-S128", "big-large-logits-L128-S128")
    cases = [c for c in get_suite("full") if c.name in names]
    assert len(cases) == 3 and any(c.name == "long-L16-S128" for c in get_suite("quick"))
    rep = sdpa_ref.check_implementation(_biased, dtypes="bfloat16", cases=cases)
    assert [r.status for r in rep.rows] == ["FAIL"] * 3, str(rep)
    for r in rep.rows:
        assert r.ratio < 0.5 and r.error < 3 * r.honest_error            # the largest error is within the rule
        assert 0.97 < r.lean < 1.03 and r.lean > r.lean_allowed and "systematic bias" in r.note
    max_only = sdpa_ref.check_implementation(_biased, dtypes="bfloat16", cases=cases,
                                             rule=RelativeRule(judge_lean=False))
    assert max_only.ok                                                   # what the lean adds
    for c in cases:
        ref = reference_quantities(c, bf)["out"]
        for m in MEMBERS:
            got = member_quantities(c, bf.name, m)["out"]
            assert abs(lean(got, ref, bf)[0]) < 0.05                     # honest kernels do not lean
        naive = max(abs(float(np.mean((member_quantities(c, bf.name, m)["out"].astype(np.float64) - ref)
                                      / ulp(ref, bf)))) for m in MEMBERS)
        if c.name == "big-gqa-L96-S128":
            assert naive > 1.5                                            # the plain mean would fail them


@pytest.mark.parametrize("bias_ulps, caught", [(1, True), (-1, True), (0, False)])
def test_the_lean_of_a_shifted_honest_kernel_is_its_shift(bias_ulps, caught):
    """``lean`` is linear in a shift of ``u``: an honest kernel's result moved by ``b`` ulps leans by its own lean
    plus ``b``, whatever its noise; the honest one itself passes."""
    pytest.importorskip("ml_dtypes")
    import ml_dtypes

    bf = np.dtype(ml_dtypes.bfloat16)
    case = next(c for c in get_suite("quick") if c.name == "long-L16-S128")
    ref = reference_quantities(case, bf)["out"]
    honest = member_quantities(case, bf.name, MEMBERS[3])["out"].astype(np.float64)    # online softmax
    shifted = honest + bias_ulps * ulp(ref, bf)
    beta0, _ = lean(honest, ref, bf)
    beta, se = lean(shifted, ref, bf)
    assert beta == pytest.approx(beta0 + bias_ulps, abs=1e-9) and 0 < se < 0.1
    assert (abs(beta) > RelativeRule().lean_bound("out", abs(beta0), se)) == caught


def test_lean_is_silent_without_rows_and_on_overflow():
    assert lean(np.array([1.0]), np.array([0.5]), np.dtype(np.float32))[1] == float("inf")     # one row: no verdict
    beta, se = lean(np.full((4, 3), 1e308), np.full((4, 3), -1e308), np.dtype(np.float64))
    assert (beta, se) == (0.0, float("inf"))                          # an overflowing error: the max rule judges it
    nan_ref = np.array([[np.nan, 1.0], [2.0, np.nan]])
    assert lean(np.array([[5.0, 1.0], [2.0, 7.0]]), nan_ref, np.dtype(np.float64))[0] == 0.0  # NaN entries unread
    with pytest.raises(TypeError, match="judge_lean"):
        RelativeRule(judge_lean=1)


def _qkv(case, dt):
    inp = case.make_inputs(dt)
    inp.pop("fully_masked", None)
    return inp.pop("query"), inp.pop("key"), inp.pop("value"), inp


CAP = 3.0


def softcap_fn(score, b, h, i, j):
    return CAP * np.tanh(score / CAP)


def window_fn(b, h, i, j):
    return (j <= i) & (i - j <= 5)


def gated_fn(score, b, h, i, j):
    return score * np.tanh(score) + 0.5 * score


CASES = [
    Case("softcap-fn", L=16, S=20, E=8, Ev=8, options=(("score_mod", softcap_fn),)),
    Case("window-fn", L=16, S=16, options=(("mask_mod", window_fn),)),
    Case("gated+window-fn", L=12, S=12, Hq=4, Hkv=2, options=(("enable_gqa", True), ("mask_mod", window_fn),
                                                                ("score_mod", ScoreMod(gated_fn)))),
]


def honest(query, key, value, **kw):
    """A float32 kernel: the package's engines in the inputs' dtype."""
    return sdpa_forward(query, key, value, upcast=False, **kw)[0]


def honest_backward(grad_out, query, key, value, **kw):
    g = sdpa_backward(sdpa_forward(query, key, value, upcast=False, **kw)[1], grad_out)
    return g.query, g.key, g.value


def mod_before_scale(query, key, value, score_mod=None, **kw):
    """Applies the score function to the unscaled scores (then scales): a real ordering mistake."""
    if score_mod is None:
        return honest(query, key, value, **kw)
    f = getattr(score_mod, "fn", score_mod)
    s = 1 / np.sqrt(query.shape[-1])
    return honest(query, key, value, score_mod=lambda t, *ix: f(t / s, *ix) * s, **kw)


def forgot_slope(grad_out, query, key, value, score_mod=None, **kw):
    """The score function applied, but its slope taken as 1 in the backward."""
    if score_mod is not None:
        score_mod = ScoreMod(getattr(score_mod, "fn", score_mod), grad=lambda s, *rest: np.ones_like(s))
    return honest_backward(grad_out, query, key, value, score_mod=score_mod, **kw)


def test_an_honest_float32_kernel_conforms():
    rep = check_implementation(honest, backward=honest_backward, cases=CASES, dtypes="float32")
    assert rep.ok and rep.counts["pass"] == 4 * len(CASES), str(rep)


def test_a_score_function_applied_before_the_scale_is_caught():
    rep = check_implementation(mod_before_scale, cases=CASES[:1], dtypes="float32")
    assert not rep.ok and {r.quantity for r in rep.failures} == {"out"}, str(rep)


def test_a_backward_that_forgets_the_score_functions_slope_is_caught():
    def fwd(query, key, value, score_mod=None, **kw):
        return honest(query, key, value, score_mod=score_mod, **kw)

    rep = check_implementation(fwd, backward=forgot_slope, cases=[CASES[0], CASES[2]], dtypes="float32")
    failed = {(r.case, r.quantity) for r in rep.failures}
    assert {("softcap-fn", "dq"), ("softcap-fn", "dk"), ("gated+window-fn", "dq"),
            ("gated+window-fn", "dk")} <= failed, str(rep)
    assert all(q != "out" for _, q in failed)


def test_a_kernel_without_score_mod_is_skipped_on_those_cases():
    def plain(query, key, value, is_causal=False):
        return honest(query, key, value, is_causal=is_causal)

    rep = check_implementation(plain, cases=CASES, dtypes="float32")
    assert rep.verdict == "nothing judged"
    assert all("needs" in r.note for r in rep.rows)


def test_function_cases_cannot_be_written_to_files(tmp_path):
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['score_mod'\]"):
        write_vectors(tmp_path / "v", cases=CASES[:1])
    with pytest.raises(ValueError, match="should have no score_mod to be written to a file"):
        CASES[0].options_json()
    with pytest.raises(TypeError, match="should be a function"):
        Case("bad", L=4, S=4, options=(("mask_mod", 3),))


def test_default_valued_options_are_not_required_and_requires_takes_functions():
    from sdpa_ref.harness.conformance import resolve_requires

    c = Case("c", L=4, S=4, options=(("causal_alignment", "top_left"), ("dropout_p", 0.0), ("fully_masked", "zero")))
    assert c.option_names == frozenset()
    assert CASES[2].option_names == {"enable_gqa", "mask_mod", "score_mod"}
    assert resolve_requires(None, {"mask_mod"}) == {"mask_mod"}


# -- the peers' options of issue 42 in the full suite: q_offset, alibi_mode="cudnn", topk_length (gathered)

PEER_OPTIONS = ("q_offset", "alibi_mode", "topk_length")
PEER_CASES = [c for c in get_suite("full") if c.option_names & set(PEER_OPTIONS)]


def _bshd(f):
    """``f`` on (..., L, H, E) arrays with the kernels' (..., L, K) indices and (..., L) counts."""
    def call(*arrays, gather_kv_indices=None, topk_length=None, **o):
        if gather_kv_indices is not None:
            o["gather_kv_indices"] = gather_kv_indices[..., None, :, :]
        if topk_length is not None:
            o["topk_length"] = topk_length[..., None, :]
        res = f(*(np.swapaxes(x, -3, -2) for x in arrays), **o)
        return np.swapaxes(res, -3, -2) if not isinstance(res, tuple) else tuple(np.swapaxes(x, -3, -2) for x in res)
    return call


def _ignoring(name, layout):
    """The honest kernel with ``name`` dropped: it takes the keyword, and computes as if it were not given."""
    def forward(query, key, value, **o):
        o.pop(name, None)
        return honest(query, key, value, **o)

    def backward(grad_out, query, key, value, **o):
        o.pop(name, None)
        return honest_backward(grad_out, query, key, value, **o)
    return (_bshd(forward), _bshd(backward)) if layout == "gathered" else (forward, backward)


@pytest.mark.parametrize("layout", ["bhld", "gathered"])
def test_the_full_suite_judges_q_offset_cudnn_alibi_and_topk_length(layout):
    assert {c.name for c in PEER_CASES} >= {"q-offset-causal-top_left-L9-S14", "alibi-cudnn-L10-S12",
                                              "gather-topk-L12-S20"}
    assert not {c.name for c in PEER_CASES} & {c.name for c in get_suite("quick")}
    fwd, bwd = (_bshd(honest), _bshd(honest_backward)) if layout == "gathered" else (honest, honest_backward)
    rep = check_implementation(fwd, backward=bwd, cases=PEER_CASES, dtypes=("float32",), layout=layout)
    assert rep.ok, str(rep)
    skipped = {r.case for r in rep.rows if r.status == "skip"}
    with_indices = {c.name for c in PEER_CASES if "gather" in c.arrays}
    if layout == "bhld":                     # top-k indices: only a kernel judged with layout="gathered" takes them
        assert skipped == with_indices and all(r.note == "needs gather_kv_indices" for r in rep.rows
                                               if r.status == "skip")
    else:
        assert not skipped and rep.judged == len(PEER_CASES)
    for name in PEER_OPTIONS:
        using = {c.name + ("-gather" if layout == "gathered" and "gather" not in c.arrays else "")
                 for c in PEER_CASES if name in c.option_names} - (skipped if layout == "bhld" else set())
        if not using:
            continue                         # topk_length in bhld: its cases are the gathered layout's
        f, b = _ignoring(name, layout)
        bad = check_implementation(f, backward=b, cases=PEER_CASES, dtypes=("float32",), layout=layout)
        assert {r.case for r in bad.failures} == using, (name, layout, str(bad))


def test_a_kernel_without_the_peers_keywords_is_skipped_on_their_cases():
    def forward(query, key, value, is_causal=False, attn_mask=None, scale=None, enable_gqa=False, window=None,
                alibi_slopes=None, q_lengths=None, kv_lengths=None, softcap=None):
        return honest(query, key, value, is_causal=is_causal, attn_mask=attn_mask, scale=scale,
                      enable_gqa=enable_gqa, window=window, alibi_slopes=alibi_slopes, q_lengths=q_lengths,
                      kv_lengths=kv_lengths, softcap=softcap)
    rep = check_implementation(forward, cases=PEER_CASES, dtypes=("float32",))
    assert rep.verdict == "nothing judged"
    notes = {r.case: r.note for r in rep.rows}
    assert notes["alibi-cudnn-L10-S12"] == "needs alibi_mode"
    assert "q_offset" in notes["q-offset-causal-top_left-L9-S14"]
