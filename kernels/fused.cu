/* fused.cu: SwiGLU forward/backward (16-byte vectors and a tail), residual
 * add + RMSNorm (row engine of rows.cuh), bias + GELU (bias vector held in
 * registers while a thread walks down the rows). All math in f32. */
#include "ew_launch.cuh"
#include "gelu.cuh"
#include "mma.cuh"
#include "fused.h"
#include "rows.cuh"
#include "rows.h"

__device__ __forceinline__ float silu_f(float g) { return g / (1.f + __expf(-g)); }

template <typename T> struct SwigluF {
  __device__ T operator()(T g, T u) const { return st<T>(silu_f(ld(g)) * ld(u)); }
};

extern "C" int gp_cuda_swiglu(gp_tensor *out, const gp_tensor *gate, const gp_tensor *up) {
  int rc = GP_OK;
  GP_FLOAT_SWITCH(out->dtype, T, rc = gp_ew_launch<2, T, T, T>("swiglu", out, gate, up, SwigluF<T>{}));
  return rc;
}

template <typename T> __device__ __forceinline__ void swiglu_bwd1(T g_, T u_, T d_, T &dg, T &du) {
  const float g = ld(g_), u = ld(u_), d = ld(d_), s = 1.f / (1.f + __expf(-g));
  dg = st<T>(d * u * s * (1.f + g * (1.f - s)));
  du = st<T>(d * g * s);
}

/* contiguous operands; V > 1 only when all five pointers are 16-byte aligned */
template <typename T, int V>
__global__ void k_swiglu_bwd(T *__restrict__ dg, T *__restrict__ du, const T *__restrict__ g, const T *__restrict__ u,
                             const T *__restrict__ d, int64_t n) {
  typedef rowvec<T, V> VT;
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  const int64_t nv = n / V;
  for (int64_t i = tid; i < nv; i += nth) {
    VT a = reinterpret_cast<const VT *>(g)[i], b = reinterpret_cast<const VT *>(u)[i],
       c = reinterpret_cast<const VT *>(d)[i], x, y;
#pragma unroll
    for (int e = 0; e < V; e++) swiglu_bwd1(a.v[e], b.v[e], c.v[e], x.v[e], y.v[e]);
    reinterpret_cast<VT *>(dg)[i] = x;
    reinterpret_cast<VT *>(du)[i] = y;
  }
  for (int64_t i = nv * V + tid; i < n; i += nth) swiglu_bwd1(g[i], u[i], d[i], dg[i], du[i]);
}

/* the five operands as rows of D (stride 1 along a row): the leading dims,
 * merged where all five allow it, and each operand's strides over them */
struct SwigluRows {
  int nl;
  int64_t rows, D;
  int64_t shape[GP_MAX_DIMS];
  int64_t stride[5][GP_MAX_DIMS];
};

/* row-strided operands (gate and up column blocks of one product, dgate and
 * dup those of one gradient); a thread takes V elements of a row (V > 1 only
 * when D, every stride and every pointer allow 16-byte vectors). NL1: one
 * leading dim after merging, each operand's row r at r * its row stride. */
template <typename T, int V, bool NL1>
__global__ void k_swiglu_bwd_rows(T *__restrict__ dg, T *__restrict__ du, const T *__restrict__ g,
                                  const T *__restrict__ u, const T *__restrict__ d, const SwigluRows L) {
  typedef rowvec<T, V> VT;
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  const int64_t dv = L.D / V, n = L.rows * dv;
  for (int64_t i = tid; i < n; i += nth) {
    const int64_t r = i / dv, c = (i - r * dv) * V;
    int64_t off[5];
    if constexpr (NL1) {
#pragma unroll
      for (int k = 0; k < 5; k++) off[k] = r * L.stride[k][0] + c;
    } else {
#pragma unroll
      for (int k = 0; k < 5; k++) off[k] = c;
      int64_t rem = r;
      for (int dd = L.nl - 1; dd >= 0; dd--) {
        const int64_t q = rem / L.shape[dd], idx = rem - q * L.shape[dd];
#pragma unroll
        for (int k = 0; k < 5; k++) off[k] += idx * L.stride[k][dd];
        rem = q;
      }
    }
    VT a = *reinterpret_cast<const VT *>(g + off[2]), b = *reinterpret_cast<const VT *>(u + off[3]),
       e = *reinterpret_cast<const VT *>(d + off[4]), x, y;
#pragma unroll
    for (int j = 0; j < V; j++) swiglu_bwd1(a.v[j], b.v[j], e.v[j], x.v[j], y.v[j]);
    *reinterpret_cast<VT *>(dg + off[0]) = x;
    *reinterpret_cast<VT *>(du + off[1]) = y;
  }
}

