/* attention_wg.cu: the Hopper (sm_90a) flash attention kernels at head dim
 * 64 (forward also 128), bf16/f16; the tile machinery is attention_tc.cuh's.
 *
 * The same algorithms as the mma.sync kernels, with the products on wgmma:
 * a warpgroup (4 warps) owns 64 rows of a tile and issues m64nNk16 products
 * whose operands are read by the tensor cores straight from shared memory
 * (descriptors) or, for P, dS and their transposes, from the registers
 * holding the accumulators of the previous product. Every tile in shared
 * memory has rows of 64 elements (128 bytes) with the 16-byte chunk c of row
 * r at c ^ (r & 7): the layout the existing cp.async loads write is exactly
 * the wgmma 128-byte swizzle when the tile starts 1024-byte aligned. A
 * row-major [rows][64] tile is a K-major operand (Q, K as S = Q K^T's A and
 * B) with the k-th 16-column slice at +32 bytes, or an MN-major B operand
 * (V in O += P V) with the k-th 16-row slice at +2048 bytes. */

#include "attention_tc.cuh"
#include "wgmma.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>

/* the kernels' bodies exist in the sm_90a pass only (GP_WG: in the others,
 * and in the host pass, they are empty; the dispatch launches them only on a
 * compute capability 9.0 device of a build with sm_90a code, GP_SM90A) */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GP_WG 1
#else
#define GP_WG 0
#endif

namespace gp_attn {
namespace {

#if GP_WG
/* the descriptors of a [rows][64] swizzled tile at shared address a */
__device__ __forceinline__ uint64_t wg_kmajor(uint32_t a) { return wg::desc(a, 16, 1024); }
__device__ __forceinline__ uint64_t wg_mnmajor(uint32_t a) { return wg::desc(a, 16, 1024); }

/* the first 1024-byte aligned address in the dynamic shared memory (the
 * launch asks for 1 KB more) */
__device__ __forceinline__ uint4 *align1k(uint4 *p) {
  const uint32_t a = smem_u32(p);
  return p + (((1024 - (a & 1023)) & 1023) >> 4);
}

/* the backward's first two products, each over D / 16 K-major k-slices of
 * two tiles of 64-column halves (an operand's second half ahs / bhs bytes
 * after its first; D 64 has one): s = A1 B1^T, then dp = A2 B2^T, issued in
 * two commit groups (wg::wait<1> then gives s) */
template <int N, typename T, int D>
__device__ __forceinline__ void wg_s_dp(float (*s)[4], float (*dp)[4], uint32_t a1, uint32_t b1, uint32_t a2,
                                        uint32_t b2, int ahs, int bhs) {
  /* D 64: the first k-slices write s and dp (zeroing them first made ptxas
   * serialize every product of the 3-CTA dk/dv kernel for want of
   * registers); D 128 zeroes them as before (with the first slices written,
   * here and in the dQ product, its backward measured 1-2% slower at B4 H8
   * T2048 causal on the H200, level at T4096) */
  constexpr int K0 = D == 64 ? 1 : 0;
  if constexpr (!K0) {
#pragma unroll
    for (int nt = 0; nt < N / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
  }
  wg::fence();
  if constexpr (K0) wg::mma<N, T>::ss0(&s[0][0], wg_kmajor(a1), wg_kmajor(b1));
#pragma unroll
  for (int kk = K0; kk < D / 16; kk++)
    wg::mma<N, T>::ss(&s[0][0], wg_kmajor(a1 + (kk >> 2) * ahs + (kk & 3) * 32),
                      wg_kmajor(b1 + (kk >> 2) * bhs + (kk & 3) * 32), 1);
  wg::commit();
  if constexpr (K0) wg::mma<N, T>::ss0(&dp[0][0], wg_kmajor(a2), wg_kmajor(b2));
#pragma unroll
  for (int kk = K0; kk < D / 16; kk++)
    wg::mma<N, T>::ss(&dp[0][0], wg_kmajor(a2 + (kk >> 2) * ahs + (kk & 3) * 32),
                      wg_kmajor(b2 + (kk >> 2) * bhs + (kk & 3) * 32), 1);
  wg::commit();
}
/* an MN-major B operand of N = D columns in 64-column halves hs bytes apart,
 * rows from shared address a */
__device__ __forceinline__ uint64_t wg_mn_halves(uint32_t a, int hs) { return wg::desc(a, hs, 1024); }
#endif

/* forward at head dim D (64, or 128 with every tile in two column halves:
 * load_tile's HALVES): NWG warpgroups, 64 query rows each (BM = 64 NWG), key
 * tiles of BN keys in NS stages loaded with cp.async one tile ahead; S = Q K^T
 * by descriptors, the online softmax in registers (as k_attn_fwd_mma), O += P
 * V with P from registers. PIPE: the two products overlap the softmax
 * (FlashAttention-3's intra-warpgroup pipelining): tile t's S = Q K_t^T and
 * the previous tile's O += P_{t-1} V_{t-1} are issued together, the softmax
 * of S_t runs while the second product is on the tensor cores, and O is
 * rescaled once it is done; else one product at a time. One barrier a tile;
 * the stage tile t + 1 loads into last held tile t + 1 - NS (s_issue says
 * when that is free). Blocks take (head, query tile) in head_tile's order. */
template <typename T, int D, int NWG, int BN, int MINB, int NS, bool PIPE>
__global__ void __launch_bounds__(NWG * 128, MINB) k_attn_fwd_wg(AttnP P, int BH) {
  static_assert(NS >= 3, "one barrier a tile needs 3 stages");
#if GP_WG
  constexpr int NTH = NWG * 128, BM = 64 * NWG, NT = BN / 8, DT = D / 8;
  extern __shared__ uint4 attn_smem[];
  T *Qs = (T *)align1k(attn_smem);
  T *Ks = Qs + BM * D; /* NS stages */
  T *Vs = Ks + NS * BN * D;
  const int wgi = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int n_m = gridDim.x / BH;
  int bh, mt; /* this block's head and query tile (the last first: the longest rows when causal) */
  head_tile(blockIdx.x, BH, n_m, (int64_t)P.S * D * 2 * sizeof(T), P.l2, bh, mt);
  const int i0 = (n_m - 1 - mt) * BM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H);
  const T *k = (const T *)P.k + kv_at(P.sk, bh, P);
  const T *v = (const T *)P.v + kv_at(P.sv, bh, P);

  const int pmin = i0 + off, pmax = min(i0 + BM, P.T) - 1 + off;
  const KvTiles kt = kv_tiles(P, pmin, pmax, BN);
  const int n_tiles = kt.n;

  load_tile<T, D, BM, NTH, true>(Qs, q, P.sq.r, i0, P.T);
  if (n_tiles > 0) {
    load_tile<T, D, BN, NTH, true>(Ks, k, P.sk.r, kt.j0(0), P.S);
    load_tile<T, D, BN, NTH, true>(Vs, v, P.sv.r, kt.j0(0), P.S);
  }
  cp_async_commit();

  float o[DT][4], m[2], l[2], s[NT][4];
  uint32_t pa[BN / 16][4]; /* P of the previous tile: the A operand of O += P V */
  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.f;
#pragma unroll
  for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  const float sl2 = P.scale * LOG2E;
  const int wrow = wgi * 64 + warp * 16;            /* the warp's first row in the tile */
  const uint32_t qa = smem_u32(Qs + wgi * 64 * 64); /* the warpgroup's rows in each column half */

  /* O += P V over the stage of tile t (P in pa) */
  auto pv_issue = [&](int t) {
    const uint32_t va = smem_u32(Vs + (t % NS) * BN * D);
    wg::fence_operand<DT * 4>(&o[0][0]);
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
      wg::mma<D, T>::template rs<1>(&o[0][0], pa[kk], wg::desc(va + kk * 2048, BN * 128, 1024), 1);
    wg::commit();
  };
  /* S_t masked (MK 1) and turned into P_t; alpha: O's factor */
  auto soft = [&](auto mk_tag, int t, float *alpha) {
    constexpr int MK = decltype(mk_tag)::value;
    if constexpr (MK == 1) {
      const int j0 = kt.j0(t);
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int p = i0 + wrow + (lane >> 2) + ((e >> 1) << 3) + off;
          const int j = j0 + nt * 8 + ((lane & 3) << 1) + (e & 1);
          if (j >= P.S || !vis(p, j, P.win, P.ng, P.causal)) s[nt][e] = -INFINITY;
        }
    } else if constexpr (MK == 2) {
      causal_hide<NT, true>(s, kt.j0(t) + ((lane & 3) << 1) - (i0 + wrow + (lane >> 2) + off), -INFINITY);
    }
    softmax_p<NT>(s, m, l, alpha, sl2);
  };

