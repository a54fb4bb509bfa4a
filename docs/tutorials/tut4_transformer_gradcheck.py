r"""
A 2-layer Transformer, checked end to end
=========================================

Each layer's backward in ``examples/nn.py`` is tested alone against finite
differences. This page puts them together into a small Transformer (the
model of the copy-task example, shrunk), writes its whole backward by hand,
and checks *the whole model's gradient* against central finite differences
of the loss, parameter by parameter, as cs231n's notes on gradient checking
:cite:p:`karpathy2016cs231n`
recommend: relative errors, float64, a sensible step, kinks detected, and a
check after some training as well as at initialisation. Then it trains the
model for a few hundred Adam steps on a copy task, and finally breaks one
line of the attention backward to show that the whole-model check finds it.

How much earlier the :math:`1/\sqrt{d_k}`-scaled model learns the copy task
than the unscaled one, over several seeds, is the subject of the
:ref:`copy-task example <sphx_glr_auto_examples_copy_task.py>`.
"""

import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

try:
    HERE = Path(__file__).resolve().parent
except NameError:                       # the docs gallery runs each page in its own folder, without __file__
    HERE = Path.cwd()
sys.path.insert(0, str(HERE.parents[1] / "examples"))   # examples/nn.py: the layers, beside the copy task
import nn  # noqa: E402

H_STEP = 1e-5           # the finite-difference step (the parameters are of order 1)
REL_TOL = 1e-5          # a checked coordinate fails above this relative error ...
ABS_FLOOR = 1e-9        # ... unless |analytic - numeric| is below this (see "the error sizes" below)
N_COORDS = 4            # random coordinates checked per parameter

# %%
# The task and the model
# ----------------------
#
# The copy task: the model reads :math:`N` random tokens, a separator, and
# must then repeat the :math:`N` tokens, predicting one position ahead.
# Only the copied positions count in the loss. A causal model can solve it
# only by attention: output position :math:`N + t` must look back
# :math:`N + 1` places, across the separator.

N_COPY, VOCAB = 8, 10           # copy 8 tokens drawn from 10; token 10 is the separator
T = 2 * N_COPY                  # positions the model sees
D, HEADS, D_MLP, N_LAYERS = 32, 2, 64, 2      # d_k = D / HEADS = 16


def make_batch(rng, batch):
    """Inputs, targets and loss weights for [x_1..x_N, SEP, x_1..x_N], predicted one ahead."""
    x = rng.integers(0, VOCAB, (batch, N_COPY))
    seq = np.concatenate([x, np.full((batch, 1), VOCAB), x], axis=1)
    weights = np.zeros((batch, T))
    weights[:, N_COPY:] = 1.0           # the positions SEP, x_1 .. x_{N-1} predict x_1 .. x_N
    return seq[:, :-1], seq[:, 1:], weights


# %%
# The model is a pre-LayerNorm Transformer: token and learned position
# embeddings; per layer, causal multi-head self-attention and a ReLU MLP,
# each on a layer-normed copy of the residual stream and added back to it;
# a final LayerNorm and an output projection. Every function comes in a
# pair, ``y, cache = f(x, ...)`` and ``grads = f_backward(cache, g)``, and the
# attention inside ``nn.multi_head_attention`` is
# :func:`sdpa_ref.sdpa_forward` with its hand-derived
# :func:`sdpa_ref.sdpa_backward`. There is no dropout and no weight decay:
# nothing random or extra in the loss that the check would have to hold
# fixed (with dropout on, both sides of every difference must use the same
# mask: ``sdpa_forward``'s ``dropout_mask=``).


def init_params(rng):
    s = 1.0 / np.sqrt(D)
    p = {"tok": rng.standard_normal((VOCAB + 1, D)) * 0.5, "pos": rng.standard_normal((T, D)) * 0.5,
         "lnf_g": np.ones(D), "lnf_b": np.zeros(D), "out": rng.standard_normal((D, VOCAB + 1)) * s}
    for i in range(N_LAYERS):
        for name in ("wq", "wk", "wv", "wo"):
            p[f"{i}.{name}"] = rng.standard_normal((D, D)) * s
        p[f"{i}.ln1_g"], p[f"{i}.ln1_b"] = np.ones(D), np.zeros(D)
        p[f"{i}.ln2_g"], p[f"{i}.ln2_b"] = np.ones(D), np.zeros(D)
        p[f"{i}.w1"], p[f"{i}.b1"] = rng.standard_normal((D, D_MLP)) * s, np.zeros(D_MLP)
        p[f"{i}.w2"], p[f"{i}.b2"] = rng.standard_normal((D_MLP, D)) / np.sqrt(D_MLP), np.zeros(D)
    return p


