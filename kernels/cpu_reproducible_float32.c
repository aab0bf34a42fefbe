/* Reproducible mode, float32 inputs (issue 40): the one pass of ringmpi/reproducible_float32.py
 * over one K/V block of whole global key blocks (256 keys each). The pass itself is
 * kernels/cpu_reproducible_window.h, included twice: rmf_block (float32, below) and rmd_block
 * (float64 inputs: the multiply-then-add chains, the float64 method's scores and det_exp,
 * four levels; see "float64 inputs" further down).
 *
 * Loaded by ringmpi/cpu/fused_reproducible_float32.py (compiled per ISA path and cached like
 * the fused tiles). The same numbers as the numpy oracle, bit for bit, on every ISA path:
 *
 *   t      t_j = fma(qs_{D-1}, k_{D-1,j}, ... fma(qs_0, k_0j, 0)): float32 fused multiply-adds
 *          over the head dim in index order (qs: q x scale x log2 e, rounded by the caller);
 *          -inf for an invisible key and the padding past the block's last key;
 *   p      m = the block's max t (NaN wins), r = ceil(m), p_j = rmf_exp2(t_j - r), float32;
 *   sums   per chain of 64 keys: lsub = a fixed tree sum of its p, osub_d = fma chain of
 *          p_j v_jd in key order from 0, float32; lb = ((l0 + l1) + l2) + l3 and ob
 *          likewise in float64;
 *   fold   (lb, ob) x 2^(r - Rw), Rw = 32 ceil(r / 32), split on the window's grids and added
 *          to the row's levels, which move down when a higher window arrives (rmf_fold).
 *
 * Why the ISA cannot change the bits: a fused multiply-add rounds once (IEEE 754 fusedMultiplyAdd)
 * on every path: the AVX-512 and AVX2 paths use the instruction, the scalar path computes the
 * product exactly in float64 and rounds the sum to odd before rounding it to float32 (the same
 * value; the numpy oracle does the same, fma32). Every other operation is a float32 or float64
 * basic operation written in one order; the file is compiled with -ffp-contract=off and
 * without -ffast-math (cpu_reproducible_math.h checks what the preprocessor can see), so the
 * compiler may vectorize across rows, keys and columns but neither fuse nor reassociate.
 */
#include <stdlib.h>

#include "cpu_reproducible_math.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

const char *rmf_isa_name(void) { return RMR_ISA; }
int rmf_simd_width_bytes(void) { return RMR_WIDTH; }

#define RMF_BK 256  /* keys per global key block */
#define RMF_CH 64   /* keys per float32 chain of the block sums */
#define RMF_NC (RMF_BK / RMF_CH)
#define RMF_F 3     /* levels (reproducible_float32.FOLDS; rmf_fold writes the 3 out) */
#define RMF_W 32.0  /* the window, in powers of two (reproducible_float32.WINDOW) */

/* float32 vectors of the path's native width (zmm, ymm, or xmm on the scalar path: GCC splits
 * wider generic vectors into scalar code for some operations): lane-wise IEEE operations */
#if defined(__AVX512F__)
#define RMF_VB 64
#elif defined(__AVX2__) && defined(__FMA__)
#define RMF_VB 32
#else
#define RMF_VB 16
#endif
#define RMF_VN (RMF_VB / 4)
/* float64 vectors of the native width, and the float32 vectors they convert from */
typedef double vd __attribute__((vector_size(RMF_VB), aligned(8), may_alias));
typedef float vfh __attribute__((vector_size(RMF_VB / 2), aligned(4), may_alias));
#define RMF_DN (RMF_VB / 8)
typedef float vf __attribute__((vector_size(RMF_VB), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(RMF_VB), aligned(4), may_alias));
static inline vf ldf(const float *p) { return *(const vf *)p; }
static inline void stf(float *p, vf x) { *(vf *)p = x; }
static inline vf self(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
/* x in every lane, bit for bit (-0 stays -0) */
static inline vf splat(float x) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(x);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){x, x, x, x};
#endif
}

/* Register blocking (the bits do not depend on it: every score and every sum is its own chain
 * of operations): RMF_R query rows x RMF_NK vectors of keys for the scores, x RMF_NV vectors
 * of columns for P V; R x N accumulators + N loads + 1 broadcast fit the register file (as the
 * default mode's tiles, kernels/cpu_simd.h). A k^T panel holds RMF_K keys. */
#define RMF_R 6
#if defined(__AVX512F__)
#define RMF_NK 4
#define RMF_NV 4
#elif defined(__AVX2__) && defined(__FMA__)
#define RMF_NK 2
#define RMF_NV 2
#else
#define RMF_NK 4
#define RMF_NV 4
#endif
#define RMF_K (RMF_NK * RMF_VN)  /* keys per panel */
#define RMF_CW (RMF_NV * RMF_VN) /* columns per P V tile */

int64_t rmf_tile_keys(void) { return RMF_BK; }
int64_t rmf_panel_keys(void) { return RMF_K; }
int64_t rmf_column_width(void) { return RMF_CW; }
int64_t rmf_levels(void) { return RMF_F; }

