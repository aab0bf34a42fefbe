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
 * fully is not masked; inside the others each strip scores only the keys from the panel
 * holding its first visible key to the 64-byte group holding its last (a narrow window or a
 * short sequence costs about its width, not the block's).
 * The strip of scores stays in L1, the K/V block in L2 (prefetched into L1 a few iterations
 * ahead), the query block's Q and state in L2: memory traffic per flop is that of a blocked
 * matrix product and no (Sq x Sk) array exists.
 *
 * exp, tanh and the vector operations are the SIMD layer both fused kernels share
 * (kernels/cpu_simd.h, cpu_simd_type.h, which also holds the score modifiers); blocks and
 * visibility come from cpu_blocks.h; the strip operations (steps 1-3) are in cpu_tile_strip.h.
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
 * The file includes itself twice to instantiate float32 and float64 (RM_BITS 32 / 64 selects
 * the type, through cpu_simd_type.h).
 */
#ifndef RM_BITS
/* ===================================================================== common part ==== */
#include "cpu_simd.h"   /* vector types and operations per ISA, exp, register blocking */
#include "cpu_blocks.h" /* blocks of positions, visibility ranges, work buffers */

/* Register blocking (cpu_simd.h: RM_ISA_*): query rows per strip RM_R; vectors of keys per
 * QK^T register tile RM_NK and of D-columns per P.V register tile RM_NV. */
#ifndef RM_R
#define RM_R RM_ISA_R
#endif
#ifndef RM_NK
#define RM_NK RM_ISA_NK
#endif
#ifndef RM_NV
#define RM_NV RM_ISA_NV
#endif

/* Arguments of rm_forward_tile_f32/_f64 (mirrored by fused._TileArgs; rm_tile_args_size lets
 * the loader check the layout). Arrays are C-contiguous, of the function's element type:
 *   q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), acc (B, H, Sq, Dv), m and l
 *   (B, H, Sq) (Dv: the value width, which may differ from the key width D);
 *   qpos (Sq,), kpos (Sk,) int64 positions; qcuts (nqcuts,), kcuts (nkcuts,): ascending
 *   indices where runs of evenly spaced positions start (may be empty).
 * Query rows [q0, q1) are folded; bq, bk: block sizes (query rows, keys); progress (may be
 * NULL) is called ceil(rows of single heads / `chunk`) - 1 times, evenly over the work (not
 * the rows: a causal mask makes later rows dearer); nonzero aborts.
 * lo, hi (Sq,) int64 or both NULL: query row i sees key j iff lo[i] <= kpos[j] <= hi[i]
 * (lo > hi: no key), the masks beyond causal (ringmpi.mask); they replace `causal`, which
 * applies only without them (key j visible iff kpos[j] <= qpos[i]).
 * Score modifiers (ringmpi.scoremods; kernels/cpu_simd_type.h): mods, the bits of the active
 * slots (0: none), mparam (H, RM_NMODS) their parameters per query head (NULL when mods is
 * 0), mpos (Sq,) the query rows' positions in key coordinates (NULL unless a position slot
 * is active); applied in slot order before the mask hides keys. */
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
    uint32_t mods;        /* bits of the active score modifiers (0: none) */
    const double *mparam; /* (H, RM_NMODS) their parameters, or NULL */
    const int64_t *mpos;  /* (Sq,) the rows' positions in key coordinates, or NULL */
    int64_t Dv;           /* the value width: v, acc (D: the key width of q and k) */
} rm_tile_args;

int64_t rm_tile_args_size(void) { return (int64_t)sizeof(rm_tile_args); }

/* The ISA path this file was compiled for: the names fused.py uses. */
const char *rm_isa_name(void) { return rm_isa(); }

int rm_simd_width_bytes(void) { return rm_simd_bytes(); }

/* ----------------------------------------------------------- instantiate both types --- */
#define RM_BITS 32
#include "cpu_tile.c" /* this file again, now with RM_BITS defined */
#undef RM_BITS
#define RM_BITS 64
#include "cpu_tile.c"

/* The score-modifier slots this build implements (a bit per slot, cpu_simd_type.h). */
unsigned rm_tile_mods(void) { return RM_MODS_ALL; }