  /* tile t + 1's loads (if any), one commit group either way */
  auto load_next = [&](int t) {
    if (t + 1 < n_tiles) {
      const int o2 = ((t + 1) % NS) * BN * D;
      load_tile<T, D, BN, NTH, true>(Ks + o2, k, P.sk.r, kt.j0(t + 1), P.S);
      load_tile<T, D, BN, NTH, true>(Vs + o2, v, P.sv.r, kt.j0(t + 1), P.S);
    }
    cp_async_commit();
  };
  /* tile t in place and visible to every warpgroup, tile t + 1's loads
   * issued, S = Q K_t^T issued (mma: false, only the wait and the loads) */
  auto s_issue = [&](int t, bool mma) {
    if constexpr (!PIPE || NS >= 4) {
      /* tile t + 1's stage last held tile t + 1 - NS, whose O += P V every
       * warpgroup finished before the barrier of tile t - 1 (PIPE: that
       * product runs in the next tile's step, so NS >= 4): its loads go out
       * before tile t's wait */
      load_next(t);
      cp_async_wait<1>();
      wg::fence_proxy();
      __syncthreads();
    } else {
      cp_async_wait<0>(); /* tile t (the only group in flight) */
      wg::fence_proxy();
      __syncthreads();
      load_next(t);
    }
    if (!mma) return;
    const uint32_t ka = smem_u32(Ks + (t % NS) * BN * D);
#pragma unroll
    for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    wg::fence();
    wg::fence_operand<NT * 4>(&s[0][0]);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
      wg::mma<BN, T>::ss(&s[0][0], wg_kmajor(qa + (kk >> 2) * BM * 128 + (kk & 3) * 32),
                         wg_kmajor(ka + (kk >> 2) * BN * 128 + (kk & 3) * 32), 1);
    wg::commit();
  };
  /* S_t done: P_t and its factor for O */
  auto s_soft = [&](int t, float *alpha) {
    wg::fence_operand<NT * 4>(&s[0][0]);
    with_mask(tile_mask(P, pmin, pmax, kt.j0(t), BN), [&](auto mk) { soft(mk, t, alpha); });
  };

  if constexpr (!PIPE) { /* one product at a time */
    /* causal without a window: the tiles past the warpgroup's last row hide
     * every key from it (P = 0); it only waits at their barriers */
    int nw = n_tiles;
    if (P.causal && P.win == 0) nw = min(n_tiles, max(0, (min(i0 + wgi * 64 + 63, P.T - 1) + off) / BN + 1));
    for (int t = 0; t < n_tiles; t++) {
      float alpha[2];
      if (t >= nw) {
        s_issue(t, false);
        continue;
      }
      s_issue(t, true);
      wg::wait<0>();
      s_soft(t, alpha);
      rescale_rows<DT>(o, alpha);
#pragma unroll
      for (int kk = 0; kk < BN / 16; kk++) acc_to_a<T>(pa[kk], s, kk);
      wg::fence();
      pv_issue(t);
      wg::wait<0>();
      wg::fence_operand<DT * 4>(&o[0][0]);
    }
  } else if (n_tiles > 0) {
    float alpha[2];
    s_issue(0, true);
    wg::wait<0>();
    s_soft(0, alpha); /* (O is zero: no rescale) */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) acc_to_a<T>(pa[kk], s, kk);
    for (int t = 1; t < n_tiles; t++) {
      s_issue(t, true);
      pv_issue(t - 1); /* the previous tile's O += P V */
      wg::wait<1>();   /* S_t */
      s_soft(t, alpha);
      wg::wait<0>(); /* O */
      wg::fence_operand<DT * 4>(&o[0][0]);
      wg::fence_operand<BN / 4>(&pa[0][0]);
      rescale_rows<DT>(o, alpha);
#pragma unroll
      for (int kk = 0; kk < BN / 16; kk++) acc_to_a<T>(pa[kk], s, kk);
    }
    /* the last tile's O += P V (its stage is in place since its barrier) */
    wg::fence();
    pv_issue(n_tiles - 1);
    wg::wait<0>();
    wg::fence_operand<DT * 4>(&o[0][0]);
  }
  cp_async_wait<0>();

  store_out_rows<T, DT>(P, bh, i0 + wrow, o, m, l, P.scale, lane);
#endif
}


#if GP_WG
/* mbarriers (shared memory, 8 bytes each) */
__device__ __forceinline__ void mb_init(uint32_t a, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(n) : "memory");
}
__device__ __forceinline__ void mb_arrive(uint32_t a) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory");
}
/* an arrival when every cp.async this thread issued before it has landed */
__device__ __forceinline__ void mb_cp_arrive(uint32_t a) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mb_wait(uint32_t a, uint32_t parity) {
  asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n" ::"r"(a),
               "r"(parity)
               : "memory");
}
template <int R> __device__ __forceinline__ void reg_dealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)); }
template <int R> __device__ __forceinline__ void reg_alloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)); }
/* one arrival that also expects bytes of copies (TMA) to land */
__device__ __forceinline__ void mb_expect(uint32_t a, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(a), "r"(bytes) : "memory");
}
/* a TMA copy of one box of a 4-d tensor map into shared memory at dst; its
 * bytes complete on the mbarrier at bar */
