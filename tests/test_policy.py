"""``sdpa_ref.policy``: the fully-masked policy is decided in one place.

Two things are held here. The predicates of ``policy.py`` say what each policy does, and each answer is read
off the policy's own paragraph in ``SEMANTICS.md`` ("A row with no allowed key") and seen in what
``sdpa_forward`` gives on a row with no allowed key. And no module outside ``policy.py`` tells the policies
apart by name: a comparison with a policy's name, a dispatch on it or a list of the names elsewhere would be a
second home for the policy. The adapters and the FlashAttention-style wrapper may translate a peer's
convention to the package's and are not counted.
"""

import ast
import pathlib
import re

import numpy as np
import pytest

from sdpa_ref import policy, sdpa_backward, sdpa_forward, sdpa_jvp
from sdpa_ref.options import FULLY_MASKED_POLICIES, AttentionOptions

from tolerances import F64_AMPLIFIED, F64_FEW_ULP, F64_GRAD
import sdpa_ref
from hypothesis import given, settings, strategies as st
from helpers import assert_close_normwise

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sdpa_ref"
TRANSLATORS = ("adapters/", "flash.py")            # they may translate a peer's convention
HOMES_AT_MOST = 2                                   # policy.py, and at most one other

# ------------------------------------------------------------------ one home: no comparison elsewhere


def _names(node):
    """The policy names a literal holds: a string, or the strings of a tuple, list or set."""
    if isinstance(node, ast.Constant) and node.value in FULLY_MASKED_POLICIES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in FULLY_MASKED_POLICIES]
    return []


def policy_decisions(source):
    """The lines of ``source`` that decide by a policy's name: a comparison with a name or a collection of names
    (``==``, ``!=``, ``in``), a dispatch on a dict literal keyed by names, and a literal collection of two names
    or more (an enumeration of the policies). Docstrings, comments and a single name passed as a value
    (``fully_masked="zero"``) are not decisions."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_names(x) for x in (node.left, *node.comparators)):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) and \
                any(_names(k) for k in node.value.keys if k is not None):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(_names(node)) >= 2:
            lines.append(node.lineno)
    return sorted(set(lines))


def modules_deciding_the_policy():
    """``{module: lines}`` over the package, less the translators."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(TRANSLATORS):
            continue
        lines = policy_decisions(path.read_text(encoding="utf-8"))
        if lines:
            found[f"sdpa_ref/{rel}"] = lines
    return found


def test_the_policy_is_decided_in_one_place():
    found = modules_deciding_the_policy()
    assert "sdpa_ref/policy.py" in found
    assert len(found) <= HOMES_AT_MOST, (
        f"the fully-masked policy is told apart by name in {len(found)} modules, {found}; ask a predicate of "
        f"sdpa_ref.policy instead (or add one there, named for what the caller needs to know)")


@pytest.mark.parametrize("source", [
    'if o.fully_masked == "uniform":\n    pass\n',
    'if o.fully_masked in ("uniform", "jax"):\n    pass\n',
    'skip = "nan" != policy\n',
    'x = {"zero": 0.0, "nan": 1.0}[policy]\n',
    'for p in ("zero", "nan", "uniform"):\n    pass\n',
])
def test_the_scan_sees_a_planted_decision(source):
    assert policy_decisions(source) == [1]


@pytest.mark.parametrize("source", [
    'out = sdpa_forward(q, k, v, fully_masked="zero")\n',
    'if policy.averages_values(o.fully_masked):\n    pass\n',
    'x = float("nan")\n',
    '"""Under ``"uniform"`` and ``"jax"`` a row averages."""\n',
    'if bug in ("nan_rows", "zero_rows"):\n    pass\n',
])
def test_the_scan_passes_what_is_not_a_decision(source):
    assert policy_decisions(source) == []


# ------------------------------------------------------------------ the predicates against SEMANTICS.md

