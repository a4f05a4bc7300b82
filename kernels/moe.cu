/* moe.cu: Mixture-of-Experts routing and token permutation on the GPU.
 *
 *  - router: one warp per token row (E <= 256: eight logits per lane):
 *    softmax, then K rounds of a warp arg-max over the logits not yet taken
 *    (ties to the lower index, NaN ranked as -inf), renormalized weights.
 *  - permute: one block of 1024 threads walks the assignments in chunks of
 *    1024; within a warp __match_any_sync gives each assignment its rank
 *    among equal experts, per-warp counts are prefix-summed per expert in
 *    shared memory, and a running total per expert carries across chunks.
 *    The ranks are therefore the stable ones (assignment order kept within
 *    an expert) and the result is deterministic.
 *  - gather / combine / combine_dw: rows of C elements in 16-byte vectors
 *    when C and the pointers allow, f32 arithmetic, fixed summation order.
 * Indices out of range are treated like -1 (no memory outside a tensor is
 * touched; the CPU reference raises instead). */
#include <limits.h>

#include "../src/cuda_internal.h"

#define MOE_FULL 0xffffffffu

template <typename T, int V> struct alignas(sizeof(T) * V) moevec { T v[V]; };

static inline bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }

__device__ __forceinline__ float moe_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(MOE_FULL, v, o);
  return v;
}
__device__ __forceinline__ float moe_warp_max(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(MOE_FULL, v, o));
  return v;
}

/* ---- router ---- */
template <typename T>
__global__ void k_moe_router(T *__restrict__ w, int32_t *__restrict__ ids, T *__restrict__ probs,
                             const T *__restrict__ logits, int64_t N, int E, int K, int renorm) {
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= N) return; /* a whole warp leaves together */
  const T *l = logits + row * E;
  float v[8], key[8], p[8];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const int e = lane + 32 * i;
    v[i] = e < E ? ld(l[e]) : -INFINITY;
    key[i] = v[i] == v[i] ? v[i] : -INFINITY;
    m = fmaxf(m, v[i]); /* NaN ignored, as the CPU's v > m */
  }
  m = moe_warp_max(m);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    p[i] = lane + 32 * i < E ? expf(v[i] - m) : 0.f;
    s += p[i];
  }
  s = moe_warp_sum(s);
  const float inv = 1.f / s;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const int e = lane + 32 * i;
    p[i] *= inv;
    if (e < E) probs[row * E + e] = st<T>(p[i]);
  }
  unsigned taken = 0;
  float tot = 0.f;
  int sel[8];
  float selp[8];
#pragma unroll
  for (int j = 0; j < 8; j++) {
    if (j >= K) break;
    float bv = -INFINITY, bp = 0.f;
    int bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int e = lane + 32 * i;
      if (e < E && !((taken >> i) & 1u) && (bi == INT_MAX || key[i] > bv)) {
        bv = key[i];
        bi = e;
        bp = p[i];
      }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
      const float ov = __shfl_xor_sync(MOE_FULL, bv, o), op = __shfl_xor_sync(MOE_FULL, bp, o);
      const int oi = __shfl_xor_sync(MOE_FULL, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
        bp = op;
      }
    }
    if (lane == (bi & 31)) taken |= 1u << (bi >> 5);
    sel[j] = bi;
    selp[j] = bp;
    tot += bp;
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
      if (j >= K) break;
      ids[row * K + j] = sel[j];
      w[row * K + j] = st<T>(renorm ? selp[j] / tot : selp[j]);
    }
  }
}

extern "C" int gp_cuda_moe_router(gp_tensor *w, gp_tensor *ids, gp_tensor *probs, const gp_tensor *logits, int64_t n,
                                  int e, int k, int renorm) {
  if (n == 0) return GP_OK;
  const int block = 128, rows = block / 32;
  const int64_t grid = (n + rows - 1) / rows;
  if (grid > INT_MAX) return gp_error("moe_router: %lld rows are too many", (long long)n);
  cudaStream_t s = gp_cuda_stream();
  GP_FLOAT_SWITCH(logits->dtype, T, {
    GP_NOTE_LAUNCH(k_moe_router<T>, block, 0);
    k_moe_router<T><<<(unsigned)grid, block, 0, s>>>((T *)gp_ptr(w), (int32_t *)gp_ptr(ids), (T *)gp_ptr(probs),
                                                     (const T *)gp_ptr(logits), n, e, k, renorm);
  });
  return gp_cuda_check_launch("moe_router");
}

