"""The harness judges kernels with score and mask functions: a Python Case carries them, the reference and the
honest ensemble compute them, an honest float32 kernel passes and wrong ones are caught; no file can hold them."""

import numpy as np
import pytest

from sdpa_ref import ScoreMod, check_implementation, sdpa_backward, sdpa_forward
from sdpa_ref.harness import Case
from sdpa_ref.harness.vectors import write_vectors

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
