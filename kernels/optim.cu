/* optim.cu: optimizer steps and sums of squares on the GPU. The multi-tensor
 * forms launch once for a whole list: blocks walk chunks of GP_CHUNK
 * elements described by a table uploaded when the list is made. */
#include "../src/cuda_internal.h"
#include "optim.h"

struct TL {
  void *const *ptrs;
  const int64_t *numel;
  const int *ct;
  const int64_t *cs;
  int n, nchunks;
  int low; /* the group of the low-precision copies, or -1 */
};

/* the low-precision copy of an updated f32 value: st<L> rounds to nearest
 * even, as the copy kernel does (CastF in copy.cu), so the results are the
 * same bits as a k.copy of the master; L = float with lp == nullptr: none */
template <typename L> __device__ __forceinline__ void store_low(L *lp, int64_t i, float x) {
  if (lp) lp[i] = st<L>(x);
}

/* one AdamW update of p, m, v from the scaled gradient gi */
__device__ __forceinline__ void adamw_val(float &p, float &m, float &v, float gi, float lr, float b1, float b2,
                                          float eps, float wd, float bc1, float bc2) {
  m = b1 * m + (1.f - b1) * gi;
  v = b2 * v + (1.f - b2) * gi * gi;
  p = p * (1.f - lr * wd) - lr * (m / bc1) / (sqrtf(v / bc2) + eps);
}

