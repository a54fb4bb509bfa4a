r"""
Grouped-query attention, masks and the fully masked row
=======================================================

Three things that every real attention kernel has and the textbook formula
leaves out:

1. **Grouped-query attention** (GQA): :math:`H_q` query heads share
   :math:`H_{kv}` key/value heads. Its forward is a plain loop that repeats
   the keys and values per head; its backward must *sum* the gradients of
   the repeated copies, and we check that against the repeated model and
   against finite differences.
2. **Masks**: a boolean mask (True = may attend) and an additive float mask;
   the package's :func:`~sdpa_ref.causal_mask`, :func:`~sdpa_ref.window_mask`
   and :func:`~sdpa_ref.padding_mask`; masked probabilities and their
   gradients are *exactly* zero, and why the popular "fill with
   :math:`-10^9`" is not a mask.
3. **The fully masked row**: a query with no key to attend to. PyTorch, JAX
   and FlashAttention answer differently; the package's ``fully_masked``
   option gives each answer on purpose, and we check what
   :doc:`the contract </semantics>` promises for the output, the LSE and
   the gradients.

Every claim is checked while the page is built: a wrong formula fails the
build.
"""

import matplotlib.pyplot as plt
import numpy as np

import sdpa_ref

rng = np.random.default_rng(0)
RTOL = 1e-12            # the package against a loop written on this page: the same arithmetic, reordered
GRAD_RTOL = 1e-7        # hand-derived gradients against central differences (float64)

# %%
# Grouped-query attention
# -----------------------
#
# In multi-head attention every query head :math:`h` has its own keys and
# values. Grouped-query attention (GQA; multi-query attention is the case
# :math:`H_{kv} = 1`) keeps :math:`H_q` query heads but only
# :math:`H_{kv}` key/value heads, with :math:`G = H_q / H_{kv}` query heads
# per kv head. Query head :math:`h` reads kv head :math:`\lfloor h / G
# \rfloor`:
#
# .. math::
#
#    O_h = \operatorname{softmax}\!\big(s\, Q_h K_{\lfloor h/G \rfloor}^\top\big)
#          \, V_{\lfloor h/G \rfloor},
#    \qquad s = 1/\sqrt{E}.
#
# This is PyTorch's ``enable_gqa=True`` (``repeat_interleave`` semantics:
# heads ``0 .. G-1`` share kv head 0, the next ``G`` share kv head 1, ...).
# The oracle is a loop over query heads, written here with nothing from the
# package:

Hq, Hkv, L, S, E, Ev = 6, 2, 4, 5, 3, 2
G = Hq // Hkv
q = rng.standard_normal((Hq, L, E))
k = rng.standard_normal((Hkv, S, E))
v = rng.standard_normal((Hkv, S, Ev))


