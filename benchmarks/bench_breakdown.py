"""Where the dense fast path's time goes, operation by operation, beside the whole engine.

Run: python benchmarks/bench_breakdown.py [--shape 1 8 1024 64] [--dtype float64|float32] [--rounds 7]

The fast engine's forward and backward are a chain of whole-array NumPy
operations (see ``sdpa_ref/engines/fast.py``). This script runs the same
operations one by one on arrays of the same shapes -- the GEMMs, the row
passes of the softmax, the pivoted softmax VJP -- in one process with the
BLAS held to one thread and no thread pool, times each (the median of
``--rounds``), and prints them with their share of the sum, beside the bare
GEMMs alone and the engine itself under the same one-thread setting. The
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
    ops = [
        ("scale q", "element-wise", lambda: q * scale),
        ("T = (s q) K^T", "GEMM", lambda: np.matmul(q * scale, kT, out=buf)),
        ("row max", "row pass", lambda: np.max(T, axis=-1, keepdims=True)),
        ("T - m", "row pass", lambda: np.subtract(T, m, out=buf)),
        ("exp", "row pass", lambda: np.exp(T, out=buf)),
        ("row sum", "row pass", lambda: np.einsum("...ij->...i", P)),
        ("P / s", "row pass", lambda: np.divide(T, s, out=buf)),
        ("lse = m + log s", "row pass", lambda: np.log(s) + m),
        ("O = P V", "GEMM", lambda: P @ v),
        ("dV = P^T dO", "GEMM", lambda: np.swapaxes(P, -1, -2) @ g),
        ("dP = dO V^T", "GEMM", lambda: np.matmul(g, vT, out=buf)),
        ("pivot: argmax P", "row pass", lambda: np.argmax(P, axis=-1)),
        ("pivot: c = dP[argmax]", "row pass", lambda: np.take_along_axis(dP, idx, axis=-1)),
        ("dP - c", "row pass", lambda: np.subtract(dP, dP[..., :1], out=buf)),
        ("D = rowsum(P (dP - c))", "row pass", lambda: np.einsum("...ij,...ij->...i", dP, P)),
        ("(dP - c) - D", "row pass", lambda: np.subtract(dP, m, out=buf)),
        ("dT = P * (...)", "row pass", lambda: np.multiply(dP, P, out=buf)),
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
    total = sum(t for _, _, t in rows)
    gemm = sum(t for _, kind, t in rows if kind == "GEMM")
    print(f"shape {tuple(args.shape)} {args.dtype}, one thread (BLAS and pool), median of {args.rounds}")
    print(f"{'operation':<26} {'kind':<13} {'ms':>9} {'share':>7}")
    for name, kind, t in rows:
        print(f"{name:<26} {kind:<13} {t * 1e3:>9.2f} {t / total:>7.1%}")
    print(f"{'sum of the operations':<40} {total * 1e3:>9.2f}")
    print(f"{'the six GEMMs alone':<40} {gemm * 1e3:>9.2f}   ({gemm / total:.1%} of the sum)")
    print(f"{'the engine, fwd + bwd':<40} {whole * 1e3:>9.2f}   (GEMMs / engine {gemm / whole:.3f})")


if __name__ == "__main__":
    main()
