/* cuda_internal.h: what the .cu files share: the stream, launch helpers, dtype traits. */
#ifndef GP_CUDA_INTERNAL_H
#define GP_CUDA_INTERNAL_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <type_traits>

#include "internal.h"

cudaStream_t gp_cuda_stream(void);
int gp_cuda_sm_count(void);
/* the device's compute capability, major * 10 + minor (90: H100, H200) */
int gp_cuda_cc(void);

/* Deferred index checks (kernels/bad_index.cuh): a kernel that finds a bad
 * index writes its ref's id and the value into a device flag; the flag is read
 * at the next synchronization point. */
struct gp_bad_ref {
  unsigned long long *flag; /* [0]: id of the first bad launch (0: none), [1]: the value */
  unsigned long long id;
};
/* op, what: string literals (kept by pointer); kind: "index" or "target" */
int gp_cuda_bad_ref(gp_bad_ref *out, const char *op, const char *kind, int64_t size, const char *what);

/* Graph-safe random numbers: under CUDA graph capture, RNG kernels add the
 * generator state of the replay, read from the device (rng[0] seed, rng[1]
 * offset base), to the offset reserved at capture (relative to the graph);
 * outside capture rng is NULL and the host seed and offset are used as they
 * are. */
const unsigned long long *gp_cuda_rng_slot(void);
__device__ __forceinline__ void gp_rng_resolve(const unsigned long long *rng, uint64_t &seed, uint64_t &offset) {
  if (rng) {
    seed = rng[0];
    offset += rng[1];
  }
}

/* Thread block clusters (compute capability 9.0; kernels/loss.cu, kernels/sample.cu). A cluster kernel's code
 * must be PTX 9.0 or later (the Makefile's GENCODE_EACH: a build whose PTX is 8.0 has the cluster code compiled
 * out): true when fn's is, asked once a device (ptx90: 8 entries, 0 unknown, 1 yes, -1 no). */
static inline bool gp_cuda_ptx90(const void *fn, int *ptx90) {
  int dev = 0;
  cudaGetDevice(&dev);
  int &ok = ptx90[dev >= 0 && dev < 8 ? dev : 0];
  if (ok == 0) {
    cudaFuncAttributes fa;
    ok = cudaFuncGetAttributes(&fa, fn) == cudaSuccess && fa.ptxVersion >= 90 ? 1 : -1;
    cudaGetLastError();
  }
  return ok > 0;
}
/* a launch on the current stream in clusters of C blocks along x (C 1: no cluster); at: the attribute's storage */
static inline cudaLaunchConfig_t gp_cluster_cfg(dim3 grid, dim3 block, size_t smem, int C, cudaLaunchAttribute *at) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = gp_cuda_stream();
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = C;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  cfg.attrs = at;
  cfg.numAttrs = C > 1 ? 1 : 0;
  return cfg;
}

/* Programmatic dependent launch (compute capability 9.0): a kernel of a
 * chain may start while the kernel before it runs. Such a kernel calls
 * gp_pdl_trigger() (its dependents may launch) and gp_pdl_wait() (the kernels
 * before it have finished and their writes are visible) before it reads what
 * they wrote or writes anything; before the wait it may read only the spans
 * it names as `pre` (weights). src/cuda.cu keeps the chain: the spans its
 * kernels write, and whether the stream's last work was a chain kernel (any
 * other op, copy, event or graph breaks it). Both calls are no-ops in a
 * kernel launched the usual way, and in code compiled from PTX older than
 * 9.0 (the Makefile's GENCODE_EACH builds the Hopper code of such files).
 * GPUSH_PDL=0 turns chains off. */
__device__ __forceinline__ void gp_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void gp_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
struct gp_span {
  const void *p;
  size_t n;
};
/* a few spans, as a launch names them: {gp_span_of(w)}; more than 4: over
 * (the launch then ends the chain, as a usual launch would) */
struct gp_spans {
  gp_span s[4];
  int n = 0;
  bool over = false;
  gp_spans() = default;
  gp_spans(std::initializer_list<gp_span> l) {
    for (const gp_span &x : l)
      if (n < 4) s[n++] = x;
      else over = true;
  }
};
/* the bytes of t (its elements' whole extent) */
gp_span gp_span_of(const gp_tensor *t);
/* the launch of fn (aware: its code waits, PTX 9.0 or later) that writes wr
 * and reads pre before its wait: true when it may overlap the kernel before
 * it (the chain goes on, none of pre written by it); records wr */
