"""The harness: it fails wrong implementations, passes right ones, and is fast."""

import time

import numpy as np
import pytest

from sdpa_ref import sdpa_backward, sdpa_forward
from sdpa_ref import attention
from sdpa_ref.transforms import unbroadcast
from sdpa_ref import OPTION_NAMES
from sdpa_ref.harness.cases import SUITE_VERSION, get_suite
from sdpa_ref.harness.conformance import FixedRule, RelativeRule, ULPRule, check_implementation
from tolerances import F64_SUMS
import json
import sdpa_ref


def ref_forward(q, k, v, **o):
    return sdpa_forward(q, k, v, **o)[0]


def ref_backward(g, q, k, v, **o):
    gr = sdpa_backward(sdpa_forward(q, k, v, **o)[1], g)
    return (gr.query, gr.key, gr.value) + ((gr.bias,) if gr.bias is not None else ())


def _failed_cases(rep):
    return {r.case for r in rep.failures}


# ------------------------------------------------------------- suite itself


def test_suite_is_named_versioned_deterministic_and_covering():
    quick, full = get_suite("quick"), get_suite("full")
    assert SUITE_VERSION == "5"
    assert {c.name for c in quick} <= {c.name for c in full}
    assert "gqa-causal-bottom_right-L7-S13" in {c.name for c in quick}
    a, b = quick[3].make_inputs("float32"), quick[3].make_inputs("float32")
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    # dtype-free seed: the float16 inputs are the float64 inputs rounded
    c64, c16 = quick[0].make_inputs("float64"), quick[0].make_inputs("float16")
    np.testing.assert_array_equal(c64["query"].astype(np.float16), c16["query"])
    # coverage of the features the issue lists
    used = set().union(*(c.option_names for c in full))
    assert used == set(OPTION_NAMES) | {"gather_kv_indices"}    # every option of the vocabulary is exercised
    # the peers' options of issue 42 only in the full suite: the quick suite's cases (and vectors) are as they were
    assert not set().union(*(c.option_names for c in quick)) & {"q_offset", "topk_length", "alibi_mode",
                                                                 "gather_kv_indices"}
    shapes = {(c.L == c.S, c.L < c.S, c.L > c.S) for c in quick}
    assert len(shapes) == 3
    assert any(c.Ev != c.E for c in quick) and any(c.batch_q != c.batch_kv for c in quick)
    assert any(c.Hkv == 1 and c.Hq > 1 for c in quick) and any(1 < c.Hkv < c.Hq for c in quick)
    assert any(c.logit_scale >= 20 for c in quick) and any(c.has_fully_masked_rows() for c in quick)
    assert max(c.L for c in full) == 512 and max(c.S for c in full) == 512
    # plain self-attention as kernels are first written: L = S, Hq = Hkv, no option but is_causal
    plain = [c for c in quick if c.L == c.S and c.Hq == c.Hkv and c.option_names <= {"is_causal"}]
    causal = [c for c in plain if c.option_names == {"is_causal"}]
    assert len(causal) >= 10 and len(plain) - len(causal) >= 5
    assert {64, 128} <= {c.E for c in causal} and {64, 128} <= {c.E for c in plain if c not in causal}
    assert any(c.L % 2 and c.L > 1 for c in causal) and any(c.E % 2 for c in causal)
    with pytest.raises(ValueError, match="`suite`"):
        get_suite("huge")


def test_large_logit_cases_really_have_large_scores():
    case = next(c for c in get_suite("quick") if c.name == "large-logits-L16-S16")
    inp = case.make_inputs()
    s = inp["query"] @ np.swapaxes(inp["key"], -1, -2) / np.sqrt(case.E)
    assert 30 < np.abs(s).max() < 120


def test_quick_suite_is_fast():
    # CPU time of this process, not wall time: the suite runs beside other workers on 2 cores, where the
    # wall clock measured 46 s for what takes 6-8 s alone
    t0 = time.process_time()
    rep = check_implementation(ref_forward, backward=ref_backward, dtypes=("float32", "float16"))
    assert rep.ok
    assert time.process_time() - t0 < 20.0


# ------------------------------------------------------------ right answers


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_reference_passes_at_every_dtype(dtype):
    rep = check_implementation(ref_forward, backward=ref_backward, dtypes=(dtype,))
    assert rep.ok, str(rep)
    assert rep.counts["skip"] == 0 and rep.counts["pass"] > 100


