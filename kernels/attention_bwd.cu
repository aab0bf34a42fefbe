// Backward attention tiles for the ring loop: add one visiting K/V block's
// contribution to dQ, dK and dV (same math as backward_tile in
// ringmpi/cpu/numpy_tile.py, which is the specification).
//
// Its storage types, conversions, Mma<T>, ldsm_x4*, cp_async16, the block plan
// tests (block_live, block_full, next_kblock), row_range and the score modifiers
// come from attention_common.cuh, shared with attention_fwd.cu.
//
// Layouts (row-major, contiguous):
//   q, dout : (B, H,   Sq, ld)  storage type T (rounded to k's type by the host)
//   k, v    : (B, Hkv, Sk, ld)  query head h reads K/V head h / (H / Hkv)
//   lse     : (B, H, Sq)        type A; -inf for a row that sees no key
//   delta   : (B, H, Sq)        type A; delta_i = dout_i . out_i
//   dq      : (B, H, Sq, D)     type A, accumulated (+=)
//   dk, dv  : (B, Hkv, Sk, D)   type A, accumulated (+=), summed over the G
//                               query heads of each K/V head
//   q_pos, k_pos, row_lo, row_hi, bounds: as in attention_fwd.cu (query i sees
//             key j iff row_lo[i] <= k_pos[j] <= row_hi[i]; null row_lo/row_hi:
//             causal or every key), the block plan over q blocks of BM rows
//             and k blocks of BN keys of the kernel
//   mods, mparam, mpos : the score modifiers, last arguments of every kernel, as in
//             attention_fwd.cu (bits of the active slots, 0: none; (H, RM_NMODS)
//             float64 parameters or null; the rows' positions (Sq,) int64 or null)
//
// For one head, with x_ij = scale q_i.k_j and s_ij = ring_modify(x_ij) (every active
// modifier of attention_common.cuh), P_ij = exp(s_ij - lse_i) over the visible pairs:
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta) * ds/dx,  dQ = scale dS K,
//   dK = scale dS^T Q,
// where ds/dx is the modifiers' derivative (ring_modify_d; 1 without modifiers).
// A block pair the plan marks as not live is skipped, a full one needs no
// mask, the others are masked per element (P = 0 outside [lo, hi]). A row
// with lse = -inf saw no key: P = exp(s - +inf) = 0, no gradient. Two
// kernels, no atomics: dkdv owns a key block and loops over the query blocks
// of all G heads; dq owns a query block and loops over the key blocks (S and
// dP are computed in both). No register total takes every query row (dK, dV)
// or every key (dQ): the partials are added to dk, dv, dq every
// RING_FLUSH_KEYS rows/keys (tensor cores) or RING_FLUSH_BLOCKS blocks (CUDA
// cores, whose blocks are summed from zero first); see "long sums" in
// attention_common.cuh.

#include "attention_common.cuh"

// base-2 log-sum-exp of a row: +inf for a row without keys (or padding), so
// exp2(s - lse2) = 0 there
__device__ __forceinline__ float lse_base2(float lse, bool valid) {
  return (!valid || lse == neg_inf<float>()) ? -neg_inf<float>() : lse * RING_LOG2E;
}
// First query block at or after qb in which some row sees a key of the
// block with positions in [klo, khi] (the mirror of next_kblock).
__device__ __forceinline__ int next_qblock(int qb, int nqb, const long long* env, long long klo,
                                           long long khi) {
  while (qb < nqb && !block_live(env, nqb, qb, klo, khi)) ++qb;
  return qb;
}
template <typename A> __device__ __forceinline__ A lse_natural(A lse, bool valid) {
  return (!valid || lse == neg_inf<A>()) ? -neg_inf<A>() : lse;
}

// ----------------------------------------------------------------------------
// fp16 / bf16 tensor-core kernels (m16n8k16 MMAs, fp32 accumulation; P and
// dS are rounded to T before they enter an MMA, as in FlashAttention-2).
// HD = head dim padded to a multiple of 32; ld (a multiple of 8) is the row
// stride of q, dout, k, v, whose pointers are 16-byte aligned.
// ----------------------------------------------------------------------------

