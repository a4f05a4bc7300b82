/* rows.cuh: the engine of the per-row kernels (softmax, norms; rows.cu and fused.cu).
 *
 * A row of D elements goes to a group of tpr threads: one warp (tpr 32, eight
 * rows per 256-thread block) for short rows, the whole block (128, 256 or 512
 * threads) for longer ones. The row lives in registers: each thread holds NV
 * vectors of V elements (V = 16 bytes / element size when the rows are 16-byte
 * aligned, else 1), element index (k * tpr + lane) * V + e, so every load and
 * store of a warp is one contiguous, coalesced run. x is read once; x and out
 * use streaming cache hints so that the weights stay in L1. Reductions are warp
 * shuffles plus, for block groups, one shared-memory step (2 barriers). Rows
 * longer than 512 * 8 vectors use a fallback: a block per row, several passes.
 *
 * An op is a struct with
 *   template <int V, int NV> __device__ void run(int64_t row, int lane, int tpr, float *sh) const;
 *   __device__ void loop(int64_t row, float *sh) const;   // fallback, blockDim threads
 * and rows_launch<T>(op, rows, D, aligned) picks the configuration. */
#ifndef GP_ROWS_CUH
#define GP_ROWS_CUH
#include "../src/cuda_internal.h"

template <typename T, int V> struct alignas(sizeof(T) * V) rowvec { T v[V]; };

/* element (k, e) of this thread is in the row */
template <int V> __device__ __forceinline__ bool row_in(int k, int e, int lane, int tpr, int64_t D) {
  return ((int64_t)k * tpr + lane) * V + e < D;
}

/* the sum of (v - mu)^2 over this thread's part of a row; MASK: elements past the row left out (they hold
 * the load's fill, which is 0: without MASK they add mu^2 each, nothing when mu is 0) */
template <int V, int NV, bool MASK>
__device__ __forceinline__ float row_dev2(const float (&v)[NV * V], float mu, int lane, int tpr, int64_t D) {
  float q = 0.f;
#pragma unroll
  for (int k = 0; k < NV; k++)
#pragma unroll
    for (int e = 0; e < V; e++) {
      const float d = v[k * V + e] - mu;
      if (!MASK || row_in<V>(k, e, lane, tpr, D)) q += d * d;
    }
  return q;
}

/* load the thread's part of a row; missing elements get `fill`. STREAM: evict-first hint */
template <typename T, int V, int NV, bool STREAM = true>
__device__ __forceinline__ void row_load(const T *p, int64_t D, int lane, int tpr, float (&r)[NV * V], float fill) {
#pragma unroll
  for (int k = 0; k < NV; k++) {
    const int64_t j = ((int64_t)k * tpr + lane) * V;
    if constexpr (V > 1) {
      if (j < D) { /* D % V == 0 here */
        rowvec<T, V> t;
        if constexpr (STREAM) {
          float4 f = __ldcs(reinterpret_cast<const float4 *>(p + j));
          memcpy(&t, &f, 16);
        } else {
          t = *reinterpret_cast<const rowvec<T, V> *>(p + j);
        }
#pragma unroll
        for (int e = 0; e < V; e++) r[k * V + e] = ld(t.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < V; e++) r[k * V + e] = fill;
      }
    } else {
      r[k] = j < D ? ld(p[j]) : fill;
    }
  }
}

