// Forward attention tiles for the ring loop: fold one visiting K/V block into
// the online-softmax state carried between ring steps (same math as
// forward_tile in ringmpi/cpu/numpy_tile.py, which is the specification).
//
// Layouts (row-major, contiguous, one CTA per (q block, head, batch)):
//   q      : (B, H,   Sq, ld)  storage type T; columns >= D are zero
//   k, v   : (B, Hkv, Sk, ld)  query head h reads K/V head h / (H / Hkv)
//   acc    : (B, H, Sq, D)     accumulation type A (float, or double)
//   m, l   : (B, H, Sq)        running max and softmax denominator, type A
//   q_pos  : (Sq,)             int64 global token positions
//   k_pos  : (Sk,)             int64 global token positions
//   row_lo, row_hi : (Sq,)     int64 or null: query i sees key j iff
//            row_lo[i] <= k_pos[j] <= row_hi[i] (row_lo[i] > row_hi[i]: no key).
//            Null: causal (key j visible iff k_pos[j] <= q_pos[i]) or, with
//            causal = 0, every key.
//   bounds : (4*nqb + 2*nkb,)  int64 block plan (ringmpi/gpu/plan.py):
//            [lo_min, lo_max, hi_min, hi_max] per q block (nqb values each),
//            then [klo, khi] per k block (nkb each). Over the non-empty rows of
//            q block j, lo_min/hi_max bound what any row sees; over all its
//            rows, lo_max/hi_min is what every row sees; klo/khi are the
//            min/max key position of a block of BN keys.
//   mods, mparam, mpos : the score modifiers (ringmpi/scoremods.py), last arguments
//            of every kernel: the active slots' bits (0: none), their parameters
//            (H, RM_NMODS) float64 per query head and the rows' positions (Sq,)
//            int64 in key coordinates (or null); each scaled score goes through
//            ring_modify of attention_common.cuh before the mask.
//
// For one query row with scaled scores s_j over the visible keys:
//   m'  = max(m, max_j s_j);  m_safe = (m' == -inf) ? 0 : m'
//   acc = exp(m - m_safe) acc + sum_j exp(s_j - m_safe) v_j
//   l   = exp(m - m_safe) l   + sum_j exp(s_j - m_safe)
// A key block with hi_max < klo or khi < lo_min is skipped (no row sees any
// of its keys); one with lo_max <= klo and khi <= hi_min needs no per-element
// mask; any other is masked per element. A row that sees no key keeps m =
// -inf, l = 0 and acc unchanged (m_safe = 0 avoids exp(-inf - -inf)).
//
// Shared types and helpers: attention_common.cuh (no other header: fp16 and bf16
// are 16-bit storage structs; conversions, tensor-core MMAs and async copies are
// inline PTX, sm_80+).

#include "attention_common.cuh"