__device__ __forceinline__ void tma_load4(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, int c3,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
#endif

/* the warp-specialized forward's TMA descriptors of q, k and v (4-d: columns,
 * then rows and heads in the order of their strides, then batches; boxes of 64
 * columns, the 128-byte swizzle the wgmma tiles use, rows past the end read as
 * zeros). on = 0: the producer copies with cp.async instead. hin: heads are
 * the inner of the two (the packed qkv layout, (B, T, 3, H, D)) */
struct TmaMaps {
  CUtensorMap q, k, v;
  int on, hin_q, hin_kv;
};

/* forward, warp-specialized and persistent (FlashAttention-3's layout of the
 * work, with cp.async for the loads): NC + 1 warpgroups, the first a
 * producer that copies each work item's Q tile (BM = 64 NC rows, two
 * buffers) and its K and V tiles (BN keys, NS stages each) into shared
 * memory, the other NC consumers of 64 query rows each running the pipelined
 * loop of k_attn_fwd_wg (S_t = Q K_t^T issued with O += P_{t-1} V_{t-1}, the
 * softmax of S_t while the second product runs), taking turns at the tensor
 * cores. Full and empty mbarriers a buffer replace the block barrier: the
 * producer's cp.asyncs arrive on a full barrier when they land
 * (cp.async.mbarrier.arrive.noinc; every producer thread counts), a consumer
 * fences the generic proxy's writes against its wgmma reads after the wait,
 * and each consumer warp arrives on the empty barrier once its products have
 * read the buffer. The producer gives up most of its registers to the
 * consumers (setmaxnreg). The grid is one block an SM: block b's first item
 * is b, the next ones come from a counter in global memory (sched: {next,
 * blocks done}, zero at launch; the last block to finish zeroes it again),
 * in head_tile's order (the longest causal rows first), so the blocks'
 * work evens out as with hardware scheduling of one block an item, and the
 * producer loads the next item's Q and first tiles while the consumers
 * finish the current one. */
template <typename T, int D, int BN, int NS, int NC>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
    k_attn_fwd_ws(AttnP P, int BH, int n_items, int *sched, const __grid_constant__ TmaMaps M) {
#if GP_WG
  constexpr int BM = 64 * NC, NT = BN / 8, DT = D / 8, NCW = 4 * NC; /* NCW: consumer warps */
  /* TMA copies at head dim 128 only: at 64 the producer's 32 registers (3 consumers) would spill */
  const bool tma = D == 128 && M.on;
  /* registers a thread: the producer's few, the consumers' the rest of 64K */
  constexpr int PREG = NC == 2 ? 56 : 32, CREG = NC == 2 ? 224 : 160;
  extern __shared__ uint4 attn_smem[];
  T *Qs = (T *)align1k(attn_smem); /* 2 buffers */
  T *Ks = Qs + 2 * BM * D;         /* NS stages */
  T *Vs = Ks + NS * BN * D;
  const uint32_t bar = smem_u32(Vs + NS * BN * D);
  volatile int *slot = (volatile int *)(Vs + NS * BN * D) + 2 * (4 + 4 * NS); /* each Q buffer's item */
  /* barriers: Q full [2], Q empty [2], then K full, K empty, V full, V empty [NS] each */
  const auto QF = [&](int b) { return bar + 8 * b; };
  const auto QE = [&](int b) { return bar + 8 * (2 + b); };
  const auto KF = [&](int s) { return bar + 8 * (4 + s); };
  const auto KE = [&](int s) { return bar + 8 * (4 + NS + s); };
  const auto VF = [&](int s) { return bar + 8 * (4 + 2 * NS + s); };
  const auto VE = [&](int s) { return bar + 8 * (4 + 3 * NS + s); };
  /* full barriers: the producer's 128 cp.async arrivals (QF: + the item's), or one TMA arrival */
  if (threadIdx.x == 0) {
    const int nf = tma ? 1 : 128;
    for (int b = 0; b < 2; b++) mb_init(QF(b), nf + !tma), mb_init(QE(b), NCW);
    for (int s = 0; s < NS; s++) mb_init(KF(s), nf), mb_init(KE(s), NCW), mb_init(VF(s), nf), mb_init(VE(s), NCW);
  }
  __syncthreads();
  const int n_m = (P.T + BM - 1) / BM, off = P.S - P.T;
  const int64_t bytes_head = (int64_t)P.S * D * 2 * sizeof(T);
  const int wgi = threadIdx.x >> 7;

  if (wgi == 0) { /* the producer: by TMA (tma, thread 0 issues every copy) or by its threads' cp.async */
    reg_dealloc<PREG>();
    int g = 0; /* the block's K/V tiles so far */
    for (int i = 0;; i++) {
      if (i >= 2) mb_wait(QE(i & 1), ((i >> 1) - 1) & 1);
      if (threadIdx.x == 0) slot[i & 1] = i == 0 ? blockIdx.x : gridDim.x + atomicAdd(sched, 1);
      asm volatile("bar.sync 1, 128;\n" ::: "memory");
      const int item = slot[i & 1];
      if (item >= n_items) { /* the consumers stop too */
        if (!tma) mb_cp_arrive(QF(i & 1));
        if (threadIdx.x == 0) {
          mb_arrive(QF(i & 1));
          /* the last block to finish resets the counters for the next launch */
          __threadfence();
          if (atomicAdd(sched + 1, 1) == (int)gridDim.x - 1) sched[0] = sched[1] = 0;
        }
        break;
      }
      int bh, mt;
      head_tile(item, BH, n_m, bytes_head, P.l2, bh, mt);
      const int i0 = (n_m - 1 - mt) * BM;
      const KvTiles kt = kv_tiles(P, i0 + off, min(i0 + BM, P.T) - 1 + off, BN);
      if (tma && threadIdx.x != 0) continue;
      const int b = bh / P.H, h = bh % P.H, hk = P.G == 1 ? h : h / P.G;
      /* TMA: rows r.. of head hh (of batch b) into a tile of `rows` at dst,
       * coordinates (column, row, head) or (column, head, row) */
      const auto box = [&](uint32_t dst, const CUtensorMap *map, int hin, int rows, int r, int hh, uint32_t bar) {
#pragma unroll
        for (int hf = 0; hf < D / 64; hf++)
          tma_load4(dst + hf * rows * 128, map, hf * 64, hin ? hh : r, hin ? r : hh, b, bar);
      };
      const T *k = (const T *)P.k + kv_at(P.sk, bh, P), *v = (const T *)P.v + kv_at(P.sv, bh, P);
      /* a K or V tile of keys j0.. into dst, completing the full barrier */
      const auto kv_tile = [&](T *dst, const CUtensorMap *map, const T *src, int64_t rs, int j0, uint32_t full) {
        if (tma) {
          mb_expect(full, BN * D * (int)sizeof(T));
          box(smem_u32(dst), map, M.hin_kv, BN, j0, hk, full);
        } else {
          load_tile<T, D, BN, 128, true>(dst, src, rs, j0, P.S);
          mb_cp_arrive(full);
        }
      };
      if (tma) {
        mb_expect(QF(i & 1), BM * D * (int)sizeof(T));
        box(smem_u32(Qs + (i & 1) * BM * D), &M.q, M.hin_q, BM, i0, h, QF(i & 1));
      } else {
        load_tile<T, D, BM, 128, true>(Qs + (i & 1) * BM * D, (const T *)P.q + head_at(P.sq, bh, P.H), P.sq.r, i0, P.T);
        mb_cp_arrive(QF(i & 1));
        if (threadIdx.x == 0) mb_arrive(QF(i & 1));
      }
      for (int t = 0; t < kt.n; t++, g++) {
        const int s = g % NS, u = g / NS;
        if (u > 0) mb_wait(KE(s), (u - 1) & 1);
        kv_tile(Ks + s * BN * D, &M.k, k, P.sk.r, kt.j0(t), KF(s));
        if (u > 0) mb_wait(VE(s), (u - 1) & 1);
        kv_tile(Vs + s * BN * D, &M.v, v, P.sv.r, kt.j0(t), VF(s));
      }
    }
    if (!tma) asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  reg_alloc<CREG>();
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int wrow = (wgi - 1) * 64 + warp * 16; /* the warp's first row in the tile */
  const bool lead = lane == 0;                 /* the lane that arrives on empty barriers */
  /* the consumer warpgroups issue their products in turn (named barrier 1 +
   * w is warpgroup w's turn; FlashAttention-3's ping-pong), so that one's
   * softmax runs while another's products hold the tensor cores; the last
   * warpgroup opens the first turn */
  const auto turn_wait = [&]() { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wgi) : "memory"); };
  const auto turn_pass = [&]() {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (wgi == NC ? 1 : wgi + 1)) : "memory");
  };
  if (wgi == NC) turn_pass();
  const float sl2 = P.scale * LOG2E;
  float o[DT][4], m[2], l[2], s[NT][4];
  uint32_t pa[BN / 16][4]; /* P of the previous tile: the A operand of O += P V */

  /* the block's i-th item, its Q tile in place (item >= n_items: no more) */
  struct Item {
    int item, bh, i0, pmin, pmax, g; /* g: the block's K/V tiles before this item's */
    KvTiles kt;
    uint32_t qa; /* this warpgroup's rows of the Q tile */
  };
  const auto fetch = [&](int i, int g) {
    Item it;
    mb_wait(QF(i & 1), (i >> 1) & 1);
    it.item = slot[i & 1];
    it.g = g;
    if (it.item >= n_items) return it;
    int mt;
    head_tile(it.item, BH, n_m, bytes_head, P.l2, it.bh, mt);
    it.i0 = (n_m - 1 - mt) * BM;
    it.pmin = it.i0 + off;
    it.pmax = min(it.i0 + BM, P.T) - 1 + off;
    it.kt = kv_tiles(P, it.pmin, it.pmax, BN);
    it.qa = smem_u32(Qs + (i & 1) * BM * D + (wgi - 1) * 64 * 64);
    return it;
  };
  /* the K or V tile of the block's gi-th K/V tile in place */
  const auto wait_k = [&](int gi) { mb_wait(KF(gi % NS), (gi / NS) & 1); };
  const auto wait_v = [&](int gi) { mb_wait(VF(gi % NS), (gi / NS) & 1); };
  /* S = Q K^T issued (K: the block's gi-th tile; the first k-slice
   * overwrites S, which no other instruction defines while a product may be
   * in flight) */
  const auto s_issue = [&](uint32_t qa, int gi) {
    const uint32_t ka = smem_u32(Ks + (gi % NS) * BN * D);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
      wg::mma<BN, T>::ss(&s[0][0], wg_kmajor(qa + (kk >> 2) * BM * 128 + (kk & 3) * 32),
                         wg_kmajor(ka + (kk >> 2) * BN * 128 + (kk & 3) * 32), kk > 0);
    wg::commit();
  };
  /* O += P V issued (P in pa, V: the block's gi-th tile); first: O = P V (so
   * that O is never zeroed by other instructions while a product is in
   * flight, which would make ptxas serialize every product) */
  const auto pv_issue = [&](int gi, bool first) {
    const uint32_t va = smem_u32(Vs + (gi % NS) * BN * D);
    wg::fence_operand<DT * 4>(&o[0][0]);
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
      wg::mma<D, T>::template rs<1>(&o[0][0], pa[kk], wg::desc(va + kk * 2048, BN * 128, 1024), first && kk == 0 ? 0 : 1);
    wg::commit();
  };
  /* S of tile t of item c done: its K stage (and, after the item's last tile,
   * its Q buffer) released; S masked where needed and turned into P (in pa);
   * alpha: O's factor */
  const auto s_soft = [&](const Item &c, int i, int t, float *alpha) {
    wg::fence_operand<NT * 4>(&s[0][0]);
    if (lead) {
      mb_arrive(KE((c.g + t) % NS));
      if (t == c.kt.n - 1) mb_arrive(QE(i & 1));
    }
    const int j0 = c.kt.j0(t), mk = tile_mask(P, c.pmin, c.pmax, j0, BN);
    if (mk == 2) {
      causal_hide<NT, true>(s, j0 + ((lane & 3) << 1) - (c.i0 + wrow + (lane >> 2) + off), -INFINITY);
    } else if (mk == 1) {
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int p = c.i0 + wrow + (lane >> 2) + ((e >> 1) << 3) + off;
          const int j = j0 + nt * 8 + ((lane & 3) << 1) + (e & 1);
          if (j >= P.S || !vis(p, j, P.win, P.ng, P.causal)) s[nt][e] = -INFINITY;
        }
    }
    softmax_p<NT>(s, m, l, alpha, sl2);
  };
  const auto reset = [&]() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  };

  /* The items run back to back: the next item's first S = Q K^T is issued
   * with the current item's last O += P V, so that the output's store and
   * the next item's first wait overlap a product. The loop is straight-line
   * code around the products (no branch joins with a product in flight,
   * where ptxas would serialize them all): every item has a key tile (S >=
   * 1, causal S >= T), and after the block's last item its last S is issued
   * once more (its Q and K stay in place: the producer is done). */
  Item c = fetch(0, 0); /* a valid item: the grid has at most one block an item */
  reset();
