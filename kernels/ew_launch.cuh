/* ew_launch.cuh: one engine for elementwise kernels on the GPU.
 * out[i] = f(a[i], b[i]) over a gp_loop (broadcast, strided, dims merged);
 * a dense loop runs a grid-stride kernel with 16-byte vector loads and
 * stores, anything else indexes through the loop's strides. */
#ifndef GP_EW_LAUNCH_CUH
#define GP_EW_LAUNCH_CUH
#include "../src/cuda_internal.h"
#include "gp_hd.h"

template <typename T, int V> struct alignas(sizeof(T) * V) gp_vec { T v[V]; };

template <int NIN, typename F, typename A, typename B>
__device__ __forceinline__ auto gp_call(const F &f, A a, B b) {
  if constexpr (NIN == 0) return f();
  else if constexpr (NIN == 1) return f(a);
  else return f(a, b);
}

/* BS: b is one value broadcast over the loop (read once per thread) */
template <int NIN, int V, bool BS, typename To, typename Ta, typename Tb, typename F>
__global__ void gp_ew_flat(To *o, const Ta *a, const Tb *b, int64_t n, F f) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  int64_t nv = n / V;
  Tb bs{};
  if constexpr (BS) bs = b[0];
  for (int64_t i = tid; i < nv; i += nth) {
    gp_vec<Ta, V> va;
    gp_vec<Tb, V> vb;
    gp_vec<To, V> vo;
    if constexpr (NIN >= 1) va = reinterpret_cast<const gp_vec<Ta, V> *>(a)[i];
    if constexpr (NIN >= 2 && !BS) vb = reinterpret_cast<const gp_vec<Tb, V> *>(b)[i];
#pragma unroll
    for (int j = 0; j < V; j++) vo.v[j] = gp_call<NIN>(f, va.v[j], BS ? bs : vb.v[j]);
    reinterpret_cast<gp_vec<To, V> *>(o)[i] = vo;
  }
  for (int64_t i = nv * V + tid; i < n; i += nth) {
    Ta x{};
    Tb y{};
    if constexpr (NIN >= 1) x = a[i];
    if constexpr (NIN >= 2) y = BS ? bs : b[i];
    o[i] = gp_call<NIN>(f, x, y);
  }
}

/* NDIM > 0: the loop has exactly NDIM dims and 32-bit indices; the unrolled
 * loops read the sizes and strides straight from the kernel parameters (a
 * run-time index into them would copy the whole loop to local memory in
 * every thread). NDIM == 0: any number of dims, 64-bit indices. V > 1: the
 * innermost dim is contiguous in every operand and the loop counts V-element
 * vectors (16-byte loads and stores; NDIM > 0 only). */
template <int NIN, int NDIM, int V, typename To, typename Ta, typename Tb, typename F>
__global__ void gp_ew_strided(gp_loop L, To *o, const Ta *a, const Tb *b, F f) {
  int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = tid; i < L.numel; i += nth) {
    int64_t off[4] = {0, 0, 0, 0};
    if constexpr (NDIM > 0) {
      uint32_t j = (uint32_t)i;
#pragma unroll
      for (int d = NDIM - 1; d >= 0; d--) {
        const uint32_t n = (uint32_t)L.shape[d], q = j / n, r = j - q * n;
#pragma unroll
        for (int k = 0; k <= NIN; k++) off[k] += (int64_t)r * L.stride[k][d];
        j = q;
      }
    } else {
      gp_loop_offsets(&L, i, off);
    }
    gp_vec<Ta, V> va;
    gp_vec<Tb, V> vb;
    gp_vec<To, V> vo;
    if constexpr (NIN >= 1) va = reinterpret_cast<const gp_vec<Ta, V> *>(a)[off[1]];
    if constexpr (NIN >= 2) vb = reinterpret_cast<const gp_vec<Tb, V> *>(b)[off[2]];
#pragma unroll
    for (int e = 0; e < V; e++) vo.v[e] = gp_call<NIN>(f, va.v[e], vb.v[e]);
    reinterpret_cast<gp_vec<To, V> *>(o)[off[0]] = vo;
  }
}

static inline bool gp_aligned(const void *p, size_t n) { return ((uintptr_t)p % n) == 0; }