template <typename T, int V, int NV>
__device__ __forceinline__ void row_store(T *p, int64_t D, int lane, int tpr, const float (&r)[NV * V]) {
#pragma unroll
  for (int k = 0; k < NV; k++) {
    const int64_t j = ((int64_t)k * tpr + lane) * V;
    if (j < D) {
      if constexpr (V > 1) {
        rowvec<T, V> t;
#pragma unroll
        for (int e = 0; e < V; e++) t.v[e] = st<T>(r[k * V + e]);
        float4 f;
        memcpy(&f, &t, 16);
        __stcs(reinterpret_cast<float4 *>(p + j), f);
      } else {
        p[j] = st<T>(r[k]);
      }
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

/* sum (or max) over the group; every thread of the group gets it. sh: 32 floats.
 * tpr > 32 means the group is the whole block (all threads must call). */
template <bool MAX> __device__ __forceinline__ float group_reduce(float v, int tpr, float *sh) {
  v = MAX ? warp_max(v) : warp_sum(v);
  if (tpr <= 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = lane < nw ? sh[lane] : (MAX ? -INFINITY : 0.f);
  v = MAX ? warp_max(v) : warp_sum(v);
  __syncthreads();
  return v;
}
__device__ __forceinline__ float group_sum(float v, int tpr, float *sh) { return group_reduce<false>(v, tpr, sh); }
__device__ __forceinline__ float group_max(float v, int tpr, float *sh) { return group_reduce<true>(v, tpr, sh); }
/* two sums at once (one pair of barriers) */
__device__ __forceinline__ float2 group_sum2(float2 v, int tpr, float *sh) {
  v.x = warp_sum(v.x);
  v.y = warp_sum(v.y);
  if (tpr <= 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sh[warp] = v.x, sh[32 + warp] = v.y;
  __syncthreads();
  v.x = warp_sum(lane < nw ? sh[lane] : 0.f);
  v.y = warp_sum(lane < nw ? sh[32 + lane] : 0.f);
  __syncthreads();
  return v;
}

/* block-wide sum / max for the fallback (blockDim threads) */
__device__ __forceinline__ float block_sum(float v, float *sh) { return group_reduce<false>(v, blockDim.x, sh); }
__device__ __forceinline__ float block_max(float v, float *sh) { return group_reduce<true>(v, blockDim.x, sh); }

/* both row kernels may run in a chain of dependent launches (rows_launch given the spans written) */
template <typename Op, int V, int NV>
__global__ void __launch_bounds__(512) k_row(Op op, int64_t rows, int tpr) {
  __shared__ float sh[64];
  gp_pdl_trigger();
  gp_pdl_wait();
  const int rpb = blockDim.x / tpr, lane = threadIdx.x % tpr, g = threadIdx.x / tpr;
  for (int64_t r0 = (int64_t)blockIdx.x * rpb; r0 < rows; r0 += (int64_t)gridDim.x * rpb) {
    const int64_t row = r0 + g;
    if (row < rows) op.template run<V, NV>(row, lane, tpr, sh); /* uniform in block mode (rpb == 1) */
  }
}

template <typename Op> __global__ void __launch_bounds__(1024) k_row_loop(Op op, int64_t rows) {
  __shared__ float sh[64];
  gp_pdl_trigger();
  gp_pdl_wait();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) op.loop(row, sh);
}

static inline int pow2_at_least(int64_t n) {
  int r = 1;
  while (r < n) r <<= 1;
  return r;
}

template <typename Op, int V, int NV>
static void rows_go(const Op &op, int64_t rows, int tpr, int block, const gp_spans &wr) {
  int64_t rpb = block / tpr, blocks = (rows + rpb - 1) / rpb, cap = (int64_t)gp_cuda_sm_count() * 64;
  if (blocks > cap) blocks = cap;
  if (wr.n) gp_launch_chain(k_row<Op, V, NV>, dim3((unsigned)blocks), dim3(block), 0, {}, wr, op, rows, tpr);
  else k_row<Op, V, NV><<<(unsigned)blocks, block, 0, gp_cuda_stream()>>>(op, rows, tpr);
}

/* run op over `rows` rows of D elements; `aligned`: every row pointer the op
 * touches is 16-byte aligned when D is a multiple of the vector width */
/* the row engine's shape for rows of nvec vectors: tpr threads a row, block
 * threads a block (block / tpr rows), nv vectors a thread; false: rows too
 * long (a block loops over each) */
static inline bool rows_config(int64_t nvec, int &tpr, int &block, int &nv) {
  if (nvec <= 32 * 4) {
    tpr = 32, block = 256, nv = pow2_at_least((nvec + 31) / 32);
  } else if (nvec <= 512 * 8) {
    tpr = nvec <= 128 * 4 ? 128 : nvec <= 256 * 4 ? 256 : 512;
    block = tpr;
    nv = pow2_at_least((nvec + tpr - 1) / tpr);
  } else {
    return false;
  }
  return true;
}

/* wr: the spans the op writes, for a launch in a chain of dependent launches
 * (none: the usual launch) */
template <typename T, typename Op>
static int rows_launch(const char *name, const Op &op, int64_t rows, int64_t D, bool aligned,
                       const gp_spans &wr = gp_spans()) {
  if (rows == 0 || D == 0) return GP_OK;
  constexpr int VV = 16 / sizeof(T);
  const bool vec = aligned && D % VV == 0;
  const int64_t nvec = vec ? D / VV : D;
  int tpr, block, nv;
  if (!rows_config(nvec, tpr, block, nv)) {
    int64_t blocks = rows < (int64_t)gp_cuda_sm_count() * 4 ? rows : (int64_t)gp_cuda_sm_count() * 4;
    if (wr.n) gp_launch_chain(k_row_loop<Op>, dim3((unsigned)blocks), dim3(1024), 0, {}, wr, op, rows);
    else k_row_loop<Op><<<(unsigned)blocks, 1024, 0, gp_cuda_stream()>>>(op, rows);
    return gp_cuda_check_launch(name);
  }
#define GP_ROWS_NV(V)                                             \
  switch (nv) {                                                   \
    case 1: rows_go<Op, V, 1>(op, rows, tpr, block, wr); break;       \
    case 2: rows_go<Op, V, 2>(op, rows, tpr, block, wr); break;       \
    case 4: rows_go<Op, V, 4>(op, rows, tpr, block, wr); break;       \
    default: rows_go<Op, V, 8>(op, rows, tpr, block, wr); break;      \
  }
  if (vec) {
    GP_ROWS_NV(VV)
  } else {
    GP_ROWS_NV(1)
  }
#undef GP_ROWS_NV
  return gp_cuda_check_launch(name);
}

static inline bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }

#endif
