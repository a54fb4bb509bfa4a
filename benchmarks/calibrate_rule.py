"""Calibrate the relative rule: how far honest kernels land from the truth, relative to the honest ensemble.

For each test dtype, draws ``--problems`` random problems with large logits
(scores of about +-50: q drawn with standard deviation ``--logit-scale``)
and shapes L, S in [8, 48], E in {16, 32, 64}, then judges every honest
specimen (:data:`sdpa_ref.harness.specimens.HONEST`) and every mutant
(:data:`~sdpa_ref.harness.specimens.MUTANTS`) by the rule, and prints

* per honest specimen, the spread of ``error / ensemble error`` over the
  problems and quantities (median, 99th percentile, max) and the fraction of
  problems on which it passes the rule (the issue's bar: at least 99%);
* per honest specimen, the largest ``|beta| / bound`` of the rule's lean test (``lean``);
* per mutant, the fraction of problems on which the rule catches it.

The factors ``k_out`` and ``k_grad`` of :class:`~sdpa_ref.harness.rules.RelativeRule`
were chosen from this output (see the class docstring). Every figure is the
same on every machine for the ensemble; the specimens use the machine's BLAS
and ``np.exp``, so their errors move a little between machines.

Run: ``python benchmarks/calibrate_rule.py --problems 200 --dtypes float32 float16 bfloat16``
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import sdpa_ref
from sdpa_ref.harness.cases import Case
from sdpa_ref.harness.specimens import HONEST, MUTANTS


def random_cases(n, seed, logit_scale):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L, S = (int(x) for x in rng.integers(8, 49, size=2))
        E = int(rng.choice([16, 32, 64]))
        out.append(Case(name=f"random-{i}-L{L}-S{S}-E{E}", L=L, S=S, E=E, Ev=E, Hq=2, Hkv=2, batch_q=(1,),
                        batch_kv=(1,), seed=1000 + i, logit_scale=logit_scale))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=200, help="random problems per dtype (default: 200)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    ap.add_argument("--logit-scale", type=float, default=20.0, help="std of q's entries (default: 20)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    cases = random_cases(a.problems, a.seed, a.logit_scale)
    rule = sdpa_ref.harness.rules.RelativeRule()
    print(f"rule: {rule.describe()}")
    print(f"{a.problems} random problems, q std {a.logit_scale:g}, seed {a.seed}")
    for dt in a.dtypes:
        t0 = time.perf_counter()
        print(f"\n== {dt}")
        print("error / ensemble error, over the problems: out | gradients")
        print(f"{'honest specimen':46s} {'median':>7s} {'p99':>6s} {'max':>6s} | {'median':>7s} {'p99':>6s} "
              f"{'max':>6s} {'lean':>5s} {'passes':>7s}")
        worst = [0.0, 0.0]
        for sp in HONEST:
            rep = sdpa_ref.check_implementation(sp.forward, backward=sp.backward, dtypes=dt, cases=cases, rule=rule)
            cols = []
            for i, want in enumerate((lambda q: q == "out", lambda q: q != "out")):
                r = np.array([row.error / row.honest_error for row in rep.rows if row.honest_error and want(row.quantity)])
                worst[i] = max(worst[i], r.max())
                cols.append(f"{np.median(r):7.2f} {np.quantile(r, 0.99):6.2f} {r.max():6.2f}")
            bad = {row.case for row in rep.rows if row.status != "pass"}
            lean = max((abs(row.lean) / row.lean_allowed for row in rep.rows if row.lean_allowed), default=0.0)
            print(f"{sp.name:46s} {cols[0]} | {cols[1]} {lean:5.2f} {1 - len(bad) / len(cases):7.1%}", flush=True)
        print(f"largest honest ratio: out {worst[0]:.2f}, gradients {worst[1]:.2f} "
              f"(k_out = {rule.k_out:g}, k_grad = {rule.k_grad:g})")
        print(f"{'mutant (those these problems can expose)':46s} {'caught on':>10s}")
        for sp, _ in MUTANTS:
            if sp.bug not in (None, "constant", "shuffled_rows") or not sp.member.softcap_grad:
                continue                    # needs masks, causal or softcap, which these problems lack
            rep = sdpa_ref.check_implementation(sp.forward, backward=sp.backward, dtypes=dt, cases=cases, rule=rule)
            bad = {row.case for row in rep.rows if row.status != "pass"}
            print(f"{sp.name:46s} {len(bad) / len(cases):10.1%}", flush=True)
        print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
