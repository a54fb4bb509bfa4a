/* The fast path's row passes (engines/fast.py), fused: one call runs a block of rows, each row in cache.
 *
 * Included by _fast_rows.c once per build: FX_W (doubles per vector), FX_SFX (the names' suffix) and FX_ATTR (the
 * functions' target attribute) say which. Every build works on eight lanes, as 8 / FX_W vectors: lane l is
 * element l of every block of eight entries. Every operation is an IEEE add, subtract, multiply, divide or
 * compare on a lane, or an integer operation on its bits, and the eight lanes' sums meet in one fixed tree, so
 * every build gives the same bits (-ffp-contract=off: no FMA is formed, and no build enables it).
 */

#define FX_CAT_(a, b) a##_##b
#define FX_CAT(a, b) FX_CAT_(a, b)
#define FX(name) FX_CAT(name, FX_SFX)
#define FX_INLINE static inline __attribute__((always_inline)) FX_ATTR

typedef double FX(vd) __attribute__((vector_size(8 * FX_W)));
typedef long long FX(vi) __attribute__((vector_size(8 * FX_W)));
typedef unsigned long long FX(vu) __attribute__((vector_size(8 * FX_W)));

FX_INLINE FX(vd) FX(splat)(double a)
{
    FX(vd) v;
    for (int i = 0; i < FX_W; i++)
        v[i] = a;
    return v;
}

FX_INLINE FX(vd) FX(sel)(FX(vi) mask, FX(vd) a, FX(vd) b) { return (FX(vd))(((FX(vi))a & mask) | ((FX(vi))b & ~mask)); }
/* a > b ? a : b lane by lane (NaN in a gives b; NaN in b gives b; equal zeros give b): exactly x86's MAXPD, one
 * instruction there (a compare and a blend otherwise, which on AVX-512 makes a longer chain) */
#if defined(__x86_64__) && FX_W == 8
FX_INLINE FX(vd) FX(vmax)(FX(vd) a, FX(vd) b) { return (FX(vd))_mm512_max_pd((__m512d)a, (__m512d)b); }
#elif defined(__x86_64__) && FX_W == 4
FX_INLINE FX(vd) FX(vmax)(FX(vd) a, FX(vd) b) { return (FX(vd))_mm256_max_pd((__m256d)a, (__m256d)b); }
#elif defined(__x86_64__) && FX_W == 2
FX_INLINE FX(vd) FX(vmax)(FX(vd) a, FX(vd) b) { return (FX(vd))_mm_max_pd((__m128d)a, (__m128d)b); }
#else
FX_INLINE FX(vd) FX(vmax)(FX(vd) a, FX(vd) b) { return FX(sel)((FX(vi))(a > b), a, b); }
#endif
/* a < b ? a : b lane by lane: exactly x86's MINPD (and MINPS below); with MAXPD, the exp's clamp to
 * [floor, 710] in two instructions, where a compare and a select each took four */
#if defined(__x86_64__) && FX_W == 8
FX_INLINE FX(vd) FX(vmin)(FX(vd) a, FX(vd) b) { return (FX(vd))_mm512_min_pd((__m512d)a, (__m512d)b); }
#elif defined(__x86_64__) && FX_W == 4
FX_INLINE FX(vd) FX(vmin)(FX(vd) a, FX(vd) b) { return (FX(vd))_mm256_min_pd((__m256d)a, (__m256d)b); }
#elif defined(__x86_64__) && FX_W == 2
FX_INLINE FX(vd) FX(vmin)(FX(vd) a, FX(vd) b) { return (FX(vd))_mm_min_pd((__m128d)a, (__m128d)b); }
#else
FX_INLINE FX(vd) FX(vmin)(FX(vd) a, FX(vd) b) { return FX(sel)((FX(vi))(a < b), a, b); }
#endif
FX_INLINE FX(vd) FX(load)(const double *p) { FX(vd) v; memcpy(&v, p, sizeof v); return v; }
FX_INLINE void FX(store)(double *p, FX(vd) v) { memcpy(p, &v, sizeof v); }

