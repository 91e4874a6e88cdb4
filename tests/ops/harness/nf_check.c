/* Python-free correctness check of the normfold CPU kernels, for ISA paths that cannot run here
 * (NEON under qemu-aarch64) and as a second opinion on the native ones. Includes the kernel source
 * directly, so it tests whichever path the compiler flags select (nf_isa() says which).
 *
 * Every case compares with a double-precision reference computed from the same (rounded) inputs:
 * forward RMSNorm and CRMSNorm with none/weight/bias/both, the fused residual add, backward (dx, dw,
 * db), float32 / bfloat16 / float16, odd widths, rows with NaN / Inf (whole row NaN), 0 rows.
 * Prints one line per failure and a summary; exit status 0 only when every case passes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "rmsnorm_cpu.c"

static uint64_t rng = 88172645463325252ull;
static double urand(void) { /* xorshift, uniform in [-1, 1) */
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (double)(rng >> 11) / (double)(1ull << 52) * 2.0 - 1.0;
}

static uint16_t f2h(float f) { /* float -> IEEE half, round to nearest even (reference only) */
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t m = u & 0x7fffffu;
    if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u : 0));
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        m |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e), half = 1u << (shift - 1);
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = m >> 13, rem = m & 0x1fffu;
    uint32_t h = sign | ((uint32_t)e << 10) | r;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
    return (uint16_t)h;
}
static double h2d(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m | 0x400, e - 25);
    return (h & 0x8000) ? -v : v;
}

static size_t esize(int dt) { return dt == NF_F32 ? 4 : 2; }
static void store(int dt, void *p, int64_t i, double v) {
    if (dt == NF_F32) ((float *)p)[i] = (float)v;
    else if (dt == NF_BF16) ((uint16_t *)p)[i] = nf_f32_to_bf16((float)v);
    else ((uint16_t *)p)[i] = f2h((float)v);
}
static double load(int dt, const void *p, int64_t i) {
    if (dt == NF_F32) return ((const float *)p)[i];
    if (dt == NF_BF16) return nf_bf16_to_f32(((const uint16_t *)p)[i]);
    return h2d(((const uint16_t *)p)[i]);
}
static double tol_of(int dt) { return dt == NF_F32 ? 2e-6 : dt == NF_BF16 ? 4e-3 : 5e-4; }
static const char *name_of(int dt) { return dt == NF_F32 ? "float32" : dt == NF_BF16 ? "bfloat16" : "float16"; }

static int failures = 0, checks = 0;
static void expect(int ok, const char *what, int dt, int64_t rows, int64_t n, double err) {
    checks++;
    if (!ok) { failures++; printf("FAIL %s %s rows=%lld n=%lld err=%g\n", what, name_of(dt), (long long)rows, (long long)n, err); }
}

/* forward (optionally fused add) vs double reference */
static void check_forward(int dt, int64_t rows, int64_t n, int compressed, int hw, int hb, int fused) {
    size_t es = esize(dt);
    void *x = malloc(rows * n * es + 1), *r = malloc(rows * n * es + 1), *y = malloc(rows * n * es + 1);
    void *s = malloc(rows * n * es + 1);
    float *w = malloc(n * 4), *b = malloc(n * 4), *rstd = malloc((rows + 1) * 4);
    for (int64_t i = 0; i < rows * n; i++) {
        store(dt, x, i, urand() * 3 + (i % n == 0 ? 60 : 0));
        store(dt, r, i, urand());
    }
    for (int64_t j = 0; j < n; j++) { w[j] = (float)(1 + 0.5 * urand()); b[j] = (float)(0.5 * urand()); }
    const float eps = 1e-5f;
    int rc = nf_forward(dt, x, n, fused ? r : 0, n, hw ? w : 0, NF_F32, hb ? b : 0, NF_F32, y, fused ? s : 0,
                        rstd, rows, n, eps, compressed, 1);
    double maxerr = 0, maxref = 1e-30;
    for (int64_t i = 0; i < rows; i++) {
        double sq = 0, sm = 0;
        for (int64_t j = 0; j < n; j++) {
            double v = load(dt, x, i * n + j);
            if (fused) {
                double want_s = load(dt, x, i * n + j) + load(dt, r, i * n + j);
                /* s is x + r rounded once to the dtype */
                void *tmp = malloc(4); store(dt, tmp, 0, (float)want_s); v = load(dt, tmp, 0); free(tmp);
                if (load(dt, s, i * n + j) != v) maxerr = INFINITY;
            }
            sq += v * v; sm += v;
        }
        double ms = compressed ? (sq + sm * sm) / (n + 1) : sq / n;
        double rs = 1 / sqrt(ms + eps);
        for (int64_t j = 0; j < n; j++) {
            double v = fused ? load(dt, s, i * n + j) : load(dt, x, i * n + j);
            double want = v * rs * (hw ? w[j] : 1) + (hb ? b[j] : 0);
            double got = load(dt, y, i * n + j);
            if (fabs(got - want) > maxerr) maxerr = fabs(got - want);
            if (fabs(want) > maxref) maxref = fabs(want);
        }
    }
    expect(rc == 0 && maxerr / maxref <= tol_of(dt), fused ? "add_forward" : (compressed ? "crms_forward" : "rms_forward"),
           dt, rows, n, maxerr / maxref);
    free(x); free(r); free(y); free(s); free(w); free(b); free(rstd);
}

