/* reduce.cu: reductions over the middle dim of a contiguous (A, B, C) view,
 * accumulating in f32, and cumsum.
 *
 * C == 1 (the reduced dim is the contiguous last one): a warp (short rows) or
 * a block (long rows) per row, 16-byte loads after a scalar head that reaches
 * 16-byte alignment, a scalar tail. A few long rows are split over several
 * blocks (S splits), whose partial states a second kernel combines in order.
 * C > 1 (a strided dim): a warp covers W = min(C, 32) consecutive columns and
 * 32 / W consecutive b, so each warp reads one contiguous run of memory; the
 * 8 warps of a block step over b; the block combines in shared memory. Again
 * S splits over b when A * C is too small to fill the GPU.
 * All combines run in a fixed order: results are deterministic. */
#include "../src/cuda_internal.h"
#include "reduce.h"

/* one state for every op: sum/max/min in a; argmax/argmin value a, index i;
 * var: count a, mean b, M2 c (Welford, merged with Chan's formula) */
struct St {
  float a, b, c;
  int64_t i;
};
struct RP {
  int nk;       /* norm kind */
  float p, invp;
  float den;    /* var: B - correction (NaN when <= 0) */
  float B;
};

template <int OP> __device__ __forceinline__ St st_init() {
  St s;
  s.b = 0.f;
  s.c = 0.f;
  s.i = INT64_MAX;
  if (OP == R_MAX || OP == R_ARGMAX) s.a = -INFINITY;
  else if (OP == R_MIN || OP == R_ARGMIN) s.a = INFINITY;
  else s.a = 0.f;
  return s;
}

/* (a, ia) better than (b, ib): NaN first, then larger (argmax) or smaller (argmin), then lower index */
template <int OP> __device__ __forceinline__ bool better(float a, int64_t ia, float b, int64_t ib) {
  bool na = a != a, nb = b != b;
  if (na || nb) return na && (!nb || ia < ib);
  if (a != b) return OP == R_ARGMAX ? a > b : a < b;
  return ia < ib;
}

template <int OP> __device__ __forceinline__ void st_add(St &s, float v, int64_t idx, const RP &rp) {
  if constexpr (OP == R_SUM || OP == R_MEAN) {
    s.a += v;
  } else if constexpr (OP == R_MAX) {
    if (s.a == s.a && !(v <= s.a)) s.a = v;
  } else if constexpr (OP == R_MIN) {
    if (s.a == s.a && !(v >= s.a)) s.a = v;
  } else if constexpr (OP == R_ARGMAX || OP == R_ARGMIN) {
    if (better<OP>(v, idx, s.a, s.i)) s.a = v, s.i = idx;
  } else if constexpr (OP == R_VAR) {
    s.a += 1.f;
    float d = v - s.b;
    s.b += __fdividef(d, s.a);
    s.c += d * (v - s.b);
  } else {
    float u = fabsf(v);
    switch (rp.nk) {
      case N_P2: s.a += u * u; break;
      case N_P1: s.a += u; break;
      case N_INF: if (s.a == s.a && !(u <= s.a)) s.a = u; break;
      case N_P0: s.a += u != 0.f ? 1.f : 0.f; break;
      default: s.a += powf(u, rp.p); break;
    }
  }
}

template <int OP> __device__ __forceinline__ void st_merge(St &s, const St &o, const RP &rp) {
  if constexpr (OP == R_MAX) {
    if (s.a == s.a && !(o.a <= s.a)) s.a = o.a;
  } else if constexpr (OP == R_MIN) {
    if (s.a == s.a && !(o.a >= s.a)) s.a = o.a;
  } else if constexpr (OP == R_ARGMAX || OP == R_ARGMIN) {
    if (better<OP>(o.a, o.i, s.a, s.i)) s.a = o.a, s.i = o.i;
  } else if constexpr (OP == R_VAR) {
    if (o.a == 0.f) return;
    if (s.a == 0.f) {
      s = o;
      return;
    }
    float n = s.a + o.a, d = o.b - s.b;
    s.b += d * (o.a / n);
    s.c += o.c + d * d * (s.a * (o.a / n));
    s.a = n;
  } else if constexpr (OP == R_NORM) {
    if (rp.nk == N_INF) {
      if (s.a == s.a && !(o.a <= s.a)) s.a = o.a;
    } else {
      s.a += o.a;
    }
  } else {
    s.a += o.a;
  }
}

