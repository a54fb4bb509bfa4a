"""Nothing a user does makes it lie (issue 12): no aliasing, clear errors for bad input, memory that is never
read, checkers that cannot be fooled, a CLI without tracebacks, and a ``verify`` you can point at anything."""

import os

import numpy as np
import pytest

import sdpa_ref
from tolerances import F64_FEW_ULP, F64_SUMS

HOWS = ["fast", "plain", "tiled", "reproducible"]


def _forward(how, q, k, v, **kw):
    if how == "reproducible":
        return sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **kw)
    return sdpa_ref.sdpa_forward(q, k, v, method=how, **kw)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((2, 2, 5, 3)) for _ in range(4))
    bias = rng.standard_normal((5, 5))
    mask = rng.random((5, 5)) < 0.8
    mask[:, 0] = True
    return q, k, v, g, bias, mask


@pytest.mark.parametrize("how", HOWS)
def test_writing_into_the_returned_output_changes_no_gradient(how):
    q, k, v, g, bias, _ = _inputs()
    out, res = _forward(how, q, k, v, bias=bias)
    before = sdpa_ref.sdpa_backward(res, g)
    out *= 2                                                        # the caller's own array
    after = sdpa_ref.sdpa_backward(res, g)
    for a, b in zip(before, after):
        if a is not None:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("how", HOWS)
def test_writing_into_the_inputs_after_the_forward_changes_no_gradient(how):
    q, k, v, g, bias, mask = _inputs(1)
    out, res = _forward(how, q, k, v, bias=bias, attn_mask=mask)
    before = sdpa_ref.sdpa_backward(res, g)
    q += 1
    k *= -1
    v[...] = 0
    bias += 5
    mask[...] = False
    after = sdpa_ref.sdpa_backward(res, g)
    for a, b in zip(before, after):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_the_residuals_are_read_only():
    """What the backward reads is frozen; ``res.out`` and ``res.lse`` are results, the caller's own copies
    (issue 40, item 9: tests/test_peers.py checks every entry point)."""
    q, k, v, g, bias, _ = _inputs(2)
    out, res = sdpa_ref.sdpa_forward(q, k, v, bias=bias)
    for arr in (res.probs, res.forward.out, res.forward.lse):
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = 0
    for name in ("out", "lse"):
        arr = getattr(res, name)
        assert arr.flags.writeable and not np.shares_memory(arr, getattr(res.forward, name)), name
    assert not np.shares_memory(out, res.out)
    assert not np.shares_memory(q, res.problem.q)


# ------------------------------------------------------------ validation gaps (issue 12, part 7)


def _q():
    return np.ones((1, 2, 3))


