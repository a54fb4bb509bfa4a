"""Golden vectors in a kernel's storage layout (``sdpa-ref vectors --layout thd|paged|thd_paged``, format 4).

The layout set's reference, computed in the layout, must be the dense set's entries moved -- bit for bit, every
quantity, storage no sequence uses holding 0 (and -inf in the LSE) -- and the set must verify like a dense one,
and refuse what it cannot hold.
"""

import json

import numpy as np
import pytest

from sdpa_ref.harness import vectors
from sdpa_ref.harness.cases import get_suite
from sdpa_ref.harness.storage import Storage
from sdpa_ref.harness.vector_layouts import takes


@pytest.fixture(scope="module", params=["thd", "paged", "thd_paged"])
def layout_set(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    m = vectors.write_vectors(str(d), dtype="float32", layout=request.param)
    return request.param, d, m


def test_the_layout_reference_is_the_dense_one_moved_bit_for_bit(layout_set):
    layout, d, m = layout_set
    assert m["format_version"] == "4" and m["layout"] == layout
    cases = {c.name: c for c in get_suite("quick")}
    for entry in m["files"]:
        case = cases[entry["case"]]
        with open(d / entry["file"], "rb") as fh:
            got = vectors.read_npz(fh.read())
        dense = vectors.case_arrays(case, "float32")
        lengths = {n: dense[n] for n in ("q_lengths", "kv_lengths") if n in dense}
        st = Storage(layout, dense["query"], dense["key"], dense["value"], lengths)
        for n in ("query", "key", "value"):
            np.testing.assert_array_equal(got[n], (st.query if n == "query" else st.kv)(dense[n]))
        np.testing.assert_array_equal(got["out"], st.out(dense["out"]))
        np.testing.assert_array_equal(got["grad_out"], st.out(dense["grad_out"]))
        np.testing.assert_array_equal(st.from_lse(got["lse"]), dense["lse"])
        for n, x in zip(("dq", "dk", "dv"), st.from_grads(got["dq"], got["dk"], got["dv"])):
            np.testing.assert_array_equal(x, dense[n])
        if st.packed_q:                              # the spare row: 0, and -inf in the LSE
            assert np.all(got["out"][-1] == 0) and np.all(got["lse"][:, -1] == -np.inf)
            assert np.all(got["dq"][-1] == 0) and (st.paged_kv or np.all(got["dk"][-1] == 0))
            np.testing.assert_array_equal(got["cu_seqlens_q"], st.kwargs()["cu_seqlens_q"])
        if st.paged_kv:                              # the spare page: in the cache, unread, 0 in dk and dv
            np.testing.assert_array_equal(got["block_table"], st.kwargs()["block_table"])
            spare = st.spare
            assert 0 <= spare < got["key"].shape[0]
            for n in ("key", "value", "dk", "dv"):
                assert np.all(got[n][spare] == 0), n
        for n in dense:
            if n.startswith("honest_") or n in ("sinks", "dsinks", "alibi_slopes", "q_offset", "options_json"):
                np.testing.assert_array_equal(got[n], dense[n])
        assert not ({"q_lengths", "kv_lengths", "attn_mask", "bias", "dropout_mask"} & set(got))


def test_a_layout_set_verifies_and_a_tampered_one_does_not(layout_set, tmp_path):
    layout, d, m = layout_set
    assert vectors.verify_vectors(str(d)).ok
    import shutil
    t = tmp_path / "t"
    shutil.copytree(d, t)
    mani = json.loads((t / "manifest.json").read_text())
    mani["layout"] = {"thd": "paged", "paged": "thd_paged", "thd_paged": "thd"}[layout]
    (t / "manifest.json").write_text(json.dumps(mani, indent=2, sort_keys=True) + "\n")
    assert not vectors.verify_vectors(str(t)).ok
    mani["layout"] = "bshd"
    (t / "manifest.json").write_text(json.dumps(mani))
    with pytest.raises(vectors.ManifestError, match="'layout'"):
        vectors.verify_vectors(str(t))


def test_which_cases_have_a_layout_form():
    suite = get_suite("full")
    for layout in ("thd", "paged", "thd_paged"):
        kept = [c for c in suite if takes(c, layout)]
        assert kept and len(kept) < len(suite)
        for c in suite:
            dense_arrays = {"mask", "masked_rows", "float_mask", "bias", "dropout", "gather", "topk"} & set(c.arrays)
            expect = (c.batch_q == c.batch_kv and len(c.batch_q) == 1 and not dense_arrays
                      and c.opts.get("fully_masked") != "uniform"
                      and not (layout == "paged" and "lengths" in c.arrays))
            assert takes(c, layout) == expect, c.name


def test_bad_layout_requests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="`layout`"):
        vectors.write_vectors(str(tmp_path / "a"), layout="bshd")
    pytest.importorskip("ml_dtypes")
    with pytest.raises(ValueError, match="fp8"):
        vectors.write_vectors(str(tmp_path / "b"), dtype="float8_e4m3fn", layout="thd")
    with pytest.raises(ValueError, match="fp8"):
        vectors.write_vectors(str(tmp_path / "c"), dtype="float8_e5m2", layout="thd_paged")


