/* Reproducible backward (issue 40): one (query block, key block) tile of
 * ringmpi/reproducible_backward.py, every batch and head, bit for bit the numpy code's.
 *
 * Loaded by ringmpi/cpu/fused_reproducible_backward.py (compiled per ISA path and cached like
 * the other kernels, ringmpi/cpu/build.py, with -ffp-contract=off -fno-fast-math after
 * $RINGMPI_CFLAGS). Its oracle is ``_tile`` of ringmpi/reproducible_backward.py, which stays
 * the fallback (RINGMPI_CPU_KERNEL=numpy, or no compiler). Per (batch b, head h), with r <= 64
 * query rows i and c <= 64 keys j, everything in float64:
 *
 *   s_ij   = (((q_i0 k_j0 + q_i1 k_j1) + q_i2 k_j2) + ...) * scale   (index order over Dk)
 *   softcap: t_ij = det_tanh(s_ij * (1 / cap)), s_ij = cap * t_ij      (rmr_tanh8)
 *   ALiBi:   s_ij = s_ij - slope_h * |qa_i - kp_j|                     (rmr_mod8, both)
 *   p_ij   = det_exp(s_ij - lse_i) for a visible pair, else 0       (rmr_exp8)
 *   dp_ij  = ((do_i0 v_j0 + do_i1 v_j1) + ...)                        (index order over Dv)
 *   ds_ij  = p_ij * (dp_ij - delta_i), then times (1 - t_ij * t_ij) with softcap
 *   dqb_i  = ((ds_i0 k_0 + ds_i1 k_1) + ...)   over the keys in key order, per column
 *   dkb_j  = ((ds_0j q_0 + ds_1j q_1) + ...)   over the rows in row order, per column
 *   dvb_j  = ((p_0j do_0 + p_1j do_1) + ...)   over the rows in row order, per column
 *
 * and each block partial folded into its sums on the caller's grids (fold_into of
 * ringmpi/reproducible.py): for f = 0..F-1, hi = (x + c_f) - c_f, sum_f += hi, x = x - hi.
 * dqb goes to (b, h, i), dkb and dvb to (b, h / G, j): the G heads of a GQA group add their
 * fold parts to the same sums, exactly (the grids make every such sum exact in float64), so
 * the order of the heads and of the calls changes no bit.
 *
 * All five chains are one pattern, out[o][col] = ((a[o][0] x[0][col] + a[o][1] x[1][col]) +
 * ...) (rmb_chain): one rounded product and one rounded addition per term, in term order,
 * vectorized over the columns (keys for s and dp, through k^T and v^T; the head dims for the
 * partials). A lane does the scalar code's operations on its own column, so the vector width
 * (8 lanes on AVX-512, 4 on AVX2, 2 on the SSE2 "scalar" path) and the register tiling change
 * no bit; no multiply-add is fused (the flags; cpu_reproducible_math.h checks what the
 * preprocessor can see).
 *
 * The largest p of the tile comes back (the caller checks the bound the grids assume): NaN if
 * some p is NaN (numpy's max), +inf if a visible s - lse exceeds 709 (det_exp's 2^n is exact
 * up to there in both codes; beyond, numpy's p is >= 8e307 or inf, either way far above the
 * bound, and the call is refused whatever the gradients are).
 */
#include <stdlib.h>

#include "cpu_reproducible_math.h"

const char *rmb_isa_name(void) { return RMR_ISA; }
int rmb_simd_width_bytes(void) { return RMR_WIDTH; }

#define RMB_BK 64  /* rows and keys per tile at most: the global block of the partial sums */
#define RMB_MAXF 4 /* folds at most (ringmpi.reproducible.folds) */
#define RMB_TBIG 709.0 /* s - lse above this: p is reported as +inf (see the header) */

int64_t rmb_tile_keys(void) { return RMB_BK; }

/* The chains' vectors: one register of the path (AVX-512 zmm, AVX2 ymm, SSE2 xmm). */
#if defined(__AVX512F__)
#define RMB_VW 8
#elif defined(__AVX2__)
#define RMB_VW 4
#else
#define RMB_VW 2
#endif
typedef double vw __attribute__((vector_size(RMB_VW * 8), aligned(8), may_alias));
static inline vw ldw(const double *p) { return *(const vw *)p; }
static inline void stw(double *p, vw x) { *(vw *)p = x; }