// dK, dV of one block of 64 keys (4 warps x 16 keys) for K/V head hk of batch
// b: grid (nkb, Hkv, B). Loops over the visible q blocks of BM rows of each of
// the G query heads; Q/dO tiles are double-buffered with cp.async. Per warp,
// in registers: S^T = K Q^T and dP^T = V dO^T (16 x BM), dV += P^T dO and
// dK += dS^T Q (16 x HD).
// Dynamic shared memory: (2 * 64 + 4 BM) (HD + 8) sizeof(T) + 2 BM * 16 bytes.
template <typename T, int HD, int BM>
__global__ void __launch_bounds__(128, 1)
    attn_bwd_dkdv_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      const T* __restrict__ dout, const float* __restrict__ lse,
                      const float* __restrict__ delta, float* __restrict__ dk,
                      float* __restrict__ dv, const long long* __restrict__ q_pos,
                      const long long* __restrict__ k_pos, const long long* __restrict__ bounds,
                      const long long* __restrict__ row_lo, const long long* __restrict__ row_hi,
                      int H, int Hkv, int Sq, int Sk, int D, int ld, float scale, int causal,
                      unsigned mods, const double* __restrict__ mparam,
                      const long long* __restrict__ mpos) {
  constexpr int BN = 64, NTHREADS = 128, LDS = HD + 8;
  constexpr int KD = HD / 16, NTQ = BM / 8, NTO = HD / 8, CH = HD / 8;
  constexpr unsigned ROWB = LDS * sizeof(T);
  static_assert(HD % 32 == 0 && HD <= 128 && BM % 16 == 0, "tile sizes");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);  // [BN][LDS]
  T* Vs = Ks + BN * LDS;                   // [BN][LDS]
  T* Qs = Vs + BN * LDS;                   // [2][BM][LDS]
  T* Os = Qs + 2 * BM * LDS;               // [2][BM][LDS]  dO
  long long* Pl = reinterpret_cast<long long*>(Os + 2 * BM * LDS);  // [2][BM] row lo
  long long* Ph = Pl + 2 * BM;                                      // [2][BM] row hi
  float* Ls = reinterpret_cast<float*>(Ph + 2 * BM);                // [2][BM] lse, base 2
  float* Es = Ls + 2 * BM;                                          // [2][BM] delta

  const int kb = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int G = H / Hkv;
  const int nqb = (Sq + BM - 1) / BM, nkb = (Sk + BN - 1) / BN;
  const long long klo_me = bounds[4 * nqb + kb], khi_me = bounds[4 * nqb + nkb + kb];
  int qb = next_qblock(0, nqb, bounds, klo_me, khi_me);
  if (qb >= nqb) return;  // no query sees these keys: gradients unchanged

  const long long krow0 = ((long long)b * Hkv + hk) * Sk;
  const int k0 = kb * BN;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gr = lane >> 2, tg = lane & 3;

  for (int i = tid; i < BN * CH; i += NTHREADS) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = (k0 + r < Sk) && (c < ld);
    const long long off = ok ? (krow0 + k0 + r) * ld + c : 0;
    cp_async16(Ks + r * LDS + c, k + off, ok ? 16 : 0);
    cp_async16(Vs + r * LDS + c, v + off, ok ? 16 : 0);
  }
  cp_commit();
  auto load_q = [&](int st, int qblock, int hq) {
    const long long qrow0 = ((long long)b * H + hq) * Sq;
    const int q0 = qblock * BM;
    for (int i = tid; i < BM * CH; i += NTHREADS) {
      const int r = i / CH, c = (i % CH) * 8;
      const bool ok = (q0 + r < Sq) && (c < ld);
      const long long off = ok ? (qrow0 + q0 + r) * ld + c : 0;
      cp_async16(Qs + (st * BM + r) * LDS + c, q + off, ok ? 16 : 0);
      cp_async16(Os + (st * BM + r) * LDS + c, dout + off, ok ? 16 : 0);
    }
    for (int r = tid; r < BM; r += NTHREADS) {
      const bool ok = q0 + r < Sq;
      long long lo = RING_POS_MAX, hi = RING_POS_MIN;  // padding rows see nothing
      if (ok) row_range(row_lo, row_hi, q_pos, causal, q0 + r, lo, hi);
      Pl[st * BM + r] = lo;
      Ph[st * BM + r] = hi;
      Ls[st * BM + r] = lse_base2(ok ? lse[qrow0 + q0 + r] : 0.f, ok);
      Es[st * BM + r] = ok ? delta[qrow0 + q0 + r] : 0.f;
    }
  };
  int gi = 0, stage = 0;  // current (q block, head hk * G + gi)
  load_q(0, qb, hk * G);
  cp_commit();

  // positions of this thread's two key rows (c0/c1: row gr, c2/c3: row gr + 8)
  long long kp[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = k0 + warp * 16 + gr + 8 * r;
    kp[r] = key < Sk ? k_pos[key] : RING_POS_MAX;
  }
  // partial dK, dV of at most RING_FLUSH_KEYS query rows, from zero; flush()
  // adds them to dk, dv and starts again (no register total takes every row)
  float dka[NTO][4], dva[NTO][4];