/* fma(a, b, c) lane by lane, rounded once per lane (the instruction, or rmr_fmaf's exact emulation) */
static inline vf rmf_fmav(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int l = 0; l < RMF_VN; l++) a[l] = rmr_fmaf(a[l], b[l], c[l]);
    return a;
#endif
}

/* m where it is a number and not x <= m, else m: a running maximum in which a NaN, once in,
 * stays (x NaN: taken; m NaN: kept) */
static inline vf rmf_max(vf m, vf x) { return self((m == m) & ~(x <= m), x, m); }

/* 2^x lane by lane, x <= 0 or NaN (reproducible_float32.exp2f): n = round(x) by 1.5 * 2^23,
 * f = x - n (exact), the degree-7 Taylor polynomial of e^(f ln 2) by Horner's rule (one
 * fused multiply-add per step), times 2^n from the exponent bits; 0 below -125. */
static const float rmf_c[8] = {
    0x1p+0f, 0x1.62e43p-1f, 0x1.ebfbep-3f, 0x1.c6b08ep-5f,
    0x1.3b2ab6p-7f, 0x1.5d87fep-10f, 0x1.430912p-13f, 0x1.ffcbfcp-17f,
};
static inline vf rmf_exp2(vf x) {
    const vf zero = {0};
    /* below -125: x = -127, so n = -127, f = 0, p = 1 and 2^n has the bits of +0: y = +0
     * with no select at the end; a NaN x goes through (its lanes' y unused) */
    const vf xc = self(x < zero - 125.0f, zero - 127.0f, x);
    const vf n = (xc + 12582912.0f) - 12582912.0f;
    const vf f = xc - n;
    vf p = rmf_fmav(zero + rmf_c[7], f, zero + rmf_c[6]);
    for (int i = 5; i >= 0; i--) p = rmf_fmav(p, f, zero + rmf_c[i]);
    const vi ni = __builtin_convertvector(n, vi); /* an integer: exact (NaN: unused) */
    const vf two_n = (vf)((ni + 127) << 23);
    return self(x != x, x, p * two_n);
}

/* reproducible_float32.tree64: a = ((p[0:16] + p[16:32]) + p[32:48]) + p[48:64] lane by lane,
 * then halves added: 16 -> 8 -> 4 -> 2 -> 1. In vectors of 8 on every path (GCC splits them
 * where the path is narrower): lo = a[0:8], hi = a[8:16], then the halves of each sum. */
typedef float rmf_v8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef float rmf_v4 __attribute__((vector_size(16)));
typedef float rmf_v2 __attribute__((vector_size(8)));
static inline float rmf_tree64(const float *p) {
    const rmf_v8 *x = (const rmf_v8 *)p; /* x[k]: p[8 k .. 8 k + 8) */
    const rmf_v8 lo = ((x[0] + x[2]) + x[4]) + x[6], hi = ((x[1] + x[3]) + x[5]) + x[7];
    const rmf_v8 h8 = lo + hi;
    const rmf_v4 h4 = (rmf_v4){h8[0], h8[1], h8[2], h8[3]} + (rmf_v4){h8[4], h8[5], h8[6], h8[7]};
    const rmf_v2 h2 = (rmf_v2){h4[0], h4[1]} + (rmf_v2){h4[2], h4[3]};
    return h2[0] + h2[1];
}

