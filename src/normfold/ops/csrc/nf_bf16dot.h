/* Statistics of bfloat16 rows with AVX512_BF16: 32 values per 512-bit register.
 *
 * VDPBF16PS multiplies the bf16 pairs of two registers and adds both products to float32 lanes, so
 * Σx² of 32 values is one instruction (a bf16 x bf16 product is exact in float32; accumulation is
 * float32, like everywhere else) instead of widening 16 values at a time (load, zero-extend,
 * shift, FMA). Σx for CRMSNorm is the same instruction against a register of ones. Inputs are
 * treated as denormals-are-zero: only |x| < 1e-38 is affected, far below eps.
 *
 * (The normalize pass stays 16-wide in nf_kernels.h: a paired version with VCVTNE2PS2BF16 +
 * VPERMW was faster on rows in L2 but 10-25% slower on tensors streamed from L3 or memory.)
 */
#ifndef NF_BF16DOT_H
#define NF_BF16DOT_H
#if NF_AVX512 && defined(__AVX512BF16__)
#define NF_BF16DOT 1
#define NF_PAIR 32 /* bf16 values per register */

/* Σx² (and Σx) of R rows, xs elements apart, one row after another (R is a literal at each call
 * site; a sequential stream measured faster than interleaving the rows, in cache or not). */
static inline __attribute__((always_inline)) void nf_bf16dot_stats(const uint16_t *x, int64_t xs, int R, int64_t n,
                                                                 int with_sum, float *sq, float *sm) {
    const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int i = 0; i < R; i++) {
        const uint16_t *xr = x + i * xs;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, s0 = a0, s1 = a0;
        int64_t j = nf_head(xr, 2, 64, n);
        if (j) {
            __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << j) - 1), xr);
            a1 = _mm512_dpbf16_ps(a1, v, v);
            if (with_sum) s1 = _mm512_dpbf16_ps(s1, v, one);
        }
        for (; j + 4 * NF_PAIR <= n; j += 4 * NF_PAIR) {
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(xr + j), v1 = (__m512bh)_mm512_loadu_si512(xr + j + NF_PAIR);
            __m512bh v2 = (__m512bh)_mm512_loadu_si512(xr + j + 2 * NF_PAIR), v3 = (__m512bh)_mm512_loadu_si512(xr + j + 3 * NF_PAIR);
            a0 = _mm512_dpbf16_ps(a0, v0, v0); a1 = _mm512_dpbf16_ps(a1, v1, v1);
            a2 = _mm512_dpbf16_ps(a2, v2, v2); a3 = _mm512_dpbf16_ps(a3, v3, v3);
            if (with_sum) { s0 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(s0, v0, one), v1, one); s1 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(s1, v2, one), v3, one); }
        }
        for (; j < n; j += NF_PAIR) {
            const __mmask32 m = n - j >= NF_PAIR ? (__mmask32)~0u : (__mmask32)((1ull << (n - j)) - 1);
            __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(m, xr + j);
            a0 = _mm512_dpbf16_ps(a0, v, v);
            if (with_sum) s0 = _mm512_dpbf16_ps(s0, v, one);
        }
        sq[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
        sm[i] = with_sum ? _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) : 0.f;
    }
}

#else
#define NF_BF16DOT 0
#endif

#endif /* NF_BF16DOT_H */
