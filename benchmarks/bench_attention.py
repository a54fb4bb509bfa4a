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
* the GEMM bound, ``bound`` / ``bound32``: the six matmuls any attention
  forward + backward must do (Q K^T, P V, P^T dO, dO V^T, dS K, dS^T Q),
  run the fastest way this BLAS runs them at this shape and thread count:
  the least, in each round, of ``gemm_stacked`` (stacked 4-D ``np.matmul``
  on a BLAS with all the threads), ``gemm_pool`` (one head at a time per
  thread of a pool of that many threads, the BLAS held to one thread, as
  the package runs) and ``gemm_pool_t`` (the same, with ``P^T dO`` and
  ``dS^T Q`` computed as ``(dO^T P)^T`` and ``(Q^T dS)^T``, the form the fast
  path uses in float64); the run says which won how often.

At the end a table gives every target of the speed issue with the figure
measured and whether it is met: bound / dense >= 0.85 at (1, 8, 1024, 64)
and (4, 16, 512, 128) in float64 and float32, and dense / torch <= 0.8;
where torch is faster, how much faster and how much of the gap the BLAS
alone explains (torch's whole forward + backward against this BLAS's six
GEMMs); ``--copy-task`` times ``examples/copy_task.py --seeds 1`` in the
default environment (target 60 s); ``--memory-sizes 65536`` runs the
long-sequence target (768 MiB; about 8 minutes).

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
from concurrent.futures import ThreadPoolExecutor

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


def _six(q, k, v, g, transposed=False):
    """The six products of a forward + backward (P and dS stand in by Q K^T and dO V^T)."""
    def t(a):
        return np.swapaxes(a, -1, -2)

    s = q @ t(k)
    s @ v
    t(t(g) @ s) if transposed else t(s) @ g           # dV = P^T dO
    d = g @ t(v)
    d @ k
    t(t(q) @ d) if transposed else t(d) @ q           # dK = dS^T Q


def _gemm_contenders(q, k, v, g, threads):
    """The ways of running the six products: stacked on the threaded BLAS, or per head on a pool."""
    from threadpoolctl import threadpool_limits

    pool = ThreadPoolExecutor(threads)
    lead = q.shape[:-2]
    heads = [tuple(a[i] for a in (q, k, v, g)) for i in np.ndindex(*lead)]

    def pooled(transposed):
        with threadpool_limits(1):
            list(pool.map(lambda a: _six(*a, transposed=transposed), heads))

    return {"gemm_stacked": lambda: _six(q, k, v, g), "gemm_pool": lambda: pooled(False),
            "gemm_pool_t": lambda: pooled(True)}


def variants(shape, threads=1):
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

    out = {"dense": dense, "plain": plain, "tiled": tiled, "dense32": dense32}
    out.update(_gemm_contenders(q, k, v, g, threads))
    out.update({n + "32": f for n, f in _gemm_contenders(q32, k32, v32, g32, threads).items()})
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
fn = B.variants({shape}, {threads})[{name!r}]
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


GEMMS = ("gemm_stacked", "gemm_pool", "gemm_pool_t")
def add_bounds(times):
    """Add ``bound`` (and ``bound32``) to ``{contender: [seconds per round]}``: in each round the least time of the
    ways of running the six GEMMs that ran; return how often each way was the fastest."""
    won = {}
    for bound, suffix in (("bound", ""), ("bound32", "32")):
        ways = [g + suffix for g in GEMMS if g + suffix in times]
        if ways:
            per_round = np.array([times[w] for w in ways])
            times[bound] = [float(x) for x in per_round.min(axis=0)]
            won[bound] = {w: int(np.sum(per_round.argmin(axis=0) == i)) for i, w in enumerate(ways)}
    return won


CONTENDERS = ("dense", "plain", "tiled", *GEMMS, "dense32", *(g + "32" for g in GEMMS), "torch64", "torch32")


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
        won = add_bounds(times)
        med = {n: float(np.median(t)) for n, t in times.items()}

        def ratio(a, b):                          # the median over rounds of the ratio within each round
            r = np.array(times[a]) / np.array(times[b])
            return float(np.median(r)), float(r.min()), float(r.max())

        row = {"shape": "x".join(map(str, shape)), **{f"{n}_s": v for n, v in med.items()}, "bound_won": won}
        for a, b in [("bound", "dense"), ("bound32", "dense32"), ("plain", "dense"), ("tiled", "dense"),
                     ("dense", "torch64"), ("dense32", "torch32"), ("bound", "torch64"), ("bound32", "torch32")]:
            if a not in times or b not in times:
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
    """Rows ``(target, measured, met)`` for every target of the speed issue that this run measured. Where torch is
    faster than the dense path, ``met`` is None when the BLAS alone explains the whole gap (this BLAS's six GEMMs
    take longer than torch's whole forward + backward), and the row says how much of the gap it explains."""
    rows = []
    for r in result["timing"]:
        if r["shape"] not in TARGET_SHAPES:
            continue
        for dt, (g, d, t) in (("float64", ("bound", "dense", "torch64")),
                              ("float32", ("bound32", "dense32", "torch32"))):
            if f"{g}_over_{d}" in r:
                v = r[f"{g}_over_{d}"]
                rows.append((f"{r['shape']} {dt}: bound / dense >= 0.85", f"{v:.3f} ({r[f'{g}_over_{d}_min']:.3f}-"
                             f"{r[f'{g}_over_{d}_max']:.3f}) of the bound", v >= 0.85))
            if f"{d}_over_{t}" in r:
                v = r[f"{d}_over_{t}"]
                text = f"{v:.3f} ({r[f'{d}_over_{t}_min']:.3f}-{r[f'{d}_over_{t}_max']:.3f})"
                ok = v <= 0.8
                if v > 1 and f"{g}_over_{t}" in r:                  # torch is faster: by how much, and why
                    b = r[f"{g}_over_{t}"]                          # this BLAS's GEMMs over torch's whole call
                    explained = min(1.0, max(0.0, (b - 1) / (v - 1)))
                    text += (f"; torch is {v:.2f}x faster; the six GEMMs of this BLAS alone take {b:.2f} of its "
                             f"time, so the BLAS explains {explained:.0%} of the gap")
                    ok = None if explained >= 1 else False
                rows.append((f"{r['shape']} {dt}: dense / {t} <= 0.8", text, ok))
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
        for b, won in r["bound_won"].items():
            print(f"    {b} (the fastest way in each round) was: " + ", ".join(f"{w} {n}x" for w, n in won.items()))
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
            print("  (bound: not met, and out of reach here: the six bare GEMMs of this BLAS alone take longer "
                  "than torch's whole forward + backward)")


if __name__ == "__main__":
    main()
