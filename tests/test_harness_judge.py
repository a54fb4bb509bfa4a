"""The harness judges the LSE a kernel returns (either base, each peer's value on rows with no key) and the
determinism of the backward as well as the forward.

Evidence: the reference and honest kernels (the specimens, each with its own LSE in float32) pass in both
bases and conventions; wrong LSEs are caught (the other base, FlashAttention 2's ``+inf`` where ``-inf`` is
asked, an LSE without the scale, one rounded to float16, one of the wrong dtype, a forward that does not return
it); a backward whose bits change from run to run fails ``determinism-backward``; the command line and the
child process take the same options.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sdpa_ref import check_implementation, sdpa_backward, sdpa_forward
from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.specimens import HONEST

HERE = os.path.dirname(os.path.abspath(__file__))
QUICK = get_suite("quick")
#: a few quick cases, some with rows that have no allowed key (the LSE's -inf), one with a bias and lengths
CASES = [c for c in QUICK if c.has_fully_masked_rows()][:3] + [c for c in QUICK if not c.has_fully_masked_rows()][:3]


def _work(dt):
    return np.float64 if np.dtype(dt) == np.float64 else np.float32


def ref_lse(base="e", empty="-inf", mutate=None):
    def forward(q, k, v, **o):
        out, res = sdpa_forward(q, k, v, **o)
        lse = res.lse_as(base=base, empty=empty)
        if mutate is not None:
            lse = mutate(lse, q, k, v, o)
        return out, np.asarray(lse).astype(_work(q.dtype))
    return forward


def _lse_rows(rep):
    return [r for r in rep.rows if r.quantity == "lse"]


def test_cases_cover_rows_without_keys():
    assert any(c.has_fully_masked_rows() for c in CASES) and any(not c.has_fully_masked_rows() for c in CASES)


@pytest.mark.parametrize("base", ["e", 2])
@pytest.mark.parametrize("empty", ["-inf", "+inf", 0.0])
def test_the_reference_lse_conforms_in_every_convention(base, empty):
    rep = check_implementation(ref_lse(base, empty), dtypes=("float32", "float16"), cases=CASES, lse=base,
                               lse_empty=empty)
    assert rep.ok, rep
    assert len(_lse_rows(rep)) == 2 * len(CASES)
    assert rep.meta["lse"] == {"base": base, "empty": empty}


@pytest.mark.parametrize("specimen", HONEST[:3] + HONEST[6:7] + HONEST[-1:], ids=lambda s: s.name)
@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_honest_kernels_with_their_own_lse_conform(specimen, dt):
    """Their LSE is m + log(sum) in float32, as the ensemble's: within the allowance, with a margin."""
    rep = check_implementation(specimen.forward_lse, dtypes=(dt,), cases=CASES, lse="e")
    assert rep.ok, rep
    assert max(r.ratio for r in _lse_rows(rep)) < 0.7


def _fails(rep, note=None):
    bad = [r for r in _lse_rows(rep) if r.status == "FAIL"]
    assert bad and not rep.ok, rep
    if note is not None:
        assert any(note in r.note for r in bad), [r.note for r in bad]
    return bad


def test_the_other_base_is_caught():
    _fails(check_implementation(ref_lse("e"), dtypes=("float32",), cases=CASES, lse=2))
    _fails(check_implementation(ref_lse(2), dtypes=("float32",), cases=CASES, lse="e"))


def test_flash_attention_2s_plus_inf_is_caught_where_minus_inf_is_asked_and_only_on_rows_without_keys():
    rep = check_implementation(ref_lse("e", "+inf"), dtypes=("float32",), cases=CASES, lse="e")
    bad = _fails(rep, "inf where the reference has -inf")
    masked = {c.name for c in CASES if c.has_fully_masked_rows()}
    assert {r.case for r in bad} == masked


def test_an_lse_without_the_scale_is_caught():
    def unscaled(lse, q, k, v, o):
        _, res = sdpa_forward(q, k, v, **dict(o, scale=1.0))
        return res.lse
    _fails(check_implementation(ref_lse(mutate=unscaled), dtypes=("float32",), cases=CASES, lse="e"))


def test_an_lse_kept_in_float16_is_caught_at_float32():
    """At float32 an LSE rounded to float16 is far outside; it is not honest at float16 either
    (tests/test_harness_rules.py)."""
    half = ref_lse(mutate=lambda lse, *_: np.asarray(lse).astype(np.float16))
    _fails(check_implementation(half, dtypes=("float32",), cases=CASES, lse="e"))