def test_a_thd_paged_set_holds_the_cases_with_query_lengths(layout_set):
    """Packed queries against the cache: the sequences' query counts are the case's q_lengths, so the cases with
    lengths are stored (a paged set leaves them out), with cu_seqlens_q beside the cache's tables."""
    layout, d, m = layout_set
    with_lengths = {c.name for c in get_suite("quick") if "lengths" in c.arrays and takes(c, "thd")}
    stored = {e["case"] for e in m["files"]}
    assert with_lengths and (with_lengths <= stored) == (layout != "paged")
    if layout == "thd_paged":
        assert all({"cu_seqlens_q", "cache_seqlens", "block_table"} <= set(e["shapes"]) for e in m["files"])
        assert not any("cu_seqlens_k" in e["shapes"] for e in m["files"])


def test_a_gathered_set_holds_every_case_with_its_indices_and_verifies(tmp_path):
    m = vectors.write_vectors(str(tmp_path), dtype="float32", layout="gathered")
    suite = get_suite("quick")
    assert m["layout"] == "gathered" and [e["case"] for e in m["files"]] == [c.name + "-gather" for c in suite]
    assert vectors.verify_vectors(str(tmp_path)).ok
    with open(tmp_path / "plain-L8-S8-gather.npz", "rb") as fh:
        got = vectors.read_npz(fh.read())
    dense = vectors.case_arrays(suite[0], "float32")
    idx = got["gather_kv_indices"]
    assert idx.shape == (2, 1, 8, 4) and idx.min() >= -1 and idx.max() < 8
    np.testing.assert_array_equal(got["query"], dense["query"])
    assert not np.array_equal(got["out"], dense["out"])             # the indices leave keys out
    from sdpa_ref import sdpa_forward
    want = sdpa_forward(*(dense[n].astype(np.float64) for n in ("query", "key", "value")), gather_kv_indices=idx,
                        precision="reproducible")[0]
    np.testing.assert_array_equal(got["out"], want)


def test_the_command_line_writes_a_layout_set_and_refuses_fp8(tmp_path, capsys):
    from sdpa_ref.cli import main
    assert main(["vectors", str(tmp_path / "p"), "--layout", "paged", "--dtype", "float32"]) == 0
    assert "layout paged" in capsys.readouterr().out
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["layout"] == "paged"
    assert main(["vectors", str(tmp_path / "tp"), "--layout", "thd_paged"]) == 0
    assert "layout thd_paged" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "tp")]) == 0
    pytest.importorskip("ml_dtypes")
    assert main(["vectors", str(tmp_path / "f"), "--layout", "thd", "--dtype", "float8_e4m3fn"]) == 2
    assert "--layout" in capsys.readouterr().err
