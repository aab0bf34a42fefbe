/* The SIMD layer of the fused CPU kernels (kernels/cpu_tile.c, kernels/cpu_backward.c).
 *
 * Included once by each kernel before its type-generic part. Per element type, one vector
 * type and the operations the kernels use, for the ISA path the file is compiled for
 * (ringmpi/cpu/isa.py sets the flags: AVX-512F 16 float32 lanes, AVX2 + FMA 8 lanes, or
 * the plain C path of one element, "scalar"):
 *
 *   float32  vf, VF_W lanes:  vf_load, vf_store, vf_set1, vf_zero, vf_fma, vf_add, vf_sub,
 *            vf_mul, vf_div, vf_max, vf_hmax, vf_hsum, vf_nan0 (NaN -> 0), vf_abs,
 *            vf_sign, vf_or, vf_sellt, and vf_exp; vf_sum: the type of the row sums;
 *            vector paths also vf_loadn (a partial load) and vf_tr (a W x W transpose)
 *   float64  vd, VD_W lanes:  the same with vd_ (vd_sum is vd)
 *
 * and the register blocking per ISA (RM_ISA_R, RM_ISA_NK, RM_ISA_NV), the ISA's name and
 * width, the software prefetch, and the coefficients of tanh's Taylor series.
 * kernels/cpu_simd_type.h maps these names to one element type (V_LOAD, ..., RM_T) for a
 * kernel's type-generic part; kernels/cpu_blocks.h holds the block and mask bookkeeping.
 *
 * exp: 2^t with t = x log2(e). float32: n = floor(t), f = t - n in [0, 1], 2^f by a degree-6
 * minimax polynomial (4e-9 relative); float64: n = round(t), |f| <= 1/2, a degree-12 Taylor
 * polynomial (truncation below 3e-16 relative). Times 2^n by vscalef (AVX-512) or by building
 * the exponent bits (AVX2); results below the smallest normal number are 0 on both. x = -inf
 * gives exactly 0; NaN propagates. The scalar path calls libm's expf/exp. Every vector
 * operation here is the same sequence of IEEE operations on AVX2 and AVX-512, and the
 * horizontal sums add in one fixed order on both: with the same blocking of the work, the two
 * paths give the same bits (the kernels' comments say where they rely on it).
 * Compiled without -ffast-math, so inf and NaN keep their IEEE meaning everywhere.
 */
#ifndef RM_CPU_SIMD_H
#define RM_CPU_SIMD_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Register blocking per ISA: query rows (or keys) per strip RM_ISA_R; vectors per register
 * tile RM_ISA_NK (products reducing over D: S = Q K^T, dP = dO V^T) and RM_ISA_NV (products
 * reducing over keys or rows: P V, dS K, P^T dO, dS^T Q). R x NK accumulators, plus NK loaded
 * vectors and one broadcast, must fit the register file without spills.
 *   AVX-512 (32 zmm): 6 x 4 = 24 accumulators.
 *   AVX2 (16 ymm): 6 x 2 = 12 accumulators + 2 loads + 1 broadcast = 15 registers; the 12
 *   independent FMA chains cover FMA latency x throughput (4 x 2 on Zen 2-4, 5 x 2 on Intel).
 *   Scalar: 4 x 4 (measured within 5% of 6 x 4 and 6 x 2). */
#if defined(__AVX512F__)
#define RM_ISA_R 6
#define RM_ISA_NK 4
#define RM_ISA_NV 4
#elif defined(__AVX2__) && defined(__FMA__)
#define RM_ISA_R 6
#define RM_ISA_NK 2
#define RM_ISA_NV 2
#else
#define RM_ISA_R 4
#define RM_ISA_NK 4
#define RM_ISA_NV 4
#endif

/* The ISA path this file was compiled for (the names ringmpi/cpu/isa.py uses) and its
 * vector width in bytes (0: scalar). */
static inline const char *rm_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "scalar";
#endif
}

static inline int rm_simd_bytes(void) {
#if defined(__AVX512F__)
    return 64;
#elif defined(__AVX2__) && defined(__FMA__)
    return 32;
#else
    return 0;
#endif
}

/* Software prefetch into L1, RM_PF iterations ahead, of the panels and rows that the
 * register tiles stream from L2 (+2-5% measured over the hardware prefetchers alone).
 * A prefetch past the end of a buffer is harmless: it never faults. */
