"""The public surface: about 25 names at the top level, the rest in namespaces named for their job, and every name
that was once at the top level still reachable there (CHANGELOG.md lists where each moved)."""

import doctest
import importlib
import subprocess
import sys

import pytest

import sdpa_ref

#: The top level's ``__all__`` before the namespaces (54 names): each must keep working as ``sdpa_ref.X``.
OLD_TOP_LEVEL = (
    "__version__", "info",
    "softmax", "softmax_lse", "log_softmax", "logsumexp", "softmax_vjp", "log_softmax_vjp", "softmax_jvp",
    "softmax_jacobian",
    "scaled_dot_product_attention", "sdpa_forward", "sdpa_backward", "sdpa_jvp", "sdpa_backward_jvp", "sdpa_hvp",
    "sdpa_forward_complex", "AbsorbedGrads", "ScoreMod", "BlockMask", "ScoreModGrads", "check_score_mod",
    "AttentionGrads", "AttentionResiduals", "FULLY_MASKED_POLICIES", "METHODS", "BACKWARD_METHODS",
    "AttentionOptions", "OPTION_NAMES",
    "Packed", "KVCache", "flash_attn_varlen_func", "flash_attn_with_kvcache",
    "convert_lse", "combine_lse", "merge_attention", "merge_attention_backward", "split_kv_partials",
    "causal_mask", "window_mask", "padding_mask", "alibi_bias", "alibi_slopes",
    "check_vjp", "assert_vjp", "check_jvp", "assert_jvp", "check_hvp", "assert_hvp", "numerical_jacobian",
    "GradcheckReport",
    "check_implementation", "assert_conforms", "check_merge",
)

#: Each namespace, and the old top-level names it is now the home of.
NAMESPACES = {
    "sdpa_ref.functional": ("softmax", "softmax_lse", "log_softmax", "logsumexp", "softmax_vjp", "log_softmax_vjp",
                            "softmax_jvp", "softmax_jacobian"),
    "sdpa_ref.gradcheck": ("check_vjp", "assert_vjp", "check_jvp", "assert_jvp", "check_hvp", "assert_hvp",
                           "numerical_jacobian", "GradcheckReport"),
    "sdpa_ref.conformance": ("check_implementation", "assert_conforms", "check_merge"),
    "sdpa_ref.flex": ("ScoreMod", "BlockMask", "check_score_mod"),
    "sdpa_ref.flash": ("flash_attn_varlen_func", "flash_attn_with_kvcache"),
    "sdpa_ref.masks": ("causal_mask", "window_mask", "padding_mask"),
    "sdpa_ref.alibi": ("alibi_bias", "alibi_slopes"),
    "sdpa_ref.lse": ("convert_lse", "combine_lse"),
    "sdpa_ref.merge": ("merge_attention", "merge_attention_backward"),
    "sdpa_ref.api": ("sdpa_forward_complex", "METHODS"),
    "sdpa_ref.options": ("FULLY_MASKED_POLICIES", "OPTION_NAMES"),
    "sdpa_ref.derivatives": ("BACKWARD_METHODS",),
    "sdpa_ref.residuals": ("AbsorbedGrads", "ScoreModGrads"),
}


def test_the_top_level_is_a_surface_a_person_can_hold():
    assert len(sdpa_ref.__all__) <= 25
    assert len(set(sdpa_ref.__all__)) == len(sdpa_ref.__all__)
    assert set(sdpa_ref.__all__) <= set(OLD_TOP_LEVEL)


def test_every_old_name_is_in_a_namespace():
    moved = set(OLD_TOP_LEVEL) - set(sdpa_ref.__all__)
    homes = {n for names in NAMESPACES.values() for n in names}
    assert moved <= homes, sorted(moved - homes)


@pytest.mark.parametrize("name", OLD_TOP_LEVEL)
def test_every_old_name_keeps_working(name):
    obj = getattr(sdpa_ref, name)
    ns = {}
    exec(f"from sdpa_ref import {name}", ns)
    assert ns[name] is obj
    assert name in dir(sdpa_ref)
    for mod, names in NAMESPACES.items():
        if name in names:
            assert getattr(importlib.import_module(mod), name) is obj, mod


@pytest.mark.parametrize("mod", sorted(NAMESPACES))
def test_each_namespace_all_resolves(mod):
    m = importlib.import_module(mod)
    assert set(NAMESPACES[mod]) <= set(m.__all__)
    for name in m.__all__:
        assert getattr(m, name) is not None, name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        sdpa_ref.no_such_name
    with pytest.raises(ImportError):
        exec("from sdpa_ref import no_such_name", {})


def test_the_harness_loads_on_first_use():
    code = ("import sys, sdpa_ref; a = 'sdpa_ref.harness' in sys.modules; sdpa_ref.check_merge; "
            "print(a, 'sdpa_ref.harness' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


@pytest.mark.parametrize("mod", ["sdpa_ref.functional", "sdpa_ref.flex"])
def test_docstring_examples(mod):
    res = doctest.testmod(importlib.import_module(mod), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


def test_create_block_mask_takes_flex_attention_arguments():
    from sdpa_ref import flex

    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx             # noqa: E731
    got = flex.create_block_mask(causal, B=None, H=2, Q_LEN=64, KV_LEN=96, device="cuda", BLOCK_SIZE=(16, 32))
    want = sdpa_ref.BlockMask.from_mask_mod(causal, 1, 2, 64, 96, block_size=(16, 32))
    assert got.block_size == want.block_size == (16, 32)
    assert got.tiles.shape == (1, 2, 4, 3)
    assert (got.tiles == want.tiles).all()


def test_one_gradients_record():
    """Every backward returns an AttentionGrads; MLA's ``qv`` and a score function's tensors add fields after the
    six (subclasses), and every record reads ``qv`` and ``score_mod`` (None without them)."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((1, 2, 3, 4))
    plain = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(x, x, x)[1], x)
    absorbed = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(x, x, x, qv=x)[1], x)
    assert type(plain) is sdpa_ref.AttentionGrads and len(plain) == 6
    assert plain.qv is None and plain.score_mod is None
    assert isinstance(absorbed, sdpa_ref.AttentionGrads) and isinstance(absorbed, sdpa_ref.AbsorbedGrads)
    assert len(absorbed) == 7 and absorbed[6] is absorbed.qv and absorbed.score_mod is None
    assert issubclass(sdpa_ref.ScoreModGrads, sdpa_ref.AttentionGrads)
    assert sdpa_ref.ScoreModGrads._fields == sdpa_ref.AttentionGrads._fields + ("qv", "score_mod")


def test_the_release_note_says_where_each_name_moved():
    import pathlib

    note = pathlib.Path(__file__).resolve().parents[1] / "CHANGELOG.md"
    if not note.exists():
        pytest.skip("the release note is not shipped beside the tests")
    text = note.read_text()
    for name in set(OLD_TOP_LEVEL) - set(sdpa_ref.__all__):
        assert f"`{name}`" in text, name
