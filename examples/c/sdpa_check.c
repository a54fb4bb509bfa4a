/*
 * sdpa_check: judge a naive C attention against sdpa_ref's golden vectors, outside Python.
 *
 *     make && ./sdpa_check DIR        (DIR written by `sdpa-ref vectors DIR [--dtype float32]`)
 *
 * C99, libc and libm only: the example a CUDA, Rust or C++ author copies. It
 *
 *  1. reads DIR/manifest.json for the case files and their dtype;
 *  2. reads each case's .npz -- an uncompressed zip of .npy files -- by its
 *     local file headers, and each .npy by its header (descr, shape);
 *  3. runs attention_forward() below, the part you replace with a call to
 *     your kernel, on the case's inputs and options (options_json);
 *  4. judges the output by the manifest's rule, the same as the harness:
 *     float64: |got - out| <= 1e-12 + 1e-12 |out| element-wise;
 *     below:   max|got - out| <= k_out * honest_out + atol, with honest_out
 *              the honest ensemble's error stored in the file, k_out from
 *              the manifest ("relative_rule"), and
 *              atol = 2 max|fl(fl(out + 0.3) - 0.3) - out| in the dtype;
 *     and NaN must meet NaN;
 *  5. prints one line per case and exits 1 if any case fails (2 on a file it
 *     cannot read).
 *
 * The forward covers every option of the suite: scale, causal and window with
 * both alignments, bool and float masks, bias, ALiBi, q/kv lengths, softcap,
 * GQA, the fully-masked policies and dropout by its keep mask; the inputs'
 * leading (batch) dims broadcast as in NumPy. It computes in double and
 * rounds the output to the vectors' dtype: float64, float32, float16, and
 * bfloat16, float8_e4m3fn and float8_e5m2, whose arrays the files store as
 * uint16 / uint8 bit patterns (decoded by at() below). fp8 inputs come with
 * per-(batch, kv-head) q_descale, k_descale and v_descale (FlashAttention 3's):
 * dequantize() multiplies them in, and an fp8 kernel's output is bfloat16
 * (the manifest's "output_dtype").
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXD 8

typedef struct {
    char name[64];
    char kind;                 /* 'f' float, 'b' bool, 'i' int, 'u' uint; bit patterns: 'B' bfloat16,
                                  'E' float8_e4m3fn, 'M' float8_e5m2 */
    int size;                  /* bytes per element */
    int ndim;
    long shape[MAXD];
    const unsigned char *data;
} Arr;

typedef struct {
    Arr a[40];
    int n;
    unsigned char *buf;
} Npz;

/* ------------------------------------------------------------------ reading */

static unsigned rd16(const unsigned char *p) { return p[0] | (p[1] << 8); }
static unsigned long rd32(const unsigned char *p)
{
    return (unsigned long)p[0] | ((unsigned long)p[1] << 8) | ((unsigned long)p[2] << 16) |
           ((unsigned long)p[3] << 24);
}

static unsigned char *read_file(const char *path, long *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(*len + 1);
    if (b && fread(b, 1, *len, f) != (size_t)*len) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b)
        b[*len] = 0;
    return b;
}

/* one .npy: "\x93NUMPY", version, header length, "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }" */
static int parse_npy(const unsigned char *p, long len, Arr *a)
{
    if (len < 10 || memcmp(p, "\x93NUMPY", 6) != 0)
        return -1;
    long hl = p[6] == 1 ? (long)rd16(p + 8) : (long)rd32(p + 8);
    long start = p[6] == 1 ? 10 : 12;
    if (start + hl > len)
        return -1;
    char head[512];
    long n = hl < 511 ? hl : 511;
    memcpy(head, p + start, n);
    head[n] = 0;
    char *d = strstr(head, "'descr': '");
    char *s = strstr(head, "'shape': (");
    if (!d || !s || strstr(head, "'fortran_order': True"))
        return -1;
    d += 10;
    if (d[0] != '<' && d[0] != '|')
        return -1;                                     /* little-endian or byte-sized only */
    a->kind = d[1];
    a->size = atoi(d + 2);
    s += 10;
    a->ndim = 0;
    while (*s && *s != ')') {
        if (*s >= '0' && *s <= '9') {
            if (a->ndim == MAXD)
                return -1;
            a->shape[a->ndim++] = strtol(s, &s, 10);
        } else {
            s++;
        }
    }
    a->data = p + start + hl;
    return 0;
}

