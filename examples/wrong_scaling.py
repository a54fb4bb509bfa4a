"""
The common mistakes: no scaling, or 1/d_k
=========================================

The common mistakes, measured: no scaling, or dividing by d_k instead of sqrt(d_k).

1. With the reference's sweep (``sdpa_ref.diagnostics.sweep``), the
   normalized entropy and the gradient norm through the softmax, as d_k
   grows:

   * 1/sqrt(d_k) keeps both flat;
   * no scaling drives the entropy to 0 (one-hot rows) and the score
     gradient down;
   * 1/d_k drives the entropy to 1 (uniform rows: attention stops
     discriminating) and shrinks the gradient reaching q and k like
     1/sqrt(d_k).

2. A backward that forgot the scale while the forward kept it is caught by
   ``sdpa_ref.check_vjp``.

Run: ``python examples/wrong_scaling.py``   (exits 1 if a claim fails)
"""

import sys

import numpy as np

from sdpa_ref import check_vjp, sdpa_backward, sdpa_forward
from sdpa_ref.diagnostics import sweep

failures = []


def claim(ok, text):
    print(("  ok    " if ok else "  FAIL  ") + text)
    if not ok:
        failures.append(text)


rows = sweep((4, 16, 64, 256, 1024), seed=0)
by = {(r.scale, r.d_k): r for r in rows}
print(f"{'d_k':>5} | {'normalized entropy':^26} | {'|dL/dscores| per row':^26} | {'|dL/dq| per row':^26}")
print(f"{'':>5} | " + " | ".join([f"{'none':>8}{'sqrt':>9}{'linear':>9}"] * 3))
for d in (4, 16, 64, 256, 1024):
    cells = []
    for key in ("normalized_entropy", "grad_norm_scores", "grad_norm_query"):
        cells.append("".join(f"{getattr(by[(s, d)], key):>{8 if s == 'none' else 9}.3f}"
                             for s in ("none", "sqrt", "linear")))
    print(f"{d:>5} | " + " | ".join(cells))

print("\nclaims")
sq = [by[("sqrt", d)].normalized_entropy for d in (4, 16, 64, 256, 1024)]
claim(max(sq) - min(sq) < 0.02, f"1/sqrt(d_k): normalized entropy flat (spread {max(sq) - min(sq):.4f})")
claim(by[("none", 1024)].normalized_entropy < 0.1,
      f"no scaling: entropy collapses (d_k=1024: {by[('none', 1024)].normalized_entropy:.3f})")
claim(by[("none", 1024)].grad_norm_scores < 0.5 * by[("sqrt", 1024)].grad_norm_scores,
      f"no scaling: score gradient at d_k=1024 is {by[('none', 1024)].grad_norm_scores:.3f} vs "
      f"{by[('sqrt', 1024)].grad_norm_scores:.3f} scaled")
claim(by[("linear", 1024)].normalized_entropy > 0.999,
      f"1/d_k: rows become uniform (d_k=1024: {by[('linear', 1024)].normalized_entropy:.4f})")
ratio = by[("linear", 4)].grad_norm_query / by[("linear", 1024)].grad_norm_query
claim(10 < ratio < 22, f"1/d_k: |dL/dq| shrinks like 1/sqrt(d_k): d_k 4 -> 1024 divides it by {ratio:.1f} "
      f"(sqrt(256) = 16)")

print("\na backward that forgot the scale (the forward kept it)")
rng = np.random.default_rng(0)
q, k, v = rng.standard_normal((2, 3, 16)), rng.standard_normal((2, 4, 16)), rng.standard_normal((2, 4, 3))


def fun(q, k, v):
    return sdpa_forward(q, k, v)[0]


def right(g, q, k, v):
    gr = sdpa_backward(sdpa_forward(q, k, v)[1], g)
    return gr.query, gr.key, gr.value


def forgot_scale(g, q, k, v):
    dq, dk, dv = right(g, q, k, v)
    return dq * np.sqrt(16), dk * np.sqrt(16), dv          # i.e. dT K instead of scale * dT K


good, bad = check_vjp(fun, right, (q, k, v)), check_vjp(fun, forgot_scale, (q, k, v))
print("  " + str(bad).replace("\n", "\n  "))
claim(good.ok and good.max_rel_error < 1e-7, f"the right backward passes (max rel error {good.max_rel_error:.1e})")
claim(not bad.ok, f"the unscaled backward is caught (max rel error {bad.max_rel_error:.2f})")

print("\n" + ("all claims hold" if not failures else f"{len(failures)} claim(s) FAILED"))
# exit status 1 with the failures on stderr (also where the docs gallery, which runs this file and shows its stdout,
# leaves them); success falls off the end
if failures:
    sys.exit("wrong_scaling.py: " + "; ".join(failures))
