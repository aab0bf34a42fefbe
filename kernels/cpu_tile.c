/* Fused CPU attention tile: scores, mask, online softmax and P.V in one pass.
 *
 * Loaded by ringmpi/cpu/fused.py (compiled on first use, cached on disk). Same semantics as
 * ringmpi.cpu.numpy_tile.forward_tile, the specification. Internal layout, head-major:
 *
 *   q    (B, H,   Sq, D)      k, v (B, Hkv, Sk, D)     query head h reads K/V head h / (H/Hkv)
 *   qpos (Sq,), kpos (Sk,)    int64 global token positions
 *   acc  (B, H, Sq, D), m (B, H, Sq), l (B, H, Sq)   online-softmax state, updated in place
 *
 * For one query row with scores s_j = scale * q.k_j over its visible keys (kpos_j <= qpos_i when
 * causal; lo_i <= kpos_j <= hi_i with per-row bounds, the masks beyond causal: windows, packed
 * sequences, cross-attention) the state update over a block of keys is
 *
 *   m'  = max(m, max_j s_j)
 *   acc = exp(m - m') acc + sum_j exp(s_j - m') v_j
 *   l   = exp(m - m') l   + sum_j exp(s_j - m')
 *
 * Technique. For every K/V head the block of keys is packed once per call: K transposed into
 * panels of KW keys ((D, KW) row-major, so one vector load gives KW/W consecutive keys of one
 * feature) and V with rows padded to a whole number of vectors; the packed head serves all
 * its query heads (GQA). Queries go in blocks of Bq rows (hundreds: the head's K/V stream
 * through L2 once per query block), each block over key blocks of Bk keys, in strips of R rows:
 *   1. S (R x Bk) = Qs K^T with an R x KW register tile (R*KW/W accumulators, broadcast FMAs);
 *      each row's maximum is taken from the registers before they are stored;
 *   2. mask (partly visible blocks only), the R rows' rescale factors by one vector exp, then
 *      P = exp(S - m) by a vector polynomial over the R rows at once, row sums;
 *   3. O (R x D) = alpha O + P V with an R x (NV*W) register tile, reduced over the block's
 *      keys from zero and added to O (and P's row sums to l) by compensated summation, so
 *      float32 rounding does not grow with the row's key count (values with a mean make a
 *      running total grow, and each term added to it rounds against the total).
 * A (query block, key block) pair that no row sees is skipped and one that every row sees
 * fully is not masked; inside the others each strip scores only the panels from its first
 * to its last visible key (a narrow window costs about its width, not the block's).
 * The strip of scores stays in L1, the K/V block in L2 (prefetched into L1 a few iterations
 * ahead), the query block's Q and state in L2: memory traffic per flop is that of a blocked
 * matrix product and no (Sq x Sk) array exists.
 *
 * exp: 2^t with t = x log2(e). float32: n = floor(t), f = t - n in [0, 1], 2^f by a degree-6
 * minimax polynomial (4e-9 relative); float64: n = round(t), |f| <= 1/2, a degree-12 Taylor
 * polynomial (truncation below 3e-16 relative). Times 2^n by vscalef (AVX-512) or by building
 * the exponent bits (AVX2); results below the smallest normal number are 0 on both. x = -inf
 * gives exactly 0; NaN propagates. The scalar path calls libm's expf/exp.
 *
 * Same answers on AVX2 and AVX-512: every score is one FMA chain over d = 0..D-1, every output
 * element one FMA chain over a key block's keys in order, added to the state by the same
 * compensated sum (rm_kadd), exp is the same sequence of IEEE operations,
 * row sums add the same numbers in the same order (see rm_softmax and the horizontal sums), and
 * fused.py cuts the same blocks for both (key blocks a multiple of 64, RM_R = 6 on both): the
 * two paths give bit-identical results. Under a mask a strip's scored keys start at a panel
 * boundary, which differs (KW), but it is a multiple of 64 bytes on both, so every column
 * keeps its row-sum lane; the extra masked columns one path scores add exact zeros (p = 0,
 * and 0 * v for finite v) and leave the maxima alone. The scalar path (no FMA, libm exp) differs by rounding.
 * Compiled without -ffast-math, so inf and NaN keep their IEEE meaning everywhere.
 *
 * The file includes itself twice to instantiate float32 and float64 (RM_T selects the type).
 */