/* the stored zip of an .npz: walk its local file headers */
static int read_npz(const char *path, Npz *z)
{
    long len;
    z->n = 0;
    z->buf = read_file(path, &len);
    if (!z->buf)
        return -1;
    long at = 0;
    while (at + 30 <= len && rd32(z->buf + at) == 0x04034b50UL) {
        const unsigned char *h = z->buf + at;
        unsigned method = rd16(h + 8), flags = rd16(h + 6);
        long size = (long)rd32(h + 18), nlen = rd16(h + 26), xlen = rd16(h + 28);
        if (method != 0 || (flags & 8) || z->n == 40)
            return -1;                                 /* only stored entries with sizes up front */
        const unsigned char *name = h + 30, *data = name + nlen + xlen;
        if (data + size > z->buf + len || nlen < 5 || nlen > 60)
            return -1;
        Arr *a = &z->a[z->n];
        memcpy(a->name, name, nlen - 4);               /* "query.npy" -> "query" */
        a->name[nlen - 4] = 0;
        if (parse_npy(data, size, a) != 0)
            return -1;
        z->n++;
        at = (data - z->buf) + size;
    }
    return z->n > 0 ? 0 : -1;
}

static const Arr *get(const Npz *z, const char *name)
{
    for (int i = 0; i < z->n; i++)
        if (strcmp(z->a[i].name, name) == 0)
            return &z->a[i];
    return NULL;
}

static long count(const Arr *a)
{
    long n = 1;
    for (int d = 0; d < a->ndim; d++)
        n *= a->shape[d];
    return n;
}

/* IEEE half (bits) to double */
static double half_to_double(unsigned h)
{
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
    return (h & 0x8000) ? -v : v;
}

/* float8_e4m3fn (bits) to double: 4 exponent bits (bias 7), 3 fraction bits, no inf, S.1111.111 is NaN */
static double e4m3_to_double(unsigned b)
{
    int e = (b >> 3) & 15, m = b & 7;
    double v = (e == 15 && m == 7) ? NAN : e == 0 ? ldexp(m, -9) : ldexp(m + 8, e - 10);
    return (b & 0x80) ? -v : v;
}

static double at(const Arr *a, long i)
{
    const unsigned char *p = a->data + i * a->size;
    if (a->kind == 'B') { unsigned long u = (unsigned long)rd16(p) << 16; float f; memcpy(&f, &u, 4); return f; }
    if (a->kind == 'E') return e4m3_to_double(p[0]);
    if (a->kind == 'M') return half_to_double((unsigned)p[0] << 8);     /* e5m2 is the top byte of a half */
    if (a->kind == 'f') {
        if (a->size == 8) { double v; memcpy(&v, p, 8); return v; }
        if (a->size == 4) { float v; memcpy(&v, p, 4); return v; }
        return half_to_double(rd16(p));
    }
    if (a->kind == 'b' || (a->kind == 'u' && a->size == 1))
        return p[0];
    if (a->kind == 'i' && a->size == 8) { long long v; memcpy(&v, p, 8); return (double)v; }
    return NAN;
}

/* the element of `a` at the index `idx` of a space of rank `rank`, `a` right-aligned and broadcast */
static double at_index(const Arr *a, const long *idx, int rank)
{
    long off = 0, stride = 1;
    for (int d = a->ndim - 1; d >= 0; d--) {
        long i = a->shape[d] == 1 ? 0 : idx[rank - a->ndim + d];
        off += i * stride;
        stride *= a->shape[d];
    }
    return at(a, off);
}

/* --------------------------------------------------------------- the options */

typedef struct {
    int causal, gqa, bottom_right, has_window_left, has_window_right, policy;   /* 0 zero, 1 nan, 2 uniform */
    long window_left, window_right;
    double scale, softcap, dropout_p;
    int has_scale, has_softcap;
} Opts;

static const char *json_value(const char *js, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(js, pat);
    if (!p)
        return NULL;
    p += strlen(pat);
    while (*p == ' ')
        p++;
    return p;
}

