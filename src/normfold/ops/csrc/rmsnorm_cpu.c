/* normfold CPU kernels: RMSNorm and CRMSNorm over the last dimension, forward and backward, with
 * optional weight and bias and an optional fused residual add (s = x + r; y = norm(s)).
 *
 * Built on first use by normfold/ops/cpu.py (cc -O3 -march=native -fopenmp -shared) and called
 * through ctypes. nf_simd.h picks AVX-512 intrinsics or a portable vector-extension version for the
 * building CPU; nf_kernels.h holds the row kernels, instantiated here for float32, bfloat16 and
 * float16. Rows are split across OpenMP threads; torch ships libgomp.so.1 with the same soname, so
 * this library joins torch's thread pool instead of starting a second one.
 *
 * Statistics accumulate in float32 for every dtype; the affine is applied in float32 and each
 * result rounded once to the output dtype. CRMSNorm (paper 001 eq. 5) takes the first n = d-1
 * coordinates of a zero-mean vector: ms = (Σx² + (Σx)²)/d, y = x / sqrt(ms + eps) · w + b.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nf_simd.h"

#ifdef _OPENMP
#include <omp.h>
static inline int nf_thread_num(void) { return omp_get_thread_num(); }
static inline int nf_num_threads(void) { return omp_get_num_threads(); }
#else
static inline int nf_thread_num(void) { return 0; }
static inline int nf_num_threads(void) { return 1; }
#endif

#define NF_INLINE inline __attribute__((always_inline))
#define NF_ABI_VERSION 6
/* Below this many elements per thread a parallel region costs more than it saves. Measured on the
 * Zen 5 EPYC, 2 threads, torch 2.13 (docs/kernels-cpu.md, "Threads for mid-sized inputs"): norms of
 * 16-64 K elements ran 4-18% faster on both threads than on one in isolation, and float32 / bfloat16
 * ones faster inside models too, where the ops around them keep the OpenMP pool awake. float16 keeps
 * ATen's 32 K: PyTorch's CPU float16 matmuls run on one thread, the pool is asleep when the norm
 * after one starts, and waking it cost more than the second thread saved (the bundled model's
 * float16 norms went from 0.48-0.61 to 0.94-0.99 of LayerNorm's time with 8 K). */
#define NF_GRAIN 8192
#define NF_GRAIN_F16 32768
/* Rows per block (see nf_kernels.h). */
#ifndef NF_RB
#define NF_RB 4
#endif
/* Forward blocks only while NF_RB rows fit in this many bytes of L1 (see nf_kernels.h). */
#define NF_L1_BLOCK 16384

#include "nf_bf16dot.h"
#include "nf_bf16pair.h"

enum { NF_F32 = 0, NF_BF16 = 1, NF_F16 = 2 };

/* rows[0] += rows[1..k-1] (per-thread partial sums of dweight / dbias). */
static void nf_reduce_rows(float *rows, int k, int64_t n) {
    if (!rows) return;
    for (int t = 1; t < k; t++)
        for (int64_t j = 0; j < n; j++) rows[j] += rows[(int64_t)t * n + j];
}

/* One instantiation per dtype: NF_FWD_BLOCK says whether forward blocks pay off (half types), and
 * NF_USE_BF16DOT takes bf16 statistics from nf_bf16dot.h. */
#define NF_USE_BF16PAIR 0
#define NF_T float
#define NF_S f32
#define NF_STREAMS 1
#define NF_FWD_BLOCK 0
#define NF_USE_BF16DOT 0
#include "nf_kernels.h"
#undef NF_T
#undef NF_S
#undef NF_FWD_BLOCK
#undef NF_USE_BF16DOT

#define NF_T uint16_t
#define NF_S bf16
#define NF_FWD_BLOCK 1
#define NF_USE_BF16DOT NF_BF16DOT
#include "nf_kernels.h"
#undef NF_T
#undef NF_S
#undef NF_FWD_BLOCK
#undef NF_USE_BF16DOT

/* bf16 again with the NaN-blind rounding (nf_simd.h, bf16q), used when nf_bf16q_exact allows; on
 * the AVX2 path it runs the pair layout of nf_bf16pair.h. */
