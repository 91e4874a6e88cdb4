/* Row kernels of (C)RMSNorm for one storage dtype. Included once per dtype by rmsnorm_cpu.c with
 * NF_T (element type) and NF_S (suffix: f32, bf16, f16) defined; no include guard on purpose.
 * NF_USE_BF16DOT (bf16 only) takes the row statistics from nf_bf16dot.h; NF_USE_BF16PAIR (bf16q on
 * the AVX2 path) takes statistics, the fused add and, given pair-layout parameters, the normalize
 * pass from nf_bf16pair.h.
 *
 * Every row is read from memory once: the statistics pass brings it into L1, the second pass
 * (normalize, or the gradient) reads it from there. All arithmetic is float32; each output is
 * rounded once to the storage dtype.
 *
 * Rows go in blocks of NF_RB (`R` is a literal at every call site, NF_RB or 1, so loops over the
 * block's rows unroll and per-row values stay in registers). Measured on an AVX-512 EPYC (Zen 5),
 * one thread, CPU time, interleaved A/B runs:
 *   - every pass reads a row as one sequential stream (interleaving the rows of a block was 10-40%
 *     slower on tensors streamed from L3 or memory, and no faster in cache);
 *   - forward: blocks help only where a row's statistics latency (dependent adds, horizontal sum,
 *     square root) shows, i.e. half-precision rows (conversion work per element) whose block
 *     still fits in L1: NF_FWD_BLOCK per dtype and NF_L1_BLOCK (-15% at bf16 512x768 and
 *     4096x768; float32 ran 10-15% faster one row at a time);
 *   - backward: after each row's dot product, the gradient pass walks the block's rows together
 *     so one load/store of weight, dweight and dbias serves NF_RB rows: -20 to -30% when the
 *     tensors come from cache or rows are wide (4096), but its NF_RB interleaved output streams
 *     cost 10-20% when dy, x and dx stream from memory; nf_backward_block_rows() decides;
 *   - each row starts with a masked head up to a vector-aligned address (nf_head): rows of an
 *     odd width otherwise split a cache line on almost every load and store.
 */
#define NF_CAT2(a, b) a##_##b
#define NF_CAT(a, b) NF_CAT2(a, b)
#define NF_FN(name) NF_CAT(name, NF_S)
#define LD NF_CAT(ld, NF_S)
#define LDN NF_CAT(ldn, NF_S)
#define ST NF_CAT(st, NF_S)
#define STN NF_CAT(stn, NF_S)
#ifndef NF_STREAMS
#define NF_STREAMS 0 /* streaming stores: the float32 instantiation only (nf_backward_streams, nf_add_streams) */
#endif
#if NF_HAVE_STREAM && NF_STREAMS
#define STS NF_CAT(sts, NF_S)
#else
#define STS ST
#endif
#define RT NF_CAT(rt, NF_S)
#define NF_VB ((int64_t)(NF_VW * sizeof(NF_T))) /* bytes of one vector of this dtype */
#define HEAD(p, n) nf_head((p), (int64_t)sizeof(NF_T), NF_VB, (n))
#if NF_USE_BF16DOT
#define NF_BLK_STATS nf_bf16dot_stats
#elif NF_USE_BF16PAIR
#define NF_BLK_STATS nf_bf16pair_stats
#else
#define NF_BLK_STATS NF_FN(blk_stats)
#endif
#if NF_USE_BF16PAIR
#define NF_BLK_ADD_STATS(x, xs, r, rst, s, R, n, ws, sq, sm, nt) nf_bf16pair_add_stats(x, xs, r, rst, s, R, n, ws, sq, sm)
#else
#define NF_BLK_ADD_STATS NF_FN(blk_add_stats)
#endif

