/* Fused CPU attention backward tile: the gradients of one (query block, K/V block) pair.
 *
 * Loaded by ringmpi/cpu/fused_backward.py (compiled on first use, cached on disk). Same
 * semantics as ringmpi.cpu.numpy_tile.backward_tile, the specification. Internal layout, head-major:
 *
 *   q (B, H, Sq, D), dout (B, H, Sq, Dv)   k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv)
 *                             query head h reads K/V head h / (H/Hkv); Dv: the value width,
 *                             which may differ from the key width D
 *   lse, delta (B, H, Sq)     saved log-sum-exp (-inf: row saw no key) and rowsum(dout * out)
 *   qpos (Sq,), kpos (Sk,)    int64 global token positions; causal: key j visible to query i
 *                             iff kpos[j] <= qpos[i]
 *   qlo, qhi (Sq,) or NULL    int64 per-row bounds (windows, packed sequences, cross): key j
 *                             visible to query i iff qlo[i] <= kpos[j] <= qhi[i] (causal is
 *                             then ignored: the bounds include it); qlo > qhi: no visible key
 *   dq (B, H, Sq, D), dk (B, Hkv, Sk, D), dv (B, Hkv, Sk, Dv)   accumulators, in place
 *
 * For one head, with Qs = scale Q:
 *
 *   P  = exp(Qs K^T - lse)        (0 where masked, and on rows with lse = -inf)
 *   dV += P^T dO                  dP = dO V^T        dS = P * (dP - delta)
 *   dQ += scale dS K              dK += dS^T Qs
 *
 * Loop order (FlashAttention-2's backward): for each K/V head and key block of Bk keys, the
 * block's K and V are packed once (K^T and V^T in panels of KW keys, (D, KW) row-major, for
 * the two products that reduce over D; K rows padded to Dp for dS K) and its dK, dV
 * accumulators (Bk x Dp) stay in L2 while the query blocks of all the head's query heads
 * (GQA) stream past. Per query block (Bq rows, Qs and dO packed with rows padded to Dp):
 *   per strip of R rows:
 *     1. S = Qs K^T with an R x KW register tile (broadcast FMAs), P = exp(S - lse) straight
 *        from the registers; masked and padded keys are zeroed afterwards;
 *     2. dP = dO V^T with the same tile, dS = P * (dP - delta) straight from the registers;
 *     3. dQ (R x Dp) = dS K over the block's keys, added to dq (times scale);
 *   then over the whole block (reductions of Bq rows):
 *     4. dV (Bk x Dp) += P^T dO and dK += dS^T Qs with an R-keys x (NV W) register tile,
 *        reduced over the block's rows from zero; every RB_FLUSH query blocks the key
 *        block's sums go into dk, dv (no running total grows with the query count).
 * P and dS of one query block (Bq x Bk) are the only score-sized buffers; no (Sq x Sk) array.
 * Masks: every row sees one range of key positions [lo_i, hi_i] (causal: (-inf, qpos_i]).
 * A (query block, key block) pair is skipped when no row's range meets the key block's
 * [min, max] positions; a pair inside every row's range needs no per-element test. Else
 * each strip counts its rows' visible keys in the block (binary search on the block's
 * sorted positions) and is skipped when there are none; with increasing key positions a
 * row's visible keys are one index range, so only the panels holding them are computed and
 * the rest of the row is zeroed; otherwise every key is tested.
 *
 * exp, tanh and the vector operations are the SIMD layer of the forward tile
 * (kernels/cpu_simd.h, cpu_simd_type.h: the same exp, so P matches the forward's
 * probabilities operation for operation; the score modifiers too); blocks and visibility
 * come from cpu_blocks.h; the products of steps 1-4 are in cpu_backward_strip.h.
 * No -ffast-math: inf and NaN keep their meaning.
 *
 * Same answers on AVX2 and AVX-512: every score and every dP is one FMA chain over
 * d = 0..D-1, every dQ element one FMA chain over a key block's keys in order (then one FMA
 * into dq), every dK, dV element one chain over a query block's rows (then added to the
 * block's accumulator, flushed every RB_FLUSH blocks), exp and tanh are the same IEEE
 * operations on both, and fused_backward.py cuts the same blocks for both (key blocks a
 * multiple of 64 up to D = 512, RB_R = 6 on both): the two paths give bit-identical results.
 * Under a mask a strip computes whole panels from the one holding its first visible key,
 * which differs (KW), but the extra columns are zeroed before they are used. The scalar
 * path (no FMA, libm exp) differs by rounding.
 *
 * The file includes itself twice to instantiate float32 and float64 (RM_BITS 32 / 64 selects
 * the type, through cpu_simd_type.h).
 */
