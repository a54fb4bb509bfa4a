"""The exact kernels (``sdpa_ref/exact/_kernels.c``) under AddressSanitizer and UBSan.

``tests/data/exact_kernels_driver.c`` calls the slicer, the end of a block and the dd accumulation over many
shapes and layouts, every buffer allocated to its exact size; built with the kernels' own source under
``-fsanitize=address,undefined``, a read or write past a buffer, or undefined behaviour, fails the run. The test
also checks that the sanitizers are awake: the same driver with one buffer a double short must be caught.
"""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "sdpa_ref", "exact", "_kernels.c")
DRIVER = os.path.join(ROOT, "tests", "data", "exact_kernels_driver.c")
CC = os.environ.get("CC") or "cc"
FLAGS = ["-std=c99", "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
         "-fno-sanitize-recover=undefined", "-ffp-contract=off", "-fno-fast-math"]
ENV = {"ASAN_OPTIONS": "detect_leaks=0:exitcode=99", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=98"}
SHORT = ("double *out = fresh((size_t)(n * rows * k));", "double *out = fresh((size_t)(n * rows * k - 1));")

pytestmark = pytest.mark.skipif(shutil.which(CC) is None or not os.path.exists(KERNELS),
                                reason="no C compiler here (CI has one)")


def _build(tmp_path, source, name):
    exe = tmp_path / name
    cp = subprocess.run([CC, *FLAGS, "-o", str(exe), str(source), KERNELS, "-lm"], capture_output=True, text=True,
                        timeout=120)
    if cp.returncode != 0:
        pytest.skip(f"{CC} cannot build with the sanitizers here: {cp.stderr[:300]}")
    return exe


def _run(exe):
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})


def test_the_exact_kernels_run_clean_under_the_sanitizers(tmp_path):
    cp = _run(_build(tmp_path, DRIVER, "driver"))
    assert cp.returncode == 0 and cp.stdout.startswith("ok "), (cp.returncode, cp.stdout, cp.stderr[-2000:])
    assert "runtime error" not in cp.stderr and "Sanitizer" not in cp.stderr, cp.stderr[-2000:]


def test_the_sanitizers_catch_a_buffer_one_double_short(tmp_path):
    with open(DRIVER) as fh:
        text = fh.read()
    assert SHORT[0] in text
    bad = tmp_path / "short.c"
    bad.write_text(text.replace(SHORT[0], SHORT[1]))
    cp = _run(_build(tmp_path, bad, "short"))
    assert cp.returncode == 99 and "heap-buffer-overflow" in cp.stderr, (cp.returncode, cp.stderr[-2000:])
