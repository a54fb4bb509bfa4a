"""The C client in examples/c (issue 13 part 4, issue 21 part 2).

It judges the golden vectors' output and gradients and catches a wrong kernel; built with AddressSanitizer
and UBSan it survives a seeded mutational fuzzer over valid vector sets (no sanitizer report, no hang, exit
status 0, 1, 2 or 3, and on 2 exactly one line on stderr) and every regression file in
tests/data/c_regressions (one per defect class the client had: each refused with exit status 2).

SDPA_REF_FUZZ_N sets the number of mutations (default 300; CI's step 5b runs a few thousand). The fuzzer also
runs by hand against any build, e.g. an old revision's client, and counts what it finds:

    python tests/test_examples_c_client.py --exe path/to/sdpa_check_asan -n 3000
"""

import argparse
import collections
import concurrent.futures
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from sdpa_ref.harness import vectors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "examples", "c", "sdpa_check.c")
REGRESSIONS = sorted(glob.glob(os.path.join(ROOT, "tests", "data", "c_regressions", "*.json")))
CC = os.environ.get("CC") or "cc"
WARN_FLAGS = ["-std=c99", "-O1", "-Wall", "-Wextra", "-pedantic"]      # CI's step 5 builds it at -O2
SAN_FLAGS = ["-std=c99", "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
             "-fno-sanitize-recover=undefined"]
