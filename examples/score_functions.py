"""
Attention variants as score and mask functions
==============================================

FlexAttention writes attention variants as two small functions: a score
function ``score_mod(score, b, h, q_idx, kv_idx)`` applied to each scaled
score, and a mask function ``mask_mod(b, h, q_idx, kv_idx) -> bool``. Here
the package's built-in options are written that way and shown to give **the
same bits**, forward and backward, in every engine:

* softcap, ALiBi and a relative-position bias table (a captured tensor with
  its own gradient) as score functions;
* a sliding window and a document mask as mask functions, and the same
  masks as a block-sparse ``BlockMask``, whose absent tiles the tiled engine
  skips (counted).

Then a score function with no built-in twin, checked by
``check_score_mod`` and by finite differences through the whole attention.

Run: ``python examples/score_functions.py``   (exits 1 if a claim fails)
"""

import sys

import numpy as np

from sdpa_ref import BlockMask, ScoreMod, check_score_mod, check_vjp, sdpa_backward, sdpa_forward

failures = []


def claim(ok, text):
    print(("  ok    " if ok else "  FAIL  ") + text)
    if not ok:
        failures.append(text)


rng = np.random.default_rng(0)
B, HQ, HKV, L, S, E, EV = 2, 4, 2, 64, 80, 16, 8
q, k, v = (rng.standard_normal((B, HQ, L, E)), rng.standard_normal((B, HKV, S, E)),
           rng.standard_normal((B, HKV, S, EV)))
g = rng.standard_normal((B, HQ, L, EV))
ENGINES = {"plain": dict(method="plain"), "fast": dict(method="fast"), "tiled": dict(method="tiled", block_size=16)}

# %%
# Score functions and their twins
# -------------------------------
# A score function receives a block of scores and int64 index arrays that
# broadcast against it. Its derivative in the score is given (``grad=``) or
# taken by the complex step; the built-in softcap's slope is computed as
# ``1 / cosh^2``, so the twin's ``grad`` is written the same way.

CAP = 2.0
SLOPES = np.array([2.0 ** -(8 / HQ * (h + 1)) for h in range(HQ)])          # alibi_slopes(4)
TABLE = rng.standard_normal((HQ, L + S - 1)) * 0.5                           # bias[h, i - j + S - 1]


def softcap(score, b, h, i, j):
    return CAP * np.tanh(score / CAP)


def softcap_slope(score, b, h, i, j):
    r = 1 / np.cosh(score / CAP)
    return r * r


def alibi(score, b, h, i, j):
    return score - SLOPES[h] * np.abs(i - j).astype(float)


def relative_position(score, b, h, i, j, table):
    return score + table[h, i - j + S - 1]


def one(score, *rest):
    return np.ones_like(score)


def table_vjp(g, score, b, h, i, j, table):
    """sum g over the entries that read each table entry: a scatter-add."""
    out = np.zeros_like(table)
    hh, rr = np.broadcast_arrays(h, i - j + S - 1, g)[:2]
    np.add.at(out, (hh, rr), g)
    return (out,)


ii, jj = np.arange(L)[:, None], np.arange(S)[None, :]
TWINS = {
    "softcap": (dict(softcap=CAP), ScoreMod(softcap, grad=softcap_slope)),
    "ALiBi": (dict(alibi_slopes=SLOPES), ScoreMod(alibi, grad=one)),
    "relative-position bias": (dict(bias=TABLE[:, ii - jj + S - 1]),
                               ScoreMod(relative_position, grad=one, params=(TABLE,), params_vjp=table_vjp)),
}

print(f"{'as a score function':<24} {'engine':<7} {'out':>6} {'dq':>6} {'dk':>6} {'dv':>6}   (same bits?)")
for name, (built_in, mod) in TWINS.items():
    for engine, how in ENGINES.items():
        o1, r1 = sdpa_forward(q, k, v, enable_gqa=True, **built_in, **how)
        o2, r2 = sdpa_forward(q, k, v, enable_gqa=True, score_mod=mod, **how)
        g1, g2 = sdpa_backward(r1, g), sdpa_backward(r2, g)
        same = [np.array_equal(o1, o2)] + [np.array_equal(getattr(g1, n), getattr(g2, n))
                                           for n in ("query", "key", "value")]
        print(f"{name:<24} {engine:<7} " + " ".join(f"{'yes' if s else 'NO':>6}" for s in same))
        claim(all(same), f"{name} as a score function, {engine} engine: the built-in's bits")
        if name == "relative-position bias":        # the table's gradient: the bias gradient gathered
            want = np.zeros_like(TABLE)
            np.add.at(want, (np.arange(HQ)[:, None, None], np.broadcast_to(ii - jj + S - 1, (HQ, L, S))), g1.bias)
            err = np.abs(g2.score_mod[0] - want).max() / np.abs(want).max()
            claim(err < 1e-13, f"the table's gradient is the bias's, summed per offset (rel {err:.1e}), {engine}")