#pragma unroll
  for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  wait_k(c.g);
  wg::fence_proxy();
  turn_wait();
  s_issue(c.qa, c.g);
  turn_pass();
  for (int i = 0;; i++) {
    const int n = c.kt.n;
    /* nw: the item's tiles this warpgroup's rows see (causal: the tiles past
     * its last row are skipped, as are all but the first for rows past T;
     * the K and V of a skipped tile are still waited for and released, and
     * the turns taken, so that every barrier counts the same) */
    int nw = n;
    if (P.causal) {
      const int r = c.i0 + (wgi - 1) * 64;
      const int pw = min(r + 63, P.T - 1) + off;
      if (r >= P.T) nw = 1;
      else
        while (nw > 1 && c.kt.j0(nw - 1) > pw) nw--;
      nw = __shfl_sync(FULL, nw, 0); /* warp-uniform, so ptxas sees the branches below as such */
    }
    float alpha[2];
    wg::wait<0>();
    s_soft(c, i, 0, alpha); /* (O is zero: no rescale) */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) acc_to_a<T>(pa[kk], s, kk);
    for (int t = 1; t < n; t++) {
      if (t >= nw) { /* tile t skipped: only O += P_{t-1} V_{t-1} (P = 0 after nw) */
        wait_k(c.g + t);
        wait_v(c.g + t - 1);
        wg::fence_proxy();
        wg::fence();
        turn_wait();
        pv_issue(c.g + t - 1, t == 1);
        turn_pass();
        wg::wait<0>();
        wg::fence_operand<DT * 4>(&o[0][0]);
        wg::fence_operand<BN / 4>(&pa[0][0]);
        if (lead) {
          mb_arrive(VE((c.g + t - 1) % NS));
          mb_arrive(KE((c.g + t) % NS));
          if (t == n - 1) mb_arrive(QE(i & 1));
        }
        /* P = 0: the products of the tiles after nw add nothing */
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
        continue;
      }
      wait_k(c.g + t);
      wait_v(c.g + t - 1);
      wg::fence_proxy();
      turn_wait();
      s_issue(c.qa, c.g + t);
      pv_issue(c.g + t - 1, t == 1); /* the previous tile's O += P V */
      turn_pass();
      wg::wait<1>(); /* S_t */
      s_soft(c, i, t, alpha);
      wg::wait<0>(); /* O */
      wg::fence_operand<DT * 4>(&o[0][0]);
      wg::fence_operand<BN / 4>(&pa[0][0]);
      if (lead) mb_arrive(VE((c.g + t - 1) % NS));
      rescale_rows<DT>(o, alpha);
#pragma unroll
      for (int kk = 0; kk < BN / 16; kk++) acc_to_a<T>(pa[kk], s, kk);
    }
    /* the last O += P V, with the next item's first S */
    const Item nx = fetch(i + 1, c.g + n);
    const bool more = nx.item < n_items;
    wait_v(c.g + n - 1);
    if (more) wait_k(nx.g);
    wg::fence_proxy();
    wg::fence();
    turn_wait();
    pv_issue(c.g + n - 1, n == 1);
    s_issue(more ? nx.qa : c.qa, more ? nx.g : c.g + n - 1);
    turn_pass();
    wg::wait<1>();
    wg::fence_operand<DT * 4>(&o[0][0]);
    if (lead) mb_arrive(VE((c.g + n - 1) % NS));
    store_out_rows<T, DT>(P, c.bh, c.i0 + wrow, o, m, l, P.scale, lane);
    reset();
    if (!more) break;
    c = nx;
  }
  wg::wait<0>();
  if (wgi == 1) turn_wait(); /* the last warpgroup's last pass */
#endif
}

/* backward, dk and dv: NWG warpgroups, 64 keys each (BNK = 64 NWG keys a
 * CTA), walking the query tiles of BQ queries that see them (double-buffered
 * with their lse and delta): S^T = K Q^T and dP^T = V dout^T by descriptors,
 * P^T and dS^T in registers, dV += P^T dout and dK += dS^T Q with the
 * accumulators as A operands and dout, Q as MN-major B operands. dk and dv
 * are written once. DQ: also dQ = dS K for each query tile (BQ 64, tiles
 * aligned to 64 rows): dS^T goes to shared memory, the product reads it as an
 * MN-major A operand, and the tile is added to P.dqa with f32 vector atomics
 * (red.global.add.v4.f32, in the accumulator's fragment order so that each
 * warp's adds are 512 contiguous bytes); k_attn_bwd_dq_store converts. At
 * D 128 the dQ tile is computed and added in two halves of 64 columns (32
 * registers a thread for it beside dK and dV): with one warpgroup, one half
 * after the other over its 64 keys; with two (128 keys), warpgroup w the
 * half w over all 128 keys, both dS^T in shared memory, so that the atomics
 * are half those of 64-key tiles.
 * Block b holds a key tile of one of the NKV = B * Hkv KV heads (head_tile's
 * order) and walks the query tiles of its G query heads in turn (one
 * double-buffered sequence of G * n_qt tiles), dk and dv summed in registers.
 * D 64 or 128 (tiles in 64-column halves). LATE: the next query tile's
 * copies are issued after this tile's S^T and dP^T products (their address
 * arithmetic beside the tensor cores' work, one block barrier a tile), else
 * before the barrier that waits for this tile (two a tile). Measured on the
 * H200 (BENCHMARKS.md, 2026-11-30 (g)): LATE 4-6% faster with two
 * warpgroups at D 128; 1-3% slower with one (D 64, D 128 up to 512 keys). */
