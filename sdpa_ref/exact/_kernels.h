/* The element-wise kernels of the exact arithmetic (ozaki.py, dd.py), the same IEEE-754 operations in the same
 * order as the NumPy code they replace, so they give the same bits.
 *
 * Included by _kernels.c once per build: KX_SFX (the names' suffix) and KX_ATTR (the functions' target attribute)
 * say which, as _fast_rows.h is by _fast_rows.c. A wider build only lets the compiler run more entries side by
 * side: every operation is an IEEE add, subtract, multiply, divide or compare on one entry, an integer operation
 * on its bits, or a maximum or an exact sum (whose order does not matter), and -ffp-contract=off forms no FMA,
 * so every build gives the bits of the scalar loops.
 */

#define KX_CAT_(a, b) a##_##b
#define KX_CAT(a, b) KX_CAT_(a, b)
#define KX(name) KX_CAT(name, KX_SFX)
#define KX_FN static KX_ATTR
#define KX_INLINE static inline __attribute__((always_inline)) KX_ATTR

/* The largest |x[j]|, 0 <= j < k: four running maxima (a maximum is exact in any order). */
KX_FN double KX(abs_max)(const double *x, ptrdiff_t k)
{
    double m0 = 0.0, m1 = 0.0, m2 = 0.0, m3 = 0.0;
    ptrdiff_t j = 0;
    for (; j + 4 <= k; j += 4) {
        double a0 = fabs(x[j]), a1 = fabs(x[j + 1]), a2 = fabs(x[j + 2]), a3 = fabs(x[j + 3]);
        m0 = a0 > m0 ? a0 : m0;
        m1 = a1 > m1 ? a1 : m1;
        m2 = a2 > m2 ? a2 : m2;
        m3 = a3 > m3 ? a3 : m3;
    }
    for (; j < k; j++) {
        double a = fabs(x[j]);
        m0 = a > m0 ? a : m0;
    }
    m0 = m1 > m0 ? m1 : m0;
    m2 = m3 > m2 ? m3 : m2;
    return m2 > m0 ? m2 : m0;
}

/* KX_W doubles side by side (GCC/Clang vector extensions: two on the baseline x86-64 build, four with AVX2, eight
 * with AVX-512). Only IEEE operations lane by lane, and maxima and exact sums, whose order does not matter: the
 * bits of the scalar loops. */
typedef double KX(sl_vd) __attribute__((vector_size(8 * KX_W)));
typedef long long KX(sl_vi) __attribute__((vector_size(8 * KX_W)));

KX_INLINE KX(sl_vd) KX(sl_splat)(double a)
{
    KX(sl_vd) v;
    for (int i = 0; i < KX_W; i++)
        v[i] = a;
    return v;
}

KX_INLINE KX(sl_vd) KX(sl_load)(const double *p) { KX(sl_vd) v; memcpy(&v, p, sizeof v); return v; }
KX_INLINE void KX(sl_store)(double *p, KX(sl_vd) v) { memcpy(p, &v, sizeof v); }

KX_INLINE KX(sl_vd) KX(sl_abs)(KX(sl_vd) a)
{
    KX(sl_vi) m;
    for (int i = 0; i < KX_W; i++)
        m[i] = INT64_MAX;
    return (KX(sl_vd))((KX(sl_vi))a & m);
}

/* a > m ? a : m lane by lane, as abs_max's scalar step (a NaN in a leaves m) */
KX_INLINE KX(sl_vd) KX(sl_max)(KX(sl_vd) a, KX(sl_vd) m)
{
    KX(sl_vi) k = a > m;
    return (KX(sl_vd))(((KX(sl_vi))a & k) | ((KX(sl_vi))m & ~k));
}

/* the largest lane (no lane is NaN: sl_max keeps them out), and the sum of the lanes (exact where it is used) */
KX_INLINE double KX(sl_hmax)(KX(sl_vd) m)
{
    double x = m[0];
    for (int i = 1; i < KX_W; i++)
        x = m[i] > x ? m[i] : x;
    return x;
}

KX_INLINE double KX(sl_hsum)(KX(sl_vd) m)
{
    double x = m[0];
    for (int i = 1; i < KX_W; i++)
        x += m[i];
    return x;
}