#ifndef RM_PF
#define RM_PF 16
#endif
#define RM_PREFETCH(p) __builtin_prefetch((p), 0, 3)

/* Horizontal sums in one fixed order for both vector ISAs: a 512-bit vector adds its two
 * 256-bit halves, then the 256-bit tree below, so that (with the row sums kept per 64 bytes,
 * see rm_softmax) AVX2 and AVX-512 add the same numbers in the same order. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
static inline float rm_hsum8f(__m256 x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}
static inline double rm_hsum4d(__m256d x) {
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    h = _mm_add_sd(h, _mm_unpackhi_pd(h, h));
    return _mm_cvtsd_f64(h);
}
#endif

/* ------------------------------------------------------------ float32 vector layer --- */
#if defined(__AVX512F__)
typedef __m512 vf;
typedef vf vf_sum; /* row sums of rm_softmax */
#define VF_W 16
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_set1 _mm512_set1_ps
#define vf_zero _mm512_setzero_ps
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_mul _mm512_mul_ps
#define vf_div _mm512_div_ps
#define vf_max _mm512_max_ps
#define vf_hmax _mm512_reduce_max_ps
#define vf_nan0(x) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask((x), (x), _CMP_ORD_Q), (x))
/* |x|, x's sign bit alone, a | b (bits), and lt ? a : b with lt = (x < y) */
#define vf_abs(x) \
    _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(INT32_MIN), _mm512_castps_si512(x)))
#define vf_sign(x) \
    _mm512_castsi512_ps(_mm512_and_si512(_mm512_set1_epi32(INT32_MIN), _mm512_castps_si512(x)))
#define vf_or(a, b) \
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)))
#define vf_sellt(x, y, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), (y), _CMP_LT_OQ), (b), (a))
static inline float vf_hsum(vf x) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    return rm_hsum8f(_mm256_add_ps(_mm512_castps512_ps256(x), hi));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
typedef vf vf_sum;
#define VF_W 8
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_set1 _mm256_set1_ps
#define vf_zero _mm256_setzero_ps
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_mul _mm256_mul_ps
#define vf_div _mm256_div_ps
#define vf_max _mm256_max_ps
#define vf_nan0(x) _mm256_and_ps(_mm256_cmp_ps((x), (x), _CMP_ORD_Q), (x))
#define vf_abs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (x))
#define vf_sign(x) _mm256_and_ps(_mm256_set1_ps(-0.0f), (x))
#define vf_or _mm256_or_ps
#define vf_sellt(x, y, a, b) _mm256_blendv_ps((b), (a), _mm256_cmp_ps((x), (y), _CMP_LT_OQ))
static inline float vf_hmax(vf x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}
#define vf_hsum rm_hsum8f
#else
typedef float vf;
/* one lane: a row's sum of up to Bk terms is one chain; in double its rounding stays below
 * that of the vector paths' (Bk / W terms a lane, then a tree) */
typedef double vf_sum;
#define VF_W 1
#define vf_load(p) (*(p))
#define vf_store(p, x) (*(p) = (x))
#define vf_set1(x) (x)
#define vf_zero() 0.0f
#define vf_fma(a, b, c) ((float)((double)(a) * (double)(b) + (double)(c)))
#define vf_add(a, b) ((a) + (b))
#define vf_sub(a, b) ((a) - (b))
#define vf_mul(a, b) ((a) * (b))
#define vf_div(a, b) ((a) / (b))
#define vf_max(a, b) ((a) > (b) ? (a) : (b))
#define vf_hmax(x) (x)
#define vf_hsum(x) (x)
#define vf_nan0(x) ((x) == (x) ? (x) : 0.0f)
#endif

