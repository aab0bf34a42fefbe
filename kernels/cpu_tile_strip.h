/* The strip operations of the fused forward tile (kernels/cpu_tile.c), one element type.
 *
 * Included by the type-generic part of cpu_tile.c, once per RM_BITS, after cpu_simd_type.h
 * and its register-blocking names (RM_R rows per strip, NK / NV vectors per register tile,
 * KW keys per K^T panel, KW_LINES / NV_LINES cache lines per panel row / V segment, NS
 * vectors per 64 bytes of row sums). One strip of RM_R query rows against one key block:
 *
 *   FN(rm_qk)       S = Qs K^T over the block's panels, the rows' lane-wise maxima taken
 *                   from the registers;
 *   FN(rm_softmax)  the online softmax: S -> P = exp(S - m'), m, l (compensated) and the
 *                   rows of O rescaled;
 *   FN(rm_pv)       O += P V, reduced from zero per block and added compensated (FN(rm_kadd)).
 *
 * No include guard: each inclusion defines the functions of that element type. */

/* One panel of S = Qs K^T: its first nv vectors of keys (nv <= NK, a constant where it is
 * inlined, so the register tile is unrolled); rmax gets the lane-wise maxima of those. */
static inline __attribute__((always_inline)) void FN(rm_qk_panel)(
    const RM_T *restrict qs, const RM_T *restrict kp, int64_t D, RM_T *restrict s, int64_t lds,
    RM_T *restrict rmax, const int nv) {
    RM_V acc[RM_R][NK];
#pragma GCC unroll 16
    for (int r = 0; r < RM_R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) acc[r][c] = V_ZERO();
    for (int64_t d = 0; d < D; d++) {
        RM_V kv[NK];
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) kv[c] = V_LOAD(kp + d * KW + c * RM_W);
#pragma GCC unroll 4
        for (int c = 0; c < KW_LINES; c++)
            RM_PREFETCH((const char *)(kp + (d + RM_PF) * KW) + 64 * c);
#pragma GCC unroll 16
        for (int r = 0; r < RM_R; r++) {
            RM_V qb = V_SET1(qs[r * D + d]);
#pragma GCC unroll 4
            for (int c = 0; c < nv; c++) acc[r][c] = V_FMA(qb, kv[c], acc[r][c]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < RM_R; r++) {
        RM_V mx = V_LOAD(rmax + r * RM_W);
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) {
            V_STORE(s + r * lds + c * RM_W, acc[r][c]);
            mx = V_MAX(mx, acc[r][c]);
        }
        V_STORE(rmax + r * RM_W, mx);
    }
}

/* S (RM_R x ldS) = Qs (RM_R x D) K^T over the block's columns [0, ncol) (ncol a multiple of
 * RM_W: whole panels, the last one possibly only its first vectors); rmax (RM_R x RM_W) gets
 * each row's running maximum as a vector (lane-wise over the panels), taken from the
 * registers before they are stored, so the softmax needs no separate pass for it. Every
 * score is the same FMA chain over d whichever columns are computed. */
static inline void FN(rm_qk)(const RM_T *restrict qs, const RM_T *restrict kt, int64_t ncol,
                             int64_t D, RM_T *restrict s, int64_t lds, RM_T *restrict rmax) {
#pragma GCC unroll 16
    for (int r = 0; r < RM_R; r++) V_STORE(rmax + r * RM_W, V_SET1(-INFINITY));
    const int64_t nfull = ncol / KW;
    for (int64_t p = 0; p < nfull; p++)
        FN(rm_qk_panel)(qs, kt + p * D * KW, D, s + p * KW, lds, rmax, NK);
    const int nv = (int)(ncol - nfull * KW) / RM_W; /* vectors of a last, partial panel */
    const RM_T *kp = kt + nfull * D * KW;
    RM_T *sp = s + nfull * KW;
    switch (nv) { /* nv < NK <= 4 */
    case 1: FN(rm_qk_panel)(qs, kp, D, sp, lds, rmax, 1); break;
#if NK > 2
    case 2: FN(rm_qk_panel)(qs, kp, D, sp, lds, rmax, 2); break;
    case 3: FN(rm_qk_panel)(qs, kp, D, sp, lds, rmax, 3); break;
#endif
    default: break;
    }
}

