"""Golden test vectors: the reference's answers as ``.npz`` files any language can read.

``write_vectors(out_dir, suite, dtype)`` writes one ``<case>.npz`` per case of
the suite and a ``manifest.json``. ``verify_vectors(out_dir)`` re-checks the
files against the manifest's SHA-256 hashes and, bit for bit, against a fresh
computation: every reference array is reproducible, so a set written on one
machine verifies on any other.

File format (``FORMAT_VERSION`` "3")
------------------------------------
Each ``.npz`` is an uncompressed zip of ``.npy`` arrays (readable by cnpy,
ndarray-npy, xtensor-io, numpy, ...), written byte-deterministically (fixed
entry order and timestamps), so the same suite, dtype and package version
give the same hashes:

``query, key, value``
    The inputs, in the vectors' dtype. bfloat16 and fp8 (``float8_e4m3fn``,
    ``float8_e5m2``) arrays are stored as their bit patterns, ``uint16`` and
    ``uint8`` (``.npy`` has no code for them): view them as the
    ``ml_dtypes`` type, or decode them as the C client does. Every array in
    the vectors' dtype (``grad_out``, a float mask, ``bias``,
    ``alibi_slopes``) is stored the same way; :func:`decoded` undoes it.
``q_descale``, ``k_descale``, ``v_descale``
    fp8 only (float32, ``batch + (Hkv,)``): the inputs are quantized per
    (batch, kv-head) as FlashAttention 3 takes them, and the problem's values
    are ``query * q_descale`` and so on. An fp8 kernel returns bfloat16 (the
    manifest's ``output_dtype``), and ``grad_out`` is bfloat16 too.
``attn_mask`` (bool), ``bias``, ``alibi_slopes``, ``dropout_mask`` (bool), ``q_lengths``, ``kv_lengths`` (int64),
``sinks`` (float32 below float64)
    Present when the case uses them.
``options_json``
    uint8: the UTF-8 bytes of a JSON object with the scalar options
    (``is_causal``, ``causal_alignment``, ``window``, ``softcap``, ``scale``,
    ``fully_masked``, ``dropout_p``, ``enable_gqa``) and ``arrays``.
``out``, ``lse``, ``grad_out``, ``dq``, ``dk``, ``dv``, ``dbias``, ``dsinks``
    The reference on the stored inputs with ``precision="reproducible"``:
    float64, faithfully rounded, the same bits on every machine;
    ``grad_out`` (the seeded cotangent) is in the vectors' dtype; ``dbias``
    only with a bias, ``dsinks`` only with sinks. ``lse`` is ``-inf`` on rows
    with no key (and no sink; it includes the sink).
``honest_out``, ``honest_lse``, ``honest_dq``, ``honest_dk``, ``honest_dv`` (``honest_dbias``,
``honest_dsinks``)
    Only below float64, float64 arrays of one entry: the largest error
    ``max|honest - out|`` of the honest ensemble (:mod:`.ensemble`, kernels
    computing in the vectors' dtype in a fixed order: the same bits
    everywhere), so that a test without Python can apply the harness's
    relative rule ``max|impl - out| <= 3 honest_out + atol``; ``honest_lse``
    over the rows whose ``lse`` is finite, the LSE kept in float32 (float64
    for float64) as kernels keep it.

Format "1" stored the plain same-dtype computation (``naive_*`` arrays) for
FlashAttention's ``2 max|naive_out - out|`` instead; format "2" had no
``honest_lse`` (a client then judges no LSE below float64). A client should
ignore ``honest_*`` arrays it does not know: they are errors of the honest
ensemble, not options.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from ..api import sdpa_forward
from ..derivatives import sdpa_backward
from ..options import ARRAY_OPTIONS
from .cases import SUITE_VERSION, get_suite, grad_out_for
from .ensemble import ensemble_errors, honest_errors
from .lowp import DESCALES, LOW_DTYPES, TEST_DTYPES, as_test_dtype, dequantized, is_low, output_dtype
from ._files import UnsafeDestination, WriteFolder
from ._kept import KeptFiles
from .budget import check_verify_budget
from .casefile import CaseFileError, case_definition, cases_from_definitions, load_cases
from .rules import RelativeRule
from .vector_layouts import LAYOUT_FORMAT_VERSION, VECTOR_LAYOUTS, in_layout, layout_arrays
from .vectorio import (FORMAT_VERSION, MAX_FILE_BYTES, MAX_MANIFEST_BYTES, ManifestError, differences,  # noqa: F401
                       manifest_bytes, manifest_differences, read_manifest, read_member, read_npz, shown)
from .vectorio import npz_bytes as _npz_bytes

__all__ = ["FORMAT_VERSION", "ManifestError", "UnsafeDestination", "write_vectors", "verify_vectors",
           "VerifyReport", "read_npz", "decoded"]

#: The top-k indices of a ``"gathered"`` set (not an option the harness judges elsewhere).
GATHER = ("gather_kv_indices",)
#: The arrays held in the vectors' dtype (bit patterns for bfloat16 and fp8).
IN_DTYPE = ("query", "key", "value", "attn_mask", "bias", "alibi_slopes", "grad_out")
#: The manifest's fields that record where a set came from and are taken as stored by ``verify`` (if strings):
#: the writer's version (the files' bytes do not depend on it, and they are compared) and the case file's name
#: (the definitions it held are stored, and compared).
PROVENANCE = ("package_version", "cases_file")


def write_vectors(out_dir, suite: str = "quick", dtype: str = "float64",
                  progress: Optional[Callable[[int, int, str], None]] = None, cases=None, layout=None) -> dict:
    """Write ``<case>.npz`` files and ``manifest.json`` into ``out_dir``; return the manifest.

    ``layout`` (``"thd"``, ``"paged"`` or ``"thd_paged"``) writes the cases that have a form in that layout as a
    varlen or paged kernel (or one taking packed queries against a paged cache) stores them, ``"gathered"``
    every case with top-k key indices (:mod:`.vector_layouts`; format "4");
    None (default) the dense set.

    ``cases`` (a case file's path, or a sequence of :class:`~.cases.Case`) replaces ``suite``: the set is then
    the ``"custom"`` suite, and the manifest stores every case's definition (``"cases"``), from which
    :func:`verify_vectors` regenerates it on any machine.

    Every file goes to a new temporary file in ``out_dir`` (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0o644), then
    ``os.replace``-d onto its name, so no write follows a symlink or blocks on a FIFO; a name that exists and is
    not a regular file (a symlink, FIFO, folder or device) is refused with :class:`UnsafeDestination` (an
    ``OSError``) before anything is written. ``out_dir`` itself is followed if it is a symlink to a folder.
    """
    from .._version import __version__

    if not (isinstance(dtype, str) and dtype in TEST_DTYPES):
        raise ValueError(f"`dtype` should be one of {', '.join(TEST_DTYPES)}, but got {dtype!r}")
    dt = as_test_dtype(dtype, "dtype")                      # bfloat16 and fp8: ImportError without ml_dtypes
    if layout is not None and layout not in VECTOR_LAYOUTS:
        raise ValueError(f"`layout` should be None or one of {', '.join(VECTOR_LAYOUTS)}, but got {layout!r}")
    if layout in ("thd", "paged", "thd_paged") and dt.name in ("float8_e4m3fn", "float8_e5m2"):
        raise ValueError(f"`dtype` should not be fp8 with `layout` (its per-(batch, kv-head) descales have no "
                         f"layout form), but got {dt.name}")
    custom = None
    if cases is not None:                                   # refuse a bad case file or suite before touching the disk
        source = os.path.basename(os.fspath(cases)) if isinstance(cases, (str, os.PathLike)) else None
        cases = load_cases(cases) if source is not None else list(cases)
        custom = {"cases": [case_definition(c) for c in cases]}
        cases_from_definitions(custom["cases"], "`cases`")       # valid and uniquely named, as verify will read them
        check_verify_budget(cases, dt.name, where="`cases`")     # and within what verify accepts
        if source is not None:
            custom["cases_file"] = source
        suite = "custom"
    else:
        cases = get_suite(suite)
    if layout is not None:
        cases = in_layout(cases, layout)
    os.makedirs(out_dir, exist_ok=True)
    files = []
    with WriteFolder(out_dir) as folder:
        folder.refuse_unsafe([f"{c.name}.npz" for c in cases] + ["manifest.json"])
        for i, case in enumerate(cases):
            if progress is not None:
                progress(i, len(cases), case.name)
            arrays = _case_arrays(case, dt.name, layout)
            data = _npz_bytes(arrays)
            folder.write(f"{case.name}.npz", data)
            files.append(_file_entry(case, arrays, data))
        manifest = _manifest(suite, dt, files, custom, __version__, layout)
        folder.write("manifest.json", manifest_bytes(manifest))
    return manifest


def _file_entry(case, arrays, data) -> dict:
    """A file's entry in the manifest."""
    return {"file": f"{case.name}.npz", "case": case.name, "sha256": hashlib.sha256(data).hexdigest(),
            "shapes": {k: list(v.shape) for k, v in arrays.items() if k != "options_json"},
            "options": case.options_json()}


def _manifest(suite, dt, files, custom, package_version, layout=None) -> dict:
    """The manifest of a set: every field but the provenance follows from the suite (or cases), dtype and
    layout."""
    manifest = {
        "format": "sdpa_ref golden vectors",
        "format_version": FORMAT_VERSION if layout is None else LAYOUT_FORMAT_VERSION,
        "package": "sdpa_ref", "package_version": package_version,
        "suite": suite, "suite_version": SUITE_VERSION, "dtype": dt.name,
        "storage": _STORAGE.get(dt.name, "every array in its own dtype"),
        "output_dtype": output_dtype(dt).name,
        "reference": ("precision='reproducible': every float64 array faithfully rounded, every honest_* error "
                      "that of the honest ensemble computed in the vectors' dtype in a fixed order; the same bits "
                      "on every machine"),
        "tolerance_rule": {
            "float64": "element-wise |got - out| <= 1e-12 + 1e-12 * |out| (and the same for every gradient)",
            "below float64": (f"the relative rule: max|got - out| <= {RelativeRule().k_out:g} * honest_out[0] + "
                              f"atol ({RelativeRule().k_out:g} * honest_lse[0] + atol for lse, over its finite "
                              f"entries, atol in float32; {RelativeRule().k_grad:g} * honest_dq[0] + atol for dq, "
                              "and so on), atol = 2*max|fl(fl(out + 0.3) - 0.3) - out| in the vectors' dtype"),
            "lse": "base e, -inf on a row with no key and no sink, which must meet -inf exactly",
            "nan": "NaN must match NaN exactly (fully_masked='nan' cases)",
        },
        "relative_rule": {"k_out": RelativeRule().k_out, "k_grad": RelativeRule().k_grad},
        "files": files,
    }
    if layout is not None:
        manifest["layout"] = layout
    manifest.update(custom or {})
    return manifest


def case_arrays(case, dt) -> Dict[str, np.ndarray]:
    """All arrays of one vector file, in the order they are written (the caller's own copies)."""
    return {n: a.copy() for n, a in _case_arrays(case, np.dtype(dt).name).items()}


def _case_arrays(case, dt, layout=None, keep=True):
    """:func:`case_arrays`, small files kept per process (:data:`_KEPT`); ``verify`` keeps nothing (``keep=False``:
    it holds one case at a time)."""
    key = (case, np.dtype(dt).name, layout)
    arrays = _KEPT.get(key)
    if arrays is None:
        arrays = _regenerated(case, dt, layout)
        if keep:
            _KEPT.put(key, arrays)
    return arrays


#: Files of at most 4 MiB kept, 64 MiB in all (a file is the same bits every time it is computed).
_KEPT = KeptFiles(4 << 20, 64 << 20)
clear_cache = _KEPT.clear


def _regenerated(case, dt, layout=None):
    """Every array of ``case``'s vector file, computed anew."""
    dt = np.dtype(dt)
    inp = case.make_inputs(dt)
    q, k, v = inp.pop("query"), inp.pop("key"), inp.pop("value")
    arrays: Dict[str, np.ndarray] = {"query": q, "key": k, "value": v}
    for name in ARRAY_OPTIONS + DESCALES + GATHER:
        if name in inp:
            arrays[name] = np.asarray(inp.pop(name))
    opts = case.options_json()
    arrays["options_json"] = np.frombuffer(json.dumps(opts, sort_keys=True).encode("utf-8"), dtype=np.uint8)
    exp = expected(arrays, opts, dt, case)
    arrays.update(exp)
    if layout in ("thd", "paged", "thd_paged"):             # as a varlen or paged kernel stores them
        arrays = layout_arrays(arrays, layout)
    return {n: _bits(a) if n in IN_DTYPE else a for n, a in arrays.items()}


_STORAGE = {n: (f"arrays in {n} ({', '.join(IN_DTYPE)}) are stored as their uint{16 if n == 'bfloat16' else 8} "
                f"bit patterns: view them as ml_dtypes.{n}" + ("" if n == "bfloat16" else
                "; grad_out is in the output dtype, bfloat16 (uint16 bits); q_descale, k_descale and v_descale "
                "(float32, batch + (Hkv,)) multiply query, key and value per (batch, kv-head)"))
            for n in LOW_DTYPES}


def _bits(a):
    """A bfloat16 or fp8 array as its unsigned bit patterns (``.npy`` has no code for those types)."""
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8) if is_low(a.dtype) else a