// ----------------------------------------------------------------------------
// fp16 / bf16 tensor-core kernel, flash-attention-2 style.
// CTA = 4 warps = 64 query rows (16 per warp); key blocks of 64 rows are
// double-buffered in shared memory with cp.async. S = Q K^T and O += P V run
// on m16n8k16 MMAs with fp32 accumulation; the online softmax stays in
// registers. HD = head dim padded to a multiple of 32 (D <= HD); ld is a
// multiple of 8 (16-byte rows) and the global pointers are 16-byte aligned.
// Dynamic shared memory: (BM + 4 BN) * (HD + 8) * sizeof(T) bytes.
// ----------------------------------------------------------------------------
template <typename T, int HD>
__global__ void __launch_bounds__(128, 1)
    attn_fwd_mma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 float* __restrict__ acc, float* __restrict__ m_state,
                 float* __restrict__ l_state, const long long* __restrict__ q_pos,
                 const long long* __restrict__ k_pos, const long long* __restrict__ bounds,
                 const long long* __restrict__ row_lo, const long long* __restrict__ row_hi,
                 int H, int Hkv, int Sq, int Sk, int D, int ld, float scale, int causal,
                 unsigned mods, const double* __restrict__ mparam,
                 const long long* __restrict__ mpos) {
  constexpr int BM = 64, BN = 64, NTHREADS = 128;
  constexpr int LDS = HD + 8;    // smem row stride (elements): conflict-free fragment loads
  constexpr int KD = HD / 16;    // k-steps of S = Q K^T over the head dim
  constexpr int NTS = BN / 8;    // n-tiles of S (keys)
  constexpr int NTO = HD / 8;    // n-tiles of O (head dim)
  constexpr int CH = HD / 8;     // 16-byte chunks per smem row
  static_assert(HD % 32 == 0 && HD <= 128, "HD must be 32, 64, 96 or 128");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);  // [BM][LDS]
  T* Ks = Qs + BM * LDS;                   // [2][BN][LDS]
  T* Vs = Ks + 2 * BN * LDS;               // [2][BN][LDS]

  const int qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int nqb = (Sq + BM - 1) / BM, nkb = (Sk + BN - 1) / BN;
  const long long* klo = bounds + 4 * nqb;
  const long long* khi = klo + nkb;

  int kb = next_kblock(0, nkb, bounds, nqb, qb);
  if (kb >= nkb) return;  // no row sees any key: state unchanged

  const int hk = h / (H / Hkv);
  const long long qrow0 = ((long long)b * H + h) * Sq;     // first row of (b, h) in q/acc/m/l
  const long long krow0 = ((long long)b * Hkv + hk) * Sk;  // first row of (b, hk) in k/v
  const T* qg = q + qrow0 * ld;
  const T* kg = k + krow0 * ld;
  const T* vg = v + krow0 * ld;
  const int q0 = qb * BM;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gr = lane >> 2, tg = lane & 3;  // MMA fragment coordinates

  // rows [r0, r0 + rows) of a (nrows, ld) matrix -> smem [rows][LDS], zero-filled
  auto load_tile = [&](T* dst, const T* src, int r0, int nrows, int rows) {
    for (int i = tid; i < rows * CH; i += NTHREADS) {
      const int r = i / CH, c = (i % CH) * 8;
      const bool ok = (r0 + r < nrows) && (c < ld);
      const T* s = ok ? src + (long long)(r0 + r) * ld + c : src;
      cp_async16(dst + r * LDS + c, s, ok ? 16 : 0);
    }
  };

  load_tile(Qs, qg, q0, Sq, BM);
  cp_commit();
  int stage = 0;
  load_tile(Ks, kg, kb * BN, Sk, BN);
  load_tile(Vs, vg, kb * BN, Sk, BN);
  cp_commit();
  // visible key range of each row of the block (padding rows see nothing)
  __shared__ long long rlo_s[BM], rhi_s[BM], qa_s[BM];
  for (int r = tid; r < BM; r += NTHREADS) {
    long long lo = RING_POS_MAX, hi = RING_POS_MIN;
    if (q0 + r < Sq) row_range(row_lo, row_hi, q_pos, causal, q0 + r, lo, hi);
    rlo_s[r] = lo;
    rhi_s[r] = hi;
    qa_s[r] = (ring_mods_pos(mods) && q0 + r < Sq) ? mpos[q0 + r] : 0;
  }
  __shared__ RingMods<float> md;  // this head's modifier parameters
  if (tid == 0) md = ring_mods_load(mods, mparam, h, 1.f);
  cp_wait<1>();  // Q has landed (the first K/V block may still be in flight)
  __syncthreads();

  // A fragments of this warp's 16 query rows, kept for the whole loop:
  // a0 (row g, k 2t..2t+1), a1 (row g+8, k 2t), a2 (row g, k 2t+8), a3 (row g+8, k 2t+8)
  const int rl = warp * 16 + gr;  // local row of c0/c1; rl + 8 holds c2/c3
  unsigned qf[KD][4];
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) {
    const T* p = Qs + rl * LDS + kk * 16 + tg * 2;
    qf[kk][0] = *reinterpret_cast<const unsigned*>(p);
    qf[kk][1] = *reinterpret_cast<const unsigned*>(p + 8 * LDS);
    qf[kk][2] = *reinterpret_cast<const unsigned*>(p + 8);
    qf[kk][3] = *reinterpret_cast<const unsigned*>(p + 8 * LDS + 8);
  }

  // rows rl and rl + 8. The registers hold the partial o, l of at most
  // RING_FLUSH_KEYS keys, from zero, relative to the running max mrow; flush()
  // adds them to the stored acc, l (relative to mst, the max they were last
  // scaled to): acc = exp(mst - m) acc + o. l is summed over the 4 lanes of a
  // row group there.
  float o[NTO][4];
  float mrow[2], lrow[2], mst[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + rl + 8 * r;
    mrow[r] = mst[r] = (row < Sq) ? m_state[qrow0 + row] : neg_inf<float>();
    lrow[r] = 0.f;
#pragma unroll
    for (int nt = 0; nt < NTO; ++nt) o[nt][2 * r] = o[nt][2 * r + 1] = 0.f;
  }
  auto flush = [&]() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = lrow[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = q0 + rl + 8 * r;
      // a row that was empty has acc = l = 0; an unchanged max gives beta = 1
      const float beta = (mst[r] == neg_inf<float>())
                             ? 0.f
                             : fast_exp2(mst[r] * RING_LOG2E - mrow[r] * RING_LOG2E);
      if (row < Sq) {
        if (tg == 0) l_state[qrow0 + row] = l_state[qrow0 + row] * beta + l;
#pragma unroll
        for (int nt = 0; nt < NTO; ++nt) {
          const int col = nt * 8 + tg * 2;
          float* a = acc + (qrow0 + row) * D + col;
          if (col < D) a[0] = a[0] * beta + o[nt][2 * r];
          if (col + 1 < D) a[1] = a[1] * beta + o[nt][2 * r + 1];
        }
      }
      mst[r] = mrow[r];
      lrow[r] = 0.f;
#pragma unroll
      for (int nt = 0; nt < NTO; ++nt) o[nt][2 * r] = o[nt][2 * r + 1] = 0.f;
    }
  };
  int nflush = 0;  // key blocks in the registers' partial

  while (true) {
    const int nxt = next_kblock(kb + 1, nkb, bounds, nqb, qb);
    if (nxt < nkb) {  // prefetch the next visible block into the other stage
      load_tile(Ks + (stage ^ 1) * BN * LDS, kg, nxt * BN, Sk, BN);
      load_tile(Vs + (stage ^ 1) * BN * LDS, vg, nxt * BN, Sk, BN);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const T* Kt = Ks + stage * BN * LDS;
    const T* Vt = Vs + stage * BN * LDS;

    // S = Q K^T: b0 = K[key g][d 2t..2t+1], b1 = K[key g][d 2t+8..]
    float s[NTS][4];
#pragma unroll
    for (int nt = 0; nt < NTS; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        const T* p = Kt + (nt * 8 + gr) * LDS + kk * 16 + tg * 2;
        Mma<T>::run(s[nt], qf[kk], *reinterpret_cast<const unsigned*>(p),
                    *reinterpret_cast<const unsigned*>(p + 8));
      }
    }

    // scale, then mask keys past Sk and, where the block plan says so, the
    // keys outside each row's [lo, hi]
    const int k0 = kb * BN;
    const bool need_mask = !block_full(bounds, nqb, qb, klo[kb], khi[kb]);
    const bool partial = k0 + BN > Sk;
#pragma unroll
    for (int nt = 0; nt < NTS; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * scale;
        if (mods) {
          const int kj = k0 + nt * 8 + tg * 2 + (e & 1);
          const long long kp = kj < Sk ? k_pos[kj] : 0;
          x = ring_modify(mods, md, x, qa_s[rl + 8 * (e >> 1)], kp);
        }
        if (partial || need_mask) {
          const int kj = k0 + nt * 8 + tg * 2 + (e & 1);
          bool vis = kj < Sk;
          if (vis && need_mask) {
            const long long kp = k_pos[kj];
            const int lr = rl + 8 * (e >> 1);
            vis = rlo_s[lr] <= kp && kp <= rhi_s[lr];
          }
          if (!vis) x = neg_inf<float>();
        }
        s[nt][e] = x;
      }
    }

    // online softmax per row (c0/c1 -> row rl, c2/c3 -> row rl + 8)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = neg_inf<float>();