#define NF_T uint16_t
#define NF_S bf16q
#define NF_FWD_BLOCK 1
#define NF_USE_BF16DOT NF_BF16DOT
#undef NF_USE_BF16PAIR
#define NF_USE_BF16PAIR NF_BF16PAIR
#include "nf_kernels.h"
#undef NF_T
#undef NF_S
#undef NF_FWD_BLOCK
#undef NF_USE_BF16DOT
#undef NF_USE_BF16PAIR
#define NF_USE_BF16PAIR 0

#if NF_HAVE_F16
#define NF_T nf_f16
#define NF_S f16
#define NF_FWD_BLOCK 1
#define NF_USE_BF16DOT 0
#include "nf_kernels.h"
#undef NF_T
#undef NF_S
#undef NF_FWD_BLOCK
#undef NF_USE_BF16DOT
#endif

/* A weight or bias as float32: itself when it already is, else a converted copy (caller frees). */
/* A bf16 / float16 weight or bias widened to float32, vector-wide (hardware conversion): it runs on
 * every call of a half-precision model, where a scalar loop cost ~1 us per 4096 values, a norm's
 * whole budget at decode sizes. */
static const float *nf_param_f32(const void *p, int dtype, int64_t n, float **owned) {
    *owned = 0;
    if (!p || dtype == NF_F32) return (const float *)p;
    float *out = (float *)malloc((size_t)n * sizeof(float));
    if (!out) return 0;
    int64_t j = 0;
    if (dtype == NF_BF16) {
        const uint16_t *q = (const uint16_t *)p;
        for (; j + NF_VW <= n; j += NF_VW) st_f32(out + j, ld_bf16(q + j));
        if (j < n) stn_f32(out + j, ldn_bf16(q + j, n - j), n - j);
    }
#if NF_HAVE_F16
    else {
        const nf_f16 *q = (const nf_f16 *)p;
        for (; j + NF_VW <= n; j += NF_VW) st_f32(out + j, ld_f16(q + j));
        if (j < n) stn_f32(out + j, ldn_f16(q + j, n - j), n - j);
    }
#endif
    *owned = out;
    return out;
}

/* Whether bf16q may round products with this parameter (given as dtype `dt`, now float32 in p):
 * parameters given in bf16 are bf16 data; only float32 ones need the scan (nf_simd.h, bf16q). */
static int nf_bf16q_ok(const float *p, int dt, int64_t n) { return dt != NF_F32 || nf_bf16q_exact(p, n); }

static int nf_threads_for(int requested, int64_t rows, int64_t n, int dtype) {
    int64_t by_work = (rows * n) / (dtype == NF_F16 ? NF_GRAIN_F16 : NF_GRAIN);
    int64_t t = requested < by_work ? requested : by_work;
    if (t > rows) t = rows;
    return t < 1 ? 1 : (int)t;
}

/* Backward blocks rows (see nf_kernels.h) when its rows are wide or when dy, x and dx together fit
 * in cache; otherwise they stream from memory and one row at a time wins. The 20 MiB bound was
 * measured on a 32 MiB-L3 EPYC (18 MiB: blocks faster, 24 MiB and more: slower). It is a constant:
 * sysconf's cache size is unreliable in VMs (it reported the whole socket's 384 MiB there). */
#define NF_BWD_CACHED_BYTES ((int64_t)20 << 20)

static int nf_backward_block_rows(int64_t rows, int64_t n, int64_t elem) {
    return (n * elem >= 8192 || 3 * rows * n * elem <= NF_BWD_CACHED_BYTES) ? NF_RB : 1;
}

/* Streaming stores pay off only when the tensors a kernel touches do not fit in cache anyway (a
 * streamed output is in memory, not in cache, when the next op reads it). `one_thread`: the bound
 * with one thread; with more, both kernels measured it at 40 MiB (the 32 MiB L3 plus some). */
#define NF_STREAM_BYTES ((int64_t)40 << 20)

static int nf_past_cache(int64_t bytes, int nth, int64_t one_thread) {
    return NF_HAVE_STREAM && bytes > (nth == 1 ? one_thread : NF_STREAM_BYTES);
}

