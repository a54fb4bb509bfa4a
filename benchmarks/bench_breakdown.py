"""Where the dense fast path's time goes, operation by operation, beside the engine and the GEMM bound.

Run: python benchmarks/bench_breakdown.py [--shape 1 8 1024 64] [--dtype float64|float32] [--threads N]
[--rounds 7]

The fast engine's forward and backward are GEMMs, two fused row passes (the
softmax rows and the pivoted softmax-VJP rows, compiled: ``sdpa_ref/exact/
_fast_rows.h``), a fresh ``L x S`` buffer for ``P`` and a few small
operations (see ``sdpa_ref/engines/fast.py``). This script runs the same
operations one by one on arrays of the same shapes *as the engine runs them*:
one head per task on a pool of ``--threads`` threads (default: the CPUs, the
thread count ``bench_attention.py`` uses), the BLAS held to one thread; the
copies of the inputs that the residuals keep run on the calling thread, as in
the engine. It times each (the median of ``--rounds``, wall time of all the
heads) and prints them with their share of the sum, beside the GEMM bound
(the fastest of the ways ``bench_attention.py`` tries) and the engine itself
under the same thread count. Without a C compiler (or with
``SDPA_REF_NATIVE=0``) the row passes are NumPy's. The engine overlaps its
heads, so its time is not exactly the sum; the table says which operations
the sum is made of. With ``--dtype float32`` the engine runs with
``upcast=False``.
"""

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from threadpoolctl import threadpool_limits  # noqa: E402

import sdpa_ref  # noqa: E402
from sdpa_ref.exact import _native  # noqa: E402
from sdpa_ref.transforms import transposed_product  # noqa: E402