/* Σx² (and Σx when `with_sum`) of R rows, xs elements apart. */
static NF_INLINE void NF_FN(blk_stats)(const NF_T *x, int64_t xs, int R, int64_t n, int with_sum, float *sq,
                                       float *sm) {
    for (int i = 0; i < R; i++) {
        const NF_T *xr = x + i * xs;
        vf a0 = vf_zero(), a1 = vf_zero(), a2 = vf_zero(), a3 = vf_zero(), s0 = vf_zero(), s1 = vf_zero();
        int64_t j = HEAD(xr, n);
        if (j) {
            vf v = LDN(xr, j);
            a1 = vf_fma(v, v, a1);
            if (with_sum) s1 = v;
        }
        for (; j + 4 * NF_VW <= n; j += 4 * NF_VW) {
            vf v0 = LD(xr + j), v1 = LD(xr + j + NF_VW), v2 = LD(xr + j + 2 * NF_VW), v3 = LD(xr + j + 3 * NF_VW);
            a0 = vf_fma(v0, v0, a0); a1 = vf_fma(v1, v1, a1); a2 = vf_fma(v2, v2, a2); a3 = vf_fma(v3, v3, a3);
            if (with_sum) { s0 = vf_add(s0, vf_add(v0, v1)); s1 = vf_add(s1, vf_add(v2, v3)); }
        }
        for (; j < n; j += NF_VW) {
            vf v = n - j >= NF_VW ? LD(xr + j) : LDN(xr + j, n - j);
            a0 = vf_fma(v, v, a0);
            if (with_sum) s0 = vf_add(s0, v);
        }
        sq[i] = vf_sum(vf_add(vf_add(a0, a1), vf_add(a2, a3)));
        sm[i] = with_sum ? vf_sum(vf_add(s0, s1)) : 0.f;
    }
}

/* s = x + r rounded to the storage dtype (written to s, rows n apart), and the statistics of that
 * rounded s, so the fused op equals the unfused `norm(x + r)` exactly. `nt`: s by streaming stores. */
static NF_INLINE void NF_FN(blk_add_stats)(const NF_T *x, int64_t xs, const NF_T *r, int64_t rst, NF_T *s, int R,
                                           int64_t n, int with_sum, float *sq, float *sm, int nt) {
    for (int i = 0; i < R; i++) {
        const NF_T *xr = x + i * xs, *rr = r + i * rst;
        NF_T *sr = s + i * n;
        vf a0 = vf_zero(), a1 = vf_zero(), s0 = vf_zero();
        int64_t j = HEAD(sr, n);
        if (j) {
            vf v = vf_add(LDN(xr, j), LDN(rr, j));
            STN(sr, v, j);
            v = RT(v);
            a1 = vf_fma(v, v, a1);
            if (with_sum) s0 = v;
        }
        for (; j + 2 * NF_VW <= n; j += 2 * NF_VW) {
            vf v0 = vf_add(LD(xr + j), LD(rr + j)), v1 = vf_add(LD(xr + j + NF_VW), LD(rr + j + NF_VW));
            if (nt) { STS(sr + j, v0); STS(sr + j + NF_VW, v1); } /* aligned: HEAD(sr) above */
            else { ST(sr + j, v0); ST(sr + j + NF_VW, v1); }
            v0 = RT(v0);
            v1 = RT(v1);
            a0 = vf_fma(v0, v0, a0);
            a1 = vf_fma(v1, v1, a1);
            if (with_sum) s0 = vf_add(s0, vf_add(v0, v1));
        }
        for (; j < n; j += NF_VW) {
            const int64_t k = n - j < NF_VW ? n - j : NF_VW;
            vf v = vf_add(LDN(xr + j, k), LDN(rr + j, k));
            STN(sr + j, v, k);
            v = RT(v);
            a0 = vf_fma(v, v, a0);
            if (with_sum) s0 = vf_add(s0, v);
        }
        sq[i] = vf_sum(vf_add(a0, a1));
        sm[i] = with_sum ? vf_sum(s0) : 0.f;
    }
}

/* y = x · rs · w + b for R rows (y rows n apart). With `sum_nt`, x is x + r recomputed (r rows rst
 * apart; the float32 sum the statistics pass streamed out, not read back) and y goes out by
 * streaming stores. `hw`/`hb`/`sum_nt` are literals at every call site. */