#ifndef RM_BITS
/* ===================================================================== common part ==== */
#include "cpu_simd.h"   /* vector types and operations per ISA, exp, register blocking */
#include "cpu_blocks.h" /* blocks of positions, visibility ranges, work buffers */

/* dK, dV of a key block are sums over every query row of the tile (all query heads of the
 * K/V head). Each query block's part is reduced from zero in registers (rb_outer) and added
 * to the block's accumulators; every RB_FLUSH query blocks these are added to dk, dv and
 * start again from zero. So no running total takes more than RB_FLUSH additions, and dk,
 * dv about Sq / (Bq RB_FLUSH) per call: the error stays that of a blocked dense product
 * instead of growing with the query count. */
#ifndef RB_FLUSH
#define RB_FLUSH 16
#endif

/* register tile (cpu_simd.h): R rows (or keys) x NK vectors (S, dP) / NV vectors (dQ, dK,
 * dV) */
#ifndef RB_R
#define RB_R RM_ISA_R
#endif
#ifndef RB_NK
#define RB_NK RM_ISA_NK
#endif
#ifndef RB_NV
#define RB_NV RM_ISA_NV
#endif

static int rb_cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The ISA path this file was compiled for (the names ringmpi/cpu/isa.py uses). */
const char *rm_backward_isa_name(void) { return rm_isa(); }

int rm_backward_simd_width_bytes(void) { return rm_simd_bytes(); }

/* ----------------------------------------------------------- instantiate both types --- */
#define RM_BITS 32
#include "cpu_backward.c" /* this file again, now with RM_BITS defined */
#undef RM_BITS
#define RM_BITS 64
#include "cpu_backward.c"

/* The score-modifier slots this build implements (a bit per slot, cpu_simd_type.h): it
 * takes (mods, mparam, mpos) as rm_backward_tile's last arguments. */
unsigned rm_backward_mods(void) { return RM_MODS_ALL; }

/* This build takes the value width Dv as rm_backward_tile's last argument. */
int rm_backward_widths(void) { return 1; }

#else
/* ============================================================ type-generic part ==== */
#include "cpu_simd_type.h" /* RM_T, RM_V, V_* and FN of this RM_BITS; rm_tanh, modifiers */
#define R RB_R
#define NK RB_NK
#define NV RB_NV
#define KW (NK * RM_W) /* keys per packed panel */
#define TW (NV * RM_W) /* columns of D per register tile in the dQ, dK, dV products */

/* Pack keys [a, a + nk) of one K/V head: K^T panels kt (np, D, KW) and V^T panels vt
 * (np, Dv, KW), zero past nk; K rows kr (nk, Dp), zero past D. */
static void FN(rb_pack)(const RM_T *restrict k, const RM_T *restrict v, int64_t a, int64_t nk,
                        int64_t D, int64_t Dv, int64_t Dp, RM_T *restrict kt,
                        RM_T *restrict vt, RM_T *restrict kr) {
    FN(rm_pack_panels)(k + a * D, nk, D, KW, kt);
    FN(rm_pack_panels)(v + a * Dv, nk, Dv, KW, vt);
    FN(rm_pack_rows)(k + a * D, nk, D, Dp, kr);
}

/* the block products: S / P / dS of a strip (rb_strip, rb_modify), dQ (rb_dq), dK and dV
 * (rb_outer, rb_flush) */
