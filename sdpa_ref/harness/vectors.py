"""Golden test vectors: the reference's answers as ``.npz`` files any language can read.

``write_vectors(out_dir, suite, dtype)`` writes one ``<case>.npz`` per case of
the suite and a ``manifest.json``. ``verify_vectors(out_dir)`` re-checks the
files against the manifest's SHA-256 hashes and, bit for bit, against a fresh
computation: every reference array is reproducible, so a set written on one
machine verifies on any other.

File format (``FORMAT_VERSION`` "2")
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
``attn_mask`` (bool), ``bias``, ``alibi_slopes``, ``dropout_mask`` (bool), ``q_lengths``, ``kv_lengths`` (int64)
    Present when the case uses them.
``options_json``
    uint8: the UTF-8 bytes of a JSON object with the scalar options
    (``is_causal``, ``causal_alignment``, ``window``, ``softcap``, ``scale``,
    ``fully_masked``, ``dropout_p``, ``enable_gqa``) and ``arrays``.
``out``, ``lse``, ``grad_out``, ``dq``, ``dk``, ``dv``, ``dbias``
    The reference on the stored inputs with ``precision="reproducible"``:
    float64, faithfully rounded, the same bits on every machine;
    ``grad_out`` (the seeded cotangent) is in the vectors' dtype; ``dbias``
    only with a bias. ``lse`` is ``-inf`` on rows with no key.
``honest_out``, ``honest_dq``, ``honest_dk``, ``honest_dv`` (``honest_dbias``)
    Only below float64, float64 arrays of one entry: the largest error
    ``max|honest - out|`` of the honest ensemble (:mod:`.ensemble`, kernels
    computing in the vectors' dtype in a fixed order: the same bits
    everywhere), so that a test without Python can apply the harness's
    relative rule ``max|impl - out| <= 3 honest_out + atol``.

Format "1" stored the plain same-dtype computation (``naive_*`` arrays) for
FlashAttention's ``2 max|naive_out - out|`` instead.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from ..api import sdpa_backward, sdpa_forward
from ..options import ARRAY_OPTIONS
from .cases import SUITE_VERSION, get_suite, grad_out_for
from .ensemble import ensemble_errors, honest_errors
from .lowp import DESCALES, LOW_DTYPES, TEST_DTYPES, as_test_dtype, dequantized, is_low, output_dtype
from ._files import read_regular_file
from .casefile import CaseFileError, case_definition, cases_from_definitions, load_cases
from .rules import RelativeRule

__all__ = ["FORMAT_VERSION", "ManifestError", "write_vectors", "verify_vectors", "VerifyReport", "read_npz", "decoded"]

#: The arrays held in the vectors' dtype (bit patterns for bfloat16 and fp8).
IN_DTYPE = ("query", "key", "value", "attn_mask", "bias", "alibi_slopes", "grad_out")

FORMAT_VERSION = "2"
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def write_vectors(out_dir, suite: str = "quick", dtype: str = "float64",
                  progress: Optional[Callable[[int, int, str], None]] = None, cases=None) -> dict:
    """Write ``<case>.npz`` files and ``manifest.json`` into ``out_dir``; return the manifest.

    ``cases`` (a case file's path, or a sequence of :class:`~.cases.Case`) replaces ``suite``: the set is then
    the ``"custom"`` suite, and the manifest stores every case's definition (``"cases"``), from which
    :func:`verify_vectors` regenerates it on any machine.
    """
    from .. import __version__

    if not (isinstance(dtype, str) and dtype in TEST_DTYPES):
        raise ValueError(f"`dtype` should be one of {', '.join(TEST_DTYPES)}, but got {dtype!r}")
    dt = as_test_dtype(dtype, "dtype")                      # bfloat16 and fp8: ImportError without ml_dtypes
    custom = None
    if cases is not None:                                   # refuse a bad case file or suite before touching the disk
        source = os.path.basename(os.fspath(cases)) if isinstance(cases, (str, os.PathLike)) else None
        cases = load_cases(cases) if source is not None else list(cases)
        custom = {"cases": [case_definition(c) for c in cases]}
        cases_from_definitions(custom["cases"], "`cases`")       # valid and uniquely named, as verify will read them
        if source is not None:
            custom["cases_file"] = source
        suite = "custom"
    else:
        cases = get_suite(suite)
    os.makedirs(out_dir, exist_ok=True)
    files = []
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.name)
        arrays = case_arrays(case, dt)
        fname = f"{case.name}.npz"
        data = _npz_bytes(arrays)
        with open(os.path.join(out_dir, fname), "wb") as fh:
            fh.write(data)
        files.append({
            "file": fname, "case": case.name, "sha256": hashlib.sha256(data).hexdigest(),
            "shapes": {k: list(v.shape) for k, v in arrays.items() if k != "options_json"},
            "options": case.options_json(),
        })
    manifest = {
        "format": "sdpa_ref golden vectors", "format_version": FORMAT_VERSION,
        "package": "sdpa_ref", "package_version": __version__,
        "suite": suite, "suite_version": SUITE_VERSION, "dtype": dt.name,
        "storage": _STORAGE.get(dt.name, "every array in its own dtype"),
        "output_dtype": output_dtype(dt).name,
        "reference": ("precision='reproducible': every float64 array faithfully rounded, every honest_* error "
                      "that of the honest ensemble computed in the vectors' dtype in a fixed order; the same bits "
                      "on every machine"),
        "tolerance_rule": {
            "float64": "element-wise |got - out| <= 1e-12 + 1e-12 * |out| (and the same for every gradient)",
            "below float64": (f"the relative rule: max|got - out| <= {RelativeRule().k_out:g} * honest_out[0] + "
                              f"atol ({RelativeRule().k_grad:g} * honest_dq[0] + atol for dq, and so on), "
                              "atol = 2*max|fl(fl(out + 0.3) - 0.3) - out| in the vectors' dtype"),
            "nan": "NaN must match NaN exactly (fully_masked='nan' cases)",
        },
        "relative_rule": {"k_out": RelativeRule().k_out, "k_grad": RelativeRule().k_grad},
        "files": files,
    }
    manifest.update(custom or {})
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
    return manifest


def case_arrays(case, dt) -> Dict[str, np.ndarray]:
    """All arrays of one vector file, in the order they are written (the caller's own copies)."""
    return {n: a.copy() for n, a in _case_arrays(case, np.dtype(dt).name).items()}


@functools.lru_cache(maxsize=128)
def _case_arrays(case, dt):
    """:func:`case_arrays`, computed once per process: the computation is deterministic to the bit."""
    dt = np.dtype(dt)
    inp = case.make_inputs(dt)
    q, k, v = inp.pop("query"), inp.pop("key"), inp.pop("value")
    arrays: Dict[str, np.ndarray] = {"query": q, "key": k, "value": v}
    for name in ARRAY_OPTIONS + DESCALES:
        if name in inp:
            arrays[name] = np.asarray(inp.pop(name))
    opts = case.options_json()
    arrays["options_json"] = np.frombuffer(json.dumps(opts, sort_keys=True).encode("utf-8"), dtype=np.uint8)
    exp = expected(arrays, opts, dt, case)
    arrays.update(exp)
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
    if dt != np.dtype(np.float64):
        ref = {n: np.asarray(result[n], np.float64) for n in ("out", "dq", "dk", "dv", "dbias") if n in result}
        honest = ensemble_errors(case, dt, ref) if case is not None and grad_out is None else \
            honest_errors(dict(kw, query=q, key=k, value=v), g, dt, ref)
        result.update({f"honest_{n}": np.array([e]) for n, e in honest.items()})
    return result


def _options_kwargs(arrays, opts):
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in opts.items() if k != "arrays"}
    for name in ARRAY_OPTIONS + DESCALES:
        if name in arrays:
            kw[name] = arrays[name]
    return kw


@dataclass
class VerifyReport:
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


#: The largest vector file ``verify`` reads (the full suite's largest is about 4 MiB).
MAX_FILE_BYTES = 256 << 20
#: The largest ``manifest.json`` it reads.
MAX_MANIFEST_BYTES = 16 << 20


class ManifestError(ValueError):
    """``manifest.json`` cannot be used: missing, not a regular file, too large, or not of the expected form."""


def verify_vectors(out_dir) -> VerifyReport:
    """Check a vector set against the suite's own definition, bit for bit.

    The threat model: the folder may hold anything. ``verify`` reads only
    ``manifest.json`` and the regular files it names, inside ``out_dir``, by
    plain name -- no ``..``, no absolute paths, no symlinks, no devices or
    FIFOs -- with bounded reads, and hashes each file before parsing it. It
    then regenerates every case of the manifest's suite from the suite's
    definition (inputs, options and every reference array, with
    ``precision="reproducible"``: the same bits on any machine) and compares
    bytes, so replaced inputs, recomputed outputs, changed options, deleted,
    duplicated or foreign cases are all NOT VERIFIED. A malformed manifest
    raises :class:`ManifestError`.
    """
    rep = VerifyReport()
    manifest = _read_manifest(out_dir)
    try:
        dt = as_test_dtype(manifest["dtype"], "dtype")
    except ImportError as exc:
        raise ManifestError(f"the vectors are {manifest['dtype']}: {exc}") from None
    if manifest["suite"] == "custom":                   # a user's cases: regenerated from the stored definitions
        try:
            suite = cases_from_definitions(manifest.get("cases"), "manifest.json")
        except CaseFileError as exc:
            raise ManifestError(str(exc)) from None
    else:
        suite = get_suite(manifest["suite"])
    cases = {f"{c.name}.npz": c for c in suite}
    seen = set()
    for entry in manifest["files"]:
        fname = entry["file"]
        row = {"file": fname, "hash_ok": False, "recompute_ok": False, "max_rel_diff": float("nan"), "ok": False}
        rep.rows.append(row)
        if fname in seen:
            row["note"] = "listed twice in the manifest"
            continue
        seen.add(fname)
        data, why = _read_member(out_dir, fname)
        if data is None:
            row["note"] = why
            continue
        row["hash_ok"] = hashlib.sha256(data).hexdigest() == entry["sha256"]
        if not row["hash_ok"]:
            row["note"] = "sha256 differs from the manifest (not parsed)"
            continue
        case = cases.get(fname)
        if case is None:
            row["note"] = f"not a case of the {manifest['suite']!r} suite"
            continue
        fresh = case_arrays(case, dt)
        if _npz_bytes(fresh) == data:
            row["recompute_ok"], row["max_rel_diff"] = True, 0.0
        else:
            row["note"], row["max_rel_diff"] = _differences(data, fresh)
        row["ok"] = row["hash_ok"] and row["recompute_ok"]
    for name in sorted(set(cases) - seen):
        rep.problems.append(f"case {name} of the {manifest['suite']!r} suite is missing from the manifest")
    try:
        on_disk = os.listdir(out_dir)
    except OSError as exc:
        raise ManifestError(f"cannot list the folder {out_dir!r}: {exc.strerror or exc}") from None
    for f in sorted(f for f in on_disk if f.endswith(".npz") and f not in seen):
        rep.problems.append(f"{f} is not listed in the manifest")
    return rep


def _read_member(out_dir, name):
    """``(bytes, None)`` of the regular file ``name`` inside ``out_dir``, or ``(None, why)``."""
    if not isinstance(name, str) or name in ("", ".", "..") or name != os.path.basename(name) \
            or any(c in name for c in "/\\\0") or not name.endswith(".npz"):
        return None, "not a plain .npz file name (no folders, no '..'): not read"
    data, why = read_regular_file(os.path.join(out_dir, name), MAX_FILE_BYTES)
    if data is None and why.startswith("missing"):
        why = why.replace("missing or unreadable", "missing", 1)
    return data, why


def _read_manifest(out_dir):
    """The validated manifest dict, or :class:`ManifestError` in one line."""
    path = os.path.join(out_dir, "manifest.json")
    data, why = read_regular_file(path, MAX_MANIFEST_BYTES)       # opened first, then checked: nothing can block it
    if data is None:
        raise ManifestError(f"cannot read {path}: {why} (it should be a regular file of at most "
                            f"{MAX_MANIFEST_BYTES} bytes)")
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{path} is not valid JSON: {type(exc).__name__}") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path} should hold a JSON object, but holds a {type(manifest).__name__}")
    from .cases import SUITES
    if manifest.get("suite") not in SUITES + ("custom",):
        raise ManifestError(f"{path}: 'suite' should be one of {SUITES + ('custom',)!r}, but got "
                            f"{manifest.get('suite')!r}")
    if manifest.get("dtype") not in TEST_DTYPES:
        raise ManifestError(f"{path}: 'dtype' should be one of {', '.join(TEST_DTYPES)}, but got "
                            f"{manifest.get('dtype')!r}")
    if manifest.get("suite_version") != SUITE_VERSION or manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path}: written for suite version {manifest.get('suite_version')!r} and format "
                            f"{manifest.get('format_version')!r}; this package has {SUITE_VERSION!r} and "
                            f"{FORMAT_VERSION!r}")
    files = manifest.get("files")
    if not isinstance(files, list) or not all(
            isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("sha256"), str)
            and len(e["sha256"]) == 64 for e in files):
        raise ManifestError(f"{path}: 'files' should be a list of {{'file': name, 'sha256': 64 hex digits}}")
    return manifest


