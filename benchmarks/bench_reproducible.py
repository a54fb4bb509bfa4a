"""The cost of precision="reproducible": its forward + backward time over the fast path's, side by side.

    python benchmarks/bench_reproducible.py [--shape 1 8 1024 64] [--rounds 5] [--dtype float64]
    python benchmarks/bench_reproducible.py --all [--rounds 3]

Each round times the fast path and the reproducible one, one after the
other (the order alternating), forward plus backward on the same float64
inputs (``--dtype float32`` / ``float16`` with ``upcast=False`` times the
honest low-precision arithmetic instead); the ratio is taken per round and
the median and range over the rounds printed, with the thread settings,
and the ratio of the process's CPU time (every thread's), which other work
on a busy machine moves less than the wall-clock time.
``--all`` times every shape of ``benchmarks/bench_attention.py`` (``SHAPES``)
and ends with a table of the median ratio per shape.
Issue 43's targets: a ratio of at most 12 at ``(1, 8, 1024, 64)`` float64 and
at most 15 at every shape. Timings on shared machines are noisy: compare
ratios from one run.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import sdpa_ref  # noqa: E402
from bench_attention import SHAPES  # noqa: E402
from bench_table import blas_and_simd, huge_pages  # noqa: E402


def once(q, k, v, g, precision, upcast):
    """``(wall, cpu)`` seconds of one forward + backward (``cpu``: the process's, every thread's)."""
    t0, c0 = time.perf_counter(), time.process_time()
    _, res = sdpa_ref.sdpa_forward(q, k, v, precision=precision, upcast=upcast)
    sdpa_ref.sdpa_backward(res, g)
    return time.perf_counter() - t0, time.process_time() - c0


def time_shape(shape, rounds, dtype):
    """The ratios of ``rounds`` rounds at ``shape``, printed round by round."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(tuple(shape)).astype(dtype) for _ in range(4))
    upcast = dtype == "float64"
    print(f"shape {tuple(shape)} {dtype}{'' if upcast else ' (upcast=False)'}, fwd + bwd; {rounds} rounds")
    once(q, k, v, g, "fast", upcast)
    once(q, k, v, g, "reproducible", upcast)                      # warm both
    ratios, cpu = [], []
    for i in range(rounds):
        order = ("fast", "reproducible") if i % 2 == 0 else ("reproducible", "fast")
        t = {p: once(q, k, v, g, p, upcast) for p in order}
        ratios.append(t["reproducible"][0] / t["fast"][0])
        cpu.append(t["reproducible"][1] / t["fast"][1])
        print(f"round {i + 1:2d}: fast {t['fast'][0] * 1e3:8.1f} ms, reproducible {t['reproducible'][0] * 1e3:9.1f} "
              f"ms, ratio {ratios[-1]:6.1f} (CPU time {cpu[-1]:6.1f})")
    print(f"median ratio reproducible / fast: {statistics.median(ratios):.1f} "
          f"(range {min(ratios):.1f} to {max(ratios):.1f}); of the CPU time: {statistics.median(cpu):.1f}")
    return ratios, cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 8, 1024, 64], metavar=("B", "H", "L", "E"))
    ap.add_argument("--all", action="store_true", help="every shape of bench_attention.SHAPES, then a table")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=["float64", "float32", "float16"], default="float64")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds should be at least 1, but got {args.rounds}")
    threads = {n: os.environ.get(n, "unset") for n in ("SDPA_REF_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    print(f"threads: {threads}; {huge_pages()}; {blas_and_simd()}")
    shapes = SHAPES if args.all else [tuple(args.shape)]
    table = [(s, time_shape(s, args.rounds, args.dtype)) for s in shapes]
    if args.all:
        print("\nshape             median ratio   range          CPU time ratio")
        for s, (r, c) in table:
            print(f"{'x'.join(map(str, s)):<17s} {statistics.median(r):12.1f}   {min(r):5.1f} to {max(r):5.1f}"
                  f"   {statistics.median(c):6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