def test_an_lse_over_the_masked_keys_too_is_caught():
    def unmasked(lse, q, k, v, o):
        o = {n: x for n, x in o.items() if n not in ("attn_mask", "is_causal", "window", "fully_masked")}
        return sdpa_forward(q, k, v, **o)[1].lse
    bad = _fails(check_implementation(ref_lse(mutate=unmasked), dtypes=("float32",), cases=CASES, lse="e"))
    assert {r.case for r in bad} <= {c.name for c in CASES if c.has_fully_masked_rows() or c.arrays
                                     or c.opts.get("is_causal")}


def test_an_lse_of_the_wrong_dtype_or_a_forward_without_it_fails_clearly():
    def f16(q, k, v, **o):
        out, res = sdpa_forward(q, k, v, **o)
        return out, res.lse.astype(q.dtype)
    _fails(check_implementation(f16, dtypes=("float16",), cases=CASES[:1], lse="e"), "expected float32")
    rep = check_implementation(lambda q, k, v, **o: sdpa_forward(q, k, v, **o)[0], dtypes=("float32",),
                               cases=CASES[:1], lse="e")
    assert not rep.ok and "should return (out, lse)" in rep.rows[0].note


def test_the_lse_keeps_its_layout_when_the_kernel_takes_blhd():
    """FlashAttention: out (B, L, H, E), softmax_lse (B, H, L)."""
    def blhd(q, k, v, **o):
        t = lambda a: np.swapaxes(a, -3, -2)                              # noqa: E731
        out, res = sdpa_forward(t(q), t(k), t(v), **o)
        return t(out), res.lse.astype(_work(q.dtype))
    plain = [c for c in CASES if not c.arrays][:3]                      # masks keep (..., H, L, S) either way
    rep = check_implementation(blhd, dtypes=("float32",), cases=plain, lse="e", layout="blhd")
    assert rep.ok, rep


@pytest.mark.parametrize("bad", [dict(lse=10), dict(lse="e", lse_empty="nan"), dict(lse="e", lse_empty=float("nan"))])
def test_bad_lse_options_are_clear_errors(bad):
    with pytest.raises(ValueError, match="`lse`|`lse_empty`"):
        check_implementation(ref_lse(), cases=CASES[:1], **bad)


# ------------------------------------------------------------------ determinism of the backward

def _ref_backward(g, q, k, v, **o):
    gr = sdpa_backward(sdpa_forward(q, k, v, **o)[1], g)
    return (gr.query, gr.key, gr.value) + ((gr.bias,) if gr.bias is not None else ())


class _Atomics:
    """A backward whose dK changes in its last bit from call to call, as atomic adds in another order do."""

    def __init__(self):
        self.calls = 0

    def __call__(self, g, q, k, v, **o):
        self.calls += 1
        dq, dk, *rest = _ref_backward(g, q, k, v, **o)
        if self.calls % 2 == 0:
            dk = np.nextafter(dk, np.inf).astype(dk.dtype)
        return (dq, dk, *rest)


def test_a_backward_that_changes_its_bits_fails_determinism_only():
    fwd = lambda q, k, v, **o: sdpa_forward(q, k, v, **o)[0]              # noqa: E731
    rep = check_implementation(fwd, backward=_Atomics(), dtypes=("float32",), cases=CASES[3:5], deterministic=True)
    rows = {(r.case, r.quantity): r for r in rep.rows}
    for c in CASES[3:5]:
        assert rows[(c.name, "determinism")].status == "pass"
        assert rows[(c.name, "determinism-backward")].status == "FAIL"
        assert "second backward" in rows[(c.name, "determinism-backward")].note
        assert rows[(c.name, "dk")].status == "pass"                    # one ulp is within the rule
    ok = check_implementation(fwd, backward=_ref_backward, dtypes=("float32",), cases=CASES[3:5], deterministic=True)
    assert ok.ok and sum(r.quantity == "determinism-backward" for r in ok.rows) == 2


def test_an_lse_that_changes_its_bits_fails_the_forward_determinism():
    calls = []

    def fwd(q, k, v, **o):
        calls.append(1)
        out, lse = ref_lse()(q, k, v, **o)
        return out, (lse if len(calls) % 2 else np.nextafter(lse, np.inf).astype(lse.dtype))
    rep = check_implementation(fwd, dtypes=("float32",), cases=CASES[3:4], deterministic=True, lse="e")
    assert [r.status for r in rep.rows if r.quantity == "determinism"] == ["FAIL"]


