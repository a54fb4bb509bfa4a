"""The compiled kernels are built at install and never at run time: nothing but the installed library is loaded.

Issue 21: the kernels used to be compiled on first use into a cache chosen from ``SDPA_REF_CACHE``,
``XDG_CACHE_HOME`` or ``HOME``, relative to the current directory when one of them was relative or unset, so
a library planted there was loaded; and a fork during the build deadlocked the child on the build lock. Here:
importing and calling the package starts no compiler and no subprocess; libraries planted in every folder the
old code looked in are never loaded; ``sdpa_ref.info()`` and ``sdpa-ref info`` say what is in use; a fork while
another thread calls the package gives a child that completes its call; and ``setup.py`` builds the library
(byte for byte the one in use) or, without a compiler, records why not and warns, without failing.
"""

import ast
import hashlib
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import sysconfig

import pytest

import sdpa_ref
from sdpa_ref.cli import main
from sdpa_ref.exact import _native

PKG = pathlib.Path(_native.__file__).resolve().parent.parent        # the sdpa_ref package in use
ROOT = PKG.parent                                                    # the folder it is imported from
REPO = pathlib.Path(__file__).resolve().parent.parent                # the checkout (for setup.py)
POSIX = os.name == "posix"

#: The calls a child makes: both engines and both precisions, forward and backward; prints a digest of the bits.
CALLS = r"""
import hashlib, json, sys
import numpy as np
import sdpa_ref
from sdpa_ref.exact import _native
rng = np.random.default_rng(7)
q, k, v, g = (rng.standard_normal((1, 2, 24, 8)) for _ in range(4))
h = hashlib.sha256()
for kw in (dict(), dict(precision="reproducible"), dict(method="tiled")):
    out, res = sdpa_ref.sdpa_forward(q, k, v, is_causal=True, **kw)
    gr = sdpa_ref.sdpa_backward(res, g)
    for a in (out, res.lse, gr.query, gr.key, gr.value):
        h.update(np.ascontiguousarray(a).tobytes())
maps = []
if sys.platform.startswith("linux"):
    with open("/proc/self/maps") as fh:
        maps = sorted({ln.split(None, 5)[5].strip() for ln in fh if len(ln.split(None, 5)) == 6})
print(json.dumps({"digest": h.hexdigest(), "in_use": _native.kernels() is not None, "maps": maps}))
"""

#: Before anything is imported: every way of starting a process raises.
NO_PROCESSES = r"""
import os, subprocess
def _refuse(*a, **k):
    with open(os.environ["REFUSED_LOG"], "a") as fh:      # written down: a caller might swallow the error
        fh.write("a process was started: %r\n" % (a[:1],))
    raise AssertionError("a process was started: %r" % (a[:1],))
subprocess.Popen = _refuse
for name in ("system", "popen", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp", "execvpe", "spawnv",
             "spawnve", "spawnvp", "spawnvpe"):
    if hasattr(os, name):
        setattr(os, name, _refuse)
"""


