/* The reproducible kernels' shared arithmetic (issue 40): included by kernels/cpu_reproducible.c
 * (the forward's two passes) and kernels/cpu_reproducible_backward.c (the backward's tile).
 *
 * What both need to give the numpy oracles' bits (ringmpi/reproducible.py) on every ISA path:
 * the checks that the compiler evaluates float64 as float64 (no -ffast-math, no x87 excess
 * precision; ringmpi/cpu/fused_reproducible.py adds -ffp-contract=off -fno-fast-math after
 * $RINGMPI_CFLAGS, so no multiply and add is fused), the ISA path's name, 8-lane float64
 * vectors, det_exp (rmr_exp8), det_tanh (rmr_tanh8), the score modifiers (rmr_mod8: softcap
 * and ALiBi, with softcap's derivative for the backward) and the fold of a summand into its grid
 * sums (RMR_FOLD, rmr_fold8). The build hashes this header with each source that includes it
 * (ringmpi/cpu/build.py, kernel_sources), so a change here rebuilds both kernels.
 *
 * rmr_exp8 (t <= 0, or NaN): 0 for t < -345 (far below the last fold's quantum: such a weight
 * never reaches a sum); otherwise n = round(t / ln 2) by the 1.5 * 2^52 trick,
 * r = (t - n ln2_hi) - n ln2_lo (ln2_hi has 32 significant bits, so n ln2_hi is exact), a
 * degree-12 Taylor polynomial in r by Horner's rule (|r| <= 0.347: truncation below 2e-16
 * relative), times 2^n built from the exponent bits (a normal number: exact). No libm call:
 * libm's exp may pick another code path on another CPU (glibc selects FMA variants at run
 * time), and numpy's np.exp has SIMD loops per CPU feature set. The backward also feeds it
 * t slightly above 0 (its lse is rounded): the exponent bits stay exact up to n = 1023
 * (t < 709), and up to there the result is det_exp's.
 */
#ifndef RINGMPI_CPU_REPRODUCIBLE_MATH_H
#define RINGMPI_CPU_REPRODUCIBLE_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __FAST_MATH__
#error "the reproducible kernels must be compiled without -ffast-math"
#endif
/* 0: float and double evaluate in their own precision (16: the same, with _Float16 promoted) */
#if defined(__FLT_EVAL_METHOD__) && __FLT_EVAL_METHOD__ != 0 && __FLT_EVAL_METHOD__ != 16
#error "the reproducible kernels need float64 without excess precision (FLT_EVAL_METHOD 0)"
#endif

#if (defined(__i386__) || defined(__x86_64__)) && !defined(__SSE2_MATH__)
#error "the reproducible kernels need SSE2 float64 arithmetic (not the x87's 80-bit registers)"
#endif

#if defined(__AVX512F__)
#define RMR_ISA "avx512"
#define RMR_WIDTH 64
#elif defined(__AVX2__) && defined(__FMA__)
#define RMR_ISA "avx2"
#define RMR_WIDTH 32
#else
#define RMR_ISA "scalar"
#define RMR_WIDTH 0
#endif

/* 8 float64 lanes in GCC/Clang's generic vectors: one zmm on AVX-512, two ymm on AVX2, four
 * xmm on the scalar path; every operation is the lane-wise IEEE operation of the scalar code
 * (the vectors only say what to do side by side, the bits are the scalar code's). */
typedef double v8 __attribute__((vector_size(64), aligned(8)));
typedef int64_t v8i __attribute__((vector_size(64), aligned(8)));
typedef uint64_t v8u __attribute__((vector_size(64), aligned(8)));