static int parse_options(const Arr *oj, Opts *o)
{
    long n = count(oj);
    char *js = malloc(n + 1);
    for (long i = 0; i < n; i++)
        js[i] = (char)oj->data[i];
    js[n] = 0;
    memset(o, 0, sizeof *o);
    const char *v;
    if ((v = json_value(js, "is_causal")))
        o->causal = strncmp(v, "true", 4) == 0;
    if ((v = json_value(js, "enable_gqa")))
        o->gqa = strncmp(v, "true", 4) == 0;
    if ((v = json_value(js, "causal_alignment")))
        o->bottom_right = strncmp(v, "\"bottom_right\"", 14) == 0;
    if ((v = json_value(js, "scale")) && strncmp(v, "null", 4) != 0) {
        o->scale = strtod(v, NULL);
        o->has_scale = 1;
    }
    if ((v = json_value(js, "softcap")) && strncmp(v, "null", 4) != 0) {
        o->softcap = strtod(v, NULL);
        o->has_softcap = 1;
    }
    if ((v = json_value(js, "dropout_p")))
        o->dropout_p = strtod(v, NULL);
    if ((v = json_value(js, "fully_masked")))
        o->policy = strncmp(v, "\"nan\"", 5) == 0 ? 1 : strncmp(v, "\"uniform\"", 9) == 0 ? 2 : 0;
    if ((v = json_value(js, "window")) && *v == '[') {
        v++;
        while (*v == ' ') v++;
        if (strncmp(v, "null", 4) != 0) { o->window_left = strtol(v, NULL, 10); o->has_window_left = 1; }
        v = strchr(v, ',');
        if (v) {
            v++;
            while (*v == ' ') v++;
            if (strncmp(v, "null", 4) != 0) { o->window_right = strtol(v, NULL, 10); o->has_window_right = 1; }
        }
        if (o->has_window_left && o->window_left < 0) o->has_window_left = 0;      /* -1: unbounded */
        if (o->has_window_right && o->window_right < 0) o->has_window_right = 0;
    }
    free(js);
    return 0;
}

/* ------------------------------------------------------- the forward: replace */

/*
 * out (in the layout batch x Hq x L x Ev, row-major) for the case in `z`.
 * This is the naive, plainly written attention; put your kernel here.
 * Returns 0, or -1 with a reason in `why` for a case it cannot run.
 */
