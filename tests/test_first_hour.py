"""A kernel author's first hour: a plain kernel judged with no case written, their own cases from a file, and a
verdict that says what happened ("nothing judged" is neither a pass nor a failure)."""

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import sdpa_ref
from sdpa_ref.cli import main
from sdpa_ref.harness import vectors
from sdpa_ref.harness.casefile import CaseFileError, case_definition, cases_from_definitions, load_cases
from sdpa_ref.harness.cases import get_suite


def plain_forward(query, key, value, is_causal=False, scale=None):
    """The README's kernel: NumPy in, NumPy out, top-left causal."""
    s = (query * (scale or query.shape[-1] ** -0.5)) @ np.swapaxes(key, -1, -2)
    if is_causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ value


CALLS = []


def causal_only(query, key, value):
    """Always causal, no keyword for it: must never be called on a non-causal case."""
    CALLS.append(query.shape)
    return plain_forward(query, key, value, is_causal=True)


causal_only.requires = {"is_causal"}


# ------------------------------------------------------------- judged on the built-in suite


def test_a_plain_causal_kernel_is_judged_on_ten_quick_cases_and_never_called_on_non_causal_ones():
    calls = []

    def spy(query, key, value):
        calls.append(query.shape)
        return plain_forward(query, key, value, is_causal=True)

    spy.requires = {"is_causal"}
    rep = sdpa_ref.check_implementation(spy, dtypes="float32")
    assert rep.ok and rep.verdict == "conforms"
    by_case = {c.name: c for c in get_suite("quick")}
    judged = {r.case for r in rep.rows if r.status != "skip"}
    assert len(judged) >= 10 and len(calls) == 3 * len(judged)     # each case, then its two guarded runs
    assert all(by_case[n].opts.get("is_causal") for n in judged)
    non_causal = [c for c in by_case.values() if not c.opts.get("is_causal")]
    assert rep.skipped["does not use is_causal (required)"] >= sum(not c.option_names for c in non_causal) > 0
    lacking = [r for r in rep.rows if r.note == "does not use is_causal (required)"]
    assert lacking and all(not by_case[r.case].opts.get("is_causal") for r in lacking)


def test_the_readme_kernel_is_judged_on_the_self_attention_cases():
    rep = sdpa_ref.check_implementation(plain_forward, dtypes=("float32", "float16"))
    assert rep.ok
    self_cases = {c.name for c in get_suite("quick") if c.name.startswith("self-")}
    assert self_cases <= {r.case for r in rep.rows if r.status == "pass"}
    assert rep.judged >= 2 * 10


def test_requires_is_checked_and_a_required_option_it_supports_is_passed():
    with pytest.raises(ValueError, match="`requires`.*causal"):
        sdpa_ref.check_implementation(plain_forward, requires={"causal"})
    with pytest.raises(TypeError, match="`requires`"):
        sdpa_ref.check_implementation(plain_forward, requires=3)
    seen = []

    def fwd(query, key, value, is_causal=False):
        seen.append(is_causal)
        return plain_forward(query, key, value, is_causal=is_causal)

    rep = sdpa_ref.check_implementation(fwd, requires="is_causal", dtypes="float64", rule="fixed")
    assert rep.ok and seen and all(seen)


def test_a_wrong_causal_only_kernel_fails():
    def anti(query, key, value):                        # causal the wrong way round
        s = query @ np.swapaxes(key, -1, -2) / np.sqrt(query.shape[-1])
        s = np.where(np.triu(np.ones(s.shape[-2:], bool)), s, -np.inf)
        with np.errstate(invalid="ignore"):                  # rows with no key (L > S) become NaN
            p = np.exp(s - s.max(-1, keepdims=True))
        return ((p / p.sum(-1, keepdims=True)) @ value).astype(query.dtype)

    anti.requires = {"is_causal"}
    rep = sdpa_ref.check_implementation(anti, dtypes="float32")
    assert not rep.ok and rep.verdict == "does not conform"


# ------------------------------------------------------------- nothing judged


