"""``precision="reproducible"``: faithful rounding against 50-digit mpmath, agreement with the other engines on
every option, and the same bits under every thread, BLAS and SIMD setting (and on the machine that committed
``tests/data/reproducible_hashes.json``)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings

import sdpa_ref
from sdpa_ref.exact import dd as D
from sdpa_ref.exact import ozaki
from sdpa_ref.pivot import softmax_vjp_in

from helpers import assert_close_normwise, assert_faithful as _faithful, assert_faithful, key_spans_case, \
    with_and_without_key_spans
from oracle import mp_shifted, oracle_attention
from strategies import variant_problem
from tolerances import F64_FEW_ULP, F64_SUMS

mpmath = pytest.importorskip("mpmath")

HERE = os.path.dirname(os.path.abspath(__file__))
HASHES = os.path.join(HERE, "data", "reproducible_hashes.json")


def _oracle_args(q, oracle):
    B = q.shape[0]
    args = dict(oracle)
    if "slopes" in args:
        args["slopes"] = np.broadcast_to(args["slopes"], (B, q.shape[1]))
    return args


@settings(max_examples=12)
@given(variant_problem(max_len=4))
def test_faithfully_rounded_against_mpmath(problem):
    q, k, v, opts, oracle = problem
    rng = np.random.default_rng(0)
    out, res = sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **opts)
    g = rng.standard_normal(out.shape)
    grads = sdpa_ref.sdpa_backward(res, g)
    args = _oracle_args(q, oracle)
    t_out, t_lse, (t_dq, t_dk, t_dv, _) = oracle_attention(q, k, v, grad_out=g, num="mp", **args)
    _faithful(out, t_out, "out")
    _faithful(res.lse, t_lse, "lse")
    _faithful(grads.query, t_dq, "dq")
    _faithful(grads.key, t_dk, "dk")
    _faithful(grads.value, t_dv, "dv")


@settings(max_examples=6)
@given(variant_problem(max_len=3))
def test_jvp_faithfully_rounded_against_mpmath(problem):
    q, k, v, opts, oracle = problem
    rng = np.random.default_rng(1)
    tq, tk, tv = (rng.standard_normal(x.shape) for x in (q, k, v))
    _, tan = sdpa_ref.sdpa_jvp((q, k, v), (tq, tk, tv), precision="reproducible", **opts)
    # the exact derivative by a central difference in 60 digits: error O(h^2) = 1e-40
    ctx = mpmath.MPContext()
    ctx.dps = 60
    h = ctx.mpf(10) ** -20

    def shifted(a, t, sign):
        return mp_shifted(ctx, a, t, sign, h)

    args = _oracle_args(q, oracle)
    hi = oracle_attention(shifted(q, tq, 1), shifted(k, tk, 1), shifted(v, tv, 1), num="mp", **args)[0]
    lo = oracle_attention(shifted(q, tq, -1), shifted(k, tk, -1), shifted(v, tv, -1), num="mp", **args)[0]
    truth = np.empty(hi.shape, dtype=object)
    for i, a in np.ndenumerate(hi):
        b = lo[i]
        truth[i] = float("nan") if mpmath.isnan(a) else (a - b) / (2 * h)
    _faithful(tan, truth, "jvp")


@given(variant_problem(max_len=5))
def test_agrees_with_the_teaching_core_on_every_option(problem):
    q, k, v, opts, _ = problem
    out_p, res_p = sdpa_ref.sdpa_forward(q, k, v, method="plain", **opts)
    out_r, res_r = sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **opts)
    assert_close_normwise(out_r, out_p, F64_SUMS)
    np.testing.assert_array_equal(np.isnan(out_r), np.isnan(out_p))
    np.testing.assert_array_equal(res_r.lse == -np.inf, res_p.lse == -np.inf)
    g = np.random.default_rng(0).standard_normal(out_p.shape)
    for a, b in zip(sdpa_ref.sdpa_backward(res_r, g), sdpa_ref.sdpa_backward(res_p, g, method="plain")):
        assert (a is None) == (b is None)
        if a is not None:
            assert_close_normwise(a, b, F64_SUMS)


def test_results_are_the_committed_bits_under_every_setting():
    """One hash per problem under threads 1-3, OpenBLAS 1/unset, its kernels, numpy's and our SIMD levels, other
    block cuts.

    The in-process run (default threads, OpenBLAS's own kernel for this CPU) is the next test.
    """
    with open(HASHES) as f:
        want = json.load(f)
    script = os.path.join(HERE, "repro_digest.py")
    avx512 = "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR X86_V4"
    # each run varies several settings at once (a run costs an interpreter start); with the in-process
    # run of the next test (the machine's default thread count and OpenBLAS kernel) they cover
    # SDPA_REF_NUM_THREADS 1 to 3 and the default, OPENBLAS_NUM_THREADS 1 and unset, three OpenBLAS kernels,
    # numpy's dispatch with and without the AVX-512 and AVX2 targets, three cuts of the blocks, the NumPy
    # loops in place of the compiled kernels (SDPA_REF_NATIVE=0; the others use them where a compiler is) and
    # every SIMD build of those (SDPA_REF_SIMD: AVX2, the baseline, and the CPU's best in process; a build the
    # CPU lacks gives its best one)
    settings_ = [({"SDPA_REF_NUM_THREADS": "1", "OPENBLAS_CORETYPE": "Prescott", "SDPA_REF_NATIVE": "0",
                   "NPY_DISABLE_CPU_FEATURES": avx512}, ["--block-entries", "4096"]),
                 ({"SDPA_REF_NUM_THREADS": "2", "SDPA_REF_SIMD": "avx2"}, []),
                 ({"SDPA_REF_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "1", "OPENBLAS_CORETYPE": "Sandybridge",
                   "NPY_DISABLE_CPU_FEATURES": avx512 + " AVX2 FMA3 X86_V3", "SDPA_REF_SIMD": "baseline"},
                  ["--block-entries", "997"])]
    base = {k: v for k, v in os.environ.items()
            if k not in ("SDPA_REF_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "NPY_DISABLE_CPU_FEATURES",
                         "SDPA_REF_NATIVE", "SDPA_REF_SIMD")}
    ran = 0
    for extra_env, args in settings_:
        env = dict(base, **extra_env)
        probe = subprocess.run([sys.executable, "-c", "import numpy"], env=env, capture_output=True)
        if probe.returncode != 0:                                # numpy refuses to switch off a baseline feature
            env.pop("NPY_DISABLE_CPU_FEATURES")
        cp = subprocess.run([sys.executable, script] + args, env=env, capture_output=True, text=True, timeout=300)
        assert cp.returncode == 0, cp.stderr[-2000:]
        got = dict(line.split() for line in cp.stdout.strip().splitlines())
        assert got == want, f"{extra_env} {args}: " + ", ".join(n for n in want if got.get(n) != want[n])
        ran += 1
    assert ran == 3


def test_in_process_results_match_the_committed_hashes():
    import importlib.util
    spec = importlib.util.spec_from_file_location("repro_digest", os.path.join(HERE, "repro_digest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(HASHES) as f:
        assert mod.digests() == json.load(f)


# ---------------------------------------------------------------- the building blocks


def test_dd_exp_log_tanh_against_mpmath():
    ctx = mpmath.MPContext()
    ctx.dps = 50
    rng = np.random.default_rng(3)
    x = np.concatenate([-rng.exponential(40, 300), -rng.random(50) * 1e-6, [0.0, -700.0, -1e-300]])
    z = np.concatenate([rng.standard_normal(300) * 4, rng.standard_normal(50) * 1e-4, [0.0, 30.0, -0.0625]])
    y = np.concatenate([1 + rng.random(200) * 4096, 1 + rng.random(50) * 1e-9, [1.0, 2.0]])
    for f, g, arg, rel in ((D.dd_exp, ctx.exp, x, True), (D.dd_tanh, ctx.tanh, z, True), (D.dd_log, ctx.log, y, False)):
        hi, lo = f(D.dd(arg))
        for a, h, l in zip(arg, hi, lo):
            t = g(ctx.mpf(float(a)))
            err = abs(ctx.mpf(float(h)) + ctx.mpf(float(l)) - t)
            # below about 2**-960 the low half underflows: an absolute error of a few subnormals is the floor
            assert err <= max((abs(t) if rel else 1) * 2.0 ** -99, 2.0 ** -1070), (f.__name__, a)


def test_ozaki_products_are_exact_to_the_target_and_blind_to_the_blas_order():
    ctx = mpmath.MPContext()
    ctx.dps = 60
    rng = np.random.default_rng(4)
    A = rng.standard_normal((5, 70)) * np.exp(rng.standard_normal((5, 70)) * 4)
    B = rng.standard_normal((70, 3))
    A[1] *= 1e-250                                              # a row far from the others
    hi, lo = ozaki.matmul(A, B)
    for i in range(5):
        for j in range(3):
            t = ctx.fsum(ctx.mpf(float(A[i, k])) * ctx.mpf(float(B[k, j])) for k in range(70))
            s = ctx.fsum(abs(ctx.mpf(float(A[i, k])) * ctx.mpf(float(B[k, j]))) for k in range(70))
            assert abs(ctx.mpf(float(hi[i, j])) + ctx.mpf(float(lo[i, j])) - t) <= s * 2.0 ** -104
    # the same product with the contraction permuted: a BLAS summing in another order
    perm = rng.permutation(70)
    h2, l2 = ozaki.matmul(A[:, perm], B[perm])
    np.testing.assert_array_equal(hi, h2)
    np.testing.assert_array_equal(lo, l2)


@pytest.mark.parametrize("native", [True, False])
def test_ozaki_products_left_out_on_zero_slices_move_no_bit(monkeypatch, native):
    """A product is formed only on the rows and columns of its slices that hold a nonzero entry (none where a
    slice is zero), and contracted over the rows of ``B``'s slice that hold one where they are few: the bits
    are those of forming every product in full, for float64 lines that fit in fewer slices than ``n`` (a few
    rows and columns that need more), dd operands, one and several batch entries, the early stop and the
    scale; a NaN or an infinity still reaches its row and column through a zero slice or a zero line."""
    if not native:
        monkeypatch.setenv("SDPA_REF_NATIVE", "0")
    rng = np.random.default_rng(11)
    A = rng.integers(-2 ** 20, 2 ** 20, (3, 60, 64)).astype(np.float64)    # one slice per row
    A[0, 5, :3] = rng.standard_normal(3)                           # rows that need every slice
    A[1, 17] = rng.standard_normal(64)
    A[2, :, 0] = 2.0 ** -40 * rng.standard_normal(60)              # a second slice on every row
    A[2, 9] = 0.0                                                   # a zero row
    B = rng.standard_normal((3, 64, 50)) * 2.0 ** 30
    B[..., :45] = np.rint(B[..., :45])                              # most columns in two slices
    Ad = (A, rng.standard_normal(A.shape) * np.abs(A) * 2.0 ** -60)
    Abig = rng.integers(-64, 64, (1, 40, 1024)).astype(np.float64)      # K = 1024
    Bbig = rng.standard_normal((1, 1024, 24))
    Bbig[..., 1:] = np.rint(Bbig[..., 1:] * 8)
    bad = A.copy()
    bad[1, 3, 7], bad[2, 4, 8] = np.nan, np.inf                     # through B's zero slices: NaN
    few = np.zeros_like(B)
    few[..., :10] = np.rint(B[..., :10])                            # most columns zero: NaN * 0 is NaN there
    Bk = np.rint(rng.standard_normal((1, 1024, 24)) * 2.0 ** 10)    # later slices: a few rows of K alone
    Bk[0, [3, 500, 901]] += rng.standard_normal((3, 24)) * 2.0 ** -30
    Ak = rng.standard_normal((1, 40, 1024))
    badk = Ak.copy()
    badk[0, 7, 4] = np.nan                                          # a row of Bk's later slices that is zero

    cases = [(A, B, {}), (A[:1], B[:1], {}), (A, B, dict(final=True)), (A[:1], B[:1], dict(scale=0.125)),
             (Ad, B, {}), (B.swapaxes(-1, -2), A.swapaxes(-1, -2), dict(final=True)),
             (Abig, Bbig, dict(final=True)), (Abig, Bbig, {}), (bad, np.rint(B), {}), (bad, few, {}),
             (bad, np.zeros_like(B), dict(final=True)), (np.zeros((1, 4, 64)), B[:1], dict(final=True)),
             (Ak, Bk, {}), (Ak, Bk, dict(final=True)), ((Ak, Ak * 2.0 ** -60), Bk, dict(final=True)),
             (np.concatenate([Ak, Ak]), np.concatenate([Bk, Bk]), {}), (badk, Bk, {}), (badk, Bk, dict(final=True))]
    with np.errstate(invalid="ignore"):                             # NaN and inf: on purpose
        got = [ozaki.matmul(a, b, **kw) for a, b, kw in cases]
    monkeypatch.setattr(ozaki, "_product", lambda A, B, ra, cb, kb=None: np.matmul(A, B))   # every one, in full

    def same(u, w):                                                 # the bits, signed zeros too; NaN as NaN
        nan = np.isnan(u)
        return np.array_equal(nan, np.isnan(w)) and np.array_equal(np.where(nan, 0.0, u).view(np.int64),
                                                                   np.where(nan, 0.0, w).view(np.int64))

    for (a, b, kw), (h, l) in zip(cases, got):
        with np.errstate(invalid="ignore"):
            h2, l2 = ozaki.matmul(a, b, **kw)
        assert same(h, h2) and same(l, l2), kw
    for h, _ in got[8:11]:
        assert np.isnan(h[1, 3]).all() and np.isnan(h[2, 4]).all() and not np.isnan(h[0]).any()
    for h, _ in got[-2:]:
        assert np.isnan(h[0, 7]).all() and np.isnan(h).sum() == h.shape[-1]


@pytest.mark.parametrize("native", [True, False])
def test_ozaki_products_on_the_columns_each_row_wants_move_no_bit(monkeypatch, native):
    """``spans``: a block of rows formed on the union of its rows' columns alone (a causal band, a window, rows that
    want nothing, blocks of several rows); every entry formed has the bits of the whole product, the rest is +0:
    float64 and dd operands over wide exponent ranges, a dominant column, the scale, several batch entries; and
    the rounded arithmetic of ``upcast=False`` gives each wanted entry its value too."""
    from sdpa_ref.exact.arith import LowPrecision
    if not native:
        monkeypatch.setenv("SDPA_REF_NATIVE", "0")
    monkeypatch.setattr(ozaki, "_BLOCK_ENTRIES", 1 << 12)             # blocks of a few rows, at this size
    rng = np.random.default_rng(12)
    M, K, N = 150, 64, 200
    A = rng.standard_normal((3, M, K)) * 2.0 ** rng.integers(-30, 30, (3, M, 1))
    B = rng.standard_normal((3, K, N)) * 2.0 ** rng.integers(-30, 30, (3, 1, N))
    B[:, 5, 17] = 2.0 ** 300                                           # a dominant entry
    Ad = (A, rng.standard_normal(A.shape) * np.abs(A) * 2.0 ** -60)
    i = np.arange(M)
    causal = (np.zeros(M, np.int64), np.minimum(N, i + 51))
    window = (np.maximum(0, i - 40), np.minimum(N, i + 1))
    gaps = (np.where(i % 37 == 3, N, window[0]), np.where(i % 37 == 3, 0, window[1]))    # rows wanting nothing
    j = np.arange(N)
    for a, kw in ((A, {}), (Ad, {}), (A, dict(scale=0.125)), (A[:1], {}), (Ad, dict(scale=3.0))):
        whole = ozaki.matmul(a, B if np.shape(a[0] if isinstance(a, tuple) else a)[0] == 3 else B[:1], **kw)
        for start, stop in (causal, window, gaps):
            part = ozaki.matmul(a, B if whole[0].shape[0] == 3 else B[:1], spans=(start, stop), **kw)
            want = np.broadcast_to((j >= start[:, None]) & (j < stop[:, None]), whole[0].shape)
            for w, p in zip(whole, part):
                np.testing.assert_array_equal(p[want].view(np.int64), w[want].view(np.int64))
                rest = ~want & (p != 0)                               # a block forms its rows' union: as whole
                np.testing.assert_array_equal(p[rest].view(np.int64), w[rest].view(np.int64))
            assert (part[0][~want] == 0).mean() > 0.5
    with pytest.raises(ValueError, match="spans"):
        ozaki.matmul(A, B, final=True, spans=causal)
    X = LowPrecision(np.float32)
    monkeypatch.setattr(LowPrecision, "BLOCK", 1 << 15)                # blocks of 2 rows
    a32, b32 = A[:1].astype(np.float32) * 2.0 ** -20, np.clip(B[:1], -1e3, 1e3).astype(np.float32)
    whole, part = X.matmul(a32, b32), X.matmul(a32, b32, spans=window)
    want = (j >= window[0][:, None]) & (j < window[1][:, None])
    np.testing.assert_array_equal(part[0][want], whole[0][want])
    assert (part[0][~want] == 0).mean() > 0.5                          # formed on the spans alone


def test_ozaki_products_large_enough_to_share_are_cut_in_two_blocks_a_thread_with_the_same_bits(monkeypatch):
    """A product whose work is worth the pool is cut into at least two blocks per thread where its shape allows
    (batch entries spread first, then rows cut finer), not one block that a single thread runs: the same bits as
    one thread's cuts, final or not, with a dd operand."""
    rng = np.random.default_rng(31)
    seen = []
    real = ozaki.run_all

    def spy(fn, items):
        seen.append(len(items))
        real(fn, items)
    monkeypatch.setattr(ozaki, "run_all", spy)
    for batch, M in ((8, 256), (2, 256), (1, 512), (3, 200)):
        A = rng.standard_normal((batch, M, 256))
        B = rng.standard_normal((batch, 256, 64))
        for a, final in ((A, True), (A, False), ((A, A * 2.0 ** -60), True)):
            monkeypatch.setenv("SDPA_REF_NUM_THREADS", "1")
            one = ozaki.matmul(a, B, final=final)
            for threads in (2, 3):
                monkeypatch.setenv("SDPA_REF_NUM_THREADS", str(threads))
                seen.clear()
                got = ozaki.matmul(a, B, final=final)
                assert seen and seen[-1] >= 2 * threads, (batch, M, threads, seen)
                for u, w in zip(got, one):
                    np.testing.assert_array_equal(u.view(np.int64), w.view(np.int64))