/* The float32 blocked backward of wide rows writes NF_RB dx rows at once, and their
 * read-for-ownership traffic shows. Streaming stores skip it, but leave dx in memory rather than in
 * cache, where the next op would read it: so only when dy, x and dx together do not fit in cache
 * anyway. Measured on the Zen 5 EPYC (interleaved A/B of the kernel alone), AVX-512: one thread
 * 0.68-0.79x the time at 24-48 MiB (512x4096 to 2048x2048; 0.88-0.93x at 3-12 MiB, not taken);
 * two threads 0.76-0.88x at 48 MiB, 0.98-1.02x at 24 MiB; the AVX2 path alike (one thread
 * 0.79-0.82x, two 0.87-0.88x at 48 MiB). bfloat16 / float16 rows (half the bytes per vector,
 * conversion work per element) ran 0.91-1.17x with them, so they keep ordinary stores, as do narrow
 * rows (one row at a time). */
static int nf_backward_streams(int64_t rows, int64_t n, int64_t elem, int nth) {
    return elem == 4 && n * elem >= 8192 && nf_past_cache(3 * rows * n * elem, nth, NF_BWD_CACHED_BYTES);
}

/* The float32 fused add writes s and y, each after a read-for-ownership of its lines; past the cache
 * streaming stores skip that, and the normalize pass recomputes x + r (exact in float32, and x and
 * r are in L1) instead of reading s back. Measured on the Zen 5 EPYC, AVX-512, kernel alone,
 * interleaved A/B, x, r, s, y together: one thread 0.69-0.86x the time from 32 MiB (2048x1024,
 * 512x4096) to 128 MiB (8192x1024), 1.09-1.41x at 12-24 MiB; two threads 0.76-0.92x from 48 MiB,
 * 1.05-2.04x at 32 MiB and less. Unlike the backward's, this gain holds for narrow rows too. */
#define NF_ADD_STREAM_BYTES_1T ((int64_t)30 << 20)

/* float32 only: the caller is the float32 case */
static int nf_add_streams(int64_t rows, int64_t n, int nth, const void *res, const void *y) {
    return res && y && nf_past_cache(4 * rows * n * (int64_t)sizeof(float), nth, NF_ADD_STREAM_BYTES_1T);
}

/* ---- exported entry points (ctypes) ---- */

int nf_abi_version(void) { return NF_ABI_VERSION; }

/* 2 = AVX-512, 3 = AVX2+FMA+F16C, 4 = NEON, 1 = portable vector code (see nf_simd.h). */
int nf_isa(void) { return NF_ISA; }

int nf_supports_dtype(int dtype) { return dtype == NF_F32 || dtype == NF_BF16 || (dtype == NF_F16 && NF_HAVE_F16); }

/* y = norm(x) or, with res, s = x + res and y = norm(s). x and res rows are xs / rst elements apart
 * (last dimension contiguous); y, s are contiguous. rstd (optional) gets 1/sqrt(ms + eps) per row.
 * y = 0 computes only rstd (and s): the row scale of a norm folded into the next matrix multiply.
 * w / b are optional, of dtype wdt / bdt (float32 or the input dtype). Returns 0, or -1 for an
 * unsupported dtype, -2 when out of memory. */
int nf_forward(int dtype, const void *x, int64_t xs, const void *res, int64_t rst, const void *w, int wdt,
               const void *b, int bdt, void *y, void *s, float *rstd, int64_t rows, int64_t n, float eps,
               int compressed, int nthreads) {
    if (!nf_supports_dtype(dtype)) return -1;
    float *wo, *bo;
    const float *wf = nf_param_f32(w, wdt, n, &wo), *bf = nf_param_f32(b, bdt, n, &bo);
    if ((w && !wf) || (b && !bf)) { free(wo); free(bo); return -2; }
    const int nth = nf_threads_for(nthreads, rows, n, dtype);
    float *pair = 0; /* w and b in pair layout (nf_bf16pair.h), when worth preparing */
    switch (dtype) {
    case NF_F32:
        forward_f32(x, xs, res, rst, wf, bf, 0, 0, y, s, rstd, rows, n, eps, compressed, nth,
                    nf_add_streams(rows, n, nth, res, y));
        break;
    case NF_BF16:
        if (!nf_bf16q_ok(wf, wdt, n) || !nf_bf16q_ok(bf, bdt, n)) {
            forward_bf16(x, xs, res, rst, wf, bf, 0, 0, y, s, rstd, rows, n, eps, compressed, nth, 0);
            break;
        }
#if NF_BF16PAIR
        if ((wf || bf) && rows >= NF_PAIR_MIN_ROWS && (pair = (float *)malloc((size_t)n * 2 * sizeof(float)))) {
            if (wf) nf_pair_params(wf, n, pair);
            if (bf) nf_pair_params(bf, n, pair + n);
        }
#endif
        forward_bf16q(x, xs, res, rst, wf, bf, pair && wf ? pair : 0, pair && bf ? pair + n : 0, y, s, rstd, rows, n,
                      eps, compressed, nth, 0);
        break;
#if NF_HAVE_F16
    case NF_F16: forward_f16(x, xs, res, rst, wf, bf, 0, 0, y, s, rstd, rows, n, eps, compressed, nth, 0); break;
#endif
    }
    free(pair);
    free(wo);
    free(bo);
    return 0;
}

