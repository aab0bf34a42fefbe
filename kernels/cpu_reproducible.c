/* Reproducible mode (issue 40): the two passes of ringmpi/reproducible.py over one K/V block.
 *
 * Loaded by ringmpi/cpu/fused_reproducible.py (compiled on first use per ISA path and cached
 * like the fused tiles, ringmpi/cpu/build.py). The same numbers as the numpy oracle of
 * ringmpi/reproducible.py, bit for bit, on every ISA path:
 *
 *   score   s = scale * (((q_0 k_0 + q_1 k_1) + q_2 k_2) + ... + q_{D-1} k_{D-1}) in float64,
 *           summed over the head dim in index order (one product, then one addition per d),
 *           then the score modifiers (rmr_modify: softcap by rmr_tanh8, ALiBi);
 *   pass 0  m_i = max over visible keys of s_ij (a maximum: exact; NaN propagates);
 *   pass 1  p_ij = rmr_exp8(s_ij - m_i) and p_ij v_j, each split on the fixed grids of the
 *           caller (constants c_f): hi = (x + c_f) - c_f, added to fold f's row sum, and
 *           x = x - hi goes on to fold f + 1 (the last fold's remainder is dropped).
 *
 * Why the ISA cannot change the bits: every line below is a sequence of IEEE 754 basic
 * operations (+, -, *, comparisons, exact conversions and power-of-two scalings) on float64,
 * written in one order. The file is compiled with -ffp-contract=off and without -ffast-math
 * (ringmpi/cpu/fused_reproducible.py adds the flags after $RINGMPI_CFLAGS; the #errors of
 * cpu_reproducible_math.h check what the preprocessor can see), so the compiler may vectorize
 * the loops (each lane does the same operations as the scalar code) but may neither
 * reassociate a sum nor fuse a multiply and an add. The fold sums are exact (their grids), so
 * the order in which keys reach a row sum (the vector lanes, the chunks, the ring steps) does
 * not change them either.
 *
 * p = rmr_exp8 (det_exp), the vector types, the fold (rmr_fold8, RMR_FOLD) and the compiler
 * checks are in cpu_reproducible_math.h, shared with the backward's kernel
 * (cpu_reproducible_backward.c).
 */
#include "cpu_reproducible_math.h"

const char *rmr_isa_name(void) { return RMR_ISA; }
int rmr_simd_width_bytes(void) { return RMR_WIDTH; }

/* Register tile of the scores: RMR_R query rows x RMR_K keys (the keys of k^T are padded by
 * the caller to a multiple of RMR_K). The blocking changes no bit: every score is its own
 * chain of operations over d. */
#define RMR_R 4  /* the score tile below is written out for 4 x 16 */
#define RMR_K 16
#define RMR_BK 64 /* keys per global key block: the unit of the block partial sums */
#define RMR_MAXF 4

int64_t rmr_tile_keys(void) { return RMR_BK; }
int64_t rmr_panel_keys(void) { return RMR_K; }

/* The scaled, modified scores of a 4 x 16 tile (reproducible.modify, the same operations;
 * rmr_mod8 of cpu_reproducible_math.h, shared with the backward's kernel):
 * x = s * scale; softcap (mods bit 0): x = cap * tanh(x * icap), icap = 1 / cap rounded once
 * (as the default mode's tiles: no division per score); ALiBi (bit 1):
 * x = x - slope * |qa_r - kp_j|, the distance exactly in float64 (positions below 2^53 are
 * exact doubles, so is their difference: the value of numpy's integer distance converted),
 * the product rounded once. kp: the keys' positions, INT64_MIN past the real keys (never
 * visible: their lanes get some finite score that no maximum or weight uses). */