@pytest.mark.parametrize("call, exc, words", [
    (lambda: sdpa_ref.sdpa_forward(_q(), _q(), _q(), window=(2**63, 0)), ValueError, "`window`"),
    (lambda: sdpa_ref.sdpa_forward(_q(), _q(), _q(), dropout_p=0.5, rng=-1), ValueError, "`rng`"),
    (lambda: sdpa_ref.alibi_bias([None], 2, 3), TypeError, "`slopes`"),
    (lambda: sdpa_ref.alibi_bias([np.nan], 2, 3), ValueError, "`slopes`"),
    (lambda: sdpa_ref.logsumexp(np.ones(3), keepdims="no"), TypeError, "`keepdims`"),
    (lambda: sdpa_ref.sdpa_forward(np.ma.masked_array(_q(), mask=_q() > 0), _q(), _q()), TypeError, "`query`"),
    (lambda: sdpa_ref.sdpa_forward(_q(), _q(), _q(), attn_mask=np.ma.masked_array(np.ones((2, 2)))), TypeError,
     "`attn_mask`"),
    (lambda: sdpa_ref.sdpa_forward([[1.0, 2.0], [3.0]], _q(), _q()), TypeError, "`query`"),
])
def test_bad_input_is_a_clear_error_naming_the_argument(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_alibi_bias_still_takes_int_slopes():
    np.testing.assert_array_equal(sdpa_ref.alibi_bias([1, 2], 2, 3), sdpa_ref.alibi_bias([1.0, 2.0], 2, 3))


def test_a_bad_suite_is_refused_before_the_folder_is_made(tmp_path):
    from sdpa_ref.harness.vectors import write_vectors
    target = tmp_path / "never"
    with pytest.raises(ValueError, match="`suite`"):
        write_vectors(str(target), suite="bogus")
    assert not target.exists()


@pytest.mark.parametrize("how", ["fast", "tiled", "reproducible"])
def test_the_smallest_softcap_warns_nothing(how, recwarn):
    q = _q()
    _, res = _forward(how, q, q, q, softcap=5e-324)
    sdpa_ref.sdpa_backward(res, q)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


# ------------------------------------------------------------ checkers that cannot be fooled (part 4)


def _diagonal_softmax_vjp(x, g):
    """The classic wrong softmax VJP: only the diagonal y (1 - y) of the Jacobian."""
    y = sdpa_ref.softmax(x)
    return g * y * (1 - y)


@pytest.mark.parametrize("kw, words", [
    (dict(mode="projection", n_projections=0), "n_projections"),
    (dict(mode="projection", n_projections=-3), "n_projections"),
    (dict(rtol=float("nan")), "`rtol`"),
    (dict(atol=float("nan")), "`atol`"),
    (dict(rtol=-1.0), "`rtol`"),
    (dict(atol=float("inf")), "`atol`"),
])
@pytest.mark.parametrize("check", ["vjp", "jvp"])
def test_a_checker_refuses_settings_that_would_pass_wrong_code(kw, words, check):
    x = np.random.default_rng(0).standard_normal((2, 5))
    if check == "vjp":
        call = lambda: sdpa_ref.check_vjp(sdpa_ref.softmax, _diagonal_softmax_vjp, (x,), **kw)  # noqa: E731
    else:
        call = lambda: sdpa_ref.check_jvp(sdpa_ref.softmax, _diagonal_softmax_vjp, (x,), **kw)  # noqa: E731
    with pytest.raises(ValueError, match=words):
        call()
    # and with honest settings the wrong VJP is caught
    assert not sdpa_ref.check_vjp(sdpa_ref.softmax, _diagonal_softmax_vjp, (x,)).ok


@pytest.mark.parametrize("make", [
    lambda R: R.FixedRule(rtol=-1, atol=0), lambda R: R.FixedRule(rtol=0, atol=float("nan")),
    lambda R: R.ULPRule(-4), lambda R: R.ULPRule(float("nan")), lambda R: R.RelativeRule(k_out=-2),
])
def test_conformance_rules_refuse_negative_and_nan_tolerances(make):
    from sdpa_ref.harness import conformance
    with pytest.raises(ValueError, match="should be a finite number >= 0"):
        make(conformance)


@pytest.mark.parametrize("argv", [["check", "--rtol", "nan", "--atol", "nan"], ["check", "--atol", "-1"],
                                  ["check", "--complex-rtol", "inf"],
                                  ["conform", "x.py", "--rule", "ulp", "--max-ulps", "-3"]])
def test_the_cli_refuses_bad_tolerances_with_a_one_line_error(argv, capsys):
    from sdpa_ref.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "should be a finite number >= 0" in err and "Traceback" not in err


# ------------------------------------------------------------ rows whose result is a constant (part 3, in part)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_a_fully_masked_row_under_the_zero_policy_reads_no_value(how, poison, recwarn):
    rng = np.random.default_rng(4)
    q, k, v, g = (rng.standard_normal((1, 2, 4, 3)) for _ in range(4))
    mask = np.ones((4, 4), bool)
    mask[1, :] = False                                              # row 1 sees no key
    clean_out, clean_res = _forward(how, q, k, v, attn_mask=mask)
    clean = sdpa_ref.sdpa_backward(clean_res, g)
    v2 = v.copy()
    v2[0, 0, 2, 1] = poison                                         # a value other rows do read
    out, res = _forward(how, q, k, v2, attn_mask=mask)
    grads = sdpa_ref.sdpa_backward(res, g)
    np.testing.assert_array_equal(out[:, :, 1], 0.0)
    np.testing.assert_array_equal(out[:, :, 1], clean_out[:, :, 1])
    np.testing.assert_array_equal(grads.query[:, :, 1], clean.query[:, :, 1])
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]   # the poison is never multiplied


