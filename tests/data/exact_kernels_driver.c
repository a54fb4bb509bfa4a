/* Drives the exact kernels (sdpa_ref/exact/_kernels.c) over many shapes and layouts, every buffer allocated to
 * its exact size, so that AddressSanitizer and UBSan (tests/test_exact_kernels_sanitized.py) see any read or write
 * past one: the slicer (contiguous and transposed rows, batched, a float64 or dd input, with and without the
 * remainder, the statistics and the normalisation, every number of slices), the end of a block and the dd
 * accumulation. Prints "ok" and exits 0 when every call returned. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

void sdpa_slice_rows(const double *hi, const double *lo, ptrdiff_t rows, ptrdiff_t k, ptrdiff_t per, ptrdiff_t bs,
                     ptrdiff_t rs, ptrdiff_t cs, int n, int rho, double *out, double *rem_hi, double *rem_lo,
                     double *smax, double *ssum, double *rmax, int *eout, double *scratch);
void sdpa_dd_finish(const double *hi, const double *lo, ptrdiff_t nb, ptrdiff_t rows, ptrdiff_t n, int norm,
                    int has_scale, double scale, const int *ea, const int *eb, double *o0, double *o1);
void sdpa_dd_add_d(double *hi, double *lo, const double *c, ptrdiff_t n);

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

int main(void)
{
    const ptrdiff_t ks[] = {1, 2, 3, 4, 5, 7, 8, 9, 33};
    long calls = 0;
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
        ptrdiff_t k = ks[ki];
        for (ptrdiff_t rows = 1; rows <= 19; rows += 6) {
            for (int transposed = 0; transposed < 2; transposed++) {
                for (int n = 1; n <= 6; n++) {
                    for (int flags = 0; flags < 8; flags++) {    /* lo given, statistics, normalisation */
                        int with_lo = flags & 1, stats = flags & 2, norm = flags & 4;
                        ptrdiff_t per = rows, bs = rows * k, rs = transposed ? 1 : k, cs = transposed ? rows : 1;
                        double *hi = fresh((size_t)(rows * k)), *lo = with_lo ? fresh((size_t)(rows * k)) : NULL;
                        double *out = fresh((size_t)(n * rows * k));
                        double *rh = stats ? NULL : fresh((size_t)(rows * k)), *rl = stats ? NULL : fresh((size_t)(rows * k));
                        double *smax = stats ? fresh((size_t)(n * rows)) : NULL, *ssum = stats ? fresh((size_t)(n * rows)) : NULL;
                        double *rmax = stats ? fresh((size_t)rows) : NULL;
                        int *e = norm ? malloc((size_t)rows * sizeof *e) : NULL;
                        double *scratch = fresh((size_t)(2 * 8 * (k + 8)));
                        sdpa_slice_rows(hi, lo, rows, k, per, bs, rs, cs, n, 30, out, rh, rl, smax, ssum, rmax, e,
                                        scratch);
                        calls++;
                        free(hi); free(lo); free(out); free(rh); free(rl); free(smax); free(ssum); free(rmax);
                        free(e); free(scratch);
                    }
                }
            }
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
                        return 2;
                    for (ptrdiff_t i = 0; i < nb * rows; i++)
                        ea[i] = (int)(i % 7) - 3;
                    for (ptrdiff_t i = 0; i < nb * n; i++)
                        eb[i] = (int)(i % 5) - 2;
                    sdpa_dd_finish(h, l, nb, rows, n, flags & 1, (flags & 2) != 0, 0.125, ea, eb, o0, o1);
                    sdpa_dd_add_d(o0, o1, h, (ptrdiff_t)m);
                    calls += 2;
                    free(h); free(l); free(o0); free(o1); free(ea); free(eb);
                }
            }
        }
    }
    printf("ok %ld calls\n", calls);
    return 0;
}
