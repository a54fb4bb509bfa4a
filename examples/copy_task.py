"""The copy task over seeds: how much later does the unscaled model learn?
=======================================================================

A tiny Transformer learns a copy task with and without the ``1/sqrt(d_k)``
scaling, once per seed. The answer to "how much later?" is a distribution
over seeds, not one number: rounding alone (another machine, another BLAS,
``SDPA_REF_NATIVE=0``) moves a single run's step to 95% by a few evaluations,
so this example reports each measure per seed with its median and range, and
checks its claims over the seeds.

The task needs attention: a causal model reads N random tokens, a separator,
and must then reproduce the N tokens, so every output position looks back
across the separator to the token N+1 places earlier. The loss and the
accuracy count only the copied positions, on ``--held-out`` (default 256)
held-out sequences per seed.

The model is a 2-layer pre-LayerNorm Transformer, d_model 64, in pure NumPy:
token and learned position embeddings, multi-head causal self-attention
through sdpa_ref's forward and hand-derived backward, a ReLU MLP, a final
LayerNorm and an output projection, trained with Adam. Every backward is
hand-written (``nn.py``, beside this script, finite-difference tested). For
each seed both runs start from the same initial weights and see the same
batches; the only difference is the attention scale: ``1/sqrt(d_k)`` or 1.

All the seeds train at once, as one batched model: every weight has a
leading seed axis, the activations are (seeds, batch, positions, width), and
the attention takes (seeds, batch, heads) as its leading batch dimensions.
Each seed's weights see only its own batches (drawn from its own generator)
and its gradient is clipped by its own norm, so a seed's run is the one it
would have alone, to rounding, whichever seeds train beside it.

With the default one head, d_k = 64 as in the classic worked example;
``--heads 4`` gives d_k = 16. ``--method plain`` trains through the teaching
core (``sdpa_ref.attention``), whose forward and backward read next to the
derivation in SEMANTICS.md: the same losses as the default fast engine.

For each scaling the example reports the step at which the held-out copy
accuracy first reaches 95% and the step at which the held-out loss first
falls to ``--loss-threshold`` (default 0.1 nats), per seed, with the median
and the range over the seeds, and the per-seed ratio of the unscaled step to
the scaled one. The model is evaluated every ``--eval-every`` steps (default
25), so every step is resolved to that grid. A run that never gets there
within ``--steps`` is censored: it is written ``> steps``, and the median
counts it as +inf.

The claims (checked when ``--min-accuracy`` is above 0; exit status 1 and a
line starting with ``FAIL`` if one fails):

* every seed's scaled model reaches ``--min-accuracy`` (default 0.95) copy
  accuracy by the last step;
* the unscaled model reaches 95% strictly later than the scaled one, or
  never, in at least ``ceil(0.8 * N)`` of the N seeds (8 of the default 10).

Run::

    python examples/copy_task.py [--seeds N] [--seed S] [--steps N] [--heads H]
        [--method M] [--loss-threshold L] [--jobs J] [--plot FILE.png] [--csv FILE]
        [--results FILE.json]

The sizes (8 tokens, 16 sequences a step, 256 held-out sequences) are the
smallest at which the question keeps its answer, chosen so that the default
ten seeds run within about a minute on 2 cores (``--jobs 2`` trains the
scaled and the unscaled models in two processes; the results do not depend
on it). ``--plot`` draws, per scaling, the median curve over the seeds, the
band from the lowest to the highest seed and each seed's curve;
``--results`` writes the summary the docs quote.
"""

import argparse
import csv
import math
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

try:
    HERE = Path(__file__).resolve().parent
except NameError:                       # the docs gallery runs each script in its own folder, without __file__
    HERE = Path.cwd()
sys.path.insert(0, str(HERE))           # nn.py, the hand-differentiated layers, sits beside this script
import nn  # noqa: E402

from sdpa_ref import log_softmax  # noqa: E402

