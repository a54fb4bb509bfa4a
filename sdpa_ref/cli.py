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
            "Run finite-difference gradient checks of every backward in the package (softmax, "
            "log-softmax, attention) over a grid of options: no/bool/float masks, causal, GQA, "
            "dropout with an explicit keep mask, L<S, L>S, Ev!=E, broadcast batch, and each "
            "fully_masked policy. Prints one line per case with its worst symmetric relative "
            "error and exits 1 if any case fails."
        ),
    )
    p.add_argument("--quick", action="store_true", help="run a covering subset of the grid (about a third)")
    _add_format(p)
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: 1e-7)")
    p.add_argument("--atol", type=float, default=None, help="absolute floor (default: 1e-9)")
    p.set_defaults(func=_cmd_check)
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

    rtol = selfcheck.CHECK_RTOL if args.rtol is None else args.rtol
    atol = selfcheck.CHECK_ATOL if args.atol is None else args.atol
    progress = _Progress("check")
    results = selfcheck.softmax_checks(rtol=rtol, atol=atol)
    cases = selfcheck.attention_cases(args.quick)
    for i, case in enumerate(cases):
        progress(i, len(cases), case.name)
        results.append(selfcheck.run_attention_case(case, rtol=rtol, atol=atol))
    progress.done()
    rows = [
        {"case": r.name, "status": "ok" if r.ok else "FAIL", "max_rel_error": r.max_rel_error,
         "max_abs_error": r.max_abs_error, "seconds": round(r.seconds, 4)}
        for r in results
    ]
    n_fail = sum(not r.ok for r in results)
    if args.format == "table":
        print(format_rows(rows, ["case", "status", "max_rel_error", "max_abs_error", "seconds"]))
        worst = max(r.max_rel_error for r in results)
        print(f"\n{len(results) - n_fail} passed, {n_fail} failed; worst relative error {worst:.2e} "
              f"(rtol {rtol:.0e}, atol {atol:.0e}; symmetric relative error, float64 central differences)")
        for r in results:
            if not r.ok:
                print(f"\nFAILED: {r.name}\n{r.detail}")
    else:
        print(_dump(rows, args.format))
    return 1 if n_fail else 0


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