#pragma unroll
      for (int nt = 0; nt < NTS; ++nt) mx = maxa(mx, maxa(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = maxa(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = maxa(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = maxa(mrow[r], mx);
      const float m_safe = (m_new == neg_inf<float>()) ? 0.f : m_new;
      const float ms = m_safe * RING_LOG2E;
      const float alpha = fast_exp2(mrow[r] * RING_LOG2E - ms);
      float rsum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NTS; ++nt) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const float p = fast_exp2(s[nt][e] * RING_LOG2E - ms);
          s[nt][e] = p;
          rsum += p;
        }
      }
      lrow[r] = lrow[r] * alpha + rsum;
      mrow[r] = m_new;
#pragma unroll
      for (int nt = 0; nt < NTO; ++nt) {
        o[nt][2 * r] *= alpha;
        o[nt][2 * r + 1] *= alpha;
      }
    }

    // O += P V. The S accumulators of key tiles 2kk, 2kk+1 are exactly the A
    // fragment of keys [16kk, 16kk+16); V fragments come from ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned a[4];
      a[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      a[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      a[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int np = 0; np < HD / 16; ++np) {
        unsigned b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3, Vt + (kk * 16 + (lane & 15)) * LDS + np * 16 + (lane >> 4) * 8);
        Mma<T>::run(o[2 * np], a, b0, b1);
        Mma<T>::run(o[2 * np + 1], a, b2, b3);
      }
    }
    if (++nflush == RING_FLUSH_KEYS / BN) {  // uniform over the CTA
      flush();
      nflush = 0;
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    if (nxt >= nkb) break;
    kb = nxt;
    stage ^= 1;
  }

  // the last partial, then the final max
  if (nflush) flush();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + rl + 8 * r;
    if (row < Sq && tg == 0) m_state[qrow0 + row] = mrow[r];
  }
}