#pragma unroll
  for (int nt = 0; nt < NTO; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[nt][e] = dva[nt][e] = 0.f;
  auto flush = [&]() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = k0 + warp * 16 + gr + 8 * r;
      if (key < Sk) {
        float* dkr = dk + (krow0 + key) * D;
        float* dvr = dv + (krow0 + key) * D;
#pragma unroll
        for (int nt = 0; nt < NTO; ++nt) {
          const int col = nt * 8 + tg * 2;
          if (col < D) {
            dkr[col] += scale * dka[nt][2 * r];
            dvr[col] += dva[nt][2 * r];
          }
          if (col + 1 < D) {
            dkr[col + 1] += scale * dka[nt][2 * r + 1];
            dvr[col + 1] += dva[nt][2 * r + 1];
          }
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTO; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dka[nt][e] = dva[nt][e] = 0.f;
  };
  int nflush = 0;  // (q block, head) steps in the partial

  const float scale_log2 = scale * RING_LOG2E;
  // ldmatrix row addresses: A fragments of K and V (this warp's 16 keys), B
  // fragments of Q and dO as stored (for S^T, dP^T) and transposed (for dK, dV)
  const int arow = warp * 16 + (lane & 15), acol = (lane >> 4) * 8;
  const unsigned k_a = smem_addr(Ks + arow * LDS + acol), v_a = smem_addr(Vs + arow * LDS + acol);
  const int brow = (lane & 7) + ((lane >> 4) << 3), bcol = ((lane >> 3) & 1) * 8;
  const unsigned q_b = smem_addr(Qs + brow * LDS + bcol), o_b = smem_addr(Os + brow * LDS + bcol);
  const int trow = lane & 15, tcol = (lane >> 4) * 8;
  const unsigned q_t = smem_addr(Qs + trow * LDS + tcol), o_t = smem_addr(Os + trow * LDS + tcol);

  while (true) {
    int nq = qb, ng = gi + 1;  // the next (q block, head): heads first, then blocks
    if (ng == G) {
      nq = next_qblock(qb + 1, nqb, bounds, klo_me, khi_me);
      ng = 0;
    }
    if (nq < nqb) {
      load_q(stage ^ 1, nq, hk * G + ng);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    // here (not after this step's MMAs, where it made HD = 128 spill registers)
    if (nflush == RING_FLUSH_KEYS / BM) {  // uniform over the CTA
      flush();
      nflush = 0;
    }
    const unsigned so = stage * BM * ROWB;

    // S^T = K Q^T and dP^T = V dO^T: 16 keys x BM queries per warp
    float st[NTQ][4], dpt[NTQ][4];
#pragma unroll
    for (int nt = 0; nt < NTQ; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      unsigned ka[4], va[4];
      ldsm_x4(ka, k_a + kk * 32);
      ldsm_x4(va, v_a + kk * 32);
#pragma unroll
      for (int np = 0; np < BM / 16; ++np) {
        unsigned bq[4], bo[4];
        ldsm_x4(bq, q_b + so + np * 16 * ROWB + kk * 32);
        ldsm_x4(bo, o_b + so + np * 16 * ROWB + kk * 32);
        Mma<T>::run(st[2 * np], ka, bq[0], bq[1]);
        Mma<T>::run(st[2 * np + 1], ka, bq[2], bq[3]);
        Mma<T>::run(dpt[2 * np], va, bo[0], bo[1]);
        Mma<T>::run(dpt[2 * np + 1], va, bo[2], bo[3]);
      }
    }

    // P^T = exp2(s - lse2) (0 where masked), dS^T = P^T (dP^T - delta) ds/dx, with
    // s = S^T scale log2e through the modifiers and ds/dx their derivative (1 without)
    const bool need_mask = !block_full(bounds, nqb, qb, klo_me, khi_me);
    const float* ls = Ls + stage * BM;
    const float* es = Es + stage * BM;
    const long long* pl = Pl + stage * BM;
    const long long* ph = Ph + stage * BM;
    const int q0 = qb * BM;
    // this step's head's modifier parameters in base 2 (score-linear ones times log2(e))
    const RingMods<float> md = ring_mods_load(mods, mparam, hk * G + gi, RING_LOG2E);
#pragma unroll
    for (int nt = 0; nt < NTQ; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + tg * 2 + (e & 1);  // query row within the block
        float x = st[nt][e] * scale_log2, dx = 1.f;
        if (mods) {
          // (a padding key, kp = RING_POS_MAX, gets no position term: its row is never stored)
          const long long qa = (ring_mods_pos(mods) && q0 + col < Sq) ? mpos[q0 + col] : 0LL;
          x = ring_modify_d(mods, md, x, qa, kp[e >> 1], dx, kp[e >> 1] != RING_POS_MAX);
        }
        float p = fast_exp2(x - ls[col]);
        if (need_mask && (kp[e >> 1] < pl[col] || kp[e >> 1] > ph[col])) p = 0.f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - es[col]) * dx;
      }
    }

    // dV += P^T dO and dK += dS^T Q: the S^T accumulators of query n-tiles
    // 2kk, 2kk+1 are the A fragment of queries [16kk, 16kk + 16)
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      unsigned pa[4], sa[4];
      pa[0] = Mma<T>::pack(st[2 * kk][0], st[2 * kk][1]);
      pa[1] = Mma<T>::pack(st[2 * kk][2], st[2 * kk][3]);
      pa[2] = Mma<T>::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      pa[3] = Mma<T>::pack(st[2 * kk + 1][2], st[2 * kk + 1][3]);
      sa[0] = Mma<T>::pack(dpt[2 * kk][0], dpt[2 * kk][1]);
      sa[1] = Mma<T>::pack(dpt[2 * kk][2], dpt[2 * kk][3]);
      sa[2] = Mma<T>::pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      sa[3] = Mma<T>::pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
      for (int np = 0; np < HD / 16; ++np) {
        unsigned bo[4], bq[4];
        ldsm_x4_trans(bo, o_t + so + kk * 16 * ROWB + np * 32);
        ldsm_x4_trans(bq, q_t + so + kk * 16 * ROWB + np * 32);
        Mma<T>::run(dva[2 * np], pa, bo[0], bo[1]);
        Mma<T>::run(dva[2 * np + 1], pa, bo[2], bo[3]);
        Mma<T>::run(dka[2 * np], sa, bq[0], bq[1]);
        Mma<T>::run(dka[2 * np + 1], sa, bq[2], bq[3]);
      }
    }
    ++nflush;
    __syncthreads();  // every warp is done with this stage before it is refilled
    if (nq >= nqb) break;
    qb = nq;
    gi = ng;
    stage ^= 1;
  }
  if (nflush) flush();
}