/* One slice of a row, as ozaki._slices_numpy: s = (h + sigma) - sigma, then (h, l) = two_sum(h - s, l) (or
 * h - s for a float64 row, l NULL), in place; returns max |h| of what is left, and the slice's max |s| and
 * exact sum of |s| in *smax, *ssum (the sum is exact: the entries lie on one grid with few bits). One pass. */
KX_INLINE KX(sl_vd) KX(slice_pair)(double *restrict h, double *restrict l, double *restrict s, KX(sl_vd) sg,
                                    KX(sl_vd) *mh, KX(sl_vd) *ms)
{
    KX(sl_vd) hj = KX(sl_load)(h);
    KX(sl_vd) sj = (hj + sg) - sg;
    KX(sl_vd) a = hj - sj;
    if (l) {
        KX(sl_vd) b = KX(sl_load)(l);
        KX(sl_vd) t = a + b;
        KX(sl_vd) bb = t - a;
        KX(sl_store)(l, (a - (t - bb)) + (b - bb));
        a = t;
    }
    KX(sl_store)(s, sj);
    KX(sl_store)(h, a);
    KX(sl_vd) as = KX(sl_abs)(sj);
    *mh = KX(sl_max)(KX(sl_abs)(a), *mh);
    *ms = KX(sl_max)(as, *ms);
    return as;
}

KX_FN double KX(slice_step)(double *restrict h, double *restrict l, double *restrict s, ptrdiff_t k, double sigma,
                            double *smax, double *ssum)
{
    const KX(sl_vd) sg = KX(sl_splat)(sigma);
    KX(sl_vd) mh0 = KX(sl_splat)(0.0), ms0 = mh0, ss0 = mh0, mh1 = mh0, ms1 = mh0, ss1 = mh0;   /* two chains each */
    ptrdiff_t j = 0;
    for (; j + 2 * KX_W <= k; j += 2 * KX_W) {
        ss0 = ss0 + KX(slice_pair)(h + j, l ? l + j : NULL, s + j, sg, &mh0, &ms0);
        ss1 = ss1 + KX(slice_pair)(h + j + KX_W, l ? l + j + KX_W : NULL, s + j + KX_W, sg, &mh1, &ms1);
    }
    KX(sl_vd) mh = KX(sl_max)(mh1, mh0), ms = KX(sl_max)(ms1, ms0), ss = ss0 + ss1;
    double mx = KX(sl_hmax)(mh), sm = KX(sl_hmax)(ms), su = KX(sl_hsum)(ss);
    for (; j < k; j++) {
        double sj = (h[j] + sigma) - sigma;
        double a = h[j] - sj;
        if (l) {
            double b = l[j];
            double t = a + b;
            double bb = t - a;
            l[j] = (a - (t - bb)) + (b - bb);
            a = t;
        }
        s[j] = sj;
        h[j] = a;
        double aa = fabs(a), as = fabs(sj);
        mx = aa > mx ? aa : mx;
        sm = as > sm ? as : sm;
        su += as;
    }
    *smax = sm;
    *ssum = su;
    return mx;
}

/* Rows gathered at once from a transposed layout (one cache line of each of their columns). */
#ifndef SLICE_GATHER
#define SLICE_GATHER 8
#endif
/* Doubles between the scratch's rows beyond k: rows a multiple of 4 KiB apart (k = 1024) share their cache sets,
 * which the transposed gather, writing SLICE_GATHER of them at once, thrashes (4x slower at k = 1024). */
#ifndef SLICE_PAD
#define SLICE_PAD 8
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
 * slice sum is exact, so its order does not matter.
 * Only the rows [first, last) are cut (every array is still indexed by the row's own number r, so calls on
 * disjoint ranges may run side by side). With tjs != 0 the slices are written transposed within each group of
 * per rows: entry j of slice p of row r goes to out[p * tps + (r / per) * tgs + j * tjs + r % per] (the columns
 * of B cut as rows, written as the C-contiguous (k, per) matrices a GEMM reads fastest: tps = rows k,
 * tgs = per k, tjs = per; or the n slices of a group side by side, (k, n per): tps = per, tgs = n per k,
 * tjs = n per). With knz (and tjs != 0), knz[(p * rows / per + r / per) * k + j] is set to 1 where entry j
 * of slice p of a row of that group is nonzero (the lines of B's slices a product must contract over; knz is
 * only ever set, so the caller clears it, and calls on ranges that share a group need knz of their own).
 * scratch: (2 + (tjs ? n : 0)) SLICE_GATHER (k + SLICE_PAD) doubles. The inputs are not written. */