#else
/* ============================================================ type-generic part ==== */
#include "cpu_simd_type.h" /* RM_T, RM_V, V_* and FN of this RM_BITS; rm_tanh, modifiers */

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
 * V rows vp (b - a, Dp), zero padded past Dv (the value width). */
static void FN(rm_pack)(const RM_T *k, const RM_T *v, int64_t a, int64_t b, int64_t D,
                        int64_t Dv, int64_t Dp, RM_T *kt, RM_T *vp) {
    FN(rm_pack_panels)(k + a * D, b - a, D, KW, kt);
    FN(rm_pack_rows)(v + a * Dv, b - a, Dv, Dp, vp);
}

/* the strip operations: S = Qs K^T (rm_qk), the online softmax (rm_softmax), O += P V
 * (rm_pv, rm_kadd) */
#include "cpu_tile_strip.h"

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

/* Fold K/V into the state for query rows [q0, q1) of every (b, h) (the fields of a).
 * The K/V of one head are packed once (only the key blocks some query block sees) and serve
 * all its query heads (GQA) and rows; when `progress` is given it is called
 * ceil(B H (q1 - q0) / chunk) - 1 times, evenly spread over the work of all heads (each
 * query block's pairs, a partly visible block counted half); a nonzero return aborts the
 * call (result -2).
 * Visibility (rm_vis): a key block is skipped for a query block when no row sees any of its
 * positions, computed without a mask when every row sees all of them; otherwise each strip
 * of RM_R rows is checked the same way and, when partly visible, scores only the keys from
 * the first to the last one any of its rows sees ([j0, j1)): when the block's positions
 * increase each row's visible keys are one interval, found by arithmetic when they are
 * consecutive, else by binary search (rm_span); otherwise by a scan,
 * then masked per row (interval fill) or per element.
 * Returns the flops of the scored pairs: 2 (D + Dv) nr (j1 - j0) per computed strip of nr
 * real rows and head (4 nq nk D per block when nothing is masked and Dv = D); every visible
 * pair is counted, so this is at least 2 (D + Dv) times the visible pairs. -1 when out of
 * memory. */