def test_nothing_judged_is_its_own_verdict_never_a_pass(capsys):
    def needs_everything(query, key, value):
        raise AssertionError("never called")

    needs_everything.requires = {"softcap", "dropout_mask"}           # no quick case uses both
    rep = sdpa_ref.check_implementation(needs_everything, dtypes="float32")
    assert rep.verdict == "nothing judged" and not rep.ok and rep.judged == 0
    assert rep.skipped["(all)"] == len(get_suite("quick"))
    text = str(rep)
    assert "NOTHING JUDGED" in text and "CONFORMS" not in text.replace("NOTHING JUDGED", "")
    assert json.loads(rep.to_json())["verdict"] == "nothing judged"
    with pytest.raises(AssertionError, match="nothing was judged"):
        sdpa_ref.assert_conforms(needs_everything, dtypes="float32")
    assert main(["conform", "tests.test_first_hour:causal_only", "--requires", "softcap", "dropout_mask"]) == 3
    assert "NOTHING JUDGED" in capsys.readouterr().out


def test_conform_exit_statuses(capsys):
    assert main(["conform", "tests.test_first_hour:causal_only"]) == 0
    assert main(["conform", "tests.test_first_hour:causal_only", "--requires", "nonsense"]) == 2
    assert "`requires`" in capsys.readouterr().err


# ------------------------------------------------------------- case files

CASES = {"cases": [
    {"name": "causal-64", "L": 24, "E": 64, "Hq": 2, "batch": [2], "options": {"is_causal": True}},
    {"name": "gqa-window", "L": 9, "S": 13, "E": 16, "Hq": 4, "Hkv": 2, "seed": 3,
     "options": {"window": [4, 0], "causal_alignment": "bottom_right"}, "arrays": ["lengths"]},
    {"name": "plain-odd", "L": 5, "S": 7, "E": 3, "Ev": 5, "batch": [], "logit_scale": 4.0},
]}

TOML = """
[[cases]]
name = "causal-64"
L = 24
E = 64
Hq = 2
batch = [2]
options = { is_causal = true }

[[cases]]
name = "gqa-window"
L = 9
S = 13
E = 16
Hq = 4
Hkv = 2
seed = 3
arrays = ["lengths"]
[cases.options]
window = [4, 0]
causal_alignment = "bottom_right"

[[cases]]
name = "plain-odd"
L = 5
S = 7
E = 3
Ev = 5
batch = []
logit_scale = 4.0
"""


@pytest.fixture
def case_file(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(CASES))
    return p


def test_a_case_file_gives_the_cases_it_defines_in_json_and_toml(case_file, tmp_path):
    cases = load_cases(case_file)
    assert [c.name for c in cases] == ["causal-64", "gqa-window", "plain-odd"]
    c0, c1, c2 = cases
    assert (c0.L, c0.S, c0.E, c0.Ev, c0.Hq, c0.Hkv, c0.batch_q) == (24, 24, 64, 64, 2, 2, (2,))
    assert c0.option_names == {"is_causal"}
    assert c1.option_names == {"window", "causal_alignment", "enable_gqa", "q_lengths", "kv_lengths"}
    assert c2.batch_q == () and c2.logit_scale == 4.0 and c2.Ev == 5
    assert cases_from_definitions([case_definition(c) for c in cases]) == cases     # a definition round-trips
    if sys.version_info >= (3, 11):
        t = tmp_path / "mine.toml"
        t.write_text(TOML)
        assert load_cases(t) == cases


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("name"), "'name'"),
    (lambda d: d.update(name="../x"), "'name'"),
    (lambda d: d.update(L=0), "'L'"),
    (lambda d: d.update(L=True), "'L'"),
    (lambda d: d.update(Hq=3, Hkv=2), "'Hq'"),
    (lambda d: d.update(batch=[2, 0]), "'batch'"),
    (lambda d: (d.pop("batch"), d.update(batch_q=[2], batch_kv=[3])), "broadcast"),
    (lambda d: d.update(L=1 << 20, S=1 << 20), "entries"),
    (lambda d: d.update(options={"is_casual": True}), "is_casual"),
    (lambda d: d.update(options={"attn_mask": True}), "'arrays'"),
    (lambda d: d.update(options={"softcap": -1.0}), "softcap"),
    (lambda d: d.update(options={"window": [1, 2, 3]}), "window"),
    (lambda d: d.update(arrays=["mask", "mask"]), "'arrays'"),
    (lambda d: d.update(arrays=["masks"]), "masks"),
    (lambda d: d.update(options={"dropout_p": 0.2}), "keep mask"),
    (lambda d: d.update(logit_scale=float("nan")), "logit_scale"),
    (lambda d: d.update(colour="red"), "colour"),
])
def test_a_bad_case_file_is_one_clear_error_naming_the_case_and_field(tmp_path, edit, field):
    d = dict(CASES["cases"][0])
    edit(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"cases": [d]}))
    with pytest.raises(CaseFileError, match=field) as info:
        load_cases(p)
    assert "bad.json" in str(info.value) and "case 0" in str(info.value) and "\n" not in str(info.value)


