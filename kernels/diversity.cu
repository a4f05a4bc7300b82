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

/* a set of fewer than two vectors has no pairs: a zero gradient (true when so) */
template <typename T>
static __device__ __forceinline__ bool dv_no_pairs(T *g, int N, int D) {
  if (N >= 2) return false;
  for (int k = threadIdx.x; k < N * D; k += blockDim.x) g[k] = st<T>(0.f);
  return true;
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
  if (dv_no_pairs<T>(g, N, D)) return;
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

/* ---- the vectorized path: one pass over each set, held in registers ----
 * Taken when D is a multiple of E = 16 / sizeof(T) (8 bf16/f16, 4 f32), x (and
 * dx) are 16-byte aligned and D / E <= 32 * 4. A warp takes R rows at a time:
 * lane l loads the 16-byte vectors l, l + 32, ... of each row (VPL of them, all
 * R * VPL loads in flight at once), the row norms come from warp shuffles, and
 * the lane adds its part of each unit row into VPL * E float accumulators. The
 * warps' partial sums of u meet in shared memory (Us[warp][D]), a thread per
 * column adds them up: U. The forward reads every row once; the backward
 * reads its rows a second time (L1 hits) to write dx, and with N <= warps * R
 * (N = 64 takes 16 warps of 4 rows) keeps the row norms in registers. */
template <typename T> struct DvVec;
template <> struct DvVec<float> {
  static constexpr int E = 4;
  static __device__ __forceinline__ void unpack(const uint4 &v, float *f) {
    f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ uint4 pack(const float *f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};
template <> struct DvVec<__nv_bfloat16> {
  static constexpr int E = 8;
  static __device__ __forceinline__ void unpack(const uint4 &v, float *f) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) f[2 * k] = __uint_as_float(w[k] << 16), f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
  static __device__ __forceinline__ uint4 pack(const float *f) {
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]); /* .x (low half) = f[2k] */
      memcpy(&w[k], &h, 4);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};
template <> struct DvVec<__half> {
  static constexpr int E = 8;
  static __device__ __forceinline__ void unpack(const uint4 &v, float *f) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
      __half2 h;
      memcpy(&h, &w[k], 4);
      const float2 p = __half22float2(h);
      f[2 * k] = p.x, f[2 * k + 1] = p.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float *f) {
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const __half2 h = __floats2half2_rn(f[2 * k], f[2 * k + 1]);
      memcpy(&w[k], &h, 4);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

/* E floats from 16-byte aligned shared memory */
template <int E>
static __device__ __forceinline__ void dv_lds(float *u, const float *p) {
#pragma unroll
  for (int e = 0; e < E; e += 4) {
    const float4 q = *reinterpret_cast<const float4 *>(p + e);
    u[e] = q.x, u[e + 1] = q.y, u[e + 2] = q.z, u[e + 3] = q.w;
  }
}

/* load rows i0 .. i0 + R - 1 of the set (zeros past N or past the row's nv vectors) */
template <typename T, int VPL, int R>
static __device__ __forceinline__ void dv_load_rows(uint4 (&buf)[R][VPL], const T *__restrict__ xs, int i0, int N, int D,
                                                    int nv, int lane) {
  constexpr int E = DvVec<T>::E;
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int k = 0; k < VPL; k++) {
      const int v = lane + 32 * k;
      buf[r][k] = make_uint4(0u, 0u, 0u, 0u);
      if (i0 + r < N && v < nv) buf[r][k] = __ldg(reinterpret_cast<const uint4 *>(xs + (int64_t)(i0 + r) * D + v * E));
    }
}

/* per row r of buf, sum_e f[e] * w[e] over the warp, to every lane (the R sums
 * interleaved): w = the row itself (its squared norm), or U (Us[0 .. D)) */
template <typename T, int VPL, int R, bool WITH_U>
static __device__ __forceinline__ void dv_row_dots(float (&q)[R], const uint4 (&buf)[R][VPL], const float *U, int nv,
                                                   int lane) {
  constexpr int E = DvVec<T>::E;
#pragma unroll
  for (int r = 0; r < R; r++) {
    q[r] = 0.f;
#pragma unroll
    for (int k = 0; k < VPL; k++) {
      const int v = lane + 32 * k;
      if (v < nv) {
        float f[E], w[E];
        DvVec<T>::unpack(buf[r][k], f);
        if (WITH_U) dv_lds<E>(w, U + v * E);
#pragma unroll
        for (int e = 0; e < E; e++) q[r] = fmaf(f[e], WITH_U ? w[e] : f[e], q[r]);
      }
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1)
#pragma unroll
    for (int r = 0; r < R; r++) q[r] += __shfl_xor_sync(0xffffffffu, q[r], m);
}

/* from squared norms: rr = 1 / max(|x|, eps), cl = the norm was clamped */
template <int R>
static __device__ __forceinline__ void dv_scales(float (&rr)[R], bool (&cl)[R], const float (&q)[R], float eps) {
#pragma unroll
  for (int r = 0; r < R; r++) {
    const float nrm = sqrtf(q[r]);
    rr[r] = 1.f / fmaxf(nrm, eps);
    cl[r] = !(nrm > eps);
  }
}

/* phase 1, shared by forward and backward: every warp's rows (R at a time),
 * sum_i u_i into Us[warp][:] (zeros for a warp without rows); returns sum_i
 * |u_i|^2 over the warp's rows (the same in every lane). buf, rr, cl keep the
 * warp's last batch: all its rows when N <= warps * R. */
template <typename T, int VPL, int R>
static __device__ __forceinline__ float dv_phase1(float *Us, uint4 (&buf)[R][VPL], float (&rr)[R], bool (&cl)[R],
                                                  const T *__restrict__ xs, int N, int D, float eps) {
  constexpr int E = DvVec<T>::E;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, nv = D / E;
  float acc[VPL][E];
#pragma unroll
  for (int k = 0; k < VPL; k++)
#pragma unroll
    for (int e = 0; e < E; e++) acc[k][e] = 0.f;
  float su = 0.f;
  for (int i0 = warp * R; i0 < N; i0 += nw * R) {
    dv_load_rows<T, VPL, R>(buf, xs, i0, N, D, nv, lane);
    float q[R];
    dv_row_dots<T, VPL, R, false>(q, buf, nullptr, nv, lane);
    dv_scales<R>(rr, cl, q, eps);
#pragma unroll
    for (int r = 0; r < R; r++) {
      su = fmaf(q[r] * rr[r], rr[r], su); /* rows past N: q = 0, nothing */
#pragma unroll
      for (int k = 0; k < VPL; k++) {
        float f[E];
        DvVec<T>::unpack(buf[r][k], f);
#pragma unroll
        for (int e = 0; e < E; e++) acc[k][e] = fmaf(f[e], rr[r], acc[k][e]);
      }
    }
  }
  float *Uw = Us + (int64_t)warp * D;
#pragma unroll
  for (int k = 0; k < VPL; k++) {
    const int v = lane + 32 * k;
    if (v < nv)
#pragma unroll
      for (int e = 0; e < E; e += 4)
        *reinterpret_cast<float4 *>(Uw + v * E + e) = make_float4(acc[k][e], acc[k][e + 1], acc[k][e + 2], acc[k][e + 3]);
  }
  return su;
}

template <typename T, int VPL, int R>
__global__ void __launch_bounds__(512, 1) k_set_div_vec(T *__restrict__ out, const T *__restrict__ x, int N, int D, float eps) {
  extern __shared__ float4 dv_sh4[];
  float *Us = reinterpret_cast<float *>(dv_sh4); /* [warps][D] */
  __shared__ float red[32];
  const int s = blockIdx.x;
  if (N < 2) {
    if (threadIdx.x == 0) out[s] = st<T>(0.f);
    return;
  }
  uint4 buf[R][VPL];
  float rr[R];
  bool cl[R];
  const float su = dv_phase1<T, VPL, R>(Us, buf, rr, cl, x + (int64_t)s * N * D, N, D, eps);
  float acc = (threadIdx.x & 31) == 0 ? -su : 0.f;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float u = 0.f;
    for (int w = 0; w < nw; w++) u += Us[w * D + c];
    acc = fmaf(u, u, acc);
  }
  const float p = dv_block_sum(acc, red); /* |U|^2 - sum |u_i|^2 = 2 sum_{i<j} cos_ij */
  if (threadIdx.x == 0) out[s] = st<T>(1.f - p / ((float)N * (float)(N - 1)));
}

template <typename T, int VPL, int R>
__global__ void __launch_bounds__(512, 1) /* (512, 1): the f32 backward spills under (512) */
    k_set_div_bwd_vec(T *__restrict__ dx, const T *__restrict__ x, const T *__restrict__ dout, int N, int D, float eps) {
  constexpr int E = DvVec<T>::E;
  extern __shared__ float4 dv_sh4[];
  float *Us = reinterpret_cast<float *>(dv_sh4); /* [warps][D]; row 0 ends up as U */
  const int s = blockIdx.x;
  const int64_t base = (int64_t)s * N * D;
  const T *xs = x + base;
  T *g = dx + base;
  if (dv_no_pairs<T>(g, N, D)) return;
  uint4 buf[R][VPL];
  float rr[R];
  bool cl[R];
  dv_phase1<T, VPL, R>(Us, buf, rr, cl, xs, N, D, eps);
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, nv = D / E;
  for (int c = threadIdx.x; c < D; c += blockDim.x) { /* column c is only touched by this thread */
    float u = 0.f;
    for (int w = 0; w < nw; w++) u += Us[w * D + c];
    Us[c] = u;
  }
  __syncthreads();
  const float kc = -ld(dout[s]) * (2.f / ((float)N * (float)(N - 1)));
  const bool held = N <= nw * R; /* each warp's only batch: its rr, cl are still those of phase 1 */
  for (int i0 = warp * R; i0 < N; i0 += nw * R) {
    /* the rows again (from L1: holding them in registers across the block-wide sum spills) */
    dv_load_rows<T, VPL, R>(buf, xs, i0, N, D, nv, lane);
    if (!held) {
      float q[R];
      dv_row_dots<T, VPL, R, false>(q, buf, nullptr, nv, lane);
      dv_scales<R>(rr, cl, q, eps);
    }
    float d[R]; /* x_i . U */
    dv_row_dots<T, VPL, R, true>(d, buf, Us, nv, lane);
#pragma unroll
    for (int r = 0; r < R; r++) {
      const int i = i0 + r;
      if (i >= N) continue;
      const float k1 = kc * rr[r];                                /* -g c / max(|x_i|, eps) */
      const float k2 = rr[r] * (cl[r] ? 1.f : d[r] * rr[r]);      /* r (u_i . U), or r when clamped */
#pragma unroll
      for (int k = 0; k < VPL; k++) {
        const int v = lane + 32 * k;
        if (v < nv) {
          float f[E], u[E];
          DvVec<T>::unpack(buf[r][k], f);
          dv_lds<E>(u, Us + v * E);
#pragma unroll
          for (int e = 0; e < E; e++) f[e] = k1 * (u[e] - f[e] * k2);
          *reinterpret_cast<uint4 *>(g + (int64_t)i * D + v * E) = DvVec<T>::pack(f);
        }
      }
    }
  }
}

/* the vectorized plan: vectors per lane (1, 2 or 4; 0 when the scalar kernels
 * run), rows per batch, warps per block */
struct dv_plan {
  int vpl, rows, warps;
  size_t smem; /* the vectorized kernels' */
  unsigned grid;
  cudaStream_t st;
};
/* the vectorized kernels keep warps * D floats of dynamic shared memory; with
 * their static red[32] the block must stay within 48 KiB (a 12 x 1024 bf16
 * plan of exactly 48 KiB failed to launch on the H100) */
static const int64_t DV_VEC_SHARED_FLOATS = (48 * 1024 - 1024) / 4;

static dv_plan dv_plan_for(int64_t N, int64_t D, size_t elsize, const void *a, const void *b) {
  dv_plan p = {0, 0, 0, 0, 0, 0};
  const int64_t E = 16 / (int64_t)elsize, nv = D / E;
  if (D % E != 0 || N * D > INT32_MAX || ((uintptr_t)a & 15u) || ((uintptr_t)b & 15u)) return p;
  p.vpl = nv <= 32 ? 1 : nv <= 64 ? 2 : nv <= 128 ? 4 : 0;
  if (!p.vpl) return p;
  p.rows = p.vpl == 4 ? 2 : 4;
  int64_t w = (N + p.rows - 1) / p.rows, cap = DV_VEC_SHARED_FLOATS / (D > 0 ? D : 1);
  if (w > 16) w = 16;
  if (w > cap) w = cap;
  p.warps = (int)(w < 1 ? 1 : w);
  return p;
}

/* shared floats of a block: the forward needs N, the backward 2N + D */
static const int64_t DV_MAX_SHARED_FLOATS = (48 * 1024 - 1024) / 4 - 4; /* room for red[32] and the + 4 */

static int dv_block(int64_t D) {
  if (D >= 512) return 512;
  int b = (int)((D + 31) / 32 * 32);
  return b < 64 ? 64 : b;
}

#define DV_VEC_LAUNCH(KERNEL, T, plan, ...)                                                              \
  do {                                                                                                   \
    const int blk_ = (plan).warps * 32;                                                                  \
    const int sm_ = (int)(plan).smem;                                                                    \
    switch ((plan).vpl) {                                                                                \
      case 1: GP_NOTE_LAUNCH((KERNEL<T, 1, 4>), blk_, sm_); KERNEL<T, 1, 4><<<(plan).grid, blk_, sm_, (plan).st>>>(__VA_ARGS__); break; \
      case 2: GP_NOTE_LAUNCH((KERNEL<T, 2, 4>), blk_, sm_); KERNEL<T, 2, 4><<<(plan).grid, blk_, sm_, (plan).st>>>(__VA_ARGS__); break; \
      default: GP_NOTE_LAUNCH((KERNEL<T, 4, 2>), blk_, sm_); KERNEL<T, 4, 2><<<(plan).grid, blk_, sm_, (plan).st>>>(__VA_ARGS__); break; \
    }                                                                                                    \
  } while (0)

/* the sets fit one grid (else an error naming op); the plan for x and the output */
static int dv_start(const char *op, const gp_tensor *x, const void *o, dv_plan *plan) {
  char sb[96];
  if (x->shape[0] > INT32_MAX) return gp_error("%s: x is %s: too many sets for one launch", op, gp_shape_str(x, sb, sizeof sb));
  *plan = dv_plan_for(x->shape[1], x->shape[2], gp_elsize(x->dtype), gp_ptr(x), o);
  plan->smem = sizeof(float) * (size_t)(plan->warps * x->shape[2]);
  plan->grid = (unsigned)x->shape[0];
  plan->st = gp_cuda_stream();
  return GP_OK;
}

extern "C" int gp_cuda_set_diversity(gp_tensor *out, const gp_tensor *x, double eps) {
  const int64_t S = x->shape[0], N = x->shape[1], D = x->shape[2];
  char sb[96];
  if (S == 0) return GP_OK;
  dv_plan plan;
  GP_TRY(dv_start("set_diversity", x, gp_ptr(x), &plan));
  if (plan.vpl) {
    GP_FLOAT_SWITCH(x->dtype, T, {
      DV_VEC_LAUNCH(k_set_div_vec, T, plan, (T *)gp_ptr(out), (const T *)gp_ptr(x), (int)N, (int)D, (float)eps);
    });
    return gp_cuda_check_launch("set_diversity");
  }
  if (N > DV_MAX_SHARED_FLOATS || N * D > INT32_MAX)
    return gp_error("set_diversity: x is %s; the CUDA kernel takes at most %lld vectors per set", gp_shape_str(x, sb, sizeof sb),
                    (long long)DV_MAX_SHARED_FLOATS);
  const int block = dv_block(D);
  /* + 4: the compiler reads rn's tail (up to 3 floats, dv_col) as one vector,
   * past N (compute-sanitizer on the H100: a 12-byte read 4 bytes beyond) */
  const size_t smem = sizeof(float) * (size_t)(N + 4);
  GP_FLOAT_SWITCH(x->dtype, T, {
    GP_NOTE_LAUNCH(k_set_div<T>, block, (int)smem);
    k_set_div<T><<<plan.grid, block, smem, plan.st>>>((T *)gp_ptr(out), (const T *)gp_ptr(x), (int)N, (int)D, (float)eps);
  });
  return gp_cuda_check_launch("set_diversity");
}

extern "C" int gp_cuda_set_diversity_backward(gp_tensor *dx, const gp_tensor *x, const gp_tensor *dout, double eps) {
  const int64_t S = x->shape[0], N = x->shape[1], D = x->shape[2];
  char sb[96];
  if (S == 0 || N * D == 0) return GP_OK;
  dv_plan plan;
  GP_TRY(dv_start("set_diversity_backward", x, gp_ptr(dx), &plan));
  if (plan.vpl) {
    GP_FLOAT_SWITCH(x->dtype, T, {
      DV_VEC_LAUNCH(k_set_div_bwd_vec, T, plan, (T *)gp_ptr(dx), (const T *)gp_ptr(x), (const T *)gp_ptr(dout),
                    (int)N, (int)D, (float)eps);
    });
    return gp_cuda_check_launch("set_diversity_backward");
  }
  if (2 * N + D > DV_MAX_SHARED_FLOATS || N * D > INT32_MAX)
    return gp_error("set_diversity_backward: x is %s; the CUDA kernel needs 2N + D <= %lld", gp_shape_str(x, sb, sizeof sb),
                    (long long)DV_MAX_SHARED_FLOATS);
  const int block = dv_block(D);
  const size_t smem = sizeof(float) * (size_t)(2 * N + D + 4); /* + 4: as in the forward */
  GP_FLOAT_SWITCH(x->dtype, T, {
    GP_NOTE_LAUNCH(k_set_div_bwd<T>, block, (int)smem);
    k_set_div_bwd<T><<<plan.grid, block, smem, plan.st>>>((T *)gp_ptr(dx), (const T *)gp_ptr(x), (const T *)gp_ptr(dout),
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
