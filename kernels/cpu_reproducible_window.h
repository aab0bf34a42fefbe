/* The one pass of the window method (ringmpi/reproducible_float32.py), one element type.
 *
 * Included by kernels/cpu_reproducible_float32.c once per type, after the names below (no
 * include guard: each inclusion defines the functions of that type):
 *
 *   W_T, W_V, W_VN       the element type, its native vector, the lanes of that vector;
 *   W_MASK_T, W_MASKV    an integer of W_T's width and its vector (lane masks);
 *   W_R, W_NK, W_NV      register blocking: rows x vectors of keys (scores), of columns (P V);
 *   W_K, W_CW            keys per k^T panel (W_NK W_VN), columns per P V tile (W_NV W_VN);
 *   W_F                  the levels of a row's sums;
 *   W_LD, W_ST, W_SEL, W_SPLAT, W_MAX   vector load, store, lane select, broadcast, and a
 *                        running maximum in which a NaN stays;
 *   W_MADD(b, x, a)      one step of a chain: fma(b, x, a) for float32, a + b x for float64;
 *   W_REF(m)             a block's reference r (an integer) from its largest chain value m;
 *   FN(weights)(t, r, s) a row's 256 chain values t (scale s) made weights 2^(t' - r) in
 *                        place (t' the score in base 2), defined before the inclusion;
 *   W_TREE64             the fixed tree sum of 64 weights;
 *   W_WIDE(p)            RMF_DN values at p as a vector of doubles;
 *   FN(x)                the functions' names (rmf_x for float32, rmd_x for float64).
 * They are undefined at the end, ready for the next instance.
 *
 * The bits do not depend on the blocking: every score and every chain is its own sequence
 * of operations (the file's header has the argument). */

/* Scores of W_R rows x one panel: t[r][j] = the W_MADD chain over d (from +0, d in index order);
 * mv (may be NULL): each row's running maximum vector, updated from the registers */
