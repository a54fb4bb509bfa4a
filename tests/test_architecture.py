"""The shape of the package holds: no import cycles, each piece of math in one place.

Module size is not checked: a module is split where its ideas part, never at a line count (../shared/STYLE.md;
the old 420-line cap split modules by size, which issue 41 names as a defect of the house).
"""

import ast
import functools
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
    return _stripped(path.read_text())


@functools.lru_cache(maxsize=None)
def _stripped(text):
    """:func:`_code_without_docstrings` of a module's text (kept: each check of every module reads them all)."""
    tree = ast.parse(text)
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
    # dropout's 1 / (1 - p): the keep probability 1 - p, handed to the arithmetic's division as 1 + (-p)
    "1.0, -p": {"transforms.py"},
    # the fully-masked policy's fill values: the uniform average 1/S, in the arithmetic's precision
    "X.recip(S)": {"policy.py"},
    # the GQA group size
    "Hq // Hkv": {"problem.py"},
    # the pivot of the softmax VJP (the row's largest P) -- and the reports' worst entry, which is not math
    "np.argmax(": {"pivot.py", "judge.py", "report.py"},
}


@pytest.mark.parametrize("snippet", list(ONE_HOME))
def test_each_piece_of_math_lives_in_one_place(snippet):
    found = {p.name for p in MODULES if snippet in _code_without_docstrings(p)
             and p.parent.name != "adapters" and p.name != "diagnostics.py"}
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


#: The longest chain of intra-package imports allowed (issue 41: at most 12 modules deep).
MAX_IMPORT_DEPTH = 12


def longest_import_chain(graph):
    """The longest chain ``[a, b, ...]`` of the acyclic import graph ``{module: imported modules}``, ``a``
    importing ``b`` and so on to a module that imports none of the package (every import counted, top-level
    or inside a function, as :func:`_imports` reads them)."""
    depth = {}

    def deepest(n):
        if n not in depth:
            depth[n] = max((deepest(m) for m in graph.get(n, ())), default=0) + 1
        return depth[n]

    chain = [max(sorted(graph), key=deepest)]
    while graph.get(chain[-1]):
        chain.append(max(sorted(graph[chain[-1]]), key=deepest))
    return chain


def test_the_longest_import_chain_is_short():
    graph = {name: _imports(path, name) for path, name in MODULES.items()}
    chain = longest_import_chain(graph)
    assert len(chain) <= MAX_IMPORT_DEPTH, f"{len(chain)} deep: " + " -> ".join(chain)


def test_the_chain_finder_finds_the_longest_chain():
    graph = {"a": {"b", "d"}, "b": {"c"}, "c": set(), "d": set(), "e": {"a"}}
    assert longest_import_chain(graph) == ["e", "a", "b", "c"]
    assert longest_import_chain({"a": set()}) == ["a"]


def _lint_imports(root):
    """``lint-imports`` run on the tree at ``root`` (its ``.importlinter`` and its ``sdpa_ref``): the exit
    status and the report."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    return run.returncode, run.stdout + run.stderr


def _source_root():
    """The checkout these tests are in (the contract is checked on its sources, installed or not)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    if not (root / ".importlinter").exists() or not (root / "sdpa_ref" / "__init__.py").exists():
        pytest.skip("not a source checkout")
    return root


def test_the_import_contract_holds():
    """The layers of .importlinter: the public API over the schedules over the stages over the arithmetic, the
    teaching core importing nothing of the package, the engines none of the conformance tools."""
    pytest.importorskip("importlinter")
    code, report = _lint_imports(_source_root())
    assert code == 0, report


def _copy(tmp_path):
    import shutil

    root = _source_root()
    shutil.copy(root / ".importlinter", tmp_path / ".importlinter")
    shutil.copytree(root / "sdpa_ref", tmp_path / "sdpa_ref", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tmp_path


@pytest.mark.parametrize("module, planted, contract", [
    ("arith.py", "from . import api\n", "layers"),                    # the arithmetic importing the public API
    ("transforms.py", "from .engines import tiled\n", "layers"),        # a stage importing a schedule
    ("engines/tiled.py", "from ..harness import cases\n", "conformance tools"),
    ("core.py", "from . import softmax\n", "teaching core"),
])
def test_the_import_contract_fails_on_a_planted_import(tmp_path, module, planted, contract):
    pytest.importorskip("importlinter")
    root = _copy(tmp_path)
    code, report = _lint_imports(root)
    assert code == 0, report                                    # the copy is analysed, and holds as the tree does
    path = root / "sdpa_ref" / module
    if not path.exists():
        pytest.skip(f"sdpa_ref/{module} is not in this tree")
    text = path.read_text()
    head = text.index("\nimport ") if "\nimport " in text else 0        # after the module docstring
    path.write_text(text[:head + 1] + planted + text[head + 1:])
    code, report = _lint_imports(root)
    assert code != 0, report
    assert "BROKEN" in report


#: Test files about the package as a whole rather than one module: the docs and examples run, the README, the
#: public surface, the import contract, the named tolerances, bad input across every entry point, one test per
#: defect found, a kernel author's first hour, and the peers' conventions across the API.
CROSS_CUTTING = ("architecture", "docs_site", "docs_sources", "doctests", "examples", "readme", "public_api",
                 "tolerances", "hardening", "regressions", "first_hour", "peers", "benchmarks")


def module_of_test(test_name, modules=None):
    """The package module a test file ``test_<name>.py`` is for: the longest ``_``-joined prefix of ``<name>``
    that names a module (``engines_tiled`` -> ``sdpa_ref.engines.tiled``), or None."""
    modules = set(MODULES.values()) if modules is None else modules
    parts = test_name.split("_")
    for n in range(len(parts), 0, -1):
        for cut in range(n, 0, -1):                    # a module name may itself hold "_" (score_mod, second_order)
            pkg, mod = parts[:cut - 1], "_".join(parts[cut - 1:n])
            for name in (".".join(["sdpa_ref"] + pkg + [mod]), ".".join(["sdpa_ref"] + pkg + ["_" + mod])):
                if name in modules:                    # a private module (_threads) by its plain name
                    return name
    return None


def test_tests_mirror_the_package():
    """Each ``tests/test_<x>.py`` is named for the module it tests (or is one of the cross-cutting files)."""
    stray = []
    for p in sorted(pathlib.Path(__file__).parent.glob("test_*.py")):
        name = p.stem[len("test_"):]
        if module_of_test(name) is None and not name.startswith(CROSS_CUTTING):
            stray.append(p.name)
    assert not stray, f"test files named for no module of the package: {stray}"


def test_the_mirror_check_reads_module_names():
    mods = {"sdpa_ref.engines.tiled", "sdpa_ref.score_mod", "sdpa_ref.second_order", "sdpa_ref.harness.vectors"}
    assert module_of_test("engines_tiled", mods) == "sdpa_ref.engines.tiled"
    assert module_of_test("score_mod", mods) == "sdpa_ref.score_mod"
    assert module_of_test("second_order_jax", mods) == "sdpa_ref.second_order"
    assert module_of_test("harness_vectors_hashes", mods) == "sdpa_ref.harness.vectors"
    assert module_of_test("edges_rows", mods) is None
    assert module_of_test("threads", {"sdpa_ref._threads"}) == "sdpa_ref._threads"
