/* attention.cu: flash attention on the GPU.
 *
 * attn_fwd, bf16/f16 with 16-byte aligned operands: FlashAttention-2 style.
 * A CTA of NW warps owns BM = 16 * MT * NW query rows (16 * MT per warp; 4
 * warps of 32 rows at D 64, GP_ATTN_IMPL=new8: 8 warps of 16) and walks
 * the visible key tiles of BN = 64 keys: K/V tiles are double-buffered in
 * shared memory with cp.async (128-byte rows XOR-swizzled by 16-byte chunk,
 * so ldmatrix is conflict-free), S = Q K^T and O += P V run on tensor cores
 * (mma.sync m16n8k16, f32 accumulators), the softmax is online in registers
 * (base 2, one quad shuffle per row max), P never leaves registers (the S
 * accumulator fragment is the A fragment of P V). Causal tiles above the
 * diagonal and window tiles left of the window are never visited; only the
 * tiles that touch a boundary are masked element by element.
 *
 * On an H100/H200 (compute capability 9.0, a build with sm_90a code) the
 * bf16/f16 forward and backward at D 64 run the same algorithms on wgmma
 * instead (attention_wg.cuh): a warpgroup owns 64 rows and the tensor cores
 * read Q, K, V, dout straight from the swizzled shared-memory tiles.
 *
 * f32 (and unaligned views): a plain tiled kernel (K/V tiles in shared memory,
 * one key per lane, FMA in f32). attn_bwd: the same plain tiling in two
 * kernels, dq by query blocks and dk/dv by key blocks (no atomics).
 * attn_decode: split-K (flash-decoding): blocks over slices of the cache per
 * (b, h), each a partial (max, sum, acc), then a combine kernel. */
#include <mma.h>

#include <cstdlib>
#include <cstring>

#include "../src/cuda_internal.h"
#include "wgmma.cuh"

#define FULL 0xffffffffu

namespace {

/* element strides of a (B, H, R, D) operand on B, H and R (stride 1 on D) */
struct Str {
  int64_t b, h, r;
};

struct AttnP {
  const void *q, *k, *v, *o, *dout;
  void *out, *dq, *dk, *dv;
  float *lse; /* contiguous (B, H, T) */
  const float *lse_in;
  float *dqa; /* the fused wgmma backward's f32 dQ accumulator (tiles of 64 rows, fragment order) */
  /* so: out (forward) or o (backward) */
  Str sq, sk, sv, so, sg, sdq, sdk, sdv;
  int H, T, S;
  float scale;
  int win, ng, causal;
};

/* element offset of head bh = b * H + h */
__device__ __forceinline__ int64_t head_at(const Str &s, int bh, int H) {
  return (int64_t)(bh / H) * s.b + (int64_t)(bh % H) * s.h;
}

__device__ __forceinline__ bool vis(int p, int j, int win, int ng, int causal) {
  if (causal && j > p) return false;
  if (win > 0 && p - j >= win && j >= ng) return false;
  return true;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
  return v;
}

/* ------------------------------------------------------------------------ */
/* plain kernels (any float dtype, any alignment)                           */

/* forward: a block of 4 warps owns 4 * RW query rows (RW per warp); K/V tiles
 * of 32 keys in shared memory; lane = key for the scores, lane = dims for the
 * output accumulators */
template <typename T, int D, int RW>
__global__ void __launch_bounds__(128) k_attn_fwd_plain(AttnP P) {
  constexpr int GM = 4 * RW, GN = 32, DT = D / 32;
  __shared__ float Qs[GM][D];
  __shared__ float Ks[GN][D + 1];
  __shared__ float Vs[GN][D];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bh = blockIdx.y, i0 = blockIdx.x * GM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H);
  const T *k = (const T *)P.k + head_at(P.sk, bh, P.H);
  const T *v = (const T *)P.v + head_at(P.sv, bh, P.H);
  for (int e = threadIdx.x; e < GM * D; e += 128) {
    int r = e / D, d = e % D;
    Qs[r][d] = i0 + r < P.T ? ld(q[(int64_t)(i0 + r) * P.sq.r + d]) * P.scale : 0.f;
  }
  float m[RW], l[RW], acc[RW][DT];
#pragma unroll
  for (int r = 0; r < RW; r++) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int t = 0; t < DT; t++) acc[r][t] = 0.f;
  }
  const int pmin = i0 + off, pmax = min(i0 + GM, P.T) - 1 + off;
  const int hi = P.causal ? min(P.S, pmax + 1) : P.S;
  for (int j0 = 0; j0 < hi; j0 += GN) {
    if (P.win > 0 && j0 >= P.ng && pmin - (j0 + GN - 1) >= P.win) continue; /* block-uniform */
    __syncthreads();
    for (int e = threadIdx.x; e < GN * D; e += 128) {
      int r = e / D, d = e % D, j = j0 + r;
      Ks[r][d] = j < P.S ? ld(k[(int64_t)j * P.sk.r + d]) : 0.f;
      Vs[r][d] = j < P.S ? ld(v[(int64_t)j * P.sv.r + d]) : 0.f;
    }
    __syncthreads();
    float s[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) s[r] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; d++) {
      float kd = Ks[lane][d];
#pragma unroll
      for (int r = 0; r < RW; r++) s[r] += Qs[warp * RW + r][d] * kd;
    }
    const int j = j0 + lane;
#pragma unroll
    for (int r = 0; r < RW; r++) {
      int row = i0 + warp * RW + r;
      bool ok = j < P.S && row < P.T && vis(row + off, j, P.win, P.ng, P.causal);
      float sv = ok ? s[r] : -INFINITY;
      float mn = fmaxf(m[r], warp_max(sv));
      float mu = mn == -INFINITY ? 0.f : mn;
      float alpha = expf(m[r] - mu);
      float pe = ok ? expf(sv - mu) : 0.f;
      l[r] = l[r] * alpha + warp_sum(pe);
      m[r] = mn;
#pragma unroll
      for (int t = 0; t < DT; t++) acc[r][t] *= alpha;
      s[r] = pe;
    }
    for (int jj = 0; jj < GN; jj++) {
      float pr[RW];
#pragma unroll
      for (int r = 0; r < RW; r++) pr[r] = __shfl_sync(FULL, s[r], jj);
#pragma unroll
      for (int t = 0; t < DT; t++) {
        float vv = Vs[jj][lane + 32 * t];
#pragma unroll
        for (int r = 0; r < RW; r++) acc[r][t] += pr[r] * vv;
      }
    }
  }
  T *o = (T *)P.out + head_at(P.so, bh, P.H);
#pragma unroll
  for (int r = 0; r < RW; r++) {
    int row = i0 + warp * RW + r;
    if (row >= P.T) continue;
    float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma unroll
    for (int t = 0; t < DT; t++) o[(int64_t)row * P.so.r + lane + 32 * t] = st<T>(acc[r][t] * inv);
    if (lane == 0) P.lse[(int64_t)bh * P.T + row] = l[r] > 0.f ? m[r] + logf(l[r]) : -INFINITY;
  }
}

/* backward, dq: query blocks as in the forward; per key tile, lane = key:
 * P = exp(s - lse), dP = dout . v, dS = P (dP - Di); dq += dS k */
template <typename T, int D, int RW>
__global__ void __launch_bounds__(128) k_attn_bwd_dq(AttnP P) {
  constexpr int GM = 4 * RW, GN = 32, DT = D / 32;
  __shared__ float Qs[GM][D];
  __shared__ float Gs[GM][D];
  __shared__ float Ks[GN][D + 1];
  __shared__ float Vs[GN][D + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bh = blockIdx.y, i0 = blockIdx.x * GM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H), *g = (const T *)P.dout + head_at(P.sg, bh, P.H);
  const T *o = (const T *)P.o + head_at(P.so, bh, P.H);
  const T *k = (const T *)P.k + head_at(P.sk, bh, P.H), *v = (const T *)P.v + head_at(P.sv, bh, P.H);
  for (int e = threadIdx.x; e < GM * D; e += 128) {
    int r = e / D, d = e % D;
    bool in = i0 + r < P.T;
    Qs[r][d] = in ? ld(q[(int64_t)(i0 + r) * P.sq.r + d]) * P.scale : 0.f;
    Gs[r][d] = in ? ld(g[(int64_t)(i0 + r) * P.sg.r + d]) : 0.f;
  }
  float Di[RW], L[RW], acc[RW][DT];
#pragma unroll
  for (int r = 0; r < RW; r++) {
    int row = i0 + warp * RW + r;
    float s = 0.f;
    if (row < P.T)
#pragma unroll
      for (int t = 0; t < DT; t++)
        s += ld(g[(int64_t)row * P.sg.r + lane + 32 * t]) * ld(o[(int64_t)row * P.so.r + lane + 32 * t]);
    Di[r] = warp_sum(s);
    L[r] = row < P.T ? P.lse_in[(int64_t)bh * P.T + row] : 0.f;
#pragma unroll
    for (int t = 0; t < DT; t++) acc[r][t] = 0.f;
  }
  const int pmin = i0 + off, pmax = min(i0 + GM, P.T) - 1 + off;
  const int hi = P.causal ? min(P.S, pmax + 1) : P.S;
  for (int j0 = 0; j0 < hi; j0 += GN) {
    if (P.win > 0 && j0 >= P.ng && pmin - (j0 + GN - 1) >= P.win) continue;
    __syncthreads();
    for (int e = threadIdx.x; e < GN * D; e += 128) {
      int r = e / D, d = e % D, j = j0 + r;
      Ks[r][d] = j < P.S ? ld(k[(int64_t)j * P.sk.r + d]) : 0.f;
      Vs[r][d] = j < P.S ? ld(v[(int64_t)j * P.sv.r + d]) : 0.f;
    }
    __syncthreads();
    float s[RW], dp[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) s[r] = dp[r] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; d++) {
      float kd = Ks[lane][d], vd = Vs[lane][d];
#pragma unroll
      for (int r = 0; r < RW; r++) {
        s[r] += Qs[warp * RW + r][d] * kd;
        dp[r] += Gs[warp * RW + r][d] * vd;
      }
    }
    const int j = j0 + lane;
#pragma unroll
    for (int r = 0; r < RW; r++) {
      int row = i0 + warp * RW + r;
      bool ok = j < P.S && row < P.T && vis(row + off, j, P.win, P.ng, P.causal);
      s[r] = ok ? expf(s[r] - L[r]) * (dp[r] - Di[r]) : 0.f; /* dS */
    }
    for (int jj = 0; jj < GN; jj++) {
      float ds[RW];
#pragma unroll
      for (int r = 0; r < RW; r++) ds[r] = __shfl_sync(FULL, s[r], jj);
#pragma unroll
      for (int t = 0; t < DT; t++) {
        float kv = Ks[jj][lane + 32 * t];
#pragma unroll
        for (int r = 0; r < RW; r++) acc[r][t] += ds[r] * kv;
      }
    }
  }
  T *dq = (T *)P.dq + head_at(P.sdq, bh, P.H);