static inline double rmf_pow2(int64_t n) { /* 2^n, -1022 <= n <= 1023 */
    const uint64_t b = (uint64_t)(n + 1023) << 52;
    double x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* The float32 instance of the pass (cpu_reproducible_window.h): fma chains, rmf_exp2, the
 * chains' float32 sums widened to float64 for the folds; exported as rmf_block. */
#define W_T float
#define W_V vf
#define W_VN RMF_VN
#define W_MASK_T int32_t
#define W_MASKV vi
#define W_R RMF_R
#define W_NK RMF_NK
#define W_NV RMF_NV
#define W_K RMF_K
#define W_CW RMF_CW
#define W_F RMF_F
#define W_LD ldf
#define W_ST stf
#define W_SEL self
#define W_SPLAT splat
#define W_MAX rmf_max
#define W_MADD(b, x, a) rmf_fmav(b, x, a)
#define W_TREE64 rmf_tree64
#define W_REF(m) (__builtin_ceilf(m) + 0.0f) /* -0 -> +0 */
#define W_WIDE(p) __builtin_convertvector(*(const vfh *)(p), vd)
#define FN(x) rmf_##x
/* p_j = rmf_exp2(t_j - r): the chains are the scores in base 2 already (qs = q x C) */
static inline void rmf_weights(float *t, float r, double scale) {
    (void)scale;
    for (int64_t j = 0; j < RMF_BK; j += RMF_VN) stf(t + j, rmf_exp2(ldf(t + j) - r));
}
#include "cpu_reproducible_window.h"

/* ============================================================== float64 inputs ====
 * The same pass in float64 (float64 inputs, issue 40): the score and P V chains multiply and
 * then add (two roundings per step, no fused operation: numpy's products and sums); the
 * scores s = chain x scale as the float64 method's (reproducible.scores), a block's
 * reference r = ceil(max s / ln 2) and p = det_exp(s - r ln 2) (rmd_weights); the 64-key
 * chains' sums already float64, and RMD_F = 4 levels (docs/reproducible.md). */
#define RMD_F 4
#define RMD_R 4 /* 4 rows x 2 vectors: 8 accumulators, room for the products between them */
#define RMD_K (2 * RMF_DN)  /* keys per k^T panel */
#define RMD_CW (2 * RMF_DN) /* columns per P V tile */
typedef int64_t vl __attribute__((vector_size(RMF_VB), aligned(8), may_alias));
static inline vd ldd(const double *p) { return *(const vd *)p; }
static inline void std_(double *p, vd x) { *(vd *)p = x; }
static inline vd seld(vl m, vd a, vd b) { return (vd)(((vl)a & m) | ((vl)b & ~m)); }
static inline vd splatd(double x) { /* every lane x, bit for bit (-0 stays -0) */
    vd v;
    for (int l = 0; l < RMF_DN; l++) v[l] = x;
    return v;
}
static inline vd rmd_max(vd m, vd x) { return seld((m == m) & ~(x <= m), x, m); }

int64_t rmd_panel_keys(void) { return RMD_K; }
int64_t rmd_column_width(void) { return RMD_CW; }
int64_t rmd_levels(void) { return RMD_F; }

/* reproducible_float32.tree64 in float64: a = ((p[0:16] + p[16:32]) + p[32:48]) + p[48:64]
 * lane by lane, then halves added: 16 -> 8 -> 4 -> 2 -> 1 (vectors of 4 on every path) */
typedef double rmd_v4 __attribute__((vector_size(32), aligned(8), may_alias));
typedef double rmd_v2 __attribute__((vector_size(16)));
static inline double rmd_tree64(const double *p) {
    const rmd_v4 *x = (const rmd_v4 *)p; /* x[k]: p[4 k .. 4 k + 4) */
    rmd_v4 a[4];
    for (int q = 0; q < 4; q++) a[q] = ((x[q] + x[4 + q]) + x[8 + q]) + x[12 + q];
    const rmd_v4 h8a = a[0] + a[2], h8b = a[1] + a[3]; /* h8 = a[0:8] + a[8:16] */
    const rmd_v4 h4 = h8a + h8b;
    const rmd_v2 h2 = (rmd_v2){h4[0], h4[1]} + (rmd_v2){h4[2], h4[3]};
    return h2[0] + h2[1];
}

#define W_T double
#define W_V vd
#define W_VN RMF_DN
#define W_MASK_T int64_t
#define W_MASKV vl
#define W_R RMD_R
#define W_NK 2
#define W_NV 2
#define W_K RMD_K
#define W_CW RMD_CW
#define W_F RMD_F
#define W_LD ldd
#define W_ST std_
#define W_SEL seld
#define W_SPLAT splatd
#define W_MAX rmd_max
#define W_MADD(b, x, a) ((a) + (b) * (x))
#define W_TREE64 rmd_tree64
#define W_REF(m) (__builtin_ceil(((m) * scale) * RMR_INVLN2) + 0.0) /* -0 -> +0 */
#define W_WIDE(p) (*(const vd *)(p))
#define FN(x) rmd_##x
/* p_j = det_exp((s_j - r ln2_hi) - r ln2_lo), s_j = t_j x scale (rmr_exp8: the float64
 * method's exp): r ln2_hi is exact (32 significant bits) for |r| < 2^21 */
static inline void rmd_weights(double *t, double r, double scale) {
    const double hi = r * RMR_LN2HI, lo = r * RMR_LN2LO;
    for (int64_t j = 0; j < RMF_BK; j += 8) st8(t + j, rmr_exp8(((ld8(t + j) * scale) - hi) - lo));
}
#include "cpu_reproducible_window.h"

/* The forward's end for float32 outputs (ringmpi.reproducible.finish's operations on o):
 * out[bb][i][h][c] = (float)((((O_0 + O_1) + O_2) x a) / l) for the row (bb, h, i) where
 * l > 0, else +0; the product only where a is given (the sinks). olev: (B, H, Sq, 3, Dv) the
 * row's levels; l, a: (B, H, Sq) float64; out: (B, Sq, H, Dv) float32. One pass over the
 * levels instead of numpy's five. */
int64_t rmf_finish(const double *olev, const double *l, const double *a, int64_t B, int64_t H,
                   int64_t Sq, int64_t Dv, float *out) {
    if (B < 0 || H < 0 || Sq < 0 || Dv < 1) return -1;
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Sq; i++) {
                const int64_t row = (bb * H + h) * Sq + i;
                const double *o = olev + row * RMF_F * Dv, lr = l[row];
                float *y = out + ((bb * Sq + i) * H + h) * Dv;
                if (!(lr > 0.0)) {
                    for (int64_t c = 0; c < Dv; c++) y[c] = 0.0f;
                    continue;
                }
                if (a) {
                    const double ar = a[row];
                    for (int64_t c = 0; c < Dv; c++)
                        y[c] = (float)((((o[c] + o[Dv + c]) + o[2 * Dv + c]) * ar) / lr);
                } else {
                    for (int64_t c = 0; c < Dv; c++)
                        y[c] = (float)(((o[c] + o[Dv + c]) + o[2 * Dv + c]) / lr);
                }
            }
    return 0;
}

