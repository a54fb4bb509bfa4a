"""The exact kernels (``sdpa_ref/exact/_kernels.c`` and the ``_kernels.h`` it compiles once per SIMD build) under
AddressSanitizer and UBSan.

``tests/data/exact_kernels_driver.c`` calls every one of them (the slicer, the end of a block, the dd
accumulation, exp, the division, the product by a scalar, the row sums, the softmax VJP, the early-stop level
test) over many shapes and layouts, every buffer allocated to its exact size, once per SIMD build the CPU runs (the driver stands in for
``_fast_rows.c``'s level switch); built with the kernels' source under ``-fsanitize=address,undefined``, a read
or write past a buffer, or undefined behaviour, fails the run. The test also checks that the sanitizers are awake: the same driver with one buffer a double short must
be caught. A compiler without the sanitizers skips; one that has them but cannot build the kernels fails.
"""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = [os.path.join(ROOT, "sdpa_ref", "exact", "_kernels.c")]   # the driver picks the SIMD build itself
DRIVER = os.path.join(ROOT, "tests", "data", "exact_kernels_driver.c")
CC = os.environ.get("CC") or "cc"
FLAGS = ["-std=c99", "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
         "-fno-sanitize-recover=undefined", "-ffp-contract=off", "-fno-fast-math"]
ENV = {"ASAN_OPTIONS": "detect_leaks=0:exitcode=99", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=98"}
SHORT = ("double *out = fresh((size_t)(n * rows * k));", "double *out = fresh((size_t)(n * rows * k - 1));")

pytestmark = pytest.mark.skipif(shutil.which(CC) is None or not all(os.path.exists(f) for f in KERNELS),
                                reason="no C compiler here (CI has one)")


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """The kernels compiled once under the sanitizers (each driver links them); a skip where the
    compiler lacks the sanitizers, a failure where it has them but cannot build the kernels."""
    d = tmp_path_factory.mktemp("sanitized")
    probe = d / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    cp = subprocess.run([CC, *FLAGS, "-o", str(d / "probe"), str(probe)], capture_output=True, text=True, timeout=120)
    if cp.returncode != 0:
        pytest.skip(f"{CC} cannot build with the sanitizers here: {cp.stderr[:300]}")
    out = []
    for f in KERNELS:
        o = d / (os.path.basename(f) + ".o")
        cp = subprocess.run([CC, *FLAGS, "-c", "-o", str(o), f], capture_output=True, text=True, timeout=300)
        assert cp.returncode == 0, f"{f} does not build with the sanitizers: {cp.stderr[-2000:]}"
        out.append(str(o))
    return out


def _build(tmp_path, source, name, objects):
    exe = tmp_path / name
    cp = subprocess.run([CC, *FLAGS, "-o", str(exe), str(source), *objects, "-lm"], capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 0, f"the driver does not build against the kernels: {cp.stderr[-2000:]}"
    return exe


def _run(exe):
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})


def test_the_exact_kernels_run_clean_under_the_sanitizers(tmp_path, objects):
    cp = _run(_build(tmp_path, DRIVER, "driver", objects))
    assert cp.returncode == 0 and cp.stdout.startswith("ok "), (cp.returncode, cp.stdout, cp.stderr[-2000:])
    assert " on 0 SIMD levels" not in cp.stdout, cp.stdout              # the baseline at least always runs
    assert "runtime error" not in cp.stderr and "Sanitizer" not in cp.stderr, cp.stderr[-2000:]


def test_the_sanitizers_catch_a_buffer_one_double_short(tmp_path, objects):
    with open(DRIVER) as fh:
        text = fh.read()
    assert SHORT[0] in text
    bad = tmp_path / "short.c"
    bad.write_text(text.replace(SHORT[0], SHORT[1]))
    cp = _run(_build(tmp_path, bad, "short", objects))
    assert cp.returncode == 99 and "heap-buffer-overflow" in cp.stderr, (cp.returncode, cp.stderr[-2000:])
