/* copy.cu: strided copy with broadcast and cast, fill and arange, on the GPU. */
#include "ew_launch.cuh"

template <typename To, typename Ts> struct CastF {
  __device__ To operator()(Ts x) const { return st<To>(ld(x)); }
};
template <typename T> struct FillF {
  T v;
  __device__ T operator()() const { return v; }
};

/* A copy of one dtype between rows that are contiguous on both sides and packed on one side only, where the
 * padded side's rows break the 16-byte vectors of the generic kernel (gp.linear's rows padded to a multiple of 8
 * and back, for 50257 outputs; the generic kernel moves an element a thread at 0.4 of copy). A block moves 256
 * vectors of the packed side, 16-byte loads or stores there. Into padded rows the elements go through shared
 * memory, so that the stores are an element a thread, consecutive threads on consecutive elements (H200, 8192 x
 * 50257 bf16: 0.73 of copy; a thread's own 8 stores: 0.20); out of them each thread loads its own 8 elements
 * (0.60-0.95; through shared memory: 0.45). PACKED_OUT: out is packed (src has rows ld apart), else src is
 * packed (out's rows ld apart). */
template <typename T, bool PACKED_OUT>
__global__ void __launch_bounds__(256) k_copy_rows(T *o, const T *a, int64_t numel, int64_t n, int64_t ld) {
  constexpr int V = 16 / (int)sizeof(T);
  const int64_t base = (int64_t)blockIdx.x * 256 * V, f = base + (int64_t)threadIdx.x * V;
  const int m = numel - f < V ? (numel - f < 0 ? 0 : (int)(numel - f)) : V; /* this thread's packed elements */
  if constexpr (PACKED_OUT) { /* a thread's V elements loaded one by one, from one row or two */
    int64_t r = f / n, c = f - r * n;
    gp_vec<T, V> v;
#pragma unroll
    for (int e = 0; e < V; e++) {
      if (e < m) v.v[e] = a[r * ld + c];
      if (++c == n) c = 0, r++;
    }
    if (m == V) reinterpret_cast<gp_vec<T, V> *>(o)[f / V] = v;
    else
      for (int e = 0; e < m; e++) o[f + e] = v.v[e];
  } else {
    __shared__ gp_vec<T, V> buf[256];
    T *el = reinterpret_cast<T *>(buf);
    if (m == V) buf[threadIdx.x] = reinterpret_cast<const gp_vec<T, V> *>(a)[f / V];
    else
      for (int e = 0; e < m; e++) el[threadIdx.x * V + e] = a[f + e];
    __syncthreads();
    /* element base + tid + 256 e: row r, column c (one division, then steps of 256) */
    int64_t r = (base + threadIdx.x) / n, c = base + threadIdx.x - r * n;
#pragma unroll
    for (int e = 0; e < V; e++) {
      if (base + threadIdx.x + 256 * e < numel) o[r * ld + c] = el[threadIdx.x + 256 * e];
      c += 256;
      if (c >= n) {
        const int64_t q = c / n;
        r += q, c -= q * n;
      }
    }
  }
}

/* k_copy_rows where it applies (1 launched, 0 not) */
static int copy_rows(gp_tensor *out, const gp_tensor *src) {
  if (out->dtype != src->dtype || out->ndim != 2 || src->ndim != 2 || gp_elsize(out->dtype) > 8) return 0;
  const int64_t rows = out->shape[0], n = out->shape[1], es = gp_elsize(out->dtype), V = 16 / es;
  if (src->shape[0] != rows || src->shape[1] != n || rows < 2 || n < 1 || out->stride[1] != 1 ||
      src->stride[1] != 1 || n % V == 0)
    return 0;
  const bool po = out->stride[0] == n, ps = src->stride[0] == n;
  if (po == ps) return 0;
  const gp_tensor *packed = po ? out : src, *other = po ? src : out;
  if (((uintptr_t)gp_ptr(packed) & 15) != 0 || other->stride[0] < n) return 0;
  const int64_t numel = rows * n, ld = other->stride[0];
  if ((numel + 256 * V - 1) / (256 * V) > INT32_MAX) return 0;
  const unsigned g = (unsigned)((numel + 256 * V - 1) / (256 * V));
  cudaStream_t s = gp_cuda_stream();
  GP_ANY_SWITCH(out->dtype, T, {
    T *o = (T *)gp_ptr(out);
    const T *a = (const T *)gp_ptr(src);
    if (po) {
      GP_NOTE_LAUNCH((k_copy_rows<T, true>), 256, 0);
      k_copy_rows<T, true><<<g, 256, 0, s>>>(o, a, numel, n, ld);
    } else {
      GP_NOTE_LAUNCH((k_copy_rows<T, false>), 256, 0);
      k_copy_rows<T, false><<<g, 256, 0, s>>>(o, a, numel, n, ld);
    }
  });
  return 1;
}

/* A transposing copy: out[z, r, c] = src[z sz + r + c sc] (out contiguous along c, src along r; z a batch
 * dim or none), a 32 x 32 tile a block through shared memory so that both the loads (along r) and the stores
 * (along c) are coalesced. The generic kernel reads src 4 bytes a sector there (H200, 8192 x 8192 f32 of a
 * transposed view: 0.23 of copy). */