extern "C" int gp_cuda_swiglu_backward(gp_tensor *dgate, gp_tensor *dup, const gp_tensor *gate, const gp_tensor *up,
                                       const gp_tensor *dout) {
  const int64_t n = gp_numel(gate);
  if (n == 0) return GP_OK;
  const gp_tensor *ops[5] = {dgate, dup, gate, up, dout};
  /* the leading dims: size-1 dims dropped, a dim merged into the one before where every operand allows it */
  SwigluRows L;
  L.D = gp_cols_of(gate);
  L.rows = gp_rows_of(gate);
  int m = 0;
  for (int dd = 0; dd < gate->ndim - 1; dd++) {
    if (gate->shape[dd] == 1) continue;
    bool merge = m > 0;
    for (int k = 0; merge && k < 5; k++) merge = L.stride[k][m - 1] == ops[k]->stride[dd] * gate->shape[dd];
    if (merge) {
      L.shape[m - 1] *= gate->shape[dd];
      for (int k = 0; k < 5; k++) L.stride[k][m - 1] = ops[k]->stride[dd];
    } else {
      L.shape[m] = gate->shape[dd];
      for (int k = 0; k < 5; k++) L.stride[k][m] = ops[k]->stride[dd];
      m++;
    }
  }
  if (m == 0) { /* one row */
    L.shape[0] = 1;
    for (int k = 0; k < 5; k++) L.stride[k][0] = 0;
    m = 1;
  }
  L.nl = m;
  /* dense: every operand's rows back to back (along a row the stride is 1 by the spec, or D is 1) */
  bool dense = m == 1;
  for (int k = 0; dense && k < 5; k++) dense = L.stride[k][0] == L.D || L.shape[0] == 1;
  cudaStream_t s = gp_cuda_stream();
  GP_FLOAT_SWITCH(gate->dtype, T, {
    constexpr int V = 16 / sizeof(T);
    T *a = (T *)gp_ptr(dgate), *b = (T *)gp_ptr(dup);
    const T *g = (const T *)gp_ptr(gate), *u = (const T *)gp_ptr(up), *d = (const T *)gp_ptr(dout);
    bool al = al16(a) && al16(b) && al16(g) && al16(u) && al16(d);
    if (dense) {
      if (al) k_swiglu_bwd<T, V><<<gp_grid((n + V - 1) / V, 256), 256, 0, s>>>(a, b, g, u, d, n);
      else k_swiglu_bwd<T, 1><<<gp_grid(n, 256), 256, 0, s>>>(a, b, g, u, d, n);
    } else {
      bool vec = al && L.D % V == 0;
      for (int k = 0; vec && k < 5; k++)
        for (int dd = 0; vec && dd < m; dd++) vec = L.stride[k][dd] % V == 0;
      const unsigned grid = gp_grid(vec ? n / V : n, 256);
      if (vec && m == 1) k_swiglu_bwd_rows<T, V, true><<<grid, 256, 0, s>>>(a, b, g, u, d, L);
      else if (vec) k_swiglu_bwd_rows<T, V, false><<<grid, 256, 0, s>>>(a, b, g, u, d, L);
      else if (m == 1) k_swiglu_bwd_rows<T, 1, true><<<grid, 256, 0, s>>>(a, b, g, u, d, L);
      else k_swiglu_bwd_rows<T, 1, false><<<grid, 256, 0, s>>>(a, b, g, u, d, L);
    }
  });
  return gp_cuda_check_launch("swiglu_backward");
}

