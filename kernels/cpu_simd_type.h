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
 * FN(rm_pack_rows)), FN(rm_tanh) and the score modifiers of ringmpi.scoremods, the one hook
 * both kernels call (RM_NMODS and the slots, FN(rm_mods_load), FN(rm_mods_row)).
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
#undef V_LOADN
#undef V_TR
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
#define V_LOADN vf_loadn
#define V_TR vf_tr
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
#define V_LOADN vd_loadn
#define V_TR vd_tr
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

/* ---------------------------------------------------------------- score modifiers ---
 * The score modifiers of ringmpi.scoremods (the registry; its docstring), applied to the
 * scaled scores s = scale q.k before the mask, in slot order. The kernels receive them as
 * (mods, mparam, mpos): the bits of the active slots, the parameters (H, RM_NMODS) float64
 * row-major (mparam[h * RM_NMODS + slot]; NULL when mods == 0), the query rows' positions
 * in key coordinates (Sq,) int64 (NULL unless a position slot is active). The kernels
 * know only this hook: FN(rm_mods_load) (a query head's parameters, once per head),
 * FN(rm_mods_row) (one row of scores, optionally with the derivative d s'/d s) and the
 * masks below; a new modifier is a slot here (its #define, RM_MODS_ALL, its field in
 * FN(rm_mods), its load and its row math) and in ringmpi/scoremods.py. */
#ifndef RM_MODS_SLOTS
#define RM_MODS_SLOTS
#define RM_NMODS 4       /* columns of mparam: ringmpi.scoremods.NMODS */
#define RM_MOD_SOFTCAP 0 /* s = cap tanh(s / cap); d s'/d s = 1 - tanh^2 */
#define RM_MOD_ALIBI 1   /* s -= slope_h |mpos[i] - kpos[j]|; d s'/d s = 1 */
#define RM_MOD_ON(bits, slot) (((bits) >> (slot)) & 1u)
/* the slots this build implements (rm_tile_mods, rm_backward_mods report them) */
#define RM_MODS_ALL ((1u << RM_MOD_SOFTCAP) | (1u << RM_MOD_ALIBI))
/* the slots whose derivative is not 1 (the backward then keeps a row of d s'/d s) */
#define RM_MODS_DERIV (1u << RM_MOD_SOFTCAP)
#endif

/* One query head's modifiers: the active slots (bits) and their parameters in RM_T. */
typedef struct {
    unsigned bits;
    RM_T cap, icap; /* RM_MOD_SOFTCAP: the cap and 1 / cap */
    double slope;   /* RM_MOD_ALIBI: the head's slope (the product is taken in double) */
} FN(rm_mods);

/* Query head h's modifiers from (mods, mparam). A slot that is the identity for this head
 * is dropped (ALiBi with slope 0; a cap that rounds to 0 in RM_T, which was never applied),
 * so a head whose bits are 0 takes the kernels' plain path: the same results (the maxima are
 * exact, exp(s - l) the same operations), less work. */
static inline FN(rm_mods) FN(rm_mods_load)(unsigned mods, const double *mparam, int64_t h) {
    FN(rm_mods) m = {0, 0, 0, 0};
    mods &= RM_MODS_ALL;
    if (!mods || !mparam) return m;
    const double *p = mparam + h * RM_NMODS;
    if (RM_MOD_ON(mods, RM_MOD_SOFTCAP) && (RM_T)p[RM_MOD_SOFTCAP] > 0) {
        m.bits |= 1u << RM_MOD_SOFTCAP;
        m.cap = (RM_T)p[RM_MOD_SOFTCAP];
        m.icap = (RM_T)1 / m.cap;
    }
    if (RM_MOD_ON(mods, RM_MOD_ALIBI) && p[RM_MOD_ALIBI] != 0) {
        m.bits |= 1u << RM_MOD_ALIBI;
        m.slope = p[RM_MOD_ALIBI];
    }
    return m;
}

/* One slot's derivative factor d into one vector of the product dc: stored when it is the
 * first (so one slot alone gives its own factor's bits), else multiplied in. */
static inline void FN(rm_mods_dc)(RM_T *restrict dc, RM_V d, int first) {
    V_STORE(dc, first ? d : V_MUL(V_LOAD(dc), d));
}

