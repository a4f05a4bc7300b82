/* rows.cu: softmax, log_softmax, LayerNorm and RMSNorm over the last dim, on
 * the row engine of rows.cuh (row in registers, read once, f32 math).
 * Norm backward: dx per row on the same engine; dw (and db) as column sums
 * over rows: per-split partial sums (no atomics) and a second kernel that adds
 * the splits in order, so results are deterministic. */
#include "rows.cuh"
#include "rows.h"

/* ---- softmax / log_softmax ---- */
template <typename T, bool LOG> struct SoftmaxOp {
  const T *x;
  T *o;
  int64_t D;
  template <int V, int NV> __device__ __forceinline__ void run(int64_t row, int lane, int tpr, float *sh) const {
    float v[NV * V];
    row_load<T, V, NV>(x + row * D, D, lane, tpr, v, -INFINITY);
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < NV * V; i++) m = fmaxf(m, v[i]);
    m = group_max(m, tpr, sh);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NV * V; i++) {
      float e = __expf(v[i] - m);
      s += e;
      if (!LOG) v[i] = e;
    }
    s = group_sum(s, tpr, sh);
    if (LOG) {
      const float ls = m + __logf(s);
#pragma unroll
      for (int i = 0; i < NV * V; i++) v[i] -= ls;
    } else {
      const float r = 1.f / s;
#pragma unroll
      for (int i = 0; i < NV * V; i++) v[i] *= r;
    }
    row_store<T, V, NV>(o + row * D, D, lane, tpr, v);
  }
  __device__ void loop(int64_t row, float *sh) const {
    const T *p = x + row * D;
    float m = -INFINITY, s = 0.f; /* online: running max and sum scaled to it */
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      float v = ld(p[j]);
      if (v > m) s = s * __expf(m - v) + 1.f, m = v;
      else s += __expf(v - m);
    }
    const float M = block_max(m, sh);
    s = block_sum(m == -INFINITY ? 0.f : s * __expf(m - M), sh);
    const float ls = M + __logf(s), r = 1.f / s;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      float v = ld(p[j]);
      o[row * D + j] = st<T>(LOG ? v - ls : __expf(v - M) * r);
    }
  }
};

template <typename T, bool LOG> struct SoftmaxBwdOp {
  const T *y, *dy;
  T *dx;
  int64_t D;
  template <int V, int NV> __device__ __forceinline__ void run(int64_t row, int lane, int tpr, float *sh) const {
    float a[NV * V], g[NV * V];
    row_load<T, V, NV>(y + row * D, D, lane, tpr, a, 0.f);
    row_load<T, V, NV>(dy + row * D, D, lane, tpr, g, 0.f);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NV * V; i++) s += LOG ? g[i] : a[i] * g[i];
    s = group_sum(s, tpr, sh);
#pragma unroll
    for (int i = 0; i < NV * V; i++) a[i] = LOG ? g[i] - __expf(a[i]) * s : a[i] * (g[i] - s);
    row_store<T, V, NV>(dx + row * D, D, lane, tpr, a);
  }
  __device__ void loop(int64_t row, float *sh) const {
    const int64_t o = row * D;
    float s = 0.f;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) s += LOG ? ld(dy[o + j]) : ld(y[o + j]) * ld(dy[o + j]);
    s = block_sum(s, sh);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      float a = ld(y[o + j]), g = ld(dy[o + j]);
      dx[o + j] = st<T>(LOG ? g - __expf(a) * s : a * (g - s));
    }
  }
};

extern "C" int gp_cuda_softmax(gp_tensor *out, const gp_tensor *x, int lg) {
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  int rc = GP_OK;
  bool al = al16(gp_ptr(x)) && al16(gp_ptr(out));
  GP_FLOAT_SWITCH(x->dtype, T, {
    if (lg) rc = rows_launch<T>("log_softmax", SoftmaxOp<T, true>{(const T *)gp_ptr(x), (T *)gp_ptr(out), D}, R, D, al);
    else rc = rows_launch<T>("softmax", SoftmaxOp<T, false>{(const T *)gp_ptr(x), (T *)gp_ptr(out), D}, R, D, al);
  });
  return rc;
}