#ifndef RM_T
/* ===================================================================== common part ==== */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Register blocking per ISA: query rows per strip RM_R; vectors of keys per QK^T register
 * tile RM_NK and of D-columns per P.V register tile RM_NV (RM_R x RM_NK accumulators, plus
 * RM_NK loaded vectors and one broadcast, must fit the register file without spills).
 *   AVX-512 (32 zmm): 6 x 4 = 24 accumulators.
 *   AVX2 (16 ymm): 6 x 2 = 12 accumulators + 2 loads + 1 broadcast = 15 registers; the 12
 *   independent FMA chains cover FMA latency x throughput (4 x 2 on Zen 2-4, 5 x 2 on Intel).
 *   Scalar: 4 x 4 (measured within 5% of 6 x 4 and 6 x 2). */
#if defined(__AVX512F__)
#define RM_R_DEF 6
#define RM_NK_DEF 4
#define RM_NV_DEF 4
#elif defined(__AVX2__) && defined(__FMA__)
#define RM_R_DEF 6
#define RM_NK_DEF 2
#define RM_NV_DEF 2
#else
#define RM_R_DEF 4
#define RM_NK_DEF 4
#define RM_NV_DEF 4
#endif
#ifndef RM_R
#define RM_R RM_R_DEF
#endif
#ifndef RM_NK
#define RM_NK RM_NK_DEF
#endif
#ifndef RM_NV
#define RM_NV RM_NV_DEF
#endif
#define RM_ALIGN 64
/* Software prefetch into L1, RM_PF iterations ahead, of the K panel / V rows that the
 * register tiles stream from L2 (+2-5% measured over the hardware prefetchers alone).
 * A prefetch past the end of a buffer is harmless: it never faults. */
#ifndef RM_PF
#define RM_PF 16
#endif
#define RM_PREFETCH(p) __builtin_prefetch((p), 0, 3)

typedef struct {
    int64_t a, b;     /* index range [a, b) */
    int64_t lo, hi;   /* min and max position inside */
    int inc;          /* positions strictly increasing: visible keys form a prefix */
} rm_block;

/* Cut [start, stop) into blocks of at most `size` rows that never cross a cut in `cuts`
 * (the boundaries of runs of evenly spaced positions), with position bounds. */
static int64_t rm_blocks(const int64_t *pos, int64_t start, int64_t stop, const int64_t *cuts,
                         int64_t ncuts, int64_t size, rm_block *out) {
    int64_t nb = 0, c = 0, a = start;
    while (a < stop) {
        while (c < ncuts && cuts[c] <= a) c++;
        int64_t seg_end = (c < ncuts && cuts[c] < stop) ? cuts[c] : stop;
        int64_t b = a + size < seg_end ? a + size : seg_end;
        int64_t lo = pos[a], hi = pos[a];
        int inc = 1;
        for (int64_t i = a + 1; i < b; i++) {
            lo = pos[i] < lo ? pos[i] : lo;
            hi = pos[i] > hi ? pos[i] : hi;
            inc &= pos[i] > pos[i - 1];
        }
        out[nb].inc = inc;
        out[nb].a = a;
        out[nb].b = b;
        out[nb].lo = lo;
        out[nb].hi = hi;
        nb++;
        a = b;
    }
    return nb;
}

static void *rm_alloc(size_t bytes) {
    size_t n = (bytes + RM_ALIGN - 1) / RM_ALIGN * RM_ALIGN;
    return aligned_alloc(RM_ALIGN, n ? n : RM_ALIGN);
}

/* Arguments of rm_forward_tile_f32/_f64 (mirrored by fused._TileArgs; rm_tile_args_size lets
 * the loader check the layout). Arrays are C-contiguous, of the function's element type:
 *   q (B, H, Sq, D), k and v (B, Hkv, Sk, D), acc (B, H, Sq, D), m and l (B, H, Sq);
 *   qpos (Sq,), kpos (Sk,) int64 positions; qcuts (nqcuts,), kcuts (nkcuts,): ascending
 *   indices where runs of evenly spaced positions start (may be empty).
 * Query rows [q0, q1) are folded; bq, bk: block sizes (query rows, keys); progress (may be
 * NULL) is called every `chunk` query rows of single heads, nonzero aborts.
 * lo, hi (Sq,) int64 or both NULL: query row i sees key j iff lo[i] <= kpos[j] <= hi[i]
 * (lo > hi: no key), the masks beyond causal (ringmpi.mask); they replace `causal`, which
 * applies only without them (key j visible iff kpos[j] <= qpos[i]).
 * Score modifiers (issue 25; ringmpi.tile): softcap > 0 caps every score, then ALiBi (slopes
 * not NULL) adds -slopes[h] |apos[i] - kpos[j]|, before the mask hides keys. */
