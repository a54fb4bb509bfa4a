"""check_vjp and check_jvp: the analytic derivative against the numeric one, whole or projected."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from .._validate import check_choice, check_tolerance, describe
from .numeric import METHODS, Numeric, batched_call, batched_shape, call, copy_args, default_eps, numeric_blocks, \
    valid_columns
from .report import GradcheckReport, compare

__all__ = ["DEFAULT_ATOL", "DEFAULT_RTOL", "assert_jvp", "assert_vjp", "check_jvp", "check_vjp"]

#: Default relative tolerance (symmetric relative error).
DEFAULT_RTOL = 1e-6
#: Default absolute floor.
DEFAULT_ATOL = 1e-9
_MODES = ("full", "projection")


def check_vjp(
    fun: Callable,
    vjp: Callable,
    args: Sequence,
    *,
    mode: str = "full",
    eps: Optional[float] = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    seed: int = 0,
    n_projections: int = 3,
    method: str = "central",
    vectorized: bool = False,
) -> GradcheckReport:
    r"""Check a vector-Jacobian product against finite differences.

    Parameters
    ----------
    fun : callable
        ``fun(*args) -> array``.
    vjp : callable
        ``vjp(g, *args) -> sequence of arrays``, one gradient per arg, each of
        its arg's shape (a bare array is accepted when there is one arg).
    args : sequence of array_like
        Where to check. Copied to float64; never modified.
    mode : {"full", "projection"}
        ``"full"`` builds the whole analytic Jacobian (one VJP per output
        entry, with one-hot cotangents) and the whole numeric one (two
        evaluations per input entry) and compares them entry by entry; then
        it pushes ``n_projections`` dense random cotangents (every entry
        non-zero, every arg at once), whose VJPs must be the same combination
        of the one-hot rows (a VJP right on one-hot cotangents only, as
        ``J^T |g|`` is, fails).
        ``"projection"`` compares :math:`\langle J^T g, u\rangle` with
        :math:`\langle g, J u\rangle` for random ``g`` and ``u``: one VJP and
        two evaluations per projection. When one fails, the full check is run
        to say where, and the verdict stays failed; when a projection is not
        finite on either side (the output holds NaN), it proves nothing, and
        the full check judges.
    eps : float, optional
        Relative finite-difference step (see the module docstring).
    rtol, atol : float
        Tolerances of the comparison rule.
    seed : int
        Seed of the random projections and probes, an int >= 0.
    n_projections : int
        Number of random projections in ``"projection"`` mode, and of dense
        probes in ``"full"`` mode.
    method : {"central", "complex"}
        How the numeric derivative is taken: central differences, or the
        complex step (exact to rounding; ``fun`` must accept complex input).
    vectorized : bool
        ``fun`` and ``vjp`` broadcast over one new leading axis, treating it
        as an independent batch (as NumPy code that follows ``np.matmul``
        broadcasting does, sdpa_ref's attention included). Then the full
        check makes one batched call for all ``+h`` perturbations of an
        argument, one for all ``-h`` (one for the complex step), and one
        batched ``vjp`` of all one-hot cotangents, instead of a Python loop
        of calls. The results are the same as the scalar check's.

    Returns
    -------
    GradcheckReport
    """
    return _run(_vjp_projection, _vjp_full, fun, vjp, args, mode, eps, rtol, atol, seed, n_projections, method,
                vectorized)


def assert_vjp(fun, vjp, args, **kwargs) -> GradcheckReport:
    """:func:`check_vjp`, raising `AssertionError` with the report's table on failure."""
    return _asserted(check_vjp(fun, vjp, args, **kwargs))


def check_jvp(
    fun: Callable,
    jvp: Callable,
    args: Sequence,
    *,
    mode: str = "full",
    eps: Optional[float] = None,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    seed: int = 0,
    n_projections: int = 3,
    method: str = "central",
    vectorized: bool = False,
) -> GradcheckReport:
    r"""Check a Jacobian-vector product (forward mode) against finite differences.

    Parameters
    ----------
    fun : callable
        ``fun(*args) -> array``.
    jvp : callable
        ``jvp(tangents, *args) -> array`` of the output's shape, where
        ``tangents`` is a tuple with one array per arg.
    args, mode, eps, rtol, atol, seed, n_projections, method, vectorized
        As in :func:`check_vjp`. ``"full"`` pushes one one-hot tangent per
        input entry; ``"projection"`` compares the whole output tangent
        :math:`J u` for random ``u`` with its central difference, entry by
        entry. The full check then pushes ``n_projections`` dense random
        tangents over every arg at once, whose JVPs must be the same
        combination of the one-hot columns. With ``vectorized=True`` (``fun``
        and ``jvp`` broadcast over one new leading axis, the tangents
        included) the full check makes one batched ``jvp`` call per argument,
        with all its one-hot tangents, and one with the dense probes.

    Returns
    -------
    GradcheckReport
    """
    return _run(_jvp_projection, _jvp_full, fun, jvp, args, mode, eps, rtol, atol, seed, n_projections, method,
                vectorized)


def assert_jvp(fun, jvp, args, **kwargs) -> GradcheckReport:
    """:func:`check_jvp`, raising `AssertionError` with the report's table on failure."""
    return _asserted(check_jvp(fun, jvp, args, **kwargs))


def _asserted(rep):
    if not rep.ok:
        raise AssertionError("\n" + str(rep))
    return rep


# ------------------------------------------------------------ internals


def _run(projection, full, fun, derivative, args, mode, eps, rtol, atol, seed, n_projections, method, vectorized):
    """The shared body of check_vjp / check_jvp: projection first, full to locate a failure or to judge what
    the projections could not (a failed projection is never overruled)."""
    check_choice(mode, "mode", _MODES)
    check_choice(method, "method", METHODS)
    rtol, atol = check_tolerance(rtol, "rtol"), check_tolerance(atol, "atol")
    check_seed(seed)
    if isinstance(n_projections, (bool, np.bool_)) or not isinstance(n_projections, (int, np.integer)) \
            or n_projections < 1:
        raise ValueError(f"`n_projections` should be an int >= 1 (0 checks nothing), but got {n_projections!r}")
    if not isinstance(vectorized, (bool, np.bool_)):       # bool("no") is True: a string turned batching on
        raise TypeError(f"`vectorized` should be a bool, but got {describe(vectorized)}")
    xs = copy_args(args)
    out = call(fun, xs)
    nd = Numeric(fun, default_eps(eps, method), method, vectorized=bool(vectorized))
    if mode == "full":
        return full(nd, derivative, xs, out, rtol, atol, seed, n_projections)
    rep, unjudged = projection(nd, derivative, xs, out, rtol, atol, seed, n_projections)
    if rep.ok and not unjudged:
        return rep
    located = full(nd, derivative, xs, out, rtol, atol, seed, n_projections)
    located.mode = "projection, then full"
    notes = list(rep.notes)
    if unjudged:
        notes.append(f"{unjudged} of {n_projections} projections were not finite on either side (a NaN in the "
                     "output or the derivative), which proves nothing: the full check judges entry by entry")
    if not rep.ok:
        located.ok = False                  # the full check locates; it never overrules the failed projection
        located.max_abs_error = max(located.max_abs_error, rep.max_abs_error)
        located.max_rel_error = max(located.max_rel_error, rep.max_rel_error)
        w = rep.worst
        notes.append(f"projection check failed (max_rel={rep.max_rel_error:.3e}; worst: projection "
                     f"{w.output_index}, analytic {w.analytic!r}, numeric {w.numeric!r}); the full check follows "
                     "to locate it, and does not overrule it")
    located.notes = notes + located.notes
    return located


def check_seed(seed):
    """``seed`` of the random projections and probes: an int >= 0, else an error naming it (NumPy's names no
    argument, and None would draw fresh entropy: a check that cannot be repeated)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"`seed` should be an int >= 0, but got {describe(seed)}")
    if seed < 0:
        raise ValueError(f"`seed` should be an int >= 0, but got {int(seed)}")
    return int(seed)


def _as_real(r, who, what, shape):
    """A derivative's result as a float64 array: None, complex and non-numeric results are a TypeError naming
    ``who`` (the imaginary part is never dropped)."""
    name = f"`{who}` {what}" if what else f"`{who}`"
    if r is None:
        raise TypeError(f"{name} should be a real array of shape {shape}, but got None")
    try:
        arr = np.asarray(r)
    except Exception as exc:                # a ragged sequence, say
        raise TypeError(f"{name} should be a real array of shape {shape}, but got {describe(r)} "
                        f"({type(exc).__name__}: {exc})") from None
    if arr.dtype.kind == "c":
        raise TypeError(f"{name} should be real, but got dtype {arr.dtype} (a complex result fails: its imaginary "
                        "part would be dropped)")
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} should be a real array of shape {shape}, but got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _as_sequence(res, n, who, vectorized=False):
    if n == 1 and isinstance(res, np.ndarray):
        return [res]
    if res is None or isinstance(res, (str, bytes, dict)) or not hasattr(res, "__iter__"):
        raise TypeError(f"`{who}` should return a sequence of {n} arrays (one per arg"
                        f"{', each with the batch axis first' if vectorized else ''}), but got {describe(res)}")
    res = list(res)
    if len(res) != n:
        raise ValueError(f"`{who}` should return {n} gradients (one per arg), but got {len(res)}")
    return res


def _as_grads(res, xs, who):
    res = _as_sequence(res, len(xs), who)
    grads = []
    for k, (r, x) in enumerate(zip(res, xs)):
        r = _as_real(r, who, f"gradient {k}", x.shape)
        if r.shape != x.shape:
            raise ValueError(f"`{who}` gradient {k} should have shape {x.shape}, but got shape {r.shape}")
        grads.append(r)
    return grads


def _vjp_batch(nd, vjp, cotangent, p, out, xs):
    """``[(p, x.size) for x in xs]``: the VJPs of the ``p`` cotangents ``cotangent(o)`` (one batched call of them
    all when vectorized; one at a time otherwise, so that no ``(p, out.size)`` array is held)."""
    if nd.vectorized:                               # the args are broadcast (views) to the batch
        G = np.stack([cotangent(o) for o in range(p)]) if p else np.zeros((0,) + out.shape)
        bx = [np.broadcast_to(x, (p,) + x.shape) for x in xs]
        res = _as_sequence(batched_call(vjp, "vjp", G, *bx), len(xs), "vjp", vectorized=True)
        ana = []
        for k, (r, x) in enumerate(zip(res, xs)):
            r = _as_real(r, "vjp", f"gradient {k}", (p,) + x.shape)
            if r.shape != (p,) + x.shape:
                raise ValueError(f"`vjp` gradient {k} should have shape {(p,) + x.shape} for vectorized=True, "
                                 f"but got shape {r.shape}")
            ana.append(r.reshape(p, -1))
        return ana, 1
    ana = [np.empty((p, x.size)) for x in xs]
    for o in range(p):
        grads = _as_grads(vjp(cotangent(o), *[x.copy() for x in xs]), xs, "vjp")
        for k, gr in enumerate(grads):
            ana[k][o] = gr.ravel()
    return ana, p


def _vjp_full(nd, vjp, xs, out, rtol, atol, seed, n_probes):
    m = out.size
    ana, n_calls = _vjp_batch(nd, vjp, lambda o: _one_hot(out.shape, o), m, out, xs)
    num = numeric_blocks(nd, xs, out)
    if nd.vectorized:
        n_evals = 1 + len(xs) + n_calls             # one batched call per arg (plus and minus together)
    else:
        n_evals = 1 + (1 if nd.method == "complex" else 2) * sum(x.size for x in xs) + n_calls
    valid = valid_columns(xs, m)
    meta = {"valid": valid, "shapes": [x.shape for x in xs]}
    rep = compare("check_vjp", _mode("full", nd), ana, num, rtol, atol, meta, out.shape, n_evals)
    # dense probes: VJPs of cotangents with every entry non-zero against the one-hot rows they combine
    G = np.random.default_rng(seed).standard_normal((n_probes,) + out.shape)
    got, n_calls = _vjp_batch(nd, vjp, lambda o: G[o].copy(), n_probes, out, xs)
    Gf = G.reshape(n_probes, m)
    want, scale = [], []
    with np.errstate(invalid="ignore", over="ignore"):
        for A, ok_cols in zip(ana, valid):
            A = np.where(ok_cols, A, 0.0)          # the columns of non-finite inputs are not compared
            want.append(Gf @ A)
            scale.append(np.abs(Gf) @ np.abs(A))
    meta = {"valid": [np.broadcast_to(v[:1], (n_probes, v.shape[1])) for v in valid], "shapes": meta["shapes"]}
    probes = compare("check_vjp", "probes", got, want, rtol, atol, meta, (n_probes,), n_calls, scales=scale,
                     require_finite=False)
    w = probes.worst
    where = w and f"probe {w.output_index[0]}: the gradient of arg {w.arg} at index {w.index}"
    return _with_probes(rep, probes, n_probes, "cotangents", "J^T |g|", where)


def _one_hot(shape, o):
    e = np.zeros(shape)
    e.flat[o] = 1.0
    return e


def _directions(xs, rng):
    """Random directions scaled like the steps, zero on non-finite inputs."""
    us = []
    for x in xs:
        u = rng.standard_normal(x.shape)
        with np.errstate(invalid="ignore"):
            u = np.where(np.isfinite(x), u * np.maximum(1.0, np.abs(x)), 0.0)
        us.append(u)
    return us


def _mode(mode, nd):
    m = mode if nd.method == "central" else f"{mode}, complex step"
    return m + ", vectorized" if nd.vectorized else m


def _with_probes(rep, probes, n_probes, what, example, where):
    """The full report ``rep`` with the dense probes' verdict: they fail it, and then name the worst."""
    rep.n_evals += probes.n_evals
    if probes.ok:
        rep.notes.append(f"dense probes: {n_probes} random {what} over every arg at once agree with the one-hot "
                         f"Jacobian's combination (max rel {probes.max_rel_error:.1e})")
        return rep
    rep.ok = False
    rep.max_abs_error = max(rep.max_abs_error, probes.max_abs_error)
    rep.max_rel_error = max(rep.max_rel_error, probes.max_rel_error)
    w = probes.worst
    rep.notes.extend(probes.notes)
    rep.notes.append(f"dense probes FAILED: {sum(r['failed'] for r in probes.per_arg)} entries of {n_probes} random "
                     f"{what} over every arg at once differ from the one-hot Jacobian's combination (worst: {where}: "
                     f"derivative {w.analytic!r}, combination {w.numeric!r}, rel {w.rel_error:.3e}): the derivative "
                     f"is not linear, right on one-hot vectors only (such as {example}, or a branch on which args "
                     "are non-zero)")
    return rep


def _vjp_projection(nd, vjp, xs, out, rtol, atol, seed, n_projections):
    rng = np.random.default_rng(seed)
    ana, num, terms = [], [], []
    for _ in range(int(n_projections)):
        g = rng.standard_normal(out.shape)
        us = _directions(xs, rng)
        grads = _as_grads(vjp(g, *[x.copy() for x in xs]), xs, "vjp")
        with np.errstate(invalid="ignore", over="ignore"):
            ana.append(sum(float(np.sum(gr * u)) for gr, u in zip(grads, us)))
            gju = g * nd.directional(xs, us)
            num.append(float(np.sum(gju)))
            terms.append(float(np.sum(np.abs(gju))))
    a = np.array(ana).reshape(-1, 1)
    n = np.array(num).reshape(-1, 1)
    # <g, J u> is a sum over the output: its central difference errs relative to the size of its terms,
    # sum |g * J u|, not of a sum that cancels (so the size stands for |n| there, as for the probes)
    terms = np.array(terms).reshape(-1, 1)
    scale = np.where(np.isfinite(terms), np.maximum(np.abs(n), terms), np.abs(n))
    judged = np.isfinite(a) | np.isfinite(n)        # NaN against NaN proves nothing: the full check judges those
    meta = {"valid": [judged], "shapes": [(1,)]}
    rep = compare("check_vjp", _mode("projection", nd), [a], [n], rtol, atol, meta, (len(ana),), 1 + 3 * len(ana),
                  scales=[scale], require_finite=False)
    rep.per_arg = []
    rep.notes = [f"<J^T g, u> vs <g, J u> over {len(ana)} random projections (worst 'output' = projection number)"]
    return rep, int(np.count_nonzero(~judged))


def _jvp_batch(nd, jvp, tangents, p, xs, out):
    """``(out.size, p)``: the JVPs of the ``p`` tangents ``tangents(i)`` (a list with one array per arg): one
    batched call of them all when vectorized, one at a time otherwise."""
    if nd.vectorized:
        each = [tangents(i) for i in range(p)]
        ts = [np.stack([t[a] for t in each]) if p else np.zeros((0,) + y.shape) for a, y in enumerate(xs)]
        bx = [np.broadcast_to(y, (p,) + y.shape) for y in xs]
        res = _as_real(batched_call(jvp, "jvp", tuple(ts), *bx), "jvp", "tangent", (p,) + out.shape)
        return (batched_shape(res, p, out.shape, "jvp").T if p else np.empty((out.size, 0))), 1
    J = np.empty((out.size, p))
    for i in range(p):
        J[:, i] = _as_tangent(jvp(tuple(tangents(i)), *[y.copy() for y in xs]), out).ravel()
    return J, p


def _jvp_full(nd, jvp, xs, out, rtol, atol, seed, n_probes):
    m = out.size
    ana = []
    for a, x in enumerate(xs):
        if nd.vectorized:                           # every one-hot tangent of this arg in one batched call
            n = x.size
            ts = [np.zeros((n,) + y.shape) if b == a else np.broadcast_to(np.zeros(()), (n,) + y.shape)
                  for b, y in enumerate(xs)]
            ts[a].reshape(n, n)[np.arange(n), np.arange(n)] = 1.0
            bx = [np.broadcast_to(y, (n,) + y.shape) for y in xs]
            res = _as_real(batched_call(jvp, "jvp", tuple(ts), *bx), "jvp", "tangent", (n,) + out.shape)
            ana.append(batched_shape(res, n, out.shape, "jvp").T if n else np.empty((m, 0)))
            continue
        ana.append(_jvp_batch(nd, jvp, lambda i, a=a: [_one_hot(y.shape, i) if b == a else np.zeros(y.shape)
                                                        for b, y in enumerate(xs)], x.size, xs, out)[0])
    num = numeric_blocks(nd, xs, out)
    if nd.vectorized:
        n_evals = 1 + 2 * len(xs)                   # per arg: one batched difference call and one batched jvp
    else:
        n_evals = 1 + (2 if nd.method == "complex" else 3) * sum(x.size for x in xs)
    valid = valid_columns(xs, m)
    meta = {"valid": valid, "shapes": [x.shape for x in xs]}
    rep = compare("check_jvp", _mode("full", nd), ana, num, rtol, atol, meta, out.shape, n_evals)
    # dense probes: tangents non-zero on every arg at once against the one-hot columns they combine
    rng = np.random.default_rng(seed)
    us = [_directions(xs, rng) for _ in range(n_probes)]
    got, n_calls = _jvp_batch(nd, jvp, lambda i: [u.copy() for u in us[i]], n_probes, xs, out)
    want, scale = np.zeros((m, n_probes)), np.zeros((m, n_probes))
    with np.errstate(invalid="ignore", over="ignore"):
        for a, (A, ok_cols) in enumerate(zip(ana, valid)):
            A = np.where(ok_cols, A, 0.0)           # the tangents are 0 on non-finite inputs
            T = np.stack([u[a].ravel() for u in us], axis=1)
            want += A @ T
            scale += np.abs(A) @ np.abs(T)
    meta = {"valid": [np.ones((m, n_probes), bool)], "shapes": [(n_probes,)]}
    probes = compare("check_jvp", "probes", [got], [want], rtol, atol, meta, out.shape, n_calls, scales=[scale],
                     require_finite=False)
    w = probes.worst
    where = w and f"probe {w.index[0]}: the tangent at output {w.output_index}"
    return _with_probes(rep, probes, n_probes, "tangents", "|t|", where)


def _jvp_projection(nd, jvp, xs, out, rtol, atol, seed, n_projections):
    rng = np.random.default_rng(seed)
    ana, num = [], []
    for _ in range(int(n_projections)):
        us = _directions(xs, rng)
        ana.append(_as_tangent(jvp(tuple(us), *[x.copy() for x in xs]), out).ravel())
        num.append(nd.directional(xs, us).ravel())
    a = np.stack(ana, axis=1) if ana else np.zeros((out.size, 0))
    n = np.stack(num, axis=1) if num else np.zeros((out.size, 0))
    meta = {"valid": [np.ones_like(a, dtype=bool)], "shapes": [(a.shape[1],)]}
    rep = compare("check_jvp", _mode("projection", nd), [a], [n], rtol, atol, meta, out.shape, 1 + 3 * a.shape[1],
                  require_finite=False)
    rep.per_arg = []
    rep.notes = [f"J u vs its central difference over {a.shape[1]} random tangents (worst 'index' = tangent number)"]
    # entry by entry, so the NaN patterns are compared and the finite parts judged; none finite judges nothing
    unjudged = a.shape[1] if a.size and not (np.isfinite(a) & np.isfinite(n)).any() else 0
    return rep, unjudged


def _as_tangent(t, out):
    t = _as_real(t, "jvp", "tangent", out.shape)
    if t.shape != out.shape:
        raise ValueError(f"`jvp` should return a tangent of the output's shape {out.shape}, but got shape {t.shape}")
    return t
