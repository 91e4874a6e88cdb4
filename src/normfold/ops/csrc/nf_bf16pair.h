/* bfloat16 forward on the AVX2 path in "pair layout": 16 values per 256-bit register, no widening.
 *
 * A 32-bit lane of raw bf16 data holds two values: the even one is the lane shifted left by 16, the
 * odd one is the lane with its low half cleared. So 16 values become two float32 registers (even
 * and odd elements) with one shift and one AND, instead of two zero-extensions and two shifts; and
 * going back, the rounded odd register keeps its high half in place while the even one is shifted
 * down and merged with one VPBLENDW, instead of two extracts and two pack instructions. The only
 * price is that the affine's weight and bias must be laid out the same way: nf_pair_params
 * deinterleaves them once per call (for calls of at least NF_PAIR_MIN_ROWS rows).
 *
 * Rounding is bf16q's (nf_simd.h): exact when the caller has checked nf_bf16q_exact.
 * Measured on a Zen 5 EPYC, one thread, AVX2 build, bf16 x·rs·w + b: 4096x768 470 -> 373 us,
 * 1024x4096 636 -> 456 us, 8192x1024 1488 -> 991 us against the 8-wide bf16q kernel.
 */
#ifndef NF_BF16PAIR_H
#define NF_BF16PAIR_H
#if NF_AVX2
#define NF_BF16PAIR 1
/* Below this many rows preparing w and b costs more than the pair layout saves (one thread, µs,
 * width 768 / 4096: 1 row 0.48 / 1.44 plain vs 0.52 / 1.70 pair, 2 rows even, 4 rows 0.77 / 3.11
 * vs 0.71 / 2.90, 15 rows 1.94 / 9.60 vs 1.55 / 7.38). */
#ifndef NF_PAIR_MIN_ROWS
#define NF_PAIR_MIN_ROWS 4
#endif

static inline __m256 nf_pair_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 nf_pair_odd(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }
/* Round even and odd float32 registers to bf16 (RNE, bf16q) and interleave them back. */
static inline __m256i nf_pair_narrow(__m256 e, __m256 o) {
    return _mm256_blend_epi16(nf_round_bf16(_mm256_castps_si256(e)), nf_round_bf16_hi(_mm256_castps_si256(o)), 0xAA);
}

/* p (n floats) in pair layout: each full block of 16 becomes its 8 even then its 8 odd entries; the
 * tail (n % 16) is not used by the pair loops. */
static void nf_pair_params(const float *p, int64_t n, float *out) {
    for (int64_t j = 0; j + 16 <= n; j += 16)
        for (int i = 0; i < 8; i++) {
            out[j + i] = p[j + 2 * i];
            out[j + 8 + i] = p[j + 2 * i + 1];
        }
}

/* Σx² (and Σx) of R rows, xs elements apart. The order of the terms does not matter here, so the
 * loop starts at a 32-byte aligned address (a masked 8-wide head) like the other paths. */
static inline __attribute__((always_inline)) void nf_bf16pair_stats(const uint16_t *x, int64_t xs, int R, int64_t n,
                                                                  int with_sum, float *sq, float *sm) {
    for (int i = 0; i < R; i++) {
        const uint16_t *xr = x + i * xs;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, s0 = a0, s1 = a0;
        int64_t j = nf_head(xr, 2, 32, n);
        for (int64_t h = 0; h < j; h += 8) { /* head: at most 15 values, 8 at a time */
            const int64_t k = j - h < 8 ? j - h : 8;
            __m256 v = ldn_bf16(xr + h, k);
            a1 = _mm256_fmadd_ps(v, v, a1);
            if (with_sum) s1 = _mm256_add_ps(s1, v);
        }
        for (; j + 32 <= n; j += 32) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(xr + j)), v1 = _mm256_loadu_si256((const __m256i *)(xr + j + 16));
            const __m256 e0 = nf_pair_even(v0), o0 = nf_pair_odd(v0), e1 = nf_pair_even(v1), o1 = nf_pair_odd(v1);
            a0 = _mm256_fmadd_ps(e0, e0, a0); a1 = _mm256_fmadd_ps(o0, o0, a1);
            a2 = _mm256_fmadd_ps(e1, e1, a2); a3 = _mm256_fmadd_ps(o1, o1, a3);
            if (with_sum) { s0 = _mm256_add_ps(s0, _mm256_add_ps(e0, o0)); s1 = _mm256_add_ps(s1, _mm256_add_ps(e1, o1)); }
        }
        for (; j < n; j += 8) {
            __m256 v = n - j >= 8 ? ld_bf16(xr + j) : ldn_bf16(xr + j, n - j);
            a0 = _mm256_fmadd_ps(v, v, a0);
            if (with_sum) s0 = _mm256_add_ps(s0, v);
        }
        sq[i] = vf_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        sm[i] = with_sum ? vf_sum(_mm256_add_ps(s0, s1)) : 0.f;
    }
}