def test_masked_problems_whose_blocks_the_thread_count_cuts_give_the_same_bits(monkeypatch):
    """Where the thread count changes a product's blocks (small products, at least two blocks a thread), the
    entries outside a row's keys that a block forms change with it; the engine reads none of them: causal and
    windowed problems give the same out, lse, probabilities and gradients on 1, 2 and 3 threads."""
    rng = np.random.default_rng(8)
    for shape, kw in (((2, 2, 256, 16), dict(is_causal=True)), ((3, 2, 200, 16), dict(window=(40, 0)))):
        q, k, v, g = (rng.standard_normal(shape) for _ in range(4))
        got = []
        for threads in ("1", "2", "3"):
            monkeypatch.setenv("SDPA_REF_NUM_THREADS", threads)
            out, res = sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **kw)
            got.append([out, res.lse, res.probs] + list(sdpa_ref.sdpa_backward(res, g)))
        for other in got[1:]:
            for u, w in zip(other, got[0]):
                if w is not None:
                    np.testing.assert_array_equal(np.asarray(u).view(np.int64), np.asarray(w).view(np.int64))


@pytest.mark.parametrize("native", [True, False])
def test_ozaki_products_contracted_where_each_row_is_nonzero_move_no_bit(monkeypatch, native):
    """``contract``: a block of rows contracted over the union of its rows' nonzero range alone (a causal ``P``,
    a band, rows that are all zero, blocks of several rows): the bits of the whole contraction, signed zeros
    too, for ``final=True`` (rows whose leading levels fail the bound and take every level: cancelling sums)
    and ``final=False``, float64 and dd operands, the scale, several batch entries, with ``spans`` at once."""
    if not native:
        monkeypatch.setenv("SDPA_REF_NATIVE", "0")
    monkeypatch.setattr(ozaki, "_BLOCK_ENTRIES", 1 << 12)
    rng = np.random.default_rng(13)
    M, K, N = 120, 160, 24
    i, k = np.arange(M), np.arange(K)
    causal = (np.zeros(M, np.int64), np.minimum(K, i + 41))
    band = (np.maximum(0, i - 30), np.minimum(K, i + 9))
    gaps = (np.where(i % 29 == 4, K, band[0]), np.where(i % 29 == 4, 0, band[1]))
    B = rng.standard_normal((2, K, N)) * 2.0 ** rng.integers(-20, 20, (2, 1, N))
    for start, stop in (causal, band, gaps):
        inside = (k >= start[:, None]) & (k < stop[:, None])
        A = np.where(inside, rng.random((2, M, K)) * 2.0 ** rng.integers(-40, 0, (2, M, 1)), 0.0)
        A[:, ::7, 1::2] = A[:, ::7, 0::2]                               # every 7th row in equal pairs, less
        A[:, ::7] = np.where(inside[::7], A[:, ::7] * (1 + 2.0 ** -80 * (k % 5 == 1)), 0.0)    # a few last bits
        Bc = B.copy()
        Bc[:, :, 3] = np.where(k % 2 == 0, 1.0, -1.0)                  # against which they cancel to those bits
        Ad = (A, A * rng.standard_normal(A.shape) * 2.0 ** -60)
        for a, kw in ((A, dict(final=True)), (Ad, dict(final=True)), (A, {}), (Ad, dict(scale=0.125)),
                      (A, dict(final=True, scale=3.0)), (A, dict(spans=band[:1] + (np.minimum(N, band[1]),)))):
            whole = ozaki.matmul(a, Bc, **{n: x for n, x in kw.items() if n != "spans"})
            part = ozaki.matmul(a, Bc, contract=(start, stop), **kw)
            if "spans" in kw:                                         # the columns each row wants
                j = np.arange(N)
                want = np.broadcast_to((j >= kw["spans"][0][:, None]) & (j < kw["spans"][1][:, None]), whole[0].shape)
                whole = tuple(np.where(want, w, 0.0) for w in whole)
                part = tuple(np.where(want, p, 0.0) for p in part)
            for w, p in zip(whole, part):
                np.testing.assert_array_equal(p.view(np.int64), w.view(np.int64))
    widths, product = [], ozaki._product                               # and the blocks were contracted less
    monkeypatch.setattr(ozaki, "_product", lambda a, b, *r: widths.append(a.shape[-1]) or product(a, b, *r))
    ozaki.matmul(A, Bc, final=True, contract=band)
    assert min(widths) <= 48 < K
    for bad, err in ((5, TypeError), ((band[0][:-1], band[1][:-1]), ValueError),
                     ((band[0] * 1.0, band[1]), ValueError)):
        with pytest.raises(err, match="`contract` should be"):
            ozaki.matmul(A, Bc, contract=bad)