template <typename T, int NWG, int BQ, int MINB, bool DQ, bool GQA, int D = 64, bool LATE = false>
__global__ void __launch_bounds__(NWG * 128, MINB)
    k_attn_bwd_dkdv_wg(AttnP P, const float *__restrict__ delta, int NKV) {
  static_assert(!DQ || BQ == 64, "the fused dQ needs query tiles of 64");
#if GP_WG
  constexpr int NTH = NWG * 128, BNK = 64 * NWG, NQ = BQ / 8, DT = D / 8;
  extern __shared__ uint4 attn_smem[];
  T *Ks = (T *)align1k(attn_smem);
  T *Vs = Ks + BNK * D;
  T *Qs = Vs + BNK * D;                            /* 2 stages */
  T *Gs = Qs + 2 * BQ * D;                         /* 2 stages */
  T *Ds = Gs + 2 * BQ * D;                         /* DQ: dS^T of each warpgroup, [64 keys][64 queries] */
  float *Ls = (float *)(Ds + (DQ ? BNK * BQ : 0)); /* 2 stages of BQ */
  float *Dl = Ls + 2 * BQ;                         /* 2 stages of BQ */
  const int wgi = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  int bkv, kt; /* this block's KV head and key tile (the first first: the most query tiles when causal) */
  head_tile(blockIdx.x, NKV, gridDim.x / NKV, (int64_t)P.G * P.T * D * (2 * sizeof(T) + (DQ ? 4 : 0)), P.l2, bkv, kt);
  const int j0 = kt * BNK, off = P.S - P.T;
  const int Hkv = GQA ? P.Hkv : P.H;
  const T *k = (const T *)P.k + head_at(P.sk, bkv, Hkv), *v = (const T *)P.v + head_at(P.sv, bkv, Hkv);

  const int jmax = min(j0 + BNK, P.S) - 1;
  int ilo = P.causal ? max(0, j0 - off) : 0;
  if (DQ) ilo &= ~63; /* the accumulator's tiles (the rows added above ilo see nothing: P = 0) */
  int ihi = P.T;
  if (P.win > 0 && j0 >= P.ng) ihi = (int)min((int64_t)P.T, (int64_t)jmax + P.win - off);
  const int n_qt = ihi > ilo ? (ihi - ilo + BQ - 1) / BQ : 0;
  const QTiles<GQA> qt(P, bkv, ilo, n_qt, BQ);
  /* G = 1 keeps the one head's pointers and the compile-time tile rows: with
   * the per-tile head of the group walk, the fused kernel (3 CTAs an SM, 168
   * registers) got two more compiler-injected warpgroup waits and its
   * backward fell from 298 to 237 TFLOP/s on the H100 */
  const T *q1 = (const T *)P.q + head_at(P.sq, bkv, P.H), *g1 = (const T *)P.dout + head_at(P.sg, bkv, P.H);
  const float *lse1 = P.lse_in + (int64_t)bkv * P.T, *dlt1 = delta + (int64_t)bkv * P.T;
  auto row0 = [&](int t) { return GQA ? qt.row0(t) : ilo + t * BQ; };
  auto load_q = [&](int stage, int t) {
    if constexpr (GQA) {
      load_q_tile<T, D, BQ, NTH, GQA, true>(P, delta, qt, t, Qs + stage * BQ * D, Gs + stage * BQ * D, Ls + stage * BQ,
                                 Dl + stage * BQ);
    } else {
      const int i0 = ilo + t * BQ;
      load_tile<T, D, BQ, NTH, true>(Qs + stage * BQ * D, q1, P.sq.r, i0, P.T);
      load_tile<T, D, BQ, NTH, true>(Gs + stage * BQ * D, g1, P.sg.r, i0, P.T);
      for (int e = threadIdx.x; e < BQ; e += NTH) {
        const int i = i0 + e;
        const bool ok = i < P.T;
        cp_async4(smem_u32(Ls + stage * BQ + e), lse1 + (ok ? i : 0), ok ? 4 : 0);
        cp_async4(smem_u32(Dl + stage * BQ + e), dlt1 + (ok ? i : 0), ok ? 4 : 0);
      }
    }
  };
  load_tile<T, D, BNK, NTH, true>(Ks, k, P.sk.r, j0, P.S);
  load_tile<T, D, BNK, NTH, true>(Vs, v, P.sv.r, j0, P.S);
  if (qt.n > 0) load_q(0, 0);
  cp_async_commit();

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; dt++)
#pragma unroll
    for (int e = 0; e < 4; e++) dk[dt][e] = dv[dt][e] = 0.f;
  const float sl2 = P.scale * LOG2E;
  /* the mask a query tile needs (tile_mask; 1 with rows past T) */
  auto q_mask = [&](int i0) {
    const int mk = tile_mask(P, i0 + off, min(i0 + BQ, P.T) - 1 + off, j0, BNK);
    return mk == 2 && i0 + BQ > P.T ? 1 : mk;
  };
  const int wrow = wgi * 64 + warp * 16, g8 = lane >> 2, t2 = (lane & 3) << 1;
  /* the warpgroup's rows in each column half (tiles in halves of 64 columns) */
  const uint32_t ka = smem_u32(Ks + wgi * 64 * 64), va = smem_u32(Vs + wgi * 64 * 64);

  auto tile = [&](auto mk_tag, int t) {
    constexpr int MK = decltype(mk_tag)::value;
    const int st = t & 1, i0 = row0(t);
    /* tile t in place (LATE: the only copies in flight); LATE: the barrier
     * also orders every product of tile t - 1 (done: each warpgroup waited
     * for its own) before the copies into their stage and the writes to Ds
     * below (else the barrier at the end of the tile does) */
    if (!LATE) {
      if (t + 1 < qt.n) load_q(st ^ 1, t + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    wg::fence_proxy();
    __syncthreads();
    const uint32_t qa = smem_u32(Qs + st * BQ * D), ga = smem_u32(Gs + st * BQ * D);
    const float *Lst = Ls + st * BQ, *Dst = Dl + st * BQ;

    /* four groups in flight in turn: S^T, dP^T; P^T (while dP^T runs), dV
     * += P^T dout; dS^T (while dV runs), dK += dS^T Q */
    float s[NQ][4], dp[NQ][4];
    wg_s_dp<BQ, T, D>(s, dp, ka, qa, va, ga, BNK * 128, BQ * 128);
    if (LATE) {
      if (t + 1 < qt.n) load_q(st ^ 1, t + 1);
      cp_async_commit();
    }
    wg::wait<1>();

#pragma unroll
    for (int nt = 0; nt < NQ; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int ic = nt * 8 + t2 + (e & 1);
        const float2 L2 = *(const float2 *)(Lst + nt * 8 + t2);
        float pv = ex2(fmaf(s[nt][e], sl2, -((e & 1) ? L2.y : L2.x) * LOG2E));
        if constexpr (MK == 1) {
          const int i = i0 + ic, j = j0 + wrow + g8 + ((e >> 1) << 3);
          if (i >= P.T || j >= P.S || !vis(i + off, j, P.win, P.ng, P.causal)) pv = 0.f;
        }
        s[nt][e] = pv;
      }
    if constexpr (MK == 2) causal_hide<NQ, false>(s, j0 + wrow + g8 - (i0 + t2 + off), 0.f);
    uint32_t pa[BQ / 16][4], da[BQ / 16][4];
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++) acc_to_a<T>(pa[kk], s, kk);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++)
      wg::mma<D, T>::template rs<1>(&dv[0][0], pa[kk], wg_mn_halves(ga + kk * 2048, BQ * 128), 1);
    wg::commit();
    wg::wait<1>();

#pragma unroll
    for (int nt = 0; nt < NQ; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const float2 D2 = *(const float2 *)(Dst + nt * 8 + t2);
        dp[nt][e] = s[nt][e] * (dp[nt][e] - ((e & 1) ? D2.y : D2.x));
      }
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++) acc_to_a<T>(da[kk], dp, kk);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++)
      wg::mma<D, T>::template rs<1>(&dk[0][0], da[kk], wg_mn_halves(qa + kk * 2048, BQ * 128), 1);
    wg::commit();
    if constexpr (DQ) {
      /* dS^T (rows: keys, columns: queries) to shared memory; dQ = dS K
       * reads it as the MN-major A operand, K as the MN-major B */
      T *Dw = Ds + wgi * 64 * BQ;
#pragma unroll
      for (int nt = 0; nt < NQ; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const int r = warp * 16 + g8 + 8 * h;
          *(uint32_t *)(Dw + swz<BQ>(r, nt) + t2) = da[nt >> 1][(nt & 1) * 2 + h];
        }
      wg::fence_proxy();
      float *dst = P.dqa + ((int64_t)(GQA ? qt.head(t) : bkv) * ((P.T + 63) >> 6) + (i0 >> 6)) * (64 * D) +
                   (threadIdx.x & 127) * 4;
      /* dQ's columns 64 hf .. 64 hf + 63 from the NK keys of the dS^T at a (MN-major A) and K at b */
      constexpr bool SPLIT = D == 128 && NWG == 2;
      constexpr int NK = SPLIT ? 128 : 64;
      auto dq_half = [&](uint32_t a, uint32_t b, int hf) {
        float dq[8][4];
        wg::fence();
        /* D 64: the first k-slice writes dq (as wg_s_dp's first products) */
        constexpr int K0 = D == 64 ? 1 : 0;
        if constexpr (K0) wg::mma<64, T>::template ss0<1, 1>(&dq[0][0], wg_mnmajor(a), wg_mnmajor(b));
#pragma unroll
        for (int kk = K0; kk < NK / 16; kk++)
          wg::mma<64, T>::template ss<1, 1>(&dq[0][0], wg_mnmajor(a + kk * 2048), wg_mnmajor(b + kk * 2048), kk > 0);
        wg::commit();
        wg::wait<0>();
#pragma unroll
        for (int j = 0; j < 8; j++)
          asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst + (hf * 8 + j) * 512), "f"(dq[j][0]),
                       "f"(dq[j][1]), "f"(dq[j][2]), "f"(dq[j][3])
                       : "memory");
      };
      if constexpr (SPLIT) { /* warpgroup w: K's half w over all 128 keys (both dS^T, side by side in Ds) */
        __syncthreads();     /* both warpgroups' dS^T written */
        dq_half(smem_u32(Ds), smem_u32(Ks) + wgi * BNK * 128, wgi);
      } else {
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wgi) : "memory"); /* the warpgroup's dS^T is written */
#pragma unroll
        for (int hf = 0; hf < D / 64; hf++) dq_half(smem_u32(Dw), ka + hf * BNK * 128, hf); /* BNK rows a half */
      }
    } else {
      wg::wait<0>();
    }
    if (!LATE) __syncthreads(); /* the next tile loads into this stage (DQ: and writes Ds) */
  };
  for (int t = 0; t < qt.n; t++) {
    with_mask(q_mask(row0(t)), [&](auto mk) { tile(mk, t); });
  }
  cp_async_wait<0>();

  store_acc_rows<T, DT>((T *)P.dk + head_at(P.sdk, bkv, Hkv), P.sdk.r, j0 + wrow, P.S, dk, P.scale,
                        lane); /* q was not scaled */
  store_acc_rows<T, DT>((T *)P.dv + head_at(P.sdv, bkv, Hkv), P.sdv.r, j0 + wrow, P.S, dv, 1.f, lane);