static int attention_forward(const Npz *z, const Opts *o, double *out, char *why)
{
    const Arr *q = get(z, "query"), *k = get(z, "key"), *v = get(z, "value");
    const Arr *mask = get(z, "attn_mask"), *bias = get(z, "bias"), *slopes = get(z, "alibi_slopes");
    const Arr *qlen = get(z, "q_lengths"), *kvlen = get(z, "kv_lengths"), *keep = get(z, "dropout_mask");
    int rq = q->ndim < 3 ? 3 : q->ndim, rk = k->ndim < 3 ? 3 : k->ndim, rv = v->ndim < 3 ? 3 : v->ndim;
    int nb = rq - 3;                                   /* batch dims: the broadcast of the three */
    if (rk - 3 > nb) nb = rk - 3;
    if (rv - 3 > nb) nb = rv - 3;
    long batch[MAXD], nbatch = 1;
    for (int d = 0; d < nb; d++) {
        long s = 1;
        const Arr *xs[3] = {q, k, v};
        for (int t = 0; t < 3; t++) {
            int r = xs[t]->ndim < 3 ? 3 : xs[t]->ndim, dd = d - (nb - (r - 3));
            long n = dd >= 0 ? xs[t]->shape[dd] : 1;
            if (n != 1) {
                if (s != 1 && s != n) { strcpy(why, "batch dims do not broadcast"); return -1; }
                s = n;
            }
        }
        batch[d] = s;
        nbatch *= s;
    }
    long Hq = q->ndim >= 3 ? q->shape[q->ndim - 3] : 1, Hkv = k->ndim >= 3 ? k->shape[k->ndim - 3] : 1;
    long L = q->shape[q->ndim - 2], E = q->shape[q->ndim - 1], S = k->shape[k->ndim - 2], Ev = v->shape[v->ndim - 1];
    long G = Hq / Hkv;
    double scale = o->has_scale ? o->scale : 1.0 / sqrt((double)E);
    double *T = malloc(sizeof(double) * (S > 0 ? S : 1));
    int *ok = malloc(sizeof(int) * (S > 0 ? S : 1));
    long idx[MAXD + 3], full = nb + 3;                 /* an index of the (batch..., Hq, L, S) scores */
    for (long b = 0; b < nbatch; b++) {
        long rem = b;
        for (int d = nb - 1; d >= 0; d--) { idx[d] = rem % batch[d]; rem /= batch[d]; }
        long ql = qlen ? (long)at_index(qlen, idx, nb) : L, kl = kvlen ? (long)at_index(kvlen, idx, nb) : S;
        long off = o->bottom_right ? (kvlen ? kl : S) - (qlen ? ql : L) : 0;
        for (long h = 0; h < Hq; h++) {
            long kvh = h / G;
            for (long i = 0; i < L; i++) {
                double *orow = out + ((b * Hq + h) * L + i) * Ev;
                idx[nb] = h; idx[nb + 1] = i;
                int any = 0;
                double m = -INFINITY;
                for (long j = 0; j < S; j++) {
                    idx[nb + 2] = j;
                    int a = j < kl && i < ql;
                    if (o->causal && j > i + off) a = 0;
                    if (o->has_window_left && j < i + off - o->window_left) a = 0;
                    if (o->has_window_right && j > i + off + o->window_right) a = 0;
                    if (mask && mask->kind == 'b' && !at_index(mask, idx, full)) a = 0;
                    double t = 0;
                    if (a) {
                        long qi[MAXD + 3], ki[MAXD + 3];
                        memcpy(qi, idx, sizeof(long) * nb); memcpy(ki, idx, sizeof(long) * nb);
                        qi[nb] = h; qi[nb + 1] = i; ki[nb] = kvh; ki[nb + 1] = j;
                        for (long e = 0; e < E; e++) {
                            qi[nb + 2] = e; ki[nb + 2] = e;
                            t += at_index(q, qi, full) * at_index(k, ki, full);
                        }
                        t *= scale;
                        if (o->has_softcap) t = o->softcap * tanh(t / o->softcap);
                        if (mask && mask->kind == 'f') t += at_index(mask, idx, full);
                        if (bias) t += at_index(bias, idx, full);
                        if (slopes) {
                            long si[MAXD + 3];
                            memcpy(si, idx, sizeof(long) * (nb + 1));
                            t -= at_index(slopes, si, nb + 1) * fabs((double)(i + off - j));
                        }
                        if (t == -INFINITY) a = 0;     /* a float -inf excludes the entry */
                    }
                    ok[j] = a;
                    T[j] = t;
                    if (a) { any = 1; if (t > m) m = t; }
                }
                for (long e = 0; e < Ev; e++) orow[e] = 0.0;
                if (i >= ql) continue;                 /* padded rows are 0 under every policy */
                if (!any && o->policy == 0) continue;
                if (!any && o->policy == 1) { for (long e = 0; e < Ev; e++) orow[e] = NAN; continue; }
                double sum = 0;
                for (long j = 0; j < S; j++)
                    if (ok[j]) { T[j] = exp(T[j] - m); sum += T[j]; }
                for (long j = 0; j < S; j++) {
                    double p = any ? (ok[j] ? T[j] / sum : 0.0) : 1.0 / (double)S;   /* uniform: every value */
                    idx[nb + 2] = j;
                    if (keep) p = at_index(keep, idx, full) ? p / (1.0 - o->dropout_p) : 0.0;
                    if (p == 0.0) continue;
                    long vi[MAXD + 3];
                    memcpy(vi, idx, sizeof(long) * nb);
                    vi[nb] = kvh; vi[nb + 1] = j;
                    for (long e = 0; e < Ev; e++) { vi[nb + 2] = e; orow[e] += p * at_index(v, vi, full); }
                }
            }
        }
    }
    free(T);
    free(ok);
    return 0;
}

/* ------------------------------------------------------------------ judging */

/* The vectors' dtype: fraction bits, smallest normal exponent, largest finite value, what overflow gives. */
typedef struct {
    const char *name;
    int bits;                  /* 64, 32: native; else rounded by round_to() */
    int mant, emin;
    double maxf;
    int overflow_nan;          /* float8_e4m3fn has no inf */
    char code;                 /* the kind its bit patterns get ('f': stored as floats) */
} Fmt;

static const Fmt FORMATS[] = {
    {"float64", 64, 52, -1022, 0, 0, 'f'},
    {"float32", 32, 23, -126, 0, 0, 'f'},
    {"float16", 16, 10, -14, 65504.0, 0, 'f'},
    {"bfloat16", 16, 7, -126, 3.3895313892515355e38, 0, 'B'},
    {"float8_e4m3fn", 8, 3, -6, 448.0, 1, 'E'},
    {"float8_e5m2", 8, 2, -14, 57344.0, 0, 'M'},
};