/* exp(x) lane by lane, within 1 ulp (tests/test_engines_fast.py measures it against the double-double exp):
 * x = k ln2 + r with k = rint(x / ln2) (the sum with 1.5 * 2**52 rounds it, and its low bits are k) and
 * |r| <= ln2/2 + tiny, by Cody and Waite (LN2_HI has 32 bits, so k * LN2_HI is exact for |k| < 2**21);
 * exp(r) = 1 + (r + r^2 q(r)), q the Taylor series of (exp(r) - 1 - r) / r^2 to degree 11 (truncation below
 * 2**-57, 1/i! correctly rounded); 2**k in two exact halves, so that subnormal results round once. NaN gives
 * NaN, -inf and x < -760 give 0, x >= 710 gives inf. */
FX_INLINE FX(vd) FX(exp)(FX(vd) x)
{
    const double LN2_HI = 0x1.62e42feep-1, LN2_LO = 0x1.a39ef35793c76p-33, SHIFT = 0x1.8p52;
    FX(vi) nan = x != x;
    FX(vi) inside = x >= FX(splat)(FX_EXP_FLOOR);                      /* false for NaN */
    FX(vd) h = FX(vmin)(FX(vmax)(x, FX(splat)(FX_EXP_FLOOR)), FX(splat)(710.0));   /* NaN gives the floor */
    FX(vd) ks = h * FX(splat)(0x1.71547652b82fep0) + FX(splat)(SHIFT);  /* x / ln2, rounded to an integer */
    FX(vi) k = (FX(vi))ks - (FX(vi))FX(splat)(SHIFT);
    FX(vd) kd = ks - FX(splat)(SHIFT);
    FX(vd) r = (h - kd * FX(splat)(LN2_HI)) - kd * FX(splat)(LN2_LO);
    /* q(r) = sum_{i=2..13} r^(i-2) / i! by Estrin's scheme: short dependency chains, so that the lanes of
     * neighbouring vectors overlap in the pipeline (Horner's twelve steps would wait on one another) */
    FX(vd) r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
    FX(vd) a0 = FX(splat)(1.0 / 2.0) + r * FX(splat)(1.0 / 6.0);
    FX(vd) a1 = FX(splat)(1.0 / 24.0) + r * FX(splat)(1.0 / 120.0);
    FX(vd) a2 = FX(splat)(1.0 / 720.0) + r * FX(splat)(1.0 / 5040.0);
    FX(vd) a3 = FX(splat)(1.0 / 40320.0) + r * FX(splat)(1.0 / 362880.0);
    FX(vd) a4 = FX(splat)(1.0 / 3628800.0) + r * FX(splat)(1.0 / 39916800.0);
    FX(vd) a5 = FX(splat)(1.0 / 479001600.0) + r * FX(splat)(1.0 / 6227020800.0);
    FX(vd) q = ((a0 + r2 * a1) + r4 * (a2 + r2 * a3)) + r8 * (a4 + r2 * a5);
    FX(vd) p = FX(splat)(1.0) + (r + r2 * q);
    /* k = h1 + h2, h1 = floor(k / 2) by a logical shift of k + 4096 (k > -1200) */
    FX(vi) h1 = (FX(vi))((FX(vu))(k + 4096) >> 1) - 2048, h2 = k - h1;
    FX(vd) s1 = (FX(vd))((h1 + 1023) << 52), s2 = (FX(vd))((h2 + 1023) << 52);
    FX(vd) e = (p * s1) * s2;
    e = (FX(vd))((FX(vi))e & inside);
    return FX(sel)(nan, x, e);
}

/* float32 vectors of the same width (twice the lanes, at most eight), their masks, and exp in float32 */
#define FX_WF (2 * FX_W > 8 ? 8 : 2 * FX_W)             /* at most the eight lanes (AVX-512: half a register) */
typedef float FX(vf) __attribute__((vector_size(4 * FX_WF)));
typedef int FX(vw) __attribute__((vector_size(4 * FX_WF)));
typedef unsigned FX(vwu) __attribute__((vector_size(4 * FX_WF)));

FX_INLINE FX(vf) FX(splatf)(float a)
{
    FX(vf) v;
    for (int i = 0; i < FX_WF; i++)
        v[i] = a;
    return v;
}