/* The decode-time common case in fewer arguments (each ctypes argument costs ~0.2 us): contiguous
 * x and y, no residual, no rstd, RMSNorm or CRMSNorm. */
int nf_forward_simple(int dtype, const void *x, const void *w, int wdt, const void *b, int bdt, void *y,
                      int64_t rows, int64_t n, float eps, int compressed, int nthreads) {
    return nf_forward(dtype, x, n, 0, 0, w, wdt, b, bdt, y, 0, 0, rows, n, eps, compressed, nthreads);
}

/* dx from dy (and ds, the gradient of the fused sum, when given); x is the normalized input (the sum
 * s for the fused op), xs elements between rows. dw_part / db_part (optional) are nthreads x n
 * float32 scratch rows; on return row 0 holds dweight / dbias. */
int nf_backward(int dtype, const void *dy, const void *ds, const void *x, int64_t xs, const void *w, int wdt,
                const float *rstd, void *dx, float *dw_part, float *db_part, int64_t rows, int64_t n,
                int compressed, int nthreads) {
    if (!nf_supports_dtype(dtype)) return -1;
    float *wo;
    const float *wf = nf_param_f32(w, wdt, n, &wo);
    if (w && !wf) return -2;
    const int nth = nf_threads_for(nthreads, rows, n, dtype);
    const int64_t elem = dtype == NF_F32 ? 4 : 2;
    const int rb = nf_backward_block_rows(rows, n, elem), nt = nf_backward_streams(rows, n, elem, nth);
    switch (dtype) {
    case NF_F32: backward_f32(dy, ds, x, xs, wf, rstd, dx, dw_part, db_part, rows, n, compressed, nth, rb, nt); break;
    case NF_BF16:
        if (nf_bf16q_ok(wf, wdt, n))
            backward_bf16q(dy, ds, x, xs, wf, rstd, dx, dw_part, db_part, rows, n, compressed, nth, rb, nt);
        else
            backward_bf16(dy, ds, x, xs, wf, rstd, dx, dw_part, db_part, rows, n, compressed, nth, rb, nt);
        break;
#if NF_HAVE_F16
    case NF_F16: backward_f16(dy, ds, x, xs, wf, rstd, dx, dw_part, db_part, rows, n, compressed, nth, rb, nt); break;
#endif
    }
    free(wo);
    return 0;
}

/* ---- fast Walsh-Hadamard transform (online rotations) ----
 * y = x · (H_m ⊗ H_p) · scale per row of n = m*p float32 values (p = 2^k; x, y contiguous, y == x allowed:
 * in place). Per row, per chunk c < m of p values: log2(p) butterfly stages (a, b) -> (a + b, a - b) over
 * pairs (i, i + h), h = 1, 2, ..., p/2 (the same adds in the same order as normfold.ops.hadamard.fwht);
 * then, when core (m x m, row-major, entries ±1) is given, out[j] = 0 + sum_i core[i][j] * y[i] chunk by
 * chunk (i ascending: the products are exact, so contracting them into FMAs rounds the same); finally
 * times scale (one multiply of each rounded value: applied as the last stage or the core sum is stored,
 * it rounds the same as a separate pass). So the result is bit-identical to the aten fwht.
 *
 * Rows stay in their layout: with p >= 8 a chunk is p/8 vectors of 8 lanes (GCC/Clang vector extensions,
 * compiled for every ISA path); the stages h = 1, 2, 4 are lane shuffles inside one vector (lanes with bit
 * h set compute -b + a, equal to a - b), the stages h = 8 .. 32 run on 8 vectors held in registers and
 * the larger ones as passes over the row, into a row of scratch when a core follows; the core sums then
 * go from the scratch to y, 8 vectors of an output chunk at a time (8 independent accumulators). Widths with p < 8 take a
 * scalar loop. Rows are split over up to `nthreads` OpenMP threads (when built with OpenMP), at least
 * NF_GRAIN elements each, like the norms.
 * Returns 0, or -1 on a bad argument. */