def _differences(data, fresh):
    """``(note, max_rel_diff)``: which arrays of a stored file differ from the regenerated ones."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            if sum(i.file_size for i in zf.infolist()) > MAX_FILE_BYTES:
                return "its arrays would inflate past the size limit: not parsed", float("nan")
        stored = read_npz(data)
    except Exception as exc:  # a corrupt file is reported, not raised
        return f"not a readable .npz: {type(exc).__name__}", float("nan")
    bad, worst = [], 0.0
    for name in sorted(set(stored) | set(fresh)):
        a, b = stored.get(name), fresh.get(name)
        if a is None or b is None:
            bad.append(f"{name} {'extra' if b is None else 'missing'}")
            continue
        b = np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{name} shape/dtype")
            continue
        if a.tobytes() != np.ascontiguousarray(b).tobytes():
            n_bad = int(np.sum(a.reshape(-1).view(np.uint8).reshape(a.size, -1)
                               != np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(b.size, -1),
                               axis=-1).astype(bool).sum()) if a.size else 0
            bad.append(f"{name}: {n_bad} entries differ")
            if a.dtype.kind == "f":
                a64, b64 = a.astype(np.float64), b.astype(np.float64)
                fin = np.isfinite(a64) & np.isfinite(b64)
                scale = np.abs(b64[fin]).max(initial=0.0) or 1.0
                worst = max(worst, float(np.abs(a64[fin] - b64[fin]).max(initial=0.0)) / scale)
    return ("differs from the suite's definition: " + ", ".join(bad) if bad else "bytes differ"), worst


def read_npz(data: bytes) -> Dict[str, np.ndarray]:
    """Arrays of an ``.npz`` given as bytes (no pickles)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _npz_bytes(arrays: Dict[str, np.ndarray]) -> bytes:
    """An uncompressed ``.npz`` with fixed timestamps and entry order: the same bytes every time."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, arr in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_FIXED_TIME)
            info.external_attr = 0o644 << 16
            npy = io.BytesIO()
            np.lib.format.write_array(npy, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(info, npy.getvalue())
    return buf.getvalue()
