"""Benchmark sdpa_ref's attention against PyTorch's CPU SDPA and the GEMM bound.

Run: python benchmarks/bench_attention.py [--repeat 7] [--format table|json] [--skip-memory]

All timings are forward + backward, float64 unless noted. Every contender
runs in a fresh process each round, with the same explicit thread count
(``--threads``, default the CPUs: the BLAS through threadpoolctl,
``SDPA_REF_NUM_THREADS``, ``torch.set_num_threads``), so none inherits or
leaves behind a spinning thread pool; each process warms up once and
reports the median of three calls. Rounds are interleaved, the order rotated
every round; every ratio is the median over rounds of the ratio of the two
times measured in the same round (which cancels the slow drift of a shared
machine), printed with its min-max. The thread state each contender was
measured under is printed. Absolute times vary between machines; compare
the ratios.

* dense: the default fast path; plain: method="plain" (the documented form);
  tiled: block_size=256; dense32: the fast path on float32 inputs with
  ``upcast=False`` (computed in float32);
* torch64 / torch32: torch.nn.functional.scaled_dot_product_attention forward
  and autograd backward, when torch is installed (same thread count);
* gemm / gemm32: the six bare matmuls any attention forward + backward must
  do (Q K^T, P V, P^T dO, dO V^T, dS K, dS^T Q), float64 / float32: the GEMM
  bound.

At the end a table gives every target of the speed issue with the figure
measured and whether it is met: gemm / dense >= 0.85 and dense / torch <=
0.8 at (1, 8, 1024, 64) and (4, 16, 512, 128) in float64 and float32;
``--copy-task`` times ``examples/copy_task.py`` in the default environment
(target 60 s); ``--memory-sizes 65536`` runs the long-sequence target (768
MiB; about 8 minutes).

Also, in subprocesses (VmHWM from /proc/self/status), the peak resident memory of the whole process for the
tiled path at L = S = 4096 and 16384 (one head, E = 64, float64), and the
time of a full gradient check of attention on (2, 2, 16, 8) inputs: sdpa_ref's
check_vjp (scalar and vectorized) against torch.autograd.gradcheck.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from sdpa_ref import sdpa_backward, sdpa_forward  # noqa: E402

#: The issue's two target shapes, then two small ones.
SHAPES = [(1, 8, 1024, 64), (4, 16, 512, 128), (2, 4, 256, 64), (4, 8, 128, 64)]
TARGET_SHAPES = ("1x8x1024x64", "4x16x512x128")

try:
    import torch
except ImportError:  # the benchmark runs without torch too
    torch = None


def variants(shape):
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(shape) for _ in range(4))

    def dense():
        _, r = sdpa_forward(q, k, v)
        sdpa_backward(r, g)

    def plain():
        _, r = sdpa_forward(q, k, v, method="plain")
        sdpa_backward(r, g, method="plain")

    def tiled():
        _, r = sdpa_forward(q, k, v, block_size=256)
        sdpa_backward(r, g)

    q32, k32, v32, g32 = (a.astype(np.float32) for a in (q, k, v, g))

    def dense32():
        _, r = sdpa_forward(q32, k32, v32, upcast=False)
        sdpa_backward(r, g32)

    def gemms(q, k, v, g):
        s = q @ np.swapaxes(k, -1, -2)
        s @ v
        np.swapaxes(s, -1, -2) @ g
        d = g @ np.swapaxes(v, -1, -2)
        d @ k
        np.swapaxes(d, -1, -2) @ q

    out = {"dense": dense, "plain": plain, "tiled": tiled, "gemm": lambda: gemms(q, k, v, g), "dense32": dense32,
           "gemm32": lambda: gemms(q32, k32, v32, g32)}
    if torch is not None:
        for name, dt in (("torch64", torch.float64), ("torch32", torch.float32)):
            tq, tk, tv = (torch.tensor(a, dtype=dt, requires_grad=True) for a in (q, k, v))
            tg = torch.tensor(g, dtype=dt)

            def run(tq=tq, tk=tk, tv=tv, tg=tg):
                for t in (tq, tk, tv):
                    t.grad = None
                o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
                o.backward(tg)

            out[name] = run
    return out


ISOLATED = r"""
import json, os, sys, time
os.environ["SDPA_REF_NUM_THREADS"] = "{threads}"
sys.path.insert(0, {here!r})
sys.path.insert(0, {root!r})
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits
import bench_attention as B
threadpool_limits({threads})                     # the BLAS (and any OpenMP) of this process: the same for everyone
if B.torch is not None:
    B.torch.set_num_threads({threads})
