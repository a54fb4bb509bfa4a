"""Peak memory of each attention path, forward + backward, in units of one ``L x S`` array.

Run: python benchmarks/bench_memory.py [--shape 1 8 2048 64] [--format table|json]

Each path runs in a fresh subprocess under :mod:`tracemalloc`, which NumPy
reports its array buffers to. The figure is the peak of traced memory during
``sdpa_forward`` + ``sdpa_backward`` minus what was traced before (the
inputs and ``grad_out``), divided by the bytes of one ``(B, H, L, S)``
float64 array: "3.0" means the path needs three score-sized arrays at its
peak, on top of its inputs. The counts come from the sizes of the arrays
allocated, not from timing, so they are the same on every machine for a
given version of NumPy and sdpa_ref.

* dense: ``sdpa_forward`` (the fast engine, ``P`` saved) + its backward;
* plain: ``method="plain"``, the teaching form, + its backward;
* lse: ``save_probs=False``, then the recomputing backward (FlashAttention's
  form, one block);
* tiled: ``block_size="auto"`` + the tiled backward.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CODE = r"""
import sys, tracemalloc
sys.path.insert(0, {root!r})
import numpy as np
from sdpa_ref import sdpa_backward, sdpa_forward
B, H, L, E = {shape}
rng = np.random.default_rng(0)
q, k, v, g = (rng.standard_normal((B, H, L, E)) for _ in range(4))
kw = {kw}
bkw = {bkw}
sdpa_backward(sdpa_forward(q[..., :8, :], k[..., :8, :], v[..., :8, :], **kw)[1], g[..., :8, :], **bkw)  # warm-up
tracemalloc.start()
base = tracemalloc.get_traced_memory()[0]
_, r = sdpa_forward(q, k, v, **kw)
gr = sdpa_backward(r, g, **bkw)
peak = tracemalloc.get_traced_memory()[1] - base
print(peak / (B * H * L * L * 8))
"""

PATHS = {
    "dense": ({}, {}),
    "plain": ({"method": "plain"}, {"method": "plain"}),
    "lse": ({"save_probs": False}, {}),
    "tiled": ({"block_size": "auto"}, {}),
}


def measure(shape, path):
    kw, bkw = PATHS[path]
    code = CODE.format(root=os.path.dirname(HERE), shape=tuple(shape), kw=kw, bkw=bkw)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 8, 2048, 64], metavar=("B", "H", "L", "E"),
                    help="query, key and value shape, L = S (default: 1 8 2048 64)")
    ap.add_argument("--format", choices=("table", "json"), default="table")
    args = ap.parse_args()
    rows = []
    for path in PATHS:
        rows.append({"path": path, "peak_in_LxS_arrays": measure(args.shape, path)})
        print(f"  measured {path}", file=sys.stderr)
    if args.format == "json":
        print(json.dumps({"shape": args.shape, "rows": rows}, indent=2))
        return
    B, H, L, E = args.shape
    print(f"peak extra memory of forward + backward at ({B}, {H}, {L}, {E}) float64, "
          f"in units of one (B, H, L, S) array ({B * H * L * L * 8 / 2**20:.0f} MiB)")
    for r in rows:
        print(f"  {r['path']:<6} {r['peak_in_LxS_arrays']:6.2f}")


if __name__ == "__main__":
    main()
