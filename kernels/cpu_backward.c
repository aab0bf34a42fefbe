/* Fused CPU attention backward tile: the gradients of one (query block, K/V block) pair.
 *
 * Loaded by ringmpi/cpu/fused_backward.py (compiled on first use, cached on disk). Same
 * semantics as ringmpi.cpu.numpy_tile.backward_tile, the specification. Internal layout, head-major:
 *
 *   q, dout (B, H, Sq, D)     k, v (B, Hkv, Sk, D)     query head h reads K/V head h / (H/Hkv)
 *   lse, delta (B, H, Sq)     saved log-sum-exp (-inf: row saw no key) and rowsum(dout * out)
 *   qpos (Sq,), kpos (Sk,)    int64 global token positions; causal: key j visible to query i
 *                             iff kpos[j] <= qpos[i]
 *   qlo, qhi (Sq,) or NULL    int64 per-row bounds (windows, packed sequences, cross): key j
 *                             visible to query i iff qlo[i] <= kpos[j] <= qhi[i] (causal is
 *                             then ignored: the bounds include it); qlo > qhi: no visible key
 *   dq (B, H, Sq, D), dk, dv (B, Hkv, Sk, D)   accumulators, updated in place
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
 * exp: 2^t with t = x log2(e). float32 on AVX-512: f = t - floor(t) in [0, 1) by vreduceps,
 * 2^f by a degree-6 minimax polynomial (4e-9 relative), 2^floor(t) by vscalefps. Elsewhere
 * t = n + f, n = round(t), |f| <= 1/2, 2^f by Taylor polynomials (degree 7 for float32, 12
 * for float64; truncation below 1e-8 resp. 3e-16 relative), 2^n by vscalef on AVX-512 or by
 * building the exponent bits on AVX2. The only other error is the rounding of t (relative
 * eps/2 of t, i.e. eps |x| / 2 relative in the result): the same as the forward tile's exp.
 * x = -inf gives exactly 0; NaN propagates. No -ffast-math: inf and NaN keep their meaning.
 *
 * The file includes itself twice to instantiate float32 and float64 (RB_T selects the type).
 */
#ifndef RB_T
/* ===================================================================== common part ==== */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define RB_ALIGN 64
#ifndef RB_PF
#define RB_PF 16 /* software prefetch distance (d steps) in the K^T / V^T panel loops */
#endif
#define RB_PREFETCH(p) __builtin_prefetch((p), 0, 3)
/* dK, dV of a key block are sums over every query row of the tile (all query heads of the
 * K/V head). Each query block's part is reduced from zero in registers (rb_outer) and added
 * to the block's accumulators; every RB_FLUSH query blocks these are added to dk, dv and
 * start again from zero. So no running total takes more than RB_FLUSH additions, and dk,
 * dv about Sq / (Bq RB_FLUSH) per call: the error stays that of a blocked dense product
 * instead of growing with the query count. */
#ifndef RB_FLUSH
#define RB_FLUSH 16
#endif

/* register tile: R rows (or keys) x NK vectors (S, dP) / NV vectors (dQ, dK, dV) */
#if defined(__AVX512F__)
#define RB_ISA_R 6
#define RB_ISA_N 4
#elif defined(__AVX2__) && defined(__FMA__)
#define RB_ISA_R 6
#define RB_ISA_N 2
#else
#define RB_ISA_R 4
#define RB_ISA_N 4
#endif
#ifndef RB_R
#define RB_R RB_ISA_R
#endif
#ifndef RB_NK
#define RB_NK RB_ISA_N
#endif
#ifndef RB_NV
#define RB_NV RB_ISA_N
#endif

typedef struct {
    int64_t a, b;   /* index range [a, b) */
    int64_t lo, hi; /* smallest and largest position inside */
    int inc;        /* positions strictly increasing inside the block */
} rb_block;

/* Split [0, n) into blocks of at most `size` indices that never straddle an entry of
 * `cuts` (ascending starts of runs of evenly spaced positions), with their position range.
 * Returns the number of blocks written to out (at most n). */
static int64_t rb_blocks(const int64_t *pos, int64_t n, const int64_t *cuts, int64_t ncuts,
                         int64_t size, rb_block *out) {
    int64_t nb = 0, c = 0;
    for (int64_t a = 0; a < n;) {
        while (c < ncuts && cuts[c] <= a) c++;
        const int64_t stop = c < ncuts && cuts[c] < n ? cuts[c] : n;
        const int64_t b = stop - a > size ? a + size : stop;
        rb_block blk = {a, b, pos[a], pos[a], 1};
        for (int64_t i = a + 1; i < b; i++) {
            if (pos[i] < blk.lo) blk.lo = pos[i];
            if (pos[i] > blk.hi) blk.hi = pos[i];
            if (pos[i] <= pos[i - 1]) blk.inc = 0;
        }
        out[nb++] = blk;
        a = b;
    }
    return nb;
}