#endif
}

/* the fused backward's dQ: one CTA a tile of 64 rows of P.dqa (64 D floats;
 * fragment order: float4 j of thread tid is at (j 128 + tid) 4, holding the
 * accumulator entries d[4j .. 4j + 3] of that thread) to dq, times scale. The
 * tile is staged in shared memory as rows, so that dq is written 16 bytes a
 * thread along rows (the fragment's own order writes 4-byte pieces, 16 bytes
 * of a row a warp instruction); rows are RS elements apart, 16 bytes more
 * than a row, so that a warp's 4-byte writes fall in 32 banks */
template <typename T, int D> __global__ void __launch_bounds__(128) k_attn_bwd_dq_store(AttnP P, int n_mt) {
  constexpr int RS = D + 8, CPR = D / 8; /* a staged row's elements; 16-byte chunks a row */
  __shared__ __align__(16) T st[64 * RS];
  const int bh = blockIdx.x / n_mt, mt = blockIdx.x % n_mt, lane = threadIdx.x & 31;
  const int r0 = (threadIdx.x >> 5) * 16 + (lane >> 2);
  const float4 *src = (const float4 *)(P.dqa + (int64_t)blockIdx.x * (64 * D));
  float4 f[D / 8];
#pragma unroll
  for (int j = 0; j < D / 8; j++) f[j] = src[j * 128 + threadIdx.x];
#pragma unroll
  for (int j = 0; j < D / 8; j++) {
    const int c = j * 8 + ((lane & 3) << 1);
    *(uint32_t *)&st[r0 * RS + c] = pack2<T>(f[j].x * P.scale, f[j].y * P.scale);
    *(uint32_t *)&st[(r0 + 8) * RS + c] = pack2<T>(f[j].z * P.scale, f[j].w * P.scale);
  }
  __syncthreads();
  T *dst = (T *)P.dq + head_at(P.sdq, bh, P.H);
#pragma unroll
  for (int k = 0; k < 64 * CPR / 128; k++) {
    const int i = k * 128 + threadIdx.x, r = i / CPR, c = (i % CPR) * 8, row = mt * 64 + r;
    if (row < P.T) *(uint4 *)(dst + (int64_t)row * P.sdq.r + c) = *(const uint4 *)&st[r * RS + c];
  }
}

/* backward, dq: NWG warpgroups, 64 queries each (BM = 64 NWG, the longest
 * causal rows first), walking the forward's key tiles of BN keys: S = Q K^T
 * and dP = dout V^T by descriptors, dS in registers, dQ += dS K with K as an
 * MN-major B operand */