#include "cpu_backward_strip.h"

/* Public entry point: add the gradients of all (query, key) pairs of the tile, in place.
 * qcuts/kcuts: ascending indices where runs of evenly spaced positions start (may be empty;
 * blocks never straddle them, so block skipping has tight bounds). qlo/qhi: per-row visible
 * key ranges (both NULL: causal or no mask as `causal` says). bq, bk: block sizes (query
 * rows, keys). progress, when given, is called whenever at least `chunk` (query row, key)
 * pairs of single heads have been computed since the last call; a nonzero return aborts
 * (result -2). Score modifiers (ringmpi.scoremods; kernels/cpu_simd_type.h): mods, the bits
 * of the active slots (0: none), mparam (H, RM_NMODS) their parameters per query head (NULL
 * when mods is 0), mpos (Sq,) the rows' positions in key coordinates (NULL unless a
 * position slot is active); dS gains the product of their derivatives d s'/d s. Dv: the
 * width of v, dout and dv (D: that of q, k, dq, dk). Returns the flops of the computed blocks
 * (2 nq nk (3 D + 2 Dv) per block pair with a visible pair and query head: 10 nq nk D for
 * Dv = D), or -1 when out of memory. */
int64_t FN(rm_backward_tile)(const RM_T *q, const RM_T *k, const RM_T *v, const RM_T *dout,
                             const RM_T *lse, const RM_T *delta, const int64_t *qpos,
                             const int64_t *kpos, RM_T *dq, RM_T *dk, RM_T *dv, int64_t B,
                             int64_t H, int64_t Hkv, int64_t Sq, int64_t Sk, int64_t D,
                             const int64_t *qcuts, int64_t nqcuts, const int64_t *kcuts,
                             int64_t nkcuts, const int64_t *qlo, const int64_t *qhi,
                             double scale, int causal, int64_t bq, int64_t bk,
                             int (*progress)(void), int64_t chunk, unsigned mods,
                             const double *mparam, const int64_t *mpos, int64_t Dv) {
    if (Sq <= 0 || Sk <= 0 || B <= 0 || H <= 0) return 0;
    if (!qlo || !qhi) qlo = qhi = NULL; /* bounds come in pairs */
    const rm_vis vis = {qlo, qhi, qpos, qlo ? 0 : causal};
    const int bounded = qlo != NULL;
    const int mask = bounded || causal; /* some pair may be hidden */
    const int64_t G = H / Hkv;
    const int64_t Dp = (D + RM_W - 1) / RM_W * RM_W;
    const int64_t Dvp = (Dv + RM_W - 1) / RM_W * RM_W; /* dO rows, dV accumulators */
    bq = bq < 1 ? R : (bq + R - 1) / R * R;
    bk = bk < 1 ? KW : (bk + KW - 1) / KW * KW;
    /* score buffers: columns for whole panels and for whole R-key tiles of the dK/dV
     * products; the columns past a block's keys are kept zero */
    const int64_t bkr = (bk + R - 1) / R * R;
    const int64_t ld = bk > bkr ? bk : bkr;
    rm_block *qb = malloc(sizeof(rm_block) * (size_t)Sq);
    rm_block *kb = malloc(sizeof(rm_block) * (size_t)Sk);
    rm_range *qr = malloc(sizeof(rm_range) * (size_t)Sq);
    int64_t *ksort = malloc(sizeof(int64_t) * (size_t)Sk);
    RM_T *kt = rm_zalloc(sizeof(RM_T) * (size_t)(bk * D));
    RM_T *vt = rm_zalloc(sizeof(RM_T) * (size_t)(bk * Dv));
    RM_T *kr = rm_zalloc(sizeof(RM_T) * (size_t)(ld * Dp));
    RM_T *dkb = rm_zalloc(sizeof(RM_T) * (size_t)(ld * Dp));
    RM_T *dvb = rm_zalloc(sizeof(RM_T) * (size_t)(ld * Dvp));
    RM_T *qs = rm_zalloc(sizeof(RM_T) * (size_t)(bq * Dp));
    RM_T *dob = rm_zalloc(sizeof(RM_T) * (size_t)(bq * Dvp));
    RM_T *pb = rm_zalloc(sizeof(RM_T) * (size_t)(bq * ld));
    RM_T *dsb = rm_zalloc(sizeof(RM_T) * (size_t)(bq * ld));
    RM_T *lb = rm_zalloc(sizeof(RM_T) * (size_t)bq);
    RM_T *deb = rm_zalloc(sizeof(RM_T) * (size_t)bq);
    /* d s'/d s of the score modifiers (those of RM_MODS_DERIV: the others' is 1) */
    const int deriv = (mods & RM_MODS_DERIV) != 0 && mparam;
    RM_T *dcb = deriv ? rm_zalloc(sizeof(RM_T) * (size_t)(bq * ld)) : NULL;
    int64_t flops = 0;
    if (!qb || !kb || !qr || !ksort || !kt || !vt || !kr || !dkb || !dvb || !qs || !dob || !pb ||
        !dsb || !lb || !deb || (deriv && !dcb)) {
        flops = -1;
        goto done;
    }
    const int64_t nqb = rm_blocks(qpos, 0, Sq, qcuts, nqcuts, bq, qb);
    const int64_t nkb = rm_blocks(kpos, 0, Sk, kcuts, nkcuts, bk, kb);
    /* extremes of the rows' visible ranges per query block */
    for (int64_t iq = 0; iq < nqb; iq++) qr[iq] = rm_rows_range(&vis, qb[iq].a, qb[iq].b);
    /* each key block's positions in ascending order, for counting a row's visible keys */
    memcpy(ksort, kpos, sizeof(int64_t) * (size_t)Sk);
    for (int64_t t = 0; t < nkb && mask; t++)
        if (!kb[t].inc)
            qsort(ksort + kb[t].a, (size_t)(kb[t].b - kb[t].a), sizeof(int64_t), rb_cmp_i64);
    const RM_T sc = (RM_T)scale;
    int64_t work = 0; /* (row, key) pairs since the last progress call */
    for (int64_t b = 0; b < B; b++) {
        for (int64_t hk = 0; hk < Hkv; hk++) {
            const int64_t kvo = (b * Hkv + hk) * Sk * D; /* k, dk; v, dv at vo */
            const int64_t vo = (b * Hkv + hk) * Sk * Dv;
            for (int64_t t = 0; t < nkb; t++) {
                const rm_block K = kb[t];
                const int64_t ka = K.a, nk = K.b - K.a;
                const int64_t nkr = (nk + R - 1) / R * R;
                const int64_t *kp = kpos + ka, *ks = ksort + ka;
                int live = 0;
                for (int64_t iq = 0; iq < nqb && !live; iq++)
                    live = !rm_hidden(&qr[iq], K.lo, K.hi);
                if (!live) continue; /* no row sees any key of the block */
                FN(rb_pack)(k + kvo, v + vo, ka, nk, D, Dv, Dp, kt, vt, kr);
                memset(dkb, 0, sizeof(RM_T) * (size_t)(nkr * Dp));
                memset(dvb, 0, sizeof(RM_T) * (size_t)(nkr * Dvp));
                int held = 0; /* query blocks summed in dkb, dvb since they were last added */
                for (int64_t g = 0; g < G; g++) {
                    const int64_t h = hk * G + g;
                    const RM_T *qh = q + (b * H + h) * Sq * D;
                    const RM_T *doh = dout + (b * H + h) * Sq * Dv;
                    const RM_T *lh = lse + (b * H + h) * Sq;
                    const RM_T *dh = delta + (b * H + h) * Sq;
                    RM_T *dqh = dq + (b * H + h) * Sq * D;
                    /* the head's score modifiers, and whether dS gains their derivative */
                    const FN(rm_mods) hm = FN(rm_mods_load)(mods, mparam, h);
                    const int dch = (hm.bits & RM_MODS_DERIV) != 0;
                    for (int64_t iq = 0; iq < nqb; iq++) {
                        const rm_block Q = qb[iq];
                        const rm_range X = qr[iq];
                        if (rm_hidden(&X, K.lo, K.hi)) continue;
                        /* some pair hidden: per-strip counts and per-element masking */
                        const int masked = mask && !rm_full(&X, K.lo, K.hi);
                        const int64_t qa = Q.a, nq = Q.b - Q.a;
                        const int64_t nqp = (nq + R - 1) / R * R;
                        /* scaled queries, dO, lse (-inf -> +inf: p = 0) and delta; padded
                         * rows are zero with lse +inf, so their P and dS are 0 */
                        for (int64_t i = 0; i < nqp; i++) {
                            RM_T *qrow = qs + i * Dp, *dr = dob + i * Dvp;
                            if (i < nq) {
                                const RM_T *qsrc = qh + (qa + i) * D;
                                for (int64_t d = 0; d < D; d++) qrow[d] = qsrc[d] * sc;
                                memcpy(dr, doh + (qa + i) * Dv, (size_t)Dv * sizeof(RM_T));
                                const RM_T l = lh[qa + i];
                                lb[i] = l == -INFINITY ? INFINITY : l;
                                deb[i] = dh[qa + i];
                            } else {
                                memset(qrow, 0, (size_t)D * sizeof(RM_T));
                                memset(dr, 0, (size_t)Dv * sizeof(RM_T));
                                lb[i] = INFINITY;
                                deb[i] = 0;
                            }
                            for (int64_t d = D; d < Dp; d++) qrow[d] = 0;
                            for (int64_t d = Dv; d < Dvp; d++) dr[d] = 0;
                        }
                        int64_t bmin = nk, bmax = 0; /* keys any strip of the block computed */
                        for (int64_t r0 = 0; r0 < nqp; r0 += R) {
                            RM_T *ps = pb + r0 * ld, *dss = dsb + r0 * ld;
                            /* visible keys of each row: the index range [jb, je) when the
                             * block's positions increase, else all keys with an explicit
                             * per-key test (each < je = nk); s0, s1: their union */
                            int64_t jb[R], je[R], s0 = 0, s1 = nk;
                            int64_t rlo[R], rhi[R];
                            if (masked) {
                                s0 = nk;
                                s1 = 0;
                                for (int r = 0; r < R; r++) {
                                    jb[r] = je[r] = 0;
                                    if (r0 + r >= nq) continue;
                                    const int64_t i = qa + r0 + r;
                                    rm_row(&vis, i, &rlo[r], &rhi[r]);
                                    int64_t a, e;
                                    rm_span(ks, nk, K.contig, rlo[r], rhi[r], &a, &e);
                                    if (e <= a) continue; /* this row sees no key here */
                                    jb[r] = K.inc ? a : 0;
                                    je[r] = K.inc ? e : nk;
                                    s0 = jb[r] < s0 ? jb[r] : s0;
                                    s1 = je[r] > s1 ? je[r] : s1;
                                }
                            } else {
                                for (int r = 0; r < R; r++) jb[r] = 0, je[r] = nk;
                            }
                            if (s1 <= s0) { /* no row of the strip sees a key */
                                memset(ps, 0, sizeof(RM_T) * (size_t)(R * ld));
                                memset(dss, 0, sizeof(RM_T) * (size_t)(R * ld));
                                continue;
                            }
                            bmin = s0 < bmin ? s0 : bmin;
                            bmax = s1 > bmax ? s1 : bmax;
                            const int64_t p0 = s0 / KW, np = (s1 + KW - 1) / KW - p0;
                            const int nrows = nq - r0 < R ? (int)(nq - r0) : R;
                            if (hm.bits) { /* raw scores, the modifiers, P = exp(s - lse) */
                                FN(rb_strip)(qs + r0 * Dp, Dp, kt + p0 * D * KW, np, D, lb + r0,
                                             2, NULL, ps + p0 * KW, ld);
                                FN(rb_modify)(&hm, ps, dch ? dcb + r0 * ld : NULL, ld, p0 * KW,
                                              (p0 + np) * KW, nk, nrows,
                                              mpos ? mpos + qa + r0 : NULL, kp, lb + r0);
                            } else {
                                FN(rb_strip)(qs + r0 * Dp, Dp, kt + p0 * D * KW, np, D, lb + r0,
                                             0, NULL, ps + p0 * KW, ld);
                            }
                            for (int r = 0; r < R; r++) {
                                RM_T *row = ps + r * ld;
                                if (masked && !K.inc && je[r] > jb[r]) {
                                    for (int64_t j = 0; j < nk; j++)
                                        if (kp[j] < rlo[r] || kp[j] > rhi[r]) row[j] = 0;
                                }
                                for (int64_t j = 0; j < jb[r]; j++) row[j] = 0;
                                for (int64_t j = je[r]; j < ld; j++) row[j] = 0;
                            }
                            FN(rb_strip)(dob + r0 * Dvp, Dvp, vt + p0 * Dv * KW, np, Dv, deb + r0,
                                         1, ps + p0 * KW, dss + p0 * KW, ld);
                            if (dch) /* dS through the modifiers: times d s'/d s */
                                for (int r = 0; r < R; r++) {
                                    RM_T *drow = dss + r * ld;
                                    const RM_T *crow = dcb + (r0 + r) * ld;
                                    for (int64_t j = p0 * KW; j < (p0 + np) * KW; j += RM_W)
                                        V_STORE(drow + j,
                                                V_MUL(V_LOAD(drow + j), V_LOAD(crow + j)));
                                }
                            for (int r = 0; r < R; r++) {
                                for (int64_t j = 0; j < jb[r]; j++) dss[r * ld + j] = 0;
                                for (int64_t j = je[r]; j < ld; j++) dss[r * ld + j] = 0;
                            }
                            FN(rb_dq)(dss + s0, ld, kr + s0 * Dp, s1 - s0, Dp, D, sc,
                                      dqh + (qa + r0) * D, nrows);
                        }
                        if (bmax <= bmin) continue; /* no visible pair in the block pair */
                        /* dV, dK over the R-key tiles holding computed keys (the other
                         * columns of P and dS are zero) */
                        const int64_t j0 = bmin / R * R;
                        const int64_t j1 = (bmax + R - 1) / R * R < nkr ? (bmax + R - 1) / R * R
                                                                       : nkr;
                        FN(rb_outer)(pb + j0, ld, dob, Dvp, nq, j1 - j0, Dvp, dvb + j0 * Dvp);
                        FN(rb_outer)(dsb + j0, ld, qs, Dp, nq, j1 - j0, Dp, dkb + j0 * Dp);
                        if (++held == RB_FLUSH) {
                            FN(rb_flush)(dk + kvo + ka * D, dv + vo + ka * Dv, dkb, dvb, nk, nkr,
                                         D, Dp, Dv, Dvp);
                            held = 0;
                        }
                        flops += 2 * nq * nk * (3 * D + 2 * Dv);
                        work += nq * nk;
                        if (progress && chunk > 0 && work >= chunk) {
                            work = 0;
                            if (progress()) {
                                flops = -2;
                                goto done;
                            }
                        }
                    }
                }
                if (held)
                    FN(rb_flush)(dk + kvo + ka * D, dv + vo + ka * Dv, dkb, dvb, nk, nkr, D, Dp,
                                 Dv, Dvp);
            }
        }
    }
done:
    free(qb);
    free(kb);
    free(qr);
    free(ksort);
    free(kt);
    free(vt);
    free(kr);
    free(dkb);
    free(dvb);
    free(qs);
    free(dob);
    free(pb);
    free(dsb);
    free(lb);
    free(deb);
    free(dcb);
    return flops;
}

#undef R
#undef NK
#undef NV
#undef KW
#undef TW
#endif