/* Number of leading entries of the increasing array p[0..n) that are <= x. */
static int64_t rb_count_le(const int64_t *p, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (p[mid] <= x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Number of leading entries of the increasing array p[0..n) that are < x. */
static int64_t rb_count_lt(const int64_t *p, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (p[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int rb_cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Visible key range of query row i: [lo, hi] (bounds given), else (-inf, qpos] (causal) or
 * everything. */
static inline int64_t rb_row_lo(const int64_t *qlo, int64_t i) { return qlo ? qlo[i] : INT64_MIN; }
static inline int64_t rb_row_hi(const int64_t *qhi, const int64_t *qpos, int causal, int64_t i) {
    return qhi ? qhi[i] : causal ? qpos[i] : INT64_MAX;
}

/* Extremes of the rows' bounds over one query block. */
typedef struct {
    int64_t lo_min, lo_max, hi_min, hi_max;
} rb_range;

static void *rb_alloc(size_t bytes) {
    const size_t n = (bytes + RB_ALIGN - 1) / RB_ALIGN * RB_ALIGN;
    void *p = aligned_alloc(RB_ALIGN, n ? n : RB_ALIGN);
    if (p) memset(p, 0, n ? n : RB_ALIGN);
    return p;
}

/* This build takes the score modifiers (softcap, slopes, apos) of rm_backward_tile. */
int rm_backward_modifiers(void) { return 1; }

int rm_backward_simd_width_bytes(void) {
#if defined(__AVX512F__)
    return 64;
#elif defined(__AVX2__) && defined(__FMA__)
    return 32;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------ float32 vector layer --- */
#if defined(__AVX512F__)
typedef __m512 bvf;
#define BVF_W 16
#define bvf_load _mm512_loadu_ps
#define bvf_store _mm512_storeu_ps
#define bvf_set1 _mm512_set1_ps
#define bvf_zero _mm512_setzero_ps
#define bvf_fma _mm512_fmadd_ps
#define bvf_sub _mm512_sub_ps
#define bvf_add _mm512_add_ps
#define bvf_mul _mm512_mul_ps
#define bvf_nan0(x) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask((x), (x), _CMP_ORD_Q), (x))
/* for tanh: a / b, |x|, x's sign bit alone, a | b (bits), (x < y) ? a : b */
#define bvf_div _mm512_div_ps
#define bvf_abs(x) \
    _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(INT32_MIN), _mm512_castps_si512(x)))
#define bvf_sign(x) \
    _mm512_castsi512_ps(_mm512_and_si512(_mm512_set1_epi32(INT32_MIN), _mm512_castps_si512(x)))
#define bvf_or(a, b) \
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)))
#define bvf_sellt(x, y, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), (y), _CMP_LT_OQ), (b), (a))
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 bvf;
#define BVF_W 8
#define bvf_load _mm256_loadu_ps
#define bvf_store _mm256_storeu_ps
#define bvf_set1 _mm256_set1_ps
#define bvf_zero _mm256_setzero_ps
#define bvf_fma _mm256_fmadd_ps
#define bvf_sub _mm256_sub_ps
#define bvf_add _mm256_add_ps
#define bvf_mul _mm256_mul_ps
#define bvf_nan0(x) _mm256_and_ps(_mm256_cmp_ps((x), (x), _CMP_ORD_Q), (x))
#define bvf_div _mm256_div_ps
#define bvf_abs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (x))
#define bvf_sign(x) _mm256_and_ps(_mm256_set1_ps(-0.0f), (x))
#define bvf_or _mm256_or_ps
#define bvf_sellt(x, y, a, b) _mm256_blendv_ps((b), (a), _mm256_cmp_ps((x), (y), _CMP_LT_OQ))
#else
typedef float bvf;
#define BVF_W 1
#define bvf_load(p) (*(p))
#define bvf_store(p, x) (*(p) = (x))
#define bvf_set1(x) (x)
#define bvf_zero() 0.0f
#define bvf_fma(a, b, c) ((float)((double)(a) * (double)(b) + (double)(c)))
#define bvf_sub(a, b) ((a) - (b))
#define bvf_add(a, b) ((a) + (b))
#define bvf_mul(a, b) ((a) * (b))
#define bvf_nan0(x) ((x) == (x) ? (x) : 0.0f)
#define bvf_div(a, b) ((a) / (b))
#endif

/* exp(x), accurate for x <= 0 (the only arguments here: scores minus their log-sum-exp);
 * x = -inf -> 0, NaN -> NaN. */
static inline bvf bvf_exp(bvf x) {
#if BVF_W == 1
    return expf(x);
#elif defined(__AVX512F__)
    const bvf t = bvf_mul(x, bvf_set1(1.44269504088896341f));
    /* f = t - floor(t), exact; t = -inf gives f = 0 and scalef(p, -inf) = 0. Results
     * below the smallest normal number (t < -126) are zeroed: subnormal probabilities
     * would make every later FMA with them take a microcode assist (ALiBi's falling
     * scores put a wide band of keys there: 4x slower measured); NaN propagates. */
    const __mmask16 normal = _mm512_cmp_ps_mask(t, bvf_set1(-126.0f), _CMP_NLT_UQ);
    const bvf f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    bvf p = bvf_fma(bvf_set1(2.170223015e-04f), f, bvf_set1(1.243969542e-03f));
    p = bvf_fma(p, f, bvf_set1(9.678840637e-03f));
    p = bvf_fma(p, f, bvf_set1(5.548334122e-02f));
    p = bvf_fma(p, f, bvf_set1(2.402298301e-01f));
    p = bvf_fma(p, f, bvf_set1(6.931470037e-01f));
    p = bvf_fma(p, f, bvf_set1(1.0f));
    return _mm512_maskz_scalef_ps(normal, p, t);
#else
    /* t clamped at -127 (the result there is 0 anyway); the constant goes first so that
     * a NaN t is the operand max returns */
    const bvf t = _mm256_max_ps(bvf_set1(-127.0f), bvf_mul(x, bvf_set1(1.44269504088896341f)));
    const bvf n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const bvf f = bvf_sub(t, n);
    /* 2^f = sum_k (f ln2)^k / k!, Horner in f with c_k = ln2^k / k! */
    bvf p = bvf_fma(bvf_set1(1.5252733804059841e-5f), f, bvf_set1(1.5403530393381608e-4f));
    p = bvf_fma(p, f, bvf_set1(1.3333558146428443e-3f));
    p = bvf_fma(p, f, bvf_set1(9.618129107628477e-3f));
    p = bvf_fma(p, f, bvf_set1(5.550410866482158e-2f));
    p = bvf_fma(p, f, bvf_set1(0.2402265069591007f));
    p = bvf_fma(p, f, bvf_set1(0.6931471805599453f));
    p = bvf_fma(p, f, bvf_set1(1.0f));
    /* 2^n from its exponent bits; n = -127 gives the bits of +0.0 */
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return bvf_mul(p, _mm256_castsi256_ps(e));
#endif
}

/* ------------------------------------------------------------ float64 vector layer --- */
#if defined(__AVX512F__)
typedef __m512d bvd;
#define BVD_W 8
#define bvd_load _mm512_loadu_pd
#define bvd_store _mm512_storeu_pd
#define bvd_set1 _mm512_set1_pd
#define bvd_zero _mm512_setzero_pd
#define bvd_fma _mm512_fmadd_pd
#define bvd_sub _mm512_sub_pd
#define bvd_add _mm512_add_pd
#define bvd_mul _mm512_mul_pd
#define bvd_nan0(x) _mm512_maskz_mov_pd(_mm512_cmp_pd_mask((x), (x), _CMP_ORD_Q), (x))
#define bvd_div _mm512_div_pd
#define bvd_abs(x) \
    _mm512_castsi512_pd(_mm512_andnot_si512(_mm512_set1_epi64(INT64_MIN), _mm512_castpd_si512(x)))
#define bvd_sign(x) \
    _mm512_castsi512_pd(_mm512_and_si512(_mm512_set1_epi64(INT64_MIN), _mm512_castpd_si512(x)))
#define bvd_or(a, b) \
    _mm512_castsi512_pd(_mm512_or_si512(_mm512_castpd_si512(a), _mm512_castpd_si512(b)))
#define bvd_sellt(x, y, a, b) _mm512_mask_blend_pd(_mm512_cmp_pd_mask((x), (y), _CMP_LT_OQ), (b), (a))
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256d bvd;
#define BVD_W 4
#define bvd_load _mm256_loadu_pd
#define bvd_store _mm256_storeu_pd
#define bvd_set1 _mm256_set1_pd
#define bvd_zero _mm256_setzero_pd
#define bvd_fma _mm256_fmadd_pd
#define bvd_sub _mm256_sub_pd
#define bvd_add _mm256_add_pd
#define bvd_mul _mm256_mul_pd
#define bvd_nan0(x) _mm256_and_pd(_mm256_cmp_pd((x), (x), _CMP_ORD_Q), (x))
#define bvd_div _mm256_div_pd
#define bvd_abs(x) _mm256_andnot_pd(_mm256_set1_pd(-0.0), (x))
#define bvd_sign(x) _mm256_and_pd(_mm256_set1_pd(-0.0), (x))
#define bvd_or _mm256_or_pd
#define bvd_sellt(x, y, a, b) _mm256_blendv_pd((b), (a), _mm256_cmp_pd((x), (y), _CMP_LT_OQ))
#else
typedef double bvd;
#define BVD_W 1
#define bvd_load(p) (*(p))
#define bvd_store(p, x) (*(p) = (x))
#define bvd_set1(x) (x)
#define bvd_zero() 0.0
#define bvd_fma(a, b, c) ((a) * (b) + (c))
#define bvd_sub(a, b) ((a) - (b))
#define bvd_add(a, b) ((a) + (b))
#define bvd_mul(a, b) ((a) * (b))
#define bvd_nan0(x) ((x) == (x) ? (x) : 0.0)
#define bvd_div(a, b) ((a) / (b))
#endif

static inline bvd bvd_exp(bvd x) {
#if BVD_W == 1
    return exp(x);
#else
    /* Taylor coefficients ln2^k / k!, k = 0..12 (truncation < 3e-16 for |f| <= 1/2) */
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
    const bvd t = _mm512_max_pd(bvd_set1(-1100.0), bvd_mul(x, bvd_set1(1.4426950408889634)));
    const bvd n = _mm512_roundscale_pd(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const bvd t = _mm256_max_pd(bvd_set1(-1023.0), bvd_mul(x, bvd_set1(1.4426950408889634)));
    const bvd n = _mm256_round_pd(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    const bvd f = bvd_sub(t, n);
    bvd p = bvd_set1(c[12]);
    for (int i = 11; i >= 0; i--) p = bvd_fma(p, f, bvd_set1(c[i]));
#if defined(__AVX512F__)
    /* zero below the normal range (n < -1022), as the float32 exp */
    return _mm512_maskz_scalef_pd(_mm512_cmp_pd_mask(n, bvd_set1(-1022.0), _CMP_NLT_UQ), p, n);
#else
    /* n >= -1023: the biased exponent is >= 0; n = -1023 gives the bits of +0.0 */
    __m256i e = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n));
    e = _mm256_slli_epi64(_mm256_add_epi64(e, _mm256_set1_epi64x(1023)), 52);
    return bvd_mul(p, _mm256_castsi256_pd(e));
#endif
#endif
}

/* tanh's Taylor series x + sum_k c_k x^(2k+1) (the forward tile's, kernels/cpu_tile.c), used
 * below RB_TANH_X; see rb_tanh. */
static const double rb_tanh_c[12] = {1.0,
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

/* ----------------------------------------------------------- instantiate both types --- */
#define RB_T float
#define RB_V bvf
#define RB_W BVF_W
#define RB_SFX f32
#define V_LOAD bvf_load
#define V_STORE bvf_store
#define V_SET1 bvf_set1
#define V_ZERO bvf_zero
#define V_FMA bvf_fma
#define V_SUB bvf_sub
#define V_ADD bvf_add
#define V_NAN0 bvf_nan0
#define V_MUL bvf_mul
#define V_EXP bvf_exp
#define V_DIV bvf_div
#define V_ABS bvf_abs
#define V_SIGN bvf_sign
#define V_OR bvf_or
#define V_SELLT bvf_sellt
#define RB_TANH1 tanhf
#define RB_TANH_X 0.35
#define RB_TANH_N 6
#include "cpu_backward.c" /* this file again, now with RB_T defined */
#undef RB_T
#undef RB_V
#undef RB_W
#undef RB_SFX
#undef V_LOAD
#undef V_STORE
#undef V_SET1
#undef V_ZERO
#undef V_FMA
#undef V_SUB
#undef V_ADD
#undef V_NAN0
#undef V_MUL
#undef V_EXP
#undef V_DIV
#undef V_ABS
#undef V_SIGN
#undef V_OR
#undef V_SELLT
#undef RB_TANH1
#undef RB_TANH_X
#undef RB_TANH_N

#define RB_T double
#define RB_V bvd
#define RB_W BVD_W
#define RB_SFX f64
#define V_LOAD bvd_load
#define V_STORE bvd_store
#define V_SET1 bvd_set1
#define V_ZERO bvd_zero
#define V_FMA bvd_fma
#define V_SUB bvd_sub
#define V_ADD bvd_add
#define V_NAN0 bvd_nan0
#define V_MUL bvd_mul
#define V_EXP bvd_exp
#define V_DIV bvd_div
#define V_ABS bvd_abs
#define V_SIGN bvd_sign
#define V_OR bvd_or
#define V_SELLT bvd_sellt
#define RB_TANH1 tanh
#define RB_TANH_X 0.3
#define RB_TANH_N 12
#include "cpu_backward.c" /* this file again, now with RB_T defined */

#else
/* ============================================================ type-generic part ==== */
#define RB_CAT2(a, b) a##_##b
#define RB_CAT(a, b) RB_CAT2(a, b)
#define FN(name) RB_CAT(name, RB_SFX)
#define R RB_R
#define NK RB_NK
#define NV RB_NV
#define KW (NK * RB_W) /* keys per packed panel */
#define TW (NV * RB_W) /* columns of D per register tile in the dQ, dK, dV products */

/* Pack keys [a, a + nk) of one K/V head: K^T and V^T panels kt, vt (np, D, KW), zero past
 * nk; K rows kr (nk, Dp), zero past D. */
static void FN(rb_pack)(const RB_T *restrict k, const RB_T *restrict v, int64_t a, int64_t nk,
                        int64_t D, int64_t Dp, RB_T *restrict kt, RB_T *restrict vt,
                        RB_T *restrict kr) {
    const int64_t np = (nk + KW - 1) / KW;
    for (int64_t p = 0; p < np; p++) {
        const int64_t nc = nk - p * KW < KW ? nk - p * KW : KW;
        const RB_T *ks = k + (a + p * KW) * D, *vs = v + (a + p * KW) * D;
        RB_T *kd = kt + p * D * KW, *vd = vt + p * D * KW;
        for (int64_t d = 0; d < D; d++) {
            for (int64_t c = 0; c < nc; c++) {
                kd[d * KW + c] = ks[c * D + d];
                vd[d * KW + c] = vs[c * D + d];
            }
            for (int64_t c = nc; c < KW; c++) kd[d * KW + c] = vd[d * KW + c] = 0;
        }
    }
    for (int64_t j = 0; j < nk; j++) {
        memcpy(kr + j * Dp, k + (a + j) * D, (size_t)D * sizeof(RB_T));
        for (int64_t d = D; d < Dp; d++) kr[j * Dp + d] = 0;
    }
}

/* One strip of R rows against np panels: acc = X (R x D, row stride ldx) Y^T (panels).
 * mode 0: out = exp(acc - aux[r])  (P from S, aux = lse)
 * mode 1: out = pin * (acc - aux[r])  (dS from dP, aux = delta, pin = P)
 * mode 2: out = acc  (the raw scores, for rb_modify)
 * out and pin have row stride ld. */
static inline void FN(rb_strip)(const RB_T *restrict x, int64_t ldx, const RB_T *restrict yt,
                                int64_t np, int64_t D, const RB_T *restrict aux, int mode,
                                const RB_T *restrict pin, RB_T *restrict out, int64_t ld) {
    for (int64_t p = 0; p < np; p++) {
        const RB_T *yp = yt + p * D * KW;
        RB_V acc[R][NK];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int c = 0; c < NK; c++) acc[r][c] = V_ZERO();
        for (int64_t d = 0; d < D; d++) {
            RB_V yv[NK];
#pragma GCC unroll 8
            for (int c = 0; c < NK; c++) yv[c] = V_LOAD(yp + d * KW + c * RB_W);
#pragma GCC unroll 8
            for (int c = 0; c < NK; c++) RB_PREFETCH(yp + (d + RB_PF) * KW + c * RB_W);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const RB_V xb = V_SET1(x[r * ldx + d]);
#pragma GCC unroll 8
                for (int c = 0; c < NK; c++) acc[r][c] = V_FMA(xb, yv[c], acc[r][c]);
            }
        }
        if (mode == 2) {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NK; c++) V_STORE(out + r * ld + p * KW + c * RB_W, acc[r][c]);
        } else if (mode == 0) {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const RB_V a = V_SET1(aux[r]);
#pragma GCC unroll 8
                for (int c = 0; c < NK; c++)
                    V_STORE(out + r * ld + p * KW + c * RB_W, V_EXP(V_SUB(acc[r][c], a)));
            }
        } else {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const RB_V a = V_SET1(aux[r]);
#pragma GCC unroll 8
                for (int c = 0; c < NK; c++) {
                    const int64_t o = r * ld + p * KW + c * RB_W;
                    V_STORE(out + o, V_MUL(V_LOAD(pin + o), V_SUB(acc[r][c], a)));
                }
            }
        }
    }
}