/* s = x + r rounded to bf16 (s rows n apart) and the statistics of the rounded s. No parameters are
 * involved, so the pair layout needs no preparation here and the rounding is always exact (every
 * input is bf16 data). */
static inline __attribute__((always_inline)) void nf_bf16pair_add_stats(const uint16_t *x, int64_t xs, const uint16_t *r,
                                                                      int64_t rst, uint16_t *s, int R, int64_t n,
                                                                      int with_sum, float *sq, float *sm) {
    for (int i = 0; i < R; i++) {
        const uint16_t *xr = x + i * xs, *rr = r + i * rst;
        uint16_t *sr = s + i * n;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, s0 = a0;
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + j)), rv = _mm256_loadu_si256((const __m256i *)(rr + j));
            const __m256i sv = nf_pair_narrow(_mm256_add_ps(nf_pair_even(xv), nf_pair_even(rv)),
                                              _mm256_add_ps(nf_pair_odd(xv), nf_pair_odd(rv)));
            _mm256_storeu_si256((__m256i *)(sr + j), sv);
            const __m256 e = nf_pair_even(sv), o = nf_pair_odd(sv);
            a0 = _mm256_fmadd_ps(e, e, a0);
            a1 = _mm256_fmadd_ps(o, o, a1);
            if (with_sum) s0 = _mm256_add_ps(s0, _mm256_add_ps(e, o));
        }
        for (; j < n; j += 8) {
            const int64_t k = n - j < 8 ? n - j : 8;
            __m256 v = _mm256_add_ps(ldn_bf16(xr + j, k), ldn_bf16(rr + j, k));
            stn_bf16q(sr + j, v, k);
            v = rt_bf16q(v);
            a0 = _mm256_fmadd_ps(v, v, a0);
            if (with_sum) s0 = _mm256_add_ps(s0, v);
        }
        sq[i] = vf_sum(_mm256_add_ps(a0, a1));
        sm[i] = with_sum ? vf_sum(s0) : 0.f;
    }
}

/* y = x · rs · w + b for R rows (y rows n apart); wp / bp are w / b in pair layout (nf_pair_params),
 * w / b themselves serve the last n % 16 columns. `hw` / `hb` are literals at every call site. */
static inline __attribute__((always_inline)) void nf_bf16pair_apply(const uint16_t *x, int64_t xs, uint16_t *y, int R,
                                                                  int64_t n, const float *rs, const float *wp,
                                                                  const float *bp, const float *w, const float *b,
                                                                  int hw, int hb) {
    for (int i = 0; i < R; i++) {
        const uint16_t *xr = x + i * xs;
        uint16_t *yr = y + i * n;
        const __m256 vr = _mm256_set1_ps(rs[i]);
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(xr + j));
            __m256 e = _mm256_mul_ps(nf_pair_even(v), vr), o = _mm256_mul_ps(nf_pair_odd(v), vr);
            if (hw && hb) {
                e = _mm256_fmadd_ps(e, _mm256_loadu_ps(wp + j), _mm256_loadu_ps(bp + j));
                o = _mm256_fmadd_ps(o, _mm256_loadu_ps(wp + j + 8), _mm256_loadu_ps(bp + j + 8));
            } else if (hw) {
                e = _mm256_mul_ps(e, _mm256_loadu_ps(wp + j));
                o = _mm256_mul_ps(o, _mm256_loadu_ps(wp + j + 8));
            } else if (hb) {
                e = _mm256_add_ps(e, _mm256_loadu_ps(bp + j));
                o = _mm256_add_ps(o, _mm256_loadu_ps(bp + j + 8));
            }
            _mm256_storeu_si256((__m256i *)(yr + j), nf_pair_narrow(e, o));
        }
        for (; j < n; j += 8) {
            const int64_t k = n - j < 8 ? n - j : 8;
            __m256 v = _mm256_mul_ps(ldn_bf16(xr + j, k), vr);
            if (hw && hb) v = _mm256_fmadd_ps(v, ldn_f32(w + j, k), ldn_f32(b + j, k));
            else if (hw) v = _mm256_mul_ps(v, ldn_f32(w + j, k));
            else if (hb) v = _mm256_add_ps(v, ldn_f32(b + j, k));
            stn_bf16q(yr + j, v, k);
        }
    }
}

#else
#define NF_BF16PAIR 0
#endif
#endif /* NF_BF16PAIR_H */