FX_INLINE FX(vf) FX(self)(FX(vw) mask, FX(vf) a, FX(vf) b)
{
    return (FX(vf))(((FX(vw))a & mask) | ((FX(vw))b & ~mask));
}
#if defined(__x86_64__) && FX_WF == 8
FX_INLINE FX(vf) FX(vmaxf)(FX(vf) a, FX(vf) b) { return (FX(vf))_mm256_max_ps((__m256)a, (__m256)b); }
#elif defined(__x86_64__) && FX_WF == 4
FX_INLINE FX(vf) FX(vmaxf)(FX(vf) a, FX(vf) b) { return (FX(vf))_mm_max_ps((__m128)a, (__m128)b); }
#else
FX_INLINE FX(vf) FX(vmaxf)(FX(vf) a, FX(vf) b) { return FX(self)((FX(vw))(a > b), a, b); }
#endif
#if defined(__x86_64__) && FX_WF == 8
FX_INLINE FX(vf) FX(vminf)(FX(vf) a, FX(vf) b) { return (FX(vf))_mm256_min_ps((__m256)a, (__m256)b); }
#elif defined(__x86_64__) && FX_WF == 4
FX_INLINE FX(vf) FX(vminf)(FX(vf) a, FX(vf) b) { return (FX(vf))_mm_min_ps((__m128)a, (__m128)b); }
#else
FX_INLINE FX(vf) FX(vminf)(FX(vf) a, FX(vf) b) { return FX(self)((FX(vw))(a < b), a, b); }
#endif
FX_INLINE FX(vf) FX(loadf)(const float *p) { FX(vf) v; memcpy(&v, p, sizeof v); return v; }
FX_INLINE void FX(storef)(float *p, FX(vf) v) { memcpy(p, &v, sizeof v); }

/* exp(x) in float32, lane by lane, within 1 ulp of float (tests/test_engines_fast.py): FX(exp)'s method with float
 * constants: Cody and Waite with LN2_HI of 15 bits (k * LN2_HI exact for |k| < 2**9), q to degree 5 (truncation
 * below 2**-27). NaN gives NaN, -inf and x < -104 give 0, x >= 89 gives inf. */
FX_INLINE FX(vf) FX(expf)(FX(vf) x)
{
    const float LN2_HI = 0x1.62e4p-1f, LN2_LO = 0x1.7f7d1cp-20f, SHIFT = 0x1.8p23f;
    FX(vw) nan = x != x;
    FX(vw) inside = x >= FX(splatf)(-104.0f);
    FX(vf) h = FX(vminf)(FX(vmaxf)(x, FX(splatf)(-104.0f)), FX(splatf)(89.0f));   /* NaN gives the floor */
    FX(vf) ks = h * FX(splatf)(0x1.715476p0f) + FX(splatf)(SHIFT);
    FX(vw) k = (FX(vw))ks - (FX(vw))FX(splatf)(SHIFT);
    FX(vf) kd = ks - FX(splatf)(SHIFT);
    FX(vf) r = (h - kd * FX(splatf)(LN2_HI)) - kd * FX(splatf)(LN2_LO);
    FX(vf) r2 = r * r;
    FX(vf) a0 = FX(splatf)(1.0f / 2.0f) + r * FX(splatf)(1.0f / 6.0f);
    FX(vf) a1 = FX(splatf)(1.0f / 24.0f) + r * FX(splatf)(1.0f / 120.0f);
    FX(vf) a2 = FX(splatf)(1.0f / 720.0f) + r * FX(splatf)(1.0f / 5040.0f);
    FX(vf) q = a0 + r2 * (a1 + r2 * a2);
    FX(vf) p = FX(splatf)(1.0f) + (r + r2 * q);
    FX(vw) h1 = (FX(vw))((FX(vwu))(k + 4096) >> 1) - 2048, h2 = k - h1;
    FX(vf) s1 = (FX(vf))((h1 + 127) << 23), s2 = (FX(vf))((h2 + 127) << 23);
    FX(vf) e = (p * s1) * s2;
    e = (FX(vf))((FX(vw))e & inside);
    return FX(self)(nan, x, e);
}

