/* bad_index.cuh: a device-side flag for out-of-range indices. Kernels guard
 * every index (never touching memory outside a tensor) and record the first
 * bad value seen; the launcher clears the flag before the kernel and reads it
 * after (one small device-to-host copy, which waits for the kernel). */
#ifndef GP_BAD_INDEX_CUH
#define GP_BAD_INDEX_CUH
#include "../src/cuda_internal.h"

static __device__ unsigned long long gp_bad_index[2]; /* flag, value */

__device__ __forceinline__ void gp_report_bad(int64_t v) {
  if (atomicCAS(&gp_bad_index[0], 0ull, 1ull) == 0ull) gp_bad_index[1] = (unsigned long long)v;
}

static inline int gp_bad_clear(const char *op) {
  void *p = 0;
  cudaError_t e = cudaGetSymbolAddress(&p, gp_bad_index);
  if (e == cudaSuccess) e = cudaMemsetAsync(p, 0, sizeof gp_bad_index, gp_cuda_stream());
  if (e != cudaSuccess) return gp_error("%s: CUDA error clearing the index flag: %s", op, cudaGetErrorString(e));
  return GP_OK;
}

/* after the launch: GP_ERR naming the op, the bad value and the size */
static inline int gp_bad_check(const char *op, int64_t size, const char *what) {
  GP_TRY(gp_cuda_check_launch(op));
  unsigned long long h[2] = {0, 0};
  cudaError_t e = cudaMemcpyFromSymbolAsync(h, gp_bad_index, sizeof h, 0, cudaMemcpyDeviceToHost, gp_cuda_stream());
  if (e == cudaSuccess) e = cudaStreamSynchronize(gp_cuda_stream());
  if (e != cudaSuccess) return gp_error("%s: CUDA error: %s", op, cudaGetErrorString(e));
  if (h[0])
    return gp_error("%s: index %lld is out of range for %s of size %lld (nothing outside the tensors was touched)", op,
                    (long long)h[1], what, (long long)size);
  return GP_OK;
}
#endif