/* The modifiers m on one row of scores, in slot order. Elementwise slots map the columns
 * [c0, c1) (whole vectors, c0 a multiple of RM_W; columns past the real keys are
 * overwritten by the mask later); position slots the columns [c0, ja) (the real keys, kq[j]
 * the position of column j) of a real row: ap points at the row's position (NULL: a padding
 * row, or no positions). dc, when not NULL, gets the product of the slots' derivatives
 * d s'/d s at [c0, c1) when some slot of RM_MODS_DERIV is active (else it is not written;
 * the other slots' factor is 1). */
static inline void FN(rm_mods_row)(const FN(rm_mods) *m, RM_T *restrict row, RM_T *restrict dc,
                                   int64_t c0, int64_t c1, int64_t ja,
                                   const int64_t *restrict kq, const int64_t *ap) {
    int first = 1; /* dc holds no factor yet */
    if (RM_MOD_ON(m->bits, RM_MOD_SOFTCAP)) { /* s -> cap tanh(s / cap), factor 1 - tanh^2 */
        const RM_V vc = V_SET1(m->cap), vic = V_SET1(m->icap), one = V_SET1((RM_T)1);
        for (int64_t j = c0; j < c1; j += RM_W) {
            const RM_V t = FN(rm_tanh)(V_MUL(V_LOAD(row + j), vic));
            if (dc) FN(rm_mods_dc)(dc + j, V_SUB(one, V_MUL(t, t)), first);
            V_STORE(row + j, V_MUL(vc, t));
        }
        first = 0;
    }
    if (RM_MOD_ON(m->bits, RM_MOD_ALIBI) && ap) {
        /* s -= slope |a - kq[j]|: the product in double, rounded once to RM_T (as the numpy
         * tile), then subtracted */
        const int64_t a = *ap;
        const double slope = m->slope;
        for (int64_t j = c0; j < ja; j++) {
            const int64_t dist = a > kq[j] ? a - kq[j] : kq[j] - a;
            row[j] -= (RM_T)(slope * (double)dist);
        }
    }
    (void)first;
}

/* Rows [0, nk) of src (row stride D) as transposed panels of kw columns: dst (np, D, kw)
 * row-major, np = ceil(nk / kw), so one vector load gives kw / RM_W consecutive rows of one
 * feature; zero past nk. Vector paths (kw a multiple of RM_W): blocks of RM_W rows x RM_W
 * features are loaded as vectors (a partial block: the features past D not read, the rows
 * past nk zero vectors), transposed in registers (V_TR) and stored as RM_W panel rows; the
 * scalar path copies element by element. Data movement only: the same values either way. */
static inline void FN(rm_pack_panels)(const RM_T *restrict src, int64_t nk, int64_t D,
                                      int64_t kw, RM_T *restrict dst) {
    const int64_t np = (nk + kw - 1) / kw;
    for (int64_t p = 0; p < np; p++) {
        RM_T *pd = dst + p * D * kw;
        const RM_T *ps = src + p * kw * D;
        const int64_t nc = nk - p * kw < kw ? nk - p * kw : kw;
#if RM_W == 1
        for (int64_t d = 0; d < D; d++) {
            for (int64_t c = 0; c < nc; c++) pd[d * kw + c] = ps[c * D + d];
            for (int64_t c = nc; c < kw; c++) pd[d * kw + c] = 0;
        }
#else
        for (int64_t c0 = 0; c0 < kw; c0 += RM_W) {
            const int64_t nr = nc - c0; /* real rows of this block (<= 0: none) */
            for (int64_t d0 = 0; d0 < D; d0 += RM_W) {
                const int nd = D - d0 < RM_W ? (int)(D - d0) : RM_W;
                RM_V r[RM_W];
#pragma GCC unroll 16
                for (int i = 0; i < RM_W; i++)
                    r[i] = i >= nr       ? V_ZERO()
                           : nd == RM_W ? V_LOAD(ps + (c0 + i) * D + d0)
                                        : V_LOADN(ps + (c0 + i) * D + d0, nd);
                V_TR(r);
#pragma GCC unroll 16
                for (int i = 0; i < RM_W; i++)
                    if (i < nd) V_STORE(pd + (d0 + i) * kw + c0, r[i]);
            }
        }
#endif
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