// ----------------------------------------------------------------------------
// fp16 / bf16 tensor-core kernel, 128 query rows per CTA (configurations
// "m128n<BN>"). Same math as attn_fwd_mma, arranged for less shared-memory
// traffic per MMA:
//   * 4 warps x 32 query rows (two m16 tiles per warp), so each K and V
//     fragment loaded from shared memory feeds two MMAs;
//   * Q, K and V fragments all come through ldmatrix (x4: four 8x8 matrices
//     per instruction) instead of 32-bit shared loads;
//   * scores, m and the modifiers are in natural units, as in attn_fwd_mma
//     (exponentials as exp2(x log2(e) - m log2(e)), one FFMA each), so m is
//     stored with the bits of a natural-unit score: no base-2 round trip
//     (m log2(e) ln 2) moves lse against the other kernels;
//   * rows are packed over the G = H / Hkv query heads that share one K/V
//     head: packed row r of (b, hk) is position r / G of query head
//     hk * G + r % G, so every K/V block loaded serves all G heads;
//   * a 1-D grid walks the q blocks in the order given by `order` (the host
//     puts the blocks with the most computed keys first, so the long CTAs
//     start early and the short ones fill the tail).
// The block plan is over packed blocks: block j covers the query positions of
// packed rows [128 j, 128 j + 128), and row_lo/row_hi (when given) are read at
// position r / G. The grid is nqb * B * Hkv CTAs with
// blockIdx.x = (j * B + b) * Hkv + hk and q block order[j].
// Dynamic shared memory: (128 + 4 BN) * (HD + 8) * sizeof(T) bytes.
// ----------------------------------------------------------------------------
template <typename T, int HD, int BN>
__global__ void __launch_bounds__(128, 1)
    attn_fwd_mma2(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  float* __restrict__ acc, float* __restrict__ m_state,
                  float* __restrict__ l_state, const long long* __restrict__ q_pos,
                  const long long* __restrict__ k_pos, const long long* __restrict__ bounds,
                  const long long* __restrict__ row_lo, const long long* __restrict__ row_hi,
                  const int* __restrict__ order, int B, int H, int Hkv, int Sq, int Sk, int D,
                  int ld, float scale, int causal, unsigned mods,
                  const double* __restrict__ mparam, const long long* __restrict__ mpos) {
  constexpr int BM = 128, NTHREADS = 128, MT = 2;
  constexpr int LDS = HD + 8;  // smem row stride: 8 rows of an ldmatrix hit 8 distinct 16 B banks
  constexpr int KD = HD / 16, NTS = BN / 8, NTO = HD / 8, CH = HD / 8;
  static_assert(HD % 32 == 0 && HD <= 128, "HD must be 32, 64, 96 or 128");
  static_assert(BN % 16 == 0 && BN <= 64, "BN must be 16, 32, 48 or 64");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ long long rlo_s[BM], rhi_s[BM];  // visible key range of each packed row
  __shared__ long long qa_s[BM];              // modifier position (mpos) of each packed row
  __shared__ RingMods<float> md_s[BM];        // its head's modifier parameters
  __shared__ float m_in[BM];     // the max each row came in with
  __shared__ float m_st[BM];     // the max the stored acc, l are scaled to
  T* Qs = reinterpret_cast<T*>(smem_raw);  // [BM][LDS]
  T* Ks = Qs + BM * LDS;                   // [2][BN][LDS]
  T* Vs = Ks + 2 * BN * LDS;               // [2][BN][LDS]

  const int G = H / Hkv;
  const int rows = G * Sq;  // packed rows of one (b, hk) group
  const int nqb = (rows + BM - 1) / BM, nkb = (Sk + BN - 1) / BN;
  int bid = blockIdx.x;
  const int hk = bid % Hkv;
  bid /= Hkv;
  const int b = bid % B;
  const int qb = order[bid / B];
  const long long* klo = bounds + 4 * nqb;
  const long long* khi = klo + nkb;

  int kb = next_kblock(0, nkb, bounds, nqb, qb);
  if (kb >= nkb) return;  // no row sees any key: state unchanged

  const long long krow0 = ((long long)b * Hkv + hk) * Sk;
  const T* kg = k + krow0 * ld;
  const T* vg = v + krow0 * ld;
  const int r0 = qb * BM;  // first packed row of this CTA
  // row of packed row r in the (B, H, Sq) arrays q, acc, m, l
  auto row_of = [&](int r) -> long long {
    return ((long long)b * H + (long long)hk * G + r % G) * Sq + r / G;
  };

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gr = lane >> 2, tg = lane & 3;

  for (int i = tid; i < BM * CH; i += NTHREADS) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = (r0 + r < rows) && (c < ld);
    const T* s = ok ? q + row_of(r0 + r) * ld + c : q;
    cp_async16(Qs + r * LDS + c, s, ok ? 16 : 0);
  }
  cp_commit();
  for (int r = tid; r < BM; r += NTHREADS) {
    const bool ok = r0 + r < rows;
    long long lo = RING_POS_MAX, hi = RING_POS_MIN;  // padding rows see nothing
    if (ok) row_range(row_lo, row_hi, q_pos, causal, (r0 + r) / G, lo, hi);
    rlo_s[r] = lo;
    rhi_s[r] = hi;
    m_in[r] = m_st[r] = ok ? m_state[row_of(r0 + r)] : neg_inf<float>();
    qa_s[r] = (ok && ring_mods_pos(mods)) ? mpos[(r0 + r) / G] : 0;
    md_s[r] = ring_mods_load(mods, mparam, hk * G + (r0 + r) % G, 1.f);
  }
  auto load_kv = [&](int st, int kblock) {
    T* kd = Ks + st * BN * LDS;
    T* vd = Vs + st * BN * LDS;
    for (int i = tid; i < BN * CH; i += NTHREADS) {
      const int r = i / CH, c = (i % CH) * 8;
      const int key = kblock * BN + r;
      const bool ok = (key < Sk) && (c < ld);
      const long long off = ok ? (long long)key * ld + c : 0;
      cp_async16(kd + r * LDS + c, kg + off, ok ? 16 : 0);
      cp_async16(vd + r * LDS + c, vg + off, ok ? 16 : 0);
    }
  };
  int stage = 0;
  load_kv(0, kb);
  cp_commit();

  // this thread's rows: local row lr(mt, r) = warp * 32 + mt * 16 + r * 8 + gr
  // (c0/c1 of m-tile mt are row r = 0, c2/c3 row r = 1).
  float o[MT][NTO][4];
  float mrow[MT][2], lrow[MT][2];
  __syncthreads();  // rlo_s, rhi_s, qa_s, md_s, m_in, m_st
  // The loop starts from the incoming max (so m only grows) with o = l = 0; every
  // RING_FLUSH_KEYS keys and at the end flush() adds o, l to the stored acc, l,
  // scaled by exp2(m_st - m) (m_st: the max they were last scaled to), and the
  // registers start again from zero.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mrow[mt][r] = m_in[warp * 32 + mt * 16 + r * 8 + gr];
      lrow[mt][r] = 0.f;
