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

from sdpa_ref import policy, sdpa_forward
from sdpa_ref.options import FULLY_MASKED_POLICIES, AttentionOptions

from tolerances import F64_FEW_ULP

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
