"""What this installation runs: :func:`info` (``sdpa-ref info`` prints it)."""

from __future__ import annotations

import platform
import sys
from typing import Any, Dict, List

from ._version import __version__

__all__ = ["info", "NUMPY_ONLY_COST"]

#: What running without the compiled kernels costs, as :func:`info` tells the user: approximate, it varies with the
#: shape and the machine (``docs/performance.md``, "Where the numbers in the code went", has the timing behind it).
NUMPY_ONLY_COST = ("precision='reproducible' runs about 1.5x slower, and the fast path's row passes use NumPy "
                   "(about 1.3x slower); the results are the same (bit for bit for precision='reproducible')")


def info() -> Dict[str, Any]:
    """What this installation of sdpa_ref runs on: the version, the compiled kernels, the BLAS and the dtypes.

    Nothing is built or measured: the compiled kernels are the library built when the package was installed,
    loaded (if it was not yet) from the package's own folder.

    Returns
    -------
    dict
        A JSON-serialisable dict with the keys

        ``version`` : str
            The package's version (``sdpa_ref.__version__``).
        ``python``, ``numpy`` : str
            Their versions.
        ``compiled_kernels`` : dict
            ``in_use`` (bool); ``reason`` (str, why they are not in use: not built at install, with the
            install's reason, ``SDPA_REF_NATIVE=0``, or failed to load, with the error; None when in use);
            ``cost`` (str, what running without them costs, approximately; None when in use); ``path`` (str or
            None, the library loaded); ``simd_level`` (str or None, the build of the fast row passes in use,
            ``"baseline"``, ``"avx2"`` or ``"avx512"``); ``simd_levels`` (list of str, the builds this CPU runs);
            ``stale`` (bool or None, True when the library was built from other C sources than those installed
            beside it, as after editing them in an editable install: reinstall); ``compiler`` and ``flags``
            (lists of str, as recorded at install, or None).
        ``blas`` : list of dict
            One per BLAS library loaded in this process, as threadpoolctl sees it: ``internal_api``
            (``"openblas"``, ``"mkl"``, ...), ``version``, ``num_threads`` (its own setting; every call of the
            package holds it to one thread while it runs), ``architecture`` (the kernel family the BLAS
            picked, e.g. ``"Haswell"``, or None), ``threading_layer`` and ``filepath``. Empty when
            threadpoolctl finds none.
        ``num_threads`` : int
            The threads of the package's own pool (``SDPA_REF_NUM_THREADS``, else the CPUs this process may
            use).
        ``dtypes`` : list of str
            The dtypes the harness takes: float64, float32 and float16 always; bfloat16, float8_e4m3fn and
            float8_e5m2 when ``ml_dtypes`` is importable.

    See Also
    --------
    sdpa_ref.exact._native.status : the compiled kernels' part.

    Examples
    --------
    >>> import sdpa_ref
    >>> d = sdpa_ref.info()
    >>> d["compiled_kernels"]["in_use"] in (True, False)
    True
    >>> "float64" in d["dtypes"]
    True
    """
    import numpy as np

    from ._threads import num_threads
    from .exact import _native

    st = _native.status()
    rec = st["build"] or {}
    kernels = {
        "in_use": st["in_use"],
        "reason": st["reason"],
        "cost": None if st["in_use"] else NUMPY_ONLY_COST,
        "path": st["path"],
        "simd_level": st["simd_level"],
        "simd_levels": st["simd_levels"],
        "stale": st["stale"],
        "compiler": rec.get("compiler"),
        "flags": rec.get("flags"),
    }
    return {
        "version": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "compiled_kernels": kernels,
        "blas": _blas(),
        "num_threads": num_threads(),
        "dtypes": _dtypes(),
    }


def _blas() -> List[Dict[str, Any]]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    out = []
    for lib in threadpool_info():
        if lib.get("user_api") != "blas":
            continue
        out.append({
            "internal_api": lib.get("internal_api"),
            "version": lib.get("version"),
            "num_threads": lib.get("num_threads"),
            "architecture": lib.get("architecture") or lib.get("coretype"),
            "threading_layer": lib.get("threading_layer"),
            "filepath": lib.get("filepath"),
        })
    return out


def _dtypes() -> List[str]:
    from .harness.lowp import LOW_DTYPES, TEST_DTYPES

    base = [d for d in TEST_DTYPES if d not in LOW_DTYPES]
    try:
        import ml_dtypes
    except ImportError:
        return base
    return base + [d for d in LOW_DTYPES if hasattr(ml_dtypes, d)]


def info_rows(d: Dict[str, Any]) -> List[Dict[str, str]]:
    """:func:`info`'s dict as ``{"item", "value"}`` rows, for the command line's table and CSV."""
    k = d["compiled_kernels"]
    if k["in_use"]:
        simd = f"SIMD {k['simd_level']} (this CPU runs: {', '.join(k['simd_levels'])})"
        state = "in use, " + simd + (" -- STALE: built from other sources; reinstall" if k["stale"] else "")
    else:
        state = f"not in use: {k['reason']}"
    rows = [("version", d["version"]), ("python", d["python"]), ("numpy", d["numpy"]),
            ("compiled kernels", state)]
    if k["in_use"]:
        rows.append(("library", k["path"]))
    else:
        rows.append(("without them", k["cost"]))
    for b in d["blas"] or [None]:
        if b is None:
            rows.append(("BLAS", "none found by threadpoolctl"))
            continue
        arch = f" ({b['architecture']})" if b["architecture"] else ""
        layer = f", {b['threading_layer']}" if b["threading_layer"] else ""
        rows.append(("BLAS", f"{b['internal_api']} {b['version']}{arch}, {b['num_threads']} threads{layer} "
                             "(held to 1 during the package's calls)"))
    rows += [("threads", str(d["num_threads"])), ("dtypes", ", ".join(d["dtypes"]))]
    return [{"item": a, "value": str(b)} for a, b in rows]
