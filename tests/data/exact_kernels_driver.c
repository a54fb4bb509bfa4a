/* Drives the exact kernels (sdpa_ref/exact/_kernels.c, _kernels.h) over many shapes and layouts, every buffer
 * allocated to its exact size, so that AddressSanitizer and UBSan (tests/test_exact_kernels_sanitized.py) see any
 * read or write past one: the slicer (contiguous and transposed rows, batched, a float64 or dd input, with and
 * without the remainder, the statistics and the normalisation, every number of slices, slices written in rows,
 * transposed or side by side with the nonzero flags of their lines, every row or a range of them), the end of a
 * block, the dd accumulation (c contiguous or a block of columns), exp (rows shorter and longer than its chunks,
 * NaN and overflowing entries), the division, the
 * product by a scalar, the row sums, the softmax VJP and the early-stop level test; all of it once per SIMD build the CPU runs (the
 * library takes the build from _fast_rows.c's sdpa_fast_get_level; built alone here, _kernels.c takes it from
 * the driver). Prints "ok" and exits 0 when every call returned. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

void sdpa_slice_rows(const double *hi, const double *lo, ptrdiff_t rows, ptrdiff_t k, ptrdiff_t per, ptrdiff_t bs,
                     ptrdiff_t rs, ptrdiff_t cs, int n, int rho, double *out, double *rem_hi, double *rem_lo,
                     double *smax, double *ssum, double *rmax, int *eout, double *scratch, ptrdiff_t first,
                     ptrdiff_t last, ptrdiff_t tps, ptrdiff_t tgs, ptrdiff_t tjs, unsigned char *knz);
void sdpa_dd_add_d_rows(double *hi, double *lo, const double *c, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ldc);
void sdpa_dd_finish(const double *hi, const double *lo, ptrdiff_t nb, ptrdiff_t rows, ptrdiff_t n, int norm,
                    int has_scale, double scale, const int *ea, const int *eb, double *o0, double *o1);
void sdpa_dd_add_d(double *hi, double *lo, const double *c, ptrdiff_t n);
void sdpa_dd_exp_rows(const double *x0, const double *x1, const double *m0, const double *m1, ptrdiff_t rows,
                      ptrdiff_t n, double *o0, double *o1, const double *t0, const double *t1, const double *c);
void sdpa_dd_div_rows(const double *a0, const double *a1, const double *b0, const double *b1, ptrdiff_t rows,
                      ptrdiff_t n, double *o0, double *o1);
void sdpa_dd_mul_d_scalar(const double *a0, const double *a1, double b, ptrdiff_t n, double *o0, double *o1);
void sdpa_dd_rowsum(const double *hi, const double *lo, ptrdiff_t rows, ptrdiff_t n, double *o0, double *o1,
                    double *scratch);
void sdpa_dd_softmax_vjp_rows(const double *p0, const double *p1, const double *g0, const double *g1,
                              ptrdiff_t rows, ptrdiff_t n, double *o0, double *o1, double *scratch);
void sdpa_level_redo(ptrdiff_t nb, ptrdiff_t rows, ptrdiff_t n, int t, double K, const double *ra, const double *rb,
                     const double *const *ma, const double *const *mb, const double *const *sa,
                     const double *const *sb, const double *h, unsigned char *redo, double *scratch);

static int level;                                            /* the build the kernels dispatch to */
int sdpa_fast_get_level(void)
{
    return level;
}

/* whether the CPU runs build l (0: the baseline; 1: AVX2; 2: AVX-512 F, DQ, VL, BW), as _fast_rows.c decides */
static int cpu_runs(int l)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2");
    int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")
                 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
    return l == 0 || (l == 1 && avx2) || (l == 2 && avx512);
#else
    return l == 0;
#endif
}

static unsigned long long state = 88172645463325252ULL;
static double draw(void)
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    double u = (double)(state >> 11) / 9007199254740992.0 - 0.5;
    return ldexp(u, (int)(state % 40) - 20);
}

static double *fresh(size_t n)
{
    double *p = malloc((n ? n : 1) * sizeof *p);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    for (size_t i = 0; i < n; i++)
        p[i] = draw();
    return p;
}

