/* index.cu: embedding, gather, index_select and scatter_add on the GPU.
 * Copies move raw element bits (dtype-agnostic); embedding rows move in the
 * widest aligned unit up to 16 bytes. Accumulating kernels add in f32 with
 * atomics (into the output when it is f32, else into an f32 scratch that is
 * then rounded; embedding_backward: into the scratch rows idx names, then
 * added to dweight), so their sums are not bitwise deterministic. */
#include "bad_index.cuh"

template <typename I> __device__ __forceinline__ int64_t ldi(const I *p, int64_t i) { return (int64_t)p[i]; }

template <typename U, typename I>
__global__ void k_embedding(U *o, const U *w, const I *idx, int64_t n, int64_t v, int64_t upr, gp_bad_ref bad) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  int64_t total = n * upr;
  for (int64_t u = tid; u < total; u += nth) {
    int64_t i = u / upr, j = u - i * upr;
    int64_t r = ldi(idx, i);
    if (r < 0 || r >= v) {
      gp_report_bad(bad, r);
      o[u] = U{};
    } else {
      o[u] = w[r * upr + j];
    }
  }
}

template <typename U> static void launch_embedding(gp_tensor *out, const gp_tensor *weight, const gp_tensor *idx, int64_t n,
                                                   int64_t v, gp_bad_ref bad, int64_t upr) {
  int64_t total = n * upr;
  unsigned g = gp_grid(total, 256);
  if (idx->dtype == GP_I32)
    k_embedding<U, int32_t><<<g, 256, 0, gp_cuda_stream()>>>((U *)gp_ptr(out), (const U *)gp_ptr(weight),
                                                               (const int32_t *)gp_ptr(idx), n, v, upr, bad);
  else
    k_embedding<U, int64_t><<<g, 256, 0, gp_cuda_stream()>>>((U *)gp_ptr(out), (const U *)gp_ptr(weight),
                                                               (const int64_t *)gp_ptr(idx), n, v, upr, bad);
}

extern "C" int gp_cuda_embedding(gp_tensor *out, const gp_tensor *weight, const gp_tensor *idx, int64_t n, int64_t v,
                                 int64_t d) {
  if (n == 0 || d == 0) return GP_OK;
  gp_bad_ref bad;
  GP_TRY(gp_bad_begin(&bad, "embedding", v, "weight's rows"));
  int64_t rb = d * gp_elsize(out->dtype);
  uintptr_t al = (uintptr_t)gp_ptr(out) | (uintptr_t)gp_ptr(weight) | (uintptr_t)rb;
  if (al % 16 == 0) launch_embedding<uint4>(out, weight, idx, n, v, bad, rb / 16);
  else if (al % 8 == 0) launch_embedding<uint2>(out, weight, idx, n, v, bad, rb / 8);
  else if (al % 4 == 0) launch_embedding<uint32_t>(out, weight, idx, n, v, bad, rb / 4);
  else if (al % 2 == 0) launch_embedding<uint16_t>(out, weight, idx, n, v, bad, rb / 2);
  else launch_embedding<uint8_t>(out, weight, idx, n, v, bad, rb);
  return gp_bad_end("embedding");
}

/* embedding_backward of a bf16/f16 dweight in three passes, a block a
 * position of idx at a time, so that only the rows idx names are touched:
 * (1) zero their f32 accumulator rows and make the first position naming
 * each row its owner; (2) add the gradient row into the accumulator row
 * with atomics (4 floats an atomic where d allows); (3) each row's owner
 * adds its accumulator row into dweight (one writer a row). An f32 dweight
 * takes pass (2) alone, into itself. */
template <typename I>
__global__ void k_embedding_bwd_claim(float *acc, int *owner, const I *idx, int64_t n, int64_t v, int64_t d,
                                      gp_bad_ref bad) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t r = ldi(idx, i);
    if (r < 0 || r >= v) {
      if (threadIdx.x == 0) gp_report_bad(bad, r);
      continue;
    }
    if (threadIdx.x == 0) atomicMin(owner + r, (int)i);
    float *a = acc + r * d;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) a[j] = 0.f;
  }
}

/* V4: d % 4 == 0 (the accumulator's rows 16-byte aligned); report: bad
 * indices are reported here (an f32 dweight: no claim pass) */
