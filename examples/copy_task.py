"""Train a tiny Transformer on a copy task, with and without the 1/sqrt(d_k) scaling.

The task needs attention: a causal model reads N random tokens, a separator,
and must then reproduce the N tokens, so every output position looks back
across the separator to the token N+1 places earlier. The loss and the
accuracy count only the copied positions.

The model is a 2-layer pre-LayerNorm Transformer, d_model 64, in pure NumPy:
token and learned position embeddings, multi-head causal self-attention
through sdpa_ref's forward and hand-derived backward, a ReLU MLP, a final
LayerNorm and an output projection, trained with Adam. Every backward is
hand-written (sdpa_ref.nn, finite-difference tested). Both runs start from the
same initial weights and see the same batches; the only difference is the
attention scale: 1/sqrt(d_k) or 1.

With the default one head, d_k = 64 as in the classic worked example;
``--heads 4`` gives d_k = 16. ``--method plain`` trains through the teaching
core (sdpa_ref.attention), whose forward and backward read next to the
derivation in SEMANTICS.md: the same losses as the default fast engine.

Run: python examples/copy_task.py [--steps N] [--heads H] [--method M] [--plot FILE.png] [--csv FILE]
Exits 1 if the scaled model does not reach --min-accuracy (default 0.95).
"""

import argparse
import csv
import sys
import time

import numpy as np

from sdpa_ref import nn


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Copy task: a tiny Transformer with and without 1/sqrt(d_k).")
    ap.add_argument("--steps", type=int, default=400, help="training steps per run (default: 400)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: 0)")
    ap.add_argument("--heads", type=int, default=1, help="attention heads; d_k = 64 / heads (default: 1)")
    ap.add_argument("--length", type=int, default=16, help="tokens to copy (default: 16)")
    ap.add_argument("--vocab", type=int, default=16, help="distinct content tokens (default: 16)")
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (default: 32)")
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    ap.add_argument("--eval-every", type=int, default=25, help="evaluate every N steps (default: 25)")
    ap.add_argument("--min-accuracy", type=float, default=0.95,
                    help="the scaled run must reach this copy accuracy, else exit 1 (default: 0.95)")
    ap.add_argument("--plot", metavar="FILE.png", help="plot both loss curves (needs matplotlib)")
    ap.add_argument("--csv", metavar="FILE", help="write the evaluation history as CSV")
    ap.add_argument("--method", choices=("fast", "plain", "tiled"), default="fast",
                    help="the attention engine: fast (default), plain (the teaching core, sdpa_ref.attention, "
                         "whose every line is derived in SEMANTICS.md) or tiled")
    return ap.parse_args(argv)


D_MODEL, N_LAYERS, D_MLP = 64, 2, 128


# ------------------------------------------------------------------- data


def make_batch(rng, batch, length, vocab):
    """Inputs, targets and loss weights: [x_1..x_N, SEP, x_1..x_N], predicted one ahead."""
    x = rng.integers(0, vocab, (batch, length))
    sep = np.full((batch, 1), vocab)                   # the separator is token `vocab`
    seq = np.concatenate([x, sep, x], axis=1)          # (B, 2N+1)
    inputs, targets = seq[:, :-1], seq[:, 1:]          # (B, 2N)
    weights = np.zeros(inputs.shape)
    weights[:, length:] = 1.0                          # positions SEP, x_1..x_{N-1} predict x_1..x_N
    return inputs, targets, weights


# ------------------------------------------------------------------ model


def init_params(rng, vocab_in, vocab_out, T):
    s = 1.0 / np.sqrt(D_MODEL)
    p = {"tok": rng.standard_normal((vocab_in, D_MODEL)) * 0.5,
         "pos": rng.standard_normal((T, D_MODEL)) * 0.5,
         "lnf_g": np.ones(D_MODEL), "lnf_b": np.zeros(D_MODEL),
         "out": rng.standard_normal((D_MODEL, vocab_out)) * s}
    for i in range(N_LAYERS):
        for name in ("wq", "wk", "wv", "wo"):
            p[f"{i}.{name}"] = rng.standard_normal((D_MODEL, D_MODEL)) * s
        p[f"{i}.ln1_g"], p[f"{i}.ln1_b"] = np.ones(D_MODEL), np.zeros(D_MODEL)
        p[f"{i}.ln2_g"], p[f"{i}.ln2_b"] = np.ones(D_MODEL), np.zeros(D_MODEL)
        p[f"{i}.w1"] = rng.standard_normal((D_MODEL, D_MLP)) * s
        p[f"{i}.b1"] = np.zeros(D_MLP)
        p[f"{i}.w2"] = rng.standard_normal((D_MLP, D_MODEL)) / np.sqrt(D_MLP)
        p[f"{i}.b2"] = np.zeros(D_MODEL)
    return p