/* tanh(x), elementwise: the forward tile's rm_tanh (same polynomial, threshold and branch
 * for large |x| with this file's exp); libm on the scalar path. */
static inline RB_V FN(rb_tanh)(RB_V x) {
#if RB_W == 1
    return RB_TANH1(x);
#else
    const RB_V one = V_SET1((RB_T)1), ax = V_ABS(x), x2 = V_MUL(x, x);
    RB_V p = V_SET1((RB_T)rb_tanh_c[RB_TANH_N - 1]);
#pragma GCC unroll 16
    for (int i = RB_TANH_N - 2; i >= 1; i--) p = V_FMA(p, x2, V_SET1((RB_T)rb_tanh_c[i]));
    const RB_V small = V_FMA(V_MUL(x, x2), p, x);
    const RB_V e = V_EXP(V_MUL(ax, V_SET1((RB_T)-2)));
    const RB_V big = V_OR(V_DIV(V_SUB(one, e), V_ADD(one, e)), V_SIGN(x));
    return V_SELLT(ax, V_SET1((RB_T)RB_TANH_X), small, big);
#endif
}

/* P of one strip with score modifiers: s (R x ld rows; the raw scores Qs K^T in the columns
 * [c0, c1), whole vectors) becomes, in order, s = cap tanh(s / cap) (cap > 0; dc gets the
 * derivative 1 - tanh^2, same layout), s -= slope |ap[r] - kp[j]| (ap not NULL, for the
 * nreal real rows and the block's keys j < nk), then P = exp(s - lse[r]). */