/* ===================================================================== the backward ====
 * One (query block, key block) tile of the float32 method's backward
 * (reproducible_float32._backward_tile, its numpy oracle; rmf_backward runs the tiles of a
 * ring step as reproducible_float32.backward_step does), every batch and head. Rows and
 * keys come in chains of 64 (a block's rows i0 + 64 a.., its keys 64 c..; past the block's
 * last row or key, zero padding that no row sees). Per (batch, head) and sub-tile (a, c)
 * in which some row sees some key (others are skipped: they would add +0):
 *
 *   t_ij  = fma chain over d of qs_id k_jd from +0 (the forward's scores)
 *   u_ij  = min((t_ij - lh_i) - ll_i, 2) (lh + ll: lse / ln 2 split in two float32)
 *   p_ij  = rmf_exp2(u_ij) where row i sees key j, else 0
 *   dp_ij = fma chain over d of do_id v_jd from +0;   ds_ij = p_ij (dp_ij - dl_i)
 *   dq_ic = fma chain over the chain's 64 keys of ds_ij k_jd, from +0, key order
 *   dk_ja = fma chain over the chain's 64 rows of ds_ij q_id, from +0, row order
 *   dv_ja = fma chain over the chain's 64 rows of p_ij do_id, from +0, row order
 *
 * The block partials are float64 sums from +0 in chain order: dQ_i = (0 + dq_i0) + dq_i1 ..
 * over c, dK_j, dV_j over a; each is folded on the caller's grids into its fold sums
 * (for f < F: hi = (x + g_f) - g_f, sum_f += hi, x = x - hi), whose every addition is exact.
 * All five products are one register-tiled pattern (rmf_chain, rmf_chain_add), the same
 * operations lane by lane whatever the tiling or the vector width. The key chains run outer,
 * the row chains inner: a key chain's dk, dv partials are then complete and folded at once;
 * the tile's dq partials collect the key chains in order (the sums and their orders are
 * those above). */

/* register tiles of the chains: RMF_BR outputs x RMF_BN vectors (RMF_BR x RMF_BN accumulators,
 * RMF_BN loads and a broadcast in the register file), the last 64 % RMF_BR outputs 4 at a time */
#if defined(__AVX512F__)
#define RMF_BR 12
#else
#define RMF_BR 6
#endif
#define RMF_BN 2
#define RMF_BW (RMF_BN * RMF_VN) /* the columns of one register tile; D is padded to them */
#define RMF_MAXF 4               /* fold levels at most (ringmpi.reproducible.folds) */
#define RMF_KG 4                 /* key blocks per group of a ring step (rmf_backward) */

int64_t rmf_backward_width(void) { return RMF_BW; }

/* x's lanes as float64 (exact): lo the first half, hi the second (in registers; a copy through
 * memory cost about a tenth of the added chains) */
static inline void rmf_widen(vf x, vd *lo, vd *hi) {
#if defined(__AVX512F__)
    *lo = (vd)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)x));
    *hi = (vd)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)x), 1)));
#elif defined(__AVX2__) && defined(__FMA__)
    *lo = (vd)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)x));
    *hi = (vd)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)x, 1));
#else
    vfh half[2];
    memcpy(half, &x, sizeof half);
    *lo = __builtin_convertvector(half[0], vd);
    *hi = __builtin_convertvector(half[1], vd);
#endif
}

/* How a chain's vector of results leaves: stored as float32, or added to float64 sums
 * (o = o + (double)x: one rounding-free conversion and one float64 addition per lane) */
static inline void rmf_put(float *o, vf x) { stf(o, x); }
static inline void rmf_put_add(double *o, vf x) {
    vd lo, hi;
    rmf_widen(x, &lo, &hi);
    *(vd *)o = *(vd *)o + lo;
    *(vd *)(o + RMF_DN) = *(vd *)(o + RMF_DN) + hi;
}

/* NR outputs from a, columns col < nc (a multiple of RMF_BW): the fma chain over t < n of
 * a[r ao + t at] x[t ldx + col + c RMF_VN], from +0, put (PUT: rmf_put or rmf_put_add) at
 * out[r ldo + col + c RMF_VN] */
#define RMF_CHAIN_ROWS(NAME, NR, OUT_T, PUT)                                                  \
    static inline void NAME(const float *a, int64_t ao, int64_t at, const float *x,           \
                            int64_t ldx, int64_t n, int64_t nc, OUT_T *out, int64_t ldo) {    \
        for (int64_t col = 0; col < nc; col += RMF_BW) {                                      \
            vf acc[NR][RMF_BN];                                                               \
            _Pragma("GCC unroll 16") for (int r = 0; r < NR; r++)                             \
                _Pragma("GCC unroll 4") for (int c = 0; c < RMF_BN; c++) acc[r][c] = (vf){0}; \
            for (int64_t t = 0; t < n; t++) {                                                 \
                vf xv[RMF_BN];                                                                \
                _Pragma("GCC unroll 4") for (int c = 0; c < RMF_BN; c++)                      \
                    xv[c] = ldf(x + t * ldx + col + c * RMF_VN);                              \
                _Pragma("GCC unroll 16") for (int r = 0; r < NR; r++) {                       \
                    const vf b = splat(a[r * ao + t * at]);                                   \
                    _Pragma("GCC unroll 4") for (int c = 0; c < RMF_BN; c++)                  \
                        acc[r][c] = rmf_fmav(b, xv[c], acc[r][c]);                            \
                }                                                                             \
            }                                                                                 \
            _Pragma("GCC unroll 16") for (int r = 0; r < NR; r++)                             \
                _Pragma("GCC unroll 4") for (int c = 0; c < RMF_BN; c++)                      \
                    PUT(out + r * ldo + col + c * RMF_VN, acc[r][c]);                         \
        }                                                                                     \
    }