# ------------------------------------------------------------------ the command line and the child process

def test_the_command_line_judges_the_lse_in_a_child_process(tmp_path):
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({"cases": [{"name": "a", "L": 4, "S": 5, "seed": 1},
                                           {"name": "b", "L": 3, "S": 3, "seed": 2, "options": {"is_causal": True}}]}))
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cp = subprocess.run([sys.executable, "-m", "sdpa_ref", "conform", "impls:ref_forward_lse", "--lse", "e",
                         "--deterministic", "--cases", str(cases), "--format", "json"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert cp.returncode == 0, cp.stderr
    rows = json.loads(cp.stdout)["rows"]
    assert {r["quantity"] for r in rows} == {"out", "lse", "determinism"}
    cp = subprocess.run([sys.executable, "-m", "sdpa_ref", "conform", "impls:ref_forward_lse", "--lse", "2",
                         "--cases", str(cases), "--in-process"], capture_output=True, text=True, env=env, timeout=300)
    assert cp.returncode == 1, cp.stderr                                  # base e returned, base 2 asked
    cp = subprocess.run([sys.executable, "-m", "sdpa_ref", "conform", "impls:ref_forward_lse", "--lse", "e",
                         "--lse-empty", "nan", "--cases", str(cases)], capture_output=True, text=True, env=env,
                        timeout=300)
    assert cp.returncode == 2 and "--lse-empty" in cp.stderr and "Traceback" not in cp.stderr


def test_every_reference_the_harness_judges_by_is_faithful(monkeypatch):
    """Nothing the harness or the testing call judges comes from a non-faithful reference: every call that makes
    a reference (the forward and its gradients, the JVP, a score function's case, the LSE in the kernel's base, a
    merge) asks for precision="reproducible"."""
    import inspect

    import sdpa_ref.harness.judge as judge
    import sdpa_ref.harness.merge_check as merge_check
    import sdpa_ref.testing as testing
    from sdpa_ref import merge_attention, sdpa_jvp
    from sdpa_ref.harness.cases import Case

    calls = []

    def spy(module, name, reference_callers=None):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            caller = inspect.stack()[1].function
            if reference_callers is None or caller in reference_callers:
                calls.append((module.__name__, name, caller, kwargs.get("precision", "fast")))
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    spy(judge, "sdpa_forward")
    spy(judge, "sdpa_jvp")
    spy(judge, "convert_lse", {"judge_case"})              # the ensemble's own LSEs are converted as kernels do
    spy(merge_check, "merge_attention")
    spy(testing, "sdpa_forward")
    spy(testing, "convert_lse", {"check_attention_close"})
    spy(testing, "merge_attention")
    judge._reference_quantities.cache_clear()
    score = Case("softcap-fn", L=16, S=20, E=8, Ev=8,
                 options=(("score_mod", lambda s, b, h, i, j: 3 * np.tanh(s / 3)),))

    def forward(q, k, v, **o):
        return sdpa_forward(q, k, v, upcast=False, **o)[0]

    def jvp(primals, tangents, **o):
        return sdpa_jvp(primals, tangents, upcast=False, **o)[1]

    def with_lse(q, k, v, **o):
        out, res = sdpa_forward(q, k, v, upcast=False, **o)
        return out, (res.lse / np.log(2)).astype(np.float32)

    cases = list(get_suite("quick"))[:6]
    check_implementation(forward, jvp=jvp, cases=cases + [score], dtypes="float32", isolate=False)
    check_implementation(with_lse, cases=cases[:3], dtypes="float32", lse=2, isolate=False)
    merge_check.check_merge(lambda o, l: merge_attention(o, l), dtypes="float32")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 8, 4)).astype(np.float32) for _ in range(3))
    out, res = sdpa_forward(q, k, v)
    testing.check_attention_close(out, q, k, v, lse=(res.lse / np.log(2)).astype(np.float32), lse_base=2)
    testing.check_merge_close(out, res.lse, np.stack([out, out]), np.stack([res.lse, res.lse]))
    made = {(m.rpartition(".")[2], n) for m, n, _, _ in calls}
    assert {("judge", "sdpa_forward"), ("judge", "sdpa_jvp"), ("judge", "convert_lse"),
            ("merge_check", "merge_attention"), ("testing", "sdpa_forward"), ("testing", "convert_lse"),
            ("testing", "merge_attention")} <= made, made
    assert all(p == "reproducible" for *_, p in calls), [c for c in calls if c[3] != "reproducible"]
    assert judge.REFERENCE_PRECISION == "reproducible"