static void FN(rb_modify)(RB_T *restrict s, RB_T *restrict dc, int64_t ld, int64_t c0,
                          int64_t c1, int64_t nk, int nreal, RB_T cap,
                          const int64_t *restrict ap, const int64_t *restrict kp, double slope,
                          const RB_T *restrict lse) {
    const RB_V vc = V_SET1(cap), vic = V_SET1((RB_T)1 / cap), one = V_SET1((RB_T)1);
    const int64_t ja = c1 < nk ? c1 : nk;
    for (int r = 0; r < R; r++) {
        RB_T *restrict row = s + r * ld;
        if (cap > 0)
            for (int64_t j = c0; j < c1; j += RB_W) {
                const RB_V t = FN(rb_tanh)(V_MUL(V_LOAD(row + j), vic));
                V_STORE(dc + r * ld + j, V_SUB(one, V_MUL(t, t)));
                V_STORE(row + j, V_MUL(vc, t));
            }
        if (ap && r < nreal) {
            const int64_t a = ap[r];
            for (int64_t j = c0; j < ja; j++) {
                const int64_t dist = a > kp[j] ? a - kp[j] : kp[j] - a;
                row[j] -= (RB_T)(slope * (double)dist);
            }
        }
        const RB_V l = V_SET1(lse[r]);
        for (int64_t j = c0; j < c1; j += RB_W) V_STORE(row + j, V_EXP(V_SUB(V_LOAD(row + j), l)));
    }
}