template <int OP> __device__ __forceinline__ float st_final(const St &s, const RP &rp) {
  if constexpr (OP == R_MEAN) return s.a / rp.B;
  else if constexpr (OP == R_VAR) return s.c / rp.den;
  else if constexpr (OP == R_NORM) return rp.nk == N_P2 ? sqrtf(s.a) : rp.nk == N_PG ? powf(s.a, rp.invp) : s.a;
  else return s.a;
}

template <typename T, int OP> __device__ __forceinline__ void st_write(void *out, int64_t k, const St &s, const RP &rp, int idx64) {
  if constexpr (OP == R_ARGMAX || OP == R_ARGMIN) {
    if (idx64) ((int64_t *)out)[k] = s.i;
    else ((int32_t *)out)[k] = (int32_t)s.i;
  } else {
    ((T *)out)[k] = st<T>(st_final<OP>(s, rp));
  }
}

__device__ __forceinline__ St st_shfl_xor(const St &s, int m) {
  St o;
  o.a = __shfl_xor_sync(0xffffffffu, s.a, m);
  o.b = __shfl_xor_sync(0xffffffffu, s.b, m);
  o.c = __shfl_xor_sync(0xffffffffu, s.c, m);
  o.i = (int64_t)__shfl_xor_sync(0xffffffffu, (long long)s.i, m);
  return o;
}

template <int OP> __device__ __forceinline__ St warp_combine(St s, const RP &rp) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) st_merge<OP>(s, st_shfl_xor(s, m), rp);
  return s;
}

/* every thread of the block gets the combined state; sh has 32 entries */
template <int OP> __device__ __forceinline__ St block_combine(St s, St *sh, const RP &rp) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  s = warp_combine<OP>(s, rp);
  if (lane == 0) sh[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < nw ? sh[lane] : st_init<OP>();
    s = warp_combine<OP>(s, rp);
    if (lane == 0) sh[0] = s;
  }
  __syncthreads();
  s = sh[0];
  __syncthreads();
  return s;
}

template <typename T, int V> struct alignas(sizeof(T) * V) rvec { T v[V]; };

/* C == 1: each group of tpr threads (a warp, or the whole block) reduces one
 * (row, split) item: elements [lo, hi) of the row. */
template <typename T, int OP>
__global__ void k_rows(const T *__restrict__ x, int64_t A, int64_t B, int S, int64_t chunk, int tpr, St *part,
                       void *out, int idx64, RP rp) {
  constexpr int V = 16 / sizeof(T);
  typedef rvec<T, V> VT;
  __shared__ St sh[32];
  const int groups = blockDim.x / tpr, lane = threadIdx.x % tpr, g = threadIdx.x / tpr;
  const int64_t items = A * S;
  for (int64_t w0 = (int64_t)blockIdx.x * groups; w0 < items; w0 += (int64_t)gridDim.x * groups) {
    const int64_t w = w0 + g;
    St s = st_init<OP>();
    if (w < items) {
      const int64_t row = w / S, lo = (w % S) * chunk, hi = min(B, lo + chunk);
      const T *p = x + row * B;
      int64_t mis = (int64_t)(((uintptr_t)(p + lo) % 16) / sizeof(T));
      int64_t head = mis ? V - mis : 0;
      if (head > hi - lo) head = hi - lo;
      if (lane < head) st_add<OP>(s, ld(p[lo + lane]), lo + lane, rp);
      const int64_t vs = lo + head, nv = (hi - vs) / V;
      const VT *pv = reinterpret_cast<const VT *>(p + vs);
      int64_t k = lane;
      for (; k + 3 * tpr < nv; k += 4 * tpr) {
        VT r[4];
#pragma unroll
        for (int u = 0; u < 4; u++) r[u] = pv[k + u * tpr];
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
          for (int e = 0; e < V; e++) st_add<OP>(s, ld(r[u].v[e]), vs + (k + u * tpr) * V + e, rp);
      }
      for (; k < nv; k += tpr) {
        VT r = pv[k];
#pragma unroll
        for (int e = 0; e < V; e++) st_add<OP>(s, ld(r.v[e]), vs + k * V + e, rp);
      }
      for (int64_t e = vs + nv * V + lane; e < hi; e += tpr) st_add<OP>(s, ld(p[e]), e, rp);
    }
    if (tpr == 32) s = warp_combine<OP>(s, rp);
    else s = block_combine<OP>(s, sh, rp);
    if (lane == 0 && w < items) {
      if (S == 1) st_write<T, OP>(out, w, s, rp, idx64);
      else part[w] = s;
    }
  }
}