typedef struct {
    const void *q, *k, *v;
    const int64_t *qpos, *kpos;
    void *acc, *m, *l;
    int64_t B, H, Hkv, Sq, Sk, D, q0, q1;
    const int64_t *qcuts, *kcuts;
    int64_t nqcuts, nkcuts;
    double scale;
    int64_t causal, bq, bk;
    int (*progress)(void);
    int64_t chunk;
    const int64_t *lo, *hi;
    double softcap;       /* > 0: scores s -> softcap tanh(s / softcap); 0: none */
    const double *slopes; /* (H,) ALiBi slopes or NULL: s -= slopes[h] |apos[i] - kpos[j]| */
    const int64_t *apos;  /* (Sq,) query rows' ALiBi positions (in key coordinates) */
} rm_tile_args;

/* Which keys each query row sees: [lo[i], hi[i]] with bounds, else (-inf, qpos[i]] when
 * causal, else every key. */
typedef struct {
    const int64_t *lo, *hi, *qpos;
    int causal;
} rm_vis;

static inline void rm_row(const rm_vis *v, int64_t i, int64_t *lo, int64_t *hi) {
    *lo = v->lo ? v->lo[i] : INT64_MIN;
    *hi = v->lo ? v->hi[i] : v->causal ? v->qpos[i] : INT64_MAX;
}

/* Extremes of the rows' bounds over a range of rows. */
typedef struct {
    int64_t lo_min, lo_max, hi_min, hi_max;
} rm_range;

static rm_range rm_rows_range(const rm_vis *v, int64_t a, int64_t b) {
    rm_range r = {INT64_MAX, INT64_MIN, INT64_MAX, INT64_MIN};
    for (int64_t i = a; i < b; i++) {
        int64_t lo, hi;
        rm_row(v, i, &lo, &hi);
        r.lo_min = lo < r.lo_min ? lo : r.lo_min;
        r.lo_max = lo > r.lo_max ? lo : r.lo_max;
        r.hi_min = hi < r.hi_min ? hi : r.hi_min;
        r.hi_max = hi > r.hi_max ? hi : r.hi_max;
    }
    return r;
}

/* No row sees any key with a position in [klo, khi]. */
static inline int rm_hidden(const rm_range *r, int64_t klo, int64_t khi) {
    return r->hi_max < klo || r->lo_min > khi;
}

/* Every row sees every key with a position in [klo, khi] (never true with an empty row). */
static inline int rm_full(const rm_range *r, int64_t klo, int64_t khi) {
    return r->lo_max <= klo && khi <= r->hi_min;
}

/* First index j of increasing kp[0..n) with kp[j] >= x (rm_lower), > x (rm_upper). */
static inline int64_t rm_lower(const int64_t *kp, int64_t n, int64_t x) {
    int64_t a = 0, b = n;
    while (a < b) {
        const int64_t mid = a + (b - a) / 2;
        if (kp[mid] < x) a = mid + 1;
        else b = mid;
    }
    return a;
}

static inline int64_t rm_upper(const int64_t *kp, int64_t n, int64_t x) {
    int64_t a = 0, b = n;
    while (a < b) {
        const int64_t mid = a + (b - a) / 2;
        if (kp[mid] <= x) a = mid + 1;
        else b = mid;
    }
    return a;
}

int64_t rm_tile_args_size(void) { return (int64_t)sizeof(rm_tile_args); }

/* The ISA path this file was compiled for: the names fused.py uses. */
const char *rm_isa_name(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "scalar";
#endif
}

int rm_simd_width_bytes(void) {
#if defined(__AVX512F__)
    return 64;
#elif defined(__AVX2__) && defined(__FMA__)
    return 32;
#else
    return 0;
#endif
}

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

/* ----------------------------------------------------------- instantiate both types --- */
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
#include "cpu_tile.c" /* this file again, now with RM_T defined */
#undef RM_T
#undef RM_V
#undef RM_VSUM
#undef RM_W
#undef RM_SFX
#undef RM_EXP1
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
#include "cpu_tile.c" /* this file again, now with RM_T defined */

#else
/* ============================================================ type-generic part ==== */
#define RM_CAT2(a, b) a##_##b
#define RM_CAT(a, b) RM_CAT2(a, b)
#define FN(name) RM_CAT(name, RM_SFX)

