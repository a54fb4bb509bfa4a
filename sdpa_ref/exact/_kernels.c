/* Element-wise kernels of the Ozaki products, the same IEEE-754 operations in the same order as the NumPy
 * code they replace (sdpa_ref/exact/ozaki.py, dd.py), so they give the same bits. Built by _native.py with
 * -ffp-contract=off and no fast-math: no FMA contraction, no reassociation. C99, libc and libm only. */
#include <math.h>
#include <stddef.h>

/* n slices of each row of (hi, lo) [rows x k, contiguous]; lo may be NULL (a float64 input). hi and lo are
 * overwritten by the remainder; slice p of row r goes to out[(p * rows + r) * k ...]. See ozaki._slices. */
void sdpa_slice_rows(double *hi, double *lo, double *out, ptrdiff_t rows, ptrdiff_t k, int n, int rho)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        double *h = hi + r * k;
        double *l = lo ? lo + r * k : NULL;
        for (int p = 0; p < n; p++) {
            double mx = 0.0;
            for (ptrdiff_t j = 0; j < k; j++) {
                double a = fabs(h[j]);
                if (a > mx)
                    mx = a;
            }
            int e;
            frexp(mx, &e);
            int ee = e + rho;
            if (ee < -1022)
                ee = -1022;
            double sigma = ldexp(1.0, ee);
            double *s = out + ((ptrdiff_t)p * rows + r) * k;
            if (l) {
                for (ptrdiff_t j = 0; j < k; j++) {
                    double sj = (h[j] + sigma) - sigma;
                    double a = h[j] - sj, b = l[j];          /* two_sum(hi - s, lo) */
                    double t = a + b;
                    double bb = t - a;
                    s[j] = sj;
                    h[j] = t;
                    l[j] = (a - (t - bb)) + (b - bb);
                }
            } else {
                for (ptrdiff_t j = 0; j < k; j++) {
                    double sj = (h[j] + sigma) - sigma;
                    s[j] = sj;
                    h[j] = h[j] - sj;
                }
            }
        }
    }
}

/* (hi, lo) = dd_add_d((hi, lo), c) in place: two_sum(hi, c), then fast_two_sum(s, e + lo). */
void sdpa_dd_add_d(double *hi, double *lo, const double *c, ptrdiff_t n)
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

#include <stdint.h>

static inline void k_two_sum(double a, double b, double *s, double *e)
{
    double t = a + b;
    double bb = t - a;
    *s = t;
    *e = (a - (t - bb)) + (b - bb);
}

static inline void k_fast_two_sum(double a, double b, double *s, double *e)
{
    double t = a + b;
    *s = t;
    *e = b - (t - a);
}

static inline void k_split(double a, double *hi, double *lo)
{
    double c = 134217729.0 * a;
    double h = c - (c - a);
    *hi = h;
    *lo = a - h;
}

static inline void k_two_prod(double a, double b, double *p, double *e)
{
    double ah, al, bh, bl;
    double t = a * b;
    k_split(a, &ah, &al);
    k_split(b, &bh, &bl);
    *p = t;
    *e = ((ah * bh - t) + ah * bl + al * bh) + al * bl;
}

static inline void k_dd_add(double a0, double a1, double b0, double b1, double *r0, double *r1)
{
    double s, e, t, f;
    k_two_sum(a0, b0, &s, &e);
    k_two_sum(a1, b1, &t, &f);
    k_fast_two_sum(s, e + t, &s, &e);
    k_fast_two_sum(s, e + f, r0, r1);
}

static inline void k_dd_mul(double a0, double a1, double b0, double b1, double *r0, double *r1)
{
    double p, e;
    k_two_prod(a0, b0, &p, &e);
    k_fast_two_sum(p, e + (a0 * b1 + a1 * b0), r0, r1);
}

static inline double k_pow2(int64_t n)
{
    union { uint64_t u; double d; } v;
    v.u = ((uint64_t)(n + 1023)) << 52;
    return v.d;
}

static inline int64_t k_floordiv2(int64_t a)
{
    return a >= 0 ? a / 2 : -((-a + 1) / 2);
}

/* c: [0] EXP_FLOOR, [1] N / ln2_hi, [2] C1, [3] C23 hi, [4] C23 lo, [5 + 2 m], [6 + 2 m]: 1/m! as dd, m = 0..8 */
void sdpa_dd_exp(const double *x0, const double *x1, double *o0, double *o1, ptrdiff_t n,
                 const double *t0, const double *t1, const double *c)
{
    const double floor_ = c[0], inv = c[1], c1 = c[2], c23h = c[3], c23l = c[4];
    const double *f = c + 5;
    for (ptrdiff_t i = 0; i < n; i++) {
        double xh = x0[i];
        if (isnan(xh) || xh == INFINITY) {                            /* NaN in NumPy too (inf - inf) */
            o0[i] = NAN;
            o1[i] = NAN;
            continue;
        }
        double inside = xh >= floor_ ? 1.0 : 0.0;
        double hi = xh < floor_ ? floor_ : xh;                        /* np.maximum */
        double lo = x1[i] * inside;
        double k = nearbyint(hi * inv);                               /* np.rint: half to even */
        double r0, r1, s, e, m0, m1, p, q;
        k_two_sum(hi, -(k * c1), &s, &e);                             /* dd_add_d((hi, lo), -(k C1)) */
        k_fast_two_sum(s, e + lo, &r0, &r1);
        k_two_prod(c23h, k, &p, &q);                                  /* dd_mul_d(C23, k) */
        k_fast_two_sum(p, q + c23l * k, &m0, &m1);
        k_dd_add(r0, r1, -m0, -m1, &r0, &r1);                         /* dd_sub */
        /* _exp_small(r) */
        double t = f[2 * 8];
        for (int m = 7; m > 3; m--)
            t = t * r0 + f[2 * m];
        double e0, e1;
        k_two_prod(r0, t, &p, &q);                                    /* dd_mul_d(r, t) */
        k_fast_two_sum(p, q + r1 * t, &e0, &e1);
        for (int m = 3; m > 0; m--) {
            double a0, a1;
            k_dd_add(f[2 * m], f[2 * m + 1], e0, e1, &a0, &a1);
            k_dd_mul(r0, r1, a0, a1, &e0, &e1);
        }
        k_two_sum(e0, 1.0, &s, &e);                                   /* dd_add_d(p, 1.0) */
        k_fast_two_sum(s, e + e1, &e0, &e1);
        int64_t ki = (int64_t)k;
        int64_t j = ki & 1023;
        double y0, y1;
        k_dd_mul(t0[j], t1[j], e0, e1, &y0, &y1);
        int64_t sh = (ki - j) >> 10;
        int64_t h1 = k_floordiv2(sh);
        double f1 = k_pow2(h1), f2 = k_pow2(sh - h1) * inside;
        o0[i] = y0 * f1 * f2;
        o1[i] = y1 * f1 * f2;
    }
}