KX_FN void KX(slice_rows)(const double *hi, const double *lo, ptrdiff_t rows, ptrdiff_t k, ptrdiff_t per, ptrdiff_t bs,
                     ptrdiff_t rs, ptrdiff_t cs, int n, int rho, double *out, double *rem_hi, double *rem_lo,
                     double *smax, double *ssum, double *rmax, int *eout, double *scratch, ptrdiff_t first,
                     ptrdiff_t last, ptrdiff_t tps, ptrdiff_t tgs, ptrdiff_t tjs, unsigned char *knz)
{
    const int tout = tjs != 0;
    const ptrdiff_t groups = per ? rows / per : 0;
    const ptrdiff_t pitch = k + SLICE_PAD;                   /* the scratch's rows: not a multiple of 4 KiB apart */
    double *H = scratch, *L = scratch + SLICE_GATHER * pitch, *T = scratch + 2 * SLICE_GATHER * pitch;
    for (ptrdiff_t r0 = first; r0 < last; r0 += SLICE_GATHER) {
        ptrdiff_t nr = last - r0 < SLICE_GATHER ? last - r0 : SLICE_GATHER;
        if (cs == 1) {                                       /* gather: contiguous rows, one by one */
            for (ptrdiff_t i = 0; i < nr; i++) {
                ptrdiff_t at = ((r0 + i) / per) * bs + ((r0 + i) % per) * rs;
                for (ptrdiff_t j = 0; j < k; j++) {
                    H[i * pitch + j] = hi[at + j];
                    L[i * pitch + j] = lo ? lo[at + j] : 0.0;
                }
            }
        } else {                                             /* a transposed block: across the rows, j by j */
            ptrdiff_t at[SLICE_GATHER];
            for (ptrdiff_t i = 0; i < nr; i++)
                at[i] = ((r0 + i) / per) * bs + ((r0 + i) % per) * rs;
            ptrdiff_t j0 = 0;
            for (; j0 + 8 <= k; j0 += 8) {                   /* 8 x nr tiles: each row's 8 entries stored */
                for (ptrdiff_t i = 0; i < nr; i++) {          /* together, the 8 lines read kept in cache */
                    double th[8], tl[8];
                    for (int jj = 0; jj < 8; jj++) {
                        th[jj] = hi[at[i] + (j0 + jj) * cs];
                        tl[jj] = lo ? lo[at[i] + (j0 + jj) * cs] : 0.0;
                    }
                    for (int jj = 0; jj < 8; jj++) {
                        H[i * pitch + j0 + jj] = th[jj];
                        L[i * pitch + j0 + jj] = tl[jj];
                    }
                }
            }
            for (ptrdiff_t j = j0; j < k; j++) {
                for (ptrdiff_t i = 0; i < nr; i++) {
                    H[i * pitch + j] = hi[at[i] + j * cs];
                    L[i * pitch + j] = lo ? lo[at[i] + j * cs] : 0.0;
                }
            }
        }
        for (ptrdiff_t i = 0; i < nr; i++) {
            ptrdiff_t r = r0 + i;
            double *restrict h = H + i * pitch, *restrict l = L + i * pitch;
            double mx = KX(abs_max)(h, k);                       /* max |hi| of what is left, kept as we cut */
            if (eout) {                                      /* ozaki._normalise: the row's max into [1/2, 1) */
                int e;
                frexp(mx, &e);
                eout[r] = e;
                if (e >= -1022 && e <= 1022) {
                    double f = ldexp(1.0, -e);               /* a power of two: exact products */
                    for (ptrdiff_t j = 0; j < k; j++) {
                        h[j] *= f;
                        l[j] *= f;
                    }
                    mx *= f;                                 /* the max scales exactly (it lands in [1/2, 1)), */
                } else {                                     /* and scaling is monotone: the new max */
                    for (ptrdiff_t j = 0; j < k; j++) {
                        h[j] = ldexp(h[j], -e);
                        l[j] = ldexp(l[j], -e);
                    }
                    mx = KX(abs_max)(h, k);
                }
            }
            for (int p = 0; p < n; p++) {
                int e;
                frexp(mx, &e);
                int ee = e + rho;
                if (ee < -1022)
                    ee = -1022;
                const double sigma = ldexp(1.0, ee);
                double *restrict s = tout ? T + ((ptrdiff_t)p * SLICE_GATHER + i) * pitch
                                          : out + ((ptrdiff_t)p * rows + r) * k;
                double sm, su;                               /* two_sum(hi - s, lo), or hi - s for a float64 row */
                mx = KX(slice_step)(h, lo ? l : NULL, s, k, sigma, &sm, &su);
                if (smax)
                    smax[(ptrdiff_t)p * rows + r] = sm;
                if (ssum)
                    ssum[(ptrdiff_t)p * rows + r] = su;
            }
            if (rem_hi) {
                for (ptrdiff_t j = 0; j < k; j++) {
                    rem_hi[r * k + j] = h[j];
                    rem_lo[r * k + j] = l[j];
                }
            }
            if (rmax)
                rmax[r] = KX(abs_max)(h, k) + KX(abs_max)(l, k);
        }
        if (tout) {                                          /* the tile's slices, transposed into place */
            for (int p = 0; p < n; p++) {
                const double *t = T + (ptrdiff_t)p * SLICE_GATHER * pitch;
                double *o = out + (ptrdiff_t)p * tps;
                if (r0 / per == (r0 + nr - 1) / per) {       /* one group: nr neighbours in each line of out */
                    double *d = o + (r0 / per) * tgs + r0 % per;
                    for (ptrdiff_t j = 0; j < k; j++)
                        for (ptrdiff_t i = 0; i < nr; i++)
                            d[j * tjs + i] = t[i * pitch + j];
                    if (knz) {
                        unsigned char *f = knz + ((ptrdiff_t)p * groups + r0 / per) * k;
                        for (ptrdiff_t j = 0; j < k; j++) {
                            int any = 0;
                            for (ptrdiff_t i = 0; i < nr; i++)
                                any |= t[i * pitch + j] != 0.0;
                            f[j] |= (unsigned char)any;
                        }
                    }
                } else {
                    for (ptrdiff_t i = 0; i < nr; i++) {
                        double *d = o + ((r0 + i) / per) * tgs + (r0 + i) % per;
                        for (ptrdiff_t j = 0; j < k; j++)
                            d[j * tjs] = t[i * pitch + j];
                        if (knz) {
                            unsigned char *f = knz + ((ptrdiff_t)p * groups + (r0 + i) / per) * k;
                            for (ptrdiff_t j = 0; j < k; j++)
                                f[j] |= (unsigned char)(t[i * pitch + j] != 0.0);
                        }
                    }
                }
            }
        }
    }
}