#pragma unroll
  for (int r = 0; r < RW; r++) {
    int row = i0 + warp * RW + r;
    if (row >= P.T) continue;
#pragma unroll
    for (int t = 0; t < DT; t++) dq[(int64_t)row * P.sdq.r + lane + 32 * t] = st<T>(acc[r][t] * P.scale);
  }
}

/* backward, dk and dv: a block owns 4 * RW keys (RW per warp) and walks the
 * query tiles that see them (32 queries, lane = query):
 * dv += P dout, dk += dS q * scale */
template <typename T, int D, int RW>
__global__ void __launch_bounds__(128) k_attn_bwd_dkdv(AttnP P) {
  constexpr int GK = 4 * RW, GQ = 32, DT = D / 32;
  __shared__ float Ks[GK][D];
  __shared__ float Vs[GK][D];
  __shared__ float Qs[GQ][D + 1];
  __shared__ float Gs[GQ][D + 1];
  __shared__ float Ls[GQ], Ds[GQ];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bh = blockIdx.y, j0 = blockIdx.x * GK, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H), *g = (const T *)P.dout + head_at(P.sg, bh, P.H);
  const T *o = (const T *)P.o + head_at(P.so, bh, P.H);
  const T *k = (const T *)P.k + head_at(P.sk, bh, P.H), *v = (const T *)P.v + head_at(P.sv, bh, P.H);
  for (int e = threadIdx.x; e < GK * D; e += 128) {
    int r = e / D, d = e % D;
    bool in = j0 + r < P.S;
    Ks[r][d] = in ? ld(k[(int64_t)(j0 + r) * P.sk.r + d]) : 0.f;
    Vs[r][d] = in ? ld(v[(int64_t)(j0 + r) * P.sv.r + d]) : 0.f;
  }
  float dk[RW][DT], dv[RW][DT];
#pragma unroll
  for (int r = 0; r < RW; r++)
#pragma unroll
    for (int t = 0; t < DT; t++) dk[r][t] = dv[r][t] = 0.f;
  const int jmax = min(j0 + GK, P.S) - 1;
  /* queries that may see a key of the block: i >= j0 - off (causal), and
   * p - jmax < win unless the block holds global keys */
  int ilo = P.causal ? max(0, j0 - off) : 0;
  int ihi = P.T;
  if (P.win > 0 && j0 >= P.ng) ihi = (int)min((int64_t)P.T, (int64_t)jmax + P.win - off);
  for (int ib = ilo; ib < ihi; ib += GQ) {
    __syncthreads();
    for (int e = threadIdx.x; e < GQ * D; e += 128) {
      int r = e / D, d = e % D, i = ib + r;
      Qs[r][d] = i < P.T ? ld(q[(int64_t)i * P.sq.r + d]) * P.scale : 0.f;
      Gs[r][d] = i < P.T ? ld(g[(int64_t)i * P.sg.r + d]) : 0.f;
    }
    for (int r = warp; r < GQ; r += 4) {
      int i = ib + r;
      float s = 0.f;
      if (i < P.T)
#pragma unroll
        for (int t = 0; t < DT; t++)
          s += ld(g[(int64_t)i * P.sg.r + lane + 32 * t]) * ld(o[(int64_t)i * P.so.r + lane + 32 * t]);
      s = warp_sum(s);
      if (lane == 0) {
        Ds[r] = s;
        Ls[r] = i < P.T ? P.lse_in[(int64_t)bh * P.T + i] : 0.f;
      }
    }
    __syncthreads();
    float pr[RW], ds[RW];
#pragma unroll
    for (int r = 0; r < RW; r++) pr[r] = ds[r] = 0.f;
#pragma unroll 8
    for (int d = 0; d < D; d++) {
      float qd = Qs[lane][d], gd = Gs[lane][d];
#pragma unroll
      for (int r = 0; r < RW; r++) {
        pr[r] += qd * Ks[warp * RW + r][d];
        ds[r] += gd * Vs[warp * RW + r][d];
      }
    }
    const int i = ib + lane;
#pragma unroll
    for (int r = 0; r < RW; r++) {
      int j = j0 + warp * RW + r;
      bool ok = i < P.T && j < P.S && vis(i + off, j, P.win, P.ng, P.causal);
      float p = ok ? expf(pr[r] - Ls[lane]) : 0.f;
      ds[r] = p * (ds[r] - Ds[lane]);
      pr[r] = p;
    }
    for (int ii = 0; ii < GQ; ii++) {
      float pb[RW], db[RW];
#pragma unroll
      for (int r = 0; r < RW; r++) {
        pb[r] = __shfl_sync(FULL, pr[r], ii);
        db[r] = __shfl_sync(FULL, ds[r], ii);
      }
#pragma unroll
      for (int t = 0; t < DT; t++) {
        float gq = Gs[ii][lane + 32 * t], qq = Qs[ii][lane + 32 * t];
#pragma unroll
        for (int r = 0; r < RW; r++) {
          dv[r][t] += pb[r] * gq;
          dk[r][t] += db[r] * qq;
        }
      }
    }
  }
  T *pdk = (T *)P.dk + head_at(P.sdk, bh, P.H), *pdv = (T *)P.dv + head_at(P.sdv, bh, P.H);
#pragma unroll
  for (int r = 0; r < RW; r++) {
    int j = j0 + warp * RW + r;
    if (j >= P.S) continue;
#pragma unroll
    for (int t = 0; t < DT; t++) {
      pdk[(int64_t)j * P.sdk.r + lane + 32 * t] = st<T>(dk[r][t]); /* q was scaled */
      pdv[(int64_t)j * P.sdv.r + lane + 32 * t] = st<T>(dv[r][t]);
    }
  }
}

/* ------------------------------------------------------------------------ */
/* tensor-core forward (bf16 / f16)                                         */

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void ldsm_x4(uint32_t *r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t *r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
template <typename T> __device__ __forceinline__ void mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* two n-tiles: c[0] += a b[0..1], c[1] += a b[2..3] (b from one ldmatrix.x4) */
template <typename T> __device__ __forceinline__ void mma2(float (*c)[4], const uint32_t *a, const uint32_t *b) {
  mma16816<T>(c[0], a, b[0], b[1]);
  mma16816<T>(c[1], a, b[2], b[3]);
}
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t u;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &h, 4);
  } else {
    __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&u, &h, 4);
  }
  return u;
}

/* the key tiles of BN keys that queries at positions [pmin, pmax] see:
 * [0, g) (the global keys) then [w, e); j0(t) is the first key of the t-th */
struct KvTiles {
  int g, w, n, bn;
  __device__ __forceinline__ int j0(int t) const { return (t < g ? t : w + (t - g)) * bn; }
};
__device__ __forceinline__ KvTiles kv_tiles(const AttnP &P, int pmin, int pmax, int BN) {
  const int kv_end = P.causal ? min(P.S, pmax + 1) : P.S;
  const int e = (kv_end + BN - 1) / BN;
  KvTiles r = {0, 0, 0, BN};
  if (P.win > 0) {
    const int lo = pmin - P.win + 1;
    r.w = lo <= 0 ? 0 : min(lo / BN, e);
    r.g = min((P.ng + BN - 1) / BN, r.w);
  }
  r.n = r.g + (e - r.w);
  return r;
}
/* keys [j0, j0 + BN) hold a key that is out of range or invisible to some
 * position in [pmin, pmax] */
__device__ __forceinline__ bool tile_masked(const AttnP &P, int pmin, int pmax, int j0, int BN) {
  return (j0 + BN > P.S) || (P.causal && j0 + BN - 1 > pmin) || (P.win > 0 && j0 + BN > P.ng && pmax - j0 >= P.win);
}