fn = B.variants({shape})[{name!r}]
fn()                                             # warm up
ts = []
for _ in range({inner}):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
state = {{"blas": [dict(api=i.get("internal_api"), version=i.get("version"), threads=i.get("num_threads"))
                   for i in threadpool_info()],
          "torch_threads": None if B.torch is None else B.torch.get_num_threads(),
          "sdpa_ref_threads": os.environ["SDPA_REF_NUM_THREADS"]}}
print(json.dumps({{"seconds": float(np.median(ts)), "state": state}}))
"""


CONTENDERS = ("dense", "plain", "tiled", "gemm", "dense32", "gemm32", "torch64", "torch32")


def time_shapes(repeat, threads, inner=3, shapes=SHAPES, contenders=CONTENDERS):
    """Every contender in its own fresh process each round, all with the same thread setting, rounds interleaved
    (the order rotated): none inherits or leaves behind a spinning thread pool."""
    rows, states = [], {}
    names = [n for n in contenders if torch is not None or not n.startswith("torch")]
    for shape in shapes:
        times = {n: [] for n in names}
        for rnd in range(repeat):
            for n in names[rnd % len(names):] + names[:rnd % len(names)]:
                code = ISOLATED.format(threads=threads, here=HERE, root=os.path.dirname(HERE), shape=tuple(shape),
                                       name=n, inner=inner)
                out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                times[n].append(got["seconds"])
                states[n] = got["state"]
        med = {n: float(np.median(t)) for n, t in times.items()}

        def ratio(a, b):                          # the median over rounds of the ratio within each round
            r = np.array(times[a]) / np.array(times[b])
            return float(np.median(r)), float(r.min()), float(r.max())

        row = {"shape": "x".join(map(str, shape)), **{f"{n}_s": v for n, v in med.items()}}
        for a, b in [("gemm", "dense"), ("gemm32", "dense32"), ("plain", "dense"), ("tiled", "dense"),
                     ("dense", "torch64"), ("dense32", "torch32"), ("gemm", "torch64"), ("gemm32", "torch32")]:
            if a not in names or b not in names:
                continue
            row[f"{a}_over_{b}"], row[f"{a}_over_{b}_min"], row[f"{a}_over_{b}_max"] = ratio(a, b)
        rows.append(row)
        print(f"  timed {row['shape']}", file=sys.stderr)
    return rows, states


MEMORY_CODE = r"""
import resource, sys, time, numpy as np
sys.path.insert(0, {root!r})
from sdpa_ref import sdpa_forward, sdpa_backward
L = {L}
rng = np.random.default_rng(0)
q, k, v, g = (rng.standard_normal((1, L, 64)) for _ in range(4))
t0 = time.perf_counter()
_, r = sdpa_forward(q, k, v, block_size="auto")
gr = sdpa_backward(r, g)
dt = time.perf_counter() - t0
assert np.isfinite(gr.query).all()
# VmHWM: the peak RSS of this process image. ru_maxrss is not used on Linux
# because it survives exec and can report the parent's high-water mark.
peak = None
try:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
except OSError:
    pass
if peak is None:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(peak, dt, r.block_size)
"""


def memory(Ls):
    rows = []
    for L in Ls:
        code = MEMORY_CODE.format(root=os.path.dirname(HERE), L=L)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        rss, secs, block = out.split()
        rows.append({"L=S": L, "peak_rss_MiB": float(rss), "seconds": float(secs), "block_size": int(block),
                     "dense_P_alone_MiB": L * L * 8 / 2**20})
        print(f"  memory L=S={L}: {float(rss):.0f} MiB", file=sys.stderr)
    return rows


COPY_TASK = os.path.join(os.path.dirname(HERE), "examples", "copy_task.py")


def copy_task():
    """Seconds of ``examples/copy_task.py --seeds 1`` (one seed, both scalings: the run the target was set for) in a
    fresh process under the default environment (no thread settings)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                            "MKL_NUM_THREADS", "SDPA_REF_NUM_THREADS")}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, COPY_TASK, "--seeds", "1"], capture_output=True, text=True, check=True, env=env)
    return time.perf_counter() - t0


