/* diversity.cu: set diversity (mean pairwise cosine distance) forward and
 * backward, one block per set, f32 accumulation; distinct-n over token ids.
 *
 * With u_i = x_i / max(|x_i|, eps) and U = sum_i u_i,
 *   sum_{i<j} u_i . u_j = (|U|^2 - sum_i |u_i|^2) / 2,
 * so a set costs two reads of its N x D values instead of N^2 / 2 dot products:
 * pass 1 (a warp per row) finds 1/max(|x_i|, eps) into shared memory; pass 2
 * (a thread per column) forms U_j and sums U_j^2. The backward adds pass 3 (a
 * warp per row): u_i . U, then dx_i = -g c / max(|x_i|, eps) (U - u_i (u_i . U))
 * (U - u_i when the norm was clamped), c = 2 / (N (N - 1)). */
#include "../src/cuda_internal.h"

#include <math.h>
#include "diversity.h"

static __device__ __forceinline__ float dv_warp_sum(float v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

/* sum over the block (blockDim.x a multiple of 32), returned to every thread */
static __device__ __forceinline__ float dv_block_sum(float v, float *red) {
  v = dv_warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < nw ? red[lane] : 0.f;
  v = dv_warp_sum(v);
  __syncthreads();
  return v;
}

/* pass 1: rn[i] = 1 / max(|x_i|, eps), cl[i] = 1 when clamped (cl may be null);
 * returns (to lane 0 of each warp, 0 elsewhere) its rows' sum of |u_i|^2 */
template <typename T>
static __device__ __forceinline__ float dv_norms(const T *__restrict__ xs, int N, int D, float eps, float *rn, float *cl) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  float su = 0.f;
  for (int i = warp; i < N; i += nw) {
    float q = 0.f;
#pragma unroll 4
    for (int j = lane; j < D; j += 32) {
      const float v = ld(xs[(int64_t)i * D + j]);
      q += v * v;
    }
    q = dv_warp_sum(q);
    const float nrm = sqrtf(q), r = 1.f / fmaxf(nrm, eps);
    if (lane == 0) {
      rn[i] = r;
      if (cl) cl[i] = nrm > eps ? 0.f : 1.f;
      su += q * r * r;
    }
  }
  return su;
}

/* sum_i x[i, j] * rn[i] for column j: four independent chains keep loads in flight */
template <typename T>
static __device__ __forceinline__ float dv_col(const T *__restrict__ xs, int N, int D, int j, const float *rn) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  int i = 0;
  for (; i + 4 <= N; i += 4) {
    a0 += ld(xs[(int64_t)i * D + j]) * rn[i];
    a1 += ld(xs[(int64_t)(i + 1) * D + j]) * rn[i + 1];
    a2 += ld(xs[(int64_t)(i + 2) * D + j]) * rn[i + 2];
    a3 += ld(xs[(int64_t)(i + 3) * D + j]) * rn[i + 3];
  }
  for (; i < N; i++) a0 += ld(xs[(int64_t)i * D + j]) * rn[i];
  return (a0 + a1) + (a2 + a3);
}

template <typename T>
__global__ void __launch_bounds__(512) k_set_div(T *__restrict__ out, const T *__restrict__ x, int N, int D, float eps) {
  extern __shared__ float sh[]; /* rn[N] */
  __shared__ float red[32];
  const int s = blockIdx.x;
  const T *xs = x + (int64_t)s * N * D;
  if (N < 2) {
    if (threadIdx.x == 0) out[s] = st<T>(0.f);
    return;
  }
  float acc = -dv_norms<T>(xs, N, D, eps, sh, nullptr);
  __syncthreads();
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    const float u = dv_col<T>(xs, N, D, j, sh);
    acc += u * u;
  }
  const float p = dv_block_sum(acc, red); /* |U|^2 - sum |u_i|^2 = 2 sum_{i<j} cos_ij */
  if (threadIdx.x == 0) out[s] = st<T>(1.f - p / ((float)N * (float)(N - 1)));
}