# a sanitizer report is a recognisable exit status (not 1, the client's "failed") and its text on stderr
SAN_ENV = {"ASAN_OPTIONS": "detect_leaks=1:exitcode=99:allocator_may_return_null=0",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=98"}
SAN_MARKERS = ("AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer", "runtime error")
FUZZ_N = int(os.environ.get("SDPA_REF_FUZZ_N", "300"))
FUZZ_SEED = int(os.environ.get("SDPA_REF_FUZZ_SEED", "21"))
RUN_TIMEOUT = 30.0                      # seconds per run of the client; a mutant's run takes well under one
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed, (\d+) skipped(: nothing judged)?$")

# one worker runs the module (setup.cfg: --dist loadgroup): its builds and vector sets are made once, not once per
# worker (about 11 s of each worker's time)
pytestmark = [pytest.mark.skipif(shutil.which(CC) is None or not os.path.exists(SOURCE),
                                 reason="no C compiler here (CI has one)"),
              pytest.mark.xdist_group("c_client")]


def _have_lowp():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------ building and running

def build(out, flags, defines=()):
    """The client compiled with ``flags`` into ``out``; (path, compiler's stderr)."""
    cp = subprocess.run([CC, *flags, *(f"-D{d}" for d in defines), "-o", str(out), SOURCE, "-lm"],
                        capture_output=True, text=True)
    if cp.returncode != 0:
        raise RuntimeError(cp.stderr)
    return str(out), cp.stderr


def run(exe, folder, *args, timeout=RUN_TIMEOUT, env=None):
    """``CompletedProcess`` (stdout and stderr as text), or None when it ran past ``timeout``; the sanitizers'
    options are set (and ignored by a build without them), and ``env``'s variables."""
    try:
        cp = subprocess.run([exe, *args, str(folder)], capture_output=True, timeout=timeout,
                            env=dict(os.environ, **SAN_ENV, **(env or {})))
    except subprocess.TimeoutExpired:
        return None
    cp.stdout = cp.stdout.decode("utf-8", "replace")
    cp.stderr = cp.stderr.decode("utf-8", "replace")
    return cp


def contract_problem(cp):
    """What a run did against the contract, or None: no sanitizer report, no hang, exit status 0 to 3, one
    stderr line naming the file on 2 and none otherwise, and then the summary line last."""
    if cp is None:
        return "hang: no exit within the time limit"
    if any(m in cp.stderr for m in SAN_MARKERS):
        return "sanitizer report"
    if cp.returncode not in (0, 1, 2, 3):
        return f"exit status {cp.returncode}"
    lines = cp.stderr.splitlines()
    if cp.returncode == 2:
        if len(lines) != 1 or not lines[0].startswith("sdpa_check: "):
            return f"exit status 2 with {len(lines)} stderr lines, not one"
        return None
    if lines:
        return "stderr written on a verdict"
    out = cp.stdout.splitlines()
    m = SUMMARY.match(out[-1]) if out else None
    if not m or (cp.returncode == 3) != bool(m.group(4)) or (cp.returncode == 1) != (int(m.group(2)) > 0):
        return "no summary line agreeing with the exit status"
    return None


# ------------------------------------------------------------------ vector sets and their bytes

class Base:
    """A valid vector set: its manifest and files, read once."""

    def __init__(self, path, dtype):
        self.path, self.dtype = str(path), dtype
        with open(os.path.join(self.path, "manifest.json"), encoding="utf-8") as fh:
            self.manifest = json.load(fh)
        self.names = [e["file"] for e in self.manifest["files"]]
        self._blobs = {}

    def fuzz_names(self):
        """The cases the fuzzer mutates: the smaller three quarters (the time goes to the sanitizers), and the
        case with every option."""
        if not hasattr(self, "_fuzz"):
            small = sorted(self.names, key=lambda f: len(self.blob(f)))[:max(1, 3 * len(self.names) // 4)]
            self._fuzz = [n for n in self.names if n in small or n.startswith("all-")]
        return self._fuzz

    def blob(self, name):
        if name not in self._blobs:
            with open(os.path.join(self.path, name), "rb") as fh:
                self._blobs[name] = fh.read()
        return self._blobs[name]


def write_base(folder, dtype):
    vectors.write_vectors(str(folder), "quick", dtype)
    return Base(folder, dtype)


def write_layout_base(folder, dtype, layout):
    vectors.write_vectors(str(folder), "quick", dtype, layout=layout)
    return Base(folder, dtype)


def write_sinks_base(folder, dtype):
    from sdpa_ref.harness.cases import get_suite
    vectors.write_vectors(str(folder), dtype=dtype, cases=[c for c in get_suite("full") if "sinks" in c.arrays])
    return Base(folder, dtype)


def zip_members(data):
    """``[(name, header offset, data offset, data size)]`` of the stored entries, by their local headers."""
    out, at = [], 0
    while at + 30 <= len(data) and data[at:at + 4] == b"PK\x03\x04":
        size = int.from_bytes(data[at + 18:at + 22], "little")
        nlen = int.from_bytes(data[at + 26:at + 28], "little")
        xlen = int.from_bytes(data[at + 28:at + 30], "little")
        d = at + 30 + nlen + xlen
        out.append((data[at + 30:at + 30 + nlen].decode("latin-1"), at, d, size))
        at = d + size
    return out


def member(data, name):
    for m in zip_members(data):
        if m[0] == name:
            return m
    raise KeyError(name)


def edit_npy_header(data, name, edit):
    """``data`` with member ``name``'s .npy header text replaced by ``edit(text)``: padded back to its length with
    spaces when it fits (every offset stays), else the entry grows and its zip sizes follow."""
    _, h, d, size = member(data, name)
    hl = int.from_bytes(data[d + 8:d + 10], "little")
    text = data[d + 10:d + 10 + hl].decode("latin-1")
    new = edit(text).encode("latin-1")
    if len(new) <= hl:
        body = new.rstrip(b"\n").ljust(hl - 1) + b"\n" if new.endswith(b"\n") else new.ljust(hl)
        return data[:d + 10] + body + data[d + 10 + hl:]
    grow = len(new) - hl
    out = bytearray(data[:d + 10] + new + data[d + 10 + hl:])
    out[d + 8:d + 10] = min(len(new), 0xFFFF).to_bytes(2, "little")
    out[h + 18:h + 22] = out[h + 22:h + 26] = ((size + grow) & 0xFFFFFFFF).to_bytes(4, "little")
    return bytes(out)


def repack(data, change):
    """The .npz ``data`` read, ``change(arrays)`` applied to the dict, and written back (byte-deterministic)."""
    arrays = vectors.read_npz(data)
    change(arrays)
    return vectors._npz_bytes(arrays)


def materialize(base, out, files, manifest):
    """The folder ``out``: the manifest (a dict, raw bytes or a special) and ``files`` (name -> bytes, or a
    special: ("fifo",), ("dir",), ("symlink", target), ("absent",)); unchanged files are hard links."""
    os.makedirs(out)
    for name, content in files.items():
        path = os.path.join(out, name)
        if isinstance(content, tuple):
            special(path, content)
        elif content is base._blobs.get(name):
            try:
                os.link(os.path.join(base.path, name), path)
            except OSError:
                shutil.copyfile(os.path.join(base.path, name), path)
        else:
            with open(path, "wb") as fh:
                fh.write(content)
    mpath = os.path.join(out, "manifest.json")
    if isinstance(manifest, tuple):
        special(mpath, manifest)
    else:
        with open(mpath, "wb") as fh:
            fh.write(manifest if isinstance(manifest, bytes) else
                     (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def special(path, what):
    kind = what[0]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    elif kind == "symlink":
        os.symlink(what[1], path)
    elif kind != "absent":
        raise ValueError(kind)


# ------------------------------------------------------------------ the mutations

BIG = [0, 1, 2, 3, 7, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 1,
       2**63, 2**64 - 1, 2**64, 10**30]
JSON_VALUES = ["true", "false", "null", "0", "-1", "1", "2", "2.5", "-0.0", "1e308", "1e400", "-1e400", "1e-400",
               "123456789012345678901234567890", '"nan"', '"inf"', "[]", "[1]", "[1, 2, 3]", "[null, null]",
               "[-2, 0]", "[-1, -1]", "[4611686018427387904, 0]", "[9223372036854775808, 0]", "[1.5, 0]", "{}",
               '{"a": 1}', '"top_left"', '"bottom_right"', '"zero"', '"nan"', '"uniform"', '"bogus"', '""',
               '"' + "x" * 300 + '"', '"\\u0041"', '"\\q"', "[" * 200 + "]" * 200, "[" * 40, '"unterminated']
OPTION_KEYS = ["is_causal", "enable_gqa", "causal_alignment", "window", "softcap", "scale", "fully_masked",
               "dropout_p", "arrays", "future_option"]
NAMES = ["x", "", ".npz", "a.npz", "x.npy", "npz", "../{n}", "/{n}", "sub/{n}", "{n}/", "\\u0041{n}", "{n}\\n",
         "y" * 300 + ".npz", "{n}.npz", " {n}", "{n}\\u0000.npz"]


def _shape_variants(rng, dims):
    dims = list(dims)
    pick = rng.randrange(9)
    if pick == 0 and dims:
        dims[rng.randrange(len(dims))] = rng.choice(BIG)
    elif pick == 1 and dims:
        i = rng.randrange(len(dims))
        dims[i] = max(0, dims[i] + rng.choice([-1, 1, dims[i]]))
    elif pick == 2:
        dims = [1] * rng.randint(1, 8) + dims
    elif pick == 3 and dims:
        del dims[rng.randrange(len(dims))]
    elif pick == 4:
        return rng.choice(["()", "(,)", "(2, , 8)", "(-1, 2)", "(2 2)", "(2, 2", "2, 2)", "(0x10,)", "(1e3,)",
                           "(2,)(3,)", "(" + "9" * 40 + ",)", "(" + ", ".join(["1"] * 12) + ")"])
    elif pick == 5 and dims:
        dims[rng.randrange(len(dims))] = 0
    elif pick == 6:
        dims = [d * 2 for d in dims]
    elif pick == 7 and len(dims) > 1:
        rng.shuffle(dims)
    else:
        dims = dims + [rng.choice([1, 2, 8])]
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def mut_flip(rng, base, target, files, manifest):
    data = bytearray(files[target])
    members = zip_members(data)
    n = rng.choice([1, 1, 2, 4, 8])
    for _ in range(n):
        if members and rng.random() < 0.7:          # mostly in a zip or npy header
            _, h, d, _ = rng.choice(members)
            pos = rng.randrange(h, min(len(data), d + 128))
        else:
            pos = rng.randrange(len(data))
        data[pos] = rng.randrange(256) if rng.random() < 0.5 else data[pos] ^ (1 << rng.randrange(8))
    files[target] = bytes(data)
    return f"{n} bytes changed"


def mut_truncate(rng, base, target, files, manifest):
    data = files[target]
    points = [p for m in zip_members(data) for p in (m[1], m[1] + 30, m[2], m[2] + 10, m[2] + m[3])]
    cut = max(0, rng.choice(points) + rng.randint(-3, 3)) if rng.random() < 0.6 else rng.randrange(len(data))
    files[target] = data[:cut]
    return f"truncated to {cut} bytes"


def mut_extend(rng, base, target, files, manifest):
    data = files[target]
    members = zip_members(data)
    pick = rng.randrange(4)
    if pick == 0:
        files[target] = data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        return "random bytes appended"
    if pick == 1:
        _, h, d, size = rng.choice(members)
        files[target] = data[:members[-1][2] + members[-1][3]] + data[h:d + size] + data[members[-1][2] +
                                                                                          members[-1][3]:]
        return "an entry repeated after the last"
    if pick == 2:
        pos = rng.randrange(len(data))
        files[target] = data[:pos] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + data[pos:]
        return f"bytes inserted at {pos}"
    files[target] = data + b"PK\x03\x04" + bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    return "a cut-short local header appended"


ZIP_FIELDS = {"flags": (6, 2), "method": (8, 2), "csize": (18, 4), "usize": (22, 4), "nlen": (26, 2),
              "xlen": (28, 2)}


def mut_zip_field(rng, base, target, files, manifest):
    data = bytearray(files[target])
    name, h, d, size = rng.choice(zip_members(data))
    if rng.random() < 0.25:                         # a zip64 entry: sizes 0xFFFFFFFF and an extra field
        usize = size if rng.random() < 0.5 else rng.choice(BIG) % 2**64
        csize = usize if rng.random() < 0.7 else rng.choice(BIG) % 2**64
        extra = (1).to_bytes(2, "little") + rng.choice([16, 8, 20, 0xFFFF]).to_bytes(2, "little") + \
            usize.to_bytes(8, "little") + csize.to_bytes(8, "little")
        nlen = int.from_bytes(data[h + 26:h + 28], "little")
        head = bytearray(data[h:h + 30 + nlen])
        head[18:26] = b"\xff" * 8
        head[28:30] = len(extra).to_bytes(2, "little")
        files[target] = bytes(data[:h] + head + extra + data[d:])
        return f"{name}: zip64 sizes {usize}, {csize}"
    field = rng.choice(sorted(ZIP_FIELDS))
    off, width = ZIP_FIELDS[field]
    cur = int.from_bytes(data[h + off:h + off + width], "little")
    value = rng.choice([0, 1, cur - 1, cur + 1, 2 * cur, cur + 4096, 2**(8 * width) - 1, rng.randrange(2**(8 * width))])
    data[h + off:h + off + width] = (value % 2**(8 * width)).to_bytes(width, "little")
    files[target] = bytes(data)
    return f"{name}: zip {field} {cur} -> {value % 2**(8 * width)}"


DESCRS = ["<f8", "<f4", "<f2", "|b1", "|u1", "<u2", "<i8", "<i4", ">f8", "<c16", "|O", "<U5", "|V8", "<f16", "",
          "<f8' ", "f8", "<i2", "|i1", "<u8"]


def mut_npy_header(rng, base, target, files, manifest):
    data = files[target]
    name, h, d, size = rng.choice(zip_members(data))
    pick = rng.randrange(7)
    if pick <= 2:
        m = re.search(r"'shape': \(([^)]*)\)", data[d + 10:d + 10 + 200].decode("latin-1"))
        dims = [int(x) for x in m.group(1).split(",") if x.strip()] if m else []
        new = _shape_variants(rng, dims)
        files[target] = edit_npy_header(data, name, lambda t: re.sub(r"'shape': \([^)]*\)", "'shape': " + new, t))
        return f"{name}: shape -> {new}"
    if pick == 3:
        new = rng.choice(DESCRS)
        files[target] = edit_npy_header(data, name, lambda t: re.sub(r"'descr': '[^']*'", f"'descr': '{new}'", t))
        return f"{name}: descr -> {new!r}"
    if pick == 4:
        new = rng.choice(["True", "0", "Flase", "None", ""])
        files[target] = edit_npy_header(data, name, lambda t: t.replace("False", new))
        return f"{name}: fortran_order -> {new!r}"
    if pick == 5:
        out = bytearray(data)
        if rng.random() < 0.5:
            out[d + 6] = rng.choice([0, 2, 3, 4, 255])
            what = f"version {out[d + 6]}"
        else:
            value = rng.choice([0, 1, 9, 0xFFFF, int.from_bytes(out[d + 8:d + 10], "little") + rng.choice([-1, 1, 64])])
            out[d + 8:d + 10] = (value % 65536).to_bytes(2, "little")
            what = f"header length {value % 65536}"
        files[target] = bytes(out)
        return f"{name}: {what}"

    def syntax(t):
        i = rng.randrange(len(t))
        return rng.choice([t[:i] + t[i + 1:], t[:i] + rng.choice("{}(),:'\"\\ 0x\n") + t[i:],
                           t.replace("'", '"'), t.replace("}", ""), t.replace(", }", ", 'extra': 1, }"),
                           t.replace("{", "{'descr': '<f8', ", 1), "{" + "(" * 100])
    files[target] = edit_npy_header(data, name, syntax)
    return f"{name}: header syntax"


def mut_options(rng, base, target, files, manifest):
    arrays = vectors.read_npz(files[target])
    opts = json.loads(bytes(arrays["options_json"]).decode("utf-8"))
    pick = rng.randrange(4)
    if pick <= 1:
        key, value = rng.choice(OPTION_KEYS), rng.choice(JSON_VALUES)
        opts[key] = "@@"
        text = json.dumps(opts, sort_keys=True).replace('"@@"', value)
        what = f"{key} = {value[:40]}"
    else:
        text = json.dumps(opts, sort_keys=True)
        i = rng.randrange(len(text) + 1)
        text = rng.choice([text[:i], text[:i] + rng.choice(['"', "{", "}", "[", ",", ":", "\\", "\x00", "\x01",
                                                             "\u00e9", "-", "1e"]) + text[i:],
                           text[:i] + text[i + 1:], " " * 5 + text + " x", "[" + text + "]", ""])
        what = "text edited"
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    files[target] = repack(files[target], lambda a: a.__setitem__("options_json", raw))
    return f"options_json: {what}"


def mut_arrays(rng, base, target, files, manifest):
    with np.errstate(all="ignore"):
        return _mut_arrays(rng, files, target)


def _mut_arrays(rng, files, target):
    arrays = vectors.read_npz(files[target])
    names = list(arrays)
    name = rng.choice(names)
    a = arrays[name]
    pick = rng.randrange(10)
    if pick == 0:
        del arrays[name]
        what = "removed"
    elif pick == 1:
        shape = list(a.shape)
        if shape:
            i = rng.randrange(len(shape))
            shape[i] = rng.choice([0, 1, shape[i] + 1, max(0, shape[i] - 1), 2 * shape[i] + 1])
        arrays[name] = np.zeros(shape, a.dtype)
        what = f"zeros of shape {tuple(shape)}"
    elif pick == 2:
        k = rng.randint(1, 7)
        arrays[name] = a.reshape((1,) * k + a.shape)
        what = f"{k} leading dims added"
    elif pick == 3:
        dt = rng.choice([np.float64, np.float32, np.float16, np.bool_, np.uint8, np.uint16, np.int64, np.int32])
        arrays[name] = a.astype(dt) if a.dtype.kind != "b" or dt != np.uint16 else a.astype(np.uint8).astype(dt)
        what = f"as {np.dtype(dt).name}"
    elif pick == 4 and a.size:
        b = a.astype(np.float64).copy() if a.dtype.kind == "f" else a.copy()
        v = rng.choice([np.nan, np.inf, -np.inf, 1e308, -1, 0]) if b.dtype.kind == "f" else \
            rng.choice([-1, 0, 1, 255, 2**15, 2**31, 2**62]) if b.dtype.kind in "iu" else True
        try:
            b.flat[rng.randrange(b.size)] = v
        except (OverflowError, ValueError):
            pass
        arrays[name] = b.astype(a.dtype) if a.dtype.kind != "f" else b.astype(a.dtype)
        what = f"an entry set to {v}"
    elif pick == 5:                                 # the heads of key and value, together
        H = rng.choice([0, 1, 3, 8])
        for n in ("key", "value"):
            s = list(arrays[n].shape)
            if len(s) >= 3:
                s[-3] = H
                arrays[n] = np.zeros(s, arrays[n].dtype)
        what = f"key and value with {H} heads"
    elif pick == 6:
        n = rng.choice(["query", "key", "value", "out", "grad_out"])
        arrays[n] = arrays[n].reshape(arrays[n].shape[-2:]) if arrays[n].ndim >= 2 and \
            np.prod(arrays[n].shape[:-2]) == 1 else arrays[n].reshape(-1)[:rng.choice([0, 1, 5])]
        name, what = n, "rank changed"
    elif pick == 7:
        extra = rng.choice(["attn_mask", "bias", "dropout_mask", "q_lengths", "kv_lengths", "alibi_slopes",
                            "q_descale", "k_descale", "v_descale", "dbias", "future", "honest_dq", "lse"])
        shape = rng.choice([(), (1,), (2,), (4,), (2, 2), (2, 2, 8, 8), (1, 1, 1, 1, 1, 1, 1, 2)])
        arrays[extra] = np.ones(shape, rng.choice([np.float64, np.bool_, np.int64, np.float32]))
        name, what = extra, f"added, shape {shape}"
    elif pick == 8 and a.dtype.kind in "iu" and a.size:
        b = a.copy()
        b.flat[0] = rng.choice([-1, 2**31, 2**62, 10**6]) if a.dtype.kind == "i" else 255
        arrays[name] = b
        what = "a large or negative entry"
    else:
        q = arrays["query"]
        s = list(q.shape)
        if len(s) >= 3:
            s[-3] = rng.choice([0, 1, 3, 6])
            arrays["query"] = np.zeros(s, q.dtype)
        name, what = "query", f"heads -> {s[-3] if len(s) >= 3 else '?'}"
    files[target] = vectors._npz_bytes(arrays)
    return f"array {name}: {what}"


def mut_manifest(rng, base, target, files, manifest):
    pick = rng.randrange(8)
    if pick == 0:
        manifest["dtype" if rng.random() < 0.6 else "output_dtype"] = rng.choice(
            ["float128", "", 5, None, "float32", "bfloat16", "float8_e5m2", "float64", ["float32"]])
        return f"dtype {manifest.get('dtype')!r}, output_dtype {manifest.get('output_dtype')!r}"
    if pick == 1:
        manifest["relative_rule"] = rng.choice([{}, {"k_out": 0}, {"k_out": -3, "k_grad": 3}, {"k_out": "3"},
                                                {"k_grad": 0, "k_out": 3}, [], None, {"k_out": 1e300},
                                                {"k_out": 3, "k_grad": 3, "x": {"y": [1, 2]}}])
        return f"relative_rule {manifest['relative_rule']!r}"
    if pick == 2:
        manifest["files"] = rng.choice([[], {}, "x", [1], [{}], [{"file": 5}], [{"file": None}], None,
                                        manifest["files"] * 2])
        return f"files {str(manifest['files'])[:60]}"
    if pick == 3:                                   # another name, and the file under it where it is plain
        new = rng.choice(NAMES).replace("{n}", target[:-4] if rng.random() < 0.5 else target)
        text = json.dumps(manifest, indent=2, sort_keys=True).replace(f'"file": "{target}"',
                                                                      '"file": "' + new.replace('"', "") + '"')
        plain = new and "/" not in new and "\\" not in new and new not in (".", "..") and len(new) < 256
        if plain:
            files[new] = files.pop(target)
        manifest.clear()
        manifest["__raw__"] = text.encode("utf-8")
        return f"file named {new!r}"
    if pick == 4:
        del manifest[rng.choice(["dtype", "files", "relative_rule", "output_dtype"])]
        return "a key removed"
    text = json.dumps(manifest, indent=2, sort_keys=True).encode("utf-8")
    if pick == 5:
        data = bytearray(text)
        for _ in range(rng.choice([1, 2, 8])):
            data[rng.randrange(len(data))] = rng.randrange(256)
        text, what = bytes(data), "bytes changed"
    elif pick == 6:
        text, what = text[:rng.randrange(len(text))], "truncated"
    else:
        i = rng.randrange(len(text))
        text = text[:i] + rng.choice([b"[" * 1000, b"{" * 50, b"\x00", b'"', b"\xef\xbb\xbf", b"1" * 200,
                                      b'"file": "x", ', b"\\", b"\xff\xfe"]) + text[i:]
        what = "bytes inserted"
    manifest.clear()
    manifest["__raw__"] = text
    return f"manifest {what}"


def mut_special(rng, base, target, files, manifest):
    kind = rng.choice(["fifo", "dir", "symlink", "dead symlink", "absent", "empty", "devnull"])
    spec = {"fifo": ("fifo",), "dir": ("dir",), "symlink": ("symlink", os.path.join(base.path, target)),
            "dead symlink": ("symlink", "nowhere.npz"), "absent": ("absent",), "empty": b"",
            "devnull": ("symlink", os.devnull)}[kind]
    if rng.random() < 0.2:
        manifest["__special__"] = spec if kind != "empty" else b""
        return f"manifest.json is {kind}"
    files[target] = spec
    return f"the case file is {kind}"


OPTION_ARRAYS = {"attn_mask": np.bool_, "bias": np.float64, "dropout_mask": np.bool_, "q_lengths": np.int64,
                 "kv_lengths": np.int64, "alibi_slopes": np.float64}


def mut_cross(rng, base, target, files, manifest):
    """A well-formed file whose shapes or lengths disagree with each other (or just agree): what only the checks
    of shapes against shapes stop before the kernels index with them."""
    with np.errstate(all="ignore"):
        arrays = vectors.read_npz(files[target])
        q, k = arrays["query"], arrays["key"]
        if q.ndim < 2 or k.ndim < 2:
            raise ValueError("rank")
        scores = list(arrays["out"].shape[:-1]) + [k.shape[-2]]
        batch = scores[:-3]
        name = rng.choice(sorted(OPTION_ARRAYS) + ["q_descale", "k_descale", "v_descale", "query", "key", "value"])
        if name in ("q_lengths", "kv_lengths"):
            shape = rng.choice([batch, batch[1:], [1] * len(batch), batch + [1], [2] + batch, batch[:-1] + [3]])
            limit = scores[-2] if name == "q_lengths" else scores[-1]
            values = rng.choice([[0], [limit], [limit + 1], [-1], [2**31], [2**62], [limit, 0]])
            a = np.resize(np.array(values, np.int64), shape)
        else:
            like = scores if name in OPTION_ARRAYS else list(arrays[name].shape) if name in arrays else batch + [2]
            if name == "alibi_slopes":
                like = batch + [scores[-3]]
            shape = list(like)
            pick = rng.randrange(8)
            if pick <= 2 and shape:                 # a dim that does not match (more often one short)
                i = rng.randrange(len(shape))
                shape[i] += rng.choice([-1, -1, 1, 2]) if shape[i] > 1 else rng.choice([0, 1]) - shape[i] + 1
            elif pick == 3:                         # more dims, the first not 1
                shape = [rng.choice([2, 3])] + [1] * rng.randint(0, 4) + shape
            elif pick == 4 and shape:               # broadcast: leading dims dropped, others 1 (valid)
                shape = [d if rng.random() < 0.5 else 1 for d in shape[rng.randrange(len(shape)):]]
            elif pick == 5 and len(shape) > 1:
                shape = shape[::-1]
            elif pick == 6:
                shape = [rng.choice([0, 1, 2, 3, 9])] * rng.randint(0, 5)
            dt = OPTION_ARRAYS.get(name, np.float64 if name.endswith("descale") else arrays[name].dtype
                                   if name in arrays else np.float64)
            a = np.ones(shape, dt)
        arrays[name] = a
        if name.endswith("descale") and rng.random() < 0.7:      # all three, or the kernels never see one
            for d in ("q_descale", "k_descale", "v_descale"):
                arrays.setdefault(d, a)
        files[target] = vectors._npz_bytes(arrays)
        return f"array {name}: shape {tuple(a.shape)}"


MUTATIONS = [(mut_flip, 10), (mut_truncate, 5), (mut_extend, 3), (mut_zip_field, 8), (mut_npy_header, 16),
             (mut_options, 8), (mut_arrays, 14), (mut_cross, 26), (mut_manifest, 8), (mut_special, 2)]


def make_mutant(seed, bases, out):
    """Mutant number ``seed`` of the sets ``bases`` written to the folder ``out``; its description."""
    rng = random.Random(seed)
    base = bases[rng.choice(sorted(bases))]
    names = base.fuzz_names()
    target = rng.choice(names)
    others = [n for n in names if n != target]
    listed = [target] + rng.sample(others, k=min(len(others), rng.choice([0, 0, 1, 2])))
    files = {n: base.blob(n) for n in listed}
    manifest = dict(base.manifest, files=[e for e in base.manifest["files"] if e["file"] in listed])
    funcs, weights = zip(*MUTATIONS)
    descs = []
    for _ in range(1 if rng.random() < 0.85 else rng.randint(2, 3)):
        f = rng.choices(funcs, weights)[0]
        if (f not in (mut_manifest, mut_special) and not isinstance(files.get(target), bytes)) or \
                "__raw__" in manifest or "__special__" in manifest:
            continue
        try:
            descs.append(f(rng, base, target, files, manifest))
        except Exception as exc:                    # noqa: BLE001 -- numpy cannot read what an earlier one left
            descs.append(f"{f.__name__} not applied ({type(exc).__name__})")
    m = manifest.get("__special__", manifest.get("__raw__", manifest))
    materialize(base, out, files, m)
    return f"seed {seed}: {base.dtype} {target}: " + "; ".join(descs)


def fuzz(exe, bases, n, seed, workdir, timeout=RUN_TIMEOUT, workers=None):
    """Run ``n`` mutants; ``[(description, problem, CompletedProcess or None)]`` of each run."""
    def one(i):
        out = os.path.join(workdir, f"m{i}")
        try:
            desc = make_mutant(seed * 1_000_003 + i, bases, out)
            cp = run(exe, out, timeout=timeout)
            return desc, contract_problem(cp), cp
        finally:
            shutil.rmtree(out, ignore_errors=True)
    for base in bases.values():
        base.fuzz_names()                           # every file read before the threads start
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(n)))


# ------------------------------------------------------------------ the regression files

def apply_recipe(recipe, base, out):
    """The folder ``out`` for a regression recipe: the case alone in the manifest, with the recipe's edits."""
    case = recipe["case"]
    if case not in base.names:
        raise AssertionError(f"the case {case} of the regression is no longer in the quick suite")
    files = {case: base.blob(case)}
    manifest = dict(base.manifest, files=[e for e in base.manifest["files"] if e["file"] == case])
    for e in recipe["edits"]:
        op = e["op"]
        if op == "npy_header":
            files[case] = edit_npy_header(files[case], e["member"], lambda t, e=e: t.replace(e["find"], e["replace"]))
        elif op == "array":                         # zeros of a shape, in the array's dtype or "dtype"
            files[case] = repack(files[case], lambda a, e=e: a.__setitem__(
                e["name"], np.zeros(e["shape"], e.get("dtype") or a[e["name"]].dtype)))
        elif op == "list_as":
            files = {e["name"]: files[case]}
            manifest["files"] = [dict(manifest["files"][0], file=e["name"])]
        elif op == "special":                       # fifo, dir, absent, or a symlink to the valid case file
            files[case] = ("symlink", os.path.join(base.path, case)) if e["kind"] == "symlink" else (e["kind"],)
        else:
            raise ValueError(op)
    materialize(base, out, files, manifest)


# ------------------------------------------------------------------ fixtures

BREAKS = {1: "out", 2: "dq", 3: "dk", 4: "dv", 5: "dbias", 8: "lse"}   # -DSDPA_CHECK_BREAK=n: that one 1% off
SINK_BREAKS = {6: "dsinks", 7: "out"}                            # dsinks 1% off; the sink forgotten (out fails)
LAYOUT_BREAK = 9                                                 # a layout kernel that reads its keys one off
GATHER_BREAK = 10                                                # a sparse kernel that ignores its indices


@pytest.fixture(scope="module")
def exes(tmp_path_factory):
    """Every build the tests use, compiled in the background (while the vectors are written): name -> future of
    its path (or of the RuntimeError of its compiler)."""
    d = tmp_path_factory.mktemp("c")
    jobs = {"asan": (SAN_FLAGS, ()), "plain": (WARN_FLAGS, ()),
            "no_backward": (["-std=c99", "-O0"], ["SDPA_CHECK_NO_BACKWARD"]),
            "no_lse": (["-std=c99", "-O0"], ["SDPA_CHECK_NO_LSE"])}
    # the wrong kernels: one build reads which from SDPA_CHECK_BREAK (-DSDPA_CHECK_BREAK_ENV), and the layout's
    # is also built as the docs say, -DSDPA_CHECK_BREAK=9
    jobs.update({"broken": (["-std=c99", "-O0"], ["SDPA_CHECK_BREAK_ENV"]),
                 f"break{LAYOUT_BREAK}": (["-std=c99", "-O0"], [f"SDPA_CHECK_BREAK={LAYOUT_BREAK}"])})

    def one(name):
        try:
            return build(d / name, *jobs[name])[0]
        except RuntimeError as exc:
            return exc
    pool = concurrent.futures.ThreadPoolExecutor(2)
    yield {name: pool.submit(one, name) for name in jobs}
    pool.shutdown()


def _broken(exes, n):
    """``(path, env)``: the build of the tests' wrong kernels and the environment that makes it wrong kernel n."""
    return _exe(exes, "broken"), {"SDPA_CHECK_BREAK": str(n)}


def _exe(exes, name):
    exe = exes[name].result()
    if isinstance(exe, Exception):
        raise exe
    return exe


@pytest.fixture(scope="module")
def client(exes):
    return _exe(exes, "plain")


@pytest.fixture(scope="module")
def asan_client(exes, tmp_path_factory):
    """The client under AddressSanitizer and UBSan, or a skip where the compiler lacks them."""
    exe = exes["asan"].result()
    if isinstance(exe, Exception):
        pytest.skip(f"{CC} cannot build with -fsanitize=address,undefined: {str(exe)[:200]}")
    cp = run(exe, tmp_path_factory.mktemp("empty"), "--help")
    if cp is not None and "LeakSanitizer has encountered a fatal error" in cp.stderr:
        SAN_ENV["ASAN_OPTIONS"] = SAN_ENV["ASAN_OPTIONS"].replace("detect_leaks=1", "detect_leaks=0")
        cp = run(exe, tmp_path_factory.mktemp("empty"), "--help")   # LeakSanitizer cannot run here (ptrace)
    if cp is None or cp.returncode != 0:
        pytest.skip(f"the sanitizer build does not run here: {'' if cp is None else cp.stderr[:300]}")
    return exe


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Quick vector sets: float64 and float32, and bfloat16 and float8_e4m3fn where ml_dtypes is."""
    dtypes = ["float64", "float32"] + (["bfloat16", "float8_e4m3fn"] if _have_lowp() else [])
    root = tmp_path_factory.mktemp("vectors")
    out = {dt: write_base(root / dt, dt) for dt in dtypes}
    out["sinks-float32"] = write_sinks_base(root / "sinks", "float32")   # the full suite's cases with sinks
    for layout in ("thd", "paged", "thd_paged", "gathered"):            # as varlen, paged, sparse kernels take them
        out[f"{layout}-float32"] = write_layout_base(root / layout, "float32", layout)
    return out


def small_set(base, out, n=16):
    """The ``n`` smallest cases of ``base`` (and those with a bias), hard-linked into the folder ``out``."""
    names = sorted(base.names, key=lambda f: len(base.blob(f)))[:n]
    names += [e["file"] for e in base.manifest["files"] if "bias" in e["shapes"] and e["file"] not in names]
    materialize(base, str(out), {f: base.blob(f) for f in names},
                dict(base.manifest, files=[e for e in base.manifest["files"] if e["file"] in names]))
    return Base(out, base.dtype)


def copy_set(base, out):
    shutil.copytree(base.path, str(out))
    return out


def rewrite(folder, name, change):
    path = os.path.join(str(folder), name)
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(repack(data, change))


# ------------------------------------------------------------------ valid sets, and wrong answers

@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float8_e4m3fn"])
@pytest.mark.slow
def test_the_client_judges_output_and_gradients_of_a_valid_set_under_the_sanitizers(exes, bases, asan_client, dtype):
    if dtype not in bases:
        pytest.skip("bfloat16 and fp8 vectors need ml_dtypes")
    base = bases[dtype]
    cp = run(asan_client, base.path)
    assert contract_problem(cp) is None and cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    lines = cp.stdout.splitlines()
    assert lines[-1] == f"{len(base.names)} passed, 0 failed, 0 skipped"
    cases = lines[:-1]
    assert len(cases) == len(base.names) and all(line.startswith("pass  ") for line in cases)
    has_bias = {e["file"][:-4]: "bias" in e["shapes"] for e in base.manifest["files"]}
    for line in cases:                              # every gradient judged, dbias where there is a bias
        assert all(re.search(rf"\b{q} [0-9.e+-]+", line) for q in ("out", "lse", "dq", "dk", "dv")), line
        assert ("dbias" in line) == has_bias[line.split()[1].rstrip(":")], line


def test_the_client_compiles_and_passes_without_the_sanitizers(client, bases):
    for base in bases.values():
        cp = run(client, base.path)
        assert cp.returncode == 0 and cp.stdout.splitlines()[-1] == f"{len(base.names)} passed, 0 failed, 0 skipped"


def test_forward_only_reports_the_gradients_as_not_judged(client, exes, bases, tmp_path):
    base = bases["float32"]
    for cp in (run(client, base.path, "--forward-only"), run(_exe(exes, "no_backward"), base.path)):
        assert cp.returncode == 0, cp.stdout + cp.stderr
        cases = cp.stdout.splitlines()[:-1]
        assert cases and all("out " in ln and "gradients not judged" in ln and "dq" not in ln for ln in cases)


def test_the_lse_is_judged_where_the_kernel_returns_one_and_the_file_has_its_honest_error(client, exes, bases,
                                                                                          tmp_path):
    base = bases["float32"]
    for cp in (run(client, base.path, "--no-lse"), run(_exe(exes, "no_lse"), base.path)):
        assert cp.returncode == 0, cp.stdout + cp.stderr
        cases = cp.stdout.splitlines()[:-1]
        assert cases and all("lse not judged (the kernel returns none: --no-lse)" in ln for ln in cases)
    d = copy_set(base, tmp_path / "v2")                  # a set of format 2: no honest_lse
    for name in base.names:
        rewrite(d, name, lambda arrays: arrays.pop("honest_lse"))
    cp = run(client, d)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert all("lse not judged (no honest_lse: vectors of format 2)" in ln for ln in cp.stdout.splitlines()[:-1])
    d = copy_set(base, tmp_path / "future")             # an honest_* error a later format adds: not an option
    rewrite(d, base.names[0], lambda arrays: arrays.__setitem__("honest_future", np.zeros(1)))
    cp = run(client, d)
    assert cp.returncode == 0 and cp.stdout.splitlines()[-1].endswith("0 skipped"), cp.stdout[-500:]


@pytest.mark.parametrize("n", sorted(SINK_BREAKS), ids=["dsinks-off", "sink-forgotten"])
def test_a_wrong_sink_kernel_fails(exes, bases, asan_client, n):
    """The client judges sinks and their gradient (under the sanitizers); a dsinks 1% off, or a forward that
    forgets the sink, fails exactly that quantity."""
    base = bases["sinks-float32"]
    cp = run(asan_client, base.path)
    assert contract_problem(cp) is None and cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    assert all("dsinks " in ln for ln in cp.stdout.splitlines()[:-1])
    exe, env = _broken(exes, n)
    cp = run(exe, base.path, env=env)
    assert cp.returncode == 1, cp.stdout[-2000:]
    failed = [ln for ln in cp.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(failed) == len(base.names)
    assert all(re.search(rf"\b{SINK_BREAKS[n]} [0-9.e+inf]+ FAIL", ln) for ln in failed), failed


@pytest.mark.parametrize("layout", ["thd", "paged", "thd_paged"])
def test_a_layout_set_is_judged_where_the_layout_keeps_the_results(exes, bases, asan_client, layout):
    """A packed, paged, or packed-against-paged set (under the sanitizers): every case passes with out, lse, dq,
    dk and dv judged in the layout; a kernel that reads each sequence's keys one off fails every case with more than one key."""
    base = bases[f"{layout}-float32"]
    cp = run(asan_client, base.path)
    assert contract_problem(cp) is None and cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    lines = cp.stdout.splitlines()
    assert lines[-1] == f"{len(base.names)} passed, 0 failed, 0 skipped"
    for line in lines[:-1]:
        assert all(re.search(rf"\b{q} [0-9.e+-]+", line) for q in ("out", "lse", "dq", "dk", "dv")), line
    built = run(_exe(exes, f"break{LAYOUT_BREAK}"), base.path)        # -DSDPA_CHECK_BREAK=9, as the docs say
    exe, env = _broken(exes, LAYOUT_BREAK)
    cp = run(exe, base.path, env=env)
    assert cp.returncode == 1, cp.stdout[-2000:]
    assert built.returncode == 1 and built.stdout == cp.stdout
    failed = {ln.split()[1].rstrip(":") for ln in cp.stdout.splitlines() if ln.startswith("FAIL")}
    several = {e["case"] for e in base.manifest["files"]
               if np.max(np.diff(vectors.read_npz(base.blob(e["file"]))["cu_seqlens_k"]) if layout == "thd"
                         else vectors.read_npz(base.blob(e["file"]))["cache_seqlens"], initial=0) > 1}
    assert several and several <= failed


def test_a_gathered_set_keeps_only_the_keys_each_row_names(exes, bases, asan_client):
    """Every case with top-k indices passes under the sanitizers; a kernel that ignores them fails the cases
    whose indices leave a key out."""
    base = bases["gathered-float32"]
    cp = run(asan_client, base.path)
    assert contract_problem(cp) is None and cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]
    assert cp.stdout.splitlines()[-1] == f"{len(base.names)} passed, 0 failed, 0 skipped"
    exe, env = _broken(exes, GATHER_BREAK)
    cp = run(exe, base.path, env=env)
    assert cp.returncode == 1, cp.stdout[-2000:]
    failed = {ln.split()[1].rstrip(":") for ln in cp.stdout.splitlines() if ln.startswith("FAIL")}
    assert len(failed) >= len(base.names) - 2, cp.stdout[-3000:]


@pytest.mark.parametrize("edit, says", [
    (("thd", lambda a: a.__setitem__("cu_seqlens_q", np.r_[0, a["cu_seqlens_q"][:0:-1]].astype(np.int32))),
     "should not decrease"),
    (("thd", lambda a: a.__setitem__("cu_seqlens_k", a["cu_seqlens_k"] + 1000)), "should start at 0"),
    (("thd", lambda a: a.__setitem__("cu_seqlens_q", a["cu_seqlens_q"] * 1000)), "end within the rows"),
    (("paged", lambda a: a.__setitem__("block_table", a["block_table"] + 1000)), "outside the cache"),
    (("paged", lambda a: a.__setitem__("cache_seqlens", a["cache_seqlens"] * 1000 + 1)), "width"),
    (("paged", lambda a: a.__setitem__("block_table", a["block_table"][:, None])), "integers of 2 dims"),
    (("paged", lambda a: a.__setitem__("q_lengths", np.ones(2, np.int64))), "should not be stored"),
    (("thd_paged", lambda a: a.__setitem__("cu_seqlens_q", a["cu_seqlens_q"] * 1000)), "end within the rows"),
    (("thd_paged", lambda a: a.__setitem__("block_table", a["block_table"][:1])), "sequences of cu_seqlens_q"),
    (("thd_paged", lambda a: a.__setitem__("query", a["query"][None])), "query should have 3 dims"),
    (("float32", lambda a: a.__setitem__("block_table", np.zeros((2, 1), np.int32))), "only a set of a layout"),
    (("gathered", lambda a: a.__setitem__("gather_kv_indices", a["gather_kv_indices"].astype(np.float64))),
     "should be integers"),
    (("gathered", lambda a: a.__setitem__("gather_kv_indices", a["gather_kv_indices"][..., :1, :, :].repeat(3, 1))),
     "broadcasting"),
], ids=["cu-decreasing", "cu-not-from-0", "cu-past-rows", "page-outside", "seqlen-past-table", "table-rank",
        "lengths-stored", "packed-past-rows", "table-rows", "packed-query-rank", "index-in-a-dense-set",
        "gather-float", "gather-heads"])
def test_a_layout_file_with_bad_indices_is_one_line_and_exit_status_2(asan_client, bases, tmp_path, edit, says):
    which, change = edit
    base = bases[which if which == "float32" else f"{which}-float32"]
    name = "plain-L8-S8-gather.npz" if which == "gathered" else "plain-L8-S8.npz"
    folder = tmp_path / "v"
    materialize(base, str(folder), {name: repack(base.blob(name), change)},      # (the base's file stays)
                dict(base.manifest, files=[e for e in base.manifest["files"] if e["file"] == name]))
    cp = run(asan_client, str(folder))
    assert contract_problem(cp) is None and cp.returncode == 2, cp.stdout[-2000:] + cp.stderr[-2000:]
    assert says in cp.stderr and len(cp.stderr.strip().splitlines()) == 1, cp.stderr


@pytest.mark.parametrize("n", sorted(BREAKS), ids=BREAKS.get)
def test_a_wrong_kernel_fails(exes, bases, tmp_path, n):
    """Wrong kernel n (SDPA_CHECK_BREAK=n): its out or one gradient is 1% off, and the client says FAIL, exit 1."""
    (exe, env), qty = _broken(exes, n), BREAKS[n]
    for dt in ("float64", "float32"):
        base = small_set(bases[dt], tmp_path / dt)
        cp = run(exe, base.path, env=env)
        assert cp.returncode == 1, cp.stdout[-2000:]
        failed = [ln for ln in cp.stdout.splitlines() if ln.startswith("FAIL")]
        assert all(re.search(rf"\b{qty} [0-9.e+inf]+ FAIL", ln) for ln in failed)
        m = SUMMARY.match(cp.stdout.splitlines()[-1])
        assert m and int(m.group(2)) == len(failed)
        # the cases where that quantity is not small fail, and only cases where it is not all zero
        must, may = set(), set()
        for name in base.names:
            a = vectors.read_npz(base.blob(name)).get(qty, np.zeros(0))
            a = np.where(np.isfinite(a), a, 0.0)            # NaN rows, and lse's -inf (which * 1.01 keeps)
            if np.any(a != 0):
                may.add(name[:-4])
            if np.max(np.abs(a), initial=0.0) > 1e-3:
                must.add(name[:-4])
        assert must and must <= {ln.split()[1].rstrip(":") for ln in failed} <= may


@pytest.mark.parametrize("qty", ["out", "dk"])
def test_an_edited_reference_fails_that_case_only(client, bases, tmp_path, qty):
    d = copy_set(bases["float32"], tmp_path / "v")
    name = "causal-bottom_right-L7-S13.npz"

    def change(arrays):
        a = arrays[qty].copy()
        a.flat[17] = a.flat[17] * 1.01 + 1e-3
        arrays[qty] = a
    rewrite(d, name, change)
    cp = run(client, d)
    assert cp.returncode == 1
    failed = [ln for ln in cp.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].startswith("FAIL  causal-bottom_right-L7-S13:") and \
        re.search(rf"\b{qty} [0-9.e+]+ FAIL \(max\|got - ref\| .* at entry \d+", failed[0])


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.long),
                                   pytest.param("float8_e4m3fn", marks=pytest.mark.long),
                                   pytest.param("float8_e5m2", marks=pytest.mark.long)])