#pragma unroll
      for (int nt = 0; nt < NTO; ++nt) o[mt][nt][2 * r] = o[mt][nt][2 * r + 1] = 0.f;
    }
  }
  auto flush = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = lrow[mt][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int lr = warp * 32 + mt * 16 + r * 8 + gr;
        const float ms = m_st[lr], mf = mrow[mt][r];
        if (r0 + lr < rows) {
          const long long ri = row_of(r0 + lr);
          // stored state relative to the current max; a row that was empty has acc = l = 0
          const float beta =
              (ms == neg_inf<float>()) ? 0.f : fast_exp2(ms * RING_LOG2E - mf * RING_LOG2E);
          if (tg == 0) l_state[ri] = l_state[ri] * beta + l;
#pragma unroll
          for (int nt = 0; nt < NTO; ++nt) {
            const int col = nt * 8 + tg * 2;
            float* a = acc + ri * D + col;
            if (col < D) a[0] = a[0] * beta + o[mt][nt][2 * r];
            if (col + 1 < D) a[1] = a[1] * beta + o[mt][nt][2 * r + 1];
          }
        }
        __syncwarp();  // the 4 lanes of the row have read m_st[lr] (the warp owns its rows)
        if (tg == 0) m_st[lr] = mf;
        lrow[mt][r] = 0.f;
#pragma unroll
        for (int nt = 0; nt < NTO; ++nt) o[mt][nt][2 * r] = o[mt][nt][2 * r + 1] = 0.f;
      }
    }
    __syncwarp();
  };
  int nflush = 0;  // key blocks in the registers' partial

  constexpr unsigned ROWB = LDS * sizeof(T);  // bytes per smem row
  // per-lane ldmatrix row addresses: A fragments of Q, B fragments of K (S = Q K^T)
  // and of V (O += P V, transposed)
  const unsigned qa_addr = smem_addr(Qs + (warp * 32 + (lane & 15)) * LDS + (lane >> 4) * 8);
  const unsigned k_addr =
      smem_addr(Ks + ((lane & 7) + ((lane >> 4) << 3)) * LDS + ((lane >> 3) & 1) * 8);
  const unsigned v_addr = smem_addr(Vs + (lane & 15) * LDS + (lane >> 4) * 8);
  while (true) {
    const int nxt = next_kblock(kb + 1, nkb, bounds, nqb, qb);
    if (nxt < nkb) {  // prefetch the next visible block into the other stage
      load_kv(stage ^ 1, nxt);
      cp_commit();
      cp_wait<1>();
    } else {
      cp_wait<0>();
    }
    __syncthreads();
    const unsigned kt = k_addr + stage * BN * ROWB, vt = v_addr + stage * BN * ROWB;

    // S = Q K^T; one ldmatrix.x4 of K gives the B fragments of two key n-tiles
    float s[MT][NTS][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTS; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      unsigned qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm_x4(qa[mt], qa_addr + mt * 16 * ROWB + kk * 32);
#pragma unroll
      for (int np = 0; np < NTS / 2; ++np) {
        unsigned bf[4];
        ldsm_x4(bf, kt + np * 16 * ROWB + kk * 32);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::run(s[mt][2 * np], qa[mt], bf[0], bf[1]);
          Mma<T>::run(s[mt][2 * np + 1], qa[mt], bf[2], bf[3]);
        }
      }
    }

    // scaled scores; mask keys past Sk and, where the block plan says so, the
    // keys outside each row's [lo, hi]
    const int k0 = kb * BN;
    const bool need_mask = !block_full(bounds, nqb, qb, klo[kb], khi[kb]);
    const bool partial = k0 + BN > Sk;