template <typename T>
__global__ void k_moe_router_bwd(T *__restrict__ dl, const T *__restrict__ probs, const int32_t *__restrict__ ids,
                                 const T *__restrict__ dw, const T *__restrict__ dprobs, int64_t N, int E, int K,
                                 int renorm) {
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= N) return;
  const T *pr = probs + row * E;
  float p[8], dp[8];
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const int e = lane + 32 * i;
    p[i] = e < E ? ld(pr[e]) : 0.f;
    dp[i] = e < E ? ld(dprobs[row * E + e]) : 0.f;
  }
  const int32_t *id = ids + row * K;
  const T *g = dw + row * K;
  float s = 0.f, c = 0.f;
  if (renorm) {
    for (int j = 0; j < K; j++) {
      const int e = id[j];
      if (e >= 0 && e < E) s += ld(pr[e]);
    }
    for (int j = 0; j < K; j++) {
      const int e = id[j];
      if (e >= 0 && e < E) c += ld(g[j]) * ld(pr[e]) / s;
    }
  }
  for (int j = 0; j < K; j++) {
    const int e = id[j];
    if (e < 0 || e >= E || (e & 31) != lane) continue;
    const float add = renorm ? (ld(g[j]) - c) / s : ld(g[j]);
#pragma unroll
    for (int i = 0; i < 8; i++)
      if (i == (e >> 5)) dp[i] += add;
  }
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < 8; i++) dot += p[i] * dp[i];
  dot = moe_warp_sum(dot);
#pragma unroll
  for (int i = 0; i < 8; i++) {
    const int e = lane + 32 * i;
    if (e < E) dl[row * E + e] = st<T>(p[i] * (dp[i] - dot));
  }
}

extern "C" int gp_cuda_moe_router_backward(gp_tensor *dlogits, const gp_tensor *probs, const gp_tensor *ids,
                                           const gp_tensor *dw, const gp_tensor *dprobs, int64_t n, int e, int k,
                                           int renorm) {
  if (n == 0) return GP_OK;
  const int block = 128, rows = block / 32;
  const int64_t grid = (n + rows - 1) / rows;
  if (grid > INT_MAX) return gp_error("moe_router_backward: %lld rows are too many", (long long)n);
  cudaStream_t s = gp_cuda_stream();
  GP_FLOAT_SWITCH(probs->dtype, T, {
    GP_NOTE_LAUNCH(k_moe_router_bwd<T>, block, 0);
    k_moe_router_bwd<T><<<(unsigned)grid, block, 0, s>>>((T *)gp_ptr(dlogits), (const T *)gp_ptr(probs),
                                                         (const int32_t *)gp_ptr(ids), (const T *)gp_ptr(dw),
                                                         (const T *)gp_ptr(dprobs), n, e, k, renorm);
  });
  return gp_cuda_check_launch("moe_router_backward");
}

