/* Vector layer of the normfold CPU kernels: one float vector type `vf` of NF_VW lanes and, per
 * storage dtype (f32, bf16, f16), full and partial loads/stores that convert to/from float32.
 *
 * Four implementations (NF_ISA below), one per shared library: normfold/ops/cpu.py compiles each
 * with explicit ISA flags and loads the best one the running CPU supports, so the choice is made
 * at load time from what the CPU reports, not by whichever -march the build happened to use:
 *   - AVX-512 (F+BW+VL) intrinsics: 16 lanes, masked tails, one-instruction bf16 rounding with
 *     AVX512_BF16;
 *   - AVX2 + FMA + F16C intrinsics (x86-64-v3: every x86 CPU since Haswell / Zen 1): 8 lanes,
 *     float16 through VCVTPH2PS / VCVTPS2PH eight values at a time;
 *   - NEON (aarch64): 4 lanes, float16 through FCVTL / FCVTN;
 *   - a portable one written with GCC/Clang vector extensions (8 lanes), for anything else.
 *     (Compiled for AVX2 it converted float16 one element at a time: 3x slower than LayerNorm.)
 *
 * bf16 rounding is round-to-nearest-even with NaN kept quiet, like torch's c10::BFloat16.
 * (VCVTNEPS2BF16 flushes float32 subnormals to zero; such tiny bf16 values never come out of a
 * norm except through a near-zero weight, and then the difference is below 1e-38.)
 */
#ifndef NF_SIMD_H
#define NF_SIMD_H

#include <stdint.h>
#include <string.h>

/* Which path this translation unit compiles (normfold/ops/cpu.py builds one library per ISA with
 * explicit flags and picks one at load time from what the CPU reports):
 *   NF_ISA 2  AVX-512 (F+BW+VL; AVX512_BF16 where the compiler targets it)   -march=native on AVX-512 CPUs
 *   NF_ISA 3  AVX2 + FMA + F16C (x86-64-v3)                                  -mavx2 -mfma -mf16c
 *   NF_ISA 4  NEON (aarch64; fp16 <-> fp32 with FCVTL/FCVTN)                  aarch64 baseline
 *   NF_ISA 1  portable GCC/Clang vector extensions                           no ISA flags
 * NF_FORCE_GENERIC selects the portable code whatever the flags allow. */
#if defined(NF_FORCE_GENERIC)
#define NF_AVX512 0
#define NF_AVX2 0
#define NF_NEON 0
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NF_AVX512 1
#define NF_AVX2 0
#define NF_NEON 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NF_AVX512 0
#define NF_AVX2 1
#define NF_NEON 0
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define NF_AVX512 0
#define NF_AVX2 0
#define NF_NEON 1
#include <arm_neon.h>
#else
#define NF_AVX512 0
#define NF_AVX2 0
#define NF_NEON 0
#endif

#if NF_AVX512 || NF_AVX2 || NF_NEON
/* float16 as raw bits: every conversion is a hardware instruction (F16C / AVX-512 VCVTPH2PS and
 * VCVTPS2PH, NEON FCVTL / FCVTN), so no compiler _Float16 support is needed. */