template <typename T, int NWG, int BN, int MINB, int D = 64>
__global__ void __launch_bounds__(NWG * 128, MINB) k_attn_bwd_dq_wg(AttnP P, const float *__restrict__ delta, int BH) {
#if GP_WG
  constexpr int NTH = NWG * 128, BM = 64 * NWG, NT = BN / 8, DT = D / 8;
  extern __shared__ uint4 attn_smem[];
  T *Qs = (T *)align1k(attn_smem);
  T *Gs = Qs + BM * D;
  T *Ks = Gs + BM * D;     /* 2 stages */
  T *Vs = Ks + 2 * BN * D; /* 2 stages */
  const int wgi = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int n_mt = gridDim.x / BH;
  int bh, mt; /* this block's head and query tile (the last first) */
  head_tile(blockIdx.x, BH, n_mt, (int64_t)P.S * D * 2 * sizeof(T), P.l2, bh, mt);
  const int i0 = (n_mt - 1 - mt) * BM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H), *g = (const T *)P.dout + head_at(P.sg, bh, P.H);
  const T *k = (const T *)P.k + kv_at(P.sk, bh, P), *v = (const T *)P.v + kv_at(P.sv, bh, P);

  const int pmin = i0 + off, pmax = min(i0 + BM, P.T) - 1 + off;
  const KvTiles kt = kv_tiles(P, pmin, pmax, BN);
  const int n_tiles = kt.n;

  load_tile<T, D, BM, NTH, true>(Qs, q, P.sq.r, i0, P.T);
  load_tile<T, D, BM, NTH, true>(Gs, g, P.sg.r, i0, P.T);
  if (n_tiles > 0) {
    load_tile<T, D, BN, NTH, true>(Ks, k, P.sk.r, kt.j0(0), P.S);
    load_tile<T, D, BN, NTH, true>(Vs, v, P.sv.r, kt.j0(0), P.S);
  }
  cp_async_commit();

  const int wrow = wgi * 64 + warp * 16, g8 = lane >> 2, t2 = (lane & 3) << 1;
  float L2[2], Dd[2];
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int row = i0 + wrow + g8 + h * 8;
    const bool ok = row < P.T;
    L2[h] = ok ? P.lse_in[(int64_t)bh * P.T + row] * LOG2E : 0.f;
    Dd[h] = ok ? delta[(int64_t)bh * P.T + row] : 0.f;
  }
  float acc[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; dt++) acc[dt][0] = acc[dt][1] = acc[dt][2] = acc[dt][3] = 0.f;
  const float sl2 = P.scale * LOG2E;
  const uint32_t qa = smem_u32(Qs + wgi * 64 * 64), ga = smem_u32(Gs + wgi * 64 * 64); /* in each column half */

  auto tile = [&](auto mk_tag, int t) {
    constexpr int MK = decltype(mk_tag)::value;
    const int st = t & 1;
    const int j0 = kt.j0(t);
    if (t + 1 < kt.n) {
      const int o2 = (st ^ 1) * BN * D;
      load_tile<T, D, BN, NTH, true>(Ks + o2, k, P.sk.r, kt.j0(t + 1), P.S);
      load_tile<T, D, BN, NTH, true>(Vs + o2, v, P.sv.r, kt.j0(t + 1), P.S);
    }
    cp_async_commit();
    cp_async_wait<1>();
    wg::fence_proxy();
    __syncthreads();
    const uint32_t ka = smem_u32(Ks + st * BN * D), va = smem_u32(Vs + st * BN * D);

    /* S, then dP: P is computed while dP runs */
    float s[NT][4], dp[NT][4];
    wg_s_dp<BN, T, D>(s, dp, qa, ka, ga, va, BM * 128, BN * 128);
    wg::wait<1>();

#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        float pv = ex2(fmaf(s[nt][e], sl2, -L2[e >> 1]));
        if constexpr (MK == 1) {
          const int p = i0 + wrow + g8 + (e >> 1) * 8 + off, j = j0 + nt * 8 + t2 + (e & 1);
          if (j >= P.S || !vis(p, j, P.win, P.ng, P.causal)) pv = 0.f;
        }
        s[nt][e] = pv;
      }
    if constexpr (MK == 2) causal_hide<NT, true>(s, j0 + t2 - (i0 + wrow + g8 + off), 0.f);
    wg::wait<0>();
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[nt][e] *= dp[nt][e] - Dd[e >> 1];

    uint32_t da[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) acc_to_a<T>(da[kk], s, kk);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++)
      wg::mma<D, T>::template rs<1>(&acc[0][0], da[kk], wg_mn_halves(ka + kk * 2048, BN * 128), 1);
    wg::commit();
    wg::wait<0>();
    __syncthreads(); /* the next iteration loads into this stage */
  };
  for (int t = 0; t < n_tiles; t++) {
    with_mask(tile_mask(P, pmin, pmax, kt.j0(t), BN), [&](auto mk) { tile(mk, t); });
  }
  cp_async_wait<0>();

  store_acc_rows<T, DT>((T *)P.dq + head_at(P.sdq, bh, P.H), P.sdq.r, i0 + wrow, P.T, acc, P.scale, lane);
#endif
}

template <typename T, int D, int NWG, int BN, int MINB, int NS, bool PIPE>
int launch_fwd_wg(const AttnP &P, int64_t BH) {
  constexpr int BM = 64 * NWG;
  static bool attr = false; /* per instantiation */
  return launch_fwd_tiles(k_attn_fwd_wg<T, D, NWG, BN, MINB, NS, PIPE>, P, BH, BM, NWG * 128,
                          (BM + 2 * NS * BN) * D * (int)sizeof(T) + 1024, attr);
}

/* the warp-specialized forward's work counters: {next item, blocks done}
 * pairs, zero between launches (the last block resets its pair); a launch
 * takes the next pair in turn, so that launches running at once on different
 * streams (fewer than 64 of them) count apart */
__device__ int g_ws_sched[64][2];
inline int *sched_slot() {
  static int *base = nullptr;
  static unsigned n = 0;
  if (!base && cudaGetSymbolAddress((void **)&base, g_ws_sched) != cudaSuccess) return nullptr;
  return base + 2 * (n++ % 64);
}

/* the driver's cuTensorMapEncodeTiled (through the runtime: no -lcuda), or
 * null: GP_ATTN_TMA=0 (read once per process) or a driver without it */
static PFN_cuTensorMapEncodeTiled_v12000 tma_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static bool tried = false;
  if (!tried) {
    tried = true;
    const char *e = getenv("GP_ATTN_TMA");
    if (e && !strcmp(e, "0")) return nullptr;
    void *f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (PFN_cuTensorMapEncodeTiled_v12000)f;
    else cudaGetLastError();
  }
  return fn;
}

/* m: a (B, heads, rows, D) tensor at base with element strides s as a 4-d
 * map of boxes of 64 columns and box_rows rows (TmaMaps); false when the
 * strides do not fit a map (every row stays 16-byte aligned: rows16) */