/* ---- histogram and permutation ---- */
__global__ void k_moe_histogram(int32_t *__restrict__ counts, const int32_t *__restrict__ ids, int64_t A, int E) {
  __shared__ int h[256];
  for (int e = threadIdx.x; e < E; e += blockDim.x) h[e] = 0;
  __syncthreads();
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < A; i += (int64_t)gridDim.x * blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < E) atomicAdd(&h[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (h[e]) atomicAdd(&counts[e], h[e]);
}

extern "C" int gp_cuda_moe_histogram(gp_tensor *counts, const gp_tensor *ids, int64_t a, int e) {
  cudaStream_t s = gp_cuda_stream();
  cudaError_t err = cudaMemsetAsync(gp_ptr(counts), 0, (size_t)e * sizeof(int32_t), s);
  if (err != cudaSuccess) return gp_error("moe_histogram: CUDA error: %s", cudaGetErrorString(err));
  if (a == 0) return GP_OK;
  GP_NOTE_LAUNCH(k_moe_histogram, 256, 0);
  k_moe_histogram<<<gp_grid(a, 256), 256, 0, s>>>((int32_t *)gp_ptr(counts), (const int32_t *)gp_ptr(ids), a, e);
  return gp_cuda_check_launch("moe_histogram");
}

__global__ void __launch_bounds__(1024)
    k_moe_permute(int32_t *__restrict__ dest, int32_t *__restrict__ src, int32_t *__restrict__ counts,
                  const int32_t *__restrict__ ids, int64_t A, int E, int64_t cap) {
  __shared__ int run[256];
  __shared__ int wc[32][256];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned lt = (1u << lane) - 1u;
  if (tid < E) run[tid] = 0;
  for (int64_t base = 0; base < A; base += 1024) {
    for (int q = tid; q < 32 * 256; q += 1024) (&wc[0][0])[q] = 0;
    __syncthreads();
    const int64_t i = base + tid;
    const int e = i < A ? ids[i] : -1;
    const bool ok = e >= 0 && e < E;
    const unsigned mask = __match_any_sync(MOE_FULL, ok ? e : -1);
    const int lr = __popc(mask & lt);
    if (ok && lr == 0) wc[warp][e] = __popc(mask);
    __syncthreads();
    if (tid < E) { /* exclusive prefix over the warps, on top of the running total */
      int s = run[tid];
      for (int q = 0; q < 32; q++) {
        const int c = wc[q][tid];
        wc[q][tid] = s;
        s += c;
      }
      run[tid] = s;
    }
    __syncthreads();
    if (i < A) {
      int32_t d = -1;
      if (ok) {
        const int64_t r = (int64_t)wc[warp][e] + lr;
        if (r < cap) {
          d = (int32_t)(e * cap + r);
          src[d] = (int32_t)i;
        }
      }
      dest[i] = d;
    }
    __syncthreads();
  }
  __syncthreads();
  if (tid < E) counts[tid] = run[tid];
}

extern "C" int gp_cuda_moe_permute(gp_tensor *dest, gp_tensor *src, gp_tensor *counts, const gp_tensor *ids, int64_t a,
                                   int e, int64_t cap) {
  cudaStream_t s = gp_cuda_stream();
  const int64_t S = (int64_t)e * cap;
  cudaError_t err = cudaMemsetAsync(gp_ptr(src), 0xff, (size_t)S * sizeof(int32_t), s); /* -1 everywhere */
  if (err != cudaSuccess) return gp_error("moe_permute: CUDA error: %s", cudaGetErrorString(err));
  GP_NOTE_LAUNCH(k_moe_permute, 1024, 0);
  k_moe_permute<<<1, 1024, 0, s>>>((int32_t *)gp_ptr(dest), (int32_t *)gp_ptr(src), (int32_t *)gp_ptr(counts),
                                   (const int32_t *)gp_ptr(ids), a, e, cap);
  return gp_cuda_check_launch("moe_permute");
}

/* ---- gather, combine and combine_dw over rows of C ---- */
template <typename T, int V>
__global__ void k_moe_gather(T *__restrict__ out, const T *__restrict__ x, const int32_t *__restrict__ src,
                             const T *__restrict__ w, int64_t S, int64_t C, int64_t NK, int64_t K) {
  typedef moevec<T, V> VT;
  const int64_t cv = C / V;
  for (int64_t s = blockIdx.x; s < S; s += gridDim.x) {
    const int64_t a = src[s];
    const bool ok = a >= 0 && a < NK;
    const float sc = ok ? ld(w[a]) : 0.f;
    const VT *xr = reinterpret_cast<const VT *>(x + (ok ? (a / K) * C : 0));
    VT *o = reinterpret_cast<VT *>(out + s * C);
    for (int64_t c = threadIdx.x; c < cv; c += blockDim.x) {
      VT r;
      if (ok) {
        const VT v = xr[c];
#pragma unroll
        for (int q = 0; q < V; q++) r.v[q] = st<T>(sc * ld(v.v[q]));
      } else {
#pragma unroll
        for (int q = 0; q < V; q++) r.v[q] = st<T>(0.f);
      }
      o[c] = r;
    }
  }
}

template <typename T, int V>
__global__ void k_moe_combine(T *__restrict__ out, const T *__restrict__ ys, const int32_t *__restrict__ dest,
                              const T *__restrict__ w, int64_t N, int64_t C, int64_t S, int64_t K) {
  typedef moevec<T, V> VT;
  const int64_t cv = C / V;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    VT *o = reinterpret_cast<VT *>(out + n * C);
    for (int64_t c = threadIdx.x; c < cv; c += blockDim.x) {
      float acc[V];
#pragma unroll
      for (int q = 0; q < V; q++) acc[q] = 0.f;
      for (int64_t j = 0; j < K; j++) {
        const int64_t s = dest[n * K + j];
        if (s < 0 || s >= S) continue;
        const float wj = ld(w[n * K + j]);
        const VT v = reinterpret_cast<const VT *>(ys + s * C)[c];
#pragma unroll
        for (int q = 0; q < V; q++) acc[q] += wj * ld(v.v[q]);
      }
      VT r;
#pragma unroll
      for (int q = 0; q < V; q++) r.v[q] = st<T>(acc[q]);
      o[c] = r;
    }
  }
}