#define NF_HAVE_F16 1
typedef uint16_t nf_f16;
#elif defined(__FLT16_MAX__)
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
#if defined(__AVX512BF16__)
static inline __m256i nf_narrow_bf16(vf v) { return (__m256i)_mm512_cvtneps_pbh(v); }
static inline __m256i nf_narrow_bf16q(vf v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
static inline __m512i nf_round_bf16(__m512i u) {
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}
static inline __m256i nf_narrow_bf16q(vf v) { return _mm512_cvtepi32_epi16(nf_round_bf16(_mm512_castps_si512(v))); }
static inline __m256i nf_narrow_bf16(vf v) {
    __m512i u = _mm512_castps_si512(v);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i r = _mm512_mask_mov_epi32(nf_round_bf16(u), nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
#endif
static inline vf ld_bf16(const uint16_t *p) { return nf_widen_bf16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf ldn_bf16(const uint16_t *p, int64_t k) { return nf_widen_bf16(_mm256_maskz_loadu_epi16(nf_mask(k), p)); }
static inline void st_bf16(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, nf_narrow_bf16(v)); }
static inline void stn_bf16(uint16_t *p, vf v, int64_t k) { _mm256_mask_storeu_epi16(p, nf_mask(k), nf_narrow_bf16(v)); }
static inline vf rt_bf16(vf v) { return nf_widen_bf16(nf_narrow_bf16(v)); }
static inline void st_bf16q(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, nf_narrow_bf16q(v)); }
static inline void stn_bf16q(uint16_t *p, vf v, int64_t k) { _mm256_mask_storeu_epi16(p, nf_mask(k), nf_narrow_bf16q(v)); }
static inline vf rt_bf16q(vf v) { return nf_widen_bf16(nf_narrow_bf16q(v)); }

#if NF_HAVE_F16
#define NF_F16_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vf ld_f16(const nf_f16 *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf ldn_f16(const nf_f16 *p, int64_t k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(nf_mask(k), p)); }
static inline void st_f16(nf_f16 *p, vf v) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, NF_F16_ROUND)); }
static inline void stn_f16(nf_f16 *p, vf v, int64_t k) { _mm256_mask_storeu_epi16(p, nf_mask(k), _mm512_cvtps_ph(v, NF_F16_ROUND)); }
static inline vf rt_f16(vf v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, NF_F16_ROUND)); }
static inline float nf_f16_to_f32(nf_f16 h) { return _cvtsh_ss(h); }
#endif
/* Streaming (non-temporal) store of one full float32 vector to a 64-byte-aligned address (only
 * float32 kernels use them: nf_backward_streams, nf_add_streams). */
#define NF_HAVE_STREAM 1
static inline void sts_f32(float *p, vf v) { _mm512_stream_ps(p, v); }

#elif NF_AVX2
/* ================================ AVX2 + FMA + F16C ================================ */
#define NF_VW 8
#define NF_ISA 3
typedef __m256 vf;

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }  /* a*b + c */
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); } /* c - a*b */
static inline float vf_sum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* Lane masks for k < 8 leading lanes: a window into a table of 8 ones and 8 zeros. */
static const int32_t nf_mask_tab[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
static inline __m256i nf_mask(int64_t k) { return _mm256_loadu_si256((const __m256i *)(nf_mask_tab + 8 - k)); }
/* k < 8 16-bit values (heads and tails of rows only): the k/2 whole dwords by masked load/store,
 * the odd last value on its own. A bounce through a stack buffer, as before, stalled on store
 * forwarding: +35 ns per row at odd widths (bf16 128x383: 12.4 us against 7.2 at 384). Masked-off
 * lanes are never touched, so nothing past p[k-1] is read or written. */
static const int16_t nf_lane16_tab[16] = {0, 0, 0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0};
static inline __m128i nf_mask4(int64_t k) { return _mm_loadu_si128((const __m128i *)(nf_mask_tab + 8 - k)); }
static inline __m128i nf_ld16n(const uint16_t *p, int64_t k) {
    __m128i v = _mm_maskload_epi32((const int *)p, nf_mask4(k >> 1));
    if (k & 1) /* lane k-1 from a broadcast of p[k-1] */
        v = _mm_blendv_epi8(v, _mm_set1_epi16((short)p[k - 1]),
                            _mm_loadu_si128((const __m128i *)(nf_lane16_tab + 9 - k)));
    return v;
}
static inline void nf_st16n(uint16_t *p, __m128i h, int64_t k) {
    _mm_maskstore_epi32((int *)p, nf_mask4(k >> 1), h);
    if (k & 1) {
        uint16_t b[8];
        _mm_storeu_si128((__m128i *)b, h);
        p[k - 1] = b[k - 1];
    }
}

static inline vf ld_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline vf ldn_f32(const float *p, int64_t k) { return _mm256_maskload_ps(p, nf_mask(k)); }
static inline void st_f32(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline void stn_f32(float *p, vf v, int64_t k) { _mm256_maskstore_ps(p, nf_mask(k), v); }
static inline vf rt_f32(vf v) { return v; }

static inline vf nf_widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
/* u + 0x7fff + lsb: the rounded bf16 in the upper half (nf_bf16pair.h keeps it there). */
static inline __m256i nf_round_bf16_hi(__m256i u) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}
static inline __m256i nf_round_bf16(__m256i u) { return _mm256_srli_epi32(nf_round_bf16_hi(u), 16); }
static inline __m128i nf_pack_bf16(__m256i r) { return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)); }
static inline __m128i nf_narrow_bf16q(vf v) { return nf_pack_bf16(nf_round_bf16(_mm256_castps_si256(v))); }
static inline __m128i nf_narrow_bf16(vf v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)); /* quiet NaN */
    return nf_pack_bf16(_mm256_blendv_epi8(nf_round_bf16(u), q, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))));
}
static inline vf ld_bf16(const uint16_t *p) { return nf_widen_bf16(_mm_loadu_si128((const __m128i *)p)); }
static inline vf ldn_bf16(const uint16_t *p, int64_t k) { return nf_widen_bf16(nf_ld16n(p, k)); }
static inline void st_bf16(uint16_t *p, vf v) { _mm_storeu_si128((__m128i *)p, nf_narrow_bf16(v)); }
static inline void stn_bf16(uint16_t *p, vf v, int64_t k) { nf_st16n(p, nf_narrow_bf16(v), k); }
static inline vf rt_bf16(vf v) { return nf_widen_bf16(nf_narrow_bf16(v)); }
static inline void st_bf16q(uint16_t *p, vf v) { _mm_storeu_si128((__m128i *)p, nf_narrow_bf16q(v)); }
static inline void stn_bf16q(uint16_t *p, vf v, int64_t k) { nf_st16n(p, nf_narrow_bf16q(v), k); }
static inline vf rt_bf16q(vf v) { return nf_widen_bf16(nf_narrow_bf16q(v)); }