def decoded(arrays, dtype):
    """The arrays of a vector file (:func:`read_npz`) with the bit patterns of ``dtype`` (bfloat16, fp8) viewed as
    that type again; other dtypes' arrays as they are."""
    dt = as_test_dtype(dtype, "dtype")
    if not is_low(dt):
        return dict(arrays)
    by_width = {dt.itemsize: dt, 2: output_dtype(dt)}          # fp8 sets: grad_out is bfloat16
    return {n: (a.view(by_width[a.itemsize]) if n in IN_DTYPE and a.dtype.kind == "u" else a)
            for n, a in arrays.items()}


def expected(arrays, opts, dt, case=None, grad_out=None) -> Dict[str, np.ndarray]:
    """The reference's out, lse, grad_out, grads (float64) and, below float64, the honest ensemble's errors.

    ``arrays`` hold the inputs in ``dt`` (not bit patterns); ``case``, when given, lets the ensemble's results
    be cached with the harness's."""
    dt = np.dtype(dt)
    kw = _options_kwargs(arrays, opts)
    q, k, v = arrays["query"], arrays["key"], arrays["value"]
    problem = dequantized(dict(kw, query=q, key=k, value=v))          # fp8: times the descales
    out, res = sdpa_forward(problem.pop("query"), problem.pop("key"), problem.pop("value"),
                            precision="reproducible", **problem)
    g = grad_out if grad_out is not None else grad_out_for(case, out.shape, output_dtype(dt))
    gr = sdpa_backward(res, np.asarray(g).astype(np.float64))
    result = {"out": out, "lse": res.lse, "grad_out": g, "dq": gr.query, "dk": gr.key, "dv": gr.value}
    if gr.bias is not None:
        result["dbias"] = gr.bias
    if gr.sinks is not None:
        result["dsinks"] = gr.sinks
    if dt != np.dtype(np.float64):
        ref = {n: np.asarray(result[n], np.float64) for n in ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")
               if n in result}
        honest = ensemble_errors(case, dt, ref) if case is not None and grad_out is None else \
            honest_errors(dict(kw, query=q, key=k, value=v), g, dt, ref)
        result.update({f"honest_{n}": np.array([e]) for n, e in honest.items()})
    return result