bool gp_pdl_chain(bool aware, const gp_span *pre, int npre, const gp_span *wr, int nwr);
/* launch k on the current stream, as a chain kernel (see above) */
template <typename... K, typename... A>
static inline cudaError_t gp_launch_chain(void (*k)(K...), dim3 grid, dim3 block, size_t smem, const gp_spans &pre,
                                         const gp_spans &wr, A... args) {
  static int ptx90[8];
  const bool known = !pre.over && !wr.over;
  const bool pdl = known && gp_pdl_chain(gp_cuda_ptx90((const void *)k, ptx90), pre.s, pre.n, wr.s, wr.n);
  gp_cuda_note_launch((const void *)k, (int)(block.x * block.y * block.z), (int)smem);
  cudaLaunchAttribute at[1];
  cudaLaunchConfig_t cfg = gp_cluster_cfg(grid, block, smem, 1, at); /* no cluster */
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, k, args...);
  /* nothing launched, or writes not all named: the stream's last kernel is not one the chain can follow */
  if (e != cudaSuccess || !known) gp_pdl_break();
  return e;
}

/* a grid for n items, capped so that grid-stride loops cover the rest */
static inline unsigned gp_grid(int64_t n, int block) {
  int64_t g = (n + block - 1) / block, cap = (int64_t)gp_cuda_sm_count() * 32;
  if (g > cap) g = cap;
  return (unsigned)(g < 1 ? 1 : g);
}

/* Loads give the compute type (float for float dtypes, int64 for integers);
 * st<T> stores it back: floats round to nearest, float -> integer truncates
 * and saturates (NaN -> 0, as on the CPU), integer -> integer wraps. */
__device__ __forceinline__ float ld(float v) { return v; }
__device__ __forceinline__ float ld(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ld(__half v) { return __half2float(v); }
__device__ __forceinline__ int64_t ld(int32_t v) { return v; }
__device__ __forceinline__ int64_t ld(int64_t v) { return v; }
__device__ __forceinline__ int64_t ld(uint8_t v) { return v; }

template <typename T> struct gp_is_float_t { static constexpr bool value = false; };
template <> struct gp_is_float_t<float> { static constexpr bool value = true; };
template <> struct gp_is_float_t<__nv_bfloat16> { static constexpr bool value = true; };
template <> struct gp_is_float_t<__half> { static constexpr bool value = true; };

__device__ __forceinline__ int64_t gp_sat(float v, int64_t lo, int64_t hi) {
  if (!(v == v)) return 0;
  if (v <= (float)lo) return lo;
  if (v >= (float)hi) return hi;
  return (int64_t)v;
}
template <typename T> __device__ __forceinline__ T st(float v) {
  if constexpr (std::is_same<T, float>::value) return v;
  else if constexpr (std::is_same<T, __nv_bfloat16>::value) return __float2bfloat16_rn(v);
  else if constexpr (std::is_same<T, __half>::value) return __float2half_rn(v);
  else if constexpr (std::is_same<T, int32_t>::value) return (int32_t)gp_sat(v, INT32_MIN, INT32_MAX);
  else if constexpr (std::is_same<T, int64_t>::value) return gp_sat(v, INT64_MIN, INT64_MAX);
  else return (uint8_t)gp_sat(v, 0, 255);
}
template <typename T> __device__ __forceinline__ T st(int64_t v) {
  if constexpr (gp_is_float_t<T>::value) return st<T>((float)v);
  else return (T)v;
}

/* Call F<T>(args...) for the storage type of a float dtype. */
#define GP_FLOAT_SWITCH(dt, T, ...)                            \
  switch (dt) {                                                \
    case GP_F32: { typedef float T; __VA_ARGS__; } break;       \
    case GP_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; } break; \
    case GP_F16: { typedef __half T; __VA_ARGS__; } break;      \
    default: break;                                            \
  }
#define GP_ANY_SWITCH(dt, T, ...)                              \
  switch (dt) {                                                \
    case GP_F32: { typedef float T; __VA_ARGS__; } break;       \
    case GP_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; } break; \
    case GP_F16: { typedef __half T; __VA_ARGS__; } break;      \
    case GP_I32: { typedef int32_t T; __VA_ARGS__; } break;     \
    case GP_I64: { typedef int64_t T; __VA_ARGS__; } break;     \
    case GP_U8: { typedef uint8_t T; __VA_ARGS__; } break;      \
    default: break;                                            \
  }

#endif