#define NF_F16_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vf ld_f16(const nf_f16 *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf ldn_f16(const nf_f16 *p, int64_t k) { return _mm256_cvtph_ps(nf_ld16n(p, k)); }
static inline void st_f16(nf_f16 *p, vf v) { _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, NF_F16_ROUND)); }
static inline void stn_f16(nf_f16 *p, vf v, int64_t k) { nf_st16n(p, _mm256_cvtps_ph(v, NF_F16_ROUND), k); }
static inline vf rt_f16(vf v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, NF_F16_ROUND)); }
static inline float nf_f16_to_f32(nf_f16 h) { return _cvtsh_ss(h); }
#define NF_HAVE_STREAM 1
static inline void sts_f32(float *p, vf v) { _mm256_stream_ps(p, v); }

#elif NF_NEON
/* ================================ NEON (aarch64) ================================ */
#define NF_VW 4
#define NF_ISA 4
typedef float32x4_t vf;

static inline vf vf_zero(void) { return vdupq_n_f32(0.f); }
static inline vf vf_set1(float a) { return vdupq_n_f32(a); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }  /* a*b + c */
static inline vf vf_fnma(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); } /* c - a*b */
static inline float vf_sum(vf a) { return vaddvq_f32(a); }

static inline vf ld_f32(const float *p) { return vld1q_f32(p); }
static inline vf ldn_f32(const float *p, int64_t k) {
    float b[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < k; i++) b[i] = p[i];
    return vld1q_f32(b);
}
static inline void st_f32(float *p, vf v) { vst1q_f32(p, v); }
static inline void stn_f32(float *p, vf v, int64_t k) {
    float b[4];
    vst1q_f32(b, v);
    for (int64_t i = 0; i < k; i++) p[i] = b[i];
}
static inline vf rt_f32(vf v) { return v; }

static inline uint16x4_t nf_ld16n(const uint16_t *p, int64_t k) {
    uint16_t b[4] = {0, 0, 0, 0};
    for (int64_t i = 0; i < k; i++) b[i] = p[i];
    return vld1_u16(b);
}
static inline void nf_st16n(uint16_t *p, uint16x4_t h, int64_t k) {
    uint16_t b[4];
    vst1_u16(b, h);
    for (int64_t i = 0; i < k; i++) p[i] = b[i];
}
static inline vf nf_widen_bf16(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }
static inline uint32x4_t nf_round_bf16(uint32x4_t u) {
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    return vshrq_n_u32(vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff))), 16);
}
static inline uint16x4_t nf_narrow_bf16q(vf v) { return vmovn_u32(nf_round_bf16(vreinterpretq_u32_f32(v))); }
static inline uint16x4_t nf_narrow_bf16(vf v) {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t q = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40)); /* quiet NaN */
    const uint32x4_t nan = vmvnq_u32(vceqq_f32(v, v));
    return vmovn_u32(vbslq_u32(nan, q, nf_round_bf16(u)));
}
static inline vf ld_bf16(const uint16_t *p) { return nf_widen_bf16(vld1_u16(p)); }
static inline vf ldn_bf16(const uint16_t *p, int64_t k) { return nf_widen_bf16(nf_ld16n(p, k)); }
static inline void st_bf16(uint16_t *p, vf v) { vst1_u16(p, nf_narrow_bf16(v)); }
static inline void stn_bf16(uint16_t *p, vf v, int64_t k) { nf_st16n(p, nf_narrow_bf16(v), k); }
static inline vf rt_bf16(vf v) { return nf_widen_bf16(nf_narrow_bf16(v)); }
static inline void st_bf16q(uint16_t *p, vf v) { vst1_u16(p, nf_narrow_bf16q(v)); }
static inline void stn_bf16q(uint16_t *p, vf v, int64_t k) { nf_st16n(p, nf_narrow_bf16q(v), k); }
static inline vf rt_bf16q(vf v) { return nf_widen_bf16(nf_narrow_bf16q(v)); }