typedef float nf_v8 __attribute__((vector_size(32)));
typedef int32_t nf_i8 __attribute__((vector_size(32)));
typedef float nf_v8u __attribute__((vector_size(32), aligned(4), may_alias));
#if defined(__clang__)
#define NF_SHUF8(v, a, b, c, d, e, f, g, h) __builtin_shufflevector(v, v, a, b, c, d, e, f, g, h)
#else
#define NF_SHUF8(v, a, b, c, d, e, f, g, h) __builtin_shuffle(v, (nf_i8){a, b, c, d, e, f, g, h})
#endif
#define NF_SGN ((int32_t)0x80000000)

static inline nf_v8 nf_v8_ld(const float *p) { return *(const nf_v8u *)p; }
static inline void nf_v8_st(float *p, nf_v8 v) { *(nf_v8u *)p = v; }
static inline nf_v8 nf_v8_flip(nf_v8 v, nf_i8 m) { return (nf_v8)((nf_i8)v ^ m); }

/* stages h = 1, 2, 4 inside one vector of 8 consecutive values */
static inline nf_v8 nf_fwht8(nf_v8 v) {
    v = nf_v8_flip(v, (nf_i8){0, NF_SGN, 0, NF_SGN, 0, NF_SGN, 0, NF_SGN}) + NF_SHUF8(v, 1, 0, 3, 2, 5, 4, 7, 6);
    v = nf_v8_flip(v, (nf_i8){0, 0, NF_SGN, NF_SGN, 0, 0, NF_SGN, NF_SGN}) + NF_SHUF8(v, 2, 3, 0, 1, 6, 7, 4, 5);
    v = nf_v8_flip(v, (nf_i8){0, 0, 0, 0, NF_SGN, NF_SGN, NF_SGN, NF_SGN}) + NF_SHUF8(v, 4, 5, 6, 7, 0, 1, 2, 3);
    return v;
}

/* stages h = 1 .. 8*G/2 on G (1, 2, 4 or 8) consecutive vectors, src -> dst, times s when `last` */
static inline __attribute__((always_inline)) void nf_fwht_group(const float *src, float *dst, int G, int last,
                                                                 float s) {
    nf_v8 r[8];
#pragma GCC unroll 8
    for (int k = 0; k < G; k++) r[k] = nf_fwht8(nf_v8_ld(src + 8 * k));
#pragma GCC unroll 8
    for (int d = 1; d < G; d *= 2)
#pragma GCC unroll 8
        for (int i = 0; i < G; i += 2 * d)
#pragma GCC unroll 8
            for (int k = i; k < i + d; k++) {
                const nf_v8 a = r[k], b = r[(k + d) & 7];  /* k + d < G <= 8; the mask only quiets -Warray-bounds */
                r[k] = a + b;
                r[(k + d) & 7] = a - b;
            }
    if (last)
#pragma GCC unroll 8
        for (int k = 0; k < G; k++) r[k] *= s;
#pragma GCC unroll 8
    for (int k = 0; k < G; k++) nf_v8_st(dst + 8 * k, r[k]);
}

/* one chunk of p >= 8 values (p/8 vectors), src -> dst; times s when `last` (no core follows) */
static void nf_fwht_chunk(const float *src, float *dst, int64_t p, int last, float s) {
    const int64_t nv = p / 8;
    if (nv == 1) { nf_fwht_group(src, dst, 1, last, s); return; }
    if (nv == 2) { nf_fwht_group(src, dst, 2, last, s); return; }
    if (nv == 4) { nf_fwht_group(src, dst, 4, last, s); return; }
    if (nv == 8) { nf_fwht_group(src, dst, 8, last, s); return; }
    for (int64_t v = 0; v < nv; v += 8) nf_fwht_group(src + 8 * v, dst + 8 * v, 8, 0, s);
    for (int64_t d = 8; d < nv; d *= 2) {
        const int sc = last && 2 * d == nv;
        for (int64_t i = 0; i < nv; i += 2 * d)
            for (int64_t k = i; k < i + d; k++) {
                const nf_v8 a = nf_v8_ld(dst + 8 * k), b = nf_v8_ld(dst + 8 * (k + d));
                nf_v8 u = a + b, w = a - b;
                if (sc) { u *= s; w *= s; }
                nf_v8_st(dst + 8 * k, u);
                nf_v8_st(dst + 8 * (k + d), w);
            }
    }
}