def softmax_rows(t):
    e = np.exp(t - t.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def gqa_loop(q, k, v):
    """The oracle: query head h attends with kv head h // G."""
    Hq, Hkv = q.shape[-3], k.shape[-3]
    G = Hq // Hkv
    scale = 1.0 / np.sqrt(q.shape[-1])
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for h in range(Hq):
        kv = h // G
        P = softmax_rows(scale * q[h] @ k[kv].T)
        out[h] = P @ v[kv]
    return out


print("query head -> kv head:", {h: h // G for h in range(Hq)})
out_gqa, res_gqa = sdpa_ref.sdpa_forward(q, k, v, enable_gqa=True)
out_loop = gqa_loop(q, k, v)
print(f"max |sdpa_forward(enable_gqa=True) - loop| = {np.abs(out_gqa - out_loop).max():.1e}")
np.testing.assert_allclose(out_gqa, out_loop, rtol=RTOL, atol=1e-14)

# %%
# The same thing can be written as ordinary multi-head attention on keys
# and values *repeated* :math:`G` times along the head axis,
# :math:`K^{\mathrm{rep}}_h = K_{\lfloor h/G \rfloor}` (``np.repeat``, which
# is ``repeat_interleave``). The forward is identical:

k_rep = np.repeat(k, G, axis=0)          # (Hq, S, E): [k0, k0, k0, k1, k1, k1]
v_rep = np.repeat(v, G, axis=0)
out_rep, res_rep = sdpa_ref.sdpa_forward(q, k_rep, v_rep)
np.testing.assert_allclose(out_rep, out_gqa, rtol=RTOL, atol=1e-14)

# %%
# Why the gradients of K and V sum over the group
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
#
# The repetition is a linear map :math:`K \mapsto K^{\mathrm{rep}} = R K`
# that copies each kv head :math:`G` times. The chain rule sends a
# cotangent back through a linear map by its transpose, and the transpose
# of "copy" is "add the copies":
#
# .. math::
#
#    dK_c = \sum_{g=0}^{G-1} dK^{\mathrm{rep}}_{cG + g},
#    \qquad
#    dV_c = \sum_{g=0}^{G-1} dV^{\mathrm{rep}}_{cG + g}.
#
# Each of the :math:`G` query heads that reads kv head :math:`c` pushes its
# own gradient into it, and they add up. So the repeated model's gradients,
# summed over each group, must equal what :func:`~sdpa_ref.sdpa_backward`
# returns for the GQA forward (whose ``dk`` already has the :math:`H_{kv}`
# heads of ``k``):

g = rng.standard_normal(out_gqa.shape)     # a random cotangent (never all ones: that hides errors)
grads = sdpa_ref.sdpa_backward(res_gqa, g)
grads_rep = sdpa_ref.sdpa_backward(res_rep, g)
dk_summed = grads_rep.key.reshape(Hkv, G, S, E).sum(axis=1)
dv_summed = grads_rep.value.reshape(Hkv, G, S, Ev).sum(axis=1)
print("dk:", grads.key.shape, " repeated model's dk:", grads_rep.key.shape)
print(f"max |dk - sum over the group| = {np.abs(grads.key - dk_summed).max():.1e}")
print(f"max |dv - sum over the group| = {np.abs(grads.value - dv_summed).max():.1e}")
np.testing.assert_allclose(grads.key, dk_summed, rtol=RTOL, atol=1e-14)
np.testing.assert_allclose(grads.value, dv_summed, rtol=RTOL, atol=1e-14)
np.testing.assert_allclose(grads.query, grads_rep.query, rtol=RTOL, atol=1e-14)

# %%
# And the GQA backward against central finite differences of the GQA
# forward, every entry of the Jacobian (:func:`sdpa_ref.check_vjp`,
# ``mode="full"``):


def gqa_fun(q, k, v):
    return sdpa_ref.sdpa_forward(q, k, v, enable_gqa=True)[0]


def gqa_vjp(g, q, k, v):
    gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, enable_gqa=True)[1], g)
    return gr.query, gr.key, gr.value


rep = sdpa_ref.check_vjp(gqa_fun, gqa_vjp, (q, k, v), rtol=GRAD_RTOL)
print(rep)
if not rep.ok:
    raise AssertionError(f"the GQA backward disagrees with finite differences:\n{rep}")

# %%
# A backward that takes the gradient of only one head of each group (as if
# each kv head had one reader) is wrong, and the same check says so, and
# says it is the keys and values (args 1 and 2) and not the queries:


def gqa_vjp_first_head_only(g, q, k, v):
    gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, enable_gqa=True)[1], g)
    rep_gr = sdpa_ref.sdpa_backward(
        sdpa_ref.sdpa_forward(q, np.repeat(k, G, axis=0), np.repeat(v, G, axis=0))[1], g)
    return gr.query, rep_gr.key[::G], rep_gr.value[::G]      # no sum: wrong


bad = sdpa_ref.check_vjp(gqa_fun, gqa_vjp_first_head_only, (q, k, v))
print(bad)
if bad.ok or bad.per_arg[0]["failed"] or not (bad.per_arg[1]["failed"] and bad.per_arg[2]["failed"]):
    raise AssertionError(f"the checker should blame dk and dv (only) of the unsummed backward:\n{bad}")