/* x rounded to the format (to nearest, ties to even), as a double */
static double round_to(double x, const Fmt *f)
{
    if (x != x || x == 0.0 || isinf(x)) return (isinf(x) && f->overflow_nan) ? NAN : x;
    int e;
    frexp(fabs(x), &e);                                /* |x| in [2^(e-1), 2^e) */
    int ue = e - 1 - f->mant < f->emin - f->mant ? f->emin - f->mant : e - 1 - f->mant;   /* the ulp's exponent */
    double r = ldexp(nearbyint(ldexp(x, -ue)), ue);
    if (fabs(r) > f->maxf) return f->overflow_nan ? NAN : copysign(INFINITY, x);
    return r;
}

static double to_dtype(double x, const Fmt *f)
{
    return f->bits == 64 ? x : f->bits == 32 ? (double)(float)x : round_to(x, f);
}

static double add_in(double a, double b, const Fmt *f)
{
    if (f->bits == 32) { volatile float s = (float)a + (float)b; return s; }
    return to_dtype(a + b, f);                         /* exact in double below float32, then one rounding */
}

/* 0 pass, 1 fail; prints the line */
static int judge(const char *name, const double *got, const Arr *ref, const Arr *honest, double k, const Fmt *f)
{
    long n = count(ref);
    double err = 0, floor_ = 0, worst = 0, herr = honest ? at(honest, 0) : 0;
    long worst_at = -1;
    int nan_bad = 0;
    double h03 = to_dtype(0.3, f);
    for (long i = 0; i < n; i++) {
        double r = at(ref, i), g = to_dtype(got[i], f);
        if ((r != r) != (g != g)) { nan_bad = 1; worst_at = i; break; }
        if (r != r) continue;
        double d = fabs(g - r);
        if (f->bits == 64) {
            double ratio = d / (1e-12 + 1e-12 * fabs(r));
            if (ratio > worst) { worst = ratio; worst_at = i; }
            continue;
        }
        if (d > err) { err = d; worst_at = i; }
        double rr = to_dtype(r, f), back = add_in(add_in(rr, h03, f), -h03, f);
        if (fabs(back - rr) > floor_) floor_ = fabs(back - rr);
    }
    if (nan_bad) {
        printf("FAIL  %s: NaN where the reference has a number, or the reverse (entry %ld)\n", name, worst_at);
        return 1;
    }
    if (f->bits == 64) {
        printf("%s  %s: worst |got - out| / (1e-12 + 1e-12 |out|) = %.3g\n", worst <= 1 ? "pass" : "FAIL", name,
               worst);
        return worst > 1;
    }
    double allowed = k * herr + 2 * floor_;
    printf("%s  %s: max|got - out| = %.3e, allowed %.3e (honest %.3e), ratio %.3f\n",
           err <= allowed ? "pass" : "FAIL", name, err, allowed, herr, allowed > 0 ? err / allowed : (err > 0) * 1e9);
    return err > allowed;
}