def _options_kwargs(arrays, opts):
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in opts.items() if k != "arrays"}
    for name in ARRAY_OPTIONS + DESCALES + GATHER:
        if name in arrays:
            kw[name] = arrays[name]
    return kw


@dataclass
class VerifyReport:
    """``rows``: one per file the manifest lists (``file`` is its name escaped by :func:`~.vectorio.shown`);
    ``problems``: what concerns the whole set (the manifest's other fields, missing and unlisted cases)."""
    rows: List[dict] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.rows) and all(r["ok"] for r in self.rows)

    def __str__(self) -> str:
        head = f"{'file':<72} {'hash':<6} {'recomputed':<10} {'max rel diff':>12}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r['file'][:72]:<72} {'ok' if r['hash_ok'] else 'BAD':<6} "
                         f"{'ok' if r['recompute_ok'] else 'BAD':<10} {r['max_rel_diff']:>12.3e}"
                         + (f"  {r['note']}" if r.get("note") else ""))
        lines.extend(f"problem: {p}" for p in self.problems)
        n_bad = sum(not r["ok"] for r in self.rows) + len(self.problems)
        lines.append(f"\n{len(self.rows) - sum(not r['ok'] for r in self.rows)} passed, {n_bad} failed")
        lines.append("verdict: " + ("VERIFIED" if self.ok else "NOT VERIFIED"))
        return "\n".join(lines)