# %%
# Masks: boolean and additive
# ---------------------------
#
# A mask says which keys each query may attend to. The package takes two
# kinds (as PyTorch's ``attn_mask`` does):
#
# * a **boolean** mask, ``True`` = the key takes part. Excluded entries get
#   :math:`P_{ij} = 0` exactly;
# * a **float** mask, *added* to the scores before the softmax:
#   :math:`T = sQK^\top + M`. A finite :math:`M_{ij}` is a bias (it has a
#   gradient, ``grads.attn_mask``), and only :math:`M_{ij} = -\infty`
#   excludes the key. So the float mask equivalent to a boolean mask ``m``
#   is ``np.where(m, 0, -np.inf)``, and it gives the same bits.
#
# The package builds the common masks (all broadcast against the scores
# :math:`(\ldots, H_q, L, S)`):
#
# * :func:`~sdpa_ref.causal_mask` ``(L, S)``: key :math:`j \le i + \mathrm{off}`,
#   with :math:`\mathrm{off} = 0` for ``"top_left"`` (PyTorch, JAX) and
#   :math:`S - L` for ``"bottom_right"`` (FlashAttention, where the last
#   query sits at the last key);
# * :func:`~sdpa_ref.window_mask` ``(L, S, left, right)``: the sliding window
#   :math:`i + \mathrm{off} - \mathrm{left} \le j \le i + \mathrm{off} +
#   \mathrm{right}`, inclusive;
# * :func:`~sdpa_ref.padding_mask` ``(q_lengths, kv_lengths, L, S)``: per
#   sequence of a padded batch, :math:`i < q_{len}` and :math:`j < kv_{len}`,
#   shaped ``(B, 1, L, S)`` to broadcast over the heads.

masks = {
    "causal_mask(6, 8)\n(top-left)": sdpa_ref.causal_mask(6, 8),
    "causal_mask(6, 8, 'bottom_right')": sdpa_ref.causal_mask(6, 8, "bottom_right"),
    "window_mask(8, 8, 2, 1)": sdpa_ref.window_mask(8, 8, 2, 1),
    "padding_mask([5], [6], 8, 8)[0, 0]": sdpa_ref.padding_mask([5], [6], 8, 8)[0, 0],
}
fig, axes = plt.subplots(1, 4, figsize=(13, 4.3), constrained_layout=True)
for ax, (title, m) in zip(axes, masks.items()):
    ax.imshow(m, cmap="Greys_r", vmin=0, vmax=1.6)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("key j")
    ax.set_xticks(range(m.shape[1]))
    ax.set_yticks(range(m.shape[0]))
axes[0].set_ylabel("query i")
fig.suptitle("mask patterns: light = True (may attend), black = excluded")

# the pictures are the definitions: check them against the formulas, entry by entry
i, j = np.arange(6)[:, None], np.arange(8)[None, :]
np.testing.assert_array_equal(sdpa_ref.causal_mask(6, 8), j <= i)
np.testing.assert_array_equal(sdpa_ref.causal_mask(6, 8, "bottom_right"), j <= i + (8 - 6))
i, j = np.arange(8)[:, None], np.arange(8)[None, :]
np.testing.assert_array_equal(sdpa_ref.window_mask(8, 8, 2, 1), (j >= i - 2) & (j <= i + 1))
np.testing.assert_array_equal(sdpa_ref.padding_mask([5], [6], 8, 8)[0, 0], (i < 5) & (j < 6))

# %%
# An attention pattern with a causal mask: every row is a distribution over
# the keys up to the diagonal, and the entries above it are exact zeros
# (drawn in grey). The boolean mask and the float mask of :math:`0` and
# :math:`-\infty` give the same bits.

T_len = 10
qc = rng.standard_normal((1, T_len, 8)) * 1.5
kc = rng.standard_normal((1, T_len, 8)) * 1.5
vc = rng.standard_normal((1, T_len, 4))
causal = sdpa_ref.causal_mask(T_len, T_len)
out_b, res_b = sdpa_ref.sdpa_forward(qc, kc, vc, attn_mask=causal)
out_f, res_f = sdpa_ref.sdpa_forward(qc, kc, vc, attn_mask=np.where(causal, 0.0, -np.inf))
out_c, res_c = sdpa_ref.sdpa_forward(qc, kc, vc, is_causal=True)
P = res_b.probs[0]
np.testing.assert_array_equal(out_b, out_f)             # bool mask == float mask of 0 / -inf, bit for bit
np.testing.assert_array_equal(res_b.probs, res_f.probs)
np.testing.assert_allclose(out_c, out_b, rtol=RTOL, atol=1e-15)   # is_causal=True: the same allowed set
if not np.all(P[~causal] == 0.0):
    raise AssertionError("a masked probability is not exactly 0")
