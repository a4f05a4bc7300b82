/* sample.cu: token sampling on the GPU, sort-free. One block per row; the row
 * is re-read from L1/L2 on every pass (it is not copied):
 *   1. max key (order-preserving 32-bit key of the float logit);
 *   2. top-k: bisection over keys on the count of {key >= t} (<= 32 passes);
 *   3. min-p: a threshold from the max; top-p: bisection over keys on the
 *      mass of {key >= t} (<= 32 passes);
 *   4. one pass that writes probs and finds the draw: tiles of blockDim
 *      elements in index order, a block scan per tile, the first element whose
 *      running mass exceeds u * (kept mass).
 * Every reduction is a fixed-order block reduction whose result is the same
 * in every thread, so the bisections stay uniform across the block and a
 * rerun gives the same bits. Semantics and the CPU reference: sample.c. */
#include "gp_hd.h"
#include "rows.cuh"

__device__ __forceinline__ uint32_t fkey(float f) {
  uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unkey(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

/* max (MAX) or min over the block of an integer; every thread gets it. sh: 32 entries */
template <bool MAX, typename V> __device__ __forceinline__ V block_ext(V v, V *sh) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    V o = __shfl_xor_sync(0xffffffffu, v, m);
    v = MAX ? (o > v ? o : v) : (o < v ? o : v);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = sh[lane < nw ? lane : 0];
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    V o = __shfl_xor_sync(0xffffffffu, v, m);
    v = MAX ? (o > v ? o : v) : (o < v ? o : v);
  }
  __syncthreads();
  return v;
}

/* inclusive scan over the block in thread order; *tot gets the block total (the same in every thread) */
__device__ __forceinline__ float block_scan(float v, float *sh, float *tot) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    float t = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += t;
  }
  if (lane == 31) sh[warp] = v;
  __syncthreads();
  float before = 0.f, all = 0.f;
  for (int w = 0; w < nw; w++) {
    if (w == warp) before = all;
    all += sh[w];
  }
  __syncthreads();
  *tot = all;
  return before + v;
}

template <typename T> struct SampleRow {
  const T *x;
  int64_t V;
  float m, inv_t;
  __device__ __forceinline__ float val(int64_t j) const {
    float v = ld(x[j]);
    return v == v ? v : -INFINITY;
  }
  __device__ float count_ge(uint32_t t, float *sh) const {
    float c = 0.f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) c += fkey(val(j)) >= t ? 1.f : 0.f;
    return block_sum(c, sh);
  }
  __device__ float mass_ge(uint32_t t, float *sh) const {
    float s = 0.f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      float v = val(j);
      if (fkey(v) >= t) s += expf((v - m) * inv_t);
    }
    return block_sum(s, sh);
  }
};

template <typename T>
__global__ void __launch_bounds__(512) k_sample(int64_t *out, T *probs, const T *logits, int64_t V, uint64_t seed,
                                                uint64_t offset, float inv_t, int greedy, int64_t top_k, float top_p,
                                                double lmin, const unsigned long long *rng) {
  gp_rng_resolve(rng, seed, offset);
  __shared__ float shf[32];
  __shared__ uint32_t shu[32];
  __shared__ long long shi[32];
  const int64_t r = blockIdx.x;
  SampleRow<T> row{logits + r * V, V, 0.f, inv_t};
  T *p = probs + r * V;
  uint32_t hi = 0;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) hi = max(hi, fkey(row.val(j)));
  hi = block_ext<true>(hi, shu);
  row.m = unkey(hi);
  if (greedy || !(row.m > -INFINITY && row.m < INFINITY)) {
    long long am = V;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
      if (fkey(row.val(j)) == hi && j < am) am = j;
    am = block_ext<false>(am, shi);
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) p[j] = st<T>(j == am ? 1.f : 0.f);
    if (threadIdx.x == 0) out[r] = am < V ? am : 0;
    return;
  }
  uint32_t tau = 0;
  if (top_k > 0 && top_k < V) {
    uint32_t lo = 0, h = hi;
    while (lo < h) {
      uint32_t mid = lo + (uint32_t)(((uint64_t)h - lo + 1) / 2);
      if (row.count_ge(mid, shf) >= (float)top_k) lo = mid;
      else h = mid - 1;
    }
    tau = lo;
  }
  if (lmin > -INFINITY) {
    uint32_t t = fkey((float)((double)row.m + lmin));
    if (t > hi) t = hi;
    if (t > tau) tau = t;
  }
  if (top_p < 1.f) {
    const float target = top_p * row.mass_ge(tau, shf);
    uint32_t lo = tau, h = hi;
    while (lo < h) {
      uint32_t mid = lo + (uint32_t)(((uint64_t)h - lo + 1) / 2);
      if (row.mass_ge(mid, shf) >= target) lo = mid;
      else h = mid - 1;
    }
    tau = lo;
  }
  const float s = row.mass_ge(tau, shf), rs = 1.f / s;
  const float thr = gp_u01(gp_philox(seed, offset + (uint64_t)r / 4).v[r % 4]) * s;
  float acc = 0.f;
  long long pick = -1, last = -1;
  for (int64_t base = 0; base < V; base += blockDim.x) {
    const int64_t j = base + threadIdx.x;
    float w = 0.f;
    if (j < V) {
      float v = row.val(j);
      if (fkey(v) >= tau) w = expf((v - row.m) * inv_t);
      p[j] = st<T>(w * rs);
      if (w > 0.f) last = j;
    }
    float tot, incl = block_scan(w, shf, &tot);
    if (pick < 0 && acc + tot > thr) { /* uniform: acc, tot and thr are the same in every thread */
      long long c = (w > 0.f && acc + incl > thr) ? j : (long long)V;
      c = block_ext<false>(c, shi);
      if (c < V) pick = c;
    }
    acc += tot;
  }
  last = block_ext<true>(last, shi);
  if (threadIdx.x == 0) out[r] = pick >= 0 ? pick : (last >= 0 ? last : 0);
}

