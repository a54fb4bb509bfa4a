"""One table of sdpa_ref's speed: each case against PyTorch's CPU SDPA and against the bound of the work it must do.

Run: python benchmarks/bench_table.py [--quick] [--json] [--output FILE] [--rounds 5] [--threads N]

The table crosses the cases {no mask, causal, sliding window, GQA 32/8,
decode against a paged cache, packed varlen} with {float64, float32 with
``upcast=False``} and L = S in {128, 1024, 4096}; then the per-call overhead
(2x2x16x8 causal, 1x1x4x4) and second order (``sdpa_hvp`` against PyTorch's
reverse over reverse on its SDPA math path, and against our own forward +
backward). Every timing is forward + backward except decode (a forward, one
query token against L keys, ``save_probs=False``, as a server runs it).

Each row runs in a fresh process with the same thread count everywhere
(``--threads``, default the CPUs: the BLAS through threadpoolctl,
``SDPA_REF_NUM_THREADS``, ``torch.set_num_threads``); within it the
contenders are timed in interleaved rounds, the order rotated every round,
and every ratio is the median over rounds of the ratio measured in the same
round, printed with its min-max. PyTorch's side of each case:

* no mask, causal, GQA: ``scaled_dot_product_attention`` with ``is_causal`` /
  ``enable_gqa``; sliding window (``window=(L // 4, 0)``): a boolean band mask
  (PyTorch has no window argument);
* decode (Hq = 32, Hkv = 8, E = 128, pages of 256 keys in random order): on
  the cache already gathered into one dense array (the gather not timed);
* packed varlen (four causal sequences of L/8, L/4, 3L/8 and L/4 tokens,
  ``Packed``): one call per sequence (PyTorch's CPU SDPA has no varlen form).

The bound is the work a forward + backward must do, timed with NumPy in
the same rounds, one head per task on a pool of as many threads, the BLAS
on one thread: the six GEMMs (``bench_attention``'s fastest way) scaled by
the fraction of 64 x 64 blocks of the score matrix with an allowed entry,
``P``'s round trip (one write and one read of the allowed blocks) and one
``exp`` per allowed score. ``ours / bound`` >= 1; how far above 1 is what a
schedule leaves on the table. Decode's bound is its two products and one
``exp`` per key.

``--output FILE`` writes the results (JSON, with the date and the machine)
that ``docs/performance.md`` draws its figure from (``docs/_figures.py``;
the docs build reads the file and never runs the benchmark). ``--quick``:
L in {128, 1024}, three rounds, second order at 1x4x512x64 only (a few
minutes on two cores). Absolute times vary between machines; compare ratios.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

CASES = ("none", "causal", "window", "gqa", "decode", "varlen")
CASE_TITLES = {"none": "no mask", "causal": "causal", "window": "sliding window", "gqa": "GQA 32/8",
               "decode": "decode, paged", "varlen": "packed varlen"}
DTYPES = ("float64", "float32")
LENGTHS = (128, 1024, 4096)
QUICK_LENGTHS = (128, 1024)
OVERHEAD_SHAPES = (((2, 2, 16, 8), True), ((1, 1, 4, 4), False))
SECOND_ORDER_SHAPES = ((1, 4, 512, 64), (1, 8, 1024, 64))
BLOCK = 64                     # the tile whose allowed entries the bound counts
PAGE_SIZE = 256
VARLEN_PARTS = (1, 2, 3, 2)    # eighths of L


def dims(case, L):
    """``(B, Hq, Hkv, E)`` of a case at ``L``: 8 heads of 64 up to L = 1024 and 4 beyond (GQA 32/8 and 4/1, so
    that one L x S buffer stays at 512 MiB in float64); decode is 32/8 heads of 128, as served models have."""
    if case == "decode":
        return 1, 32, 8, 128
    if case == "gqa":
        return (1, 32, 8, 64) if L <= 1024 else (1, 4, 1, 64)
    return (1, 8, 8, 64) if L <= 1024 else (1, 4, 4, 64)


def varlen_lengths(L):
    """The packed sequences' lengths: L/8, L/4, 3L/8 and L/4 (the last takes the remainder)."""
    n = [L * p // 8 for p in VARLEN_PARTS[:-1]]
    return n + [L - sum(n)]


def allowed(case, L):
    """The boolean ``L x S`` matrix of the allowed scores of a case (one query row for decode)."""
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    if case in ("none", "gqa"):
        return np.ones((L, L), bool)
    if case == "causal":
        return j <= i
    if case == "window":
        return (j <= i) & (j >= i - L // 4)
    if case == "decode":
        return np.ones((1, L), bool)
    if case == "varlen":
        seq = np.repeat(np.arange(4), varlen_lengths(L))
        return (seq[:, None] == seq[None, :]) & (j <= i)
    raise ValueError(f"`case` should be one of {CASES}, but got {case!r}")


def fractions(case, L, block=BLOCK):
    """``(exact, blocks)``: the fraction of allowed scores, and of ``block x block`` tiles with an allowed one."""
    a = allowed(case, L)
    rows, cols = -(-a.shape[0] // block), -(-a.shape[1] // block)
    pad = np.zeros((rows * block, cols * block), bool)
    pad[:a.shape[0], :a.shape[1]] = a
    tiles = pad.reshape(rows, block, cols, block).any(axis=(1, 3))
    exact = float(a.mean())
    # a tile's share is the scores it covers inside the matrix (the last row and column of tiles may be partial)
    h = np.minimum(block, a.shape[0] - np.arange(rows) * block)[:, None]
    w = np.minimum(block, a.shape[1] - np.arange(cols) * block)[None, :]
    return exact, float((tiles * h * w).sum() / a.size)


def problem(case, dtype, L, seed=0, sizes=None):
    """``{"ours": fn, "torch": fn or None}`` for one cell; each ``fn()`` returns what it computed (the output and
    the gradients of q, k, v as NumPy arrays; decode only the output), so a test can hold both to one answer.
    ``sizes`` overrides :func:`dims` (tests)."""
    import sdpa_ref

    B, Hq, Hkv, E = sizes or dims(case, L)
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    kw = {"upcast": False} if dt == np.float32 else {}
    fns = {}
    if case == "decode":
        pages = -(-L // PAGE_SIZE)
        q = rng.standard_normal((B, 1, Hq, E)).astype(dt)
        kc, vc = (rng.standard_normal((pages, PAGE_SIZE, Hkv, E)).astype(dt) for _ in range(2))
        table = rng.permutation(pages)[None]
        lay = sdpa_ref.KVCache(cache_seqlens=np.array([L]), block_table=table)

        def ours():
            return [sdpa_ref.sdpa_forward(q, kc, vc, layout=lay, enable_gqa=True, is_causal=True,
                                          causal_alignment="bottom_right", save_probs=False, **kw)[0]]
        fns["ours"] = ours
        gathered = [np.ascontiguousarray(c[table[0]].reshape(1, pages * PAGE_SIZE, Hkv, E)[:, :L].transpose(0, 2, 1, 3))
                    for c in (kc, vc)]
        dense = (np.ascontiguousarray(q.transpose(0, 2, 1, 3)), *gathered)
        fns["torch"] = _torch_decode(dense)
        return fns
    if case == "varlen":
        T = L
        q, k, v, g = (rng.standard_normal((T, Hq, E)).astype(dt) for _ in range(4))
        cu = np.concatenate([[0], np.cumsum(varlen_lengths(L))])
        lay = sdpa_ref.Packed(cu_seqlens_q=cu, cu_seqlens_k=cu)

        def ours():
            out, res = sdpa_ref.sdpa_forward(q, k, v, layout=lay, is_causal=True, **kw)
            gr = sdpa_ref.sdpa_backward(res, g)
            return [out, gr.query, gr.key, gr.value]
        fns["ours"] = ours
        fns["torch"] = _torch_varlen(q, k, v, g, cu)
        return fns
    q, g = (rng.standard_normal((B, Hq, L, E)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((B, Hkv, L, E)).astype(dt) for _ in range(2))
    opts = {"none": {}, "gqa": {"enable_gqa": True}, "causal": {"is_causal": True},
            "window": {"window": (L // 4, 0)}}[case]

    def ours():
        out, res = sdpa_ref.sdpa_forward(q, k, v, **opts, **kw)
        gr = sdpa_ref.sdpa_backward(res, g)
        return [out, gr.query, gr.key, gr.value]
    fns["ours"] = ours
    mask = allowed(case, L) if case == "window" else None
    fns["torch"] = _torch_dense(q, k, v, g, is_causal=case == "causal", enable_gqa=case == "gqa", mask=mask)
    return fns


def _torch():
    try:
        import torch
    except ImportError:  # the benchmark runs without torch: no ratios to it
        return None
    return torch


def _torch_dense(q, k, v, g, is_causal=False, enable_gqa=False, mask=None):
    torch = _torch()
    if torch is None:
        return None
    F = torch.nn.functional
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tg, tm = torch.tensor(g), None if mask is None else torch.tensor(mask)

    def run():
        for t in (tq, tk, tv):
            t.grad = None
        out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, is_causal=is_causal, enable_gqa=enable_gqa)
        out.backward(tg)
        return [out.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()]
    return run


def _torch_decode(dense):
    torch = _torch()
    if torch is None:
        return None
    tq, tk, tv = (torch.tensor(a) for a in dense)

    def run():
        with torch.no_grad():
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        return [out.numpy().transpose(0, 2, 1, 3)]
    return run


def _torch_varlen(q, k, v, g, cu):
    torch = _torch()
    if torch is None:
        return None
    F = torch.nn.functional
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tg = torch.tensor(g)
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def run():
        for t in (tq, tk, tv):
            t.grad = None
        # (T, H, E) -> one (1, H, l, E) call per sequence, the outputs packed back
        outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (tq, tk, tv)),
                                               is_causal=True)[0].transpose(0, 1) for a, b in spans]
        out = torch.cat(outs)
        out.backward(tg)
        return [out.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()]
    return run


def bound_parts(case, dtype, L, threads, seed=0):
    """``{"gemm": fn, "exp": fn, "p_round_trip": fn}``: the bound's primitives at a cell's full size (scaled by the
    allowed fractions afterwards), one head per task on a pool of ``threads`` (the BLAS held to one thread)."""
    from concurrent.futures import ThreadPoolExecutor

    import bench_attention
    from threadpoolctl import threadpool_limits

    B, Hq, Hkv, E = dims(case, L)
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    rows = 1 if case == "decode" else L
    q, g = (rng.standard_normal((B, Hq, rows, E)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((B, Hq, L, E)).astype(dt) for _ in range(2))   # GQA: the same products per q head
    pool = ThreadPoolExecutor(threads)
    heads = list(np.ndindex(B, Hq))
    scores = rng.standard_normal((B, Hq, rows, L)).astype(dt)
    out = np.empty_like(scores)

    def pooled(fn):
        def run():
            with threadpool_limits(1):
                list(pool.map(fn, heads))
        return run

    if case == "decode":                           # each kv head's keys read once, by its group of query heads
        qg = rng.standard_normal((B, Hkv, Hq // Hkv, E)).astype(dt)
        kv = [rng.standard_normal((B, Hkv, L, E)).astype(dt) for _ in range(2)]
        groups = list(np.ndindex(B, Hkv))

        def gemm():
            with threadpool_limits(1):
                list(pool.map(lambda h: (qg[h] @ kv[0][h].T) @ kv[1][h], groups))
    else:
        ways = bench_attention._gemm_contenders(q, k, v, g, threads)
        gemm = ways["gemm_pool_t"] if dt == np.float64 else ways["gemm_pool"]
    parts = {"gemm": gemm, "exp": pooled(lambda h: np.exp(scores[h], out=out[h]))}
    if case != "decode":
        parts["p_round_trip"] = pooled(lambda h: np.copyto(out[h], scores[h]))
    return parts


def _timed(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def interleaved(fns, rounds, min_time=0.02):
    """``{name: [seconds per call, one per round]}``: every function warmed up, then called in rounds with the order
    rotated; a function faster than ``min_time`` is called enough times per round to take about that long."""
    names = [n for n, f in fns.items() if f is not None]
    reps = {}
    for n in names:
        t0 = time.perf_counter()
        fns[n]()
        reps[n] = max(1, min(1000, int(min_time / max(time.perf_counter() - t0, 1e-7))))
    times = {n: [] for n in names}
    for rnd in range(rounds):
        for n in names[rnd % len(names):] + names[:rnd % len(names)]:
            times[n].append(_timed(fns[n], reps[n]))
    return times


def ratio(times, a, b):
    """``(median, min, max)`` over rounds of ``a / b`` measured in the same round, or None."""
    if a not in times or b not in times:
        return None
    r = np.array(times[a]) / np.array(times[b])
    return float(np.median(r)), float(r.min()), float(r.max())


def measure_cell(case, dtype, L, threads, rounds):
    """One row of the table (run in its own process by :func:`main`)."""
    fns = problem(case, dtype, L)
    parts = bound_parts(case, dtype, L, threads)
    times = interleaved({**fns, **parts}, rounds)
    exact, blocks = fractions(case, L)
    # the bound per round: the GEMMs and P's round trip over the allowed tiles, one exp per allowed score
    times["bound"] = [blocks * (times["gemm"][i] + (times["p_round_trip"][i] if "p_round_trip" in times else 0.0))
                      + exact * times["exp"][i] for i in range(rounds)]
    med = {n: float(np.median(t)) for n, t in times.items()}
    return {"case": case, "dtype": dtype, "L": L, "dims": list(dims(case, L)), "allowed": exact,
            "allowed_blocks": blocks, **{f"{n}_s": v for n, v in med.items()},
            "ours_over_torch": ratio(times, "ours", "torch"), "ours_over_bound": ratio(times, "ours", "bound")}


def measure_overhead(shape, causal, rounds):
    """Forward + backward of a small float64 call, ours against PyTorch's: the per-call cost."""
    import sdpa_ref

    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(shape) for _ in range(4))

    def ours():
        _, res = sdpa_ref.sdpa_forward(q, k, v, is_causal=causal)
        sdpa_ref.sdpa_backward(res, g)
    times = interleaved({"ours": ours, "torch": _torch_dense(q, k, v, g, is_causal=causal)}, rounds, min_time=0.05)
    return {"shape": "x".join(map(str, shape)), "causal": causal,
            **{f"{n}_s": float(np.median(t)) for n, t in times.items()},
            "ours_over_torch": ratio(times, "ours", "torch")}


def measure_second_order(shape, rounds):
    """``sdpa_hvp`` (causal, float64, a direction in q, k and v) against PyTorch's reverse over reverse on its SDPA
    math path, and against our own forward + backward."""
    import sdpa_ref

    rng = np.random.default_rng(0)
    q, k, v, g, dq, dk, dv = (rng.standard_normal(shape) for _ in range(7))

    def hvp():
        sdpa_ref.sdpa_hvp((q, k, v), (dq, dk, dv), g, is_causal=True)

    def first():
        _, res = sdpa_ref.sdpa_forward(q, k, v, is_causal=True)
        sdpa_ref.sdpa_backward(res, g)
    fns = {"ours": hvp, "ours_first_order": first, "torch": None}
    torch = _torch()
    if torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        xs = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
        us, tg = [torch.tensor(a) for a in (dq, dk, dv)], torch.tensor(g)

        def reverse_over_reverse():
            with sdpa_kernel(SDPBackend.MATH):
                out = torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=True)
            grads = torch.autograd.grad((out * tg).sum(), xs, create_graph=True)
            torch.autograd.grad(grads, xs, grad_outputs=us)
        fns["torch"] = reverse_over_reverse
    times = interleaved(fns, rounds)
    return {"shape": "x".join(map(str, shape)), **{f"{n}_s": float(np.median(t)) for n, t in times.items()},
            "ours_over_torch": ratio(times, "ours", "torch"),
            "ours_over_first_order": ratio(times, "ours", "ours_first_order")}


CHILD = r"""
import json, os, sys
os.environ["SDPA_REF_NUM_THREADS"] = "{threads}"
sys.path.insert(0, {here!r})
from threadpoolctl import threadpool_limits
import bench_table as T
threadpool_limits({threads})
torch = T._torch()
if torch is not None:
    torch.set_num_threads({threads})
print(json.dumps(getattr(T, {fn!r})(*{args!r})))
"""


def in_child(fn, args, threads):
    """``fn(*args)`` of this module in a fresh process with ``threads`` threads everywhere; its JSON result."""
    code = CHILD.format(threads=threads, here=HERE, fn=fn, args=tuple(args))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine():
    """The machine a run was made on, in words."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), model)
    except OSError:
        pass
    return (f"{model}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, {huge_pages()}, "
            f"{blas_and_simd()}")


def blas_and_simd():
    """Whether the BLAS is held to one thread inside the package's pool (threadpoolctl, a dependency: without it
    each worker's GEMMs start the BLAS's own threads, and two of them on two cores run far slower), and the SIMD
    build the compiled kernels run (``sdpa_ref.info()``): both move the ratios."""
    from sdpa_ref import _threads
    from sdpa_ref.exact import _native
    held = "BLAS held in the pool" if _threads._controllers() else "threadpoolctl missing: the BLAS is not held"
    st = _native.status()
    simd = f"kernels {st['simd_level']}" if st["in_use"] else "no compiled kernels"
    return f"{held}; {simd}"


def huge_pages():
    """Whether NumPy asks for transparent huge pages for its large arrays, and the kernel's setting: on a virtual
    machine whose host backs memory on first touch, a huge-page fault can cost milliseconds, and the path that
    allocates more pays more (``docs/performance.md``), so every ratio moves with it."""
    try:
        asks = bool(np._core.multiarray._get_madvise_hugepage())
    except AttributeError:
        try:
            asks = bool(np.core.multiarray._get_madvise_hugepage())
        except AttributeError:
            asks = None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            kernel = fh.read().strip()
    except OSError:
        kernel = "unknown"
    numpy_says = {True: "NumPy asks for them", False: "NumPy does not ask (NUMPY_MADVISE_HUGEPAGE=0)",
                  None: "NumPy's setting unknown"}[asks]
    return f"huge pages: {numpy_says}; kernel {kernel}"


def run(quick=False, rounds=None, threads=None, cases=CASES, dtypes=DTYPES, lengths=None, second_order=None,
        log=sys.stderr):
    """Measure everything; the results as a JSON-ready dict."""
    import sdpa_ref

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = threads or cpus
    rounds = rounds or (3 if quick else 5)
    lengths = lengths or (QUICK_LENGTHS if quick else LENGTHS)
    second_order = second_order or (SECOND_ORDER_SHAPES[:1] if quick else SECOND_ORDER_SHAPES)
    torch = _torch()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": machine(), "threads": threads, "rounds": rounds, "quick": quick,
              "versions": {"sdpa_ref": sdpa_ref.__version__, "numpy": np.__version__,
                           "torch": None if torch is None else torch.__version__, "python": platform.python_version()},
              "cells": [], "overhead": [], "second_order": []}
    for case in cases:
        for dtype in dtypes:
            for L in lengths:
                result["cells"].append(in_child("measure_cell", (case, dtype, L, threads, rounds), threads))
                print(f"  timed {case} {dtype} L={L}", file=log)
    for shape, causal in OVERHEAD_SHAPES:
        result["overhead"].append(in_child("measure_overhead", (shape, causal, rounds), threads))
    for shape in second_order:
        result["second_order"].append(in_child("measure_second_order", (shape, rounds), threads))
        print(f"  timed second order {shape}", file=log)
    return result


def _r(x):
    return "-" if x is None else f"{x[0]:.2f} ({x[1]:.2f}-{x[2]:.2f})"


def format_table(result):
    """The results as the text table the benchmark prints."""
    v = result["versions"]
    lines = [f"{result['date']}; {result['machine']}; {result['threads']} thread(s) everywhere; sdpa_ref "
             f"{v['sdpa_ref']}, numpy {v['numpy']}, torch {v['torch']}; medians of {result['rounds']} interleaved "
             f"rounds, ratios per round (median, min-max)",
             "forward + backward (decode: forward); ours / torch < 1: faster than torch; ours / bound: the time "
             "over the work it must do", "",
             f"{'case':<16} {'dtype':<8} {'L':>5}  {'B,Hq,Hkv,E':<12} {'allowed':>7} {'ours ms':>9} "
             f"{'torch ms':>9}  {'ours / torch':<20} {'ours / bound':<20}"]
    for c in result["cells"]:
        torch_ms = "-" if c.get("torch_s") is None else f"{c['torch_s'] * 1e3:9.2f}"
        lines.append(f"{CASE_TITLES[c['case']]:<16} {c['dtype']:<8} {c['L']:>5}  {','.join(map(str, c['dims'])):<12} "
                     f"{c['allowed']:>7.3f} {c['ours_s'] * 1e3:>9.2f} {torch_ms:>9}  {_r(c['ours_over_torch']):<20} "
                     f"{_r(c['ours_over_bound']):<20}")
    if result["overhead"]:
        lines += ["", "per-call overhead, float64, forward + backward:"]
        for o in result["overhead"]:
            torch_ms = "-" if o.get("torch_s") is None else f"{o['torch_s'] * 1e3:.3f} ms"
            lines.append(f"  {o['shape']:<10} {'causal' if o['causal'] else 'no mask':<8} ours {o['ours_s'] * 1e3:.3f} "
                         f"ms, torch {torch_ms}; ours / torch {_r(o['ours_over_torch'])}")
    if result["second_order"]:
        lines += ["", "second order, causal float64: sdpa_hvp against torch's reverse over reverse (math path):"]
        for s in result["second_order"]:
            torch_ms = "-" if s.get("torch_s") is None else f"{s['torch_s'] * 1e3:.1f} ms"
            lines.append(f"  {s['shape']:<12} ours {s['ours_s'] * 1e3:.1f} ms, torch {torch_ms}; ours / torch "
                         f"{_r(s['ours_over_torch'])}; ours / our forward + backward {_r(s['ours_over_first_order'])}")
    return "\n".join(lines)


def figure(result, path):
    """Draw the table as a figure (matplotlib): ours / torch and ours / bound per case and dtype against L, then
    the overhead and second order; the date and machine in the title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    from matplotlib.colors import LogNorm

    cells = result["cells"]
    rows = [(c, d) for c in CASES for d in DTYPES if any(x["case"] == c and x["dtype"] == d for x in cells)]
    Ls = sorted({x["L"] for x in cells})
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.2 + 0.42 * max(len(rows), 1)), constrained_layout=True)
    for ax, key, title in ((axes[0], "ours_over_torch", "sdpa_ref / torch (< 1: faster)"),
                           (axes[1], "ours_over_bound", "sdpa_ref / bound of its work (>= 1)")):
        grid = np.full((len(rows), len(Ls)), np.nan)
        for x in cells:
            if x.get(key) is not None:
                grid[rows.index((x["case"], x["dtype"])), Ls.index(x["L"])] = x[key][0]
        im = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn_r", aspect="auto",
                       norm=LogNorm(vmin=0.25, vmax=4.0) if key == "ours_over_torch" else LogNorm(vmin=1, vmax=8))
        for (i, j), val in np.ndenumerate(grid):
            ax.text(j, i, "-" if np.isnan(val) else f"{val:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(Ls)), [f"L = {n}" for n in Ls])
        ax.set_yticks(range(len(rows)), [f"{CASE_TITLES[c]}, {d}" for c, d in rows])
        ax.set_title(title, fontsize=10)
        bar = fig.colorbar(im, ax=ax, shrink=0.8)
        bar.ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        bar.ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    extra = [f"overhead {o['shape']}{' causal' if o['causal'] else ''}: {_r(o['ours_over_torch'])} of torch"
             for o in result["overhead"]]
    extra += [f"sdpa_hvp {s['shape']}: {_r(s['ours_over_torch'])} of torch, {_r(s['ours_over_first_order'])} of "
              f"our fwd + bwd" for s in result["second_order"]]
    fig.suptitle(f"forward + backward (decode: forward), {result['threads']} threads; {result['date']}; "
                 f"{result['machine']}" + ("\n" + "; ".join(extra) if extra else ""), fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="L in {128, 1024}, 3 rounds, second order at 1x4x512x64")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per row (default 5, quick 3)")
    ap.add_argument("--threads", type=int, default=None, help="threads everywhere (default: the CPUs)")
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="L = S (default 128 1024 4096)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    ap.add_argument("--output", default=None, help="also write the results (JSON) to this file")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds should be at least 1, but got {args.rounds}")
    result = run(args.quick, args.rounds, args.threads, args.cases, args.dtypes, args.lengths)
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