/* the A fragment (16 x 16) made of the accumulators of n-tiles 2 kk and 2 kk + 1 */
template <typename T> __device__ __forceinline__ void acc_to_a(uint32_t *a, const float (*c)[4], int kk) {
  a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

/* element offset of 16-byte chunk c of row r in a swizzled tile of rows of D */
template <int D> __device__ __forceinline__ int swz(int r, int c) { return r * D + ((c ^ (r & 7)) << 3); }

/* ROWS rows from global row row0, rows rs elements apart (rows >= nrows are
 * zero-filled); every row start 16-byte aligned; NTH threads (the block).
 * Thread x copies chunk x % (D / 8) of rows x / (D / 8) + NTH / (D / 8) i:
 * a fixed swizzled column, so each copy is one 64-bit address and an add.
 * Layout: rows of D, swz<D> (HALVES false); or (the wgmma kernels, HALVES)
 * D / 64 tiles of [ROWS][64], each in the 128-byte swizzle, column half h
 * at sm + h ROWS 64 (the same as the first for D 64). */
template <typename T, int D, int ROWS, int NTH = 128, bool HALVES = false>
__device__ __forceinline__ void load_tile(T *sm, const T *g, int64_t rs, int row0, int nrows) {
  constexpr int DC = D / 8, RSTEP = NTH / DC, N = ROWS * DC, W = HALVES ? 64 : D; /* W: a row's elements in smem */
  static_assert(NTH % DC == 0 && (RSTEP % 8 == 0 || RSTEP >= ROWS), "load_tile: the swizzle needs rows 8k apart");
  const int c = threadIdx.x % DC, r0 = threadIdx.x / DC;
  const T *src = g + (int64_t)row0 * rs + c * 8;
  const uint32_t dst = smem_u32(HALVES ? sm + (c >> 3) * ROWS * 64 + swz<64>(r0, c & 7) : sm + swz<D>(r0, c));
#pragma unroll
  for (int it = 0; it < (N + NTH - 1) / NTH; it++) {
    const int r = r0 + it * RSTEP;
    if (N % NTH != 0 && r >= ROWS) break;
    const bool ok = row0 + r < nrows;
    cp_async16(dst + it * RSTEP * W * (int)sizeof(T), ok ? src + (int64_t)r * rs : g, ok ? 16 : 0);
  }
}

/* the K/V pipeline step of key tile t (of kt.n): start loading tile t + 1
 * into the other stage, then wait for tile t (stage t & 1) */
template <typename T, int D, int BN, int NTH = 128>
__device__ __forceinline__ void kv_next(T *Ks, T *Vs, const T *k, const T *v, int64_t ks, int64_t vs,
                                        const KvTiles &kt, int t, int S) {
  if (t + 1 < kt.n) {
    const int o = ((t & 1) ^ 1) * BN * D;
    load_tile<T, D, BN, NTH>(Ks + o, k, ks, kt.j0(t + 1), S);
    load_tile<T, D, BN, NTH>(Vs + o, v, vs, kt.j0(t + 1), S);
  }
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
}

/* ex2.approx.ftz: one MUFU op (exp2f adds a range fix-up around it) */
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* one m-tile's online softmax (base 2, raw max: scale > 0): rows g and g + 8
 * of the thread's quad, s (NT n-tiles) becomes p = ex2(s sl2 - m sl2), m and
 * l are updated, o (DT n-tiles) rescaled; l stays per thread until the end */
template <int NT, int DT>
__device__ __forceinline__ void softmax_rows(float (*s)[4], float *m, float *l, float (*o)[4], float sl2) {
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float mx = m[h];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
    const float mus = (mx == -INFINITY ? 0.f : mx) * sl2;
    const float alpha = ex2(m[h] * sl2 - mus); /* m = -inf: 0 */
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const float p0 = ex2(fmaf(s[nt][2 * h], sl2, -mus)), p1 = ex2(fmaf(s[nt][2 * h + 1], sl2, -mus));
      s[nt][2 * h] = p0;
      s[nt][2 * h + 1] = p1;
      sum += p0 + p1;
    }
    m[h] = mx;
    l[h] = l[h] * alpha + sum;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
      o[dt][2 * h] *= alpha;
      o[dt][2 * h + 1] *= alpha;
    }
  }
}

/* the forward's output rows row0 + g and row0 + g + 8 (those below T) of one
 * m-tile: o / l, and lse = m mnat + log l (mnat: the units of m) */
template <typename T, int DT>
__device__ __forceinline__ void store_out_rows(const AttnP &P, int bh, int row0, const float (*o)[4],
                                               const float *m, const float *l, float mnat, int lane) {
  T *out = (T *)P.out + head_at(P.so, bh, P.H);
#pragma unroll
  for (int h = 0; h < 2; h++) {
    float lt = l[h];
    lt += __shfl_xor_sync(FULL, lt, 1);
    lt += __shfl_xor_sync(FULL, lt, 2);
    const int row = row0 + (lane >> 2) + h * 8;
    if (row >= P.T) continue;
    const float inv = lt > 0.f ? 1.f / lt : 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
      *(uint32_t *)(out + (int64_t)row * P.so.r + dt * 8 + ((lane & 3) << 1)) =
          pack2<T>(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
    if ((lane & 3) == 0) P.lse[(int64_t)bh * P.T + row] = lt > 0.f ? m[h] * mnat + logf(lt) : -INFINITY;
  }
}

/* rows row0 + g and row0 + g + 8 (those below nrows) of an accumulator
 * tile a (DT n-tiles) times scale into dst (rows rs elements apart) */
template <typename T, int DT>
__device__ __forceinline__ void store_acc_rows(T *dst, int64_t rs, int row0, int nrows, const float (*a)[4],
                                               float scale, int lane) {
#pragma unroll
  for (int h = 0; h < 2; h++) {
    const int row = row0 + (lane >> 2) + h * 8;
    if (row >= nrows) continue;
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
      *(uint32_t *)(dst + (int64_t)row * rs + dt * 8 + ((lane & 3) << 1)) =
          pack2<T>(a[dt][2 * h] * scale, a[dt][2 * h + 1] * scale);
  }
}

/* tile(mk, t) for a tile loop body specialized on its masking: NEW, the
 * unmasked body (mk 0) or the masked one (mk 1) by the block-uniform masked;
 * old (NEW = false), one body that tests its own need_mask (mk 2) */
template <bool NEW, typename F> __device__ __forceinline__ void run_tile(F &tile, int t, bool masked) {
  if constexpr (NEW) {
    if (masked)
      tile(std::integral_constant<int, 1>(), t);
    else
      tile(std::integral_constant<int, 0>(), t);
  } else {
    tile(std::integral_constant<int, 2>(), t);
  }
}

/* NW warps, MT m-tiles of 16 query rows each: BM = 16 * MT * NW rows a CTA.
 * NEW = false is the first version (kept for A/B, GP_ATTN_IMPL=old). NEW:
 * the row max is taken on the raw scores (the host picks NEW only for scale
 * > 0), p = ex2(s * scale log2e - m * scale log2e) is one FFMA and one MUFU
 * op, and the masked and unmasked tiles are two specialized loop bodies (no
 * per-element mask code on the tiles away from the boundaries). */
template <typename T, int D, int MT, int NW, bool NEW>
__global__ void __launch_bounds__(NW * 32, NW == 8 ? 2 : 1) k_attn_fwd_mma(AttnP P, int BH) {
  constexpr int NTH = NW * 32, BM = 16 * MT * NW, BN = 64, KD = D / 16, NT = BN / 8, DT = D / 8;
  extern __shared__ uint4 attn_smem[];
  T *Qs = (T *)attn_smem;
  T *Ks = Qs + BM * D; /* 2 stages */
  T *Vs = Ks + 2 * BN * D;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  /* block b: query tile n_m - 1 - b / BH of head b % BH (the longest causal rows of every head first) */
  const int n_m = gridDim.x / BH;
  const int bh = blockIdx.x % BH, i0 = (n_m - 1 - (int)(blockIdx.x / BH)) * BM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H);
  const T *k = (const T *)P.k + head_at(P.sk, bh, P.H);
  const T *v = (const T *)P.v + head_at(P.sv, bh, P.H);

  const int pmin = i0 + off, pmax = min(i0 + BM, P.T) - 1 + off;
  const KvTiles kt = kv_tiles(P, pmin, pmax, BN);
  const int n_tiles = kt.n;

  load_tile<T, D, BM, NTH>(Qs, q, P.sq.r, i0, P.T);
  if (n_tiles > 0) {
    load_tile<T, D, BN, NTH>(Ks, k, P.sk.r, kt.j0(0), P.S);
    load_tile<T, D, BN, NTH>(Vs, v, P.sv.r, kt.j0(0), P.S);
  }
  cp_async_commit();

  /* the Q fragments stay in registers (QREG), or are reloaded from shared
   * memory per k-step where registers are short (8 warps at 2 CTAs an SM) */
  constexpr bool QREG = NW == 4;
  float o[MT][DT][4], m[MT][2], l[MT][2];
  uint32_t qf[MT][QREG ? KD : 1][4];
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.f;
  }
  const float sl2 = P.scale * 1.4426950408889634f;
  const int wrow = warp * 16 * MT; /* the warp's first row in the tile */

  /* one key tile; MK: 0 no mask, 1 mask, 2 mask when need_mask (NEW = false) */
  auto tile = [&](auto mk_tag, int t) {
    constexpr int MK = decltype(mk_tag)::value;
    const int st = t & 1;
    const int j0 = kt.j0(t);
    kv_next<T, D, BN, NTH>(Ks, Vs, k, v, P.sk.r, P.sv.r, kt, t, P.S);
    if (QREG && t == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int kk = 0; kk < KD; kk++)
          ldsm_x4(qf[mt][kk], smem_u32(Qs + swz<D>(wrow + mt * 16 + (lane & 15), kk * 2 + (lane >> 4))));
    }
    const T *Kst = Ks + st * BN * D, *Vst = Vs + st * BN * D;

    /* S = Q K^T */
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < NT; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
      if constexpr (!QREG)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
          ldsm_x4(qf[mt][0], smem_u32(Qs + swz<D>(wrow + mt * 16 + (lane & 15), kk * 2 + (lane >> 4))));
