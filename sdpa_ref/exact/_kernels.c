/* The exact arithmetic's element-wise kernels (_kernels.h: the loops of sdpa_ref/exact/ozaki.py and dd.py, the
 * same IEEE-754 operations in the same order as the NumPy code they replace, so they give the same bits), compiled
 * for the baseline and, on x86-64, for AVX2 and AVX-512 through function attributes, as _fast_rows.c compiles the
 * fast path's row passes: the build in use is theirs (sdpa_fast_set_level, SDPA_REF_SIMD), the widest the CPU
 * runs by default. Every build gives the same bits; a wider one lets the compiler run more entries side by side
 * (AVX-512's masks and 64-bit integer conversions vectorise the exp's table step and the scalings, which the
 * baseline runs one entry at a time). Built at install (setup.py) with -ffp-contract=off and no fast-math: no FMA
 * contraction, no reassociation. C99 with GCC/Clang vector extensions, libc and libm only. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#pragma GCC diagnostic ignored "-Wpsabi"             /* the vector helpers are always inlined: no ABI to keep */

#define KX_W 2
#define KX_SFX base
#define KX_ATTR
#include "_kernels.h"
#undef KX_W
#undef KX_SFX
#undef KX_ATTR

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KX_HAVE_AVX2 1
#define KX_W 4
#define KX_SFX avx2
#define KX_ATTR __attribute__((target("avx2")))
#include "_kernels.h"
#undef KX_W
#undef KX_SFX
#undef KX_ATTR

#define KX_W 8
#define KX_SFX avx512
#define KX_ATTR __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
#include "_kernels.h"
#undef KX_W
#undef KX_SFX
#undef KX_ATTR
#endif

int sdpa_fast_get_level(void);                     /* _fast_rows.c: the build in use, the same for both files */

#ifdef KX_HAVE_AVX2
#define KX_DISPATCH(NAME, ...)                                                                                   \
    do {                                                                                                         \
        int level_ = sdpa_fast_get_level();                                                                      \
        if (level_ == 2)                                                                                         \
            NAME##_avx512(__VA_ARGS__);                                                                          \
        else if (level_ == 1)                                                                                    \
            NAME##_avx2(__VA_ARGS__);                                                                            \
        else                                                                                                     \
            NAME##_base(__VA_ARGS__);                                                                            \
    } while (0)
#else
#define KX_DISPATCH(NAME, ...) NAME##_base(__VA_ARGS__)
#endif

/* n slices of each row of (hi, lo), as ozaki._slices: slice p of row r goes to out[(p * rows + r) * k ...]
 * (contiguous); the remainder to (rem_hi, rem_lo) [rows x k, contiguous] when they are given. lo may be NULL
 * for a float64 input. The rows are read in place: row r starts at element (r / per) * bs + (r % per) * rs of
 * hi (and of lo, which has the same layout), its entries cs elements apart, so a transposed block (the rows of
 * A^T, the columns of B) is cut without a copy. With eout, each row is first scaled as ozaki._normalise does,
 * by 2**-e with its max|hi| = f 2**e, f in [1/2, 1) (e = 0 for a zero row; exact, or the correctly rounded
 * ldexp where an entry underflows), and e goes to eout[r].
 * Optionally, per slice and row, the max and the sum of the absolute values (smax, ssum [n x rows]: the sum is
 * exact, its entries lie on one grid with few bits) and the remainder's max|hi| + max|lo| (rmax [rows]).
 * The element-wise steps and the reductions are separate loops (the first vectorises); every maximum and
 * slice sum is exact, so its order does not matter. Only the rows [first, last) are cut (the arrays are
 * indexed by the row's own number, so calls on disjoint ranges may run side by side); with tjs != 0 the slices
 * are written transposed within each group of per rows, at the strides tps, tgs, tjs, and knz marks each
 * group's entries that are nonzero in a slice (see _kernels.h).
 * scratch: (2 + (tjs ? n : 0))
 * SLICE_GATHER (k + SLICE_PAD) doubles. The inputs are not written. */
void sdpa_slice_rows(const double *hi, const double *lo, ptrdiff_t rows, ptrdiff_t k, ptrdiff_t per, ptrdiff_t bs,
                     ptrdiff_t rs, ptrdiff_t cs, int n, int rho, double *out, double *rem_hi, double *rem_lo,
                     double *smax, double *ssum, double *rmax, int *eout, double *scratch, ptrdiff_t first,
                     ptrdiff_t last, ptrdiff_t tps, ptrdiff_t tgs, ptrdiff_t tjs, unsigned char *knz)
{
    KX_DISPATCH(slice_rows, hi, lo, rows, k, per, bs, rs, cs, n, rho, out, rem_hi, rem_lo, smax, ssum, rmax, eout,
                scratch, first, last, tps, tgs, tjs, knz);
}

