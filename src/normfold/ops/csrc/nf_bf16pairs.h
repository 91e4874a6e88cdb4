/* bfloat16 rows with AVX512_BF16: work on 32 values per 512-bit register, as (even, odd) pairs.
 *
 * A dword of a bf16 row holds an even element in its low half and the next (odd) one in its high
 * half, so one load gives both halves as float32 with one shift and one mask. Sums of squares do
 * not care about order, and VDPBF16PS squares and adds both halves in one instruction (products of
 * two bf16 are exact in float32; accumulation is float32, like everywhere else). The normalize pass
 * multiplies the halves by weight/bias rows stored in the same (even, odd) split (prepared once per
 * call by nf_split_pairs) and VCVTNE2PS2BF16 + VPERMW put the rounded halves back in order. This
 * roughly halves the instructions per element compared with widening 16 values at a time, which is
 * what bounds a bf16 norm when its rows are in cache.
 */
#ifndef NF_BF16PAIRS_H
#define NF_BF16PAIRS_H

#if NF_AVX512 && defined(__AVX512BF16__)
#define NF_PAIRS 1
#define NF_PAIR 32 /* bf16 values per register */

static inline __m512 nf_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 nf_odd(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))); }

/* (even, odd) float32 halves back to 32 bf16 values in row order, rounded to nearest even. */
static inline __m512i nf_join_pairs(__m512 even, __m512 odd) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

/* p[c*32 + k] = q[c*32 + 2k], p[c*32 + 16 + k] = q[c*32 + 2k + 1] for every full 32-chunk of q. */
static void nf_split_pairs(const float *q, float *p, int64_t n) {
    for (int64_t c = 0; c + NF_PAIR <= n; c += NF_PAIR)
        for (int k = 0; k < 16; k++) {
            p[c + k] = q[c + 2 * k];
            p[c + 16 + k] = q[c + 2 * k + 1];
        }
}

/* Σx² (and Σx) of R rows, xs elements apart (R is a literal at each call site). */
static inline __attribute__((always_inline)) void nf_pairs_stats(const uint16_t *x, int64_t xs, int R, int64_t n,
                                                                 int with_sum, float *sq, float *sm) {
    __m512 a0[NF_RB], a1[NF_RB], s0[NF_RB];
    const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int i = 0; i < R; i++) a0[i] = a1[i] = s0[i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 * NF_PAIR <= n; j += 2 * NF_PAIR)
        for (int i = 0; i < R; i++) {
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(x + i * xs + j);
            __m512bh v1 = (__m512bh)_mm512_loadu_si512(x + i * xs + j + NF_PAIR);
            a0[i] = _mm512_dpbf16_ps(a0[i], v0, v0);
            a1[i] = _mm512_dpbf16_ps(a1[i], v1, v1);
            if (with_sum) s0[i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(s0[i], v0, one), v1, one);
        }
    for (; j < n; j += NF_PAIR) { /* masked where fewer than 32 are left: zeros elsewhere */
        const __mmask32 m = n - j >= NF_PAIR ? (__mmask32)~0u : (__mmask32)((1ull << (n - j)) - 1);
        for (int i = 0; i < R; i++) {
            __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * xs + j);
            a0[i] = _mm512_dpbf16_ps(a0[i], v, v);
            if (with_sum) s0[i] = _mm512_dpbf16_ps(s0[i], v, one);
        }
    }
    for (int i = 0; i < R; i++) {
        sq[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
        sm[i] = with_sum ? _mm512_reduce_add_ps(s0[i]) : 0.f;
    }
}

/* y = x·rs·w + b for R rows (x rows xs apart, y rows n apart); wp / bp are w / b in the (even, odd)
 * split, w / b in row order for the tail. `R`, `hw`, `hb` are literals at each call site. */
static inline __attribute__((always_inline)) void nf_pairs_apply(const uint16_t *x, int64_t xs, uint16_t *y, int R,
                                                                 int64_t n, const float *rs, const float *w,
                                                                 const float *b, const float *wp, const float *bp,
                                                                 int hw, int hb) {
    __m512 vr[NF_RB];
    for (int i = 0; i < R; i++) vr[i] = _mm512_set1_ps(rs[i]);
    int64_t j = 0;
    for (; j + NF_PAIR <= n; j += NF_PAIR) {
        __m512 we = _mm512_setzero_ps(), wo = we, be = we, bo = we;
        if (hw) { we = _mm512_loadu_ps(wp + j); wo = _mm512_loadu_ps(wp + j + 16); }
        if (hb) { be = _mm512_loadu_ps(bp + j); bo = _mm512_loadu_ps(bp + j + 16); }
        for (int i = 0; i < R; i++) {
            __m512i v = _mm512_loadu_si512(x + i * xs + j);
            __m512 e = _mm512_mul_ps(nf_even(v), vr[i]), o = _mm512_mul_ps(nf_odd(v), vr[i]);
            if (hw && hb) { e = _mm512_fmadd_ps(e, we, be); o = _mm512_fmadd_ps(o, wo, bo); }
            else if (hw) { e = _mm512_mul_ps(e, we); o = _mm512_mul_ps(o, wo); }
            else if (hb) { e = _mm512_add_ps(e, be); o = _mm512_add_ps(o, bo); }
            _mm512_storeu_si512(y + i * n + j, nf_join_pairs(e, o));
        }
    }
    for (; j < n; j += 16) { /* tail in row order, 16 at a time */
        const int64_t k = n - j < 16 ? n - j : 16;
        __m512 wv = hw ? ldn_f32(w + j, k) : _mm512_setzero_ps(), bv = hb ? ldn_f32(b + j, k) : _mm512_setzero_ps();
        for (int i = 0; i < R; i++) {
            __m512 v = _mm512_mul_ps(ldn_bf16(x + i * xs + j, k), vr[i]);
            if (hw && hb) v = _mm512_fmadd_ps(v, wv, bv);
            else if (hw) v = _mm512_mul_ps(v, wv);
            else if (hb) v = _mm512_add_ps(v, bv);
            stn_bf16(y + i * n + j, v, k);
        }
    }
}

#else
#define NF_PAIRS 0
#endif

#endif /* NF_BF16PAIRS_H */