#pragma unroll
      for (int np = 0; np < NT / 2; np++) {
        uint32_t b[4];
        ldsm_x4(b, smem_u32(Kst + swz<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1))));
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma2<T>(s[mt] + 2 * np, qf[mt][QREG ? kk : 0], b);
        }
      }
    }

    /* masks, only on tiles that touch a boundary */
    const bool need_mask = MK == 1 || (MK == 2 && tile_masked(P, pmin, pmax, j0, BN));
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          float x = NEW ? s[mt][nt][e] : s[mt][nt][e] * sl2;
          if (MK != 0 && need_mask) {
            int p = i0 + wrow + mt * 16 + (lane >> 2) + ((e >> 1) << 3) + off;
            int j = j0 + nt * 8 + ((lane & 3) << 1) + (e & 1);
            if (j >= P.S || !vis(p, j, P.win, P.ng, P.causal)) x = -INFINITY;
          }
          s[mt][nt][e] = x;
        }

    /* online softmax (base 2); l stays per thread until the end. NEW: m is
     * the raw max (scale > 0), p = ex2(s sl2 - m sl2); old: m and s are
     * already scaled by sl2 */
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      if constexpr (NEW) {
        softmax_rows<NT, DT>(s[mt], m[mt], l[mt], o[mt], sl2);
      } else {
#pragma unroll
        for (int h = 0; h < 2; h++) {
          float mx = m[mt][h];
#pragma unroll
          for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
          const float mu = mx == -INFINITY ? 0.f : mx;
          const float alpha = exp2f(m[mt][h] - mu);
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < NT; nt++) {
            float p0 = exp2f(s[mt][nt][2 * h] - mu), p1 = exp2f(s[mt][nt][2 * h + 1] - mu);
            s[mt][nt][2 * h] = p0;
            s[mt][nt][2 * h + 1] = p1;
            sum += p0 + p1;
          }
          m[mt][h] = mx;
          l[mt][h] = l[mt][h] * alpha + sum;
#pragma unroll
          for (int dt = 0; dt < DT; dt++) {
            o[mt][dt][2 * h] *= alpha;
            o[mt][dt][2 * h + 1] *= alpha;
          }
        }
      }
    }

    /* O += P V: the S accumulators are P's A fragments */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        acc_to_a<T>(pa[mt], s[mt], kk);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; dp++) {
        uint32_t b[4];
        ldsm_x4_t(b, smem_u32(Vst + swz<D>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), dp * 2 + (lane >> 4))));
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma2<T>(o[mt] + 2 * dp, pa[mt], b);
        }
      }
    }
    __syncthreads(); /* the next iteration loads into this stage */
  };
  for (int t = 0; t < n_tiles; t++) run_tile<NEW>(tile, t, NEW && (tile_masked(P, pmin, pmax, kt.j0(t), BN)));
  cp_async_wait<0>();

  /* m: raw max (NEW), base-2 scaled max (old) */
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
    store_out_rows<T, DT>(P, bh, i0 + wrow + mt * 16, o[mt], m[mt], l[mt], NEW ? P.scale : 0.6931471805599453f, lane);
}

/* ------------------------------------------------------------------------ */
/* tensor-core backward (bf16 / f16), FlashAttention-2 style                */
/*
 * Three kernels: delta_i = rowsum(dout_i * out_i) (f32); dk/dv by key tiles
 * (a CTA owns 64 keys, 16 per warp, and walks the query tiles that see them:
 * S^T = K Q^T, dP^T = V dout^T, P^T = exp2(S^T * scale * log2e - lse * log2e),
 * dS^T = P^T (dP^T - delta), dV += P^T dout, dK += dS^T Q * scale); dq by
 * query tiles (64 queries, 16 per warp, walking the visible key tiles as the
 * forward does: S = Q K^T, dP = dout V^T, dQ += dS K * scale). No atomics:
 * every output element is written once by one thread (deterministic). The
 * recomputed score tiles stay in registers: an mma accumulator fragment is
 * the A fragment of the next product (P^T, dS^T and dS). Query tiles (dk/dv)
 * and key tiles (dq) are double-buffered with cp.async. */

#define LOG2E 1.4426950408889634f

__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
/* ldmatrix addresses in a swizzled tile (rows of D elements):
 * a_off: the A fragment (16 rows from row0, 16 columns from chunk kc0) of a
 *   row-major [M][K] tile;
 * bn_off: the B fragments of two n-tiles (rows n0..n0+15) of a [N][K] tile
 *   (K^T-like operand: non-transposed ldmatrix);
 * bk_off: the B fragments of two n-tiles (columns from chunk nc0) of a [K][N]
 *   tile (V-like operand: ldmatrix.trans). */
template <int D> __device__ __forceinline__ int a_off(int row0, int kc0, int lane) {
  return swz<D>(row0 + (lane & 15), kc0 + (lane >> 4));
}
template <int D> __device__ __forceinline__ int bn_off(int n0, int kc0, int lane) {
  return swz<D>(n0 + (lane & 7) + ((lane >> 4) << 3), kc0 + ((lane >> 3) & 1));
}
template <int D> __device__ __forceinline__ int bk_off(int k0, int nc0, int lane) {
  return swz<D>(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), nc0 + (lane >> 4));
}

/* delta[r] = sum_d dout[r, d] * out[r, d] for r = bh * T + i: D / 8 threads a
 * row, 16 bytes each (the tensor-core path: rows 16-byte aligned) */
template <typename T, int D>
__global__ void __launch_bounds__(128) k_attn_bwd_delta(AttnP P, float *__restrict__ delta, int64_t rows) {
  constexpr int TPR = D / 8; /* threads a row, 16 bytes each */
  const int64_t row = (int64_t)blockIdx.x * (128 / TPR) + threadIdx.x / TPR;
  const int c = (threadIdx.x % TPR) * 8;
  float s = 0.f;
  if (row < rows) {
    const int bh = (int)(row / P.T), i = (int)(row % P.T);
    const uint4 o = *(const uint4 *)((const T *)P.o + head_at(P.so, bh, P.H) + (int64_t)i * P.so.r + c);
    const uint4 g = *(const uint4 *)((const T *)P.dout + head_at(P.sg, bh, P.H) + (int64_t)i * P.sg.r + c);
    const T *oe = (const T *)&o, *ge = (const T *)&g;
#pragma unroll
    for (int e = 0; e < 8; e++) s += ld(ge[e]) * ld(oe[e]);
  }
#pragma unroll
  for (int w = TPR / 2; w > 0; w >>= 1) s += __shfl_xor_sync(FULL, s, w);
  if (row < rows && c == 0) delta[row] = s;
}

/* dk, dv: block b holds key tile b / BH (the first key tiles, which most
 * causal queries see, start first) of head b % BH */
template <typename T, int D, int BQ, bool NEW>
__global__ void __launch_bounds__(128) k_attn_bwd_dkdv_mma(AttnP P, const float *__restrict__ delta, int BH) {
  constexpr int BN = 64, KD = D / 16, NQ = BQ / 8, DT = D / 8;
  extern __shared__ uint4 attn_smem[];
  T *Ks = (T *)attn_smem;
  T *Vs = Ks + BN * D;
  T *Qs = Vs + BN * D;     /* 2 stages */
  T *Gs = Qs + 2 * BQ * D; /* 2 stages */
  float *Ls = (float *)(Gs + 2 * BQ * D); /* 2 stages of BQ */
  float *Dl = Ls + 2 * BQ;                /* 2 stages of BQ */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int bh = blockIdx.x % BH, j0 = (blockIdx.x / BH) * BN, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H), *g = (const T *)P.dout + head_at(P.sg, bh, P.H);
  const T *k = (const T *)P.k + head_at(P.sk, bh, P.H), *v = (const T *)P.v + head_at(P.sv, bh, P.H);
  const float *lse = P.lse_in + (int64_t)bh * P.T, *dlt = delta + (int64_t)bh * P.T;

  /* the queries that may see a key of the tile: p >= j0 (causal), and
   * p - jmax < win unless the tile holds a global key */
  const int jmax = min(j0 + BN, P.S) - 1;
  const int ilo = P.causal ? max(0, j0 - off) : 0;
  int ihi = P.T;
  if (P.win > 0 && j0 >= P.ng) ihi = (int)min((int64_t)P.T, (int64_t)jmax + P.win - off);
  const int n_qt = ihi > ilo ? (ihi - ilo + BQ - 1) / BQ : 0;

  auto load_q = [&](int stage, int i0) {
    load_tile<T, D, BQ>(Qs + stage * BQ * D, q, P.sq.r, i0, P.T);
    load_tile<T, D, BQ>(Gs + stage * BQ * D, g, P.sg.r, i0, P.T);
    for (int e = threadIdx.x; e < BQ; e += 128) {
      const int i = i0 + e;
      const bool ok = i < P.T;
      cp_async4(smem_u32(Ls + stage * BQ + e), lse + (ok ? i : 0), ok ? 4 : 0);
      cp_async4(smem_u32(Dl + stage * BQ + e), dlt + (ok ? i : 0), ok ? 4 : 0);
    }
  };
  load_tile<T, D, BN>(Ks, k, P.sk.r, j0, P.S);
  load_tile<T, D, BN>(Vs, v, P.sv.r, j0, P.S);
  if (n_qt > 0) load_q(0, ilo);
  cp_async_commit();

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; dt++)
#pragma unroll
    for (int e = 0; e < 4; e++) dk[dt][e] = dv[dt][e] = 0.f;
  const float sl2 = P.scale * LOG2E;
  /* the query tile from i0 holds a row past T or a (query, key) pair to mask */
  auto q_masked = [&](int i0) {
    return i0 + BQ > P.T || tile_masked(P, i0 + off, min(i0 + BQ, P.T) - 1 + off, j0, BN);
  };
  const int wrow = warp * 16, g8 = lane >> 2, t2 = (lane & 3) << 1;

  /* one query tile; MK: 0 no mask, 1 mask, 2 mask when need_mask (NEW = false) */
  auto tile = [&](auto mk_tag, int t) {
    constexpr int MK = decltype(mk_tag)::value;
    const int st = t & 1, i0 = ilo + t * BQ;
    if (t + 1 < n_qt) load_q(st ^ 1, i0 + BQ);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T *Qst = Qs + st * BQ * D, *Gst = Gs + st * BQ * D;
    const float *Lst = Ls + st * BQ, *Dst = Dl + st * BQ;

    /* S^T = K Q^T and dP^T = V dout^T (rows: the warp's 16 keys; columns: BQ queries) */
    float s[NQ][4], dp[NQ][4];
#pragma unroll
    for (int nt = 0; nt < NQ; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
      uint32_t ka[4], va[4];
      ldsm_x4(ka, smem_u32(Ks + a_off<D>(wrow, kk * 2, lane)));
      ldsm_x4(va, smem_u32(Vs + a_off<D>(wrow, kk * 2, lane)));
#pragma unroll
      for (int np = 0; np < NQ / 2; np++) {
        uint32_t b[4];
        ldsm_x4(b, smem_u32(Qst + bn_off<D>(np * 16, kk * 2, lane)));
        mma2<T>(s + 2 * np, ka, b);
        ldsm_x4(b, smem_u32(Gst + bn_off<D>(np * 16, kk * 2, lane)));
        mma2<T>(dp + 2 * np, va, b);
      }
    }

    /* P^T and dS^T; masks only on tiles that touch a boundary */
    const bool need_mask = MK == 1 || (MK == 2 && q_masked(i0));
#pragma unroll
    for (int nt = 0; nt < NQ; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int ic = nt * 8 + t2 + (e & 1);
        float pv = NEW ? ex2(fmaf(s[nt][e], sl2, -Lst[ic] * LOG2E)) : exp2f(s[nt][e] * sl2 - Lst[ic] * LOG2E);
        if (MK != 0 && need_mask) {
          const int i = i0 + ic, j = j0 + wrow + g8 + ((e >> 1) << 3);
          if (i >= P.T || j >= P.S || !vis(i + off, j, P.win, P.ng, P.causal)) pv = 0.f;
        }
        dp[nt][e] = pv * (dp[nt][e] - Dst[ic]);
        s[nt][e] = pv;
      }

    /* dV += P^T dout, dK += dS^T Q (the accumulators are the A fragments) */
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++) {
      uint32_t pa[4], da[4];
      acc_to_a<T>(pa, s, kk);
      acc_to_a<T>(da, dp, kk);
#pragma unroll
      for (int dq2 = 0; dq2 < DT / 2; dq2++) {
        uint32_t b[4];
        ldsm_x4_t(b, smem_u32(Gst + bk_off<D>(kk * 16, dq2 * 2, lane)));
        mma2<T>(dv + 2 * dq2, pa, b);
        ldsm_x4_t(b, smem_u32(Qst + bk_off<D>(kk * 16, dq2 * 2, lane)));
        mma2<T>(dk + 2 * dq2, da, b);
      }
    }
    __syncthreads(); /* the next iteration loads into this stage */
  };
  for (int t = 0; t < n_qt; t++) run_tile<NEW>(tile, t, NEW && (q_masked(ilo + t * BQ)));
  cp_async_wait<0>();

  store_acc_rows<T, DT>((T *)P.dk + head_at(P.sdk, bh, P.H), P.sdk.r, j0 + wrow, P.S, dk, P.scale, lane); /* q was not scaled */
  store_acc_rows<T, DT>((T *)P.dv + head_at(P.sdv, bh, P.H), P.sdv.r, j0 + wrow, P.S, dv, 1.f, lane);
}