/* The kernels, once for float64 (T double, V FX(vd), LW = FX_W lanes) and once for float32 (float, FX(vf),
 * FX_WF lanes; everything in float32 but the log). A block of eight entries is 8 / LW vectors; lane l of a
 * block is element l % LW of its vector l / LW; the eight lanes' sums meet as ((0 + 1) + (2 + 3)) + ((4 + 5) +
 * (6 + 7)). A row's last, short block is padded (with -inf before exp: its exp is 0; with 0 in the VJP's sum),
 * so that the lanes hold the same entries in every build. */
#define FX_SUM8(acc, LW) ((((acc)[0 / LW][0 % LW] + (acc)[1 / LW][1 % LW])                                             \
                           + ((acc)[2 / LW][2 % LW] + (acc)[3 / LW][3 % LW]))                                          \
                          + (((acc)[4 / LW][4 % LW] + (acc)[5 / LW][5 % LW])                                           \
                             + ((acc)[6 / LW][6 % LW] + (acc)[7 / LW][7 % LW])))

#define FX_ROW_KERNELS(TS, T, LW, V, M, LD, ST, SPLAT, SEL, EXP, VMAX)                                                       \
                                                                                                                       \
/* the largest of x[0:n] (NaN skipped; -inf for a row of -inf or none): x[j] > m ? x[j] : m in eight lanes,            \
 * the rest in order, then the lanes; *nan_out (when given) says whether a NaN was seen, in the same pass            \
 * (normalize.row_stats: a NaN score makes the row NaN, it must not be lost by the skipping max) */                 \