/* (hi, lo) = dd_add_d((hi, lo), c) in place: two_sum(hi, c), then fast_two_sum(s, e + lo). */
KX_FN void KX(dd_add_d)(double *hi, double *lo, const double *c, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        double a = hi[i], b = c[i];
        double s = a + b;
        double bb = s - a;
        double e = (a - (s - bb)) + (b - bb);
        double t = e + lo[i];
        double u = s + t;
        hi[i] = u;
        lo[i] = t - (u - s);
    }
}

/* ------------------------------------------------------------ dd.dd_exp, operation for operation */

KX_INLINE void KX(k_two_sum)(double a, double b, double *s, double *e)
{
    double t = a + b;
    double bb = t - a;
    *s = t;
    *e = (a - (t - bb)) + (b - bb);
}

KX_INLINE void KX(k_fast_two_sum)(double a, double b, double *s, double *e)
{
    double t = a + b;
    *s = t;
    *e = b - (t - a);
}

KX_INLINE void KX(k_split)(double a, double *hi, double *lo)
{
    double c = 134217729.0 * a;
    double h = c - (c - a);
    *hi = h;
    *lo = a - h;
}

KX_INLINE void KX(k_two_prod)(double a, double b, double *p, double *e)
{
    double ah, al, bh, bl;
    double t = a * b;
    KX(k_split)(a, &ah, &al);
    KX(k_split)(b, &bh, &bl);
    *p = t;
    *e = ((ah * bh - t) + ah * bl + al * bh) + al * bl;
}

