/* One element type of the SIMD layer (kernels/cpu_simd.h), for a kernel's type-generic part.
 *
 * Included at the top of the type-generic part of kernels/cpu_tile.c and
 * kernels/cpu_backward.c, once per element type, with RM_BITS 32 (float) or 64 (double).
 * It (re)defines the names that part is written in:
 *
 *   RM_T, RM_V, RM_W    the element type, its vector type and lanes per vector
 *   RM_VSUM             the type of the forward's row sums (double lanes on the scalar path)
 *   V_LOAD, ..., V_EXP  the vector operations of that type (cpu_simd.h)
 *   FN(name)            name_f32 / name_f64, the functions of this type
 *
 * and the functions both kernels share: the packing of K/V blocks (FN(rm_pack_panels),
 * FN(rm_pack_rows)), FN(rm_tanh) and the score modifiers of ringmpi.tile on one row of
 * scores, FN(rm_softcap_row) and FN(rm_alibi_row).
 */
#undef RM_T
#undef RM_V
#undef RM_VSUM
#undef RM_W
#undef RM_SFX
#undef RM_LOG1
#undef RM_TANH1
#undef RM_TANH_X
#undef RM_TANH_N
#undef V_ABS
#undef V_SIGN
#undef V_OR
#undef V_SELLT
#undef V_DIV
#undef V_LOAD
#undef V_STORE
#undef V_SET1
#undef V_ZERO
#undef V_FMA
#undef V_MUL
#undef V_ADD
#undef V_SUB
#undef V_NAN0
#undef V_MAX
#undef V_HMAX
#undef V_HSUM
#undef V_EXP
#if RM_BITS == 32
#define RM_T float
#define RM_V vf
#define RM_VSUM vf_sum
#define RM_W VF_W
#define RM_SFX f32
#define RM_LOG1 logf
#define RM_TANH1 tanhf
#define RM_TANH_X 0.35 /* below: the odd Taylor polynomial of rm_tanh_c[0..RM_TANH_N) */
#define RM_TANH_N 6
#define V_ABS vf_abs
#define V_SIGN vf_sign
#define V_OR vf_or
#define V_SELLT vf_sellt
#define V_DIV vf_div
#define V_LOAD vf_load
#define V_STORE vf_store
#define V_SET1 vf_set1
#define V_ZERO vf_zero
#define V_FMA vf_fma
#define V_MUL vf_mul
#define V_ADD vf_add
#define V_SUB vf_sub
#define V_NAN0 vf_nan0
#define V_MAX vf_max
#define V_HMAX vf_hmax
#define V_HSUM vf_hsum
#define V_EXP vf_exp
#elif RM_BITS == 64
#define RM_T double
#define RM_V vd
#define RM_VSUM vd
#define RM_W VD_W
#define RM_SFX f64
#define RM_LOG1 log
#define RM_TANH1 tanh
#define RM_TANH_X 0.3
#define RM_TANH_N 12
#define V_ABS vd_abs
#define V_SIGN vd_sign
#define V_OR vd_or
#define V_SELLT vd_sellt
#define V_DIV vd_div
#define V_LOAD vd_load
#define V_STORE vd_store
#define V_SET1 vd_set1
#define V_ZERO vd_zero
#define V_FMA vd_fma
#define V_MUL vd_mul
#define V_ADD vd_add
#define V_SUB vd_sub
#define V_NAN0 vd_nan0
#define V_MAX vd_max
#define V_HMAX vd_hmax
#define V_HSUM vd_hsum
#define V_EXP vd_exp
#else
#error "define RM_BITS as 32 or 64 before including cpu_simd_type.h"
#endif
#ifndef FN
#define RM_CAT2(a, b) a##_##b
#define RM_CAT(a, b) RM_CAT2(a, b)
#define FN(name) RM_CAT(name, RM_SFX)
#endif

/* tanh(x), elementwise. Vector paths: |x| < RM_TANH_X by the odd Taylor polynomial
 * x + x^3 P(x^2) (RM_TANH_N terms: truncation 1.2e-8 relative for float32 below 0.35, 3e-18
 * for float64 below 0.3), else sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) from V_EXP
 * (no cancellation: e < 0.55 there); |x| >= 44 (float32) gives e = 0, so exactly +-1. Both
 * branches are computed and one selected: the same IEEE operations on AVX2 and AVX-512, so
 * the same bits. NaN propagates (the compare is false, V_EXP keeps it). Scalar path: libm. */