// dQ of one block of 64 query rows (4 warps x 16 rows) of head h, batch b:
// grid (nqb, H, B). Loops over the visible key blocks of BN keys (K/V
// double-buffered with cp.async). Per warp, in registers: S = Q K^T and
// dP = dO V^T (16 x BN), dQ += dS K (16 x HD).
// Dynamic shared memory: (2 * 64 + 4 BN) (HD + 8) sizeof(T) bytes.
template <typename T, int HD, int BN>
__global__ void __launch_bounds__(128, 1)
    attn_bwd_dq_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const T* __restrict__ dout, const float* __restrict__ lse,
                    const float* __restrict__ delta, float* __restrict__ dq,
                    const long long* __restrict__ q_pos, const long long* __restrict__ k_pos,
                    const long long* __restrict__ bounds, const long long* __restrict__ row_lo,
                    const long long* __restrict__ row_hi, int H, int Hkv, int Sq, int Sk, int D,
                    int ld, float scale, int causal, unsigned mods,
                    const double* __restrict__ mparam, const long long* __restrict__ mpos) {
  constexpr int BM = 64, NTHREADS = 128, LDS = HD + 8;
  constexpr int KD = HD / 16, NTS = BN / 8, NTO = HD / 8, CH = HD / 8;
  constexpr unsigned ROWB = LDS * sizeof(T);
  static_assert(HD % 32 == 0 && HD <= 128 && BN % 16 == 0, "tile sizes");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);  // [BM][LDS]
  T* Os = Qs + BM * LDS;                   // [BM][LDS]  dO
  T* Ks = Os + BM * LDS;                   // [2][BN][LDS]
  T* Vs = Ks + 2 * BN * LDS;               // [2][BN][LDS]

  const int qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int nqb = (Sq + BM - 1) / BM, nkb = (Sk + BN - 1) / BN;
  const long long* klo = bounds + 4 * nqb;
  const long long* khi = klo + nkb;
  int kb = next_kblock(0, nkb, bounds, nqb, qb);
  if (kb >= nkb) return;  // no row sees any key: no gradient

  const int hk = h / (H / Hkv);
  const long long qrow0 = ((long long)b * H + h) * Sq;
  const long long krow0 = ((long long)b * Hkv + hk) * Sk;
  const int q0 = qb * BM;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gr = lane >> 2, tg = lane & 3;

  for (int i = tid; i < BM * CH; i += NTHREADS) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = (q0 + r < Sq) && (c < ld);
    const long long off = ok ? (qrow0 + q0 + r) * ld + c : 0;
    cp_async16(Qs + r * LDS + c, q + off, ok ? 16 : 0);
    cp_async16(Os + r * LDS + c, dout + off, ok ? 16 : 0);
  }
  cp_commit();
  auto load_kv = [&](int st, int kblock) {
    for (int i = tid; i < BN * CH; i += NTHREADS) {
      const int r = i / CH, c = (i % CH) * 8;
      const int key = kblock * BN + r;
      const bool ok = (key < Sk) && (c < ld);
      const long long off = ok ? (krow0 + key) * ld + c : 0;
      cp_async16(Ks + (st * BN + r) * LDS + c, k + off, ok ? 16 : 0);
      cp_async16(Vs + (st * BN + r) * LDS + c, v + off, ok ? 16 : 0);
    }
  };
  int stage = 0;
  load_kv(0, kb);
  cp_commit();

  // this thread's rows q0 + warp * 16 + gr (+ 8): base-2 lse, delta, visible keys
  float l2[2], dl[2];
  long long rlo[2], rhi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + warp * 16 + gr + 8 * r;
    const bool ok = row < Sq;
    l2[r] = lse_base2(ok ? lse[qrow0 + row] : 0.f, ok);
    dl[r] = ok ? delta[qrow0 + row] : 0.f;
    rlo[r] = RING_POS_MAX;
    rhi[r] = RING_POS_MIN;
    if (ok) row_range(row_lo, row_hi, q_pos, causal, row, rlo[r], rhi[r]);
  }
  // partial dQ of at most RING_FLUSH_KEYS keys, from zero; flush() adds it to dq
  float dqa[NTO][4];