/* C > 1: lane -> column tile*W + lane % W and row offset lane / W (R = 32 / W rows per warp) */
template <typename T, int OP>
__global__ void k_cols(const T *__restrict__ x, int64_t A, int64_t B, int64_t C, int W, int S, int64_t chunk, St *part,
                       void *out, int idx64, RP rp) {
  __shared__ St sh[256];
  const int R = 32 / W, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int cl = lane % W, r = lane / W;
  const int64_t nt = (C + W - 1) / W, items = A * nt * S, step = (int64_t)nw * R;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t t = w / S, tile = t % nt, a = t / nt;
    const int sp = (int)(w % S);
    const int64_t c = tile * W + cl, lo = sp * chunk, hi = min(B, lo + chunk);
    St s = st_init<OP>();
    if (r < R && c < C) {
      const T *p = x + a * B * C + c;
#pragma unroll 4
      for (int64_t b = lo + warp * R + r; b < hi; b += step) st_add<OP>(s, ld(p[b * C]), b, rp);
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    if ((int)threadIdx.x < W && c < C) {
      St acc = st_init<OP>();
      for (int ww = 0; ww < nw; ww++)
        for (int rr = 0; rr < R; rr++) st_merge<OP>(acc, sh[ww * 32 + rr * W + threadIdx.x], rp);
      const int64_t k = a * C + c;
      if (S == 1) st_write<T, OP>(out, k, acc, rp, idx64);
      else part[k * S + sp] = acc;
    }
    __syncthreads();
  }
}

/* C > 1, sum and mean, C a multiple of V (16 bytes of T) and x aligned: a
 * lane reads V consecutive columns with one 16-byte load, so a warp reads
 * 512 contiguous bytes per b (the bias gradient of a (B*T, C) activation);
 * the 8 warps step over b, the block adds them up in shared memory (fixed
 * order), and S > 1 splits over b leave f32 partials for k_final_vec. */
template <typename T, int OP, int V>
__global__ void __launch_bounds__(256) k_cols_vec(const T *__restrict__ x, int64_t A, int64_t B, int64_t C, int S,
                                                  int64_t chunk, float *part, void *out, RP rp) {
  __shared__ float sh[8][32 * V];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t TW = 32 * V, nt = (C + TW - 1) / TW, items = A * nt * S;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t t = w / S, tile = t % nt, a = t / nt;
    const int sp = (int)(w % S);
    const int64_t c0 = tile * TW + (int64_t)lane * V, lo = sp * chunk, hi = min(B, lo + chunk);
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; j++) acc[j] = 0.f;
    if (c0 < C) {
      const T *p = x + a * B * C + c0;
#pragma unroll 8
      for (int64_t b = lo + warp; b < hi; b += 8) {
        const rvec<T, V> v = *reinterpret_cast<const rvec<T, V> *>(p + b * C);
#pragma unroll
        for (int j = 0; j < V; j++) acc[j] += ld(v.v[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < V; j++) sh[warp][lane * V + j] = acc[j];
    __syncthreads();
    for (int col = threadIdx.x; col < TW; col += blockDim.x) {
      const int64_t c = tile * TW + col;
      if (c < C) {
        float s = 0.f;
#pragma unroll
        for (int ww = 0; ww < 8; ww++) s += sh[ww][col];
        const int64_t k = a * C + c;
        if (S == 1) {
          St st = st_init<OP>();
          st.a = s;
          st_write<T, OP>(out, k, st, rp, 0);
        } else {
          part[k * S + sp] = s;
        }
      }
    }
    __syncthreads();
  }
}

template <typename T, int OP>
__global__ void k_final_vec(const float *__restrict__ part, int64_t n, int S, void *out, RP rp) {
  for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < n; k += (int64_t)gridDim.x * blockDim.x) {
    St st = st_init<OP>();
    for (int s = 0; s < S; s++) st.a += part[k * S + s];
    st_write<T, OP>(out, k, st, rp, 0);
  }
}

/* combine the S partial states of each output, in order */
template <typename T, int OP>
__global__ void k_final(const St *__restrict__ part, int64_t n, int S, void *out, int idx64, RP rp) {
  for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < n; k += (int64_t)gridDim.x * blockDim.x) {
    St acc = st_init<OP>();
    for (int s = 0; s < S; s++) st_merge<OP>(acc, part[k * S + s], rp);
    st_write<T, OP>(out, k, acc, rp, idx64);
  }
}