extern "C" int gp_cuda_softmax_backward(gp_tensor *dx, const gp_tensor *y, const gp_tensor *dy, int lg) {
  int64_t R = gp_rows_of(y), D = gp_cols_of(y);
  int rc = GP_OK;
  bool al = al16(gp_ptr(y)) && al16(gp_ptr(dy)) && al16(gp_ptr(dx));
  GP_FLOAT_SWITCH(y->dtype, T, {
    const T *py = (const T *)gp_ptr(y), *pg = (const T *)gp_ptr(dy);
    T *pd = (T *)gp_ptr(dx);
    if (lg) rc = rows_launch<T>("log_softmax_backward", SoftmaxBwdOp<T, true>{py, pg, pd, D}, R, D, al);
    else rc = rows_launch<T>("softmax_backward", SoftmaxBwdOp<T, false>{py, pg, pd, D}, R, D, al);
  });
  return rc;
}

/* ---- LayerNorm / RMSNorm forward (RMS: no mean, no bias) ---- */
template <typename T, bool RMS> struct NormOp {
  const T *x, *w, *b;
  T *o;
  float *mean, *rstd;
  int64_t D;
  float eps;
  template <int V, int NV> __device__ __forceinline__ void load_w(int lane, int tpr, float (&wv)[NV * V], float (&bv)[NV * V]) const {
    row_load<T, V, NV, false>(w, D, lane, tpr, wv, 0.f);
    if (!RMS) row_load<T, V, NV, false>(b, D, lane, tpr, bv, 0.f);
  }
  template <int V, int NV> __device__ __forceinline__ void run(int64_t row, int lane, int tpr, float *sh) const {
    float wv[NV * V], bv[NV * V];
    load_w<V, NV>(lane, tpr, wv, bv);
    run_w<V, NV>(row, lane, tpr, sh, wv, bv);
  }
  /* one row with the weights already in registers */
  template <int V, int NV>
  __device__ __forceinline__ void run_w(int64_t row, int lane, int tpr, float *sh, const float (&wv)[NV * V],
                                        const float (&bv)[NV * V]) const {
    float v[NV * V];
    row_load<T, V, NV>(x + row * D, D, lane, tpr, v, 0.f);
    float mu = 0.f;
    if (!RMS) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < NV * V; i++) s += v[i];
      mu = group_sum(s, tpr, sh) / (float)D;
    }
    const float q = row_dev2<V, NV, !RMS>(v, mu, lane, tpr, D);
    const float rs = rsqrtf(group_sum(q, tpr, sh) / (float)D + eps);
    if (RMS) {
#pragma unroll
      for (int i = 0; i < NV * V; i++) v[i] = v[i] * rs * wv[i];
    } else {
#pragma unroll
      for (int i = 0; i < NV * V; i++) v[i] = (v[i] - mu) * rs * wv[i] + bv[i];
    }
    row_store<T, V, NV>(o + row * D, D, lane, tpr, v);
    if (lane == 0) {
      if (!RMS) mean[row] = mu;
      rstd[row] = rs;
    }
  }
  __device__ void loop(int64_t row, float *sh) const {
    const T *p = x + row * D;
    float mu = 0.f;
    if (!RMS) {
      float s = 0.f;
      for (int64_t j = threadIdx.x; j < D; j += blockDim.x) s += ld(p[j]);
      mu = block_sum(s, sh) / (float)D;
    }
    float q = 0.f;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      float d = ld(p[j]) - mu;
      q += d * d;
    }
    const float rs = rsqrtf(block_sum(q, sh) / (float)D + eps);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      float y = (ld(p[j]) - mu) * rs * ld(w[j]);
      if (!RMS) y += ld(b[j]);
      o[row * D + j] = st<T>(y);
    }
    if (threadIdx.x == 0) {
      if (!RMS) mean[row] = mu;
      rstd[row] = rs;
    }
  }
};

/* Long rows (a block per row): a persistent grid whose blocks load the weights
 * once and keep them in registers over many rows, so that w and b are not
 * re-read from L2 for every row (at D = 8192 in f32 they would add half again
 * the row's own traffic). */
template <typename T, bool RMS, int V, int NV>
__global__ void __launch_bounds__(512) k_norm_persist(NormOp<T, RMS> op, int64_t rows) {
  __shared__ float sh[64];
  float wv[NV * V], bv[NV * V];
  op.template load_w<V, NV>(threadIdx.x, blockDim.x, wv, bv);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) op.template run_w<V, NV>(row, threadIdx.x, blockDim.x, sh, wv, bv);
}