@pytest.mark.parametrize("how", HOWS)
def test_grad_out_at_padded_rows_is_never_read(how):
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((2, 2, 5, 3)) for _ in range(4))
    lengths = np.array([5, 3])
    _, res = _forward(how, q, k, v, q_lengths=lengths)
    clean = sdpa_ref.sdpa_backward(res, g)
    g2 = g.copy()
    g2[1, :, 3:] = np.nan                                           # past q_lengths[1]
    for a, b in zip(sdpa_ref.sdpa_backward(res, g2), clean):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_a_complex_result_is_a_failure_not_its_real_part():
    from sdpa_ref.harness.cases import get_suite
    from sdpa_ref.harness.conformance import check_implementation

    def plus_imaginary(q, k, v, **o):
        out = sdpa_ref.sdpa_forward(q, k, v, **o)[0]
        return out + 1e6j

    case = [c for c in get_suite("quick") if c.name == "plain-L8-S8"]
    rep = check_implementation(plus_imaginary, dtypes=("float64",), cases=case)
    assert not rep.ok
    row = next(r for r in rep.rows if r.quantity == "out")
    assert row.status == "FAIL" and "complex" in row.note


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("policy", ["zero", "nan"])
def test_memory_past_the_lengths_is_never_read(how, policy, recwarn):
    rng = np.random.default_rng(6)
    q, k, v, g = (rng.standard_normal((2, 2, 5, 3)) for _ in range(4))
    kw = dict(q_lengths=np.array([5, 3]), kv_lengths=np.array([5, 2]), fully_masked=policy)
    out0, res0 = _forward(how, q, k, v, **kw)
    clean = sdpa_ref.sdpa_backward(res0, g)
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    q2[1, :, 3:] = np.nan                                           # query rows past q_len
    k2[1, :, 2:] = np.nan                                           # keys past kv_len
    v2[1, :, 2:] = np.inf                                           # values past kv_len
    out1, res1 = _forward(how, q2, k2, v2, **kw)
    np.testing.assert_array_equal(out1, out0)                       # the same bits as with clean memory
    np.testing.assert_array_equal(res1.lse, res0.lse)
    for a, b in zip(sdpa_ref.sdpa_backward(res1, g), clean):
        if a is not None:
            np.testing.assert_array_equal(a, b)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_under_the_uniform_policy_an_empty_row_averages_every_value_by_definition():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 1, 3, 2)) for _ in range(3))
    out = sdpa_ref.scaled_dot_product_attention(q, k, v, kv_lengths=[0], fully_masked="uniform")
    np.testing.assert_allclose(out[0, 0], np.broadcast_to(v[0, 0].mean(axis=0), (3, 2)), rtol=F64_FEW_ULP)


def test_an_implementation_that_exits_is_a_failed_case_and_the_run_goes_on():
    from sdpa_ref.harness.cases import get_suite
    from sdpa_ref.harness.conformance import check_implementation

    def exits(q, k, v, **o):
        raise SystemExit(0)

    cases = get_suite("quick")[:2]
    rep = check_implementation(exits, dtypes=("float64",), cases=cases)
    assert not rep.ok
    assert [r.status for r in rep.rows] == ["error", "error"]
    assert all("SystemExit" in r.note for r in rep.rows)


def _spins(q, k, v, **o):
    while True:
        pass


def _sleeps(q, k, v, **o):
    import time
    time.sleep(600)


def _swallows(q, k, v, **o):                                        # catches Exception: the limit is no Exception
    try:
        while True:
            pass
    except Exception:
        return q


@pytest.mark.parametrize("impl", [_spins, _sleeps, _swallows])
@pytest.mark.parametrize("thread", [False, True])
def test_a_case_that_runs_past_the_timeout_is_a_failed_case_and_the_run_goes_on(impl, thread):
    import threading
    import time

    from sdpa_ref.harness.cases import get_suite
    from sdpa_ref.harness.conformance import check_implementation

    cases = get_suite("quick")[:2]
    got = {}

    def run():
        t0 = time.monotonic()
        got["rep"] = check_implementation(impl, dtypes=("float64",), cases=cases, timeout=0.2)
        got["seconds"] = time.monotonic() - t0

    if thread:                                                      # off the main thread: no SIGALRM there
        if impl is _sleeps:
            pytest.skip("a sleep in another thread cannot be interrupted (documented); it still fails when late")
        t = threading.Thread(target=run)
        t.start()
        t.join(30)
        assert not t.is_alive()
    else:
        run()
    rep = got["rep"]
    assert [r.status for r in rep.rows] == ["error", "error"]
    assert all("ran past the time limit of 0.2 s" in r.note for r in rep.rows)
    assert got["seconds"] < 5