np.testing.assert_allclose(P.sum(axis=-1), 1.0, rtol=1e-14)
print(f"masked entries of P: {np.count_nonzero(~causal)}, of which exactly 0: {np.count_nonzero(P[~causal] == 0)}")

fig, ax = plt.subplots(figsize=(5.2, 4.4), constrained_layout=True)
cmap = plt.get_cmap("viridis").copy()
cmap.set_bad("0.85")
im = ax.imshow(np.ma.masked_where(~causal, P), cmap=cmap, vmin=0, vmax=1)
fig.colorbar(im, ax=ax, label="attention weight $P_{ij}$")
ax.set_xlabel("key j")
ax.set_ylabel("query i")
ax.set_title("causal attention: grey = masked, exactly 0")

# %%
# Gradients at masked positions are exactly zero
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
#
# The backward of the softmax is :math:`dT_{ij} = P_{ij} (dP_{ij} - D_i)`:
# where :math:`P_{ij} = 0` exactly, :math:`dT_{ij} = 0` exactly. So the
# gradient of a float mask at its :math:`-\infty` entries is 0, and a key
# that no query may attend to gets :math:`dK_j = 0` and :math:`dV_j = 0`,
# not "small". Here a padding mask hides the last keys of a sequence from
# every query:

Lp, Sp, kv_len = 4, 6, 4
qp, kp, vp = rng.standard_normal((1, 2, Lp, 3)), rng.standard_normal((1, 2, Sp, 3)), rng.standard_normal((1, 2, Sp, 2))
pad = sdpa_ref.padding_mask(None, [kv_len], Lp, Sp)          # (1, 1, L, S): keys j >= 4 excluded
fmask = np.where(pad, 0.0, -np.inf)
out_p, res_p = sdpa_ref.sdpa_forward(qp, kp, vp, attn_mask=fmask)
gp = sdpa_ref.sdpa_backward(res_p, rng.standard_normal(out_p.shape))
print("dK of the padded keys:", gp.key[..., kv_len:, :].ravel())
print("dV of the padded keys:", gp.value[..., kv_len:, :].ravel())
print("d(float mask) where it is -inf:", gp.attn_mask[..., ~pad[0, 0]].ravel())
for name, arr in (("dK", gp.key[..., kv_len:, :]), ("dV", gp.value[..., kv_len:, :]),
                  ("d mask", gp.attn_mask[..., ~pad[0, 0]])):
    if not np.all(arr == 0.0):
        raise AssertionError(f"{name} at masked positions is not exactly 0: {arr.ravel()}")
# and the finite entries of the float mask are a bias: their gradient is right (the -inf entries cannot be
# perturbed, so the checker leaves them out)


def masked_fun(q, k, v, m):
    return sdpa_ref.sdpa_forward(q, k, v, attn_mask=m)[0]


def masked_vjp(g, q, k, v, m):
    gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, attn_mask=m)[1], g)
    return gr.query, gr.key, gr.value, gr.attn_mask


rep = sdpa_ref.check_vjp(masked_fun, masked_vjp, (qp, kp, vp, np.broadcast_to(fmask, (1, 2, Lp, Sp))),
                         rtol=GRAD_RTOL)
print(rep)
if not rep.ok:
    raise AssertionError(f"masked attention's backward disagrees with finite differences:\n{rep}")