/* keys per packed K^T panel (NK vectors) and D-columns per P.V register tile (NV vectors) */
#define NK RM_NK
#define KW (NK * RM_W)
#define NV RM_NV
/* 64-byte cache lines per row of a K^T panel and per V row segment of a P.V tile: one
 * prefetch per line (AVX2 float32: one line holds both vectors) */
#define KW_LINES ((int)((KW * sizeof(RM_T) + 63) / 64))
#define NV_LINES ((int)((NV * RM_W * sizeof(RM_T) + 63) / 64))
/* vectors per 64 bytes for the row sums of rm_softmax (1 on the scalar path) */
#define NS (RM_W > 1 ? (int)(64 / sizeof(RM_T)) / RM_W : 1)
_Static_assert(KW % (NS * RM_W) == 0, "a K panel must span whole 64-byte row-sum groups");

/* Pack keys [a, b) of one K/V head: K^T panels kt (npanel, D, KW), zero padded past b;
 * V rows vp (b - a, Dp), zero padded past D. The panel is written in order (unit-stride
 * stores); its KW source rows are read column by column and stay in L1. */
static void FN(rm_pack)(const RM_T *k, const RM_T *v, int64_t a, int64_t b, int64_t D,
                        int64_t Dp, RM_T *kt, RM_T *vp) {
    int64_t nk = b - a;
    int64_t np = (nk + KW - 1) / KW;
    for (int64_t p = 0; p < np; p++) {
        RM_T *dst = kt + p * D * KW;
        const RM_T *src = k + (a + p * KW) * D;
        const int64_t nc = nk - p * KW < KW ? nk - p * KW : KW;
        for (int64_t d = 0; d < D; d++) {
            for (int64_t c = 0; c < nc; c++) dst[d * KW + c] = src[c * D + d];
            for (int64_t c = nc; c < KW; c++) dst[d * KW + c] = 0;
        }
    }
    for (int64_t j = 0; j < nk; j++) {
        memcpy(vp + j * Dp, v + (a + j) * D, (size_t)D * sizeof(RM_T));
        for (int64_t d = D; d < Dp; d++) vp[j * Dp + d] = 0;
    }
}

/* S (RM_R x ldS) = Qs (RM_R x D) K^T for all panels of one block; rmax (RM_R x RM_W) gets
 * each row's running maximum as a vector (lane-wise over the panels), taken from the
 * registers before they are stored, so the softmax needs no separate pass for it. */