def targets(result):
    """Rows ``(target, measured, met)`` for every target of the speed issue that this run measured; ``met`` is None
    for a torch target that is missed where the bare GEMMs alone already take more than 0.8 of torch's time
    (the issue asks for 0.8 "where the GEMM bound allows it")."""
    rows = []
    for r in result["timing"]:
        if r["shape"] not in TARGET_SHAPES:
            continue
        for dt, (g, d, t) in (("float64", ("gemm", "dense", "torch64")), ("float32", ("gemm32", "dense32", "torch32"))):
            if f"{g}_over_{d}" in r:
                v = r[f"{g}_over_{d}"]
                rows.append((f"{r['shape']} {dt}: gemm / dense >= 0.85", f"{v:.3f} ({r[f'{g}_over_{d}_min']:.3f}-"
                             f"{r[f'{g}_over_{d}_max']:.3f})", v >= 0.85))
            if f"{d}_over_{t}" in r:
                v = r[f"{d}_over_{t}"]
                bound = r.get(f"{g}_over_{t}")             # the bare GEMMs against torch: what the bound allows
                ok = True if v <= 0.8 else (None if bound is not None and bound > 0.8 else False)
                rows.append((f"{r['shape']} {dt}: dense / {t} <= 0.8", f"{v:.3f} ({r[f'{d}_over_{t}_min']:.3f}-"
                             f"{r[f'{d}_over_{t}_max']:.3f})" + ("" if bound is None else
                                                                 f"; the GEMMs alone {bound:.3f}"), ok))
    if result.get("copy_task_s") is not None:
        rows.append(("copy task (default environment) <= 60 s", f"{result['copy_task_s']:.1f} s",
                     result["copy_task_s"] <= 60))
    for m in result["memory"]:
        if m["L=S"] >= 65536:
            rows.append((f"tiled L = S = {m['L=S']}, E = 64: peak RSS <= 768 MiB",
                         f"{m['peak_rss_MiB']:.0f} MiB, {m['seconds']:.0f} s", m["peak_rss_MiB"] <= 768))
    return rows


