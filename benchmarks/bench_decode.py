"""A paged decode against a long KV cache: one query token, the cache's pages in random order.

    python benchmarks/bench_decode.py [--keys 32768] [--page-size 256] [--heads 32 8] [--width 128] [--rounds 3]

Times ``sdpa_forward(q, k_cache, v_cache, layout=KVCache(block_table=..., cache_seqlens=...))`` in float64
(the forward, no P kept), and reports the peak memory Python's allocator saw (tracemalloc) against the bytes of
the keys and values the decode reads, for the cache as given and for a cache with twice the pages (the same keys
read): the decode's memory grows with the keys it reads, not with the cache. Issue 24's target: under 1 s at
32k keys, 32 query heads over 8 kv heads, E = 128, on 2 cores. Timings on shared machines are noisy.
"""

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import sdpa_ref  # noqa: E402
from sdpa_ref import KVCache  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HQ", "HKV"))
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.keys < 1 or args.page_size < 1 or args.rounds < 1 or args.width < 1 or min(args.heads) < 1:
        ap.error("--keys, --page-size, --width, --rounds and --heads should be positive")
    rng = np.random.default_rng(0)
    hq, hkv = args.heads
    pages = -(-args.keys // args.page_size)
    q = rng.standard_normal((1, 1, hq, args.width))
    read = 2 * args.keys * hkv * args.width * 8
    print(f"decode: 1 query token, {args.keys} keys on {pages} pages of {args.page_size}, Hq={hq} Hkv={hkv} "
          f"E={args.width}, float64; threads: {os.environ.get('SDPA_REF_NUM_THREADS', 'unset')}")
    for extra in (1, 2):
        n = pages * extra
        kc = rng.standard_normal((n, args.page_size, hkv, args.width))
        vc = rng.standard_normal((n, args.page_size, hkv, args.width))
        lay = KVCache(cache_seqlens=np.array([args.keys]), block_table=rng.permutation(n)[:pages][None])

        def once():
            return sdpa_ref.sdpa_forward(q, kc, vc, layout=lay, enable_gqa=hq != hkv, is_causal=True,
                                         causal_alignment="bottom_right", save_probs=False)
        once()
        ts = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            once()
            ts.append(time.perf_counter() - t0)
        tracemalloc.start()
        once()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"cache of {n} pages ({kc.nbytes * 2 / 2**20:.0f} MiB): {min(ts):.3f} s best, {max(ts):.3f} s worst "
              f"of {args.rounds}; peak {peak / 2**20:.0f} MiB for {read / 2**20:.0f} MiB of keys and values read")
    return 0


if __name__ == "__main__":
    sys.exit(main())