static inline void rmr_modify(const double s[RMR_R][RMR_K], double scale, int64_t mods,
                              double cap, double icap, double slope, const int64_t qa[RMR_R],
                              const int64_t kp[RMR_K], double out[RMR_R][RMR_K]) {
    double kd[RMR_K], qd[RMR_R];
    if (mods & 2) {
        for (int r = 0; r < RMR_R; r++) qd[r] = (double)qa[r];
        for (int j = 0; j < RMR_K; j++) kd[j] = kp[j] == INT64_MIN ? 0.0 : (double)kp[j];
    }
    for (int r = 0; r < RMR_R; r++)
        for (int h8 = 0; h8 < RMR_K; h8 += 8) {
            const v8 x = ld8(s[r] + h8) * scale;
            const v8 k8 = (mods & 2) ? ld8(kd + h8) : (v8){0};
            st8(out[r] + h8, rmr_mod8(x, mods, cap, icap, slope, (mods & 2) ? qd[r] : 0.0, k8, 0));
        }
}

/* Scores of a 4 x 16 tile: s[r][j] = ((q_r0 k_0j + q_r1 k_1j) + ...) (before the scale).
 * kc: the panel (D, RMR_K). fused (only where every q and k is a float32 value): the vector
 * paths add each product by one fused multiply-add. A product of two float32 values is exact
 * in float64 (24 + 24 significant bits, exponents far inside the range), so fma(q, k, a) =
 * round(a + q k) = a + round(q k): the same bits as the multiply and the add of the other
 * paths and of the numpy code. Each path keeps a register tile that fits its registers. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define RMR_MADD(a, b, x) (fused ? _mm512_fmadd_pd(b, x, a) : _mm512_add_pd(a, _mm512_mul_pd(b, x)))
static inline void rmr_scores(const double *const qr[RMR_R], const double *kc, int64_t D,
                              int fused, double s[RMR_R][RMR_K]) {
    const __m512d k0 = _mm512_loadu_pd(kc), k1 = _mm512_loadu_pd(kc + 8);
    __m512d a[RMR_R][2];
    for (int r = 0; r < RMR_R; r++) {
        const __m512d b = _mm512_set1_pd(qr[r][0]);
        a[r][0] = _mm512_mul_pd(b, k0);
        a[r][1] = _mm512_mul_pd(b, k1);
    }
    for (int64_t d = 1; d < D; d++) {
        const __m512d x0 = _mm512_loadu_pd(kc + d * RMR_K), x1 = _mm512_loadu_pd(kc + d * RMR_K + 8);
        for (int r = 0; r < RMR_R; r++) {
            const __m512d b = _mm512_set1_pd(qr[r][d]);
            a[r][0] = RMR_MADD(a[r][0], b, x0);
            a[r][1] = RMR_MADD(a[r][1], b, x1);
        }
    }
    for (int r = 0; r < RMR_R; r++) {
        _mm512_storeu_pd(s[r], a[r][0]);
        _mm512_storeu_pd(s[r] + 8, a[r][1]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RMR_MADD(a, b, x) (fused ? _mm256_fmadd_pd(b, x, a) : _mm256_add_pd(a, _mm256_mul_pd(b, x)))
static inline void rmr_scores(const double *const qr[RMR_R], const double *kc, int64_t D,
                              int fused, double s[RMR_R][RMR_K]) {
    for (int half = 0; half < RMR_K; half += 8) { /* 4 rows x 8 keys: 8 ymm accumulators */
        const double *kh = kc + half;
        const __m256d k0 = _mm256_loadu_pd(kh), k1 = _mm256_loadu_pd(kh + 4);
        __m256d a[RMR_R][2];
        for (int r = 0; r < RMR_R; r++) {
            const __m256d b = _mm256_set1_pd(qr[r][0]);
            a[r][0] = _mm256_mul_pd(b, k0);
            a[r][1] = _mm256_mul_pd(b, k1);
        }
        for (int64_t d = 1; d < D; d++) {
            const __m256d x0 = _mm256_loadu_pd(kh + d * RMR_K);
            const __m256d x1 = _mm256_loadu_pd(kh + d * RMR_K + 4);
            for (int r = 0; r < RMR_R; r++) {
                const __m256d b = _mm256_set1_pd(qr[r][d]);
                a[r][0] = RMR_MADD(a[r][0], b, x0);
                a[r][1] = RMR_MADD(a[r][1], b, x1);
            }
        }
        for (int r = 0; r < RMR_R; r++) {
            _mm256_storeu_pd(s[r] + half, a[r][0]);
            _mm256_storeu_pd(s[r] + half + 4, a[r][1]);
        }
    }
}
#else
static inline void rmr_scores(const double *const qr[RMR_R], const double *kc, int64_t D,
                              int fused, double s[RMR_R][RMR_K]) {
    (void)fused; /* no fused multiply-add here: the multiply and the add (the same bits) */
    for (int r = 0; r < RMR_R; r++)
        for (int j = 0; j < RMR_K; j++) s[r][j] = qr[r][0] * kc[j];
    for (int64_t d = 1; d < D; d++)
        for (int r = 0; r < RMR_R; r++) {
            const double b = qr[r][d];
            for (int j = 0; j < RMR_K; j++) s[r][j] = s[r][j] + b * kc[d * RMR_K + j];
        }
}
#endif