template <typename G, typename L = float>
__device__ __forceinline__ void adamw_elem(float *p, float *m, float *v, const G *g, int64_t i, float gs, float lr,
                                           float b1, float b2, float eps, float wd, float bc1, float bc2,
                                           L *lp = nullptr) {
  float pi = p[i], mi = m[i], vi = v[i];
  adamw_val(pi, mi, vi, ld(g[i]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
  p[i] = pi;
  m[i] = mi;
  v[i] = vi;
  store_low(lp, i, pi);
}

/* four consecutive elements, one load or store */
template <typename T> struct alignas(4 * sizeof(T)) vec4 {
  T v[4];
};
static __device__ __forceinline__ bool al_to(const void *q, size_t a) { return ((uintptr_t)q & (a - 1)) == 0; }

template <typename G, typename L = float>
__device__ __forceinline__ void sgd_elem(float *p, float *buf, const G *g, int64_t i, float gs, float lr, float mom,
                                         float wd, int nesterov, L *lp = nullptr) {
  float gi = ld(g[i]) * gs + wd * p[i];
  float b = mom * buf[i] + gi;
  buf[i] = b;
  float pn = p[i] - lr * (nesterov ? gi + mom * b : b);
  p[i] = pn;
  store_low(lp, i, pn);
}

template <typename G>
__global__ void k_adamw(float *p, float *m, float *v, const G *g, int64_t n, const float *gscale, float lr, float b1,
                        float b2, float eps, float wd, float bc1, float bc2) {
  float gs = gscale ? *gscale : 1.f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    adamw_elem(p, m, v, g, i, gs, lr, b1, b2, eps, wd, bc1, bc2);
}

template <typename G>
__global__ void k_sgd(float *p, float *buf, const G *g, int64_t n, const float *gscale, float lr, float mom, float wd,
                      int nesterov) {
  float gs = gscale ? *gscale : 1.f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    sgd_elem(p, buf, g, i, gs, lr, mom, wd, nesterov);
}

template <typename G, typename L>
__global__ void k_multi_adamw(TL t, const float *gscale, const float *hyper, float lr, float b1, float b2, float eps,
                              float wd, float bc1, float bc2) {
  float gs = gscale ? *gscale : 1.f;
  if (hyper) lr = hyper[0], bc1 = hyper[1], bc2 = hyper[2];
  for (int c = blockIdx.x; c < t.nchunks; c += gridDim.x) {
    int i = t.ct[c];
    int64_t s = t.cs[c], e = min(s + (int64_t)GP_CHUNK, t.numel[i]);
    float *p = (float *)t.ptrs[i], *m = (float *)t.ptrs[t.n + i], *v = (float *)t.ptrs[2 * t.n + i];
    const G *g = (const G *)t.ptrs[3 * t.n + i];
    L *lp = t.low >= 0 ? (L *)t.ptrs[t.low * t.n + i] : nullptr;
    int64_t j0 = s; /* the first element the scalar loop takes */
    if (al_to(p + s, 16) && al_to(m + s, 16) && al_to(v + s, 16) && al_to(g + s, 4 * sizeof(G)) &&
        (!lp || al_to(lp + s, 4 * sizeof(L)))) {
      /* four elements a thread: 16-byte loads and stores of p, m, v */
      const int64_t n4 = (e - s) / 4;
      for (int64_t q = threadIdx.x; q < n4; q += blockDim.x) {
        const int64_t j = s + 4 * q;
        float4 P = *reinterpret_cast<const float4 *>(p + j), M = *reinterpret_cast<const float4 *>(m + j),
               V = *reinterpret_cast<const float4 *>(v + j);
        const vec4<G> gv = *reinterpret_cast<const vec4<G> *>(g + j);
        adamw_val(P.x, M.x, V.x, ld(gv.v[0]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
        adamw_val(P.y, M.y, V.y, ld(gv.v[1]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
        adamw_val(P.z, M.z, V.z, ld(gv.v[2]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
        adamw_val(P.w, M.w, V.w, ld(gv.v[3]) * gs, lr, b1, b2, eps, wd, bc1, bc2);
        *reinterpret_cast<float4 *>(p + j) = P;
        *reinterpret_cast<float4 *>(m + j) = M;
        *reinterpret_cast<float4 *>(v + j) = V;
        if (lp) *reinterpret_cast<vec4<L> *>(lp + j) = vec4<L>{{st<L>(P.x), st<L>(P.y), st<L>(P.z), st<L>(P.w)}};
      }
      j0 = s + 4 * n4;
    }
    for (int64_t j = j0 + threadIdx.x; j < e; j += blockDim.x)
      adamw_elem(p, m, v, g, j, gs, lr, b1, b2, eps, wd, bc1, bc2, lp);
  }
}

template <typename G, typename L>
__global__ void k_multi_sgd(TL t, const float *gscale, const float *hyper, float lr, float mom, float wd, int nesterov) {
  float gs = gscale ? *gscale : 1.f;
  if (hyper) lr = hyper[0];
  for (int c = blockIdx.x; c < t.nchunks; c += gridDim.x) {
    int i = t.ct[c];
    int64_t s = t.cs[c], e = min(s + (int64_t)GP_CHUNK, t.numel[i]);
    float *p = (float *)t.ptrs[i], *buf = (float *)t.ptrs[t.n + i];
    const G *g = (const G *)t.ptrs[2 * t.n + i];
    L *lp = t.low >= 0 ? (L *)t.ptrs[t.low * t.n + i] : nullptr;
    for (int64_t j = s + threadIdx.x; j < e; j += blockDim.x) sgd_elem(p, buf, g, j, gs, lr, mom, wd, nesterov, lp);
  }
}

/* block-wide sum of one float per thread (blockDim.x a multiple of 32, <= 1024) */
__device__ float block_sum(float x) {
  __shared__ float w[32];
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) w[wid] = x;
  __syncthreads();
  x = threadIdx.x < blockDim.x / 32 ? w[threadIdx.x] : 0.f;
  if (wid == 0)
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}

/* sum of squares of the 16-byte vectors q = q0, q0 + step, ... < nv of p (16-byte aligned) */
template <typename T> __device__ __forceinline__ float sumsq_vecs(const T *p, int64_t nv, int64_t q0, int64_t step) {
  constexpr int V = 16 / sizeof(T);
  float s = 0.f;
  for (int64_t q = q0; q < nv; q += step) {
    const float4 f = *reinterpret_cast<const float4 *>(p + q * V);
    const T *w = reinterpret_cast<const T *>(&f);
#pragma unroll
    for (int k = 0; k < V; k++) {
      const float u = ld(w[k]);
      s += u * u;
    }
  }
  return s;
}

/* partials[b] = the b-th block's share of sum(x^2) (fixed order: deterministic): 16-byte loads from x's first
 * 16-byte boundary, the elements before it and after the last whole vector one a thread (one 2-byte element a
 * thread ran bf16 at 0.31 of the copy bandwidth) */
template <typename T> __global__ void k_sumsq_partial(const T *x, int64_t n, float *partials) {
  constexpr int V = 16 / sizeof(T);
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  int64_t h = (int64_t)(((16 - ((uintptr_t)x & 15)) & 15) / sizeof(T));
  if (h > n) h = n;
  const int64_t nv = (n - h) / V;
  float s = sumsq_vecs(x + h, nv, tid, nth);
  for (int64_t i = tid; i < h; i += nth) s += ld(x[i]) * ld(x[i]);
  for (int64_t i = h + nv * V + tid; i < n; i += nth) s += ld(x[i]) * ld(x[i]);
  s = block_sum(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

template <typename T> __global__ void k_multi_sumsq_partial(TL t, float *partials) {
  for (int c = blockIdx.x; c < t.nchunks; c += gridDim.x) {
    int i = t.ct[c];
    int64_t s0 = t.cs[c], e = min(s0 + (int64_t)GP_CHUNK, t.numel[i]);
    const T *x = (const T *)t.ptrs[i];
    float s = 0.f;
    int64_t j0 = s0; /* the first element the scalar loop takes */
    if (al_to(x + s0, 16)) { /* 16-byte loads */
      constexpr int V = 16 / sizeof(T);
      const int64_t nv = (e - s0) / V;
      s = sumsq_vecs(x + s0, nv, threadIdx.x, blockDim.x);
      j0 = s0 + nv * V;
    }
    for (int64_t j = j0 + threadIdx.x; j < e; j += blockDim.x) {
      float v = ld(x[j]);
      s += v * v;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) partials[c] = s;
  }
}

__global__ void k_sum_final(const float *partials, int n, float *out) {
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = s;
}

__global__ void k_clip_coef(float *scale, const float *sumsq, float max_norm, float eps) {
  float c = max_norm / (sqrtf(*sumsq) + eps);
  *scale = c < 1.f ? c : 1.f;
}

static const float *gs_ptr(const gp_tensor *gs) { return gs ? (const float *)gp_ptr(gs) : nullptr; }

extern "C" int gp_cuda_adamw(gp_tensor *p, gp_tensor *m, gp_tensor *v, const gp_tensor *g, const gp_tensor *gscale,
                             double lr, double b1, double b2, double eps, double wd, double bc1, double bc2) {
  int64_t n = gp_numel(p);
  if (n == 0) return GP_OK;
  GP_FLOAT_SWITCH(g->dtype, G,
                  k_adamw<G><<<gp_grid(n, 256), 256, 0, gp_cuda_stream()>>>(
                      (float *)gp_ptr(p), (float *)gp_ptr(m), (float *)gp_ptr(v), (const G *)gp_ptr(g), n,
                      gs_ptr(gscale), (float)lr, (float)b1, (float)b2, (float)eps, (float)wd, (float)bc1, (float)bc2));
  return gp_cuda_check_launch("adamw");
}

extern "C" int gp_cuda_sgd(gp_tensor *p, gp_tensor *buf, const gp_tensor *g, const gp_tensor *gscale, double lr,
                           double mom, double wd, int nesterov) {
  int64_t n = gp_numel(p);
  if (n == 0) return GP_OK;
  GP_FLOAT_SWITCH(g->dtype, G,
                  k_sgd<G><<<gp_grid(n, 256), 256, 0, gp_cuda_stream()>>>((float *)gp_ptr(p), (float *)gp_ptr(buf),
                                                                          (const G *)gp_ptr(g), n, gs_ptr(gscale),
                                                                          (float)lr, (float)mom, (float)wd, nesterov));
  return gp_cuda_check_launch("sgd");
}

extern "C" int gp_cuda_sumsq(gp_tensor *out, const gp_tensor *x) {
  int64_t n = gp_numel(x);
  int blocks = (int)gp_grid((n + 7) / 8, 256);
  if (blocks > 1024) blocks = 1024;
  void *part;
  size_t pb;
  GP_TRY(gp_alloc(&part, &pb, sizeof(float) * (size_t)blocks, GP_CUDA));
  cudaStream_t s = gp_cuda_stream();
  GP_FLOAT_SWITCH(x->dtype, T, k_sumsq_partial<T><<<blocks, 256, 0, s>>>((const T *)gp_ptr(x), n, (float *)part));
  k_sum_final<<<1, 1024, 0, s>>>((const float *)part, blocks, (float *)gp_ptr(out));
  gp_free(part, pb, GP_CUDA); /* reuse is ordered on the stream */
  return gp_cuda_check_launch("sumsq");
}

extern "C" int gp_cuda_clip_coef(gp_tensor *scale, const gp_tensor *sumsq, double max_norm, double eps) {
  k_clip_coef<<<1, 1, 0, gp_cuda_stream()>>>((float *)gp_ptr(scale), (const float *)gp_ptr(sumsq), (float)max_norm,
                                              (float)eps);
  return gp_cuda_check_launch("clip_coef");
}

/* ---- lists ---- */

extern "C" int gp_cuda_tlist_upload(struct gp_tlist *l) {
  int gn = l->groups * l->n;
  size_t bytes = sizeof(void *) * (size_t)gn + sizeof(int64_t) * (size_t)l->n + sizeof(int) * (size_t)l->nchunks +
                 sizeof(int64_t) * (size_t)l->nchunks + 64;
  char *h = (char *)malloc(bytes);
  if (!h) return gp_error_oom("tlist: out of host memory");
  void **ptrs = (void **)h;
  int64_t *numel = (int64_t *)(ptrs + gn);
  int64_t *cs = numel + l->n;
  int *ct = (int *)(cs + l->nchunks);
  for (int k = 0; k < gn; k++) ptrs[k] = gp_ptr(l->ts[k]);
  int c = 0;
  for (int i = 0; i < l->n; i++) {
    numel[i] = l->numel[i];
    for (int64_t s = 0; s < l->numel[i]; s += GP_CHUNK, c++) {
      ct[c] = i;
      cs[c] = s;
    }
  }
  int rc = gp_alloc(&l->dev, &l->dev_bytes, bytes, GP_CUDA);
  if (rc == GP_OK) rc = gp_alloc((void **)&l->partials, &l->partial_bytes, sizeof(float) * ((size_t)l->nchunks + 1), GP_CUDA);
  if (rc == GP_OK) rc = gp_cuda_memcpy(l->dev, h, bytes, 1);
  if (rc == GP_OK) rc = gp_cuda_sync("tlist");
  free(h);
  return rc;
}

static TL tl_of(const struct gp_tlist *l) {
  TL t;
  int gn = l->groups * l->n;
  t.ptrs = (void *const *)l->dev;
  t.numel = (const int64_t *)((void *const *)l->dev + gn);
  t.cs = t.numel + l->n;
  t.ct = (const int *)(t.cs + l->nchunks);
  t.n = l->n;
  t.nchunks = l->nchunks;
  t.low = -1;
  return t;
}

static unsigned chunk_grid(int nchunks) {
  int cap = gp_cuda_sm_count() * 8;
  return (unsigned)(nchunks < cap ? (nchunks > 0 ? nchunks : 1) : cap);
}

/* the storage type L of the low-precision group (float, unused, when the
 * list has none: groups == base) and the TL with its index */
#define GP_LOW_SWITCH(l, base, t, L, ...)                                                         \
  do {                                                                                           \
    if ((l)->groups == (base) + 1) {                                                             \
      (t).low = (base);                                                                          \
      if ((l)->dtype[base] == GP_BF16) { typedef __nv_bfloat16 L; __VA_ARGS__; }                 \
      else { typedef __half L; __VA_ARGS__; }                                                    \
    } else {                                                                                     \
      typedef float L;                                                                           \
      __VA_ARGS__;                                                                               \
    }                                                                                            \
  } while (0)

extern "C" int gp_cuda_multi_adamw(struct gp_tlist *l, const gp_tensor *gscale, const gp_tensor *hyper, double lr,
                                   double b1, double b2, double eps, double wd, double bc1, double bc2) {
  TL t = tl_of(l);
  GP_LOW_SWITCH(l, 4, t, L,
                GP_FLOAT_SWITCH(l->dtype[3], G,
                                k_multi_adamw<G, L><<<chunk_grid(l->nchunks), 256, 0, gp_cuda_stream()>>>(
                                    t, gs_ptr(gscale), gs_ptr(hyper), (float)lr, (float)b1, (float)b2, (float)eps,
                                    (float)wd, (float)bc1, (float)bc2)));
  return gp_cuda_check_launch("multi_adamw");
}

extern "C" int gp_cuda_multi_sgd(struct gp_tlist *l, const gp_tensor *gscale, const gp_tensor *hyper, double lr,
                                 double mom, double wd, int nesterov) {
  TL t = tl_of(l);
  GP_LOW_SWITCH(l, 3, t, L,
                GP_FLOAT_SWITCH(l->dtype[2], G,
                                k_multi_sgd<G, L><<<chunk_grid(l->nchunks), 256, 0, gp_cuda_stream()>>>(
                                    t, gs_ptr(gscale), gs_ptr(hyper), (float)lr, (float)mom, (float)wd, nesterov)));
  return gp_cuda_check_launch("multi_sgd");
}

extern "C" int gp_cuda_multi_sumsq(gp_tensor *out, struct gp_tlist *l) {
  cudaStream_t s = gp_cuda_stream();
  GP_FLOAT_SWITCH(l->dtype[0], T, k_multi_sumsq_partial<T><<<chunk_grid(l->nchunks), 256, 0, s>>>(tl_of(l), l->partials));
  k_sum_final<<<1, 1024, 0, s>>>(l->partials, l->nchunks, (float *)gp_ptr(out));
  return gp_cuda_check_launch("multi_sumsq");
}