RMF_CHAIN_ROWS(rmf_chain_main, RMF_BR, float, rmf_put)
RMF_CHAIN_ROWS(rmf_chain_four, 4, float, rmf_put)
RMF_CHAIN_ROWS(rmf_chain_add_main, RMF_BR, double, rmf_put_add)
RMF_CHAIN_ROWS(rmf_chain_add_four, 4, double, rmf_put_add)

/* out[o][col] for o < 64: RMF_BR outputs at a time, then 4 (64 = 4 mod RMF_BR) */
static void rmf_chain(const float *a, int64_t ao, int64_t at, const float *x, int64_t ldx,
                      int64_t n, int64_t nc, float *out, int64_t ldo) {
    int64_t o = 0;
    for (; o + RMF_BR <= RMF_CH; o += RMF_BR)
        rmf_chain_main(a + o * ao, ao, at, x, ldx, n, nc, out + o * ldo, ldo);
    for (; o < RMF_CH; o += 4) rmf_chain_four(a + o * ao, ao, at, x, ldx, n, nc, out + o * ldo, ldo);
}

/* out[o][col] += (double)chain for o < 64, the same tiling */
static void rmf_chain_add(const float *a, int64_t ao, int64_t at, const float *x, int64_t ldx,
                          int64_t n, int64_t nc, double *out, int64_t ldo) {
    int64_t o = 0;
    for (; o + RMF_BR <= RMF_CH; o += RMF_BR)
        rmf_chain_add_main(a + o * ao, ao, at, x, ldx, n, nc, out + o * ldo, ldo);
    for (; o < RMF_CH; o += 4)
        rmf_chain_add_four(a + o * ao, ao, at, x, ldx, n, nc, out + o * ldo, ldo);
}
_Static_assert(RMF_CH % RMF_BR % 4 == 0, "the chains' last outputs go 4 at a time");
_Static_assert(RMF_VN == 2 * RMF_DN, "a float32 vector converts to two float64 vectors");

/* Fold x[0..n) into the sums s[f][0..n) on the grid rows g[f][0..n), f < F: per column
 * y = x, then for each level h = (y + g_f) - g_f, s_f += h, y = y - h (the last y unused);
 * 2 and 3 levels written out (one pass over the columns), the same operations */
static void rmf_fold_row(const double *restrict x, int64_t n, int64_t F, double *const s[],
                         const double *const g[]) {
    if (F == 2) {
        double *restrict s0 = s[0], *restrict s1 = s[1];
        const double *restrict g0 = g[0], *restrict g1 = g[1];
        for (int64_t d = 0; d < n; d++) {
            const double y = x[d], h0 = (y + g0[d]) - g0[d];
            const double y1 = y - h0, h1 = (y1 + g1[d]) - g1[d];
            s0[d] = s0[d] + h0;
            s1[d] = s1[d] + h1;
        }
        return;
    }
    if (F == 3) {
        double *restrict s0 = s[0], *restrict s1 = s[1], *restrict s2 = s[2];
        const double *restrict g0 = g[0], *restrict g1 = g[1], *restrict g2 = g[2];
        for (int64_t d = 0; d < n; d++) {
            const double y = x[d], h0 = (y + g0[d]) - g0[d];
            const double y1 = y - h0, h1 = (y1 + g1[d]) - g1[d];
            const double y2 = y1 - h1, h2 = (y2 + g2[d]) - g2[d];
            s0[d] = s0[d] + h0;
            s1[d] = s1[d] + h1;
            s2[d] = s2[d] + h2;
        }
        return;
    }
    double y[n];
    for (int64_t d = 0; d < n; d++) y[d] = x[d];
    for (int64_t f = 0; f < F; f++) {
        double *sf = s[f];
        const double *gf = g[f];
        for (int64_t d = 0; d < n; d++) {
            const double h = (y[d] + gf[d]) - gf[d];
            sf[d] = sf[d] + h;
            y[d] = y[d] - h;
        }
    }
}