/* A 4 rows x 16 columns tile of a block's p v: o[r] = p_r0 v_0 + p_r1 v_1 + ... in key order.
 * vb: the block's v from its column; its rows are Dv apart. */
#if defined(__AVX2__) && !defined(__AVX512F__)
/* AVX2: the same chains, 8 columns at a time (4 rows x 2 ymm: no spills of 16 ymm) */
typedef double v4 __attribute__((vector_size(32), aligned(8), may_alias));
static inline void rmr_pv(const double pw[RMR_R][RMR_BK], const double *vb, int64_t Dv,
                          int64_t nkb, v8 o[RMR_R][2]) {
    double out[RMR_R][16];
    for (int half = 0; half < 16; half += 8) {
        const double *vh = vb + half;
        const v4 v0 = *(const v4 *)vh, v1 = *(const v4 *)(vh + 4);
        v4 a00 = pw[0][0] * v0, a01 = pw[0][0] * v1, a10 = pw[1][0] * v0, a11 = pw[1][0] * v1;
        v4 a20 = pw[2][0] * v0, a21 = pw[2][0] * v1, a30 = pw[3][0] * v0, a31 = pw[3][0] * v1;
        for (int64_t j = 1; j < nkb; j++) {
            const v4 x0 = *(const v4 *)(vh + j * Dv), x1 = *(const v4 *)(vh + j * Dv + 4);
            const double p0 = pw[0][j], p1 = pw[1][j], p2 = pw[2][j], p3 = pw[3][j];
            a00 = a00 + p0 * x0;
            a01 = a01 + p0 * x1;
            a10 = a10 + p1 * x0;
            a11 = a11 + p1 * x1;
            a20 = a20 + p2 * x0;
            a21 = a21 + p2 * x1;
            a30 = a30 + p3 * x0;
            a31 = a31 + p3 * x1;
        }
        *(v4 *)(out[0] + half) = a00, *(v4 *)(out[0] + half + 4) = a01;
        *(v4 *)(out[1] + half) = a10, *(v4 *)(out[1] + half + 4) = a11;
        *(v4 *)(out[2] + half) = a20, *(v4 *)(out[2] + half + 4) = a21;
        *(v4 *)(out[3] + half) = a30, *(v4 *)(out[3] + half + 4) = a31;
    }
    for (int r = 0; r < RMR_R; r++) {
        o[r][0] = ld8(out[r]);
        o[r][1] = ld8(out[r] + 8);
    }
}
#else
static inline void rmr_pv(const double pw[RMR_R][RMR_BK], const double *vb, int64_t Dv,
                          int64_t nkb, v8 o[RMR_R][2]) {
    const v8 v0 = ld8(vb), v1 = ld8(vb + 8);
    v8 a00 = pw[0][0] * v0, a01 = pw[0][0] * v1, a10 = pw[1][0] * v0, a11 = pw[1][0] * v1;
    v8 a20 = pw[2][0] * v0, a21 = pw[2][0] * v1, a30 = pw[3][0] * v0, a31 = pw[3][0] * v1;
    for (int64_t j = 1; j < nkb; j++) {
        const v8 x0 = ld8(vb + j * Dv), x1 = ld8(vb + j * Dv + 8);
        const double p0 = pw[0][j], p1 = pw[1][j], p2 = pw[2][j], p3 = pw[3][j];
        a00 = a00 + p0 * x0;
        a01 = a01 + p0 * x1;
        a10 = a10 + p1 * x0;
        a11 = a11 + p1 * x1;
        a20 = a20 + p2 * x0;
        a21 = a21 + p2 * x1;
        a30 = a30 + p3 * x0;
        a31 = a31 + p3 * x1;
    }
    o[0][0] = a00, o[0][1] = a01, o[1][0] = a10, o[1][1] = a11;
    o[2][0] = a20, o[2][1] = a21, o[3][0] = a30, o[3][1] = a31;
}
#endif