def verify_vectors(out_dir) -> VerifyReport:
    """Check a vector set against the suite's own definition, bit for bit: VERIFIED only if a fresh
    :func:`write_vectors` of the same suite (or cases) and dtype would write the same bytes.

    The threat model: the folder may hold anything. ``verify`` reads only
    ``manifest.json`` and the regular files it names, inside ``out_dir``, by
    plain name -- no ``..``, no absolute paths, no symlinks, no devices or
    FIFOs -- with bounded reads, and hashes each file before parsing it. It
    then regenerates each case of the manifest's suite from the suite's
    definition (inputs, options and every reference array, with
    ``precision="reproducible"``: the same bits on any machine), one at a time
    in the manifest's order, keeping only its entry, and compares bytes, so
    replaced inputs, recomputed outputs, changed options, deleted, duplicated
    or foreign cases are all NOT VERIFIED. Bounded work: before computing
    anything, a set past :data:`~.budget.VERIFY_LIMITS` is refused
    (:class:`ManifestError`). Per case: 2**22 score entries (batch x Hq x L x S), 2**20 entries in an input,
    2**26 bytes (64 MiB) of file, 2**28 work (scores x (E + Ev + 16)); in total 2**24 score entries, 2**29 bytes
    (512 MiB), 2**30 work (2**18 more per case): seconds in float64, a minute in bfloat16, 0.5 GB. The manifest is
    regenerated too and compared byte for byte (every field a judge reads:
    dtype, output_dtype, storage, reference, tolerance_rule, relative_rule,
    format and suite versions, the case definitions, each file's name, case,
    sha256, shapes and options), except :data:`PROVENANCE`, taken as stored
    if strings. A malformed manifest (a key written twice, ``NaN``, the wrong
    versions, ...) raises :class:`ManifestError`. Names are reported escaped,
    one line each, whatever their encoding.
    """
    from .._version import __version__

    out_dir = os.fspath(out_dir)
    out_dir = os.fsdecode(out_dir) if isinstance(out_dir, bytes) else out_dir
    rep = VerifyReport()
    manifest, raw = read_manifest(out_dir)
    try:
        dt = as_test_dtype(manifest["dtype"], "dtype")
    except ImportError as exc:
        raise ManifestError(f"the vectors are {manifest['dtype']}: {exc}") from None
    custom, layout = None, manifest.get("layout")
    if manifest["suite"] == "custom":                   # a user's cases: regenerated from the stored definitions
        try:
            suite = cases_from_definitions(manifest.get("cases"), "manifest.json")
        except CaseFileError as exc:
            raise ManifestError(str(exc)) from None
        custom = {"cases": [case_definition(c) for c in suite]}
    else:
        suite = get_suite(manifest["suite"])
    if layout is not None:
        suite = in_layout(suite, layout)
    check_verify_budget(suite, dt.name, where=shown(os.path.join(out_dir, "manifest.json"), 300))
    by_file = {f"{case.name}.npz": case for case in suite}
    entries, seen = {}, set()                           # each case's manifest entry: all that is kept of it

    def regenerate(fname):                              # one case, its arrays freed by the caller
        arrays = _case_arrays(by_file[fname], dt.name, layout, keep=False)
        data = _npz_bytes(arrays)
        entries[fname] = _file_entry(by_file[fname], arrays, data)
        return arrays, data

    for entry in manifest["files"]:                     # in the manifest's order: read, regenerate, compare
        fname = entry["file"]
        row = {"file": shown(fname, 200), "hash_ok": False, "recompute_ok": False, "max_rel_diff": float("nan"),
               "ok": False}
        rep.rows.append(row)
        if fname in seen:
            row["note"] = "listed twice in the manifest"
            continue
        seen.add(fname)
        data, why = read_member(out_dir, fname)
        fresh = regenerate(fname) if fname in by_file else None
        if data is None:
            row["note"] = why
            continue
        row["hash_ok"] = hashlib.sha256(data).hexdigest() == entry["sha256"]
        if not row["hash_ok"]:
            row["note"] = "sha256 differs from the manifest (not parsed)"
            continue
        if fresh is None:
            row["note"] = f"not a case of the {manifest['suite']!r} suite"
            continue
        if fresh[1] == data:
            row["recompute_ok"], row["max_rel_diff"] = True, 0.0
        else:
            row["note"], row["max_rel_diff"] = differences(data, fresh[0])
        row["ok"] = row["hash_ok"] and row["recompute_ok"]
    for fname in [f for f in by_file if f not in entries]:     # cases the manifest leaves out: their entries too
        regenerate(fname)
    kept = {k: manifest[k] for k in PROVENANCE if isinstance(manifest.get(k), str)}
    if "cases_file" in kept:
        custom = dict(custom or {}, cases_file=kept["cases_file"])
    want = _manifest(manifest["suite"], dt, [entries[f] for f in by_file], custom,
                     kept.get("package_version", __version__), layout)
    if raw != manifest_bytes(want):
        diff = manifest_differences(manifest, want)
        rep.problems.insert(0, "manifest.json is not what a fresh write of this set gives: " + (
            "; ".join(diff) if diff else "the same fields, but other bytes (layout, key order, escapes or the "
                                         "spelling of a number)"))
    for name in sorted(set(by_file) - seen):
        rep.problems.append(f"case {shown(name)} of the {manifest['suite']!r} suite is missing from the manifest")
    try:
        on_disk = os.listdir(out_dir)
    except OSError as exc:
        raise ManifestError(f"cannot list the folder {shown(out_dir, 300)}: {exc.strerror or exc}") from None
    for f in sorted(f for f in on_disk if f.endswith(".npz") and f not in seen):
        rep.problems.append(f"{shown(f)} is not listed in the manifest")
    return rep
