/* Reproducible mode, float32 inputs (issue 40): the one pass of ringmpi/reproducible_float32.py
 * over one K/V block of whole global key blocks (256 keys each).
 *
 * Loaded by ringmpi/cpu/fused_reproducible_float32.py (compiled per ISA path and cached like
 * the fused tiles). The same numbers as the numpy oracle, bit for bit, on every ISA path:
 *
 *   t      t_j = fma(qs_{D-1}, k_{D-1,j}, ... fma(qs_0, k_0j, 0)): float32 fused multiply-adds
 *          over the head dim in index order (qs: q x scale x log2 e, rounded by the caller);
 *          -inf for an invisible key and the padding past the block's last key;
 *   p      m = the block's max t (NaN wins), r = ceil(m), p_j = rmf_exp2(t_j - r), float32;
 *   sums   per chain of 64 keys: lsub = a fixed tree sum of its p, osub_d = fma chain of
 *          p_j v_jd in key order from 0, float32; lb = ((l0 + l1) + l2) + l3 and ob
 *          likewise in float64;
 *   fold   (lb, ob) x 2^(r - Rw), Rw = 32 ceil(r / 32), split on the window's grids and added
 *          to the row's levels, which move down when a higher window arrives (rmf_fold).
 *
 * Why the ISA cannot change the bits: a fused multiply-add rounds once (IEEE 754 fusedMultiplyAdd)
 * on every path: the AVX-512 and AVX2 paths use the instruction, the scalar path computes the
 * product exactly in float64 and rounds the sum to odd before rounding it to float32 (the same
 * value; the numpy oracle does the same, fma32). Every other operation is a float32 or float64
 * basic operation written in one order; the file is compiled with -ffp-contract=off and
 * without -ffast-math (cpu_reproducible_math.h checks what the preprocessor can see), so the
 * compiler may vectorize across rows, keys and columns but neither fuse nor reassociate.
 */
#include "cpu_reproducible_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

const char *rmf_isa_name(void) { return RMR_ISA; }
int rmf_simd_width_bytes(void) { return RMR_WIDTH; }

#define RMF_BK 256  /* keys per global key block */
#define RMF_CH 64   /* keys per float32 chain of the block sums */
#define RMF_NC (RMF_BK / RMF_CH)
#define RMF_F 3     /* levels (reproducible_float32.FOLDS; rmf_fold writes the 3 out) */
#define RMF_W 32.0  /* the window, in powers of two (reproducible_float32.WINDOW) */

/* float32 vectors of the path's native width (zmm, ymm, or xmm on the scalar path: GCC splits
 * wider generic vectors into scalar code for some operations): lane-wise IEEE operations */
#if defined(__AVX512F__)
#define RMF_VB 64
#elif defined(__AVX2__) && defined(__FMA__)
#define RMF_VB 32
#else
#define RMF_VB 16
#endif
#define RMF_VN (RMF_VB / 4)
/* float64 vectors of the native width, and the float32 vectors they convert from */
typedef double vd __attribute__((vector_size(RMF_VB), aligned(8), may_alias));
typedef float vfh __attribute__((vector_size(RMF_VB / 2), aligned(4), may_alias));
#define RMF_DN (RMF_VB / 8)
typedef float vf __attribute__((vector_size(RMF_VB), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(RMF_VB), aligned(4), may_alias));
static inline vf ldf(const float *p) { return *(const vf *)p; }
static inline void stf(float *p, vf x) { *(vf *)p = x; }
static inline vf self(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
/* x in every lane, bit for bit (-0 stays -0) */
static inline vf splat(float x) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){x, x, x, x};
#endif
}

/* Register blocking (the bits do not depend on it: every score and every sum is its own chain
 * of operations): RMF_R query rows x RMF_NK vectors of keys for the scores, x RMF_NV vectors
 * of columns for P V; R x N accumulators + N loads + 1 broadcast fit the register file (as the
 * default mode's tiles, kernels/cpu_simd.h). A k^T panel holds RMF_K keys. */
#define RMF_R 6
#if defined(__AVX512F__)
#define RMF_NK 4
#define RMF_NV 4
#elif defined(__AVX2__) && defined(__FMA__)
#define RMF_NK 2
#define RMF_NV 2
#else
#define RMF_NK 4
#define RMF_NV 4
#endif
#define RMF_K (RMF_NK * RMF_VN)  /* keys per panel */
#define RMF_CW (RMF_NV * RMF_VN) /* columns per P V tile */

