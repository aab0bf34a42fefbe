// Shared by attention_fwd.cu and attention_bwd.cu (each includes it): storage
// types, constants, the scalar / tensor-core / async-copy helpers, the block
// plan tests and the score modifiers.
//
// The score-modifier math (the slots, RingMods, ring_mods_load, ring_modify,
// ring_modify_d and the softcap / ALiBi helpers under them) is RING_HD: __host__
// __device__ under nvcc / NVRTC, plain inline C++ under a host compiler, so
// tests/gpu/test_header.py compiles it with g++ and checks it against numpy (the
// only part of the CUDA arithmetic that runs without a GPU). Everything else here
// is device code, compiled only by nvcc / NVRTC.
//
// The loader (ringmpi/gpu/sources.py) splices this file in place of the
// `#include "attention_common.cuh"` line of each .cu file, so NVRTC needs no
// include path and the header's text is part of every kernel cache key.

#ifndef RM_ATTENTION_COMMON_CUH
#define RM_ATTENTION_COMMON_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define RING_DEVICE_CODE 1
#define RING_HD __host__ __device__ __forceinline__
#else
#include <math.h>
#define RING_HD inline
#endif

typedef unsigned short u16;
struct half_t { u16 x; };  // IEEE binary16 bits
struct bf16_t { u16 x; };  // bfloat16 bits (upper half of a float32)

#define RING_LOG2E 1.4426950408889634f
#define RING_LN2 0.6931471805599453f
#define RING_POS_MAX 0x7fffffffffffffffLL

#ifdef RING_DEVICE_CODE
// ----------------------------------------------------------------------------
// scalar helpers
// ----------------------------------------------------------------------------
template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
  return __longlong_as_double(0xfff0000000000000LL);
}

template <typename A> __device__ __forceinline__ A to_acc(float x);
template <typename A> __device__ __forceinline__ A to_acc(double x);
template <> __device__ __forceinline__ float to_acc<float>(float x) { return x; }
template <> __device__ __forceinline__ double to_acc<double>(double x) { return x; }
template <typename A> __device__ __forceinline__ A to_acc(half_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.x));
  return (A)f;
}
template <typename A> __device__ __forceinline__ A to_acc(bf16_t x) {
  return (A)__int_as_float(((unsigned)x.x) << 16);
}

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }

template <typename A> __device__ __forceinline__ A maxa(A a, A b) { return a > b ? a : b; }

// 2^x with the MUFU unit; 2^-inf = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ----------------------------------------------------------------------------
// long sums (issue 20). A float32 total that every key of a row (or every query
// row of a key) is added to rounds each term against an ever larger total:
// with values that have a mean the error grows with the key count. So no
// accumulator here takes a row-long chain: each block's part is summed from
// zero and added to the running state once, either by compensated (Kahan)
// summation (CUDA-core forward) or, where registers are short (tensor-core
// kernels, backward), the register partial goes to the stored state every
// RING_FLUSH_KEYS keys (or query rows) and starts again from zero.
// ----------------------------------------------------------------------------
#define RING_FLUSH_KEYS 1024  // keys (query rows) per register partial, tensor-core kernels
#define RING_FLUSH_BLOCKS 64  // blocks per register partial, CUDA-core backward kernels

// rounded once and never contracted with a neighbouring product into an FMA
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

// o + x by compensated (Kahan) summation: the state is o - c (c holds the
// rounding error of o so far); a NaN compensation (from an infinite o) is
// replaced by 0, so inf and NaN behave as in plain summation.
template <typename A> __device__ __forceinline__ A kahan_add(A o, A x, A& c) {
  const A y = sub_rn(x, c);
  const A t = add_rn(o, y);
  const A e = sub_rn(sub_rn(t, o), y);
  c = (e == e) ? e : A(0);
  return t;
}

// ----------------------------------------------------------------------------
// tensor-core helpers (sm_80+): m16n8k16 MMA, ldmatrix, cp.async
// ----------------------------------------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (unsigned)a;
}