template <typename T>
__global__ void __launch_bounds__(512)
    k_set_div_bwd(T *__restrict__ dx, const T *__restrict__ x, const T *__restrict__ dout, int N, int D, float eps) {
  extern __shared__ float sh[]; /* rn[N], cl[N], U[D] */
  float *rn = sh, *cl = sh + N, *U = sh + 2 * N;
  const int s = blockIdx.x;
  const int64_t base = (int64_t)s * N * D;
  const T *xs = x + base;
  T *g = dx + base;
  if (N < 2) {
    for (int k = threadIdx.x; k < N * D; k += blockDim.x) g[k] = st<T>(0.f);
    return;
  }
  dv_norms<T>(xs, N, D, eps, rn, cl);
  __syncthreads();
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    U[j] = dv_col<T>(xs, N, D, j, rn);
  }
  __syncthreads();
  const float c = 2.f / ((float)N * (float)(N - 1)), go = ld(dout[s]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int i = warp; i < N; i += nw) {
    const T *xi = xs + (int64_t)i * D;
    const float r = rn[i];
    float d = 0.f;
    for (int j = lane; j < D; j += 32) d += ld(xi[j]) * U[j];
    const float uU = dv_warp_sum(d) * r;       /* u_i . U */
    const float proj = cl[i] != 0.f ? 1.f : uU; /* clamped: u_i is x_i / eps, no projection */
    const float k = -go * c * r;
    for (int j = lane; j < D; j += 32) g[(int64_t)i * D + j] = st<T>(k * (U[j] - ld(xi[j]) * r * proj));
  }
}

/* shared floats of a block: the forward needs N, the backward 2N + D */
static const int64_t DV_MAX_SHARED_FLOATS = 48 * 1024 / 4;

static int dv_block(int64_t D) {
  if (D >= 512) return 512;
  int b = (int)((D + 31) / 32 * 32);
  return b < 64 ? 64 : b;
}

extern "C" int gp_cuda_set_diversity(gp_tensor *out, const gp_tensor *x, double eps) {
  const int64_t S = x->shape[0], N = x->shape[1], D = x->shape[2];
  char sb[96];
  if (S == 0) return GP_OK;
  if (N > DV_MAX_SHARED_FLOATS || N * D > INT32_MAX)
    return gp_error("set_diversity: x is %s; the CUDA kernel takes at most %lld vectors per set", gp_shape_str(x, sb, sizeof sb),
                    (long long)DV_MAX_SHARED_FLOATS);
  if (S > INT32_MAX) return gp_error("set_diversity: x is %s: too many sets for one launch", gp_shape_str(x, sb, sizeof sb));
  const int block = dv_block(D);
  const size_t smem = sizeof(float) * (size_t)(N > 0 ? N : 1);
  cudaStream_t st = gp_cuda_stream();
  GP_FLOAT_SWITCH(x->dtype, T, {
    GP_NOTE_LAUNCH(k_set_div<T>, block, (int)smem);
    k_set_div<T><<<(unsigned)S, block, smem, st>>>((T *)gp_ptr(out), (const T *)gp_ptr(x), (int)N, (int)D, (float)eps);
  });
  return gp_cuda_check_launch("set_diversity");
}

