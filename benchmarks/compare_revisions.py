"""Time the dense fast engine, forward plus backward, against another git revision, side by side.

    python benchmarks/compare_revisions.py REV [--shape 1 8 1024 64] [--rounds 15]

Each round runs both trees in fresh subprocesses, one after the other, in
alternating order (so that neither inherits the other's threads), and each
subprocess reports the median of a few timed calls. The ratio is taken per
round; the script prints the median ratio and its range over the rounds,
with the thread settings it ran under. Timings on shared machines are noisy:
compare ratios from one run, never absolute times across runs.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

CODE = """
import time, numpy as np, sdpa_ref as s
r = np.random.default_rng(0)
shape = {shape}
q, k, v = (r.standard_normal(shape) for _ in range(3))
g = r.standard_normal(shape)
def once():
    out, res = s.sdpa_forward(q, k, v)
    s.sdpa_backward(res, g)
once()
ts = []
for _ in range({reps}):
    t0 = time.perf_counter(); once(); ts.append(time.perf_counter() - t0)
ts.sort()
print(ts[len(ts) // 2])
"""


def run(tree, shape, reps):
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, "-c", CODE.format(shape=tuple(shape), reps=reps)], env=env,
                         capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    return float(out.stdout)


def build(tree):
    """Build a tree's compiled kernels in place where it builds them at install (later revisions); earlier ones
    build them on first use by themselves. Without it a later revision would run its NumPy code: unfair."""
    setup = os.path.join(tree, "setup.py")
    if os.path.exists(setup) and "build_ext" in open(setup).read():
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, check=True,
                       capture_output=True)


def describe(tree):
    """Whether the tree's compiled kernels are in use (``sdpa_ref.info()`` where it has one)."""
    code = ("import sdpa_ref as s; i = getattr(s, 'info', None); k = i()['compiled_kernels'] if i else None; "
            "print('compiled kernels built on first use (no info())' if k is None else "
            "f\"compiled kernels in use, SIMD {k['simd_level']}\" if k['in_use'] else f\"NumPy only: {k['reason']}\")")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=tree), capture_output=True,
                         text=True, cwd=tempfile.gettempdir())
    return (out.stdout or out.stderr).strip().splitlines()[-1] if (out.stdout or out.stderr) else "?"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the git revision to compare against (e.g. HEAD~3 or a commit)")
    ap.add_argument("--shape", type=int, nargs=4, default=[1, 8, 1024, 64], metavar=("B", "H", "L", "E"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per subprocess (median taken)")
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "-C", here, "archive", args.rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        build(old)
        build(here)
        for tree in (here, old):
            print(f"{'this tree' if tree == here else args.rev}: {describe(tree)}")
        threads = {k: os.environ.get(k, "unset") for k in ("SDPA_REF_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
        print(f"shape {tuple(args.shape)} float64, fwd + bwd; {args.rounds} rounds; threads: {threads}")
        ratios = []
        for i in range(args.rounds):
            pair = [("new", here), ("old", old)] if i % 2 == 0 else [("old", old), ("new", here)]
            t = {name: run(tree, args.shape, args.reps) for name, tree in pair}
            ratios.append(t["new"] / t["old"])
            print(f"round {i + 1:2d}: this tree {t['new'] * 1e3:7.1f} ms, {args.rev} {t['old'] * 1e3:7.1f} ms, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        print(f"median ratio this tree / {args.rev}: {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f} to {max(ratios):.3f})")


if __name__ == "__main__":
    main()