/* dst[0..n) += s * src[0..n) */
static inline void FN(rb_axpy)(RB_T *restrict dst, const RB_T *restrict src, int64_t n, RB_T s) {
    int64_t d = 0;
    const RB_V vs = V_SET1(s);
    for (; d + RB_W <= n; d += RB_W) V_STORE(dst + d, V_FMA(vs, V_LOAD(src + d), V_LOAD(dst + d)));
    for (; d < n; d++) dst[d] += s * src[d];
}

/* dk, dv rows [0, nk) (row stride D) += dkb, dvb (row stride Dp); then dkb, dvb = 0. */
static void FN(rb_flush)(RB_T *restrict dk, RB_T *restrict dv, RB_T *restrict dkb,
                         RB_T *restrict dvb, int64_t nk, int64_t nkr, int64_t D, int64_t Dp) {
    for (int64_t j = 0; j < nk; j++) {
        FN(rb_axpy)(dk + j * D, dkb + j * Dp, D, (RB_T)1);
        FN(rb_axpy)(dv + j * D, dvb + j * Dp, D, (RB_T)1);
    }
    memset(dkb, 0, sizeof(RB_T) * (size_t)(nkr * Dp));
    memset(dvb, 0, sizeof(RB_T) * (size_t)(nkr * Dp));
}