def operations(q, k, v, g, scale, pool=None):
    """``[(name, kind, fn(h))]``: each operation of the fast forward + backward for head ``h`` (an index of the
    leading axes), on arrays of its shapes; kind ``"serial"`` marks an operation started once by the calling
    thread (``fn()``): the residuals' copies, and the new ``L x S`` buffer, which the calling thread allocates and
    ``pool`` (None: the calling thread) touches head by head, as the engine's forward does."""
    swap = lambda a: np.swapaxes(a, -1, -2)  # noqa: E731
    T = (q * scale) @ swap(k)
    P = np.exp(T - T.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    dP = g @ swap(v)
    buf = np.empty_like(T)
    lib = _native.kernels()
    n = T.shape[-2]
    rows1 = [np.empty(T.shape[:-1] + (1,), dtype=T.dtype) for _ in range(3)]
    empty = np.empty(T.shape[:-1] + (1,), dtype=bool)

    def fused_softmax(h):
        np.copyto(buf[h], T[h])                        # the pass works in place: on a copy of the scores
        _native.fast_softmax_rows(lib, buf[h], *(r[h] for r in rows1), empty[h])

    def fused_vjp(h):
        np.copyto(buf[h], dP[h])
        _native.fast_softmax_vjp_rows(lib, buf[h], P[h])

    def numpy_softmax(h):
        t = np.copyto(buf[h], T[h]) or buf[h]
        t -= t.max(-1, keepdims=True)
        np.exp(t, out=t)
        t /= t.sum(-1, keepdims=True)

    def numpy_vjp(h):
        d = np.copyto(buf[h], dP[h]) or buf[h]
        c = np.take_along_axis(d, np.argmax(P[h], -1)[:, None], -1)
        d -= c
        d -= np.einsum("ij,ij->i", d, P[h])[:, None]
        d *= P[h]

    heads = list(np.ndindex(*T.shape[:-2]))

    def new_buffer():
        t = np.empty_like(T)                           # one buffer for every head, as the engine's T
        touch = lambda h: t[h].fill(0.0)  # noqa: E731
        list(map(touch, heads) if pool is None else pool.map(touch, heads))

    copies = lambda h: np.copyto(buf[h], T[h])  # noqa: E731
    inputs = (q, k, v)
    return [
        ("inputs copied (residuals)", "serial", lambda: [np.array(a) for a in inputs]),
        ("new L x S buffer, touched", "serial", new_buffer),
        ("T = (s q) K^T", "GEMM", lambda h: np.matmul(q[h] * scale, swap(k[h]), out=buf[h])),
        ("copy of T (for the next)", "memory", copies),
        ("softmax rows" + (", compiled" if lib is not None else ", NumPy"), "row pass",
         fused_softmax if lib is not None else numpy_softmax),
        ("O = P V", "GEMM", lambda h: P[h] @ v[h]),
        ("dV = P^T dO", "GEMM", lambda h: transposed_product(P[h], g[h])),
        ("dP = dO V^T", "GEMM", lambda h: np.matmul(g[h], swap(v[h]), out=buf[h])),
        ("copy of dP (for the next)", "memory", lambda h: np.copyto(buf[h], dP[h])),
        ("softmax VJP rows" + (", compiled" if lib is not None else ", NumPy"), "row pass",
         fused_vjp if lib is not None else numpy_vjp),
        ("dQ = s dT K", "GEMM", lambda h: (dP[h] @ k[h]) * scale),
        ("dK = s dT^T Q", "GEMM", lambda h: transposed_product(dP[h], q[h]) * scale),
    ], n


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
    ap.add_argument("--threads", type=int, default=None,
                    help="the pool's threads, as bench_attention.py gives every contender (default: the CPUs)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or cpus
    os.environ["SDPA_REF_NUM_THREADS"] = str(threads)     # before the engine's first call makes its pool
    import bench_attention                                 # the ways of running the six GEMMs
    rng = np.random.default_rng(0)
    dt = np.dtype(args.dtype)
    q, k, v, g = (rng.standard_normal(tuple(args.shape)).astype(dt) for _ in range(4))
    scale = dt.type(1 / np.sqrt(args.shape[-1]))
    heads = list(np.ndindex(*args.shape[:2]))
    pool = ThreadPoolExecutor(threads)
    ops, _ = operations(q, k, v, g, scale, pool)

    def pooled(fn):
        return lambda: list(pool.map(fn, heads))

    rows = []
    with threadpool_limits(1):
        for name, kind, fn in ops:
            rows.append((name, kind, median_time(fn if kind == "serial" else pooled(fn), args.rounds)))
        ways = bench_attention._gemm_contenders(q, k, v, g, threads)
    with threadpool_limits(threads):                       # the stacked way gets the threaded BLAS
        bound = min(median_time(f, args.rounds) for f in ways.values())

    def engine():
        _, res = sdpa_ref.sdpa_forward(q, k, v, upcast=dt == np.float64)
        sdpa_ref.sdpa_backward(res, g)

    whole = median_time(engine, args.rounds)
    copies = sum(t for name, _, t in rows if name.startswith("copy of"))   # only to feed the in-place passes
    rows = [(name, kind, t - (rows[i - 1][2] if kind == "row pass" else 0.0))
            for i, (name, kind, t) in enumerate(rows) if not name.startswith("copy of")]
    total = sum(t for _, _, t in rows)
    gemm = sum(t for _, kind, t in rows if kind == "GEMM")
    level = _native.simd_level(_native.kernels()) if _native.kernels() is not None else "NumPy"
    print(f"shape {tuple(args.shape)} {args.dtype}, {threads} thread(s): one head per task on the pool, the BLAS "
          f"on one thread; median of {args.rounds}; row passes: {level}"
          + (f", less the copy that feeds them ({copies * 1e3:.1f} ms)" if copies else ""))
    print(f"{'operation':<30} {'kind':<9} {'ms':>9} {'share':>7}")
    for name, kind, t in rows:
        print(f"{name:<30} {kind:<9} {t * 1e3:>9.2f} {t / total:>7.1%}")
    print(f"{'sum of the operations':<40} {total * 1e3:>9.2f}")
    print(f"{'the six GEMMs, as the engine runs them':<40} {gemm * 1e3:>9.2f}   ({gemm / total:.1%} of the sum)")
    print(f"{'the GEMM bound (bench_attention.py)':<40} {bound * 1e3:>9.2f}")
    print(f"{'the engine, fwd + bwd':<40} {whole * 1e3:>9.2f}   (bound / engine {bound / whole:.3f}; "
          f"the sum leaves {(whole - total) * 1e3:.1f} ms unexplained)")


if __name__ == "__main__":
    main()