/* out[o][col] = ((a[o][0] x[0][col] + a[o][1] x[1][col]) + ...) over t < n (n >= 1), for
 * o < no and col < nc. a[o][t] at a + o * ao + t * at (a weight is broadcast: any layout,
 * so ds serves both as (rows, keys) and as (keys, rows) without a transpose); x: rows ldx
 * apart (columns contiguous); out: rows ldo apart. 4 outputs x 2 vectors of columns at a
 * time (8 vector accumulators: no spills on any path), then the remaining columns one at a
 * time; every element gets the same sequence of operations whichever branch computes it. */
static void rmb_chain(const double *a, int64_t ao, int64_t at, const double *x, int64_t ldx,
                      int64_t no, int64_t n, int64_t nc, double *out, int64_t ldo) {
    int64_t o = 0;
    for (; o + 4 <= no; o += 4) {
        const double *a0 = a + o * ao, *a1 = a0 + ao, *a2 = a1 + ao, *a3 = a2 + ao;
        double *o0 = out + o * ldo, *o1 = o0 + ldo, *o2 = o1 + ldo, *o3 = o2 + ldo;
        int64_t col = 0;
        for (; col + 2 * RMB_VW <= nc; col += 2 * RMB_VW) {
            const double *xc = x + col;
            vw x0 = ldw(xc), x1 = ldw(xc + RMB_VW);
            vw s00 = a0[0] * x0, s01 = a0[0] * x1, s10 = a1[0] * x0, s11 = a1[0] * x1;
            vw s20 = a2[0] * x0, s21 = a2[0] * x1, s30 = a3[0] * x0, s31 = a3[0] * x1;
            for (int64_t t = 1; t < n; t++) {
                x0 = ldw(xc + t * ldx);
                x1 = ldw(xc + t * ldx + RMB_VW);
                const int64_t ta = t * at;
                const double b0 = a0[ta], b1 = a1[ta], b2 = a2[ta], b3 = a3[ta];
                s00 = s00 + b0 * x0;
                s01 = s01 + b0 * x1;
                s10 = s10 + b1 * x0;
                s11 = s11 + b1 * x1;
                s20 = s20 + b2 * x0;
                s21 = s21 + b2 * x1;
                s30 = s30 + b3 * x0;
                s31 = s31 + b3 * x1;
            }
            stw(o0 + col, s00), stw(o0 + col + RMB_VW, s01);
            stw(o1 + col, s10), stw(o1 + col + RMB_VW, s11);
            stw(o2 + col, s20), stw(o2 + col + RMB_VW, s21);
            stw(o3 + col, s30), stw(o3 + col + RMB_VW, s31);
        }
        for (; col < nc; col++) {
            double s0 = a0[0] * x[col], s1 = a1[0] * x[col], s2 = a2[0] * x[col],
                   s3 = a3[0] * x[col];
            for (int64_t t = 1; t < n; t++) {
                const double xt = x[t * ldx + col];
                const int64_t ta = t * at;
                s0 = s0 + a0[ta] * xt;
                s1 = s1 + a1[ta] * xt;
                s2 = s2 + a2[ta] * xt;
                s3 = s3 + a3[ta] * xt;
            }
            o0[col] = s0, o1[col] = s1, o2[col] = s2, o3[col] = s3;
        }
    }
    for (; o < no; o++) { /* the last outputs, one at a time */
        const double *a0 = a + o * ao;
        double *oo = out + o * ldo;
        int64_t col = 0;
        for (; col + RMB_VW <= nc; col += RMB_VW) {
            vw s = a0[0] * ldw(x + col);
            for (int64_t t = 1; t < n; t++) s = s + a0[t * at] * ldw(x + t * ldx + col);
            stw(oo + col, s);
        }
        for (; col < nc; col++) {
            double s = a0[0] * x[col];
            for (int64_t t = 1; t < n; t++) s = s + a0[t * at] * x[t * ldx + col];
            oo[col] = s;
        }
    }
}

/* Fold the row x[0..n) into the sums acc[f][0..n) on the grid rows g[f][0..n) (f < folds),
 * 8 columns at a time (rmr_fold8), then one at a time: the same operations per column. */
static void rmb_fold_row(const double *x, int64_t n, int64_t folds, double *const acc[],
                         const double *const g[]) {
    int64_t col = 0;
    for (; col + 8 <= n; col += 8) {
        v8 xv = ld8(x + col);
        for (int64_t f = 0; f < folds; f++) {
            const v8 cf = ld8(g[f] + col);
            const v8 hi = (xv + cf) - cf;
            st8(acc[f] + col, ld8(acc[f] + col) + hi);
            xv = xv - hi;
        }
    }
    for (; col < n; col++) {
        double xs = x[col];
        for (int64_t f = 0; f < folds; f++) RMR_FOLD(xs, g[f][col], acc[f][col]);
    }
}