# %%
# Mask functions and block masks
# ------------------------------
# A mask function joins the allowed set. As a ``BlockMask`` (FlexAttention's
# ``create_block_mask``), 16 x 16 tiles are absent, partial or full; the
# tiled engine skips the absent ones and does not call the function on the
# full ones, and the build checks that the tiles agree with the function.

DOC = np.repeat(np.arange(4), 20)                  # four documents of 20 tokens, packed


def sliding_window(b, h, i, j):
    return (j <= i) & (i - j <= 40)


def document(b, h, i, j):
    return (DOC[i] == DOC[j]) & (j <= i)


MASK_TWINS = {"sliding window": (dict(window=(40, 0)), sliding_window),
              "document (causal)": (dict(attn_mask=(DOC[:L, None] == DOC[None, :S]) & (jj <= ii)), document)}
print(f"\n{'as a mask function':<20} {'engine':<7} {'same bits':>9}   tiles absent / full / partial of "
      f"{-(-L // 16) * -(-S // 16)}")
for name, (built_in, mm) in MASK_TWINS.items():
    bm = BlockMask.from_mask_mod(mm, 1, 1, L, S, block_size=16)
    for engine, how in ENGINES.items():
        o1, r1 = sdpa_forward(q, k, v, enable_gqa=True, **built_in, **how)
        o2, r2 = sdpa_forward(q, k, v, enable_gqa=True, mask_mod=mm, **how)
        same = np.array_equal(o1, o2) and all(np.array_equal(a, b) for a, b in
                                              zip(sdpa_backward(r1, g)[:3], sdpa_backward(r2, g)[:3]))
        print(f"{name:<20} {engine:<7} {'yes' if same else 'NO':>9}")
        claim(same, f"{name} as a mask function, {engine} engine: the built-in's bits")
    ob, rb = sdpa_forward(q, k, v, enable_gqa=True, block_mask=bm, method="tiled")
    om, _ = sdpa_forward(q, k, v, enable_gqa=True, mask_mod=mm, method="tiled", block_size=16)
    c = rb.tile_counts
    t = bm.tiles[0, 0]
    print(f"{name + ' as BlockMask':<28} tiled   {'yes' if np.array_equal(ob, om) else 'NO':>9}   "
          f"{c['absent']} / {c['full']} / {c['partial']}")
    claim(np.array_equal(ob, om), f"{name}: the block mask gives the mask function's bits")
    claim(c == {"absent": int((t == 0).sum()), "full": int((t == 2).sum()), "partial": int((t == 1).sum())},
          f"{name}: the tiled engine visited each tile once, and skipped the {c['absent']} absent ones")

# %%
# A variant with no built-in twin
# -------------------------------
# ``tanh`` gating by a learned per-head temperature: the derivative comes
# from the complex step (checked on every call against central
# differences), and the temperature gets its gradient by the complex step
# one entry at a time. ``check_score_mod`` checks the function alone,
# ``check_vjp`` the whole attention through it.


def gated(score, b, h, i, j, temperature):
    return score * np.tanh(temperature[h] * score) + 0.05 * score


rep = check_score_mod(ScoreMod(gated, params=(np.array([0.5, 1.0, 1.5, 2.0]),)))
claim(rep.ok, f"check_score_mod: the complex-step derivatives of the gated score (max rel {rep.max_rel_error:.1e})")
wrong = ScoreMod(gated, grad=lambda s, b, h, i, j, t: np.tanh(t[h] * s), params=(np.array([0.5, 1.0, 1.5, 2.0]),))
claim(not check_score_mod(wrong).ok, "check_score_mod catches a slope that forgets the product rule")

small = [x[:1, :, :6] if x.shape[-2] == L else x[:1, :, :7] for x in (q, k, v)]


def fun(q, k, v, t):
    return sdpa_forward(q, k, v, enable_gqa=True, score_mod=ScoreMod(gated, params=(t,)), is_causal=True)[0]


def vjp(g, q, k, v, t):
    r = sdpa_backward(sdpa_forward(q, k, v, enable_gqa=True, score_mod=ScoreMod(gated, params=(t,)),
                                   is_causal=True)[1], g)
    return r.query, r.key, r.value, r.score_mod[0]


rep = check_vjp(fun, vjp, (*small, np.array([0.5, 1.0, 1.5, 2.0])))
claim(rep.ok, f"every gradient through the gated attention, the temperatures' included, against finite "
              f"differences (max rel {rep.max_rel_error:.1e})")

print("\n" + ("all claims hold" if not failures else f"{len(failures)} claim(s) FAILED"))
if failures:
    sys.exit("score_functions.py: " + "; ".join(failures))