static NF_INLINE void NF_FN(blk_apply)(const NF_T *x, int64_t xs, const NF_T *r, int64_t rst, NF_T *y, int R,
                                       int64_t n, const float *rs, const float *w, const float *b, int hw, int hb,
                                       int sum_nt) {
#define NF_SRC(j) (sum_nt ? vf_add(LD(xr + (j)), LD(rr + (j))) : LD(xr + (j)))
#define NF_SRCN(j, k) (sum_nt ? vf_add(LDN(xr + (j), k), LDN(rr + (j), k)) : LDN(xr + (j), k))
    for (int i = 0; i < R; i++) {
        const NF_T *xr = x + i * xs, *rr = sum_nt ? r + i * rst : 0;
        NF_T *yr = y + i * n;
        const vf vr = vf_set1(rs[i]);
        int64_t j = HEAD(yr, n);
        if (j) {
            vf v = vf_mul(NF_SRCN(0, j), vr);
            if (hw && hb) v = vf_fma(v, ldn_f32(w, j), ldn_f32(b, j));
            else if (hw) v = vf_mul(v, ldn_f32(w, j));
            else if (hb) v = vf_add(v, ldn_f32(b, j));
            STN(yr, v, j);
        }
        for (; j + NF_VW <= n; j += NF_VW) {
            vf v = vf_mul(NF_SRC(j), vr);
            if (hw && hb) v = vf_fma(v, ld_f32(w + j), ld_f32(b + j));
            else if (hw) v = vf_mul(v, ld_f32(w + j));
            else if (hb) v = vf_add(v, ld_f32(b + j));
            if (sum_nt) STS(yr + j, v); else ST(yr + j, v); /* aligned: HEAD(yr) above */
        }
        if (j < n) {
            const int64_t k = n - j;
            vf v = vf_mul(NF_SRCN(j, k), vr);
            if (hw && hb) v = vf_fma(v, ldn_f32(w + j, k), ldn_f32(b + j, k));
            else if (hw) v = vf_mul(v, ldn_f32(w + j, k));
            else if (hb) v = vf_add(v, ldn_f32(b + j, k));
            STN(yr + j, v, k);
        }
    }
#undef NF_SRC
#undef NF_SRCN
}

/* One block of R rows starting at row r0 (see forward). */
static NF_INLINE void NF_FN(fwd_block)(const NF_T *x, int64_t xs, const NF_T *res, int64_t rst, const float *w,
                                       const float *b, const float *wp, const float *bp, NF_T *y, NF_T *s,
                                       float *rstd, int64_t r0, int R, int64_t n, float eps, float inv_d,
                                       int compressed, int nt) {
    float sq[NF_RB], sm[NF_RB], rs[NF_RB];
    const NF_T *src = x + r0 * xs, *rr = res ? res + r0 * rst : 0;
    int64_t ss = xs;
    /* the fused add's s and y by streaming stores (nf_add_streams); y then from x + r, not s */
    const int stream = NF_STREAMS && nt && res;
    if (res) {
        NF_T *sr = s + r0 * n;
        if (compressed) NF_BLK_ADD_STATS(src, xs, rr, rst, sr, R, n, 1, sq, sm, stream);
        else NF_BLK_ADD_STATS(src, xs, rr, rst, sr, R, n, 0, sq, sm, stream);
        if (!stream) {
            src = sr;
            ss = n;
        }
    } else if (compressed) {
        NF_BLK_STATS(src, xs, R, n, 1, sq, sm);
    } else {
        NF_BLK_STATS(src, xs, R, n, 0, sq, sm);
    }
    for (int i = 0; i < R; i++) {
        rs[i] = 1.0f / sqrtf((sq[i] + sm[i] * sm[i]) * inv_d + eps);
        /* A row holding Inf or NaN comes out all NaN, as LayerNorm's does (1/sqrt(inf) = 0 would
         * otherwise turn its finite entries into 0 and only the Inf itself into NaN). */
        if (!isfinite(sq[i] + sm[i])) rs[i] = NAN;
        if (rstd) rstd[r0 + i] = rs[i];
    }
    if (!y) return; /* statistics only (nf_forward with y = 0) */
    NF_T *yr = y + r0 * n;
#if NF_USE_BF16PAIR
    if ((!w || wp) && (!b || bp)) {
        if (w && b) nf_bf16pair_apply(src, ss, yr, R, n, rs, wp, bp, w, b, 1, 1);
        else if (w) nf_bf16pair_apply(src, ss, yr, R, n, rs, wp, bp, w, b, 1, 0);
        else if (b) nf_bf16pair_apply(src, ss, yr, R, n, rs, wp, bp, w, b, 0, 1);
        else nf_bf16pair_apply(src, ss, yr, R, n, rs, wp, bp, w, b, 0, 0);
        return;
    }
#else
    (void)wp;
    (void)bp;
#endif
#define NF_APPLY(hw, hb, sum_nt) NF_FN(blk_apply)(src, ss, rr, rst, yr, R, n, rs, w, b, hw, hb, sum_nt)
    if (stream) {
        if (w && b) NF_APPLY(1, 1, 1);
        else if (w) NF_APPLY(1, 0, 1);
        else if (b) NF_APPLY(0, 1, 1);
        else NF_APPLY(0, 0, 1);
    } else {
        if (w && b) NF_APPLY(1, 1, 0);
        else if (w) NF_APPLY(1, 0, 0);
        else if (b) NF_APPLY(0, 1, 0);
        else NF_APPLY(0, 0, 0);
    }
#undef NF_APPLY
}

