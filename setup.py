"""Build script: the metadata is in setup.cfg; this file adds the optional compiled kernels.

``sdpa_ref/exact/_kernels.c`` and ``_fast_rows.c`` (which include ``_kernels.h`` and ``_fast_rows.h`` once per
SIMD build) are compiled at install time into one plain shared library, ``sdpa_ref/exact/_compiled_kernels.so``,
next to ``_native.py``, which loads it with ctypes (it is not a Python extension module). The build is optional, as
PyYAML's and MarkupSafe's speedups are: without a C compiler, or when the compiler fails, the install still
succeeds, says so in a warning, and the package runs its NumPy code (the same bits for
``precision="reproducible"``). Either way ``_compiled_kernels.json`` records what happened; ``sdpa-ref info``
reports it.

The compiler is ``$CC`` (split like a shell word list), else ``cc``, called with exactly :data:`FLAGS` and no
``CFLAGS``: the flags decide the bits (no FMA contraction, no fast-math), so nothing from the environment is
added. It works for ``pip install .`` (the library goes into the wheel, which is therefore platform-specific, and,
since pip builds in the source tree, beside the sources too, so that tests run from a checkout use it),
``pip install -e .`` and ``python setup.py build_ext --inplace`` (the library lands in the source tree,
ignored by git; rerun any of them after editing the C files).

``SDPA_REF_NO_COMPILE=1`` in the environment builds nothing, as if there were no compiler (the record says it
was asked, and any library an earlier build left in the build folder is removed): an install without the
kernels, which .ci/run tests on a compiler's machine (``SDPA_REF_NATIVE=0`` instead only stops an installed
library from being loaded).
"""

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: The importable-looking name of the library (only its folder and file name matter: ctypes loads it by path).
LIBRARY = "sdpa_ref.exact._compiled_kernels"
#: The file next to the library that records how it was built, or why it was not.
RECORD = "_compiled_kernels.json"
SOURCES = ["sdpa_ref/exact/_kernels.c", "sdpa_ref/exact/_fast_rows.c"]
HEADERS = ["sdpa_ref/exact/_kernels.h", "sdpa_ref/exact/_fast_rows.h"]
#: Exactly these, no more: the same bits on every build (the AVX2 variant needs no flag: a function attribute).
FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
LIBS = ["-lm"]


def sources_sha256(root="."):
    """The sha256 of every file the build reads, in order (``_native`` compares it to tell a stale library)."""
    h = hashlib.sha256()
    for f in SOURCES + HEADERS:
        with open(os.path.join(root, f), "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


class BuildCompiledKernels(build_ext):
    """``build_ext`` that builds :data:`LIBRARY` with the C compiler directly, never failing the install."""

    def get_ext_filename(self, fullname):
        if fullname in (LIBRARY, LIBRARY.rpartition(".")[2]):  # (distutils asks by the last part alone)
            # no Python ABI tag: it is not an extension module
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        if ext.name != LIBRARY:
            return super().build_extension(ext)
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        record = {"built": False, "reason": None, "compiler": None, "flags": FLAGS + LIBS,
                  "sources_sha256": sources_sha256(), "platform": sysconfig.get_platform()}
        try:
            if os.environ.get("SDPA_REF_NO_COMPILE", "") not in ("", "0"):
                raise _NotBuilt("SDPA_REF_NO_COMPILE is set: asked to build no kernels")
            record["compiler"] = cc = self._compiler()
            tmp = out + ".tmp"
            cmd = [*cc, *FLAGS, "-o", tmp, *ext.sources, *LIBS]
            print(" ".join(shlex.quote(c) for c in cmd))
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise _NotBuilt(f"{cc[0]} could not run: {e}") from None
            if run.returncode != 0:
                tail = (run.stderr or run.stdout).strip().splitlines()[-5:]
                raise _NotBuilt(f"{cc[0]} failed (exit {run.returncode}): " + " / ".join(tail))
            os.replace(tmp, out)
            record["built"] = True
        except _NotBuilt as e:
            record["reason"] = str(e)
            for f in (out, out + ".tmp"):                   # never a stale library beside a record saying none
                if os.path.exists(f):
                    os.remove(f)
            self._warn_not_built(str(e))
        with open(os.path.join(os.path.dirname(out), RECORD), "w") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")

    @staticmethod
    def _compiler():
        words = shlex.split(os.environ.get("CC") or "cc")
        if not words:
            raise _NotBuilt("CC is empty")
        if shutil.which(words[0]) is None:
            via = "CC" if os.environ.get("CC") else "the default C compiler"
            raise _NotBuilt(f"no C compiler: {words[0]!r} ({via}) was not found")
        return words

    @staticmethod
    def _warn_not_built(reason):
        bar = "*" * 78
        sys.stderr.write(f"\n{bar}\nWARNING: sdpa_ref's optional compiled kernels were not built: {reason}.\n"
                         "The package is installed and works with its NumPy code (the same results), but\n"
                         "precision='reproducible' runs about 1.5x slower and the fast path's row passes use\n"
                         "NumPy. Install a C compiler (or set CC) and reinstall to build them;\n"
                         f"`sdpa-ref info` says what is in use.\n{bar}\n\n")

    def run(self):
        super().run()
        root = os.path.dirname(os.path.abspath(__file__))
        default_dir = os.path.join(root, "build")
        if self.inplace or os.path.commonpath([os.path.abspath(self.build_lib), default_dir]) != default_dir:
            return
        # `pip install .` builds here, in the source tree's build/: a library that built goes beside the sources
        # too (as --inplace would put it), so that the README's `python -m pytest` in a checkout, which imports the
        # checkout's sdpa_ref rather than the installed one, runs the kernels this install built. Nothing is
        # removed or copied when it did not build, or for a build elsewhere (-b DIR); an unwritable tree is fine.
        so = self.get_ext_fullpath(LIBRARY)
        rec = os.path.join(os.path.dirname(so), RECORD)
        if not os.path.exists(so):
            return
        dest = os.path.join(root, *LIBRARY.split(".")[:-1])
        try:
            for f in (so, rec):
                shutil.copyfile(f, os.path.join(dest, os.path.basename(f)) + ".tmp")
                os.replace(os.path.join(dest, os.path.basename(f)) + ".tmp", os.path.join(dest, os.path.basename(f)))
        except OSError as e:
            sys.stderr.write(f"note: the compiled kernels were not copied beside the sources: {e}\n")

    def copy_extensions_to_source(self):
        """``--inplace`` and editable installs: the library (or its absence) and the record into the source tree.

        (Done here rather than by setuptools, whose copy fails on a missing file in some versions.)"""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            fullname = self.get_ext_fullname(ext.name)
            filename = self.get_ext_filename(fullname)
            package_dir = build_py.get_package_dir(".".join(fullname.split(".")[:-1]))
            inplace = os.path.join(package_dir, os.path.basename(filename))
            regular = os.path.join(self.build_lib, filename)
            if os.path.exists(regular):
                self.copy_file(regular, inplace, level=self.verbose)
            elif os.path.exists(inplace):
                os.remove(inplace)                          # a library from an earlier build: not what was asked
            rec = os.path.join(os.path.dirname(regular), RECORD)
            if ext.name == LIBRARY and os.path.exists(rec):
                self.copy_file(rec, os.path.join(package_dir, RECORD), level=self.verbose)


class _NotBuilt(Exception):
    pass


setup(
    ext_modules=[Extension(LIBRARY, sources=SOURCES, depends=HEADERS, optional=True)],
    cmdclass={"build_ext": BuildCompiledKernels},
)