# %%
# Why not fill the scores with :math:`-10^9`?
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
#
# Two popular shortcuts stand in for a mask with a large negative number:
# *adding* :math:`-10^9` to the masked scores (a float mask
# ``(1 - m) * -1e9``, as BERT-style "extended attention masks" do), or
# *replacing* them by it (``scores.masked_fill(~m, -1e9)``). For ordinary
# rows both work in float64, since :math:`e^{-10^9}` underflows to exactly
# 0. But a number is not an exclusion, and they leak:
#
# 1. **Added, against scores of a comparable size.** A masked score of
#    :math:`2.5 \times 10^9` (say, unscaled scores of a model whose
#    activations have blown up) minus :math:`10^9` is still the largest in
#    its row, and the masked key takes all the weight.
# 2. **Added, on a fully masked row.** Every score of the row moves by the
#    same :math:`-10^9`, and the softmax does not change when every score
#    moves by the same amount: the row attends to the keys it was forbidden
#    to see *as if there were no mask at all*.
# 3. **Replaced, on a fully masked row.** Every score is the same
#    :math:`-10^9`: the output is the plain mean of :math:`V`, and the
#    gradient flows into the values of keys the query may not see.
# 4. **Low precision.** :math:`-10^9` is not a float16 number: it rounds to
#    :math:`-\infty`, and a fully masked row becomes
#    :math:`-\infty - (-\infty) = \mathrm{NaN}`.
#
# The additive shortcut is what the package computes when given a float
# mask of :math:`-10^9` (a finite float mask is a bias, as far as any
# implementation can know), so cases 1 and 2 use it; case 3 is written out.
# Each is set against the boolean mask:

v1 = np.array([[[1.0], [2.0], [3.0]]])        # three keys, values 1, 2, 3
k1 = np.eye(3)[None]                          # with scale=1 and k = I, the scores are the query itself
keep = np.array([[True, True, False]])        # one query row; key 2 is masked
q_big = np.array([[[1.0e9, 0.5e9, 2.5e9]]])   # 1. scores of size 1e9


def probs(q, mask):
    return sdpa_ref.sdpa_forward(q, k1, v1, attn_mask=mask, scale=1.0)[1].probs[0]


p_bool, p_add = probs(q_big, keep), probs(q_big, np.where(keep, 0.0, -1e9))
print("1. scores ~1e9:      P, bool mask:", p_bool, "  P, -1e9 added:", p_add)
np.testing.assert_array_equal(p_bool, [[1.0, 0.0, 0.0]])
if not p_add[0, 2] > 0.5:
    raise AssertionError(f"expected the added -1e9 to leak the masked key's weight, got {p_add}")

none = np.zeros((1, 3), bool)                 # 2. a fully masked row, ordinary scores
q_row = np.array([[[1.0, 0.5, 2.5]]])
p_add_row = probs(q_row, np.where(none, 0.0, -1e9))
p_unmasked = probs(q_row, None)
print("2. fully masked row: P, -1e9 added:", p_add_row, "  P, no mask at all:", p_unmasked)
np.testing.assert_allclose(p_add_row, p_unmasked, rtol=1e-6)


def attention_masked_fill(q, k, v, keep, fill=-1e9):
    """3. the replacing shortcut, written out: scores of masked keys become `fill`."""
    P = softmax_rows(np.where(keep, q @ np.swapaxes(k, -1, -2), fill))
    return P @ v, P


o_fill, p_fill = attention_masked_fill(q_row, k1, v1, none)
dv_fill = np.swapaxes(p_fill, -1, -2) @ np.ones((1, 1, 1))     # dV = P^T dO, with dO = 1
o_bool, r_bool = sdpa_ref.sdpa_forward(q_row, k1, v1, attn_mask=none, scale=1.0)
dv_bool = sdpa_ref.sdpa_backward(r_bool, np.ones((1, 1, 1))).value
print("3. fully masked row: out, masked_fill(-1e9):", o_fill.ravel(), "(the mean of V)  dV:", dv_fill.ravel())
print("                     out, bool mask:        ", o_bool.ravel(), "                   dV:", dv_bool.ravel())
np.testing.assert_allclose(o_fill.ravel(), [v1.mean()], rtol=1e-14)
np.testing.assert_array_equal(o_bool.ravel(), [0.0])
np.testing.assert_array_equal(dv_bool, 0.0)

with np.errstate(over="ignore", invalid="ignore"):   # 4. float16: the overflow is the point
    neg_big = np.float16(-1e9)
    t16 = np.full(3, neg_big, dtype=np.float16)       # a fully masked row after masked_fill(-1e9)
    e16 = np.exp(t16 - t16.max())
    p16 = e16 / e16.sum()