template <typename T, bool RMS> static int norm_launch(const char *name, const NormOp<T, RMS> &op, int64_t R, bool al) {
  constexpr int VV = 16 / sizeof(T);
  const int64_t D = op.D, nvec = D / VV;
  /* 16-bit LayerNorm keeps w and b out of registers (x, w, b as floats would
   * take all 128 at 32 elements per thread): the plain row engine, whose
   * weight loads hit L1, measured faster for it on the H100 */
  const bool persist = RMS || sizeof(T) == 4;
  if (!(persist && al && D % VV == 0 && nvec > 32 * 4 && nvec <= 512 * 8)) return rows_launch<T>(name, op, R, D, al);
  /* (measured on an H100: spreading bf16 rows over more threads, ~16 elements
   * each, was slower than these widths; fewer threads per row mean fewer barriers) */
  const int tpr = nvec <= 128 * 4 ? 128 : nvec <= 256 * 4 ? 256 : 512;
  const int nv = pow2_at_least((nvec + tpr - 1) / tpr);
  auto go = [&](auto kern) {
    int per_sm = 1;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, tpr, 0);
    int64_t blocks = (int64_t)gp_cuda_sm_count() * (per_sm > 0 ? per_sm : 1);
    if (blocks > R) blocks = R;
    kern<<<(unsigned)blocks, tpr, 0, gp_cuda_stream()>>>(op, R);
  };
  switch (nv) {
    case 1: go(k_norm_persist<T, RMS, VV, 1>); break;
    case 2: go(k_norm_persist<T, RMS, VV, 2>); break;
    case 4: go(k_norm_persist<T, RMS, VV, 4>); break;
    default: go(k_norm_persist<T, RMS, VV, 8>); break;
  }
  return gp_cuda_check_launch(name);
}

extern "C" int gp_cuda_layer_norm(gp_tensor *out, gp_tensor *mean, gp_tensor *rstd, const gp_tensor *x, const gp_tensor *w,
                                  const gp_tensor *b, double eps) {
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  int rc = GP_OK;
  bool al = al16(gp_ptr(x)) && al16(gp_ptr(out)) && al16(gp_ptr(w)) && al16(gp_ptr(b));
  GP_FLOAT_SWITCH(x->dtype, T, {
    NormOp<T, false> op{(const T *)gp_ptr(x), (const T *)gp_ptr(w), (const T *)gp_ptr(b), (T *)gp_ptr(out),
                        (float *)gp_ptr(mean), (float *)gp_ptr(rstd), D, (float)eps};
    rc = norm_launch<T, false>("layer_norm", op, R, al);
  });
  return rc;
}

extern "C" int gp_cuda_rms_norm(gp_tensor *out, gp_tensor *rstd, const gp_tensor *x, const gp_tensor *w, double eps) {
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  int rc = GP_OK;
  bool al = al16(gp_ptr(x)) && al16(gp_ptr(out)) && al16(gp_ptr(w));
  GP_FLOAT_SWITCH(x->dtype, T, {
    NormOp<T, true> op{(const T *)gp_ptr(x), (const T *)gp_ptr(w), nullptr, (T *)gp_ptr(out), nullptr,
                       (float *)gp_ptr(rstd), D, (float)eps};
    rc = norm_launch<T, true>("rms_norm", op, R, al);
  });
  return rc;
}

/* ---- norm backward: dx per row ---- */
/* w's V elements from element j (zeros past D; D % V == 0 when V > 1) */
template <typename T, int V> __device__ __forceinline__ void row_vec(const T *w, int64_t j, int64_t D, float (&r)[V]) {
  if constexpr (V > 1) {
    if (j < D) {
      const rowvec<T, V> t = *reinterpret_cast<const rowvec<T, V> *>(w + j);
#pragma unroll
      for (int e = 0; e < V; e++) r[e] = ld(t.v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < V; e++) r[e] = 0.f;
    }
  } else {
    r[0] = j < D ? ld(w[j]) : 0.f;
  }
}
/* p[e] += a[e] b[e] (b given) or a[e], e < V; float4s when V % 4 == 0 */
template <int V> __device__ __forceinline__ void acc_add(float *p, const float *a, const float *b, bool mul) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int q = 0; q < V; q += 4) {
      float4 t = *reinterpret_cast<float4 *>(p + q);
      t.x = mul ? fmaf(a[q], b[q], t.x) : t.x + a[q];
      t.y = mul ? fmaf(a[q + 1], b[q + 1], t.y) : t.y + a[q + 1];
      t.z = mul ? fmaf(a[q + 2], b[q + 2], t.z) : t.z + a[q + 2];
      t.w = mul ? fmaf(a[q + 3], b[q + 3], t.w) : t.w + a[q + 3];
      *reinterpret_cast<float4 *>(p + q) = t;
    }
  } else {
#pragma unroll
    for (int e = 0; e < V; e++) p[e] = mul ? fmaf(a[e], b[e], p[e]) : p[e] + a[e];
  }
}