template <typename To, typename Ts>
__global__ void __launch_bounds__(256)
    k_copy_transpose(To *o, const Ts *a, int64_t R, int64_t C, int64_t oz, int64_t orr, int64_t sz, int64_t sc) {
  __shared__ To t[32][33];
  const int64_t r0 = (int64_t)blockIdx.x * 32, c0 = (int64_t)blockIdx.y * 32, z = blockIdx.z;
  const Ts *az = a + z * sz;
#pragma unroll
  for (int j = threadIdx.y; j < 32; j += 8) {
    const int64_t r = r0 + threadIdx.x, c = c0 + j;
    if (r < R && c < C) t[j][threadIdx.x] = st<To>(ld(az[r + c * sc]));
  }
  __syncthreads();
  To *oz_ = o + z * oz;
#pragma unroll
  for (int j = threadIdx.y; j < 32; j += 8) {
    const int64_t r = r0 + j, c = c0 + threadIdx.x;
    if (r < R && c < C) oz_[r * orr + c] = t[threadIdx.x][j];
  }
}

/* k_copy_transpose where the merged loop is such a transpose (1 launched, 0 not) */
static int copy_transpose(gp_tensor *out, const gp_tensor *src) {
  gp_loop L;
  const gp_tensor *ops[2] = {out, src};
  if (gp_loop_init(&L, "copy", 2, ops) != GP_OK) return 0; /* the generic path reports it */
  const int n = L.ndim;
  if (n < 2 || n > 3 || L.stride[0][n - 1] != 1 || L.stride[1][n - 2] != 1 || L.stride[1][n - 1] == 1) return 0;
  const int64_t R = L.shape[n - 2], C = L.shape[n - 1], Z = n == 3 ? L.shape[0] : 1;
  if (R < 32 || C < 32 || (C + 31) / 32 > 65535 || Z > 65535) return 0;
  const int64_t oz = n == 3 ? L.stride[0][0] : 0, sz = n == 3 ? L.stride[1][0] : 0;
  const dim3 g((unsigned)((R + 31) / 32), (unsigned)((C + 31) / 32), (unsigned)Z), b(32, 8);
  cudaStream_t s = gp_cuda_stream();
  GP_ANY_SWITCH(out->dtype, To, GP_ANY_SWITCH(src->dtype, Ts, {
                  GP_NOTE_LAUNCH((k_copy_transpose<To, Ts>), 256, 0);
                  k_copy_transpose<To, Ts><<<g, b, 0, s>>>((To *)gp_ptr(out), (const Ts *)gp_ptr(src), R, C, oz,
                                                           L.stride[0][n - 2], sz, L.stride[1][n - 1]);
                }));
  return 1;
}

extern "C" int gp_cuda_copy(gp_tensor *out, const gp_tensor *src) {
  if (copy_rows(out, src) || copy_transpose(out, src)) return gp_cuda_check_launch("copy");
  int rc = GP_OK;
  GP_ANY_SWITCH(out->dtype, To,
                GP_ANY_SWITCH(src->dtype, Ts, rc = gp_ew_launch<1, To, Ts, Ts>("copy", out, src, nullptr, CastF<To, Ts>{})));
  return rc;
}

/* the fill value, converted on the host exactly as the CPU reference does */
extern "C" int gp_cuda_fill(gp_tensor *out, double value) {
  union {
    float f;
    uint16_t h;
    int32_t i;
    int64_t l;
    uint8_t b;
  } u;
  gp_store(&u, out->dtype, 0, value);
  int rc = GP_OK;
  GP_ANY_SWITCH(out->dtype, T, {
    T v;
    memcpy((void *)&v, &u, sizeof v);
    rc = gp_ew_launch<0, T, T, T>("fill", out, nullptr, nullptr, FillF<T>{v});
  });
  return rc;
}

/* arange: each value computed in double and stored as the CPU's gp_store does it (floats through float,
 * integers by gp_d2i: truncated and saturated in double, so large i64 ramps stay exact) */
template <typename T> __device__ __forceinline__ T arange_store(double v) {
  if constexpr (gp_is_float_t<T>::value) return st<T>((float)v);
  else if constexpr (std::is_same<T, int32_t>::value) return (T)gp_d2i(v, INT32_MIN, INT32_MAX);
  else if constexpr (std::is_same<T, int64_t>::value) return gp_d2i(v, INT64_MIN, INT64_MAX);
  else return (T)gp_d2i(v, 0, 255);
}
template <typename T> __global__ void k_arange(T *o, int64_t n, double start, double step) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = tid; i < n; i += nth) o[i] = arange_store<T>(start + (double)i * step);
}

extern "C" int gp_cuda_arange(gp_tensor *out, double start, double step) {
  int64_t n = out->shape[0];
  if (n == 0) return GP_OK;
  GP_ANY_SWITCH(out->dtype, T, {
    GP_NOTE_LAUNCH(k_arange<T>, 256, 0);
    k_arange<T><<<gp_grid(n, 256), 256, 0, gp_cuda_stream()>>>((T *)gp_ptr(out), n, start, step);
  });
  return gp_cuda_check_launch("arange");
}
