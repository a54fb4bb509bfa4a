"""Golden test vectors: the reference's answers as ``.npz`` files any language can read.

``write_vectors(out_dir, suite, dtype)`` writes one ``<case>.npz`` per case of
the suite and a ``manifest.json``. ``verify_vectors(out_dir)`` re-checks the
files against the manifest's SHA-256 hashes and, bit for bit, against a fresh
computation: every reference array is reproducible, so a set written on one
machine verifies on any other.

File format (``FORMAT_VERSION`` "1")
------------------------------------
Each ``.npz`` is an uncompressed zip of ``.npy`` arrays (readable by cnpy,
ndarray-npy, xtensor-io, numpy, ...), written byte-deterministically (fixed
entry order and timestamps), so the same suite, dtype and package version
give the same hashes:

``query, key, value``
    The inputs, in the vectors' dtype.
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
``naive_out``, ``naive_dq``, ``naive_dk``, ``naive_dv`` (``naive_dbias``)
    Only below float64: the reference computed *in* the vectors' dtype
    (``upcast=False``, ``precision="reproducible"``: every operation rounded
    to the dtype in a fixed order, the same bits everywhere), so that a test
    without Python can apply
    FlashAttention's relative rule ``max|impl - out| <= 2 max|naive_out -
    out| + atol`` (3x for gradients).
"""

from __future__ import annotations

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
from .cases import SUITE_VERSION, get_suite
from .conformance import grad_out_for

__all__ = ["FORMAT_VERSION", "write_vectors", "verify_vectors", "VerifyReport", "read_npz"]

FORMAT_VERSION = "1"
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def write_vectors(out_dir, suite: str = "quick", dtype: str = "float64",
                  progress: Optional[Callable[[int, int, str], None]] = None) -> dict:
    """Write ``<case>.npz`` files and ``manifest.json`` into ``out_dir``; return the manifest."""
    from .. import __version__

    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"`dtype` should be float16, float32 or float64, but got {dtype!r}")
    cases = get_suite(suite)                               # refuse a bad suite before touching the disk
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
        "reference": ("precision='reproducible': every float64 array faithfully rounded, every naive_* array "
                      "computed in the vectors' dtype in a fixed order; the same bits on every machine"),
        "tolerance_rule": {
            "float64": "element-wise |got - out| <= 1e-12 + 1e-12 * |out| (and the same for every gradient)",
            "below float64": ("FlashAttention's relative rule: max|got - out| <= 2 * max|naive_out - out| + atol "
                              "(3x for dq, dk, dv, dbias), atol = 2*max|fl(fl(out + 0.3) - 0.3) - out| in the "
                              "vectors' dtype"),
            "nan": "NaN must match NaN exactly (fully_masked='nan' cases)",
        },
        "files": files,
    }
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
    return manifest


def case_arrays(case, dt) -> Dict[str, np.ndarray]:
    """All arrays of one vector file, in the order they are written."""
    inp = case.make_inputs(dt)
    q, k, v = inp.pop("query"), inp.pop("key"), inp.pop("value")
    arrays: Dict[str, np.ndarray] = {"query": q, "key": k, "value": v}
    for name in ARRAY_OPTIONS:
        if name in inp:
            arrays[name] = np.asarray(inp.pop(name))
    opts = case.options_json()
    arrays["options_json"] = np.frombuffer(json.dumps(opts, sort_keys=True).encode("utf-8"), dtype=np.uint8)
    exp = expected(arrays, opts, dt, case)
    arrays.update(exp)
    return arrays