static int64_t FN(rm_tile)(const rm_tile_args *a) {
    const RM_T *q = a->q, *k = a->k, *v = a->v;
    RM_T *acc = a->acc, *m = a->m, *l = a->l;
    const int64_t *qpos = a->qpos, *kpos = a->kpos;
    const int64_t B = a->B, H = a->H, Hkv = a->Hkv, Sq = a->Sq, Sk = a->Sk, D = a->D;
    const int64_t Dv = a->Dv; /* the value width: v, acc and the P.V columns */
    const int64_t q0 = a->q0, q1 = a->q1;
    int64_t bq = a->bq, bk = a->bk;
    if (q1 <= q0 || Sk == 0) return 0;
    const rm_vis vis = {a->lo, a->hi, qpos, a->lo ? 0 : (int)a->causal};
    const int64_t G = H / Hkv;
    const int64_t Dp = (Dv + RM_W - 1) / RM_W * RM_W; /* V rows and O, padded to vectors */
    bk = (bk + KW - 1) / KW * KW;
    bq = (bq + RM_R - 1) / RM_R * RM_R;
    rm_block *qb = malloc(sizeof(rm_block) * (size_t)(q1 - q0 + 1));
    rm_block *kb = malloc(sizeof(rm_block) * (size_t)(Sk + 1));
    rm_range *qr = malloc(sizeof(rm_range) * (size_t)(q1 - q0 + 1));
    char *need = malloc((size_t)(Sk + 1));
    int64_t *koff = malloc(sizeof(int64_t) * (size_t)(Sk + 2));
    double *qw = malloc(sizeof(double) * (size_t)(q1 - q0 + 1));
    RM_T *kt = NULL, *vp = NULL, *qs = NULL, *ob = NULL, *mb = NULL, *lb = NULL, *sb = NULL;
    RM_T *oc = NULL, *lc = NULL; /* compensations of ob and lb (rm_kadd) */
    int64_t flops = 0;
    if (!qb || !kb || !qr || !need || !koff || !qw) {
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
    /* each query block's work (pairs it scores, a partly visible block counted half), so
     * that the progress calls come evenly in time: under a causal mask the first rows of a
     * sequence cost next to nothing, the last ones the most */
    double wtotal = 0;
    for (int64_t iq = 0; iq < nqb; iq++) {
        double w = 0;
        for (int64_t t = 0; t < nkb; t++)
            if (!rm_hidden(&qr[iq], kb[t].lo, kb[t].hi))
                w += (double)(qb[iq].b - qb[iq].a) * (double)(kb[t].b - kb[t].a) *
                     (rm_full(&qr[iq], kb[t].lo, kb[t].hi) ? 1.0 : 0.5);
        qw[iq] = w;
        wtotal += w;
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
    int64_t ncalls = 0;
    double work_done = 0; /* of B * H * wtotal: the progress calls are spread over it */
    const double work_all = (double)(B * H) * wtotal;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t hk = 0; hk < Hkv; hk++) {
            const RM_T *kh = k + (b * Hkv + hk) * Sk * D;
            const RM_T *vh = v + (b * Hkv + hk) * Sk * Dv;
            for (int64_t t = 0; t < nkb; t++)
                if (need[t])
                    FN(rm_pack)(kh, vh, kb[t].a, kb[t].b, D, Dv, Dp, kt + koff[t] * D,
                                vp + koff[t] * Dp);
            for (int64_t g = 0; g < G; g++) {
                const int64_t h = hk * G + g;
                const RM_T *qh = q + (b * H + h) * Sq * D;
                /* the head's score modifiers; with any, the maxima are recomputed */
                const FN(rm_mods) hm = FN(rm_mods_load)(a->mods, a->mparam, h);
                RM_T *ah = acc + (b * H + h) * Sq * Dv;
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
                            memcpy(ob + i * Dp, ah + (qa + i) * Dv, (size_t)Dv * sizeof(RM_T));
                            for (int64_t d = Dv; d < Dp; d++) ob[i * Dp + d] = 0;
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
                                            int64_t f, e;
                                            rm_span(kp, nk, kb[t].contig, lo, hi, &f, &e);
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
                            /* scored columns: whole 64-byte groups (the row sums' lanes);
                             * the panels' columns past them would score -inf after masking */
                            const int64_t ucol = (use + NS * RM_W - 1) / (NS * RM_W) * NS * RM_W;
                            const int64_t pcol = (use + KW - 1) / KW * KW; /* panels' end */
                            FN(rm_qk)(qs + r0 * D, ktb + base * D, ucol, D, sb, bk, rmax);
                            if (hm.bits) /* the scored columns [0, ucol), real keys < use */
                                for (int r = 0; r < nr; r++)
                                    FN(rm_mods_row)(&hm, sb + r * bk, NULL, 0, ucol, use,
                                                    kp + base,
                                                    a->mpos ? a->mpos + qa + r0 + r : NULL);
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
                            const int have_max = mode == 0 && pcol == use && !hm.bits;
                            FN(rm_softmax)(sb, bk, ucol, pcol > ucol, mb + r0, lb + r0, lc + r0,
                                           ob + r0 * Dp, oc + r0 * Dp, Dp, rmax, have_max);
                            FN(rm_pv)(sb, bk, vpb + base * Dp, use, Dp, ob + r0 * Dp,
                                      oc + r0 * Dp);
                            flops += 2 * nr * (j1 - j0) * (D + Dv);
                        }
                    }
                    /* the state goes back with its compensation applied (o - c: one
                     * rounding); a NaN difference (inf - inf) keeps o itself */
                    for (int64_t i = 0; i < nq; i++) {
                        const RM_T *orow = ob + i * Dp, *crow = oc + i * Dp;
                        RM_T *arow = ah + (qa + i) * Dv;
                        for (int64_t d = 0; d < Dv; d++) {
                            const RM_T x = orow[d] - crow[d];
                            arow[d] = x == x ? x : orow[d];
                        }
                        mh[qa + i] = mb[i];
                        const RM_T x = lb[i] - lc[i];
                        lh[qa + i] = x == x ? x : lb[i];
                    }
                    /* progress: ceil(total / chunk) - 1 calls spread evenly over the work */
                    work_done += qw[iq];
                    while (a->progress && ncalls < ntarget &&
                           work_done * (double)(ntarget + 1) >= (double)(ncalls + 1) * work_all) {
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
    free(qw);
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

#undef NK
#undef KW
#undef NV
#undef KW_LINES
#undef NV_LINES
#undef NS
#endif