extern "C" int gp_cuda_set_diversity_backward(gp_tensor *dx, const gp_tensor *x, const gp_tensor *dout, double eps) {
  const int64_t S = x->shape[0], N = x->shape[1], D = x->shape[2];
  char sb[96];
  if (S == 0 || N * D == 0) return GP_OK;
  if (2 * N + D > DV_MAX_SHARED_FLOATS || N * D > INT32_MAX)
    return gp_error("set_diversity_backward: x is %s; the CUDA kernel needs 2N + D <= %lld", gp_shape_str(x, sb, sizeof sb),
                    (long long)DV_MAX_SHARED_FLOATS);
  if (S > INT32_MAX) return gp_error("set_diversity_backward: x is %s: too many sets for one launch", gp_shape_str(x, sb, sizeof sb));
  const int block = dv_block(D);
  const size_t smem = sizeof(float) * (size_t)(2 * N + D);
  cudaStream_t st = gp_cuda_stream();
  GP_FLOAT_SWITCH(x->dtype, T, {
    GP_NOTE_LAUNCH(k_set_div_bwd<T>, block, (int)smem);
    k_set_div_bwd<T><<<(unsigned)S, block, smem, st>>>((T *)gp_ptr(dx), (const T *)gp_ptr(x), (const T *)gp_ptr(dout),
                                                        (int)N, (int)D, (float)eps);
  });
  return gp_cuda_check_launch("set_diversity_backward");
}

/* distinct-n: a block per set, a thread per (sequence, position) n-gram; lens
 * are clamped to [0, L] (the CPU reference raises on them instead) */
template <typename TT, typename TL>
__global__ void k_distinct_n(float *__restrict__ out, const TT *__restrict__ tok, const TL *__restrict__ lens, int N,
                             int L, int g) {
  __shared__ float red[32];
  const int s = blockIdx.x;
  const TT *ts = tok + (int64_t)s * N * L;
  const TL *ls = lens + (int64_t)s * N;
  float total = 0.f, distinct = 0.f;
  for (int k = threadIdx.x; k < N * L; k += blockDim.x) {
    const int i = k / L, p = k - i * L;
    const int64_t li = min((int64_t)L, max((int64_t)0, (int64_t)ls[i]));
    if (p + g > li) continue;
    total += 1.f;
    bool seen = false;
    for (int i2 = 0; i2 <= i && !seen; i2++) {
      const int64_t l2 = min((int64_t)L, max((int64_t)0, (int64_t)ls[i2]));
      for (int p2 = 0; p2 + g <= l2 && !seen; p2++) {
        if (i2 == i && p2 >= p) break;
        bool same = true;
        for (int q = 0; q < g && same; q++) same = (int64_t)ts[(int64_t)i * L + p + q] == (int64_t)ts[(int64_t)i2 * L + p2 + q];
        seen = same;
      }
    }
    if (!seen) distinct += 1.f;
  }
  total = dv_block_sum(total, red);
  distinct = dv_block_sum(distinct, red);
  if (threadIdx.x == 0) out[s] = total > 0.f ? distinct / total : 0.f;
}

extern "C" int gp_cuda_distinct_n(gp_tensor *out, const gp_tensor *tokens, const gp_tensor *lens, int64_t n) {
  const int64_t S = tokens->shape[0], N = tokens->shape[1], L = tokens->shape[2];
  char sb[96];
  if (S == 0) return GP_OK;
  if (N * L > INT32_MAX || S > INT32_MAX || n > INT32_MAX)
    return gp_error("distinct_n: tokens are %s: too large for one launch", gp_shape_str(tokens, sb, sizeof sb));
  cudaStream_t st = gp_cuda_stream();
  const int block = 256;
  float *po = (float *)gp_ptr(out);
#define DV_DN(TT, TL)                                                                                          \
  do {                                                                                                         \
    GP_NOTE_LAUNCH((k_distinct_n<TT, TL>), block, 0);                                                          \
    k_distinct_n<TT, TL><<<(unsigned)S, block, 0, st>>>(po, (const TT *)gp_ptr(tokens), (const TL *)gp_ptr(lens), \
                                                        (int)N, (int)L, (int)n);                               \
  } while (0)
  const bool t64 = tokens->dtype == GP_I64, l64 = lens->dtype == GP_I64;
  if (t64 && l64) DV_DN(int64_t, int64_t);
  else if (t64) DV_DN(int64_t, int32_t);
  else if (l64) DV_DN(int32_t, int64_t);
  else DV_DN(int32_t, int32_t);
#undef DV_DN
  return gp_cuda_check_launch("distinct_n");
}
