"""The shape of the package holds: no import cycles, each piece of math in one place.

Module size is not checked: a module is split where its ideas part, never at a line count (../shared/STYLE.md;
the old 420-line cap split modules by size, which issue 41 names as a defect of the house).
"""

import ast
import pathlib

import pytest

import sdpa_ref
from sdpa_ref import OPTION_NAMES

PKG = pathlib.Path(sdpa_ref.__file__).resolve().parent
MODULES = {p: ".".join(("sdpa_ref",) + p.relative_to(PKG).with_suffix("").parts).replace(".__init__", "")
           for p in sorted(PKG.rglob("*.py"))}


def _imports(path, name):
    """Every sdpa_ref module that ``path`` imports, at the top or inside a function."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES.values()]
            cands = subs if len(subs) == len(node.names) else [mod] + subs
        elif isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        else:
            continue
        out |= {c for c in cands if c in MODULES.values() and c != name}
    return out


def find_cycle(graph):
    """A cycle of the directed graph ``{node: successors}`` as a list of nodes, or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycles():
    graph = {name: _imports(path, name) for path, name in MODULES.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles_and_function_level_imports(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from . import api\n")
    assert "sdpa_ref.api" in _imports(lazy, "sdpa_ref.attention")


def _code_without_docstrings(path):
    """The module's code, docstrings and comments left out."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None),
                                                                        ast.Constant):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


ONE_HOME = {
    # the softcap transform and its derivative (lowp.py: the tanh primitive of the blas specimens' arithmetic,
    # over which softcap_forward_in runs; not a second softcap)
    "np.tanh(": {"transforms.py", "lowp.py"},
    "np.cosh(": {"transforms.py"},
    # dropout's 1 / (1 - p)
    "1.0 - p": {"transforms.py"},
    # the fully-masked policy's fill values
    "'uniform': 1.0 / S": {"policy.py"},
    # the GQA group size
    "Hq // Hkv": {"problem.py"},
    # the pivot of the softmax VJP (the row's largest P) -- and the reports' worst entry, which is not math
    "np.argmax(": {"pivot.py", "judge.py", "report.py"},
}


@pytest.mark.parametrize("snippet", list(ONE_HOME))
def test_each_piece_of_math_lives_in_one_place(snippet):
    found = {p.name for p in MODULES if snippet in _code_without_docstrings(p)
             and p.parent.name != "adapters" and p.name not in ("diagnostics.py", "nn.py")}
    assert found == ONE_HOME[snippet], f"{snippet!r} is written in {sorted(found)}"


#: The engines (schedules): every stage they compute is one call to its definition.
ENGINE_MODULES = [p for p in MODULES if p.parent.name == "engines" or p.name == "attention.py"]


@pytest.mark.parametrize("path", ENGINE_MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_engine_knows_the_normalisers_extra_logits(path):
    """Sinks are the normaliser's extra logits (sdpa_ref.normalize): an engine closes its rows and passes the
    extra gradient on without naming them, so the diff that adds such a logit touches no engine."""
    assert "sink" not in _code_without_docstrings(path).lower()


def test_the_engine_check_sees_code_and_not_its_prose(tmp_path):
    engine = tmp_path / "engine.py"
    engine.write_text('"""Sinks are the normaliser\'s."""\n\n\ndef f(prob):\n    return prob.sink_rows()  # a sink\n')
    assert "sink" in _code_without_docstrings(engine).lower()
    engine.write_text('"""Sinks are the normaliser\'s."""\n\n\ndef f(prob):\n    return extras(prob)  # a sink\n')
    assert "sink" not in _code_without_docstrings(engine).lower()


def test_no_source_holds_a_control_character():
    """A ``\\frac`` or ``\\tanh`` in a docstring that is not raw is a form feed or a tab in the text."""
    bad = [str(p.relative_to(PKG)) for p in MODULES
           if any(c in p.read_text() for c in "\x0b\x0c" + "".join(map(chr, range(0, 9))))]
    tabs = [str(p.relative_to(PKG)) for p in MODULES if "\t" in p.read_text()]
    assert not bad and not tabs, (bad, tabs)


def test_the_option_list_is_written_once():
    """No module but options.py spells out (more than half of) the list of option names."""
    offenders = []
    for path in MODULES:
        if path.name == "options.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(names & set(OPTION_NAMES)) > len(OPTION_NAMES) // 2:
                    offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


def test_contract_and_architecture_docs_are_in_the_project():
    root = PKG.parent
    if not (root / "README.md").exists():
        pytest.skip("not a source checkout")
    assert (root / "SEMANTICS.md").exists() and (root / "docs" / "architecture.md").exists()
    assert len((root / "README.md").read_bytes()) <= 10 * 1024