/* (hi, lo) = dd_add_d((hi, lo), c) in place: two_sum(hi, c), then fast_two_sum(s, e + lo). */
void sdpa_dd_add_d(double *hi, double *lo, const double *c, ptrdiff_t n)
{
    KX_DISPATCH(dd_add_d, hi, lo, c, n);
}

/* The same, c read as rows of n entries ldc apart (a block of columns of a wider product); (hi, lo) [rows x n],
 * contiguous. The same operations on each entry, so the same bits. */
void sdpa_dd_add_d_rows(double *hi, double *lo, const double *c, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ldc)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        KX_DISPATCH(dd_add_d, hi + r * n, lo + r * n, c + r * ldc, n);
}

/* exp of x [rows x n] less the row's m (dd_exp(dd_sub(x, m))), or of x itself when m0 is NULL.
 * c: [0] EXP_FLOOR, [1] N / ln2_hi, [2] C1, [3] C23 hi, [4] C23 lo, [5 + 2 m], [6 + 2 m]: 1/m! as dd, m = 0..8.
 * The operations of dd._dd_exp_numpy, element by element, in branch-free stages over chunks of entries, so that
 * the chains of neighbouring entries overlap and each stage vectorises (the table's gather with AVX-512). */
void sdpa_dd_exp_rows(const double *x0, const double *x1, const double *m0, const double *m1, ptrdiff_t rows,
                      ptrdiff_t n, double *o0, double *o1, const double *t0, const double *t1, const double *c)
{
    KX_DISPATCH(dd_exp_rows, x0, x1, m0, m1, rows, n, o0, o1, t0, t1, c);
}

/* dd.dd_div(a, b) of a [rows x n] by the row's b */
void sdpa_dd_div_rows(const double *a0, const double *a1, const double *b0, const double *b1, ptrdiff_t rows,
                      ptrdiff_t n, double *o0, double *o1)
{
    KX_DISPATCH(dd_div_rows, a0, a1, b0, b1, rows, n, o0, o1);
}

/* dd.dd_mul_d(a, b) for a scalar b */
void sdpa_dd_mul_d_scalar(const double *a0, const double *a1, double b, ptrdiff_t n, double *o0, double *o1)
{
    KX_DISPATCH(dd_mul_d_scalar, a0, a1, b, n, o0, o1);
}

/* dd.dd_sum of each row of (hi, lo) [rows x n], by its pairwise tree (k_tree in _kernels.h); scratch: 2 n doubles */
void sdpa_dd_rowsum(const double *hi, const double *lo, ptrdiff_t rows, ptrdiff_t n, double *o0, double *o1,
                    double *scratch)
{
    KX_DISPATCH(dd_rowsum, hi, lo, rows, n, o0, o1, scratch);
}

/* reproducible._softmax_vjp on rows of dd P and g [rows x n]: c = g at the first largest P.hi (NumPy's argmax:
 * the first NaN if any), gc = g - c, out = P * (gc - tree_sum(P * gc)). scratch: 2 n doubles. */
void sdpa_dd_softmax_vjp_rows(const double *p0, const double *p1, const double *g0, const double *g1,
                              ptrdiff_t rows, ptrdiff_t n, double *o0, double *o1, double *scratch)
{
    KX_DISPATCH(dd_softmax_vjp_rows, p0, p1, g0, g1, rows, n, o0, o1, scratch);
}

/* The end of a block of an exact product: the dd sum (hi, lo) [nb x rows x n] of its levels, normalised
 * (fast_two_sum, when norm is set), times the float scale (dd.dd_mul_d, when has_scale is set), then times
 * 2**(ea[i, r] + eb[i, j]) (the rows' and columns' scalings put back, ozaki.matmul: pow2(ea) * pow2(eb), a power
 * of two, the caller has checked that every exponent and every sum of two lies in [-1022, 1023]), written to
 * (o0, o1) [nb x rows x n, contiguous]. The operations of the NumPy steps it replaces, in their order. */
void sdpa_dd_finish(const double *hi, const double *lo, ptrdiff_t nb, ptrdiff_t rows, ptrdiff_t n, int norm,
                    int has_scale, double scale, const int *ea, const int *eb, double *o0, double *o1)
{
    KX_DISPATCH(dd_finish, hi, lo, nb, rows, n, norm, has_scale, scale, ea, eb, o0, o1);
}

/* ozaki._level_bound and its test, row by row: redo [nb x rows] (see _kernels.h). scratch: 3 n doubles. */
void sdpa_level_redo(ptrdiff_t nb, ptrdiff_t rows, ptrdiff_t n, int t, double K, const double *ra, const double *rb,
                     const double *const *ma, const double *const *mb, const double *const *sa,
                     const double *const *sb, const double *h, unsigned char *redo, double *scratch)
{
    KX_DISPATCH(level_redo, nb, rows, n, t, K, ra, rb, ma, mb, sa, sb, h, redo, scratch);
}