/* dq: block b holds query tile (n_mt - 1 - b / BH) (the longest causal rows
 * first) of head b % BH; the key tiles are the forward's */
template <typename T, int D, int BN, bool NEW>
__global__ void __launch_bounds__(128) k_attn_bwd_dq_mma(AttnP P, const float *__restrict__ delta, int BH) {
  constexpr int BM = 64, KD = D / 16, NT = BN / 8, DT = D / 8;
  extern __shared__ uint4 attn_smem[];
  T *Qs = (T *)attn_smem;
  T *Gs = Qs + BM * D;
  T *Ks = Gs + BM * D;     /* 2 stages */
  T *Vs = Ks + 2 * BN * D; /* 2 stages */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_mt = gridDim.x / BH;
  const int bh = blockIdx.x % BH, i0 = (n_mt - 1 - (int)(blockIdx.x / BH)) * BM, off = P.S - P.T;
  const T *q = (const T *)P.q + head_at(P.sq, bh, P.H), *g = (const T *)P.dout + head_at(P.sg, bh, P.H);
  const T *k = (const T *)P.k + head_at(P.sk, bh, P.H), *v = (const T *)P.v + head_at(P.sv, bh, P.H);

  const int pmin = i0 + off, pmax = min(i0 + BM, P.T) - 1 + off;
  const KvTiles kt = kv_tiles(P, pmin, pmax, BN);
  const int n_tiles = kt.n;

  load_tile<T, D, BM>(Qs, q, P.sq.r, i0, P.T);
  load_tile<T, D, BM>(Gs, g, P.sg.r, i0, P.T);
  if (n_tiles > 0) {
    load_tile<T, D, BN>(Ks, k, P.sk.r, kt.j0(0), P.S);
    load_tile<T, D, BN>(Vs, v, P.sv.r, kt.j0(0), P.S);
  }
  cp_async_commit();

  const int wrow = warp * 16, g8 = lane >> 2, t2 = (lane & 3) << 1;
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
  uint32_t qf[KD][4], gf[KD][4];
  const float sl2 = P.scale * LOG2E;

  /* one key tile; MK: 0 no mask, 1 mask, 2 mask when need_mask (NEW = false) */
  auto tile = [&](auto mk_tag, int t) {
    constexpr int MK = decltype(mk_tag)::value;
    const int st = t & 1;
    const int j0 = kt.j0(t);
    kv_next<T, D, BN>(Ks, Vs, k, v, P.sk.r, P.sv.r, kt, t, P.S);
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < KD; kk++) {
        ldsm_x4(qf[kk], smem_u32(Qs + a_off<D>(wrow, kk * 2, lane)));
        ldsm_x4(gf[kk], smem_u32(Gs + a_off<D>(wrow, kk * 2, lane)));
      }
    }
    const T *Kst = Ks + st * BN * D, *Vst = Vs + st * BN * D;

    /* S = Q K^T, dP = dout V^T */
    float s[NT][4], dp[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[nt][e] = dp[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; kk++)
#pragma unroll
      for (int np = 0; np < NT / 2; np++) {
        uint32_t b[4];
        ldsm_x4(b, smem_u32(Kst + bn_off<D>(np * 16, kk * 2, lane)));
        mma2<T>(s + 2 * np, qf[kk], b);
        ldsm_x4(b, smem_u32(Vst + bn_off<D>(np * 16, kk * 2, lane)));
        mma2<T>(dp + 2 * np, gf[kk], b);
      }

    /* dS = P (dP - delta); masks only on tiles that touch a boundary (rows
     * past T are never stored) */
    const bool need_mask = MK == 1 || (MK == 2 && tile_masked(P, pmin, pmax, j0, BN));
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int h = e >> 1;
        float pv = NEW ? ex2(fmaf(s[nt][e], sl2, -L2[h])) : exp2f(s[nt][e] * sl2 - L2[h]);
        if (MK != 0 && need_mask) {
          const int p = i0 + wrow + g8 + h * 8 + off, j = j0 + nt * 8 + t2 + (e & 1);
          if (j >= P.S || !vis(p, j, P.win, P.ng, P.causal)) pv = 0.f;
        }
        s[nt][e] = pv * (dp[nt][e] - Dd[h]);
      }

    /* dQ += dS K */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      uint32_t da[4];
      acc_to_a<T>(da, s, kk);
#pragma unroll
      for (int dq2 = 0; dq2 < DT / 2; dq2++) {
        uint32_t b[4];
        ldsm_x4_t(b, smem_u32(Kst + bk_off<D>(kk * 16, dq2 * 2, lane)));
        mma2<T>(acc + 2 * dq2, da, b);
      }
    }
    __syncthreads(); /* the next iteration loads into this stage */
  };
  for (int t = 0; t < n_tiles; t++) run_tile<NEW>(tile, t, NEW && (tile_masked(P, pmin, pmax, kt.j0(t), BN)));
  cp_async_wait<0>();

  store_acc_rows<T, DT>((T *)P.dq + head_at(P.sdq, bh, P.H), P.sdq.r, i0 + wrow, P.T, acc, P.scale, lane);
}

#include "attention_wg.cuh"

/* ------------------------------------------------------------------------ */
/* decode: split-K over the cache, then a combine                           */

struct DecP {
  const void *q, *kc, *vc, *lens;
  void *out;
  float *part; /* [BH, nsplit, D + 2]: acc (unnormalized), max (log2 units), sum */
  int lens64, H, C, chunk, nsplit;
  float scale;
  int win, ng;
};

__device__ __forceinline__ int dec_len(const DecP &P, int b) {
  int64_t n = P.lens64 ? ((const int64_t *)P.lens)[b] : ((const int32_t *)P.lens)[b];
  return (int)(n < 0 ? 0 : n > P.C ? P.C : n); /* clamped: never outside the cache */
}

/* 16 bytes at p: one load (VEC: p 16-byte aligned) or element by element */
template <typename T, bool VEC> __device__ __forceinline__ uint4 ld16(const T *p) {
  if constexpr (VEC) {
    return *(const uint4 *)p;
  } else {
    uint4 v;
    T *e = (T *)&v;
#pragma unroll
    for (int t = 0; t < 16 / (int)sizeof(T); t++) e[t] = p[t];
    return v;
  }
}
/* one 16-byte vector of a row as floats */
template <typename T, int N> __device__ __forceinline__ void vec_f32(float *f, const uint4 &v) {
  const T *e = (const T *)&v;
#pragma unroll
  for (int t = 0; t < N; t++) f[t] = ld(e[t]);
}

