"""The conformance report: one row per (case, dtype, quantity), as a table or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import numpy as np

from .suites import SUITE_VERSION

__all__ = ["ConformanceReport", "ConformanceRow"]


@dataclass
class ConformanceRow:
    case: str
    dtype: str
    quantity: str
    status: str                        # "pass" | "FAIL" | "skip" | "error"
    error: Optional[float] = None
    allowed: Optional[float] = None
    ratio: Optional[float] = None
    worst_index: Optional[tuple] = None
    impl_value: Optional[float] = None
    ref_value: Optional[float] = None
    note: str = ""
    honest_error: Optional[float] = None   # the honest ensemble's error (relative rule), else None
    lean: Optional[float] = None           # the systematic error in ulps (rules.lean; relative rule), else None
    lean_allowed: Optional[float] = None   # how far it may go (None: not judged, e.g. a single row)


@dataclass
class ConformanceReport:
    """One row per (case, dtype, quantity); ``.ok``, ``str()``, ``.to_json()``."""

    rows: List[ConformanceRow]
    rule: str
    suite: str
    suite_version: str = SUITE_VERSION
    seconds: float = 0.0
    meta: Dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.status in ("pass", "skip") for r in self.rows) and any(r.status == "pass" for r in self.rows)

    @property
    def verdict(self) -> str:
        """``"does not conform"`` if anything failed, else ``"nothing judged"`` if no quantity was compared
        (every case skipped: not a pass), else ``"conforms"``."""
        c = self.counts
        if c["FAIL"] or c["error"]:
            return "does not conform"
        return "conforms" if c["pass"] else "nothing judged"

    @property
    def judged(self) -> int:
        """How many (case, dtype) pairs had at least one quantity compared (passed, failed or in error)."""
        return len({(r.case, r.dtype) for r in self.rows if r.status != "skip"})

    @property
    def skipped(self) -> Dict[str, int]:
        """The (case, dtype) pairs skipped whole, counted by reason, most common first: ``"needs attn_mask"``
        (an option the implementation does not support), ``"does not use is_causal (required)"``, ``"not
        implemented: ..."``. A case that needs two options counts under each; ``"(all)"`` holds the total."""
        judged = {(r.case, r.dtype) for r in self.rows if r.status != "skip"}
        why: Dict[str, set] = {"(all)": set()}
        for r in self.rows:
            key = (r.case, r.dtype)
            if r.status != "skip" or key in judged:
                continue
            why["(all)"].add(key)
            note = r.note or "skipped"
            parts = [f"needs {n}" for n in note[6:].split(", ")] if note.startswith("needs ") else [note]
            for p in parts:
                why.setdefault(p, set()).add(key)
        return dict(sorted(((k, len(v)) for k, v in why.items()), key=lambda kv: (kv[0] != "(all)", -kv[1], kv[0])))

    @property
    def failures(self) -> List[ConformanceRow]:
        return [r for r in self.rows if r.status in ("FAIL", "error")]

    @property
    def counts(self) -> Dict[str, int]:
        """Rows by status: ``{"pass", "FAIL", "skip", "error"}`` (a property, like ``ok`` and ``failures``)."""
        out = {"pass": 0, "FAIL": 0, "skip": 0, "error": 0}
        for r in self.rows:
            out[r.status] += 1
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "verdict": self.verdict, "judged": self.judged, "skipped": self.skipped,
                "rule": self.rule, "suite": self.suite, "suite_version": self.suite_version,
                "counts": self.counts, "seconds": self.seconds, "meta": self.meta,
                "rows": [asdict(r) for r in self.rows]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), default=_json_default, **kw)

    def to_csv(self) -> str:
        """One line per row, with a header; the worst index as ``i;j;...``."""
        import csv
        import io

        buf = io.StringIO()
        names = list(ConformanceRow.__dataclass_fields__)
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(names)
        for r in self.rows:
            vals = []
            for n in names:
                v = getattr(r, n)
                vals.append(";".join(map(str, v)) if isinstance(v, tuple) else ("" if v is None else v))
            w.writerow(vals)
        return buf.getvalue().rstrip("\n")

    def __str__(self) -> str:
        wc = max([4] + [len(r.case) for r in self.rows])          # full case names
        head = (f"{'case':<{wc}} {'dtype':<8} {'qty':<5} {'status':<6} {'error':>10} {'honest':>10} "
                f"{'allowed':>10} {'ratio':>7}")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            if r.status == "skip":
                lines.append(f"{r.case:<{wc}} {r.dtype:<8} {r.quantity:<5} {'skip':<6}  {r.note}")
                continue
            err = "-" if r.error is None else f"{r.error:.3e}"
            nav = "-" if r.honest_error is None else f"{r.honest_error:.3e}"
            alw = "-" if r.allowed is None else f"{r.allowed:.3e}"
            rat = "-" if r.ratio is None else f"{r.ratio:.3f}"
            lines.append(f"{r.case:<{wc}} {r.dtype:<8} {r.quantity:<5} {r.status:<6} {err:>10} {nav:>10} {alw:>10} "
                         f"{rat:>7}")
            if r.status in ("FAIL", "error"):
                where = f"worst at {r.worst_index}: impl {r.impl_value!r}, reference {r.ref_value!r}" \
                    if r.worst_index is not None else ""
                lines.append(f"    {where} {r.note}".rstrip())
            elif r.note:
                lines.append(f"    {r.note}")
        c = self.counts
        lines.append("")
        lines.append("error: max |impl - ref64| (ref64: the reference in float64 on the same inputs); honest: the "
                     "largest of the same for the honest ensemble, kernels computing in the test dtype (the "
                     "relative rule's baseline); allowed: what the rule permits; ratio: error / allowed (at most 1 "
                     "passes); a row also fails where its errors lean one way on average (see its note).")
        lines.append(f"rule: {self.rule}")
        skipped = self.skipped
        n_skip = skipped.pop("(all)")
        lines.append(f"judged {self.judged} of {self.judged + n_skip} (case, dtype) pairs; skipped {n_skip}"
                     + (", by reason (a pair may have several):" if skipped else ""))
        for k, (why, n) in enumerate(skipped.items()):
            if k == 10:
                lines.append(f"  ... and {len(skipped) - 10} more reasons")
                break
            lines.append(f"  {n:5d}  {why}")
        where = "; the implementation in a child process" if self.meta.get("isolated") else ""
        lines.append(f"{c['pass']} passed, {c['FAIL'] + c['error']} failed, {c['skip']} skipped "
                     f"(suite {self.suite} v{self.suite_version}; {self.seconds:.1f} s{where})")
        lines.append("verdict: " + self.verdict.upper()
                     + (" (every case was skipped: this is not a pass)" if self.verdict == "nothing judged" else ""))
        return "\n".join(lines)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
