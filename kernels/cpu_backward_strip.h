/* The block products of the fused backward tile (kernels/cpu_backward.c), one element type.
 *
 * Included by the type-generic part of cpu_backward.c, once per RM_BITS, after
 * cpu_simd_type.h and its register-blocking names (R rows or keys per register tile, NK / NV
 * vectors per tile, KW keys per packed panel, TW columns of D per dQ / dK / dV tile):
 *
 *   FN(rb_strip)    one strip of R rows against the panels: S, then P = exp(S - lse) or the
 *                   raw scores (mode 2, for FN(rb_modify): the score modifiers, then P), or
 *                   dP, then dS = P (dP - delta);
 *   FN(rb_dq)       dQ += scale dS K for one strip;
 *   FN(rb_outer)    dV += P^T dO and dK += dS^T Qs over a query block, reduced from zero;
 *   FN(rb_flush)    the key block's sums into dk, dv (FN(rb_axpy)).
 *
 * No include guard: each inclusion defines the functions of that element type. */

/* One strip of R rows against np panels: acc = X (R x D, row stride ldx) Y^T (panels).
 * mode 0: out = exp(acc - aux[r])  (P from S, aux = lse)
 * mode 1: out = pin * (acc - aux[r])  (dS from dP, aux = delta, pin = P)
 * mode 2: out = acc  (the raw scores, for rb_modify)
 * out and pin have row stride ld. */
static inline void FN(rb_strip)(const RM_T *restrict x, int64_t ldx, const RM_T *restrict yt,
                                int64_t np, int64_t D, const RM_T *restrict aux, int mode,
                                const RM_T *restrict pin, RM_T *restrict out, int64_t ld) {
    for (int64_t p = 0; p < np; p++) {
        const RM_T *yp = yt + p * D * KW;
        RM_V acc[R][NK];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int c = 0; c < NK; c++) acc[r][c] = V_ZERO();
        for (int64_t d = 0; d < D; d++) {
            RM_V yv[NK];
#pragma GCC unroll 8
            for (int c = 0; c < NK; c++) yv[c] = V_LOAD(yp + d * KW + c * RM_W);
#pragma GCC unroll 8
            for (int c = 0; c < NK; c++) RM_PREFETCH(yp + (d + RM_PF) * KW + c * RM_W);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const RM_V xb = V_SET1(x[r * ldx + d]);
#pragma GCC unroll 8
                for (int c = 0; c < NK; c++) acc[r][c] = V_FMA(xb, yv[c], acc[r][c]);
            }
        }
        if (mode == 2) {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NK; c++) V_STORE(out + r * ld + p * KW + c * RM_W, acc[r][c]);
        } else if (mode == 0) {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const RM_V a = V_SET1(aux[r]);
#pragma GCC unroll 8
                for (int c = 0; c < NK; c++)
                    V_STORE(out + r * ld + p * KW + c * RM_W, V_EXP(V_SUB(acc[r][c], a)));
            }
        } else {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const RM_V a = V_SET1(aux[r]);
#pragma GCC unroll 8
                for (int c = 0; c < NK; c++) {
                    const int64_t o = r * ld + p * KW + c * RM_W;
                    V_STORE(out + o, V_MUL(V_LOAD(pin + o), V_SUB(acc[r][c], a)));
                }
            }
        }
    }
}

/* P of one strip with score modifiers: s (R x ld rows; the raw scores Qs K^T in the columns
 * [c0, c1), whole vectors) gets the head's modifiers m (FN(rm_mods_row): dc, when not NULL,
 * the product of their derivatives, same layout; the position modifiers on the nreal real
 * rows, ap their positions, and the block's keys j < nk, kp their positions), then
 * P = exp(s - lse[r]). */
static void FN(rb_modify)(const FN(rm_mods) *m, RM_T *restrict s, RM_T *restrict dc, int64_t ld,
                          int64_t c0, int64_t c1, int64_t nk, int nreal,
                          const int64_t *restrict ap, const int64_t *restrict kp,
                          const RM_T *restrict lse) {
    const int64_t ja = c1 < nk ? c1 : nk;
    for (int r = 0; r < R; r++) {
        RM_T *restrict row = s + r * ld;
        FN(rm_mods_row)(m, row, dc ? dc + r * ld : NULL, c0, c1, ja, kp,
                        ap && r < nreal ? ap + r : NULL);
        const RM_V l = V_SET1(lse[r]);
        for (int64_t j = c0; j < c1; j += RM_W) V_STORE(row + j, V_EXP(V_SUB(V_LOAD(row + j), l)));
    }
}

/* dst[0..n) += s * src[0..n) */
static inline void FN(rb_axpy)(RM_T *restrict dst, const RM_T *restrict src, int64_t n, RM_T s) {
    int64_t d = 0;
    const RM_V vs = V_SET1(s);
    for (; d + RM_W <= n; d += RM_W) V_STORE(dst + d, V_FMA(vs, V_LOAD(src + d), V_LOAD(dst + d)));
    for (; d < n; d++) dst[d] += s * src[d];
}

/* dk rows [0, nk) (row stride D) += dkb (row stride Dp), dv rows (row stride Dv) += dvb
 * (row stride Dvp); then dkb, dvb = 0. */