/* o + x by compensated (Kahan) summation: *c holds the rounding error of o so far, to be
 * subtracted from it; a NaN compensation (from an infinite o) is replaced by 0, so inf and
 * NaN in o behave as in plain summation. */
static inline RM_V FN(rm_kadd)(RM_V o, RM_V x, RM_V *c) {
    const RM_V y = V_SUB(x, *c);
    const RM_V t = V_ADD(o, y);
    const RM_V e = V_SUB(V_SUB(t, o), y);
    *c = V_NAN0(e);
    return t;
}

/* O (RM_R x Dp) += P (RM_R x nk) V (nk x Dp), with compensation oc (RM_R x Dp). The block's
 * product is accumulated from zero in registers and added to O once, compensated: a chain
 * that started from O would add every key's term to the row's ever larger running total,
 * an error growing with the row's key count (about sqrt(N) ulps of O for values with a
 * mean); this way it is that of one chain of at most Bk keys, whatever the key count. */
static inline void FN(rm_pv)(const RM_T *restrict pm, int64_t ldp, const RM_T *restrict vp,
                             int64_t nk, int64_t Dp, RM_T *restrict o, RM_T *restrict oc) {
    int64_t d0 = 0;
    for (; d0 + NV * RM_W <= Dp; d0 += NV * RM_W) {
        RM_V acc[RM_R][NV];
#pragma GCC unroll 16
        for (int r = 0; r < RM_R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < NV; c++) acc[r][c] = V_ZERO();
        for (int64_t j = 0; j < nk; j++) {
            RM_V vv[NV];
#pragma GCC unroll 4
            for (int c = 0; c < NV; c++) vv[c] = V_LOAD(vp + j * Dp + d0 + c * RM_W);
#pragma GCC unroll 4
            for (int c = 0; c < NV_LINES; c++)
                RM_PREFETCH((const char *)(vp + (j + RM_PF) * Dp + d0) + 64 * c);
#pragma GCC unroll 16
            for (int r = 0; r < RM_R; r++) {
                RM_V pb = V_SET1(pm[r * ldp + j]);
#pragma GCC unroll 4
                for (int c = 0; c < NV; c++) acc[r][c] = V_FMA(pb, vv[c], acc[r][c]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < RM_R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < NV; c++) {
                const int64_t off = r * Dp + d0 + c * RM_W;
                RM_V cv = V_LOAD(oc + off);
                V_STORE(o + off, FN(rm_kadd)(V_LOAD(o + off), acc[r][c], &cv));
                V_STORE(oc + off, cv);
            }
    }
    for (; d0 < Dp; d0 += RM_W) { /* tail: one vector of columns */
        RM_V acc[RM_R];
#pragma GCC unroll 16
        for (int r = 0; r < RM_R; r++) acc[r] = V_ZERO();
        for (int64_t j = 0; j < nk; j++) {
            RM_V vv = V_LOAD(vp + j * Dp + d0);
#pragma GCC unroll 16
            for (int r = 0; r < RM_R; r++) acc[r] = V_FMA(V_SET1(pm[r * ldp + j]), vv, acc[r]);
        }
#pragma GCC unroll 16
        for (int r = 0; r < RM_R; r++) {
            const int64_t off = r * Dp + d0;
            RM_V cv = V_LOAD(oc + off);
            V_STORE(o + off, FN(rm_kadd)(V_LOAD(o + off), acc[r], &cv));
            V_STORE(oc + off, cv);
        }
    }
}

/* Online softmax over one strip: s (RM_R x ncol, ncol a multiple of 64 bytes, -inf past the
 * valid keys) becomes P in place (pad: the panels end past ncol, their columns all -inf);
 * m, l, and the rows of o (RM_R x Dp) are rescaled, with their compensations lc and oc (see
 * rm_kadd); the strip's row sums go into l compensated. rmax (RM_R x RM_W): lane-wise row
 * maxima of s from rm_qk when have_max, else scratch. The per-row statistics go through one
 * vector exp, and the exp pass runs over the RM_R rows at once (independent chains, one
 * running sum per row). */
static inline void FN(rm_softmax)(RM_T *restrict s, int64_t lds, int64_t ncol, int pad,
                                  RM_T *restrict m, RM_T *restrict l, RM_T *restrict lc,
                                  RM_T *restrict o, RM_T *restrict oc, int64_t Dp,
                                  RM_T *restrict rmax, int have_max) {
    enum { NR = (RM_R + RM_W - 1) / RM_W * RM_W }; /* rows padded to whole vectors */
    RM_T arg[NR], alpha[NR], neg[RM_R];
    for (int r = 0; r < RM_R; r++) {
        RM_V vm;
        if (have_max) {
            vm = V_LOAD(rmax + r * RM_W);
        } else {
            const RM_T *row = s + r * lds;
            vm = V_LOAD(row);
            for (int64_t j = RM_W; j < ncol; j += RM_W) vm = V_MAX(vm, V_LOAD(row + j));
            /* the -inf columns up to the panel's end, as when they were scored: V_MAX
             * returns its second operand for a NaN lane, so they drop a NaN maximum */
            if (pad) vm = V_MAX(vm, V_SET1(-INFINITY));
        }
        RM_T mx = V_HMAX(vm);
        RM_T m_old = m[r];
        RM_T m_new = m_old > mx ? m_old : mx;
        if (mx != mx) m_new = mx; /* NaN score: poison the row like the spec */
        /* nothing visible yet (m_new = -inf): the spec uses m_safe = 0, so alpha = 0, p = 0 */
        const int empty = m_new == -INFINITY;
        arg[r] = empty ? -INFINITY : m_old - m_new;
        neg[r] = empty ? 0 : -m_new;
        m[r] = m_new;
    }
    for (int r = RM_R; r < NR; r++) arg[r] = 0;
    for (int r = 0; r < NR; r += RM_W) V_STORE(alpha + r, V_EXP(V_LOAD(arg + r)));
    /* Each row sums into NS vectors spanning 64 bytes (lane i of vector c adds the columns j
     * = c W + i mod NS W, in increasing j), adds them up and reduces by V_HSUM's fixed tree:
     * the same additions in the same order on AVX2 (NS = 2) and AVX-512 (NS = 1). ncol is a
     * multiple of NS W (64 bytes); -inf columns past it would add exact zeros. */
    RM_V vneg[RM_R];
    RM_VSUM sum[RM_R][NS];
#pragma GCC unroll 16
    for (int r = 0; r < RM_R; r++) {
        vneg[r] = V_SET1(neg[r]);
#pragma GCC unroll 4
        for (int c = 0; c < NS; c++) sum[r][c] = V_ZERO();
    }
    for (int64_t j = 0; j < ncol; j += NS * RM_W) {
#pragma GCC unroll 16
        for (int r = 0; r < RM_R; r++) {
#pragma GCC unroll 4
            for (int c = 0; c < NS; c++) {
                RM_T *sp = s + r * lds + j + c * RM_W;
                RM_V p = V_EXP(V_ADD(V_LOAD(sp), vneg[r]));
                V_STORE(sp, p);
                sum[r][c] = V_ADD(sum[r][c], p);
            }
        }
    }
    for (int r = 0; r < RM_R; r++) {
#pragma GCC unroll 4
        for (int c = 1; c < NS; c++) sum[r][0] = V_ADD(sum[r][0], sum[r][c]);
        {
            const RM_T x = V_HSUM(sum[r][0]), ls = l[r] * alpha[r], y = x - lc[r] * alpha[r];
            const RM_T t = ls + y, e = (t - ls) - y;
            lc[r] = e == e ? e : 0;
            l[r] = t;
        }
        if (alpha[r] != 1) {
            RM_V va = V_SET1(alpha[r]);
            RM_T *orow = o + r * Dp, *crow = oc + r * Dp;
            for (int64_t d = 0; d < Dp; d += RM_W) {
                V_STORE(orow + d, V_MUL(V_LOAD(orow + d), va));
                V_STORE(crow + d, V_MUL(V_LOAD(crow + d), va));
            }
        }
    }
}