def gradcheck_speed(repeat=7):
    """Full-Jacobian gradient checks, interleaved rounds; the ratio is the median of per-round ratios."""
    from sdpa_ref import check_vjp

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2, 16, 8)) for _ in range(3))

    def fun(q, k, v):
        return sdpa_forward(q, k, v)[0]

    def vjp(g, q, k, v):
        gr = sdpa_backward(sdpa_forward(q, k, v)[1], g)
        return gr.query, gr.key, gr.value

    def ours(**kw):
        assert check_vjp(fun, vjp, (q, k, v), mode="full", **kw).ok

    fns = {"check_vjp_full_s": ours, "check_vjp_full_vectorized_s": lambda: ours(vectorized=True)}
    if torch is not None:
        tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))

        def theirs():
            assert torch.autograd.gradcheck(torch.nn.functional.scaled_dot_product_attention, (tq, tk, tv))

        fns["torch_gradcheck_s"] = theirs
    times = {n: [] for n in fns}
    names = list(fns)
    for rnd in range(repeat):
        for n in names[rnd % len(names):] + names[:rnd % len(names)]:
            time.sleep(0.05)
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    res = {n: float(np.median(t)) for n, t in times.items()}
    if torch is not None:
        res["torch_over_ours_vectorized"] = float(np.median(
            np.array(times["torch_gradcheck_s"]) / np.array(times["check_vjp_full_vectorized_s"])))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7, help="interleaved rounds per shape (default: 7)")
    ap.add_argument("--threads", type=int, default=None,
                    help="the thread count every contender gets: BLAS, sdpa_ref's pool, torch (default: the CPUs)")
    ap.add_argument("--shapes", type=str, nargs="+", default=None, metavar="BxHxLxE",
                    help="shapes to time (default: " + " ".join("x".join(map(str, s)) for s in SHAPES) + ")")
    ap.add_argument("--format", choices=("table", "json"), default="table")
    ap.add_argument("--skip-memory", action="store_true", help="skip the memory runs")
    ap.add_argument("--skip-gradcheck", action="store_true", help="skip the gradient-check timing")
    ap.add_argument("--memory-sizes", type=int, nargs="+", default=[4096, 16384],
                    help="L = S of the tiled memory runs (default: 4096 16384; the target is 65536)")
    ap.add_argument("--copy-task", action="store_true", help="also time examples/copy_task.py (about a minute)")
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS), metavar="NAME",
                    help="the contenders to time (default: all of " + ", ".join(CONTENDERS) + "; torch's only when "
                         "torch is installed); a ratio or target is reported where both of its contenders ran")
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = args.threads or cpus
    shapes = SHAPES if args.shapes is None else [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    result = {"numpy": np.__version__, "torch": None if torch is None else torch.__version__, "cpus": cpus,
              "threads": threads,
              "env": {n: os.environ.get(n) for n in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                                     "SDPA_REF_NUM_THREADS")}}
    result["memory"] = [] if args.skip_memory else memory(args.memory_sizes)   # first, while this process is small
    result["timing"], result["thread_state"] = time_shapes(args.repeat, threads, shapes=shapes,
                                                          contenders=args.contenders)
    result["gradcheck"] = {} if args.skip_gradcheck else gradcheck_speed()
    result["copy_task_s"] = copy_task() if args.copy_task else None
    result["targets"] = [dict(target=t, measured=m, met=ok) for t, m, ok in targets(result)]
    if args.format == "json":
        print(json.dumps(result, indent=2))
        return
    print(f"numpy {result['numpy']}, torch {result['torch']}, {cpus} CPUs; every contender in a fresh process "
          f"with {threads} thread(s) (BLAS, sdpa_ref's pool, torch); forward + backward, float64 unless named; "
          f"medians over {args.repeat} interleaved rounds, ratios per round (median, min-max)")
    print(f"environment: {result['env']}")
    for n, st in result["thread_state"].items():
        print(f"  measured under, {n}: {st}")
    print()
    for r in result["timing"]:
        times = ", ".join(f"{k[:-2]} {v * 1000:.1f} ms" for k, v in r.items() if k.endswith("_s"))
        print(f"{r['shape']}: {times}")
        for k in [k for k in r if "_over_" in k and not k.endswith(("_min", "_max"))]:
            print(f"    {k:<22} {r[k]:.3f} ({r[k + '_min']:.3f}-{r[k + '_max']:.3f})")
    gc = result["gradcheck"]
    if gc:
        print("\ngradient check, attention on (2, 2, 16, 8), full Jacobian, float64:")
        for k, v in gc.items():
            print(f"  {k:<30} {v:.4f}")
    if result["memory"]:
        print("\ntiled path, one head, E = 64, float64, block_size='auto' (peak RSS of the whole process):")
        for r in result["memory"]:
            print(f"  L = S = {r['L=S']:>6}: {r['peak_rss_MiB']:8.1f} MiB peak, {r['seconds']:7.2f} s, block "
                  f"{r['block_size']} (a dense P alone would be {r['dense_P_alone_MiB']:.0f} MiB)")
    if result["targets"]:
        print("\ntargets (this run, the thread state above):")
        for t in result["targets"]:
            verdict = {True: "met    ", False: "NOT met", None: "bound  "}[t["met"]]
            print(f"  {verdict}  {t['target']:<48} {t['measured']}")
        if any(t["met"] is None for t in result["targets"]):
            print("  (bound: not met, and out of reach here: the six bare GEMMs of this BLAS alone take more than "
                  "0.8 times torch's whole forward + backward)")


if __name__ == "__main__":
    main()