#pragma unroll
    for (int nt = 0; nt < NTS; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kj = k0 + nt * 8 + tg * 2 + e;
        long long kp = 0;
        if ((need_mask || ring_mods_pos(mods)) && kj < Sk) kp = k_pos[kj];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float x = s[mt][nt][2 * r + e] * scale;
            if (mods) {
              const int lr = warp * 32 + mt * 16 + r * 8 + gr;
              x = ring_modify(mods, md_s[lr], x, qa_s[lr], kp);
            }
            if (partial || need_mask) {
              const int lr = warp * 32 + mt * 16 + r * 8 + gr;
              const bool vis = kj < Sk && (!need_mask || (rlo_s[lr] <= kp && kp <= rhi_s[lr]));
              if (!vis) x = neg_inf<float>();
            }
            s[mt][nt][2 * r + e] = x;
          }
        }
      }
    }

    // online softmax per row
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = neg_inf<float>();
#pragma unroll
        for (int nt = 0; nt < NTS; ++nt) mx = maxa(mx, maxa(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = maxa(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = maxa(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = maxa(mrow[mt][r], mx);
        const float m_use = (m_new == neg_inf<float>()) ? 0.f : m_new;
        const float ms = m_use * RING_LOG2E;
        const float alpha = fast_exp2(mrow[mt][r] * RING_LOG2E - ms);
        float rsum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NTS; ++nt) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            const float p = fast_exp2(s[mt][nt][e] * RING_LOG2E - ms);
            s[mt][nt][e] = p;
            rsum += p;
          }
        }
        lrow[mt][r] = lrow[mt][r] * alpha + rsum;
        mrow[mt][r] = m_new;
#pragma unroll
        for (int nt = 0; nt < NTO; ++nt) {
          o[mt][nt][2 * r] *= alpha;
          o[mt][nt][2 * r + 1] *= alpha;
        }
      }
    }

    // O += P V: the S accumulators of key n-tiles 2kk, 2kk+1 are the A
    // fragment of keys [16kk, 16kk + 16); one ldmatrix.trans of V serves both m-tiles
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = Mma<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = Mma<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = Mma<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = Mma<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int np = 0; np < HD / 16; ++np) {
        unsigned bf[4];
        ldsm_x4_trans(bf, vt + kk * 16 * ROWB + np * 32);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::run(o[mt][2 * np], a[mt], bf[0], bf[1]);
          Mma<T>::run(o[mt][2 * np + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
    if (++nflush == RING_FLUSH_KEYS / BN) {  // uniform over the CTA
      flush();
      nflush = 0;
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
    if (nxt >= nkb) break;
    kb = nxt;
    stage ^= 1;
  }

  if (nflush) flush();  // the last partial
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int lr = warp * 32 + mt * 16 + r * 8 + gr;
      const float mi = m_in[lr], mf = mrow[mt][r];
      // natural units: the max is one scaled score's bits, as the other kernels store
      if (r0 + lr < rows && tg == 0 && mf != mi) m_state[row_of(r0 + lr)] = mf;
    }
  }
}