def test_a_case_file_that_is_not_a_file_or_not_a_list_is_refused(tmp_path):
    for text in ("", "[]", '{"cases": []}', '{"cases": {}}', '{"case": []}', "{\"cases\": [1]}"):
        p = tmp_path / "x.json"
        p.write_text(text)
        with pytest.raises(CaseFileError):
            load_cases(p)
    dup = {"cases": [CASES["cases"][0], CASES["cases"][0]]}
    (tmp_path / "dup.json").write_text(json.dumps(dup))
    with pytest.raises(CaseFileError, match="twice"):
        load_cases(tmp_path / "dup.json")
    with pytest.raises(CaseFileError, match="not a regular file"):
        load_cases(tmp_path)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo.json")
        with pytest.raises(CaseFileError, match="not a regular file"):      # and it does not block
            load_cases(tmp_path / "fifo.json")


def test_check_implementation_and_conform_take_a_case_file(case_file, capsys):
    rep = sdpa_ref.check_implementation(plain_forward, cases=str(case_file), dtypes="float32")
    assert rep.suite == "custom" and rep.meta["cases_file"] == "mine.json"
    judged = {r.case for r in rep.rows if r.status != "skip"}
    assert judged == {"causal-64", "plain-odd"} and rep.ok
    assert main(["conform", "tests.test_first_hour:causal_only", "--cases", str(case_file), "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["verdict"] == "conforms" and got["judged"] == 1 and got["suite"] == "custom"
    assert main(["conform", "tests.test_first_hour:causal_only", "--cases", str(case_file) + ".missing"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cases" in err


def test_vectors_from_a_case_file_verify_from_their_manifest_alone(case_file, tmp_path, capsys):
    out = tmp_path / "v"
    assert main(["vectors", str(out), "--cases", str(case_file), "--dtype", "float32"]) == 0
    case_file.unlink()                                       # verify needs only the set: its manifest holds the cases
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["suite"] == "custom" and manifest["cases_file"] == "mine.json"
    assert [c["name"] for c in manifest["cases"]] == ["causal-64", "gqa-window", "plain-odd"]
    assert main(["verify", str(out)]) == 0
    assert "VERIFIED" in capsys.readouterr().out
    # a changed definition no longer matches the stored files
    manifest["cases"][0]["seed"] = 1
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(out)]) == 1
    # a hostile definition is a one-line manifest error, not a computation
    manifest["cases"][0]["L"] = 1 << 30
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "entries" in err


def test_vectors_refuse_a_bad_case_file_before_writing(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"cases": [{"name": "x"}]}')
    assert main(["vectors", str(tmp_path / "v"), "--cases", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'L' is required" in err and not (tmp_path / "v").exists()


# ------------------------------------------------------------- verify cannot be made to block


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_verify_never_blocks_when_a_file_becomes_a_fifo_between_check_and_open(tmp_path, monkeypatch):
    """The worst moment of the race: the member is swapped for a FIFO right before it is opened."""
    d = tmp_path / "v"
    vectors.write_vectors(str(d), cases=[get_suite("quick")[0]])
    real_open = os.open
    member = str(d / f"{get_suite('quick')[0].name}.npz")

    def racing_open(path, flags, *a, **kw):
        if os.fspath(path) == member and os.path.isfile(member):
            os.remove(member)
            os.mkfifo(member)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", racing_open)
    result = {}
    t = threading.Thread(target=lambda: result.update(rep=vectors.verify_vectors(str(d))), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "verify blocked on a FIFO"
    rep = result["rep"]
    assert not rep.ok and "not a regular file" in rep.rows[0]["note"]


# ------------------------------------------------------------- small things a user hit


def test_a_failing_backward_is_reported_under_its_own_name(capsys):
    assert main(["conform", "tests.test_first_hour:causal_only", "--backward", "tests.test_first_hour:nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--backward" in err and "tests.test_first_hour:nope" in err
    assert "implementation 'tests.test_first_hour:causal_only'" not in err


@pytest.mark.parametrize("flag", ["--d-k", "--n-keys", "--trials", "--n-queries"])
def test_diagnose_sizes_are_checked_under_the_flag_name(flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(["diagnose", flag, "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "d_ks" not in err and "Traceback" not in err


# ------------------------------------------------------------- a C kernel through ctypes

C_KERNEL = r"""
#include <math.h>
/* llm.c-style causal self-attention: q, k, v, out are (B, H, T, E), row-major doubles */
void attention_forward(double *out, const double *q, const double *k, const double *v,
                       int B, int H, int T, int E, double *att)
{
    double scale = 1.0 / sqrt((double)E);
    for (int b = 0; b < B; b++) for (int h = 0; h < H; h++) for (int t = 0; t < T; t++) {
        const double *qt = q + (((long)b * H + h) * T + t) * E;
        double *row = att + t * (long)T, m = -INFINITY, sum = 0.0;
        for (int s = 0; s <= t; s++) {
            const double *ks = k + (((long)b * H + h) * T + s) * E;
            double d = 0.0;
            for (int e = 0; e < E; e++) d += qt[e] * ks[e];
            row[s] = d * scale;
            if (row[s] > m) m = row[s];
        }
        for (int s = 0; s <= t; s++) { row[s] = exp(row[s] - m); sum += row[s]; }
        double *o = out + (((long)b * H + h) * T + t) * E;
        for (int e = 0; e < E; e++) o[e] = 0.0;
        for (int s = 0; s <= t; s++) {
            const double *vs = v + (((long)b * H + h) * T + s) * E;
            for (int e = 0; e < E; e++) o[e] += row[s] / sum * vs[e];
        }
    }
}
"""


@pytest.fixture(scope="module")
def c_kernel(tmp_path_factory):
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("ckernel")
    (d / "attn.c").write_text(C_KERNEL)
    lib = d / "attn.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(d / "attn.c"), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def test_a_c_causal_kernel_through_ctypes_is_judged_on_ten_quick_cases(c_kernel):
    fn = c_kernel.attention_forward
    fn.restype = None
    ptr = ctypes.POINTER(ctypes.c_double)

    def forward(query, key, value):
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError("self-attention with Ev = E only")
        dt = query.dtype
        q, k, v = (np.ascontiguousarray(x, dtype=np.float64) for x in (query, key, value))
        *batch, H, T, E = q.shape
        B = int(np.prod(batch, dtype=np.int64))
        out = np.empty_like(q)
        att = np.empty(T * T)
        fn(out.ctypes.data_as(ptr), q.ctypes.data_as(ptr), k.ctypes.data_as(ptr), v.ctypes.data_as(ptr),
           B, H, T, E, att.ctypes.data_as(ptr))
        return out.astype(dt)

    forward.requires = {"is_causal"}
    rep = sdpa_ref.check_implementation(forward, dtypes=("float64", "float32"), rule=None)
    judged = {r.case for r in rep.rows if r.status != "skip"}
    assert rep.ok, str(rep)
    assert len(judged) >= 10
    assert all(c.opts.get("is_causal") for c in get_suite("quick") if c.name in judged)