template <int NIN, typename To, typename Ta, typename Tb, typename F>
int gp_ew_launch(const char *name, gp_tensor *out, const gp_tensor *a, const gp_tensor *b, F f) {
  gp_loop L;
  const gp_tensor *ops[3] = {out, a, b};
  GP_TRY(gp_loop_init(&L, name, 1 + NIN, ops));
  if (L.numel == 0) return GP_OK;
  To *po = (To *)gp_ptr(out);
  const Ta *pa = NIN >= 1 ? (const Ta *)gp_ptr(a) : nullptr;
  const Tb *pb = NIN >= 2 ? (const Tb *)gp_ptr(b) : nullptr;
  cudaStream_t s = gp_cuda_stream();
  bool flat = L.ndim == 1;
  for (int k = 0; k <= NIN; k++) flat = flat && (L.stride[k][0] == 1 || L.numel == 1);
  /* a dense loop times one broadcast value (dlogits * (upstream / count)) */
  const bool bscalar =
      NIN == 2 && !flat && L.ndim == 1 && L.stride[0][0] == 1 && L.stride[1][0] == 1 && L.stride[2][0] == 0;
  constexpr size_t mx = sizeof(To) > sizeof(Ta) ? (sizeof(To) > sizeof(Tb) ? sizeof(To) : sizeof(Tb))
                                                : (sizeof(Ta) > sizeof(Tb) ? sizeof(Ta) : sizeof(Tb));
  constexpr int V = (int)(16 / mx);
  /* strided with a contiguous innermost dim (a permute that keeps the last
   * dim, a row broadcast): vectors along that dim when sizes, strides and
   * pointers all allow it */
  bool vec = !flat && L.ndim >= 2 && L.ndim <= 4 && L.shape[L.ndim - 1] % V == 0 && L.numel / V < ((int64_t)1 << 31) &&
             gp_aligned(po, sizeof(To) * V) && (NIN < 1 || gp_aligned(pa, sizeof(Ta) * V)) &&
             (NIN < 2 || gp_aligned(pb, sizeof(Tb) * V));
  for (int k = 0; vec && k <= NIN; k++) {
    vec = L.stride[k][L.ndim - 1] == 1;
    for (int d = 0; vec && d < L.ndim - 1; d++) vec = L.stride[k][d] % V == 0;
  }
  if (vec) {
    gp_loop LV = L;
    LV.shape[L.ndim - 1] /= V;
    LV.numel /= V;
    for (int k = 0; k <= NIN; k++)
      for (int d = 0; d < L.ndim - 1; d++) LV.stride[k][d] /= V;
    const unsigned g = gp_grid(LV.numel, 256);
#define GP_EW_VEC(ND)                                                     \
  do {                                                                    \
    GP_NOTE_LAUNCH((gp_ew_strided<NIN, ND, V, To, Ta, Tb, F>), 256, 0);    \
    gp_ew_strided<NIN, ND, V><<<g, 256, 0, s>>>(LV, po, pa, pb, f);      \
  } while (0)
    if (L.ndim == 2) GP_EW_VEC(2);
    else if (L.ndim == 3) GP_EW_VEC(3);
    else GP_EW_VEC(4);
#undef GP_EW_VEC
  } else if (flat) {
    bool al = gp_aligned(po, sizeof(To) * V) && (NIN < 1 || gp_aligned(pa, sizeof(Ta) * V)) &&
              (NIN < 2 || gp_aligned(pb, sizeof(Tb) * V));
    if (al) GP_NOTE_LAUNCH((gp_ew_flat<NIN, V, false, To, Ta, Tb, F>), 256, 0);
    else GP_NOTE_LAUNCH((gp_ew_flat<NIN, 1, false, To, Ta, Tb, F>), 256, 0);
    if (al) gp_ew_flat<NIN, V, false><<<gp_grid((L.numel + V - 1) / V, 256), 256, 0, s>>>(po, pa, pb, L.numel, f);
    else gp_ew_flat<NIN, 1, false><<<gp_grid(L.numel, 256), 256, 0, s>>>(po, pa, pb, L.numel, f);
  } else if (bscalar) {
    if constexpr (NIN == 2) { /* (bscalar is false for fewer inputs: no kernels for it) */
      bool al = gp_aligned(po, sizeof(To) * V) && gp_aligned(pa, sizeof(Ta) * V);
      if (al) GP_NOTE_LAUNCH((gp_ew_flat<NIN, V, true, To, Ta, Tb, F>), 256, 0);
      else GP_NOTE_LAUNCH((gp_ew_flat<NIN, 1, true, To, Ta, Tb, F>), 256, 0);
      if (al) gp_ew_flat<NIN, V, true><<<gp_grid((L.numel + V - 1) / V, 256), 256, 0, s>>>(po, pa, pb, L.numel, f);
      else gp_ew_flat<NIN, 1, true><<<gp_grid(L.numel, 256), 256, 0, s>>>(po, pa, pb, L.numel, f);
    }
  } else {
    const bool small = L.numel < ((int64_t)1 << 31);
    const unsigned g = gp_grid(L.numel, 256);
#define GP_EW_STRIDED(ND)                                              \
  do {                                                                 \
    GP_NOTE_LAUNCH((gp_ew_strided<NIN, ND, 1, To, Ta, Tb, F>), 256, 0);   \
    gp_ew_strided<NIN, ND, 1><<<g, 256, 0, s>>>(L, po, pa, pb, f);        \
  } while (0)
    if (small && L.ndim == 1) GP_EW_STRIDED(1);
    else if (small && L.ndim == 2) GP_EW_STRIDED(2);
    else if (small && L.ndim == 3) GP_EW_STRIDED(3);
    else if (small && L.ndim == 4) GP_EW_STRIDED(4);
    else GP_EW_STRIDED(0);
#undef GP_EW_STRIDED
  }
  return gp_cuda_check_launch(name);
}
#endif