print(f"4. float16(-1e9) = {neg_big};  softmax of that fully masked float16 row: {p16}")
if not (np.isneginf(neg_big) and np.all(np.isnan(p16))):
    raise AssertionError(f"expected -1e9 to overflow float16 and the row to be NaN, got {neg_big}, {p16}")

# %%
# The package never writes a sentinel: an excluded entry is not computed
# with, whatever the dtype and whatever the scores, so :math:`P_{ij} = 0`
# and :math:`dT_{ij} = 0` exactly. What a row with no allowed key gets is
# then a decision, not an accident of a constant.
#
# The fully masked row
# --------------------
#
# A query row can have no key to attend to: a boolean mask row of all
# ``False``, a causal mask with :math:`L > S` under bottom-right alignment,
# a sliding window that misses every key, a sequence of length zero. The
# formula gives :math:`0/0`. Implementations disagree about the answer
# (from the table of conventions in :doc:`the contract </semantics>`):
#
# ==========================  ===============================================
# implementation              a fully masked row gets
# ==========================  ===============================================
# PyTorch                     zeros (2.5 and later, math backend; older: NaN)
# JAX                         the mean of :math:`V` (it masks with a finite
#                             large negative value)
# FlashAttention              zeros; its LSE is :math:`-\infty` (FA3, FA4) or
#                             :math:`+\infty` (FA2)
# xformers reference          NaN
# ==========================  ===============================================
#
# :mod:`sdpa_ref` makes it an option, ``fully_masked``, with the policies in
# ``sdpa_ref.FULLY_MASKED_POLICIES``:
#
# * ``"zero"`` (the default): output 0 and every gradient from the row 0
#   (PyTorch, FlashAttention);
# * ``"nan"``: NaN, the textbook formula (xformers); the NaN reaches
#   :math:`dK` and :math:`dV` of the head, as the formula's would;
# * ``"uniform"``: the softmax over all :math:`S` keys as if masking used
#   one finite large negative value: the mean of :math:`V`; its
#   probabilities do not depend on the scores, so :math:`dQ` of the row is 0
#   and only :math:`dV` gets :math:`g_i / S` per key;
# * ``"jax"``: JAX's algorithm exactly: it averages the keys the structural
#   rules exclude, which for a boolean mask is every key, the same bits as
#   ``"uniform"``; it differs only on rows emptied by :math:`-\infty`
#   floats (then NaN, as JAX).
#
# The LSE (log-sum-exp of the allowed scores, which FlashAttention returns
# for its backward) is a sum over no terms: :math:`\log 0 = -\infty` under
# every policy.
#
# One problem, row 1 of 3 fully masked, under each policy:

Lm, Sm = 3, 4
qm, km, vm = rng.standard_normal((1, Lm, 3)), rng.standard_normal((1, Sm, 3)), rng.standard_normal((1, Sm, 2))
row_mask = np.ones((Lm, Sm), bool)
row_mask[1] = False                       # query 1 may attend to nothing
gm = rng.standard_normal((1, Lm, 2))
keep_rows = [0, 2]                        # the same problem without row 1, for comparison
_, res_wo = sdpa_ref.sdpa_forward(qm[:, keep_rows], km, vm, attn_mask=row_mask[keep_rows])
grads_wo = sdpa_ref.sdpa_backward(res_wo, gm[:, keep_rows])

print(f"{'policy':>8} | {'out[1]':>18} | {'lse[1]':>6} | {'dq[1]':>15} | row 1's share of dV[:, 0]")
results = {}
for policy in sdpa_ref.FULLY_MASKED_POLICIES:
    out_m, lse_m = sdpa_ref.scaled_dot_product_attention(qm, km, vm, attn_mask=row_mask, return_lse=True,
                                                        fully_masked=policy)
    _, res_m = sdpa_ref.sdpa_forward(qm, km, vm, attn_mask=row_mask, fully_masked=policy)
    gr = sdpa_ref.sdpa_backward(res_m, gm)
    results[policy] = (out_m, lse_m, gr)
    with np.errstate(invalid="ignore"):
        dv_share = gr.value - grads_wo.value
    print(f"{policy:>8} | {np.array2string(out_m[0, 1], precision=4):>18} | {lse_m[0, 1]:>6} | "
          f"{np.array2string(gr.query[0, 1], precision=2):>15} | {np.array2string(dv_share[0, :, 0], precision=4)}")