KX_INLINE void KX(k_dd_add)(double a0, double a1, double b0, double b1, double *r0, double *r1)
{
    double s, e, t, f;
    KX(k_two_sum)(a0, b0, &s, &e);
    KX(k_two_sum)(a1, b1, &t, &f);
    KX(k_fast_two_sum)(s, e + t, &s, &e);
    KX(k_fast_two_sum)(s, e + f, r0, r1);
}

KX_INLINE void KX(k_dd_mul)(double a0, double a1, double b0, double b1, double *r0, double *r1)
{
    double p, e;
    KX(k_two_prod)(a0, b0, &p, &e);
    KX(k_fast_two_sum)(p, e + (a0 * b1 + a1 * b0), r0, r1);
}

KX_INLINE double KX(k_pow2)(int64_t n)
{
    union { uint64_t u; double d; } v;
    v.u = ((uint64_t)(n + 1023)) << 52;
    return v.d;
}

/* round to the nearest integer, ties to even, as np.rint (|y| < 2**51 here): the sum with 1.5 * 2**52 rounds */
KX_INLINE double KX(k_rint)(double y)
{
    double k = (y + 6755399441055744.0) - 6755399441055744.0;
    return copysign(k, y);                                            /* rint keeps the sign of a zero */
}

/* exp of x [rows x n] less the row's m (dd_exp(dd_sub(x, m))), or of x itself when m0 is NULL.
 * c: [0] EXP_FLOOR, [1] N / ln2_hi, [2] C1, [3] C23 hi, [4] C23 lo, [5 + 2 m], [6 + 2 m]: 1/m! as dd, m = 0..8.
 * The operations of dd._dd_exp_numpy, element by element, in three branch-free stages over chunks of entries, so that
 * the chains of neighbouring entries overlap (and the first two vectorise). */
#ifndef EXP_CHUNK
#define EXP_CHUNK 64
#endif
KX_FN void KX(dd_exp_rows)(const double *x0, const double *x1, const double *m0, const double *m1, ptrdiff_t rows,
                      ptrdiff_t n, double *o0, double *o1, const double *t0, const double *t1, const double *c)
{
    const double floor_ = c[0], inv = c[1], c1 = c[2], c23h = c[3], c23l = c[4];
    const double *f = c + 5;
    double K[EXP_CHUNK], R0[EXP_CHUNK], R1[EXP_CHUNK], IN[EXP_CHUNK], X0[EXP_CHUNK], X1[EXP_CHUNK];
    for (ptrdiff_t r = 0; r < rows; r++) {
        for (ptrdiff_t j0 = 0; j0 < n; j0 += EXP_CHUNK) {
            ptrdiff_t len = n - j0 < EXP_CHUNK ? n - j0 : EXP_CHUNK;
            const double *a0 = x0 + r * n + j0, *a1 = x1 + r * n + j0;
            if (m0) {                                                 /* the shift (a loop of its own: */
                const double s0 = -m0[r], s1 = -m1[r];                /* no branch in the loops below) */
                for (ptrdiff_t j = 0; j < len; j++)
                    KX(k_dd_add)(a0[j], a1[j], s0, s1, &X0[j], &X1[j]);
            } else {
                for (ptrdiff_t j = 0; j < len; j++) {
                    X0[j] = a0[j];
                    X1[j] = a1[j];
                }
            }
            for (ptrdiff_t j = 0; j < len; j++) {                     /* the range reduction */
                double u0 = X0[j], u1 = X1[j];
                double ok = (u0 == u0 && u0 < 710.0) ? u0 : 0.0;      /* NaN and overflow: fixed below */
                double inside = ok >= floor_ ? 1.0 : 0.0;
                double hi = ok < floor_ ? floor_ : ok;
                double lo = u1 * inside;
                double k = KX(k_rint)(hi * inv);
                double s, e, q0, q1, p, q, w0, w1;
                KX(k_two_sum)(hi, -(k * c1), &s, &e);
                KX(k_fast_two_sum)(s, e + lo, &q0, &q1);
                KX(k_two_prod)(c23h, k, &p, &q);
                KX(k_fast_two_sum)(p, q + c23l * k, &w0, &w1);
                KX(k_dd_add)(q0, q1, -w0, -w1, &R0[j], &R1[j]);
                K[j] = k;
                IN[j] = inside;
            }
            for (ptrdiff_t j = 0; j < len; j++) {                     /* _exp_small(r) */
                double r0 = R0[j], r1 = R1[j];
                double t = f[2 * 8];
                for (int m = 7; m > 3; m--)
                    t = t * r0 + f[2 * m];
                double e0, e1, p, q, s, e;
                KX(k_two_prod)(r0, t, &p, &q);
                KX(k_fast_two_sum)(p, q + r1 * t, &e0, &e1);
                for (int m = 3; m > 0; m--) {
                    double b0, b1;
                    KX(k_dd_add)(f[2 * m], f[2 * m + 1], e0, e1, &b0, &b1);
                    KX(k_dd_mul)(r0, r1, b0, b1, &e0, &e1);
                }
                KX(k_two_sum)(e0, 1.0, &s, &e);
                KX(k_fast_two_sum)(s, e + e1, &R0[j], &R1[j]);
            }
            for (ptrdiff_t j = 0; j < len; j++) {                     /* the table, the power of two */
                int64_t ki = (int64_t)K[j];
                int64_t jj = ki & 1023;
                double y0, y1;
                KX(k_dd_mul)(t0[jj], t1[jj], R0[j], R1[j], &y0, &y1);
                int64_t sh = (ki - jj) >> 10;
                int64_t h1 = sh >> 1;                                 /* floor(sh / 2): an arithmetic shift */
                double f1 = KX(k_pow2)(h1), f2 = KX(k_pow2)(sh - h1) * IN[j];
                R0[j] = y0 * f1 * f2;
                R1[j] = y1 * f1 * f2;
            }
            double *b0 = o0 + r * n + j0, *b1 = o1 + r * n + j0;
            for (ptrdiff_t j = 0; j < len; j++) {                     /* NaN and overflow, selected: their */
                double u = X0[j];                                     /* lanes ran on ok = 0 above */
                b0[j] = u != u ? NAN : u >= 710.0 ? INFINITY : R0[j];
                b1[j] = u != u ? NAN : u >= 710.0 ? 0.0 : R1[j];
            }
        }
    }
}