def _env(**over):
    """The environment of a child: ours without the package's own settings, importing the same package."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDPA_REF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["SDPA_REF_NUM_THREADS"] = "2"
    for k, v in over.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _start(code, env, cwd):
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the child ran past {timeout} s")
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _fake_compilers(folder, log):
    """``cc``, ``gcc``, ``clang``, ... in ``folder``: each records that it ran, in ``log``, and fails."""
    folder.mkdir()
    for name in ("cc", "gcc", "clang", "c99", "tcc", "x86_64-linux-gnu-gcc"):
        f = folder / name
        f.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 1\n')
        f.chmod(0o755)
    return folder


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """What a child with none of the settings below computes."""
    return _finish(_start(CALLS, _env(), str(tmp_path_factory.mktemp("plain"))))


def test_nothing_in_native_can_start_a_process():
    """``_native.py`` imports nothing that starts a process and calls nothing that does."""
    tree = ast.parse(pathlib.Path(_native.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"subprocess", "shutil", "tempfile", "sysconfig", "multiprocessing", "distutils",
                           "setuptools", "threading"}, imported
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not attrs & {"system", "popen", "Popen", "posix_spawn", "fork", "execv", "spawnv", "find_library"}
    assert "_lock" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}      # no lock to inherit


@pytest.mark.skipif(not POSIX, reason="fake compilers are shell scripts")
def test_importing_and_calling_starts_no_compiler(tmp_path, plain):
    """With ``CC`` and ``PATH`` pointing at compilers that record being run, and every way of starting a process
    raising, the package is imported and called (fast, tiled, reproducible; forward and backward): nothing ran,
    and the bits are those of a plain child."""
    log, refused = tmp_path / "compilers-ran.log", tmp_path / "processes-refused.log"
    fake = _fake_compilers(tmp_path / "bin", log)
    env = _env(CC=str(fake / "cc"), PATH=str(fake) + os.pathsep + os.environ.get("PATH", ""),
               REFUSED_LOG=str(refused))
    procs = [_start(code, env, str(tmp_path)) for code in (CALLS, NO_PROCESSES + CALLS)]
    faked, no_processes = (_finish(p) for p in procs)
    assert not log.exists(), "a compiler ran: " + log.read_text()
    assert not refused.exists(), refused.read_text()
    assert faked["digest"] == no_processes["digest"] == plain["digest"], "the bits changed"
    assert faked["in_use"] == no_processes["in_use"] == plain["in_use"] == (_native.kernels() is not None)


def _old_cache_names():
    """The file names the old runtime build gave the library (its tag hashed the sources, ``cc`` and its flags,
    the platform and the interpreter), and the new library's name."""
    src = b"".join(pathlib.Path(f).read_bytes() for f in _native._SOURCES + _native._HEADERS)
    flags = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
    tag = hashlib.sha256(src + " ".join(["cc"] + flags).encode() + sysconfig.get_platform().encode()
                         + sys.implementation.cache_tag.encode()).hexdigest()[:16]
    return [f"kernels-{tag}.so", "_compiled_kernels.so", "kernels.so"]


