"""The work of each ``sdpa-ref`` command: call the library, hand the rows to :mod:`.output`; and
:func:`main`, which parses a command line (:mod:`.parser`) and runs the command it names."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

from ..harness.casefile import CaseFileError, load_cases
from ..harness.lowp import as_test_dtype
from .parser import build_parser
from .output import DIAGNOSE_COLUMNS, _dump, _import_pyplot, _plot_sweep, _Progress, format_rows

#: ``sdpa-ref conform``'s exit status by verdict (the C client's are the same; 2 is a usage error or a bad file).
EXIT_STATUS = {"conforms": 0, "does not conform": 1, "nothing judged": 3}


def _cmd_check(args) -> int:
    from ..harness import selfcheck

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
         "hvp_rel_error": r.hvp_rel_error, "seconds": round(r.seconds, 4)}
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
              f"{worst('ip_rel_error'):.2e}; Hessian-vector product vs differences of the VJP "
              f"{worst('hvp_rel_error'):.2e} ({selfcheck.HVP_RTOL:.0e})")
        print("symmetric relative error |a-n|/(|a|+|n|), float64; fd: sdpa_backward and sdpa_jvp vs central differences; "
              "cs: sdpa_backward and sdpa_jvp vs the complex step")
        for r in results:
            if not r.ok:
                print(f"\nFAILED: {r.name}\n{r.detail}")
    else:
        print(_dump(rows, args.format))
    return 1 if n_fail else 0


def _cmd_info(args) -> int:
    from .._info import info, info_rows

    d = info()
    if args.format == "json":
        print(json.dumps(d, indent=2))
    elif args.format == "csv":
        print(_dump(info_rows(d), "csv"))
    else:
        print(format_rows(info_rows(d), ["item", "value"]))
    return 0


def _cmd_diagnose(args) -> int:
    from .. import diagnostics

    if args.plot is not None:
        parent = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(parent):
            print(f"sdpa-ref: --plot should name a file in an existing folder, but {parent!r} does not exist",
                  file=sys.stderr)
            return 2
        plt = _import_pyplot()
        if plt is None:
            print("sdpa-ref: --plot needs matplotlib; install it with: python -m pip install matplotlib",
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

    from ..softmax import softmax

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
    from ..harness import vectors
    from ..harness.vectorio import one_line

    err = _writable_dir(args.out_dir)
    if err:
        print(f"sdpa-ref: OUT_DIR {err}", file=sys.stderr)
        return 2
    try:
        as_test_dtype(args.dtype, "--dtype")
    except ImportError as exc:
        print(f"sdpa-ref: {exc}", file=sys.stderr)
        return 2
    progress = _Progress("vectors")
    try:
        manifest = vectors.write_vectors(args.out_dir, suite=args.suite, dtype=args.dtype, progress=progress,
                                         cases=args.cases, layout=args.layout)
    except CaseFileError as exc:
        progress.done()
        print(f"sdpa-ref: --cases: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:                              # fp8 with --layout
        progress.done()
        print(f"sdpa-ref: --layout: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:                                 # vectors.UnsafeDestination too: names the entry
        progress.done()
        print(f"sdpa-ref: cannot write into OUT_DIR {_shown_path(args.out_dir)}: {one_line(exc.strerror or exc)}",
              file=sys.stderr)
        return 2
    progress.done()
    if args.format == "table":
        what = f"from {one_line(args.cases)}" if args.cases else f"{args.suite} suite v{manifest['suite_version']}"
        where = f", layout {args.layout}" if args.layout else ""
        print(f"wrote {len(manifest['files'])} cases ({what}, {args.dtype}{where}) and manifest.json to "
              f"{one_line(args.out_dir)}")
        return 0
    rows = [{"file": e["file"], "sha256": e["sha256"], "bytes": os.lstat(os.path.join(args.out_dir, e["file"])).st_size}
            for e in manifest["files"]]
    if args.format == "json":
        print(json.dumps({"out_dir": args.out_dir, "suite": manifest["suite"], "suite_version": manifest["suite_version"],
                          "dtype": args.dtype, "files": rows}, indent=2))
    else:
        print(_dump(rows, "csv"))
    return 0


def _cmd_verify(args) -> int:
    from ..harness import vectors
    from ..harness.vectorio import one_line

    try:
        rep = vectors.verify_vectors(args.out_dir)
    except vectors.ManifestError as exc:
        print(f"sdpa-ref: {one_line(exc)}", file=sys.stderr)
        return 2
    if args.format == "table":
        print(rep)
        return 0 if rep.ok else 1
    # every row with the same columns (csv), the set's problems as rows with no file, no NaN in the JSON
    rows = [dict({"note": ""}, **r) for r in rep.rows]
    rows += [{"file": "", "hash_ok": False, "recompute_ok": False, "max_rel_diff": None, "ok": False, "note": p}
             for p in rep.problems]
    if args.format == "json":
        rows = [dict(r, max_rel_diff=r["max_rel_diff"] if r["max_rel_diff"] == r["max_rel_diff"] else None)
                for r in rows]
    print(_dump([{k: r[k] for k in ("file", "hash_ok", "recompute_ok", "max_rel_diff", "ok", "note")} for r in rows],
                args.format))
    return 0 if rep.ok else 1


def _cmd_conform(args) -> int:
    try:                                                   # bfloat16 and fp8 need ml_dtypes: say so, no traceback
        for d in args.dtype:
            as_test_dtype(d, "--dtype")
    except ImportError as exc:
        print(f"sdpa-ref: {exc}", file=sys.stderr)
        return 2
    saved = list(sys.path)
    # the reference's side never imports from the current directory (``python -m`` puts it first): the
    # implementation finds it last, after the installed packages, in its own process or for its own import
    sys.path[:] = [p for p in sys.path if not _is_cwd(p)]
    try:
        return _conform(args)
    finally:
        sys.path[:] = saved


def _conform(args) -> int:
    from ..harness import conformance

    specs = [(flag, spec) for flag, spec in (("MODULE:FUNCTION", args.target), ("--backward", args.backward))
             if spec is not None]
    for flag, spec in specs:
        if ":" not in spec:
            print(f"sdpa-ref: cannot load {spec!r} ({flag}): it should be MODULE:FUNCTION", file=sys.stderr)
            return 2
    loaded = {}
    for flag, spec in specs if args.in_process else ():
        try:
            loaded[flag] = _load(spec)
        except KeyboardInterrupt:
            raise
        except (Exception, SystemExit) as exc:             # whatever the module does on import is its error
            what = f"SystemExit({exc.code!r})" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
            return _cannot_load(flag, spec, what)
    fwd, bwd = loaded.get("MODULE:FUNCTION", args.target), loaded.get("--backward", args.backward)
    cases = None
    if args.cases is not None:
        try:
            cases = load_cases(args.cases)
        except CaseFileError as exc:
            print(f"sdpa-ref: --cases: {exc}", file=sys.stderr)
            return 2
    given = {"--rtol": args.rtol, "--atol": args.atol, "--max-ulps": args.max_ulps}
    applies = {"relative": (), "fixed": ("--rtol", "--atol"), "ulp": ("--max-ulps",)}[args.rule]
    stray = [f for f, v in given.items() if v is not None and f not in applies]
    if stray:
        print(f"sdpa-ref: {', '.join(stray)} does not apply to --rule {args.rule} "
              f"({'it takes no tolerance' if not applies else 'it takes ' + ' and '.join(applies)})", file=sys.stderr)
        return 2
    rule = {"relative": lambda: conformance.RelativeRule(),
            "fixed": lambda: conformance.FixedRule(1e-12 if args.rtol is None else args.rtol,
                                                   1e-12 if args.atol is None else args.atol),
            "ulp": lambda: conformance.ULPRule(4.0 if args.max_ulps is None else args.max_ulps)}[args.rule]()
    progress = _Progress("conform")
    try:
        rep = conformance.check_implementation(fwd, backward=bwd, supports=args.supports, requires=args.requires,
                                               suite=args.suite, cases=cases, dtypes=args.dtype, rule=rule,
                                               progress=progress, timeout=args.timeout,
                                               isolate=not args.in_process, lse=args.lse,
                                               lse_empty=args.lse_empty, deterministic=args.deterministic,
                                               guards=not args.no_guards,
                                               layout=args.layout)
    except conformance.LoadError as exc:
        progress.done()
        flag = "--backward" if exc.which == "backward" else "MODULE:FUNCTION"
        return _cannot_load(flag, args.backward if flag == "--backward" else args.target, exc.what)
    except (TypeError, ValueError) as exc:
        progress.done()
        print(f"sdpa-ref: {exc}", file=sys.stderr)
        return 2
    progress.done()
    if args.format == "table":
        print(rep)
    elif args.format == "json":
        print(rep.to_json(indent=2))
    else:
        print(rep.to_csv())
    return EXIT_STATUS[rep.verdict]


def _cannot_load(flag, spec, what):
    print(f"sdpa-ref: cannot load the {'backward' if flag == '--backward' else 'implementation'} {spec!r} "
          f"({flag}): {what}", file=sys.stderr)
    return 2


def _writable_dir(path):
    """Why ``path`` cannot be the folder to write into, or None (a symlink to a folder is the folder it names)."""
    if not path:
        return "should be a folder path, but got an empty one"
    if os.path.islink(path) and not os.path.exists(path):
        return f"should be a folder, but {_shown_path(path)} is a symbolic link to nothing"
    if os.path.exists(path) and not os.path.isdir(path):
        return f"should be a folder, but {_shown_path(path)} is an existing file"
    return None


def _shown_path(path):
    """A path the user gave, quoted, on one printable line."""
    from ..harness.vectorio import one_line

    return one_line(repr(path))


def _load(spec):
    """``package.module:attr.sub`` -> the object, imported in this process (``conform --in-process``): the current
    directory is on the path only for that import, and last, so a module there never shadows an installed one."""
    from ..harness._worker import load_spec

    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return load_spec(spec)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _is_cwd(entry):
    """Whether a ``sys.path`` entry names the current directory ('' included)."""
    try:
        return entry == "" or os.path.samefile(entry, os.getcwd())
    except (OSError, TypeError, ValueError):
        return False


#: The function of each command, by the name the parser gives it (``args.command``).
COMMANDS = {"check": _cmd_check, "diagnose": _cmd_diagnose, "saturation": _cmd_saturation, "vectors": _cmd_vectors,
            "verify": _cmd_verify, "conform": _cmd_conform, "info": _cmd_info}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``sdpa-ref`` command ``argv`` names (``sys.argv[1:]`` when None); its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(COMMANDS[args.command](args) or 0)