extern "C" int gp_cuda_sample(gp_tensor *out, gp_tensor *probs, const gp_tensor *logits, uint64_t seed, uint64_t offset,
                              double temperature, int64_t top_k, double top_p, double min_p, double lmin) {
  (void)min_p;
  int64_t n = logits->shape[0], v = logits->shape[1];
  if (n == 0) return GP_OK;
  if (n > 2147483647) return gp_error("sample: %lld rows is more than one launch handles", (long long)n);
  const int block = v >= 8192 ? 512 : v >= 1024 ? 256 : 128;
  const int greedy = temperature == 0;
  const float inv_t = greedy ? 1.f : (float)(1.0 / temperature);
  GP_FLOAT_SWITCH(logits->dtype, T, GP_NOTE_LAUNCH(k_sample<T>, block, 0);
                  k_sample<T><<<(unsigned)n, block, 0, gp_cuda_stream()>>>(
                      (int64_t *)gp_ptr(out), (T *)gp_ptr(probs), (const T *)gp_ptr(logits), v, seed, offset, inv_t,
                      greedy, top_k, (float)top_p, lmin, gp_cuda_rng_slot()));
  return gp_cuda_check_launch("sample");
}

/* the penalty: a device-to-device copy of the logits, then one block per row
 * rewrites the ids of its history (duplicates write the same value; ids
 * outside [0, V) are skipped, lens is clamped to [0, L]) */
template <typename T>
__global__ void k_rep_penalty(T *o, const T *x, const int64_t *h, const int64_t *lens, int64_t V, int64_t L, float pen) {
  const int64_t r = blockIdx.x;
  int64_t n = lens[r];
  n = n < 0 ? 0 : n > L ? L : n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t id = h[r * L + i];
    if (id < 0 || id >= V) continue;
    const float v = ld(x[r * V + id]);
    o[r * V + id] = st<T>(v > 0.f ? v / pen : v * pen);
  }
}

extern "C" int gp_cuda_repetition_penalty(gp_tensor *out, const gp_tensor *logits, const gp_tensor *history,
                                          const gp_tensor *lens, double penalty) {
  int64_t n = logits->shape[0], v = logits->shape[1], l = history->shape[1];
  if (n * v == 0) return GP_OK;
  if (n > 2147483647) return gp_error("repetition_penalty: %lld rows is more than one launch handles", (long long)n);
  if (cudaMemcpyAsync(gp_ptr(out), gp_ptr(logits), (size_t)(n * v) * (size_t)gp_elsize(out->dtype),
                      cudaMemcpyDeviceToDevice, gp_cuda_stream()) != cudaSuccess)
    return gp_cuda_check_launch("repetition_penalty (copy)");
  if (l == 0) return GP_OK;
  GP_FLOAT_SWITCH(logits->dtype, T, GP_NOTE_LAUNCH(k_rep_penalty<T>, 128, 0);
                  k_rep_penalty<T><<<(unsigned)n, 128, 0, gp_cuda_stream()>>>(
                      (T *)gp_ptr(out), (const T *)gp_ptr(logits), (const int64_t *)gp_ptr(history),
                      (const int64_t *)gp_ptr(lens), v, l, (float)penalty));
  return gp_cuda_check_launch("repetition_penalty");
}