static inline void FN(scores)(const W_T *const qr[W_R], const W_T *kp, int64_t D,
                              W_T *t, int64_t ldt, W_V *mv) {
    W_V a[W_R][W_NK];
#pragma GCC unroll 8
    for (int r = 0; r < W_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < W_NK; c++) a[r][c] = (W_V){0};
    for (int64_t d = 0; d < D; d++) {
        W_V k[W_NK];
#pragma GCC unroll 4
        for (int c = 0; c < W_NK; c++) k[c] = W_LD(kp + d * W_K + c * W_VN);
#pragma GCC unroll 8
        for (int r = 0; r < W_R; r++) {
            const W_V b = W_SPLAT(qr[r][d]);
#pragma GCC unroll 4
            for (int c = 0; c < W_NK; c++) a[r][c] = W_MADD(b, k[c], a[r][c]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < W_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < W_NK; c++) W_ST(t + r * ldt + c * W_VN, a[r][c]);
    if (mv)
#pragma GCC unroll 8
        for (int r = 0; r < W_R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < W_NK; c++) mv[r] = W_MAX(mv[r], a[r][c]);
}

/* One chain's P V for W_R rows x W_CW columns: o[r][c] = the W_MADD chain over its 64 keys
 * in key order, from +0 */
static inline void FN(pv)(const W_T *p, int64_t ldp, const W_T *vb, int64_t ldv, W_T *o,
                          int64_t ldo) {
    W_V a[W_R][W_NV];
#pragma GCC unroll 8
    for (int r = 0; r < W_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < W_NV; c++) a[r][c] = (W_V){0};
    for (int64_t j = 0; j < RMF_CH; j++) {
        W_V x[W_NV];
#pragma GCC unroll 4
        for (int c = 0; c < W_NV; c++) x[c] = W_LD(vb + j * ldv + c * W_VN);
#pragma GCC unroll 8
        for (int r = 0; r < W_R; r++) {
            const W_V b = W_SPLAT(p[r * ldp + j]);
#pragma GCC unroll 4
            for (int c = 0; c < W_NV; c++) a[r][c] = W_MADD(b, x[c], a[r][c]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < W_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < W_NV; c++) W_ST(o + r * ldo + c * W_VN, a[r][c]);
}

/* reproducible_float32.fold_rows for one row (W_F levels): the block partial (lb, ob) x 2^r
 * into the row's window R and levels L[f], O[f * Dv + c] (grids lg[f], vg[f * Dv + c]); ob
 * is made here from the row's four chain sums os4[q][c]: ((o_0 + o_1) + o_2) + o_3 in
 * float64. */
static void FN(fold)(double r, double lb, const W_T *const os4[RMF_NC], int64_t Dv, double *R,
                     double *L, double *O, const double *lg, const double *vg) {
    if (r != r || *R == INFINITY) {
        *R = INFINITY;
        return;
    }
    const double rw = RMF_W * __builtin_ceil(r / RMF_W);
    if (!(*R >= rw)) { /* a higher window: the levels move down by k */
        int64_t k = *R == -INFINITY ? W_F : (int64_t)((rw - *R) / RMF_W);
        if (k > W_F) k = W_F;
        const double sc = rmf_pow2(-32 * k);
        for (int64_t f = W_F - 1; f >= 0; f--) {
            L[f] = f >= k ? L[f - k] * sc : 0.0;
            double *of = O + f * Dv;
            if (f >= k) {
                const double *og = O + (f - k) * Dv;
                for (int64_t c = 0; c < Dv; c++) of[c] = og[c] * sc;
            } else {
                for (int64_t c = 0; c < Dv; c++) of[c] = 0.0;
            }
        }
        *R = rw;
    }
    const int64_t kk = (int64_t)((*R - rw) / RMF_W);
    if (kk >= W_F) return; /* every part lands below the last level */
    const double s = rmf_pow2((int64_t)(r - rw)), down = rmf_pow2(-32 * kk);
    double x = lb * s;
    for (int64_t f = 0; f + kk < W_F; f++) {
        const double h = (x + lg[f]) - lg[f];
        L[f + kk] = L[f + kk] + h * down;
        x = x - h;
    }
    /* ob = ((o_0 + o_1) + o_2) + o_3 in float64, times 2^(r - Rw), folded: 8 columns at a time
     * (lane by lane the operations of the scalar tail below) */
    int64_t c = 0;
    if (kk == 0) /* the common case: h x 1 = h, the levels in place (the last y - h unused) */
        for (; c + RMF_DN <= Dv; c += RMF_DN) {
            vd y = W_WIDE(os4[0] + c);
            for (int q = 1; q < RMF_NC; q++) y = y + W_WIDE(os4[q] + c);
            y = y * s;
#pragma GCC unroll 4
            for (int f = 0; f < W_F; f++) {
                const vd g = *(const vd *)(vg + f * Dv + c);
                const vd h = (y + g) - g;
                vd *o = (vd *)(O + f * Dv + c);
                *o = *o + h;
                y = y - h;
            }
        }
    for (; c + RMF_DN <= Dv; c += RMF_DN) {
        vd y = W_WIDE(os4[0] + c);
        for (int q = 1; q < RMF_NC; q++) y = y + W_WIDE(os4[q] + c);
        y = y * s;
        for (int64_t f = 0; f + kk < W_F; f++) {
            const vd g = *(const vd *)(vg + f * Dv + c);
            const vd h = (y + g) - g;
            vd *o = (vd *)(O + (f + kk) * Dv + c);
            *o = *o + h * down;
            y = y - h;
        }
    }
    for (; c < Dv; c++) {
        double y = (double)os4[0][c];
        for (int q = 1; q < RMF_NC; q++) y = y + (double)os4[q][c];
        y = y * s;
        for (int64_t f = 0; f + kk < W_F; f++) {
            const double g = vg[f * Dv + c];
            const double h = (y + g) - g;
            O[(f + kk) * Dv + c] = O[(f + kk) * Dv + c] + h * down;
            y = y - h;
        }
    }
}

/* One K/V block (whole global key blocks) against the query rows row0 <= i < row1.
 *
 * qs: (B, H, Sq, D) W_T: float32 q x C rounded (C = scale x log2 e rounded to float32), or
 *     float64 q itself; kt: (B, Hkv, Skp / W_K, D, W_K) W_T k^T in panels; v: (B, Hkv, Skp,
 *     Dvp) W_T (keys past Sk and columns past Dv zero); Skp a multiple of 256, Dvp of W_CW
 * kpos: (Sk,) int64 global positions, kpos[0] a multiple of 256, consecutive
 * lo, hi: (nlay, Sq) int64 visible key ranges (a row sees p when lo[t] <= p <= hi[t], some t)
 * ref: (B, H, Sq) windows; llev: (B, H, Sq, W_F); olev: (B, H, Sq, W_F, Dv) (a row's levels
 * side by side: far apart, at power-of-two strides, they thrashed the caches); lgrid (W_F,);
 * vgrid: (B, Hkv, W_F, Dv); scale: the scores' factor where the chains are of q itself (the
 * float64 instance; the float32 one takes qs, already scaled). Returns 0, or -1 for a bad
 * argument. */
int64_t FN(block)(const W_T *qs, const W_T *kt, const W_T *v, const int64_t *kpos,
                  const int64_t *lo, const int64_t *hi, int64_t nlay, int64_t B, int64_t H,
                  int64_t Hkv, int64_t Sq, int64_t Sk, int64_t Skp, int64_t D, int64_t Dvp,
                  int64_t Dv, int64_t row0, int64_t row1, double *ref, double *llev,
                  double *olev, const double *lgrid, const double *vgrid, double scale) {
    if (Skp % RMF_BK || Skp < Sk || D < 1 || Dv < 1 || Dvp % W_CW || Dvp < Dv || H % Hkv ||
        nlay < 1 || row0 < 0 || row1 > Sq || row0 > row1 || (Sk > 0 && kpos[0] % RMF_BK))
        return -1;
    const int64_t g = H / Hkv;
    W_T t[W_R][RMF_BK], osub[RMF_NC][W_R][Dvp];
    W_T lsub[RMF_NC][W_R];
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t kh = h / g;
            const W_T *kth = kt + (bb * Hkv + kh) * D * Skp;
            const W_T *vh = v + (bb * Hkv + kh) * Skp * Dvp;
            const double *vg = vgrid + (bb * Hkv + kh) * W_F * Dv;
            for (int64_t kb0 = 0; kb0 < Sk; kb0 += RMF_BK) {
                const int64_t nkb = Sk - kb0 < RMF_BK ? Sk - kb0 : RMF_BK;
                const int64_t p0 = kpos[kb0], p1 = kpos[kb0 + nkb - 1];
                for (int64_t i0 = row0; i0 < row1; i0 += W_R) {
                    const int64_t nr = row1 - i0 < W_R ? row1 - i0 : W_R;
                    int64_t rlo = INT64_MAX, rhi = INT64_MIN;
                    for (int64_t tl = 0; tl < nlay; tl++)
                        for (int64_t r = 0; r < nr; r++) {
                            const int64_t a = lo[tl * Sq + i0 + r], b = hi[tl * Sq + i0 + r];
                            if (a > b) continue;
                            rlo = a < rlo ? a : rlo;
                            rhi = b > rhi ? b : rhi;
                        }
                    if (rlo > p1 || rhi < p0) continue; /* no row of the tile sees the block */
                    const W_T *qr[W_R];
                    for (int64_t r = 0; r < W_R; r++)
                        qr[r] = qs + ((bb * H + h) * Sq + i0 + (r < nr ? r : 0)) * D;
                    /* full: every row sees every key of a whole block (no mask to apply; the
                     * maxima come from the registers) */
                    int full = nkb == RMF_BK;
                    for (int64_t r = 0; r < nr && full; r++) {
                        int all = 0;
                        for (int64_t tl = 0; tl < nlay && !all; tl++)
                            all = lo[tl * Sq + i0 + r] <= p0 && hi[tl * Sq + i0 + r] >= p1;
                        full = all;
                    }
                    W_T mx[W_R];
                    if (full) {
                        W_V mv[W_R];
                        for (int r = 0; r < W_R; r++) mv[r] = (W_V){0} - INFINITY;
                        for (int64_t c = 0; c < RMF_BK / W_K; c++)
                            FN(scores)(qr, kth + (kb0 / W_K + c) * W_K * D, D, t[0] + c * W_K,
                                       RMF_BK, mv);
                        for (int r = 0; r < W_R; r++) {
                            W_T m = mv[r][0];
                            for (int l = 1; l < W_VN; l++) m = (m == m && !(mv[r][l] <= m)) ? mv[r][l] : m;
                            mx[r] = m;
                        }
                    } else {
                    for (int64_t c = 0; c < RMF_BK / W_K; c++) {
                        const int64_t j0 = c * W_K;
                        if (j0 >= nkb || kpos[kb0 + j0] > rhi ||
                            kpos[kb0 + (j0 + W_K < nkb ? j0 + W_K : nkb) - 1] < rlo) {
                            for (int r = 0; r < W_R; r++)
                                for (int j = 0; j < W_K; j++) t[r][j0 + j] = -INFINITY;
                            continue;
                        }
                        FN(scores)(qr, kth + (kb0 / W_K + c) * W_K * D, D, t[0] + j0, RMF_BK,
                                   0);
                    }
                    /* invisible keys (and the padding) -inf; the rows' maxima, NaN winning */
                    const W_V minf = (W_V){0} - INFINITY;
                    for (int64_t r = 0; r < W_R; r++) {
                        const int64_t i = i0 + (r < nr ? r : 0);
                        /* the block's keys are consecutive: layer tl shows j in [a, b] */
                        W_MASK_T keep[RMF_BK] = {0};
                        for (int64_t tl = 0; tl < nlay; tl++) {
                            int64_t a = lo[tl * Sq + i] - p0, b = hi[tl * Sq + i] - p0;
                            a = a < 0 ? 0 : a;
                            b = b > nkb - 1 ? nkb - 1 : b;
                            for (int64_t j = a; j <= b; j++) keep[j] = -1;
                        }
                        for (int64_t j = 0; j < RMF_BK; j += W_VN)
                            W_ST(t[r] + j, W_SEL(*(const W_MASKV *)(keep + j), W_LD(t[r] + j), minf));
                        /* a NaN, once in m, stays: take x where m is a number and not x <= m */
                        W_V mv = W_LD(t[r]);
                        for (int64_t j = W_VN; j < RMF_BK; j += W_VN) mv = W_MAX(mv, W_LD(t[r] + j));
                        W_T m = mv[0];
                        for (int l = 1; l < W_VN; l++) m = (m == m && !(mv[l] <= m)) ? mv[l] : m;
                        mx[r] = m;
                    }
                    }
                    int live[W_R], anylive = 0;
                    W_T rr[W_R];
                    for (int r = 0; r < W_R; r++) {
                        live[r] = r < nr && mx[r] != -INFINITY;
                        anylive |= live[r];
                        rr[r] = live[r] ? W_REF(mx[r]) : (W_T)0;
                    }
                    if (!anylive) continue;
                    for (int r = 0; r < W_R; r++) {
                        if (!live[r]) {
                            for (int64_t j = 0; j < RMF_BK; j++) t[r][j] = (W_T)0;
                            continue;
                        }
                        FN(weights)(t[r], rr[r], scale);
                    }
                    for (int c = 0; c < RMF_NC; c++) {
                        int any = 0;
                        for (int r = 0; r < W_R && !any; r++)
                            for (int64_t j = 0; j < RMF_CH; j++)
                                if (t[r][c * RMF_CH + j] != (W_T)0) {
                                    any = 1;
                                    break;
                                }
                        for (int r = 0; r < W_R; r++) lsub[c][r] = W_TREE64(t[r] + c * RMF_CH);
                        if (!any) { /* every weight +0: the chains give +0 */
                            for (int r = 0; r < W_R; r++)
                                for (int64_t col = 0; col < Dvp; col++) osub[c][r][col] = (W_T)0;
                            continue;
                        }
                        for (int64_t col = 0; col < Dvp; col += W_CW)
                            FN(pv)(t[0] + c * RMF_CH, RMF_BK, vh + (kb0 + c * RMF_CH) * Dvp + col,
                                   Dvp, osub[c][0] + col, Dvp);
                    }
                    for (int64_t r = 0; r < nr; r++) {
                        if (!live[r]) continue;
                        const int64_t i = i0 + r, row = (bb * H + h) * Sq + i;
                        double lb = (double)lsub[0][r];
                        for (int c = 1; c < RMF_NC; c++) lb = lb + (double)lsub[c][r];
                        const W_T *os4[RMF_NC];
                        for (int c = 0; c < RMF_NC; c++) os4[c] = osub[c][r];
                        FN(fold)(mx[r] != mx[r] ? (double)mx[r] : (double)rr[r], lb, os4, Dv,
                                 ref + row, llev + row * W_F, olev + row * W_F * Dv, lgrid, vg);
                    }
                }
            }
        }
    return 0;
}

#undef W_T
#undef W_V
#undef W_VN
#undef W_MASK_T
#undef W_MASKV
#undef W_R
#undef W_NK
#undef W_NV
#undef W_K
#undef W_CW
#undef W_F
#undef W_LD
#undef W_ST
#undef W_SEL
#undef W_SPLAT
#undef W_MAX
#undef W_MADD
#undef W_REF
#undef W_TREE64
#undef W_WIDE
#undef FN