template <typename T, int D>
static bool tma_map(CUtensorMap *m, int *hin, const void *base, const Str &s, int rows, int heads, int64_t B,
                    int box_rows) {
  const auto enc = tma_encoder();
  if (!enc) return false;
  const int64_t es = sizeof(T);
  *hin = heads > 1 && rows > 1 && s.h < s.r;
  const int64_t d1 = *hin ? heads : rows, d2 = *hin ? rows : heads;
  int64_t s1 = (*hin ? s.h : s.r) * es, s2 = (*hin ? s.r : s.h) * es, s3 = s.b * es;
  /* a dim of one: its stride is never used, but must pass the encoder's checks */
  if (d1 == 1) s1 = D * es;
  if (d2 == 1) s2 = s1 * d1;
  if (B == 1) s3 = s2 * d2;
  const int64_t lim = (int64_t)1 << 40;
  if (s1 % 16 || s2 % 16 || s3 % 16 || s1 <= 0 || s2 <= 0 || s3 <= 0 || s1 >= lim || s2 >= lim || s3 >= lim)
    return false;
  const cuuint64_t dim[4] = {(cuuint64_t)D, (cuuint64_t)d1, (cuuint64_t)d2, (cuuint64_t)B};
  const cuuint64_t str[3] = {(cuuint64_t)s1, (cuuint64_t)s2, (cuuint64_t)s3};
  const cuuint32_t box[4] = {64, *hin ? 1u : (cuuint32_t)box_rows, *hin ? (cuuint32_t)box_rows : 1u, 1};
  const cuuint32_t one[4] = {1, 1, 1, 1};
  return enc(m, std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4,
             const_cast<void *>(base), dim, str, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* the warp-specialized forward: one block an SM (or fewer, one an item) */
template <typename T, int D, int BN, int NS, int NC> int launch_fwd_ws(const AttnP &P, int64_t BH) {
  constexpr int BM = 64 * NC;
  static bool attr = false; /* per instantiation */
  auto kern = k_attn_fwd_ws<T, D, BN, NS, NC>;
  const int smem = (2 * BM + 2 * NS * BN) * D * (int)sizeof(T) + 1024 + 8 * (4 + 4 * NS) + 8;
  GP_TRY(smem_attr(kern, smem, attr, "attn_fwd"));
  int *sched = sched_slot();
  if (!sched) return gp_error("attn_fwd: cannot find the scheduler's counters (%s)", cudaGetErrorString(cudaGetLastError()));
  const int64_t items = BH * ((P.T + BM - 1) / BM);
  if (items > INT32_MAX / 2)
    return gp_error("attn_fwd: too many tiles for one launch (B * H = %lld, T = %d)", (long long)BH, P.T);
  const int grid = (int)std::min<int64_t>(items, std::max(1, gp_cuda_sm_count()));
  TmaMaps M;
  memset(&M, 0, sizeof M);
  const int64_t B = BH / P.H;
  int hv = 0;
  M.on = D == 128 && tma_map<T, D>(&M.q, &M.hin_q, P.q, P.sq, P.T, P.H, B, BM) &&
         tma_map<T, D>(&M.k, &M.hin_kv, P.k, P.sk, P.S, P.Hkv, B, BN) &&
         tma_map<T, D>(&M.v, &hv, P.v, P.sv, P.S, P.Hkv, B, BN) && hv == M.hin_kv;
  GP_NOTE_LAUNCH(kern, 128 * (NC + 1), smem);
  kern<<<grid, 128 * (NC + 1), smem, gp_cuda_stream()>>>(P, (int)BH, (int)items, sched, M);
  return GP_OK;
}

/* the wgmma backward in two kernels (D 64 or 128): dk/dv by NWG1 warpgroups
 * of 64 keys (query tiles of BQ), dq by NWG2 warpgroups of 64 queries (key
 * tiles of BN); GQA: G > 1 */
template <typename T, int D, int NWG1, int BQ, int MINB1, int NWG2, int BN, int MINB2, bool GQA>
int launch_bwd_wg(const AttnP &P, int64_t BH) {
  constexpr int BNK = 64 * NWG1, BM = 64 * NWG2;
  static bool a1 = false, a2 = false; /* per instantiation */
  return launch_bwd_kernels<T, D, false>(
      P, BH, k_attn_bwd_dkdv_wg<T, NWG1, BQ, MINB1, false, GQA, D>, NWG1 * 128,
      (2 * BNK + 4 * BQ) * D * (int)sizeof(T) + 4 * BQ * (int)sizeof(float) + 1024, (P.S + BNK - 1) / BNK, a1,
      k_attn_bwd_dq_wg<T, NWG2, BN, MINB2, D>, NWG2 * 128, (2 * BM + 4 * BN) * D * (int)sizeof(T) + 1024,
      (P.T + BM - 1) / BM, a2);
}

/* the fused wgmma backward: dk/dv and the dQ atomics by NWG warpgroups of
 * 64 keys, query tiles of 64 (shared memory: K, V, 2 stages of Q and dout,
 * dS^T, 2 stages of lse and delta) */
template <typename T, int D, int NWG, int MINB, bool GQA> int launch_bwd_wg_fused(const AttnP &P, int64_t BH) {
  constexpr int BNK = 64 * NWG;
  static bool a1 = false, unused = false; /* per instantiation */
  return launch_bwd_kernels<T, D, true>(
      P, BH, k_attn_bwd_dkdv_wg<T, NWG, 64, MINB, true, GQA, D, D == 128 && NWG == 2>, NWG * 128,
      ((2 * BNK + 4 * 64) * D + BNK * 64) * (int)sizeof(T) + 4 * 64 * (int)sizeof(float) + 1024, (P.S + BNK - 1) / BNK,
      a1, k_attn_bwd_dq_store<T, D>, 0, 0, 0, unused);
}

template <bool GQA> int bwd_wg_g(const AttnP &P, int64_t BH, int dtype, int D, bool deterministic) {
  /* deterministic: the two kernels; else dQ by atomics in the dk/dv kernel:
   * D 64 one warpgroup of 64 keys, 3 CTAs an SM; D 128 two warpgroups of 128
   * keys, each adding half of dQ's columns over all 128 keys (half the
   * atomics of 64-key tiles), 1 CTA an SM, or up to 512 keys one warpgroup
   * of 64 keys, 2 CTAs an SM. GP_ATTN_FUSED_BWD=0 / 1 / 2 picks the two
   * kernels / one / two warpgroups at D 128. Measured on the H200
   * (BENCHMARKS.md, 2026-11-30 (c)), backward ms, two kernels / one / two:
   * B4 H8 T2048 causal 0.330 / 0.318 / 0.300, B1 H16 T16384 8.37 / 7.73 /
   * 6.35, B4 H16 T4096 2.18 / 2.05 / 1.80, B32 H16 T512 0.542 / 0.513 / 0.552 */
  static const int fused128 = getenv("GP_ATTN_FUSED_BWD") ? atoi(getenv("GP_ATTN_FUSED_BWD")) : -1;
  if (D == 128) {
    if (deterministic || fused128 == 0)
      return dtype == GP_BF16 ? launch_bwd_wg<__nv_bfloat16, 128, 1, 64, 2, 1, 64, 2, GQA>(P, BH)
                              : launch_bwd_wg<__half, 128, 1, 64, 2, 1, 64, 2, GQA>(P, BH);
    if (fused128 == 1 || (fused128 != 2 && P.S <= 512))
      return dtype == GP_BF16 ? launch_bwd_wg_fused<__nv_bfloat16, 128, 1, 2, GQA>(P, BH)
                              : launch_bwd_wg_fused<__half, 128, 1, 2, GQA>(P, BH);
    return dtype == GP_BF16 ? launch_bwd_wg_fused<__nv_bfloat16, 128, 2, 1, GQA>(P, BH)
                            : launch_bwd_wg_fused<__half, 128, 2, 1, GQA>(P, BH);
  }
  if (dtype == GP_BF16)
    return deterministic ? launch_bwd_wg<__nv_bfloat16, 64, 1, 64, 2, 1, 64, 2, GQA>(P, BH)
                         : launch_bwd_wg_fused<__nv_bfloat16, 64, 1, 3, GQA>(P, BH);
  return deterministic ? launch_bwd_wg<__half, 64, 1, 64, 2, 1, 64, 2, GQA>(P, BH)
                       : launch_bwd_wg_fused<__half, 64, 1, 3, GQA>(P, BH);
}

} // namespace

int fwd_wg(const AttnP &P, int64_t BH, int dtype, int D) {
  /* The warp-specialized kernel (GP_ATTN_WS=0: the kernel below): D 128
   * with 2 consumer warpgroups, key tiles of 128 in 2 stages; D 64 with 3,
   * key tiles of 128 in 3 stages. Measured on the H200 against the kernel
   * below (BENCHMARKS.md, 2026-11-29 (i) and 2026-11-30 (f), forward): D 128
   * +12-19% at every shape; D 64 non-causal +14-29%; D 64 causal, with the
   * diagonal tiles' one-compare mask, +8% at T 512, +13-15% at T 1024, +29%
   * at T 2048, level at T 4096 (before that mask, 17-25% slower at T 512
   * and 1024, where the kernel below was kept). */
  static const int ws = getenv("GP_ATTN_WS") ? atoi(getenv("GP_ATTN_WS")) : 1;
  if (ws != 0) {
    if (dtype == GP_BF16)
      return D == 64 ? launch_fwd_ws<__nv_bfloat16, 64, 128, 3, 3>(P, BH) : launch_fwd_ws<__nv_bfloat16, 128, 128, 2, 2>(P, BH);
    return D == 64 ? launch_fwd_ws<__half, 64, 128, 3, 3>(P, BH) : launch_fwd_ws<__half, 128, 128, 2, 2>(P, BH);
  }
  /* The block-synchronous kernel: D 64: 2 warpgroups of 64 rows, key tiles
   * of 64 in 3 stages, 2 CTAs an SM, one product at a time (the two CTAs
   * overlap each other's softmax); D 128 (GP_ATTN_WS=0): key tiles of 128,
   * tiles as two 64-column halves, 1 CTA an SM, the products pipelined with
   * the softmax. Measured on the H100 (BENCHMARKS.md, 2026-11-25):
   * pipelined, D 64 lost 3-5% of its forward; D 128 pipelined with tiles of
   * 128 gained 6-17% over one product at a time with tiles of 64; D 64 with
   * 3 warpgroups and key tiles of 128 was slower (81-356 against 138-360
   * TFLOP/s), as were 2 warpgroups with tiles of 128 at one CTA an SM (94-305
   * against 140-338); 4 stages with the loads issued a tile earlier,
   * pipelined, level with 3 */
  if (dtype == GP_BF16)
    return D == 64 ? launch_fwd_wg<__nv_bfloat16, 64, 2, 64, 2, 3, false>(P, BH)
                   : launch_fwd_wg<__nv_bfloat16, 128, 2, 128, 1, 3, true>(P, BH);
  return D == 64 ? launch_fwd_wg<__half, 64, 2, 64, 2, 3, false>(P, BH)
                 : launch_fwd_wg<__half, 128, 2, 128, 1, 3, true>(P, BH);
}

/* G = 1 runs the dk/dv kernel without the loop over a group's query heads */
int bwd_wg(const AttnP &P, int64_t BH, int dtype, int D, bool deterministic) {
  return P.G > 1 ? bwd_wg_g<true>(P, BH, dtype, D, deterministic) : bwd_wg_g<false>(P, BH, dtype, D, deterministic);
}

} // namespace gp_attn