@pytest.mark.parametrize("kv_lengths", [[30, 40], [40, 40]])
@pytest.mark.parametrize("policy", ["zero", "nan", "uniform", "jax"])
def test_the_products_on_the_allowed_blocks_alone_move_no_bit(monkeypatch, policy, kv_lengths):
    """``Q K^T`` and ``dO V^T`` formed on each query row's allowed keys (any batch entry or head), ``P V`` and
    ``dT K`` contracted over them, ``P^T dO`` and ``dT^T Q`` over each key's rows (blocks of 8 rows here), and the
    JVP's tangent scores and products likewise: the output, LSE, gradients and JVP are the bits of forming every
    product whole, in float64 and in float32 with
    ``upcast=False``, for per-batch lengths (padded rows, and a sequence whose first rows have no key or none), a
    window, sinks, dropout and GQA, under every policy (whole where a policy fills a row past its keys)."""
    from sdpa_ref.engines import reproducible as R
    from sdpa_ref.exact.arith import LowPrecision
    monkeypatch.setattr(ozaki, "_BLOCK_ENTRIES", 1 << 8)
    monkeypatch.setattr(LowPrecision, "BLOCK", 1 << 9)
    q, k, v, g, ts, opts = key_spans_case(np.random.default_rng(31), policy, kv_lengths)

    def run():
        out = []
        for dt, kw in ((np.float64, {}), (np.float32, dict(upcast=False))):
            a = [x.astype(dt) for x in (q, k, v, g)]
            o, res = sdpa_ref.sdpa_forward(*a[:3], **opts, **kw)
            out += [o, res.lse, *sdpa_ref.sdpa_backward(res, a[3])[:3],
                    sdpa_ref.sdpa_jvp(tuple(a[:3]), tuple(x.astype(dt) for x in ts), **opts, **kw)[1]]
        return out
    with_, without, calls = with_and_without_key_spans(monkeypatch, R, run)
    assert calls[0] is not None                                        # the scores took them
    assert (policy != "zero" and kv_lengths[0] < 40) or all(c is not None for c in calls)    # and every product
    for x, y in zip(with_, without):
        np.testing.assert_array_equal(x, y)