/* dq rows [0, nrows) (row stride D) += sc * dS (R x nk, row stride ld) K (nk x Dp). */
static inline void FN(rb_dq)(const RB_T *restrict ds, int64_t ld, const RB_T *restrict kr,
                             int64_t nk, int64_t Dp, int64_t D, RB_T sc, RB_T *restrict dq,
                             int nrows) {
    RB_T tmp[R * TW];
    int64_t d0 = 0;
    for (; d0 + TW <= Dp; d0 += TW) {
        RB_V acc[R][NV];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int c = 0; c < NV; c++) acc[r][c] = V_ZERO();
        for (int64_t j = 0; j < nk; j++) {
            RB_V kv[NV];
#pragma GCC unroll 8
            for (int c = 0; c < NV; c++) kv[c] = V_LOAD(kr + j * Dp + d0 + c * RB_W);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const RB_V sb = V_SET1(ds[r * ld + j]);
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) acc[r][c] = V_FMA(sb, kv[c], acc[r][c]);
            }
        }
        if (d0 + TW <= D) {
            const RB_V vs = V_SET1(sc);
            for (int r = 0; r < nrows; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) {
                    RB_T *o = dq + r * D + d0 + c * RB_W;
                    V_STORE(o, V_FMA(vs, acc[r][c], V_LOAD(o)));
                }
        } else {
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) V_STORE(tmp + r * TW + c * RB_W, acc[r][c]);
            for (int r = 0; r < nrows; r++) FN(rb_axpy)(dq + r * D + d0, tmp + r * TW, D - d0, sc);
        }
    }
    for (; d0 < Dp; d0 += RB_W) { /* tail: one vector of columns */
        RB_V acc[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r] = V_ZERO();
        for (int64_t j = 0; j < nk; j++) {
            const RB_V kv = V_LOAD(kr + j * Dp + d0);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[r] = V_FMA(V_SET1(ds[r * ld + j]), kv, acc[r]);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) V_STORE(tmp + r * RB_W, acc[r]);
        const int64_t n = D - d0 < RB_W ? D - d0 : RB_W;
        for (int r = 0; r < nrows; r++) FN(rb_axpy)(dq + r * D + d0, tmp + r * RB_W, n, sc);
    }
}

/* out (nkr x Dp, nkr a multiple of R) += A^T X: A (nq x nkr, row stride lda; P or dS),
 * X (nq x Dp, row stride ldx; dO or Qs). Register tile: R keys x TW columns, reducing over
 * the nq rows of the query block from zero; the block's sum is then added to out once.
 * Chaining from out instead would add every query row's term to a total over all the rows
 * seen so far: an error growing with the query count (see RB_FLUSH for the rest). */
static void FN(rb_outer)(const RB_T *restrict A, int64_t lda, const RB_T *restrict X,
                         int64_t ldx, int64_t nq, int64_t nkr, int64_t Dp, RB_T *restrict out) {
    for (int64_t j0 = 0; j0 < nkr; j0 += R) {
        RB_T *o = out + j0 * Dp;
        const RB_T *a = A + j0;
        int64_t d0 = 0;
        for (; d0 + TW <= Dp; d0 += TW) {
            RB_V acc[R][NV];
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) acc[r][c] = V_ZERO();
            for (int64_t i = 0; i < nq; i++) {
                RB_V xv[NV];
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) xv[c] = V_LOAD(X + i * ldx + d0 + c * RB_W);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) {
                    const RB_V ab = V_SET1(a[i * lda + r]);
#pragma GCC unroll 8
                    for (int c = 0; c < NV; c++) acc[r][c] = V_FMA(ab, xv[c], acc[r][c]);
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; r++)
#pragma GCC unroll 8
                for (int c = 0; c < NV; c++) {
                    RB_T *op = o + r * Dp + d0 + c * RB_W;
                    V_STORE(op, V_ADD(V_LOAD(op), acc[r][c]));
                }
        }
        for (; d0 < Dp; d0 += RB_W) { /* tail: one vector of columns */
            RB_V acc[R];
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[r] = V_ZERO();
            for (int64_t i = 0; i < nq; i++) {
                const RB_V xv = V_LOAD(X + i * ldx + d0);
#pragma GCC unroll 16
                for (int r = 0; r < R; r++) acc[r] = V_FMA(V_SET1(a[i * lda + r]), xv, acc[r]);
            }
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) V_STORE(o + r * Dp + d0, V_ADD(V_LOAD(o + r * Dp + d0), acc[r]));
        }
    }
}

/* Public entry point: add the gradients of all (query, key) pairs of the tile, in place.
 * qcuts/kcuts: ascending indices where runs of evenly spaced positions start (may be empty;
 * blocks never straddle them, so block skipping has tight bounds). qlo/qhi: per-row visible
 * key ranges (both NULL: causal or no mask as `causal` says). bq, bk: block sizes (query
 * rows, keys). progress, when given, is called whenever at least `chunk` (query row, key)
 * pairs of single heads have been computed since the last call; a nonzero return aborts
 * (result -2). Score modifiers (ringmpi.tile): softcap > 0 caps the scores (dS then gains
 * the factor 1 - tanh^2), slopes (H,) not NULL adds ALiBi -slopes[h] |apos[i] - kpos[j]|
 * with apos (Sq,) the rows' positions in key coordinates; 0 / NULL: none. Returns the flops of the computed blocks (10 nq nk D per block pair with a
 * visible pair and query head), or -1 when out of memory. */