def _planted_library(tmp_path, marker):
    """A shared library whose constructor appends to ``marker`` when loaded (a text file named like a library
    without a compiler: loading it would fail, and the results are still compared)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    out = tmp_path / "evil.so"
    if cc:
        c = tmp_path / "evil.c"
        c.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void)\n'
                     f'{{ FILE *f = fopen("{marker}", "a"); if (f) {{ fputs("loaded\\n", f); fclose(f); }} }}\n'
                     "int sdpa_fast_set_level(int l) { return 0; }\nint sdpa_fast_get_level(void) { return 0; }\n")
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(c)], check=True, capture_output=True)
    else:
        out.write_text("not a library\n")
    return out


def _plant(lib, folder):
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)                                   # owned by us, nobody else can write: the old code's test
    for name in _old_cache_names():
        shutil.copy(lib, folder / name)


@pytest.mark.skipif(not POSIX, reason="the old cache folders are POSIX paths")
def test_libraries_planted_where_the_old_cache_was_are_never_loaded(tmp_path, plain):
    """A library planted in every folder the old runtime build read (``$SDPA_REF_CACHE``,
    ``$XDG_CACHE_HOME/sdpa_ref``, ``$HOME/.cache/sdpa_ref``, the temporary directory's ``sdpa_ref-UID``; each
    absolute, relative to the current directory, or the current directory itself) is never loaded: its
    constructor never runs, it is not mapped, and the bits are those of a plain child."""
    marker = tmp_path / "planted-library-ran"
    lib = _planted_library(tmp_path, marker)
    uid = os.getuid()
    a, cwd = tmp_path / "abs", tmp_path / "cwd"
    (a / "tmp").mkdir(parents=True)
    cwd.mkdir()
    for d in (a / "cache", a / "xdg" / "sdpa_ref", a / "home" / ".cache" / "sdpa_ref", a / "tmp" / f"sdpa_ref-{uid}",
              cwd / "relcache", cwd / "relxdg" / "sdpa_ref", cwd / "relhome" / ".cache" / "sdpa_ref",
              cwd / ".cache" / "sdpa_ref", cwd, cwd / "tmp" / f"sdpa_ref-{uid}"):
        _plant(lib, d)
    configs = [
        dict(SDPA_REF_CACHE=str(a / "cache"), XDG_CACHE_HOME=str(a / "xdg"), HOME=str(a / "home"),
             TMPDIR=str(a / "tmp")),
        dict(SDPA_REF_CACHE="relcache", XDG_CACHE_HOME="relxdg", HOME="relhome", TMPDIR="tmp"),
        dict(SDPA_REF_CACHE=None, XDG_CACHE_HOME="relxdg", HOME="relhome"),
        dict(SDPA_REF_CACHE=None, XDG_CACHE_HOME=None, HOME="relhome"),
        dict(SDPA_REF_CACHE=None, XDG_CACHE_HOME=None, HOME="."),
        dict(SDPA_REF_CACHE=".", XDG_CACHE_HOME="", HOME="relhome"),
    ]
    procs = [_start(CALLS, _env(**c), str(cwd)) for c in configs]
    results = [_finish(p) for p in procs]
    assert not marker.exists(), "a planted library was loaded"
    for c, r in zip(configs, results):
        assert r["digest"] == plain["digest"], c
        assert r["in_use"] == plain["in_use"], c
        assert not [m for m in r["maps"] if str(tmp_path) in m], (c, r["maps"])
        if r["in_use"]:
            assert str(pathlib.Path(_native._LIBRARY).resolve()) in [str(pathlib.Path(m).resolve())
                                                                     for m in r["maps"] if m.startswith("/")]


def test_only_a_regular_file_at_the_packages_own_path_is_loaded(tmp_path, monkeypatch):
    """The loader opens one path, beside ``_native.py``; a missing file says what the install recorded, and
    anything but a regular file (here a folder) is refused without being opened."""
    assert pathlib.Path(_native._LIBRARY).parent == pathlib.Path(_native.__file__).resolve().parent
    monkeypatch.setattr(_native, "_LIBRARY", str(tmp_path / "absent.so"))
    monkeypatch.setattr(_native, "_RECORD", str(tmp_path / "absent.json"))
    lib, why = _native._load()
    assert lib is None and why.startswith("not built") and ("no build record" in why or "source tree" in why)
    (tmp_path / "absent.json").write_text(json.dumps({"built": False, "reason": "no C compiler: 'cc' was not found"}))
    assert _native._load() == (None, "not built at install: no C compiler: 'cc' was not found")
    (tmp_path / "absent.json").write_text(json.dumps({"built": True, "reason": None}))
    assert "not in the package" in _native._load()[1]
    (tmp_path / "dir.so").mkdir()
    monkeypatch.setattr(_native, "_LIBRARY", str(tmp_path / "dir.so"))
    assert _native._load() == (None, f"failed to load: {tmp_path / 'dir.so'} is not a regular file")
    (tmp_path / "junk.so").write_text("not a library")
    monkeypatch.setattr(_native, "_LIBRARY", str(tmp_path / "junk.so"))
    lib, why = _native._load()
    assert lib is None and why.startswith("failed to load:")


def _need_kernels():
    if _native.kernels() is None:
        pytest.skip(f"compiled kernels not in use: {_native.status()['reason']}")


def test_the_library_in_use_is_the_packages_own_and_is_not_stale():
    """The library in use sits beside ``_native.py``, and was built from the C sources installed with it (after
    editing them in an editable install: ``pip install -e .`` or ``python setup.py build_ext --inplace``)."""
    _need_kernels()
    st = _native.status()
    assert st["in_use"] and st["reason"] is None and st["path"] == _native._LIBRARY
    assert stat.S_ISREG(os.stat(st["path"]).st_mode)
    assert st["build"] and st["build"]["built"] is True
    assert st["stale"] is False, ("the compiled kernels were built from other C sources than those beside them: "
                                  "rebuild (pip install -e . / python setup.py build_ext --inplace)")
    assert st["simd_level"] in st["simd_levels"] and st["simd_levels"][0] == "baseline"


def test_native_0_forces_numpy(monkeypatch):
    monkeypatch.setenv("SDPA_REF_NATIVE", "0")
    assert _native.kernels() is None
    st = _native.status()
    assert not st["in_use"] and st["reason"] == "SDPA_REF_NATIVE=0"


# ------------------------------------------------------------------ info


def _check_info(d):
    assert set(d) == {"version", "python", "numpy", "compiled_kernels", "blas", "num_threads", "dtypes"}
    assert d["version"] == sdpa_ref.__version__
    assert isinstance(d["python"], str) and isinstance(d["numpy"], str)
    k = d["compiled_kernels"]
    assert set(k) == {"in_use", "reason", "cost", "path", "simd_level", "simd_levels", "stale", "compiler", "flags"}
    assert isinstance(k["in_use"], bool)
    if k["in_use"]:
        assert k["reason"] is None and k["cost"] is None and isinstance(k["path"], str)
        assert k["simd_level"] in _native.SIMD_LEVELS and set(k["simd_levels"]) <= set(_native.SIMD_LEVELS)
    else:
        assert isinstance(k["reason"], str) and "slower" in k["cost"]
        assert k["path"] is None and k["simd_level"] is None and k["simd_levels"] == []
    assert isinstance(d["blas"], list)
    for b in d["blas"]:
        assert set(b) == {"internal_api", "version", "num_threads", "architecture", "threading_layer", "filepath"}
        assert isinstance(b["internal_api"], str) and isinstance(b["num_threads"], int)
    assert isinstance(d["num_threads"], int) and d["num_threads"] >= 1
    assert d["dtypes"][:3] == ["float64", "float32", "float16"]
    json.dumps(d)


def test_info_says_what_is_in_use():
    d = sdpa_ref.info()
    _check_info(d)
    assert "info" in sdpa_ref.__all__
    assert d["compiled_kernels"]["in_use"] == (_native.kernels() is not None)


def test_info_without_the_kernels_or_ml_dtypes(monkeypatch):
    """With ``SDPA_REF_NATIVE=0``: not in use, why, and what it costs; without ml_dtypes: only NumPy's floats."""
    monkeypatch.setenv("SDPA_REF_NATIVE", "0")
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)                 # import ml_dtypes raises ImportError
    d = sdpa_ref.info()
    _check_info(d)
    k = d["compiled_kernels"]
    assert not k["in_use"] and k["reason"] == "SDPA_REF_NATIVE=0" and "reproducible" in k["cost"]
    assert d["dtypes"] == ["float64", "float32", "float16"]