def test_a_wrong_rounding_is_caught():
    # the faithfulness check itself must fail for a result two ulps away
    t = np.array([mpmath.mpf(1) / 3], dtype=object)
    _faithful(np.array([1 / 3]), t, "ok")
    with pytest.raises(AssertionError):
        _faithful(np.array([np.nextafter(np.nextafter(1 / 3, 1), 1)]), t, "two ulps")
    # a truth a hair past the midpoint of two floats: both are faithful (the check once rounded the truth to
    # 53 bits first and then wanted the upper one only -- hypothesis found a JVP entry there)
    a, b = 1 / 3, float(np.nextafter(1 / 3, 1))
    with mpmath.workdps(60):
        mid = (mpmath.mpf(a) + mpmath.mpf(b)) / 2 + mpmath.mpf(10) ** -40
    for x in (a, b):
        _faithful(np.array([x]), np.array([mid], dtype=object), "a neighbour of a truth past the midpoint")


# ---------------------------------------------------------------- the API


def test_precision_errors_name_the_argument():
    q = np.ones((1, 2, 3))
    with pytest.raises(ValueError, match="precision"):
        sdpa_ref.sdpa_forward(q, q, q, precision="exact")
    with pytest.raises(ValueError, match="method"):
        sdpa_ref.sdpa_forward(q, q, q, precision="reproducible", method="tiled")
    q32 = q.astype(np.float32)
    assert sdpa_ref.sdpa_forward(q32, q32, q32, precision="reproducible", upcast=False)[0].dtype == np.float32
    _, res = sdpa_ref.sdpa_forward(q, q, q, precision="reproducible")
    with pytest.raises(ValueError, match="method"):
        sdpa_ref.sdpa_backward(res, np.ones((1, 2, 3)), method="fast")
    _, res = sdpa_ref.sdpa_forward(q, q, q)
    with pytest.raises(ValueError, match="method"):
        sdpa_ref.sdpa_backward(res, np.ones((1, 2, 3)), method="reproducible")
    _, res = sdpa_ref.sdpa_forward(q, q, q, precision="reproducible", save_probs=False)
    with pytest.raises(ValueError, match="save_probs"):
        sdpa_ref.sdpa_backward(res, np.ones((1, 2, 3)))


def test_float32_inputs_are_upcast_and_the_result_rounded_once_more():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 4, 3)) for _ in range(3))
    out64 = sdpa_ref.scaled_dot_product_attention(q, k, v, precision="reproducible")
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    out32 = sdpa_ref.scaled_dot_product_attention(q32, k32, v32, precision="reproducible")
    want = sdpa_ref.scaled_dot_product_attention(*(x.astype(np.float64) for x in (q32, k32, v32)),
                                                 precision="reproducible").astype(np.float32)
    assert out32.dtype == np.float32
    np.testing.assert_array_equal(out32, want)
    assert out64.dtype == np.float64


@pytest.mark.parametrize("policy", ["zero", "uniform"])
def test_the_reproducible_backward_and_jvp_pass_finite_differences_with_every_option(policy):
    # one problem with every option at once; that the engine equals the teaching core on every combination
    # is test_agrees_with_the_teaching_core_on_every_option, and the core's own finite-difference checks
    # cover the combinations
    rng = np.random.default_rng(11)
    B, Hq, Hkv, L, S, E = 2, 4, 2, 4, 5, 3
    q, k, v = (rng.standard_normal(s) for s in ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, E)))
    mask = rng.random((L, S)) < 0.8
    mask[2] = False                                                  # a fully masked row
    opts = dict(enable_gqa=True, attn_mask=mask, bias=rng.standard_normal((Hq, L, S)), softcap=2.0,
                alibi_slopes=rng.random(Hq), window=(3, 1), q_lengths=[4, 3], kv_lengths=[5, 4],
                dropout_p=0.2, dropout_mask=rng.random((B, Hq, L, S)) > 0.2, fully_masked=policy,
                causal_alignment="bottom_right", scale=0.7)

    def f(q, k, v):
        return sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **opts)[0]

    def vjp(g, q, k, v):
        gr = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **opts)[1], g)
        return gr.query, gr.key, gr.value

    def jvp(t, q, k, v):
        return sdpa_ref.sdpa_jvp((q, k, v), tuple(t), precision="reproducible", **opts)[1]

    # random projections: a wrong gradient anywhere changes <g, J t> (the full mode would take 300 calls)
    assert sdpa_ref.check_vjp(f, vjp, (q, k, v), mode="projection", n_projections=4).ok
    assert sdpa_ref.check_jvp(f, jvp, (q, k, v), mode="projection", n_projections=4).ok


@pytest.fixture(params=("baseline", "avx2", "avx512"))
def simd(request):
    """Each SIMD build of the compiled kernels in turn (``_kernels.h``, compiled once per build): the tests
    below hold every build this CPU runs to the NumPy loops' bits; a build it lacks is skipped."""
    from sdpa_ref.exact import _native
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']}): the NumPy loops run, and the "
                    "hashes above hold them")
    if _native.simd_level(lib, request.param) != request.param:
        _native.simd_level(lib, "best")
        pytest.skip(f"this CPU does not run the {request.param} build")
    yield request.param
    _native.simd_level(lib, "best")


def test_the_compiled_kernels_give_the_numpy_loops_bits(simd):
    from sdpa_ref.exact import _native, dd, ozaki
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']}): the NumPy loops run, and the "
                    "hashes above hold them")
    rng = np.random.default_rng(3)
    x0 = np.concatenate([-rng.random(20000) * 800, rng.standard_normal(500),
                         [-760.0, -760.0000001, 0.0, -0.0, -np.inf, -5e-324, -745.2, -708.4, 1.5, 709.5, 710.0,
                          800.0, np.inf, np.nan]])
    x1 = np.where(np.isinf(x0), 0.0, x0 * rng.standard_normal(x0.size) * 2.0 ** -60)
    a = _native.dd_exp(lib, (x0, x1), dd._TABLE, dd._EXP_CONSTS)
    with np.errstate(over="ignore"):                               # exp(709.9) overflows to inf: as it should
        b = dd._dd_exp_numpy((x0, x1))
    for u, w in zip(a, b):
        same = (u.view(np.int64) == w.view(np.int64)) | (np.isnan(u) & np.isnan(w))
        assert same.all(), np.flatnonzero(~same)
    hi = rng.standard_normal((3, 7, 40)) * np.exp(rng.standard_normal((3, 7, 1)) * 10)
    lo = hi * rng.standard_normal(hi.shape) * 2.0 ** -55
    for x in ((hi, lo), (hi, None)):
        for axis in (-1, -2):
            got = ozaki._slices(ozaki._normalise(x, axis)[0], axis, 5, 30)
            want = ozaki._slices_numpy(ozaki._normalise(x, axis)[0], axis, 5, 30)
            for u, w in zip(got[0] + list(got[1]), want[0] + list(want[1])):
                assert np.array_equal(np.asarray(u).view(np.int64), np.asarray(w).view(np.int64))
    acc, c = (hi.copy(), lo.copy()), rng.standard_normal(hi.shape)
    want = dd.dd_add_d(acc, c)
    got = _native.dd_add_d_inplace(lib, acc, c)
    for u, w in zip(got, want):
        assert np.array_equal(u.view(np.int64), w.view(np.int64))


def test_every_compiled_dd_kernel_gives_the_numpy_bits(monkeypatch, simd):
    from sdpa_ref.engines import reproducible
    from sdpa_ref.exact import _native
    from sdpa_ref.exact.arith import DoubleDouble
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']}): the NumPy loops run, and the "
                    "hashes above hold them")
    rng = np.random.default_rng(4)
    a = (rng.standard_normal((3, 5, 33)) * 4, rng.standard_normal((3, 5, 33)) * 2.0 ** -55)
    b = (rng.random((3, 5, 1)) + 0.5, rng.standard_normal((3, 5, 1)) * 2.0 ** -56)
    P = (rng.random((3, 5, 33)), rng.standard_normal((3, 5, 33)) * 2.0 ** -56)
    P[0][0, 0, [3, 9]] = P[0][0, 0].max() + 1                       # a tie: the first largest is the pivot
    X = DoubleDouble()

    def run():
        return [X.sum(a, keepdims=True), X.sum(a), X.div(a, b), X.mul_d(a, 0.3), X.exp_minus(a, b),
                softmax_vjp_in(X, P, a), softmax_vjp_in(X, P, a, b[0])]

    got = run()
    monkeypatch.setattr(_native, "kernels", lambda: None)
    want = run()
    for g, w in zip(got, want):
        for u, v in zip(g, w):
            assert np.array_equal(np.asarray(u).view(np.int64), np.asarray(v).view(np.int64))