def forward(p, inputs, heads, scale, method="fast"):
    caches = {}
    B, T = inputs.shape
    x, caches["tok"] = nn.embedding(inputs, p["tok"])
    x = x + p["pos"][:T]
    for i in range(N_LAYERS):
        h, caches[f"{i}.ln1"] = nn.layer_norm(x, p[f"{i}.ln1_g"], p[f"{i}.ln1_b"])
        a, caches[f"{i}.attn"] = nn.multi_head_attention(
            h, p[f"{i}.wq"], p[f"{i}.wk"], p[f"{i}.wv"], p[f"{i}.wo"], heads, is_causal=True, scale=scale,
            method=method)
        x = x + a
        h, caches[f"{i}.ln2"] = nn.layer_norm(x, p[f"{i}.ln2_g"], p[f"{i}.ln2_b"])
        u, caches[f"{i}.fc1"] = nn.linear(h, p[f"{i}.w1"], p[f"{i}.b1"])
        u, caches[f"{i}.relu"] = nn.relu(u)
        m, caches[f"{i}.fc2"] = nn.linear(u, p[f"{i}.w2"], p[f"{i}.b2"])
        x = x + m
    h, caches["lnf"] = nn.layer_norm(x, p["lnf_g"], p["lnf_b"])
    logits, caches["out"] = nn.linear(h, p["out"])
    return logits, caches


def backward(p, caches, dlogits, T):
    g = {}
    dh, g["out"], _ = nn.linear_backward(caches["out"], dlogits)
    dx, g["lnf_g"], g["lnf_b"] = nn.layer_norm_backward(caches["lnf"], dh)
    for i in reversed(range(N_LAYERS)):
        du, g[f"{i}.w2"], g[f"{i}.b2"] = nn.linear_backward(caches[f"{i}.fc2"], dx)
        du = nn.relu_backward(caches[f"{i}.relu"], du)
        dh, g[f"{i}.w1"], g[f"{i}.b1"] = nn.linear_backward(caches[f"{i}.fc1"], du)
        dh, g[f"{i}.ln2_g"], g[f"{i}.ln2_b"] = nn.layer_norm_backward(caches[f"{i}.ln2"], dh)
        dx = dx + dh
        dh, g[f"{i}.wq"], g[f"{i}.wk"], g[f"{i}.wv"], g[f"{i}.wo"] = nn.multi_head_attention_backward(
            caches[f"{i}.attn"], dx)
        dh, g[f"{i}.ln1_g"], g[f"{i}.ln1_b"] = nn.layer_norm_backward(caches[f"{i}.ln1"], dh)
        dx = dx + dh
    g["pos"] = np.zeros_like(p["pos"])
    g["pos"][:T] = dx.sum(axis=0)
    g["tok"] = nn.embedding_backward(caches["tok"], dx)
    return g


def evaluate(p, data, heads, scale, method="fast"):
    inputs, targets, weights = data
    logits, _ = forward(p, inputs, heads, scale, method)
    loss, _ = nn.softmax_cross_entropy(logits, targets, weights)
    correct = (logits.argmax(-1) == targets) & (weights > 0)
    return loss, float(correct.sum() / weights.sum())


def train(args, scaled):
    d_k = D_MODEL // args.heads
    scale = None if scaled else 1.0                    # None: the reference's 1/sqrt(d_k)
    T = 2 * args.length
    p = init_params(np.random.default_rng(args.seed), args.vocab + 1, args.vocab + 1, T)
    state = nn.adam_init(p)
    data_rng = np.random.default_rng(args.seed + 1)     # same batches for both runs
    held_out = make_batch(np.random.default_rng(10_000 + args.seed), 512, args.length, args.vocab)
    history = []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            loss, acc = evaluate(p, held_out, args.heads, scale, args.method)
            history.append({"run": "scaled" if scaled else "unscaled", "d_k": d_k, "step": step,
                            "loss": loss, "accuracy": acc})
        if step == args.steps:
            break
        inputs, targets, weights = make_batch(data_rng, args.batch, args.length, args.vocab)
        logits, caches = forward(p, inputs, args.heads, scale, args.method)
        _, ce = nn.softmax_cross_entropy(logits, targets, weights)
        grads = backward(p, caches, nn.softmax_cross_entropy_backward(ce), T)
        p, state = nn.adam_update(p, grads, state, lr=args.lr, max_grad_norm=1.0)
    return history