/* ---- residual add + RMSNorm or LayerNorm: r = round(x + res) is stored and normalized ---- */
template <typename T, bool RMS> struct AddNormOp {
  const T *x, *res, *w, *b; /* b, mean: LayerNorm's */
  T *o, *ro;
  float *mean, *rstd;
  int64_t D;
  float eps;
  template <int V, int NV> __device__ __forceinline__ void run(int64_t row, int lane, int tpr, float *sh) const {
    float v[NV * V], q[NV * V];
    row_load<T, V, NV>(x + row * D, D, lane, tpr, v, 0.f);
    row_load<T, V, NV>(res + row * D, D, lane, tpr, q, 0.f);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < NV * V; i++) {
      v[i] = ld(st<T>(v[i] + q[i]));
      s += RMS ? v[i] * v[i] : v[i];
    }
    row_store<T, V, NV>(ro + row * D, D, lane, tpr, v);
    float mu = 0.f, rs;
    if (RMS) {
      rs = rsqrtf(group_sum(s, tpr, sh) / (float)D + eps);
    } else {
      mu = group_sum(s, tpr, sh) / (float)D;
      rs = rsqrtf(group_sum(row_dev2<V, NV, true>(v, mu, lane, tpr, D), tpr, sh) / (float)D + eps);
    }
    row_load<T, V, NV, false>(w, D, lane, tpr, q, 0.f);
#pragma unroll
    for (int i = 0; i < NV * V; i++) v[i] = (v[i] - mu) * rs * q[i];
    if (!RMS) {
      row_load<T, V, NV, false>(b, D, lane, tpr, q, 0.f);
#pragma unroll
      for (int i = 0; i < NV * V; i++) v[i] += q[i];
    }
    row_store<T, V, NV>(o + row * D, D, lane, tpr, v);
    if (lane == 0) {
      if (!RMS) mean[row] = mu;
      rstd[row] = rs;
    }
  }
  /* pass 2 reads back res_out, each thread the elements it wrote itself */
  __device__ void loop(int64_t row, float *sh) const {
    const int64_t o0 = row * D;
    float s = 0.f;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      T r = st<T>(ld(x[o0 + j]) + ld(res[o0 + j]));
      ro[o0 + j] = r;
      float v = ld(r);
      s += RMS ? v * v : v;
    }
    float mu = 0.f, rs;
    if (RMS) {
      rs = rsqrtf(block_sum(s, sh) / (float)D + eps);
    } else {
      mu = block_sum(s, sh) / (float)D;
      float d2 = 0.f;
      for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        const float d = ld(ro[o0 + j]) - mu;
        d2 += d * d;
      }
      rs = rsqrtf(block_sum(d2, sh) / (float)D + eps);
    }
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      float y = (ld(ro[o0 + j]) - mu) * rs * ld(w[j]);
      if (!RMS) y += ld(b[j]);
      o[o0 + j] = st<T>(y);
    }
    if (threadIdx.x == 0) {
      if (!RMS) mean[row] = mu;
      rstd[row] = rs;
    }
  }
};

/* add_rms_norm (b and mean null) and add_layer_norm: chain kernels (rows_launch given the spans written) */
static int add_norm(const char *name, gp_tensor *out, gp_tensor *res_out, gp_tensor *mean, gp_tensor *rstd,
                    const gp_tensor *x, const gp_tensor *res, const gp_tensor *w, const gp_tensor *b, double eps) {
  int64_t R = gp_rows_of(x), D = gp_cols_of(x);
  int rc = GP_OK;
  bool al = al16(gp_ptr(x)) && al16(gp_ptr(res)) && al16(gp_ptr(w)) && (!b || al16(gp_ptr(b))) && al16(gp_ptr(out)) &&
            al16(gp_ptr(res_out));
  const gp_spans wr = mean ? gp_spans{gp_span_of(out), gp_span_of(res_out), gp_span_of(mean), gp_span_of(rstd)}
                           : gp_spans{gp_span_of(out), gp_span_of(res_out), gp_span_of(rstd)};
  GP_FLOAT_SWITCH(x->dtype, T, {
    const T *pb = b ? (const T *)gp_ptr(b) : nullptr;
    float *pm = mean ? (float *)gp_ptr(mean) : nullptr;
    if (b) {
      AddNormOp<T, false> op{(const T *)gp_ptr(x), (const T *)gp_ptr(res), (const T *)gp_ptr(w), pb, (T *)gp_ptr(out),
                             (T *)gp_ptr(res_out), pm, (float *)gp_ptr(rstd), D, (float)eps};
      rc = rows_launch<T>(name, op, R, D, al, wr);
    } else {
      AddNormOp<T, true> op{(const T *)gp_ptr(x), (const T *)gp_ptr(res), (const T *)gp_ptr(w), pb, (T *)gp_ptr(out),
                            (T *)gp_ptr(res_out), pm, (float *)gp_ptr(rstd), D, (float)eps};
      rc = rows_launch<T>(name, op, R, D, al, wr);
    }
  });
  return rc;
}