static inline vf nf_h2f(uint16x4_t h) { return vcvt_f32_f16(vreinterpret_f16_u16(h)); }
static inline uint16x4_t nf_f2h(vf v) { return vreinterpret_u16_f16(vcvt_f16_f32(v)); }
static inline vf ld_f16(const nf_f16 *p) { return nf_h2f(vld1_u16(p)); }
static inline vf ldn_f16(const nf_f16 *p, int64_t k) { return nf_h2f(nf_ld16n(p, k)); }
static inline void st_f16(nf_f16 *p, vf v) { vst1_u16(p, nf_f2h(v)); }
static inline void stn_f16(nf_f16 *p, vf v, int64_t k) { nf_st16n(p, nf_f2h(v), k); }
static inline vf rt_f16(vf v) { return nf_h2f(nf_f2h(v)); }
static inline float nf_f16_to_f32(nf_f16 h) { return vgetq_lane_f32(nf_h2f(vdup_n_u16(h)), 0); }

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
static inline nf_vh nf_narrow_bf16q(vf v) {
    nf_vu u = (nf_vu)v;
    return __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nf_vh);
}
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
static inline void st_bf16q(uint16_t *p, vf v) { nf_vh h = nf_narrow_bf16q(v); memcpy(p, &h, sizeof h); }
static inline void stn_bf16q(uint16_t *p, vf v, int64_t k) { nf_vh h = nf_narrow_bf16q(v); memcpy(p, &h, (size_t)k * 2); }
static inline vf rt_bf16q(vf v) { return nf_widen_bf16(nf_narrow_bf16q(v)); }

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
static inline float nf_f16_to_f32(nf_f16 h) { return (float)h; }
#endif

#endif /* ISA */

#ifndef NF_HAVE_STREAM
#define NF_HAVE_STREAM 0 /* NEON and portable code: plain stores (nf_kernels.h) */
#endif
/* Orders this thread's streaming stores before what follows (OpenMP's barrier does not). */
static inline void nf_stream_fence(void) {
#if NF_HAVE_STREAM
    _mm_sfence();
#endif
}

/* bf16q: bfloat16 stored with nf_narrow_bf16q, round-to-nearest-even without the NaN fix-up (15-28%
 * of a bf16 forward on the AVX2 path). It is exact for every finite and infinite value, and for
 * every NaN whose low 16 bits are zero: adding at most 0x8000 to such a NaN cannot carry into its
 * upper half. The kernels only meet such NaNs when every float input is bf16 data or NaN-free:
 * bf16 values widen with zero low bits, arithmetic returns one operand's NaN or the default NaN
 * (0xFFC00000 on x86, 0x7FC00000 on ARM), and a non-finite row's rstd is NAN (0x7FC00000). A NaN
 * with low bits set can only come from a float32 weight or bias (nf_bf16q_exact). */
static inline vf ld_bf16q(const uint16_t *p) { return ld_bf16(p); }
static inline vf ldn_bf16q(const uint16_t *p, int64_t k) { return ldn_bf16(p, k); }

/* 1 when bf16q rounds these float32 values' products exactly: none is a NaN with low bits set. */
static inline int nf_bf16q_exact(const float *p, int64_t n) {
    uint32_t bad = 0;
    for (int64_t j = 0; p && j < n; j++) {
        uint32_t u;
        memcpy(&u, p + j, 4);
        bad |= ((u & 0x7fffffffu) > 0x7f800000u) & ((u & 0xffffu) != 0);
    }
    return !bad;
}
#endif /* NF_SIMD_H */
