"""
Var(q.k) grows like d_k: measured
=================================

Var(q.k) = d_k for unit-variance q, k, and 1 after dividing by sqrt(d_k): measured.

For each d_k from 4 to 1024 this draws N independent pairs (q, k) of
standard normal vectors and estimates Var(q.k) with a 99.9% confidence
interval from the sample fourth moment (standard error of a sample variance:
sqrt((m4 - s^4) / N)), instead of a fixed tolerance. The theory
(Var = d_k; for Gaussians m4 = 3 d_k^2 + 6 d_k) must lie inside every interval.

Run: ``python examples/variance_growth.py [--n 20000]``   (exits 1 if a claim fails)
"""

import argparse
import sys

import numpy as np

ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
ap.add_argument("--n", type=int, default=20000, help="pairs per d_k (default: 20000)")
ap.add_argument("--seed", type=int, default=0)
args = ap.parse_args()

Z = 3.29                       # two-sided 99.9%
D_KS = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
failures = 0
print(f"{'d_k':>5} {'Var(q.k)':>10} {'99.9% CI':>21} {'theory':>7}   {'Var(q.k/sqrt(d_k))':>18} {'99.9% CI':>17}")
for d in D_KS:
    rng = np.random.default_rng([args.seed, d])
    dots = np.concatenate([
        np.einsum("nd,nd->n", rng.standard_normal((m, d)), rng.standard_normal((m, d)))
        for m in np.diff(np.linspace(0, args.n, 5).astype(int))
    ])
    rows = []
    for x, theory in ((dots, float(d)), (dots / np.sqrt(d), 1.0)):
        c = x - x.mean()
        var = float(np.mean(c**2))
        se = float(np.sqrt((np.mean(c**4) - var**2) / x.size))
        lo, hi = var - Z * se, var + Z * se
        ok = lo <= theory <= hi
        failures += not ok
        rows.append((var, lo, hi, ok))
    (v1, l1, h1, ok1), (v2, l2, h2, ok2) = rows
    print(f"{d:>5} {v1:>10.2f} [{l1:>8.2f}, {h1:>8.2f}]{'' if ok1 else '!'} {d:>7}   "
          f"{v2:>18.4f} [{l2:.4f}, {h2:.4f}]{'' if ok2 else '!'}")
print(f"\n{2 * len(D_KS) - failures} of {2 * len(D_KS)} intervals contain the theory "
      f"(Var(q.k) = d_k; scaled: 1); N = {args.n} pairs per d_k")
# exit status 1 with the failures on stderr (also where the docs gallery, which runs this file and shows its stdout,
# leaves them); success falls off the end
if failures:
    sys.exit(f"variance_growth.py: {failures} interval(s) do not contain the theory")