/* The tile. Arrays (C-contiguous; "rows" of the dealt query rows, "keys" of the key arrays):
 * qs, q: (B, H, Sq, Dkp); dO: (B, H, Sq, Dvp); lh, ll, dl: (B, H, Sq) float32; k: (B, Hkv, Sk,
 * Dkp), v: (B, Hkv, Sk, Dvp) float32 (columns past Dk, Dv zero; Dkp, Dvp multiples of RMF_BW).
 * The tile: rows row0 .. row0 + nr - 1 (nr <= 256; the arrays hold zero rows up to the next
 * multiple of 64), keys key0 .. key0 + nk - 1 (nk <= 256, zero keys likewise) at the global
 * positions kpos0, kpos0 + 1, ...; lo, hi (nlay, Sq): row i sees position p when
 * lo[l][i] <= p <= hi[l][i] for some l.
 * qgrid (F, B, H, Dk), kgrid (F, B, Hkv, Dk), vgrid (F, B, Hkv, Dv): the grids; dq[f]: the
 * tile's first row's dq fold sums, (b, h, i) strides dqs; dk[f], dv[f]: the tile's first key's
 * sums, (b, kv head, j) strides dks, dvs; the last axis contiguous.
 * pmax: the largest p (NaN if some p is NaN); pairs: the visible (row, key) pairs.
 * Returns 0; -1 for a bad argument; -2 without scratch memory. */