/* y = norm(x), or s = x + res and y = norm(s). wp / bp: w / b in pair layout, or 0 (NF_USE_BF16PAIR).
 * nt: the fused add writes s and y by streaming stores (nf_add_streams; float32 only). */
static void NF_FN(forward)(const NF_T *x, int64_t xs, const NF_T *res, int64_t rst, const float *w, const float *b,
                           const float *wp, const float *bp, NF_T *y, NF_T *s, float *rstd, int64_t rows, int64_t n,
                           float eps, int compressed, int nth, int nt) {
    const float inv_d = 1.0f / (float)(compressed ? n + 1 : n);
    const int rb = NF_FWD_BLOCK && (int64_t)sizeof(NF_T) * n * NF_RB <= NF_L1_BLOCK ? NF_RB : 1;
    const int64_t blocks = (rows + rb - 1) / rb;
#define NF_FWD_BLOCKS(nt_)                                                                                    \
    for (int64_t blk = 0; blk < blocks; blk++) {                                                              \
        const int64_t r0 = blk * rb;                                                                          \
        if (rb == NF_RB && r0 + NF_RB <= rows) {                                                              \
            NF_FN(fwd_block)(x, xs, res, rst, w, b, wp, bp, y, s, rstd, r0, NF_RB, n, eps, inv_d, compressed, nt_); \
        } else {                                                                                              \
            for (int64_t r = r0; r < rows && r < r0 + rb; r++)                                               \
                NF_FN(fwd_block)(x, xs, res, rst, w, b, wp, bp, y, s, rstd, r, 1, n, eps, inv_d, compressed, nt_); \
        }                                                                                                     \
    }
    /* The streaming case needs each thread to fence after its rows, hence a region with a `nowait`
     * loop; that form measured 10-20% slower than `parallel for` in the float32 forward (with the
     * arguments firstprivate too), so the ordinary case keeps `parallel for`. */
    if (!nt) {
#pragma omp parallel for schedule(static) num_threads(nth) if (nth > 1)
        NF_FWD_BLOCKS(0)
    } else {
#pragma omp parallel num_threads(nth) if (nth > 1)
        {
#pragma omp for schedule(static) nowait
            NF_FWD_BLOCKS(1)
            nf_stream_fence(); /* before the region's closing barrier */
        }
    }
#undef NF_FWD_BLOCKS
}

/* Columns [j, j + k) of the gradient pass for R rows; `full` (k == NF_VW) is a literal at each
 * call site so the main loop has no tail logic. */
