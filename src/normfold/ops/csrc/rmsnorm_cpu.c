/* normfold CPU kernels: RMSNorm and CRMSNorm forward/backward over the last dimension.
 *
 * Built on first use by normfold/ops/cpu.py (cc -O3 -march=native -fopenmp -shared) and called
 * through ctypes. Rows are split across OpenMP threads; torch ships libgomp.so.1 with the same
 * soname, so this library joins torch's thread pool instead of starting a second one.
 *
 * Statistics accumulate in float32 for every input dtype. The affine (weight, bias) is applied in
 * float32 and the result rounded once to the output dtype (round-to-nearest-even for bf16, like
 * torch). CRMSNorm (paper 001 eq. 5) takes the first n = d-1 coordinates of a zero-mean vector:
 *   ms = (sum x^2 + (sum x)^2) / d,   y = x / sqrt(ms + eps) * w + b.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

enum { NF_F32 = 0, NF_BF16 = 1, NF_F16 = 2 };

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define LD_F32(p, i) ((p)[i])
#define ST_F32(p, i, v) ((p)[i] = (v))
#define LD_BF16(p, i) bf16_to_f32((p)[i])
#define ST_BF16(p, i, v) ((p)[i] = f32_to_bf16(v))
#define LD_F16(p, i) ((float)(p)[i])
#define ST_F16(p, i, v) ((p)[i] = (_Float16)(v))

#define NF_LANES 16

/* One row's sum of squares and plain sum, with NF_LANES independent accumulators so the
 * compiler can vectorize without -ffast-math. */
#define DEFINE_ROW_STATS(SUF, T, LD)                                                          \
    static inline void row_stats_##SUF(const T *xr, int64_t n, float *sq, float *sm) {       \
        float a[NF_LANES] = {0}, s[NF_LANES] = {0};                                           \
        int64_t j = 0;                                                                        \
        for (; j + NF_LANES <= n; j += NF_LANES)                                              \
            for (int k = 0; k < NF_LANES; k++) {                                              \
                float v = LD(xr, j + k);                                                      \
                a[k] += v * v;                                                                \
                s[k] += v;                                                                    \
            }                                                                                 \
        float ta = 0.f, ts = 0.f;                                                             \
        for (int k = 0; k < NF_LANES; k++) { ta += a[k]; ts += s[k]; }                        \
        for (; j < n; j++) { float v = LD(xr, j); ta += v * v; ts += v; }                     \
        *sq = ta;                                                                             \
        *sm = ts;                                                                             \
    }

#define DEFINE_ROW_SQ(SUF, T, LD)                                                             \
    static inline float row_sq_##SUF(const T *xr, int64_t n) {                               \
        float a[NF_LANES] = {0};                                                              \
        int64_t j = 0;                                                                        \
        for (; j + NF_LANES <= n; j += NF_LANES)                                              \
            for (int k = 0; k < NF_LANES; k++) { float v = LD(xr, j + k); a[k] += v * v; }    \
        float ta = 0.f;                                                                       \
        for (int k = 0; k < NF_LANES; k++) ta += a[k];                                        \
        for (; j < n; j++) { float v = LD(xr, j); ta += v * v; }                              \
        return ta;                                                                            \
    }

#define DEFINE_FORWARD(SUF, T, LD, ST)                                                        \
    static void forward_##SUF(const T *x, const T *w, const T *b, T *y, float *rstd,          \
                              int64_t rows, int64_t n, float eps, int compressed) {           \
        const float inv_d = 1.0f / (float)(compressed ? n + 1 : n);                           \
        _Pragma("omp parallel for schedule(static)")                                          \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *xr = x + r * n;                                                          \
            T *yr = y + r * n;                                                                \
            float ms;                                                                         \
            if (compressed) {                                                                 \
                float sq, sm;                                                                 \
                row_stats_##SUF(xr, n, &sq, &sm);                                             \
                ms = (sq + sm * sm) * inv_d;                                                  \
            } else {                                                                          \
                ms = row_sq_##SUF(xr, n) * inv_d;                                             \
            }                                                                                 \
            const float rs = 1.0f / sqrtf(ms + eps);                                          \
            if (rstd) rstd[r] = rs;                                                           \
            if (w && b) { for (int64_t j = 0; j < n; j++) ST(yr, j, LD(xr, j) * rs * LD(w, j) + LD(b, j)); } \
            else if (w) { for (int64_t j = 0; j < n; j++) ST(yr, j, LD(xr, j) * rs * LD(w, j)); }           \
            else if (b) { for (int64_t j = 0; j < n; j++) ST(yr, j, LD(xr, j) * rs + LD(b, j)); }           \
            else        { for (int64_t j = 0; j < n; j++) ST(yr, j, LD(xr, j) * rs); }                      \
        }                                                                                     \
    }