TARGET = 0.95                                          # the copy accuracy whose step is compared
RUNS = ("scaled", "unscaled")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Copy task over seeds: a tiny Transformer with and without 1/sqrt(d_k). Claims (checked "
                    "only when --min-accuracy > 0; exit 1 and a FAIL line if one fails): every seed's scaled "
                    "model reaches --min-accuracy by the last step, and the unscaled model reaches 95% strictly "
                    "later (or never) in at least ceil(0.8 * seeds) seeds.")
    ap.add_argument("--seeds", type=int, default=10, help="number of seeds: --seed, ..., --seed + N - 1 (default: 10)")
    ap.add_argument("--seed", type=int, default=0, help="first seed of the weights and the data (default: 0)")
    ap.add_argument("--steps", type=int, default=250, help="training steps per run (default: 250)")
    ap.add_argument("--heads", type=int, default=1, help="attention heads; d_k = 64 / heads (default: 1)")
    ap.add_argument("--length", type=int, default=8, help="tokens to copy (default: 8)")
    ap.add_argument("--vocab", type=int, default=16, help="distinct content tokens (default: 16)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step, per seed (default: 16)")
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    ap.add_argument("--eval-every", type=int, default=25,
                    help="evaluate every N steps; every reported step is resolved to this grid (default: 25)")
    ap.add_argument("--loss-threshold", type=float, default=0.1,
                    help="report the first step whose held-out loss is at most this, in nats (default: 0.1)")
    ap.add_argument("--min-accuracy", type=float, default=0.95,
                    help="every seed's scaled run must reach this copy accuracy by the last step; 0 checks no "
                         "claim at all, for smoke runs (default: 0.95)")
    ap.add_argument("--jobs", type=int, default=2, choices=(1, 2),
                    help="2 trains the scaled and the unscaled models in two processes at once (each one batched "
                         "model over the seeds); the results do not depend on it (default: 2)")
    ap.add_argument("--held-out", type=int, default=256,
                    help="held-out sequences per seed on which the loss and the accuracy are measured (default: 256)")
    ap.add_argument("--plot", metavar="FILE.png", help="plot the loss and accuracy bands (needs matplotlib)")
    ap.add_argument("--csv", metavar="FILE", help="write every evaluation of every run as CSV")
    ap.add_argument("--results", metavar="FILE.json",
                    help="write the summary (the settings, each measure's per-seed steps, median and range, and the "
                         "same formatted as the report prints them) as JSON: the docs build formats its text from it")
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


def stack_params(seeds, vocab_in, vocab_out, T):
    """Each seed's initial weights (:func:`init_params` with its own generator), stacked on a leading seed axis: the
    seeds train as one batched model (``nn.py``'s model axis), each seed's weights seeing only its own data."""
    ps = [init_params(np.random.default_rng(seed), vocab_in, vocab_out, T) for seed in seeds]
    return {k: np.stack([p[k] for p in ps]) for k in ps[0]}


def stack_batches(rngs, batch, length, vocab):
    """One batch per seed, each from that seed's own generator (so a seed's run does not depend on which seeds
    train beside it), stacked: inputs, targets and weights of shape (seeds, batch, 2 * length)."""
    return tuple(np.stack(parts) for parts in zip(*(make_batch(r, batch, length, vocab) for r in rngs)))


def forward(p, inputs, heads, scale, method="fast"):
    """Logits (seeds, B, T, V) of the seeds' models on their inputs (seeds, B, T), and the caches."""
    caches = {}
    T = inputs.shape[-1]
    x, caches["tok"] = nn.embedding(inputs, p["tok"])
    x = x + p["pos"][:, None, :T]
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
    g["pos"][:, :T] = dx.sum(axis=1)
    g["tok"] = nn.embedding_backward(caches["tok"], dx)
    return g