template <typename T, typename I, bool V4>
__global__ void k_embedding_bwd(float *acc, const T *g, const I *idx, int64_t n, int64_t v, int64_t d, int report,
                                gp_bad_ref bad) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t r = ldi(idx, i);
    if (r < 0 || r >= v) {
      if (report && threadIdx.x == 0) gp_report_bad(bad, r);
      continue;
    }
    float *a = acc + r * d;
    const T *gi = g + i * d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (V4) {
      for (int64_t j = 4 * threadIdx.x; j < d; j += 4 * blockDim.x)
        atomicAdd((float4 *)(a + j), make_float4(ld(gi[j]), ld(gi[j + 1]), ld(gi[j + 2]), ld(gi[j + 3])));
      continue;
    }
#endif
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) atomicAdd(a + j, ld(gi[j]));
  }
}

template <typename T, typename I>
__global__ void k_embedding_bwd_flush(T *dw, const float *acc, const int *owner, const I *idx, int64_t n, int64_t v,
                                      int64_t d) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t r = ldi(idx, i);
    if (r < 0 || r >= v || owner[r] != (int)i) continue;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dw[r * d + j] = st<T>(ld(dw[r * d + j]) + acc[r * d + j]);
  }
}

template <typename T> __global__ void k_round(T *o, const float *a, int64_t n) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = tid; i < n; i += nth) o[i] = st<T>(a[i]);
}

/* an f32 accumulator for out: out itself when it is f32, else a scratch */
static int f32_acc(gp_tensor **scratch, float **acc, gp_tensor *out) {
  *scratch = 0;
  if (out->dtype == GP_F32) {
    *acc = (float *)gp_ptr(out);
    return GP_OK;
  }
  GP_TRY(gp_tensor_scratch(scratch, GP_F32, GP_CUDA, out->ndim, out->shape));
  *acc = (float *)gp_ptr(*scratch);
  return GP_OK;
}

static void f32_round(gp_tensor *out, const float *acc, int64_t n) {
  if (out->dtype == GP_F32 || n == 0) return;
  GP_FLOAT_SWITCH(out->dtype, T, k_round<T><<<gp_grid(n, 256), 256, 0, gp_cuda_stream()>>>((T *)gp_ptr(out), acc, n));
}