static inline RM_V FN(rm_tanh)(RM_V x) {
#if RM_W == 1
    return RM_TANH1(x);
#else
    const RM_V one = V_SET1((RM_T)1), ax = V_ABS(x), x2 = V_MUL(x, x);
    RM_V p = V_SET1((RM_T)rm_tanh_c[RM_TANH_N - 1]);
#pragma GCC unroll 16
    for (int i = RM_TANH_N - 2; i >= 1; i--) p = V_FMA(p, x2, V_SET1((RM_T)rm_tanh_c[i]));
    const RM_V small = V_FMA(V_MUL(x, x2), p, x);
    const RM_V e = V_EXP(V_MUL(ax, V_SET1((RM_T)-2)));
    const RM_V big = V_OR(V_DIV(V_SUB(one, e), V_ADD(one, e)), V_SIGN(x));
    return V_SELLT(ax, V_SET1((RM_T)RM_TANH_X), small, big);
#endif
}

/* Softcap on the columns [j0, j1) of one row of scores (whole vectors, j0 a multiple of
 * RM_W): s -> cap tanh(s / cap); dc, when not NULL, gets the derivative 1 - tanh^2 at the
 * same columns (the backward's factor of dS). */
static inline void FN(rm_softcap_row)(RM_T *restrict row, RM_T *restrict dc, int64_t j0,
                                      int64_t j1, RM_T cap) {
    const RM_V vc = V_SET1(cap), vic = V_SET1((RM_T)1 / cap), one = V_SET1((RM_T)1);
    for (int64_t j = j0; j < j1; j += RM_W) {
        const RM_V t = FN(rm_tanh)(V_MUL(V_LOAD(row + j), vic));
        if (dc) V_STORE(dc + j, V_SUB(one, V_MUL(t, t)));
        V_STORE(row + j, V_MUL(vc, t));
    }
}

/* ALiBi on the columns [j0, j1) of one row of scores: s -= slope |a - kq[j]| (a: the row's
 * position, kq: the columns' key positions), the product in double, rounded once to RM_T
 * (as the numpy tile), then subtracted. */
static inline void FN(rm_alibi_row)(RM_T *restrict row, int64_t j0, int64_t j1, int64_t a,
                                    const int64_t *restrict kq, double slope) {
    for (int64_t j = j0; j < j1; j++) {
        const int64_t dist = a > kq[j] ? a - kq[j] : kq[j] - a;
        row[j] -= (RM_T)(slope * (double)dist);
    }
}

/* Rows [0, nk) of src (row stride D) as transposed panels of kw columns: dst (np, D, kw)
 * row-major, np = ceil(nk / kw), so one vector load gives kw / RM_W consecutive rows of one
 * feature; zero past nk. The panel is written in order (unit-stride stores); its kw source
 * rows are read column by column and stay in L1. */
static inline void FN(rm_pack_panels)(const RM_T *restrict src, int64_t nk, int64_t D,
                                      int64_t kw, RM_T *restrict dst) {
    const int64_t np = (nk + kw - 1) / kw;
    for (int64_t p = 0; p < np; p++) {
        RM_T *pd = dst + p * D * kw;
        const RM_T *ps = src + p * kw * D;
        const int64_t nc = nk - p * kw < kw ? nk - p * kw : kw;
        for (int64_t d = 0; d < D; d++) {
            for (int64_t c = 0; c < nc; c++) pd[d * kw + c] = ps[c * D + d];
            for (int64_t c = nc; c < kw; c++) pd[d * kw + c] = 0;
        }
    }
}

/* Rows [0, nk) of src (row stride D) padded to Dp columns: dst (nk, Dp), zero past D. */
static inline void FN(rm_pack_rows)(const RM_T *restrict src, int64_t nk, int64_t D, int64_t Dp,
                                    RM_T *restrict dst) {
    for (int64_t j = 0; j < nk; j++) {
        memcpy(dst + j * Dp, src + j * D, (size_t)D * sizeof(RM_T));
        for (int64_t d = D; d < Dp; d++) dst[j * Dp + d] = 0;
    }
}