def test_the_client_reads_the_low_precision_vectors(client, tmp_path, dtype):
    """bfloat16 and fp8 arrays are stored as bit patterns; the client decodes them and rounds to the format."""
    pytest.importorskip("ml_dtypes")
    d = tmp_path / "v"
    vectors.write_vectors(str(d), "quick", dtype)
    cp = run(client, d)
    assert cp.returncode == 0 and cp.stdout.splitlines()[-1].endswith(" passed, 0 failed, 0 skipped"), cp.stdout
    # the decoded inputs are what the reference read: a wrong decoding would not pass, and neither does this
    rewrite(d, "plain-L8-S8.npz", lambda a: a.__setitem__("value", a["value"][..., ::-1, :].copy()))
    cp = run(client, d)
    failed = [ln for ln in cp.stdout.splitlines() if ln.startswith("FAIL")]
    assert cp.returncode == 1 and len(failed) == 1 and failed[0].startswith("FAIL  plain-L8-S8:")


# ------------------------------------------------------------------ nothing judged, bad input

def test_nothing_judged_is_exit_status_3(client, bases, tmp_path):
    base = bases["float64"]
    d = copy_set(base, tmp_path / "v")
    for name in base.names:                         # an option the kernel does not know: every case skipped
        def change(a):
            opts = json.loads(bytes(a["options_json"]).decode())
            opts["future_option"] = True
            a["options_json"] = np.frombuffer(json.dumps(opts).encode(), dtype=np.uint8)
        rewrite(d, name, change)
    cp = run(client, d)
    lines = cp.stdout.splitlines()
    assert cp.returncode == 3 and not cp.stderr, cp.stdout + cp.stderr
    assert lines[-1] == f"0 passed, 0 failed, {len(base.names)} skipped: nothing judged"
    assert all(ln.startswith("skip  ") and "future_option" in ln for ln in lines[:-1])
    e = tmp_path / "empty"
    e.mkdir()
    (e / "manifest.json").write_text(json.dumps(dict(base.manifest, files=[])))
    cp = run(client, e)
    assert cp.returncode == 3 and cp.stdout == "0 passed, 0 failed, 0 skipped: nothing judged\n"