// 16-byte async copy global -> shared; bytes = 0 fills the 16 bytes with zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices, transposed on the way: thread (g = lane/4, t = lane%4)
// gets elements [2t][g] and [2t+1][g] of each matrix (low half = row 2t).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2,
                                                  unsigned& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr(p)));
}

// Four 8x8 b16 matrices as stored, from a 32-bit shared address: thread
// (g, t) gets elements [g][2t] and [g][2t+1] of each matrix; lanes 8i..8i+7
// give the row addresses of matrix i. _trans: elements [2t][g] and [2t+1][g].
__device__ __forceinline__ void ldsm_x4(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <typename T> struct Mma;

template <> struct Mma<half_t> {
  // c (16x8, f32) += a (16x16, row) * b (16x8, col)
  static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0,
                                             unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // two floats -> packed pair, lo in the low 16 bits (PTX puts operand a high)
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <> struct Mma<bf16_t> {
  static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0,
                                             unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

#define RING_POS_MIN (-RING_POS_MAX - 1)

// Block plan tests (see `bounds` above). env = bounds; q block qb of nqb.
// Whether some row of q block qb may see a key with position in [klo, khi].
__device__ __forceinline__ bool block_live(const long long* env, int nqb, int qb, long long klo,
                                           long long khi) {
  return env[qb] <= khi && klo <= env[3 * nqb + qb];
}
// Whether every row of q block qb sees every key with position in [klo, khi].
__device__ __forceinline__ bool block_full(const long long* env, int nqb, int qb, long long klo,
                                           long long khi) {
  return env[nqb + qb] <= klo && khi <= env[2 * nqb + qb];
}
// First key block at or after kb that some row of q block qb sees.
__device__ __forceinline__ int next_kblock(int kb, int nkb, const long long* env, int nqb,
                                           int qb) {
  const long long* klo = env + 4 * nqb;
  while (kb < nkb && !block_live(env, nqb, qb, klo[kb], klo[nkb + kb])) ++kb;
  return kb;
}
// Visible key positions [lo, hi] of query row `row` (< Sq): row_lo/row_hi
// when given, else causal (up to the query's own position) or every key.
__device__ __forceinline__ void row_range(const long long* row_lo, const long long* row_hi,
                                          const long long* q_pos, int causal, int row,
                                          long long& lo, long long& hi) {
  if (row_lo != nullptr) {
    lo = row_lo[row];
    hi = row_hi[row];
  } else {
    lo = RING_POS_MIN;
    hi = causal ? q_pos[row] : RING_POS_MAX;
  }
}
#endif  // RING_DEVICE_CODE

// ----------------------------------------------------------------------------
// score modifiers (ringmpi/scoremods.py is the spec: registry, slots, numpy math),
// host and device. Every kernel takes them as its last three arguments:
//   unsigned mods          bit RM_MOD_<slot> set: that modifier applies (0: none)
//   const double* mparam   (H, RM_NMODS) row-major: mparam[h * RM_NMODS + slot], the
//                          parameters of query head h (null when mods == 0)
//   const long long* mpos  (Sq,) the rows' positions in key coordinates, given (not
//                          null) iff an active modifier reads positions (RM_POS_MODS)
// A kernel loads the parameters of a head once (ring_mods_load; kept in registers or
// shared memory) and sends each scaled score through ring_modify (forward) or
// ring_modify_d (backward: also d s'/d s). The slots are applied in slot order, before
// the mask; no kernel names a modifier. A new modifier = one slot below: its define
// (and RM_POS_MODS if it reads positions), a RingMods field, a line in ring_mods_load
// and its math in ring_modify / ring_modify_d.
// ----------------------------------------------------------------------------
#define RM_NMODS 4        // columns of mparam (scoremods.NMODS)
#define RM_MOD_SOFTCAP 0  // s = c tanh(s / c)                 mparam[., 0] = c > 0
#define RM_MOD_ALIBI 1    // s -= slope_h |mpos[i] - k_pos[j]|  mparam[h, 1] = slope_h

// the slots whose math reads positions (mpos, k_pos): mpos is given when one is active
#define RM_POS_MODS (1u << RM_MOD_ALIBI)

// whether slot `slot` is active in the bits `mods`
RING_HD bool ring_mod_on(unsigned mods, int slot) { return ((mods >> slot) & 1u) != 0u; }
// whether an active modifier reads positions: the kernels load the rows' mpos and the
// keys' positions for ring_modify only then (else they pass 0)
RING_HD bool ring_mods_pos(unsigned mods) { return (mods & RM_POS_MODS) != 0u; }

RING_HD float ring_tanh(float x) { return tanhf(x); }
RING_HD double ring_tanh(double x) { return tanh(x); }

// Softcap c > 0 of a scaled score x: c tanh(x / c). The base-2 kernels pass x and c
// times log2(e) (the tanh argument, so the derivative, is the same).
template <typename A> RING_HD A softcap_value(A x, A cap) { return cap * ring_tanh(x / cap); }

// The capped score c tanh(x / c), and in `grad` its derivative d/dx = 1 - tanh^2(x / c)
// (= 1 - (s_c / c)^2 for the capped score s_c): what the backward multiplies dS by.
// t is kept rather than recovered as s_c / c: the operations of the numpy spec.
template <typename A> RING_HD A softcap_apply(A x, A cap, A& grad) {
  const A t = ring_tanh(x / cap);
  grad = (A)1 - t * t;
  return cap * t;
}

// ALiBi term of the row at key-coordinate position qa and the key at kp:
// -slope |qa - kp| (the distance converted to A first, exact below 2^24 in float).
template <typename A> RING_HD A alibi_term(A slope, long long qa, long long kp) {
  return -(slope * (A)(qa > kp ? qa - kp : kp - qa));
}

// The parameters of one query head in the kernel's type A, each multiplied by the
// kernel's score unit if it is score-linear (the base-2 kernels work on x log2(e):
// unit = log2(e); the others pass 1). 0 for an inactive slot.
template <typename A> struct RingMods {
  A cap;    // RM_MOD_SOFTCAP: c, times unit
  A slope;  // RM_MOD_ALIBI: slope_h, times unit
};

// RingMods of query head h; reads mparam only for the active slots.
template <typename A>
RING_HD RingMods<A> ring_mods_load(unsigned mods, const double* mparam, int h, A unit) {
  RingMods<A> p;
  const long long row = (long long)h * RM_NMODS;
  p.cap = ring_mod_on(mods, RM_MOD_SOFTCAP) ? (A)mparam[row + RM_MOD_SOFTCAP] * unit : (A)0;
  p.slope = ring_mod_on(mods, RM_MOD_ALIBI) ? (A)mparam[row + RM_MOD_ALIBI] * unit : (A)0;
  return p;
}

// One scaled score x (times unit) of the row at position qa (mpos) and the key at
// position kp, through every active modifier in slot order. pos = false: qa / kp are
// no real positions (a padding key), the position terms are left out (that score is
// never stored). qa and kp are read only by position modifiers (RM_POS_MODS).
template <typename A>
RING_HD A ring_modify(unsigned mods, const RingMods<A>& p, A x, long long qa, long long kp,
                      bool pos = true) {
  if (ring_mod_on(mods, RM_MOD_SOFTCAP)) x = softcap_value(x, p.cap);
  if (ring_mod_on(mods, RM_MOD_ALIBI) && pos) x += alibi_term(p.slope, qa, kp);
  return x;
}

// ring_modify, and in dx the derivative d s'/d s of the modified score: the product of
// the active modifiers' derivatives (softcap: 1 - tanh^2(x / c); ALiBi: 1), 1 when none.
template <typename A>
RING_HD A ring_modify_d(unsigned mods, const RingMods<A>& p, A x, long long qa, long long kp,
                        A& dx, bool pos = true) {
  A d = (A)1;
  if (ring_mod_on(mods, RM_MOD_SOFTCAP)) {
    A g;
    x = softcap_apply(x, p.cap, g);
    d *= g;
  }
  if (ring_mod_on(mods, RM_MOD_ALIBI) && pos) x += alibi_term(p.slope, qa, kp);
  dx = d;
  return x;
}

#endif  // RM_ATTENTION_COMMON_CUH