/* RES: dres (the gradient of a residual stream that also feeds the norm) is added into dx */
template <typename T, bool RMS, bool RES = false> struct NormDxOp {
  const T *x, *w, *dout;
  const float *mean, *rstd;
  T *dx;
  int64_t D;
  const T *dres = nullptr;
  template <int V, int NV> __device__ __forceinline__ void run(int64_t row, int lane, int tpr, float *sh) const {
    run_acc<V, NV, false>(row, lane, tpr, sh, nullptr);
  }
  /* ACC: also this row's share of dw (dout x_hat) and db (dout, LayerNorm)
   * added into the group's accumulators in shared memory, acc + p D for
   * plane p (this thread's columns only: no other thread touches them until
   * the block's sum) */
  template <int V, int NV, bool ACC>
  __device__ __forceinline__ void run_acc(int64_t row, int lane, int tpr, float *sh, float *acc) const {
    float xv[NV * V], g[NV * V], rv[RES ? NV * V : 1];
    row_load<T, V, NV>(x + row * D, D, lane, tpr, xv, 0.f);
    row_load<T, V, NV>(dout + row * D, D, lane, tpr, g, 0.f);
    if constexpr (RES) row_load<T, V, NV>(dres + row * D, D, lane, tpr, rv, 0.f); /* in flight with x, dout */
    const float mu = RMS ? 0.f : mean[row], rs = rstd[row];
    float2 s = make_float2(0.f, 0.f);
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int64_t j = ((int64_t)k * tpr + lane) * V;
      float wv[V];
      row_vec<T, V>(w, j, D, wv);
#pragma unroll
      for (int e = 0; e < V; e++) {
        const int i = k * V + e;
        xv[i] = (xv[i] - mu) * rs;
      }
      if constexpr (ACC) {
        if (j < D) {
          acc_add<V>(acc + j, &g[k * V], &xv[k * V], true);
          if constexpr (!RMS) acc_add<V>(acc + D + j, &g[k * V], nullptr, false);
        }
      }
#pragma unroll
      for (int e = 0; e < V; e++) {
        const int i = k * V + e;
        g[i] *= wv[e];
        s.x += g[i];
        s.y += g[i] * xv[i];
      }
    }
    s = group_sum2(s, tpr, sh);
    const float a = RMS ? 0.f : s.x / (float)D, c = s.y / (float)D;
#pragma unroll
    for (int i = 0; i < NV * V; i++) {
      xv[i] = rs * (g[i] - a - xv[i] * c);
      if constexpr (RES) xv[i] += rv[i];
    }
    row_store<T, V, NV>(dx + row * D, D, lane, tpr, xv);
  }
  __device__ void loop(int64_t row, float *sh) const {
    const int64_t o = row * D;
    const float mu = RMS ? 0.f : mean[row], rs = rstd[row];
    float2 s = make_float2(0.f, 0.f);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      float g = ld(dout[o + j]) * ld(w[j]), xh = (ld(x[o + j]) - mu) * rs;
      s.x += g;
      s.y += g * xh;
    }
    s.x = block_sum(s.x, sh);
    s.y = block_sum(s.y, sh);
    const float a = RMS ? 0.f : s.x / (float)D, c = s.y / (float)D;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      float g = ld(dout[o + j]) * ld(w[j]), xh = (ld(x[o + j]) - mu) * rs;
      dx[o + j] = st<T>(rs * (g - a - xh * c) + (RES ? ld(dres[o + j]) : 0.f));
    }
  }
};

/* the norm backward in one pass: dx row by row (NormDxOp), and each row
 * group's share of dw (and db) added into its
 * own accumulators in shared memory (PL planes of D floats a group), then
 * summed over the block's groups into part[p][b][j] (plane p, block b). x,
 * dout (and dres) are read once, in flight together. */