#pragma unroll
  for (int nt = 0; nt < NTO; ++nt) dqa[nt][0] = dqa[nt][1] = dqa[nt][2] = dqa[nt][3] = 0.f;
  auto flush = [&]() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = q0 + warp * 16 + gr + 8 * r;
      if (row < Sq) {
        float* dqr = dq + (qrow0 + row) * D;
#pragma unroll
        for (int nt = 0; nt < NTO; ++nt) {
          const int col = nt * 8 + tg * 2;
          if (col < D) dqr[col] += scale * dqa[nt][2 * r];
          if (col + 1 < D) dqr[col + 1] += scale * dqa[nt][2 * r + 1];
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTO; ++nt) dqa[nt][0] = dqa[nt][1] = dqa[nt][2] = dqa[nt][3] = 0.f;
  };
  int nflush = 0;  // key blocks in the partial

  const float scale_log2 = scale * RING_LOG2E;
  // this head's modifier parameters in base 2 (score-linear ones times log2(e))
  __shared__ RingMods<float> md;
  if (tid == 0) md = ring_mods_load(mods, mparam, h, RING_LOG2E);
  long long qar[2];  // modifier positions (mpos) of this thread's two rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + warp * 16 + gr + 8 * r;
    qar[r] = (ring_mods_pos(mods) && row < Sq) ? mpos[row] : 0;
  }
  const int arow = warp * 16 + (lane & 15), acol = (lane >> 4) * 8;
  const unsigned q_a = smem_addr(Qs + arow * LDS + acol), o_a = smem_addr(Os + arow * LDS + acol);
  const int brow = (lane & 7) + ((lane >> 4) << 3), bcol = ((lane >> 3) & 1) * 8;
  const unsigned k_b = smem_addr(Ks + brow * LDS + bcol), v_b = smem_addr(Vs + brow * LDS + bcol);
  const unsigned k_t = smem_addr(Ks + (lane & 15) * LDS + (lane >> 4) * 8);

  while (true) {
    const int nxt = next_kblock(kb + 1, nkb, bounds, nqb, qb);
    if (nxt < nkb) {
      load_kv(stage ^ 1, nxt);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const unsigned so = stage * BN * ROWB;

    // S = Q K^T and dP = dO V^T: 16 rows x BN keys per warp
    float s[NTS][4], dp[NTS][4];
#pragma unroll
    for (int nt = 0; nt < NTS; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      unsigned qa[4], oa[4];
      ldsm_x4(qa, q_a + kk * 32);
      ldsm_x4(oa, o_a + kk * 32);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        unsigned bk[4], bv[4];
        ldsm_x4(bk, k_b + so + np * 16 * ROWB + kk * 32);
        ldsm_x4(bv, v_b + so + np * 16 * ROWB + kk * 32);
        Mma<T>::run(s[2 * np], qa, bk[0], bk[1]);
        Mma<T>::run(s[2 * np + 1], qa, bk[2], bk[3]);
        Mma<T>::run(dp[2 * np], oa, bv[0], bv[1]);
        Mma<T>::run(dp[2 * np + 1], oa, bv[2], bv[3]);
      }
    }

    // dS = P (dP - delta) ds/dx, P = exp2(s - lse2), 0 where masked; s = S scale log2e
    // through the modifiers, ds/dx their derivative (1 without)
    const int k0 = kb * BN;
    const bool need_mask = !block_full(bounds, nqb, qb, klo[kb], khi[kb]);
    const bool partial = k0 + BN > Sk;
#pragma unroll
    for (int nt = 0; nt < NTS; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kj = k0 + nt * 8 + tg * 2 + (e & 1);
        float x = s[nt][e] * scale_log2, dx = 1.f;
        if (mods) {  // key positions only for position modifiers
          const long long kp = (ring_mods_pos(mods) && kj < Sk) ? k_pos[kj] : 0LL;
          x = ring_modify_d(mods, md, x, qar[e >> 1], kp, dx);
        }
        float p = fast_exp2(x - l2[e >> 1]);
        if (partial && kj >= Sk) p = 0.f;
        if (need_mask && kj < Sk) {
          const long long kp = k_pos[kj];
          if (kp < rlo[e >> 1] || kp > rhi[e >> 1]) p = 0.f;
        }
        s[nt][e] = p * (dp[nt][e] - dl[e >> 1]) * dx;
      }
    }

    // dQ += dS K: dS accumulators of key n-tiles 2kk, 2kk+1 are the A fragment
    // of keys [16kk, 16kk + 16); K as B (keys x head dim) via ldmatrix.trans
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned a[4];
      a[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      a[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      a[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int np = 0; np < HD / 16; ++np) {
        unsigned bk[4];
        ldsm_x4_trans(bk, k_t + so + kk * 16 * ROWB + np * 32);
        Mma<T>::run(dqa[2 * np], a, bk[0], bk[1]);
        Mma<T>::run(dqa[2 * np + 1], a, bk[2], bk[3]);
      }
    }
    if (++nflush == RING_FLUSH_KEYS / BN) {  // uniform over the CTA
      flush();
      nflush = 0;
    }
    __syncthreads();
    if (nxt >= nkb) break;
    kb = nxt;
    stage ^= 1;
  }
  if (nflush) flush();
}

// ----------------------------------------------------------------------------
// CUDA-core kernels: fp32 and fp64 (any D <= DMAX), and fp16/bf16 heads wider
// than 128. 256 threads as a 16 x 16 grid (ty, tx); tiles live in shared
// memory in the accumulation type A with odd row strides (no bank conflicts).
// ----------------------------------------------------------------------------

