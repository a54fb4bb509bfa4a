"""Where the dense fast path's time goes, operation by operation, beside the whole engine.

Run: python benchmarks/bench_breakdown.py [--shape 1 8 1024 64] [--dtype float64|float32] [--rounds 7]

The fast engine's forward and backward are GEMMs, two fused row passes (the
softmax rows and the pivoted softmax-VJP rows, compiled: ``sdpa_ref/exact/
_fast_rows.h``) and a few small operations (see ``sdpa_ref/engines/fast.py``).
This script runs the same operations one by one on arrays of the same
shapes, in one process with the BLAS held to one thread and no thread pool,
times each (the median of ``--rounds``), and prints them with their share of
the sum, beside the bare GEMMs alone and the engine itself under the same
one-thread setting. Without a C compiler (or with ``SDPA_REF_NATIVE=0``)
the row passes are NumPy's, and the script times those one by one instead. The
engine works in cache-sized row blocks and chunks of heads, so its time is
not exactly the sum; the table says which operations the sum is made of.
With ``--dtype float32`` the engine runs with ``upcast=False``.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("SDPA_REF_NUM_THREADS", "1")

from threadpoolctl import threadpool_limits  # noqa: E402

import sdpa_ref  # noqa: E402
from sdpa_ref.exact import _native  # noqa: E402


def operations(q, k, v, g, scale):
    """``[(name, kind, fn)]``: each operation of the fast forward + backward on fresh arrays of its shapes."""
    kT, vT = np.swapaxes(k, -1, -2), np.swapaxes(v, -1, -2)
    T = (q * scale) @ kT
    m = T.max(-1, keepdims=True)
    P = np.exp(T - m)
    s = P.sum(-1, keepdims=True)
    P /= s
    dP = g @ vT
    buf = np.empty_like(T)
    idx = np.argmax(P, axis=-1)[..., None]
    lib = _native.kernels()
    n_rows = int(np.prod(T.shape[:-1]))
    rows1 = [np.empty((n_rows, 1), dtype=T.dtype) for _ in range(3)]
    empty = np.empty((n_rows, 1), dtype=bool)

    def fused_softmax():
        np.copyto(buf, T)                                  # the pass works in place: on a copy of the scores
        _native.fast_softmax_rows(lib, buf.reshape(n_rows, -1), *rows1, empty)

    def fused_vjp():
        np.copyto(buf, dP)
        _native.fast_softmax_vjp_rows(lib, buf.reshape(n_rows, -1), P.reshape(n_rows, -1))

    ops = [
        ("scale q", "element-wise", lambda: q * scale),
        ("new L x S buffer, touched", "memory", lambda: np.empty_like(T).fill(0.0)),
        ("T = (s q) K^T", "GEMM", lambda: np.matmul(q * scale, kT, out=buf)),
    ]
    if lib is not None:
        ops += [("copy of T (for the next)", "memory", lambda: np.copyto(buf, T)),
                ("softmax rows, compiled", "row pass", fused_softmax)]
    else:
        ops += [
            ("row max", "row pass", lambda: np.max(T, axis=-1, keepdims=True)),
            ("T - m", "row pass", lambda: np.subtract(T, m, out=buf)),
            ("exp", "row pass", lambda: np.exp(T, out=buf)),
            ("row sum", "row pass", lambda: np.einsum("...ij->...i", P)),
            ("P / s", "row pass", lambda: np.divide(T, s, out=buf)),
            ("lse = m + log s", "row pass", lambda: np.log(s) + m)]
    ops += [
        ("O = P V", "GEMM", lambda: P @ v),
        ("dV = P^T dO", "GEMM", lambda: np.swapaxes(P, -1, -2) @ g),
        ("dP = dO V^T", "GEMM", lambda: np.matmul(g, vT, out=buf)),
    ]
    if lib is not None:
        ops += [("copy of dP (for the next)", "memory", lambda: np.copyto(buf, dP)),
                ("softmax VJP rows, compiled", "row pass", fused_vjp)]
    else:
        ops += [
            ("pivot: argmax P", "row pass", lambda: np.argmax(P, axis=-1)),
            ("pivot: c = dP[argmax]", "row pass", lambda: np.take_along_axis(dP, idx, axis=-1)),
            ("dP - c", "row pass", lambda: np.subtract(dP, dP[..., :1], out=buf)),
            ("D = rowsum(P (dP - c))", "row pass", lambda: np.einsum("...ij,...ij->...i", dP, P)),
            ("(dP - c) - D", "row pass", lambda: np.subtract(dP, m, out=buf)),
            ("dT = P * (...)", "row pass", lambda: np.multiply(dP, P, out=buf))]
    ops += [
        ("dQ = s dT K", "GEMM", lambda: (dP @ k) * scale),
        ("dK = s dT^T Q", "GEMM", lambda: (np.swapaxes(dP, -1, -2) @ q) * scale),
    ]
    return ops


def median_time(fn, rounds):
    fn()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 8, 1024, 64], metavar=("B", "H", "L", "E"))
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    dt = np.dtype(args.dtype)
    q, k, v, g = (rng.standard_normal(tuple(args.shape)).astype(dt) for _ in range(4))
    scale = dt.type(1 / np.sqrt(args.shape[-1]))
    with threadpool_limits(1):
        rows = [(name, kind, median_time(fn, args.rounds)) for name, kind, fn in operations(q, k, v, g, scale)]
        upcast = dt == np.float64

        def engine():
            _, res = sdpa_ref.sdpa_forward(q, k, v, upcast=upcast)
            sdpa_ref.sdpa_backward(res, g)

        whole = median_time(engine, args.rounds)
    copies = sum(t for name, _, t in rows if name.startswith("copy of"))   # only to feed the in-place passes
    rows = [(name, kind, t - (rows[i - 1][2] if name.endswith("compiled") else 0.0))
            for i, (name, kind, t) in enumerate(rows) if not name.startswith("copy of")]
    total = sum(t for _, _, t in rows)
    gemm = sum(t for _, kind, t in rows if kind == "GEMM")
    print(f"shape {tuple(args.shape)} {args.dtype}, one thread (BLAS and pool), median of {args.rounds}; row passes: "
          + (f"compiled ({_native.simd_level(_native.kernels())}), less the copy that feeds them "
             f"({copies * 1e3:.1f} ms)"
             if _native.kernels() is not None else "NumPy's"))
    print(f"{'operation':<26} {'kind':<13} {'ms':>9} {'share':>7}")
    for name, kind, t in rows:
        print(f"{name:<26} {kind:<13} {t * 1e3:>9.2f} {t / total:>7.1%}")
    print(f"{'sum of the operations':<40} {total * 1e3:>9.2f}")
    print(f"{'the six GEMMs alone':<40} {gemm * 1e3:>9.2f}   ({gemm / total:.1%} of the sum)")
    print(f"{'the engine, fwd + bwd':<40} {whole * 1e3:>9.2f}   (GEMMs / engine {gemm / whole:.3f})")


if __name__ == "__main__":
    main()