template <typename T, int OP> static int launch(const char *name, gp_tensor *out, const gp_tensor *x, RP rp) {
  const int64_t A = x->shape[0], B = x->shape[1], C = x->shape[2];
  const int sm = gp_cuda_sm_count(), idx64 = out->dtype == GP_I64;
  constexpr int V = 16 / sizeof(T);
  cudaStream_t stream = gp_cuda_stream();
  const T *px = (const T *)gp_ptr(x);
  void *po = gp_ptr(out);
  int64_t S, chunk, nout = A * C;
  int tpr = 0, W = 0;
  if constexpr (OP == R_SUM || OP == R_MEAN) {
    if (C > 1 && C % V == 0 && ((uintptr_t)px % 16) == 0 && B > 0) {
      const int64_t items = A * ((C + 32 * V - 1) / (32 * V));
      int64_t Sv = (sm * 4 + items - 1) / items, maxs = (B + 63) / 64;
      if (Sv > maxs) Sv = maxs;
      if (Sv < 1) Sv = 1;
      int64_t ch = (B + Sv - 1) / Sv;
      Sv = (B + ch - 1) / ch;
      float *part = nullptr;
      void *scratch = nullptr;
      size_t sbytes = 0;
      if (Sv > 1) {
        GP_TRY(gp_alloc(&scratch, &sbytes, (size_t)(nout * Sv) * sizeof(float), GP_CUDA));
        part = (float *)scratch;
      }
      int64_t blocks = items * Sv, cap = (int64_t)sm * 32;
      if (blocks > cap) blocks = cap;
      k_cols_vec<T, OP, V><<<(unsigned)blocks, 256, 0, stream>>>(px, A, B, C, (int)Sv, ch, part, po, rp);
      if (Sv > 1) k_final_vec<T, OP><<<gp_grid(nout, 256), 256, 0, stream>>>(part, nout, (int)Sv, po, rp);
      int rc = gp_cuda_check_launch(name);
      if (scratch) gp_free(scratch, sbytes, GP_CUDA);
      return rc;
    }
  }
  if (C == 1) {
    tpr = B <= 32 * V * 4 ? 32 : 256;
    int64_t target = (int64_t)sm * (2048 / tpr), maxs = B / ((int64_t)tpr * V * 4);
    S = A >= target ? 1 : (target + A - 1) / A;
    if (S > maxs) S = maxs;
    if (S < 1) S = 1;
    chunk = (B + S - 1) / S;
    chunk = (chunk + V - 1) / V * V;
  } else {
    W = C >= 32 ? 32 : (int)C;
    int64_t R = 32 / W, items = A * ((C + W - 1) / W), target = (int64_t)sm * 8, maxs = B / (8 * R * 16);
    S = items >= target ? 1 : (target + items - 1) / items;
    if (S > maxs) S = maxs;
    if (S < 1) S = 1;
    chunk = (B + S - 1) / S;
  }
  if (chunk < 1) chunk = 1;
  S = B > 0 ? (B + chunk - 1) / chunk : 1;
  if (S > 65536) return gp_error("%s: internal: too many splits", name);
  void *scratch = nullptr;
  size_t sbytes = 0;
  if (S > 1) GP_TRY(gp_alloc(&scratch, &sbytes, (size_t)(nout * S) * sizeof(St), GP_CUDA));
  St *part = (St *)scratch;
  int64_t cap = (int64_t)sm * 32, blocks;
  if (C == 1) {
    int groups = 256 / tpr;
    blocks = (A * S + groups - 1) / groups;
    if (blocks > cap) blocks = cap;
    k_rows<T, OP><<<(unsigned)blocks, 256, 0, stream>>>(px, A, B, (int)S, chunk, tpr, part, po, idx64, rp);
  } else {
    blocks = A * ((C + W - 1) / W) * S;
    if (blocks > cap) blocks = cap;
    k_cols<T, OP><<<(unsigned)blocks, 256, 0, stream>>>(px, A, B, C, W, (int)S, chunk, part, po, idx64, rp);
  }
  if (S > 1) k_final<T, OP><<<gp_grid(nout, 256), 256, 0, stream>>>(part, nout, (int)S, po, idx64, rp);
  int rc = gp_cuda_check_launch(name);
  if (scratch) gp_free(scratch, sbytes, GP_CUDA); /* stream-ordered: later work on the stream may reuse it */
  return rc;
}