// dK, dV of one block of BN keys: grid (nkb, Hkv, B). Thread (ty, tx) owns
// keys ty + 16 i and, for S^T/dP^T, queries tx + 16 j; for dK/dV, head-dim
// columns tx + 16 j. Dynamic shared memory:
// BM * 16 + ((2 BN + 2 BM) (DMAX + 1) + 2 BN (BM + 1) + 2 BM) * sizeof(A) bytes.
template <typename T, typename A, int DMAX, int BM, int BN>
__global__ void __launch_bounds__(256, 1)
    attn_bwd_dkdv_simt(const T* __restrict__ q, const T* __restrict__ k,
                       const T* __restrict__ v, const T* __restrict__ dout,
                       const A* __restrict__ lse, const A* __restrict__ delta,
                       A* __restrict__ dk, A* __restrict__ dv, const long long* __restrict__ q_pos,
                       const long long* __restrict__ k_pos, const long long* __restrict__ bounds,
                       const long long* __restrict__ row_lo, const long long* __restrict__ row_hi,
                       int H, int Hkv, int Sq, int Sk, int D, int ld, A scale, int causal,
                       unsigned mods, const double* __restrict__ mparam,
                       const long long* __restrict__ mpos) {
  constexpr int NTHREADS = 256, LD = DMAX + 1, LP = BM + 1;
  constexpr int RN = BN / 16, RM = BM / 16, RD = DMAX / 16;
  static_assert(BM % 16 == 0 && BN % 16 == 0 && DMAX % 16 == 0, "tile sizes");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  long long* Ql = reinterpret_cast<long long*>(smem_raw);  // [BM] row lo
  long long* Qh = Ql + BM;                                  // [BM] row hi
  A* Ks = reinterpret_cast<A*>(Qh + BM);                    // [BN][LD]
  A* Vs = Ks + BN * LD;                                     // [BN][LD]
  A* Qs = Vs + BN * LD;                                     // [BM][LD]
  A* Os = Qs + BM * LD;                                     // [BM][LD]  dO
  A* Pt = Os + BM * LD;                                     // [BN][LP]  P^T
  A* St = Pt + BN * LP;                                     // [BN][LP]  dS^T
  A* Ls = St + BN * LP;                                     // [BM] lse (+inf: no key)
  A* Es = Ls + BM;                                          // [BM] delta

  const int kb = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int G = H / Hkv;
  const int nqb = (Sq + BM - 1) / BM, nkb = (Sk + BN - 1) / BN;
  const long long klo_me = bounds[4 * nqb + kb], khi_me = bounds[4 * nqb + nkb + kb];
  int qb = next_qblock(0, nqb, bounds, klo_me, khi_me);
  if (qb >= nqb) return;

  const long long krow0 = ((long long)b * Hkv + hk) * Sk;
  const int k0 = kb * BN;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const A zero = 0;

  for (int i = tid; i < BN * DMAX; i += NTHREADS) {
    const int r = i / DMAX, c = i % DMAX;
    const bool ok = k0 + r < Sk && c < D;
    const long long gi = (krow0 + k0 + r) * ld + c;
    Ks[r * LD + c] = ok ? to_acc<A>(k[gi]) : zero;
    Vs[r * LD + c] = ok ? to_acc<A>(v[gi]) : zero;
  }
  long long kp[RN];
#pragma unroll
  for (int i = 0; i < RN; ++i) {
    const int key = k0 + ty + 16 * i;
    kp[i] = key < Sk ? k_pos[key] : RING_POS_MAX;
  }
  // each (q block, head) step's dK, dV are summed from zero (pk, pv) and added
  // to dka, dva, which go to dk, dv every RING_FLUSH_BLOCKS steps (flush()):
  // no total takes more than BM, RING_FLUSH_BLOCKS or G Sq / (BM RING_FLUSH_BLOCKS)
  // additions, instead of one chain over every query row
  A dka[RN][RD], dva[RN][RD];
#pragma unroll
  for (int i = 0; i < RN; ++i)
#pragma unroll
    for (int j = 0; j < RD; ++j) dka[i][j] = dva[i][j] = zero;
  auto flush = [&]() {
#pragma unroll
    for (int i = 0; i < RN; ++i) {
      const int key = k0 + ty + 16 * i;
#pragma unroll
      for (int j = 0; j < RD; ++j) {
        const int c = tx + 16 * j;
        if (key < Sk && c < D) {
          dk[(krow0 + key) * D + c] += scale * dka[i][j];
          dv[(krow0 + key) * D + c] += dva[i][j];
        }
        dka[i][j] = dva[i][j] = zero;
      }
    }
  };
  int nflush = 0;  // steps in dka, dva
  __shared__ RingMods<A> md;  // the modifier parameters of the step's head

  for (; qb < nqb; qb = next_qblock(qb + 1, nqb, bounds, klo_me, khi_me)) {
    const int q0 = qb * BM;
    const int nq = (Sq - q0 < BM) ? Sq - q0 : BM;
    const bool need_mask = !block_full(bounds, nqb, qb, klo_me, khi_me);
    for (int gi = 0; gi < G; ++gi) {
      const long long qrow0 = ((long long)b * H + hk * G + gi) * Sq;
      __syncthreads();  // the previous tile's readers are done (K/V stored)
      if (tid == 0) md = ring_mods_load(mods, mparam, hk * G + gi, (A)1);  // its parameters
      for (int i = tid; i < BM * DMAX; i += NTHREADS) {
        const int r = i / DMAX, c = i % DMAX;
        const bool ok = q0 + r < Sq && c < D;
        const long long gq = (qrow0 + q0 + r) * ld + c;
        Qs[r * LD + c] = ok ? to_acc<A>(q[gq]) : zero;
        Os[r * LD + c] = ok ? to_acc<A>(dout[gq]) : zero;
      }
      for (int r = tid; r < BM; r += NTHREADS) {
        const bool ok = q0 + r < Sq;
        long long lo = RING_POS_MAX, hi = RING_POS_MIN;  // padding rows see nothing
        if (ok) row_range(row_lo, row_hi, q_pos, causal, q0 + r, lo, hi);
        Ql[r] = lo;
        Qh[r] = hi;
        Ls[r] = lse_natural<A>(ok ? lse[qrow0 + q0 + r] : zero, ok);
        Es[r] = ok ? delta[qrow0 + q0 + r] : zero;
      }
      __syncthreads();

      A s[RN][RM], dp[RN][RM];
#pragma unroll
      for (int i = 0; i < RN; ++i)
#pragma unroll
        for (int j = 0; j < RM; ++j) s[i][j] = dp[i][j] = zero;
#pragma unroll 4
      for (int d = 0; d < D; ++d) {
        A ka[RN], va[RN], qa[RM], oa[RM];
#pragma unroll
        for (int i = 0; i < RN; ++i) {
          ka[i] = Ks[(ty + 16 * i) * LD + d];
          va[i] = Vs[(ty + 16 * i) * LD + d];
        }
#pragma unroll
        for (int j = 0; j < RM; ++j) {
          qa[j] = Qs[(tx + 16 * j) * LD + d];
          oa[j] = Os[(tx + 16 * j) * LD + d];
        }
#pragma unroll
        for (int i = 0; i < RN; ++i)
#pragma unroll
          for (int j = 0; j < RM; ++j) {
            s[i][j] += ka[i] * qa[j];
            dp[i][j] += va[i] * oa[j];
          }
      }
#pragma unroll
      for (int i = 0; i < RN; ++i)
#pragma unroll
        for (int j = 0; j < RM; ++j) {
          const int qj = tx + 16 * j;
          // the modifiers and their derivative ds/dx (1 without)
          A x = s[i][j] * scale, dx = (A)1;
          if (mods) {  // no position term for a padding key (never stored)
            const long long qa = (ring_mods_pos(mods) && q0 + qj < Sq) ? mpos[q0 + qj] : 0LL;
            x = ring_modify_d(mods, md, x, qa, kp[i], dx, kp[i] != RING_POS_MAX);
          }
          A p = exp_acc(x - Ls[qj]);
          if (need_mask && (kp[i] < Ql[qj] || kp[i] > Qh[qj])) p = zero;
          Pt[(ty + 16 * i) * LP + qj] = p;
          St[(ty + 16 * i) * LP + qj] = p * (dp[i][j] - Es[qj]) * dx;
        }
      __syncthreads();

      A pk[RN][RD], pv[RN][RD];
#pragma unroll
      for (int i = 0; i < RN; ++i)
#pragma unroll
        for (int j = 0; j < RD; ++j) pk[i][j] = pv[i][j] = zero;
#pragma unroll 4
      for (int qq = 0; qq < nq; ++qq) {
        A pa[RN], sa[RN], oa[RD], qa[RD];
#pragma unroll
        for (int i = 0; i < RN; ++i) {
          pa[i] = Pt[(ty + 16 * i) * LP + qq];
          sa[i] = St[(ty + 16 * i) * LP + qq];
        }
#pragma unroll
        for (int j = 0; j < RD; ++j) {
          oa[j] = Os[qq * LD + tx + 16 * j];
          qa[j] = Qs[qq * LD + tx + 16 * j];
        }
#pragma unroll
        for (int i = 0; i < RN; ++i)
#pragma unroll
          for (int j = 0; j < RD; ++j) {
            pv[i][j] += pa[i] * oa[j];
            pk[i][j] += sa[i] * qa[j];
          }
      }
#pragma unroll
      for (int i = 0; i < RN; ++i)
#pragma unroll
        for (int j = 0; j < RD; ++j) {
          dva[i][j] = add_rn(dva[i][j], pv[i][j]);
          dka[i][j] = add_rn(dka[i][j], pk[i][j]);
        }
      if (++nflush == RING_FLUSH_BLOCKS) {
        flush();
        nflush = 0;
      }
    }
  }
  if (nflush) flush();
}