def forward(p, inputs):
    c = {}
    x, c["tok"] = nn.embedding(inputs, p["tok"])
    x = x + p["pos"]
    for i in range(N_LAYERS):
        h, c[f"{i}.ln1"] = nn.layer_norm(x, p[f"{i}.ln1_g"], p[f"{i}.ln1_b"])
        a, c[f"{i}.attn"] = nn.multi_head_attention(h, p[f"{i}.wq"], p[f"{i}.wk"], p[f"{i}.wv"], p[f"{i}.wo"],
                                                    HEADS, is_causal=True)
        x = x + a
        h, c[f"{i}.ln2"] = nn.layer_norm(x, p[f"{i}.ln2_g"], p[f"{i}.ln2_b"])
        u, c[f"{i}.fc1"] = nn.linear(h, p[f"{i}.w1"], p[f"{i}.b1"])
        u, c[f"{i}.relu"] = nn.relu(u)          # the cache is the mask u > 0: it tells us about kinks
        m, c[f"{i}.fc2"] = nn.linear(u, p[f"{i}.w2"], p[f"{i}.b2"])
        x = x + m
    h, c["lnf"] = nn.layer_norm(x, p["lnf_g"], p["lnf_b"])
    logits, c["out"] = nn.linear(h, p["out"])
    return logits, c


def backward(c, dlogits, mha_backward=nn.multi_head_attention_backward):
    """Every forward line above, reversed. ``mha_backward`` is a parameter so that we can break it later."""
    g = {}
    dh, g["out"], _ = nn.linear_backward(c["out"], dlogits)
    dx, g["lnf_g"], g["lnf_b"] = nn.layer_norm_backward(c["lnf"], dh)
    for i in reversed(range(N_LAYERS)):
        du, g[f"{i}.w2"], g[f"{i}.b2"] = nn.linear_backward(c[f"{i}.fc2"], dx)
        du = nn.relu_backward(c[f"{i}.relu"], du)
        dh, g[f"{i}.w1"], g[f"{i}.b1"] = nn.linear_backward(c[f"{i}.fc1"], du)
        dh, g[f"{i}.ln2_g"], g[f"{i}.ln2_b"] = nn.layer_norm_backward(c[f"{i}.ln2"], dh)
        dx = dx + dh                            # the residual: x feeds both the branch and the sum
        dh, g[f"{i}.wq"], g[f"{i}.wk"], g[f"{i}.wv"], g[f"{i}.wo"] = mha_backward(c[f"{i}.attn"], dx)
        dh, g[f"{i}.ln1_g"], g[f"{i}.ln1_b"] = nn.layer_norm_backward(c[f"{i}.ln1"], dh)
        dx = dx + dh
    g["pos"] = dx.sum(axis=0)                   # the position table is added to every sequence
    g["tok"] = nn.embedding_backward(c["tok"], dx)
    return g


def loss_and_grads(p, batch, mha_backward=nn.multi_head_attention_backward):
    inputs, targets, weights = batch
    logits, c = forward(p, inputs)
    loss, ce = nn.softmax_cross_entropy(logits, targets, weights)
    return loss, backward(c, nn.softmax_cross_entropy_backward(ce), mha_backward)


def loss_and_kinks(p, batch):
    """The loss alone, and the ReLU patterns (which units are on): what a finite difference must not change."""
    inputs, targets, weights = batch
    logits, c = forward(p, inputs)
    return nn.softmax_cross_entropy(logits, targets, weights)[0], [c[f"{i}.relu"] for i in range(N_LAYERS)]