static void FN(rb_flush)(RM_T *restrict dk, RM_T *restrict dv, RM_T *restrict dkb,
                         RM_T *restrict dvb, int64_t nk, int64_t nkr, int64_t D, int64_t Dp,
                         int64_t Dv, int64_t Dvp) {
    for (int64_t j = 0; j < nk; j++) {
        FN(rb_axpy)(dk + j * D, dkb + j * Dp, D, (RM_T)1);
        FN(rb_axpy)(dv + j * Dv, dvb + j * Dvp, Dv, (RM_T)1);
    }
    memset(dkb, 0, sizeof(RM_T) * (size_t)(nkr * Dp));
    memset(dvb, 0, sizeof(RM_T) * (size_t)(nkr * Dvp));
}

/* dq rows [0, nrows) (row stride D) += sc * dS (R x nk, row stride ld) K (nk x Dp). */
static inline void FN(rb_dq)(const RM_T *restrict ds, int64_t ld, const RM_T *restrict kr,
                             int64_t nk, int64_t Dp, int64_t D, RM_T sc, RM_T *restrict dq,
                             int nrows) {
    RM_T tmp[R * TW];
    int64_t d0 = 0;
    for (; d0 + TW <= Dp; d0 += TW) {
        RM_V acc[R][NV];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int c = 0; c < NV; c++) acc[r][c] = V_ZERO();
        for (int64_t j = 0; j < nk; j++) {
            RM_V kv[NV];
#pragma GCC unroll 8
            for (int c = 0; c < NV; c++) kv[c] = V_LOAD(kr + j * Dp + d0 + c * RM_W);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const RM_V sb = V_SET1(ds[r * ld + j]);
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) acc[r][c] = V_FMA(sb, kv[c], acc[r][c]);
            }
        }
        if (d0 + TW <= D) {
            const RM_V vs = V_SET1(sc);
            for (int r = 0; r < nrows; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) {
                    RM_T *o = dq + r * D + d0 + c * RM_W;
                    V_STORE(o, V_FMA(vs, acc[r][c], V_LOAD(o)));
                }
        } else {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) V_STORE(tmp + r * TW + c * RM_W, acc[r][c]);
            for (int r = 0; r < nrows; r++) FN(rb_axpy)(dq + r * D + d0, tmp + r * TW, D - d0, sc);
        }
    }
    for (; d0 < Dp; d0 += RM_W) { /* tail: one vector of columns */
        RM_V acc[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r] = V_ZERO();
        for (int64_t j = 0; j < nk; j++) {
            const RM_V kv = V_LOAD(kr + j * Dp + d0);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[r] = V_FMA(V_SET1(ds[r * ld + j]), kv, acc[r]);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) V_STORE(tmp + r * RM_W, acc[r]);
        const int64_t n = D - d0 < RM_W ? D - d0 : RM_W;
        for (int r = 0; r < nrows; r++) FN(rb_axpy)(dq + r * D + d0, tmp + r * RM_W, n, sc);
    }
}

/* out (nkr x Dp, nkr a multiple of R) += A^T X: A (nq x nkr, row stride lda; P or dS),
 * X (nq x Dp, row stride ldx; dO or Qs). Register tile: R keys x TW columns, reducing over
 * the nq rows of the query block from zero; the block's sum is then added to out once.
 * Chaining from out instead would add every query row's term to a total over all the rows
 * seen so far: an error growing with the query count (see RB_FLUSH for the rest). */
static void FN(rb_outer)(const RM_T *restrict A, int64_t lda, const RM_T *restrict X,
                         int64_t ldx, int64_t nq, int64_t nkr, int64_t Dp, RM_T *restrict out) {
    for (int64_t j0 = 0; j0 < nkr; j0 += R) {
        RM_T *o = out + j0 * Dp;
        const RM_T *a = A + j0;
        int64_t d0 = 0;
        for (; d0 + TW <= Dp; d0 += TW) {
            RM_V acc[R][NV];
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) acc[r][c] = V_ZERO();
            for (int64_t i = 0; i < nq; i++) {
                RM_V xv[NV];
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) xv[c] = V_LOAD(X + i * ldx + d0 + c * RM_W);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    const RM_V ab = V_SET1(a[i * lda + r]);
#pragma GCC unroll 8
                    for (int c = 0; c < NV; c++) acc[r][c] = V_FMA(ab, xv[c], acc[r][c]);
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) {
                    RM_T *op = o + r * Dp + d0 + c * RM_W;
                    V_STORE(op, V_ADD(V_LOAD(op), acc[r][c]));
                }
        }
        for (; d0 < Dp; d0 += RM_W) { /* tail: one vector of columns */
            RM_V acc[R];
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[r] = V_ZERO();
            for (int64_t i = 0; i < nq; i++) {
                const RM_V xv = V_LOAD(X + i * ldx + d0);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) acc[r] = V_FMA(V_SET1(a[i * lda + r]), xv, acc[r]);
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) V_STORE(o + r * Dp + d0, V_ADD(V_LOAD(o + r * Dp + d0), acc[r]));
        }
    }
}