#: For each predicate, the policies it holds for, each with the words of its paragraph in SEMANTICS.md that
#: say so; it is False for every other policy.
CONTRACT = {
    policy.is_default: {"zero": "(the default)"},
    policy.fills_zero: {"zero": "the output row is 0 and its gradients are 0"},
    policy.makes_nan: {"nan": "NaN. This is the textbook formula"},
    policy.averages_values: {"uniform": "the output is the mean of V",
                             "jax": "A row with no allowed key averages the `n` keys"},
    policy.averages_every_key: {"uniform": "softmax over all S keys"},
    policy.averages_excluded: {"jax": "averages the `n` keys the structural rules exclude from it"},
    policy.emulates_peer: {"jax": "JAX's, exactly"},
}


def semantics_paragraphs():
    """``{policy: its paragraph}`` from SEMANTICS.md's list under "A row with no allowed key", whitespace made
    single spaces."""
    text = (ROOT / "SEMANTICS.md").read_text(encoding="utf-8")
    section = text.split("**A row with no allowed key.**", 1)[1].split("\n\n", 2)[1]
    items = re.split(r"^- ", section, flags=re.M)[1:]
    out = {}
    for item in items:
        name = re.match(r'`"(\w+)"`', item).group(1)
        out[name] = " ".join(item.split())
    return out


def test_semantics_lists_the_policies():
    assert tuple(semantics_paragraphs()) == FULLY_MASKED_POLICIES
    assert policy.FULLY_MASKED_POLICIES is FULLY_MASKED_POLICIES


@pytest.mark.parametrize("predicate", list(CONTRACT), ids=lambda f: f.__name__)
def test_each_predicate_says_what_semantics_says(predicate):
    paragraphs = semantics_paragraphs()
    holds = CONTRACT[predicate]
    for name in FULLY_MASKED_POLICIES:
        assert predicate(name) is (name in holds), (predicate.__name__, name)
        if name in holds:
            assert holds[name] in paragraphs[name], (predicate.__name__, name, holds[name])


@pytest.mark.parametrize("predicate", list(CONTRACT), ids=lambda f: f.__name__)
def test_a_predicate_answers_false_to_an_unknown_name(predicate):
    assert predicate("ones") is False
    assert predicate(None) is False


def test_the_default_is_the_options_default():
    assert policy.DEFAULT == AttentionOptions().fully_masked
    assert [p for p in FULLY_MASKED_POLICIES if policy.is_default(p)] == [policy.DEFAULT]


# ------------------------------------------------------------------ the predicates against what rows get