def test_the_compiled_end_of_a_block_gives_the_numpy_bits(simd):
    """``_native.dd_finish`` (the end of a block of ``ozaki.matmul`` in one pass) against the NumPy steps it
    replaces: ``fast_two_sum``, the dd product by the scale, the scalings put back, on sums near overflow, with
    NaN and infinities, results that underflow into the subnormals and exponents at both ends of the range."""
    from sdpa_ref.exact import _native, dd
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']}): the NumPy loops run, and the "
                    "hashes above hold them")
    rng = np.random.default_rng(6)
    nb, rows, n = 2, 9, 37
    h = rng.standard_normal((nb, rows, n)) * np.exp(rng.standard_normal((nb, rows, 1)) * 5)
    l = h * rng.standard_normal(h.shape) * 2.0 ** -50                 # not yet normalised: fast_two_sum moves bits
    h[0, 0, :4] = [np.nan, np.inf, -np.inf, 0.0]
    h[0, 1, :3] = [1.7e308, -1.7e308, 2.0 ** 996]                     # Dekker's split overflows past 2**996
    h[1, 2, :2] = [5e-324, -2.0 ** -1070]
    l[1, 3] = -h[1, 3]                                                # hi + lo cancel: +0 or -0 to keep
    ea = rng.integers(-30, 30, (nb, rows, 1)).astype(np.intc)
    eb = rng.integers(-30, 30, (nb, 1, n)).astype(np.intc)
    ea[0, 4], eb[0, 0, 5], ea[1, 5], eb[1, 0, 6] = -1022, 0, 1023, -1022 - 1023 + 1023   # the range's ends
    ea[1, 6] = -1000                                                  # 2**(ea + eb) subnormal products
    h0, l0 = h.copy(), l.copy()
    for normalise in (True, False):
        for scale in (None, 0.125, 1 / 3, -7.5e-300):
            out = (np.empty_like(h), np.empty_like(h))
            with np.errstate(all="ignore"):
                _native.dd_finish(lib, (h, l), ea, eb, out, normalise=normalise, scale=scale)
                x = dd.fast_two_sum(h, l) if normalise else (h, l)
                if scale is not None:
                    x = dd.dd_mul_d(x, np.float64(scale))
                f = dd.pow2(ea) * dd.pow2(eb)
                want = x[0] * f, x[1] * f
            for u, w in zip(out, want):
                same = (u.view(np.int64) == w.view(np.int64)) | (np.isnan(u) & np.isnan(w))
                assert same.all(), (normalise, scale, np.argwhere(~same)[:5])
    assert np.array_equal(h.view(np.int64), h0.view(np.int64)) and np.array_equal(l.view(np.int64), l0.view(np.int64))


def test_the_compiled_level_test_takes_the_numpy_decision_on_every_row(simd):
    """``_native.level_redo`` (which rows of a ``final=True`` block take every level) against ``_level_bound`` and
    its test in NumPy: rows whose ``|h|`` sits exactly on the bound (``<=`` holds) and one ulp below it (it does
    not), so that an operation done in another order or rounding moves a decision; NaN and infinite statistics,
    zero rows and columns, several batch entries, and the bound's inputs not yet laid out (broadcast, strided)."""
    from sdpa_ref.exact import _native
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']}): the NumPy loops run, and the "
                    "hashes above hold them")
    rng = np.random.default_rng(8)
    for nb, rows, n, t, K in ((2, 11, 37, 4, 1024), (1, 128, 64, 4, 1000), (3, 5, 9, 3, 7)):
        wide = lambda *s: rng.random(s) * 2.0 ** rng.integers(-40, 3, s)          # noqa: E731
        ra, rb = wide(nb, rows, 1) * 2.0 ** -60, wide(nb, 1, n) * 2.0 ** -60
        ma = [wide(nb, rows, 1) * 2.0 ** (-21 * p) for p in range(t)]
        mb = [wide(nb, 1, n) * 2.0 ** (-21 * q) for q in range(t)]
        sa, sb = [x * rng.integers(1, 900, x.shape) for x in ma], [x * rng.integers(1, 900, x.shape) for x in mb]
        ma[1][0, 1], sb[2][0, 0, 3], ra[-1, 2] = np.nan, np.inf, 0.0                 # non-finite statistics
        mb[0][0, 0, 4], sb[0][0, 0, 4] = 0.0, 0.0
        bound = ozaki._level_bound(ra, rb, ma, mb, sa, sb, K)
        h = rng.standard_normal((nb, rows, n)) * 2.0 ** 60 * np.where(np.isfinite(bound), bound, 1.0)
        on = np.where(np.isfinite(bound), bound * 2.0 ** 55, 1.0)                   # |h| exactly on the bound
        h[:, ::2, :] = np.abs(h[:, ::2, :])                                          # most rows far inside
        h[:, 1::3, 5 % n] = on[:, 1::3, 5 % n] * np.where(rng.random((nb, len(range(1, rows, 3)))) < 0.5, 1, -1)
        h[:, 2::3, 1 % n] = np.nextafter(on[:, 2::3, 1 % n], 0)                     # one ulp inside the bound
        want = ~np.all(bound <= 2.0 ** -55 * np.abs(h), axis=-1)
        for args in ((ra, rb, ma, mb, sa, sb), (np.broadcast_to(ra[:, :, :1], ra.shape), rb, ma[::-1][::-1],
                                                  [np.asfortranarray(x) for x in mb], sa, sb)):
            got = _native.level_redo(lib, *args, h, K)
            assert got.dtype == bool and got.shape == (nb, rows)
            np.testing.assert_array_equal(got, want)
        assert want.any() and not want.all()                                       # both decisions are taken


def test_the_compiled_slicer_reads_every_layout_in_place_and_normalises_with_the_numpy_bits(simd):
    """The Ozaki slicer reads rows in place (transposed, batched, broadcast, sliced views) and scales each row as
    ``_normalise`` does; slices, remainders, statistics and exponents are the NumPy definition's bits, rows whose
    scaling underflows (the ``ldexp`` branch) and zero rows included."""
    from sdpa_ref.exact import _native, ozaki
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']}): the NumPy loops run, and the "
                    "hashes above hold them")
    rng = np.random.default_rng(5)
    base = rng.standard_normal((2, 3, 17, 21)) * np.exp(rng.standard_normal((2, 3, 17, 1)) * 8)
    base[0, 0, 1] = 0.0                                             # a zero row: e = 0
    base[0, 1, 2, :3] = [1e300, -3e-300, 5e-320]                    # its scaling underflows: ldexp, rounded
    base[1, 2, 3] = 2.0 ** -1060 * rng.standard_normal(21)          # subnormal: e below -1022
    lo = base * rng.standard_normal(base.shape) * 2.0 ** -56
    before = base.copy(), lo.copy()
    views = {"contiguous": (base, lo), "transposed": (np.swapaxes(base, -1, -2), np.swapaxes(lo, -1, -2)),
             "heads swapped": (np.swapaxes(base, 0, 1), np.swapaxes(lo, 0, 1)),
             "a column block": (base[..., 2:19], lo[..., 2:19]), "every other row": (base[:, :, ::2], lo[:, :, ::2]),
             "broadcast": (np.broadcast_to(base[:1], base.shape), np.broadcast_to(lo[:1], base.shape)),
             "lo laid out otherwise": (base, np.asfortranarray(lo)), "float64": (base, None)}

    def same(u, w):
        return np.array_equal(np.asarray(u).view(np.int64), np.asarray(w).view(np.int64)) if np.asarray(
            u).dtype == np.float64 else np.array_equal(u, w)

    for what, (h, l) in views.items():
        xn, e = ozaki._normalise((h, l), -1)
        for n in (1, 4, 6):
            want, (rh, rl) = ozaki._slices_numpy(xn, -1, n, 30)
            got, (gh, gl), ge = _native.slice_rows(lib, h, l, n, 30, normalise=True)
            assert all(same(u, w) for u, w in zip(got + [gh, gl], want + [rh, rl])), (what, n)
            assert np.array_equal(ge, e), what
            sq, (smax, ssum), rmax, se = _native.slice_rows(lib, h, l, n, 30, stats=True, normalise=True)
            assert all(same(u, w) for u, w in zip(sq, want)) and np.array_equal(se, e), (what, n)
            assert all(same(m, np.max(np.abs(w), axis=-1, keepdims=True)) for m, w in zip(smax, want))
            assert all(same(s, np.sum(np.abs(w), axis=-1, keepdims=True)) for s, w in zip(ssum, want))
            assert same(rmax, np.max(np.abs(rh), axis=-1, keepdims=True) + np.max(np.abs(rl), axis=-1,
                                                                                   keepdims=True))
            tq, (th, tl), te = _native.slice_rows(lib, h, l, n, 30, normalise=True, transposed=True)
            assert all(u.flags.c_contiguous and same(u, np.swapaxes(w, -1, -2)) for u, w in zip(tq, want)), (what, n)
            assert same(th, rh) and same(tl, rl) and np.array_equal(te, e), (what, n)
        for axis in (-1, -2):                                       # and through ozaki's own entry point
            got = ozaki._normalised_slices((h, l), axis, 5, 30)
            xa, ea = ozaki._normalise((h, l), axis)
            want = ozaki._slices_numpy(xa, axis, 5, 30)
            assert all(same(u, w) for u, w in zip(got[0] + list(got[1]), want[0] + list(want[1]))), (what, axis)
            assert np.array_equal(got[2], ea), (what, axis)
    assert same(base, before[0]) and same(lo, before[1])            # the inputs are not written