FX_INLINE T FX(rowmax##TS)(const T *x, ptrdiff_t n, int *nan_out)                                                       \
{                                                                                                                      \
    V m[(8 / LW)], seen[(8 / LW)];                                                                                     \
    for (int u = 0; u < (8 / LW); u++) {                                                                               \
        m[u] = SPLAT(-INFINITY);                                                                                       \
        seen[u] = SPLAT(0);                                                                                            \
    }                                                                                                                  \
    ptrdiff_t j = 0;                                                                                                   \
    if (nan_out)                                                                                                       \
        for (; j + 8 <= n; j += 8)                                                                                     \
            for (int u = 0; u < (8 / LW); u++) {                                                                       \
                V a = LD(x + j + u * LW);                                                                              \
                m[u] = VMAX(a, m[u]);                                                                                  \
                seen[u] = (V)((M)seen[u] | (M)(a != a));                                                               \
            }                                                                                                          \
    else                                                                                                               \
        for (; j + 8 <= n; j += 8)                                                                                     \
            for (int u = 0; u < (8 / LW); u++) {                                                                       \
                m[u] = VMAX(LD(x + j + u * LW), m[u]);                                                                 \
            }                                                                                                          \
    T r = -INFINITY;                                                                                                   \
    int nan = 0;                                                                                                       \
    for (; j < n; j++) {                                                                                               \
        r = x[j] > r ? x[j] : r;                                                                                       \
        nan |= x[j] != x[j];                                                                                           \
    }                                                                                                                  \
    for (int l = 0; l < 8; l++) {                                                                                      \
        r = m[l / LW][l % LW] > r ? m[l / LW][l % LW] : r;                                                             \
        nan |= ((M)seen[l / LW])[l % LW] != 0;                                                                         \
    }                                                                                                                  \
    if (nan_out)                                                                                                       \
        *nan_out = nan;                                                                                                \
    return r;                                                                                                          \
}                                                                                                                      \
                                                                                                                       \
/* softmax of each row of t [rows x n, rows ld apart] in place, with its max m, sum s and lse = m + log(s) per row,   \
 * empty = (every score is -inf): m is 0 there, s 0 and P 0/0 (NaN: the engine fills such rows). A row with a NaN    \
 * or +inf score is NaN (normalize.row_stats): P NaN where the score is not -inf and 0 where it is, s and lse NaN,  \
 * m the largest non-NaN score (0 where that is not finite), not empty */                                            \
FX_INLINE void FX(softmax_rows##TS)(T *t, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ld, T *m_out, T *s_out, T *lse_out,   \
                                    unsigned char *empty_out)                                                          \
{                                                                                                                      \
    for (ptrdiff_t r = 0; r < rows; r++) {                                                                             \
        T *x = t + r * ld;                                                                                             \
        int nan;                                                                                                       \
        T m = FX(rowmax##TS)(x, n, &nan);                                                                              \
        if (nan || m == INFINITY) {                                                                                    \
            for (ptrdiff_t j = 0; j < n; j++)                                                                          \
                x[j] = x[j] == -INFINITY ? (T)0 : (T)NAN;                                                              \
            m_out[r] = m == -INFINITY || m == INFINITY ? (T)0 : m;                                                     \
            s_out[r] = lse_out[r] = (T)NAN;                                                                            \
            empty_out[r] = 0;                                                                                          \
            continue;                                                                                                  \
        }                                                                                                              \
        unsigned char empty = m == -INFINITY;                                                                          \
        if (empty) m = 0;                                                                                              \
        V acc[(8 / LW)], mv = SPLAT(m);                                                                                \
        for (int u = 0; u < (8 / LW); u++)                                                                             \
            acc[u] = SPLAT(0);                                                                                         \
        ptrdiff_t j = 0;                                                                                               \
        for (; j + 8 <= n; j += 8)                                                                                     \
            for (int u = 0; u < (8 / LW); u++) {                                                                       \
                V e = EXP(LD(x + j + u * LW) - mv);                                                                    \
                ST(x + j + u * LW, e);                                                                                 \
                acc[u] += e;                                                                                           \
            }                                                                                                          \
        if (j < n) {                                                                                                   \
            T b[8];                                                                                                    \
            for (int l = 0; l < 8; l++)                                                                                \
                b[l] = j + l < n ? x[j + l] : (T)-INFINITY;                                                            \
            for (int u = 0; u < (8 / LW); u++) {                                                                       \
                V e = EXP(LD(b + u * LW) - mv);                                                                        \
                ST(b + u * LW, e);                                                                                     \
                acc[u] += e;                                                                                           \
            }                                                                                                          \
            for (int l = 0; j + l < n; l++)                                                                            \
                x[j + l] = b[l];                                                                                       \
        }                                                                                                              \
        T s = FX_SUM8(acc, LW);                                                                                        \
        V sv = SPLAT(s);                                                                                               \
        for (j = 0; j + LW <= n; j += LW)                                                                              \
            ST(x + j, LD(x + j) / sv);                                                                                 \
        for (; j < n; j++)                                                                                             \
            x[j] = x[j] / s;                                                                                           \
        m_out[r] = m;                                                                                                  \
        s_out[r] = s;                                                                                                  \
        lse_out[r] = (T)(log((double)s) + (double)m);                                                                  \
        empty_out[r] = empty;                                                                                          \
    }                                                                                                                  \
}                                                                                                                      \
                                                                                                                       \
/* the softmax VJP of each row in place, pivoted (softmax.row_pivot): d <- p * ((d - c) - sum(p * (d - c))),           \
 * c = d at the row's first largest p (NaN is never the largest; a NaN in p makes the row NaN whatever c is) */        \
FX_INLINE void FX(softmax_vjp_rows##TS)(T *d, const T *p, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ldd, ptrdiff_t ldp)  \
{                                                                                                                      \
    for (ptrdiff_t r = 0; r < rows; r++) {                                                                             \
        T *g = d + r * ldd;                                                                                            \
        const T *q = p + r * ldp;                                                                                      \
        T top = FX(rowmax##TS)(q, n, NULL);                                                                            \
        ptrdiff_t at = 0;                                                                                              \
        while (at < n && !(q[at] == top))                                                                              \
            at++;                                                                                                      \
        T c = at < n ? g[at] : (T)0;                                                                                   \
        V acc[(8 / LW)], cv = SPLAT(c);                                                                                \
        for (int u = 0; u < (8 / LW); u++)                                                                             \
            acc[u] = SPLAT(0);                                                                                         \
        ptrdiff_t j = 0;                                                                                               \
        for (; j + 8 <= n; j += 8)                                                                                     \
            for (int u = 0; u < (8 / LW); u++) {                                                                       \
                V v = LD(g + j + u * LW) - cv;                                                                         \
                ST(g + j + u * LW, v);                                                                                 \
                acc[u] += LD(q + j + u * LW) * v;                                                                      \
            }                                                                                                          \
        if (j < n) {                                                                                                   \
            T bg[8], bq[8];                                                                                            \
            for (int l = 0; l < 8; l++) {                                                                              \
                bg[l] = j + l < n ? g[j + l] - c : (T)0;                                                               \
                bq[l] = j + l < n ? q[j + l] : (T)0;                                                                   \
            }                                                                                                          \
            for (int u = 0; u < (8 / LW); u++)                                                                         \
                acc[u] += LD(bq + u * LW) * LD(bg + u * LW);                                                           \
            for (int l = 0; j + l < n; l++)                                                                            \
                g[j + l] = bg[l];                                                                                      \
        }                                                                                                              \
        T D = FX_SUM8(acc, LW);                                                                                        \
        if (D != D) {                   /* a NaN row (pivot.py): an entry with p = 0 is not read, its d is 0 */        \
            for (j = 0; j < n; j++)                                                                                    \
                g[j] = q[j] == 0 ? (T)0 : (g[j] - D) * q[j];                                                           \
            continue;                                                                                                  \
        }                                                                                                              \
        V Dv = SPLAT(D);                                                                                               \
        for (j = 0; j + LW <= n; j += LW)                                                                              \
            ST(g + j, (LD(g + j) - Dv) * LD(q + j));                                                                   \
        for (; j < n; j++)                                                                                             \
            g[j] = (g[j] - D) * q[j];                                                                                  \
    }                                                                                                                  \
}

FX_ROW_KERNELS(, double, FX_W, FX(vd), FX(vi), FX(load), FX(store), FX(splat), FX(sel), FX(exp), FX(vmax))
FX_ROW_KERNELS(_f32, float, FX_WF, FX(vf), FX(vw), FX(loadf), FX(storef), FX(splatf), FX(self), FX(expf), FX(vmaxf))

/* The entry points of this build: the kernels, not inlined into one another. */
FX_ATTR static void FX(softmax_rows_entry)(double *t, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ld, double *m,
                                           double *s, double *l, unsigned char *e)
    { FX(softmax_rows)(t, rows, n, ld, m, s, l, e); }
FX_ATTR static void FX(softmax_rows_f32_entry)(float *t, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ld, float *m,
                                               float *s, float *l, unsigned char *e)
    { FX(softmax_rows_f32)(t, rows, n, ld, m, s, l, e); }
FX_ATTR static void FX(vjp_rows_entry)(double *d, const double *p, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ldd,
                                       ptrdiff_t ldp) { FX(softmax_vjp_rows)(d, p, rows, n, ldd, ldp); }
FX_ATTR static void FX(vjp_rows_f32_entry)(float *d, const float *p, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ldd,
                                           ptrdiff_t ldp) { FX(softmax_vjp_rows_f32)(d, p, rows, n, ldd, ldp); }
FX_ATTR static void FX(exp_entry)(const double *x, ptrdiff_t n, double *out)
{
    ptrdiff_t j = 0;
    for (; j + FX_W <= n; j += FX_W)
        FX(store)(out + j, FX(exp)(FX(load)(x + j)));
    for (; j < n; j++) {                                      /* the last few, one lane each */
        double e[FX_W] = {0};
        e[0] = x[j];
        FX(store)(e, FX(exp)(FX(load)(e)));
        out[j] = e[0];
    }
}

FX_ATTR static void FX(expf_entry)(const float *x, ptrdiff_t n, float *out)
{
    ptrdiff_t j = 0;
    for (; j + FX_WF <= n; j += FX_WF)
        FX(storef)(out + j, FX(expf)(FX(loadf)(x + j)));
    for (; j < n; j++) {
        float e[FX_WF] = {0};
        e[0] = x[j];
        FX(storef)(e, FX(expf)(FX(loadf)(e)));
        out[j] = e[0];
    }
}

#undef FX_ROW_KERNELS
#undef FX_SUM8
#undef FX_WF
#undef FX_INLINE
#undef FX
#undef FX_CAT
#undef FX_CAT_