def _rows(name):
    """``(out, v)`` for one head, L = 3, S = 4, whose rows have no allowed key three ways: row 0 by the bool mask
    (every key excluded structurally), row 1 by the bool mask on keys 2, 3 and a ``-inf`` bias on keys 0, 1, row
    2 by a ``-inf`` bias on every key (none excluded structurally)."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 1, 3, 2)), rng.standard_normal((1, 1, 4, 2)), rng.standard_normal((1, 1, 4, 2))
    mask = np.ones((3, 4), bool)
    mask[0] = False
    mask[1, 2:] = False
    bias = np.zeros((3, 4))
    bias[1, :2] = -np.inf
    bias[2] = -np.inf
    out, _ = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, fully_masked=name)
    return out[0, 0], v[0, 0]


@pytest.mark.parametrize("name", FULLY_MASKED_POLICIES)
def test_the_predicates_are_what_a_row_gets(name):
    out, v = _rows(name)
    every, excluded_1 = v.mean(axis=0), v[2:].mean(axis=0)
    if policy.fills_zero(name):
        np.testing.assert_array_equal(out, 0.0)
    if policy.makes_nan(name):
        assert np.isnan(out).all()
    if policy.averages_every_key(name):
        for row in out:
            np.testing.assert_allclose(row, every, rtol=F64_FEW_ULP, atol=F64_FEW_ULP)
    if policy.averages_excluded(name):               # JAX: the excluded keys; none excluded on row 2: NaN
        np.testing.assert_allclose(out[0], every, rtol=F64_FEW_ULP, atol=F64_FEW_ULP)
        np.testing.assert_allclose(out[1], excluded_1, rtol=F64_FEW_ULP, atol=F64_FEW_ULP)
        assert np.isnan(out[2]).all()
    reads_values = np.isfinite(out).all(axis=-1) & (out != 0).any(axis=-1)
    assert bool(reads_values.any()) is policy.averages_values(name)
    assert (policy.fills_zero(name) + policy.makes_nan(name) + policy.averages_values(name)) == 1


@pytest.mark.parametrize("name", FULLY_MASKED_POLICIES)
def test_the_mean_over_every_key_needs_a_key(name):
    q, k, v = np.ones((1, 1, 2, 2)), np.ones((1, 1, 0, 2)), np.ones((1, 1, 0, 2))
    if policy.averages_every_key(name):
        with pytest.raises(ValueError, match="fully_masked"):
            sdpa_forward(q, k, v, fully_masked=name)
    else:
        out, _ = sdpa_forward(q, k, v, fully_masked=name)
        assert bool(np.isnan(out).all()) is policy.makes_nan(name)


HOWS = {"fast": {}, "plain": {"method": "plain"}, "tiled-2": {"block_size": 2}, "split-2": {"num_splits": 2},
        "reproducible": {"precision": "reproducible"}}


SENTINEL = -0.7 * np.finfo(np.float64).max


def structural(B, H, L, S, o):
    """The structurally allowed entries ``(B, H, L, S)``, by broadcasting index grids (JAX's own way)."""
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    a = np.ones((B, H, L, S), bool)
    if o.get("attn_mask") is not None:
        a &= o["attn_mask"]
    if o.get("is_causal"):
        a &= j <= i
    if o.get("window") is not None:
        left = o["window"][0]
        a &= j >= i - left
    if o.get("kv_lengths") is not None:
        a &= j < np.asarray(o["kv_lengths"])[:, None, None, None]
    return a


def jax_oracle(q, k, v, o):
    B, H, L, E = q.shape
    S = k.shape[2]
    T = q @ np.swapaxes(k, -1, -2) / np.sqrt(E)
    if o.get("bias") is not None:
        T = T + o["bias"]
    T = np.where(structural(B, H, L, S, o), T, SENTINEL)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(T - T.max(-1, keepdims=True))
        P = e / e.sum(-1, keepdims=True)
    if o.get("dropout_mask") is not None:
        P = P * o["dropout_mask"] / (1 - o["dropout_p"])
    out = P @ v
    if o.get("q_lengths") is not None:
        out = np.where(np.arange(L)[:, None] < np.asarray(o["q_lengths"])[:, None, None, None], out, 0.0)
    return out


@st.composite
def problems(draw):
    B, H, L, S, E = (draw(st.integers(1, n)) for n in (2, 2, 5, 6, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v = (rng.standard_normal(s) for s in ((B, H, L, E), (B, H, S, E), (B, H, S, 2)))
    o = {"fully_masked": "jax", "is_causal": draw(st.booleans())}
    if draw(st.booleans()):
        o["attn_mask"] = rng.random((B, H, L, S)) > 0.4
    bias = rng.standard_normal((B, H, L, S))
    bias[rng.random((B, H, L, S)) < draw(st.sampled_from([0.0, 0.5, 0.9]))] = -np.inf
    for r in range(L):                                             # rows of -inf: all, or the allowed ones
        if rng.random() < 0.3:
            bias[..., r, :] = -np.inf
    o["bias"] = bias
    if draw(st.booleans()):
        o["kv_lengths"] = rng.integers(0, S + 1, B)
    if draw(st.booleans()):
        o["q_lengths"] = rng.integers(0, L + 1, B)
    if draw(st.booleans()):
        o["window"] = (draw(st.integers(0, 2)), None)
    if draw(st.booleans()):
        o["dropout_mask"], o["dropout_p"] = rng.random((B, H, L, S)) > 0.25, 0.25
    return (q, k, v), o


@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(problem=problems())
def test_every_engine_gives_jax_s_result(problem, how):
    (q, k, v), o = problem
    want = jax_oracle(q, k, v, o)
    got = sdpa_forward(q, k, v, **o, **HOWS[how])[0]
    assert_close_normwise(want, got, F64_AMPLIFIED)


@pytest.mark.parametrize("how", list(HOWS))
@settings(max_examples=max(8, settings.default.max_examples // 3))
@given(problem=problems())
def test_every_engine_gives_the_same_gradients_and_tangents(problem, how):
    (q, k, v), o = problem
    rng = np.random.default_rng(1)
    out, res = sdpa_forward(q, k, v, **o, method="plain")
    g = rng.standard_normal(out.shape)
    ts = tuple(rng.standard_normal(x.shape) for x in (q, k, v))
    want = (sdpa_backward(res, g), sdpa_jvp((q, k, v), ts, **o, method="plain")[1])
    out2, res2 = sdpa_forward(q, k, v, **o, **HOWS[how])
    kw = {k2: v2 for k2, v2 in HOWS[how].items() if k2 != "block_size"}
    got = (sdpa_backward(res2, g), sdpa_jvp((q, k, v), ts, **o, **kw)[1])
    for a, b in zip(want[0], got[0]):
        assert_close_normwise(a, b, F64_GRAD)
    assert_close_normwise(want[1], got[1], F64_GRAD)


def test_a_row_emptied_by_minus_inf_floats_averages_the_excluded_keys_and_its_gradients_are_exact():
    """Row 1 allows keys 2..4, all with a -inf bias: JAX averages keys 0 and 1 (the sentinel's), so dV gets
    g / 2 on each, and nothing reaches q, k or the bias from that row. Row 2 is -inf everywhere and allows every
    key: NaN, as the "nan" policy."""
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 1, 3, 2)), rng.standard_normal((1, 1, 5, 2)), rng.standard_normal((1, 1, 5, 3))
    mask = np.ones((3, 5), bool)
    mask[1, :2] = False
    bias = np.zeros((3, 5))
    bias[1, 2:] = -np.inf
    bias[2] = -np.inf
    out, res = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, fully_masked="jax")
    np.testing.assert_allclose(out[0, 0, 1], v[0, 0, :2].mean(0), rtol=F64_FEW_ULP)
    assert np.isnan(out[0, 0, 2]).all() and np.isfinite(out[0, 0, :2]).all()
    uniform = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, fully_masked="uniform")[0]
    np.testing.assert_allclose(uniform[0, 0, 1], v[0, 0].mean(0), rtol=F64_FEW_ULP)     # the difference
    _, res = sdpa_forward(q[:, :, :2], k, v, attn_mask=mask[:2], bias=bias[:2], fully_masked="jax")
    g = np.zeros((1, 1, 2, 3))                                     # (with row 2, every dV would be NaN)
    g[0, 0, 1] = rng.standard_normal(3)
    gr = sdpa_backward(res, g)
    np.testing.assert_allclose(gr.value[0, 0, :2], np.tile(g[0, 0, 1] / 2, (2, 1)), rtol=F64_FEW_ULP)
    assert np.all(gr.value[0, 0, 2:] == 0) and np.all(gr.query == 0) and np.all(gr.key == 0)
    assert np.all(gr.bias[1] == 0)


def test_without_minus_inf_floats_jax_is_uniform_bit_for_bit():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 6, 3)), rng.standard_normal((2, 2, 6, 2))
    o = dict(attn_mask=rng.random((2, 2, 4, 6)) > 0.7, is_causal=True, kv_lengths=np.array([6, 2]))
    for how in HOWS.values():
        a, ra = sdpa_forward(q, k, v, fully_masked="uniform", **o, **how)
        b, rb = sdpa_forward(q, k, v, fully_masked="jax", **o, **how)
        np.testing.assert_array_equal(a, b)
        g = rng.standard_normal(a.shape)
        for x, y in zip(sdpa_backward(ra, g), sdpa_backward(rb, g)):
            np.testing.assert_array_equal(x, y)