static NF_INLINE void NF_FN(bwd_cols)(const NF_T *dy, const NF_T *ds, const NF_T *x, int64_t xs, const float *w,
                                      const vf *vr, const vf *vk, const vf *vsh, int compressed, NF_T *dx,
                                      float *dwt, float *dbt, int R, int64_t n, int hw, int64_t j, int64_t k,
                                      int full, int nt) {
    vf wv = hw ? (full ? ld_f32(w + j) : ldn_f32(w + j, k)) : vf_zero();
    vf dwa = vf_zero(), dba = vf_zero();
    for (int i = 0; i < R; i++) {
        vf d = full ? LD(dy + i * n + j) : LDN(dy + i * n + j, k);
        vf xv = full ? LD(x + i * xs + j) : LDN(x + i * xs + j, k);
        vf g = hw ? vf_mul(d, wv) : d;
        vf o = vf_fnma(vk[i], compressed ? vf_add(xv, vsh[i]) : xv, vf_mul(vr[i], g));
        if (ds) o = vf_add(o, full ? LD(ds + i * n + j) : LDN(ds + i * n + j, k));
        NF_T *p = dx + i * n + j;
        if (!full) STN(p, o, k);
        else if (nt && !((uintptr_t)p & (NF_VB - 1))) STS(p, o); /* streaming stores need alignment */
        else ST(p, o);
        if (dwt) dwa = vf_fma(vf_mul(d, xv), vr[i], dwa);
        if (dbt) dba = vf_add(dba, d);
    }
    if (dwt) {
        vf acc = vf_add(dwa, full ? ld_f32(dwt + j) : ldn_f32(dwt + j, k));
        if (full) st_f32(dwt + j, acc); else stn_f32(dwt + j, acc, k);
    }
    if (dbt) {
        vf acc = vf_add(dba, full ? ld_f32(dbt + j) : ldn_f32(dbt + j, k));
        if (full) st_f32(dbt + j, acc); else stn_f32(dbt + j, acc, k);
    }
}

/* Gradient of R rows. With g = dy·w, r = rstd, c = Σ g·x:
 *   RMSNorm:  dx = r·g − r³·c/d · x
 *   CRMSNorm: dx = r·g − r³·c/d · (x + Σx)        (paper 001 eq. 5, d = n + 1)
 * plus ds (the gradient reaching the sum output of the fused add). dw += dy·x·r, db += dy into this
 * thread's float32 rows. dy, ds, dx rows are n apart, x rows xs apart. `hw` and `nt` (streaming
 * stores for dx) are literals. */
static NF_INLINE void NF_FN(blk_backward)(const NF_T *dy, const NF_T *ds, const NF_T *x, int64_t xs, const float *w,
                                          const float *rstd, float inv_d, int compressed, NF_T *dx, float *dwt,
                                          float *dbt, int R, int64_t n, int hw, int nt) {
    vf c0[NF_RB], m0[NF_RB];
    for (int i = 0; i < R; i++) { /* row by row: c = Σ g·x (and Σx for CRMSNorm) */
        vf c1 = vf_zero(), m1 = vf_zero();
        c0[i] = m0[i] = vf_zero();
        int64_t j = HEAD(x + i * xs, n);
        if (j) {
            vf g = LDN(dy + i * n, j), xv = LDN(x + i * xs, j);
            if (hw) g = vf_mul(g, ldn_f32(w, j));
            c1 = vf_fma(g, xv, c1);
            if (compressed) m1 = xv;
        }
        for (; j + 2 * NF_VW <= n; j += 2 * NF_VW) {
            vf g0 = LD(dy + i * n + j), g1 = LD(dy + i * n + j + NF_VW);
            vf x0 = LD(x + i * xs + j), x1 = LD(x + i * xs + j + NF_VW);
            if (hw) { g0 = vf_mul(g0, ld_f32(w + j)); g1 = vf_mul(g1, ld_f32(w + j + NF_VW)); }
            c0[i] = vf_fma(g0, x0, c0[i]); c1 = vf_fma(g1, x1, c1);
            if (compressed) { m0[i] = vf_add(m0[i], x0); m1 = vf_add(m1, x1); }
        }
        for (; j < n; j += NF_VW) {
            const int64_t k = n - j < NF_VW ? n - j : NF_VW;
            vf g = k == NF_VW ? LD(dy + i * n + j) : LDN(dy + i * n + j, k);
            vf xv = k == NF_VW ? LD(x + i * xs + j) : LDN(x + i * xs + j, k);
            if (hw) g = vf_mul(g, k == NF_VW ? ld_f32(w + j) : ldn_f32(w + j, k));
            c1 = vf_fma(g, xv, c1);
            if (compressed) m1 = vf_add(m1, xv);
        }
        c0[i] = vf_add(c0[i], c1);
        m0[i] = vf_add(m0[i], m1);
    }
    vf vr[NF_RB], vk[NF_RB], vsh[NF_RB];
    for (int i = 0; i < R; i++) {
        const float rs = rstd[i], c = vf_sum(c0[i]);
        vr[i] = vf_set1(rs);
        vk[i] = vf_set1(rs * rs * rs * c * inv_d);
        vsh[i] = vf_set1(compressed ? vf_sum(m0[i]) : 0.f);
    }
    const int64_t head = HEAD(dx, n); /* aligns the stores of the block's first row */
    int64_t j = 0;
    if (head) NF_FN(bwd_cols)(dy, ds, x, xs, w, vr, vk, vsh, compressed, dx, dwt, dbt, R, n, hw, 0, head, 0, 0);
    for (j = head; j + NF_VW <= n; j += NF_VW)
        NF_FN(bwd_cols)(dy, ds, x, xs, w, vr, vk, vsh, compressed, dx, dwt, dbt, R, n, hw, j, NF_VW, 1, nt);
    if (j < n) NF_FN(bwd_cols)(dy, ds, x, xs, w, vr, vk, vsh, compressed, dx, dwt, dbt, R, n, hw, j, n - j, 0, 0);
}