typedef double v8m __attribute__((vector_size(64), aligned(8), may_alias)); /* unaligned */
static inline v8 ld8(const double *p) { return *(const v8m *)p; }
static inline void st8(double *p, v8 x) { *(v8m *)p = x; }
static inline v8 sel8(v8i mask, v8 a, v8 b) { /* mask lanes -1: a, 0: b */
    return (v8)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* Lane-wise comparisons of 8 lanes as masks (-1 true, 0 false), made on pieces of the
 * native vector width: GCC turns a comparison of whole 64-byte vectors into scalar compares
 * and lane inserts on AVX2 and SSE2 (measured: no vcmppd at all in the AVX2 build). The
 * same IEEE comparisons, lane by lane. */
#if defined(__AVX512F__)
#define RMR_PIECE 8
#elif defined(__AVX2__) && defined(__FMA__)
#define RMR_PIECE 4
#else
#define RMR_PIECE 2
#endif
typedef double rmr_pd __attribute__((vector_size(RMR_PIECE * 8), aligned(8), may_alias));
typedef int64_t rmr_pi __attribute__((vector_size(RMR_PIECE * 8), aligned(8), may_alias));
#define RMR_CMP8(name, type, piece, op)                                         \
    static inline v8i name(type a, type b) {                                    \
        v8i r;                                                                  \
        for (int o = 0; o < 8; o += RMR_PIECE)                                  \
            *(rmr_pi *)((int64_t *)&r + o) =                                    \
                (rmr_pi)(*(const piece *)((const char *)&a + 8 * o)             \
                             op * (const piece *)((const char *)&b + 8 * o));   \
        return r;                                                               \
    }
RMR_CMP8(lt8, v8, rmr_pd, <)
RMR_CMP8(gt8, v8, rmr_pd, >)
RMR_CMP8(ne8, v8, rmr_pd, !=)
RMR_CMP8(ige8, v8i, rmr_pi, >=)
RMR_CMP8(ile8, v8i, rmr_pi, <=)
#define RMR_SPLAT8(x) ((v8){(x), (x), (x), (x), (x), (x), (x), (x)})

/* the exp constants: ringmpi/reproducible.py (EXP_*) holds the same doubles */
#define RMR_SHIFT 0x1.8p52
#define RMR_INVLN2 0x1.71547652b82fep+0
#define RMR_LN2HI 0x1.62e42fee00000p-1
#define RMR_LN2LO 0x1.a39ef35793c76p-33
#define RMR_TMIN (-345.0)

static const double rmr_c[13] = {
    0x1.0000000000000p+0, 0x1.0000000000000p+0, 0x1.0000000000000p-1, 0x1.5555555555555p-3,
    0x1.5555555555555p-5, 0x1.1111111111111p-7, 0x1.6c16c16c16c17p-10, 0x1.a01a01a01a01ap-13,
    0x1.a01a01a01a01ap-16, 0x1.71de3a556c734p-19, 0x1.27e4fb7789f5cp-22, 0x1.ae64567f544e4p-26,
    0x1.1eed8eff8d898p-29,
};

/* fma(a, b, c) rounded once to float32 (IEEE 754 fusedMultiplyAdd): the instruction where the
 * path has it; else a b exactly in float64 (24 + 24 bits), s = a b + c and its error e exactly
 * (TwoSum), s rounded to odd where e != 0 (its neighbour toward e when its last bit is even),
 * then to float32: the correctly rounded value (53 >= 24 + 2 bits), as
 * reproducible_float32.fma32 computes it. */
static inline float rmr_fmaf(float a, float b, float c) {
#if defined(__FMA__)
    return __builtin_fmaf(a, b, c);
#else
    const double p = (double)a * (double)b, cc = (double)c;
    const double s = p + cc, bb = s - p;
    const double e = (p - (s - bb)) + (cc - bb);
    if (e != 0 && s - s == 0) {
        int64_t bits;
        memcpy(&bits, &s, sizeof bits);
        if (!(bits & 1)) {
            bits += ((e > 0) == (s > 0)) ? 1 : -1;
            double t;
            memcpy(&t, &bits, sizeof t);
            return (float)t;
        }
    }
    return (float)s;
#endif
}

/* Fold x into the row sums acc[f] (f < folds) on the grids c[f]: hi = (x + c) - c exact. */
#define RMR_FOLD(x, cf, accf)                     \
    do {                                          \
        double hi_ = ((x) + (cf)) - (cf);         \
        (accf) += hi_;                            \
        (x) = (x) - hi_;                          \
    } while (0)

/* The range reduction of rmr_exp8 and rmr_tanh8 (reproducible.det_exp's first steps): t
 * clamped at RMR_TMIN and NaN lanes computed on 0, kk = t / ln2 + shift (its significand
 * holds 2^51 + n exactly, n = round(t / ln2) in [-1022, 0]), r = (t - n ln2_hi) - n ln2_lo;
 * *two_n = 2^n from kk's bits ((kk - shift) + 1023) << 52, a normal number. Returns r. */
static inline v8 rmr_reduce8(v8 t, v8 *two_n) {
    const v8 tmin = {RMR_TMIN, RMR_TMIN, RMR_TMIN, RMR_TMIN, RMR_TMIN, RMR_TMIN, RMR_TMIN,
                     RMR_TMIN};
    const v8 zero = {0};
    v8 tc = sel8(lt8(t, tmin), tmin, t);
    tc = sel8(ne8(tc, tc), zero, tc);
    const v8 kk = tc * RMR_INVLN2 + RMR_SHIFT;
    const v8 n = kk - RMR_SHIFT;
    const double shift = RMR_SHIFT;
    uint64_t sb;
    memcpy(&sb, &shift, sizeof sb);
    *two_n = (v8)((((v8u)kk - sb) + 1023) << 52);
    return (tc - n * RMR_LN2HI) - n * RMR_LN2LO;
}

/* exp(t) for t <= 0 or NaN on 8 lanes (see the header): the same operations as
 * reproducible.det_exp, lane by lane: 2^n P(r), P the degree-12 Taylor polynomial of e^r
 * (rmr_c, Horner); 0 below RMR_TMIN, NaN lanes returned as they are. */
static inline v8 rmr_exp8(v8 t) {
    const v8 tmin = {RMR_TMIN, RMR_TMIN, RMR_TMIN, RMR_TMIN, RMR_TMIN, RMR_TMIN, RMR_TMIN,
                     RMR_TMIN};
    const v8 zero = {0};
    v8 two_n;
    const v8 r = rmr_reduce8(t, &two_n);
    v8 p = rmr_c[12] * r + rmr_c[11];
    for (int i = 10; i >= 0; i--) p = p * r + rmr_c[i];
    const v8 y = p * two_n;
    return sel8(lt8(t, tmin), zero, sel8(ne8(t, t), t, y));
}

/* tanh(x) on 8 lanes: the same operations as reproducible.det_tanh, lane by lane. With
 * t = -2|x|, n and r as in rmr_reduce8, u = e^t - 1 = (2^n - 1) + 2^n (r Q(r)) with Q the
 * Taylor polynomial of (e^r - 1) / r (rmr_c[1..12], Horner): for |t| < ln2 / 2, n = 0 and
 * u = r Q(r), so small |x| keep their relative precision. Then tanh|x| = -u / (2 + u), and
 * x's sign by a bit copy (exact). */
static inline v8 rmr_tanh8(v8 x) {
    const uint64_t sgn = UINT64_C(1) << 63;
    const v8 ax = (v8)((v8u)x & ~sgn);
    v8 two_n;
    const v8 r = rmr_reduce8(-2.0 * ax, &two_n);
    v8 p = rmr_c[12] * r + rmr_c[11];
    for (int i = 10; i >= 1; i--) p = p * r + rmr_c[i];
    const v8 u = (two_n - 1.0) + two_n * (r * p);
    v8 y = (-u) / (2.0 + u);
    y = sel8(ne8(x, x), x, y);
    return (v8)(((v8u)y & ~sgn) | ((v8u)x & sgn));
}

/* The score modifiers on 8 scaled scores x of one row (reproducible.modify and
 * reproducible_backward.modify_batched, the same operations): softcap (mods bit 0)
 * t = tanh(x * icap), x = cap * t, icap = 1 / cap rounded once by the caller (no division per
 * score); ALiBi (bit 1) x = x - slope * |qd - kd|, qd and kd the row's and the keys'
 * positions as doubles: exact below 2^53, and so is their difference, the value of numpy's
 * integer distance converted; the product rounded once. dm (may be NULL): softcap's
 * derivative 1 - t t (the backward's factor of dS; left alone without softcap). */
static inline v8 rmr_mod8(v8 x, int64_t mods, double cap, double icap, double slope,
                          double qd, v8 kd, v8 *dm) {
    if (mods & 1) {
        const v8 t = rmr_tanh8(x * icap);
        x = cap * t;
        if (dm) *dm = 1.0 - t * t;
    }
    if (mods & 2) {
        const uint64_t sgn = UINT64_C(1) << 63;
        const v8 d = (v8)((v8u)(qd - kd) & ~sgn); /* |qa - k|: exact */
        x = x - slope * d;
    }
    return x;
}

/* Fold the 8 lanes x into the sums o[f][0..7] on the grids c[f][0..7] */
static inline void rmr_fold8(v8 x, int64_t folds, double *o, int64_t ostride, const double *c,
                             int64_t cstride) {
    for (int64_t f = 0; f < folds; f++) {
        const v8 cf = ld8(c + f * cstride);
        const v8 hi = (x + cf) - cf;
        st8(o + f * ostride, ld8(o + f * ostride) + hi);
        x = x - hi;
    }
}

#endif /* RINGMPI_CPU_REPRODUCIBLE_MATH_H */