/* exp, the division, the product by a scalar, the row sums and the softmax VJP on rows of n entries */
static long drive_rows(void)
{
    long calls = 0;
    double *t0 = fresh(1024), *t1 = fresh(1024), *c = fresh(23);
    c[0] = -760.0;                                           /* EXP_FLOOR, then N / ln2 and the rest as drawn */
    c[1] = 1477.3197218702985;
    for (ptrdiff_t rows = 1; rows <= 9; rows += 4) {
        for (ptrdiff_t n = 1; n <= 140; n += 13) {             /* shorter and longer than a chunk of 64 */
            size_t m = (size_t)(rows * n);
            double *x0 = fresh(m), *x1 = fresh(m), *o0 = fresh(m), *o1 = fresh(m), *scratch = fresh(2 * (size_t)n);
            double *y0 = fresh(m), *y1 = fresh(m);
            double *m0 = fresh((size_t)rows), *m1 = fresh((size_t)rows), *b0 = fresh((size_t)rows);
            for (size_t i = 0; i < m; i++)
                x0[i] *= 4000.0;                               /* below the floor, above 710 */
            x0[0] = NAN;
            for (ptrdiff_t r = 0; r < rows; r++)
                b0[r] = 1.0 + fabs(b0[r]);
            sdpa_dd_exp_rows(x0, x1, m0, m1, rows, n, o0, o1, t0, t1, c);
            sdpa_dd_exp_rows(x0, x1, NULL, NULL, rows, n, o0, o1, t0, t1, c);
            sdpa_dd_div_rows(o0, o1, b0, m1, rows, n, x0, x1);
            sdpa_dd_mul_d_scalar(x0, x1, 0.125, (ptrdiff_t)m, o0, o1);
            sdpa_dd_rowsum(o0, o1, rows, n, m0, m1, scratch);
            sdpa_dd_softmax_vjp_rows(o0, o1, x0, x1, rows, n, y0, y1, scratch);
            calls += 6;
            free(x0); free(x1); free(o0); free(o1); free(y0); free(y1); free(scratch); free(m0); free(m1);
            free(b0);
        }
    }
    free(t0); free(t1); free(c);
    return calls;
}

