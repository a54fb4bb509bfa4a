/*
 * sdpa_check: judge a C attention, forward and backward, against sdpa_ref's golden vectors, outside Python.
 *
 *     make && ./sdpa_check [--forward-only] DIR     (DIR written by `sdpa-ref vectors DIR [--dtype float32]`)
 *
 * C99 and POSIX (open, fstat, read), libc and libm only: the example a CUDA, Rust or C++ author copies. It
 *
 *  1. reads DIR/manifest.json for the case files, their dtype and the rule's factors;
 *  2. reads each case's .npz -- an uncompressed zip of .npy files -- by its local file headers, and each .npy
 *     by its header (descr, fortran_order, shape), and checks every shape against the others;
 *  3. runs attention_forward() and attention_backward() below -- the parts you replace with calls to your
 *     kernel -- on the case's inputs, options (options_json) and seeded grad_out;
 *  4. judges out and lse, dq, dk, dv (dbias with a bias, dsinks with sinks) by the manifest's rule, as the
 *     harness:
 *     float64: |got - ref| <= 1e-12 + 1e-12 |ref| element-wise;
 *     below:   max|got - ref| <= k * honest + atol, with honest the honest ensemble's error stored in the
 *              file (honest_out, honest_lse, honest_dq, ...), k = k_out (out, lse) or k_grad from the
 *              manifest ("relative_rule"), and atol = 2 max|fl(fl(ref + 0.3) - 0.3) - ref| in the output
 *              dtype (float32 for lse and dsinks, which kernels keep in float32);
 *     and NaN must meet NaN, an inf the same inf (lse: -inf on a row with no key and no sink);
 *  5. prints one line per case (pass, FAIL or skip, with each quantity's error / allowed: a quantity passes
 *     at <= 1), then "N passed, M failed, K skipped" (cases).
 *
 * A set written with `sdpa-ref vectors DIR --layout thd|paged|thd_paged` (format 4) stores each case as a
 * varlen or a paged KV-cache kernel takes it (thd_paged: packed queries against the paged cache); see
 * "layouts" below: the client checks the index arrays against the storage, gathers the sequences into the
 * dense kernels and judges the results where the layout keeps them.
 * With `--layout gathered` every case has top-k gather_kv_indices (batch..., Hq or 1, L, K): a row keeps only
 * the keys its indices name (-1 and out-of-range name none, a repeat counts once), which score_row applies.
 *
 * Exit status (the contract the `sdpa-ref` command line shares):
 *     0  at least one quantity was judged and none failed
 *     1  a quantity failed
 *     2  bad usage, or a file it cannot read or that is not well formed: one line on stderr names the file
 *        and what is wrong
 *     3  nothing judged (every case skipped, or a manifest without cases): the summary line says so
 *
 * Pass --forward-only, or build with -DSDPA_CHECK_NO_BACKWARD, when your kernel has no backward: the
 * gradients are then reported as not judged, never as passed; --no-lse (-DSDPA_CHECK_NO_LSE) when it returns
 * no LSE. Vectors of format 2 have no honest_lse: their LSE is judged in float64 only. A case whose options the kernel does not
 * cover is skipped with the reason, never passed.
 *
 * The files may hold anything (a test fuzzes this program under AddressSanitizer and UBSan). Only regular
 * files are opened (O_NOFOLLOW | O_NONBLOCK, then fstat on the descriptor: no symlink, FIFO or device); the
 * manifest may have MAX_MANIFEST_BYTES, a case file MAX_FILE_BYTES; every length, offset, count and shape
 * read from a file is checked before use, each dimension is at most MAX_DIM, each array at most MAX_ELEMS
 * entries and exactly the bytes that follow its header (then copied into an allocation of its own), and
 * every allocation is checked. A case larger than this naive kernel should take (MAX_KEYS keys, MAX_WORK
 * steps) is skipped.
 *
 * The kernels cover every option of the suite: scale, causal and window with both alignments, bool and
 * float masks, bias, ALiBi, q/kv lengths, softcap, GQA, the fully-masked policies, dropout by its keep
 * mask and attention sinks (one logit per query head in the softmax's normaliser, with its gradient); the
 * inputs' leading (batch) dims broadcast as in NumPy, and gradients are summed back to each input's own shape. They compute in double; the judge rounds to the output dtype: float64, float32,
 * float16, and bfloat16, float8_e4m3fn and float8_e5m2, whose arrays the files store as uint16 / uint8 bit
 * patterns (decoded by at() below). fp8 inputs come with per-(batch, kv-head) q_descale, k_descale and
 * v_descale (FlashAttention 3's): dequantize() multiplies them in, an fp8 kernel's output is bfloat16 (the
 * manifest's "output_dtype") and so is grad_out.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* The tests' wrong kernels (tests/test_examples_c_client.py shows each check failing on one): built with
 * -DSDPA_CHECK_BREAK=n, one quantity is made wrong on purpose (BREAKS there says which); with
 * -DSDPA_CHECK_BREAK_ENV, n is read from the environment variable SDPA_CHECK_BREAK instead, so one build serves
 * them all. Never for use: without either, BREAK is 0 and the compiler drops every branch on it. */
#if defined(SDPA_CHECK_BREAK_ENV)
static int break_number(void)
{
    static int n = -1;
    if (n < 0) {
        const char *s = getenv("SDPA_CHECK_BREAK");
        n = s ? atoi(s) : 0;
    }
    return n;
}
#define BREAK break_number()
#elif defined(SDPA_CHECK_BREAK)
#define BREAK (SDPA_CHECK_BREAK)
#else
#define BREAK 0
#endif

/* ------------------------------------------------------------------ limits */

#define MAXD 8                                  /* dims of one array (batch dims: up to MAXD - 3) */
#define MAX_ARRAYS 64                           /* arrays in one .npz */
#define MAX_FILES 100000                        /* cases in one manifest */
#define MAX_MANIFEST_BYTES ((size_t)16 << 20)
#define MAX_FILE_BYTES ((size_t)256 << 20)
#define MAX_NPY_HEADER 65535                    /* bytes of one .npy header */
#define MAX_DIM ((size_t)0x7fffffff)            /* one dimension: 2^31 - 1 */
#define MAX_ELEMS ((size_t)1 << 31)             /* entries of one array */
#define MAX_ALLOC ((size_t)1 << 31)             /* bytes of one allocation */
#define MAX_JSON_DEPTH 32
#define MAX_KEYS ((size_t)1 << 20)              /* S that the naive kernels below take */
#define MAX_WORK 1e10                           /* steps per case that they take (about a minute) */

/* ------------------------------------------------------------------ errors */

static char why_bad[512];                       /* why a file was refused: one line, no file name */

static int bad(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why_bad, sizeof why_bad, fmt, ap);
    va_end(ap);
    return -1;
}

/* n entries of `size` bytes, zeroed, or NULL (with a reason) past MAX_ALLOC or when the allocator fails */
static void *xcalloc(size_t n, size_t size)
{
    if (n > MAX_ALLOC / size) {
        bad("would need more than %zu bytes of memory", MAX_ALLOC);
        return NULL;
    }
    void *p = calloc(n ? n : 1, size);
    if (!p)
        bad("out of memory (%zu bytes)", n * size);
    return p;
}

/* ------------------------------------------------------------------ reading files */

/*
 * The whole regular file `path`, of at most `limit` bytes, in a buffer with a NUL after it, or NULL with
 * a reason. Opened first and checked on the descriptor, so nothing swapped in meanwhile is read; a FIFO
 * or device is never read from (O_NONBLOCK: the open does not wait for a writer either).
 */
static unsigned char *read_file(const char *path, size_t limit, size_t *len)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        bad("%s", errno == ELOOP ? "a symbolic link (not followed)" : strerror(errno));
        return NULL;
    }
    struct stat st;
    unsigned char *buf = NULL;
    if (fstat(fd, &st) != 0) {
        bad("cannot stat: %s", strerror(errno));
    } else if (!S_ISREG(st.st_mode)) {
        bad("not a regular file (%s)",
            S_ISDIR(st.st_mode) ? "a folder" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket");
    } else if (st.st_size < 0 || (uintmax_t)st.st_size > limit) {
        bad("%lld bytes, more than the %zu allowed", (long long)st.st_size, limit);
    } else if ((buf = xcalloc((size_t)st.st_size + 1, 1)) != NULL) {
        size_t n = (size_t)st.st_size, got = 0;
        while (got <= n) {                      /* one byte more than fstat said: a file that grew is refused */
            ssize_t r = read(fd, buf + got, n + 1 - got);
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0) {
                if (r < 0)
                    got = n + 2;                /* a read error */
                break;
            }
            got += (size_t)r;
        }
        if (got != n) {
            bad("%s", got == n + 2 ? "a read error" : "changed size while it was read");
            free(buf);
            buf = NULL;
        } else {
            buf[n] = 0;
            *len = n;
        }
    }
    close(fd);
    return buf;
}

static unsigned rd16(const unsigned char *p) { return (unsigned)p[0] | ((unsigned)p[1] << 8); }
static unsigned long rd32(const unsigned char *p)
{
    return (unsigned long)p[0] | ((unsigned long)p[1] << 8) | ((unsigned long)p[2] << 16) |
           ((unsigned long)p[3] << 24);
}

static int is_key(const char *k, size_t n, const char *want) { return strlen(want) == n && memcmp(k, want, n) == 0; }

/* s[0..n) for a message: printable ASCII as it is, other bytes as \xNN (a verdict stays one line) */
static const char *shown(const char *s, size_t n, char *out, size_t size)
{
    size_t at = 0;
    for (size_t i = 0; i < n && at + 5 < size; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '\\')
            out[at++] = (char)c;
        else
            at += (size_t)snprintf(out + at, size - at, "\\x%02x", c);
    }
    out[at] = 0;
    return out;
}

/* ------------------------------------------------------------------ JSON (the manifest, options_json) */

/* A strict JSON reader over [p, end): no NUL terminator needed, nesting at most MAX_JSON_DEPTH. */
typedef struct {
    const char *p, *end, *start;
    int depth;
} Json;

static int json_peek(Json *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
    return j->p < j->end ? (unsigned char)*j->p : -1;
}

static int json_word(Json *j, const char *w)    /* 1 when the literal w (true, false, null) is next, consumed */
{
    size_t n = strlen(w);
    if (json_peek(j) < 0 || (size_t)(j->end - j->p) < n || memcmp(j->p, w, n) != 0)
        return 0;
    j->p += n;
    return 1;
}

static int json_open(Json *j, char open)
{
    if (json_peek(j) != open)
        return bad("JSON: '%c' expected at byte %ld", open, (long)(j->p - j->start));
    if (++j->depth > MAX_JSON_DEPTH)
        return bad("JSON nested deeper than %d", MAX_JSON_DEPTH);
    j->p++;
    return 0;
}

/* In an object or array: 1 when another member follows (its comma consumed), 0 at the closing bracket. */
static int json_more(Json *j, char close, int *first)
{
    int c = json_peek(j);
    if (c == close) {
        j->p++;
        j->depth--;
        return 0;
    }
    if (!*first) {
        if (c != ',')
            return bad("JSON: ',' or '%c' expected", close);
        j->p++;
    }
    *first = 0;
    return 1;
}

