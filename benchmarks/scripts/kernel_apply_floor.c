/* A floor for the forward: an nf_forward that runs only the normalize pass, y = x · c · w with a
 * fixed c, over the same vector layer (nf_simd.h) as the real kernel: each element is loaded,
 * widened to float32, scaled twice, narrowed and stored, which every RMSNorm forward must do at
 * least once. No statistics pass. bfloat16 rounds as the kernel does for a bf16 weight (bf16q), on
 * the AVX2 path in the kernel's pair layout (nf_bf16pair.h). Built like the kernel library and passed to
 * benchmarks/scripts/kernel_forward_ab.c as B ("DIFFERENT" is expected):
 *
 *   S=src/normfold/ops/csrc
 *   gcc -O3 -shared -fPIC -mavx2 -mfma -mf16c benchmarks/scripts/kernel_apply_floor.c -I$S -o /tmp/floor.so
 *
 * Used for docs/kernels-cpu.md, "The half-precision forward in cache: the normalize pass alone".
 * Contiguous rows, weight in the input dtype or float32, no bias, one thread.
 */
#include <stdint.h>
#include <stdlib.h>
#include "nf_simd.h"
#include "nf_bf16pair.h"

#define APPLY(T, LDT, STT, LDNT, STNT)                                                                 \
    for (int64_t i = 0; i < rows; i++) {                                                             \
        const T *xr = (const T *)x + i * xs;                                                         \
        T *yr = (T *)y + i * n;                                                                      \
        int64_t j = 0;                                                                               \
        for (; j + NF_VW <= n; j += NF_VW) STT(yr + j, vf_mul(vf_mul(LDT(xr + j), c), ld_f32(wf + j))); \
        if (j < n) STNT(yr + j, vf_mul(vf_mul(LDNT(xr + j, n - j), c), ldn_f32(wf + j, n - j)), n - j); \
    }

int nf_forward(int dtype, const void *x, int64_t xs, const void *res, int64_t rst, const void *w, int wdt,
               const void *b, int bdt, void *y, void *s, float *rstd, int64_t rows, int64_t n, float eps,
               int compressed, int nthreads) {
    (void)res; (void)rst; (void)b; (void)bdt; (void)s; (void)rstd; (void)eps; (void)compressed; (void)nthreads;
    float *wf = malloc((size_t)n * sizeof(float)); /* the weight widened once, as nf_param_f32 does */
    if (!wf) return -2;
    for (int64_t j = 0; j < n; j++)
        wf[j] = wdt == 0 ? ((const float *)w)[j]
                : wdt == 1 ? nf_bf16_to_f32(((const uint16_t *)w)[j])
                           : nf_f16_to_f32(((const nf_f16 *)w)[j]);
    const vf c = vf_set1(0.7f);
    if (dtype == 0) APPLY(float, ld_f32, st_f32, ldn_f32, stn_f32)
    else if (dtype == 1) {
#if NF_BF16PAIR
        float *wp = malloc((size_t)n * sizeof(float)), rs[1] = {0.7f};
        if (!wp) { free(wf); return -2; }
        nf_pair_params(wf, n, wp);
        for (int64_t i = 0; i < rows; i++)
            nf_bf16pair_apply((const uint16_t *)x + i * xs, xs, (uint16_t *)y + i * n, 1, n, rs, wp, 0, wf, 0, 1, 0);
        free(wp);
#else
        APPLY(uint16_t, ld_bf16, st_bf16q, ldn_bf16, stn_bf16q)
#endif
    }
    else APPLY(nf_f16, ld_f16, st_f16, ldn_f16, stn_f16)
    free(wf);
    return 0;
}