# %%
# Gradient checking, as cs231n's notes say
# ----------------------------------------
#
# For a parameter coordinate :math:`\theta_i`, the centred difference
#
# .. math::
#
#    n_i = \frac{\mathcal{L}(\theta + h e_i) - \mathcal{L}(\theta - h e_i)}{2h}
#
# has a truncation error of order :math:`h^2` (the one-sided difference:
# order :math:`h`) and a rounding error of order
# :math:`\epsilon_{\text{mach}} |\mathcal{L}| / h`. Compare it with the
# backward's :math:`a_i` by the **relative error**
#
# .. math::
#
#    r_i = \frac{|a_i - n_i|}{\max(|a_i|, |n_i|)},
#
# not the absolute one: an absolute :math:`10^{-4}` is alarming for a
# gradient of :math:`10^{-5}` and harmless for one of :math:`10^{2}`. How to
# read it (cs231n's rule of thumb, in float64):
#
# * :math:`r \lesssim 10^{-7}`: right;
# * :math:`10^{-7}` to :math:`10^{-4}`: suspicious, unless the loss has kinks
#   near the point (ReLU, max); in a deep network errors also compound, so a
#   few layers may legitimately push the right answer toward the upper end;
# * :math:`\gtrsim 10^{-2}`: the gradient is wrong.
#
# The practical rules that make those numbers meaningful:
#
# * **float64.** In float32 the rounding term alone is up to about
#   :math:`10^{-7} \cdot |\mathcal{L}| / h`, which with :math:`h = 10^{-5}`
#   and a loss near 2 is :math:`10^{-2}`: as large as the gradients
#   themselves (shown below).
# * **The step** :math:`h \approx 10^{-5}` to :math:`10^{-6}` for parameters
#   of order one: smaller is not better, as the rounding term grows as
#   :math:`1/h`.
# * **Kinks.** :math:`\mathrm{ReLU}(u) = \max(u, 0)` is not differentiable at
#   0. If a step moves some pre-activation :math:`u` across 0, the
#   difference quotient averages two slopes and disagrees with either; it is
#   not a bug. We detect it as the notes suggest: record which units are
#   on at :math:`\theta + h e_i` and at :math:`\theta - h e_i`; if the pattern
#   differs, a kink was crossed, and the coordinate is counted and skipped.
# * **A small floor.** When both values are tiny (a gradient of
#   :math:`10^{-9}`), :math:`r` measures the difference quotient's own
#   rounding noise (about :math:`10^{-11}` in absolute terms here), not the
#   backward. So a coordinate also passes when :math:`|a_i - n_i| \le
#   10^{-9}`; the table counts how many did only that way.
# * **Few coordinates, every parameter.** Each coordinate costs two
#   forwards, so check a few random ones of every parameter array, and all
#   of one small array, rather than all of one big array.
# * **Not only at initialisation**, where symmetric or tiny weights can hide a
#   term: check again after some training.
# * **Copies.** Perturb a copy; never the model's own array.


def grad_check(p, batch, mha_backward=nn.multi_head_attention_backward, full=("0.ln1_g",), seed=0, h=H_STEP):
    """Rows (name, checked, kinks skipped, passed only by the floor, max relative error, failures)."""
    rng = np.random.default_rng(seed)
    _, grads = loss_and_grads(p, batch, mha_backward)
    rows = []
    for name, theta in p.items():
        coords = np.arange(theta.size) if name in full else rng.choice(theta.size, N_COORDS, replace=False)
        worst, kinks, floored, failed = 0.0, 0, 0, 0
        for i in coords:
            work = dict(p)
            work[name] = theta_i = theta.copy()         # a private copy: the model's array is never touched
            theta_i.flat[i] = theta.flat[i] + h
            loss_plus, on_plus = loss_and_kinks(work, batch)
            theta_i.flat[i] = theta.flat[i] - h
            loss_minus, on_minus = loss_and_kinks(work, batch)
            if any(np.any(a != b) for a, b in zip(on_plus, on_minus)):
                kinks += 1                              # a ReLU switched between the two sides: skip
                continue
            num = (loss_plus - loss_minus) / (2 * h)
            ana = grads[name].flat[i]
            err = abs(ana - num)
            rel = err / max(abs(ana), abs(num)) if err > 0 else 0.0
            if rel > REL_TOL and err <= ABS_FLOOR:
                floored += 1                            # both tiny: the floor decides, r means nothing here
                continue
            worst = max(worst, rel)
            failed += rel > REL_TOL
        rows.append((name, len(coords), kinks, floored, worst, failed))
    return rows


def print_table(rows, title):
    print(title)
    print(f"  {'parameter':<9} {'checked':>7} {'kinks':>5} {'floor':>5} {'max rel err':>11}  verdict")
    for name, n, kinks, floored, worst, failed in rows:
        verdict = "ok" if not failed else f"WRONG at {failed} of {n - kinks}"
        print(f"  {name:<9} {n:>7} {kinks:>5} {floored:>5} {worst:>11.1e}  {verdict}")