/* Whether row i sees key position p in a layer t >= 1 (layer 0 is tested by the caller). */
static inline int rmr_seen(const int64_t *lo, const int64_t *hi, int64_t nlay, int64_t Sq,
                           int64_t i, int64_t p) {
    for (int64_t t = 1; t < nlay; t++)
        if (p >= lo[t * Sq + i] && p <= hi[t * Sq + i]) return 1;
    return 0;
}

/* One K/V block against the query rows row0 <= i < row1, every (batch, head).
 *
 * q: (B, H, Sq, D) float64
 * kt: (B, Hkv, Skp / RMR_K, D, RMR_K) float64: k^T in panels of RMR_K keys, Skp a multiple of
 *     RMR_BK (the padding keys are never visible);  v: (B, Hkv, Sk, Dv) float64
 * kpos: (Sk,) int64 global positions, kpos[0] a multiple of RMR_BK: key j belongs to the global
 *       key block j / RMR_BK (ringmpi/reproducible.py deals the keys out in whole blocks)
 * lo, hi: (nlay, Sq) int64: row i sees key position p when lo[t, i] <= p <= hi[t, i] for some
 *         layer t (one layer for the single-range masks; a mask of slices gives each row its
 *         sorted disjoint intervals, lo > hi for a layer a row lacks)
 * m: (B, H, Sq) float64 row maxima: pass 0 updates them, pass 1 reads them
 * lconst: (folds,) grids of the block sums of p;  vconst: (folds, B, Hkv, Dv) grids of p v's
 * lsum: (folds, B, H, Sq);  osum: (folds, B, H, Sq, Dv): fold sums, added to
 *
 * Pass 1: for each row and global key block, lb = p_0 + p_1 + ... and ob = p_0 v_0 + p_1 v_1
 * + ..., in key order (invisible keys with p = 0), then folded: one block partial per
 * (row, block), the same numbers whichever rank holds the block.
 * fused: 1 when every q and k is a float32 value (rmr_scores may fuse; the same bits).
 * mods: the score modifiers (bit 0 softcap cap, bit 1 ALiBi slopes (H,) with the rows' ALiBi
 * positions qa (Sq,)), applied to every score by rmr_modify in both passes.
 * Returns 0, or -1 for a bad argument. */