extern "C" int gp_cuda_embedding_backward(gp_tensor *dweight, const gp_tensor *dout, const gp_tensor *idx, int64_t n,
                                          int64_t v, int64_t d, int accumulate) {
  int64_t vd = v * d;
  if (vd == 0) return GP_OK;
  cudaStream_t st = gp_cuda_stream();
  if (!accumulate) {
    cudaError_t e = cudaMemsetAsync(gp_ptr(dweight), 0, (size_t)vd * gp_elsize(dweight->dtype), st);
    if (e != cudaSuccess) return gp_error("embedding_backward: %s", cudaGetErrorString(e));
  }
  if (n * d == 0) return GP_OK;
  /* positions stay below the owners' initial 0x7f7f7f7f */
  if (n >= 0x7f7f7f7fLL) return gp_error("embedding_backward: %lld indices; fewer than %d", (long long)n, 0x7f7f7f7f);
  const bool f32 = dweight->dtype == GP_F32; /* dweight is the accumulator: atomics straight into it */
  const bool i32 = idx->dtype == GP_I32;
  const void *pi = gp_ptr(idx);
  /* a block a position (grid-stride), its threads along the row */
  const int64_t cap = (int64_t)gp_cuda_sm_count() * 32;
  const unsigned g = (unsigned)(n < cap ? n : cap);
  const int64_t lanes = d % 4 == 0 ? d / 4 : d;
  const int th = lanes >= 256 ? 256 : (int)((lanes + 31) / 32 * 32);
  gp_tensor *scratch = nullptr;
  void *ob = nullptr;
  size_t obytes = 0;
  float *acc = (float *)gp_ptr(dweight);
  int *owner = nullptr;
  if (!f32) {
    int64_t shape[2] = {v, d};
    GP_TRY(gp_tensor_scratch(&scratch, GP_F32, GP_CUDA, 2, shape));
    acc = (float *)gp_ptr(scratch);
    int rc = gp_alloc(&ob, &obytes, (size_t)v * sizeof(int), GP_CUDA);
    if (rc != GP_OK) {
      gp_tensor_free(scratch);
      return rc;
    }
    owner = (int *)ob;
  }
  const bool v4 = d % 4 == 0 && (uintptr_t)acc % 16 == 0; /* float4 atomics on 16-byte aligned rows */
  gp_bad_ref bad;
  int rc = gp_bad_begin(&bad, "embedding_backward", v, "dweight's rows");
  if (rc == GP_OK && owner) {
    cudaError_t e = cudaMemsetAsync(owner, 0x7f, (size_t)v * sizeof(int), st); /* 0x7f7f7f7f: above any position */
    if (e != cudaSuccess) rc = gp_error("embedding_backward: %s", cudaGetErrorString(e));
    else if (i32) k_embedding_bwd_claim<int32_t><<<g, th, 0, st>>>(acc, owner, (const int32_t *)pi, n, v, d, bad);
    else k_embedding_bwd_claim<int64_t><<<g, th, 0, st>>>(acc, owner, (const int64_t *)pi, n, v, d, bad);
  }
  if (rc == GP_OK) {
    GP_FLOAT_SWITCH(dout->dtype, T, {
      const T *pg = (const T *)gp_ptr(dout);
      if (i32 && v4) k_embedding_bwd<T, int32_t, true><<<g, th, 0, st>>>(acc, pg, (const int32_t *)pi, n, v, d, f32, bad);
      else if (i32) k_embedding_bwd<T, int32_t, false><<<g, th, 0, st>>>(acc, pg, (const int32_t *)pi, n, v, d, f32, bad);
      else if (v4) k_embedding_bwd<T, int64_t, true><<<g, th, 0, st>>>(acc, pg, (const int64_t *)pi, n, v, d, f32, bad);
      else k_embedding_bwd<T, int64_t, false><<<g, th, 0, st>>>(acc, pg, (const int64_t *)pi, n, v, d, f32, bad);
    });
    if (owner) {
      GP_FLOAT_SWITCH(dweight->dtype, T, {
        T *pw = (T *)gp_ptr(dweight);
        if (i32) k_embedding_bwd_flush<T, int32_t><<<g, th, 0, st>>>(pw, acc, owner, (const int32_t *)pi, n, v, d);
        else k_embedding_bwd_flush<T, int64_t><<<g, th, 0, st>>>(pw, acc, owner, (const int64_t *)pi, n, v, d);
      });
    }
    rc = gp_bad_end("embedding_backward");
  }
  if (ob) gp_free(ob, obytes, GP_CUDA);
  gp_tensor_free(scratch);
  return rc;
}

/* 3-d geometry: out/idx contiguous [A,K,C]; x strided [A,B,C] */
struct g3 {
  int64_t A, K, C, B, sa, sb, sc;
};

/* one element a thread (rows shorter than a warp's worth) */
template <typename U, typename I>
__global__ void k_gather(U *o, const U *x, const I *idx, g3 g, int mode, gp_bad_ref bad) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  int64_t n = g.A * g.K * g.C;
  for (int64_t e = tid; e < n; e += nth) {
    int64_t c = e % g.C, ak = e / g.C, k = ak % g.K, a = ak / g.K;
    int64_t b = ldi(idx, mode == 0 ? e : k);
    if (b < 0 || b >= g.B) {
      gp_report_bad(bad, b);
      o[e] = U{};
    } else {
      o[e] = x[a * g.sa + b * g.sb + c * g.sc];
    }
  }
}

/* a warp a row r = a K + k of out, lanes along it: one division a row where the kernel above has two an
 * element (64-bit: they bound it, 0.21-0.25 of copy on the H200). SEL (index_select): the row copies x's row
 * idx[k], in units U of up to 16 bytes when x's rows are contiguous and aligned (g's strides and C in units);
 * else (gather) element c comes from x's row idx[r, c] */
template <typename U, typename I, bool SEL>
__global__ void k_gather_rows(U *o, const U *x, const I *idx, g3 g, gp_bad_ref bad) {
  const int lane = threadIdx.x & 31;
  const int64_t w0 = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5, nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t r = w0; r < g.A * g.K; r += nw) {
    const int64_t a = r / g.K;
    U *orow = o + r * g.C;
    if constexpr (SEL) {
      const int64_t b = ldi(idx, r - a * g.K);
      if (b < 0 || b >= g.B) {
        if (lane == 0) gp_report_bad(bad, b);
        for (int64_t c = lane; c < g.C; c += 32) orow[c] = U{};
      } else {
        const U *xrow = x + a * g.sa + b * g.sb;
        for (int64_t c = lane; c < g.C; c += 32) orow[c] = xrow[c * g.sc];
      }
    } else {
      const I *irow = idx + r * g.C;
      const U *xa = x + a * g.sa;
      for (int64_t c = lane; c < g.C; c += 32) {
        const int64_t b = ldi(irow, c);
        if (b < 0 || b >= g.B) {
          gp_report_bad(bad, b);
          orow[c] = U{};
        } else {
          orow[c] = xa[b * g.sb + c * g.sc];
        }
      }
    }
  }
}