extern "C" int gp_cuda_add_rms_norm(gp_tensor *out, gp_tensor *res_out, gp_tensor *rstd, const gp_tensor *x,
                                    const gp_tensor *res, const gp_tensor *w, double eps) {
  return add_norm("add_rms_norm", out, res_out, nullptr, rstd, x, res, w, nullptr, eps);
}

extern "C" int gp_cuda_add_layer_norm(gp_tensor *out, gp_tensor *res_out, gp_tensor *mean, gp_tensor *rstd,
                                      const gp_tensor *x, const gp_tensor *res, const gp_tensor *w, const gp_tensor *b,
                                      double eps) {
  return add_norm("add_layer_norm", out, res_out, mean, rstd, x, res, w, b, eps);
}

/* ---- bias + GELU ---- */
__device__ __forceinline__ float gelu_f(float v) { return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)); }

/* threads across (vectors of) columns, each with its bias in registers, striding over rows */
template <typename T, int V>
__global__ void k_bias_gelu(const T *__restrict__ x, const T *__restrict__ b, T *__restrict__ o, int64_t R, int64_t D) {
  typedef rowvec<T, V> VT;
  const int64_t jv = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (jv * V >= D) return;
  float bv[V];
  if constexpr (V > 1) {
    VT t = reinterpret_cast<const VT *>(b)[jv];
#pragma unroll
    for (int e = 0; e < V; e++) bv[e] = ld(t.v[e]);
  } else {
    bv[0] = ld(b[jv]);
  }
  for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
    const int64_t i = r * D + jv * V;
    VT t = *reinterpret_cast<const VT *>(x + i), y;
#pragma unroll
    for (int e = 0; e < V; e++) y.v[e] = st<T>(gelu_f(ld(t.v[e]) + bv[e]));
    *reinterpret_cast<VT *>(o + i) = y;
  }
}

/* short rows: flat over all elements */
template <typename T>
__global__ void k_bias_gelu_flat(const T *__restrict__ x, const T *__restrict__ b, T *__restrict__ o, int64_t n, int64_t D) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    o[i] = st<T>(gelu_f(ld(x[i]) + ld(b[i % D])));
}

extern "C" int gp_cuda_bias_gelu(gp_tensor *out, const gp_tensor *x, const gp_tensor *b) {
  const int64_t R = gp_rows_of(x), D = gp_cols_of(x), n = R * D;
  if (n == 0) return GP_OK;
  cudaStream_t s = gp_cuda_stream();
  const bool al = al16(gp_ptr(x)) && al16(gp_ptr(b)) && al16(gp_ptr(out));
  GP_FLOAT_SWITCH(x->dtype, T, {
    constexpr int VV = 16 / sizeof(T);
    const T *px = (const T *)gp_ptr(x), *pb = (const T *)gp_ptr(b);
    T *po = (T *)gp_ptr(out);
    if (D < 64) {
      k_bias_gelu_flat<T><<<gp_grid(n, 256), 256, 0, s>>>(px, pb, po, n, D);
    } else {
      const bool vec = al && D % VV == 0;
      const int64_t ncol = vec ? D / VV : D;
      const int block = ncol >= 256 ? 256 : (int)((ncol + 31) / 32 * 32);
      const int64_t gx = (ncol + block - 1) / block, target = (int64_t)gp_cuda_sm_count() * 32;
      int64_t gy = (target + gx - 1) / gx;
      if (gy > R) gy = R;
      if (gy > 65535) gy = 65535;
      if (gy < 1) gy = 1;
      dim3 grid((unsigned)gx, (unsigned)gy);
      if (vec) k_bias_gelu<T, VV><<<grid, block, 0, s>>>(px, pb, po, R, D);
      else k_bias_gelu<T, 1><<<grid, block, 0, s>>>(px, pb, po, R, D);
    }
  });
  return gp_cuda_check_launch("bias_gelu");
}

