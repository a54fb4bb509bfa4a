"""Output of the command line: aligned tables, JSON, CSV, progress on stderr, and plots."""

from __future__ import annotations

import csv
import io
import json
import sys
from typing import List, Optional, Sequence

__all__ = ["DIAGNOSE_COLUMNS", "format_rows"]

DIAGNOSE_COLUMNS = [
    "scale", "d_k", "score_std", "predicted_score_std", "entropy", "normalized_entropy",
    "max_weight_mean", "max_weight_median", "saturated_fraction", "grad_norm_scores",
    "grad_norm_query", "grad_norm_key", "jacobian_norm",
]


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
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.8), constrained_layout=True)   # at 940 px wide, text >= 10 px
    for ax, (key, title) in zip(axes, panels):
        for s in scales:
            pts = sorted((r.d_k, getattr(r, key), getattr(r, key + "_stderr")) for r in rows if r.scale == s)
            x, y, e = (list(t) for t in zip(*pts))
            ax.errorbar(x, y, yerr=[2 * v for v in e], marker="o", ms=4, capsize=2, label=labels[s])
        ax.set_xscale("log", base=2)
        ticks = sorted({r.d_k for r in rows})
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks], fontsize=9)
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
    for n, (r, row) in enumerate(zip(rows, cells)):
        if group_by is not None and n > 0 and r.get(group_by) != rows[n - 1].get(group_by):
            out.append("")
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
    """Progress on stderr: a one-line indicator on a terminal; when piped (CI logs), a line every few seconds.

    ``every`` is the interval of the piped lines (seconds); the first comes at once, the last says how long the
    whole took. Nothing goes to stdout, so tables, JSON and CSV stay clean.
    """

    def __init__(self, label: str, stream=None, every: float = 5.0):
        import time

        self._time = time.monotonic
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = every
        self.start = self._time()
        self.last = None
        self.n = None

    def __call__(self, i: int, n: int, what: str = "") -> None:
        self.n = n
        if self.tty:
            self.stream.write(f"\r{self.label}: {i + 1}/{n} {what[:60]:<60}")
            self.stream.flush()
            return
        now = self._time()
        if self.last is None or now - self.last >= self.every:
            self.last = now
            self.stream.write(f"{self.label}: {i + 1}/{n} {what} ({now - self.start:.0f} s)\n")
            self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r" + " " * (len(self.label) + 80) + "\r")
            self.stream.flush()
        elif self.last is not None:
            self.stream.write(f"{self.label}: {self.n}/{self.n} done in {self._time() - self.start:.1f} s\n")
            self.stream.flush()