def test_the_compiled_slicer_cuts_ranges_of_rows_side_by_side_with_the_bits_of_one_call(monkeypatch):
    """Large inputs are cut in ranges of rows in the pool (``_native.slice_rows``): the C loop writes the rows of
    its range alone (a sentinel elsewhere survives), and ranges of any size, side by side, give the bits of one
    call, in rows or transposed, with statistics or a remainder."""
    import ctypes
    from sdpa_ref.exact import _native
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']})")
    rng = np.random.default_rng(9)
    hi = rng.standard_normal((3, 37, 29)) * np.exp(rng.standard_normal((3, 37, 1)) * 6)
    lo = hi * rng.standard_normal(hi.shape) * 2.0 ** -55
    for tout in (0, 1):                                             # the loop itself: rows [9, 50) alone
        rows, k, n = 3 * 37, 29, 4
        out = np.full((n, rows, k), 7.0)
        rh, rl = np.full((rows, k), 7.0), np.full((rows, k), 7.0)
        scratch = np.empty((2 + n * tout) * _native._GATHER * (k + _native._PAD))
        p = lambda a: a.ctypes.data_as(ctypes.c_void_p)             # noqa: E731
        lib.sdpa_slice_rows(p(hi), p(lo), rows, k, 37, 37 * k, k, 1, n, 30, p(out), p(rh), p(rl), None, None, None,
                            None, p(scratch), 9, 50, *((rows * k, 37 * k, 37) if tout else (0, 0, 0)), None)
        whole = _native.slice_rows(lib, hi, lo, n, 30)
        inside = np.zeros(rows, bool)
        inside[9:50] = True
        if tout:
            got = out.reshape(n, 3, k, 37).swapaxes(-1, -2).reshape(n, rows, k)
        else:
            got = out
        assert np.array_equal(got[:, inside], np.stack(whole[0]).reshape(n, rows, k)[:, inside])
        assert np.array_equal(rh[inside], whole[1][0].reshape(rows, k)[inside])
        written = got != 7.0
        assert not written[:, ~inside].any() and not (rh[~inside] != 7.0).any()
    from sdpa_ref._threads import run_all
    calls = []

    def counted(fn, items):
        calls.append(len(items))
        run_all(fn, items)
    views = {"rows": (hi, lo), "columns": (np.swapaxes(hi, -1, -2), np.swapaxes(lo, -1, -2))}
    for parts in (2, 3, 7):
        for what, (h, l) in views.items():
            for kw in (dict(normalise=True), dict(stats=True, normalise=True), dict(transposed=True),
                       dict(stats=True, transposed=True)):
                monkeypatch.setattr(_native, "_SLICE_PARALLEL", 1 << 40)
                one = _native.slice_rows(lib, h, l, 5, 30, parts=parts, run=counted, **kw)
                assert not calls
                monkeypatch.setattr(_native, "_SLICE_PARALLEL", 1)
                split = _native.slice_rows(lib, h, l, 5, 30, parts=parts, run=counted, **kw)
                assert len(calls) == 1 and 1 < calls[0] <= parts, (what, kw, calls)
                calls.clear()
                flat = lambda r: [x for y in r for x in (flat(y) if isinstance(y, (list, tuple)) else [y])]  # noqa
                assert all(np.array_equal(np.asarray(u).view(np.int8), np.asarray(w).view(np.int8))
                           for u, w in zip(flat(split), flat(one))), (what, kw, parts)


def test_the_compiled_column_statistics_give_the_numpy_passes_bits(monkeypatch):
    """A product rounded next (``final=True``) takes ``B``'s column slices, maxima, exact sums and remainder from
    the compiled slicer in one pass (``ozaki._quick_columns``): the bits of the NumPy passes it replaces, with
    columns that fit in the quick levels' slices, columns that need more (the passes run), a dd ``A``, a
    scale, batches that broadcast, and a row whose early stop fails."""
    from sdpa_ref.exact import _native
    if _native.kernels() is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']}): the NumPy passes run")
    rng = np.random.default_rng(12)
    A = rng.standard_normal((2, 3, 40, 300))
    A = D.fast_two_sum(A, A * rng.standard_normal(A.shape) * 2.0 ** -58)
    A[0][0, 0, 7] = -A[0][0, 0, :7].sum() - A[0][0, 0, 8:].sum()     # a cancelling row: every level
    wide = rng.standard_normal((3, 300, 24)) * np.exp2(rng.integers(-40, 40, (3, 300, 24)))
    for B in (rng.standard_normal((3, 300, 24)), rng.standard_normal((1, 300, 24)), wide):
        cut = ozaki._quick_columns((B, None), 4, 6, 32)
        assert (cut is None) == (B is wide)
        if cut is not None:                                  # the statistics are the NumPy passes' values
            sb, e, mbs, sbq, rbq, joined, knz = cut
            assert joined is None
            want, rem, we = ozaki._normalised_slices((B, None), -2, 4, 32)
            assert all(np.array_equal(f, np.any(w != 0, axis=-1)) for f, w in zip(knz, want))
            assert all(np.array_equal(u, w) for u, w in zip(sb[:4], want)) and np.array_equal(e, we)
            assert not np.any(rem[0]) and not np.any(rbq) and not any(np.any(x) for x in sb[4:] + mbs[4:])
            assert all(np.array_equal(m, np.max(np.abs(w), axis=-2, keepdims=True)) for m, w in zip(mbs, want))
            assert all(np.array_equal(m, np.sum(np.abs(w), axis=-2, keepdims=True)) for m, w in zip(sbq, want))
        got = ozaki.matmul(A, B, final=True, scale=0.3)
        with monkeypatch.context() as m:
            m.setattr(ozaki, "_quick_columns", lambda *a, **k: None)
            want = ozaki.matmul(A, B, final=True, scale=0.3)
        for u, w in zip(got, want):
            assert np.array_equal(u.view(np.int64), w.view(np.int64))


