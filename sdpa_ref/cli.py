"""The ``sdpa-ref`` command line: printing, JSON, CSV and plots live here.

Run ``sdpa-ref --help`` or ``sdpa-ref COMMAND --help``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from typing import List, Optional, Sequence

__all__ = ["main", "build_parser", "format_rows"]


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="sdpa-ref",
        description=(
            "sdpa_ref: a pure-NumPy reference for softmax and scaled dot-product attention, "
            "with hand-derived gradients proven by finite differences."
        ),
        epilog="Run 'sdpa-ref COMMAND --help' for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"sdpa_ref {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "check",
        help="verify this installation: gradient checks of every backward over a grid of options",
        description=(
            "Prove every backward in the package (softmax, log-softmax, attention) over a grid "
            "of options: no/bool/float masks, bias, causal in both alignments, windows, softcap, "
            "ALiBi, per-batch lengths, GQA, dropout with an explicit keep mask, L<S, L>S, Ev!=E, "
            "broadcast batch, and each fully_masked policy. Each attention case checks the VJP and JVP "
            "against central differences (fd), the VJP and JVP against the complex step (cs), "
            "FlashAttention's lse backward against the default (lse) and <g,Jt> = <J^T g,t> (ip). "
            "Prints one line per case and exits 1 if any case fails."
        ),
    )
    p.add_argument("--quick", action="store_true", help="run a covering subset of the grid (about 45%%)")
    p.add_argument("--filter", metavar="TEXT", default=None,
                   help="run only the cases whose name contains TEXT (e.g. 'softcap' or 'mask=bool')")
    _add_format(p)
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: 1e-7)")
    p.add_argument("--atol", type=float, default=None, help="absolute floor (default: 1e-9)")
    p.add_argument("--complex-rtol", type=float, default=None,
                   help="relative tolerance of the complex-step checks (default: 1e-12)")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser(
        "diagnose",
        help="measure softmax saturation, entropy and gradient norms as d_k grows, per scaling",
        description=(
            "Sweep d_k and measure, for each scaling choice (none: 1, sqrt: 1/sqrt(d_k), linear: "
            "1/d_k), the score std (beside the theory's sqrt(d_k)*scale), the softmax entropy, "
            "the top weight, the share of saturated rows (top weight > 0.9), and the norms of "
            "the gradients with respect to the scores, the queries and the keys, all computed "
            "by the reference's forward and backward on standard normal q, k."
        ),
        epilog="Example: sdpa-ref diagnose --d-k 16 64 256 --format json",
    )
    p.add_argument("--d-k", type=int, nargs="+", default=None, metavar="D",
                   help="key widths to sweep (default: 4 8 16 ... 1024)")
    p.add_argument("--n-keys", type=int, default=50, help="keys per query (default: 50)")
    p.add_argument("--n-queries", type=int, default=32, help="queries per trial (default: 32)")
    p.add_argument("--trials", type=int, default=64, help="independent draws per point (default: 64)")
    p.add_argument("--scales", nargs="+", choices=("none", "sqrt", "linear"), default=["none", "sqrt", "linear"],
                   help="scaling choices to compare (default: all three)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the result is deterministic (default: 0)")
    _add_format(p)
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw normalized entropy, max weight and gradient norm against d_k "
                        "(needs the 'plot' extra: python -m pip install 'sdpa_ref[plot]')")
    p.set_defaults(func=_cmd_diagnose)

    p = sub.add_parser(
        "saturation",
        help="see it yourself: top-5 softmax weights of one query, raw vs scaled scores",
        description=(
            "Draw one standard normal query and N keys of width d_k and print the five largest "
            "softmax weights of the raw scores q.k and of the scaled scores q.k/sqrt(d_k)."
        ),
    )
    p.add_argument("--d-k", type=int, default=128, help="key width (default: 128)")
    p.add_argument("--n-keys", type=int, default=50, help="number of keys (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    _add_format(p)
    p.set_defaults(func=_cmd_saturation)

    p = sub.add_parser(
        "vectors",
        help="write golden test vectors (.npz per case + manifest.json) for implementations outside Python",
        description=(
            "Write one .npz per case of the suite (inputs, options as JSON bytes, the reference's output, "
            "LSE, a seeded grad_out and every gradient, in float64; below float64 also the naive same-dtype "
            "results for FlashAttention's relative rule) and manifest.json with the suite and package "
            "versions, each file's sha256 and the tolerance rule. The files are byte-deterministic."
        ),
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write into (created if missing)")
    p.add_argument("--suite", choices=("quick", "full"), default="quick", help="case suite (default: quick)")
    p.add_argument("--dtype", choices=("float16", "float32", "float64"), default="float64",
                   help="dtype of the stored inputs (default: float64)")
    p.set_defaults(func=_cmd_vectors)

    p = sub.add_parser(
        "verify",
        help="re-check golden vectors against their manifest (hashes) and a fresh computation",
        description="Check every file listed in OUT_DIR/manifest.json: its sha256, and its expected arrays "
                    "against the reference recomputed from the stored inputs (rtol 1e-12). Exit 1 on any mismatch.",
    )
    p.add_argument("out_dir", metavar="OUT_DIR")
    _add_format(p)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "conform",
        help="judge an importable attention implementation against the reference",
        description=(
            "Run MODULE:FUNCTION (called as f(query, key, value, **options) on NumPy arrays) over the case "
            "suite at each dtype and judge it against the float64 reference. The default rule is "
            "FlashAttention's: max|impl-ref64| <= 2 (3 for gradients) * max|naive_same_dtype-ref64| + the "
            "dtype's rounding of the output. Options the function does not list in a `supports` attribute "
            "are never passed; such cases are skipped. Exit 1 if anything fails."
        ),
        epilog="Example: sdpa-ref conform sdpa_ref.adapters.pytorch:forward "
               "--backward sdpa_ref.adapters.pytorch:backward --dtype float32 float16",
    )
    p.add_argument("target", metavar="MODULE:FUNCTION", help="the forward to judge")
    p.add_argument("--backward", metavar="MODULE:FUNCTION", default=None,
                   help="f(grad_out, query, key, value, **options) -> (dq, dk, dv[, dbias])")
    p.add_argument("--suite", choices=("quick", "full"), default="quick")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=("float16", "float32", "float64"),
                   help="test dtypes (default: float32)")
    p.add_argument("--rule", choices=("relative", "fixed", "ulp"), default="relative",
                   help="relative (default), fixed (--rtol/--atol) or ulp (--max-ulps)")
    p.add_argument("--rtol", type=float, default=1e-12)
    p.add_argument("--atol", type=float, default=1e-12)
    p.add_argument("--max-ulps", type=float, default=4.0)
    p.add_argument("--supports", nargs="+", default=None, metavar="OPTION",
                   help="override the options the function understands")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.set_defaults(func=_cmd_conform)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


# ---------------------------------------------------------------- commands


def _cmd_check(args) -> int:
    from . import selfcheck

    tols = {"rtol": selfcheck.CHECK_RTOL if args.rtol is None else args.rtol,
            "atol": selfcheck.CHECK_ATOL if args.atol is None else args.atol}
    if args.complex_rtol is not None:
        tols["complex_rtol"] = args.complex_rtol
    progress = _Progress("check")
    results = selfcheck.run_checks(args.quick, progress=progress, name_filter=args.filter, **tols)
    if not results:
        print(f"sdpa-ref: no case matches --filter {args.filter!r}", file=sys.stderr)
        return 2
    progress.done()
    rows = [
        {"case": r.name, "status": "ok" if r.ok else "FAIL", "fd_rel_error": r.max_rel_error,
         "cs_rel_error": r.cs_rel_error, "lse_rel_error": r.lse_rel_error, "ip_rel_error": r.ip_rel_error,
         "seconds": round(r.seconds, 4)}
        for r in results
    ]
    n_fail = sum(not r.ok for r in results)
    if args.format == "table":
        table = [{k: ("-" if v is None else v) for k, v in row.items()} for row in rows]
        print(format_rows(table, list(rows[0].keys())))
        worst = lambda key: max((row[key] for row in rows if row[key] is not None), default=0.0)  # noqa: E731
        print(f"\n{len(results) - n_fail} passed, {n_fail} failed")
        print(f"worst relative errors: central differences {worst('fd_rel_error'):.2e} (tolerance "
              f"{tols['rtol']:.0e}); complex step {worst('cs_rel_error'):.2e} "
              f"({tols.get('complex_rtol', selfcheck.COMPLEX_RTOL):.0e}); lse vs probs backward "
              f"{worst('lse_rel_error'):.2e} ({selfcheck.LSE_RTOL:.0e}); <g,Jt> vs <J^T g,t> "
              f"{worst('ip_rel_error'):.2e}")
        print("symmetric relative error |a-n|/(|a|+|n|), float64; fd: sdpa_backward and sdpa_jvp vs central differences; "
              "cs: sdpa_backward and sdpa_jvp vs the complex step")
        for r in results:
            if not r.ok:
                print(f"\nFAILED: {r.name}\n{r.detail}")
    else:
        print(_dump(rows, args.format))
    return 1 if n_fail else 0


DIAGNOSE_COLUMNS = [
    "scale", "d_k", "score_std", "predicted_score_std", "entropy", "normalized_entropy",
    "max_weight_mean", "max_weight_median", "saturated_fraction", "grad_norm_scores",
    "grad_norm_query", "grad_norm_key", "jacobian_norm",
]


def _cmd_diagnose(args) -> int:
    from . import diagnostics

    if args.plot is not None:
        plt = _import_pyplot()
        if plt is None:
            print("sdpa-ref: --plot needs matplotlib; install it with: python -m pip install 'sdpa_ref[plot]'",
                  file=sys.stderr)
            return 2
    d_ks = args.d_k if args.d_k else list(diagnostics.DEFAULT_D_KS)
    progress = _Progress("diagnose")
    try:
        rows = diagnostics.sweep(d_ks, n_keys=args.n_keys, n_queries=args.n_queries, trials=args.trials,
                                 scales=args.scales, seed=args.seed, progress=progress)
    except ValueError as exc:
        progress.done()
        print(f"sdpa-ref: {exc}", file=sys.stderr)
        return 2
    progress.done()
    dicts = [r.as_dict() for r in rows]
    if args.format == "table":
        order = {s: i for i, s in enumerate(args.scales)}
        table = sorted(dicts, key=lambda r: (order[r["scale"]], r["d_k"]))
        print(format_rows(table, DIAGNOSE_COLUMNS, group_by="scale"))
        r0 = rows[0]
        print(f"\n{r0.trials} trials x {r0.n_queries} queries x {r0.n_keys} keys per point, seed {args.seed}. "
              "Per-row means; predicted_score_std = sqrt(d_k) * scale; saturated = top weight > 0.9; "
              "grad norms are mean L2 norms of a row of dT (scores), dQ and dK.")
    else:
        print(_dump(dicts, args.format))
    if args.plot is not None:
        _plot_sweep(plt, rows, args.scales, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _cmd_saturation(args) -> int:
    import numpy as np

    from .softmax import softmax

    if args.d_k < 1 or args.n_keys < 5:
        print("sdpa-ref: --d-k should be >= 1 and --n-keys >= 5", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    q = rng.standard_normal(args.d_k)
    k = rng.standard_normal((args.n_keys, args.d_k))
    raw = k @ q
    scaled = raw / np.sqrt(args.d_k)
    p_raw, p_scaled = softmax(raw), softmax(scaled)
    top_raw = np.argsort(-p_raw)[:5]
    top_scaled = np.argsort(-p_scaled)[:5]
    result = {
        "d_k": args.d_k, "n_keys": args.n_keys, "seed": args.seed,
        "raw_score_std": float(raw.std()), "scaled_score_std": float(scaled.std()),
        "raw_top5": [{"key": int(i), "score": float(raw[i]), "weight": float(p_raw[i])} for i in top_raw],
        "scaled_top5": [{"key": int(i), "score": float(scaled[i]), "weight": float(p_scaled[i])} for i in top_scaled],
    }
    if args.format == "json":
        print(json.dumps(result, indent=2))
        return 0
    rows = []
    for rank in range(5):
        a, b = result["raw_top5"][rank], result["scaled_top5"][rank]
        rows.append({"rank": rank + 1, "raw_key": a["key"], "raw_score": a["score"], "raw_weight": a["weight"],
                     "scaled_key": b["key"], "scaled_score": b["score"], "scaled_weight": b["weight"]})
    if args.format == "csv":
        print(_dump(rows, "csv"))
        return 0
    print(f"one query against {args.n_keys} keys, d_k = {args.d_k}, seed {args.seed}")
    print(f"raw scores q.k: std {result['raw_score_std']:.2f} (theory sqrt(d_k) = {np.sqrt(args.d_k):.2f}); "
          f"scaled q.k/sqrt(d_k): std {result['scaled_score_std']:.2f} (theory 1)\n")
    print(format_rows(rows, list(rows[0].keys())))
    print(f"\ntop weight: raw {p_raw.max():.4f}, scaled {p_scaled.max():.4f}; "
          f"uniform would be {1 / args.n_keys:.4f}")
    return 0


def _cmd_vectors(args) -> int:
    from . import vectors

    progress = _Progress("vectors")
    manifest = vectors.write_vectors(args.out_dir, suite=args.suite, dtype=args.dtype, progress=progress)
    progress.done()
    print(f"wrote {len(manifest['files'])} cases ({args.suite} suite v{manifest['suite_version']}, "
          f"{args.dtype}) and manifest.json to {args.out_dir}")
    return 0


def _cmd_verify(args) -> int:
    from . import vectors

    rep = vectors.verify_vectors(args.out_dir)
    if args.format == "table":
        print(rep)
    else:
        print(_dump([{k: v for k, v in r.items()} for r in rep.rows], args.format))
    return 0 if rep.ok else 1


def _cmd_conform(args) -> int:
    from . import conformance

    try:
        fwd = _load(args.target)
        bwd = _load(args.backward) if args.backward else None
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"sdpa-ref: cannot load the implementation: {exc}", file=sys.stderr)
        return 2
    rule = {"relative": conformance.RelativeRule(), "fixed": conformance.FixedRule(args.rtol, args.atol),
            "ulp": conformance.ULPRule(args.max_ulps)}[args.rule]
    progress = _Progress("conform")
    try:
        rep = conformance.check_implementation(fwd, backward=bwd, supports=args.supports, suite=args.suite,
                                               dtypes=args.dtype, rule=rule, progress=progress)
    except ValueError as exc:
        progress.done()
        print(f"sdpa-ref: {exc}", file=sys.stderr)
        return 2
    progress.done()
    print(rep if args.format == "table" else rep.to_json(indent=2))
    return 0 if rep.ok else 1


def _load(spec):
    """``package.module:attr.sub`` -> the object; the current directory is importable."""
    import importlib
    import os

    if ":" not in spec:
        raise ValueError(f"`{spec}` should be MODULE:FUNCTION")
    mod, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"`{spec}` is not callable")
    return obj


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_sweep(plt, rows, scales, path):
    labels = {"none": "no scaling (1)", "sqrt": "1/sqrt(d_k)", "linear": "1/d_k"}
    panels = [("normalized_entropy", "normalized entropy"), ("max_weight_mean", "mean top weight"),
              ("grad_norm_scores", "|dL/d scores| per row")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    for ax, (key, title) in zip(axes, panels):
        for s in scales:
            pts = sorted((r.d_k, getattr(r, key), getattr(r, key + "_stderr")) for r in rows if r.scale == s)
            x, y, e = (list(t) for t in zip(*pts))
            ax.errorbar(x, y, yerr=[2 * v for v in e], marker="o", ms=4, capsize=2, label=labels[s])
        ax.set_xscale("log", base=2)
        ticks = sorted({r.d_k for r in rows})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("d_k")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylim(0, 1.05)
    axes[0].legend(title="scores scaled by")
    r0 = rows[0]
    fig.suptitle(f"softmax of q.k over {r0.n_keys} keys, q, k ~ N(0, I): {r0.trials} trials x {r0.n_queries} "
                 "queries per point (bars: 2 standard errors)", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- output


def _add_format(p):
    p.add_argument("--format", choices=("table", "json", "csv"), default="table",
                   help="output format (default: an aligned table)")


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0.0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


def format_rows(rows: List[dict], columns: Sequence[str], *, group_by: Optional[str] = None) -> str:
    """An aligned text table; numbers right-aligned. ``group_by`` adds a blank line between groups."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) for r in rows) for c in columns]

    def line(vals):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    out = [line(list(columns)), line(["-" * w for w in widths])]
    prev = object()
    for r, row in zip(rows, cells):
        if group_by is not None and r.get(group_by) != prev and prev is not object and len(out) > 2:
            out.append("")
        prev = r.get(group_by) if group_by is not None else prev
        out.append(line(row))
    return "\n".join(out)


def _dump(rows: List[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return buf.getvalue().rstrip("\n")


class _Progress:
    """A one-line progress indicator on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, stream=None):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.active = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, i: int, n: int, what: str = "") -> None:
        if self.active:
            self.stream.write(f"\r{self.label}: {i + 1}/{n} {what[:60]:<60}")
            self.stream.flush()

    def done(self) -> None:
        if self.active:
            self.stream.write("\r" + " " * (len(self.label) + 80) + "\r")
            self.stream.flush()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