/* exp(x) for x <= 0 (x = -inf -> 0, NaN -> NaN). */
static inline vf vf_exp(vf x) {
#if VF_W == 1
    return expf(x);
#elif defined(__AVX512F__)
    /* t = x log2(e); n = floor(t), f = t - n in [0, 1] rounded to nearest (vreduceps would
     * save an operation but rounds f down, which AVX2 cannot reproduce); 2^f by a degree-6
     * minimax polynomial (relative error 4e-9, c0 = 1 so exp(0) = 1); vscalefps multiplies
     * by 2^n. Results below the smallest normal number (t < -126, x = -inf included) are
     * zeroed as on AVX2; NaN propagates (the compare is false for it). */
    vf t = vf_mul(x, vf_set1(1.44269504088896341f));
    const __mmask16 normal = _mm512_cmp_ps_mask(t, vf_set1(-126.0f), _CMP_NLT_UQ);
    vf n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    vf f = _mm512_sub_ps(t, n);
    vf p = vf_fma(vf_set1(2.170223015e-04f), f, vf_set1(1.243969542e-03f));
    p = vf_fma(p, f, vf_set1(9.678840637e-03f));
    p = vf_fma(p, f, vf_set1(5.548334122e-02f));
    p = vf_fma(p, f, vf_set1(2.402298301e-01f));
    p = vf_fma(p, f, vf_set1(6.931470037e-01f));
    p = vf_fma(p, f, vf_set1(1.0f));
    return _mm512_maskz_scalef_ps(normal, p, n);
#else
    /* The AVX-512 scheme with AVX2 instructions, operation for operation: t = x log2(e),
     * n = floor(t), f = t - n in [0, 1], 2^f by the same minimax polynomial, 2^n built in the
     * exponent bits. t is clamped at -127 first (max keeps a NaN t: it returns its second
     * operand when either is NaN): n = -127 gives the bit pattern of +0.0, so exp(x) = 0 for
     * t < -126 (below the smallest normal number) and x = -inf gives 0; a NaN x gives a NaN
     * polynomial and stays NaN whatever its exponent bits. */
    vf t = _mm256_max_ps(vf_set1(-127.0f), vf_mul(x, vf_set1(1.44269504088896341f)));
    vf n = _mm256_floor_ps(t);
    vf f = _mm256_sub_ps(t, n);
    vf p = vf_fma(vf_set1(2.170223015e-04f), f, vf_set1(1.243969542e-03f));
    p = vf_fma(p, f, vf_set1(9.678840637e-03f));
    p = vf_fma(p, f, vf_set1(5.548334122e-02f));
    p = vf_fma(p, f, vf_set1(2.402298301e-01f));
    p = vf_fma(p, f, vf_set1(6.931470037e-01f));
    p = vf_fma(p, f, vf_set1(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
#endif
}

/* ------------------------------------------------------------ float64 vector layer --- */
#if defined(__AVX512F__)
typedef __m512d vd;
#define VD_W 8
#define vd_load _mm512_loadu_pd
#define vd_store _mm512_storeu_pd
#define vd_set1 _mm512_set1_pd
#define vd_zero _mm512_setzero_pd
#define vd_fma(a, b, c) _mm512_fmadd_pd(a, b, c)
#define vd_add _mm512_add_pd
#define vd_sub _mm512_sub_pd
#define vd_mul _mm512_mul_pd
#define vd_div _mm512_div_pd
#define vd_max _mm512_max_pd
#define vd_hmax _mm512_reduce_max_pd
#define vd_nan0(x) _mm512_maskz_mov_pd(_mm512_cmp_pd_mask((x), (x), _CMP_ORD_Q), (x))
#define vd_abs(x) \
    _mm512_castsi512_pd(_mm512_andnot_si512(_mm512_set1_epi64(INT64_MIN), _mm512_castpd_si512(x)))
#define vd_sign(x) \
    _mm512_castsi512_pd(_mm512_and_si512(_mm512_set1_epi64(INT64_MIN), _mm512_castpd_si512(x)))
#define vd_or(a, b) \
    _mm512_castsi512_pd(_mm512_or_si512(_mm512_castpd_si512(a), _mm512_castpd_si512(b)))
#define vd_sellt(x, y, a, b) _mm512_mask_blend_pd(_mm512_cmp_pd_mask((x), (y), _CMP_LT_OQ), (b), (a))
static inline double vd_hsum(vd x) {
    return rm_hsum4d(_mm256_add_pd(_mm512_castpd512_pd256(x), _mm512_extractf64x4_pd(x, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256d vd;
#define VD_W 4
#define vd_load _mm256_loadu_pd
#define vd_store _mm256_storeu_pd
#define vd_set1 _mm256_set1_pd
#define vd_zero _mm256_setzero_pd
#define vd_fma(a, b, c) _mm256_fmadd_pd(a, b, c)
#define vd_add _mm256_add_pd
#define vd_sub _mm256_sub_pd
#define vd_mul _mm256_mul_pd
#define vd_div _mm256_div_pd
#define vd_max _mm256_max_pd
#define vd_nan0(x) _mm256_and_pd(_mm256_cmp_pd((x), (x), _CMP_ORD_Q), (x))
#define vd_abs(x) _mm256_andnot_pd(_mm256_set1_pd(-0.0), (x))
#define vd_sign(x) _mm256_and_pd(_mm256_set1_pd(-0.0), (x))
#define vd_or _mm256_or_pd
#define vd_sellt(x, y, a, b) _mm256_blendv_pd((b), (a), _mm256_cmp_pd((x), (y), _CMP_LT_OQ))
static inline double vd_hmax(vd x) {
    __m128d h = _mm_max_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    h = _mm_max_sd(h, _mm_unpackhi_pd(h, h));
    return _mm_cvtsd_f64(h);
}
#define vd_hsum rm_hsum4d
#else
typedef double vd;
#define VD_W 1
#define vd_load(p) (*(p))
#define vd_store(p, x) (*(p) = (x))
#define vd_set1(x) (x)
#define vd_zero() 0.0
#define vd_fma(a, b, c) ((a) * (b) + (c))
#define vd_add(a, b) ((a) + (b))
#define vd_sub(a, b) ((a) - (b))
#define vd_mul(a, b) ((a) * (b))
#define vd_div(a, b) ((a) / (b))
#define vd_max(a, b) ((a) > (b) ? (a) : (b))
#define vd_hmax(x) (x)
#define vd_hsum(x) (x)
#define vd_nan0(x) ((x) == (x) ? (x) : 0.0)
#endif

static inline vd vd_exp(vd x) {
#if VD_W == 1
    return exp(x);
#else
    /* Taylor coefficients ln2^k / k!, k = 0..12 */
    static const double c[13] = {1.0,
                                 0.6931471805599453,
                                 0.2402265069591007,
                                 5.550410866482158e-2,
                                 9.618129107628477e-3,
                                 1.3333558146428443e-3,
                                 1.5403530393381608e-4,
                                 1.5252733804059841e-5,
                                 1.3215486790144307e-6,
                                 1.0178086009239699e-7,
                                 7.054911620801123e-9,
                                 4.445538271870811e-10,
                                 2.567843599348821e-11};
#if defined(__AVX512F__)
    vd t = _mm512_max_pd(vd_set1(-1100.0), vd_mul(x, vd_set1(1.4426950408889634)));
    vd n = _mm512_roundscale_pd(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vd f = _mm512_sub_pd(t, n);
#else
    vd t = _mm256_max_pd(vd_set1(-1023.0), vd_mul(x, vd_set1(1.4426950408889634)));
    vd n = _mm256_round_pd(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    vd f = _mm256_sub_pd(t, n);
#endif
    vd p = vd_set1(c[12]);
    for (int i = 11; i >= 0; i--) p = vd_fma(p, f, vd_set1(c[i]));
#if defined(__AVX512F__)
    /* zero below the normal range (n < -1022) as on AVX2; NaN propagates */
    const __mmask8 normal = _mm512_cmp_pd_mask(n, vd_set1(-1022.0), _CMP_NLT_UQ);
    return _mm512_maskz_scalef_pd(normal, p, n);
#else
    /* n >= -1023: biased exponent >= 0; n = -1023 gives the bit pattern of 0.0 */
    __m256i e = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n));
    e = _mm256_slli_epi64(_mm256_add_epi64(e, _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(p, _mm256_castsi256_pd(e));
#endif
#endif
}

/* ------------------------------------------------ transposes and partial loads --- *
 * vf_loadn / vd_loadn (p, n): the first n (0 < n <= W) elements at p, zeros past them (the
 * masked-out elements are not read: no fault past the end of an array). vf_tr / vd_tr (r):
 * the W x W block r[0..W) (W vectors of W lanes, row i = r[i]) transposed in place, by
 * lane shuffles only (the bits move, no arithmetic). Used to pack K^T panels. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
/* 4 x 4 transpose of the 128-bit lanes of x[0..4) (lane L of x[i] -> lane i of x[L]) */
static inline void rm_tr_lanes4(__m512 x[4]) {
    const __m512 v0 = _mm512_shuffle_f32x4(x[0], x[1], 0x44); /* x0[0] x0[1] x1[0] x1[1] */
    const __m512 v1 = _mm512_shuffle_f32x4(x[0], x[1], 0xEE); /* x0[2] x0[3] x1[2] x1[3] */
    const __m512 v2 = _mm512_shuffle_f32x4(x[2], x[3], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(x[2], x[3], 0xEE);
    x[0] = _mm512_shuffle_f32x4(v0, v2, 0x88); /* lanes 0 and 2 of each */
    x[1] = _mm512_shuffle_f32x4(v0, v2, 0xDD); /* lanes 1 and 3 of each */
    x[2] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    x[3] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
}
static inline vf vf_loadn(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline vd vd_loadn(const double *p, int n) {
    return _mm512_maskz_loadu_pd((__mmask8)((1u << n) - 1), p);
}
static inline void vf_tr(vf r[16]) {
    vf t[16];
    for (int i = 0; i < 16; i += 2) { /* lane L of t[i + k]: columns 4L + 2k, 4L + 2k + 1 */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int j = 0; j < 16; j += 4) { /* lane L of r[j + k]: column 4L + k of rows j..j+3 */
        const __m512d a = _mm512_castps_pd(t[j]), b = _mm512_castps_pd(t[j + 1]);
        const __m512d c = _mm512_castps_pd(t[j + 2]), d = _mm512_castps_pd(t[j + 3]);
        r[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int k = 0; k < 4; k++) { /* row 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k] */
        vf x[4] = {r[k], r[4 + k], r[8 + k], r[12 + k]};
        rm_tr_lanes4(x);
        for (int L = 0; L < 4; L++) t[4 * L + k] = x[L];
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}
static inline void vd_tr(vd r[8]) {
    vd t[8];
    for (int i = 0; i < 8; i += 2) { /* lane L of t[i + k]: column 2L + k of rows i, i + 1 */
        t[i] = _mm512_unpacklo_pd(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_pd(r[i], r[i + 1]);
    }
    for (int k = 0; k < 2; k++) { /* row 2L + k: lane L of t[k], t[2 + k], t[4 + k], t[6 + k] */
        __m512 x[4] = {_mm512_castpd_ps(t[k]), _mm512_castpd_ps(t[2 + k]),
                       _mm512_castpd_ps(t[4 + k]), _mm512_castpd_ps(t[6 + k])};
        rm_tr_lanes4(x);
        for (int L = 0; L < 4; L++) r[2 * L + k] = _mm512_castps_pd(x[L]);
    }
}
#else
static inline vf vf_loadn(const float *p, int n) {
    const __m256i i = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), i);
    return _mm256_maskload_ps(p, m);
}
static inline vd vd_loadn(const double *p, int n) {
    const __m256i m = _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
    return _mm256_maskload_pd(p, m);
}
static inline void vf_tr(vf r[8]) {
    vf t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int j = 0; j < 8; j += 4) { /* lane L of r[j + k]: column 4L + k of rows j..j+3 */
        r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
        r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
        r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
        r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) { /* row 4L + k: lane L of r[k], r[4 + k] */
        t[k] = _mm256_permute2f128_ps(r[k], r[4 + k], 0x20);
        t[4 + k] = _mm256_permute2f128_ps(r[k], r[4 + k], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}
static inline void vd_tr(vd r[4]) {
    vd t[4];
    for (int i = 0; i < 4; i += 2) { /* lane L of t[i + k]: column 2L + k of rows i, i + 1 */
        t[i] = _mm256_unpacklo_pd(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_pd(r[i], r[i + 1]);
    }
    for (int k = 0; k < 2; k++) { /* row 2L + k: lane L of t[k], t[2 + k] */
        r[k] = _mm256_permute2f128_pd(t[k], t[2 + k], 0x20);
        r[2 + k] = _mm256_permute2f128_pd(t[k], t[2 + k], 0x31);
    }
}
#endif
#endif

/* tanh's Taylor series x + sum_k c_k x^(2k+1), c_k = 2^(2k+2) (2^(2k+2) - 1) B_(2k+2) / (2k+2)!
 * (B: Bernoulli numbers); used for |x| below RM_TANH_X (see rm_tanh). */
static const double rm_tanh_c[12] = {1.0,
                                     -0.3333333333333333,
                                     0.13333333333333333,
                                     -0.05396825396825397,
                                     0.021869488536155203,
                                     -0.008863235529902197,
                                     0.003592128036572481,
                                     -0.0014558343870513183,
                                     0.000590027440945586,
                                     -0.00023912911424355248,
                                     9.691537956929451e-05,
                                     -3.927832388331683e-05};

#endif /* RM_CPU_SIMD_H */
