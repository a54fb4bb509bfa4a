/* The fast path's row passes (engines/fast.py), fused: _fast_rows.h compiled for the baseline (two doubles per
 * vector) and, on x86-64, for AVX2 (four per vector) and AVX-512 (eight per vector; float32 stays at eight lanes,
 * half a register) through function attributes, the widest the CPU runs chosen at run time. Every build gives
 * the same bits (see _fast_rows.h). Not bit-compatible with NumPy's passes (its exp and
 * sum order are its own), but the same bits on every machine and SIMD level. No libm but log (one per row).
 * Built at install (setup.py) into one library with _kernels.c, with -ffp-contract=off and no fast-math. */
#include <math.h>
#include <stddef.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#pragma GCC diagnostic ignored "-Wpsabi"             /* the vector helpers are always inlined: no ABI to keep */
#define FX_EXP_FLOOR (-760.0)                        /* below this exp is 0 in float64 (as dd.EXP_FLOOR) */

#define FX_W 2
#define FX_SFX base
#define FX_ATTR
#include "_fast_rows.h"
#undef FX_W
#undef FX_SFX
#undef FX_ATTR

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FX_HAVE_AVX2 1
#define FX_W 4
#define FX_SFX avx2
#define FX_ATTR __attribute__((target("avx2")))
#include "_fast_rows.h"
#undef FX_W
#undef FX_SFX
#undef FX_ATTR

#define FX_W 8
#define FX_SFX avx512
#define FX_ATTR __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))
#include "_fast_rows.h"
#undef FX_W
#undef FX_SFX
#undef FX_ATTR
#endif

static int fx_level = -1;

/* The widest build this CPU runs: 2 = AVX-512 (F; the OS saves the registers), 1 = AVX2, 0 = the baseline. */
static int fx_best(void)
{
    int best = 0;
#ifdef FX_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        best = 1;
    if (best == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
        best = 2;
#endif
    return best;
}

/* The build the row passes use from now on: 2 = AVX-512, 1 = AVX2, 0 = the baseline; the best one this CPU runs
 * when level is negative or beyond it, so a build the CPU lacks is never picked. Returns the level chosen. */
int sdpa_fast_set_level(int level)
{
    int best = fx_best();
    fx_level = level < 0 || level > best ? best : level;
    return fx_level;
}

/* The level in use (the best one this CPU runs until set). */
int sdpa_fast_get_level(void)
{
    if (fx_level < 0)
        sdpa_fast_set_level(-1);
    return fx_level;
}

#ifdef FX_HAVE_AVX2
#define FX_DISPATCH(NAME, ...)                                                                                   \
    do {                                                                                                         \
        if (fx_level < 0)                                                                                        \
            sdpa_fast_set_level(-1);                                                                             \
        if (fx_level == 2)                                                                                       \
            NAME##_avx512(__VA_ARGS__);                                                                          \
        else if (fx_level == 1)                                                                                  \
            NAME##_avx2(__VA_ARGS__);                                                                            \
        else                                                                                                     \
            NAME##_base(__VA_ARGS__);                                                                            \
    } while (0)
#else
#define FX_DISPATCH(NAME, ...) NAME##_base(__VA_ARGS__)
#endif

/* softmax of each row of t [rows x n, rows ld entries apart: a block of a wider array] in place, with the rows'
 * max, sum, lse and emptiness (_fast_rows.h) */
void sdpa_fast_softmax_rows(double *t, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ld, double *m, double *s, double *lse,
                            unsigned char *empty)
{
    FX_DISPATCH(softmax_rows_entry, t, rows, n, ld, m, s, lse, empty);
}

void sdpa_fast_softmax_rows_f32(float *t, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ld, float *m, float *s, float *lse,
                                unsigned char *empty)
{
    FX_DISPATCH(softmax_rows_f32_entry, t, rows, n, ld, m, s, lse, empty);
}

/* the pivoted softmax VJP of each row of d [rows x n, rows ldd apart] in place, p the probabilities (rows ldp
 * apart) (_fast_rows.h) */
void sdpa_fast_softmax_vjp_rows(double *d, const double *p, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ldd, ptrdiff_t ldp)
{
    FX_DISPATCH(vjp_rows_entry, d, p, rows, n, ldd, ldp);
}

void sdpa_fast_softmax_vjp_rows_f32(float *d, const float *p, ptrdiff_t rows, ptrdiff_t n, ptrdiff_t ldd,
                                    ptrdiff_t ldp)
{
    FX_DISPATCH(vjp_rows_f32_entry, d, p, rows, n, ldd, ldp);
}

/* exp of x[0:n] into out by the row passes' exp, float64 and float32 (for the tests) */
void sdpa_fast_exp(const double *x, ptrdiff_t n, double *out)
{
    FX_DISPATCH(exp_entry, x, n, out);
}

void sdpa_fast_expf(const float *x, ptrdiff_t n, float *out)
{
    FX_DISPATCH(expf_entry, x, n, out);
}