template <typename T, bool RMS, bool RES, int V, int NV>
__global__ void __launch_bounds__(512) k_norm_bwd(NormDxOp<T, RMS, RES> op, float *__restrict__ part, int64_t rows,
                                                 int tpr) {
  constexpr int PL = RMS ? 1 : 2;
  extern __shared__ float4 sacc4[];
  __shared__ float sh[64];
  float *sacc = reinterpret_cast<float *>(sacc4);
  const int rpb = blockDim.x / tpr, lane = threadIdx.x % tpr, g = threadIdx.x / tpr;
  const int64_t D = op.D;
  float *mine = sacc + (int64_t)g * PL * D;
#pragma unroll
  for (int k = 0; k < NV; k++) {
    const int64_t j = ((int64_t)k * tpr + lane) * V;
    if (j < D)
#pragma unroll
      for (int p = 0; p < PL; p++)
#pragma unroll
        for (int e = 0; e < V; e++) mine[p * D + j + e] = 0.f;
  }
  for (int64_t r0 = (int64_t)blockIdx.x * rpb; r0 < rows; r0 += (int64_t)gridDim.x * rpb) {
    const int64_t row = r0 + g;
    if (row < rows) op.template run_acc<V, NV, true>(row, lane, tpr, sh, mine); /* uniform when rpb == 1 */
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < PL * D; i += blockDim.x) {
    const int64_t p = i / D, j = i - p * D;
    float t = 0.f;
    for (int q = 0; q < rpb; q++) t += sacc[(q * PL + p) * D + j];
    part[(p * gridDim.x + blockIdx.x) * D + j] = t;
  }
}

/* the planes' outputs: plane p's sums go to o[p] */
template <typename T> struct PartOuts {
  T *o[2];
};

/* o[p][j] (+)= the sum over the S partial rows of plane p (part + p S D; acc:
 * added): a block sums 16 columns of one plane, 64 threads down the rows,
 * then a fixed tree in shared memory (the same order every call) */
template <typename T>
__global__ void __launch_bounds__(1024) k_norm_part_sum(const float *__restrict__ part, PartOuts<T> outs, int64_t D,
                                                       int S, int acc) {
  __shared__ float red[64][17];
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4, p = blockIdx.y;
  const int64_t j = blockIdx.x * 16LL + tx;
  const float *base = part + (int64_t)p * S * D;
  float t = 0.f;
  if (j < D)
    for (int s = ty; s < S; s += 64) t += base[(int64_t)s * D + j];
  red[ty][tx] = t;
  __syncthreads();
#pragma unroll
  for (int n = 32; n >= 1; n >>= 1) {
    if (ty < n) red[ty][tx] += red[ty + n][tx];
    __syncthreads();
  }
  if (ty == 0 && j < D) {
    T *o = outs.o[p];
    const float v = red[0][tx];
    o[j] = st<T>(acc ? ld(o[j]) + v : v);
  }
}

template <typename T> static void part_sum(const float *part, PartOuts<T> outs, int planes, int64_t D, int S, int acc) {
  k_norm_part_sum<T><<<dim3((unsigned)((D + 15) / 16), (unsigned)planes), 1024, 0, gp_cuda_stream()>>>(part, outs, D, S,
                                                                                                     acc);
}

/* the one-pass backward when the rows fit the row engine (aligned, D a
 * multiple of the vector width) and the accumulators fit shared memory;
 * false: the caller takes the two passes. outs: dw (and db) */