def failures(rows):
    return [r[0] for r in rows if r[5]]


# %%
# The check at initialisation
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
#
# Two sequences are enough (few data points: fewer kinks, cheaper
# forwards); every parameter array gets :math:`4` random coordinates, and
# the first LayerNorm's gain ``0.ln1_g``, the parameter farthest from the
# loss, all of its 32.

rng = np.random.default_rng(0)
params = init_params(rng)
check_batch = make_batch(np.random.default_rng(1), 2)
t0 = time.perf_counter()
rows_init = grad_check(params, check_batch)
print_table(rows_init, f"whole-model gradient check at initialisation (h = {H_STEP:g}, float64)")
print(f"({time.perf_counter() - t0:.1f} s)")
if failures(rows_init):
    raise AssertionError(f"the backward disagrees with finite differences at init for {failures(rows_init)}")

# %%
# Every error is in cs231n's "right" range, through two layers of
# attention, LayerNorm and MLP, and far below the tolerance
# :math:`10^{-5}`, which is set well above the noise of central differences
# with this step in float64 and far below the errors of a real mistake
# (order 1, at the end of this page). The largest errors are on
# coordinates with small gradients, where the difference quotient's fixed
# absolute noise weighs most.
#
# Why float64: the same differences with the loss computed in float32 (the
# analytic gradient stays float64) on a few coordinates of the output
# projection:

p32 = {k: x.astype(np.float32) for k, x in params.items()}
_, grads64 = loss_and_grads(params, check_batch)
for i in (3, 40, 100):
    x_plus, x_minus = p32["out"].copy(), p32["out"].copy()
    x_plus.flat[i] += np.float32(H_STEP)
    x_minus.flat[i] -= np.float32(H_STEP)
    loss_plus = loss_and_kinks({**p32, "out": x_plus}, check_batch)[0]
    loss_minus = loss_and_kinks({**p32, "out": x_minus}, check_batch)[0]
    num = (loss_plus - loss_minus) / (float(x_plus.flat[i]) - float(x_minus.flat[i]))   # over the realised step
    ana = grads64["out"].flat[i]
    print(f"out[{i}]: analytic {ana:+.6e}  float32 difference {num:+.6e}  relative error "
          f"{abs(ana - num) / max(abs(ana), abs(num)):.1e}")

# %%
# Kinks, planted
# ~~~~~~~~~~~~~~
#
# At random parameters a ReLU input rarely sits within :math:`10^{-5}` of 0
# (the ``kinks`` column above). To see the detector work, move the
# bias of one MLP unit so that one of its pre-activations is :math:`10^{-6}`,
# and check that bias: the :math:`\pm h` steps switch the unit off and on.

_, cache = forward(params, check_batch[0])
u0 = cache["0.fc1"][0] @ params["0.w1"] + params["0.b1"]      # pre-activations of layer 0's MLP, (B, T, D_MLP)
b, t, j = 1, T - 1, 5                                           # one unit at one position
kinked = dict(params)
kinked["0.b1"] = params["0.b1"].copy()
kinked["0.b1"][j] -= u0[b, t, j] - 1e-6                         # now that pre-activation is 1e-6
_, g_kinked = loss_and_grads(kinked, check_batch)
lp, on_p = loss_and_kinks({**kinked, "0.b1": kinked["0.b1"] + H_STEP * np.eye(D_MLP)[j]}, check_batch)
lm, on_m = loss_and_kinks({**kinked, "0.b1": kinked["0.b1"] - H_STEP * np.eye(D_MLP)[j]}, check_batch)
num, ana = (lp - lm) / (2 * H_STEP), g_kinked["0.b1"][j]
crossed = any(np.any(a != c) for a, c in zip(on_p, on_m))
print(f"0.b1[{j}]: analytic {ana:+.6e}  numeric {num:+.6e}  relative error "
      f"{abs(ana - num) / max(abs(ana), abs(num)):.1e};  kink crossed: {crossed}")
rows_kinked = grad_check(kinked, check_batch, full=("0.b1",))
print_table([r for r in rows_kinked if r[0] == "0.b1"], "the check of 0.b1, kinks skipped:")
if not crossed or dict((r[0], r[2]) for r in rows_kinked)["0.b1"] < 1:
    raise AssertionError("the planted kink was not detected")