/* the slicer, the end of a block and the dd accumulation */
static long drive_products(void)
{
    const ptrdiff_t ks[] = {1, 2, 3, 4, 5, 7, 8, 9, 33};
    long calls = 0;
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
        ptrdiff_t k = ks[ki];
        for (ptrdiff_t per = 1; per <= 19; per += 6) {
            for (int transposed = 0; transposed < 2; transposed++) {
                for (int n = 1; n <= 6; n++) {
                    for (int flags = 0; flags < 128; flags++) {  /* lo given, statistics, normalisation, */
                        int with_lo = flags & 1, stats = flags & 2, norm = flags & 4;   /* out in rows, */
                        int tout = (flags >> 3) & 3, part = (flags >> 5) & 1;  /* transposed or joined slices, */
                        if (tout == 3)                                          /* a range of rows, */
                            continue;
                        ptrdiff_t groups = (flags >> 6) & 1 ? 3 : 1, rows = per * groups;  /* several groups */
                        ptrdiff_t tps = tout == 1 ? rows * k : per, tgs = tout == 1 ? per * k : n * per * k;
                        ptrdiff_t tjs = tout == 0 ? 0 : tout == 1 ? per : n * per;
                        ptrdiff_t bs = per * k, rs = transposed ? 1 : k, cs = transposed ? per : 1;
                        ptrdiff_t first = part ? rows / 3 : 0, last = part ? rows - rows / 4 : rows;
                        double *hi = fresh((size_t)(rows * k)), *lo = with_lo ? fresh((size_t)(rows * k)) : NULL;
                        double *out = fresh((size_t)(n * rows * k));
                        double *rh = stats ? NULL : fresh((size_t)(rows * k)), *rl = stats ? NULL : fresh((size_t)(rows * k));
                        double *smax = stats ? fresh((size_t)(n * rows)) : NULL, *ssum = stats ? fresh((size_t)(n * rows)) : NULL;
                        double *rmax = stats ? fresh((size_t)rows) : NULL;
                        int *e = norm ? malloc((size_t)rows * sizeof *e) : NULL;
                        double *scratch = fresh((size_t)((2 + (tout ? n : 0)) * 8 * (k + 8)));
                        unsigned char *knz = tout ? calloc((size_t)(n * groups * k), 1) : NULL;
                        sdpa_slice_rows(hi, lo, rows, k, per, bs, rs, cs, n, 30, out, rh, rl, smax, ssum, rmax, e,
                                        scratch, first, last, tps, tgs, tjs, knz);
                        calls++;
                        free(hi); free(lo); free(out); free(rh); free(rl); free(smax); free(ssum); free(rmax);
                        free(e); free(scratch); free(knz);
                    }
                }
            }
        }
    }
    for (ptrdiff_t rows = 1; rows <= 9; rows += 4) {                  /* the dd sum, c a block of columns */
        for (ptrdiff_t n = 1; n <= 13; n += 3) {
            ptrdiff_t ldc = n + rows;
            double *h = fresh((size_t)(rows * n)), *l = fresh((size_t)(rows * n));
            double *c = fresh((size_t)((rows - 1) * ldc + n));
            sdpa_dd_add_d_rows(h, l, c, rows, n, ldc);
            calls++;
            free(h); free(l); free(c);
        }
    }
    for (ptrdiff_t nb = 1; nb <= 3; nb++) {
        for (ptrdiff_t rows = 1; rows <= 9; rows += 4) {
            for (ptrdiff_t n = 1; n <= 13; n += 3) {
                for (int flags = 0; flags < 4; flags++) {
                    size_t m = (size_t)(nb * rows * n);
                    double *h = fresh(m), *l = fresh(m), *o0 = fresh(m), *o1 = fresh(m);
                    int *ea = malloc((size_t)(nb * rows) * sizeof *ea), *eb = malloc((size_t)(nb * n) * sizeof *eb);
                    if (!ea || !eb)
                        exit(2);
                    for (ptrdiff_t i = 0; i < nb * rows; i++)
                        ea[i] = (int)(i % 7) - 3;
                    for (ptrdiff_t i = 0; i < nb * n; i++)
                        eb[i] = (int)(i % 5) - 2;
                    sdpa_dd_finish(h, l, nb, rows, n, flags & 1, (flags & 2) != 0, 0.125, ea, eb, o0, o1);
                    sdpa_dd_add_d(o0, o1, h, (ptrdiff_t)m);
                    calls += 2;
                    int t = 1 + flags;                           /* the level test: t slices' statistics */
                    double *ra = fresh((size_t)(nb * rows)), *rb = fresh((size_t)(nb * n));
                    double *st[4 * 4], *scratch = fresh((size_t)(3 * n));
                    const double *ma[4], *sa[4], *mb[4], *sb[4];
                    for (int p = 0; p < t; p++) {
                        ma[p] = st[4 * p] = fresh((size_t)(nb * rows));
                        sa[p] = st[4 * p + 1] = fresh((size_t)(nb * rows));
                        mb[p] = st[4 * p + 2] = fresh((size_t)(nb * n));
                        sb[p] = st[4 * p + 3] = fresh((size_t)(nb * n));
                    }
                    unsigned char *redo = malloc((size_t)(nb * rows));
                    if (!redo)
                        exit(2);
                    sdpa_level_redo(nb, rows, n, t, 1024.0, ra, rb, ma, mb, sa, sb, o0, redo, scratch);
                    calls++;
                    for (int p = 0; p < 4 * t; p++)
                        free(st[p]);
                    free(ra); free(rb); free(scratch); free(redo);
                    free(h); free(l); free(o0); free(o1); free(ea); free(eb);
                }
            }
        }
    }
    return calls;
}

int main(void)
{
    long calls = 0;
    int levels = 0;
    for (level = 0; level <= 2; level++) {                   /* each build the CPU runs: baseline, AVX2, AVX-512 */
        if (!cpu_runs(level))
            continue;
        calls += drive_products() + drive_rows();
        levels++;
    }
    printf("ok %ld calls on %d SIMD levels\n", calls, levels);
    return 0;
}
