"""
How often does an unscaled softmax saturate?
============================================

How often does an unscaled softmax saturate at d_k = 128, 50 keys?

The lesson's claim, word for word (d_k = 128, 50 keys): "The unscaled top
weight is often > 0.9 (saturated); the scaled top weight is typically
0.05-0.2 (useful)." Unscaled, the scores q.k have standard deviation
sqrt(d_k). This measures both halves over many seeds (one query and 50 fresh
keys per seed) and prints the figures beside the claims.

Run: ``python examples/saturation_demo.py [--seeds 2000] [--results FILE.json]``   (exits 1 if a claim fails)
"""

import argparse
import sys

import numpy as np

from sdpa_ref import softmax

ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
ap.add_argument("--seeds", type=int, default=2000, help="independent draws (default: 2000)")
ap.add_argument("--d-k", type=int, default=128)
ap.add_argument("--n-keys", type=int, default=50)
ap.add_argument("--plot", metavar="FILE.png",
                help="draw the two histograms of the top weight (needs matplotlib); the PNG records the digest of "
                     "the bin counts it shows, which the docs build compares with the README's copy")
ap.add_argument("--results", metavar="FILE.json",
                help="write the measured figures, raw and formatted as printed, as JSON (the docs quote them)")
args = ap.parse_args()

tops_raw, tops_scaled = np.empty(args.seeds), np.empty(args.seeds)
for seed in range(args.seeds):          # one query per seed, as "run it with several seeds"
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(args.d_k)
    k = rng.standard_normal((args.n_keys, args.d_k))
    s = k @ q
    tops_raw[seed] = softmax(s).max()
    tops_scaled[seed] = softmax(s / np.sqrt(args.d_k)).max()

frac_sat = float(np.mean(tops_raw > 0.9))
se_sat = float(np.sqrt(frac_sat * (1 - frac_sat) / args.seeds))
in_band = float(np.mean((tops_scaled >= 0.05) & (tops_scaled <= 0.2)))
q05, q50, q95 = np.quantile(tops_scaled, [0.05, 0.5, 0.95])

print(f"d_k = {args.d_k}, {args.n_keys} keys, {args.seeds} seeds")
print(f"  unscaled: top weight > 0.9 in {frac_sat:.1%} of seeds (+- {se_sat:.1%}); "
      f"median top weight {np.median(tops_raw):.3f}")
print(f"  scaled:   top weight median {q50:.3f}, 5-95% range {q05:.3f}-{q95:.3f}; "
      f"{in_band:.1%} of seeds inside the claimed 0.05-0.2")

if args.results:
    import json
    with open(args.results, "w") as fh:
        json.dump({"settings": {"d_k": args.d_k, "n_keys": args.n_keys, "seeds": args.seeds},
                   "values": {"saturated": frac_sat, "saturated_se": se_sat,
                              "unscaled_median": float(np.median(tops_raw)),
                              "scaled_median": float(q50), "scaled_p05": float(q05), "scaled_p95": float(q95),
                              "in_band": in_band},
                   "text": {"saturated": f"{frac_sat:.1%}", "saturated_se": f"{se_sat:.1%}",
                            "unscaled_median": f"{np.median(tops_raw):.3f}", "scaled_median": f"{q50:.3f}",
                            "scaled_p05": f"{q05:.3f}", "scaled_p95": f"{q95:.3f}", "in_band": f"{in_band:.0%}"}},
                  fh, indent=1)

failures = []
if not frac_sat - 3 * se_sat > 0.5:
    failures.append(f"claim 'the unscaled top weight is often > 0.9' not supported: {frac_sat:.1%}")
if not 0.05 <= q50 <= 0.2:
    failures.append(f"claim 'the scaled top weight is typically 0.05-0.2' not supported: median {q50:.3f}")
print("\nclassic claim vs measurement:")
print(f"  'the unscaled top weight is often > 0.9' -> measured {frac_sat:.1%}: "
      f"{'holds' if frac_sat - 3 * se_sat > 0.5 else 'does NOT hold'} "
      f"(often: a majority of rows, not almost all: the top two scores are often close)")
print(f"  'the scaled top weight is typically 0.05-0.2' -> median {q50:.3f}, {in_band:.1%} inside: "
      f"{'holds' if 0.05 <= q50 <= 0.2 else 'does NOT hold'}")
if args.plot:
    import hashlib

    import matplotlib.pyplot as plt
    bins = np.linspace(0, 1, 41)
    counts = [np.histogram(t, bins)[0] for t in (tops_scaled, tops_raw)]
    digest = hashlib.sha256(np.asarray(counts, np.int64).tobytes()).hexdigest()[:16]
    fig, ax = plt.subplots(figsize=(8, 3.6), constrained_layout=True)
    for c, label, color in ((counts[0], f"scaled by 1/sqrt(d_k): median {q50:.3f}", "C0"),
                            (counts[1], f"unscaled: {frac_sat:.1%} of rows above 0.9", "C3")):
        ax.stairs(c / args.seeds, bins, fill=True, alpha=0.55, color=color, label=label)
    ax.axvline(0.9, color="0.3", ls="--", lw=1)
    ax.set_xlabel("top softmax weight of a row")
    ax.set_ylabel("share of rows")
    ax.set_xlim(0, 1)
    ax.legend(loc="upper center")
    ax.set_title(f"d_k = {args.d_k}, {args.n_keys} keys, q and k standard normal: {args.seeds} rows")
    fig.savefig(args.plot, dpi=100, metadata={"Description": f"sdpa_ref saturation_demo counts {digest}"})
    print(f"wrote {args.plot} (bin counts digest {digest})")     # the figure stays open for the docs gallery

for f in failures:
    print("FAIL:", f)
# exit status 1 with the failures on stderr (also where the docs gallery, which runs this file and shows its stdout,
# leaves them); success falls off the end
if failures:
    sys.exit("saturation_demo.py: " + "; ".join(failures))