if not abs(ana - num) / max(abs(ana), abs(num)) > 100 * REL_TOL:
    raise AssertionError(f"the planted kink should spoil the difference quotient: {ana} vs {num}")
if failures(rows_kinked):
    raise AssertionError(f"with the kink skipped the check should pass, but {failures(rows_kinked)} failed")

# %%
# Without the detector, that coordinate's error would read like a bug.
#
# Training on the copy task
# -------------------------
#
# A few hundred Adam steps of 32 sequences, with the gradients checked
# above; the held-out loss and copy accuracy are measured every 10 steps on
# 256 sequences the model never trains on. The parameters after 30 steps
# are kept for a second check.

STEPS, LR, BATCH, EVAL_EVERY = 200, 2e-3, 32, 10
held_out = make_batch(np.random.default_rng(10_000), 256)


def evaluate(p):
    inputs, targets, weights = held_out
    logits, _ = forward(p, inputs)
    loss, _ = nn.softmax_cross_entropy(logits, targets, weights)
    correct = (logits.argmax(-1) == targets) & (weights > 0)
    return loss, float(correct.sum() / weights.sum())


p, state = dict(params), nn.adam_init(params)
data_rng = np.random.default_rng(2)
history, after_30 = [], None
t0 = time.perf_counter()
for step in range(STEPS + 1):
    if step % EVAL_EVERY == 0:
        history.append((step, *evaluate(p)))
    if step == 30:
        after_30 = p
    if step == STEPS:
        break
    loss, grads = loss_and_grads(p, make_batch(data_rng, BATCH))
    p, state = nn.adam_update(p, grads, state, lr=LR, max_grad_norm=1.0)
print(f"{STEPS} Adam steps in {time.perf_counter() - t0:.1f} s")
for step, loss, acc in history[::4] + ([history[-1]] if (len(history) - 1) % 4 else []):
    print(f"  step {step:>4}: held-out loss {loss:.4f}, copy accuracy {acc:.1%}")

steps, losses, accs = (np.array(col) for col in zip(*history))
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
ax1.semilogy(steps, losses)
ax1.set_ylabel("held-out copy loss (nats)")
ax2.plot(steps, accs)
ax2.set_ylabel("held-out copy accuracy")
ax2.set_ylim(0, 1.02)
for ax in (ax1, ax2):
    ax.set_xlabel("Adam step")
    ax.grid(True, alpha=0.3)
fig.suptitle(f"copy task: {N_LAYERS}-layer Transformer, d_model {D}, {HEADS} heads, trained with hand-written backwards")