# %%
# What the contract promises, checked:

for policy, (out_m, lse_m, gr) in results.items():
    if not np.isneginf(lse_m[0, 1]):
        raise AssertionError(f"{policy}: the LSE of a row with no key should be -inf, got {lse_m[0, 1]}")
    # the other rows do not notice row 1, under every policy
    np.testing.assert_allclose(out_m[0, keep_rows], sdpa_ref.scaled_dot_product_attention(
        qm[:, keep_rows], km, vm, attn_mask=row_mask[keep_rows])[0], rtol=RTOL, atol=1e-15)

out_z, _, gr_z = results["zero"]
np.testing.assert_array_equal(out_z[0, 1], 0.0)
np.testing.assert_array_equal(gr_z.query[0, 1], 0.0)
np.testing.assert_allclose(gr_z.key, grads_wo.key, rtol=RTOL, atol=1e-15)    # row 1 adds nothing to dK, dV
np.testing.assert_allclose(gr_z.value, grads_wo.value, rtol=RTOL, atol=1e-15)

out_n, _, gr_n = results["nan"]
if not (np.isnan(out_n[0, 1]).all() and np.isnan(gr_n.query[0, 1]).all() and np.isnan(gr_n.key).all()):
    raise AssertionError("'nan': the row and its head's dK should be NaN")

out_u, _, gr_u = results["uniform"]
np.testing.assert_allclose(out_u[0, 1], vm[0].mean(axis=0), rtol=RTOL)        # the mean of V over all S keys
np.testing.assert_array_equal(gr_u.query[0, 1], 0.0)                          # P does not depend on q_1
np.testing.assert_allclose(gr_u.key, grads_wo.key, rtol=RTOL, atol=1e-15)      # nor on the keys
np.testing.assert_allclose(gr_u.value - grads_wo.value, np.broadcast_to(gm[0, 1] / Sm, (1, Sm, 2)),
                           rtol=1e-10, atol=1e-15)                             # dV_j gets g_1 / S

out_j, _, gr_j = results["jax"]
np.testing.assert_array_equal(out_j, out_u)       # a boolean mask: JAX averages every key, as "uniform"
for f in ("query", "key", "value"):
    np.testing.assert_array_equal(getattr(gr_j, f), getattr(gr_u, f))

# %%
# The gradients of the finite policies are not only finite: they are the
# derivatives of the function each policy defines, by finite differences.
# (Under ``"zero"`` the row is the constant 0, under ``"uniform"`` the
# constant-weight mean of :math:`V`; both are smooth.)

for policy in ("zero", "uniform", "jax"):
    def fun(q, k, v, policy=policy):
        return sdpa_ref.sdpa_forward(q, k, v, attn_mask=row_mask, fully_masked=policy)[0]

    def vjp(g, q, k, v, policy=policy):
        gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, attn_mask=row_mask, fully_masked=policy)[1], g)
        return gr.query, gr.key, gr.value

    rep = sdpa_ref.check_vjp(fun, vjp, (qm, km, vm), rtol=GRAD_RTOL)
    print(f"{policy:>8}: {rep}".splitlines()[0])
    if not rep.ok:
        raise AssertionError(f"fully_masked={policy!r}: the backward disagrees with finite differences:\n{rep}")

# %%
# Which policy to pick? To compare against a kernel, the kernel's own:
# ``"zero"`` for PyTorch 2.5+ and FlashAttention, ``"jax"`` for
# ``jax.nn.dot_product_attention``, ``"nan"`` for xformers' reference. To
# train, ``"zero"``: a padded query contributes nothing, to the output or to
# any gradient. The contract (:doc:`/semantics`, "A row with no allowed
# key") has the full statement, including rows emptied by :math:`-\infty` float masks and
# per-sequence lengths (query rows past ``q_lengths`` are 0 under every
# policy).