/* Backward. With g = dy * w (or dy), r = rstd, c = sum_k g_k x_k:
 *   RMSNorm:  dx_j = r g_j - r^3 x_j c / d
 *   CRMSNorm: dx_j = r g_j - r^3 (x_j + sum x) c / d
 * dw = sum_rows dy * x * r and db = sum_rows dy accumulate into per-thread float32 rows of
 * dw_part / db_part (nthreads x n), summed by the caller. */
#define DEFINE_BACKWARD(SUF, T, LD, ST)                                                       \
    static void backward_##SUF(const T *dy, const T *x, const T *w, const float *rstd, T *dx, \
                               float *dw_part, float *db_part, int64_t rows, int64_t n,       \
                               int compressed) {                                              \
        const float inv_d = 1.0f / (float)(compressed ? n + 1 : n);                           \
        _Pragma("omp parallel")                                                               \
        {                                                                                     \
            const int tid = omp_get_thread_num();                                             \
            float *dwt = dw_part ? dw_part + (int64_t)tid * n : 0;                            \
            float *dbt = db_part ? db_part + (int64_t)tid * n : 0;                            \
            _Pragma("omp for schedule(static)")                                               \
            for (int64_t r = 0; r < rows; r++) {                                              \
                const T *xr = x + r * n, *dyr = dy + r * n;                                   \
                T *dxr = dx + r * n;                                                          \
                const float rs = rstd[r];                                                     \
                float c = 0.f, sm = 0.f;                                                      \
                for (int64_t j = 0; j < n; j++) {                                             \
                    float g = LD(dyr, j) * (w ? LD(w, j) : 1.0f);                             \
                    float v = LD(xr, j);                                                      \
                    c += g * v;                                                               \
                    sm += v;                                                                  \
                }                                                                             \
                const float k = rs * rs * rs * c * inv_d;                                     \
                const float shift = compressed ? sm : 0.f;                                    \
                for (int64_t j = 0; j < n; j++) {                                             \
                    float g = LD(dyr, j) * (w ? LD(w, j) : 1.0f);                             \
                    float v = LD(xr, j);                                                      \
                    ST(dxr, j, rs * g - k * (v + shift));                                     \
                    if (dwt) dwt[j] += LD(dyr, j) * v * rs;                                   \
                    if (dbt) dbt[j] += LD(dyr, j);                                            \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_ROW_STATS(f32, float, LD_F32)
DEFINE_ROW_SQ(f32, float, LD_F32)
DEFINE_FORWARD(f32, float, LD_F32, ST_F32)
DEFINE_BACKWARD(f32, float, LD_F32, ST_F32)

DEFINE_ROW_STATS(bf16, uint16_t, LD_BF16)
DEFINE_ROW_SQ(bf16, uint16_t, LD_BF16)
DEFINE_FORWARD(bf16, uint16_t, LD_BF16, ST_BF16)
DEFINE_BACKWARD(bf16, uint16_t, LD_BF16, ST_BF16)

DEFINE_ROW_STATS(f16, _Float16, LD_F16)
DEFINE_ROW_SQ(f16, _Float16, LD_F16)
DEFINE_FORWARD(f16, _Float16, LD_F16, ST_F16)
DEFINE_BACKWARD(f16, _Float16, LD_F16, ST_F16)

/* ---- exported entry points (ctypes) ---- */

int nf_abi_version(void) { return 1; }

int nf_max_threads(void) { return omp_get_max_threads(); }

int nf_rms_forward(int dtype, const void *x, const void *w, const void *b, void *y, float *rstd,
                   int64_t rows, int64_t n, float eps, int compressed) {
    switch (dtype) {
    case NF_F32: forward_f32(x, w, b, y, rstd, rows, n, eps, compressed); return 0;
    case NF_BF16: forward_bf16(x, w, b, y, rstd, rows, n, eps, compressed); return 0;
    case NF_F16: forward_f16(x, w, b, y, rstd, rows, n, eps, compressed); return 0;
    default: return -1;
    }
}

int nf_rms_backward(int dtype, const void *dy, const void *x, const void *w, const float *rstd,
                    void *dx, float *dw_part, float *db_part, int64_t rows, int64_t n,
                    int compressed) {
    switch (dtype) {
    case NF_F32: backward_f32(dy, x, w, rstd, dx, dw_part, db_part, rows, n, compressed); return 0;
    case NF_BF16: backward_bf16(dy, x, w, rstd, dx, dw_part, db_part, rows, n, compressed); return 0;
    case NF_F16: backward_f16(dy, x, w, rstd, dx, dw_part, db_part, rows, n, compressed); return 0;
    default: return -1;
    }
}
