/* bad_index.cuh: deferred reporting of out-of-range indices on the GPU.
 * Kernels guard every index (never touching memory outside a tensor) and
 * record the first bad value in a device flag, tagged with the id of the
 * launch's descriptor (op, size, what: a small host table in src/cuda.cu).
 * Nothing waits for the kernel: the flag is read at the next synchronization
 * point (gp.sync, item/totable/print, device-to-host copies, stream and
 * event syncs), which raises the error naming the op, the value and the size.
 * Under CUDA graph capture the same ids are baked into the graph, so replays
 * report the same way. */
#ifndef GP_BAD_INDEX_CUH
#define GP_BAD_INDEX_CUH
#include "../src/cuda_internal.h"

__device__ __forceinline__ void gp_report_bad(gp_bad_ref b, int64_t v) {
  if (atomicCAS(b.flag, 0ull, b.id) == 0ull) b.flag[1] = (unsigned long long)v;
}

/* a ref for this launch; arms the check at the next synchronization */
static inline int gp_bad_begin(gp_bad_ref *r, const char *op, int64_t size, const char *what) {
  return gp_cuda_bad_ref(r, op, "index", size, what);
}

/* after the launch: only the launch status (the index check is deferred) */
static inline int gp_bad_end(const char *op) { return gp_cuda_check_launch(op); }
#endif