template <typename T, bool RMS, bool RES>
static bool norm_bwd_fused(int *rc, const char *name, const NormDxOp<T, RMS, RES> &op, PartOuts<T> outs, int64_t R,
                           bool al, int acc) {
  constexpr int VV = 16 / sizeof(T), PL = RMS ? 1 : 2;
  const int64_t D = op.D;
  int tpr, block, nv;
  if (!al || D % VV != 0 || R == 0 || !rows_config(D / VV, tpr, block, nv)) return false;
  nv = (int)((D / VV + tpr - 1) / tpr); /* exactly the vectors a thread needs (not a power of 2) */
  nv = nv <= 4 ? nv : nv <= 6 ? 6 : 8;
  const int rpb = block / tpr;
  const size_t smem = (size_t)rpb * PL * D * sizeof(float);
  if (smem > 100 * 1024) return false;
  auto go = [&](auto kern) {
    /* at every size: the kernel's static sh[64] comes on top, so 48 KB of planes (LayerNorm's two at D 768 in
     * blocks of 8 rows, GPT-2's shape) already need the opt-in; without it the launch fails */
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    int per_sm = 1;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, block, smem);
    per_sm = per_sm < 1 ? 1 : per_sm > 4 ? 4 : per_sm;
    int64_t blocks = (R + rpb - 1) / rpb, cap = (int64_t)gp_cuda_sm_count() * per_sm;
    if (blocks > cap) blocks = cap;
    void *scratch;
    size_t sbytes;
    *rc = gp_alloc(&scratch, &sbytes, (size_t)(PL * blocks * D) * sizeof(float), GP_CUDA);
    if (*rc != GP_OK) return;
    float *part = (float *)scratch;
    kern<<<(unsigned)blocks, block, smem, gp_cuda_stream()>>>(op, part, R, tpr);
    part_sum<T>(part, outs, PL, D, (int)blocks, acc);
    *rc = gp_cuda_check_launch(name);
    gp_free(scratch, sbytes, GP_CUDA);
  };
  switch (nv) {
    case 1: go(k_norm_bwd<T, RMS, RES, VV, 1>); break;
    case 2: go(k_norm_bwd<T, RMS, RES, VV, 2>); break;
    case 3: go(k_norm_bwd<T, RMS, RES, VV, 3>); break;
    case 4: go(k_norm_bwd<T, RMS, RES, VV, 4>); break;
    case 6: go(k_norm_bwd<T, RMS, RES, VV, 6>); break;
    default: go(k_norm_bwd<T, RMS, RES, VV, 8>); break;
  }
  return true;
}

/* dw[j] = sum_r dout * (x - mean) * rstd, db[j] = sum_r dout: block (32 columns x 8 rows),
 * split s of the rows writes part[s][j] (two planes: dw, db) */
template <typename T>
__global__ void k_norm_dw_part(const T *__restrict__ x, const T *__restrict__ dout, const float *__restrict__ mean,
                               const float *__restrict__ rstd, float *__restrict__ part, int64_t R, int64_t D,
                               int64_t chunk, int S) {
  __shared__ float sw[8][33], sb[8][33];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t j = blockIdx.x * 32LL + tx;
  const int s = blockIdx.y;
  const int64_t lo = s * chunk, hi = min(R, lo + chunk);
  float aw = 0.f, ab = 0.f;
  if (j < D) {
    for (int64_t r = lo + ty; r < hi; r += 8) {
      const float g = ld(dout[r * D + j]);
      aw += g * (ld(x[r * D + j]) - (mean ? mean[r] : 0.f)) * rstd[r];
      ab += g;
    }
  }
  sw[ty][tx] = aw;
  sb[ty][tx] = ab;
  __syncthreads();
  if (ty == 0 && j < D) {
    for (int k = 1; k < 8; k++) aw += sw[k][tx], ab += sb[k][tx];
    part[(int64_t)s * D + j] = aw;
    part[((int64_t)S + s) * D + j] = ab;
  }
}

template <typename T>
static int norm_dw(const char *name, gp_tensor *dw, gp_tensor *db, const gp_tensor *x, const gp_tensor *mean,
                   const gp_tensor *rstd, const gp_tensor *dout, int acc) {
  const int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  if (D == 0) return GP_OK;
  cudaStream_t stream = gp_cuda_stream();
  const int64_t ct = (D + 31) / 32, target = (int64_t)gp_cuda_sm_count() * 8;
  int64_t S = (target + ct - 1) / ct, maxs = R / 64;
  if (S > maxs) S = maxs;
  if (S > 1024) S = 1024;
  if (S < 1) S = 1;
  int64_t chunk = R > 0 ? (R + S - 1) / S : 1;
  S = R > 0 ? (R + chunk - 1) / chunk : 1;
  if (ct > 2147483647LL) return gp_error("%s: D too large", name);
  void *scratch;
  size_t sbytes;
  GP_TRY(gp_alloc(&scratch, &sbytes, (size_t)(2 * S * D) * sizeof(float), GP_CUDA));
  float *part = (float *)scratch;
  k_norm_dw_part<T><<<dim3((unsigned)ct, (unsigned)S), 256, 0, stream>>>(
      (const T *)gp_ptr(x), (const T *)gp_ptr(dout), mean ? (const float *)gp_ptr(mean) : nullptr,
      (const float *)gp_ptr(rstd), part, R, D, chunk, (int)S);
  part_sum<T>(part, PartOuts<T>{{(T *)gp_ptr(dw), db ? (T *)gp_ptr(db) : nullptr}}, db ? 2 : 1, D, (int)S, acc);
  int rc = gp_cuda_check_launch(name);
  gp_free(scratch, sbytes, GP_CUDA);
  return rc;
}