def test_a_late_result_fails_even_when_it_could_not_be_interrupted():
    import time

    from sdpa_ref.harness.cases import get_suite
    from sdpa_ref.harness.conformance import check_implementation

    def late(q, k, v, **o):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.3:
            try:
                time.sleep(0.01)
            except BaseException:                                   # swallows the interruption, then returns late
                pass
        return sdpa_ref.scaled_dot_product_attention(q, k, v, **o)

    rep = check_implementation(late, dtypes=("float64",), cases=get_suite("quick")[:1], timeout=0.1)
    assert [r.status for r in rep.rows] == ["error"] and "time limit" in rep.rows[0].note
    ok = check_implementation(sdpa_ref.scaled_dot_product_attention, dtypes=("float64",),
                              cases=get_suite("quick")[:1], timeout=60)
    assert ok.ok


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(timeout):
    from sdpa_ref.harness.conformance import check_implementation
    with pytest.raises(ValueError, match="timeout"):
        check_implementation(sdpa_ref.scaled_dot_product_attention, timeout=timeout)


def test_conform_timeout_on_the_command_line(tmp_path, monkeypatch, capsys):
    from sdpa_ref.cli import main
    (tmp_path / "hangs.py").write_text("def f(q, k, v, **o):\n    while True:\n        pass\nf.supports = ()\n")
    monkeypatch.chdir(tmp_path)
    code = main(["conform", "hangs:f", "--timeout", "0.05", "--dtype", "float64"])
    out = capsys.readouterr().out
    assert code == 1 and "ran past the time limit of 0.05 s" in out
    for bad in ("0", "nan", "-2", "soon"):
        with pytest.raises(SystemExit) as e:
            main(["conform", "hangs:f", "--timeout", bad])
        assert e.value.code == 2
        assert "--timeout" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (lambda d: ["vectors", str(d / "afile")], "OUT_DIR should be a folder"),
    (lambda d: ["vectors", ""], "OUT_DIR should be a folder path"),
    (lambda d: ["vectors", str(d / "afile" / "sub")], "cannot write into OUT_DIR"),
    (lambda d: ["diagnose", "--d-k", "4", "--plot", str(d / "no" / "such" / "p.png")], "--plot"),
    (lambda d: ["saturation", "--seed", "-1"], "--seed"),
    (lambda d: ["conform", "raising_module:f"], "RuntimeError: boom"),
    (lambda d: ["conform", "broken_module:f"], "SyntaxError"),
    (lambda d: ["conform", "exiting_module:f"], "SystemExit(0)"),
])
def test_user_mistakes_on_the_command_line_are_one_line_errors(tmp_path, monkeypatch, capsys, argv, words):
    from sdpa_ref.cli import main
    (tmp_path / "afile").write_text("x")
    (tmp_path / "raising_module.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "broken_module.py").write_text("def f(:\n")
    (tmp_path / "exiting_module.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv(tmp_path))
    except SystemExit as e:                                         # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and "Traceback" not in err


# ------------------------------------------------------------ a verify you can point at anything (part 5)


@pytest.fixture(scope="module")
def vector_set(tmp_path_factory):
    from sdpa_ref.harness.vectors import write_vectors
    d = tmp_path_factory.mktemp("vectors")
    write_vectors(str(d), "quick", "float32")
    return d


def _copy_set(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def _manifest(d):
    import json
    return json.loads((d / "manifest.json").read_text())


def _write_manifest(d, m):
    import json
    (d / "manifest.json").write_text(json.dumps(m))


def _rehash(d, entry):
    import hashlib
    entry["sha256"] = hashlib.sha256((d / entry["file"]).read_bytes()).hexdigest()


def test_verify_reads_nothing_outside_its_folder(vector_set, tmp_path):
    from sdpa_ref.harness.vectors import verify_vectors
    d = _copy_set(vector_set, tmp_path / "v")
    outside = tmp_path / "outside.npz"
    outside.write_bytes((d / "plain-L8-S8.npz").read_bytes())
    m = _manifest(d)
    m["files"][0]["file"] = "../outside.npz"
    m["files"][1]["file"] = str(outside)                            # an absolute path
    (d / "link.npz").symlink_to(outside)
    m["files"][2]["file"] = "link.npz"
    os.mkfifo(d / "fifo.npz")
    m["files"][3]["file"] = "fifo.npz"
    m["files"][4]["file"] = "/dev/zero"                             # 6 GiB of reads on the old main
    (d / "zero.npz").symlink_to("/dev/zero")
    m["files"][5]["file"] = "zero.npz"
    (d / "dir.npz").mkdir()
    m["files"][6]["file"] = "dir.npz"
    device = False
    try:                                                            # a device node inside the folder (needs root)
        import stat
        os.mknod(d / "dev.npz", 0o600 | stat.S_IFCHR, os.makedev(1, 5))
        m["files"][7]["file"] = "dev.npz"
        device = True
    except (PermissionError, AttributeError, OSError):
        pass
    _write_manifest(d, m)
    rep = verify_vectors(str(d))
    assert not rep.ok
    notes = {r["file"]: r.get("note", "") for r in rep.rows}
    assert "not read" in notes["../outside.npz"] and "not read" in notes[str(outside)]
    assert "not read" in notes["/dev/zero"] and "symbolic link" in notes["zero.npz"]
    assert "symbolic link" in notes["link.npz"] and "not a regular file" in notes["fifo.npz"]
    assert "not a regular file" in notes["dir.npz"]
    if device:
        assert "not a regular file" in notes["dev.npz"]


def test_verify_refuses_tampered_sets(vector_set, tmp_path):
    from sdpa_ref.harness import vectors
    from sdpa_ref.harness.cases import get_suite
    import numpy as np_
    # inputs replaced and every output recomputed from them, hashes made consistent
    d = _copy_set(vector_set, tmp_path / "a")
    m = _manifest(d)
    e = next(x for x in m["files"] if x["file"] == "plain-L8-S8.npz")
    arrays = vectors.read_npz((d / e["file"]).read_bytes())
    arrays["query"] = (arrays["query"] * 2).astype(arrays["query"].dtype)
    import json
    opts = json.loads(bytes(arrays["options_json"]).decode())
    arrays.update(vectors.expected(arrays, opts, np_.dtype("float32"), grad_out=arrays["grad_out"]))
    (d / e["file"]).write_bytes(vectors._npz_bytes(arrays))
    _rehash(d, e)
    _write_manifest(d, m)
    rep = vectors.verify_vectors(str(d))
    assert not rep.ok and "query" in next(r for r in rep.rows if r["file"] == e["file"])["note"]
    # all cases but one deleted
    d = _copy_set(vector_set, tmp_path / "b")
    m = _manifest(d)
    m["files"] = m["files"][:1]
    _write_manifest(d, m)
    for f in os.listdir(d):
        if f.endswith(".npz") and f != m["files"][0]["file"]:
            os.remove(d / f)
    rep = vectors.verify_vectors(str(d))
    assert not rep.ok and sum("missing from the manifest" in p for p in rep.problems) == len(get_suite("quick")) - 1
    # an extra option written into a case, its outputs recomputed with it, hashes made consistent
    d = _copy_set(vector_set, tmp_path / "e")
    m = _manifest(d)
    e = next(x for x in m["files"] if x["file"] == "plain-L8-S8.npz")
    arrays = vectors.read_npz((d / e["file"]).read_bytes())
    opts = dict(json.loads(bytes(arrays["options_json"]).decode()), is_causal=True)
    arrays["options_json"] = np_.frombuffer(json.dumps(opts, sort_keys=True).encode(), dtype=np_.uint8)
    arrays.update(vectors.expected(arrays, opts, np_.dtype("float32"), grad_out=arrays["grad_out"]))
    (d / e["file"]).write_bytes(vectors._npz_bytes(arrays))
    _rehash(d, e)
    _write_manifest(d, m)
    rep = vectors.verify_vectors(str(d))
    assert not rep.ok and not next(r for r in rep.rows if r["file"] == e["file"])["ok"]
    # a duplicated entry
    d = _copy_set(vector_set, tmp_path / "c")
    m = _manifest(d)
    m["files"].append(dict(m["files"][0]))
    _write_manifest(d, m)
    rep = vectors.verify_vectors(str(d))
    assert not rep.ok and any("listed twice" in r.get("note", "") for r in rep.rows)


@pytest.mark.parametrize("text", ["", "[]", "{}", '{"suite": "quick"}', "[" * 200000 + "]" * 200000,
                                  '{"suite": "quick", "dtype": "float32", "suite_version": "1", '
                                  '"format_version": "1", "files": [{"file": 3}]}'])
def test_a_malformed_manifest_is_a_one_line_error_with_exit_2(tmp_path, capsys, text):
    from sdpa_ref.cli import main
    (tmp_path / "manifest.json").write_text(text)
    assert main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "manifest.json" in err and "Traceback" not in err


def test_verify_does_not_parse_a_file_whose_hash_is_wrong(vector_set, tmp_path):
    import zipfile
    from sdpa_ref.harness.vectors import verify_vectors
    d = _copy_set(vector_set, tmp_path / "z")
    bomb = d / "plain-L8-S8.npz"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("out.npy", b"\0" * (64 << 20))                  # 64 MiB that deflate to almost nothing
    rep = verify_vectors(str(d))
    row = next(r for r in rep.rows if r["file"] == "plain-L8-S8.npz")
    assert not row["ok"] and "not parsed" in row["note"]


@pytest.mark.parametrize("which", ["query", "query-rank3", "key"])
def test_an_input_shared_across_the_batch_keeps_rows_some_batch_entry_reads(which):
    # q (Hq, L, E) is broadcast over a batch whose lengths differ: a row is dead only if dead for every entry
    rng = np.random.default_rng(8)
    q, k, v, g = (rng.standard_normal((2, 2, 5, 3)) for _ in range(4))
    kw = dict(q_lengths=np.array([5, 3]), kv_lengths=np.array([4, 2]))
    shared = {"query": (q[:1], k, v), "query-rank3": (q[0], k, v), "key": (q, k[:1], v[:1])}[which]
    out, res = sdpa_ref.sdpa_forward(*shared, **kw)
    full = [np.broadcast_to(a, (2, 2, 5, 3)).copy() for a in shared]
    want, res_full = sdpa_ref.sdpa_forward(*full, **kw)
    np.testing.assert_array_equal(out, want)
    got, ref = sdpa_ref.sdpa_backward(res, g), sdpa_ref.sdpa_backward(res_full, g)
    np.testing.assert_allclose(got.value, ref.value.sum(axis=0, keepdims=True) if which == "key" else ref.value,
                               rtol=F64_SUMS, atol=F64_FEW_ULP)


# ------------------------------------------------------------ honest memory (part 8)


def _peak_in_scores(L, **kw):
    """Peak traced memory of forward + backward, in units of one (B, H, L, S) float64 array."""
    import tracemalloc
    rng = np.random.default_rng(8)
    q, k, v, g = (rng.standard_normal((1, 2, L, 16)) for _ in range(4))
    bkw = {"method": kw.pop("backward")} if "backward" in kw else {}
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        _, res = sdpa_ref.sdpa_forward(q, k, v, **kw)
        sdpa_ref.sdpa_backward(res, g, **bkw)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak / (2 * L * L * 8)


def test_save_probs_false_peaks_no_higher_than_the_default(monkeypatch):
    # the sizes of the arrays allocated, not timings: the same on every machine (benchmarks/bench_memory.py), on
    # one thread (with two, how far the dense path's head chunks overlap moves its peak: 1.8 to 2.4 score arrays)
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "1")
    dense = _peak_in_scores(512)
    lse = _peak_in_scores(512, save_probs=False)
    assert lse <= dense, (lse, dense)
    one = _peak_in_scores(512, block_size=128)            # the tiled path: one block of rows at a time
    assert one < 0.5 * dense, (one, dense)
    monkeypatch.setenv("SDPA_REF_NUM_THREADS", "2")       # each thread holds one block of rows' temporaries
    assert _peak_in_scores(512, block_size=128) < 2 * one


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere")
def test_vectors_into_a_folder_it_may_not_write_is_a_one_line_error(tmp_path, capsys):
    from sdpa_ref.cli import main
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["vectors", str(ro / "v")]) == 2
    finally:
        ro.chmod(0o700)
    err = capsys.readouterr().err
    assert "cannot write into OUT_DIR" in err and "Traceback" not in err