/* One tile, every (batch, head). The last axis of every float array is contiguous; the
 * (batch, head, row or key) strides of the others, in float64 elements, are st[0..27):
 * 3 each for q, dO, lse, delta, k, v, the dq sums, the dk sums, the dv sums, in that order.
 *
 * mods: the score modifiers (bit 0 softcap cap > 0; bit 1 ALiBi: slopes (H,), the rows'
 * ALiBi positions qa (r,) and the keys' positions kp (c,), both below 2^53 in magnitude);
 * q (B, H, r, Dk);  dO (B, H, r, Dv);  lse, delta (B, H, r);  k (B, H, c, Dk),
 * v (B, H, c, Dv): the K/V head of each query head;
 * vis (r, c) uint8, rows visr bytes apart: 1 where row i sees key j;
 * qgrid (F, B, H, Dk), kgrid (F, B, Hkv, Dk), vgrid (F, B, Hkv, Dv): C-contiguous grids;
 * dq[f] (B, H, r, Dk), dk[f] (B, Hkv, c, Dk), dv[f] (B, Hkv, c, Dv): fold sums (one pointer
 * per fold, the same strides for every fold), added to;
 * pmax: the largest p (see the header).
 * Returns 0; -1 for a bad argument; -2 when no scratch memory was available. */