def test_a_case_too_large_for_the_naive_kernel_is_skipped(asan_client, bases, tmp_path):
    """Shapes that hold no data (E = Ev = 0) but would take the naive loops L * S * 65536 steps: a skip, at once."""
    base = bases["float64"]
    name = "plain-L8-S8.npz"

    def change(a):
        for n in ("query", "key", "value", "out", "grad_out", "dq", "dk", "dv"):
            a[n] = np.zeros((2, 2, 65536, 0))
        del a["lse"]
    files = {name: repack(base.blob(name), change)}
    materialize(base, str(tmp_path / "v"), files,
                dict(base.manifest, files=[e for e in base.manifest["files"] if e["file"] == name]))
    cp = run(asan_client, tmp_path / "v", timeout=60)
    assert contract_problem(cp) is None and cp.returncode == 3, cp and cp.stdout + cp.stderr
    assert "too large for this naive kernel" in cp.stdout


def test_bad_input_is_one_line_and_exit_status_2(client, tmp_path):
    def once(*args):
        cp = run(client, tmp_path, *args)
        lines = cp.stderr.splitlines()
        assert cp.returncode == 2 and len(lines) == 1 and lines[0].startswith(("sdpa_check: ", "usage: ")), cp.stderr
        return lines[0]
    assert "manifest.json" in once()
    assert "usage" in once("--bogus")
    (tmp_path / "manifest.json").write_text('{"dtype": "float32", "files": [{"file": "gone.npz"}]}')
    assert "k_out" in once()                        # no rule to judge by
    (tmp_path / "manifest.json").write_text('{"dtype": "float32", "relative_rule": {"k_out": 3.0, "k_grad": 3.0}, '
                                            '"files": [{"file": "gone.npz"}]}')
    assert "gone.npz" in once()
    (tmp_path / "gone.npz").write_bytes(np.arange(10).tobytes())
    assert "gone.npz" in once() and "zip" in once()
    (tmp_path / "gone.npz").unlink()
    os.mkfifo(tmp_path / "gone.npz")                # a FIFO: refused at once, never waited on
    assert "FIFO" in once()
    assert subprocess.run([client, "--help"], capture_output=True).returncode == 0


