"""
The worked numbers of 1/sqrt(d_k), checked
==========================================

The worked numbers of the classic explanation of 1/sqrt(d_k), checked.

* d_k = 64: sqrt(d_k) = 8, so raw scores 45 and 2 become 5.625 and 0.25.
* d_k = 16: sqrt(d_k) = 4, so a raw score of 40 becomes 10.
* The softmax of the pair (45, 2) is one-hot to 19 digits; after scaling it
  is 0.9954 / 0.0046, still nearly saturated, but the softmax Jacobian,
  which every gradient to the scores passes through, grows from 3.7e-19 to
  9.2e-3.
* The caveats the classic example leaves out: with unit-variance q and k a
  raw score of 45 at d_k = 64 is 45 / 8 = 5.6 standard deviations, about one
  score in 50 million, not a typical one; and scaling does not make such an
  outlier's softmax soft. What scaling does is make *typical* scores O(1).

Run: ``python examples/scaling_arithmetic.py``   (exits 1 if a claim fails)
"""

import math
import sys

import numpy as np

from sdpa_ref import softmax, softmax_jacobian

failures = []


def claim(ok, text):
    print(("  ok    " if ok else "  FAIL  ") + text)
    if not ok:
        failures.append(text)


print("d_k = 64")
raw = np.array([45.0, 2.0])
scaled = raw / math.sqrt(64)
claim(math.sqrt(64) == 8.0, "sqrt(64) = 8")
claim(scaled.tolist() == [5.625, 0.25], f"45 / 8 = {scaled[0]}, 2 / 8 = {scaled[1]}")

print("d_k = 16")
claim(math.sqrt(16) == 4.0 and 40 / math.sqrt(16) == 10.0, f"sqrt(16) = 4 and 40 / 4 = {40 / math.sqrt(16)}")

print("softmax of the pair before and after scaling")
p_raw, p_scaled = softmax(raw), softmax(scaled)
print(f"    raw    (45, 2)       -> {p_raw[0]:.19f}, {p_raw[1]:.3e}")
print(f"    scaled (5.625, 0.25) -> {p_scaled[0]:.4f}, {p_scaled[1]:.4f}")
claim(abs(p_raw[1] - math.exp(-43) / (1 + math.exp(-43))) < 1e-30,
      "raw: the second weight is e^-43 / (1 + e^-43) ~ 2.1e-19")
claim(abs(p_scaled[0] - 1 / (1 + math.exp(-5.375))) < 1e-15, "scaled: the top weight is 1 / (1 + e^-5.375) = 0.9954")
j_raw = np.linalg.norm(softmax_jacobian(p_raw))
j_scaled = np.linalg.norm(softmax_jacobian(p_scaled))
print(f"    |softmax Jacobian|_F: raw {j_raw:.2e}, scaled {j_scaled:.2e}")
claim(j_raw < 1e-18 and j_scaled > 1e-3 and j_scaled / j_raw > 1e15,
      f"the Jacobian the gradient flows through is {j_scaled / j_raw:.1e} times larger after scaling")

print("the caveats")
z = 45 / math.sqrt(64)                                  # q.k ~ N(0, d_k) for unit-variance q, k
tail = math.erfc(z / math.sqrt(2))                      # P(|q.k| >= 45), normal approximation
print(f"    a raw 45 at d_k = 64 is {z:.3f} standard deviations; P(|score| >= 45) = {tail:.1e}")
claim(z > 5.5 and tail < 1e-7, f"45 is an outlier: {z:.2f} sigma, one score in {1 / tail:.1e}")
claim(p_scaled[0] > 0.99, f"after scaling the pair is still nearly saturated: top weight {p_scaled[0]:.4f}")

print("\n" + ("all claims hold" if not failures else f"{len(failures)} claim(s) FAILED"))
# exit status 1 with the failures on stderr (also where the docs gallery, which runs this file and shows its stdout,
# leaves them); success falls off the end
if failures:
    sys.exit("scaling_arithmetic.py: " + "; ".join(failures))