/* one (b, h) and one slice of its cache a block: each key's row is read by
 * LPK lanes with 16-byte loads (a warp reads KPW consecutive keys, 512
 * bytes, at a time), U keys a lane group in flight, one online-softmax
 * rescale per U keys (base 2); the 4 KPW lane groups' partials meet in
 * shared memory and go to part (m in log2 units). VEC: q, kc and vc start
 * 16-byte aligned (else the vectors are read element by element). */
template <typename T, int D, bool VEC>
__global__ void __launch_bounds__(128) k_attn_decode_split(DecP P) {
  constexpr int EPL = 16 / (int)sizeof(T), LPK = D / EPL, KPW = 32 / LPK, NPART = 4 * KPW, U = 4;
  static_assert(LPK <= 32 && 32 % LPK == 0, "decode: a key's row is 16-byte vectors of one warp");
  __shared__ float sm_m[NPART], sm_l[NPART], sm_acc[NPART][D];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane % LPK;
  const int gi = warp * KPW + lane / LPK; /* the lane group */
  const int bh = blockIdx.y, b = bh / P.H, split = blockIdx.x;
  const int n = dec_len(P, b), p = n - 1;
  const int jb = split * P.chunk, je = min(n, jb + P.chunk);
  float qr[EPL], acc[EPL];
  {
    const uint4 qv = ld16<T, VEC>((const T *)P.q + (int64_t)bh * D + sub * EPL);
    vec_f32<T, EPL>(qr, qv);
  }
  const float sl2 = P.scale * LOG2E;
#pragma unroll
  for (int t = 0; t < EPL; t++) {
    qr[t] *= sl2;
    acc[t] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const T *kc = (const T *)P.kc + (int64_t)bh * P.C * D + sub * EPL;
  const T *vc = (const T *)P.vc + (int64_t)bh * P.C * D + sub * EPL;
  /* keys [lo, hi): the block walks NPART U of them at a time (a uniform
   * trip count: every lane takes part in the shuffles) */
  auto run = [&](int lo, int hi) {
    for (int base = lo; base < hi; base += NPART * U) {
      uint4 kv[U], vv[U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int j = base + u * NPART + gi;
        const bool ok = j < hi;
        kv[u] = ok ? ld16<T, VEC>(kc + (int64_t)j * D) : make_uint4(0, 0, 0, 0);
        vv[u] = ok ? ld16<T, VEC>(vc + (int64_t)j * D) : make_uint4(0, 0, 0, 0);
      }
      float sc[U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        float kf[EPL];
        vec_f32<T, EPL>(kf, kv[u]);
        float d = 0.f;
#pragma unroll
        for (int t = 0; t < EPL; t++) d = fmaf(qr[t], kf[t], d);
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(FULL, d, o);
        sc[u] = base + u * NPART + gi < hi ? d : -INFINITY;
      }
      float mn = m;
#pragma unroll
      for (int u = 0; u < U; u++) mn = fmaxf(mn, sc[u]);
      if (mn == -INFINITY) continue; /* none of this group's keys */
      const float alpha = ex2(m - mn); /* m = -inf: 0 */
      l *= alpha;
#pragma unroll
      for (int t = 0; t < EPL; t++) acc[t] *= alpha;
#pragma unroll
      for (int u = 0; u < U; u++) {
        const float e = ex2(sc[u] - mn);
        float vf[EPL];
        vec_f32<T, EPL>(vf, vv[u]);
        l += e;
#pragma unroll
        for (int t = 0; t < EPL; t++) acc[t] = fmaf(e, vf[t], acc[t]);
      }
      m = mn;
    }
  };
  if (P.win > 0) { /* the leading visible keys, then the window */
    run(jb, min(je, P.ng));
    run(max(jb, max(P.ng, p - P.win + 1)), je);
  } else {
    run(jb, je);
  }
  if (sub == 0) {
    sm_m[gi] = m;
    sm_l[gi] = l;
  }
#pragma unroll
  for (int t = 0; t < EPL; t++) sm_acc[gi][sub * EPL + t] = acc[t];
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int i = 0; i < NPART; i++) M = fmaxf(M, sm_m[i]);
  float *part = P.part + ((int64_t)bh * P.nsplit + split) * (D + 2);
  for (int d = threadIdx.x; d < D; d += 128) {
    float a = 0.f;
#pragma unroll
    for (int i = 0; i < NPART; i++) a += (sm_m[i] == -INFINITY ? 0.f : ex2(sm_m[i] - M)) * sm_acc[i][d];
    part[d] = a;
  }
  if (threadIdx.x == 0) {
    float L = 0.f;
#pragma unroll
    for (int i = 0; i < NPART; i++) L += sm_m[i] == -INFINITY ? 0.f : ex2(sm_m[i] - M) * sm_l[i];
    part[D] = M;
    part[D + 1] = L;
  }
}

/* the splits' partials of one (b, h): weights 2^(m_s - M) */
template <typename T, int D>
__global__ void __launch_bounds__(D) k_attn_decode_combine(DecP P) {
  const int bh = blockIdx.x, d = threadIdx.x;
  const float *part = P.part + (int64_t)bh * P.nsplit * (D + 2);
  float M = -INFINITY;
  for (int s = 0; s < P.nsplit; s++) M = fmaxf(M, part[s * (D + 2) + D]);
  float a = 0.f, L = 0.f;
  if (M != -INFINITY)
    for (int s = 0; s < P.nsplit; s++) {
      float ms = part[s * (D + 2) + D];
      if (ms == -INFINITY) continue;
      float w = exp2f(ms - M);
      a += w * part[s * (D + 2) + d];
      L += w * part[s * (D + 2) + D + 1];
    }
  ((T *)P.out)[(int64_t)bh * D + d] = st<T>(L > 0.f ? a / L : 0.f);
}

/* ------------------------------------------------------------------------ */

int fill_params(AttnP &P, const char *op, const gp_tensor *q, const gp_tensor *k, double scale, int64_t win,
                int64_t ng, int causal) {
  char bq[96], bk[96];
  if (q->shape[2] >= INT32_MAX / 2 || k->shape[2] >= INT32_MAX / 2)
    return gp_error("%s: sequence lengths must be below 2^30 on the GPU; q is %s, k is %s", op,
                    gp_shape_str(q, bq, 96), gp_shape_str(k, bk, 96));
  if (q->shape[0] * q->shape[1] > 65535)
    return gp_error("%s: B * H must be at most 65535 on the GPU; q is %s", op, gp_shape_str(q, bq, 96));
  P.H = (int)q->shape[1];
  P.T = (int)q->shape[2];
  P.S = (int)k->shape[2];
  P.scale = (float)scale;
  P.win = (int)(win > INT32_MAX / 2 ? INT32_MAX / 2 : win);
  P.ng = (int)(ng > P.S ? P.S : ng);
  P.causal = causal;
  return GP_OK;
}

/* shared memory beyond 48 KB needs the attribute, once per kernel */
template <typename K> int smem_attr(K *kern, int smem, bool &done, const char *op) {
  if (done) return GP_OK;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return gp_error("%s: cannot give the kernel %d bytes of shared memory", op, smem);
  done = true;
  return GP_OK;
}

Str strides(const gp_tensor *t) { return Str{t->stride[0], t->stride[1], t->stride[2]}; }

/* the tensor-core paths' layout rule: a 16-byte aligned base and every B, H, T
 * stride (of a dim longer than 1) a multiple of 16 bytes, so that every row
 * starts 16-byte aligned (cp.async, ldmatrix, the 4-byte stores) */
bool rows16(const gp_tensor *t) {
  if (((uintptr_t)gp_ptr(t) & 15) != 0) return false;
  const int64_t es = gp_elsize(t->dtype);
  for (int d = 0; d < 3; d++)
    if (t->shape[d] > 1 && (t->stride[d] * es) % 16 != 0) return false;
  return true;
}