/* core sums over the m chunks of one row (p >= 8), t -> y, times s: for each output chunk j, G vectors
 * of it at a time are G independent accumulators, each term one multiply-add with a vector of t */
static inline __attribute__((always_inline)) void nf_fwht_core_g(const float *t, float *y, int64_t m, int64_t p,
                                                                  const float *core, float s, int G) {
    for (int64_t q = 0; q < p; q += 8 * G)
        for (int64_t j = 0; j < m; j++) {
            nf_v8 acc[8];
#pragma GCC unroll 8
            for (int k = 0; k < G; k++) acc[k] = (nf_v8){0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t i = 0; i < m; i++) {
                const float c = core[i * m + j];
                const float *ti = t + i * p + q;
#pragma GCC unroll 8
                for (int k = 0; k < G; k++) acc[k] += nf_v8_ld(ti + 8 * k) * c;
            }
#pragma GCC unroll 8
            for (int k = 0; k < G; k++) nf_v8_st(y + j * p + q + 8 * k, acc[k] * s);
        }
}

static void nf_fwht_core(const float *t, float *y, int64_t m, int64_t p, const float *core, float s) {
    if (p >= 64) nf_fwht_core_g(t, y, m, p, core, s, 8);
    else if (p == 32) nf_fwht_core_g(t, y, m, p, core, s, 4);
    else if (p == 16) nf_fwht_core_g(t, y, m, p, core, s, 2);
    else nf_fwht_core_g(t, y, m, p, core, s, 1);
}

/* p < 8: the plain loops (the aten order), one row */
static void nf_fwht_row_scalar(const float *x, float *y, int64_t m, int64_t p, const float *core, float s,
                               float *tmp) {
    const int64_t n = m * p;
    for (int64_t i = 0; i < n; i++) y[i] = x[i];
    for (int64_t c = 0; c < m; c++) {
        float *z = y + c * p;
        for (int64_t h = 1; h < p; h *= 2)
            for (int64_t i = 0; i < p; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = z[j], b = z[j + h];
                    z[j] = a + b;
                    z[j + h] = a - b;
                }
    }
    if (core) {
        for (int64_t j = 0; j < m; j++)
            for (int64_t q = 0; q < p; q++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < m; i++) acc += core[i * m + j] * y[i * p + q];
                tmp[j * p + q] = acc;
            }
        for (int64_t i = 0; i < n; i++) y[i] = tmp[i] * s;
    } else {
        for (int64_t i = 0; i < n; i++) y[i] *= s;
    }
}

static void nf_fwht_rows(const float *x, float *y, int64_t r0, int64_t r1, int64_t m, int64_t p,
                         const float *core, float s) {
    const int64_t n = m * p;
    if (p < 8) {
        float tmp[core ? n : 1];
        for (int64_t r = r0; r < r1; r++) nf_fwht_row_scalar(x + r * n, y + r * n, m, p, core, s, tmp);
        return;
    }
    float t[core ? n : 1];  /* the butterflies' output when a core sum follows */
    for (int64_t r = r0; r < r1; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n, *br = core ? t : yr;
        for (int64_t c = 0; c < m; c++) nf_fwht_chunk(xr + c * p, br + c * p, p, !core, s);
        if (core) nf_fwht_core(t, yr, m, p, core, s);
    }
}

int nf_fwht_f32(const float *x, float *y, int64_t rows, int64_t m, int64_t p, const float *core, float scale,
                int nthreads) {
    if (!x || !y || rows < 0 || m < 1 || p < 1 || (p & (p - 1))) return -1;
    const float *c = core && m > 1 ? core : NULL;
    const int64_t n = m * p;
    const int nth = nf_threads_for(nthreads, rows, n, NF_F32);  /* the norms' grain: 8192 elements a thread */
    if (nth == 1) {
        nf_fwht_rows(x, y, 0, rows, m, p, c, scale);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(nth)
    for (int t = 0; t < nth; t++)
        nf_fwht_rows(x, y, rows * t / nth, rows * (t + 1) / nth, m, p, c, scale);
    return 0;
}