static void check_backward(int dt, int64_t rows, int64_t n, int compressed) {
    size_t es = esize(dt);
    void *x = malloc(rows * n * es), *dy = malloc(rows * n * es), *dx = malloc(rows * n * es), *y = malloc(rows * n * es);
    float *w = malloc(n * 4), *rstd = malloc(rows * 4), *dw = calloc(n, 4), *db = calloc(n, 4);
    for (int64_t i = 0; i < rows * n; i++) { store(dt, x, i, urand() * 2); store(dt, dy, i, urand()); }
    for (int64_t j = 0; j < n; j++) w[j] = (float)(1 + 0.5 * urand());
    nf_forward(dt, x, n, 0, 0, w, NF_F32, 0, 0, y, 0, rstd, rows, n, 1e-5f, compressed, 1);
    int rc = nf_backward(dt, dy, 0, x, n, w, NF_F32, rstd, dx, dw, db, rows, n, compressed, 1);
    double *rdw = calloc(n, sizeof(double)), *rdb = calloc(n, sizeof(double));
    double ex = 0, mx = 1e-30;
    const double d = compressed ? n + 1 : n;
    for (int64_t i = 0; i < rows; i++) {
        double sq = 0, sm = 0, c = 0;
        for (int64_t j = 0; j < n; j++) { double v = load(dt, x, i * n + j); sq += v * v; sm += v; }
        double rs = 1 / sqrt((compressed ? sq + sm * sm : sq) / d + 1e-5);
        for (int64_t j = 0; j < n; j++) c += load(dt, dy, i * n + j) * w[j] * load(dt, x, i * n + j);
        for (int64_t j = 0; j < n; j++) {
            double v = load(dt, x, i * n + j), g = load(dt, dy, i * n + j) * w[j];
            double want = rs * g - rs * rs * rs * c / d * (v + (compressed ? sm : 0));
            double e = fabs(load(dt, dx, i * n + j) - want);
            if (e > ex) ex = e;
            /* scale: the larger of the two terms (at n = 1 they cancel to eps / (x^2 + eps)^1.5) */
            if (fabs(rs * g) > mx) mx = fabs(rs * g);
            rdw[j] += load(dt, dy, i * n + j) * v * rs;
            rdb[j] += load(dt, dy, i * n + j);
        }
    }
    double ew = 0, mw = 1e-30, eb = 0, mb = 1e-30;
    for (int64_t j = 0; j < n; j++) {
        if (fabs(dw[j] - rdw[j]) > ew) ew = fabs(dw[j] - rdw[j]);
        if (fabs(rdw[j]) > mw) mw = fabs(rdw[j]);
        if (fabs(db[j] - rdb[j]) > eb) eb = fabs(db[j] - rdb[j]);
        if (fabs(rdb[j]) > mb) mb = fabs(rdb[j]);
    }
    double tol = 2 * tol_of(dt);
    expect(rc == 0 && ex / mx <= tol, "backward dx", dt, rows, n, ex / mx);
    expect(rc == 0 && ew / mw <= tol && eb / mb <= tol, "backward dw/db", dt, rows, n, ew / mw > eb / mb ? ew / mw : eb / mb);
    free(x); free(dy); free(dx); free(y); free(w); free(rstd); free(dw); free(db); free(rdw); free(rdb);
}

static void check_non_finite(int dt) {
    const int64_t rows = 4, n = 767;
    size_t es = esize(dt);
    void *x = malloc(rows * n * es), *y = malloc(rows * n * es);
    for (int64_t i = 0; i < rows * n; i++) store(dt, x, i, urand());
    store(dt, x, 0 * n + 5, NAN);
    store(dt, x, 1 * n + 700, INFINITY);
    store(dt, x, 2 * n + 3, -INFINITY);
    nf_forward(dt, x, n, 0, 0, 0, 0, 0, 0, y, 0, 0, rows, n, 1e-5f, 0, 1);
    int ok = 1;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < n; j++) {
            double v = load(dt, y, i * n + j);
            if (i < 3 ? !isnan(v) : !isfinite(v)) ok = 0;
        }
    expect(ok, "non-finite rows all NaN", dt, rows, n, 0);
    expect(nf_forward(dt, x, n, 0, 0, 0, 0, 0, 0, y, 0, 0, 0, n, 1e-5f, 0, 1) == 0, "zero rows", dt, 0, n, 0);
    free(x); free(y);
}

int main(void) {
    static const char *isa[] = {"?", "portable", "avx512", "avx2", "neon"};
    const int64_t widths[] = {1, 3, 5, 17, 64, 129, 767, 768, 4095, 4097};
    for (int dt = 0; dt < 3; dt++) {
        if (!nf_supports_dtype(dt)) { printf("FAIL %s unsupported\n", name_of(dt)); failures++; continue; }
        for (size_t k = 0; k < sizeof widths / sizeof *widths; k++) {
            int64_t n = widths[k];
            for (int c = 0; c < 2; c++) {
                for (int a = 0; a < 4; a++) check_forward(dt, 5, n, c, a & 1, a >> 1, 0);
                check_forward(dt, 9, n, c, 1, 0, 1);
                check_backward(dt, 6, n, c);
            }
        }
        check_non_finite(dt);
    }
    printf("isa=%s checks=%d failures=%d\n", isa[nf_isa()], checks, failures);
    return failures != 0;
}