int64_t rmf_tile_keys(void) { return RMF_BK; }
int64_t rmf_panel_keys(void) { return RMF_K; }
int64_t rmf_column_width(void) { return RMF_CW; }
int64_t rmf_levels(void) { return RMF_F; }

/* fma(a, b, c) lane by lane, rounded once per lane (the instruction, or rmr_fmaf's exact emulation) */
static inline vf rmf_fmav(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int l = 0; l < RMF_VN; l++) a[l] = rmr_fmaf(a[l], b[l], c[l]);
    return a;
#endif
}

/* m where it is a number and not x <= m, else m: a running maximum in which a NaN, once in,
 * stays (x NaN: taken; m NaN: kept) */
static inline vf rmf_max(vf m, vf x) { return self((m == m) & ~(x <= m), x, m); }

/* Scores of RMF_R rows x one panel: t[r][j] = fma chain over d (from +0, d in index order);
 * mv (may be NULL): each row's running maximum vector, updated from the registers */
static inline void rmf_scores(const float *const qr[RMF_R], const float *kp, int64_t D,
                              float *t, int64_t ldt, vf *mv) {
    vf a[RMF_R][RMF_NK];
#pragma GCC unroll 8
    for (int r = 0; r < RMF_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RMF_NK; c++) a[r][c] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf k[RMF_NK];
#pragma GCC unroll 4
        for (int c = 0; c < RMF_NK; c++) k[c] = ldf(kp + d * RMF_K + c * RMF_VN);
#pragma GCC unroll 8
        for (int r = 0; r < RMF_R; r++) {
            const vf b = splat(qr[r][d]);
#pragma GCC unroll 4
            for (int c = 0; c < RMF_NK; c++) a[r][c] = rmf_fmav(b, k[c], a[r][c]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RMF_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RMF_NK; c++) stf(t + r * ldt + c * RMF_VN, a[r][c]);
    if (mv)
#pragma GCC unroll 8
        for (int r = 0; r < RMF_R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < RMF_NK; c++) mv[r] = rmf_max(mv[r], a[r][c]);
}

/* One chain's P V for RMF_R rows x RMF_CW columns: o[r][c] = fma chain over its 64 keys in
 * key order, from +0 */
static inline void rmf_pv(const float *p, int64_t ldp, const float *vb, int64_t ldv, float *o,
                          int64_t ldo) {
    vf a[RMF_R][RMF_NV];
#pragma GCC unroll 8
    for (int r = 0; r < RMF_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RMF_NV; c++) a[r][c] = (vf){0};
    for (int64_t j = 0; j < RMF_CH; j++) {
        vf x[RMF_NV];
#pragma GCC unroll 4
        for (int c = 0; c < RMF_NV; c++) x[c] = ldf(vb + j * ldv + c * RMF_VN);
#pragma GCC unroll 8
        for (int r = 0; r < RMF_R; r++) {
            const vf b = splat(p[r * ldp + j]);
#pragma GCC unroll 4
            for (int c = 0; c < RMF_NV; c++) a[r][c] = rmf_fmav(b, x[c], a[r][c]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RMF_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < RMF_NV; c++) stf(o + r * ldo + c * RMF_VN, a[r][c]);
}

/* 2^x lane by lane, x <= 0 or NaN (reproducible_float32.exp2f): n = round(x) by 1.5 * 2^23,
 * f = x - n (exact), the degree-7 Taylor polynomial of e^(f ln 2) by Horner's rule (one
 * fused multiply-add per step), times 2^n from the exponent bits; 0 below -125. */
static const float rmf_c[8] = {
    0x1p+0f, 0x1.62e43p-1f, 0x1.ebfbep-3f, 0x1.c6b08ep-5f,
    0x1.3b2ab6p-7f, 0x1.5d87fep-10f, 0x1.430912p-13f, 0x1.ffcbfcp-17f,
};
static inline vf rmf_exp2(vf x) {
    const vf zero = {0}, lowv = zero - 125.0f;
    const vi low = x < lowv, nan = x != x;
    const vf xc = self(low | nan, zero, x);
    const vf n = (xc + 12582912.0f) - 12582912.0f;
    const vf f = xc - n;
    vf p = rmf_fmav(zero + rmf_c[7], f, zero + rmf_c[6]);
    for (int i = 5; i >= 0; i--) p = rmf_fmav(p, f, zero + rmf_c[i]);
    const vi ni = __builtin_convertvector(n, vi); /* an integer: exact */
    const vf two_n = (vf)((ni + 127) << 23);
    const vf y = p * two_n;
    return self(low, zero, self(nan, x, y));
}

/* reproducible_float32.tree64: a = ((p[0:16] + p[16:32]) + p[32:48]) + p[48:64] lane by lane
 * (RMF_VN lanes at a time), then halves added: 16 -> 8 -> 4 -> 2 -> 1 */
static inline float rmf_tree64(const float *p) {
    float a[16], h8[8], h4[4], h2[2];
    for (int o = 0; o < 16; o += RMF_VN) {
        vf x = (ldf(p + o) + ldf(p + 16 + o)) + ldf(p + 32 + o);
        stf(a + o, x + ldf(p + 48 + o));
    }
    for (int l = 0; l < 8; l++) h8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) h4[l] = h8[l] + h8[l + 4];
    for (int l = 0; l < 2; l++) h2[l] = h4[l] + h4[l + 2];
    return h2[0] + h2[1];
}

static inline double rmf_pow2(int64_t n) { /* 2^n, -1022 <= n <= 1023 */
    const uint64_t b = (uint64_t)(n + 1023) << 52;
    double x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* reproducible_float32.fold_rows for one row: the block partial (lb, ob) x 2^r into the row's
 * window R and levels L[f], O[f * Dv + c] (grids lg[f], vg[f * Dv + c]); ob is made here from
 * the row's four chain sums os4[q][c]: ((o_0 + o_1) + o_2) + o_3 in float64. */
static void rmf_fold(double r, double lb, const float *const os4[RMF_NC], int64_t Dv, double *R,
                     double *L, double *O, const double *lg, const double *vg) {
    if (r != r || *R == INFINITY) {
        *R = INFINITY;
        return;
    }
    const double rw = RMF_W * __builtin_ceil(r / RMF_W);
    if (!(*R >= rw)) { /* a higher window: the levels move down by k */
        int64_t k = *R == -INFINITY ? RMF_F : (int64_t)((rw - *R) / RMF_W);
        if (k > RMF_F) k = RMF_F;
        const double sc = rmf_pow2(-32 * k);
        for (int64_t f = RMF_F - 1; f >= 0; f--) {
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
    if (kk >= RMF_F) return; /* every part lands below the last level */
    const double s = rmf_pow2((int64_t)(r - rw)), down = rmf_pow2(-32 * kk);
    double x = lb * s;
    for (int64_t f = 0; f + kk < RMF_F; f++) {
        const double h = (x + lg[f]) - lg[f];
        L[f + kk] = L[f + kk] + h * down;
        x = x - h;
    }
    /* ob = ((o_0 + o_1) + o_2) + o_3 in float64, times 2^(r - Rw), folded: 8 columns at a time
     * (lane by lane the operations of the scalar tail below) */
    int64_t c = 0;
    if (kk == 0) /* the common case, written out: h x 1 = h and the last y - h unused */
        for (; c + RMF_DN <= Dv; c += RMF_DN) {
            vd y = __builtin_convertvector(*(const vfh *)(os4[0] + c), vd);
            for (int q = 1; q < RMF_NC; q++)
                y = y + __builtin_convertvector(*(const vfh *)(os4[q] + c), vd);
            y = y * s;
            const vd g0 = *(const vd *)(vg + c), g1 = *(const vd *)(vg + Dv + c);
            const vd g2 = *(const vd *)(vg + 2 * Dv + c);
            vd *o0 = (vd *)(O + c), *o1 = (vd *)(O + Dv + c), *o2 = (vd *)(O + 2 * Dv + c);
            const vd h0 = (y + g0) - g0;
            y = y - h0;
            const vd h1 = (y + g1) - g1;
            y = y - h1;
            const vd h2 = (y + g2) - g2;
            *o0 = *o0 + h0;
            *o1 = *o1 + h1;
            *o2 = *o2 + h2;
        }
    for (; c + RMF_DN <= Dv; c += RMF_DN) {
        vd y = __builtin_convertvector(*(const vfh *)(os4[0] + c), vd);
        for (int q = 1; q < RMF_NC; q++) y = y + __builtin_convertvector(*(const vfh *)(os4[q] + c), vd);
        y = y * s;
        for (int64_t f = 0; f + kk < RMF_F; f++) {
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
        for (int64_t f = 0; f + kk < RMF_F; f++) {
            const double g = vg[f * Dv + c];
            const double h = (y + g) - g;
            O[(f + kk) * Dv + c] = O[(f + kk) * Dv + c] + h * down;
            y = y - h;
        }
    }
}

/* One K/V block (whole global key blocks) against the query rows row0 <= i < row1.
 *
 * qs: (B, H, Sq, D) float32, q x C rounded (C = scale x log2 e rounded to float32)
 * kt: (B, Hkv, Skp / RMF_K, D, RMF_K) float32 k^T in panels; v: (B, Hkv, Skp, Dvp) float32
 *     (keys past Sk and columns past Dv zero); Skp a multiple of 256, Dvp of RMF_CW
 * kpos: (Sk,) int64 global positions, kpos[0] a multiple of 256, consecutive
 * lo, hi: (nlay, Sq) int64 visible key ranges (a row sees p when lo[t] <= p <= hi[t], some t)
 * ref: (B, H, Sq) windows; llev: (B, H, Sq, 3); olev: (B, H, Sq, 3, Dv) (a row's levels side
 * by side: far apart, at power-of-two strides, they thrashed the caches); lgrid (3,);
 * vgrid: (B, Hkv, 3, Dv). Returns 0, or -1 for a bad argument. */
int64_t rmf_block(const float *qs, const float *kt, const float *v, const int64_t *kpos,
                  const int64_t *lo, const int64_t *hi, int64_t nlay, int64_t B, int64_t H,
                  int64_t Hkv, int64_t Sq, int64_t Sk, int64_t Skp, int64_t D, int64_t Dvp,
                  int64_t Dv, int64_t row0, int64_t row1, double *ref, double *llev,
                  double *olev, const double *lgrid, const double *vgrid) {
    if (Skp % RMF_BK || Skp < Sk || D < 1 || Dv < 1 || Dvp % RMF_CW || Dvp < Dv || H % Hkv ||
        nlay < 1 || row0 < 0 || row1 > Sq || row0 > row1 || (Sk > 0 && kpos[0] % RMF_BK))
        return -1;
    const int64_t g = H / Hkv;
    float t[RMF_R][RMF_BK], osub[RMF_NC][RMF_R][Dvp];
    float lsub[RMF_NC][RMF_R];
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t kh = h / g;
            const float *kth = kt + (bb * Hkv + kh) * D * Skp;
            const float *vh = v + (bb * Hkv + kh) * Skp * Dvp;
            const double *vg = vgrid + (bb * Hkv + kh) * RMF_F * Dv;
            for (int64_t kb0 = 0; kb0 < Sk; kb0 += RMF_BK) {
                const int64_t nkb = Sk - kb0 < RMF_BK ? Sk - kb0 : RMF_BK;
                const int64_t p0 = kpos[kb0], p1 = kpos[kb0 + nkb - 1];
                for (int64_t i0 = row0; i0 < row1; i0 += RMF_R) {
                    const int64_t nr = row1 - i0 < RMF_R ? row1 - i0 : RMF_R;
                    int64_t rlo = INT64_MAX, rhi = INT64_MIN;
                    for (int64_t tl = 0; tl < nlay; tl++)
                        for (int64_t r = 0; r < nr; r++) {
                            const int64_t a = lo[tl * Sq + i0 + r], b = hi[tl * Sq + i0 + r];
                            if (a > b) continue;
                            rlo = a < rlo ? a : rlo;
                            rhi = b > rhi ? b : rhi;
                        }
                    if (rlo > p1 || rhi < p0) continue; /* no row of the tile sees the block */
                    const float *qr[RMF_R];
                    for (int64_t r = 0; r < RMF_R; r++)
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
                    float mx[RMF_R];
                    if (full) {
                        vf mv[RMF_R];
                        for (int r = 0; r < RMF_R; r++) mv[r] = (vf){0} - INFINITY;
                        for (int64_t c = 0; c < RMF_BK / RMF_K; c++)
                            rmf_scores(qr, kth + (kb0 / RMF_K + c) * RMF_K * D, D, t[0] + c * RMF_K,
                                       RMF_BK, mv);
                        for (int r = 0; r < RMF_R; r++) {
                            float m = mv[r][0];
                            for (int l = 1; l < RMF_VN; l++) m = (m == m && !(mv[r][l] <= m)) ? mv[r][l] : m;
                            mx[r] = m;
                        }
                    } else {
                    for (int64_t c = 0; c < RMF_BK / RMF_K; c++) {
                        const int64_t j0 = c * RMF_K;
                        if (j0 >= nkb || kpos[kb0 + j0] > rhi ||
                            kpos[kb0 + (j0 + RMF_K < nkb ? j0 + RMF_K : nkb) - 1] < rlo) {
                            for (int r = 0; r < RMF_R; r++)
                                for (int j = 0; j < RMF_K; j++) t[r][j0 + j] = -INFINITY;
                            continue;
                        }
                        rmf_scores(qr, kth + (kb0 / RMF_K + c) * RMF_K * D, D, t[0] + j0, RMF_BK,
                                   0);
                    }
                    /* invisible keys (and the padding) -inf; the rows' maxima, NaN winning */
                    const vf minf = (vf){0} - INFINITY;
                    for (int64_t r = 0; r < RMF_R; r++) {
                        const int64_t i = i0 + (r < nr ? r : 0);
                        /* the block's keys are consecutive: layer tl shows j in [a, b] */
                        int32_t keep[RMF_BK] = {0};
                        for (int64_t tl = 0; tl < nlay; tl++) {
                            int64_t a = lo[tl * Sq + i] - p0, b = hi[tl * Sq + i] - p0;
                            a = a < 0 ? 0 : a;
                            b = b > nkb - 1 ? nkb - 1 : b;
                            for (int64_t j = a; j <= b; j++) keep[j] = -1;
                        }
                        for (int64_t j = 0; j < RMF_BK; j += RMF_VN)
                            stf(t[r] + j, self(*(const vi *)(keep + j), ldf(t[r] + j), minf));
                        /* a NaN, once in m, stays: take x where m is a number and not x <= m */
                        vf mv = ldf(t[r]);
                        for (int64_t j = RMF_VN; j < RMF_BK; j += RMF_VN) mv = rmf_max(mv, ldf(t[r] + j));
                        float m = mv[0];
                        for (int l = 1; l < RMF_VN; l++) m = (m == m && !(mv[l] <= m)) ? mv[l] : m;
                        mx[r] = m;
                    }
                    }
                    int live[RMF_R], anylive = 0;
                    float rr[RMF_R];
                    for (int r = 0; r < RMF_R; r++) {
                        live[r] = r < nr && mx[r] != -INFINITY;
                        anylive |= live[r];
                        rr[r] = live[r] ? __builtin_ceilf(mx[r]) + 0.0f : 0.0f; /* -0 -> +0 */
                    }
                    if (!anylive) continue;
                    for (int r = 0; r < RMF_R; r++) {
                        if (!live[r]) {
                            for (int64_t j = 0; j < RMF_BK; j++) t[r][j] = 0.0f;
                            continue;
                        }
                        for (int64_t j = 0; j < RMF_BK; j += RMF_VN)
                            stf(t[r] + j, rmf_exp2(ldf(t[r] + j) - rr[r]));
                    }
                    for (int c = 0; c < RMF_NC; c++) {
                        int any = 0;
                        for (int r = 0; r < RMF_R && !any; r++)
                            for (int64_t j = 0; j < RMF_CH; j++)
                                if (t[r][c * RMF_CH + j] != 0.0f) {
                                    any = 1;
                                    break;
                                }
                        for (int r = 0; r < RMF_R; r++) lsub[c][r] = rmf_tree64(t[r] + c * RMF_CH);
                        if (!any) { /* every weight +0: the chains give +0 */
                            for (int r = 0; r < RMF_R; r++)
                                for (int64_t col = 0; col < Dvp; col++) osub[c][r][col] = 0.0f;
                            continue;
                        }
                        for (int64_t col = 0; col < Dvp; col += RMF_CW)
                            rmf_pv(t[0] + c * RMF_CH, RMF_BK, vh + (kb0 + c * RMF_CH) * Dvp + col,
                                   Dvp, osub[c][0] + col, Dvp);
                    }
                    for (int64_t r = 0; r < nr; r++) {
                        if (!live[r]) continue;
                        const int64_t i = i0 + r, row = (bb * H + h) * Sq + i;
                        double lb = (double)lsub[0][r];
                        for (int c = 1; c < RMF_NC; c++) lb = lb + (double)lsub[c][r];
                        const float *os4[RMF_NC];
                        for (int c = 0; c < RMF_NC; c++) os4[c] = osub[c][r];
                        rmf_fold(mx[r] != mx[r] ? (double)mx[r] : (double)rr[r], lb, os4, Dv,
                                 ref + row, llev + row * RMF_F, olev + row * RMF_F * Dv, lgrid, vg);
                    }
                }
            }
        }
    return 0;
}