/* dd.dd_div(a, b) of a [rows x n] by the row's b */
KX_FN void KX(dd_div_rows)(const double *a0, const double *a1, const double *b0, const double *b1, ptrdiff_t rows,
                      ptrdiff_t n, double *o0, double *o1)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        double B0 = b0[r], B1 = b1[r];
        for (ptrdiff_t j = 0; j < n; j++) {
            ptrdiff_t i = r * n + j;
            double q1 = a0[i] / B0, p, e, m0, m1, r0, r1, q2, q3, s, t;
            KX(k_two_prod)(B0, q1, &p, &e);                                /* dd_mul_d(b, q1) */
            KX(k_fast_two_sum)(p, e + B1 * q1, &m0, &m1);
            KX(k_dd_add)(a0[i], a1[i], -m0, -m1, &r0, &r1);                /* dd_sub */
            q2 = r0 / B0;
            KX(k_two_prod)(B0, q2, &p, &e);
            KX(k_fast_two_sum)(p, e + B1 * q2, &m0, &m1);
            KX(k_dd_add)(r0, r1, -m0, -m1, &r0, &r1);
            q3 = r0 / B0;
            KX(k_fast_two_sum)(q1, q2, &q1, &q2);
            KX(k_two_sum)(q1, q3, &s, &t);                                 /* dd_add_d((q1, q2), q3) */
            KX(k_fast_two_sum)(s, t + q2, &o0[i], &o1[i]);
        }
    }
}

/* dd.dd_mul_d(a, b) for a scalar b */
KX_FN void KX(dd_mul_d_scalar)(const double *a0, const double *a1, double b, ptrdiff_t n, double *o0, double *o1)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        double p, e;
        KX(k_two_prod)(a0[i], b, &p, &e);
        KX(k_fast_two_sum)(p, e + a1[i] * b, &o0[i], &o1[i]);
    }
}

/* ------------------------------------------------------------ dd.dd_sum along a row, the same tree */

/* The pairwise tree of dd_sum over x (hi, lo) [n], in place in the scratch (sh, sl): level by level the first
 * half is added to the second half, an odd last entry waiting for the next level. */