static int64_t rmf_backward_tile(const float *qs, const float *q, const float *dO, const float *lh,
                     const float *ll, const float *dl, const float *k, const float *v,
                     const int64_t *lo, const int64_t *hi, int64_t nlay, int64_t B, int64_t H,
                     int64_t Hkv, int64_t Sq, int64_t Sk, int64_t Dk, int64_t Dkp, int64_t Dv,
                     int64_t Dvp, int64_t row0, int64_t nr, int64_t key0, int64_t nk,
                     int64_t kpos0, int64_t F, const double *qgrid, const double *kgrid,
                     const double *vgrid, double *const *dq, const int64_t *dqs,
                     double *const *dk, const int64_t *dks, double *const *dv,
                     const int64_t *dvs, double *pmax, int64_t *pairs) {
    if (B < 0 || H < 1 || Hkv < 1 || H % Hkv || nr < 0 || nr > RMF_BK || nk < 0 || nk > RMF_BK ||
        Dk < 1 || Dv < 1 || Dkp < Dk || Dvp < Dv || Dkp % RMF_BW || Dvp % RMF_BW || nlay < 1 ||
        F < 1 || F > RMF_MAXF || row0 < 0 || key0 < 0 || !pmax || !pairs)
        return -1;
    const int64_t na = (nr + RMF_CH - 1) / RMF_CH, nc = (nk + RMF_CH - 1) / RMF_CH;
    if (row0 + na * RMF_CH > Sq || key0 + nc * RMF_CH > Sk) return -1;
    *pmax = 0.0;
    *pairs = 0;
    if (B == 0 || nr == 0 || nk == 0) return 0;
    const int64_t g = H / Hkv;
    const size_t nkt = (size_t)RMF_BK * (Dk + Dv);
    const size_t n32 = nkt + 2 * RMF_CH * RMF_CH;
    const size_t n64 = (size_t)RMF_BK * Dkp + (size_t)RMF_CH * (Dkp + Dvp);
    /* scratch kept per thread between calls (fresh pages on every call cost ~6%) */
    static __thread double *buf64 = NULL;
    static __thread float *buf32 = NULL;
    static __thread size_t have64 = 0, have32 = 0;
    if (n64 > have64 || n32 > have32) {
        free(buf64);
        free(buf32);
        buf64 = malloc(n64 * sizeof(double));
        buf32 = malloc(n32 * sizeof(float));
        have64 = buf64 && buf32 ? n64 : 0;
        have32 = buf64 && buf32 ? n32 : 0;
        if (!have64) return -2;
    }
    float *kT = buf32, *vT = kT + (size_t)RMF_BK * Dk; /* per chain c: (D, 64), all written */
    float *sp = vT + (size_t)RMF_BK * Dv, *dpds = sp + RMF_CH * RMF_CH;
    /* the block partials: dq of the tile's rows (256, Dkp); dk, dv of one key chain */
    double *dq64 = buf64, *dk64 = dq64 + (size_t)RMF_BK * Dkp, *dv64 = dk64 + RMF_CH * Dkp;
    /* visibility: bit j of seen[i][j / 64] when row i of the tile sees key j (consecutive
     * positions); a sub-tile (a, c) is 0 (no row sees a key: skipped), 1 (every row of
     * the 64 sees every key of the 64: no mask) or 2 (the lanes masked from the bits) */
    uint64_t seen[RMF_BK][RMF_NC];
    int sub[RMF_NC][RMF_NC];
    int64_t count = 0;
    memset(seen, 0, sizeof seen);
    for (int64_t i = 0; i < nr; i++)
        for (int64_t l = 0; l < nlay; l++) {
            int64_t a = lo[l * Sq + row0 + i] - kpos0, b = hi[l * Sq + row0 + i] - kpos0;
            a = a < 0 ? 0 : a;
            b = b > nk - 1 ? nk - 1 : b;
            for (int64_t w = a / RMF_CH; a <= b && w <= b / RMF_CH; w++) {
                const int64_t s0 = w * RMF_CH > a ? 0 : a - w * RMF_CH;
                const int64_t s1 = (w + 1) * RMF_CH - 1 < b ? RMF_CH - 1 : b - w * RMF_CH;
                seen[i][w] |= (~(uint64_t)0 >> (RMF_CH - 1 - s1 + s0)) << s0; /* bits s0..s1 */
            }
        }
    for (int64_t a = 0; a < RMF_NC; a++)
        for (int64_t c = 0; c < RMF_NC; c++) {
            uint64_t any = 0, all = ~(uint64_t)0;
            for (int64_t i = a * RMF_CH; i < (a + 1) * RMF_CH; i++) {
                any |= seen[i][c];
                all &= seen[i][c];
                count += __builtin_popcountll(seen[i][c]);
            }
            sub[a][c] = any == 0 ? 0 : all == ~(uint64_t)0 ? 1 : 2;
        }
    *pairs = count;
    vf pm = {0};
    vi nanv = {0};
    for (int64_t bb = 0; bb < B; bb++)
        for (int64_t kh = 0; kh < Hkv; kh++) {
            const float *kb = k + ((bb * Hkv + kh) * Sk + key0) * Dkp;
            const float *vb = v + ((bb * Hkv + kh) * Sk + key0) * Dvp;
            /* k^T, v^T per chain of 64 keys: (D, 64) */
            for (int64_t c = 0; c < nc; c++)
                for (int64_t j = 0; j < RMF_CH; j++) {
                    const float *kj = kb + (c * RMF_CH + j) * Dkp, *vj = vb + (c * RMF_CH + j) * Dvp;
                    for (int64_t d = 0; d < Dk; d++) kT[(c * Dk + d) * RMF_CH + j] = kj[d];
                    for (int64_t d = 0; d < Dv; d++) vT[(c * Dv + d) * RMF_CH + j] = vj[d];
                }
            for (int64_t h = kh * g; h < (kh + 1) * g; h++) {
                const int64_t hr = (bb * H + h) * Sq + row0;
                const double *gq[RMF_MAXF], *gk[RMF_MAXF], *gv[RMF_MAXF];
                for (int64_t f = 0; f < F; f++) {
                    gq[f] = qgrid + ((f * B + bb) * H + h) * Dk;
                    gk[f] = kgrid + ((f * B + bb) * Hkv + kh) * Dk;
                    gv[f] = vgrid + ((f * B + bb) * Hkv + kh) * Dv;
                }
                double *acc[RMF_MAXF];
                for (size_t x = 0; x < (size_t)na * RMF_CH * Dkp; x++) dq64[x] = 0.0;
                /* key chains outer: a chain's dk, dv partials (64 keys) are complete after
                 * the row chains and folded at once; the dq partials of the tile's rows
                 * collect the key chains in order (the same sums in the same order) */
                for (int64_t c = 0; c < nc; c++) {
                    int any = 0;
                    for (size_t x = 0; x < (size_t)RMF_CH * (Dkp + Dvp); x++) dk64[x] = 0.0;
                    for (int64_t a = 0; a < na; a++) {
                        if (!sub[a][c]) continue;
                        any = 1;
                        const int64_t ir = hr + a * RMF_CH; /* the chain's first row */
                        const float *qsa = qs + ir * Dkp, *qa = q + ir * Dkp, *doa = dO + ir * Dvp;
                        rmf_chain(qsa, Dkp, 1, kT + c * Dk * RMF_CH, RMF_CH, Dk, RMF_CH, sp, RMF_CH);
                        rmf_chain(doa, Dvp, 1, vT + c * Dv * RMF_CH, RMF_CH, Dv, RMF_CH, dpds,
                                  RMF_CH);
                        const vf two = (vf){0} + 2.0f, zero = {0};
                        vi lane_bit;
                        for (int l = 0; l < RMF_VN; l++) lane_bit[l] = 1 << l;
                        for (int64_t i = 0; i < RMF_CH; i++) {
                            const vf lhi = splat(lh[ir + i]), lli = splat(ll[ir + i]);
                            const vf dli = splat(dl[ir + i]);
                            const uint64_t bits = seen[a * RMF_CH + i][c];
                            float *si = sp + i * RMF_CH, *di = dpds + i * RMF_CH;
                            for (int64_t j = 0; j < RMF_CH; j += RMF_VN) {
                                vf u = (ldf(si + j) - lhi) - lli;
                                u = self(u > two, two, u);
                                vf p = rmf_exp2(u);
                                if (sub[a][c] == 2) /* lane l: key j + l seen */
                                    p = self(((vi){0} + (int32_t)(bits >> j) & lane_bit) != 0,
                                             p, zero);
                                stf(si + j, p);
                                stf(di + j, p * (ldf(di + j) - dli));
                                nanv |= p != p;
                                pm = self(p > pm, p, pm);
                            }
                        }
                        /* the chains added to the block partials (padded columns: + 0) */
                        rmf_chain_add(dpds, RMF_CH, 1, kb + c * RMF_CH * Dkp, Dkp, RMF_CH, Dkp,
                                      dq64 + a * RMF_CH * Dkp, Dkp);
                        rmf_chain_add(dpds, 1, RMF_CH, qa, Dkp, RMF_CH, Dkp, dk64, Dkp);
                        rmf_chain_add(sp, 1, RMF_CH, doa, Dvp, RMF_CH, Dvp, dv64, Dvp);
                    }
                    if (!any) continue; /* nothing added: the folds would add +0 */
                    for (int64_t j = 0; j < RMF_CH && c * RMF_CH + j < nk; j++) {
                        const int64_t jl = c * RMF_CH + j;
                        for (int64_t f = 0; f < F; f++)
                            acc[f] = dk[f] + bb * dks[0] + kh * dks[1] + jl * dks[2];
                        rmf_fold_row(dk64 + j * Dkp, Dk, F, acc, gk);
                        for (int64_t f = 0; f < F; f++)
                            acc[f] = dv[f] + bb * dvs[0] + kh * dvs[1] + jl * dvs[2];
                        rmf_fold_row(dv64 + j * Dvp, Dv, F, acc, gv);
                    }
                }
                for (int64_t i = 0; i < nr; i++) {
                    for (int64_t f = 0; f < F; f++)
                        acc[f] = dq[f] + bb * dqs[0] + h * dqs[1] + i * dqs[2];
                    rmf_fold_row(dq64 + i * Dkp, Dk, F, acc, gq);
                }
            }
        }
    float m = 0.0f;
    int nan = 0;
    for (int l = 0; l < RMF_VN; l++) {
        nan |= nanv[l] != 0;
        m = pm[l] > m ? pm[l] : m;
    }
    *pmax = nan ? NAN : (double)m;
    return 0;
}