def test_info_with_ml_dtypes_lists_the_low_precision_types():
    pytest.importorskip("ml_dtypes")
    assert sdpa_ref.info()["dtypes"] == ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                                         "float8_e5m2"]


def test_the_info_command(capsys, monkeypatch):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["item", "value"]
    for item in ("version", "python", "numpy", "compiled kernels", "BLAS", "threads", "dtypes"):
        assert any(line.startswith(item) for line in out.splitlines()), item
    assert ("in use, SIMD " if _native.kernels() is not None else "not in use: ") in out
    assert main(["info", "--format", "json"]) == 0
    _check_info(json.loads(capsys.readouterr().out))
    monkeypatch.setenv("SDPA_REF_NATIVE", "0")
    assert main(["info", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "item,value" and "compiled kernels,not in use: SDPA_REF_NATIVE=0" in lines
    assert any(line.startswith("without them,") and "slower" in line for line in lines)


# ------------------------------------------------------------------ fork

FORK = r"""
import hashlib, json, os, threading, time
import numpy as np
import sdpa_ref
rng = np.random.default_rng(7)
q, k, v, g = (rng.standard_normal((1, 2, 24, 8)) for _ in range(4))
def digest():
    h = hashlib.sha256()
    for kw in (dict(), dict(precision="reproducible"), dict(method="tiled")):
        out, res = sdpa_ref.sdpa_forward(q, k, v, is_causal=True, **kw)
        gr = sdpa_ref.sdpa_backward(res, g)
        for a in (out, res.lse, gr.query, gr.key, gr.value):
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
os.environ["SDPA_REF_NATIVE"] = "0"          # a first call without the kernels: every lazy import done (a fork
digest()                                     # during another thread's import deadlocks on Python's module lock)
del os.environ["SDPA_REF_NATIVE"]
stop = threading.Event()
def work():
    while not stop.is_set():
        for kw in (dict(), dict(precision="reproducible")):
            out, res = sdpa_ref.sdpa_forward(q, k, v, is_causal=True, **kw)
            sdpa_ref.sdpa_backward(res, g)
worker = threading.Thread(target=work)
worker.start()                               # its first call loads the kernels (the old code compiled them here)
got = []
for i in range(4):
    time.sleep(0.05 if i == 0 else 0.02 * i)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, digest().encode())
        finally:
            os._exit(0)
    os.close(w)
    got.append(os.read(r, 100).decode())
    os.close(r)
    os.waitpid(pid, 0)
stop.set()
worker.join()
want = digest()
assert got == [want] * 4, (got, want)
print(json.dumps({"forks": len(got)}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_while_another_thread_calls_the_package_completes_its_call(tmp_path):
    """Forks while a second thread runs the fast and reproducible paths, from its first call on (when the old
    code was compiling the kernels, under a lock, in an empty cache): each child completes a call of every
    engine and gets the parent's bits. A deadlock fails on the time limit."""
    env = _env(SDPA_REF_CACHE=str(tmp_path / "cache"))            # (empty: the old code would compile)
    proc = subprocess.Popen([sys.executable, "-c", FORK], env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail("a forked child did not finish its call within 60 s (a lock inherited from the fork?)")
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"forks": 4}


# ------------------------------------------------------------------ the build (setup.py)


def _setup_py():
    if not (REPO / "setup.py").exists() or not (REPO / "sdpa_ref" / "exact" / "_kernels.c").exists():
        pytest.skip("not a source checkout: no setup.py to build with")
    pytest.importorskip("setuptools")


def _build(tmp_path, **env):
    lib, tmp = tmp_path / "lib", tmp_path / "tmp"
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(lib), "-t", str(tmp)],
                         cwd=str(REPO), env=dict(os.environ, **env), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = lib / "sdpa_ref" / "exact"
    return out / "_compiled_kernels.so", json.loads((out / "_compiled_kernels.json").read_text()), run.stderr


@pytest.mark.skipif(not POSIX, reason="a POSIX build")
def test_without_a_compiler_the_build_succeeds_records_why_and_warns(tmp_path):
    _setup_py()
    so, rec, err = _build(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert not so.exists()
    assert rec["built"] is False and "no C compiler" in rec["reason"] and "no-such-cc" in rec["reason"]
    assert "WARNING: sdpa_ref's optional compiled kernels were not built" in err and "sdpa-ref info" in err


@pytest.mark.skipif(not POSIX, reason="fake compilers are shell scripts")
def test_a_failing_compiler_fails_the_build_of_the_kernels_not_the_install(tmp_path):
    _setup_py()
    fake = _fake_compilers(tmp_path / "bin", tmp_path / "ran.log")
    so, rec, err = _build(tmp_path, CC=f"{fake / 'cc'} -m64")              # $CC is split like a shell's words
    assert not so.exists() and rec["built"] is False and "failed (exit 1)" in rec["reason"]
    assert "-m64 -O3 -std=c99 -fPIC -shared -ffp-contract=off -fno-fast-math -o" in (tmp_path / "ran.log").read_text()
    assert "WARNING" in err


def test_the_build_gives_the_library_in_use_byte_for_byte(tmp_path):
    """``setup.py build_ext`` with the compiler the install used gives the very file in use (the same flags,
    the same sources: the same bits as the old runtime build)."""
    _setup_py()
    _need_kernels()
    rec = _native.build_record()
    cc = rec["compiler"]
    if os.environ.get("CC", "cc").split() != cc or shutil.which(cc[0]) is None:
        pytest.skip(f"the library was built with {cc}, not the compiler here")
    so, new, _ = _build(tmp_path, CC=" ".join(cc))
    if new["sources_sha256"] != rec["sources_sha256"]:
        pytest.skip("the package in use was built from other C sources than this checkout's")
    assert new["built"] is True and new["flags"] == rec["flags"]
    assert so.read_bytes() == pathlib.Path(_native._LIBRARY).read_bytes()



@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_row_passes_take_a_block_of_columns_in_place(dtype):
    """The fast engine's block-skipping schedule hands the compiled row passes a block of columns of a wider
    array (rows ``ld`` entries apart): the same bits as on a contiguous copy, and nothing outside the block
    touched; :func:`_native.row_stride` says which arrays the passes take."""
    import numpy as np
    lib = _native.kernels()
    if lib is None:
        pytest.skip("no compiled kernels")
    rng = np.random.default_rng(5)
    big = rng.standard_normal((7, 40)).astype(dtype)
    big[:, 10] = -np.inf
    big[2, 8:29] = -np.inf                                  # a fully masked row of the block
    before = big.copy()
    block, copy = big[:, 8:29], np.ascontiguousarray(big[:, 8:29])
    outs = [[np.empty((7, 1), dtype) for _ in range(3)] + [np.empty((7, 1), bool)] for _ in range(2)]
    _native.fast_softmax_rows(lib, block, *outs[0])
    _native.fast_softmax_rows(lib, copy, *outs[1])
    np.testing.assert_array_equal(block, copy)
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(big[:, :8], before[:, :8])
    np.testing.assert_array_equal(big[:, 29:], before[:, 29:])
    d = rng.standard_normal((7, 40)).astype(dtype)
    dcopy = np.ascontiguousarray(d[:, 8:29])
    _native.fast_softmax_vjp_rows(lib, d[:, 8:29], block)
    _native.fast_softmax_vjp_rows(lib, dcopy, copy)
    np.testing.assert_array_equal(d[:, 8:29], dcopy)
    assert _native.row_stride(big) == 40 and _native.row_stride(block) == 40 and _native.row_stride(copy) == 21
    assert _native.row_stride(big.T) is None and _native.row_stride(big[:, ::2]) is None
    assert _native.row_stride(big[:0]) == 40 and _native.row_stride(big[None]) is None