KX_FN void KX(k_tree)(double *sh, double *sl, ptrdiff_t n, double *r0, double *r1)
{
    if (n == 0) {
        *r0 = 0.0;
        *r1 = 0.0;
        return;
    }
    while (n > 1) {
        ptrdiff_t h = n / 2;
        for (ptrdiff_t i = 0; i < h; i++)
            KX(k_dd_add)(sh[i], sl[i], sh[h + i], sl[h + i], &sh[i], &sl[i]);
        if (n % 2) {
            sh[h] = sh[n - 1];
            sl[h] = sl[n - 1];
        }
        n = h + n % 2;
    }
    *r0 = sh[0];
    *r1 = sl[0];
}

KX_FN void KX(dd_rowsum)(const double *hi, const double *lo, ptrdiff_t rows, ptrdiff_t n, double *o0, double *o1,
                    double *scratch)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        for (ptrdiff_t j = 0; j < n; j++) {
            scratch[j] = hi[r * n + j];
            scratch[n + j] = lo[r * n + j];
        }
        KX(k_tree)(scratch, scratch + n, n, &o0[r], &o1[r]);
    }
}

/* reproducible._softmax_vjp on rows of dd P and g [rows x n]: c = g at the first largest P.hi (NumPy's argmax:
 * the first NaN if any), gc = g - c, out = P * (gc - tree_sum(P * gc)). scratch: 2 n doubles. */
KX_FN void KX(dd_softmax_vjp_rows)(const double *p0, const double *p1, const double *g0, const double *g1,
                              ptrdiff_t rows, ptrdiff_t n, double *o0, double *o1, double *scratch)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        const double *restrict P0 = p0 + r * n, *restrict P1 = p1 + r * n, *restrict G0 = g0 + r * n,
                     *restrict G1 = g1 + r * n;
        double *restrict O0 = o0 + r * n, *restrict O1 = o1 + r * n;   /* apart from each other and the inputs: */
        double *restrict S0 = scratch, *restrict S1 = scratch + n;      /* the loops below vectorise */
        if (n == 0)
            continue;
        ptrdiff_t idx = 0;
        double best = P0[0];
        if (!isnan(best)) {
            for (ptrdiff_t j = 1; j < n; j++) {
                if (isnan(P0[j])) {
                    idx = j;
                    break;
                }
                if (P0[j] > best) {
                    best = P0[j];
                    idx = j;
                }
            }
        }
        double c0 = -G0[idx], c1 = -G1[idx];
        for (ptrdiff_t j = 0; j < n; j++)                              /* gc = g - c, kept in the output */
            KX(k_dd_add)(G0[j], G1[j], c0, c1, &O0[j], &O1[j]);        /* for now */
        for (ptrdiff_t j = 0; j < n; j++)                              /* P gc */
            KX(k_dd_mul)(P0[j], P1[j], O0[j], O1[j], &S0[j], &S1[j]);
        double s0, s1;
        KX(k_tree)(S0, S1, n, &s0, &s1);
        for (ptrdiff_t j = 0; j < n; j++) {
            double a0, a1;
            KX(k_dd_add)(O0[j], O1[j], -s0, -s1, &a0, &a1);               /* gc - s */
            KX(k_dd_mul)(P0[j], P1[j], a0, a1, &O0[j], &O1[j]);
        }
    }
}

/* ------------------------------------------------------------ ozaki.matmul's last steps, in one pass */

/* The end of a block of an exact product: the dd sum (hi, lo) [nb x rows x n] of its levels, normalised
 * (fast_two_sum, when norm is set), times the float scale (dd.dd_mul_d, when has_scale is set), then times
 * 2**(ea[i, r] + eb[i, j]) (the rows' and columns' scalings put back, ozaki.matmul: pow2(ea) * pow2(eb), a power
 * of two, the caller has checked that every exponent and every sum of two lies in [-1022, 1023]), written to
 * (o0, o1) [nb x rows x n, contiguous]. The operations of the NumPy steps it replaces, in their order. */
KX_FN void KX(dd_finish)(const double *hi, const double *lo, ptrdiff_t nb, ptrdiff_t rows, ptrdiff_t n, int norm,
                    int has_scale, double scale, const int *ea, const int *eb, double *o0, double *o1)
{
    for (ptrdiff_t i = 0; i < nb; i++) {
        const int *ec = eb + i * n;
        for (ptrdiff_t r = 0; r < rows; r++) {
            ptrdiff_t at = (i * rows + r) * n;
            double fa = KX(k_pow2)(ea[i * rows + r]);
            for (ptrdiff_t j = 0; j < n; j++) {
                double s = hi[at + j], e = lo[at + j];
                if (norm)
                    KX(k_fast_two_sum)(s, e, &s, &e);
                if (has_scale) {
                    double p, q;
                    KX(k_two_prod)(s, scale, &p, &q);
                    KX(k_fast_two_sum)(p, q + e * scale, &s, &e);
                }
                double f = fa * KX(k_pow2)(ec[j]);
                o0[at + j] = s * f;
                o1[at + j] = e * f;
            }
        }
    }
}