template <typename T, int V>
__global__ void k_moe_combine_dw(T *__restrict__ dw, const T *__restrict__ dout, const T *__restrict__ ys,
                                 const int32_t *__restrict__ dest, int64_t N, int64_t C, int64_t S, int64_t K) {
  typedef moevec<T, V> VT;
  const int lane = threadIdx.x & 31;
  const int64_t cv = C / V, nw = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t q = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); q < N * K; q += nw) {
    const int64_t n = q / K, s = dest[q];
    float acc = 0.f;
    if (s >= 0 && s < S) {
      const VT *a = reinterpret_cast<const VT *>(dout + n * C), *b = reinterpret_cast<const VT *>(ys + s * C);
      for (int64_t c = lane; c < cv; c += 32) {
        const VT u = a[c], v = b[c];
#pragma unroll
        for (int e = 0; e < V; e++) acc += ld(u.v[e]) * ld(v.v[e]);
      }
    }
    acc = moe_warp_sum(acc);
    if (lane == 0) dw[q] = st<T>(acc);
  }
}

/* the row kernels with V = 16 / sizeof(T) when C and every pointer allow, else 1 */
#define MOE_ROWS_LAUNCH(KERNEL, grid, block, al, C, ...)                                        \
  GP_FLOAT_SWITCH(dt, T, {                                                                      \
    constexpr int V = 16 / sizeof(T);                                                           \
    if ((al) && (C) % V == 0) {                                                                 \
      GP_NOTE_LAUNCH((KERNEL<T, V>), block, 0);                                                 \
      KERNEL<T, V><<<grid, block, 0, gp_cuda_stream()>>>(__VA_ARGS__);                           \
    } else {                                                                                    \
      GP_NOTE_LAUNCH((KERNEL<T, 1>), block, 0);                                                 \
      KERNEL<T, 1><<<grid, block, 0, gp_cuda_stream()>>>(__VA_ARGS__);                           \
    }                                                                                           \
  })

static unsigned rows_grid(int64_t rows) {
  const int64_t cap = (int64_t)gp_cuda_sm_count() * 16;
  return (unsigned)(rows < 1 ? 1 : rows < cap ? rows : cap);
}

extern "C" int gp_cuda_moe_gather(gp_tensor *out, const gp_tensor *x, const gp_tensor *src, const gp_tensor *w,
                                  int64_t s, int64_t c, int64_t n, int64_t k) {
  if (s == 0 || c == 0) return GP_OK;
  const int dt = out->dtype;
  const bool al = al16(gp_ptr(out)) && al16(gp_ptr(x));
  MOE_ROWS_LAUNCH(k_moe_gather, rows_grid(s), 128, al, c, (T *)gp_ptr(out), (const T *)gp_ptr(x),
                  (const int32_t *)gp_ptr(src), (const T *)gp_ptr(w), s, c, n * k, k);
  return gp_cuda_check_launch("moe_gather");
}

extern "C" int gp_cuda_moe_combine(gp_tensor *out, const gp_tensor *ys, const gp_tensor *dest, const gp_tensor *w,
                                   int64_t n, int64_t c, int64_t s, int64_t k) {
  if (n == 0 || c == 0) return GP_OK;
  const int dt = out->dtype;
  const bool al = al16(gp_ptr(out)) && al16(gp_ptr(ys));
  MOE_ROWS_LAUNCH(k_moe_combine, rows_grid(n), 128, al, c, (T *)gp_ptr(out), (const T *)gp_ptr(ys),
                  (const int32_t *)gp_ptr(dest), (const T *)gp_ptr(w), n, c, s, k);
  return gp_cuda_check_launch("moe_combine");
}

extern "C" int gp_cuda_moe_combine_dw(gp_tensor *dw, const gp_tensor *dout, const gp_tensor *ys, const gp_tensor *dest,
                                      int64_t n, int64_t c, int64_t s, int64_t k) {
  if (n * k == 0) return GP_OK;
  const int dt = dw->dtype;
  const bool al = al16(gp_ptr(dout)) && al16(gp_ptr(ys));
  MOE_ROWS_LAUNCH(k_moe_combine_dw, rows_grid((n * k + 7) / 8), 256, al, c, (T *)gp_ptr(dw), (const T *)gp_ptr(dout),
                  (const T *)gp_ptr(ys), (const int32_t *)gp_ptr(dest), n, c, s, k);
  return gp_cuda_check_launch("moe_combine_dw");
}