// dQ of one block of BM query rows of head h: grid (nqb, H, B). Thread
// (ty, tx) owns rows ty + 16 i and, for S/dP, keys tx + 16 j; for dQ, head-dim
// columns tx + 16 j. Dynamic shared memory:
// ((2 BM + 2 BN) (DMAX + 1) + BM (BN + 1)) * sizeof(A) bytes.
template <typename T, typename A, int DMAX, int BM, int BN>
__global__ void __launch_bounds__(256, 1)
    attn_bwd_dq_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ dout, const A* __restrict__ lse,
                     const A* __restrict__ delta, A* __restrict__ dq,
                     const long long* __restrict__ q_pos, const long long* __restrict__ k_pos,
                     const long long* __restrict__ bounds, const long long* __restrict__ row_lo,
                     const long long* __restrict__ row_hi, int H, int Hkv, int Sq, int Sk, int D,
                     int ld, A scale, int causal, unsigned mods,
                     const double* __restrict__ mparam, const long long* __restrict__ mpos) {
  constexpr int NTHREADS = 256, LD = DMAX + 1, LP = BN + 1;
  constexpr int RM = BM / 16, RN = BN / 16, RD = DMAX / 16;
  static_assert(BM % 16 == 0 && BN % 16 == 0 && DMAX % 16 == 0, "tile sizes");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* Qs = reinterpret_cast<A*>(smem_raw);  // [BM][LD]
  A* Os = Qs + BM * LD;                    // [BM][LD]  dO
  A* Ks = Os + BM * LD;                    // [BN][LD]
  A* Vs = Ks + BN * LD;                    // [BN][LD]
  A* Ss = Vs + BN * LD;                    // [BM][LP]  dS

  const int qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int nqb = (Sq + BM - 1) / BM, nkb = (Sk + BN - 1) / BN;
  const long long* klo = bounds + 4 * nqb;
  const long long* khi = klo + nkb;
  int kb = next_kblock(0, nkb, bounds, nqb, qb);
  if (kb >= nkb) return;

  const int hk = h / (H / Hkv);
  const long long qrow0 = ((long long)b * H + h) * Sq;
  const long long krow0 = ((long long)b * Hkv + hk) * Sk;
  const int q0 = qb * BM;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const A zero = 0;

  for (int i = tid; i < BM * DMAX; i += NTHREADS) {
    const int r = i / DMAX, c = i % DMAX;
    const bool ok = q0 + r < Sq && c < D;
    const long long gq = (qrow0 + q0 + r) * ld + c;
    Qs[r * LD + c] = ok ? to_acc<A>(q[gq]) : zero;
    Os[r * LD + c] = ok ? to_acc<A>(dout[gq]) : zero;
  }
  A lr[RM], dl[RM], dqa[RM][RD];
  long long rlo[RM], rhi[RM], qar[RM];  // visible keys and modifier position of each row
  __shared__ RingMods<A> md;  // this head's modifier parameters
  if (tid == 0) md = ring_mods_load(mods, mparam, h, (A)1);
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const int row = q0 + ty + 16 * i;
    const bool ok = row < Sq;
    qar[i] = (ring_mods_pos(mods) && ok) ? mpos[row] : 0;
    lr[i] = lse_natural<A>(ok ? lse[qrow0 + row] : zero, ok);
    dl[i] = ok ? delta[qrow0 + row] : zero;
    rlo[i] = RING_POS_MAX;
    rhi[i] = RING_POS_MIN;
    if (ok) row_range(row_lo, row_hi, q_pos, causal, row, rlo[i], rhi[i]);
#pragma unroll
    for (int j = 0; j < RD; ++j) dqa[i][j] = zero;
  }
  // each key block's dS K is summed from zero (pq) and added to dqa, which goes
  // to dq every RING_FLUSH_BLOCKS blocks (flush()): no chain over every key
  auto flush = [&]() {
#pragma unroll
    for (int i = 0; i < RM; ++i) {
      const int row = q0 + ty + 16 * i;
#pragma unroll
      for (int j = 0; j < RD; ++j) {
        const int c = tx + 16 * j;
        if (row < Sq && c < D) dq[(qrow0 + row) * D + c] += scale * dqa[i][j];
        dqa[i][j] = zero;
      }
    }
  };
  int nflush = 0;  // key blocks in dqa

  for (; kb < nkb; kb = next_kblock(kb + 1, nkb, bounds, nqb, qb)) {
    const int k0 = kb * BN;
    __syncthreads();  // previous block's readers are done (and Q/dO are stored)
    for (int i = tid; i < BN * DMAX; i += NTHREADS) {
      const int r = i / DMAX, c = i % DMAX;
      const bool ok = k0 + r < Sk && c < D;
      const long long gi = (krow0 + k0 + r) * ld + c;
      Ks[r * LD + c] = ok ? to_acc<A>(k[gi]) : zero;
      Vs[r * LD + c] = ok ? to_acc<A>(v[gi]) : zero;
    }
    __syncthreads();

    A s[RM][RN], dp[RM][RN];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RN; ++j) s[i][j] = dp[i][j] = zero;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
      A qa[RM], oa[RM], ka[RN], va[RN];