/* swiglu_linear and rows_linear: a warp a row of w: the row's first 8
 * 16-byte vectors a lane are loaded into registers first, then the block
 * stages the rows of x in shared memory while they arrive (SW: the rows'
 * SwiGLU of [gate | up], in x's dtype as gp.swiglu would write it), then
 * every lane sums its products with each staged row in f32, a warp sum, one
 * write a row and output (rows_linear_bias: plus the bias and, act 1, GELU's
 * tanh form, in f32 before the one rounding, as cuBLASLt's epilogues). VEC: I
 * a multiple of the vector and w 16-byte aligned. A chain kernel
 * (cuda_internal.h): w is read before the wait, x and the bias after it. */
namespace {
constexpr int SWL_PRE = 8; /* 16-byte vectors of a row a lane holds in registers */
template <typename T, int MT, bool VEC, bool SW>
__global__ void __launch_bounds__(256) k_swiglu_linear(T *__restrict__ out, const T *__restrict__ gu,
                                                      const T *__restrict__ w, const T *__restrict__ bias, int act,
                                                      int M, int N, int I) {
  extern __shared__ __align__(16) unsigned char swl_smem[];
  T *xs = reinterpret_cast<T *>(swl_smem);
  constexpr int V = 16 / (int)sizeof(T);
  const int lane = threadIdx.x & 31, n = blockIdx.x * 8 + (threadIdx.x >> 5);
  const T *wr = w + (int64_t)min(n, N - 1) * I;
  uint4 pre[SWL_PRE];
  gp_pdl_trigger();
  if constexpr (VEC) {
#pragma unroll
    for (int j = 0; j < SWL_PRE; j++) {
      const int k = (j * 32 + lane) * V;
      pre[j] = k < I ? __ldg(reinterpret_cast<const uint4 *>(wr + k)) : make_uint4(0, 0, 0, 0);
    }
  }
  gp_pdl_wait(); /* w's loads issued; x is the kernel before's output */
  for (int e = threadIdx.x; e < M * I; e += blockDim.x) {
    if constexpr (SW) {
      const int m = e / I, i = e - m * I;
      const T *row = gu + (int64_t)m * 2 * I;
      xs[e] = st<T>(silu_f(ld(row[i])) * ld(row[I + i]));
    } else {
      xs[e] = gu[e];
    }
  }
  __syncthreads();
  if (n >= N) return;
  float acc[MT];
#pragma unroll
  for (int m = 0; m < MT; m++) acc[m] = 0.f;
  auto dot = [&](const uint4 &wv, int k) {
    const T *we = reinterpret_cast<const T *>(&wv);
#pragma unroll
    for (int m = 0; m < MT; m++) {
      if (m < M) {
        const uint4 xv = *reinterpret_cast<const uint4 *>(xs + m * I + k);
        const T *xe = reinterpret_cast<const T *>(&xv);
#pragma unroll
        for (int v = 0; v < V; v++) acc[m] = fmaf(ld(we[v]), ld(xe[v]), acc[m]);
      }
    }
  };
  int i0 = 0;
  if constexpr (VEC) {
#pragma unroll
    for (int j = 0; j < SWL_PRE; j++) {
      const int k = (j * 32 + lane) * V;
      if (k < I) dot(pre[j], k);
    }
    for (int k = (SWL_PRE * 32 + lane) * V; k < I; k += 32 * V) dot(__ldg(reinterpret_cast<const uint4 *>(wr + k)), k);
    i0 = I;
  }
  for (int k = i0 + lane; k < I; k += 32) { /* not vectorized: element by element */
    const float wk = ld(wr[k]);
#pragma unroll
    for (int m = 0; m < MT; m++)
      if (m < M) acc[m] = fmaf(wk, ld(xs[m * I + k]), acc[m]);
  }
#pragma unroll
  for (int m = 0; m < MT; m++) {
    float s = acc[m];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (bias) s += ld(bias[n]);
    if (act) s = gp_gelu_tanh(s);
    if (lane == 0 && m < M) out[(int64_t)m * N + n] = st<T>(s);
  }
}

template <typename T, int MT, bool SW>
void launch_swiglu_linear(gp_tensor *out, const gp_tensor *gu, const gp_tensor *w, const gp_tensor *b, int act) {
  const int M = (int)out->shape[0], N = (int)out->shape[1], I = (int)w->shape[1];
  const bool vec = I % (16 / (int)sizeof(T)) == 0 && ((uintptr_t)gp_ptr(w) & 15) == 0;
  const int smem = M * I * (int)sizeof(T);
  const unsigned grid = (unsigned)((N + 7) / 8);
  T *po = (T *)gp_ptr(out);
  const T *pg = (const T *)gp_ptr(gu), *pw = (const T *)gp_ptr(w), *pb = b ? (const T *)gp_ptr(b) : nullptr;
  /* a chain kernel (cuda_internal.h): w is read before the wait (the bias after it, with x) */
  auto go = [&](auto k) {
    gp_launch_chain(k, dim3(grid), dim3(256), smem, {gp_span_of(w)}, {gp_span_of(out)}, po, pg, pw, pb, act, M, N, I);
  };
  if (vec) go(k_swiglu_linear<T, MT, true, SW>);
  else go(k_swiglu_linear<T, MT, false, SW>);
}
/* The same products on tensor cores, for 16-bit x with K a multiple of 32
 * (up to 16 rows): mma.sync m16n8k16, 16 rows of w the A operand, 8 rows of
 * x the B operand (an n-tile; NT of them), f32 accumulators. Lane (g, t)
 * loads 16 bytes of w's rows g and g + 8 in each 32-element span of K,
 * elements 8 t .. 8 t + 7: its A registers for the span's two products
 * (elements 8t + 0..3, then 8t + 4..7: K's order inside a product is free
 * as long as A and B agree), and row g of the n-tile's x gives the same
 * elements in one 16-byte load (SW: the SwiGLU of [gate | up] there, rounded
 * as gp.swiglu writes it). A CUDA block takes 16 rows of w: its S warps
 * split K (at most RM_SPANS spans a warp in flight: every load of a warp's
 * slice is issued before its first product) and add their sums in shared
 * memory in warp order (deterministic). A chain kernel: w's first loads are
 * issued before the wait, x and the bias read after it. */
constexpr int RM_SPANS = 8, RM_WARPS = 8;
template <typename T, bool SW> __device__ __forceinline__ uint4 rm_x(const T *x, int64_t stride, int row, int k, int K) {
  const T *p = x + (int64_t)row * stride + k;
  const uint4 v = __ldg(reinterpret_cast<const uint4 *>(p));
  if constexpr (!SW) {
    return v;
  } else {
    const uint4 u = __ldg(reinterpret_cast<const uint4 *>(p + K));
    const T *ge = reinterpret_cast<const T *>(&v), *ue = reinterpret_cast<const T *>(&u);
    uint4 r;
    T *re = reinterpret_cast<T *>(&r);
#pragma unroll
    for (int e = 0; e < 8; e++) re[e] = st<T>(silu_f(ld(ge[e])) * ld(ue[e]));
    return r;
  }
}

template <typename T, int NT, bool SW>
__global__ void __launch_bounds__(32 * RM_WARPS) k_rows_mma(T *__restrict__ out, const T *__restrict__ x,
                                                           const T *__restrict__ w, const T *__restrict__ bias,
                                                           int act, int M, int N, int K, int sps) {
  extern __shared__ float rm_red[]; /* (warp, NT * 4, lane) */
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, S = blockDim.x >> 5, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * 16, spans = K >> 5;
  const int sp0 = warp * sps, sp1 = min(spans, sp0 + sps);
  const int64_t ldx = SW ? 2 * (int64_t)K : K;
  const T *wa_p = w + (int64_t)min(n0 + g, N - 1) * K + 8 * t, *wb_p = w + (int64_t)min(n0 + g + 8, N - 1) * K + 8 * t;
  uint4 wa[RM_SPANS], wb[RM_SPANS];
  auto load = [&](int s0) {
#pragma unroll
    for (int j = 0; j < RM_SPANS; j++)
      if (s0 + j < sp1) {
        wa[j] = __ldg(reinterpret_cast<const uint4 *>(wa_p + (int64_t)(s0 + j) * 32));
        wb[j] = __ldg(reinterpret_cast<const uint4 *>(wb_p + (int64_t)(s0 + j) * 32));
      }
  };
  gp_pdl_trigger();
  load(sp0);
  gp_pdl_wait(); /* w's loads issued; x is the kernel before's output */
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  constexpr int XS = RM_SPANS / NT; /* spans of x loaded at once (registers: XS NT 16-byte pieces) */
  for (int s0 = sp0; s0 < sp1; s0 += RM_SPANS) {
    if (s0 != sp0) load(s0);
#pragma unroll
    for (int j0 = 0; j0 < RM_SPANS; j0 += XS) {
      /* x's pieces of XS spans, all loads issued before the first product (rows past M load the last row: their
       * sums land in columns not written) */
      uint4 xv[XS][NT];
#pragma unroll
      for (int j = 0; j < XS; j++)
#pragma unroll
        for (int n = 0; n < NT; n++)
          if (s0 + j0 + j < sp1) xv[j][n] = rm_x<T, SW>(x, ldx, min(8 * n + g, M - 1), (s0 + j0 + j) * 32 + 8 * t, K);
#pragma unroll
      for (int j = 0; j < XS; j++) {
        if (s0 + j0 + j < sp1) {
          const uint4 &a = wa[j0 + j], &b = wb[j0 + j];
          const uint32_t a0[4] = {a.x, b.x, a.y, b.y}, a1[4] = {a.z, b.z, a.w, b.w};
#pragma unroll
          for (int n = 0; n < NT; n++) {
            mma_16816<T>(acc[n], a0, xv[j][n].x, xv[j][n].y);
            mma_16816<T>(acc[n], a1, xv[j][n].z, xv[j][n].w);
          }
        }
      }
    }
  }
  if (S > 1) {
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) rm_red[((warp * NT + n) * 4 + e) * 32 + lane] = acc[n][e];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        float sum = 0.f;
        for (int k = 0; k < S; k++) sum += rm_red[((k * NT + n) * 4 + e) * 32 + lane];
        acc[n][e] = sum;
      }
  }
  /* C[w row g (+ 8)][x row 2t (+ 1)] */
