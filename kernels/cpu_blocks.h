/* Block and mask bookkeeping of the fused CPU kernels (kernels/cpu_tile.c, cpu_backward.c).
 *
 * Integer work only: cutting positions into blocks (rm_blocks) that never cross the start
 * of a run of evenly spaced positions, each row's visible key range and its extremes over
 * a block of rows (rm_vis, rm_rows_range; the masks of ringmpi.mask: causal, or per-row
 * bounds lo[i] <= kpos[j] <= hi[i]), the tests that skip a block pair or leave it unmasked
 * (rm_hidden, rm_full), binary searches in increasing positions, and 64-byte aligned work
 * buffers. Included once by each kernel, after kernels/cpu_simd.h.
 */
#ifndef RM_CPU_BLOCKS_H
#define RM_CPU_BLOCKS_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RM_ALIGN 64

typedef struct {
    int64_t a, b;     /* index range [a, b) */
    int64_t lo, hi;   /* min and max position inside */
    int inc;          /* positions strictly increasing: visible keys form a prefix */
    int contig;       /* positions pos[a] + 0, 1, ..., b - a - 1 (consecutive; implies inc) */
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
        /* strictly increasing with last - first = n - 1: consecutive (unsigned: no overflow) */
        out[nb].contig = inc && (uint64_t)pos[b - 1] - (uint64_t)pos[a] == (uint64_t)(b - a - 1);
        out[nb].a = a;
        out[nb].b = b;
        out[nb].lo = lo;
        out[nb].hi = hi;
        nb++;
        a = b;
    }
    return nb;
}

/* A work buffer of at least `bytes`, 64-byte aligned (free() releases it); NULL when out of
 * memory. */
static void *rm_alloc(size_t bytes) {
    size_t n = (bytes + RM_ALIGN - 1) / RM_ALIGN * RM_ALIGN;
    return aligned_alloc(RM_ALIGN, n ? n : RM_ALIGN);
}

/* rm_alloc, zero filled. */
static inline void *rm_zalloc(size_t bytes) {
    const size_t n = (bytes + RM_ALIGN - 1) / RM_ALIGN * RM_ALIGN;
    void *p = rm_alloc(bytes);
    if (p) memset(p, 0, n ? n : RM_ALIGN);
    return p;
}

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

/* The keys of increasing kp[0..n) (n >= 1) a row with bounds [lo, hi] sees: [*f, *e) with
 * *f = rm_lower(kp, n, lo), *e = rm_upper(kp, n, hi). When contig (kp[j] = kp[0] + j, see
 * rm_block) the same indices by arithmetic (clamped to [0, n]; no overflow: a difference is
 * taken only between kp[0] and a value inside [kp[0], kp[n - 1]]), else by the searches. */
static inline void rm_span(const int64_t *kp, int64_t n, int contig, int64_t lo, int64_t hi,
                           int64_t *f, int64_t *e) {
    if (contig) {
        const int64_t k0 = kp[0], k1 = kp[n - 1];
        *f = lo <= k0 ? 0 : lo > k1 ? n : lo - k0;
        *e = hi < k0 ? 0 : hi >= k1 ? n : hi - k0 + 1;
    } else {
        *f = rm_lower(kp, n, lo);
        *e = rm_upper(kp, n, hi);
    }
}
#endif /* RM_CPU_BLOCKS_H */
