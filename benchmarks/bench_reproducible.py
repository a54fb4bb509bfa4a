"""The cost of precision="reproducible": its forward + backward time over the fast path's, side by side.

    python benchmarks/bench_reproducible.py [--shape 1 8 1024 64] [--rounds 5] [--dtype float64]

Each round times the fast path and the reproducible one, one after the
other (the order alternating), forward plus backward on the same float64
inputs (``--dtype float32`` / ``float16`` with ``upcast=False`` times the
honest low-precision arithmetic instead); the ratio is taken per round and
the median and range over the rounds printed, with the thread settings.
Issue 11's target is a ratio of at most 20 at ``(1, 8, 1024, 64)`` float64.
Timings on shared machines are noisy: compare ratios from one run.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import sdpa_ref  # noqa: E402


def once(q, k, v, g, precision, upcast):
    t0 = time.perf_counter()
    _, res = sdpa_ref.sdpa_forward(q, k, v, precision=precision, upcast=upcast)
    sdpa_ref.sdpa_backward(res, g)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 8, 1024, 64], metavar=("B", "H", "L", "E"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=["float64", "float32", "float16"], default="float64")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds should be at least 1, but got {args.rounds}")
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(tuple(args.shape)).astype(args.dtype) for _ in range(4))
    upcast = args.dtype == "float64"
    threads = {n: os.environ.get(n, "unset") for n in ("SDPA_REF_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    print(f"shape {tuple(args.shape)} {args.dtype}{'' if upcast else ' (upcast=False)'}, fwd + bwd; "
          f"{args.rounds} rounds; threads: {threads}")
    once(q, k, v, g, "fast", upcast)
    once(q, k, v, g, "reproducible", upcast)                      # warm both
    ratios = []
    for i in range(args.rounds):
        order = ("fast", "reproducible") if i % 2 == 0 else ("reproducible", "fast")
        t = {p: once(q, k, v, g, p, upcast) for p in order}
        ratios.append(t["reproducible"] / t["fast"])
        print(f"round {i + 1:2d}: fast {t['fast'] * 1e3:8.1f} ms, reproducible {t['reproducible'] * 1e3:9.1f} ms, "
              f"ratio {ratios[-1]:6.1f}")
    print(f"median ratio reproducible / fast: {statistics.median(ratios):.1f} "
          f"(range {min(ratios):.1f} to {max(ratios):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