int64_t FN(rm_backward_tile)(const RB_T *q, const RB_T *k, const RB_T *v, const RB_T *dout,
                             const RB_T *lse, const RB_T *delta, const int64_t *qpos,
                             const int64_t *kpos, RB_T *dq, RB_T *dk, RB_T *dv, int64_t B,
                             int64_t H, int64_t Hkv, int64_t Sq, int64_t Sk, int64_t D,
                             const int64_t *qcuts, int64_t nqcuts, const int64_t *kcuts,
                             int64_t nkcuts, const int64_t *qlo, const int64_t *qhi,
                             double scale, int causal, int64_t bq, int64_t bk,
                             int (*progress)(void), int64_t chunk, double softcap,
                             const double *slopes, const int64_t *apos) {
    if (Sq <= 0 || Sk <= 0 || B <= 0 || H <= 0) return 0;
    if (!qlo || !qhi) qlo = qhi = NULL; /* bounds come in pairs */
    const int bounded = qlo != NULL;
    const int mask = bounded || causal; /* some pair may be hidden */
    const int64_t G = H / Hkv;
    const int64_t Dp = (D + RB_W - 1) / RB_W * RB_W;
    bq = bq < 1 ? R : (bq + R - 1) / R * R;
    bk = bk < 1 ? KW : (bk + KW - 1) / KW * KW;
    /* score buffers: columns for whole panels and for whole R-key tiles of the dK/dV
     * products; the columns past a block's keys are kept zero */
    const int64_t bkr = (bk + R - 1) / R * R;
    const int64_t ld = bk > bkr ? bk : bkr;
    rb_block *qb = malloc(sizeof(rb_block) * (size_t)Sq);
    rb_block *kb = malloc(sizeof(rb_block) * (size_t)Sk);
    rb_range *qr = malloc(sizeof(rb_range) * (size_t)Sq);
    int64_t *ksort = malloc(sizeof(int64_t) * (size_t)Sk);
    RB_T *kt = rb_alloc(sizeof(RB_T) * (size_t)(bk * D));
    RB_T *vt = rb_alloc(sizeof(RB_T) * (size_t)(bk * D));
    RB_T *kr = rb_alloc(sizeof(RB_T) * (size_t)(ld * Dp));
    RB_T *dkb = rb_alloc(sizeof(RB_T) * (size_t)(ld * Dp));
    RB_T *dvb = rb_alloc(sizeof(RB_T) * (size_t)(ld * Dp));
    RB_T *qs = rb_alloc(sizeof(RB_T) * (size_t)(bq * Dp));
    RB_T *dob = rb_alloc(sizeof(RB_T) * (size_t)(bq * Dp));
    RB_T *pb = rb_alloc(sizeof(RB_T) * (size_t)(bq * ld));
    RB_T *dsb = rb_alloc(sizeof(RB_T) * (size_t)(bq * ld));
    RB_T *lb = rb_alloc(sizeof(RB_T) * (size_t)bq);
    RB_T *deb = rb_alloc(sizeof(RB_T) * (size_t)bq);
    const RB_T cap = softcap > 0 ? (RB_T)softcap : 0;
    const int mods = cap > 0 || slopes;
    RB_T *dcb = cap > 0 ? rb_alloc(sizeof(RB_T) * (size_t)(bq * ld)) : NULL; /* 1 - tanh^2 */
    int64_t flops = 0;
    if (!qb || !kb || !qr || !ksort || !kt || !vt || !kr || !dkb || !dvb || !qs || !dob || !pb ||
        !dsb || !lb || !deb || (cap > 0 && !dcb)) {
        flops = -1;
        goto done;
    }
    const int64_t nqb = rb_blocks(qpos, Sq, qcuts, nqcuts, bq, qb);
    const int64_t nkb = rb_blocks(kpos, Sk, kcuts, nkcuts, bk, kb);
    for (int64_t iq = 0; iq < nqb; iq++) { /* extremes of the rows' visible ranges */
        rb_range x = {INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN};
        for (int64_t i = qb[iq].a; i < qb[iq].b; i++) {
            const int64_t lo = rb_row_lo(qlo, i), hi = rb_row_hi(qhi, qpos, causal, i);
            x.lo_min = lo < x.lo_min ? lo : x.lo_min;
            x.lo_max = lo > x.lo_max ? lo : x.lo_max;
            x.hi_min = hi < x.hi_min ? hi : x.hi_min;
            x.hi_max = hi > x.hi_max ? hi : x.hi_max;
        }
        qr[iq] = x;
    }
    /* each key block's positions in ascending order, for counting a row's visible keys */
    memcpy(ksort, kpos, sizeof(int64_t) * (size_t)Sk);
    for (int64_t t = 0; t < nkb && mask; t++)
        if (!kb[t].inc)
            qsort(ksort + kb[t].a, (size_t)(kb[t].b - kb[t].a), sizeof(int64_t), rb_cmp_i64);
    const RB_T sc = (RB_T)scale;
    int64_t work = 0; /* (row, key) pairs since the last progress call */
    for (int64_t b = 0; b < B; b++) {
        for (int64_t hk = 0; hk < Hkv; hk++) {
            const int64_t kvo = (b * Hkv + hk) * Sk * D;
            for (int64_t t = 0; t < nkb; t++) {
                const rb_block K = kb[t];
                const int64_t ka = K.a, nk = K.b - K.a;
                const int64_t nkr = (nk + R - 1) / R * R;
                const int64_t *kp = kpos + ka, *ks = ksort + ka;
                int live = 0;
                for (int64_t iq = 0; iq < nqb && !live; iq++)
                    live = qr[iq].hi_max >= K.lo && qr[iq].lo_min <= K.hi;
                if (!live) continue; /* no row sees any key of the block */
                FN(rb_pack)(k + kvo, v + kvo, ka, nk, D, Dp, kt, vt, kr);
                memset(dkb, 0, sizeof(RB_T) * (size_t)(nkr * Dp));
                memset(dvb, 0, sizeof(RB_T) * (size_t)(nkr * Dp));
                int held = 0; /* query blocks summed in dkb, dvb since they were last added */
                for (int64_t g = 0; g < G; g++) {
                    const int64_t h = hk * G + g;
                    const RB_T *qh = q + (b * H + h) * Sq * D;
                    const RB_T *doh = dout + (b * H + h) * Sq * D;
                    const RB_T *lh = lse + (b * H + h) * Sq;
                    const RB_T *dh = delta + (b * H + h) * Sq;
                    RB_T *dqh = dq + (b * H + h) * Sq * D;
                    const double slope = slopes ? slopes[h] : 0;
                    for (int64_t iq = 0; iq < nqb; iq++) {
                        const rb_block Q = qb[iq];
                        const rb_range X = qr[iq];
                        if (X.hi_max < K.lo || X.lo_min > K.hi) continue;
                        /* some pair hidden: per-strip counts and per-element masking */
                        const int masked = mask && !(X.lo_max <= K.lo && K.hi <= X.hi_min);
                        const int64_t qa = Q.a, nq = Q.b - Q.a;
                        const int64_t nqp = (nq + R - 1) / R * R;
                        /* scaled queries, dO, lse (-inf -> +inf: p = 0) and delta; padded
                         * rows are zero with lse +inf, so their P and dS are 0 */
                        for (int64_t i = 0; i < nqp; i++) {
                            RB_T *qrow = qs + i * Dp, *dr = dob + i * Dp;
                            if (i < nq) {
                                const RB_T *qsrc = qh + (qa + i) * D;
                                for (int64_t d = 0; d < D; d++) qrow[d] = qsrc[d] * sc;
                                memcpy(dr, doh + (qa + i) * D, (size_t)D * sizeof(RB_T));
                                const RB_T l = lh[qa + i];
                                lb[i] = l == -INFINITY ? INFINITY : l;
                                deb[i] = dh[qa + i];
                            } else {
                                memset(qrow, 0, (size_t)D * sizeof(RB_T));
                                memset(dr, 0, (size_t)D * sizeof(RB_T));
                                lb[i] = INFINITY;
                                deb[i] = 0;
                            }
                            for (int64_t d = D; d < Dp; d++) qrow[d] = dr[d] = 0;
                        }
                        int64_t bmin = nk, bmax = 0; /* keys any strip of the block computed */
                        for (int64_t r0 = 0; r0 < nqp; r0 += R) {
                            RB_T *ps = pb + r0 * ld, *dss = dsb + r0 * ld;
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
                                    rlo[r] = rb_row_lo(qlo, i);
                                    rhi[r] = rb_row_hi(qhi, qpos, causal, i);
                                    const int64_t a = rb_count_lt(ks, nk, rlo[r]);
                                    const int64_t e = rb_count_le(ks, nk, rhi[r]);
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
                                memset(ps, 0, sizeof(RB_T) * (size_t)(R * ld));
                                memset(dss, 0, sizeof(RB_T) * (size_t)(R * ld));
                                continue;
                            }
                            bmin = s0 < bmin ? s0 : bmin;
                            bmax = s1 > bmax ? s1 : bmax;
                            const int64_t p0 = s0 / KW, np = (s1 + KW - 1) / KW - p0;
                            const int nrows = nq - r0 < R ? (int)(nq - r0) : R;
                            if (mods) { /* raw scores, then cap, ALiBi and P = exp(s - lse) */
                                FN(rb_strip)(qs + r0 * Dp, Dp, kt + p0 * D * KW, np, D, lb + r0,
                                             2, NULL, ps + p0 * KW, ld);
                                FN(rb_modify)(ps, cap > 0 ? dcb + r0 * ld : NULL, ld, p0 * KW,
                                              (p0 + np) * KW, nk, nrows, cap,
                                              slopes ? apos + qa + r0 : NULL, kp, slope, lb + r0);
                            } else {
                                FN(rb_strip)(qs + r0 * Dp, Dp, kt + p0 * D * KW, np, D, lb + r0,
                                             0, NULL, ps + p0 * KW, ld);
                            }
                            for (int r = 0; r < R; r++) {
                                RB_T *row = ps + r * ld;
                                if (masked && !K.inc && je[r] > jb[r]) {
                                    for (int64_t j = 0; j < nk; j++)
                                        if (kp[j] < rlo[r] || kp[j] > rhi[r]) row[j] = 0;
                                }
                                for (int64_t j = 0; j < jb[r]; j++) row[j] = 0;
                                for (int64_t j = je[r]; j < ld; j++) row[j] = 0;
                            }
                            FN(rb_strip)(dob + r0 * Dp, Dp, vt + p0 * D * KW, np, D, deb + r0, 1,
                                         ps + p0 * KW, dss + p0 * KW, ld);
                            if (cap > 0) /* dS through the cap: times 1 - tanh^2 */
                                for (int r = 0; r < R; r++) {
                                    RB_T *drow = dss + r * ld;
                                    const RB_T *crow = dcb + (r0 + r) * ld;
                                    for (int64_t j = p0 * KW; j < (p0 + np) * KW; j += RB_W)
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
                        FN(rb_outer)(pb + j0, ld, dob, Dp, nq, j1 - j0, Dp, dvb + j0 * Dp);
                        FN(rb_outer)(dsb + j0, ld, qs, Dp, nq, j1 - j0, Dp, dkb + j0 * Dp);
                        if (++held == RB_FLUSH) {
                            FN(rb_flush)(dk + kvo + ka * D, dv + kvo + ka * D, dkb, dvb, nk, nkr,
                                         D, Dp);
                            held = 0;
                        }
                        flops += 10 * nq * nk * D;
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
                if (held) FN(rb_flush)(dk + kvo + ka * D, dv + kvo + ka * D, dkb, dvb, nk, nkr, D, Dp);
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

#undef FN
#undef R
#undef NK
#undef NV
#undef KW
#undef TW
#endif