def seed_losses(logits, targets, weights):
    """Per seed: the weighted mean cross-entropy over its own positions (seeds,), and its gradient in the logits.

    The total loss is the sum over the seeds, so each seed's gradient is that of its own mean loss."""
    logp = log_softmax(logits, axis=-1)
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    total = weights.sum(axis=(1, 2))
    losses = np.sum(weights * nll, axis=(1, 2)) / total
    d = np.exp(logp)
    np.put_along_axis(d, targets[..., None], np.take_along_axis(d, targets[..., None], -1) - 1.0, axis=-1)
    return losses, d * (weights / total[:, None, None])[..., None]


def evaluate(p, data, heads, scale, method="fast"):
    """Per seed: the held-out loss and copy accuracy, two arrays of shape (seeds,)."""
    inputs, targets, weights = data
    logits, _ = forward(p, inputs, heads, scale, method)
    loss, _ = seed_losses(logits, targets, weights)
    correct = (logits.argmax(-1) == targets) & (weights > 0)
    return loss, correct.sum(axis=(1, 2)) / weights.sum(axis=(1, 2))


def train(args, seeds, scaled):
    """The seeds' runs of one scaling, trained as one batched model: ``{seed: history}``."""
    d_k = D_MODEL // args.heads
    scale = None if scaled else 1.0                    # None: the reference's 1/sqrt(d_k)
    T = 2 * args.length
    p = stack_params(seeds, args.vocab + 1, args.vocab + 1, T)
    state = nn.adam_init(p)
    data_rngs = [np.random.default_rng(seed + 1) for seed in seeds]       # same batches for both runs
    held_out = stack_batches([np.random.default_rng(10_000 + seed) for seed in seeds], args.held_out,
                             args.length, args.vocab)
    history = {seed: [] for seed in seeds}
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            losses, accs = evaluate(p, held_out, args.heads, scale, args.method)
            for seed, loss, acc in zip(seeds, losses, accs):
                history[seed].append({"seed": seed, "run": RUNS[0] if scaled else RUNS[1], "d_k": d_k,
                                      "step": step, "loss": float(loss), "accuracy": float(acc)})
        if step == args.steps:
            break
        inputs, targets, weights = stack_batches(data_rngs, args.batch, args.length, args.vocab)
        logits, caches = forward(p, inputs, args.heads, scale, args.method)
        _, dlogits = seed_losses(logits, targets, weights)
        grads = backward(p, caches, dlogits, T)
        p, state = nn.adam_update(p, grads, state, lr=args.lr, max_grad_norm=1.0, per_model=True)
    return history


def train_seeds(args, seeds):
    """Both runs of every seed: ``{seed: {"scaled": history, "unscaled": history}}``; the times go to stderr."""
    out = {seed: {} for seed in seeds}
    if args.jobs == 2 and "fork" in multiprocessing.get_all_start_methods():
        # the unscaled model in a forked child (fork: nothing is pickled but the result, so this also runs where
        # the script is not an importable module, as in the docs gallery), the scaled one here
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=lambda: send.send(_timed_train(args, seeds, RUNS[1])))
        child.start()
        done = {RUNS[0]: _timed_train(args, seeds, RUNS[0])}
        done[RUNS[1]] = recv.recv()
        child.join()
        if child.exitcode:
            raise RuntimeError(f"copy_task: the unscaled run's process failed (exit status {child.exitcode})")
    else:
        done = {run: _timed_train(args, seeds, run) for run in RUNS}
    for run in RUNS:
        for seed, history in done[run].items():
            out[seed][run] = history
    return out