template <typename U, typename I>
static void launch_gather_i(int mode, gp_tensor *out, const gp_tensor *x, const gp_tensor *idx, g3 g, gp_bad_ref bad) {
  U *po = (U *)gp_ptr(out);
  const U *px = (const U *)gp_ptr(x);
  const I *pi = (const I *)gp_ptr(idx);
  cudaStream_t s = gp_cuda_stream();
  if (g.C >= 16) { /* a warp a row */
    const unsigned gr = gp_grid(g.A * g.K * 32, 256);
    if (mode == 0) k_gather_rows<U, I, false><<<gr, 256, 0, s>>>(po, px, pi, g, bad);
    else k_gather_rows<U, I, true><<<gr, 256, 0, s>>>(po, px, pi, g, bad);
  } else {
    k_gather<U, I><<<gp_grid(g.A * g.K * g.C, 256), 256, 0, s>>>(po, px, pi, g, mode, bad);
  }
}

template <typename U>
static void launch_gather(int mode, gp_tensor *out, const gp_tensor *x, const gp_tensor *idx, g3 g, gp_bad_ref bad) {
  if (idx->dtype == GP_I32) launch_gather_i<U, int32_t>(mode, out, x, idx, g, bad);
  else launch_gather_i<U, int64_t>(mode, out, x, idx, g, bad);
}

extern "C" int gp_cuda_gather(int mode, gp_tensor *out, const gp_tensor *x, const gp_tensor *idx) {
  const char *op = mode == 0 ? "gather" : "index_select";
  g3 g = {out->shape[0], out->shape[1], out->shape[2], x->shape[1], x->stride[0], x->stride[1], x->stride[2]};
  if (g.A * g.K * g.C == 0) return GP_OK;
  gp_bad_ref bad;
  GP_TRY(gp_bad_begin(&bad, op, g.B, "x's dim 2 (the gathered dim)"));
  const int64_t es = gp_elsize(out->dtype);
  /* index_select over rows of x contiguous along C: units of 16, 8 or 4 bytes where the rows, their strides
   * and both pointers allow */
  const uintptr_t al = (uintptr_t)gp_ptr(out) | (uintptr_t)gp_ptr(x) | (uintptr_t)(g.C * es) | (uintptr_t)(g.sa * es) |
                       (uintptr_t)(g.sb * es);
  const int unit = mode == 1 && (g.sc == 1 || g.C == 1) ? (al % 16 == 0  ? 16
                                                           : al % 8 == 0 ? 8
                                                           : al % 4 == 0 ? 4
                                                                         : 0)
                                                        : 0;
  if (unit > es) {
    const int64_t f = unit / es;
    g3 gu = {g.A, g.K, g.C / f, g.B, g.sa / f, g.sb / f, 1};
    if (unit == 16) launch_gather<uint4>(mode, out, x, idx, gu, bad);
    else if (unit == 8) launch_gather<uint2>(mode, out, x, idx, gu, bad);
    else launch_gather<uint32_t>(mode, out, x, idx, gu, bad);
  } else {
    switch (es) {
      case 1: launch_gather<uint8_t>(mode, out, x, idx, g, bad); break;
      case 2: launch_gather<uint16_t>(mode, out, x, idx, g, bad); break;
      case 4: launch_gather<uint32_t>(mode, out, x, idx, g, bad); break;
      default: launch_gather<unsigned long long>(mode, out, x, idx, g, bad); break;
    }
  }
  return gp_bad_end(op);
}

/* acc[a,b,c] = x[a,b,c] (x strided); ROWS: a warp a row (a, b) (C >= 16), else an element a thread */
template <typename T, bool ROWS>
__global__ void k_init3(float *acc, const T *x, int64_t A, int64_t B, int64_t C, int64_t sa, int64_t sb, int64_t sc) {
  if constexpr (ROWS) {
    const int lane = threadIdx.x & 31;
    const int64_t w0 = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5,
                  nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = w0; r < A * B; r += nw) {
      const int64_t a = r / B, b = r - a * B;
      const T *xr = x + a * sa + b * sb;
      for (int64_t c = lane; c < C; c += 32) acc[r * C + c] = ld(xr[c * sc]);
    }
  } else {
    int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = tid; e < A * B * C; e += nth) {
      int64_t c = e % C, ab = e / C, b = ab % B, a = ab / B;
      acc[e] = ld(x[a * sa + b * sb + c * sc]);
    }
  }
}