int64_t rmr_block(const double *q, const double *kt, const double *v, const int64_t *kpos,
                  const int64_t *lo, const int64_t *hi, int64_t B, int64_t H, int64_t Hkv,
                  int64_t Sq, int64_t Sk, int64_t Skp, int64_t D, int64_t Dv, double scale,
                  int64_t pass, int64_t folds, int64_t row0, int64_t row1, int64_t fused,
                  double *m,
                  const double *lconst, const double *vconst, double *lsum, double *osum,
                  int64_t mods, double cap, const double *slopes, const int64_t *qa,
                  int64_t nlay) {
    if ((mods & ~INT64_C(3)) || ((mods & 1) && !(cap > 0)) || ((mods & 2) && (!slopes || !qa)))
        return -1;
    if (Skp % RMR_BK || Skp < Sk || D < 1 || H % Hkv || folds < 1 || folds > RMR_MAXF || nlay < 1 ||
        row0 < 0 || row1 > Sq || row0 > row1 || (Sk > 0 && kpos[0] % RMR_BK))
        return -1;
    const int64_t g = H / Hkv, nchunk = Skp / RMR_K;
    const double icap = (mods & 1) ? 1.0 / cap : 0.0;
    /* per key chunk: the range of its real keys' positions (empty chunk: min > max) */
    int64_t cmin[nchunk > 0 ? nchunk : 1], cmax[nchunk > 0 ? nchunk : 1];
    for (int64_t c = 0; c < nchunk; c++) {
        int64_t a = INT64_MAX, b = INT64_MIN;
        for (int64_t j = c * RMR_K; j < (c + 1) * RMR_K && j < Sk; j++) {
            a = kpos[j] < a ? kpos[j] : a;
            b = kpos[j] > b ? kpos[j] : b;
        }
        cmin[c] = a;
        cmax[c] = b;
    }
    double lc[RMR_MAXF] = {0};
    for (int64_t f = 0; pass && f < folds; f++) lc[f] = lconst[f];
    const int64_t lstride = B * H * Sq, ostride = B * H * Sq * Dv, vcs = B * Hkv * Dv;
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t kh = h / g;
            const double *kth = kt + (bb * Hkv + kh) * D * Skp;
            const double *vh = v ? v + (bb * Hkv + kh) * Sk * Dv : 0;
            const double *vc = pass ? vconst + (bb * Hkv + kh) * Dv : 0;
            double *mh = m + (bb * H + h) * Sq;
            const double slope = (mods & 2) ? slopes[h] : 0.0;
            /* key blocks outside, row tiles inside: a block's k panels and v rows (2 x 32 KiB
             * at D = 64) stay in cache while every row tile of the call uses them */
            for (int64_t kb0 = 0; kb0 < Sk; kb0 += RMR_BK)
            for (int64_t i0 = row0; i0 < row1; i0 += RMR_R) {
                const int64_t nr = row1 - i0 < RMR_R ? row1 - i0 : RMR_R;
                int64_t rlo = INT64_MAX, rhi = INT64_MIN; /* the rows' visible keys lie inside */
                for (int64_t t = 0; t < nlay; t++)
                    for (int64_t r = 0; r < nr; r++) {
                        const int64_t a = lo[t * Sq + i0 + r], b = hi[t * Sq + i0 + r];
                        if (a > b) continue;
                        rlo = a < rlo ? a : rlo;
                        rhi = b > rhi ? b : rhi;
                    }
                const double *qr[RMR_R];
                int64_t qar[RMR_R] = {0};
                for (int64_t r = 0; r < RMR_R; r++) {
                    qr[r] = q + ((bb * H + h) * Sq + i0 + (r < nr ? r : 0)) * D;
                    if (mods & 2) qar[r] = qa[i0 + (r < nr ? r : 0)];
                }
                double s[RMR_R][RMR_K], sm[RMR_R][RMR_K];
                if (pass == 0) {
                    for (int64_t c = kb0 / RMR_K; c < (kb0 + RMR_BK) / RMR_K; c++) {
                        if (cmin[c] > rhi || cmax[c] < rlo) continue; /* no row sees a key */
                        rmr_scores(qr, kth + c * RMR_K * D, D, (int)fused, s);
                        const int64_t j0 = c * RMR_K;
                        const int64_t nk = Sk - j0 < RMR_K ? Sk - j0 : RMR_K;
                        int64_t kp[RMR_K];
                        for (int j = 0; j < RMR_K; j++) kp[j] = j < nk ? kpos[j0 + j] : INT64_MIN;
                        rmr_modify((const double(*)[RMR_K])s, scale, mods, cap, icap, slope, qar,
                                   kp, sm);
                        for (int64_t r = 0; r < nr; r++) {
                            const int64_t i = i0 + r, a = lo[i], b = hi[i];
                            double mx = mh[i];
                            for (int64_t j = 0; j < nk; j++) {
                                const int64_t p = kpos[j0 + j];
                                if ((p < a || p > b) && !rmr_seen(lo, hi, nlay, Sq, i, p)) continue;
                                const double x = sm[r][j];
                                if (x != x || mx != mx)
                                    mx = x != x ? x : mx;
                                else if (x > mx)
                                    mx = x;
                            }
                            mh[i] = mx;
                        }
                    }
                    continue;
                }
                double mi[RMR_R];
                for (int64_t r = 0; r < RMR_R; r++) mi[r] = mh[i0 + (r < nr ? r : 0)];
                for (int64_t j0 = kb0; j0 == kb0; j0++) { /* this key block */
                    const int64_t nkb = Sk - j0 < RMR_BK ? Sk - j0 : RMR_BK;
                    double pw[RMR_R][RMR_BK];
                    int any = 0;
                    for (int64_t cc = 0; cc < RMR_BK / RMR_K; cc++) {
                        const int64_t c = j0 / RMR_K + cc, jc = cc * RMR_K;
                        if (jc >= nkb || cmin[c] > rhi || cmax[c] < rlo) {
                            for (int r = 0; r < RMR_R; r++)
                                for (int j = 0; j < RMR_K; j++) pw[r][jc + j] = 0.0;
                            continue;
                        }
                        any = 1;
                        rmr_scores(qr, kth + c * RMR_K * D, D, (int)fused, s);
                        /* positions of the chunk's keys, past the real keys: never visible */
                        int64_t kp[RMR_K];
                        for (int j = 0; j < RMR_K; j++)
                            kp[j] = jc + j < nkb ? kpos[j0 + jc + j] : INT64_MIN;
                        rmr_modify((const double(*)[RMR_K])s, scale, mods, cap, icap, slope, qar,
                                   kp, sm);
                        for (int r = 0; r < RMR_R; r++) {
                            const int64_t i = i0 + (r < nr ? r : 0), a = lo[i], b = hi[i];
                            for (int h8 = 0; h8 < RMR_K; h8 += 8) {
                                const v8 e = rmr_exp8(ld8(sm[r] + h8) - mi[r]);
                                v8i p8;
                                memcpy(&p8, kp + h8, sizeof p8);
                                const v8i av = {a, a, a, a, a, a, a, a}, bv = {b, b, b, b, b, b, b, b};
                                v8i vis = ige8(p8, av) & ile8(p8, bv);
                                for (int64_t t = 1; t < nlay; t++) {
                                    const int64_t l0 = lo[t * Sq + i], h0 = hi[t * Sq + i];
                                    const v8i lv = {l0, l0, l0, l0, l0, l0, l0, l0};
                                    const v8i hv = {h0, h0, h0, h0, h0, h0, h0, h0};
                                    vis |= ige8(p8, lv) & ile8(p8, hv);
                                }
                                st8(pw[r] + jc + h8, sel8(vis, e, (v8){0}));
                            }
                        }
                    }
                    if (!any) continue; /* every weight 0: the block adds exact zeros */
                    { /* lb: each row's p of the block summed in key order (4 chains at once) */
                        double x[RMR_R];
                        for (int r = 0; r < RMR_R; r++) x[r] = pw[r][0];
                        for (int64_t j = 1; j < nkb; j++)
                            for (int r = 0; r < RMR_R; r++) x[r] = x[r] + pw[r][j];
                        for (int64_t r = 0; r < nr; r++) {
                            double *lrow = lsum + (bb * H + h) * Sq + i0 + r;
                            for (int64_t f = 0; f < folds; f++)
                                RMR_FOLD(x[r], lc[f], lrow[f * lstride]);
                        }
                    }
                    /* ob: the block's p v summed in key order, 4 rows x 16 columns at a time */
                    const double *vb = vh + j0 * Dv;
                    double *orow = osum + ((bb * H + h) * Sq + i0) * Dv;
                    int64_t col = 0;
                    for (; col + 16 <= Dv; col += 16) {
                        v8 o[RMR_R][2];
                        rmr_pv(pw, vb + col, Dv, nkb, o);
                        for (int64_t r = 0; r < nr; r++) {
                            rmr_fold8(o[r][0], folds, orow + r * Dv + col, ostride, vc + col, vcs);
                            rmr_fold8(o[r][1], folds, orow + r * Dv + col + 8, ostride,
                                      vc + col + 8, vcs);
                        }
                    }
                    for (; col < Dv; col++) /* the columns past the last 16 */
                        for (int64_t r = 0; r < nr; r++) {
                            double x = pw[r][0] * vb[col];
                            for (int64_t j = 1; j < nkb; j++) x = x + pw[r][j] * vb[j * Dv + col];
                            double *o = orow + r * Dv + col;
                            for (int64_t f = 0; f < folds; f++)
                                RMR_FOLD(x, vc[f * vcs + col], o[f * ostride]);
                        }
                }
            }
        }
    return 0;
}