/* zeros into a (B, H, R, D) operand at its strides (attn_bwd with T = 0 or S = 0) */
template <typename T>
__global__ void k_attn_zero(T *p, Str s, int64_t H, int64_t R, int64_t D, int64_t n) {
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const int64_t d = e % D, r = (e / D) % R, bh = e / (D * R);
    p[(bh / H) * s.b + (bh % H) * s.h + r * s.r + d] = st<T>(0.f);
  }
}
int zero_rows(const gp_tensor *t) {
  const int64_t n = gp_numel(t);
  if (n == 0) return GP_OK;
  const int64_t blocks = (n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096;
  GP_FLOAT_SWITCH(t->dtype, T,
                  k_attn_zero<T><<<(unsigned)blocks, 256, 0, gp_cuda_stream()>>>(
                      (T *)gp_ptr(t), strides(t), t->shape[1], t->shape[2], t->shape[3], n));
  return GP_OK;
}

/* a forward kernel over query tiles of BM rows: grid BH x ceil(T / BM) */
template <typename K> int launch_fwd_tiles(K *kern, const AttnP &P, int64_t BH, int BM, int nth, int smem, bool &attr) {
  GP_TRY(smem_attr(kern, smem, attr, "attn_fwd"));
  const int64_t blocks = BH * ((P.T + BM - 1) / BM);
  if (blocks > INT32_MAX) return gp_error("attn_fwd: too many blocks for one launch (B * H = %lld, T = %d)",
                                          (long long)BH, P.T);
  GP_NOTE_LAUNCH(kern, nth, smem);
  kern<<<(unsigned)blocks, nth, smem, gp_cuda_stream()>>>(P, (int)BH);
  return GP_OK;
}

template <typename T, int D, int MT, int NW, bool NEW> int launch_fwd_mma(const AttnP &P, int64_t BH) {
  constexpr int BM = 16 * MT * NW;
  static bool attr = false; /* per instantiation */
  return launch_fwd_tiles(k_attn_fwd_mma<T, D, MT, NW, NEW>, P, BH, BM, NW * 32, (BM + 4 * 64) * D * (int)sizeof(T),
                          attr);
}

template <typename T, int D, int NWG, int BN, int MINB, int NS> int launch_fwd_wg(const AttnP &P, int64_t BH) {
  constexpr int BM = 64 * NWG;
  static bool attr = false; /* per instantiation */
  return launch_fwd_tiles(k_attn_fwd_wg<T, D, NWG, BN, MINB, NS>, P, BH, BM, NWG * 128,
                          (BM + 2 * NS * BN) * D * (int)sizeof(T) + 1024, attr);
}

/* GP_ATTN_IMPL (read once): "old" the first tensor-core kernels, "new" the
 * revised mma.sync ones, "new8" as new with the 8-warp forward (16 rows a
 * warp) at D 64; "wg" (the default where it runs: a compute capability 9.0
 * GPU and a build with sm_90a code; else new) the wgmma kernels at D 64 */
enum { IMPL_OLD = 0, IMPL_NEW = 1, IMPL_NEW8 = 2, IMPL_WG = 3 };
int attn_impl() {
  static int impl = -1;
  if (impl < 0) {
    const char *e = getenv("GP_ATTN_IMPL");
#ifdef GP_SM90A
    const bool wg = gp_cuda_cc() == 90;
#else
    const bool wg = false;
#endif
    impl = e && !strcmp(e, "old")    ? IMPL_OLD
           : e && !strcmp(e, "new")  ? IMPL_NEW
           : e && !strcmp(e, "new8") ? IMPL_NEW8
           : wg                      ? IMPL_WG
                                     : IMPL_NEW;
  }
  return impl;
}

template <typename T, int D> int launch_fwd_tc(const AttnP &P, int64_t BH) {
  constexpr int MT = D == 64 ? 2 : 1;
  const int impl = P.scale > 0.f ? attn_impl() : IMPL_OLD; /* NEW takes the max of the raw scores */
  if (impl == IMPL_OLD) return launch_fwd_mma<T, D, MT, 4, false>(P, BH);
  if constexpr (D == 64) {
    if (impl == IMPL_NEW8) return launch_fwd_mma<T, D, 1, 8, true>(P, BH);
    /* 2 warpgroups of 64 rows, key tiles of 64 in 3 stages, 2 CTAs an SM
     * (the best of the tilings measured: BENCHMARKS.md) */
    if (impl == IMPL_WG) return launch_fwd_wg<T, 64, 2, 64, 2, 3>(P, BH);
  }
  /* head dim 128: the same kernel, tiles as two 64-column halves, 1 CTA an
   * SM (3 warpgroups measured slower: BENCHMARKS.md) */
  if constexpr (D == 128)
    if (impl == IMPL_WG) return launch_fwd_wg<T, 128, 2, 64, 1, 3>(P, BH);
  return launch_fwd_mma<T, D, MT, 4, true>(P, BH);
}

template <typename T, int D> int launch_fwd_plain(const AttnP &P, int64_t BH) {
  constexpr int RW = D <= 64 ? 4 : 2;
  dim3 grid((unsigned)((P.T + 4 * RW - 1) / (4 * RW)), (unsigned)BH);
  GP_NOTE_LAUNCH((k_attn_fwd_plain<T, D, RW>), 128, 0);
  k_attn_fwd_plain<T, D, RW><<<grid, 128, 0, gp_cuda_stream()>>>(P);
  return GP_OK;
}

template <typename T, int D> int launch_bwd(const AttnP &P, int64_t BH) {
  constexpr int RW = D <= 64 ? 4 : 2;
  dim3 g1((unsigned)((P.T + 4 * RW - 1) / (4 * RW)), (unsigned)BH);
  GP_NOTE_LAUNCH((k_attn_bwd_dq<T, D, RW>), 128, 0);
  k_attn_bwd_dq<T, D, RW><<<g1, 128, 0, gp_cuda_stream()>>>(P);
  dim3 g2((unsigned)((P.S + 4 * RW - 1) / (4 * RW)), (unsigned)BH);
  GP_NOTE_LAUNCH((k_attn_bwd_dkdv<T, D, RW>), 128, 0);
  k_attn_bwd_dkdv<T, D, RW><<<g2, 128, 0, gp_cuda_stream()>>>(P);
  return GP_OK;
}

/* a tensor-core backward: delta (f32 scratch), then the dk/dv kernel over
 * n_kt key tiles and the dq kernel over n_mt query tiles of every head; dq
 * nullptr: the dk/dv kernel adds dQ into an f32 accumulator (P.dqa, tiles of
 * 64 rows) and k_attn_bwd_dq_store converts it */
template <typename T, int D, typename K1, typename K2>
int launch_bwd_kernels(AttnP P, int64_t BH, K1 *dkdv, int nth1, int smem1, int64_t n_kt, bool &a1, K2 dq,
                       int nth2, int smem2, int64_t n_mt, bool &a2) {
  constexpr bool SPLIT = !std::is_same<K2, std::nullptr_t>::value; /* a dq kernel */
  const int64_t rows = BH * P.T;
  if (BH * n_kt > INT32_MAX || BH * n_mt > INT32_MAX || (rows + 7) / 8 > INT32_MAX)
    return gp_error("attn_bwd: too many blocks for one launch (B * H = %lld, T = %d, S = %d)", (long long)BH, P.T,
                    P.S);
  gp_tensor *dl = 0, *acc = 0;
  GP_TRY(gp_tensor_scratch(&dl, GP_F32, GP_CUDA, 1, &rows));
  const int64_t nacc = BH * ((P.T + 63) / 64) * 4096;
  int rc = SPLIT ? GP_OK : gp_tensor_scratch(&acc, GP_F32, GP_CUDA, 1, &nacc);
  if (rc == GP_OK && acc) {
    P.dqa = (float *)gp_ptr(acc);
    if (cudaMemsetAsync(P.dqa, 0, (size_t)nacc * sizeof(float), gp_cuda_stream()) != cudaSuccess)
      rc = gp_error("attn_bwd: clearing the dQ accumulator failed");
  }
  float *delta = (float *)gp_ptr(dl);
  if (rc == GP_OK) {
    GP_NOTE_LAUNCH((k_attn_bwd_delta<T, D>), 128, 0);
    k_attn_bwd_delta<T, D><<<(unsigned)((rows + 128 / (D / 8) - 1) / (128 / (D / 8))), 128, 0, gp_cuda_stream()>>>(
        P, delta, rows);
    rc = smem_attr(dkdv, smem1, a1, "attn_bwd");
  }
  if constexpr (SPLIT)
    if (rc == GP_OK) rc = smem_attr(dq, smem2, a2, "attn_bwd");
  if (rc == GP_OK) {
    GP_NOTE_LAUNCH(dkdv, nth1, smem1);
    dkdv<<<(unsigned)(BH * n_kt), nth1, smem1, gp_cuda_stream()>>>(P, delta, (int)BH);
    if constexpr (SPLIT) {
      GP_NOTE_LAUNCH(dq, nth2, smem2);
      dq<<<(unsigned)(BH * n_mt), nth2, smem2, gp_cuda_stream()>>>(P, delta, (int)BH);
    } else {
      const int n64 = (P.T + 63) / 64;
      GP_NOTE_LAUNCH(k_attn_bwd_dq_store<T>, 128, 0);
      k_attn_bwd_dq_store<T><<<(unsigned)(BH * n64), 128, 0, gp_cuda_stream()>>>(P, n64);
    }
  }
  gp_tensor_free(acc);
  gp_tensor_free(dl); /* (stream-ordered, as the decode's partials) */
  return rc;
}

/* the mma.sync backward: 4 warps a CTA, 64 keys (dk/dv) or 64 queries (dq) */
template <typename T, int D, bool NEW> int launch_bwd_mma(const AttnP &P, int64_t BH) {
  constexpr int BQ = D == 64 ? 64 : 32; /* query tile of the dk/dv kernel */
  constexpr int BN = 64;                /* key tile of the dq kernel */
  static bool a1 = false, a2 = false;   /* per instantiation */
  return launch_bwd_kernels<T, D>(P, BH, k_attn_bwd_dkdv_mma<T, D, BQ, NEW>, 128,
                                  (2 * 64 + 4 * BQ) * D * (int)sizeof(T) + 4 * BQ * (int)sizeof(float),
                                  (P.S + 63) / 64, a1, k_attn_bwd_dq_mma<T, D, BN, NEW>, 128,
                                  (2 * 64 + 4 * BN) * D * (int)sizeof(T), (P.T + 63) / 64, a2);
}

/* the wgmma backward at D 64: dk/dv by NWG1 warpgroups of 64 keys (query
 * tiles of BQ), dq by NWG2 warpgroups of 64 queries (key tiles of BN) */
template <typename T, int NWG1, int BQ, int MINB1, int NWG2, int BN, int MINB2>
int launch_bwd_wg(const AttnP &P, int64_t BH) {
  constexpr int BNK = 64 * NWG1, BM = 64 * NWG2;
  static bool a1 = false, a2 = false; /* per instantiation */
  return launch_bwd_kernels<T, 64>(P, BH, k_attn_bwd_dkdv_wg<T, NWG1, BQ, MINB1, false>, NWG1 * 128,
                                   (2 * BNK + 4 * BQ) * 64 * (int)sizeof(T) + 4 * BQ * (int)sizeof(float) + 1024,
                                   (P.S + BNK - 1) / BNK, a1, k_attn_bwd_dq_wg<T, NWG2, BN, MINB2>, NWG2 * 128,
                                   (2 * BM + 4 * BN) * 64 * (int)sizeof(T) + 1024, (P.T + BM - 1) / BM, a2);
}

/* the fused wgmma backward at D 64: dk/dv and the dQ atomics by NWG
 * warpgroups of 64 keys, query tiles of 64 */
template <typename T, int NWG, int MINB> int launch_bwd_wg_fused(const AttnP &P, int64_t BH) {
  constexpr int BNK = 64 * NWG;
  static bool a1 = false, unused = false; /* per instantiation */
  return launch_bwd_kernels<T, 64>(P, BH, k_attn_bwd_dkdv_wg<T, NWG, 64, MINB, true>, NWG * 128,
                                   (3 * BNK + 4 * 64) * 64 * (int)sizeof(T) + 4 * 64 * (int)sizeof(float) + 1024,
                                   (P.S + BNK - 1) / BNK, a1, nullptr, 0, 0, 0, unused);
}

template <typename T, int D> int launch_bwd_tc(const AttnP &P, int64_t BH) {
  if constexpr (D == 64)
    if (attn_impl() == IMPL_WG) {
      /* GP_ATTN_DETERMINISTIC=1: the two kernels; else dQ by atomics in
       * the dk/dv kernel, 3 CTAs an SM (BENCHMARKS.md) */
      static const char *det = getenv("GP_ATTN_DETERMINISTIC");
      if (det && strcmp(det, "") && strcmp(det, "0")) return launch_bwd_wg<T, 1, 64, 2, 1, 64, 2>(P, BH);
      return launch_bwd_wg_fused<T, 1, 3>(P, BH);
    }
  return attn_impl() == IMPL_OLD ? launch_bwd_mma<T, D, false>(P, BH) : launch_bwd_mma<T, D, true>(P, BH);
}

template <typename T, int D> void launch_decode(const DecP &P, int64_t BH, bool vec) {
  dim3 grid((unsigned)P.nsplit, (unsigned)BH);
  if (vec) {
    GP_NOTE_LAUNCH((k_attn_decode_split<T, D, true>), 128, 0);
    k_attn_decode_split<T, D, true><<<grid, 128, 0, gp_cuda_stream()>>>(P);
  } else {
    GP_NOTE_LAUNCH((k_attn_decode_split<T, D, false>), 128, 0);
    k_attn_decode_split<T, D, false><<<grid, 128, 0, gp_cuda_stream()>>>(P);
  }
  k_attn_decode_combine<T, D><<<(unsigned)BH, D, 0, gp_cuda_stream()>>>(P);
}

} // namespace