// ----------------------------------------------------------------------------
// General kernel on the CUDA cores: fp32 and fp64 (any D <= DMAX), and
// fp16/bf16 heads wider than 128. 256 threads as a 16 x 16 grid (ty, tx);
// thread (ty, tx) owns query rows ty + 16 i and, for S, keys tx + 16 j and,
// for O, head-dim columns tx + 16 j. Q, K, V and P live in shared memory in
// the accumulation type. Dynamic shared memory:
// ((BM + 2 BN) (DMAX + 1) + BM (BN + 1)) * sizeof(A) bytes.
// ----------------------------------------------------------------------------
template <typename T, typename A, int DMAX, int BM, int BN>
__global__ void __launch_bounds__(256, 1)
    attn_fwd_simt(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  A* __restrict__ acc, A* __restrict__ m_state, A* __restrict__ l_state,
                  const long long* __restrict__ q_pos, const long long* __restrict__ k_pos,
                  const long long* __restrict__ bounds, const long long* __restrict__ row_lo,
                  const long long* __restrict__ row_hi, int H, int Hkv, int Sq, int Sk, int D,
                  int ld, A scale, int causal, unsigned mods,
                  const double* __restrict__ mparam, const long long* __restrict__ mpos) {
  constexpr int NTHREADS = 256;
  constexpr int LD = DMAX + 1;  // odd stride: rows fall in different banks
  constexpr int LP = BN + 1;
  constexpr int RM = BM / 16, RN = BN / 16, RD = DMAX / 16;
  static_assert(BM % 16 == 0 && BN % 16 == 0 && DMAX % 16 == 0, "tile sizes");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* Qs = reinterpret_cast<A*>(smem_raw);  // [BM][LD]
  A* Ks = Qs + BM * LD;                    // [BN][LD]
  A* Vs = Ks + BN * LD;                    // [BN][LD]
  A* Ps = Vs + BN * LD;                    // [BM][LP]

  const int qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int nqb = (Sq + BM - 1) / BM, nkb = (Sk + BN - 1) / BN;
  const long long* klo = bounds + 4 * nqb;
  const long long* khi = klo + nkb;

  int kb = next_kblock(0, nkb, bounds, nqb, qb);
  if (kb >= nkb) return;

  const int hk = h / (H / Hkv);
  const long long qrow0 = ((long long)b * H + h) * Sq;
  const long long krow0 = ((long long)b * Hkv + hk) * Sk;
  const T* qg = q + qrow0 * ld;
  const T* kg = k + krow0 * ld;
  const T* vg = v + krow0 * ld;
  const int q0 = qb * BM;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const A zero = 0;

  for (int i = tid; i < BM * DMAX; i += NTHREADS) {
    const int r = i / DMAX, c = i % DMAX;
    Qs[r * LD + c] = (q0 + r < Sq && c < D) ? to_acc<A>(qg[(long long)(q0 + r) * ld + c]) : zero;
  }

  // the state (o - oc, l - lc) of each row: every key block's P V and row sum
  // are summed from zero (pv, rsum) and added by compensated summation
  A o[RM][RD], oc[RM][RD], mrow[RM], lrow[RM], lc[RM];
  long long rlo[RM], rhi[RM];  // visible key positions of each row (none for padding)
  long long qar[RM];           // modifier position (mpos) of each row
  __shared__ RingMods<A> md;   // this head's modifier parameters
  if (tid == 0) md = ring_mods_load(mods, mparam, h, (A)1);
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const int row = q0 + ty + 16 * i;
    const bool valid = row < Sq;
    qar[i] = (valid && ring_mods_pos(mods)) ? mpos[row] : 0;
    mrow[i] = valid ? m_state[qrow0 + row] : neg_inf<A>();
    lrow[i] = (valid && tx == 0) ? l_state[qrow0 + row] : zero;
    lc[i] = zero;
    rlo[i] = RING_POS_MAX;
    rhi[i] = RING_POS_MIN;
    if (valid) row_range(row_lo, row_hi, q_pos, causal, row, rlo[i], rhi[i]);
#pragma unroll
    for (int j = 0; j < RD; ++j) {
      const int c = tx + 16 * j;
      o[i][j] = (valid && c < D) ? acc[(qrow0 + row) * D + c] : zero;
      oc[i][j] = zero;
    }
  }

  for (; kb < nkb; kb = next_kblock(kb + 1, nkb, bounds, nqb, qb)) {
    const int k0 = kb * BN;
    __syncthreads();  // previous block's readers are done (and Q is stored)
    for (int i = tid; i < BN * DMAX; i += NTHREADS) {
      const int r = i / DMAX, c = i % DMAX;
      const bool ok = k0 + r < Sk && c < D;
      const long long gi = (long long)(k0 + r) * ld + c;
      Ks[r * LD + c] = ok ? to_acc<A>(kg[gi]) : zero;
      Vs[r * LD + c] = ok ? to_acc<A>(vg[gi]) : zero;
    }
    __syncthreads();

    // S = Q K^T for rows ty + 16 i and keys tx + 16 j
    A s[RM][RN];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RN; ++j) s[i][j] = zero;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
      A qa[RM], kb_[RN];