static const char *RNAME[] = {"sum", "mean", "max", "min", "argmax", "argmin", "var", "norm"};

extern "C" int gp_cuda_reduce(int op, gp_tensor *out, const gp_tensor *x, double param) {
  RP rp;
  rp.nk = gp_reduce_norm_kind(param);
  rp.p = (float)param;
  rp.invp = (float)(1.0 / param);
  double den = (double)x->shape[1] - param;
  rp.den = den > 0 ? (float)den : NAN;
  rp.B = (float)x->shape[1];
  const char *name = RNAME[op];
  int rc = GP_OK;
#define GP_R(OPC) GP_FLOAT_SWITCH(x->dtype, T, rc = launch<T, OPC>(name, out, x, rp))
  switch (op) {
    case R_SUM: GP_R(R_SUM); break;
    case R_MEAN: GP_R(R_MEAN); break;
    case R_MAX: GP_R(R_MAX); break;
    case R_MIN: GP_R(R_MIN); break;
    case R_ARGMAX: GP_R(R_ARGMAX); break;
    case R_ARGMIN: GP_R(R_ARGMIN); break;
    case R_VAR: GP_R(R_VAR); break;
    default: GP_R(R_NORM); break;
  }
#undef GP_R
  return rc;
}

/* ---- cumsum ---- */

/* C == 1: a block per row, 1024-element chunks (4 per thread), block scan, carry between chunks */
template <typename T> __global__ void k_cumsum_rows(const T *__restrict__ x, T *__restrict__ o, int64_t A, int64_t B) {
  __shared__ float wsum[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int64_t per = (int64_t)blockDim.x * 4;
  for (int64_t row = blockIdx.x; row < A; row += gridDim.x) {
    const T *p = x + row * B;
    T *q = o + row * B;
    float carry = 0.f;
    for (int64_t base = 0; base < B; base += per) {
      const int64_t i0 = base + threadIdx.x * 4;
      float v[4], t = 0.f;
#pragma unroll
      for (int j = 0; j < 4; j++) {
        t += i0 + j < B ? ld(p[i0 + j]) : 0.f;
        v[j] = t;
      }
      float inc = t;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        float y = __shfl_up_sync(0xffffffffu, inc, d);
        if (lane >= d) inc += y;
      }
      if (lane == 31) wsum[warp] = inc;
      __syncthreads();
      if (warp == 0) {
        float ws = lane < nw ? wsum[lane] : 0.f;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          float y = __shfl_up_sync(0xffffffffu, ws, d);
          if (lane >= d) ws += y;
        }
        if (lane < nw) wsum[lane] = ws;
      }
      __syncthreads();
      const float pre = carry + (warp > 0 ? wsum[warp - 1] : 0.f) + inc - t;
#pragma unroll
      for (int j = 0; j < 4; j++)
        if (i0 + j < B) q[i0 + j] = st<T>(pre + v[j]);
      carry += wsum[nw - 1];
      __syncthreads();
    }
  }
}

/* C > 1: a thread per column, sequential over b (consecutive threads read consecutive addresses) */
template <typename T>
__global__ void k_cumsum_cols(const T *__restrict__ x, T *__restrict__ o, int64_t A, int64_t B, int64_t C) {
  for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < A * C; k += (int64_t)gridDim.x * blockDim.x) {
    const int64_t a = k / C, c = k - a * C, base = a * B * C + c;
    float s = 0.f;
    for (int64_t b = 0; b < B; b++) {
      s += ld(x[base + b * C]);
      o[base + b * C] = st<T>(s);
    }
  }
}

extern "C" int gp_cuda_cumsum(gp_tensor *out, const gp_tensor *x) {
  const int64_t A = x->shape[0], B = x->shape[1], C = x->shape[2];
  cudaStream_t stream = gp_cuda_stream();
  GP_FLOAT_SWITCH(x->dtype, T, {
    const T *px = (const T *)gp_ptr(x);
    T *po = (T *)gp_ptr(out);
    if (C == 1) {
      int64_t blocks = A < (int64_t)gp_cuda_sm_count() * 16 ? A : (int64_t)gp_cuda_sm_count() * 16;
      k_cumsum_rows<T><<<(unsigned)blocks, 256, 0, stream>>>(px, po, A, B);
    } else {
      k_cumsum_cols<T><<<gp_grid(A * C, 256), 256, 0, stream>>>(px, po, A, B, C);
    }
  });
  return gp_cuda_check_launch("cumsum");
}