def test_the_slices_of_b_side_by_side_give_the_bits_of_one_product_at_a_time(monkeypatch):
    """A ``final=True`` product with few columns cuts ``B``'s slices side by side (``slice_rows(joined=True)``)
    and forms the products of each slice of a block of ``A`` with the leading slices of ``B`` in one GEMM
    (``_products``' ``joined``), whose column blocks the dd sum reads in place (``dd_add_d_rows``): the bits of
    the products formed one at a time, with float64 and dd operands, slices of ``B`` contracted over a few lines
    (the last bits of a float64 column), rows of ``A`` that are zero, a NaN, batches, a scale and a contraction
    range; and the joined GEMMs are in use."""
    from sdpa_ref.exact import _native
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']}): the products are formed one at a "
                    "time")
    rng = np.random.default_rng(21)
    h = rng.standard_normal((2, 29, 13))
    for parts in (1, 3):                                            # the layout: the transposed slices, padded
        sq, _, _, _, whole = _native.slice_rows(lib, h, None, 4, 30, stats=True, normalise=True, transposed=True,
                                                joined=True, parts=parts, run=lambda f, xs: [f(x) for x in xs])
        want = _native.slice_rows(lib, h, None, 4, 30, stats=True, normalise=True, transposed=True)[0]
        assert whole.shape == (2, 13, 4 * 29 + _native._JOIN_PAD) and whole.flags.c_contiguous
        assert all(np.array_equal(u, w) and np.shares_memory(u, whole) for u, w in zip(sq, want))
    with pytest.raises(ValueError, match="transposed"):
        _native.slice_rows(lib, h, None, 4, 30, joined=True)
    acc = (rng.standard_normal((3, 5, 7)), rng.standard_normal((3, 5, 7)) * 1e-17)
    wide = rng.standard_normal((3, 5, 11))
    got = _native.dd_add_d_inplace(lib, (acc[0].copy(), acc[1].copy()), wide[..., 2:9])
    want = D.dd_add_d(acc, np.ascontiguousarray(wide[..., 2:9]))
    assert all(np.array_equal(u, w) for u, w in zip(got, want))

    formed = []
    real = ozaki._products

    def spy(*a, **k):
        formed.append(k.get("joined") is not None)
        return real(*a, **k)
    monkeypatch.setattr(ozaki, "_products", spy)
    A = rng.standard_normal((2, 3, 40, 600))
    A[:, :, 5] = 0.0                                                # rows with no slice
    Add = D.fast_two_sum(A, A * rng.standard_normal(A.shape) * 2.0 ** -58)
    B = rng.standard_normal((2, 3, 600, 24)) * np.exp2(rng.integers(-3, 3, (2, 3, 600, 24)))
    B[0, 1, 3:, 4] = 0.0                                            # a column held in few lines
    nan = A.copy()
    nan[1, 2, 9, 100] = np.nan
    cases = [(A, B, {}), (Add, B, dict(scale=0.7)), (A, B[:1, :1], {}), (nan, B, {}),
             (A[0, 0], B[0, 0], dict(contract=(np.full(40, 50), np.full(40, 420))))]
    for a, b, kw in cases:
        formed.clear()
        got = ozaki.matmul(a, b, final=True, **kw)
        used = any(formed)
        with monkeypatch.context() as m:
            m.setattr(ozaki, "_JOIN_COLUMNS", 0)
            want = ozaki.matmul(a, b, final=True, **kw)
        for u, w in zip(got, want):
            assert np.array_equal(u.view(np.int64), w.view(np.int64)), kw
        assert used == (np.shape(b[0] if isinstance(b, tuple) else b)[:-2] == np.shape(
            a[0] if isinstance(a, tuple) else a)[:-2]), kw


def test_the_slicer_finds_the_nonzero_lines_of_b_as_it_cuts_them(monkeypatch):
    """``slice_rows(nonzero=True)`` marks, per slice of ``B``'s columns, the lines of ``K`` holding a nonzero entry
    (what a product contracts over) as it writes them: NumPy's ``np.any(slice != 0)`` for groups of columns that
    are and are not a multiple of the gather, ranges of rows that share a group, a NaN and zero columns; and a
    product summed on (``final=False``) that takes its column slices, maxima and those lines from the slicer in
    one pass (``ozaki._columns``) has the bits of the NumPy passes."""
    from sdpa_ref.exact import _native
    from sdpa_ref._threads import run_all
    lib = _native.kernels()
    if lib is None:
        pytest.skip(f"compiled kernels not in use ({_native.status()['reason']})")
    rng = np.random.default_rng(33)
    B = rng.standard_normal((3, 300, 21)) * np.exp2(rng.integers(-12, 1, (3, 300, 1)))  # the last slices: few lines
    B[0, :, 4] = 0.0
    B[1, 200:, 7] = 0.0
    B[2, 17, 3] = np.nan
    monkeypatch.setattr(_native, "_SLICE_PARALLEL", 1)
    for parts in (1, 2, 5):
        for joined in (False, True):
            got = _native.slice_rows(lib, np.swapaxes(B, -1, -2), None, 5, 32, normalise=True, remainder=False,
                                     transposed=True, joined=joined, nonzero=True, parts=parts, run=run_all)
            knz = got[-1]
            assert knz.shape == (5, 3, 300) and knz.dtype == bool
            for f, x in zip(knz, got[0]):
                np.testing.assert_array_equal(f, np.any(x != 0, axis=-1))
            assert knz.any() and not knz.all()
    with pytest.raises(ValueError, match="transposed"):
        _native.slice_rows(lib, B, None, 5, 32, nonzero=True)
    A = rng.standard_normal((3, 40, 300))
    for b in (B[:2], np.where(np.isnan(B), 1.0, B)[:1], B):
        cut = ozaki._columns((b, None), 5, 32)
        assert (cut is None) == bool(np.isnan(b).any())
        got = ozaki.matmul(A[:len(b)] if len(b) > 1 else A, b, scale=0.25)
        with monkeypatch.context() as m:
            m.setattr(ozaki, "_columns", lambda *a: None)
            want = ozaki.matmul(A[:len(b)] if len(b) > 1 else A, b, scale=0.25)
        for u, w in zip(got, want):
            np.testing.assert_array_equal(u.view(np.int64), w.view(np.int64))


#: How much of a cancelling entry is left: well inside the reproducible engine's claim (about 2**45).
CANCEL = 2.0 ** -30


def _problem(rng, qb=2, kb=2, vb=2, Hq=2, Hkv=2, L=3, S=4, E=2, Ev=3):
    q = rng.standard_normal((qb, Hq, L, E))
    k = rng.standard_normal((kb, Hkv, S, E))
    v = rng.standard_normal((vb, Hkv, S, Ev))
    qv = rng.standard_normal((qb, Hq, L, Ev))
    return q, k, v, qv


def _truth(q, k, v, qv, g, **oracle):
    """The mpmath ``(out, lse, dq, dk, dv, dqv)`` of the qv problem, in the inputs' own shapes (broadcast key
    and value gradients summed over the batch in mpmath), by the joined problem in the plain-loop oracle."""
    E, Ev = q.shape[-1], v.shape[-1]
    B = max(q.shape[0], k.shape[0], v.shape[0])
    kf, vf = np.broadcast_to(k, (B,) + k.shape[1:]), np.broadcast_to(v, (B,) + v.shape[1:])
    q2 = np.concatenate([np.broadcast_to(q, (B,) + q.shape[1:]), np.broadcast_to(qv, (B,) + qv.shape[1:])], -1)
    k2 = np.concatenate([kf, vf], -1)
    out, lse, (dq2, dk2, dv, _) = oracle_attention(q2, k2, vf, grad_out=g, scale=1 / np.sqrt(E + Ev), num="mp",
                                                  **oracle)
    dv = dv + dk2[..., E:]                                    # both uses of V, summed exactly (mpf)

    def to(x, shape):
        return x.sum(axis=0, keepdims=True) if shape[0] == 1 and x.shape[0] != 1 else x
    return out, lse, dq2[..., :E], to(dk2[..., :E], k.shape), to(dv, v.shape), dq2[..., E:]


def _coefficients(q, k, v, qv, which, j):
    """``G`` with ``grads.<which>[j] = <G, dO>``: the backward on the basis of ``dO`` (it is linear in ``dO``)."""
    out, res = sdpa_ref.sdpa_forward(q, k, v, qv=qv)
    G = np.empty(out.shape)
    for i in np.ndindex(out.shape):
        e = np.zeros(out.shape)
        e[i] = 1.0
        G[i] = getattr(sdpa_ref.sdpa_backward(res, e), which)[j]
    return G


def _cancelling(rng, q, k, v, qv, which, j):
    """A cotangent ``dO`` under which ``grads.<which>[j]`` is ``CANCEL`` of its terms' size."""
    G = _coefficients(q, k, v, qv, which, j)
    r = rng.standard_normal(G.shape)
    return r - (1 - CANCEL) * np.sum(G * r) / np.sum(G * G) * G


@pytest.mark.parametrize("j", [(0, 0, 1, 2), (1, 0, 3, 0)])
def test_dv_faithful_where_the_two_uses_of_v_cancel(j):
    rng = np.random.default_rng(40)
    q, k, v, qv = _problem(rng)
    g = _cancelling(rng, q, k, v, qv, "value", j)
    _, res = sdpa_ref.sdpa_forward(q, k, v, qv=qv, precision="reproducible")
    dv = sdpa_ref.sdpa_backward(res, g).value
    truth = _truth(q, k, v, qv, g)[4]
    assert abs(float(truth[j])) < 1e-6 * float(np.max(np.abs(dv)))             # it does cancel
    assert_faithful(dv, truth, "dv")