/* acc[a, idx[a,k,c], c] += src[a,k,c]; ROWS: a warp a row (a, k) of src and idx (C >= 16), else an element a
 * thread */
template <typename T, typename I, bool ROWS>
__global__ void k_scatter_add(float *acc, const T *src, const I *idx, g3 g, gp_bad_ref bad) {
  if constexpr (ROWS) {
    const int lane = threadIdx.x & 31;
    const int64_t w0 = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5,
                  nw = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = w0; r < g.A * g.K; r += nw) {
      const int64_t a = r / g.K, k = r - a * g.K;
      const I *irow = idx + r * g.C;
      const T *sr = src + a * g.sa + k * g.sb;
      float *aa = acc + a * g.B * g.C;
      for (int64_t c = lane; c < g.C; c += 32) {
        const int64_t b = ldi(irow, c);
        if (b < 0 || b >= g.B) gp_report_bad(bad, b);
        else atomicAdd(aa + b * g.C + c, ld(sr[c * g.sc]));
      }
    }
  } else {
    int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = tid; e < g.A * g.K * g.C; e += nth) {
      int64_t c = e % g.C, ak = e / g.C, k = ak % g.K, a = ak / g.K;
      int64_t b = ldi(idx, e);
      if (b < 0 || b >= g.B) gp_report_bad(bad, b);
      else atomicAdd(acc + (a * g.B + b) * g.C + c, ld(src[a * g.sa + k * g.sb + c * g.sc]));
    }
  }
}

extern "C" int gp_cuda_scatter_add(gp_tensor *out, const gp_tensor *x, const gp_tensor *idx, const gp_tensor *src) {
  int64_t A = out->shape[0], B = out->shape[1], C = out->shape[2], K = idx->shape[1];
  if (A * B * C == 0) return GP_OK;
  gp_tensor *scratch;
  float *acc;
  GP_TRY(f32_acc(&scratch, &acc, out));
  gp_bad_ref bad;
  int rc = gp_bad_begin(&bad, "scatter_add", B, "out's dim 2 (the scattered dim)");
  if (rc == GP_OK) {
    const bool rows = C >= 16;
    cudaStream_t st = gp_cuda_stream();
    const unsigned gi = gp_grid(rows ? A * B * 32 : A * B * C, 256);
    GP_FLOAT_SWITCH(x->dtype, T, {
      const T *px = (const T *)gp_ptr(x);
      if (rows) k_init3<T, true><<<gi, 256, 0, st>>>(acc, px, A, B, C, x->stride[0], x->stride[1], x->stride[2]);
      else k_init3<T, false><<<gi, 256, 0, st>>>(acc, px, A, B, C, x->stride[0], x->stride[1], x->stride[2]);
    });
    g3 g = {A, K, C, B, src->stride[0], src->stride[1], src->stride[2]};
    if (A * K * C > 0) {
      const unsigned gr = gp_grid(rows ? A * K * 32 : A * K * C, 256);
      const bool i32 = idx->dtype == GP_I32;
      const void *pi = gp_ptr(idx);
      GP_FLOAT_SWITCH(src->dtype, T, {
        const T *ps = (const T *)gp_ptr(src);
        if (i32 && rows) k_scatter_add<T, int32_t, true><<<gr, 256, 0, st>>>(acc, ps, (const int32_t *)pi, g, bad);
        else if (i32) k_scatter_add<T, int32_t, false><<<gr, 256, 0, st>>>(acc, ps, (const int32_t *)pi, g, bad);
        else if (rows) k_scatter_add<T, int64_t, true><<<gr, 256, 0, st>>>(acc, ps, (const int64_t *)pi, g, bad);
        else k_scatter_add<T, int64_t, false><<<gr, 256, 0, st>>>(acc, ps, (const int64_t *)pi, g, bad);
      });
    }
    f32_round(out, acc, A * B * C);
    rc = gp_bad_end("scatter_add");
  }
  gp_tensor_free(scratch);
  return rc;
}