#pragma unroll
  for (int n = 0; n < NT; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int m = 8 * n + 2 * t + (e & 1), row = n0 + g + 8 * (e >> 1);
      if (m < M && row < N) {
        float v = acc[n][e];
        if (bias) v += ld(bias[row]);
        if (act) v = gp_gelu_tanh(v);
        out[(int64_t)m * N + row] = st<T>(v);
      }
    }
}

template <typename T, int NT, bool SW>
void launch_rows_mma(gp_tensor *out, const gp_tensor *x, const gp_tensor *w, const gp_tensor *b, int act) {
  const int M = (int)out->shape[0], N = (int)out->shape[1], K = (int)w->shape[1], spans = K / 32;
  int S = (spans + RM_SPANS - 1) / RM_SPANS;
  if (S > RM_WARPS) S = RM_WARPS;
  if (S < 1) S = 1;
  const int sps = (spans + S - 1) / S;
  S = (spans + sps - 1) / sps;
  const int smem = S > 1 ? S * NT * 4 * 32 * (int)sizeof(float) : 0;
  T *po = (T *)gp_ptr(out);
  const T *px = (const T *)gp_ptr(x), *pw = (const T *)gp_ptr(w), *pb = b ? (const T *)gp_ptr(b) : nullptr;
  gp_launch_chain(k_rows_mma<T, NT, SW>, dim3((unsigned)((N + 15) / 16)), dim3(32 * S), smem, {gp_span_of(w)},
                  {gp_span_of(out)}, po, px, pw, pb, act, M, N, K, sps);
}