static inline void FN(rm_qk)(const RM_T *restrict qs, const RM_T *restrict kt, int64_t np,
                             int64_t D, RM_T *restrict s, int64_t lds, RM_T *restrict rmax) {
#pragma GCC unroll 16
    for (int r = 0; r < RM_R; r++) V_STORE(rmax + r * RM_W, V_SET1(-INFINITY));
    for (int64_t p = 0; p < np; p++) {
        const RM_T *kp = kt + p * D * KW;
        RM_V acc[RM_R][NK];
#pragma GCC unroll 16
        for (int r = 0; r < RM_R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < NK; c++) acc[r][c] = V_ZERO();
        for (int64_t d = 0; d < D; d++) {
            RM_V kv[NK];
#pragma GCC unroll 4
            for (int c = 0; c < NK; c++) kv[c] = V_LOAD(kp + d * KW + c * RM_W);
#pragma GCC unroll 4
            for (int c = 0; c < KW_LINES; c++)
                RM_PREFETCH((const char *)(kp + (d + RM_PF) * KW) + 64 * c);
#pragma GCC unroll 16
            for (int r = 0; r < RM_R; r++) {
                RM_V qb = V_SET1(qs[r * D + d]);
#pragma GCC unroll 4
                for (int c = 0; c < NK; c++) acc[r][c] = V_FMA(qb, kv[c], acc[r][c]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < RM_R; r++) {
            RM_V mx = V_LOAD(rmax + r * RM_W);
#pragma GCC unroll 4
            for (int c = 0; c < NK; c++) {
                V_STORE(s + r * lds + p * KW + c * RM_W, acc[r][c]);
                mx = V_MAX(mx, acc[r][c]);
            }
            V_STORE(rmax + r * RM_W, mx);
        }
    }
}

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

/* y[0..n) = tanh(x[0..n)) by rm_tanh (the tile's own; exported for the accuracy tests). */
void FN(rm_tanh_array)(const RM_T *x, RM_T *y, int64_t n) {
    int64_t i = 0;
    for (; i + RM_W <= n; i += RM_W) V_STORE(y + i, FN(rm_tanh)(V_LOAD(x + i)));
    if (i < n) { /* the tail through one padded vector: the same operations */
        RM_T buf[RM_W];
        for (int c = 0; c < RM_W; c++) buf[c] = i + c < n ? x[i + c] : 0;
        V_STORE(buf, FN(rm_tanh)(V_LOAD(buf)));
        for (int64_t c = 0; i + c < n; c++) y[i + c] = buf[c];
    }
}

/* Score modifiers on one strip (rows of stride lds; nr real rows): softcap (cap > 0) maps
 * the columns [0, ncol) (whole vectors: the columns past the scored keys are overwritten
 * by the mask later) to cap tanh(s / cap); ALiBi (ap not NULL: the rows' positions, kq the
 * scored keys' positions) adds -slope |ap[r] - kq[j]| to the columns [0, use): the product
 * in double, rounded once to RM_T (as the numpy tile), then subtracted. */
static void FN(rm_modify)(RM_T *restrict s, int64_t lds, int nr, int64_t use, int64_t ncol,
                          RM_T cap, const int64_t *restrict ap, const int64_t *restrict kq,
                          double slope) {
    const RM_V vc = V_SET1(cap), vic = V_SET1((RM_T)1 / cap);
    for (int r = 0; r < nr; r++) {
        RM_T *restrict row = s + r * lds;
        if (cap > 0)
            for (int64_t j = 0; j < ncol; j += RM_W)
                V_STORE(row + j, V_MUL(vc, FN(rm_tanh)(V_MUL(V_LOAD(row + j), vic))));
        if (ap) {
            const int64_t a = ap[r];
            for (int64_t j = 0; j < use; j++) {
                const int64_t dist = a > kq[j] ? a - kq[j] : kq[j] - a;
                row[j] -= (RM_T)(slope * (double)dist);
            }
        }
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

/* Online softmax over one strip: s (RM_R x ncol, ncol a multiple of RM_W, -inf past the
 * valid keys) becomes P in place; m, l, and the rows of o (RM_R x Dp) are rescaled, with
 * their compensations lc and oc (see rm_kadd); the strip's row sums go into l compensated.
 * rmax (RM_R x RM_W): lane-wise row maxima of s from rm_qk when have_max, else scratch.
 * The per-row statistics go through one vector exp, and the exp pass runs over the RM_R
 * rows at once (independent chains, one running sum per row). */
static inline void FN(rm_softmax)(RM_T *restrict s, int64_t lds, int64_t ncol, RM_T *restrict m,
                                  RM_T *restrict l, RM_T *restrict lc, RM_T *restrict o,
                                  RM_T *restrict oc, int64_t Dp, RM_T *restrict rmax,
                                  int have_max) {
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
     * multiple of KW, hence of NS W. */
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

/* Fold K/V into the state for query rows [q0, q1) of every (b, h) (the fields of a).
 * The K/V of one head are packed once (only the key blocks some query block sees) and serve
 * all its query heads (GQA) and rows; when `progress` is given it is called
 * ceil(B H (q1 - q0) / chunk) - 1 times, evenly spread over the query rows of all heads; a
 * nonzero return aborts the call (result -2).
 * Visibility (rm_vis): a key block is skipped for a query block when no row sees any of its
 * positions, computed without a mask when every row sees all of them; otherwise each strip
 * of RM_R rows is checked the same way and, when partly visible, scores only the keys from
 * the first to the last one any of its rows sees ([j0, j1)): by binary search when the
 * block's positions increase (each row's visible keys are one interval), else by a scan,
 * then masked per row (interval fill) or per element.
 * Returns the flops of the scored pairs: 4 D nr (j1 - j0) per computed strip of nr real rows
 * and head (4 nq nk D per block when nothing is masked); every visible pair is counted, so
 * this is at least 4 D times the visible pairs. -1 when out of memory. */
static int64_t FN(rm_tile)(const rm_tile_args *a) {
    const RM_T *q = a->q, *k = a->k, *v = a->v;
    RM_T *acc = a->acc, *m = a->m, *l = a->l;
    const int64_t *qpos = a->qpos, *kpos = a->kpos;
    const int64_t B = a->B, H = a->H, Hkv = a->Hkv, Sq = a->Sq, Sk = a->Sk, D = a->D;
    const int64_t q0 = a->q0, q1 = a->q1;
    int64_t bq = a->bq, bk = a->bk;
    if (q1 <= q0 || Sk == 0) return 0;
    const rm_vis vis = {a->lo, a->hi, qpos, a->lo ? 0 : (int)a->causal};
    const RM_T cap = a->softcap > 0 ? (RM_T)a->softcap : 0;
    const int mods = cap > 0 || a->slopes; /* score modifiers: the maxima are recomputed */
    const int64_t G = H / Hkv;
    const int64_t Dp = (D + RM_W - 1) / RM_W * RM_W;
    bk = (bk + KW - 1) / KW * KW;
    bq = (bq + RM_R - 1) / RM_R * RM_R;
    rm_block *qb = malloc(sizeof(rm_block) * (size_t)(q1 - q0 + 1));
    rm_block *kb = malloc(sizeof(rm_block) * (size_t)(Sk + 1));
    rm_range *qr = malloc(sizeof(rm_range) * (size_t)(q1 - q0 + 1));
    char *need = malloc((size_t)(Sk + 1));
    int64_t *koff = malloc(sizeof(int64_t) * (size_t)(Sk + 2));
    RM_T *kt = NULL, *vp = NULL, *qs = NULL, *ob = NULL, *mb = NULL, *lb = NULL, *sb = NULL;
    RM_T *oc = NULL, *lc = NULL; /* compensations of ob and lb (rm_kadd) */
    int64_t flops = 0;
    if (!qb || !kb || !qr || !need || !koff) {
        flops = -1;
        goto done;
    }
    const int64_t nqb = rm_blocks(qpos, q0, q1, a->qcuts, a->nqcuts, bq, qb);
    const int64_t nkb = rm_blocks(kpos, 0, Sk, a->kcuts, a->nkcuts, bk, kb);
    for (int64_t iq = 0; iq < nqb; iq++) qr[iq] = rm_rows_range(&vis, qb[iq].a, qb[iq].b);
    /* a key block no query block sees is neither packed nor visited */
    for (int64_t t = 0; t < nkb; t++) {
        need[t] = 0;
        for (int64_t iq = 0; iq < nqb && !need[t]; iq++)
            need[t] = !rm_hidden(&qr[iq], kb[t].lo, kb[t].hi);
    }
    /* packed offsets: block t uses whole panels */
    koff[0] = 0;
    for (int64_t t = 0; t < nkb; t++)
        koff[t + 1] = koff[t] + (kb[t].b - kb[t].a + KW - 1) / KW * KW;
    kt = rm_alloc(sizeof(RM_T) * (size_t)(koff[nkb] * D));
    vp = rm_alloc(sizeof(RM_T) * (size_t)(koff[nkb] * Dp));
    qs = rm_alloc(sizeof(RM_T) * (size_t)(bq * D));
    ob = rm_alloc(sizeof(RM_T) * (size_t)(bq * Dp));
    mb = rm_alloc(sizeof(RM_T) * (size_t)bq);
    lb = rm_alloc(sizeof(RM_T) * (size_t)bq);
    oc = rm_alloc(sizeof(RM_T) * (size_t)(bq * Dp));
    lc = rm_alloc(sizeof(RM_T) * (size_t)bq);
    sb = rm_alloc(sizeof(RM_T) * (size_t)(RM_R * bk));
    if (!kt || !vp || !qs || !ob || !mb || !lb || !sb || !oc || !lc) {
        flops = -1;
        goto done;
    }
    const RM_T sc = (RM_T)a->scale;
    RM_T rmax[RM_R * RM_W]; /* lane-wise row maxima of the current strip */
    const int64_t total = B * H * (q1 - q0); /* query rows of single heads */
    const int64_t ntarget = a->chunk > 0 ? (total + a->chunk - 1) / a->chunk - 1 : 0;
    int64_t rows_done = 0, ncalls = 0;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t hk = 0; hk < Hkv; hk++) {
            const RM_T *kh = k + (b * Hkv + hk) * Sk * D;
            const RM_T *vh = v + (b * Hkv + hk) * Sk * D;
            for (int64_t t = 0; t < nkb; t++)
                if (need[t])
                    FN(rm_pack)(kh, vh, kb[t].a, kb[t].b, D, Dp, kt + koff[t] * D,
                                vp + koff[t] * Dp);
            for (int64_t g = 0; g < G; g++) {
                const int64_t h = hk * G + g;
                const RM_T *qh = q + (b * H + h) * Sq * D;
                const double slope = a->slopes ? a->slopes[h] : 0;
                RM_T *ah = acc + (b * H + h) * Sq * D;
                RM_T *mh = m + (b * H + h) * Sq;
                RM_T *lh = l + (b * H + h) * Sq;
                for (int64_t iq = 0; iq < nqb; iq++) {
                    const int64_t qa = qb[iq].a, nq = qb[iq].b - qb[iq].a;
                    const int64_t nqp = (nq + RM_R - 1) / RM_R * RM_R;
                    /* load the state and the scaled queries; padded rows stay harmless */
                    memset(oc, 0, sizeof(RM_T) * (size_t)(nqp * Dp));
                    memset(lc, 0, sizeof(RM_T) * (size_t)nqp);
                    for (int64_t i = 0; i < nqp; i++) {
                        if (i < nq) {
                            const RM_T *qrow = qh + (qa + i) * D;
                            for (int64_t d = 0; d < D; d++) qs[i * D + d] = qrow[d] * sc;
                            memcpy(ob + i * Dp, ah + (qa + i) * D, (size_t)D * sizeof(RM_T));
                            for (int64_t d = D; d < Dp; d++) ob[i * Dp + d] = 0;
                            mb[i] = mh[qa + i];
                            lb[i] = lh[qa + i];
                        } else {
                            for (int64_t d = 0; d < D; d++) qs[i * D + d] = 0;
                            for (int64_t d = 0; d < Dp; d++) ob[i * Dp + d] = 0;
                            mb[i] = -INFINITY;
                            lb[i] = 0;
                        }
                    }
                    for (int64_t t = 0; t < nkb; t++) {
                        const int64_t klo = kb[t].lo, khi = kb[t].hi;
                        if (!need[t] || rm_hidden(&qr[iq], klo, khi)) continue;
                        const int block_full = rm_full(&qr[iq], klo, khi);
                        const int64_t ka = kb[t].a, nk = kb[t].b - kb[t].a;
                        const RM_T *ktb = kt + koff[t] * D, *vpb = vp + koff[t] * Dp;
                        const int64_t *kp = kpos + ka;
                        for (int64_t r0 = 0; r0 < nq; r0 += RM_R) {
                            const int64_t nr = nq - r0 < RM_R ? nq - r0 : RM_R; /* real rows */
                            /* keys [j0, j1) are scored; mode 0: every real row sees all of
                             * them, 1: row r sees [first[r], end[r]), 2: per-element test */
                            int64_t j0 = 0, j1 = nk, first[RM_R], end[RM_R];
                            int mode = 0;
                            if (!block_full) {
                                const rm_range sr = rm_rows_range(&vis, qa + r0, qa + r0 + nr);
                                if (rm_hidden(&sr, klo, khi)) continue;
                                if (!rm_full(&sr, klo, khi)) {
                                    if (kb[t].inc) { /* each row's visible keys: an interval */
                                        mode = 1;
                                        j0 = nk;
                                        j1 = 0;
                                        for (int r = 0; r < nr; r++) {
                                            int64_t lo, hi;
                                            rm_row(&vis, qa + r0 + r, &lo, &hi);
                                            int64_t f = rm_lower(kp, nk, lo);
                                            int64_t e = rm_upper(kp, nk, hi);
                                            if (f >= e) f = e = 0; /* sees none */
                                            else {
                                                j0 = f < j0 ? f : j0;
                                                j1 = e > j1 ? e : j1;
                                            }
                                            first[r] = f;
                                            end[r] = e;
                                        }
                                    } else { /* keys any row of the strip might see */
                                        mode = 2;
                                        j0 = -1;
                                        for (int64_t j = 0; j < nk; j++)
                                            if (sr.lo_min <= kp[j] && kp[j] <= sr.hi_max) {
                                                if (j0 < 0) j0 = j;
                                                j1 = j + 1;
                                            }
                                        if (j0 < 0) j0 = j1 = 0;
                                    }
                                    if (j1 <= j0) continue; /* no row of the strip sees a key */
                                }
                            }
                            /* panels from the one holding key j0 (a multiple of KW, so the
                             * row sums' lanes see the same columns on every vector path) */
                            const int64_t base = j0 / KW * KW, use = j1 - base;
                            const int64_t ucol = (use + KW - 1) / KW * KW;
                            FN(rm_qk)(qs + r0 * D, ktb + base * D, ucol / KW, D, sb, bk, rmax);
                            if (mods)
                                FN(rm_modify)(sb, bk, (int)nr, use, ucol, cap,
                                              a->slopes ? a->apos + qa + r0 : NULL, kp + base,
                                              slope);
                            for (int r = 0; r < RM_R; r++) {
                                RM_T *row = sb + r * bk;
                                if (r < nr && mode == 1) {
                                    int64_t f = first[r] - base, e = end[r] - base;
                                    f = f < 0 ? 0 : f;
                                    e = e > use ? use : e;
                                    e = e < f ? f : e;
                                    for (int64_t j = 0; j < f; j++) row[j] = -INFINITY;
                                    for (int64_t j = e; j < use; j++) row[j] = -INFINITY;
                                } else if (r < nr && mode == 2) {
                                    int64_t lo, hi;
                                    rm_row(&vis, qa + r0 + r, &lo, &hi);
                                    const int64_t *kq = kp + base;
                                    for (int64_t j = 0; j < use; j++)
                                        row[j] = lo <= kq[j] && kq[j] <= hi ? row[j] : -INFINITY;
                                }
                                for (int64_t j = use; j < ucol; j++) row[j] = -INFINITY;
                            }
                            /* the maxima from rm_qk hold unless keys were masked or padded */
                            const int have_max = mode == 0 && ucol == use && !mods;
                            FN(rm_softmax)(sb, bk, ucol, mb + r0, lb + r0, lc + r0, ob + r0 * Dp,
                                           oc + r0 * Dp, Dp, rmax, have_max);
                            FN(rm_pv)(sb, bk, vpb + base * Dp, use, Dp, ob + r0 * Dp,
                                      oc + r0 * Dp);
                            flops += 4 * nr * (j1 - j0) * D;
                        }
                    }
                    /* the state goes back with its compensation applied (o - c: one
                     * rounding); a NaN difference (inf - inf) keeps o itself */
                    for (int64_t i = 0; i < nq; i++) {
                        const RM_T *orow = ob + i * Dp, *crow = oc + i * Dp;
                        RM_T *arow = ah + (qa + i) * D;
                        for (int64_t d = 0; d < D; d++) {
                            const RM_T x = orow[d] - crow[d];
                            arow[d] = x == x ? x : orow[d];
                        }
                        mh[qa + i] = mb[i];
                        const RM_T x = lb[i] - lc[i];
                        lh[qa + i] = x == x ? x : lb[i];
                    }
                    /* progress: ceil(total / chunk) - 1 calls spread evenly over the work */
                    rows_done += nq;
                    while (a->progress && ncalls < ntarget &&
                           rows_done * (ntarget + 1) >= (ncalls + 1) * total) {
                        ncalls++;
                        if (a->progress()) {
                            flops = -2;
                            goto done;
                        }
                    }
                }
            }
        }
    }
done:
    free(qb);
    free(kb);
    free(qr);
    free(need);
    free(koff);
    free(kt);
    free(vp);
    free(qs);
    free(ob);
    free(mb);
    free(lb);
    free(sb);
    free(oc);
    free(lc);
    return flops;
}

int64_t FN(rm_forward_tile)(const rm_tile_args *a) { return FN(rm_tile)(a); }

/* Normalise the state in one pass: out = acc / l, lse = m + log(l); rows with l == 0 (no
 * visible key) give out 0 and lse -inf; NaN stays NaN. Same as ringmpi.softmax.finalize
 * (the division is IEEE division, as numpy's). out is (B, H, S, D), or (B, S, H, D) when
 * seq_major (the user-facing layout, saving a transposing copy). */
void FN(rm_finalize)(const RM_T *acc, const RM_T *m, const RM_T *l, int64_t B, int64_t H,
                     int64_t S, int64_t D, RM_T *out, RM_T *lse, int seq_major) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < S; i++) {
                const int64_t r = (b * H + h) * S + i;
                const RM_T li = l[r];
                const RM_T *a = acc + r * D;
                RM_T *o = out + (seq_major ? ((b * S + i) * H + h) * D : r * D);
                if (li != 0) { /* NaN included: it propagates */
                    int64_t d = 0;
                    const RM_V vl = V_SET1(li);
                    for (; d + RM_W <= D; d += RM_W) V_STORE(o + d, V_DIV(V_LOAD(a + d), vl));
                    for (; d < D; d++) o[d] = a[d] / li;
                    lse[r] = m[r] + RM_LOG1(li);
                } else {
                    for (int64_t d = 0; d < D; d++) o[d] = 0;
                    lse[r] = -INFINITY;
                }
            }
}

#undef FN
#undef NK
#undef KW
#undef NV
#undef KW_LINES
#undef NV_LINES
#undef NS
#endif