# ------------------------------------------------------------------ the fuzzer and the regressions

def test_the_fuzzer_finds_nothing_in_the_client(asan_client, bases, tmp_path):
    """SDPA_REF_FUZZ_N seeded mutants of valid sets (SDPA_REF_FUZZ_SEED): every run keeps the contract."""
    results = fuzz(asan_client, bases, FUZZ_N, FUZZ_SEED, str(tmp_path))
    bad = [(desc, prob, cp) for desc, prob, cp in results if prob]
    assert not bad, f"{len(bad)} of {len(results)} mutants broke the contract; the first:\n" + "\n\n".join(
        f"{desc}\n  {prob}\n  {'' if cp is None else cp.stderr[-1500:]}" for desc, prob, cp in bad[:5])
    statuses = collections.Counter(cp.returncode for _, _, cp in results)
    # the mutants reach past the first check: some are still read and judged, and the refusals differ
    assert statuses[2] and statuses[0] + statuses[1] + statuses[3], statuses
    reasons = {re.sub(r"\d+", "N", cp.stderr.split(": ", 2)[-1]) for _, _, cp in results if cp.returncode == 2}
    assert len(reasons) >= min(10, FUZZ_N // 20), reasons


@pytest.mark.parametrize("recipe", REGRESSIONS, ids=lambda p: os.path.basename(p)[:-5])
def test_a_regression_file_is_refused(asan_client, bases, tmp_path, recipe):
    with open(recipe, encoding="utf-8") as fh:
        r = json.load(fh)
    if r["dtype"] not in bases:
        pytest.skip(f"{r['dtype']} vectors need ml_dtypes")
    apply_recipe(r, bases[r["dtype"]], str(tmp_path / "v"))
    cp = run(asan_client, tmp_path / "v")
    assert contract_problem(cp) is None and cp.returncode == 2, (cp and cp.stdout[-1000:] + cp.stderr[-2000:])
    assert r["stderr"] in cp.stderr, cp.stderr


def test_there_is_a_regression_file_for_each_defect_class():
    classes = set()
    for path in REGRESSIONS:
        with open(path, encoding="utf-8") as fh:
            classes.add(json.load(fh)["class"])
    assert {"declared shape past the data", "too many mask dims", "Hkv = 0", "G = 0", "shape product overflow",
            "huge allocation", "short file name", "FIFO as a case",                     # the security review's
            "input of rank below 2", "folder as a case", "leak on a refusal",              # the fuzzer's
            "bias that does not broadcast"} <= classes


@pytest.mark.skipif(not os.environ.get("SDPA_REF_OLD_C_CLIENT"),
                    reason="set SDPA_REF_OLD_C_CLIENT to a sanitizer build of an older client to check the files")
@pytest.mark.parametrize("recipe", REGRESSIONS, ids=lambda p: os.path.basename(p)[:-5])
def test_a_regression_file_reproduces_on_an_old_client(bases, tmp_path, recipe):
    """Each regression file did to the client before issue 21 what its "old_client" says: a sanitizer report, a
    hang, or a symbolic link followed (and the case judged)."""
    with open(recipe, encoding="utf-8") as fh:
        r = json.load(fh)
    if r["dtype"] not in bases:
        pytest.skip(f"{r['dtype']} vectors need ml_dtypes")
    apply_recipe(r, bases[r["dtype"]], str(tmp_path / "v"))
    cp = run(os.environ["SDPA_REF_OLD_C_CLIENT"], tmp_path / "v", timeout=5)
    did = "hang" if cp is None else "sanitizer report" if any(m in cp.stderr for m in SAN_MARKERS) else \
        "followed" if cp.returncode == 0 else f"exit status {cp.returncode}"
    assert did == r["old_client"], (cp and (cp.stdout[-500:], cp.stderr[-1500:]))


# ------------------------------------------------------------------ by hand

def report_place(stderr):
    """Where a sanitizer report points: UBSan's ``file:line``, or the first frame of the client in ASan's stack."""
    m = re.search(r"([\w./-]+\.c:\d+):\d+: runtime error: ([^\n]{0,60})", stderr)
    if m:
        return f"{os.path.basename(m.group(1))} {m.group(2)}"
    kind = re.search(r"ERROR: AddressSanitizer: ([\w-]+)", stderr)
    frame = re.search(r"#\d+ 0x[0-9a-f]+ in (\w+) [^\n]*?([\w.-]+\.c:\d+)", stderr)
    return f"{kind.group(1) if kind else 'leak'} in {frame.group(1) + ' ' + frame.group(2) if frame else '?'}"


def main(argv=None):
    ap = argparse.ArgumentParser(description="Fuzz a build of examples/c/sdpa_check.c and count what breaks.")
    ap.add_argument("--exe", required=True, help="the client, built with -fsanitize=address,undefined")
    ap.add_argument("-n", type=int, default=FUZZ_N)
    ap.add_argument("--seed", type=int, default=FUZZ_SEED)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32", "bfloat16", "float8_e4m3fn"])
    ap.add_argument("--show", type=int, default=5, help="print this many of the runs that broke the contract")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        bases = {dt: write_base(os.path.join(tmp, dt), dt) for dt in args.dtypes}
        results = fuzz(args.exe, bases, args.n, args.seed, tmp, timeout=args.timeout)
    kinds, places, first = collections.Counter(), collections.Counter(), {}
    for desc, prob, cp in results:
        if prob == "sanitizer report":
            kind = "LeakSanitizer" if "LeakSanitizer" in cp.stderr else "AddressSanitizer" if "AddressSanitizer" \
                in cp.stderr else "UndefinedBehaviorSanitizer"
            kinds[kind] += 1
            places[(kind, report_place(cp.stderr))] += 1
            first.setdefault((kind, report_place(cp.stderr)), desc)
        elif prob:
            kinds[prob.split(":")[0]] += 1
    statuses = collections.Counter(cp.returncode for _, _, cp in results if cp)
    print(f"{len(results)} mutants; exit statuses {dict(statuses)}")
    print("contract broken:", dict(kinds) or "never")
    print(f"sanitizer reports in {len(places)} distinct places:")
    for (kind, place), count in places.most_common():
        print(f"  {count:5d}  {kind}: {place}\n         e.g. {first[(kind, place)][:150]}")
    for desc, prob, cp in [r for r in results if r[1]][:args.show]:
        print(f"\n{desc}\n  {prob}\n  " + ("" if cp is None else "\n  ".join(cp.stderr.splitlines()[:6])))
    return 1 if kinds else 0


if __name__ == "__main__":
    sys.exit(main())
