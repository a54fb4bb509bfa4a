"""The harness used from Python as a kernel author would (issue 13, part 3), and its command line (part 5)."""

import json

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref.harness.cases import get_suite


def _cases(*names):
    by_name = {c.name: c for c in get_suite("full")}
    return [by_name[n] for n in names]


def ref(q, k, v, **o):
    return sdpa_ref.sdpa_forward(q, k, v, **o)[0]


def three_keywords(query, key, value, is_causal=False, scale=None, causal_alignment="top_left"):
    return sdpa_ref.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale,
                                                 causal_alignment=causal_alignment)


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
    with pytest.raises(ValueError, match="layout"):
        sdpa_ref.check_implementation(ref, layout="bshd", cases=cases)


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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_poison_check_fails_a_kernel_that_reads_padding():
    cases = _cases("lengths-L9-S12")
    assert sdpa_ref.check_implementation(leaky, cases=cases).ok                       # right on clean memory
    rep = sdpa_ref.check_implementation(leaky, poison=True, cases=cases)
    bad = [r for r in rep.rows if r.quantity == "poison"]
    assert [r.status for r in bad] == ["FAIL"] and "NaN written where no row reads" in bad[0].note
    assert sdpa_ref.check_implementation(ref, poison=True, cases=cases).ok


# ------------------------------------------------------------------ the command line


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