#pragma unroll
      for (int i = 0; i < RM; ++i) qa[i] = Qs[(ty + 16 * i) * LD + d];
#pragma unroll
      for (int j = 0; j < RN; ++j) kb_[j] = Ks[(tx + 16 * j) * LD + d];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) s[i][j] += qa[i] * kb_[j];
    }

    const bool need_mask = !block_full(bounds, nqb, qb, klo[kb], khi[kb]);
    const bool partial = k0 + BN > Sk;
#pragma unroll
    for (int i = 0; i < RM; ++i) {
      A mx = neg_inf<A>();
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        A x = s[i][j] * scale;
        if (mods) {
          const int kj = k0 + tx + 16 * j;
          const long long kp = kj < Sk ? k_pos[kj] : 0;
          x = ring_modify(mods, md, x, qar[i], kp);
        }
        if (partial || need_mask) {
          const int kj = k0 + tx + 16 * j;
          bool vis = kj < Sk;
          if (vis && need_mask) {
            const long long kp = k_pos[kj];
            vis = rlo[i] <= kp && kp <= rhi[i];
          }
          if (!vis) x = neg_inf<A>();
        }
        s[i][j] = x;
        mx = maxa(mx, x);
      }
      // the 16 lanes tx = 0..15 of one row are one half-warp
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) mx = maxa(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const A m_new = maxa(mrow[i], mx);
      const A m_safe = (m_new == neg_inf<A>()) ? zero : m_new;
      const A alpha = exp_acc(mrow[i] - m_safe);
      A rsum = zero;
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        const A p = exp_acc(s[i][j] - m_safe);
        rsum += p;
        Ps[(ty + 16 * i) * LP + tx + 16 * j] = p;
      }
      // alpha = 1 (the usual case once the max has settled) scales exactly
      lc[i] *= alpha;
      lrow[i] = kahan_add(lrow[i] * alpha, rsum, lc[i]);
      mrow[i] = m_new;
#pragma unroll
      for (int j = 0; j < RD; ++j) {
        o[i][j] *= alpha;
        oc[i][j] *= alpha;
      }
    }
    __syncthreads();

    // O += P V over the valid keys of the block: the block's product from zero,
    // then added to the state once, compensated
    const int nk = (Sk - k0 < BN) ? Sk - k0 : BN;
    A pv[RM][RD];
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RD; ++j) pv[i][j] = zero;
#pragma unroll 4
    for (int kk = 0; kk < nk; ++kk) {
      A pa[RM], va[RD];
#pragma unroll
      for (int i = 0; i < RM; ++i) pa[i] = Ps[(ty + 16 * i) * LP + kk];
#pragma unroll
      for (int j = 0; j < RD; ++j) va[j] = Vs[kk * LD + tx + 16 * j];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RD; ++j) pv[i][j] += pa[i] * va[j];
    }
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RD; ++j) o[i][j] = kahan_add(o[i][j], pv[i][j], oc[i][j]);
  }

#pragma unroll
  for (int i = 0; i < RM; ++i) {
    A l = sub_rn(lrow[i], lc[i]);
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    const int row = q0 + ty + 16 * i;
    if (row < Sq) {
      if (tx == 0) {
        m_state[qrow0 + row] = mrow[i];
        l_state[qrow0 + row] = l;
      }
#pragma unroll
      for (int j = 0; j < RD; ++j) {
        const int c = tx + 16 * j;
        if (c < D) acc[(qrow0 + row) * D + c] = sub_rn(o[i][j], oc[i][j]);
      }
    }
  }
}