/* ozaki._level_bound and the test matmul(final=True) makes of it, entry by entry in the same IEEE operations and
 * order (NumPy's, left to right), so that every row takes the same decision: redo[i, r] = 1 where some column j
 * of the block has !(bound <= 2**-55 |h|), with
 *   bound = (((SA rb + (K ra)(MB + rb)) + 2**-100 min(SA MB, MA SB)) + ((2**-100 K)(ra + MA))(rb + MB)
 *           + sum over p, q < t with p + q >= t (p outer) of min(sa_p mb_q, ma_p sb_q)) (1 + 2**-20)
 * and SA = 0 + sa_0 + ... + sa_{t-1} (Python's sum), the same for SB, MA, MB; min as np.minimum (a NaN wins).
 * ra [nb x rows] and t arrays sa[p], ma[p] [nb x rows] per row; rb and t arrays sb[q], mb[q] [nb x n] per column;
 * h [nb x rows x n].
 * scratch: 3 n doubles. */
KX_INLINE double KX(lb_min)(double a, double b)
{
    return (a < b || a != a) ? a : b;
}

KX_FN void KX(level_redo)(ptrdiff_t nb, ptrdiff_t rows, ptrdiff_t n, int t, double K, const double *ra,
                          const double *rb, const double *const *ma, const double *const *mb, const double *const *sa,
                          const double *const *sb, const double *h, unsigned char *redo, double *scratch)
{
    const double tiny = 0x1p-100, tk = 0x1p-100 * K, grow = 1.0 + 0x1p-20, half = 0x1p-55;
    double *restrict SBc = scratch, *restrict MBc = scratch + n, *restrict left = scratch + 2 * n;
    for (ptrdiff_t i = 0; i < nb; i++) {
        const double *restrict RB = rb + i * n;
        for (ptrdiff_t j = 0; j < n; j++)
            SBc[j] = MBc[j] = 0.0;
        for (int q = 0; q < t; q++) {                        /* Python's sum: 0 + x_0 + x_1 + ... */
            const double *restrict sq = sb[q] + i * n, *restrict mq = mb[q] + i * n;
            for (ptrdiff_t j = 0; j < n; j++) {
                SBc[j] = SBc[j] + sq[j];
                MBc[j] = MBc[j] + mq[j];
            }
        }
        for (ptrdiff_t r = 0; r < rows; r++) {
            ptrdiff_t ir = i * rows + r;
            double RA = ra[ir], SA = 0.0, MA = 0.0;
            for (int p = 0; p < t; p++) {
                SA = SA + sa[p][ir];
                MA = MA + ma[p][ir];
            }
            const double KRA = K * RA, TRA = tk * (RA + MA);
            for (ptrdiff_t j = 0; j < n; j++) {
                double l = SA * RB[j] + KRA * (MBc[j] + RB[j]);
                l = l + tiny * KX(lb_min)(SA * MBc[j], MA * SBc[j]);
                left[j] = l + TRA * (RB[j] + MBc[j]);
            }
            for (int p = 0; p < t; p++) {
                const double sp = sa[p][ir], mp = ma[p][ir];
                for (int q = t - p; q < t; q++) {            /* the pairs p + q >= t, p outer, q inner */
                    const double *restrict sq = sb[q] + i * n, *restrict mq = mb[q] + i * n;
                    for (ptrdiff_t j = 0; j < n; j++)
                        left[j] = left[j] + KX(lb_min)(sp * mq[j], mp * sq[j]);
                }
            }
            const double *restrict hr = h + ir * n;
            unsigned char bad = 0;
            for (ptrdiff_t j = 0; j < n; j++)
                bad |= !(left[j] * grow <= half * fabs(hr[j]));
            redo[ir] = bad;
        }
    }
}

#undef KX_CAT_
#undef KX_CAT
#undef KX
#undef KX_FN
#undef KX_INLINE