def test_the_reference_passes_tight_fixed_and_ulp_rules():
    assert check_implementation(ref_forward, backward=ref_backward, dtypes=("float64",),
                                rule=FixedRule(rtol=F64_SUMS, atol=F64_SUMS)).ok
    assert check_implementation(ref_forward, dtypes=("float32",), rule=ULPRule(1)).ok


def _float32_other_order(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """A float32 attention summing in another order: keys in two halves, merged by online softmax."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    s = np.float32(1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    allowed = np.ones((L, S), bool) if attn_mask is None else np.broadcast_to(attn_mask, q.shape[:-1] + (S,))
    if is_causal:
        allowed = allowed & np.tril(np.ones((L, S), bool))
    half = S // 2 or S
    m = np.full(q.shape[:-1] + (1,), -np.inf, np.float32)
    den = np.zeros_like(m)
    num = np.zeros(q.shape[:-1] + (v.shape[-1],), np.float32)
    for lo, hi in ((half, S), (0, half)):           # second half first
        if lo >= hi:
            continue
        t = np.einsum("...ie,...je->...ij", q, k[..., lo:hi, :]) * s
        t = np.where(allowed[..., lo:hi], t, -np.inf)
        m_new = np.maximum(m, t.max(-1, keepdims=True))
        shift = np.where(np.isfinite(m_new), m_new, 0).astype(np.float32)
        with np.errstate(invalid="ignore"):
            c = np.where(np.isfinite(m), np.exp(m - shift), 0).astype(np.float32)
            e = np.exp(t - shift).astype(np.float32)
        den = den * c + e.sum(-1, keepdims=True)
        num = num * c + e[..., ::-1] @ v[..., lo:hi, :][..., ::-1, :]
        m = m_new
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, 0).astype(np.float32)    # rows with no key: zeros


_float32_other_order.supports = {"attn_mask", "is_causal", "scale"}


def test_a_float32_reimplementation_with_another_summation_order_passes():
    rep = check_implementation(_float32_other_order, dtypes=("float32",))
    c = rep.counts
    assert rep.ok, str(rep)
    assert c["pass"] >= 8 and c["skip"] > 0          # unsupported cases are skipped, not failed
    # and it is not the same arithmetic as the reference: errors are non-zero
    assert max(r.error for r in rep.rows if r.status == "pass") > 0


def test_skipped_options_are_never_passed():
    seen = set()

    def fwd(q, k, v, **o):
        seen.update(o)
        return ref_forward(q, k, v, **o)

    check_implementation(fwd, supports={"is_causal", "causal_alignment"}, dtypes=("float64",),
                         rule=FixedRule())
    assert seen <= {"is_causal", "causal_alignment"} and seen


def test_not_implemented_is_a_skip_and_a_crash_is_an_error():
    def fwd(q, k, v, **o):
        if o.get("is_causal"):
            raise NotImplementedError("no causal")
        if "attn_mask" in o:
            raise RuntimeError("boom")
        return ref_forward(q, k, v, **o)

    rep = check_implementation(fwd, dtypes=("float32",))
    st = {r.case: r.status for r in rep.rows}
    assert st["causal-top_left-L7-S13"] == "skip" and st["mask-L7-S9"] == "error"
    assert not rep.ok and "boom" in str(rep)


def test_unknown_supports_is_a_clear_error():
    with pytest.raises(ValueError, match="`supports`"):
        check_implementation(ref_forward, supports={"causal"})


# ------------------------------------------------------------- wrong answers


def wrong_scale(q, k, v, scale=None, **o):
    return ref_forward(q, k, v, scale=1.0 / q.shape[-1] if scale is None else scale, **o)


def causal_off_by_one(q, k, v, is_causal=False, window=None, **o):
    if is_causal:
        left, right = (None, None) if window is None else window
        right = 1 if right is None else min(right, 0) + 1
        window = (left, right)
    return ref_forward(q, k, v, window=window, **o)


def top_left_always(q, k, v, causal_alignment="top_left", **o):
    return ref_forward(q, k, v, **o)


def nan_on_fully_masked(q, k, v, fully_masked="zero", **o):
    return ref_forward(q, k, v, fully_masked="nan", **o)


def float16_claiming_float32(q, k, v, **o):
    lo = {kk: (vv.astype(np.float16) if isinstance(vv, np.ndarray) and vv.dtype == np.float32 else vv)
          for kk, vv in o.items()}
    out = sdpa_forward(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), upcast=False, **lo)[0]
    return out.astype(q.dtype)


def backward_without_softcap_derivative(g, q, k, v, **o):
    out, res = sdpa_forward(q, k, v, method="plain", **o)
    prob = res.problem
    dO = g.astype(np.float64).reshape(prob.full_scores[:-1] + (g.shape[-1],))
    gr = attention.backward(prob, res.forward._replace(slope=None), dO)     # forgets dT * (1 - tanh^2)
    grads = (unbroadcast(gr.dq, q.shape), unbroadcast(gr.dk, k.shape), unbroadcast(gr.dv, v.shape))
    return tuple(a.astype(q.dtype) for a in grads) + ((gr.dbias.astype(q.dtype),) if gr.dbias is not None else ())


@pytest.mark.parametrize("impl,exposed_by", [
    (wrong_scale, "plain-L8-S8"),
    (causal_off_by_one, "causal-top_left-L7-S13"),
    (top_left_always, "causal-bottom_right-L7-S13"),
    (nan_on_fully_masked, "masked-rows-L8-S8"),
    (float16_claiming_float32, "plain-L8-S8"),
], ids=["wrong-scale", "causal-off-by-one", "top-left-for-bottom-right", "nan-for-zero", "float16-as-float32"])
def test_wrong_forwards_fail_on_the_cases_that_expose_them(impl, exposed_by):
    rep = check_implementation(impl, dtypes=("float32",))
    assert not rep.ok
    assert exposed_by in _failed_cases(rep), str(rep)
    bad = next(r for r in rep.failures if r.case == exposed_by)
    assert bad.worst_index is not None and bad.impl_value is not None and bad.ref_value is not None
    assert "DOES NOT CONFORM" in str(rep)


def test_top_left_for_bottom_right_passes_where_they_coincide():
    rep = check_implementation(top_left_always, dtypes=("float32",))
    st = {(r.case, r.quantity): r.status for r in rep.rows}
    assert st[("causal-top_left-L7-S13", "out")] == "pass"
    assert st[("causal-bottom_right-L13-S7", "out")] == "FAIL"


def test_a_backward_missing_the_softcap_derivative_fails():
    rep = check_implementation(ref_forward, backward=backward_without_softcap_derivative, dtypes=("float32",))
    failed = {(r.case, r.quantity) for r in rep.failures}
    assert ("softcap5-L10-S10", "dq") in failed and ("softcap5-L10-S10", "dk") in failed
    assert ("softcap5-L10-S10", "out") not in failed and ("softcap5-L10-S10", "dv") not in failed
    assert not any(c == "plain-L8-S8" for c, _ in failed)      # without softcap it is right


def test_report_json_and_table():
    import json

    rep = check_implementation(wrong_scale, dtypes=("float32",), cases=get_suite("quick")[:3])
    d = json.loads(rep.to_json())
    assert d["ok"] is False and d["suite"] == "custom" and len(d["rows"]) == 3
    assert {"case", "dtype", "quantity", "error", "allowed", "ratio", "status"} <= set(d["rows"][0])
    assert "verdict: DOES NOT CONFORM" in str(rep)
    assert isinstance(RelativeRule().describe(), str)


def _cases(*names):
    by_name = {c.name: c for c in get_suite("full")}
    return [by_name[n] for n in names]


def ref(q, k, v, **o):
    return sdpa_ref.sdpa_forward(q, k, v, **o)[0]


def three_keywords(query, key, value, is_causal=False, scale=None, causal_alignment="top_left"):
    return sdpa_ref.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale,
                                                 causal_alignment=causal_alignment)


def leaky(q, k, v, kv_lengths=None, q_lengths=None, scale=None):
    """Textbook: -inf where masked, then P @ V -- so 0 * NaN reaches every row when the padding holds NaN."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    j = np.arange(k.shape[-2])
    if kv_lengths is not None:
        s = np.where(j >= np.asarray(kv_lengths)[:, None, None, None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    out = ((p / p.sum(-1, keepdims=True)) @ v).astype(q.dtype)
    if q_lengths is not None:
        i = np.arange(q.shape[-2])[:, None]
        out = np.where(i >= np.asarray(q_lengths)[:, None, None, None], 0, out).astype(q.dtype)
    return out


def test_the_harness_is_at_the_top_level_and_asserts_for_pytest():
    cases = _cases("plain-L8-S8")
    assert sdpa_ref.check_implementation(ref, cases=cases).ok
    assert sdpa_ref.assert_conforms(ref, cases=cases).ok
    with pytest.raises(AssertionError, match="DOES NOT CONFORM") as e:
        sdpa_ref.assert_conforms(lambda q, k, v, **o: ref(q, k, v, **o) * 1.01, cases=cases)
    assert "plain-L8-S8" in str(e.value) and "ratio" in str(e.value)


def test_supports_comes_from_the_signature():
    rep = sdpa_ref.check_implementation(three_keywords, suite="quick")
    statuses = {r.status for r in rep.rows}
    assert rep.ok and "error" not in statuses                     # no TypeError rows: nothing unknown is passed
    ran = {r.case for r in rep.rows if r.status == "pass"}
    assert "causal-bottom_right-L7-S13" in ran and "bias-L7-S9" not in ran
    assert rep.meta["supports"] == ["causal_alignment", "is_causal", "scale"]


def test_a_bhld_only_kernel_fails_under_blhd_and_a_blhd_kernel_passes():
    def blhd(q, k, v, **o):                                         # (B, L, H, E) in and out
        out = ref(np.swapaxes(q, -3, -2), np.swapaxes(k, -3, -2), np.swapaxes(v, -3, -2), **o)
        return np.swapaxes(out, -3, -2)

    def blhd_backward(g, q, k, v, **o):
        sw = lambda a: np.swapaxes(a, -3, -2)  # noqa: E731
        gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(sw(q), sw(k), sw(v), **o)[1], sw(g))
        return sw(gr.query), sw(gr.key), sw(gr.value)

    cases = _cases("plain-L5-S11", "gqa-L6-S9")
    assert sdpa_ref.check_implementation(blhd, backward=blhd_backward, layout="blhd", cases=cases,
                                         supports=("enable_gqa",)).ok
    assert not sdpa_ref.check_implementation(ref, layout="blhd", cases=cases).ok
    bshd = lambda q, k, v, **o: sdpa_ref.sdpa_forward(q, k, v, layout="bshd", **o)[0]  # noqa: E731
    assert sdpa_ref.check_implementation(bshd, layout="bshd", cases=cases, supports=("enable_gqa",)).ok
    assert not sdpa_ref.check_implementation(ref, layout="bshd", cases=cases).ok   # the entry points' name
    with pytest.raises(ValueError, match="layout"):
        sdpa_ref.check_implementation(ref, layout="bhds", cases=cases)


def test_dtypes_and_rules_by_name():
    cases = _cases("plain-L8-S8")
    rep = sdpa_ref.check_implementation(ref, dtypes="float16", cases=cases)
    assert {r.dtype for r in rep.rows} == {"float16"}                 # not 'f', 'l', 'o', ...
    assert {r.dtype for r in sdpa_ref.check_implementation(ref, dtypes=np.float32, cases=cases).rows} == {"float32"}
    for name, word in (("fixed", "fixed"), ("ulp", "ulp"), ("relative", "relative")):
        assert word in sdpa_ref.check_implementation(ref, rule=name, dtypes="float64", cases=cases).rule
    with pytest.raises(ValueError, match="rule"):
        sdpa_ref.check_implementation(ref, rule="loose", cases=cases)


def test_a_wrong_output_dtype_is_a_failure_and_the_table_says_why():
    def upcasts(q, k, v, **o):                                      # float16 in, float32 out
        return sdpa_ref.scaled_dot_product_attention(q.astype(np.float32), k.astype(np.float32),
                                                     v.astype(np.float32), **o)

    rep = sdpa_ref.check_implementation(upcasts, dtypes="float16", cases=_cases("plain-L8-S8"))
    assert not rep.ok and "returned dtype float32, expected float16" in str(rep)


def test_the_report_shows_the_error_the_honest_baseline_and_the_allowance_with_full_names():
    long_name = "all-gqa-mask-bias-alibi-lengths-causal-window_6_inf-bottom_right-softcap8-L24-S24"
    rep = sdpa_ref.check_implementation(ref, cases=_cases(long_name))
    text = str(rep)
    assert long_name in text and "honest" in text and "allowed" in text and "ensemble" in text
    row = rep.rows[0]
    assert row.honest_error is not None and row.allowed >= 2 * row.honest_error
    csv = rep.to_csv().splitlines()
    assert csv[0].startswith("case,dtype,quantity,status") and long_name in csv[1]


def test_the_determinism_check():
    cases = _cases("plain-L8-S8")
    rng = np.random.default_rng(0)

    def wobbly(q, k, v, **o):                                       # right, but not the same bits twice
        out = ref(q, k, v, **o)
        return np.where(rng.random(out.shape) < 0.5, out, out + np.spacing(out)).astype(out.dtype)

    assert sdpa_ref.check_implementation(ref, deterministic=True, cases=cases).ok
    rep = sdpa_ref.check_implementation(wobbly, deterministic=True, cases=cases)
    assert [r.status for r in rep.rows if r.quantity == "determinism"] == ["FAIL"]
    assert all(r.status == "pass" for r in rep.rows if r.quantity == "out")


def test_the_jvp_check_passes_the_right_jvp_and_fails_a_wrong_one():
    cases = _cases("causal-bottom_right-L7-S13", "softcap5-L10-S10")

    def right(primals, tangents, **o):
        return sdpa_ref.sdpa_jvp(primals, tangents, **o)[1]

    def no_key_tangent(primals, tangents, **o):
        return sdpa_ref.sdpa_jvp(primals, (tangents[0], None, tangents[2]), **o)[1]

    for dt in ("float32", "float64"):
        rule = "relative" if dt == "float32" else "fixed"
        assert sdpa_ref.check_implementation(ref, jvp=right, dtypes=dt, rule=rule, cases=cases).ok
        rep = sdpa_ref.check_implementation(ref, jvp=no_key_tangent, dtypes=dt, rule=rule, cases=cases)
        assert {r.status for r in rep.rows if r.quantity == "jvp"} == {"FAIL"}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_poison_check_fails_a_kernel_that_reads_padding():
    cases = _cases("lengths-L9-S12")
    assert sdpa_ref.check_implementation(leaky, cases=cases).ok                       # right on clean memory
    rep = sdpa_ref.check_implementation(leaky, poison=True, cases=cases)
    bad = [r for r in rep.rows if r.quantity == "poison"]
    assert [r.status for r in bad] == ["FAIL"] and "NaN written where no row reads" in bad[0].note
    assert sdpa_ref.check_implementation(ref, poison=True, cases=cases).ok


def test_conform_and_vectors_take_every_format(tmp_path, capsys, monkeypatch):
    from sdpa_ref.cli import main
    (tmp_path / "kern.py").write_text("import sdpa_ref\n"
                                      "def f(query, key, value, is_causal=False):\n"
                                      "    return sdpa_ref.scaled_dot_product_attention(query, key, value,"
                                      " is_causal=is_causal)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["conform", "kern:f", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("case,dtype,quantity,status") and len(lines) > 10
    assert main(["vectors", str(tmp_path / "v"), "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["suite"] == "quick" and len(got["files"]) == len(get_suite("quick")) and len(got["files"][0]["sha256"]) == 64
    assert main(["vectors", str(tmp_path / "w"), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "file,sha256,bytes"


@pytest.mark.parametrize("argv, flag", [(["--rtol", "1e-3"], "--rtol"), (["--rule", "fixed", "--max-ulps", "2"],
                                                                          "--max-ulps"),
                                         (["--rule", "ulp", "--atol", "0"], "--atol")])
def test_a_tolerance_that_does_not_apply_to_the_rule_is_an_error(argv, flag, capsys):
    from sdpa_ref.cli import main
    assert main(["conform", "sdpa_ref:scaled_dot_product_attention"] + argv) == 2
    err = capsys.readouterr().err
    assert flag in err and "does not apply" in err and "Traceback" not in err


@pytest.mark.parametrize("kw, exc, words", [
    (dict(deterministic="yes"), TypeError, "deterministic"),
    (dict(poison=1), TypeError, "poison"),
    (dict(dtypes=()), ValueError, "dtypes"),
    (dict(dtypes="floatx"), TypeError, "dtypes"),
    (dict(rule=3), TypeError, "rule"),
    (dict(backward="not a function"), TypeError, "backward"),
])
def test_bad_settings_are_clear_errors_naming_the_argument(kw, exc, words):
    with pytest.raises(exc, match=words):
        sdpa_ref.check_implementation(ref, cases=_cases("plain-L8-S8"), **kw)