/* fp8: q, k, v times their per-(batch, kv-head) descale, into doubles (the problem's values); 0 or -1 */
static int dequantize(Npz *z, double **bufs)
{
    static const char *names[3][2] = {{"query", "q_descale"}, {"key", "k_descale"}, {"value", "v_descale"}};
    for (int t = 0; t < 3; t++) {
        Arr *a = (Arr *)get(z, names[t][0]);
        const Arr *d = get(z, names[t][1]);
        if (!d) return 0;                              /* no descales: the values are the problem's */
        if (!a || a->ndim < 3 || d->ndim < 1) return -1;
        long n = count(a), H = a->shape[a->ndim - 3], per = a->shape[a->ndim - 2] * a->shape[a->ndim - 1];
        long Hkv = d->shape[d->ndim - 1];
        if (Hkv <= 0 || H % Hkv != 0 || count(d) * (H / Hkv) * per != n) return -1;
        double *b = malloc((n + 1) * sizeof(double));
        if (!b) return -1;
        for (long i = 0; i < n; i++) {
            long h = (i / per) % H, bi = i / (per * H);
            b[i] = at(a, i) * at(d, bi * Hkv + h / (H / Hkv));
        }
        a->kind = 'f';
        a->size = 8;
        a->data = (const unsigned char *)b;
        bufs[t] = b;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR   (a folder written by `sdpa-ref vectors DIR`)\n", argv[0]);
        return 2;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/manifest.json", argv[1]);
    long mlen;
    char *man = (char *)read_file(path, &mlen);
    if (!man) { fprintf(stderr, "sdpa_check: cannot read %s\n", path); return 2; }
    const char *dt = strstr(man, "\"dtype\": \"");
    const Fmt *fmt = NULL;
    for (size_t i = 0; dt && i < sizeof FORMATS / sizeof FORMATS[0]; i++) {
        size_t nl = strlen(FORMATS[i].name);
        if (strncmp(dt + 10, FORMATS[i].name, nl) == 0 && dt[10 + nl] == '"') fmt = &FORMATS[i];
    }
    if (!fmt) {
        fprintf(stderr, "sdpa_check: %s: the dtype is not one of float64, float32, float16, bfloat16, "
                "float8_e4m3fn, float8_e5m2\n", path);
        return 2;
    }
    const Fmt *ofmt = fmt;                             /* what the kernel returns: bfloat16 for fp8 */
    const char *od = strstr(man, "\"output_dtype\": \"");
    for (size_t i = 0; od && i < sizeof FORMATS / sizeof FORMATS[0]; i++) {
        size_t nl = strlen(FORMATS[i].name);
        if (strncmp(od + 17, FORMATS[i].name, nl) == 0 && od[17 + nl] == '"') ofmt = &FORMATS[i];
    }
    const char *kp = strstr(man, "\"k_out\": ");
    double k = kp ? strtod(kp + 9, NULL) : 0;
    if (fmt->bits != 64 && !(k > 0)) { fprintf(stderr, "sdpa_check: %s: no relative_rule k_out\n", path); return 2; }
    int failed = 0, total = 0;
    for (const char *p = strstr(man, "\"file\": \""); p; p = strstr(p + 1, "\"file\": \"")) {
        const char *s = p + 9, *e = strchr(s, '"');
        if (!e || e - s > 255 || memchr(s, '/', e - s)) { fprintf(stderr, "sdpa_check: a bad file name\n"); return 2; }
        char file[256];
        memcpy(file, s, e - s);
        file[e - s] = 0;
        snprintf(path, sizeof path, "%s/%s", argv[1], file);
        Npz z;
        if (read_npz(path, &z) != 0 || !get(&z, "query") || !get(&z, "key") || !get(&z, "value") ||
            !get(&z, "out") || !get(&z, "options_json")) {
            fprintf(stderr, "sdpa_check: cannot read %s\n", path);
            return 2;
        }
        if (fmt->code != 'f') {                        /* the bit patterns of the vectors' dtype */
            static const char *in_dtype[] = {"query", "key", "value", "attn_mask", "bias", "alibi_slopes", "grad_out"};
            for (int j = 0; j < z.n; j++)
                for (size_t t = 0; t < sizeof in_dtype / sizeof in_dtype[0]; t++)
                    if (strcmp(z.a[j].name, in_dtype[t]) == 0 && z.a[j].kind == 'u')
                        z.a[j].kind = z.a[j].size == 2 ? 'B' : fmt->code;     /* 2 bytes: bfloat16 */
        }
        double *deq[3] = {NULL, NULL, NULL};
        if (dequantize(&z, deq) != 0) { fprintf(stderr, "sdpa_check: %s: bad descales\n", path); return 2; }
        Opts o;
        parse_options(get(&z, "options_json"), &o);
        const Arr *ref = get(&z, "out");
        double *out = calloc(count(ref) + 1, sizeof(double));
        char why[128] = "";
        char name[256];
        memcpy(name, file, strlen(file) - 4);
        name[strlen(file) - 4] = 0;
        total++;
        if (attention_forward(&z, &o, out, why) != 0) {
            printf("skip  %s: %s\n", name, why);
        } else {
            const Arr *honest = get(&z, "honest_out");
            if (fmt->bits != 64 && !honest) {
                fprintf(stderr, "sdpa_check: %s has no honest_out (vectors of format 1?)\n", path);
                return 2;
            }
            failed += judge(name, out, ref, honest, k, ofmt);
        }
        for (int t = 0; t < 3; t++) free(deq[t]);
        free(out);
        free(z.buf);
    }
    free(man);
    printf("%d cases, %d failed\n", total, failed);
    return failed ? 1 : 0;
}