extern "C" int gp_cuda_layer_norm_backward(gp_tensor *dx, gp_tensor *dw, gp_tensor *db, const gp_tensor *x,
                                           const gp_tensor *w, const gp_tensor *mean, const gp_tensor *rstd,
                                           const gp_tensor *dout, const gp_tensor *dres, int accumulate) {
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  int rc = GP_OK;
  const char *name = dres ? "layer_norm_backward_add" : "layer_norm_backward";
  bool al = al16(gp_ptr(x)) && al16(gp_ptr(w)) && al16(gp_ptr(dout)) && al16(gp_ptr(dx)) && (!dres || al16(gp_ptr(dres)));
  GP_FLOAT_SWITCH(x->dtype, T, {
    bool done;
    const PartOuts<T> lnouts{{(T *)gp_ptr(dw), (T *)gp_ptr(db)}};
    if (dres) {
      NormDxOp<T, false, true> op{(const T *)gp_ptr(x), (const T *)gp_ptr(w), (const T *)gp_ptr(dout),
                                  (const float *)gp_ptr(mean), (const float *)gp_ptr(rstd), (T *)gp_ptr(dx), D,
                                  (const T *)gp_ptr(dres)};
      done = norm_bwd_fused<T, false, true>(&rc, name, op, lnouts, R, al, accumulate);
      if (!done) rc = rows_launch<T>(name, op, R, D, al);
    } else {
      NormDxOp<T, false> op{(const T *)gp_ptr(x), (const T *)gp_ptr(w), (const T *)gp_ptr(dout),
                            (const float *)gp_ptr(mean), (const float *)gp_ptr(rstd), (T *)gp_ptr(dx), D};
      done = norm_bwd_fused<T, false, false>(&rc, name, op, lnouts, R, al, accumulate);
      if (!done) rc = rows_launch<T>(name, op, R, D, al);
    }
    if (!done && rc == GP_OK) rc = norm_dw<T>(name, dw, db, x, mean, rstd, dout, accumulate);
  });
  return rc;
}

extern "C" int gp_cuda_rms_norm_backward(gp_tensor *dx, gp_tensor *dw, const gp_tensor *x, const gp_tensor *w,
                                         const gp_tensor *rstd, const gp_tensor *dout, const gp_tensor *dres,
                                         int accumulate) {
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  int rc = GP_OK;
  const char *name = dres ? "rms_norm_backward_add" : "rms_norm_backward";
  bool al = al16(gp_ptr(x)) && al16(gp_ptr(w)) && al16(gp_ptr(dout)) && al16(gp_ptr(dx)) && (!dres || al16(gp_ptr(dres)));
  GP_FLOAT_SWITCH(x->dtype, T, {
    bool done;
    const PartOuts<T> rmsouts{{(T *)gp_ptr(dw), nullptr}};
    if (dres) {
      NormDxOp<T, true, true> op{(const T *)gp_ptr(x), (const T *)gp_ptr(w), (const T *)gp_ptr(dout), nullptr,
                                 (const float *)gp_ptr(rstd), (T *)gp_ptr(dx), D, (const T *)gp_ptr(dres)};
      done = norm_bwd_fused<T, true, true>(&rc, name, op, rmsouts, R, al, accumulate);
      if (!done) rc = rows_launch<T>(name, op, R, D, al);
    } else {
      NormDxOp<T, true> op{(const T *)gp_ptr(x), (const T *)gp_ptr(w), (const T *)gp_ptr(dout), nullptr,
                           (const float *)gp_ptr(rstd), (T *)gp_ptr(dx), D};
      done = norm_bwd_fused<T, true, false>(&rc, name, op, rmsouts, R, al, accumulate);
      if (!done) rc = rows_launch<T>(name, op, R, D, al);
    }
    if (!done && rc == GP_OK) rc = norm_dw<T>(name, dw, nullptr, x, nullptr, rstd, dout, accumulate);
  });
  return rc;
}
