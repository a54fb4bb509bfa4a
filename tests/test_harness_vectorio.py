"""Golden vectors that cannot be turned against their users (issue 22, items 3 and 4).

``verify`` says VERIFIED only for a set that a fresh ``write_vectors`` would
write byte for byte: every field of the manifest a judge reads is compared
(each key, nested ones included, is changed in turn below), a duplicated key
or a NaN / Infinity literal is refused, and any name, however encoded, is
printed escaped and never raises. ``vectors`` writes each file to a fresh
temporary file (``O_CREAT | O_EXCL | O_NOFOLLOW``) renamed into place, and
refuses a destination entry that is not a regular file, so planted symlinks
and FIFOs neither redirect nor block it.
"""

import csv
import hashlib
import io
import json
import math
import os
import shutil
import stat
import tempfile
import threading
import zipfile

import pytest

from sdpa_ref.cli import main
from sdpa_ref.harness import vectors

pytestmark = pytest.mark.skipif(os.name != "posix", reason="symlinks, FIFOs and byte file names: POSIX")

#: A small custom set whose manifest has every kind of key: case definitions, a case file's name, masks,
#: a bias, ALiBi slopes, lengths, dropout, GQA, and (below float64) the honest errors.
CASES = {"cases": [
    {"name": "everything", "L": 5, "S": 7, "E": 4, "Hq": 2, "Hkv": 1, "batch": [2], "seed": 3, "logit_scale": 2.0,
     "options": {"is_causal": True, "causal_alignment": "bottom_right", "window": [3, 1], "softcap": 8.0,
                 "scale": 0.5},
     "arrays": ["mask", "bias", "alibi", "lengths"]},
    {"name": "plain", "L": 3, "E": 4, "batch_q": [2], "batch_kv": [1],
     "options": {"dropout_p": 0.25, "fully_masked": "nan"}, "arrays": ["dropout", "masked_rows"]},
]}
NAMES = ("everything.npz", "plain.npz", "manifest.json")


def _write_case_file(folder):
    path = os.path.join(folder, "mine.json")
    with open(path, "w") as fh:
        json.dump(CASES, fh)
    return path


def _canonical(manifest) -> bytes:
    """A manifest as ``write_vectors`` lays it out: only the changed value differs from the original's bytes."""
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("ascii")


def _reference_manifest():
    with tempfile.TemporaryDirectory() as d:
        return vectors.write_vectors(os.path.join(d, "v"), dtype="float32", cases=_write_case_file(d))