static int hexdigit(int c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

/* A string: [*s, *s + *n) are its bytes between the quotes, escapes undecoded; *plain is 1 without escapes. */
static int json_string(Json *j, const char **s, size_t *n, int *plain)
{
    if (json_peek(j) != '"')
        return bad("JSON: a string expected");
    const char *b = ++j->p;
    int esc = 0;
    while (j->p < j->end && *j->p != '"') {
        unsigned char c = (unsigned char)*j->p;
        if (c < 0x20)
            return bad("JSON: a control character in a string");
        if (c == '\\') {
            esc = 1;
            if (j->end - j->p < 2)
                return bad("JSON: a string without its closing quote");
            c = (unsigned char)*++j->p;
            if (c == 'u') {
                if (j->end - j->p < 5 || !hexdigit(j->p[1]) || !hexdigit(j->p[2]) || !hexdigit(j->p[3]) ||
                    !hexdigit(j->p[4]))
                    return bad("JSON: a bad \\u escape");
                j->p += 4;
            } else if (!memchr("\"\\/bfnrt", c, 8)) {
                return bad("JSON: a bad escape in a string");
            }
        }
        j->p++;
    }
    if (j->p >= j->end)
        return bad("JSON: a string without its closing quote");
    *s = b;
    *n = (size_t)(j->p - b);
    if (plain)
        *plain = !esc;
    j->p++;
    return 0;
}

static int json_key(Json *j, const char **k, size_t *n)
{
    if (json_string(j, k, n, NULL) != 0)
        return -1;
    if (json_peek(j) != ':')
        return bad("JSON: ':' expected after a key");
    j->p++;
    return 0;
}

static int digit(const char *p, const char *e) { return p < e && *p >= '0' && *p <= '9'; }

/* A number by JSON's grammar (not strtod's, which takes hex, inf and nan); its value in *v unless v is NULL. */
static int json_number(Json *j, double *v)
{
    json_peek(j);
    const char *b = j->p, *e = j->end, *p = b;
    if (p < e && *p == '-')
        p++;
    if (p < e && *p == '0')
        p++;
    else if (digit(p, e))
        while (digit(p, e)) p++;
    else
        return bad("JSON: a number expected");
    if (p < e && *p == '.') {
        if (!digit(++p, e))
            return bad("JSON: a bad number");
        while (digit(p, e)) p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-'))
            p++;
        if (!digit(p, e))
            return bad("JSON: a bad number");
        while (digit(p, e)) p++;
    }
    if (v) {
        char tmp[64];
        if ((size_t)(p - b) >= sizeof tmp)
            return bad("JSON: a number of more than %d characters", (int)sizeof tmp - 1);
        memcpy(tmp, b, (size_t)(p - b));
        tmp[p - b] = 0;
        *v = strtod(tmp, NULL);
    }
    j->p = p;
    return 0;
}

static int json_skip(Json *j)                   /* any value */
{
    int c = json_peek(j), first = 1, r;
    const char *s;
    size_t n;
    if (c == '"')
        return json_string(j, &s, &n, NULL);
    if (c == '{' || c == '[') {
        if (json_open(j, (char)c) != 0)
            return -1;
        while ((r = json_more(j, c == '{' ? '}' : ']', &first)) == 1)
            if ((c == '{' && json_key(j, &s, &n) != 0) || json_skip(j) != 0)
                return -1;
        return r;
    }
    if (c == '-' || (c >= '0' && c <= '9'))
        return json_number(j, NULL);
    if (json_word(j, "true") || json_word(j, "false") || json_word(j, "null"))
        return 0;
    return bad("not valid JSON");
}

static int json_end(Json *j) { return json_peek(j) < 0 ? 0 : bad("JSON: text after the value"); }

/* ------------------------------------------------------------------ the dtypes */

/* The vectors' dtype: fraction bits, smallest normal exponent, largest finite value, what overflow gives. */
typedef struct {
    const char *name;
    int bits;                                   /* 64, 32: native; else rounded by round_to() */
    int mant, emin;
    double maxf;
    int overflow_nan;                           /* float8_e4m3fn has no inf */
    char kind;                                  /* how its arrays are stored: 'f' floats, else bit patterns */
    int size;
} Fmt;

static const Fmt FORMATS[] = {
    {"float64", 64, 52, -1022, 0, 0, 'f', 8},
    {"float32", 32, 23, -126, 0, 0, 'f', 4},
    {"float16", 16, 10, -14, 65504.0, 0, 'f', 2},
    {"bfloat16", 16, 7, -126, 3.3895313892515355e38, 0, 'B', 2},
    {"float8_e4m3fn", 8, 3, -6, 448.0, 1, 'E', 1},
    {"float8_e5m2", 8, 2, -14, 57344.0, 0, 'M', 1},
};
#define NFORMATS (sizeof FORMATS / sizeof FORMATS[0])

static const Fmt *format_named(const char *s, size_t n)
{
    for (size_t i = 0; i < NFORMATS; i++)
        if (is_key(s, n, FORMATS[i].name))
            return &FORMATS[i];
    return NULL;
}

/* ------------------------------------------------------------------ the manifest */

enum { LAYOUT_DENSE, LAYOUT_THD, LAYOUT_PAGED, LAYOUT_THD_PAGED };

/* whether a layout packs its queries (thd, thd_paged), and whether it pages its keys (paged, thd_paged) */
#define PACKED_Q(kind) ((kind) == LAYOUT_THD || (kind) == LAYOUT_THD_PAGED)
#define PAGED_KV(kind) ((kind) == LAYOUT_PAGED || (kind) == LAYOUT_THD_PAGED)

typedef struct {
    const char *s;                              /* a case file's name, inside the manifest's text */
    size_t n;
} Name;

typedef struct {
    char *text;
    const Fmt *fmt, *ofmt;                      /* the vectors' dtype, the kernel's output dtype */
    double k_out, k_grad;                       /* 0 when absent */
    int layout;                                 /* LAYOUT_DENSE, _THD, _PAGED or _THD_PAGED ("layout") */
    Name *files;
    size_t nfiles;
} Manifest;

static int file_name_ok(const char *s, size_t n)
{
    if (n < 5 || n > 255 || memcmp(s + n - 4, ".npz", 4) != 0)
        return 0;
    return memchr(s, '/', n) == NULL;           /* a plain name, inside DIR (JSON strings hold no NUL) */
}

static int parse_manifest(Manifest *m, size_t len)
{
    Json j = {m->text, m->text + len, m->text, 0};
    int first = 1, r, have_files = 0;
    const char *k, *s;
    size_t kn, n, cap = 0;
    if (json_open(&j, '{') != 0)
        return bad("should hold a JSON object");
    while ((r = json_more(&j, '}', &first)) == 1) {
        if (json_key(&j, &k, &kn) != 0)
            return -1;
        if (is_key(k, kn, "dtype") || is_key(k, kn, "output_dtype")) {
            if (json_string(&j, &s, &n, NULL) != 0)
                return -1;
            const Fmt *f = format_named(s, n);
            if (!f)
                return bad("the %s should be one of float64, float32, float16, bfloat16, float8_e4m3fn, "
                           "float8_e5m2", kn == 5 ? "dtype" : "output_dtype");
            *(kn == 5 ? &m->fmt : &m->ofmt) = f;
        } else if (is_key(k, kn, "layout")) {
            if (json_string(&j, &s, &n, NULL) != 0)
                return -1;
            m->layout = is_key(s, n, "thd") ? LAYOUT_THD : is_key(s, n, "paged") ? LAYOUT_PAGED
                      : is_key(s, n, "thd_paged") ? LAYOUT_THD_PAGED
                      : is_key(s, n, "gathered") ? LAYOUT_DENSE : -1;   /* gathered: dense, with the indices */
            if (m->layout < 0)
                return bad("the layout should be \"thd\", \"paged\", \"thd_paged\" or \"gathered\"");
        } else if (is_key(k, kn, "relative_rule")) {
            int f2 = 1, r2;
            if (json_open(&j, '{') != 0)
                return -1;
            while ((r2 = json_more(&j, '}', &f2)) == 1) {
                if (json_key(&j, &k, &kn) != 0)
                    return -1;
                int which = is_key(k, kn, "k_out") ? 1 : is_key(k, kn, "k_grad") ? 2 : 0;
                double v = 0;
                if (which && json_number(&j, &v) != 0)
                    return -1;
                if (which && !(v > 0 && v <= 1e6))
                    return bad("relative_rule: %s should be a number in (0, 1e6]", which == 1 ? "k_out" : "k_grad");
                if (which)
                    *(which == 1 ? &m->k_out : &m->k_grad) = v;
                else if (json_skip(&j) != 0)
                    return -1;
            }
            if (r2 != 0)
                return -1;
        } else if (is_key(k, kn, "files")) {
            int f2 = 1, r2;
            have_files = 1;
            if (json_open(&j, '[') != 0)
                return -1;
            while ((r2 = json_more(&j, ']', &f2)) == 1) {
                int f3 = 1, r3, plain;
                Name name = {NULL, 0};
                if (json_open(&j, '{') != 0)
                    return -1;
                while ((r3 = json_more(&j, '}', &f3)) == 1) {
                    if (json_key(&j, &k, &kn) != 0)
                        return -1;
                    if (!is_key(k, kn, "file")) {
                        if (json_skip(&j) != 0)
                            return -1;
                        continue;
                    }
                    if (json_string(&j, &name.s, &name.n, &plain) != 0)
                        return -1;
                    if (!plain || !file_name_ok(name.s, name.n))
                        return bad("files[%zu]: \"file\" should be a plain name ending in .npz (no folder, no escapes, "
                                   "at most 255 bytes)", m->nfiles);
                }
                if (r3 != 0)
                    return -1;
                if (!name.s)
                    return bad("files[%zu] has no \"file\"", m->nfiles);
                if (m->nfiles == MAX_FILES)
                    return bad("more than %d files", MAX_FILES);
                if (m->nfiles == cap) {
                    cap = cap ? 2 * cap : 64;
                    Name *grown = realloc(m->files, cap * sizeof *grown);
                    if (!grown)
                        return bad("out of memory");
                    m->files = grown;
                }
                m->files[m->nfiles++] = name;
            }
            if (r2 != 0)
                return -1;
        } else if (json_skip(&j) != 0) {
            return -1;
        }
    }
    if (r != 0 || json_end(&j) != 0)
        return -1;
    if (!m->fmt)
        return bad("no \"dtype\"");
    if (!have_files)
        return bad("no \"files\" list");
    if (!m->ofmt)                               /* fp8 kernels return bfloat16 */
        m->ofmt = m->fmt->kind == 'E' || m->fmt->kind == 'M' ? &FORMATS[3] : m->fmt;
    return 0;
}

/* ------------------------------------------------------------------ .npz and .npy */

typedef struct {
    char name[64];
    char kind;                                  /* 'f' float, 'b' bool, 'i' int, 'u' uint; bit patterns: 'B'
                                                   bfloat16, 'E' float8_e4m3fn, 'M' float8_e5m2 */
    int size;                                   /* bytes per element */
    int ndim;
    size_t shape[MAXD];
    size_t count;                               /* entries */
    const unsigned char *data;
} Arr;

typedef struct {
    Arr a[MAX_ARRAYS];
    int n;
    unsigned char *buf;                         /* the file, while it is read */
    unsigned char *data[MAX_ARRAYS];            /* each array's own copy of its data */
    double *owned[3];                           /* dequantized query, key, value */
} Npz;

static const struct {
    const char *descr;
    char kind;
    int size;
} DESCRS[] = {{"<f8", 'f', 8}, {"<f4", 'f', 4}, {"<f2", 'f', 2}, {"|b1", 'b', 1}, {"|u1", 'u', 1},
              {"<u2", 'u', 2}, {"<i8", 'i', 8}, {"<i4", 'i', 4}};

static const char *spaces(const char *p, const char *e)
{
    while (p < e && *p == ' ')
        p++;
    return p;
}

/* A quoted Python string ('...' or "...", no escapes) at *p: its bytes in [*s, *s + *n). */
static int py_string(const char **p, const char *e, const char **s, size_t *n)
{
    const char *q = *p;
    if (q >= e || (*q != '\'' && *q != '"'))
        return -1;
    char quote = *q++;
    *s = q;
    while (q < e && *q != quote && *q >= 0x20 && *q < 0x7f && *q != '\\')   /* printable ASCII only */
        q++;
    if (q >= e || *q != quote)
        return -1;
    *n = (size_t)(q - *s);
    *p = q + 1;
    return 0;
}

/* The header dict of an .npy, "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }" padded with spaces
   and a newline, into a's kind, size, ndim and shape. */
static int npy_header(const char *h, size_t n, Arr *a)
{
    const char *p = h, *e = h + n, *k, *s;
    size_t kn, sn;
    int have = 0;                               /* 1 descr, 2 fortran_order, 4 shape */
    p = spaces(p, e);
    if (p >= e || *p++ != '{')
        return bad("%s.npy: the header is not a dict", a->name);
    for (;;) {
        p = spaces(p, e);
        if (p < e && *p == '}') {
            p++;
            break;
        }
        if (py_string(&p, e, &k, &kn) != 0 || (p = spaces(p, e)) >= e || *p++ != ':')
            return bad("%s.npy: a malformed header", a->name);
        p = spaces(p, e);
        if (is_key(k, kn, "descr")) {
            if (py_string(&p, e, &s, &sn) != 0)
                return bad("%s.npy: a malformed descr", a->name);
            size_t i;
            for (i = 0; i < sizeof DESCRS / sizeof DESCRS[0] && !is_key(s, sn, DESCRS[i].descr); i++)
                ;
            if (i == sizeof DESCRS / sizeof DESCRS[0])
                return bad("%s.npy: the dtype descr '%.*s' is not one this client reads (<f8 <f4 <f2 |b1 |u1 <u2 "
                           "<i8 <i4)", a->name, (int)(sn < 16 ? sn : 16), s);
            a->kind = DESCRS[i].kind;
            a->size = DESCRS[i].size;
            have |= 1;
        } else if (is_key(k, kn, "fortran_order")) {
            if ((size_t)(e - p) >= 5 && memcmp(p, "False", 5) == 0)
                p += 5;
            else if ((size_t)(e - p) >= 4 && memcmp(p, "True", 4) == 0)
                return bad("%s.npy: stored in Fortran order (only C order is read)", a->name);
            else
                return bad("%s.npy: a malformed fortran_order", a->name);
            have |= 2;
        } else if (is_key(k, kn, "shape")) {
            if (p >= e || *p++ != '(')
                return bad("%s.npy: a malformed shape", a->name);
            a->ndim = 0;
            for (;;) {
                p = spaces(p, e);
                if (p < e && *p == ')') {
                    p++;
                    break;
                }
                if (!digit(p, e))
                    return bad("%s.npy: a malformed shape", a->name);
                size_t d = 0;
                for (; digit(p, e); p++) {
                    size_t v = (size_t)(*p - '0');
                    if (d > (MAX_DIM - v) / 10)
                        return bad("%s.npy: a dimension over %zu", a->name, MAX_DIM);
                    d = 10 * d + v;
                }
                if (a->ndim == MAXD)
                    return bad("%s.npy: more than %d dims", a->name, MAXD);
                a->shape[a->ndim++] = d;
                p = spaces(p, e);
                if (p < e && *p == ',')
                    p++;
                else if (p >= e || *p != ')')
                    return bad("%s.npy: a malformed shape", a->name);
            }
            have |= 4;
        } else {
            return bad("%s.npy: an unknown header key '%.*s'", a->name, (int)(kn < 16 ? kn : 16), k);
        }
        p = spaces(p, e);
        if (p < e && *p == ',')
            p++;
        else if (p >= e || *p != '}')
            return bad("%s.npy: a malformed header", a->name);
    }
    for (; p < e; p++)
        if (*p != ' ' && *p != '\n')
            return bad("%s.npy: text after the header dict", a->name);
    if (have != 7)
        return bad("%s.npy: the header lacks %s", a->name,
                   !(have & 1) ? "descr" : !(have & 2) ? "fortran_order" : "shape");
    return 0;
}

/* one .npy: "\x93NUMPY", version, header length, header, data (exactly count * size bytes) */
static int parse_npy(const unsigned char *p, size_t len, Arr *a)
{
    if (len < 10 || memcmp(p, "\x93NUMPY", 6) != 0)
        return bad("%s.npy: not an .npy (no \\x93NUMPY at its start)", a->name);
    size_t start = p[6] == 1 ? 10 : 12, hl;
    if (p[6] < 1 || p[6] > 3 || len < start)
        return bad("%s.npy: .npy version %u is not read", a->name, (unsigned)p[6]);
    hl = p[6] == 1 ? rd16(p + 8) : rd32(p + 8);
    if (hl > MAX_NPY_HEADER || hl > len - start)
        return bad("%s.npy: a header of %zu bytes in %zu", a->name, hl, len);
    if (npy_header((const char *)p + start, hl, a) != 0)
        return -1;
    a->count = 1;
    for (int d = 0; d < a->ndim; d++) {
        if (a->shape[d] && a->count > MAX_ELEMS / a->shape[d])
            return bad("%s.npy: more than %zu entries", a->name, MAX_ELEMS);
        a->count *= a->shape[d];
    }
    size_t bytes = len - start - hl;
    if (bytes % (size_t)a->size != 0 || bytes / (size_t)a->size != a->count)
        return bad("%s.npy: its shape holds %zu entries of %d bytes, but %zu bytes follow its header", a->name,
                   a->count, a->size, bytes);
    a->data = p + start + hl;
    return 0;
}

/* The 64-bit sizes of a zip64 entry, from its extra field (id 1): those of the header that are 0xFFFFFFFF. */
static int zip64_sizes(const unsigned char *x, size_t xlen, size_t *usize, size_t *csize, size_t limit)
{
    for (size_t at = 0; xlen - at >= 4;) {
        size_t id = rd16(x + at), n = rd16(x + at + 2);
        size_t need = (*usize == 0xFFFFFFFFUL ? 8u : 0u) + (*csize == 0xFFFFFFFFUL ? 8u : 0u);
        if (n > xlen - at - 4)
            return -1;
        if (id == 1 && n >= need) {
            size_t *fields[2] = {usize, csize}, o = at + 4;
            for (int f = 0; f < 2; f++) {
                if (*fields[f] != 0xFFFFFFFFUL)
                    continue;
                uint64_t v = (uint64_t)rd32(x + o) | ((uint64_t)rd32(x + o + 4) << 32);
                if (v > limit)
                    return -1;
                *fields[f] = (size_t)v;
                o += 8;
            }
            return 0;
        }
        at += 4 + n;
    }
    return -1;
}

/* The stored zip of an .npz: walk its local file headers (the central directory after them is not needed). */
static int read_npz(const char *path, Npz *z)
{
    size_t len, at = 0;
    memset(z, 0, sizeof *z);
    z->buf = read_file(path, MAX_FILE_BYTES, &len);
    if (!z->buf)
        return -1;
    while (len - at >= 4 && rd32(z->buf + at) == 0x04034b50UL) {
        const unsigned char *h = z->buf + at;
        if (len - at < 30)
            return bad("the zip entry at byte %zu is cut short", at);
        unsigned flags = rd16(h + 6), method = rd16(h + 8);
        size_t csize = rd32(h + 18), usize = rd32(h + 22), nlen = rd16(h + 26), xlen = rd16(h + 28);
        if (method != 0 || (flags & 1))
            return bad("the zip entry at byte %zu is %s (only stored entries are read)", at,
                       method ? "compressed" : "encrypted");
        if (flags & 8)
            return bad("the zip entry at byte %zu has its sizes after the data (not read)", at);
        if (nlen + xlen > len - at - 30)
            return bad("the zip entry at byte %zu runs past the end of the file", at);
        const unsigned char *name = h + 30;
        if ((csize == 0xFFFFFFFFUL || usize == 0xFFFFFFFFUL) &&
            zip64_sizes(name + nlen, xlen, &usize, &csize, len) != 0)
            return bad("the zip entry at byte %zu has bad zip64 sizes", at);
        size_t data_at = at + 30 + nlen + xlen;
        if (csize != usize || csize > len - data_at)
            return bad("the zip entry at byte %zu declares %zu bytes, but %zu are left in the file", at, usize,
                       len - data_at);
        if (z->n == MAX_ARRAYS)
            return bad("more than %d arrays", MAX_ARRAYS);
        Arr *a = &z->a[z->n];
        if (nlen < 5 || nlen - 4 >= sizeof a->name || memcmp(name + nlen - 4, ".npy", 4) != 0)
            return bad("the zip entry at byte %zu is not named NAME.npy (NAME of 1 to %d characters)", at,
                       (int)sizeof a->name - 1);
        for (size_t i = 0; i < nlen - 4; i++) {
            unsigned char c = name[i];
            if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'))
                return bad("the zip entry at byte %zu has a name that is not of letters, digits and '_'", at);
            a->name[i] = (char)c;
        }
        a->name[nlen - 4] = 0;
        for (int i = 0; i < z->n; i++)
            if (strcmp(z->a[i].name, a->name) == 0)
                return bad("two arrays named %s", a->name);
        if (parse_npy(z->buf + data_at, csize, a) != 0)
            return -1;
        /* each array in an allocation of its own: a read past its end is then caught by the sanitizers */
        if ((z->data[z->n] = xcalloc(a->count, (size_t)a->size)) == NULL)
            return -1;
        memcpy(z->data[z->n], a->data, a->count * (size_t)a->size);
        a->data = z->data[z->n++];
        at = data_at + csize;
    }
    free(z->buf);
    z->buf = NULL;
    if (z->n == 0)
        return bad("not an .npz of stored .npy arrays (no zip entry at its start)");
    return 0;
}

static Arr *get(Npz *z, const char *name)
{
    for (int i = 0; i < z->n; i++)
        if (strcmp(z->a[i].name, name) == 0)
            return &z->a[i];
    return NULL;
}

static void shape_str(const Arr *a, char *buf, size_t n)
{
    size_t at = (size_t)snprintf(buf, n, "(");
    for (int d = 0; d < a->ndim && at < n; d++)
        at += (size_t)snprintf(buf + at, n - at, "%s%zu", d ? ", " : "", a->shape[d]);
    if (at < n)
        snprintf(buf + at, n - at, a->ndim == 1 ? ",)" : ")");
}

/* ------------------------------------------------------------------ element access */

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

/* entry i (< a->count) as a double */
static double at(const Arr *a, size_t i)
{
    const unsigned char *p = a->data + i * (size_t)a->size;
    switch (a->kind) {
    case 'B': { uint32_t u = (uint32_t)rd16(p) << 16; float f; memcpy(&f, &u, 4); return f; }
    case 'E': return e4m3_to_double(p[0]);
    case 'M': return half_to_double((unsigned)p[0] << 8);          /* e5m2 is the top byte of a half */
    case 'f':
        if (a->size == 8) { double v; memcpy(&v, p, 8); return v; }
        if (a->size == 4) { float v; memcpy(&v, p, 4); return v; }
        return half_to_double(rd16(p));
    case 'b': return p[0] != 0;
    case 'u': return a->size == 1 ? p[0] : rd16(p);
    default:                                                        /* 'i' */
        if (a->size == 8) { int64_t v; memcpy(&v, p, 8); return (double)v; }
        { int32_t v; memcpy(&v, p, 4); return v; }
    }
}

static long long at_int(const Arr *a, size_t i)                    /* an 'i' array's entry */
{
    const unsigned char *p = a->data + i * (size_t)a->size;
    if (a->size == 8) { int64_t v; memcpy(&v, p, 8); return v; }
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static int is_float(const Arr *a) { return a->kind == 'f' || a->kind == 'B' || a->kind == 'E' || a->kind == 'M'; }

/*
 * The offset in `a` of the index `idx` of a space of rank `rank`, `a` right-aligned and broadcast (a dim of
 * 1 takes index 0). Only for arrays checked by broadcasts() against that space: a->ndim <= rank, and each
 * dim 1 or that of the space, so the offset is < a->count.
 */
static size_t offset_of(const Arr *a, const size_t *idx, int rank)
{
    size_t off = 0, stride = 1;
    for (int d = a->ndim - 1; d >= 0; d--) {
        off += (a->shape[d] == 1 ? 0 : idx[rank - a->ndim + d]) * stride;
        stride *= a->shape[d];
    }
    return off;
}

static double at_index(const Arr *a, const size_t *idx, int rank) { return at(a, offset_of(a, idx, rank)); }

/* 1 when `a` broadcasts to the space `shape` of rank `rank` (as NumPy: right-aligned, each dim 1 or equal) */
static int broadcasts(const Arr *a, const size_t *shape, int rank)
{
    if (a->ndim > rank)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != 1 && a->shape[d] != shape[rank - a->ndim + d])
            return 0;
    return 1;
}

/* ------------------------------------------------------------------ the options */

enum { POLICY_ZERO, POLICY_NAN, POLICY_UNIFORM };

typedef struct {
    int causal, gqa, bottom_right, policy;
    int has_left, has_right, has_scale, has_softcap;
    long long left, right;                      /* the window's bounds, when bounded */
    double scale, softcap, dropout_p;
    char unknown[200];                          /* an option this client does not know: the case is skipped */
} Opts;

static int json_bool(Json *j, int *v, const char *key)
{
    if (json_word(j, "true"))
        *v = 1;
    else if (json_word(j, "false"))
        *v = 0;
    else
        return bad("options_json: %s should be true or false", key);
    return 0;
}

/* one of `words` (a NULL-ended list) as its index */
static int json_choice(Json *j, const char *const *words, int *v, const char *key)
{
    const char *s;
    size_t n;
    int plain;
    if (json_string(j, &s, &n, &plain) == 0)
        for (int i = 0; words[i]; i++)
            if (plain && is_key(s, n, words[i])) {
                *v = i;
                return 0;
            }
    return bad("options_json: %s should be one of the strings this client knows", key);
}

static int json_window_bound(Json *j, int *has, long long *v)
{
    double w;
    if (json_word(j, "null")) {
        *has = 0;
        return 0;
    }
    if (json_number(j, &w) != 0 || w != floor(w) || w < -1 || w > ldexp(1, 62))
        return bad("options_json: a window bound should be an int >= 0, -1 or null");
    *has = w >= 0;                              /* -1: unbounded */
    *v = (long long)w;
    return 0;
}

static int parse_options(const Arr *oj, Opts *o)
{
    static const char *const aligns[] = {"top_left", "bottom_right", NULL};
    static const char *const policies[] = {"zero", "nan", "uniform", NULL};
    memset(o, 0, sizeof *o);
    if (oj->kind != 'u' || oj->size != 1 || oj->ndim != 1)
        return bad("options_json should be a 1-D uint8 array (JSON bytes)");
    Json j = {(const char *)oj->data, (const char *)oj->data + oj->count, (const char *)oj->data, 0};
    int first = 1, r;
    const char *k;
    size_t kn;
    if (json_open(&j, '{') != 0)
        return bad("options_json should hold a JSON object");
    while ((r = json_more(&j, '}', &first)) == 1) {
        double v = 0;
        if (json_key(&j, &k, &kn) != 0)
            return -1;
        if (is_key(k, kn, "is_causal")) {
            if (json_bool(&j, &o->causal, "is_causal") != 0) return -1;
        } else if (is_key(k, kn, "enable_gqa")) {
            if (json_bool(&j, &o->gqa, "enable_gqa") != 0) return -1;
        } else if (is_key(k, kn, "causal_alignment")) {
            if (json_choice(&j, aligns, &o->bottom_right, "causal_alignment") != 0) return -1;
        } else if (is_key(k, kn, "fully_masked")) {
            if (json_choice(&j, policies, &o->policy, "fully_masked") != 0) return -1;
        } else if (is_key(k, kn, "scale") || is_key(k, kn, "softcap")) {
            int sc = kn == 5;
            if (json_word(&j, "null"))
                continue;
            if (json_number(&j, &v) != 0 || !isfinite(v) || (sc ? v == 0 : v <= 0))
                return bad("options_json: %s should be %s", sc ? "scale" : "softcap",
                           sc ? "a finite number other than 0, or null" : "a finite number > 0, or null");
            *(sc ? &o->scale : &o->softcap) = v;
            *(sc ? &o->has_scale : &o->has_softcap) = 1;
        } else if (is_key(k, kn, "dropout_p")) {
            if (json_number(&j, &v) != 0 || !(v >= 0 && v < 1))
                return bad("options_json: dropout_p should be in [0, 1)");
            o->dropout_p = v;
        } else if (is_key(k, kn, "window")) {
            int f2 = 1;
            if (json_word(&j, "null"))
                continue;
            if (json_open(&j, '[') != 0 || json_more(&j, ']', &f2) != 1 ||
                json_window_bound(&j, &o->has_left, &o->left) != 0 || json_more(&j, ']', &f2) != 1 ||
                json_window_bound(&j, &o->has_right, &o->right) != 0 || json_more(&j, ']', &f2) != 0)
                return bad("options_json: window should be [left, right], each an int >= 0, -1 or null");
        } else if (is_key(k, kn, "arrays")) {   /* the names of the drawn arrays: the .npz has them */
            if (json_skip(&j) != 0) return -1;
        } else {
            if (!o->unknown[0])
                shown(k, kn < 40 ? kn : 40, o->unknown, sizeof o->unknown);
            if (json_skip(&j) != 0) return -1;
        }
    }
    if (r != 0 || json_end(&j) != 0) {
        char inner[sizeof why_bad];
        memcpy(inner, why_bad, sizeof inner);
        return bad("options_json: %s", inner);
    }
    return 0;
}

/* ------------------------------------------------------------------ a case, checked */

/* What the kernels get: arrays whose shapes were checked against each other, and the options. */
typedef struct {
    const Arr *q, *k, *v, *mask, *bias, *slopes, *qlen, *kvlen, *keep, *sinks, *gather;
    Opts o;
    int nb;                                     /* batch dims; the scores are (batch..., Hq, L, S) */
    size_t batch[MAXD], nbatch;
    size_t Hq, Hkv, G, L, S, E, Ev;
    double scale;
} Problem;

/* 0, -1 (a bad file: why_bad), or 1: the kernels below do not take this case (the reason in `skip`) */
static int check_problem(Npz *z, const Opts *o, Problem *p, char *skip, size_t skip_n)
{
    char s1[96], s2[96];
    memset(p, 0, sizeof *p);
    p->o = *o;
    const Arr *q = p->q = get(z, "query"), *k = p->k = get(z, "key"), *v = p->v = get(z, "value");
    const Arr *xs[3] = {q, k, v};
    static const char *names[3] = {"query", "key", "value"};
    for (int t = 0; t < 3; t++) {
        if (!is_float(xs[t]))
            return bad("%s should be floating", names[t]);
        if (xs[t]->ndim < 2)
            return bad("%s should have at least 2 dims, (L, E) or (..., H, L, E)", names[t]);
    }
    shape_str(q, s1, sizeof s1);
    shape_str(k, s2, sizeof s2);
    p->E = q->shape[q->ndim - 1];
    p->L = q->shape[q->ndim - 2];
    p->S = k->shape[k->ndim - 2];
    p->Ev = v->shape[v->ndim - 1];
    p->Hq = q->ndim > 2 ? q->shape[q->ndim - 3] : 1;
    p->Hkv = k->ndim > 2 ? k->shape[k->ndim - 3] : 1;
    if (k->shape[k->ndim - 1] != p->E)
        return bad("key %s should have the last dim E=%zu of query %s", s2, p->E, s1);
    if (v->shape[v->ndim - 2] != p->S || (v->ndim > 2 ? v->shape[v->ndim - 3] : 1) != p->Hkv)
        return bad("value should have the heads and the S=%zu rows of key %s", p->S, s2);
    if (p->Hkv == 0)
        return bad("key %s has 0 heads", s2);
    if (o->gqa ? p->Hq % p->Hkv != 0 : p->Hq != p->Hkv)
        return bad(o->gqa ? "key %s should have a head count that divides the Hq=%zu of query"
                          : "key %s should have the Hq=%zu heads of query (enable_gqa is false)", s2, p->Hq);
    p->G = p->Hq / p->Hkv;
    /* the batch dims: the broadcast of those of query, key and value (their dims before the last 3) */
    int nb = 0;
    for (int t = 0; t < 3; t++)
        if (xs[t]->ndim - 3 > nb)
            nb = xs[t]->ndim - 3;
    p->nb = nb;
    p->nbatch = 1;
    for (int d = 0; d < nb; d++) {
        size_t n = 1;
        for (int t = 0; t < 3; t++) {
            int dd = d - (nb - (xs[t]->ndim - 3));
            size_t m = dd >= 0 ? xs[t]->shape[dd] : 1;
            if (m != 1 && n != 1 && m != n)
                return bad("the batch dims of query %s, key %s and value do not broadcast", s1, s2);
            if (m != 1)
                n = m;
        }
        p->batch[d] = n;
        if (n && p->nbatch > MAX_ELEMS / n)
            return bad("more than %zu batch entries", MAX_ELEMS);
        p->nbatch *= n;
    }
    /* the scores' shape (batch..., Hq, L, S); masks broadcast to its last max(ndim) dims, as in NumPy */
    size_t full[MAXD + 3];
    int rank = nb + 3, urank = 2;
    memcpy(full, p->batch, sizeof(size_t) * (size_t)nb);
    full[nb] = p->Hq;
    full[nb + 1] = p->L;
    full[nb + 2] = p->S;
    for (int t = 0; t < 3; t++)
        if (xs[t]->ndim > urank)
            urank = xs[t]->ndim;
    static const char *scored[3] = {"attn_mask", "bias", "dropout_mask"};
    const Arr **slot[3] = {&p->mask, &p->bias, &p->keep};
    for (int t = 0; t < 3; t++) {
        const Arr *m = *slot[t] = get(z, scored[t]);
        if (!m)
            continue;
        if (t == 0 ? m->kind != 'b' && !is_float(m) : t == 1 ? !is_float(m) : m->kind != 'b')
            return bad("%s should be %s", scored[t], t == 0 ? "bool or floating" : t == 1 ? "floating" : "bool");
        shape_str(m, s2, sizeof s2);
        if (m->ndim > urank || !broadcasts(m, full, rank))
            return bad("%s %s should broadcast to the scores' shape (batch..., Hq, L, S) of query %s and key",
                       scored[t], s2, s1);
    }
    if ((p->slopes = get(z, "alibi_slopes")) != NULL) {
        const Arr *a = p->slopes;
        shape_str(a, s2, sizeof s2);
        if (!is_float(a) || a->ndim < 1 || a->ndim > nb + 1 || a->shape[a->ndim - 1] != p->Hq ||
            !broadcasts(a, full, nb + 1))
            return bad("alibi_slopes %s should be floating, of shape (Hq,) = (%zu,) or (..., Hq) broadcasting to the "
                       "batch", s2, p->Hq);
    }
    if ((p->sinks = get(z, "sinks")) != NULL) {    /* one logit per query head, finite or -inf (no sink) */
        const Arr *a = p->sinks;
        shape_str(a, s2, sizeof s2);
        if (!is_float(a) || a->ndim < 1 || a->ndim > nb + 1 || a->shape[a->ndim - 1] != p->Hq ||
            !broadcasts(a, full, nb + 1))
            return bad("sinks %s should be floating, of shape (Hq,) = (%zu,) or (..., Hq) broadcasting to the batch",
                       s2, p->Hq);
        for (size_t i = 0; i < a->count; i++)
            if (at(a, i) != at(a, i) || at(a, i) == INFINITY)
                return bad("sinks should be finite or -inf, but holds %g", at(a, i));
    }
    if ((p->gather = get(z, "gather_kv_indices")) != NULL) {   /* top-k: (batch..., Hq or 1, L, K) */
        const Arr *a = p->gather;
        size_t gfull[MAXD + 3];
        memcpy(gfull, full, sizeof gfull);
        gfull[rank - 1] = a->ndim ? a->shape[a->ndim - 1] : 0;
        shape_str(a, s2, sizeof s2);
        if (a->kind != 'i' || a->ndim < 2 || a->ndim > urank || !broadcasts(a, gfull, rank))
            return bad("gather_kv_indices %s should be integers of a shape (batch..., Hq, L, K) broadcasting to the "
                       "scores' but for K", s2);
    }
    static const char *lens[2] = {"q_lengths", "kv_lengths"};
    const Arr **lslot[2] = {&p->qlen, &p->kvlen};
    for (int t = 0; t < 2; t++) {
        const Arr *a = *lslot[t] = get(z, lens[t]);
        size_t limit = t ? p->S : p->L;
        if (!a)
            continue;
        shape_str(a, s2, sizeof s2);
        if (a->kind != 'i' || !broadcasts(a, full, nb))
            return bad("%s %s should be integers, of a shape broadcasting to the batch", lens[t], s2);
        for (size_t i = 0; i < a->count; i++)
            if (at_int(a, i) < 0 || (unsigned long long)at_int(a, i) > limit)
                return bad("%s should hold lengths in [0, %zu]", lens[t], limit);
    }
    /* fp8: the descales, batch + (Hkv,) each (all three or none) */
    static const char *desc[3] = {"q_descale", "k_descale", "v_descale"};
    int ndesc = 0;
    for (int t = 0; t < 3; t++) {
        const Arr *d = get(z, desc[t]);
        if (!d)
            continue;
        ndesc++;
        shape_str(d, s2, sizeof s2);
        const Arr *x = xs[t];
        size_t H = x->ndim > 2 ? x->shape[x->ndim - 3] : 1;
        int ok = is_float(d) && d->ndim >= 1 && x->ndim >= 3 && d->ndim - 1 <= x->ndim - 3 &&
                 d->shape[d->ndim - 1] == p->Hkv && H % p->Hkv == 0;
        for (int dd = 0; ok && dd < d->ndim - 1; dd++) {
            size_t m = d->shape[dd], n = x->shape[x->ndim - 3 - (d->ndim - 1) + dd];
            ok = m == 1 || m == n;
        }
        if (!ok)
            return bad("%s %s should be floating, of shape batch + (Hkv,) = (..., %zu) of %s", desc[t], s2, p->Hkv,
                       names[t]);
    }
    if (ndesc != 0 && ndesc != 3)
        return bad("q_descale, k_descale and v_descale should come together");
    if (o->policy == POLICY_UNIFORM && p->S == 0)
        return bad("fully_masked is \"uniform\" with S = 0 (the mean of no values)");
    p->scale = o->has_scale ? o->scale : p->E > 0 ? 1.0 / sqrt((double)p->E) : 1.0;
    /* what the kernels below do not take: a skip, with the reason */
    double work = (double)p->nbatch *          /* the kernels' loops, in steps of about one multiply-add */
                  (16 + (double)p->Hq * (16 + (double)p->L * (16 + (double)p->S * (double)(p->E + p->Ev + 8))));
    if (o->unknown[0])
        snprintf(skip, skip_n, "the option \"%s\" is not known to this kernel", o->unknown);
    else if (o->dropout_p > 0 && !p->keep)
        snprintf(skip, skip_n, "dropout_p > 0 without a stored dropout_mask");
    else if (p->S > MAX_KEYS || work > MAX_WORK)
        snprintf(skip, skip_n, "too large for this naive kernel (S = %zu, %.3g steps)", p->S, work);
    else
        return 0;
    return 1;
}

/* fp8: query, key and value times their per-(batch, kv-head) descale, into doubles (the problem's values) */
static int dequantize(Npz *z, const Problem *p)
{
    static const char *names[3][2] = {{"query", "q_descale"}, {"key", "k_descale"}, {"value", "v_descale"}};
    for (int t = 0; t < 3; t++) {
        Arr *a = get(z, names[t][0]);
        const Arr *d = get(z, names[t][1]);
        if (!d)
            return 0;                           /* no descales: the values are the problem's */
        size_t H = a->shape[a->ndim - 3], per = a->shape[a->ndim - 2] * a->shape[a->ndim - 1], idx[MAXD];
        double *b = z->owned[t] = xcalloc(a->count, sizeof(double));
        if (!b)
            return -1;
        int lead = a->ndim - 3;                 /* the index space of the descale: a's leading dims, then Hkv */
        for (size_t i = 0; i < a->count; i++) {
            size_t h = (i / per) % H, rest = i / per / H;
            for (int dd = lead - 1; dd >= 0; dd--) {
                idx[dd] = rest % a->shape[dd];
                rest /= a->shape[dd];
            }
            idx[lead] = h / (H / p->Hkv);
            b[i] = at(a, i) * at_index(d, idx, lead + 1);
        }
        a->kind = 'f';
        a->size = 8;
        a->data = (const unsigned char *)b;
    }
    return 0;
}

/* ------------------------------------------------------------------ the kernels: replace */

/* One row of scores, what the forward and the backward share. */
typedef struct {
    double *t;                                  /* the scores after softcap, float mask, bias and ALiBi */
    double *th;                                 /* tanh(raw score / softcap), for the backward */
    double *pr;                                 /* the probabilities, before dropout */
    double *dp;                                 /* the backward's dO . v_j, times the dropout factor */
    unsigned char *ok;                          /* 1 where the key takes part */
    unsigned char *named;                       /* gather_kv_indices: 1 where the row's indices name the key */
    double psink;                               /* the sink's probability (0 without a sink) */
    double lse;                                 /* log sum_j exp(t_j) over the keys and the sink; -inf: none */
} Row;

static void row_free(Row *r)
{
    free(r->t);
    free(r->th);
    free(r->pr);
    free(r->dp);
    free(r->ok);
    free(r->named);
}

static int row_alloc(Row *r, size_t S)
{
    r->t = xcalloc(S, sizeof(double));
    r->th = xcalloc(S, sizeof(double));
    r->pr = xcalloc(S, sizeof(double));
    r->dp = xcalloc(S, sizeof(double));
    r->ok = xcalloc(S, 1);
    r->named = xcalloc(S ? S : 1, 1);
    if (r->t && r->th && r->pr && r->dp && r->ok && r->named)
        return 0;
    row_free(r);
    return -1;
}

enum { ROW_PADDED, ROW_LIVE, ROW_EMPTY };

/*
 * Where a row of `a` starts: the offset of index `idx` (of the space of rank `rank`) with its last entry 0.
 * The last dim of query, key, value and the gradients is never broadcast, so the row's entries follow.
 */
static size_t row_of(const Arr *a, size_t *idx, int rank)
{
    idx[rank - 1] = 0;
    return offset_of(a, idx, rank);
}

/*
 * Row i of query head h at the batch index idx[0..nb): fills r, and sets idx[nb] = h, idx[nb + 1] = i.
 * ROW_PADDED: a row past q_lengths (output 0, no gradient); ROW_EMPTY: no key takes part (then pr is 1/S
 * everywhere under "uniform", else 0); ROW_LIVE: pr is the softmax over the keys that take part.
 */
static int score_row(const Problem *p, size_t *idx, size_t h, size_t i, Row *r)
{
    const int nb = p->nb, full = nb + 3;
    const Opts *o = &p->o;
    long long ql = p->qlen ? at_int(p->qlen, offset_of(p->qlen, idx, nb)) : (long long)p->L;
    long long kl = p->kvlen ? at_int(p->kvlen, offset_of(p->kvlen, idx, nb)) : (long long)p->S;
    long long off = o->bottom_right ? kl - ql : 0, ii = (long long)i;
    idx[nb] = h;
    idx[nb + 1] = i;
    r->psink = 0.0;
    r->lse = -INFINITY;
    if (ii >= ql)
        return ROW_PADDED;                      /* a padded row has no sink either */
    double slope = p->slopes ? at_index(p->slopes, idx, nb + 1) : 0.0, m = -INFINITY;
    double sink = p->sinks ? at_index(p->sinks, idx, nb + 1) : -INFINITY;   /* a score with no value */
    if (BREAK == 7)                             /* the tests' wrong kernel: the sink forgotten */
        sink = -INFINITY;
    size_t ki[MAXD + 3], qrow;
    memcpy(ki, idx, sizeof ki);
    qrow = row_of(p->q, ki, full);              /* q_i */
    ki[nb] = h / p->G;                          /* GQA: query head h reads kv head h / G */
    if (p->gather) {                            /* the keys the row's indices name: -1 and out of range none */
        const Arr *g = p->gather;
        memset(r->named, 0, p->S);
        for (size_t c = 0; c < g->shape[g->ndim - 1]; c++) {
            idx[nb + 2] = c;
            long long j = at_int(g, offset_of(g, idx, full));
            if (j >= 0 && (unsigned long long)j < p->S)
                r->named[j] = 1;                /* a repeated index counts once */
        }
    }
    int any = 0;
    for (size_t j = 0; j < p->S; j++) {
        long long jj = (long long)j;
        int a = jj < kl;
        if (o->causal && jj > ii + off) a = 0;
        if (o->has_left && jj < ii + off - o->left) a = 0;
        if (o->has_right && jj > ii + off + o->right) a = 0;
        idx[nb + 2] = j;
        if (a && p->mask && p->mask->kind == 'b' && !at_index(p->mask, idx, full)) a = 0;
        if (a && p->gather && !r->named[j] && BREAK != 10) a = 0;   /* BREAK 10: the tests' kernel ignores them */
        double t = 0, th = 0;
        if (a) {
            ki[nb + 1] = j;
            size_t krow = row_of(p->k, ki, full);                   /* k_j */
            for (size_t e = 0; e < p->E; e++)
                t += at(p->q, qrow + e) * at(p->k, krow + e);
            t *= p->scale;
            if (o->has_softcap) { th = tanh(t / o->softcap); t = o->softcap * th; }
            if (p->mask && p->mask->kind != 'b') t += at_index(p->mask, idx, full);
            if (p->bias) t += at_index(p->bias, idx, full);
            if (p->slopes) t -= slope * fabs((double)(ii + off - jj));
            if (t == -INFINITY) a = 0;          /* a float -inf excludes the entry */
        }
        r->ok[j] = (unsigned char)a;
        r->t[j] = t;
        r->th[j] = th;
        if (a) { any = 1; if (t > m) m = t; }
    }
    if (!any && sink == -INFINITY) {
        for (size_t j = 0; j < p->S; j++)
            r->pr[j] = o->policy == POLICY_UNIFORM ? 1.0 / (double)p->S : 0.0;
        return ROW_EMPTY;
    }
    if (sink > m) m = sink;                     /* the sink takes part in the max and the sum */
    double sum = sink == -INFINITY ? 0.0 : exp(sink - m);
    for (size_t j = 0; j < p->S; j++) {
        r->pr[j] = r->ok[j] ? exp(r->t[j] - m) : 0.0;
        sum += r->pr[j];
    }
    for (size_t j = 0; j < p->S; j++)
        r->pr[j] /= sum;
    r->psink = sink == -INFINITY ? 0.0 : exp(sink - m) / sum;   /* a row with no key: 1, and O = 0 */
    r->lse = m + log(sum);                      /* the LSE includes the sink (FlashAttention 4, cuDNN) */
    return ROW_LIVE;
}

/* dropout's factor for key j of the row in idx: Z / (1 - p), or 1 without dropout */
static double kept(const Problem *p, size_t *idx, size_t j)
{
    if (!p->keep)
        return 1.0;
    idx[p->nb + 2] = j;
    return at_index(p->keep, idx, p->nb + 3) != 0 ? 1.0 / (1.0 - p->o.dropout_p) : 0.0;
}

static void batch_index(const Problem *p, size_t b, size_t *idx)
{
    for (int d = p->nb - 1; d >= 0; d--) {
        idx[d] = b % p->batch[d];
        b /= p->batch[d];
    }
}

/*
 * out (batch x Hq x L x Ev, row-major) for the problem p: the naive, plainly written attention, and, when
 * lse is not NULL, each row's log-sum-exp (batch x Hq x L; natural base, the sink included, -inf on a row with
 * no key and no sink). Put your kernel here. Returns 0, or -1 with a reason in `why` for a case it cannot
 * run (a skip).
 */
static int attention_forward(const Problem *p, double *out, double *lse, char *why, size_t why_n)
{
    Row r;
    size_t idx[MAXD + 3] = {0}, vi[MAXD + 3];
    const int nb = p->nb;
    if (row_alloc(&r, p->S) != 0) {
        snprintf(why, why_n, "%s", why_bad);
        return -1;
    }
    for (size_t b = 0; b < p->nbatch; b++) {
        batch_index(p, b, idx);
        for (size_t h = 0; h < p->Hq; h++) {
            for (size_t i = 0; i < p->L; i++) {
                double *orow = out + ((b * p->Hq + h) * p->L + i) * p->Ev;
                int st = score_row(p, idx, h, i, &r);
                if (lse)
                    lse[(b * p->Hq + h) * p->L + i] = r.lse;
                for (size_t e = 0; e < p->Ev; e++)
                    orow[e] = st == ROW_EMPTY && p->o.policy == POLICY_NAN ? NAN : 0.0;
                if (st == ROW_PADDED || (st == ROW_EMPTY && p->o.policy != POLICY_UNIFORM))
                    continue;                   /* padded rows are 0 under every policy */
                memcpy(vi, idx, sizeof vi);
                vi[nb] = h / p->G;
                for (size_t j = 0; j < p->S; j++) {
                    double pd = r.pr[j] * kept(p, idx, j);
                    if (pd == 0.0)
                        continue;
                    vi[nb + 1] = j;
                    size_t vrow = row_of(p->v, vi, nb + 3);                 /* v_j */
                    for (size_t e = 0; e < p->Ev; e++)
                        orow[e] += pd * at(p->v, vrow + e);
                }
            }
        }
    }
    row_free(&r);
    return 0;
}

/* The gradients, each in its input's own layout (summed over broadcast dims and GQA groups). */
typedef struct {
    double *dq, *dk, *dv, *dbias, *dsinks;      /* dbias, dsinks: NULL without a bias, without sinks */
} Grads;

/*
 * The gradients for the cotangent grad_out (the out's shape), by the textbook backward (SEMANTICS.md):
 *     dV = P_drop^T dO;  dP = (dO V^T) Z / (1 - p);  dT = P (dP - rowsum(P dP));  dbias = dT;
 *     dTraw = dT (1 - tanh^2(raw / cap)) with softcap;  dQ = scale dTraw K;  dK = scale dTraw^T Q;
 *     dsink = -sum_i p_sink,i rowsum(P dP)_i (the sink is a column with dP = 0)
 * on zeroed buffers g. A padded row adds nothing; an empty row adds nothing under "zero", NaN under "nan",
 * and under "uniform" only to dV (its P is 1/S whatever the scores). Put your kernel's backward here.
 * Returns 0, or -1 with a reason in `why` for a case it cannot run (a skip).
 */
static int attention_backward(const Problem *p, const Arr *grad_out, Grads *g, char *why, size_t why_n)
{
    Row r;
    size_t idx[MAXD + 3] = {0}, qi[MAXD + 3], ki[MAXD + 3];
    const int nb = p->nb, full = nb + 3;
    if (row_alloc(&r, p->S) != 0) {
        snprintf(why, why_n, "%s", why_bad);
        return -1;
    }
    for (size_t b = 0; b < p->nbatch; b++) {
        batch_index(p, b, idx);
        for (size_t h = 0; h < p->Hq; h++) {
            for (size_t i = 0; i < p->L; i++) {
                size_t orow = ((b * p->Hq + h) * p->L + i) * p->Ev;           /* dO_i in grad_out */
                int st = score_row(p, idx, h, i, &r);
                if (st == ROW_PADDED || (st == ROW_EMPTY && p->o.policy == POLICY_ZERO))
                    continue;
                memcpy(qi, idx, sizeof qi);
                memcpy(ki, idx, sizeof ki);
                size_t qrow = row_of(p->q, qi, full);                          /* q_i, and dq_i */
                ki[nb] = h / p->G;
                double poison = st == ROW_EMPTY && p->o.policy == POLICY_NAN ? NAN : 0.0;
                double D = 0;
                for (size_t j = 0; j < p->S; j++) {                           /* dV, and dP */
                    double z = kept(p, idx, j), pd = r.pr[j] * z, dp = 0;
                    ki[nb + 1] = j;
                    size_t vrow = row_of(p->v, ki, full);                      /* v_j, and dv_j */
                    for (size_t e = 0; e < p->Ev; e++) {
                        double go = at(grad_out, orow + e);
                        if (pd != 0.0 || poison != 0.0)
                            g->dv[vrow + e] += pd * go + poison;
                        if (r.ok[j])
                            dp += go * at(p->v, vrow + e);
                    }
                    r.dp[j] = dp * z;
                    D += r.pr[j] * r.dp[j];
                }
                if (g->dsinks && (r.psink != 0.0 || poison != 0.0))
                    g->dsinks[offset_of(p->sinks, idx, nb + 1)] += -r.psink * D + poison;
                if (st == ROW_EMPTY && p->o.policy == POLICY_UNIFORM)
                    continue;                   /* the scores do not reach this row's output */
                for (size_t j = 0; j < p->S; j++) {                           /* dT, then dbias, dQ, dK */
                    if (!r.ok[j] && poison == 0.0)
                        continue;
                    double dt = r.pr[j] * (r.dp[j] - D) + poison;
                    idx[nb + 2] = j;
                    if (g->dbias)
                        g->dbias[offset_of(p->bias, idx, full)] += dt;
                    if (p->o.has_softcap)
                        dt *= 1.0 - r.th[j] * r.th[j];
                    dt *= p->scale;
                    ki[nb + 1] = j;
                    size_t krow = row_of(p->k, ki, full);                      /* k_j, and dk_j */
                    for (size_t e = 0; e < p->E; e++) {
                        g->dq[qrow + e] += dt * at(p->k, krow + e);
                        g->dk[krow + e] += dt * at(p->q, qrow + e);
                    }
                }
            }
        }
    }
    row_free(&r);
    return 0;
}

/* ------------------------------------------------------------------ judging */

/* x rounded to the format (to nearest, ties to even), as a double */
static double round_to(double x, const Fmt *f)
{
    if (x != x || x == 0.0 || isinf(x)) return (isinf(x) && f->overflow_nan) ? NAN : x;
    int e;
    frexp(fabs(x), &e);                         /* |x| in [2^(e-1), 2^e) */
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
    return to_dtype(a + b, f);                  /* exact in double below float32, then one rounding */
}

typedef struct {
    int fail;
    double ratio, err, allowed;                 /* error / allowed: passes at <= 1 */
    size_t worst;                               /* the entry of the largest ratio */
    const char *note;                           /* a NaN or inf where the reference has a number, or the reverse */
} Verdict;

/* got (n entries, the reference's layout) against the reference `ref` by the manifest's rule */
static Verdict judge(const double *got, const Arr *ref, double honest, double k, const Fmt *f)
{
    Verdict v = {0, 0, 0, 0, 0, NULL};
    double floor_ = 0, h03 = to_dtype(0.3, f);
    for (size_t i = 0; i < ref->count; i++) {
        double r = at(ref, i), g = to_dtype(got[i], f);
        if ((r != r) != (g != g) || ((isinf(r) || isinf(g)) && r != g && r == r && g == g)) {
            v.fail = 1;
            v.ratio = INFINITY;
            v.worst = i;
            v.note = (g != g)   ? "NaN where the reference has a number"
                     : (r != r) ? "a number where the reference has NaN"
                                : "an inf where they differ";
            return v;
        }
        if (r != r || isinf(r))
            continue;
        double d = fabs(g - r);
        if (f->bits == 64) {
            double tol = 1e-12 + 1e-12 * fabs(r);
            if (d / tol > v.ratio) { v.ratio = d / tol; v.err = d; v.allowed = tol; v.worst = i; }
            continue;
        }
        if (d > v.err) { v.err = d; v.worst = i; }
        double rr = to_dtype(r, f), back = add_in(add_in(rr, h03, f), -h03, f);
        if (fabs(back - rr) > floor_) floor_ = fabs(back - rr);
    }
    if (f->bits != 64) {
        v.allowed = k * honest + 2 * floor_;
        v.ratio = v.allowed > 0 ? v.err / v.allowed : v.err > 0 ? INFINITY : 0.0;
    }
    v.fail = !(v.ratio <= 1.0);
    return v;
}

/* ------------------------------------------------------------------ one case */

typedef struct {
    char text[1024];                            /* the case's verdict line, so far */
    size_t at;
    int judged, failed;                         /* quantities */
} Line;

static void say(Line *l, const char *fmt, ...)
{
    if (l->at >= sizeof l->text)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(l->text + l->at, sizeof l->text - l->at, fmt, ap);
    va_end(ap);
    l->at = n < 0 ? sizeof l->text : l->at + (size_t)n;
}

/* Judge one quantity; a quantity without entries is reported as not judged. */
static void judge_into(Line *l, const char *q, const double *got, const Arr *ref, const Arr *honest, double k,
                       const Fmt *f)
{
    if (ref->count == 0) {
        say(l, "%s%s: no entries", l->at ? ", " : "", q);
        return;
    }
    Verdict v = judge(got, ref, honest ? at(honest, 0) : 0.0, k, f);
    l->judged++;
    l->failed += v.fail;
    say(l, "%s%s %.3g", l->at ? ", " : "", q, v.ratio);
    if (v.note)
        say(l, " FAIL (%s, entry %zu)", v.note, v.worst);
    else if (v.fail)
        say(l, " FAIL (max|got - ref| %.3e at entry %zu, allowed %.3e)", v.err, v.worst, v.allowed);
}

/* the honest error array for quantity q, checked; -1 when absent or malformed below float64 */
static int honest_for(Npz *z, const char *q, const Fmt *fmt, const Arr **h)
{
    char name[32];
    snprintf(name, sizeof name, "honest_%s", q);
    *h = get(z, name);
    if (fmt->bits == 64)
        return 0;
    if (!*h)
        return bad("has %s but no %s (vectors of format 1?)", q, name);
    if ((*h)->kind != 'f' || (*h)->count < 1 || !(at(*h, 0) >= 0) || isinf(at(*h, 0)))
        return bad("%s should hold a finite error >= 0", name);
    return 0;
}

/* the reference array `name`: floating, of the shape of `like` */
static int check_ref(const Arr *ref, const char *name, const Arr *like, const char *like_name)
{
    char s1[96], s2[96];
    int same = ref->ndim == like->ndim && memcmp(ref->shape, like->shape, sizeof(size_t) * (size_t)ref->ndim) == 0;
    if (ref->kind != 'f' || !same) {
        shape_str(ref, s1, sizeof s1);
        shape_str(like, s2, sizeof s2);
        return bad("%s %s should be floating, of the shape %s of %s", name, s1, s2, like_name);
    }
    return 0;
}

/* ------------------------------------------------------------------ layouts: sequences as a kernel stores them */

/*
 * A set whose manifest says "layout": "thd", "paged" or "thd_paged" (format 4; sdpa_ref/harness/vector_layouts.py)
 * stores each case as a varlen or a paged KV-cache kernel takes it: query, key, value and grad_out packed
 * (T, H, F) with cu_seqlens_q and cu_seqlens_k, or a query (B, L, Hq, E) against a cache (pages, page_size, Hkv,
 * F) with cache_seqlens and block_table, or (thd_paged) a packed query with cu_seqlens_q against that cache;
 * out, lse, dq, dk and dv are stored the same way (lse (Hq, T) packed, (B, Hq, L) paged).
 * layout_to_dense() checks the storage against its index arrays and gathers it into the dense padded problem
 * -- (B, H, Lmax, F) with the sequences' lengths as q_lengths and kv_lengths -- that the kernels above compute;
 * to_storage() and lse_to_storage() put the results back where the layout keeps them, and they are judged there
 * against the file's references, storage no sequence uses included (0, and -inf in the LSE). A varlen or paged
 * kernel replaces the three of them and the kernels together.
 */
typedef struct {
    int kind;                                   /* LAYOUT_DENSE (none), _THD, _PAGED or _THD_PAGED */
    size_t B, Lmax, Smax;                       /* sequences; the longest query and key run */
    size_t T, Tk;                               /* packed: the rows of query (and, thd, of key) */
    size_t pages, psize, width;                 /* paged: the cache's pages, their size, the table's width */
    long long *cu_q, *cu_k, *seqlen, *table;    /* copies of the index arrays */
    long long *qlen, *kvlen;                    /* the dense problem's q_lengths and kv_lengths */
    Arr sq, sk, sv, sgo;                        /* the storage arrays as read (sgo.count 0: no grad_out) */
    double *dense[4];                           /* the dense query, key, value, grad_out */
} Layout;

static void layout_free(Layout *l)
{
    free(l->cu_q);
    free(l->cu_k);
    free(l->seqlen);
    free(l->table);
    free(l->qlen);
    free(l->kvlen);
    for (int t = 0; t < 4; t++)
        free(l->dense[t]);
}

/* the integer array `name` of `ndim` dims, copied into *out (its shape in shape[]) */
static int layout_ints(Npz *z, const char *name, int ndim, long long **out, size_t *shape)
{
    const Arr *a = get(z, name);
    if (!a)
        return bad("has no %s (the manifest's layout needs it)", name);
    if (a->kind != 'i' || a->ndim != ndim)
        return bad("%s should be integers of %d dim%s", name, ndim, ndim > 1 ? "s" : "");
    if ((*out = xcalloc(a->count ? a->count : 1, sizeof(long long))) == NULL)
        return -1;
    for (size_t i = 0; i < a->count; i++)
        (*out)[i] = at_int(a, i);
    for (int d = 0; d < ndim; d++)
        shape[d] = a->shape[d];
    return 0;
}

/* a * b, or 0 with why_bad when it passes MAX_ELEMS */
static size_t elems(size_t a, size_t b)
{
    if (b && a > MAX_ELEMS / b) {
        bad("an array of the dense problem would pass %zu entries", MAX_ELEMS);
        return 0;
    }
    return a * b;
}

/* entry (b, h, i, f) of the storage of a (H, F) array: the query side (keys = 0) or the key side */
static size_t storage_at(const Layout *l, int keys, size_t b, size_t h, size_t i, size_t f, size_t H, size_t F)
{
    size_t n = (size_t)(keys ? l->kvlen[b] : l->qlen[b]);
    if (BREAK == 9 && keys && i + 1 < n)        /* the tests' wrong layout kernel: keys one off */
        i++;
    if (!keys)
        return ((PACKED_Q(l->kind) ? (size_t)l->cu_q[b] : b * l->Lmax) + i) * H * F + h * F + f;
    if (l->kind == LAYOUT_THD)
        return (((size_t)l->cu_k[b] + i) * H + h) * F + f;
    size_t page = (size_t)l->table[b * l->width + i / l->psize];
    return ((page * l->psize + i % l->psize) * H + h) * F + f;
}

/* the storage array `a` (H heads of F) into the dense (B, H, n, F), 0 past each sequence */
static double *gather(const Layout *l, const Arr *a, int keys, size_t H, size_t n, size_t F)
{
    size_t count = elems(elems(elems(l->B, H), n), F);
    if (count == 0 && l->B && H && n && F)
        return NULL;
    double *d = xcalloc(count ? count : 1, sizeof(double));
    if (!d)
        return NULL;
    for (size_t b = 0; b < l->B; b++)
        for (size_t h = 0; h < H; h++)
            for (size_t i = 0; i < (size_t)(keys ? l->kvlen[b] : l->qlen[b]); i++)
                for (size_t f = 0; f < F; f++)
                    d[((b * H + h) * n + i) * F + f] = at(a, storage_at(l, keys, b, h, i, f, H, F));
    return d;
}

/* the dense (B, H, n, F) result into a storage buffer of `like`'s shape (zeroed first): 0 where no sequence is */
static void to_storage(const Layout *l, const double *d, int keys, size_t H, size_t n, size_t F, double *st,
                       size_t count)
{
    memset(st, 0, count * sizeof(double));
    for (size_t b = 0; b < l->B; b++)
        for (size_t h = 0; h < H; h++)
            for (size_t i = 0; i < (size_t)(keys ? l->kvlen[b] : l->qlen[b]); i++)
                for (size_t f = 0; f < F; f++)        /* a page two sequences share gets both: a sum */
                    st[storage_at(l, keys, b, h, i, f, H, F)] += d[((b * H + h) * n + i) * F + f];
}

/* the dense LSE (B, Hq, Lmax) into the layout's: (Hq, T) packed queries, (B, Hq, L) else; -inf on unused rows */
static void lse_to_storage(const Layout *l, const double *d, size_t H, double *st, size_t count)
{
    for (size_t i = 0; i < count; i++)
        st[i] = -INFINITY;
    for (size_t b = 0; b < l->B; b++)
        for (size_t h = 0; h < H; h++)
            for (size_t i = 0; i < (size_t)l->qlen[b]; i++)
                st[PACKED_Q(l->kind) ? h * l->T + (size_t)l->cu_q[b] + i : (b * H + h) * l->Lmax + i] =
                    d[(b * H + h) * l->Lmax + i];
}

/* the dense array `d` of shape (B, H, n, F) in place of z's array `a` (its storage form kept in *keep) */
static void replace(Arr *a, Arr *keep, double *d, size_t B, size_t H, size_t n, size_t F)
{
    *keep = *a;
    a->kind = 'f';
    a->size = 8;
    a->ndim = 4;
    a->shape[0] = B;
    a->shape[1] = H;
    a->shape[2] = n;
    a->shape[3] = F;
    a->count = B * H * n * F;
    a->data = (const unsigned char *)d;
}

/* Checks the storage of `kind` against its index arrays and replaces query, key, value and grad_out by the
   dense padded problem, with q_lengths and kv_lengths added: 0, or -1 (why_bad) */
static int layout_to_dense(Npz *z, int kind, Layout *l)
{
    Arr *q = get(z, "query"), *k = get(z, "key"), *v = get(z, "value"), *go = get(z, "grad_out");
    size_t sh[2];
    l->kind = kind;
    if (get(z, "q_lengths") || get(z, "kv_lengths"))
        return bad("q_lengths and kv_lengths should not be stored in a layout set (the layout holds the lengths)");
    if (z->n + 2 > MAX_ARRAYS)
        return bad("more than %d arrays", MAX_ARRAYS - 2);
    int rank = PACKED_Q(kind) ? 3 : 4, krank = PAGED_KV(kind) ? 4 : 3;      /* query's, and key's and value's */
    static const char *const names[] = {"", "thd", "paged", "thd_paged"};
    if (q->ndim != rank || k->ndim != krank || v->ndim != krank)
        return bad("query should have %d dims and key and value %d in a %s set", rank, krank, names[kind]);
    size_t Hq = q->shape[rank - 2], E = q->shape[rank - 1], Hkv = k->shape[krank - 2], Ev = v->shape[krank - 1];
    if (k->shape[krank - 1] != E || v->shape[krank - 2] != Hkv || v->shape[0] != k->shape[0] ||
        (krank == 4 && v->shape[1] != k->shape[1]))
        return bad("key and value should be stored alike, with the E of query");
    if (PACKED_Q(kind)) {                       /* cu_seqlens_q: B + 1 offsets into query's rows */
        if (layout_ints(z, "cu_seqlens_q", 1, &l->cu_q, sh) != 0)
            return -1;
        if (sh[0] < 1)
            return bad("cu_seqlens_q should hold B + 1 offsets");
        l->B = sh[0] - 1;
        l->T = q->shape[0];
        if (l->cu_q[0] != 0)
            return bad("cu_seqlens_q should start at 0");
        for (size_t b = 0; b < l->B; b++)
            if (l->cu_q[b + 1] < l->cu_q[b])
                return bad("cu_seqlens_q should not decrease");
        if ((unsigned long long)l->cu_q[l->B] > l->T)
            return bad("cu_seqlens_q should end within the rows of query");
    }
    if (kind == LAYOUT_THD) {
        size_t n2[1];
        if (layout_ints(z, "cu_seqlens_k", 1, &l->cu_k, n2) != 0)
            return -1;
        if (n2[0] != l->B + 1)
            return bad("cu_seqlens_q and cu_seqlens_k should hold B + 1 offsets each");
        l->Tk = k->shape[0];
        if (l->cu_k[0] != 0)
            return bad("cu_seqlens_q and cu_seqlens_k should start at 0");
        for (size_t b = 0; b < l->B; b++)
            if (l->cu_k[b + 1] < l->cu_k[b])
                return bad("cu_seqlens_q and cu_seqlens_k should not decrease");
        if ((unsigned long long)l->cu_k[l->B] > l->Tk)
            return bad("cu_seqlens_q and cu_seqlens_k should end within the rows of query and key");
    } else {
        size_t w[2];
        if (layout_ints(z, "cache_seqlens", 1, &l->seqlen, sh) != 0 || layout_ints(z, "block_table", 2, &l->table, w) != 0)
            return -1;
        if (!PACKED_Q(kind)) {
            l->B = q->shape[0];
            l->Lmax = q->shape[1];
        }
        l->pages = k->shape[0];
        l->psize = k->shape[1];
        l->width = w[1];
        if (sh[0] != l->B || w[0] != l->B)
            return bad("cache_seqlens (B,) and block_table (B, pages) should have the B=%zu %s", l->B,
                       PACKED_Q(kind) ? "sequences of cu_seqlens_q" : "rows of query");
        for (size_t b = 0; b < l->B; b++) {
            if (l->seqlen[b] < 0 || (l->psize && (unsigned long long)l->seqlen[b] > l->width * l->psize) ||
                (!l->psize && l->seqlen[b] > 0))
                return bad("cache_seqlens should be in [0, block_table's width x page size]");
            for (size_t p = 0; l->psize && p < ((size_t)l->seqlen[b] + l->psize - 1) / l->psize; p++)
                if (l->table[b * l->width + p] < 0 || (unsigned long long)l->table[b * l->width + p] >= l->pages)
                    return bad("block_table names a page outside the cache's %zu pages", l->pages);
        }
    }
    if ((l->qlen = xcalloc(l->B ? l->B : 1, sizeof(long long))) == NULL ||
        (l->kvlen = xcalloc(l->B ? l->B : 1, sizeof(long long))) == NULL)
        return -1;
    for (size_t b = 0; b < l->B; b++) {
        l->qlen[b] = PACKED_Q(kind) ? l->cu_q[b + 1] - l->cu_q[b] : (long long)l->Lmax;
        l->kvlen[b] = kind == LAYOUT_THD ? l->cu_k[b + 1] - l->cu_k[b] : l->seqlen[b];
        if (PACKED_Q(kind) && (size_t)l->qlen[b] > l->Lmax)
            l->Lmax = (size_t)l->qlen[b];
        if ((size_t)l->kvlen[b] > l->Smax)
            l->Smax = (size_t)l->kvlen[b];
    }
    if (go) {
        int same = go->ndim == rank && go->shape[rank - 1] == Ev;
        for (int d = 0; same && d < rank - 1; d++)
            same = go->shape[d] == q->shape[d];
        if (!same)
            return bad("grad_out should be stored as query is, with the last dim Ev of value");
    }
    Arr *xs[4] = {q, k, v, go};
    Arr *keep[4] = {&l->sq, &l->sk, &l->sv, &l->sgo};
    size_t H[4] = {Hq, Hkv, Hkv, Hq}, n[4] = {l->Lmax, l->Smax, l->Smax, l->Lmax}, F[4] = {E, E, Ev, Ev};
    for (int t = 0; t < 4; t++) {
        if (!xs[t])
            continue;
        if ((l->dense[t] = gather(l, xs[t], t == 1 || t == 2, H[t], n[t], F[t])) == NULL)
            return -1;
        replace(xs[t], keep[t], l->dense[t], l->B, H[t], n[t], F[t]);
    }
    static const char *lens[2] = {"q_lengths", "kv_lengths"};
    long long *vals[2] = {l->qlen, l->kvlen};
    for (int t = 0; t < 2; t++) {                /* the lengths, as arrays of the file (their data is the layout's) */
        Arr *a = &z->a[z->n];
        memset(a, 0, sizeof *a);
        snprintf(a->name, sizeof a->name, "%s", lens[t]);
        a->kind = 'i';
        a->size = 8;
        a->ndim = 1;
        a->shape[0] = l->B;
        a->count = l->B;
        a->data = (const unsigned char *)vals[t];
        z->data[z->n++] = NULL;
    }
    return 0;
}

/* the layout's reference shapes: out, grad_out and dq as query is stored (last dim Ev for out and grad_out),
   lse (Hq, T) or (B, Hq, L), dk and dv as key and value */
static int layout_refs_ok(const Layout *l, const Arr *out, const Arr *lse)
{
    int rank = l->sq.ndim, same = out->kind == 'f' && out->ndim == rank &&
                                  out->shape[rank - 1] == l->sv.shape[l->sv.ndim - 1];
    for (int d = 0; same && d < rank - 1; d++)
        same = out->shape[d] == l->sq.shape[d];
    if (!same)
        return bad("out should be floating, stored as query is with the last dim Ev of value");
    size_t Hq = l->sq.shape[rank - 2];
    if (lse && (lse->kind != 'f' || (PACKED_Q(l->kind)
                                     ? lse->ndim != 2 || lse->shape[0] != Hq || lse->shape[1] != l->T
                                     : lse->ndim != 3 || lse->shape[0] != l->B || lse->shape[1] != Hq ||
                                       lse->shape[2] != l->Lmax)))
        return bad("lse should be floating, of the layout's shape %s", PACKED_Q(l->kind) ? "(Hq, T)" : "(B, Hq, L)");
    return 0;
}

/* the arrays a vector file may hold; any other may carry an option the kernels do not know: a skip */
static const char *const KNOWN[] = {
    "query", "key", "value", "attn_mask", "bias", "alibi_slopes", "dropout_mask", "q_lengths", "kv_lengths",
    "q_descale", "k_descale", "v_descale", "options_json", "out", "lse", "grad_out", "dq", "dk", "dv", "dbias",
    "honest_out", "honest_dq", "honest_dk", "honest_dv", "honest_dbias", "sinks", "dsinks", "honest_dsinks",
    "honest_lse", "cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "block_table", "gather_kv_indices", NULL};

/* the index arrays of a layout set (format 4), only there */
static const char *const LAYOUT_ARRAYS[] = {"cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "block_table", NULL};

/* the arrays stored in the vectors' dtype (bit patterns below float16) */
static const char *const IN_DTYPE[] = {"query", "key", "value", "attn_mask", "bias", "alibi_slopes", "grad_out", NULL};

static int listed(const char *const *list, const char *name)
{
    for (int i = 0; list[i]; i++)
        if (strcmp(list[i], name) == 0)
            return 1;
    return 0;
}

typedef struct {
    int passed, failed, skipped;                /* cases */
} Tally;

/* The case in `path` (named `name`): -1 on a bad file (why_bad), else 0 with its line printed. */
static int run_case(const char *path, const char *name, const Manifest *m, int backward, int with_lse, Tally *tally)
{
    Npz z;
    Opts o;
    Problem p;
    Line l;
    Grads g = {NULL, NULL, NULL, NULL, NULL};
    double *out = NULL, *lse = NULL, *st[5] = {NULL, NULL, NULL, NULL, NULL};   /* results as the layout stores them */
    Layout lay;
    char skip[sizeof why_bad] = "";
    int rc = -1;
    memset(&l, 0, sizeof l);
    memset(&lay, 0, sizeof lay);
    if (read_npz(path, &z) != 0)
        goto done;
    const char *missing = !get(&z, "query") ? "query" : !get(&z, "key") ? "key" : !get(&z, "value") ? "value"
                        : !get(&z, "out") ? "out" : !get(&z, "options_json") ? "options_json" : NULL;
    if (missing) {
        bad("has no %s array", missing);
        goto done;
    }
    /* bfloat16 and fp8: the arrays in the vectors' dtype are bit patterns; grad_out is in the output dtype */
    const Fmt *fmt = m->fmt, *ofmt = m->ofmt;
    for (int i = 0; i < z.n; i++) {
        Arr *a = &z.a[i];
        if (fmt->kind == 'f' || !listed(IN_DTYPE, a->name) || a->kind != 'u')
            continue;
        const Fmt *as = a->size == fmt->size ? fmt : a->size == ofmt->size ? ofmt : NULL;
        if (!as || as->kind == 'f') {
            bad("%s is stored as %d-byte integers, not as %s bit patterns", a->name, a->size, fmt->name);
            goto done;
        }
        a->kind = as->kind;
    }
    static const char *inputs[3] = {"query", "key", "value"};
    for (int t = 0; t < 3; t++) {
        const Arr *a = get(&z, inputs[t]);
        if (a->kind != fmt->kind || a->size != fmt->size) {
            bad("%s is not stored in the vectors' dtype %s", inputs[t], fmt->name);
            goto done;
        }
    }
    if (parse_options(get(&z, "options_json"), &o) != 0)
        goto done;
    if (m->layout != LAYOUT_DENSE) {                      /* a varlen or paged set: into the dense problem */
        if (layout_to_dense(&z, m->layout, &lay) != 0)
            goto done;
    } else {
        for (int i = 0; LAYOUT_ARRAYS[i]; i++)
            if (get(&z, LAYOUT_ARRAYS[i])) {
                bad("has %s, which only a set of a layout (format 4) holds", LAYOUT_ARRAYS[i]);
                goto done;
            }
    }
    int sk = check_problem(&z, &o, &p, skip, sizeof skip);
    if (sk < 0)
        goto done;
    for (int i = 0; sk == 0 && i < z.n; i++)              /* honest_* are errors, not options: never a skip */
        if (!listed(KNOWN, z.a[i].name) && strncmp(z.a[i].name, "honest_", 7) != 0) {
            snprintf(skip, sizeof skip, "the array %s is not known to this kernel", z.a[i].name);
            sk = 1;
        }
    /* the references: out of the shape batch + (Hq, L, Ev), in the user's rank; the gradients of the inputs' */
    const Arr *ref = get(&z, "out"), *honest, *go = get(&z, "grad_out");
    size_t oshape[MAXD + 3];
    int orank = p.nb + 3, urank = p.q->ndim;
    if (p.k->ndim > urank) urank = p.k->ndim;
    if (p.v->ndim > urank) urank = p.v->ndim;
    memcpy(oshape, p.batch, sizeof(size_t) * (size_t)p.nb);
    oshape[p.nb] = p.Hq;
    oshape[p.nb + 1] = p.L;
    oshape[p.nb + 2] = p.Ev;
    const Arr *lref = get(&z, "lse"), *lhonest = get(&z, "honest_lse");
    if (lay.kind && layout_refs_ok(&lay, ref, lref) != 0)
        goto done;
    if (!lay.kind && (ref->kind != 'f' || ref->ndim != urank ||
                      memcmp(ref->shape, oshape + orank - urank, sizeof(size_t) * (size_t)urank) != 0)) {
        char s1[96];
        shape_str(ref, s1, sizeof s1);
        bad("out %s should be floating, of the shape batch + (Hq, L, Ev) of query, key and value", s1);
        goto done;
    }
    if (honest_for(&z, "out", fmt, &honest) != 0)
        goto done;
    /* the LSE: batch + (Hq, L) in the user's rank; honest_lse below float64 (format 3; format 2 has none) */
    if (!lay.kind && lref && (lref->kind != 'f' || lref->ndim != urank - 1 ||
                 memcmp(lref->shape, oshape + orank - urank, sizeof(size_t) * (size_t)(urank - 1)) != 0)) {
        char s1[96];
        shape_str(lref, s1, sizeof s1);
        bad("lse %s should be floating, of the shape of out without its last dim", s1);
        goto done;
    }
    if (lref && lhonest && honest_for(&z, "lse", fmt, &lhonest) != 0)
        goto done;
    if (!lay.kind && go && (!is_float(go) || go->ndim != ref->ndim ||
                            memcmp(go->shape, ref->shape, sizeof(size_t) * (size_t)ref->ndim) != 0)) {
        bad("grad_out should be floating, of the shape of out");
        goto done;
    }
    static const char *gnames[5] = {"dq", "dk", "dv", "dbias", "dsinks"}, *lnames[2] = {"bias", "sinks"};
    const Arr *like[5] = {p.q, p.k, p.v, p.bias, p.sinks}, *gref[5], *ghonest[5] = {NULL, NULL, NULL, NULL, NULL};
    const Arr *stored[5] = {lay.kind ? &lay.sq : p.q, lay.kind ? &lay.sk : p.k, lay.kind ? &lay.sv : p.v, p.bias,
                            p.sinks};                     /* what the references have the shapes of */
    for (int t = 0; t < 5; t++) {
        gref[t] = like[t] ? get(&z, gnames[t]) : NULL;
        if (gref[t] && (check_ref(gref[t], gnames[t], stored[t], t < 3 ? inputs[t] : lnames[t - 3]) != 0 ||
                        honest_for(&z, gnames[t], fmt, &ghonest[t]) != 0))
            goto done;
    }
    if (backward && go && fmt->bits != 64 && !(m->k_grad > 0)) {
        bad("the manifest has no relative_rule k_grad to judge the gradients by");
        goto done;
    }
    rc = 0;
    if (sk == 0 && dequantize(&z, &p) != 0) {
        rc = -1;
        goto done;
    }
    /* the forward (in the dense problem: batch + (Hq, L, Ev), the LSE batch + (Hq, L)) */
    size_t ocount = lay.kind ? elems(elems(elems(lay.B, p.Hq), p.L), p.Ev) : ref->count;
    size_t lcount = lay.kind ? elems(elems(lay.B, p.Hq), p.L) : lref ? lref->count : 0;
    if (sk == 0 && (out = xcalloc(ocount ? ocount : 1, sizeof(double))) == NULL) {
        rc = -1;
        goto done;
    }
    if (sk == 0 && with_lse && lref && (lse = xcalloc(lcount ? lcount : 1, sizeof(double))) == NULL) {
        rc = -1;
        goto done;
    }
    if (sk == 0 && attention_forward(&p, out, lse, skip, sizeof skip) != 0)
        sk = 1;
    if (sk != 0) {
        printf("skip  %s: %s\n", name, skip);
        tally->skipped++;
        goto done;
    }
    for (size_t i = 0; BREAK == 1 && i < ref->count; i++) out[i] *= 1.01;   /* the tests' wrong kernel */
    if (lay.kind) {                                   /* where the layout keeps them */
        if ((st[0] = xcalloc(ref->count ? ref->count : 1, sizeof(double))) == NULL ||
            (lse && (st[1] = xcalloc(lref->count ? lref->count : 1, sizeof(double))) == NULL)) {
            rc = -1;
            goto done;
        }
        to_storage(&lay, out, 0, p.Hq, p.L, p.Ev, st[0], ref->count);
        if (lse)
            lse_to_storage(&lay, lse, p.Hq, st[1], lref->count);
    }
    judge_into(&l, "out", lay.kind ? st[0] : out, ref, honest, m->k_out, ofmt);
    if (BREAK == 8 && lse) {                    /* the tests' wrong kernel: lse 1% off */
        for (size_t i = 0; i < lcount; i++) lse[i] *= 1.01;
        if (lay.kind)
            lse_to_storage(&lay, lse, p.Hq, st[1], lref->count);
    }
    if (!lref)
        say(&l, ", lse not judged (not in the file)");
    else if (!with_lse)
        say(&l, ", lse not judged (the kernel returns none: --no-lse)");
    else if (fmt->bits != 64 && !lhonest)
        say(&l, ", lse not judged (no honest_lse: vectors of format 2)");
    else                                        /* kept in float32 below float64, as kernels keep it */
        judge_into(&l, "lse", lay.kind ? st[1] : lse, lref, lhonest, m->k_out, ofmt->bits < 32 ? &FORMATS[1] : ofmt);
    /* the backward */
    if (!backward) {
        say(&l, "; gradients not judged (the kernel has no backward: --forward-only)");
    } else if (!go) {
        say(&l, "; gradients not judged (the file has no grad_out)");
    } else {
        double **bufs[5] = {&g.dq, &g.dk, &g.dv, &g.dbias, &g.dsinks};
        for (int t = 0; t < 5; t++)
            if (like[t] && (*bufs[t] = xcalloc(like[t]->count, sizeof(double))) == NULL) {
                rc = -1;
                goto done;
            }
        if (attention_backward(&p, go, &g, skip, sizeof skip) != 0) {
            say(&l, "; gradients not judged (%s)", skip);
        } else {
            if (BREAK >= 2 && BREAK <= 6) {     /* the tests' wrong kernel: dq, dk, dv, dbias, dsinks 1% off */
                int w = BREAK - 2;
                for (size_t i = 0; like[w] && i < like[w]->count; i++)
                    (*bufs[w])[i] *= 1.01;
            }
            double *mine[5] = {g.dq, g.dk, g.dv, g.dbias, g.dsinks};
            for (int t = 0; lay.kind && t < 3; t++) {   /* dq, dk, dv where the layout keeps their inputs */
                size_t H = t ? p.Hkv : p.Hq, n = t ? p.S : p.L, F = t == 2 ? p.Ev : p.E;
                if ((st[2 + t] = xcalloc(stored[t]->count ? stored[t]->count : 1, sizeof(double))) == NULL) {
                    rc = -1;
                    goto done;
                }
                to_storage(&lay, mine[t], t > 0, H, n, F, st[2 + t], stored[t]->count);
                mine[t] = st[2 + t];
            }
            for (int t = 0; t < 5; t++) {
                if (!like[t])
                    continue;
                if (!gref[t])
                    say(&l, ", %s not judged (not in the file)", gnames[t]);
                else                            /* dsinks in the sinks' own dtype: float32 below float64 */
                    judge_into(&l, gnames[t], mine[t], gref[t], ghonest[t], m->k_grad,
                               t == 4 && ofmt->bits < 32 ? &FORMATS[1] : ofmt);
            }
        }
    }
    if (l.judged == 0) {
        printf("skip  %s: nothing to judge (%s)\n", name, l.text);
        tally->skipped++;
    } else {
        printf("%s  %s: %s\n", l.failed ? "FAIL" : "pass", name, l.text);
        if (l.failed) tally->failed++; else tally->passed++;
    }
done:
    layout_free(&lay);
    for (int t = 0; t < 5; t++) free(st[t]);
    for (int t = 0; t < 3; t++) free(z.owned[t]);
    for (int i = 0; i < z.n; i++) free(z.data[i]);
    free(g.dq);
    free(g.dk);
    free(g.dv);
    free(g.dbias);
    free(g.dsinks);
    free(out);
    free(lse);
    free(z.buf);
    return rc;
}

/* ------------------------------------------------------------------ main */

static int usage(FILE *f, const char *argv0, int status)
{
    fprintf(f, "usage: %s [--forward-only] [--no-lse] DIR   (a folder written by `sdpa-ref vectors DIR`); exit "
               "status 0 pass, 1 fail, 2 bad input, 3 nothing judged\n", argv0);
    return status;
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *argv0 = argc > 0 ? argv[0] : "sdpa_check";
    int backward = 1, with_lse = 1;
#ifdef SDPA_CHECK_NO_BACKWARD
    backward = 0;
#endif
#ifdef SDPA_CHECK_NO_LSE
    with_lse = 0;
#endif
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--forward-only") == 0)
            backward = 0;
        else if (strcmp(argv[i], "--no-lse") == 0)
            with_lse = 0;
        else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0)
            return usage(stdout, argv0, 0);
        else if (argv[i][0] == '-' || dir)
            return usage(stderr, argv0, 2);
        else
            dir = argv[i];
    }
    if (!dir)
        return usage(stderr, argv0, 2);
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) {
        fprintf(stderr, "sdpa_check: this client reads the little-endian arrays on a little-endian machine only\n");
        return 2;
    }
    char path[4096];
    Manifest m;
    size_t mlen;
    memset(&m, 0, sizeof m);
    if ((size_t)snprintf(path, sizeof path, "%s/manifest.json", dir) >= sizeof path) {
        fprintf(stderr, "sdpa_check: %s: the folder's path is too long\n", dir);
        return 2;
    }
    if ((m.text = (char *)read_file(path, MAX_MANIFEST_BYTES, &mlen)) == NULL || parse_manifest(&m, mlen) != 0) {
        fprintf(stderr, "sdpa_check: cannot read %s: %s\n", path, why_bad);
        free(m.text);
        free(m.files);
        return 2;
    }
    if (m.fmt->bits != 64 && !(m.k_out > 0)) {
        fprintf(stderr, "sdpa_check: cannot read %s: no relative_rule k_out to judge by\n", path);
        free(m.text);
        free(m.files);
        return 2;
    }
    Tally t = {0, 0, 0};
    int status = 0;
    for (size_t f = 0; f < m.nfiles && status == 0; f++) {
        char name[5 * 256];                                     /* "plain-L8-S8.npz" -> "plain-L8-S8", shown */
        const Name *file = &m.files[f];
        shown(file->s, file->n - 4, name, sizeof name);
        if ((size_t)snprintf(path, sizeof path, "%s/%.*s", dir, (int)file->n, file->s) >= sizeof path) {
            fprintf(stderr, "sdpa_check: %s/%s.npz: the path is too long\n", dir, name);
            status = 2;
        } else if (run_case(path, name, &m, backward, with_lse, &t) != 0) {
            fflush(stdout);
            fprintf(stderr, "sdpa_check: cannot read %s/%s.npz: %s\n", dir, name, why_bad);
            status = 2;
        }
    }
    free(m.text);
    free(m.files);
    if (status)
        return status;
    int judged = t.passed + t.failed;
    printf("%d passed, %d failed, %d skipped%s\n", t.passed, t.failed, t.skipped, judged ? "" : ": nothing judged");
    return t.failed ? 1 : judged ? 0 : 3;
}