def test_the_gradients_match_central_differences():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((1, 2, 3, 2)), rng.standard_normal((1, 2, 4, 2)), rng.standard_normal((1, 2, 4, 2))
    mask = np.ones((3, 4), bool)
    mask[0, :2] = False
    bias = rng.standard_normal((2, 3, 4))
    bias[:, 0, 2:] = -np.inf                                       # row 0 averages keys 0 and 1
    o = dict(attn_mask=mask, bias=bias, fully_masked="jax", softcap=2.0)
    for how in ({}, {"block_size": 2}):
        f = lambda q, k, v: sdpa_forward(q, k, v, **o, **how)[0]                       # noqa: E731
        vjp = lambda g, q, k, v: sdpa_backward(sdpa_forward(q, k, v, **o, **how)[1], g)[:3]   # noqa: E731
        assert sdpa_ref.check_vjp(f, vjp, (q, k, v)).ok
        jvp = lambda t, q, k, v: sdpa_jvp((q, k, v), t, **o, **how)[1]                 # noqa: E731
        assert sdpa_ref.check_jvp(f, jvp, (q, k, v)).ok


@pytest.mark.parametrize("how", list(HOWS))
def test_a_jax_row_reads_only_the_keys_it_averages(how):
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 1, 2, 2)), rng.standard_normal((1, 1, 4, 2)), rng.standard_normal((1, 1, 4, 2))
    mask = np.array([[False, True, True, True], [True] * 4])
    bias = np.zeros((2, 4))
    bias[0, 1:] = -np.inf                                          # row 0: averages key 0 only
    clean = sdpa_forward(q, k, v, attn_mask=mask, bias=bias, fully_masked="jax", **HOWS[how])[0]
    v2 = v.copy()
    v2[0, 0, 2] = np.nan                                           # read by row 1, not by row 0
    out = sdpa_forward(q, k, v2, attn_mask=mask, bias=bias, fully_masked="jax", **HOWS[how])[0]
    np.testing.assert_array_equal(out[0, 0, 0], clean[0, 0, 0])
    assert np.isnan(out[0, 0, 1]).any()
    v3 = v.copy()
    v3[0, 0, 0] = np.inf                                           # the key row 0 averages
    assert np.isnan(sdpa_forward(q, k, v3, attn_mask=mask, bias=bias, fully_masked="jax",
                                 **HOWS[how])[0][0, 0, 0]).all()