/* the tensor-core kernel: 16-bit, K a multiple of 32 (w's rows in 16-byte pieces), aligned x and w, at most 16
 * rows; taken for 2 to 16 rows (SwiGLU's: past the other kernel's 4) and for one row whose K is over 1024 or over
 * the other kernel's 48 KB, where splitting K between warps wins (H200: 4.4 against 6.9 us at 2816 -> 1024).
 * GPUSH_ROWS_MMA=0 never, 1 for every row count (for comparisons) */
bool rows_mma_ok(const gp_tensor *out, const gp_tensor *x, const gp_tensor *w, bool sw) {
  static const int mode = [] {
    const char *e = getenv("GPUSH_ROWS_MMA");
    return e ? atoi(e) : 2;
  }();
  const int64_t M = out->shape[0], K = w->shape[1];
  const bool staged = M <= 4 && M * K * (int64_t)gp_elsize(out->dtype) <= 48 * 1024; /* the other kernel can */
  const bool want = mode == 1 || !staged || (M == 1 ? K > 1024 : !sw);
  return mode != 0 && want && M <= 16 && (out->dtype == GP_BF16 || out->dtype == GP_F16) && K % 32 == 0 && K > 0 &&
         (((uintptr_t)gp_ptr(x) | (uintptr_t)gp_ptr(w)) & 15) == 0;
}