#pragma unroll
      for (int i = 0; i < RM; ++i) {
        qa[i] = Qs[(ty + 16 * i) * LD + d];
        oa[i] = Os[(ty + 16 * i) * LD + d];
      }
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        ka[j] = Ks[(tx + 16 * j) * LD + d];
        va[j] = Vs[(tx + 16 * j) * LD + d];
      }
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) {
          s[i][j] += qa[i] * ka[j];
          dp[i][j] += oa[i] * va[j];
        }
    }
    const bool need_mask = !block_full(bounds, nqb, qb, klo[kb], khi[kb]);
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        const int kj = k0 + tx + 16 * j;
        // the modifiers and their derivative ds/dx (1 without)
        A x = s[i][j] * scale, dx = (A)1;
        if (mods) {  // key positions only for position modifiers
          const long long kp = (ring_mods_pos(mods) && kj < Sk) ? k_pos[kj] : 0LL;
          x = ring_modify_d(mods, md, x, qar[i], kp, dx);
        }
        A p = exp_acc(x - lr[i]);
        if (kj >= Sk) {
          p = zero;
        } else if (need_mask) {
          const long long kp = k_pos[kj];
          if (kp < rlo[i] || kp > rhi[i]) p = zero;
        }
        Ss[(ty + 16 * i) * LP + tx + 16 * j] = p * (dp[i][j] - dl[i]) * dx;
      }
    __syncthreads();

    const int nk = (Sk - k0 < BN) ? Sk - k0 : BN;
    A pq[RM][RD];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RD; ++j) pq[i][j] = zero;
#pragma unroll 4
    for (int kk = 0; kk < nk; ++kk) {
      A sa[RM], ka[RD];
#pragma unroll
      for (int i = 0; i < RM; ++i) sa[i] = Ss[(ty + 16 * i) * LP + kk];
#pragma unroll
      for (int j = 0; j < RD; ++j) ka[j] = Ks[kk * LD + tx + 16 * j];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RD; ++j) pq[i][j] += sa[i] * ka[j];
    }
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RD; ++j) dqa[i][j] = add_rn(dqa[i][j], pq[i][j]);
    if (++nflush == RING_FLUSH_BLOCKS) {
      flush();
      nflush = 0;
    }
  }
  if (nflush) flush();
}