if not (accs[-1] >= 0.95 and losses[-1] < 0.1 * losses[0]):
    raise AssertionError(f"the model did not learn the copy task: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                         f"accuracy {accs[-1]:.1%}")

# %%
# Chance is :math:`1/10` per copied token, a loss of :math:`\ln 10 \approx
# 2.3` nats; the model ends near perfect copying. Now the second check, at
# the parameters after 30 steps, where the attention patterns have started
# to form and the weights are no longer the symmetric random draw:

rows_30 = grad_check(after_30, check_batch, seed=1)
print_table(rows_30, "whole-model gradient check after 30 Adam steps")
if failures(rows_30):
    raise AssertionError(f"the backward disagrees with finite differences after training for {failures(rows_30)}")

# %%
# At the *end* of training the loss is a few thousandths and so are the
# gradients, while the difference quotient's absolute noise does not
# shrink as much: relative errors grow there for no fault of the backward.
# That is the notes' advice to check in the "active range" of the
# computation, not at a point where everything is tiny.
#
# Break one line
# --------------
#
# Would this check notice a real mistake, buried in one layer of a
# two-layer model? Here is ``nn.multi_head_attention_backward``
# with its attention core written out (the backward of
# :doc:`the contract </semantics>`, derived step by step in
# :ref:`sphx_glr_auto_tutorials_tut2_attention_backward.py`), with a switch that
# breaks one line: forget the scale in :math:`dK`, or flip the sign of the
# softmax's :math:`-D` term.


def mha_backward_by_hand(cache, g, bug=None):
    x, wq, wk, wv, wo, merged, res, H = cache
    B, T_, D_ = x.shape

    def heads(y):       # (B, T, D) -> (B, H, T, D/H)
        return y.reshape(B, T_, H, D_ // H).transpose(0, 2, 1, 3)

    def unheads(y):     # (B, H, T, D/H) -> (B, T, D)
        return y.transpose(0, 2, 1, 3).reshape(B, T_, D_)

    q, k, v = heads(x @ wq), heads(x @ wk), heads(x @ wv)
    P, scale = res.probs, res.scale                     # softmax(scale Q K^T), causal entries exactly 0
    dwo = merged.reshape(-1, D_).T @ g.reshape(-1, D_)  # y = merged Wo
    do = heads(g @ wo.T)
    dv = np.swapaxes(P, -1, -2) @ do                    # O = P V
    dP = do @ np.swapaxes(v, -1, -2)
    Drow = np.sum(P * dP, axis=-1, keepdims=True)
    if bug == "sign":
        dS = P * (dP + Drow)                            # BROKEN: the sign of the softmax's -D term
    else:
        dS = P * (dP - Drow)                            # P = softmax(S), row by row
    dq = scale * (dS @ k)                               # S = scale Q K^T
    if bug == "no_scale_in_dK":
        dk = np.swapaxes(dS, -1, -2) @ q                # BROKEN: the scale is forgotten
    else:
        dk = scale * (np.swapaxes(dS, -1, -2) @ q)
    dq, dk, dv = unheads(dq), unheads(dk), unheads(dv)
    x2 = x.reshape(-1, D_)
    dx = dq @ wq.T + dk @ wk.T + dv @ wv.T              # q = x Wq, k = x Wk, v = x Wv
    return dx, x2.T @ dq.reshape(-1, D_), x2.T @ dk.reshape(-1, D_), x2.T @ dv.reshape(-1, D_), dwo


# unbroken, it is the package's backward, to rounding: so a failure below is the broken line's and not the copy's
_, g_pkg = loss_and_grads(after_30, check_batch)
_, g_hand = loss_and_grads(after_30, check_batch, mha_backward_by_hand)
for name in g_pkg:
    np.testing.assert_allclose(g_hand[name], g_pkg[name], rtol=1e-10, atol=1e-14, err_msg=name)
print("the written-out backward agrees with nn.multi_head_attention_backward on every parameter")

# %%
# Now each broken copy through the same whole-model check:

for bug in ("no_scale_in_dK", "sign"):
    rows_bug = grad_check(after_30, check_batch, lambda c, g, bug=bug: mha_backward_by_hand(c, g, bug), seed=1)
    print_table(rows_bug, f"whole-model check with bug={bug!r}")
    bad = failures(rows_bug)
    if not bad:
        raise AssertionError(f"the whole-model check did not catch bug={bug!r}")
    # what the table below reads off, held to it: which parameters the broken line reaches
    expect_wrong = {"1.wk", "1.ln1_g", "0.wq", "0.ln1_g", "tok"} | ({"1.wq", "1.ln1_b"} if bug == "sign" else set())
    expect_right = {"1.wv", "1.wo", "1.ln2_g", "1.w1", "out"} | ({"1.wq", "1.ln1_b"} if bug != "sign" else set())
    if not expect_wrong <= set(bad) or expect_right & set(bad):
        raise AssertionError(f"bug={bug!r}: expected wrong {sorted(expect_wrong)}, right {sorted(expect_right)}; "
                             f"the check failed {bad}")
    print(f"caught: {', '.join(bad)}\n")

# %%
# The table also says *where* to look. The last layer's ``1.wv`` and
# ``1.wo``, and everything after its attention (``1.ln2_g`` ... ``out``),
# are right: their gradients do not pass through the broken line.
# ``1.wk`` is wrong under both bugs, ``1.wq`` only under the sign bug (the
# forgotten scale is in :math:`dK` alone), and every parameter *before*
# the last attention is wrong: layer 0 and the embeddings get their
# gradient through :math:`dx`, which the broken line corrupts. The first
# wrong parameters, reading from the loss backwards, name the layer and the
# line.
#
# One exception is worth a second look: with the scale forgotten, the bias
# ``1.ln1_b`` in front of the attention stays right. Each row of
# :math:`dS = P \odot (dP - D)` sums to zero (softmax does not change when
# a row of scores moves by a constant), so the keys' gradients sum to zero,
# :math:`\sum_j dK_j = s \sum_i \big(\sum_j dS_{ij}\big) q_i = 0`, with
# the scale :math:`s` or without it, and a bias added at every position
# sees only that sum. The sign bug breaks the zero row sums, and
# ``1.ln1_b`` goes wrong with it. A check of a few coordinates of *every*
# parameter is what makes such blind spots harmless.