def first_step(history, threshold):
    for h in history:
        if h["accuracy"] >= threshold:
            return h["step"]
    return None


def main(argv=None):
    args = parse_args(argv)
    if 64 % args.heads:
        print("copy_task: --heads should divide 64", file=sys.stderr)
        return 2
    d_k = D_MODEL // args.heads
    print(f"copy task: {args.length} tokens from {args.vocab}, {N_LAYERS} layers, d_model {D_MODEL}, "
          f"{args.heads} head(s), d_k = {d_k}; {args.steps} Adam steps of {args.batch} sequences, lr {args.lr}")
    runs = {}
    for scaled in (True, False):
        t0 = time.perf_counter()
        runs[scaled] = train(args, scaled)
        print(f"  {'scaled 1/sqrt(d_k)' if scaled else 'unscaled (scale 1)'}: {time.perf_counter() - t0:.1f} s")
    print(f"\n{'step':>6} | {'scaled loss':>11} {'acc':>6} | {'unscaled loss':>13} {'acc':>6}")
    for a, b in zip(runs[True], runs[False]):
        if a["step"] % (args.eval_every * 4) == 0 or a["step"] == args.steps:
            print(f"{a['step']:>6} | {a['loss']:>11.4f} {a['accuracy']:>6.1%} | {b['loss']:>13.4f} {b['accuracy']:>6.1%}")

    fa, fb = runs[True][-1], runs[False][-1]
    print("\nmeasured:")
    for thr in (0.5, 0.95):
        sa, sb = first_step(runs[True], thr), first_step(runs[False], thr)
        fmt = lambda s: "never" if s is None else f"step {s}"  # noqa: E731
        print(f"  first evaluation at >= {thr:.0%} copy accuracy: scaled {fmt(sa)}, unscaled {fmt(sb)}")
    print(f"  final copy accuracy: scaled {fa['accuracy']:.1%}, unscaled {fb['accuracy']:.1%}; "
          f"final loss: scaled {fa['loss']:.4f}, unscaled {fb['loss']:.4f}")
    sa, sb = first_step(runs[True], 0.95), first_step(runs[False], 0.95)
    if sa is not None and sb is not None:
        verdict = ("the unscaled run got there later, by %d steps" % (sb - sa)) if sb > sa else \
                  ("the unscaled run was not slower here (%d vs %d steps)" % (sb, sa))
    elif sa is not None:
        verdict = f"the unscaled run never reached 95% in {args.steps} steps"
    else:
        verdict = "neither run reached 95%"
    print(f"  so: {verdict}")

    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(runs[True][0].keys()))
            w.writeheader()
            w.writerows(runs[True] + runs[False])
        print(f"wrote {args.csv}")
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("copy_task: --plot needs matplotlib: python -m pip install matplotlib", file=sys.stderr)
            return 2
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
        for scaled, style in ((True, "-"), (False, "--")):
            h = runs[scaled]
            label = "scaled 1/sqrt(d_k)" if scaled else "unscaled (scale 1)"
            ax1.plot([r["step"] for r in h], [r["loss"] for r in h], style, label=label)
            ax2.plot([r["step"] for r in h], [r["accuracy"] for r in h], style, label=label)
        ax1.set_yscale("log")
        ax1.set_ylabel("held-out copy loss (nats)")
        ax2.set_ylabel("held-out copy accuracy")
        ax2.set_ylim(0, 1.02)
        for ax in (ax1, ax2):
            ax.set_xlabel("Adam step")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"copy task, {N_LAYERS}-layer Transformer, d_model {D_MODEL}, {args.heads} head(s): d_k = {d_k}")
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")

    if fa["accuracy"] < args.min_accuracy:
        print(f"FAIL: the scaled model reached {fa['accuracy']:.1%} < {args.min_accuracy:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