extern "C" int gp_cuda_attn_fwd(gp_tensor *out, gp_tensor *lse, const gp_tensor *q, const gp_tensor *k,
                                const gp_tensor *v, double scale, int64_t window, int64_t n_global, int causal) {
  AttnP P = {};
  GP_TRY(fill_params(P, "attn_fwd", q, k, scale, window, n_global, causal));
  int64_t BH = q->shape[0] * q->shape[1], D = q->shape[3];
  if (BH == 0 || P.T == 0) return GP_OK;
  P.q = gp_ptr(q);
  P.k = gp_ptr(k);
  P.v = gp_ptr(v);
  P.out = gp_ptr(out);
  P.lse = (float *)gp_ptr(lse);
  P.sq = strides(q);
  P.sk = strides(k);
  P.sv = strides(v);
  P.so = strides(out);
  const bool mma = q->dtype != GP_F32 && D != 32 && P.S > 0 && rows16(q) && rows16(k) && rows16(v) && rows16(out);
  int rc = GP_OK;
  if (mma) {
    if (D == 64) {
      GP_FLOAT_SWITCH(q->dtype, T, if constexpr (!std::is_same<T, float>::value) rc = launch_fwd_tc<T, 64>(P, BH));
    } else {
      GP_FLOAT_SWITCH(q->dtype, T, if constexpr (!std::is_same<T, float>::value) rc = launch_fwd_tc<T, 128>(P, BH));
    }
  } else if (D == 32) { /* head dim 32: the plain kernels only */
    GP_FLOAT_SWITCH(q->dtype, T, rc = launch_fwd_plain<T, 32>(P, BH));
  } else if (D == 64) {
    GP_FLOAT_SWITCH(q->dtype, T, rc = launch_fwd_plain<T, 64>(P, BH));
  } else {
    GP_FLOAT_SWITCH(q->dtype, T, rc = launch_fwd_plain<T, 128>(P, BH));
  }
  GP_TRY(rc);
  return gp_cuda_check_launch("attn_fwd");
}

extern "C" int gp_cuda_attn_bwd(gp_tensor *dq, gp_tensor *dk, gp_tensor *dv, const gp_tensor *q, const gp_tensor *k,
                                const gp_tensor *v, const gp_tensor *out, const gp_tensor *lse, const gp_tensor *dout,
                                double scale, int64_t window, int64_t n_global, int causal) {
  AttnP P = {};
  GP_TRY(fill_params(P, "attn_bwd", q, k, scale, window, n_global, causal));
  int64_t BH = q->shape[0] * q->shape[1], D = q->shape[3];
  if (BH == 0 || (P.T == 0 && P.S == 0)) return GP_OK;
  P.q = gp_ptr(q);
  P.k = gp_ptr(k);
  P.v = gp_ptr(v);
  P.o = gp_ptr(out);
  P.dout = gp_ptr(dout);
  P.lse_in = (const float *)gp_ptr(lse);
  P.dq = gp_ptr(dq);
  P.dk = gp_ptr(dk);
  P.dv = gp_ptr(dv);
  P.sq = strides(q);
  P.sk = strides(k);
  P.sv = strides(v);
  P.so = strides(out);
  P.sg = strides(dout);
  P.sdq = strides(dq);
  P.sdk = strides(dk);
  P.sdv = strides(dv);
  /* a grid of 0 blocks is a launch error: T = 0 or S = 0 runs one side only
   * (the other gradients are zeros, written at their strides) */
  int rc = GP_OK;
  if (P.T == 0 || P.S == 0) {
    GP_TRY(zero_rows(P.T == 0 ? dk : dq));
    if (P.T == 0) GP_TRY(zero_rows(dv));
    return gp_cuda_check_launch("attn_bwd");
  }
  const bool mma = q->dtype != GP_F32 && D != 32 && rows16(q) && rows16(k) && rows16(v) && rows16(dout) &&
                   rows16(dq) && rows16(dk) && rows16(dv);
  if (mma) {
    if (D == 64) {
      GP_FLOAT_SWITCH(q->dtype, T, if constexpr (!std::is_same<T, float>::value) rc = launch_bwd_tc<T, 64>(P, BH));
    } else {
      GP_FLOAT_SWITCH(q->dtype, T, if constexpr (!std::is_same<T, float>::value) rc = launch_bwd_tc<T, 128>(P, BH));
    }
  } else if (D == 32) {
    GP_FLOAT_SWITCH(q->dtype, T, rc = launch_bwd<T, 32>(P, BH));
  } else if (D == 64) {
    GP_FLOAT_SWITCH(q->dtype, T, rc = launch_bwd<T, 64>(P, BH));
  } else {
    GP_FLOAT_SWITCH(q->dtype, T, rc = launch_bwd<T, 128>(P, BH));
  }
  GP_TRY(rc);
  return gp_cuda_check_launch("attn_bwd");
}

extern "C" int gp_cuda_attn_decode(gp_tensor *out, const gp_tensor *q, const gp_tensor *kcache,
                                   const gp_tensor *vcache, const gp_tensor *lens, double scale, int64_t window,
                                   int64_t n_global) {
  int64_t B = q->shape[0], H = q->shape[1], D = q->shape[2], C = kcache->shape[2], BH = B * H;
  if (BH == 0) return GP_OK;
  if (C >= INT32_MAX / 2 || BH > 65535) {
    char bk[96];
    return gp_error("attn_decode: kcache %s is too large for the GPU kernel (C < 2^30, B * H <= 65535)",
                    gp_shape_str(kcache, bk, 96));
  }
  DecP P = {};
  P.q = gp_ptr(q);
  P.kc = gp_ptr(kcache);
  P.vc = gp_ptr(vcache);
  P.lens = gp_ptr(lens);
  P.out = gp_ptr(out);
  P.lens64 = lens->dtype == GP_I64;
  P.H = (int)H;
  P.C = (int)C;
  P.scale = (float)scale;
  P.win = (int)(window > INT32_MAX / 2 ? INT32_MAX / 2 : window);
  P.ng = (int)(n_global > C ? C : n_global);
  /* enough blocks for 4 an SM, slices of at least 128 keys */
  int64_t want = ((int64_t)gp_cuda_sm_count() * 4 + BH - 1) / BH, most = (C + 127) / 128;
  int64_t nsplit = want < most ? want : most;
  if (nsplit < 1) nsplit = 1;
  int64_t chunk = (C + nsplit - 1) / nsplit;
  if (chunk < 1) chunk = 1;
  nsplit = (C + chunk - 1) / chunk;
  if (nsplit < 1) nsplit = 1;
  P.chunk = (int)chunk;
  P.nsplit = (int)nsplit;
  gp_tensor *part = 0;
  int64_t pn = BH * nsplit * (D + 2);
  GP_TRY(gp_tensor_scratch(&part, GP_F32, GP_CUDA, 1, &pn));
  P.part = (float *)gp_ptr(part);
  const bool vec = (((uintptr_t)P.q | (uintptr_t)P.kc | (uintptr_t)P.vc) & 15) == 0;
  if (D == 64) {
    GP_FLOAT_SWITCH(q->dtype, T, launch_decode<T, 64>(P, BH, vec));
  } else {
    GP_FLOAT_SWITCH(q->dtype, T, launch_decode<T, 128>(P, BH, vec));
  }
  gp_tensor_free(part);
  return gp_cuda_check_launch("attn_decode");
}