def expected(arrays, opts, dt, case=None, grad_out=None) -> Dict[str, np.ndarray]:
    """The reference's out, lse, grad_out, grads (float64) and, below float64, the naive ones."""
    kw = _options_kwargs(arrays, opts)
    q, k, v = arrays["query"], arrays["key"], arrays["value"]
    f64 = {n: (np.asarray(a, np.float64) if n in ("bias", "alibi_slopes") else a) for n, a in kw.items()}
    out, res = sdpa_forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                            precision="reproducible", **f64)
    g = grad_out if grad_out is not None else grad_out_for(case, out.shape, dt)
    gr = sdpa_backward(res, g.astype(np.float64))
    result = {"out": out, "lse": res.lse, "grad_out": g, "dq": gr.query, "dk": gr.key, "dv": gr.value}
    if gr.bias is not None:
        result["dbias"] = gr.bias
    if dt != np.dtype(np.float64):
        n_out, n_res = sdpa_forward(q, k, v, upcast=False, precision="reproducible", **kw)
        n_gr = sdpa_backward(n_res, g)
        result.update({"naive_out": n_out, "naive_dq": n_gr.query, "naive_dk": n_gr.key, "naive_dv": n_gr.value})
        if n_gr.bias is not None:
            result["naive_dbias"] = n_gr.bias
    return result


def _options_kwargs(arrays, opts):
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in opts.items() if k != "arrays"}
    for name in ARRAY_OPTIONS:
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


def verify_vectors(out_dir) -> VerifyReport:
    """Check every file's hash against the manifest and its contents, bit for bit, against a fresh computation.

    Every reference array is computed with ``precision="reproducible"``, so
    a fresh computation on any machine gives the same bits: an array that
    differs in one bit, anywhere, fails. ``max_rel_diff`` reports how far it
    is off, for the record.
    """
    rep = VerifyReport()
    mpath = os.path.join(out_dir, "manifest.json")
    try:
        with open(mpath, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        rep.problems.append(f"cannot read {mpath}: {exc}")
        return rep
    dt = np.dtype(manifest.get("dtype", "float64"))
    listed = set()
    for entry in manifest.get("files", []):
        fname = entry["file"]
        listed.add(fname)
        path = os.path.join(out_dir, fname)
        row = {"file": fname, "hash_ok": False, "recompute_ok": False, "max_rel_diff": float("nan"), "ok": False}
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            row["note"] = f"missing: {exc}"
            rep.rows.append(row)
            continue
        row["hash_ok"] = hashlib.sha256(data).hexdigest() == entry["sha256"]
        try:
            arrays = read_npz(data)
            opts = json.loads(bytes(arrays["options_json"]).decode("utf-8"))
            fresh = expected(arrays, opts, dt, grad_out=arrays["grad_out"])
            worst = 0.0
            for name, val in fresh.items():
                if name == "grad_out":
                    continue
                stored, val = arrays[name], np.asarray(val)
                if stored.shape != val.shape or stored.dtype != val.dtype:
                    raise ValueError(f"{name}: shape or dtype differs from a fresh computation")
                s64, v64 = stored.astype(np.float64), val.astype(np.float64)
                fin = np.isfinite(s64) & np.isfinite(v64)
                scale = np.abs(v64[fin]).max(initial=0.0) or 1.0
                worst = max(worst, float(np.abs(s64[fin] - v64[fin]).max(initial=0.0)) / scale)
                if not np.array_equal(stored, val, equal_nan=True):
                    n_bad = int(np.sum(~((stored == val) | (np.isnan(s64) & np.isnan(v64)))))
                    raise ValueError(f"{name}: {n_bad} entries differ from a fresh computation "
                                     f"(by up to {worst:.3e} relative)")
            row["recompute_ok"] = True
            row["max_rel_diff"] = worst
        except Exception as exc:  # a corrupt file is reported, not raised
            row["note"] = f"{type(exc).__name__}: {exc}"
        row["ok"] = row["hash_ok"] and row["recompute_ok"]
        if not row["hash_ok"]:
            row["note"] = ("sha256 differs from the manifest; " + row.get("note", "")).rstrip("; ")
        rep.rows.append(row)
    extra = sorted(f for f in os.listdir(out_dir) if f.endswith(".npz") and f not in listed)
    for f in extra:
        rep.problems.append(f"{f} is not listed in the manifest")
    return rep


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