int64_t rmb_tile(const double *q, const double *dO, const double *lse, const double *delta,
                 const double *k, const double *v, const int64_t *st, const uint8_t *vis,
                 int64_t visr, int64_t B, int64_t H, int64_t Hkv, int64_t r, int64_t c,
                 int64_t Dk, int64_t Dv, double scale, int64_t folds, const double *qgrid,
                 const double *kgrid, const double *vgrid, double *const *dq,
                 double *const *dk, double *const *dv, double *pmax, int64_t mods, double cap,
                 const double *slopes, const int64_t *qa, const int64_t *kp) {
    const int64_t *qs = st, *dos = st + 3, *ls = st + 6, *es = st + 9, *ks = st + 12;
    const int64_t *vs = st + 15, *dqs = st + 18, *dks = st + 21, *dvs = st + 24;
    if (B < 0 || H < 1 || Hkv < 1 || H % Hkv || r < 0 || r > RMB_BK || c < 0 || c > RMB_BK ||
        Dk < 1 || Dv < 1 || folds < 1 || folds > RMB_MAXF || visr < c || !pmax)
        return -1;
    if ((mods & ~INT64_C(3)) || ((mods & 1) && !(cap > 0)) ||
        ((mods & 2) && (!slopes || !qa || !kp)))
        return -1;
    *pmax = 0.0;
    if (B == 0 || r == 0 || c == 0) return 0; /* numpy: no p, max 0 */
    const int64_t g = H / Hkv, dmax = Dk > Dv ? Dk : Dv;
    /* scratch: k^T and v^T (D x 64), s then p, dp then ds (64 x 64), a block partial
     * (64 x max(Dk, Dv)), the visibility as lane masks (64 x 64 int64: -1 visible, 0 not or
     * past c, built once for every head); zeroed once, so the lanes past c are finite */
    const size_t nbuf = (size_t)(Dk + Dv + dmax) * RMB_BK + 3 * RMB_BK * RMB_BK;
    double *buf = calloc(nbuf, sizeof(double));
    if (!buf) return -2;
    double *kT = buf, *vT = kT + Dk * RMB_BK, *sp = vT + Dv * RMB_BK;
    double *dpds = sp + RMB_BK * RMB_BK, *part = dpds + RMB_BK * RMB_BK;
    int64_t *vmask = (int64_t *)(part + dmax * RMB_BK);
    const double icap = (mods & 1) ? 1.0 / cap : 0.0; /* rounded once, as numpy's 1.0 / cap */
    double kd[RMB_BK] = {0}; /* the keys' ALiBi positions as doubles, 0 past c (unused lanes) */
    if (mods & 2)
        for (int64_t j = 0; j < c; j++) kd[j] = (double)kp[j];
    const int64_t cw = (c + 7) / 8 * 8; /* the columns the 8-lane steps touch */
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < c; j++) vmask[i * RMB_BK + j] = vis[i * visr + j] ? -1 : 0;
    /* the largest p lane by lane (p >= 0, and 0 past c), NaN lanes, visible s - lse > 709 */
    v8 pm8 = {0};
    v8i nan8 = {0}, big8 = {0};
    const v8 tbig = {RMB_TBIG, RMB_TBIG, RMB_TBIG, RMB_TBIG, RMB_TBIG, RMB_TBIG, RMB_TBIG,
                     RMB_TBIG};
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t kh = h / g;
            const double slope = (mods & 2) ? slopes[h] : 0.0;
            const double *qh = q + bb * qs[0] + h * qs[1], *doh = dO + bb * dos[0] + h * dos[1];
            const double *kh_ = k + bb * ks[0] + h * ks[1], *vh = v + bb * vs[0] + h * vs[1];
            /* k^T, v^T: the keys along the columns (strided reads, contiguous writes) */
            for (int64_t d = 0; d < Dk; d++)
                for (int64_t j = 0; j < c; j++) kT[d * RMB_BK + j] = kh_[j * ks[2] + d];
            for (int64_t d = 0; d < Dv; d++)
                for (int64_t j = 0; j < c; j++) vT[d * RMB_BK + j] = vh[j * vs[2] + d];
            rmb_chain(qh, qs[2], 1, kT, RMB_BK, r, Dk, c, sp, RMB_BK); /* s before the scale */
            rmb_chain(doh, dos[2], 1, vT, RMB_BK, r, Dv, c, dpds, RMB_BK); /* dp */
            for (int64_t i = 0; i < r; i++) {
                const double li = lse[bb * ls[0] + h * ls[1] + i * ls[2]];
                const double di = delta[bb * es[0] + h * es[1] + i * es[2]];
                const double qd = (mods & 2) ? (double)qa[i] : 0.0;
                double *si = sp + i * RMB_BK, *dsi = dpds + i * RMB_BK;
                for (int64_t j0 = 0; j0 < cw; j0 += 8) {
                    v8i vm;
                    memcpy(&vm, vmask + i * RMB_BK + j0, sizeof vm);
                    v8 x = ld8(si + j0) * scale, dm = {0};
                    if (mods) x = rmr_mod8(x, mods, cap, icap, slope, qd, ld8(kd + j0), &dm);
                    const v8 t = x - li;
                    const v8 p = sel8(vm, rmr_exp8(t), (v8){0});
                    v8 ds = p * (ld8(dsi + j0) - di);
                    if (mods & 1) ds = ds * dm; /* numpy: ds *= dmod, after the product */
                    st8(si + j0, p);
                    st8(dsi + j0, ds);
                    nan8 |= ne8(p, p);
                    big8 |= vm & gt8(t, tbig);
                    pm8 = sel8(gt8(p, pm8), p, pm8);
                }
            }
            /* dq: per row, over the keys in key order; into (b, h, i) */
            rmb_chain(dpds, RMB_BK, 1, kh_, ks[2], r, c, Dk, part, dmax);
            const double *gq[RMB_MAXF], *gk[RMB_MAXF], *gv[RMB_MAXF];
            double *acc[RMB_MAXF];
            for (int64_t f = 0; f < folds; f++) {
                gq[f] = qgrid + ((f * B + bb) * H + h) * Dk;
                gk[f] = kgrid + ((f * B + bb) * Hkv + kh) * Dk;
                gv[f] = vgrid + ((f * B + bb) * Hkv + kh) * Dv;
            }
            for (int64_t i = 0; i < r; i++) {
                for (int64_t f = 0; f < folds; f++)
                    acc[f] = dq[f] + bb * dqs[0] + h * dqs[1] + i * dqs[2];
                rmb_fold_row(part + i * dmax, Dk, folds, acc, gq);
            }
            /* dk: per key, over the rows in row order; into (b, h / G, j) */
            rmb_chain(dpds, 1, RMB_BK, qh, qs[2], c, r, Dk, part, dmax);
            for (int64_t j = 0; j < c; j++) {
                for (int64_t f = 0; f < folds; f++)
                    acc[f] = dk[f] + bb * dks[0] + kh * dks[1] + j * dks[2];
                rmb_fold_row(part + j * dmax, Dk, folds, acc, gk);
            }
            /* dv: per key, p times dO over the rows in row order; into (b, h / G, j) */
            rmb_chain(sp, 1, RMB_BK, doh, dos[2], c, r, Dv, part, dmax);
            for (int64_t j = 0; j < c; j++) {
                for (int64_t f = 0; f < folds; f++)
                    acc[f] = dv[f] + bb * dvs[0] + kh * dvs[1] + j * dvs[2];
                rmb_fold_row(part + j * dmax, Dv, folds, acc, gv);
            }
        }
    free(buf);
    double pm = 0.0;
    int nan = 0, big = 0;
    for (int l = 0; l < 8; l++) {
        nan |= nan8[l] != 0;
        big |= big8[l] != 0;
        pm = pm8[l] > pm ? pm8[l] : pm;
    }
    *pmax = nan ? NAN : big ? INFINITY : pm;
    return 0;
}