@pytest.mark.parametrize("which, shapes, j", [
    ("key", dict(kb=1), (0, 0, 2, 1)),                       # one key for both batches: dK summed over them
    ("value", dict(vb=1), (0, 0, 1, 2)),                     # one value: dV's two uses, each over both batches
])
def test_broadcast_key_and_value_faithful_where_the_batch_sum_cancels(which, shapes, j):
    rng = np.random.default_rng(41)
    q, k, v, qv = _problem(rng, **shapes)
    g = _cancelling(rng, q, k, v, qv, which, j)
    _, res = sdpa_ref.sdpa_forward(q, k, v, qv=qv, precision="reproducible")
    got = getattr(sdpa_ref.sdpa_backward(res, g), which)
    truth = _truth(q, k, v, qv, g)[3 if which == "key" else 4]
    assert got.shape == truth.shape
    assert_faithful(got, truth, which)


@pytest.mark.parametrize("opts, oracle", [
    ({}, {}),
    (dict(is_causal=True, enable_gqa=True), dict(is_causal=True)),
    (dict(softcap=2.0, enable_gqa=True), dict(softcap=2.0)),
])
def test_every_reproducible_quantity_with_qv_is_faithful(opts, oracle):
    rng = np.random.default_rng(42)
    q, k, v, qv = _problem(rng, Hkv=1 if opts.get("enable_gqa") else 2)
    g = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    out, res = sdpa_ref.sdpa_forward(q, k, v, qv=qv, precision="reproducible", **opts)
    gr = sdpa_ref.sdpa_backward(res, g)
    t_out, t_lse, t_dq, t_dk, t_dv, t_dqv = _truth(q, k, v, qv, g, **oracle)
    for x, t, what in ((out, t_out, "out"), (res.lse, t_lse, "lse"), (gr.query, t_dq, "dq"),
                       (gr.key, t_dk, "dk"), (gr.value, t_dv, "dv"), (gr.qv, t_dqv, "dqv")):
        assert_faithful(x, t, what)


def test_jvp_with_qv_is_faithful():
    """The output tangent along all four inputs against a 60-digit central difference (error O(h^2) = 1e-40)."""
    rng = np.random.default_rng(43)
    q, k, v, qv = _problem(rng, Hq=1, Hkv=1, L=2, S=3)
    ts = [rng.standard_normal(x.shape) for x in (q, k, v, qv)]
    _, tan = sdpa_ref.sdpa_jvp((q, k, v), (ts[0], ts[1], ts[2], None, None, ts[3]), qv=qv,
                               precision="reproducible")
    ctx = mpmath.MPContext()
    ctx.dps = 60
    h = ctx.mpf(10) ** -20

    def shifted(a, t, sign):
        return mp_shifted(ctx, a, t, sign, h)

    def out_at(sign):
        q2 = np.concatenate([shifted(q, ts[0], sign), shifted(qv, ts[3], sign)], -1)
        vv = shifted(v, ts[2], sign)
        k2 = np.concatenate([shifted(k, ts[1], sign), vv], -1)
        return oracle_attention(q2, k2, vv, scale=1 / np.sqrt(q.shape[-1] + v.shape[-1]), num="mp")[0]

    hi, lo = out_at(1), out_at(-1)
    truth = np.empty(hi.shape, dtype=object)
    for i, a in np.ndenumerate(hi):
        truth[i] = (a - lo[i]) / (2 * h)
    assert_faithful(tan, truth, "jvp")


def test_a_nan_in_v_makes_the_same_gradients_nan_as_the_fast_split():
    """The engine's split gives the values, the API's split the NaN pattern of what reads the poison."""
    rng = np.random.default_rng(44)
    q, k, v, qv = _problem(rng)
    v[1, 0, 2, 1] = np.nan
    g = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    got = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, qv=qv, precision="reproducible")[1], g)
    ref = sdpa_ref.sdpa_backward(sdpa_ref.sdpa_forward(q, k, v, qv=qv)[1], g)
    for x, y in zip(got, ref):
        if y is not None:
            np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
            assert np.any(np.isnan(y)) and not np.all(np.isnan(y))
            np.testing.assert_allclose(x[~np.isnan(x)], y[~np.isnan(y)], rtol=F64_SUMS, atol=F64_FEW_ULP)


_PIECE_CASES = [dict(), dict(is_causal=True), dict(enable_gqa=True), dict(dropout_p=0.3, rng=3), dict(sinks=True),
                dict(softcap=5.0), dict(window=(5, 3)), dict(attn_mask="bool"), dict(alibi_slopes=True),
                dict(q_lengths=np.array([10, 24]), kv_lengths=np.array([0, 33])),
                dict(q_lengths=np.array([10, 24]), kv_lengths=np.array([0, 33]), fully_masked="nan"),
                dict(attn_mask="sparse", fully_masked="uniform"), dict(grad_lse=True), dict(broadcast_kv=True),
                dict(enable_gqa=True, sinks=True, is_causal=True, dropout_p=0.2, rng=5, grad_lse=True)]


@pytest.mark.parametrize("case", range(len(_PIECE_CASES)))
def test_backward_in_pieces_moves_no_bit(monkeypatch, case):
    """The backward of large scores takes the kv heads a piece at a time (``dP``, the row pass, ``dT K`` and
    ``dT^T Q`` of one piece in one workspace): every gradient has the bits of the whole at once, on every option
    the pass reads (GQA groups, broadcast keys, dropout, sinks, softcap, masks and empty rows, ``grad_lse``)."""
    import sdpa_ref.engines.reproducible as R
    rng = np.random.default_rng(40 + case)
    kw = dict(_PIECE_CASES[case])
    B, H, L, S, E = 2, 4, 24, 40, 8
    H, Hkv = (8, 4) if kw.get("enable_gqa") else (H, H)
    q, g = rng.standard_normal((B, H, L, E)), rng.standard_normal((B, H, L, E))
    kb = 1 if kw.pop("broadcast_kv", False) else B
    k, v = rng.standard_normal((kb, Hkv, S, E)), rng.standard_normal((kb, Hkv, S, E))
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(H)
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = rng.random(H)
    if kw.get("attn_mask") is not None:
        kw["attn_mask"] = rng.random((L, S)) < (0.5 if kw["attn_mask"] == "bool" else 0.05)
    grad_lse = rng.standard_normal((B, H, L)) if kw.pop("grad_lse", False) else None
    seed = kw.pop("rng", None)
    calls = []
    whole_in_pieces = R._backward_in_pieces
    monkeypatch.setattr(R, "_backward_in_pieces", lambda *a: calls.append(len(a[2])) or whole_in_pieces(*a))

    def grads(piece):
        monkeypatch.setattr(R, "_PIECE_ENTRIES", piece)
        extra = {} if seed is None else dict(rng=np.random.default_rng(seed))
        _, res = sdpa_ref.sdpa_forward(q, k, v, precision="reproducible", **kw, **extra)
        return sdpa_ref.sdpa_backward(res, g, grad_lse=grad_lse)

    whole = grads(1 << 40)
    assert calls == []
    per_head = H // Hkv * L * S
    for piece, heads in ((per_head // 2, 1), (2 * per_head, 2)):    # a head a piece (smaller); two heads
        pieces = grads(piece)
        assert calls and calls[-1] == B * Hkv // heads
        for a, b in zip(whole, pieces):
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a).view(np.int64), np.asarray(b).view(np.int64))


def test_ozaki_matmul_writes_to_out():
    """``out``: the product written to the given dd workspace and returned as it, the bits of a fresh result
    (``spans`` too: the rest set to +0); a workspace of another shape or dtype, or one that overlaps an input,
    is refused by name."""
    rng = np.random.default_rng(41)
    A, B = rng.standard_normal((3, 20, 16)), rng.standard_normal((3, 16, 30))
    i = np.arange(20)
    for kw in (dict(), dict(scale=0.5), dict(spans=(np.maximum(0, i - 5), np.minimum(30, i + 3)))):
        want = ozaki.matmul(A, B, **kw)
        out = (np.full((3, 20, 30), np.nan), np.full((3, 20, 30), np.nan))
        got = ozaki.matmul(A, B, out=out, **kw)
        assert got is out
        for w, o in zip(want, out):
            np.testing.assert_array_equal(o.view(np.int64), w.view(np.int64))
    with pytest.raises(ValueError, match="`out`"):
        ozaki.matmul(A, B, out=(np.empty((3, 20, 31)), np.empty((3, 20, 31))))
    with pytest.raises(ValueError, match="`out`"):
        ozaki.matmul(A, B, out=(np.empty((3, 20, 30), np.float32), np.empty((3, 20, 30))))
    with pytest.raises(TypeError, match="`out`"):
        ozaki.matmul(A, B, out=np.empty((3, 20, 30)))
    w = np.empty((2, 3, 20, 30))
    with pytest.raises(ValueError, match="share no memory"):
        ozaki.matmul(A, B, out=(w[0], w[0]))