def _timed_train(args, seeds, run):
    t0 = time.perf_counter()
    history = train(args, seeds, run == "scaled")
    print(f"seeds {seeds[0]}-{seeds[-1]} {run}, one batched model: {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
    return history


# ------------------------------------------------- the measures and the claims


def first_step(history, key, threshold, below=False):
    """The first evaluated step with ``history[key] >= threshold`` (``<=`` if ``below``); None if never."""
    for h in history:
        if (h[key] <= threshold) if below else (h[key] >= threshold):
            return h["step"]
    return None


def ratios(scaled, unscaled, steps):
    """Per seed: (unscaled / scaled step, censored?). A never unscaled is a lower bound ``steps / scaled``;
    a scaled run that never got there (or got there at step 0) gives None."""
    out = []
    for s, u in zip(scaled, unscaled):
        out.append(None if not s else (steps / s, True) if u is None else (u / s, False))
    return out


def median_of(values, of_ratios=False):
    """The median of first steps (None: never) or, ``of_ratios``, of ratios (``(x, censored)``; None: undefined,
    left out), a never or a censored ratio counted as +inf; None if nothing is left."""
    if of_ratios:
        values = [v[0] if not v[1] else None for v in values if v is not None]
    xs = [math.inf if v is None else v for v in values]
    return float(np.median(xs)) if xs else None


def check_claims(runs, min_accuracy, target=TARGET):
    """The example's claims over ``runs`` (``{seed: {"scaled": history, "unscaled": history}}``, each history a
    list of ``{"step", "loss", "accuracy"}`` rows in step order), as ``[(passed, line), ...]``:

    (a) every seed's scaled model ends at ``min_accuracy`` or above;
    (b) the unscaled model reaches ``target`` strictly later than the scaled one, or never while the scaled one
        did, in at least ``ceil(0.8 * seeds)`` seeds.
    """
    seeds = sorted(runs)
    finals = [runs[s]["scaled"][-1]["accuracy"] for s in seeds]
    low = [s for s, f in zip(seeds, finals) if f < min_accuracy]
    a = (not low, f"every seed's scaled model reaches {min_accuracy:.0%} copy accuracy by the last step: "
                  f"{len(seeds) - len(low)} of {len(seeds)} (final: {', '.join(f'{f:.1%}' for f in finals)})")
    slower, pairs = 0, []
    for s in seeds:
        sa, sb = (first_step(runs[s][r], "accuracy", target) for r in RUNS)
        slower += sa is not None and (sb is None or sb > sa)
        pairs.append(f"{fmt_step(sa)} vs {fmt_step(sb)}")
    need = math.ceil(0.8 * len(seeds))
    b = (slower >= need, f"the unscaled model reaches {target:.0%} later than the scaled one (or never) in "
                         f"{slower} of {len(seeds)} seeds, at least {need} needed (scaled vs unscaled: "
                         f"{', '.join(pairs)})")
    return [a, b]


def fmt_step(s, steps=None):
    return ("never" if steps is None else f">{steps}") if s is None else str(s)


def fmt_ratio(r):
    return "n/a" if r is None else f"{'>' if r[1] else ''}{r[0]:.2f}"


def step_range(got, steps):
    """``min to max`` of first steps; a never is ``>steps``, above every step seen."""
    known = [g for g in got if g is not None]
    lo, hi = (str(min(known)) if known else f">{steps}"), (f">{steps}" if None in got else str(max(known)))
    return lo if lo == hi else f"{lo} to {hi}"


def ratio_range(rat):
    """``min to max`` of ratios; a censored maximum is ``>bound``, or ``>=max`` where a finite ratio is above the
    bound (the censored one may be below it or above)."""
    known = [r for r in rat if r is not None]
    if not known:
        return "n/a"
    finite, bounds = [v for v, c in known if not c], [v for v, c in known if c]
    hi = (f"{max(finite):.2f}" if not bounds else f">{max(bounds):.2f}" if not finite or max(bounds) >= max(finite)
          else f">={max(finite):.2f}")
    return f"{fmt_ratio(min(known))} to {hi}"


def report(args, runs):
    """Print the median curves over the seeds and the table of first steps; return the summary
    (:func:`summary`'s dict)."""
    seeds = sorted(runs)
    n, steps = len(seeds), args.steps
    print(f"\nmedian over the {n} seed(s) (held-out loss in nats, copy accuracy):")
    print(f"{'step':>6} | {'scaled loss':>11} {'acc':>6} | {'unscaled loss':>13} {'acc':>6}")
    for i, row in enumerate(runs[seeds[0]]["scaled"]):
        if row["step"] % (args.eval_every * 4) and row["step"] != steps:
            continue
        med = {(r, k): float(np.median([runs[s][r][i][k] for s in seeds])) for r in RUNS for k in ("loss", "accuracy")}
        print(f"{row['step']:>6} | {med['scaled', 'loss']:>11.4f} {med['scaled', 'accuracy']:>6.1%} | "
              f"{med['unscaled', 'loss']:>13.4f} {med['unscaled', 'accuracy']:>6.1%}")

    print(f"\nfirst evaluated step (every {args.eval_every} steps, so resolved to {args.eval_every}); "
          f"'>{steps}': never within {steps} steps, counted as +inf in the median:")
    rows, got = [], {}
    for label, key, thr, below in ((f"{TARGET:.0%} copy accuracy", "accuracy", TARGET, False),
                                   (f"loss <= {args.loss_threshold:g} nats", "loss", args.loss_threshold, True)):
        for r in RUNS:
            g = got[r, key] = [first_step(runs[s][r], key, thr, below) for s in seeds]
            med = median_of(g)
            rows.append((f"{r}, {label}", [fmt_step(x, steps) for x in g],
                         fmt_step(None if math.isinf(med) else f"{med:g}", steps), step_range(g, steps),
                         f"{sum(x is None for x in g)}/{n}"))
    rat = ratios(got["scaled", "accuracy"], got["unscaled", "accuracy"], steps)
    med = median_of(rat, of_ratios=True)
    rows.append((f"ratio unscaled/scaled, {TARGET:.0%}", [fmt_ratio(x) for x in rat],
                 "n/a" if med is None else f"{med:.2f}", ratio_range(rat), ""))
    w = max(len(x) for row in rows for x in row[1])
    print(f"  {'seed':<28} {' '.join(f'{s:>{w}}' for s in seeds)}  {'median':>7} {'range (min to max)':>18} "
          f"{'never':>6}")
    for label, per_seed, med, rng, never in rows:
        print(f"  {label:<28} {' '.join(f'{x:>{w}}' for x in per_seed)}  {med:>7} {rng:>18} {never:>6}".rstrip())
    print(f"  (the ratio counts a never unscaled as >{steps}/scaled; n/a: the scaled run never got there)")
    return summary(args, seeds, got, rat)


def summary(args, seeds, got, rat):
    """The measures as the report prints them, for the docs to quote: ``{"settings": ..., "measures": ...}``, every
    measure with its raw per-seed values and ``text``, the strings the table shows (median, range, nevers)."""
    steps = args.steps
    measures = {}
    for (run, key), g in got.items():
        med = median_of(g)
        name = f"{run}_{'acc' if key == 'accuracy' else 'loss'}"
        measures[name] = {"per_seed": g, "median": None if math.isinf(med) else med,
                          "text": {"median": fmt_step(None if math.isinf(med) else f"{med:g}", steps),
                                   "range": step_range(g, steps), "never": str(sum(x is None for x in g))}}
    med = median_of(rat, of_ratios=True)
    finite = [r[0] for r in rat if r is not None and not r[1]]
    measures["ratio_acc"] = {
        "per_seed": [None if r is None else {"ratio": r[0], "censored": r[1]} for r in rat], "median": med,
        "text": {"median": "n/a" if med is None else f"{med:.2f}", "range": ratio_range(rat),
                 "finite_range": f"{min(finite):.2f} to {max(finite):.2f}" if finite else "n/a",
                 "finite": str(len(finite))}}
    settings = {"seeds": len(seeds), "first_seed": seeds[0], "last_seed": seeds[-1], "steps": steps,
                "eval_every": args.eval_every, "heads": args.heads, "d_k": D_MODEL // args.heads,
                "d_model": D_MODEL, "layers": N_LAYERS, "length": args.length, "vocab": args.vocab,
                "batch": args.batch, "held_out": args.held_out, "lr": args.lr,
                "loss_threshold": args.loss_threshold, "target": TARGET}
    return {"settings": settings, "measures": measures}


def plot(args, runs, path):
    try:
        import matplotlib
        if "matplotlib.pyplot" not in sys.modules:       # keep a backend already chosen (sphinx-gallery's)
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("copy_task: --plot needs matplotlib: python -m pip install matplotlib", file=sys.stderr)
        return 2
    seeds = sorted(runs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for r, color in zip(RUNS, ("C0", "C3")):
        label = "scaled 1/sqrt(d_k)" if r == "scaled" else "unscaled (scale 1)"
        x = [h["step"] for h in runs[seeds[0]][r]]
        for ax, key in zip(axes, ("loss", "accuracy")):
            y = np.array([[h[key] for h in runs[s][r]] for s in seeds])
            for row in y:
                ax.plot(x, row, color=color, lw=0.6, alpha=0.35)
            ax.fill_between(x, y.min(0), y.max(0), color=color, alpha=0.15, lw=0)
            ax.plot(x, np.median(y, 0), color=color, lw=2, label=f"{label}: median, min-max band")
    axes[0].axhline(args.loss_threshold, color="k", ls="--", lw=1, label=f"{args.loss_threshold:g} nats")
    axes[1].axhline(TARGET, color="k", ls="--", lw=1, label=f"{TARGET:.0%}")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("held-out copy loss (nats)")
    axes[1].set_ylabel("held-out copy accuracy")
    axes[1].set_ylim(0, 1.02)
    for ax in axes:
        ax.set_xlabel("Adam step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"copy task, seeds {seeds[0]}-{seeds[-1]} (thin lines: each seed), {N_LAYERS}-layer Transformer, "
                 f"d_model {D_MODEL}, {args.heads} head(s): d_k = {D_MODEL // args.heads}")
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")                             # the figure stays open: sphinx-gallery shows it
    return 0


def main(argv=None):
    args = parse_args(argv)
    if 64 % args.heads or min(args.seeds, args.steps, args.eval_every, args.held_out) < 1:
        print("copy_task: --heads should divide 64; --seeds, --steps, --eval-every and --held-out should be >= 1",
              file=sys.stderr)
        return 2
    seeds = list(range(args.seed, args.seed + args.seeds))
    print(f"copy task: {args.length} tokens from {args.vocab}, {N_LAYERS} layers, d_model {D_MODEL}, "
          f"{args.heads} head(s), d_k = {D_MODEL // args.heads}; {args.steps} Adam steps of {args.batch} sequences, "
          f"lr {args.lr}; seeds {seeds[0]}-{seeds[-1]}, each run scaled and unscaled from the same weights and "
          f"batches")
    t0 = time.perf_counter()
    runs = train_seeds(args, seeds)
    print(f"{len(seeds)} seed(s) trained in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    results = report(args, runs)

    if args.csv:
        rows = [h for s in seeds for r in RUNS for h in runs[s][r]]
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    if args.plot and plot(args, runs, args.plot):
        return 2

    claims = check_claims(runs, args.min_accuracy) if args.min_accuracy > 0 else []
    if args.results:
        import json
        results["claims"] = [{"passed": ok, "line": line} for ok, line in claims]
        results["claims_text"] = ("not checked" if not claims else "both hold" if all(ok for ok, _ in claims)
                                  else "a claim failed")
        with open(args.results, "w") as fh:
            json.dump(results, fh, indent=1)
        print(f"wrote {args.results}")

    if args.min_accuracy <= 0:
        print("\nclaims: not checked (--min-accuracy 0)")
        return 0
    print("\nclaims:")
    for ok, line in claims:
        print(f"{'PASS' if ok else 'FAIL'}  {line}")
    return 0 if all(ok for ok, _ in claims) else 1


if __name__ == "__main__":      # success falls off the end: the docs gallery runs this file and keeps its stdout
    status = main()
    if status:
        sys.exit(status if status == 2 else "copy_task.py: a claim failed (the FAIL lines above)")