def test_jax_with_a_layout_is_refused_and_s_zero_gives_zero():
    """S = 0: JAX's P V sums over no key, 0 (tests/test_peers.py checks the gradients and every engine)."""
    x = np.zeros((3, 1, 2))
    with pytest.raises(ValueError, match="`fully_masked`"):
        sdpa_forward(x, x, x, layout=sdpa_ref.Packed([0, 3], [0, 3]), fully_masked="jax")
    out = sdpa_forward(np.zeros((1, 2, 2)), np.zeros((1, 0, 2)), np.zeros((1, 0, 2)), fully_masked="jax")[0]
    np.testing.assert_array_equal(out, np.zeros((1, 2, 2)))


@pytest.mark.parametrize("how", list(HOWS))
def test_a_row_of_minus_inf_with_lengths_but_no_excluded_key_is_nan(how):
    """Regression: with q_lengths the allowed set broadcasts over the keys (shape (..., L, 1)); its count of
    excluded keys must count every key, not one."""
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 2, 1, 2)), rng.standard_normal((2, 2, 2, 2)), rng.standard_normal((2, 2, 2, 2))
    bias = np.zeros((2, 2, 1, 2))
    bias[1, 0] = -np.inf
    o = dict(bias=bias, fully_masked="jax", q_lengths=np.array([1, 1]))
    out = sdpa_forward(q, k, v, **o, **HOWS[how])[0]
    assert np.isnan(out[1, 0]).all() and np.isfinite(out[0]).all() and np.isfinite(out[1, 1]).all()
    assert_close_normwise(jax_oracle(q, k, v, o), out, F64_AMPLIFIED)