def _key_paths(value, path=()):
    """Every key and list position of a JSON value, as tuples; a list position is the first that has the rest."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path + (k,)
            yield from _key_paths(v, path + (k,))
    elif isinstance(value, list):
        seen = set()
        for i, v in enumerate(value):
            for p in [path + (i,)] + list(_key_paths(v, path + (i,))):
                general = tuple("*" if isinstance(x, int) else x for x in p)
                if general not in seen:
                    seen.add(general)
                    yield p


#: Every key of the manifest (nested ones included), computed from a real one so that none is left out.
PATHS = sorted(set(_key_paths(_reference_manifest())), key=lambda p: tuple(map(str, p)))


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _ids(p):
    return ".".join(str(x) for x in p) or "(top)"


@pytest.fixture(scope="module")
def vector_set(tmp_path_factory):
    base = tmp_path_factory.mktemp("safety")
    out = base / "v"
    vectors.write_vectors(str(out), dtype="float32", cases=_write_case_file(str(base)))
    assert vectors.verify_vectors(str(out)).ok
    return out


def _copy(vector_set, tmp_path):
    d = tmp_path / "v"
    shutil.copytree(vector_set, d)
    return d


def _manifest(d):
    return json.loads((d / "manifest.json").read_text())


def _verdict(d):
    """"VERIFIED", "NOT VERIFIED", or the one-line manifest error."""
    try:
        rep = vectors.verify_vectors(str(d))
    except vectors.ManifestError as exc:
        assert "\n" not in str(exc)
        return f"error: {exc}"
    return "VERIFIED" if rep.ok else "NOT VERIFIED"


# ------------------------------------------------------------------ every field of the manifest is compared


def _changed(v, path=()):
    """A different value of the same JSON type: the smallest change for a float, but in a case definition (a
    definition that changes less than the vectors' dtype resolves gives the same files: the same set)."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 1.5 + 1 if path[:1] == ("cases",) else math.nextafter(v, math.inf)
    if isinstance(v, str):
        return v + "x"
    if isinstance(v, list):
        return v + [v[-1] if v else 0]
    if isinstance(v, dict):
        return dict(v, extra=1)
    return 0


def _retyped(v):
    """The same value in another JSON type: 3.0 as 3, 3 as 3.0, true as 1, "x" as ["x"]."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return float(v)
    if isinstance(v, float):
        return int(v) if v == int(v) else str(v)
    if isinstance(v, str):
        return [v]
    return None


@pytest.mark.parametrize("path", PATHS, ids=_ids)
@pytest.mark.parametrize("how", ["changed", "retyped", "removed"])
def test_a_set_with_any_field_changed_is_not_verified(vector_set, tmp_path, path, how):
    if path[-1] in ("package_version", "cases_file"):
        pytest.skip("provenance, taken as stored (test_the_exempt_fields_are_exactly_the_provenance)")
    d = _copy(vector_set, tmp_path)
    m = _manifest(d)
    parent, key = _get(m, path[:-1]), path[-1]
    if how == "removed":
        del parent[key]
    else:
        parent[key] = _changed(parent[key], path) if how == "changed" else _retyped(parent[key])
    (d / "manifest.json").write_bytes(_canonical(m))
    assert _verdict(d) != "VERIFIED"


def test_the_parametrization_reaches_nested_keys():
    flat = {_ids(tuple("*" if isinstance(x, int) else x for x in p)) for p in PATHS}
    for want in ("relative_rule.k_out", "relative_rule.k_grad", "tolerance_rule.below float64", "output_dtype",
                 "dtype", "storage", "reference", "files.*.sha256", "files.*.shapes.dbias.*",
                 "files.*.options.enable_gqa", "cases.*.options.window.*", "suite_version", "format_version"):
        assert want in flat, want


@pytest.mark.parametrize("value", ["1e300", "3.0000000000000004", "0.3e1", "NaN", "Infinity", "-Infinity", "1e400",
                                   "3", '"3"', "null"])
def test_k_out_is_compared_and_nan_and_infinity_are_refused(vector_set, tmp_path, value):
    d = _copy(vector_set, tmp_path)
    text = (d / "manifest.json").read_text()
    assert '"k_out": 3.0' in text
    (d / "manifest.json").write_text(text.replace('"k_out": 3.0', f'"k_out": {value}'))
    verdict = _verdict(d)
    assert verdict != "VERIFIED"
    if value in ("NaN", "Infinity", "-Infinity", "1e400"):
        assert verdict.startswith("error:") and "manifest.json" in verdict


def _with_duplicate(manifest, path, value):
    """The canonical text of ``manifest`` with ``path``'s key written twice: first ``value``, then its own."""
    parent, key = _get(manifest, path[:-1]), path[-1]
    parent["\0dup"] = value                             # sorts first, so it comes before the real key
    text = _canonical(manifest).decode()
    assert text.count('"\\u0000dup"') == 1
    return text.replace('"\\u0000dup"', json.dumps(key))


@pytest.mark.parametrize("path", [p for p in PATHS if isinstance(p[-1], str)], ids=_ids)
def test_a_duplicated_key_anywhere_is_refused(vector_set, tmp_path, path):
    d = _copy(vector_set, tmp_path)
    m = _manifest(d)
    (d / "manifest.json").write_text(_with_duplicate(m, path, _changed(_get(m, path))))
    verdict = _verdict(d)
    assert verdict.startswith("error:") and "twice" in verdict, verdict


def test_a_duplicated_dtype_that_a_first_match_reader_takes_is_refused(vector_set, tmp_path, capsys):
    """The issue's case: Python keeps the last "dtype", a reader that takes the first sees float16."""
    d = _copy(vector_set, tmp_path)
    (d / "manifest.json").write_text(_with_duplicate(_manifest(d), ("dtype",), "float16"))
    assert main(["verify", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'dtype'" in err and "Traceback" not in err


def test_the_exempt_fields_are_exactly_the_provenance(vector_set, tmp_path):
    """package_version (who wrote the set) and cases_file (the name of the file the cases came from) are taken as
    stored, if strings; every other field must be what a fresh write gives."""
    d = _copy(vector_set, tmp_path)
    m = _manifest(d)
    m["package_version"], m["cases_file"] = "0.0.1-elsewhere", "theirs.toml"
    (d / "manifest.json").write_bytes(_canonical(m))
    assert _verdict(d) == "VERIFIED"
    for field in ("package_version", "cases_file"):
        bad = dict(m, **{field: 1})
        (d / "manifest.json").write_bytes(_canonical(bad))
        assert _verdict(d) == "NOT VERIFIED", field


@pytest.mark.parametrize("how", ["compact", "reordered files", "a trailing newline less", "non-ASCII escape"])
def test_only_the_bytes_a_fresh_write_gives_verify(vector_set, tmp_path, how):
    d = _copy(vector_set, tmp_path)
    m = _manifest(d)
    raw = _canonical(m)
    if how == "compact":
        raw = json.dumps(m, sort_keys=True).encode()
    elif how == "reordered files":
        m["files"].reverse()
        raw = _canonical(m)
    elif how == "a trailing newline less":
        raw = raw[:-1]
    else:
        raw = raw.replace(b'"float32"', b'"float\\u0033\\u0032"', 1)
    (d / "manifest.json").write_bytes(raw)
    rep = vectors.verify_vectors(str(d))
    assert not rep.ok and any("manifest.json" in p for p in rep.problems), str(rep)


def test_a_changed_field_is_named_in_the_report_and_in_json_and_csv(vector_set, tmp_path, capsys):
    d = _copy(vector_set, tmp_path)
    m = _manifest(d)
    m["relative_rule"]["k_out"] = 1e300
    (d / "manifest.json").write_bytes(_canonical(m))
    for fmt in ("table", "json", "csv"):
        assert main(["verify", str(d), "--format", fmt]) == 1
        out = capsys.readouterr().out
        assert "relative_rule.k_out" in out and "VERIFIED" not in out.replace("NOT VERIFIED", ""), fmt
    rows = list(csv.DictReader(io.StringIO((main(["verify", str(d), "--format", "csv"]), capsys.readouterr().out)[1])))
    assert any(r["ok"] == "False" and "relative_rule.k_out" in r["note"] for r in rows)


# ------------------------------------------------------------------ vectors writes through nothing, blocks on nothing


def _within(seconds, fn, fifos=()):
    """``fn()``'s result or exception; a call still running after ``seconds`` fails the test instead of hanging."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: B036 -- handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for f in fifos:                                 # let a writer blocked on a FIFO go (it then gets EPIPE)
            try:
                os.close(os.open(f, os.O_RDONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(10)
        pytest.fail(f"blocked for more than {seconds} s")
    return box


def _plant(d, outside):
    """Symlinks named like a case file and like manifest.json pointing outside (one of them dangling), a FIFO named
    like a case file: what a hostile user of a shared folder leaves."""
    d.mkdir()
    outside.mkdir()
    (outside / "precious").write_text("precious")
    (outside / "config").write_text("config")
    (d / "everything.npz").symlink_to(outside / "precious")
    (d / "manifest.json").symlink_to(outside / "config")
    (d / "plain.npz").symlink_to(outside / "created")         # dangling: a write would create it


@pytest.mark.parametrize("planted", ["symlinks", "fifo case file", "fifo manifest", "folder", "dangling symlink"])
def test_vectors_into_a_folder_with_planted_entries_writes_nothing_outside_and_never_blocks(tmp_path, planted, capsys):
    d, outside = tmp_path / "v", tmp_path / "outside"
    cases = _write_case_file(str(tmp_path))
    fifos = []
    if planted == "symlinks":
        _plant(d, outside)
    else:
        d.mkdir()
        outside.mkdir()
        target = {"fifo case file": "plain.npz", "fifo manifest": "manifest.json", "folder": "everything.npz",
                  "dangling symlink": "manifest.json"}[planted]
        if planted.startswith("fifo"):
            os.mkfifo(d / target)
            fifos.append(str(d / target))
        elif planted == "folder":
            (d / target).mkdir()
        else:
            (d / target).symlink_to(outside / "created")
    before = sorted(os.listdir(d))
    box = _within(60, lambda: main(["vectors", str(d), "--cases", cases, "--dtype", "float32"]), fifos)
    assert box.get("value") == 2, box
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert any(n in err for n in NAMES), err                     # names the entry it refused
    assert sorted(os.listdir(d)) == before                        # refused before anything was written
    assert sorted(os.listdir(outside)) == (["config", "precious"] if planted == "symlinks" else [])
    if planted == "symlinks":
        assert (outside / "precious").read_text() == "precious" and (outside / "config").read_text() == "config"


def test_the_api_refuses_planted_entries_with_an_oserror_naming_them(tmp_path):
    d, outside = tmp_path / "v", tmp_path / "outside"
    _plant(d, outside)
    with pytest.raises(OSError, match="everything.npz|manifest.json|plain.npz") as info:
        vectors.write_vectors(str(d), dtype="float32", cases=_write_case_file(str(tmp_path)))
    assert "symbolic link" in str(info.value)
    assert (outside / "precious").read_text() == "precious" and not (outside / "created").exists()


def test_vectors_replaces_regular_files_without_writing_through_hard_links(tmp_path):
    """An existing regular file is replaced by a new one (rename), so a hard link to a file outside is not written."""
    d, outside = tmp_path / "v", tmp_path / "outside"
    d.mkdir()
    outside.mkdir()
    (outside / "precious").write_text("precious")
    os.link(outside / "precious", d / "manifest.json")
    (d / "everything.npz").write_bytes(b"stale")
    old_umask = os.umask(0o022)
    try:
        box = _within(60, lambda: vectors.write_vectors(str(d), dtype="float32",
                                                        cases=_write_case_file(str(tmp_path))))
    finally:
        os.umask(old_umask)
    assert "error" not in box, box
    assert (outside / "precious").read_text() == "precious"
    assert sorted(os.listdir(d)) == sorted(NAMES)                 # no temporary file left behind
    for n in NAMES:
        st = os.lstat(d / n)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644 and st.st_nlink == 1, n
    assert vectors.verify_vectors(str(d)).ok


def test_a_symlinked_out_dir_that_the_user_names_is_followed(tmp_path):
    """Following the folder the user named is normal (documented); entries planted inside it are the threat."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    vectors.write_vectors(str(tmp_path / "link"), dtype="float32", cases=_write_case_file(str(tmp_path)))
    assert sorted(os.listdir(real)) == sorted(NAMES)


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    d = tmp_path / "v"
    real_write = os.write

    def failing_write(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        vectors.write_vectors(str(d), dtype="float32", cases=_write_case_file(str(tmp_path)))
    monkeypatch.setattr(os, "write", real_write)
    assert os.listdir(d) == []


# ------------------------------------------------------------------ any name prints escaped, none raises

HOSTILE = ["\ud800.npz", "\udcff.npz", "\x1b[2K\rVERIFIED.npz", "a\nverdict: VERIFIED\n.npz", "x" * 5000 + ".npz",
           "\u202eevil.npz", "\x00.npz", "tab\there.npz", "back\\slash.npz"]


def _printable_lines(text):
    """Every character printable ASCII, lines split only by the output's own newlines."""
    bad = sorted({c for c in text if not (" " <= c <= "~" or c == "\n")})
    assert not bad, f"raw characters in the output: {bad!r}"


def _hostile_set(vector_set, tmp_path):
    d = _copy(vector_set, tmp_path)
    m = _manifest(d)
    m["files"] += [{"file": n, "sha256": "0" * 64} for n in HOSTILE]
    (d / "manifest.json").write_bytes(_canonical(m))
    base = os.fsencode(str(d))
    for n in (b"\xff\xfe.npz", b"\x1b[2K\rVERIFIED.npz", b"b\nverdict: VERIFIED.npz", "\u202e.npz".encode()):
        with open(base + b"/" + n, "wb") as fh:                   # names that are not UTF-8, or not printable
            fh.write(b"")
    # a member of a listed file with a hostile name, the file's hash made consistent
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("\x1b[2K\rVERIFIED\n.npy", b"x")
        zf.writestr("o\u00fft.npy", b"x")
    data = buf.getvalue()
    (d / "plain.npz").write_bytes(data)
    next(e for e in m["files"] if e["file"] == "plain.npz")["sha256"] = hashlib.sha256(data).hexdigest()
    (d / "manifest.json").write_bytes(_canonical(m))
    return d, m


@pytest.mark.parametrize("fmt", ["table", "json", "csv"])
def test_hostile_names_print_escaped_and_never_raise(vector_set, tmp_path, capsys, fmt):
    d, m = _hostile_set(vector_set, tmp_path)
    assert main(["verify", str(d), "--format", fmt]) == 1
    out, err = capsys.readouterr()
    _printable_lines(out)
    assert "Traceback" not in err
    if fmt == "table":
        lines = out.splitlines()
        assert lines[-1] == "verdict: NOT VERIFIED"
        assert not [x for x in lines if x.startswith("verdict: VERIFIED")]
        assert "\\x1b[2K\\x0dVERIFIED.npz" in out and "\\ud800.npz" in out
        assert "\\udcff\\udcfe.npz" in out                       # the bytes 0xff 0xfe, as os.fsdecode gives them
        assert len(lines) == 2 + len(m["files"]) + sum(x.startswith("problem: ") for x in lines) + 3
    elif fmt == "json":
        rows = json.loads(out)
        assert sum(r["file"] != "" for r in rows) == len(m["files"])
        assert all(isinstance(r["file"], str) and all(" " <= c <= "~" for c in r["file"]) for r in rows)
    else:
        rows = list(csv.DictReader(io.StringIO(out)))
        assert sum(r["file"] != "" for r in rows) == len(m["files"])
    assert all(len(x) < 1000 for x in out.splitlines())          # a 5000-character name is cut short


def test_hostile_names_through_the_api(vector_set, tmp_path):
    d, m = _hostile_set(vector_set, tmp_path)
    rep = vectors.verify_vectors(os.fsencode(str(d)))             # a bytes path too
    assert not rep.ok
    _printable_lines(str(rep))
    files = [r["file"] for r in rep.rows]
    assert len(files) == len(m["files"]) and len(set(files)) == len(files)
    note = next(r["note"] for r in rep.rows if r["file"] == "plain.npz")
    assert "\\x1b[2K\\x0dVERIFIED\\x0a" in note or "not a readable .npz" in note


@pytest.mark.parametrize("name", ["v\x1b[2K\rverdict: VERIFIED\nsecond line", "v\udcff", "v\u202e"])
def test_a_hostile_folder_name_is_a_one_line_escaped_error(tmp_path, capsys, name):
    d = os.path.join(str(tmp_path), name)
    os.mkdir(os.fsencode(d))
    assert main(["verify", d]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    _printable_lines(err)


def test_vectors_into_a_folder_with_a_hostile_name_prints_it_escaped(tmp_path, capsys):
    d = os.fsdecode(os.fsencode(str(tmp_path)) + b"/v\xff\x1b[2K\rdone")
    assert main(["vectors", d, "--cases", _write_case_file(str(tmp_path)), "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    _printable_lines(out)
    assert "wrote 2 cases" in out and "\\udcff\\x1b[2K\\x0ddone" in out
    assert main(["verify", d]) == 0
    _printable_lines(capsys.readouterr().out)