template <bool SW>
int swiglu_or_rows(gp_tensor *out, const gp_tensor *x, const gp_tensor *w, const gp_tensor *b = nullptr, int act = 0) {
  const int64_t M = out->shape[0], N = out->shape[1];
  if (M == 0 || N == 0) return GP_OK;
  if (rows_mma_ok(out, x, w, SW)) {
    if (out->dtype == GP_BF16) {
      if (M <= 8) launch_rows_mma<__nv_bfloat16, 1, SW>(out, x, w, b, act);
      else launch_rows_mma<__nv_bfloat16, 2, SW>(out, x, w, b, act);
    } else {
      if (M <= 8) launch_rows_mma<__half, 1, SW>(out, x, w, b, act);
      else launch_rows_mma<__half, 2, SW>(out, x, w, b, act);
    }
    return gp_cuda_check_launch(SW ? "swiglu_linear" : b ? "rows_linear_bias" : "rows_linear");
  }
  if (M > 4 || M * w->shape[1] * (int64_t)gp_elsize(out->dtype) > 48 * 1024)
    return gp_error("%s: %lld rows of %lld need the tensor-core kernel (bf16 or f16, K a multiple of 32, x and w "
                    "16-byte aligned; the other kernel holds 4 rows in 48 KB)",
                    SW ? "swiglu_linear" : b ? "rows_linear_bias" : "rows_linear", (long long)M,
                    (long long)w->shape[1]);
  GP_FLOAT_SWITCH(out->dtype, T, {
    if (M <= 1) launch_swiglu_linear<T, 1, SW>(out, x, w, b, act);
    else if (M <= 2) launch_swiglu_linear<T, 2, SW>(out, x, w, b, act);
    else launch_swiglu_linear<T, 4, SW>(out, x, w, b, act);
  });
  return gp_cuda_check_launch(SW ? "swiglu_linear" : b ? "rows_linear_bias" : "rows_linear");
}
} // namespace

extern "C" int gp_cuda_swiglu_linear(gp_tensor *out, const gp_tensor *gu, const gp_tensor *w) {
  return swiglu_or_rows<true>(out, gu, w);
}

extern "C" int gp_cuda_rows_linear(gp_tensor *out, const gp_tensor *x, const gp_tensor *w) {
  return swiglu_or_rows<false>(out, x, w);
}

extern "C" int gp_cuda_rows_linear_bias(gp_tensor *out, const gp_tensor *x, const gp_tensor *w, const gp_tensor *b,
                                        int act) {
  return swiglu_or_rows<false>(out, x, w, b, act);
}