static NF_INLINE void NF_FN(bwd_block)(const NF_T *dy, const NF_T *ds, const NF_T *x, int64_t xs, const float *w,
                                       const float *rstd, float inv_d, int compressed, NF_T *dx, float *dwt,
                                       float *dbt, int64_t r0, int R, int64_t n, int nt) {
    const NF_T *dsr = ds ? ds + r0 * n : 0;
#define NF_BWD(hw, nt) NF_FN(blk_backward)(dy + r0 * n, dsr, x + r0 * xs, xs, w, rstd + r0, inv_d, compressed, \
                                         dx + r0 * n, dwt, dbt, R, n, hw, nt)
    /* hw and nt as literals: each combination gets its own loop (a runtime nt cost 2-10%) */
    if (NF_STREAMS && nt) { if (w) NF_BWD(1, 1); else NF_BWD(0, 1); }
    else { if (w) NF_BWD(1, 0); else NF_BWD(0, 0); }
#undef NF_BWD
}

/* rb: rows per block, NF_RB or 1 (chosen by nf_backward_block_rows); nt: store dx with streaming
 * stores (nf_backward_streams). */
static void NF_FN(backward)(const NF_T *dy, const NF_T *ds, const NF_T *x, int64_t xs, const float *w,
                            const float *rstd, NF_T *dx, float *dw_part, float *db_part, int64_t rows, int64_t n,
                            int compressed, int nth, int rb, int nt) {
    const float inv_d = 1.0f / (float)(compressed ? n + 1 : n);
    const int64_t blocks = (rows + rb - 1) / rb;
    int team = 1; /* the team OpenMP really gave us (may be smaller than nth) */
#pragma omp parallel num_threads(nth) if (nth > 1)
    {
        const int tid = nf_thread_num();
        if (tid == 0) team = nf_num_threads();
        float *dwt = dw_part ? dw_part + (int64_t)tid * n : 0;
        float *dbt = db_part ? db_part + (int64_t)tid * n : 0;
        if (dwt) memset(dwt, 0, (size_t)n * sizeof(float));
        if (dbt) memset(dbt, 0, (size_t)n * sizeof(float));
#pragma omp for schedule(static) nowait
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t r0 = blk * rb;
            if (rb == NF_RB && r0 + NF_RB <= rows) {
                NF_FN(bwd_block)(dy, ds, x, xs, w, rstd, inv_d, compressed, dx, dwt, dbt, r0, NF_RB, n, nt);
            } else {
                for (int64_t r = r0; r < rows && r < r0 + rb; r++)
                    NF_FN(bwd_block)(dy, ds, x, xs, w, rstd, inv_d, compressed, dx, dwt, dbt, r, 1, n, nt);
            }
        }
        if (nt) nf_stream_fence(); /* before the region's closing barrier */
    }
    nf_reduce_rows(dw_part, team, n);
    nf_reduce_rows(db_part, team, n);
}

#undef NF_CAT2
#undef NF_CAT
#undef NF_FN
#undef LD
#undef LDN
#undef ST
#undef STN
#undef STS
#undef NF_STREAMS
#undef RT
#undef NF_VB
#undef HEAD
#undef NF_BLK_STATS
#undef NF_BLK_ADD_STATS
