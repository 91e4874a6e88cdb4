/* Vector layer of the normfold CPU kernels: one float vector type `vf` of NF_VW lanes and, per
 * storage dtype (f32, bf16, f16), full and partial loads/stores that convert to/from float32.
 *
 * Two implementations, chosen at compile time for the machine that builds the library (the build
 * uses -march=native and is cached per CPU):
 *   - AVX-512 (F+BW+VL) intrinsics: 16 lanes, masked tails, one-instruction bf16 rounding with
 *     AVX512_BF16;
 *   - a portable one written with GCC/Clang vector extensions (8 lanes): compiles to AVX2, SSE or
 *     NEON, whatever -march allows. NF_FORCE_GENERIC selects it on AVX-512 machines too (tests).
 *
 * bf16 rounding is round-to-nearest-even with NaN kept quiet, like torch's c10::BFloat16.
 * (VCVTNEPS2BF16 flushes float32 subnormals to zero; such tiny bf16 values never come out of a
 * norm except through a near-zero weight, and then the difference is below 1e-38.)
 */
#ifndef NF_SIMD_H
#define NF_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(NF_FORCE_GENERIC)
#define NF_AVX512 1
#include <immintrin.h>
#else
#define NF_AVX512 0
#endif

#if defined(__FLT16_MAX__) || defined(__aarch64__)
#define NF_HAVE_F16 1
typedef _Float16 nf_f16;
#else
#define NF_HAVE_F16 0
#endif

/* ---------------- scalar conversions (tails of the generic path, parameter set-up) ---------------- */

static inline float nf_bf16_to_f32(uint16_t v) {
    uint32_t u = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t nf_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Elements before p reaches a multiple of `align` bytes (at most n). Rows of an odd width start at
 * every possible offset; a masked head lets the rest of the row use loads and stores that never
 * split a cache line (that split cost 30-40% on float32 rows of width 1023 from L3). */
static inline int64_t nf_head(const void *p, int64_t elem, int64_t align, int64_t n) {
    int64_t h = (int64_t)(((uintptr_t)0 - (uintptr_t)p) & (uintptr_t)(align - 1)) / elem;
    return h < n ? h : n;
}

#if NF_AVX512
/* ================================ AVX-512 ================================ */
#define NF_VW 16
#define NF_ISA 2
typedef __m512 vf;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  /* a*b + c */
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a*b */
static inline float vf_sum(vf a) { return _mm512_reduce_add_ps(a); }
static inline __mmask16 nf_mask(int64_t k) { return (__mmask16)((1u << k) - 1u); }

static inline vf ld_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline vf ldn_f32(const float *p, int64_t k) { return _mm512_maskz_loadu_ps(nf_mask(k), p); }
static inline void st_f32(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline void stn_f32(float *p, vf v, int64_t k) { _mm512_mask_storeu_ps(p, nf_mask(k), v); }
static inline vf rt_f32(vf v) { return v; }

static inline vf nf_widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m256i nf_narrow_bf16(vf v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
#endif
}
static inline vf ld_bf16(const uint16_t *p) { return nf_widen_bf16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf ldn_bf16(const uint16_t *p, int64_t k) { return nf_widen_bf16(_mm256_maskz_loadu_epi16(nf_mask(k), p)); }
static inline void st_bf16(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, nf_narrow_bf16(v)); }
static inline void stn_bf16(uint16_t *p, vf v, int64_t k) { _mm256_mask_storeu_epi16(p, nf_mask(k), nf_narrow_bf16(v)); }
static inline vf rt_bf16(vf v) { return nf_widen_bf16(nf_narrow_bf16(v)); }

#if NF_HAVE_F16
#define NF_F16_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vf ld_f16(const nf_f16 *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf ldn_f16(const nf_f16 *p, int64_t k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(nf_mask(k), p)); }
static inline void st_f16(nf_f16 *p, vf v) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, NF_F16_ROUND)); }
static inline void stn_f16(nf_f16 *p, vf v, int64_t k) { _mm256_mask_storeu_epi16(p, nf_mask(k), _mm512_cvtps_ph(v, NF_F16_ROUND)); }
static inline vf rt_f16(vf v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, NF_F16_ROUND)); }
#endif

#else
/* ================================ portable (vector extensions) ================================ */
#define NF_VW 8
#define NF_ISA 1
typedef float vf __attribute__((vector_size(32)));
typedef int32_t nf_vi __attribute__((vector_size(32)));
typedef uint32_t nf_vu __attribute__((vector_size(32)));
typedef uint16_t nf_vh __attribute__((vector_size(16)));

static inline vf vf_zero(void) { vf z = {0}; return z; }
static inline vf vf_set1(float a) { return vf_zero() + a; }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vf_fnma(vf a, vf b, vf c) { return c - a * b; }
static inline float vf_sum(vf a) {
    float s = 0.f;
    for (int i = 0; i < NF_VW; i++) s += a[i];
    return s;
}

static inline vf ld_f32(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf ldn_f32(const float *p, int64_t k) { vf v = vf_zero(); memcpy(&v, p, (size_t)k * 4); return v; }
static inline void st_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline void stn_f32(float *p, vf v, int64_t k) { memcpy(p, &v, (size_t)k * 4); }
static inline vf rt_f32(vf v) { return v; }

static inline vf nf_widen_bf16(nf_vh h) { return (vf)(__builtin_convertvector(h, nf_vu) << 16); }
static inline nf_vh nf_narrow_bf16(vf v) {
    nf_vu u = (nf_vu)v;
    nf_vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    nf_vu q = (u >> 16) | 0x40u;
    nf_vu nan = (nf_vu)((u & 0x7fffffffu) > 0x7f800000u); /* all-ones lanes where NaN */
    return __builtin_convertvector((q & nan) | (r & ~nan), nf_vh);
}
static inline vf ld_bf16(const uint16_t *p) { nf_vh h; memcpy(&h, p, sizeof h); return nf_widen_bf16(h); }
static inline vf ldn_bf16(const uint16_t *p, int64_t k) {
    nf_vh h = {0};
    memcpy(&h, p, (size_t)k * 2);
    return nf_widen_bf16(h);
}
static inline void st_bf16(uint16_t *p, vf v) { nf_vh h = nf_narrow_bf16(v); memcpy(p, &h, sizeof h); }
static inline void stn_bf16(uint16_t *p, vf v, int64_t k) { nf_vh h = nf_narrow_bf16(v); memcpy(p, &h, (size_t)k * 2); }
static inline vf rt_bf16(vf v) { return nf_widen_bf16(nf_narrow_bf16(v)); }

#if NF_HAVE_F16
typedef nf_f16 nf_vf16 __attribute__((vector_size(16)));
static inline vf ld_f16(const nf_f16 *p) { nf_vf16 h; memcpy(&h, p, sizeof h); return __builtin_convertvector(h, vf); }
static inline vf ldn_f16(const nf_f16 *p, int64_t k) {
    nf_vf16 h = {0};
    memcpy(&h, p, (size_t)k * 2);
    return __builtin_convertvector(h, vf);
}
static inline void st_f16(nf_f16 *p, vf v) { nf_vf16 h = __builtin_convertvector(v, nf_vf16); memcpy(p, &h, sizeof h); }
static inline void stn_f16(nf_f16 *p, vf v, int64_t k) {
    nf_vf16 h = __builtin_convertvector(v, nf_vf16);
    memcpy(p, &h, (size_t)k * 2);
}
static inline vf rt_f16(vf v) { return __builtin_convertvector(__builtin_convertvector(v, nf_vf16), vf); }
#endif

#endif /* NF_AVX512 */
#endif /* NF_SIMD_H */