/* One ring step: every (256-row block, 256-key block) tile of the rows 0 .. nrows - 1 and the
 * keys 0 .. nkeys - 1 (at the global positions kpos0, kpos0 + 1, ...; kpos0 a block's first)
 * in which some row's ranges meet the block's positions (rmf_backward_tile skips the
 * 64 x 64 sub-tiles that no row sees). The arrays as rmf_backward_tile takes them; dq[f]: the
 * fold sums of row 0, dk[f], dv[f]: those of key 0. pmax, pairs: over the tiles; cells: the
 * tiles' rows x keys. Returns 0, -1 for a bad argument, -2 without scratch memory. */
int64_t rmf_backward(const float *qs, const float *q, const float *dO, const float *lh,
                     const float *ll, const float *dl, const float *k, const float *v,
                     const int64_t *lo, const int64_t *hi, int64_t nlay, int64_t B, int64_t H,
                     int64_t Hkv, int64_t Sq, int64_t Sk, int64_t Dk, int64_t Dkp, int64_t Dv,
                     int64_t Dvp, int64_t nrows, int64_t nkeys, int64_t kpos0, int64_t F,
                     const double *qgrid, const double *kgrid, const double *vgrid,
                     double *const *dq, const int64_t *dqs, double *const *dk,
                     const int64_t *dks, double *const *dv, const int64_t *dvs, double *pmax,
                     int64_t *pairs, int64_t *cells) {
    if (nrows < 0 || nkeys < 0 || nrows > Sq || nkeys > Sk || nlay < 1 || F < 1 ||
        F > RMF_MAXF || !pmax || !pairs || !cells)
        return -1;
    *pmax = 0.0;
    *pairs = 0;
    *cells = 0;
    int nan = 0;
    /* groups of RMF_KG key blocks, each against every row block: the fold sums of the group's
     * keys stay in the caches while the rows pass (the order changes no bit: every fold sum
     * is exact) */
    for (int64_t g0 = 0; g0 < nkeys; g0 += RMF_KG * RMF_BK)
    for (int64_t r0 = 0; r0 < nrows; r0 += RMF_BK) {
        const int64_t nr = nrows - r0 < RMF_BK ? nrows - r0 : RMF_BK;
        int64_t blo = INT64_MAX, bhi = INT64_MIN; /* the union of the block's ranges */
        for (int64_t l = 0; l < nlay; l++)
            for (int64_t i = r0; i < r0 + nr; i++) {
                const int64_t a = lo[l * Sq + i], b = hi[l * Sq + i];
                if (a > b) continue;
                blo = a < blo ? a : blo;
                bhi = b > bhi ? b : bhi;
            }
        for (int64_t c0 = g0; c0 < nkeys && c0 < g0 + RMF_KG * RMF_BK; c0 += RMF_BK) {
            const int64_t nk = nkeys - c0 < RMF_BK ? nkeys - c0 : RMF_BK;
            if (blo > kpos0 + c0 + nk - 1 || bhi < kpos0 + c0) continue;
            double *dqf[RMF_MAXF], *dkf[RMF_MAXF], *dvf[RMF_MAXF];
            for (int64_t f = 0; f < F; f++) {
                dqf[f] = dq[f] + r0 * dqs[2];
                dkf[f] = dk[f] + c0 * dks[2];
                dvf[f] = dv[f] + c0 * dvs[2];
            }
            double pm;
            int64_t pr;
            const int64_t rc = rmf_backward_tile(
                qs, q, dO, lh, ll, dl, k, v, lo, hi, nlay, B, H, Hkv, Sq, Sk, Dk, Dkp, Dv, Dvp, r0,
                nr, c0, nk, kpos0 + c0, F, qgrid, kgrid, vgrid, dqf, dqs, dkf, dks, dvf, dvs, &pm,
                &pr);
            if (rc) return rc;
            nan |= pm != pm;
            *pmax = pm > *pmax ? pm : *pmax;
            *pairs += pr;
            *cells += nr * nk;
        }
    }
    if (nan) *pmax = NAN;
    return 0;
}
